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
//! images' placeholders, the assistant's turn the caption (text alone when there is no image).
//! Other members are skipped unread.
//!
//! A shard is never held whole: [`Shards`] keeps one chunk ([`CHUNK_BYTES`], one ranged GET from
//! S3, with the next one's GET under way while it is read) plus the sample being gathered, each member bounded (images by `--max-image-bytes`,
//! records by the manifest's line limit), so memory is bounded however large the shard. What
//! goes wrong rejects the sample it happened in, with its shard and byte offset, never the run:
//! a member over its limit, a corrupt header (reading goes on at the next header that checks
//! out), a shard cut short (the sample it ends in; a shard must end with tar's end-of-archive
//! blocks), a shard that cannot be read (one reject for the rest of it).

use std::collections::VecDeque;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;

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
/// `{train,val}-{0..3}.tar`), or `@FILE`, a file listing them (one per line, `#` comments;
/// relative paths against the file's folder).
pub fn shard_list(specs: &[String]) -> Result<Vec<Shard>, String> {
    let mut shards = Vec::new();
    for spec in specs {
        match spec.strip_prefix('@') {
            Some(list) => {
                let text = read_list(Path::new(list))?;
                let folder = Path::new(list).parent().unwrap_or(Path::new(""));
                for line in text.lines().map(str::trim) {
                    if line.is_empty() || line.starts_with('#') {
                        continue;
                    }
                    for name in expand(line, MAX_SHARDS - shards.len())? {
                        let shard = Shard::parse(&name)?;
                        shards.push(match shard {
                            Shard::Local(p) if p.is_relative() => Shard::Local(folder.join(p)),
                            other => other,
                        });
                    }
                }
            }
            None => {
                for name in expand(spec, MAX_SHARDS - shards.len())? {
                    shards.push(Shard::parse(&name)?);
                }
            }
        }
    }
    if shards.is_empty() {
        return Err("no shard named".into());
    }
    Ok(shards)
}

/// A shard list file's text (at most 64 MiB, a regular file).
fn read_list(path: &Path) -> Result<String, String> {
    use std::io::Read;
    const MAX: u64 = 64 << 20;
    let mut bytes = Vec::new();
    crate::input::open_regular(path)
        .and_then(|f| f.take(MAX + 1).read_to_end(&mut bytes))
        .map_err(|e| format!("reading the shard list {}: {e}", path.display()))?;
    if bytes.len() as u64 > MAX {
        return Err(format!(
            "the shard list {} is over {} MiB",
            path.display(),
            MAX >> 20
        ));
    }
    String::from_utf8(bytes).map_err(|_| format!("the shard list {} is not text", path.display()))
}

/// Expands the brace patterns in `pattern` (`{000..127}`: numbers, zero-padded to the first's
/// width; `{a,b}`: alternatives), to at most `limit` names.
pub fn expand(pattern: &str, limit: usize) -> Result<Vec<String>, String> {
    let Some(open) = pattern.find('{') else {
        if pattern.contains('}') {
            return Err(format!("{pattern:?}: a '}}' without its '{{'"));
        }
        return Ok(vec![pattern.to_owned()]);
    };
    let close = pattern[open..]
        .find('}')
        .map(|c| open + c)
        .ok_or_else(|| format!("{pattern:?}: a '{{' without its '}}'"))?;
    let body = &pattern[open + 1..close];
    if body.contains('{') {
        return Err(format!("{pattern:?}: nested braces are not expanded"));
    }
    let choices: Vec<String> = match body.split_once("..") {
        Some((from, to)) => {
            let parse = |n: &str| {
                n.parse::<u64>()
                    .map_err(|_| format!("{pattern:?}: {{{body}}} is not a range of numbers"))
            };
            let (a, b) = (parse(from)?, parse(to)?);
            if a > b {
                return Err(format!("{pattern:?}: {{{body}}} is an empty range"));
            }
            if b - a >= limit as u64 {
                return Err(format!("{pattern:?} names over {limit} shards"));
            }
            let width = if from.starts_with('0') { from.len() } else { 0 };
            (a..=b).map(|n| format!("{n:0width$}")).collect()
        }
        None => body.split(',').map(str::to_owned).collect(),
    };
    let rest = expand(&pattern[close + 1..], limit)?;
    if choices.len().saturating_mul(rest.len()) > limit {
        return Err(format!("{pattern:?} names over {limit} shards"));
    }
    let head = &pattern[..open];
    let mut names = Vec::with_capacity(choices.len() * rest.len());
    for choice in &choices {
        for tail in &rest {
            names.push(format!("{head}{choice}{tail}"));
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
    /// The most bytes a shard's reader held at once: its buffer and the sample being gathered.
    pub peak_held: AtomicU64,
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
        }
    }

    /// What reading has taken so far.
    pub fn stats(&self) -> Arc<ShardStats> {
        self.stats.clone()
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
                ahead: None,
            },
        };
        self.reading = Some(ShardReader {
            name,
            body,
            buf: Vec::new(),
            start: 0,
            at: 0,
            ended: false,
            stats: self.stats.clone(),
            max_image_bytes: self.max_image_bytes,
            gathering: None,
            pending_name: None,
            pending_size: None,
            pending_problem: None,
        });
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
    async fn wait(mut self) -> Result<Result<Bytes, FetchError>, tokio::task::JoinError> {
        self.task.take().expect("awaited once").await
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
}

/// Why a shard's bytes stopped.
enum Cut {
    /// The shard ends here.
    Short,
    /// It could not be read.
    Failed(FetchError),
}

