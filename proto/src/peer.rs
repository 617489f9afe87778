//! The daemon-to-daemon protocol: how one node's `feedstored` pulls an object from the node that
//! owns it.
//!
//! Separate from the client protocol ([`crate::frame`]): it runs over TCP between daemons, never
//! between a client and a daemon, and its messages are all fixed-size but one (the verdict's
//! reason), so a receiver reads exactly what it expects and nothing a peer sends can make it
//! buffer more.
//!
//! A connection starts with a symmetric handshake, each side sending the same three messages and
//! reading the other's:
//!
//! 1. [`PeerHello`] (64 bytes): magic, the protocol versions the sender speaks (newest and
//!    oldest), node id, epoch, a random instance id and a random nonce. Its layout is fixed for
//!    every version, so two versions can still tell each other why they part. Both sides use
//!    the newest version both speak ([`PeerHello::agreed_version`]), so daemons of adjacent
//!    releases keep pulling from each other while a cluster is upgraded node by node; version 3
//!    is the first to name a range (before it, the field was reserved and zero: a hello that
//!    names no oldest speaks its version alone).
//! 2. A proof (32 bytes): HMAC-SHA256 of both hellos under the cluster secret, labelled by the
//!    side that sends it (all zeros when the cluster runs without a secret, in tests only).
//! 3. [`Verdict`]: accepted, or refused with a code and a reason the other side logs.
//!
//! From then on every message is a **record**: its bytes, then a [`TAG_BYTES`] tag that
//! authenticates them under a key of the sending direction, derived from the cluster secret and
//! both hellos (so fresh for every connection), and the record's sequence number in that
//! direction (never sent: both sides count). A record altered, forged, replayed from this or
//! another connection, dropped or reordered fails its tag, and the receiver closes the
//! connection before it uses a byte of it. (The tag is GMAC, AES-256-GCM with the record as
//! its associated data, so integrity costs one pass at about the speed of a CRC; the bytes are
//! not encrypted.)
//!
//! Unless the connector's hello set [`HELLO_STREAMS`] (a stream session,
//! [`crate::peer_stream`]), the connecting side sends [`ReadRequest`]s, one at a time, and the
//! listening side answers each with a [`ReadReply`], which names the handle and range it
//! answers; when the status is `Ok`, the range's bytes follow as records of at most
//! [`PIECE_BYTES`] each, landed in place and checked before anything is sealed.

use crate::{Handle, Status};

/// The newest daemon-to-daemon protocol version this crate speaks. Version 3: records
/// authenticated by a per-connection key instead of a CRC-32C per range; a reply names the
/// handle it answers and the uid that wrote the object. Version 4: a stream session's join may
/// carry a resharded spec ([`crate::peer_stream::RESHARDED_SINCE`]); everything else reads as in
/// version 3.
pub const PEER_VERSION: u16 = 4;

/// The oldest peer protocol version this crate speaks; a peer that shares none with this range
/// is refused at handshake. Version 2 (0.1.0) is not spoken: its records carry no
/// authentication, so a node on the path could rewrite what it pulls (docs/SECURITY.md). The
/// next version must keep speaking this one for a release, so that a cluster can be upgraded
/// node by node.
pub const PEER_OLDEST_VERSION: u16 = 3;

/// First bytes of every hello.
pub const PEER_MAGIC: [u8; 8] = *b"FSPEER\r\n";

/// Hello flag: this side has a cluster secret and requires the other to prove it.
pub const HELLO_SECRET: u16 = 1;

/// Hello flag (connector only): this connection carries the stream session
/// ([`crate::peer_stream`]) instead of range reads.
pub const HELLO_STREAMS: u16 = 2;

/// Bytes of a proof (an HMAC-SHA256 tag).
pub const PROOF_BYTES: usize = 32;

/// The longest reason a verdict carries.
pub const MAX_REASON_BYTES: usize = 512;

/// The most bytes one read may ask for; larger objects are pulled in several ranges.
pub const MAX_RANGE_BYTES: u64 = 64 << 20;

/// Bytes of the tag after every record.
pub const TAG_BYTES: usize = 16;

/// The most object bytes one record carries: a range's bytes go as records of this size (the
/// last one shorter), each checked as it arrives, while it is still in cache.
pub const PIECE_BYTES: usize = 256 << 10;

