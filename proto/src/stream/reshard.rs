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
//! What it holds is the old spec and, per epoch left unfinished, one count per old rank: its
//! size grows with the old world, never with the data set (see [`Reshard::to_text`]).

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

/// One epoch's remainder: how many of its own slots each old rank had read.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Remainder {
    epoch: u64,
    /// Per old rank, slots read (at most `per_rank`).
    read: Vec<u64>,
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
    /// `None` when the counts do not fit in 64 bits.
    fn new(epoch: u64, read: Vec<u64>, per_rank: u64, offset: u64) -> Option<Remainder> {
        let mut sorted = read.clone();
        sorted.sort_unstable();
        let mut prefix = Vec::with_capacity(sorted.len() + 1);
        prefix.push(0u64);
        for &c in &sorted {
            prefix.push(prefix.last().copied().unwrap_or(0).checked_add(c)?);
        }
        let mut left = 0u64;
        for &c in &read {
            left = left.checked_add(per_rank.checked_sub(c)?)?;
        }
        offset.checked_add(left)?;
        Some(Remainder {
            epoch,
            read,
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

    /// Slots left in the rows before `row`: `Σ max(0, row − read_r)`.
    fn left_before(&self, row: u64) -> u64 {
        let below = self.sorted.partition_point(|&c| c < row);
        below as u64 * row - self.prefix[below]
    }

    /// The `k`-th slot left (`k < left`), as (old rank, position).
    fn nth(&self, k: u64, per_rank: u64) -> (u32, u64) {
        // The row: the last one with fewer than k + 1 slots left before it.
        let (mut lo, mut hi) = (self.sorted[0], per_rank);
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
            if c <= lo {
                if j == 0 {
                    return (rank as u32, lo);
                }
                j -= 1;
            }
        }
        unreachable!("row {lo} holds slot {k}")
    }
}

/// What a run at one world size left unread, dealt to the ranks of another
/// ([`Reshard::new`]).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Reshard {
    /// The stream as the old run read it (its ordinary epochs: a reshard of a resharded
    /// stream starts from where its ranks stand in those).
    old: StreamSpec,
    /// The same at the new world size.
    new: StreamSpec,
    /// The new world's size.
    world: u32,
    /// The epochs some old rank had begun and not every one had finished, in order.
    remainders: Vec<Remainder>,
    /// The first epoch the new world reads whole.
    next_epoch: u64,
}

