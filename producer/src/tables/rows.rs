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
//! Row groups are the pieces of a [`Pieces`] cache: read and decoded on the blocking threads of
//! a runtime of its own (8 MiB stacks: decoding recurses along the schema), a few at a time.
//! Memory is the cache, the row groups being read (each its bytes, what decoding it holds and
//! its decoded rows), the rows handed out and not yet made into samples, and the files kept
//! open (at most [`OPEN_FILES`] parsed footers).
//!
//! Every file's footer is read when the stream starts (its rows make the stream's record count)
//! and read again when the file is opened later; a file whose footer or length changed meanwhile,
//! or a local file whose length or modification time changed while it was open, is refused, row
//! group by row group, rather than read as other records. (An S3 object written again while it
//! is open is not seen: ranged GETs are not pinned to an ETag.)

use std::panic::AssertUnwindSafe;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use parquet::file::metadata::ParquetMetaData;

use super::{
    AbortOnDrop, Body, Halt, MAX_ROWS_PER_GROUP, PAGE_LIMIT, RowMaker, Source, TableStats,
    panicked, start_open, table_reject,
};
use crate::feed::Indexed;
use crate::manifest::Reject;
use crate::pieces::{Key, Piece, PieceIndex, Pieces, ReadPiece, Taken, indexed};
use crate::shards::Shard;
use crate::source::Fetch;

/// Files kept open (a file descriptor, or an S3 file's end, and the parsed footer) between
/// row groups.
pub const OPEN_FILES: usize = 16;

/// Footers read at once when the stream starts.
const OPENING: usize = 16;

/// The rows of a list of Parquet files, read by index ([`RecordIndex`](crate::feed::RecordIndex)): the rows of the first
/// file, then the second's, and so on.
pub type ParquetRows = PieceIndex<Tables>;

/// The files, indexed, and what reading a row group of them takes.
pub struct Tables {
    files: Vec<TableFile>,
    rows: u64,
    fetcher: Arc<dyn Fetch>,
    /// The handle of the [`Pieces`]' runtime, which S3 reads run on.
    handle: tokio::runtime::Handle,
    maker: RowMaker,
    page_limit: u64,
    stats: Arc<TableStats>,
    /// Files open, most recently used last.
    open: Mutex<Vec<(usize, Arc<Opened>)>>,
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

impl PieceIndex<Tables> {
    /// Reads every file's footer (local files, or S3 ones through `fetcher`, `OPENING` at a
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
        let runtime = crate::pieces::runtime()?;
        let mut tables = Tables {
            files: Vec::with_capacity(files.len()),
            rows: 0,
            fetcher,
            handle: runtime.handle().clone(),
            maker: RowMaker {
                max_image_bytes,
                image_root,
            },
            page_limit: PAGE_LIMIT,
            stats: Arc::default(),
            open: Mutex::default(),
        };
        tables.index(files)?;
        Ok(PieceIndex(Arc::new(Pieces::new(
            runtime,
            tables,
            cache_bytes,
        ))))
    }

    /// The most bytes a page may state uncompressed [default: [`PAGE_LIMIT`]].
    pub fn with_page_limit(mut self, bytes: u64) -> ParquetRows {
        Arc::get_mut(&mut self.0)
            .expect("set before it is shared")
            .reader
            .page_limit = bytes;
        self
    }

    /// What reading has taken so far.
    pub fn stats(&self) -> Arc<TableStats> {
        self.0.reader.stats.clone()
    }

    /// The files.
    pub fn files(&self) -> usize {
        self.0.reader.files.len()
    }
}

/// The rows of each row group, from their ends.
fn group_rows(ends: &[u64]) -> impl Iterator<Item = u64> + '_ {
    ends.iter()
        .scan(0, |last, &end| Some(end - std::mem::replace(last, end)))
}

impl Tables {
    /// Counts every file's rows from its footer, the next files' ends read meanwhile.
    fn index(&mut self, files: Vec<Shard>) -> Result<(), String> {
        let handle = self.handle.clone();
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
        let handle = &self.handle;
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
            let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(i) = open.iter().position(|(f, _)| *f == file) {
                let entry = open.remove(i);
                let opened = entry.1.clone();
                open.push(entry);
                return Ok(opened);
            }
        }
        let shard = &self.files[file].shard;
        let opened = self.open_with(
            shard,
            start_open(shard, &self.fetcher, &self.stats, &self.handle),
        )?;
        if opened.version != self.files[file].version {
            return Err(CHANGED.into());
        }
        let opened = Arc::new(opened);
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        // (Another thread may have opened it meanwhile: one entry per file.)
        open.retain(|(f, _)| *f != file);
        if open.len() >= OPEN_FILES {
            open.remove(0);
        }
        open.push((file, opened.clone()));
        Ok(opened)
    }

    /// Row group `group` of file `file`, read and decoded: a record or a reject per row.
    fn decode_group(&self, file: usize, group: usize) -> Piece {
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
                        out.push(indexed(input));
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
            let last = first_row + count as u64 - 1;
            let rows = match last > first_row {
                true => format!("rows {first_row} to {last}"),
                false => format!("row {first_row}"),
            };
            format!("{}: row group {group} ({rows}): {reason}", table.name).into()
        });
        Piece::new(out, lost)
    }
}

impl ReadPiece for Tables {
    fn records(&self) -> u64 {
        self.rows
    }

    fn locate(&self, index: u64) -> Option<(Key, usize)> {
        self.locate(index)
            .map(|(file, group, at)| ((file, group), at))
    }

    /// The row groups, over every file.
    fn pieces(&self) -> usize {
        self.files.iter().map(|f| f.ends.len()).sum()
    }

    /// The most rows in one row group.
    fn largest_piece(&self) -> u64 {
        let groups = self.files.iter().flat_map(|f| group_rows(&f.ends));
        groups.max().unwrap_or(0)
    }

    fn read_piece(&self, (file, group): Key) -> Piece {
        self.decode_group(file, group)
    }

    fn reject(&self, line: u64, reason: String) -> Reject {
        table_reject(line, None, reason)
    }

    fn count_lost(&self) {
        self.stats.unreadable.fetch_add(1, Ordering::Relaxed);
    }

    fn describe(&self, (file, group): Key) -> String {
        format!("{}: row group {group}", self.files[file].name)
    }

    fn taken(&self) -> Taken {
        let load = |n: &std::sync::atomic::AtomicU64| n.load(Ordering::Relaxed);
        Taken {
            bytes: load(&self.stats.bytes),
            reads: load(&self.stats.requests),
            note: format!("{} row group(s) read", load(&self.stats.row_groups)),
        }
    }
}
