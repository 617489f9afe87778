//! Cross-node pulls end to end: real daemons in separate network namespaces joined by veth pairs
//! through a bridge, real TCP between them, real faults (a daemon killed with `kill -9`, a proxy
//! that stalls or resets, a `tc` rate limit, a store with no room), and a check after each that
//! nothing leaked on any node.
//!
//! The namespace tests need root (they make namespaces); they create everything they use and
//! remove it when they end, a failing test included. Traffic stays inside those namespaces and
//! on loopback.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use common::netns::Lan;
use common::*;
use feedstore_consumer::{Client, ConnectOptions, Error, Handle, Role, StoreStats};

const LIMIT: Duration = Duration::from_secs(240);

fn skip_unless_root(test: &str) -> bool {
    if !is_root() {
        eprintln!("SKIPPED {test}: needs root to make network namespaces");
        return true;
    }
    false
}

fn secret_file(dir: &Path, name: &str, secret: &str) -> String {
    use std::os::unix::fs::PermissionsExt;
    let path = dir.join(name);
    std::fs::write(&path, secret).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    path.to_str().unwrap().to_owned()
}

/// A node's daemon in namespace `i` of `lan`, listening on port 7070 of its address.
fn node(lan: &Lan, dir: &Path, i: usize, extra: &[&str]) -> DaemonProcess {
    let listen = format!("{}:7070", lan.ip(i));
    let node_id = format!("{}", 0xA0 + i);
    let mut args = vec!["--node-id", &node_id, "--listen", &listen];
    args.extend_from_slice(extra);
    DaemonProcess::start_named(dir, &format!("node{i}"), &lan.exec(i), &args)
}

/// Creates an object of `size` bytes on `writer`, filled with the pattern of `seed`.
fn make(writer: &Client, size: usize, seed: u64) -> Handle {
    let mut w = writer.create(size as u64).unwrap();
    fill_pattern(w.as_mut_slice(), seed);
    w.seal().unwrap()
}

/// Whether every counter that shows a leak is back at rest.
fn at_rest(s: &StoreStats) -> bool {
    s.objects_writing == 0 && s.leases == 0 && s.pulls_in_flight == 0
}

/// A TCP connection to 127.0.0.1:`port` from the loopback address `source`.
fn connect_from(source: &str, port: u16) -> std::os::fd::OwnedFd {
    use nix::sys::socket::{AddressFamily, SockFlag, SockType, SockaddrIn, bind, connect, socket};
    let fd = socket(
        AddressFamily::Inet,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC,
        None,
    )
    .unwrap();
    let from: SockaddrIn = format!("{source}:0").parse().unwrap();
    bind(std::os::fd::AsRawFd::as_raw_fd(&fd), &from).unwrap();
    let to: SockaddrIn = format!("127.0.0.1:{port}").parse().unwrap();
    connect(std::os::fd::AsRawFd::as_raw_fd(&fd), &to).unwrap();
    fd
}

