//! The object and lease model: what the daemon knows about every object and every client.
//!
//! [`Objects`] is plain synchronous state with no I/O, owned by the server behind one mutex, so
//! every rule below is unit-testable without a socket:
//!
//! - an object is created *writing*, owned by one connection; only that connection can seal or
//!   abort it, and nobody can get it until it is sealed;
//! - a get takes a lease; the object cannot be evicted or freed while any lease is held;
//! - delete of a leased object hides it from new gets and frees it when the last lease returns;
//! - when space runs out, sealed, unleased, unpinned objects are evicted in LRU order (least
//!   recently sealed or released first);
//! - when a connection goes away, its unsealed objects are aborted and its leases returned;
//! - a copy of another node's object (pulled by [`crate::cluster`]) is found by that node's
//!   handle once sealed, and is leased, evicted and deleted like any local object.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};

use feedstore_proto::frame::Created;
use feedstore_proto::{Handle, Location, Role, Status, StoreStats};

use crate::alloc::{Allocator, Block};

/// Identifies one client connection for the daemon's lifetime.
pub type ConnId = u64;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Writing { owner: ConnId },
    Sealed,
}

#[derive(Debug)]
struct Object {
    segment: u32,
    block: Block,
    len: u64,
    state: State,
    leases: u32,
    pinned: bool,
    delete_pending: bool,
    /// Position in the LRU index while evictable.
    lru_tick: Option<u64>,
    /// For a sealed copy of another node's object, that object's handle.
    origin: Option<Handle>,
    /// The uid of the client that created it.
    creator: u32,
}

impl Object {
    fn evictable(&self) -> bool {
        self.state == State::Sealed && self.leases == 0 && !self.pinned && !self.delete_pending
    }

    fn location(&self) -> Location {
        Location {
            segment: self.segment,
            offset: self.block.offset,
            len: self.len,
        }
    }
}

#[derive(Debug, Default)]
struct Slot {
    generation: u32,
    object: Option<Object>,
}

/// What the daemon knows about one connected client.
#[derive(Debug)]
pub struct ClientInfo {
    /// Reader or writer.
    pub role: Role,
    /// The peer's uid (`SO_PEERCRED`).
    pub uid: u32,
    /// The peer's pid (`SO_PEERCRED`; 0 when it lives in another pid namespace).
    pub pid: i32,
    /// The name the client gave in its hello.
    pub name: String,
    /// One of the daemon's own connections (a stream holding its samples' leases): not a
    /// client, and bounded by its stream's depth rather than the lease limit.
    pub internal: bool,
}

#[derive(Debug)]
struct Conn {
    info: ClientInfo,
    writing: HashSet<u32>,
    /// Leases per slot. A leased object is never freed, so its slot cannot be reused meanwhile.
    leases: HashMap<u32, u32>,
    /// Leases held, summed over slots.
    lease_count: u64,
}

/// What a disconnect reclaimed.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Reclaimed {
    /// Unsealed objects aborted.
    pub aborted: u64,
    /// Leases returned.
    pub leases: u64,
}

#[derive(Debug, Default)]
struct Counters {
    evictions: u64,
    evicted_bytes: u64,
    creates_waited: u64,
    creates_full: u64,
    aborted_on_disconnect: u64,
    leases_reclaimed: u64,
    limits_hit: u64,
}

/// All objects and clients of one daemon.
#[derive(Debug)]
pub struct Objects {
    node_id: u32,
    epoch: u32,
    hugetlb: bool,
    segments: Vec<Allocator>,
    slots: Vec<Slot>,
    /// Empty slots, reused oldest first so a freed handle stays `NotFound` as long as possible
    /// before it becomes `Stale`.
    free_slots: VecDeque<u32>,
    /// Evictable objects by last use.
    lru: BTreeMap<u64, u32>,
    tick: u64,
    conns: HashMap<ConnId, Conn>,
    next_conn: ConnId,
    counters: Counters,
    /// Bumped whenever space is freed or an object becomes evictable, i.e. whenever a create
    /// that found no room might now find some; creates waiting for room watch it.
    space_epoch: u64,
    /// Most leases a client connection may hold (`--max-leases-per-connection`).
    max_leases_per_conn: u64,
    /// Sealed local copies of other nodes' objects, by the owner's handle.
    copies: HashMap<Handle, u32>,
}

