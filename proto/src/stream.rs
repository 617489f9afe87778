//! What a stream is: which record each rank gets at each position of each epoch.
//!
//! A stream's order is a pure function of its [`StreamSpec`] (record count, seed, world size,
//! shuffle, tail policy), an epoch, a rank and a position. Nothing about it depends on which
//! producer finished first, how deep the prefetch was, or what was in flight when a process died:
//! a consumer's whole position is the pair ([`StreamState::epoch`], [`StreamState::position`]),
//! and resuming from it yields exactly the samples an uninterrupted run would have yielded next.
//!
//! The shuffle is a keyed pseudo-random permutation computed per index (a Feistel network over the
//! index bits, cycle-walked into `[0, n)`), so a full permutation of a billion records costs no
//! memory and any position is found in O(1): resume never replays an epoch to find its place.
//! [`Shuffle::Block`] permutes blocks of consecutive records and the records within each block,
//! for sources that are cheaper to read in runs.
//!
//! Ranks share an epoch the way PyTorch's `DistributedSampler` does: the permuted order is dealt
//! round-robin, rank `r` taking global slots `r, r + world, r + 2·world, …`. Every rank gets the
//! same count ([`Tail::Drop`] drops the last `n mod world` records of the epoch's order,
//! [`Tail::Pad`] wraps around to its start), so data-parallel ranks never wait on an uneven tail.

use std::sync::Arc;

pub mod reshard;

use reshard::Reshard;

/// Longest stream name, in bytes.
pub const MAX_STREAM_NAME: usize = 128;

/// How records are ordered within an epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Shuffle {
    /// Manifest order, every epoch.
    None,
    /// A fresh full permutation each epoch.
    Full,
    /// Blocks of this many consecutive records in a fresh order each epoch, the records within a
    /// block permuted too; a short last block stays last.
    Block(u32),
}

/// What to do with the `n mod world` records that do not divide evenly among ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Tail {
    /// Leave them out of this epoch (a different set each epoch when shuffled).
    Drop,
    /// Give the short ranks repeats from the start of the epoch's order.
    Pad,
}

impl std::fmt::Display for Shuffle {
    /// As `--shuffle` takes it: `none`, `full`, `block:N`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Shuffle::None => f.write_str("none"),
            Shuffle::Full => f.write_str("full"),
            Shuffle::Block(n) => write!(f, "block:{n}"),
        }
    }
}

impl std::fmt::Display for Tail {
    /// As `--tail` takes it: `drop`, `pad`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Tail::Drop => "drop",
            Tail::Pad => "pad",
        })
    }
}

impl std::str::FromStr for Shuffle {
    type Err = String;

    /// `none`, `full` or `block:N` (N > 0), as the command line and the Python API spell it.
    fn from_str(s: &str) -> Result<Shuffle, String> {
        match s.to_ascii_lowercase().as_str() {
            "full" => Ok(Shuffle::Full),
            "none" => Ok(Shuffle::None),
            other => match other.strip_prefix("block:").map(str::parse) {
                Some(Ok(n)) if n > 0 => Ok(Shuffle::Block(n)),
                _ => Err(format!("shuffle {other:?}: expected full, none or block:N")),
            },
        }
    }
}

impl std::str::FromStr for Tail {
    type Err = String;

    /// `drop` or `pad`.
    fn from_str(s: &str) -> Result<Tail, String> {
        match s.to_ascii_lowercase().as_str() {
            "drop" => Ok(Tail::Drop),
            "pad" => Ok(Tail::Pad),
            other => Err(format!("tail {other:?}: expected drop or pad")),
        }
    }
}

