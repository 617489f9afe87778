//! Ranks another node owns: this node's producers feed them through a feeder (in the daemon's
//! cluster code) that joins the owner's stream, asks it for tasks and hands the samples over.
//! Here is what the feeder asks and is told: demand, grants, the outbox of samples to forward.

use std::collections::HashMap;
use std::time::Instant;

use feedstore_proto::frame::{StreamItem, StreamTask};
use feedstore_proto::ring::ENTRY_FAILED;
use feedstore_proto::stream::StreamSpec;

use super::Streams;
use crate::objects::{ConnId, Objects};

/// Ranks of a stream another node's daemon owns, fed by this node's producers.
#[derive(Debug, Default)]
pub(super) struct Remote {
    /// The stream's id on the owner, while a session has it joined.
    pub(super) id: Option<u32>,
    /// The owner said its ranks need nothing more.
    pub(super) ended: bool,
    /// Samples made here for its ranks (sealed, leased by the stream) to hand over.
    pub(super) outbox: Vec<StreamItem>,
    /// How many of its ranks the owner was told of (a producer joining later with more ranks
    /// makes the feeder join again).
    pub(super) joined_ranks: usize,
    /// The feeder is telling the owner this node's producers left.
    pub(super) leaving: bool,
    /// A producer joined while the feeder was leaving: it joins again instead of ending.
    pub(super) wanted: bool,
}

/// Samples made here for another node's ranks, to be pulled by that node: the stream leases
/// each until the owner has answered for it.
#[derive(Debug)]
pub struct Forward {
    /// The owner.
    pub node: u32,
    /// The stream's id there.
    pub remote_stream: u32,
    /// The connection holding the leases.
    pub leases: ConnId,
    /// The node the owner pulls them through, if not from here.
    pub relay: Option<u32>,
    /// The samples.
    pub items: Vec<StreamItem>,
}

/// Where a producer's ranks live, and how their samples travel.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Placement {
    /// The node owning each rank that is not this node's.
    pub owners: HashMap<u32, u32>,
    /// A node every sample for another node passes through (the `relay` placement: the
    /// owner pulls from it, and it from the producer's node); `None` pulls straight from here.
    pub relay: Option<u32>,
}

/// Whether a node's feeder for a stream should go on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Demand {
    /// Ask the owner for this many tasks.
    Tasks(u32),
    /// Producers here now serve more of the owner's ranks than it was told of: join again.
    Rejoin,
    /// Enough granted tasks wait for this node's producers.
    Full,
    /// No producer here serves the stream any more (or it is gone): leave.
    Leave,
}

impl Streams {
    /// What a feeder joins `node` with for stream `id`: the owner's uid, the spec, the depth
    /// and where each of the ranks `node` owns starts. `None` once the stream is gone.
    pub fn remote_join(
        &self,
        id: u32,
        node: u32,
    ) -> Option<(u32, StreamSpec, u32, Vec<StreamTask>)> {
        let stream = self.streams.get(&id)?;
        stream.remotes.get(&node)?;
        let ranks = stream
            .ranks
            .iter()
            .filter(|(_, r)| r.owner == Some(node))
            .map(|(&rank, r)| StreamTask {
                rank,
                seq: r.released,
            })
            .collect();
        Some((stream.owner_uid, stream.spec.clone(), stream.depth, ranks))
    }

    /// `node` has the stream joined as `remote_stream`, told of `ranks` of its ranks (`None`:
    /// the session was lost, and with it the tasks it had granted, which that node makes
    /// available again).
    pub fn remote_joined(&mut self, id: u32, node: u32, remote_stream: Option<u32>, ranks: usize) {
        let Some(stream) = self.streams.get_mut(&id) else {
            return;
        };
        let Some(remote) = stream.remotes.get_mut(&node) else {
            return;
        };
        remote.id = remote_stream;
        remote.joined_ranks = ranks;
        if remote_stream.is_none() {
            for r in stream.ranks.values_mut().filter(|r| r.owner == Some(node)) {
                r.redo.clear();
            }
        }
        self.changed();
    }

