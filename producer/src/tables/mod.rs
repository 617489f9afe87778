//! Parquet files, as Hugging Face `datasets` writes them (LLaVA-OneVision, ShareGPT4V exports,
//! The Cauldron): each row is a record, its columns what a manifest line's keys would be
//! (`id`, `conversations`, `messages`, `text`, `image`, `images`; or The Cauldron's `texts`, or a
//! caption beside images: `as_conversation`), read a row group at a time.
//!
//! ```text
//! train-00000-of-00004.parquet   id   image {bytes, path}   conversations [{from, value}]
//!                                 └──────── one row: one sample ─────────┘
//! ```
//!
//! Images are `datasets`' `Image` columns: a struct `{bytes, path}`, alone or in a list (or plain
//! binary in an `image` column or `images` list). One with bytes is the image (named by its
//! column, `image` or `images[1]`); one with only a path names a file or `s3://` object as a
//! manifest's path would. A row's record is its columns as JSON, each image replaced by its name,
//! parsed exactly as a manifest line; its images are those its `image`/`images` name, or every
//! image it holds in column order when it names none.
//!
//! A file is read where it is (a file on this node through `pread`, an S3 object through ranged
//! GETs with the image fetcher's retries): its footer (at most [`MAX_FOOTER_BYTES`]), then one
//! row group at a time, every column chunk of it in one read (at most [`MAX_ROW_GROUP_BYTES`];
//! from S3, the next row group's GETs run while one is decoded). The parquet crate trusts what
//! a file states (it makes room for a page's stated size, and a dictionary's stated values,
//! before it decodes; it builds the schema by recursion), so what it will trust is read here
//! first, strictly, as it will read it: the schema's depth ([`MAX_SCHEMA_DEPTH`]) and columns
//! ([`MAX_COLUMNS`]); a row group's rows ([`MAX_ROWS_PER_GROUP`]), codecs (snappy, zstd, lz4_raw,
//! none: those whose output the stated size bounds) and chunks; every page header's sizes
//! ([`PAGE_LIMIT`], and no more than its codec inflates to) and values; and what decoding the
//! row group holds at once ([`DECODE_BUDGET`]), and only encodings decoded within a page's bytes.
//! So memory is bounded by two row groups' bytes (the one decoded and, from S3, the next), that
//! budget and the rows in flight, however large the file, as far as the crate allocates what
//! these checks cover: it runs in this process, and a hazard in it that they miss could still
//! end the run (a decoder in a memory-limited process of its own would contain any). A row group that cannot be read (a check, a decode error, a panic in
//! the decoder) is one reject naming file, row group and rows; a file that cannot be read is one
//! reject; both count in [`TableStats::unreadable`], so the run can fail at its end.
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
use parquet::file::metadata::{ParquetMetaData, ParquetMetaDataOptions, ParquetMetaDataReader};
use parquet::file::properties::ReaderProperties;
use parquet::file::reader::{ChunkReader, Length};
use parquet::file::serialized_reader::SerializedRowGroupReader;
use parquet::record::reader::RowIter;
use parquet::record::{Field, Row};
use serde_json::{Map, Value};

mod rows;

pub use crate::pieces::{DEFAULT_CACHE_BYTES, PieceIndex, ReadStats};
pub use rows::{OPEN_FILES, ParquetRows};

use crate::chat::IMAGE_PLACEHOLDER;
use crate::manifest::{MAX_IMAGES_PER_RECORD, MAX_LINE_BYTES, Reject};
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
/// (pyarrow checks its page size only every 1,024 values, so a row group of 100 images is one
/// page): a page may be as large as a row group.
pub const PAGE_LIMIT: u64 = MAX_ROW_GROUP_BYTES;

/// The most a row group's decoding may hold at once, as its page headers state it: every
/// column's dictionary and largest page, with room for their values.
pub const DECODE_BUDGET: u64 = 2 << 30;

/// The most rows a row group may hold (every row becomes a sample or a reject).
pub const MAX_ROWS_PER_GROUP: u64 = 1 << 20;

/// The most leaf columns a file may have (each gets its own reader and buffers).
pub const MAX_COLUMNS: usize = 1024;

/// The most values a column chunk's data pages may state together.
const MAX_VALUES_PER_CHUNK: u64 = 1 << 24;

/// The most values a dictionary page may state.
const MAX_DICTIONARY_VALUES: u64 = 1 << 22;

/// What the crate holds per dictionary value (a `ByteArray`), and per value of a row being
/// built (a record `Field`), for the decode budget.
const DICTIONARY_VALUE_BYTES: u64 = 32;
const ROW_VALUE_BYTES: u64 = 48;

/// Below this, any page size is let through whatever its codec (the ratio check is for bombs,
/// not for pages of a few values).
const RATIO_FLOOR: u64 = 64 << 10;

/// How deep the JSON a row becomes, or a page header, may nest.
const MAX_DEPTH: u32 = 64;

/// The longest id a reject carries (a row's `id` column may hold anything).
const MAX_ID_BYTES: usize = 256;

/// The longest fixed-length byte array a schema may declare.
const MAX_TYPE_LENGTH: i32 = 1 << 16;

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
    /// Set by the reader's thread when it has read every file (or was told to stop): a channel
    /// closed before that means the thread died, which the run must hear of.
    done: Arc<std::sync::atomic::AtomicBool>,
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
            done: Arc::default(),
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
                maker: RowMaker {
                    max_image_bytes: self.max_image_bytes,
                    image_root: self.image_root.clone(),
                },
                stats: self.stats.clone(),
                tx,
                line: 0,
                done: self.done.clone(),
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
        let next = self.rows.as_mut()?.recv().await;
        if next.is_none() && !self.done.swap(true, Ordering::SeqCst) {
            self.stats.unreadable.fetch_add(1, Ordering::Relaxed);
            return Some(Input::Rejected(table_reject(
                0,
                None,
                "the Parquet reader's thread stopped before the last file's end: the rows after \
                 it are missing"
                    .into(),
            )));
        }
        next
    }
}

