//! A producer's side of a stream ([`StreamFeeder`]): join it, take tasks, make samples, and
//! put them, one at a time or pipelined ([`PendingPut`]).

use super::*;
use crate::client::gone;

/// A producer's handle on a stream: take tasks, make samples, put them.
///
/// On a client that reconnects ([`crate::ConnectOptions::reconnect_timeout`]), a feeder whose
/// daemon went away joins the stream again on the daemon started in its place, as it joined
/// the first time (the same ranks, starting where they were given: each rank's consumer,
/// attaching again at its next sample, moves it there, and the tasks handed out before that
/// are refused as [`Error::Stale`] when put). A put sent to the daemon that went away reports
/// each of its samples as [`Error::Stale`]: the new daemon hands their tasks out again.
#[derive(Debug, Clone)]
pub struct StreamFeeder {
    client: Client,
    spec: StreamSpec,
    /// How it joined: how it joins again.
    join: Arc<Join>,
    /// The stream's id on the daemon of the client's link of that generation.
    joined: Arc<Mutex<Joined>>,
}

#[derive(Debug)]
struct Join {
    depth: u32,
    batch: u32,
    ranks: Vec<StreamTask>,
    at: Vec<RankAt>,
    relay: String,
}

#[derive(Debug, Clone, Copy)]
struct Joined {
    id: u32,
    generation: u64,
}

/// A sample for a task, ready to put.
#[derive(Debug)]
pub struct Delivery {
    /// The task it fulfils.
    pub task: StreamTask,
    /// The record it was made from.
    pub record: u64,
    /// Its decode-once cache key (`feedstore_proto::stream::sample_key`); 0 for none.
    pub key: u128,
    /// The sample.
    pub made: Made,
}

/// How a sample for a task was made.
#[derive(Debug)]
pub enum Made {
    /// A sample written into a reservation of the feeder's client (sealed by the put).
    Written(ObjectWriter),
    /// An existing sealed object (a cached sample).
    Existing(Handle),
    /// A sample inside an object another delivery of the same put writes ([`Made::Written`],
    /// earlier in the list), starting `offset` bytes in and running to the object's end: the
    /// second and later samples of a batch placed in one object by a
    /// [`feedstore_proto::sample::BatchPlan`] (see [`StreamFeeder::put_batch`]).
    Part {
        /// The object's handle.
        handle: Handle,
        /// Where the sample starts ([`feedstore_proto::sample::BatchPlan::start`]).
        offset: u64,
    },
    /// No candidate record made a sample.
    Failed,
}

/// A stream put sent without waiting for its reply ([`StreamFeeder::submit_put`]).
///
/// Dropping it unread waits for the reply as [`PendingPut::wait`] does (aborting what the
/// stream did not take) and drops the outcome.
#[must_use = "a put's outcome is only known once waited for"]
pub struct PendingPut {
    client: Client,
    /// The generation of the client's link it was sent on.
    generation: u64,
    items: Vec<StreamItem>,
    /// Per item: its object is a reservation of this client (aborted if no item takes it).
    reserved: Vec<bool>,
    /// The requests sent and not read yet, with how many items each carries, oldest first.
    sent: VecDeque<(crate::client::Ticket, usize)>,
    /// Per item of the requests read so far, the daemon's status (`None` where its chunk
    /// failed as a whole).
    statuses: Vec<Option<Status>>,
    /// The first failure: a chunk that could not be sent (the later ones were not), or failed.
    failure: Option<Error>,
    done: bool,
}

/// Chunks of one put sent before the oldest one's reply is read: a bounded share of the
/// connection's requests, and of the replies the daemon's socket holds while it waits.
const PUT_CHUNKS_AHEAD: usize = 4;

impl PendingPut {
    /// Waits for the daemon's replies: per item `Ok`, or why the stream did not take it, as
    /// [`StreamFeeder::put`] returns. Reservations no item took are given back.
    pub fn wait(mut self) -> Result<Vec<Result<(), Error>>, Error> {
        self.finish()
    }

