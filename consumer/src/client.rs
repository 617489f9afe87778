//! The connection to the node's daemon.

use std::io::{IoSliceMut, Read};
use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::os::unix::io::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::Duration;

use feedstore_proto::frame::{self, CREATE_PIN, Frame, HEADER_BYTES, Request, Response};
use feedstore_proto::{Handle, Location, Role, SegmentInfo, Status, StoreStats};
use feedstore_shm::{Access, Mapping};
use nix::sys::socket::{ControlMessageOwned, MsgFlags};

use crate::Error;
use crate::lease::Lease;
use crate::writer::ObjectWriter;

/// How to connect.
#[derive(Debug, Clone)]
pub struct ConnectOptions {
    /// The daemon's socket [default: `$FEEDSTORE_SOCKET` or `/tmp/feedstore-<uid>.sock`].
    pub socket: PathBuf,
    /// Reader (maps read-only) or writer.
    pub role: Role,
    /// A label for the daemon's logs and stats.
    pub name: String,
    /// Build page tables for the whole segment at connect time (`MAP_POPULATE`), so no get or
    /// put ever pays a page fault. Costs a few ms per GiB once.
    pub populate: bool,
    /// How long a create waits for space before failing with [`Error::Full`].
    pub create_timeout: Duration,
    /// How long a dropped lease's release may wait to ride along with the next request instead
    /// of costing the daemon a wake-up of its own. Zero sends each release at once.
    pub release_delay: Duration,
}

impl ConnectOptions {
    /// Defaults for a role.
    pub fn new(role: Role) -> ConnectOptions {
        ConnectOptions {
            socket: feedstore_proto::default_socket_path(),
            role,
            name: default_name(),
            populate: true,
            create_timeout: Duration::from_secs(10),
            release_delay: Duration::from_millis(1),
        }
    }

    /// Sets the socket path.
    pub fn socket(mut self, socket: impl Into<PathBuf>) -> Self {
        self.socket = socket.into();
        self
    }

    /// Sets the client's label.
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// Sets whether to pre-build page tables.
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

    /// Connects.
    pub fn connect(self) -> Result<Client, Error> {
        Client::connect_with(self)
    }
}

fn default_name() -> String {
    let exe = std::env::current_exe().ok();
    let exe = exe
        .as_deref()
        .and_then(|p| p.file_name())
        .map(|n| n.to_string_lossy().into_owned());
    format!(
        "{}[{}]",
        exe.unwrap_or_else(|| "client".into()),
        std::process::id()
    )
}

/// Options for one create.
#[derive(Debug, Clone, Copy, Default)]
pub struct CreateOptions {
    /// Wait at most this long for space [default: the connection's `create_timeout`].
    pub timeout: Option<Duration>,
    /// Never evict this object (it can still be deleted).
    pub pin: bool,
}

pub(crate) struct Inner {
    stream: UnixStream,
    /// Serialises request/reply pairs, and owns the receive buffer.
    call: Mutex<CallState>,
    /// Serialises writes to the socket: calls and one-way releases.
    send: Mutex<()>,
    segments: Vec<Arc<Mapping>>,
    node_id: u32,
    epoch: u32,
    role: Role,
    create_timeout: Duration,
    broken: AtomicBool,
    releases: Arc<ReleaseQueue>,
}

/// Releases of dropped leases not yet sent.
///
/// A release is one-way, so sending it alone costs the daemon a wake-up of its own, which lands
/// just as the next get arrives (measured here: +3.5 us on that get). Instead releases queue here
/// and ride in the same `send` as the next request; a flusher thread sends whatever is still
/// queued `release_delay` later, so an idle client's releases still arrive promptly.
struct ReleaseQueue {
    state: Mutex<PendingReleases>,
    wake: Condvar,
    delay: Duration,
}

#[derive(Default)]
struct PendingReleases {
    handles: Vec<Handle>,
    /// The flusher is in its timed wait and will look at the queue without being woken.
    armed: bool,
    closed: bool,
}

/// Flush at once past this many queued releases.
const MAX_QUEUED_RELEASES: usize = 256;

