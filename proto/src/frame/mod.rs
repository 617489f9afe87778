//! Control-socket frames.
//!
//! Every frame is a 16-byte header followed by `payload_len` bytes:
//!
//! | bytes  | field         | value                                                  |
//! |--------|---------------|--------------------------------------------------------|
//! | 0..2   | `magic`       | [`MAGIC`]                                              |
//! | 2..4   | `version`     | the version the connection agreed at hello ([`Speaks`]) |
//! | 4..6   | `opcode`      | an [`Opcode`]; replies set [`REPLY_BIT`]                |
//! | 6..8   | `flags`       | reserved, zero                                         |
//! | 8..12  | `request_id`  | chosen by the client, echoed in the reply              |
//! | 12..16 | `payload_len` | at most the receiver's limit                           |
//!
//! Every request but the one-way ones ([`Request::Release`], [`Request::StreamRelease`],
//! [`Request::ProducerReport`]) gets exactly one reply,
//! in order. Batches are the unit: `Get`, `Seal`, `Delete`, ... carry a list of handles and the
//! reply carries one result each, so a client amortises a round trip over many objects.
//!
//! **Versions are agreed at `Hello`** (from protocol 11 on): the client's hello, in a header
//! of the newest version it speaks, says every version it speaks and its features
//! ([`Speaks`]); the daemon answers in the newest version both speak, saying the same of itself,
//! and both use that version and the features both have from then on. A daemon serves the
//! hellos of older clients too, down to [`MIN_VERSION`] (0.1.0's), speaking their version; a
//! client whose hello a daemon of an older version refuses says hello again in that version.
//!
//! **Frame limits are agreed at `Hello`:** each side says the largest payload it accepts, and
//! every encoder checks the peer's limit before a byte is sent ([`EncodeError::TooLarge`]).
//! A client splits a batch so that both the request and its reply fit ([`max_batch_items`]); a
//! daemon refuses a request whose reply could not fit before acting on it.
//!
//! The message parts live by family, each part's encoding beside its decoding: [`session`]
//! (hello, segments), [`objects`] (create, get, results), [`streams`] (specs, tasks, items,
//! listings), [`stats`]. This module holds the header and the two enums that dispatch to them.

mod objects;
mod session;
mod stats;
mod streams;

pub use objects::{CacheEntry, Created, Got};
pub use session::{FEATURES, NEGOTIATED_SINCE, Speaks, feature};
pub use streams::{
    PRODUCER_STAGES, ProducerFigures, RESHARD_SINCE, RankAt, RankFigures, RankInfo, StreamInfo,
    StreamItem, StreamTask, TakeTasks,
};

use crate::stream::StreamSpec;
pub use crate::wire::DecodeError;
use crate::wire::{Reader, Wire, Writer};
use crate::{Handle, Role, SegmentInfo, Status, StoreStats};

/// First two bytes of every frame.
pub const MAGIC: u16 = 0xFD5E;
/// Protocol version spoken by this crate. Version 2: frame limits agreed at hello, stream
/// detach, paged stream lists, attach without creating. Version 3: cross-node pull statistics
/// and statuses (`Unreachable`, `Corrupt`). Version 4: where a stream's ranks are read
/// (`StreamJoin` `at` and `relay`). Version 5: `InUse`, a rank that already has a consumer.
/// Version 6: consumers report their figures with their returns; stream lists carry them.
/// Version 7: producers report their stage figures; stream lists carry their sum; statistics
/// count consumers waiting for a stream to be created. Version 8: a put item names where its
/// sample starts inside its object (several samples of one batch share an object); a join
/// names the stream's batch size. Version 9: `CacheInsert`, writers file sealed objects in the
/// decode-once cache (a loader's workers share the samples they make). Version 10: handles carry
/// a random 64-bit id instead of slot and generation; a get result and a ring entry name the
/// uid that wrote the object; a daemon answers a hello of another version with an error naming
/// both versions. Version 11: hellos say which versions and features each side speaks
/// ([`Speaks`]), and the connection speaks the newest both do; a daemon serves clients down to
/// [`MIN_VERSION`]. Version 12: a hello says how many times the client connected again after
/// its daemon went away; statistics count such clients (`reconnects`, `reconnected_clients`).
/// Version 13: a stream spec carries its reshard (a stream resumed at another world size).
pub const VERSION: u16 = 13;
/// The release and the protocols it speaks, as `--version` prints them.
pub const LONG_VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (protocols 9-13, peer protocols 3-4)"
);
// (The text names the numbers: a new version fails the build here until it says so too.)
const _: () = assert!(
    MIN_VERSION == 9
        && VERSION == 13
        && crate::peer::PEER_OLDEST_VERSION == 3
        && crate::peer::PEER_VERSION == 4
);

