//! The stream session between daemons: how producers on one node feed the ranks another node's
//! daemon owns.
//!
//! A connection whose connector set [`crate::peer::HELLO_STREAMS`] in its hello carries this
//! session instead of range reads. After the handshake both directions carry frames:
//!
//! ```text
//! u32 length of what follows (at most MAX_SESSION_FRAME) | u32 request id | u8 kind | body
//! ```
//!
//! The connector sends [`SessionRequest`]s, the acceptor answers each with one
//! [`SessionReply`] carrying the same id, in any order (a `Take` waits for work while `Put`s
//! are answered), so one connection serves every stream between two nodes. Bodies use the
//! client protocol's encodings of specs, tasks, items and takes.
//!
//! The acceptor (the daemon that owns the ranks) treats the session as one producer per uid:
//! what the session took and has not put goes back to the windows when it ends, however it
//! ends.

use crate::Status;
use crate::frame::{RESHARD_SINCE, StreamItem, StreamTask, TakeTasks};
use crate::stream::StreamSpec;
use crate::wire::{DecodeError, Reader, Wire, Writer, truncate};

/// The first peer protocol version whose joins may carry a resharded spec (a stream resumed at
/// another world size): such a join is a frame of its own kind, whose spec carries its
/// reshard as the client protocol does from [`RESHARD_SINCE`]. A connector never sends one on
/// a session of an older version.
pub const RESHARDED_SINCE: u16 = 4;

/// The largest frame (after its length word) either side sends or accepts.
pub const MAX_SESSION_FRAME: usize = 1 << 20;

/// The most tasks one `Take` may ask for, or one `Put` deliver (both fit a frame).
pub const MAX_SESSION_ITEMS: u32 = 4096;

/// The longest error message a reply carries.
pub const MAX_MESSAGE_BYTES: usize = 1024;

/// What the producers' daemon asks of the ranks' daemon.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SessionRequest {
    /// Producers of `uid` on the asking node serve `ranks` of the stream (created if new, with
    /// `depth`); each rank not yet known starts at its sequence number.
    Join {
        /// Whose stream (uids agree across the cluster's nodes).
        uid: u32,
        /// The stream.
        spec: StreamSpec,
        /// Prefetch depth per rank, if the stream is new.
        depth: u32,
        /// The ranks, owned by the answering node, with where each starts.
        ranks: Vec<StreamTask>,
    },
    /// Tasks of the joined ranks (the stream id from [`SessionReply::Joined`]); the client
    /// protocol's codec.
    Take(TakeTasks),
    /// Samples made on node `source`, sealed there: the answering node pulls each before it
    /// publishes it, and answers once each is in (or why not).
    Put {
        /// From [`SessionReply::Joined`].
        stream: u32,
        /// The node holding the bytes (the producer's, or a relay's).
        source: u32,
        /// The samples; each handle names an object of its producer's node.
        items: Vec<StreamItem>,
    },
    /// The asking node's producers left the stream: its tasks go back to the windows.
    Leave {
        /// From [`SessionReply::Joined`].
        stream: u32,
    },
}

/// The answer to one [`SessionRequest`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SessionReply {
    /// Joined; the stream's id on the answering node.
    Joined {
        /// The id later requests name.
        stream: u32,
    },
    /// Tasks (empty when none came before the timeout).
    Tasks(Vec<StreamTask>),
    /// Per item of a `Put`, or one `Ok` for a `Leave`.
    Done(Vec<Status>),
    /// The request failed as a whole (`Ended` once the stream has no work left).
    Failed {
        /// Why.
        status: Status,
        /// Detail for the log.
        message: String,
    },
}

const JOIN: u8 = 1;
const TAKE: u8 = 2;
const PUT: u8 = 3;
const LEAVE: u8 = 4;
/// A join whose spec is resharded (peer protocol [`RESHARDED_SINCE`] on).
const JOIN_RESHARDED: u8 = 5;
const JOINED: u8 = 101;
const TASKS: u8 = 102;
const DONE: u8 = 103;
const FAILED: u8 = 104;

/// Bytes before the body: length word, request id, kind.
pub const SESSION_HEADER_BYTES: usize = 9;