impl ReleaseQueue {
    fn lock(&self) -> std::sync::MutexGuard<'_, PendingReleases> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn take(&self) -> Vec<Handle> {
        std::mem::take(&mut self.lock().handles)
    }

    /// The flusher thread's body.
    fn run_flusher(self: Arc<Self>, client: Weak<Inner>) {
        let mut state = self.lock();
        loop {
            state.armed = false;
            while state.handles.is_empty() && !state.closed {
                state = self.wake.wait(state).unwrap_or_else(|e| e.into_inner());
            }
            if state.closed {
                return;
            }
            // Sleep out the whole window even if a request takes the queue meanwhile: waking
            // and re-arming on every release would cost a context switch per lease.
            state.armed = true;
            let deadline = std::time::Instant::now() + self.delay;
            loop {
                let now = std::time::Instant::now();
                if now >= deadline || state.closed {
                    break;
                }
                state = self
                    .wake
                    .wait_timeout(state, deadline - now)
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
            }
            let due = std::mem::take(&mut state.handles);
            drop(state);
            if !due.is_empty() {
                match client.upgrade() {
                    Some(inner) => Client { inner }.send_release(&due),
                    None => return,
                }
            }
            state = self.lock();
        }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        let mut state = self.releases.lock();
        state.closed = true;
        let due = std::mem::take(&mut state.handles);
        drop(state);
        self.releases.wake.notify_all();
        if !due.is_empty() && !self.broken.load(Ordering::Relaxed) {
            let mut buf = Vec::new();
            Request::Release { handles: due }.encode(0, &mut buf);
            let _ = send_all(&self.stream, &buf);
        }
    }
}

struct CallState {
    next_id: u32,
    wbuf: Vec<u8>,
    rbuf: RecvBuf,
}

/// A connection to the node's `feedstored`.
///
/// Cheap to clone (an `Arc`) and safe to share between threads. Calls from several threads are
/// serialised on the one socket, so a create waiting for space delays the other threads' calls
/// on the same client (lease releases still go through); give a thread that must not wait its
/// own client. Leases and writers keep the connection alive.
///
/// When the daemon goes away every call fails with [`Error::Disconnected`]; make a new client.
/// Existing leases keep their mappings valid (the memory stays until the last mapping goes).
#[derive(Clone)]
pub struct Client {
    pub(crate) inner: Arc<Inner>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("node_id", &self.inner.node_id)
            .field("epoch", &self.inner.epoch)
            .field("role", &self.inner.role)
            .field("segments", &self.inner.segments.len())
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

