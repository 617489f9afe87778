//! Parquet rows by index, for a stream: a stream's tasks name records by index in an order the
//! daemon draws, so the rows must be read out of order.
//!
//! ```text
//! open:  every file's footer ──▶ rows per row group ──▶ index i ──▶ (file, row group, row)
//! get i: its row group, read and decoded whole once ──▶ cache (LRU, --row-group-cache bytes)
//!        ──▶ row i's record and image bytes
//! ```
//!
//! A row is read by reading its row group whole (one read of its column chunks, then every page
//! decoded: the record reader goes through a row group's pages in order), checked exactly as a
//! one-pass read checks it ([`Source::start_row_group`], [`Source::finish_row_group`]). The
//! decoded rows stay in a cache of `cache_bytes` while the stream's ranks read the rest: with
//! `--shuffle block:N` (N a row group's rows: the default for Parquet streams) the ranks read a
//! few row groups at a time. A row group that lines up with a block is read once an epoch; one
//! split between two blocks (after a file whose rows are not a multiple of N) is read again when
//! the second block comes, unless the cache still holds it. A full shuffle over files larger
//! than the cache reads a row group per sample.
//!
//! Row groups are read and decoded on the blocking threads of a runtime of its own (8 MiB
//! stacks: decoding recurses along the schema), at most [`READS_AT_ONCE`] at a time: one a
//! reader waits for and [`PREFETCHING`] read ahead. Memory is the cache, those reads (each at
//! most a row group's bytes and its decode budget, as a one-pass read), the rows handed out
//! and not yet made into samples, and the files kept open (at most [`OPEN_FILES`] parsed
//! footers).
//!
//! Every file's footer is read when the stream starts (its rows make the stream's record count)
//! and read again when the file is opened later; a file whose footer or length changed meanwhile,
//! or a local file whose length or modification time changed while it was open, is refused, row
//! group by row group, rather than read as other records. (An S3 object written again while it
//! is open is not seen: ranged GETs are not pinned to an ETag.)

use std::collections::HashSet;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};

use parquet::file::metadata::ParquetMetaData;

use super::{
    AbortOnDrop, Body, Halt, MAX_ROWS_PER_GROUP, PAGE_LIMIT, RowMaker, Source, TableStats,
    panicked, start_open, table_reject,
};
use crate::feed::{Indexed, RecordIndex};
use crate::manifest::{Content, Reject};
use crate::pipeline::Input;
use crate::shards::Shard;
use crate::source::Fetch;

/// Files kept open (a file descriptor, or an S3 file's end, and the parsed footer) between
/// row groups.
pub const OPEN_FILES: usize = 16;

/// Footers read at once when the stream starts.
const OPENING: usize = 16;

/// Row groups read ahead at once (`RecordIndex::prefetch`).
pub const PREFETCHING: u64 = 2;

/// Row groups read at once: one a reader waits for, and those read ahead.
pub const READS_AT_ONCE: usize = 1 + PREFETCHING as usize;

/// The most row groups the cache tracks, whatever their size.
const MAX_CACHED_GROUPS: usize = 4096;

/// The default bytes of decoded rows kept ([`ParquetRows::open`]'s `cache_bytes`).
pub const DEFAULT_CACHE_BYTES: u64 = 1 << 30;

/// The stack of a thread that decodes (as the one-pass reader's).
const DECODE_STACK: usize = 8 << 20;

/// The rows of a list of Parquet files, read by index ([`RecordIndex`]): the rows of the first
/// file, then the second's, and so on.
pub struct ParquetRows(Arc<Inner>);

struct Inner {
    files: Vec<TableFile>,
    rows: u64,
    fetcher: Arc<dyn Fetch>,
    runtime: IoRuntime,
    maker: RowMaker,
    page_limit: u64,
    cache_bytes: u64,
    stats: Arc<TableStats>,
    reads: ReadStats,
    cache: Mutex<Cache>,
    /// Row groups being read, and a wake-up when one is done.
    reading: Mutex<usize>,
    read_done: Condvar,
}

