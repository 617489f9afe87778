//! Wire status codes.

use std::fmt;

/// Outcome of one operation as the daemon reports it. `Ok` is zero; everything else names a
/// condition the caller can act on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u16)]
#[non_exhaustive]
pub enum Status {
    /// Success.
    Ok = 0,
    /// No live object has this handle (never existed, deleted or evicted).
    NotFound = 1,
    /// The handle's slot was reused, or it comes from an earlier run of the daemon.
    Stale = 2,
    /// The object exists but its writer has not sealed it yet; it is not visible.
    NotSealed = 3,
    /// No room even after evicting every evictable object, within the create timeout.
    Full = 4,
    /// The connection's role or uid does not allow this.
    PermissionDenied = 5,
    /// The object is being written by another client.
    NotOwner = 6,
    /// The operation does not apply to the object's state (sealing a sealed object, say).
    InvalidState = 7,
    /// The object is larger than any segment could ever hold.
    TooLarge = 8,
    /// An argument is out of range (a zero-byte object, an empty batch).
    InvalidArgument = 9,
    /// The daemon is shutting down.
    ShuttingDown = 10,
    /// The peer broke the protocol.
    Protocol = 11,
    /// The handle names another node, and this daemon has no peers to pull it from (it runs
    /// without `--peers`).
    WrongNode = 12,
    /// A wait ran out of time.
    Timeout = 13,
    /// The stream has no more work or samples (its last epoch is done, or it was closed).
    Ended = 14,
    /// The stream exists with another spec (record count, seed, world, shuffle, tail, epochs).
    SpecMismatch = 15,
    /// A limit the daemon's operator set was reached (connections per uid, streams, ring
    /// memory, leases, queued requests); the message names the setting.
    LimitReached = 16,
    /// The handle names another node that could not be reached: no peer has its node id, or
    /// its daemon refused, reset or went away during the transfer (the message or the daemon's
    /// log says which).
    Unreachable = 17,
    /// A pulled object's bytes failed their authentication (altered, replayed or forged on the
    /// way), twice: nothing was sealed.
    Corrupt = 18,
    /// Taken already: the stream rank has a consumer (one per rank: another process reads it,
    /// or a dead one's connection is not closed yet), or the cache key names another sample.
    InUse = 19,
    /// A get by a uid allowed only to read, whose leases with this object would exceed its
    /// share of the store (`--reader-lease-percent`).
    OverShare = 20,
}

impl Status {
    /// Decodes a wire code; unknown codes (from a newer peer) become `None`.
    pub fn from_u16(v: u16) -> Option<Status> {
        use Status::*;
        Some(match v {
            0 => Ok,
            1 => NotFound,
            2 => Stale,
            3 => NotSealed,
            4 => Full,
            5 => PermissionDenied,
            6 => NotOwner,
            7 => InvalidState,
            8 => TooLarge,
            9 => InvalidArgument,
            10 => ShuttingDown,
            11 => Protocol,
            12 => WrongNode,
            13 => Timeout,
            14 => Ended,
            15 => SpecMismatch,
            16 => LimitReached,
            17 => Unreachable,
            18 => Corrupt,
            19 => InUse,
            20 => OverShare,
            _ => return None,
        })
    }

    /// A short human description.
    pub fn describe(self) -> &'static str {
        match self {
            Status::Ok => "ok",
            Status::NotFound => "no such object",
            Status::Stale => "stale handle (slot reused or daemon restarted)",
            Status::NotSealed => "object not sealed yet",
            Status::Full => "store full",
            Status::PermissionDenied => "permission denied",
            Status::NotOwner => "object is being written by another client",
            Status::InvalidState => "operation does not apply in the object's state",
            Status::TooLarge => "object larger than any segment",
            Status::InvalidArgument => "invalid argument",
            Status::ShuttingDown => "daemon shutting down",
            Status::Protocol => "protocol violation",
            Status::WrongNode => "handle belongs to another node",
            Status::Timeout => "timed out",
            Status::Ended => "stream ended",
            Status::SpecMismatch => "the stream exists with a different spec",
            Status::LimitReached => "a configured limit was reached",
            Status::Unreachable => "the owning node could not be reached",
            Status::Corrupt => "pulled bytes failed their authentication",
            Status::InUse => "already taken (a stream rank's consumer, a cache key's sample)",
            Status::OverShare => "over this reader uid's share of the store",
        }
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.describe())
    }
}
