//! Handing a running daemon over to its successor (`feedstored --takeover`), both sides.
//!
//! The successor connects to the daemon's own socket and asks for the state
//! ([`Request::Takeover`], from the daemon's uid or root). The daemon freezes (no request
//! starts, those under way finish or park, no connection is accepted: [`Handoff::freeze`],
//! [`Handoff::enter`]), writes its object table ([`Handover`]) with the descriptors of its
//! segments and listeners beside it (`SCM_RIGHTS`), and waits. The successor maps the same
//! memory and takes the same epoch (so every handle stays valid), then commits in two steps
//! ([`commit`]): it says [`READY`], the daemon answers [`STOPPING`] and stops (its runtime
//! dropped, its connections closed, the socket file left), and only once that connection has
//! closed does the successor accept on the same listening socket. Clients connect again — to
//! the successor, which holds each client process's leases and reservations for it until it
//! comes back ([`feedstore_core::objects::Objects::take_over`]). If the successor fails before
//! its `READY`, the daemon thaws and serves on as if nothing happened.
//!
//! From Envoy's hot restart and HAProxy's seamless reload: the listening socket itself passes
//! between the processes, so no connection is refused meanwhile (clients that connect while
//! the daemon is frozen wait in the listen backlog for the successor's first accept).

use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use feedstore_proto::frame::{self, Frame, Request, Response};
use feedstore_proto::handover::{HANDOVER_FORMAT, Handover};
use tokio::sync::watch;

/// What precedes a hand-over's length on the socket: never the start of a frame (an error
/// frame's magic is `0xFD5E`).
pub(crate) const HANDOVER_MAGIC: &[u8; 8] = b"FSHANDOV";

/// The largest hand-over a successor reads (some 70 bytes an object: millions of objects).
const MAX_HANDOVER_BYTES: u64 = 1 << 30;

/// How long a daemon that handed over waits for its successor to be ready before it serves on.
pub(crate) const SUCCESSOR_DEADLINE: Duration = Duration::from_secs(60);

/// How long a successor waits for the daemon it takes over to answer that it stops (then it
/// does not serve); once it has, the successor waits for it to stop however long it takes,
/// saying so this often.
const PREDECESSOR_DEADLINE: Duration = Duration::from_secs(30);

/// How long a daemon asked to hand over waits for the requests under way to finish or wait.
pub(crate) const QUIESCE_DEADLINE: Duration = Duration::from_secs(5);

/// The successor's word: its state is built, it serves once the daemon has stopped.
pub(crate) const READY: u8 = 1;
/// The daemon's answer: it stops now (the successor serves once the connection closes).
pub(crate) const STOPPING: u8 = 2;

/// The most descriptors a hand-over's first message carries: the segments and three listeners.
const MAX_HANDED_FDS: usize = 256;

/// The byte each message of client processes' pidfds carries (after the hand-over's bytes).
pub(crate) const PIDFDS: u8 = b'P';
/// Pidfds per message (the kernel passes at most 253 at once).
pub(crate) const PIDFDS_PER_MESSAGE: usize = 200;

/// The listeners a daemon serves on, as their descriptors (valid while it serves).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Listeners {
    pub(crate) clients: RawFd,
    pub(crate) peers: Option<RawFd>,
    pub(crate) metrics: Option<RawFd>,
}

/// A daemon's side of a hand-over: whether it is frozen, whether it is done.
pub struct Handoff {
    frozen: AtomicBool,
    /// Requests being handled and not parked (each connection's, the hand-over's own too).
    busy: AtomicUsize,
    /// Follows `frozen`, for the tasks that wait for it to clear.
    thawed: watch::Sender<bool>,
    /// Held while `frozen` and `thawed` change together (a freeze racing a thaw).
    switch: Mutex<()>,
    /// Set once the successor is ready: the daemon stops, leaving the socket file to it.
    done: watch::Sender<bool>,
    listeners: Mutex<Option<Listeners>>,
    /// The successor's connection, once the daemon said it stops: closed only after the
    /// daemon's runtime is gone (no worker thread left that could touch the memory), which is
    /// the successor's sign to serve ([`Handoff::release_successor`]).
    successor: Mutex<Option<OwnedFd>>,
}

impl Default for Handoff {
    fn default() -> Self {
        Handoff {
            frozen: AtomicBool::new(false),
            busy: AtomicUsize::new(0),
            thawed: watch::Sender::new(true),
            switch: Mutex::new(()),
            done: watch::Sender::new(false),
            listeners: Mutex::new(None),
            successor: Mutex::new(None),
        }
    }
}

