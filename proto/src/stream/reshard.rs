//! Resuming a stream at another world size: what the ranks of a run at world `W` left unread of
//! their epochs, split over the ranks of a run at world `W'`, every sample once.
//!
//! An epoch's order is a permutation of its *slots*: rank `r` reads slot `p·W + r` at position
//! `p` ([`StreamSpec::record_at`]). The ranks of a stopped run each read a prefix of their own
//! slots (their [`StreamState`]s say how long, ranks' uneven progress and ranks already in the
//! next epoch included), so what is left of an epoch is, row by row (`p`), the slots of the
//! ranks that had not reached that row. A [`Reshard`] numbers those slots in slot order and
//! deals them to the new ranks in turn: the `k`-th remaining slot goes to new rank `k mod W'`,
//! as its `k div W'`-th sample of that epoch's remainder. After the last epoch any old rank had
//! begun, the new world reads the stream's ordinary epochs at world `W'`.
//!
//! A run that was itself resharded reads its share of that reshard first: each of its ranks
//! `r` has `share(r)` samples of it, a prefix of which it read. Those shares are dealt in turn,
//! so they differ by one at most, and what is left of them is again a grid read row by row: the
//! reshard of such a run deals that *carried* remainder first, then its ordinary epochs' (a
//! reshard over a reshard, nested as deep as [`MAX_LEVELS`]).
//!
//! What it holds is the old spec and, per epoch left unfinished (and per reshard carried), one
//! count per old rank: its size grows with the old worlds, never with the data set (see
//! [`Reshard::to_text`]).

use std::sync::Arc;

use crate::stream::{StreamSpec, StreamState};

/// Why states cannot be resharded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReshardError {
    /// A state belongs to another stream.
    #[error(
        "a state belongs to another stream (spec digest {found:016x}, this one's {expected:016x})"
    )]
    OtherStream {
        /// The stream's.
        expected: u64,
        /// The state's.
        found: u64,
    },
    /// Not exactly one state per rank of the old world.
    #[error("{found} states for a world of {world}: one per rank, each rank once")]
    Ranks {
        /// The old world.
        world: u32,
        /// States given.
        found: usize,
    },
    /// A state past the stream's end, or the new world is empty.
    #[error("{0}")]
    Invalid(String),
}

/// How many slots each old rank has in a remainder's grid: `rows` for the first `full` ranks,
/// one fewer for the rest (an epoch's grid is full; the shares of a reshard dealt in turn are
/// one longer for its first ranks).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Grid {
    rows: u64,
    full: usize,
}

impl Grid {
    fn cap(self, rank: usize) -> u64 {
        if rank < self.full {
            self.rows
        } else {
            self.rows - 1
        }
    }

    /// The grid of a reshard's shares (`None` if they are not dealt in turn: never, for a
    /// reshard's).
    fn of_shares(shares: &[u64]) -> Option<Grid> {
        let rows = shares.iter().copied().max()?;
        let full = shares.iter().take_while(|&&s| s == rows).count();
        let rest_shorter = shares[full..].iter().all(|&s| s + 1 == rows);
        (rows > 0 && rest_shorter).then_some(Grid { rows, full })
    }
}

/// One remainder: how many of its own slots each old rank had read, of an epoch or of the old
/// run's own reshard.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Remainder {
    /// The epoch of the old stream's ordinary order, or `None` for the old stream's own
    /// reshard (its ranks' shares: the carried remainder).
    epoch: Option<u64>,
    /// Per old rank, slots read (at most its cap in the grid).
    read: Vec<u64>,
    grid: Grid,
    /// The same, sorted, with prefix sums, for counting the slots left before a row.
    sorted: Vec<u64>,
    prefix: Vec<u64>,
    /// Slots left.
    left: u64,
    /// Slots left in the remainders before this one: the deal goes on where the last one
    /// stopped, so new ranks' shares differ by one at most.
    offset: u64,
}

impl Remainder {
    /// `None` when a count is past its rank's slots or the counts do not fit in 64 bits.
    fn new(epoch: Option<u64>, read: Vec<u64>, grid: Grid, offset: u64) -> Option<Remainder> {
        let mut sorted = read.clone();
        sorted.sort_unstable();
        let mut prefix = Vec::with_capacity(sorted.len() + 1);
        prefix.push(0u64);
        for &c in &sorted {
            prefix.push(prefix.last().copied().unwrap_or(0).checked_add(c)?);
        }
        let mut left = 0u64;
        for (rank, &c) in read.iter().enumerate() {
            left = left.checked_add(grid.cap(rank).checked_sub(c)?)?;
        }
        offset.checked_add(left)?;
        Some(Remainder {
            epoch,
            read,
            grid,
            sorted,
            prefix,
            left,
            offset,
        })
    }

    /// New rank `rank`'s part of this remainder, dealt in turn to `world` ranks from
    /// [`Remainder::offset`] on: (its first slot's index, how many).
    fn share(&self, world: u32, rank: u32) -> (u64, u64) {
        let world = u64::from(world);
        let first = (u64::from(rank) + world - self.offset % world) % world;
        let n = if first < self.left {
            (self.left - 1 - first) / world + 1
        } else {
            0
        };
        (first, n)
    }

    /// Slots left in the rows before `row` (at most the shortest rank's cap, `rows - 1`, so
    /// every rank has a slot in each of them): `Σ max(0, row − read_r)`.
    fn left_before(&self, row: u64) -> u64 {
        let below = self.sorted.partition_point(|&c| c < row);
        below as u64 * row - self.prefix[below]
    }

    /// The `k`-th slot left (`k < left`), as (old rank, position).
    fn nth(&self, k: u64) -> (u32, u64) {
        // The row: the last one with fewer than k + 1 slots left before it (the search looks
        // only at rows below the last, where every rank has a slot).
        let (mut lo, mut hi) = (self.sorted[0], self.grid.rows);
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            if self.left_before(mid) <= k {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        let mut j = k - self.left_before(lo);
        for (rank, &c) in self.read.iter().enumerate() {
            if c <= lo && lo < self.grid.cap(rank) {
                if j == 0 {
                    return (rank as u32, lo);
                }
                j -= 1;
            }
        }
        unreachable!("row {lo} holds slot {k}")
    }

    /// Its counts as [`Reshard::to_text`] writes them: runs `value*times` (`*times` left out
    /// for one), separated by `,`.
    fn counts_text(&self) -> String {
        let mut runs: Vec<(u64, u64)> = Vec::new();
        for &c in &self.read {
            match runs.last_mut() {
                Some((v, n)) if *v == c => *n += 1,
                _ => runs.push((c, 1)),
            }
        }
        runs.iter()
            .map(|&(v, n)| {
                if n == 1 {
                    format!("{v:x}")
                } else {
                    format!("{v:x}*{n:x}")
                }
            })
            .collect::<Vec<_>>()
            .join(",")
    }
}

/// What a run at one world size left unread, dealt to the ranks of another
/// ([`Reshard::new`]).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Reshard {
    /// The stream as the old run read it: its ordinary epochs, or, when the old run was itself
    /// resharded, with that reshard (whose shares' remainder this one deals first).
    old: StreamSpec,
    /// The same at the new world size, without a reshard.
    new: StreamSpec,
    /// The new world's size.
    world: u32,
    /// What is left, in the order it is dealt: of the old run's own reshard (the carried
    /// remainder, first when there is one), then of the epochs some old rank had begun and not
    /// every one had finished, in order.
    remainders: Vec<Remainder>,
    /// The first epoch the new world reads whole.
    next_epoch: u64,
    /// [`Reshard::to_text`], rendered once when it is made: a nested reshard's text holds the
    /// texts below it, and so does its old spec's digest, so rendering them again at each
    /// level would cost twice as much per level.
    text: Arc<str>,
}

