//! The stream family: specs, tasks, delivered items, positions and listings.

use std::sync::Arc;

use crate::Handle;
use crate::reshard::{MAX_RESHARD_TEXT, Reshard};
use crate::stream::{Shuffle, StreamSpec, Tail};
use crate::wire::{DecodeError, Reader, Wire, Writer};

/// The first protocol version whose stream specs carry their reshard.
pub const RESHARD_SINCE: u16 = 13;

/// The spec as it crosses the socket: name, records, seed, world, shuffle kind and block size,
/// tail, epochs (0 for unbounded), and from protocol [`RESHARD_SINCE`] on the reshard's text
/// ([`Reshard::to_text`]) as a `u32` length and its bytes (none: 0). (Its checkpoint digest has
/// an encoding of its own, [`StreamSpec::canonical_bytes`].) A resharded spec cannot be sent
/// in an older version: a client checks the version agreed first.
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
        if w.version >= RESHARD_SINCE {
            let text = self
                .reshard
                .as_ref()
                .map(|r| r.to_text())
                .unwrap_or_default();
            w.u32(text.len() as u32);
            w.buf.extend_from_slice(text.as_bytes());
        }
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
        let mut spec = StreamSpec {
            name,
            records,
            seed,
            world,
            shuffle,
            tail,
            epochs,
            reshard: None,
        };
        if r.version >= RESHARD_SINCE {
            let n = r.u32()? as usize;
            let invalid = DecodeError::InvalidValue { field: "reshard" };
            if n > MAX_RESHARD_TEXT {
                return Err(invalid);
            }
            if n > 0 {
                let text = std::str::from_utf8(r.bytes(n)?).map_err(|_| invalid.clone())?;
                let reshard = Reshard::from_text(&spec, text).ok_or(invalid.clone())?;
                spec.reshard = Some(Arc::new(reshard));
                spec.check(0).map_err(|_| invalid)?;
            }
        }
        Ok(spec)
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

/// A producer's ask for work: up to `max` tasks of stream `stream`, waiting up to `timeout_ms`
/// while every rank's prefetch window is full (backpressure). One codec for the Unix socket's
/// [`super::Request::StreamTake`] and the peer session's
/// [`crate::peer_stream::SessionRequest::Take`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TakeTasks {
    /// The stream's id where it was joined.
    pub stream: u32,
    /// Most tasks wanted.
    pub max: u32,
    /// How long to wait for work.
    pub timeout_ms: u32,
}

