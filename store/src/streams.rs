//! Streams: the daemon's side of handing samples to trainer ranks in a fixed order.
//!
//! A stream is named and defined by a [`StreamSpec`], which fixes the record behind every
//! (rank, sequence number). Per rank the daemon keeps a window of `depth` sequence numbers
//! starting at the first one its consumer has not returned. Producers take tasks (rank, seq)
//! inside the windows, make the samples, and put them back; each put sample is leased by the
//! stream (through a connection of its own in [`Objects`], so it cannot be evicted) and
//! published into the rank's shared-memory ring at slot `seq mod depth`. A consumer reads its ring
//! without asking the daemon, and returns samples in batches, which slides its window and lets
//! producers go on: the window is the prefetch depth and the backpressure.
//!
//! Nothing here depends on timing. A producer that dies loses only its tasks, which go back to
//! the window to be made again. A consumer that attaches at a sequence number (a fresh start, or
//! a resume from a checkpoint after everything was killed) gets exactly the samples from there
//! on: those still held are republished into its new ring, the rest are made again.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::os::fd::OwnedFd;
use std::time::{Duration, Instant};

use feedstore_proto::frame::{StreamInfo, StreamItem, StreamTask};
use feedstore_proto::ring::{ENTRY_FAILED, RingEntry, RingHeader, ring_bytes};
use feedstore_proto::stream::StreamSpec;
use feedstore_proto::{Handle, Location, Role, Status};
use feedstore_shm::{Access, HugePages, Mapping, Segment, SegmentOptions, ShmError};

use crate::objects::{ClientInfo, ConnId, Objects};

/// Largest prefetch depth per rank.
pub const MAX_DEPTH: u32 = 1 << 16;

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
        let map = Mapping::new(fd, segment.size_bytes(), Access::ReadWrite, true)?;
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

#[derive(Debug)]
struct Consumer {
    conn: ConnId,
    ring: Ring,
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
}

impl Rank {
    fn new(start: u64) -> Rank {
        Rank {
            released: start,
            next: start,
            ready: BTreeMap::new(),
            assigned: BTreeMap::new(),
            redo: BTreeSet::new(),
            consumer: None,
            finished: false,
        }
    }

    fn in_flight(&self) -> usize {
        self.ready.len() + self.assigned.len()
    }

    /// The next task of this rank, if its window has room.
    fn next_task(&mut self, conn: ConnId, window_end: u64) -> Option<u64> {
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

    /// Whether the rank needs nothing more: every sample made, and its consumer read past the
    /// last (or returned them all). Until then a consumer resuming from an earlier state may
    /// rewind the rank and need samples made again.
    fn done(&self, end: Option<u64>) -> bool {
        end.is_some_and(|end| self.next >= end && (self.released >= end || self.finished))
            && self.redo.is_empty()
            && self.assigned.is_empty()
    }
}

/// One stream.
#[derive(Debug)]
struct Stream {
    spec: StreamSpec,
    depth: u32,
    /// The stream's own connection in [`Objects`]: its leases keep put samples alive.
    leases: ConnId,
    ranks: BTreeMap<u32, Rank>,
    producers: BTreeSet<ConnId>,
    created: Instant,
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

    fn rank(&mut self, rank: u32, start: u64) -> &mut Rank {
        self.ranks.entry(rank).or_insert_with(|| Rank::new(start))
    }

    /// Returns one sample's lease.
    fn drop_entry(&self, objects: &mut Objects, entry: &RingEntry) {
        if entry.flags & ENTRY_FAILED == 0 {
            let _ = objects.release(self.leases, entry.handle);
        }
    }
}

/// Every stream of the daemon, and the decode-once cache they share.
#[derive(Debug, Default)]
pub struct Streams {
    by_name: HashMap<String, u32>,
    streams: BTreeMap<u32, Stream>,
    next_id: u32,
    /// Decode-once cache: sample key to the object holding that sample. The objects are
    /// ordinary store objects, so eviction (LRU over samples no stream or consumer holds) is
    /// the store's; an entry whose object is gone is dropped when looked up or swept.
    cache: HashMap<u128, Handle>,
    cache_lookups: u64,
    cache_hits: u64,
}

impl Streams {
    fn open(
        &mut self,
        objects: &mut Objects,
        spec: &StreamSpec,
        rank: u32,
        depth: u32,
    ) -> Result<u32, StreamError> {
        spec.check(rank)
            .map_err(|e| fail(Status::InvalidArgument, e.to_string()))?;
        if let Some(&id) = self.by_name.get(&spec.name) {
            let existing = &self.streams[&id].spec;
            if existing != spec {
                return Err(fail(
                    Status::SpecMismatch,
                    format!(
                        "stream {:?} exists with another spec ({existing:?}); close it or pick another name",
                        spec.name
                    ),
                ));
            }
            return Ok(id);
        }
        self.next_id += 1;
        let id = self.next_id;
        let leases = objects.connect(ClientInfo {
            role: Role::Reader,
            uid: 0,
            pid: 0,
            name: format!("stream {}", spec.name),
        });
        self.by_name.insert(spec.name.clone(), id);
        self.streams.insert(
            id,
            Stream {
                spec: spec.clone(),
                depth: depth.clamp(1, MAX_DEPTH),
                leases,
                ranks: BTreeMap::new(),
                producers: BTreeSet::new(),
                created: Instant::now(),
                cold_start: None,
                samples_put: 0,
                samples_returned: 0,
            },
        );
        tracing::info!(stream = %spec.name, id, depth, records = spec.records, world = spec.world, "stream created");
        Ok(id)
    }

