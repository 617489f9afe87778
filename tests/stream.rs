//! Streams end to end with real processes: a `feedstored`, producer processes making samples for
//! every rank, and one consumer process per rank reading its share through the shared-memory
//! ring. Ranks get disjoint, equal shares whose union is every record, in an order fixed by the
//! seed; and after every process (the daemon included) is killed with `kill -9` at random
//! moments and restarted from the consumers' saved states, the per-rank sequences equal an
//! uninterrupted run's.

mod common;

use std::collections::BTreeSet;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::*;
use feedstore_consumer::{
    Delivery, Made, RankAt, StoreStats, Stream, StreamFeeder, StreamOptions, StreamTask,
    stacked_image,
};
use feedstore_proto::sample::{BatchPlan, DType, SampleInfo, SamplePlan, TensorLayout};
use feedstore_proto::stream::{Shuffle, StreamSpec, StreamState, Tail};

const PAYLOAD: usize = 96;

fn spec(name: &str, records: u64, seed: u64, world: u32, epochs: u64) -> StreamSpec {
    StreamSpec {
        name: name.into(),
        records,
        seed,
        world,
        shuffle: Shuffle::Full,
        tail: Tail::Drop,
        epochs: Some(epochs),
        reshard: None,
    }
}

/// The spec as a child process's words: name, records, seed, world, epochs, and the reshard's
/// text (`-` for none).
fn spec_args(s: &StreamSpec) -> String {
    format!(
        "{} {} {} {} {} {}",
        s.name,
        s.records,
        s.seed,
        s.world,
        s.epochs.unwrap(),
        s.reshard.as_ref().map_or("-".into(), |r| r.to_text())
    )
}

fn parse_spec<'a>(words: &mut impl Iterator<Item = &'a str>) -> StreamSpec {
    let mut n = || words.next().unwrap();
    let name = n().to_owned();
    let (records, seed, world, epochs) = (
        n().parse().unwrap(),
        n().parse().unwrap(),
        n().parse().unwrap(),
        n().parse().unwrap(),
    );
    let mut s = spec(&name, records, seed, world, epochs);
    let reshard = n();
    if reshard != "-" {
        let reshard = feedstore_proto::reshard::Reshard::from_text(&s, reshard).unwrap();
        s.reshard = Some(std::sync::Arc::new(reshard));
    }
    s
}

/// A consumer's checkpoint file: its state and the records it consumed up to it.
struct Checkpoint {
    state: Option<StreamState>,
    done: bool,
    records: Vec<u64>,
}

impl Checkpoint {
    fn read(path: &Path) -> Checkpoint {
        let Ok(text) = std::fs::read_to_string(path) else {
            return Checkpoint {
                state: None,
                done: false,
                records: Vec::new(),
            };
        };
        let mut lines = text.lines();
        let state = StreamState::from_text(lines.next().unwrap());
        let done = lines.next() == Some("done");
        let records = lines
            .next()
            .unwrap_or("")
            .split_whitespace()
            .map(|r| r.parse().unwrap())
            .collect();
        Checkpoint {
            state,
            done,
            records,
        }
    }

    /// Written whole or not at all (rename), as a trainer's checkpoint is.
    fn write(&self, path: &Path) {
        let tmp = path.with_extension("tmp");
        let records: Vec<String> = self.records.iter().map(u64::to_string).collect();
        std::fs::write(
            &tmp,
            format!(
                "{}\n{}\n{}\n",
                self.state.map_or("start".into(), |s| s.to_text()),
                if self.done { "done" } else { "running" },
                records.join(" ")
            ),
        )
        .unwrap();
        std::fs::rename(&tmp, path).unwrap();
    }
}

/// The sample for a task: an object holding its record's pattern, filed in the decode-once
/// cache under a key of its record (as feedstore's producer files what it makes).
fn delivery(client: &feedstore_consumer::Client, spec: &StreamSpec, task: StreamTask) -> Delivery {
    let record = spec.record_at(task.rank, task.seq);
    let mut w = client.create(PAYLOAD as u64).unwrap();
    w.as_mut_slice().copy_from_slice(&pattern(record, PAYLOAD));
    Delivery {
        task,
        record,
        key: cache_key(record),
        made: Made::Written(w),
    }
}

/// The cache key test producers file record `record`'s sample under.
fn cache_key(record: u64) -> u128 {
    0x5eed_0000_0000_0000_0000_0000_0000_0000 | (u128::from(record) + 1)
}

/// The image every batched sample of `record` carries: 3×4×4 f32 (192 bytes, a multiple of
/// 64), every element the record's number.
const BATCHED_IMAGE: [u32; 3] = [3, 4, 4];

/// One object holding the samples of `tasks` (one batch of a rank), image 0 of each side by
/// side: the image filled with its record's number, tokens `[record, seq]`.
fn batched_delivery(
    client: &feedstore_consumer::Client,
    spec: &StreamSpec,
    tasks: &[StreamTask],
) -> (BatchPlan, feedstore_consumer::ObjectWriter) {
    let records: Vec<u64> = tasks
        .iter()
        .map(|t| spec.record_at(t.rank, t.seq))
        .collect();
    let infos: Vec<SampleInfo> = records
        .iter()
        .map(|r| SampleInfo {
            id: format!("record-{r}"),
            ..SampleInfo::default()
        })
        .collect();
    let plans = tasks
        .iter()
        .map(|_| {
            let mut plan = SamplePlan::new();
            plan.add_image(DType::F32, TensorLayout::Chw, &BATCHED_IMAGE);
            plan.set_token_count(2);
            plan
        })
        .collect();
    let plan = BatchPlan::new(plans, &infos).unwrap();
    let mut object = client.create(plan.object_bytes()).unwrap();
    for (i, task) in tasks.iter().enumerate() {
        let mut regions = plan.regions(object.as_mut_slice(), i).unwrap();
        bytemuck::cast_slice_mut::<u8, f32>(regions.images[0]).fill(records[i] as f32);
        regions
            .tokens
            .copy_from_slice(&[records[i] as u32, task.seq as u32]);
        plan.finish(object.as_mut_slice(), i, &infos[i]).unwrap();
    }
    (plan, object)
}