    /// Reads the reply of the oldest request sent. Every reply is read, so none is left for a
    /// later call to set aside, and a chunk served after a failed one still counts what it took.
    fn read_oldest(&mut self) {
        let Some((ticket, len)) = self.sent.pop_front() else {
            return;
        };
        match self.client.collect(ticket) {
            Ok(Response::Done(s)) if s.len() == len => {
                self.statuses.extend(s.into_iter().map(Some));
                return;
            }
            Ok(other) => {
                let e = Error::Protocol(format!("unexpected reply {other:?}"));
                self.failure.get_or_insert(e);
            }
            Err(e) => {
                self.failure.get_or_insert(e);
            }
        }
        self.statuses.extend(std::iter::repeat_n(None, len));
    }

    fn finish(&mut self) -> Result<Vec<Result<(), Error>>, Error> {
        self.done = true;
        while !self.sent.is_empty() {
            self.read_oldest();
        }
        let mut statuses = std::mem::take(&mut self.statuses);
        let mut failure = self.failure.take();
        if failure.as_ref().is_some_and(gone) && self.client.reconnecting() {
            // Sent to a daemon that went away: whatever it took went with it, and its
            // successor hands the tasks out again.
            failure = None;
            statuses = vec![Some(Status::Stale); self.items.len()];
        }
        // An object no item of which was taken (several items share a batch's object).
        let taken: HashSet<Handle> = self
            .items
            .iter()
            .zip(&statuses)
            .filter(|(_, s)| **s == Some(Status::Ok))
            .map(|(item, _)| item.handle)
            .collect();
        let abort: Vec<Handle> = self
            .items
            .iter()
            .zip(&self.reserved)
            .filter(|(item, written)| **written && !taken.contains(&item.handle))
            .map(|(item, _)| item.handle)
            .collect();
        if !abort.is_empty() {
            // Best effort: whatever is not aborted here is aborted when the connection ends.
            let _ = self
                .client
                .each(Opcode::Abort, &abort, |handles| Request::Abort { handles });
        }
        if let Some(e) = failure {
            return Err(e);
        }
        Ok(self
            .items
            .iter()
            .zip(statuses)
            .map(|(item, s)| match s {
                Some(Status::Ok) => Ok(()),
                Some(s) => Err(Error::from_status(s, item.handle, 0, "")),
                None => unreachable!("a chunk that failed as a whole is the put's failure"),
            })
            .collect())
    }
}

impl std::fmt::Debug for PendingPut {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PendingPut")
            .field("items", &self.items.len())
            .field("requests", &self.sent.len())
            .finish()
    }
}

impl Drop for PendingPut {
    fn drop(&mut self) {
        if !self.done
            && let Err(e) = self.finish()
        {
            tracing::debug!(error = %e, "a stream put dropped unread failed");
        }
    }
}

impl StreamFeeder {
    /// Joins a stream to make samples for some ranks on `client` (a writer), creating the
    /// stream if it is new. Each rank the daemon does not know yet starts at the sequence
    /// number given with it (its consumer's checkpointed state, 0 for a fresh run).
    pub fn join(
        client: &Client,
        spec: &StreamSpec,
        depth: u32,
        ranks: &[StreamTask],
    ) -> Result<StreamFeeder, Error> {
        Self::join_at(client, spec, depth, ranks, &[], "")
    }

    /// [`StreamFeeder::join`] for a stream whose ranks live on several nodes: `at` names, for
    /// each rank another node's daemon serves, that daemon's peer address (`host:port` of its
    /// `--listen`). This node's daemon joins the stream there over the peer connection, takes
    /// tasks for those ranks and hands the samples made here to that node, which pulls them.
    /// A non-empty `relay` (a peer address) sends every such sample through that node first,
    /// as a data loader relaying through a coordinator would (the seed's "before"; for
    /// comparisons, never faster).
    pub fn join_at(
        client: &Client,
        spec: &StreamSpec,
        depth: u32,
        ranks: &[StreamTask],
        at: &[RankAt],
        relay: &str,
    ) -> Result<StreamFeeder, Error> {
        Self::join_batched_at(client, spec, depth, 0, ranks, at, relay)
    }