/// The oldest protocol version this crate speaks: 0.1.0's, so that a daemon serves clients of
/// the previous release (and a client reaches its daemon).
pub const MIN_VERSION: u16 = 9;
/// Size of the frame header.
pub const HEADER_BYTES: usize = 16;
/// Default maximum payload a side accepts (room for a batch of ~65k handles).
pub const MAX_PAYLOAD_BYTES: u32 = 1 << 20;
/// The smallest limit a side may announce: every fixed-size message fits well inside it.
pub const MIN_PAYLOAD_BYTES: u32 = 64 << 10;
/// Set in a reply's opcode.
pub const REPLY_BIT: u16 = 0x8000;
/// Create flag: the object is never evicted (it can still be deleted).
pub const CREATE_PIN: u32 = 1;
/// Create flag: a reservation asked for ahead of need (a put pipeline's next object): when the
/// store has no room it is refused without a warning or a count in `creates_full`, since the
/// put that would have used it reserves again, waiting as a put does. (Daemons before this flag
/// ignore it.)
pub const CREATE_AHEAD: u32 = 2;

/// Request kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u16)]
pub enum Opcode {
    /// [`Request::Hello`]
    Hello = 1,
    /// [`Request::Create`]
    Create = 2,
    /// [`Request::Seal`]
    Seal = 3,
    /// [`Request::Abort`]
    Abort = 4,
    /// [`Request::Get`]
    Get = 5,
    /// [`Request::Release`]
    Release = 6,
    /// [`Request::Delete`]
    Delete = 7,
    /// [`Request::Stats`]
    Stats = 8,
    /// [`Request::StreamJoin`]
    StreamJoin = 9,
    /// [`Request::StreamAttach`]
    StreamAttach = 10,
    /// [`Request::StreamTake`]
    StreamTake = 11,
    /// [`Request::StreamPut`]
    StreamPut = 12,
    /// [`Request::StreamRelease`]
    StreamRelease = 13,
    /// [`Request::StreamWait`]
    StreamWait = 14,
    /// [`Request::StreamClose`]
    StreamClose = 15,
    /// [`Request::CacheLookup`]
    CacheLookup = 16,
    /// [`Request::StreamList`]
    StreamList = 17,
    /// [`Request::StreamDetach`]
    StreamDetach = 18,
    /// [`Request::ProducerReport`]
    ProducerReport = 19,
    /// [`Request::CacheInsert`]
    CacheInsert = 20,
    /// [`Request::Takeover`]
    Takeover = 21,
    /// [`Response::Error`] (reply only).
    Error = 0x7FFF,
}

impl Opcode {
    /// Every opcode, for tests and fuzzers that must cover them all.
    pub const ALL: [Opcode; 22] = [
        Opcode::Hello,
        Opcode::Create,
        Opcode::Seal,
        Opcode::Abort,
        Opcode::Get,
        Opcode::Release,
        Opcode::Delete,
        Opcode::Stats,
        Opcode::StreamJoin,
        Opcode::StreamAttach,
        Opcode::StreamTake,
        Opcode::StreamPut,
        Opcode::StreamRelease,
        Opcode::StreamWait,
        Opcode::StreamClose,
        Opcode::CacheLookup,
        Opcode::StreamList,
        Opcode::StreamDetach,
        Opcode::ProducerReport,
        Opcode::CacheInsert,
        Opcode::Takeover,
        Opcode::Error,
    ];

    /// Decodes the opcode field (without [`REPLY_BIT`]).
    pub fn from_u16(v: u16) -> Option<Opcode> {
        Opcode::ALL.into_iter().find(|op| *op as u16 == v)
    }

    /// What a batch of this kind costs on the wire, for the batch kinds.
    pub fn batch_cost(self) -> Option<BatchCost> {
        let (request_fixed, request_per_item, reply_per_item) = match self {
            // timeout, flags, count | a size | handle, status, location
            Opcode::Create => (12, 8, Created::WIRE_BYTES),
            Opcode::Seal | Opcode::Abort | Opcode::Delete => (4, Handle::WIRE_BYTES, 2),
            Opcode::Get => (4, Handle::WIRE_BYTES, objects::GOT_BYTES),
            Opcode::Release => (4, Handle::WIRE_BYTES, 0),
            Opcode::CacheLookup => (4, 16, objects::CACHED_BYTES),
            Opcode::CacheInsert => (4, CacheEntry::WIRE_BYTES, 2),
            // stream, count | an item | a status
            Opcode::StreamPut => (8, StreamItem::WIRE_BYTES, 2),
            _ => return None,
        };
        Some(BatchCost {
            request_fixed,
            request_per_item,
            reply_fixed: 4,
            reply_per_item,
        })
    }
}

