//! Parquet files, as Hugging Face `datasets` writes them (LLaVA-OneVision, ShareGPT4V exports,
//! The Cauldron): each row is a record, its columns what a manifest line's keys would be
//! (`id`, `conversations`, `messages`, `text`, `image`, `images`), read a row group at a time.
//!
//! ```text
//! train-00000-of-00004.parquet   id   image {bytes, path}   conversations [{from, value}]
//!                                 └──────── one row: one sample ─────────┘
//! ```
//!
//! Images are `datasets`' `Image` columns: a struct `{bytes, path}`, alone or in a list. One with
//! bytes is the image (named by its column, `image` or `images[1]`); one with only a path names
//! a file or `s3://` object as a manifest's path would. A row's record is its columns as JSON,
//! each image replaced by its name, parsed exactly as a manifest line; its images are those its
//! `image`/`images` name, or every image it holds in column order when it names none.
//!
//! A file is read where it is (a file on this node through `pread`, an S3 object through ranged
//! GETs with the image fetcher's retries): its footer (at most [`MAX_FOOTER_BYTES`]), then one
//! row group at a time, every column chunk of it in one read (at most [`MAX_ROW_GROUP_BYTES`];
//! from S3, the next row group's GETs run while one is decoded).
//! Before a page of it is decoded, every page header is read here and its sizes checked: no
//! page may state more than [`PAGE_LIMIT`] uncompressed, nor more than its codec can inflate its
//! bytes to (the parquet crate makes room for what a header states, up to 2 GiB, before it
//! decompresses); only codecs whose output that size bounds are read (snappy, zstd, lz4_raw,
//! none), and a schema nested deeper than [`MAX_SCHEMA_DEPTH`] is refused before the crate
//! builds it by recursion. So memory is bounded by two row groups' bytes (the one decoded and,
//! from S3, the next), a page per column and the rows in flight, however large the file. A row
//! group that cannot be read (a corrupt page, a limit passed, a panic in the decoder) is one
//! reject naming file, row group and rows; a file that cannot be read is one reject; both count
//! in [`TableStats::unreadable`], so the run can fail at its end.
//!
//! Decoding runs on a thread of its own (the parquet crate's reads are blocking), a row at a
//! time into a channel of one: the pipeline's permits bound what is read ahead.

use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::{Buf, Bytes};
use parquet::basic::Compression;
use parquet::errors::ParquetError;
use parquet::file::metadata::page_index::RowGroupPageIndex;
use parquet::file::metadata::{ParquetMetaData, ParquetMetaDataReader};
use parquet::file::properties::ReaderProperties;
use parquet::file::reader::{ChunkReader, Length};
use parquet::file::serialized_reader::SerializedRowGroupReader;
use parquet::record::reader::RowIter;
use parquet::record::{Field, Row};
use serde_json::{Map, Value};

use crate::chat::IMAGE_PLACEHOLDER;
use crate::manifest::{MAX_IMAGES_PER_RECORD, Reject};
use crate::pipeline::{Input, Inputs};
use crate::shards::Shard;
use crate::source::{Fetch, ImageSource};

/// The longest footer read (the file's schema and row group index).
pub const MAX_FOOTER_BYTES: u64 = 16 << 20;

/// What is read of a file's end first: its footer, most often whole.
const TAIL_BYTES: u64 = 64 << 10;

/// The most one ranged GET of an S3 file asks for (a row group takes several, in turn).
pub const GET_BYTES: u64 = 16 << 20;

/// The most bytes one row group's column chunks may hold: a row group is read whole.
pub const MAX_ROW_GROUP_BYTES: u64 = 1 << 30;

/// The most bytes a page may state uncompressed [default]. Writers put many values in a page
/// (pyarrow checks its page size only every 1,024 values, so a row group of 100 images is often
/// one page): this bounds what decoding a page may take, whatever its header says.
pub const PAGE_LIMIT: u64 = 256 << 20;

/// Below this, any page size is let through whatever its codec (the ratio check is for bombs,
/// not for pages of a few values).
const RATIO_FLOOR: u64 = 64 << 10;

/// How deep the JSON a row becomes, or a page header, may nest.
const MAX_DEPTH: u32 = 64;

/// How deep a file's schema may nest (`datasets`' deepest types are a few levels).
pub const MAX_SCHEMA_DEPTH: usize = 32;

/// What reading has taken so far.
#[derive(Debug, Default)]
pub struct TableStats {
    /// Reads issued (ranged GETs for S3 files).
    pub requests: AtomicU64,
    /// Bytes read.
    pub bytes: AtomicU64,
    /// Row groups read whole.
    pub row_groups: AtomicU64,
    /// The most bytes one row group's read held.
    pub peak_row_group: AtomicU64,
    /// Files, or row groups of them, that could not be read (their rows are missing).
    pub unreadable: AtomicU64,
}

/// The rows of a list of Parquet files, read in order, as the pipeline's [`Inputs`]: a record
/// with its images' bytes (or paths) per row, a reject per row or row group that went wrong.
pub struct ParquetFiles {
    files: Vec<Shard>,
    fetcher: Arc<dyn Fetch>,
    max_image_bytes: u64,
    page_limit: u64,
    image_root: PathBuf,
    stats: Arc<TableStats>,
    rows: Option<tokio::sync::mpsc::Receiver<Input>>,
}

impl std::fmt::Debug for ParquetFiles {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ParquetFiles")
            .field("files", &self.files.len())
            .finish_non_exhaustive()
    }
}

impl ParquetFiles {
    /// Reads `files` in order, S3 ones through `fetcher`; images of at most `max_image_bytes`;
    /// image paths in rows resolve against `image_root`.
    pub fn new(
        files: Vec<Shard>,
        fetcher: Arc<dyn Fetch>,
        max_image_bytes: u64,
        image_root: PathBuf,
    ) -> ParquetFiles {
        ParquetFiles {
            files,
            fetcher,
            max_image_bytes,
            page_limit: PAGE_LIMIT,
            image_root,
            stats: Arc::default(),
            rows: None,
        }
    }

