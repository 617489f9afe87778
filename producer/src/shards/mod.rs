//! WebDataset shards: tar files in which the members sharing a key (a member's path up to the
//! first dot of its file name) make one sample, read front to back a chunk at a time.
//!
//! ```text
//! shard-000.tar: 000017.jpg 000017.json 000018.jpg 000018.txt ...
//!                └── sample "000017" ──┘ └── sample "000018" ─┘
//! ```
//!
//! A sample's `.json` member is its record, as a manifest line would be (`conversations`,
//! `messages` or `text`; `id` defaults to the key). Its images are the sample's image members
//! (`jpg`, `jpeg`, `png`, `webp`, `gif`), in the order of the record's `image` / `images` when it
//! names them (by member name, file name or extension: `"jpg"`, `"0.png"`) and in the shard's
//! order when it does not. Without a `.json`, a `.txt` member is a caption: the user turn is the
//! images' placeholders, the assistant's turn the caption (a caption needs an image). Other
//! members are skipped unread. Shards are uncompressed tar files (a compressed one is refused,
//! saying so).
//!
//! A shard is never held whole: [`Shards`] keeps one chunk ([`CHUNK_BYTES`], one ranged GET from
//! S3, with the next one's GET under way while it is read) plus the sample being gathered, each member bounded (images by `--max-image-bytes`,
//! records by the manifest's line limit), so memory is bounded however large the shard. What
//! goes wrong rejects the sample it happened in, with its shard and byte offset, never the run:
//! a member over its limit, a corrupt header (the samples before and after it, since the member
//! lost may be either's; reading goes on at the next header that checks out), a shard cut
//! short (the sample it ends in; a shard must end with tar's end-of-archive blocks), a shard
//! that cannot be read (one reject, counted in [`ShardStats::unreadable`]).

use std::collections::VecDeque;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;

mod rows;

pub use rows::{PIECE_BYTES, ShardRows};

use crate::chat::{IMAGE_PLACEHOLDER, Message, Role};
use crate::manifest::{Content, MAX_IMAGES_PER_RECORD, MAX_LINE_BYTES, Record, Reject};
use crate::pipeline::{Input, Inputs};
use crate::source::{Fetch, FetchError, ImageSource};

/// Bytes read from a shard at a time: one ranged GET from S3, one `pread` from a file.
pub const CHUNK_BYTES: u64 = 4 << 20;

/// The most shards a list may name.
pub const MAX_SHARDS: usize = 1 << 20;

/// The largest pax extended header or GNU long name read (a member's name and size).
const MAX_EXTENDED_HEADER: u64 = 1 << 20;

/// Image members, by extension.
const IMAGE_EXTENSIONS: [&str; 5] = ["jpg", "jpeg", "png", "webp", "gif"];

const BLOCK: u64 = 512;

/// The largest member a header may claim (1 PiB): past it, the header is taken as corrupt.
const MAX_MEMBER_SPAN: u64 = 1 << 50;

/// A shard: a tar file on this node or an S3 object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Shard {
    /// A file on this node.
    Local(PathBuf),
    /// An S3 object.
    S3 {
        /// Bucket.
        bucket: String,
        /// Key.
        key: String,
    },
}

impl Shard {
    /// `s3://bucket/key` or a path.
    pub fn parse(text: &str) -> Result<Shard, String> {
        match text.strip_prefix("s3://") {
            Some(rest) => match rest.split_once('/') {
                Some((bucket, key)) if !bucket.is_empty() && !key.is_empty() => Ok(Shard::S3 {
                    bucket: bucket.to_owned(),
                    key: key.to_owned(),
                }),
                _ => Err(format!("{text:?}: expected s3://bucket/key")),
            },
            None if text.trim().is_empty() => Err("an empty shard name".into()),
            None => Ok(Shard::Local(PathBuf::from(text))),
        }
    }
}

impl std::fmt::Display for Shard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Shard::Local(path) => write!(f, "{}", path.display()),
            Shard::S3 { bucket, key } => write!(f, "s3://{bucket}/{key}"),
        }
    }
}

/// The shards `specs` name, in order: each a shard, a brace pattern (`shard-{000..127}.tar`,
/// `{train,val}-{0..3}.tar`), or `@FILE`, a file listing them (one shard or pattern per line,
/// `#` comments; relative paths against the file's folder). At most [`MAX_SHARDS`], their names
/// [`MAX_NAME_BYTES`] each.
pub fn shard_list(specs: &[String]) -> Result<Vec<Shard>, String> {
    let mut shards = Vec::new();
    let add = |name: &str, folder: Option<&Path>, shards: &mut Vec<Shard>| {
        for name in expand(name, MAX_SHARDS - shards.len())? {
            let shard = Shard::parse(&name)?;
            shards.push(match (shard, folder) {
                (Shard::Local(p), Some(folder)) if p.is_relative() => Shard::Local(folder.join(p)),
                (other, _) => other,
            });
        }
        Ok::<_, String>(())
    };
    for spec in specs {
        match spec.strip_prefix('@') {
            Some(list) => {
                // At most 64 MiB, a regular file.
                let text = crate::input::read_text(Path::new(list), 64 << 20, "the shard list")?;
                let folder = Path::new(list).parent().unwrap_or(Path::new(""));
                for line in text.lines().map(str::trim) {
                    if !line.is_empty() && !line.starts_with('#') {
                        add(line, Some(folder), &mut shards)?;
                    }
                }
            }
            None => add(spec, None, &mut shards)?,
        }
    }
    if shards.is_empty() {
        return Err("no shard named".into());
    }
    Ok(shards)
}

/// The longest shard name (a path or an S3 URI), pattern or expanded.
pub const MAX_NAME_BYTES: usize = 4096;

/// The most brace groups in one pattern.
const MAX_BRACE_GROUPS: usize = 16;

