//! The stream family: specs, tasks, delivered items, positions and listings.

use crate::Handle;
use crate::stream::{Shuffle, StreamSpec, Tail};
use crate::wire::{DecodeError, Reader, Wire, Writer};

/// The spec as it crosses the socket: name, records, seed, world, shuffle kind and block size,
/// tail, epochs (0 for unbounded). (Its checkpoint digest has an encoding of its own,
/// [`StreamSpec::canonical_bytes`].)
impl Wire for StreamSpec {
    const MIN_BYTES: usize = 2 + 8 + 8 + 4 + 1 + 4 + 1 + 8;
    fn encode(&self, w: &mut Writer<'_>) {
        w.string(&self.name);
        w.u64(self.records);
        w.u64(self.seed);
        w.u32(self.world);
        let (kind, block) = self.shuffle.code();
        w.u8(kind);
        w.u32(block);
        w.u8(self.tail.code());
        w.u64(self.epochs.unwrap_or(0));
    }
    fn decode(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        let name = r.string()?;
        let records = r.u64()?;
        let seed = r.u64()?;
        let world = r.u32()?;
        let (kind, block) = (r.u8()?, r.u32()?);
        let shuffle = Shuffle::from_code(kind, block)
            .ok_or(DecodeError::InvalidValue { field: "shuffle" })?;
        let tail = Tail::from_code(r.u8()?).ok_or(DecodeError::InvalidValue { field: "tail" })?;
        let epochs = match r.u64()? {
            0 => None,
            e => Some(e),
        };
        Ok(StreamSpec {
            name,
            records,
            seed,
            world,
            shuffle,
            tail,
            epochs,
        })
    }
}

/// A rank and a sequence number: a task (make the sample for `seq` of `rank`), or where a rank
/// starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StreamTask {
    /// The rank.
    pub rank: u32,
    /// Its sequence number.
    pub seq: u64,
}

impl StreamTask {
    /// Bytes on the wire.
    pub const WIRE_BYTES: usize = 12;
}

impl Wire for StreamTask {
    const MIN_BYTES: usize = Self::WIRE_BYTES;
    fn encode(&self, w: &mut Writer<'_>) {
        w.u32(self.rank);
        w.u64(self.seq);
    }
    fn decode(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        Ok(StreamTask {
            rank: r.u32()?,
            seq: r.u64()?,
        })
    }
}

/// Where a rank lives: the peer address of the daemon its consumer uses.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RankAt {
    /// The rank.
    pub rank: u32,
    /// `host:port` of that daemon's `--listen`.
    pub addr: String,
}

impl Wire for RankAt {
    const MIN_BYTES: usize = 4 + 2;
    fn encode(&self, w: &mut Writer<'_>) {
        w.u32(self.rank);
        w.string(&self.addr);
    }
    fn decode(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        Ok(RankAt {
            rank: r.u32()?,
            addr: r.string()?,
        })
    }
}

/// A delivered sample.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamItem {
    /// The task it fulfils.
    pub task: StreamTask,
    /// The sample's object (zero when `flags` has [`crate::ring::ENTRY_FAILED`]).
    pub handle: Handle,
    /// The record it was made from.
    pub record: u64,
    /// [`crate::ring::ENTRY_FAILED`] when no candidate record made a sample.
    pub flags: u32,
    /// The sample's decode-once cache key; 0 for none.
    pub key: u128,
}

impl StreamItem {
    /// Bytes on the wire.
    pub const WIRE_BYTES: usize = StreamTask::WIRE_BYTES + Handle::WIRE_BYTES + 8 + 4 + 16;
}

impl Wire for StreamItem {
    const MIN_BYTES: usize = Self::WIRE_BYTES;
    fn encode(&self, w: &mut Writer<'_>) {
        self.task.encode(w);
        self.handle.encode(w);
        w.u64(self.record);
        w.u32(self.flags);
        w.u128(self.key);
    }
    fn decode(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        Ok(StreamItem {
            task: StreamTask::decode(r)?,
            handle: Handle::decode(r)?,
            record: r.u64()?,
            flags: r.u32()?,
            key: r.u128()?,
        })
    }
}

/// One stream as `feedstore stat` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamInfo {
    /// Its id on this daemon (pages of [`crate::frame::Request::StreamList`] follow it).
    pub id: u32,
    /// The uid that created it (its streams are its own).
    pub owner_uid: u32,
    /// Its name.
    pub name: String,
    /// Prefetch depth per rank.
    pub depth: u32,
    /// Producer connections joined.
    pub producers: u32,
    /// Ranks with a consumer attached.
    pub consumers: u32,
    /// Ranks known on this node.
    pub ranks: u32,
    /// Samples made and not yet returned, over ranks.
    pub ready: u64,
    /// Samples being made.
    pub making: u64,
    /// Samples put so far.
    pub put: u64,
    /// Samples returned by consumers so far.
    pub returned: u64,
    /// The slowest rank's next sequence number.
    pub slowest: u64,
    /// The fastest rank's next sequence number (the lag is fastest - slowest).
    pub fastest: u64,
    /// Microseconds from the stream's creation to its first sample; 0 before that.
    pub cold_start_us: u64,
}

impl StreamInfo {
    /// Bytes this entry takes in a [`crate::frame::Response::Streams`] page.
    pub fn wire_bytes(&self) -> usize {
        <StreamInfo as Wire>::MIN_BYTES + self.name.len()
    }
}

impl Wire for StreamInfo {
    /// An empty name: id, owner, the name's length, four `u32`s and seven `u64`s.
    const MIN_BYTES: usize = 4 + 4 + 2 + 4 * 4 + 7 * 8;
    fn encode(&self, w: &mut Writer<'_>) {
        w.u32(self.id);
        w.u32(self.owner_uid);
        w.string(&self.name);
        for v in [self.depth, self.producers, self.consumers, self.ranks] {
            w.u32(v);
        }
        for v in [
            self.ready,
            self.making,
            self.put,
            self.returned,
            self.slowest,
            self.fastest,
            self.cold_start_us,
        ] {
            w.u64(v);
        }
    }
    fn decode(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        Ok(StreamInfo {
            id: r.u32()?,
            owner_uid: r.u32()?,
            name: r.string()?,
            depth: r.u32()?,
            producers: r.u32()?,
            consumers: r.u32()?,
            ranks: r.u32()?,
            ready: r.u64()?,
            making: r.u64()?,
            put: r.u64()?,
            returned: r.u64()?,
            slowest: r.u64()?,
            fastest: r.u64()?,
            cold_start_us: r.u64()?,
        })
    }
}

/// A consumer's position in its rank: stream, rank, sequence number (release, wait, detach).
pub(super) fn encode_position(w: &mut Writer<'_>, stream: u32, rank: u32, seq: u64) {
    w.u32(stream);
    w.u32(rank);
    w.u64(seq);
}

pub(super) fn decode_position(r: &mut Reader<'_>) -> Result<(u32, u32, u64), DecodeError> {
    Ok((r.u32()?, r.u32()?, r.u64()?))
}
