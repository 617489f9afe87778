//! Fetching from S3 with latency: does concurrency hide it, and does the profiler name the
//! bottleneck?
//!
//! A real `moto_server` on loopback serves the 9 derived benchmark JPEGs (long side 512-2048 px)
//! under many keys, behind the test harness's proxy adding a fixed latency to every request, as
//! a far-away S3 would. Three parts, one run:
//!
//! 1. the unloaded cost of one GET straight to moto (what the latency adds to);
//! 2. `S3Fetcher` throughput at several concurrencies behind the proxy, against the ideal
//!    `concurrency / (latency + unloaded cost)`: the share of the ideal reached is the share of
//!    the latency hidden;
//! 3. the whole producer (`feedstore produce`'s pipeline, 2 CPU workers, a real store) behind the
//!    proxy at one fetch in flight and at 64, with the profiler's verdict for each;
//! 4. two epochs fed through a stream to a consumer, with the decode-once cache and without:
//!    epoch 2 samples/s.
//!
//! Run: `cargo bench --bench fetch` (needs `pip install 'moto[server]'`); `-- --quick` for a
//! shorter run, `-- --latency-ms N` to change the added latency (default 50).

use std::sync::Arc;
use std::time::{Duration, Instant};

use feedstore_consumer::{Stream, StreamOptions, StreamTask};
use feedstore_producer::chat::ChatTokenizer;
use feedstore_producer::feed::{FeedConfig, feed};
use feedstore_producer::manifest::{ImageSource, IndexedManifest, Manifest};
use feedstore_producer::pipeline::{Fetch, ProducerConfig, run};
use feedstore_proto::stream::{Shuffle, StreamSpec, Tail};
use feedstore_s3::S3Fetcher;
use feedstore_testkit::moto::Moto;
use feedstore_testkit::proxy::{FaultProxy, Plan};

mod common;

const BUCKET: &str = "bench-images";
use common::s3_options as options;

fn source(key: &str) -> ImageSource {
    ImageSource::S3 {
        bucket: BUCKET.into(),
        key: key.into(),
    }
}

/// Fetches every key once with at most `concurrency` in flight; returns (wall, bytes).
async fn fetch_all(
    fetcher: &Arc<S3Fetcher>,
    keys: &[String],
    concurrency: usize,
) -> (Duration, u64) {
    let permits = Arc::new(tokio::sync::Semaphore::new(concurrency));
    let mut tasks = tokio::task::JoinSet::new();
    let started = Instant::now();
    for key in keys {
        let permit = permits.clone().acquire_owned().await.unwrap();
        let (fetcher, key) = (fetcher.clone(), key.clone());
        tasks.spawn(async move {
            let bytes = fetcher.fetch(&source(&key)).await.unwrap();
            drop(permit);
            bytes.len() as u64
        });
    }
    let mut total = 0;
    while let Some(n) = tasks.join_next().await {
        total += n.unwrap();
    }
    (started.elapsed(), total)
}

