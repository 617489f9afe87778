//! No client can exhaust the daemon: every resource a client can make it hold is bounded by a
//! documented setting, and hitting one gives a clear error (and a count in `limits_hit`), never
//! a hang or a daemon that grows without end. Each test is one finding, tried with a raw socket
//! as an attacker would.

mod common;

use std::time::{Duration, Instant};

use common::*;
use feedstore_consumer::{ConnectOptions, Error, Role, Stream, StreamFeeder, StreamOptions};
use feedstore_proto::Status;
use feedstore_proto::frame::{Request, Response};
use feedstore_proto::stream::{Shuffle, StreamSpec, Tail};

const LIMIT: Duration = Duration::from_secs(120);

fn spec(name: &str, world: u32) -> StreamSpec {
    StreamSpec {
        name: name.into(),
        records: 64,
        seed: 0,
        world,
        shuffle: Shuffle::None,
        tail: Tail::Drop,
        epochs: Some(1),
        reshard: None,
    }
}

fn quick() -> StreamOptions {
    StreamOptions {
        wait: Duration::from_secs(5),
        ..StreamOptions::default()
    }
}

/// Finding: a reader attached 200 streams of depth 65536 and grew the daemon by 800 MiB of
/// rings outside `--capacity`. Readers no longer create streams, rings count against
/// `--max-ring-bytes`, and streams against `--max-streams`.
#[test]
fn rings_and_streams_are_bounded() {
    let _w = watchdog("rings_and_streams_are_bounded", LIMIT);
    let dir = scratch_dir("ring-limit");
    let daemon = DaemonProcess::start(&dir, &["--max-ring-bytes", "64KiB", "--max-streams", "2"]);
    let writer = daemon.writer();
    // Depth 256: a ring of 64 bytes per slot and a header, 20 KiB in whole pages.
    let s = spec("wide", 16);
    let _feeder = StreamFeeder::join(&writer, &s, 256, &[]).unwrap();
    let mut open = Vec::new();
    let err = loop {
        match Stream::open(&daemon.socket, &s, open.len() as u32, None, quick()) {
            Ok(stream) => open.push(stream),
            Err(e) => break e,
        }
    };
    assert_eq!(open.len(), 3, "three 20 KiB rings fit in 64 KiB");
    assert!(
        matches!(&err, Error::LimitReached(m) if m.contains("--max-ring-bytes")),
        "{err}"
    );
    let stats = writer.stats().unwrap();
    assert_eq!(stats.ring_bytes, 3 * 20480);
    // Detaching gives the ring back.
    open.pop();
    Stream::open(&daemon.socket, &s, 2, None, quick()).unwrap();

    let _second = StreamFeeder::join(&writer, &spec("second", 1), 4, &[]).unwrap();
    let err = StreamFeeder::join(&writer, &spec("third", 1), 4, &[]).unwrap_err();
    assert!(
        matches!(&err, Error::LimitReached(m) if m.contains("--max-streams")),
        "{err}"
    );
    assert!(writer.stats().unwrap().limits_hit >= 2);
}

/// Finding: 6,000 streams left behind by a departed client were never removed. A stream with no
/// producer and no consumer for `--stream-idle-secs` is closed, and its samples go back.
#[test]
fn idle_streams_expire() {
    let _w = watchdog("idle_streams_expire", LIMIT);
    let dir = scratch_dir("expiry");
    let daemon = DaemonProcess::start(&dir, &["--stream-idle-secs", "1"]);
    let watcher = daemon.reader();
    {
        let writer = daemon.writer();
        let s = spec("left-behind", 1);
        let feeder = StreamFeeder::join(
            &writer,
            &s,
            4,
            &[feedstore_consumer::StreamTask { rank: 0, seq: 0 }],
        )
        .unwrap();
        let tasks = feeder.take(4, Duration::from_secs(5)).unwrap().unwrap();
        let object = writer.put(b"a sample").unwrap();
        let made = tasks
            .into_iter()
            .map(|task| feedstore_consumer::Delivery {
                task,
                record: 0,
                key: 0,
                made: feedstore_consumer::Made::Existing(object),
            })
            .collect();
        assert!(feeder.put(made).unwrap().iter().all(Result::is_ok));
        assert_eq!(watcher.stats().unwrap().streams, 1);
    } // the producer goes
    let stats = wait_for_stats(&watcher, "the idle stream to expire", |s| s.streams == 0);
    assert_eq!((stats.streams_expired, stats.leases), (1, 0));
    assert!(daemon.log_text().contains("expired"));
}