/// Expands the brace patterns in `pattern` (`{000..127}`: numbers, zero-padded to the first's
/// width; `{a,b}`: alternatives; no nesting), to at most `limit` names of at most
/// [`MAX_NAME_BYTES`] each.
pub fn expand(pattern: &str, limit: usize) -> Result<Vec<String>, String> {
    let over = || format!("{pattern:?} names over {limit} shards");
    if limit == 0 {
        return Err(over());
    }
    if pattern.len() > MAX_NAME_BYTES {
        return Err(format!(
            "a shard name or pattern of {} bytes (at most {MAX_NAME_BYTES})",
            pattern.len()
        ));
    }
    // The pattern as parts, each a list of choices (a literal is one).
    let mut parts: Vec<Vec<String>> = Vec::new();
    let mut count = 1usize;
    let mut rest = pattern;
    while let Some(open) = rest.find('{') {
        if rest[..open].contains('}') {
            return Err(format!("{pattern:?}: a '}}' without its '{{'"));
        }
        parts.push(vec![rest[..open].to_owned()]);
        let close = rest[open..]
            .find('}')
            .map(|c| open + c)
            .ok_or_else(|| format!("{pattern:?}: a '{{' without its '}}'"))?;
        let body = &rest[open + 1..close];
        if body.contains('{') {
            return Err(format!("{pattern:?}: nested braces are not expanded"));
        }
        if parts.len() / 2 >= MAX_BRACE_GROUPS {
            return Err(format!("{pattern:?}: over {MAX_BRACE_GROUPS} brace groups"));
        }
        let choices: Vec<String> = match body.split_once("..") {
            Some((from, to)) => {
                let parse = |n: &str| {
                    n.parse::<u64>()
                        .ok()
                        .filter(|_| n.len() <= 20)
                        .ok_or_else(|| format!("{pattern:?}: {{{body}}} is not a range of numbers"))
                };
                let (a, b) = (parse(from)?, parse(to)?);
                if a > b {
                    return Err(format!("{pattern:?}: {{{body}}} is an empty range"));
                }
                if b - a >= limit as u64 {
                    return Err(over());
                }
                let width = if from.starts_with('0') { from.len() } else { 0 };
                (a..=b).map(|n| format!("{n:0width$}")).collect()
            }
            None if body.matches(',').count() >= limit => return Err(over()),
            None => body.split(',').map(str::to_owned).collect(),
        };
        count = count
            .checked_mul(choices.len())
            .filter(|&c| c <= limit)
            .ok_or_else(over)?;
        parts.push(choices);
        rest = &rest[close + 1..];
    }
    if rest.contains('}') {
        return Err(format!("{pattern:?}: a '}}' without its '{{'"));
    }
    parts.push(vec![rest.to_owned()]);
    // Every combination, the last part turning fastest.
    let mut names = Vec::with_capacity(count);
    let mut at = vec![0usize; parts.len()];
    for _ in 0..count {
        let name: String = parts.iter().zip(&at).map(|(p, &i)| p[i].as_str()).collect();
        if name.len() > MAX_NAME_BYTES {
            return Err(format!(
                "{pattern:?} expands to a name of {} bytes (at most {MAX_NAME_BYTES})",
                name.len()
            ));
        }
        names.push(name);
        for (i, part) in at.iter_mut().zip(&parts).rev() {
            *i += 1;
            if *i < part.len() {
                break;
            }
            *i = 0;
        }
    }
    Ok(names)
}

/// What reading shards took, for the profile and tests.
#[derive(Debug, Default)]
pub struct ShardStats {
    /// Reads issued (ranged GETs for S3 shards).
    pub requests: AtomicU64,
    /// Bytes read.
    pub bytes: AtomicU64,
    /// The most bytes a shard's reader held at once: its buffer, the chunk being fetched and
    /// the sample being gathered.
    pub peak_held: AtomicU64,
    /// Shards that could not be read to their end (missing, unreadable, not a tar file, a
    /// read that failed after its retries).
    pub unreadable: AtomicU64,
}

/// The samples of a list of shards, read in order, as the pipeline's [`Inputs`]: a record with
/// its images' bytes per sample, a reject per sample that went wrong.
pub struct Shards {
    shards: VecDeque<Shard>,
    fetcher: Arc<dyn Fetch>,
    max_image_bytes: u64,
    stats: Arc<ShardStats>,
    /// The shard being read.
    reading: Option<ShardReader>,
    /// Inputs made and not yet handed out.
    ready: VecDeque<Input>,
    /// Samples numbered so far: a sample's `line`.
    samples: u64,
    /// The next shard's first chunk, fetched while the shard before it is read to its end
    /// (an S3 shard's only).
    next_first: Option<ReadAhead>,
}

impl std::fmt::Debug for Shards {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shards")
            .field("left", &self.shards.len())
            .field("samples", &self.samples)
            .finish_non_exhaustive()
    }
}

impl Shards {
    /// Reads `shards` in order, S3 ones through `fetcher` (ranged GETs with its retries), image
    /// members of at most `max_image_bytes`.
    pub fn new(shards: Vec<Shard>, fetcher: Arc<dyn Fetch>, max_image_bytes: u64) -> Shards {
        Shards {
            shards: shards.into(),
            fetcher,
            max_image_bytes,
            stats: Arc::default(),
            reading: None,
            ready: VecDeque::new(),
            samples: 0,
            next_first: None,
        }
    }

    /// What reading has taken so far.
    pub fn stats(&self) -> Arc<ShardStats> {
        self.stats.clone()
    }

    /// Starts fetching the next shard's first chunk, if it is in S3 and not started yet.
    fn start_next(&mut self) {
        let Some(Shard::S3 { bucket, key }) = self.shards.front() else {
            return;
        };
        if self.next_first.is_some() {
            return;
        }
        self.stats.requests.fetch_add(1, Ordering::Relaxed);
        let fetcher = self.fetcher.clone();
        let source = ImageSource::S3 {
            bucket: bucket.clone(),
            key: key.clone(),
        };
        self.next_first = Some(ReadAhead {
            offset: 0,
            task: Some(tokio::spawn(async move {
                fetcher.fetch_range(&source, 0, CHUNK_BYTES).await
            })),
        });
    }

