//! The pause a trainer sees when its node's daemon is killed (kill -9) and started again on the
//! same socket, with clients that reconnect (`FEEDSTORE_RECONNECT_TIMEOUT`): a producer thread
//! making 2 MiB samples into a stream, and a reader taking them as they come and dropping each
//! at once, in this process on connections of their own. The store holds `capacity` less
//! 512 MiB of pinned objects when the daemon is killed (a store in use), and the daemon is
//! started again the moment the old one is gone, and again 100 ms after each start that fails
//! (systemd's `Restart=always` with its default `RestartSec`).
//!
//! Per store size: how long the daemon takes to start (to answering on its socket; the default
//! `--prefault true` allocates and zeroes the store after that, on a thread of its own), the
//! mean time between two samples in steady state, and the pause across each restart: the
//! longest time between two samples from the kill on.
//!
//! Before the kills, the same store is taken over three times (`feedstored --takeover`): the
//! pause across each.
//!
//! With `-- --systemd`, the daemon is the shipped unit run by a user instance of systemd of the
//! bench's own (root only): the takeovers are `systemctl reload`, and after each kill systemd
//! starts it again (`Restart=on-failure`, `RestartSec=0` here) with the memory and the object
//! table it kept (`--fd-store`): the store is not freed and made again, and its objects stay.
//!
//! Run: `cargo bench --bench restart` (1 GiB and 16 GiB stores; `-- --quick`: 1 GiB only;
//! `-- --gib N`: N GiB only; `-- --takeover-only`: no kills; `-- --systemd`). The
//! 16 GiB store needs some 17 GiB of memory free: the old store's memory goes only when every
//! mapping of it does (each client lets go of its own the moment it finds the daemon gone).

use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use feedstore_consumer::{
    Client, ConnectOptions, CreateOptions, Delivery, Made, Role, Stream, StreamFeeder,
    StreamOptions,
};
use feedstore_proto::frame::StreamTask;
use feedstore_proto::stream::{Shuffle, StreamSpec, Tail};
use feedstore_testkit::systemd::{FeedstoredUnit, ServiceManager};

const SAMPLE_BYTES: usize = 2 << 20;
const FILL_OBJECT_BYTES: u64 = 64 << 20;
const KILLS: usize = 3;
const STEADY: Duration = Duration::from_secs(2);
const RECONNECT_TIMEOUT_S: &str = "120";

