//! `feedstore produce`: a manifest in, samples sealed in the store out.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use feedstore_producer::chat::ChatTokenizer;
use feedstore_producer::manifest::Manifest;
use feedstore_producer::pipeline::{Event, ProducerConfig, run};
use feedstore_producer::s3::{S3Fetcher, S3Options};
use feedstore_producer::vision::ResizeMode;
use feedstore_proto::sample::{DType, TensorLayout};

use crate::SocketArg;

/// Arguments of `feedstore produce`.
#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(flatten)]
    socket: SocketArg,
    /// JSONL manifest in LLaVA / Qwen-VL form: {"id", "image" | "images", "conversations"} or
    /// {"id", "text"}. Relative image paths resolve against the manifest's folder.
    #[arg(long, value_name = "FILE")]
    manifest: PathBuf,
    /// The tokenizer's tokenizer.json (Qwen-VL family: it must have <|image_pad|> and friends).
    #[arg(long, value_name = "FILE")]
    tokenizer: PathBuf,
    /// Where rejected records go, one JSON object per line with line, id, stage and reason
    /// [default: <manifest>.rejects.jsonl].
    #[arg(long, value_name = "FILE")]
    rejects: Option<PathBuf>,
    /// Also write each produced sample's handle here, one JSON object per line with line, id,
    /// handle (node:epoch:slot:generation in hex) and bytes, for readers to fetch it by.
    #[arg(long, value_name = "FILE")]
    handles: Option<PathBuf>,
    /// Output image size: `qwen` (Qwen-VL smart resize between --min-pixels and --max-pixels,
    /// sides multiples of patch × merge), `WxH` (fixed, e.g. 448x448), or `short:N` (shorter
    /// side N, aspect kept).
    #[arg(long, value_name = "SIZE", default_value = "qwen")]
    image_size: String,
    /// Smallest image area for `--image-size qwen`, in pixels.
    #[arg(long, value_name = "PIXELS", default_value_t = 56 * 56)]
    min_pixels: u64,
    /// Largest image area for `--image-size qwen`, in pixels.
    #[arg(long, value_name = "PIXELS", default_value_t = 14 * 14 * 4 * 1280)]
    max_pixels: u64,
    /// Vision patch size in pixels (14 for Qwen2/2.5-VL, 16 for Qwen3-VL).
    #[arg(long, value_name = "PIXELS", default_value_t = 14)]
    patch_size: u32,
    /// Patches merged into one image token along each side.
    #[arg(long, value_name = "N", default_value_t = 2)]
    merge_size: u32,
    /// Tensor element type: f32, bf16, f16 or u8 (u8 skips normalisation).
    #[arg(long, value_name = "TYPE", default_value = "f32")]
    dtype: String,
    /// Tensor layout: chw or hwc.
    #[arg(long, value_name = "LAYOUT", default_value = "chw")]
    layout: String,
    /// Refuse images with more pixels than this before decoding (decompression-bomb guard).
    #[arg(long, value_name = "PIXELS", default_value_t = 64 << 20)]
    max_source_pixels: u64,
    /// Reject conversations longer than this many tokens (image tokens included).
    #[arg(long, value_name = "N", default_value_t = 8192)]
    max_tokens: usize,
    /// Image fetches in flight at most: raise it when the verdict says fetch-bound.
    #[arg(long, value_name = "N", default_value_t = 32)]
    fetch_concurrency: usize,
    /// CPU workers (decode, resize, tokenize, write) [default: one per core].
    #[arg(long, value_name = "N")]
    workers: Option<usize>,
    /// Exit non-zero when more than this share of records is rejected (0.05 = 5%).
    #[arg(long, value_name = "SHARE", default_value_t = 0.05)]
    max_reject_rate: f64,
    /// S3 endpoint for s3:// images, e.g. http://127.0.0.1:9000 for a self-hosted store
    /// [default: $AWS_ENDPOINT_URL, else AWS]. Credentials come from the standard AWS chain.
    #[arg(long, value_name = "URL")]
    s3_endpoint: Option<String>,
    /// S3 region [default: $AWS_REGION, else us-east-1].
    #[arg(long, value_name = "REGION")]
    s3_region: Option<String>,
    /// Address buckets by path (endpoint/bucket/key), as most self-hosted stores need.
    #[arg(long)]
    s3_path_style: bool,
    /// Attempts per S3 object before the record is rejected; retries back off exponentially with
    /// jitter on throttling, 5xx, timeouts and resets.
    #[arg(long, value_name = "N", default_value_t = 5)]
    s3_max_attempts: u32,
    /// Seconds one S3 attempt may take, the whole body included, before it is retried.
    #[arg(long, value_name = "SECONDS", default_value_t = 30.0)]
    s3_attempt_timeout: f64,
}

fn image_size(args: &Args) -> anyhow::Result<ResizeMode> {
    let s = args.image_size.trim().to_ascii_lowercase();
    if s == "qwen" {
        return Ok(ResizeMode::QwenVl {
            min_pixels: args.min_pixels,
            max_pixels: args.max_pixels,
            factor: args.patch_size * args.merge_size,
        });
    }
    if let Some(n) = s.strip_prefix("short:") {
        return Ok(ResizeMode::ShorterSide(
            n.parse().context("--image-size short:N needs a number")?,
        ));
    }
    if let Some((w, h)) = s.split_once('x') {
        let (width, height) = (w.parse()?, h.parse()?);
        return Ok(ResizeMode::Fixed { width, height });
    }
    bail!(
        "--image-size {:?}: expected qwen, WxH or short:N",
        args.image_size
    )
}