    fn stream(&mut self, id: u32) -> Result<&mut Stream, StreamError> {
        self.streams
            .get_mut(&id)
            .ok_or_else(|| fail(Status::NotFound, format!("no stream {id}")))
    }

    /// A producer joins a stream for some ranks; ranks not yet known start where given.
    pub fn join(
        &mut self,
        objects: &mut Objects,
        conn: ConnId,
        spec: &StreamSpec,
        depth: u32,
        ranks: &[StreamTask],
    ) -> Result<u32, StreamError> {
        for r in ranks {
            spec.check(r.rank)
                .map_err(|e| fail(Status::InvalidArgument, e.to_string()))?;
        }
        let id = self.open(objects, spec, 0, depth)?;
        let stream = self.stream(id)?;
        stream.producers.insert(conn);
        for r in ranks {
            stream.rank(r.rank, r.seq);
        }
        Ok(id)
    }

    /// A consumer attaches to `rank` at `seq`: a new ring, holding every sample of the window
    /// still held; the rest of the window is made (again).
    pub fn attach(
        &mut self,
        objects: &mut Objects,
        conn: ConnId,
        spec: &StreamSpec,
        depth: u32,
        rank: u32,
        seq: u64,
    ) -> Result<(u32, &Ring), StreamError> {
        let id = self.open(objects, spec, rank, depth)?;
        let stream = self.stream(id)?;
        if let Some(c) = stream.ranks.get(&rank).and_then(|r| r.consumer.as_ref())
            && c.conn != conn
        {
            return Err(fail(
                Status::InvalidState,
                format!(
                    "rank {rank} of stream {:?} already has a consumer",
                    spec.name
                ),
            ));
        }
        let ring = Ring::new(spec, rank, stream.depth)
            .map_err(|e| fail(Status::Full, format!("cannot create the ring: {e}")))?;
        let depth = u64::from(stream.depth);
        let window_end = seq.saturating_add(depth);
        let leases = stream.leases;
        let r = stream.rank(rank, seq);
        // Keep what lies in the new window; return the rest.
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
        for entry in r.ready.values() {
            ring.publish(entry);
        }
        r.consumer = Some(Consumer { conn, ring });
        tracing::info!(stream = %spec.name, rank, seq, held = r.ready.len(), "consumer attached");
        let ring = &r.consumer.as_ref().expect("just set").ring;
        Ok((id, ring))
    }

    /// Up to `max` tasks for a producer, spread over the ranks that are furthest behind.
    /// `Err(Ended)` when the stream has no work left and never will.
    pub fn take(
        &mut self,
        conn: ConnId,
        id: u32,
        max: u32,
    ) -> Result<Vec<StreamTask>, StreamError> {
        let Some(stream) = self.streams.get_mut(&id) else {
            return Err(fail(Status::Ended, "the stream was closed"));
        };
        if !stream.producers.contains(&conn) {
            return Err(fail(Status::Protocol, "take before joining the stream"));
        }
        let end = stream.end();
        if !stream.ranks.is_empty() && stream.ranks.values().all(|r| r.done(end)) {
            return Err(fail(Status::Ended, "every rank's last epoch is made"));
        }
        let mut order: Vec<u32> = stream.ranks.keys().copied().collect();
        order.sort_by_key(|r| stream.ranks[r].in_flight());
        let mut tasks = Vec::new();
        let mut progress = true;
        while tasks.len() < max as usize && progress {
            progress = false;
            for &rank in &order {
                if tasks.len() == max as usize {
                    break;
                }
                let window_end = stream.window_end(&stream.ranks[&rank]);
                let r = stream.ranks.get_mut(&rank).expect("listed");
                if let Some(seq) = r.next_task(conn, window_end) {
                    tasks.push(StreamTask { rank, seq });
                    progress = true;
                }
            }
        }
        Ok(tasks)
    }