    /// The most bytes a page may state uncompressed [default: [`PAGE_LIMIT`]].
    pub fn with_page_limit(mut self, bytes: u64) -> ParquetFiles {
        self.page_limit = bytes;
        self
    }

    /// What reading has taken so far.
    pub fn stats(&self) -> Arc<TableStats> {
        self.stats.clone()
    }
}

impl Inputs for ParquetFiles {
    async fn next(&mut self) -> Option<Input> {
        if self.rows.is_none() {
            // Started on the pipeline's IO runtime, whose handle the reader's S3 reads use.
            let (tx, rx) = tokio::sync::mpsc::channel(1);
            let reader = Reader {
                fetcher: self.fetcher.clone(),
                runtime: tokio::runtime::Handle::current(),
                page_limit: self.page_limit,
                max_image_bytes: self.max_image_bytes,
                image_root: self.image_root.clone(),
                stats: self.stats.clone(),
                tx,
                line: 0,
            };
            let files = std::mem::take(&mut self.files);
            let spawned = std::thread::Builder::new()
                .name("feedstore-parquet".into())
                // Decoding recurses along the schema (at most MAX_SCHEMA_DEPTH levels).
                .stack_size(8 << 20)
                .spawn(move || reader.read_all(files));
            if let Err(e) = spawned {
                self.stats.unreadable.fetch_add(1, Ordering::Relaxed);
                return Some(Input::Rejected(table_reject(
                    1,
                    None,
                    format!("cannot start the Parquet reader's thread: {e}"),
                )));
            }
            self.rows = Some(rx);
        }
        self.rows.as_mut()?.recv().await
    }
}

fn table_reject(line: u64, id: Option<String>, reason: String) -> Reject {
    Reject {
        line,
        id,
        stage: "parquet".into(),
        reason,
    }
}

/// Why reading stopped.
enum Halt {
    /// The pipeline went away: nothing more is wanted.
    Gone,
    /// What could not be read, and why.
    Failed(String),
}

impl From<String> for Halt {
    fn from(reason: String) -> Halt {
        Halt::Failed(reason)
    }
}

/// The reader's thread: the files in order, a row at a time into the channel.
struct Reader {
    fetcher: Arc<dyn Fetch>,
    runtime: tokio::runtime::Handle,
    page_limit: u64,
    max_image_bytes: u64,
    image_root: PathBuf,
    stats: Arc<TableStats>,
    tx: tokio::sync::mpsc::Sender<Input>,
    /// Rows numbered so far: a row's `line`.
    line: u64,
}

impl Reader {
    fn read_all(mut self, files: Vec<Shard>) {
        // The next S3 file's end (its footer) is read while this one is decoded.
        let mut opening = files.first().and_then(|f| self.start_open(f));
        for (i, file) in files.iter().enumerate() {
            let this = opening.take();
            opening = files.get(i + 1).and_then(|f| self.start_open(f));
            match self.read_file(file, this) {
                Ok(()) => {}
                Err(Halt::Gone) => return,
                Err(Halt::Failed(reason)) => {
                    self.stats.unreadable.fetch_add(1, Ordering::Relaxed);
                    self.line += 1;
                    let reject = table_reject(self.line, None, format!("{file}: {reason}"));
                    if self.send(Input::Rejected(reject)).is_err() {
                        return;
                    }
                }
            }
        }
    }

    fn send(&self, input: Input) -> Result<(), Halt> {
        self.tx.blocking_send(input).map_err(|_| Halt::Gone)
    }

    /// Starts reading an S3 file's end: its last [`TAIL_BYTES`] and its length, in one GET.
    fn start_open(&self, file: &Shard) -> Option<AbortOnDrop<(Bytes, u64)>> {
        let Shard::S3 { bucket, key } = file else {
            return None;
        };
        let source = ImageSource::S3 {
            bucket: bucket.clone(),
            key: key.clone(),
        };
        let (fetcher, stats) = (self.fetcher.clone(), self.stats.clone());
        Some(AbortOnDrop(Some(self.runtime.spawn(async move {
            stats.requests.fetch_add(1, Ordering::Relaxed);
            let (tail, len) = fetcher
                .fetch_tail(&source, TAIL_BYTES)
                .await
                .map_err(|e| e.to_string())?;
            stats.bytes.fetch_add(tail.len() as u64, Ordering::Relaxed);
            Ok((tail, len))
        }))))
    }

    fn read_file(
        &mut self,
        file: &Shard,
        opening: Option<AbortOnDrop<(Bytes, u64)>>,
    ) -> Result<(), Halt> {
        let body = Body::open(file, opening, &self.runtime)?;
        let source = Source {
            body,
            fetcher: self.fetcher.clone(),
            runtime: self.runtime.clone(),
            stats: self.stats.clone(),
        };
        let metadata = source.footer()?;
        let name: Arc<str> = file.to_string().into();
        let file_name = name.rsplit('/').next().unwrap_or(&name).to_owned();
        let mut row = 0u64;
        // The next row group's read is under way while one is decoded.
        let groups = metadata.num_row_groups();
        let mut next = (groups > 0).then(|| source.start_row_group(&metadata, 0));
        for group in 0..groups {
            let end = rows_before(&metadata, group + 1);
            let current = next.take().expect("started");
            next = (group + 1 < groups).then(|| source.start_row_group(&metadata, group + 1));
            let read =
                current.and_then(|pending| source.finish_row_group(pending, self.page_limit));
            let outcome = match read {
                Ok(bytes) => {
                    self.stats.row_groups.fetch_add(1, Ordering::Relaxed);
                    self.rows_of(&metadata, group, bytes, &name, &file_name, &mut row)
                }
                Err(reason) => Err(Halt::Failed(reason)),
            };
            match outcome {
                Ok(()) => {}
                Err(Halt::Gone) => return Err(Halt::Gone),
                Err(Halt::Failed(reason)) => {
                    // The rest of the row group is lost (one reject; its rows keep their
                    // numbers); the file goes on at the next.
                    self.stats.unreadable.fetch_add(1, Ordering::Relaxed);
                    let line = self.line + 1;
                    self.line += end.saturating_sub(row).max(1);
                    let reason = format!("{name}: row group {group} (rows {row}..{end}): {reason}");
                    row = end;
                    self.send(Input::Rejected(table_reject(line, None, reason)))?;
                }
            }
        }
        Ok(())
    }

