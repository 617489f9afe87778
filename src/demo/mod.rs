//! `feedstore demo`: the seed's experiment, reproduced on this machine in one run.
//!
//! A multimodal SFT data set (derived from embedded real photos and easy-VQA, built once and
//! cached) is served from local files behind S3-like per-request latency. The same trainer loop
//! (each step waits for a batch, then "computes" for the step time) is fed by four loaders in
//! turn, the seed's ladder of fixes ([`ladder`]), and then by feedstore with several ranks, as the
//! main job: an embedded daemon (or a running one), producers feeding a stream, trainer ranks
//! reading it. The run prints samples/s, wait-time ratios, time to first batch, the producer's
//! stage profile with its verdict and the store's memory, and writes a JSON report.

mod data;
mod ladder;
mod nodes;
mod plot;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use feedstore_consumer::stream::{StreamFeeder, StreamOptions};
use feedstore_consumer::{ConnectOptions, Role, Stream, StreamTask};
use feedstore_lab::delayed::Delayed;
use feedstore_producer::chat::ChatTokenizer;
use feedstore_producer::feed::{FeedConfig, feed};
use feedstore_producer::manifest::IndexedManifest;
use feedstore_producer::pipeline::{Fetch, ProducerConfig};
use feedstore_producer::vision::ResizeMode;
use feedstore_proto::sample::{DType, TensorLayout};
use feedstore_proto::stream::{Shuffle, StreamSpec, Tail};
use feedstore_s3::{S3Fetcher, S3Options};
use feedstore_store::config::{format_bytes, parse_bytes};

use crate::SocketArg;
use ladder::{RungResult, Setup};

/// The Qwen3 tokenizer (the text tokenizer of Qwen3-VL), embedded for the demo.
const TOKENIZER_GZ: &[u8] = include_bytes!("../../producer/tests/data/qwen3-tokenizer.json.gz");

/// The seed's wait-time ratio for a serial loader, which the step time is chosen to reproduce.
const SEED_SERIAL_WAIT: f64 = 0.85;

