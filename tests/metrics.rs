//! The daemon's Prometheus metrics, scraped for real: `feedstored --metrics-addr` serves
//! `/metrics`; a stream is fed by a producer slower than its trainer, so the trainer waits part
//! of its time; the rank's wait-time ratio the daemon exports (from what the consumer reports
//! with its returns) agrees with the one the trainer measures around its own loop; `promtool
//! check metrics` accepts the scrape; a real Prometheus server scrapes the daemon and answers a
//! query for the rank's ratio. `feedstore stat` shows the rank's figures too. A stream fed by a
//! real `feedstore produce` and read by a slow trainer: the producer's stage profile reaches the
//! metrics, `feedstore stat` and `feedstore top`, with the verdict (trainer-bound).
//!
//! Needs `promtool` and `prometheus` (Debian's `prometheus` package; `./scripts/test` installs
//! it). Traffic stays on 127.0.0.1.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use feedstore_consumer::{Delivery, Made, Stream, StreamFeeder, StreamOptions, StreamTask};
use feedstore_proto::stream::{Shuffle, StreamSpec, Tail};

/// `text` as a URL query value.
fn url_encode(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
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

/// A producer thread feeding rank 0 of `spec`, one sample at a time, sleeping `pause(seq)`
/// before making each; it stops at the stream's end or once `stop` is set.
fn spawn_producer(
    socket: std::path::PathBuf,
    spec: StreamSpec,
    pause: fn(u64) -> Duration,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let client = connect(&socket, feedstore_consumer::Role::Writer);
        let feeder =
            StreamFeeder::join(&client, &spec, 4, &[StreamTask { rank: 0, seq: 0 }]).unwrap();
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            let Some(tasks) = feeder.take(1, Duration::from_millis(200)).unwrap() else {
                break;
            };
            let made = tasks
                .into_iter()
                .map(|task| {
                    std::thread::sleep(pause(task.seq));
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
}

/// `promtool check metrics` (Prometheus's own checker) accepts the scrape.
fn promtool_accepts(scrape: &str) {
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
}

/// The Grafana dashboard's queries.
fn dashboard_queries() -> Vec<String> {
    let dashboard: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/deploy/grafana/feedstore.json"
        ))
        .unwrap(),
    )
    .unwrap();
    let mut queries = Vec::new();
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().unwrap() {
            queries.push(target["expr"].as_str().unwrap().to_owned());
        }
    }
    queries
}