    /// Opens the next shard; false when none is left. A shard that cannot be opened is one
    /// reject.
    fn open_next(&mut self) -> bool {
        let Some(shard) = self.shards.pop_front() else {
            return false;
        };
        let name: Arc<str> = shard.to_string().into();
        let body = match &shard {
            Shard::Local(path) => match crate::input::open_regular(path)
                .and_then(|file| Ok((file.metadata()?.len(), file)))
            {
                Ok((len, file)) => Body::Local { file, len },
                Err(e) => {
                    self.stats.unreadable.fetch_add(1, Ordering::Relaxed);
                    self.samples += 1;
                    self.ready.push_back(Input::Rejected(shard_reject(
                        self.samples,
                        None,
                        format!("cannot open shard {name}: {e}"),
                    )));
                    return true;
                }
            },
            Shard::S3 { bucket, key } => Body::Remote {
                fetcher: self.fetcher.clone(),
                source: ImageSource::S3 {
                    bucket: bucket.clone(),
                    key: key.clone(),
                },
                // Its first chunk, when the shard before it started it.
                ahead: self.next_first.take(),
            },
        };
        self.reading = Some(ShardReader::new(
            name,
            body,
            0,
            self.stats.clone(),
            self.max_image_bytes,
        ));
        true
    }
}

impl Inputs for Shards {
    async fn next(&mut self) -> Option<Input> {
        loop {
            if let Some(input) = self.ready.pop_front() {
                return Some(input);
            }
            let Some(reader) = &mut self.reading else {
                if !self.open_next() {
                    return None;
                }
                continue;
            };
            let step = reader.step().await;
            if reader.ended {
                // Its last chunk is read: the next shard's first is fetched meanwhile.
                self.start_next();
            }
            let mut finish = |sample: Gathered, out: &mut VecDeque<Input>| {
                self.samples += 1;
                out.push_back(sample.into_input(self.samples));
            };
            match step {
                Step::Sample(sample) => finish(sample, &mut self.ready),
                Step::Member => {}
                Step::End { whole, cut, why } => {
                    for sample in whole.into_iter().chain(cut) {
                        finish(sample, &mut self.ready);
                    }
                    if let Some(reason) = why {
                        self.samples += 1;
                        self.ready.push_back(Input::Rejected(shard_reject(
                            self.samples,
                            None,
                            reason,
                        )));
                    }
                    self.reading = None;
                }
            }
        }
    }
}

fn shard_reject(line: u64, id: Option<String>, reason: String) -> Reject {
    Reject {
        line,
        id,
        stage: "shard".into(),
        reason,
    }
}

/// Where a shard's bytes come from.
enum Body {
    /// A regular file of `len` bytes (as it was when opened; growth is not read).
    Local { file: File, len: u64 },
    /// An S3 object, a ranged GET at a time, the next chunk's under way while one is read.
    Remote {
        fetcher: Arc<dyn Fetch>,
        source: ImageSource,
        ahead: Option<ReadAhead>,
    },
}

/// The next chunk of an S3 shard, being fetched.
struct ReadAhead {
    offset: u64,
    task: Option<tokio::task::JoinHandle<Result<Bytes, FetchError>>>,
}

impl ReadAhead {
    /// Its chunk (the task stays here, so a wait cancelled still aborts it on drop).
    async fn wait(&mut self) -> Result<Result<Bytes, FetchError>, tokio::task::JoinError> {
        self.task.as_mut().expect("awaited once").await
    }
}

impl Drop for ReadAhead {
    fn drop(&mut self) {
        // A jump past it, or the shard given up: the fetch is not awaited.
        if let Some(task) = &self.task {
            task.abort();
        }
    }
}

/// One step of a shard's reader.
// (One step a member: moving a few hundred bytes is nothing beside the member's own.)
#[allow(clippy::large_enum_variant)]
enum Step {
    /// A sample ended (the next member has another key).
    Sample(Gathered),
    /// A member was read into the sample being gathered, or skipped.
    Member,
    /// The shard ended: a sample that ended whole with it, the sample it was cut short in
    /// (rejected), and why, when no sample says it (or the rest could not be read).
    End {
        whole: Option<Gathered>,
        cut: Option<Gathered>,
        why: Option<String>,
    },
}

/// One shard's reader: a chunk buffered, the sample being gathered.
struct ShardReader {
    name: Arc<str>,
    body: Body,
    buf: Vec<u8>,
    /// Where in `buf` the unread bytes begin.
    start: usize,
    /// The shard offset of `buf[start]`.
    at: u64,
    /// The body has no more bytes past `buf`.
    ended: bool,
    stats: Arc<ShardStats>,
    max_image_bytes: u64,
    gathering: Option<Gathered>,
    /// The next member's name and size, from a pax header or a GNU long name.
    pending_name: Option<String>,
    pending_size: Option<u64>,
    /// Why the next member's sample cannot be produced (its extended header was refused).
    pending_problem: Option<String>,
    /// Where the next member's extended headers begin: where its sample begins, if it starts
    /// one.
    pending_start: Option<u64>,
    /// Only the samples' bounds are wanted: members are passed over, not read.
    index_only: bool,
    /// Stop (a clean end) at the first sample that begins at or past this offset.
    stop_at: Option<u64>,
}

/// Why a shard's bytes stopped.
enum Cut {
    /// The shard ends here.
    Short,
    /// It could not be read.
    Failed(FetchError),
}

impl ShardReader {
    /// A reader of the shard `name` from byte `at`, where a sample begins.
    fn new(
        name: Arc<str>,
        body: Body,
        at: u64,
        stats: Arc<ShardStats>,
        max_image_bytes: u64,
    ) -> ShardReader {
        ShardReader {
            name,
            body,
            buf: Vec::new(),
            start: 0,
            at,
            ended: false,
            stats,
            max_image_bytes,
            gathering: None,
            pending_name: None,
            pending_size: None,
            pending_problem: None,
            pending_start: None,
            index_only: false,
            stop_at: None,
        }
    }

