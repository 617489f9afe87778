//! The C example (`examples/read_stream.c`) compiled with gcc against the static library and
//! run against a real daemon while a producer feeds its stream: it prints what each sample holds,
//! and this test checks every line against the stream's spec.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use feedstore_consumer::{ConnectOptions, Delivery, Made, Role, StreamFeeder, StreamTask};
use feedstore_proto::sample::{DType, SampleInfo, SamplePlan, TensorLayout};
use feedstore_proto::stream::{Shuffle, StreamSpec, StreamState, Tail};

#[test]
fn the_c_example_reads_a_stream() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let dir = std::env::temp_dir().join(format!("feedstore-ffi-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();

    let target = feedstore_testkit::build_library("feedstore-ffi");
    let library = target.join("libfeedstore_c.a");
    assert!(library.exists(), "{} not built", library.display());
    let binary = dir.join("read_stream");
    let gcc = Command::new("gcc")
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-I"])
        .arg(root.join("include"))
        .arg(root.join("examples/read_stream.c"))
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

    let socket = dir.join("feedstored.sock");
    let daemon = feedstore_store::daemon::Daemon::bind(&feedstore_store::config::DaemonConfig {
        socket: socket.clone(),
        capacity_bytes: 64 << 20,
        segment_bytes: 64 << 20,
        ..feedstore_store::config::DaemonConfig::default()
    })
    .unwrap()
    .spawn();
    let spec = StreamSpec {
        name: "c-example".into(),
        records: 12,
        seed: 5,
        world: 2,
        shuffle: Shuffle::Full,
        tail: Tail::Drop,
        epochs: Some(2),
    };
    // A producer for rank 0: each sample is one 3x4x4 u8 image filled with its record number
    // and 8 tokens starting at 1000 + record.
    let producer = {
        let (socket, spec) = (socket.clone(), spec.clone());
        std::thread::spawn(move || {
            let client = ConnectOptions::new(Role::Writer)
                .socket(&socket)
                .connect()
                .unwrap();
            let feeder =
                StreamFeeder::join(&client, &spec, 16, &[StreamTask { rank: 0, seq: 0 }]).unwrap();
            while let Some(tasks) = feeder.take(8, Duration::from_millis(100)).unwrap() {
                let made = tasks
                    .into_iter()
                    .map(|task| {
                        let record = spec.record_at(task.rank, task.seq);
                        let mut plan = SamplePlan::new();
                        plan.add_image(DType::U8, TensorLayout::Chw, &[3, 4, 4]);
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
                            regions.images[0].fill(record as u8);
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
                feeder.put(made).unwrap();
            }
        })
    };

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
}