impl Objects {
    /// State for segments of the given sizes.
    pub fn new(node_id: u32, epoch: u32, segment_bytes: &[u64], hugetlb: bool) -> Objects {
        Objects {
            node_id,
            epoch,
            hugetlb,
            segments: segment_bytes.iter().map(|&b| Allocator::new(b)).collect(),
            slots: Vec::new(),
            free_slots: VecDeque::new(),
            lru: BTreeMap::new(),
            tick: 0,
            conns: HashMap::new(),
            next_conn: 1,
            counters: Counters::default(),
            space_epoch: 0,
            max_leases_per_conn: u64::MAX,
            copies: HashMap::new(),
        }
    }

    /// Caps the leases one client connection may hold (the daemon's own stream connections
    /// are bounded by their streams' depth instead).
    pub fn with_lease_limit(mut self, max_leases_per_conn: u64) -> Objects {
        self.max_leases_per_conn = max_leases_per_conn;
        self
    }

    /// Counts a request refused by a configured limit (for `limits_hit`).
    pub fn note_limit_hit(&mut self) {
        self.counters.limits_hit += 1;
    }

    /// Registers a new connection.
    pub fn connect(&mut self, info: ClientInfo) -> ConnId {
        let id = self.next_conn;
        self.next_conn += 1;
        self.conns.insert(
            id,
            Conn {
                info,
                writing: HashSet::new(),
                leases: HashMap::new(),
                lease_count: 0,
            },
        );
        id
    }

    /// The client behind a connection.
    pub fn client(&self, conn: ConnId) -> Option<&ClientInfo> {
        self.conns.get(&conn).map(|c| &c.info)
    }

    /// Forgets a connection: aborts what it was writing and returns its leases.
    pub fn disconnect(&mut self, conn: ConnId) -> Reclaimed {
        let Some(c) = self.conns.remove(&conn) else {
            return Reclaimed::default();
        };
        let mut reclaimed = Reclaimed::default();
        for slot in c.writing {
            self.free(slot);
            reclaimed.aborted += 1;
        }
        for (slot, count) in c.leases {
            reclaimed.leases += u64::from(count);
            self.drop_leases(slot, count);
        }
        self.counters.aborted_on_disconnect += reclaimed.aborted;
        self.counters.leases_reclaimed += reclaimed.leases;
        reclaimed
    }

    /// A counter bumped whenever space is freed or becomes evictable.
    pub fn space_epoch(&self) -> u64 {
        self.space_epoch
    }

    /// Counts a create that had to wait for space.
    pub fn note_create_waited(&mut self) {
        self.counters.creates_waited += 1;
    }

    /// Counts a create that gave up with `Full`.
    pub fn note_create_full(&mut self) {
        self.counters.creates_full += 1;
    }

    /// Reserves a writable object of `size` bytes for `conn`, evicting LRU objects if needed.
    /// `Err(Status::Full)` means no room now; the caller may wait for [`Self::space_epoch`].
    pub fn create(&mut self, conn: ConnId, size: u64, pinned: bool) -> Result<Created, Status> {
        self.require_writer(conn)?;
        if size == 0 {
            return Err(Status::InvalidArgument);
        }
        let need = Allocator::reserved_len(size).ok_or(Status::TooLarge)?;
        if !self.segments.iter().any(|s| s.capacity() >= need) {
            return Err(Status::TooLarge);
        }
        let creator = self.conns[&conn].info.uid; // (a writer: checked above)
        let (segment, block) = loop {
            let found = self
                .segments
                .iter_mut()
                .enumerate()
                .find_map(|(i, s)| s.allocate(size).map(|b| (i as u32, b)));
            if let Some(found) = found {
                break found;
            }
            if !self.evict_one() {
                return Err(Status::Full);
            }
        };
        let slot = match self.free_slots.pop_front() {
            Some(slot) => slot,
            None => {
                self.slots.push(Slot::default());
                (self.slots.len() - 1) as u32
            }
        };
        let entry = &mut self.slots[slot as usize];
        entry.generation = entry.generation.wrapping_add(1);
        entry.object = Some(Object {
            segment,
            block,
            len: size,
            state: State::Writing { owner: conn },
            leases: 0,
            pinned,
            delete_pending: false,
            lru_tick: None,
            origin: None,
            creator,
        });
        let handle = self.handle(slot);
        self.conns
            .get_mut(&conn)
            .expect("writer checked above")
            .writing
            .insert(slot);
        let location = self.slots[slot as usize]
            .object
            .as_ref()
            .expect("just set")
            .location();
        tracing::debug!(%handle, size, segment, offset = block.offset, "object created");
        Ok(Created { handle, location })
    }

