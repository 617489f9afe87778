//! Streams across nodes: the stream session between two daemons
//! ([`feedstore_proto::peer_stream`]), both ends of it.
//!
//! ```text
//!  node P (producers)                                    node R (the rank's consumer)
//!  producer ── StreamTake ──▶ daemon P: feeder(stream, R) ── Take ──▶ daemon R: window of rank r
//!           ◀── tasks ──────── granted tasks ◀─────────────── tasks ──┘
//!  producer ── StreamPut ───▶ sealed + leased on P ── Put(handles) ──▶ pull each from P, then
//!                             lease returned ◀────────── Done ─────── publish into r's ring
//! ```
//!
//! The rank's daemon (R) keeps the window, the order and the ring exactly as for local
//! producers: the session is one more producer connection per uid there, so what it took and
//! has not put goes back to the window when the session ends (node P died, the link broke).
//! The producers' daemon (P) runs one feeder per stream and owner: it joins the stream on R,
//! asks for tasks while its producers have room for them, and hands each sample made for R's
//! ranks over by handle; R pulls the bytes (the cross-node pull) before it publishes them, so
//! they arrive inside the window, ahead of the trainer. Nobody else carries samples or assigns
//! tasks.

use std::collections::{BTreeSet, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use feedstore_proto::frame::{StreamItem, StreamTask, TakeTasks};
use feedstore_proto::peer::TAG_BYTES;
use feedstore_proto::peer_stream::{
    MAX_SESSION_ITEMS, RESHARDED_SINCE, SessionReply, SessionRequest, frame_len,
};
use feedstore_proto::ring::ENTRY_FAILED;
use feedstore_proto::{Role, Status};
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::{Semaphore, oneshot};
use tokio::time::Instant;

use super::Cluster;
use super::record::{Opener, Records, Sealer, Tag};
use super::transport::{PeerIdentity, PullError, write_record};
use crate::objects::{ClientInfo, ConnId};
use crate::state::Shared;
use crate::streams::{Demand, Forward, Placement};

/// How long one `Take` waits at the owner for room in a window.
const TAKE_WAIT_MS: u32 = 1000;
/// The longest wait a peer may ask for in one `Take`.
const MAX_TAKE_WAIT_MS: u32 = 10_000;
/// Requests one session may have under way at the owner; the reader waits beyond that.
const MAX_SESSION_REQUESTS: usize = 64;
/// Uids one session may produce for.
const MAX_SESSION_UIDS: usize = 64;
/// The longest a feeder waits before it tries a lost owner again.
const MAX_BACKOFF: Duration = Duration::from_secs(5);
/// A session left without a request this long is closed by the owner.
const IDLE_TIMEOUT: Duration = Duration::from_secs(300);

/// Reads one frame and checks its record tag (over the length word and the frame); an error
/// if it fails, which ends the session.
async fn read_frame(
    reader: &mut OwnedReadHalf,
    opener: &mut Opener,
    rejected: &AtomicU64,
) -> std::io::Result<Vec<u8>> {
    let mut record = vec![0u8; 4];
    reader.read_exact(&mut record).await?;
    let word: [u8; 4] = record[..].try_into().expect("4 bytes");
    // The length is checked before the tag: it bounds what is read, and a forged one fails the
    // tag once the frame is in.
    let len = frame_len(word)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e.to_string()))?;
    record.resize(4 + len, 0);
    reader.read_exact(&mut record[4..]).await?;
    let mut tag: Tag = [0; TAG_BYTES];
    reader.read_exact(&mut tag).await?;
    if let Err(e) = opener.open(&record, &tag) {
        rejected.fetch_add(1, Ordering::Relaxed);
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            e.to_string(),
        ));
    }
    record.drain(..4);
    Ok(record)
}

/// The producers' end of a session to one owner.
pub(crate) struct Session {
    node: u32,
    addr: SocketAddr,
    /// The socket, shut down by [`Session::kill`] (the write half keeps it open until then).
    fd: std::os::fd::RawFd,
    /// The write half and the tags of what it sends, in the order it sends.
    writer: tokio::sync::Mutex<(OwnedWriteHalf, Sealer)>,
    pending: Arc<Mutex<HashMap<u32, oneshot::Sender<SessionReply>>>>,
    alive: Arc<AtomicBool>,
    next_id: AtomicU32,
    reader: tokio::task::JoinHandle<()>,
    /// The peer protocol version agreed at handshake.
    protocol: u16,
}

