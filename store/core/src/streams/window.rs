//! One rank's window, and the hand-off through it: producers take tasks inside the window and
//! put samples back; the rank's consumer waits for them, reads them from its ring and returns
//! them, which slides the window.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use feedstore_proto::frame::{Got, RankFigures, StreamItem, StreamTask};
use feedstore_proto::ring::{ENTRY_FAILED, RingEntry};
use feedstore_proto::{Handle, Location, Status};

use super::ring::Consumer;
use super::{Stream, StreamError, Streams, fail};
use crate::objects::{ConnId, Objects};
/// What a put's item refers to, leased for the stream (`leases`): the producer's reservation
/// sealed (or an object already sealed, a cache hit), at the item's offset within it; nothing
/// for a failed sample.
fn claim(
    objects: &mut Objects,
    conn: ConnId,
    leases: ConnId,
    item: &StreamItem,
) -> Result<Got, Status> {
    if item.flags & ENTRY_FAILED != 0 {
        return Ok(Got {
            location: Location {
                segment: 0,
                offset: 0,
                len: 0,
            },
            writer: 0,
        });
    }
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
}

/// The part of an object from `offset` to its end, where a sample of a batch starts: a
/// multiple of 64 (what a sample's alignment needs) inside the object. `None` otherwise.
pub(super) fn within(l: Location, offset: u64) -> Option<Location> {
    (offset.is_multiple_of(64) && offset < l.len.max(1)).then(|| Location {
        segment: l.segment,
        offset: l.offset + offset,
        len: l.len - offset,
    })
}

/// One rank's window.
#[derive(Debug)]
pub(super) struct Rank {
    /// Every sequence number below this was returned by the consumer.
    pub(super) released: u64,
    /// The lowest sequence number never handed to a producer.
    pub(super) next: u64,
    /// Made and leased by the stream, not yet returned.
    pub(super) ready: BTreeMap<u64, RingEntry>,
    /// At a producer.
    pub(super) assigned: BTreeMap<u64, ConnId>,
    /// Inside the window, to be handed out again (its producer died, or a resume rewound).
    pub(super) redo: BTreeSet<u64>,
    pub(super) consumer: Option<Consumer>,
    /// The consumer read past the rank's last sample (it may still hold some).
    pub(super) finished: bool,
    /// The node whose daemon owns the rank (its consumer's), when it is not this one: its
    /// window lives there, and `redo` holds the tasks that daemon granted to this node's
    /// producers.
    pub(super) owner: Option<u32>,
}

impl Rank {
    /// A consumer (re)starts reading at `seq` with a window of `depth`: what lies in the new
    /// window is kept; the stream's leases (`leases`) on the rest go back (views a previous
    /// consumer still holds have leases of their own); samples made and lost below the
    /// window's end are made again.
    pub(super) fn restart_at(
        &mut self,
        objects: &mut Objects,
        leases: ConnId,
        seq: u64,
        depth: u64,
    ) {
        let window_end = seq.saturating_add(depth);
        let outside: Vec<u64> = self
            .ready
            .keys()
            .copied()
            .filter(|&s| s < seq || s >= window_end)
            .collect();
        for s in outside {
            let entry = self.ready.remove(&s).expect("listed");
            if entry.flags & ENTRY_FAILED == 0 {
                let _ = objects.release(leases, entry.handle);
            }
        }
        self.assigned.retain(|&s, _| s >= seq && s < window_end);
        self.redo.retain(|&s| s >= seq && s < window_end);
        let made_up_to = self.next.clamp(seq, window_end);
        for s in seq..made_up_to {
            if !self.ready.contains_key(&s) && !self.assigned.contains_key(&s) {
                self.redo.insert(s);
            }
        }
        self.released = seq;
        self.finished = false;
        self.next = made_up_to;
    }

    pub(super) fn new(start: u64, owner: Option<u32>) -> Rank {
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

    pub(super) fn in_flight(&self) -> usize {
        self.ready.len() + self.assigned.len()
    }

    /// The next task of this rank, if its window has room (of another node's rank: the next
    /// task its daemon granted).
    pub(super) fn next_task(&mut self, conn: ConnId, window_end: u64) -> Option<u64> {
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
    pub(super) fn next_batch(
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
    pub(super) fn done(&self, end: Option<u64>) -> bool {
        end.is_some_and(|end| self.next >= end && (self.released >= end || self.finished))
            && self.redo.is_empty()
            && self.assigned.is_empty()
    }
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

impl Streams {
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
        if serving.peek().is_some() && serving.all(|(&k, r)| stream.rank_done(k, r)) {
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
                    let window_end = stream.window_end(rank, &stream.ranks[&rank]);
                    let end = stream.end(rank);
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
            let got = claim(objects, conn, leases, item);
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
        if stream.end(rank).is_some_and(|end| seq >= end) {
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
        if stream.end(rank).is_none_or(|end| seq < end) {
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

    /// The consumer attached to `rank` on `conn`, or why a request from `conn` about it is
    /// refused.
    pub(super) fn consumer_of<'a>(
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
}