    fn buffered(&self) -> u64 {
        (self.buf.len() - self.start) as u64
    }

    /// Makes at least `n` unread bytes buffered; false when the shard ends first.
    async fn fill(&mut self, n: u64) -> Result<bool, FetchError> {
        while self.buffered() < n && !self.ended {
            if self.start > 0 {
                self.buf.drain(..self.start);
                self.start = 0;
            }
            let from = self.at + self.buffered();
            let mut want = CHUNK_BYTES.max(n - self.buffered());
            // Room for what is left and a chunk, made once (growing it as it fills would hold
            // the old and the new buffer at once); more only for a member larger than that.
            let room = (self.buffered() + want) as usize;
            if self.buf.capacity() < room {
                self.buf
                    .reserve_exact(room.max(2 * CHUNK_BYTES as usize) - self.buf.len());
            }
            let got = match &mut self.body {
                Body::Local { file, len } => {
                    self.stats.requests.fetch_add(1, Ordering::Relaxed);
                    let want = want.min(len.saturating_sub(from));
                    let old = self.buf.len();
                    self.buf.resize(old + want as usize, 0);
                    let mut filled = 0;
                    while filled < want as usize {
                        match file.read_at(&mut self.buf[old + filled..], from + filled as u64) {
                            Ok(0) => break,
                            Ok(k) => filled += k,
                            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                            Err(e) => {
                                self.buf.truncate(old);
                                return Err(FetchError::Other(format!(
                                    "reading {} at byte {from}: {e}",
                                    self.name
                                )));
                            }
                        }
                    }
                    self.buf.truncate(old + filled);
                    filled as u64
                }
                Body::Remote {
                    fetcher,
                    source,
                    ahead,
                } => {
                    let bytes = match ahead.take() {
                        // The chunk under way holds `from` (after a jump into it, past its start).
                        Some(mut next)
                            if next.offset <= from && from - next.offset < CHUNK_BYTES =>
                        {
                            let into = from - next.offset;
                            want = CHUNK_BYTES - into;
                            let chunk = next.wait().await.map_err(|e| {
                                FetchError::Other(format!("reading {source} at byte {from}: {e}"))
                            })??;
                            chunk.slice((into as usize).min(chunk.len())..)
                        }
                        _ => {
                            self.stats.requests.fetch_add(1, Ordering::Relaxed);
                            fetcher.fetch_range(source, from, want).await?
                        }
                    };
                    if bytes.len() as u64 == want {
                        // Not the end: the next chunk is fetched while this one is read.
                        self.stats.requests.fetch_add(1, Ordering::Relaxed);
                        let (fetcher, source, offset) =
                            (fetcher.clone(), source.clone(), from + want);
                        *ahead = Some(ReadAhead {
                            offset,
                            task: Some(tokio::spawn(async move {
                                fetcher.fetch_range(&source, offset, CHUNK_BYTES).await
                            })),
                        });
                    }
                    self.buf.extend_from_slice(&bytes);
                    bytes.len() as u64
                }
            };
            self.stats.bytes.fetch_add(got, Ordering::Relaxed);
            if got < want {
                self.ended = true;
            }
            self.note_held();
        }
        Ok(self.buffered() >= n)
    }

    fn note_held(&self) {
        let ahead = match &self.body {
            Body::Remote { ahead: Some(_), .. } => CHUNK_BYTES,
            _ => 0,
        };
        let held = self.buf.capacity() as u64
            + ahead
            + self.gathering.as_ref().map_or(0, |g| g.held_bytes());
        self.stats.peak_held.fetch_max(held, Ordering::Relaxed);
    }

    /// The next `n` bytes, or why there are not that many.
    async fn take(&mut self, n: u64) -> Result<Bytes, Cut> {
        match self.fill(n).await {
            Ok(true) => {
                // Copied out, so the sample holds its own bytes, not the chunk's.
                let bytes = Bytes::copy_from_slice(&self.buf[self.start..self.start + n as usize]);
                self.start += n as usize;
                self.at += n;
                if self.buf.capacity() as u64 > 2 * CHUNK_BYTES {
                    // Grown for a large member: given back.
                    self.buf.drain(..self.start);
                    self.start = 0;
                    self.buf.shrink_to(2 * CHUNK_BYTES as usize);
                }
                Ok(bytes)
            }
            Ok(false) => Err(Cut::Short),
            Err(e) => Err(Cut::Failed(e)),
        }
    }

    /// Passes over the next `n` bytes, reading what is buffered and jumping over the rest.
    /// `n` is at most [`MAX_MEMBER_SPAN`], so the offset never overflows.
    fn skip(&mut self, n: u64) {
        if n <= self.buffered() {
            self.start += n as usize;
        } else {
            self.buf.clear();
            self.start = 0;
            // Bytes past the end read as none: the next read finds the shard cut short.
        }
        self.at += n;
    }

