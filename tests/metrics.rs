//! The daemon's Prometheus metrics, scraped for real: `feedstored --metrics-addr` serves
//! `/metrics`; a stream is fed by a producer slower than its trainer, so the trainer waits part
//! of its time; the rank's wait-time ratio the daemon exports (from what the consumer reports
//! with its returns) agrees with the one the trainer measures around its own loop; `promtool
//! check metrics` accepts the scrape; a real Prometheus server scrapes the daemon and answers a
//! query for the rank's ratio. `feedstore stat` shows the rank's figures too.
//!
//! Needs `promtool` and `prometheus` (Debian's `prometheus` package; `./scripts/test` installs
//! it). Traffic stays on 127.0.0.1.

mod common;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use feedstore_consumer::{Delivery, Made, Stream, StreamFeeder, StreamOptions, StreamTask};
use feedstore_proto::stream::{Shuffle, StreamSpec, Tail};

/// A port free on 127.0.0.1 now (the daemon binds it right after).
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// `GET path` on 127.0.0.1:`port`: the status line and the body.
fn get(port: u16, path: &str) -> (String, String) {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut reply = String::new();
    stream.read_to_string(&mut reply).unwrap();
    let (head, body) = reply.split_once("\r\n\r\n").unwrap_or((&reply, ""));
    (
        head.lines().next().unwrap_or("").to_owned(),
        body.to_owned(),
    )
}

/// The value of the sample `name{labels}` in a scrape (labels as written, in order).
fn sample(scrape: &str, name_and_labels: &str) -> Option<f64> {
    scrape.lines().find_map(|line| {
        let rest = line.strip_prefix(name_and_labels)?;
        rest.strip_prefix(' ')?.trim().parse().ok()
    })
}

/// A daemon serving metrics on a free loopback port: its scratch folder, the port, the daemon.
fn daemon_with_metrics(test: &str) -> (std::path::PathBuf, u16, DaemonProcess) {
    let dir = scratch_dir(test);
    let port = free_port();
    let daemon = DaemonProcess::start(&dir, &["--metrics-addr", &format!("127.0.0.1:{port}")]);
    (dir, port, daemon)
}

/// A child process killed when dropped.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn a_ranks_wait_time_ratio_reaches_prometheus() {
    let _w = watchdog(
        "a_ranks_wait_time_ratio_reaches_prometheus",
        Duration::from_secs(240),
    );
    let (dir, port, daemon) = daemon_with_metrics("metrics");

    // A producer that makes one sample every 4 ms, a trainer that computes 2 ms per sample:
    // the trainer waits about half its time.
    let spec = StreamSpec {
        name: "metrics \"run\" 1".into(),
        records: 150,
        seed: 7,
        world: 1,
        shuffle: Shuffle::Full,
        tail: Tail::Drop,
        epochs: Some(1),
    };
    let producer = {
        let (socket, spec) = (daemon.socket.clone(), spec.clone());
        std::thread::spawn(move || {
            let client = connect(&socket, feedstore_consumer::Role::Writer);
            let feeder =
                StreamFeeder::join(&client, &spec, 4, &[StreamTask { rank: 0, seq: 0 }]).unwrap();
            while let Some(tasks) = feeder.take(1, Duration::from_millis(200)).unwrap() {
                let made = tasks
                    .into_iter()
                    .map(|task| {
                        std::thread::sleep(Duration::from_millis(4));
                        let mut w = client.create(64).unwrap();
                        w.as_mut_slice().fill(1);
                        Delivery {
                            task,
                            record: spec.record_at(task.rank, task.seq),
                            key: 0,
                            made: Made::Written(w),
                        }
                    })
                    .collect();
                feeder.put(made).unwrap();
            }
        })
    };
    let mut stream = Stream::open(
        &daemon.socket,
        &spec,
        0,
        None,
        StreamOptions {
            wait: Duration::from_secs(30),
            ..StreamOptions::default()
        },
    )
    .unwrap();
    // The trainer's own measure, around its own loop.
    let (mut waited, mut taken) = (Duration::ZERO, 0u64);
    let started = Instant::now();
    loop {
        let asked = Instant::now();
        let Some(sample) = stream.next_sample().unwrap() else {
            break;
        };
        waited += asked.elapsed();
        drop(sample);
        taken += 1;
        std::thread::sleep(Duration::from_millis(2));
    }
    stream.flush_returns();
    assert_eq!(taken, 150, "the whole epoch");
    let own = waited.as_secs_f64() / started.elapsed().as_secs_f64();
    assert!(
        (0.1..0.9).contains(&own),
        "the set-up makes the trainer wait part of its time: {own:.3}"
    );

    let (status, scrape) = get(port, "/metrics");
    assert!(status.contains("200"), "{status}");
    let labels = r#"{stream="metrics \"run\" 1",uid="0",rank="0"}"#;
    let exported = sample(&scrape, &format!("feedstore_rank_wait_ratio{labels}"))
        .unwrap_or_else(|| panic!("no wait ratio for the rank in:\n{scrape}"));
    assert!(
        (exported - own).abs() < 0.03,
        "the daemon exports {exported:.3}, the trainer measured {own:.3}"
    );
    assert_eq!(
        sample(
            &scrape,
            &format!("feedstore_rank_taken_samples_total{labels}")
        ),
        Some(150.0)
    );
    assert!(
        sample(
            &scrape,
            &format!("feedstore_rank_first_sample_seconds{labels}")
        )
        .unwrap()
            > 0.0
    );
    assert!(sample(&scrape, "feedstore_capacity_bytes").unwrap() > 0.0);
    assert!(
        scrape.contains("# TYPE feedstore_evictions_total counter"),
        "{scrape}"
    );

    // Prometheus's own checker accepts the format, names and help.
    let mut promtool = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool (Debian's prometheus package; ./scripts/test installs it)");
    promtool
        .stdin
        .take()
        .unwrap()
        .write_all(scrape.as_bytes())
        .unwrap();
    let checked = promtool.wait_with_output().unwrap();
    assert!(
        checked.status.success(),
        "promtool: {}{}",
        String::from_utf8_lossy(&checked.stdout),
        String::from_utf8_lossy(&checked.stderr)
    );

    // `feedstore stat` shows the rank's figures.
    let stat = Command::new(env!("CARGO_BIN_EXE_feedstore"))
        .args(["stat", "--socket", daemon.socket.to_str().unwrap()])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&stat.stdout);
    assert!(
        text.contains("rank 0: at ") && text.contains("its trainer waited"),
        "{text}"
    );

    // A real Prometheus scrapes the daemon every second and answers a query for the ratio.
    let prom_port = free_port();
    std::fs::write(
        dir.join("prometheus.yml"),
        format!(
            "global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: feedstore\n    \
             static_configs:\n      - targets: ['127.0.0.1:{port}']\n"
        ),
    )
    .unwrap();
    let _prometheus = Killed(
        Command::new("prometheus")
            .arg(format!(
                "--config.file={}",
                dir.join("prometheus.yml").display()
            ))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("tsdb").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{prom_port}"))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("prometheus.log")).unwrap())
            .spawn()
            .expect("prometheus (Debian's prometheus package; ./scripts/test installs it)"),
    );
    let query = "/api/v1/query?query=feedstore_rank_wait_ratio%7Brank%3D%220%22%7D";
    let deadline = Instant::now() + Duration::from_secs(60);
    let answered = loop {
        if TcpStream::connect(("127.0.0.1", prom_port)).is_ok() {
            let (_, body) = get(prom_port, query);
            if body.contains("\"value\"") {
                break body;
            }
        }
        assert!(
            Instant::now() < deadline,
            "Prometheus did not answer within 60 s: {}",
            std::fs::read_to_string(dir.join("prometheus.log")).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(500));
    };
    let answer: serde_json::Value = serde_json::from_str(&answered).unwrap();
    let result = &answer["data"]["result"][0];
    assert_eq!(result["metric"]["stream"], "metrics \"run\" 1", "{answer}");
    let value: f64 = result["value"][1].as_str().unwrap().parse().unwrap();
    assert!(
        (value - own).abs() < 0.03,
        "Prometheus answers {value:.3}, the trainer measured {own:.3}"
    );

    // The trainer read the whole epoch: the producer sees the stream end.
    producer.join().unwrap();
    drop(stream);
}

