//! Control-socket frames.
//!
//! Every frame is a 16-byte header followed by `payload_len` bytes:
//!
//! | bytes  | field         | value                                                  |
//! |--------|---------------|--------------------------------------------------------|
//! | 0..2   | `magic`       | [`MAGIC`]                                              |
//! | 2..4   | `version`     | [`VERSION`]; a daemon refuses other versions            |
//! | 4..6   | `opcode`      | an [`Opcode`]; replies set [`REPLY_BIT`]                |
//! | 6..8   | `flags`       | reserved, zero                                         |
//! | 8..12  | `request_id`  | chosen by the client, echoed in the reply              |
//! | 12..16 | `payload_len` | at most the receiver's maximum ([`MAX_PAYLOAD_BYTES`]) |
//!
//! Every request but [`Request::Release`] gets exactly one reply, in order. Batches are the unit:
//! `Get`, `Seal`, `Delete`, ... carry a list of handles and the reply carries one result each, so
//! a client amortises a round trip over as many objects as it likes.

use crate::stream::StreamSpec;
use crate::wire::{Reader, Writer};
use crate::{Handle, Location, Role, SegmentInfo, Status, StoreStats};

/// First two bytes of every frame.
pub const MAGIC: u16 = 0xFD5E;
/// Protocol version spoken by this crate.
pub const VERSION: u16 = 1;
/// Size of the frame header.
pub const HEADER_BYTES: usize = 16;
/// Default maximum payload a peer accepts: room for a batch of ~65k handles.
pub const MAX_PAYLOAD_BYTES: u32 = 1 << 20;
/// Set in a reply's opcode.
pub const REPLY_BIT: u16 = 0x8000;
/// Create flag: the object is never evicted (it can still be deleted).
pub const CREATE_PIN: u32 = 1;

/// Request kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
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
    /// [`Response::Error`] (reply only).
    Error = 0x7FFF,
}

impl Opcode {
    fn from_u16(v: u16) -> Option<Opcode> {
        use Opcode::*;
        Some(match v {
            1 => Hello,
            2 => Create,
            3 => Seal,
            4 => Abort,
            5 => Get,
            6 => Release,
            7 => Delete,
            8 => Stats,
            9 => StreamJoin,
            10 => StreamAttach,
            11 => StreamTake,
            12 => StreamPut,
            13 => StreamRelease,
            14 => StreamWait,
            15 => StreamClose,
            16 => CacheLookup,
            17 => StreamList,
            0x7FFF => Error,
            _ => return None,
        })
    }
}

/// Why bytes could not be decoded as a frame. Any of these closes the connection.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// The first two bytes are not [`MAGIC`]: the peer is not speaking this protocol.
    #[error("bad magic {found:#06x} (not a feedstore peer?)")]
    BadMagic {
        /// What arrived.
        found: u16,
    },
    /// The peer speaks another protocol version.
    #[error("unsupported protocol version {found} (this side speaks {VERSION})")]
    UnsupportedVersion {
        /// What arrived.
        found: u16,
    },
    /// The opcode is unknown or not valid in this direction.
    #[error("unknown opcode {found:#06x}")]
    UnknownOpcode {
        /// What arrived.
        found: u16,
    },
    /// The header announces a payload larger than the receiver accepts.
    #[error("frame payload of {len} bytes exceeds the maximum of {max}")]
    Oversized {
        /// Announced payload length.
        len: u32,
        /// The receiver's maximum.
        max: u32,
    },
    /// The payload ends before a field does.
    #[error("truncated payload: needed {need} more bytes, {have} left")]
    Truncated {
        /// Bytes needed.
        need: usize,
        /// Bytes left.
        have: usize,
    },
    /// The payload has bytes after its last field.
    #[error("{extra} trailing bytes after the payload")]
    TrailingBytes {
        /// Number of extra bytes.
        extra: usize,
    },
    /// A field holds a value outside its domain.
    #[error("invalid value in field {field}")]
    InvalidValue {
        /// The field.
        field: &'static str,
    },
    /// The reserved flags are not zero.
    #[error("reserved header flags set: {found:#06x}")]
    ReservedFlags {
        /// What arrived.
        found: u16,
    },
}

/// A parsed frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// The raw opcode, [`REPLY_BIT`] included.
    pub opcode: u16,
    /// Echoed from the request.
    pub request_id: u32,
    /// Bytes following the header.
    pub payload_len: u32,
}

