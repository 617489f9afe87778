//! The seam between the pull engine and the network, and the one transport built: TCP.
//!
//! The engine asks a [`Transport`] for a [`Channel`] to a peer and, over it, for ranges of the
//! peer's objects, in two steps: [`Channel::request`] names the range and learns the object's
//! length (so the engine can reserve room for the copy), then [`Channel::receive`] lands the
//! range's bytes in a slice of that reservation and checks them (every record's tag,
//! [`super::record`]). Nothing else of the store is
//! visible to a transport, so another one — RDMA, where `request` returns the owner's registered
//! address and key and `receive` is a one-sided read into this node's registered segment — fits
//! without touching the store (see `docs/ARCHITECTURE.md`).

use std::net::SocketAddr;
use std::time::Duration;

use feedstore_proto::peer::{
    HELLO_SECRET, HELLO_STREAMS, PEER_OLDEST_VERSION, PEER_VERSION, PIECE_BYTES, PROOF_BYTES,
    PeerHello, ReadReply, ReadRequest, TAG_BYTES, Verdict, VerdictCode,
};
use feedstore_proto::{Handle, Status};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;

use super::auth::{Secret, Side};
use super::record::{Forged, Records, Sealer, Tag};
use crate::random_bytes;

/// The longest a handshake may take (a peer on the same network answers in milliseconds; a
/// stranger that stays silent holds a handshake slot this long at most).
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(3);

/// Who is at the other end of a channel, learnt at handshake.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerIdentity {
    /// Its node id.
    pub node_id: u32,
    /// Its start epoch.
    pub epoch: u32,
    /// Its random instance id.
    pub instance: u64,
    /// It opened a stream session ([`feedstore_proto::peer_stream`]), not a range channel.
    pub streams: bool,
    /// The peer protocol version both speak ([`PeerHello::agreed_version`]): what this
    /// connection's messages follow (3 or 4: only a version-4 stream session carries a
    /// resharded join).
    pub protocol: u16,
}

/// What this daemon says of itself at handshake, and the secret it proves.
#[derive(Debug, Clone)]
pub struct LocalIdentity {
    /// This node's id.
    pub node_id: u32,
    /// This daemon's epoch.
    pub epoch: u32,
    /// Random per start.
    pub instance: u64,
    /// The cluster secret, if the cluster has one.
    pub secret: Option<Secret>,
}

/// Why a pull (or one step of it) failed: the status the reader gets, a message for the log,
/// and whether trying again (on a fresh connection) may help.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct PullError {
    /// What the reader is told.
    pub status: Status,
    /// What the log says.
    pub message: String,
    /// A fresh connection may succeed (a reset, a peer that restarted).
    pub retry: bool,
    /// A record from the peer failed its tag (altered, replayed or forged on the way): asked of
    /// the owner once more, and counted in `peer_frames_rejected`. (An owner's authenticated
    /// `Corrupt` answer, from a relay's own pull, is not this.)
    pub forged: bool,
}

impl PullError {
    /// A failure that retrying will not mend.
    pub fn fatal(status: Status, message: impl Into<String>) -> PullError {
        PullError {
            status,
            message: message.into(),
            retry: false,
            forged: false,
        }
    }
}

/// Why a connection to a peer could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    /// The address is this daemon's own (decided only once the other end proved the secret).
    #[error("the address is this daemon's own")]
    SelfConnection,
    /// The other end broke off the handshake, or sent something else, at a named step.
    #[error("{step}: {cause}")]
    Handshake {
        /// Which step: what this side was waiting for.
        step: &'static str,
        /// What happened instead, in words.
        cause: String,
    },
    /// This side refused the peer.
    #[error("refused the peer: {reason}")]
    Refused {
        /// Why.
        code: VerdictCode,
        /// The reason logged on both sides.
        reason: String,
    },
    /// The peer refused this side.
    #[error("the peer refused this node: {reason}")]
    RefusedBy {
        /// Why.
        code: VerdictCode,
        /// The peer's reason.
        reason: String,
    },
    /// The peer sent something no feedstore daemon sends.
    #[error("not a feedstore peer: {0}")]
    Protocol(String),
    /// No answer in time.
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    /// The socket failed.
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