/// Arguments of `feedstore demo`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Use the daemon already listening here instead of starting an embedded one.
    #[command(flatten)]
    socket: SocketArg,
    /// Shared memory of the embedded daemon (with --nodes: of each node's daemon).
    #[arg(long, value_name = "SIZE", default_value = "1GiB", value_parser = parse_bytes)]
    capacity: u64,
    /// Records in the derived data set (built once per setting, then cached).
    #[arg(long, value_name = "N", default_value_t = 256)]
    records: u64,
    /// Serve the images from this S3 endpoint instead of local files (the data set is uploaded
    /// once to --s3-bucket; credentials from the standard AWS chain). The latency range is added
    /// to the endpoint's own.
    #[arg(long, value_name = "URL", env = "AWS_ENDPOINT_URL")]
    s3_endpoint: Option<String>,
    /// The bucket of the S3 mode (created if missing).
    #[arg(long, value_name = "NAME", default_value = "feedstore-demo")]
    s3_bucket: String,
    /// Long side of the derived images, in pixels, drawn from LOW-HIGH (SFT data's range).
    #[arg(long, value_name = "LOW-HIGH", default_value = "256-2048")]
    image_sides: String,
    /// Where the data set is cached [default: $XDG_CACHE_HOME/feedstore/demo or ~/.cache/feedstore/demo].
    #[arg(long, value_name = "DIR")]
    data_dir: Option<PathBuf>,
    /// Per-request latency of the image source, in milliseconds, drawn uniformly from LOW-HIGH
    /// (S3 answers a GET in tens of milliseconds however small the object). 0 for none.
    #[arg(long, value_name = "LOW-HIGH", default_value = "30-80")]
    latency_ms: String,
    /// Samples per training step [default: 16; with --nodes, 4 at the base scale (x4 takes
    /// 4 times as many)].
    #[arg(long, value_name = "N")]
    batch: Option<usize>,
    /// Training steps per loader (the first is the cold start; wait-time ratios are over the
    /// rest) [default: 12].
    #[arg(long, value_name = "N")]
    steps: Option<usize>,
    /// Seconds one training step computes [default: chosen so that the serial loader waits 85%
    /// of the time, the seed's figure, from one timed batch].
    #[arg(long, value_name = "SECONDS")]
    step_time: Option<f64>,
    /// Trainer ranks of the feedstore run (with --nodes: one per node at the base scale, four
    /// at x4).
    #[arg(long, value_name = "N", default_value_t = 2)]
    ranks: u32,
    /// CPU workers per loader (decode, resize, normalise, tokenize) [default: one per core].
    #[arg(long, value_name = "N")]
    workers: Option<usize>,
    /// Image fetches in flight at most.
    #[arg(long, value_name = "N", default_value_t = 32)]
    fetch_concurrency: usize,
    /// Decode every pixel of a JPEG before resizing, in every loader (as `feedstore produce
    /// --full-jpeg-decode`) [default: decode at the largest DCT scale that keeps the image at
    /// least the output size]. To measure what decoding at the size needed gains.
    #[arg(long)]
    full_jpeg_decode: bool,
    /// Samples prepared ahead of each trainer, beyond the batch it is computing on (prefetching
    /// loaders).
    #[arg(long, value_name = "N", default_value_t = 32)]
    prefetch: u32,
    /// Leave out the ladder of loaders; run only feedstore's ranks.
    #[arg(long)]
    no_ladder: bool,
    /// Also run the scaling view: the prefetching loader (copies) against feedstore as ranks,
    /// batch size and latency grow (about a minute more).
    #[arg(long)]
    scaling: bool,
    /// Seeds the data set, the latencies and the stream order.
    #[arg(long, value_name = "N", default_value_t = 0)]
    seed: u64,
    /// Where the JSON report goes.
    #[arg(long, value_name = "FILE", default_value = "feedstore-demo.json")]
    report: PathBuf,
    /// Where the PNG plot goes (the ladder's wait-time ratios and every loader's steps).
    #[arg(long, value_name = "FILE", default_value = "feedstore-demo.png")]
    plot: PathBuf,
    /// The seed's scale act instead: N nodes, 2 to 16 (network namespaces, a daemon each, links
    /// capped like NICs), trainer ranks on every node, producers by placement, at the base
    /// scale and at 4x ranks, batch and streams; prints samples/s, wait-time ratio and each
    /// node's link use per placement and scale. Needs root (namespaces, tc); 4 nodes show the
    /// effect best, and each run takes a few minutes.
    #[arg(long, value_name = "N", help_heading = "Across nodes")]
    nodes: Option<usize>,
    /// Each node's link cap, what it sends and receives together (e.g. 400mbit, 1gbit)
    /// [default: from a calibration run, so that the producers could fill 2.5 links].
    #[arg(long, value_name = "RATE", value_parser = parse_rate, requires = "nodes", help_heading = "Across nodes")]
    link_rate: Option<u64>,
    /// The placements to compare: spread, colocated, relay.
    #[arg(
        long,
        value_name = "LIST",
        value_delimiter = ',',
        default_value = "spread,colocated,relay",
        requires = "nodes",
        help_heading = "Across nodes"
    )]
    placements: Vec<nodes::Placement>,
}

/// A link rate: bits per second, with an optional k/m/g suffix and `bit`/`bps`
/// (`400mbit`, `1gbit`, `250000000`).
fn parse_rate(s: &str) -> Result<u64, String> {
    let t = s.trim().to_ascii_lowercase();
    let t = t
        .strip_suffix("bit")
        .or_else(|| t.strip_suffix("bps"))
        .unwrap_or(&t);
    let (digits, scale) = match t.chars().last() {
        Some('k') => (&t[..t.len() - 1], 1e3),
        Some('m') => (&t[..t.len() - 1], 1e6),
        Some('g') => (&t[..t.len() - 1], 1e9),
        _ => (t, 1.0),
    };
    let value: f64 = digits
        .trim()
        .parse()
        .map_err(|_| format!("{s:?}: want a rate like 400mbit or 1gbit"))?;
    let bits = value * scale;
    if !(bits >= 1e6 && bits.is_finite()) {
        return Err(format!("{s:?}: at least 1mbit"));
    }
    Ok(bits as u64)
}

