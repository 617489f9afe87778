//! The object table kept where a crash cannot take it: a *ledger*, a memfd the daemon writes as
//! it changes the table and gives the service manager to keep (`sd_notify` `FDSTORE=1`, beside
//! the segments). A daemon started again after a crash finds the segments and the ledger among
//! the descriptors the service manager passes it, reads the table back ([`read`]: the same
//! [`Handover`] a takeover carries) and serves the same handles from the same memory.
//!
//! What must survive is what clients hold: every live object (sealed or being written), and per
//! client *process* the leases and reservations it holds. A view a process keeps across the
//! crash stays what it was only if the successor knows it is leased; a reservation a producer
//! goes on writing after the crash only if the successor does not hand its block out again.
//! So the ledger may say more is held than is (a lease returned in the instant of the crash
//! stays held until its process exits), never less:
//!
//! - it is written under the objects lock, after the table changes and before any reply says
//!   so: a client never holds what the ledger has not recorded;
//! - every record becomes valid by one 64-bit store, made last (a record's *head*, a lease's
//!   count, a process's tag), and stops being valid by one store, made first: a daemon killed
//!   between two stores leaves each record wholly old or wholly new;
//! - it is fixed in size; when a record finds no room, the daemon writes a new ledger twice
//!   the size from its table, gives it to the service manager, and only then lets go of the
//!   old one (then marks it abandoned). Of the ledgers a daemon finds at its start, only the
//!   latest may be the table, and only if it is complete (its generation is the node's
//!   boot-time clock, which every daemon on the node reads alike).
//!
//! Only the daemon maps a ledger (it holds the key object ids are drawn under); streams and
//! what the daemon's own connections hold are not in it, as they are not in a hand-over.

use std::collections::HashMap;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};

use feedstore_proto::Handle;
use feedstore_proto::handover::{
    HANDOVER_FORMAT, HandedObject, HandedProcess, Handover, UNNAMED_KEY,
};
use feedstore_shm::{Access, HugePages, Mapping, Segment, SegmentOptions};

use super::handover::{Inconsistent, pid_namespace};
use super::{Conn, ConnId, Objects, State};

/// "FSLEDGER".
const MAGIC: u64 = u64::from_le_bytes(*b"FSLEDGER");
/// This build's ledger format: a ledger of another is not read (the daemon starts afresh).
pub const LEDGER_FORMAT: u64 = 1;

/// Header words.
const H_MAGIC: usize = 0;
const H_FORMAT: usize = 1;
const H_GENERATION: usize = 2;
/// 0 while being written, [`LIVE`] once complete, [`ABANDONED`] once the daemon stopped
/// keeping it.
const H_STATE: usize = 3;
const H_NODE_EPOCH: usize = 4;
const H_PID_NAMESPACE: usize = 5;
const H_ID_KEY: usize = 6; // 4 words
const H_ID_COUNTER: usize = 10;
const H_HUGETLB: usize = 11;
const H_SEGMENTS: usize = 12;
const H_OBJECTS: usize = 13;
const H_LEASES: usize = 14;
const H_PROCESSES: usize = 15;
const H_PID: usize = 16;
const HEADER_WORDS: usize = 32;

const LIVE: u64 = 1;
const ABANDONED: u64 = 2;

/// An object record: head, id, segment | writer, offset, reserved, len, creator | origin flag,
/// origin node | epoch, origin id.
const OBJECT_WORDS: usize = 9;
/// A lease record: slot | process index, count.
const LEASE_WORDS: usize = 2;
/// A process record: key, start time, pid | tag.
const PROCESS_WORDS: usize = 3;
/// A segment's entry in the header: its size and its id (the memfd's inode).
const SEGMENT_WORDS: usize = 2;

/// Object heads: what the record says (0: nothing).
const WRITING: u64 = 1;
const SEALED: u64 = 2;
const PINNED: u64 = 1 << 8;
const DELETE_PENDING: u64 = 1 << 9;
/// A process record's tag (in the high half of its second word): it names a process.
const PROCESS_LIVE: u64 = 1 << 32;
const NO_WRITER: u64 = u32::MAX as u64;

/// Where the service manager keeps a daemon's descriptors for the daemon after it.
pub trait LedgerStore: Send {
    /// A generation later than any ledger already kept (the node's boot-time clock).
    fn generation(&self) -> u64;
    /// The ids of the segments kept beside the ledger (their memfds' inodes), in order.
    fn segment_ids(&self) -> Vec<u64>;
    /// Keeps `ledger` (generation `generation`), then lets go of the ledger of generation
    /// `replaces`, if any. Done when this returns: the new ledger is kept even if the daemon is
    /// killed right after.
    fn keep(
        &mut self,
        ledger: BorrowedFd<'_>,
        generation: u64,
        replaces: Option<u64>,
    ) -> std::io::Result<()>;
    /// Lets go of the ledger of generation `generation`.
    fn forget(&mut self, generation: u64);
}

/// What a ledger's header holds, apart from its sizes.
#[derive(Debug, Clone)]
pub(super) struct Header {
    pub node_id: u32,
    pub epoch: u32,
    pub pid_namespace: u64,
    pub id_key: [u8; 32],
    pub id_counter: u64,
    pub hugetlb: bool,
    pub segments: Vec<u64>,
    /// Each segment's id (the inode of its memfd): the descriptors a daemon is passed after a
    /// crash are its segments only if their ids match.
    pub segment_ids: Vec<u64>,
}

/// How many records of each kind a ledger has room for.
#[derive(Debug, Clone, Copy)]
pub(super) struct Room {
    pub objects: usize,
    pub leases: usize,
    pub processes: usize,
}