impl LinkError {
    /// Whether the handshake failed on a decision (secret, node id, version), not the network.
    pub fn is_refusal(&self) -> bool {
        matches!(
            self,
            LinkError::Refused { .. } | LinkError::RefusedBy { .. }
        )
    }
}

impl From<LinkError> for PullError {
    fn from(e: LinkError) -> PullError {
        match e {
            LinkError::Timeout(_) => PullError::fatal(Status::Timeout, e.to_string()),
            LinkError::Io(_) => PullError {
                status: Status::Unreachable,
                message: e.to_string(),
                retry: true,
                forged: false,
            },
            other => PullError::fatal(Status::Unreachable, other.to_string()),
        }
    }
}

/// The owner's answer to a request: where the range lies in its object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RangeHeader {
    /// The uid that wrote the object, as its owner's daemon recorded it.
    pub writer: u32,
    /// The object's whole length.
    pub total: u64,
    /// First byte of the range.
    pub offset: u64,
    /// Bytes in the range.
    pub len: u64,
}

/// Opens channels to peers.
pub trait Transport: Send + Sync + 'static {
    /// One connection to one peer.
    type Channel: Channel;

    /// Connects to the daemon at `addr` and authenticates both ways before `deadline`.
    fn connect(
        &self,
        addr: SocketAddr,
        deadline: Instant,
    ) -> impl Future<Output = Result<Self::Channel, LinkError>> + Send;
}

/// One authenticated connection to one peer, carrying one range at a time.
pub trait Channel: Send + 'static {
    /// Who is at the other end.
    fn peer(&self) -> PeerIdentity;

    /// Asks for up to `len` bytes at `offset` of the peer's object `handle`. The owner holds a
    /// lease on the object from here until the range is received. A refusal by the owner
    /// (`NotFound`, `Stale`, ...) is an error with its status; the channel stays usable.
    fn request(
        &mut self,
        handle: Handle,
        offset: u64,
        len: u64,
        deadline: Instant,
    ) -> impl Future<Output = Result<RangeHeader, PullError>> + Send;

    /// Lands the requested range in `dest` (exactly the range's length) and checks every
    /// record of it; `Corrupt` if one fails (retryable once: the engine asks the owner again on
    /// a fresh connection). After an error the channel must be dropped.
    fn receive(
        &mut self,
        dest: &mut [u8],
        deadline: Instant,
    ) -> impl Future<Output = Result<(), PullError>> + Send;
}

/// Peers over TCP.
#[derive(Debug, Clone)]
pub struct TcpTransport {
    local: LocalIdentity,
}

impl TcpTransport {
    /// A transport that introduces itself as `local`.
    pub fn new(local: LocalIdentity) -> TcpTransport {
        TcpTransport { local }
    }

    /// What this daemon says of itself.
    pub fn local(&self) -> &LocalIdentity {
        &self.local
    }

    /// Opens a stream session to the daemon at `addr`, by `deadline` (the handshake within
    /// its own limit too).
    pub async fn connect_session(
        &self,
        addr: SocketAddr,
        deadline: Instant,
    ) -> Result<(TcpStream, PeerIdentity, Records), LinkError> {
        let deadline = deadline.min(Instant::now() + HANDSHAKE_TIMEOUT);
        let work = async {
            let mut stream = TcpStream::connect(addr).await?;
            tune(&stream);
            let (peer, records) =
                handshake(&mut stream, &self.local, Side::Connector, HELLO_STREAMS).await?;
            Ok((stream, peer, records))
        };
        tokio::time::timeout_at(deadline, work)
            .await
            .map_err(|_| LinkError::Timeout(HANDSHAKE_TIMEOUT))?
    }
}

