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
//! A detach returns the consumer's leases on entries it never read.
//!
//! Nothing here depends on timing. A producer that dies loses only its tasks, which go back to
//! the window to be made again. A consumer that attaches at a sequence number (a fresh start, or
//! a resume from a checkpoint after everything was killed) gets exactly the samples from there
//! on: those still held are republished into its new ring, the rest are made again.
//!
//! Every change a waiter could be waiting for bumps [`Streams::version`]; the server wakes
//! stream waiters when it moves, so no caller has to remember to.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::os::fd::OwnedFd;
use std::time::{Duration, Instant};

use feedstore_proto::frame::{
    CacheEntry, Got, ProducerFigures, RankFigures, RankInfo, StreamInfo, StreamItem, StreamTask,
};
use feedstore_proto::ring::{ENTRY_FAILED, RingEntry, RingHeader, ring_bytes};
use feedstore_proto::stream::StreamSpec;
use feedstore_proto::{Handle, Location, Role, Status};
use feedstore_shm::{Access, HugePages, Mapping, Segment, SegmentOptions, ShmError};

use crate::cache::SampleCache;
use crate::config::{Limits, format_bytes};
use crate::objects::{ClientInfo, ConnId, Objects};

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

/// A consumer's ring: shared memory the daemon writes and the consumer maps read-only.
#[derive(Debug)]
pub struct Ring {
    segment: Segment,
    map: Mapping,
    header: RingHeader,
}

impl Ring {
    fn new(spec: &StreamSpec, rank: u32, capacity: u32) -> Result<Ring, ShmError> {
        let segment = Segment::create(&SegmentOptions {
            name: format!("feedstore-ring-{}-{rank}", spec.name),
            size_bytes: ring_bytes(capacity) as u64,
            huge_pages: HugePages::Off,
            prefault: true,
        })?;
        let fd = segment
            .fd()
            .try_clone_to_owned()
            .map_err(|source| ShmError::Reopen { source })?;
        let map = Mapping::new(fd, segment.size_bytes(), Access::ReadWrite, true)?
            .without_private_views();
        let header = RingHeader {
            capacity,
            rank,
            spec_digest: spec.digest(),
        };
        header
            .write(map.atomic_words().expect("mapped read-write"))
            .expect("sized for its capacity");
        Ok(Ring {
            segment,
            map,
            header,
        })
    }

    fn publish(&self, entry: &RingEntry) {
        self.header
            .publish(self.map.atomic_words().expect("mapped read-write"), entry);
    }

    /// A read-only descriptor for the consumer.
    pub fn readonly_fd(&self) -> Result<OwnedFd, ShmError> {
        self.segment.reopen_readonly()
    }

    /// Slots.
    pub fn capacity(&self) -> u32 {
        self.header.capacity
    }

    /// Bytes of shared memory.
    pub fn size_bytes(&self) -> u64 {
        self.segment.size_bytes()
    }
}

/// The shared memory a ring of `capacity` slots takes (whole pages).
fn ring_size(capacity: u32) -> u64 {
    (ring_bytes(capacity) as u64).next_multiple_of(4096)
}

/// Ring entries published to one consumer connection with a lease of that connection's, not yet
/// known to be read.
#[derive(Debug, Default)]
struct Published(BTreeMap<u64, Handle>);

impl Published {
    /// The consumer has read everything below `seq`: those leases belong to its samples now.
    fn read_below(&mut self, seq: u64) {
        self.0 = self.0.split_off(&seq);
    }

    /// Returns the leases of the entries at or after `next`, which the consumer never read.
    fn release_unread(self, objects: &mut Objects, conn: ConnId, next: u64) -> u64 {
        let mut released = 0;
        for (_, handle) in self.0.range(next..) {
            if objects.release(conn, *handle).is_ok() {
                released += 1;
            }
        }
        released
    }
}

#[derive(Debug)]
struct Consumer {
    conn: ConnId,
    ring: Ring,
    published: Published,
    /// What the consumer last reported of its reading (with its returns), and when.
    figures: RankFigures,
    reported_at: Option<Instant>,
    /// Since when it has been waiting for a sample not yet ready (a `StreamWait` found it
    /// missing, and none has found it since): a rank starving now shows as waiting before its
    /// consumer's next report says so.
    waiting_since: Option<Instant>,
    /// The sequence number it waits for: the wait ends when that entry is published into its
    /// ring (whether or not a `StreamWait` is there to see it: a client waiting in slices may
    /// find it in the ring without asking again).
    waiting_for: Option<u64>,
    /// Waits the daemon saw end since the last report (the next report includes them).
    waited_unreported: Duration,
    /// When the daemon first saw it wait, for a consumer that has not reported yet.
    first_wait: Option<Instant>,
    /// The highest (waited, elapsed) microseconds shown so far: what is shown never goes back
    /// (a report can say a little less than the daemon's estimate before it), so the metrics'
    /// counters only grow.
    shown: std::cell::Cell<(u64, u64)>,
}

impl Consumer {
    /// Its figures as of now: the last report, plus what the daemon has seen since (waits that
    /// ended, a wait under way) and the time up to now, never less than what was shown before.
    /// Time since its last report that the daemon did not see it wait counts as the trainer's
    /// own work (a long step between reports reads as computing, not as still waiting); its
    /// next report corrects the estimate with what the consumer measured (a wait the daemon
    /// could not see, such as one inside the consumer, raises the waited time then). A rank
    /// that has read its whole share (`finished`) has stopped its clock (its consumer's too:
    /// its reports after the end say the same time): no run time counts past its last report.
    fn figures_now(&self, now: Instant, finished: bool) -> RankFigures {
        let micros = |d: Duration| d.as_micros().min(u128::from(u64::MAX)) as u64;
        let mut f = self.figures;
        let under_way = self
            .waiting_since
            .map_or(Duration::ZERO, |since| now - since);
        f.waited_us = f
            .waited_us
            .saturating_add(micros(self.waited_unreported + under_way));
        let until = if finished && self.waiting_since.is_none() {
            // Up to what the daemon saw last: no run time past the end of the reading.
            self.reported_at.unwrap_or(now)
        } else {
            now
        };
        let seen_since = |from: Instant| micros(until.saturating_duration_since(from));
        f.elapsed_us = match (self.reported_at, self.first_wait) {
            (Some(at), _) => f.elapsed_us.saturating_add(seen_since(at)),
            (None, Some(first)) => seen_since(first),
            (None, None) => f.elapsed_us,
        };
        let (waited, elapsed) = self.shown.get();
        f.waited_us = f.waited_us.max(waited);
        f.elapsed_us = f.elapsed_us.max(elapsed).max(f.waited_us);
        self.shown.set((f.waited_us, f.elapsed_us));
        f
    }

    /// A `StreamWait` for `seq` found it `ready` or not.
    fn polled(&mut self, seq: u64, ready: bool, now: Instant) {
        if ready {
            self.wait_ended(now);
        } else if self.waiting_since.is_none() || self.waiting_for != Some(seq) {
            self.wait_ended(now);
            self.waiting_since = Some(now);
            self.waiting_for = Some(seq);
            self.first_wait.get_or_insert(now);
        }
    }

    /// The wait under way, if any, ended `now`.
    fn wait_ended(&mut self, now: Instant) {
        if let Some(since) = self.waiting_since.take() {
            self.waited_unreported += now - since;
        }
        self.waiting_for = None;
    }
}

impl Consumer {
    /// Gives the consumer's connection its own lease on the entry's object (shared from the
    /// stream's), then publishes the entry into its ring.
    fn publish(&mut self, objects: &mut Objects, stream_leases: ConnId, entry: &RingEntry) {
        if entry.flags & ENTRY_FAILED == 0 {
            if let Err(status) = objects.share_lease(stream_leases, self.conn, entry.handle) {
                // The stream holds a lease on every ready entry, so only the consumer's lease
                // limit refuses (it keeps samples it has returned): the entry is not published,
                // since an entry without the consumer's own lease never is.
                tracing::warn!(conn = self.conn, handle = %entry.handle, %status, "sample not delivered: its consumer holds too many leases");
                return;
            }
            self.published.0.insert(entry.seq, entry.handle);
        }
        self.ring.publish(entry);
        if self.waiting_for == Some(entry.seq) {
            self.wait_ended(Instant::now());
        }
    }
}

/// The part of an object from `offset` to its end, where a sample of a batch starts: a
/// multiple of 64 (what a sample's alignment needs) inside the object. `None` otherwise.
fn within(l: Location, offset: u64) -> Option<Location> {
    (offset % 64 == 0 && offset < l.len.max(1)).then(|| Location {
        segment: l.segment,
        offset: l.offset + offset,
        len: l.len - offset,
    })
}

/// One rank's window.
#[derive(Debug)]
struct Rank {
    /// Every sequence number below this was returned by the consumer.
    released: u64,
    /// The lowest sequence number never handed to a producer.
    next: u64,
    /// Made and leased by the stream, not yet returned.
    ready: BTreeMap<u64, RingEntry>,
    /// At a producer.
    assigned: BTreeMap<u64, ConnId>,
    /// Inside the window, to be handed out again (its producer died, or a resume rewound).
    redo: BTreeSet<u64>,
    consumer: Option<Consumer>,
    /// The consumer read past the rank's last sample (it may still hold some).
    finished: bool,
    /// The node whose daemon owns the rank (its consumer's), when it is not this one: its
    /// window lives there, and `redo` holds the tasks that daemon granted to this node's
    /// producers.
    owner: Option<u32>,
}

impl Rank {
    fn new(start: u64, owner: Option<u32>) -> Rank {
        Rank {
            released: start,
            next: start,
            ready: BTreeMap::new(),
            assigned: BTreeMap::new(),
            redo: BTreeSet::new(),
            consumer: None,
            finished: false,
            owner,
        }
    }

    fn in_flight(&self) -> usize {
        self.ready.len() + self.assigned.len()
    }