    /// The rows of one row group, each sent as it is made.
    fn rows_of(
        &mut self,
        metadata: &ParquetMetaData,
        group: usize,
        bytes: RowGroupBytes,
        name: &Arc<str>,
        file_name: &str,
        row: &mut u64,
    ) -> Result<(), Halt> {
        let properties = Arc::new(
            ReaderProperties::builder()
                .set_read_bloom_filter(false)
                .set_read_page_statistics(false)
                .build(),
        );
        let group_meta = metadata.row_group(group);
        // A file that passed every check may still hold what the decoder panics on: that
        // loses the row group, not the run.
        let decoded = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let reader = SerializedRowGroupReader::new(
                Arc::new(bytes),
                group_meta,
                RowGroupPageIndex::new(group, None),
                properties,
            )
            .map_err(|e| Halt::Failed(e.to_string()))?;
            let rows =
                RowIter::from_row_group(None, &reader).map_err(|e| Halt::Failed(e.to_string()))?;
            for next in rows {
                let parsed = next.map_err(|e| Halt::Failed(e.to_string()))?;
                self.line += 1;
                let origin = format!("{name}: row {} (row group {group})", *row);
                let id = format!("{file_name}:{}", *row);
                *row += 1;
                let input = match self.row_input(parsed, &id, name) {
                    Ok(Input::Read(mut record, images)) => {
                        record.origin = Some(origin.into());
                        Input::Read(record, images)
                    }
                    Ok(Input::Record(mut record)) => {
                        record.origin = Some(origin.into());
                        Input::Record(record)
                    }
                    Ok(rejected) => rejected,
                    Err(mut reject) => {
                        reject.reason = format!("{origin}: {}", reject.reason);
                        Input::Rejected(reject)
                    }
                };
                self.send(input)?;
            }
            Ok(())
        }));
        match decoded {
            Ok(outcome) => outcome,
            Err(panic) => {
                let said = panic
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "a panic".into());
                Err(Halt::Failed(format!("the decoder gave up: {said}")))
            }
        }
    }

    /// A row as the pipeline's input: its record with its images' bytes, or with the paths it
    /// names (fetched as a manifest's are).
    fn row_input(&self, row: Row, default_id: &str, file: &Arc<str>) -> Result<Input, Reject> {
        let line = self.line;
        // The row's own id where it has one, for a reject before its record is made.
        let id = row
            .get_column_iter()
            .find(|(name, _)| *name == "id")
            .and_then(|(_, field)| match field {
                Field::Str(s) if !s.is_empty() => Some(s.clone()),
                Field::Int(v) => Some(v.to_string()),
                Field::Long(v) => Some(v.to_string()),
                _ => None,
            })
            .unwrap_or_else(|| default_id.to_owned());
        let reject = |reason: String| Reject {
            line,
            id: Some(id.clone()),
            stage: "manifest".into(),
            reason,
        };
        let mut images = Images::default();
        let mut object = Map::new();
        for (column, field) in row.into_columns() {
            let value = images
                .json(&field, &column, 0, self.max_image_bytes)
                .map_err(reject)?;
            object.insert(column, value);
        }
        if images.held.len() > MAX_IMAGES_PER_RECORD {
            return Err(reject(format!(
                "{} images; a record may have at most {MAX_IMAGES_PER_RECORD}",
                images.held.len()
            )));
        }
        caption_as_conversation(&mut object, images.held.len());
        let text = Value::Object(object).to_string();
        let mut picked = Vec::new();
        let record = crate::manifest::record_from_json(line, &text, Some(default_id), |refs| {
            if images.held.is_empty() {
                // Paths only: sources as a manifest's, fetched by the pipeline.
                return refs
                    .iter()
                    .map(|r| crate::manifest::image_source(&self.image_root, r))
                    .collect();
            }
            picked = images.pick(refs)?;
            Ok(picked
                .iter()
                .map(|&i| ImageSource::Member {
                    shard: file.to_string(),
                    name: images.held[i].0.clone(),
                    offset: line,
                })
                .collect())
        })?;
        Ok(match images.held.is_empty() {
            true => Input::Record(record),
            false => {
                let bytes = picked.iter().map(|&i| images.held[i].1.clone()).collect();
                Input::Read(record, bytes)
            }
        })
    }
}

/// The images a row holds, named as its record names them.
#[derive(Default)]
struct Images {
    /// (name, bytes) of each image with bytes, in column order.
    held: Vec<(String, Bytes)>,
}