/// The client process a lease or a reservation is recorded for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Holder {
    /// Its key (see [`feedstore_proto::handover::HandedProcess::key`]).
    pub key: u64,
    /// Its pid in the daemon's pid namespace (0 in another).
    pub pid: i32,
    /// When it started (see [`super::Process::started`]; 0 unknown).
    pub started: u64,
}

/// What one object record says.
#[derive(Debug, Clone, Copy)]
pub(super) struct Record {
    pub id: u64,
    pub segment: u32,
    pub offset: u64,
    pub reserved: u64,
    pub len: u64,
    /// Being written by this process; `None`: sealed.
    pub writer: Option<Holder>,
    pub pinned: bool,
    pub delete_pending: bool,
    pub creator: u32,
    pub origin: Option<Handle>,
}

impl Record {
    /// The object as a hand-over carries it, with the leases of each process.
    pub(super) fn handed(self, leases: Vec<(u64, u32)>) -> HandedObject {
        HandedObject {
            id: self.id,
            segment: self.segment,
            offset: self.offset,
            reserved: self.reserved,
            len: self.len,
            writer: self.writer.map(|h| h.key),
            pinned: self.pinned,
            delete_pending: self.delete_pending,
            origin: self.origin,
            creator: self.creator,
            leases,
        }
    }
}

/// No room for one more record: the daemon writes a larger ledger.
#[derive(Debug)]
pub(super) struct NoRoom;

struct Process {
    index: u32,
    /// Lease records and reservations naming it.
    refs: u32,
    /// The start time its record says (0 unknown).
    started: u64,
}

/// One ledger, mapped read-write by the daemon that keeps it.
pub struct Ledger {
    memfd: Segment,
    map: Mapping,
    generation: u64,
    room: Room,
    objects_at: usize,
    leases_at: usize,
    processes_at: usize,
    processes: HashMap<u64, Process>,
    free_processes: Vec<u32>,
    /// Lease records by (slot, process index): (record index, count).
    leases: HashMap<(u32, u32), (u32, u32)>,
    free_leases: Vec<u32>,
    /// The process index each reservation's record names, by slot.
    writers: HashMap<u32, u32>,
}

impl std::fmt::Debug for Ledger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ledger")
            .field("generation", &self.generation)
            .field("objects", &self.room.objects)
            .field("leases", &self.leases.len())
            .field("processes", &self.processes.len())
            .finish()
    }
}

fn words_for(segments: usize, room: Room) -> (usize, usize, usize, usize) {
    let objects_at = HEADER_WORDS + segments * SEGMENT_WORDS;
    let leases_at = objects_at + room.objects * OBJECT_WORDS;
    let processes_at = leases_at + room.leases * LEASE_WORDS;
    (
        objects_at,
        leases_at,
        processes_at,
        processes_at + room.processes * PROCESS_WORDS,
    )
}

impl Ledger {
    /// A new, empty ledger with `room`, its header written but not yet complete
    /// ([`Ledger::complete`]).
    pub(super) fn create(header: &Header, room: Room, generation: u64) -> std::io::Result<Ledger> {
        let (objects_at, leases_at, processes_at, words) = words_for(header.segments.len(), room);
        let memfd = Segment::create(&SegmentOptions {
            name: "feedstore-ledger".into(),
            size_bytes: (words * 8) as u64,
            huge_pages: HugePages::Off,
            prefault: false,
        })
        .map_err(std::io::Error::other)?;
        let fd = memfd.fd().try_clone_to_owned()?;
        let map = Mapping::new(fd, memfd.size_bytes(), Access::ReadWrite, false)
            .map_err(std::io::Error::other)?;
        let ledger = Ledger {
            memfd,
            map,
            generation,
            room,
            objects_at,
            leases_at,
            processes_at,
            processes: HashMap::new(),
            free_processes: (0..room.processes as u32).rev().collect(),
            leases: HashMap::new(),
            free_leases: (0..room.leases as u32).rev().collect(),
            writers: HashMap::new(),
        };
        let w = ledger.words();
        let set = |i: usize, v: u64| w[i].store(v, Ordering::Relaxed);
        set(H_MAGIC, MAGIC);
        set(H_FORMAT, LEDGER_FORMAT);
        set(H_GENERATION, generation);
        set(
            H_NODE_EPOCH,
            u64::from(header.node_id) | u64::from(header.epoch) << 32,
        );
        set(H_PID_NAMESPACE, header.pid_namespace);
        for (i, chunk) in header.id_key.chunks_exact(8).enumerate() {
            set(
                H_ID_KEY + i,
                u64::from_le_bytes(chunk.try_into().expect("8 bytes")),
            );
        }
        set(H_ID_COUNTER, header.id_counter);
        set(H_HUGETLB, u64::from(header.hugetlb));
        set(H_SEGMENTS, header.segments.len() as u64);
        set(H_OBJECTS, room.objects as u64);
        set(H_LEASES, room.leases as u64);
        set(H_PROCESSES, room.processes as u64);
        set(H_PID, u64::from(std::process::id()));
        for (i, (&size, &id)) in header.segments.iter().zip(&header.segment_ids).enumerate() {
            set(HEADER_WORDS + i * SEGMENT_WORDS, size);
            set(HEADER_WORDS + i * SEGMENT_WORDS + 1, id);
        }
        Ok(ledger)
    }

    fn words(&self) -> &[AtomicU64] {
        self.map
            .atomic_words()
            .expect("a ledger is mapped read-write")
    }

    /// Its generation.
    pub(super) fn generation(&self) -> u64 {
        self.generation
    }

