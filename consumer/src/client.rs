//! The connection to the node's daemon.

use std::collections::VecDeque;
use std::io::{IoSliceMut, Read};
use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::os::unix::io::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, Once, RwLock, Weak};
use std::time::{Duration, Instant};

use feedstore_proto::frame::{
    self, CacheEntry, Frame, HEADER_BYTES, Opcode, Request, Response, Speaks, max_batch_items,
};
use feedstore_proto::{Handle, Location, Role, SegmentInfo, Status, StoreStats};
use feedstore_shm::{Access, Mapping};
use nix::sys::socket::{ControlMessageOwned, MsgFlags};

use crate::Error;

mod io;
mod releases;

pub(crate) use io::unexpected;
use io::{
    Greeted, RecvBuf, Welcome, check_daemon_uid, check_error, check_segment_id, encode_releases,
    hello, read_frame, read_reply, recv_with_fds, send_all, send_all_or_none,
};
use releases::{MAX_QUEUED_RELEASES, PendingReleases, ReleaseQueue};

/// How to connect.
#[derive(Debug, Clone)]
pub struct ConnectOptions {
    /// The daemon's socket [default: [`feedstore_proto::client_socket_path`]:
    /// `$FEEDSTORE_SOCKET`, else this user's daemon, else the system daemon's].
    pub socket: PathBuf,
    /// The uid the daemon must run as, besides root and this process's own uid, which are
    /// always trusted [default: `$FEEDSTORE_DAEMON_UID`]. A socket served by any other uid is
    /// refused before a byte is sent ([`Error::UntrustedDaemon`]): whoever binds a socket path
    /// first must not receive a writer's samples or feed a reader its own bytes.
    pub daemon_uid: Option<u32>,
    /// How long to wait for the daemon to answer hello before failing with [`Error::Timeout`]
    /// (a daemon at its connection limit, or something that is not a daemon).
    pub hello_timeout: Duration,
    /// The largest reply payload this client accepts (announced at hello).
    pub max_frame_bytes: u32,
    /// Reader (maps read-only) or writer.
    pub role: Role,
    /// A label for the daemon's logs and stats.
    pub name: String,
    /// A writer builds the page tables of each object it reserves before handing it out
    /// ([`Mapping::populate_write`]: the pages this process has not written before, once), so
    /// its copy runs at memory speed instead of faulting page by page. Nothing is built ahead
    /// of use: connecting maps the store without page tables, and readers fault pages in as
    /// they first read them (64 KiB a fault; about 0.05 s per GiB more than a read of mapped
    /// pages, once per process; [`crate::Lease::prefault`] moves that to another thread). Building
    /// a whole store's page tables at connect (0.3 s of CPU per GiB writable, 0.07 s
    /// read-only, on a thread of its own) held the cores the first samples needed: `feedstore
    /// demo`'s first batch came at 0.4-1.0 s instead of 0.1 s. Connections of one process share
    /// one mapping of the store.
    pub populate: bool,
    /// How long a create waits for space before failing with [`Error::Full`].
    pub create_timeout: Duration,
    /// How long a dropped lease's release may wait to ride along with the next request instead
    /// of costing the daemon a wake-up of its own. Zero sends each release at once.
    pub release_delay: Duration,
    /// How long to try to reconnect when the daemon goes away (killed, crashed, restarted)
    /// before failing with [`Error::Disconnected`], which then says so [default:
    /// `$FEEDSTORE_RECONNECT_TIMEOUT` seconds, else zero: no reconnecting]. Tries come 10 ms
    /// apart at first, doubling to 1 s, jittered. A connection to the daemon started again on
    /// the same socket goes on where the call that found the old one gone left off: that call
    /// is sent again, unless it named a stream (the [`crate::Stream`] or
    /// [`crate::StreamFeeder`] attaches or joins again first); what lived only in the old
    /// daemon is gone (a `get` of one of its handles fails with [`Error::Stale`]), and views
    /// taken before stay readable and unchanged until dropped.
    pub reconnect_timeout: Duration,
}

impl ConnectOptions {
    /// Defaults for a role.
    pub fn new(role: Role) -> ConnectOptions {
        ConnectOptions {
            socket: feedstore_proto::client_socket_path(),
            daemon_uid: std::env::var(feedstore_proto::DAEMON_UID_ENV)
                .ok()
                .and_then(|v| v.trim().parse().ok()),
            hello_timeout: Duration::from_secs(10),
            max_frame_bytes: frame::MAX_PAYLOAD_BYTES,
            role,
            name: default_name(),
            populate: true,
            create_timeout: Duration::from_secs(10),
            release_delay: Duration::from_millis(1),
            reconnect_timeout: reconnect_timeout_from_env(),
        }
    }

    /// Sets the socket path.
    pub fn socket(mut self, socket: impl Into<PathBuf>) -> Self {
        self.socket = socket.into();
        self
    }

    /// Sets the client's label (at most [`feedstore_proto::MAX_CLIENT_NAME`] bytes of
    /// printable text; the daemon refuses others).
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// Trusts a daemon run by `uid` (besides root and this process's own uid).
    pub fn daemon_uid(mut self, uid: u32) -> Self {
        self.daemon_uid = Some(uid);
        self
    }

    /// Sets how long the daemon may take to answer hello.
    pub fn hello_timeout(mut self, timeout: Duration) -> Self {
        self.hello_timeout = timeout;
        self
    }

    /// Sets whether a writer builds an object's page tables when it reserves it (see
    /// [`ConnectOptions::populate`]).
    pub fn populate(mut self, populate: bool) -> Self {
        self.populate = populate;
        self
    }

    /// Sets the create timeout.
    pub fn create_timeout(mut self, timeout: Duration) -> Self {
        self.create_timeout = timeout;
        self
    }

    /// Sets the release delay.
    pub fn release_delay(mut self, delay: Duration) -> Self {
        self.release_delay = delay;
        self
    }

    /// Sets how long to try to reconnect to a daemon that went away (zero: never).
    pub fn reconnect_timeout(mut self, timeout: Duration) -> Self {
        self.reconnect_timeout = timeout;
        self
    }

    /// Connects.
    pub fn connect(self) -> Result<Client, Error> {
        Client::connect_with(self)
    }
}

