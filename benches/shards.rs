//! Per-image S3 objects against WebDataset shards and Parquet files, behind S3-like latency:
//! samples/s and GET requests per sample, side by side in one run; and the two readers alone.
//!
//! A real `moto_server` on loopback behind the test harness's proxy, which adds a fixed latency
//! (default 50 ms) to every request. Two workloads, each stored twice in the same bucket: one
//! object per image (a JSONL manifest of `s3://` records, fetched 32 at a time, the producer's
//! default) and the same samples in 8 tar shards written by Python's `tarfile` (read a 4 MiB
//! ranged GET at a time, the next one under way) and in 8 Parquet files written by pyarrow with
//! Hugging Face's `Image` column (a row group at a time, one ranged GET of up to 16 MiB each).
//! The whole producer (`feedstore produce`'s pipeline, 2 CPU workers, an embedded store) makes
//! every sample of each. A second table reads the same shards and Parquet files from local
//! disk with no pipeline behind them: what the readers alone deliver.
//!
//! - photos: the 9 derived benchmark JPEGs (long side 512-2048 px) under 16 keys each, 144
//!   records: decode-heavy;
//! - shapes: 2,000 64×64 PNG crops of the photos, easy-VQA-sized: the per-object latency is
//!   most of a sample's cost.
//!
//! A third table feeds the same records as a stream to two ranks: objects read in a full
//! shuffle, shard samples by index (`ShardRows`, the shards indexed first) in blocks of a
//! piece's samples, and Parquet rows by index (`ParquetRows`) in blocks of a row group's rows.
//!
//! Run: `cargo bench --bench shards` (needs `pip install 'moto[server]'` and pyarrow in
//! `$FEEDSTORE_PYTHON`, as `scripts/test --install-only` sets up); `-- --latency-ms N` changes
//! the latency, `-- --quick` makes a quarter of the shapes.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use feedstore_consumer::{Stream, StreamOptions, StreamTask};
use feedstore_producer::chat::ChatTokenizer;
use feedstore_producer::feed::{FeedConfig, RecordIndex, feed};
use feedstore_producer::input::LocalFiles;
use feedstore_producer::manifest::{IndexedManifest, Manifest};
use feedstore_producer::pipeline::{Input, Inputs, ProducerConfig, Summary, run, run_inputs};
use feedstore_producer::shards::{PIECE_BYTES, Shard, ShardRows, Shards};
use feedstore_producer::tables::{DEFAULT_CACHE_BYTES, ParquetFiles, ParquetRows};
use feedstore_proto::stream::{Shuffle, StreamSpec, Tail};
use feedstore_s3::S3Fetcher;
use feedstore_testkit::moto::Moto;
use feedstore_testkit::proxy::{FaultProxy, Plan};
use feedstore_testkit::tar::{data_python, python_tar, run_python_with};

mod common;

const BUCKET: &str = "bench-shards";
const SHARDS: usize = 8;
use common::s3_options as options;

/// The record of sample `key` (its image named by the record in the shard, by URI in the
/// manifest).
fn record(key: &str, image: &str) -> serde_json::Value {
    serde_json::json!({"id": key, "image": image, "conversations": [
        {"from": "human", "value": "<image>\nWhat is in the picture?"},
        {"from": "gpt", "value": "A photograph."}]})
}

/// 64×64 crops of the committed photos, PNG: `count` of them, each a different crop.
fn shapes(count: usize) -> Vec<Vec<u8>> {
    let photos: Vec<image::RgbImage> = ["grace_hopper.jpg", "rocket.jpg", "chelsea.png"]
        .iter()
        .map(|n| {
            image::open(format!("{}/{n}", common::PHOTOS))
                .unwrap()
                .into_rgb8()
        })
        .collect();
    (0..count)
        .map(|i| {
            let photo = &photos[i % photos.len()];
            let (w, h) = photo.dimensions();
            let (x, y) = ((i as u32 * 37) % (w - 64), (i as u32 * 53) % (h - 64));
            let crop = image::imageops::crop_imm(photo, x, y, 64, 64).to_image();
            let mut bytes = Vec::new();
            crop.write_to(
                &mut std::io::Cursor::new(&mut bytes),
                image::ImageFormat::Png,
            )
            .unwrap();
            bytes
        })
        .collect()
}

