//! Handing the object table to a successor daemon and taking it over
//! ([`feedstore_proto::handover`]).

use std::collections::HashMap;

use feedstore_proto::Role;
use feedstore_proto::handover::{HANDOVER_FORMAT, HandedObject, Handover};

use super::{ClientInfo, ConnId, Ids, Object, Objects, State};
use crate::alloc::{Allocator, Block};

/// Why a hand-over cannot be taken over: it contradicts itself (never the case between two
/// daemons of one build; refused rather than trusted).
#[derive(Debug, thiserror::Error)]
#[error("the hand-over is inconsistent: {0}")]
pub struct Inconsistent(String);

impl Objects {
    /// This table as a successor takes it over: every live object with the leases and
    /// reservations of each client process, by pid. What the daemon's own connections hold
    /// (streams' samples, pulls being written) is not handed over: a stream is set up again
    /// by its clients on the successor, a pull is made again.
    pub fn hand_over(&self, peer_listener: bool, metrics_listener: bool) -> Handover {
        let client = |conn: &ConnId| {
            self.conns
                .get(conn)
                .is_some_and(|c| !c.info.internal || self.orphans.get(&c.info.pid) == Some(conn))
        };
        let mut leases: HashMap<u32, HashMap<i32, u32>> = HashMap::new();
        for (id, c) in &self.conns {
            if !client(id) {
                continue;
            }
            for (&slot, &n) in &c.leases {
                *leases
                    .entry(slot)
                    .or_default()
                    .entry(c.info.pid)
                    .or_default() += n;
            }
        }
        // Evictable objects first, in the order they would go; then the rest.
        let order = self
            .lru
            .values()
            .copied()
            .chain((0..self.slots.len() as u32).filter(|&s| {
                self.slots[s as usize]
                    .as_ref()
                    .is_some_and(|o| o.lru_tick.is_none())
            }));
        let mut objects = Vec::with_capacity(self.by_id.len());
        for slot in order {
            let o = self.slots[slot as usize].as_ref().expect("a live slot");
            let writer_pid = match o.state {
                State::Sealed => None,
                State::Writing { owner } if client(&owner) => Some(self.conns[&owner].info.pid),
                State::Writing { .. } => continue,
            };
            let mut held: Vec<(i32, u32)> = leases
                .remove(&slot)
                .map(|m| m.into_iter().collect())
                .unwrap_or_default();
            held.sort_unstable();
            if o.delete_pending && held.is_empty() {
                // Deleted, and held only by the daemon's own connections (not handed over):
                // nobody can find or hold it any more.
                continue;
            }
            objects.push(HandedObject {
                id: o.id,
                segment: o.segment,
                offset: o.block.offset,
                reserved: o.block.len,
                len: o.len,
                writer_pid,
                pinned: o.pinned,
                delete_pending: o.delete_pending,
                origin: o.origin,
                creator: o.creator,
                leases: held,
            });
        }
        Handover {
            format: HANDOVER_FORMAT,
            pid: std::process::id(),
            node_id: self.node_id,
            epoch: self.epoch,
            id_key: self.ids.key,
            id_counter: self.ids.counter,
            segments: self.segments.iter().map(Allocator::capacity).collect(),
            hugetlb: self.hugetlb,
            peer_listener,
            metrics_listener,
            objects,
        }
    }

    /// The table a predecessor handed over, on the same memory: the same handles, each client
    /// process's leases and reservations held for it by a connection of the daemon's own (see
    /// [`Objects::orphans`]), which its new connections return, seal and abort through, and
    /// which is dropped when the process is gone. Checked first: every object lies in its
    /// segment, apart from every other.
    pub fn take_over(h: &Handover) -> Result<Objects, Inconsistent> {
        let mut o = Objects::new(h.node_id, h.epoch, &h.segments, h.hugetlb);
        o.ids = Ids::resume(&h.id_key, h.id_counter);
        for handed in &h.objects {
            o.adopt(handed)?;
        }
        Ok(o)
    }