impl Header {
    /// Parses and checks a header against the receiver's maximum payload.
    pub fn parse(b: &[u8; HEADER_BYTES], max_payload: u32) -> Result<Header, DecodeError> {
        let mut r = Reader::new(b);
        let magic = r.u16()?;
        if magic != MAGIC {
            return Err(DecodeError::BadMagic { found: magic });
        }
        let version = r.u16()?;
        if version != VERSION {
            return Err(DecodeError::UnsupportedVersion { found: version });
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

fn begin(out: &mut Vec<u8>, opcode: u16, request_id: u32) -> usize {
    let start = out.len();
    let mut w = Writer { buf: out };
    w.u16(MAGIC);
    w.u16(VERSION);
    w.u16(opcode);
    w.u16(0);
    w.u32(request_id);
    w.u32(0); // patched by `finish`
    start
}

fn finish(out: &mut [u8], start: usize) {
    let payload_len = (out.len() - start - HEADER_BYTES) as u32;
    out[start + 12..start + 16].copy_from_slice(&payload_len.to_le_bytes());
}

fn write_handles(w: &mut Writer<'_>, handles: &[Handle]) {
    w.count(handles.len());
    for h in handles {
        w.handle(*h);
    }
}

fn read_handles(r: &mut Reader<'_>) -> Result<Vec<Handle>, DecodeError> {
    let n = r.count(Handle::WIRE_BYTES)?;
    (0..n).map(|_| r.handle()).collect()
}

fn read_status(r: &mut Reader<'_>) -> Result<Status, DecodeError> {
    Status::from_u16(r.u16()?).ok_or(DecodeError::InvalidValue { field: "status" })
}

/// A client's request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    /// First frame on a connection. The reply carries the segment descriptors.
    Hello {
        /// Reader or writer.
        role: Role,
        /// A label for logs and stats (process name, rank).
        client_name: String,
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
    /// A producer joins a stream (creating it if new) to make samples for some of its ranks.
    StreamJoin {
        /// The stream; must equal the existing stream's spec.
        spec: StreamSpec,
        /// Prefetch depth per rank, if the stream is new.
        depth: u32,
        /// Ranks served on this node, each with the sequence number it starts at if the daemon
        /// does not know it yet (from the consumers' checkpointed states; 0 for a fresh run).
        ranks: Vec<StreamTask>,
    },
    /// A consumer attaches to its rank at a sequence number. The reply carries the rank's ring.
    StreamAttach {
        /// The stream; must equal the existing stream's spec.
        spec: StreamSpec,
        /// Prefetch depth per rank, if the stream is new.
        depth: u32,
        /// The consumer's rank.
        rank: u32,
        /// The next sequence number it wants.
        seq: u64,
    },
    /// A producer asks for up to `max` samples to make, waiting up to `timeout_ms` while every
    /// rank's prefetch window is full (backpressure).
    StreamTake {
        /// From [`Response::StreamJoined`].
        stream: u32,
        /// Most tasks wanted.
        max: u32,
        /// How long to wait for work.
        timeout_ms: u32,
    },
    /// A producer delivers samples: reserved objects of its own (sealed here) or sealed ones
    /// (cache hits), each for one task.
    StreamPut {
        /// From [`Response::StreamJoined`].
        stream: u32,
        /// The samples.
        items: Vec<StreamItem>,
    },
    /// A consumer returns every sample before `upto`. One-way: no reply.
    StreamRelease {
        /// From [`Response::StreamAttached`].
        stream: u32,
        /// The consumer's rank.
        rank: u32,
        /// Everything below this sequence number is returned.
        upto: u64,
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
    /// Closes a stream: its samples are returned to the store and its rings retired.
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
    /// Describes every open stream.
    StreamList,
}

/// One stream as `feedstore stat` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamInfo {
    /// Its name.
    pub name: String,
    /// Prefetch depth per rank.
    pub depth: u32,
    /// Producer connections joined.
    pub producers: u32,
    /// Ranks with a consumer attached.
    pub consumers: u32,
    /// Ranks known on this node.
    pub ranks: u32,
    /// Samples made and not yet returned, over ranks.
    pub ready: u64,
    /// Samples being made.
    pub making: u64,
    /// Samples put so far.
    pub put: u64,
    /// Samples returned by consumers so far.
    pub returned: u64,
    /// The slowest rank's next sequence number.
    pub slowest: u64,
    /// The fastest rank's next sequence number (the lag is fastest - slowest).
    pub fastest: u64,
    /// Microseconds from the stream's creation to its first sample; 0 before that.
    pub cold_start_us: u64,
}

/// A rank and a sequence number: a task (make the sample for `seq` of `rank`), or where a rank
/// starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StreamTask {
    /// The rank.
    pub rank: u32,
    /// Its sequence number.
    pub seq: u64,
}

/// A delivered sample.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamItem {
    /// The task it fulfils.
    pub task: StreamTask,
    /// The sample's object (ignored when `flags` has [`crate::ring::ENTRY_FAILED`]).
    pub handle: Handle,
    /// The record it was made from.
    pub record: u64,
    /// [`crate::ring::ENTRY_FAILED`] when no candidate record made a sample.
    pub flags: u32,
    /// The sample's decode-once cache key; 0 for none.
    pub key: u128,
}

const STREAM_ITEM_BYTES: usize = 4 + 8 + Handle::WIRE_BYTES + 8 + 4 + 16;

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
            Request::StreamTake { .. } => Opcode::StreamTake,
            Request::StreamPut { .. } => Opcode::StreamPut,
            Request::StreamRelease { .. } => Opcode::StreamRelease,
            Request::StreamWait { .. } => Opcode::StreamWait,
            Request::StreamClose { .. } => Opcode::StreamClose,
            Request::CacheLookup { .. } => Opcode::CacheLookup,
            Request::StreamList => Opcode::StreamList,
        }
    }

    /// Whether the daemon answers this request.
    pub fn expects_reply(&self) -> bool {
        !matches!(
            self,
            Request::Release { .. } | Request::StreamRelease { .. }
        )
    }

    /// Appends the encoded frame to `out`.
    pub fn encode(&self, request_id: u32, out: &mut Vec<u8>) {
        let start = begin(out, self.opcode() as u16, request_id);
        let mut w = Writer { buf: out };
        match self {
            Request::Hello { role, client_name } => {
                w.u8(*role as u8);
                w.string(client_name);
            }
            Request::Create {
                sizes,
                timeout_ms,
                flags,
            } => {
                w.u32(*timeout_ms);
                w.u32(*flags);
                w.count(sizes.len());
                for s in sizes {
                    w.u64(*s);
                }
            }
            Request::Seal { handles }
            | Request::Abort { handles }
            | Request::Get { handles }
            | Request::Release { handles }
            | Request::Delete { handles } => write_handles(&mut w, handles),
            Request::Stats => {}
            Request::StreamJoin { spec, depth, ranks } => {
                spec.encode(&mut w);
                w.u32(*depth);
                w.count(ranks.len());
                for r in ranks {
                    w.u32(r.rank);
                    w.u64(r.seq);
                }
            }
            Request::StreamAttach {
                spec,
                depth,
                rank,
                seq,
            } => {
                spec.encode(&mut w);
                w.u32(*depth);
                w.u32(*rank);
                w.u64(*seq);
            }
            Request::StreamTake {
                stream,
                max,
                timeout_ms,
            } => {
                w.u32(*stream);
                w.u32(*max);
                w.u32(*timeout_ms);
            }
            Request::StreamPut { stream, items } => {
                w.u32(*stream);
                w.count(items.len());
                for item in items {
                    w.u32(item.task.rank);
                    w.u64(item.task.seq);
                    w.handle(item.handle);
                    w.u64(item.record);
                    w.u32(item.flags);
                    w.u64(item.key as u64);
                    w.u64((item.key >> 64) as u64);
                }
            }
            Request::StreamRelease { stream, rank, upto } => {
                w.u32(*stream);
                w.u32(*rank);
                w.u64(*upto);
            }
            Request::StreamWait {
                stream,
                rank,
                seq,
                timeout_ms,
            } => {
                w.u32(*stream);
                w.u32(*rank);
                w.u64(*seq);
                w.u32(*timeout_ms);
            }
            Request::StreamClose { stream } => w.u32(*stream),
            Request::CacheLookup { keys } => {
                w.count(keys.len());
                for k in keys {
                    w.u64(*k as u64);
                    w.u64((*k >> 64) as u64);
                }
            }
            Request::StreamList => {}
        }
        finish(out, start);
    }

    /// Decodes a request frame; every length is checked against the payload.
    pub fn decode(frame: &Frame<'_>) -> Result<Request, DecodeError> {
        let opcode = frame.header.opcode;
        let op = Opcode::from_u16(opcode).ok_or(DecodeError::UnknownOpcode { found: opcode })?;
        let mut r = Reader::new(frame.payload);
        let req = match op {
            Opcode::Hello => {
                let role =
                    Role::from_u8(r.u8()?).ok_or(DecodeError::InvalidValue { field: "role" })?;
                Request::Hello {
                    role,
                    client_name: r.string()?,
                }
            }
            Opcode::Create => {
                let timeout_ms = r.u32()?;
                let flags = r.u32()?;
                let n = r.count(8)?;
                let sizes = (0..n).map(|_| r.u64()).collect::<Result<_, _>>()?;
                Request::Create {
                    sizes,
                    timeout_ms,
                    flags,
                }
            }
            Opcode::Seal => Request::Seal {
                handles: read_handles(&mut r)?,
            },
            Opcode::Abort => Request::Abort {
                handles: read_handles(&mut r)?,
            },
            Opcode::Get => Request::Get {
                handles: read_handles(&mut r)?,
            },
            Opcode::Release => Request::Release {
                handles: read_handles(&mut r)?,
            },
            Opcode::Delete => Request::Delete {
                handles: read_handles(&mut r)?,
            },
            Opcode::Stats => Request::Stats,
            Opcode::StreamJoin => {
                let spec = StreamSpec::decode(&mut r)?;
                let depth = r.u32()?;
                let n = r.count(12)?;
                let ranks = (0..n)
                    .map(|_| {
                        Ok(StreamTask {
                            rank: r.u32()?,
                            seq: r.u64()?,
                        })
                    })
                    .collect::<Result<_, DecodeError>>()?;
                Request::StreamJoin { spec, depth, ranks }
            }
            Opcode::StreamAttach => Request::StreamAttach {
                spec: StreamSpec::decode(&mut r)?,
                depth: r.u32()?,
                rank: r.u32()?,
                seq: r.u64()?,
            },
            Opcode::StreamTake => Request::StreamTake {
                stream: r.u32()?,
                max: r.u32()?,
                timeout_ms: r.u32()?,
            },
            Opcode::StreamPut => {
                let stream = r.u32()?;
                let n = r.count(STREAM_ITEM_BYTES)?;
                let items = (0..n)
                    .map(|_| {
                        Ok(StreamItem {
                            task: StreamTask {
                                rank: r.u32()?,
                                seq: r.u64()?,
                            },
                            handle: r.handle()?,
                            record: r.u64()?,
                            flags: r.u32()?,
                            key: u128::from(r.u64()?) | u128::from(r.u64()?) << 64,
                        })
                    })
                    .collect::<Result<_, DecodeError>>()?;
                Request::StreamPut { stream, items }
            }
            Opcode::StreamRelease => Request::StreamRelease {
                stream: r.u32()?,
                rank: r.u32()?,
                upto: r.u64()?,
            },
            Opcode::StreamWait => Request::StreamWait {
                stream: r.u32()?,
                rank: r.u32()?,
                seq: r.u64()?,
                timeout_ms: r.u32()?,
            },
            Opcode::StreamClose => Request::StreamClose { stream: r.u32()? },
            Opcode::CacheLookup => {
                let n = r.count(16)?;
                let keys = (0..n)
                    .map(|_| Ok(u128::from(r.u64()?) | u128::from(r.u64()?) << 64))
                    .collect::<Result<_, DecodeError>>()?;
                Request::CacheLookup { keys }
            }
            Opcode::StreamList => Request::StreamList,
            Opcode::Error => return Err(DecodeError::UnknownOpcode { found: opcode }),
        };
        r.finish()?;
        Ok(req)
    }
}