/// Every metric `expr` names (of those `which` picks) is in the scrape.
fn dashboard_names_are_exported(expr: &str, scrape: &str, which: impl Fn(&str) -> bool) {
    for name in expr
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|w| w.starts_with("feedstore_") && which(w))
    {
        assert!(
            scrape.contains(&format!("# TYPE {name} ")),
            "the dashboard queries {name}, which the daemon does not export"
        );
    }
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
        reshard: None,
    };
    let producer = spawn_producer(
        daemon.socket.clone(),
        spec.clone(),
        |_| Duration::from_millis(4),
        Default::default(),
    );
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

    let (status, scrape) = http_get(port, "/metrics");
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
    promtool_accepts(&scrape);

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
    let release = format!(
        "release         feedstore {} (protocols {}-{}); this connection speaks protocol {}",
        env!("CARGO_PKG_VERSION"),
        feedstore_proto::frame::MIN_VERSION,
        feedstore_proto::frame::VERSION,
        feedstore_proto::frame::VERSION
    );
    assert!(text.contains(&release), "{text}");

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
    let mut prometheus = Command::new("prometheus");
    // Killed by the kernel when this test process dies (a watchdog abort skips `Killed`'s drop).
    let die_with_parent = || {
        // SAFETY: prctl with these arguments only sets this process's parent-death signal.
        if unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) } == 0 {
            Ok(())
        } else {
            Err(std::io::Error::last_os_error())
        }
    };
    // SAFETY: the hook runs between fork and exec and only calls prctl, which is
    // async-signal-safe and allocates nothing.
    unsafe { std::os::unix::process::CommandExt::pre_exec(&mut prometheus, die_with_parent) };
    let _prometheus = Killed(
        prometheus
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
            let (_, body) = http_get(prom_port, query);
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

    // The Grafana dashboard's queries name metrics the daemon exports, and Prometheus runs
    // every one of them. (This stream's producer is a bare feeder that reports no profile: the
    // producer metrics are checked against a real producer's scrape below.)
    let mut queries = 0;
    for expr in dashboard_queries() {
        dashboard_names_are_exported(&expr, &scrape, |name| {
            !name.starts_with("feedstore_producer_")
        });
        let expr = expr
            .replace("$__rate_interval", "10s")
            .replace("$instance", ".*");
        let (_, body) = http_get(
            prom_port,
            &format!("/api/v1/query?query={}", url_encode(&expr)),
        );
        let answer: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(answer["status"], "success", "{expr}: {answer}");
        queries += 1;
    }
    assert!(queries >= 12, "{queries}");

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
    assert!(http_get(port, "/").0.contains("404"));
    let (status, scrape) = http_get(port, "/metrics?x=1");
    assert!(status.contains("200"), "{status}");
    let build = format!(
        r#"feedstore_build_info{{version="{}",protocol_min="{}",protocol="{}",peer_protocol="{}"}}"#,
        env!("CARGO_PKG_VERSION"),
        feedstore_proto::frame::MIN_VERSION,
        feedstore_proto::frame::VERSION,
        feedstore_proto::peer::PEER_VERSION
    );
    assert_eq!(sample(&scrape, &build), Some(1.0), "{build} in:\n{scrape}");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    let started = sample(
        &scrape,
        r#"feedstore_daemon_start_time_seconds{how="fresh"}"#,
    )
    .unwrap_or_else(|| panic!("a start time in:\n{scrape}"));
    assert!(
        started <= now && started > now - 600.0,
        "{started} is this daemon's start"
    );
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
    // Sixteen connections that say nothing hold every slot: the next is told so at once, and
    // the slots come back when the silent ones time out.
    let silent: Vec<TcpStream> = (0..16)
        .map(|_| TcpStream::connect(("127.0.0.1", port)).unwrap())
        .collect();
    std::thread::sleep(Duration::from_millis(200));
    assert!(http_get(port, "/metrics").0.contains("503"));
    // One more that says nothing is answered all the same, and closed: it holds nothing.
    let mut over = TcpStream::connect(("127.0.0.1", port)).unwrap();
    over.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut reply = String::new();
    over.read_to_string(&mut reply).unwrap();
    assert!(reply.starts_with("HTTP/1.1 503"), "{reply}");
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while !http_get(port, "/metrics").0.contains("200") {
        assert!(
            std::time::Instant::now() < deadline,
            "the slots never came back"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    drop(silent);
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
        reshard: None,
    };
    // The trainer opens the stream before any producer created it: the daemon shows it
    // waiting (in the metrics, `feedstore stat` and `feedstore top`), not nothing.
    let opening = {
        let (socket, spec) = (daemon.socket.clone(), spec.clone());
        std::thread::spawn(move || {
            Stream::open(&socket, &spec, 0, None, StreamOptions::default()).unwrap()
        })
    };
    let reader = daemon.reader();
    let deadline = Instant::now() + Duration::from_secs(30);
    while reader.stats().unwrap().attaches_waiting != 1 {
        assert!(Instant::now() < deadline, "the waiting open never showed");
        std::thread::sleep(Duration::from_millis(20));
    }
    let (_, scrape) = http_get(port, "/metrics");
    assert_eq!(
        sample(&scrape, "feedstore_attaches_waiting"),
        Some(1.0),
        "{scrape}"
    );
    for args in [&["stat"][..], &["top", "--count", "1"]] {
        let shown = Command::new(env!("CARGO_BIN_EXE_feedstore"))
            .args(args)
            .arg("--socket")
            .arg(&daemon.socket)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&shown.stdout);
        assert!(
            text.contains("1 trainer(s) waiting for a stream no producer has created"),
            "{args:?}: {text}"
        );
    }
    // A producer joins (the stream exists) and makes nothing.
    let writer = connect(&daemon.socket, feedstore_consumer::Role::Writer);
    let feeder = StreamFeeder::join(&writer, &spec, 4, &[StreamTask { rank: 0, seq: 0 }]).unwrap();
    let mut stream = opening.join().unwrap();
    assert_eq!(reader.stats().unwrap().attaches_waiting, 0);
    let waited = stream.next_sample_within(Duration::from_millis(1500));
    assert!(
        matches!(waited, Err(feedstore_consumer::Error::Timeout(_))),
        "{waited:?}"
    );
    assert_eq!(stream.figures().taken, 0);
    let (_, scrape) = http_get(port, "/metrics");
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

    // A producer makes the samples: the wait ends with the first, the trainer returns it (and
    // reports), then computes a long step. The daemon counts that time as the trainer's own
    // (its run time grows, its wait does not), not as more waiting until the next report.
    drop(feeder);
    let producer = spawn_producer(
        daemon.socket.clone(),
        spec.clone(),
        |_| Duration::ZERO,
        Default::default(),
    );
    drop(stream.next_sample().unwrap().expect("a sample"));
    // The report with its return: from here the daemon's estimate runs on from a report.
    stream.flush_returns();
    let counters = || {
        let (_, scrape) = http_get(port, "/metrics");
        let counter = |name: &str| sample(&scrape, &format!("{name}{labels}")).unwrap();
        (
            counter("feedstore_rank_wait_seconds_total"),
            counter("feedstore_rank_run_seconds_total"),
        )
    };
    let (waited, ran) = counters();
    std::thread::sleep(Duration::from_millis(700));
    let (waited_after, ran_after) = counters();
    assert!(
        ran_after - ran >= 0.6 && waited_after - waited < 0.1,
        "a 0.7 s step: run {ran:.3} -> {ran_after:.3} s, wait {waited:.3} -> {waited_after:.3} s"
    );
    while stream.next_sample().unwrap().is_some() {}
    producer.join().unwrap();
}

