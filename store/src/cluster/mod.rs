//! Cross-node pulls: a handle owned by another node, read on this one.
//!
//! A daemon started with `--listen` accepts other daemons (never clients) on a TCP port; with
//! `--peers` (addresses or DNS names, re-resolved every `--peer-refresh-secs`) or
//! `--peers-file` it connects to them. Each connection starts with a handshake that exchanges
//! node id, epoch and protocol version and, when the cluster has a secret, proves it both ways
//! ([`auth`]); a clashing node id, another version or a wrong secret is refused with a reason
//! logged on both sides.
//!
//! When a client asks this daemon for a handle of another node, the connection's get starts a
//! pull ([`Cluster::pull`]), or joins the one under way for that handle: the engine asks the
//! owner for the object's first range, reserves room for the whole object in this node's
//! shared memory, lands every range straight from the socket into the reservation (large
//! objects in ranges over several connections at once), checks every record's tag ([`record`]),
//! and seals the copy under the owner's handle
//! ([`Objects::seal_copy`](crate::objects::Objects::seal_copy)).
//! The get then leases the copy like any local object, and later gets of the handle on this node
//! never touch the network. Anything that fails aborts the reservation and answers the reader
//! with a status that says why.

pub mod auth;
mod pull;
pub mod record;
mod serve;
mod session;

pub(crate) use session::{feed_remote, forward};
pub mod transport;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use feedstore_proto::frame::Created;
use feedstore_proto::{Handle, Status, StoreStats};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore, oneshot, watch};
use tokio::time::Instant;

pub use crate::config::ClusterConfig;
use crate::objects::ConnId;
use crate::state::Shared;
use auth::Secret;
use transport::{
    Channel, LinkError, LocalIdentity, PullError, TcpChannel, TcpTransport, Transport,
};

/// Bytes per range: an object larger than this is pulled in ranges over several connections.
pub const RANGE_BYTES: u64 = 16 << 20;

/// Attempts of one pull on fresh connections after a reset or a lost connection.
const ATTEMPTS: u32 = 3;

/// Connections that have not proved the cluster secret yet, per budget (one for addresses the
/// peer list names, one for the rest): past this, the oldest handshake of the source holding
/// the most in that budget goes.
pub const MAX_HANDSHAKES: usize = 64;

/// Lines a flood of failed handshakes may log per [`LOG_WINDOW`]; the rest are counted and
/// summed up in one line, logged with the first line of a later window.
const LOG_LINES: u32 = 5;
/// See [`LOG_LINES`].
const LOG_WINDOW: Duration = Duration::from_secs(10);

/// Counters behind the cluster's lines of `feedstore stat`.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pulls: AtomicU64,
    pulled_bytes: AtomicU64,
    fail_unreachable: AtomicU64,
    fail_timeout: AtomicU64,
    fail_missing: AtomicU64,
    fail_corrupt: AtomicU64,
    fail_full: AtomicU64,
    pub(crate) peers_refused: AtomicU64,
    pub(crate) served_reads: AtomicU64,
    pub(crate) served_bytes: AtomicU64,
    /// Shared with the stream sessions' reader tasks.
    frames_rejected: Arc<AtomicU64>,
    handshakes_dropped: AtomicU64,
}

/// How a pull ended, as every get waiting for it learns.
pub type PullOutcome = Result<(), PullError>;

/// One peer daemon, known by its node id.
#[derive(Debug)]
struct Peer {
    addr: SocketAddr,
    node_id: u32,
    /// Connections that may be open at once.
    permits: Arc<Semaphore>,
    /// Open connections not carrying a range now.
    idle: Mutex<Vec<TcpChannel>>,
    /// Whether its last connection attempt succeeded.
    up: AtomicBool,
}

/// A connection taken from a peer's pool; dropped, it closes; [`Pooled::recycle`] puts it back.
struct Pooled {
    channel: TcpChannel,
    _permit: OwnedSemaphorePermit,
}

#[derive(Debug, Default)]
struct Membership {
    by_node: HashMap<u32, Arc<Peer>>,
    /// Addresses that reached this daemon itself.
    own_addrs: HashSet<SocketAddr>,
    /// The last problem logged per address or name, so a dead peer logs once, not every refresh.
    logged: HashMap<String, String>,
}