fn table_reject(line: u64, id: Option<String>, reason: String) -> Reject {
    Reject {
        line,
        id,
        stage: "parquet".into(),
        reason: bounded(reason),
    }
}

/// A reason cut to 1 KiB: the crate's errors may quote a value whole (an invalid string's
/// every byte).
fn bounded(mut reason: String) -> String {
    if reason.len() > 1024 {
        let cut = feedstore_proto::truncate(&reason, 1024).len();
        reason.truncate(cut);
        reason.push_str("...");
    }
    reason
}

/// What a caught panic said.
fn panicked(panic: &(dyn std::any::Any + Send)) -> String {
    let said = panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic".into());
    format!("the Parquet decoder gave up: {said}")
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
    maker: RowMaker,
    stats: Arc<TableStats>,
    tx: tokio::sync::mpsc::Sender<Input>,
    /// Rows numbered so far: a row's `line`.
    line: u64,
    done: Arc<std::sync::atomic::AtomicBool>,
}

impl Reader {
    fn read_all(mut self, files: Vec<Shard>) {
        self.read_files(files);
        // Before the channel closes (with `self`), so the pipeline never sees it closed early.
        self.done.store(true, Ordering::SeqCst);
    }

    fn read_files(&mut self, files: Vec<Shard>) {
        // The next S3 file's end (its footer) is read while this one is decoded.
        let mut opening = files.first().and_then(|f| self.start_open(f));
        for (i, file) in files.iter().enumerate() {
            let this = opening.take();
            opening = files.get(i + 1).and_then(|f| self.start_open(f));
            // A file that passed every check may still hold what the parquet crate panics on:
            // that loses the file (one reject), not the run.
            let read = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                self.read_file(file, this)
            }))
            .unwrap_or_else(|panic| Err(Halt::Failed(panicked(&*panic))));
            match read {
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

    fn start_open(&self, file: &Shard) -> Option<AbortOnDrop<(Bytes, u64)>> {
        start_open(file, &self.fetcher, &self.stats, &self.runtime)
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
        let (metadata, _) = source.footer()?;
        let name: Arc<str> = file.to_string().into();
        let mut row = 0u64;
        // The next row group's read is under way while one is decoded.
        let groups = metadata.num_row_groups();
        let mut next = (groups > 0).then(|| source.start_row_group(&metadata, 0));
        let mut end = 0u64;
        for group in 0..groups {
            // The rows before the next row group.
            end = end.saturating_add(metadata.row_group(group).num_rows().max(0) as u64);
            let current = next.take().expect("started");
            next = (group + 1 < groups).then(|| source.start_row_group(&metadata, group + 1));
            let read =
                current.and_then(|pending| source.finish_row_group(pending, self.page_limit));
            let outcome = match read {
                Ok(bytes) => {
                    self.stats.row_groups.fetch_add(1, Ordering::Relaxed);
                    let tx = &self.tx;
                    self.maker.decode(
                        &metadata,
                        group,
                        bytes,
                        &name,
                        &mut row,
                        &mut self.line,
                        |input| tx.blocking_send(input).map_err(|_| Halt::Gone),
                    )
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
                    self.line = self.line.saturating_add(end.saturating_sub(row).max(1));
                    let reason = match end > row + 1 {
                        true => format!(
                            "{name}: row group {group} (rows {row} to {}): {reason}",
                            end - 1
                        ),
                        false => format!("{name}: row group {group} (row {row}): {reason}"),
                    };
                    row = end;
                    self.send(Input::Rejected(table_reject(line, None, reason)))?;
                }
            }
        }
        Ok(())
    }
}

/// Starts reading an S3 file's end on `runtime`: its last [`TAIL_BYTES`] and its length, in one
/// GET (`None` for a local file).
fn start_open(
    file: &Shard,
    fetcher: &Arc<dyn Fetch>,
    stats: &Arc<TableStats>,
    runtime: &tokio::runtime::Handle,
) -> Option<AbortOnDrop<(Bytes, u64)>> {
    let Shard::S3 { bucket, key } = file else {
        return None;
    };
    let source = ImageSource::S3 {
        bucket: bucket.clone(),
        key: key.clone(),
    };
    let (fetcher, stats) = (fetcher.clone(), stats.clone());
    Some(AbortOnDrop(Some(runtime.spawn(async move {
        stats.requests.fetch_add(1, Ordering::Relaxed);
        let (tail, len) = fetcher
            .fetch_tail(&source, TAIL_BYTES)
            .await
            .map_err(|e| e.to_string())?;
        stats.bytes.fetch_add(tail.len() as u64, Ordering::Relaxed);
        Ok((tail, len))
    }))))
}

/// What makes a row's record: where its image paths resolve, how large an image may be.
#[derive(Debug, Clone)]
struct RowMaker {
    max_image_bytes: u64,
    image_root: PathBuf,
}