    /// Reads the next member (or header) and says what came of it.
    async fn step(&mut self) -> Step {
        let offset = self.at;
        let header = match self.take(BLOCK).await {
            Ok(block) => block,
            // Not even one header's worth.
            Err(Cut::Short) if offset == 0 && self.buffered() > 0 => {
                self.stats.unreadable.fetch_add(1, Ordering::Relaxed);
                let head = &self.buf[self.start..];
                let what = match compressed(head) {
                    Some(kind) => format!("a {kind}-compressed file"),
                    None => format!("{} bytes, less than a tar header", head.len()),
                };
                return Step::End {
                    whole: None,
                    cut: None,
                    why: Some(format!("{}: not a tar file: {what}", self.name)),
                };
            }
            Err(cut) => return self.cut(cut, offset, Reading::Header),
        };
        if offset == 0
            && let Some(kind) = compressed(&header)
        {
            self.stats.unreadable.fetch_add(1, Ordering::Relaxed);
            return Step::End {
                whole: None,
                cut: None,
                why: Some(format!(
                    "{}: a {kind}-compressed file, not a tar file: feedstore reads uncompressed \
                     tar shards (decompress it first)",
                    self.name
                )),
            };
        }
        let header = match parse_header(&header) {
            Ok(Some(h)) => h,
            // End of archive (two blocks of zeros, or one at the end of the file): the sample
            // gathered last is whole.
            Ok(None) => {
                let end = match self.fill(BLOCK).await {
                    Ok(true) => self.buf[self.start..self.start + BLOCK as usize]
                        .iter()
                        .all(|&b| b == 0),
                    _ => true,
                };
                if end {
                    self.pending_problem = None;
                    return Step::End {
                        whole: self.gathering.take(),
                        cut: None,
                        why: None,
                    };
                }
                return self
                    .resync(offset, "a block of zeros amid the members".into())
                    .await;
            }
            Err(why) => return self.resync(offset, why).await,
        };
        let size = self.pending_size.take().unwrap_or(header.size);
        let Some(padded) = size
            .checked_next_multiple_of(BLOCK)
            .filter(|&p| p <= MAX_MEMBER_SPAN)
        else {
            return self.resync(offset, format!("a size of {size} bytes")).await;
        };
        // A local shard's length is known: a member running past it is cut short now, not
        // after a jump past the end.
        if let Body::Local { len, .. } = &self.body
            && offset + BLOCK + size > *len
        {
            let name = self.pending_name.take().unwrap_or(header.name);
            return self.cut(
                Cut::Short,
                offset,
                Reading::Part(format!("member {name} (of {size} bytes)")),
            );
        }
        match header.kind {
            b'x' | b'L' if size > MAX_EXTENDED_HEADER => {
                self.pending_start.get_or_insert(offset);
                self.pending_problem = Some(format!(
                    "an extended header of {size} bytes at byte {offset} (at most \
                     {MAX_EXTENDED_HEADER} are read)"
                ));
                self.skip(padded);
                return Step::Member;
            }
            b'x' | b'L' => {
                self.pending_start.get_or_insert(offset);
                let data = match self.take(padded).await {
                    Ok(d) => d,
                    Err(cut) => {
                        return self.cut(cut, offset, Reading::Part("an extended header".into()));
                    }
                };
                let data = &data[..size as usize];
                if header.kind == b'L' {
                    let end = data.iter().position(|&b| b == 0).unwrap_or(data.len());
                    self.pending_name = Some(String::from_utf8_lossy(&data[..end]).into_owned());
                } else {
                    let (path, size) = parse_pax(data);
                    self.pending_name = path.or(self.pending_name.take());
                    self.pending_size = size;
                }
                return Step::Member;
            }
            b'0' | 0 | b'7' => {}
            // A long link name: for the link that follows, which is skipped.
            b'K' => {
                self.skip(padded);
                return Step::Member;
            }
            // Directories, links, global pax headers and the rest hold no member of a sample
            // (what an extended header said was about this one).
            _ => {
                self.pending_name = None;
                self.pending_problem = None;
                self.pending_start = None;
                self.skip(padded);
                return Step::Member;
            }
        }
        let name = self.pending_name.take().unwrap_or(header.name);
        let name = name.strip_prefix("./").unwrap_or(&name).to_owned();
        let Some((key, suffix)) = split_key(&name).map(|(k, s)| (k.to_owned(), s.to_owned()))
        else {
            self.pending_problem = None;
            self.pending_start = None;
            self.skip(padded);
            return Step::Member;
        };
        let ext = suffix.rsplit('.').next().unwrap_or("").to_ascii_lowercase();
        let kind = match ext.as_str() {
            "json" => Kind::Record,
            "txt" => Kind::Caption,
            e if IMAGE_EXTENSIONS.contains(&e) => Kind::Image,
            _ => Kind::Other,
        };
        let start = self.pending_start.take().unwrap_or(offset);
        let whole = match &self.gathering {
            Some(g) if g.key != key => self.gathering.take(),
            _ => None,
        };
        if self.gathering.is_none() && self.stop_at.is_some_and(|stop| start >= stop) {
            // The next piece's first sample: this piece ends cleanly here.
            return Step::End {
                whole,
                cut: None,
                why: None,
            };
        }
        let new = self.gathering.is_none();
        let shard = self.name.clone();
        let sample = self.gathering.get_or_insert_with(|| Gathered {
            start,
            ..Gathered::new(shard, key, offset)
        });
        if let Some(problem) = self.pending_problem.take() {
            if new {
                sample.carried = Some(problem.clone());
            }
            sample.problem.get_or_insert(problem);
        }
        let problem = match kind {
            Kind::Other => None,
            _ if sample.problem.is_some() => None,
            Kind::Image if size > self.max_image_bytes => Some(format!(
                "member {name} at byte {offset} is {size} bytes, over the {}-byte limit \
                 (--max-image-bytes)",
                self.max_image_bytes
            )),
            Kind::Record | Kind::Caption if size > MAX_LINE_BYTES => Some(format!(
                "member {name} at byte {offset} is {size} bytes, over a record's \
                 {MAX_LINE_BYTES}-byte limit"
            )),
            Kind::Record if sample.json.is_some() => Some(format!("a second .json member, {name}")),
            Kind::Caption if sample.caption.is_some() => {
                Some(format!("a second .txt member, {name}"))
            }
            Kind::Image if sample.images.len() >= MAX_IMAGES_PER_RECORD => Some(format!(
                "more than {MAX_IMAGES_PER_RECORD} images (a record may have at most that many)"
            )),
            _ => None,
        };
        if let Some(problem) = problem {
            sample.problem = Some(problem);
        }
        if kind == Kind::Other || sample.problem.is_some() || self.index_only {
            self.skip(padded);
            return whole.map_or(Step::Member, Step::Sample);
        }
        let data = match self.take(padded).await {
            Ok(d) => d.slice(..size as usize),
            Err(cut) => {
                // The sample that ended before this member is whole; this one is cut.
                let mut step = self.cut(cut, offset, Reading::Part(format!("member {name}")));
                if let Step::End { whole: w, .. } = &mut step {
                    *w = whole;
                }
                return step;
            }
        };
        let sample = self.gathering.as_mut().expect("a sample is being gathered");
        match kind {
            Kind::Record => sample.json = Some(data),
            Kind::Caption => sample.caption = Some(data),
            _ => sample.images.push(ImageMember {
                name,
                suffix,
                offset,
                bytes: data,
            }),
        }
        self.note_held();
        whole.map_or(Step::Member, Step::Sample)
    }