    /// Seals an object `conn` created: it becomes immutable and visible.
    pub fn seal(&mut self, conn: ConnId, handle: Handle) -> Result<(), Status> {
        let slot = self.end_reservation(conn, handle)?;
        self.object_mut(slot).state = State::Sealed;
        self.touch(slot);
        tracing::debug!(%handle, "object sealed");
        Ok(())
    }

    /// Seals an object `conn` filled with the bytes of `origin`, another node's object: from
    /// now on a get of `origin` on this node leases the copy. (A copy already known for
    /// `origin` stays; this one is aborted and `InvalidState` returned.)
    pub fn seal_copy(
        &mut self,
        conn: ConnId,
        handle: Handle,
        origin: Handle,
    ) -> Result<(), Status> {
        if origin.node_id == self.node_id {
            return Err(Status::InvalidArgument);
        }
        if self.copies.contains_key(&origin) {
            self.abort(conn, handle)?;
            return Err(Status::InvalidState);
        }
        let slot = self.end_reservation(conn, handle)?;
        let obj = self.object_mut(slot);
        obj.state = State::Sealed;
        obj.origin = Some(origin);
        self.copies.insert(origin, slot);
        self.touch(slot);
        tracing::debug!(%handle, %origin, "copy of a remote object sealed");
        Ok(())
    }

    /// Gives back an object `conn` created and has not sealed.
    pub fn abort(&mut self, conn: ConnId, handle: Handle) -> Result<(), Status> {
        let slot = self.end_reservation(conn, handle)?;
        self.free(slot);
        tracing::debug!(%handle, "object aborted");
        Ok(())
    }

    /// Ends `conn`'s reservation of an unsealed object it created, returning its slot.
    fn end_reservation(&mut self, conn: ConnId, handle: Handle) -> Result<u32, Status> {
        self.require_writer(conn)?;
        let slot = self.resolve(handle)?;
        match self.object_mut(slot).state {
            State::Writing { owner } if owner == conn => {}
            State::Writing { .. } => return Err(Status::NotOwner),
            State::Sealed => return Err(Status::InvalidState),
        }
        self.conns
            .get_mut(&conn)
            .expect("writer checked")
            .writing
            .remove(&slot);
        Ok(slot)
    }

    /// Takes a lease on a sealed object for `conn` and says where it lives. `LimitReached`
    /// once the connection holds `--max-leases-per-connection`.
    pub fn get(&mut self, conn: ConnId, handle: Handle) -> Result<Location, Status> {
        let slot = self.resolve(handle)?;
        let obj = self.object_mut(slot);
        if obj.delete_pending {
            return Err(Status::NotFound);
        }
        if obj.state != State::Sealed {
            return Err(Status::NotSealed);
        }
        self.add_lease(conn, slot)
    }

    /// Gives `to` a lease of its own on an object `from` holds a lease on (a stream handing a
    /// sample to its consumer). Succeeds for a deleted object too: its bytes stay valid while
    /// leased, and `from`'s lease proves it is still there. `LimitReached` once `to` holds
    /// `--max-leases-per-connection`, as for a get.
    pub fn share_lease(&mut self, from: ConnId, to: ConnId, handle: Handle) -> Result<(), Status> {
        let slot = self.resolve(handle)?;
        let held = self
            .conns
            .get(&from)
            .and_then(|c| c.leases.get(&slot))
            .is_some_and(|&n| n > 0);
        if !held {
            return Err(Status::InvalidState);
        }
        self.add_lease(to, slot).map(|_| ())
    }

    /// One more lease for `conn` on `slot`, within the connection's limit (client connections
    /// only) and the object's counter.
    fn add_lease(&mut self, conn: ConnId, slot: u32) -> Result<Location, Status> {
        let c = self.conns.get(&conn).ok_or(Status::Protocol)?;
        if !c.info.internal && c.lease_count >= self.max_leases_per_conn {
            self.counters.limits_hit += 1;
            return Err(Status::LimitReached);
        }
        let obj = self.slots[slot as usize]
            .object
            .as_mut()
            .expect("resolved slot holds an object");
        let Some(leases) = obj.leases.checked_add(1) else {
            self.counters.limits_hit += 1;
            return Err(Status::LimitReached);
        };
        let location = obj.location();
        let c = self.conns.get_mut(&conn).ok_or(Status::Protocol)?;
        obj.leases = leases;
        *c.leases.entry(slot).or_insert(0) += 1;
        c.lease_count += 1;
        self.touch(slot);
        Ok(location)
    }

