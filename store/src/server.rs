//! The control socket: one tokio task per client connection.
//!
//! A connection's life: `SO_PEERCRED` is checked against the allow-list, the client says hello
//! and receives one descriptor per segment by `SCM_RIGHTS` (read-only for readers), then frames
//! flow until the client goes away — for any reason, `kill -9` included — at which point its
//! unsealed objects are aborted and its leases returned. A malformed or oversized frame closes
//! that one connection with a logged reason.
//!
//! A create that finds the store full waits here, not in the object model: it re-tries whenever
//! space is freed, until its deadline. While it waits the connection keeps reading, so leases the
//! same client releases from another thread still reach the daemon (otherwise a client could
//! deadlock against its own leases).

use std::collections::{HashSet, VecDeque};
use std::io::IoSlice;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use feedstore_proto::frame::{CREATE_PIN, Created, DecodeError, Frame, Opcode, Request, Response};
use feedstore_proto::{Handle, Role, SEGMENT_HUGETLB, SEGMENT_WRITABLE, SegmentInfo, Status};
use feedstore_shm::Segment;
use nix::sys::socket::{ControlMessage, MsgFlags};
use tokio::io::{AsyncReadExt, AsyncWriteExt, Interest};
use tokio::net::UnixStream;
use tokio::sync::watch;
use tokio::time::Instant;

use crate::objects::{ClientInfo, ConnId, Objects};
use crate::streams::{StreamError, Streams};

/// Who may connect, decided from `SO_PEERCRED`.
#[derive(Debug, Clone)]
pub struct AccessPolicy {
    /// Allowed uids (the daemon's own uid and root are always allowed).
    pub uids: HashSet<u32>,
    /// Peers whose primary gid is this group are allowed too.
    pub gid: Option<u32>,
}

impl AccessPolicy {
    fn allows(&self, uid: u32, gid: u32) -> bool {
        uid == 0 || self.uids.contains(&uid) || self.gid == Some(gid)
    }
}

/// State shared by all connections.
pub struct Shared {
    objects: Mutex<Objects>,
    segments: Vec<Segment>,
    readonly_fds: Vec<OwnedFd>,
    node_id: u32,
    epoch: u32,
    max_frame_bytes: u32,
    max_create_wait_ms: u32,
    policy: AccessPolicy,
    space: watch::Sender<u64>,
    streams: Mutex<Streams>,
    /// Bumped after every stream operation; producers and consumers waiting on a stream watch it.
    stream_events: watch::Sender<u64>,
}

impl Shared {
    /// Wraps the daemon's segments and object state.
    pub fn new(
        objects: Objects,
        segments: Vec<Segment>,
        node_id: u32,
        epoch: u32,
        policy: AccessPolicy,
        max_frame_bytes: u32,
        max_create_wait_ms: u32,
    ) -> Result<Shared, feedstore_shm::ShmError> {
        let readonly_fds = segments
            .iter()
            .map(Segment::reopen_readonly)
            .collect::<Result<_, _>>()?;
        Ok(Shared {
            objects: Mutex::new(objects),
            segments,
            readonly_fds,
            node_id,
            epoch,
            max_frame_bytes,
            max_create_wait_ms,
            policy,
            space: watch::Sender::new(0),
            streams: Mutex::new(Streams::default()),
            stream_events: watch::Sender::new(0),
        })
    }

    /// Runs `f` on the object state, then wakes creates waiting for space if it freed some or
    /// made some evictable.
    pub fn with_objects<R>(&self, f: impl FnOnce(&mut Objects) -> R) -> R {
        let mut objects = self.lock();
        let before = objects.space_epoch();
        let result = f(&mut objects);
        let after = objects.space_epoch();
        drop(objects);
        // Only creates that found the store full subscribe; skip the wake-up machinery otherwise.
        if after != before && self.space.receiver_count() > 0 {
            self.space.send_replace(after);
        }
        result
    }

