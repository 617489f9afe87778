//! The node's state every task of the daemon shares: the locks over the core's object table and
//! streams, the segments and their read-only descriptors, the daemon's own mappings for pulls,
//! the limits, who may connect and how many are connected, and the wake-ups of requests that
//! wait. The socket server (`server`), the cluster (`cluster`) and the metrics endpoint take it;
//! it knows none of them.
//!
//! The object table and the streams sit behind locks that abort the process if a panic unwinds
//! while one is held ([`Critical`]): clients then see the daemon gone (`Disconnected`, which
//! they handle), never a daemon serving from a half-updated allocator.

use std::collections::{HashMap, HashSet};
use std::ops::{Deref, DerefMut};
use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use feedstore_proto::{Role, SEGMENT_HUGETLB, SEGMENT_WRITABLE, SegmentInfo};
use feedstore_shm::{Access, Mapping, Segment};
use tokio::sync::watch;

use crate::config::Limits;
use crate::credentials::Credentials;
use crate::objects::{ConnId, Objects};
use crate::streams::Streams;

/// Who may connect, and in which role, decided from the client's credentials.
#[derive(Debug, Clone)]
pub struct AccessPolicy {
    /// Uids allowed as readers and writers (the daemon's own uid and root are always allowed).
    pub uids: HashSet<u32>,
    /// Uids allowed as readers only: their hello as a writer is refused.
    pub reader_uids: HashSet<u32>,
    /// Peers in this group, as primary or supplementary group, are allowed too.
    pub gid: Option<u32>,
}

impl AccessPolicy {
    /// Whether `client` may connect as a writer.
    pub(crate) fn may_write(&self, client: &Credentials) -> bool {
        client.uid == 0
            || self.uids.contains(&client.uid)
            || self.gid.is_some_and(|g| client.groups.contains(&g))
    }

    /// Why `client` may not connect as `role`, if it may not.
    pub(crate) fn refusal(&self, client: &Credentials, role: Role) -> Option<String> {
        if self.may_write(client) {
            return None;
        }
        match (self.reader_uids.contains(&client.uid), role) {
            (true, Role::Reader) => None,
            (true, Role::Writer) => Some(format!(
                "uid {} may only read from this feedstored (--allow-reader-uid)",
                client.uid
            )),
            (false, _) => Some(format!(
                "uid {} is not allowed by this feedstored; add it with --allow-uid, \
                 --allow-reader-uid or --socket-group",
                client.uid
            )),
        }
    }
}

/// A lock over state a panic could leave half-updated. If a panic starts while it is held, the
/// process aborts instead of unlocking: no connection can go on serving from a torn allocator
/// or object table, and every client sees the daemon gone. (Taken while a panic elsewhere
/// unwinds, to reclaim a connection's holdings, it unlocks normally.)
pub struct Critical<'a, T> {
    guard: MutexGuard<'a, T>,
    /// Whether this thread was already unwinding when it locked.
    unwinding_at_lock: bool,
}

impl<'a, T> Critical<'a, T> {
    fn lock(mutex: &'a Mutex<T>) -> Self {
        match mutex.lock() {
            Ok(guard) => Critical {
                guard,
                unwinding_at_lock: std::thread::panicking(),
            },
            // Unreachable: a panic under the lock aborts before it can poison it.
            Err(_) => abort_torn("a poisoned lock"),
        }
    }
}

impl<T> Deref for Critical<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.guard
    }
}

impl<T> DerefMut for Critical<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.guard
    }
}

impl<T> Drop for Critical<'_, T> {
    fn drop(&mut self) {
        if std::thread::panicking() && !self.unwinding_at_lock {
            abort_torn("a panic while the daemon's state was locked");
        }
    }
}

fn abort_torn(what: &str) -> ! {
    tracing::error!(
        "{what}: the object table may be half-updated; aborting (clients see the daemon gone)"
    );
    eprintln!("feedstored: {what}; aborting so no client is served from torn state");
    std::process::abort();
}

/// Connections open now, in all and per uid.
#[derive(Debug, Default)]
struct Admissions {
    total: usize,
    by_uid: HashMap<u32, usize>,
}