impl std::fmt::Debug for ParquetRows {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ParquetRows")
            .field("files", &self.0.files.len())
            .field("rows", &self.0.rows)
            .finish_non_exhaustive()
    }
}

/// How the cache served reads.
#[derive(Debug, Default)]
pub struct ReadStats {
    /// Row groups being read ahead now.
    pub prefetching: AtomicU64,
    /// Row groups read again after the cache let them go.
    pub reread: AtomicU64,
    /// The most bytes of decoded rows the cache held.
    pub peak_bytes: AtomicU64,
}

/// A file, as its footer was when the stream started.
#[derive(Debug)]
struct TableFile {
    shard: Shard,
    name: Arc<str>,
    /// The index of its first row.
    first: u64,
    /// The rows before each row group's end, within the file.
    ends: Vec<u64>,
    /// Its footer's digest, with its length ([`Source::footer`]).
    version: u64,
    /// A local file's length and modification time when it was indexed.
    stamp: Option<Stamp>,
}

/// A local file's length and modification time.
type Stamp = (u64, Option<std::time::SystemTime>);

/// A file opened: where its bytes are and its footer.
struct Opened {
    source: Source,
    metadata: ParquetMetaData,
    version: u64,
}

impl Opened {
    /// A local file's length and modification time now, through its open descriptor.
    fn stamp(&self) -> Result<Option<Stamp>, String> {
        match &self.source.body {
            Body::Local { file, .. } => {
                let meta = file
                    .metadata()
                    .map_err(|e| format!("cannot stat it: {e}"))?;
                Ok(Some((meta.len(), meta.modified().ok())))
            }
            Body::Remote { .. } => Ok(None),
        }
    }

    /// Refuses a local file written again in place since `table` indexed it (an S3 object is
    /// checked only when opened: its ranged reads are not pinned to a version).
    fn unchanged(&self, table: &TableFile) -> Result<(), String> {
        match self.stamp()? == table.stamp {
            true => Ok(()),
            false => Err(CHANGED.into()),
        }
    }
}

/// Why a file's rows are no longer read.
const CHANGED: &str = "it changed since the stream started (its footer, length or modification \
                       time differ: written again?): its rows are no longer the stream's records";

/// A row group's rows: each read a record or why it is not one; past them, when the row group
/// could not be read to its end, why (one reason for every row lost, not a copy each).
struct Rows {
    read: Vec<Result<Indexed, Reject>>,
    lost: Option<Arc<str>>,
    /// The bytes they hold, about.
    bytes: u64,
}

/// Row groups read, most recently used last, and the files open, most recently used last.
#[derive(Default)]
struct Cache {
    groups: Vec<Slot>,
    bytes: u64,
    /// Row groups ever read, to count those read again.
    seen: HashSet<(usize, usize)>,
    /// Row groups that could not be read, counted once each in `unreadable`.
    failed: HashSet<(usize, usize)>,
    open: Vec<(usize, Arc<Opened>)>,
}

struct Slot {
    key: (usize, usize),
    /// Filled once, by whichever reader asked first; others wait for it.
    rows: Arc<OnceLock<Rows>>,
    /// Its bytes once read (0 while being read).
    bytes: u64,
}

/// A runtime of its own for reading row groups (on its blocking threads) and S3 (on its worker),
/// shut down without waiting wherever it is dropped.
struct IoRuntime(Option<tokio::runtime::Runtime>);

impl IoRuntime {
    fn handle(&self) -> &tokio::runtime::Handle {
        self.0.as_ref().expect("until dropped").handle()
    }
}

impl Drop for IoRuntime {
    fn drop(&mut self) {
        if let Some(runtime) = self.0.take() {
            runtime.shutdown_background();
        }
    }
}

/// One of [`READS_AT_ONCE`], given back when dropped.
struct Reading<'a>(&'a Inner);

