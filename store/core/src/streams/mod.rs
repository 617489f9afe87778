//! Streams: the daemon's side of handing samples to trainer ranks in a fixed order.
//!
//! A stream is named and defined by a [`StreamSpec`], which fixes the record behind every
//! (rank, sequence number). Streams belong to the uid of the writer that created them, and names
//! are per uid: a client sees, joins and attaches to its own uid's streams only, so no other user
//! can squat a name, feed, rewind or end a stream. Only writers create streams (by joining one as
//! a producer); readers attach to a rank of an existing one. Per rank the daemon keeps a window of `depth` sequence
//! numbers starting at the first one its consumer has not returned. Producers take tasks
//! (rank, seq) inside the windows, make the samples, and put them back; each put sample is
//! leased by the stream (through a connection of its own in [`Objects`], so it cannot be
//! evicted) and published into the rank's shared-memory ring at slot `seq mod depth`.
//!
//! **Every delivered view holds its own lease.** Publishing an entry into a consumer's ring
//! gives the consumer's connection a lease of its own on the object, which the consumer hands to
//! the sample it reads and returns when that sample (and every array or tensor over it) is
//! gone. The stream's lease only keeps the sample for the window: a rewind, a reattach at
//! another position, or a close returns the stream's leases and never touches the consumer's.
//! A detach returns the consumer's leases on entries it never read, and finishes the rank when
//! the consumer had read all of it (as asking past the end does).
//!
//! Nothing here depends on timing. A producer that dies loses only its tasks, which go back to
//! the window to be made again. A consumer that attaches at a sequence number (a fresh start, or
//! a resume from a checkpoint after everything was killed) gets exactly the samples from there
//! on: those still held are republished into its new ring, the rest are made again.
//!
//! Every change a waiter could be waiting for bumps [`Streams::version`]; the server wakes
//! stream waiters when it moves, so no caller has to remember to.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::time::{Duration, Instant};

use feedstore_proto::frame::ProducerFigures;
use feedstore_proto::stream::StreamSpec;
use feedstore_proto::{Role, Status};

use crate::objects::{ConnId, Objects};

pub mod cache;
mod info;
mod join;
mod remote;
mod ring;
mod window;

pub use remote::{Demand, Forward, Placement};
pub use ring::Ring;
pub use window::Window;

use cache::SampleCache;
use remote::Remote;
use ring::Published;
use window::Rank;

/// Largest prefetch depth per rank.
pub const MAX_DEPTH: u32 = 1 << 16;
/// The largest batch a stream hands out whole: a take may return up to `MAX_BATCH - 1` tasks
/// past what it was asked for, which must still fit the smallest frame and a peer session's
/// task list.
pub const MAX_BATCH: u32 = 1024;
/// Most ranks the daemon keeps, over all streams.
pub const MAX_RANKS: usize = 1 << 16;
/// Most rings one connection may receive over its life (a consumer attaches once; each ring
/// stays counted against `--max-ring-bytes` until the connection that received it closes, since
/// the client may keep it mapped).
pub const MAX_RINGS_PER_CONNECTION: u32 = 16;

/// What the daemon's streams may take at most (its `--max-streams`, `--max-ring-bytes` and
/// `--stream-idle-timeout`, and the rings its open-file limit allows).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamLimits {
    /// Streams open at once.
    pub max_streams: usize,
    /// Shared memory for stream delivery rings, over all streams.
    pub max_ring_bytes: u64,
    /// A stream with no producer and no consumer for this long is closed.
    pub stream_idle_timeout: Duration,
    /// Rings attached at once (each holds a descriptor and a mapping in the daemon).
    pub max_rings: usize,
}

impl Default for StreamLimits {
    fn default() -> Self {
        StreamLimits {
            max_streams: 1024,
            max_ring_bytes: 64 << 20,
            stream_idle_timeout: Duration::from_secs(600),
            max_rings: 4096,
        }
    }
}

/// A stream operation that failed as a whole.
#[derive(Debug, thiserror::Error)]
#[error("{status}: {message}")]
pub struct StreamError {
    /// The status sent back.
    pub status: Status,
    /// Detail for the client.
    pub message: String,
}