    /// Returns one lease `conn` holds on `handle`.
    pub fn release(&mut self, conn: ConnId, handle: Handle) -> Result<(), Status> {
        let slot = self.resolve(handle)?;
        let c = self.conns.get_mut(&conn).ok_or(Status::Protocol)?;
        match c.leases.get_mut(&slot) {
            Some(n) if *n > 1 => *n -= 1,
            Some(_) => {
                c.leases.remove(&slot);
            }
            None => return Err(Status::InvalidState),
        }
        c.lease_count -= 1;
        self.drop_leases(slot, 1);
        Ok(())
    }

    /// Deletes an object: at once if unleased, else when its last lease is returned. A writer
    /// deleting its own unsealed object aborts it.
    pub fn delete(&mut self, conn: ConnId, handle: Handle) -> Result<(), Status> {
        self.require_writer(conn)?;
        let slot = self.resolve(handle)?;
        let obj = self.object_mut(slot);
        match obj.state {
            State::Writing { owner } if owner == conn => return self.abort(conn, handle),
            State::Writing { .. } => return Err(Status::NotOwner),
            State::Sealed if obj.delete_pending => return Err(Status::NotFound),
            State::Sealed if obj.leases > 0 => {
                obj.delete_pending = true;
                let leases = obj.leases;
                self.touch(slot);
                tracing::debug!(%handle, leases, "delete deferred until leases are released");
            }
            State::Sealed => {
                self.free(slot);
                tracing::debug!(%handle, "object deleted");
            }
        }
        Ok(())
    }

    /// A snapshot of the store.
    pub fn stats(&self) -> StoreStats {
        let mut s = StoreStats {
            capacity_bytes: self.segments.iter().map(Allocator::capacity).sum(),
            largest_free_bytes: self
                .segments
                .iter()
                .map(Allocator::largest_free)
                .max()
                .unwrap_or(0),
            clients: self.conns.values().filter(|c| !c.info.internal).count() as u64,
            evictions: self.counters.evictions,
            evicted_bytes: self.counters.evicted_bytes,
            creates_waited: self.counters.creates_waited,
            creates_full: self.counters.creates_full,
            aborted_on_disconnect: self.counters.aborted_on_disconnect,
            leases_reclaimed: self.counters.leases_reclaimed,
            limits_hit: self.counters.limits_hit,
            segments: self.segments.len() as u64,
            huge_pages: u64::from(self.hugetlb),
            ..StoreStats::default()
        };
        s.used_bytes =
            s.capacity_bytes - self.segments.iter().map(Allocator::free_bytes).sum::<u64>();
        for obj in self.slots.iter().filter_map(|s| s.object.as_ref()) {
            match obj.state {
                State::Writing { .. } => s.objects_writing += 1,
                State::Sealed if obj.delete_pending => s.objects_delete_pending += 1,
                State::Sealed => {
                    s.objects_sealed += 1;
                    s.objects_pinned += u64::from(obj.pinned);
                    s.objects_pulled += u64::from(obj.origin.is_some());
                }
            }
            s.leases += u64::from(obj.leases);
        }
        s
    }

    fn handle(&self, slot: u32) -> Handle {
        Handle {
            node_id: self.node_id,
            epoch: self.epoch,
            slot,
            generation: self.slots[slot as usize].generation,
        }
    }

    /// The uid that created the live, sealed object `handle` names (None: no such object).
    pub fn creator(&self, handle: Handle) -> Option<u32> {
        let slot = self.resolve(handle).ok()?;
        let obj = self.slots[slot as usize].object.as_ref()?;
        (obj.state == State::Sealed && !obj.delete_pending).then_some(obj.creator)
    }

    /// How many object slots the store has had at once at most: a bound on its live objects
    /// that costs nothing to read.
    pub fn slot_count(&self) -> usize {
        self.slots.len()
    }

    /// Whether `handle` names a live, sealed object not waiting for deletion.
    pub fn is_sealed(&self, handle: Handle) -> bool {
        self.resolve(handle).is_ok_and(|slot| {
            self.slots[slot as usize]
                .object
                .as_ref()
                .is_some_and(|o| o.state == State::Sealed && !o.delete_pending)
        })
    }