/// A reserved object: its handle and where to write it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Created {
    /// The new object's handle.
    pub handle: Handle,
    /// Where the writer writes.
    pub location: Location,
}

/// The daemon's reply.
#[derive(Debug, Clone, PartialEq)]
pub enum Response {
    /// Reply to [`Request::Hello`]; one descriptor per segment travels beside it.
    Hello {
        /// The daemon's node id.
        node_id: u32,
        /// The daemon's start epoch.
        epoch: u32,
        /// The segments, in the order of the attached descriptors.
        segments: Vec<SegmentInfo>,
    },
    /// Reply to [`Request::Create`], one result per size.
    Created(Vec<Result<Created, Status>>),
    /// Reply to [`Request::Get`], one result per handle.
    Got(Vec<Result<Location, Status>>),
    /// Reply to [`Request::Seal`], [`Request::Abort`], [`Request::Delete`] or
    /// [`Request::StreamPut`] (one status per handle or item), or to [`Request::StreamWait`] or
    /// [`Request::StreamClose`] (one status).
    Done(Vec<Status>),
    /// Reply to [`Request::Stats`].
    Stats(StoreStats),
    /// Reply to [`Request::StreamJoin`].
    StreamJoined {
        /// The stream's id on this daemon, for later requests.
        stream: u32,
    },
    /// Reply to [`Request::StreamAttach`]; the ring's read-only descriptor travels beside it.
    StreamAttached {
        /// The stream's id on this daemon.
        stream: u32,
        /// Ring slots (the prefetch depth).
        capacity: u32,
        /// Bytes of the ring's shared memory.
        ring_bytes: u64,
    },
    /// Reply to [`Request::StreamTake`]: tasks, possibly none if the wait ran out.
    Tasks(Vec<StreamTask>),
    /// Reply to [`Request::CacheLookup`]: per key, the sample's handle if it is still stored.
    Cached(Vec<Option<Handle>>),
    /// Reply to [`Request::StreamList`].
    Streams(Vec<StreamInfo>),
    /// The request failed as a whole.
    Error {
        /// What went wrong.
        status: Status,
        /// Detail for logs.
        message: String,
    },
}