    /// Its descriptor (for the service manager).
    pub(super) fn fd(&self) -> BorrowedFd<'_> {
        self.memfd.fd()
    }

    /// Marks it complete: a daemon started after this one may read it.
    pub(super) fn complete(&self) {
        self.words()[H_STATE].store(LIVE, Ordering::Release);
    }

    /// Marks it no longer kept: a daemon started after this one starts afresh.
    pub(super) fn abandon(&self) {
        self.words()[H_STATE].store(ABANDONED, Ordering::Release);
    }

    /// Records how many object ids were drawn.
    pub(super) fn set_id_counter(&self, counter: u64) {
        self.words()[H_ID_COUNTER].store(counter, Ordering::Release);
    }

    /// The process record for `key`, made if there is none; one more reference to it.
    fn process(&mut self, holder: Holder) -> Result<u32, NoRoom> {
        self.same_start(holder);
        if let Some(p) = self.processes.get_mut(&holder.key) {
            p.refs += 1;
            return Ok(p.index);
        }
        let index = self.free_processes.pop().ok_or(NoRoom)?;
        let at = self.processes_at + index as usize * PROCESS_WORDS;
        let w = self.words();
        w[at].store(holder.key, Ordering::Relaxed);
        w[at + 1].store(holder.started, Ordering::Relaxed);
        w[at + 2].store(
            u64::from(holder.pid as u32) | PROCESS_LIVE,
            Ordering::Release,
        );
        self.processes.insert(
            holder.key,
            Process {
                index,
                refs: 1,
                started: holder.started,
            },
        );
        Ok(index)
    }

    /// Where `holder` is not the process its key's record was made for (a pid given again
    /// while the first one's connection is not yet gone), no start names the key's holdings:
    /// the record's start becomes unknown.
    fn same_start(&mut self, holder: Holder) {
        if let Some(p) = self.processes.get_mut(&holder.key)
            && p.started != holder.started
            && p.started != 0
        {
            p.started = 0;
            let at = self.processes_at + p.index as usize * PROCESS_WORDS;
            self.map.atomic_words().expect("read-write")[at + 1].store(0, Ordering::Release);
        }
    }

    /// One reference fewer to the process record at `index` (`key`): cleared at the last.
    fn unref_process(&mut self, key: u64) {
        let Some(p) = self.processes.get_mut(&key) else {
            return;
        };
        p.refs -= 1;
        if p.refs == 0 {
            let index = p.index;
            self.processes.remove(&key);
            let at = self.processes_at + index as usize * PROCESS_WORDS;
            self.words()[at + 2].store(0, Ordering::Release);
            self.free_processes.push(index);
        }
    }

    fn key_of(&self, index: u32) -> u64 {
        self.words()[self.processes_at + index as usize * PROCESS_WORDS].load(Ordering::Relaxed)
    }

    /// Writes the record of the object in `slot`.
    pub(super) fn put(&mut self, slot: u32, r: &Record) -> Result<(), NoRoom> {
        if slot as usize >= self.room.objects {
            return Err(NoRoom);
        }
        let writer = match r.writer {
            Some(holder) => match self.writers.get(&slot) {
                Some(&index) if self.key_of(index) == holder.key => Some(index),
                _ => {
                    let index = self.process(holder)?;
                    self.unset_writer(slot);
                    self.writers.insert(slot, index);
                    Some(index)
                }
            },
            None => None,
        };
        let at = self.objects_at + slot as usize * OBJECT_WORDS;
        let w = self.words();
        let head = if writer.is_some() { WRITING } else { SEALED }
            | if r.pinned { PINNED } else { 0 }
            | if r.delete_pending { DELETE_PENDING } else { 0 };
        // Every field the head makes valid is written before it.
        w[at + 1].store(r.id, Ordering::Relaxed);
        w[at + 3].store(r.offset, Ordering::Relaxed);
        w[at + 4].store(r.reserved, Ordering::Relaxed);
        w[at + 5].store(r.len, Ordering::Relaxed);
        w[at + 6].store(
            u64::from(r.creator) | u64::from(r.origin.is_some()) << 32,
            Ordering::Relaxed,
        );
        let origin = r.origin.unwrap_or(Handle {
            node_id: 0,
            epoch: 0,
            id: 0,
        });
        w[at + 7].store(
            u64::from(origin.node_id) | u64::from(origin.epoch) << 32,
            Ordering::Relaxed,
        );
        w[at + 8].store(origin.id, Ordering::Relaxed);
        let segment_writer =
            |writer: Option<u32>| u64::from(r.segment) | writer.map_or(NO_WRITER, u64::from) << 32;
        // A reservation's record, or a sealed one that was none (a new record: its segment is
        // read once the head is): the word before the head. A reservation's sealing: after
        // it, which no longer reads the writer (release: never moved before the head).
        let sealing = writer.is_none() && self.writers.contains_key(&slot);
        if !sealing {
            w[at + 2].store(segment_writer(writer), Ordering::Relaxed);
        }
        w[at].store(head, Ordering::Release);
        if sealing {
            w[at + 2].store(segment_writer(None), Ordering::Release);
        }
        if writer.is_none() {
            self.unset_writer(slot);
        }
        Ok(())
    }

    fn unset_writer(&mut self, slot: u32) {
        if let Some(index) = self.writers.remove(&slot) {
            let key = self.key_of(index);
            self.unref_process(key);
        }
    }

    /// Clears the record of the object in `slot` (freed).
    pub(super) fn clear(&mut self, slot: u32) {
        if (slot as usize) < self.room.objects {
            let at = self.objects_at + slot as usize * OBJECT_WORDS;
            self.words()[at].store(0, Ordering::Release);
        }
        self.unset_writer(slot);
    }

    /// Adds `delta` to the leases `holder` holds on the object in `slot`.
    pub(super) fn lease(&mut self, slot: u32, holder: Holder, delta: i64) -> Result<(), NoRoom> {
        let key = holder.key;
        if delta > 0 {
            self.same_start(holder);
        }
        let index = self.processes.get(&key).map(|p| p.index);
        if let Some(index) = index
            && let Some((record, count)) = self.leases.get_mut(&(slot, index))
        {
            let record = *record;
            let n = u32::try_from((i64::from(*count) + delta).max(0)).unwrap_or(u32::MAX);
            *count = n;
            let at = self.leases_at + record as usize * LEASE_WORDS;
            self.words()[at + 1].store(u64::from(n), Ordering::Release);
            if n == 0 {
                self.leases.remove(&(slot, index));
                self.free_leases.push(record);
                self.unref_process(key);
            }
            return Ok(());
        }
        if delta <= 0 {
            return Ok(());
        }
        let n = u32::try_from(delta).unwrap_or(u32::MAX);
        let Some(&record) = self.free_leases.last() else {
            return Err(NoRoom);
        };
        let index = self.process(holder)?;
        self.free_leases.pop();
        let at = self.leases_at + record as usize * LEASE_WORDS;
        let w = self.words();
        w[at].store(u64::from(slot) | u64::from(index) << 32, Ordering::Relaxed);
        w[at + 1].store(u64::from(n), Ordering::Release);
        self.leases.insert((slot, index), (record, n));
        Ok(())
    }
}