/// `feedstore top` in a real terminal (tmux on a server of its own): while a trainer reads a
/// stream fed by a slow producer, the view shows the stream, the rank's wait and a verdict.
#[test]
fn feedstore_top_shows_a_running_stream_in_a_terminal() {
    let _w = watchdog(
        "feedstore_top_shows_a_running_stream_in_a_terminal",
        Duration::from_secs(120),
    );
    let (dir, _port, daemon) = daemon_with_metrics("metrics-top");
    let spec = StreamSpec {
        name: "top-run".into(),
        records: 400,
        seed: 3,
        world: 1,
        shuffle: Shuffle::Full,
        tail: Tail::Drop,
        // Unbounded: the test stops the trainer itself, however slow the machine.
        epochs: None,
        reshard: None,
    };
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let producer = spawn_producer(
        daemon.socket.clone(),
        spec.clone(),
        |_| Duration::from_millis(10),
        stop.clone(),
    );
    let trainer = {
        let (socket, spec, stop) = (daemon.socket.clone(), spec.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut stream =
                Stream::open(&socket, &spec, 0, None, StreamOptions::default()).unwrap();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                match stream.next_sample() {
                    Ok(Some(_)) => std::thread::sleep(Duration::from_millis(2)),
                    _ => break,
                }
            }
        })
    };

    let server = format!("feedstore-top-{}", std::process::id());
    let tmux = |args: &[&str]| tmux(&server, args);
    let command = format!(
        "{} top --socket {} --interval 0.5",
        env!("CARGO_BIN_EXE_feedstore"),
        daemon.socket.display()
    );
    let started = tmux(&[
        "new-session",
        "-d",
        "-s",
        "top",
        "-x",
        "160",
        "-y",
        "40",
        &command,
    ]);
    assert!(started.status.success(), "{started:?}");
    let deadline = Instant::now() + Duration::from_secs(30);
    let screen = loop {
        let captured = tmux(&["capture-pane", "-p", "-t", "top"]);
        let screen = String::from_utf8_lossy(&captured.stdout).into_owned();
        // The first views may say "none yet" (the trainer has not taken a sample) or, while
        // the ring still holds what was made before the trainer started, "compute-bound":
        // the test waits for the verdict the steady state gives.
        if screen.contains("verdict: data-bound") {
            break screen;
        }
        if Instant::now() > deadline {
            let _ = tmux(&["kill-server"]);
            panic!(
                "no data-bound verdict within 30 s (the producer is 5x slower than the trainer):\n{screen}"
            );
        }
        std::thread::sleep(Duration::from_millis(300));
    };
    let _ = tmux(&["kill-server"]);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    trainer.join().unwrap();
    producer.join().unwrap();
    assert!(screen.contains("stream \"top-run\""), "{screen}");
    assert!(
        screen.contains("wait now") && screen.contains("samples/s"),
        "{screen}"
    );
    std::fs::write(dir.join("top-screen.txt"), &screen).unwrap();
}

