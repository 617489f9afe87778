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
//! - a copy of another node's object (pulled by the daemon's cluster code) is found by that node's
//!   handle once sealed, and is leased, evicted and deleted like any local object.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::os::fd::OwnedFd;
use std::sync::Arc;

use feedstore_proto::frame::{Created, Got};
use feedstore_proto::{Handle, Location, Role, Status, StoreStats};
use hmac::{Hmac, Mac};
use sha2::Sha256;

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
    /// The random id its handle carries.
    id: u64,
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
    /// The uid of the client that created it (for a copy, the uid the owner's daemon recorded).
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

/// Where object ids come from: 64 bits of HMAC-SHA256, under a key drawn when the daemon
/// starts, of a counter. Unpredictable to anyone without the key (the ids a reader holds say
/// nothing of the others), and never 0.
struct Ids {
    mac: Hmac<Sha256>,
    /// The key, for a successor that goes on drawing ([`Objects::hand_over`]).
    key: [u8; 32],
    counter: u64,
}

impl std::fmt::Debug for Ids {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Ids({} drawn)", self.counter)
    }
}

impl Ids {
    fn new(key: &[u8; 32]) -> Ids {
        Ids::resume(key, 0)
    }

    /// Draws after the first `counter` ids of `key`.
    fn resume(key: &[u8; 32], counter: u64) -> Ids {
        Ids {
            mac: <Hmac<Sha256> as Mac>::new_from_slice(key).expect("HMAC takes keys of any length"),
            key: *key,
            counter,
        }
    }

    fn next(&mut self) -> u64 {
        loop {
            self.counter += 1;
            let mut mac = self.mac.clone();
            mac.update(&self.counter.to_le_bytes());
            let out = mac.finalize().into_bytes();
            let id = u64::from_le_bytes(out[..8].try_into().expect("8 bytes"));
            if id != 0 {
                return id;
            }
        }
    }
}

/// The leases one capped uid holds: per object, and their bytes (each object counted once).
#[derive(Debug, Default)]
struct UidLeases {
    per_slot: HashMap<u32, u32>,
    bytes: u64,
}

/// Which process a client connection comes from, for what the daemon holds for that process
/// across a hand-over ([`Objects::take_over`]).
#[derive(Debug, Clone, Default)]
pub struct Process {
    /// Names the process on this node while it runs, whatever its pid namespace (see
    /// [`feedstore_proto::handover::HandedProcess::key`]); 0 when unknown (the process is then
    /// never given back what it held).
    pub key: u64,
    /// A pidfd of the process (`SO_PEERPIDFD`), readable once it exited.
    pub pidfd: Option<Arc<OwnedFd>>,
    /// When it started, in clock ticks after boot (`/proc/<pid>/stat`; 0 unknown): with its
    /// pid, names it after the daemon that knew it crashed ([`Objects::keep_ledger`]), where
    /// no pidfd came across.
    pub started: u64,
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
    /// The peer's process.
    pub process: Process,
    /// The name the client gave in its hello.
    pub name: String,
    /// One of the daemon's own connections (a stream holding its samples' leases): not a
    /// client, and bounded by its stream's depth rather than the lease limit.
    pub internal: bool,
    /// A uid allowed only to read (`--allow-reader-uid`): the bytes its connections hold
    /// leased, together, are capped (`--reader-lease-percent`), so such a uid cannot pin the
    /// store against the writers.
    pub capped: bool,
}

#[derive(Debug)]
struct Conn {
    info: ClientInfo,
    writing: HashSet<u32>,
    /// Leases per slot. A leased object is never freed, so its slot cannot be reused meanwhile.
    leases: HashMap<u32, u32>,
    /// Leases held, summed over slots.
    lease_count: u64,
    /// Whether the client came back after the daemon before this one went away.
    reconnected: bool,
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
    /// Gets refused because a capped uid held its share.
    capped_refusals: u64,
    /// Connections of clients that came back after the daemon before this one went away.
    reconnects: u64,
}