impl Drop for Session {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

impl Session {
    fn start(
        rejected: Arc<AtomicU64>,
        stream: TcpStream,
        addr: SocketAddr,
        peer: PeerIdentity,
        records: Records,
    ) -> Session {
        let fd = std::os::fd::AsRawFd::as_raw_fd(&stream);
        let (mut reader, writer) = stream.into_split();
        let Records { sealer, mut opener } = records;
        let pending: Arc<Mutex<HashMap<u32, oneshot::Sender<SessionReply>>>> = Arc::default();
        let alive = Arc::new(AtomicBool::new(true));
        let task = {
            let (pending, alive) = (pending.clone(), alive.clone());
            tokio::spawn(async move {
                let why = loop {
                    let body = match read_frame(&mut reader, &mut opener, &rejected).await {
                        Ok(body) => body,
                        Err(e) => break e.to_string(),
                    };
                    match SessionReply::decode(&body) {
                        Ok((id, reply)) => {
                            let waiter = pending
                                .lock()
                                .unwrap_or_else(|e| e.into_inner())
                                .remove(&id);
                            if let Some(tx) = waiter {
                                let _ = tx.send(reply);
                            }
                        }
                        Err(e) => break format!("malformed reply: {e}"),
                    }
                };
                tracing::info!(peer = %addr, reason = %why, "stream session ended");
                // Every call waiting now, and every call made from now on, learns the session
                // is gone (the flag first, then the waiters: see `call`).
                alive.store(false, Ordering::Release);
                pending.lock().unwrap_or_else(|e| e.into_inner()).clear();
            })
        };
        Session {
            node: peer.node_id,
            addr,
            fd,
            writer: tokio::sync::Mutex::new((writer, sealer)),
            pending,
            alive,
            next_id: AtomicU32::new(1),
            reader: task,
            protocol: peer.protocol,
        }
    }

    fn alive(&self) -> bool {
        self.alive.load(Ordering::Acquire) && !self.reader.is_finished()
    }

    /// Ends the session: the socket is shut down (the owner sees it end and returns everything
    /// the session took to the windows), and every call waiting fails.
    fn kill(&self) {
        self.alive.store(false, Ordering::Release);
        // The descriptor is open: the write half, which owns it, lives as long as `self`.
        let _ = nix::sys::socket::shutdown(self.fd, nix::sys::socket::Shutdown::Both);
        self.reader.abort();
        self.pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
    }

    /// Sends one request and waits for its answer until `deadline`. A call that times out ends
    /// the session, so nothing the owner granted in a reply nobody read stays out.
    async fn call(
        &self,
        request: &SessionRequest,
        deadline: Instant,
    ) -> Result<SessionReply, PullError> {
        let lost = |what: &str| PullError {
            status: Status::Unreachable,
            message: format!(
                "stream session to node {:08x} at {}: {what}",
                self.node, self.addr
            ),
            retry: true,
            forged: false,
        };
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        self.pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id, tx);
        if !self.alive() {
            self.pending
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&id);
            return Err(lost("closed"));
        }
        let bytes = request.encode(id);
        let sent = tokio::time::timeout_at(deadline, async {
            let (writer, sealer) = &mut *self.writer.lock().await;
            // A frame cut off mid-write (this call dropped by its caller) leaves the record
            // count out of step with the owner's: the session ends rather than send on.
            let cut = KillUnlessDone(Some(self));
            let written = write_record(writer, sealer, &bytes).await;
            cut.done();
            written
        })
        .await;
        match sent {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                self.kill();
                return Err(lost(&e.to_string()));
            }
            Err(_) => {
                self.kill();
                return Err(lost("timed out sending"));
            }
        }
        match tokio::time::timeout_at(deadline, rx).await {
            Ok(Ok(reply)) => Ok(reply),
            Ok(Err(_)) => Err(lost("closed")),
            Err(_) => {
                self.kill();
                Err(PullError::fatal(
                    Status::Timeout,
                    format!("node {:08x} did not answer in time", self.node),
                ))
            }
        }
    }
}

/// Ends its session when dropped before [`KillUnlessDone::done`].
struct KillUnlessDone<'a>(Option<&'a Session>);