fn fail(status: Status, message: impl Into<String>) -> StreamError {
    StreamError {
        status,
        message: message.into(),
    }
}

/// One stream.
#[derive(Debug)]
struct Stream {
    spec: StreamSpec,
    depth: u32,
    /// Tasks of this node's ranks go out this many at a time (see [`Window::batch`]).
    batch: u32,
    /// The stream's own connection in [`Objects`]: its leases keep put samples alive.
    leases: ConnId,
    /// The uid of the writer that created it: its writers (and root) may close it.
    owner_uid: u32,
    ranks: BTreeMap<u32, Rank>,
    /// Other nodes owning some ranks, by node id.
    remotes: BTreeMap<u32, Remote>,
    /// The node samples for other nodes pass through (see [`Placement::relay`]).
    relay: Option<u32>,
    producers: BTreeSet<ConnId>,
    /// The latest figures each joined producer reported (at most one entry per producer).
    producer_figures: BTreeMap<ConnId, ProducerFigures>,
    /// The counters of producers that left: the stream's sums never go back.
    producers_departed: ProducerFigures,
    created: Instant,
    /// When a producer or consumer last came, went or acted; an idle stream expires from here.
    last_used: Instant,
    /// From creation to the first sample put.
    cold_start: Option<Duration>,
    samples_put: u64,
    samples_returned: u64,
}

impl Stream {
    /// One past rank `rank`'s last sequence number, if the stream ends.
    fn end(&self, rank: u32) -> Option<u64> {
        self.spec.end_seq(rank)
    }

    /// Where rank `id`'s window ends now.
    fn window_end(&self, id: u32, rank: &Rank) -> u64 {
        let end = rank.released.saturating_add(u64::from(self.depth));
        self.end(id).map_or(end, |e| end.min(e))
    }

    /// The rank's window, made if it is new (the caller has checked there is room for it).
    fn rank(&mut self, rank: u32, start: u64) -> &mut Rank {
        self.ranks
            .entry(rank)
            .or_insert_with(|| Rank::new(start, None))
    }

    /// Whether rank `id` needs nothing more from this node's producers.
    fn rank_done(&self, id: u32, rank: &Rank) -> bool {
        match rank.owner {
            None => rank.done(self.end(id)),
            Some(node) => self.remotes.get(&node).is_some_and(|r| r.ended),
        }
    }

    fn idle(&self) -> bool {
        self.producers.is_empty() && self.ranks.values().all(|r| r.consumer.is_none())
    }
}

/// The rings a connection received, counted until it closes (it may keep them mapped).
#[derive(Debug, Default, Clone, Copy)]
struct ConnRings {
    bytes: u64,
    received: u32,
    /// Whether it is attached to a rank now (one at a time).
    attached: bool,
}

/// Every stream of the daemon, and the decode-once cache they share.
#[derive(Debug)]
pub struct Streams {
    /// Streams by owner uid and name.
    by_name: HashMap<(u32, String), u32>,
    streams: BTreeMap<u32, Stream>,
    next_id: u32,
    /// Ranks over all streams.
    ranks: usize,
    /// Rings received per connection.
    conn_rings: HashMap<ConnId, ConnRings>,
    /// Producer connections that are other nodes' stream sessions: they make samples only for
    /// this node's ranks, so they keep no feeder of this node going.
    sessions: HashSet<ConnId>,
    /// Rings attached now (each holds a descriptor and a mapping in the daemon).
    rings_attached: usize,
    max_rings: usize,
    /// Consumers whose stream was closed under them: the entries they may still read from
    /// their ring keep their leases until they detach or disconnect.
    orphans: HashMap<(ConnId, u32, u32), Published>,
    /// The decode-once cache, which streams' producers fill as they put.
    cache: SampleCache,
    /// Bumped by every change a waiter may wait for.
    version: u64,
    /// Shared memory in rings.
    ring_bytes: u64,
    max_streams: usize,
    max_ring_bytes: u64,
    idle_timeout: Duration,
    /// Root and the daemon's uid may close any stream.
    daemon_uid: u32,
    limits_hit: u64,
    expired: u64,
}

