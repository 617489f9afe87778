//! C programs compiled with gcc against the static library and run against a real daemon while
//! a producer feeds their stream: the example (`examples/read_stream.c`) prints what each sample
//! holds, checked line by line against the stream's spec; `tests/c/held_view.c` keeps a sample
//! across a reopen of its stream and a refill of the store; `tests/c/stacked.c` reads batches a
//! producer placed in one object as one stacked tensor each; `tests/c/reshard.c` resumes a run
//! saved at another world size.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use feedstore_consumer::{ConnectOptions, Delivery, Made, Role, StreamFeeder, StreamTask};
use feedstore_proto::sample::{BatchPlan, DType, SampleInfo, SamplePlan, TensorLayout};
use feedstore_proto::stream::{Shuffle, StreamSpec, StreamState, Tail};

/// Compiles `source` (relative to this crate) against the static library, into `dir`.
fn compile(source: &str, dir: &Path) -> PathBuf {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let target = feedstore_testkit::build_library("feedstore-ffi");
    let library = target.join("libfeedstore_c.a");
    assert!(library.exists(), "{} not built", library.display());
    let binary = dir.join(Path::new(source).file_stem().unwrap());
    let gcc = Command::new("gcc")
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-I"])
        .arg(root.join("include"))
        .arg(root.join(source))
        .arg(&library)
        .args(["-lpthread", "-ldl", "-lm", "-o"])
        .arg(&binary)
        .output()
        .unwrap();
    assert!(
        gcc.status.success(),
        "gcc: {}",
        String::from_utf8_lossy(&gcc.stderr)
    );
    binary
}