fn frame(id: u32, kind: u8, body: impl FnOnce(&mut Writer<'_>)) -> Vec<u8> {
    let mut buf = Vec::with_capacity(64);
    buf.extend_from_slice(&[0; 4]);
    buf.extend_from_slice(&id.to_le_bytes());
    buf.push(kind);
    body(&mut Writer::new(&mut buf));
    let len = (buf.len() - 4) as u32;
    buf[..4].copy_from_slice(&len.to_le_bytes());
    buf
}

/// The length word's value: refused when it exceeds [`MAX_SESSION_FRAME`] or cannot hold an id
/// and a kind.
pub fn frame_len(word: [u8; 4]) -> Result<usize, DecodeError> {
    let len = u32::from_le_bytes(word) as usize;
    if !(5..=MAX_SESSION_FRAME).contains(&len) {
        return Err(DecodeError::InvalidValue {
            field: "session frame length",
        });
    }
    Ok(len)
}

fn split(frame: &[u8]) -> Result<(u32, u8, Reader<'_>), DecodeError> {
    let mut r = Reader::new(frame);
    let id = r.u32()?;
    let kind = r.u8()?;
    Ok((id, kind, r))
}

fn bounded<T>(items: Vec<T>, field: &'static str) -> Result<Vec<T>, DecodeError> {
    if items.len() > MAX_SESSION_ITEMS as usize {
        return Err(DecodeError::InvalidValue { field });
    }
    Ok(items)
}

impl SessionRequest {
    /// The whole frame, length word first. Lists are bounded by [`MAX_SESSION_ITEMS`], which
    /// keeps every request inside [`MAX_SESSION_FRAME`].
    pub fn encode(&self, id: u32) -> Vec<u8> {
        match self {
            SessionRequest::Join {
                uid,
                spec,
                depth,
                ranks,
            } => {
                let kind = if spec.reshard.is_some() {
                    JOIN_RESHARDED
                } else {
                    JOIN
                };
                frame(id, kind, |w| {
                    w.u32(*uid);
                    let layout = w.version;
                    if kind == JOIN_RESHARDED {
                        w.version = RESHARD_SINCE;
                    }
                    spec.encode(w);
                    w.version = layout;
                    w.u32(*depth);
                    w.list(ranks);
                })
            }
            SessionRequest::Take(take) => frame(id, TAKE, |w| take.encode(w)),
            SessionRequest::Put {
                stream,
                source,
                items,
            } => frame(id, PUT, |w| {
                w.u32(*stream);
                w.u32(*source);
                w.list(items);
            }),
            SessionRequest::Leave { stream } => frame(id, LEAVE, |w| w.u32(*stream)),
        }
    }

    /// Parses a frame (after its length word) into its id and request.
    pub fn decode(frame: &[u8]) -> Result<(u32, SessionRequest), DecodeError> {
        let (id, kind, mut r) = split(frame)?;
        let request = match kind {
            JOIN | JOIN_RESHARDED => SessionRequest::Join {
                uid: r.u32()?,
                spec: {
                    let layout = r.version;
                    if kind == JOIN_RESHARDED {
                        r.version = RESHARD_SINCE;
                    }
                    let spec = StreamSpec::decode(&mut r)?;
                    r.version = layout;
                    if (kind == JOIN_RESHARDED) != spec.reshard.is_some() {
                        return Err(DecodeError::InvalidValue { field: "reshard" });
                    }
                    spec
                },
                depth: r.u32()?,
                ranks: bounded(r.list()?, "session ranks")?,
            },
            TAKE => SessionRequest::Take(TakeTasks::decode(&mut r)?),
            PUT => SessionRequest::Put {
                stream: r.u32()?,
                source: r.u32()?,
                items: bounded(r.list()?, "session items")?,
            },
            LEAVE => SessionRequest::Leave { stream: r.u32()? },
            _ => {
                return Err(DecodeError::InvalidValue {
                    field: "session request kind",
                });
            }
        };
        r.finish()?;
        Ok((id, request))
    }
}

impl SessionReply {
    /// The whole frame, length word first.
    pub fn encode(&self, id: u32) -> Vec<u8> {
        match self {
            SessionReply::Joined { stream } => frame(id, JOINED, |w| w.u32(*stream)),
            SessionReply::Tasks(tasks) => frame(id, TASKS, |w| w.list(tasks)),
            SessionReply::Done(statuses) => frame(id, DONE, |w| w.list(statuses)),
            SessionReply::Failed { status, message } => frame(id, FAILED, |w| {
                status.encode(w);
                w.string(truncate(message, MAX_MESSAGE_BYTES));
            }),
        }
    }

    /// Parses a frame (after its length word) into its id and reply.
    pub fn decode(frame: &[u8]) -> Result<(u32, SessionReply), DecodeError> {
        let (id, kind, mut r) = split(frame)?;
        let reply = match kind {
            JOINED => SessionReply::Joined { stream: r.u32()? },
            TASKS => SessionReply::Tasks(bounded(r.list()?, "session tasks")?),
            DONE => SessionReply::Done(bounded(r.list()?, "session statuses")?),
            FAILED => SessionReply::Failed {
                status: Status::decode(&mut r)?,
                message: r.string()?,
            },
            _ => {
                return Err(DecodeError::InvalidValue {
                    field: "session reply kind",
                });
            }
        };
        r.finish()?;
        Ok((id, reply))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Handle;
    use crate::stream::{Shuffle, Tail};

    fn spec() -> StreamSpec {
        StreamSpec {
            name: "s".into(),
            records: 10,
            seed: 3,
            world: 4,
            shuffle: Shuffle::Full,
            tail: Tail::Drop,
            epochs: Some(2),
            reshard: None,
        }
    }

    fn round_trip_request(req: SessionRequest) {
        let wire = req.encode(77);
        let len = frame_len(wire[..4].try_into().unwrap()).unwrap();
        assert_eq!(len, wire.len() - 4);
        assert_eq!(SessionRequest::decode(&wire[4..]).unwrap(), (77, req));
    }

    fn round_trip_reply(reply: SessionReply) {
        let wire = reply.encode(5);
        assert_eq!(SessionReply::decode(&wire[4..]).unwrap(), (5, reply));
    }

    #[test]
    fn requests_and_replies_round_trip() {
        let task = StreamTask { rank: 2, seq: 9 };
        round_trip_request(SessionRequest::Join {
            uid: 1000,
            spec: spec(),
            depth: 8,
            ranks: vec![task],
        });
        // A resharded spec travels in a join of its own kind, reshard and all.
        let old = spec();
        let states = [0, 1, 2, 3].map(|r| crate::stream::StreamState::at(&old, r, r.into()));
        let resharded = crate::reshard::Reshard::new(&old, &states, 3)
            .unwrap()
            .spec();
        let join = SessionRequest::Join {
            uid: 1000,
            spec: resharded.clone(),
            depth: 8,
            ranks: vec![task],
        };
        let wire = join.encode(1);
        assert_eq!(wire[8], JOIN_RESHARDED);
        round_trip_request(join);
        // (A plain join whose bytes claim the resharded kind, or the other way round, is
        // refused.)
        let mut plain = SessionRequest::Join {
            uid: 1000,
            spec: old,
            depth: 8,
            ranks: vec![task],
        }
        .encode(1);
        plain[8] = JOIN_RESHARDED;
        assert!(SessionRequest::decode(&plain[4..]).is_err());
        let mut claimed = wire;
        claimed[8] = JOIN;
        assert!(SessionRequest::decode(&claimed[4..]).is_err());
        round_trip_request(SessionRequest::Take(TakeTasks {
            stream: 3,
            max: 16,
            timeout_ms: 500,
        }));
        round_trip_request(SessionRequest::Put {
            stream: 3,
            source: 0xA1,
            items: vec![StreamItem {
                task,
                handle: Handle {
                    node_id: 0xA1,
                    epoch: 2,
                    id: 5 << 32 | 7,
                },
                record: 4,
                flags: 0,
                key: 99,
                offset: 128,
            }],
        });
        round_trip_request(SessionRequest::Leave { stream: 3 });
        round_trip_reply(SessionReply::Joined { stream: 4 });
        round_trip_reply(SessionReply::Tasks(vec![task, task]));
        round_trip_reply(SessionReply::Done(vec![Status::Ok, Status::Stale]));
        round_trip_reply(SessionReply::Failed {
            status: Status::Ended,
            message: "over".into(),
        });
    }

    #[test]
    fn forged_frames_are_refused() {
        assert!(frame_len(0u32.to_le_bytes()).is_err());
        assert!(frame_len(((MAX_SESSION_FRAME + 1) as u32).to_le_bytes()).is_err());
        // An unknown kind, a truncated body, a count larger than the frame, trailing bytes.
        assert!(SessionRequest::decode(&[1, 0, 0, 0, 9]).is_err());
        assert!(SessionRequest::decode(&[1, 0, 0, 0, TAKE, 1]).is_err());
        let mut put = SessionRequest::Put {
            stream: 1,
            source: 2,
            items: vec![],
        }
        .encode(1);
        let n = put.len();
        put[n - 4..].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(SessionRequest::decode(&put[4..]).is_err());
        let mut leave = SessionRequest::Leave { stream: 1 }.encode(1);
        leave.push(0);
        assert!(SessionRequest::decode(&leave[4..]).is_err());
        assert!(SessionReply::decode(&[1, 0, 0, 0, 200]).is_err());
    }
}