    /// Runs `f` on the streams and the object state (locked in that order), then wakes whoever
    /// waits on a stream. Only for changes that can end a wait (a sample put or returned, a
    /// consumer or producer come or gone): a waiter re-checks on every wake-up, so a wake-up
    /// from its own check would spin.
    pub fn with_streams<R>(&self, f: impl FnOnce(&mut Streams, &mut Objects) -> R) -> R {
        let result = self.peek_streams(f);
        if self.stream_events.receiver_count() > 0 {
            self.stream_events.send_modify(|n| *n = n.wrapping_add(1));
        }
        result
    }

    /// Runs `f` on the streams and the object state without waking waiters.
    fn peek_streams<R>(&self, f: impl FnOnce(&mut Streams, &mut Objects) -> R) -> R {
        let mut streams = self.streams.lock().unwrap_or_else(|e| e.into_inner());
        self.with_objects(|o| f(&mut streams, o))
    }

    fn lock(&self) -> MutexGuard<'_, Objects> {
        // A panic while holding the lock is a daemon bug; the state is still consistent enough to
        // keep serving other clients, so recover instead of cascading the panic.
        self.objects.lock().unwrap_or_else(|e| e.into_inner())
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
    #[error("uid {uid} is not allowed to connect")]
    Denied { uid: u32 },
}

/// Serves one accepted connection to its end, then reclaims everything it held.
pub async fn serve_connection(shared: Arc<Shared>, stream: UnixStream) {
    let cred = match stream.peer_cred() {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!(error = %e, "cannot read peer credentials; closing connection");
            return;
        }
    };
    let mut conn = Connection {
        shared: shared.clone(),
        stream,
        rbuf: Vec::with_capacity(64 << 10),
        wbuf: Vec::with_capacity(4 << 10),
        deferred: VecDeque::new(),
        id: None,
        role: Role::Reader,
        uid: cred.uid(),
        gid: cred.gid(),
        pid: cred.pid().unwrap_or(0),
    };
    let end = conn.run().await;
    let (uid, pid) = (conn.uid, conn.pid);
    if let Some(id) = conn.id {
        let name = shared
            .lock()
            .client(id)
            .map(|c| c.name.clone())
            .unwrap_or_default();
        shared.with_streams(|s, _| s.disconnect(id));
        let reclaimed = shared.with_objects(|o| o.disconnect(id));
        if let Err(reason @ (ConnEnd::Malformed(_) | ConnEnd::Protocol(_))) = &end {
            tracing::warn!(conn = id, pid, uid, %name, %reason, "closing connection");
        }
        if reclaimed.aborted + reclaimed.leases > 0 {
            tracing::info!(
                conn = id, pid, %name,
                aborted_objects = reclaimed.aborted,
                released_leases = reclaimed.leases,
                "client disconnected; reclaimed its unsealed objects and leases"
            );
        } else {
            tracing::info!(conn = id, pid, %name, "client disconnected");
        }
    } else if let Err(e) = end {
        match e {
            ConnEnd::Closed => {}
            e => tracing::warn!(pid, uid, reason = %e, "connection refused before hello"),
        }
    }
}

struct Connection {
    shared: Arc<Shared>,
    stream: UnixStream,
    rbuf: Vec<u8>,
    wbuf: Vec<u8>,
    /// Requests (with their ids) read while a create was waiting, to be handled after it.
    deferred: VecDeque<(u32, Request)>,
    id: Option<ConnId>,
    role: Role,
    uid: u32,
    gid: u32,
    pid: i32,
}