impl Reshard {
    /// Deals what the ranks of `old` left unread (their `states`, one per rank, in any order)
    /// to `world` new ranks. When `old` was itself resharded, what its ranks left of their
    /// shares of that reshard is dealt first.
    pub fn new(
        old: &StreamSpec,
        states: &[StreamState],
        world: u32,
    ) -> Result<Reshard, ReshardError> {
        if world == 0 {
            return Err(ReshardError::Invalid("the new world has no ranks".into()));
        }
        old.check(0)
            .map_err(|e| ReshardError::Invalid(e.to_string()))?;
        let expected = old.digest();
        let mut by_rank: Vec<Option<&StreamState>> =
            vec![None; old.world.min(MAX_OLD_WORLD) as usize];
        for s in states {
            if s.spec_digest != expected {
                return Err(ReshardError::OtherStream {
                    expected,
                    found: s.spec_digest,
                });
            }
            match by_rank.get_mut(s.rank as usize) {
                Some(slot @ None) => *slot = Some(s),
                _ => {
                    return Err(ReshardError::Ranks {
                        world: old.world,
                        found: states.len(),
                    });
                }
            }
        }
        let Some(states) = by_rank.into_iter().collect::<Option<Vec<_>>>() else {
            return Err(ReshardError::Ranks {
                world: old.world,
                found: states.len(),
            });
        };
        if old.world > MAX_OLD_WORLD {
            return Err(ReshardError::Invalid(format!(
                "a world of {} is more than {MAX_OLD_WORLD} ranks",
                old.world
            )));
        }
        let plain = old.plain();
        let new = StreamSpec {
            world,
            ..plain.clone()
        };
        new.check(0)
            .map_err(|e| ReshardError::Invalid(format!("at the new world size: {e}")))?;
        let per_rank = old.per_rank();
        let past_end =
            |rank: u32| ReshardError::Invalid(format!("rank {rank} is past the stream's end"));
        // Each state as its sequence number says (a position past the rank's share is the next
        // epoch's), within the stream; of a resharded stream, split into what the rank read of
        // its share of that reshard and where it stands in the ordinary epochs after it.
        let mut at = Vec::with_capacity(states.len());
        let mut carried_read = Vec::new();
        for s in &states {
            let seq = s
                .epoch
                .checked_mul(per_rank)
                .and_then(|e| e.checked_add(s.position))
                .filter(|&seq| old.end_seq(s.rank).is_none_or(|end| seq <= end))
                .ok_or_else(|| past_end(s.rank))?;
            let ordinary = match &old.reshard {
                None => seq,
                Some(before) => {
                    let share = before.share(s.rank);
                    carried_read.push(seq.min(share));
                    (seq.saturating_sub(share))
                        .checked_add(before.next_epoch * per_rank)
                        .ok_or_else(|| past_end(s.rank))?
                }
            };
            at.push(StreamState::at(&plain, s.rank, ordinary));
        }
        let mut remainders: Vec<Remainder> = Vec::new();
        if let Some(before) = &old.reshard {
            let carried = before
                .carried(carried_read)
                .ok_or_else(|| ReshardError::Invalid("more samples than 64 bits count".into()))?;
            if carried.left == 0 {
                // Every rank past its share: a reshard of the ordinary states they stand for.
                return Reshard::new(&plain, &at, world);
            }
            if before.levels() >= MAX_LEVELS {
                return Err(ReshardError::Invalid(format!(
                    "the run was resized {} times while some rank still read its share of the \
                     first resize: resume at world {} until every rank has read its share, \
                     then resize again",
                    before.levels(),
                    old.world
                )));
            }
            remainders.push(carried);
        }
        let first = at.iter().map(|s| s.epoch).min().unwrap_or(0);
        let last = at.iter().map(|s| s.epoch).max().unwrap_or(0);
        if last - first >= MAX_EPOCHS_APART {
            return Err(ReshardError::Invalid(format!(
                "ranks {} epochs apart (at most {MAX_EPOCHS_APART})",
                last - first
            )));
        }
        // Past the last epoch some rank has begun, the new world reads whole epochs.
        let next_epoch = last + u64::from(at.iter().any(|s| s.epoch == last && s.position > 0));
        let before_cells = old.reshard.as_ref().map_or(0, |r| r.cells());
        let cells = (next_epoch - first)
            .saturating_add(remainders.len() as u64)
            .saturating_mul(u64::from(old.world))
            .saturating_add(before_cells as u64);
        if cells > MAX_RESHARD_CELLS as u64 {
            return Err(ReshardError::Invalid(format!(
                "{} ranks over {} unfinished epochs (and earlier resizes' shares): more than \
                 {MAX_RESHARD_CELLS} counts to keep",
                old.world,
                next_epoch - first
            )));
        }
        if next_epoch.checked_mul(new.per_rank()).is_none()
            || next_epoch.checked_mul(per_rank).is_none()
        {
            return Err(ReshardError::Invalid(
                "more samples than 64 bits count".into(),
            ));
        }
        let grid = Grid {
            rows: per_rank,
            full: at.len(),
        };
        for epoch in first..next_epoch {
            let read: Vec<u64> = at
                .iter()
                .map(|s| match s.epoch.cmp(&epoch) {
                    std::cmp::Ordering::Greater => per_rank,
                    std::cmp::Ordering::Equal => s.position,
                    std::cmp::Ordering::Less => 0,
                })
                .collect();
            let offset = remainders.last().map_or(0, |r| r.offset + r.left);
            let r = Remainder::new(Some(epoch), read, grid, offset)
                .ok_or_else(|| ReshardError::Invalid("more samples than 64 bits count".into()))?;
            if r.left > 0 {
                remainders.push(r);
            }
        }
        let reshard = Reshard {
            old: old.clone(),
            new,
            world,
            remainders,
            next_epoch,
            text: Arc::from(""),
        }
        .rendered();
        let text = reshard.text.len();
        if text > MAX_RESHARD_TEXT {
            return Err(ReshardError::Invalid(format!(
                "what the ranks left takes {text} bytes to say, more than {MAX_RESHARD_TEXT}: \
                 too many ranks stopped at different positions (resume at the same world size, \
                 or from a checkpoint taken at an epoch's end)"
            )));
        }
        Ok(reshard)
    }

    /// What this reshard's ranks left of their shares of it (`read`, per rank, each at most
    /// its share), as the remainder a reshard of its stream deals first (so from offset 0).
    fn carried(&self, read: Vec<u64>) -> Option<Remainder> {
        let shares: Vec<u64> = (0..self.world).map(|rank| self.share(rank)).collect();
        Remainder::new(None, read, Grid::of_shares(&shares)?, 0)
    }

    /// The reshards this one stands on, itself included: 1 for a reshard of a plain run.
    fn levels(&self) -> usize {
        1 + self.old.reshard.as_ref().map_or(0, |r| r.levels())
    }

    /// The counts it keeps, those of the reshards it stands on included.
    fn cells(&self) -> usize {
        let own: usize = self.remainders.iter().map(|r| r.read.len()).sum();
        own + self.old.reshard.as_ref().map_or(0, |r| r.cells())
    }

    /// The stream the new world reads: the old spec at the new world size, resuming this
    /// reshard (none when the old ranks left nothing unread).
    pub fn spec(&self) -> StreamSpec {
        StreamSpec {
            reshard: (!self.remainders.is_empty()).then(|| Arc::new(self.clone())),
            ..self.new.clone()
        }
    }

    /// Where each new rank starts, in rank order: states of [`Reshard::spec`].
    pub fn states(&self) -> Vec<StreamState> {
        let spec = self.spec();
        let (digest, per_rank) = (spec.digest(), spec.per_rank());
        let start = if spec.reshard.is_some() {
            0
        } else {
            self.next_epoch * per_rank
        };
        (0..self.world)
            .map(|rank| StreamState {
                spec_digest: digest,
                rank,
                epoch: start / per_rank,
                position: start % per_rank,
            })
            .collect()
    }

    /// Whether `spec` is the stream at the new world size (its reshard aside).
    pub(crate) fn resumed_by(&self, spec: &StreamSpec) -> bool {
        spec.world == self.world && spec.plain() == self.new
    }