/// Everything that fixes a stream's order. Producers and consumers of one stream must agree on
/// it; the daemon refuses an open whose spec differs from the stream's.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct StreamSpec {
    /// The stream's name, unique on the node (e.g. the job and dataset).
    pub name: String,
    /// Records in the source (manifest lines).
    pub records: u64,
    /// Seeds the shuffle.
    pub seed: u64,
    /// Data-parallel ranks sharing the records.
    pub world: u32,
    /// Order within an epoch.
    pub shuffle: Shuffle,
    /// Uneven tail policy.
    pub tail: Tail,
    /// Epochs to run; `None` runs until the stream is closed.
    pub epochs: Option<u64>,
    /// What a run at another world size left unread, when this stream resumes one
    /// ([`crate::reshard`]): each rank first reads its share of it, then this spec's ordinary
    /// epochs from [`Reshard::next_epoch`] on. `None` for a stream read from its start or
    /// resumed at the world size it was saved at.
    pub reshard: Option<Arc<Reshard>>,
}

/// Samples made ahead of each rank when a producer names no depth.
pub const DEFAULT_DEPTH: u32 = 64;

/// The prefetch depth of a stream whose producer names none: [`DEFAULT_DEPTH`], and for a
/// stream of placed batches of `batch` samples at least three batches: one the trainer holds,
/// one ready for its next step and one being made. (Two made the trainer wait 18-20% of its
/// time on the demo's workload, three 0.1%: BENCHMARKS.md, "Zero-copy batches at the default
/// depth".)
pub fn default_depth(batch: u32) -> u32 {
    DEFAULT_DEPTH.max(batch.saturating_mul(3))
}

impl StreamSpec {
    /// What differs from `other`, in words: `records 40 (asked: 41), seed 0 (asked: 1)`, this
    /// spec's values first.
    pub fn differences(&self, other: &StreamSpec) -> String {
        let epochs = |e: Option<u64>| e.map_or("unbounded".to_string(), |e| e.to_string());
        let fields = [
            (
                "records",
                self.records.to_string(),
                other.records.to_string(),
            ),
            ("seed", self.seed.to_string(), other.seed.to_string()),
            ("world", self.world.to_string(), other.world.to_string()),
            (
                "shuffle",
                self.shuffle.to_string(),
                other.shuffle.to_string(),
            ),
            ("tail", self.tail.to_string(), other.tail.to_string()),
            ("epochs", epochs(self.epochs), epochs(other.epochs)),
            (
                "resumed from",
                Reshard::describe(self.reshard.as_deref()),
                Reshard::describe(other.reshard.as_deref()),
            ),
        ];
        fields
            .iter()
            .filter(|(_, a, b)| a != b)
            .map(|(name, a, b)| format!("{name} {a} (asked: {b})"))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// Why a spec or state is unusable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SpecError {
    /// World size zero.
    #[error("world size must be at least 1")]
    NoRanks,
    /// A rank outside the world.
    #[error("rank {rank} is outside a world of {world}")]
    RankOutOfRange {
        /// The rank asked for.
        rank: u32,
        /// The world size.
        world: u32,
    },
    /// Fewer records than ranks under [`Tail::Drop`], or none at all.
    #[error("{records} records cannot give each of {world} ranks a sample")]
    TooFewRecords {
        /// Records in the source.
        records: u64,
        /// The world size.
        world: u32,
    },
    /// A zero block size.
    #[error("block shuffle needs a block size of at least 1")]
    EmptyBlock,
    /// `Some(0)` epochs: a stream runs at least one epoch (`None` runs until closed).
    #[error("a stream runs at least one epoch (none: until it is closed)")]
    NoEpochs,
    /// Name empty, too long, or with control characters.
    #[error("stream name must be 1..={MAX_STREAM_NAME} bytes of printable text")]
    BadName,
    /// A reshard of another stream, or to another world size.
    #[error("the reshard the stream resumes belongs to another stream or world size")]
    OtherReshard,
}

impl StreamSpec {
    /// Checks the spec makes sense for `rank`.
    pub fn check(&self, rank: u32) -> Result<(), SpecError> {
        if self.name.is_empty()
            || self.name.len() > MAX_STREAM_NAME
            || self.name.chars().any(char::is_control)
        {
            return Err(SpecError::BadName);
        }
        if self.world == 0 {
            return Err(SpecError::NoRanks);
        }
        if rank >= self.world {
            return Err(SpecError::RankOutOfRange {
                rank,
                world: self.world,
            });
        }
        if self.shuffle == Shuffle::Block(0) {
            return Err(SpecError::EmptyBlock);
        }
        if self.epochs == Some(0) {
            return Err(SpecError::NoEpochs);
        }
        if self.per_rank() == 0 {
            return Err(SpecError::TooFewRecords {
                records: self.records,
                world: self.world,
            });
        }
        if self.reshard.as_ref().is_some_and(|r| !r.resumed_by(self)) {
            return Err(SpecError::OtherReshard);
        }
        Ok(())
    }