#[test]
#[ignore = "run as a child process by the tests below"]
fn child_process() {
    let Ok(task) = std::env::var(CHILD_ENV) else {
        return;
    };
    let socket = PathBuf::from(std::env::var("FEEDSTORE_SOCKET").unwrap());
    let mut words = task.split_whitespace();
    match words.next() {
        // Make every rank's samples: each object's bytes are the pattern of its record.
        Some("produce") => {
            let spec = parse_spec(&mut words);
            // rank:seq pairs, from the consumers' checkpoints; @rank=host:port for ranks whose
            // consumers use another node's daemon.
            let (mut ranks, mut at, mut relay) = (Vec::new(), Vec::new(), String::new());
            for w in words {
                if let Some(addr) = w.strip_prefix("relay=") {
                    relay = addr.into();
                    continue;
                }
                if let Some(placed) = w.strip_prefix('@') {
                    let (rank, addr) = placed.split_once('=').unwrap();
                    at.push(RankAt {
                        rank: rank.parse().unwrap(),
                        addr: addr.into(),
                    });
                    continue;
                }
                let (rank, seq) = w.split_once(':').unwrap();
                ranks.push(StreamTask {
                    rank: rank.parse().unwrap(),
                    seq: seq.parse().unwrap(),
                });
            }
            let client = feedstore_consumer::ConnectOptions::new(feedstore_consumer::Role::Writer)
                .socket(&socket)
                .connect()
                .unwrap();
            let feeder = StreamFeeder::join_at(&client, &spec, 8, &ranks, &at, &relay).unwrap();
            println!("READY");
            std::io::stdout().flush().unwrap();
            // As feedstore's producer does: each put sent, its reply read after the next one's
            // samples are made (so a kill -9 lands between a put and its reply too).
            let confirm = |put: feedstore_consumer::PendingPut| {
                for r in put.wait().unwrap() {
                    // A resume can move a window past a task in flight; anything else is a bug.
                    if let Err(e) = r {
                        assert!(matches!(e, feedstore_consumer::Error::Stale { .. }), "{e}");
                    }
                }
            };
            let mut sent = None;
            while let Some(tasks) = feeder.take(16, Duration::from_millis(200)).unwrap() {
                let made = tasks
                    .into_iter()
                    .map(|task| delivery(&client, &spec, task))
                    .collect();
                if let Some(put) = sent.take() {
                    confirm(put);
                }
                sent = Some(feeder.submit_put(made).unwrap());
            }
            if let Some(put) = sent {
                confirm(put);
            }
        }
        // Make every rank's samples a batch per object, pausing after each batch.
        Some("produce-batched") => {
            let spec = parse_spec(&mut words);
            let batch: u32 = words.next().unwrap().parse().unwrap();
            let pause = Duration::from_millis(words.next().unwrap().parse().unwrap());
            let ranks: Vec<StreamTask> = words
                .map(|w| {
                    let (rank, seq) = w.split_once(':').unwrap();
                    StreamTask {
                        rank: rank.parse().unwrap(),
                        seq: seq.parse().unwrap(),
                    }
                })
                .collect();
            let client = feedstore_consumer::ConnectOptions::new(feedstore_consumer::Role::Writer)
                .socket(&socket)
                .connect()
                .unwrap();
            let feeder =
                StreamFeeder::join_batched(&client, &spec, 2 * batch, batch, &ranks).unwrap();
            println!("READY");
            std::io::stdout().flush().unwrap();
            let same_batch = |a: &StreamTask, b: &StreamTask| {
                a.rank == b.rank && a.seq / u64::from(batch) == b.seq / u64::from(batch)
            };
            while let Some(tasks) = feeder.take(1, Duration::from_millis(200)).unwrap() {
                for group in tasks.chunk_by(same_batch) {
                    let (plan, object) = batched_delivery(&client, &spec, group);
                    let made: Vec<(StreamTask, u64)> = group
                        .iter()
                        .map(|&t| (t, spec.record_at(t.rank, t.seq)))
                        .collect();
                    for r in feeder.put_batch(&made, &plan, object).unwrap() {
                        if let Err(e) = r {
                            assert!(matches!(e, feedstore_consumer::Error::Stale { .. }), "{e}");
                        }
                    }
                    std::thread::sleep(pause);
                }
            }
        }
        // Read one rank's share from its checkpoint on, checking each sample is the record the
        // spec puts there, saving a checkpoint every few samples.
        Some("consume") => {
            let spec = parse_spec(&mut words);
            let rank: u32 = words.next().unwrap().parse().unwrap();
            let path = PathBuf::from(words.next().unwrap());
            let every: usize = words.next().unwrap().parse().unwrap();
            let pause = Duration::from_micros(words.next().unwrap().parse().unwrap());
            // "hold": keep the first sample read to the end, and check it reads the same then.
            let hold = words.next() == Some("hold");
            let mut held = None;
            let mut checkpoint = Checkpoint::read(&path);
            let mut stream = Stream::open(
                &socket,
                &spec,
                rank,
                checkpoint.state,
                StreamOptions {
                    wait: Duration::from_secs(60),
                    ..StreamOptions::default()
                },
            )
            .unwrap();
            println!("READY");
            std::io::stdout().flush().unwrap();
            let mut since = 0;
            while let Some(sample) = stream.next_sample().unwrap() {
                assert_eq!(sample.record(), spec.record_at(rank, sample.seq()));
                assert!(
                    *sample == pattern(sample.record(), PAYLOAD)[..],
                    "bytes of {sample:?}"
                );
                checkpoint.records.push(sample.record());
                if hold && held.is_none() {
                    held = Some(sample);
                }
                std::thread::sleep(pause);
                since += 1;
                if since == every {
                    since = 0;
                    checkpoint.state = Some(stream.state());
                    checkpoint.write(&path);
                }
            }
            checkpoint.state = Some(stream.state());
            checkpoint.done = true;
            checkpoint.write(&path);
            if let Some(sample) = held {
                assert!(
                    *sample == pattern(sample.record(), PAYLOAD)[..],
                    "the sample held from the start reads its own bytes at the end: {sample:?}"
                );
            }
            println!("reattached {}", stream.reattached());
        }
        other => panic!("unknown child task {other:?}"),
    }
}

/// Starts the producers and one consumer per rank from their checkpoints; `reconnect`: all of
/// them reconnect when the daemon goes away, and each consumer holds its first sample to its
/// end.
fn start_all(
    socket: &Path,
    spec: &StreamSpec,
    producers: usize,
    dir: &Path,
    pause_us: u64,
    reconnect: bool,
) -> Vec<ClientProcess> {
    let env: &[(&str, &str)] = if reconnect {
        &[(feedstore_proto::RECONNECT_ENV, "30")]
    } else {
        &[]
    };
    let starts: Vec<String> = (0..spec.world)
        .map(|r| {
            let seq = Checkpoint::read(&dir.join(format!("rank{r}")))
                .state
                .map_or(0, |s| s.seq(spec));
            format!("{r}:{seq}")
        })
        .collect();
    let mut procs = Vec::new();
    for _ in 0..producers {
        let mut p = ClientProcess::spawn_with(
            socket,
            &format!("produce {} {}", spec_args(spec), starts.join(" ")),
            env,
        );
        p.ready();
        procs.push(p);
    }
    for rank in 0..spec.world {
        let path = dir.join(format!("rank{rank}"));
        if Checkpoint::read(&path).done {
            continue;
        }
        let mut c = ClientProcess::spawn_with(
            socket,
            &format!(
                "consume {} {rank} {} 5 {pause_us}{}",
                spec_args(spec),
                path.display(),
                if reconnect { " hold" } else { "" }
            ),
            env,
        );
        c.ready();
        procs.push(c);
    }
    procs
}

/// Runs a stream to its end without interruption; returns each rank's records.
fn run(spec: &StreamSpec, producers: usize) -> Vec<Vec<u64>> {
    let dir = scratch_dir(&format!("stream-{}", spec.seed));
    let daemon = DaemonProcess::start(&dir, &[]);
    let procs = start_all(&daemon.socket, spec, producers, &dir, 0, false);
    for mut p in procs {
        let status = wait_child(&mut p.child, Duration::from_secs(120));
        assert!(status.success(), "{status}");
    }
    let stats = daemon.reader().stats().unwrap();
    assert_eq!(stats.leases, 0, "every sample returned: {stats:?}");
    // Nothing leaked: what is left is the samples themselves, sealed and evictable (the
    // decode-once cache's level), and nothing half-written.
    let aligned = (PAYLOAD as u64).next_multiple_of(feedstore_proto::OBJECT_ALIGN_BYTES);
    assert_eq!(stats.objects_writing, 0);
    assert_eq!(
        stats.used_bytes,
        stats.objects_sealed * aligned,
        "{stats:?}"
    );
    (0..spec.world)
        .map(|r| {
            let c = Checkpoint::read(&dir.join(format!("rank{r}")));
            assert!(c.done);
            c.records
        })
        .collect()
}

#[test]
fn ranks_get_disjoint_equal_shares_in_the_seeds_order() {
    let _w = watchdog("ranks_get_disjoint_equal_shares", Duration::from_secs(240));
    let s = spec("shares", 96, 11, 4, 3);
    let per_rank = s.per_rank() as usize;
    let first = run(&s, 2);
    for epoch in 0..3 {
        let mut union = BTreeSet::new();
        for rank in &first {
            assert_eq!(rank.len(), per_rank * 3, "every rank the same count");
            let share = &rank[epoch * per_rank..(epoch + 1) * per_rank];
            for r in share {
                assert!(
                    union.insert(*r),
                    "record {r} went to two ranks in epoch {epoch}"
                );
            }
        }
        assert_eq!(
            union,
            (0..96).collect(),
            "epoch {epoch} covers every record once"
        );
    }
    assert_ne!(
        first[0][..per_rank],
        first[0][per_rank..2 * per_rank],
        "epochs reshuffle"
    );
    assert_eq!(
        run(&s, 1),
        first,
        "same seed, same order (one producer instead of two)"
    );
    let other = run(
        &StreamSpec {
            seed: 12,
            name: "shares2".into(),
            ..s
        },
        2,
    );
    assert_ne!(other, first, "another seed, another order");
}

