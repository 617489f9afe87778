//! WebDataset samples by index, for a stream: a stream's tasks name records by index in an
//! order the daemon draws, and a tar shard has no index of its samples, so one is made first.
//!
//! ```text
//! open:  each shard read through once, members passed over ──▶ where each sample starts
//!        ──▶ pieces of about PIECE_BYTES of consecutive samples ──▶ index i ──▶ (shard, piece, k)
//! get i: its piece, read from its first sample's header to the next piece's ──▶ cache
//!        ([`Pieces`], --row-group-cache bytes) ──▶ sample i's record and image bytes
//! ```
//!
//! The index pass runs the same reader as a one-pass read (`ShardReader`), with member data
//! passed over: a shard is read a chunk at a time, and a member past the chunk is jumped over,
//! not read. It records where each sample starts (its first member's header, or the pax / GNU
//! long-name headers before it) and what a piece's first sample took from the members before it
//! (a header lost just before it: `Gathered::carried`), so a piece read from there gives each of
//! its samples as the one-pass read gave it (the mutation test compares them sample by sample
//! over hundreds of damaged shards). A piece ends where the next one's first sample starts, or
//! at the shard's end; its read runs a chunk or so past that end, to see where the next sample
//! starts.
//!
//! A shard that cannot be read to its end (missing, not a tar file, a read that failed after
//! its retries), or that ends without tar's end-of-archive blocks where no sample says so, is
//! an error naming it: the stream's record count is fixed before it starts. A
//! local shard written again after the index was made (its length or modification time
//! differ) is refused piece by piece rather than read as other samples; an S3 shard is not
//! checked (ranged GETs are not pinned to an ETag).

use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::{Body, Gathered, Shard, ShardReader, ShardStats, Step, shard_reject};
use crate::feed::Indexed;
use crate::manifest::Reject;
use crate::pieces::{Key, Piece, PieceIndex, Pieces, ReadPiece, Taken};
use crate::source::{Fetch, ImageSource};

/// About the bytes of consecutive samples read as one piece (a few ranged GETs from S3).
pub const PIECE_BYTES: u64 = 8 << 20;

/// The samples of a list of shards, read by index ([`RecordIndex`](crate::feed::RecordIndex)): the samples of the first
/// shard, in its order, then the second's, and so on.
pub type ShardRows = PieceIndex<ShardPieces>;

/// The shards, indexed, and what reading a piece of them takes.
pub struct ShardPieces {
    shards: Vec<IndexedShard>,
    samples: u64,
    fetcher: Arc<dyn Fetch>,
    handle: tokio::runtime::Handle,
    max_image_bytes: u64,
    stats: Arc<ShardStats>,
}

/// A shard as it was indexed.
#[derive(Debug)]
struct IndexedShard {
    shard: Shard,
    name: Arc<str>,
    /// The index of its first sample.
    first: u64,
    /// Its pieces, in order.
    pieces: Vec<ShardPiece>,
    /// A local shard's length and modification time when it was indexed.
    stamp: Option<Stamp>,
}

/// A local file's length and modification time.
type Stamp = (u64, Option<std::time::SystemTime>);

/// Consecutive samples of a shard.
#[derive(Debug, Clone)]
struct ShardPiece {
    /// Where its first sample starts.
    start: u64,
    /// Where the next piece's first sample starts (`None`: the shard's end).
    end: Option<u64>,
    /// Its first sample's place in the shard, and its samples.
    first: u64,
    samples: u64,
    /// The problem its first sample took from the members before it (`Gathered::carried`),
    /// which a read starting at `start` must be told.
    carried: Option<Arc<str>>,
}

impl PieceIndex<ShardPieces> {
    /// Indexes `shards` (local, or S3 through `fetcher`), one after another, in pieces of about
    /// `piece_bytes` ([`PIECE_BYTES`]); images of at most `max_image_bytes`; at most
    /// `cache_bytes` of samples kept (and always the piece read last). `progress` is told each
    /// shard indexed, with the samples so far, and asked between members whether to go on
    /// (`None`: told; `false` stops indexing with an error).
    pub fn open(
        shards: Vec<Shard>,
        fetcher: Arc<dyn Fetch>,
        max_image_bytes: u64,
        (piece_bytes, cache_bytes): (u64, u64),
        mut progress: impl FnMut(Option<(usize, u64)>) -> bool,
    ) -> Result<ShardRows, String> {
        let runtime = crate::pieces::runtime()?;
        let mut pieces = ShardPieces {
            shards: Vec::with_capacity(shards.len()),
            samples: 0,
            fetcher,
            handle: runtime.handle().clone(),
            max_image_bytes,
            stats: Arc::default(),
        };
        for (i, shard) in shards.into_iter().enumerate() {
            pieces.index(shard, piece_bytes, &mut || progress(None))?;
            progress(Some((i + 1, pieces.samples)));
        }
        Ok(PieceIndex(Arc::new(Pieces::new(
            runtime,
            pieces,
            cache_bytes,
        ))))
    }