    /// The spec without its reshard: the stream's ordinary epochs.
    pub fn plain(&self) -> StreamSpec {
        StreamSpec {
            reshard: None,
            ..self.clone()
        }
    }

    /// Samples each rank gets per epoch.
    pub fn per_rank(&self) -> u64 {
        let world = u64::from(self.world.max(1));
        match self.tail {
            Tail::Drop => self.records / world,
            Tail::Pad => self.records.div_ceil(world),
        }
    }

    /// The sequence number one past the last sample of `rank`, if the stream ends. (Ranks of
    /// a resharded stream may end one sample apart: see [`Reshard::share`].)
    pub fn end_seq(&self, rank: u32) -> Option<u64> {
        let epochs = self.epochs?;
        Some(match &self.reshard {
            None => epochs.saturating_mul(self.per_rank()),
            Some(r) => r.share(rank).saturating_add(
                epochs
                    .saturating_sub(r.next_epoch())
                    .saturating_mul(self.per_rank()),
            ),
        })
    }

    /// The record (manifest index) a rank gets at a sequence number (`epoch · per_rank +
    /// position`; of a resharded stream, its share of the reshard first). Call
    /// [`StreamSpec::check`] first.
    pub fn record_at(&self, rank: u32, seq: u64) -> u64 {
        match &self.reshard {
            None => self.ordinary_record_at(rank, seq),
            Some(r) => r.record_at(rank, seq),
        }
    }

    /// The epoch of a rank's sample at a sequence number (of a resharded stream's share of
    /// the reshard, the epoch the sample was left from).
    pub fn epoch_at(&self, rank: u32, seq: u64) -> u64 {
        match &self.reshard {
            None => seq / self.per_rank().max(1),
            Some(r) => r.epoch_at(rank, seq),
        }
    }

    /// [`StreamSpec::record_at`] in the ordinary epochs, the reshard aside.
    pub(crate) fn ordinary_record_at(&self, rank: u32, seq: u64) -> u64 {
        let per_rank = self.per_rank();
        let (epoch, position) = (seq / per_rank, seq % per_rank);
        let slot = position * u64::from(self.world) + u64::from(rank);
        self.permuted(epoch, slot % self.records)
    }

    /// The records to try, in order, for a rank's sequence number: its own record, then the next
    /// positions of the same rank's share of the epoch, wrapping (of a resharded stream's
    /// remainder, the rank's share of that). A producer uses the first that makes a good
    /// sample, so a rejected record is replaced the same way on every run and every rank
    /// still gets its count of samples.
    pub fn candidates(&self, rank: u32, seq: u64) -> impl Iterator<Item = u64> + '_ {
        (0..).map_while(move |k| self.candidate(rank, seq, k))
    }

    /// The `k`-th of [`StreamSpec::candidates`], or `None` past the last.
    pub fn candidate(&self, rank: u32, seq: u64, k: u64) -> Option<u64> {
        let (seq, base) = match &self.reshard {
            Some(r) => {
                let share = r.share(rank);
                if seq < share {
                    return (k < share).then(|| r.record_at(rank, (seq + k) % share));
                }
                (seq - share, r.next_epoch() * self.per_rank())
            }
            None => (seq, 0),
        };
        let per_rank = self.per_rank();
        let (epoch, position) = (seq / per_rank, seq % per_rank);
        (k < per_rank).then(|| {
            let seq = (epoch * per_rank + (position + k) % per_rank).saturating_add(base);
            self.ordinary_record_at(rank, seq)
        })
    }