impl Drop for Reading<'_> {
    fn drop(&mut self) {
        *self.0.reading.lock().unwrap_or_else(|e| e.into_inner()) -= 1;
        self.0.read_done.notify_one();
    }
}

/// Gives a read-ahead's count back however its read ends.
struct Prefetching<'a>(&'a AtomicU64);

impl Drop for Prefetching<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl ParquetRows {
    /// Reads every file's footer (local files, or S3 ones through `fetcher`, [`OPENING`] at a
    /// time) and counts their rows; images of at most `max_image_bytes`; image paths in rows
    /// resolve against `image_root`; at most `cache_bytes` of decoded rows kept (and always the
    /// row group last read). A file that cannot be opened, or whose footer fails a check, is an
    /// error naming it: the stream's record count is fixed before it starts.
    pub fn open(
        files: Vec<Shard>,
        fetcher: Arc<dyn Fetch>,
        max_image_bytes: u64,
        image_root: std::path::PathBuf,
        cache_bytes: u64,
    ) -> Result<ParquetRows, String> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("feedstore-parquet")
            .thread_stack_size(DECODE_STACK)
            .enable_all()
            .build()
            .map_err(|e| format!("cannot start the Parquet reader's runtime: {e}"))?;
        let mut inner = Inner {
            files: Vec::with_capacity(files.len()),
            rows: 0,
            fetcher,
            runtime: IoRuntime(Some(runtime)),
            maker: RowMaker {
                max_image_bytes,
                image_root,
            },
            page_limit: PAGE_LIMIT,
            cache_bytes,
            stats: Arc::default(),
            reads: ReadStats::default(),
            cache: Mutex::default(),
            reading: Mutex::new(0),
            read_done: Condvar::new(),
        };
        inner.index(files)?;
        Ok(ParquetRows(Arc::new(inner)))
    }

    /// The most bytes a page may state uncompressed [default: [`PAGE_LIMIT`]].
    pub fn with_page_limit(mut self, bytes: u64) -> ParquetRows {
        Arc::get_mut(&mut self.0)
            .expect("set before it is shared")
            .page_limit = bytes;
        self
    }

    /// What reading has taken so far.
    pub fn stats(&self) -> Arc<TableStats> {
        self.0.stats.clone()
    }

    /// How the cache served reads so far.
    pub fn reads(&self) -> &ReadStats {
        &self.0.reads
    }

    /// The files.
    pub fn files(&self) -> usize {
        self.0.files.len()
    }

    /// The row groups, over every file.
    pub fn row_groups(&self) -> usize {
        self.0.files.iter().map(|f| f.ends.len()).sum()
    }

    /// The most rows in one row group (0 with no rows).
    pub fn largest_row_group(&self) -> u64 {
        self.0
            .files
            .iter()
            .flat_map(|f| group_rows(&f.ends))
            .max()
            .unwrap_or(0)
    }
}

/// The rows of each row group, from their ends.
fn group_rows(ends: &[u64]) -> impl Iterator<Item = u64> + '_ {
    ends.iter()
        .scan(0, |last, &end| Some(end - std::mem::replace(last, end)))
}

impl Inner {
    /// Counts every file's rows from its footer, the next files' ends read meanwhile.
    fn index(&mut self, files: Vec<Shard>) -> Result<(), String> {
        let handle = self.runtime.handle().clone();
        let start = |file: &Shard| start_open(file, &self.fetcher, &self.stats, &handle);
        let mut opening: std::collections::VecDeque<_> =
            files.iter().take(OPENING).map(start).collect();
        let mut first = 0u64;
        for (i, shard) in files.iter().enumerate() {
            let this = opening.pop_front().expect("one per file");
            if let Some(next) = files.get(i + OPENING) {
                opening.push_back(start(next));
            }
            let opened = std::panic::catch_unwind(AssertUnwindSafe(|| self.open_with(shard, this)))
                .unwrap_or_else(|panic| Err(panicked(&*panic)))
                .map_err(|e| format!("{shard}: {e}"))?;
            let mut ends = Vec::with_capacity(opened.metadata.num_row_groups());
            let mut end = 0u64;
            for (group, meta) in opened.metadata.row_groups().iter().enumerate() {
                let rows = u64::try_from(meta.num_rows())
                    .ok()
                    .filter(|&r| r <= MAX_ROWS_PER_GROUP)
                    .ok_or_else(|| {
                        format!(
                            "{shard}: row group {group} states {} rows (at most \
                             {MAX_ROWS_PER_GROUP} are read in one)",
                            meta.num_rows()
                        )
                    })?;
                end += rows;
                ends.push(end);
            }
            self.files.push(TableFile {
                shard: shard.clone(),
                name: shard.to_string().into(),
                first,
                ends,
                version: opened.version,
                stamp: opened.stamp().map_err(|e| format!("{shard}: {e}"))?,
            });
            first += end;
        }
        self.rows = first;
        Ok(())
    }

