//! `feedstore produce`: a manifest in, samples sealed in the store out.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use feedstore_consumer::{RankAt, StreamTask};
use feedstore_producer::chat::ChatTokenizer;
use feedstore_producer::feed::RecordIndex;
use feedstore_producer::feed::{FeedConfig, feed};
use feedstore_producer::manifest::{IndexedManifest, Manifest};
use feedstore_producer::pieces::{PieceIndex, ReadPiece};
use feedstore_producer::pipeline::{Event, ProducerConfig, Summary, run, run_inputs};
use feedstore_producer::profile::Profiler;
use feedstore_producer::shards::ShardRows;
use feedstore_producer::shards::{Shard, Shards, shard_list};
use feedstore_producer::tables::{ParquetFiles, ParquetRows, TableStats};
use feedstore_producer::vision::{NORMALIZATIONS, ResizeMode};
use feedstore_proto::reshard::resume;
use feedstore_proto::sample::{DType, TensorLayout};
use feedstore_proto::stream::{Shuffle, StreamSpec, StreamState, Tail, default_depth};
use feedstore_s3::{S3Fetcher, S3Options};

use crate::SocketArg;

mod progress;

pub use progress::AroundTheBar;
use progress::{BarOnError, LazyFile, Progress, catch_interrupts};

/// Arguments of `feedstore produce`.
#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(flatten)]
    socket: SocketArg,
    /// Manifest in LLaVA / Qwen-VL form, a record per line (JSONL) or one JSON array of them
    /// (LLaVA's .json files, read a record at a time): {"id", "image" | "images",
    /// "conversations", "tools" (optional)} or {"id", "text"}; a regular file. A turn is
    /// {"from", "value"}, from
    /// human, gpt, system, tool / observation (a tool's result) or function_call (a call, its
    /// value {"name", "arguments"} as an object or JSON text); a gpt turn may carry
    /// "tool_calls". Relative image paths resolve against the manifest's folder.
    #[arg(long, value_name = "FILE", required_unless_present_any = ["shards", "parquet"])]
    manifest: Option<PathBuf>,
    /// WebDataset shards instead of a manifest: uncompressed tar files (local or s3://) whose
    /// members sharing a key make a sample: a record (.json, as a manifest line: conversations,
    /// messages or text; its id defaults to the key) or a caption (.txt, with at least one
    /// image), and its images (.jpg, .jpeg, .png, .webp, .gif; in the record's
    /// "image"/"images" order when it names them). Each value is a shard, a brace pattern
    /// (s3://bucket/shard-{000..127}.tar) or @FILE, a file listing shards or patterns, one
    /// per line. Shards are read in order, a 4 MiB chunk (one ranged GET) at a time; a corrupt
    /// member or a shard cut short rejects only the samples it touches; a shard that cannot be
    /// read makes the run exit non-zero at its end. With --stream, every shard is first read
    /// through once, its members passed over, to find where each sample starts (a shard that
    /// cannot be read stops the run before it starts), and a sample is read with about 8 MiB
    /// of the samples around it, kept while ranks read the rest (--row-group-cache).
    #[arg(
        long,
        value_name = "SHARDS",
        num_args = 1..,
        conflicts_with_all = ["manifest", "image_root", "parquet"]
    )]
    shards: Vec<String>,
    /// Parquet files instead of a manifest (Hugging Face datasets' exports, local or s3://;
    /// patterns and @FILE as for --shards): a row is a record, its columns a manifest line's
    /// keys (id, conversations, messages, text, image, images). An Image column ({bytes,
    /// path}, alone or in a list) holds the image, or names a path that resolves as a
    /// manifest's (against --image-root, by default the first local file's folder, or the
    /// current one when every file is in S3). Read a row
    /// group (at most 1 GiB) at a time, every page header checked before it is decoded;
    /// snappy, zstd, lz4_raw or uncompressed (gzip, brotli, lzo and Hadoop's lz4 are refused,
    /// as are the DELTA encodings and BYTE_STREAM_SPLIT). A row group or file
    /// that cannot be read is one reject and makes the run exit non-zero at its end. With
    /// --stream, every file's footer is read first (their rows are the stream's records, so
    /// a file that cannot be opened stops the run before it starts) and a row is read with
    /// its row group, kept while ranks read the rest (--row-group-cache).
    #[arg(
        long,
        value_name = "FILES",
        num_args = 1..,
        conflicts_with_all = ["manifest"]
    )]
    parquet: Vec<String>,
    /// Relative image paths resolve against this folder (LLaVA's `image_folder`), and every
    /// image must lie beneath it: no `..` and no symbolic link (an absolute one at all) leads
    /// out [default: the manifest's folder; with --parquet, the first local file's].
    #[arg(long, value_name = "DIR")]
    image_root: Option<PathBuf>,
    /// Read absolute image paths outside the image root too, as given (relative paths stay
    /// confined).
    #[arg(long)]
    allow_absolute_image_paths: bool,
    /// The largest image file or S3 object read (a size: 67108864, 64MiB); larger ones are
    /// rejected before (and, if they grow, while) reading. A record's images (at most 128) are
    /// fetched and held together: images in memory at once are bounded by this times the images
    /// of the records in flight (--fetch-concurrency) plus three per worker. Only regular files
    /// are read: a directory, FIFO or device is rejected as such, without opening it.
    #[arg(long, value_name = "BYTES", default_value = "64MiB", value_parser = feedstore_store::config::parse_bytes)]
    max_image_bytes: u64,
    /// The model's tokenizer.json. Its chat template is read from beside it, as transformers
    /// reads it (chat_template.jinja, chat_template.json, then tokenizer_config.json's
    /// chat_template); a Qwen tokenizer with none there gets Qwen3's built-in template. Images
    /// need an image token: <|image_pad|> (Qwen-VL), <image> (LLaVA), or <|image|> where the
    /// template writes it.
    #[arg(long, value_name = "FILE")]
    tokenizer: PathBuf,
    /// The chat template to render conversations with instead of the tokenizer's: a Jinja file,
    /// a JSON file holding "chat_template" (tokenizer_config.json, chat_template.json), or
    /// `qwen3` for the built-in one.
    #[arg(long, value_name = "FILE")]
    chat_template: Option<PathBuf>,
    /// Where rejected records go, one JSON object per line with line, id, stage and reason
    /// [default: <manifest>.rejects.jsonl; with --shards or --parquet, shards.rejects.jsonl
    /// or parquet.rejects.jsonl here].
    #[arg(long, value_name = "FILE")]
    rejects: Option<PathBuf>,
    /// Also write each produced sample's handle here, one JSON object per line with line, id,
    /// handle (node:epoch:id in hex) and bytes, for readers to fetch it by.
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
    /// Tensor element type: f32, bf16, f16 or u8 (u8 keeps pixels as decoded, 0..255: not
    /// normalised, so it takes no --normalize, --mean or --std).
    #[arg(long, value_name = "TYPE", default_value = "f32")]
    dtype: String,
    /// Tensor layout: chw or hwc.
    #[arg(long, value_name = "LAYOUT", default_value = "chw")]
    layout: String,
    /// Pixel normalisation, `(x / 255 - mean) / std` per channel, as the vision encoder was
    /// trained with: `clip` (OpenAI CLIP's, Qwen2/2.5-VL's), `siglip` (mean = std = 0.5:
    /// SigLIP, Qwen3-VL), `imagenet`, or `none` (x / 255) [default: clip]. Each sample's
    /// metadata says which (`normalize`; `u8` for --dtype u8, which keeps pixels as decoded),
    /// and it is part of the decode-once cache's key.
    #[arg(long, value_name = "NAME")]
    normalize: Option<String>,
    /// A normalisation of your own: the mean per channel on the 0..1 scale, 0 to 1, e.g.
    /// 0.485,0.456,0.406 (with --std, instead of --normalize; values equal to a preset's are
    /// recorded by its name). Write --mean=... for a value that starts with '-'.
    #[arg(
        long,
        value_name = "R,G,B",
        requires = "std",
        conflicts_with = "normalize"
    )]
    mean: Option<String>,
    /// The standard deviation per channel on the 0..1 scale, 0.001 to 1, with --mean.
    #[arg(long, value_name = "R,G,B", requires = "mean")]
    std: Option<String>,
    /// Decode every pixel of a JPEG before resizing, as transformers' image processors do
    /// [default: decode at the largest DCT scale (1/2, 1/4, 1/8) that keeps the image at least
    /// the output size, as Pillow's `Image.draft` + resize: far less work for large photos, and
    /// pixels that differ from a full decode's by a level or two on average, more on sharp
    /// edges].
    #[arg(long)]
    full_jpeg_decode: bool,
    /// Refuse images with more pixels than this before decoding (decompression-bomb guard).
    #[arg(long, value_name = "PIXELS", default_value_t = 64 << 20)]
    max_source_pixels: u64,
    /// Reject conversations longer than this many tokens (image tokens included).
    #[arg(long, value_name = "N", default_value_t = 8192)]
    max_tokens: usize,
    /// Image fetches in flight at most: raise it when the verdict says fetch-bound.
    #[arg(long, value_name = "N", default_value_t = 32, value_parser = at_least_one)]
    fetch_concurrency: usize,
    /// CPU workers (decode, resize, tokenize, write) [default: one per core].
    #[arg(long, value_name = "N", value_parser = at_least_one)]
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
    #[command(flatten)]
    stream: StreamArgs,
}