/// Why a peer message could not be parsed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PeerDecodeError {
    /// The magic is not feedstore's: not a feedstore daemon.
    #[error("not a feedstore peer (bad magic {0:02x?})")]
    Magic([u8; 8]),
    /// A field holds a value no sender produces.
    #[error("invalid {field}: {value}")]
    Invalid {
        /// The field.
        field: &'static str,
        /// Its value.
        value: u64,
    },
}

/// The first message each side sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerHello {
    /// The newest protocol version the sender speaks ([`PEER_VERSION`]).
    pub version: u16,
    /// The oldest protocol version the sender speaks ([`PEER_OLDEST_VERSION`]), at most
    /// `version`; 0 names none (hellos of version 2 and older): the sender speaks `version`
    /// alone ([`PeerHello::oldest_version`]).
    pub oldest: u16,
    /// Bytes 22..24, zero from this version on. Every field is kept as it came, so a parsed
    /// hello encodes to the very bytes received, which the handshake's proofs and record keys
    /// cover: a later release may use these bytes without breaking the proofs.
    pub reserved: u16,
    /// [`HELLO_SECRET`] or 0.
    pub flags: u16,
    /// The sender's node id (what its handles carry).
    pub node_id: u32,
    /// The sender's start epoch.
    pub epoch: u32,
    /// Random per daemon start: a daemon that reaches itself (its own address in a peer list or
    /// a DNS answer) recognises its own instance and hangs up quietly.
    pub instance: u64,
    /// Random per connection: makes each proof fresh.
    pub nonce: [u8; 32],
}

impl PeerHello {
    /// Encoded size.
    pub const BYTES: usize = 64;

    /// The wire form.
    pub fn to_bytes(&self) -> [u8; Self::BYTES] {
        let mut b = [0u8; Self::BYTES];
        b[0..8].copy_from_slice(&PEER_MAGIC);
        b[8..10].copy_from_slice(&self.version.to_le_bytes());
        b[10..12].copy_from_slice(&self.flags.to_le_bytes());
        b[12..16].copy_from_slice(&self.node_id.to_le_bytes());
        b[16..20].copy_from_slice(&self.epoch.to_le_bytes());
        b[20..22].copy_from_slice(&self.oldest.to_le_bytes());
        b[22..24].copy_from_slice(&self.reserved.to_le_bytes());
        b[24..32].copy_from_slice(&self.instance.to_le_bytes());
        b[32..64].copy_from_slice(&self.nonce);
        b
    }

    /// Parses a hello of any version (the layout is the same for all).
    pub fn from_bytes(b: &[u8; Self::BYTES]) -> Result<PeerHello, PeerDecodeError> {
        let magic: [u8; 8] = b[0..8].try_into().expect("8 bytes");
        if magic != PEER_MAGIC {
            return Err(PeerDecodeError::Magic(magic));
        }
        let version = u16::from_le_bytes([b[8], b[9]]);
        let oldest = u16::from_le_bytes([b[20], b[21]]);
        if oldest > version {
            return Err(PeerDecodeError::Invalid {
                field: "oldest peer protocol version",
                value: u64::from(oldest),
            });
        }
        Ok(PeerHello {
            version,
            oldest,
            reserved: u16::from_le_bytes([b[22], b[23]]),
            flags: u16::from_le_bytes([b[10], b[11]]),
            node_id: le32(&b[12..16]),
            epoch: le32(&b[16..20]),
            instance: le64(&b[24..32]),
            nonce: b[32..64].try_into().expect("32 bytes"),
        })
    }

    /// The version two daemons speak once they have exchanged `self` and `other`: the newest
    /// both speak, or `None` when their ranges do not meet. Both sides compute the same answer,
    /// and under a cluster secret the proofs cover both hellos, so no one between them can talk
    /// them down.
    pub fn agreed_version(&self, other: &PeerHello) -> Option<u16> {
        let newest = self.version.min(other.version);
        (newest >= self.oldest_version().max(other.oldest_version())).then_some(newest)
    }

    /// The oldest version the sender speaks: `oldest`, or `version` where it names none.
    pub fn oldest_version(&self) -> u16 {
        if self.oldest == 0 {
            self.version
        } else {
            self.oldest
        }
    }

    /// The range it speaks, as a log line names it: `3` or `3-4`.
    pub fn describe_versions(&self) -> String {
        if self.oldest_version() == self.version {
            self.version.to_string()
        } else {
            format!("{}-{}", self.oldest_version(), self.version)
        }
    }
}

