//! The S3 fetcher against a real S3-compatible server on loopback (`moto_server`, from PyPI's
//! `moto[server]`, which `.ci/run` installs): objects come back byte for byte, a missing key or
//! bucket is a clear not-found, and the pipeline produces from `s3://` references, rejecting the
//! missing one with its reason.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::DATA;
use feedstore_producer::manifest::{ImageSource, Manifest};
use feedstore_producer::pipeline::{Event, Fetch, FetchError, ProducerConfig, run};
use feedstore_s3::{S3Fetcher, S3Options};
use feedstore_testkit::moto::Moto;
use feedstore_testkit::proxy::{Fault, FaultProxy, Plan, Rule};

fn options(endpoint: String) -> S3Options {
    S3Options {
        endpoint: Some(endpoint),
        region: Some("us-east-1".into()),
        force_path_style: true,
        static_credentials: Some(("testing".into(), "testing".into())),
        attempt_timeout: Duration::from_secs(10),
        ..S3Options::default()
    }
}

/// A bucket holding `objects` in `moto`, and a fetcher reaching it through a proxy that cuts
/// off the body of the first reply for a key containing `cut` (to be retried).
fn bucket_behind_proxy(
    runtime: &tokio::runtime::Runtime,
    moto: &Moto,
    bucket: &str,
    objects: &[(&str, Vec<u8>)],
    cut: &str,
) -> (FaultProxy, Arc<S3Fetcher>) {
    let direct = runtime.block_on(S3Fetcher::new(&options(moto.endpoint())));
    runtime.block_on(async {
        let client = direct.client();
        client.create_bucket().bucket(bucket).send().await.unwrap();
        for (key, body) in objects {
            client
                .put_object()
                .bucket(bucket)
                .key(*key)
                .body(body.clone().into())
                .send()
                .await
                .unwrap();
        }
    });
    let proxy = FaultProxy::start(
        moto.addr(),
        Plan {
            latency: Duration::ZERO,
            rules: vec![Rule::new(cut, Fault::ResetMidBody).times(1)],
        },
    )
    .unwrap();
    let fetcher = Arc::new(runtime.block_on(S3Fetcher::new(&options(proxy.endpoint()))));
    (proxy, fetcher)
}

fn s3(bucket: &str, key: &str) -> ImageSource {
    ImageSource::S3 {
        bucket: bucket.into(),
        key: key.into(),
    }
}