/// How a workload's samples are stored.
struct Stored {
    /// The manifest of an object per image.
    manifest: std::path::PathBuf,
    /// The 8 shards, in S3 and on disk.
    shards: Vec<Shard>,
    local_shards: Vec<Shard>,
    /// The 8 Parquet files, in S3 and on disk.
    tables: Vec<Shard>,
    local_tables: Vec<Shard>,
}

/// Writes a Parquet file at `out` with pyarrow: a row (id, an `Image` of the file's bytes, the
/// conversation) per (key, image file).
fn write_parquet(out: &Path, rows: &[(String, std::path::PathBuf)]) {
    let script = r#"
import json, sys
import pyarrow as pa, pyarrow.parquet as pq
spec = json.load(sys.stdin)
image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
table = pa.table({
    "id": pa.array([key for key, _ in spec["rows"]]),
    "image": pa.array([{"bytes": open(f, "rb").read(), "path": None} for _, f in spec["rows"]],
                      type=image),
    "conversations": pa.array([[{"from": "human", "value": "<image>\nWhat is in the picture?"},
                                {"from": "gpt", "value": "A photograph."}]] * len(spec["rows"])),
})
# Row groups of 100, as `datasets` writes image data sets; no dictionary (a data set's images
# are all different, these repeat).
pq.write_table(table, spec["out"], row_group_size=100, use_dictionary=["id"])
"#;
    run_python_with(
        &data_python(),
        script,
        &serde_json::json!({"out": out, "rows": rows}),
    );
}

/// Uploads `images` as objects `<name>/img/<i>.<ext>`, as 8 shards `<name>/shard-<n>.tar` and
/// as 8 Parquet files `<name>/part-<n>.parquet`; writes the manifest of the objects.
fn store(
    runtime: &tokio::runtime::Runtime,
    s3: &S3Fetcher,
    dir: &Path,
    name: &str,
    images: &[(Vec<u8>, &str)],
) -> Stored {
    let put = |key: &str, body: Vec<u8>| {
        runtime.block_on(async {
            s3.client()
                .put_object()
                .bucket(BUCKET)
                .key(key)
                .body(body.into())
                .send()
                .await
                .unwrap();
        })
    };
    let files = dir.join(format!("{name}-img"));
    std::fs::create_dir_all(&files).unwrap();
    let mut tables: Vec<Vec<(String, std::path::PathBuf)>> = vec![Vec::new(); SHARDS];
    let mut lines = Vec::new();
    let mut shards: Vec<Vec<(String, Vec<u8>)>> = vec![Vec::new(); SHARDS];
    for (i, (bytes, ext)) in images.iter().enumerate() {
        let key = format!("{i:06}");
        let object = format!("{name}/img/{key}.{ext}");
        lines.push(record(&key, &format!("s3://{BUCKET}/{object}")).to_string());
        let shard = &mut shards[i * SHARDS / images.len()];
        shard.push((
            format!("{key}.json"),
            record(&key, &format!("{key}.{ext}"))
                .to_string()
                .into_bytes(),
        ));
        shard.push((format!("{key}.{ext}"), bytes.clone()));
        let file = files.join(format!("{key}.{ext}"));
        std::fs::write(&file, bytes).unwrap();
        tables[i * SHARDS / images.len()].push((key, file));
        put(&object, bytes.clone());
    }
    let manifest = dir.join(format!("{name}.jsonl"));
    std::fs::write(&manifest, lines.join("\n")).unwrap();
    let (mut names, mut local_shards) = (Vec::new(), Vec::new());
    for (n, members) in shards.iter().enumerate() {
        let path = dir.join(format!("{name}-{n}.tar"));
        let members: Vec<(&str, Vec<u8>)> = members
            .iter()
            .map(|(m, b)| (m.as_str(), b.clone()))
            .collect();
        python_tar(&path, "pax", &members);
        let key = format!("{name}/shard-{n}.tar");
        put(&key, std::fs::read(&path).unwrap());
        names.push(Shard::S3 {
            bucket: BUCKET.into(),
            key,
        });
        local_shards.push(Shard::Local(path));
    }
    let (mut parts, mut local_tables) = (Vec::new(), Vec::new());
    for (n, rows) in tables.iter().enumerate() {
        let path = dir.join(format!("{name}-{n}.parquet"));
        write_parquet(&path, rows);
        let key = format!("{name}/part-{n}.parquet");
        put(&key, std::fs::read(&path).unwrap());
        parts.push(Shard::S3 {
            bucket: BUCKET.into(),
            key,
        });
        local_tables.push(Shard::Local(path));
    }
    std::fs::remove_dir_all(&files).unwrap();
    Stored {
        manifest,
        shards: names,
        local_shards,
        tables: parts,
        local_tables,
    }
}