impl KillUnlessDone<'_> {
    fn done(mut self) {
        self.0 = None;
    }
}

impl Drop for KillUnlessDone<'_> {
    fn drop(&mut self) {
        if let Some(session) = self.0 {
            session.kill();
        }
    }
}

impl Cluster {
    /// The stream session to `node`, opened if there is none alive.
    async fn session(&self, node: u32, deadline: Instant) -> Result<Arc<Session>, PullError> {
        if let Some(s) = self.lock_sessions().get(&node).filter(|s| s.alive()) {
            return Ok(s.clone());
        }
        // One opening at a time: many forwards finding a session gone make one connection.
        let _opening = tokio::time::timeout_at(deadline, self.opening_sessions.lock())
            .await
            .map_err(|_| PullError::fatal(Status::Timeout, "waiting to open a stream session"))?;
        if let Some(s) = self.lock_sessions().get(&node).filter(|s| s.alive()) {
            return Ok(s.clone());
        }
        let peer = self.peer_for(node, deadline).await?;
        let (stream, identity, records) = self
            .transport
            .connect_session(peer.addr, deadline)
            .await
            .map_err(|e| {
                let mut err = PullError::from(e);
                err.message = format!("node {node:08x} at {}: {}", peer.addr, err.message);
                err
            })?;
        if identity.node_id != node {
            self.kick.notify_one();
            return Err(PullError::fatal(
                Status::Unreachable,
                format!(
                    "{} now answers as node {:08x}, not {node:08x}",
                    peer.addr, identity.node_id
                ),
            ));
        }
        let fresh = Arc::new(Session::start(
            self.counters.frames_rejected.clone(),
            stream,
            peer.addr,
            identity,
            records,
        ));
        let mut sessions = self.lock_sessions();
        // Two callers may have opened one at once: keep the first alive one.
        let kept = match sessions.get(&node) {
            Some(s) if s.alive() => s.clone(),
            _ => {
                sessions.insert(node, fresh.clone());
                fresh
            }
        };
        Ok(kept)
    }

    fn lock_sessions(&self) -> std::sync::MutexGuard<'_, HashMap<u32, Arc<Session>>> {
        self.sessions.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Which node's daemon listens at `addr` (`host:port`): `None` for this one. Waits (up to
    /// the pull timeout) for the peer to be found, so producers may start before a peer does.
    pub(crate) async fn node_at(&self, addr: &str) -> Result<Option<u32>, String> {
        let found = tokio::time::timeout(Duration::from_secs(5), tokio::net::lookup_host(addr))
            .await
            .map_err(|_| format!("resolving {addr:?} took over 5 s"))?
            .map_err(|e| format!("cannot resolve {addr:?}: {e}"))?;
        let addrs: Vec<SocketAddr> = found.collect();
        if self.config.listen.is_some_and(|l| addrs.contains(&l)) {
            return Ok(None);
        }
        let deadline = Instant::now() + self.config.pull_timeout;
        let mut rounds = self.rounds.subscribe();
        loop {
            {
                let m = self.lock_members();
                if addrs.iter().any(|a| m.own_addrs.contains(a)) {
                    return Ok(None);
                }
                if let Some(p) = m.by_node.values().find(|p| addrs.contains(&p.addr)) {
                    return Ok(Some(p.node_id));
                }
            }
            self.kick.notify_one();
            if tokio::time::timeout_at(deadline, rounds.changed())
                .await
                .is_err()
            {
                return Err(format!(
                    "no peer daemon answers at {addr} (is it in --peers? peers: {})",
                    self.describe_peers()
                ));
            }
        }
    }
}