/// The bytes a batch request and its reply take: a fixed part and a part per item.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchCost {
    /// Request payload bytes besides the items.
    pub request_fixed: usize,
    /// Request payload bytes per item.
    pub request_per_item: usize,
    /// Reply payload bytes besides the items.
    pub reply_fixed: usize,
    /// Reply payload bytes per item (0: no reply).
    pub reply_per_item: usize,
}

impl BatchCost {
    /// The reply's payload for `n` items.
    pub fn reply_bytes(&self, n: usize) -> usize {
        self.reply_fixed + n.saturating_mul(self.reply_per_item)
    }
}

/// The most items one batch of `op` may carry so that the request fits the daemon's limit and
/// its reply fits the client's. At least 1 for the limits hello allows.
pub fn max_batch_items(op: Opcode, request_limit: u32, reply_limit: u32) -> usize {
    let Some(cost) = op.batch_cost() else {
        return 1;
    };
    let by_request =
        (request_limit as usize).saturating_sub(cost.request_fixed) / cost.request_per_item;
    let by_reply = match cost.reply_per_item {
        0 => usize::MAX,
        per => (reply_limit as usize).saturating_sub(cost.reply_fixed) / per,
    };
    by_request.min(by_reply).max(1)
}

/// Why a message was not encoded. Nothing was sent; the caller can split the batch or report
/// the error, and the connection stays usable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EncodeError {
    /// The payload would exceed the limit the peer announced at hello.
    #[error("a {opcode:?} frame of {len} bytes exceeds the peer's limit of {max} bytes")]
    TooLarge {
        /// The message kind.
        opcode: Opcode,
        /// Its payload length.
        len: usize,
        /// The peer's limit.
        max: u32,
    },
}

/// A parsed frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// The protocol version the frame is in.
    pub version: u16,
    /// The raw opcode, [`REPLY_BIT`] included.
    pub opcode: u16,
    /// Echoed from the request.
    pub request_id: u32,
    /// Bytes following the header.
    pub payload_len: u32,
}

impl Header {
    /// Parses and checks a header against the receiver's maximum payload. Any version from
    /// [`MIN_VERSION`] on parses (a hello comes before the versions are agreed, perhaps from a
    /// newer client); each side checks that later frames are in the version agreed.
    pub fn parse(b: &[u8; HEADER_BYTES], max_payload: u32) -> Result<Header, DecodeError> {
        let mut r = Reader::new(b);
        let magic = r.u16()?;
        if magic != MAGIC {
            return Err(DecodeError::BadMagic { found: magic });
        }
        let version = r.u16()?;
        if version < MIN_VERSION {
            return Err(DecodeError::UnsupportedVersion {
                found: version,
                expected: VERSION,
            });
        }
        let opcode = r.u16()?;
        let flags = r.u16()?;
        if flags != 0 {
            return Err(DecodeError::ReservedFlags { found: flags });
        }
        let request_id = r.u32()?;
        let payload_len = r.u32()?;
        if payload_len > max_payload {
            return Err(DecodeError::Oversized {
                len: payload_len,
                max: max_payload,
            });
        }
        Ok(Header {
            version,
            opcode,
            request_id,
            payload_len,
        })
    }

    /// Total frame length, header included.
    pub fn frame_len(&self) -> usize {
        HEADER_BYTES + self.payload_len as usize
    }
}

/// A whole frame borrowed from a receive buffer.
#[derive(Debug, Clone, Copy)]
pub struct Frame<'a> {
    /// The checked header.
    pub header: Header,
    /// Exactly `header.payload_len` bytes.
    pub payload: &'a [u8],
}