    fn adopt(&mut self, h: &HandedObject) -> Result<(), Inconsistent> {
        let bad = |why: &str| Inconsistent(format!("object {:016x}: {why}", h.id));
        let block = Block {
            offset: h.offset,
            len: h.reserved,
        };
        if h.len == 0 || Allocator::reserved_len(h.len) != Some(h.reserved) {
            return Err(bad("its length and its block disagree"));
        }
        if h.id == 0 || self.by_id.contains_key(&h.id) {
            return Err(bad("its id is 0 or taken"));
        }
        let segment = self
            .segments
            .get_mut(h.segment as usize)
            .ok_or_else(|| bad("no such segment"))?;
        if !segment.claim(block) {
            return Err(bad("its block is outside its segment or overlaps another"));
        }
        let slot = self.slots.len() as u32;
        let state = match h.writer_pid {
            None => State::Sealed,
            Some(pid) => {
                let owner = self.orphan(pid);
                self.conns
                    .get_mut(&owner)
                    .expect("just made")
                    .writing
                    .insert(slot);
                State::Writing { owner }
            }
        };
        let mut leases = 0u32;
        for &(pid, n) in &h.leases {
            let owner = self.orphan(pid);
            let c = self.conns.get_mut(&owner).expect("just made");
            *c.leases.entry(slot).or_insert(0) += n;
            c.lease_count += u64::from(n);
            leases = leases
                .checked_add(n)
                .ok_or_else(|| bad("too many leases"))?;
        }
        if let Some(origin) = h.origin
            && self.copies.insert(origin, slot).is_some()
        {
            return Err(bad("a second copy of one remote object"));
        }
        self.slots.push(Some(Object {
            id: h.id,
            segment: h.segment,
            block,
            len: h.len,
            state,
            leases,
            pinned: h.pinned,
            delete_pending: h.delete_pending,
            lru_tick: None,
            origin: h.origin,
            creator: h.creator,
        }));
        self.by_id.insert(h.id, slot);
        self.touch(slot);
        Ok(())
    }

    /// The connection holding what process `pid` held on the predecessor.
    fn orphan(&mut self, pid: i32) -> ConnId {
        if let Some(&conn) = self.orphans.get(&pid) {
            return conn;
        }
        let conn = self.connect(ClientInfo {
            role: Role::Writer,
            uid: 0,
            pid,
            name: format!("held for pid {pid} since the hand-over"),
            internal: true,
            capped: false,
        });
        self.orphans.insert(pid, conn);
        conn
    }

    /// The connection holding what the process behind `conn` held on the predecessor, if any
    /// (never for a process in another pid namespace: its pid reads 0).
    pub(super) fn orphan_of(&self, conn: ConnId) -> Option<ConnId> {
        let pid = self.conns.get(&conn)?.info.pid;
        (pid != 0)
            .then(|| self.orphans.get(&pid).copied())
            .flatten()
            .filter(|&o| o != conn)
    }