    /// Position `i` of epoch `epoch`'s order, as a record index.
    fn permuted(&self, epoch: u64, i: u64) -> u64 {
        let n = self.records;
        let key = mix(self.seed ^ mix(epoch.wrapping_add(0x5EED)));
        match self.shuffle {
            Shuffle::None => i,
            Shuffle::Full => permute(i, n, key),
            Shuffle::Block(b) => {
                let b = u64::from(b);
                let full_blocks = n / b;
                let (block, offset) = (i / b, i % b);
                if block >= full_blocks {
                    // The short last block stays last; its records are still permuted.
                    let size = n - full_blocks * b;
                    return full_blocks * b + permute(offset, size, mix(key ^ block));
                }
                let physical = permute(block, full_blocks, key);
                physical * b + permute(offset, b, mix(key ^ physical ^ 0xB10C))
            }
        }
    }

    /// A 64-bit digest of the spec, carried in states so a resume can tell it belongs here.
    ///
    /// Computed from [`StreamSpec::canonical_bytes`], a versioned encoding of its own, never
    /// from the wire form: a protocol change cannot silently invalidate every saved
    /// checkpoint (a test pins the digests of known specs).
    pub fn digest(&self) -> u64 {
        self.canonical_bytes()
            .chunks(8)
            .fold(0x0F5E_ED5E_ED5E_ED00, |h, c| {
                let mut w = [0u8; 8];
                w[..c.len()].copy_from_slice(c);
                mix(h ^ u64::from_le_bytes(w))
            })
    }

    /// The spec's checkpoint encoding, version 1 (the digest's input), little-endian:
    ///
    /// | field   | bytes                                                  |
    /// |---------|--------------------------------------------------------|
    /// | name    | `u16` length, then the UTF-8 bytes                     |
    /// | records | `u64`                                                  |
    /// | seed    | `u64`                                                  |
    /// | world   | `u32`                                                  |
    /// | shuffle | `u8` kind (0 none, 1 full, 2 block), `u32` block size (0 unless block) |
    /// | tail    | `u8` (0 drop, 1 pad)                                   |
    /// | epochs  | `u64` (0 for unbounded)                                |
    ///
    /// Frozen: a later version must add a version marker and keep this one's digests.
    ///
    /// Version 2 appends, for a resharded stream only (so every other stream's digest stays
    /// version 1's): `u8` 2, then the reshard's text ([`Reshard::to_text`]) as a `u32` length
    /// and its bytes.
    pub fn canonical_bytes(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(40 + self.name.len());
        let name = &self.name.as_bytes()[..self.name.len().min(MAX_STREAM_NAME)];
        b.extend_from_slice(&(name.len() as u16).to_le_bytes());
        b.extend_from_slice(name);
        b.extend_from_slice(&self.records.to_le_bytes());
        b.extend_from_slice(&self.seed.to_le_bytes());
        b.extend_from_slice(&self.world.to_le_bytes());
        let (kind, block) = self.shuffle.code();
        b.push(kind);
        b.extend_from_slice(&block.to_le_bytes());
        b.push(self.tail.code());
        b.extend_from_slice(&self.epochs.unwrap_or(0).to_le_bytes());
        if let Some(r) = &self.reshard {
            let text = r.to_text();
            b.push(2);
            b.extend_from_slice(&(text.len() as u32).to_le_bytes());
            b.extend_from_slice(text.as_bytes());
        }
        b
    }
}

impl Shuffle {
    /// (kind, block size): 0 none, 1 full, 2 block. The block size is 0 unless by blocks, so a
    /// value has exactly one code.
    pub fn code(self) -> (u8, u32) {
        match self {
            Shuffle::None => (0, 0),
            Shuffle::Full => (1, 0),
            Shuffle::Block(b) => (2, b),
        }
    }

    /// The inverse of [`Shuffle::code`]; `None` for a code no value has.
    pub fn from_code(kind: u8, block: u32) -> Option<Shuffle> {
        match (kind, block) {
            (0, 0) => Some(Shuffle::None),
            (1, 0) => Some(Shuffle::Full),
            (2, b) => Some(Shuffle::Block(b)),
            _ => None,
        }
    }
}