/// Feeding a stream instead of producing each record once.
#[derive(Debug, clap::Args)]
#[command(next_help_heading = "Feeding a stream")]
struct StreamArgs {
    /// Feed the named stream: samples go to trainer ranks in the order --seed fixes, each rank's
    /// prefetch window full ahead of it, for --epochs epochs. Consumers open the stream with the
    /// same name and settings.
    #[arg(long, value_name = "NAME")]
    stream: Option<String>,
    /// Data-parallel ranks sharing the records (over all nodes).
    #[arg(long, value_name = "N", default_value_t = 1, requires = "stream")]
    world: u32,
    /// The ranks this producer serves, e.g. 0-7 or 0,2,4 [default: every rank].
    #[arg(long, value_name = "LIST", requires = "stream")]
    ranks: Option<String>,
    /// Where ranks live when their trainers are on other nodes: `HOST:PORT=RANKS,...`, the
    /// peer address (`feedstored --listen`) of each rank's node, e.g.
    /// `10.0.0.1:7070=0-7,10.0.0.2:7070=8-15`. Samples for those ranks are made here and pulled
    /// by their node, inside its prefetch window. Ranks not listed (or listed at this node's
    /// own address) are this node's.
    #[arg(long, value_name = "HOST:PORT=RANKS,...", requires = "stream")]
    ranks_at: Vec<String>,
    /// Send every sample for another node's ranks through the node at HOST:PORT first (it
    /// pulls the sample, then the rank's node pulls it from there), as a loader relaying
    /// samples through a coordinator does. For measuring the seed's "before": it doubles that
    /// node's traffic and adds a hop (the default pulls straight from here).
    #[arg(long, value_name = "HOST:PORT", requires = "ranks_at")]
    relay: Option<String>,
    /// Seeds the per-epoch shuffle.
    #[arg(long, value_name = "N", default_value_t = 0, requires = "stream")]
    seed: u64,
    /// Epochs to make; 0 runs until the stream is closed.
    #[arg(long, value_name = "N", default_value_t = 1, requires = "stream")]
    epochs: u64,
    /// Order within an epoch: full (a fresh permutation each epoch), none (manifest order), or
    /// block:N (blocks of N consecutive records shuffled, and shuffled within) [default: full;
    /// with --parquet, block:N with N the rows of the largest row group, so ranks read a few
    /// row groups at a time; with --shards, N the samples of the largest 8 MiB piece].
    #[arg(long, value_name = "ORDER", requires = "stream")]
    shuffle: Option<String>,
    /// With --parquet or --shards: the bytes of decoded rows or samples kept while ranks read
    /// their row groups or pieces (the one read last is always kept; up to three more may be
    /// being read). A --shuffle whose ranks read more of them at once than this holds reads
    /// them again; the run's end says how many.
    #[arg(
        long,
        value_name = "BYTES",
        default_value = "1GiB",
        value_parser = feedstore_store::config::parse_bytes,
        requires = "stream"
    )]
    row_group_cache: u64,
    /// The records that do not divide evenly among ranks: drop (left out of that epoch) or pad
    /// (short ranks repeat records from the epoch's start).
    #[arg(
        long,
        value_name = "POLICY",
        default_value = "drop",
        requires = "stream"
    )]
    tail: String,
    /// Samples made ahead of each rank (its ring's size), the samples its trainer holds
    /// included [default: 64; with --batch N, the larger of 64 and 3N: a batch held, one
    /// ready, one being made].
    #[arg(long, value_name = "N", requires = "stream")]
    prefetch: Option<u32>,
    /// Place each batch of N samples of a rank in one object, image 0 of each side by side, so
    /// a trainer reading whole batches (`Stream.next_stacked(N)`) gets their images as one
    /// view with no copy. Needs --image-size WxH (one shape for every image) whose bytes are a
    /// multiple of 64, and a --prefetch of at least N (the default, the larger of 64 and 3N,
    /// keeps a trainer fed); at most 1024. The decode-once cache is not used. A batch holding a
    /// record without an image is put one sample per object (its reader gets a copy).
    #[arg(long, value_name = "N", requires = "stream")]
    batch: Option<u32>,
    /// Resume: a file of the consumers' saved states (one `Stream::state()` text per line);
    /// their ranks start where those states say, the others at the beginning. States of every
    /// rank of a run at another world size are resharded to --world (as `feedstore.reshard`
    /// does: every sample the old ranks left of the epochs they had begun read once, then
    /// whole epochs at --world); give the trainers the same new states.
    #[arg(long, value_name = "FILE", requires = "stream")]
    resume: Option<PathBuf>,
    /// Make every sample again even when the store still holds it (by default a sample made
    /// once, by any producer on the node, with the same record, transform and tokenizer, is
    /// reused by later epochs, ranks and jobs while memory allows).
    #[arg(long, requires = "stream")]
    no_cache: bool,
    /// Seconds to go on once every trainer that read the stream on this node has left: then
    /// the producer says so and exits with status 3, its profile printed (a supervisor sees
    /// a run that did not finish its epochs). While no trainer has attached yet it waits for
    /// one; the progress line says how long the readers have been gone. Long enough for a
    /// checkpoint or an evaluation between epochs, when loaders close their streams. 0: wait
    /// for readers forever. Not used with --ranks-at (readers on other nodes are not seen
    /// from here).
    #[arg(
        long,
        value_name = "SECONDS",
        default_value_t = 1800,
        requires = "stream"
    )]
    idle_exit: u64,
}

