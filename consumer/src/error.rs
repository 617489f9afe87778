//! The client's error type.

use std::io;
use std::path::PathBuf;

use feedstore_proto::frame::DecodeError;
use feedstore_proto::{Handle, Status};
use feedstore_shm::ShmError;

/// Everything a client operation can fail with. Each variant names a condition the caller can act
/// on: retry later (`Full`, `NotSealed`), reconnect (`Disconnected`), drop the handle
/// (`NotFound`, `Stale`), or fix the program (`PermissionDenied`, `InvalidArgument`).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// No daemon answers on the socket (or its directory is closed to this user).
    #[error(
        "cannot connect to feedstored at {path}: {source}{}",
        connect_hint(source)
    )]
    Connect {
        /// The socket path tried.
        path: PathBuf,
        /// Why.
        source: io::Error,
    },
    /// The socket is served by a process of a uid this client does not trust: not root, not
    /// its own, not the configured daemon uid. Nothing was sent to it.
    #[error(
        "refusing {path}: it is served by uid {uid}, not by a trusted feedstored (uids {trusted:?}); \
         set FEEDSTORE_DAEMON_UID={uid} if that daemon is yours"
    )]
    UntrustedDaemon {
        /// The socket path.
        path: PathBuf,
        /// The uid serving it.
        uid: u32,
        /// The uids trusted.
        trusted: Vec<u32>,
    },
    /// The daemon and this client share no protocol version: one of them must be upgraded.
    /// Nothing was done.
    #[error(
        "feedstored speaks protocol {daemon}, this client {}-{client}: upgrade {} so that both \
         speak a version in common{}",
        feedstore_proto::frame::MIN_VERSION,
        if daemon > client { "this client" } else { "feedstored" },
        if detail.is_empty() { String::new() } else { format!(" (the daemon says: {detail})") }
    )]
    VersionMismatch {
        /// The daemon's protocol version.
        daemon: u16,
        /// This client's newest ([`feedstore_proto::frame::VERSION`]).
        client: u16,
        /// What the daemon said, if its reply could be read.
        detail: String,
    },
    /// The daemon went away (stopped, restarted or crashed). Reconnect with a new [`Client`];
    /// handles from before a restart are stale.
    ///
    /// [`Client`]: crate::Client
    #[error("disconnected from feedstored (it stopped, restarted or was taken over)")]
    Disconnected {
        /// The socket error, if there was one (none for a clean end of stream).
        #[source]
        source: Option<io::Error>,
    },
    /// No live object has this handle.
    #[error("object {handle} not found")]
    NotFound {
        /// The handle asked for.
        handle: Handle,
    },
    /// The handle's slot was reused or it predates a daemon restart.
    #[error("stale handle {handle}")]
    Stale {
        /// The handle asked for.
        handle: Handle,
    },
    /// The object exists but is not sealed yet.
    #[error("object {handle} is not sealed yet")]
    NotSealed {
        /// The handle asked for.
        handle: Handle,
    },
    /// The handle belongs to another node and this node's daemon has no peers to pull it from
    /// (it runs without `--peers`).
    #[error(
        "object {handle} belongs to node {:08x}, and this node's feedstored has no peers to pull it from (start it with --listen and --peers)",
        handle.node_id
    )]
    WrongNode {
        /// The handle asked for.
        handle: Handle,
    },
    /// The handle belongs to another node that could not be reached: no peer has its node id,
    /// or its daemon refused, reset or went away during the transfer (this node's feedstored
    /// logs which). Retrying may help once the node is back.
    #[error("{}", unreachable_text(handle, reason))]
    Unreachable {
        /// The handle asked for (zero when no object was: a stream's rank on another node).
        handle: Handle,
        /// The daemon's reason, when it gave one.
        reason: String,
    },
    /// An object pulled from its owning node failed its authentication on the way, twice
    /// (altered, replayed or forged bytes: an attacker or a broken link between the nodes);
    /// nothing was handed out.
    #[error(
        "object {handle} from node {:08x} failed its authentication on the way, twice (altered, \
         replayed or forged between the nodes; this node's feedstored log says more)",
        handle.node_id
    )]
    Corrupt {
        /// The handle asked for.
        handle: Handle,
    },
    /// No room for the object within the create timeout: every remaining object is leased,
    /// pinned or being written.
    #[error("store full: no room for {size_bytes} bytes within the timeout")]
    Full {
        /// The object size asked for.
        size_bytes: u64,
    },
    /// The object can never fit: it is larger than a segment. Retrying will not help (unlike
    /// [`Error::Full`]).
    #[error(
        "object of {size_bytes} bytes is larger than any segment: start feedstored with a \
         larger --segment-size (and --capacity), or make the object smaller (a smaller batch \
         or --image-size)"
    )]
    TooLarge {
        /// The object size asked for.
        size_bytes: u64,
    },
    /// A limit the daemon's operator set was reached; the message names the setting.
    #[error("limit reached: {0}")]
    LimitReached(String),
    /// A request could not be encoded within the daemon's frame limit (nothing was sent).
    #[error("request too large")]
    Encode(#[from] feedstore_proto::frame::EncodeError),
    /// The caller's interrupt check ended a wait (a signal in an embedding).
    #[error("interrupted")]
    Interrupted,
    /// The client was made before this process was forked from its parent: its connection and
    /// leases belong to the parent. Connect again in this process. (Views inherited across the
    /// fork stay readable only while the parent holds them.)
    #[error("this client belongs to the process it was made in, before a fork; connect again here")]
    Forked,
    /// This connection may not do that (a reader creating, a uid not on the allow-list).
    #[error("permission denied: {reason}")]
    PermissionDenied {
        /// The daemon's explanation.
        reason: String,
    },
    /// The object is being written by another client.
    #[error("object {handle} is being written by another client")]
    NotOwner {
        /// The handle.
        handle: Handle,
    },
    /// The operation does not apply in the object's state.
    #[error("operation does not apply to object {handle} in its state")]
    InvalidState {
        /// The handle.
        handle: Handle,
    },
    /// The stream rank already has a consumer (in another process, or in one that died and whose
    /// connection the daemon has not closed yet).
    #[error("{0}")]
    RankInUse(String),
    /// An argument is out of range.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The daemon is shutting down.
    #[error("feedstored is shutting down")]
    ShuttingDown,
    /// The daemon's reply could not be understood.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// A reply frame was malformed.
    #[error("malformed reply")]
    Decode(#[from] DecodeError),
    /// Mapping a segment failed.
    #[error("cannot map a shared-memory segment")]
    Map(#[from] ShmError),
    /// A wait ran out of time.
    #[error("timed out: {0}")]
    Timeout(String),
    /// The stream exists on the daemon with another spec, or a saved state belongs to another
    /// stream or rank.
    #[error("stream mismatch: {0}")]
    StreamMismatch(String),
    /// The stream was closed, or its last epoch is done.
    #[error("stream ended")]
    Ended,
    /// No sample could be made for this position: every record of the rank's share that could
    /// stand in for it was rejected. The stream goes on with the next position.
    #[error(
        "no sample for sequence number {seq} (record {record} and every stand-in were rejected)"
    )]
    SampleFailed {
        /// The rank's sequence number.
        seq: u64,
        /// The record it should have come from.
        record: u64,
    },
    /// The consumer holds as many samples as the prefetch depth (and as many again kept past
    /// the window), so the stream cannot move on until some are dropped.
    #[error(
        "holding {held} samples (or views of them) that fill the prefetch window: drop some \
         (.clone() what you keep), or give the stream a larger depth"
    )]
    WindowFull {
        /// Samples held.
        held: u64,
    },
}