impl<'a> Frame<'a> {
    /// Parses one frame from the front of `buf`: `Ok(None)` when more bytes are needed, an error
    /// as soon as the header is known to be bad (before waiting for an oversized payload).
    pub fn parse(buf: &'a [u8], max_payload: u32) -> Result<Option<Frame<'a>>, DecodeError> {
        let Some(head) = buf.first_chunk::<HEADER_BYTES>() else {
            return Ok(None);
        };
        let header = Header::parse(head, max_payload)?;
        let end = header.frame_len();
        if buf.len() < end {
            return Ok(None);
        }
        Ok(Some(Frame {
            header,
            payload: &buf[HEADER_BYTES..end],
        }))
    }

    /// Bytes this frame occupies in the buffer.
    pub fn len(&self) -> usize {
        self.header.frame_len()
    }

    /// Whether the frame is empty; never, as the header counts.
    pub fn is_empty(&self) -> bool {
        false
    }
}

/// Writes a header with a zero length, then the payload `body` writes, then patches the length.
/// On a payload over `max_payload` the output is left as it was and nothing is sent.
fn framed(
    out: &mut Vec<u8>,
    version: u16,
    opcode: Opcode,
    reply: bool,
    request_id: u32,
    max_payload: u32,
    body: impl FnOnce(&mut Writer<'_>),
) -> Result<(), EncodeError> {
    let start = out.len();
    let mut w = Writer { buf: out, version };
    w.u16(MAGIC);
    w.u16(version);
    w.u16(opcode as u16 | if reply { REPLY_BIT } else { 0 });
    w.u16(0);
    w.u32(request_id);
    w.u32(0);
    body(&mut w);
    let len = out.len() - start - HEADER_BYTES;
    if len > max_payload as usize {
        out.truncate(start);
        return Err(EncodeError::TooLarge {
            opcode,
            len,
            max: max_payload,
        });
    }
    out[start + 12..start + 16].copy_from_slice(&(len as u32).to_le_bytes());
    Ok(())
}

/// A client's request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    /// First frame on a connection. The reply carries the segment descriptors.
    Hello {
        /// Reader or writer.
        role: Role,
        /// A label for logs and stats (process name, rank); at most `MAX_CLIENT_NAME` bytes of
        /// printable text (the daemon refuses others).
        client_name: String,
        /// The largest reply payload this client accepts.
        max_frame_bytes: u32,
        /// The versions and features the client speaks (sent from protocol 11 on; implied by
        /// the header's version before).
        speaks: Speaks,
        /// How many times this client connected again after its daemon went away (0 on its
        /// first connection; sent from protocol [`session::RECONNECTS_SINCE`] on, 0 before).
        reconnects: u32,
    },
    /// Reserve one writable object per size. The reservation is visible only to this connection
    /// until sealed.
    Create {
        /// Object sizes in bytes, each at least 1.
        sizes: Vec<u64>,
        /// How long to wait for space once eviction cannot make room; 0 fails at once.
        timeout_ms: u32,
        /// Bit set of `CREATE_*` flags.
        flags: u32,
    },
    /// Make reserved objects immutable and visible.
    Seal {
        /// Objects this connection created.
        handles: Vec<Handle>,
    },
    /// Give reserved objects back unsealed.
    Abort {
        /// Objects this connection created.
        handles: Vec<Handle>,
    },
    /// Take a lease on each sealed object and learn where it lives.
    Get {
        /// Objects to read.
        handles: Vec<Handle>,
    },
    /// Return leases (one per handle occurrence). One-way: no reply.
    Release {
        /// Leased objects.
        handles: Vec<Handle>,
    },
    /// Delete objects; space is reused once the last lease is released.
    Delete {
        /// Objects to delete.
        handles: Vec<Handle>,
    },
    /// Ask for a [`StoreStats`] snapshot.
    Stats,
    /// A producer (writer) joins a stream, creating it if new, to make samples for some of its
    /// ranks.
    StreamJoin {
        /// The stream; must equal the existing stream's spec.
        spec: StreamSpec,
        /// Prefetch depth per rank, if the stream is new.
        depth: u32,
        /// Batch size per rank, if the stream is new: above 1, tasks of this node's ranks are
        /// handed out a whole batch at a time (sequence numbers `k·batch .. (k+1)·batch`, all
        /// to one producer), so a producer can place a batch's samples in one object. 0 or 1:
        /// one task at a time.
        batch: u32,
        /// Ranks served, each with the sequence number it starts at if the daemon does not
        /// know it yet (from the consumers' checkpointed states; 0 for a fresh run).
        ranks: Vec<StreamTask>,
        /// Where ranks live that are not this node's: the peer address (`host:port`) of the
        /// daemon their consumers use. Ranks not listed are this node's.
        at: Vec<RankAt>,
        /// The peer address of a node every sample for another node's ranks passes through
        /// before that node pulls it (the `relay` placement); empty for none.
        relay: String,
    },
    /// A consumer attaches to its rank at a sequence number, waiting up to `timeout_ms` for a
    /// producer to create the stream. The reply carries the rank's ring.
    StreamAttach {
        /// The stream; must equal the existing stream's spec.
        spec: StreamSpec,
        /// The consumer's rank.
        rank: u32,
        /// The next sequence number it wants.
        seq: u64,
        /// How long to wait for the stream to exist.
        timeout_ms: u32,
    },
    /// A producer asks for samples to make (its stream id from [`Response::StreamJoined`]).
    StreamTake(TakeTasks),
    /// A producer delivers samples: reserved objects of its own (sealed here) or sealed ones
    /// (cache hits), each for one task.
    StreamPut {
        /// From [`Response::StreamJoined`].
        stream: u32,
        /// The samples.
        items: Vec<StreamItem>,
    },
    /// A consumer returns every sample before `upto` to the stream's window, and reports its
    /// figures. One-way: no reply. (The bytes stay leased by the consumer's own connection
    /// until each view goes.)
    StreamRelease {
        /// From [`Response::StreamAttached`].
        stream: u32,
        /// The consumer's rank.
        rank: u32,
        /// Everything below this sequence number is returned.
        upto: u64,
        /// What the consumer measured of its reading so far.
        figures: RankFigures,
    },
    /// A consumer waits until `seq` is in its ring, up to `timeout_ms`.
    StreamWait {
        /// From [`Response::StreamAttached`].
        stream: u32,
        /// The consumer's rank.
        rank: u32,
        /// The sequence number wanted.
        seq: u64,
        /// How long to wait.
        timeout_ms: u32,
    },
    /// Closes a stream (its owner's writers only): the stream's own holds go back to the store
    /// and its rings are retired. Views consumers still hold keep their own leases.
    StreamClose {
        /// The stream.
        stream: u32,
    },
    /// Looks samples up in the decode-once cache by key
    /// ([`crate::stream::sample_key`]).
    CacheLookup {
        /// The keys.
        keys: Vec<u128>,
    },
    /// Describes the open streams with ids above `after`, as many as fit in one reply.
    StreamList {
        /// 0 for the first page; then the last id of the previous page.
        after: u32,
    },
    /// A consumer detaches from its rank: the daemon releases the leases of the ring entries it
    /// published at or after `next` (never read), and the rank is free for another consumer.
    StreamDetach {
        /// From [`Response::StreamAttached`].
        stream: u32,
        /// The consumer's rank.
        rank: u32,
        /// The first sequence number the consumer did not read.
        next: u64,
    },
    /// A producer of a stream reports its figures (the daemon keeps the latest, per connection,
    /// for `feedstore top` and the metrics). One-way: no reply.
    ProducerReport {
        /// From [`Response::StreamJoined`].
        stream: u32,
        /// What the producer measured so far.
        figures: ProducerFigures,
    },
    /// Files sealed objects in the decode-once cache under sample keys, for [`Request::CacheLookup`]
    /// by clients of the same uid (a loader's worker that made a sample files it for the others).
    /// Per entry `Ok`; `InUse` when the key already names another sealed object (which stays);
    /// `NotFound` when the handle names no sealed object; `LimitReached` at the cache's bound.
    /// An entry lasts as long as its object, which stays evictable unless pinned.
    CacheInsert {
        /// The keys and the objects holding their samples.
        entries: Vec<CacheEntry>,
    },
    /// A daemon started with `--takeover` asks the one serving to hand over (instead of a
    /// hello, from the daemon's uid or root; protocol 12 on). No reply frame: the daemon
    /// answers with a [`crate::handover::Handover`] (a `u64` length, then its bytes) with the
    /// segments' and listeners' descriptors on its first byte, or with an error frame saying
    /// why not; the successor answers one byte once it serves, and the daemon exits.
    Takeover {
        /// The successor's [`crate::handover::HANDOVER_FORMAT`].
        format: u32,
    },
}

impl Request {
    /// The request's opcode.
    pub fn opcode(&self) -> Opcode {
        match self {
            Request::Hello { .. } => Opcode::Hello,
            Request::Create { .. } => Opcode::Create,
            Request::Seal { .. } => Opcode::Seal,
            Request::Abort { .. } => Opcode::Abort,
            Request::Get { .. } => Opcode::Get,
            Request::Release { .. } => Opcode::Release,
            Request::Delete { .. } => Opcode::Delete,
            Request::Stats => Opcode::Stats,
            Request::StreamJoin { .. } => Opcode::StreamJoin,
            Request::StreamAttach { .. } => Opcode::StreamAttach,
            Request::StreamTake(_) => Opcode::StreamTake,
            Request::StreamPut { .. } => Opcode::StreamPut,
            Request::StreamRelease { .. } => Opcode::StreamRelease,
            Request::StreamWait { .. } => Opcode::StreamWait,
            Request::StreamClose { .. } => Opcode::StreamClose,
            Request::CacheLookup { .. } => Opcode::CacheLookup,
            Request::StreamList { .. } => Opcode::StreamList,
            Request::StreamDetach { .. } => Opcode::StreamDetach,
            Request::ProducerReport { .. } => Opcode::ProducerReport,
            Request::CacheInsert { .. } => Opcode::CacheInsert,
            Request::Takeover { .. } => Opcode::Takeover,
        }
    }