impl StreamArgs {
    /// The spec and where each served rank starts.
    /// The order `--shuffle` asks for, if it names one.
    fn shuffle(&self) -> anyhow::Result<Option<Shuffle>> {
        self.shuffle
            .as_deref()
            .map(|asked| asked.parse().map_err(|e| anyhow::anyhow!("--{e}")))
            .transpose()
    }

    fn feed(&self, name: &str, records: u64, shuffle: Shuffle) -> anyhow::Result<FeedConfig> {
        let shuffle = self.shuffle()?.unwrap_or(shuffle);
        let tail: Tail = self.tail.parse().map_err(|e| anyhow::anyhow!("--{e}"))?;
        let spec = StreamSpec {
            name: name.to_owned(),
            records,
            seed: self.seed,
            world: self.world,
            shuffle,
            tail,
            epochs: (self.epochs > 0).then_some(self.epochs),
            reshard: None,
        };
        spec.check(0)
            .map_err(|e| anyhow::anyhow!("--stream {name}: {e}"))?;
        let ranks: Vec<u32> = match &self.ranks {
            None => (0..self.world).collect(),
            Some(list) => parse_ranks(list, "--ranks")?,
        };
        let mut starts = std::collections::BTreeMap::new();
        let mut spec = spec;
        if let Some(path) = &self.resume {
            let (resumed, states) = resume_states(path, &spec)?;
            spec = resumed;
            for state in states {
                starts.insert(state.rank, state.seq(&spec));
            }
        }
        let mut tasks = Vec::with_capacity(ranks.len());
        for rank in ranks {
            spec.check(rank)
                .map_err(|e| anyhow::anyhow!("--ranks: {e}"))?;
            tasks.push(StreamTask {
                rank,
                seq: starts.get(&rank).copied().unwrap_or(0),
            });
        }
        Ok(FeedConfig {
            at: self.ranks_at(&spec)?,
            relay: self.relay.clone().unwrap_or_default(),
            spec,
            depth: self
                .prefetch
                .unwrap_or_else(|| default_depth(self.batch.unwrap_or(1)))
                .max(1),
            ranks: tasks,
            cache: !self.no_cache,
            batch: self.batch.unwrap_or(0),
        })
    }
}