/// Reads every input of `inputs` and drops it: (inputs, seconds).
fn drain(runtime: &tokio::runtime::Runtime, mut inputs: impl Inputs) -> (u64, f64) {
    let started = std::time::Instant::now();
    let mut count = 0;
    runtime.block_on(async {
        while let Some(input) = inputs.next().await {
            assert!(matches!(input, Input::Read(..)), "{input:?}");
            count += 1;
        }
    });
    (count, started.elapsed().as_secs_f64())
}

/// Feeds the stream `name` of `records` to two ranks, each read to its end by a thread of its
/// own: (samples read, seconds from the feed's start to the last one).
fn feed_two_ranks(
    config: &ProducerConfig,
    tokenizer: &Arc<ChatTokenizer>,
    fetcher: &Arc<S3Fetcher>,
    name: &str,
    records: Arc<dyn RecordIndex>,
    shuffle: Shuffle,
) -> (u64, f64) {
    let spec = StreamSpec {
        name: name.into(),
        records: records.len(),
        seed: 11,
        world: 2,
        shuffle,
        tail: Tail::Pad,
        epochs: Some(1),
        reshard: None,
    };
    let started = std::time::Instant::now();
    let readers: Vec<_> = (0..2)
        .map(|rank| {
            let (socket, spec) = (config.socket.clone(), spec.clone());
            std::thread::spawn(move || {
                let mut stream =
                    Stream::open(&socket, &spec, rank, None, StreamOptions::default()).unwrap();
                let mut read = 0u64;
                for sample in &mut stream {
                    std::hint::black_box(sample.unwrap().view().unwrap().tokens().len());
                    read += 1;
                }
                read
            })
        })
        .collect();
    let feed_config = FeedConfig {
        spec: spec.clone(),
        depth: 64,
        at: Vec::new(),
        relay: String::new(),
        ranks: vec![
            StreamTask { rank: 0, seq: 0 },
            StreamTask { rank: 1, seq: 0 },
        ],
        cache: false,
        batch: 0,
    };
    let summary = feed(
        config,
        &feed_config,
        tokenizer.clone(),
        fetcher.clone(),
        records,
        |_, _| {},
    )
    .unwrap();
    assert_eq!(summary.rejected, 0);
    let read: u64 = readers.into_iter().map(|r| r.join().unwrap()).sum();
    (read, started.elapsed().as_secs_f64())
}