pub fn run_produce(args: Args) -> anyhow::Result<()> {
    let socket = args.socket.path();
    let mut config = ProducerConfig::new(socket);
    config.fetch_concurrency = args.fetch_concurrency.max(1);
    if let Some(w) = args.workers {
        config.workers = w.max(1);
    }
    config.patch_size = args.patch_size;
    config.merge_size = args.merge_size;
    config.transform.resize = image_size(&args)?;
    config.transform.max_source_pixels = args.max_source_pixels;
    config.transform.dtype = match args.dtype.to_ascii_lowercase().as_str() {
        "f32" => DType::F32,
        "bf16" => DType::BF16,
        "f16" => DType::F16,
        "u8" => DType::U8,
        other => bail!("--dtype {other:?}: expected f32, bf16, f16 or u8"),
    };
    config.transform.layout = match args.layout.to_ascii_lowercase().as_str() {
        "chw" => TensorLayout::Chw,
        "hwc" => TensorLayout::Hwc,
        other => bail!("--layout {other:?}: expected chw or hwc"),
    };
    let tokenizer = Arc::new(
        ChatTokenizer::from_file(&args.tokenizer, args.max_tokens)
            .with_context(|| format!("loading {}", args.tokenizer.display()))?,
    );
    let manifest = Manifest::open(&args.manifest)
        .with_context(|| format!("opening {}", args.manifest.display()))?;
    let rejects_path = args.rejects.clone().unwrap_or_else(|| {
        let mut p = args.manifest.clone().into_os_string();
        p.push(".rejects.jsonl");
        p.into()
    });
    let create = |path: &std::path::Path| {
        std::fs::File::create(path)
            .map(std::io::BufWriter::new)
            .with_context(|| format!("creating {}", path.display()))
    };
    let mut rejects = create(&rejects_path)?;
    let mut handles = args.handles.as_deref().map(create).transpose()?;
    if !(args.s3_attempt_timeout > 0.0 && args.s3_attempt_timeout.is_finite()) {
        bail!("--s3-attempt-timeout must be a positive number of seconds");
    }
    eprintln!(
        "producing from {} into the store at {} with {} workers and {} fetches in flight",
        args.manifest.display(),
        config.socket.display(),
        config.workers,
        config.fetch_concurrency
    );
    let s3_options = S3Options {
        endpoint: args.s3_endpoint.clone(),
        region: args.s3_region.clone(),
        force_path_style: args.s3_path_style,
        max_attempts: args.s3_max_attempts,
        attempt_timeout: Duration::from_secs_f64(args.s3_attempt_timeout),
        ..S3Options::default()
    };
    let fetcher = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting a runtime for the S3 client")?
        .block_on(S3Fetcher::new(&s3_options));
    let started = Instant::now();
    let mut last = Instant::now();
    let (mut produced, mut rejected, mut bytes) = (0u64, 0u64, 0u64);
    let mut write_error = None;
    let summary = run(
        &config,
        tokenizer,
        Arc::new(fetcher),
        manifest,
        |event, profiler| {
            match event {
                Event::Produced(p) => {
                    produced += 1;
                    bytes += p.bytes;
                    if let Some(out) = handles.as_mut() {
                        let row = serde_json::json!({
                            "line": p.line, "id": p.id, "handle": p.handle.to_string(), "bytes": p.bytes,
                        });
                        if let Err(e) = writeln!(out, "{row}") {
                            write_error.get_or_insert(e);
                        }
                    }
                }
                Event::Rejected(r) => {
                    rejected += 1;
                    let line = serde_json::to_string(r).expect("rejects serialise");
                    if let Err(e) = writeln!(rejects, "{line}") {
                        write_error.get_or_insert(e);
                    }
                }
            }
            if last.elapsed() >= Duration::from_millis(500) {
                last = Instant::now();
                let wall = started.elapsed();
                let profile = profiler.snapshot(wall, config.workers, config.fetch_concurrency);
                eprintln!(
                    "  {produced} produced, {rejected} rejected, {:.1} samples/s, {:.0} MB/s into the store, {} fetches in flight; {}",
                    produced as f64 / wall.as_secs_f64(),
                    bytes as f64 / 1e6 / wall.as_secs_f64(),
                    profile.fetch_in_flight,
                    profile.verdict()
                );
            }
        },
    )?;
    rejects.flush().context("writing the rejects file")?;
    if let Some(out) = handles.as_mut() {
        out.flush().context("writing the handles file")?;
    }
    if let Some(e) = write_error {
        return Err(e).context("writing the rejects or handles file");
    }
    let wall = summary.profile.wall.as_secs_f64();
    println!(
        "produced {} samples ({:.1} MB) in {:.2} s: {:.1} samples/s; rejected {} ({:.1}%), listed in {}",
        summary.produced,
        bytes as f64 / 1e6,
        wall,
        summary.produced as f64 / wall.max(1e-9),
        summary.rejected,
        summary.reject_rate() * 100.0,
        rejects_path.display()
    );
    print!("{}", summary.profile.table());
    println!("verdict: {}", summary.profile.verdict());
    if summary.reject_rate() > args.max_reject_rate {
        bail!(
            "{:.1}% of records were rejected, above --max-reject-rate {:.1}%; see {}",
            summary.reject_rate() * 100.0,
            args.max_reject_rate * 100.0,
            rejects_path.display()
        );
    }
    Ok(())
}