/// Joins stream `id` on `node` for the ranks it owns, in joins of at most
/// [`MAX_SESSION_ITEMS`] ranks (each adds to the last): the stream's id there and how many ranks
/// it was told of. `None` once the stream is gone here.
async fn join_remote(
    shared: &Shared,
    session: &Session,
    id: u32,
    node: u32,
    deadline: Instant,
) -> Result<Option<(u32, usize)>, PullError> {
    let Some((uid, spec, depth, ranks)) = shared.with_streams(|s, _| s.remote_join(id, node))
    else {
        return Ok(None);
    };
    let mut remote = None;
    let chunks: Vec<&[StreamTask]> = if ranks.is_empty() {
        vec![&[]]
    } else {
        ranks.chunks(MAX_SESSION_ITEMS as usize).collect()
    };
    if spec.reshard.is_some() && session.protocol < RESHARDED_SINCE {
        return Err(PullError::fatal(
            Status::InvalidArgument,
            format!(
                "node {node:08x}'s feedstored speaks peer protocol {}, which cannot carry a \
                 stream resumed at another world size (from {RESHARDED_SINCE} on): upgrade it",
                session.protocol
            ),
        ));
    }
    for chunk in chunks {
        let join = SessionRequest::Join {
            uid,
            spec: spec.clone(),
            depth,
            ranks: chunk.to_vec(),
        };
        match session.call(&join, deadline).await? {
            SessionReply::Joined { stream } => remote = Some(stream),
            SessionReply::Failed { status, message } => {
                return Err(PullError::fatal(status, message));
            }
            other => {
                return Err(PullError::fatal(
                    Status::Protocol,
                    format!("unexpected answer to a join: {other:?}"),
                ));
            }
        }
    }
    Ok(remote.map(|r| (r, ranks.len())))
}

/// Runs the feeder of stream `id`'s ranks owned by `node` until no producer here serves the
/// stream: joins it there, keeps granted tasks ready for this node's producers, and comes back
/// after a lost session.
pub(crate) async fn feed_remote(shared: Arc<Shared>, cluster: Arc<Cluster>, id: u32, node: u32) {
    let mut events = shared.stream_events();
    let mut backoff = Duration::from_millis(100);
    loop {
        // Nobody here needs it (before joining, or after a lost session): nothing to tell the
        // owner.
        if shared.with_streams(|s, _| s.begin_leave(id, node))
            && shared.with_streams(|s, _| s.end_leave(id, node))
        {
            return;
        }
        let joined = async {
            let deadline = Instant::now() + cluster.config.pull_timeout;
            let session = cluster.session(node, deadline).await?;
            let joined = join_remote(&shared, &session, id, node, deadline).await?;
            Ok::<_, PullError>(joined.map(|j| (session, j)))
        }
        .await;
        let (session, (remote, ranks)) = match joined {
            Ok(Some(joined)) => joined,
            // The stream is gone here.
            Ok(None) => return,
            Err(e) => {
                cluster.log_once(
                    &format!("stream {id} node {node:08x}"),
                    format!(
                        "cannot join stream {id} on node {node:08x}: {} (trying again)",
                        e.message
                    ),
                );
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(MAX_BACKOFF);
                continue;
            }
        };
        backoff = Duration::from_millis(100);
        tracing::info!(stream = id, node = %format!("{node:08x}"), remote, "joined the stream on its ranks' node");
        shared.with_streams(|s, _| s.remote_joined(id, node, Some(remote), ranks));
        if serve_grants(&shared, &session, &mut events, id, node, remote).await {
            return;
        }
        // The session was lost (or the producers left and came back): what it was granted is
        // the owner's again; join again.
        shared.with_streams(|s, _| s.remote_joined(id, node, None, 0));
    }
}