fn default_data_dir() -> PathBuf {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    base.join("feedstore").join("demo")
}

fn latency(spec: &str) -> anyhow::Result<(Duration, Duration)> {
    let ms = |s: &str| -> anyhow::Result<Duration> {
        let v: f64 = s
            .trim()
            .parse()
            .with_context(|| format!("--latency-ms {spec:?}"))?;
        if !(v >= 0.0 && v.is_finite()) {
            bail!("--latency-ms {spec:?}: milliseconds must be a non-negative number");
        }
        Ok(Duration::from_secs_f64(v / 1e3))
    };
    match spec.split_once('-') {
        Some((low, high)) => {
            let (low, high) = (ms(low)?, ms(high)?);
            if high < low {
                bail!("--latency-ms {spec:?}: LOW is above HIGH");
            }
            Ok((low, high))
        }
        None => ms(spec).map(|d| (d, d)),
    }
}

/// The feedstore run: producers feed a stream, `ranks` trainers read it.
struct FeedstoreRun {
    result: RungResult,
    /// Per rank, the records it was handed, in order.
    delivered: Vec<Vec<u64>>,
    profile: feedstore_producer::profile::StageProfile,
    store: feedstore_proto::StoreStats,
    stream_name: String,
}

fn run_feedstore(
    setup: &Setup,
    socket: &Path,
    ranks: u32,
    depth: u32,
    seed: u64,
    label: &str,
) -> anyhow::Result<FeedstoreRun> {
    let started = Instant::now();
    let records = setup.manifest.len();
    let per_rank = records / u64::from(ranks);
    if per_rank == 0 {
        bail!("{records} records cannot be shared by {ranks} ranks");
    }
    let needed = (setup.steps * setup.batch) as u64;
    let name = format!("demo-{}-{label}", std::process::id());
    let spec = StreamSpec {
        name: name.clone(),
        records,
        seed,
        world: ranks,
        shuffle: Shuffle::Full,
        tail: Tail::Drop,
        epochs: Some(needed.div_ceil(per_rank)),
        reshard: None,
    };
    // The ring holds the batch in use as well as the samples made ahead of it.
    let depth = depth + setup.batch as u32;
    let feed_config = FeedConfig {
        spec: spec.clone(),
        depth,
        at: Vec::new(),
        relay: String::new(),
        ranks: (0..ranks).map(|rank| StreamTask { rank, seq: 0 }).collect(),
        // Every sample is made, as the other loaders make theirs: the decode-once cache would
        // serve repeats for free (measured in BENCHMARKS.md) and is left out of the comparison.
        cache: false,
        batch: 0,
    };
    let producer = {
        let (mut config, tokenizer, manifest) = (
            setup.config.clone(),
            setup.tokenizer.clone(),
            setup.manifest.clone(),
        );
        config.socket = socket.to_owned();
        let source = (setup.source)();
        std::thread::spawn(move || {
            feed(
                &config,
                &feed_config,
                tokenizer,
                source,
                manifest,
                |_, _| {},
            )
        })
    };
    let trainers: Vec<_> = (0..ranks)
        .map(|rank| {
            let (setup, spec, socket) = (setup.clone(), spec.clone(), socket.to_owned());
            std::thread::spawn(move || train_rank(&setup, &socket, &spec, rank, started))
        })
        .collect();
    let (mut result, delivered, failure) = gather(trainers, ranks);
    result.wall = started.elapsed().as_secs_f64();
    let store = ConnectOptions::new(Role::Reader)
        .socket(socket)
        .name("demo")
        .connect()?
        .stats()?;
    // The trainers are done: closing the stream ends the producer.
    close_stream(socket, &spec, depth)?;
    let summary = producer
        .join()
        .expect("the producer panicked")
        .context("the producer failed")?;
    if let Some(e) = failure {
        return Err(e);
    }
    Ok(FeedstoreRun {
        result,
        delivered,
        profile: summary.profile,
        store,
        stream_name: name,
    })
}