/// The most bytes a `--resume` file may hold: a state per rank of the largest world a reshard
/// takes, each carrying the largest reshard.
const MAX_RESUME_FILE: u64 = 256 << 20;

/// The states in a `--resume` file for the stream `spec` (at --world): read as they are, or
/// resharded from a run at another world size when they are every rank's of one. The spec
/// they belong to comes back with them (with the reshard, if any).
fn resume_states(
    path: &std::path::Path,
    spec: &StreamSpec,
) -> anyhow::Result<(StreamSpec, Vec<StreamState>)> {
    let text = feedstore_producer::input::read_text(path, MAX_RESUME_FILE, "the states file")
        .map_err(|e| anyhow::anyhow!(e))?;
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    let (resumed, states, resharded) = resume(spec, &lines).map_err(|why| {
        anyhow::anyhow!(
            "{}: {why}; seed, epochs, shuffle, tail and the manifest's record count must match",
            path.display()
        )
    })?;
    if resharded {
        eprintln!(
            "feedstore produce: resharding the states of {} ranks in {} to --world {}",
            lines.len(),
            path.display(),
            spec.world
        );
    }
    Ok((resumed, states))
}

impl StreamArgs {
    /// `--ranks-at`: `host:port=0-3,6,other:port=4-5` (a part with `=` starts a node).
    fn ranks_at(&self, spec: &StreamSpec) -> anyhow::Result<Vec<RankAt>> {
        let mut at: Vec<RankAt> = Vec::new();
        for value in &self.ranks_at {
            let mut addr: Option<&str> = None;
            for part in value.split(',').map(str::trim).filter(|p| !p.is_empty()) {
                let list = match part.split_once('=') {
                    Some((a, list)) => {
                        if !a.contains(':') {
                            bail!(
                                "--ranks-at {a:?}: want HOST:PORT (the node's feedstored --listen)"
                            );
                        }
                        addr = Some(a.trim());
                        list
                    }
                    None => part,
                };
                let Some(addr) = addr else {
                    bail!("--ranks-at {value:?}: want HOST:PORT=RANKS, e.g. 10.0.0.2:7070=8-15");
                };
                for rank in parse_ranks(list, "--ranks-at")? {
                    spec.check(rank)
                        .map_err(|e| anyhow::anyhow!("--ranks-at: {e}"))?;
                    if at.iter().any(|r| r.rank == rank) {
                        bail!("--ranks-at names rank {rank} twice");
                    }
                    at.push(RankAt {
                        rank,
                        addr: addr.to_owned(),
                    });
                }
            }
        }
        Ok(at)
    }
}

