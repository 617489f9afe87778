//! Streams from the client's side: a trainer rank reading its samples in order
//! ([`Stream`]), and a producer making them ([`StreamFeeder`]).
//!
//! A rank's samples arrive in a shared-memory ring the daemon fills (see
//! `feedstore_proto::ring`); [`Stream::next_sample`] reads the next slot and returns the sample in place,
//! without a round trip. Only when the ring has not caught up does it ask the daemon to wake it.
//! Dropped samples are returned in batches, which slides the rank's prefetch window.

use std::collections::{BTreeSet, HashSet, VecDeque};
use std::ops::Deref;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use feedstore_proto::frame::{
    self, Opcode, ProducerFigures, RankAt, RankFigures, Request, Response, StreamItem, StreamTask,
    TakeTasks,
};
use feedstore_proto::ring::{ENTRY_FAILED, RingEntry, RingHeader, RingWords};
use feedstore_proto::sample::{
    BatchPlan, DType, SampleError, SampleView, TensorLayout, side_by_side,
};
use feedstore_proto::stream::{StreamSpec, StreamState};
use feedstore_proto::{Handle, Status};
use feedstore_shm::{Access, Mapping, SharedBytes};

use crate::client::{Link, gone};
use crate::lease::{LeaseHold, leased_bytes};
use crate::{Client, ConnectOptions, Error, ObjectWriter, Role};

mod feeder;

pub use feeder::{Delivery, Made, PendingPut, StreamFeeder};

/// How a consumer opens its stream. (The prefetch depth is the stream's, set by the producer
/// that creates it.)
#[derive(Debug, Clone)]
pub struct StreamOptions {
    /// How long [`Stream::open`] waits for a producer to create the stream, and
    /// [`Stream::next_sample`] for a sample, before failing with [`Error::Timeout`].
    pub wait: Duration,
    /// Return dropped samples to the stream once this many are pending.
    pub return_batch: u32,
}

impl Default for StreamOptions {
    fn default() -> Self {
        StreamOptions {
            wait: Duration::from_secs(300),
            return_batch: 8,
        }
    }
}

/// How long one wait for the stream to appear lasts before the caller's interrupt check runs.
const ATTACH_SLICE: Duration = Duration::from_millis(100);

/// The ring mapped read-only.
struct RingMap(Mapping);

impl RingWords for RingMap {
    fn load_relaxed(&self, i: usize) -> u64 {
        self.0.load_word_relaxed(i)
    }
    fn len(&self) -> usize {
        self.0.len() / 8
    }
}

/// Which sequence numbers the user has dropped: the window's start (`upto`: all before it
/// returned or passed) and the samples returned beyond a held one.
#[derive(Debug)]
struct Returns {
    upto: u64,
    out_of_order: BTreeSet<u64>,
    /// Samples returned beyond a held one at which the window moves past it: half the depth.
    straggle: usize,
    /// Most samples passed and still held at once: the depth. Each keeps its object leased
    /// outside any window, so this bounds what a consumer keeping samples can pin; past it
    /// the window stops moving and the consumer gets [`Error::WindowFull`], as without passing.
    passed_limit: usize,
    /// Held samples the window moved past, over the stream's life.
    passed: u64,
    /// Those still held.
    passed_live: BTreeSet<u64>,
}

impl Returns {
    fn new(upto: u64, depth: u32) -> Returns {
        Returns {
            upto,
            out_of_order: BTreeSet::new(),
            straggle: (depth as usize / 2).max(1),
            passed_limit: depth as usize,
            passed: 0,
            passed_live: BTreeSet::new(),
        }
    }