    /// The shard stopped at `offset` while reading `what`: the sample being gathered is
    /// rejected (cut short), and the shard ends, saying why when no sample says it.
    fn cut(&mut self, cut: Cut, offset: u64, what: Reading) -> Step {
        let end = match &self.body {
            Body::Local { len, .. } => *len,
            Body::Remote { .. } => self.at + self.buffered(),
        };
        let (reason, failed) = match cut {
            // Nothing could be read: the shard, not a sample, failed.
            Cut::Failed(e) if offset == 0 && self.gathering.is_none() => {
                self.stats.unreadable.fetch_add(1, Ordering::Relaxed);
                return Step::End {
                    whole: None,
                    cut: None,
                    why: Some(format!("cannot read shard {}: {e}", self.name)),
                };
            }
            Cut::Short if matches!(what, Reading::Header) && self.buffered() == 0 => (
                format!(
                    "the shard ends at byte {offset} without tar's end-of-archive blocks (cut \
                     short?), so a member of the sample it ends in may be missing"
                ),
                false,
            ),
            Cut::Short => (
                format!(
                    "the shard is cut short in {what}, which starts at byte {offset}: the shard \
                     ends at byte {end}"
                ),
                false,
            ),
            Cut::Failed(e) => (format!("cannot read {what} at byte {offset}: {e}"), true),
        };
        if failed {
            self.stats.unreadable.fetch_add(1, Ordering::Relaxed);
        }
        let cut = self.gathering.take().map(|mut g| {
            g.problem.get_or_insert(reason.clone());
            g
        });
        let why = match (&cut, failed) {
            (_, true) => Some(format!(
                "{}: {reason}; the rest of the shard is skipped",
                self.name
            )),
            (None, false) => Some(format!("{}: {reason}", self.name)),
            (Some(_), false) => None,
        };
        Step::End {
            whole: None,
            cut,
            why,
        }
    }

    /// A header at `offset` that does not check out: the sample being gathered is rejected,
    /// and so is the first one after it (the lost member may have been either's); reading goes
    /// on at the next block that is a valid header (or the end of the archive: two blocks of
    /// zeros). A shard with no valid header at all is not a tar file: one reject, no more.
    async fn resync(&mut self, offset: u64, why: String) -> Step {
        let gathered = self.gathering.take();
        self.pending_name = None;
        self.pending_size = None;
        // A sample made of the bad header alone starts where its extended headers did.
        let start = self.pending_start.take().unwrap_or(offset);
        let mut found = false;
        while let Ok(true) = self.fill(BLOCK).await {
            let block = &self.buf[self.start..self.start + BLOCK as usize];
            match parse_header(block) {
                Ok(Some(_)) => found = true,
                Ok(None) => {
                    // The end, unless another block follows that is not zeros.
                    found = match self.fill(2 * BLOCK).await {
                        Ok(true) => {
                            let next = self.start + BLOCK as usize;
                            self.buf[next..next + BLOCK as usize]
                                .iter()
                                .all(|&b| b == 0)
                        }
                        _ => true,
                    };
                }
                Err(_) => {}
            }
            if found {
                break;
            }
            self.skip(BLOCK);
        }
        let corrupt = format!("a corrupt tar header at byte {offset} ({why})");
        if !found && gathered.is_none() && offset == 0 {
            self.stats.unreadable.fetch_add(1, Ordering::Relaxed);
            return Step::End {
                whole: None,
                cut: None,
                why: Some(format!(
                    "{}: not a tar file: no header in it checks out ({why} at byte 0)",
                    self.name
                )),
            };
        }
        let mut sample = gathered.unwrap_or_else(|| Gathered {
            start,
            ..Gathered::new(self.name.clone(), String::new(), offset)
        });
        if found {
            sample.problem = Some(format!("{corrupt}; reading went on at byte {}", self.at));
            self.pending_problem = Some(format!(
                "a member of it may have been lost to {corrupt}, just before it"
            ));
            Step::Sample(sample)
        } else {
            sample.problem = Some(format!("{corrupt}, and no valid header after it"));
            Step::End {
                whole: None,
                cut: Some(sample),
                why: None,
            }
        }
    }
}

/// What a member is to its sample.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Image,
    /// `.json`: the record.
    Record,
    /// `.txt`: a caption.
    Caption,
    Other,
}

/// The compression `block` (a file's first bytes) starts with, if any.
fn compressed(block: &[u8]) -> Option<&'static str> {
    const MAGIC: [(&[u8], &str); 4] = [
        (b"\x1f\x8b", "gzip"),
        (b"\x28\xb5\x2f\xfd", "zstd"),
        (b"BZh", "bzip2"),
        (b"\xfd7zXZ\x00", "xz"),
    ];
    MAGIC
        .iter()
        .find(|(magic, _)| block.starts_with(magic))
        .map(|&(_, kind)| kind)
}

/// What a shard's reader was reading when the shard stopped.
enum Reading {
    /// A member's header, where a shard may end (with its end-of-archive blocks).
    Header,
    /// Anything else, as a reject names it: `member 000017.jpg`.
    Part(String),
}

impl std::fmt::Display for Reading {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Reading::Header => f.write_str("a header"),
            Reading::Part(what) => f.write_str(what),
        }
    }
}