impl Images {
    /// The field as JSON; an `Image` struct becomes its name (bytes kept here) or its path.
    fn json(
        &mut self,
        field: &Field,
        at: &str,
        depth: u32,
        max_image_bytes: u64,
    ) -> Result<Value, String> {
        if depth > MAX_DEPTH {
            return Err(format!("column {at} nests deeper than {MAX_DEPTH}"));
        }
        Ok(match field {
            Field::Null => Value::Null,
            Field::Bool(b) => Value::Bool(*b),
            Field::Byte(v) => (*v).into(),
            Field::Short(v) => (*v).into(),
            Field::Int(v) | Field::Date(v) | Field::TimeMillis(v) => (*v).into(),
            Field::Long(v)
            | Field::TimeMicros(v)
            | Field::TimestampMillis(v)
            | Field::TimestampMicros(v) => (*v).into(),
            Field::UByte(v) => (*v).into(),
            Field::UShort(v) => (*v).into(),
            Field::UInt(v) => (*v).into(),
            Field::ULong(v) => (*v).into(),
            Field::Float16(v) => float(f64::from(*v)),
            Field::Float(v) => float(f64::from(*v)),
            Field::Double(v) => float(*v),
            Field::Decimal(d) => Value::String(format!("{d:?}")),
            Field::Str(s) => Value::String(s.clone()),
            // Binary that is not an image's: text when it is UTF-8, else nothing a record uses.
            Field::Bytes(b) => match std::str::from_utf8(b.data()) {
                Ok(s) => Value::String(s.to_owned()),
                Err(_) => Value::Null,
            },
            Field::Group(row) => match image(row) {
                Some((Some(bytes), _)) => {
                    if bytes.len() as u64 > max_image_bytes {
                        return Err(format!(
                            "column {at}: an image of {} bytes, over the {max_image_bytes}-byte \
                             limit (--max-image-bytes)",
                            bytes.len()
                        ));
                    }
                    // One copy, so a row does not pin its page.
                    self.held
                        .push((at.to_owned(), Bytes::copy_from_slice(bytes)));
                    Value::String(at.to_owned())
                }
                Some((None, Some(path))) => Value::String(path.to_owned()),
                Some((None, None)) => Value::Null,
                None => {
                    let mut object = Map::new();
                    for (name, field) in row.get_column_iter() {
                        let value =
                            self.json(field, &format!("{at}.{name}"), depth + 1, max_image_bytes)?;
                        object.insert(name.clone(), value);
                    }
                    Value::Object(object)
                }
            },
            Field::ListInternal(list) => Value::Array(
                list.elements()
                    .iter()
                    .enumerate()
                    .map(|(i, f)| self.json(f, &format!("{at}[{i}]"), depth + 1, max_image_bytes))
                    .collect::<Result<_, _>>()?,
            ),
            Field::MapInternal(map) => {
                let mut object = Map::new();
                for (key, value) in map.entries() {
                    let key = match self.json(key, at, depth + 1, max_image_bytes)? {
                        Value::String(s) => s,
                        other => other.to_string(),
                    };
                    let value =
                        self.json(value, &format!("{at}.{key}"), depth + 1, max_image_bytes)?;
                    object.insert(key, value);
                }
                Value::Object(object)
            }
        })
    }

    /// The held images a record's references name, in their order; every held image when it
    /// names none.
    fn pick(&self, refs: &[String]) -> Result<Vec<usize>, String> {
        if refs.is_empty() {
            return Ok((0..self.held.len()).collect());
        }
        refs.iter()
            .map(|r| {
                self.held
                    .iter()
                    .position(|(name, _)| name == r)
                    .ok_or_else(|| {
                        let names: Vec<&str> = self.held.iter().map(|(n, _)| n.as_str()).collect();
                        format!(
                            "the record names image {r:?}, not one of the images its row holds \
                         ({}): a row's images are all bytes or all paths",
                            names.join(", ")
                        )
                    })
            })
            .collect()
    }
}

/// A row of images and a caption (`caption`, or `text`) with no conversation, as captioning
/// data sets are (LAION's, Conceptual Captions'): the images, then the caption as the reply,
/// as a WebDataset sample's `.txt` is.
fn caption_as_conversation(object: &mut Map<String, Value>, held: usize) {
    if held == 0 || object.contains_key("conversations") || object.contains_key("messages") {
        return;
    }
    let images = match (object.get("image"), object.get("images")) {
        (_, Some(Value::Array(images))) => {
            images.len() + usize::from(object.get("image").is_some_and(Value::is_string))
        }
        (Some(Value::String(_)), _) => 1,
        _ => held,
    };
    let caption = ["caption", "text"]
        .into_iter()
        .find_map(|key| match object.get(key) {
            Some(Value::String(caption)) => Some((key, caption.clone())),
            _ => None,
        });
    if let Some((key, caption)) = caption {
        object.remove(key);
        object.insert(
            "conversations".into(),
            serde_json::json!([
                {"from": "human", "value": vec![IMAGE_PLACEHOLDER; images].join("\n")},
                {"from": "gpt", "value": caption},
            ]),
        );
    }
}

/// A JSON number, or null for NaN and infinities (JSON has none).
fn float(v: f64) -> Value {
    serde_json::Number::from_f64(v).map_or(Value::Null, Value::Number)
}

/// A `datasets` `Image` struct's bytes and path: a group of exactly the fields `bytes` (binary
/// or null) and `path` (text or null). `None` for any other group.
fn image(row: &Row) -> Option<(Option<&[u8]>, Option<&str>)> {
    let (mut bytes, mut path, mut fields) = (None, None, 0);
    for (name, field) in row.get_column_iter() {
        fields += 1;
        match (name.as_str(), field) {
            ("bytes", Field::Bytes(b)) => bytes = Some(b.data()),
            ("path", Field::Str(s)) => path = Some(s.as_str()).filter(|s| !s.is_empty()),
            ("bytes" | "path", Field::Null) => {}
            _ => return None,
        }
    }
    (fields == 2).then_some((bytes, path))
}

/// Where a file's bytes come from.
enum Body {
    /// A regular file on this node, `len` bytes when opened.
    Local { file: std::fs::File, len: u64 },
    /// An S3 object of `len` bytes, whose end (`tail`) was read first.
    Remote {
        source: ImageSource,
        len: u64,
        tail: Bytes,
    },
}

impl Body {
    /// Opens a local file, or waits for an S3 file's end (`opening`).
    fn open(
        file: &Shard,
        opening: Option<AbortOnDrop<(Bytes, u64)>>,
        runtime: &tokio::runtime::Handle,
    ) -> Result<Body, String> {
        match file {
            Shard::Local(path) => {
                let file =
                    crate::input::open_regular(path).map_err(|e| format!("cannot open: {e}"))?;
                let len = file.metadata().map_err(|e| e.to_string())?.len();
                Ok(Body::Local { file, len })
            }
            Shard::S3 { bucket, key } => {
                let source = ImageSource::S3 {
                    bucket: bucket.clone(),
                    key: key.clone(),
                };
                let mut opening = opening.expect("an S3 file's end is read before it is opened");
                let task = opening.0.take().expect("awaited once");
                let (tail, len) = runtime
                    .block_on(task)
                    .map_err(|e| format!("the read was lost: {e}"))??;
                Ok(Body::Remote { source, len, tail })
            }
        }
    }