impl Handoff {
    /// Notes the listeners, once the daemon serves on them.
    pub(crate) fn serving_on(&self, listeners: Listeners) {
        *self.listeners.lock().unwrap_or_else(|e| e.into_inner()) = Some(listeners);
    }

    pub(crate) fn listeners(&self) -> Option<Listeners> {
        *self.listeners.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Stops serving for a hand-over: false if one is under way already.
    pub(crate) fn freeze(&self) -> bool {
        let _switch = self.switch.lock().unwrap_or_else(|e| e.into_inner());
        if self.frozen.swap(true, Ordering::SeqCst) {
            return false;
        }
        self.thawed.send_replace(false);
        true
    }

    /// Serves on (the successor failed).
    pub(crate) fn thaw(&self) {
        let _switch = self.switch.lock().unwrap_or_else(|e| e.into_inner());
        self.frozen.store(false, Ordering::SeqCst);
        self.thawed.send_replace(true);
    }

    /// Whether a hand-over is under way.
    pub(crate) fn is_frozen(&self) -> bool {
        self.frozen.load(Ordering::SeqCst)
    }

    /// Counts a request as being handled (until the guard drops), first waiting while a
    /// hand-over is under way: nothing is handled meanwhile.
    pub(crate) async fn enter(&self) -> Busy<'_> {
        // (Counted before the look at `frozen`, which a hand-over sets before it counts: one of
        // the two sees the other.)
        self.busy.fetch_add(1, Ordering::SeqCst);
        self.park().await;
        Busy(&self.busy)
    }

    /// While a hand-over is under way, waits uncounted (the hand-over's snapshot does not wait
    /// for a request parked here, which changes nothing until it is over).
    pub(crate) async fn park(&self) {
        // (Looked at again after each wake-up: another hand-over may have begun since.)
        while self.is_frozen() {
            self.busy.fetch_sub(1, Ordering::SeqCst);
            let mut thawed = self.thawed.subscribe();
            let _ = thawed.wait_for(|t| *t).await;
            self.busy.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// Leaves the count while a reply is written (a request's changes are all made by then,
    /// so the snapshot need not wait for a client slow to read): counted again on drop.
    pub(crate) fn writing(&self) -> Writing<'_> {
        self.busy.fetch_sub(1, Ordering::SeqCst);
        Writing(&self.busy)
    }

    /// Requests being handled and not parked.
    pub(crate) fn busy(&self) -> usize {
        self.busy.load(Ordering::SeqCst)
    }

    /// Keeps the successor's connection open (its close says this daemon stopped) and marks
    /// the hand-over done: the daemon stops.
    pub(crate) fn stop_for(&self, successor: OwnedFd) {
        *self.successor.lock().unwrap_or_else(|e| e.into_inner()) = Some(successor);
        self.done.send_replace(true);
    }

    /// Closes the successor's connection, letting it serve: called once the daemon's runtime
    /// is dropped (every task gone, every worker thread joined).
    pub(crate) fn release_successor(&self) {
        drop(
            self.successor
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take(),
        );
    }

    /// Whether the daemon handed over to a successor that serves.
    pub(crate) fn is_done(&self) -> bool {
        *self.done.borrow()
    }

    /// A receiver that sees every freeze and thaw.
    pub(crate) fn thawed_watch(&self) -> watch::Receiver<bool> {
        self.thawed.subscribe()
    }

    /// A receiver that sees the hand-over end (the successor serves).
    pub(crate) fn done_watch(&self) -> watch::Receiver<bool> {
        self.done.subscribe()
    }
}

/// A reply being written, uncounted ([`Handoff::writing`]).
pub(crate) struct Writing<'a>(&'a AtomicUsize);

impl Drop for Writing<'_> {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

/// A request being handled ([`Handoff::enter`]).
pub(crate) struct Busy<'a>(&'a AtomicUsize);

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// What a successor received from the daemon it takes over.
pub(crate) struct Received {
    pub(crate) handover: Handover,
    pub(crate) segments: Vec<OwnedFd>,
    pub(crate) clients: std::os::unix::net::UnixListener,
    pub(crate) peers: Option<std::net::TcpListener>,
    pub(crate) metrics: Option<std::net::TcpListener>,
    /// The pidfds of the client processes the hand-over names as having one, in its order.
    pub(crate) pidfds: Vec<OwnedFd>,
    /// The connection to the daemon, for the two-step commit ([`commit`]).
    pub(crate) daemon: UnixStream,
}