impl Connection {
    async fn run(&mut self) -> Result<(), ConnEnd> {
        loop {
            let (request_id, request) = match self.deferred.pop_front() {
                Some(r) => r,
                None => match self.take_request()? {
                    Some(r) => r,
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
        let Some(frame) = Frame::parse(&self.rbuf, self.shared.max_frame_bytes)? else {
            return Ok(None);
        };
        let (len, request_id) = (frame.len(), frame.header.request_id);
        let request = Request::decode(&frame)?;
        self.rbuf.drain(..len);
        Ok(Some((request_id, request)))
    }

    async fn dispatch(&mut self, request_id: u32, request: Request) -> Result<(), ConnEnd> {
        let op = request.opcode();
        let Some(id) = self.id else {
            return match request {
                Request::Hello { role, client_name } => {
                    self.hello(request_id, role, client_name).await
                }
                _ => Err(ConnEnd::Protocol(format!("{op:?} before hello"))),
            };
        };
        let shared = self.shared.clone();
        let response = match request {
            Request::Hello { .. } => return Err(ConnEnd::Protocol("second hello".into())),
            Request::Create {
                sizes,
                timeout_ms,
                flags,
            } => {
                if sizes.is_empty() {
                    Response::Error {
                        status: Status::InvalidArgument,
                        message: "empty create batch".into(),
                    }
                } else {
                    let mut results = Vec::with_capacity(sizes.len());
                    let wait =
                        Duration::from_millis(u64::from(timeout_ms.min(shared.max_create_wait_ms)));
                    let deadline = Instant::now() + wait;
                    for size in sizes {
                        results.push(
                            self.create_one(id, size, flags & CREATE_PIN != 0, deadline)
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
            Request::Get { handles } => Response::Got(
                shared.with_objects(|o| handles.iter().map(|&h| o.get(id, h)).collect()),
            ),
            Request::Release { handles } => {
                self.release(id, &handles);
                return Ok(());
            }
            Request::Stats => Response::Stats(shared.peek_streams(|s, o| {
                let mut stats = o.stats();
                s.add_stats(&mut stats);
                stats
            })),
            Request::CacheLookup { keys } => {
                Response::Cached(shared.peek_streams(|s, o| s.lookup(o, &keys)))
            }
            Request::StreamList => Response::Streams(shared.peek_streams(|s, _| s.list())),
            Request::StreamJoin { spec, depth, ranks } => {
                if self.role != Role::Writer {
                    Response::Error {
                        status: Status::PermissionDenied,
                        message: "only writers produce into streams".into(),
                    }
                } else {
                    stream_reply(
                        shared.with_streams(|s, o| s.join(o, id, &spec, depth, &ranks)),
                        |stream| Response::StreamJoined { stream },
                    )
                }
            }
            Request::StreamAttach {
                spec,
                depth,
                rank,
                seq,
            } => {
                let attached = shared.with_streams(|s, o| {
                    let (stream, ring) = s.attach(o, id, &spec, depth, rank, seq)?;
                    let fd = ring.readonly_fd().map_err(|e| StreamError {
                        status: Status::Full,
                        message: format!("cannot share the ring: {e}"),
                    })?;
                    Ok((stream, ring.capacity(), ring.size_bytes(), fd))
                });
                return match attached {
                    Ok((stream, capacity, ring_bytes, fd)) => {
                        let response = Response::StreamAttached {
                            stream,
                            capacity,
                            ring_bytes,
                        };
                        self.wbuf.clear();
                        response.encode(op, request_id, &mut self.wbuf);
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
                self.wait_until(id, timeout_ms, |expired| {
                    match shared.peek_streams(|s, _| s.take(id, stream, max.max(1))) {
                        Ok(tasks) if !tasks.is_empty() || expired => Some(Response::Tasks(tasks)),
                        Ok(_) => None,
                        Err(e) => Some(stream_error(e)),
                    }
                })
                .await?
            }
            Request::StreamPut { stream, items } => stream_reply(
                shared.with_streams(|s, o| s.put(o, id, stream, &items)),
                Response::Done,
            ),
            Request::StreamRelease { stream, rank, upto } => {
                self.stream_release(id, stream, rank, upto);
                return Ok(());
            }
            Request::StreamWait {
                stream,
                rank,
                seq,
                timeout_ms,
            } => {
                // Asking past the end: the consumer has read all of its share. Only that wakes
                // the producers waiting for work (so they can stop).
                if shared.peek_streams(|s, _| s.finish(id, stream, rank, seq)) {
                    shared.with_streams(|_, _| ());
                }
                self.wait_until(id, timeout_ms, |expired| {
                    match shared.peek_streams(|s, _| s.poll(stream, rank, seq)) {
                        Some(status) => Some(Response::Done(vec![status])),
                        None if expired => Some(Response::Done(vec![Status::Timeout])),
                        None => None,
                    }
                })
                .await?
            }
            Request::StreamClose { stream } => {
                stream_reply(shared.with_streams(|s, o| s.close(o, stream)), |()| {
                    Response::Done(vec![Status::Ok])
                })
            }
        };
        self.reply(op, request_id, &response).await
    }

    fn stream_release(&self, id: ConnId, stream: u32, rank: u32, upto: u64) {
        if let Err(e) = self
            .shared
            .with_streams(|s, o| s.release(o, id, stream, rank, upto))
        {
            tracing::debug!(conn = id, stream, rank, upto, error = %e, "stream release refused");
        }
    }

    /// Re-checks a stream condition whenever a stream changes, until `check` answers (it is told
    /// when the time is up, and must answer then).
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
    /// deadlock against its own returns, and other requests are queued for after the wait.
    async fn wait_for(
        &mut self,
        id: ConnId,
        events: &mut watch::Receiver<u64>,
        deadline: Instant,
    ) -> Result<(), ConnEnd> {
        tokio::select! {
            _ = events.changed() => {}
            _ = tokio::time::sleep_until(deadline) => {}
            read = self.stream.read_buf(&mut self.rbuf) => {
                if read? == 0 {
                    return Err(ConnEnd::Closed);
                }
                while let Some((request_id, request)) = self.take_request()? {
                    match request {
                        Request::Release { handles } => self.release(id, &handles),
                        Request::StreamRelease { stream, rank, upto } => {
                            self.stream_release(id, stream, rank, upto);
                        }
                        other => self.deferred.push_back((request_id, other)),
                    }
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

    async fn hello(&mut self, request_id: u32, role: Role, name: String) -> Result<(), ConnEnd> {
        let shared = self.shared.clone();
        if !shared.policy.allows(self.uid, self.gid) {
            let message = format!(
                "uid {} is not allowed by this feedstored; add it with --allow-uid or use --socket-group",
                self.uid
            );
            let response = Response::Error {
                status: Status::PermissionDenied,
                message,
            };
            self.reply(Opcode::Hello, request_id, &response).await?;
            return Err(ConnEnd::Denied { uid: self.uid });
        }
        let info = ClientInfo {
            role,
            uid: self.uid,
            pid: self.pid,
            name: name.clone(),
        };
        let id = shared.with_objects(|o| o.connect(info));
        self.id = Some(id);
        self.role = role;
        tracing::info!(conn = id, pid = self.pid, uid = self.uid, ?role, %name, "client connected");
        let response = Response::Hello {
            node_id: shared.node_id,
            epoch: shared.epoch,
            segments: shared.segment_infos(role),
        };
        self.wbuf.clear();
        response.encode(Opcode::Hello, request_id, &mut self.wbuf);
        let fds: Vec<i32> = match role {
            Role::Writer => shared.segments.iter().map(|s| s.fd().as_raw_fd()).collect(),
            Role::Reader => shared.readonly_fds.iter().map(|f| f.as_raw_fd()).collect(),
        };
        // The descriptors ride on the first byte of the reply; the rest follows as plain bytes.
        self.send_with_fds(&fds).await
    }

    async fn reply(
        &mut self,
        op: Opcode,
        request_id: u32,
        response: &Response,
    ) -> Result<(), ConnEnd> {
        self.wbuf.clear();
        response.encode(op, request_id, &mut self.wbuf);
        self.stream.write_all(&self.wbuf).await?;
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

fn stream_error(e: StreamError) -> Response {
    Response::Error {
        status: e.status,
        message: e.message,
    }
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