#[test]
fn kill_everything_and_resume_exactly() {
    let _w = watchdog(
        "kill_everything_and_resume_exactly",
        Duration::from_secs(600),
    );
    let s = spec("resume", 96, 5, 4, 3);
    let reference = run(&s, 2);
    let mut rng = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
        | 1;
    eprintln!("kill schedule seed {rng}");
    for trial in 0..3 {
        let dir = scratch_dir(&format!("stream-kill-{trial}"));
        let mut rounds = 0;
        loop {
            let unfinished = (0..s.world)
                .filter(|r| !Checkpoint::read(&dir.join(format!("rank{r}"))).done)
                .count();
            if unfinished == 0 {
                break;
            }
            rounds += 1;
            assert!(rounds < 60, "no progress after {rounds} restarts");
            let mut daemon = DaemonProcess::start(&dir, &[]);
            let procs = start_all(&daemon.socket, &s, 2, &dir, 3000, false);
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            // Kill at a random moment, mostly mid-epoch; after a few rounds, run to the end.
            let limit = if rounds < 8 {
                Duration::from_millis(20 + rng % 120)
            } else {
                Duration::from_secs(120)
            };
            let started = Instant::now();
            let mut procs: Vec<Option<ClientProcess>> = procs.into_iter().map(Some).collect();
            while started.elapsed() < limit && procs.iter().flatten().count() > 0 {
                for p in procs.iter_mut() {
                    if p.as_mut()
                        .is_some_and(|c| c.child.try_wait().unwrap().is_some())
                    {
                        let status = p.take().unwrap().child.wait().unwrap();
                        assert!(status.success(), "a process failed: {status}");
                    }
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            for mut p in procs.into_iter().flatten() {
                // It may have finished on its own just now; otherwise it dies mid-work.
                let pid = nix::unistd::Pid::from_raw(p.child.id() as i32);
                let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
                let status = wait_child(&mut p.child, Duration::from_secs(20));
                use std::os::unix::process::ExitStatusExt;
                assert!(
                    status.success() || status.signal() == Some(libc::SIGKILL),
                    "{status}"
                );
            }
            let pid = nix::unistd::Pid::from_raw(daemon.child.id() as i32);
            nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL).unwrap();
            daemon.child.wait().unwrap();
            let progress: Vec<usize> = (0..s.world)
                .map(|r| {
                    Checkpoint::read(&dir.join(format!("rank{r}")))
                        .records
                        .len()
                })
                .collect();
            eprintln!(
                "trial {trial} round {rounds}: killed everything after {limit:?}; samples checkpointed per rank {progress:?}"
            );
        }
        let resumed: Vec<Vec<u64>> = (0..s.world)
            .map(|r| Checkpoint::read(&dir.join(format!("rank{r}"))).records)
            .collect();
        assert!(rounds >= 2, "the run was interrupted at least once");
        assert_eq!(
            resumed, reference,
            "trial {trial}: after {rounds} rounds of kill -9 and resume, every rank read exactly the uninterrupted sequence"
        );
    }
}

/// `feedstored --takeover` mid-epoch, then kill -9 on the daemon alone, three times, each time
/// started again on the same socket (at once, after 0.3 s, after 1 s): the producers and
/// consumers, which reconnect, go on by themselves, and every rank reads exactly the
/// uninterrupted sequence; a sample each consumer held from its start, before all four, still
/// reads its own bytes at the end.
#[test]
fn a_daemon_killed_and_started_again_loses_and_repeats_no_sample() {
    let _w = watchdog(
        "a_daemon_killed_and_started_again",
        Duration::from_secs(600),
    );
    let s = spec("restart", 96, 9, 2, 3);
    let reference = run(&s, 1);
    let dir = scratch_dir("stream-daemon-restart");
    let mut daemon = DaemonProcess::start(&dir, &[]);
    let mut procs = start_all(&daemon.socket, &s, 2, &dir, 20_000, true);
    let mut unfinished_at_kills = Vec::new();
    // First a takeover (`feedstored --takeover`: the old daemon exits), then three kill -9s.
    for pause_ms in [None, Some(0), Some(300), Some(1000)] {
        std::thread::sleep(Duration::from_millis(150));
        unfinished_at_kills.push(
            (0..s.world)
                .filter(|r| !Checkpoint::read(&dir.join(format!("rank{r}"))).done)
                .count(),
        );
        let Some(pause_ms) = pause_ms else {
            daemon = daemon.take_over(&dir, &[]);
            continue;
        };
        let pid = nix::unistd::Pid::from_raw(daemon.child.id() as i32);
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL).unwrap();
        daemon.child.wait().unwrap();
        std::thread::sleep(Duration::from_millis(pause_ms));
        daemon = DaemonProcess::start(&dir, &[]);
    }
    let reattached: u64 = procs
        .iter_mut()
        .map(|p| p.finish_reattached(Duration::from_secs(120)))
        .sum();
    assert!(
        unfinished_at_kills.iter().all(|&n| n == s.world as usize),
        "every kill landed mid-run (unfinished ranks at each: {unfinished_at_kills:?})"
    );
    assert!(
        reattached >= 4,
        "the consumers attached again ({reattached} times in all)"
    );
    let resumed: Vec<Vec<u64>> = (0..s.world)
        .map(|r| Checkpoint::read(&dir.join(format!("rank{r}"))).records)
        .collect();
    assert_eq!(
        resumed, reference,
        "after a takeover and three kill -9s of the daemon alone, every rank read exactly the uninterrupted sequence"
    );
}

#[test]
fn stream_misuse_gets_clear_errors() {
    let _w = watchdog("stream_misuse_gets_clear_errors", Duration::from_secs(60));
    let dir = scratch_dir("stream-errors");
    let daemon = DaemonProcess::start(&dir, &[]);
    let s = spec("errors", 16, 1, 2, 1);
    let options = StreamOptions {
        wait: Duration::from_millis(300),
        ..StreamOptions::default()
    };
    // No producer made the stream: opening it fails after the wait, saying why.
    let err = Stream::open(&daemon.socket, &s, 0, None, options.clone()).unwrap_err();
    assert!(
        matches!(&err, feedstore_consumer::Error::Timeout(m) if m.contains("producer") && m.contains("errors")),
        "{err}"
    );
    // A producer made it but makes nothing: the first sample fails after the wait.
    let client = daemon.writer();
    let feeder = StreamFeeder::join(&client, &s, 4, &[StreamTask { rank: 0, seq: 0 }]).unwrap();
    let mut stream = Stream::open(&daemon.socket, &s, 0, None, options.clone()).unwrap();
    let err = stream.next_sample().unwrap_err();
    assert!(
        matches!(&err, feedstore_consumer::Error::Timeout(m) if m.contains("producers")),
        "{err}"
    );
    // The same name with another seed is another stream: refused.
    let other = StreamSpec {
        seed: 2,
        ..s.clone()
    };
    let err = Stream::open(&daemon.socket, &other, 1, None, options.clone()).unwrap_err();
    assert!(
        matches!(err, feedstore_consumer::Error::StreamMismatch(_)),
        "{err}"
    );
    // A state saved by rank 0 cannot resume rank 1, nor a state of another spec.
    let state = stream.state();
    let err = Stream::open(&daemon.socket, &s, 1, Some(state), options.clone()).unwrap_err();
    assert!(
        matches!(err, feedstore_consumer::Error::StreamMismatch(_)),
        "{err}"
    );
    let err = Stream::open(&daemon.socket, &other, 0, Some(state), options.clone()).unwrap_err();
    assert!(
        matches!(err, feedstore_consumer::Error::StreamMismatch(_)),
        "{err}"
    );
    // A second consumer of a rank that has one: refused, saying so (a restarted worker tries
    // another rank of its node on this error).
    let err = Stream::open(&daemon.socket, &s, 0, None, options.clone()).unwrap_err();
    assert!(
        matches!(&err, feedstore_consumer::Error::RankInUse(m) if m.contains("already has a consumer")),
        "{err}"
    );
    // A rank outside the world.
    let err = Stream::open(&daemon.socket, &s, 2, None, options).unwrap_err();
    assert!(
        matches!(err, feedstore_consumer::Error::InvalidArgument(_)),
        "{err}"
    );
    // Holding the whole prefetch depth: the stream says so instead of waiting forever.
    let tasks = feeder.take(8, Duration::from_millis(100)).unwrap().unwrap();
    let made = tasks
        .into_iter()
        .map(|task| delivery(&client, &s, task))
        .collect();
    assert!(feeder.put(made).unwrap().iter().all(Result::is_ok));
    let held: Vec<_> = (0..4)
        .map(|_| stream.next_sample().unwrap().unwrap())
        .collect();
    assert_eq!(held.len(), 4);
    let err = stream.next_sample().unwrap_err();
    assert!(
        matches!(err, feedstore_consumer::Error::WindowFull { .. }),
        "{err}"
    );
}