#[test]
fn fetches_from_s3_and_rejects_missing_objects() {
    let moto = Moto::start().unwrap();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let fetcher = runtime.block_on(S3Fetcher::new(&options(moto.endpoint())));
    let photos = ["grace_hopper.jpg", "rocket.jpg", "chelsea.png"];
    runtime.block_on(async {
        fetcher
            .client()
            .create_bucket()
            .bucket("vqa")
            .send()
            .await
            .unwrap();
        for name in photos {
            let body = std::fs::read(format!("{DATA}/photos/{name}")).unwrap();
            fetcher
                .client()
                .put_object()
                .bucket("vqa")
                .key(format!("img/{name}"))
                .body(body.into())
                .send()
                .await
                .unwrap();
        }
        let got = fetcher.fetch(&s3("vqa", "img/rocket.jpg")).await.unwrap();
        assert_eq!(
            got,
            std::fs::read(format!("{DATA}/photos/rocket.jpg")).unwrap(),
            "byte for byte"
        );
        assert!(matches!(
            fetcher.fetch(&s3("vqa", "img/nope.jpg")).await,
            Err(FetchError::NotFound(_))
        ));
        assert!(matches!(
            fetcher.fetch(&s3("no-such-bucket", "x.jpg")).await,
            Err(FetchError::NotFound(_))
        ));
        // An object over the limit is refused by its length, before its body is read.
        let small = S3Fetcher::new(&S3Options {
            max_object_bytes: 100_000,
            ..options(moto.endpoint())
        })
        .await;
        assert!(small.fetch(&s3("vqa", "img/grace_hopper.jpg")).await.is_ok());
        let err = small
            .fetch(&s3("vqa", "img/chelsea.png"))
            .await
            .unwrap_err();
        assert!(
            matches!(&err, FetchError::TooLarge(m)
                if m == "s3://vqa/img/chelsea.png is 240512 bytes, over the 100000-byte limit (--max-image-bytes)"),
            "{err}"
        );
    });

    // The pipeline over s3:// references.
    let dir = std::env::temp_dir().join(format!("feedstore-s3-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let mut lines: Vec<String> = photos
        .iter()
        .map(|name| {
            serde_json::json!({"id": name, "image": format!("s3://vqa/img/{name}"), "conversations": [
                {"from": "human", "value": "<image>\nwhat is this?"}, {"from": "gpt", "value": "a photo"}]})
            .to_string()
        })
        .collect();
    lines.push(
        serde_json::json!({"id": "missing", "image": "s3://vqa/img/missing.jpg", "conversations": [
            {"from": "human", "value": "<image>\n?"}, {"from": "gpt", "value": "!"}]})
        .to_string(),
    );
    let manifest_path = dir.join("m.jsonl");
    std::fs::write(&manifest_path, lines.join("\n")).unwrap();
    let socket = dir.join("feedstored.sock");
    let daemon = common::embedded_daemon(&socket, 128 << 20);
    let tokenizer = Arc::new(common::tokenizer(4096));
    let mut config = ProducerConfig::new(socket);
    config.workers = 2;
    let mut rejects = Vec::new();
    let summary = run(
        &config,
        tokenizer,
        Arc::new(fetcher),
        Manifest::open(&manifest_path).unwrap(),
        |e, _| {
            if let Event::Rejected(r) = e {
                rejects.push(r.clone());
            }
        },
    )
    .unwrap();
    assert_eq!((summary.produced, summary.rejected), (3, 1));
    assert_eq!(rejects[0].id.as_deref(), Some("missing"));
    assert_eq!(rejects[0].stage, "fetch");
    assert!(
        rejects[0]
            .reason
            .contains("not found: s3://vqa/img/missing.jpg"),
        "{:?}",
        rejects[0].reason
    );
    daemon.stop();
    let _ = std::fs::remove_dir_all(&dir); // (kept when the test fails, to look at)
}

#[test]
fn transient_failures_are_retried_and_final_ones_are_not() {
    let moto = Moto::start().unwrap();
    let photo = std::fs::read(format!("{DATA}/photos/rocket.jpg")).unwrap();
    let keys = [
        "status-500",
        "slow-down",
        "reset",
        "cut",
        "stall",
        "trickle",
        "always-500",
        "denied",
    ];
    let proxy = FaultProxy::start(
        moto.addr(),
        Plan {
            latency: Duration::from_millis(5),
            rules: vec![
                Rule::new("img/status-500", Fault::Status(500)).times(2),
                Rule::new("img/slow-down", Fault::Status(503)).times(3),
                Rule::new("img/reset", Fault::ResetBeforeResponse).times(1),
                Rule::new("img/cut", Fault::ResetMidBody).times(2),
                Rule::new("img/stall", Fault::StallBody(Duration::from_secs(3))).times(1),
                Rule::new(
                    "img/trickle",
                    Fault::SlowBody {
                        chunk: 4096,
                        pause: Duration::from_millis(2),
                    },
                ),
                Rule::new("img/always-500", Fault::Status(500)),
                Rule::new("img/denied", Fault::Status(403)),
            ],
        },
    )
    .unwrap();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        // Uploads go straight to moto; fetches go through the proxy.
        let direct = S3Fetcher::new(&options(moto.endpoint())).await;
        direct
            .client()
            .create_bucket()
            .bucket("faults")
            .send()
            .await
            .unwrap();
        for key in keys {
            direct
                .client()
                .put_object()
                .bucket("faults")
                .key(format!("img/{key}"))
                .body(photo.clone().into())
                .send()
                .await
                .unwrap();
        }
        let fetcher = S3Fetcher::new(&S3Options {
            max_attempts: 4,
            initial_backoff: Duration::from_millis(20),
            attempt_timeout: Duration::from_secs(1),
            ..options(proxy.endpoint())
        })
        .await;
        for key in [
            "status-500",
            "slow-down",
            "reset",
            "cut",
            "stall",
            "trickle",
        ] {
            let got = fetcher
                .fetch(&s3("faults", &format!("img/{key}")))
                .await
                .unwrap_or_else(|e| panic!("{key}: {e}"));
            assert!(got == photo, "{key}: byte for byte");
        }
        let err = fetcher
            .fetch(&s3("faults", "img/always-500"))
            .await
            .unwrap_err();
        assert!(
            matches!(&err, FetchError::Other(m) if m.contains("after retries")),
            "{err}"
        );
        let err = fetcher
            .fetch(&s3("faults", "img/denied"))
            .await
            .unwrap_err();
        assert!(matches!(err, FetchError::AccessDenied(_)), "{err}");
    });
    // The faults really happened, and each retry was one more request.
    for (key, requests) in [
        ("status-500", 3),
        ("slow-down", 4),
        ("reset", 2),
        ("cut", 3),
        ("stall", 2),
        ("trickle", 1),
        ("always-500", 4),
        ("denied", 1),
    ] {
        assert_eq!(
            proxy.requests_for(&format!("img/{key}")),
            requests,
            "requests for {key}: {:?}",
            proxy.seen()
        );
    }
}