/// A rank's counters only grow, scrape after scrape, while its trainer alternates between
/// waiting (a producer that stalls now and then) and computing between reports: the daemon's
/// estimate of a wait never falls back to an older report.
#[test]
fn rank_counters_never_go_back() {
    let _w = watchdog("rank_counters_never_go_back", Duration::from_secs(120));
    let (_dir, port, daemon) = daemon_with_metrics("metrics-monotonic");
    let spec = StreamSpec {
        name: "bursty".into(),
        records: 60,
        seed: 5,
        world: 1,
        shuffle: Shuffle::None,
        tail: Tail::Drop,
        epochs: Some(1),
        reshard: None,
    };
    let producer = spawn_producer(
        daemon.socket.clone(),
        spec.clone(),
        // Stall for a while every tenth sample.
        |seq| Duration::from_millis(if seq % 10 == 9 { 300 } else { 0 }),
        Default::default(),
    );
    let trainer = {
        let (socket, spec) = (daemon.socket.clone(), spec.clone());
        std::thread::spawn(move || {
            let mut stream =
                Stream::open(&socket, &spec, 0, None, StreamOptions::default()).unwrap();
            while let Some(sample) = stream.next_sample().unwrap() {
                drop(sample);
                std::thread::sleep(Duration::from_millis(40));
            }
            stream
        })
    };
    let labels = r#"{stream="bursty",uid="0",rank="0"}"#;
    let mut last = (0.0, 0.0);
    let mut scrapes = 0;
    while !trainer.is_finished() {
        let (_, scrape) = http_get(port, "/metrics");
        let waited = sample(
            &scrape,
            &format!("feedstore_rank_wait_seconds_total{labels}"),
        );
        let run = sample(
            &scrape,
            &format!("feedstore_rank_run_seconds_total{labels}"),
        );
        if let (Some(waited), Some(run)) = (waited, run) {
            assert!(
                waited >= last.0 && run >= last.1,
                "went back: wait {} -> {waited}, run {} -> {run}",
                last.0,
                last.1
            );
            last = (waited, run);
            scrapes += 1;
        }
        std::thread::sleep(Duration::from_millis(25));
    }
    let stream = trainer.join().unwrap();
    producer.join().unwrap();
    assert!(scrapes > 10, "{scrapes} scrapes saw the rank");
    assert!(last.0 > 0.0, "the trainer waited: {last:?}");
    // Growing never meant over-counting: once the trainer's last report is in, the daemon shows
    // what the trainer measured.
    let own = stream.figures();
    let (_, scrape) = http_get(port, "/metrics");
    let exported = sample(&scrape, &format!("feedstore_rank_wait_ratio{labels}")).unwrap();
    assert!(
        (exported - own.wait_ratio()).abs() < 0.03,
        "the daemon shows {exported:.3}, the trainer measured {:.3}",
        own.wait_ratio()
    );
    drop(stream);
}