/// Asks for tasks while this node's producers want them. `true` once the feeder left (no
/// producer here any more); `false` when the session was lost.
async fn serve_grants(
    shared: &Arc<Shared>,
    session: &Session,
    events: &mut tokio::sync::watch::Receiver<u64>,
    id: u32,
    node: u32,
    remote: u32,
) -> bool {
    let mut ended = false;
    loop {
        events.borrow_and_update();
        let demand = shared.with_streams(|s, _| s.demand(id, node));
        match demand {
            Demand::Leave => {
                if !shared.with_streams(|s, _| s.begin_leave(id, node)) {
                    continue;
                }
                let deadline = Instant::now() + Duration::from_secs(30);
                let told = session
                    .call(&SessionRequest::Leave { stream: remote }, deadline)
                    .await;
                if told.is_err() {
                    // The owner takes the tasks back when the session ends.
                    session.kill();
                }
                return shared.with_streams(|s, _| s.end_leave(id, node));
            }
            Demand::Rejoin => {
                let deadline = Instant::now() + Duration::from_secs(30);
                match join_remote(shared, session, id, node, deadline).await {
                    Ok(Some((_, ranks))) => {
                        shared.with_streams(|s, _| s.remote_joined(id, node, Some(remote), ranks));
                    }
                    Ok(None) => return true,
                    Err(e) => {
                        tracing::info!(node = %format!("{node:08x}"), reason = %e.message, "joining more ranks failed; joining again");
                        session.kill();
                        return false;
                    }
                }
            }
            Demand::Tasks(n) if !ended => {
                let take = SessionRequest::Take(TakeTasks {
                    stream: remote,
                    max: n.min(MAX_SESSION_ITEMS),
                    timeout_ms: TAKE_WAIT_MS,
                });
                let deadline = Instant::now()
                    + Duration::from_millis(u64::from(TAKE_WAIT_MS))
                    + Duration::from_secs(30);
                match session.call(&take, deadline).await {
                    Ok(SessionReply::Tasks(tasks)) => {
                        if !tasks.is_empty() {
                            shared.with_streams(|s, _| s.grant(id, node, &tasks));
                        }
                    }
                    Ok(SessionReply::Failed {
                        status: Status::Ended,
                        ..
                    }) => {
                        ended = true;
                        shared.with_streams(|s, _| s.remote_ended(id, node));
                    }
                    Ok(other) => {
                        tracing::warn!(node = %format!("{node:08x}"), reply = ?other, "stream take refused; joining again");
                        session.kill();
                        return false;
                    }
                    Err(e) => {
                        tracing::info!(node = %format!("{node:08x}"), reason = %e.message, "stream session lost; joining again");
                        return false;
                    }
                }
            }
            // Enough granted tasks wait, or the owner needs nothing more: wait for a change.
            _ => {
                if !session.alive() {
                    return false;
                }
                let _ = tokio::time::timeout(Duration::from_secs(1), events.changed()).await;
            }
        }
    }
}

/// Hands samples made here to the node owning their ranks, and returns the stream's leases on
/// them once that node has answered (it pulled them, or gave their tasks back to the window).
pub(crate) fn forward(shared: &Arc<Shared>, cluster: &Arc<Cluster>, forwards: Vec<Forward>) {
    for fwd in forwards {
        let (shared, cluster) = (shared.clone(), cluster.clone());
        tokio::spawn(async move {
            let deadline = Instant::now() + cluster.config.pull_timeout + Duration::from_secs(10);
            for items in fwd.items.chunks(MAX_SESSION_ITEMS as usize) {
                let put = SessionRequest::Put {
                    stream: fwd.remote_stream,
                    source: fwd.relay.unwrap_or(shared.node_id()),
                    items: items.to_vec(),
                };
                let answer = match cluster.session(fwd.node, deadline).await {
                    Ok(session) => session.call(&put, deadline).await,
                    Err(e) => Err(e),
                };
                match answer {
                    Ok(SessionReply::Done(statuses)) => {
                        let refused = statuses.iter().filter(|s| **s != Status::Ok).count();
                        if refused > 0 {
                            tracing::debug!(node = %format!("{:08x}", fwd.node), refused, "samples not taken by their ranks' node");
                        }
                    }
                    Ok(other) => {
                        tracing::warn!(node = %format!("{:08x}", fwd.node), reply = ?other, "samples refused by their ranks' node")
                    }
                    Err(e) => {
                        tracing::info!(node = %format!("{:08x}", fwd.node), reason = %e.message, "samples not handed over (their tasks go back to the window there)")
                    }
                }
                shared.with_objects(|o| {
                    for item in items.iter().filter(|i| i.flags & ENTRY_FAILED == 0) {
                        let _ = o.release(fwd.leases, item.handle);
                    }
                });
            }
        });
    }
}

/// The owner's end: the producer connections (one per uid) a peer's session acts through,
/// taken out of every stream when the session ends, however it ends.
struct Producers {
    shared: Arc<Shared>,
    node: u32,
    by_uid: Mutex<HashMap<u32, ConnId>>,
    /// Stream id to the connection that joined it and the ranks it joined.
    joined: Mutex<HashMap<u32, (ConnId, BTreeSet<u32>)>>,
}

impl Drop for Producers {
    fn drop(&mut self) {
        let conns: Vec<ConnId> = self
            .by_uid
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .copied()
            .collect();
        self.shared.with_streams(|s, o| {
            for conn in conns {
                s.disconnect(conn);
                o.disconnect(conn);
            }
        });
    }
}