    fn len(&self) -> u64 {
        match self {
            Body::Local { len, .. } | Body::Remote { len, .. } => *len,
        }
    }
}

/// A file being read, with what reading it takes.
struct Source {
    body: Body,
    fetcher: Arc<dyn Fetch>,
    runtime: tokio::runtime::Handle,
    stats: Arc<TableStats>,
}

impl Source {
    /// `len` bytes from `offset`, all of them: one `pread`, or ranged GETs of at most
    /// [`GET_BYTES`] each, one after another (a row group is one buffer).
    fn read(&self, offset: u64, len: u64) -> Result<Bytes, String> {
        match &self.body {
            Body::Local { file, .. } => {
                self.stats.requests.fetch_add(1, Ordering::Relaxed);
                let mut buf = vec![0; len as usize];
                file.read_exact_at(&mut buf, offset)
                    .map_err(|e| format!("reading {len} bytes at byte {offset}: {e}"))?;
                self.stats.bytes.fetch_add(len, Ordering::Relaxed);
                Ok(Bytes::from(buf))
            }
            Body::Remote { source, .. } => self.runtime.block_on(read_remote(
                self.fetcher.clone(),
                source.clone(),
                self.stats.clone(),
                offset,
                len,
            )),
        }
    }

    /// Starts reading `len` bytes from `offset`: an S3 file's GETs run on the IO runtime
    /// while the thread decodes what it has; a local file's `pread` waits for [`Pending::wait`].
    fn start(&self, offset: u64, len: u64) -> Pending {
        match &self.body {
            Body::Local { .. } => Pending::Later { offset, len },
            Body::Remote { source, .. } => {
                Pending::Running(AbortOnDrop(Some(self.runtime.spawn(read_remote(
                    self.fetcher.clone(),
                    source.clone(),
                    self.stats.clone(),
                    offset,
                    len,
                )))))
            }
        }
    }

    /// The file's metadata, from its footer: the file's last [`TAIL_BYTES`] in one read, and
    /// the rest of a footer longer than that in another.
    fn footer(&self) -> Result<ParquetMetaData, String> {
        let len = self.body.len();
        if len < 12 {
            return Err(format!("not a Parquet file ({len} bytes)"));
        }
        let tail = match &self.body {
            Body::Remote { tail, .. } => tail.clone(),
            Body::Local { .. } => self.read(len - len.min(TAIL_BYTES), len.min(TAIL_BYTES))?,
        };
        let tail_len = tail.len() as u64;
        if tail_len < 12 {
            return Err(format!(
                "not a Parquet file (its end came back as {tail_len} bytes)"
            ));
        }
        let end = &tail[tail.len() - 8..];
        match &end[4..] {
            b"PAR1" => {}
            b"PARE" => {
                return Err(
                    "an encrypted Parquet file (its footer is encrypted), which \
                            feedstore does not read"
                        .into(),
                );
            }
            _ => return Err("not a Parquet file (it does not end in PAR1)".into()),
        }
        let footer_len = u64::from(u32::from_le_bytes(end[..4].try_into().expect("4 bytes")));
        if footer_len > MAX_FOOTER_BYTES {
            return Err(format!(
                "its footer states {footer_len} bytes, over the {MAX_FOOTER_BYTES}-byte limit"
            ));
        }
        if footer_len + 12 > len {
            return Err(format!(
                "its footer states {footer_len} bytes, more than the file's {len} hold"
            ));
        }
        let footer = match footer_len + 8 <= tail_len {
            true => tail.slice((tail_len - 8 - footer_len) as usize..(tail_len - 8) as usize),
            false => self.read(len - 8 - footer_len, footer_len)?,
        };
        // The crate builds the schema's tree by recursion, as deep as the footer says: checked
        // first, so a footer of nested groups cannot overflow the stack.
        if schema_depth(&footer).map_err(|e| format!("its footer cannot be read: {e}"))?
            > MAX_SCHEMA_DEPTH
        {
            return Err(format!(
                "its schema nests deeper than {MAX_SCHEMA_DEPTH} levels, which feedstore does \
                 not read"
            ));
        }
        ParquetMetaDataReader::decode_metadata(&footer)
            .map_err(|e| format!("its footer cannot be read: {e}"))
    }

    /// Starts reading row group `group`'s column chunks, in one piece, once where each lies in
    /// the file and its codec are checked.
    fn start_row_group(
        &self,
        metadata: &ParquetMetaData,
        group: usize,
    ) -> Result<PendingGroup, String> {
        let file_len = self.body.len();
        let data_end = file_len.saturating_sub(8);
        let mut chunks: Vec<Chunk> = Vec::new();
        for column in metadata.row_group(group).columns() {
            let path = column.column_path().string();
            // How far the codec can inflate a page: snappy at most ~21x (a 64-byte copy in 3
            // bytes), lz4 ~255x, none 1x; zstd is bounded only by the limit.
            let ratio = match column.compression() {
                Compression::UNCOMPRESSED => 1,
                Compression::SNAPPY => 32,
                Compression::LZ4_RAW => 256,
                Compression::ZSTD(_) => u64::MAX,
                other => {
                    return Err(format!(
                        "column {path} is compressed with {other}, which feedstore does not \
                         read (its pages inflate to no stated bound); write the file with \
                         snappy or zstd"
                    ));
                }
            };
            let start = column
                .dictionary_page_offset()
                .unwrap_or(column.data_page_offset());
            let size = column.compressed_size();
            let (Ok(start), Ok(size)) = (u64::try_from(start), u64::try_from(size)) else {
                return Err(format!(
                    "column {path} states a negative offset or size ({start}, {size})"
                ));
            };
            if start.checked_add(size).is_none_or(|end| end > data_end) {
                return Err(format!(
                    "column {path} states bytes {start}..+{size}, past the file's data \
                     ({data_end} bytes)"
                ));
            }
            chunks.push((path, start, size, ratio, column.compression()));
        }
        let lo = chunks.iter().map(|c| c.1).min().unwrap_or(0);
        let hi = chunks.iter().map(|c| c.1 + c.2).max().unwrap_or(0);
        if hi - lo > MAX_ROW_GROUP_BYTES {
            return Err(format!(
                "its column chunks span {} bytes, over the {MAX_ROW_GROUP_BYTES}-byte limit \
                 on a row group (write the file with smaller row groups)",
                hi - lo
            ));
        }
        Ok(PendingGroup {
            chunks,
            lo,
            read: self.start(lo, hi - lo),
        })
    }