/// The deployment files are what they claim: systemd accepts the unit (pointed at the binary
/// built here), and the daemon starts with the shipped `feedstore.toml` (flags for the socket,
/// capacity and port win over the file, as documented).
#[test]
fn the_systemd_unit_and_config_are_valid() {
    let _w = watchdog(
        "the_systemd_unit_and_config_are_valid",
        Duration::from_secs(60),
    );
    let dir = scratch_dir("deploy");
    let root = env!("CARGO_MANIFEST_DIR");
    if Command::new("systemd-analyze")
        .arg("--version")
        .output()
        .is_ok()
    {
        let unit = std::fs::read_to_string(format!("{root}/deploy/systemd/feedstored.service"))
            .unwrap()
            .replace(
                "/usr/local/bin/feedstored",
                env!("CARGO_BIN_EXE_feedstored"),
            );
        let path = dir.join("feedstored.service");
        std::fs::write(&path, unit).unwrap();
        let verified = Command::new("systemd-analyze")
            .args(["verify", "--man=no"])
            .arg(&path)
            .output()
            .unwrap();
        let said = String::from_utf8_lossy(&verified.stderr);
        assert!(
            verified.status.success() && !said.contains("feedstored.service"),
            "systemd-analyze verify: {said}"
        );
    } else {
        eprintln!("SKIPPED the unit check: no systemd-analyze here");
    }
    let port = free_port();
    let _daemon = DaemonProcess::start(
        &dir,
        &[
            "--config",
            &format!("{root}/deploy/systemd/feedstore.toml"),
            "--metrics-addr",
            &format!("127.0.0.1:{port}"),
        ],
    );
    assert!(http_get(port, "/metrics").0.contains("200"));
}