/// Asks the daemon on `socket` for its state. Refused before anything is touched when no
/// daemon answers, when it runs as another uid, or when its format is not this build's: why,
/// as a sentence.
pub(crate) fn receive(socket: &Path) -> Result<Received, String> {
    let failed = |why: String| why;
    let mut daemon = UnixStream::connect(socket).map_err(|e| {
        if e.kind() == std::io::ErrorKind::PermissionDenied {
            let owner = std::fs::metadata(socket).map_or_else(
                |_| "unknown".to_owned(),
                |m| format!("uid {}", std::os::unix::fs::MetadataExt::uid(&m)),
            );
            return failed(format!(
                "cannot reach the feedstored on {} (permission denied): it runs as another uid \
                 (the socket's owner: {owner}); take over as that uid or root",
                socket.display()
            ));
        }
        failed(format!(
            "no feedstored answers on {} ({e}): there is nothing to take over; start without \
             --takeover (or with --takeover=auto, which starts afresh when none answers)",
            socket.display()
        ))
    })?;
    // (The uid of whoever bound the socket: the first daemon of a chain of takeovers, of the
    // same uid. Its pid too, so the daemon's own pid comes in the hand-over.)
    let creds = nix::sys::socket::getsockopt(&daemon, nix::sys::socket::sockopt::PeerCredentials)
        .map_err(|e| failed(format!("cannot read the daemon's credentials: {e}")))?;
    let me = nix::unistd::geteuid().as_raw();
    if creds.uid() != me && creds.uid() != 0 && me != 0 {
        return Err(failed(format!(
            "the feedstored on {} runs as uid {}, this one as uid {me}: take over as its uid",
            socket.display(),
            creds.uid()
        )));
    }
    daemon
        .set_read_timeout(Some(SUCCESSOR_DEADLINE))
        .map_err(|e| failed(e.to_string()))?;
    let mut request = Vec::new();
    Request::Takeover {
        format: HANDOVER_FORMAT,
    }
    .encode_in(frame::VERSION, 1, frame::MIN_PAYLOAD_BYTES, &mut request)
    .map_err(|e| failed(e.to_string()))?;
    daemon
        .write_all(&request)
        .map_err(|e| failed(format!("cannot ask the daemon to hand over: {e}")))?;
    let (first, fds) = recv_with_fds(&daemon, 64 << 10).map_err(|e| {
        failed(format!(
            "the daemon closed without handing over ({e}): another takeover was under way \
             (retry once it is over), the daemon was stopping, or it is a release without \
             takeover (0.1.x: restart it instead)"
        ))
    })?;
    let mut head = first;
    if !head.starts_with(HANDOVER_MAGIC) {
        return Err(failed(refusal(&daemon, head)));
    }
    while head.len() < 16 {
        let mut more = [0u8; 16];
        let n = (&daemon)
            .read(&mut more[..16 - head.len()])
            .map_err(|e| failed(format!("reading the hand-over: {e}")))?;
        if n == 0 {
            return Err(failed("the daemon closed mid-hand-over".into()));
        }
        head.extend_from_slice(&more[..n]);
    }
    let len = u64::from_le_bytes(head[8..16].try_into().expect("8 bytes"));
    if len > MAX_HANDOVER_BYTES {
        return Err(failed(format!("a hand-over of {len} bytes is refused")));
    }
    let mut bytes = head.split_off(16);
    if bytes.len() as u64 > len {
        return Err(failed("the daemon sent more than its hand-over".into()));
    }
    let missing = len as usize - bytes.len();
    let start = bytes.len();
    bytes.resize(len as usize, 0);
    (&daemon)
        .read_exact(&mut bytes[start..start + missing])
        .map_err(|e| failed(format!("reading the hand-over: {e}")))?;
    let handover = Handover::decode(&bytes).map_err(|e| failed(e.to_string()))?;
    let wanted = handover.segments.len()
        + 1
        + usize::from(handover.peer_listener)
        + usize::from(handover.metrics_listener);
    if fds.len() != wanted {
        return Err(failed(format!(
            "the daemon passed {} descriptors, its hand-over names {wanted}",
            fds.len()
        )));
    }
    let mut fds = fds.into_iter();
    let segments: Vec<OwnedFd> = fds.by_ref().take(handover.segments.len()).collect();
    let clients = std::os::unix::net::UnixListener::from(fds.next().expect("counted"));
    let peers = handover
        .peer_listener
        .then(|| std::net::TcpListener::from(fds.next().expect("counted")));
    let metrics = handover
        .metrics_listener
        .then(|| std::net::TcpListener::from(fds.next().expect("counted")));
    let wanted = handover.processes.iter().filter(|p| p.pidfd).count();
    let mut pidfds = Vec::with_capacity(wanted);
    while pidfds.len() < wanted {
        let (byte, fds) = recv_with_fds(&daemon, 1)
            .map_err(|e| failed(format!("reading the client processes' pidfds: {e}")))?;
        if byte != [PIDFDS] || fds.is_empty() || pidfds.len() + fds.len() > wanted {
            return Err(failed(format!(
                "the daemon passed other pidfds than its hand-over names ({wanted})"
            )));
        }
        pidfds.extend(fds);
    }
    Ok(Received {
        handover,
        segments,
        clients,
        peers,
        metrics,
        pidfds,
        daemon,
    })
}