/// A ledger's table, read back by a daemon started after the one that kept it.
#[derive(Debug)]
pub struct Recovered {
    /// The table, as a hand-over would carry it: every process named has no pidfd yet (the
    /// daemon finds the processes that still run, [`forget_processes`] the rest).
    pub handover: Handover,
    /// The ledger's generation (of several, the latest is the table).
    pub generation: u64,
    /// Each segment's id (the inode of its memfd), in order.
    pub segment_ids: Vec<u64>,
    /// When each process named started (by key; 0 unknown): with its pid, what tells it from
    /// another process given the same pid since.
    pub started: HashMap<u64, u64>,
}

/// Maps a ledger (`access`), if it is one this build reads: its mapping and length.
fn map_ledger(fd: OwnedFd, access: Access) -> Option<Mapping> {
    let file = std::fs::File::from(fd);
    let len = file.metadata().ok()?.len();
    if len < (HEADER_WORDS * 8) as u64 {
        return None;
    }
    let map = Mapping::new(OwnedFd::from(file), len, access, false).ok()?;
    (map.load_word_relaxed(H_MAGIC) == MAGIC && map.load_word_relaxed(H_FORMAT) == LEDGER_FORMAT)
        .then_some(map)
}

/// The generation of a ledger, complete or not; `None` when it is not one this build reads.
/// Of the ledgers a daemon is passed, only the one of the highest generation may be its table.
pub fn generation(fd: &OwnedFd) -> Option<u64> {
    let map = map_ledger(fd.try_clone().ok()?, Access::ReadOnly)?;
    Some(map.load_word_relaxed(H_GENERATION))
}

/// Marks a ledger another daemon kept abandoned: no daemon reads it any more (the daemon that
/// read it back keeps its own, or none).
pub fn abandon(fd: &OwnedFd) -> std::io::Result<()> {
    let map = map_ledger(fd.try_clone()?, Access::ReadWrite)
        .ok_or_else(|| std::io::Error::other("not a ledger"))?;
    map.atomic_words().expect("mapped read-write")[H_STATE].store(ABANDONED, Ordering::Release);
    Ok(())
}