fn default_name() -> String {
    let exe = std::env::current_exe().ok();
    let exe: String = exe
        .as_deref()
        .and_then(|p| p.file_name())
        .map(|n| {
            n.to_string_lossy()
                .chars()
                .filter(|c| !c.is_control())
                .take(64)
                .collect()
        })
        .unwrap_or_else(|| "client".into());
    format!("{exe}[{}]", std::process::id())
}

/// Options for one create.
#[derive(Debug, Clone, Copy, Default)]
pub struct CreateOptions {
    /// Wait at most this long for space [default: the connection's `create_timeout`].
    pub timeout: Option<Duration>,
    /// Never evict this object (it can still be deleted).
    pub pin: bool,
}

/// Forks this process has gone through as a child (bumped by a `pthread_atfork` handler).
static FORKS: AtomicU64 = AtomicU64::new(0);

extern "C" fn after_fork_in_child() {
    // An atomic add: async-signal-safe, as a fork handler must be.
    FORKS.fetch_add(1, Ordering::Relaxed);
}

/// How many forks made this process, the handler installed on first use. A client made before
/// a fork belongs to the parent: the child must not speak on its socket (a release from the
/// child would return the parent's lease) and gets [`Error::Forked`] instead.
fn fork_generation() -> u64 {
    static INSTALL: Once = Once::new();
    INSTALL.call_once(|| {
        // SAFETY: registers a child handler that only does an atomic add (async-signal-safe);
        // no prepare or parent handler. The handler is a plain function that lives forever.
        let rc = unsafe { libc::pthread_atfork(None, None, Some(after_fork_in_child)) };
        if rc != 0 {
            tracing::warn!(
                rc,
                "cannot watch for forks; a forked child could misuse clients"
            );
        }
    });
    FORKS.load(Ordering::Relaxed)
}

/// [`feedstore_proto::RECONNECT_ENV`] in seconds; unset, or not a number of seconds (warned
/// once), 0: no reconnect.
fn reconnect_timeout_from_env() -> Duration {
    let Ok(text) = std::env::var(feedstore_proto::RECONNECT_ENV) else {
        return Duration::ZERO;
    };
    let parsed = text
        .trim()
        .parse::<f64>()
        .ok()
        .and_then(|s| Duration::try_from_secs_f64(s).ok());
    parsed.unwrap_or_else(|| {
        static WARNED: AtomicBool = AtomicBool::new(false);
        if !WARNED.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                value = %text,
                "{} is not a number of seconds; clients do not reconnect",
                feedstore_proto::RECONNECT_ENV
            );
        }
        Duration::ZERO
    })
}

/// `pause`, moved by up to half of it either way (clients that lost one daemon do not all
/// knock on its successor at the same instant).
fn jittered(pause: Duration) -> Duration {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    // A cheap spread of the clock's low bits over [0.5, 1.5).
    let spread = f64::from(nanos.wrapping_mul(2_654_435_761) % 1_000_000) / 1_000_000.0;
    pause.mul_f64(0.5 + spread)
}

/// Says that a client speaks an older protocol than its newest with its daemon: once per
/// process at warn (every connection of a DataLoader's workers would repeat it), then at debug.
fn note_downgrade(opts: &ConnectOptions, from: u16, to: u16, why: &str) {
    static WARNED: AtomicBool = AtomicBool::new(false);
    let socket = opts.socket.display();
    if WARNED.swap(true, Ordering::Relaxed) {
        tracing::debug!(%socket, from, to, "{why}: saying hello in protocol {to}");
    } else {
        tracing::warn!(
            %socket,
            from,
            to,
            "{why}: saying hello in protocol {to} (upgrade feedstored to the client's release \
             for every feature; said once per process)"
        );
    }
}

/// One connection to one daemon: the socket and what its hello said. A client has one at a
/// time; a daemon that went away and came back on the same socket gets a new one
/// ([`ConnectOptions::reconnect_timeout`]), and whatever came through the old one (a lease's
/// mapping, a stream's ring) keeps the old one's mappings.
pub(crate) struct Link {
    stream: UnixStream,
    segments: Vec<Arc<Mapping>>,
    node_id: u32,
    epoch: u32,
    /// The largest request payload the daemon accepts (from its hello reply).
    request_limit: u32,
    /// The protocol version agreed at hello.
    version: u16,
    /// What the daemon speaks (its versions, features and release), from its hello reply.
    daemon: Speaks,
    /// Out of step with the daemon, or the daemon gone: no call goes through it any more.
    broken: AtomicBool,
    /// Broken because the daemon went away (end of stream, a reset, `ShuttingDown`): only
    /// then does a reconnecting client connect again. (Out of step with a daemon still there,
    /// it must not: the daemon would reclaim the leases of views still in use.)
    gone: AtomicBool,
    /// How many links the client had before this one.
    generation: u64,
    /// The generation of the first link to this daemon's memory: a daemon that took over
    /// from the one before (`feedstored --takeover`, the same epoch) holds the leases taken
    /// on its predecessor, so they are returned to it; one started afresh does not.
    lineage: u64,
}

impl Link {
    /// The mapping of the segment holding `loc`, which a reply on this link named; an error if
    /// the range lies outside it.
    pub(crate) fn mapping(&self, loc: Location) -> Result<&Arc<Mapping>, Error> {
        let mapping = self.segments.get(loc.segment as usize).ok_or_else(|| {
            Error::Protocol(format!("daemon named unknown segment {}", loc.segment))
        })?;
        if mapping.range_ptr(loc.offset, loc.len).is_none() {
            return Err(Error::Protocol(format!(
                "daemon named a range outside segment {}",
                loc.segment
            )));
        }
        Ok(mapping)
    }

    pub(crate) fn generation(&self) -> u64 {
        self.generation
    }

    pub(crate) fn lineage(&self) -> u64 {
        self.lineage
    }

    /// Whether the daemon at the other end has `feature` (and so does this client).
    pub(crate) fn has_feature(&self, feature: u64) -> bool {
        self.daemon.features & frame::FEATURES & feature == feature
    }

    /// The writer uid the daemon named for an object, if it records writers
    /// ([`frame::feature::WRITERS`]); else [`frame::Got::UNKNOWN_WRITER`], whatever it sent.
    pub(crate) fn believed_writer(&self, named: u32) -> u32 {
        if self.has_feature(frame::feature::WRITERS) {
            named
        } else {
            frame::Got::UNKNOWN_WRITER
        }
    }

