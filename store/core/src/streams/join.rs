//! Who takes part in a stream: producers join it (the first creates it), consumers attach to a
//! rank and detach.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Instant;

use feedstore_proto::frame::{ProducerFigures, StreamTask};
use feedstore_proto::stream::StreamSpec;
use feedstore_proto::{Role, Status};

use super::remote::{Placement, Remote};
use super::ring::{Consumer, Ring, ring_size};
use super::window::{Rank, Window};
use super::{
    MAX_BATCH, MAX_DEPTH, MAX_RANKS, MAX_RINGS_PER_CONNECTION, Stream, StreamError, Streams, fail,
};
use crate::format_bytes;
use crate::objects::{ClientInfo, ConnId, Objects};

impl Streams {
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
        if let Some((id, differences)) = self.stale(uid, spec) {
            tracing::info!(stream = ?spec.name, %differences, "an idle stream gives way to a producer of another spec");
            self.remove(objects, id, "replaced");
        }
        let existing = self.find(uid, spec)?;
        // Another node's session and a producer's put-only connections (no ranks) say nothing
        // about relays; this node's producers that name ranks must agree.
        let session = self.sessions.contains(&conn) || ranks.is_empty();
        if let Some(id) = existing {
            self.agrees(id, &spec.name, ranks, placement, session)?;
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

    /// Whether a producer joining stream `id` (named `name`) with `ranks` placed as `placement`
    /// agrees with its other producers: each rank served from the same node, and (unless it is
    /// a `session` that says nothing of relays) the same relay.
    fn agrees(
        &self,
        id: u32,
        name: &str,
        ranks: &[StreamTask],
        placement: &Placement,
        session: bool,
    ) -> Result<(), StreamError> {
        let owners = &placement.owners;
        // A rank lives on one node: every producer must say the same.
        for (rank, r) in &self.streams[&id].ranks {
            let said = owners.get(rank).copied();
            let listed = ranks.iter().any(|t| t.rank == *rank);
            if listed && said != r.owner {
                let place =
                    |o: Option<u32>| o.map_or("this node".to_string(), |n| format!("node {n:08x}"));
                return Err(fail(
                    Status::InvalidArgument,
                    format!(
                        "rank {rank} of stream {:?} is served from {}, not {} (--ranks-at \
                             must agree on every node)",
                        name,
                        place(r.owner),
                        place(said)
                    ),
                ));
            }
        }
        if !session
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
                    name, self.streams[&id].relay, placement.relay
                ),
            ));
        }
        Ok(())
    }

    /// Refuses `n` more ranks past [`MAX_RANKS`].
    pub(super) fn room_for_ranks(&mut self, n: usize) -> Result<(), StreamError> {
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

    pub(super) fn create(
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
            process: crate::objects::Process::default(),
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
        if let Some((_, differences)) = self.stale(uid, spec) {
            // (A producer of this spec replaces it: wait for one.)
            return Err(fail(
                Status::NotFound,
                format!(
                    "stream {:?} of uid {uid} has another spec and nobody uses it ({differences}): \
                     waiting for a producer of this spec to replace it",
                    spec.name
                ),
            ));
        }
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
        let new_rank = self.may_attach(conn, id, &spec.name, rank)?;
        let stream = self.streams.get_mut(&id).expect("found above");
        let ring = Ring::new(spec, rank, stream.depth)
            .map_err(|e| fail(Status::Full, format!("cannot create the ring: {e}")))?;
        let ring_size = ring.size_bytes();
        let depth = u64::from(stream.depth);
        let leases = stream.leases;
        stream.last_used = Instant::now();
        let r = stream.rank(rank, seq);
        r.restart_at(objects, leases, seq, depth);
        let mut consumer = Consumer::new(conn, ring);
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

    /// Whether `conn` may attach to `rank` of stream `id` (named `name`): the connection not
    /// attached yet and under its count of rings, the rank served here and free, room for its
    /// ring and, for a rank new to the stream, for the rank. Whether the rank is new.
    fn may_attach(
        &mut self,
        conn: ConnId,
        id: u32,
        name: &str,
        rank: u32,
    ) -> Result<bool, StreamError> {
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
                    name
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
                    format!("rank {rank} of stream {:?} already has a consumer", name),
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
        Ok(new_rank)
    }

    /// A consumer detaches from its rank, having read everything below `next`: the leases its
    /// connection got for entries it never read go back, the rank is finished if that was all
    /// of it, and the rank is free for another consumer.
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
        // Leaving with its whole share read is finishing it, as asking past the end is: the
        // producers need not wait for the samples it still holds to come back.
        self.finish(conn, id, rank, next);
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
}
