//! What a daemon hands to its successor (`feedstored --takeover`): the object table in one
//! format both must agree on. It crosses the daemon's own socket once, between two processes of
//! the daemon's uid, with the segments' and the listeners' descriptors beside it
//! (`SCM_RIGHTS`); the successor maps the same memory, so every handle, view and reservation
//! stays what it was.
//!
//! What is handed over is what clients hold by handle: every live object (sealed or being
//! written), where it lives, who wrote it, and the leases and reservations of each client
//! process (by its [process key](HandedProcess::key): the successor gives them back to that
//! process's new connections, and drops them when it exits; the pidfds that tell it so follow
//! the hand-over, a process in another pid namespace included). Streams are not: their readers and producers set them up again
//! on the successor as after a crash (a rank attaches at its next sample), so their samples
//! made ahead are made again.

use crate::Handle;
use crate::wire::{DecodeError, Reader, Wire, Writer};

/// This build's format of the hand-over. A successor refuses any other (before the daemon it
/// would replace stops serving anything), naming both.
pub const HANDOVER_FORMAT: u32 = 3;

/// Bit 62 of a [process key](HandedProcess::key): the rest is a pid (no pidfs here).
pub const PID_KEY: u64 = 1 << 62;
/// Bit 63 of a process key: the rest numbers a process no new connection can be recognised as
/// (held for until it exits, where its pidfd says so, or else until a daemon starts afresh).
pub const UNNAMED_KEY: u64 = 1 << 63;

/// One daemon's state, as its successor needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Handover {
    /// [`HANDOVER_FORMAT`] of the daemon that wrote it.
    pub format: u32,
    /// The pid of the daemon that wrote it.
    pub pid: u32,
    /// Its pid namespace (the inode of `/proc/self/ns/pid`; 0 unknown): pids, and keys made of
    /// pids, mean the same to the successor only in the same one.
    pub pid_namespace: u64,
    /// The node's id in handles.
    pub node_id: u32,
    /// The epoch handles carry: the successor keeps it, so handles stay valid.
    pub epoch: u32,
    /// The key object ids are drawn under, and how many were drawn: the successor goes on
    /// drawing where the daemon stopped (ids never repeat, and stay unpredictable).
    pub id_key: [u8; 32],
    /// Ids drawn so far.
    pub id_counter: u64,
    /// Each segment's size, in descriptor order.
    pub segments: Vec<u64>,
    /// Whether the segments are on hugetlbfs.
    pub hugetlb: bool,
    /// Which listeners' descriptors follow the segments' (the client socket's always does).
    pub peer_listener: bool,
    /// Whether the metrics listener's descriptor follows.
    pub metrics_listener: bool,
    /// Every live object, evictable ones in the order they would be evicted.
    pub objects: Vec<HandedObject>,
    /// Every client process holding a lease or a reservation; the pidfds of those that have
    /// one follow the hand-over's bytes, in this order.
    pub processes: Vec<HandedProcess>,
}

/// A client process the successor holds leases or reservations for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HandedProcess {
    /// What names the process on this node while it runs (the inode of its pidfd where the
    /// kernel has pidfs, whatever its pid namespace; else its pid with bit 62 set, which means
    /// the same only in the daemon's pid namespace; else, bit 63 set, a number that names no
    /// process a new connection could come from); what [`HandedObject::leases`] and
    /// [`HandedObject::writer`] refer to. Never 0.
    pub key: u64,
    /// Its pid in the daemon's pid namespace (0 in another): the successor watches it with
    /// `kill(pid, 0)` when there is no pidfd, in the same pid namespace only.
    pub pid: i32,
    /// Whether its pidfd follows (the successor polls it to learn that the process exited).
    pub pidfd: bool,
}

impl Wire for HandedProcess {
    const MIN_BYTES: usize = 8 + 4 + 1;
    fn encode(&self, w: &mut Writer<'_>) {
        w.u64(self.key);
        w.u32(self.pid as u32);
        w.bool(self.pidfd);
    }
    fn decode(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        Ok(HandedProcess {
            key: r.u64()?,
            pid: r.u32()? as i32,
            pidfd: r.bool("pidfd")?,
        })
    }
}

/// One live object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HandedObject {
    /// Its random id (the handle's).
    pub id: u64,
    /// The segment it lives in.
    pub segment: u32,
    /// Where its reserved block starts in the segment.
    pub offset: u64,
    /// The block's reserved length.
    pub reserved: u64,
    /// The object's length.
    pub len: u64,
    /// Being written by a process (its [key](HandedProcess::key)): it may seal or abort it
    /// from a new connection. `None`: sealed.
    pub writer: Option<u64>,
    /// Never evicted.
    pub pinned: bool,
    /// Deleted, freed when the last lease goes.
    pub delete_pending: bool,
    /// For a copy of another node's object, that object's handle.
    pub origin: Option<Handle>,
    /// The uid that wrote it.
    pub creator: u32,
    /// Leases held, by client process: ([key](HandedProcess::key), count).
    pub leases: Vec<(u64, u32)>,
}