const LOCATION_BYTES: usize = 2 + 4 + 8 + 8;

impl Response {
    /// Appends the encoded reply to `request` to `out`.
    pub fn encode(&self, request: Opcode, request_id: u32, out: &mut Vec<u8>) {
        let opcode = match self {
            Response::Error { .. } => Opcode::Error as u16,
            _ => request as u16,
        } | REPLY_BIT;
        let start = begin(out, opcode, request_id);
        let mut w = Writer { buf: out };
        let location = |w: &mut Writer<'_>, status: Status, loc: Location| {
            w.u16(status as u16);
            w.u32(loc.segment);
            w.u64(loc.offset);
            w.u64(loc.len);
        };
        const NOWHERE: Location = Location {
            segment: 0,
            offset: 0,
            len: 0,
        };
        match self {
            Response::Hello {
                node_id,
                epoch,
                segments,
            } => {
                w.u32(*node_id);
                w.u32(*epoch);
                w.count(segments.len());
                for s in segments {
                    w.u32(s.id);
                    w.u64(s.size_bytes);
                    w.u32(s.flags);
                }
            }
            Response::Created(results) => {
                w.count(results.len());
                for r in results {
                    match r {
                        Ok(c) => {
                            w.handle(c.handle);
                            location(&mut w, Status::Ok, c.location);
                        }
                        Err(s) => {
                            w.handle(Handle::default());
                            location(&mut w, *s, NOWHERE);
                        }
                    }
                }
            }
            Response::Got(results) => {
                w.count(results.len());
                for r in results {
                    match r {
                        Ok(loc) => location(&mut w, Status::Ok, *loc),
                        Err(s) => location(&mut w, *s, NOWHERE),
                    }
                }
            }
            Response::Done(statuses) => {
                w.count(statuses.len());
                for s in statuses {
                    w.u16(*s as u16);
                }
            }
            Response::Stats(stats) => {
                let fields = stats.fields();
                w.count(fields.len());
                for f in fields {
                    w.u64(f);
                }
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
            Response::Tasks(tasks) => {
                w.count(tasks.len());
                for t in tasks {
                    w.u32(t.rank);
                    w.u64(t.seq);
                }
            }
            Response::Cached(found) => {
                w.count(found.len());
                for h in found {
                    w.u8(u8::from(h.is_some()));
                    w.handle(h.unwrap_or_default());
                }
            }
            Response::Streams(streams) => {
                w.count(streams.len());
                for s in streams {
                    w.string(&s.name);
                    for v in [s.depth, s.producers, s.consumers, s.ranks] {
                        w.u32(v);
                    }
                    for v in [
                        s.ready,
                        s.making,
                        s.put,
                        s.returned,
                        s.slowest,
                        s.fastest,
                        s.cold_start_us,
                    ] {
                        w.u64(v);
                    }
                }
            }
            Response::Error { status, message } => {
                w.u16(*status as u16);
                w.string(message);
            }
        }
        finish(out, start);
    }