impl Tail {
    /// 0 drop, 1 pad.
    pub fn code(self) -> u8 {
        match self {
            Tail::Drop => 0,
            Tail::Pad => 1,
        }
    }

    /// The inverse of [`Tail::code`].
    pub fn from_code(code: u8) -> Option<Tail> {
        match code {
            0 => Some(Tail::Drop),
            1 => Some(Tail::Pad),
            _ => None,
        }
    }
}

/// A consumer's position: small, and saved with the trainer's checkpoint. Resuming from it
/// continues with exactly the next sample.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct StreamState {
    /// [`StreamSpec::digest`] of the stream it belongs to.
    pub spec_digest: u64,
    /// The consumer's rank.
    pub rank: u32,
    /// The epoch of the next sample.
    pub epoch: u64,
    /// The next sample's position within the rank's share of that epoch.
    pub position: u64,
}

impl StreamState {
    /// The state at sequence number `seq` of `rank`.
    pub fn at(spec: &StreamSpec, rank: u32, seq: u64) -> StreamState {
        let per_rank = spec.per_rank().max(1);
        StreamState {
            spec_digest: spec.digest(),
            rank,
            epoch: seq / per_rank,
            position: seq % per_rank,
        }
    }

    /// The sequence number of the next sample.
    pub fn seq(&self, spec: &StreamSpec) -> u64 {
        self.epoch * spec.per_rank() + self.position
    }

    /// A one-line text form, `digest:rank:epoch:position` in hex, for checkpoints and logs.
    pub fn to_text(&self) -> String {
        format!(
            "{:016x}:{:x}:{:x}:{:x}",
            self.spec_digest, self.rank, self.epoch, self.position
        )
    }

    /// Parses [`StreamState::to_text`].
    pub fn from_text(s: &str) -> Option<StreamState> {
        let mut parts = s.trim().split(':');
        let mut next = || u64::from_str_radix(parts.next()?, 16).ok();
        let state = StreamState {
            spec_digest: next()?,
            rank: u32::try_from(next()?).ok()?,
            epoch: next()?,
            position: next()?,
        };
        parts.next().is_none().then_some(state)
    }
}

/// A sample's identity for the decode-once cache: a 128-bit digest of everything that
/// determines its bytes (the record's line, where relative paths resolve, the transform
/// settings, the tokenizer). Equal keys mean interchangeable samples, across ranks, epochs and
/// jobs on the node. Not cryptographic: producers on a node are trusted to compute it honestly.
pub fn sample_key(parts: &[&[u8]]) -> u128 {
    let (mut a, mut b) = (0x5A3D_1E0F_2B4C_6D8Eu64, 0xC0FF_EE00_D15E_A5E5u64);
    for part in parts {
        // Length first, so ("ab", "c") and ("a", "bc") differ.
        for word in std::iter::once(part.len() as u64).chain(part.chunks(8).map(|c| {
            let mut w = [0u8; 8];
            w[..c.len()].copy_from_slice(c);
            u64::from_le_bytes(w)
        })) {
            a = mix(a ^ word);
            b = mix(b.rotate_left(17) ^ word ^ 0x9E37_79B9_7F4A_7C15);
        }
    }
    u128::from(a) << 64 | u128::from(b)
}