fn main() {
    // SAFETY: set before any other thread of this process starts (none reads the environment
    // meanwhile); every client this bench makes, the stream's included, reads it.
    unsafe { std::env::set_var(feedstore_proto::RECONNECT_ENV, RECONNECT_TIMEOUT_S) };
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    let kills = if args.iter().any(|a| a == "--takeover-only") {
        0
    } else {
        KILLS
    };
    let only: Option<u64> = args
        .iter()
        .position(|a| a == "--gib")
        .and_then(|i| args.get(i + 1)?.parse().ok());
    let systemd = args.iter().any(|a| a == "--systemd");
    let dir = std::env::temp_dir().join(format!("feedstore-restart-bench-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    println!(
        "kill -9 of feedstored mid-stream, started again on the same socket{}: 2 MiB samples, \
         {KILLS} kills per store",
        if systemd {
            " by systemd, with the store it kept (--fd-store)"
        } else {
            ""
        }
    );
    println!();
    println!(
        "| store | daemon start (first, then each restart) | steady time between samples (mean) | pause across a takeover (each) | pause across a restart (each) | starts refused |"
    );
    println!("|---|---|---|---|---|---|");
    let sizes: Vec<u64> = match (only, quick) {
        (Some(gib), _) => vec![gib],
        (None, true) => vec![1],
        (None, false) => vec![1, 16],
    };
    for gib in sizes {
        // The bench's own restarts first, then (with --systemd) systemd's with the store kept,
        // side by side.
        for under_systemd in [false, true] {
            if under_systemd && !systemd {
                continue;
            }
            let dir = dir.join(format!(
                "{gib}g-{}",
                if under_systemd { "systemd" } else { "direct" }
            ));
            std::fs::create_dir_all(&dir).unwrap();
            let host = if under_systemd {
                Host::systemd(&dir, gib << 30)
            } else {
                Host::Direct {
                    socket: dir.join("feedstored.sock"),
                    log: dir.join("feedstored.log"),
                }
            };
            run(&host, gib << 30, kills);
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A daemon started on `socket` (again every 100 ms while it refuses to start); how long its
/// last start took, and how many starts it refused before.
struct Daemon {
    /// The process, where the bench started it itself.
    child: Option<Child>,
    started_in: Duration,
    refused: u32,
}

/// What runs the daemon.
enum Host {
    /// The bench, as a child process, started again by itself after a kill.
    Direct {
        socket: std::path::PathBuf,
        log: std::path::PathBuf,
    },
    /// The shipped unit under systemd (a user instance of the bench's own).
    Systemd {
        manager: ServiceManager,
        unit: FeedstoredUnit,
    },
}

impl Host {
    fn systemd(dir: &Path, capacity: u64) -> Host {
        assert!(
            nix::unistd::geteuid().is_root(),
            "--systemd runs systemd in a mount namespace: root only"
        );
        let manager = ServiceManager::start(dir);
        let unit = FeedstoredUnit::install(
            &manager,
            dir,
            env!("CARGO_BIN_EXE_feedstored"),
            &format!("capacity = \"{}MiB\"", capacity >> 20),
            "RestartSec=0\nEnvironment=FEEDSTORE_LOG=info",
        );
        Host::Systemd { manager, unit }
    }

    fn socket(&self) -> &Path {
        match self {
            Host::Direct { socket, .. } => socket,
            Host::Systemd { unit, .. } => &unit.socket,
        }
    }

    /// The first daemon.
    fn start(&self, capacity: u64) -> Daemon {
        match self {
            Host::Direct { socket, log } => start(socket, log, capacity),
            Host::Systemd { manager, .. } => {
                let began = Instant::now();
                manager.must(&["start", FeedstoredUnit::NAME]);
                Daemon {
                    child: None,
                    started_in: began.elapsed(),
                    refused: 0,
                }
            }
        }
    }

    /// `feedstored --takeover` in place of `old` (`systemctl reload` under systemd): returns
    /// once the old one exited.
    fn take_over(&self, capacity: u64, old: Daemon) -> Daemon {
        match self {
            Host::Direct { socket, log } => take_over(socket, log, capacity, old),
            Host::Systemd { manager, .. } => {
                let before = main_pid(manager);
                manager.must(&["reload", FeedstoredUnit::NAME]);
                wait_gone(before);
                Daemon {
                    child: None,
                    started_in: Duration::ZERO,
                    refused: 0,
                }
            }
        }
    }

    /// `kill -9` of `old`, and a daemon started again (by systemd under it).
    fn kill_and_start(&self, capacity: u64, old: Daemon) -> Daemon {
        match self {
            Host::Direct { socket, log } => {
                let mut child = old.child.expect("started by the bench");
                child.kill().unwrap();
                child.wait().unwrap();
                start(socket, log, capacity)
            }
            Host::Systemd { manager, unit } => {
                let pid = main_pid(manager);
                let restarts = manager.show(FeedstoredUnit::NAME, "NRestarts");
                let began = Instant::now();
                nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL).unwrap();
                manager.wait(FeedstoredUnit::NAME, "NRestarts", |n| n != restarts);
                while UnixStream::connect(&unit.socket).is_err() {
                    assert!(
                        began.elapsed() < Duration::from_secs(120),
                        "feedstored hangs"
                    );
                    std::thread::sleep(Duration::from_millis(1));
                }
                Daemon {
                    child: None,
                    started_in: began.elapsed(),
                    refused: 0,
                }
            }
        }
    }

    /// Stops the daemon for good.
    fn stop(&self, daemon: Daemon) {
        match self {
            Host::Direct { .. } => {
                let mut child = daemon.child.expect("started by the bench");
                let _ = child.kill();
                let _ = child.wait();
            }
            Host::Systemd { manager, .. } => manager.must(&["stop", FeedstoredUnit::NAME]),
        }
    }
}

fn main_pid(manager: &ServiceManager) -> nix::unistd::Pid {
    nix::unistd::Pid::from_raw(
        manager
            .show(FeedstoredUnit::NAME, "MainPID")
            .parse()
            .expect("a main pid"),
    )
}

/// Waits until `pid` is gone.
fn wait_gone(pid: nix::unistd::Pid) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while nix::sys::signal::kill(pid, None).is_ok() {
        assert!(Instant::now() < deadline, "the daemon taken over exits");
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn start(socket: &Path, log: &Path, capacity: u64) -> Daemon {
    let mut refused = 0;
    loop {
        let began = Instant::now();
        let mut child = spawn(socket, log, capacity, &[]);
        loop {
            if UnixStream::connect(socket).is_ok() {
                return Daemon {
                    child: Some(child),
                    started_in: began.elapsed(),
                    refused,
                };
            }
            if child.try_wait().unwrap().is_some() {
                refused += 1;
                assert!(
                    refused < 600,
                    "feedstored did not start: see {}",
                    log.display()
                );
                std::thread::sleep(Duration::from_millis(100));
                break;
            }
            assert!(
                began.elapsed() < Duration::from_secs(120),
                "feedstored hangs"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

/// `feedstored` on `socket` with `capacity` and `extra` flags, its log appended to `log`.
fn spawn(socket: &Path, log: &Path, capacity: u64, extra: &[&str]) -> Child {
    Command::new(env!("CARGO_BIN_EXE_feedstored"))
        .arg("--socket")
        .arg(socket)
        .args(["--capacity", &format!("{}MiB", capacity >> 20)])
        .args(extra)
        .env("FEEDSTORE_LOG", "info")
        .stdout(Stdio::null())
        .stderr(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(log)
                .unwrap(),
        )
        .spawn()
        .expect("spawning feedstored")
}

fn writer(socket: &Path) -> Client {
    ConnectOptions::new(Role::Writer)
        .socket(socket)
        .name("restart bench")
        .connect()
        .expect("connecting to feedstored")
}

fn run(host: &Host, capacity: u64, kills: usize) {
    let socket = host.socket().to_owned();
    let mut daemon = host.start(capacity);
    let first_start = daemon.started_in;
    let spec = StreamSpec {
        name: format!("restart-{}", capacity >> 30),
        records: 1 << 30,
        seed: 1,
        world: 1,
        shuffle: Shuffle::None,
        tail: Tail::Drop,
        epochs: Some(1),
        reshard: None,
    };
    let stop = Arc::new(AtomicBool::new(false));
    let producer = {
        let (socket, spec, stop) = (socket.clone(), spec.clone(), stop.clone());
        std::thread::spawn(move || produce(&socket, &spec, &stop))
    };
    let mut stream = Stream::open(
        &socket,
        &spec,
        0,
        None,
        StreamOptions {
            wait: Duration::from_secs(120),
            ..StreamOptions::default()
        },
    )
    .unwrap();
    let mut times = Vec::new();
    let read_for = |stream: &mut Stream, how_long: Duration, times: &mut Vec<Instant>| {
        let until = Instant::now() + how_long;
        while Instant::now() < until {
            let sample = stream.next_sample().unwrap().expect("an endless stream");
            assert_eq!(sample.len(), SAMPLE_BYTES);
            times.push(Instant::now());
        }
    };
    read_for(&mut stream, STEADY, &mut times);
    let steady = mean_gap(&times);
    // `feedstored --takeover` first: the memory, objects and sockets handed over.
    let mut takeover_pauses = Vec::new();
    for _ in 0..KILLS {
        fill(&socket, capacity - (512 << 20));
        read_for(&mut stream, Duration::from_millis(200), &mut times);
        let from = times.len() - 1;
        daemon = std::thread::scope(|s| {
            let old = daemon;
            let handover = s.spawn(|| host.take_over(capacity, old));
            while !handover.is_finished() {
                read_for(&mut stream, Duration::from_millis(10), &mut times);
            }
            handover.join().unwrap()
        });
        read_for(&mut stream, STEADY, &mut times);
        takeover_pauses.push(longest_gap(&times[from..]));
    }
    let mut pauses = Vec::new();
    let mut starts = Vec::new();
    let mut refused = 0;
    for _ in 0..kills {
        fill(&socket, capacity - (512 << 20));
        read_for(&mut stream, Duration::from_millis(200), &mut times);
        let from = times.len() - 1;
        // The kill and the start again on a thread of their own, as the reader goes on asking
        // for samples (a trainer waiting on its next one is what lets go of the old store).
        daemon = std::thread::scope(|s| {
            let old = daemon;
            let restart = s.spawn(|| host.kill_and_start(capacity, old));
            while !restart.is_finished() {
                read_for(&mut stream, Duration::from_millis(10), &mut times);
            }
            restart.join().unwrap()
        });
        starts.push(daemon.started_in);
        refused += daemon.refused;
        read_for(&mut stream, STEADY, &mut times);
        pauses.push(longest_gap(&times[from..]));
    }
    assert_eq!(stream.reattached(), (KILLS + kills) as u64);
    stop.store(true, Ordering::Relaxed);
    drop(stream);
    producer.join().unwrap();
    host.stop(daemon);
    if let Host::Systemd { unit, .. } = host {
        // Each daemon systemd started after a kill served the store it kept, not a fresh one.
        let log = std::fs::read_to_string(&unit.log).unwrap();
        assert_eq!(
            log.matches("read the store back").count(),
            kills,
            "every restart read the store back: see {}",
            unit.log.display()
        );
    }
    let seconds = |ds: &[Duration]| {
        ds.iter()
            .map(|d| format!("{:.2} s", d.as_secs_f64()))
            .collect::<Vec<_>>()
            .join(", ")
    };
    println!(
        "| {} GiB{} | {:.2} s (then {}) | {:.0} µs | {} | {} | {} |",
        capacity >> 30,
        match host {
            Host::Direct { .. } => "",
            Host::Systemd { .. } => ", systemd, --fd-store",
        },
        first_start.as_secs_f64(),
        seconds(&starts),
        steady.as_secs_f64() * 1e6,
        seconds(&takeover_pauses),
        seconds(&pauses),
        refused
    );
}

/// The longest time between two consecutive samples.
fn longest_gap(times: &[Instant]) -> Duration {
    times
        .windows(2)
        .map(|w| w[1] - w[0])
        .max()
        .unwrap_or_default()
}

/// `feedstored --takeover` in place of `old`: returns once the old one exited (cleanly).
fn take_over(socket: &Path, log: &Path, capacity: u64, old: Daemon) -> Daemon {
    let child = spawn(socket, log, capacity, &["--takeover"]);
    let status = old.child.expect("started by the bench").wait().unwrap();
    assert!(
        status.success(),
        "the daemon taken over exits cleanly: see {}",
        log.display()
    );
    Daemon {
        child: Some(child),
        started_in: Duration::ZERO,
        refused: 0,
    }
}

/// Pins objects of 64 MiB until `bytes` of the store are used (what a store in use holds).
fn fill(socket: &Path, bytes: u64) {
    let client = writer(socket);
    let mut used = client.stats().unwrap().used_bytes;
    let pinned = CreateOptions {
        pin: true,
        ..CreateOptions::default()
    };
    while used + FILL_OBJECT_BYTES <= bytes {
        let mut w = client.create_with(FILL_OBJECT_BYTES, pinned).unwrap();
        w.as_mut_slice().fill(0x5a);
        w.seal().unwrap();
        used += FILL_OBJECT_BYTES;
    }
}

/// Makes rank 0's samples until `stop`, going on by itself across restarts.
fn produce(socket: &Path, spec: &StreamSpec, stop: &AtomicBool) {
    let client = writer(socket);
    let feeder = StreamFeeder::join(&client, spec, 16, &[StreamTask { rank: 0, seq: 0 }]).unwrap();
    while !stop.load(Ordering::Relaxed) {
        let Some(tasks) = feeder.take(16, Duration::from_millis(100)).unwrap() else {
            return;
        };
        let mut made = Vec::new();
        for task in tasks {
            let mut w = match client.create(SAMPLE_BYTES as u64) {
                Ok(w) => w,
                Err(e) => panic!("create: {e}"),
            };
            w.as_mut_slice().fill(task.seq as u8);
            made.push(Delivery {
                task,
                record: spec.record_at(task.rank, task.seq),
                key: 0,
                made: Made::Written(w),
            });
        }
        // Per sample Ok, or Stale (the daemon that handed it out is gone): anything else stops.
        for r in feeder.put(made).unwrap() {
            if let Err(e) = r {
                assert!(matches!(e, feedstore_consumer::Error::Stale { .. }), "{e}");
            }
        }
    }
}

/// The mean time between two consecutive samples (they come in bursts: the producer puts 16
/// at a time).
fn mean_gap(times: &[Instant]) -> Duration {
    (times[times.len() - 1] - times[0]) / (times.len() as u32 - 1)
}