    /// Decodes a reply frame.
    pub fn decode(frame: &Frame<'_>) -> Result<Response, DecodeError> {
        let raw = frame.header.opcode;
        if raw & REPLY_BIT == 0 {
            return Err(DecodeError::UnknownOpcode { found: raw });
        }
        let op =
            Opcode::from_u16(raw & !REPLY_BIT).ok_or(DecodeError::UnknownOpcode { found: raw })?;
        let mut r = Reader::new(frame.payload);
        let read_location = |r: &mut Reader<'_>| -> Result<Result<Location, Status>, DecodeError> {
            let status = read_status(r)?;
            let loc = Location {
                segment: r.u32()?,
                offset: r.u64()?,
                len: r.u64()?,
            };
            Ok(if status == Status::Ok {
                Ok(loc)
            } else {
                Err(status)
            })
        };
        let resp = match op {
            Opcode::Hello => {
                let node_id = r.u32()?;
                let epoch = r.u32()?;
                let n = r.count(16)?;
                let segments = (0..n)
                    .map(|_| {
                        Ok(SegmentInfo {
                            id: r.u32()?,
                            size_bytes: r.u64()?,
                            flags: r.u32()?,
                        })
                    })
                    .collect::<Result<_, DecodeError>>()?;
                Response::Hello {
                    node_id,
                    epoch,
                    segments,
                }
            }
            Opcode::Create => {
                let n = r.count(Handle::WIRE_BYTES + LOCATION_BYTES)?;
                let results = (0..n)
                    .map(|_| {
                        let handle = r.handle()?;
                        Ok(read_location(&mut r)?.map(|location| Created { handle, location }))
                    })
                    .collect::<Result<_, DecodeError>>()?;
                Response::Created(results)
            }
            Opcode::Get => {
                let n = r.count(LOCATION_BYTES)?;
                Response::Got(
                    (0..n)
                        .map(|_| read_location(&mut r))
                        .collect::<Result<_, _>>()?,
                )
            }
            Opcode::Seal
            | Opcode::Abort
            | Opcode::Delete
            | Opcode::StreamPut
            | Opcode::StreamWait
            | Opcode::StreamClose => {
                let n = r.count(2)?;
                Response::Done(
                    (0..n)
                        .map(|_| read_status(&mut r))
                        .collect::<Result<_, _>>()?,
                )
            }
            Opcode::Stats => {
                let n = r.count(8)?;
                let fields = (0..n).map(|_| r.u64()).collect::<Result<Vec<_>, _>>()?;
                Response::Stats(StoreStats::from_fields(&fields))
            }
            Opcode::Error => Response::Error {
                status: read_status(&mut r)?,
                message: r.string()?,
            },
            Opcode::StreamJoin => Response::StreamJoined { stream: r.u32()? },
            Opcode::StreamAttach => Response::StreamAttached {
                stream: r.u32()?,
                capacity: r.u32()?,
                ring_bytes: r.u64()?,
            },
            Opcode::StreamTake => {
                let n = r.count(12)?;
                Response::Tasks(
                    (0..n)
                        .map(|_| {
                            Ok(StreamTask {
                                rank: r.u32()?,
                                seq: r.u64()?,
                            })
                        })
                        .collect::<Result<_, DecodeError>>()?,
                )
            }
            Opcode::CacheLookup => {
                let n = r.count(1 + Handle::WIRE_BYTES)?;
                Response::Cached(
                    (0..n)
                        .map(|_| {
                            let present = r.u8()?;
                            let h = r.handle()?;
                            match present {
                                0 => Ok(None),
                                1 => Ok(Some(h)),
                                _ => Err(DecodeError::InvalidValue { field: "present" }),
                            }
                        })
                        .collect::<Result<_, DecodeError>>()?,
                )
            }
            Opcode::StreamList => {
                let n = r.count(4 + 4 * 4 + 7 * 8)?;
                Response::Streams(
                    (0..n)
                        .map(|_| {
                            Ok(StreamInfo {
                                name: r.string()?,
                                depth: r.u32()?,
                                producers: r.u32()?,
                                consumers: r.u32()?,
                                ranks: r.u32()?,
                                ready: r.u64()?,
                                making: r.u64()?,
                                put: r.u64()?,
                                returned: r.u64()?,
                                slowest: r.u64()?,
                                fastest: r.u64()?,
                                cold_start_us: r.u64()?,
                            })
                        })
                        .collect::<Result<_, DecodeError>>()?,
                )
            }
            Opcode::Release | Opcode::StreamRelease => {
                return Err(DecodeError::UnknownOpcode { found: raw });
            }
        };
        r.finish()?;
        Ok(resp)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn round_trip_request(req: Request) {
        let mut wire = Vec::new();
        req.encode(77, &mut wire);
        let frame = Frame::parse(&wire, MAX_PAYLOAD_BYTES).unwrap().unwrap();
        assert_eq!(frame.len(), wire.len());
        assert_eq!(frame.header.request_id, 77);
        assert_eq!(Request::decode(&frame).unwrap(), req);
    }