/// State shared by all connections.
pub struct Shared {
    objects: Mutex<Objects>,
    streams: Mutex<Streams>,
    pub(crate) segments: Vec<Segment>,
    pub(crate) readonly_fds: Vec<OwnedFd>,
    /// The daemon's own read-write mapping of each segment, when it belongs to a cluster: only
    /// pulls touch object bytes through it (sending ranges to peers, landing copies).
    mappings: Vec<Arc<Mapping>>,
    pub(crate) node_id: u32,
    pub(crate) epoch: u32,
    pub(crate) max_frame_bytes: u32,
    pub(crate) max_create_wait_ms: u32,
    pub(crate) policy: AccessPolicy,
    pub(crate) limits: Limits,
    admissions: Mutex<Admissions>,
    /// Bumped when space is freed or becomes evictable; creates waiting for room watch it.
    pub(crate) space: watch::Sender<u64>,
    /// Follows [`Streams::version`]; stream waiters watch it.
    pub(crate) stream_events: watch::Sender<u64>,
    /// Consumers waiting for their stream to be created.
    pub(crate) attaches_waiting: AttachWaits,
    /// The daemon's uid (it and root may take the daemon over).
    pub(crate) daemon_uid: u32,
    /// A hand-over to a successor under way, or done.
    pub(crate) handoff: crate::handoff::Handoff,
    /// How it came by its store (for the metrics).
    pub started: Started,
    /// When it started, in seconds since the Unix epoch (for the metrics).
    pub started_at: u64,
}

/// How long a consumer whose wait for its stream ran out still counts as waiting: a client
/// waits in slices (100 ms each, checking for an interrupt between), and the gauge must not
/// drop to zero between one slice and the next.
const ATTACH_LINGER: Duration = Duration::from_secs(1);

/// The consumers waiting for their stream to be created, one entry per connection (so at most
/// as many as there are connections): waiting now, or since the instant its last wait ran out.
#[derive(Debug, Default)]
pub(crate) struct AttachWaits(Mutex<HashMap<ConnId, Option<Instant>>>);

impl AttachWaits {
    /// Connection `id` is waiting for its stream.
    pub(crate) fn begin(&self, id: ConnId) {
        self.lock().insert(id, None);
    }

    /// Connection `id`'s wait ran out with no stream: it counts for [`ATTACH_LINGER`] more,
    /// the client may be about to ask again.
    pub(crate) fn ran_out(&self, id: ConnId) {
        if let Some(since) = self.lock().get_mut(&id) {
            *since = Some(Instant::now());
        }
    }

    /// Connection `id` waits no more: attached, refused, or gone.
    pub(crate) fn end(&self, id: ConnId) {
        self.lock().remove(&id);
    }

    /// How many wait now or ran out within [`ATTACH_LINGER`] (forgetting the others).
    fn count(&self) -> u64 {
        let mut waits = self.lock();
        waits.retain(|_, since| since.is_none_or(|t| t.elapsed() < ATTACH_LINGER));
        waits.len() as u64
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<ConnId, Option<Instant>>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// How a daemon came by the store it serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Started {
    /// Made afresh.
    Fresh,
    /// Taken over from a running daemon (`--takeover`).
    TakenOver,
    /// Read back from what the service manager kept for it after a crash (`--fd-store`).
    Restored,
}

impl Started {
    /// Its name in metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Started::Fresh => "fresh",
            Started::TakenOver => "takeover",
            Started::Restored => "restored",
        }
    }
}

/// The daemon-wide settings a [`Shared`] serves with.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    /// This node's id.
    pub node_id: u32,
    /// This daemon's start epoch.
    pub epoch: u32,
    /// Who may connect.
    pub policy: AccessPolicy,
    /// The largest request payload accepted.
    pub max_frame_bytes: u32,
    /// The longest a create may wait for space.
    pub max_create_wait_ms: u32,
    /// What clients may hold.
    pub limits: Limits,
    /// The daemon's uid (may close any stream).
    pub daemon_uid: u32,
    /// Whether this node is part of a cluster: then the daemon maps each segment read-write for
    /// the pulls (sending ranges to peers, landing copies).
    pub cluster: bool,
    /// How it came by its store.
    pub started: Started,
}