/// Why a handshake was refused, as the refusing side reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u16)]
pub enum VerdictCode {
    /// Accepted.
    Accepted = 0,
    /// The protocol versions differ.
    Version = 1,
    /// Both daemons claim the same node id (`--node-id` sets it; namespaces on one host share a
    /// host name, whose hash is the default).
    NodeIdClash = 2,
    /// The proof does not match this side's secret.
    BadProof = 3,
    /// One side has a cluster secret and the other none.
    SecretMismatch = 4,
    /// The connection reached the daemon that opened it.
    SelfConnection = 5,
}

impl VerdictCode {
    fn from_u16(v: u16) -> Option<VerdictCode> {
        use VerdictCode::*;
        Some(match v {
            0 => Accepted,
            1 => Version,
            2 => NodeIdClash,
            3 => BadProof,
            4 => SecretMismatch,
            5 => SelfConnection,
            _ => return None,
        })
    }
}

/// The last handshake message: the sender's decision, with a reason when it refuses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    /// The decision.
    pub code: VerdictCode,
    /// Why, for the other side's log (at most [`MAX_REASON_BYTES`]).
    pub reason: String,
}

impl Verdict {
    /// Bytes before the reason: code and reason length.
    pub const HEAD_BYTES: usize = 4;

    /// The wire form: code, reason length, reason.
    pub fn to_bytes(&self) -> Vec<u8> {
        let reason = crate::truncate(&self.reason, MAX_REASON_BYTES);
        let mut b = Vec::with_capacity(Self::HEAD_BYTES + reason.len());
        b.extend_from_slice(&(self.code as u16).to_le_bytes());
        b.extend_from_slice(&(reason.len() as u16).to_le_bytes());
        b.extend_from_slice(reason.as_bytes());
        b
    }

    /// Parses the head: the code and how many reason bytes follow.
    pub fn parse_head(b: &[u8; Self::HEAD_BYTES]) -> Result<(VerdictCode, usize), PeerDecodeError> {
        let code = u16::from_le_bytes([b[0], b[1]]);
        let len = u16::from_le_bytes([b[2], b[3]]) as usize;
        let code = VerdictCode::from_u16(code).ok_or(PeerDecodeError::Invalid {
            field: "verdict code",
            value: u64::from(code),
        })?;
        if len > MAX_REASON_BYTES {
            return Err(PeerDecodeError::Invalid {
                field: "verdict reason length",
                value: len as u64,
            });
        }
        Ok((code, len))
    }
}

/// Asks the owner for bytes `offset..offset + len` of an object (fewer if it is shorter).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadRequest {
    /// The object, as its owner named it.
    pub handle: Handle,
    /// First byte wanted.
    pub offset: u64,
    /// Bytes wanted, at most [`MAX_RANGE_BYTES`].
    pub len: u64,
}

impl ReadRequest {
    /// Encoded size.
    pub const BYTES: usize = 40;
    const OP_READ: u16 = 1;

    /// The wire form.
    pub fn to_bytes(&self) -> [u8; Self::BYTES] {
        let mut b = [0u8; Self::BYTES];
        b[0..2].copy_from_slice(&Self::OP_READ.to_le_bytes());
        // 2..8 reserved, zero.
        b[8..24].copy_from_slice(&self.handle.to_bytes());
        b[24..32].copy_from_slice(&self.offset.to_le_bytes());
        b[32..40].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    /// Parses a request; refuses an unknown operation and a length over [`MAX_RANGE_BYTES`].
    pub fn from_bytes(b: &[u8; Self::BYTES]) -> Result<ReadRequest, PeerDecodeError> {
        let op = u16::from_le_bytes([b[0], b[1]]);
        if op != Self::OP_READ || b[2..8].iter().any(|&x| x != 0) {
            return Err(PeerDecodeError::Invalid {
                field: "request operation",
                value: u64::from(op),
            });
        }
        let request = ReadRequest {
            handle: Handle::from_bytes(b[8..24].try_into().expect("16 bytes")),
            offset: le64(&b[24..32]),
            len: le64(&b[32..40]),
        };
        if request.len == 0 || request.len > MAX_RANGE_BYTES {
            return Err(PeerDecodeError::Invalid {
                field: "request length",
                value: request.len,
            });
        }
        Ok(request)
    }
}

/// The owner's answer to a [`ReadRequest`]. With `Ok`, `len` bytes follow, as records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadReply {
    /// `Ok`, or why not (`NotFound`, `Stale`, `NotSealed`, `InvalidArgument` for a range past
    /// the end).
    pub status: Status,
    /// The object it answers for, as the request named it.
    pub handle: Handle,
    /// The uid that wrote the object, as its owner's daemon recorded it (0 unless `Ok`).
    pub writer: u32,
    /// The object's whole length (0 unless `Ok`).
    pub total: u64,
    /// First byte sent.
    pub offset: u64,
    /// Bytes sent.
    pub len: u64,
}