    fn round_trip_response(op: Opcode, resp: Response) {
        let mut wire = Vec::new();
        resp.encode(op, 5, &mut wire);
        let frame = Frame::parse(&wire, MAX_PAYLOAD_BYTES).unwrap().unwrap();
        assert_eq!(Response::decode(&frame).unwrap(), resp);
    }

    fn handle(i: u32) -> Handle {
        Handle {
            node_id: 1,
            epoch: 2,
            slot: i,
            generation: i * 3,
        }
    }

    #[test]
    fn every_request_round_trips() {
        round_trip_request(Request::Hello {
            role: Role::Writer,
            client_name: "rank-3".into(),
        });
        round_trip_request(Request::Create {
            sizes: vec![1, 1 << 30],
            timeout_ms: 5,
            flags: 1,
        });
        round_trip_request(Request::Seal {
            handles: vec![handle(1), handle(2)],
        });
        round_trip_request(Request::Abort {
            handles: vec![handle(1)],
        });
        round_trip_request(Request::Get { handles: vec![] });
        round_trip_request(Request::Release {
            handles: vec![handle(9)],
        });
        round_trip_request(Request::Delete {
            handles: vec![handle(4)],
        });
        round_trip_request(Request::Stats);
        let spec = StreamSpec {
            name: "job-7/train".into(),
            records: 1_000_003,
            seed: 42,
            world: 8,
            shuffle: crate::stream::Shuffle::Block(64),
            tail: crate::stream::Tail::Pad,
            epochs: Some(3),
        };
        round_trip_request(Request::StreamJoin {
            spec: spec.clone(),
            depth: 64,
            ranks: vec![
                StreamTask { rank: 0, seq: 9 },
                StreamTask { rank: 7, seq: 0 },
            ],
        });
        round_trip_request(Request::StreamAttach {
            spec,
            depth: 32,
            rank: 3,
            seq: 1 << 40,
        });
        round_trip_request(Request::StreamTake {
            stream: 1,
            max: 16,
            timeout_ms: 100,
        });
        round_trip_request(Request::StreamPut {
            stream: 1,
            items: vec![StreamItem {
                task: StreamTask { rank: 2, seq: 5 },
                handle: handle(3),
                record: 77,
                flags: 1,
                key: u128::MAX - 5,
            }],
        });
        round_trip_request(Request::CacheLookup {
            keys: vec![1, u128::MAX],
        });
        round_trip_request(Request::StreamList);
        round_trip_request(Request::StreamRelease {
            stream: 1,
            rank: 2,
            upto: 6,
        });
        round_trip_request(Request::StreamWait {
            stream: 1,
            rank: 2,
            seq: 6,
            timeout_ms: 0,
        });
        round_trip_request(Request::StreamClose { stream: 1 });
    }