    /// What reading has taken so far (the index pass included).
    pub fn stats(&self) -> Arc<ShardStats> {
        self.0.reader.stats.clone()
    }
}

/// A local shard's body and its length and modification time; an S3 shard's body.
fn open_body(shard: &Shard, fetcher: &Arc<dyn Fetch>) -> Result<(Body, Option<Stamp>), String> {
    match shard {
        Shard::Local(path) => {
            let file = crate::input::open_regular(path)
                .map_err(|e| format!("cannot open shard {shard}: {e}"))?;
            let meta = file
                .metadata()
                .map_err(|e| format!("cannot stat shard {shard}: {e}"))?;
            let stamp = (meta.len(), meta.modified().ok());
            Ok((
                Body::Local {
                    file,
                    len: meta.len(),
                },
                Some(stamp),
            ))
        }
        Shard::S3 { bucket, key } => Ok((
            Body::Remote {
                fetcher: fetcher.clone(),
                source: ImageSource::S3 {
                    bucket: bucket.clone(),
                    key: key.clone(),
                },
                ahead: None,
            },
            None,
        )),
    }
}

impl ShardPieces {
    /// Reads `shard` through, members passed over, and adds its samples to the index.
    /// `more` is asked between members whether to go on.
    fn index(
        &mut self,
        shard: Shard,
        piece_bytes: u64,
        more: &mut dyn FnMut() -> bool,
    ) -> Result<(), String> {
        let name: Arc<str> = shard.to_string().into();
        let (body, stamp) = open_body(&shard, &self.fetcher)?;
        let before = self.stats.unreadable.load(Ordering::Relaxed);
        let mut reader = ShardReader::new(
            name.clone(),
            body,
            0,
            self.stats.clone(),
            self.max_image_bytes,
        );
        reader.index_only = true;
        // Consecutive samples, about `piece_bytes` at a time, grouped as they come.
        let mut pieces: Vec<ShardPiece> = Vec::new();
        let mut count = 0u64;
        let mut add = |sample: Gathered| {
            match pieces.last_mut() {
                // (Starts only grow; were one to go back, its piece's read would come up short
                // and reject what it lacks.)
                Some(piece) if sample.start.saturating_sub(piece.start) < piece_bytes => {
                    piece.samples += 1
                }
                last => {
                    if let Some(piece) = last {
                        piece.end = Some(sample.start);
                    }
                    pieces.push(ShardPiece {
                        start: sample.start,
                        end: None,
                        first: count,
                        samples: 1,
                        carried: sample.carried.map(Arc::from),
                    });
                }
            }
            count += 1;
        };
        let why = self.handle.block_on(async {
            loop {
                if !more() {
                    break Some("stopped by an interrupt while it was indexed".to_owned());
                }
                match reader.step().await {
                    Step::Sample(sample) => add(sample),
                    Step::Member => {}
                    Step::End { whole, cut, why } => {
                        whole.into_iter().chain(cut).for_each(&mut add);
                        break why;
                    }
                }
            }
        });
        // A shard that could not be read to its end, or that ended without a sample to say why
        // (empty, or cut short between samples, where a sample may be missing): the one-pass
        // read would reject it as a whole; the index refuses it.
        if let Some(why) = why {
            return Err(why);
        }
        if self.stats.unreadable.load(Ordering::Relaxed) > before {
            return Err(format!("{name}: could not be read to its end"));
        }
        let first = self.samples;
        self.samples += count;
        self.shards.push(IndexedShard {
            shard,
            name,
            first,
            pieces,
            stamp,
        });
        Ok(())
    }

    /// Where sample `index` is: (shard, piece, sample within it).
    fn locate(&self, index: u64) -> Option<(usize, usize, usize)> {
        if index >= self.samples {
            return None;
        }
        // Shards with no samples share their first index with the next: the last one is it.
        let shard = self.shards.partition_point(|s| s.first <= index) - 1;
        let within = index - self.shards[shard].first;
        let pieces = &self.shards[shard].pieces;
        let piece = pieces.partition_point(|p| p.first <= within) - 1;
        Some((shard, piece, (within - pieces[piece].first) as usize))
    }