    /// Connects with explicit options.
    pub fn connect_with(opts: ConnectOptions) -> Result<Client, Error> {
        let stream = UnixStream::connect(&opts.socket).map_err(|source| Error::Connect {
            path: opts.socket.clone(),
            source,
        })?;
        let mut wbuf = Vec::with_capacity(256);
        Request::Hello {
            role: opts.role,
            client_name: opts.name.clone(),
        }
        .encode(0, &mut wbuf);
        send_all(&stream, &wbuf)?;
        let mut rbuf = Vec::with_capacity(4096);
        let (frame_len, fds) = recv_hello(&stream, &mut rbuf)?;
        let frame = Frame::parse(&rbuf[..frame_len], frame::MAX_PAYLOAD_BYTES)?
            .ok_or_else(|| Error::Protocol("short hello reply".into()))?;
        let (node_id, epoch, infos) = match Response::decode(&frame)? {
            Response::Hello {
                node_id,
                epoch,
                segments,
            } => (node_id, epoch, segments),
            Response::Error { status, message } => {
                return Err(Error::from_status(status, Handle::default(), 0, &message));
            }
            other => return Err(Error::Protocol(format!("unexpected hello reply {other:?}"))),
        };
        let rbuf = RecvBuf::new(&rbuf[frame_len..]);
        if fds.len() != infos.len() {
            return Err(Error::Protocol(format!(
                "hello announced {} segments but carried {} descriptors",
                infos.len(),
                fds.len()
            )));
        }
        let access = match opts.role {
            Role::Reader => Access::ReadOnly,
            Role::Writer => Access::ReadWrite,
        };
        let mut segments = Vec::with_capacity(infos.len());
        for (i, (info, fd)) in infos.iter().zip(fds).enumerate() {
            check_segment_id(info, i)?;
            segments.push(Arc::new(Mapping::new(
                fd,
                info.size_bytes,
                access,
                opts.populate,
            )?));
        }
        tracing::debug!(node_id, epoch, segments = segments.len(), role = ?opts.role, "connected");
        let releases = Arc::new(ReleaseQueue {
            state: Mutex::new(PendingReleases::default()),
            wake: Condvar::new(),
            delay: opts.release_delay,
        });
        let client = Client {
            inner: Arc::new(Inner {
                stream,
                call: Mutex::new(CallState {
                    next_id: 1,
                    wbuf,
                    rbuf,
                }),
                send: Mutex::new(()),
                segments,
                node_id,
                epoch,
                role: opts.role,
                create_timeout: opts.create_timeout,
                broken: AtomicBool::new(false),
                releases: releases.clone(),
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

    /// The daemon's node id.
    pub fn node_id(&self) -> u32 {
        self.inner.node_id
    }

    /// The daemon's start epoch; it changes when the daemon restarts.
    pub fn epoch(&self) -> u32 {
        self.inner.epoch
    }

    /// This connection's role.
    pub fn role(&self) -> Role {
        self.inner.role
    }

    /// Reserves a writable object of `size_bytes` bytes, waiting for space up to the connection's
    /// create timeout. Write it through [`ObjectWriter::as_mut_slice`], then seal it.
    pub fn create(&self, size_bytes: u64) -> Result<ObjectWriter, Error> {
        self.create_with(size_bytes, CreateOptions::default())
    }

    /// [`Client::create`] with explicit options.
    pub fn create_with(&self, size_bytes: u64, opts: CreateOptions) -> Result<ObjectWriter, Error> {
        self.create_batch(&[size_bytes], opts)?
            .pop()
            .expect("one result per size")
    }

    /// Reserves one object per size in one round trip. Each result stands alone: a `Full` for one
    /// size does not undo the others.
    pub fn create_batch(
        &self,
        sizes_bytes: &[u64],
        opts: CreateOptions,
    ) -> Result<Vec<Result<ObjectWriter, Error>>, Error> {
        if sizes_bytes.is_empty() {
            return Ok(Vec::new());
        }
        let timeout = opts.timeout.unwrap_or(self.inner.create_timeout);
        let request = Request::Create {
            sizes: sizes_bytes.to_vec(),
            timeout_ms: u32::try_from(timeout.as_millis()).unwrap_or(u32::MAX),
            flags: if opts.pin { CREATE_PIN } else { 0 },
        };
        let results = match self.call(&request)? {
            Response::Created(r) if r.len() == sizes_bytes.len() => r,
            other => return Err(unexpected(other)),
        };
        Ok(results
            .into_iter()
            .zip(sizes_bytes)
            .map(|(r, &size)| match r {
                Ok(c) => {
                    let mapping = self.mapping(c.location)?.clone();
                    Ok(ObjectWriter::new(
                        self.clone(),
                        c.handle,
                        mapping,
                        c.location,
                    ))
                }
                Err(status) => Err(Error::from_status(status, Handle::default(), size, "")),
            })
            .collect())
    }

    /// Writes `bytes` as a new sealed object: reserve, one copy into shared memory, seal.
    pub fn put(&self, bytes: &[u8]) -> Result<Handle, Error> {
        let mut writer = self.create(bytes.len() as u64)?;
        writer.as_mut_slice().copy_from_slice(bytes);
        writer.seal()
    }

    /// Writes several objects in two round trips (one create batch, one seal batch). All or
    /// nothing: on any failure the reserved objects are aborted and the first error returned.
    pub fn put_batch(&self, objects: &[&[u8]]) -> Result<Vec<Handle>, Error> {
        let sizes: Vec<u64> = objects.iter().map(|o| o.len() as u64).collect();
        let writers = self.create_batch(&sizes, CreateOptions::default())?;
        let mut ok = Vec::with_capacity(writers.len());
        let mut first_err = None;
        for w in writers {
            match w {
                Ok(w) => ok.push(w),
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        if let Some(e) = first_err {
            drop(ok); // aborts each reservation
            return Err(e);
        }
        for (w, bytes) in ok.iter_mut().zip(objects) {
            w.as_mut_slice().copy_from_slice(bytes);
        }
        ObjectWriter::seal_batch(self, ok)
    }

    /// Takes a lease on a sealed object and returns a read-only view of its bytes in shared
    /// memory. The lease is released when the view is dropped.
    pub fn get(&self, handle: Handle) -> Result<Lease, Error> {
        self.get_batch(&[handle])?
            .pop()
            .expect("one result per handle")
    }

    /// Leases several objects in one round trip.
    pub fn get_batch(&self, handles: &[Handle]) -> Result<Vec<Result<Lease, Error>>, Error> {
        if handles.is_empty() {
            return Ok(Vec::new());
        }
        let results = match self.call(&Request::Get {
            handles: handles.to_vec(),
        })? {
            Response::Got(r) if r.len() == handles.len() => r,
            other => return Err(unexpected(other)),
        };
        Ok(results
            .into_iter()
            .zip(handles)
            .map(|(r, &handle)| match r {
                Ok(loc) => {
                    let mapping = self.mapping(loc)?.clone();
                    Ok(Lease::new(self.clone(), handle, mapping, loc))
                }
                Err(status) => Err(Error::from_status(status, handle, 0, "")),
            })
            .collect())
    }

    /// Deletes an object. Its bytes stay readable through existing leases and are reused once the
    /// last one is released.
    pub fn delete(&self, handle: Handle) -> Result<(), Error> {
        self.delete_batch(&[handle])?
            .pop()
            .expect("one result per handle")
    }

    /// Deletes several objects in one round trip.
    pub fn delete_batch(&self, handles: &[Handle]) -> Result<Vec<Result<(), Error>>, Error> {
        self.each(
            Request::Delete {
                handles: handles.to_vec(),
            },
            handles,
        )
    }

    /// A snapshot of the daemon's statistics.
    pub fn stats(&self) -> Result<StoreStats, Error> {
        match self.call(&Request::Stats)? {
            Response::Stats(s) => Ok(s),
            other => Err(unexpected(other)),
        }
    }

    /// Every open stream on the daemon.
    pub fn streams(&self) -> Result<Vec<feedstore_proto::frame::StreamInfo>, Error> {
        match self.call(&Request::StreamList)? {
            Response::Streams(list) => Ok(list),
            other => Err(unexpected(other)),
        }
    }

    /// Whether `ptr` points into one of this client's segment mappings (for zero-copy checks).
    pub fn maps(&self, ptr: *const u8) -> bool {
        self.inner.segments.iter().any(|m| m.contains(ptr))
    }

    pub(crate) fn each(
        &self,
        request: Request,
        handles: &[Handle],
    ) -> Result<Vec<Result<(), Error>>, Error> {
        if handles.is_empty() {
            return Ok(Vec::new());
        }
        let statuses = match self.call(&request)? {
            Response::Done(s) if s.len() == handles.len() => s,
            other => return Err(unexpected(other)),
        };
        Ok(statuses
            .into_iter()
            .zip(handles)
            .map(|(s, &h)| {
                if s == Status::Ok {
                    Ok(())
                } else {
                    Err(Error::from_status(s, h, 0, ""))
                }
            })
            .collect())
    }

    pub(crate) fn mapping(&self, loc: Location) -> Result<&Arc<Mapping>, Error> {
        let mapping = self
            .inner
            .segments
            .get(loc.segment as usize)
            .ok_or_else(|| {
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

    /// Sends a request and waits for its reply.
    pub(crate) fn call(&self, request: &Request) -> Result<Response, Error> {
        self.exchange(request, read_reply).and_then(check_error)
    }

    /// Sends a request whose reply carries descriptors, and waits for both.
    pub(crate) fn call_with_fds(
        &self,
        request: &Request,
    ) -> Result<(Response, Vec<OwnedFd>), Error> {
        let mut fds = Vec::new();
        let response = self.exchange(request, |stream, rb, id| {
            read_frame(rb, id, |buf| {
                let (n, received) = recv_with_fds(stream, buf)?;
                fds.extend(received);
                Ok(n)
            })
        })?;
        Ok((check_error(response)?, fds))
    }

    /// One request/reply exchange, queued releases riding along; `read` reads the reply.
    fn exchange(
        &self,
        request: &Request,
        read: impl FnOnce(&UnixStream, &mut RecvBuf, u32) -> Result<Response, Error>,
    ) -> Result<Response, Error> {
        let inner = &*self.inner;
        if inner.broken.load(Ordering::Relaxed) {
            return Err(Error::Disconnected { source: None });
        }
        let mut guard = inner.call.lock().unwrap_or_else(|e| e.into_inner());
        let state = &mut *guard;
        let id = state.next_id;
        state.next_id = state.next_id.wrapping_add(1);
        state.wbuf.clear();
        let queued = inner.releases.take();
        if !queued.is_empty() {
            Request::Release { handles: queued }.encode(0, &mut state.wbuf);
        }
        request.encode(id, &mut state.wbuf);
        let result = self
            .send(&state.wbuf)
            .and_then(|()| read(&inner.stream, &mut state.rbuf, id));
        // After a socket, framing or decoding error the byte stream is no longer in step with
        // the daemon; fail every later call instead of misreading the next reply.
        if let Err(e) = &result
            && matches!(
                e,
                Error::Disconnected { .. } | Error::Protocol(_) | Error::Decode(_)
            )
        {
            inner.broken.store(true, Ordering::Relaxed);
        }
        result
    }

    /// Sends a request that has no reply.
    pub(crate) fn send_one_way(&self, request: &Request) -> Result<(), Error> {
        debug_assert!(!request.expects_reply());
        if self.inner.broken.load(Ordering::Relaxed) {
            return Err(Error::Disconnected { source: None });
        }
        let mut buf = Vec::with_capacity(64);
        request.encode(0, &mut buf);
        self.send(&buf).inspect_err(|_| {
            self.inner.broken.store(true, Ordering::Relaxed);
        })
    }

    /// Returns a lease: queued to ride with the next request, or sent at once when the queue is
    /// long or the connection has no release delay.
    pub(crate) fn release(&self, handle: Handle) {
        let queue = &self.inner.releases;
        if queue.delay.is_zero() {
            return self.send_release(&[handle]);
        }
        let mut state = queue.lock();
        state.handles.push(handle);
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
        if self.inner.broken.load(Ordering::Relaxed) {
            return;
        }
        let mut buf = Vec::with_capacity(frame::HEADER_BYTES + 4 + 16 * handles.len());
        Request::Release {
            handles: handles.to_vec(),
        }
        .encode(0, &mut buf);
        if self.send(&buf).is_err() {
            self.inner.broken.store(true, Ordering::Relaxed);
        }
    }

    fn send(&self, bytes: &[u8]) -> Result<(), Error> {
        let _guard = self.inner.send.lock().unwrap_or_else(|e| e.into_inner());
        send_all(&self.inner.stream, bytes)
    }
}

/// A reply that is an error as a whole becomes the caller's error.
fn check_error(response: Response) -> Result<Response, Error> {
    match response {
        Response::Error { status, message } => {
            Err(Error::from_status(status, Handle::default(), 0, &message))
        }
        response => Ok(response),
    }
}

fn unexpected(response: Response) -> Error {
    Error::Protocol(format!("unexpected reply {response:?}"))
}

fn check_segment_id(info: &SegmentInfo, index: usize) -> Result<(), Error> {
    if info.id as usize != index {
        return Err(Error::Protocol(format!(
            "segment {} announced at position {index}",
            info.id
        )));
    }
    Ok(())
}

fn disconnected(e: std::io::Error) -> Error {
    Error::Disconnected { source: Some(e) }
}

/// Writes all of `bytes`; `MSG_NOSIGNAL` so a dead daemon is an error, not a `SIGPIPE` that kills
/// a Python or C host process.
fn send_all(stream: &UnixStream, mut bytes: &[u8]) -> Result<(), Error> {
    while !bytes.is_empty() {
        match nix::sys::socket::send(stream.as_raw_fd(), bytes, MsgFlags::MSG_NOSIGNAL) {
            Ok(n) => bytes = &bytes[n..],
            Err(nix::Error::EINTR) => {}
            Err(e) => return Err(disconnected(e.into())),
        }
    }
    Ok(())
}

/// A receive buffer that is zeroed once, not on every read.
struct RecvBuf {
    data: Vec<u8>,
    filled: usize,
}

impl RecvBuf {
    fn new(leftover: &[u8]) -> RecvBuf {
        let mut data = vec![0u8; (64 << 10).max(leftover.len())];
        data[..leftover.len()].copy_from_slice(leftover);
        RecvBuf {
            data,
            filled: leftover.len(),
        }
    }
}

/// Reads until the buffer holds one whole frame with the expected id, decodes and consumes it.
fn read_reply(stream: &UnixStream, rb: &mut RecvBuf, id: u32) -> Result<Response, Error> {
    read_frame(rb, id, |buf| {
        loop {
            match (&*stream).read(buf) {
                Ok(0) => return Err(Error::Disconnected { source: None }),
                Ok(n) => return Ok(n),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(disconnected(e)),
            }
        }
    })
}

/// Fills the buffer with `read` until it holds one whole frame with the expected id, then
/// decodes and consumes it.
fn read_frame(
    rb: &mut RecvBuf,
    id: u32,
    mut read: impl FnMut(&mut [u8]) -> Result<usize, Error>,
) -> Result<Response, Error> {
    loop {
        if let Some(frame) = Frame::parse(&rb.data[..rb.filled], frame::MAX_PAYLOAD_BYTES)? {
            if frame.header.request_id != id {
                return Err(Error::Protocol(format!(
                    "reply for request {} while waiting for {id}",
                    frame.header.request_id
                )));
            }
            let response = Response::decode(&frame);
            let len = frame.len();
            rb.data.copy_within(len..rb.filled, 0);
            rb.filled -= len;
            return Ok(response?);
        }
        if rb.filled == rb.data.len() {
            let grown = rb.data.len() * 2;
            rb.data.resize(grown, 0);
        }
        let filled = rb.filled;
        rb.filled += read(&mut rb.data[filled..])?;
    }
}

/// Reads the hello reply, which carries the segment descriptors.
fn recv_hello(stream: &UnixStream, rbuf: &mut Vec<u8>) -> Result<(usize, Vec<OwnedFd>), Error> {
    let mut fds: Vec<OwnedFd> = Vec::new();
    loop {
        if let Some(frame) = Frame::parse(rbuf, frame::MAX_PAYLOAD_BYTES)? {
            return Ok((frame.len(), fds));
        }
        let start = rbuf.len();
        rbuf.resize(start + 4096.max(HEADER_BYTES), 0);
        let (n, received) = recv_with_fds(stream, &mut rbuf[start..])?;
        fds.extend(received);
        rbuf.truncate(start + n);
    }
}

/// One `recvmsg` into `buf`, keeping the descriptors that ride along. End of stream is
/// `Disconnected`.
fn recv_with_fds(stream: &UnixStream, buf: &mut [u8]) -> Result<(usize, Vec<OwnedFd>), Error> {
    let mut cmsg = nix::cmsg_space!([RawFd; 253]);
    let (n, received) = loop {
        let mut iov = [IoSliceMut::new(&mut *buf)];
        let msg = match nix::sys::socket::recvmsg::<()>(
            stream.as_raw_fd(),
            &mut iov,
            Some(&mut cmsg),
            MsgFlags::MSG_CMSG_CLOEXEC,
        ) {
            Ok(msg) => msg,
            Err(nix::Error::EINTR) => continue,
            Err(e) => return Err(disconnected(e.into())),
        };
        let mut received = Vec::new();
        for c in msg
            .cmsgs()
            .map_err(|e| Error::Protocol(format!("bad control message: {e}")))?
        {
            if let ControlMessageOwned::ScmRights(raw) = c {
                received.extend(raw);
            }
        }
        break (msg.bytes, received);
    };
    // SAFETY: SCM_RIGHTS installed these descriptors in this process just now; nothing else owns
    // them.
    let fds = received
        .into_iter()
        .map(|fd| unsafe { OwnedFd::from_raw_fd(fd) })
        .collect();
    if n == 0 {
        return Err(Error::Disconnected { source: None });
    }
    Ok((n, fds))
}