    #[test]
    fn a_stream_spec_has_one_encoding() {
        let spec = StreamSpec {
            name: "s".into(),
            records: 4,
            seed: 1,
            world: 1,
            shuffle: crate::stream::Shuffle::Full,
            tail: crate::stream::Tail::Drop,
            epochs: None,
        };
        let mut good = Vec::new();
        Request::StreamAttach {
            spec,
            depth: 1,
            rank: 0,
            seq: 0,
        }
        .encode(1, &mut good);
        // The block size of a full shuffle sits after the header, the name (u16 length + "s"),
        // records, seed, world and the shuffle kind.
        let block = HEADER_BYTES + 2 + 1 + 8 + 8 + 4 + 1;
        let mut bad = good.clone();
        bad[block] = 7;
        let frame = Frame::parse(&bad, MAX_PAYLOAD_BYTES).unwrap().unwrap();
        assert!(
            Request::decode(&frame).is_err(),
            "a block size without block shuffle"
        );
        let frame = Frame::parse(&good, MAX_PAYLOAD_BYTES).unwrap().unwrap();
        assert!(Request::decode(&frame).is_ok());
    }

    #[test]
    fn every_response_round_trips() {
        let loc = Location {
            segment: 1,
            offset: 4096,
            len: 100,
        };
        round_trip_response(
            Opcode::Hello,
            Response::Hello {
                node_id: 3,
                epoch: 4,
                segments: vec![SegmentInfo {
                    id: 0,
                    size_bytes: 1 << 33,
                    flags: 3,
                }],
            },
        );
        round_trip_response(
            Opcode::Create,
            Response::Created(vec![
                Ok(Created {
                    handle: handle(1),
                    location: loc,
                }),
                Err(Status::Full),
            ]),
        );
        round_trip_response(
            Opcode::Get,
            Response::Got(vec![Ok(loc), Err(Status::Stale)]),
        );
        round_trip_response(
            Opcode::Seal,
            Response::Done(vec![Status::Ok, Status::NotOwner]),
        );
        let stats = StoreStats {
            capacity_bytes: 10,
            evictions: 3,
            ..Default::default()
        };
        round_trip_response(Opcode::Stats, Response::Stats(stats));
        round_trip_response(Opcode::StreamJoin, Response::StreamJoined { stream: 4 });
        round_trip_response(
            Opcode::StreamAttach,
            Response::StreamAttached {
                stream: 4,
                capacity: 64,
                ring_bytes: 8192,
            },
        );
        round_trip_response(
            Opcode::StreamTake,
            Response::Tasks(vec![StreamTask { rank: 1, seq: 2 }]),
        );
        round_trip_response(Opcode::StreamWait, Response::Done(vec![Status::Timeout]));
        round_trip_response(
            Opcode::CacheLookup,
            Response::Cached(vec![None, Some(handle(4))]),
        );
        round_trip_response(
            Opcode::StreamList,
            Response::Streams(vec![StreamInfo {
                name: "train".into(),
                depth: 64,
                producers: 2,
                consumers: 8,
                ranks: 8,
                ready: 300,
                making: 40,
                put: 1000,
                returned: 700,
                slowest: 80,
                fastest: 95,
                cold_start_us: 1_500_000,
            }]),
        );
        round_trip_response(
            Opcode::Get,
            Response::Error {
                status: Status::PermissionDenied,
                message: "readers".into(),
            },
        );
    }