    fn returned(&mut self, seq: u64) {
        if seq < self.upto {
            // A sample the window passed, dropped now (or one before a rewind).
            self.passed_live.remove(&seq);
            return;
        }
        if seq == self.upto {
            self.upto += 1;
            self.advance();
            return;
        }
        self.out_of_order.insert(seq);
        // A sample held while half a window of later ones came back (a label kept for a log, a
        // view kept for an epoch) stops holding its place in the window, which would otherwise
        // fill `depth` samples later and stall the stream: the window moves past it. Its object
        // stays leased by the sample itself, so what it reads does not change; only the
        // daemon's hold for the window is returned.
        while self.out_of_order.len() >= self.straggle {
            let Some(&first) = self.out_of_order.first() else {
                break;
            };
            // Every sample in `upto..first` was delivered (first < next) and is still held.
            let skipped = first - self.upto;
            if self.passed_live.len() as u64 + skipped > self.passed_limit as u64 {
                break;
            }
            self.out_of_order.pop_first();
            self.passed_live.extend(self.upto..first);
            self.passed += skipped;
            self.upto = first + 1;
            self.advance();
        }
    }

    fn advance(&mut self) {
        while self.out_of_order.remove(&self.upto) {
            self.upto += 1;
        }
    }
}

/// A trainer rank's stream: its share of the samples, in the stream's order, with prefetch.
///
/// Dropping the stream detaches the rank (another consumer may attach to it). Samples already
/// delivered stay valid whatever happens to the stream: each holds its own lease, on a
/// connection it keeps open.
pub struct Stream {
    client: Client,
    /// The link the ring came on: its daemon filled the ring, and the locations it names are
    /// in this link's mappings.
    link: Arc<Link>,
    spec: StreamSpec,
    id: u32,
    rank: u32,
    ring: RingMap,
    header: RingHeader,
    next: u64,
    end: Option<u64>,
    returns: Arc<Mutex<Returns>>,
    sent: u64,
    opts: StreamOptions,
    opened: Instant,
    first_sample: Option<Duration>,
    /// The daemon knows this rank read past its last sample.
    told_end: bool,
    /// An error met after `next_batch` had taken some samples: those went to the caller, this
    /// comes with the next call.
    pending: Option<Error>,
    /// The first `next_sample` call: the trainer's loop runs from here.
    started: Option<Instant>,
    /// When it found the end of its share (or of the stream): the loop's clock stops there.
    ended: Option<Instant>,
    /// Time spent waiting for samples not yet in the ring.
    waited: Duration,
    /// Samples taken, and how many the daemon was last told of.
    taken: u64,
    reported: u64,
    /// Times this rank attached again, to a daemon started again after the last went away.
    reattached: u64,
}

/// A rank's ring, as an attach hands it over.
struct Attached {
    id: u32,
    ring: RingMap,
    header: RingHeader,
    link: Arc<Link>,
}

/// Refuses a resharded spec on a connection whose protocol cannot carry it (a daemon older
/// than [`frame::RESHARD_SINCE`]).
pub(crate) fn can_send(client: &Client, spec: &StreamSpec) -> Result<(), Error> {
    let version = client.protocol();
    if spec.reshard.is_some() && version < frame::RESHARD_SINCE {
        return Err(Error::InvalidArgument(format!(
            "this stream resumes a run at another world size, which feedstored speaks from \
             protocol {} on; this one speaks {version}: upgrade feedstored",
            frame::RESHARD_SINCE
        )));
    }
    Ok(())
}

/// Attaches `client` to `rank` of the stream at `seq`, asking again every 100 ms (calling
/// `interrupt` between) until the stream exists or `wait` is over.
fn attach(
    client: &Client,
    spec: &StreamSpec,
    rank: u32,
    seq: u64,
    wait: Duration,
    mut interrupt: impl FnMut() -> Result<(), Error>,
) -> Result<Attached, Error> {
    can_send(client, spec)?;
    let deadline = Instant::now() + wait;
    let (response, mut fds, link) = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let attach = Request::StreamAttach {
            spec: spec.clone(),
            rank,
            seq,
            timeout_ms: left.min(ATTACH_SLICE).as_millis() as u32,
        };
        match client.call_with_fds(&attach) {
            Err(Error::Timeout(_)) if !left.is_zero() => interrupt()?,
            other => break other?,
        }
    };
    let Response::StreamAttached {
        stream, ring_bytes, ..
    } = response
    else {
        return Err(Error::Protocol(format!("unexpected reply {response:?}")));
    };
    let fd = fds
        .pop()
        .filter(|_| fds.is_empty())
        .ok_or_else(|| Error::Protocol("stream attach reply without one ring descriptor".into()))?;
    let ring =
        RingMap(Mapping::new(fd, ring_bytes, Access::ReadOnly, true)?.without_private_views());
    let header = RingHeader::read(&ring).map_err(|e| Error::Protocol(format!("bad ring: {e}")))?;
    if header.rank != rank || header.spec_digest != spec.digest() {
        return Err(Error::Protocol("ring for another rank or stream".into()));
    }
    Ok(Attached {
        id: stream,
        ring,
        header,
        link,
    })
}