impl Shared {
    /// Allocates and zeroes the segments' memory that is not yet (shmem: hugetlbfs segments
    /// were at creation), and builds the page tables of the daemon's own mappings for pulls;
    /// on a thread of its own, while the daemon serves (`Segment::prefault` is safe under
    /// writers). A failure is logged: the pages are then allocated as they are first written,
    /// as with `--prefault false`.
    pub fn prefault(&self) {
        let started = std::time::Instant::now();
        for (i, segment) in self.segments.iter().enumerate() {
            if segment.is_hugetlb() {
                continue;
            }
            // One thread: the daemon serves meanwhile, and its clients need the cores.
            if let Err(e) = segment.prefault(1) {
                tracing::error!(segment = i, error = %feedstore_proto::error_chain(&e), "cannot pre-fault the store's memory: its pages are allocated as they are first written");
                return;
            }
        }
        for mapping in &self.mappings {
            mapping.populate_write(0, mapping.len() as u64);
        }
        tracing::info!(
            elapsed_ms = started.elapsed().as_millis() as u64,
            "shared memory pre-faulted"
        );
    }

    /// Wraps the daemon's segments and object state.
    pub fn new(
        objects: Objects,
        segments: Vec<Segment>,
        config: ServeConfig,
    ) -> Result<Shared, feedstore_shm::ShmError> {
        let readonly_fds = segments
            .iter()
            .map(Segment::reopen_readonly)
            .collect::<Result<_, _>>()?;
        // Mapped only where pulls use them, with page tables built now (MAP_POPULATE) when the
        // pages exist anyway (pre-faulted): a pull then lands bytes at memory speed instead of
        // taking a page fault every 4 KiB.
        let mappings = segments
            .iter()
            .filter(|_| config.cluster)
            .map(|s| {
                let fd =
                    s.fd()
                        .try_clone_to_owned()
                        .map_err(|source| feedstore_shm::ShmError::Map {
                            len: s.size_bytes(),
                            access: Access::ReadWrite,
                            source,
                        })?;
                // (Populated with the pre-fault, once the pages exist: `Shared::prefault`.)
                Mapping::new(fd, s.size_bytes(), Access::ReadWrite, false)
                    .map(|m| Arc::new(m.without_private_views()))
            })
            .collect::<Result<_, _>>()?;
        Ok(Shared {
            objects: Mutex::new({
                let share = u128::from(objects.capacity())
                    * u128::from(config.limits.reader_lease_percent)
                    / 100;
                let share = u64::try_from(share).expect("at most the capacity");
                objects
                    .with_lease_limit(config.limits.max_leases_per_connection)
                    .with_capped_lease_bytes(share)
            }),
            streams: Mutex::new(Streams::new(&config.limits.streams(), config.daemon_uid)),
            segments,
            readonly_fds,
            mappings,
            node_id: config.node_id,
            epoch: config.epoch,
            max_frame_bytes: config.max_frame_bytes,
            max_create_wait_ms: config.max_create_wait_ms,
            policy: config.policy,
            limits: config.limits,
            admissions: Mutex::new(Admissions::default()),
            space: watch::Sender::new(0),
            stream_events: watch::Sender::new(0),
            attaches_waiting: AttachWaits::default(),
            daemon_uid: config.daemon_uid,
            handoff: crate::handoff::Handoff::default(),
            started: config.started,
            started_at: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
        })
    }

    /// Runs `f` on the object state, then wakes creates waiting for space if it freed some or
    /// made some evictable.
    pub fn with_objects<R>(&self, f: impl FnOnce(&mut Objects) -> R) -> R {
        self.with_streams(|_, o| f(o))
    }