    #[test]
    fn oversized_frame_is_rejected_from_its_header_alone() {
        let mut wire = Vec::new();
        Request::Get {
            handles: vec![handle(1); 10],
        }
        .encode(1, &mut wire);
        let err = Frame::parse(&wire[..HEADER_BYTES], 64).unwrap_err();
        assert_eq!(
            err,
            DecodeError::Oversized {
                len: 4 + 160,
                max: 64
            }
        );
    }

    #[test]
    fn forged_count_cannot_reserve_memory() {
        let mut wire = Vec::new();
        Request::Get {
            handles: vec![handle(1)],
        }
        .encode(1, &mut wire);
        wire[HEADER_BYTES..HEADER_BYTES + 4].copy_from_slice(&u32::MAX.to_le_bytes());
        let frame = Frame::parse(&wire, MAX_PAYLOAD_BYTES).unwrap().unwrap();
        assert!(matches!(
            Request::decode(&frame),
            Err(DecodeError::Truncated { .. })
        ));
    }

    #[test]
    fn partial_frame_waits_for_more_bytes() {
        let mut wire = Vec::new();
        Request::Stats.encode(1, &mut wire);
        Request::Seal {
            handles: vec![handle(2)],
        }
        .encode(2, &mut wire);
        for cut in 0..wire.len() {
            let parsed = Frame::parse(&wire[..cut], MAX_PAYLOAD_BYTES).unwrap();
            if cut < HEADER_BYTES {
                assert!(parsed.is_none());
            } else {
                assert_eq!(
                    parsed.is_some(),
                    cut >= HEADER_BYTES,
                    "stats has no payload"
                );
            }
        }
    }

    proptest! {
        /// Whatever bytes a peer sends, decoding returns an error or a value; it never panics.
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            if let Ok(Some(frame)) = Frame::parse(&bytes, MAX_PAYLOAD_BYTES) {
                let _ = Request::decode(&frame);
                let _ = Response::decode(&frame);
            }
        }

        /// A valid header followed by arbitrary payload bytes never panics either.
        #[test]
        fn arbitrary_payload_never_panics(
            opcode in 0u16..16,
            reply in any::<bool>(),
            payload in proptest::collection::vec(any::<u8>(), 0..128),
        ) {
            let mut wire = Vec::new();
            let start = begin(&mut wire, opcode | if reply { REPLY_BIT } else { 0 }, 1);
            wire.extend_from_slice(&payload);
            finish(&mut wire, start);
            let frame = Frame::parse(&wire, MAX_PAYLOAD_BYTES).unwrap().unwrap();
            let _ = Request::decode(&frame);
            let _ = Response::decode(&frame);
        }
    }
}