/// This node's view of the cluster and its pulls.
pub struct Cluster {
    config: ClusterConfig,
    transport: TcpTransport,
    /// The object-table connection the pulls reserve and seal copies through.
    engine_conn: ConnId,
    members: Mutex<Membership>,
    /// Bumped after each round of resolving and probing peers.
    rounds: watch::Sender<u64>,
    /// Asks for a round now (a pull found a peer gone).
    kick: Notify,
    inflight: Mutex<HashMap<Handle, watch::Receiver<Option<PullOutcome>>>>,
    /// Connections other daemons have open to this one, having proved the secret: in all, and
    /// by address.
    peer_connections: Mutex<(usize, HashMap<IpAddr, usize>)>,
    /// Connections not yet past their handshake: from addresses the peer list names, and from
    /// the rest, each with a budget of its own.
    handshakes: Mutex<[Handshakes; 2]>,
    /// The addresses the peer list resolved to at the last round.
    listed: Mutex<HashSet<IpAddr>>,
    /// Lines logged about failed handshakes in the current window, and those left out.
    handshake_log: Mutex<(std::time::Instant, u32, u64)>,
    /// Stream sessions this node opened to other nodes, by node id.
    sessions: Mutex<HashMap<u32, Arc<session::Session>>>,
    /// Held while a session is being opened.
    opening_sessions: tokio::sync::Mutex<()>,
    pub(crate) counters: Counters,
}

impl std::fmt::Debug for Cluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cluster")
            .field("config", &self.config)
            .field("engine_conn", &self.engine_conn)
            .finish_non_exhaustive()
    }
}

impl Cluster {
    /// A cluster view for the daemon `(node_id, epoch)` whose pulls use the object-table
    /// connection `engine_conn` (an internal writer).
    pub fn new(
        config: ClusterConfig,
        node_id: u32,
        epoch: u32,
        secret: Option<Secret>,
        engine_conn: ConnId,
    ) -> Cluster {
        let instance = u64::from_le_bytes(crate::random_bytes());
        Cluster {
            transport: TcpTransport::new(LocalIdentity {
                node_id,
                epoch,
                instance,
                secret,
            }),
            config,
            engine_conn,
            members: Mutex::new(Membership::default()),
            rounds: watch::Sender::new(0),
            kick: Notify::new(),
            inflight: Mutex::new(HashMap::new()),
            peer_connections: Mutex::new((0, HashMap::new())),
            handshakes: Mutex::new(Default::default()),
            listed: Mutex::new(HashSet::new()),
            handshake_log: Mutex::new((std::time::Instant::now(), 0, 0)),
            sessions: Mutex::new(HashMap::new()),
            opening_sessions: tokio::sync::Mutex::new(()),
            counters: Counters::default(),
        }
    }

    /// The settings it runs with.
    pub fn config(&self) -> &ClusterConfig {
        &self.config
    }

    /// Starts the listener (if any) and the membership loop on the current runtime.
    pub(crate) fn start(
        self: &Arc<Self>,
        shared: &Arc<Shared>,
        listener: Option<std::net::TcpListener>,
    ) -> Vec<tokio::task::JoinHandle<()>> {
        assert!(
            shared.mapped_for_pulls(),
            "a cluster serves a Shared made with ServeConfig::cluster set"
        );
        let mut tasks = Vec::new();
        if let Some(listener) = listener {
            match tokio::net::TcpListener::from_std(listener) {
                Ok(listener) => {
                    tasks.push(tokio::spawn(serve::listen(
                        shared.clone(),
                        self.clone(),
                        listener,
                    )));
                }
                Err(e) => tracing::error!(error = %e, "cannot serve the peer listener"),
            }
        }
        let this = self.clone();
        tasks.push(tokio::spawn(async move { this.membership().await }));
        tasks
    }

    /// Adds the cluster's counters to a stats snapshot.
    pub fn add_stats(&self, s: &mut StoreStats) {
        let c = &self.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        s.peers_up = self
            .lock_members()
            .by_node
            .values()
            .filter(|p| p.up.load(Ordering::Relaxed))
            .count() as u64;
        s.pulls_in_flight = self.lock_inflight().len() as u64;
        s.pulls = get(&c.pulls);
        s.pulled_bytes = get(&c.pulled_bytes);
        s.pull_failures_unreachable = get(&c.fail_unreachable);
        s.pull_failures_timeout = get(&c.fail_timeout);
        s.pull_failures_missing = get(&c.fail_missing);
        s.pull_failures_corrupt = get(&c.fail_corrupt);
        s.pull_failures_full = get(&c.fail_full);
        s.peers_refused = get(&c.peers_refused);
        s.served_reads = get(&c.served_reads);
        s.served_bytes = get(&c.served_bytes);
        s.peer_frames_rejected = get(&c.frames_rejected);
        s.peer_handshakes_dropped = get(&c.handshakes_dropped);
    }