/// SplitMix64's finaliser: a fast, well-mixed 64-bit hash.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A keyed permutation of `[0, n)`, evaluated at `i`: a balanced Feistel network over the
/// smallest even number of bits covering `n`, cycle-walked until the result falls inside `[0, n)`
/// (fewer than four steps on average, since the domain is under 4n).
fn permute(i: u64, n: u64, key: u64) -> u64 {
    debug_assert!(i < n);
    if n <= 1 {
        return i;
    }
    let bits = (64 - (n - 1).leading_zeros()).max(2).next_multiple_of(2);
    let half = bits / 2;
    let mask = (1u64 << half) - 1;
    let mut x = i;
    loop {
        let (mut left, mut right) = (x >> half, x & mask);
        for round in 0..6u64 {
            let f = mix(right ^ mix(key ^ round)) & mask;
            (left, right) = (right, left ^ f);
        }
        x = (left << half) | right;
        if x < n {
            return x;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    fn spec(records: u64, world: u32, shuffle: Shuffle, tail: Tail) -> StreamSpec {
        StreamSpec {
            name: "test".into(),
            records,
            seed: 7,
            world,
            shuffle,
            tail,
            epochs: Some(3),
            reshard: None,
        }
    }

    #[test]
    fn spec_differences_name_each_field_in_words() {
        let a = spec(40, 2, Shuffle::Full, Tail::Drop);
        let b = StreamSpec {
            records: 41,
            epochs: None,
            ..spec(40, 2, Shuffle::Block(8), Tail::Drop)
        };
        assert_eq!(
            a.differences(&b),
            "records 40 (asked: 41), shuffle full (asked: block:8), epochs 3 (asked: unbounded)"
        );
        assert_eq!(a.differences(&a), "");
    }

    #[test]
    fn permutations_are_bijections() {
        for n in [1u64, 2, 3, 5, 16, 17, 100, 1000, 4097] {
            for key in [0, 1, 0xDEAD_BEEF] {
                let seen: BTreeSet<u64> = (0..n).map(|i| permute(i, n, key)).collect();
                assert_eq!(seen.len() as u64, n, "n={n} key={key}");
                assert!(seen.iter().all(|&x| x < n));
            }
        }
    }

    #[test]
    fn ranks_are_disjoint_equal_and_cover_the_epoch() {
        for shuffle in [Shuffle::None, Shuffle::Full, Shuffle::Block(8)] {
            for (n, world) in [(100u64, 4u32), (103, 4), (7, 8), (64, 1)] {
                let pad = spec(n, world, shuffle, Tail::Pad);
                let drop = spec(n, world, shuffle, Tail::Drop);
                for epoch in 0..3 {
                    // Pad: every record at least once, at most ceil(world / n) + 1 times.
                    let mut all = Vec::new();
                    for rank in 0..world {
                        let per = pad.per_rank();
                        all.extend((0..per).map(|p| pad.record_at(rank, epoch * per + p)));
                    }
                    assert_eq!(all.len() as u64, pad.per_rank() * u64::from(world));
                    let unique: BTreeSet<u64> = all.iter().copied().collect();
                    assert_eq!(
                        unique.len() as u64,
                        n,
                        "{shuffle:?} n={n} w={world}: all records"
                    );
                    // Drop: disjoint shares of distinct records.
                    if drop.check(0).is_ok() {
                        let per = drop.per_rank();
                        let all: Vec<u64> = (0..world)
                            .flat_map(|rank| (0..per).map(move |p| (rank, epoch * per + p)))
                            .map(|(rank, seq)| drop.record_at(rank, seq))
                            .collect();
                        let unique: BTreeSet<u64> = all.iter().copied().collect();
                        assert_eq!(unique.len(), all.len(), "{shuffle:?}: disjoint");
                        assert_eq!(all.len() as u64, n - n % u64::from(world));
                    } else {
                        assert!(n < u64::from(world));
                    }
                }
            }
        }
    }

    #[test]
    fn order_depends_on_seed_and_epoch_only() {
        let a = spec(1000, 4, Shuffle::Full, Tail::Drop);
        let order = |s: &StreamSpec, epoch: u64| -> Vec<u64> {
            (0..250).map(|p| s.record_at(1, epoch * 250 + p)).collect()
        };
        assert_eq!(order(&a, 0), order(&a.clone(), 0), "deterministic");
        assert_ne!(order(&a, 0), order(&a, 1), "each epoch its own order");
        let b = StreamSpec {
            seed: 8,
            ..a.clone()
        };
        assert_ne!(order(&a, 0), order(&b, 0), "seed changes the order");
        let none = spec(1000, 4, Shuffle::None, Tail::Drop);
        assert_eq!(order(&none, 0)[..3], [1, 5, 9], "unshuffled: round-robin");
        // A shuffled order is far from the identity: few records stay in place.
        let fixed = (0..1000).filter(|&i| a.permuted(0, i) == i).count();
        assert!(fixed < 10, "{fixed} fixed points");
    }

    #[test]
    fn block_shuffle_keeps_blocks_together() {
        let s = spec(100, 1, Shuffle::Block(10), Tail::Drop);
        let order: Vec<u64> = (0..100).map(|p| s.record_at(0, p)).collect();
        for chunk in order.chunks(10) {
            let block = chunk[0] / 10;
            assert!(chunk.iter().all(|r| r / 10 == block), "{chunk:?}");
        }
        assert_ne!(order, (0..100).collect::<Vec<_>>());
    }

    #[test]
    fn candidates_start_at_the_record_and_stay_in_the_share() {
        let s = spec(40, 4, Shuffle::Full, Tail::Drop);
        let share: BTreeSet<u64> = (10..20).map(|seq| s.record_at(2, seq)).collect();
        let c: Vec<u64> = s.candidates(2, 13).collect();
        assert_eq!(c[0], s.record_at(2, 13));
        assert_eq!(c[1], s.record_at(2, 14));
        assert_eq!(c.len(), 10);
        assert_eq!(c.iter().copied().collect::<BTreeSet<_>>(), share);
    }

    #[test]
    fn states_round_trip_and_reject_garbage() {
        let s = spec(100, 4, Shuffle::Full, Tail::Pad);
        let state = StreamState::at(&s, 3, 57);
        assert_eq!((state.epoch, state.position), (2, 7));
        assert_eq!(state.seq(&s), 57);
        assert_eq!(StreamState::from_text(&state.to_text()), Some(state));
        for bad in ["", "1:2:3", "1:2:3:4:5", "x:1:2:3", "1:100000000000:2:3"] {
            assert_eq!(StreamState::from_text(bad), None, "{bad}");
        }
        assert_ne!(
            s.digest(),
            StreamSpec {
                seed: 8,
                ..s.clone()
            }
            .digest()
        );
    }

    /// Checkpoints saved by earlier releases name their spec by this digest: it must never
    /// change for a given spec, whatever the wire protocol does.
    #[test]
    fn digests_of_known_specs_never_change() {
        let a = StreamSpec {
            name: "job-7/train".into(),
            records: 1_000_003,
            seed: 42,
            world: 8,
            shuffle: Shuffle::Block(64),
            tail: Tail::Pad,
            epochs: Some(3),
            reshard: None,
        };
        let b = StreamSpec {
            name: "s".into(),
            records: 16,
            seed: 0,
            world: 1,
            shuffle: Shuffle::None,
            tail: Tail::Drop,
            epochs: None,
            reshard: None,
        };
        assert_eq!(a.digest(), 0x3e4a_1cea_7af7_fefb);
        assert_eq!(b.digest(), 0x974c_4d3d_e6c5_8e4e);
    }

    #[test]
    fn sample_keys_separate_their_parts() {
        let k = sample_key(&[b"ab", b"c"]);
        assert_eq!(k, sample_key(&[b"ab", b"c"]));
        assert_ne!(k, sample_key(&[b"a", b"bc"]));
        assert_ne!(k, sample_key(&[b"ab", b"d"]));
        assert_ne!(sample_key(&[b""]), sample_key(&[]));
    }

    #[test]
    fn bad_specs_are_refused() {
        let s = spec(3, 4, Shuffle::Full, Tail::Drop);
        assert_eq!(
            s.check(0),
            Err(SpecError::TooFewRecords {
                records: 3,
                world: 4
            })
        );
        assert!(spec(3, 4, Shuffle::Full, Tail::Pad).check(3).is_ok());
        assert!(matches!(
            spec(3, 4, Shuffle::Full, Tail::Pad).check(4),
            Err(SpecError::RankOutOfRange { .. })
        ));
        assert_eq!(
            spec(3, 1, Shuffle::Block(0), Tail::Pad).check(0),
            Err(SpecError::EmptyBlock)
        );
        let zero = StreamSpec {
            epochs: Some(0),
            ..spec(3, 1, Shuffle::Full, Tail::Pad)
        };
        assert_eq!(
            zero.check(0),
            Err(SpecError::NoEpochs),
            "would decode as unbounded"
        );
    }
}