/// A stream of 64 samples for one rank, depth 8, fed by a thread that makes whatever the window
/// allows, read by `read` (which gets the stream and its spec); returns what `read` returned and
/// how many held samples the window moved past.
fn with_fed_stream<T>(name: &str, read: impl FnOnce(&mut Stream, &StreamSpec) -> T) -> (T, u64) {
    let dir = scratch_dir(&format!("stream-{name}"));
    let daemon = DaemonProcess::start(&dir, &[]);
    let s = spec(name, 64, 5, 1, 1);
    let client = daemon.writer();
    let feeder = StreamFeeder::join(&client, &s, 8, &[StreamTask { rank: 0, seq: 0 }]).unwrap();
    let options = StreamOptions {
        wait: Duration::from_secs(20),
        return_batch: 1,
    };
    let mut stream = Stream::open(&daemon.socket, &s, 0, None, options).unwrap();
    let out = std::thread::scope(|scope| {
        scope.spawn(|| {
            let mut made = 0;
            while made < 64 {
                let tasks = feeder
                    .take(64, Duration::from_millis(100))
                    .unwrap()
                    .unwrap();
                made += tasks.len();
                let items = tasks
                    .into_iter()
                    .map(|t| delivery(&client, &s, t))
                    .collect();
                assert!(feeder.put(items).unwrap().iter().all(Result::is_ok));
            }
        });
        read(&mut stream, &s)
    });
    (out, stream.passed_held())
}

/// A sample a trainer keeps (a label for a log, a view for an epoch) holds its place in the
/// window only until half the depth of later samples came back: the stream reads on past
/// `depth` more samples, and the kept sample's bytes stay its own (its lease keeps the object,
/// and the store reuses none of it).
#[test]
fn a_sample_held_long_does_not_stall_the_stream() {
    let _w = watchdog(
        "a_sample_held_long_does_not_stall_the_stream",
        Duration::from_secs(60),
    );
    let (kept, passed) = with_fed_stream("held-long", |stream, s| {
        // Samples 3 and 40 are kept; every other is dropped at once.
        let mut kept = Vec::new();
        while let Some(sample) = stream.next_sample().unwrap() {
            assert_eq!(
                &sample[..],
                &pattern(s.record_at(0, sample.seq()), PAYLOAD)[..]
            );
            if sample.seq() == 3 || sample.seq() == 40 {
                kept.push(sample);
            }
        }
        for k in &kept {
            assert_eq!(&k[..], &pattern(s.record_at(0, k.seq()), PAYLOAD)[..]);
        }
        kept.iter().map(|k| k.seq()).collect::<Vec<_>>()
    });
    assert_eq!((kept, passed), (vec![3, 40], 2));
}

/// Passing is bounded: a consumer keeping one sample in four keeps at most `depth` passed
/// samples' objects leased; past that the window stops moving and the stream says
/// `WindowFull`, as it did before passing, and goes on once the kept samples are dropped.
#[test]
fn kept_samples_are_passed_only_up_to_the_depth() {
    let _w = watchdog(
        "kept_samples_are_passed_only_up_to_the_depth",
        Duration::from_secs(60),
    );
    let ((full, read), _) = with_fed_stream("kept-bounded", |stream, s| {
        let (mut kept, mut full, mut read) = (Vec::new(), 0, 0);
        loop {
            match stream.next_sample() {
                Ok(Some(sample)) => {
                    read += 1;
                    if sample.seq() % 4 == 0 {
                        kept.push(sample);
                    }
                }
                Ok(None) => break,
                Err(feedstore_consumer::Error::WindowFull { .. }) => {
                    full += 1;
                    assert!(kept.len() > 8, "{} kept", kept.len());
                    assert!(stream.passed_held() >= 8);
                    for k in &kept {
                        assert_eq!(&k[..], &pattern(s.record_at(0, k.seq()), PAYLOAD)[..]);
                    }
                    kept.clear();
                }
                Err(e) => panic!("{e}"),
            }
        }
        (full, read)
    });
    assert_eq!(read, 64);
    assert!(full >= 1, "a consumer keeping samples forever is stopped");
}

/// Puts sent without reading their replies are served in order: a consumer reads their samples
/// before the producer reads a reply; the replies say what each put did, item by item even for
/// a put of several frames, and a put the stream refuses gives its reservation back. Seals sent
/// unread likewise, more of them than a connection keeps unread.
#[test]
fn puts_and_seals_sent_unread_are_served_and_seen_before_their_replies() {
    let _w = watchdog(
        "puts_and_seals_sent_unread_are_served_and_seen_before_their_replies",
        Duration::from_secs(60),
    );
    let dir = scratch_dir("stream-unread-puts");
    // Small frames, so a large put takes several.
    let daemon = DaemonProcess::start(&dir, &["--max-frame-bytes", "64KiB"]);
    let s = spec("unread", 16, 3, 1, 1);
    let client = daemon.writer();
    let feeder = StreamFeeder::join(&client, &s, 8, &[StreamTask { rank: 0, seq: 0 }]).unwrap();
    let tasks = feeder.take(8, Duration::from_millis(100)).unwrap().unwrap();
    assert_eq!(tasks.len(), 8);
    // One put per sample, sent back to back, none of their replies read.
    let made: Vec<_> = tasks.iter().map(|&t| delivery(&client, &s, t)).collect();
    let sent: Vec<_> = made
        .into_iter()
        .map(|d| feeder.submit_put(vec![d]).unwrap())
        .collect();
    // Each sample returned as soon as dropped, so the window slides for the next tasks.
    let options = StreamOptions {
        wait: Duration::from_secs(10),
        return_batch: 1,
    };
    let mut stream = Stream::open(&daemon.socket, &s, 0, None, options).unwrap();
    for seq in 0..8 {
        let sample = stream.next_sample().unwrap().unwrap();
        assert_eq!((sample.seq(), sample.record()), (seq, s.record_at(0, seq)));
        assert!(*sample == pattern(sample.record(), PAYLOAD)[..]);
    }
    for put in sent {
        assert!(matches!(put.wait().unwrap()[..], [Ok(())]));
    }
    // A task nobody handed out: refused, its reservation given back, the connection usable.
    let before = client.stats().unwrap();
    let refused = feeder
        .submit_put(vec![delivery(&client, &s, StreamTask { rank: 0, seq: 12 })])
        .unwrap();
    let results = refused.wait().unwrap();
    assert!(results[0].is_err(), "{results:?}");
    let after = client.stats().unwrap();
    assert_eq!(
        (after.objects_writing, after.used_bytes),
        (before.objects_writing, before.used_bytes)
    );
    // A put of several frames (more than it sends ahead of their replies): the next tasks
    // (7 or 8: the last sample read goes back with the consumer's next call), then 5,000
    // nobody handed out. Each item gets its own answer, in order; the refused reservations
    // are given back.
    let tasks = feeder.take(8, Duration::from_secs(5)).unwrap().unwrap();
    let k = tasks.len();
    assert!(k >= 7, "{tasks:?}");
    let mut deliveries: Vec<_> = tasks.iter().map(|&t| delivery(&client, &s, t)).collect();
    let refused = 5_000;
    let writers = client
        .create_batch(
            &vec![64; refused],
            feedstore_consumer::CreateOptions::default(),
        )
        .unwrap();
    deliveries.extend(writers.into_iter().enumerate().map(|(i, w)| Delivery {
        task: StreamTask {
            rank: 0,
            seq: 1_000 + i as u64,
        },
        record: 0,
        key: 0,
        made: Made::Written(w.unwrap()),
    }));
    let results = feeder.submit_put(deliveries).unwrap().wait().unwrap();
    assert_eq!(results.len(), k + refused);
    assert!(
        results[..k].iter().all(Result::is_ok),
        "{:?}",
        &results[..k]
    );
    assert!(results[k..].iter().all(Result::is_err));
    assert_eq!(client.stats().unwrap().objects_writing, 0);
    for seq in 8..8 + k as u64 {
        let sample = stream.next_sample().unwrap().unwrap();
        assert_eq!((sample.seq(), sample.record()), (seq, s.record_at(0, seq)));
        assert!(*sample == pattern(sample.record(), PAYLOAD)[..]);
    }
    // A seal sent unread: its handle is readable by anyone once waited for; dropped unread,
    // the object is sealed all the same.
    let mut w = client.create(PAYLOAD as u64).unwrap();
    w.as_mut_slice().copy_from_slice(&pattern(1, PAYLOAD));
    let handle = w.seal_later().wait().unwrap();
    assert!(*daemon.reader().get(handle).unwrap() == pattern(1, PAYLOAD)[..]);
    let mut w = client.create(PAYLOAD as u64).unwrap();
    w.as_mut_slice().copy_from_slice(&pattern(2, PAYLOAD));
    let pending = w.seal_later();
    let handle = pending.handle();
    drop(pending);
    assert!(*daemon.reader().get(handle).unwrap() == pattern(2, PAYLOAD)[..]);
    // More seals unread than a connection keeps unread (64): the oldest replies are read aside
    // as later ones are sent, and each is still its own seal's.
    let writers = client
        .create_batch(
            &[PAYLOAD as u64; 100],
            feedstore_consumer::CreateOptions::default(),
        )
        .unwrap();
    let pending: Vec<_> = writers
        .into_iter()
        .enumerate()
        .map(|(i, w)| {
            let mut w = w.unwrap();
            w.as_mut_slice()
                .copy_from_slice(&pattern(100 + i as u64, PAYLOAD));
            w.seal_later()
        })
        .collect();
    let reader = daemon.reader();
    for (i, seal) in pending.into_iter().enumerate() {
        let handle = seal.wait().unwrap();
        assert!(*reader.get(handle).unwrap() == pattern(100 + i as u64, PAYLOAD)[..]);
    }
    assert_eq!(client.stats().unwrap().objects_writing, 0);
}

