//! Records read by index from files read a piece at a time (a Parquet row group; a run of a
//! shard's samples): a stream's tasks name records in an order the daemon draws, so a record is
//! read by reading its piece whole, and the piece's records are kept while the ranks read the
//! rest of it.
//!
//! ```text
//! get (key, at) ──▶ cache: a OnceLock per piece (LRU, at most cache_bytes) ──▶ record `at`
//!                     └─ missing: read on the runtime's blocking threads (8 MiB stacks),
//!                        at most READS_AT_ONCE at a time: one waited for, PREFETCHING ahead
//! ```
//!
//! A thread asking for a piece being read waits for that read instead of reading it again. The
//! piece read last always stays; the least recently used go first once the cache is over its
//! bytes. Memory is the cache, up to [`READS_AT_ONCE`] pieces being read, and the records
//! handed out.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};

use crate::feed::{Indexed, RecordIndex};
use crate::manifest::{Content, Reject};
use crate::pipeline::Input;

/// A piece: (file, piece within it).
pub type Key = (usize, usize);

/// Pieces read ahead at once.
pub const PREFETCHING: u64 = 2;

/// Pieces read at once: one a reader waits for, and those read ahead.
pub const READS_AT_ONCE: usize = 1 + PREFETCHING as usize;

/// The most pieces the cache tracks, whatever their size.
const MAX_CACHED: usize = 4096;

/// The default bytes of records kept.
pub const DEFAULT_CACHE_BYTES: u64 = 1 << 30;

/// The stack of a thread that reads a piece (decoders may recurse).
const READ_STACK: usize = 8 << 20;

/// A piece's records: each read a record or why it is not one; past them, when the piece could
/// not be read to its end, why (one reason for every record lost, not a copy each).
pub struct Piece {
    read: Vec<Result<Indexed, Reject>>,
    lost: Option<Arc<str>>,
    /// The bytes they hold, about.
    bytes: u64,
}

impl Piece {
    pub(crate) fn new(read: Vec<Result<Indexed, Reject>>, lost: Option<Arc<str>>) -> Piece {
        let bytes =
            read.iter().map(weight).sum::<u64>() + lost.as_ref().map_or(0, |r| r.len() as u64);
        Piece { read, lost, bytes }
    }
}

/// The bytes a record and its images hold, about.
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

/// What reads a piece, and knows where each record is.
pub trait ReadPiece: Send + Sync + 'static {
    /// How many records there are.
    fn records(&self) -> u64;

    /// Where record `index` is: its piece, and its place in it (`None` past the last).
    fn locate(&self, index: u64) -> Option<(Key, usize)>;

    /// How many pieces there are.
    fn pieces(&self) -> usize;

    /// The most records in one piece (0 with none).
    fn largest_piece(&self) -> u64;

    /// Piece `key`, read whole (blocking, on one of the runtime's blocking threads).
    fn read_piece(&self, key: Key) -> Piece;

    /// A reject of the record on `line`, for `reason`.
    fn reject(&self, line: u64, reason: String) -> Reject;

    /// Piece `key` in words, for a reject (`FILE: row group 3`).
    fn describe(&self, key: Key) -> String;

    /// Counts a piece that could not be read whole, once a piece however often it is read
    /// (the reader's own `unreadable`).
    fn count_lost(&self);

    /// What reading has taken so far.
    fn taken(&self) -> Taken;
}

/// What reading has taken: bytes, reads (ranged GETs, `pread`s), and what else to say.
#[derive(Debug, Clone)]
pub struct Taken {
    /// Bytes read.
    pub bytes: u64,
    /// Reads issued.
    pub reads: u64,
    /// What else to say of them (`3 row group(s) read`).
    pub note: String,
}

/// A piece's input as a record read by index.
pub(crate) fn indexed(input: Input) -> Result<Indexed, Reject> {
    match input {
        Input::Read(record, images) => Ok(Indexed {
            record,
            images: Some(images),
        }),
        Input::Record(record) => Ok(Indexed {
            record,
            images: None,
        }),
        Input::Rejected(reject) => Err(reject),
    }
}

/// Records read by index through a cache of the pieces `R` reads ([`RecordIndex`]):
/// `tables::ParquetRows`, `shards::ShardRows`.
pub struct PieceIndex<R>(pub(crate) Arc<Pieces<R>>);

impl<R: ReadPiece> std::fmt::Debug for PieceIndex<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PieceIndex")
            .field("records", &self.0.reader.records())
            .finish_non_exhaustive()
    }
}