    /// A file's bytes and footer, its end (for an S3 file) being read by `opening`.
    fn open_with(
        &self,
        shard: &Shard,
        opening: Option<AbortOnDrop<(bytes::Bytes, u64)>>,
    ) -> Result<Opened, String> {
        let handle = self.runtime.handle();
        let source = Source {
            body: Body::open(shard, opening, handle)?,
            fetcher: self.fetcher.clone(),
            runtime: handle.clone(),
            stats: self.stats.clone(),
        };
        let (metadata, version) = source.footer()?;
        Ok(Opened {
            source,
            metadata,
            version,
        })
    }

    fn cache(&self) -> std::sync::MutexGuard<'_, Cache> {
        self.cache.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Where row `index` is: (file, row group, row within it).
    fn locate(&self, index: u64) -> Option<(usize, usize, usize)> {
        if index >= self.rows {
            return None;
        }
        // Files with no rows share their first index with the next: the last one is it.
        let file = self.files.partition_point(|f| f.first <= index) - 1;
        let within = index - self.files[file].first;
        let ends = &self.files[file].ends;
        let group = ends.partition_point(|&end| end <= within);
        let before = group.checked_sub(1).map_or(0, |g| ends[g]);
        Some((file, group, (within - before) as usize))
    }

    /// File `file`, kept open or opened again (and then checked to be the file indexed).
    fn opened(&self, file: usize) -> Result<Arc<Opened>, String> {
        {
            let mut cache = self.cache();
            if let Some(i) = cache.open.iter().position(|(f, _)| *f == file) {
                let entry = cache.open.remove(i);
                let opened = entry.1.clone();
                cache.open.push(entry);
                return Ok(opened);
            }
        }
        let shard = &self.files[file].shard;
        let handle = self.runtime.handle();
        let opened =
            self.open_with(shard, start_open(shard, &self.fetcher, &self.stats, handle))?;
        if opened.version != self.files[file].version {
            return Err(CHANGED.into());
        }
        let opened = Arc::new(opened);
        let mut cache = self.cache();
        // (Another thread may have opened it meanwhile: one entry per file.)
        cache.open.retain(|(f, _)| *f != file);
        if cache.open.len() >= OPEN_FILES {
            cache.open.remove(0);
        }
        cache.open.push((file, opened.clone()));
        Ok(opened)
    }

    /// Row group `key`'s slot in the cache, made (and counted) when missing, now its most
    /// recently used. With `ahead`, only a slot made here for a read ahead, when fewer than
    /// [`PREFETCHING`] are under way (which it then counts).
    fn slot(&self, key: (usize, usize), ahead: bool) -> Option<Arc<OnceLock<Rows>>> {
        let mut cache = self.cache();
        if let Some(i) = cache.groups.iter().position(|s| s.key == key) {
            // Most recently used last (a hint too: its rows are wanted soon).
            let slot = cache.groups.remove(i);
            let rows = slot.rows.clone();
            cache.groups.push(slot);
            return (!ahead).then_some(rows);
        }
        if ahead && self.reads.prefetching.fetch_add(1, Ordering::Relaxed) >= PREFETCHING {
            self.reads.prefetching.fetch_sub(1, Ordering::Relaxed);
            return None;
        }
        if !cache.seen.insert(key) {
            self.reads.reread.fetch_add(1, Ordering::Relaxed);
        }
        let rows = Arc::new(OnceLock::new());
        cache.groups.push(Slot {
            key,
            rows: rows.clone(),
            bytes: 0,
        });
        Some(rows)
    }

