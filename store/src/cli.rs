//! The `feedstored` command line.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;

use crate::config::{DaemonConfig, Settings};
use crate::daemon::Daemon;

/// feedstored: the per-node shared-memory object store daemon.
///
/// Owns the node's shared-memory segments and serves producers and trainers over a Unix socket.
/// Objects are written once into shared memory and read in place by handle. Stop it with
/// SIGTERM or Ctrl-C; the socket file is removed on the way out.
#[derive(Debug, Parser)]
#[command(name = "feedstored", version, long_version = feedstore_proto::frame::LONG_VERSION, about, long_about)]
pub struct Args {
    /// The daemon's settings.
    #[command(flatten)]
    pub settings: Settings,

    /// Read settings from this TOML file (the flags' names as keys, e.g. `capacity = "8GiB"`);
    /// flags override it.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,

    /// Take over from the feedstored serving on the socket (an upgrade, a reload): receive its
    /// shared memory, objects and listening sockets, then it exits. Every handle, view and
    /// reservation stays valid; clients reconnect by themselves (FEEDSTORE_RECONNECT_TIMEOUT)
    /// and their streams go on. Run it as the running daemon's uid or root, with the same node
    /// id; the memory (--capacity, --segment-size, huge pages) is the running daemon's, the
    /// other settings this one's. Refused, with the running daemon serving on, when no daemon
    /// answers, it runs as another uid, the node id differs, it is part of a cluster (not yet
    /// supported), or it cannot hand over to this build.
    #[arg(long)]
    pub takeover: bool,
}

impl Args {
    /// Resolves defaults, the config file and the flags into one configuration.
    pub fn resolve(self) -> Result<DaemonConfig, crate::config::ConfigError> {
        let mut cfg = DaemonConfig::default();
        if let Some(path) = &self.config {
            Settings::load(path)?.apply(&mut cfg)?;
        }
        self.settings.apply(&mut cfg)?;
        cfg.validate()?;
        Ok(cfg)
    }
}

/// Installs the log subscriber: `FEEDSTORE_LOG` (or `RUST_LOG`) filters, default `info`.
pub fn init_logging() {
    init_logging_with_default("info");
}

/// Installs the log subscriber with another default level (tools that print their own output
/// default to `warn`).
pub fn init_logging_with_default(default: &str) {
    init_logging_to(default, std::io::stderr);
}

/// Installs the log subscriber writing to `writer` (stderr, or stderr around a progress bar),
/// one write per event.
pub fn init_logging_to<W>(default: &str, writer: W)
where
    W: for<'w> tracing_subscriber::fmt::MakeWriter<'w> + Send + Sync + 'static,
{
    let filter = std::env::var("FEEDSTORE_LOG")
        .or_else(|_| std::env::var("RUST_LOG"))
        .unwrap_or_else(|_| default.into());
    use std::io::IsTerminal;
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
        .with_writer(writer)
        // Colours for a person at a terminal, plain text for a log file or journal.
        .with_ansi(std::io::stderr().is_terminal())
        .try_init();
}

/// Prints an error and its causes on one line.
pub fn error_line(err: &dyn std::error::Error) -> String {
    feedstore_proto::error_chain(err)
}

/// `feedstored`'s `main`.
pub fn main() -> ExitCode {
    main_from(std::env::args_os())
}

/// [`main`] with the command line given (the program name first): `feedstore demo --nodes`
/// runs its nodes' daemons through it.
pub fn main_from(args: impl IntoIterator<Item = std::ffi::OsString>) -> ExitCode {
    let args = Args::parse_from(args);
    init_logging();
    let takeover = args.takeover;
    let config = match args.resolve() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("feedstored: error: {}", error_line(&e));
            return ExitCode::from(2);
        }
    };
    let started = if takeover {
        Daemon::take_over(&config)
    } else {
        Daemon::bind(&config)
    };
    let daemon = match started {
        Ok(d) => d,
        Err(e) => {
            eprintln!("feedstored: error: {}", error_line(&e));
            return ExitCode::FAILURE;
        }
    };
    let result = daemon.serve(async {
        use tokio::signal::unix::{SignalKind, signal};
        let (Ok(mut term), Ok(mut int)) = (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) else {
            tracing::error!("cannot install signal handlers; stop with SIGKILL");
            return std::future::pending().await;
        };
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM received"),
            _ = int.recv() => tracing::info!("SIGINT received"),
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("feedstored: error: {}", error_line(&e));
            ExitCode::FAILURE
        }
    }
}