/// A consumer reports its figures to the daemon at least every this many samples (riding on a
/// return when one is due, otherwise alone: one one-way message).
const REPORT_EVERY: u64 = 64;

impl std::fmt::Debug for Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stream")
            .field("name", &self.spec.name)
            .field("rank", &self.rank)
            .field("next", &self.next)
            .finish()
    }
}

impl Stream {
    /// Opens `rank`'s share of a stream on its own connection to the daemon at `socket`,
    /// starting at `from` (a state saved with a checkpoint) or at the beginning. Waits up to
    /// [`StreamOptions::wait`] for a producer to create the stream.
    pub fn open(
        socket: impl Into<std::path::PathBuf>,
        spec: &StreamSpec,
        rank: u32,
        from: Option<StreamState>,
        opts: StreamOptions,
    ) -> Result<Stream, Error> {
        Stream::open_interruptible(socket, spec, rank, from, opts, || Ok(()))
    }

    /// [`Stream::open`], calling `interrupt` every 100 ms while it waits for the stream to
    /// appear; an error from `interrupt` ends the wait with that error (an embedding that must
    /// react to signals returns [`Error::Interrupted`]).
    pub fn open_interruptible(
        socket: impl Into<std::path::PathBuf>,
        spec: &StreamSpec,
        rank: u32,
        from: Option<StreamState>,
        opts: StreamOptions,
        interrupt: impl FnMut() -> Result<(), Error>,
    ) -> Result<Stream, Error> {
        // Time to first sample counts from here: a wait for the stream to exist is cold start too.
        let opened = Instant::now();
        spec.check(rank)
            .map_err(|e| Error::InvalidArgument(e.to_string()))?;
        let seq = match from {
            None => 0,
            Some(state) if state.spec_digest != spec.digest() => {
                return Err(Error::StreamMismatch(format!(
                    "the saved state belongs to another stream spec (digest {:016x}, this one {:016x})",
                    state.spec_digest,
                    spec.digest()
                )));
            }
            Some(state) if state.rank != rank => {
                return Err(Error::StreamMismatch(format!(
                    "the saved state is rank {}'s, not rank {rank}'s",
                    state.rank
                )));
            }
            Some(state) => state.seq(spec),
        };
        let client = ConnectOptions::new(Role::Reader)
            .socket(socket)
            .name(feedstore_proto::truncate(
                &format!("{} rank {rank}", spec.name),
                feedstore_proto::MAX_CLIENT_NAME,
            ))
            .connect()?;
        let Attached {
            id,
            ring,
            header,
            link,
        } = attach(&client, spec, rank, seq, opts.wait, interrupt)?;
        let depth = header.capacity;
        Ok(Stream {
            client,
            link,
            spec: spec.clone(),
            id,
            rank,
            ring,
            header,
            next: seq,
            end: spec.end_seq(rank),
            returns: Arc::new(Mutex::new(Returns::new(seq, depth))),
            sent: seq,
            opts,
            opened,
            first_sample: None,
            told_end: false,
            pending: None,
            started: None,
            ended: None,
            waited: Duration::ZERO,
            taken: 0,
            reported: 0,
            reattached: 0,
        })
    }

    /// How many times this rank attached again after its daemon went away and came back (a
    /// client that reconnects: [`crate::ConnectOptions::reconnect_timeout`]).
    pub fn reattached(&self) -> u64 {
        self.reattached
    }

    /// Whether `e` says the daemon this rank is attached to went away (or the client left it
    /// already) and the client reconnects: time to attach again to its successor.
    fn moved_on(&self, e: &Error) -> bool {
        gone(e) && self.client.reconnecting()
    }

