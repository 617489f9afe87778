//! The socket under a [`Client`](super::Client): whole frames written with `MSG_NOSIGNAL`,
//! replies read into a buffer zeroed once, the hello with the segment descriptors riding along
//! (`SCM_RIGHTS`), the daemon's uid checked before a byte is sent, and lease releases encoded
//! to fit the daemon's limit.

use super::*;

/// Release frames for `handles` in protocol `version`, split to fit the daemon's limit.
pub(super) fn encode_releases(
    handles: &[Handle],
    limit: u32,
    version: u16,
    out: &mut Vec<u8>,
) -> Result<(), frame::EncodeError> {
    for chunk in handles.chunks(max_batch_items(Opcode::Release, limit, limit)) {
        Request::Release {
            handles: chunk.to_vec(),
        }
        .encode_in(version, 0, limit, out)?;
    }
    Ok(())
}

/// Refuses a socket served by anyone but root, this process's uid or the configured daemon
/// uid, before a byte is sent.
pub(super) fn check_daemon_uid(stream: &UnixStream, opts: &ConnectOptions) -> Result<(), Error> {
    let cred = nix::sys::socket::getsockopt(stream, nix::sys::socket::sockopt::PeerCredentials)
        .map_err(|e| disconnected(e.into()))?;
    let uid = cred.uid();
    let own = nix::unistd::geteuid().as_raw();
    if uid == 0 || uid == own || opts.daemon_uid == Some(uid) {
        return Ok(());
    }
    let mut trusted: Vec<u32> = [Some(0), Some(own), opts.daemon_uid]
        .into_iter()
        .flatten()
        .collect();
    trusted.dedup();
    Err(Error::UntrustedDaemon {
        path: opts.socket.clone(),
        uid,
        trusted,
    })
}

/// A reply that is an error as a whole becomes the caller's error.
pub(super) fn check_error(response: Response) -> Result<Response, Error> {
    match response {
        Response::Error { status, message } => {
            Err(Error::from_status(status, Handle::default(), 0, &message))
        }
        response => Ok(response),
    }
}

pub(crate) fn unexpected(response: Response) -> Error {
    Error::Protocol(format!("unexpected reply {response:?}"))
}

pub(super) fn check_segment_id(info: &SegmentInfo, index: usize) -> Result<(), Error> {
    if info.id as usize != index {
        return Err(Error::Protocol(format!(
            "segment {} announced at position {index}",
            info.id
        )));
    }
    Ok(())
}

pub(super) fn disconnected(e: std::io::Error) -> Error {
    Error::Disconnected { source: Some(e) }
}

/// Writes all of `bytes`; `MSG_NOSIGNAL` so a dead daemon is an error, not a `SIGPIPE` that kills
/// a Python or C host process.
pub(super) fn send_all(stream: &UnixStream, bytes: &[u8]) -> Result<(), Error> {
    send_all_or_none(stream, bytes).map_err(|(e, _)| e)
}

/// [`send_all`], saying on failure whether none of the bytes left (then the daemon saw none
/// of them).
pub(super) fn send_all_or_none(stream: &UnixStream, mut bytes: &[u8]) -> Result<(), (Error, bool)> {
    let whole = bytes.len();
    while !bytes.is_empty() {
        match nix::sys::socket::send(stream.as_raw_fd(), bytes, MsgFlags::MSG_NOSIGNAL) {
            Ok(n) => bytes = &bytes[n..],
            Err(nix::Error::EINTR) => {}
            Err(e) => return Err((disconnected(e.into()), bytes.len() == whole)),
        }
    }
    Ok(())
}

/// A receive buffer that is zeroed once, not on every read.
pub(super) struct RecvBuf {
    data: Vec<u8>,
    filled: usize,
}

impl RecvBuf {
    pub(super) fn new(leftover: &[u8]) -> RecvBuf {
        let mut data = vec![0u8; (64 << 10).max(leftover.len())];
        data[..leftover.len()].copy_from_slice(leftover);
        RecvBuf {
            data,
            filled: leftover.len(),
        }
    }
}

