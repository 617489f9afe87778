//! The control socket: one tokio task per client connection.
//!
//! A connection's life: it is admitted against the connection limits, its peer's uid and
//! groups are checked against the allow-list, the client says hello (within the hello timeout,
//! with a printable name and its frame limit) and receives one descriptor per segment by
//! `SCM_RIGHTS` (read-only for readers), then frames flow until the client goes away — for any
//! reason, `kill -9` included — at which point its unsealed objects are aborted and its leases
//! returned. A malformed or oversized frame closes that one connection with a logged reason.
//!
//! A request that waits (a create for space, a take for tasks, a wait for a sample, an attach
//! for its stream) waits here, not in the state: it re-tries whenever the state it depends on
//! moves, until its deadline. While it waits the connection keeps reading, so leases and samples
//! the same client returns from another thread still reach the daemon (otherwise a client could
//! deadlock against its own returns); other requests queue behind it, at most
//! `--max-queued-requests`.
//!
//! The object table and the streams sit behind locks that abort the process if a panic unwinds
//! while one is held ([`Critical`]): clients then see the daemon gone (`Disconnected`, which
//! they handle), never a daemon serving from a half-updated allocator.

use std::collections::{HashMap, HashSet, VecDeque};
use std::io::IoSlice;
use std::ops::{Deref, DerefMut};
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use feedstore_proto::frame::{
    CREATE_AHEAD, CREATE_PIN, Created, DecodeError, Frame, MIN_PAYLOAD_BYTES, Opcode, RankAt,
    Request, Response, StreamTask,
};
use feedstore_proto::{
    Handle, MAX_CLIENT_NAME, Role, SEGMENT_HUGETLB, SEGMENT_WRITABLE, SegmentInfo, Status,
};
use feedstore_shm::{Access, Mapping, Segment};
use nix::sys::socket::{ControlMessage, MsgFlags};
use tokio::io::{AsyncReadExt, AsyncWriteExt, Interest};
use tokio::net::UnixStream;
use tokio::sync::watch;
use tokio::time::Instant;

use crate::cluster::Cluster;
use crate::config::Limits;
use crate::objects::{ClientInfo, ConnId, Objects};
use crate::peer::Peer;
use crate::streams::{MAX_BATCH, Placement, StreamError, Streams, Window};