/// All objects and clients of one daemon.
#[derive(Debug)]
pub struct Objects {
    node_id: u32,
    epoch: u32,
    hugetlb: bool,
    segments: Vec<Allocator>,
    slots: Vec<Option<Object>>,
    /// Live objects' slots by id.
    by_id: HashMap<u64, u32>,
    /// Empty slots.
    free_slots: Vec<u32>,
    ids: Ids,
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
    /// The most bytes a capped uid's connections may hold leased (`--reader-lease-percent`).
    capped_lease_bytes: u64,
    /// Leases of capped uids, by uid.
    capped: HashMap<u32, UidLeases>,
    /// What client processes held on the daemon this one took over from, by process key: a
    /// connection of its own each, whose leases and reservations that process's new
    /// connections return and seal ([`Objects::take_over`]).
    orphans: HashMap<u64, ConnId>,
    /// The table as kept for a daemon started after this one is killed
    /// ([`Objects::keep_ledger`]).
    ledger: Option<ledger::Kept>,
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
            by_id: HashMap::new(),
            free_slots: Vec::new(),
            ids: Ids::new(&crate::random_bytes()),
            lru: BTreeMap::new(),
            tick: 0,
            conns: HashMap::new(),
            next_conn: 1,
            counters: Counters::default(),
            space_epoch: 0,
            max_leases_per_conn: u64::MAX,
            copies: HashMap::new(),
            capped_lease_bytes: u64::MAX,
            capped: HashMap::new(),
            orphans: HashMap::new(),
            ledger: None,
        }
    }

    /// The epoch its handles carry.
    pub fn epoch(&self) -> u32 {
        self.epoch
    }

    /// Bytes of all segments.
    pub fn capacity(&self) -> u64 {
        self.segments.iter().map(Allocator::capacity).sum()
    }

    /// Caps the bytes the connections of one uid allowed only to read may hold leased at once
    /// (see [`ClientInfo::capped`]).
    pub fn with_capped_lease_bytes(mut self, bytes: u64) -> Objects {
        self.capped_lease_bytes = bytes;
        self
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
                reconnected: false,
            },
        );
        id
    }

    /// Notes that the client of `conn` connected again after the daemon before this one went
    /// away (its hello said so), for `reconnects` and `reconnected_clients`.
    pub fn note_reconnected(&mut self, conn: ConnId) {
        if let Some(c) = self.conns.get_mut(&conn) {
            c.reconnected = true;
            self.counters.reconnects += 1;
        }
    }

    /// The client behind a connection.
    pub fn client(&self, conn: ConnId) -> Option<&ClientInfo> {
        self.conns.get(&conn).map(|c| &c.info)
    }

    /// Forgets a connection: aborts what it was writing and returns its leases.
    pub fn disconnect(&mut self, conn: ConnId) -> Reclaimed {
        let holder = self.holder(conn);
        let Some(c) = self.conns.remove(&conn) else {
            return Reclaimed::default();
        };
        if self.orphans.get(&c.info.process.key) == Some(&conn) {
            self.orphans.remove(&c.info.process.key);
        }
        let mut reclaimed = Reclaimed::default();
        for slot in c.writing {
            self.free(slot);
            reclaimed.aborted += 1;
        }
        for (slot, count) in c.leases {
            reclaimed.leases += u64::from(count);
            if c.info.capped {
                self.uncount_capped(c.info.uid, slot, count);
            }
            self.ledger_lease(holder, slot, -i64::from(count));
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
        let slot = match self.free_slots.pop() {
            Some(slot) => slot,
            None => {
                self.slots.push(None);
                (self.slots.len() - 1) as u32
            }
        };
        let id = loop {
            let id = self.ids.next();
            if !self.by_id.contains_key(&id) {
                break id;
            }
        };
        self.by_id.insert(id, slot);
        self.slots[slot as usize] = Some(Object {
            id,
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
        self.ledger_object(slot);
        let location = self.object_mut(slot).location();
        tracing::debug!(%handle, size, segment, offset = block.offset, "object created");
        Ok(Created { handle, location })
    }

    /// Seals an object `conn` created: it becomes immutable and visible.
    pub fn seal(&mut self, conn: ConnId, handle: Handle) -> Result<(), Status> {
        let slot = self.end_reservation(conn, handle)?;
        self.object_mut(slot).state = State::Sealed;
        self.touch(slot);
        self.ledger_object(slot);
        tracing::debug!(%handle, "object sealed");
        Ok(())
    }

    /// Seals an object `conn` filled with the bytes of `origin`, another node's object, which
    /// uid `writer` wrote there (as its owner's daemon says): from now on a get of `origin` on
    /// this node leases the copy. (A copy already known for `origin` stays; this one is aborted
    /// and `InvalidState` returned.)
    pub fn seal_copy(
        &mut self,
        conn: ConnId,
        handle: Handle,
        origin: Handle,
        writer: u32,
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
        obj.creator = writer;
        self.copies.insert(origin, slot);
        self.touch(slot);
        self.ledger_object(slot);
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
        let orphan = self.orphan_of(conn);
        let owner = match self.object_mut(slot).state {
            State::Writing { owner } if owner == conn || orphan == Some(owner) => owner,
            State::Writing { .. } => return Err(Status::NotOwner),
            State::Sealed => return Err(Status::InvalidState),
        };
        self.conns
            .get_mut(&owner)
            .expect("a reservation's owner is connected")
            .writing
            .remove(&slot);
        Ok(slot)
    }

    /// Takes a lease on a sealed object for `conn` and says where it lives. `LimitReached`
    /// once the connection holds `--max-leases-per-connection`, or its uid is capped and holds
    /// its share of the store.
    pub fn get(&mut self, conn: ConnId, handle: Handle) -> Result<Location, Status> {
        self.lease(conn, handle).map(|got| got.location)
    }

    /// [`Objects::get`], with the uid that wrote the object. `OverShare` when the connection's
    /// uid is capped and this object would take its leases past its share.
    pub fn lease(&mut self, conn: ConnId, handle: Handle) -> Result<Got, Status> {
        let slot = self.resolve(handle)?;
        let obj = self.object_mut(slot);
        if obj.delete_pending {
            return Err(Status::NotFound);
        }
        if obj.state != State::Sealed {
            return Err(Status::NotSealed);
        }
        let writer = obj.creator;
        let location = self.add_lease(conn, slot, true)?;
        Ok(Got { location, writer })
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
        self.add_lease(to, slot, false).map(|_| ())
    }

    /// One more lease for `conn` on `slot`, within the connection's limit (client connections
    /// only), its uid's share when it is capped (a get; a stream handing its own sample over,
    /// `share`, is bounded by the stream's depth instead: a consumer holds at most the window
    /// and as many samples again that its window moved past, `consumer::stream::Returns`) and
    /// the object's counter.
    fn add_lease(&mut self, conn: ConnId, slot: u32, get: bool) -> Result<Location, Status> {
        let c = self.conns.get(&conn).ok_or(Status::Protocol)?;
        if !c.info.internal && c.lease_count >= self.max_leases_per_conn {
            self.counters.limits_hit += 1;
            return Err(Status::LimitReached);
        }
        let (uid, capped) = (c.info.uid, c.info.capped);
        let obj = self.slots[slot as usize]
            .as_mut()
            .expect("resolved slot holds an object");
        let Some(leases) = obj.leases.checked_add(1) else {
            self.counters.limits_hit += 1;
            return Err(Status::LimitReached);
        };
        let (location, bytes) = (obj.location(), obj.block.len);
        if capped {
            let (held_bytes, new) = self
                .capped
                .get(&uid)
                .map_or((0, true), |h| (h.bytes, !h.per_slot.contains_key(&slot)));
            if get && new && held_bytes.saturating_add(bytes) > self.capped_lease_bytes {
                self.counters.limits_hit += 1;
                self.counters.capped_refusals += 1;
                return Err(Status::OverShare);
            }
            let held = self.capped.entry(uid).or_default();
            *held.per_slot.entry(slot).or_insert(0) += 1;
            if new {
                held.bytes += bytes;
            }
        }
        let c = self.conns.get_mut(&conn).ok_or(Status::Protocol)?;
        self.slots[slot as usize]
            .as_mut()
            .expect("resolved slot holds an object")
            .leases = leases;
        *c.leases.entry(slot).or_insert(0) += 1;
        c.lease_count += 1;
        self.touch(slot);
        let holder = self.holder(conn);
        self.ledger_lease(holder, slot, 1);
        Ok(location)
    }

    /// Takes `count` leases of a capped `uid` on `slot` off its share.
    fn uncount_capped(&mut self, uid: u32, slot: u32, count: u32) {
        let bytes = self.slots[slot as usize]
            .as_ref()
            .expect("a leased slot holds an object")
            .block
            .len;
        let Some(held) = self.capped.get_mut(&uid) else {
            return;
        };
        if let Some(n) = held.per_slot.get_mut(&slot) {
            *n = n.saturating_sub(count);
            if *n == 0 {
                held.per_slot.remove(&slot);
                held.bytes -= bytes;
            }
        }
        if held.per_slot.is_empty() {
            self.capped.remove(&uid);
        }
    }

    /// Returns one lease `conn` holds on `handle` (or its process held on the daemon this one
    /// took over from).
    pub fn release(&mut self, conn: ConnId, handle: Handle) -> Result<(), Status> {
        let slot = self.resolve(handle)?;
        let held = |c: &Conn| c.leases.get(&slot).is_some_and(|&n| n > 0);
        let conn = match self.conns.get(&conn) {
            None => return Err(Status::Protocol),
            Some(c) if held(c) => conn,
            Some(_) => match self.orphan_of(conn) {
                Some(orphan) if self.conns.get(&orphan).is_some_and(held) => orphan,
                _ => conn,
            },
        };
        let c = self.conns.get_mut(&conn).ok_or(Status::Protocol)?;
        match c.leases.get_mut(&slot) {
            Some(n) if *n > 1 => *n -= 1,
            Some(_) => {
                c.leases.remove(&slot);
            }
            None => return Err(Status::InvalidState),
        }
        c.lease_count -= 1;
        let (uid, capped) = (c.info.uid, c.info.capped);
        if capped {
            self.uncount_capped(uid, slot, 1);
        }
        let holder = self.holder(conn);
        self.ledger_lease(holder, slot, -1);
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
                self.ledger_object(slot);
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
            capacity_bytes: self.capacity(),
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
            lease_share_refusals: self.counters.capped_refusals,
            reconnects: self.counters.reconnects,
            reconnected_clients: self.conns.values().filter(|c| c.reconnected).count() as u64,
            segments: self.segments.len() as u64,
            huge_pages: u64::from(self.hugetlb),
            ..StoreStats::default()
        };
        s.used_bytes =
            s.capacity_bytes - self.segments.iter().map(Allocator::free_bytes).sum::<u64>();
        for obj in self.slots.iter().filter_map(Option::as_ref) {
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
            id: self.slots[slot as usize].as_ref().expect("a live slot").id,
        }
    }

    /// The uid that created the live, sealed object `handle` names (None: no such object).
    pub fn creator(&self, handle: Handle) -> Option<u32> {
        let slot = self.resolve(handle).ok()?;
        let obj = self.slots[slot as usize].as_ref()?;
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
        self.by_id.get(&handle.id).copied().ok_or(Status::NotFound)
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
        let obj = self.slots[slot as usize].as_mut().expect("live slot");
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
            .take()
            .expect("free of a live slot");
        if let Some(tick) = obj.lru_tick {
            self.lru.remove(&tick);
        }
        if let Some(origin) = obj.origin {
            self.copies.remove(&origin);
        }
        self.by_id.remove(&obj.id);
        self.segments[obj.segment as usize].free(obj.block);
        self.free_slots.push(slot);
        self.space_epoch += 1;
        self.ledger_object(slot);
    }
}

/// A plain client of `uid` for other modules' tests.
#[cfg(test)]
pub(crate) fn test_client(o: &mut Objects, role: Role, uid: u32) -> ConnId {
    o.connect(ClientInfo {
        role,
        uid,
        pid: 1,
        process: Process::default(),
        name: String::new(),
        internal: false,
        capped: false,
    })
}

mod handover;
pub mod ledger;
pub use handover::pid_namespace;
#[cfg(test)]
mod tests;