impl ReadReply {
    /// Encoded size.
    pub const BYTES: usize = 48;

    /// A refusal of the request for `handle`.
    pub fn refused(handle: Handle, status: Status) -> ReadReply {
        ReadReply {
            status,
            handle,
            writer: 0,
            total: 0,
            offset: 0,
            len: 0,
        }
    }

    /// The wire form.
    pub fn to_bytes(&self) -> [u8; Self::BYTES] {
        let mut b = [0u8; Self::BYTES];
        b[0..2].copy_from_slice(&(self.status as u16).to_le_bytes());
        // 2..4 reserved, zero.
        b[4..8].copy_from_slice(&self.writer.to_le_bytes());
        b[8..16].copy_from_slice(&self.total.to_le_bytes());
        b[16..24].copy_from_slice(&self.offset.to_le_bytes());
        b[24..32].copy_from_slice(&self.len.to_le_bytes());
        b[32..48].copy_from_slice(&self.handle.to_bytes());
        b
    }

    /// Parses a reply; refuses one whose range does not lie inside its object or is larger than
    /// any request may ask.
    pub fn from_bytes(b: &[u8; Self::BYTES]) -> Result<ReadReply, PeerDecodeError> {
        let code = u16::from_le_bytes([b[0], b[1]]);
        let status = Status::from_u16(code).ok_or(PeerDecodeError::Invalid {
            field: "reply status",
            value: u64::from(code),
        })?;
        let reply = ReadReply {
            status,
            handle: Handle::from_bytes(b[32..48].try_into().expect("16 bytes")),
            writer: le32(&b[4..8]),
            total: le64(&b[8..16]),
            offset: le64(&b[16..24]),
            len: le64(&b[24..32]),
        };
        let inside = reply
            .offset
            .checked_add(reply.len)
            .is_some_and(|end| end <= reply.total);
        let empty = reply.writer == 0 && reply.total == 0 && reply.offset == 0;
        if !inside
            || reply.len > MAX_RANGE_BYTES
            || b[2..4] != [0, 0]
            || (status != Status::Ok && (reply.len != 0 || !empty))
        {
            return Err(PeerDecodeError::Invalid {
                field: "reply range",
                value: reply.len,
            });
        }
        Ok(reply)
    }
}

fn le32(b: &[u8]) -> u32 {
    u32::from_le_bytes(b.try_into().expect("4 bytes"))
}