/// `0-7`, `0,2,4` or a mix (`flag` names the option in errors).
fn parse_ranks(list: &str, flag: &str) -> anyhow::Result<Vec<u32>> {
    let mut ranks = Vec::new();
    for part in list.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b): (u32, u32) = (a.trim().parse()?, b.trim().parse()?);
                if a > b {
                    bail!("{flag} {part}: empty range");
                }
                ranks.extend(a..=b);
            }
            None => ranks.push(part.parse().with_context(|| format!("{flag} {part:?}"))?),
        }
    }
    if ranks.is_empty() {
        bail!("{flag} {list:?} names no rank");
    }
    Ok(ranks)
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
        return Ok(ResizeMode::ShorterSide(n.trim().parse().with_context(
            || format!("--image-size {:?}: short:N needs a number", args.image_size),
        )?));
    }
    if let Some((w, h)) = s.split_once('x')
        && let (Ok(width), Ok(height)) = (w.trim().parse(), h.trim().parse())
    {
        return Ok(ResizeMode::Fixed { width, height });
    }
    bail!(
        "--image-size {:?}: expected qwen, WxH or short:N",
        args.image_size
    )
}

/// `feedstore produce`: the producer's pipeline over a manifest, into the store or a stream,
/// with progress on stderr, then the profile.
pub fn run_produce(args: Args) -> anyhow::Result<()> {
    let config = producer_config(&args)?;
    let shards = match args.shards.is_empty() {
        true => None,
        false => Some(shard_list(&args.shards).map_err(|e| anyhow::anyhow!("--shards: {e}"))?),
    };
    let tables = match args.parquet.is_empty() {
        true => None,
        false => Some(shard_list(&args.parquet).map_err(|e| anyhow::anyhow!("--parquet: {e}"))?),
    };
    // Where a Parquet row's image paths resolve: beside the first local file.
    let tables_folder = tables.iter().flatten().find_map(|file| match file {
        Shard::Local(path) => Some(
            std::path::absolute(path)
                .ok()?
                .parent()
                .map_or_else(|| PathBuf::from("/"), PathBuf::from),
        ),
        Shard::S3 { .. } => None,
    });
    let image_root = match (&args.image_root, &args.manifest) {
        (Some(root), _) => root.clone(),
        (None, Some(manifest)) => std::path::absolute(manifest)
            .with_context(|| format!("{}", manifest.display()))?
            .parent()
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("/")),
        // Shards hold their images: no path is read from a record.
        (None, None) => match tables_folder {
            Some(folder) => folder,
            None => std::env::current_dir().context("the current folder")?,
        },
    };
    let local = feedstore_producer::input::LocalFiles::beneath(
        &image_root,
        args.allow_absolute_image_paths,
        args.max_image_bytes,
    )
    .context("--image-root")?;
    let tokenizer = Arc::new(
        ChatTokenizer::load(
            &args.tokenizer,
            args.chat_template.as_deref(),
            args.max_tokens,
        )
        .context("loading the tokenizer and its chat template")?,
    );
    let rejects_path = args
        .rejects
        .clone()
        .unwrap_or_else(|| match &args.manifest {
            Some(manifest) => {
                let mut p = manifest.clone().into_os_string();
                p.push(".rejects.jsonl");
                p.into()
            }
            None if tables.is_some() => PathBuf::from("parquet.rejects.jsonl"),
            None => PathBuf::from("shards.rejects.jsonl"),
        });
    let rejects = LazyFile::new(&rejects_path)?;
    let handles = args.handles.as_deref().map(LazyFile::new).transpose()?;
    if !(args.s3_attempt_timeout > 0.0 && args.s3_attempt_timeout.is_finite()) {
        bail!("--s3-attempt-timeout must be a positive number of seconds");
    }
    let (from, images) = match (&args.manifest, &shards) {
        (None, None) if let Some(files) = &tables => (
            match files.len() {
                1 => format!("the Parquet file {}", files[0]),
                n => format!("{n} Parquet files, {} to {}", files[0], files[n - 1]),
            },
            format!(
                "images in the files, or paths beneath {}",
                image_root.display()
            ),
        ),
        (Some(manifest), _) => (
            manifest.display().to_string(),
            format!(
                "images beneath {}{}",
                image_root.display(),
                if args.allow_absolute_image_paths {
                    " (absolute paths anywhere)"
                } else {
                    ""
                }
            ),
        ),
        (None, Some(shards)) => (
            match shards.len() {
                1 => format!("the shard {}", shards[0]),
                n => format!("{n} shards, {} to {}", shards[0], shards[n - 1]),
            },
            "images in the shards".to_owned(),
        ),
        (None, None) => unreachable!("clap requires --manifest, --shards or --parquet"),
    };
    eprintln!(
        "producing from {from} into the store at {} with {} workers and {} fetches in flight; \
         {images}; chat template: {}",
        config.socket.display(),
        config.workers,
        config.fetch_concurrency,
        tokenizer.template().origin()
    );
    let fetcher = Arc::new(s3_fetcher(&args)?.with_local(local));
    let mut progress = Progress::new(&args, &config, rejects, handles);
    let _abandon = BarOnError(progress.bar.clone());
    // Ctrl-C (or SIGTERM) ends the run with the profile so far; a second one kills at once.
    catch_interrupts();
    let mut on_event = |event: &Event, profiler: &Profiler| progress.on_event(event, profiler);
    // Shards or Parquet files that could not be read to their end: counted, and the run fails
    // once it is over.
    let mut unreadable = None;
    let summary = match (&args.stream.stream, &args.manifest, shards) {
        (None, None, None) if let Some(files) = tables => {
            let named = files.len();
            let inputs = ParquetFiles::new(
                files,
                fetcher.clone(),
                args.max_image_bytes,
                image_root.clone(),
            );
            let stats = inputs.stats();
            let summary = run_inputs(&config, tokenizer, fetcher, inputs, &mut on_event)?;
            let load = |n: &std::sync::atomic::AtomicU64| n.load(Ordering::Relaxed);
            eprintln!(
                "read {} from the {named} Parquet file(s) named, {} row group(s) (the largest \
                 {}), in {} reads",
                feedstore_store::config::format_bytes(load(&stats.bytes)),
                load(&stats.row_groups),
                feedstore_store::config::format_bytes(load(&stats.peak_row_group)),
                load(&stats.requests),
            );
            unreadable = tables_lost(&stats, named, false);
            summary
        }
        (Some(name), None, None) if let Some(files) = tables => {
            // A --shuffle that does not parse is said before any footer is read.
            args.stream.shuffle()?;
            let named = files.len();
            eprintln!("reading the footers of {named} Parquet file(s)");
            let started = Instant::now();
            let rows = ParquetRows::open(
                files,
                fetcher.clone(),
                args.max_image_bytes,
                image_root.clone(),
                args.stream.row_group_cache,
            )
            .map_err(|e| anyhow::anyhow!("--parquet: {e}"))?;
            let rows = Arc::new(rows);
            let counted = (started, "rows", format!("{named} file(s)"));
            let pipeline = (&config, tokenizer, fetcher);
            let summary = feed_by_index(
                &args,
                name,
                (&rows, "row group", counted),
                pipeline,
                &mut progress,
            )?;
            unreadable = tables_lost(&rows.stats(), named, true);
            summary
        }
        (Some(name), None, Some(shards)) => {
            // A --shuffle that does not parse is said before any shard is read.
            args.stream.shuffle()?;
            let named = shards.len();
            eprintln!("indexing {named} shard(s): each read through once, its members passed over");
            let started = Instant::now();
            let mut said = Instant::now();
            let rows = ShardRows::open(
                shards,
                fetcher.clone(),
                args.max_image_bytes,
                (
                    feedstore_producer::shards::PIECE_BYTES,
                    args.stream.row_group_cache,
                ),
                |indexed| {
                    if let Some((done, samples)) = indexed
                        && said.elapsed() >= Duration::from_secs(5)
                    {
                        said = Instant::now();
                        eprintln!("  {done} of {named} shard(s) indexed, {samples} samples");
                    }
                    // A first Ctrl-C (or SIGTERM) stops indexing: the run ends, said so.
                    !progress::was_interrupted()
                },
            )
            .map_err(|e| anyhow::anyhow!("--shards: {e}"))?;
            let rows = Arc::new(rows);
            let counted = (started, "samples", format!("{named} shard(s)"));
            let pipeline = (&config, tokenizer, fetcher);
            let summary = feed_by_index(
                &args,
                name,
                (&rows, "piece", counted),
                pipeline,
                &mut progress,
            )?;
            let failed = rows.stats().unreadable.load(Ordering::Relaxed);
            unreadable = (failed > 0).then(|| {
                format!(
                    "{failed} piece(s) of the {named} shard(s) could not be read (changed since \
                     they were indexed, or a read that failed after its retries): their samples \
                     were left out, each replaced by the next record of its rank's share"
                )
            });
            summary
        }
        (_, _, Some(shards)) => {
            let named = shards.len();
            let inputs = Shards::new(shards, fetcher.clone(), args.max_image_bytes);
            let stats = inputs.stats();
            let summary = run_inputs(&config, tokenizer, fetcher, inputs, &mut on_event)?;
            let (requests, bytes) = (
                stats.requests.load(Ordering::Relaxed),
                stats.bytes.load(Ordering::Relaxed),
            );
            eprintln!(
                "read {} from {named} shard(s) in {requests} reads ({:.3} reads per sample)",
                feedstore_store::config::format_bytes(bytes),
                requests as f64 / (summary.produced + summary.rejected).max(1) as f64
            );
            let failed = stats.unreadable.load(Ordering::Relaxed);
            unreadable = (failed > 0).then(|| {
                format!(
                    "{failed} of {named} shard(s) could not be read to their end (missing, not \
                     a tar file, or a read that failed after its retries): their samples are \
                     missing from this run"
                )
            });
            summary
        }
        (None, Some(manifest_path), None) => {
            let manifest = Manifest::open(manifest_path)
                .with_context(|| format!("opening {}", manifest_path.display()))?;
            let failure = manifest.failure();
            let summary = run(&config, tokenizer, fetcher, manifest, &mut on_event)?;
            if let Some(e) = failure.get() {
                bail!("{}: {e}", manifest_path.display());
            }
            summary
        }
        (Some(_), None, None) | (None, None, None) => {
            unreachable!("clap requires --manifest or --shards")
        }
        (Some(name), Some(manifest_path), None) => {
            let manifest = Arc::new(
                IndexedManifest::open(manifest_path)
                    .with_context(|| format!("indexing {}", manifest_path.display()))?,
            );
            let feed_config = args.stream.feed(name, manifest.len(), Shuffle::Full)?;
            progress.feeding(name, &feed_config, manifest.len());
            let on_event = |event: &Event, profiler: &Profiler| progress.on_event(event, profiler);
            feed(
                &config,
                &feed_config,
                tokenizer,
                fetcher,
                manifest,
                on_event,
            )?
        }
    };
    let rejects_path = progress.rejects_path().to_owned();
    let finished = progress.finish(&summary, args.max_reject_rate);
    let unreadable = unreadable.map(|u| format!("{u}; see {}", rejects_path.display()));
    match (finished, unreadable) {
        (Ok(()), None) => Ok(()),
        (Ok(()), Some(unreadable)) => bail!("{unreadable}"),
        // Both: the files lost are said first, since the reject rate counts each as one.
        (Err(e), Some(unreadable)) => {
            eprintln!("feedstore: error: {unreadable}");
            Err(e)
        }
        (Err(e), None) => Err(e),
    }
}