/// Reads a ledger a daemon kept: `Ok(None)` when it is not one this build reads or was not
/// complete (abandoned, or killed while being written), an error when it contradicts itself.
pub fn read(fd: OwnedFd) -> Result<Option<Recovered>, Inconsistent> {
    let bad = |why: String| Inconsistent(format!("the ledger: {why}"));
    let Some(map) = map_ledger(fd, Access::ReadOnly) else {
        return Ok(None);
    };
    let len = map.len() as u64;
    let r = |i: usize| map.load_word_relaxed(i);
    if r(H_STATE) != LIVE {
        return Ok(None);
    }
    std::sync::atomic::fence(Ordering::Acquire);
    let count = |i: usize| usize::try_from(r(i)).unwrap_or(usize::MAX);
    let (segments, room) = (
        count(H_SEGMENTS),
        Room {
            objects: count(H_OBJECTS),
            leases: count(H_LEASES),
            processes: count(H_PROCESSES),
        },
    );
    let words = (len / 8) as usize;
    let fits = [segments, room.objects, room.leases, room.processes]
        .iter()
        .all(|&n| n <= words);
    // (Each count at most the words: the sum below cannot overflow.)
    if !fits || words_for(segments, room).3 > words {
        return Err(bad(format!("{len} bytes hold less than its header says")));
    }
    let (objects_at, leases_at, processes_at, _) = words_for(segments, room);
    let mut processes: HashMap<u32, (u64, i32)> = HashMap::new();
    let mut started = HashMap::new();
    for i in 0..room.processes {
        let at = processes_at + i * PROCESS_WORDS;
        let tag = r(at + 2);
        if tag & PROCESS_LIVE != 0 {
            processes.insert(i as u32, (r(at), tag as u32 as i32));
            started.insert(r(at), r(at + 1));
        }
    }
    let mut leases: HashMap<u32, HashMap<u64, u32>> = HashMap::new();
    for i in 0..room.leases {
        let at = leases_at + i * LEASE_WORDS;
        let n = r(at + 1);
        if n == 0 {
            continue;
        }
        let (slot, index) = (r(at) as u32, (r(at) >> 32) as u32);
        let &(key, _) = processes
            .get(&index)
            .ok_or_else(|| bad(format!("lease record {i} names no process")))?;
        let held = leases.entry(slot).or_default().entry(key).or_default();
        *held = held.saturating_add(u32::try_from(n).unwrap_or(u32::MAX));
    }
    let mut objects = Vec::new();
    let mut named = std::collections::BTreeSet::new();
    for slot in 0..room.objects {
        let at = objects_at + slot * OBJECT_WORDS;
        let head = r(at);
        let writer = match head & 0xff {
            0 => continue,
            SEALED => None,
            WRITING => {
                let index = (r(at + 2) >> 32) as u32;
                let &(key, _) = processes.get(&index).ok_or_else(|| {
                    bad(format!("the reservation in slot {slot} names no process"))
                })?;
                Some(key)
            }
            other => return Err(bad(format!("slot {slot} is in state {other}"))),
        };
        let origin = (r(at + 6) >> 32 & 1 == 1).then(|| Handle {
            node_id: r(at + 7) as u32,
            epoch: (r(at + 7) >> 32) as u32,
            id: r(at + 8),
        });
        let mut held: Vec<(u64, u32)> = leases
            .remove(&(slot as u32))
            .map(|m| m.into_iter().collect())
            .unwrap_or_default();
        held.sort_unstable();
        named.extend(writer);
        named.extend(held.iter().map(|&(k, _)| k));
        objects.push(HandedObject {
            id: r(at + 1),
            segment: r(at + 2) as u32,
            offset: r(at + 3),
            reserved: r(at + 4),
            len: r(at + 5),
            writer,
            pinned: head & PINNED != 0,
            delete_pending: head & DELETE_PENDING != 0,
            origin,
            creator: r(at + 6) as u32,
            leases: held,
        });
    }
    // Deleted, and held only by the daemon's own connections (not kept): nobody can find or
    // hold it any more.
    objects.retain(|o| !(o.delete_pending && o.leases.is_empty()));
    if let Some(slot) = leases.keys().next() {
        return Err(bad(format!("leases on slot {slot}, which holds no object")));
    }
    let pids: HashMap<u64, i32> = processes.into_values().collect();
    let mut id_key = [0u8; 32];
    for (i, chunk) in id_key.chunks_exact_mut(8).enumerate() {
        chunk.copy_from_slice(&r(H_ID_KEY + i).to_le_bytes());
    }
    let handover = Handover {
        format: HANDOVER_FORMAT,
        pid: r(H_PID) as u32,
        pid_namespace: r(H_PID_NAMESPACE),
        node_id: r(H_NODE_EPOCH) as u32,
        epoch: (r(H_NODE_EPOCH) >> 32) as u32,
        id_key,
        id_counter: r(H_ID_COUNTER),
        segments: (0..segments)
            .map(|i| r(HEADER_WORDS + i * SEGMENT_WORDS))
            .collect(),
        hugetlb: r(H_HUGETLB) != 0,
        peer_listener: false,
        metrics_listener: false,
        objects,
        processes: named
            .into_iter()
            .filter(|&key| key != 0)
            .map(|key| HandedProcess {
                key,
                pid: pids.get(&key).copied().unwrap_or(0),
                pidfd: false,
            })
            .collect(),
    };
    Ok(Some(Recovered {
        handover,
        generation: r(H_GENERATION),
        segment_ids: (0..segments)
            .map(|i| r(HEADER_WORDS + i * SEGMENT_WORDS + 1))
            .collect(),
        started,
    }))
}

/// Drops from a table read back what processes that are gone held: their leases, their
/// reservations (aborted) and a deleted object nobody holds any more.
pub fn forget_processes(h: &mut Handover, gone: &std::collections::HashSet<u64>) {
    h.processes.retain(|p| !gone.contains(&p.key));
    h.objects.retain_mut(|o| {
        o.leases.retain(|(key, _)| !gone.contains(key));
        let aborted = o.writer.is_some_and(|key| gone.contains(&key));
        !(aborted || o.delete_pending && o.leases.is_empty())
    });
}

/// The most bytes a ledger may take for a store of `capacity` bytes: a sixteenth of it, at
/// least 64 MiB.
pub fn max_ledger_bytes(capacity: u64) -> u64 {
    (capacity / 16).max(64 << 20)
}

/// A ledger and where it is kept.
pub(super) struct Kept {
    ledger: Ledger,
    store: Box<dyn LedgerStore>,
}

impl std::fmt::Debug for Kept {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.ledger.fmt(f)
    }
}

impl Objects {
    /// Keeps a ledger of this table from now on, in `store` (the service manager's file
    /// descriptor store): a daemon started after this one is killed serves the same objects.
    pub fn keep_ledger(&mut self, mut store: Box<dyn LedgerStore>) -> std::io::Result<()> {
        let replaces = self.ledger.take().map(|k| {
            k.ledger.abandon();
            k.ledger.generation()
        });
        let ledger = self.write_ledger(&mut *store, replaces)?;
        tracing::info!(
            generation = ledger.generation(),
            objects = self.by_id.len(),
            "the object table is kept in a ledger the service manager holds"
        );
        self.ledger = Some(Kept { ledger, store });
        Ok(())
    }

    /// Stops keeping the ledger (the daemon handed itself over, or stops for good): it is
    /// marked abandoned and the store lets go of it, so no daemon after this one reads it.
    pub fn abandon_ledger(&mut self) {
        if let Some(mut kept) = self.ledger.take() {
            kept.ledger.abandon();
            kept.store.forget(kept.ledger.generation());
        }
    }

    /// The generation of the ledger kept, if any.
    pub fn ledger_generation(&self) -> Option<u64> {
        self.ledger.as_ref().map(|k| k.ledger.generation())
    }