impl Reshard {
    /// Deals what the ranks of `old` left unread (their `states`, one per rank, in any order)
    /// to `world` new ranks.
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
        if let Some(before) = &old.reshard {
            let states = before.in_ordinary_epochs(old, states)?;
            return Reshard::new(&old.plain(), &states, world);
        }
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
        let new = StreamSpec {
            world,
            reshard: None,
            ..old.clone()
        };
        new.check(0)
            .map_err(|e| ReshardError::Invalid(format!("at the new world size: {e}")))?;
        let per_rank = old.per_rank();
        // Each state as its sequence number says (a position past the rank's share is the next
        // epoch's), within the stream.
        let mut at = Vec::with_capacity(states.len());
        for s in &states {
            let seq = s
                .epoch
                .checked_mul(per_rank)
                .and_then(|e| e.checked_add(s.position))
                .filter(|&seq| old.end_seq(s.rank).is_none_or(|end| seq <= end))
                .ok_or_else(|| {
                    ReshardError::Invalid(format!("rank {} is past the stream's end", s.rank))
                })?;
            at.push(StreamState::at(old, s.rank, seq));
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
        if (next_epoch - first).saturating_mul(u64::from(old.world)) > MAX_RESHARD_CELLS as u64 {
            return Err(ReshardError::Invalid(format!(
                "{} ranks over {} unfinished epochs: more than {MAX_RESHARD_CELLS} counts to keep",
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
        let mut remainders: Vec<Remainder> = Vec::new();
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
            let r = Remainder::new(epoch, read, per_rank, offset)
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
        };
        let text = reshard.to_text().len();
        if text > MAX_RESHARD_TEXT {
            return Err(ReshardError::Invalid(format!(
                "what the ranks left takes {text} bytes to say, more than {MAX_RESHARD_TEXT}: \
                 too many ranks stopped at different positions (resume at the same world size, \
                 or from a checkpoint taken at an epoch's end)"
            )));
        }
        Ok(reshard)
    }

    /// The states of a resharded stream's ranks (`stream`'s, whose reshard this is) as states
    /// of its ordinary epochs, for a reshard of those: refused while a rank still reads its
    /// share of this reshard.
    fn in_ordinary_epochs(
        &self,
        stream: &StreamSpec,
        states: &[StreamState],
    ) -> Result<Vec<StreamState>, ReshardError> {
        let expected = stream.digest();
        let plain = stream.plain();
        states
            .iter()
            .map(|s| {
                if s.spec_digest != expected {
                    return Err(ReshardError::OtherStream {
                        expected,
                        found: s.spec_digest,
                    });
                }
                if s.rank >= self.world {
                    return Err(ReshardError::Ranks {
                        world: self.world,
                        found: states.len(),
                    });
                }
                let share = self.share(s.rank);
                let seq = s
                    .epoch
                    .checked_mul(stream.per_rank())
                    .and_then(|e| e.checked_add(s.position))
                    .ok_or_else(|| {
                        ReshardError::Invalid(format!("rank {} is past the stream's end", s.rank))
                    })?;
                if seq < share {
                    return Err(ReshardError::Invalid(format!(
                        "rank {} has read {seq} of the {share} samples that the run before the \
                         last resize left it: resume at world {} until every rank has read its \
                         share, then resize again",
                        s.rank, self.world
                    )));
                }
                let ordinary = (seq - share)
                    .checked_add(self.next_epoch * plain.per_rank())
                    .ok_or_else(|| {
                        ReshardError::Invalid(format!("rank {} is past the stream's end", s.rank))
                    })?;
                Ok(StreamState::at(&plain, s.rank, ordinary))
            })
            .collect()
    }

    /// The stream the new world reads: the old spec at the new world size, resuming this
    /// reshard (none when the old ranks left no epoch unfinished).
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

    /// The epoch new rank `rank`'s sample at `seq` belongs to: of the remainders, the epoch it
    /// was left from.
    pub fn epoch_at(&self, rank: u32, seq: u64) -> u64 {
        let mut seq = seq;
        for r in &self.remainders {
            let n = r.share(self.world, rank).1;
            if seq < n {
                return r.epoch;
            }
            seq -= n;
        }
        self.next_epoch.saturating_add(seq / self.new.per_rank())
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
        let mut seq = seq;
        let per_rank = self.old.per_rank();
        for r in &self.remainders {
            let (first, n) = r.share(self.world, rank);
            if seq < n {
                let (old_rank, position) = r.nth(first + seq * u64::from(self.world), per_rank);
                return self.old.record_at(old_rank, r.epoch * per_rank + position);
            }
            seq -= n;
        }
        self.new.ordinary_record_at(
            rank,
            (self.next_epoch * self.new.per_rank()).saturating_add(seq),
        )
    }
}

/// The longest text a reshard may have ([`Reshard::to_text`]): it fits a frame of any size
/// a side may agree to, with room to spare. 1,024 ranks at different positions take 6 KiB; a
/// reshard that would take more is refused ([`Reshard::new`]).
pub const MAX_RESHARD_TEXT: usize = 32 << 10;
/// The most counts a reshard keeps (old ranks times the epochs they left unfinished): 1,024
/// ranks over 16 epochs, or 65,536 ranks in one, about 1.5 MiB of tables.
pub const MAX_RESHARD_CELLS: usize = 1 << 16;
/// The most old ranks a reshard may have (a bound for text read from a checkpoint).
pub const MAX_OLD_WORLD: u32 = 1 << 16;
/// The most epochs the old ranks may be apart (a rank that many epochs behind the others is a
/// run gone wrong, not one to resume).
pub const MAX_EPOCHS_APART: u64 = 16;

impl Reshard {
    /// A one-line text form for checkpoints:
    /// `r1:<old spec digest>:<old world>:<new world>:<first epoch>:<counts>` in hex, where
    /// `<counts>` lists each unfinished epoch's counts (slots each old rank read) separated by
    /// `;`, each as runs `value*times` separated by `,` (`*times` left out for one). Ranks that
    /// stop together write one run: 1,024 ranks at one position of an epoch of 10^9 records
    /// take 39 bytes, at 1,024 different positions 6 KiB. It grows with the old world and the
    /// epochs its ranks are apart (at most [`MAX_EPOCHS_APART`]), never with the data set.
    pub fn to_text(&self) -> String {
        let epochs: Vec<String> = self
            .remainders
            .iter()
            .map(|r| {
                let mut runs: Vec<(u64, u64)> = Vec::new();
                for &c in &r.read {
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
            })
            .collect();
        let first = self.remainders.first().map_or(self.next_epoch, |r| r.epoch);
        format!(
            "r1:{:016x}:{:x}:{:x}:{:x}:{}",
            self.old.digest(),
            self.old.world,
            self.world,
            first,
            epochs.join(";")
        )
    }

    /// Parses [`Reshard::to_text`] for the stream `spec` (at either world size): `None` when it
    /// is not one, names another stream, or lies (counts past an epoch, more than
    /// [`MAX_OLD_WORLD`] ranks).
    pub fn from_text(spec: &StreamSpec, text: &str) -> Option<Reshard> {
        // Lowercase hex digits only, one to sixteen: one text per reshard.
        let hex = |s: &str| {
            (!s.is_empty()
                && s.len() <= 16
                && s.bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)))
            .then(|| u64::from_str_radix(s, 16).ok())
            .flatten()
        };
        if text.len() > MAX_RESHARD_TEXT {
            return None;
        }
        let mut parts = text.trim().split(':');
        if parts.next()? != "r1" {
            return None;
        }
        let digest = hex(parts.next()?)?;
        let old_world = u32::try_from(hex(parts.next()?)?).ok()?;
        let world = u32::try_from(hex(parts.next()?)?).ok()?;
        let first = hex(parts.next()?)?;
        let counts = parts.next()?;
        if parts.next().is_some() || old_world == 0 || old_world > MAX_OLD_WORLD {
            return None;
        }
        let old = StreamSpec {
            world: old_world,
            reshard: None,
            ..spec.clone()
        };
        let new = StreamSpec {
            world,
            reshard: None,
            ..spec.clone()
        };
        if old.digest() != digest || old.check(0).is_err() || new.check(0).is_err() {
            return None;
        }
        let per_rank = old.per_rank();
        // (A reshard that left nothing is never written: its stream is the plain one.)
        let epochs: Vec<&str> = counts.split(';').collect();
        let next_epoch = first.checked_add(epochs.len() as u64)?;
        if counts.is_empty()
            || epochs.len() as u64 > MAX_EPOCHS_APART
            || epochs.len().saturating_mul(old_world as usize) > MAX_RESHARD_CELLS
            || next_epoch.checked_mul(per_rank).is_none()
            || next_epoch.checked_mul(new.per_rank()).is_none()
            || old.epochs.is_some_and(|e| next_epoch > e)
        {
            return None;
        }
        let mut remainders: Vec<Remainder> = Vec::new();
        for (i, epoch) in epochs.iter().enumerate() {
            let mut read = Vec::with_capacity(old_world as usize);
            for run in epoch.split(',') {
                let (v, n) = match run.split_once('*') {
                    Some((v, n)) => (hex(v)?, hex(n)?),
                    None => (hex(run)?, 1),
                };
                if v > per_rank || n == 0 || n > u64::from(old_world) - read.len() as u64 {
                    return None;
                }
                read.extend(std::iter::repeat_n(v, n as usize));
            }
            if read.len() != old_world as usize {
                return None;
            }
            // What states could say: a rank that had not finished an epoch read nothing of
            // the next, and some rank had begun the last.
            if let Some(before) = remainders.last()
                && before
                    .read
                    .iter()
                    .zip(&read)
                    .any(|(&b, &r)| b < per_rank && r > 0)
            {
                return None;
            }
            if i + 1 == epochs.len() && read.iter().all(|&r| r == 0) {
                return None;
            }
            let offset = remainders.last().map_or(0, |r| r.offset + r.left);
            let r = Remainder::new(first + i as u64, read, per_rank, offset)?;
            if r.left == 0 {
                return None;
            }
            remainders.push(r);
        }
        let reshard = Reshard {
            old,
            new,
            world,
            next_epoch,
            remainders,
        };
        // One text per reshard: what it writes, nothing else (no leading zeros, no runs split
        // or of one).
        (reshard.to_text() == text.trim()).then_some(reshard)
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
            "the state belongs to another stream spec (digest {:016x}, this one {:016x})",
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
        let old = StreamSpec {
            shuffle: SHUFFLE.get(),
            ..spec(records, old_world, tail)
        };
        let per_rank = old.per_rank();
        let reshard = Reshard::new(&old, &states_at(&old, seqs), new_world).unwrap();
        // What each epoch's slots were read as: (epoch, record) counts.
        let mut read: HashMap<(u64, u64), u32> = HashMap::new();
        for (r, &seq) in seqs.iter().enumerate() {
            for s in 0..seq {
                *read
                    .entry((s / per_rank, old.record_at(r as u32, s)))
                    .or_default() += 1;
            }
        }
        let last_epoch = seqs.iter().map(|s| s / per_rank).max().unwrap();
        // The stream the new world reads: the reshard's records first, then the new spec's.
        let resharded = reshard.spec();
        let new = resharded.plain();
        assert_eq!(resharded.reshard.is_some(), !reshard.remainders.is_empty());
        resharded.check(new_world - 1).unwrap();
        let mut shares = Vec::new();
        for rank in 0..new_world {
            let share = reshard.share(rank);
            // The remainders' samples, by epoch: each new rank reads them in epoch order.
            let mut seq = 0;
            for r in &reshard.remainders {
                for _ in 0..r.share(new_world, rank).1 {
                    assert_eq!(resharded.epoch_at(rank, seq), r.epoch);
                    *read
                        .entry((r.epoch, resharded.record_at(rank, seq)))
                        .or_default() += 1;
                    seq += 1;
                }
            }
            assert_eq!(seq, share);
            shares.push(share);
            // Each rank ends after its share and the epochs left, and starts where its state
            // says.
            assert_eq!(
                resharded.end_seq(rank),
                Some(share + (4 - reshard.next_epoch()) * new.per_rank())
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
            for p in 0..new.per_rank() {
                assert_eq!(
                    resharded.record_at(rank, share + p),
                    new.record_at(rank, reshard.next_epoch() * new.per_rank() + p),
                    "rank {rank}, position {p} of the next epoch"
                );
            }
        }
        let (most, least) = (shares.iter().max().unwrap(), shares.iter().min().unwrap());
        assert!(most - least <= 1, "shares {shares:?} differ by one at most");
        // (A reshard that left nothing is never written.)
        assert_eq!(
            Reshard::from_text(&old, &reshard.to_text()).as_ref(),
            (!reshard.remainders.is_empty()).then_some(&reshard),
            "{}",
            reshard.to_text()
        );
        let first_epoch = seqs.iter().map(|s| s / per_rank).min().unwrap();
        for epoch in first_epoch..=last_epoch {
            // Every slot of the epoch once: its records as an uninterrupted run reads them.
            let mut expected: HashMap<u64, u32> = HashMap::new();
            for r in 0..old_world {
                for p in 0..per_rank {
                    *expected
                        .entry(old.record_at(r, epoch * per_rank + p))
                        .or_default() += 1;
                }
            }
            if epoch >= reshard.next_epoch() {
                continue;
            }
            let total: u32 = read
                .iter()
                .filter(|((e, _), _)| *e == epoch)
                .map(|(_, n)| n)
                .sum();
            assert_eq!(
                u64::from(total),
                per_rank * u64::from(old_world),
                "epoch {epoch}"
            );
            for (record, n) in expected {
                let got = read.get(&(epoch, record)).copied().unwrap_or(0);
                assert_eq!(got, n, "epoch {epoch}, record {record}");
            }
        }
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

    /// Worlds 1 to 9 to worlds 1 to 9, every shuffle and tail, ranks anywhere in two epochs.
    #[test]
    fn any_world_to_any_world() {
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut next = |n: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % n
        };
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
        // Inside the shares: read back as it was, and not resharded again yet.
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
        let refused = reshard_texts(&at_three, &refs(&inside), 2).unwrap_err();
        assert!(
            refused.to_string().contains("resume at world 3"),
            "{refused}"
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
        let at_two = StreamSpec {
            world: 2,
            ..old.clone()
        };
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