    /// A producer delivers samples. Per item: `Ok`, or why it was not taken (the producer then
    /// aborts its object).
    pub fn put(
        &mut self,
        objects: &mut Objects,
        conn: ConnId,
        id: u32,
        items: &[StreamItem],
    ) -> Result<Vec<Status>, StreamError> {
        let stream = self
            .streams
            .get_mut(&id)
            .ok_or_else(|| fail(Status::Ended, "the stream was closed"))?;
        let leases = stream.leases;
        let mut statuses = Vec::with_capacity(items.len());
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
            if !r.assigned.contains_key(&seq) {
                statuses.push(Status::Stale);
                continue;
            }
            let location = if item.flags & ENTRY_FAILED != 0 {
                Ok(Location {
                    segment: 0,
                    offset: 0,
                    len: 0,
                })
            } else {
                // Seal the producer's reservation (or accept an already sealed object, a cache
                // hit), then lease it for the stream.
                match objects.seal(conn, item.handle) {
                    Ok(()) | Err(Status::InvalidState) => objects.get(leases, item.handle),
                    Err(e) => Err(e),
                }
            };
            r.assigned.remove(&seq);
            let location = match location {
                Ok(l) => l,
                Err(status) => {
                    r.redo.insert(seq);
                    statuses.push(status);
                    continue;
                }
            };
            let entry = RingEntry {
                seq,
                handle: if item.flags & ENTRY_FAILED != 0 {
                    Handle::default()
                } else {
                    item.handle
                },
                location,
                record: item.record,
                flags: item.flags,
            };
            if let Some(c) = &r.consumer {
                c.ring.publish(&entry);
            }
            r.ready.insert(seq, entry);
            if item.key != 0 && entry.flags & ENTRY_FAILED == 0 {
                cached.push((item.key, entry.handle));
            }
            stream.samples_put += 1;
            stream
                .cold_start
                .get_or_insert_with(|| stream.created.elapsed());
            statuses.push(Status::Ok);
        }
        self.cache.extend(cached);
        self.sweep_cache(objects);
        Ok(statuses)
    }

    /// Looks samples up by key: the handle of each one still in the store.
    pub fn lookup(&mut self, objects: &Objects, keys: &[u128]) -> Vec<Option<Handle>> {
        self.cache_lookups += keys.len() as u64;
        keys.iter()
            .map(|key| {
                let handle = *self.cache.get(key)?;
                if objects.is_sealed(handle) {
                    self.cache_hits += 1;
                    Some(handle)
                } else {
                    self.cache.remove(key);
                    None
                }
            })
            .collect()
    }

    /// Drops entries whose objects are gone once the map is much larger than the store's
    /// object count, so it stays bounded by what the store holds.
    fn sweep_cache(&mut self, objects: &Objects) {
        let sealed = objects.stats().objects_sealed as usize;
        if self.cache.len() > 2 * sealed + 1024 {
            self.cache.retain(|_, h| objects.is_sealed(*h));
        }
    }

    /// Adds the streams' and the cache's counters to the store's.
    pub fn add_stats(&self, stats: &mut feedstore_proto::StoreStats) {
        stats.streams = self.streams.len() as u64;
        stats.cache_lookups = self.cache_lookups;
        stats.cache_hits = self.cache_hits;
        stats.cache_entries = self.cache.len() as u64;
    }

    /// A consumer returns every sample below `upto` (up to the first one not yet made).
    pub fn release(
        &mut self,
        objects: &mut Objects,
        conn: ConnId,
        id: u32,
        rank: u32,
        upto: u64,
    ) -> Result<(), StreamError> {
        let stream = self.stream(id)?;
        let Some(r) = stream.ranks.get_mut(&rank) else {
            return Err(fail(Status::NotFound, format!("no rank {rank}")));
        };
        if r.consumer.as_ref().map(|c| c.conn) != Some(conn) {
            return Err(fail(
                Status::Protocol,
                "release by a connection not attached to the rank",
            ));
        }
        let mut returned = Vec::new();
        while r.released < upto {
            let Some(entry) = r.ready.remove(&r.released) else {
                break;
            };
            returned.push(entry);
            r.released += 1;
        }
        stream.samples_returned += returned.len() as u64;
        for entry in &returned {
            stream.drop_entry(objects, entry);
        }
        Ok(())
    }