    /// In words, for a spec's differences: `nothing`, or the old world and what it left.
    pub(crate) fn describe(reshard: Option<&Reshard>) -> String {
        reshard.map_or_else(
            || "nothing".into(),
            |r| {
                let left: u64 = r.remainders.iter().map(|e| e.left).sum();
                let id = crate::stream::sample_key(&[r.to_text().as_bytes()]) as u32;
                format!("a world of {} ({left} samples left, {id:08x})", r.old.world)
            },
        )
    }

    /// How many samples of the remainders new rank `rank` reads before the ordinary epochs
    /// (the new ranks' shares differ by one at most).
    pub fn share(&self, rank: u32) -> u64 {
        self.remainders
            .iter()
            .map(|r| r.share(self.world, rank).1)
            .sum()
    }

    /// The first epoch the new world reads whole.
    pub fn next_epoch(&self) -> u64 {
        self.next_epoch
    }

    /// Where new rank `rank`'s sample at `seq` comes from: (the remainder, the old rank, its
    /// position in that remainder's grid), or the sequence number in the new spec's ordinary
    /// epochs.
    fn source(&self, rank: u32, seq: u64) -> Result<(&Remainder, u32, u64), u64> {
        let mut seq = seq;
        for r in &self.remainders {
            let (first, n) = r.share(self.world, rank);
            if seq < n {
                let (old_rank, position) = r.nth(first + seq * u64::from(self.world));
                return Ok((r, old_rank, position));
            }
            seq -= n;
        }
        Err((self.next_epoch * self.new.per_rank()).saturating_add(seq))
    }

    /// The epoch new rank `rank`'s sample at `seq` belongs to: of the remainders, the epoch it
    /// was left from.
    pub fn epoch_at(&self, rank: u32, seq: u64) -> u64 {
        match self.source(rank, seq) {
            Ok((r, old_rank, position)) => match r.epoch {
                Some(epoch) => epoch,
                None => self.old.epoch_at(old_rank, position),
            },
            Err(seq) => seq / self.new.per_rank(),
        }
    }

    /// The record new rank `rank` (below the new world) reads at its sequence number `seq`:
    /// from the remainders while `seq < share(rank)`, then the new spec's epochs from
    /// [`Reshard::next_epoch`] on.
    pub fn record_at(&self, rank: u32, seq: u64) -> u64 {
        assert!(
            rank < self.world,
            "rank {rank} of a world of {}",
            self.world
        );
        match self.source(rank, seq) {
            Ok((r, old_rank, position)) => match r.epoch {
                Some(epoch) => self
                    .old
                    .ordinary_record_at(old_rank, epoch * self.old.per_rank() + position),
                // The old run's own share: its record as that run reads it.
                None => self.old.record_at(old_rank, position),
            },
            Err(seq) => self.new.ordinary_record_at(rank, seq),
        }
    }
}

/// The longest text a reshard may have ([`Reshard::to_text`]): it fits a frame of any size
/// a side may agree to, with room to spare. 1,024 ranks at different positions take 6 KiB; a
/// reshard that would take more is refused ([`Reshard::new`]).
pub const MAX_RESHARD_TEXT: usize = 32 << 10;
/// The most counts a reshard keeps (old ranks times the epochs they left unfinished, over the
/// reshards it stands on): 1,024 ranks over 16 epochs, or 65,536 ranks in one, about 1.5 MiB
/// of tables.
pub const MAX_RESHARD_CELLS: usize = 1 << 16;
/// The most old ranks a reshard may have (a bound for text read from a checkpoint).
pub const MAX_OLD_WORLD: u32 = 1 << 16;
/// The most epochs the old ranks may be apart (a rank that many epochs behind the others is a
/// run gone wrong, not one to resume).
pub const MAX_EPOCHS_APART: u64 = 16;
/// The most reshards one may stand on, itself included: resizes while some rank still reads
/// its share of an earlier one.
pub const MAX_LEVELS: usize = 8;

impl Reshard {
    /// A one-line text form for checkpoints:
    /// `r1:<old spec digest>:<old world>:<new world>:<first epoch>:<counts>` in hex, where
    /// `<counts>` lists each unfinished epoch's counts (slots each old rank read) separated by
    /// `;`, each as runs `value*times` separated by `,` (`*times` left out for one). Ranks that
    /// stop together write one run: 1,024 ranks at one position of an epoch of 10^9 records
    /// take 39 bytes, at 1,024 different positions 6 KiB. It grows with the old world and the
    /// epochs its ranks are apart (at most [`MAX_EPOCHS_APART`]), never with the data set.
    ///
    /// A reshard of a resharded run is that run's reshard's text, `|`, then
    /// `r2:<old spec digest>:<old world>:<new world>:<first epoch>:<carried>:<counts>`, where
    /// `<carried>` is what each old rank read of its share of that reshard (the old spec's
    /// digest covers that reshard) and `<counts>` may be empty.
    pub fn to_text(&self) -> String {
        self.text.to_string()
    }

    /// `self` with its text ([`Reshard::to_text`]) rendered.
    fn rendered(mut self) -> Reshard {
        self.text = Arc::from(self.render());
        self
    }

    fn render(&self) -> String {
        let carried = self.remainders.first().filter(|r| r.epoch.is_none());
        let epochs: Vec<String> = self
            .remainders
            .iter()
            .filter(|r| r.epoch.is_some())
            .map(Remainder::counts_text)
            .collect();
        let first = self
            .remainders
            .iter()
            .find_map(|r| r.epoch)
            .unwrap_or(self.next_epoch);
        let head = format!(
            "{:016x}:{:x}:{:x}:{:x}",
            self.old.digest(),
            self.old.world,
            self.world,
            first
        );
        match (&self.old.reshard, carried) {
            (Some(before), Some(carried)) => format!(
                "{}|r2:{head}:{}:{}",
                before.to_text(),
                carried.counts_text(),
                epochs.join(";")
            ),
            _ => format!("r1:{head}:{}", epochs.join(";")),
        }
    }

    /// Parses [`Reshard::to_text`] for the stream `spec` (at either world size): `None` when it
    /// is not one, names another stream, or lies (counts past an epoch or a share, more than
    /// [`MAX_OLD_WORLD`] ranks or [`MAX_LEVELS`] reshards).
    pub fn from_text(spec: &StreamSpec, text: &str) -> Option<Reshard> {
        if text.len() > MAX_RESHARD_TEXT || text.matches('|').count() >= MAX_LEVELS {
            return None;
        }
        let text = text.trim();
        let (before, level) = match text.rsplit_once('|') {
            Some((before, level)) => (Some(Reshard::from_text(spec, before)?), level),
            None => (None, text),
        };
        let reshard = Reshard::level_from_text(spec, before, level)?;
        // One text per reshard: what it writes, nothing else (no leading zeros, no runs split
        // or of one, no spaces inside).
        (reshard.to_text() == text).then_some(reshard)
    }