    /// The row group `pending` reads, once every page header in it is checked.
    fn finish_row_group(
        &self,
        pending: PendingGroup,
        page_limit: u64,
    ) -> Result<RowGroupBytes, String> {
        let PendingGroup { chunks, lo, read } = pending;
        let bytes = match read {
            Pending::Later { offset, len } => self.read(offset, len)?,
            Pending::Running(mut task) => {
                let handle = task.0.take().expect("awaited once");
                self.runtime
                    .block_on(handle)
                    .map_err(|e| format!("the read was lost: {e}"))??
            }
        };
        let (file_len, hi) = (self.body.len(), lo + bytes.len() as u64);
        self.stats
            .peak_row_group
            .fetch_max(hi - lo, Ordering::Relaxed);
        for (path, start, size, ratio, codec) in &chunks {
            let from = (start - lo) as usize;
            let limit = Limit {
                bytes: page_limit,
                ratio: *ratio,
                codec: *codec,
            };
            check_pages(&bytes[from..from + *size as usize], *start, &limit)
                .map_err(|e| format!("column {path}: {e}"))?;
        }
        Ok(RowGroupBytes {
            file_len,
            base: lo,
            bytes,
        })
    }
}

/// A column chunk of a row group: (its path, offset, size, the most its codec inflates a page,
/// the codec).
type Chunk = (String, u64, u64, u64, Compression);

/// A row group being read.
struct PendingGroup {
    chunks: Vec<Chunk>,
    /// The file offset of its first byte.
    lo: u64,
    read: Pending,
}

/// A read started.
enum Pending {
    /// A local file's, made when waited for.
    Later { offset: u64, len: u64 },
    /// An S3 file's GETs, under way on the IO runtime.
    Running(AbortOnDrop),
}

/// A read's task, aborted if it is dropped unawaited (the reader stopped, or a row group
/// failed before it).
struct AbortOnDrop<T = Bytes>(Option<tokio::task::JoinHandle<Result<T, String>>>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        if let Some(task) = &self.0 {
            task.abort();
        }
    }
}

/// `len` bytes of an S3 file from `offset`, all of them, in ranged GETs of at most
/// [`GET_BYTES`] one after another.
async fn read_remote(
    fetcher: Arc<dyn Fetch>,
    source: ImageSource,
    stats: Arc<TableStats>,
    offset: u64,
    len: u64,
) -> Result<Bytes, String> {
    let get = async |at: u64, n: u64| {
        stats.requests.fetch_add(1, Ordering::Relaxed);
        let got = fetcher
            .fetch_range(&source, at, n)
            .await
            .map_err(|e| e.to_string())?;
        match got.len() as u64 == n {
            true => Ok(got),
            false => Err(format!(
                "{n} bytes at byte {at} came back as {}: the object changed while it was read",
                got.len()
            )),
        }
    };
    let bytes = if len <= GET_BYTES {
        get(offset, len).await?
    } else {
        let mut buf = Vec::with_capacity(len as usize);
        let mut at = offset;
        while at < offset + len {
            let n = GET_BYTES.min(offset + len - at);
            buf.extend_from_slice(&get(at, n).await?);
            at += n;
        }
        Bytes::from(buf)
    };
    stats.bytes.fetch_add(len, Ordering::Relaxed);
    Ok(bytes)
}

/// The rows of the row groups before `group`.
fn rows_before(metadata: &ParquetMetaData, group: usize) -> u64 {
    metadata.row_groups()[..group.min(metadata.num_row_groups())]
        .iter()
        .map(|g| g.num_rows().max(0) as u64)
        .fold(0, u64::saturating_add)
}

/// A row group's bytes, which its page readers read: any byte outside them is an error.
struct RowGroupBytes {
    file_len: u64,
    /// The file offset of `bytes[0]`.
    base: u64,
    bytes: Bytes,
}

impl RowGroupBytes {
    fn slice(&self, start: u64, len: Option<usize>) -> Result<Bytes, ParquetError> {
        let outside = || {
            ParquetError::General(format!(
                "byte {start} (+{len:?}) lies outside the row group's column chunks"
            ))
        };
        let from = start
            .checked_sub(self.base)
            .filter(|&f| f <= self.bytes.len() as u64)
            .ok_or_else(outside)? as usize;
        let to = match len {
            None => self.bytes.len(),
            Some(n) => from
                .checked_add(n)
                .filter(|&t| t <= self.bytes.len())
                .ok_or_else(outside)?,
        };
        Ok(self.bytes.slice(from..to))
    }
}

impl Length for RowGroupBytes {
    fn len(&self) -> u64 {
        self.file_len
    }
}

impl ChunkReader for RowGroupBytes {
    type T = bytes::buf::Reader<Bytes>;

    fn get_read(&self, start: u64) -> Result<Self::T, ParquetError> {
        Ok(self.slice(start, None)?.reader())
    }

    fn get_bytes(&self, start: u64, length: usize) -> Result<Bytes, ParquetError> {
        self.slice(start, Some(length))
    }
}

/// What a page of a column chunk may state uncompressed.
struct Limit {
    /// At most this many bytes.
    bytes: u64,
    /// At most this many times its compressed size (past [`RATIO_FLOOR`]).
    ratio: u64,
    codec: Compression,
}