    /// Piece `piece` of shard `shard`, read from its first sample to the next piece's.
    fn read(&self, shard: usize, piece: usize) -> Piece {
        let indexed = &self.shards[shard];
        let at = &indexed.pieces[piece];
        let mut out: Vec<Result<Indexed, Reject>> = Vec::with_capacity(at.samples as usize);
        let reading = Arc::new(ShardStats::default());
        let first_line = indexed.first + at.first + 1;
        let read = (|| -> Result<Option<String>, String> {
            let (body, stamp) = open_body(&indexed.shard, &self.fetcher)?;
            if stamp != indexed.stamp {
                return Err(
                    "it changed since the stream started (its length or modification time \
                     differ: written again?): its samples are no longer the stream's records"
                        .into(),
                );
            }
            // (Its own stats: a piece that fails is counted once, by the cache.)
            let mut reader = ShardReader::new(
                indexed.name.clone(),
                body,
                at.start,
                reading.clone(),
                self.max_image_bytes,
            );
            reader.stop_at = at.end;
            reader.pending_problem = at.carried.as_deref().map(str::to_owned);
            let take = |sample: Gathered, out: &mut Vec<Result<Indexed, Reject>>| {
                if (out.len() as u64) < at.samples {
                    let line = first_line + out.len() as u64;
                    out.push(crate::pieces::indexed(sample.into_input(line)));
                }
            };
            Ok(self.handle.block_on(async {
                loop {
                    match reader.step().await {
                        Step::Sample(sample) => take(sample, &mut out),
                        Step::Member => {}
                        Step::End { whole, cut, why } => {
                            for sample in whole.into_iter().chain(cut) {
                                take(sample, &mut out);
                            }
                            break why;
                        }
                    }
                }
            }))
        })();
        let load = |n: &std::sync::atomic::AtomicU64| n.load(Ordering::Relaxed);
        (self.stats.requests).fetch_add(load(&reading.requests), Ordering::Relaxed);
        (self.stats.bytes).fetch_add(load(&reading.bytes), Ordering::Relaxed);
        (self.stats.peak_held).fetch_max(load(&reading.peak_held), Ordering::Relaxed);
        let failure = match read {
            Ok(_) if out.len() as u64 == at.samples => None,
            Ok(why) => Some(why.unwrap_or_else(|| {
                format!(
                    "it gave {} samples where its index had {}",
                    out.len(),
                    at.samples
                )
            })),
            Err(reason) => Some(reason),
        };
        let lost: Option<Arc<str>> = failure.map(|reason| {
            format!(
                "{}: the samples from byte {} (samples {} to {} of the shard): {reason}",
                indexed.name,
                at.start,
                at.first,
                at.first + at.samples - 1
            )
            .into()
        });
        Piece::new(out, lost)
    }
}

impl ReadPiece for ShardPieces {
    fn records(&self) -> u64 {
        self.samples
    }

    fn locate(&self, index: u64) -> Option<(Key, usize)> {
        self.locate(index)
            .map(|(shard, piece, at)| ((shard, piece), at))
    }

    fn pieces(&self) -> usize {
        self.shards.iter().map(|s| s.pieces.len()).sum()
    }

    fn largest_piece(&self) -> u64 {
        let pieces = self.shards.iter().flat_map(|s| s.pieces.iter());
        pieces.map(|p| p.samples).max().unwrap_or(0)
    }

    fn read_piece(&self, (shard, piece): Key) -> Piece {
        self.read(shard, piece)
    }

    fn reject(&self, line: u64, reason: String) -> Reject {
        shard_reject(line, None, reason)
    }

    fn count_lost(&self) {
        self.stats.unreadable.fetch_add(1, Ordering::Relaxed);
    }

    fn describe(&self, (shard, piece): Key) -> String {
        let indexed = &self.shards[shard];
        let start = indexed.pieces[piece].start;
        format!("{}: the samples from byte {start}", indexed.name)
    }

    fn taken(&self) -> Taken {
        Taken {
            bytes: self.stats.bytes.load(Ordering::Relaxed),
            reads: self.stats.requests.load(Ordering::Relaxed),
            note: "the index pass included".into(),
        }
    }
}