    fn breaks(&self) {
        self.broken.store(true, Ordering::Relaxed);
    }

    /// This link, broken, without the store's mappings: what a client or a stream keeps of a
    /// daemon that went away, so that the old store's memory goes as soon as the views taken
    /// from it do (a daemon started in its place may need that memory to start at all). `None`
    /// if the socket cannot be duplicated (then the link stays as it is).
    pub(crate) fn tombstone(&self) -> Option<Link> {
        Some(Link {
            stream: self.stream.try_clone().ok()?,
            segments: Vec::new(),
            node_id: self.node_id,
            epoch: self.epoch,
            request_limit: self.request_limit,
            version: self.version,
            daemon: self.daemon.clone(),
            broken: AtomicBool::new(true),
            gone: AtomicBool::new(true),
            generation: self.generation,
            lineage: self.lineage,
        })
    }
}

pub(crate) struct Inner {
    /// The connection in use; replaced when the daemon comes back after going away.
    link: RwLock<Arc<Link>>,
    /// The current link's generation, for the paths that only compare it.
    generation: AtomicU64,
    /// The current link's lineage (leases of that lineage are returned to it).
    lineage: AtomicU64,
    /// How this client connected: how it connects again.
    opts: ConnectOptions,
    /// Times this client connected again after its daemon went away.
    reconnects: AtomicU64,
    /// [`fork_generation`] at connect: the connection belongs to the process that made it.
    forks: u64,
    /// Serialises request/reply pairs, and owns the receive buffer.
    call: Mutex<CallState>,
    /// Serialises writes to the socket: calls and one-way releases.
    send: Mutex<()>,
    role: Role,
    /// The largest reply payload this client accepts (announced in hello).
    reply_limit: u32,
    pub(crate) create_timeout: Duration,
    releases: Arc<ReleaseQueue>,
    /// Whether writers build an object's page tables when they reserve it.
    pub(crate) populate: bool,
    /// The handles of this client's live `ObjectWriter`s: a stream put may not name one
    /// (sealing it would publish bytes its writer can still change).
    pub(crate) writers: Mutex<std::collections::HashSet<feedstore_proto::Handle>>,
}

impl Inner {
    /// Whether this process is a child forked after the connection was made.
    fn forked(&self) -> bool {
        FORKS.load(Ordering::Relaxed) != self.forks
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        let mut state = self.releases.lock();
        state.closed = true;
        let due = std::mem::take(&mut state.handles);
        drop(state);
        self.releases.wake.notify_all();
        let link = self.link.read().unwrap_or_else(|e| e.into_inner());
        if !due.is_empty() && !link.broken.load(Ordering::Relaxed) && !self.forked() {
            let mut buf = Vec::new();
            if encode_releases(&due, link.request_limit, link.version, &mut buf).is_ok() {
                let _ = send_all(&link.stream, &buf);
            }
        }
    }
}

struct CallState {
    next_id: u32,
    wbuf: Vec<u8>,
    rbuf: RecvBuf,
    /// Requests sent by [`Client::submit`] whose replies are not read yet, oldest first (the
    /// daemon answers a connection's requests in order). At most [`MAX_OUTSTANDING`].
    outstanding: VecDeque<u32>,
    /// Replies read ahead of the one a caller waited for, by request id, until collected. At
    /// most [`MAX_ARRIVED`].
    arrived: Vec<(u32, Response)>,
}

/// The most submitted requests whose replies are not yet read, per connection: a submit past
/// it reads the oldest reply aside first (the daemon's socket holds the replies it could not
/// send while it waits, and stops reading the connection when it is full).
const MAX_OUTSTANDING: usize = 64;

/// The most replies read aside and not collected, per connection.
const MAX_ARRIVED: usize = 1024;

/// A request sent with [`Client::submit`] (its id, on the link of that generation), whose reply
/// [`Client::collect`] reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Ticket(u32, u64);

/// The first pause between tries to reconnect, and the longest.
const RECONNECT_FIRST: Duration = Duration::from_millis(10);
const RECONNECT_MAX: Duration = Duration::from_secs(1);

/// How many times one call is sent again on new links before its error stands.
const MAX_RESENDS: u32 = 3;

/// Whether `e` means the daemon went away (or is going): a reconnecting client tries again.
pub(crate) fn gone(e: &Error) -> bool {
    matches!(e, Error::Disconnected { .. } | Error::ShuttingDown)
}

/// A connection to the node's `feedstored`.
///
/// Cheap to clone (an `Arc`) and safe to share between threads. Calls from several threads are
/// serialised on the one socket, so a create waiting for space delays the other threads' calls
/// on the same client (lease releases still go through); give a thread that must not wait its
/// own client. Leases and writers keep the connection alive.
///
/// When the daemon goes away every call fails with [`Error::Disconnected`]; make a new client,
/// or connect with a [`ConnectOptions::reconnect_timeout`] and the client reconnects by itself
/// to the daemon started again on the same socket. Existing leases keep their mappings valid
/// either way (the memory stays until the last mapping goes).
#[derive(Clone)]
pub struct Client {
    pub(crate) inner: Arc<Inner>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("node_id", &self.node_id())
            .field("epoch", &self.epoch())
            .field("role", &self.inner.role)
            .field("reconnects", &self.reconnects())
            .finish()
    }
}

impl Client {
    /// Connects as a reader to the default socket.
    pub fn connect_reader() -> Result<Client, Error> {
        ConnectOptions::new(Role::Reader).connect()
    }

    /// Connects as a writer to the default socket.
    pub fn connect_writer() -> Result<Client, Error> {
        ConnectOptions::new(Role::Writer).connect()
    }