    /// Whether the daemon answers this request.
    pub fn expects_reply(&self) -> bool {
        !matches!(
            self,
            Request::Release { .. }
                | Request::StreamRelease { .. }
                | Request::ProducerReport { .. }
        )
    }

    /// Items in a batch request (0 for the others).
    pub fn batch_len(&self) -> usize {
        match self {
            Request::Create { sizes, .. } => sizes.len(),
            Request::Seal { handles }
            | Request::Abort { handles }
            | Request::Get { handles }
            | Request::Release { handles }
            | Request::Delete { handles } => handles.len(),
            Request::StreamPut { items, .. } => items.len(),
            Request::CacheLookup { keys } => keys.len(),
            Request::CacheInsert { entries } => entries.len(),
            _ => 0,
        }
    }

    /// The largest reply payload this request can get, when that depends on the request (a
    /// batch's reply grows with it): the daemon refuses a request whose reply could not fit the
    /// client's limit before acting on it. (A take has none: the daemon hands out no more tasks
    /// than the client's limit lets the reply carry.)
    pub fn reply_bound(&self) -> Option<usize> {
        self.opcode()
            .batch_cost()
            .map(|cost| cost.reply_bytes(self.batch_len()))
    }

    /// Appends the encoded frame, in this crate's [`VERSION`], to `out`, or leaves `out` as it
    /// was if the payload exceeds `max_payload` (the daemon's limit from hello).
    pub fn encode(
        &self,
        request_id: u32,
        max_payload: u32,
        out: &mut Vec<u8>,
    ) -> Result<(), EncodeError> {
        self.encode_in(VERSION, request_id, max_payload, out)
    }