/// What to try after a failed connect, by cause.
fn connect_hint(source: &io::Error) -> &'static str {
    match source.kind() {
        io::ErrorKind::NotFound | io::ErrorKind::ConnectionRefused => {
            " (is the daemon running? pass --socket or set FEEDSTORE_SOCKET if it listens elsewhere)"
        }
        io::ErrorKind::PermissionDenied => {
            " (the daemon does not let this user in: see its --socket-group, --allow-uid and \
             --allow-reader-uid)"
        }
        _ => "",
    }
}

fn unreachable_text(handle: &Handle, reason: &str) -> String {
    if *handle == Handle::default() && !reason.is_empty() {
        return reason.to_owned();
    }
    let mut text = format!(
        "object {handle} belongs to node {:08x}, which could not be reached (see this node's \
         feedstored log and `feedstore stat`)",
        handle.node_id
    );
    if !reason.is_empty() {
        text = format!("{text}: {reason}");
    }
    text
}

impl Error {
    /// The error for a per-object status from the daemon.
    pub(crate) fn from_status(
        status: Status,
        handle: Handle,
        size_bytes: u64,
        message: &str,
    ) -> Error {
        match status {
            Status::NotFound => Error::NotFound { handle },
            Status::Stale => Error::Stale { handle },
            Status::NotSealed => Error::NotSealed { handle },
            Status::WrongNode => Error::WrongNode { handle },
            Status::Unreachable => Error::Unreachable {
                handle,
                reason: message.into(),
            },
            Status::Corrupt => Error::Corrupt { handle },
            Status::Full => Error::Full { size_bytes },
            Status::TooLarge => Error::TooLarge { size_bytes },
            Status::PermissionDenied => Error::PermissionDenied {
                reason: if message.is_empty() {
                    "not allowed for this connection".into()
                } else {
                    message.into()
                },
            },
            Status::NotOwner => Error::NotOwner { handle },
            Status::InvalidState => Error::InvalidState { handle },
            Status::InvalidArgument => Error::InvalidArgument(if message.is_empty() {
                "rejected by the daemon".into()
            } else {
                message.into()
            }),
            Status::ShuttingDown => Error::ShuttingDown,
            // A get times out only while pulling from another node.
            Status::Timeout if message.is_empty() => Error::Timeout(format!(
                "object {handle}: its owning node {:08x} did not send it within this node's \
                 pull timeout (feedstored --pull-timeout-ms)",
                handle.node_id
            )),
            Status::Timeout => Error::Timeout(message.into()),
            Status::SpecMismatch => Error::StreamMismatch(message.into()),
            Status::InUse => Error::RankInUse(if message.is_empty() {
                "the stream rank already has a consumer".into()
            } else {
                message.into()
            }),
            Status::Ended => Error::Ended,
            Status::LimitReached if message.is_empty() => Error::LimitReached(
                "this connection holds as many leases as the daemon allows \
                 (--max-leases-per-connection)"
                    .into(),
            ),
            Status::OverShare => Error::LimitReached(format!(
                "object {handle}: this uid, allowed only to read (--allow-reader-uid), may hold \
                 its share of the store leased at once (--reader-lease-percent), and its leases \
                 with this object would exceed it (return some, or ask for a larger share if \
                 the object alone is larger)"
            )),
            Status::LimitReached => Error::LimitReached(message.into()),
            other => Error::Protocol(format!("daemon answered {other}: {message}")),
        }
    }

    /// Whether the connection is gone and a new client is needed.
    pub fn is_disconnected(&self) -> bool {
        matches!(self, Error::Disconnected { .. })
    }
}