impl Transport for TcpTransport {
    type Channel = TcpChannel;

    async fn connect(&self, addr: SocketAddr, deadline: Instant) -> Result<TcpChannel, LinkError> {
        let deadline = deadline.min(Instant::now() + HANDSHAKE_TIMEOUT);
        let work = async {
            let mut stream = TcpStream::connect(addr).await?;
            tune(&stream);
            let (peer, records) = handshake(&mut stream, &self.local, Side::Connector, 0).await?;
            Ok(TcpChannel {
                stream,
                peer,
                addr,
                records,
                pending: None,
            })
        };
        tokio::time::timeout_at(deadline, work)
            .await
            .map_err(|_| LinkError::Timeout(HANDSHAKE_TIMEOUT))?
    }
}

/// Low latency for the small messages, keepalives so a vanished peer is noticed on an idle
/// pooled connection.
pub(crate) fn tune(stream: &TcpStream) {
    use nix::sys::socket::{setsockopt, sockopt};
    let _ = stream.set_nodelay(true);
    let _ = setsockopt(stream, sockopt::KeepAlive, &true);
    let _ = setsockopt(stream, sockopt::TcpKeepIdle, &30);
    let _ = setsockopt(stream, sockopt::TcpKeepInterval, &10);
    let _ = setsockopt(stream, sockopt::TcpKeepCount, &3);
    // Sent bytes unacknowledged this long (a peer that stopped reading, a partition) end the
    // connection, and with it the owner's lease.
    let _ = setsockopt(stream, sockopt::TcpUserTimeout, &30_000);
}

/// One TCP connection to a peer.
#[derive(Debug)]
pub struct TcpChannel {
    stream: TcpStream,
    peer: PeerIdentity,
    addr: SocketAddr,
    records: Records,
    /// The range requested and not yet received.
    pending: Option<RangeHeader>,
}

impl TcpChannel {
    fn io_error(&self, what: &str, e: std::io::Error) -> PullError {
        PullError {
            status: Status::Unreachable,
            message: format!(
                "node {:08x} at {}: {what}: {e}",
                self.peer.node_id, self.addr
            ),
            retry: true,
            forged: false,
        }
    }

    fn forged(&self, what: &str) -> PullError {
        PullError {
            status: Status::Corrupt,
            message: format!(
                "node {:08x} at {}: {what}: {Forged}",
                self.peer.node_id, self.addr
            ),
            retry: false,
            forged: true,
        }
    }

    fn timed_out(&self, what: &str) -> PullError {
        PullError::fatal(
            Status::Timeout,
            format!(
                "node {:08x} at {} stalled: {what} did not finish within the pull timeout \
                 (--pull-timeout-ms)",
                self.peer.node_id, self.addr
            ),
        )
    }
}

impl Channel for TcpChannel {
    fn peer(&self) -> PeerIdentity {
        self.peer
    }