    fn lock_members(&self) -> std::sync::MutexGuard<'_, Membership> {
        self.members.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn lock_inflight(
        &self,
    ) -> std::sync::MutexGuard<'_, HashMap<Handle, watch::Receiver<Option<PullOutcome>>>> {
        self.inflight.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A place in the handshake budget for a connection just accepted: strangers that never
    /// finish a handshake hold only these, never the places of peers that proved the secret.
    /// Connections from an address the peer list names have a budget of their own, which no
    /// stranger's connection takes or evicts. Within a budget, when it is full or the
    /// connection's source (its address; its /64 for IPv6) holds its share (twice
    /// `--peer-connections`, plus 2 for probes), the oldest handshake of the source holding the
    /// most is ended to make room: a flood of silent connections keeps being replaced.
    fn begin_handshake(self: &Arc<Self>, addr: SocketAddr) -> HandshakeTicket {
        let per_source = 2 * self.config.connections_per_peer + 2;
        let source = SourceKey::of(addr.ip());
        let pool = usize::from(
            self.listed
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .contains(&addr.ip()),
        );
        let mut pools = self.handshakes.lock().unwrap_or_else(|e| e.into_inner());
        let h = &mut pools[pool];
        let evict = if h.by_source.get(&source).copied().unwrap_or(0) >= per_source {
            Some(source)
        } else if h.open.len() >= MAX_HANDSHAKES {
            h.busiest()
        } else {
            None
        };
        if let Some(victim) = evict
            && let Some(id) = h.oldest_of(victim)
        {
            h.remove(id);
            // Its task hears it, closes the connection and counts it.
        }
        let (tx, rx) = oneshot::channel();
        h.next += 1;
        let id = h.next;
        h.open.insert(id, (source, tx));
        *h.by_source.entry(source).or_insert(0) += 1;
        HandshakeTicket {
            cluster: self.clone(),
            pool,
            id,
            evicted: rx,
        }
    }

    /// Counts a connection closed before it proved the secret, and says why (rate-limited).
    fn note_handshake_dropped(&self, addr: SocketAddr, why: &str) {
        self.counters
            .handshakes_dropped
            .fetch_add(1, Ordering::Relaxed);
        self.log_limited(format!(
            "peer connection from {addr} closed before it proved the cluster secret: {why}"
        ));
    }

    /// Counts a record from a peer that failed its tag.
    fn note_forged_record(&self) {
        self.counters
            .frames_rejected
            .fetch_add(1, Ordering::Relaxed);
    }

    /// Logs a line about a connection that did not become a peer, at most [`LOG_LINES`] per
    /// [`LOG_WINDOW`]: a flood from strangers costs a few lines, and the next window's first
    /// line comes with one that sums up what was left out.
    fn log_limited(&self, message: String) {
        let mut log = self.handshake_log.lock().unwrap_or_else(|e| e.into_inner());
        let (start, lines, skipped) = &mut *log;
        if start.elapsed() >= LOG_WINDOW {
            if *skipped > 0 {
                tracing::warn!(
                    "{skipped} more connections did not become peers in the last {:?} (not \
                     logged one by one; peer_handshakes_dropped and peers_refused count them)",
                    start.elapsed()
                );
            }
            (*start, *lines, *skipped) = (std::time::Instant::now(), 0, 0);
        }
        if *lines < LOG_LINES {
            *lines += 1;
            tracing::warn!("{message}");
        } else {
            *skipped += 1;
        }
    }

    /// Counts a connection that proved the secret against `--max-peer-connections` and against
    /// the share one address may hold (twice `--peer-connections`, plus 2 for probes). `None`,
    /// logged once, when full.
    fn admit_peer_connection(self: &Arc<Self>, addr: SocketAddr) -> Option<PeerSlot> {
        let per_address = 2 * self.config.connections_per_peer + 2;
        let mut open = self
            .peer_connections
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let (total, by_ip) = &mut *open;
        let mine = by_ip.entry(addr.ip()).or_insert(0);
        let refusal = if *total >= self.config.max_peer_connections {
            Some(format!(
                "{total} peer connections open (--max-peer-connections)"
            ))
        } else if *mine >= per_address {
            Some(format!(
                "{mine} connections open from {}, the most one address may hold",
                addr.ip()
            ))
        } else {
            None
        };
        if let Some(message) = refusal {
            if *mine == 0 {
                by_ip.remove(&addr.ip());
            }
            drop(open);
            self.log_once(
                &addr.ip().to_string(),
                format!("peer connection from {addr} refused: {message}"),
            );
            return None;
        }
        *mine += 1;
        *total += 1;
        Some(PeerSlot(self.clone(), addr.ip()))
    }

