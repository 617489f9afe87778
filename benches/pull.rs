//! Cross-node pull vs the link it runs on, measured side by side in one run on one veth link
//! between two network namespaces:
//!
//! 1. the link's own speed: a plain TCP stream from a thread in namespace A to one in B, and a
//!    plain TCP request/response of the same object sizes (send 8 bytes, read the object's bytes
//!    into a warm buffer) — the best a pull could do;
//! 2. feedstore's remote get: objects of 4 MiB and 64 MiB made on node A's `feedstored`, read by
//!    a client of node B's `feedstored`, which pulls each (every record authenticated with GMAC
//!    under the connection's keys) into B's shared memory: throughput and per-get p50/p99, one get at a time and in batches
//!    of 8 (several objects in flight over several connections);
//! 3. Ray across two raylets, if Ray is installed (it is not on the machine the figures in
//!    BENCHMARKS.md come from).
//!
//! Needs root (it makes the namespaces, and removes them at the end). Run:
//! `cargo bench --bench pull` (add `-- --quick` for a short run).

#[path = "../tests/common/netns.rs"]
mod netns;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use feedstore_consumer::{Client, ConnectOptions, Handle, Role};
use netns::Lan;

const PORT: u16 = 7070;
const PLAIN_PORT: u16 = 7100;