    async fn request(
        &mut self,
        handle: Handle,
        offset: u64,
        len: u64,
        deadline: Instant,
    ) -> Result<RangeHeader, PullError> {
        assert!(self.pending.is_none(), "one range at a time per channel");
        let mut request = [0u8; ReadRequest::BYTES + TAG_BYTES];
        let (body, tag) = request.split_at_mut(ReadRequest::BYTES);
        body.copy_from_slice(
            &ReadRequest {
                handle,
                offset,
                len,
            }
            .to_bytes(),
        );
        tag.copy_from_slice(&self.records.sealer.seal(body));
        let mut head = [0u8; ReadReply::BYTES + TAG_BYTES];
        let exchange = async {
            self.stream.write_all(&request).await?;
            self.stream.read_exact(&mut head).await
        };
        match tokio::time::timeout_at(deadline, exchange).await {
            Err(_) => return Err(self.timed_out("a request")),
            Ok(Err(e)) => return Err(self.io_error("request failed", e)),
            Ok(Ok(_)) => {}
        }
        let (head, tag) = head.split_at(ReadReply::BYTES);
        let tag: &Tag = tag.try_into().expect("a tag's bytes");
        if self.records.opener.open(head, tag).is_err() {
            return Err(self.forged(&format!("the reply to a request for {handle}")));
        }
        let head: &[u8; ReadReply::BYTES] = head.try_into().expect("a reply's bytes");
        let reply = ReadReply::from_bytes(head).map_err(|e| {
            PullError::fatal(
                Status::Protocol,
                format!(
                    "node {:08x} at {}: bad reply: {e}",
                    self.peer.node_id, self.addr
                ),
            )
        })?;
        if reply.handle != handle {
            return Err(PullError::fatal(
                Status::Protocol,
                format!(
                    "node {:08x} answered a request for {handle} about {}",
                    self.peer.node_id, reply.handle
                ),
            ));
        }
        if reply.status != Status::Ok {
            return Err(PullError::fatal(
                reply.status,
                format!(
                    "node {:08x} answered {} for {handle}",
                    self.peer.node_id, reply.status
                ),
            ));
        }
        let expected = len.min(reply.total.saturating_sub(offset));
        if reply.offset != offset || reply.len != expected {
            return Err(PullError::fatal(
                Status::Protocol,
                format!(
                    "node {:08x} sent bytes {}..+{} of {handle}, not {offset}..+{expected}",
                    self.peer.node_id, reply.offset, reply.len
                ),
            ));
        }
        let header = RangeHeader {
            writer: reply.writer,
            total: reply.total,
            offset: reply.offset,
            len: reply.len,
        };
        self.pending = Some(header);
        Ok(header)
    }

    async fn receive(&mut self, dest: &mut [u8], deadline: Instant) -> Result<(), PullError> {
        let header = self.pending.take().expect("receive follows a request");
        assert_eq!(
            dest.len() as u64,
            header.len,
            "the destination fits the range"
        );
        let (stream, opener) = (&mut self.stream, &mut self.records.opener);
        let body = async {
            // Straight from the socket into the reservation, each record checked as it lands,
            // while it is still in cache.
            for (i, piece) in dest.chunks_mut(PIECE_BYTES).enumerate() {
                stream.read_exact(piece).await?;
                let mut tag: Tag = [0; TAG_BYTES];
                stream.read_exact(&mut tag).await?;
                if opener.open(piece, &tag).is_err() {
                    return Ok(Some(i));
                }
            }
            Ok::<_, std::io::Error>(None)
        };
        match tokio::time::timeout_at(deadline, body).await {
            Err(_) => Err(self.timed_out("a transfer")),
            Ok(Err(e)) => Err(self.io_error("transfer broke off", e)),
            Ok(Ok(Some(piece))) => {
                let at = header.offset + (piece * PIECE_BYTES) as u64;
                Err(self.forged(&format!("bytes from {at} of a range of {}", header.len)))
            }
            Ok(Ok(None)) => Ok(()),
        }
    }
}

/// Writes `record` and its tag in one `writev`, where the socket takes both at once (with
/// `TCP_NODELAY`, a tag written on its own would be a packet of its own).
pub(crate) async fn write_record<W: AsyncWrite + Unpin>(
    stream: &mut W,
    sealer: &mut Sealer,
    record: &[u8],
) -> std::io::Result<()> {
    let tag = sealer.seal(record);
    let (mut body, mut tail): (&[u8], &[u8]) = (record, &tag);
    while !body.is_empty() {
        let n = stream
            .write_vectored(&[std::io::IoSlice::new(body), std::io::IoSlice::new(tail)])
            .await?;
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        if n >= body.len() {
            tail = &tail[n - body.len()..];
            body = &[];
        } else {
            body = &body[n..];
        }
    }
    stream.write_all(tail).await
}