    /// Connects and says hello in the newest protocol version this client speaks, again in an
    /// older one (on a new connection) while the daemon speaks only older ones: the socket, the
    /// send buffer and the daemon's welcome. `reconnects`: how many times the client connected
    /// again after its daemon went away (the hello says so); on a reconnect, a close at hello
    /// is a daemon still starting (tried again later), never a reason to speak an older
    /// version.
    fn greet(
        opts: &ConnectOptions,
        reconnects: u64,
    ) -> Result<(UnixStream, Vec<u8>, Welcome), Error> {
        let again = reconnects > 0;
        let reconnects = u32::try_from(reconnects).unwrap_or(u32::MAX);
        let mut version = frame::VERSION;
        // A daemon that closes at hello without a word is 0.1.0's, or one that restarted just
        // then: the first such close is tried again in the same version.
        let mut silent_closes = 0;
        loop {
            let stream = UnixStream::connect(&opts.socket).map_err(|source| Error::Connect {
                path: opts.socket.clone(),
                source,
            })?;
            check_daemon_uid(&stream, opts)?;
            let mut wbuf = Vec::with_capacity(256);
            match hello(&stream, opts, &mut wbuf, version, reconnects)? {
                Greeted::Welcome(welcome) => return Ok((stream, wbuf, welcome)),
                Greeted::Closed if again => return Err(Error::Disconnected { source: None }),
                Greeted::Closed if silent_closes == 0 && version > frame::MIN_VERSION => {
                    silent_closes += 1;
                }
                Greeted::Closed if version > frame::MIN_VERSION => {
                    let why = "the daemon closed twice at hello without a word, as 0.1.0's does";
                    note_downgrade(opts, version, frame::MIN_VERSION, why);
                    version = frame::MIN_VERSION;
                }
                Greeted::Closed => return Err(Error::Disconnected { source: None }),
                // (Each try is in an older version than the last: at most a few.)
                Greeted::Older(older) if (frame::MIN_VERSION..version).contains(&older) => {
                    note_downgrade(opts, version, older, "the daemon speaks an older protocol");
                    version = older;
                }
                Greeted::Older(older) => {
                    return Err(Error::VersionMismatch {
                        daemon: older,
                        client: frame::VERSION,
                        detail: format!("it refused a hello in protocol {version}"),
                    });
                }
            }
        }
    }

    /// A link to the daemon at `opts.socket`: hello said, the store mapped. Also the send
    /// buffer and the bytes read past the hello, for the call state.
    fn establish(
        opts: &ConnectOptions,
        generation: u64,
    ) -> Result<(Link, Vec<u8>, RecvBuf), Error> {
        let (stream, wbuf, welcome) = Client::greet(opts, generation)?;
        let Welcome {
            node_id,
            epoch,
            segments: infos,
            fds,
            request_limit,
            version,
            daemon,
            rbuf,
        } = welcome;
        let access = match opts.role {
            Role::Reader => Access::ReadOnly,
            Role::Writer => Access::ReadWrite,
        };
        let mut segments = Vec::with_capacity(infos.len());
        for (i, (info, fd)) in infos.iter().zip(fds).enumerate() {
            check_segment_id(info, i)?;
            // Another connection of this process may map the same store already: shared.
            segments.push(Mapping::shared(
                fd,
                info.size_bytes,
                access,
                (node_id, epoch, i as u32),
            )?);
        }
        tracing::debug!(node_id, epoch, segments = segments.len(), role = ?opts.role, protocol = version, daemon = %daemon.describe(), generation, "connected");
        let link = Link {
            stream,
            segments,
            node_id,
            epoch,
            request_limit,
            version,
            daemon,
            broken: AtomicBool::new(false),
            gone: AtomicBool::new(false),
            generation,
            lineage: generation,
        };
        Ok((link, wbuf, rbuf))
    }

    /// Connects with explicit options.
    pub fn connect_with(opts: ConnectOptions) -> Result<Client, Error> {
        if opts.name.len() > feedstore_proto::MAX_CLIENT_NAME
            || opts.name.chars().any(char::is_control)
        {
            return Err(Error::InvalidArgument(format!(
                "client name must be at most {} bytes of printable text",
                feedstore_proto::MAX_CLIENT_NAME
            )));
        }
        let forks = fork_generation();
        let (link, wbuf, rbuf) = Client::establish(&opts, 0)?;
        let releases = Arc::new(ReleaseQueue {
            state: Mutex::new(PendingReleases::default()),
            wake: Condvar::new(),
            delay: opts.release_delay,
        });
        let client = Client {
            inner: Arc::new(Inner {
                link: RwLock::new(Arc::new(link)),
                generation: AtomicU64::new(0),
                lineage: AtomicU64::new(0),
                reconnects: AtomicU64::new(0),
                forks,
                call: Mutex::new(CallState {
                    next_id: 1,
                    wbuf,
                    rbuf,
                    outstanding: VecDeque::new(),
                    arrived: Vec::new(),
                }),
                send: Mutex::new(()),
                role: opts.role,
                populate: opts.populate,
                reply_limit: opts.max_frame_bytes,
                create_timeout: opts.create_timeout,
                releases: releases.clone(),
                writers: Mutex::new(std::collections::HashSet::new()),
                opts: opts.clone(),
            }),
        };
        if !opts.release_delay.is_zero() {
            let weak = Arc::downgrade(&client.inner);
            std::thread::Builder::new()
                .name("feedstore-release".into())
                .spawn(move || releases.run_flusher(weak))
                .map_err(|e| Error::Protocol(format!("cannot start the release flusher: {e}")))?;
        }
        Ok(client)
    }