/// A member's key and suffix: `dir/000017.seg.png` is `dir/000017` and `seg.png`. None for a
/// name whose file name has no dot past its first character.
fn split_key(name: &str) -> Option<(&str, &str)> {
    let file_start = name.rfind('/').map_or(0, |i| i + 1);
    let dot = name[file_start..].find('.').filter(|&d| d > 0)? + file_start;
    Some((&name[..dot], &name[dot + 1..]))
}

/// An image member of a sample.
struct ImageMember {
    name: String,
    suffix: String,
    offset: u64,
    bytes: Bytes,
}

/// A sample being gathered from consecutive members with one key.
struct Gathered {
    shard: Arc<str>,
    key: String,
    /// Where its first member's header starts.
    offset: u64,
    /// Where the sample starts: its first member's header, or the extended headers before it.
    start: u64,
    /// The problem it took from the members before it (a header lost just before it), which a
    /// read starting at `start` would not see.
    carried: Option<String>,
    images: Vec<ImageMember>,
    json: Option<Bytes>,
    caption: Option<Bytes>,
    /// Why it cannot be produced, once known.
    problem: Option<String>,
}

impl Gathered {
    fn new(shard: Arc<str>, key: String, offset: u64) -> Gathered {
        Gathered {
            shard,
            key,
            offset,
            start: offset,
            carried: None,
            images: Vec::new(),
            json: None,
            caption: None,
            problem: None,
        }
    }

    fn held_bytes(&self) -> u64 {
        let images: usize = self.images.iter().map(|i| i.bytes.len()).sum();
        (images
            + self.json.as_ref().map_or(0, Bytes::len)
            + self.caption.as_ref().map_or(0, Bytes::len)) as u64
    }

    /// The sample as the pipeline's input: its record and images, or a reject naming its shard
    /// and offset.
    fn into_input(self, line: u64) -> Input {
        let at = match self.key.is_empty() {
            true => format!("{} at byte {}", self.shard, self.offset),
            false => format!(
                "{}: sample {} (from byte {})",
                self.shard, self.key, self.offset
            ),
        };
        let id = (!self.key.is_empty()).then(|| self.key.clone());
        if let Some(problem) = &self.problem {
            return Input::Rejected(shard_reject(line, id, format!("{at}: {problem}")));
        }
        match self.record(line) {
            Ok((mut record, images)) => {
                record.origin = Some(at.into());
                Input::Read(record, images)
            }
            Err(mut reject) => {
                reject.reason = format!("{at}: {}", reject.reason);
                Input::Rejected(reject)
            }
        }
    }

    fn record(self, line: u64) -> Result<(Record, Vec<Bytes>), Reject> {
        let source = |m: &ImageMember| ImageSource::Member {
            shard: self.shard.to_string(),
            name: m.name.clone(),
            offset: m.offset,
        };
        let reject = |reason: String| Reject {
            line,
            id: Some(self.key.clone()),
            stage: "manifest".into(),
            reason,
        };
        // img2dataset's shards: a .json of metadata (url, caption, size) beside the .txt
        // caption; a .json that is a record has a conversation or a text.
        let is_record = |json: &Bytes| {
            serde_json::from_slice::<serde_json::Value>(json).map_or(true, |v| {
                ["conversations", "messages", "text"]
                    .iter()
                    .any(|k| v.get(k).is_some())
            })
        };
        if let Some(json) = self
            .json
            .as_ref()
            .filter(|j| self.caption.is_none() || is_record(j))
        {
            let text = std::str::from_utf8(json)
                .map_err(|e| reject(format!("the .json member is not UTF-8: {e}")))?;
            let mut picked = Vec::new();
            let record =
                crate::manifest::record_from_json(line, text.trim(), Some(&self.key), |refs| {
                    picked = self.pick(refs)?;
                    Ok(picked.iter().map(|&i| source(&self.images[i])).collect())
                })?;
            let images = picked
                .iter()
                .map(|&i| self.images[i].bytes.clone())
                .collect();
            return Ok((record, images));
        }
        let Some(caption) = &self.caption else {
            let members: Vec<&str> = self.images.iter().map(|m| m.name.as_str()).collect();
            return Err(reject(format!(
                "no .json or .txt member (images: {})",
                if members.is_empty() {
                    "none".into()
                } else {
                    members.join(", ")
                }
            )));
        };
        let caption = std::str::from_utf8(caption)
            .map_err(|e| reject(format!("the .txt member is not UTF-8: {e}")))?
            .trim_end()
            .to_owned();
        if self.images.is_empty() {
            return Err(reject(
                "a caption (.txt) with no image (a sample of text alone is a .json with \"text\")"
                    .into(),
            ));
        }
        let placeholders = vec![IMAGE_PLACEHOLDER; self.images.len()].join("\n");
        let content = Content::Conversation(vec![
            Message::new(Role::User, placeholders),
            Message::new(Role::Assistant, caption),
        ]);
        Ok((
            Record {
                line,
                id: self.key.clone(),
                images: self.images.iter().map(source).collect(),
                content,
                tools: None,
                origin: None,
            },
            self.images.iter().map(|m| m.bytes.clone()).collect(),
        ))
    }

    /// The image members a record's references name, in their order (by member name, file
    /// name or suffix), or every image member in the shard's order when it names none.
    fn pick(&self, refs: &[String]) -> Result<Vec<usize>, String> {
        if refs.is_empty() {
            return Ok((0..self.images.len()).collect());
        }
        refs.iter()
            .map(|r| {
                self.images
                    .iter()
                    .position(|m| {
                        m.name == *r
                            || m.name.rsplit('/').next() == Some(r.as_str())
                            || m.suffix.eq_ignore_ascii_case(r)
                    })
                    .ok_or_else(|| {
                        let names: Vec<&str> =
                            self.images.iter().map(|m| m.name.as_str()).collect();
                        format!(
                            "the record names image {r:?}, which the sample does not hold \
                             (its images: {})",
                            if names.is_empty() {
                                "none".into()
                            } else {
                                names.join(", ")
                            }
                        )
                    })
            })
            .collect()
    }
}

/// A tar header's member name, size and type.
#[derive(Debug)]
struct Header {
    name: String,
    size: u64,
    kind: u8,
}