/// The trainer ranks' figures as one rung (its wall time left to the caller), the records
/// each was handed, and the first failure.
fn gather(
    trainers: Vec<std::thread::JoinHandle<anyhow::Result<RankRun>>>,
    ranks: u32,
) -> (RungResult, Vec<Vec<u64>>, Option<anyhow::Error>) {
    let mut result = RungResult {
        name: match ranks {
            1 => "3 feedstore: shared memory, by handle".to_string(),
            n => format!("3 feedstore, shared memory, {n} ranks"),
        },
        steps: Vec::new(),
        samples: 0,
        wall: 0.0,
        first_batch: Vec::new(),
    };
    let mut delivered = Vec::new();
    let mut failure = None;
    for t in trainers {
        match t.join().expect("a trainer panicked") {
            Ok((steps, samples, first, records)) => {
                result.steps.push(steps);
                result.samples += samples;
                result.first_batch.push(first);
                delivered.push(records);
            }
            Err(e) => {
                failure.get_or_insert(e);
            }
        }
    }
    (result, delivered, failure)
}

/// What a trainer rank measured (per step: wait and compute; its samples; its first batch)
/// and the records it was handed, in order.
type RankRun = (ladder::Steps, u64, f64, Vec<u64>);

/// One trainer rank of the feedstore run: batches from its stream, each sample read, for the
/// run's steps.
fn train_rank(
    setup: &Setup,
    socket: &Path,
    spec: &StreamSpec,
    rank: u32,
    started: Instant,
) -> anyhow::Result<RankRun> {
    let mut stream = open_rank(socket, spec, rank)?;
    let mut delivered = Vec::new();
    let mut held = Vec::new();
    let (steps, samples, first) =
        ladder::train(setup, started, (spec.world > 1).then_some(rank), || {
            // The step is over: its batch goes back, which makes room in the window.
            held.clear();
            held = stream.next_batch(setup.batch)?;
            for sample in &held {
                sample.view().context("a sample the trainer cannot read")?;
                delivered.push(sample.record());
            }
            Ok(held.len())
        })?;
    Ok((steps, samples, first, delivered))
}

/// Opens `rank` of `spec` on the daemon at `socket` as a demo trainer does: waiting up to 2
/// minutes for the producers to create the stream.
fn open_rank(socket: &Path, spec: &StreamSpec, rank: u32) -> anyhow::Result<Stream> {
    let options = StreamOptions {
        wait: Duration::from_secs(120),
        ..StreamOptions::default()
    };
    Stream::open(socket, spec, rank, None, options)
        .with_context(|| format!("rank {rank} of {} opening its stream", spec.name))
}

/// Closes `spec` on the daemon at `socket` as a writer of its owner, which ends the producers
/// feeding it there.
fn close_stream(socket: &Path, spec: &StreamSpec, depth: u32) -> anyhow::Result<()> {
    let client = ConnectOptions::new(Role::Writer)
        .socket(socket)
        .name("demo")
        .connect()?;
    StreamFeeder::join(&client, spec, depth, &[])?.close()?;
    Ok(())
}