impl Wire for TakeTasks {
    const MIN_BYTES: usize = 12;
    fn encode(&self, w: &mut Writer<'_>) {
        w.u32(self.stream);
        w.u32(self.max);
        w.u32(self.timeout_ms);
    }
    fn decode(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        Ok(TakeTasks {
            stream: r.u32()?,
            max: r.u32()?,
            timeout_ms: r.u32()?,
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
    /// Where the sample starts inside its object, a multiple of 64 below the object's length;
    /// it runs to the object's end. 0 for a sample that is a whole object. Several samples of
    /// one batch share an object this way (see `feedstore_proto::sample::BatchPlan`).
    pub offset: u64,
}

impl StreamItem {
    /// Bytes on the wire.
    pub const WIRE_BYTES: usize = StreamTask::WIRE_BYTES + Handle::WIRE_BYTES + 8 + 4 + 16 + 8;
}

impl Wire for StreamItem {
    const MIN_BYTES: usize = Self::WIRE_BYTES;
    fn encode(&self, w: &mut Writer<'_>) {
        self.task.encode(w);
        self.handle.encode(w);
        w.u64(self.record);
        w.u32(self.flags);
        w.u128(self.key);
        w.u64(self.offset);
    }
    fn decode(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        Ok(StreamItem {
            task: StreamTask::decode(r)?,
            handle: Handle::decode(r)?,
            record: r.u64()?,
            flags: r.u32()?,
            key: r.u128()?,
            offset: r.u64()?,
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
    /// The ranks with a consumer attached, by rank, as their consumers report them (at most
    /// [`StreamInfo::RANKS_LISTED`]).
    pub ranks_attached: Vec<RankInfo>,
    /// What this node's producers of the stream reported, summed: the counters of every producer
    /// that ever reported (they only grow), the gauges of those joined now.
    pub producer: ProducerFigures,
}

/// The producer's pipeline stages, in order, as [`ProducerFigures`] counts them and metrics
/// label them.
pub const PRODUCER_STAGES: [&str; 5] = ["fetch", "decode", "resize", "tokenize", "write"];

/// What a producer measures of its own work and reports to the daemon
/// ([`crate::frame::Request::ProducerReport`]): the producer's side of the bottleneck verdict.
/// Times are microseconds since the producer started. Every field but the last three is a
/// counter (it only grows); those three are gauges.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ProducerFigures {
    /// Since the producer started.
    pub elapsed_us: u64,
    /// Before its CPU workers could start (connecting, mapping the store, joining the stream).
    pub startup_us: u64,
    /// The CPU workers' time since they started: workers × (elapsed − startup).
    pub worker_us: u64,
    /// Busy time per stage ([`PRODUCER_STAGES`]), summed over concurrent tasks.
    pub stage_busy_us: [u64; 5],
    /// Items per stage.
    pub stage_items: [u64; 5],
    /// CPU workers waiting for fetched input (the pipeline is fetch-bound).
    pub cpu_idle_us: u64,
    /// Fetched records waiting for a CPU worker (it is CPU-bound).
    pub fetch_blocked_us: u64,
    /// Waiting for the daemon to hand out work while every rank's prefetch window was full:
    /// the trainers are the bottleneck.
    pub backpressure_us: u64,
    /// Bytes fetched.
    pub fetched_bytes: u64,
    /// Fetches that succeeded.
    pub fetches_ok: u64,
    /// Fetches that failed.
    pub fetch_failures: u64,
    /// Samples served from the decode-once cache instead of being made.
    pub cache_hits: u64,
    /// CPU workers (gauge).
    pub cpu_workers: u64,
    /// Most fetches in flight (gauge).
    pub fetch_concurrency: u64,
    /// Fetches in flight now (gauge).
    pub fetch_in_flight: u64,
}

impl ProducerFigures {
    pub(crate) const FIELDS: usize = 23;
    /// The fields from this index on are gauges.
    const GAUGES: usize = 20;

    pub(crate) fn fields(&self) -> [u64; Self::FIELDS] {
        let s = &self.stage_busy_us;
        let i = &self.stage_items;
        [
            self.elapsed_us,
            self.startup_us,
            self.worker_us,
            s[0],
            s[1],
            s[2],
            s[3],
            s[4],
            i[0],
            i[1],
            i[2],
            i[3],
            i[4],
            self.cpu_idle_us,
            self.fetch_blocked_us,
            self.backpressure_us,
            self.fetched_bytes,
            self.fetches_ok,
            self.fetch_failures,
            self.cache_hits,
            self.cpu_workers,
            self.fetch_concurrency,
            self.fetch_in_flight,
        ]
    }

    pub(crate) fn from_fields(f: [u64; Self::FIELDS]) -> ProducerFigures {
        ProducerFigures {
            elapsed_us: f[0],
            startup_us: f[1],
            worker_us: f[2],
            stage_busy_us: [f[3], f[4], f[5], f[6], f[7]],
            stage_items: [f[8], f[9], f[10], f[11], f[12]],
            cpu_idle_us: f[13],
            fetch_blocked_us: f[14],
            backpressure_us: f[15],
            fetched_bytes: f[16],
            fetches_ok: f[17],
            fetch_failures: f[18],
            cache_hits: f[19],
            cpu_workers: f[20],
            fetch_concurrency: f[21],
            fetch_in_flight: f[22],
        }
    }

    /// A newer report from the same producer: its counters never go back (a report that says
    /// less keeps what was shown), its gauges are replaced.
    pub fn update(&mut self, newer: &ProducerFigures) {
        let (mut f, n) = (self.fields(), newer.fields());
        for (i, (old, new)) in f.iter_mut().zip(n).enumerate() {
            *old = if i < Self::GAUGES {
                (*old).max(new)
            } else {
                new
            };
        }
        *self = Self::from_fields(f);
    }

    /// Adds another producer's figures (saturating).
    pub fn add(&mut self, other: &ProducerFigures) {
        let (mut f, o) = (self.fields(), other.fields());
        for (a, b) in f.iter_mut().zip(o) {
            *a = a.saturating_add(b);
        }
        *self = Self::from_fields(f);
    }

    /// The counters only: what a producer that left leaves behind.
    pub fn counters(&self) -> ProducerFigures {
        let mut f = self.fields();
        f[Self::GAUGES..].fill(0);
        Self::from_fields(f)
    }

    /// What grew from `earlier` to `self` (the counters; the gauges as of `self`).
    pub fn since(&self, earlier: &ProducerFigures) -> ProducerFigures {
        let (mut f, e) = (self.fields(), earlier.fields());
        for (a, b) in f[..Self::GAUGES].iter_mut().zip(e) {
            *a = a.saturating_sub(b);
        }
        Self::from_fields(f)
    }
}

impl Wire for ProducerFigures {
    const MIN_BYTES: usize = Self::FIELDS * 8;
    fn encode(&self, w: &mut Writer<'_>) {
        for v in self.fields() {
            w.u64(v);
        }
    }
    fn decode(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        let mut f = [0; Self::FIELDS];
        for v in &mut f {
            *v = r.u64()?;
        }
        Ok(Self::from_fields(f))
    }
}

/// What a consumer measures of its own reading and reports with its returns
/// ([`crate::frame::Request::StreamRelease`]): the trainer's side of the wait-time ratio.
/// Times count from its first request for a sample.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RankFigures {
    /// Microseconds it spent waiting for samples not yet in its ring.
    pub waited_us: u64,
    /// Samples it took.
    pub taken: u64,
    /// Microseconds since its first request for a sample, when it reported.
    pub elapsed_us: u64,
    /// Microseconds from opening to its first sample; 0 before that.
    pub first_sample_us: u64,
}

impl RankFigures {
    /// The share of its time the rank spent waiting for data (0 before anything is known).
    pub fn wait_ratio(&self) -> f64 {
        if self.elapsed_us == 0 {
            0.0
        } else {
            (self.waited_us as f64 / self.elapsed_us as f64).min(1.0)
        }
    }
}

impl Wire for RankFigures {
    const MIN_BYTES: usize = 4 * 8;
    fn encode(&self, w: &mut Writer<'_>) {
        for v in [
            self.waited_us,
            self.taken,
            self.elapsed_us,
            self.first_sample_us,
        ] {
            w.u64(v);
        }
    }
    fn decode(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        Ok(RankFigures {
            waited_us: r.u64()?,
            taken: r.u64()?,
            elapsed_us: r.u64()?,
            first_sample_us: r.u64()?,
        })
    }
}

/// One attached rank of a stream, as `feedstore stat` and the metrics show it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RankInfo {
    /// The rank.
    pub rank: u32,
    /// The first sequence number its consumer has not returned.
    pub released: u64,
    /// Samples made and waiting in its window.
    pub ready: u32,
    /// What its consumer last reported, plus a wait under way since (as the daemon sees it).
    pub figures: RankFigures,
}

impl Wire for RankInfo {
    const MIN_BYTES: usize = 4 + 8 + 4 + RankFigures::MIN_BYTES;
    fn encode(&self, w: &mut Writer<'_>) {
        w.u32(self.rank);
        w.u64(self.released);
        w.u32(self.ready);
        self.figures.encode(w);
    }
    fn decode(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        Ok(RankInfo {
            rank: r.u32()?,
            released: r.u64()?,
            ready: r.u32()?,
            figures: RankFigures::decode(r)?,
        })
    }
}

impl StreamInfo {
    /// The most attached ranks one entry lists: 256 × 48 bytes fit any page a client may ask
    /// for (at least 64 KiB).
    pub const RANKS_LISTED: usize = 256;

    /// Bytes this entry takes in a [`crate::frame::Response::Streams`] page.
    pub fn wire_bytes(&self) -> usize {
        <StreamInfo as Wire>::MIN_BYTES
            + self.name.len()
            + self.ranks_attached.len() * RankInfo::MIN_BYTES
    }
}

impl Wire for StreamInfo {
    /// An empty name: id, owner, the name's length, four `u32`s, seven `u64`s, an empty rank
    /// list (its count) and the producers' figures.
    const MIN_BYTES: usize = 4 + 4 + 2 + 4 * 4 + 7 * 8 + 4 + ProducerFigures::MIN_BYTES;
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
        w.list(&self.ranks_attached);
        self.producer.encode(w);
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
            ranks_attached: r.list()?,
            producer: ProducerFigures::decode(r)?,
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