    /// One level of [`Reshard::from_text`]: `r1:...` of a plain run, or `r2:...` of the run
    /// `before` had resharded.
    fn level_from_text(spec: &StreamSpec, before: Option<Reshard>, text: &str) -> Option<Reshard> {
        // Lowercase hex digits only, one to sixteen: one text per reshard.
        let hex = |s: &str| {
            (!s.is_empty()
                && s.len() <= 16
                && s.bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)))
            .then(|| u64::from_str_radix(s, 16).ok())
            .flatten()
        };
        let mut parts = text.split(':');
        let nested = match (parts.next()?, &before) {
            ("r1", None) => false,
            ("r2", Some(_)) => true,
            _ => return None,
        };
        let digest = hex(parts.next()?)?;
        let old_world = u32::try_from(hex(parts.next()?)?).ok()?;
        let world = u32::try_from(hex(parts.next()?)?).ok()?;
        let first = hex(parts.next()?)?;
        let carried_counts = if nested { Some(parts.next()?) } else { None };
        let counts = parts.next()?;
        if parts.next().is_some() || old_world == 0 || old_world > MAX_OLD_WORLD {
            return None;
        }
        let old = match &before {
            Some(before) => before.spec(),
            None => StreamSpec {
                world: old_world,
                ..spec.plain()
            },
        };
        let new = StreamSpec {
            world,
            ..spec.plain()
        };
        if old.world != old_world
            || old.digest() != digest
            || old.check(0).is_err()
            || new.check(0).is_err()
        {
            return None;
        }
        // Counts, as runs; `None` when they are not `old_world` of them.
        let read_counts = |text: &str| -> Option<Vec<u64>> {
            let mut read = Vec::with_capacity(old_world as usize);
            for run in text.split(',') {
                let (v, n) = match run.split_once('*') {
                    Some((v, n)) => (hex(v)?, hex(n)?),
                    None => (hex(run)?, 1),
                };
                if n == 0 || n > u64::from(old_world) - read.len() as u64 {
                    return None;
                }
                read.extend(std::iter::repeat_n(v, n as usize));
            }
            (read.len() == old_world as usize).then_some(read)
        };
        let per_rank = old.per_rank();
        // (A reshard that left nothing is never written: its stream is the plain one.)
        let epochs: Vec<&str> = if counts.is_empty() {
            Vec::new()
        } else {
            counts.split(';').collect()
        };
        let next_epoch = first.checked_add(epochs.len() as u64)?;
        let before_cells = before.as_ref().map_or(0, Reshard::cells);
        let own_cells = (epochs.len() + usize::from(nested)).saturating_mul(old_world as usize);
        if (epochs.is_empty() && !nested)
            || epochs.len() as u64 > MAX_EPOCHS_APART
            || own_cells.saturating_add(before_cells) > MAX_RESHARD_CELLS
            || next_epoch.checked_mul(per_rank).is_none()
            || next_epoch.checked_mul(new.per_rank()).is_none()
            || old.epochs.is_some_and(|e| next_epoch > e)
        {
            return None;
        }
        let mut remainders: Vec<Remainder> = Vec::new();
        if let (Some(before), Some(carried)) = (&before, carried_counts) {
            let carried = before.carried(read_counts(carried)?)?;
            // Something is left of the shares (else the reshard is of the ordinary states), so
            // some rank is still in its share: it stands at the start of the epoch after them.
            if carried.left == 0 || first != before.next_epoch {
                return None;
            }
            remainders.push(carried);
        }
        let grid = Grid {
            rows: per_rank,
            full: old_world as usize,
        };
        for (i, epoch) in epochs.iter().enumerate() {
            let read = read_counts(epoch)?;
            // What states could say: a rank that had not finished an epoch (or its share of
            // the reshard before) read nothing of the next.
            if let Some(before) = remainders.last() {
                let unfinished = |rank: usize| before.read[rank] < before.grid.cap(rank);
                if (0..read.len()).any(|rank| unfinished(rank) && read[rank] > 0) {
                    return None;
                }
            }
            if i + 1 == epochs.len() && read.iter().all(|&r| r == 0) {
                return None;
            }
            // A rank that read all of the last epoch stands at the next: as many epochs apart
            // from the first as there are, which must be fewer than MAX_EPOCHS_APART.
            if i as u64 + 1 == MAX_EPOCHS_APART && read.contains(&per_rank) {
                return None;
            }
            let offset = remainders.last().map_or(0, |r| r.offset + r.left);
            let r = Remainder::new(Some(first + i as u64), read, grid, offset)?;
            if r.left == 0 {
                return None;
            }
            remainders.push(r);
        }
        Some(
            Reshard {
                old,
                new,
                world,
                next_epoch,
                remainders,
                text: Arc::from(""),
            }
            .rendered(),
        )
    }
}

/// A rank's state as a checkpoint keeps it in text: [`StreamState::to_text`], for a resharded
/// stream prefixed by its reshard ([`Reshard::to_text`]) and `@`, so that the text and the
/// stream's ordinary spec are all a resume needs.
pub fn state_text(spec: &StreamSpec, state: &StreamState) -> String {
    match &spec.reshard {
        None => state.to_text(),
        Some(r) => format!("{}@{}", r.to_text(), state.to_text()),
    }
}

/// Reads [`state_text`] for the stream `spec` describes (its reshard aside): the spec the
/// state belongs to (with the reshard its text carries, if any) and the state. Says why not
/// when the text is not one, or belongs to another stream or world size.
pub fn read_state(spec: &StreamSpec, text: &str) -> Result<(StreamSpec, StreamState), String> {
    let (reshard, state) = match text.trim().rsplit_once('@') {
        Some((reshard, state)) => (Some(reshard), state),
        None => (None, text),
    };
    let state = StreamState::from_text(state)
        .ok_or_else(|| format!("{:?} is not a stream state", crate::truncate(text, 80)))?;
    let spec = match reshard {
        None => spec.plain(),
        Some(text) => {
            let r = Reshard::from_text(spec, text).ok_or_else(|| {
                "the state's reshard is not one, or is another stream's (name, records, seed, \
                 shuffle, tail or epochs differ)"
                    .to_string()
            })?;
            if r.world != spec.world {
                return Err(format!(
                    "the state was resharded for a world of {}, not {}",
                    r.world, spec.world
                ));
            }
            r.spec()
        }
    };
    if state.spec_digest != spec.digest() {
        return Err(format!(
            "the state belongs to another stream spec (digest {:016x}, this one {:016x}): the \
             name, records, seed, shuffle, tail, epochs (1 unless given) and world must be the \
             run's that saved it; a state of a run at another world size is resharded first",
            state.spec_digest,
            spec.digest()
        ));
    }
    within(&spec, &state)?;
    Ok((spec, state))
}

/// Refuses a state of a rank outside the stream's world, or past its end (a sequence number
/// 64 bits cannot hold included).
fn within(spec: &StreamSpec, state: &StreamState) -> Result<(), String> {
    if state.rank >= spec.world {
        return Err(format!(
            "the state is rank {}'s, outside a world of {}",
            state.rank, spec.world
        ));
    }
    let seq = state
        .epoch
        .checked_mul(spec.per_rank())
        .and_then(|e| e.checked_add(state.position));
    match seq {
        Some(seq) if spec.end_seq(state.rank).is_none_or(|end| seq <= end) => Ok(()),
        _ => Err(format!(
            "rank {}'s state is past the stream's end",
            state.rank
        )),
    }
}

/// [`read_state`] of each of `texts`, which must belong to one run: the reshard they carry is
/// read once (each must carry the same), so a rank's cost stays its state's. The spec they
/// belong to and the states.
pub fn read_states(
    spec: &StreamSpec,
    texts: &[&str],
) -> Result<(StreamSpec, Vec<StreamState>), String> {
    let mut run: Option<(&str, StreamSpec, u64)> = None;
    let mut states = Vec::with_capacity(texts.len());
    for text in texts {
        let text = text.trim();
        let (prefix, rest) = text.rsplit_once('@').unwrap_or(("", text));
        let prefix = prefix.trim();
        match &run {
            None => {
                let (s, state) = read_state(spec, text)?;
                let digest = s.digest();
                run = Some((prefix, s, digest));
                states.push(state);
            }
            Some((p, run_spec, digest)) if *p == prefix => {
                let state = StreamState::from_text(rest).ok_or_else(|| {
                    format!("{:?} is not a stream state", crate::truncate(text, 80))
                })?;
                if state.spec_digest != *digest {
                    return Err(format!(
                        "a state belongs to another stream spec (digest {:016x}, this one \
                         {digest:016x})",
                        state.spec_digest
                    ));
                }
                within(run_spec, &state)?;
                states.push(state);
            }
            Some(_) => {
                return Err("the states come from different runs (their reshards differ)".into());
            }
        }
    }
    Ok((run.map_or_else(|| spec.plain(), |(_, s, _)| s), states))
}