fn main() {
    let (quick, latency) = common::s3_bench_flags();
    let copies = if quick { 4 } else { 16 };
    let dir = std::env::temp_dir().join(format!("feedstore-bench-fetch-{}", std::process::id()));
    let images = common::derive_images(&dir.join("images"));
    let moto = Moto::start().expect("moto_server (pip install 'moto[server]')");
    let proxy = FaultProxy::start(
        moto.addr(),
        Plan {
            latency,
            rules: Vec::new(),
        },
    )
    .unwrap();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();

    // Upload: each image under `copies` keys, so no fetch is served from a client cache.
    let mut keys = Vec::new();
    runtime.block_on(async {
        let direct = S3Fetcher::new(&options(moto.endpoint())).await;
        direct
            .client()
            .create_bucket()
            .bucket(BUCKET)
            .send()
            .await
            .unwrap();
        for (i, path) in images.iter().enumerate() {
            let body = std::fs::read(path).unwrap();
            for c in 0..copies {
                let key = format!("img/{c}/{i}.jpg");
                direct
                    .client()
                    .put_object()
                    .bucket(BUCKET)
                    .key(&key)
                    .body(body.clone().into())
                    .send()
                    .await
                    .unwrap();
                keys.push(key);
            }
        }
    });
    let mean_bytes: u64 = images
        .iter()
        .map(|p| std::fs::metadata(p).unwrap().len())
        .sum::<u64>()
        / images.len() as u64;
    println!(
        "## S3 fetch behind a {} ms proxy ({} objects, mean {:.0} KB, moto_server on loopback)",
        latency.as_millis(),
        keys.len(),
        mean_bytes as f64 / 1e3
    );
    println!();

    // 1. Straight to moto: the unloaded cost of one GET, and the most moto serves at once.
    let (unloaded, ceiling) = runtime.block_on(async {
        let direct = Arc::new(S3Fetcher::new(&options(moto.endpoint())).await);
        fetch_all(&direct, &keys[..keys.len().min(36)], 1).await; // warm the connection pool
        let (one, _) = fetch_all(&direct, &keys, 1).await;
        let mut ceiling: f64 = 0.0;
        for concurrency in [16, 64] {
            let (many, _) = fetch_all(&direct, &keys, concurrency).await;
            ceiling = ceiling.max(keys.len() as f64 / many.as_secs_f64());
        }
        (one / keys.len() as u32, ceiling)
    });
    println!(
        "straight to moto: {:.2} ms per GET one at a time; at most {ceiling:.0} objects/s with 16 or 64 in flight (moto's own limit on this machine)",
        unloaded.as_secs_f64() * 1e3
    );
    println!();

    // 2. Throughput against concurrency behind the proxy. The ideal is what latency allows,
    // `concurrency / (latency + unloaded GET)`, capped at moto's own limit.
    println!(
        "| fetches in flight | objects/s | MB/s | vs 1 in flight | ideal objects/s | share of ideal |"
    );
    println!("|---|---|---|---|---|---|");
    let fetcher =
        runtime.block_on(async { Arc::new(S3Fetcher::new(&options(proxy.endpoint())).await) });
    let mut first = None;
    for concurrency in [1usize, 4, 16, 64] {
        let (wall, bytes) = runtime.block_on(fetch_all(&fetcher, &keys, concurrency));
        let rate = keys.len() as f64 / wall.as_secs_f64();
        let base = *first.get_or_insert(rate);
        let ideal = (concurrency as f64 / (latency + unloaded).as_secs_f64()).min(ceiling);
        println!(
            "| {concurrency} | {rate:.1} | {:.1} | {:.1}x | {ideal:.1} | {:.0}% |",
            bytes as f64 / 1e6 / wall.as_secs_f64(),
            rate / base,
            100.0 * rate / ideal
        );
    }
    println!();

    // 3. The producer behind the proxy: the profiler's verdict at 1 and 64 fetches in flight.
    let tokenizer = Arc::new(ChatTokenizer::from_bytes(&common::tokenizer_json(), 8192).unwrap());
    let manifest = dir.join("bench.jsonl");
    let lines: Vec<String> = keys
        .iter()
        .map(|key| {
            serde_json::json!({"id": key, "image": format!("s3://{BUCKET}/{key}"), "conversations": [
                {"from": "human", "value": "<image>\nWhat is in the picture?"},
                {"from": "gpt", "value": "A photograph."}]})
            .to_string()
        })
        .collect();
    std::fs::write(&manifest, lines.join("\n")).unwrap();
    let socket = dir.join("feedstored.sock");
    let daemon = common::embedded_daemon(&socket, 2 << 30);
    println!("| producer (2 CPU workers) | samples/s | CPU workers idle | verdict |");
    println!("|---|---|---|---|");
    for concurrency in [1usize, 64] {
        let mut config = ProducerConfig::new(socket.clone());
        config.workers = 2;
        config.fetch_concurrency = concurrency;
        let summary = run(
            &config,
            tokenizer.clone(),
            fetcher.clone(),
            Manifest::open(&manifest).unwrap(),
            |_, _| {},
        )
        .unwrap();
        assert_eq!(summary.rejected, 0);
        println!(
            "| --fetch-concurrency {concurrency} | {:.1} | {:.0}% | {} |",
            summary.produced as f64 / summary.profile.wall.as_secs_f64(),
            summary.profile.cpu_idle_share() * 100.0,
            summary.profile.verdict()
        );
        eprint!("{}", summary.profile.table());
    }

    // 4. Two epochs through a stream, with the decode-once cache and without.
    println!();
    println!(
        "| stream, 2 epochs of {} records (1 rank, depth 32) | epoch 1 samples/s | epoch 2 samples/s | epoch 2 / epoch 1 |",
        keys.len()
    );
    println!("|---|---|---|---|");
    let indexed = Arc::new(IndexedManifest::open(&manifest).unwrap());
    // The cache first: with it off, the second run would still find the first run's samples.
    for cache in [true, false] {
        let spec = StreamSpec {
            name: format!("bench-epochs-cache-{cache}"),
            records: indexed.len(),
            seed: 3,
            world: 1,
            shuffle: Shuffle::Full,
            tail: Tail::Drop,
            epochs: Some(2),
            reshard: None,
        };
        let per_epoch = spec.per_rank();
        let consumer = {
            let (socket, spec) = (socket.clone(), spec.clone());
            std::thread::spawn(move || {
                let mut stream =
                    Stream::open(&socket, &spec, 0, None, StreamOptions::default()).unwrap();
                // Timed from the first sample, so the cold start is not in epoch 1's rate.
                let (mut first, mut boundary) = (None, Duration::ZERO);
                for sample in &mut stream {
                    let sample = sample.unwrap();
                    std::hint::black_box(sample.view().unwrap().tokens().len());
                    let started = *first.get_or_insert_with(Instant::now);
                    if sample.seq() + 1 == per_epoch {
                        boundary = started.elapsed();
                    }
                }
                let total = first.expect("samples").elapsed();
                (boundary, total - boundary)
            })
        };
        let mut config = ProducerConfig::new(socket.clone());
        config.workers = 2;
        config.fetch_concurrency = 64;
        let feed_config = FeedConfig {
            spec: spec.clone(),
            depth: 32,
            at: Vec::new(),
            relay: String::new(),
            ranks: vec![StreamTask { rank: 0, seq: 0 }],
            cache,
            batch: 0,
        };
        let summary = feed(
            &config,
            &feed_config,
            tokenizer.clone(),
            fetcher.clone(),
            indexed.clone(),
            |_, _| {},
        )
        .unwrap();
        assert_eq!(summary.rejected, 0);
        let (first, second) = consumer.join().unwrap();
        let (first, second) = (
            (per_epoch - 1) as f64 / first.as_secs_f64(),
            per_epoch as f64 / second.as_secs_f64(),
        );
        println!(
            "| decode-once cache {} | {first:.1} | {second:.1} | {:.1}x |",
            if cache { "on" } else { "off (--no-cache)" },
            second / first
        );
    }
    daemon.stop();
    let _ = std::fs::remove_dir_all(&dir);
}
