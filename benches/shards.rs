//! Per-image S3 objects against WebDataset shards, behind S3-like latency: samples/s and GET
//! requests per sample, side by side in one run.
//!
//! A real `moto_server` on loopback behind the test harness's proxy, which adds a fixed latency
//! (default 50 ms) to every request. Two workloads, each stored twice in the same bucket: one
//! object per image (a JSONL manifest of `s3://` records, fetched 32 at a time, the producer's
//! default) and the same samples in 8 tar shards written by Python's `tarfile` (read a 4 MiB
//! ranged GET at a time, the next one under way). The whole producer (`feedstore produce`'s
//! pipeline, 2 CPU workers, an embedded store) makes every sample of each.
//!
//! - photos: the 9 derived benchmark JPEGs (long side 512-2048 px) under 16 keys each, 144
//!   records: decode-heavy;
//! - shapes: 2,000 64×64 PNG crops of the photos, easy-VQA-sized: the per-object latency is
//!   most of a sample's cost.
//!
//! Run: `cargo bench --bench shards` (needs `pip install 'moto[server]'`); `-- --latency-ms N`
//! changes the latency, `-- --quick` makes a quarter of the shapes.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use feedstore_producer::chat::ChatTokenizer;
use feedstore_producer::manifest::Manifest;
use feedstore_producer::pipeline::{ProducerConfig, Summary, run, run_inputs};
use feedstore_producer::shards::{Shard, Shards};
use feedstore_s3::S3Fetcher;
use feedstore_testkit::moto::Moto;
use feedstore_testkit::proxy::{FaultProxy, Plan};
use feedstore_testkit::tar::python_tar;

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

/// Uploads `images` as objects `<name>/img/<i>.<ext>` and as 8 shards
/// `<name>/shard-<n>.tar`; writes the manifest of the objects. Returns the manifest and the
/// shards.
fn store(
    runtime: &tokio::runtime::Runtime,
    s3: &S3Fetcher,
    dir: &Path,
    name: &str,
    images: &[(Vec<u8>, &str)],
) -> (std::path::PathBuf, Vec<Shard>) {
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
        runtime.block_on(async {
            s3.client()
                .put_object()
                .bucket(BUCKET)
                .key(&object)
                .body(bytes.clone().into())
                .send()
                .await
                .unwrap();
        });
    }
    let manifest = dir.join(format!("{name}.jsonl"));
    std::fs::write(&manifest, lines.join("\n")).unwrap();
    let mut names = Vec::new();
    for (n, members) in shards.iter().enumerate() {
        let path = dir.join(format!("{name}-{n}.tar"));
        let members: Vec<(&str, Vec<u8>)> = members
            .iter()
            .map(|(m, b)| (m.as_str(), b.clone()))
            .collect();
        python_tar(&path, "pax", &members);
        let key = format!("{name}/shard-{n}.tar");
        runtime.block_on(async {
            s3.client()
                .put_object()
                .bucket(BUCKET)
                .key(&key)
                .body(std::fs::read(&path).unwrap().into())
                .send()
                .await
                .unwrap();
        });
        names.push(Shard::S3 {
            bucket: BUCKET.into(),
            key,
        });
    }
    (manifest, names)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    let latency = Duration::from_millis(
        args.iter()
            .position(|a| a == "--latency-ms")
            .and_then(|i| args.get(i + 1))
            .map_or(50, |v| v.parse().expect("--latency-ms N")),
    );
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
        "## Per-image objects against {SHARDS} tar shards, behind a {} ms proxy (moto_server on loopback, 2 CPU workers, 32 fetches in flight)",
        latency.as_millis()
    );
    println!();
    println!("| workload | read as | samples | MB | samples/s | GETs per sample | verdict |");
    println!("|---|---|---|---|---|---|---|");
    for (name, what, (manifest, shards), images) in &workloads {
        let bytes: usize = images.iter().map(|(b, _)| b.len()).sum();
        let mut rates = Vec::new();
        for shards in [None, Some(shards.clone())] {
            let before = proxy.seen().len();
            let summary: Summary = match &shards {
                None => run(
                    &config,
                    tokenizer.clone(),
                    fetcher.clone(),
                    Manifest::open(manifest).unwrap(),
                    |_, _| {},
                ),
                Some(list) => run_inputs(
                    &config,
                    tokenizer.clone(),
                    fetcher.clone(),
                    Shards::new(list.clone(), fetcher.clone(), 64 << 20),
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
                "| {name} ({what}) | {} | {} | {:.1} | {rate:.1} | {:.3} | {} |",
                if shards.is_some() {
                    format!("{SHARDS} shards")
                } else {
                    "an object per image".into()
                },
                summary.produced,
                bytes as f64 / 1e6,
                gets as f64 / summary.produced as f64,
                summary.profile.verdict()
            );
            eprint!("{}", summary.profile.table());
        }
        println!(
            "| {name} | shards / objects | | | {:.2}x | | |",
            rates[1] / rates[0]
        );
    }
    daemon.stop();
    let _ = std::fs::remove_dir_all(&dir);
}