/// [`Reshard::new`] from states as checkpoints keep them ([`state_text`]), one per rank of the
/// old run, for the stream `spec` describes (any world; its reshard aside): the new world's
/// states, in rank order, in the same text form.
pub fn reshard_texts(
    spec: &StreamSpec,
    texts: &[&str],
    world: u32,
) -> Result<Vec<String>, ReshardError> {
    let old_world = u32::try_from(texts.len())
        .ok()
        .filter(|&w| w > 0)
        .ok_or_else(|| ReshardError::Invalid("no states to reshard".into()))?;
    // One state per old rank: a rank past the count, or twice, means states missing (the old
    // world is the count of states, and a spec at another world has another digest).
    let mut seen = vec![false; texts.len()];
    for text in texts {
        let state = text.trim().rsplit_once('@').map_or(text.trim(), |(_, s)| s);
        if let Some(state) = StreamState::from_text(state) {
            match seen.get_mut(state.rank as usize) {
                Some(seen @ false) => *seen = true,
                _ => {
                    return Err(ReshardError::Ranks {
                        world: old_world,
                        found: texts.len(),
                    });
                }
            }
        }
    }
    let old = StreamSpec {
        world: old_world,
        ..spec.plain()
    };
    let (old, states) = read_states(&old, texts).map_err(ReshardError::Invalid)?;
    let reshard = Reshard::new(&old, &states, world)?;
    let new = reshard.spec();
    Ok(reshard
        .states()
        .iter()
        .map(|s| state_text(&new, s))
        .collect())
}