    /// The next task of this rank, if its window has room (of another node's rank: the next
    /// task its daemon granted).
    fn next_task(&mut self, conn: ConnId, window_end: u64) -> Option<u64> {
        if self.owner.is_some() {
            let seq = self.redo.pop_first()?;
            self.assigned.insert(seq, conn);
            return Some(seq);
        }
        let seq = match self.redo.first() {
            Some(&s) if s < window_end => {
                self.redo.remove(&s);
                s
            }
            _ if self.next < window_end => {
                self.next += 1;
                self.next - 1
            }
            _ => return None,
        };
        self.assigned.insert(seq, conn);
        Some(seq)
    }

    /// The next batch of this (own) rank's tasks: sequence numbers of one batch
    /// `k·batch .. (k+1)·batch` (clipped to the stream's `end`), all to `conn`. Tasks to make
    /// again come first, with every other task of their batch not yet handed out; a batch
    /// with tasks never handed out goes out once the window holds the whole of it (a rank
    /// resumed inside a batch starts with the rest of that batch).
    fn next_batch(
        &mut self,
        conn: ConnId,
        window_end: u64,
        end: Option<u64>,
        batch: u64,
    ) -> Vec<u64> {
        let end = end.unwrap_or(u64::MAX);
        let start = match self.redo.first() {
            Some(&s) if s < end.min(window_end) => s,
            _ => self.next,
        };
        let batch_start = start - start % batch;
        let batch_end = batch_start.saturating_add(batch).min(end);
        let fresh_start = self.next.max(batch_start);
        let fresh = fresh_start..batch_end.max(fresh_start);
        if !fresh.is_empty() && fresh.end > window_end {
            return Vec::new();
        }
        let mut group: Vec<u64> = self
            .redo
            .range(batch_start..batch_end.min(window_end).max(batch_start))
            .copied()
            .collect();
        for s in &group {
            self.redo.remove(s);
        }
        if !fresh.is_empty() {
            self.next = fresh.end;
            group.extend(fresh);
        }
        for &s in &group {
            self.assigned.insert(s, conn);
        }
        group
    }

    /// Whether the rank needs nothing more: every sample made, and its consumer read past the
    /// last (or returned them all). Until then a consumer resuming from an earlier state may
    /// rewind the rank and need samples made again.
    fn done(&self, end: Option<u64>) -> bool {
        end.is_some_and(|end| self.next >= end && (self.released >= end || self.finished))
            && self.redo.is_empty()
            && self.assigned.is_empty()
    }
}

/// Ranks of a stream another node's daemon owns, fed by this node's producers.
#[derive(Debug, Default)]
struct Remote {
    /// The stream's id on the owner, while a session has it joined.
    id: Option<u32>,
    /// The owner said its ranks need nothing more.
    ended: bool,
    /// Samples made here for its ranks (sealed, leased by the stream) to hand over.
    outbox: Vec<StreamItem>,
    /// How many of its ranks the owner was told of (a producer joining later with more ranks
    /// makes the feeder join again).
    joined_ranks: usize,
    /// The feeder is telling the owner this node's producers left.
    leaving: bool,
    /// A producer joined while the feeder was leaving: it joins again instead of ending.
    wanted: bool,
}

/// Samples made here for another node's ranks, to be pulled by that node: the stream leases
/// each until the owner has answered for it.
#[derive(Debug)]
pub struct Forward {
    /// The owner.
    pub node: u32,
    /// The stream's id there.
    pub remote_stream: u32,
    /// The connection holding the leases.
    pub leases: ConnId,
    /// The node the owner pulls them through, if not from here.
    pub relay: Option<u32>,
    /// The samples.
    pub items: Vec<StreamItem>,
}

/// Where a producer's ranks live, and how their samples travel.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Placement {
    /// The node owning each rank that is not this node's.
    pub owners: HashMap<u32, u32>,
    /// A node every sample for another node passes through (the `relay` placement: the
    /// owner pulls from it, and it from the producer's node); `None` pulls straight from here.
    pub relay: Option<u32>,
}

/// A new stream's window per rank: how many samples ahead producers may make, and how many
/// tasks they take at a time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    /// Samples made ahead of the consumer (the prefetch depth).
    pub depth: u32,
    /// Above 1: this node's ranks hand out tasks a whole batch at a time (sequence numbers
    /// `k·batch .. (k+1)·batch` to one producer), so the producer can place them in one object.
    pub batch: u32,
}

impl From<u32> for Window {
    fn from(depth: u32) -> Window {
        Window { depth, batch: 1 }
    }
}

