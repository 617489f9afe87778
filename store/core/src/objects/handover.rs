//! Handing the object table to a successor daemon and taking it over
//! ([`feedstore_proto::handover`]).

use std::collections::{BTreeMap, HashMap};
use std::os::fd::OwnedFd;
use std::sync::Arc;

use feedstore_proto::Role;
use feedstore_proto::handover::{
    HANDOVER_FORMAT, HandedObject, HandedProcess, Handover, PID_KEY, UNNAMED_KEY,
};

use super::{ClientInfo, ConnId, Ids, Object, Objects, Process, State};
use crate::alloc::{Allocator, Block};

/// Why a hand-over cannot be taken over: it contradicts itself (never the case between two
/// daemons of one build; refused rather than trusted).
#[derive(Debug, thiserror::Error)]
#[error("the hand-over is inconsistent: {0}")]
pub struct Inconsistent(pub(super) String);

impl Objects {
    /// This table as a successor takes it over: every live object with the leases and
    /// reservations of each client process, by process key, and the pidfds of those processes
    /// (to pass beside it, in [`Handover::processes`] order). What the daemon's own
    /// connections hold (streams' samples, pulls being written) is not handed over: a stream is
    /// set up again by its clients on the successor, a pull is made again.
    pub fn hand_over(
        &self,
        peer_listener: bool,
        metrics_listener: bool,
    ) -> (Handover, Vec<Arc<OwnedFd>>) {
        let mut leases: HashMap<u32, HashMap<u64, u32>> = HashMap::new();
        let mut processes: BTreeMap<u64, (i32, Option<Arc<OwnedFd>>)> = BTreeMap::new();
        for (id, c) in &self.conns {
            let Some(super::ledger::Holder { key, .. }) = self.process_key(*id, c) else {
                continue;
            };
            if key != 0 && (!c.leases.is_empty() || !c.writing.is_empty()) {
                let known = processes.entry(key).or_insert((c.info.pid, None));
                if known.1.is_none() {
                    known.1 = c.info.process.pidfd.clone();
                }
            }
            for (&slot, &n) in &c.leases {
                *leases.entry(slot).or_default().entry(key).or_default() += n;
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
            // (None: being written by the daemon's own connection, a pull.)
            let Some(record) = self.record(slot) else {
                continue;
            };
            let mut held: Vec<(u64, u32)> = leases
                .remove(&slot)
                .map(|m| m.into_iter().collect())
                .unwrap_or_default();
            held.sort_unstable();
            if record.delete_pending && held.is_empty() {
                // Deleted, and held only by the daemon's own connections (not handed over):
                // nobody can find or hold it any more.
                continue;
            }
            objects.push(record.handed(held));
        }
        let mut pidfds = Vec::new();
        let processes = processes
            .into_iter()
            .map(|(key, (pid, pidfd))| {
                let has = pidfd.is_some();
                pidfds.extend(pidfd);
                HandedProcess {
                    key,
                    pid,
                    pidfd: has,
                }
            })
            .collect();
        let handover = Handover {
            format: HANDOVER_FORMAT,
            pid: std::process::id(),
            pid_namespace: pid_namespace(),
            node_id: self.node_id,
            epoch: self.epoch,
            id_key: self.ids.key,
            id_counter: self.ids.counter,
            segments: self.segments.iter().map(Allocator::capacity).collect(),
            hugetlb: self.hugetlb,
            peer_listener,
            metrics_listener,
            objects,
            processes,
        };
        (handover, pidfds)
    }

    /// The table a predecessor handed over, on the same memory, with the pidfds that came
    /// beside it: the same handles, each client process's leases and reservations held for it
    /// by a connection of the daemon's own (see [`Objects::orphans`]), which its new
    /// connections return, seal and abort through, and which is dropped when the process is
    /// gone. Checked first: every object lies in its segment, apart from every other, and
    /// the pidfds are those the hand-over names.
    pub fn take_over(h: &Handover, pidfds: Vec<OwnedFd>) -> Result<Objects, Inconsistent> {
        let mut o = Objects::new(h.node_id, h.epoch, &h.segments, h.hugetlb);
        o.ids = Ids::resume(&h.id_key, h.id_counter);
        let named = h.processes.iter().filter(|p| p.pidfd).count();
        if named != pidfds.len() {
            return Err(Inconsistent(format!(
                "{named} processes with a pidfd, {} pidfds",
                pidfds.len()
            )));
        }
        // Pids mean the same only in the predecessor's pid namespace: from another, a key
        // made of a pid names no process here (it could name another one), and no pid is
        // watched with kill().
        let same_pids = h.pid_namespace != 0 && h.pid_namespace == pid_namespace();
        let mut pidfds = pidfds.into_iter();
        let mut processes = HashMap::new();
        let mut rekeyed = HashMap::new();
        for (i, p) in h.processes.iter().enumerate() {
            let pidfd = p.pidfd.then(|| Arc::new(pidfds.next().expect("counted")));
            let foreign_pid = !same_pids && p.key & (PID_KEY | UNNAMED_KEY) == PID_KEY;
            let (key, pid) = match (foreign_pid, &pidfd) {
                // Watched by its pidfd, recognised by nothing (bit 62 kept apart from the
                // predecessor's unnamed keys, which are its connection ids).
                (true, Some(_)) => (UNNAMED_KEY | PID_KEY | i as u64, 0),
                // Neither: held for with what no process can be found for (key 0).
                (true, None) => (0, 0),
                (false, _) if same_pids => (p.key, p.pid),
                (false, _) => (p.key, 0),
            };
            if foreign_pid {
                rekeyed.insert(p.key, key);
                if key == 0 {
                    continue;
                }
            }
            if p.key == 0 || processes.insert(key, (pid, pidfd)).is_some() {
                return Err(Inconsistent(format!(
                    "process key {:x} is 0 or named twice",
                    p.key
                )));
            }
        }
        let key = |k: u64| rekeyed.get(&k).copied().unwrap_or(k);
        for handed in &h.objects {
            let mut handed = handed.clone();
            handed.writer = handed.writer.map(key);
            for lease in &mut handed.leases {
                lease.0 = key(lease.0);
            }
            o.adopt(&handed, &processes)?;
        }
        Ok(o)
    }

    fn adopt(
        &mut self,
        h: &HandedObject,
        processes: &HashMap<u64, (i32, Option<Arc<OwnedFd>>)>,
    ) -> Result<(), Inconsistent> {
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
        let state = match h.writer {
            None => State::Sealed,
            Some(key) => {
                let owner = self.orphan(key, processes);
                self.conns
                    .get_mut(&owner)
                    .expect("just made")
                    .writing
                    .insert(slot);
                State::Writing { owner }
            }
        };
        let mut leases = 0u32;
        for &(key, n) in &h.leases {
            let owner = self.orphan(key, processes);
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

    /// The connection holding what process `key` held on the predecessor. Key 0 (a process
    /// the predecessor could neither name nor watch) has one too, which nothing returns to and
    /// nothing drops: what it holds stays held, takeover after takeover, until a daemon starts
    /// afresh.
    fn orphan(
        &mut self,
        key: u64,
        processes: &HashMap<u64, (i32, Option<Arc<OwnedFd>>)>,
    ) -> ConnId {
        if let Some(&conn) = self.orphans.get(&key) {
            return conn;
        }
        let (pid, pidfd) = processes.get(&key).cloned().unwrap_or((0, None));
        let conn = self.connect(ClientInfo {
            role: Role::Writer,
            uid: 0,
            pid,
            process: Process {
                key,
                pidfd,
                started: 0,
            },
            name: format!("held for pid {pid} since the hand-over"),
            internal: true,
            capped: false,
        });
        self.orphans.insert(key, conn);
        conn
    }

    /// The connection holding what the process behind `conn` held on the predecessor, if any
    /// (never for a process the daemon cannot name: its key is 0).
    pub(super) fn orphan_of(&self, conn: ConnId) -> Option<ConnId> {
        let key = self.conns.get(&conn)?.info.process.key;
        (key != 0)
            .then(|| self.orphans.get(&key).copied())
            .flatten()
            .filter(|&o| o != conn)
    }

    /// Records when the process an orphan holds for started (see [`Process::started`]),
    /// once the daemon found it running.
    pub fn set_started(&mut self, orphan: ConnId, started: u64) {
        if let Some(c) = self.conns.get_mut(&orphan) {
            c.info.process.started = started;
        }
    }

    /// The processes something is held for since the hand-over: the connection holding it,
    /// the process's pid (0 in another pid namespace) and what names it. The daemon drops the
    /// connection ([`Objects::disconnect`]) once the process is gone.
    pub fn orphans(&self) -> Vec<(ConnId, i32, Process)> {
        self.orphans
            .values()
            .filter_map(|&conn| {
                let info = &self.conns.get(&conn)?.info;
                Some((conn, info.pid, info.process.clone()))
            })
            .collect()
    }
}

/// This process's pid namespace: the inode of `/proc/self/ns/pid` (0 where it cannot be read).
pub fn pid_namespace() -> u64 {
    std::fs::metadata("/proc/self/ns/pid").map_or(0, |m| std::os::unix::fs::MetadataExt::ino(&m))
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
            process: Process {
                key: if internal { 0 } else { pid as u64 },
                pidfd: None,
                started: 0,
            },
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

        let (h, pidfds) = o.hand_over(true, false);
        assert!(pidfds.is_empty());
        assert_eq!(
            h.processes.iter().map(|p| p.key).collect::<Vec<_>>(),
            [10, 20],
            "the writer (a reservation) and the reader (leases); not the stream"
        );
        assert_eq!(h.objects.len(), 4);
        assert_eq!(
            h.objects[0].id, evictable.id,
            "evictable first, in LRU order"
        );
        let mut n = Objects::take_over(
            &feedstore_proto::handover::Handover::decode(&h.encode()).unwrap(),
            Vec::new(),
        )
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
        let mut n = Objects::take_over(&o.hand_over(false, false).0, Vec::new()).unwrap();
        let orphans = n.orphans();
        assert_eq!(orphans.len(), 1);
        assert_eq!((orphans[0].1, orphans[0].2.key), (10, 10));
        let reclaimed = n.disconnect(orphans[0].0);
        assert_eq!((reclaimed.aborted, reclaimed.leases), (1, 1));
        assert!(n.orphans().is_empty());
        let s = n.stats();
        assert_eq!((s.objects_writing, s.leases, s.objects_sealed), (0, 0, 1));
        let w2 = client(&mut n, Role::Writer, 10, false);
        assert_eq!(n.seal(w2, c.handle), Err(Status::NotFound));
    }

    /// From a daemon in another pid namespace, a key made of a pid names nobody here: what
    /// that process held stays held (a process here with that pid gets none of it back), and
    /// its pid is not watched; a pidfs key still names its process.
    #[test]
    fn pids_from_another_pid_namespace_name_nobody() {
        let mut o = Objects::new(1, 2, &[1 << 20], false);
        let by_pid = client(&mut o, Role::Reader, 10, false);
        let by_inode = client(&mut o, Role::Reader, 20, false);
        let w = client(&mut o, Role::Writer, 30, false);
        let a = o.create(w, 100, false).unwrap().handle;
        o.seal(w, a).unwrap();
        o.get(by_pid, a).unwrap();
        o.get(by_inode, a).unwrap();
        let (mut h, _) = o.hand_over(false, false);
        for p in &mut h.processes {
            if p.key == 10 {
                p.key = PID_KEY | 10;
            }
        }
        for object in &mut h.objects {
            for lease in &mut object.leases {
                if lease.0 == 10 {
                    lease.0 = PID_KEY | 10;
                }
            }
        }
        h.pid_namespace = pid_namespace() + 1;
        let mut n = Objects::take_over(&h, Vec::new()).unwrap();
        assert!(
            n.orphans().iter().all(|(_, pid, _)| *pid == 0),
            "no pid watched"
        );
        let same_pid = n.connect(ClientInfo {
            role: Role::Reader,
            uid: 1000,
            pid: 10,
            process: Process {
                key: PID_KEY | 10,
                pidfd: None,
                started: 0,
            },
            name: "pid 10 here".into(),
            internal: false,
            capped: false,
        });
        assert!(
            n.release(same_pid, a).is_err(),
            "not the process that held it"
        );
        let same_inode = client(&mut n, Role::Reader, 20, false);
        n.release(same_inode, a).unwrap();
        assert_eq!(
            n.stats().leases,
            1,
            "the pid-named process's lease stays held"
        );
    }

    /// Processes that cannot be named (a pidfd, no pidfs) stay apart through a chain of
    /// takeovers: each is held for on its own, watched by its own pidfd, however the daemons
    /// numbered their connections.
    #[test]
    fn unnamed_processes_stay_apart_through_takeovers() {
        let pidfd = || {
            Some(Arc::new(OwnedFd::from(
                std::fs::File::open("/dev/null").unwrap(),
            )))
        };
        let unnamed = |o: &mut Objects| {
            o.connect(ClientInfo {
                role: Role::Reader,
                uid: 1000,
                pid: 0,
                process: Process {
                    key: 0,
                    pidfd: pidfd(),
                    started: 0,
                },
                name: "unnamed".into(),
                internal: false,
                capped: false,
            })
        };
        let mut o = Objects::new(1, 2, &[1 << 20], false);
        let w = client(&mut o, Role::Writer, 30, false);
        let a = o.create(w, 100, false).unwrap().handle;
        o.seal(w, a).unwrap();
        let first = unnamed(&mut o);
        o.get(first, a).unwrap();
        let (h, fds) = o.hand_over(false, false);
        let fds = fds.iter().map(|f| f.try_clone().unwrap()).collect();
        let mut n = Objects::take_over(&h, fds).unwrap();
        // A new unnamed process in the successor, whose connection ids start again.
        let second = unnamed(&mut n);
        n.get(second, a).unwrap();
        n.get(second, a).unwrap();
        let (h2, fds2) = n.hand_over(false, false);
        let unnamed_keys: Vec<u64> = h2
            .processes
            .iter()
            .map(|p| p.key)
            .filter(|k| k & UNNAMED_KEY != 0)
            .collect();
        assert_eq!(unnamed_keys.len(), 2, "two processes, not one: {h2:?}");
        let fds2 = fds2.iter().map(|f| f.try_clone().unwrap()).collect();
        let mut n2 = Objects::take_over(&h2, fds2).unwrap();
        let mut held: Vec<u64> = n2
            .orphans()
            .iter()
            .filter(|(_, _, p)| p.key & UNNAMED_KEY != 0)
            .map(|(conn, _, _)| n2.disconnect(*conn).leases)
            .collect();
        held.sort_unstable();
        assert_eq!(held, [1, 2], "each process's own leases");
    }

    /// A hand-over that contradicts itself is refused, not trusted.
    #[test]
    fn an_inconsistent_hand_over_is_refused() {
        let mut o = Objects::new(1, 2, &[1 << 20], false);
        let w = client(&mut o, Role::Writer, 10, false);
        let a = o.create(w, 100, false).unwrap().handle;
        o.seal(w, a).unwrap();
        o.get(w, a).unwrap();
        let good = o.hand_over(false, false).0;
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
        let mut claims_a_pidfd = good.clone();
        claims_a_pidfd.processes[0].pidfd = true;
        let mut key_zero = good.clone();
        key_zero.processes[0].key = 0;
        for bad in [
            overlapping,
            outside,
            wrong_len,
            same_id,
            claims_a_pidfd,
            key_zero,
        ] {
            assert!(Objects::take_over(&bad, Vec::new()).is_err(), "{bad:?}");
        }
        assert!(Objects::take_over(&good, Vec::new()).is_ok());
    }
}