/// Where a resume starts: the states in `texts` ([`state_text`]) for the stream `spec`
/// describes at its world size, read as they are, or, when they are every rank's of a run at
/// another world size, resharded to it ([`reshard_texts`]). The spec they belong to (with its
/// reshard, if any), the states, and whether they were resharded; or why not.
pub fn resume(
    spec: &StreamSpec,
    texts: &[&str],
) -> Result<(StreamSpec, Vec<StreamState>, bool), String> {
    match read_states(spec, texts) {
        Ok((resumed, states)) => Ok((resumed, states, false)),
        Err(why) => {
            let texts = reshard_texts(spec, texts, spec.world).map_err(|e| {
                format!(
                    "{why}; nor are they every rank's states of a run at another world size \
                     ({e})"
                )
            })?;
            let texts: Vec<&str> = texts.iter().map(String::as_str).collect();
            let (resumed, states) = read_states(spec, &texts)?;
            Ok((resumed, states, true))
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;
    use crate::stream::{Shuffle, Tail};

    fn spec(records: u64, world: u32, tail: Tail) -> StreamSpec {
        StreamSpec {
            name: "reshard".into(),
            records,
            seed: 11,
            world,
            shuffle: Shuffle::Full,
            tail,
            epochs: Some(4),
            reshard: None,
        }
    }

    /// Rank `r`'s state at `seqs[r]`, for every rank of `spec`.
    fn states_at(spec: &StreamSpec, seqs: &[u64]) -> Vec<StreamState> {
        seqs.iter()
            .enumerate()
            .map(|(r, &seq)| StreamState::at(spec, r as u32, seq))
            .collect()
    }

    thread_local! {
        /// The shuffle [`check`] runs with.
        static SHUFFLE: std::cell::Cell<Shuffle> = const { std::cell::Cell::new(Shuffle::Full) };
    }

    /// The records each old rank read, its state, and what the new ranks read of the
    /// remainders: together, each slot of the epochs begun exactly once, and then the new
    /// world's epochs equal an uninterrupted run at the new world.
    fn check(records: u64, tail: Tail, old_world: u32, seqs: &[u64], new_world: u32) {
        assert_eq!(seqs.len(), old_world as usize);
        check_chain(records, tail, &[(old_world, seqs.to_vec())], new_world);
    }

    /// [`check`] over a chain of runs: the first at `runs[0].0` ranks read to `runs[0].1`, was
    /// resharded to the next run's world, whose ranks read to their sequence numbers (of the
    /// resharded stream: their share of it first), and so on; the last is resharded to
    /// `new_world`. Returns the last reshard.
    fn check_chain(records: u64, tail: Tail, runs: &[(u32, Vec<u64>)], new_world: u32) -> Reshard {
        let first_spec = StreamSpec {
            shuffle: SHUFFLE.get(),
            ..spec(records, runs[0].0, tail)
        };
        // What each epoch's slots were read as: (epoch, record) counts.
        let mut read: HashMap<(u64, u64), u32> = HashMap::new();
        // The spec whose grid each epoch was begun in, from the epoch on.
        let mut grids: Vec<(u64, StreamSpec)> = vec![(0, first_spec.clone())];
        let mut old = first_spec.clone();
        let mut last: Option<Reshard> = None;
        for (i, (world, seqs)) in runs.iter().enumerate() {
            assert_eq!((old.world, seqs.len()), (*world, *world as usize));
            for (r, &seq) in seqs.iter().enumerate() {
                // Each rank reads from where the reshard before started it.
                let start = last.as_ref().map_or(0, |l| l.states()[r].seq(&old));
                assert!(start <= seq, "rank {r} at {seq}, before its start {start}");
                for s in start..seq {
                    let rank = r as u32;
                    *read
                        .entry((old.epoch_at(rank, s), old.record_at(rank, s)))
                        .or_default() += 1;
                }
            }
            let to = runs.get(i + 1).map_or(new_world, |(w, _)| *w);
            let reshard = Reshard::new(&old, &states_at(&old, seqs), to).unwrap();
            // (A reshard that left nothing is never written.)
            assert_eq!(
                Reshard::from_text(&old, &reshard.to_text()).as_ref(),
                (!reshard.remainders.is_empty()).then_some(&reshard),
                "{}",
                reshard.to_text()
            );
            // Nested when the old run was resharded and some rank had not read its share.
            assert_eq!(
                reshard.to_text().contains('|'),
                reshard.old.reshard.is_some()
            );
            old = reshard.spec();
            if i + 1 < runs.len() {
                grids.push((reshard.next_epoch(), old.plain()));
            }
            last = Some(reshard);
        }
        let reshard = last.unwrap();
        // The stream the new world reads: the reshard's records first, then the new spec's.
        let resharded = reshard.spec();
        let new = resharded.plain();
        assert_eq!(resharded.reshard.is_some(), !reshard.remainders.is_empty());
        resharded.check(new_world - 1).unwrap();
        let mut shares = Vec::new();
        for rank in 0..new_world {
            let share = reshard.share(rank);
            // The remainders' samples, each in the remainder it was dealt from, in order.
            let mut seq = 0;
            for r in &reshard.remainders {
                for _ in 0..r.share(new_world, rank).1 {
                    if let Some(epoch) = r.epoch {
                        assert_eq!(resharded.epoch_at(rank, seq), epoch);
                    }
                    *read
                        .entry((
                            resharded.epoch_at(rank, seq),
                            resharded.record_at(rank, seq),
                        ))
                        .or_default() += 1;
                    seq += 1;
                }
            }
            assert_eq!(seq, share);
            shares.push(share);
            // Each rank ends after its share and the epochs left, and starts where its state
            // says (a plain stream's sequence numbers count from its first epoch).
            let before = if resharded.reshard.is_some() {
                share
            } else {
                reshard.next_epoch() * new.per_rank()
            };
            assert_eq!(
                resharded.end_seq(rank),
                Some(before + (4 - reshard.next_epoch()) * new.per_rank())
            );
            let start = reshard.states()[rank as usize];
            assert_eq!((start.rank, start.spec_digest), (rank, resharded.digest()));
            if resharded.reshard.is_none() {
                assert_eq!(start.seq(&new), reshard.next_epoch() * new.per_rank());
            } else {
                assert_eq!(start.seq(&resharded), 0);
            }
            if share > 0 {
                // A rejected record is replaced from the rank's own share.
                let stand_ins: Vec<u64> = resharded.candidates(rank, 0).collect();
                let own: Vec<u64> = (0..share).map(|s| resharded.record_at(rank, s)).collect();
                assert_eq!(stand_ins, own);
            }
            // Then the next epoch, as a run at the new world would read it.
            for p in 0..new
                .per_rank()
                .min(resharded.end_seq(rank).map_or(u64::MAX, |end| end - before))
            {
                assert_eq!(
                    resharded.record_at(rank, before + p),
                    new.record_at(rank, reshard.next_epoch() * new.per_rank() + p),
                    "rank {rank}, position {p} of the next epoch"
                );
            }
        }
        let (most, least) = (shares.iter().max().unwrap(), shares.iter().min().unwrap());
        assert!(most - least <= 1, "shares {shares:?} differ by one at most");
        let first_epoch = runs[0].1.iter().min().unwrap() / first_spec.per_rank();
        for epoch in first_epoch..reshard.next_epoch() {
            // Every slot of the epoch once: its records as an uninterrupted run at the world it
            // was begun in reads them.
            let grid = &grids.iter().rfind(|(from, _)| *from <= epoch).unwrap().1;
            let per_rank = grid.per_rank();
            let mut expected: HashMap<u64, u32> = HashMap::new();
            for r in 0..grid.world {
                for p in 0..per_rank {
                    *expected
                        .entry(grid.record_at(r, epoch * per_rank + p))
                        .or_default() += 1;
                }
            }
            let got: HashMap<u64, u32> = read
                .iter()
                .filter(|((e, _), _)| *e == epoch)
                .map(|(&(_, record), &n)| (record, n))
                .collect();
            assert_eq!(got, expected, "epoch {epoch}");
        }
        reshard
    }

    /// The text form reads back as the same reshard, from the spec at either world, is small,
    /// and what is not one (or lies) is refused in bounded time and memory.
    #[test]
    fn the_text_form_reads_back_and_stays_small() {
        let old = spec(103, 4, Tail::Drop);
        let states = states_at(&old, &[5, 9, 27, 11]);
        let reshard = Reshard::new(&old, &states, 3).unwrap();
        let text = reshard.to_text();
        assert_eq!(Reshard::from_text(&old, &text), Some(reshard.clone()));
        assert_eq!(Reshard::from_text(&reshard.spec(), &text), Some(reshard));
        let other = StreamSpec {
            seed: 12,
            ..old.clone()
        };
        assert_eq!(Reshard::from_text(&other, &text), None, "another stream");
        for lie in [
            "r1:0:4:3:0:",
            "r2:0:4:3:0:1,2,3,4",
            &text.replace(":4:3:", ":10000:3:"),
            &text.replace(":4:3:", ":4:0:"),
            &format!("{}*ffffffff", text),
            &format!("{text},0"),
        ] {
            assert_eq!(Reshard::from_text(&old, lie), None, "{lie}");
        }
        // 1,024 ranks near the end of an epoch of 10^9 records: at one position, and at as
        // many positions as ranks.
        let big = StreamSpec {
            records: 1_000_000_000,
            world: 1024,
            ..old.clone()
        };
        let at = |seq: &dyn Fn(u32) -> u64| -> String {
            let states: Vec<StreamState> = (0..1024)
                .map(|r| StreamState::at(&big, r, seq(r)))
                .collect();
            Reshard::new(&big, &states, 1000).unwrap().to_text()
        };
        let together = at(&|_| 976_000);
        let apart = at(&|r| 975_000 + u64::from(r));
        eprintln!(
            "1,024 ranks: {} bytes together, {} apart",
            together.len(),
            apart.len()
        );
        assert!(together.len() < 80, "{} bytes", together.len());
        assert!(apart.len() < 10 << 10, "{} bytes", apart.len());
    }

    /// Reproducible draws below `n` (xorshift from `seed`).
    fn draws(mut seed: u64) -> impl FnMut(u64) -> u64 {
        move |n| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        }
    }

    /// Worlds 1 to 9 to worlds 1 to 9, every shuffle and tail, ranks anywhere in two epochs.
    #[test]
    fn any_world_to_any_world() {
        let mut next = draws(0x2545_f491_4f6c_dd1du64);
        for _ in 0..300 {
            let old_world = 1 + next(9) as u32;
            let new_world = 1 + next(9) as u32;
            let records = u64::from(old_world.max(new_world)) + next(60);
            let tail = if next(2) == 0 { Tail::Drop } else { Tail::Pad };
            SHUFFLE.set([Shuffle::None, Shuffle::Full, Shuffle::Block(4)][next(3) as usize]);
            let per_rank = spec(records, old_world, tail).per_rank();
            let base = next(2) * per_rank;
            let seqs: Vec<u64> = (0..old_world)
                .map(|_| base + next(per_rank + per_rank / 2 + 1))
                .collect();
            check(records, tail, old_world, &seqs, new_world);
        }
    }

    /// What cannot be resharded is refused, saying why.
    #[test]
    fn impossible_reshards_are_refused() {
        let old = spec(10, 2, Tail::Drop);
        let at = |seqs: &[(u64, u64)]| -> Vec<StreamState> {
            seqs.iter()
                .enumerate()
                .map(|(r, &(epoch, position))| StreamState {
                    spec_digest: old.digest(),
                    rank: r as u32,
                    epoch,
                    position,
                })
                .collect()
        };
        let two = at(&[(0, 3), (0, 3)]);
        assert!(
            matches!(Reshard::new(&old, &two, 11), Err(ReshardError::Invalid(_))),
            "10 records for 11 ranks"
        );
        assert!(matches!(
            Reshard::new(&old, &two, 0),
            Err(ReshardError::Invalid(_))
        ));
        assert!(matches!(
            Reshard::new(&old, &two[..1], 3),
            Err(ReshardError::Ranks { .. })
        ));
        assert!(matches!(
            Reshard::new(&old, &[two[0], two[0]], 3),
            Err(ReshardError::Ranks { .. })
        ));
        let other = StreamState {
            spec_digest: 1,
            ..two[1]
        };
        assert!(matches!(
            Reshard::new(&old, &[two[0], other], 3),
            Err(ReshardError::OtherStream { .. })
        ));
        assert!(
            matches!(
                Reshard::new(&old, &at(&[(0, 3), (4, 1)]), 3),
                Err(ReshardError::Invalid(_))
            ),
            "past the end"
        );
        assert!(matches!(
            Reshard::new(&old, &at(&[(u64::MAX / 2, 0), (0, 0)]), 3),
            Err(ReshardError::Invalid(_))
        ));
        let endless = StreamSpec {
            epochs: None,
            ..old.clone()
        };
        let far: Vec<StreamState> = at(&[(0, 1), (1 << 40, 0)])
            .into_iter()
            .map(|s| StreamState {
                spec_digest: endless.digest(),
                ..s
            })
            .collect();
        assert!(
            matches!(
                Reshard::new(&endless, &far, 3),
                Err(ReshardError::Invalid(_))
            ),
            "epochs apart"
        );
        // A position past the rank's share is the next epoch's: nothing read twice.
        let one = spec(40, 1, Tail::Drop);
        let past = StreamState {
            spec_digest: one.digest(),
            rank: 0,
            epoch: 0,
            position: 45,
        };
        let r = Reshard::new(&one, &[past], 2).unwrap();
        assert_eq!(r.share(0) + r.share(1), 35, "epoch 1 less the 5 read");
        assert_eq!(r.next_epoch(), 2);
    }

    /// A resharded spec crosses the socket whole from protocol 13 on; only a resharded spec's
    /// digest changes; a forged reshard, or one for another world, is refused.
    #[test]
    fn a_resharded_spec_crosses_the_socket_with_a_digest_of_its_own() {
        use crate::frame::RESHARD_SINCE;
        use crate::wire::{Reader, Wire, Writer};
        let old = spec(103, 4, Tail::Drop);
        let states = states_at(&old, &[5, 9, 27, 11]);
        let new = Reshard::new(&old, &states, 3).unwrap().spec();
        let plain = new.plain();
        assert_ne!(new.digest(), plain.digest());
        assert!(new.canonical_bytes().starts_with(&plain.canonical_bytes()));
        let encode = |spec: &StreamSpec, version| {
            let mut buf = Vec::new();
            spec.encode(&mut Writer {
                buf: &mut buf,
                version,
            });
            buf
        };
        let decode = |buf: &[u8], version| StreamSpec::decode(&mut Reader::at(buf, version));
        let wire = encode(&new, RESHARD_SINCE);
        assert_eq!(decode(&wire, RESHARD_SINCE), Ok(new.clone()));
        assert_eq!(
            decode(&encode(&plain, RESHARD_SINCE), RESHARD_SINCE),
            Ok(plain.clone())
        );
        let mut forged = wire.clone();
        *forged.last_mut().unwrap() = b'g';
        let elsewhere = encode(
            &StreamSpec {
                world: 2,
                ..new.clone()
            },
            RESHARD_SINCE,
        );
        for bad in [forged, elsewhere] {
            assert_eq!(
                decode(&bad, RESHARD_SINCE),
                Err(crate::wire::DecodeError::InvalidValue { field: "reshard" })
            );
        }
    }

    /// Checkpoint texts: resharded, read back at the new world (not another), resharded
    /// again once every rank has read its share (not before), and plain when the ranks
    /// stopped at an epoch's end.
    #[test]
    fn checkpoint_texts_reshard_and_read_back() {
        let old = spec(103, 4, Tail::Drop);
        let texts = |spec: &StreamSpec, seqs: &[u64]| -> Vec<String> {
            seqs.iter()
                .enumerate()
                .map(|(r, &seq)| state_text(spec, &StreamState::at(spec, r as u32, seq)))
                .collect()
        };
        fn refs(t: &[String]) -> Vec<&str> {
            t.iter().map(String::as_str).collect()
        }
        let saved = texts(&old, &[5, 9, 27, 11]);
        let three = reshard_texts(&old, &refs(&saved), 3).unwrap();
        let at_three = StreamSpec {
            world: 3,
            ..old.clone()
        };
        let (resharded, first) = read_state(&at_three, &three[1]).unwrap();
        assert!(resharded.reshard.is_some() && three[1].contains('@'));
        assert_eq!((first.rank, first.seq(&resharded)), (1, 0));
        let wrong = read_state(&old, &three[1]).unwrap_err();
        assert!(wrong.contains("a world of 3, not 4"), "{wrong}");
        assert!(read_state(&at_three, &saved[0]).is_err());
        // Inside the shares: read back as it was, and resharded again over it (nested), the
        // new texts read back at the new world.
        let reshard = resharded.reshard.clone().unwrap();
        let shares: Vec<u64> = (0..3).map(|r| reshard.share(r)).collect();
        let inside = texts(&resharded, &[shares[0] - 1, shares[1], shares[2] + 5]);
        assert_eq!(
            read_state(&at_three, &inside[0]).unwrap(),
            (
                resharded.clone(),
                StreamState::at(&resharded, 0, shares[0] - 1)
            )
        );
        let nested = reshard_texts(&at_three, &refs(&inside), 2).unwrap();
        let at_two = StreamSpec {
            world: 2,
            ..old.clone()
        };
        let (twice, _) = read_states(&at_two, &refs(&nested)).unwrap();
        let twice = twice.reshard.unwrap();
        assert!(nested[0].contains('|') && twice.levels() == 2);
        assert_eq!(
            twice.share(0) + twice.share(1),
            1 + (at_three.per_rank() * 3 - 5)
        );
        // Past them: the same as resharding the ordinary states they stand for.
        let past = texts(&resharded, &[shares[0], shares[1] + 3, shares[2] + 40]);
        let base = reshard.next_epoch() * at_three.per_rank();
        let ordinary = texts(&at_three, &[base, base + 3, base + 40]);
        assert_eq!(
            reshard_texts(&at_three, &refs(&past), 2).unwrap(),
            reshard_texts(&at_three, &refs(&ordinary), 2).unwrap()
        );
        // At an epoch's end nothing is left: plain states of the next epoch.
        let ends = texts(&old, &[old.per_rank(); 4]);
        let two = reshard_texts(&old, &refs(&ends), 2).unwrap();
        for (r, t) in two.iter().enumerate() {
            let (s, state) = read_state(&at_two, t).unwrap();
            assert_eq!(s, at_two);
            assert_eq!(state, StreamState::at(&at_two, r as u32, at_two.per_rank()));
        }
        assert!(reshard_texts(&old, &refs(&saved[..3]), 2).is_err());
        // A state past the end (or past what 64 bits hold), or of a rank outside the world.
        let digest = old.digest();
        for (text, why) in [
            (
                format!("{digest:016x}:0:ffffffffffffffff:0"),
                "past the stream's end",
            ),
            (format!("{digest:016x}:0:4:1"), "past the stream's end"),
            (format!("{digest:016x}:4:0:0"), "outside a world of 4"),
        ] {
            let err = read_state(&old, &text).unwrap_err();
            assert!(err.contains(why), "{text}: {err}");
        }
        // The same reshard with spaces around it is the same run.
        let spaced = three[0].replacen('@', " @", 1);
        assert!(read_states(&at_three, &[&spaced, &three[1]]).is_ok());
    }

    /// Texts no states could give, or not as a reshard writes them, are refused, in bounded
    /// time and memory.
    #[test]
    fn hostile_texts_are_refused() {
        let old = spec(103, 4, Tail::Drop);
        let digest = format!("{:016x}", old.digest());
        let many = format!("r1:{digest}:4:3:0:{}", vec!["0*4"; 100_000].join(";"));
        assert_eq!(Reshard::from_text(&old, &many), None);
        // 65,536 ranks over 2 epochs: a short text for more counts than a reshard keeps.
        let wide = spec(1 << 40, 1 << 16, Tail::Drop);
        let wide_digest = format!("{:016x}", wide.digest());
        let one = format!("r1:{wide_digest}:10000:3:0:1000000,1*ffff");
        assert!(
            Reshard::from_text(&wide, &one).is_some(),
            "one epoch: within the bound"
        );
        let cells = format!("{one};1,0*ffff");
        assert!(cells.len() < 100);
        assert_eq!(Reshard::from_text(&wide, &cells), None);
        for lie in [
            format!("r1:{digest}:4:3:0:1*4;0*4"),
            format!("r1:{digest}:4:3:0:1*4;1,0*3"),
            format!("r1:{digest}:4:3:0:+1*4"),
            format!("r1:{digest}:4:3:0:1*3,A"),
            format!("r1:{digest}:4:3:fffffffffffffff0:1*4"),
            format!("r1:{digest}:4:3:4:1*4"),
            // Nothing left: never written.
            format!("r1:{digest}:4:3:2:"),
            // Not as written: runs split or of one, leading zeros.
            format!("r1:{digest}:4:3:0:1,1,1,1"),
            format!("r1:{digest}:4:3:0:1*2,1*2"),
            format!("r1:{digest}:4:3:0:01*4"),
            format!("r1:{digest}:4:03:0:1*4"),
        ] {
            assert_eq!(Reshard::from_text(&old, &lie), None, "{lie}");
        }
        assert!(Reshard::from_text(&old, &format!("r1:{digest}:4:3:0:1*4")).is_some());
        // Ranks 15 epochs apart are kept, 16 refused: as text too (a rank that read all of the
        // last of 16 epochs stands 16 epochs past the first).
        let endless = StreamSpec {
            epochs: None,
            ..old.clone()
        };
        let far = |last_read: u64| {
            let states = states_at(&endless, &[15 * 25 + last_read, 0, 0, 0]);
            let text = format!(
                "r1:{:016x}:4:3:0:{}{:x},0*3",
                endless.digest(),
                "19,0*3;".repeat(15),
                last_read
            );
            (
                Reshard::new(&endless, &states, 3),
                Reshard::from_text(&endless, &text),
            )
        };
        let (made, read) = far(1);
        assert_eq!(made.ok(), read);
        assert!(read.is_some());
        let (made, read) = far(25);
        assert!(made.is_err() && read.is_none());
    }

    /// The shares of a resharded stream (its ranks' own, in full) plus `extra` of each rank's
    /// next samples, capped at the stream's end.
    fn past_shares(spec: &StreamSpec, extra: &[u64]) -> Vec<u64> {
        let r = spec.reshard.as_ref().unwrap();
        (0..spec.world)
            .map(|rank| {
                let seq = r.share(rank) + extra[rank as usize];
                seq.min(spec.end_seq(rank).unwrap())
            })
            .collect()
    }

    /// A run resharded again while its ranks still read their shares of the first reshard:
    /// what they left of those shares is dealt first, every sample of the epochs begun read
    /// once over all three runs, and the epochs after are the last world's.
    #[test]
    fn a_reshard_of_a_reshard_deals_what_is_left_of_the_shares_first() {
        let first = spec(103, 4, Tail::Drop);
        let once = Reshard::new(&first, &states_at(&first, &[5, 9, 27, 11]), 3)
            .unwrap()
            .spec();
        let shares: Vec<u64> = (0..3)
            .map(|r| once.reshard.as_ref().unwrap().share(r))
            .collect();
        // 4 → 3 → 2: one rank read nothing of its share, one part of it, one is past it.
        check_chain(
            103,
            Tail::Drop,
            &[
                (4, vec![5, 9, 27, 11]),
                (3, vec![0, shares[1] / 2, shares[2] + 7]),
            ],
            2,
        );
        // 4 → 3 → 5, every rank inside its share; and a rank at its very end.
        check_chain(
            103,
            Tail::Drop,
            &[(4, vec![5, 9, 27, 11]), (3, vec![1, 2, 3])],
            5,
        );
        check_chain(
            103,
            Tail::Drop,
            &[
                (4, vec![5, 9, 27, 11]),
                (3, vec![shares[0], shares[1] - 1, 0]),
            ],
            1,
        );
        // Three reshards deep: 2 → 3 → 2 → 4.
        let last = check_chain(
            100,
            Tail::Pad,
            &[(2, vec![10, 3]), (3, vec![4, 0, 9]), (2, vec![2, 5])],
            4,
        );
        assert_eq!(last.levels(), 3);
        // Every rank past its share: the ordinary states' reshard, not nested.
        let plain = check_chain(
            103,
            Tail::Drop,
            &[
                (4, vec![5, 9, 27, 11]),
                (3, past_shares(&once, &[0, 3, 40])),
            ],
            2,
        );
        assert_eq!(plain.levels(), 1);
    }

    /// Random chains of two and three reshards, every shuffle and tail.
    #[test]
    fn any_chain_of_reshards() {
        let mut next = draws(0x9e37_79b9_7f4a_7c15u64);
        let mut nested = [0usize; 3];
        for _ in 0..150 {
            let depth = 2 + next(2) as usize;
            let worlds: Vec<u32> = (0..=depth).map(|_| 1 + next(6) as u32).collect();
            let records = u64::from(*worlds.iter().max().unwrap()) + next(50);
            let tail = if next(2) == 0 { Tail::Drop } else { Tail::Pad };
            SHUFFLE.set([Shuffle::None, Shuffle::Full, Shuffle::Block(4)][next(3) as usize]);
            let first = StreamSpec {
                shuffle: SHUFFLE.get(),
                ..spec(records, worlds[0], tail)
            };
            let per_rank = first.per_rank();
            let mut runs = vec![(
                worlds[0],
                (0..worlds[0])
                    .map(|_| next(per_rank + 1))
                    .collect::<Vec<u64>>(),
            )];
            // Each later run's ranks stand anywhere in their share or a little past it.
            let mut old = first;
            for &world in &worlds[1..depth] {
                let (w, seqs) = runs.last().unwrap();
                assert_eq!(*w, old.world);
                let reshard = Reshard::new(&old, &states_at(&old, seqs), world).unwrap();
                old = reshard.spec();
                let seqs = (0..world)
                    .map(|rank| {
                        let start = reshard.states()[rank as usize].seq(&old);
                        let share = old.reshard.as_ref().map_or(0, |r| r.share(rank));
                        let end = old.end_seq(rank).unwrap();
                        (start + next(share + old.per_rank() / 2 + 1)).min(end)
                    })
                    .collect();
                runs.push((world, seqs));
            }
            let levels = check_chain(records, tail, &runs, worlds[depth]).levels();
            nested[levels - 1] += 1;
        }
        // The chains did nest, two and three deep.
        eprintln!("reshards 1, 2 and 3 deep: {nested:?}");
        assert!(nested[1] >= 30 && nested[2] >= 10, "{nested:?}");
    }

    /// A nested text reads back only as written: on the reshard it stands on, with counts
    /// within the shares, standing at the epoch after them, at most [`MAX_LEVELS`] deep.
    #[test]
    fn nested_texts_are_checked_and_bounded() {
        let first = spec(103, 4, Tail::Drop);
        let once = Reshard::new(&first, &states_at(&first, &[5, 9, 27, 11]), 3).unwrap();
        let twice = Reshard::new(&once.spec(), &states_at(&once.spec(), &[1, 2, 3]), 2).unwrap();
        let text = twice.to_text();
        let (head, level) = text.rsplit_once('|').unwrap();
        assert_eq!(head, once.to_text());
        assert!(level.starts_with("r2:"), "{text}");
        assert_eq!(Reshard::from_text(&first, &text), Some(twice.clone()));
        let digest = format!("{:016x}", once.spec().digest());
        let next = format!("{:x}", once.next_epoch());
        for lie in [
            // A level without the reshard it stands on, or a first level that says it has one.
            level.to_string(),
            text.replacen("r1:", "r2:", 1),
            text.replace("|r2:", "|r1:"),
            // Counts past a share, or none left of the shares.
            format!("{head}|r2:{digest}:3:2:{next}:ffff*3:"),
            format!(
                "{head}|r2:{digest}:3:2:{next}:{:x},{:x},{:x}:",
                once.share(0),
                once.share(1),
                once.share(2)
            ),
            // Not at the epoch after the shares, or a rank inside its share that read on.
            format!("{head}|r2:{digest}:3:2:0:1*3:"),
            format!("{head}|r2:{digest}:3:2:{next}:1*3:5*3"),
            format!("{head}|r2:{digest}:3:2:{next}:1,{:x}*2:5*3", once.share(1)),
            // Spaces, another digest, another old world.
            text.replace('|', " | "),
            format!("{head}|r2:{:016x}:3:2:{next}:1*3:", first.digest()),
            format!("{head}|r2:{digest}:4:2:{next}:1*4:"),
        ] {
            assert_eq!(Reshard::from_text(&first, &lie), None, "{lie}");
        }
        assert!(
            Reshard::from_text(&first, &format!("{head}|r2:{digest}:3:2:{next}:1*3:")).is_some()
        );
        // Deeper than MAX_LEVELS: refused when made, and as text.
        let mut spec = first.clone();
        let mut texts = Vec::new();
        for level in 0..=MAX_LEVELS {
            let world = [3, 2][level % 2];
            let seqs: Vec<u64> = (0..spec.world).map(|r| u64::from(r == 0)).collect();
            match Reshard::new(&spec, &states_at(&spec, &seqs), world) {
                Ok(r) => {
                    assert_eq!(r.levels(), level + 1);
                    texts.push(r.to_text());
                    spec = r.spec();
                }
                Err(e) => {
                    assert_eq!(level, MAX_LEVELS, "{e}");
                    assert!(e.to_string().contains("resume at world"), "{e}");
                }
            }
        }
        assert_eq!(texts.len(), MAX_LEVELS);
        let deepest = texts.last().unwrap();
        assert!(Reshard::from_text(&first, deepest).is_some());
        let (_, level) = deepest.rsplit_once('|').unwrap();
        assert_eq!(
            Reshard::from_text(&first, &format!("{deepest}|{level}")),
            None
        );
    }

    #[test]
    fn every_sample_left_is_read_once_by_the_new_world() {
        // 2 → 3, a rank that read nothing.
        check(100, Tail::Drop, 2, &[0, 17], 3);
        // 4 → 2, uneven progress, one rank already in the next epoch.
        check(103, Tail::Drop, 4, &[5, 9, 25 + 2, 11], 2);
        // 3 → 1, in the last few samples of an epoch.
        check(99, Tail::Pad, 3, &[31, 32, 33], 1);
        // 1 → 4.
        check(50, Tail::Drop, 1, &[7], 4);
        // Same world, and growth past the records left.
        check(40, Tail::Drop, 4, &[3, 3, 2, 3], 4);
        check(40, Tail::Pad, 2, &[19, 19], 8);
    }
}