/// A stream fed by a real `feedstore produce` and read by a slow trainer: the producer reports
/// its stage profile to the daemon, which exports it (stage times and items, cache hits, the
/// time it waited on full windows) and shows it in `feedstore stat` and `feedstore top`, with
/// the verdict: trainer-bound, the producer keeps up.
#[test]
fn a_streams_producer_reports_its_stage_profile() {
    let _w = watchdog(
        "a_streams_producer_reports_its_stage_profile",
        Duration::from_secs(240),
    );
    let (dir, port, daemon) = daemon_with_metrics("metrics-producer");
    let tokenizer = tokenizer_file(&dir);
    let turns = serde_json::json!([
        {"from": "human", "value": "<image>\nWhat is this?"},
        {"from": "gpt", "value": "A black square."},
    ]);
    let lines: Vec<String> = (0..8)
        .map(|i| {
            let image = dir.join(format!("{i}.png"));
            std::fs::write(&image, png(96, 64)).unwrap();
            llava(&format!("r{i}"), image.to_str().unwrap(), &turns)
        })
        .collect();
    let manifest = dir.join("m.jsonl");
    std::fs::write(&manifest, lines.join("\n")).unwrap();
    // Two epochs: the second comes from the decode-once cache.
    let mut producer = KillOnDrop(
        produce_command(&daemon.socket, &manifest, &tokenizer)
            .args(["--workers", "1", "--stream", "prof", "--seed", "3"])
            .args(["--epochs", "2", "--prefetch", "2"])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("produce.log")).unwrap())
            .spawn()
            .unwrap(),
    );
    let spec = StreamSpec {
        name: "prof".into(),
        records: 8,
        seed: 3,
        world: 1,
        shuffle: Shuffle::Full,
        tail: Tail::Drop,
        epochs: Some(2),
        reshard: None,
    };
    let mut stream = Stream::open(
        &daemon.socket,
        &spec,
        0,
        None,
        StreamOptions {
            wait: Duration::from_secs(60),
            ..StreamOptions::default()
        },
    )
    .unwrap();
    // A trainer far slower than the producer: 150 ms a sample, a window of two.
    let mut taken = 0;
    let mut top_view = String::new();
    while let Some(sample) = stream.next_sample().unwrap() {
        drop(sample);
        taken += 1;
        std::thread::sleep(Duration::from_millis(150));
        if taken == 12 {
            let top = Command::new(env!("CARGO_BIN_EXE_feedstore"))
                .args(["top", "--count", "1", "--socket"])
                .arg(&daemon.socket)
                .output()
                .unwrap();
            top_view = String::from_utf8_lossy(&top.stdout).into_owned();
        }
    }
    assert_eq!(taken, 16, "both epochs");
    assert!(
        top_view.contains("producers: 1 CPU worker(s)") && top_view.contains("trainer-bound"),
        "feedstore top shows the producer's profile and verdict:\n{top_view}"
    );
    let status = wait_child(&mut producer.0, Duration::from_secs(60));
    assert!(
        status.success(),
        "{}",
        std::fs::read_to_string(dir.join("produce.log")).unwrap_or_default()
    );

    // The producer has gone; what it reported stays with the stream (its last report included
    // the CPU workers' last samples).
    let (_, scrape) = http_get(port, "/metrics");
    let labels = |stage: &str| format!(r#"{{stream="prof",uid="0",stage="{stage}"}}"#);
    for stage in ["fetch", "decode", "resize", "tokenize", "write"] {
        assert_eq!(
            sample(
                &scrape,
                &format!("feedstore_producer_stage_items_total{}", labels(stage))
            ),
            Some(8.0),
            "{stage}: each record made once, the second epoch from the cache\n{scrape}"
        );
        assert!(
            sample(
                &scrape,
                &format!(
                    "feedstore_producer_stage_busy_seconds_total{}",
                    labels(stage)
                )
            )
            .unwrap()
                > 0.0,
            "{stage}"
        );
    }
    for expr in dashboard_queries() {
        dashboard_names_are_exported(&expr, &scrape, |_| true);
    }
    let stream_labels = r#"{stream="prof",uid="0"}"#;
    let value = |name: &str| {
        sample(&scrape, &format!("{name}{stream_labels}"))
            .unwrap_or_else(|| panic!("no {name} in:\n{scrape}"))
    };
    assert_eq!(value("feedstore_producer_cache_hit_samples_total"), 8.0);
    assert_eq!(value("feedstore_producer_fetches_total"), 8.0);
    assert!(value("feedstore_producer_fetched_bytes_total") > 0.0);
    assert_eq!(
        value("feedstore_producer_cpu_workers"),
        0.0,
        "none joined now"
    );
    let (run, waited) = (
        value("feedstore_producer_run_seconds_total"),
        value("feedstore_producer_backpressure_seconds_total"),
    );
    assert!(
        waited > 0.5 * (run - value("feedstore_producer_startup_seconds_total")),
        "the producer waited on full windows most of its time: {waited:.2} of {run:.2} s"
    );
    promtool_accepts(&scrape);

    // `feedstore stat` prints the same profile, its table and its verdict.
    let stat = Command::new(env!("CARGO_BIN_EXE_feedstore"))
        .args(["stat", "--json", "--socket"])
        .arg(&daemon.socket)
        .output()
        .unwrap();
    let json: serde_json::Value = serde_json::from_slice(&stat.stdout).unwrap();
    assert_eq!(
        json["daemon"]["release"],
        env!("CARGO_PKG_VERSION"),
        "{json}"
    );
    assert_eq!(
        json["daemon"]["protocol_max"],
        feedstore_proto::frame::VERSION,
        "{json}"
    );
    let producer = &json["streams"][0]["producer"];
    assert_eq!(producer["stage_items"]["decode"], 8, "{producer}");
    assert!(
        producer["verdict"]
            .as_str()
            .unwrap()
            .starts_with("trainer-bound"),
        "{producer}"
    );
    drop(stream);
}