    /// [`Request::encode`] in protocol `version` (the connection's, agreed at hello).
    pub fn encode_in(
        &self,
        version: u16,
        request_id: u32,
        max_payload: u32,
        out: &mut Vec<u8>,
    ) -> Result<(), EncodeError> {
        framed(
            out,
            version,
            self.opcode(),
            false,
            request_id,
            max_payload,
            |w| self.encode_payload(w),
        )
    }

    /// The request's payload, after the frame's header.
    fn encode_payload(&self, w: &mut Writer<'_>) {
        match self {
            Request::Hello {
                role,
                client_name,
                max_frame_bytes,
                speaks,
                reconnects,
            } => {
                session::encode_hello(w, *role, client_name, *max_frame_bytes, speaks, *reconnects)
            }
            Request::Create {
                sizes,
                timeout_ms,
                flags,
            } => {
                w.u32(*timeout_ms);
                w.u32(*flags);
                w.list(sizes);
            }
            Request::Seal { handles }
            | Request::Abort { handles }
            | Request::Get { handles }
            | Request::Release { handles }
            | Request::Delete { handles } => w.list(handles),
            Request::Stats => {}
            Request::StreamJoin {
                spec,
                depth,
                batch,
                ranks,
                at,
                relay,
            } => {
                spec.encode(w);
                w.u32(*depth);
                w.u32(*batch);
                w.list(ranks);
                w.list(at);
                w.string(relay);
            }
            Request::StreamAttach {
                spec,
                rank,
                seq,
                timeout_ms,
            } => {
                spec.encode(w);
                w.u32(*rank);
                w.u64(*seq);
                w.u32(*timeout_ms);
            }
            Request::StreamTake(take) => take.encode(w),
            Request::StreamPut { stream, items } => {
                w.u32(*stream);
                w.list(items);
            }
            Request::StreamRelease {
                stream,
                rank,
                upto,
                figures,
            } => {
                streams::encode_position(w, *stream, *rank, *upto);
                figures.encode(w);
            }
            Request::StreamWait {
                stream,
                rank,
                seq,
                timeout_ms,
            } => {
                streams::encode_position(w, *stream, *rank, *seq);
                w.u32(*timeout_ms);
            }
            Request::StreamClose { stream } => w.u32(*stream),
            Request::CacheLookup { keys } => w.list(keys),
            Request::StreamList { after } => w.u32(*after),
            Request::StreamDetach { stream, rank, next } => {
                streams::encode_position(w, *stream, *rank, *next);
            }
            Request::ProducerReport { stream, figures } => {
                w.u32(*stream);
                figures.encode(w);
            }
            Request::CacheInsert { entries } => w.list(entries),
            Request::Takeover { format } => w.u32(*format),
        }
    }