#[test]
fn the_metrics_server_answers_only_what_it_serves() {
    let _w = watchdog(
        "the_metrics_server_answers_only_what_it_serves",
        Duration::from_secs(60),
    );
    let (_dir, port, _daemon) = daemon_with_metrics("metrics-http");
    assert!(get(port, "/").0.contains("404"));
    assert!(get(port, "/metrics?x=1").0.contains("200"));
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(b"POST /metrics HTTP/1.1\r\n\r\n").unwrap();
    let mut reply = String::new();
    s.read_to_string(&mut reply).unwrap();
    assert!(reply.starts_with("HTTP/1.1 405"), "{reply}");
    // A request head that never ends is cut off at its bound, not read forever.
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let junk = vec![b'x'; 8200];
    let _ = s.write_all(&junk);
    let mut reply = String::new();
    let _ = s.read_to_string(&mut reply);
    assert!(reply.starts_with("HTTP/1.1 431"), "{reply}");
}

/// A rank whose producer makes nothing has never reported (it took no sample), yet it shows as
/// waiting all its time: the daemon adds the wait under way.
#[test]
fn a_starving_rank_shows_as_waiting_before_it_reports() {
    let _w = watchdog(
        "a_starving_rank_shows_as_waiting_before_it_reports",
        Duration::from_secs(60),
    );
    let (_dir, port, daemon) = daemon_with_metrics("metrics-starving");
    let spec = StreamSpec {
        name: "starving".into(),
        records: 10,
        seed: 1,
        world: 1,
        shuffle: Shuffle::None,
        tail: Tail::Drop,
        epochs: Some(1),
    };
    // A producer joins (the stream exists) and makes nothing.
    let writer = connect(&daemon.socket, feedstore_consumer::Role::Writer);
    let _feeder = StreamFeeder::join(&writer, &spec, 4, &[StreamTask { rank: 0, seq: 0 }]).unwrap();
    let mut stream =
        Stream::open(&daemon.socket, &spec, 0, None, StreamOptions::default()).unwrap();
    let waited = stream.next_sample_within(Duration::from_millis(1500));
    assert!(
        matches!(waited, Err(feedstore_consumer::Error::Timeout(_))),
        "{waited:?}"
    );
    assert_eq!(stream.figures().taken, 0);
    let (_, scrape) = get(port, "/metrics");
    let labels = r#"{stream="starving",uid="0",rank="0"}"#;
    let ratio = sample(&scrape, &format!("feedstore_rank_wait_ratio{labels}")).unwrap();
    assert!(ratio > 0.99, "{ratio}: {scrape}");
    assert!(
        sample(
            &scrape,
            &format!("feedstore_rank_wait_seconds_total{labels}")
        )
        .unwrap()
            > 0.0
    );
}