/// Checks every page header of a column chunk (`chunk`, from file offset `at`): each page lies
/// within the chunk and states no more bytes uncompressed than `limit` allows.
fn check_pages(chunk: &[u8], at: u64, limit: &Limit) -> Result<(), String> {
    let mut offset = 0usize;
    while offset < chunk.len() {
        let here = at + offset as u64;
        let (uncompressed, compressed, header) = page_sizes(&chunk[offset..])
            .map_err(|e| format!("the page header at byte {here}: {e}"))?;
        if uncompressed > limit.bytes {
            return Err(format!(
                "the page at byte {here} states {uncompressed} bytes uncompressed, over the \
                 {}-byte limit on a page",
                limit.bytes
            ));
        }
        if uncompressed > compressed.saturating_mul(limit.ratio).max(RATIO_FLOOR) {
            return Err(format!(
                "the page at byte {here} states {uncompressed} bytes uncompressed from \
                 {compressed}, more than {} inflates to",
                limit.codec
            ));
        }
        offset = header
            .checked_add(compressed as usize)
            .and_then(|n| offset.checked_add(n))
            .filter(|&end| end <= chunk.len())
            .ok_or_else(|| {
                format!("the page at byte {here} ({compressed} bytes) runs past its column chunk")
            })?;
    }
    Ok(())
}

/// How deep the schema in a footer (Thrift's `FileMetaData`, field 2: the schema's elements in
/// depth-first order, each group with its `num_children`, field 5) nests, counted without
/// building it; past [`MAX_SCHEMA_DEPTH`] the count stops (at one more).
fn schema_depth(footer: &[u8]) -> Result<usize, String> {
    let mut thrift = Compact {
        bytes: footer,
        at: 0,
    };
    const TOO_DEEP: &str = "too deep";
    let mut deepest = 0;
    let read = thrift.fields(0, |thrift, id, kind| {
        if (id, kind) != (2, 9) || deepest > 0 {
            return thrift.skip(kind, 1);
        }
        let header = thrift.byte()?;
        let size = match header >> 4 {
            15 => thrift.varint()?,
            n => u64::from(n),
        };
        if header & 0x0f != 12 || size > (thrift.bytes.len() - thrift.at) as u64 {
            return Err("a schema that is not a list of elements".into());
        }
        // The children each open group has still to come.
        let mut open: Vec<i64> = Vec::new();
        for _ in 0..size {
            let mut children = 0;
            thrift.fields(1, |thrift, id, kind| match (id, kind) {
                (5, 5) => {
                    children = thrift.zigzag()?;
                    Ok(())
                }
                _ => thrift.skip(kind, 2),
            })?;
            if let Some(left) = open.last_mut() {
                *left -= 1;
            }
            if children > 0 {
                open.push(children);
                deepest = deepest.max(open.len());
                if deepest > MAX_SCHEMA_DEPTH {
                    return Err(TOO_DEEP.into());
                }
            }
            while open.last().is_some_and(|&left| left <= 0) {
                open.pop();
            }
        }
        deepest = deepest.max(1);
        Ok(())
    });
    match read {
        Err(e) if e == TOO_DEEP => Ok(MAX_SCHEMA_DEPTH + 1),
        Err(e) => Err(e),
        Ok(()) => Ok(deepest),
    }
}

/// A page header's uncompressed and compressed sizes (its fields 2 and 3, i32) and its length,
/// read as Thrift's compact protocol; every other field is skipped.
fn page_sizes(bytes: &[u8]) -> Result<(u64, u64, usize), String> {
    let mut thrift = Compact { bytes, at: 0 };
    let (mut uncompressed, mut compressed) = (None, None);
    thrift.fields(0, |thrift, id, kind| match (id, kind) {
        (2 | 3, 5) => {
            let v = thrift.zigzag()?;
            let v = u64::try_from(v).map_err(|_| format!("a negative page size ({v})"))?;
            match id {
                2 => uncompressed = Some(v),
                _ => compressed = Some(v),
            }
            Ok(())
        }
        _ => thrift.skip(kind, 1),
    })?;
    match (uncompressed, compressed) {
        (Some(u), Some(c)) => Ok((u, c, thrift.at)),
        _ => Err("no page sizes in it".into()),
    }
}