impl<R: ReadPiece> PieceIndex<R> {
    /// How the cache served reads so far.
    pub fn reads(&self) -> &ReadStats {
        &self.0.reads
    }

    /// How many pieces there are (Parquet row groups, runs of a shard's samples).
    pub fn pieces(&self) -> usize {
        self.0.reader.pieces()
    }

    /// The most records in one piece (0 with none).
    pub fn largest_piece(&self) -> u64 {
        self.0.reader.largest_piece()
    }

    /// What reading has taken so far.
    pub fn taken(&self) -> Taken {
        self.0.reader.taken()
    }
}

impl<R: ReadPiece> RecordIndex for PieceIndex<R> {
    fn len(&self) -> u64 {
        self.0.reader.records()
    }

    fn get(&self, index: u64) -> Result<Indexed, Reject> {
        match self.0.reader.locate(index) {
            Some((key, at)) => self.0.get(key, at, index + 1),
            None => Err(self.0.reader.reject(
                index.saturating_add(1),
                format!(
                    "record {index} is past the {} records",
                    self.0.reader.records()
                ),
            )),
        }
    }

    /// Starts reading record `index`'s piece unless it is read or being read, or enough are
    /// being read ahead already.
    fn prefetch(self: Arc<Self>, index: u64) {
        if let Some((key, _)) = self.0.reader.locate(index) {
            self.0.prefetch(key);
        }
    }
}

/// How the cache served reads.
#[derive(Debug, Default)]
pub struct ReadStats {
    /// Pieces being read ahead now.
    pub prefetching: AtomicU64,
    /// Pieces read again after the cache let them go.
    pub reread: AtomicU64,
    /// The most bytes of records the cache held.
    pub peak_bytes: AtomicU64,
}

/// Pieces read, most recently used last.
#[derive(Default)]
struct Cache {
    pieces: Vec<Slot>,
    bytes: u64,
    /// Pieces ever read, to count those read again.
    seen: HashSet<Key>,
    /// Pieces that could not be read whole, counted once each ([`ReadPiece::count_lost`]).
    lost: HashSet<Key>,
}

struct Slot {
    key: Key,
    /// Filled once, by whichever reader asked first; others wait for it.
    piece: Arc<OnceLock<Piece>>,
    /// Its bytes once read (0 while being read).
    bytes: u64,
}

/// A runtime for reading pieces (on its blocking threads) and S3 (on its worker), shut down
/// without waiting wherever it is dropped.
struct IoRuntime(Option<tokio::runtime::Runtime>);

impl Drop for IoRuntime {
    fn drop(&mut self) {
        if let Some(runtime) = self.0.take() {
            runtime.shutdown_background();
        }
    }
}

/// The runtime a [`Pieces`] reads on: one worker thread for S3, blocking threads with
/// [`READ_STACK`].
pub(crate) fn runtime() -> Result<tokio::runtime::Runtime, String> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("feedstore-pieces")
        .thread_stack_size(READ_STACK)
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the reader's runtime: {e}"))
}

/// A cache of pieces read by `reader`.
pub struct Pieces<R> {
    pub(crate) reader: R,
    runtime: IoRuntime,
    cache_bytes: u64,
    reads: ReadStats,
    cache: Mutex<Cache>,
    /// Pieces being read, and a wake-up when one is done.
    reading: Mutex<usize>,
    read_done: Condvar,
}

/// One of [`READS_AT_ONCE`], given back when dropped.
struct Reading<'a, R>(&'a Pieces<R>);

impl<R> Drop for Reading<'_, R> {
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

impl<R: ReadPiece> Pieces<R> {
    /// Pieces read by `reader` on `runtime` ([`runtime`]), at most `cache_bytes` of records kept.
    pub(crate) fn new(runtime: tokio::runtime::Runtime, reader: R, cache_bytes: u64) -> Self {
        Pieces {
            reader,
            runtime: IoRuntime(Some(runtime)),
            cache_bytes,
            reads: ReadStats::default(),
            cache: Mutex::default(),
            reading: Mutex::new(0),
            read_done: Condvar::new(),
        }
    }

    fn handle(&self) -> &tokio::runtime::Handle {
        self.runtime.0.as_ref().expect("until dropped").handle()
    }