/// Nodes in their own network namespaces, each daemon listening on its address and knowing
/// all; ranks 0-1 are read on node 0, ranks 2-3 on node 1 (a third node, if any, only makes
/// samples).
struct Nodes {
    lan: common::netns::Lan,
    nodes: Vec<DaemonProcess>,
    dir: PathBuf,
    /// Whether the clients started from now on reconnect when their daemon goes away (and each
    /// consumer holds its first sample to its end).
    reconnect: bool,
}

impl Nodes {
    fn start(tag: &str, n: usize) -> Nodes {
        use std::os::unix::fs::PermissionsExt;
        let lan = common::netns::Lan::new(tag, n);
        let dir = scratch_dir(&format!("stream-nodes-{tag}"));
        let secret = dir.join("secret");
        std::fs::write(&secret, "two-nodes-stream-secret\n").unwrap();
        std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();
        let peers = (0..n)
            .map(|i| format!("{}:7070", lan.ip(i)))
            .collect::<Vec<_>>()
            .join(",");
        let nodes = (0..n)
            .map(|i| {
                let args = Self::args(&lan, i, &peers, &secret);
                let args: Vec<&str> = args.iter().map(String::as_str).collect();
                DaemonProcess::start_named(&dir, &format!("node{i}"), &lan.exec(i), &args)
            })
            .collect::<Vec<_>>();
        for node in &nodes {
            wait_for_stats(&node.reader(), "the other nodes up", |s| {
                s.peers_up == n as u64 - 1
            });
        }
        Nodes {
            lan,
            nodes,
            dir,
            reconnect: false,
        }
    }

    /// The flags of node `i`'s daemon.
    fn args(lan: &common::netns::Lan, i: usize, peers: &str, secret: &Path) -> Vec<String> {
        let listen = format!("{}:7070", lan.ip(i));
        [
            "--node-id",
            &format!("{}", 0xB0 + i),
            "--listen",
            &listen,
            "--peers",
            peers,
            "--cluster-secret-file",
            secret.to_str().unwrap(),
            "--peer-refresh-secs",
            "1",
        ]
        .map(String::from)
        .to_vec()
    }

    /// Replaces node `i`'s daemon by `feedstored --takeover` (the old one exits).
    fn take_over(&mut self, i: usize) {
        let peers = (0..self.nodes.len())
            .map(|j| self.addr(j))
            .collect::<Vec<_>>()
            .join(",");
        let args = Self::args(&self.lan, i, &peers, &self.dir.join("secret"));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let old = self.nodes.remove(i);
        let successor = old.take_over_via(&self.dir, &self.lan.exec(i), &args);
        self.nodes.insert(i, successor);
    }

    /// Kills node `i`'s daemon with `kill -9` and starts it again (a new epoch: what it held
    /// is lost).
    fn kill_and_restart(&mut self, i: usize) {
        let peers = (0..self.nodes.len())
            .map(|j| self.addr(j))
            .collect::<Vec<_>>()
            .join(",");
        let args = Self::args(&self.lan, i, &peers, &self.dir.join("secret"));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let mut old = self.nodes.remove(i);
        let pid = nix::unistd::Pid::from_raw(old.child.id() as i32);
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL).unwrap();
        old.child.wait().unwrap();
        let name = format!("node{i}");
        let again = DaemonProcess::start_named(&self.dir, &name, &self.lan.exec(i), &args);
        self.nodes.insert(i, again);
    }

    /// The node whose consumers read `rank`.
    fn home(rank: u32) -> usize {
        (rank / 2) as usize
    }

    /// `@rank=addr` for every rank: where a producer on either node sends it.
    fn placement(&self, spec: &StreamSpec) -> String {
        (0..spec.world)
            .map(|r| format!("@{r}={}", self.addr(Self::home(r))))
            .collect::<Vec<_>>()
            .join(" ")
    }

    /// The peer address of node `i`.
    fn addr(&self, i: usize) -> String {
        format!("{}:7070", self.lan.ip(i))
    }

    /// A producer on node `i` serving every rank, each from its checkpoint (`extra`: more
    /// words for the child, `relay=ADDR`).
    fn producer(&self, i: usize, spec: &StreamSpec, extra: &str) -> ClientProcess {
        let all: Vec<u32> = (0..spec.world).collect();
        self.producer_of(i, spec, &all, extra)
    }

    /// A producer on node `i` serving only `ranks`.
    fn producer_of(
        &self,
        i: usize,
        spec: &StreamSpec,
        ranks: &[u32],
        extra: &str,
    ) -> ClientProcess {
        let starts: Vec<String> = ranks
            .iter()
            .map(|&r| {
                let seq = Checkpoint::read(&self.dir.join(format!("rank{r}")))
                    .state
                    .map_or(0, |s| s.seq(spec));
                format!("{r}:{seq}")
            })
            .collect();
        let mut p = ClientProcess::spawn_with(
            &self.nodes[i].socket,
            &format!(
                "produce {} {} {} {extra}",
                spec_args(spec),
                starts.join(" "),
                self.placement(spec)
            ),
            self.env(),
        );
        p.ready();
        p
    }

    /// The consumer of `rank` on its node, from its checkpoint.
    fn consumer(&self, spec: &StreamSpec, rank: u32, pause_us: u64) -> ClientProcess {
        let path = self.dir.join(format!("rank{rank}"));
        let mut c = ClientProcess::spawn_with(
            &self.nodes[Self::home(rank)].socket,
            &format!(
                "consume {} {rank} {} 5 {pause_us}{}",
                spec_args(spec),
                path.display(),
                if self.reconnect { " hold" } else { "" }
            ),
            self.env(),
        );
        c.ready();
        c
    }

    /// Starts a consumer for every rank of `spec`, each on its node, and waits for them and
    /// `producers` to finish, each successfully.
    fn read_all(&self, spec: &StreamSpec, producers: impl IntoIterator<Item = ClientProcess>) {
        let consumers: Vec<ClientProcess> =
            (0..spec.world).map(|r| self.consumer(spec, r, 0)).collect();
        for mut p in consumers.into_iter().chain(producers) {
            let status = wait_child(&mut p.child, Duration::from_secs(120));
            assert!(status.success(), "{status}");
        }
    }

    fn env(&self) -> &'static [(&'static str, &'static str)] {
        if self.reconnect {
            &[(feedstore_proto::RECONNECT_ENV, "30")]
        } else {
            &[]
        }
    }

    fn records(&self, spec: &StreamSpec) -> Vec<Vec<u64>> {
        (0..spec.world)
            .map(|r| {
                let c = Checkpoint::read(&self.dir.join(format!("rank{r}")));
                assert!(c.done, "rank {r} finished");
                c.records
            })
            .collect()
    }

    /// Every node (of the first `n`) back at rest: no lease, reservation or pull left.
    fn assert_at_rest(&self, n: usize) {
        for (i, n) in self.nodes.iter().take(n).enumerate() {
            wait_for_stats(&n.reader(), &format!("node {i} at rest"), |s| {
                s.leases == 0 && s.objects_writing == 0 && s.pulls_in_flight == 0
            });
        }
    }
}