    /// Attaches again, to the daemon the client reconnected to, at the next sample: it makes
    /// that sample and the rest again, while the samples read before stay as they are (their
    /// leases went with the old daemon; their mappings keep their bytes). Waits for a
    /// producer to join the stream there until `deadline` (a [`Error::Timeout`] then: the
    /// next call tries again).
    fn reattach(&mut self, deadline: Instant) -> Result<(), Error> {
        let wait = deadline.saturating_duration_since(Instant::now());
        let Attached {
            id,
            ring,
            header,
            link,
        } = attach(&self.client, &self.spec, self.rank, self.next, wait, || {
            Ok(())
        })?;
        tracing::warn!(
            stream = %self.spec.name,
            rank = self.rank,
            seq = self.next,
            "feedstored restarted: attached to the stream again at the next sample"
        );
        *self.returns.lock().unwrap_or_else(|e| e.into_inner()) =
            Returns::new(self.next, header.capacity);
        (self.id, self.ring, self.header, self.link) = (id, ring, header, link);
        self.sent = self.next;
        self.told_end = false;
        self.reattached += 1;
        Ok(())
    }

    /// The cold start this consumer saw: from opening the stream to its first sample (`None`
    /// before it).
    pub fn time_to_first_sample(&self) -> Option<Duration> {
        self.first_sample
    }

    /// What this consumer measured of its own reading, as it reports it to the daemon: time
    /// spent waiting for samples not yet in the ring, samples taken, and time since its first
    /// `next_sample` call (the rest of that time is the trainer's own work), up to the call
    /// that found the end of its share, if one has.
    pub fn figures(&self) -> RankFigures {
        let micros = |d: Duration| d.as_micros().min(u128::from(u64::MAX)) as u64;
        RankFigures {
            waited_us: micros(self.waited),
            taken: self.taken,
            elapsed_us: self.started.map_or(0, |s| {
                micros(
                    self.ended
                        .unwrap_or_else(Instant::now)
                        .saturating_duration_since(s),
                )
            }),
            first_sample_us: self.first_sample.map_or(0, |d| micros(d).max(1)),
        }
    }

    /// Where the stream stands: save this with a checkpoint, and [`Stream::open`] from it to
    /// continue with exactly the next sample.
    pub fn state(&self) -> StreamState {
        StreamState::at(&self.spec, self.rank, self.next)
    }

    /// The stream's spec.
    pub fn spec(&self) -> &StreamSpec {
        &self.spec
    }

    /// Samples still held when the window moved past them: each was kept while half the
    /// prefetch depth of later samples came back (see [`StreamSample`]).
    pub fn passed_held(&self) -> u64 {
        self.returns
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .passed
    }

    /// The next sample, in place in shared memory; `None` after the last epoch. (The stream is
    /// also an iterator of `Result<StreamSample, Error>`.) Waits up to the stream's
    /// [`StreamOptions::wait`] for it.
    pub fn next_sample(&mut self) -> Result<Option<StreamSample>, Error> {
        self.next_sample_within(self.opts.wait)
    }

