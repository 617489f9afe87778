//! A consumer's delivery ring and what the daemon keeps of the consumer attached to it: the
//! entries published to it with a lease of its own, and the figures it reports.

use std::collections::BTreeMap;
use std::os::fd::OwnedFd;
use std::time::{Duration, Instant};

use feedstore_proto::Handle;
use feedstore_proto::frame::RankFigures;
use feedstore_proto::ring::{ENTRY_FAILED, RingEntry, RingHeader, ring_bytes};
use feedstore_proto::stream::StreamSpec;
use feedstore_shm::{Access, HugePages, Mapping, Segment, SegmentOptions, ShmError};

use crate::objects::{ConnId, Objects};

/// A consumer's ring: shared memory the daemon writes and the consumer maps read-only.
#[derive(Debug)]
pub struct Ring {
    segment: Segment,
    map: Mapping,
    header: RingHeader,
}

impl Ring {
    pub(super) fn new(spec: &StreamSpec, rank: u32, capacity: u32) -> Result<Ring, ShmError> {
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

    pub(super) fn publish(&self, entry: &RingEntry) {
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
pub(super) fn ring_size(capacity: u32) -> u64 {
    (ring_bytes(capacity) as u64).next_multiple_of(4096)
}

/// Ring entries published to one consumer connection with a lease of that connection's, not yet
/// known to be read.
#[derive(Debug, Default)]
pub(super) struct Published(pub(super) BTreeMap<u64, Handle>);

impl Published {
    /// The consumer has read everything below `seq`: those leases belong to its samples now.
    pub(super) fn read_below(&mut self, seq: u64) {
        self.0 = self.0.split_off(&seq);
    }

    /// Returns the leases of the entries at or after `next`, which the consumer never read.
    pub(super) fn release_unread(self, objects: &mut Objects, conn: ConnId, next: u64) -> u64 {
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
pub(super) struct Consumer {
    pub(super) conn: ConnId,
    pub(super) ring: Ring,
    pub(super) published: Published,
    /// What the consumer last reported of its reading (with its returns), and when.
    pub(super) figures: RankFigures,
    pub(super) reported_at: Option<Instant>,
    /// Since when it has been waiting for a sample not yet ready (a `StreamWait` found it
    /// missing, and none has found it since): a rank starving now shows as waiting before its
    /// consumer's next report says so.
    pub(super) waiting_since: Option<Instant>,
    /// The sequence number it waits for: the wait ends when that entry is published into its
    /// ring (whether or not a `StreamWait` is there to see it: a client waiting in slices may
    /// find it in the ring without asking again).
    pub(super) waiting_for: Option<u64>,
    /// Waits the daemon saw end since the last report (the next report includes them).
    pub(super) waited_unreported: Duration,
    /// When the daemon first saw it wait, for a consumer that has not reported yet.
    pub(super) first_wait: Option<Instant>,
    /// The highest (waited, elapsed) microseconds shown so far: what is shown never goes back
    /// (a report can say a little less than the daemon's estimate before it), so the metrics'
    /// counters only grow.
    pub(super) shown: std::cell::Cell<(u64, u64)>,
}

impl Consumer {
    /// A consumer on `conn` reading through `ring`, nothing published or reported yet.
    pub(super) fn new(conn: ConnId, ring: Ring) -> Consumer {
        Consumer {
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
        }
    }

    /// Its figures as of now: the last report, plus what the daemon has seen since (waits that
    /// ended, a wait under way) and the time up to now, never less than what was shown before.
    /// Time since its last report that the daemon did not see it wait counts as the trainer's
    /// own work (a long step between reports reads as computing, not as still waiting); its
    /// next report corrects the estimate with what the consumer measured (a wait the daemon
    /// could not see, such as one inside the consumer, raises the waited time then). A rank
    /// that has read its whole share (`finished`) has stopped its clock (its consumer's too:
    /// its reports after the end say the same time): no run time counts past its last report.
    pub(super) fn figures_now(&self, now: Instant, finished: bool) -> RankFigures {
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
    pub(super) fn polled(&mut self, seq: u64, ready: bool, now: Instant) {
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
    pub(super) fn wait_ended(&mut self, now: Instant) {
        if let Some(since) = self.waiting_since.take() {
            self.waited_unreported += now - since;
        }
        self.waiting_for = None;
    }
}

impl Consumer {
    /// Gives the consumer's connection its own lease on the entry's object (shared from the
    /// stream's), then publishes the entry into its ring.
    pub(super) fn publish(
        &mut self,
        objects: &mut Objects,
        stream_leases: ConnId,
        entry: &RingEntry,
    ) {
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