fn main() {
    let (quick, latency) = common::s3_bench_flags();
    let dir = std::env::temp_dir().join(format!("feedstore-bench-shards-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let moto = Moto::start().expect("moto_server (pip install 'moto[server]')");
    let proxy = FaultProxy::start(
        moto.addr(),
        Plan {
            latency,
            rules: Vec::new(),
        },
    )
    .unwrap();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let direct = runtime.block_on(S3Fetcher::new(&options(moto.endpoint())));
    runtime.block_on(async {
        direct
            .client()
            .create_bucket()
            .bucket(BUCKET)
            .send()
            .await
            .unwrap();
    });
    let photos: Vec<(Vec<u8>, &str)> = common::derive_images(&dir.join("photos"))
        .iter()
        .flat_map(|p| std::iter::repeat_n(std::fs::read(p).unwrap(), 16))
        .map(|b| (b, "jpg"))
        .collect();
    let shapes: Vec<(Vec<u8>, &str)> = shapes(if quick { 500 } else { 2000 })
        .into_iter()
        .map(|b| (b, "png"))
        .collect();
    let workloads = [
        (
            "photos",
            "JPEG 512-2048 px",
            store(&runtime, &direct, &dir, "photos", &photos),
            &photos,
        ),
        (
            "shapes",
            "PNG 64x64",
            store(&runtime, &direct, &dir, "shapes", &shapes),
            &shapes,
        ),
    ];

    let tokenizer = Arc::new(ChatTokenizer::from_bytes(&common::tokenizer_json(), 8192).unwrap());
    let socket = dir.join("feedstored.sock");
    let daemon = common::embedded_daemon(&socket, 2 << 30);
    let fetcher: Arc<S3Fetcher> =
        Arc::new(runtime.block_on(S3Fetcher::new(&options(proxy.endpoint()))));
    let mut config = ProducerConfig::new(socket.clone());
    config.workers = 2;
    config.fetch_concurrency = 32;
    config.transform.resize = feedstore_producer::vision::ResizeMode::Fixed {
        width: 224,
        height: 224,
    };

    println!(
        "## Per-image objects against {SHARDS} tar shards and {SHARDS} Parquet files, behind a {} ms proxy (moto_server on loopback, 2 CPU workers, 32 fetches in flight)",
        latency.as_millis()
    );
    println!();
    println!("| workload | read as | samples | MB | samples/s | GETs per sample | verdict |");
    println!("|---|---|---|---|---|---|---|");
    for (name, what, stored, images) in &workloads {
        let bytes: usize = images.iter().map(|(b, _)| b.len()).sum();
        let mut rates = Vec::new();
        for form in ["an object per image", "8 shards", "8 Parquet files"] {
            let before = proxy.seen().len();
            let summary: Summary = match form {
                "an object per image" => run(
                    &config,
                    tokenizer.clone(),
                    fetcher.clone(),
                    Manifest::open(&stored.manifest).unwrap(),
                    |_, _| {},
                ),
                "8 shards" => run_inputs(
                    &config,
                    tokenizer.clone(),
                    fetcher.clone(),
                    Shards::new(stored.shards.clone(), fetcher.clone(), 64 << 20),
                    |_, _| {},
                ),
                _ => run_inputs(
                    &config,
                    tokenizer.clone(),
                    fetcher.clone(),
                    ParquetFiles::new(
                        stored.tables.clone(),
                        fetcher.clone(),
                        64 << 20,
                        dir.clone(),
                    ),
                    |_, _| {},
                ),
            }
            .unwrap();
            assert_eq!(summary.rejected, 0);
            assert_eq!(summary.produced, images.len() as u64);
            let gets = proxy.seen().len() - before;
            let rate = summary.produced as f64 / summary.profile.wall.as_secs_f64();
            rates.push(rate);
            println!(
                "| {name} ({what}) | {form} | {} | {:.1} | {rate:.1} | {:.3} | {} |",
                summary.produced,
                bytes as f64 / 1e6,
                gets as f64 / summary.produced as f64,
                summary.profile.verdict()
            );
            eprint!("{}", summary.profile.table());
        }
        println!(
            "| {name} | shards / objects, Parquet / objects | | | {:.2}x, {:.2}x | | |",
            rates[1] / rates[0],
            rates[2] / rates[0]
        );
    }

    // A stream: the same records fed to two ranks reading as fast as they can, in a shuffled
    // order (objects: a full shuffle; Parquet: blocks of a row group's rows, its default).
    println!();
    println!(
        "## Feeding a stream of 2 ranks, one epoch, behind the same proxy (2 CPU workers, depth 64, decode-once cache off)"
    );
    println!();
    println!(
        "| workload | read as | shuffle | samples | samples/s | GETs per sample | pieces read |"
    );
    println!("|---|---|---|---|---|---|---|");
    for (name, what, stored, images) in &workloads {
        let mut rates = Vec::new();
        for form in ["an object per image", "8 shards", "8 Parquet files"] {
            let before = proxy.seen().len();
            // The source, its order, and what it says it read.
            let (records, shuffle, count): (Arc<dyn RecordIndex>, _, Box<dyn Fn() -> String>) =
                match form {
                    "an object per image" => (
                        Arc::new(IndexedManifest::open(&stored.manifest).unwrap()),
                        Shuffle::Full,
                        Box::new(String::new),
                    ),
                    "8 shards" => {
                        let rows = Arc::new(
                            ShardRows::open(
                                stored.shards.clone(),
                                fetcher.clone(),
                                64 << 20,
                                (PIECE_BYTES, DEFAULT_CACHE_BYTES),
                                |_| true,
                            )
                            .unwrap(),
                        );
                        let block = Shuffle::Block(rows.largest_piece() as u32);
                        let read = rows.clone();
                        let count = move || {
                            let again = read.reads().reread.load(Ordering::Relaxed);
                            format!("{} pieces, {again} read again", read.pieces())
                        };
                        (rows, block, Box::new(count))
                    }
                    _ => {
                        let rows = Arc::new(
                            ParquetRows::open(
                                stored.tables.clone(),
                                fetcher.clone(),
                                64 << 20,
                                dir.clone(),
                                DEFAULT_CACHE_BYTES,
                            )
                            .unwrap(),
                        );
                        let block = Shuffle::Block(rows.largest_piece() as u32);
                        let read = rows.clone();
                        let count = move || {
                            let groups = read.stats().row_groups.load(Ordering::Relaxed);
                            format!("{groups} of {} row groups", read.pieces())
                        };
                        (rows, block, Box::new(count))
                    }
                };
            let stream = format!("{name}-{}", rates.len());
            let (made, seconds) =
                feed_two_ranks(&config, &tokenizer, &fetcher, &stream, records, shuffle);
            assert_eq!(made, images.len() as u64);
            let gets = proxy.seen().len() - before;
            let rate = made as f64 / seconds;
            rates.push(rate);
            println!(
                "| {name} ({what}) | {form} | {shuffle} | {made} | {rate:.1} | {:.3} | {} |",
                gets as f64 / made as f64,
                count(),
            );
        }
        println!(
            "| {name} | shards / objects, Parquet / objects | | | {:.2}x, {:.2}x | | |",
            rates[1] / rates[0],
            rates[2] / rates[0]
        );
    }

    // The readers alone, from local disk: what each hands the pipeline, with nothing behind.
    println!();
    println!(
        "## The readers alone: the same samples from local disk, each input dropped as read (best of 3)"
    );
    println!();
    println!("| workload | read as | samples | MB on disk | samples/s | MB/s |");
    println!("|---|---|---|---|---|---|");
    let local = Arc::new(LocalFiles::anywhere(64 << 20));
    for (name, what, stored, _) in &workloads {
        for (form, files) in [
            ("8 shards", &stored.local_shards),
            ("8 Parquet files", &stored.local_tables),
        ] {
            let on_disk: u64 = files
                .iter()
                .map(|f| match f {
                    Shard::Local(p) => std::fs::metadata(p).unwrap().len(),
                    Shard::S3 { .. } => unreachable!("local files"),
                })
                .sum();
            let best = (0..3)
                .map(|_| match form {
                    "8 shards" => drain(
                        &runtime,
                        Shards::new(files.clone(), local.clone(), 64 << 20),
                    ),
                    _ => drain(
                        &runtime,
                        ParquetFiles::new(files.clone(), local.clone(), 64 << 20, dir.clone()),
                    ),
                })
                .min_by(|a, b| a.1.total_cmp(&b.1))
                .unwrap();
            println!(
                "| {name} ({what}) | {form} | {} | {:.1} | {:.0} | {:.0} |",
                best.0,
                on_disk as f64 / 1e6,
                best.0 as f64 / best.1,
                on_disk as f64 / 1e6 / best.1
            );
        }
    }
    daemon.stop();
    let _ = std::fs::remove_dir_all(&dir);
}