    /// Runs `f` on the streams and the object state (locked in that order), then wakes whoever
    /// waits on what changed: creates when space moved, stream waiters when the streams'
    /// version moved. Waiters re-check on every wake-up, so only real changes wake them.
    pub fn with_streams<R>(&self, f: impl FnOnce(&mut Streams, &mut Objects) -> R) -> R {
        let mut streams = Critical::lock(&self.streams);
        let mut objects = Critical::lock(&self.objects);
        let (space_before, version_before) = (objects.space_epoch(), streams.version());
        let result = f(&mut streams, &mut objects);
        let (space, version) = (objects.space_epoch(), streams.version());
        drop(objects);
        drop(streams);
        // Only waiters subscribe; skip the wake-up machinery otherwise.
        if space != space_before && self.space.receiver_count() > 0 {
            self.space.send_replace(space);
        }
        if version != version_before && self.stream_events.receiver_count() > 0 {
            self.stream_events.send_replace(version);
        }
        result
    }

    /// The daemon's read-write mapping of a segment (made when the daemon has a cluster).
    pub(crate) fn mapping(&self, segment: u32) -> &Mapping {
        &self.mappings[segment as usize]
    }

    /// Whether the daemon mapped its segments for pulls (`ServeConfig::cluster`).
    pub(crate) fn mapped_for_pulls(&self) -> bool {
        self.mappings.len() == self.segments.len()
    }

    /// Changes whenever space is freed or becomes evictable.
    pub(crate) fn space_events(&self) -> watch::Receiver<u64> {
        self.space.subscribe()
    }

    /// Changes whenever the streams do (see [`Streams::version`]).
    pub(crate) fn stream_events(&self) -> watch::Receiver<u64> {
        self.stream_events.subscribe()
    }

    /// This node's id.
    pub fn node_id(&self) -> u32 {
        self.node_id
    }

    /// This daemon's start epoch (random at each start).
    pub fn epoch(&self) -> u32 {
        self.epoch
    }

    /// The statistics and every open stream (all their attached ranks), taken under one hold of
    /// the locks: what a metrics scrape shows (the cluster's counters are the caller's to add).
    pub fn snapshot(
        &self,
    ) -> (
        feedstore_proto::StoreStats,
        Vec<feedstore_proto::frame::StreamInfo>,
    ) {
        let (mut stats, streams) = self.with_streams(|s, o| {
            let mut stats = o.stats();
            s.add_stats(&mut stats);
            (stats, s.all())
        });
        self.add_stats(&mut stats);
        (stats, streams)
    }

    /// A snapshot of the statistics `feedstore stat` shows, but the cluster's.
    pub fn stats(&self) -> feedstore_proto::StoreStats {
        let mut stats = self.with_streams(|s, o| {
            let mut stats = o.stats();
            s.add_stats(&mut stats);
            stats
        });
        self.add_stats(&mut stats);
        stats
    }

    /// Adds what lives outside the locks: consumers waiting for streams.
    fn add_stats(&self, stats: &mut feedstore_proto::StoreStats) {
        stats.attaches_waiting = self.attaches_waiting.count();
    }

    /// Closes the streams nobody has used for the idle timeout.
    pub fn expire_streams(&self) {
        let expired = self.with_streams(|s, o| s.expire(o, std::time::Instant::now()));
        if expired > 0 {
            tracing::info!(expired, "idle streams closed");
        }
    }

    /// Drops what client processes held on the daemon this one took over from once they are
    /// gone (their pidfd polls readable, or, where the kernel gave none, `kill(pid, 0)` says
    /// no such process): their reservations aborted, their leases returned. A process neither
    /// can watch (another pid namespace on a kernel before 6.5) keeps what it held until a
    /// daemon starts afresh (a takeover hands it on).
    pub fn drop_what_gone_processes_held(&self) {
        let orphans = self.with_objects(|o| o.orphans());
        for (conn, pid, process) in orphans {
            if crate::credentials::exited(&process, pid) {
                let reclaimed = self.with_objects(|o| o.disconnect(conn));
                tracing::info!(
                    pid,
                    aborted_objects = reclaimed.aborted,
                    released_leases = reclaimed.leases,
                    "a client process gone since the hand-over: what it held is reclaimed"
                );
            }
        }
    }