fn scratch(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("feedstore-ffi-{}-{test}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn daemon(socket: &Path) -> feedstore_store::daemon::DaemonHandle {
    feedstore_store::daemon::Daemon::bind(&feedstore_store::config::DaemonConfig {
        socket: socket.to_owned(),
        capacity_bytes: 64 << 20,
        segment_bytes: 64 << 20,
        ..feedstore_store::config::DaemonConfig::default()
    })
    .unwrap()
    .spawn()
}

/// A producer for rank 0 until the stream ends: each sample is one u8 image of `shape` filled
/// with `fill(record)` and 8 tokens starting at 1000 + record.
fn produce(
    socket: &Path,
    spec: &StreamSpec,
    shape: [u32; 3],
    fill: fn(u64) -> u8,
) -> std::thread::JoinHandle<()> {
    produce_ranks(socket, spec, &[StreamTask { rank: 0, seq: 0 }], shape, fill)
}

/// [`produce`] for `ranks`, each from its sequence number.
fn produce_ranks(
    socket: &Path,
    spec: &StreamSpec,
    ranks: &[StreamTask],
    shape: [u32; 3],
    fill: fn(u64) -> u8,
) -> std::thread::JoinHandle<()> {
    let (socket, spec, ranks) = (socket.to_owned(), spec.clone(), ranks.to_vec());
    std::thread::spawn(move || {
        let client = ConnectOptions::new(Role::Writer)
            .socket(&socket)
            .connect()
            .unwrap();
        let feeder = StreamFeeder::join(&client, &spec, 16, &ranks).unwrap();
        while let Ok(Some(tasks)) = feeder.take(8, Duration::from_millis(100)) {
            let made = tasks
                .into_iter()
                .map(|task| {
                    let record = spec.record_at(task.rank, task.seq);
                    let mut plan = SamplePlan::new();
                    plan.add_image(DType::U8, TensorLayout::Chw, &shape);
                    plan.set_token_count(8);
                    let info = SampleInfo {
                        id: format!("rec-{record}"),
                        source_keys: vec![],
                        image_grid_thw: vec![],
                        metadata: vec![],
                    };
                    let mut w = client.create(plan.object_bytes(&info)).unwrap();
                    {
                        let mut regions = plan.regions(w.as_mut_slice()).unwrap();
                        regions.images[0].fill(fill(record));
                        for (i, t) in regions.tokens.iter_mut().enumerate() {
                            *t = 1000 + record as u32 + i as u32;
                        }
                        regions.labels.fill(-100);
                    }
                    plan.finish(w.as_mut_slice(), &info).unwrap();
                    Delivery {
                        task,
                        record,
                        key: 0,
                        made: Made::Written(w),
                    }
                })
                .collect();
            if feeder.put(made).is_err() {
                return;
            }
        }
    })
}

#[test]
fn the_c_example_reads_a_stream() {
    let dir = scratch("example");
    let binary = compile("examples/read_stream.c", &dir);
    let socket = dir.join("feedstored.sock");
    let daemon = daemon(&socket);
    let spec = StreamSpec {
        name: "c-example".into(),
        records: 12,
        seed: 5,
        world: 2,
        shuffle: Shuffle::Full,
        tail: Tail::Drop,
        epochs: Some(2),
        reshard: None,
    };
    let producer = produce(&socket, &spec, [3, 4, 4], |record| record as u8);

    let out = Command::new(&binary)
        .arg(&socket)
        .args(["c-example", "12", "5", "2", "2", "0"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    producer.join().unwrap();
    assert_eq!(
        stdout.lines().next(),
        Some(format!("feedstore {}", env!("CARGO_PKG_VERSION")).as_str()),
        "the header's version macros and fs_version() agree with the crate"
    );
    let samples: Vec<&str> = stdout
        .lines()
        .filter(|l| l.starts_with("sample "))
        .collect();
    assert_eq!(
        samples.len(),
        12,
        "6 per epoch for rank 0, 2 epochs:\n{stdout}"
    );
    for (seq, line) in samples.iter().enumerate() {
        let record = spec.record_at(0, seq as u64);
        let expected = format!(
            "sample seq={seq} record={record} id=rec-{record} tokens=8 first={} image=3x4x4 dtype=0 pixel0={record}",
            1000 + record
        );
        assert_eq!(*line, expected);
    }
    let state = stdout
        .lines()
        .find_map(|l| l.strip_prefix("state="))
        .and_then(StreamState::from_text)
        .expect("a state line");
    assert_eq!((state.epoch, state.position), (2, 0));
    assert!(stdout.trim_end().ends_with("end"));
    daemon.stop();
    let _ = std::fs::remove_dir_all(&dir); // (kept when the test fails, to look at)
}

/// Issue 11 from C: a sample kept while its stream is freed and reopened at a later position,
/// and while other work refills the store, still reads its own bytes.
#[test]
fn a_held_c_sample_outlives_a_reopen_and_a_refill() {
    let dir = scratch("held");
    let binary = compile("tests/c/held_view.c", &dir);
    let socket = dir.join("feedstored.sock");
    let daemon = daemon(&socket);
    let spec = StreamSpec {
        name: "held".into(),
        records: 16,
        seed: 0,
        world: 1,
        shuffle: Shuffle::None,
        tail: Tail::Drop,
        epochs: Some(1),
        reshard: None,
    };
    let producer = produce(&socket, &spec, [3, 128, 128], |record| record as u8 + 1);
    let mut reader = Command::new(&binary)
        .arg(&socket)
        .args(["held", "16"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(reader.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    assert_eq!(line, "READY\n");
    // Other work fills the store over and over.
    let writer = ConnectOptions::new(Role::Writer)
        .socket(&socket)
        .create_timeout(Duration::from_millis(100))
        .connect()
        .unwrap();
    let junk = vec![0xABu8; 150_000];
    for _ in 0..3000 {
        let _ = writer.put(&junk);
    }
    assert!(
        writer.stats().unwrap().evictions > 0,
        "the store was refilled"
    );
    let mut stdin = reader.stdin.take().unwrap();
    stdin.write_all(b"go\n").unwrap();
    let mut rest = String::new();
    for l in out.lines() {
        rest.push_str(&l.unwrap());
        rest.push('\n');
    }
    assert!(reader.wait().unwrap().success(), "{rest}");
    assert_eq!(
        rest, "held record=0 bytes=49152 tokens=8 wrong=0\nnext seq=3\n",
        "the held sample's bytes are its own"
    );
    // The reader read only part of its share: closing the stream ends the producer.
    StreamFeeder::join(&writer, &spec, 16, &[])
        .unwrap()
        .close()
        .unwrap();
    producer.join().unwrap();
    daemon.stop();
    let _ = std::fs::remove_dir_all(&dir); // (kept when the test fails, to look at)
}

/// A producer for rank 0 placing each batch of `batch` samples in one object: image 0 of each
/// is 4x4x4 u8 (64 bytes) filled with the record's number.
fn produce_batched(socket: &Path, spec: &StreamSpec, batch: u32) -> std::thread::JoinHandle<()> {
    let (socket, spec) = (socket.to_owned(), spec.clone());
    std::thread::spawn(move || {
        let client = ConnectOptions::new(Role::Writer)
            .socket(&socket)
            .connect()
            .unwrap();
        let start = [StreamTask { rank: 0, seq: 0 }];
        let feeder = StreamFeeder::join_batched(&client, &spec, 2 * batch, batch, &start).unwrap();
        while let Ok(Some(tasks)) = feeder.take(1, Duration::from_millis(100)) {
            for group in tasks.chunk_by(|a, b| a.seq / u64::from(batch) == b.seq / u64::from(batch))
            {
                let records: Vec<u64> = group.iter().map(|t| spec.record_at(0, t.seq)).collect();
                let infos: Vec<SampleInfo> = records
                    .iter()
                    .map(|r| SampleInfo {
                        id: format!("rec-{r}"),
                        ..SampleInfo::default()
                    })
                    .collect();
                let plans = group
                    .iter()
                    .map(|_| {
                        let mut plan = SamplePlan::new();
                        plan.add_image(DType::U8, TensorLayout::Chw, &[4, 4, 4]);
                        plan
                    })
                    .collect();
                let plan = BatchPlan::new(plans, &infos).unwrap();
                let mut w = client.create(plan.object_bytes()).unwrap();
                for (i, info) in infos.iter().enumerate() {
                    let mut regions = plan.regions(w.as_mut_slice(), i).unwrap();
                    regions.images[0].fill(records[i] as u8);
                    plan.finish(w.as_mut_slice(), i, info).unwrap();
                }
                let made: Vec<(StreamTask, u64)> =
                    group.iter().copied().zip(records.iter().copied()).collect();
                if feeder.put_batch(&made, &plan, w).is_err() {
                    return;
                }
            }
        }
    })
}

/// Issue 17 part 5 from C: `fs_stacked_image` hands out each placed batch as one tensor; a
/// reader that starts inside a batch gets no view for the batches it reads across (and reads
/// each sample's image instead).
#[test]
fn c_reads_a_placed_batch_as_one_tensor() {
    let dir = scratch("stacked");
    let binary = compile("tests/c/stacked.c", &dir);
    let socket = dir.join("feedstored.sock");
    let daemon = daemon(&socket);
    let spec = |name: &str| StreamSpec {
        name: name.into(),
        records: 16,
        seed: 0,
        world: 1,
        shuffle: Shuffle::None,
        tail: Tail::Drop,
        epochs: Some(1),
        reshard: None,
    };
    let run = |name: &str, skip: &str| {
        let producer = produce_batched(&socket, &spec(name), 4);
        let out = Command::new(&binary)
            .arg(&socket)
            .args([name, "16", "4", skip])
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "{}\n{stdout}",
            String::from_utf8_lossy(&out.stderr)
        );
        producer.join().unwrap();
        stdout
    };
    assert_eq!(
        run("aligned", "0"),
        "batch seq=0 view=1 shape=4x4x4x4 first=0,1,2,3\n\
         batch seq=4 view=1 shape=4x4x4x4 first=4,5,6,7\n\
         batch seq=8 view=1 shape=4x4x4x4 first=8,9,10,11\n\
         batch seq=12 view=1 shape=4x4x4x4 first=12,13,14,15\n\
         end\n"
    );
    assert_eq!(
        run("inside", "2"),
        "batch seq=2 view=0 shape= first=2,3,4,5\n\
         batch seq=6 view=0 shape= first=6,7,8,9\n\
         batch seq=10 view=0 shape= first=10,11,12,13\n\
         batch seq=14 view=1 shape=2x4x4x4 first=14,15\n\
         end\n"
    );
    daemon.stop();
    let _ = std::fs::remove_dir_all(&dir); // (kept when the test fails, to look at)
}

/// `tests/c/reshard.c`: each rank of a run of 3 reshards the states of a run of 2 itself
/// (`fs_reshard`), opens the stream from its share and reads it to the end: together they read
/// every sample the old ranks left of their epoch once, then the next epoch as a run of 3; the
/// state each saves at the end resumes at the end.
#[test]
fn c_ranks_resume_a_run_of_another_world_size() {
    use feedstore_proto::reshard::Reshard;
    use std::collections::BTreeMap;

    let dir = scratch("reshard");
    let binary = compile("tests/c/reshard.c", &dir);
    let socket = dir.join("feedstored.sock");
    let _daemon = daemon(&socket);
    let old = StreamSpec {
        name: "c-reshard".into(),
        records: 23,
        seed: 8,
        world: 2,
        shuffle: Shuffle::Full,
        tail: Tail::Drop,
        epochs: Some(2),
        reshard: None,
    };
    // Rank 0 read 4 of its 11, rank 1 none.
    let states = [StreamState::at(&old, 0, 4), StreamState::at(&old, 1, 0)];
    let reshard = Reshard::new(&old, &states, 3).unwrap();
    let new = reshard.spec();
    let starts: Vec<StreamTask> = (0..3).map(|rank| StreamTask { rank, seq: 0 }).collect();
    let producer = produce_ranks(&socket, &new, &starts, [1, 8, 8], |r| r as u8);
    // (epoch, record) of each sample read.
    let mut read: BTreeMap<(u64, u64), u32> = BTreeMap::new();
    for p in 0..4 {
        *read.entry((0, old.record_at(0, p))).or_default() += 1;
    }
    let plain = new.plain();
    for rank in 0..3u32 {
        let out = Command::new(&binary)
            .arg(&socket)
            .args(["c-reshard", "23", "8", "2", "3", &rank.to_string()])
            .args(states.iter().map(StreamState::to_text))
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "rank {rank}: {}\n{stdout}",
            String::from_utf8_lossy(&out.stderr)
        );
        let mut lines = stdout.lines().collect::<Vec<_>>();
        let state = lines
            .pop()
            .unwrap()
            .strip_prefix("state ")
            .unwrap()
            .to_owned();
        assert!(state.starts_with("r1:"), "{state}");
        let share = reshard.share(rank);
        assert_eq!(
            lines.len() as u64,
            new.end_seq(rank).unwrap(),
            "rank {rank}"
        );
        for (seq, line) in lines.iter().enumerate() {
            let (s, record) = line.split_once(' ').unwrap();
            assert_eq!(s.parse::<u64>().unwrap(), seq as u64);
            let record: u64 = record.parse().unwrap();
            if (seq as u64) < share {
                *read
                    .entry((new.epoch_at(rank, seq as u64), record))
                    .or_default() += 1;
            } else {
                let k = seq as u64 - share;
                assert_eq!(record, plain.record_at(rank, plain.per_rank() + k));
            }
        }
    }
    let mut expected: BTreeMap<(u64, u64), u32> = BTreeMap::new();
    for rank in 0..2 {
        for p in 0..old.per_rank() {
            *expected.entry((0, old.record_at(rank, p))).or_default() += 1;
        }
    }
    assert_eq!(read, expected, "the epoch begun, each sample once");
    producer.join().unwrap();
}