    /// Finds the live slot a handle names, or says why not.
    fn resolve(&self, handle: Handle) -> Result<u32, Status> {
        if handle.node_id != self.node_id {
            // Another node's object: its local copy, if one has been pulled.
            return self.copies.get(&handle).copied().ok_or(Status::WrongNode);
        }
        if handle.epoch != self.epoch {
            return Err(Status::Stale);
        }
        let slot = self
            .slots
            .get(handle.slot as usize)
            .ok_or(Status::NotFound)?;
        if slot.generation != handle.generation {
            return Err(Status::Stale);
        }
        if slot.object.is_none() {
            return Err(Status::NotFound);
        }
        Ok(handle.slot)
    }

    fn require_writer(&self, conn: ConnId) -> Result<(), Status> {
        match self.conns.get(&conn) {
            Some(c) if c.info.role == Role::Writer => Ok(()),
            Some(_) => Err(Status::PermissionDenied),
            None => Err(Status::Protocol),
        }
    }

    fn object_mut(&mut self, slot: u32) -> &mut Object {
        self.slots[slot as usize]
            .object
            .as_mut()
            .expect("resolved slot holds an object")
    }

    fn drop_leases(&mut self, slot: u32, count: u32) {
        let obj = self.object_mut(slot);
        obj.leases -= count;
        if obj.leases == 0 && obj.delete_pending {
            self.free(slot);
        } else {
            self.touch(slot);
        }
    }

    /// Re-files a slot in the LRU index: out if not evictable, else as most recently used.
    fn touch(&mut self, slot: u32) {
        let obj = self.slots[slot as usize]
            .object
            .as_mut()
            .expect("live slot");
        if let Some(tick) = obj.lru_tick.take() {
            self.lru.remove(&tick);
        }
        if obj.evictable() {
            self.tick += 1;
            obj.lru_tick = Some(self.tick);
            self.lru.insert(self.tick, slot);
            self.space_epoch += 1;
        }
    }

    fn evict_one(&mut self) -> bool {
        let Some((_, slot)) = self.lru.first_key_value().map(|(&t, &s)| (t, s)) else {
            return false;
        };
        let handle = self.handle(slot);
        let len = self.slots[slot as usize]
            .object
            .as_ref()
            .expect("lru holds live slots")
            .block
            .len;
        self.free(slot);
        self.counters.evictions += 1;
        self.counters.evicted_bytes += len;
        tracing::debug!(%handle, bytes = len, "object evicted (LRU)");
        true
    }

    fn free(&mut self, slot: u32) {
        let obj = self.slots[slot as usize]
            .object
            .take()
            .expect("free of a live slot");
        if let Some(tick) = obj.lru_tick {
            self.lru.remove(&tick);
        }
        if let Some(origin) = obj.origin {
            self.copies.remove(&origin);
        }
        self.segments[obj.segment as usize].free(obj.block);
        // A slot whose generation would wrap is retired: a handle never names two objects.
        if self.slots[slot as usize].generation != u32::MAX {
            self.free_slots.push_back(slot);
        }
        self.space_epoch += 1;
    }
}