impl Producers {
    fn conn_for(&self, uid: u32) -> Result<ConnId, SessionReply> {
        let mut by_uid = self.by_uid.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(&conn) = by_uid.get(&uid) {
            return Ok(conn);
        }
        if by_uid.len() >= MAX_SESSION_UIDS {
            return Err(SessionReply::Failed {
                status: Status::LimitReached,
                message: format!("one session produces for at most {MAX_SESSION_UIDS} uids"),
            });
        }
        let conn = self.shared.with_streams(|s, o| {
            let conn = o.connect(ClientInfo {
                role: Role::Writer,
                uid,
                pid: 0,
                process: crate::objects::Process::default(),
                name: format!("producers of node {:08x}", self.node),
                internal: true,
                capped: false,
            });
            s.register_session(conn);
            conn
        });
        by_uid.insert(uid, conn);
        Ok(conn)
    }

    fn joined(&self, stream: u32) -> Result<(ConnId, BTreeSet<u32>), SessionReply> {
        self.joined
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&stream)
            .cloned()
            .ok_or(SessionReply::Failed {
                status: Status::Protocol,
                message: format!("stream {stream} was not joined on this session"),
            })
    }
}

/// Serves a peer's stream session until it ends.
pub(crate) async fn serve_session(
    shared: Arc<Shared>,
    cluster: Arc<Cluster>,
    stream: TcpStream,
    addr: SocketAddr,
    peer: PeerIdentity,
    records: Records,
) {
    let (mut reader, mut writer) = stream.into_split();
    let Records {
        mut sealer,
        mut opener,
    } = records;
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Vec<u8>>(MAX_SESSION_REQUESTS);
    let write = tokio::spawn(async move {
        while let Some(bytes) = rx.recv().await {
            if write_record(&mut writer, &mut sealer, &bytes)
                .await
                .is_err()
            {
                break;
            }
        }
    });
    let producers = Arc::new(Producers {
        shared: shared.clone(),
        node: peer.node_id,
        by_uid: Mutex::default(),
        joined: Mutex::default(),
    });
    let permits = Arc::new(Semaphore::new(MAX_SESSION_REQUESTS));
    let mut tasks = tokio::task::JoinSet::new();
    tracing::info!(peer = %addr, node = %format!("{:08x}", peer.node_id), "stream session opened");
    let why = loop {
        let read = read_frame(&mut reader, &mut opener, &cluster.counters.frames_rejected);
        let body = match tokio::time::timeout(IDLE_TIMEOUT, read).await {
            Err(_) => break format!("idle for {IDLE_TIMEOUT:?}"),
            Ok(Err(e)) => break e.to_string(),
            Ok(Ok(body)) => body,
        };
        let (id, request) = match SessionRequest::decode(&body) {
            Ok(r) => r,
            Err(e) => break format!("malformed request: {e}"),
        };
        let Ok(permit) = permits.clone().acquire_owned().await else {
            break "shutting down".into();
        };
        let (shared, cluster, producers, tx) = (
            shared.clone(),
            cluster.clone(),
            producers.clone(),
            tx.clone(),
        );
        tasks.spawn(async move {
            let reply = answer(&shared, &cluster, &producers, request).await;
            let _ = tx.send(reply.encode(id)).await;
            drop(permit);
        });
        while tasks.try_join_next().is_some() {}
    };
    tracing::info!(peer = %addr, reason = %why, "stream session closed");
    tasks.shutdown().await;
    write.abort();
    // The last holder of `producers` drops here: the session's tasks go back to the windows.
}