/// Thrift's compact protocol, read as far as a page header needs.
struct Compact<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl Compact<'_> {
    fn byte(&mut self) -> Result<u8, String> {
        let b = *self.bytes.get(self.at).ok_or("cut short")?;
        self.at += 1;
        Ok(b)
    }

    fn varint(&mut self) -> Result<u64, String> {
        let mut value = 0u64;
        for shift in (0..70).step_by(7) {
            let b = self.byte()?;
            value |= u64::from(b & 0x7f) << shift.min(63);
            if b & 0x80 == 0 {
                return Ok(value);
            }
        }
        Err("a varint over 10 bytes".into())
    }

    fn zigzag(&mut self) -> Result<i64, String> {
        let v = self.varint()?;
        Ok((v >> 1) as i64 ^ -((v & 1) as i64))
    }

    fn advance(&mut self, n: u64) -> Result<(), String> {
        self.at = usize::try_from(n)
            .ok()
            .and_then(|n| self.at.checked_add(n))
            .filter(|&end| end <= self.bytes.len())
            .ok_or("cut short")?;
        Ok(())
    }

    /// A struct's fields, each handed to `field` (id, type) to read or skip, to its stop.
    fn fields(
        &mut self,
        depth: u32,
        mut field: impl FnMut(&mut Self, i64, u8) -> Result<(), String>,
    ) -> Result<(), String> {
        let mut id = 0i64;
        loop {
            let header = self.byte()?;
            if header == 0 {
                return Ok(());
            }
            let (delta, kind) = (header >> 4, header & 0x0f);
            id = match delta {
                0 => self.zigzag()?,
                d => id + i64::from(d),
            };
            if depth > MAX_DEPTH {
                return Err("nested too deep".into());
            }
            field(self, id, kind)?;
        }
    }

    /// Skips a value of type `kind`.
    fn skip(&mut self, kind: u8, depth: u32) -> Result<(), String> {
        if depth > MAX_DEPTH {
            return Err("nested too deep".into());
        }
        match kind {
            // A field's booleans live in its header.
            1 | 2 => Ok(()),
            3 => self.advance(1),
            4..=6 => self.varint().map(drop),
            7 => self.advance(8),
            8 => {
                let len = self.varint()?;
                self.advance(len)
            }
            9 | 10 => {
                let header = self.byte()?;
                let size = match header >> 4 {
                    15 => self.varint()?,
                    n => u64::from(n),
                };
                let element = header & 0x0f;
                // Every element takes a byte at least: a size past the bytes left is a lie.
                if size > (self.bytes.len() - self.at) as u64 {
                    return Err(format!("a list of {size} elements in fewer bytes"));
                }
                for _ in 0..size {
                    match element {
                        1 | 2 => self.advance(1)?,
                        kind => self.skip(kind, depth + 1)?,
                    }
                }
                Ok(())
            }
            11 => {
                let size = self.varint()?;
                if size == 0 {
                    return Ok(());
                }
                if size > (self.bytes.len() - self.at) as u64 {
                    return Err(format!("a map of {size} entries in fewer bytes"));
                }
                let kinds = self.byte()?;
                for _ in 0..size {
                    for kind in [kinds >> 4, kinds & 0x0f] {
                        match kind {
                            1 | 2 => self.advance(1)?,
                            kind => self.skip(kind, depth + 1)?,
                        }
                    }
                }
                Ok(())
            }
            12 => self.fields(depth + 1, |thrift, _, kind| thrift.skip(kind, depth + 1)),
            other => Err(format!("an unknown Thrift type {other}")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn page_headers_are_read_for_their_sizes_and_lies_refused() {
        // type=DATA_PAGE(0), uncompressed=300, compressed=200, a data page header struct with
        // a binary and a list inside, then stop.
        let mut header = vec![0x15, 0x00, 0x15, 0xd8, 0x04, 0x15, 0x90, 0x03];
        header.extend([
            0x2c, 0x18, 0x02, b'h', b'i', 0x19, 0x25, 0x02, 0x04, 0x00, 0x00,
        ]);
        assert_eq!(page_sizes(&header), Ok((300, 200, header.len())));
        // Cut anywhere, it is refused, never read past.
        for cut in 0..header.len() {
            assert!(page_sizes(&header[..cut]).is_err(), "cut at {cut}");
        }
        // A negative size; a list claiming more elements than bytes.
        assert!(
            page_sizes(&[0x25, 0x01, 0x00])
                .unwrap_err()
                .contains("negative")
        );
        assert!(
            page_sizes(&[0x19, 0xf5, 0xff, 0xff, 0xff, 0x0f])
                .unwrap_err()
                .contains("elements")
        );
        // Structs nested past the bound.
        let deep = vec![0x1c; 200];
        assert!(page_sizes(&deep).unwrap_err().contains("deep"));
    }

    #[test]
    fn a_schema_is_measured_without_recursion() {
        // FileMetaData { version: 1, schema: [n elements, each a group of one child] }.
        let footer = |n: u32, children: u8| {
            let mut bytes = vec![0x15, 0x02, 0x19, 0xfc];
            let mut v = n;
            while v >= 0x80 {
                bytes.push(v as u8 | 0x80);
                v >>= 7;
            }
            bytes.push(v as u8);
            for _ in 0..n {
                bytes.extend([0x55, children * 2, 0x00]);
            }
            bytes.push(0x00);
            bytes
        };
        assert_eq!(schema_depth(&footer(100_000, 1)), Ok(MAX_SCHEMA_DEPTH + 1));
        assert_eq!(schema_depth(&footer(5, 1)), Ok(5));
        assert_eq!(schema_depth(&footer(3, 0)), Ok(1));
        // A list longer than the bytes behind it.
        let mut cut = footer(100, 1);
        cut.truncate(50);
        assert!(schema_depth(&cut).is_err());
    }

    #[test]
    fn pages_must_fit_their_chunk_and_the_limit() {
        // A page header stating `u` bytes uncompressed and `c` compressed, then its `c` bytes.
        let page = |u: u64, c: u64| {
            let mut bytes = vec![0x15, 0x00];
            for (field, v) in [(0x15u8, u), (0x15, c)] {
                bytes.push(field);
                let mut z = v << 1;
                while z >= 0x80 {
                    bytes.push(z as u8 | 0x80);
                    z >>= 7;
                }
                bytes.push(z as u8);
            }
            bytes.push(0x00);
            bytes.resize(bytes.len() + c as usize, 0);
            bytes
        };
        let limit = |bytes, codec| Limit {
            bytes,
            ratio: 32,
            codec,
        };
        let mut chunk = page(10, 3);
        chunk.extend(page(5, 2));
        assert_eq!(
            check_pages(&chunk, 100, &limit(10, Compression::SNAPPY)),
            Ok(())
        );
        assert!(
            check_pages(&chunk, 100, &limit(9, Compression::SNAPPY))
                .unwrap_err()
                .contains("byte 100")
        );
        assert!(
            check_pages(
                &chunk[..chunk.len() - 1],
                100,
                &limit(10, Compression::SNAPPY)
            )
            .unwrap_err()
            .contains("runs past")
        );
        // Past the floor, a page may not state more than its codec inflates to.
        let bomb = page(RATIO_FLOOR + 1, 100);
        assert!(
            check_pages(&bomb, 0, &limit(1 << 30, Compression::SNAPPY))
                .unwrap_err()
                .contains("more than SNAPPY inflates to")
        );
        assert_eq!(
            check_pages(&page(3200, 100), 0, &limit(1 << 30, Compression::SNAPPY)),
            Ok(())
        );
    }
}