    /// Reads row group `key` into `slot` unless another thread read it or is reading it (then
    /// waited for), on one of this runtime's blocking threads (a reader's thread waits here).
    fn fill(self: &Arc<Self>, slot: &Arc<OnceLock<Rows>>, key: (usize, usize)) {
        if slot.get().is_some() {
            return;
        }
        let (inner, filling) = (self.clone(), slot.clone());
        let read = self
            .runtime
            .handle()
            .spawn_blocking(move || inner.fill_here(&filling, key));
        // A read that panicked leaves the slot empty: the next reader tries again.
        let _ = self.runtime.handle().block_on(read);
    }

    /// [`Inner::fill`] on this thread, one of the runtime's blocking threads.
    fn fill_here(&self, slot: &Arc<OnceLock<Rows>>, key: (usize, usize)) {
        let mut filled = false;
        let rows = slot.get_or_init(|| {
            filled = true;
            self.read_group(key.0, key.1)
        });
        if filled {
            self.settle(slot, key, rows.bytes);
        }
    }

    /// Row group `group` of file `file`, read and decoded (once a read is free): a record or a
    /// reject per row.
    fn read_group(&self, file: usize, group: usize) -> Rows {
        let mut reading = self.reading.lock().unwrap_or_else(|e| e.into_inner());
        while *reading >= READS_AT_ONCE {
            reading = self
                .read_done
                .wait(reading)
                .unwrap_or_else(|e| e.into_inner());
        }
        *reading += 1;
        drop(reading);
        // Given back however the read ends (a panic included).
        let _read = Reading(self);
        self.decode_group(file, group)
    }

    fn decode_group(&self, file: usize, group: usize) -> Rows {
        let table = &self.files[file];
        let first_row = group.checked_sub(1).map_or(0, |g| table.ends[g]);
        let count = (table.ends[group] - first_row) as usize;
        let mut out: Vec<Result<Indexed, Reject>> = Vec::with_capacity(count);
        let read = std::panic::catch_unwind(AssertUnwindSafe(|| -> Result<(), Halt> {
            let opened = self.opened(file)?;
            opened.unchanged(table)?;
            let pending = opened.source.start_row_group(&opened.metadata, group)?;
            let bytes = opened.source.finish_row_group(pending, self.page_limit)?;
            self.stats.row_groups.fetch_add(1, Ordering::Relaxed);
            let (mut row, mut line) = (first_row, table.first + first_row);
            self.maker.decode(
                &opened.metadata,
                group,
                bytes,
                &table.name,
                &mut row,
                &mut line,
                |input| {
                    // (A decoder giving more rows than the footer states: the rest are not
                    // this index's.)
                    if out.len() < count {
                        out.push(match input {
                            Input::Read(record, images) => Ok(Indexed {
                                record,
                                images: Some(images),
                            }),
                            Input::Record(record) => Ok(Indexed {
                                record,
                                images: None,
                            }),
                            Input::Rejected(reject) => Err(reject),
                        });
                    }
                    Ok(())
                },
            )
        }))
        .unwrap_or_else(|panic| Err(Halt::Failed(panicked(&*panic))));
        let failure = match read {
            Ok(()) if out.len() == count => None,
            Ok(()) => Some(format!(
                "it gave {} rows where its footer states {count}",
                out.len()
            )),
            Err(Halt::Failed(reason)) => Some(reason),
            Err(Halt::Gone) => Some("reading it stopped".into()),
        };
        let lost: Option<Arc<str>> = failure.map(|reason| {
            // The rows not read are lost, each a reject naming the row group (counted once
            // however often it is read).
            if self.cache().failed.insert((file, group)) {
                self.stats.unreadable.fetch_add(1, Ordering::Relaxed);
            }
            let last = first_row + count as u64 - 1;
            let rows = match last > first_row {
                true => format!("rows {first_row} to {last}"),
                false => format!("row {first_row}"),
            };
            format!("{}: row group {group} ({rows}): {reason}", table.name).into()
        });
        let bytes =
            out.iter().map(weight).sum::<u64>() + lost.as_ref().map_or(0, |r| r.len() as u64);
        Rows {
            read: out,
            lost,
            bytes,
        }
    }