fn le64(b: &[u8]) -> u64 {
    u64::from_le_bytes(b.try_into().expect("8 bytes"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn hello_round_trips(version in 1u16.., oldest: u16, reserved: u16, flags: u16, node_id: u32, epoch: u32, instance: u64, nonce: [u8; 32]) {
            let oldest = oldest % (version + 1);
            let h = PeerHello { version, oldest, reserved, flags, node_id, epoch, instance, nonce };
            prop_assert_eq!(PeerHello::from_bytes(&h.to_bytes()).unwrap(), h);
        }

        /// The proofs and record keys are computed over a parsed hello's encoding: it must be
        /// the bytes that came, whatever they hold.
        #[test]
        fn a_parsed_hello_encodes_to_the_bytes_received(b in proptest::collection::vec(any::<u8>(), 64)) {
            let raw: [u8; 64] = b.try_into().unwrap();
            if let Ok(h) = PeerHello::from_bytes(&raw) {
                prop_assert_eq!(h.to_bytes(), raw);
            }
        }

        #[test]
        fn requests_and_replies_round_trip(node: u32, id: u64, offset in 0u64..1 << 40, len in 1..=MAX_RANGE_BYTES) {
            let handle = Handle { node_id: node, epoch: 1, id };
            let r = ReadRequest { handle, offset, len };
            prop_assert_eq!(ReadRequest::from_bytes(&r.to_bytes()).unwrap(), r);
            let reply = ReadReply { status: Status::Ok, handle, writer: 1000, total: offset + len, offset, len };
            prop_assert_eq!(ReadReply::from_bytes(&reply.to_bytes()).unwrap(), reply);
        }

        #[test]
        fn any_bytes_parse_or_fail_cleanly(b in proptest::collection::vec(any::<u8>(), 64)) {
            let _ = PeerHello::from_bytes(b[..64].try_into().unwrap());
            let _ = ReadRequest::from_bytes(b[..40].try_into().unwrap());
            let _ = ReadReply::from_bytes(b[..48].try_into().unwrap());
            let _ = Verdict::parse_head(b[..4].try_into().unwrap());
        }
    }

    #[test]
    fn lying_lengths_are_refused() {
        let handle = Handle::default();
        let mut r = ReadRequest {
            handle,
            offset: 0,
            len: MAX_RANGE_BYTES + 1,
        }
        .to_bytes();
        assert!(ReadRequest::from_bytes(&r).is_err(), "over the range limit");
        r[32..40].copy_from_slice(&0u64.to_le_bytes());
        assert!(ReadRequest::from_bytes(&r).is_err(), "empty");
        let past_end = ReadReply {
            status: Status::Ok,
            handle,
            writer: 0,
            total: 10,
            offset: 8,
            len: 4,
        };
        assert!(ReadReply::from_bytes(&past_end.to_bytes()).is_err());
        let error_with_bytes = ReadReply {
            status: Status::NotFound,
            handle,
            writer: 0,
            total: 10,
            offset: 0,
            len: 4,
        };
        assert!(ReadReply::from_bytes(&error_with_bytes.to_bytes()).is_err());
        let long = [0u8, 0, 0xff, 0xff];
        assert!(Verdict::parse_head(&long).is_err());
        let mut bad = speaking(1, 1).to_bytes();
        bad[0] = b'X';
        assert!(matches!(
            PeerHello::from_bytes(&bad),
            Err(PeerDecodeError::Magic(_))
        ));
    }

    fn speaking(oldest: u16, version: u16) -> PeerHello {
        PeerHello {
            version,
            oldest,
            reserved: 0,
            flags: 0,
            node_id: 1,
            epoch: 1,
            instance: 1,
            nonce: [0; 32],
        }
    }

    #[test]
    fn two_hellos_agree_on_the_newest_version_both_speak() {
        let ours = speaking(PEER_OLDEST_VERSION, PEER_VERSION);
        assert_eq!(ours.agreed_version(&ours), Some(PEER_VERSION));
        // A newer release that still speaks ours, either side first.
        let next = speaking(PEER_VERSION, PEER_VERSION + 1);
        assert_eq!(ours.agreed_version(&next), Some(PEER_VERSION));
        assert_eq!(next.agreed_version(&ours), Some(PEER_VERSION));
        // One that dropped it, and 0.1.0 (version 2, which names no oldest).
        let later = speaking(PEER_VERSION + 1, PEER_VERSION + 2);
        assert_eq!(ours.agreed_version(&later), None);
        let mut v2 = speaking(0, 0).to_bytes();
        v2[8..10].copy_from_slice(&2u16.to_le_bytes());
        v2[20..22].copy_from_slice(&[0, 0]);
        let v2 = PeerHello::from_bytes(&v2).unwrap();
        assert_eq!((v2.oldest_version(), v2.version), (2, 2));
        assert_eq!(ours.agreed_version(&v2), None);
        assert_eq!(v2.describe_versions(), "2");
        assert_eq!(
            next.describe_versions(),
            format!("{}-{}", PEER_VERSION, PEER_VERSION + 1)
        );
        // An oldest newer than the newest is no hello at all.
        let mut bad = speaking(1, 1).to_bytes();
        bad[20..22].copy_from_slice(&2u16.to_le_bytes());
        assert!(PeerHello::from_bytes(&bad).is_err());
    }

    #[test]
    fn a_verdict_reason_is_bounded() {
        let v = Verdict {
            code: VerdictCode::BadProof,
            reason: "x".repeat(10_000),
        };
        let b = v.to_bytes();
        let (code, len) = Verdict::parse_head(b[..4].try_into().unwrap()).unwrap();
        assert_eq!((code, len), (VerdictCode::BadProof, MAX_REASON_BYTES));
        assert_eq!(b.len(), 4 + MAX_REASON_BYTES);
    }
}
