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
    /// other settings this one's; in a cluster, give it the same --listen, --peers and secret.
    /// Refused, with the running daemon serving on, when no daemon answers, it runs as another
    /// uid, the node id differs, it cannot hand over to this build, another takeover is under
    /// way, or its requests under way do not finish or wait within 5 s (try again). `--takeover=auto` takes
    /// over a daemon that answers on the socket and otherwise starts afresh (a container whose
    /// every start should do whichever applies: a Kubernetes DaemonSet's pods).
    #[arg(
        long,
        value_enum,
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "always",
        value_name = "WHEN"
    )]
    pub takeover: Option<Takeover>,

    /// After handing over to a successor, stay (idle, holding nothing) until SIGTERM or
    /// SIGINT, then exit 0, instead of exiting at once: for a supervisor that would start an
    /// exited daemon again (a Kubernetes pod's container), which here would take the store
    /// back from the successor. Exits 1 if nothing listens on the socket any more (the
    /// successor went), so that the supervisor starts a daemon again.
    #[arg(long)]
    pub stay_after_handover: bool,

    /// Create this file once the daemon serves, and remove it when it stops serving (handed
    /// over or stopped): a readiness check for this daemon rather than whichever serves on the
    /// socket (`test -e FILE` in a Kubernetes readiness probe). A file of its own: it is
    /// removed at start too, one left by a daemon killed before it could.
    #[arg(long, value_name = "FILE")]
    pub ready_file: Option<PathBuf>,

    /// Serve in the background: the command returns once the daemon serves (exit status 0,
    /// its pid printed) or failed to (1, with the reason). For `ExecReload=feedstored
    /// --takeover --detach` under systemd, whose reload waits for the command to end; the
    /// daemon's log goes where this command's standard error goes.
    #[arg(long)]
    pub detach: bool,
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
    let (takeover, detach, stay) = (args.takeover, args.detach, args.stay_after_handover);
    let ready_file = args.ready_file.clone();
    let config = match args.resolve() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("feedstored: error: {}", error_line(&e));
            return ExitCode::from(2);
        }
    };
    if let Some(path) = &ready_file {
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => std::path::Path::new("."),
        };
        if !dir.is_dir() {
            eprintln!(
                "feedstored: error: --ready-file {}: {} is not a directory",
                path.display(),
                dir.display()
            );
            return ExitCode::from(2);
        }
        // (One left by a daemon killed before it could remove it says nothing about this one.)
        let _ = std::fs::remove_file(path);
    }
    // Before anything starts a thread: the parent waits for the child's word and exits.
    let detached = if detach {
        match detach::fork() {
            Ok(detach::Side::Parent(code)) => return code,
            Ok(detach::Side::Child(word)) => Some(word),
            Err(e) => {
                let why = if e == nix::errno::Errno::EBUSY {
                    "this process runs threads already (--detach is for feedstored's own command \
                     line, not an embedding)"
                        .to_owned()
                } else {
                    e.to_string()
                };
                eprintln!("feedstored: error: cannot detach: {why}");
                return ExitCode::FAILURE;
            }
        }
    } else {
        None
    };
    // Said once: serving, or why not (a failure before serving included).
    let word = std::sync::Arc::new(std::sync::Mutex::new(detached));
    let say = {
        let word = word.clone();
        move |outcome: Result<(), &str>| {
            let taken = word.lock().unwrap_or_else(|e| e.into_inner()).take();
            match (taken, outcome) {
                (Some(w), Ok(())) => w.serving(),
                (Some(w), Err(why)) => w.failed(why),
                (None, Err(why)) => eprintln!("feedstored: error: {why}"),
                (None, Ok(())) => {}
            }
        }
    };
    init_logging();
    let takeover = match takeover {
        Some(Takeover::Auto) => {
            // Only nothing listening is "no daemon": another refusal (permission) goes to the
            // takeover, which says why.
            let answers = crate::daemon::listened_on(&config.socket);
            if !answers {
                tracing::info!(socket = %config.socket.display(), "--takeover=auto: no daemon answers on the socket; starting afresh");
            }
            answers
        }
        Some(Takeover::Always) => true,
        None => false,
    };
    let started = if takeover {
        Daemon::take_over(&config)
    } else {
        Daemon::bind(&config)
    };
    let daemon = match started {
        Ok(d) => d,
        Err(e) => {
            // (Detached, the waiting command says it.)
            say(Err(&error_line(&e)));
            return ExitCode::FAILURE;
        }
    };
    let handed_over = daemon.shared().handoff.done_watch();
    let ready = ready_file.clone();
    let serving = say.clone();
    let daemon = daemon.on_serving(move || {
        let status = if takeover {
            "serving (took over from the daemon before)"
        } else {
            "serving"
        };
        crate::notify::ready(status);
        serving(Ok(()));
        if let Some(path) = &ready
            && let Err(e) = std::fs::write(path, b"")
        {
            tracing::error!(path = %path.display(), error = %e, "cannot create the --ready-file");
        }
    });
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
    if let Some(path) = &ready_file {
        let _ = std::fs::remove_file(path);
    }
    match result {
        Ok(()) if stay && *handed_over.borrow() => {
            tracing::info!(
                "handed over: staying until SIGTERM or SIGINT (--stay-after-handover), or \
                 until no daemon answers on the socket"
            );
            stay_until_stopped(&config.socket)
        }
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            say(Err(&error_line(&e)));
            ExitCode::FAILURE
        }
    }
}