    /// [`Stream::next_sample`], waiting up to `wait` instead (an embedding that must react to
    /// signals waits in slices and retries on [`Error::Timeout`]; nothing is lost by a timeout).
    pub fn next_sample_within(&mut self, wait: Duration) -> Result<Option<StreamSample>, Error> {
        self.started.get_or_insert_with(Instant::now);
        if self.end.is_some_and(|end| self.next >= end) {
            // The reading is over: its clock stops (the report below says so).
            self.ended.get_or_insert_with(Instant::now);
            self.return_samples(true);
            if !self.told_end {
                // Tell the daemon this rank has read its share, even if some samples are still
                // held: its producers may stop. Best effort: a daemon that is gone needs no news.
                self.told_end = true;
                let request = Request::StreamWait {
                    stream: self.id,
                    rank: self.rank,
                    seq: self.next,
                    timeout_ms: 0,
                };
                let _ = self.client.call_bound(self.link.generation(), &request);
            }
            return Ok(None);
        }
        self.return_samples(false);
        let entry = match self.header.read_entry(&self.ring, self.next) {
            Some(entry) => entry,
            None => {
                // Only here does the trainer wait for data: the clock is read on this path
                // alone, never on the hand-off of a sample already in the ring.
                let began = Instant::now();
                let waited = self.wait(wait);
                self.waited += began.elapsed();
                match waited? {
                    Some(entry) => entry,
                    None => {
                        self.ended.get_or_insert_with(Instant::now);
                        return Ok(None);
                    }
                }
            }
        };
        self.next += 1;
        self.taken += 1;
        self.first_sample
            .get_or_insert_with(|| self.opened.elapsed());
        if entry.flags & ENTRY_FAILED != 0 {
            self.returned(entry.seq);
            return Err(Error::SampleFailed {
                seq: entry.seq,
                record: entry.record,
            });
        }
        // The daemon took a lease for this connection when it published the entry; from here
        // it belongs to the sample.
        // A writer only a daemon that records writers names is believed (as a get's).
        let entry = RingEntry {
            writer: self.link.believed_writer(entry.writer),
            ..entry
        };
        let hold = SampleHold {
            seq: entry.seq,
            returns: self.returns.clone(),
            lease: LeaseHold::new(self.client.clone(), entry.handle, self.link.lineage()),
        };
        let mapping = self.link.mapping(entry.location)?.clone();
        // SAFETY: the daemon publishes an entry into this connection's ring only after taking a
        // lease on its sealed object for this connection, and returns that lease only when this
        // sample's hold releases it (or the connection, which the hold keeps open, closes).
        let bytes = unsafe { leased_bytes(mapping, entry.location, hold)? };
        Ok(Some(StreamSample { entry, bytes }))
    }

    /// Up to `n` samples: fewer at the end of the stream, or before an error (a failed sample,
    /// a timeout): the samples already taken are returned, and the next call returns the
    /// error, so none is lost.
    pub fn next_batch(&mut self, n: usize) -> Result<Vec<StreamSample>, Error> {
        if let Some(e) = self.pending.take() {
            return Err(e);
        }
        let mut batch = Vec::with_capacity(n.min(1024));
        while batch.len() < n {
            match self.next_sample() {
                Ok(Some(sample)) => batch.push(sample),
                Ok(None) => break,
                Err(e) if !batch.is_empty() => {
                    self.pending = Some(e);
                    break;
                }
                Err(e) => return Err(e),
            }
        }
        Ok(batch)
    }

    fn returned(&self, seq: u64) {
        self.returns
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .returned(seq);
    }

    /// Tells the daemon which samples came back, once a batch is pending (or `now`), and how
    /// this consumer's reading went, every [`REPORT_EVERY`] samples (or `now`).
    fn return_samples(&mut self, now: bool) {
        let upto = self.returns.lock().unwrap_or_else(|e| e.into_inner()).upto;
        let returns_due =
            upto > self.sent && (now || upto - self.sent >= u64::from(self.opts.return_batch));
        let report_due =
            self.taken >= self.reported + REPORT_EVERY || (now && self.taken > self.reported);
        if returns_due || report_due {
            let release = Request::StreamRelease {
                stream: self.id,
                rank: self.rank,
                upto: upto.max(self.sent),
                figures: self.figures(),
            };
            if self
                .client
                .send_one_way(&release, self.link.generation())
                .is_ok()
            {
                self.sent = upto.max(self.sent);
                self.reported = self.taken;
            }
        }
    }

    /// Returns the samples dropped so far to the daemon now, rather than once a batch of them
    /// is pending (the stream does this itself before it waits and when it is dropped).
    pub fn flush_returns(&mut self) {
        self.return_samples(true);
    }