async fn answer(
    shared: &Arc<Shared>,
    cluster: &Arc<Cluster>,
    producers: &Producers,
    request: SessionRequest,
) -> SessionReply {
    let failed = |e: crate::streams::StreamError| SessionReply::Failed {
        status: e.status,
        message: e.message,
    };
    match request {
        SessionRequest::Join {
            uid,
            spec,
            depth,
            ranks,
        } => {
            let conn = match producers.conn_for(uid) {
                Ok(c) => c,
                Err(reply) => return reply,
            };
            match shared
                .with_streams(|s, o| s.join(o, conn, &spec, depth, &ranks, &Placement::default()))
            {
                Ok((stream, _)) => {
                    producers
                        .joined
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .entry(stream)
                        .or_insert_with(|| (conn, BTreeSet::new()))
                        .1
                        .extend(ranks.iter().map(|t| t.rank));
                    SessionReply::Joined { stream }
                }
                Err(e) => failed(e),
            }
        }
        SessionRequest::Take(TakeTasks {
            stream,
            max,
            timeout_ms,
        }) => {
            let (conn, ranks) = match producers.joined(stream) {
                Ok(c) => c,
                Err(reply) => return reply,
            };
            // A batched stream's last whole batch may go up to `MAX_BATCH - 1` past `max`.
            let max = max.clamp(1, MAX_SESSION_ITEMS - (crate::streams::MAX_BATCH - 1));
            let deadline =
                Instant::now() + Duration::from_millis(u64::from(timeout_ms.min(MAX_TAKE_WAIT_MS)));
            let mut events = shared.stream_events();
            loop {
                events.borrow_and_update();
                match shared.with_streams(|s, _| s.take(conn, stream, max, Some(&ranks))) {
                    Ok(tasks) if !tasks.is_empty() || Instant::now() >= deadline => {
                        return SessionReply::Tasks(tasks);
                    }
                    Ok(_) => {}
                    Err(e) => return failed(e),
                }
                let _ = tokio::time::timeout_at(deadline, events.changed()).await;
            }
        }
        SessionRequest::Put {
            stream,
            source,
            items,
        } => {
            let (conn, _) = match producers.joined(stream) {
                Ok(c) => c,
                Err(reply) => return reply,
            };
            put_pulled(shared, cluster, conn, stream, source, items).await
        }
        SessionRequest::Leave { stream } => {
            if let Ok((conn, _)) = producers.joined(stream) {
                shared.with_streams(|s, _| s.leave(conn, stream));
                producers
                    .joined
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .remove(&stream);
            }
            SessionReply::Done(vec![Status::Ok])
        }
    }
}

/// Pulls the samples a peer made for this node's ranks (those not here already), then puts
/// them into the stream as a local producer would. A sample that cannot be pulled gives its
/// task back to the window, to be made again by whichever producer takes it next.
async fn put_pulled(
    shared: &Arc<Shared>,
    cluster: &Arc<Cluster>,
    conn: ConnId,
    stream: u32,
    source: u32,
    items: Vec<StreamItem>,
) -> SessionReply {
    let pulls = items.iter().map(|item| async move {
        if item.flags & ENTRY_FAILED != 0 {
            return Ok(());
        }
        // This node's own object only if it is a sample this stream's producers here made (a
        // peer's decode-once cache hit on a copy of it): a peer may not publish other objects
        // of this node (other users' among them) into a ring.
        if item.handle.node_id == shared.node_id() {
            let ours = shared.with_streams(|s, _| s.cached_sample(stream, item.key, item.handle));
            return if ours {
                Ok(())
            } else {
                Err(Status::InvalidArgument)
            };
        }
        if shared.with_objects(|o| o.is_sealed(item.handle)) {
            return Ok(());
        }
        // From the relay the producers' node named, unless that is this node (then straight
        // from the owner: this node is the one copy in between).
        let via = if source == shared.node_id() {
            item.handle.node_id
        } else {
            source
        };
        cluster.pulled(shared, item.handle, via).await
    });
    let pulled: Vec<Result<(), Status>> = futures_util::future::join_all(pulls).await;
    let mut statuses: Vec<Status> = Vec::with_capacity(items.len());
    let ok: Vec<StreamItem> = items
        .iter()
        .zip(&pulled)
        .filter(|(_, p)| p.is_ok())
        .map(|(i, _)| *i)
        .collect();
    // (Not while the daemon is handed over: a sample published now would give its consumer a
    // lease the successor does not know.)
    let busy = shared.handoff.enter().await;
    let put = shared.with_streams(|s, o| {
        for (item, p) in items.iter().zip(&pulled) {
            if p.is_err() {
                s.give_back(conn, stream, item.task);
            }
        }
        s.put(o, conn, stream, &ok, false)
    });
    drop(busy);
    let mut put = match put {
        Ok(statuses) => statuses.into_iter(),
        Err(e) => {
            return SessionReply::Failed {
                status: e.status,
                message: e.message,
            };
        }
    };
    for p in &pulled {
        statuses.push(match p {
            Ok(()) => put.next().unwrap_or(Status::Protocol),
            Err(status) => *status,
        });
    }
    SessionReply::Done(statuses)
}