/// Who may connect, and in which role, decided from the peer's credentials.
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
    /// Whether `peer` may connect as a writer.
    fn may_write(&self, peer: &Peer) -> bool {
        peer.uid == 0
            || self.uids.contains(&peer.uid)
            || self.gid.is_some_and(|g| peer.groups.contains(&g))
    }

    /// Why `peer` may not connect as `role`, if it may not.
    fn refusal(&self, peer: &Peer, role: Role) -> Option<String> {
        if self.may_write(peer) {
            return None;
        }
        match (self.reader_uids.contains(&peer.uid), role) {
            (true, Role::Reader) => None,
            (true, Role::Writer) => Some(format!(
                "uid {} may only read from this feedstored (--allow-reader-uid)",
                peer.uid
            )),
            (false, _) => Some(format!(
                "uid {} is not allowed by this feedstored; add it with --allow-uid, \
                 --allow-reader-uid or --socket-group",
                peer.uid
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
    segments: Vec<Segment>,
    readonly_fds: Vec<OwnedFd>,
    /// The daemon's own read-write mapping of each segment, when it belongs to a cluster: only
    /// pulls touch object bytes through it (sending ranges to peers, landing copies).
    mappings: Vec<Arc<Mapping>>,
    cluster: Option<Arc<Cluster>>,
    node_id: u32,
    epoch: u32,
    max_frame_bytes: u32,
    max_create_wait_ms: u32,
    policy: AccessPolicy,
    limits: Limits,
    admissions: Mutex<Admissions>,
    /// Bumped when space is freed or becomes evictable; creates waiting for room watch it.
    space: watch::Sender<u64>,
    /// Follows [`Streams::version`]; stream waiters watch it.
    stream_events: watch::Sender<u64>,
    /// Consumers waiting for their stream to be created.
    attaches_waiting: AtomicU64,
}

/// Counts a consumer waiting for its stream to be created, for as long as it lives (the wait
/// ends, or its connection goes mid-wait).
struct AttachWaiting<'a>(&'a AtomicU64);

impl<'a> AttachWaiting<'a> {
    fn new(count: &'a AtomicU64) -> Self {
        count.fetch_add(1, Ordering::Relaxed);
        AttachWaiting(count)
    }
}

impl Drop for AttachWaiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
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
    /// Peers to pull other nodes' objects from, if this node is part of a cluster.
    pub cluster: Option<Arc<Cluster>>,
    /// Whether the segments were pre-faulted (then the daemon's own mappings are populated
    /// too, at no memory cost).
    pub prefault: bool,
}

impl Shared {
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
            .filter(|_| config.cluster.is_some())
            .map(|s| {
                let fd =
                    s.fd()
                        .try_clone_to_owned()
                        .map_err(|source| feedstore_shm::ShmError::Map {
                            len: s.size_bytes(),
                            access: Access::ReadWrite,
                            source,
                        })?;
                Mapping::new(fd, s.size_bytes(), Access::ReadWrite, config.prefault)
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
            cluster: config.cluster,
            node_id: config.node_id,
            epoch: config.epoch,
            max_frame_bytes: config.max_frame_bytes,
            max_create_wait_ms: config.max_create_wait_ms,
            policy: config.policy,
            limits: config.limits,
            admissions: Mutex::new(Admissions::default()),
            space: watch::Sender::new(0),
            stream_events: watch::Sender::new(0),
            attaches_waiting: AtomicU64::new(0),
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

    /// The cluster this node belongs to, if any.
    pub fn cluster(&self) -> Option<&Arc<Cluster>> {
        self.cluster.as_ref()
    }

    /// The statistics and every open stream (all their attached ranks), taken under one hold of
    /// the locks: what a metrics scrape shows.
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

    /// A snapshot of the statistics `feedstore stat` shows.
    pub fn stats(&self) -> feedstore_proto::StoreStats {
        let mut stats = self.with_streams(|s, o| {
            let mut stats = o.stats();
            s.add_stats(&mut stats);
            stats
        });
        self.add_stats(&mut stats);
        stats
    }

    /// Adds what lives outside the locks: the cluster's counters, consumers waiting for streams.
    fn add_stats(&self, stats: &mut feedstore_proto::StoreStats) {
        if let Some(cluster) = &self.cluster {
            cluster.add_stats(stats);
        }
        stats.attaches_waiting = self.attaches_waiting.load(Ordering::Relaxed);
    }

    /// Closes the streams nobody has used for the idle timeout.
    pub fn expire_streams(&self) {
        let expired = self.with_streams(|s, o| s.expire(o, std::time::Instant::now()));
        if expired > 0 {
            tracing::info!(expired, "idle streams closed");
        }
    }

    /// How often idle streams are looked for.
    pub fn expiry_interval(&self) -> Duration {
        (self.limits.stream_idle_timeout / 4)
            .clamp(Duration::from_millis(100), Duration::from_secs(10))
    }

    /// Admits a connection from `uid` within the connection limits, or says which is full.
    fn admit(self: &Arc<Self>, uid: u32) -> Result<Admitted, String> {
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

    fn segment_infos(&self, role: Role) -> Vec<SegmentInfo> {
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
struct Admitted {
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

/// Why a connection ended.
#[derive(Debug, thiserror::Error)]
enum ConnEnd {
    #[error("client closed the connection")]
    Closed,
    #[error("socket error")]
    Io(#[from] std::io::Error),
    #[error("malformed frame: {0}")]
    Malformed(#[from] DecodeError),
    #[error("protocol violation: {0}")]
    Protocol(String),
    #[error("refused at hello: {0}")]
    Refused(String),
    #[error("no hello within {0:?} (--hello-timeout-ms)")]
    HelloTimeout(Duration),
    #[error(
        "the client speaks protocol {found}, this daemon {}",
        feedstore_proto::frame::VERSION
    )]
    Version { found: u16, request_id: u32 },
}

/// Serves one accepted connection to its end, then reclaims everything it held.
pub async fn serve_connection(shared: Arc<Shared>, mut stream: UnixStream) {
    let peer = match Peer::of(&stream) {
        Ok(p) => p,
        Err(e) => {
            tracing::warn!(error = %e, "cannot read peer credentials; closing connection");
            return;
        }
    };
    let _admitted = match shared.admit(peer.uid) {
        Ok(a) => a,
        Err(message) => {
            shared.with_objects(Objects::note_limit_hit);
            tracing::warn!(pid = peer.pid, uid = peer.uid, %message, "connection refused");
            let mut out = Vec::new();
            let refusal = Response::Error {
                status: Status::LimitReached,
                message,
            };
            if refusal
                .encode(Opcode::Hello, 0, MIN_PAYLOAD_BYTES, &mut out)
                .is_ok()
            {
                let _ = stream.write_all(&out).await;
            }
            return;
        }
    };
    let mut conn = Connection {
        shared: shared.clone(),
        stream,
        rbuf: Vec::with_capacity(64 << 10),
        wbuf: Vec::with_capacity(4 << 10),
        deferred: VecDeque::new(),
        deferred_bytes: 0,
        id: None,
        role: Role::Reader,
        peer,
        peer_limit: MIN_PAYLOAD_BYTES,
        name: String::new(),
    };
    let end = conn.run().await;
    if let Err(ConnEnd::Version { found, request_id }) = &end {
        // Told why before the close, in a frame of this daemon's version: a client of any
        // version since 1 reads a header's version, and this one names both.
        let message = version_mismatch(*found);
        let mut out = Vec::new();
        if error(Status::Protocol, message)
            .encode(Opcode::Hello, *request_id, MIN_PAYLOAD_BYTES, &mut out)
            .is_ok()
        {
            let _ = conn.stream.write_all(&out).await;
        }
    }
    let (uid, pid) = (conn.peer.uid, conn.peer.pid);
    match (&conn.id, end) {
        (Some(id), Err(reason @ (ConnEnd::Malformed(_) | ConnEnd::Protocol(_)))) => {
            tracing::warn!(conn = id, pid, uid, name = ?conn.name, %reason, "closing connection");
        }
        (None, Err(ConnEnd::Closed) | Ok(())) | (Some(_), _) => {}
        (None, Err(e)) => {
            if matches!(e, ConnEnd::HelloTimeout(_)) {
                shared.with_objects(Objects::note_limit_hit);
            }
            tracing::warn!(pid, uid, reason = %e, "connection closed before hello");
        }
    }
    // `conn` drops here: its `Drop` reclaims what the client held.
}

/// One client's connection. Dropping it (at the end, or when its task is cancelled or panics)
/// aborts what the client was writing and returns its leases, stream tasks and ring.
struct Connection {
    shared: Arc<Shared>,
    stream: UnixStream,
    rbuf: Vec<u8>,
    wbuf: Vec<u8>,
    /// Requests (with their ids) read while another was waiting, to be handled after it.
    deferred: VecDeque<(u32, Request)>,
    /// Frame bytes of the deferred requests.
    deferred_bytes: usize,
    id: Option<ConnId>,
    role: Role,
    peer: Peer,
    /// The largest reply payload the client accepts (from its hello).
    peer_limit: u32,
    name: String,
}

impl Drop for Connection {
    fn drop(&mut self) {
        let Some(id) = self.id else {
            return;
        };
        let reclaimed = self.shared.with_streams(|s, o| {
            s.disconnect(id);
            o.disconnect(id)
        });
        let (pid, name) = (self.peer.pid, &self.name);
        if reclaimed.aborted + reclaimed.leases > 0 {
            tracing::info!(
                conn = id, pid, name = ?name,
                aborted_objects = reclaimed.aborted,
                released_leases = reclaimed.leases,
                "client disconnected; reclaimed its unsealed objects and leases"
            );
        } else {
            tracing::info!(conn = id, pid, name = ?name, "client disconnected");
        }
    }
}

impl Connection {
    async fn run(&mut self) -> Result<(), ConnEnd> {
        let hello_timeout = self.shared.limits.hello_timeout;
        let hello_deadline = Instant::now() + hello_timeout;
        loop {
            let (request_id, request) = match self.deferred.pop_front() {
                Some((id, r)) => {
                    if self.deferred.is_empty() {
                        self.deferred_bytes = 0;
                    }
                    (id, r)
                }
                None => match self.take_request()? {
                    Some(r) => r,
                    None if self.id.is_none() => {
                        tokio::time::timeout_at(hello_deadline, self.fill())
                            .await
                            .map_err(|_| ConnEnd::HelloTimeout(hello_timeout))??;
                        continue;
                    }
                    None => {
                        self.fill().await?;
                        continue;
                    }
                },
            };
            self.dispatch(request_id, request).await?;
        }
    }

    /// Reads more bytes; `Closed` at end of stream.
    async fn fill(&mut self) -> Result<(), ConnEnd> {
        self.rbuf.reserve(16 << 10);
        let n = self.stream.read_buf(&mut self.rbuf).await?;
        if n == 0 {
            return Err(if self.rbuf.is_empty() {
                ConnEnd::Closed
            } else {
                ConnEnd::Malformed(DecodeError::Truncated {
                    need: 16,
                    have: self.rbuf.len(),
                })
            });
        }
        Ok(())
    }

    /// Decodes the request at the front of the read buffer, if it is whole, and removes its
    /// bytes. Decoding reads the buffer in place: a frame is parsed once and never copied.
    fn take_request(&mut self) -> Result<Option<(u32, Request)>, ConnEnd> {
        Ok(self.take_frame()?.map(|(id, request, _)| (id, request)))
    }

    /// [`Connection::take_request`], with the frame's length.
    fn take_frame(&mut self) -> Result<Option<(u32, Request, usize)>, ConnEnd> {
        let parsed = match Frame::parse(&self.rbuf, self.shared.max_frame_bytes) {
            Err(DecodeError::UnsupportedVersion { found, .. }) if self.id.is_none() => {
                let request_id =
                    u32::from_le_bytes(self.rbuf[8..12].try_into().expect("a whole header"));
                return Err(ConnEnd::Version { found, request_id });
            }
            other => other?,
        };
        let Some(frame) = parsed else {
            return Ok(None);
        };
        let (len, request_id) = (frame.len(), frame.header.request_id);
        let request = Request::decode(&frame)?;
        self.rbuf.drain(..len);
        Ok(Some((request_id, request, len)))
    }

    async fn dispatch(&mut self, request_id: u32, request: Request) -> Result<(), ConnEnd> {
        let op = request.opcode();
        let Some(id) = self.id else {
            return match request {
                Request::Hello {
                    role,
                    client_name,
                    max_frame_bytes,
                } => {
                    self.hello(request_id, role, client_name, max_frame_bytes)
                        .await
                }
                _ => Err(ConnEnd::Protocol(format!("{op:?} before hello"))),
            };
        };
        // A batch whose reply could not fit the client's limit is refused before it takes a
        // single lease or reservation.
        if let Some(bound) = request.reply_bound()
            && bound > self.peer_limit as usize
            && !matches!(request, Request::StreamTake { .. })
        {
            let message = format!(
                "a {op:?} of {} items needs a reply of {bound} bytes, over this client's limit \
                 of {} bytes: split the batch",
                request.batch_len(),
                self.peer_limit
            );
            return self
                .reply(op, request_id, &error(Status::InvalidArgument, message))
                .await;
        }
        let shared = self.shared.clone();
        let response = match request {
            Request::Hello { .. } => return Err(ConnEnd::Protocol("second hello".into())),
            Request::Create {
                sizes,
                timeout_ms,
                flags,
            } => {
                if sizes.is_empty() {
                    error(Status::InvalidArgument, "empty create batch".into())
                } else {
                    let mut results = Vec::with_capacity(sizes.len());
                    let wait =
                        Duration::from_millis(u64::from(timeout_ms.min(shared.max_create_wait_ms)));
                    let deadline = Instant::now() + wait;
                    for size in sizes {
                        results.push(
                            self.create_one(
                                id,
                                size,
                                flags & CREATE_PIN != 0,
                                flags & CREATE_AHEAD != 0,
                                deadline,
                            )
                            .await?,
                        );
                    }
                    Response::Created(results)
                }
            }
            Request::Seal { handles } => Response::Done(each(&shared, id, &handles, Objects::seal)),
            Request::Abort { handles } => {
                Response::Done(each(&shared, id, &handles, Objects::abort))
            }
            Request::Delete { handles } => {
                Response::Done(each(&shared, id, &handles, Objects::delete))
            }
            Request::Get { handles } => {
                let mut got: Vec<_> =
                    shared.with_objects(|o| handles.iter().map(|&h| o.lease(id, h)).collect());
                if let Some(cluster) = &shared.cluster
                    && got.contains(&Err(Status::WrongNode))
                {
                    self.pull_then_get(cluster, id, &handles, &mut got).await?;
                }
                Response::Got(got)
            }
            Request::Release { handles } => {
                self.release(id, &handles);
                return Ok(());
            }
            Request::Stats => Response::Stats(Box::new(shared.stats())),
            Request::CacheLookup { keys } => {
                Response::Cached(shared.with_streams(|s, o| s.lookup(o, id, &keys)))
            }
            Request::CacheInsert { entries } => {
                if self.role != Role::Writer {
                    error(
                        Status::PermissionDenied,
                        "only writers file samples in the cache".into(),
                    )
                } else {
                    Response::Done(shared.with_streams(|s, o| s.insert(o, id, &entries)))
                }
            }
            Request::StreamList { after } => {
                // The page's fixed part: the list's count and the `more` byte.
                let budget = self.peer_limit as usize - 5;
                let (streams, more) = shared.with_streams(|s, o| s.list(o, id, after, budget));
                Response::Streams { streams, more }
            }
            Request::StreamJoin {
                spec,
                depth,
                batch,
                ranks,
                at,
                relay,
            } => {
                let placement = match self.locate(&at, &relay).await {
                    Ok(placement) => placement,
                    Err(e) => return self.reply(op, request_id, &stream_error(e)).await,
                };
                let joined = shared.with_streams(|s, o| {
                    let window = Window { depth, batch };
                    s.join(o, id, &spec, window, &ranks, &placement)
                });
                if let (Ok((stream, feeders)), Some(cluster)) = (&joined, &shared.cluster) {
                    for &node in feeders {
                        tokio::spawn(crate::cluster::feed_remote(
                            shared.clone(),
                            cluster.clone(),
                            *stream,
                            node,
                        ));
                    }
                }
                stream_reply(joined, |(stream, _)| Response::StreamJoined { stream })
            }
            Request::StreamAttach {
                spec,
                rank,
                seq,
                timeout_ms,
            } => {
                let mut waiting = None;
                let attached = self
                    .wait_until(id, timeout_ms, |expired| {
                        let attached = shared.with_streams(|s, o| -> Result<_, StreamError> {
                            let (stream, ring) = s.attach(o, id, &spec, rank, seq)?;
                            let fd = ring.readonly_fd().map_err(|e| StreamError {
                                status: Status::Full,
                                message: format!("cannot share the ring: {e}"),
                            })?;
                            Ok((stream, ring.capacity(), ring.size_bytes(), fd))
                        });
                        match attached {
                            Err(e) if e.status == Status::NotFound && !expired => {
                                waiting.get_or_insert_with(|| {
                                    AttachWaiting::new(&shared.attaches_waiting)
                                });
                                None
                            }
                            Err(e) if e.status == Status::NotFound => Some(Err(StreamError {
                                status: Status::Timeout,
                                message: e.message,
                            })),
                            other => Some(other),
                        }
                    })
                    .await?;
                drop(waiting);
                return match attached {
                    Ok((stream, capacity, ring_bytes, fd)) => {
                        let response = Response::StreamAttached {
                            stream,
                            capacity,
                            ring_bytes,
                        };
                        self.wbuf.clear();
                        self.encode_reply(op, request_id, &response);
                        self.send_with_fds(&[fd.as_raw_fd()]).await
                    }
                    Err(e) => self.reply(op, request_id, &stream_error(e)).await,
                };
            }
            Request::StreamTake {
                stream,
                max,
                timeout_ms,
            } => {
                // No more tasks than the client's limit lets the reply carry, a batched stream's
                // last whole batch included (up to `MAX_BATCH - 1` past `max`).
                let fits = (self.peer_limit as usize - 4) / StreamTask::WIRE_BYTES;
                let fits = fits.saturating_sub(MAX_BATCH as usize - 1).max(1);
                let max = max.clamp(1, fits as u32);
                self.wait_until(id, timeout_ms, |expired| {
                    match shared.with_streams(|s, _| s.take(id, stream, max, None)) {
                        Ok(tasks) if !tasks.is_empty() || expired => Some(Response::Tasks(tasks)),
                        Ok(_) => None,
                        Err(e) => Some(stream_error(e)),
                    }
                })
                .await?
            }
            Request::StreamPut { stream, items } => {
                if self.role != Role::Writer {
                    error(
                        Status::PermissionDenied,
                        "only writers put samples into streams".into(),
                    )
                } else {
                    let (put, forwards) = shared.with_streams(|s, o| {
                        let put = s.put(o, id, stream, &items, true);
                        (put, s.forwards(o))
                    });
                    if let Some(cluster) = &shared.cluster
                        && !forwards.is_empty()
                    {
                        crate::cluster::forward(&shared, cluster, forwards);
                    }
                    stream_reply(put, Response::Done)
                }
            }
            Request::StreamRelease {
                stream,
                rank,
                upto,
                figures,
            } => {
                self.stream_release(id, stream, rank, upto, figures);
                return Ok(());
            }
            Request::ProducerReport { stream, figures } => {
                self.producer_report(id, stream, &figures);
                return Ok(());
            }
            Request::StreamWait {
                stream,
                rank,
                seq,
                timeout_ms,
            } => {
                // Asking past the end: the consumer has read all of its share, which lets the
                // producers waiting for work stop.
                shared.with_streams(|s, _| s.finish(id, stream, rank, seq));
                self.wait_until(id, timeout_ms, |expired| {
                    match shared.with_streams(|s, _| s.poll(id, stream, rank, seq)) {
                        Ok(Some(status)) => Some(Response::Done(vec![status])),
                        Ok(None) if expired => Some(Response::Done(vec![Status::Timeout])),
                        Ok(None) => None,
                        Err(e) => Some(stream_error(e)),
                    }
                })
                .await?
            }
            Request::StreamDetach { stream, rank, next } => stream_reply(
                shared.with_streams(|s, o| s.detach(o, id, stream, rank, next)),
                |()| Response::Done(vec![Status::Ok]),
            ),
            Request::StreamClose { stream } => {
                stream_reply(shared.with_streams(|s, o| s.close(o, id, stream)), |()| {
                    Response::Done(vec![Status::Ok])
                })
            }
        };
        self.reply(op, request_id, &response).await
    }

    /// The node owning each rank of `at` (ranks at this node's own address are left out), and
    /// the relay's node.
    async fn locate(&self, at: &[RankAt], relay: &str) -> Result<Placement, StreamError> {
        let mut placement = Placement::default();
        if at.is_empty() && relay.is_empty() {
            return Ok(placement);
        }
        let Some(cluster) = &self.shared.cluster else {
            return Err(StreamError {
                status: Status::InvalidArgument,
                message: "ranks on other nodes need this daemon in a cluster (feedstored \
                          --listen, --peers, --cluster-secret-file)"
                    .into(),
            });
        };
        let unreachable = |message| StreamError {
            status: Status::Unreachable,
            message,
        };
        if !relay.is_empty() {
            placement.relay = cluster.node_at(relay).await.map_err(unreachable)?;
        }
        let mut nodes: HashMap<&str, Option<u32>> = HashMap::new();
        for r in at {
            let node = match nodes.get(r.addr.as_str()) {
                Some(&node) => node,
                None => {
                    let node = cluster.node_at(&r.addr).await.map_err(unreachable)?;
                    nodes.insert(&r.addr, node);
                    node
                }
            };
            if let Some(node) = node {
                placement.owners.insert(r.rank, node);
            }
        }
        Ok(placement)
    }

    fn stream_release(
        &self,
        id: ConnId,
        stream: u32,
        rank: u32,
        upto: u64,
        figures: feedstore_proto::frame::RankFigures,
    ) {
        if let Err(e) = self
            .shared
            .with_streams(|s, o| s.release(o, id, stream, rank, upto, figures))
        {
            tracing::debug!(conn = id, stream, rank, upto, error = %e, "stream release refused");
        }
    }

    fn producer_report(
        &self,
        id: ConnId,
        stream: u32,
        figures: &feedstore_proto::frame::ProducerFigures,
    ) {
        if let Err(e) = self
            .shared
            .with_streams(|s, _| s.producer_report(id, stream, figures))
        {
            tracing::debug!(conn = id, stream, error = %e, "producer report refused");
        }
    }

    /// Re-checks a stream condition whenever the streams change, until `check` answers (it is
    /// told when the time is up, and must answer then).
    async fn wait_until<T>(
        &mut self,
        id: ConnId,
        timeout_ms: u32,
        mut check: impl FnMut(bool) -> Option<T>,
    ) -> Result<T, ConnEnd> {
        let deadline = Instant::now() + Duration::from_millis(u64::from(timeout_ms));
        let mut events = self.shared.stream_events.subscribe();
        loop {
            events.borrow_and_update();
            if let Some(answer) = check(Instant::now() >= deadline) {
                return Ok(answer);
            }
            self.wait_for(id, &mut events, deadline).await?;
        }
    }

    /// Waits until `events` changes or the deadline passes. Meanwhile the connection keeps
    /// reading: one-way returns (leases, stream samples) are applied at once, so a client cannot
    /// deadlock against its own returns, and other requests are queued for after the wait, at
    /// most `--max-queued-requests` of them and four maximal frames' worth of bytes.
    async fn wait_for<T>(
        &mut self,
        id: ConnId,
        events: &mut watch::Receiver<T>,
        deadline: Instant,
    ) -> Result<(), ConnEnd> {
        // Frames that arrived with the waiting request are taken in first.
        self.absorb(id)?;
        tokio::select! {
            _ = events.changed() => {}
            _ = tokio::time::sleep_until(deadline) => {}
            read = self.stream.read_buf(&mut self.rbuf) => {
                if read? == 0 {
                    return Err(ConnEnd::Closed);
                }
                self.absorb(id)?;
            }
        }
        Ok(())
    }

    /// Takes every whole frame in the read buffer while a request waits: returns are applied at
    /// once, other requests queued for after the wait, within the queue's bounds.
    fn absorb(&mut self, id: ConnId) -> Result<(), ConnEnd> {
        while let Some((request_id, request, len)) = self.take_frame()? {
            match request {
                Request::Release { handles } => self.release(id, &handles),
                Request::StreamRelease {
                    stream,
                    rank,
                    upto,
                    figures,
                } => {
                    self.stream_release(id, stream, rank, upto, figures);
                }
                Request::ProducerReport { stream, figures } => {
                    self.producer_report(id, stream, &figures);
                }
                other => {
                    let limits = &self.shared.limits;
                    let max_bytes = 4 * self.shared.max_frame_bytes as usize;
                    if self.deferred.len() >= limits.max_queued_requests
                        || self.deferred_bytes + len > max_bytes
                    {
                        self.shared.with_objects(Objects::note_limit_hit);
                        return Err(ConnEnd::Protocol(format!(
                            "more than {} requests or {max_bytes} bytes queued behind a \
                             waiting one (--max-queued-requests)",
                            limits.max_queued_requests
                        )));
                    }
                    self.deferred_bytes += len;
                    self.deferred.push_back((request_id, other));
                }
            }
        }
        Ok(())
    }

    /// Sends the encoded reply in `wbuf` with descriptors riding on its first byte.
    async fn send_with_fds(&mut self, fds: &[i32]) -> Result<(), ConnEnd> {
        let wbuf = std::mem::take(&mut self.wbuf);
        let sock = self.stream.as_raw_fd();
        let sent = self
            .stream
            .async_io(Interest::WRITABLE, || {
                let cmsg = [ControlMessage::ScmRights(fds)];
                nix::sys::socket::sendmsg::<()>(
                    sock,
                    &[IoSlice::new(&wbuf)],
                    &cmsg,
                    MsgFlags::MSG_NOSIGNAL,
                    None,
                )
                .map_err(std::io::Error::from)
            })
            .await?;
        self.stream.write_all(&wbuf[sent..]).await?;
        self.wbuf = wbuf;
        Ok(())
    }

    /// Refuses the hello with a reply the client can show, then ends the connection.
    async fn refuse(
        &mut self,
        request_id: u32,
        status: Status,
        message: String,
    ) -> Result<(), ConnEnd> {
        self.reply(Opcode::Hello, request_id, &error(status, message.clone()))
            .await?;
        Err(ConnEnd::Refused(message))
    }

    async fn hello(
        &mut self,
        request_id: u32,
        role: Role,
        name: String,
        max_frame_bytes: u32,
    ) -> Result<(), ConnEnd> {
        let shared = self.shared.clone();
        if let Some(message) = shared.policy.refusal(&self.peer, role) {
            return self
                .refuse(request_id, Status::PermissionDenied, message)
                .await;
        }
        if name.len() > MAX_CLIENT_NAME || name.chars().any(char::is_control) {
            let message = format!(
                "client name of {} bytes refused: at most {MAX_CLIENT_NAME} bytes of printable text",
                name.len()
            );
            return self
                .refuse(request_id, Status::InvalidArgument, message)
                .await;
        }
        if max_frame_bytes < MIN_PAYLOAD_BYTES {
            let message = format!(
                "the client accepts frames of {max_frame_bytes} bytes; at least {MIN_PAYLOAD_BYTES} are needed"
            );
            return self
                .refuse(request_id, Status::InvalidArgument, message)
                .await;
        }
        let info = ClientInfo {
            role,
            uid: self.peer.uid,
            pid: self.peer.pid,
            name: name.clone(),
            internal: false,
            // A uid allowed only to read holds at most its share of the store leased.
            capped: !shared.policy.may_write(&self.peer),
        };
        let id = shared.with_objects(|o| o.connect(info));
        self.id = Some(id);
        self.role = role;
        self.peer_limit = max_frame_bytes;
        self.name = name;
        tracing::info!(conn = id, pid = self.peer.pid, uid = self.peer.uid, ?role, name = ?self.name, "client connected");
        let response = Response::Hello {
            node_id: shared.node_id,
            epoch: shared.epoch,
            segments: shared.segment_infos(role),
            max_frame_bytes: shared.max_frame_bytes,
        };
        self.wbuf.clear();
        self.encode_reply(Opcode::Hello, request_id, &response);
        let fds: Vec<i32> = match role {
            Role::Writer => shared.segments.iter().map(|s| s.fd().as_raw_fd()).collect(),
            Role::Reader => shared.readonly_fds.iter().map(|f| f.as_raw_fd()).collect(),
        };
        // The descriptors ride on the first byte of the reply; the rest follows as plain bytes.
        self.send_with_fds(&fds).await
    }

    /// Encodes `response` into `wbuf` within the client's limit; one that does not fit (which
    /// the checks before each request rule out) becomes an error reply that does.
    fn encode_reply(&mut self, op: Opcode, request_id: u32, response: &Response) {
        if let Err(e) = response.encode(op, request_id, self.peer_limit, &mut self.wbuf) {
            tracing::error!(error = %e, "reply over the client's limit");
            let fallback = error(Status::LimitReached, e.to_string());
            fallback
                .encode(op, request_id, self.peer_limit, &mut self.wbuf)
                .expect("an error reply fits any agreed limit");
        }
    }

    async fn reply(
        &mut self,
        op: Opcode,
        request_id: u32,
        response: &Response,
    ) -> Result<(), ConnEnd> {
        self.wbuf.clear();
        self.encode_reply(op, request_id, response);
        self.stream.write_all(&self.wbuf).await?;
        Ok(())
    }

    /// Pulls the objects of other nodes a get found no copy of (`WrongNode` in `got`), all at
    /// once, then leases the copies. Waits while the pulls run, serving the client's returns
    /// meanwhile, as a create waiting for space does. A copy evicted before this get could
    /// lease it is pulled again, twice at most, then reported `Full`.
    async fn pull_then_get(
        &mut self,
        cluster: &Arc<Cluster>,
        id: ConnId,
        handles: &[Handle],
        got: &mut [Result<feedstore_proto::frame::Got, Status>],
    ) -> Result<(), ConnEnd> {
        let shared = self.shared.clone();
        // One deadline for the whole get: the pulls end by their own (`--pull-timeout-ms`); this
        // one only guards against a lost task and bounds the re-pulls.
        let deadline = Instant::now() + cluster.config().pull_timeout + Duration::from_secs(5);
        for _ in 0..3 {
            let mut pulls = Vec::new();
            for (i, &h) in handles.iter().enumerate() {
                if got[i] == Err(Status::WrongNode) {
                    match cluster.pull(&shared, h) {
                        Ok(rx) => pulls.push((i, rx)),
                        Err(status) => {
                            shared.with_objects(Objects::note_limit_hit);
                            got[i] = Err(status);
                        }
                    }
                }
            }
            if pulls.is_empty() {
                return Ok(());
            }
            for (i, mut rx) in pulls {
                let outcome = loop {
                    if let Some(outcome) = rx.borrow_and_update().clone() {
                        break outcome.map_err(|e| e.status);
                    }
                    if rx.has_changed().is_err() || Instant::now() >= deadline {
                        break Err(Status::Unreachable);
                    }
                    self.wait_for(id, &mut rx, deadline).await?;
                };
                got[i] = outcome.and_then(|()| shared.with_objects(|o| o.lease(id, handles[i])));
            }
        }
        for r in got.iter_mut() {
            if *r == Err(Status::WrongNode) {
                *r = Err(Status::Full);
            }
        }
        Ok(())
    }

    fn release(&self, id: ConnId, handles: &[Handle]) {
        self.shared.with_objects(|o| {
            for &h in handles {
                if let Err(status) = o.release(id, h) {
                    tracing::debug!(conn = id, handle = %h, %status, "release of a lease not held");
                }
            }
        });
    }

    /// One create, waiting for space until `deadline` while still serving releases.
    async fn create_one(
        &mut self,
        id: ConnId,
        size: u64,
        pinned: bool,
        ahead: bool,
        deadline: Instant,
    ) -> Result<Result<Created, Status>, ConnEnd> {
        let shared = self.shared.clone();
        let mut space = shared.space.subscribe();
        let mut waited = false;
        loop {
            space.borrow_and_update();
            match shared.with_objects(|o| o.create(id, size, pinned)) {
                Err(Status::Full) => {}
                other => return Ok(other),
            }
            if Instant::now() >= deadline {
                if ahead {
                    return Ok(Err(Status::Full));
                }
                let stats = shared.with_objects(|o| {
                    o.note_create_full();
                    o.stats()
                });
                tracing::warn!(
                    conn = id,
                    size,
                    used = stats.used_bytes,
                    capacity = stats.capacity_bytes,
                    leases = stats.leases,
                    pinned = stats.objects_pinned,
                    "create failed: store full of leased, pinned or unsealed objects"
                );
                return Ok(Err(Status::Full));
            }
            if !waited {
                waited = true;
                shared.with_objects(Objects::note_create_waited);
                tracing::debug!(conn = id, size, "create waiting for space");
            }
            self.wait_for(id, &mut space, deadline).await?;
        }
    }
}

/// What a client of protocol `found` is told by this daemon.
fn version_mismatch(found: u16) -> String {
    let ours = feedstore_proto::frame::VERSION;
    let upgrade = if found < ours {
        "the client"
    } else {
        "this feedstored"
    };
    format!(
        "feedstored speaks protocol {ours}, this client {found}: upgrade {upgrade} (feedstore \
         {}) so that both speak the same version",
        env!("CARGO_PKG_VERSION")
    )
}

fn error(status: Status, message: String) -> Response {
    Response::Error {
        status,
        message: feedstore_proto::truncate(&message, 1024).to_owned(),
    }
}

fn stream_error(e: StreamError) -> Response {
    error(e.status, e.message)
}

fn stream_reply<T>(result: Result<T, StreamError>, ok: impl FnOnce(T) -> Response) -> Response {
    result.map_or_else(stream_error, ok)
}

fn each(
    shared: &Shared,
    id: ConnId,
    handles: &[Handle],
    op: fn(&mut Objects, ConnId, Handle) -> Result<(), Status>,
) -> Vec<Status> {
    shared.with_objects(|o| {
        handles
            .iter()
            .map(|&h| op(o, id, h).err().unwrap_or(Status::Ok))
            .collect()
    })
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
        let status = child("server::tests::a_panic_under_the_lock_aborts_the_process");
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