/// Reads until the buffer holds one whole frame with the expected id, decodes and consumes it.
pub(super) fn read_reply(
    stream: &UnixStream,
    rb: &mut RecvBuf,
    id: u32,
    (limit, version): (u32, u16),
) -> Result<Response, Error> {
    read_frame(rb, id, (limit, version), |buf| {
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
pub(super) fn read_frame(
    rb: &mut RecvBuf,
    id: u32,
    (limit, version): (u32, u16),
    mut read: impl FnMut(&mut [u8]) -> Result<usize, Error>,
) -> Result<Response, Error> {
    loop {
        if let Some(frame) = Frame::parse(&rb.data[..rb.filled], limit)? {
            if frame.header.version != version {
                return Err(Error::Protocol(format!(
                    "a reply in protocol {} on a connection that agreed on {version}",
                    frame.header.version
                )));
            }
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

/// Reads the hello reply, which carries the segment descriptors. A reply of a protocol version
/// older than any this client speaks is [`Error::VersionMismatch`], with the daemon's own words
/// when its error reply can be read (every version so far lays out a header, and an error
/// reply, the same way).
pub(super) fn recv_hello(
    stream: &UnixStream,
    rbuf: &mut Vec<u8>,
) -> Result<(usize, Vec<OwnedFd>), Error> {
    let mut fds: Vec<OwnedFd> = Vec::new();
    loop {
        match Frame::parse(rbuf, frame::MAX_PAYLOAD_BYTES) {
            Ok(Some(frame)) => return Ok((frame.len(), fds)),
            Ok(None) => {}
            Err(frame::DecodeError::UnsupportedVersion { found, expected }) => {
                // Read as a reply of this version: every version so far lays a header and an
                // error reply out the same way.
                let mut ours = rbuf.clone();
                ours[2..4].copy_from_slice(&expected.to_le_bytes());
                let parsed = Frame::parse(&ours, frame::MAX_PAYLOAD_BYTES);
                if !matches!(parsed, Ok(None)) {
                    let detail = match parsed.ok().flatten().map(|f| Response::decode(&f)) {
                        Some(Ok(Response::Error { message, .. })) => message,
                        _ => String::new(),
                    };
                    return Err(Error::VersionMismatch {
                        daemon: found,
                        client: expected,
                        detail,
                    });
                }
                // The rest of the daemon's reply is on its way.
            }
            Err(e) => return Err(e.into()),
        }
        // A hello reply is small (at most 250 segments); anything longer is not a daemon.
        if rbuf.len() > frame::MIN_PAYLOAD_BYTES as usize {
            return Err(Error::Protocol("hello reply too long".into()));
        }
        let start = rbuf.len();
        rbuf.resize(start + 4096.max(HEADER_BYTES), 0);
        let got = recv_with_fds(stream, &mut rbuf[start..]);
        // (Only what arrived stays: the caller tells a close before any reply by an empty
        // buffer.)
        rbuf.truncate(start + got.as_ref().map_or(0, |(n, _)| *n));
        let (_, received) = got?;
        fds.extend(received);
    }
}

/// One `recvmsg` into `buf`, keeping the descriptors that ride along. End of stream is
/// `Disconnected`.
pub(super) fn recv_with_fds(
    stream: &UnixStream,
    buf: &mut [u8],
) -> Result<(usize, Vec<OwnedFd>), Error> {
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

/// What the daemon's hello reply says, with the descriptors of its segments.
pub(super) struct Welcome {
    pub(super) node_id: u32,
    pub(super) epoch: u32,
    pub(super) segments: Vec<SegmentInfo>,
    pub(super) fds: Vec<OwnedFd>,
    /// The largest request frame the daemon takes.
    pub(super) request_limit: u32,
    /// The protocol version the connection speaks from now on.
    pub(super) version: u16,
    /// What the daemon speaks: its versions, features and release.
    pub(super) daemon: Speaks,
    /// The receive buffer, holding what was read past the hello reply.
    pub(super) rbuf: RecvBuf,
}

/// How a hello in one protocol version went.
pub(super) enum Greeted {
    /// The daemon answered: the connection is up.
    Welcome(Welcome),
    /// The daemon speaks only older versions, the newest of them this one: say hello again in
    /// it, on a new connection.
    Older(u16),
    /// The daemon closed the connection without a word: 0.1.0's does at a hello of a version
    /// it does not speak (a daemon restarting just then does too).
    Closed,
}

/// Sends the hello in protocol `version` (encoded into `wbuf`) and reads the daemon's answer,
/// waiting at most `opts.hello_timeout`: its node, epoch and segments, each segment's
/// descriptor alongside, and the version both speak. A daemon older than `version` refuses the
/// hello with an error in its own version ([`Greeted::Older`]); one that speaks protocol 9
/// (feedstore 0.1.0) closes the connection without a word ([`Greeted::Closed`]).
pub(super) fn hello(
    stream: &UnixStream,
    opts: &ConnectOptions,
    wbuf: &mut Vec<u8>,
    version: u16,
    reconnects: u32,
) -> Result<Greeted, Error> {
    Request::Hello {
        role: opts.role,
        client_name: opts.name.clone(),
        max_frame_bytes: opts.max_frame_bytes,
        speaks: Speaks::ours(),
        reconnects,
    }
    .encode_in(version, 0, frame::MIN_PAYLOAD_BYTES, wbuf)?;
    // A daemon refusing the connection (at a connection limit) may answer and close before
    // the hello is sent: read its answer before reporting a broken pipe.
    let sent = send_all(stream, wbuf);
    let mut rbuf = Vec::with_capacity(4096);
    let hello_timeout = |e: Error| match e {
        Error::Disconnected {
            source: Some(ref io),
        } if matches!(
            io.kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
        ) =>
        {
            Error::Timeout(format!(
                "feedstored at {} accepted the connection but did not answer within {:?} \
                 (at its connection limit, or not a feedstored?)",
                opts.socket.display(),
                opts.hello_timeout
            ))
        }
        e => e,
    };
    stream
        .set_read_timeout(Some(opts.hello_timeout.max(Duration::from_millis(1))))
        .map_err(disconnected)?;
    let (frame_len, fds) = match recv_hello(stream, &mut rbuf).map_err(hello_timeout) {
        Ok(hello) => hello,
        // (A close with the hello unread reaches this side as a reset.)
        Err(Error::Disconnected { source })
            if rbuf.is_empty()
                && source
                    .as_ref()
                    .is_none_or(|e| e.kind() == std::io::ErrorKind::ConnectionReset) =>
        {
            return Ok(Greeted::Closed);
        }
        Err(e) => return Err(sent.err().unwrap_or(e)),
    };
    stream.set_read_timeout(None).map_err(disconnected)?;
    let frame = Frame::parse(&rbuf[..frame_len], opts.max_frame_bytes)?
        .ok_or_else(|| Error::Protocol("short hello reply".into()))?;
    let agreed = frame.header.version;
    let (node_id, epoch, infos, request_limit, daemon) = match Response::decode(&frame)? {
        Response::Hello { .. } if agreed > version => {
            return Err(Error::Protocol(format!(
                "the daemon answered a hello of protocol {version} in {agreed}"
            )));
        }
        Response::Hello {
            node_id,
            epoch,
            segments,
            max_frame_bytes,
            speaks,
        } => (node_id, epoch, segments, max_frame_bytes, speaks),
        Response::Error { .. } if agreed < version => return Ok(Greeted::Older(agreed)),
        // A daemon newer than anything this client speaks says why in its own version.
        Response::Error { message, .. } if agreed > version => {
            return Err(Error::VersionMismatch {
                daemon: agreed,
                client: frame::VERSION,
                detail: message,
            });
        }
        Response::Error { status, message } => {
            return Err(Error::from_status(status, Handle::default(), 0, &message));
        }
        other => return Err(Error::Protocol(format!("unexpected hello reply {other:?}"))),
    };
    if request_limit < frame::MIN_PAYLOAD_BYTES {
        return Err(Error::Protocol(format!(
            "daemon accepts frames of only {request_limit} bytes (at least {} are needed)",
            frame::MIN_PAYLOAD_BYTES
        )));
    }
    if fds.len() != infos.len() {
        return Err(Error::Protocol(format!(
            "hello announced {} segments but carried {} descriptors",
            infos.len(),
            fds.len()
        )));
    }
    Ok(Greeted::Welcome(Welcome {
        node_id,
        epoch,
        segments: infos,
        fds,
        request_limit,
        version: agreed,
        daemon,
        rbuf: RecvBuf::new(&rbuf[frame_len..]),
    }))
}