    /// Decodes a request frame; every length is checked against the payload, and every value
    /// has exactly one encoding (what decodes re-encodes to the same bytes).
    pub fn decode(frame: &Frame<'_>) -> Result<Request, DecodeError> {
        let raw = frame.header.opcode;
        let op = Opcode::from_u16(raw)
            .filter(|op| *op != Opcode::Error)
            .ok_or(DecodeError::UnknownOpcode { found: raw })?;
        let mut r = Reader::at(frame.payload, frame.header.version);
        let req = match op {
            Opcode::Hello => session::decode_hello(&mut r)?,
            Opcode::Create => Request::Create {
                timeout_ms: r.u32()?,
                flags: r.u32()?,
                sizes: r.list()?,
            },
            Opcode::Seal => Request::Seal { handles: r.list()? },
            Opcode::Abort => Request::Abort { handles: r.list()? },
            Opcode::Get => Request::Get { handles: r.list()? },
            Opcode::Release => Request::Release { handles: r.list()? },
            Opcode::Delete => Request::Delete { handles: r.list()? },
            Opcode::Stats => Request::Stats,
            Opcode::StreamJoin => Request::StreamJoin {
                spec: StreamSpec::decode(&mut r)?,
                depth: r.u32()?,
                batch: r.u32()?,
                ranks: r.list()?,
                at: r.list()?,
                relay: r.string()?,
            },
            Opcode::StreamAttach => Request::StreamAttach {
                spec: StreamSpec::decode(&mut r)?,
                rank: r.u32()?,
                seq: r.u64()?,
                timeout_ms: r.u32()?,
            },
            Opcode::StreamTake => Request::StreamTake(TakeTasks::decode(&mut r)?),
            Opcode::StreamPut => Request::StreamPut {
                stream: r.u32()?,
                items: r.list()?,
            },
            Opcode::StreamRelease => {
                let (stream, rank, upto) = streams::decode_position(&mut r)?;
                Request::StreamRelease {
                    stream,
                    rank,
                    upto,
                    figures: RankFigures::decode(&mut r)?,
                }
            }
            Opcode::StreamWait => {
                let (stream, rank, seq) = streams::decode_position(&mut r)?;
                Request::StreamWait {
                    stream,
                    rank,
                    seq,
                    timeout_ms: r.u32()?,
                }
            }
            Opcode::StreamClose => Request::StreamClose { stream: r.u32()? },
            Opcode::CacheLookup => Request::CacheLookup { keys: r.list()? },
            Opcode::StreamList => Request::StreamList { after: r.u32()? },
            Opcode::StreamDetach => {
                let (stream, rank, next) = streams::decode_position(&mut r)?;
                Request::StreamDetach { stream, rank, next }
            }
            Opcode::ProducerReport => Request::ProducerReport {
                stream: r.u32()?,
                figures: ProducerFigures::decode(&mut r)?,
            },
            Opcode::CacheInsert => Request::CacheInsert { entries: r.list()? },
            Opcode::Takeover => Request::Takeover { format: r.u32()? },
            Opcode::Error => unreachable!("filtered above"),
        };
        r.finish()?;
        Ok(req)
    }
}

/// The daemon's reply to one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Response {
    /// Reply to [`Request::Hello`]; the segment descriptors ride along by `SCM_RIGHTS`.
    Hello {
        /// This daemon's node id.
        node_id: u32,
        /// This daemon's start epoch.
        epoch: u32,
        /// The segments, in descriptor order.
        segments: Vec<SegmentInfo>,
        /// The largest request payload the daemon accepts.
        max_frame_bytes: u32,
        /// The versions and features the daemon speaks (sent from protocol 11 on; implied by
        /// the reply's version before). The reply's version is the connection's.
        speaks: Speaks,
    },
    /// Reply to [`Request::Create`]: per size, the reservation or why not.
    Created(Vec<Result<Created, Status>>),
    /// Reply to [`Request::Get`]: per handle, where the leased object lives and who wrote it,
    /// or why not.
    Got(Vec<Result<Got, Status>>),
    /// Per-item statuses (seal, abort, delete, stream put, wait, close, detach).
    Done(Vec<Status>),
    /// Reply to [`Request::Stats`].
    Stats(Box<StoreStats>),
    /// The request failed as a whole.
    Error {
        /// Why.
        status: Status,
        /// Detail for logs and users.
        message: String,
    },
    /// Reply to [`Request::StreamJoin`].
    StreamJoined {
        /// The stream's id on this daemon.
        stream: u32,
    },
    /// Reply to [`Request::StreamAttach`]; the ring's read-only descriptor rides along.
    StreamAttached {
        /// The stream's id on this daemon.
        stream: u32,
        /// Ring slots (the stream's depth).
        capacity: u32,
        /// The ring's size in bytes.
        ring_bytes: u64,
    },
    /// Reply to [`Request::StreamTake`].
    Tasks(Vec<StreamTask>),
    /// Reply to [`Request::CacheLookup`]: per key, the sample still in the store.
    Cached(Vec<Option<Handle>>),
    /// Reply to [`Request::StreamList`]: one page of streams.
    Streams {
        /// Streams in id order.
        streams: Vec<StreamInfo>,
        /// More streams follow: ask again with `after` set to the last id here.
        more: bool,
    },
}