/// Whether a node's feeder for a stream should go on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Demand {
    /// Ask the owner for this many tasks.
    Tasks(u32),
    /// Producers here now serve more of the owner's ranks than it was told of: join again.
    Rejoin,
    /// Enough granted tasks wait for this node's producers.
    Full,
    /// No producer here serves the stream any more (or it is gone): leave.
    Leave,
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
    fn end(&self) -> Option<u64> {
        self.spec.end_seq()
    }

    fn window_end(&self, rank: &Rank) -> u64 {
        let end = rank.released.saturating_add(u64::from(self.depth));
        self.end().map_or(end, |e| end.min(e))
    }

    /// The rank's window, made if it is new (the caller has checked there is room for it).
    fn rank(&mut self, rank: u32, start: u64) -> &mut Rank {
        self.ranks
            .entry(rank)
            .or_insert_with(|| Rank::new(start, None))
    }

    /// Whether the rank needs nothing more from this node's producers.
    fn rank_done(&self, rank: &Rank) -> bool {
        match rank.owner {
            None => rank.done(self.end()),
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
    pub fn new(limits: &Limits, daemon_uid: u32) -> Streams {
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

    /// `uid`'s stream named in `spec`, checked against it.
    fn find(&self, uid: u32, spec: &StreamSpec) -> Result<Option<u32>, StreamError> {
        let Some(&id) = self.by_name.get(&(uid, spec.name.clone())) else {
            return Ok(None);
        };
        let existing = &self.streams[&id].spec;
        if existing != spec {
            return Err(fail(
                Status::SpecMismatch,
                format!(
                    "stream {:?} exists with another spec: {}; open it with the producers' \
                     settings (or close it, `feedstore stream close`, or pick another name)",
                    spec.name,
                    existing.differences(spec)
                ),
            ));
        }
        Ok(Some(id))
    }

    /// A producer (a writer) joins a stream for some ranks, creating it if new; ranks not yet
    /// known start where given. `placement` names the node owning each rank that lives on
    /// another node (its consumer's daemon; the others are this node's) and the relay, if any.
    /// Returns the stream's id and the nodes whose feeders must start (owners this stream did
    /// not know yet).
    pub fn join(
        &mut self,
        objects: &mut Objects,
        conn: ConnId,
        spec: &StreamSpec,
        window: impl Into<Window>,
        ranks: &[StreamTask],
        placement: &Placement,
    ) -> Result<(u32, Vec<u32>), StreamError> {
        let window = window.into();
        let owners = &placement.owners;
        let info = objects
            .client(conn)
            .ok_or_else(|| fail(Status::Protocol, "unknown connection"))?;
        if info.role != Role::Writer {
            return Err(fail(
                Status::PermissionDenied,
                "only writers produce into (and create) streams",
            ));
        }
        let uid = info.uid;
        spec.check(0)
            .map_err(|e| fail(Status::InvalidArgument, e.to_string()))?;
        for r in ranks {
            spec.check(r.rank)
                .map_err(|e| fail(Status::InvalidArgument, e.to_string()))?;
        }
        let existing = self.find(uid, spec)?;
        if let Some(id) = existing {
            // A rank lives on one node: every producer must say the same.
            for (rank, r) in &self.streams[&id].ranks {
                let said = owners.get(rank).copied();
                let listed = ranks.iter().any(|t| t.rank == *rank);
                if listed && said != r.owner {
                    let place = |o: Option<u32>| {
                        o.map_or("this node".to_string(), |n| format!("node {n:08x}"))
                    };
                    return Err(fail(
                        Status::InvalidArgument,
                        format!(
                            "rank {rank} of stream {:?} is served from {}, not {} (--ranks-at \
                             must agree on every node)",
                            spec.name,
                            place(r.owner),
                            place(said)
                        ),
                    ));
                }
            }
        }
        // Another node's session and a producer's put-only connections (no ranks) say nothing
        // about relays; this node's producers that name ranks must agree.
        let session = self.sessions.contains(&conn) || ranks.is_empty();
        if let Some(id) = existing
            && !session
            && self.streams[&id]
                .producers
                .iter()
                .any(|c| !self.sessions.contains(c))
            && self.streams[&id].relay != placement.relay
        {
            return Err(fail(
                Status::InvalidArgument,
                format!(
                    "stream {:?} relays through {:?} here, not {:?}: its producers on one node \
                     must agree",
                    spec.name, self.streams[&id].relay, placement.relay
                ),
            ));
        }
        let id = match existing {
            Some(id) => id,
            None => self.create(objects, spec, window, uid)?,
        };
        if !session {
            self.stream(id)?.relay = placement.relay;
        }
        let stream = &self.streams[&id];
        let new: BTreeSet<u32> = ranks
            .iter()
            .map(|r| r.rank)
            .filter(|r| !stream.ranks.contains_key(r))
            .collect();
        self.room_for_ranks(new.len())?;
        let stream = self.stream(id)?;
        stream.producers.insert(conn);
        stream.last_used = Instant::now();
        let mut feeders = Vec::new();
        for r in ranks {
            let owner = owners.get(&r.rank).copied();
            stream
                .ranks
                .entry(r.rank)
                .or_insert_with(|| Rank::new(r.seq, owner));
            if let Some(node) = owner {
                match stream.remotes.get_mut(&node) {
                    // Its feeder is leaving: it stays, and joins again.
                    Some(remote) if remote.leaving => remote.wanted = true,
                    Some(_) => {}
                    None => {
                        stream.remotes.insert(node, Remote::default());
                        feeders.push(node);
                    }
                }
            }
        }
        self.ranks += new.len();
        self.changed();
        Ok((id, feeders))
    }

    /// Refuses `n` more ranks past [`MAX_RANKS`].
    fn room_for_ranks(&mut self, n: usize) -> Result<(), StreamError> {
        if self.ranks + n > MAX_RANKS {
            let message = format!(
                "the daemon keeps at most {MAX_RANKS} ranks over all streams ({} now); close \
                 unused streams",
                self.ranks
            );
            return Err(self.limit(message));
        }
        Ok(())
    }

    fn create(
        &mut self,
        objects: &mut Objects,
        spec: &StreamSpec,
        window: Window,
        owner_uid: u32,
    ) -> Result<u32, StreamError> {
        let depth = window.depth.clamp(1, MAX_DEPTH);
        let batch = window.batch.max(1);
        if batch > MAX_BATCH {
            return Err(fail(
                Status::InvalidArgument,
                format!("a batch of {batch} samples: at most {MAX_BATCH}"),
            ));
        }
        if batch > depth {
            return Err(fail(
                Status::InvalidArgument,
                format!(
                    "a batch of {batch} samples needs a prefetch depth of at least {batch} \
                     (the window holds whole batches); the depth is {depth}"
                ),
            ));
        }
        if self.streams.len() >= self.max_streams {
            return Err(self.limit(format!(
                "{} streams are open, the most this daemon allows (--max-streams); close some \
                 (`feedstore stat` lists them)",
                self.streams.len()
            )));
        }
        let Some(id) = self.next_id.checked_add(1) else {
            return Err(self.limit("stream ids are used up; restart the daemon".into()));
        };
        self.next_id = id;
        let leases = objects.connect(ClientInfo {
            role: Role::Reader,
            uid: 0,
            pid: 0,
            name: format!("stream {}", spec.name),
            internal: true,
            capped: false,
        });
        self.by_name.insert((owner_uid, spec.name.clone()), id);
        let now = Instant::now();
        self.streams.insert(
            id,
            Stream {
                spec: spec.clone(),
                depth,
                batch,
                leases,
                owner_uid,
                ranks: BTreeMap::new(),
                remotes: BTreeMap::new(),
                relay: None,
                producers: BTreeSet::new(),
                producer_figures: BTreeMap::new(),
                producers_departed: ProducerFigures::default(),
                created: now,
                last_used: now,
                cold_start: None,
                samples_put: 0,
                samples_returned: 0,
            },
        );
        tracing::info!(stream = ?spec.name, id, depth, batch, records = spec.records, world = spec.world, owner_uid, "stream created");
        Ok(id)
    }

    /// A consumer attaches to `rank` of an existing stream at `seq`: a new ring, holding every
    /// sample of the window still held; the rest of the window is made (again). `NotFound`
    /// while no producer has created the stream (the server waits and asks again).
    pub fn attach(
        &mut self,
        objects: &mut Objects,
        conn: ConnId,
        spec: &StreamSpec,
        rank: u32,
        seq: u64,
    ) -> Result<(u32, &Ring), StreamError> {
        spec.check(rank)
            .map_err(|e| fail(Status::InvalidArgument, e.to_string()))?;
        let uid = objects
            .client(conn)
            .ok_or_else(|| fail(Status::Protocol, "unknown connection"))?
            .uid;
        let id = self.find(uid, spec)?.ok_or_else(|| {
            fail(
                Status::NotFound,
                format!(
                    "no stream named {:?} of uid {uid} (is a producer of this user running with \
                     --stream {:?}?)",
                    spec.name, spec.name
                ),
            )
        })?;
        let rings = self.conn_rings.get(&conn).copied().unwrap_or_default();
        if rings.attached {
            return Err(fail(
                Status::InvalidState,
                "this connection is already attached to a rank; one per connection",
            ));
        }
        if rings.received >= MAX_RINGS_PER_CONNECTION {
            let message = format!(
                "this connection has received {MAX_RINGS_PER_CONNECTION} rings, the most one may; \
                 connect again"
            );
            return Err(self.limit(message));
        }
        let stream = &self.streams[&id];
        if let Some(node) = stream.ranks.get(&rank).and_then(|r| r.owner) {
            return Err(fail(
                Status::InvalidArgument,
                format!(
                    "rank {rank} of stream {:?} is served from node {node:08x} (the producers' \
                     --ranks-at): its consumer opens the stream there",
                    spec.name
                ),
            ));
        }
        match stream.ranks.get(&rank).and_then(|r| r.consumer.as_ref()) {
            Some(c) if c.conn == conn => {
                return Err(fail(
                    Status::InvalidState,
                    format!("this connection is already attached to rank {rank}; detach first"),
                ));
            }
            Some(_) => {
                return Err(fail(
                    Status::InUse,
                    format!(
                        "rank {rank} of stream {:?} already has a consumer",
                        spec.name
                    ),
                ));
            }
            None => {}
        }
        let size = ring_size(stream.depth);
        let new_rank = !stream.ranks.contains_key(&rank);
        if self.ring_bytes + size > self.max_ring_bytes {
            let message = format!(
                "delivery rings would take {} of the {} allowed (--max-ring-bytes); close unused \
                 streams, or consumers that hold samples of streams they left",
                format_bytes(self.ring_bytes + size),
                format_bytes(self.max_ring_bytes)
            );
            return Err(self.limit(message));
        }
        if self.rings_attached >= self.max_rings {
            let message = format!(
                "{} rings are attached, the most the daemon's open-file limit allows",
                self.rings_attached
            );
            return Err(self.limit(message));
        }
        self.room_for_ranks(usize::from(new_rank))?;
        let stream = self.streams.get_mut(&id).expect("found above");
        let ring = Ring::new(spec, rank, stream.depth)
            .map_err(|e| fail(Status::Full, format!("cannot create the ring: {e}")))?;
        let ring_size = ring.size_bytes();
        let depth = u64::from(stream.depth);
        let window_end = seq.saturating_add(depth);
        let leases = stream.leases;
        stream.last_used = Instant::now();
        let r = stream.rank(rank, seq);
        // Keep what lies in the new window; return the stream's leases on the rest (views a
        // previous consumer still holds have leases of their own).
        let outside: Vec<u64> = r
            .ready
            .keys()
            .copied()
            .filter(|&s| s < seq || s >= window_end)
            .collect();
        for s in outside {
            let entry = r.ready.remove(&s).expect("listed");
            if entry.flags & ENTRY_FAILED == 0 {
                let _ = objects.release(leases, entry.handle);
            }
        }
        r.assigned.retain(|&s, _| s >= seq && s < window_end);
        r.redo.retain(|&s| s >= seq && s < window_end);
        let made_up_to = r.next.clamp(seq, window_end);
        for s in seq..made_up_to {
            if !r.ready.contains_key(&s) && !r.assigned.contains_key(&s) {
                r.redo.insert(s);
            }
        }
        r.released = seq;
        r.finished = false;
        r.next = made_up_to;
        let mut consumer = Consumer {
            conn,
            ring,
            published: Published::default(),
            figures: RankFigures::default(),
            reported_at: None,
            waiting_since: None,
            waiting_for: None,
            waited_unreported: Duration::ZERO,
            first_wait: None,
            shown: std::cell::Cell::new((0, 0)),
        };
        for entry in r.ready.values() {
            consumer.publish(objects, leases, entry);
        }
        tracing::info!(stream = ?spec.name, rank, seq, held = r.ready.len(), "consumer attached");
        let ring = &r.consumer.insert(consumer).ring;
        self.ranks += usize::from(new_rank);
        self.ring_bytes += ring_size;
        self.rings_attached += 1;
        let rings = self.conn_rings.entry(conn).or_default();
        rings.bytes += ring_size;
        rings.received += 1;
        rings.attached = true;
        self.version = self.version.wrapping_add(1);
        Ok((id, ring))
    }

    /// Up to `max` tasks for a producer, spread over the ranks that are furthest behind, this
    /// node's ranks first (their samples need not cross the network), then those other nodes
    /// granted. `only` (another node's session asking) limits it to the ranks that session
    /// joined, among this node's own. `Err(Ended)` when the stream has no work left and never
    /// will.
    pub fn take(
        &mut self,
        conn: ConnId,
        id: u32,
        max: u32,
        only: Option<&BTreeSet<u32>>,
    ) -> Result<Vec<StreamTask>, StreamError> {
        let Some(stream) = self.streams.get_mut(&id) else {
            return Err(fail(Status::Ended, "the stream was closed"));
        };
        if !stream.producers.contains(&conn) {
            return Err(fail(Status::Protocol, "take before joining the stream"));
        }
        let served = |rank: &u32, r: &Rank| match only {
            None => true,
            Some(ranks) => r.owner.is_none() && ranks.contains(rank),
        };
        let mut serving = stream.ranks.iter().filter(|(k, r)| served(k, r)).peekable();
        if serving.peek().is_some() && serving.all(|(_, r)| stream.rank_done(r)) {
            return Err(fail(Status::Ended, "every rank's last epoch is made"));
        }
        let mut order: Vec<u32> = stream
            .ranks
            .iter()
            .filter(|(k, r)| served(k, r))
            .map(|(&rank, _)| rank)
            .collect();
        order.sort_by_key(|r| stream.ranks[r].in_flight());
        let mut tasks = Vec::new();
        // This node's ranks round-robin until their windows are full, then other nodes'.
        for remote in [false, true] {
            let group: Vec<u32> = order
                .iter()
                .copied()
                .filter(|r| stream.ranks[r].owner.is_some() == remote)
                .collect();
            let mut progress = true;
            while tasks.len() < max as usize && progress {
                progress = false;
                for &rank in &group {
                    if tasks.len() >= max as usize {
                        break;
                    }
                    let window_end = stream.window_end(&stream.ranks[&rank]);
                    let end = stream.end();
                    let r = stream.ranks.get_mut(&rank).expect("listed");
                    if stream.batch > 1 && r.owner.is_none() {
                        // A whole batch, even past `max`: a batch split between producers
                        // could not share an object.
                        let seqs = r.next_batch(conn, window_end, end, u64::from(stream.batch));
                        progress |= !seqs.is_empty();
                        tasks.extend(seqs.into_iter().map(|seq| StreamTask { rank, seq }));
                    } else if let Some(seq) = r.next_task(conn, window_end) {
                        tasks.push(StreamTask { rank, seq });
                        progress = true;
                    }
                }
            }
        }
        if !tasks.is_empty() {
            stream.last_used = Instant::now();
            self.changed();
        }
        Ok(tasks)
    }

    /// A producer delivers samples. Per item: `Ok`, or why it was not taken (the producer then
    /// aborts its object). A sample for another node's rank is sealed and leased here and waits
    /// in that node's outbox ([`Streams::forwards`]); only this node's producers (`forwardable`)
    /// put those, never another node's session.
    pub fn put(
        &mut self,
        objects: &mut Objects,
        conn: ConnId,
        id: u32,
        items: &[StreamItem],
        forwardable: bool,
    ) -> Result<Vec<Status>, StreamError> {
        let stream = self
            .streams
            .get_mut(&id)
            .ok_or_else(|| fail(Status::Ended, "the stream was closed"))?;
        if !stream.producers.contains(&conn) {
            return Err(fail(Status::Protocol, "put before joining the stream"));
        }
        let leases = stream.leases;
        let mut statuses = Vec::with_capacity(items.len());
        // What a put files in the decode-once cache, under the stream's owner's uid: samples
        // this node's own producers of that uid made, whole objects only (a sample inside
        // another object is not cached). A peer's stream session puts samples, never cache
        // entries: nothing a peer sends is filed under a key.
        let files = !self.sessions.contains(&conn);
        let mut cached = Vec::new();
        for item in items {
            let StreamTask { rank, seq } = item.task;
            let Some(r) = stream.ranks.get_mut(&rank) else {
                statuses.push(Status::NotFound);
                continue;
            };
            // Any producer connection may put a task taken by another (a producer process takes
            // on one connection and puts from each CPU worker's); what matters is that the task
            // is still out. Not out any more: a resume moved the window, or it was put already.
            if !r.assigned.contains_key(&seq) || (r.owner.is_some() && !forwardable) {
                statuses.push(Status::Stale);
                continue;
            }
            let got = if item.flags & ENTRY_FAILED != 0 {
                Ok(Got {
                    location: Location {
                        segment: 0,
                        offset: 0,
                        len: 0,
                    },
                    writer: 0,
                })
            } else {
                // Seal the producer's reservation (or accept an already sealed object, a cache
                // hit), then lease it for the stream.
                match objects.seal(conn, item.handle) {
                    Ok(()) | Err(Status::InvalidState) => objects.lease(leases, item.handle),
                    Err(e) => Err(e),
                }
                .and_then(|got| match within(got.location, item.offset) {
                    Some(location) => Ok(Got { location, ..got }),
                    None => {
                        let _ = objects.release(leases, item.handle);
                        Err(Status::InvalidArgument)
                    }
                })
            };
            r.assigned.remove(&seq);
            let got = match got {
                Ok(got) => got,
                Err(status) => {
                    r.redo.insert(seq);
                    statuses.push(status);
                    continue;
                }
            };
            let made = item.flags & ENTRY_FAILED == 0;
            if let Some(node) = r.owner {
                let Some(remote) = stream.remotes.get_mut(&node) else {
                    if made {
                        let _ = objects.release(leases, item.handle);
                    }
                    statuses.push(Status::Stale);
                    continue;
                };
                remote.outbox.push(*item);
                if files && item.key != 0 && item.offset == 0 && made {
                    cached.push(((stream.owner_uid, item.key), item.handle));
                }
                stream.samples_put += 1;
                statuses.push(Status::Ok);
                continue;
            }
            let entry = RingEntry {
                seq,
                handle: if item.flags & ENTRY_FAILED != 0 {
                    Handle::default()
                } else {
                    item.handle
                },
                location: got.location,
                record: item.record,
                flags: item.flags,
                writer: got.writer,
            };
            if let Some(c) = &mut r.consumer {
                c.publish(objects, leases, &entry);
            }
            r.ready.insert(seq, entry);
            if files && item.key != 0 && item.offset == 0 && entry.flags & ENTRY_FAILED == 0 {
                cached.push(((stream.owner_uid, item.key), entry.handle));
            }
            stream.samples_put += 1;
            stream
                .cold_start
                .get_or_insert_with(|| stream.created.elapsed());
            statuses.push(Status::Ok);
        }
        stream.last_used = Instant::now();
        for ((uid, key), handle) in cached {
            if objects.creator(handle) == Some(uid) {
                self.cache.file(objects, uid, key, handle);
            }
        }
        self.changed();
        Ok(statuses)
    }

    /// Looks samples up by key, among those `conn`'s uid filed: the handle of each one still
    /// in the store.
    pub fn lookup(
        &mut self,
        objects: &Objects,
        conn: ConnId,
        keys: &[u128],
    ) -> Vec<Option<Handle>> {
        match objects.client(conn).map(|c| c.uid) {
            Some(uid) => self.cache.lookup(objects, uid, keys),
            None => vec![None; keys.len()],
        }
    }

    /// Files objects `conn`'s uid made under sample keys (a loader's worker sharing what it
    /// made): per entry, see [`SampleCache::insert`].
    pub fn insert(
        &mut self,
        objects: &Objects,
        conn: ConnId,
        entries: &[CacheEntry],
    ) -> Vec<Status> {
        match objects.client(conn).map(|c| c.uid) {
            Some(uid) => self.cache.insert(objects, uid, entries),
            None => vec![Status::NotFound; entries.len()],
        }
    }

    /// What a feeder joins `node` with for stream `id`: the owner's uid, the spec, the depth
    /// and where each of the ranks `node` owns starts. `None` once the stream is gone.
    pub fn remote_join(
        &self,
        id: u32,
        node: u32,
    ) -> Option<(u32, StreamSpec, u32, Vec<StreamTask>)> {
        let stream = self.streams.get(&id)?;
        stream.remotes.get(&node)?;
        let ranks = stream
            .ranks
            .iter()
            .filter(|(_, r)| r.owner == Some(node))
            .map(|(&rank, r)| StreamTask {
                rank,
                seq: r.released,
            })
            .collect();
        Some((stream.owner_uid, stream.spec.clone(), stream.depth, ranks))
    }

    /// `node` has the stream joined as `remote_stream`, told of `ranks` of its ranks (`None`:
    /// the session was lost, and with it the tasks it had granted, which that node makes
    /// available again).
    pub fn remote_joined(&mut self, id: u32, node: u32, remote_stream: Option<u32>, ranks: usize) {
        let Some(stream) = self.streams.get_mut(&id) else {
            return;
        };
        let Some(remote) = stream.remotes.get_mut(&node) else {
            return;
        };
        remote.id = remote_stream;
        remote.joined_ranks = ranks;
        if remote_stream.is_none() {
            for r in stream.ranks.values_mut().filter(|r| r.owner == Some(node)) {
                r.redo.clear();
            }
        }
        self.changed();
    }

    /// How many tasks the feeder of `node`'s ranks should ask for: enough to keep this node's
    /// producers busy, not so many that other nodes' producers go without.
    pub fn demand(&self, id: u32, node: u32) -> Demand {
        let Some(stream) = self.streams.get(&id) else {
            return Demand::Leave;
        };
        let local = stream
            .producers
            .iter()
            .filter(|c| !self.sessions.contains(c))
            .count();
        if local == 0 || !stream.remotes.contains_key(&node) {
            return Demand::Leave;
        }
        let owned = stream.ranks.values().filter(|r| r.owner == Some(node));
        if owned.clone().count() > stream.remotes[&node].joined_ranks {
            return Demand::Rejoin;
        }
        let waiting: usize = owned.map(|r| r.redo.len()).sum();
        let target = (local * 8).clamp(8, 1024);
        match target.saturating_sub(waiting) {
            0 => Demand::Full,
            n => Demand::Tasks(n as u32),
        }
    }

    /// Tasks `node` granted for its ranks: this node's producers take them next.
    pub fn grant(&mut self, id: u32, node: u32, tasks: &[StreamTask]) {
        let Some(stream) = self.streams.get_mut(&id) else {
            return;
        };
        for task in tasks {
            if let Some(r) = stream.ranks.get_mut(&task.rank)
                && r.owner == Some(node)
                && !r.assigned.contains_key(&task.seq)
            {
                r.redo.insert(task.seq);
            }
        }
        stream.last_used = Instant::now();
        self.changed();
    }

    /// `node` needs nothing more for its ranks of the stream.
    pub fn remote_ended(&mut self, id: u32, node: u32) {
        if let Some(remote) = self
            .streams
            .get_mut(&id)
            .and_then(|s| s.remotes.get_mut(&node))
        {
            remote.ended = true;
            self.changed();
        }
    }

    /// The feeder of `node` starts leaving, if no producer here serves the stream any more
    /// (checked under the same lock): granted tasks are forgotten (the owner takes them back
    /// when told), and samples made meanwhile are not handed over. `false`: producers are back.
    pub fn begin_leave(&mut self, id: u32, node: u32) -> bool {
        if self.demand(id, node) != Demand::Leave {
            return false;
        }
        let Some(stream) = self.streams.get_mut(&id) else {
            return true;
        };
        if let Some(remote) = stream.remotes.get_mut(&node) {
            remote.leaving = true;
            remote.wanted = false;
            remote.id = None;
            for r in stream.ranks.values_mut().filter(|r| r.owner == Some(node)) {
                r.redo.clear();
            }
            self.changed();
        }
        true
    }

    /// The owner was told: the feeder ends (`true`), unless a producer joined meanwhile
    /// (`false`: it joins again; a producer joining after this starts a new feeder).
    pub fn end_leave(&mut self, id: u32, node: u32) -> bool {
        let Some(stream) = self.streams.get_mut(&id) else {
            return true;
        };
        let Some(remote) = stream.remotes.get_mut(&node) else {
            return true;
        };
        if remote.wanted {
            remote.leaving = false;
            remote.wanted = false;
            remote.joined_ranks = 0;
            return false;
        }
        stream.remotes.remove(&node);
        self.changed();
        true
    }

    /// Takes the samples waiting to be handed to other nodes. Those whose owner has no session
    /// now are dropped with their leases (the owner made their tasks available again when the
    /// session was lost).
    pub fn forwards(&mut self, objects: &mut Objects) -> Vec<Forward> {
        let mut out = Vec::new();
        for stream in self.streams.values_mut() {
            for (&node, remote) in &mut stream.remotes {
                if remote.outbox.is_empty() {
                    continue;
                }
                let items = std::mem::take(&mut remote.outbox);
                match remote.id {
                    Some(remote_stream) => out.push(Forward {
                        node,
                        remote_stream,
                        leases: stream.leases,
                        relay: stream.relay,
                        items,
                    }),
                    None => {
                        for item in items.iter().filter(|i| i.flags & ENTRY_FAILED == 0) {
                            let _ = objects.release(stream.leases, item.handle);
                        }
                    }
                }
            }
        }
        out
    }

    /// A task `conn` took and cannot deliver (another node could not pull its sample) goes
    /// back to its window, to be made again.
    pub fn give_back(&mut self, conn: ConnId, id: u32, task: StreamTask) {
        if let Some(r) = self
            .streams
            .get_mut(&id)
            .and_then(|s| s.ranks.get_mut(&task.rank))
            && r.assigned.get(&task.seq) == Some(&conn)
        {
            r.assigned.remove(&task.seq);
            r.redo.insert(task.seq);
            self.changed();
        }
    }

    /// Whether `handle` is what stream `id`'s owner put under cache key `key`: a sample this
    /// node's producers of that uid made, which another node's producer may hand back for a
    /// rank of the stream (it found the sample in its own cache as a pulled copy).
    pub fn cached_sample(&self, id: u32, key: u128, handle: Handle) -> bool {
        key != 0
            && self
                .streams
                .get(&id)
                .is_some_and(|s| self.cache.get(s.owner_uid, key) == Some(handle))
    }

    /// Marks `conn` as another node's stream session (see [`Streams::demand`]).
    pub fn register_session(&mut self, conn: ConnId) {
        self.sessions.insert(conn);
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

    /// Adds the streams' and the cache's counters to the store's.
    pub fn add_stats(&self, stats: &mut feedstore_proto::StoreStats) {
        stats.streams = self.streams.len() as u64;
        self.cache.add_stats(stats);
        stats.ring_bytes = self.ring_bytes;
        stats.limits_hit += self.limits_hit;
        stats.streams_expired = self.expired;
    }

    /// The consumer attached to `rank` on `conn`, or why a request from `conn` about it is
    /// refused.
    fn consumer_of<'a>(
        stream: &'a mut Stream,
        conn: ConnId,
        rank: u32,
        what: &str,
    ) -> Result<&'a mut Rank, StreamError> {
        let r = stream
            .ranks
            .get_mut(&rank)
            .ok_or_else(|| fail(Status::NotFound, format!("no rank {rank}")))?;
        if r.consumer.as_ref().map(|c| c.conn) != Some(conn) {
            return Err(fail(
                Status::Protocol,
                format!("{what} by a connection not attached to rank {rank}"),
            ));
        }
        Ok(r)
    }

    /// A consumer returns every sample below `upto` (up to the first one not yet made) to the
    /// window. The views it read keep their own leases until they go.
    pub fn release(
        &mut self,
        objects: &mut Objects,
        conn: ConnId,
        id: u32,
        rank: u32,
        upto: u64,
        figures: RankFigures,
    ) -> Result<(), StreamError> {
        let stream = self.stream(id)?;
        let leases = stream.leases;
        let r = Self::consumer_of(stream, conn, rank, "release")?;
        let mut returned = Vec::new();
        while r.released < upto {
            let Some(entry) = r.ready.remove(&r.released) else {
                break;
            };
            returned.push(entry);
            r.released += 1;
        }
        if let Some(c) = &mut r.consumer {
            c.published.read_below(upto);
            c.figures = figures;
            // The report includes every wait that ended before it, and a wait in slices up to
            // its last slice: a wait still under way counts on from here.
            let now = Instant::now();
            c.reported_at = Some(now);
            c.waited_unreported = Duration::ZERO;
            if let Some(since) = &mut c.waiting_since {
                *since = now;
            }
        }
        for entry in &returned {
            if entry.flags & ENTRY_FAILED == 0 {
                let _ = objects.release(leases, entry.handle);
            }
        }
        stream.samples_returned += returned.len() as u64;
        stream.last_used = Instant::now();
        if !returned.is_empty() {
            self.changed();
        }
        Ok(())
    }

    /// A producer of the stream reports its figures: kept per producer, its counters never
    /// going back (see [`ProducerFigures::update`]).
    pub fn producer_report(
        &mut self,
        conn: ConnId,
        id: u32,
        figures: &ProducerFigures,
    ) -> Result<(), StreamError> {
        let stream = self.stream(id)?;
        if !stream.producers.contains(&conn) {
            return Err(fail(
                Status::Protocol,
                "a producer report from a connection that did not join the stream",
            ));
        }
        stream
            .producer_figures
            .entry(conn)
            .or_default()
            .update(figures);
        Ok(())
    }

    /// The consumer on `conn` waits for `seq` of `rank`: whether it is in its ring (`Ok`), will
    /// never be (`Ended`), or not yet (`None`). Everything below `seq` was read.
    pub fn poll(
        &mut self,
        conn: ConnId,
        id: u32,
        rank: u32,
        seq: u64,
    ) -> Result<Option<Status>, StreamError> {
        let Some(stream) = self.streams.get_mut(&id) else {
            return Ok(Some(Status::Ended));
        };
        if stream.end().is_some_and(|end| seq >= end) {
            return Ok(Some(Status::Ended));
        }
        let r = Self::consumer_of(stream, conn, rank, "wait")?;
        let ready = r.ready.contains_key(&seq);
        if let Some(c) = &mut r.consumer {
            c.published.read_below(seq);
            c.polled(seq, ready, Instant::now());
        }
        Ok(ready.then_some(Status::Ok))
    }

    /// The consumer on `conn` asks for `seq` of `rank`: if that is past the rank's last sample,
    /// it has read its whole share, and producers need not wait for it to return them before
    /// they stop.
    pub fn finish(&mut self, conn: ConnId, id: u32, rank: u32, seq: u64) {
        let Some(stream) = self.streams.get_mut(&id) else {
            return;
        };
        if stream.end().is_none_or(|end| seq < end) {
            return;
        }
        let Some(r) = stream.ranks.get_mut(&rank) else {
            return;
        };
        let newly = !r.finished && r.consumer.as_ref().is_some_and(|c| c.conn == conn);
        r.finished |= newly;
        if newly {
            self.changed();
        }
    }

    /// A consumer detaches from its rank, having read everything below `next`: the leases its
    /// connection got for entries it never read go back, and the rank is free for another
    /// consumer.
    pub fn detach(
        &mut self,
        objects: &mut Objects,
        conn: ConnId,
        id: u32,
        rank: u32,
        next: u64,
    ) -> Result<(), StreamError> {
        if let Some(orphan) = self.orphans.remove(&(conn, id, rank)) {
            orphan.release_unread(objects, conn, next);
            return Ok(());
        }
        let stream = self.stream(id)?;
        let r = Self::consumer_of(stream, conn, rank, "detach")?;
        let consumer = r.consumer.take().expect("checked attached");
        let unread = consumer.published.release_unread(objects, conn, next);
        stream.last_used = Instant::now();
        tracing::info!(stream = ?stream.spec.name, rank, next, unread, "consumer detached");
        self.unattach(conn);
        self.changed();
        Ok(())
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

    /// The streams `conn` may see (its uid's; every stream for root and the daemon's uid)
    /// with ids above `after`, in id order, as many as fit in `budget_bytes` of encoded entries
    /// (at least one); whether more follow.
    pub fn list(
        &self,
        objects: &Objects,
        conn: ConnId,
        after: u32,
        budget_bytes: usize,
    ) -> (Vec<StreamInfo>, bool) {
        let uid = objects.client(conn).map_or(u32::MAX, |c| c.uid);
        let sees_all = uid == 0 || uid == self.daemon_uid;
        let mut page = Vec::new();
        let mut used = 0;
        let visible = self
            .streams
            .range(after.saturating_add(1)..)
            .filter(|(_, s)| sees_all || s.owner_uid == uid);
        for (&id, s) in visible {
            let info = Self::info(id, s, StreamInfo::RANKS_LISTED);
            if !page.is_empty() && used + info.wire_bytes() > budget_bytes {
                return (page, true);
            }
            used += info.wire_bytes();
            page.push(info);
        }
        (page, false)
    }

    /// Every open stream, whoever owns it, with every attached rank: for the daemon's own
    /// metrics.
    pub fn all(&self) -> Vec<StreamInfo> {
        self.streams
            .iter()
            .map(|(&id, s)| Self::info(id, s, usize::MAX))
            .collect()
    }

    /// A stream as listed, with at most `ranks` of its attached ranks.
    fn info(id: u32, s: &Stream, ranks: usize) -> StreamInfo {
        let now = Instant::now();
        StreamInfo {
            id,
            owner_uid: s.owner_uid,
            name: s.spec.name.clone(),
            depth: s.depth,
            producers: s.producers.len() as u32,
            consumers: s.ranks.values().filter(|r| r.consumer.is_some()).count() as u32,
            ranks: s.ranks.len() as u32,
            ready: s.ranks.values().map(|r| r.ready.len() as u64).sum(),
            making: s.ranks.values().map(|r| r.assigned.len() as u64).sum(),
            put: s.samples_put,
            returned: s.samples_returned,
            slowest: s.ranks.values().map(|r| r.released).min().unwrap_or(0),
            fastest: s.ranks.values().map(|r| r.released).max().unwrap_or(0),
            cold_start_us: s.cold_start.map_or(0, |d| d.as_micros().max(1) as u64),
            ranks_attached: s
                .ranks
                .iter()
                .filter_map(|(&rank, r)| {
                    r.consumer.as_ref().map(|c| RankInfo {
                        rank,
                        released: r.released,
                        ready: r.ready.len() as u32,
                        figures: c.figures_now(now, r.finished),
                    })
                })
                .take(ranks)
                .collect(),
            producer: s
                .producer_figures
                .values()
                .fold(s.producers_departed, |mut sum, f| {
                    sum.add(f);
                    sum
                }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use feedstore_proto::stream::{Shuffle, Tail};

    fn spec(epochs: u64) -> StreamSpec {
        StreamSpec {
            name: "s".into(),
            records: 8,
            seed: 1,
            world: 2,
            shuffle: Shuffle::Full,
            tail: Tail::Drop,
            epochs: Some(epochs),
        }
    }

    use crate::objects::test_client as client;

    fn setup() -> (Objects, Streams, ConnId, ConnId) {
        setup_with(&Limits::default())
    }

    fn setup_with(limits: &Limits) -> (Objects, Streams, ConnId, ConnId) {
        let mut o = Objects::new(1, 1, &[1 << 20], false);
        let producer = client(&mut o, Role::Writer, 1000);
        let consumer = client(&mut o, Role::Reader, 1000);
        (o, Streams::new(limits, 1000), producer, consumer)
    }

    fn starts(ranks: &[u32]) -> Vec<StreamTask> {
        ranks
            .iter()
            .map(|&rank| StreamTask { rank, seq: 0 })
            .collect()
    }

    fn make(o: &mut Objects, producer: ConnId, task: StreamTask) -> StreamItem {
        let created = o.create(producer, 64, false).unwrap();
        StreamItem {
            task,
            handle: created.handle,
            record: task.seq,
            flags: 0,
            key: u128::from(task.seq) + 1,
            offset: 0,
        }
    }

    /// Takes and puts everything the windows allow.
    fn fill(o: &mut Objects, s: &mut Streams, p: ConnId, id: u32) -> Vec<StreamItem> {
        let tasks = s.take(p, id, 100, None).unwrap();
        let items: Vec<_> = tasks.iter().map(|&t| make(o, p, t)).collect();
        assert!(
            s.put(o, p, id, &items, true)
                .unwrap()
                .iter()
                .all(|s| *s == Status::Ok)
        );
        items
    }

    #[test]
    fn windows_bound_the_work_and_slide_on_release() {
        let (mut o, mut s, p, c) = setup();
        let id = s
            .join(
                &mut o,
                p,
                &spec(1),
                2,
                &starts(&[0, 1]),
                &Placement::default(),
            )
            .map(|(id, _)| id)
            .unwrap();
        let tasks = s.take(p, id, 100, None).unwrap();
        assert_eq!(tasks.len(), 4, "depth 2 × 2 ranks: {tasks:?}");
        assert!(s.take(p, id, 100, None).unwrap().is_empty(), "windows full");
        let items: Vec<_> = tasks.iter().map(|&t| make(&mut o, p, t)).collect();
        assert_eq!(
            s.put(&mut o, p, id, &items, true).unwrap(),
            vec![Status::Ok; 4]
        );
        assert_eq!(o.stats().objects_sealed, 4);
        let (_, ring) = s.attach(&mut o, c, &spec(1), 0, 0).unwrap();
        assert!(ring.size_bytes() > 0);
        assert_eq!(
            o.stats().leases,
            4 + 2,
            "the stream's four, the consumer's own two"
        );
        assert_eq!(s.poll(c, id, 0, 0).unwrap(), Some(Status::Ok));
        assert_eq!(s.poll(c, id, 0, 2).unwrap(), None);
        s.release(&mut o, c, id, 0, 1, RankFigures::default())
            .unwrap();
        assert_eq!(
            s.take(p, id, 100, None).unwrap(),
            vec![StreamTask { rank: 0, seq: 2 }]
        );
        assert_eq!(
            o.stats().leases,
            3 + 2,
            "the stream let go; the views still hold theirs"
        );
        // The consumer's views go: its client returns their leases.
        o.release(c, items[0].handle).unwrap();
        assert_eq!(o.stats().leases, 3 + 1);
    }

    /// The soundness bug: a rank reopened at a later position used to return the stream's
    /// lease on samples a view still read, and the store reused their bytes.
    #[test]
    fn a_reattach_never_frees_what_a_view_holds() {
        let (mut o, mut s, p, c) = setup();
        let id = s
            .join(&mut o, p, &spec(4), 4, &starts(&[0]), &Placement::default())
            .map(|(id, _)| id)
            .unwrap();
        let items = fill(&mut o, &mut s, p, id);
        s.attach(&mut o, c, &spec(4), 0, 0).unwrap();
        // The consumer read 0..3 (holding 0), then its stream went: a detach at 3.
        s.release(&mut o, c, id, 0, 0, RankFigures::default())
            .unwrap();
        s.detach(&mut o, c, id, 0, 3).unwrap();
        assert_eq!(
            o.stats().leases,
            4 + 3,
            "entry 3 was never read: its lease went back"
        );
        // A new consumer resumes at 3: the stream drops 0..3, but views 0..3 keep theirs.
        let c2 = client(&mut o, Role::Reader, 1000);
        s.attach(&mut o, c2, &spec(4), 0, 3).unwrap();
        // Room for all but one object: only evicting views' objects could make it.
        assert_eq!(
            o.create(p, (1 << 20) - 64, false).unwrap_err(),
            Status::Full,
            "nothing a view holds is evictable"
        );
        for item in &items[..3] {
            assert!(o.is_sealed(item.handle), "{} still stored", item.handle);
        }
        // And a close keeps them too.
        s.close(&mut o, p, id).unwrap();
        for item in &items[..3] {
            assert!(o.is_sealed(item.handle));
        }
        for item in &items[..3] {
            o.release(c, item.handle).unwrap();
        }
        assert_eq!(
            o.stats().leases,
            1,
            "only c2's own lease on entry 3, until it detaches"
        );
    }

    #[test]
    fn only_the_owners_writers_close_a_stream() {
        let (mut o, mut s, p, c) = setup();
        let id = s
            .join(&mut o, p, &spec(1), 4, &starts(&[0]), &Placement::default())
            .map(|(id, _)| id)
            .unwrap();
        s.attach(&mut o, c, &spec(1), 0, 0).unwrap();
        let err = s.close(&mut o, c, id).unwrap_err();
        assert_eq!(err.status, Status::PermissionDenied, "a reader: {err}");
        let stranger = client(&mut o, Role::Writer, 2000);
        let err = s.close(&mut o, stranger, id).unwrap_err();
        assert_eq!(err.status, Status::PermissionDenied, "another uid: {err}");
        let err = s
            .join(&mut o, c, &spec(1), 4, &starts(&[0]), &Placement::default())
            .map(|(id, _)| id)
            .unwrap_err();
        assert_eq!(
            err.status,
            Status::PermissionDenied,
            "readers do not create or join"
        );
        let root = client(&mut o, Role::Writer, 0);
        s.close(&mut o, root, id).unwrap();
    }

    #[test]
    fn readers_attach_only_to_streams_writers_made() {
        let (mut o, mut s, p, c) = setup();
        let err = s.attach(&mut o, c, &spec(1), 0, 0).unwrap_err();
        assert_eq!(err.status, Status::NotFound);
        assert_eq!(s.list(&o, c, 0, 1 << 20).0.len(), 0);
        s.join(&mut o, p, &spec(1), 4, &[], &Placement::default())
            .map(|(id, _)| id)
            .unwrap();
        s.attach(&mut o, c, &spec(1), 0, 0).unwrap();
        let other = client(&mut o, Role::Reader, 1000);
        let err = s.attach(&mut o, other, &spec(1), 0, 0).unwrap_err();
        assert_eq!(err.status, Status::InUse, "one consumer per rank");
    }

    #[test]
    fn rings_and_streams_are_bounded() {
        let limits = Limits {
            max_streams: 2,
            max_ring_bytes: 3 * ring_size(64),
            ..Limits::default()
        };
        let (mut o, mut s, p, c) = setup_with(&limits);
        let wide = StreamSpec {
            world: 8,
            records: 64,
            ..spec(1)
        };
        s.join(&mut o, p, &wide, 64, &[], &Placement::default())
            .map(|(id, _)| id)
            .unwrap();
        for rank in 0..3 {
            let conn = client(&mut o, Role::Reader, 1000);
            s.attach(&mut o, conn, &wide, rank, 0).unwrap();
        }
        let err = s.attach(&mut o, c, &wide, 3, 0).unwrap_err();
        assert_eq!(err.status, Status::LimitReached, "{err}");
        assert!(err.message.contains("--max-ring-bytes"), "{err}");
        let mut stats = o.stats();
        s.add_stats(&mut stats);
        assert_eq!(stats.ring_bytes, 3 * ring_size(64));
        let two = StreamSpec {
            name: "t".into(),
            ..spec(1)
        };
        s.join(&mut o, p, &two, 4, &[], &Placement::default())
            .map(|(id, _)| id)
            .unwrap();
        let three = StreamSpec {
            name: "u".into(),
            ..spec(1)
        };
        let err = s
            .join(&mut o, p, &three, 4, &[], &Placement::default())
            .map(|(id, _)| id)
            .unwrap_err();
        assert_eq!(err.status, Status::LimitReached);
        assert!(err.message.contains("--max-streams"), "{err}");
    }

    /// Names are per uid: another user can neither see, feed, rewind nor squat a stream.
    #[test]
    fn streams_belong_to_their_uid() {
        let (mut o, mut s, p, c) = setup();
        let id = s
            .join(&mut o, p, &spec(1), 4, &starts(&[0]), &Placement::default())
            .map(|(id, _)| id)
            .unwrap();
        let tasks = s.take(p, id, 1, None).unwrap();
        let other_reader = client(&mut o, Role::Reader, 2000);
        let err = s.attach(&mut o, other_reader, &spec(1), 0, 0).unwrap_err();
        assert_eq!(
            err.status,
            Status::NotFound,
            "uid 2000 sees no stream of uid 1000"
        );
        let other_writer = client(&mut o, Role::Writer, 2000);
        let theirs = s
            .join(
                &mut o,
                other_writer,
                &spec(1),
                4,
                &[],
                &Placement::default(),
            )
            .map(|(id, _)| id)
            .unwrap();
        assert_ne!(
            theirs, id,
            "the same name is another stream for another uid"
        );
        let item = make(&mut o, other_writer, tasks[0]);
        let err = s.put(&mut o, other_writer, id, &[item], true).unwrap_err();
        assert_eq!(
            err.status,
            Status::Protocol,
            "only the stream's producers put into it"
        );
        assert!(s.take(other_writer, id, 1, None).is_err());
        s.attach(&mut o, c, &spec(1), 0, 0).unwrap();
    }

    /// A ring stays counted until the connection that received it closes (the client may keep
    /// it mapped), and a connection attaches to one rank at a time.
    #[test]
    fn rings_are_counted_until_their_connection_closes() {
        let (mut o, mut s, p, c) = setup();
        let wide = StreamSpec {
            world: 4,
            ..spec(1)
        };
        let id = s
            .join(&mut o, p, &wide, 64, &[], &Placement::default())
            .map(|(id, _)| id)
            .unwrap();
        s.attach(&mut o, c, &wide, 0, 0).unwrap();
        let err = s.attach(&mut o, c, &wide, 1, 0).unwrap_err();
        assert_eq!(err.status, Status::InvalidState, "one rank per connection");
        s.detach(&mut o, c, id, 0, 0).unwrap();
        let ring_bytes = |s: &Streams| {
            let mut stats = feedstore_proto::StoreStats::default();
            s.add_stats(&mut stats);
            stats.ring_bytes
        };
        assert_eq!(
            ring_bytes(&s),
            ring_size(64),
            "still counted after the detach"
        );
        s.attach(&mut o, c, &wide, 1, 0).unwrap();
        assert_eq!(ring_bytes(&s), 2 * ring_size(64));
        s.disconnect(c);
        assert_eq!(ring_bytes(&s), 0, "given back with the connection");
        let looping = client(&mut o, Role::Reader, 1000);
        for _ in 0..MAX_RINGS_PER_CONNECTION {
            s.attach(&mut o, looping, &wide, 2, 0).unwrap();
            s.detach(&mut o, looping, id, 2, 0).unwrap();
        }
        let err = s.attach(&mut o, looping, &wide, 2, 0).unwrap_err();
        assert_eq!(err.status, Status::LimitReached, "{err}");
    }

    #[test]
    fn idle_streams_expire_and_give_their_samples_back() {
        let limits = Limits {
            stream_idle_timeout: Duration::from_secs(60),
            ..Limits::default()
        };
        let (mut o, mut s, p, c) = setup_with(&limits);
        let id = s
            .join(&mut o, p, &spec(1), 4, &starts(&[0]), &Placement::default())
            .map(|(id, _)| id)
            .unwrap();
        fill(&mut o, &mut s, p, id);
        let later = Instant::now() + Duration::from_secs(120);
        assert_eq!(s.expire(&mut o, later), 0, "a producer is joined");
        s.disconnect(p);
        s.attach(&mut o, c, &spec(1), 0, 0).unwrap();
        assert_eq!(s.expire(&mut o, later), 0, "a consumer is attached");
        s.disconnect(c);
        o.disconnect(c);
        assert_eq!(s.expire(&mut o, Instant::now()), 0, "not idle for long yet");
        assert_eq!(s.expire(&mut o, later), 1);
        assert_eq!(o.stats().leases, 0);
        let mut stats = o.stats();
        s.add_stats(&mut stats);
        assert_eq!((stats.streams, stats.streams_expired), (0, 1));
    }

    #[test]
    fn a_batched_stream_hands_out_whole_batches_that_share_an_object() {
        let (mut o, mut s, p, _) = setup();
        let tasks = |rank, seqs: std::ops::Range<u64>| -> Vec<StreamTask> {
            seqs.map(|seq| StreamTask { rank, seq }).collect()
        };
        let narrow = Window { depth: 3, batch: 4 };
        let err = s
            .join(
                &mut o,
                p,
                &spec(2),
                narrow,
                &starts(&[0]),
                &Placement::default(),
            )
            .unwrap_err();
        assert_eq!(err.status, Status::InvalidArgument);
        assert!(
            err.message.contains("a batch of 4 samples"),
            "{}",
            err.message
        );
        let huge = Window {
            depth: MAX_DEPTH,
            batch: MAX_BATCH + 1,
        };
        let err = s
            .join(
                &mut o,
                p,
                &spec(2),
                huge,
                &starts(&[0]),
                &Placement::default(),
            )
            .unwrap_err();
        assert_eq!(err.status, Status::InvalidArgument, "{}", err.message);
        let window = Window { depth: 8, batch: 4 };
        let id = s
            .join(
                &mut o,
                p,
                &spec(2),
                window,
                &starts(&[0, 1]),
                &Placement::default(),
            )
            .map(|(id, _)| id)
            .unwrap();
        assert_eq!(
            s.take(p, id, 1, None).unwrap(),
            tasks(0, 0..4),
            "a whole batch past max"
        );
        let rest = s.take(p, id, 100, None).unwrap();
        let want: Vec<StreamTask> = [tasks(1, 0..4), tasks(0, 4..8), tasks(1, 4..8)].concat();
        assert_eq!(rest, want);
        assert!(s.take(p, id, 100, None).unwrap().is_empty(), "windows full");

        // Rank 0's first batch in one object of four 64-byte samples; a fifth offset past its
        // end is refused, and only that task is made again.
        let object = o.create(p, 256, false).unwrap().handle;
        let items: Vec<StreamItem> = tasks(0, 0..4)
            .into_iter()
            .zip([0, 64, 128, 256])
            .map(|(task, offset)| StreamItem {
                task,
                handle: object,
                record: task.seq,
                flags: 0,
                key: 0,
                offset,
            })
            .collect();
        assert_eq!(
            s.put(&mut o, p, id, &items, true).unwrap(),
            vec![Status::Ok, Status::Ok, Status::Ok, Status::InvalidArgument]
        );
        assert_eq!(o.stats().objects_sealed, 1);
        assert_eq!(
            o.stats().leases,
            3,
            "the stream leases the object once per sample"
        );
        let stream = &s.streams[&id];
        let entries = &stream.ranks[&0].ready;
        let at = |seq: u64| entries[&seq].location;
        assert_eq!(
            (at(1).offset - at(0).offset, at(0).len - at(1).len),
            (64, 64)
        );
        assert_eq!(
            at(2).offset + at(2).len,
            at(0).offset + 256,
            "each runs to the end"
        );

        // A producer dies with batches out: a new one gets the missing ones a batch at a time.
        s.disconnect(p);
        let p2 = client(&mut o, Role::Writer, 1000);
        s.join(
            &mut o,
            p2,
            &spec(2),
            window,
            &starts(&[0]),
            &Placement::default(),
        )
        .unwrap();
        let again = s.take(p2, id, 100, None).unwrap();
        let want = [
            tasks(1, 0..4),
            tasks(0, 3..4),
            tasks(1, 4..8),
            tasks(0, 4..8),
        ]
        .concat();
        assert_eq!(again, want);
    }

    #[test]
    fn a_dead_producers_tasks_are_made_again() {
        let (mut o, mut s, p, _) = setup();
        let id = s
            .join(&mut o, p, &spec(1), 2, &starts(&[0]), &Placement::default())
            .map(|(id, _)| id)
            .unwrap();
        let first = s.take(p, id, 1, None).unwrap();
        s.disconnect(p);
        let p2 = client(&mut o, Role::Writer, 1000);
        s.join(
            &mut o,
            p2,
            &spec(1),
            2,
            &starts(&[0]),
            &Placement::default(),
        )
        .map(|(id, _)| id)
        .unwrap();
        let again = s.take(p2, id, 2, None).unwrap();
        assert_eq!(again[0], first[0], "redo first");
        let item = make(&mut o, p2, first[0]);
        assert_eq!(
            s.put(&mut o, p2, id, &[item], true).unwrap(),
            vec![Status::Ok]
        );
        let twice = make(&mut o, p2, first[0]);
        assert_eq!(
            s.put(&mut o, p2, id, &[twice], true).unwrap(),
            vec![Status::Stale],
            "put once"
        );
    }

    #[test]
    fn attach_rewinds_and_keeps_what_it_can() {
        let (mut o, mut s, p, c) = setup();
        let id = s
            .join(&mut o, p, &spec(2), 4, &starts(&[0]), &Placement::default())
            .map(|(id, _)| id)
            .unwrap();
        fill(&mut o, &mut s, p, id);
        s.attach(&mut o, c, &spec(2), 0, 0).unwrap();
        s.release(&mut o, c, id, 0, 3, RankFigures::default())
            .unwrap();
        s.disconnect(c);
        // The checkpoint said 1: 1 and 2 were returned, 3 is still held.
        let c2 = client(&mut o, Role::Reader, 1000);
        s.attach(&mut o, c2, &spec(2), 0, 1).unwrap();
        assert_eq!(s.poll(c2, id, 0, 3).unwrap(), Some(Status::Ok), "kept");
        assert_eq!(s.poll(c2, id, 0, 1).unwrap(), None, "to be made again");
        let again = s.take(p, id, 10, None).unwrap();
        let seqs: Vec<u64> = again.iter().map(|t| t.seq).collect();
        assert_eq!(seqs, vec![1, 2, 4]);
        assert!(
            s.poll(c, id, 0, 1).is_err(),
            "only the attached consumer waits"
        );
    }

    #[test]
    fn a_finished_stream_ends_and_a_close_returns_everything() {
        let (mut o, mut s, p, c) = setup();
        let id = s
            .join(&mut o, p, &spec(1), 8, &starts(&[0]), &Placement::default())
            .map(|(id, _)| id)
            .unwrap();
        let tasks = s.take(p, id, 100, None).unwrap();
        assert_eq!(tasks.len(), 4, "one epoch of 8 records over 2 ranks");
        let items: Vec<_> = tasks.iter().map(|&t| make(&mut o, p, t)).collect();
        s.put(&mut o, p, id, &items, true).unwrap();
        assert!(
            s.take(p, id, 1, None).unwrap().is_empty(),
            "made but not read: a resuming consumer may still rewind"
        );
        s.attach(&mut o, c, &spec(1), 0, 0).unwrap();
        assert_eq!(s.poll(c, id, 0, 4).unwrap(), Some(Status::Ended));
        let before = s.version();
        s.finish(c, id, 0, 3);
        assert_eq!(s.version(), before, "not past the end: nothing changed");
        s.finish(c, id, 0, 4);
        assert_ne!(
            s.version(),
            before,
            "read past the end: producers are woken"
        );
        assert_eq!(s.take(p, id, 1, None).unwrap_err().status, Status::Ended);
        let other = StreamSpec { seed: 2, ..spec(1) };
        assert_eq!(
            s.attach(&mut o, c, &other, 0, 0).unwrap_err().status,
            Status::SpecMismatch
        );
        s.close(&mut o, p, id).unwrap();
        assert_eq!(o.stats().leases, 4, "the consumer's own, until it detaches");
        s.detach(&mut o, c, id, 0, 0).unwrap();
        assert_eq!(o.stats().leases, 0);
    }

    #[test]
    fn the_cache_finds_samples_still_stored() {
        let (mut o, mut s, p, _) = setup();
        let id = s
            .join(&mut o, p, &spec(1), 8, &starts(&[0]), &Placement::default())
            .map(|(id, _)| id)
            .unwrap();
        let tasks = s.take(p, id, 2, None).unwrap();
        let items: Vec<_> = tasks.iter().map(|&t| make(&mut o, p, t)).collect();
        s.put(&mut o, p, id, &items, true).unwrap();
        let found = s.lookup(&o, p, &[1, 2, 99]);
        assert_eq!(
            found,
            vec![Some(items[0].handle), Some(items[1].handle), None]
        );
        s.close(&mut o, p, id).unwrap();
        o.delete(p, items[0].handle).unwrap();
        assert_eq!(
            s.lookup(&o, p, &[1, 2]),
            vec![None, Some(items[1].handle)],
            "gone once deleted"
        );
        let stranger = client(&mut o, Role::Writer, 2000);
        assert_eq!(
            s.lookup(&o, stranger, &[2]),
            vec![None],
            "another uid finds nothing under the same key"
        );
        let mut stats = o.stats();
        s.add_stats(&mut stats);
        assert_eq!(
            (stats.cache_lookups, stats.cache_hits, stats.cache_entries),
            (6, 3, 1)
        );
    }

    #[test]
    fn stream_lists_come_in_pages_that_fit() {
        let (mut o, mut s, p, _) = setup();
        for i in 0..10 {
            let spec = StreamSpec {
                name: format!("stream-{i}"),
                ..spec(1)
            };
            s.join(&mut o, p, &spec, 4, &[], &Placement::default())
                .map(|(id, _)| id)
                .unwrap();
        }
        let mut seen = Vec::new();
        let mut after = 0;
        let stranger = client(&mut o, Role::Reader, 2000);
        assert!(
            s.list(&o, stranger, 0, 1 << 20).0.is_empty(),
            "another uid's"
        );
        loop {
            // Room for three entries (each about 280 bytes).
            let (page, more) = s.list(&o, p, after, 900);
            assert!(page.iter().map(StreamInfo::wire_bytes).sum::<usize>() <= 900);
            after = page.last().unwrap().id;
            seen.extend(page.into_iter().map(|i| i.name));
            if !more {
                break;
            }
        }
        assert_eq!(seen.len(), 10);
    }

    /// Rank 1 lives on node 9: its tasks come only from what node 9 grants, its samples wait
    /// (sealed, leased by the stream) in node 9's outbox, and its consumer cannot attach here.
    #[test]
    fn another_nodes_ranks_take_only_granted_tasks_and_forward_their_samples() {
        let (mut o, mut s, p, c) = setup();
        let owners = Placement {
            owners: HashMap::from([(1, 9)]),
            relay: None,
        };
        let (id, feeders) = s
            .join(&mut o, p, &spec(1), 2, &starts(&[0, 1]), &owners)
            .unwrap();
        assert_eq!(feeders, vec![9], "one feeder for node 9");
        let (_, again) = s
            .join(&mut o, p, &spec(1), 2, &starts(&[0, 1]), &owners)
            .unwrap();
        assert!(again.is_empty(), "the feeder runs already");
        let err = s
            .join(&mut o, p, &spec(1), 2, &starts(&[1]), &Placement::default())
            .unwrap_err();
        assert_eq!(err.status, Status::InvalidArgument, "{}", err.message);
        let err = s.attach(&mut o, c, &spec(1), 1, 0).unwrap_err();
        assert!(err.message.contains("node 00000009"), "{}", err.message);

        let local = s.take(p, id, 100, None).unwrap();
        assert!(
            local.iter().all(|t| t.rank == 0),
            "nothing granted yet: {local:?}"
        );
        assert_eq!(s.demand(id, 9), Demand::Rejoin, "node 9 not told yet");
        let (uid, _, depth, ranks) = s.remote_join(id, 9).unwrap();
        assert_eq!((uid, depth, ranks), (1000, 2, starts(&[1])));
        s.remote_joined(id, 9, Some(4), 1);
        assert_eq!(s.demand(id, 9), Demand::Tasks(8));
        let granted = [
            StreamTask { rank: 1, seq: 0 },
            StreamTask { rank: 1, seq: 1 },
        ];
        s.grant(id, 9, &granted);
        assert_eq!(s.demand(id, 9), Demand::Tasks(6));
        assert_eq!(s.take(p, id, 100, None).unwrap(), granted.to_vec());
        assert!(
            s.take(p, id, 100, Some(&BTreeSet::from([0, 1])))
                .unwrap()
                .iter()
                .all(|t| t.rank == 0),
            "another node's session is never handed a third node's tasks"
        );
        let items: Vec<_> = granted.iter().map(|&t| make(&mut o, p, t)).collect();
        // A session may not put them back here (that would forward in a loop).
        let other_session = client(&mut o, Role::Writer, 1000);
        s.join(
            &mut o,
            other_session,
            &spec(1),
            2,
            &[],
            &Placement::default(),
        )
        .unwrap();
        assert_eq!(
            s.put(&mut o, other_session, id, &items[..1], false)
                .unwrap(),
            vec![Status::Stale]
        );
        assert_eq!(
            s.put(&mut o, p, id, &items, true).unwrap(),
            vec![Status::Ok; 2]
        );
        let forwards = s.forwards(&mut o);
        assert_eq!(forwards.len(), 1);
        assert_eq!((forwards[0].node, forwards[0].remote_stream), (9, 4));
        assert_eq!(forwards[0].items, items);
        assert_eq!(
            o.stats().leases,
            2,
            "the stream leases both until node 9 answers"
        );
        for item in &items {
            o.release(forwards[0].leases, item.handle).unwrap();
        }
        assert!(s.forwards(&mut o).is_empty());

        // A lost session forgets its grants; the owner said it ended; the last producer left.
        s.grant(id, 9, &[StreamTask { rank: 1, seq: 2 }]);
        s.remote_joined(id, 9, None, 0);
        s.remote_joined(id, 9, Some(4), 1);
        assert!(
            s.take(p, id, 100, None)
                .unwrap()
                .iter()
                .all(|t| t.rank == 0)
        );
        s.remote_ended(id, 9);
        s.register_session(other_session);
        s.disconnect(p);
        assert_eq!(
            s.demand(id, 9),
            Demand::Leave,
            "another node's session keeps no feeder of this node going"
        );
        // Leaving, a producer comes back: the same feeder joins again instead of ending.
        assert!(s.begin_leave(id, 9));
        s.join(&mut o, p, &spec(1), 2, &starts(&[0, 1]), &owners)
            .map(|(_, feeders)| assert!(feeders.is_empty(), "no second feeder"))
            .unwrap();
        assert!(!s.end_leave(id, 9), "joins again");
        s.disconnect(p);
        assert!(s.begin_leave(id, 9));
        assert!(s.end_leave(id, 9), "gone for good");
        assert!(s.remote_join(id, 9).is_none());
    }

    /// A task whose sample could not be pulled goes back to its window; a session leaving a
    /// stream gives back what it took.
    #[test]
    fn tasks_given_back_or_left_are_made_again() {
        let (mut o, mut s, p, _c) = setup();
        let (id, _) = s
            .join(&mut o, p, &spec(1), 2, &starts(&[0]), &Placement::default())
            .unwrap();
        let only = BTreeSet::from([0]);
        let first = s.take(p, id, 1, Some(&only)).unwrap();
        let p2 = client(&mut o, Role::Writer, 1000);
        s.give_back(p2, id, first[0]);
        assert!(
            s.take(p, id, 1, Some(&only)).unwrap() != first,
            "only the connection that took a task gives it back"
        );
        s.give_back(p, id, first[0]);
        assert_eq!(s.take(p, id, 1, Some(&only)).unwrap(), first, "made again");
        s.leave(p, id);
        s.join(&mut o, p2, &spec(1), 2, &[], &Placement::default())
            .unwrap();
        let again = s.take(p2, id, 2, Some(&only)).unwrap();
        assert!(again.contains(&first[0]), "{again:?}");
        assert!(
            s.take(p, id, 1, Some(&only)).is_err(),
            "left: no longer a producer"
        );
    }

    /// The owner takes its own object back from a peer only when it is the stream's cached
    /// sample for that key (a peer's cache hit on a copy of it), never any other object.
    #[test]
    fn only_the_streams_own_cached_sample_is_taken_back() {
        let (mut o, mut s, p, _c) = setup();
        let (id, _) = s
            .join(&mut o, p, &spec(1), 2, &starts(&[0]), &Placement::default())
            .unwrap();
        let tasks = s.take(p, id, 1, None).unwrap();
        let item = make(&mut o, p, tasks[0]);
        assert_eq!(
            s.put(&mut o, p, id, &[item], true).unwrap(),
            vec![Status::Ok]
        );
        assert!(s.cached_sample(id, item.key, item.handle));
        assert!(
            !s.cached_sample(id, item.key + 1, item.handle),
            "another key"
        );
        assert!(!s.cached_sample(id, 0, item.handle), "no key");
        let other = o.create(p, 64, false).unwrap().handle;
        assert!(!s.cached_sample(id, item.key, other), "another object");
    }
}