    /// Counts `slot`'s `bytes` (row group `key`) in the cache, if it is still there, then lets
    /// the least recently used row groups go until the cache is within its bytes (the one just
    /// read stays).
    fn settle(&self, slot: &Arc<OnceLock<Rows>>, key: (usize, usize), bytes: u64) {
        let mut cache = self.cache();
        if let Some(listed) = cache.groups.iter_mut().find(|s| Arc::ptr_eq(&s.rows, slot)) {
            listed.bytes = bytes;
            cache.bytes += bytes;
        }
        while cache.bytes > self.cache_bytes || cache.groups.len() > MAX_CACHED_GROUPS {
            // The least recently used that is counted (one being read holds nothing yet).
            let Some(i) = cache
                .groups
                .iter()
                .position(|s| s.key != key && s.bytes > 0)
            else {
                break;
            };
            let gone = cache.groups.remove(i);
            cache.bytes -= gone.bytes;
        }
        self.reads
            .peak_bytes
            .fetch_max(cache.bytes, Ordering::Relaxed);
    }
}

/// The bytes a row's record and images hold, about.
fn weight(row: &Result<Indexed, Reject>) -> u64 {
    const RECORD: u64 = 256;
    let held = match row {
        Ok(Indexed { record, images }) => {
            let text = match &record.content {
                Content::Text(text) => text.len(),
                Content::Conversation(messages) => {
                    messages.iter().map(|m| m.content.len() + 64).sum()
                }
            };
            let images: usize = images.iter().flatten().map(|i| i.len()).sum();
            (text + images + record.id.len()) as u64
        }
        Err(reject) => reject.reason.len() as u64,
    };
    RECORD + held
}

impl RecordIndex for ParquetRows {
    fn len(&self) -> u64 {
        self.0.rows
    }

    fn get(&self, index: u64) -> Result<Indexed, Reject> {
        let inner = &self.0;
        let Some((file, group, at)) = inner.locate(index) else {
            return Err(table_reject(
                index.saturating_add(1),
                None,
                format!("row {index} is past the files' {} rows", inner.rows),
            ));
        };
        let key = (file, group);
        let slot = inner.slot(key, false).expect("made when missing");
        inner.fill(&slot, key);
        match slot.get() {
            Some(rows) => match (rows.read.get(at), &rows.lost) {
                (Some(row), _) => row.clone(),
                (None, lost) => Err(table_reject(
                    index + 1,
                    None,
                    lost.as_deref()
                        .unwrap_or("a row the decoder did not give")
                        .to_owned(),
                )),
            },
            None => Err(table_reject(
                index + 1,
                None,
                format!(
                    "{}: row group {group}: its read ended without its rows",
                    inner.files[file].name
                ),
            )),
        }
    }

    /// Starts reading row `index`'s row group unless it is read or being read, or
    /// [`PREFETCHING`] are being read ahead already.
    fn prefetch(self: Arc<Self>, index: u64) {
        let inner = &self.0;
        let Some((file, group, _)) = inner.locate(index) else {
            return;
        };
        let Some(slot) = inner.slot((file, group), true) else {
            return;
        };
        let ahead = inner.clone();
        inner.runtime.handle().spawn_blocking(move || {
            let _counted = Prefetching(&ahead.reads.prefetching);
            ahead.fill_here(&slot, (file, group));
        });
    }
}