impl Wire for HandedObject {
    const MIN_BYTES: usize = 8 + 4 + 8 * 3 + 1 + 1 + 1 + 1 + 4 + 4;
    fn encode(&self, w: &mut Writer<'_>) {
        w.u64(self.id);
        w.u32(self.segment);
        w.u64(self.offset);
        w.u64(self.reserved);
        w.u64(self.len);
        match self.writer {
            Some(key) => {
                w.bool(true);
                w.u64(key);
            }
            None => w.bool(false),
        }
        w.bool(self.pinned);
        w.bool(self.delete_pending);
        match self.origin {
            Some(h) => {
                w.bool(true);
                w.u128(u128::from_le_bytes(h.to_bytes()));
            }
            None => w.bool(false),
        }
        w.u32(self.creator);
        w.count(self.leases.len());
        for &(key, count) in &self.leases {
            w.u64(key);
            w.u32(count);
        }
    }
    fn decode(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        let (id, segment, offset, reserved, len) =
            (r.u64()?, r.u32()?, r.u64()?, r.u64()?, r.u64()?);
        let writer = if r.bool("writer")? {
            Some(r.u64()?)
        } else {
            None
        };
        let (pinned, delete_pending) = (r.bool("pinned")?, r.bool("delete pending")?);
        let origin = if r.bool("origin")? {
            Some(Handle::from_bytes(r.u128()?.to_le_bytes()))
        } else {
            None
        };
        let creator = r.u32()?;
        let n = r.count(12)?;
        let leases = (0..n)
            .map(|_| Ok((r.u64()?, r.u32()?)))
            .collect::<Result<_, DecodeError>>()?;
        Ok(HandedObject {
            id,
            segment,
            offset,
            reserved,
            len,
            writer,
            pinned,
            delete_pending,
            origin,
            creator,
            leases,
        })
    }
}

impl Handover {
    /// The bytes sent: the format first, so that a successor of another format can say which
    /// before it reads anything else.
    pub fn encode(&self) -> Vec<u8> {
        let mut buf = Vec::with_capacity(64 + self.objects.len() * 72);
        let mut w = Writer::new(&mut buf);
        w.u32(self.format);
        w.u32(self.pid);
        w.u64(self.pid_namespace);
        w.u32(self.node_id);
        w.u32(self.epoch);
        w.buf.extend_from_slice(&self.id_key);
        w.u64(self.id_counter);
        w.count(self.segments.len());
        for &size in &self.segments {
            w.u64(size);
        }
        w.bool(self.hugetlb);
        w.bool(self.peer_listener);
        w.bool(self.metrics_listener);
        w.list(&self.objects);
        w.list(&self.processes);
        buf
    }

    /// Reads what [`Handover::encode`] wrote; [`HandoverError::Format`] for another format's.
    pub fn decode(bytes: &[u8]) -> Result<Handover, HandoverError> {
        let mut r = Reader::new(bytes);
        let format = r.u32()?;
        if format != HANDOVER_FORMAT {
            return Err(HandoverError::Format {
                theirs: format,
                ours: HANDOVER_FORMAT,
            });
        }
        let (pid, pid_namespace) = (r.u32()?, r.u64()?);
        let (node_id, epoch) = (r.u32()?, r.u32()?);
        let id_key = r.bytes(32)?.try_into().expect("32 bytes");
        let id_counter = r.u64()?;
        let n = r.count(8)?;
        let segments = (0..n).map(|_| r.u64()).collect::<Result<_, _>>()?;
        let hugetlb = r.bool("hugetlb")?;
        let peer_listener = r.bool("peer listener")?;
        let metrics_listener = r.bool("metrics listener")?;
        let objects = r.list()?;
        let processes = r.list()?;
        r.finish()?;
        Ok(Handover {
            format,
            pid,
            pid_namespace,
            node_id,
            epoch,
            id_key,
            id_counter,
            segments,
            hugetlb,
            peer_listener,
            metrics_listener,
            objects,
            processes,
        })
    }
}

/// Why a hand-over cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum HandoverError {
    /// Written by a daemon of another hand-over format.
    #[error(
        "the running daemon hands over its state in format {theirs}, this one reads format \
         {ours}: stop it and start this one instead (its clients reconnect; objects it held are \
         lost)"
    )]
    Format {
        /// The running daemon's.
        theirs: u32,
        /// This build's.
        ours: u32,
    },
    /// Malformed.
    #[error("malformed hand-over")]
    Decode(#[from] DecodeError),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_handover_reads_back_as_written_and_another_format_is_named() {
        let h = Handover {
            format: HANDOVER_FORMAT,
            pid: 4242,
            pid_namespace: 4026531836,
            node_id: 7,
            epoch: 0xdead_beef,
            id_key: [3; 32],
            id_counter: 41,
            segments: vec![1 << 30, 1 << 29],
            hugetlb: false,
            peer_listener: true,
            metrics_listener: false,
            objects: vec![
                HandedObject {
                    id: 9,
                    segment: 1,
                    offset: 4096,
                    reserved: 8192,
                    len: 5000,
                    writer: None,
                    pinned: true,
                    delete_pending: false,
                    origin: Some(Handle {
                        node_id: 2,
                        epoch: 3,
                        id: 4,
                    }),
                    creator: 1000,
                    leases: vec![(1234, 2), (1 << 40, 1)],
                },
                HandedObject {
                    id: 10,
                    segment: 0,
                    offset: 0,
                    reserved: 64,
                    len: 1,
                    writer: Some(99),
                    pinned: false,
                    delete_pending: false,
                    origin: None,
                    creator: 0,
                    leases: vec![],
                },
            ],
            processes: vec![
                HandedProcess {
                    key: 1234,
                    pid: 77,
                    pidfd: true,
                },
                HandedProcess {
                    key: 1 << 40,
                    pid: 0,
                    pidfd: false,
                },
            ],
        };
        let bytes = h.encode();
        assert_eq!(Handover::decode(&bytes).unwrap(), h);
        for cut in 0..bytes.len() {
            assert!(Handover::decode(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        let mut other = bytes.clone();
        other[0] = 2;
        let e = Handover::decode(&other).unwrap_err();
        assert!(
            matches!(e, HandoverError::Format { theirs: 2, ours: 3 }),
            "{e}"
        );
    }
}