/// Feeds the stream `name` from `rows`, read by index through a cache of pieces (Parquet row
/// groups, runs of a shard's samples), in blocks of the largest piece's records (ranks read a
/// few pieces at a time) unless --shuffle says otherwise; says what was indexed, since when,
/// and what the cache did. `piece` names a piece, `records` the records, `of` the files.
fn feed_by_index<R: ReadPiece>(
    args: &Args,
    name: &str,
    (rows, piece, (started, records, of)): (&Arc<PieceIndex<R>>, &str, (Instant, &str, String)),
    (config, tokenizer, fetcher): (&ProducerConfig, Arc<ChatTokenizer>, Arc<S3Fetcher>),
    progress: &mut Progress,
) -> anyhow::Result<Summary> {
    eprintln!(
        "{} {records} in {} {piece}(s) of {of}, indexed in {:.1} s",
        rows.len(),
        rows.pieces(),
        started.elapsed().as_secs_f64()
    );
    let block = u32::try_from(rows.largest_piece().max(1)).unwrap_or(u32::MAX);
    let feed_config = args.stream.feed(name, rows.len(), Shuffle::Block(block))?;
    let cache = feedstore_store::config::format_bytes(args.stream.row_group_cache);
    if feed_config.spec.shuffle == Shuffle::Full {
        eprintln!(
            "feedstore: warning: --shuffle full reads a {piece} for about every sample unless \
             the records fit in --row-group-cache ({cache}); block:{block} reads each {piece} \
             about once an epoch"
        );
    }
    progress.feeding(name, &feed_config, rows.len());
    let on_event = |event: &Event, profiler: &Profiler| progress.on_event(event, profiler);
    let source: Arc<dyn RecordIndex> = rows.clone();
    let summary = feed(config, &feed_config, tokenizer, fetcher, source, on_event)?;
    let taken = rows.taken();
    eprintln!(
        "read {} in {} reads, {}",
        feedstore_store::config::format_bytes(taken.bytes),
        taken.reads,
        taken.note
    );
    let reads = rows.reads();
    let reread = reads.reread.load(Ordering::Relaxed);
    eprintln!(
        "{reread} {piece}(s) read again after the cache let them go{}; the cache held at most {}",
        match reread {
            0 => String::new(),
            _ => format!(
                " (a --row-group-cache over {cache}, or a --shuffle block:N of fewer records, \
                 reads each once)"
            ),
        },
        feedstore_store::config::format_bytes(reads.peak_bytes.load(Ordering::Relaxed)),
    );
    Ok(summary)
}