/// Finding: requests queued behind a waiting call grew without limit (300 MiB for 300 queued
/// gets). Past `--max-queued-requests`, or four maximal frames' worth of bytes, the connection is
/// closed with a logged reason.
#[test]
fn requests_queued_behind_a_waiting_call_are_bounded() {
    let _w = watchdog("requests_queued_behind_a_waiting_call_are_bounded", LIMIT);
    let dir = scratch_dir("queued");
    let daemon = DaemonProcess::start(&dir, &["--max-queued-requests", "8"]);
    let (mut raw, _, _) = RawClient::hello(&daemon.socket, Role::Reader, "pipeliner");
    // A call that waits: attaching to a stream nobody has made.
    raw.send(&Request::StreamAttach {
        spec: spec("never-made", 1),
        rank: 0,
        seq: 0,
        timeout_ms: 30_000,
    });
    // Twenty small requests pipelined behind it: more than the eight allowed.
    for _ in 0..20 {
        if raw.try_send(&Request::Stats).is_err() {
            break; // closed already
        }
    }
    raw.expect_closed();
    assert!(daemon.log_text().contains("--max-queued-requests"));
    // Large requests are bounded by bytes too: four maximal frames' worth.
    let (mut raw, _, _) = RawClient::hello(&daemon.socket, Role::Reader, "pipeliner");
    raw.send(&Request::StreamAttach {
        spec: spec("never-made", 1),
        rank: 0,
        seq: 0,
        timeout_ms: 30_000,
    });
    let big = Request::Get {
        handles: vec![feedstore_proto::Handle::default(); 60_000],
    };
    for _ in 0..8 {
        if raw.try_send(&big).is_err() {
            break;
        }
    }
    raw.expect_closed();
    let bystander = daemon.reader();
    assert!(bystander.stats().unwrap().limits_hit >= 1);
}

/// Finding: 300 idle connections exhausted the daemon's descriptors, after which `stat` and new
/// clients hung. Connections are bounded per uid (and in all), below the descriptor limit, and a
/// client over the limit is told so at once.
#[test]
fn connections_per_uid_are_bounded_and_refused_clearly() {
    let _w = watchdog("connections_per_uid_are_bounded_and_refused_clearly", LIMIT);
    let dir = scratch_dir("connections");
    let daemon = DaemonProcess::start(&dir, &["--max-connections-per-uid", "4"]);
    let idle: Vec<_> = (0..4)
        .map(|_| RawClient::hello(&daemon.socket, Role::Reader, "idle").0)
        .collect();
    // Refused at once, not left hanging (the watchdog fails a hang; tests assert no timings).
    let err = ConnectOptions::new(Role::Reader)
        .socket(&daemon.socket)
        .connect()
        .unwrap_err();
    assert!(
        matches!(&err, Error::LimitReached(m) if m.contains("--max-connections-per-uid")),
        "{err}"
    );
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_feedstore"))
        .args(["stat", "--socket"])
        .arg(&daemon.socket)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        text.starts_with("feedstore: error:") && text.contains("--max-connections-per-uid"),
        "one clear line: {text}"
    );
    drop(idle);
    // The slots come back as the idle connections go.
    let deadline = Instant::now() + Duration::from_secs(20);
    let client = loop {
        match ConnectOptions::new(Role::Reader)
            .socket(&daemon.socket)
            .connect()
        {
            Ok(c) => break c,
            Err(Error::LimitReached(_)) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => panic!("{e}"),
        }
    };
    assert!(client.stats().unwrap().limits_hit >= 2);
}

/// A connection that never says hello is closed after `--hello-timeout-ms`.
#[test]
fn a_silent_connection_is_closed() {
    let _w = watchdog("a_silent_connection_is_closed", LIMIT);
    let dir = scratch_dir("silent");
    let daemon = DaemonProcess::start(&dir, &["--hello-timeout-ms", "200"]);
    let mut raw = RawClient::connect(&daemon.socket).unwrap();
    raw.expect_closed();
    assert!(daemon.log_text().contains("--hello-timeout-ms"));
    assert!(daemon.reader().stats().unwrap().limits_hit >= 1, "counted");
}

/// Finding: a client name of 64 KiB with newlines and escape codes went into the log as is.
/// Names are at most 256 bytes of printable text; the daemon refuses others.
#[test]
fn client_names_are_bounded_and_printable() {
    let _w = watchdog("client_names_are_bounded_and_printable", LIMIT);
    let dir = scratch_dir("names");
    let daemon = DaemonProcess::start(&dir, &[]);
    let evil = format!("x\n\x1b[31mFORGED LOG LINE{}", "y".repeat(64 << 10));
    let (_raw, response, fds) = RawClient::hello(&daemon.socket, Role::Reader, &evil);
    match response {
        Response::Error { status, message } => {
            assert_eq!(status, Status::InvalidArgument);
            assert!(message.contains("at most 256 bytes"), "{message}");
        }
        other => panic!("{other:?}"),
    }
    assert!(fds.is_empty(), "no segments for a refused client");
    assert!(!daemon.log_text().contains("\x1b[31m"));
    assert!(!daemon.log_text().contains("FORGED LOG LINE"));
    let err = ConnectOptions::new(Role::Reader)
        .socket(&daemon.socket)
        .name("two\nlines")
        .connect()
        .unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
}

/// A client cannot pin the whole store through leases: `--max-leases-per-connection`.
#[test]
fn leases_per_connection_are_bounded() {
    let _w = watchdog("leases_per_connection_are_bounded", LIMIT);
    let dir = scratch_dir("leases");
    let daemon = DaemonProcess::start(&dir, &["--max-leases-per-connection", "10"]);
    let writer = daemon.writer();
    let h = writer.put(b"x").unwrap();
    let reader = daemon.reader();
    let held: Vec<_> = (0..10).map(|_| reader.get(h).unwrap()).collect();
    let err = reader.get(h).unwrap_err();
    assert!(matches!(err, Error::LimitReached(_)), "{err}");
    drop(held);
    reader.flush_releases();
    wait_for_stats(&writer, "the leases back", |s| s.leases == 0);
    reader.get(h).unwrap();
}