    /// How many tasks the feeder of `node`'s ranks should ask for: enough to keep this node's
    /// producers busy, not so many that other nodes' producers go without.
    pub fn demand(&self, id: u32, node: u32) -> Demand {
        let Some(stream) = self.streams.get(&id) else {
            return Demand::Leave;
        };
        let local = stream
            .producers
            .iter()
            .filter(|c| !self.sessions.contains(c))
            .count();
        if local == 0 || !stream.remotes.contains_key(&node) {
            return Demand::Leave;
        }
        let owned = stream.ranks.values().filter(|r| r.owner == Some(node));
        if owned.clone().count() > stream.remotes[&node].joined_ranks {
            return Demand::Rejoin;
        }
        let waiting: usize = owned.map(|r| r.redo.len()).sum();
        let target = (local * 8).clamp(8, 1024);
        match target.saturating_sub(waiting) {
            0 => Demand::Full,
            n => Demand::Tasks(n as u32),
        }
    }

    /// Tasks `node` granted for its ranks: this node's producers take them next.
    pub fn grant(&mut self, id: u32, node: u32, tasks: &[StreamTask]) {
        let Some(stream) = self.streams.get_mut(&id) else {
            return;
        };
        for task in tasks {
            if let Some(r) = stream.ranks.get_mut(&task.rank)
                && r.owner == Some(node)
                && !r.assigned.contains_key(&task.seq)
            {
                r.redo.insert(task.seq);
            }
        }
        stream.last_used = Instant::now();
        self.changed();
    }

    /// `node` needs nothing more for its ranks of the stream.
    pub fn remote_ended(&mut self, id: u32, node: u32) {
        if let Some(remote) = self
            .streams
            .get_mut(&id)
            .and_then(|s| s.remotes.get_mut(&node))
        {
            remote.ended = true;
            self.changed();
        }
    }

    /// The feeder of `node` starts leaving, if no producer here serves the stream any more
    /// (checked under the same lock): granted tasks are forgotten (the owner takes them back
    /// when told), and samples made meanwhile are not handed over. `false`: producers are back.
    pub fn begin_leave(&mut self, id: u32, node: u32) -> bool {
        if self.demand(id, node) != Demand::Leave {
            return false;
        }
        let Some(stream) = self.streams.get_mut(&id) else {
            return true;
        };
        if let Some(remote) = stream.remotes.get_mut(&node) {
            remote.leaving = true;
            remote.wanted = false;
            remote.id = None;
            for r in stream.ranks.values_mut().filter(|r| r.owner == Some(node)) {
                r.redo.clear();
            }
            self.changed();
        }
        true
    }

    /// The owner was told: the feeder ends (`true`), unless a producer joined meanwhile
    /// (`false`: it joins again; a producer joining after this starts a new feeder).
    pub fn end_leave(&mut self, id: u32, node: u32) -> bool {
        let Some(stream) = self.streams.get_mut(&id) else {
            return true;
        };
        let Some(remote) = stream.remotes.get_mut(&node) else {
            return true;
        };
        if remote.wanted {
            remote.leaving = false;
            remote.wanted = false;
            remote.joined_ranks = 0;
            return false;
        }
        stream.remotes.remove(&node);
        self.changed();
        true
    }

    /// Takes the samples waiting to be handed to other nodes. Those whose owner has no session
    /// now are dropped with their leases (the owner made their tasks available again when the
    /// session was lost).
    pub fn forwards(&mut self, objects: &mut Objects) -> Vec<Forward> {
        let mut out = Vec::new();
        for stream in self.streams.values_mut() {
            for (&node, remote) in &mut stream.remotes {
                if remote.outbox.is_empty() {
                    continue;
                }
                let items = std::mem::take(&mut remote.outbox);
                match remote.id {
                    Some(remote_stream) => out.push(Forward {
                        node,
                        remote_stream,
                        leases: stream.leases,
                        relay: stream.relay,
                        items,
                    }),
                    None => {
                        for item in items.iter().filter(|i| i.flags & ENTRY_FAILED == 0) {
                            let _ = objects.release(stream.leases, item.handle);
                        }
                    }
                }
            }
        }
        out
    }

    /// Marks `conn` as another node's stream session (see [`Streams::demand`]).
    pub fn register_session(&mut self, conn: ConnId) {
        self.sessions.insert(conn);
    }
}