    /// A new ledger of the whole table, twice the room it needs, kept in `store` (in place of
    /// the ledger of generation `replaces`).
    fn write_ledger(
        &self,
        store: &mut dyn LedgerStore,
        replaces: Option<u64>,
    ) -> std::io::Result<Ledger> {
        let mut pairs = 0usize;
        let mut processes = std::collections::HashSet::new();
        for (&id, c) in &self.conns {
            if let Some(holder) = self.process_key(id, c) {
                pairs += c.leases.len();
                processes.insert(holder.key);
            }
        }
        let room = Room {
            objects: (self.slots.len() * 2).max(1024),
            leases: (pairs * 2).max(1024),
            processes: (processes.len() * 2).max(64),
        };
        // Bounded by the store: a table of many small objects would make a ledger as large
        // as the memory it describes (a record of 72 bytes an object, room for twice as
        // many), so past a sixteenth of the store the daemon keeps none.
        let bytes = words_for(self.segments.len(), room).3 as u64 * 8;
        let most = max_ledger_bytes(self.capacity());
        if bytes > most {
            return Err(std::io::Error::other(format!(
                "a ledger of {} objects would take {}, over a sixteenth of the store ({})",
                self.slots.len(),
                crate::format_bytes(bytes),
                crate::format_bytes(most)
            )));
        }
        let generation = store
            .generation()
            .max(replaces.map_or(0, |g| g.saturating_add(1)));
        let header = Header {
            node_id: self.node_id,
            epoch: self.epoch,
            pid_namespace: pid_namespace(),
            id_key: self.ids.key,
            id_counter: self.ids.counter,
            hugetlb: self.hugetlb,
            segments: self
                .segments
                .iter()
                .map(crate::alloc::Allocator::capacity)
                .collect(),
            segment_ids: store.segment_ids(),
        };
        if header.segment_ids.len() != header.segments.len() {
            return Err(std::io::Error::other(
                "the segments kept are not the table's",
            ));
        }
        let mut ledger = Ledger::create(&header, room, generation)?;
        let no_room = |_| std::io::Error::other("a ledger sized for the table has no room for it");
        for slot in 0..self.slots.len() as u32 {
            if let Some(record) = self.record(slot) {
                ledger.put(slot, &record).map_err(no_room)?;
            }
        }
        for (&id, c) in &self.conns {
            if let Some(holder) = self.process_key(id, c) {
                for (&slot, &n) in &c.leases {
                    ledger.lease(slot, holder, i64::from(n)).map_err(no_room)?;
                }
            }
        }
        ledger.complete();
        store.keep(ledger.fd(), generation, replaces)?;
        Ok(ledger)
    }

    /// The process a client connection's holdings are kept for in a ledger or a hand-over;
    /// `None` for the daemon's own connections (but those holding for a process since a
    /// hand-over).
    pub(super) fn process_key(&self, id: ConnId, c: &Conn) -> Option<Holder> {
        if c.info.internal && self.orphans.get(&c.info.process.key) != Some(&id) {
            return None;
        }
        // A connection whose process has no key but a pidfd (no pidfs: a kernel before 6.9, in
        // another pid namespace) is a process of its own, unnamed: what it holds is held until
        // its pidfd says it exited. Unnamed keys never match a new connection, so they are
        // numbered afresh by this daemon's connection ids (unique here; a predecessor's
        // numbers could clash with them).
        let key = match c.info.process.key {
            0 if c.info.process.pidfd.is_some() => UNNAMED_KEY | id,
            key if key & UNNAMED_KEY != 0 => UNNAMED_KEY | id,
            key => key,
        };
        Some(Holder {
            key,
            pid: c.info.pid,
            started: c.info.process.started,
        })
    }

    /// What a ledger says of the object in `slot`: `None` when there is none, or it is being
    /// written by the daemon's own connection (a pull: the successor pulls it again).
    pub(super) fn record(&self, slot: u32) -> Option<Record> {
        let o = self.slots.get(slot as usize)?.as_ref()?;
        let writer = match o.state {
            State::Sealed => None,
            State::Writing { owner } => Some(self.process_key(owner, self.conns.get(&owner)?)?),
        };
        Some(Record {
            id: o.id,
            segment: o.segment,
            offset: o.block.offset,
            reserved: o.block.len,
            len: o.len,
            writer,
            pinned: o.pinned,
            delete_pending: o.delete_pending,
            creator: o.creator,
            origin: o.origin,
        })
    }

    /// Applies `change` to the ledger kept, if any; where it finds no room, a ledger twice the
    /// size is written from the table (which has the change already) in its place. If that
    /// fails the ledger is abandoned: a daemon started after this one starts afresh.
    fn ledger_change(&mut self, change: impl FnOnce(&mut Ledger) -> Result<(), NoRoom>) {
        let Some(kept) = self.ledger.as_mut() else {
            return;
        };
        if change(&mut kept.ledger).is_ok() {
            return;
        }
        let mut kept = self.ledger.take().expect("seen above");
        let replaces = kept.ledger.generation();
        match self.write_ledger(&mut *kept.store, Some(replaces)) {
            Ok(ledger) => {
                tracing::debug!(generation = ledger.generation(), "the ledger grew");
                // (Kept no more: marked so, in case the store did not let go of it.)
                kept.ledger.abandon();
                kept.ledger = ledger;
                self.ledger = Some(kept);
            }
            Err(e) => {
                kept.ledger.abandon();
                tracing::error!(
                    error = %e,
                    "cannot grow the ledger: the object table is no longer kept (a daemon \
                     started after this one is killed starts afresh)"
                );
            }
        }
    }

    /// Records the object in `slot` as it now is (or its end, when it is gone).
    pub(super) fn ledger_object(&mut self, slot: u32) {
        if self.ledger.is_none() {
            return;
        }
        let counter = self.ids.counter;
        match self.record(slot) {
            Some(record) => self.ledger_change(|l| {
                l.set_id_counter(counter);
                l.put(slot, &record)
            }),
            None => self.ledger_change(|l| {
                l.clear(slot);
                Ok(())
            }),
        }
    }