    /// Logs `message` for `key` at warn level unless it is the last thing logged for `key`
    /// (remembering at most 1024 keys).
    pub(crate) fn log_once(&self, key: &str, message: String) {
        let mut m = self.lock_members();
        if m.logged.get(key) != Some(&message) {
            tracing::warn!(peer = key, "{message}");
            if m.logged.len() >= 1024 {
                m.logged.clear();
            }
            m.logged.insert(key.to_owned(), message);
        }
    }

    fn describe_peers(&self) -> String {
        let m = self.lock_members();
        if m.by_node.is_empty() {
            return "none reachable".into();
        }
        let mut peers: Vec<String> = m
            .by_node
            .values()
            .map(|p| format!("{:08x} at {}", p.node_id, p.addr))
            .collect();
        peers.sort();
        peers.join(", ")
    }

    /// Resolves the peer list and connects to new peers, every `--peer-refresh-secs` or when a
    /// pull finds a peer gone.
    async fn membership(self: Arc<Self>) {
        loop {
            let addrs = self.resolve().await;
            *self.listed.lock().unwrap_or_else(|e| e.into_inner()) =
                addrs.iter().map(SocketAddr::ip).collect();
            let probes: Vec<_> = {
                let mut m = self.lock_members();
                // Peers whose address no longer resolves leave.
                let before = m.by_node.len();
                m.by_node.retain(|_, p| addrs.contains(&p.addr));
                if m.by_node.len() < before {
                    tracing::info!(left = before - m.by_node.len(), "peers left the peer list");
                }
                let known_up: HashSet<SocketAddr> = m
                    .by_node
                    .values()
                    .filter(|p| p.up.load(Ordering::Relaxed))
                    .map(|p| p.addr)
                    .collect();
                addrs
                    .iter()
                    .filter(|a| !m.own_addrs.contains(a) && !known_up.contains(a))
                    .map(|&a| self.probe(a))
                    .collect()
            };
            futures_util::future::join_all(probes).await;
            self.rounds.send_modify(|r| *r += 1);
            tokio::select! {
                _ = tokio::time::sleep(self.config.refresh) => {}
                _ = self.kick.notified() => {
                    // A burst of failures asks once; give the peer a moment.
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        }
    }

    /// Every address the peer list names now.
    async fn resolve(&self) -> HashSet<SocketAddr> {
        let mut specs = self.config.peers.clone();
        if let Some(path) = &self.config.peers_file {
            match std::fs::read_to_string(path) {
                Ok(text) => specs.extend(
                    text.lines()
                        .map(|l| l.split('#').next().unwrap_or("").trim())
                        .filter(|l| !l.is_empty())
                        .map(str::to_owned),
                ),
                Err(e) => self.log_once(
                    &path.display().to_string(),
                    format!("cannot read --peers-file: {e}"),
                ),
            }
        }
        let mut addrs = HashSet::new();
        for spec in specs {
            let lookup = tokio::time::timeout(
                Duration::from_secs(5),
                tokio::net::lookup_host(spec.clone()),
            )
            .await;
            match lookup {
                Ok(Ok(found)) => addrs.extend(found),
                Ok(Err(e)) => self.log_once(&spec, format!("cannot resolve peer: {e}")),
                Err(_) => self.log_once(&spec, "resolving the peer timed out".into()),
            }
        }
        addrs
    }

    /// Connects to `addr` and, if a peer answers, files it under its node id with the connection
    /// kept for the first pull.
    async fn probe(&self, addr: SocketAddr) {
        let deadline = Instant::now() + transport::HANDSHAKE_TIMEOUT;
        match self.transport.connect(addr, deadline).await {
            Ok(channel) => {
                let id = channel.peer();
                let mut m = self.lock_members();
                if let Some(other) = m.by_node.get(&id.node_id)
                    && other.addr != addr
                    && other.up.load(Ordering::Relaxed)
                {
                    let message = format!(
                        "{addr} and {} both claim node id {:08x}; ignoring {addr} (give each \
                         node its own --node-id)",
                        other.addr, id.node_id
                    );
                    drop(m);
                    self.log_once(&addr.to_string(), message);
                    return;
                }
                let peer = Arc::new(Peer {
                    addr,
                    node_id: id.node_id,
                    permits: Arc::new(Semaphore::new(self.config.connections_per_peer)),
                    idle: Mutex::new(vec![channel]),
                    up: AtomicBool::new(true),
                });
                m.by_node.insert(id.node_id, peer);
                m.logged.remove(&addr.to_string());
                drop(m);
                tracing::info!(peer = %addr, node = %format!("{:08x}", id.node_id), epoch = %format!("{:08x}", id.epoch), "peer up");
            }
            Err(LinkError::SelfConnection) => {
                self.lock_members().own_addrs.insert(addr);
            }
            Err(e) => {
                if e.is_refusal() {
                    self.counters.peers_refused.fetch_add(1, Ordering::Relaxed);
                }
                let m = self.lock_members();
                let was_up = m
                    .by_node
                    .values()
                    .find(|p| p.addr == addr)
                    .is_some_and(|p| p.up.swap(false, Ordering::Relaxed));
                drop(m);
                if was_up {
                    tracing::warn!(peer = %addr, error = %e, "peer down");
                }
                self.log_once(&addr.to_string(), format!("cannot reach peer: {e}"));
            }
        }
    }
}

/// Where a connection comes from, for the handshake budget's shares: its IPv4 address, or the
/// /64 of its IPv6 address (one host is usually given a whole /64).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum SourceKey {
    V4(std::net::Ipv4Addr),
    V6(u64),
}

impl SourceKey {
    fn of(ip: IpAddr) -> SourceKey {
        match ip {
            IpAddr::V4(v4) => SourceKey::V4(v4),
            IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
                Some(v4) => SourceKey::V4(v4),
                None => SourceKey::V6((v6.to_bits() >> 64) as u64),
            },
        }
    }
}