/// The symmetric handshake (see [`feedstore_proto::peer`]): hellos, proofs, verdicts. Returns
/// the peer's identity and the connection's record layer once both sides accepted. A failure
/// says at which step and why, in words an operator can act on.
pub(crate) async fn handshake<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    local: &LocalIdentity,
    side: Side,
    purpose: u16,
) -> Result<(PeerIdentity, Records), LinkError> {
    let mine = PeerHello {
        version: PEER_VERSION,
        oldest: PEER_OLDEST_VERSION,
        reserved: 0,
        flags: purpose
            | if local.secret.is_some() {
                HELLO_SECRET
            } else {
                0
            },
        node_id: local.node_id,
        epoch: local.epoch,
        instance: local.instance,
        nonce: random_bytes(),
    };
    stream
        .write_all(&mine.to_bytes())
        .await
        .map_err(broke_off("sending this daemon's hello"))?;
    let mut raw = [0u8; PeerHello::BYTES];
    stream
        .read_exact(&mut raw)
        .await
        .map_err(broke_off("waiting for the peer's hello"))?;
    let theirs = PeerHello::from_bytes(&raw).map_err(|e| LinkError::Handshake {
        step: "reading the peer's hello",
        cause: e.to_string(),
    })?;
    let (connector, acceptor) = match side {
        Side::Connector => (&mine, &theirs),
        Side::Acceptor => (&theirs, &mine),
    };
    let proof = local
        .secret
        .as_ref()
        .map_or([0u8; PROOF_BYTES], |s| s.prove(side, connector, acceptor));
    stream
        .write_all(&proof)
        .await
        .map_err(broke_off("sending this daemon's proof"))?;
    let mut their_proof = [0u8; PROOF_BYTES];
    stream
        .read_exact(&mut their_proof)
        .await
        .map_err(broke_off(
            "waiting for the peer's proof of the cluster secret",
        ))?;

    let (code, reason) = judge(local, &mine, &theirs, |secret| {
        secret.verify(side.other(), connector, acceptor, &their_proof)
    });
    let (their_code, their_reason) = exchange_verdicts(stream, code, &reason).await?;
    // Only this side's own judgement makes a connection this daemon's own: the other side's
    // verdict is not authenticated, so a stranger saying "you reached yourself" is just a
    // refusal.
    match (code, their_code) {
        (VerdictCode::SelfConnection, _) => Err(LinkError::SelfConnection),
        (VerdictCode::Accepted, VerdictCode::Accepted) => Ok((
            PeerIdentity {
                node_id: theirs.node_id,
                epoch: theirs.epoch,
                instance: theirs.instance,
                streams: side == Side::Acceptor && theirs.flags & HELLO_STREAMS != 0,
                protocol: agreed(&mine, &theirs),
            },
            Records::new(local.secret.as_ref(), side, connector, acceptor),
        )),
        (VerdictCode::Accepted, code) => Err(LinkError::RefusedBy {
            code,
            reason: their_reason,
        }),
        (code, _) => Err(LinkError::Refused { code, reason }),
    }
}

/// The peer protocol version of an accepted handshake. Versions 3 and 4 read the same but for
/// a stream session's resharded join, which only a session of version 4 sends.
fn agreed(mine: &PeerHello, theirs: &PeerHello) -> u16 {
    mine.agreed_version(theirs)
        .expect("an accepted handshake has a common version")
}