/// What an uninterrupted run delivers to each rank: the spec's records in sequence order.
fn expected(spec: &StreamSpec) -> Vec<Vec<u64>> {
    (0..spec.world)
        .map(|r| {
            (0..spec.end_seq(r).unwrap())
                .map(|seq| spec.record_at(r, seq))
                .collect()
        })
        .collect()
}

fn skip_unless_root(test: &str) -> bool {
    if !is_root() {
        eprintln!("SKIPPED {test}: needs root to make network namespaces");
        return true;
    }
    false
}

/// The colocated placement: one producer, on node 1, makes every rank's samples; node 0's ranks
/// get theirs by pulling each from node 1 inside their windows.
#[test]
fn ranks_on_another_node_are_fed_by_pulls_in_the_seeds_order() {
    if skip_unless_root("ranks_on_another_node_are_fed_by_pulls") {
        return;
    }
    let _w = watchdog("ranks_on_another_node_are_fed", Duration::from_secs(240));
    let nodes = Nodes::start("sa", 2);
    let s = spec("across", 64, 21, 4, 2);
    let producer = nodes.producer(1, &s, "");
    nodes.read_all(&s, [producer]);
    assert_eq!(
        nodes.records(&s),
        expected(&s),
        "each rank its share, in order"
    );
    let (a, b) = (nodes.nodes[0].reader(), nodes.nodes[1].reader());
    let per_node = 2 * s.per_rank() * 2;
    assert_eq!(
        a.stats().unwrap().pulls,
        per_node,
        "node 0 pulled each of its samples once"
    );
    assert_eq!(b.stats().unwrap().pulls, 0, "node 1 made its own");
    assert_eq!(b.stats().unwrap().served_reads, per_node);
    // The producers' node files what its producers made, under their keys. The ranks' node
    // files nothing: a sample a peer's session hands over is a stream sample, never a cache
    // entry, so no peer can place bytes under a key this node's users look up.
    let keys: Vec<u128> = (0..s.records).map(cache_key).collect();
    assert!(b.cache_lookup(&keys).unwrap().iter().any(Option::is_some));
    assert!(a.cache_lookup(&keys).unwrap().iter().all(Option::is_none));
    assert_eq!(a.stats().unwrap().cache_entries, 0);
    nodes.assert_at_rest(2);
}

/// A stream resumed at another world size (3 ranks' states dealt to 4) is read across nodes: the
/// peer session carries the reshard, so the ranks' node ends each rank at its share and the
/// next epoch, and every rank reads exactly the resharded sequence.
#[test]
fn a_resharded_stream_is_read_across_nodes() {
    if skip_unless_root("a_resharded_stream_is_read_across_nodes") {
        return;
    }
    let _w = watchdog(
        "a_resharded_stream_is_read_across_nodes",
        Duration::from_secs(240),
    );
    let nodes = Nodes::start("rs", 2);
    let old = spec("elastic-across", 64, 23, 3, 2);
    let states: Vec<StreamState> = [(0, 5), (1, 0), (2, 21)]
        .iter()
        .map(|&(rank, seq)| StreamState::at(&old, rank, seq))
        .collect();
    let s = feedstore_proto::reshard::Reshard::new(&old, &states, 4)
        .unwrap()
        .spec();
    assert!(s.reshard.is_some());
    let producer = nodes.producer(1, &s, "");
    nodes.read_all(&s, [producer]);
    assert_eq!(
        nodes.records(&s),
        expected(&s),
        "each rank its share, then the epoch"
    );
    nodes.assert_at_rest(2);
}

/// A pulled stream survives the takeover of either node (`feedstored --takeover`, the old
/// daemon exits): the producers' node first, whose samples node 0 pulls, then the ranks' node,
/// whose windows, rings and pulls live in the memory handed over; then that node's daemon is
/// killed with `kill -9` and started again. Every rank reads exactly its uninterrupted
/// sequence, and a sample each consumer held from its start (node 0's: a pulled copy) still
/// reads its own bytes at the end.
#[test]
fn a_pulled_stream_survives_the_takeover_of_either_node() {
    if skip_unless_root("a_pulled_stream_survives_the_takeover_of_either_node") {
        return;
    }
    let _w = watchdog(
        "a_pulled_stream_survives_takeovers",
        Duration::from_secs(300),
    );
    let mut nodes = Nodes::start("sf", 2);
    nodes.reconnect = true;
    let s = spec("takeover", 256, 23, 4, 2);
    let producer = nodes.producer(1, &s, "");
    let consumers: Vec<ClientProcess> = (0..4).map(|r| nodes.consumer(&s, r, 20_000)).collect();
    let unfinished = |nodes: &Nodes| {
        (0..s.world)
            .filter(|r| !Checkpoint::read(&nodes.dir.join(format!("rank{r}"))).done)
            .count()
    };
    wait_for_stats(
        &nodes.nodes[0].reader(),
        "samples pulled from node 1",
        |s| s.pulls >= 8,
    );
    assert_eq!(unfinished(&nodes), 4, "the first takeover lands mid-run");
    nodes.take_over(1);
    let pulled = nodes.nodes[0].reader().stats().unwrap().pulls;
    wait_for_stats(
        &nodes.nodes[0].reader(),
        "pulls from node 1's successor",
        |s| s.pulls >= pulled + 8,
    );
    assert_eq!(unfinished(&nodes), 4, "the second takeover lands mid-run");
    nodes.take_over(0);
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(unfinished(&nodes), 4, "the kill lands mid-run");
    nodes.kill_and_restart(0);
    let reattached: u64 = consumers
        .into_iter()
        .chain([producer])
        .map(|mut p| p.finish_reattached(Duration::from_secs(180)))
        .sum();
    assert_eq!(
        nodes.records(&s),
        expected(&s),
        "no sample lost or duplicated across the takeover of either node and a kill -9"
    );
    assert!(
        reattached >= 4,
        "every consumer attached again ({reattached} times in all)"
    );
    nodes.assert_at_rest(2);
}

/// The spread placement under faults: producers on both nodes; node 1's producer and one of
/// node 1's ranks are killed with `kill -9` mid-epoch (the rank restarts from its checkpoint).
/// Every rank still reads exactly its uninterrupted sequence.
#[test]
fn spread_producers_survive_a_killed_producer_and_rank() {
    if skip_unless_root("spread_producers_survive_a_killed_producer_and_rank") {
        return;
    }
    let _w = watchdog("spread_producers_survive", Duration::from_secs(300));
    let nodes = Nodes::start("sb", 2);
    let s = spec("spread", 192, 8, 4, 2);
    let survivor = nodes.producer(0, &s, "");
    let doomed = nodes.producer(1, &s, "");
    let mut consumers: Vec<Option<ClientProcess>> =
        (0..4).map(|r| Some(nodes.consumer(&s, r, 1500))).collect();
    std::thread::sleep(Duration::from_millis(60));
    doomed.kill9();
    std::thread::sleep(Duration::from_millis(40));
    consumers[2].take().unwrap().kill9();
    let progress = Checkpoint::read(&nodes.dir.join("rank2")).records.len();
    eprintln!("rank 2 killed after {progress} checkpointed samples");
    consumers[2] = Some(nodes.consumer(&s, 2, 0));
    for mut p in consumers.into_iter().flatten().chain([survivor]) {
        let status = wait_child(&mut p.child, Duration::from_secs(180));
        assert!(status.success(), "{status}");
    }
    assert_eq!(
        nodes.records(&s),
        expected(&s),
        "no sample lost or duplicated after kill -9 of a producer and a rank"
    );
    nodes.assert_at_rest(2);
}