/// The connections still in their handshake, oldest first, with the signal that ends each.
#[derive(Debug, Default)]
struct Handshakes {
    next: u64,
    open: BTreeMap<u64, (SourceKey, oneshot::Sender<()>)>,
    by_source: HashMap<SourceKey, usize>,
}

impl Handshakes {
    /// The source holding the most handshakes (of those, the one whose oldest is oldest).
    fn busiest(&self) -> Option<SourceKey> {
        let most = self.by_source.values().copied().max()?;
        self.open
            .values()
            .map(|(source, _)| *source)
            .find(|s| self.by_source.get(s) == Some(&most))
    }

    fn oldest_of(&self, source: SourceKey) -> Option<u64> {
        self.open
            .iter()
            .find(|(_, (s, _))| *s == source)
            .map(|(&id, _)| id)
    }

    /// Takes a handshake out of the budget; dropping its sender tells its task to stop.
    fn remove(&mut self, id: u64) {
        if let Some((source, _signal)) = self.open.remove(&id)
            && let Some(n) = self.by_source.get_mut(&source)
        {
            *n -= 1;
            if *n == 0 {
                self.by_source.remove(&source);
            }
        }
    }
}

/// A connection's place in the handshake budget, given back when dropped (the handshake ended,
/// however it ended).
pub(crate) struct HandshakeTicket {
    cluster: Arc<Cluster>,
    pool: usize,
    id: u64,
    evicted: oneshot::Receiver<()>,
}

impl HandshakeTicket {
    /// Resolves when a newer connection took this one's place.
    async fn evicted(&mut self) {
        let _ = (&mut self.evicted).await;
    }
}

impl Drop for HandshakeTicket {
    fn drop(&mut self) {
        self.cluster
            .handshakes
            .lock()
            .unwrap_or_else(|e| e.into_inner())[self.pool]
            .remove(self.id);
    }
}

/// A peer connection counted against `--max-peer-connections` until dropped.
struct PeerSlot(Arc<Cluster>, IpAddr);

impl Drop for PeerSlot {
    fn drop(&mut self) {
        let mut open = self
            .0
            .peer_connections
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let (total, by_ip) = &mut *open;
        *total -= 1;
        if let Some(n) = by_ip.get_mut(&self.1) {
            *n -= 1;
            if *n == 0 {
                by_ip.remove(&self.1);
            }
        }
    }
}