/// Sends this side's verdict on the handshake and reads the peer's: its code and reason.
async fn exchange_verdicts<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    code: VerdictCode,
    reason: &str,
) -> Result<(VerdictCode, String), LinkError> {
    stream
        .write_all(
            &Verdict {
                code,
                reason: reason.to_owned(),
            }
            .to_bytes(),
        )
        .await
        .map_err(broke_off("sending this daemon's verdict"))?;
    let mut head = [0u8; Verdict::HEAD_BYTES];
    stream
        .read_exact(&mut head)
        .await
        .map_err(broke_off("waiting for the peer's verdict"))?;
    let (their_code, len) = Verdict::parse_head(&head).map_err(|e| LinkError::Handshake {
        step: "reading the peer's verdict",
        cause: e.to_string(),
    })?;
    let mut their_reason = vec![0u8; len];
    stream
        .read_exact(&mut their_reason)
        .await
        .map_err(broke_off("reading the peer's verdict"))?;
    let their_reason = String::from_utf8_lossy(&their_reason).into_owned();
    Ok((their_code, their_reason))
}

/// Maps an I/O error at a handshake step to what it means.
fn broke_off(step: &'static str) -> impl Fn(std::io::Error) -> LinkError {
    move |e| {
        let cause = match e.kind() {
            std::io::ErrorKind::UnexpectedEof => {
                "the connection was closed (the other end is not a feedstore daemon, runs \
                 another version that gave up, or refused this one: see its log)"
                    .to_string()
            }
            std::io::ErrorKind::ConnectionReset => "the connection was reset".to_string(),
            _ => e.to_string(),
        };
        LinkError::Handshake { step, cause }
    }
}