impl Response {
    /// Appends the encoded reply to `request_op` (an error reply has its own opcode), in this
    /// crate's [`VERSION`], or leaves `out` as it was if the payload exceeds `max_payload` (the
    /// client's limit from hello).
    pub fn encode(
        &self,
        request_op: Opcode,
        request_id: u32,
        max_payload: u32,
        out: &mut Vec<u8>,
    ) -> Result<(), EncodeError> {
        self.encode_in(VERSION, request_op, request_id, max_payload, out)
    }

    /// [`Response::encode`] in protocol `version` (the connection's, agreed at hello).
    pub fn encode_in(
        &self,
        version: u16,
        request_op: Opcode,
        request_id: u32,
        max_payload: u32,
        out: &mut Vec<u8>,
    ) -> Result<(), EncodeError> {
        let op = match self {
            Response::Error { .. } => Opcode::Error,
            _ => request_op,
        };
        framed(
            out,
            version,
            op,
            true,
            request_id,
            max_payload,
            |w| match self {
                Response::Hello {
                    node_id,
                    epoch,
                    segments,
                    max_frame_bytes,
                    speaks,
                } => {
                    w.u32(*node_id);
                    w.u32(*epoch);
                    w.list(segments);
                    w.u32(*max_frame_bytes);
                    speaks.encode_since_negotiation(w);
                }
                Response::Created(results) => w.list(results),
                Response::Got(results) => w.list(results),
                Response::Done(statuses) => w.list(statuses),
                Response::Stats(stats) => stats.encode(w),
                Response::Error { status, message } => {
                    status.encode(w);
                    w.string(message);
                }
                Response::StreamJoined { stream } => w.u32(*stream),
                Response::StreamAttached {
                    stream,
                    capacity,
                    ring_bytes,
                } => {
                    w.u32(*stream);
                    w.u32(*capacity);
                    w.u64(*ring_bytes);
                }
                Response::Tasks(tasks) => w.list(tasks),
                Response::Cached(found) => w.list(found),
                Response::Streams { streams, more } => {
                    w.list(streams);
                    w.bool(*more);
                }
            },
        )
    }

    /// Decodes a reply frame. The reply's kind follows from its opcode.
    pub fn decode(frame: &Frame<'_>) -> Result<Response, DecodeError> {
        let raw = frame.header.opcode;
        if raw & REPLY_BIT == 0 {
            return Err(DecodeError::UnknownOpcode { found: raw });
        }
        let op =
            Opcode::from_u16(raw & !REPLY_BIT).ok_or(DecodeError::UnknownOpcode { found: raw })?;
        let mut r = Reader::at(frame.payload, frame.header.version);
        let resp = match op {
            Opcode::Hello => Response::Hello {
                node_id: r.u32()?,
                epoch: r.u32()?,
                segments: r.list()?,
                max_frame_bytes: r.u32()?,
                speaks: {
                    let speaks = Speaks::decode_since_negotiation(&mut r)?;
                    session::skip_newer(&mut r);
                    speaks
                },
            },
            Opcode::Create => Response::Created(r.list()?),
            Opcode::Get => Response::Got(r.list()?),
            Opcode::Seal
            | Opcode::Abort
            | Opcode::Delete
            | Opcode::StreamPut
            | Opcode::StreamWait
            | Opcode::StreamClose
            | Opcode::StreamDetach
            | Opcode::CacheInsert => Response::Done(r.list()?),
            Opcode::Stats => Response::Stats(Box::new(StoreStats::decode(&mut r)?)),
            Opcode::Error => Response::Error {
                status: Status::decode(&mut r)?,
                message: r.string()?,
            },
            Opcode::StreamJoin => Response::StreamJoined { stream: r.u32()? },
            Opcode::StreamAttach => Response::StreamAttached {
                stream: r.u32()?,
                capacity: r.u32()?,
                ring_bytes: r.u64()?,
            },
            Opcode::StreamTake => Response::Tasks(r.list()?),
            Opcode::CacheLookup => Response::Cached(r.list()?),
            Opcode::StreamList => Response::Streams {
                streams: r.list()?,
                more: r.bool("more")?,
            },
            Opcode::Release | Opcode::StreamRelease | Opcode::ProducerReport | Opcode::Takeover => {
                return Err(DecodeError::UnknownOpcode { found: raw });
            }
        };
        r.finish()?;
        Ok(resp)
    }
}

#[cfg(test)]
mod tests;