fn main() {
    if !nix::unistd::geteuid().is_root() {
        println!("pull bench skipped: it needs root to make network namespaces");
        return;
    }
    let quick = std::env::args().any(|a| a == "--quick");
    let lan = Lan::new("b", 2);
    let dir = std::env::temp_dir().join(format!("feedstore-pull-bench-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let secret = dir.join("secret");
    std::fs::write(&secret, "the-cluster-secret-of-this-bench\n").unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();

    let total_bytes: u64 = if quick { 256 << 20 } else { 1 << 30 };
    println!(
        "cross-node pull over one veth link, {} per size (Linux veth between two namespaces)",
        mib(total_bytes)
    );
    println!();
    let link = plain_stream(&lan, total_bytes);
    println!(
        "plain TCP stream A -> B           {:>8.0} MB/s   (the link's own speed)",
        link
    );

    let capacity = format!("{}MiB", (total_bytes >> 20) * 2 + 256);
    let a = Daemon::start(&lan, &dir, 0, &capacity, &secret, None);
    let b = Daemon::start(&lan, &dir, 1, &capacity, &secret, Some(&lan.ip(0)));
    let writer = connect(&a.socket, Role::Writer);
    let reader = connect(&b.socket, Role::Reader);
    let deadline = Instant::now() + Duration::from_secs(20);
    while reader.stats().unwrap().peers_up < 1 {
        assert!(Instant::now() < deadline, "B never saw A");
        std::thread::sleep(Duration::from_millis(20));
    }

    println!();
    println!(
        "{:>6} {:>28} {:>10} {:>10} {:>10} {:>12}",
        "size", "transfer", "MB/s", "p50 ms", "p99 ms", "vs stream"
    );
    for size in [4u64 << 20, 64 << 20] {
        let count = (total_bytes / size).max(4) as usize;
        let plain = plain_request_response(&lan, size, count);
        report(size, "plain TCP request/response", &plain, link);
        let handles = make_objects(&writer, size, count);
        let one = remote_gets(&reader, &handles[..count / 2], 1);
        report(size, "feedstore remote get", &one, link);
        let batched = remote_gets(&reader, &handles[count / 2..], 8);
        report(size, "feedstore get_batch of 8", &batched, link);
        writer.delete_batch(&handles).unwrap();
    }
    let s = reader.stats().unwrap();
    println!();
    println!(
        "B pulled {} objects ({}), {} failures; A served {} ranges",
        s.pulls,
        mib(s.pulled_bytes),
        s.pull_failures_unreachable
            + s.pull_failures_timeout
            + s.pull_failures_missing
            + s.pull_failures_corrupt
            + s.pull_failures_full,
        writer.stats().unwrap().served_reads
    );
    let ray = Command::new("python3")
        .args(["-c", "import ray"])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !ray {
        println!("Ray: not installed here, so no Ray figures in this run");
    }
    drop((a, b));
    let _ = std::fs::remove_dir_all(&dir);
}

fn mib(bytes: u64) -> String {
    format!("{} MiB", bytes >> 20)
}

/// Per-transfer times of one way of moving objects.
struct Run {
    bytes: u64,
    wall: Duration,
    each: Vec<Duration>,
}

fn report(size: u64, what: &str, run: &Run, link_mb_s: f64) {
    let mut each = run.each.clone();
    each.sort();
    let pick = |q: f64| each[((each.len() - 1) as f64 * q).round() as usize].as_secs_f64() * 1e3;
    let mb_s = run.bytes as f64 / run.wall.as_secs_f64() / 1e6;
    println!(
        "{:>6} {:>28} {:>10.0} {:>10.2} {:>10.2} {:>11.2}x",
        mib(size),
        what,
        mb_s,
        pick(0.5),
        pick(0.99),
        mb_s / link_mb_s
    );
}

/// A plain TCP stream of `total` bytes from A to B, in MB/s at the receiver.
fn plain_stream(lan: &Lan, total: u64) -> f64 {
    let (b_ns, a_ns) = (lan.nodes[1].clone(), lan.nodes[0].clone());
    let addr = format!("{}:{PLAIN_PORT}", lan.ip(1));
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let receiver = std::thread::spawn(move || {
        netns::enter(&b_ns);
        let listener = TcpListener::bind(format!("0.0.0.0:{PLAIN_PORT}")).unwrap();
        ready_tx.send(()).unwrap();
        let (mut s, _) = listener.accept().unwrap();
        let mut buf = vec![0u8; 256 << 10];
        let mut got = 0u64;
        let mut started = None;
        while got < total {
            let n = s.read(&mut buf).unwrap();
            assert!(n > 0, "sender stopped early");
            started.get_or_insert_with(Instant::now);
            got += n as u64;
        }
        got as f64 / started.unwrap().elapsed().as_secs_f64() / 1e6
    });
    ready_rx.recv().unwrap();
    let sender = std::thread::spawn(move || {
        netns::enter(&a_ns);
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_nodelay(true).unwrap();
        let buf = vec![7u8; 4 << 20];
        let mut sent = 0u64;
        while sent < total {
            s.write_all(&buf).unwrap();
            sent += buf.len() as u64;
        }
    });
    sender.join().unwrap();
    receiver.join().unwrap()
}

/// `count` objects of `size` bytes each sent A -> B over one plain TCP connection, each asked
/// for by an 8-byte request and read into a warm buffer.
fn plain_request_response(lan: &Lan, size: u64, count: usize) -> Run {
    let (b_ns, a_ns) = (lan.nodes[1].clone(), lan.nodes[0].clone());
    let addr = format!("{}:{}", lan.ip(0), PLAIN_PORT + 1);
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let server = std::thread::spawn(move || {
        netns::enter(&a_ns);
        let listener = TcpListener::bind(format!("0.0.0.0:{}", PLAIN_PORT + 1)).unwrap();
        ready_tx.send(()).unwrap();
        let (mut s, _) = listener.accept().unwrap();
        s.set_nodelay(true).unwrap();
        let object = vec![3u8; size as usize];
        let mut ask = [0u8; 8];
        while s.read_exact(&mut ask).is_ok() {
            s.write_all(&object).unwrap();
        }
    });
    ready_rx.recv().unwrap();
    let client = std::thread::spawn(move || {
        netns::enter(&b_ns);
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_nodelay(true).unwrap();
        // Warm, as a store's pre-faulted segment is.
        let mut buf = vec![1u8; size as usize];
        let mut each = Vec::with_capacity(count);
        let started = Instant::now();
        for _ in 0..count {
            let t = Instant::now();
            s.write_all(&[0u8; 8]).unwrap();
            for piece in buf.chunks_mut(256 << 10) {
                s.read_exact(piece).unwrap();
            }
            each.push(t.elapsed());
        }
        Run {
            bytes: size * count as u64,
            wall: started.elapsed(),
            each,
        }
    });
    let run = client.join().unwrap();
    server.join().unwrap();
    run
}

fn make_objects(writer: &Client, size: u64, count: usize) -> Vec<Handle> {
    (0..count)
        .map(|i| {
            let mut w = writer.create(size).unwrap();
            w.as_mut_slice().fill(i as u8);
            w.seal().unwrap()
        })
        .collect()
}

/// Gets every handle on B (each a pull from A), `batch` at a time; checks a byte of each.
fn remote_gets(reader: &Client, handles: &[Handle], batch: usize) -> Run {
    let mut each = Vec::new();
    let started = Instant::now();
    let mut bytes = 0u64;
    for chunk in handles.chunks(batch) {
        let t = Instant::now();
        let leases = reader.get_batch(chunk).unwrap();
        let took = t.elapsed();
        for lease in leases {
            let lease = lease.unwrap();
            bytes += lease.len() as u64;
            std::hint::black_box(lease[lease.len() - 1]);
        }
        each.push(took);
    }
    Run {
        bytes,
        wall: started.elapsed(),
        each,
    }
}

fn connect(socket: &Path, role: Role) -> Client {
    ConnectOptions::new(role)
        .socket(socket)
        .connect()
        .expect("connecting to feedstored")
}

/// A release `feedstored` in namespace `i`, killed on drop.
struct Daemon {
    child: Child,
    socket: std::path::PathBuf,
}

impl Daemon {
    fn start(
        lan: &Lan,
        dir: &Path,
        i: usize,
        capacity: &str,
        secret: &Path,
        peer: Option<&str>,
    ) -> Daemon {
        let socket = dir.join(format!("node{i}.sock"));
        let mut cmd = Command::new("ip");
        cmd.args(lan.exec(i)[1..].iter())
            .arg(env!("CARGO_BIN_EXE_feedstored"))
            .arg("--socket")
            .arg(&socket)
            .args([
                "--capacity",
                capacity,
                "--node-id",
                &format!("{}", 0xB0 + i),
            ])
            .args(["--listen", &format!("{}:{PORT}", lan.ip(i))])
            .arg("--cluster-secret-file")
            .arg(secret)
            .env("FEEDSTORE_LOG", "warn")
            .stdout(Stdio::null());
        if let Some(peer) = peer {
            cmd.args(["--peers", &format!("{peer}:{PORT}")]);
        }
        let child = cmd.spawn().expect("spawning feedstored");
        let deadline = Instant::now() + Duration::from_secs(60);
        while std::os::unix::net::UnixStream::connect(&socket).is_err() {
            assert!(Instant::now() < deadline, "feedstored did not come up");
            std::thread::sleep(Duration::from_millis(20));
        }
        Daemon { child, socket }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