/// This side's decision on the peer's hello and proof. Whether the peer is this very daemon
/// (its own address in a peer list) is decided only after the proof verified: a stranger that
/// echoes this daemon's instance id is refused like any stranger, not taken for itself.
fn judge(
    local: &LocalIdentity,
    mine: &PeerHello,
    theirs: &PeerHello,
    proof_ok: impl FnOnce(&Secret) -> bool,
) -> (VerdictCode, String) {
    if mine.agreed_version(theirs).is_none() {
        return (
            VerdictCode::Version,
            format!(
                "no common peer protocol: node {:08x} speaks {}, node {:08x} speaks {} \
                 (adjacent releases share one; upgrade the older node{})",
                local.node_id,
                mine.describe_versions(),
                theirs.node_id,
                theirs.describe_versions(),
                if theirs.version < PEER_OLDEST_VERSION {
                    ", which predates authenticated pulls"
                } else {
                    ""
                }
            ),
        );
    }
    let they_have_secret = theirs.flags & HELLO_SECRET != 0;
    match (&local.secret, they_have_secret) {
        (Some(_), false) | (None, true) => {
            let (with, without) = if they_have_secret {
                (theirs.node_id, local.node_id)
            } else {
                (local.node_id, theirs.node_id)
            };
            return (
                VerdictCode::SecretMismatch,
                format!(
                    "node {with:08x} has a cluster secret and node {without:08x} has none \
                     (--cluster-secret-file)"
                ),
            );
        }
        (Some(secret), true) if !proof_ok(secret) => {
            return (
                VerdictCode::BadProof,
                format!(
                    "node {:08x} did not prove the cluster secret of node {:08x}: the secrets \
                     differ",
                    theirs.node_id, local.node_id
                ),
            );
        }
        _ => {}
    }
    if theirs.instance == local.instance {
        return (VerdictCode::SelfConnection, String::new());
    }
    if theirs.node_id == local.node_id {
        return (
            VerdictCode::NodeIdClash,
            format!(
                "two daemons have node id {:08x}; give each node its own --node-id",
                local.node_id
            ),
        );
    }
    (VerdictCode::Accepted, String::new())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn local(node_id: u32, secret: Option<&[u8]>) -> LocalIdentity {
        LocalIdentity {
            node_id,
            epoch: 7,
            instance: u64::from(node_id) << 8,
            secret: secret.map(|s| Secret::from_bytes(s.to_vec()).unwrap()),
        }
    }

    /// Runs both sides of a handshake over a real socket pair.
    fn shake(
        a: LocalIdentity,
        b: LocalIdentity,
    ) -> (
        Result<PeerIdentity, LinkError>,
        Result<PeerIdentity, LinkError>,
    ) {
        let (x, y) = shake_records(a, b);
        (x.map(|(p, _)| p), y.map(|(p, _)| p))
    }

    type Shaken = Result<(PeerIdentity, Records), LinkError>;

    /// `talk` run on a runtime of its own with both ends of a fresh socket pair.
    fn on_a_socket_pair<Talk, Done>(talk: Talk) -> Done::Output
    where
        Talk: FnOnce(tokio::net::UnixStream, tokio::net::UnixStream) -> Done,
        Done: std::future::Future,
    {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let (x, y) = tokio::net::UnixStream::pair().unwrap();
            talk(x, y).await
        })
    }

    /// Both sides of a handshake, with their record layers.
    fn shake_records(a: LocalIdentity, b: LocalIdentity) -> (Shaken, Shaken) {
        on_a_socket_pair(|mut x, mut y| async move {
            tokio::join!(
                handshake(&mut x, &a, Side::Connector, 0),
                handshake(&mut y, &b, Side::Acceptor, 0)
            )
        })
    }

    /// A daemon of another release, as its bytes reach this one: a peer that says hello
    /// speaking `oldest..=version` (no secret) and accepts whatever comes. Returns this
    /// daemon's result and the verdict it sent that peer.
    fn shake_with_release(oldest: u16, version: u16) -> (Result<PeerIdentity, LinkError>, Verdict) {
        on_a_socket_pair(|mut x, mut y| async move {
            let other = async move {
                let hello = PeerHello {
                    version,
                    oldest,
                    reserved: 0,
                    flags: 0,
                    node_id: 9,
                    epoch: 1,
                    instance: 9 << 8,
                    nonce: [7; 32],
                };
                y.write_all(&hello.to_bytes()).await.unwrap();
                let mut theirs = [0u8; PeerHello::BYTES + PROOF_BYTES];
                y.read_exact(&mut theirs).await.unwrap();
                y.write_all(&[0u8; PROOF_BYTES]).await.unwrap();
                let accept = Verdict {
                    code: VerdictCode::Accepted,
                    reason: String::new(),
                };
                y.write_all(&accept.to_bytes()).await.unwrap();
                let mut head = [0u8; Verdict::HEAD_BYTES];
                y.read_exact(&mut head).await.unwrap();
                let (code, len) = Verdict::parse_head(&head).unwrap();
                let mut reason = vec![0u8; len];
                y.read_exact(&mut reason).await.unwrap();
                Verdict {
                    code,
                    reason: String::from_utf8(reason).unwrap(),
                }
            };
            let me = local(1, None);
            let (ours, sent) = tokio::join!(handshake(&mut x, &me, Side::Acceptor, 0), other);
            (ours.map(|(peer, _)| peer), sent)
        })
    }

    #[test]
    fn a_peer_of_an_adjacent_release_is_spoken_to_in_the_version_both_speak() {
        // The next release, still speaking this one's version: accepted.
        let (ours, sent) = shake_with_release(PEER_VERSION, PEER_VERSION + 1);
        let peer = ours.unwrap();
        assert_eq!((peer.node_id, peer.protocol), (9, PEER_VERSION));
        assert_eq!(sent.code, VerdictCode::Accepted);
        // One that speaks only newer versions: refused, both ranges named.
        let (ours, sent) = shake_with_release(PEER_VERSION + 1, PEER_VERSION + 2);
        assert_eq!(sent.code, VerdictCode::Version);
        let ours = ours.unwrap_err().to_string();
        assert!(
            ours.contains(&format!("speaks {}-{}", PEER_VERSION + 1, PEER_VERSION + 2)),
            "{ours}"
        );
        assert_eq!(
            sent.reason,
            ours.split_once(": ").map_or("", |(_, r)| r),
            "{ours}"
        );
        // 0.1.0 (version 2, unauthenticated records): refused, saying why.
        let (ours, sent) = shake_with_release(0, 2);
        assert_eq!(sent.code, VerdictCode::Version);
        assert!(sent.reason.contains("speaks 2"), "{}", sent.reason);
        assert!(
            sent.reason.contains("predates authenticated pulls"),
            "{}",
            sent.reason
        );
        assert!(ours.is_err());
    }

    const S1: &[u8] = b"first-cluster-secret";
    const S2: &[u8] = b"other-cluster-secret";

    #[test]
    fn matching_secrets_shake_hands() {
        let (a, b) = shake(local(1, Some(S1)), local(2, Some(S1)));
        assert_eq!(a.unwrap().node_id, 2);
        assert_eq!(b.unwrap().node_id, 1);
    }

    #[test]
    fn refusals_carry_their_reason_to_both_sides() {
        let reason = |r: Result<PeerIdentity, LinkError>| r.unwrap_err().to_string();
        let (a, b) = shake(local(1, Some(S1)), local(2, Some(S2)));
        assert!(reason(a).contains("secrets differ"));
        assert!(reason(b).contains("secrets differ"));
        let (a, b) = shake(local(1, None), local(2, Some(S1)));
        assert!(reason(a).contains("has none"));
        assert!(reason(b).contains("has none"));
        let (a, b) = shake(
            local(3, Some(S1)),
            LocalIdentity {
                instance: 99,
                ..local(3, Some(S1))
            },
        );
        assert!(reason(a).contains("--node-id"));
        assert!(reason(b).contains("--node-id"));
        let (a, b) = shake(local(4, None), local(4, None));
        assert!(matches!(a, Err(LinkError::SelfConnection)));
        assert!(matches!(b, Err(LinkError::SelfConnection)));
    }

    #[test]
    fn a_handshake_keys_both_directions_of_its_connection() {
        let (a, b) = shake_records(local(1, Some(S1)), local(2, Some(S1)));
        let ((_, mut a), (_, mut b)) = (a.unwrap(), b.unwrap());
        let tag = a.sealer.seal(b"request");
        assert!(b.opener.open(b"request", &tag).is_ok());
        let tag = b.sealer.seal(b"reply");
        assert!(a.opener.open(b"reply", &tag).is_ok());
        // Another connection between the same two daemons has other keys.
        let (c, _) = shake_records(local(1, Some(S1)), local(2, Some(S1)));
        let (_, mut c) = c.unwrap();
        let tag = c.sealer.seal(b"request");
        assert!(b.opener.open(b"request", &tag).is_err());
    }

    /// A stranger without the secret that echoes this daemon's instance id is refused for its
    /// proof; only a peer that proved the secret can be taken for this daemon itself.
    #[test]
    fn only_a_proven_peer_can_be_this_daemon_itself() {
        let me = local(5, Some(S1));
        let impostor = LocalIdentity {
            node_id: 6,
            secret: Some(Secret::from_bytes(S2.to_vec()).unwrap()),
            ..me.clone()
        };
        let (a, b) = shake(me.clone(), impostor);
        for r in [a, b] {
            let e = r.unwrap_err();
            assert!(!matches!(e, LinkError::SelfConnection), "{e}");
            assert!(e.to_string().contains("secrets differ"), "{e}");
        }
        let (a, _) = shake(me.clone(), me);
        assert!(matches!(a, Err(LinkError::SelfConnection)));
    }

    #[test]
    fn a_handshake_cut_short_says_where() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let err = rt.block_on(async {
            let (mut x, y) = tokio::net::UnixStream::pair().unwrap();
            drop(y);
            handshake(&mut x, &local(1, Some(S1)), Side::Connector, 0)
                .await
                .unwrap_err()
        });
        let text = err.to_string();
        assert!(
            text.contains("hello") && text.contains("closed") || text.contains("sending"),
            "{text}"
        );
    }
}
