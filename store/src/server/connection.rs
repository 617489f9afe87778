//! A connection's loop: frames read and decoded once, one-way messages applied at once, every
//! request routed to its family's handler (`session`, `objects`, `streams`), the reply written.

use std::collections::VecDeque;
use std::io::IoSlice;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::Duration;

use feedstore_proto::frame::{DecodeError, Frame, MIN_PAYLOAD_BYTES, Opcode, Request, Response};
use feedstore_proto::{Role, Status};
use nix::sys::socket::{ControlMessage, MsgFlags};
use tokio::io::{AsyncReadExt, AsyncWriteExt, Interest};
use tokio::net::UnixStream;
use tokio::sync::watch;
use tokio::time::Instant;

use super::session::version_mismatch;
use super::{Cluster, ConnEnd, Connection, Credentials, Shared, error};
use crate::objects::{ConnId, Objects};

/// Serves one accepted connection to its end, then reclaims everything it held.
pub async fn serve_connection(
    shared: Arc<Shared>,
    cluster: Option<Arc<Cluster>>,
    mut stream: UnixStream,
) {
    let credentials = match Credentials::of(&stream) {
        Ok(p) => p,
        Err(e) => {
            tracing::warn!(error = %e, "cannot read the client's credentials; closing connection");
            return;
        }
    };
    let _admitted = match shared.admit(credentials.uid) {
        Ok(a) => a,
        Err(message) => {
            shared.with_objects(Objects::note_limit_hit);
            tracing::warn!(pid = credentials.pid, uid = credentials.uid, %message, "connection refused");
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
        cluster,
        stream,
        rbuf: Vec::with_capacity(64 << 10),
        wbuf: Vec::with_capacity(4 << 10),
        deferred: VecDeque::new(),
        deferred_bytes: 0,
        id: None,
        role: Role::Reader,
        credentials,
        client_limit: MIN_PAYLOAD_BYTES,
        name: String::new(),
        version: feedstore_proto::frame::VERSION,
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
    let (uid, pid) = (conn.credentials.uid, conn.credentials.pid);
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
            // (While the daemon hands over to a successor nothing is served: what it would
            // change would not reach the successor. Its clients ask the successor again.)
            let shared = self.shared.clone();
            let _busy = shared.handoff.enter().await;
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
        if self.id.is_some() && frame.header.version != self.version {
            return Err(ConnEnd::Protocol(format!(
                "a frame of protocol {} on a connection that agreed on {}",
                frame.header.version, self.version
            )));
        }
        let request = Request::decode(&frame)?;
        self.rbuf.drain(..len);
        Ok(Some((request_id, request, len)))
    }

    /// Handles one request: the hello first, then one-way messages at once (no reply), then
    /// each request by its family's handler, its reply written here.
    async fn dispatch(&mut self, request_id: u32, request: Request) -> Result<(), ConnEnd> {
        let op = request.opcode();
        let Some(id) = self.id else {
            return match request {
                Request::Hello {
                    role,
                    client_name,
                    max_frame_bytes,
                    speaks,
                    reconnects,
                } => {
                    self.hello(
                        request_id,
                        role,
                        client_name,
                        max_frame_bytes,
                        speaks,
                        reconnects,
                    )
                    .await
                }
                Request::Takeover { format } => self.hand_over(request_id, format).await,
                _ => Err(ConnEnd::Protocol(format!("{op:?} before hello"))),
            };
        };
        let Some(request) = self.one_way(id, request) else {
            return Ok(());
        };
        // A batch whose reply could not fit the client's limit is refused before it takes a
        // single lease or reservation.
        if let Some(bound) = request.reply_bound()
            && bound > self.client_limit as usize
        {
            let message = format!(
                "a {op:?} of {} items needs a reply of {bound} bytes, over this client's limit \
                 of {} bytes: split the batch",
                request.batch_len(),
                self.client_limit
            );
            return self
                .reply(op, request_id, &error(Status::InvalidArgument, message))
                .await;
        }
        let response = match request {
            Request::Hello { .. } => return Err(ConnEnd::Protocol("second hello".into())),
            Request::Stats => {
                let mut stats = self.shared.stats();
                if let Some(cluster) = &self.cluster {
                    cluster.add_stats(&mut stats);
                }
                Response::Stats(Box::new(stats))
            }
            request @ (Request::Create { .. }
            | Request::Seal { .. }
            | Request::Abort { .. }
            | Request::Delete { .. }
            | Request::Get { .. }) => self.objects(id, request).await?,
            Request::StreamAttach {
                spec,
                rank,
                seq,
                timeout_ms,
            } => {
                return self
                    .stream_attach(id, request_id, spec, rank, seq, timeout_ms)
                    .await;
            }
            request => match self.streams(id, request).await? {
                Ok(response) => response,
                Err(request) => {
                    let op = request.opcode();
                    return Err(ConnEnd::Protocol(format!("{op:?} has no handler")));
                }
            },
        };
        self.reply(op, request_id, &response).await
    }

    /// Applies a one-way message (a client's returns of leases and stream samples, a
    /// producer's report: no reply) at once; hands any other request back. Whether it comes
    /// in turn or while another request waits, a one-way message goes through here.
    fn one_way(&self, id: ConnId, request: Request) -> Option<Request> {
        match request {
            Request::Release { handles } => self.release(id, &handles),
            Request::StreamRelease {
                stream,
                rank,
                upto,
                figures,
            } => self.stream_release(id, stream, rank, upto, figures),
            Request::ProducerReport { stream, figures } => {
                self.producer_report(id, stream, &figures);
            }
            other => return Some(other),
        }
        None
    }

    /// Re-checks a stream condition whenever the streams change, until `check` answers (it is
    /// told when the time is up, and must answer then).
    pub(super) async fn wait_until<T>(
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
    pub(super) async fn wait_for<T>(
        &mut self,
        id: ConnId,
        events: &mut watch::Receiver<T>,
        deadline: Instant,
    ) -> Result<(), ConnEnd> {
        // Frames that arrived with the waiting request are taken in first.
        self.absorb(id)?;
        // A hand-over beginning (or under way) wakes the wait, which parks until it is over.
        let mut thawed = self.shared.handoff.thawed_watch();
        tokio::select! {
            _ = thawed.wait_for(|t| !*t) => {}
            _ = events.changed() => {}
            _ = tokio::time::sleep_until(deadline) => {}
            read = self.stream.read_buf(&mut self.rbuf) => {
                if read? == 0 {
                    return Err(ConnEnd::Closed);
                }
                self.absorb(id)?;
            }
        }
        self.shared.handoff.park().await;
        Ok(())
    }

    /// Takes every whole frame in the read buffer while a request waits: one-way messages are
    /// applied at once, other requests queued for after the wait, within the queue's bounds.
    fn absorb(&mut self, id: ConnId) -> Result<(), ConnEnd> {
        while let Some((request_id, request, len)) = self.take_frame()? {
            let Some(request) = self.one_way(id, request) else {
                continue;
            };
            let limits = &self.shared.limits;
            let max_bytes = 4 * self.shared.max_frame_bytes as usize;
            if self.deferred.len() >= limits.max_queued_requests
                || self.deferred_bytes + len > max_bytes
            {
                self.shared.with_objects(Objects::note_limit_hit);
                return Err(ConnEnd::Protocol(format!(
                    "more than {} requests or {max_bytes} bytes queued behind a waiting one \
                     (--max-queued-requests)",
                    limits.max_queued_requests
                )));
            }
            self.deferred_bytes += len;
            self.deferred.push_back((request_id, request));
        }
        Ok(())
    }

    /// Sends the encoded reply in `wbuf` with descriptors riding on its first byte.
    pub(super) async fn send_with_fds(&mut self, fds: &[i32]) -> Result<(), ConnEnd> {
        let shared = self.shared.clone();
        let _writing = shared.handoff.writing();
        self.send_with_fds_now(fds).await
    }

    /// [`Connection::send_with_fds`], counted as busy all along (the hand-over's own).
    pub(super) async fn send_with_fds_now(&mut self, fds: &[i32]) -> Result<(), ConnEnd> {
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

    /// Encodes `response` into `wbuf` within the client's limit; one that does not fit (which
    /// the checks before each request rule out) becomes an error reply that does.
    pub(super) fn encode_reply(&mut self, op: Opcode, request_id: u32, response: &Response) {
        let (version, limit) = (self.version, self.client_limit);
        if let Err(e) = response.encode_in(version, op, request_id, limit, &mut self.wbuf) {
            tracing::error!(error = %e, "reply over the client's limit");
            let fallback = error(Status::LimitReached, e.to_string());
            fallback
                .encode_in(version, op, request_id, limit, &mut self.wbuf)
                .expect("an error reply fits any agreed limit");
        }
    }

    pub(super) async fn reply(
        &mut self,
        op: Opcode,
        request_id: u32,
        response: &Response,
    ) -> Result<(), ConnEnd> {
        self.wbuf.clear();
        self.encode_reply(op, request_id, response);
        // (Uncounted while written: its changes are made, in the snapshot of a hand-over that
        // begins meanwhile, which need not wait for a client slow to read.)
        let shared = self.shared.clone();
        let _writing = shared.handoff.writing();
        self.stream.write_all(&self.wbuf).await?;
        Ok(())
    }
}