impl Streams {
    /// No streams yet, under `limits`; `daemon_uid` may close any stream.
    pub fn new(limits: &StreamLimits, daemon_uid: u32) -> Streams {
        Streams {
            by_name: HashMap::new(),
            streams: BTreeMap::new(),
            next_id: 0,
            ranks: 0,
            conn_rings: HashMap::new(),
            sessions: HashSet::new(),
            rings_attached: 0,
            max_rings: limits.max_rings,
            orphans: HashMap::new(),
            cache: SampleCache::default(),
            version: 0,
            ring_bytes: 0,
            max_streams: limits.max_streams,
            max_ring_bytes: limits.max_ring_bytes,
            idle_timeout: limits.stream_idle_timeout,
            daemon_uid,
            limits_hit: 0,
            expired: 0,
        }
    }

    /// Moves whenever a stream changes in a way a waiter may be waiting for (a sample put or
    /// returned, a stream, producer or consumer come or gone, a rank finished).
    pub fn version(&self) -> u64 {
        self.version
    }

    fn changed(&mut self) {
        self.version = self.version.wrapping_add(1);
    }

    fn limit(&mut self, message: String) -> StreamError {
        self.limits_hit += 1;
        fail(Status::LimitReached, message)
    }

    fn stream(&mut self, id: u32) -> Result<&mut Stream, StreamError> {
        self.streams
            .get_mut(&id)
            .ok_or_else(|| fail(Status::NotFound, format!("no stream {id}")))
    }

    /// `uid`'s stream named in `spec` if it is the same stream at another world size (or
    /// resumed otherwise: only `world` and the reshard differ) and nobody uses it (no producer
    /// and no consumer here: a run that ended or was stopped; its feeders of other nodes' ranks
    /// leave with it), with what differs. A producer of the run resumed from it takes its name
    /// over instead of waiting for it to expire; any other difference stays a mismatch.
    fn stale(&self, uid: u32, spec: &StreamSpec) -> Option<(u32, String)> {
        let &id = self.by_name.get(&(uid, spec.name.clone()))?;
        let stream = &self.streams[&id];
        let resumed = StreamSpec {
            world: spec.world,
            ..stream.spec.plain()
        } == spec.plain();
        (stream.spec != *spec && resumed && stream.idle())
            .then(|| (id, stream.spec.differences(spec)))
    }

    /// `uid`'s stream named in `spec`, checked against it.
    fn find(&self, uid: u32, spec: &StreamSpec) -> Result<Option<u32>, StreamError> {
        let Some(&id) = self.by_name.get(&(uid, spec.name.clone())) else {
            return Ok(None);
        };
        let existing = &self.streams[&id].spec;
        if existing != spec {
            let resized = StreamSpec {
                world: spec.world,
                ..existing.plain()
            } == spec.plain();
            let fix = if resized {
                "it is this stream at another world size or resume: it gives way once nothing \
                 uses it, so stop the old run's producers and trainers first"
            } else {
                "open it with the producers' settings (or close it, `feedstore stream close`, \
                 or pick another name)"
            };
            return Err(fail(
                Status::SpecMismatch,
                format!(
                    "stream {:?} exists with another spec: {}; {fix}",
                    spec.name,
                    existing.differences(spec)
                ),
            ));
        }
        Ok(Some(id))
    }

    /// A producer connection leaves one stream: its tasks go back to the windows.
    pub fn leave(&mut self, conn: ConnId, id: u32) {
        if let Some(stream) = self.streams.get_mut(&id)
            && Self::drop_producer(stream, conn)
        {
            stream.last_used = Instant::now();
            self.changed();
        }
    }