    /// The link in use now.
    pub(crate) fn link(&self) -> Arc<Link> {
        self.inner
            .link
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The current link's generation: how many times this client reconnected.
    pub(crate) fn generation(&self) -> u64 {
        self.inner.generation.load(Ordering::Acquire)
    }

    /// How many times this client connected again after its daemon went away.
    pub fn reconnects(&self) -> u64 {
        self.inner.reconnects.load(Ordering::Relaxed)
    }

    /// Whether the link in use is broken (the daemon gone, or out of step).
    pub(crate) fn link_broken(&self) -> bool {
        self.link().broken.load(Ordering::Relaxed)
    }

    /// Whether this client reconnects when its daemon goes away.
    pub(crate) fn reconnecting(&self) -> bool {
        !self.inner.opts.reconnect_timeout.is_zero()
    }

    /// After `dead` broke: a link to the daemon on the same socket (one started again), tried
    /// with backoff for [`ConnectOptions::reconnect_timeout`]; the one in place if another
    /// thread made it already. Called with the call lock held (`state`), which it resets.
    fn relink(&self, state: &mut CallState, dead: &Arc<Link>) -> Result<Arc<Link>, Error> {
        let current = self.link();
        if current.generation != dead.generation {
            return Ok(current);
        }
        let limit = self.inner.opts.reconnect_timeout;
        if limit.is_zero() || !dead.gone.load(Ordering::Relaxed) {
            return Err(Error::Disconnected { source: None });
        }
        let started = Instant::now();
        let mut pause = RECONNECT_FIRST;
        let mut tries = 0u32;
        let last = loop {
            tries += 1;
            let left = limit.saturating_sub(started.elapsed());
            let mut opts = self.inner.opts.clone();
            opts.hello_timeout = opts.hello_timeout.min(left).max(RECONNECT_FIRST);
            let failure = match Client::establish(&opts, dead.generation + 1) {
                Ok((mut link, wbuf, rbuf)) => {
                    // The same memory and epoch: a successor that took the daemon over.
                    let taken_over = link.node_id == dead.node_id && link.epoch == dead.epoch;
                    if taken_over {
                        link.lineage = dead.lineage;
                    }
                    let link = Arc::new(link);
                    *state = CallState {
                        next_id: state.next_id,
                        wbuf,
                        rbuf,
                        outstanding: VecDeque::new(),
                        arrived: Vec::new(),
                    };
                    *self.inner.link.write().unwrap_or_else(|e| e.into_inner()) = link.clone();
                    self.inner
                        .generation
                        .store(link.generation, Ordering::Release);
                    self.inner.lineage.store(link.lineage, Ordering::Release);
                    // Releases queued for the old daemon's leases mean nothing to a daemon
                    // started afresh; a successor holds those leases and takes them back
                    // (now that the link to it is in place).
                    if taken_over {
                        self.inner.releases.unpark();
                    } else {
                        drop(self.inner.releases.take());
                    }
                    self.inner.reconnects.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(
                        socket = %opts.socket.display(),
                        epoch_before = %format!("{:08x}", dead.epoch),
                        epoch = %format!("{:08x}", link.epoch),
                        after_ms = started.elapsed().as_millis() as u64,
                        tries,
                        "feedstored went away and is back: reconnected (what only the old daemon held is gone)"
                    );
                    return Ok(link);
                }
                // A daemon this client must not talk to, or cannot: no point waiting.
                Err(
                    e @ (Error::UntrustedDaemon { .. }
                    | Error::VersionMismatch { .. }
                    | Error::InvalidArgument(_)),
                ) => return Err(e),
                Err(e) => e,
            };
            let left = limit.saturating_sub(started.elapsed());
            if left.is_zero() {
                break failure;
            }
            std::thread::sleep(jittered(pause).min(left));
            pause = (pause * 2).min(RECONNECT_MAX);
        };
        Err(Error::Disconnected {
            source: Some(std::io::Error::other(format!(
                "feedstored at {} went away and did not come back within {limit:?} ({tries} \
                 tries to reconnect; the last: {last})",
                self.inner.opts.socket.display()
            ))),
        })
    }

    /// Marks `link` broken (the daemon gone, or out of step) and, if it is still the one in
    /// use, puts its tombstone in its place: the client lets go of that store's mappings now,
    /// not when it reconnects.
    fn broke(&self, link: &Arc<Link>, why: &Error) {
        link.breaks();
        if !gone(why) {
            return;
        }
        link.gone.store(true, Ordering::Relaxed);
        let mut current = self.inner.link.write().unwrap_or_else(|e| e.into_inner());
        if Arc::ptr_eq(&current, link)
            && let Some(tombstone) = link.tombstone()
        {
            *current = Arc::new(tombstone);
        }
    }

    /// Moves to a new link if the one in use broke (see [`Client::relink`]): the link to use.
    /// What only the old daemon knew (a stream joined or attached there) is the caller's to
    /// set up again.
    pub(crate) fn reconnect(&self) -> Result<Arc<Link>, Error> {
        let mut guard = self.inner.call.lock().unwrap_or_else(|e| e.into_inner());
        let link = self.link();
        if link.broken.load(Ordering::Relaxed) {
            self.relink(&mut guard, &link)
        } else {
            Ok(link)
        }
    }

    /// What the daemon said of itself at hello: the protocol versions it speaks, its features
    /// and its release (implied by its version for daemons before protocol 11).
    pub fn daemon(&self) -> Speaks {
        self.link().daemon.clone()
    }

    /// The protocol version this connection speaks: the newest both sides do.
    pub fn protocol(&self) -> u16 {
        self.link().version
    }

    /// Whether both this client and the daemon have `feature` (a bit of
    /// [`feedstore_proto::frame::feature`]).
    pub fn has_feature(&self, feature: u64) -> bool {
        self.link().has_feature(feature)
    }

    /// The daemon's node id.
    pub fn node_id(&self) -> u32 {
        self.link().node_id
    }

    /// The daemon's start epoch; it changes when the daemon restarts (and this client
    /// reconnects).
    pub fn epoch(&self) -> u32 {
        self.link().epoch
    }

    /// Whether `handle` names an object of this node's daemon from before the one this client
    /// talks to now (one that went away: the client reconnected since, or connected after):
    /// that object went with it.
    pub fn predates(&self, handle: Handle) -> bool {
        let link = self.link();
        handle.node_id == link.node_id && handle.epoch != link.epoch
    }

    /// This connection's role.
    pub fn role(&self) -> Role {
        self.inner.role
    }

    /// Deletes an object. Its bytes stay readable through existing leases and are reused once the
    /// last one is released.
    pub fn delete(&self, handle: Handle) -> Result<(), Error> {
        self.delete_batch(&[handle])?
            .pop()
            .expect("one result per handle")
    }

    /// Deletes several objects, in as few round trips as the frame limits allow.
    pub fn delete_batch(&self, handles: &[Handle]) -> Result<Vec<Result<(), Error>>, Error> {
        self.each(Opcode::Delete, handles, |handles| Request::Delete {
            handles,
        })
    }

    /// Looks samples up in the daemon's decode-once cache: per key, the handle of the object
    /// filed under it by a client of this uid (a producer's put, [`Client::cache_insert`]) if
    /// the store still holds it. A hit is only a handle: the object can still be evicted before
    /// it is leased ([`Client::get`] then fails with `NotFound`).
    pub fn cache_lookup(&self, keys: &[u128]) -> Result<Vec<Option<Handle>>, Error> {
        self.batched(Opcode::CacheLookup, keys, |keys| {
            match self.call(&Request::CacheLookup {
                keys: keys.to_vec(),
            })? {
                Response::Cached(found) if found.len() == keys.len() => Ok(found),
                other => Err(unexpected(other)),
            }
        })
    }

    /// Files sealed objects in the daemon's decode-once cache, each under its sample key (not
    /// 0), for [`Client::cache_lookup`] by this uid's clients (writers only). An entry lasts as
    /// long as its object, which stays evictable unless pinned. Per entry the daemon's status:
    /// `Ok`; `InUse` (the key already names another live object, which stays: delete this
    /// one); `NotFound` (the handle names no sealed object); `LimitReached` (the cache's bound
    /// on entries); `InvalidArgument` (the key 0).
    pub fn cache_insert(&self, entries: &[(u128, Handle)]) -> Result<Vec<Status>, Error> {
        self.batched(Opcode::CacheInsert, entries, |chunk| {
            let entries = chunk
                .iter()
                .map(|&(key, handle)| CacheEntry { key, handle })
                .collect();
            match self.call(&Request::CacheInsert { entries })? {
                Response::Done(s) if s.len() == chunk.len() => Ok(s),
                other => Err(unexpected(other)),
            }
        })
    }

    /// A snapshot of the daemon's statistics.
    pub fn stats(&self) -> Result<StoreStats, Error> {
        match self.call(&Request::Stats)? {
            Response::Stats(s) => Ok(*s),
            other => Err(unexpected(other)),
        }
    }

    /// Every open stream on the daemon (asked for in pages that fit the frame limits; the
    /// pages after the first are asked of the daemon that answered the first, never of one
    /// started since: stream ids are numbered per daemon).
    pub fn streams(&self) -> Result<Vec<feedstore_proto::frame::StreamInfo>, Error> {
        let mut all = Vec::new();
        let mut after = 0;
        let mut generation = None;
        loop {
            let request = Request::StreamList { after };
            let response = match generation {
                None => {
                    let (response, link) = self.call_linked(&request)?;
                    generation = Some(link.generation());
                    response
                }
                Some(g) => self.call_bound(g, &request)?,
            };
            match response {
                Response::Streams { streams, more } => {
                    let last = streams.last().map(|s| s.id);
                    all.extend(streams);
                    match (more, last) {
                        (true, Some(id)) if id > after => after = id,
                        (true, _) => {
                            return Err(Error::Protocol(
                                "stream list page made no progress".into(),
                            ));
                        }
                        (false, _) => return Ok(all),
                    }
                }
                other => return Err(unexpected(other)),
            }
        }
    }

    /// Closes stream `id` (from [`Client::streams`]) for everyone: its held samples go back to
    /// the store, its producers and consumers see it end. Needs a writer of the uid that made
    /// the stream, root or the daemon's uid. Sent only to the daemon this client is connected
    /// to now (never again to one started since: ids are numbered per daemon): after
    /// [`Client::reconnects`] moved, list the streams again.
    pub fn close_stream(&self, id: u32) -> Result<(), Error> {
        match self.call_bound(self.generation(), &Request::StreamClose { stream: id })? {
            Response::Done(_) => Ok(()),
            other => Err(unexpected(other)),
        }
    }

    /// Whether `ptr` points into one of this client's segment mappings (for zero-copy checks).
    pub fn maps(&self, ptr: *const u8) -> bool {
        self.link().segments.iter().any(|m| m.contains(ptr))
    }

    /// A batch of per-handle operations (`make` builds the request for a chunk), split into
    /// as many round trips as the frame limits need.
    pub(crate) fn each(
        &self,
        op: Opcode,
        handles: &[Handle],
        make: impl Fn(Vec<Handle>) -> Request,
    ) -> Result<Vec<Result<(), Error>>, Error> {
        self.batched(op, handles, |chunk| {
            let statuses = match self.call(&make(chunk.to_vec()))? {
                Response::Done(s) if s.len() == chunk.len() => s,
                other => return Err(unexpected(other)),
            };
            Ok(statuses
                .into_iter()
                .zip(chunk)
                .map(|(s, &h)| {
                    if s == Status::Ok {
                        Ok(())
                    } else {
                        Err(Error::from_status(s, h, 0, ""))
                    }
                })
                .collect())
        })
    }

    /// The most items one batch of `op` may carry on this connection.
    pub(crate) fn batch_items(&self, op: Opcode) -> usize {
        max_batch_items(op, self.link().request_limit, self.inner.reply_limit)
    }

    /// Runs `call` on chunks of `items` small enough that each request fits the daemon's frame
    /// limit and each reply this client's, and joins the results in order.
    pub(crate) fn batched<T, R>(
        &self,
        op: Opcode,
        items: &[T],
        mut call: impl FnMut(&[T]) -> Result<Vec<R>, Error>,
    ) -> Result<Vec<R>, Error> {
        let mut out = Vec::with_capacity(items.len());
        for chunk in items.chunks(self.batch_items(op)) {
            out.extend(call(chunk)?);
        }
        Ok(out)
    }

    /// Sends a request and waits for its reply (sent again on a new link if the daemon went
    /// away and this client reconnects).
    pub(crate) fn call(&self, request: &Request) -> Result<Response, Error> {
        self.call_linked(request).map(|(response, _)| response)
    }

    /// [`Client::call`], and the link the reply came on: the one whose mappings the locations
    /// it names are in.
    pub(crate) fn call_linked(&self, request: &Request) -> Result<(Response, Arc<Link>), Error> {
        self.exchange(request, None, read_reply)
            .and_then(|(response, link)| Ok((check_error(response)?, link)))
    }

    /// A call that names something only the daemon of link `generation` knows (a stream by
    /// id): never sent on another link. If that one is gone it fails (`Disconnected`), and the
    /// caller of a reconnecting client lets go of what it holds of the old daemon, moves to a
    /// new link ([`Client::reconnect`]) and sets itself up there.
    pub(crate) fn call_bound(&self, generation: u64, request: &Request) -> Result<Response, Error> {
        self.exchange(request, Some(generation), read_reply)
            .and_then(|(response, _)| check_error(response))
    }

    /// Sends a request whose reply carries descriptors, and waits for both (and the link they
    /// came on).
    pub(crate) fn call_with_fds(
        &self,
        request: &Request,
    ) -> Result<(Response, Vec<OwnedFd>, Arc<Link>), Error> {
        let mut fds = Vec::new();
        let (response, link) = self.exchange(request, None, |stream, rb, id, link| {
            // (A reply read on a link that then broke leaves its descriptors here: dropped.)
            fds.clear();
            read_frame(rb, id, link, |buf| {
                let (n, received) = recv_with_fds(stream, buf)?;
                fds.extend(received);
                Ok(n)
            })
        })?;
        Ok((check_error(response)?, fds, link))
    }

    /// Refuses a connection that is this process's parent's (after a fork).
    fn usable(&self) -> Result<(), Error> {
        if self.inner.forked() {
            return Err(Error::Forked);
        }
        Ok(())
    }

    /// The link to send on: the current one, or a new one if it broke and this client
    /// reconnects (else `Disconnected`); refused if the call is `bound` to another.
    fn sendable(&self, state: &mut CallState, bound: Option<u64>) -> Result<Arc<Link>, Error> {
        let mut link = self.link();
        // A call bound to a link that is gone fails at once: its owner sets itself up again
        // (and a `Drop` that detaches never waits for a daemon to come back).
        if bound.is_some_and(|g| g != link.generation || link.broken.load(Ordering::Relaxed)) {
            return Err(Error::Disconnected {
                source: Some(std::io::Error::other(
                    "feedstored went away since this stream was set up",
                )),
            });
        }
        if link.broken.load(Ordering::Relaxed) {
            link = self.relink(state, &link)?;
        }
        Ok(link)
    }

    /// Encodes `request` under the next request id into the call buffer, the queued releases
    /// in front of it, and returns the id and those releases.
    fn encode_call(
        link: &Link,
        releases: &ReleaseQueue,
        state: &mut CallState,
        request: &Request,
    ) -> Result<(u32, Vec<Handle>), Error> {
        let id = state.next_id;
        state.next_id = state.next_id.wrapping_add(1);
        state.wbuf.clear();
        // Encode the request first: a request over the daemon's limit fails here, before the
        // queued releases leave the queue, and the connection stays usable.
        request.encode_in(link.version, id, link.request_limit, &mut state.wbuf)?;
        let queued = releases.take();
        if !queued.is_empty() {
            let mut released = Vec::new();
            encode_releases(&queued, link.request_limit, link.version, &mut released)?;
            state.wbuf.splice(0..0, released);
        }
        Ok((id, queued))
    }

    /// One request/reply exchange, queued releases riding along; `read` reads the reply. A
    /// reconnecting client whose daemon went away sends it again on a new link (at most
    /// [`MAX_RESENDS`] times), unless it is `bound` to the link of that generation: then it
    /// fails.
    fn exchange(
        &self,
        request: &Request,
        bound: Option<u64>,
        mut read: impl FnMut(&UnixStream, &mut RecvBuf, u32, (u32, u16)) -> Result<Response, Error>,
    ) -> Result<(Response, Arc<Link>), Error> {
        let inner = &*self.inner;
        self.usable()?;
        let mut guard = inner.call.lock().unwrap_or_else(|e| e.into_inner());
        let state = &mut *guard;
        let mut resends = 0;
        loop {
            let link = self.sendable(state, bound)?;
            // Replies to submitted requests come first on the socket: read them aside.
            let result = self.read_outstanding(state, None, &link).and_then(|_| {
                let (id, released) = Self::encode_call(&link, &inner.releases, state, request)?;
                self.send_releasing(&link, &state.wbuf, released)?;
                read(
                    &link.stream,
                    &mut state.rbuf,
                    id,
                    (inner.reply_limit, link.version),
                )
            });
            // A daemon that says it is shutting down has gone as far as this client goes.
            let result = match result {
                Ok(Response::Error {
                    status: Status::ShuttingDown,
                    ..
                }) if self.reconnecting() => Err(Error::ShuttingDown),
                other => other,
            };
            match result {
                Ok(response) => return Ok((response, link)),
                // After a socket, framing or decoding error the byte stream is no longer in
                // step with the daemon; fail every later call instead of misreading the next
                // reply.
                Err(
                    e @ (Error::Disconnected { .. }
                    | Error::Protocol(_)
                    | Error::Decode(_)
                    | Error::ShuttingDown),
                ) => {
                    if !matches!(e, Error::ShuttingDown) || self.reconnecting() {
                        self.broke(&link, &e);
                    }
                    if !(gone(&e) && self.reconnecting()) {
                        return Err(e);
                    }
                    // A bound call's owner sets itself up again on the next link itself
                    // (`Client::reconnect`), having let go of what it held of this one.
                    if bound.is_some() || resends == MAX_RESENDS {
                        return Err(e);
                    }
                    resends += 1;
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Sends a request without waiting for its reply (queued releases riding along); the reply
    /// is read by [`Client::collect`], or read aside by the next call that needs the socket.
    /// Up to [`MAX_OUTSTANDING`] may be unread; past that, the oldest is read aside. `bound`:
    /// as for [`Client::call_bound`].
    pub(crate) fn submit(&self, request: &Request, bound: Option<u64>) -> Result<Ticket, Error> {
        let inner = &*self.inner;
        self.usable()?;
        let mut guard = inner.call.lock().unwrap_or_else(|e| e.into_inner());
        let state = &mut *guard;
        let link = self.sendable(state, bound)?;
        // At the limit the oldest reply is read aside (replies come in order, so this always
        // moves); the replies read aside and not collected yet have a bound of their own.
        while let Some(&oldest) = state.outstanding.front()
            && state.outstanding.len() >= MAX_OUTSTANDING
        {
            match self.read_outstanding(state, Some(oldest), &link) {
                Ok(reply) => state.arrived.extend(reply.map(|r| (oldest, r))),
                Err(e) => {
                    self.broke(&link, &e);
                    return Err(e);
                }
            }
        }
        if state.arrived.len() >= MAX_ARRIVED {
            return Err(Error::LimitReached(format!(
                "{MAX_ARRIVED} replies on this connection read and not collected (pipelines \
                 sharing one client that do not wait for their requests)"
            )));
        }
        let (id, released) = Self::encode_call(&link, &inner.releases, state, request)?;
        if let Err(e) = self.send_releasing(&link, &state.wbuf, released) {
            self.broke(&link, &e);
            return Err(e);
        }
        state.outstanding.push_back(id);
        Ok(Ticket(id, link.generation))
    }

    /// The reply to a submitted request: read aside already, or read now (with the replies
    /// before it, read aside); and the link it came on. `Disconnected` if that link is gone.
    pub(crate) fn collect_linked(&self, ticket: Ticket) -> Result<(Response, Arc<Link>), Error> {
        let inner = &*self.inner;
        let mut guard = inner.call.lock().unwrap_or_else(|e| e.into_inner());
        let state = &mut *guard;
        let link = self.link();
        if link.generation != ticket.1 {
            return Err(Error::Disconnected {
                source: Some(std::io::Error::other(
                    "feedstored went away before it answered (the client reconnected since)",
                )),
            });
        }
        if let Some(i) = state.arrived.iter().position(|(id, _)| *id == ticket.0) {
            return Ok((check_error(state.arrived.swap_remove(i).1)?, link));
        }
        self.usable()?;
        if link.broken.load(Ordering::Relaxed) {
            return Err(Error::Disconnected { source: None });
        }
        match self.read_outstanding(state, Some(ticket.0), &link) {
            Ok(Some(response)) => Ok((check_error(response)?, link)),
            Ok(None) => Err(Error::Protocol(format!(
                "no request {} outstanding",
                ticket.0
            ))),
            Err(e) => {
                self.broke(&link, &e);
                Err(e)
            }
        }
    }

    /// [`Client::collect_linked`] without the link.
    pub(crate) fn collect(&self, ticket: Ticket) -> Result<Response, Error> {
        self.collect_linked(ticket).map(|(response, _)| response)
    }

    /// Reads the outstanding replies in order, setting each aside, until `until`'s, which is
    /// returned (or all of them, for `None`).
    fn read_outstanding(
        &self,
        state: &mut CallState,
        until: Option<u32>,
        link: &Link,
    ) -> Result<Option<Response>, Error> {
        while let Some(id) = state.outstanding.pop_front() {
            let limits = (self.inner.reply_limit, link.version);
            let response = read_reply(&link.stream, &mut state.rbuf, id, limits)?;
            if until == Some(id) {
                return Ok(Some(response));
            }
            state.arrived.push((id, response));
        }
        Ok(None)
    }

    /// Sends a request that has no reply, with the queued lease releases riding along, on the
    /// link of `generation` only (a one-way message names a stream: it means nothing to
    /// another daemon).
    pub(crate) fn send_one_way(&self, request: &Request, generation: u64) -> Result<(), Error> {
        debug_assert!(!request.expects_reply());
        self.usable()?;
        let link = self.link();
        if link.broken.load(Ordering::Relaxed) || link.generation != generation {
            return Err(Error::Disconnected { source: None });
        }
        let mut buf = Vec::with_capacity(64);
        let (limit, version) = (link.request_limit, link.version);
        request.encode_in(version, 0, limit, &mut buf)?;
        let queued = self.inner.releases.take();
        if !queued.is_empty() {
            encode_releases(&queued, limit, version, &mut buf)?;
        }
        self.send_releasing(&link, &buf, queued)
            .inspect_err(|e| self.broke(&link, e))
    }

    /// Returns a lease taken on a link of `lineage`: queued to ride with the next request, or
    /// sent at once when the queue is long or the connection has no release delay. A lease
    /// from a daemon this client has left since went with it, unless the daemon it is linked
    /// to now took that one over: nothing to send.
    pub(crate) fn release(&self, handle: Handle, lineage: u64) {
        if self.inner.forked() || lineage != self.inner.lineage.load(Ordering::Acquire) {
            return; // the parent's lease, not this child's to return; or the old daemon's
        }
        let queue = &self.inner.releases;
        if queue.delay.is_zero() {
            return self.send_release(&[handle]);
        }
        let mut state = queue.lock();
        state.handles.push(handle);
        if state.parked {
            // (Waiting for the daemon's successor: sending now would only find it gone.)
            return;
        }
        if state.handles.len() >= MAX_QUEUED_RELEASES {
            let due = std::mem::take(&mut state.handles);
            drop(state);
            self.send_release(&due);
        } else if !state.armed && state.handles.len() == 1 {
            drop(state);
            queue.wake.notify_one();
        }
    }

    /// Sends every queued release now.
    pub fn flush_releases(&self) {
        let due = self.inner.releases.take();
        if !due.is_empty() {
            self.send_release(&due);
        }
    }

    /// Sends a one-way release of the given leases.
    fn send_release(&self, handles: &[Handle]) {
        let link = self.link();
        if self.inner.forked() {
            return;
        }
        if link.broken.load(Ordering::Relaxed) {
            // For the link that replaces it, if that is a successor's.
            self.keep_releases(&link, handles.to_vec());
            return;
        }
        let mut buf = Vec::with_capacity(frame::HEADER_BYTES + 4 + 16 * handles.len());
        let sent = encode_releases(handles, link.request_limit, link.version, &mut buf)
            .map_err(Error::from)
            .and_then(|()| self.send_releasing(&link, &buf, handles.to_vec()));
        if let Err(e) = sent {
            self.broke(&link, &e);
        }
    }

    /// [`Client::send_on`] for bytes carrying the releases `released`: when none of the bytes
    /// left (the daemon had gone before), a reconnecting client queues the releases again, for
    /// a successor that took the daemon over and holds those leases (see
    /// [`ReleaseQueue::put_back`]). Bytes that partly left may have been read, so their
    /// releases are never sent twice.
    fn send_releasing(
        &self,
        link: &Link,
        bytes: &[u8],
        released: Vec<Handle>,
    ) -> Result<(), Error> {
        let _guard = self.inner.send.lock().unwrap_or_else(|e| e.into_inner());
        send_all_or_none(&link.stream, bytes).map_err(|(e, none_left)| {
            if none_left && !released.is_empty() {
                self.keep_releases(link, released);
            }
            e
        })
    }

    /// Releases meant for `link` that never left: kept for the daemon that took it over. If
    /// the client already moved to another link (another thread reconnected meanwhile), they
    /// go there when it is that successor's (the same lineage), and nowhere otherwise.
    fn keep_releases(&self, link: &Link, handles: Vec<Handle>) {
        if !self.reconnecting() {
            return;
        }
        if self.inner.generation.load(Ordering::Acquire) == link.generation {
            self.inner.releases.put_back(handles);
        } else if self.inner.lineage.load(Ordering::Acquire) == link.lineage {
            self.inner.releases.requeue(handles);
        }
    }
}