    fn cache(&self) -> std::sync::MutexGuard<'_, Cache> {
        self.cache.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Record `at` of piece `key`, the record on `line`: read with its piece unless the cache
    /// holds it. Blocking; not on an async runtime's thread.
    pub(crate) fn get(self: &Arc<Self>, key: Key, at: usize, line: u64) -> Result<Indexed, Reject> {
        let slot = self.slot(key, false).expect("made when missing");
        self.fill(&slot, key);
        match slot.get() {
            Some(piece) => match (piece.read.get(at), &piece.lost) {
                (Some(record), _) => record.clone(),
                // (Its reason names the piece.)
                (None, Some(lost)) => Err(self.reader.reject(line, lost.to_string())),
                (None, None) => Err(self.reader.reject(
                    line,
                    format!("{}: a record it did not give", self.reader.describe(key)),
                )),
            },
            None => Err(self.reader.reject(
                line,
                format!(
                    "{}: its read ended without its records",
                    self.reader.describe(key)
                ),
            )),
        }
    }

    /// Starts reading piece `key` unless it is read or being read, or [`PREFETCHING`] are
    /// being read ahead already.
    pub(crate) fn prefetch(self: &Arc<Self>, key: Key) {
        let Some(slot) = self.slot(key, true) else {
            return;
        };
        let ahead = self.clone();
        self.handle().spawn_blocking(move || {
            let _counted = Prefetching(&ahead.reads.prefetching);
            ahead.fill_here(&slot, key);
        });
    }

    /// Piece `key`'s slot in the cache, made (and counted) when missing, now its most recently
    /// used. With `ahead`, only a slot made here for a read ahead, when fewer than
    /// [`PREFETCHING`] are under way (which it then counts).
    fn slot(&self, key: Key, ahead: bool) -> Option<Arc<OnceLock<Piece>>> {
        let mut cache = self.cache();
        if let Some(i) = cache.pieces.iter().position(|s| s.key == key) {
            // Most recently used last (a hint too: its records are wanted soon).
            let slot = cache.pieces.remove(i);
            let piece = slot.piece.clone();
            cache.pieces.push(slot);
            return (!ahead).then_some(piece);
        }
        if ahead && self.reads.prefetching.fetch_add(1, Ordering::Relaxed) >= PREFETCHING {
            self.reads.prefetching.fetch_sub(1, Ordering::Relaxed);
            return None;
        }
        if !cache.seen.insert(key) {
            self.reads.reread.fetch_add(1, Ordering::Relaxed);
        }
        let piece = Arc::new(OnceLock::new());
        cache.pieces.push(Slot {
            key,
            piece: piece.clone(),
            bytes: 0,
        });
        Some(piece)
    }

    /// Reads piece `key` into `slot` unless another thread read it or is reading it (then
    /// waited for), on one of the runtime's blocking threads (a reader's thread waits here).
    fn fill(self: &Arc<Self>, slot: &Arc<OnceLock<Piece>>, key: Key) {
        if slot.get().is_some() {
            return;
        }
        let (pieces, filling) = (self.clone(), slot.clone());
        let read = self
            .handle()
            .spawn_blocking(move || pieces.fill_here(&filling, key));
        // A read that panicked leaves the slot empty: the next reader tries again.
        let _ = self.handle().block_on(read);
    }

    /// [`Pieces::fill`] on this thread, one of the runtime's blocking threads.
    fn fill_here(&self, slot: &Arc<OnceLock<Piece>>, key: Key) {
        let mut filled = false;
        let piece = slot.get_or_init(|| {
            filled = true;
            self.read(key)
        });
        if filled {
            if piece.lost.is_some() && self.cache().lost.insert(key) {
                self.reader.count_lost();
            }
            self.settle(slot, key, piece.bytes);
        }
    }

    /// Piece `key`, read once a read is free.
    fn read(&self, key: Key) -> Piece {
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
        self.reader.read_piece(key)
    }

    /// Counts `slot`'s `bytes` (piece `key`) in the cache, if it is still there, then lets the
    /// least recently used pieces go until the cache is within its bytes (the one just read
    /// stays).
    fn settle(&self, slot: &Arc<OnceLock<Piece>>, key: Key, bytes: u64) {
        let mut cache = self.cache();
        if let Some(listed) = cache
            .pieces
            .iter_mut()
            .find(|s| Arc::ptr_eq(&s.piece, slot))
        {
            listed.bytes = bytes;
            cache.bytes += bytes;
        }
        while cache.bytes > self.cache_bytes || cache.pieces.len() > MAX_CACHED {
            // The least recently used that is counted (one being read holds nothing yet).
            let Some(i) = cache
                .pieces
                .iter()
                .position(|s| s.key != key && s.bytes > 0)
            else {
                break;
            };
            let gone = cache.pieces.remove(i);
            cache.bytes -= gone.bytes;
        }
        self.reads
            .peak_bytes
            .fetch_max(cache.bytes, Ordering::Relaxed);
    }
}