    /// [`StreamFeeder::join`] for a producer that places each batch of `batch` samples of a
    /// rank in one object ([`StreamFeeder::put_batch`]): if the stream is new, its ranks hand
    /// out tasks a whole batch at a time (sequence numbers `k·batch .. (k+1)·batch`, all to one
    /// producer; `batch` at most 1024, `depth` at least `batch`, and twice it lets the next
    /// batch be made while a trainer holds one). A stream that exists keeps its batch size. A consumer reading whole batches from a
    /// multiple of `batch` then gets each batch's images as one stacked view
    /// ([`stacked_image`]).
    pub fn join_batched(
        client: &Client,
        spec: &StreamSpec,
        depth: u32,
        batch: u32,
        ranks: &[StreamTask],
    ) -> Result<StreamFeeder, Error> {
        Self::join_batched_at(client, spec, depth, batch, ranks, &[], "")
    }

    /// [`StreamFeeder::join_batched`] and [`StreamFeeder::join_at`] together (batches are
    /// handed out whole for this node's ranks only).
    pub fn join_batched_at(
        client: &Client,
        spec: &StreamSpec,
        depth: u32,
        batch: u32,
        ranks: &[StreamTask],
        at: &[RankAt],
        relay: &str,
    ) -> Result<StreamFeeder, Error> {
        let join = Join {
            depth,
            batch,
            ranks: ranks.to_vec(),
            at: at.to_vec(),
            relay: relay.to_owned(),
        };
        let joined = Self::join_with(client, spec, &join)?;
        Ok(StreamFeeder {
            client: client.clone(),
            spec: spec.clone(),
            join: Arc::new(join),
            joined: Arc::new(Mutex::new(joined)),
        })
    }

    fn join_with(client: &Client, spec: &StreamSpec, join: &Join) -> Result<Joined, Error> {
        super::can_send(client, spec)?;
        let request = Request::StreamJoin {
            spec: spec.clone(),
            depth: join.depth,
            batch: join.batch,
            ranks: join.ranks.clone(),
            at: join.at.clone(),
            relay: join.relay.clone(),
        };
        match client.call_linked(&request)? {
            (Response::StreamJoined { stream }, link) => Ok(Joined {
                id: stream,
                generation: link.generation(),
            }),
            (other, _) => Err(Error::Protocol(format!("unexpected reply {other:?}"))),
        }
    }