/// What a run says of Parquet files or row groups it could not read, if any.
/// (`stream`: the rows of a stream, each rejected one replaced by another record.)
fn tables_lost(stats: &TableStats, named: usize, stream: bool) -> Option<String> {
    let failed = stats.unreadable.load(Ordering::Relaxed);
    let lost = match stream {
        true => "their rows were left out, each replaced by the next record of its rank's share",
        false => "their rows are missing from this run",
    };
    (failed > 0).then(|| {
        format!(
            "{failed} Parquet file(s) or row group(s) of the {named} file(s) could not be read \
             (missing, not a Parquet file, a corrupt page, a limit passed, or a read that \
             failed after its retries): {lost}"
        )
    })
}

/// The pipeline's settings from the command line, checked before any work.
fn producer_config(args: &Args) -> anyhow::Result<ProducerConfig> {
    let mut config = ProducerConfig::new(args.socket.path());
    config.fetch_concurrency = args.fetch_concurrency.max(1);
    if let Some(w) = args.workers {
        config.workers = w.max(1);
    }
    config.patch_size = args.patch_size;
    config.merge_size = args.merge_size;
    config.transform.resize = image_size(args)?;
    config.transform.max_source_pixels = args.max_source_pixels;
    config.transform.jpeg_draft = !args.full_jpeg_decode;
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
    (config.transform.mean, config.transform.std) = normalization(args)?;
    config.validate().map_err(|e| {
        anyhow::anyhow!(
            "{e} (--image-size, --patch-size, --merge-size, --min-pixels, --max-pixels, \
             --max-source-pixels)"
        )
    })?;
    if let Some(batch) = args.stream.batch.filter(|&b| b > 1) {
        check_batch_shape(args, &config, batch)?;
    }
    Ok(config)
}

