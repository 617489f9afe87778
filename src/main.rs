//! `feedstore`: the command-line front of the feedstore object store.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod check;
mod demo;
mod produce;
mod stat;
mod streams;
mod top;

/// feedstore: a per-node shared-memory object store that keeps training GPUs fed.
///
/// `feedstored` (a separate binary) owns the node's shared memory; this tool inspects it and runs
/// the end-to-end demo.
#[derive(Debug, Parser)]
#[command(name = "feedstore", version, long_version = feedstore_proto::frame::LONG_VERSION, about, long_about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Print a running daemon's statistics: capacity, used, objects, leases, clients,
    /// fragmentation, evictions.
    Stat(stat::Args),
    /// The main job: the seed's experiment on this machine. Builds (once) a multimodal SFT data set
    /// from embedded real photos and easy-VQA, serves its images behind S3-like latency, and
    /// feeds the same trainer loop with a serial loader, concurrent workers, a prefetching loader
    /// and feedstore (an embedded daemon unless --socket is given); prints each one's wait-time
    /// ratio and samples/s, feedstore's per-rank figures, stage profile and store memory, and
    /// writes a JSON report.
    Demo(Box<demo::Args>),
    /// Exercise the store itself end to end: a producer thread writes large objects through the
    /// real socket and shared memory, reader threads verify every byte; then small round trips.
    Check(check::Args),
    /// Read a manifest (JSONL, or a JSON array of records), WebDataset shards or Parquet files;
    /// fetch, decode, resize, normalise and tokenize each record, and write
    /// each sample once into the running daemon's shared memory. Bad records go to a rejects
    /// file; the run ends with a stage profile naming the bottleneck.
    Produce(Box<produce::Args>),
    /// List the daemon's streams, or close one (an ended stream stays listed, holding its ready
    /// samples, until closed or expired).
    Stream(streams::Args),
    /// Watch the streams live: per stream and rank, the trainer's wait-time ratio over the last
    /// interval and since its first request, samples/s, lag, the producers' verdict (fetch-,
    /// CPU- or trainer-bound) and the stream's (compute- or data-bound). Refreshes in place on a
    /// terminal, prints one view per interval otherwise.
    Top(top::Args),
}

/// Lets `feedstore stat | head -3` end quietly, as Unix tools do: Rust ignores `SIGPIPE`, so a
/// write to a closed pipe would otherwise fail and `println!` panic.
fn restore_sigpipe() {
    use nix::sys::signal::{SigHandler, Signal, signal};
    // SAFETY: installs the default disposition, no handler: nothing runs in signal context,
    // and no other thread exists yet to race on the disposition.
    let _ = unsafe { signal(Signal::SIGPIPE, SigHandler::SigDfl) };
}

/// A daemon embedded in `demo` or `check`, its socket in a directory of its own under the
/// temporary directory (the daemon makes it 0700 and refuses one another user made), removed
/// when the daemon stops.
struct EmbeddedDaemon {
    daemon: Option<feedstore_store::daemon::DaemonHandle>,
    dir: PathBuf,
}

impl EmbeddedDaemon {
    /// Starts one with `capacity_bytes` of shared memory; returns its socket.
    fn start(what: &str, capacity_bytes: u64) -> anyhow::Result<(PathBuf, EmbeddedDaemon)> {
        use anyhow::Context;
        let dir = std::env::temp_dir().join(format!("feedstore-{what}-{}", std::process::id()));
        let socket = dir.join("feedstore.sock");
        let config = feedstore_store::config::DaemonConfig {
            socket: socket.clone(),
            capacity_bytes,
            segment_bytes: capacity_bytes,
            ..feedstore_store::config::DaemonConfig::default()
        };
        let daemon = feedstore_store::daemon::Daemon::bind(&config)
            .context("starting the embedded daemon")?
            .spawn();
        let embedded = EmbeddedDaemon {
            daemon: Some(daemon),
            dir,
        };
        Ok((socket, embedded))
    }
}

impl Drop for EmbeddedDaemon {
    fn drop(&mut self) {
        if let Some(daemon) = self.daemon.take() {
            daemon.stop();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The socket flag shared by subcommands.
#[derive(Debug, clap::Args)]
struct SocketArg {
    /// The daemon's socket [default: $FEEDSTORE_SOCKET, else this user's daemon
    /// ($XDG_RUNTIME_DIR/feedstore/feedstore.sock or /tmp/feedstore-<uid>/feedstore.sock; root:
    /// /run/feedstore/feedstore.sock), else the system daemon's].
    #[arg(long, value_name = "PATH")]
    socket: Option<PathBuf>,
}

impl SocketArg {
    fn path(&self) -> PathBuf {
        self.socket
            .clone()
            .unwrap_or_else(feedstore_proto::client_socket_path)
    }

    /// A connection for a tool that reads the daemon's lists and statistics, never an object's
    /// bytes (nor writes any: it builds no page tables of the store).
    fn inspect(
        &self,
        role: feedstore_proto::Role,
        name: &str,
    ) -> Result<feedstore_consumer::Client, feedstore_consumer::Error> {
        feedstore_consumer::ConnectOptions::new(role)
            .socket(self.path())
            .name(name)
            .populate(false)
            .connect()
    }
}

/// The hidden first argument that makes this binary run the daemon (`feedstored`'s own command
/// line follows): `feedstore demo --nodes` starts each node's daemon in its namespace with it,
/// so the demo needs no second binary built beside it.
const RUN_DAEMON: &str = "__feedstored";

fn main() -> ExitCode {
    let mut args = std::env::args_os();
    if args.nth(1).is_some_and(|a| a == RUN_DAEMON) {
        return feedstore_store::cli::main_from(
            std::iter::once(std::ffi::OsString::from("feedstored")).chain(args),
        );
    }
    restore_sigpipe();
    let cli = Cli::parse();
    // Log lines go above `feedstore produce`'s progress bar, never through it.
    feedstore_store::cli::init_logging_to("warn", || produce::AroundTheBar);
    let result = match cli.command {
        Command::Stat(args) => stat::run(args),
        Command::Top(args) => top::run(args),
        Command::Demo(args) => demo::run(*args),
        Command::Check(args) => check::run(args),
        Command::Produce(args) => produce::run_produce(*args),
        Command::Stream(args) => streams::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // Each cause once: an error that already says its source's words (after a colon, as
            // `what: why` does) is not followed by them again.
            let mut line = String::new();
            for cause in e.chain().map(|c| c.to_string()) {
                if !line.contains(&format!(": {cause}")) {
                    if !line.is_empty() {
                        line.push_str(": ");
                    }
                    line.push_str(&cause);
                }
            }
            eprintln!("feedstore: error: {line}");
            ExitCode::FAILURE
        }
    }
}