    fn joined(&self) -> Joined {
        *self.joined.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Joins the stream again on the client's new link, once per link for all the clones of
    /// this feeder: the stream joined on the link of `generation` went away with its daemon.
    fn rejoin(&self, generation: u64) -> Result<(), Error> {
        let mut joined = self.joined.lock().unwrap_or_else(|e| e.into_inner());
        if joined.generation != generation {
            return Ok(()); // another clone did
        }
        self.client.reconnect()?;
        *joined = Self::join_with(&self.client, &self.spec, &self.join)?;
        tracing::warn!(stream = %self.spec.name, id = joined.id, ranks = self.join.ranks.len(), "feedstored restarted: joined the stream again");
        Ok(())
    }

    /// Whether `e` says the daemon of the stream's join went away (or the client left it
    /// already) and the client reconnects: the stream must be joined again on its successor.
    fn moved_on(&self, e: &Error) -> bool {
        gone(e) && self.client.reconnecting()
    }

    /// A call naming the stream (`make` builds it for the stream's id), joining the stream
    /// again first if the daemon went away and the client reconnected.
    fn on_stream(&self, make: impl Fn(u32) -> Request) -> Result<Response, Error> {
        let mut tries = 0;
        loop {
            let Joined { id, generation } = self.joined();
            match self.client.call_bound(generation, &make(id)) {
                Err(e) if tries < 3 && self.moved_on(&e) => {
                    tries += 1;
                    self.rejoin(generation)?;
                }
                other => return other,
            }
        }
    }

    /// Whether `other` puts on the same connection as this feeder.
    pub fn same_connection(&self, other: &StreamFeeder) -> bool {
        Arc::ptr_eq(&self.client.inner, &other.client.inner)
    }

    /// The stream's spec.
    pub fn spec(&self) -> &StreamSpec {
        &self.spec
    }

    /// Up to `max` tasks, waiting up to `wait` while every prefetch window is full. `None`
    /// once the stream has no work left.
    pub fn take(&self, max: u32, wait: Duration) -> Result<Option<Vec<StreamTask>>, Error> {
        let timeout_ms = wait.as_millis().min(u128::from(u32::MAX)) as u32;
        let request = |stream| {
            Request::StreamTake(TakeTasks {
                stream,
                max,
                timeout_ms,
            })
        };
        match self.on_stream(request) {
            Ok(Response::Tasks(tasks)) => Ok(Some(tasks)),
            Ok(other) => Err(Error::Protocol(format!("unexpected reply {other:?}"))),
            Err(Error::Ended) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Reports the producer's figures to the daemon (one-way: no round trip), for `feedstore
    /// top` and the metrics.
    pub fn report(&self, figures: &ProducerFigures) -> Result<(), Error> {
        let Joined { id, generation } = self.joined();
        let request = Request::ProducerReport {
            stream: id,
            figures: *figures,
        };
        self.client.send_one_way(&request, generation)
    }

    /// Looks samples up in the daemon's decode-once cache: per key, the handle of the sample if
    /// the store still holds it (put it as [`Made::Existing`]).
    pub fn lookup(&self, keys: &[u128]) -> Result<Vec<Option<Handle>>, Error> {
        self.client.cache_lookup(keys)
    }

    /// Puts samples, one per task. Per item: `Ok`, or why the stream did not take it (a
    /// resume moved the window past it, say); reservations not taken are aborted. An error as a
    /// whole (the stream closed, the daemon gone) aborts every reservation not yet put; with
    /// more items than fit one frame, other chunks may have been put.
    pub fn put(&self, deliveries: Vec<Delivery>) -> Result<Vec<Result<(), Error>>, Error> {
        self.submit_put(deliveries)?.wait()
    }

    /// [`StreamFeeder::put`] without waiting for the daemon's reply: the put is sent, and
    /// [`PendingPut::wait`] reads what the daemon made of it. A producer that sends one put,
    /// makes its next sample and only then reads the reply (which by then has usually arrived,
    /// read aside by the reservation of that next sample) waits for one round trip per sample
    /// instead of two.
    ///
    /// The daemon serves a connection's requests in order: a put sent here is served (its
    /// samples sealed and published to their ranks) before any later request of this client,
    /// and a consumer sees them as soon as it is served, reply read or not. Fails at once only
    /// for a delivery that names an object a live writer of this client still holds (its
    /// reservations are aborted as they drop); a failure to send is reported by `wait`. A put
    /// larger than four frames reads its earlier chunks' replies as it sends the later ones.
    pub fn submit_put(&self, deliveries: Vec<Delivery>) -> Result<PendingPut, Error> {
        // A sample may name an object by handle only once its writer is done with it: the put
        // seals this client's reservations, and a live `ObjectWriter` could still change bytes
        // readers then see. Its own `Made::Written` in this put hands the writer over.
        let handing_over: HashSet<Handle> = deliveries
            .iter()
            .filter_map(|d| match &d.made {
                Made::Written(w) => Some(w.handle()),
                _ => None,
            })
            .collect();
        {
            let live = self
                .client
                .inner
                .writers
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            for d in &deliveries {
                if let Made::Existing(h) | Made::Part { handle: h, .. } = &d.made
                    && live.contains(h)
                    && !handing_over.contains(h)
                {
                    return Err(Error::InvalidArgument(format!(
                        "object {h} is still being written by an ObjectWriter of this client: \
                         put it as Made::Written (or seal it) first"
                    )));
                }
            }
        }
        let mut items = Vec::with_capacity(deliveries.len());
        let mut reserved = Vec::with_capacity(deliveries.len());
        for Delivery {
            task,
            record,
            key,
            made,
        } in deliveries
        {
            let (handle, flags, written, offset) = match made {
                Made::Written(w) => (w.hand_over(), 0, true, 0),
                Made::Existing(h) => (h, 0, false, 0),
                Made::Part { handle, offset } => (handle, 0, false, offset),
                Made::Failed => (Handle::default(), ENTRY_FAILED, false, 0),
            };
            items.push(StreamItem {
                task,
                handle,
                record,
                flags,
                key,
                offset,
            });
            reserved.push(written);
        }
        // One request per chunk that fits a frame. A chunk that cannot be sent leaves its own
        // and the later chunks' reservations unput: `wait` aborts them.
        let mut joined = self.joined();
        let mut rejoins = 0;
        let mut pending = PendingPut {
            client: self.client.clone(),
            generation: joined.generation,
            items,
            reserved,
            sent: VecDeque::new(),
            statuses: Vec::new(),
            failure: None,
            done: false,
        };
        let per_chunk = self.client.batch_items(Opcode::StreamPut);
        let mut at = 0;
        while at < pending.items.len() {
            if pending.sent.len() == PUT_CHUNKS_AHEAD {
                pending.read_oldest();
                // A chunk refused as a whole: the rest are not sent (`wait` aborts them).
                if pending.failure.is_some() {
                    break;
                }
            }
            let chunk = &pending.items[at..pending.items.len().min(at + per_chunk)];
            let request = Request::StreamPut {
                stream: joined.id,
                items: chunk.to_vec(),
            };
            match self.client.submit(&request, Some(joined.generation)) {
                Ok(ticket) => pending.sent.push_back((ticket, chunk.len())),
                // The daemon went away before any of it was sent: join its successor and put
                // there (the objects made on the old one it refuses, as its tasks are new).
                Err(e)
                    if at == 0 && rejoins < 3 && pending.sent.is_empty() && self.moved_on(&e) =>
                {
                    rejoins += 1;
                    self.rejoin(joined.generation)?;
                    joined = self.joined();
                    pending.generation = joined.generation;
                    continue;
                }
                Err(e) => {
                    pending.failure.get_or_insert(e);
                    break;
                }
            }
            at += per_chunk;
        }
        Ok(pending)
    }

    /// Puts a batch placed in one object: `tasks[i]` (with the record it was made from) is
    /// sample `i` of `plan`, written into `object` (reserved at `plan.object_bytes()` on this
    /// feeder's client, every sample finished). Per task: as [`StreamFeeder::put`]; the object
    /// is given back only if no task took it.
    pub fn put_batch(
        &self,
        tasks: &[(StreamTask, u64)],
        plan: &BatchPlan,
        object: ObjectWriter,
    ) -> Result<Vec<Result<(), Error>>, Error> {
        if tasks.len() != plan.len() || tasks.is_empty() {
            return Err(Error::InvalidArgument(format!(
                "{} tasks for a batch of {} samples",
                tasks.len(),
                plan.len()
            )));
        }
        let handle = object.handle();
        let mut object = Some(object);
        let deliveries = tasks
            .iter()
            .enumerate()
            .map(|(i, &(task, record))| Delivery {
                task,
                record,
                key: 0,
                made: match object.take() {
                    Some(w) => Made::Written(w),
                    None => Made::Part {
                        handle,
                        offset: plan.start(i),
                    },
                },
            })
            .collect();
        self.put(deliveries)
    }

    /// Closes the stream for everyone: its held samples go back to the store (views consumers
    /// still hold keep their own leases). Only writers of the uid that created the stream (or
    /// root) may.
    pub fn close(&self) -> Result<(), Error> {
        match self.on_stream(|stream| Request::StreamClose { stream })? {
            Response::Done(_) => Ok(()),
            other => Err(Error::Protocol(format!("unexpected reply {other:?}"))),
        }
    }
}