/// The relay placement: a producer-only node makes every sample, and node 0 relays those for
/// node 1's ranks: node 0 pulls every sample (its own and node 1's), node 1 pulls its own from
/// node 0, never from the producers' node.
#[test]
fn relayed_samples_pass_through_the_relay_node_once() {
    if skip_unless_root("relayed_samples_pass_through_the_relay_node_once") {
        return;
    }
    let _w = watchdog("relayed_samples_pass_through", Duration::from_secs(240));
    let nodes = Nodes::start("sc", 3);
    let s = spec("relayed", 64, 4, 4, 2);
    let producer = nodes.producer(2, &s, &format!("relay={}", nodes.addr(0)));
    nodes.read_all(&s, [producer]);
    assert_eq!(nodes.records(&s), expected(&s));
    let stats: Vec<StoreStats> = nodes
        .nodes
        .iter()
        .map(|n| n.reader().stats().unwrap())
        .collect();
    let per_node = 2 * s.per_rank() * 2;
    assert_eq!(
        stats[0].pulls,
        2 * per_node,
        "node 0 pulled every sample: {stats:?}"
    );
    assert_eq!(stats[0].served_reads, per_node, "and served node 1's");
    assert_eq!(stats[1].pulls, per_node);
    assert_eq!(
        stats[2].served_reads,
        2 * per_node,
        "each sample left its node once"
    );
    nodes.assert_at_rest(3);
}

/// A producer's node dies (daemon and producer, `kill -9`) mid-epoch: what it had taken, and
/// what it had made that was not pulled yet, is made again by the other node's producer.
#[test]
fn a_dead_producer_node_loses_and_duplicates_nothing() {
    if skip_unless_root("a_dead_producer_node_loses_and_duplicates_nothing") {
        return;
    }
    let _w = watchdog("a_dead_producer_node", Duration::from_secs(300));
    let mut nodes = Nodes::start("sd", 3);
    let s = spec("node-death", 192, 13, 4, 2);
    let doomed = nodes.producer(2, &s, "");
    let consumers: Vec<ClientProcess> = (0..4).map(|r| nodes.consumer(&s, r, 1500)).collect();
    // Killed once it has delivered to both ranks' nodes, long before the end.
    for n in &nodes.nodes[..2] {
        wait_for_stats(&n.reader(), "samples pulled from node 2", |s| s.pulls >= 8);
    }
    let survivor = nodes.producer(1, &s, "");
    doomed.kill9();
    let mut dead = nodes.nodes.pop().unwrap();
    let pid = nix::unistd::Pid::from_raw(dead.child.id() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL).unwrap();
    dead.child.wait().unwrap();
    for mut p in consumers.into_iter().chain([survivor]) {
        let status = wait_child(&mut p.child, Duration::from_secs(180));
        assert!(status.success(), "{status}");
    }
    assert_eq!(
        nodes.records(&s),
        expected(&s),
        "no sample lost or duplicated after the producers' node died"
    );
    nodes.assert_at_rest(2);
}

/// Producers naming part of the ranks each: node 0's names ranks 0-2 (rank 2 on node 1), node
/// 1's only rank 3. Node 1 must hand node 0's session tasks of rank 2 alone: a task of rank 3
/// granted to node 0, which does not know rank 3, would stall it.
#[test]
fn producers_serving_part_of_the_ranks_get_only_their_ranks_tasks() {
    if skip_unless_root("producers_serving_part_of_the_ranks") {
        return;
    }
    let _w = watchdog(
        "producers_serving_part_of_the_ranks",
        Duration::from_secs(240),
    );
    let nodes = Nodes::start("se", 2);
    let s = spec("subsets", 64, 17, 4, 2);
    let a = nodes.producer_of(0, &s, &[0, 1, 2], "");
    let b = nodes.producer_of(1, &s, &[3], "");
    nodes.read_all(&s, [a, b]);
    assert_eq!(nodes.records(&s), expected(&s));
    let (n0, n1) = (nodes.nodes[0].reader(), nodes.nodes[1].reader());
    assert_eq!(n0.stats().unwrap().pulls, 0, "ranks 0-1 made on node 0");
    // Rank 2's samples: node 1's producer may make some (a producer takes any of its node's
    // ranks), node 0's the rest, pulled.
    assert!(n1.stats().unwrap().pulls <= s.per_rank() * 2);
    nodes.assert_at_rest(2);
}

/// Reads `n` samples of `rank` as one batch and checks each is the record the spec puts at its
/// position; returns whether their images came as one stacked view (checked element by element).
fn read_batch(stream: &mut Stream, spec: &StreamSpec, rank: u32, n: usize) -> bool {
    let batch = stream.next_batch(n).unwrap();
    assert_eq!(batch.len(), n);
    for s in &batch {
        let record = spec.record_at(rank, s.seq());
        assert_eq!(s.record(), record);
        let view = s.view().unwrap();
        assert_eq!(view.id(), format!("record-{record}"));
        assert_eq!(view.tokens(), &[record as u32, s.seq() as u32]);
        let image = view.image(0).unwrap().as_f32().unwrap();
        assert!(image.iter().all(|&v| v == record as f32), "{s:?}");
    }
    let Some(stacked) = stacked_image(&batch, 0).unwrap() else {
        return false;
    };
    let per: usize = BATCHED_IMAGE.iter().map(|&d| d as usize).product();
    let mut shape = vec![n];
    shape.extend(BATCHED_IMAGE.iter().map(|&d| d as usize));
    assert_eq!(stacked.shape, shape);
    let all: &[f32] = bytemuck::cast_slice(stacked.bytes);
    for (s, images) in batch.iter().zip(all.chunks(per)) {
        assert!(images.iter().all(|&v| v == s.record() as f32), "{s:?}");
    }
    true
}

/// Issue 17 part 5: a producer places each batch in one object; a rank reading whole batches
/// gets each batch's images as one view, in the seeds' order, exactly once, across a producer
/// killed with `kill -9` and a consumer resumed from its state. A reader that starts inside a
/// batch still reads every sample (only not as one view).
#[test]
fn batches_placed_in_one_object_read_as_one_stacked_view() {
    let _w = watchdog("batches_placed_in_one_object", Duration::from_secs(120));
    let dir = scratch_dir("stream-batched");
    let daemon = DaemonProcess::start(&dir, &[]);
    let spec = spec("batched", 64, 5, 2, 1);
    let producer = |starts: &str| {
        let mut p = ClientProcess::spawn(
            &daemon.socket,
            &format!("produce-batched {} 4 20 {starts}", spec_args(&spec)),
        );
        p.ready();
        p
    };
    let first = producer("0:0 1:0");
    let opts = StreamOptions {
        wait: Duration::from_secs(30),
        ..StreamOptions::default()
    };
    let mut stream = Stream::open(&daemon.socket, &spec, 0, None, opts.clone()).unwrap();
    for _ in 0..4 {
        assert!(read_batch(&mut stream, &spec, 0, 4), "one view per batch");
    }
    let state = stream.state();
    assert_eq!(state.seq(&spec), 16);
    drop(stream);
    // Its pause leaves the producer mid-run; one made from rank 0's state takes over.
    first.kill9();
    let second = producer("0:16 1:0");
    let mut stream = Stream::open(&daemon.socket, &spec, 0, Some(state), opts.clone()).unwrap();
    for _ in 0..4 {
        assert!(
            read_batch(&mut stream, &spec, 0, 4),
            "one view per batch after the resume"
        );
    }
    assert!(
        stream.next_sample().unwrap().is_none(),
        "rank 0 read exactly its share"
    );
    drop(stream);
    // Rank 1 from inside its first batch: the samples, one object each side of a batch's end.
    let inside = StreamState::at(&spec, 1, 2);
    let mut stream = Stream::open(&daemon.socket, &spec, 1, Some(inside), opts).unwrap();
    assert!(
        !read_batch(&mut stream, &spec, 1, 4),
        "2..6 spans two objects"
    );
    read_batch(&mut stream, &spec, 1, 2);
    for _ in 0..6 {
        assert!(read_batch(&mut stream, &spec, 1, 4), "aligned again at 8");
    }
    assert!(stream.next_sample().unwrap().is_none());
    drop(stream);
    let mut second = second;
    assert!(wait_child(&mut second.child, Duration::from_secs(30)).success());
    let stats = daemon.reader().stats().unwrap();
    assert_eq!((stats.leases, stats.objects_writing), (0, 0), "{stats:?}");
    // A put may not publish an object whose writer is still live (it could change the bytes
    // readers see): refused before anything is sent, and the writer's object is untouched.
    let writer = daemon.writer();
    let feeder = StreamFeeder::join_batched(&writer, &spec, 8, 4, &[]).unwrap();
    let mut live = writer.create(4096).unwrap();
    let task = StreamTask { rank: 0, seq: 0 };
    for made in [
        Made::Part {
            handle: live.handle(),
            offset: 64,
        },
        Made::Existing(live.handle()),
    ] {
        let delivery = Delivery {
            task,
            record: 0,
            key: 0,
            made,
        };
        let err = feeder.put(vec![delivery]).unwrap_err();
        assert!(err.to_string().contains("still being written"), "{err}");
    }
    live.as_mut_slice()[0] = 1;
    assert_eq!(writer.stats().unwrap().objects_writing, 1);
}