    /// The processes something is held for since the hand-over, with the connection holding
    /// it: the daemon drops it ([`Objects::disconnect`]) once the process is gone.
    pub fn orphans(&self) -> Vec<(i32, ConnId)> {
        self.orphans
            .iter()
            .map(|(&pid, &conn)| (pid, conn))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use feedstore_proto::Status;

    use super::*;

    fn client(o: &mut Objects, role: Role, pid: i32, internal: bool) -> ConnId {
        o.connect(ClientInfo {
            role,
            uid: 1000,
            pid,
            name: format!("pid {pid}"),
            internal,
            capped: false,
        })
    }

    /// A successor serves the same handles on the same memory: each process's leases and
    /// reservations are its own again (only its), a stream's are not handed over, ids go on.
    #[test]
    fn a_successor_serves_the_same_objects_and_each_process_finds_what_it_held() {
        let mut o = Objects::new(7, 99, &[1 << 20, 1 << 20], false);
        let w = client(&mut o, Role::Writer, 10, false);
        let r = client(&mut o, Role::Reader, 20, false);
        let stream = client(&mut o, Role::Reader, 0, true);
        let put = |o: &mut Objects, size| {
            let c = o.create(w, size, false).unwrap();
            o.seal(w, c.handle).unwrap();
            c.handle
        };
        let (a, b, evictable) = (put(&mut o, 1000), put(&mut o, 3000), put(&mut o, 10));
        let writing = o.create(w, 500, false).unwrap().handle;
        o.get(r, a).unwrap();
        o.get(r, a).unwrap();
        o.delete(w, a).unwrap(); // pending: leased
        o.get(stream, b).unwrap();
        let before = o.stats();

        let h = o.hand_over(true, false);
        assert_eq!(h.objects.len(), 4);
        assert_eq!(
            h.objects[0].id, evictable.id,
            "evictable first, in LRU order"
        );
        let mut n =
            Objects::take_over(&feedstore_proto::handover::Handover::decode(&h.encode()).unwrap())
                .unwrap();
        let after = n.stats();
        assert_eq!(after.used_bytes, before.used_bytes);
        assert_eq!(after.objects_writing, 1);
        assert_eq!(after.objects_delete_pending, 1);
        assert_eq!(
            after.leases, 2,
            "the reader's two; the stream's are not handed over"
        );
        assert_eq!(after.clients, 0, "what is held for processes is no client");

        // The reader's process, on a new connection, returns its leases; the deleted object
        // goes with the last.
        let r2 = client(&mut n, Role::Reader, 20, false);
        let other = client(&mut n, Role::Writer, 30, false);
        assert_eq!(
            n.release(other, a),
            Err(Status::InvalidState),
            "another process's lease"
        );
        n.release(r2, a).unwrap();
        n.release(r2, a).unwrap();
        assert_eq!(
            n.release(r2, a),
            Err(Status::NotFound),
            "freed with its last lease"
        );
        assert_eq!(n.get(r2, b).unwrap().len, 3000);
        // Only the writer's process seals its reservation.
        assert_eq!(n.seal(other, writing), Err(Status::NotOwner));
        let w2 = client(&mut n, Role::Writer, 10, false);
        n.seal(w2, writing).unwrap();
        assert_eq!(n.get(r2, writing).unwrap().len, 500);
        // Ids go on where the predecessor stopped: no handle repeats.
        let fresh = n.create(w2, 10, false).unwrap().handle;
        assert!(![a, b, evictable, writing].contains(&fresh));
        assert_eq!((fresh.node_id, fresh.epoch), (7, 99));
    }

    /// What a process held is dropped when it is gone: its reservations aborted, its leases
    /// returned.
    #[test]
    fn what_a_gone_process_held_is_dropped() {
        let mut o = Objects::new(1, 2, &[1 << 20], false);
        let w = client(&mut o, Role::Writer, 10, false);
        let c = o.create(w, 100, false).unwrap();
        let sealed = o.create(w, 100, false).unwrap().handle;
        o.seal(w, sealed).unwrap();
        o.get(w, sealed).unwrap();
        let mut n = Objects::take_over(&o.hand_over(false, false)).unwrap();
        let orphans = n.orphans();
        assert_eq!(orphans.len(), 1);
        assert_eq!(orphans[0].0, 10);
        let reclaimed = n.disconnect(orphans[0].1);
        assert_eq!((reclaimed.aborted, reclaimed.leases), (1, 1));
        assert!(n.orphans().is_empty());
        let s = n.stats();
        assert_eq!((s.objects_writing, s.leases, s.objects_sealed), (0, 0, 1));
        let w2 = client(&mut n, Role::Writer, 10, false);
        assert_eq!(n.seal(w2, c.handle), Err(Status::NotFound));
    }

    /// A hand-over that contradicts itself is refused, not trusted.
    #[test]
    fn an_inconsistent_hand_over_is_refused() {
        let mut o = Objects::new(1, 2, &[1 << 20], false);
        let w = client(&mut o, Role::Writer, 10, false);
        let a = o.create(w, 100, false).unwrap().handle;
        o.seal(w, a).unwrap();
        let good = o.hand_over(false, false);
        let mut overlapping = good.clone();
        let mut twin = overlapping.objects[0].clone();
        twin.id += 1;
        overlapping.objects.push(twin);
        let mut outside = good.clone();
        outside.objects[0].offset = 1 << 20;
        let mut wrong_len = good.clone();
        wrong_len.objects[0].len = 1 << 19;
        let mut same_id = good.clone();
        let mut second = same_id.objects[0].clone();
        second.offset += second.reserved;
        same_id.objects.push(second);
        for bad in [overlapping, outside, wrong_len, same_id] {
            assert!(Objects::take_over(&bad).is_err(), "{bad:?}");
        }
        assert!(Objects::take_over(&good).is_ok());
    }
}
