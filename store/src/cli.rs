//! The `feedstored` command line.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;

use crate::config::{DaemonConfig, FileConfig, parse_bytes, parse_huge_pages};
use crate::daemon::Daemon;

/// feedstored: the per-node shared-memory object store daemon.
///
/// Owns the node's shared-memory segments and serves producers and trainers over a Unix socket.
/// Objects are written once into shared memory and read in place by handle. Stop it with
/// SIGTERM or Ctrl-C; the socket file is removed on the way out.
#[derive(Debug, Parser)]
#[command(name = "feedstored", version, about, long_about)]
pub struct Args {
    /// Unix socket to listen on [default: $FEEDSTORE_SOCKET or /tmp/feedstore-<uid>.sock].
    #[arg(long, value_name = "PATH")]
    pub socket: Option<PathBuf>,

    /// Total shared memory to own, e.g. 512MiB or 8GiB [default: 2GiB, or a quarter of RAM if
    /// less]. Must fit in available memory.
    #[arg(long, value_name = "SIZE", value_parser = parse_bytes)]
    pub capacity: Option<u64>,

    /// Split the capacity into segments of this size (the largest object is one segment)
    /// [default: one segment].
    #[arg(long, value_name = "SIZE", value_parser = parse_bytes)]
    pub segment_size: Option<u64>,

    /// Huge pages: `auto` uses them when enough are reserved, `on` refuses to start without
    /// them, `off` never uses them [default: auto].
    #[arg(long, value_name = "MODE")]
    pub huge_pages: Option<String>,

    /// Allocate all shared memory at start so writes never pay first-touch page faults
    /// [default: true].
    #[arg(long, value_name = "BOOL")]
    pub prefault: Option<bool>,

    /// This node's id in object handles [default: a hash of the host name].
    #[arg(long, value_name = "ID")]
    pub node_id: Option<u32>,

    /// Let members of this group connect (socket mode 0660 instead of 0600).
    #[arg(long, value_name = "GROUP")]
    pub socket_group: Option<String>,

    /// Also allow this uid to connect (repeatable). The daemon's own uid and root always may.
    #[arg(long = "allow-uid", value_name = "UID")]
    pub allow_uids: Vec<u32>,

    /// Async worker threads; 1 serves everything on one thread, the lowest latency [default: 1].
    #[arg(long, value_name = "N")]
    pub worker_threads: Option<usize>,

    /// Read settings from this TOML file; flags override it.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
}

impl Args {
    /// Resolves defaults, the config file and the flags into one configuration.
    pub fn resolve(self) -> Result<DaemonConfig, crate::config::ConfigError> {
        let mut cfg = DaemonConfig::default();
        if let Some(path) = &self.config {
            FileConfig::load(path)?.apply(&mut cfg)?;
        }
        if let Some(v) = self.socket {
            cfg.socket = v;
        }
        if let Some(v) = self.capacity {
            cfg.capacity_bytes = v;
            cfg.segment_bytes = v;
        }
        if let Some(v) = self.segment_size {
            cfg.segment_bytes = v;
        }
        if let Some(v) = &self.huge_pages {
            cfg.huge_pages = parse_huge_pages(v)?;
        }
        if let Some(v) = self.prefault {
            cfg.prefault = v;
        }
        if let Some(v) = self.node_id {
            cfg.node_id = v;
        }
        if let Some(v) = self.socket_group {
            cfg.socket_group = Some(v);
        }
        if !self.allow_uids.is_empty() {
            cfg.allow_uids = self.allow_uids;
        }
        if let Some(v) = self.worker_threads {
            cfg.worker_threads = v;
        }
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
    let filter = std::env::var("FEEDSTORE_LOG")
        .or_else(|_| std::env::var("RUST_LOG"))
        .unwrap_or_else(|_| default.into());
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
        .with_writer(std::io::stderr)
        .try_init();
}

/// Prints an error and its causes on one line.
pub fn error_line(err: &dyn std::error::Error) -> String {
    let mut line = err.to_string();
    let mut source = err.source();
    while let Some(s) = source {
        line.push_str(": ");
        line.push_str(&s.to_string());
        source = s.source();
    }
    line
}

/// `feedstored`'s `main`.
pub fn main() -> ExitCode {
    let args = Args::parse();
    init_logging();
    let config = match args.resolve() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("feedstored: error: {}", error_line(&e));
            return ExitCode::from(2);
        }
    };
    let daemon = match Daemon::bind(&config) {
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