/// The header in a 512-byte block; `None` for a block of zeros (the end of the archive).
fn parse_header(block: &[u8]) -> Result<Option<Header>, String> {
    if block.iter().all(|&b| b == 0) {
        return Ok(None);
    }
    let stored = octal(&block[148..156]).ok_or("its checksum field is not a number")?;
    let unsigned: u64 = block
        .iter()
        .enumerate()
        .map(|(i, &b)| {
            if (148..156).contains(&i) {
                32
            } else {
                u64::from(b)
            }
        })
        .sum();
    let signed: i64 = block
        .iter()
        .enumerate()
        .map(|(i, &b)| {
            if (148..156).contains(&i) {
                32
            } else {
                i64::from(b as i8)
            }
        })
        .sum();
    if stored != unsigned && i64::try_from(stored).ok() != Some(signed) {
        return Err(format!("checksum {stored} stored, {unsigned} computed"));
    }
    let size = if block[124] & 0x80 != 0 {
        // GNU base-256: the rest of the field, big-endian.
        if block[124] & 0x40 != 0 || block[125..128].iter().any(|&b| b != 0) {
            return Err("a size out of range".into());
        }
        block[128..136]
            .iter()
            .fold(0u64, |n, &b| (n << 8) | u64::from(b))
    } else {
        octal(&block[124..136]).ok_or("its size field is not a number")?
    };
    let field = |range: std::ops::Range<usize>| {
        let bytes = &block[range];
        let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
        String::from_utf8_lossy(&bytes[..end]).into_owned()
    };
    let mut name = field(0..100);
    if &block[257..263] == b"ustar\0" {
        let prefix = field(345..500);
        if !prefix.is_empty() {
            name = format!("{prefix}/{name}");
        }
    }
    Ok(Some(Header {
        name,
        size,
        kind: block[156],
    }))
}

/// An octal field: digits between optional spaces, ended by a NUL or space.
fn octal(field: &[u8]) -> Option<u64> {
    let text = std::str::from_utf8(field).ok()?;
    let digits = text.trim_matches(|c: char| c == ' ' || c == '\0');
    if digits.is_empty() {
        return Some(0);
    }
    u64::from_str_radix(digits, 8).ok()
}

/// A pax extended header's `path` and `size` (records `"<len> <key>=<value>\n"`).
fn parse_pax(data: &[u8]) -> (Option<String>, Option<u64>) {
    let (mut path, mut size) = (None, None);
    let mut rest = data;
    while !rest.is_empty() {
        let Some(space) = rest.iter().position(|&b| b == b' ') else {
            break;
        };
        let Some(len) = std::str::from_utf8(&rest[..space])
            .ok()
            .and_then(|l| l.parse::<usize>().ok())
            .filter(|&l| l > space && l <= rest.len())
        else {
            break;
        };
        let record = &rest[space + 1..len];
        let record = record.strip_suffix(b"\n").unwrap_or(record);
        if let Some(eq) = record.iter().position(|&b| b == b'=') {
            let value = String::from_utf8_lossy(&record[eq + 1..]).into_owned();
            match &record[..eq] {
                b"path" => path = Some(value),
                b"size" => size = value.parse().ok(),
                _ => {}
            }
        }
        rest = &rest[len..];
    }
    (path, size)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A ustar header for `name` whose size field is `size_field`, its checksum right.
    fn header(name: &str, size_field: &[u8; 12], kind: u8) -> Vec<u8> {
        let mut block = vec![0u8; 512];
        block[..name.len()].copy_from_slice(name.as_bytes());
        block[124..136].copy_from_slice(size_field);
        block[156] = kind;
        block[257..263].copy_from_slice(b"ustar\0");
        block[148..156].copy_from_slice(b"        ");
        let sum: u64 = block.iter().map(|&b| u64::from(b)).sum();
        block[148..155].copy_from_slice(format!("{sum:06o}\0").as_bytes());
        block
    }

    #[test]
    fn headers_read_octal_and_base_256_sizes_and_refuse_bad_checksums() {
        let h = parse_header(&header("a.jpg", b"00000001750\0", b'0'))
            .unwrap()
            .unwrap();
        assert_eq!((h.name.as_str(), h.size, h.kind), ("a.jpg", 1000, b'0'));
        // GNU base-256: 2^40 bytes.
        let mut big = [0u8; 12];
        big[0] = 0x80;
        big[6] = 1;
        let h = parse_header(&header("b.bin", &big, b'0')).unwrap().unwrap();
        assert_eq!(h.size, 1 << 40);
        // A negative base-256 size is refused.
        big[0] = 0xff;
        assert!(parse_header(&header("c.bin", &big, b'0')).is_err());
        let mut bad = header("a.jpg", b"00000001750\0", b'0');
        bad[0] = b'b';
        assert!(parse_header(&bad).unwrap_err().contains("checksum"));
        assert!(parse_header(&[0u8; 512]).unwrap().is_none());
        assert!(parse_header(&header("d", b"0000000zz50\0", b'0')).is_err());
    }

    #[test]
    fn pax_records_give_path_and_size_and_stop_at_a_bad_one() {
        let data = b"27 path=dir/000001.seg.png\n12 size=999\n13 mtime=1.5\n99 bad";
        assert_eq!(
            parse_pax(data),
            (Some("dir/000001.seg.png".into()), Some(999))
        );
        assert_eq!(parse_pax(b"5 x\n"), (None, None));
        assert_eq!(parse_pax(b"999999999999999999999 path=x\n"), (None, None));
    }

    #[test]
    fn keys_end_at_the_first_dot_of_the_file_name() {
        assert_eq!(split_key("000017.jpg"), Some(("000017", "jpg")));
        assert_eq!(
            split_key("a.b/dir/000017.seg.png"),
            Some(("a.b/dir/000017", "seg.png"))
        );
        assert_eq!(split_key("dir/.hidden"), None);
        assert_eq!(split_key("README"), None);
    }
}