    /// Waits up to `limit` for the next sample's slot to fill.
    fn wait(&mut self, limit: Duration) -> Result<Option<RingEntry>, Error> {
        let (window, held) = {
            let returns = self.returns.lock().unwrap_or_else(|e| e.into_inner());
            let window = self.next - returns.upto;
            // Samples still held: the window's not returned, and those kept past it.
            let held =
                window - returns.out_of_order.len() as u64 + returns.passed_live.len() as u64;
            (window, held)
        };
        if window >= u64::from(self.header.capacity) {
            return Err(Error::WindowFull { held });
        }
        self.return_samples(true);
        let deadline = Instant::now() + limit;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let request = Request::StreamWait {
                stream: self.id,
                rank: self.rank,
                seq: self.next,
                timeout_ms: left.as_millis().min(u128::from(u32::MAX)) as u32,
            };
            let reply = match self.client.call_bound(self.link.generation(), &request) {
                Err(e) if self.moved_on(&e) => {
                    // The old daemon's store mapping goes now (the samples taken from it keep
                    // their own), while the new daemon may still be starting: it may need the
                    // memory. Its generation stays: nothing bound to it reaches the new one.
                    if let Some(tombstone) = self.link.tombstone() {
                        self.link = Arc::new(tombstone);
                    }
                    self.client.reconnect()?;
                    self.reattach(deadline)?;
                    if let Some(entry) = self.header.read_entry(&self.ring, self.next) {
                        return Ok(Some(entry));
                    }
                    continue;
                }
                other => other?,
            };
            match reply {
                Response::Done(s) if s == [Status::Ok] => {
                    if let Some(entry) = self.header.read_entry(&self.ring, self.next) {
                        return Ok(Some(entry));
                    }
                    return Err(Error::Protocol(format!(
                        "daemon says sample {} is ready, but its slot does not hold it",
                        self.next
                    )));
                }
                Response::Done(s) if s == [Status::Ended] => return Ok(None),
                Response::Done(s) if s == [Status::Timeout] => {
                    if left.is_zero() {
                        return Err(Error::Timeout(format!(
                            "no sample {} of rank {} of stream {:?} within {:?}: are producers running?",
                            self.next, self.rank, self.spec.name, limit
                        )));
                    }
                }
                other => return Err(Error::Protocol(format!("unexpected reply {other:?}"))),
            }
        }
    }
}

impl Iterator for Stream {
    type Item = Result<StreamSample, Error>;

    fn next(&mut self) -> Option<Self::Item> {
        self.next_sample().transpose()
    }
}

impl Drop for Stream {
    /// Returns the dropped samples and detaches: the daemon releases the entries it published
    /// but this consumer never read, and the rank is free for another consumer. Samples still
    /// held keep their own leases (and this connection) until they are dropped.
    fn drop(&mut self) {
        self.return_samples(true);
        let detach = Request::StreamDetach {
            stream: self.id,
            rank: self.rank,
            next: self.next,
        };
        // Best effort: a daemon that is gone has reclaimed everything already.
        if let Err(e) = self.client.call_bound(self.link.generation(), &detach) {
            tracing::debug!(stream = %self.spec.name, rank = self.rank, error = %e, "detach failed");
        }
    }
}

/// What keeps a stream sample's bytes valid: its own lease (on the consumer's connection, which
/// it keeps open), and its place in the rank's returns.
#[derive(Debug)]
struct SampleHold {
    seq: u64,
    returns: Arc<Mutex<Returns>>,
    lease: LeaseHold,
}

impl Drop for SampleHold {
    fn drop(&mut self) {
        // The stream's window slides on its next return; the lease goes back when `lease`
        // drops, right after this.
        self.returns
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .returned(self.seq);
    }
}

/// One sample from a [`Stream`], in place in shared memory.
///
/// It holds its own lease on the object, so its bytes stay valid and unchanged for as long as
/// it lives, whatever happens to the [`Stream`] (dropped, reopened at another position,
/// closed by the producer) or to the rest of the store.
///
/// It also holds its place in the rank's prefetch window (the samples made ahead count the
/// ones held, so a trainer holding a batch gets the next made within the depth) until it is
/// dropped, or until half the depth of later samples have been dropped while it is held: then
/// the window moves past it ([`Stream::passed_held`]), so a sample kept long does not stall
/// the stream. At most `depth` samples are passed and held at once (each keeps its object
/// leased outside any window); a consumer keeping more, or holding as many samples as the
/// depth in order, gets [`Error::WindowFull`].
pub struct StreamSample {
    entry: RingEntry,
    bytes: SharedBytes<SampleHold>,
}