impl ShardReader {
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
                        Some(next) if next.offset == from => {
                            want = CHUNK_BYTES;
                            next.wait().await.map_err(|e| {
                                FetchError::Other(format!("reading {source} at byte {from}: {e}"))
                            })??
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
                let bytes = Bytes::copy_from_slice(&self.buf[self.start..self.start + n as usize]);
                self.start += n as usize;
                self.at += n;
                Ok(bytes)
            }
            Ok(false) => Err(Cut::Short),
            Err(e) => Err(Cut::Failed(e)),
        }
    }

    /// Passes over the next `n` bytes, reading what is buffered and jumping over the rest.
    fn skip(&mut self, n: u64) {
        if n <= self.buffered() {
            self.start += n as usize;
        } else {
            self.buf.clear();
            self.start = 0;
            // A file's bytes past its end read as none: the next read finds the shard cut short.
        }
        self.at += n;
    }

    /// Reads the next member (or header) and says what came of it.
    async fn step(&mut self) -> Step {
        let offset = self.at;
        let header = match self.take(BLOCK).await {
            Ok(block) => block,
            Err(cut) => return self.cut(cut, offset, "a header"),
        };
        let header = match parse_header(&header) {
            Ok(Some(h)) => h,
            // End of archive: the sample gathered last is whole.
            Ok(None) => {
                return Step::End {
                    whole: self.gathering.take(),
                    cut: None,
                    why: None,
                };
            }
            Err(why) => return self.resync(offset, why).await,
        };
        let size = self.pending_size.take().unwrap_or(header.size);
        let padded = size.next_multiple_of(BLOCK);
        match header.kind {
            b'x' | b'L' if size > MAX_EXTENDED_HEADER => {
                self.pending_problem = Some(format!(
                    "an extended header of {size} bytes at byte {offset} (at most \
                     {MAX_EXTENDED_HEADER} are read)"
                ));
                self.skip(padded);
                return Step::Member;
            }
            b'x' | b'L' => {
                let data = match self.take(padded).await {
                    Ok(d) => d,
                    Err(cut) => return self.cut(cut, offset, "an extended header"),
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
            // Directories, links, global pax headers and the rest hold no member of a sample.
            _ => {
                self.pending_name = None;
                self.skip(padded);
                return Step::Member;
            }
        }
        let name = self.pending_name.take().unwrap_or(header.name);
        let name = name.strip_prefix("./").unwrap_or(&name).to_owned();
        let Some((key, suffix)) = split_key(&name).map(|(k, s)| (k.to_owned(), s.to_owned()))
        else {
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
        let whole = match &self.gathering {
            Some(g) if g.key != key => self.gathering.take(),
            _ => None,
        };
        let shard = self.name.clone();
        let sample = self
            .gathering
            .get_or_insert_with(|| Gathered::new(shard, key, offset));
        if let Some(problem) = self.pending_problem.take() {
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
        if kind == Kind::Other || sample.problem.is_some() {
            self.skip(padded);
            return whole.map_or(Step::Member, Step::Sample);
        }
        let data = match self.take(padded).await {
            Ok(d) => d.slice(..size as usize),
            Err(cut) => {
                // The sample that ended before this member is whole; this one is cut.
                let mut step = self.cut(cut, offset, &format!("member {name}"));
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
    fn cut(&mut self, cut: Cut, offset: u64, what: &str) -> Step {
        let (reason, failed) = match cut {
            Cut::Short if what == "a header" && self.buffered() == 0 => (
                format!(
                    "the shard ends at byte {offset} without tar's end-of-archive blocks: cut \
                     short?"
                ),
                false,
            ),
            Cut::Short => (
                format!("the shard is cut short in {what} at byte {offset}"),
                false,
            ),
            Cut::Failed(e) => (format!("cannot read {what} at byte {offset}: {e}"), true),
        };
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
    /// and reading goes on at the next block that is a valid header (or the end of the
    /// archive: two blocks of zeros).
    async fn resync(&mut self, offset: u64, why: String) -> Step {
        let mut sample = self
            .gathering
            .take()
            .unwrap_or_else(|| Gathered::new(self.name.clone(), String::new(), offset));
        self.pending_name = None;
        self.pending_size = None;
        self.pending_problem = None;
        while let Ok(true) = self.fill(BLOCK).await {
            let block = &self.buf[self.start..self.start + BLOCK as usize];
            match parse_header(block) {
                Ok(Some(_)) => break,
                Ok(None) => {
                    // The end, unless another block follows that is not zeros.
                    let end = match self.fill(2 * BLOCK).await {
                        Ok(true) => {
                            let next = self.start + BLOCK as usize;
                            self.buf[next..next + BLOCK as usize]
                                .iter()
                                .all(|&b| b == 0)
                        }
                        _ => true,
                    };
                    if end {
                        break;
                    }
                }
                Err(_) => {}
            }
            self.skip(BLOCK);
        }
        sample.problem = Some(format!(
            "a corrupt tar header at byte {offset} ({why}); reading went on at byte {}",
            self.at
        ));
        Step::Sample(sample)
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
        let at = format!("{} at byte {}", self.shard, self.offset);
        let id = (!self.key.is_empty()).then(|| self.key.clone());
        if let Some(problem) = &self.problem {
            return Input::Rejected(shard_reject(line, id, format!("{at}: {problem}")));
        }
        match self.record(line) {
            Ok((record, images)) => Input::Read(record, images),
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
        if let Some(json) = &self.json {
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
        let content = if self.images.is_empty() {
            Content::Text(caption)
        } else {
            let placeholders = vec![IMAGE_PLACEHOLDER; self.images.len()].join("\n");
            Content::Conversation(vec![
                Message::new(Role::User, placeholders),
                Message::new(Role::Assistant, caption),
            ])
        };
        Ok((
            Record {
                line,
                id: self.key.clone(),
                images: self.images.iter().map(source).collect(),
                content,
                tools: None,
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