fn print_rung(r: &RungResult) {
    println!(
        "  {:<46} wait {:>5.1}%   {:>6.1} samples/s   first batch {:>6.2} s",
        r.name,
        100.0 * r.wait_ratio(),
        r.samples_per_sec(),
        r.first_batch.iter().copied().fold(0.0, f64::max)
    );
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let across = args.nodes.is_some();
    let batch = args.batch.unwrap_or(if across { 4 } else { 16 });
    let steps = args.steps.unwrap_or(12);
    if batch == 0 || steps == 0 || args.ranks == 0 || args.records == 0 {
        bail!("--batch, --steps, --ranks and --records must be at least 1");
    }
    if across {
        nodes::require_root()?;
    }
    let (low, high) = latency(&args.latency_ms)?;
    let (data, s3, sides) = demo_data(&args)?;
    let manifest = Arc::new(
        IndexedManifest::open(&data.manifest)
            .with_context(|| format!("indexing {}", data.manifest.display()))?,
    );
    let (socket, _daemon) = match &args.socket.socket {
        Some(path) => (path.clone(), None),
        // Each node has its own daemon.
        None if across => (PathBuf::new(), None),
        None => {
            let (socket, daemon) = crate::EmbeddedDaemon::start("demo", args.capacity)?;
            (socket, Some(daemon))
        }
    };
    let config = demo_config(&args, socket.clone());
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    print_header(&args, &data, (low, high), (batch, steps), &config, cores);
    let mut setup = Setup {
        config,
        tokenizer: demo_tokenizer()?,
        manifest,
        batch,
        steps,
        step_time: Duration::ZERO,
        source: sources(s3.clone(), args.seed)(low, high),
    };
    if let Some(n) = args.nodes {
        let nodes_args = nodes::NodesArgs {
            nodes: n,
            link_rate: args.link_rate,
            step_time: args.step_time,
            placements: args.placements.clone(),
            capacity: args.capacity,
            prefetch: args.prefetch,
            seed: args.seed,
            report: args.report.clone(),
            plot: args.plot.clone(),
        };
        return nodes::run(&nodes_args, setup);
    }
    setup.step_time = step_time(&args, &setup)?;
    println!("step time {:.3} s", setup.step_time.as_secs_f64());

    let ladder = if args.no_ladder {
        Vec::new()
    } else {
        run_ladder(&args, &setup, &socket)?
    };
    eprintln!("running feedstore with {} ranks ...", args.ranks);
    let main = run_feedstore(
        &setup,
        &socket,
        args.ranks,
        args.prefetch,
        args.seed,
        "main",
    )?;
    print_main(&main, args.ranks);
    let scaling = if args.scaling {
        run_scaling(&args, &setup, &socket, s3, (low, high))?
    } else {
        Scaling::default()
    };
    let outcome = Outcome {
        cores,
        latency: (low, high),
        sides,
        data,
        ladder,
        main,
        scaling,
    };
    outcome.write(&args, &setup)
}

/// The run's opening line: the data, where its images are and behind what latency, the
/// batch, the steps and the CPU workers.
fn print_header(
    args: &Args,
    data: &data::DataSet,
    (low, high): (Duration, Duration),
    (batch, steps): (usize, usize),
    config: &ProducerConfig,
    cores: usize,
) {
    println!(
        "feedstore demo: {} records ({}, {:.0} MB of images{}), images {} behind {}-{} ms per \
         request, batch {}, {} steps per loader, {} CPU workers on {} cores",
        data.records,
        data.manifest.display(),
        data.image_bytes as f64 / 1e6,
        if data.built {
            ", just built"
        } else {
            ", cached"
        },
        args.s3_endpoint
            .as_ref()
            .map_or("on local disk".to_owned(), |e| format!("in S3 at {e}")),
        low.as_millis(),
        high.as_millis(),
        batch,
        steps,
        config.workers,
        cores
    );
}