/// The mean and standard deviation of `--normalize`, or of `--mean` and `--std`.
fn normalization(args: &Args) -> anyhow::Result<([f32; 3], [f32; 3])> {
    if args.dtype.eq_ignore_ascii_case("u8") && (args.normalize.is_some() || args.mean.is_some()) {
        bail!("--dtype u8 keeps pixels as decoded: drop --normalize, --mean and --std");
    }
    if let (Some(mean), Some(std)) = (&args.mean, &args.std) {
        return Ok((
            channels(
                "--mean",
                mean,
                0.0,
                "a mean of 123.675 on the 0..255 scale is 0.485",
            )?,
            channels(
                "--std",
                std,
                0.001,
                "a std of 58.395 on the 0..255 scale is 0.229",
            )?,
        ));
    }
    let given = args.normalize.as_deref().unwrap_or("clip");
    let name = given.to_ascii_lowercase();
    match NORMALIZATIONS.iter().find(|(n, _, _)| *n == name) {
        Some(&(_, mean, std)) => Ok((mean, std)),
        None => {
            let names: Vec<&str> = NORMALIZATIONS.iter().map(|(n, _, _)| *n).collect();
            bail!(
                "--normalize {given:?}: expected {}, or --mean and --std",
                names.join(", ")
            )
        }
    }
}

/// Three values `R,G,B` between `low` and 1: a mean or standard deviation on the 0..1 scale
/// (`example` shows the scale).
fn channels(flag: &str, text: &str, low: f32, example: &str) -> anyhow::Result<[f32; 3]> {
    let values: Vec<f32> = text
        .split(',')
        .map(|v| v.trim().parse::<f32>())
        .collect::<Result<_, _>>()
        .map_err(|_| anyhow::anyhow!("{flag} {text:?}: expected three numbers R,G,B"))?;
    let Ok(values) = <[f32; 3]>::try_from(values) else {
        bail!("{flag} {text:?}: expected three numbers R,G,B");
    };
    if let Some(v) = values.iter().find(|v| !(low..=1.0).contains(*v)) {
        bail!(
            "{flag} {text:?}: {v} is not between {low} and 1; values are on the 0..1 scale \
             ({example})"
        );
    }
    Ok(values)
}

/// Refuses `--batch` before any work when no batch could be one view: images of several
/// shapes, or of a size that cannot lie side by side aligned.
fn check_batch_shape(args: &Args, config: &ProducerConfig, batch: u32) -> anyhow::Result<()> {
    let ResizeMode::Fixed { width, height } = config.transform.resize else {
        bail!(
            "--batch {batch}: a batch's images lie side by side only if they have one shape: \
             use --image-size WxH (not {:?})",
            args.image_size
        );
    };
    let elements: u64 = config
        .transform
        .shape(width, height)
        .iter()
        .map(|&d| u64::from(d))
        .product();
    let bytes = elements * config.transform.dtype.size_bytes();
    if !bytes.is_multiple_of(64) {
        bail!(
            "--batch {batch}: a {width}x{height} image is {bytes} bytes at --dtype {}, not a \
             multiple of 64, so a batch's images cannot lie side by side aligned: pick \
             another --image-size or --dtype",
            args.dtype
        );
    }
    Ok(())
}

/// The S3 client, as the `--s3-*` options say.
fn s3_fetcher(args: &Args) -> anyhow::Result<S3Fetcher> {
    let s3_options = S3Options {
        endpoint: args.s3_endpoint.clone(),
        region: args.s3_region.clone(),
        force_path_style: args.s3_path_style,
        max_attempts: args.s3_max_attempts,
        attempt_timeout: Duration::from_secs_f64(args.s3_attempt_timeout),
        max_object_bytes: args.max_image_bytes,
        ..S3Options::default()
    };
    Ok(tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting a runtime for the S3 client")?
        .block_on(S3Fetcher::new(&s3_options)))
}

/// A count that must be at least 1.
fn at_least_one(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}