/// When `--takeover` takes the running daemon over.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Takeover {
    /// Always: refused when no daemon answers.
    Always,
    /// When a daemon answers on the socket; otherwise start afresh.
    Auto,
}

/// A daemon handed over, staying: exits 0 at SIGTERM or SIGINT taken here, or 1 once nothing
/// listens on `socket` (its successor went: a supervisor starting this one again gets a daemon
/// serving). The daemon's runtime is gone; the signals are blocked in this thread and taken
/// synchronously, and get their default action back, so one that reaches another thread still
/// alive (a pre-fault finishing) ends the process by the signal instead of being lost.
fn stay_until_stopped(socket: &std::path::Path) -> ExitCode {
    use nix::sys::signal::{SigHandler, SigSet, Signal, signal};
    let mut set = SigSet::empty();
    set.add(Signal::SIGTERM);
    set.add(Signal::SIGINT);
    if set.thread_block().is_err() {
        return ExitCode::FAILURE;
    }
    for s in [Signal::SIGTERM, Signal::SIGINT] {
        // SAFETY: the default action; no handler of this process runs any more (its runtime,
        // which installed them, is gone).
        let _ = unsafe { signal(s, SigHandler::SigDfl) };
    }
    let every = libc::timespec {
        tv_sec: 5,
        tv_nsec: 0,
    };
    loop {
        // SAFETY: `set` and `every` are valid for the call; no siginfo is asked for.
        let got = unsafe { libc::sigtimedwait(set.as_ref(), std::ptr::null_mut(), &every) };
        if got > 0 {
            tracing::info!(signal = got, "stopping");
            return ExitCode::SUCCESS;
        }
        if !crate::daemon::listened_on(socket) {
            tracing::warn!(
                socket = %socket.display(),
                "no daemon answers on the socket any more (the successor went): exiting so \
                 that this one is started again"
            );
            return ExitCode::FAILURE;
        }
    }
}

/// `--detach`: the command forks before anything else starts; the parent waits for the child's
/// word through a pipe (serving, or why not) and exits with it.
mod detach {
    use std::io::{Read, Write};
    use std::os::fd::OwnedFd;
    use std::process::ExitCode;

    /// Which side of the fork this is.
    pub(super) enum Side {
        /// The command's process: its exit status, once the child said how it went.
        Parent(ExitCode),
        /// The daemon: says how it went through this.
        Child(Word),
    }

    /// The child's end of the pipe.
    pub(super) struct Word(OwnedFd);

    impl Word {
        pub(super) fn serving(self) {
            let _ = std::fs::File::from(self.0).write_all(b"serving");
        }

        pub(super) fn failed(self, why: &str) {
            let _ = std::fs::File::from(self.0).write_all(why.as_bytes());
        }
    }

    pub(super) fn fork() -> nix::Result<Side> {
        // Only a process of one thread may go on after a fork: `feedstored`'s main is one
        // here; an embedding that calls `main_from` from a threaded program gets an error.
        let threads = std::fs::read_dir("/proc/self/task").map_or(1, |d| d.count());
        if threads != 1 {
            return Err(nix::errno::Errno::EBUSY);
        }
        let (read, write) = nix::unistd::pipe()?;
        // SAFETY: called from `main` before any thread is started (no logging, no runtime
        // yet), so the child is a copy of a single-threaded process and may go on as it likes.
        match unsafe { nix::unistd::fork() }? {
            nix::unistd::ForkResult::Parent { child } => {
                drop(write);
                let mut said = String::new();
                // (Bounded: the child writes one short line, then closes.)
                let _ = std::fs::File::from(read)
                    .take(64 << 10)
                    .read_to_string(&mut said);
                Ok(Side::Parent(if said == "serving" {
                    println!("feedstored serving (pid {child})");
                    ExitCode::SUCCESS
                } else if said.is_empty() {
                    eprintln!(
                        "feedstored: error: the daemon (pid {child}) exited before it served \
                         (its log says why)"
                    );
                    ExitCode::FAILURE
                } else {
                    eprintln!("feedstored: error: {said}");
                    ExitCode::FAILURE
                }))
            }
            nix::unistd::ForkResult::Child => {
                drop(read);
                // Its own session: a terminal closing after the command returned does not
                // take the daemon with it. Nothing to read, nothing printed: standard input
                // and output go to /dev/null (a caller reading the command's output sees it
                // end when the command does); the log stays on standard error.
                let _ = nix::unistd::setsid();
                if let Ok(null) = std::fs::OpenOptions::new()
                    .read(true)
                    .write(true)
                    .open("/dev/null")
                {
                    use std::os::fd::AsRawFd;
                    for fd in [0, 1] {
                        // SAFETY: dup2 onto the standard descriptors of this process, which
                        // nothing else holds as an owned descriptor.
                        unsafe { libc::dup2(null.as_raw_fd(), fd) };
                    }
                }
                Ok(Side::Child(Word(write)))
            }
        }
    }
}