#[test]
fn objects_made_on_one_node_are_read_byte_exact_on_others() {
    if skip_unless_root("objects_made_on_one_node_are_read_byte_exact_on_others") {
        return;
    }
    let _w = watchdog("objects_made_on_one_node", LIMIT);
    let lan = Lan::new("r", 4);
    let dir = scratch_dir("cluster-read");
    let secret = secret_file(&dir, "secret", "the-cluster-secret-of-this-test\n");
    let peers = format!(
        "{0}:7070,{1}:7070,{2}:7070",
        lan.ip(0),
        lan.ip(1),
        lan.ip(2)
    );
    let common = [
        "--capacity",
        "320MiB",
        "--cluster-secret-file",
        &secret,
        "--peers",
        &peers,
        "--peer-refresh-secs",
        "1",
    ];
    // Every node has every address, its own included (as a headless service answers).
    let (a, b, c) = (
        node(&lan, &dir, 0, &common),
        node(&lan, &dir, 1, &common),
        node(&lan, &dir, 2, &common),
    );
    let (wa, rb, rc) = (a.writer(), b.reader(), c.reader());
    for client in [&wa, &rb, &rc] {
        wait_for_stats(client, "two peers up", |s| s.peers_up == 2);
    }

    let sizes = [1usize, 4097, (4 << 20) + 3, 256 << 20];
    let handles: Vec<Handle> = sizes
        .iter()
        .enumerate()
        .map(|(i, &size)| make(&wa, size, i as u64 + 1))
        .collect();
    for (reader, name) in [(&rb, "B"), (&rc, "C")] {
        for (i, (&h, &size)) in handles.iter().zip(&sizes).enumerate() {
            let lease = reader
                .get(h)
                .unwrap_or_else(|e| panic!("{name} get {h}: {e}"));
            assert_eq!(lease.len(), size);
            assert!(
                pattern_matches(&lease, i as u64 + 1),
                "{name}: object {i} ({size} bytes) differs"
            );
        }
    }
    let sent = wa.stats().unwrap();
    let b_stats = rb.stats().unwrap();
    assert_eq!(b_stats.pulls, 4);
    let total: u64 = sizes.iter().map(|&s| s as u64).sum();
    assert_eq!(b_stats.pulled_bytes, total);
    assert_eq!(b_stats.objects_pulled, 4);
    // 256 MiB goes in 16 ranges, the rest in one each.
    assert_eq!(sent.served_reads, 2 * (3 + 16));
    assert_eq!(sent.served_bytes, 2 * total);

    // A second read on B is served from B's copy: no transfer.
    for (i, &h) in handles.iter().enumerate() {
        assert!(pattern_matches(&rb.get(h).unwrap(), i as u64 + 1));
    }
    assert_eq!(rb.stats().unwrap().pulls, 4);
    assert_eq!(wa.stats().unwrap().served_reads, sent.served_reads);

    // An object deleted on its owner is gone for the other nodes too.
    let deleted = make(&wa, 1000, 99);
    wa.delete(deleted).unwrap();
    assert!(matches!(rb.get(deleted), Err(Error::NotFound { .. })));
    assert_eq!(rb.stats().unwrap().pull_failures_missing, 1);
    // A node nobody answers for.
    let nowhere = Handle {
        node_id: 0xdead,
        ..handles[0]
    };
    let err = rb.get(nowhere).unwrap_err();
    assert!(matches!(err, Error::Unreachable { .. }), "{err}");

    // A daemon with another secret is refused, and says so on both sides.
    let wrong = secret_file(&dir, "wrong", "not-the-secret-of-this-cluster\n");
    let a_addr = format!("{}:7070", lan.ip(0));
    let d = node(
        &lan,
        &dir,
        3,
        &[
            "--cluster-secret-file",
            &wrong,
            "--peers",
            &a_addr,
            "--peer-refresh-secs",
            "1",
        ],
    );
    let rd = d.reader();
    let err = rd.get(handles[1]).unwrap_err();
    assert!(matches!(err, Error::Unreachable { .. }), "{err}");
    assert_eq!(rd.stats().unwrap().peers_up, 0);
    wait_for_stats(&wa, "the stranger refused", |s| s.peers_refused >= 1);
    assert!(
        a.log_text().contains(&lan.ip(3)) && a.log_text().contains("secrets differ"),
        "A logs the refused peer's address and why:\n{}",
        a.log_text()
    );
    assert!(d.log_text().contains("secrets differ"));

    // Nothing leaked anywhere once the readers let go.
    drop(rd);
    for (client, name) in [(&wa, "A"), (&rb, "B"), (&rc, "C")] {
        let s = wait_for_stats(client, &format!("{name} at rest"), at_rest);
        assert_eq!(
            s.objects_sealed, 4,
            "{name}: the originals or copies remain"
        );
    }
}

/// What the proxy does to bytes flowing from the owner to the puller.
const FORWARD: u8 = 0;
const STALL: u8 = 1;
const RESET: u8 = 2;
/// Faults start after this many bytes on a connection, past the handshake and into a transfer.
const FAULT_AFTER: usize = 1 << 20;