/// The demo's data set, built (or found cached) on local disk, and uploaded to S3 when
/// `--s3-endpoint` says; the image sides it was built with.
fn demo_data(args: &Args) -> anyhow::Result<(data::DataSet, Option<S3Options>, (u32, u32))> {
    let data_dir = args.data_dir.clone().unwrap_or_else(default_data_dir);
    let sides = args
        .image_sides
        .split_once('-')
        .and_then(|(l, h)| Some((l.trim().parse().ok()?, h.trim().parse().ok()?)))
        .with_context(|| format!("--image-sides {:?}: expected LOW-HIGH", args.image_sides))?;
    let data = data::build(&data_dir, args.records, args.seed, sides)?;
    let Some(endpoint) = &args.s3_endpoint else {
        return Ok((data, None, sides));
    };
    let options = S3Options {
        endpoint: Some(endpoint.clone()),
        force_path_style: true,
        ..S3Options::default()
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let fetcher = rt.block_on(S3Fetcher::new(&options));
    let data = data::to_s3(&data, fetcher.client(), &rt, &args.s3_bucket)?;
    Ok((data, Some(options), sides))
}

/// The Qwen3 tokenizer the binary carries.
fn demo_tokenizer() -> anyhow::Result<Arc<ChatTokenizer>> {
    use std::io::Read;
    let mut json = Vec::new();
    flate2::read::GzDecoder::new(TOKENIZER_GZ).read_to_end(&mut json)?;
    Ok(Arc::new(ChatTokenizer::from_bytes(&json, 8192)?))
}

/// The producers' settings: Qwen-VL's resize with at most 640 x 640 pixels' worth of area,
/// bf16, channels first.
fn demo_config(args: &Args, socket: PathBuf) -> ProducerConfig {
    let mut config = ProducerConfig::new(socket);
    config.fetch_concurrency = args.fetch_concurrency.max(1);
    if let Some(w) = args.workers {
        config.workers = w.max(1);
    }
    config.transform.resize = ResizeMode::QwenVl {
        min_pixels: 3136,
        max_pixels: 640 * 640,
        factor: config.patch_size * config.merge_size,
    };
    config.transform.dtype = DType::BF16;
    config.transform.layout = TensorLayout::Chw;
    config.transform.jpeg_draft = !args.full_jpeg_decode;
    config
}

/// `--step-time`, else the step that makes the serial loader wait as in the seed (~85%),
/// from one serial batch timed here.
fn step_time(args: &Args, setup: &Setup) -> anyhow::Result<Duration> {
    match args.step_time {
        Some(s) if s >= 0.0 && s.is_finite() => Ok(Duration::from_secs_f64(s)),
        Some(_) => bail!("--step-time must be a non-negative number of seconds"),
        None => {
            eprintln!("timing one serial batch to choose the step time ...");
            let probe = Setup {
                steps: 1,
                ..setup.clone()
            };
            let r = ladder::serial(&probe)?;
            let prep = r.steps[0][0].0;
            let t = prep * (1.0 - SEED_SERIAL_WAIT) / SEED_SERIAL_WAIT;
            eprintln!(
                "  a serial batch took {prep:.2} s: a step of {t:.2} s makes the serial loader \
                 wait ~85%"
            );
            Ok(Duration::from_secs_f64(t))
        }
    }
}

/// The ladder: one trainer each on the serial, concurrent and prefetching loaders, then
/// feedstore with one rank.
fn run_ladder(args: &Args, setup: &Setup, socket: &Path) -> anyhow::Result<Vec<RungResult>> {
    println!("the ladder (one trainer each; same data, latency, step time and CPUs):");
    type Rung = fn(&Setup, u32) -> anyhow::Result<RungResult>;
    let rungs: [(&str, Rung); 3] = [
        ("serial", |s, _| ladder::serial(s)),
        ("concurrent", |s, _| ladder::concurrent(s)),
        ("prefetch", |s, p| {
            ladder::prefetch(s, (p as usize).div_ceil(s.batch).max(1), 1)
        }),
    ];
    let mut results = Vec::new();
    for (what, rung) in rungs {
        eprintln!("running the {what} loader ...");
        let r = rung(setup, args.prefetch)?;
        print_rung(&r);
        results.push(r);
    }
    eprintln!("running feedstore with one rank ...");
    let one = run_feedstore(setup, socket, 1, args.prefetch, args.seed, "ladder")?;
    print_rung(&one.result);
    results.push(one.result);
    Ok(results)
}

/// The main run's figures: per rank, the store, the producers' profile.
fn print_main(main: &FeedstoreRun, ranks: u32) {
    println!(
        "feedstore, {ranks} ranks: {:.1} samples/s together",
        main.result.samples_per_sec()
    );
    for rank in 0..ranks as usize {
        println!(
            "  rank {rank}: wait {:>5.1}%, first batch after {:.2} s",
            100.0 * main.result.wait_ratio_of(rank),
            main.result.first_batch[rank]
        );
    }
    println!(
        "store: {} used of {} ({} objects, {} leases)",
        format_bytes(main.store.used_bytes),
        format_bytes(main.store.capacity_bytes),
        main.store.objects_sealed,
        main.store.leases
    );
    print!("producer stage profile:\n{}", main.profile.table());
    println!("verdict: {}", main.profile.verdict());
}

/// `--scaling`'s cells, for the report and the plot.
#[derive(Default)]
struct Scaling {
    json: Vec<serde_json::Value>,
    cells: Vec<plot::ScalingCell>,
}

/// `--scaling`: the prefetching loader with copies against feedstore, the same CPUs split
/// among ranks, over ranks, batch sizes and latencies around the main run's.
fn run_scaling(
    args: &Args,
    setup: &Setup,
    socket: &Path,
    s3: Option<S3Options>,
    (low, high): (Duration, Duration),
) -> anyhow::Result<Scaling> {
    println!(
        "scaling (the prefetching loader with copies vs feedstore; the same CPUs split among \
         ranks):"
    );
    let batch = setup.batch;
    let base = (args.ranks.max(2), batch, (low, high));
    let mut cells = vec![(1, batch, (low, high)), base, (4, batch, (low, high))];
    cells.extend([
        (base.0, batch / 2, (low, high)),
        (base.0, batch * 2, (low, high)),
    ]);
    cells.push((base.0, batch, (low * 3, high * 3)));
    cells.retain(|c| c.1 > 0);
    cells.dedup();
    let mut scaling = Scaling::default();
    for (ranks, batch, (lo, hi)) in cells {
        let cell = Setup {
            batch,
            step_time: setup.step_time.mul_f64(batch as f64 / setup.batch as f64),
            source: sources(s3.clone(), args.seed)(lo, hi),
            ..setup.clone()
        };
        let prefetch_batches = (args.prefetch as usize).div_ceil(batch).max(1);
        let latency_ms = [lo.as_secs_f64() * 1e3, hi.as_secs_f64() * 1e3];
        let (lo, hi) = (lo.as_millis(), hi.as_millis());
        eprintln!("scaling: {ranks} ranks, batch {batch}, {lo}-{hi} ms ...");
        let copies = ladder::prefetch(&cell, prefetch_batches, ranks as usize)?;
        let shm = run_feedstore(&cell, socket, ranks, args.prefetch, args.seed, "scaling")?.result;
        println!(
            "  {ranks} ranks, batch {batch:>2}, {lo:>3}-{hi:<3} ms: copies wait {:>5.1}% {:>6.1} \
             samples/s | feedstore wait {:>5.1}% {:>6.1} samples/s",
            100.0 * copies.wait_ratio(),
            copies.samples_per_sec(),
            100.0 * shm.wait_ratio(),
            shm.samples_per_sec()
        );
        scaling.cells.push(plot::ScalingCell {
            label: format!("{ranks} ranks, batch {batch}, {lo}-{hi} ms"),
            copies: copies.wait_ratio(),
            feedstore: shm.wait_ratio(),
        });
        scaling.json.push(serde_json::json!({
            "ranks": ranks,
            "batch": batch,
            "latency_ms": latency_ms,
            "step_time_s": cell.step_time.as_secs_f64(),
            "copies": rung_json(&copies),
            "feedstore": rung_json(&shm),
        }));
    }
    Ok(scaling)
}

/// What a run measured, for `--report` (JSON) and `--plot` (PNG).
struct Outcome {
    cores: usize,
    latency: (Duration, Duration),
    sides: (u32, u32),
    data: data::DataSet,
    ladder: Vec<RungResult>,
    main: FeedstoreRun,
    scaling: Scaling,
}

impl Outcome {
    fn write(&self, args: &Args, setup: &Setup) -> anyhow::Result<()> {
        let (low, high) = self.latency;
        let main = &self.main;
        let report = serde_json::json!({
            "machine": { "cores": self.cores },
            "settings": {
                "records": self.data.records,
                "latency_ms": [low.as_secs_f64() * 1e3, high.as_secs_f64() * 1e3],
                "batch": setup.batch,
                "steps": setup.steps,
                "step_time_s": setup.step_time.as_secs_f64(),
                "workers": setup.config.workers,
                "fetch_concurrency": setup.config.fetch_concurrency,
                "prefetch": args.prefetch,
                "seed": args.seed,
                "s3_endpoint": args.s3_endpoint,
            },
            "data": {
                "manifest": self.data.manifest,
                "image_bytes": self.data.image_bytes,
                "derived_from": format!(
                    "10 real photos and easy-VQA (data/demo), re-cropped, re-scaled to {}-{} px, \
                     re-encoded",
                    self.sides.0, self.sides.1
                ),
            },
            "ladder": self.ladder.iter().map(rung_json).collect::<Vec<_>>(),
            "scaling": self.scaling.json,
            "feedstore": {
                "stream": main.stream_name,
                "ranks": args.ranks,
                "run": rung_json(&main.result),
                "wait_ratio_per_rank": (0..args.ranks as usize)
                    .map(|r| main.result.wait_ratio_of(r))
                    .collect::<Vec<_>>(),
                "delivered_records": main.delivered,
                "profile": {
                    "table": main.profile.table(),
                    "verdict": main.profile.verdict(),
                    "cpu_idle_share": main.profile.cpu_idle_share(),
                },
                "store": {
                    "capacity_bytes": main.store.capacity_bytes,
                    "used_bytes": main.store.used_bytes,
                    "objects": main.store.objects_sealed,
                },
            },
        });
        std::fs::write(&args.report, serde_json::to_string_pretty(&report)? + "\n")
            .with_context(|| format!("writing {}", args.report.display()))?;
        let pictured: Vec<&RungResult> = self
            .ladder
            .iter()
            .chain(std::iter::once(&main.result))
            .collect();
        plot::write(
            &args.plot,
            &format!(
                "feedstore demo: batch {}, step {:.0} ms, images behind {}-{} ms, {} cores",
                setup.batch,
                setup.step_time.as_secs_f64() * 1e3,
                low.as_millis(),
                high.as_millis(),
                self.cores
            ),
            &pictured,
            &self.scaling.cells,
        )?;
        println!(
            "report: {}, plot: {}",
            args.report.display(),
            args.plot.display()
        );
        Ok(())
    }
}

/// A fresh image source per loader, all with the same latencies: local files, or S3 (one
/// client per loader, since a client's connections belong to the runtime that opened them).
type Source = Arc<dyn Fn() -> Arc<dyn Fetch> + Send + Sync>;

fn sources(s3: Option<S3Options>, seed: u64) -> impl Fn(Duration, Duration) -> Source {
    move |low, high| match s3.clone() {
        None => Arc::new(move || Arc::new(Delayed::new(low, high, seed)) as Arc<dyn Fetch>),
        Some(options) => Arc::new(move || {
            let fetcher = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a runtime to build the S3 client")
                .block_on(S3Fetcher::new(&options));
            Arc::new(Delayed::wrap(Arc::new(fetcher), low, high, seed)) as Arc<dyn Fetch>
        }),
    }
}

fn rung_json(r: &RungResult) -> serde_json::Value {
    serde_json::json!({
        "name": r.name,
        "wait_ratio": r.wait_ratio(),
        "samples_per_sec": r.samples_per_sec(),
        "samples": r.samples,
        "wall_s": r.wall,
        "first_batch_s": r.first_batch,
        "steps": r.steps,
    })
}