/// The successor's side of the commit, before it serves anything: says it is ready, then waits
/// for the daemon's word that it stops and for its connection to close (its runtime gone: it
/// touches nothing any more). Anything else, and the successor must not serve: the daemon
/// serves on, or is in an unknown state.
pub(crate) fn commit(mut daemon: UnixStream, pid: u32) -> Result<(), String> {
    daemon
        .set_read_timeout(Some(PREDECESSOR_DEADLINE))
        .map_err(|e| e.to_string())?;
    daemon
        .write_all(&[READY])
        .map_err(|e| format!("the daemon taken over went away before it stopped: {e}"))?;
    let mut word = [0u8; 1];
    match (&daemon).read(&mut word) {
        Ok(1) if word[0] == STOPPING => {}
        Ok(1) => return Err("the daemon taken over refused to stop: it serves on".into()),
        Ok(_) => {
            return Err(format!(
                "the daemon taken over (pid {pid}) closed before it said it stops: not serving \
                 (if it died, no daemon serves: start feedstored again)"
            ));
        }
        Err(e) => return Err(format!("no word from the daemon taken over: {e}")),
    }
    // It stops, committed: wait for it however long it takes (it touches the memory until its
    // runtime is gone), never serve beside it.
    loop {
        match (&daemon).read(&mut word) {
            Ok(0) => return Ok(()),
            Ok(_) => return Err("the daemon taken over said more than it should".into()),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock
                        | std::io::ErrorKind::TimedOut
                        | std::io::ErrorKind::Interrupted
                ) =>
            {
                tracing::warn!(
                    predecessor_pid = pid,
                    "the daemon taken over said it stops and has not yet: waiting for it"
                );
            }
            Err(e) => return Err(format!("waiting for the daemon taken over to stop: {e}")),
        }
    }
}

/// What the daemon said instead of handing over (an error frame), as a sentence.
fn refusal(daemon: &UnixStream, mut bytes: Vec<u8>) -> String {
    loop {
        match Frame::parse(&bytes, frame::MAX_PAYLOAD_BYTES) {
            Ok(Some(frame)) => {
                return match Response::decode(&frame) {
                    Ok(Response::Error { status, message }) => {
                        format!("the running daemon refuses: {message} ({status:?})")
                    }
                    _ => "the running daemon answered something else than a hand-over".into(),
                };
            }
            Ok(None) => {
                let mut more = [0u8; 4096];
                match (&mut &*daemon).read(&mut more) {
                    Ok(n) if n > 0 => bytes.extend_from_slice(&more[..n]),
                    _ => return "the daemon closed mid-answer".into(),
                }
            }
            Err(e) => {
                return format!("the running daemon does not hand over (an older release?): {e}");
            }
        }
    }
}

/// One read of at most `max` bytes with the descriptors that come with them.
fn recv_with_fds(sock: &UnixStream, max: usize) -> std::io::Result<(Vec<u8>, Vec<OwnedFd>)> {
    use nix::sys::socket::{ControlMessageOwned, MsgFlags, recvmsg};
    let mut buf = vec![0u8; max];
    let mut space = nix::cmsg_space!([RawFd; MAX_HANDED_FDS]);
    let mut iov = [std::io::IoSliceMut::new(&mut buf)];
    let msg = recvmsg::<()>(
        sock.as_raw_fd(),
        &mut iov,
        Some(&mut space),
        MsgFlags::MSG_CMSG_CLOEXEC,
    )?;
    let mut fds = Vec::new();
    for cmsg in msg.cmsgs()? {
        if let ControlMessageOwned::ScmRights(raw) = cmsg {
            // SAFETY: the kernel just installed these descriptors in this process for this
            // message; nothing else owns them.
            fds.extend(
                raw.into_iter()
                    .map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }),
            );
        }
    }
    let truncated = msg.flags.contains(MsgFlags::MSG_CTRUNC);
    let n = msg.bytes;
    if truncated {
        return Err(std::io::Error::other("descriptors were cut off"));
    }
    if n == 0 {
        return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof));
    }
    buf.truncate(n);
    Ok((buf, fds))
}