/// A plain client of `uid` for other modules' tests.
#[cfg(test)]
pub(crate) fn test_client(o: &mut Objects, role: Role, uid: u32) -> ConnId {
    o.connect(ClientInfo {
        role,
        uid,
        pid: 1,
        name: String::new(),
        internal: false,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn store(capacity: u64) -> (Objects, ConnId, ConnId) {
        store_with(Objects::new(7, 99, &[capacity], false))
    }

    /// `o` with a writer and a reader connected.
    fn store_with(mut o: Objects) -> (Objects, ConnId, ConnId) {
        let info = |role| ClientInfo {
            role,
            uid: 0,
            pid: 1,
            name: "t".into(),
            internal: false,
        };
        let w = o.connect(info(Role::Writer));
        let r = o.connect(info(Role::Reader));
        (o, w, r)
    }

    fn put(o: &mut Objects, w: ConnId, size: u64) -> Handle {
        let c = o.create(w, size, false).unwrap();
        o.seal(w, c.handle).unwrap();
        c.handle
    }

    #[test]
    fn unsealed_objects_are_invisible() {
        let (mut o, w, r) = store(1 << 20);
        let c = o.create(w, 100, false).unwrap();
        assert_eq!(o.get(r, c.handle), Err(Status::NotSealed));
        o.seal(w, c.handle).unwrap();
        assert_eq!(o.get(r, c.handle).unwrap().len, 100);
    }

    #[test]
    fn readers_cannot_write() {
        let (mut o, _, r) = store(1 << 20);
        assert_eq!(
            o.create(r, 10, false).unwrap_err(),
            Status::PermissionDenied
        );
    }

    #[test]
    fn only_the_owner_seals() {
        let mut o = Objects::new(1, 1, &[1 << 20], false);
        let info = || ClientInfo {
            role: Role::Writer,
            uid: 0,
            pid: 1,
            name: "t".into(),
            internal: false,
        };
        let (a, b) = (o.connect(info()), o.connect(info()));
        let c = o.create(a, 10, false).unwrap();
        assert_eq!(o.seal(b, c.handle), Err(Status::NotOwner));
        o.seal(a, c.handle).unwrap();
        assert_eq!(o.seal(a, c.handle), Err(Status::InvalidState));
    }

    #[test]
    fn forged_and_stale_handles_never_resolve_to_another_object() {
        let (mut o, w, r) = store(1 << 20);
        let h = put(&mut o, w, 64);
        o.delete(w, h).unwrap();
        assert_eq!(o.get(r, h), Err(Status::NotFound));
        let h2 = put(&mut o, w, 64);
        assert_eq!(h2.slot, h.slot, "slot reused");
        assert_eq!(o.get(r, h), Err(Status::Stale));
        let forged = |f: fn(&mut Handle)| {
            let mut x = h2;
            f(&mut x);
            x
        };
        assert_eq!(o.get(r, forged(|h| h.epoch ^= 1)), Err(Status::Stale));
        assert_eq!(o.get(r, forged(|h| h.node_id ^= 1)), Err(Status::WrongNode));
        assert_eq!(
            o.get(r, forged(|h| h.slot = 1_000_000)),
            Err(Status::NotFound)
        );
        assert_eq!(o.get(r, forged(|h| h.generation += 1)), Err(Status::Stale));
    }

    #[test]
    fn delete_waits_for_the_last_lease() {
        let (mut o, w, r) = store(1 << 20);
        let h = put(&mut o, w, 1000);
        o.get(r, h).unwrap();
        o.get(r, h).unwrap();
        o.delete(w, h).unwrap();
        assert_eq!(o.get(r, h), Err(Status::NotFound), "hidden once deleted");
        assert_eq!(o.stats().objects_delete_pending, 1);
        assert_eq!(o.stats().used_bytes, 1024);
        o.release(r, h).unwrap();
        assert_eq!(o.stats().used_bytes, 1024);
        o.release(r, h).unwrap();
        assert_eq!(o.stats().used_bytes, 0);
        assert_eq!(o.release(r, h), Err(Status::NotFound));
    }

    /// A slot whose generation would wrap is never reused: a handle kept since (a cache
    /// entry, a forged one) names nothing rather than a later object.
    #[test]
    fn a_slot_is_retired_before_its_generation_wraps() {
        let (mut o, w, r) = store(1 << 20);
        let first = put(&mut o, w, 64);
        o.delete(w, first).unwrap();
        o.slots[first.slot as usize].generation = u32::MAX - 1;
        let last = put(&mut o, w, 64);
        assert_eq!((last.slot, last.generation), (first.slot, u32::MAX));
        o.delete(w, last).unwrap();
        let next = put(&mut o, w, 64);
        assert_ne!(next.slot, last.slot, "a fresh slot");
        assert_eq!(o.slot_count(), 2);
        assert_eq!(o.get(r, last), Err(Status::NotFound));
        let wrapped = Handle {
            generation: 0,
            ..last
        };
        assert!(o.get(r, wrapped).is_err());
    }

    #[test]
    fn eviction_is_lru_and_spares_leased_and_pinned_objects() {
        let (mut o, w, r) = store(64 * 4);
        let pinned = o.create(w, 64, true).unwrap().handle;
        o.seal(w, pinned).unwrap();
        let a = put(&mut o, w, 64);
        let b = put(&mut o, w, 64);
        let c = put(&mut o, w, 64);
        o.get(r, a).unwrap(); // leased: not evictable
        o.get(r, b).unwrap();
        o.release(r, b).unwrap(); // b now more recent than c
        let d = put(&mut o, w, 64);
        let gone = |r: Result<Location, Status>| matches!(r, Err(Status::NotFound | Status::Stale));
        assert!(gone(o.get(r, c)), "c was least recently used");
        let e = put(&mut o, w, 64);
        assert!(gone(o.get(r, b)), "then b");
        assert_eq!(o.stats().evictions, 2);
        // Everything left is leased or pinned, except e and d.
        o.get(r, d).unwrap();
        o.get(r, e).unwrap();
        assert_eq!(o.create(w, 64, false).unwrap_err(), Status::Full);
        assert!(o.get(r, pinned).is_ok());
    }

    #[test]
    fn too_large_and_zero_sized_objects_are_refused() {
        let (mut o, w, _) = store(1 << 20);
        assert_eq!(
            o.create(w, (1 << 20) + 1, false).unwrap_err(),
            Status::TooLarge
        );
        assert_eq!(o.create(w, 0, false).unwrap_err(), Status::InvalidArgument);
        assert_eq!(o.create(w, u64::MAX, false).unwrap_err(), Status::TooLarge);
    }

    #[test]
    fn a_connection_holds_at_most_its_lease_limit() {
        let (mut o, w, r) = store_with(Objects::new(7, 99, &[1 << 20], false).with_lease_limit(3));
        let h = put(&mut o, w, 64);
        for _ in 0..3 {
            o.get(r, h).unwrap();
        }
        assert_eq!(o.get(r, h), Err(Status::LimitReached));
        o.release(r, h).unwrap();
        o.get(r, h).unwrap();
        assert_eq!(o.stats().limits_hit, 1);
        assert_eq!(o.stats().leases, 3);
    }

    #[test]
    fn a_shared_lease_needs_one_to_share() {
        let (mut o, w, r) = store(1 << 20);
        let h = put(&mut o, w, 64);
        assert_eq!(o.share_lease(w, r, h), Err(Status::InvalidState));
        o.get(w, h).unwrap();
        o.delete(w, h).unwrap();
        o.share_lease(w, r, h).unwrap();
        assert_eq!(o.get(r, h), Err(Status::NotFound), "hidden from new gets");
        o.release(w, h).unwrap();
        assert!(o.stats().used_bytes > 0, "the shared lease keeps it");
        o.release(r, h).unwrap();
        assert_eq!(o.stats().used_bytes, 0);
    }

    #[test]
    fn a_copy_answers_to_its_owners_handle_until_it_goes() {
        let (mut o, w, r) = store(1 << 20);
        let origin = Handle {
            node_id: 8,
            epoch: 5,
            slot: 3,
            generation: 1,
        };
        assert_eq!(o.get(r, origin), Err(Status::WrongNode), "not pulled yet");
        let c = o.create(w, 100, false).unwrap();
        assert_eq!(
            o.get(r, origin),
            Err(Status::WrongNode),
            "not visible while written"
        );
        o.seal_copy(w, c.handle, origin).unwrap();
        assert_eq!(o.get(r, origin).unwrap(), c.location);
        assert_eq!(o.stats().objects_pulled, 1);
        let twice = o.create(w, 100, false).unwrap();
        assert_eq!(
            o.seal_copy(w, twice.handle, origin),
            Err(Status::InvalidState)
        );
        assert_eq!(o.stats().objects_writing, 0, "the second copy was aborted");
        o.release(r, origin).unwrap();
        o.delete(w, origin).unwrap();
        assert_eq!(o.get(r, origin), Err(Status::WrongNode), "gone: pull again");
        let own = o.create(w, 10, false).unwrap().handle;
        assert_eq!(o.seal_copy(w, own, own), Err(Status::InvalidArgument));
    }

    #[test]
    fn disconnect_aborts_unsealed_and_returns_leases() {
        let (mut o, w, r) = store(1 << 20);
        let sealed = put(&mut o, w, 4096);
        let _open = o.create(w, 4096, false).unwrap();
        o.get(r, sealed).unwrap();
        o.get(r, sealed).unwrap();
        assert_eq!(
            o.disconnect(r),
            Reclaimed {
                aborted: 0,
                leases: 2
            }
        );
        assert_eq!(
            o.disconnect(w),
            Reclaimed {
                aborted: 1,
                leases: 0
            }
        );
        let s = o.stats();
        assert_eq!((s.leases, s.objects_writing, s.objects_sealed), (0, 0, 1));
        assert_eq!(s.used_bytes, 4096);
    }
}