/// A TCP proxy in a namespace, between a puller and the owner, that forwards, stalls or resets
/// what the owner sends. Stops on drop.
struct Proxy {
    mode: Arc<AtomicU8>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Proxy {
    fn start(netns: &str, listen: SocketAddr, upstream: SocketAddr) -> Proxy {
        let mode = Arc::new(AtomicU8::new(FORWARD));
        let stop = Arc::new(AtomicBool::new(false));
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let netns = netns.to_owned();
        let (m, s) = (mode.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            // This thread (and the threads it starts) lives in the namespace.
            common::netns::enter(&netns);
            let listener = TcpListener::bind(listen).unwrap();
            listener.set_nonblocking(true).unwrap();
            ready_tx.send(()).unwrap();
            let mut pumps = Vec::new();
            while !s.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((down, _)) => {
                        let Ok(up) = TcpStream::connect_timeout(&upstream, Duration::from_secs(2))
                        else {
                            continue; // the owner is gone: the puller sees the close
                        };
                        down.set_nonblocking(false).unwrap();
                        let (down, up) = (Arc::new(down), Arc::new(up));
                        pumps.push(pump(up.clone(), down.clone(), m.clone(), s.clone(), true));
                        pumps.push(pump(down, up, m.clone(), s.clone(), false));
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
            for p in pumps {
                let _ = p.join();
            }
        });
        ready_rx.recv_timeout(Duration::from_secs(10)).unwrap();
        Proxy {
            mode,
            stop,
            thread: Some(thread),
        }
    }

    fn set(&self, mode: u8) {
        self.mode.store(mode, Ordering::Relaxed);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Copies `from` to `to` until either ends or the proxy stops; faults apply to the owner's
/// direction (`faulty`) once a connection has carried [`FAULT_AFTER`] bytes.
fn pump(
    from: Arc<TcpStream>,
    to: Arc<TcpStream>,
    mode: Arc<AtomicU8>,
    stop: Arc<AtomicBool>,
    faulty: bool,
) -> JoinHandle<()> {
    std::thread::spawn(move || {
        from.set_read_timeout(Some(Duration::from_millis(50)))
            .unwrap();
        let mut buf = vec![0u8; 64 << 10];
        let mut carried = 0usize;
        while !stop.load(Ordering::Relaxed) {
            let fault = if faulty && carried > FAULT_AFTER {
                mode.load(Ordering::Relaxed)
            } else {
                FORWARD
            };
            if fault == STALL {
                std::thread::sleep(Duration::from_millis(20));
                continue;
            }
            if fault == RESET {
                // Linger 0: closing sends a reset, not a FIN.
                let linger = libc::linger {
                    l_onoff: 1,
                    l_linger: 0,
                };
                for s in [&from, &to] {
                    let _ = nix::sys::socket::setsockopt(
                        s.as_ref(),
                        nix::sys::socket::sockopt::Linger,
                        &linger,
                    );
                    let _ = s.shutdown(std::net::Shutdown::Read);
                }
                return;
            }
            match (&*from).read(&mut buf) {
                Ok(0) => {
                    let _ = to.shutdown(std::net::Shutdown::Write);
                    return;
                }
                Ok(n) => {
                    carried += n;
                    if (&*to).write_all(&buf[..n]).is_err() {
                        return;
                    }
                }
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) => {}
                Err(_) => {
                    let _ = to.shutdown(std::net::Shutdown::Both);
                    return;
                }
            }
        }
    })
}

#[test]
fn faults_end_in_clear_errors_and_leak_nothing() {
    if skip_unless_root("faults_end_in_clear_errors_and_leak_nothing") {
        return;
    }
    let _w = watchdog("faults_end_in_clear_errors", LIMIT);
    let lan = Lan::new("f", 2);
    let dir = scratch_dir("cluster-faults");
    let secret = secret_file(&dir, "secret", "the-cluster-secret-of-this-test\n");
    let a = node(
        &lan,
        &dir,
        0,
        &["--capacity", "160MiB", "--cluster-secret-file", &secret],
    );
    // B reaches A only through the proxy, in B's namespace.
    let proxy_addr: SocketAddr = format!("{}:7171", lan.ip(1)).parse().unwrap();
    let a_addr: SocketAddr = format!("{}:7070", lan.ip(0)).parse().unwrap();
    let proxy = Proxy::start(&lan.nodes[1], proxy_addr, a_addr);
    let proxy_spec = proxy_addr.to_string();
    let mut b = node(
        &lan,
        &dir,
        1,
        &[
            "--capacity",
            "96MiB",
            "--cluster-secret-file",
            &secret,
            "--peers",
            &proxy_spec,
            "--pull-timeout-ms",
            "4000",
            "--peer-refresh-secs",
            "1",
        ],
    );
    let (wa, rb, wb) = (a.writer(), b.reader(), b.writer());
    wait_for_stats(&rb, "A up", |s| s.peers_up == 1);
    let good = make(&wa, 2 << 20, 1);
    assert!(pattern_matches(&rb.get(good).unwrap(), 1));

    // A stalling owner: the get ends with a timeout, the reservation is gone.
    proxy.set(STALL);
    let stalled = make(&wa, 8 << 20, 2);
    let err = rb.get(stalled).unwrap_err();
    assert!(matches!(err, Error::Timeout(_)), "{err}");
    assert!(
        err.to_string().contains("--pull-timeout-ms"),
        "ended by the pull timeout: {err}"
    );
    let s = rb.stats().unwrap();
    assert_eq!((s.pull_failures_timeout, s.objects_writing), (1, 0));

    // A connection reset mid-transfer, every time: retried, then a clear error.
    proxy.set(RESET);
    let reset = make(&wa, 8 << 20, 3);
    let err = rb.get(reset).unwrap_err();
    assert!(matches!(err, Error::Unreachable { .. }), "{err}");
    assert!(b.log_text().contains("retrying"), "{}", b.log_text());
    let s = rb.stats().unwrap();
    assert_eq!((s.pull_failures_unreachable, s.objects_writing), (1, 0));

    // The link heals: the same objects arrive intact.
    proxy.set(FORWARD);
    assert!(pattern_matches(&rb.get(stalled).unwrap(), 2));
    assert!(pattern_matches(&rb.get(reset).unwrap(), 3));

    // No room on B: every byte of it leased by a reader.
    let filler = make(&wb, 80 << 20, 4);
    let held = rb.get(filler).unwrap();
    let big = make(&wa, 32 << 20, 5);
    let err = rb.get(big).unwrap_err();
    assert!(matches!(err, Error::Full { .. }), "{err}");
    assert_eq!(rb.stats().unwrap().pull_failures_full, 1);
    drop(held);
    wb.delete(filler).unwrap();

    // The owner killed with -9 in the middle of a transfer (slowed to ~10 MB/s by tc).
    wait_for_stats(&wa, "A at rest", at_rest);
    lan.rate_limit(0, "80mbit");
    let doomed = make(&wa, 24 << 20, 6);
    let reader = b.reader();
    let pull = std::thread::spawn(move || reader.get(doomed).map(|l| l.len()));
    wait_for_stats(&rb, "the pull under way", |s| s.pulls_in_flight == 1);
    std::thread::sleep(Duration::from_millis(500));
    let mut a = a;
    a.signal_and_wait(nix::sys::signal::Signal::SIGKILL);
    let err = pull.join().unwrap().unwrap_err();
    assert!(matches!(err, Error::Unreachable { .. }), "{err}");
    drop(proxy);

    // Nothing leaked on B: no reservation, no lease, no pull; only copies left (the filler
    // evicted some), and B serves on.
    let s = wait_for_stats(&rb, "B at rest", at_rest);
    assert_eq!(s.objects_sealed, s.objects_pulled);
    assert!(b.child.try_wait().unwrap().is_none(), "B still serves");
    let own = make(&wb, 4096, 8);
    assert!(pattern_matches(&rb.get(own).unwrap(), 8));
    drop(b);
}

/// Both nodes of a cluster are taken over in turn (`feedstored --takeover`): the owner's
/// successor serves the objects made before it (the same handles) and after it to its peer;
/// the puller's successor keeps the copies it pulled (not pulled again), and a view of one held
/// across both takeovers reads its bytes.
#[test]
fn nodes_in_a_cluster_are_taken_over_and_serve_on() {
    let _w = watchdog("nodes_in_a_cluster_are_taken_over", LIMIT);
    let dir = scratch_dir("cluster-takeover");
    let secret = secret_file(&dir, "secret", "the-cluster-secret-of-this-test\n");
    let common = ["--capacity", "128MiB", "--cluster-secret-file", &secret].map(String::from);
    let (a, la) = DaemonProcess::start_listening(&dir, "a", |_| {
        [&["--node-id".into(), "1".into()][..], &common].concat()
    });
    let (b, lb) = DaemonProcess::start_listening(&dir, "b", |addr| {
        let peers = format!("{la},{addr}");
        [
            &["--node-id", "2", "--peers", &peers].map(String::from)[..],
            &common,
        ]
        .concat()
    });
    let args = |id: &str, listen: &str| -> Vec<String> {
        let peers = format!("{la},{lb}");
        [
            &["--node-id", id, "--listen", listen, "--peers", &peers].map(String::from)[..],
            &common,
        ]
        .concat()
    };
    let reconnecting = |d: &DaemonProcess, role| {
        ConnectOptions::new(role)
            .socket(&d.socket)
            .reconnect_timeout(Duration::from_secs(30))
            .connect()
            .unwrap()
    };
    let (wa, rb) = (
        reconnecting(&a, Role::Writer),
        reconnecting(&b, Role::Reader),
    );
    let pulled = make(&wa, 3 << 20, 1);
    let held = rb.get(pulled).unwrap();
    assert!(pattern_matches(&held, 1));
    let unpulled = make(&wa, 2 << 20, 2);

    let flags = args("1", &la);
    let a = a.take_over(&dir, &flags.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(
        pattern_matches(&rb.get(unpulled).unwrap(), 2),
        "made before the owner's takeover, pulled from its successor"
    );
    let after = make(&wa, 5 << 20, 3);
    assert!(
        wa.reconnects() >= 1,
        "the writer went on with the successor"
    );
    assert!(pattern_matches(&rb.get(after).unwrap(), 3));
    let pulls = b.reader().stats().unwrap().pulls;

    let flags = args("2", &lb);
    let b = b.take_over(&dir, &flags.iter().map(String::as_str).collect::<Vec<_>>());
    for (h, seed) in [(pulled, 1), (unpulled, 2), (after, 3)] {
        assert!(pattern_matches(&rb.get(h).unwrap(), seed));
    }
    let stats = b.reader().stats().unwrap();
    assert_eq!(
        stats.pulls, 0,
        "the puller's successor kept every copy: {stats:?}"
    );
    assert!(rb.reconnects() >= 1);
    let last = make(&wa, 1 << 20, 4);
    assert!(pattern_matches(&rb.get(last).unwrap(), 4));
    assert_eq!(b.reader().stats().unwrap().pulls, 1);
    assert!(pulls >= 3, "{pulls}");
    // Every block of b's store nothing holds written again: the pulled copy under the view
    // kept its lease through both takeovers.
    churn(&b.writer(), 256 << 20, 8 << 20);
    assert!(
        pattern_matches(&held, 1),
        "a view held across both takeovers reads its bytes"
    );
    drop(a);
}

/// Two daemons on loopback, no namespaces: runs as any user, so every CI run covers the pull
/// path. Strangers holding 300 silent connections from 30 addresses, none of which ever proves
/// the secret, cannot lock a real peer out: they only ever hold the handshake budget, and the
/// oldest of them make room for whoever comes next.
#[test]
fn loopback_peers_pull_and_a_flood_of_strangers_cannot_lock_them_out() {
    let _w = watchdog("loopback_peers", LIMIT);
    let dir = scratch_dir("cluster-loopback");
    let secret = secret_file(&dir, "secret", "the-cluster-secret-of-this-test\n");
    let capacity = ["--capacity", "256MiB", "--cluster-secret-file", &secret].map(String::from);
    let (a, la) = DaemonProcess::start_listening(&dir, "a", |_| {
        [&["--node-id".into(), "1".into()][..], &capacity].concat()
    });
    let pa: u16 = la.rsplit(':').next().unwrap().parse().unwrap();
    // 300 silent connections from 127.0.0.2 to 127.0.0.31, ten from each, before any peer.
    let strangers: Vec<_> = (0..300)
        .map(|i| connect_from(&format!("127.0.0.{}", 2 + i % 30), pa))
        .collect();
    // Two connections for six objects of three ranges each, all asked for at once: no pull may
    // wait on a connection another pull holds while that one waits on it.
    let (b, _) = DaemonProcess::start_listening(&dir, "b", |lb| {
        let peers = format!("{la},{lb}");
        [
            &[
                "--node-id",
                "2",
                "--peers",
                &peers,
                "--peer-connections",
                "2",
            ]
            .map(String::from)[..],
            &capacity,
        ]
        .concat()
    });
    let (wa, rb) = (a.writer(), b.reader());
    let handles: Vec<Handle> = (0..20)
        .map(|i| make(&wa, 1000 + 4096 * i, i as u64))
        .collect();
    // More silent connections while B pulls: B's own keep getting through.
    let more: Vec<_> = (0..60)
        .map(|i| connect_from(&format!("127.0.0.{}", 2 + i % 30), pa))
        .collect();
    let leases = rb.get_batch(&handles).unwrap();
    for (i, lease) in leases.into_iter().enumerate() {
        let lease = lease.unwrap();
        assert_eq!(lease.len(), 1000 + 4096 * i);
        assert!(pattern_matches(&lease, i as u64));
    }
    let s = rb.stats().unwrap();
    assert_eq!((s.pulls, s.peers_up), (20, 1));
    let sa = wa.stats().unwrap();
    // 360 strangers: all but the 64 the handshake budget holds at most were dropped already.
    assert!(
        sa.peer_handshakes_dropped >= 360 - 64,
        "the flood was dropped: {}",
        sa.peer_handshakes_dropped
    );
    // A few lines about the flood, not hundreds.
    let flood_lines = a
        .log_text()
        .lines()
        .filter(|l| l.contains("did not become peers") || l.contains("before it proved"))
        .count();
    assert!(
        (1..=12).contains(&flood_lines),
        "{flood_lines} lines:\n{}",
        a.log_text()
    );
    drop((strangers, more));
    let large: Vec<Handle> = (0..6).map(|i| make(&wa, 33 << 20, 100 + i)).collect();
    for (i, lease) in rb.get_batch(&large).unwrap().into_iter().enumerate() {
        assert!(pattern_matches(&lease.unwrap(), 100 + i as u64));
    }
    assert_eq!(wa.stats().unwrap().served_reads, 20 + 6 * 3);
    // A handle of B's own is local as ever.
    let wb = b.writer();
    let own = make(&wb, 10, 7);
    assert!(pattern_matches(&rb.get(own).unwrap(), 7));
    // A cluster needs a secret, even on loopback (the port skips the socket's uid checks).
    let out = Command::new(env!("CARGO_BIN_EXE_feedstored"))
        .args(["--listen", "127.0.0.1:0", "--socket"])
        .arg(dir.join("refused.sock"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("cluster-secret-file"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// What the tampering proxy does to the owner's bytes once a connection is past its handshake.
const PASS: u8 = 0;
/// Flips one byte of the next record that goes by, then passes everything.
const FLIP_ONCE: u8 = 1;
/// Flips a byte of every record stream.
const FLIP: u8 = 2;
/// Overwrites 4 KiB of every object's bytes with zeros (what an attacker who recomputed a
/// checksum would send).
const ZERO: u8 = 3;
/// Sends, in place of a reply and its object, the bytes of an earlier reply and object,
/// recorded off the wire (the first a connection carried while the proxy passed everything).
const REPLAY: u8 = 4;

/// The owner's bytes before its first record on a connection: hello, proof, verdict.
const HANDSHAKE_BYTES: usize = 64 + 32 + 4;

/// A proxy on loopback between a puller and the owner that rewrites what the owner sends, as an
/// attacker on the path would.
struct TamperProxy {
    addr: SocketAddr,
    mode: Arc<AtomicU8>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl TamperProxy {
    fn start(upstream: SocketAddr) -> TamperProxy {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        listener.set_nonblocking(true).unwrap();
        let mode = Arc::new(AtomicU8::new(PASS));
        let stop = Arc::new(AtomicBool::new(false));
        // What the latest connection to start in PASS mode carried after its handshake (up to
        // 8 MiB), and which connection that was.
        let recorded: Arc<std::sync::Mutex<(usize, Vec<u8>)>> = Arc::default();
        let mut connections = 0;
        let (m, s) = (mode.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            let mut pumps = Vec::new();
            while !s.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((down, _)) => {
                        let Ok(up) = TcpStream::connect(upstream) else {
                            continue;
                        };
                        down.set_nonblocking(false).unwrap();
                        let (down, up) = (Arc::new(down), Arc::new(up));
                        let (m, s2, r) = (m.clone(), s.clone(), recorded.clone());
                        let (u, d) = (up.clone(), down.clone());
                        connections += 1;
                        let me = connections;
                        pumps.push(std::thread::spawn(move || tamper(me, &u, &d, &m, &s2, &r)));
                        let s2 = s.clone();
                        pumps.push(std::thread::spawn(move || plain(&down, &up, &s2)));
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
            for p in pumps {
                let _ = p.join();
            }
        });
        TamperProxy {
            addr,
            mode,
            stop,
            thread: Some(thread),
        }
    }

    fn set(&self, mode: u8) {
        self.mode.store(mode, Ordering::Relaxed);
    }
}

impl Drop for TamperProxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Reads `from` with a short timeout (so the proxy can stop); `None` at the end or an error.
fn read_some(from: &TcpStream, buf: &mut [u8], stop: &AtomicBool) -> Option<usize> {
    from.set_read_timeout(Some(Duration::from_millis(50)))
        .unwrap();
    while !stop.load(Ordering::Relaxed) {
        match (&*from).read(buf) {
            Ok(0) => return None,
            Ok(n) => return Some(n),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => return None,
        }
    }
    None
}

/// The puller's requests, passed as they are.
fn plain(from: &TcpStream, to: &TcpStream, stop: &AtomicBool) {
    let mut buf = vec![0u8; 64 << 10];
    while let Some(n) = read_some(from, &mut buf, stop) {
        if (&*to).write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = to.shutdown(std::net::Shutdown::Both);
}

/// The owner's bytes, rewritten after the handshake as the mode says.
fn tamper(
    me: usize,
    from: &TcpStream,
    to: &TcpStream,
    mode: &AtomicU8,
    stop: &AtomicBool,
    recorded: &std::sync::Mutex<(usize, Vec<u8>)>,
) {
    let mut buf = vec![0u8; 64 << 10];
    // Bytes of this connection so far; where its replay began, once it did.
    let mut at = 0usize;
    let mut replay_from = None;
    while let Some(n) = read_some(from, &mut buf, stop) {
        let chunk = &mut buf[..n];
        let start = at;
        at += n;
        // The part of this chunk past the handshake, and where it starts in the record stream.
        let skip = HANDSHAKE_BYTES.saturating_sub(start).min(n);
        let pos = start + skip - HANDSHAKE_BYTES.min(start + skip);
        let records = &mut chunk[skip..];
        match mode.load(Ordering::Relaxed) {
            PASS if !records.is_empty() => {
                let mut r = recorded.lock().unwrap();
                if pos == 0 {
                    *r = (me, Vec::new());
                }
                if r.0 == me && r.1.len() < 8 << 20 {
                    r.1.extend_from_slice(records);
                }
            }
            FLIP_ONCE if !records.is_empty() => {
                records[records.len() / 2] ^= 0x40;
                mode.store(PASS, Ordering::Relaxed);
            }
            FLIP if !records.is_empty() => records[records.len() / 2] ^= 0x01,
            ZERO if records.len() > 8192 => records[4096..8192].fill(0),
            REPLAY if !records.is_empty() => {
                // The recorded reply and object, from their start, in place of this one's.
                let from = *replay_from.get_or_insert(pos);
                let old = recorded.lock().unwrap();
                for (i, b) in records.iter_mut().enumerate() {
                    if let Some(&x) = old.1.get(pos + i - from) {
                        *b = x;
                    }
                }
            }
            _ => {}
        }
        if (&*to).write_all(chunk).is_err() {
            break;
        }
    }
    let _ = to.shutdown(std::net::Shutdown::Both);
}

/// An attacker on the path between two daemons who flips bits, replaces bytes or replays what
/// it recorded earlier gets errors, which the puller retries once from the owner; a reader
/// sees the object's own bytes or an error, never anything else, and nothing half-written
/// stays behind.
#[test]
fn a_proxy_rewriting_bytes_between_daemons_gets_errors_never_wrong_bytes() {
    let _w = watchdog("a_proxy_rewriting_bytes", LIMIT);
    let dir = scratch_dir("cluster-tamper");
    let secret = secret_file(&dir, "secret", "the-cluster-secret-of-this-test\n");
    let common = ["--capacity", "128MiB", "--cluster-secret-file", &secret];
    let (a, la) = DaemonProcess::start_listening(&dir, "a", |_| {
        [&["--node-id", "1"][..], &common]
            .concat()
            .into_iter()
            .map(String::from)
            .collect()
    });
    let proxy = TamperProxy::start(la.parse().unwrap());
    let through = proxy.addr.to_string();
    let b_args = [
        &[
            "--node-id",
            "2",
            "--peers",
            &through,
            "--pull-timeout-ms",
            "5000",
        ][..],
        &common,
    ]
    .concat();
    let b = DaemonProcess::start_named(&dir, "b", &[], &b_args);
    let (wa, rb) = (a.writer(), b.reader());
    wait_for_stats(&rb, "A up", |s| s.peers_up == 1);
    // Records a first transfer of each size for the replay below.
    let size = (3 << 20) + 5;
    let first = make(&wa, size, 1);
    assert!(pattern_matches(&rb.get(first).unwrap(), 1));

    // One byte flipped on the way: the pull fails its authentication, is asked again, and
    // the reader gets the object's own bytes.
    proxy.set(FLIP_ONCE);
    let flipped = make(&wa, size, 2);
    assert!(pattern_matches(&rb.get(flipped).unwrap(), 2));
    let s = rb.stats().unwrap();
    assert!(s.peer_frames_rejected >= 1, "{s:?}");
    assert_eq!(s.pull_failures_corrupt, 0);

    // Every record altered, or 4 KiB replaced (no checksum to fix up: a tag the proxy cannot
    // make), or an earlier connection's bytes sent again: an error, never other bytes.
    let mut tampered = Vec::new();
    for (mode, seed) in [(FLIP, 3), (ZERO, 4), (REPLAY, 5)] {
        proxy.set(mode);
        let h = make(&wa, size, seed);
        tampered.push((seed, h));
        match rb.get(h) {
            Err(Error::Corrupt { .. }) => {}
            Ok(lease) => panic!("mode {mode}: a get returned bytes: {}", lease.len()),
            Err(e) => panic!("mode {mode}: {e}"),
        }
    }
    let s = rb.stats().unwrap();
    assert_eq!(s.pull_failures_corrupt, 3, "{s:?}");
    assert!(s.peer_frames_rejected > 3 * 2, "each retried once: {s:?}");
    assert_eq!((s.objects_writing, s.pulls_in_flight), (0, 0));
    assert!(
        b.log_text().contains("failed its authentication"),
        "{}",
        b.log_text()
    );

    // The path heals: every object arrives intact, none was sealed from altered bytes.
    proxy.set(PASS);
    for (seed, h) in [(1, first), (2, flipped)].into_iter().chain(tampered) {
        assert!(pattern_matches(&rb.get(h).unwrap(), seed), "object {seed}");
    }
    let again = make(&wa, size, 6);
    assert!(pattern_matches(&rb.get(again).unwrap(), 6));
    wait_for_stats(&wa, "A at rest", at_rest);
}