/// A shard of 15 MiB in S3, read through a proxy that resets the body of one ranged GET: four
/// chunks (each the next one's GET under way while it is read, a reply cut off retried), members
/// no sample uses jumped over where they run past what is buffered, every sample whole and byte
/// for byte, and a range past the end (416) read as the end. Then `fetch_range` alone: a range
/// from the middle, one past the end, and a missing key.
#[test]
fn a_shard_in_s3_is_read_a_ranged_get_at_a_time() {
    use feedstore_producer::pipeline::{Input, Inputs};
    use feedstore_producer::shards::{CHUNK_BYTES, Shard, Shards};
    use std::sync::atomic::Ordering;

    let moto = Moto::start().unwrap();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let dir = std::env::temp_dir().join(format!(
        "feedstore-producer-{}-s3-shard",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let photo = std::fs::read(format!("{DATA}/photos/grace_hopper.jpg")).unwrap();
    let record = serde_json::json!({"conversations": [
        {"from": "human", "value": "<image>\nwho?"}, {"from": "gpt", "value": "an admiral"}]})
    .to_string()
    .into_bytes();
    let keys: Vec<String> = (0..12).map(|i| format!("{i:03}")).collect();
    let names: Vec<[String; 3]> = keys
        .iter()
        .map(|k| [format!("{k}.npy"), format!("{k}.jpg"), format!("{k}.json")])
        .collect();
    let mut members = Vec::new();
    for (i, [npy, jpg, json]) in names.iter().enumerate() {
        // Every third sample carries 3 MiB no sample uses: jumped over, not fetched.
        let filler = if i % 3 == 0 { 3 << 20 } else { 1000 };
        members.push((npy.as_str(), vec![i as u8; filler]));
        members.push((jpg.as_str(), photo.clone()));
        members.push((json.as_str(), record.clone()));
    }
    let tar = dir.join("shard.tar");
    feedstore_testkit::tar::python_tar(&tar, "ustar", &members);
    let bytes = std::fs::read(&tar).unwrap();
    assert!(bytes.len() as u64 > 3 * CHUNK_BYTES);
    // The first ranged GET's body is cut off once: retried as a whole.
    let (proxy, fetcher) = bucket_behind_proxy(
        &runtime,
        &moto,
        "wds",
        &[("train/shard-0.tar", bytes.clone())],
        "shard-0.tar",
    );
    let mut reader = Shards::new(
        vec![Shard::S3 {
            bucket: "wds".into(),
            key: "train/shard-0.tar".into(),
        }],
        fetcher.clone(),
        64 << 20,
    );
    let read = runtime.block_on(async {
        let mut read = Vec::new();
        while let Some(input) = reader.next().await {
            match input {
                Input::Read(record, images) => {
                    assert_eq!(images.len(), 1);
                    assert_eq!(images[0], photo, "{} byte for byte", record.id);
                    read.push(record.id);
                }
                other => panic!("{other:?}"),
            }
        }
        read
    });
    assert_eq!(read, keys);
    let stats = reader.stats();
    let (got, requests) = (
        stats.bytes.load(Ordering::Relaxed),
        stats.requests.load(Ordering::Relaxed),
    );
    // The 3 MiB fillers past the buffer are not fetched.
    assert!(
        got < bytes.len() as u64 - (3 << 20),
        "read {got} of {}",
        bytes.len()
    );
    assert!(
        requests <= 2 * (bytes.len() as u64 / CHUNK_BYTES + 1) + 4,
        "{requests}"
    );
    let seen = proxy.requests_for("shard-0.tar");
    assert!(
        seen >= 3 && proxy.faults() == 1,
        "{seen} GETs, {} faults",
        proxy.faults()
    );

    runtime.block_on(async {
        let source = s3("wds", "train/shard-0.tar");
        let len = bytes.len() as u64;
        let middle = fetcher.fetch_range(&source, 1000, 5000).await.unwrap();
        assert_eq!(middle, bytes[1000..6000]);
        let tail = fetcher.fetch_range(&source, len - 10, 100).await.unwrap();
        assert_eq!(tail, bytes[bytes.len() - 10..]);
        assert!(
            fetcher
                .fetch_range(&source, len, 100)
                .await
                .unwrap()
                .is_empty()
        );
        assert!(
            fetcher
                .fetch_range(&source, len + 5000, 100)
                .await
                .unwrap()
                .is_empty()
        );
        assert!(matches!(
            fetcher.fetch_range(&s3("wds", "nope.tar"), 0, 100).await,
            Err(FetchError::NotFound(_))
        ));
    });

    // Indexed for a stream (the shard read through once, the 3 MiB fillers passed over), then
    // read by index, last sample first, in pieces of about 1 MiB: every image byte for byte.
    use feedstore_producer::feed::RecordIndex;
    use feedstore_producer::shards::ShardRows;
    let rows = ShardRows::open(
        vec![Shard::S3 {
            bucket: "wds".into(),
            key: "train/shard-0.tar".into(),
        }],
        fetcher.clone(),
        64 << 20,
        (1 << 20, 1 << 30),
        |_| true,
    )
    .unwrap();
    assert_eq!(rows.len(), 12);
    assert!(rows.pieces() >= 4, "{} pieces", rows.pieces());
    for i in (0..12u64).rev() {
        let read = rows.get(i).unwrap();
        assert_eq!(read.record.id, keys[i as usize]);
        let images = read.images.unwrap();
        assert!(
            images.len() == 1 && images[0] == photo,
            "sample {i} byte for byte"
        );
    }
    assert_eq!(rows.reads().reread.load(Ordering::Relaxed), 0);
    // A shard that is not there stops the index, naming it.
    let missing = ShardRows::open(
        vec![Shard::S3 {
            bucket: "wds".into(),
            key: "train/nope.tar".into(),
        }],
        fetcher.clone(),
        64 << 20,
        (1 << 20, 1 << 30),
        |_| true,
    )
    .unwrap_err();
    assert!(missing.contains("s3://wds/train/nope.tar"), "{missing}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A Parquet file of 80 rows (19 MiB) in S3, read through a proxy that resets the body of one
/// GET: its end in one GET (the footer and the file's length), a row group of 70 rows (over
/// 16 MiB) in two ranged GETs, the next in one, the reply cut off retried, every image byte for
/// byte. Then `fetch_tail` alone: an end, an object shorter than asked, an empty one, a missing
/// key.
#[test]
fn a_parquet_file_in_s3_is_read_a_row_group_at_a_time() {
    use feedstore_producer::pipeline::{Input, Inputs};
    use feedstore_producer::shards::Shard;
    use feedstore_producer::tables::{GET_BYTES, ParquetFiles};
    use std::sync::atomic::Ordering;

    let moto = Moto::start().unwrap();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let dir = std::env::temp_dir().join(format!(
        "feedstore-producer-{}-s3-parquet",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let photo = std::fs::read(format!("{DATA}/photos/chelsea.png")).unwrap();
    let path = dir.join("data.parquet");
    feedstore_testkit::tar::run_python_with(
        &feedstore_testkit::tar::data_python(),
        r#"
import json, sys
import pyarrow as pa, pyarrow.parquet as pq
spec = json.load(sys.stdin)
image = open(spec["photo"], "rb").read()
n = 80
table = pa.table({
    "id": pa.array(["%03d" % i for i in range(n)]),
    "image": pa.array([{"bytes": image + i.to_bytes(4, "little"), "path": None} for i in range(n)],
                      type=pa.struct([("bytes", pa.binary()), ("path", pa.string())])),
    "text": pa.array(["sample %d" % i for i in range(n)]),
})
pq.write_table(table, spec["out"], row_group_size=70, compression="snappy")
"#,
        &serde_json::json!({"out": path, "photo": format!("{DATA}/photos/chelsea.png")}),
    );
    let bytes = std::fs::read(&path).unwrap();
    let (proxy, fetcher) = bucket_behind_proxy(
        &runtime,
        &moto,
        "hf-data",
        &[("data.parquet", bytes.clone()), ("empty", Vec::new())],
        "data.parquet",
    );
    let mut reader = ParquetFiles::new(
        vec![Shard::S3 {
            bucket: "hf-data".into(),
            key: "data.parquet".into(),
        }],
        fetcher.clone(),
        64 << 20,
        dir.clone(),
    );
    let stats = reader.stats();
    let ids = runtime.block_on(async {
        let mut ids = Vec::new();
        while let Some(input) = reader.next().await {
            match input {
                Input::Read(record, images) => {
                    let i = ids.len() as u32;
                    let mut expected = photo.clone();
                    expected.extend(i.to_le_bytes());
                    assert_eq!(images, [expected], "{} byte for byte", record.id);
                    ids.push(record.id);
                }
                other => panic!("{other:?}"),
            }
        }
        ids
    });
    assert_eq!(ids, (0..80).map(|i| format!("{i:03}")).collect::<Vec<_>>());
    assert!(stats.peak_row_group.load(Ordering::Relaxed) > GET_BYTES);
    // The end, two GETs for the first row group, one for the second.
    assert_eq!(stats.requests.load(Ordering::Relaxed), 4);
    assert_eq!(stats.row_groups.load(Ordering::Relaxed), 2);
    assert!(
        proxy.requests_for("data.parquet") == 5 && proxy.faults() == 1,
        "{} GETs, {} faults",
        proxy.requests_for("data.parquet"),
        proxy.faults()
    );

    runtime.block_on(async {
        let source = s3("hf-data", "data.parquet");
        let len = bytes.len() as u64;
        let (tail, total) = fetcher.fetch_tail(&source, 100).await.unwrap();
        assert_eq!((tail.as_ref(), total), (&bytes[bytes.len() - 100..], len));
        let (whole, total) = fetcher.fetch_tail(&source, len + 100).await.unwrap();
        assert_eq!((whole.len() as u64, total), (len, len));
        let (empty, total) = fetcher
            .fetch_tail(&s3("hf-data", "empty"), 100)
            .await
            .unwrap();
        assert_eq!((empty.len(), total), (0, 0));
        assert!(matches!(
            fetcher
                .fetch_tail(&s3("hf-data", "nope.parquet"), 100)
                .await,
            Err(FetchError::NotFound(_))
        ));
    });

    // Read by index for a stream, last row first: the end read to count the rows, read again
    // when the file is opened, then each row group once (the first in two GETs), every image
    // byte for byte.
    use feedstore_producer::feed::RecordIndex;
    use feedstore_producer::tables::ParquetRows;
    let file = |key: &str| Shard::S3 {
        bucket: "hf-data".into(),
        key: key.into(),
    };
    let rows = ParquetRows::open(
        vec![file("data.parquet")],
        fetcher.clone(),
        64 << 20,
        dir.clone(),
        1 << 30,
    )
    .unwrap();
    assert_eq!((rows.len(), rows.largest_piece()), (80, 70));
    for i in (0..80u32).rev() {
        let read = rows.get(u64::from(i)).unwrap();
        let mut expected = photo.clone();
        expected.extend(i.to_le_bytes());
        assert_eq!(read.record.id, format!("{i:03}"));
        assert_eq!(read.images.unwrap(), [expected], "row {i} byte for byte");
    }
    let stats = rows.stats();
    assert_eq!(stats.requests.load(Ordering::Relaxed), 5);
    assert_eq!(stats.row_groups.load(Ordering::Relaxed), 2);
    // A file missing from the list stops the stream before it starts, naming it.
    let missing = ParquetRows::open(
        vec![file("data.parquet"), file("nope.parquet")],
        fetcher.clone(),
        64 << 20,
        dir.clone(),
        1 << 30,
    )
    .unwrap_err();
    assert!(
        missing.starts_with("s3://hf-data/nope.parquet: "),
        "{missing}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