    /// Whether `seq` of `rank` is in its ring (`Ok`), will never be (`Ended`), or not yet
    /// (`None`).
    pub fn poll(&self, id: u32, rank: u32, seq: u64) -> Option<Status> {
        let Some(stream) = self.streams.get(&id) else {
            return Some(Status::Ended);
        };
        if stream.end().is_some_and(|end| seq >= end) {
            return Some(Status::Ended);
        }
        let r = stream.ranks.get(&rank)?;
        r.ready.contains_key(&seq).then_some(Status::Ok)
    }

    /// The consumer on `conn` asks for `seq` of `rank`: if that is past the rank's last sample,
    /// it has read its whole share, and producers need not wait for it to return them before
    /// they stop. Returns whether this newly finished the rank.
    pub fn finish(&mut self, conn: ConnId, id: u32, rank: u32, seq: u64) -> bool {
        let Some(stream) = self.streams.get_mut(&id) else {
            return false;
        };
        if stream.end().is_none_or(|end| seq < end) {
            return false;
        }
        let Some(r) = stream.ranks.get_mut(&rank) else {
            return false;
        };
        let newly = !r.finished && r.consumer.as_ref().is_some_and(|c| c.conn == conn);
        r.finished |= newly;
        newly
    }

    /// Closes a stream: returns its samples and retires its rings.
    pub fn close(&mut self, objects: &mut Objects, id: u32) -> Result<(), StreamError> {
        let stream = self
            .streams
            .remove(&id)
            .ok_or_else(|| fail(Status::NotFound, format!("no stream {id}")))?;
        self.by_name.remove(&stream.spec.name);
        objects.disconnect(stream.leases);
        tracing::info!(stream = %stream.spec.name, "stream closed");
        Ok(())
    }

    /// A connection went away: its tasks go back to their windows, its rings are retired.
    pub fn disconnect(&mut self, conn: ConnId) {
        for stream in self.streams.values_mut() {
            stream.producers.remove(&conn);
            for r in stream.ranks.values_mut() {
                let lost: Vec<u64> = r
                    .assigned
                    .iter()
                    .filter(|&(_, &c)| c == conn)
                    .map(|(&s, _)| s)
                    .collect();
                for s in lost {
                    r.assigned.remove(&s);
                    r.redo.insert(s);
                }
                if r.consumer.as_ref().is_some_and(|c| c.conn == conn) {
                    r.consumer = None;
                }
            }
        }
    }

    /// Every stream, for `feedstore stat`.
    pub fn list(&self) -> Vec<StreamInfo> {
        self.streams
            .values()
            .map(|s| StreamInfo {
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
            })
            .collect()
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

    fn setup() -> (Objects, Streams, ConnId, ConnId) {
        let mut o = Objects::new(1, 1, &[1 << 20], false);
        let info = |role| ClientInfo {
            role,
            uid: 0,
            pid: 0,
            name: String::new(),
        };
        let producer = o.connect(info(Role::Writer));
        let consumer = o.connect(info(Role::Reader));
        (o, Streams::default(), producer, consumer)
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
        }
    }

    #[test]
    fn windows_bound_the_work_and_slide_on_release() {
        let (mut o, mut s, p, c) = setup();
        let id = s.join(&mut o, p, &spec(1), 2, &starts(&[0, 1])).unwrap();
        let tasks = s.take(p, id, 100).unwrap();
        assert_eq!(tasks.len(), 4, "depth 2 × 2 ranks: {tasks:?}");
        assert!(s.take(p, id, 100).unwrap().is_empty(), "windows full");
        let items: Vec<_> = tasks.iter().map(|&t| make(&mut o, p, t)).collect();
        assert_eq!(s.put(&mut o, p, id, &items).unwrap(), vec![Status::Ok; 4]);
        assert_eq!(o.stats().objects_sealed, 4);
        let (_, ring) = s.attach(&mut o, c, &spec(1), 2, 0, 0).unwrap();
        assert!(ring.size_bytes() > 0);
        assert_eq!(s.poll(id, 0, 0), Some(Status::Ok));
        assert_eq!(s.poll(id, 0, 2), None);
        s.release(&mut o, c, id, 0, 1).unwrap();
        assert_eq!(
            s.take(p, id, 100).unwrap(),
            vec![StreamTask { rank: 0, seq: 2 }]
        );
        assert_eq!(o.stats().leases, 3, "the returned sample's lease is gone");
    }