impl RowMaker {
    /// The rows of row group `group`, each handed to `emit` as it is made: `row` counts the
    /// file's rows, `line` numbers the records (each row's is one more than the last).
    #[allow(clippy::too_many_arguments)]
    fn decode(
        &self,
        metadata: &ParquetMetaData,
        group: usize,
        bytes: RowGroupBytes,
        name: &Arc<str>,
        row: &mut u64,
        line: &mut u64,
        mut emit: impl FnMut(Input) -> Result<(), Halt>,
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
                *line += 1;
                let origin = format!("{name}: row {} (row group {group})", *row);
                // The file's whole name: data sets' subsets share file names.
                let id = format!("{name}:{}", *row);
                *row += 1;
                let input = match self.row_input(parsed, *line, &id, name) {
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
                        reject.reason = bounded(format!("{origin}: {}", reject.reason));
                        Input::Rejected(reject)
                    }
                };
                emit(input)?;
            }
            Ok(())
        }));
        decoded.unwrap_or_else(|panic| Err(Halt::Failed(panicked(&*panic))))
    }

    /// A row as the pipeline's input: its record with its images' bytes, or with the paths it
    /// names (fetched as a manifest's are).
    fn row_input(
        &self,
        row: Row,
        line: u64,
        default_id: &str,
        file: &Arc<str>,
    ) -> Result<Input, Reject> {
        // The row's own id where it has one, for a reject before its record is made.
        let id = row
            .get_column_iter()
            .find(|(name, _)| *name == "id")
            .and_then(|(_, field)| match field {
                Field::Str(s) if !s.is_empty() => {
                    Some(feedstore_proto::truncate(s, MAX_ID_BYTES).to_owned())
                }
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
        as_conversation(&mut object, images.held.len());
        let text = Value::Object(object).to_string();
        // As long as a manifest's line may be (a row's strings may repeat a dictionary's).
        if text.len() as u64 > MAX_LINE_BYTES {
            return Err(reject(format!(
                "its columns make {} bytes of record, over the {MAX_LINE_BYTES}-byte limit on \
                 a record",
                text.len()
            )));
        }
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
    /// The bytes of text taken so far.
    text: usize,
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
            Field::Str(s) => Value::String(self.text(s)?.to_owned()),
            // Binary that is not an image's: text when it is UTF-8, else nothing a record uses.
            // An `image` column, or an `images` list, of plain binary: image bytes.
            Field::Bytes(b) if at == "image" || at.starts_with("images[") => {
                self.hold(at, b.data(), max_image_bytes)?
            }
            Field::Bytes(b) => match std::str::from_utf8(b.data()) {
                Ok(s) => Value::String(self.text(s)?.to_owned()),
                Err(_) => Value::Null,
            },
            Field::Group(row) => match image(row) {
                Some((Some(bytes), _)) => self.hold(at, bytes, max_image_bytes)?,
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

    /// Counts a string of the row before it is copied: a row's text is bounded as a manifest's
    /// line is.
    fn text<'s>(&mut self, s: &'s str) -> Result<&'s str, String> {
        self.text += s.len();
        match self.text as u64 > MAX_LINE_BYTES {
            true => Err(format!(
                "its text runs past {MAX_LINE_BYTES} bytes, the limit on a record"
            )),
            false => Ok(s),
        }
    }

    /// Keeps an image's bytes (one copy, so a row does not pin its page), named `at`.
    fn hold(&mut self, at: &str, bytes: &[u8], max_image_bytes: u64) -> Result<Value, String> {
        if bytes.len() as u64 > max_image_bytes {
            return Err(format!(
                "column {at}: an image of {} bytes, over the {max_image_bytes}-byte limit \
                 (--max-image-bytes)",
                bytes.len()
            ));
        }
        if self.held.len() >= MAX_IMAGES_PER_RECORD {
            return Err(format!(
                "more than {MAX_IMAGES_PER_RECORD} images; a record may have at most \
                 {MAX_IMAGES_PER_RECORD}"
            ));
        }
        self.held
            .push((at.to_owned(), Bytes::copy_from_slice(bytes)));
        Ok(Value::String(at.to_owned()))
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

/// A row's turns in the forms data sets other than LLaVA's give them, as `conversations`: The
/// Cauldron's `texts` (`[{user, assistant}, ...]`: the images before the first question, unless
/// it places them), or a caption (`caption`, or `text`, beside images; LAION's, Conceptual
/// Captions'): the images, then the caption as the reply, as a WebDataset sample's `.txt` is.
/// A row with `conversations` or `messages` is left as it is.
fn as_conversation(object: &mut Map<String, Value>, held: usize) {
    let given = |key: &str| object.get(key).is_some_and(|v| !v.is_null());
    if given("conversations") || given("messages") {
        return;
    }
    // How many images the row names (by `image`/`images`), or holds when it names none.
    let images = match (object.get("image"), object.get("images")) {
        (_, Some(Value::Array(images))) => {
            images.len() + usize::from(object.get("image").is_some_and(Value::is_string))
        }
        (Some(Value::String(_)), _) => 1,
        _ => held,
    };
    let placeholders = vec![IMAGE_PLACEHOLDER; images].join("\n");
    if let Some(Value::Array(texts)) = object.get("texts") {
        let mut turns = Vec::new();
        for (i, text) in texts.iter().enumerate() {
            let (Some(Value::String(user)), Some(Value::String(assistant))) =
                (text.get("user"), text.get("assistant"))
            else {
                // Not The Cauldron's form: the record says what is missing.
                return;
            };
            let user = match i == 0 && images > 0 && !user.contains(IMAGE_PLACEHOLDER) {
                true => format!("{placeholders}\n{user}"),
                false => user.clone(),
            };
            turns.push(serde_json::json!({"from": "human", "value": user}));
            turns.push(serde_json::json!({"from": "gpt", "value": assistant}));
        }
        object.remove("texts");
        object.insert("conversations".into(), Value::Array(turns));
        return;
    }
    if held == 0 {
        return;
    }
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
                {"from": "human", "value": placeholders},
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
                let file = crate::input::open_regular(path).map_err(|e| {
                    let name = path.to_string_lossy();
                    match name.contains(['*', '?']) {
                        true => format!(
                            "cannot open: {e} (* and ? are not patterns here: name files with \
                             braces, train-{{00000..00009}}.parquet, or list them in @FILE)"
                        ),
                        false => format!("cannot open: {e}"),
                    }
                })?;
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
    /// a footer longer than that whole in another.
    ///
    /// With it, a digest of the footer's bytes and the file's length: what names this version
    /// of the file (a file written again almost surely has other column chunk offsets, sizes or
    /// statistics).
    fn footer(&self) -> Result<(ParquetMetaData, u64), String> {
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
            _ => {
                return Err(
                    "not a Parquet file, or one cut short (it does not end in PAR1)".into(),
                );
            }
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
        let unreadable = |e: &dyn std::fmt::Display| format!("its footer cannot be read: {e}");
        let (depth, schema_end) = schema_depth(&footer).map_err(|e| unreadable(&e))?;
        if depth > MAX_SCHEMA_DEPTH {
            return Err(format!(
                "its schema nests deeper than {MAX_SCHEMA_DEPTH} levels, which feedstore does \
                 not read"
            ));
        }
        // The schema measured, built alone; the footer then read with it, every schema field
        // in it skipped (the crate would build each one it meets, by recursion).
        let schema = ParquetMetaDataReader::decode_schema(&footer[..schema_end])
            .map_err(|e| unreadable(&e))?;
        let options = ParquetMetaDataOptions::new().with_schema(schema);
        let metadata = ParquetMetaDataReader::decode_metadata_with_options(&footer, Some(&options))
            .map_err(|e| unreadable(&e))?;
        let columns = metadata.file_metadata().schema_descr().num_columns();
        if columns > MAX_COLUMNS {
            return Err(format!(
                "it has {columns} columns, more than the {MAX_COLUMNS} read"
            ));
        }
        let version = {
            use std::hash::{Hash, Hasher};
            let mut hasher = std::hash::DefaultHasher::new();
            (len, &footer[..]).hash(&mut hasher);
            hasher.finish()
        };
        Ok((metadata, version))
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
        let row_group = metadata.row_group(group);
        let rows = u64::try_from(row_group.num_rows())
            .map_err(|_| format!("it states {} rows", row_group.num_rows()))?;
        if rows > MAX_ROWS_PER_GROUP {
            return Err(format!(
                "it states {rows} rows, over the {MAX_ROWS_PER_GROUP} read in a row group; \
                 {SMALLER_GROUPS}"
            ));
        }
        if rows > 0 && row_group.columns().is_empty() {
            return Err(format!("it states {rows} rows and has no columns"));
        }
        let mut chunks: Vec<Chunk> = Vec::new();
        for column in row_group.columns() {
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
                        "column {path} is compressed with {}, which feedstore does not read \
                         (its pages inflate to no stated bound); write the file again with \
                         snappy or zstd (pyarrow: pq.write_table(pq.read_table(path), out, \
                         compression=\"snappy\"))",
                        codec_name(other)
                    ));
                }
            };
            // Every row has a value (or a null) in every leaf column.
            if column.num_values() < row_group.num_rows() {
                return Err(format!(
                    "column {path} states {} values for {rows} rows",
                    column.num_values()
                ));
            }
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
        // Chunks may not share bytes: each page is checked, and decoded, once.
        let mut spans: Vec<(u64, u64)> = chunks.iter().map(|c| (c.1, c.1 + c.2)).collect();
        spans.sort_unstable();
        if let Some(pair) = spans.windows(2).find(|pair| pair[0].1 > pair[1].0) {
            return Err(format!(
                "its column chunks overlap (bytes {}..{} and {}..{})",
                pair[0].0, pair[0].1, pair[1].0, pair[1].1
            ));
        }
        let lo = spans.first().map_or(0, |s| s.0);
        let hi = spans.iter().map(|s| s.1).max().unwrap_or(0);
        if hi - lo > MAX_ROW_GROUP_BYTES {
            return Err(format!(
                "its column chunks span {} bytes, over the {MAX_ROW_GROUP_BYTES}-byte limit \
                 on a row group; {SMALLER_GROUPS}",
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
        let file_len = self.body.len();
        let mut decoding = 0u64;
        for (path, start, size, ratio, codec) in &chunks {
            let from = (start - lo) as usize;
            let limit = Limit {
                bytes: page_limit,
                ratio: *ratio,
                codec: *codec,
            };
            decoding += check_pages(&bytes[from..from + *size as usize], *start, &limit)
                .map_err(|e| format!("column {path}: {e}"))?;
        }
        if decoding > DECODE_BUDGET {
            return Err(format!(
                "decoding it would hold {decoding} bytes at once (its columns' dictionaries and \
                 largest pages, as their headers state them), over the {DECODE_BUDGET}-byte \
                 budget for a row group; {SMALLER_GROUPS}"
            ));
        }
        self.stats
            .peak_row_group
            .fetch_max(bytes.len() as u64, Ordering::Relaxed);
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

/// What to do about a row group too large.
const SMALLER_GROUPS: &str =
    "write the file with smaller row groups (datasets: to_parquet(path, batch_size=16))";

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
/// within the chunk, states no more bytes uncompressed than `limit` allows, and no more values
/// than its bytes can hold (the crate makes room for a dictionary's stated values before it
/// reads one). Returns what decoding the chunk may hold at once: its dictionaries and its
/// largest data page, each with room for its values.
fn check_pages(chunk: &[u8], at: u64, limit: &Limit) -> Result<u64, String> {
    let (mut dictionaries, mut largest, mut values_in_chunk) = (0u64, 0u64, 0u64);
    let mut offset = 0usize;
    while offset < chunk.len() {
        let here = at + offset as u64;
        let page = page_header(&chunk[offset..])
            .map_err(|e| format!("the page header at byte {here}: {e}"))?;
        let (uncompressed, compressed, values) = (page.uncompressed, page.compressed, page.values);
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
                codec_name(limit.codec)
            ));
        }
        // A dictionary's values take a byte each at least; a data page's levels may pack 8 to
        // a byte, and runs of nulls more (a floor for them).
        let most = match page.dictionary {
            true => uncompressed.min(MAX_DICTIONARY_VALUES),
            false => uncompressed.saturating_mul(8).max(MAX_ROWS_PER_GROUP),
        };
        if values > most {
            return Err(format!(
                "the page at byte {here} states {values} values in {uncompressed} bytes (at \
                 most {most})"
            ));
        }
        // A row's list may run on across pages (the crate gathers it whole): every value of
        // the chunk counts, not only the largest page's.
        match page.dictionary {
            true => dictionaries += uncompressed + values * DICTIONARY_VALUE_BYTES,
            false => {
                largest = largest.max(uncompressed);
                values_in_chunk += values;
                if values_in_chunk > MAX_VALUES_PER_CHUNK {
                    return Err(format!(
                        "its pages state more than {MAX_VALUES_PER_CHUNK} values"
                    ));
                }
            }
        }
        offset = page
            .len
            .checked_add(compressed as usize)
            .and_then(|n| offset.checked_add(n))
            .filter(|&end| end <= chunk.len())
            .ok_or_else(|| {
                format!("the page at byte {here} ({compressed} bytes) runs past its column chunk")
            })?;
    }
    Ok(dictionaries + largest + values_in_chunk * ROW_VALUE_BYTES)
}

/// A codec's name, as a user would write it.
fn codec_name(codec: Compression) -> &'static str {
    match codec {
        Compression::UNCOMPRESSED => "uncompressed",
        Compression::SNAPPY => "snappy",
        Compression::GZIP(_) => "gzip",
        Compression::LZO => "lzo",
        Compression::BROTLI(_) => "brotli",
        Compression::LZ4 => "lz4 (Hadoop's)",
        Compression::ZSTD(_) => "zstd",
        Compression::LZ4_RAW => "lz4_raw",
    }
}

/// How deep the schema in a footer (Thrift's `FileMetaData`, field 2: the schema's elements in
/// depth-first order, each group with its `num_children`, field 5) nests, counted without
/// building it; past [`MAX_SCHEMA_DEPTH`] the count stops (at one more). The crate builds the
/// first field 2 it meets, right away, and needs it before the row groups (field 4): so the
/// schema must be the footer's first field, after the version (field 1) alone, as every writer
/// puts it, and its elements are read strictly (each known field with its wire type, once), so
/// the crate reads the same elements counted here. Returns the depth and where the schema ends:
/// the crate is given this schema alone to build ([`ParquetMetaDataReader::decode_schema`]),
/// and skips every schema field of the footer (a second one included) when it reads the rest.
fn schema_depth(footer: &[u8]) -> Result<(usize, usize), String> {
    const ELEMENT: &[(i64, Wire)] = &[
        (1, I32),
        (2, I32),
        (3, I32),
        (4, Binary),
        (5, I32),
        (6, I32),
        (7, I32),
        (8, I32),
        (9, I32),
        (10, Struct),
    ];
    let mut thrift = Compact {
        bytes: footer,
        at: 0,
    };
    // Field 1 (delta 1, i32), then field 2 (delta 1, list); or field 2 first (delta 2).
    let mut header = thrift.byte()?;
    if header == 0x15 {
        thrift.i32()?;
        header = thrift.byte()?;
        if header != 0x19 {
            return Err("its schema does not follow its version, as every writer puts it".into());
        }
    } else if header != 0x29 {
        return Err("its schema is not its first field, as every writer puts it".into());
    }
    let list = thrift.byte()?;
    let size = match list >> 4 {
        15 => thrift.varint()?,
        n => u64::from(n),
    };
    if list & 0x0f != 12 || size > (thrift.bytes.len() - thrift.at) as u64 {
        return Err("a schema that is not a list of elements".into());
    }
    let mut deepest = 1;
    // The children each open group has still to come.
    let mut open: Vec<i64> = Vec::new();
    for _ in 0..size {
        let mut children = 0;
        thrift.strict(1, ELEMENT, |thrift, id, kind| match (id, kind) {
            (5, _) => {
                children = i64::from(thrift.i32()?);
                match children < 0 {
                    true => Err(format!("a group of {children} children")),
                    false => Ok(()),
                }
            }
            (2, _) => {
                // A fixed-length byte array's length: some decoders allocate values times it.
                let length = thrift.i32()?;
                match (0..=MAX_TYPE_LENGTH).contains(&length) {
                    true => Ok(()),
                    false => Err(format!("a fixed length of {length} bytes")),
                }
            }
            (10, _) => thrift.logical_type(),
            (_, 5) => thrift.i32().map(drop),
            (_, kind) => thrift.skip(kind, 2),
        })?;
        if let Some(left) = open.last_mut() {
            *left -= 1;
        }
        if children > 0 {
            open.push(children);
            deepest = deepest.max(open.len());
            if deepest > MAX_SCHEMA_DEPTH {
                return Ok((MAX_SCHEMA_DEPTH + 1, thrift.at));
            }
        }
        while open.last().is_some_and(|&left| left <= 0) {
            open.pop();
        }
    }
    Ok((deepest, thrift.at))
}

/// What a page header states, read as the parquet crate will read it.
#[derive(Debug, PartialEq, Eq)]
struct PageHeader {
    uncompressed: u64,
    compressed: u64,
    /// The values its data or dictionary page header states (0 for other pages).
    values: u64,
    dictionary: bool,
    /// The header's own length.
    len: usize,
}

/// Thrift wire types a known field may have.
#[derive(Debug, Clone, Copy)]
enum Wire {
    Bool,
    Byte,
    I32,
    Binary,
    Struct,
}

impl Wire {
    fn accepts(self, kind: u8) -> bool {
        matches!(
            (self, kind),
            (Wire::Bool, 1 | 2)
                | (Wire::Byte, 3)
                | (Wire::I32, 5)
                | (Wire::Binary, 8)
                | (Wire::Struct, 12)
        )
    }
}

use Wire::{Binary, Bool, Byte, I32, Struct};

/// A page header (Thrift's `PageHeader`), read strictly: every field the crate knows must have
/// its wire type and come once (the crate reads a known field by its id, whatever its type, and
/// keeps the last copy: a lenient reader here could check one size while the crate used
/// another). Fields 1-4: type, uncompressed and compressed size, crc; 5, 7 and 8: the data,
/// dictionary and v2 data page headers, whose field 1 is the values the page holds.
fn page_header(bytes: &[u8]) -> Result<PageHeader, String> {
    const HEADER: &[(i64, Wire)] = &[
        (1, I32),
        (2, I32),
        (3, I32),
        (4, I32),
        (5, Struct),
        (6, Struct),
        (7, Struct),
        (8, Struct),
    ];
    const DATA: &[(i64, Wire)] = &[(1, I32), (2, I32), (3, I32), (4, I32), (5, Struct)];
    const DICTIONARY: &[(i64, Wire)] = &[(1, I32), (2, I32), (3, Bool)];
    const DATA_V2: &[(i64, Wire)] = &[
        (1, I32),
        (2, I32),
        (3, I32),
        (4, I32),
        (5, I32),
        (6, I32),
        (7, Bool),
        (8, Struct),
    ];
    let mut thrift = Compact { bytes, at: 0 };
    let (mut uncompressed, mut compressed, mut values, mut dictionary) = (None, None, 0, false);
    thrift.strict(0, HEADER, |thrift, id, kind| match id {
        2 | 3 => {
            let v = thrift.i32()?;
            let v = u64::try_from(v).map_err(|_| format!("a negative page size ({v})"))?;
            match id {
                2 => uncompressed = Some(v),
                _ => compressed = Some(v),
            }
            Ok(())
        }
        5 | 7 | 8 => {
            dictionary |= id == 7;
            let known = match id {
                5 => DATA,
                7 => DICTIONARY,
                _ => DATA_V2,
            };
            let page = id;
            thrift.strict(1, known, |thrift, id, kind| match (id, kind) {
                (1, _) => {
                    let v = thrift.i32()?;
                    values = values.max(
                        u64::try_from(v).map_err(|_| format!("a negative value count ({v})"))?,
                    );
                    Ok(())
                }
                (_, 5) => encoding_read(page, id, thrift.i32()?),
                (_, kind) => thrift.skip(kind, 2),
            })
        }
        _ => match kind {
            5 => thrift.i32().map(drop),
            kind => thrift.skip(kind, 1),
        },
    })?;
    match (uncompressed, compressed) {
        (Some(uncompressed), Some(compressed)) => Ok(PageHeader {
            uncompressed,
            compressed,
            values,
            dictionary,
            len: thrift.at,
        }),
        _ => Err("no page sizes in it".into()),
    }
}

/// Whether the encoding field `field` of a page header's `page` struct (5: data, 7: dictionary,
/// 8: data v2) names one the crate decodes within the page's bytes: PLAIN, the dictionary's
/// indexes (PLAIN_DICTIONARY, RLE_DICTIONARY) and RLE (or BIT_PACKED levels), what pyarrow and
/// `datasets` write. The DELTA encodings and BYTE_STREAM_SPLIT make the crate allocate what
/// their own headers, or the schema, state.
fn encoding_read(page: i64, field: i64, encoding: i32) -> Result<(), String> {
    const NAMES: [&str; 11] = [
        "PLAIN",
        "GROUP_VAR_INT",
        "PLAIN_DICTIONARY",
        "RLE",
        "BIT_PACKED",
        "DELTA_BINARY_PACKED",
        "DELTA_LENGTH_BYTE_ARRAY",
        "DELTA_BYTE_ARRAY",
        "RLE_DICTIONARY",
        "BYTE_STREAM_SPLIT",
        "ALP",
    ];
    let allowed: &[i32] = match (page, field) {
        // Values.
        (5, 2) | (8, 4) => &[0, 2, 3, 8],
        // Levels (a v1 data page's).
        (5, 3 | 4) => &[3, 4],
        // A dictionary's values.
        (7, 2) => &[0, 2],
        _ => return Ok(()),
    };
    match allowed.contains(&encoding) {
        true => Ok(()),
        false => Err(format!(
            "encoding {}, which feedstore does not read (pyarrow writes PLAIN, dictionaries \
             and RLE: pq.write_table(..., use_dictionary=True, column_encoding=None))",
            usize::try_from(encoding)
                .ok()
                .and_then(|e| NAMES.get(e))
                .map_or_else(|| encoding.to_string(), |name| (*name).to_owned())
        )),
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

    /// An i32, refused past its range (the crate would cut it to 32 bits).
    fn i32(&mut self) -> Result<i32, String> {
        let v = self.zigzag()?;
        i32::try_from(v).map_err(|_| format!("{v} where an i32 goes"))
    }

    /// A schema element's logical type (Thrift's `LogicalType` union), read strictly: its
    /// variants and their fields as the crate knows them.
    fn logical_type(&mut self) -> Result<(), String> {
        const VARIANTS: &[(i64, Wire)] = &[
            (1, Struct),
            (2, Struct),
            (3, Struct),
            (4, Struct),
            (5, Struct),
            (6, Struct),
            (7, Struct),
            (8, Struct),
            (10, Struct),
            (11, Struct),
            (12, Struct),
            (13, Struct),
            (14, Struct),
            (15, Struct),
            (16, Struct),
            (17, Struct),
            (18, Struct),
            (19, Struct),
        ];
        const TIME_UNIT: &[(i64, Wire)] = &[(1, Struct), (2, Struct), (3, Struct)];
        self.strict(2, VARIANTS, |thrift, variant, _| {
            let fields: &[(i64, Wire)] = match variant {
                5 => &[(1, I32), (2, I32)],
                7 | 8 => &[(1, Bool), (2, Struct)],
                10 => &[(1, Byte), (2, Bool)],
                16 => &[(1, Byte)],
                17 => &[(1, Binary)],
                18 => &[(1, Binary), (2, I32)],
                _ => &[],
            };
            thrift.strict(3, fields, |thrift, _, kind| match kind {
                5 => thrift.i32().map(drop),
                // A time unit: one of three empty structs.
                12 => thrift.strict(4, TIME_UNIT, |thrift, _, _| {
                    thrift.strict(5, &[], |_, _, _| Ok(()))
                }),
                kind => thrift.skip(kind, 4),
            })
        })
    }

    /// A struct's fields, read strictly: each id in `known` must come with its wire type and at
    /// most once, and is handed to `read`; other ids are skipped.
    fn strict(
        &mut self,
        depth: u32,
        known: &[(i64, Wire)],
        mut read: impl FnMut(&mut Self, i64, u8) -> Result<(), String>,
    ) -> Result<(), String> {
        let mut seen = 0u64;
        self.fields(depth, |thrift, id, kind| {
            match known.iter().find(|(k, _)| *k == id) {
                Some(&(_, wire)) => {
                    if !wire.accepts(kind) {
                        return Err(format!("field {id} has Thrift type {kind}, not {wire:?}"));
                    }
                    if seen & (1 << id) != 0 {
                        return Err(format!("field {id} comes twice"));
                    }
                    seen |= 1 << id;
                    read(thrift, id, kind)
                }
                None => thrift.skip(kind, depth + 1),
            }
        })
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
        // Ids as the crate reads them: an i16, a long-form id cut to its low 16 bits, a delta
        // that would overflow refused; a type of 0 is the end, whatever the delta.
        let mut id = 0i16;
        loop {
            let header = self.byte()?;
            let (delta, kind) = (header >> 4, header & 0x0f);
            if kind == 0 {
                return Ok(());
            }
            id = match delta {
                0 => self.zigzag()? as i16,
                d => id
                    .checked_add(i16::from(d))
                    .ok_or("a field id past an i16")?,
            };
            if depth > MAX_DEPTH {
                return Err("nested too deep".into());
            }
            field(self, i64::from(id), kind)?;
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
    fn page_headers_are_read_strictly_for_their_sizes_and_values() {
        // type=DATA_PAGE, uncompressed=300, compressed=200, a data page header of 7 values with
        // statistics (a binary inside), then stop.
        let header = [
            0x15, 0x00, 0x15, 0xd8, 0x04, 0x15, 0x90, 0x03, 0x2c, 0x15, 0x0e, 0x4c, 0x18, 0x02,
            b'h', b'i', 0x00, 0x00, 0x00,
        ];
        assert_eq!(
            page_header(&header),
            Ok(PageHeader {
                uncompressed: 300,
                compressed: 200,
                values: 7,
                dictionary: false,
                len: header.len(),
            })
        );
        // Cut anywhere, it is refused, never read past.
        for cut in 0..header.len() {
            assert!(page_header(&header[..cut]).is_err(), "cut at {cut}");
        }
        let refused = |bytes: &[u8], said: &str| {
            let e = page_header(bytes).unwrap_err();
            assert!(e.contains(said), "{e} (expected {said})");
        };
        // A negative size; a size past an i32 (the crate would cut it short).
        refused(&[0x25, 0x01, 0x00], "negative");
        refused(
            &[0x25, 0x80, 0x80, 0x80, 0x80, 0x10, 0x00],
            "where an i32 goes",
        );
        // The uncompressed size given again as an i64 (the crate would keep the second): a
        // known field with another wire type, or given twice, is refused.
        refused(
            &[
                0x15, 0x00, 0x15, 0xc8, 0x01, 0x15, 0x90, 0x03, 0x06, 0x04, 0xfe, 0xff, 0x0f, 0x00,
            ],
            "field 2 has Thrift type 6",
        );
        refused(
            &[0x15, 0x00, 0x15, 0xc8, 0x01, 0x05, 0x04, 0x02, 0x00],
            "field 2 comes twice",
        );
        // A crc given as a binary would put the two readers out of step.
        refused(&[0x48, 0x02, b'a', b'b', 0x00], "field 4 has Thrift type 8");
        // A list claiming more elements than bytes, in a field no one knows.
        refused(
            &[0x15, 0x00, 0x99, 0xf5, 0xff, 0xff, 0xff, 0x0f],
            "elements",
        );
        // Structs nested past the bound.
        let mut deep = vec![0x15, 0x00, 0x15, 0x02, 0x15, 0x02, 0x9c];
        deep.extend([0x1c; 200]);
        refused(&deep, "deep");
    }

    #[test]
    fn a_page_may_not_state_more_values_than_its_bytes_hold() {
        // A dictionary page (type 2) of 20 bytes stating 2^31 - 1 values: the crate would make
        // room for all of them (64 GiB of byte arrays) before reading one.
        let mut bomb = vec![0x15, 0x04, 0x15, 0x28, 0x15, 0x28, 0x4c, 0x15];
        bomb.extend([0xfe, 0xff, 0xff, 0xff, 0x0f, 0x00, 0x00]);
        bomb.extend([0; 20]);
        let limit = Limit {
            bytes: 1 << 30,
            ratio: 1,
            codec: Compression::UNCOMPRESSED,
        };
        let e = check_pages(&bomb, 0, &limit).unwrap_err();
        assert!(e.contains("states 2147483647 values in 20 bytes"), "{e}");
        // The same count under a long-form id the crate cuts to 16 bits (65537 is its field 1).
        let mut hidden = vec![
            0x15, 0x04, 0x15, 0x28, 0x15, 0x28, 0x4c, 0x05, 0x82, 0x80, 0x08,
        ];
        hidden.extend([0xfe, 0xff, 0xff, 0xff, 0x0f, 0x00, 0x00]);
        hidden.extend([0; 20]);
        let e = check_pages(&hidden, 0, &limit).unwrap_err();
        assert!(e.contains("states 2147483647 values in 20 bytes"), "{e}");
        // A data page in an encoding that allocates what its own header says.
        let delta = [
            0x15, 0x00, 0x15, 0x28, 0x15, 0x28, 0x2c, 0x15, 0x02, 0x15, 0x0c, 0x00, 0x00,
        ];
        let e = page_header(&delta).unwrap_err();
        assert!(e.contains("encoding DELTA_LENGTH_BYTE_ARRAY"), "{e}");
        // Five values in 20 bytes are fine, and what decoding holds is counted.
        let mut fine = vec![
            0x15, 0x04, 0x15, 0x28, 0x15, 0x28, 0x4c, 0x15, 0x0a, 0x00, 0x00,
        ];
        fine.extend([0; 20]);
        assert_eq!(
            check_pages(&fine, 0, &limit),
            Ok(20 + 5 * DICTIONARY_VALUE_BYTES)
        );
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
        let depth = |bytes: &[u8]| schema_depth(bytes).map(|d| d.0);
        assert_eq!(depth(&footer(100_000, 1)), Ok(MAX_SCHEMA_DEPTH + 1));
        assert_eq!(depth(&footer(5, 1)), Ok(5));
        assert_eq!(depth(&footer(3, 0)), Ok(1));
        // A list longer than the bytes behind it.
        let mut cut = footer(100, 1);
        cut.truncate(50);
        assert!(schema_depth(&cut).is_err());
        // What the crate would read otherwise than this count is refused: a schema after
        // another field, or as a set; a child count as an i64, negative, or past an i32.
        let refused = |bytes: &[u8], said: &str| {
            let e = schema_depth(bytes).unwrap_err();
            assert!(e.contains(said), "{e} (expected {said})");
        };
        refused(&[0x36, 0x02, 0x19, 0x1c, 0x00, 0x00], "not its first field");
        refused(
            &[0x15, 0x02, 0x1a, 0x1c, 0x00, 0x00],
            "does not follow its version",
        );
        refused(
            &[0x29, 0x1c, 0x56, 0x02, 0x00, 0x00],
            "field 5 has Thrift type 6",
        );
        refused(&[0x29, 0x1c, 0x55, 0x01, 0x00, 0x00], "children");
        refused(
            &[0x29, 0x1c, 0x55, 0xfe, 0xff, 0xff, 0xff, 0x1f, 0x00],
            "where an i32 goes",
        );
        // A child count under a long-form id (65541, field 5 to the crate) is counted.
        let mut hidden = vec![0x15, 0x02, 0x19, 0xfc, 0xe8, 0x07];
        for _ in 0..1000 {
            hidden.extend([0x05, 0x8a, 0x80, 0x08, 0x02, 0x00]);
        }
        assert_eq!(schema_depth(&hidden).map(|d| d.0), Ok(MAX_SCHEMA_DEPTH + 1));
        // A fixed length too long for the decoders that allocate by it.
        refused(
            &[0x29, 0x1c, 0x25, 0xfe, 0xff, 0xff, 0xff, 0x0f, 0x00],
            "a fixed length",
        );
        // A logical type's field with another wire type (an integer's bit width as an i32).
        refused(
            &[0x29, 0x1c, 0xac, 0xac, 0x15, 0x10, 0x00, 0x00, 0x00, 0x00],
            "field 1 has Thrift type 5",
        );
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
            Ok(10)
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
                .contains("more than snappy inflates to")
        );
        assert_eq!(
            check_pages(&page(3200, 100), 0, &limit(1 << 30, Compression::SNAPPY)),
            Ok(3200)
        );
    }
}