    /// Takes `conn` out of a stream's producers and its tasks back to the windows (and its
    /// consumer off its rank); whether it had any part in the stream.
    fn drop_producer(stream: &mut Stream, conn: ConnId) -> bool {
        let mut used = stream.producers.remove(&conn);
        if let Some(left) = stream.producer_figures.remove(&conn) {
            stream.producers_departed.add(&left.counters());
        }
        for r in stream.ranks.values_mut() {
            let lost: Vec<u64> = r
                .assigned
                .iter()
                .filter(|&(_, &c)| c == conn)
                .map(|(&s, _)| s)
                .collect();
            used |= !lost.is_empty();
            for s in lost {
                r.assigned.remove(&s);
                r.redo.insert(s);
            }
            if r.consumer.as_ref().is_some_and(|c| c.conn == conn) {
                r.consumer = None;
                used = true;
            }
        }
        used
    }

    /// Closes a stream: its own leases go back (views consumers hold keep theirs), its rings
    /// are retired. Only writers of the uid that created it, root and the daemon's uid may.
    pub fn close(
        &mut self,
        objects: &mut Objects,
        conn: ConnId,
        id: u32,
    ) -> Result<(), StreamError> {
        let stream = self
            .streams
            .get(&id)
            .ok_or_else(|| fail(Status::NotFound, format!("no stream {id}")))?;
        let (role, uid) = objects
            .client(conn)
            .map(|c| (c.role, c.uid))
            .ok_or_else(|| fail(Status::Protocol, "unknown connection"))?;
        if role != Role::Writer {
            return Err(fail(
                Status::PermissionDenied,
                "readers cannot close streams; a producer (writer) of the stream's owner can",
            ));
        }
        if uid != stream.owner_uid && uid != 0 && uid != self.daemon_uid {
            return Err(fail(
                Status::PermissionDenied,
                format!(
                    "stream {:?} belongs to uid {}; uid {uid} cannot close it",
                    stream.spec.name, stream.owner_uid
                ),
            ));
        }
        self.remove(objects, id, "closed");
        Ok(())
    }

    /// A connection's ring is retired: its descriptor and mapping in the daemon go, but its
    /// bytes stay counted until the connection closes.
    fn unattach(&mut self, conn: ConnId) {
        if let Some(rings) = self.conn_rings.get_mut(&conn)
            && rings.attached
        {
            rings.attached = false;
            self.rings_attached -= 1;
        }
    }

    /// Retires a stream: rings gone, the stream's leases returned, consumers' unread entries
    /// kept leased for them until they detach or disconnect.
    fn remove(&mut self, objects: &mut Objects, id: u32, why: &str) {
        let Some(stream) = self.streams.remove(&id) else {
            return;
        };
        self.by_name
            .remove(&(stream.owner_uid, stream.spec.name.clone()));
        self.ranks -= stream.ranks.len();
        for (rank, r) in stream.ranks {
            if let Some(c) = r.consumer {
                self.unattach(c.conn);
                self.orphans.insert((c.conn, id, rank), c.published);
            }
        }
        objects.disconnect(stream.leases);
        tracing::info!(stream = ?stream.spec.name, "stream {why}");
        self.changed();
    }

    /// Closes every stream no producer or consumer has used for the idle timeout (their
    /// samples go back to the store; a resume later makes them again). Returns how many.
    pub fn expire(&mut self, objects: &mut Objects, now: Instant) -> usize {
        let idle: Vec<u32> = self
            .streams
            .iter()
            .filter(|(_, s)| s.idle() && now.duration_since(s.last_used) >= self.idle_timeout)
            .map(|(&id, _)| id)
            .collect();
        for &id in &idle {
            self.remove(
                objects,
                id,
                "expired: no producer or consumer for the idle timeout",
            );
        }
        self.expired += idle.len() as u64;
        idle.len()
    }

    /// A connection went away: its tasks go back to their windows, its rings are retired.
    pub fn disconnect(&mut self, conn: ConnId) {
        let mut touched = false;
        let now = Instant::now();
        for stream in self.streams.values_mut() {
            if Self::drop_producer(stream, conn) {
                stream.last_used = now;
                touched = true;
            }
        }
        self.orphans.retain(|&(c, _, _), _| c != conn);
        self.sessions.remove(&conn);
        if let Some(rings) = self.conn_rings.remove(&conn) {
            self.ring_bytes -= rings.bytes;
            self.rings_attached -= usize::from(rings.attached);
        }
        if touched {
            self.changed();
        }
    }
}

#[cfg(test)]
mod tests;