    /// Records `delta` leases of `holder` (a process, from [`Objects::process_key`]) on `slot`.
    pub(super) fn ledger_lease(&mut self, holder: Option<Holder>, slot: u32, delta: i64) {
        if let (Some(_), Some(holder)) = (&self.ledger, holder) {
            self.ledger_change(|l| l.lease(slot, holder, delta));
        }
    }

    /// The holder [`Objects::ledger_lease`] records for `conn`.
    pub(super) fn holder(&self, conn: ConnId) -> Option<Holder> {
        self.ledger.as_ref()?;
        self.process_key(conn, self.conns.get(&conn)?)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use feedstore_proto::{Role, Status};

    use super::*;
    use crate::objects::{ClientInfo, Process};

    /// The service manager's store, as a test holds it: every ledger kept, by generation.
    #[derive(Clone)]
    struct Kept(Arc<Mutex<Vec<(u64, OwnedFd)>>>, usize);

    impl LedgerStore for Kept {
        fn generation(&self) -> u64 {
            1000
        }
        fn segment_ids(&self) -> Vec<u64> {
            (0..self.1 as u64).map(|i| 77 + i).collect()
        }
        fn keep(
            &mut self,
            ledger: BorrowedFd<'_>,
            generation: u64,
            replaces: Option<u64>,
        ) -> std::io::Result<()> {
            let mut kept = self.0.lock().unwrap();
            kept.push((generation, ledger.try_clone_to_owned()?));
            kept.retain(|(g, _)| Some(*g) != replaces);
            Ok(())
        }
        fn forget(&mut self, generation: u64) {
            self.0.lock().unwrap().retain(|(g, _)| *g != generation);
        }
    }

    impl Kept {
        /// A store for the ledger of a table over `segments` segments.
        fn new(segments: usize) -> Kept {
            Kept(Arc::default(), segments)
        }

        /// The latest ledger, read back.
        fn read(&self) -> Recovered {
            let kept = self.0.lock().unwrap();
            assert_eq!(kept.len(), 1, "one ledger kept at a time");
            read(kept[0].1.try_clone().unwrap())
                .unwrap()
                .expect("a complete ledger")
        }
    }

    fn client(o: &mut Objects, role: Role, key: u64, internal: bool) -> ConnId {
        o.connect(ClientInfo {
            role,
            uid: 0,
            pid: key as i32,
            process: Process {
                key,
                pidfd: None,
                started: key * 3,
            },
            name: String::new(),
            internal,
            capped: false,
        })
    }

    /// A hand-over with its objects by id, to compare as sets.
    fn sorted(mut h: Handover) -> Handover {
        h.objects.sort_by_key(|o| o.id);
        h.pid = 0;
        h
    }

    /// After every change, the ledger reads back as the hand-over of the table would be.
    #[test]
    fn the_ledger_reads_back_as_the_table_hands_over() {
        let mut o = Objects::new(7, 99, &[1 << 20, 1 << 20], false);
        let kept = Kept::new(2);
        o.keep_ledger(Box::new(kept.clone())).unwrap();
        let check = |o: &Objects, what: &str| {
            let back = kept.read();
            assert_eq!(back.generation, 1000);
            assert_eq!(
                sorted(back.handover),
                sorted(o.hand_over(false, false).0),
                "after {what}"
            );
        };
        check(&o, "nothing");
        let w = client(&mut o, Role::Writer, 10, false);
        let r = client(&mut o, Role::Reader, 20, false);
        let r_again = client(&mut o, Role::Reader, 20, false);
        let stream = client(&mut o, Role::Reader, 30, true);
        let a = o.create(w, 1000, true).unwrap().handle;
        check(&o, "a reservation");
        o.seal(w, a).unwrap();
        check(&o, "a seal");
        let b = o.create(w, 3000, false).unwrap().handle;
        o.seal(w, b).unwrap();
        o.get(r, a).unwrap();
        o.get(r_again, a).unwrap();
        o.get(r, b).unwrap();
        o.get(stream, b).unwrap();
        check(
            &o,
            "leases of one process on two connections, and a stream's",
        );
        let started = kept.read().started;
        assert_eq!(
            (started.get(&10), started.get(&20), started.get(&30)),
            (None, Some(&60), None),
            "when each process holding something started (the reader); not the writer's, \
             which holds nothing now, nor the stream's"
        );
        // Another process under the same key (a pid given again): no start names the key.
        let again = o.connect(ClientInfo {
            role: Role::Reader,
            uid: 0,
            pid: 20,
            process: Process {
                key: 20,
                pidfd: None,
                started: 999,
            },
            name: String::new(),
            internal: false,
            capped: false,
        });
        o.get(again, b).unwrap();
        assert_eq!(kept.read().started.get(&20), Some(&0));
        o.release(again, b).unwrap();
        o.delete(w, a).unwrap();
        check(&o, "a deferred delete");
        o.release(r, a).unwrap();
        check(&o, "a release");
        o.disconnect(r_again);
        check(&o, "a disconnect");
        let writing = o.create(w, 500, false).unwrap().handle;
        o.disconnect(w);
        check(&o, "a writer gone (its reservation aborted)");
        assert_eq!(o.get(r, writing), Err(Status::NotFound));
        o.release(r, b).unwrap();
        check(&o, "the last of a process's leases returned");
        let back = kept.read().handover;
        assert!(back.processes.is_empty(), "{:?}", back.processes);
        assert_eq!(back.id_counter, 3, "ids drawn");
    }

    /// Any sequence of what clients do leaves a ledger that reads back as the table's
    /// hand-over (a pseudo-random walk through creates, seals, aborts, gets, releases,
    /// deletes, connects and disconnects, with small rooms so that it grows too).
    #[test]
    fn random_work_leaves_the_ledger_true() {
        let mut o = Objects::new(3, 4, &[1 << 16, 1 << 16], false);
        let kept = Kept::new(2);
        o.keep_ledger(Box::new(kept.clone())).unwrap();
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move |n: usize| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed % n as u64) as usize
        };
        let mut conns: Vec<ConnId> = (0..4)
            .map(|i| client(&mut o, Role::Writer, 10 + i % 3, false))
            .collect();
        let mut handles: Vec<Handle> = Vec::new();
        for step in 0..3000 {
            let conn = conns[next(conns.len())];
            let pick = |next: &mut dyn FnMut(usize) -> usize| {
                (!handles.is_empty()).then(|| handles[next(handles.len())])
            };
            match next(9) {
                0 | 1 => {
                    if let Ok(c) = o.create(conn, 1 + next(3000) as u64, next(8) == 0) {
                        handles.push(c.handle);
                    }
                }
                2 | 3 => drop(pick(&mut next).map(|h| o.seal(conn, h))),
                4 => drop(pick(&mut next).map(|h| o.abort(conn, h))),
                5 => drop(pick(&mut next).map(|h| o.get(conn, h))),
                6 => drop(pick(&mut next).map(|h| o.release(conn, h))),
                7 => drop(pick(&mut next).map(|h| o.delete(conn, h))),
                _ => {
                    let i = next(conns.len());
                    o.disconnect(conns[i]);
                    conns[i] = client(&mut o, Role::Writer, 10 + next(5) as u64, false);
                }
            }
            if step % 7 == 0 {
                assert_eq!(
                    sorted(kept.read().handover),
                    sorted(o.hand_over(false, false).0),
                    "step {step}"
                );
            }
        }
    }

    /// A ledger with no room for a change is written again, twice the size, and the old one
    /// let go of; what it says stays the table's.
    #[test]
    fn a_full_ledger_is_written_again_larger() {
        let mut o = Objects::new(1, 2, &[64 << 20], false);
        let kept = Kept::new(1);
        o.keep_ledger(Box::new(kept.clone())).unwrap();
        let first = o.ledger_generation().unwrap();
        let w = client(&mut o, Role::Writer, 10, false);
        let readers: Vec<ConnId> = (0..80)
            .map(|i| client(&mut o, Role::Reader, 100 + i, false))
            .collect();
        let mut handles = Vec::new();
        for _ in 0..1500 {
            let h = o.create(w, 64, false).unwrap().handle;
            o.seal(w, h).unwrap();
            handles.push(h);
        }
        for (i, h) in handles.iter().enumerate() {
            o.get(readers[i % readers.len()], *h).unwrap();
        }
        assert!(o.ledger_generation().unwrap() > first, "written again");
        assert_eq!(
            sorted(kept.read().handover),
            sorted(o.hand_over(false, false).0)
        );
        let back = kept.read().handover;
        assert_eq!(back.objects.len(), 1500);
        assert_eq!(
            back.processes.len(),
            80,
            "the readers; the writer holds nothing"
        );
    }

    /// A ledger that is not complete, or was abandoned, is no table.
    #[test]
    fn an_incomplete_or_abandoned_ledger_is_not_read() {
        let header = Header {
            node_id: 1,
            epoch: 2,
            pid_namespace: 0,
            id_key: [7; 32],
            id_counter: 0,
            hugetlb: false,
            segments: vec![1 << 20],
            segment_ids: vec![42],
        };
        let room = Room {
            objects: 8,
            leases: 8,
            processes: 8,
        };
        let ledger = Ledger::create(&header, room, 5).unwrap();
        let fd = || ledger.fd().try_clone_to_owned().unwrap();
        assert!(read(fd()).unwrap().is_none(), "being written");
        assert_eq!(
            generation(&fd()),
            Some(5),
            "its generation, complete or not"
        );
        ledger.complete();
        let back = read(fd()).unwrap().unwrap();
        assert_eq!((back.generation, back.handover.epoch), (5, 2));
        assert_eq!(back.handover.id_key, [7; 32]);
        assert_eq!(back.segment_ids, [42]);
        abandon(&fd()).unwrap();
        assert!(read(fd()).unwrap().is_none(), "abandoned by a daemon after");
        assert_eq!(generation(&fd()), Some(5));
    }

    /// What gone processes held is dropped from a table read back.
    #[test]
    fn what_gone_processes_held_is_forgotten() {
        let mut o = Objects::new(1, 2, &[1 << 20], false);
        let kept = Kept::new(1);
        o.keep_ledger(Box::new(kept.clone())).unwrap();
        let (w, r, gone) = (
            client(&mut o, Role::Writer, 10, false),
            client(&mut o, Role::Reader, 20, false),
            client(&mut o, Role::Writer, 30, false),
        );
        let a = o.create(w, 100, false).unwrap().handle;
        o.seal(w, a).unwrap();
        let deleted = o.create(w, 100, false).unwrap().handle;
        o.seal(w, deleted).unwrap();
        o.get(r, a).unwrap();
        o.get(gone, a).unwrap();
        o.get(gone, deleted).unwrap();
        o.delete(w, deleted).unwrap();
        o.create(gone, 100, false).unwrap();
        let mut h = kept.read().handover;
        forget_processes(&mut h, &[30].into_iter().collect());
        assert_eq!(
            h.objects.len(),
            1,
            "the reservation aborted, the deleted object freed"
        );
        assert_eq!(h.objects[0].leases, [(20, 1)]);
        assert_eq!(h.processes.iter().map(|p| p.key).collect::<Vec<_>>(), [20]);
    }
}