    #[test]
    fn a_dead_producers_tasks_are_made_again() {
        let (mut o, mut s, p, _) = setup();
        let id = s.join(&mut o, p, &spec(1), 2, &starts(&[0])).unwrap();
        let first = s.take(p, id, 1).unwrap();
        s.disconnect(p);
        let p2 = o.connect(ClientInfo {
            role: Role::Writer,
            uid: 0,
            pid: 0,
            name: String::new(),
        });
        s.join(&mut o, p2, &spec(1), 2, &starts(&[0])).unwrap();
        let again = s.take(p2, id, 2).unwrap();
        assert_eq!(again[0], first[0], "redo first");
        let item = make(&mut o, p2, first[0]);
        assert_eq!(s.put(&mut o, p2, id, &[item]).unwrap(), vec![Status::Ok]);
        let twice = make(&mut o, p2, first[0]);
        assert_eq!(
            s.put(&mut o, p2, id, &[twice]).unwrap(),
            vec![Status::Stale],
            "put once"
        );
    }

    #[test]
    fn attach_rewinds_and_keeps_what_it_can() {
        let (mut o, mut s, p, c) = setup();
        let id = s.join(&mut o, p, &spec(2), 4, &starts(&[0])).unwrap();
        let tasks = s.take(p, id, 4).unwrap();
        let items: Vec<_> = tasks.iter().map(|&t| make(&mut o, p, t)).collect();
        s.put(&mut o, p, id, &items).unwrap();
        s.attach(&mut o, c, &spec(2), 4, 0, 0).unwrap();
        s.release(&mut o, c, id, 0, 3).unwrap();
        s.disconnect(c);
        // The checkpoint said 1: 1 and 2 were returned, 3 is still held.
        let c2 = o.connect(ClientInfo {
            role: Role::Reader,
            uid: 0,
            pid: 0,
            name: String::new(),
        });
        s.attach(&mut o, c2, &spec(2), 4, 0, 1).unwrap();
        assert_eq!(s.poll(id, 0, 3), Some(Status::Ok), "kept");
        assert_eq!(s.poll(id, 0, 1), None, "to be made again");
        let again = s.take(p, id, 10).unwrap();
        let seqs: Vec<u64> = again.iter().map(|t| t.seq).collect();
        assert_eq!(seqs, vec![1, 2, 4]);
    }

    #[test]
    fn a_finished_stream_ends_and_a_close_returns_everything() {
        let (mut o, mut s, p, c) = setup();
        let id = s.join(&mut o, p, &spec(1), 8, &starts(&[0])).unwrap();
        let tasks = s.take(p, id, 100).unwrap();
        assert_eq!(tasks.len(), 4, "one epoch of 8 records over 2 ranks");
        let items: Vec<_> = tasks.iter().map(|&t| make(&mut o, p, t)).collect();
        s.put(&mut o, p, id, &items).unwrap();
        assert_eq!(s.poll(id, 0, 4), Some(Status::Ended));
        assert!(
            s.take(p, id, 1).unwrap().is_empty(),
            "made but not read: a resuming consumer may still rewind"
        );
        s.attach(&mut o, c, &spec(1), 8, 0, 0).unwrap();
        assert!(!s.finish(c, id, 0, 3), "not past the end");
        assert!(
            s.finish(c, id, 0, 4),
            "read past the end, holding its samples"
        );
        assert_eq!(s.take(p, id, 1).unwrap_err().status, Status::Ended);
        let other = StreamSpec { seed: 2, ..spec(1) };
        assert_eq!(
            s.attach(&mut o, c, &other, 8, 0, 0).unwrap_err().status,
            Status::SpecMismatch
        );
        s.close(&mut o, id).unwrap();
        assert_eq!(o.stats().leases, 0);
    }

    #[test]
    fn the_cache_finds_samples_still_stored() {
        let (mut o, mut s, p, _) = setup();
        let id = s.join(&mut o, p, &spec(1), 8, &starts(&[0])).unwrap();
        let tasks = s.take(p, id, 2).unwrap();
        let items: Vec<_> = tasks.iter().map(|&t| make(&mut o, p, t)).collect();
        s.put(&mut o, p, id, &items).unwrap();
        let found = s.lookup(&o, &[1, 2, 99]);
        assert_eq!(
            found,
            vec![Some(items[0].handle), Some(items[1].handle), None]
        );
        s.close(&mut o, id).unwrap();
        o.delete(p, items[0].handle).unwrap();
        assert_eq!(
            s.lookup(&o, &[1, 2]),
            vec![None, Some(items[1].handle)],
            "gone once deleted"
        );
        let mut stats = o.stats();
        s.add_stats(&mut stats);
        assert_eq!(
            (stats.cache_lookups, stats.cache_hits, stats.cache_entries),
            (5, 3, 1)
        );
    }
}