impl StreamSample {
    /// The rank's sequence number of this sample.
    pub fn seq(&self) -> u64 {
        self.entry.seq
    }

    /// The manifest record it was made from.
    pub fn record(&self) -> u64 {
        self.entry.record
    }

    /// The object's handle.
    pub fn handle(&self) -> Handle {
        self.bytes.hold().lease.handle()
    }

    /// The uid that wrote the sample's object, as the daemon recorded it (see
    /// [`crate::Lease::writer`]); [`Got::UNKNOWN_WRITER`] from a daemon that records no
    /// writers (feedstore 0.1.0, whose ring entries leave the field zero: root's uid, which
    /// must not be believed).
    ///
    /// [`Got::UNKNOWN_WRITER`]: feedstore_proto::frame::Got::UNKNOWN_WRITER
    pub fn writer(&self) -> u32 {
        self.entry.writer
    }

    /// The sample, validated, with typed views of its tensors and tokens.
    pub fn view(&self) -> Result<SampleView<'_>, SampleError> {
        SampleView::new(self)
    }
}

impl StreamSample {
    /// A private, writable copy-on-write view of the sample, as [`crate::Lease::private_view`].
    ///
    /// # Safety
    /// `keep` keeps this sample alive for the view's whole life.
    pub unsafe fn private_view<K>(
        &self,
        keep: K,
        populate: bool,
    ) -> Result<feedstore_shm::PrivateBytes<K>, Error> {
        // SAFETY: the caller's contract is this one's.
        Ok(unsafe { self.bytes.private_view(keep, populate) }?)
    }
}

impl Deref for StreamSample {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        &self.bytes
    }
}

impl std::fmt::Debug for StreamSample {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamSample")
            .field("seq", &self.entry.seq)
            .field("record", &self.entry.record)
            .field("len", &self.entry.location.len)
            .finish()
    }
}

/// Image `i` of several samples as one stacked tensor, in place in shared memory.
#[derive(Debug, Clone)]
pub struct StackedImage<'a> {
    /// Element type.
    pub dtype: DType,
    /// Memory order of each image.
    pub layout: TensorLayout,
    /// `[samples, *image shape]`.
    pub shape: Vec<usize>,
    /// The images' bytes, one after the other.
    pub bytes: &'a [u8],
}

/// Image `image` of every sample as one stacked view, with no copy, when a producer placed
/// them side by side in one object in this order (a batch put with
/// [`StreamFeeder::put_batch`], read whole from its first sample); `None` when they are not
/// (samples made one object each, a batch made again in parts after a producer died, a reader
/// that is not at a batch's start): stack them yourself then. An error if a sample has no such
/// image or the images differ in dtype, layout or shape.
pub fn stacked_image<'a>(
    samples: impl IntoIterator<Item = &'a StreamSample>,
    image: usize,
) -> Result<Option<StackedImage<'a>>, SampleError> {
    let mut samples = samples.into_iter();
    let Some(first) = samples.next() else {
        return Ok(None);
    };
    let mut parts = Vec::new();
    let mut kind = None;
    for s in std::iter::once(first).chain(samples) {
        let t = s
            .view()?
            .image(image)
            .ok_or(SampleError::Invalid("a sample has no such image"))?;
        let this = (t.dtype(), t.layout(), t.shape());
        if kind.get_or_insert_with(|| this.clone()) != &this {
            return Err(SampleError::Invalid(
                "images of the batch differ in dtype, layout or shape",
            ));
        }
        parts.push(t.bytes());
    }
    let (dtype, layout, mut shape) = kind.expect("one sample or more");
    // Through the first sample, which holds a lease on the object and runs to its end.
    let within: &'a [u8] = first;
    Ok(side_by_side(within, &parts).map(|range| {
        shape.insert(0, parts.len());
        StackedImage {
            dtype,
            layout,
            shape,
            bytes: &within[range],
        }
    }))
}