    /// How often idle streams are looked for.
    pub fn expiry_interval(&self) -> Duration {
        (self.limits.stream_idle_timeout / 4)
            .clamp(Duration::from_millis(100), Duration::from_secs(10))
    }

    /// Admits a connection from `uid` within the connection limits, or says which is full.
    pub(crate) fn admit(self: &Arc<Self>, uid: u32) -> Result<Admitted, String> {
        let mut a = self.admissions.lock().unwrap_or_else(|e| e.into_inner());
        let mine = a.by_uid.get(&uid).copied().unwrap_or(0);
        if a.total >= self.limits.max_connections {
            return Err(format!(
                "feedstored has {} connections open, its limit (--max-connections)",
                a.total
            ));
        }
        if mine >= self.limits.max_connections_per_uid {
            return Err(format!(
                "uid {uid} has {mine} connections open, the limit per uid \
                 (--max-connections-per-uid); close some clients"
            ));
        }
        a.total += 1;
        *a.by_uid.entry(uid).or_insert(0) += 1;
        Ok(Admitted {
            shared: self.clone(),
            uid,
        })
    }

    pub(crate) fn segment_infos(&self, role: Role) -> Vec<SegmentInfo> {
        self.segments
            .iter()
            .enumerate()
            .map(|(i, s)| SegmentInfo {
                id: i as u32,
                size_bytes: s.size_bytes(),
                flags: if s.is_hugetlb() { SEGMENT_HUGETLB } else { 0 }
                    | if role == Role::Writer {
                        SEGMENT_WRITABLE
                    } else {
                        0
                    },
            })
            .collect()
    }
}

/// A connection counted against the limits until it ends.
pub(crate) struct Admitted {
    shared: Arc<Shared>,
    uid: u32,
}

impl Drop for Admitted {
    fn drop(&mut self) {
        let mut a = self
            .shared
            .admissions
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        a.total -= 1;
        if let Some(n) = a.by_uid.get_mut(&self.uid) {
            *n -= 1;
            if *n == 0 {
                a.by_uid.remove(&self.uid);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs this test binary again with only `test` and `FEEDSTORE_CRITICAL_CHILD` set, and
    /// returns how the child ended.
    fn child(test: &str) -> std::process::ExitStatus {
        std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", test, "--nocapture", "--test-threads=1"])
            .env("FEEDSTORE_CRITICAL_CHILD", "1")
            .stderr(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .status()
            .unwrap()
    }

    #[test]
    fn a_panic_under_the_lock_aborts_the_process() {
        if std::env::var_os("FEEDSTORE_CRITICAL_CHILD").is_some() {
            let state = Mutex::new(Objects::new(1, 1, &[1 << 20], false));
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                let _guard = Critical::lock(&state);
                panic!("torn");
            }));
            // Only reached if the panic did not abort: then the lock must still work.
            let _ = Critical::lock(&state);
            std::process::exit(0);
        }
        use std::os::unix::process::ExitStatusExt;
        let status = child("state::tests::a_panic_under_the_lock_aborts_the_process");
        assert_eq!(status.signal(), Some(libc::SIGABRT), "{status}");
    }

    #[test]
    fn a_panic_outside_the_lock_does_not_abort() {
        let state = Mutex::new(0u32);
        let result = std::panic::catch_unwind(|| {
            *Critical::lock(&state) += 1;
            panic!("after the lock");
        });
        assert!(result.is_err());
        assert_eq!(*Critical::lock(&state), 1);
        // Locking while a panic elsewhere unwinds (a connection's reclaim in its `Drop`).
        struct ReclaimOnDrop<'a>(&'a Mutex<u32>);
        impl Drop for ReclaimOnDrop<'_> {
            fn drop(&mut self) {
                *Critical::lock(self.0) += 1;
            }
        }
        let result = std::panic::catch_unwind(|| {
            let _reclaim = ReclaimOnDrop(&state);
            panic!("in a connection task");
        });
        assert!(result.is_err());
        assert_eq!(*Critical::lock(&state), 2, "reclaimed, not aborted");
    }
}