/// Feeds every task of `spec`'s `ranks` (starting where given) until `stop`: each sample the
/// pattern of its record, filed in the decode-once cache under its record.
fn feed_until(
    daemon: &DaemonProcess,
    spec: &StreamSpec,
    ranks: &[StreamTask],
    stop: &std::sync::atomic::AtomicBool,
) {
    let client = daemon.writer();
    let feeder = StreamFeeder::join(&client, spec, 8, ranks).unwrap();
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        let Some(tasks) = feeder.take(16, Duration::from_millis(50)).unwrap() else {
            break;
        };
        // As feedstore's producer does: what the store still holds is put again, not made.
        let keys: Vec<u128> = tasks
            .iter()
            .map(|t| cache_key(spec.record_at(t.rank, t.seq)))
            .collect();
        let found = feeder.lookup(&keys).unwrap();
        let items = tasks
            .into_iter()
            .zip(found)
            .map(|(t, found)| match found {
                Some(handle) => Delivery {
                    task: t,
                    record: spec.record_at(t.rank, t.seq),
                    key: 0,
                    made: Made::Existing(handle),
                },
                None => delivery(&client, spec, t),
            })
            .collect();
        for put in feeder.put(items).unwrap() {
            // (A task of a rank whose reader moved on is stale; nothing else fails.)
            if let Err(e) = put {
                assert!(matches!(e, feedstore_consumer::Error::Stale { .. }), "{e}");
            }
        }
    }
}

/// Reads up to `n` samples of `rank` from `state` on: the (epoch, record) of each read (each
/// checked against its bytes and the spec) and the state after them.
fn read_some(
    daemon: &DaemonProcess,
    spec: &StreamSpec,
    rank: u32,
    state: Option<StreamState>,
    n: u64,
) -> (Vec<(u64, u64)>, StreamState) {
    let options = StreamOptions {
        wait: Duration::from_secs(30),
        ..StreamOptions::default()
    };
    let mut stream = Stream::open(&daemon.socket, spec, rank, state, options).unwrap();
    let mut records = Vec::new();
    while (records.len() as u64) < n {
        let Some(sample) = stream.next_sample().unwrap() else {
            break;
        };
        assert_eq!(sample.record(), spec.record_at(rank, sample.seq()));
        assert_eq!(&sample[..], &pattern(sample.record(), PAYLOAD)[..]);
        records.push((spec.epoch_at(rank, sample.seq()), sample.record()));
    }
    (records, stream.state())
}

/// A run stopped with its ranks at uneven places (one that read nothing, one in the last
/// samples of an epoch, one already in the next) resumes at another world size through a real
/// daemon: every sample of the epochs begun is read exactly once across both runs, the new
/// ranks' shares differ by one at most, the epoch after is an uninterrupted run's at the new
/// world, and the new run reuses the old run's decode-once cache entries.
#[test]
fn a_run_resumed_at_another_world_size_reads_every_sample_left_once() {
    use feedstore_proto::reshard::Reshard;
    use std::collections::BTreeMap;
    use std::sync::atomic::{AtomicBool, Ordering};

    let dir = scratch_dir("stream-reshard");
    let daemon = DaemonProcess::start(&dir, &[]);
    // (old world, what each old rank reads, new world); 37 records, 3 epochs: a rank that
    // read nothing, one a sample short of its epoch's end, one in the next epoch.
    let cases: [(u32, &[u64], u32); 4] = [
        (2, &[7, 0], 3),
        (4, &[3, 11, 8, 5], 2),
        (3, &[11, 12, 9], 1),
        (1, &[20], 4),
    ];
    for (case, &(old_world, reads, new_world)) in cases.iter().enumerate() {
        let old = spec(
            &format!("elastic-{case}"),
            37,
            40 + case as u64,
            old_world,
            3,
        );
        let per_rank = old.per_rank();
        let stop = AtomicBool::new(false);
        let starts: Vec<StreamTask> = (0..old_world)
            .map(|rank| StreamTask { rank, seq: 0 })
            .collect();
        // The old run: each rank reads its part, saves its state, and the run stops.
        let mut read: BTreeMap<(u64, u64), u32> = BTreeMap::new();
        let states: Vec<StreamState> = std::thread::scope(|scope| {
            scope.spawn(|| feed_until(&daemon, &old, &starts, &stop));
            let states = (0..old_world)
                .map(|rank| {
                    let (records, state) =
                        read_some(&daemon, &old, rank, None, reads[rank as usize]);
                    assert_eq!(records.len() as u64, reads[rank as usize]);
                    for r in records {
                        *read.entry(r).or_default() += 1;
                    }
                    state
                })
                .collect();
            stop.store(true, Ordering::Relaxed);
            states
        });
        let hits_before = daemon.reader().stats().unwrap().cache_hits;

        // The new run, at the new world: producers and ranks start from the resharded states
        // (the old stream, idle now, gives way).
        let reshard = Reshard::new(&old, &states, new_world).unwrap();
        let (new, starts) = (reshard.spec(), reshard.states());
        assert!(new.reshard.is_some(), "case {case}: something was left");
        let tasks: Vec<StreamTask> = starts
            .iter()
            .map(|s| StreamTask {
                rank: s.rank,
                seq: s.seq(&new),
            })
            .collect();
        let stop = AtomicBool::new(false);
        let shares: Vec<u64> = (0..new_world).map(|r| reshard.share(r)).collect();
        let plain = new.plain();
        let mut later = Vec::new();
        std::thread::scope(|scope| {
            scope.spawn(|| feed_until(&daemon, &new, &tasks, &stop));
            for rank in 0..new_world {
                let (records, end) =
                    read_some(&daemon, &new, rank, Some(starts[rank as usize]), u64::MAX);
                assert_eq!(end.seq(&new), new.end_seq(rank).unwrap());
                let share = shares[rank as usize] as usize;
                for &r in &records[..share] {
                    *read.entry(r).or_default() += 1;
                }
                // After its share, the rank reads the new world's epochs, as a run at that
                // world from the start would.
                let expected: Vec<(u64, u64)> = (0..(records.len() - share) as u64)
                    .map(|k| {
                        let seq = reshard.next_epoch() * plain.per_rank() + k;
                        (seq / plain.per_rank(), plain.record_at(rank, seq))
                    })
                    .collect();
                assert_eq!(records[share..], expected[..], "case {case}, rank {rank}");
                later.push(records.len() - share);
            }
            stop.store(true, Ordering::Relaxed);
        });
        let (most, least) = (shares.iter().max().unwrap(), shares.iter().min().unwrap());
        assert!(most - least <= 1, "case {case}: shares {shares:?}");
        // Every sample of the epochs begun once, in its epoch: as the old run would have read
        // them whole.
        let mut expected: BTreeMap<(u64, u64), u32> = BTreeMap::new();
        for epoch in 0..reshard.next_epoch() {
            for rank in 0..old_world {
                for p in 0..per_rank {
                    *expected
                        .entry((epoch, old.record_at(rank, epoch * per_rank + p)))
                        .or_default() += 1;
                }
            }
        }
        assert_eq!(read, expected, "case {case}");
        assert!(
            later
                .iter()
                .all(|&n| n as u64 == (3 - reshard.next_epoch()) * plain.per_rank()),
            "case {case}: {later:?}"
        );
        // Made once by the old run, found again by the new one.
        assert!(
            daemon.reader().stats().unwrap().cache_hits > hits_before,
            "case {case}"
        );
    }
}
