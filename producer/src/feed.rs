//! Feeding a stream: the producer pipeline driven by a stream's tasks instead of a manifest's
//! order.
//!
//! ```text
//! taker thread ── StreamTake ──▶ tasks (rank, seq) ──▶ IO runtime: record = spec's candidate k,
//!      ▲                                                 read by index (a manifest's line, a
//!      │                                                 Parquet row), fetch
//!      │ (windows slide as consumers return samples)         │
//!      │                                                     ▼ ordered queue
//! daemon ◀── StreamPut (seal + lease + publish) ◀── CPU workers: decode, resize, tokenize, write
//!                                                     │ a rejected record: try candidate k + 1
//!                                                     └──────────────────────────▶ IO runtime
//! ```
//!
//! With `batch` (`feedstore produce --batch N`) the daemon hands out a rank's tasks a whole
//! batch at a time; the CPU workers make the samples as before, and the worker that makes a
//! batch's last sample copies the batch's samples into one object, image 0 of each side by side
//! ([`BatchPlan`]), and puts them together: the trainer reads the batch's images as one view.
//!
//! The daemon decides which sequence numbers are made next (the ranks furthest behind first);
//! the spec decides which record each one is. A record that fails anywhere is replaced by the next
//! candidate of the same rank's share, the same way on every run, so each rank still gets its
//! full count and a resume reproduces the same samples.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use feedstore_consumer::{
    Client, Delivery, Made, ObjectWriter, PendingPut, RankAt, StreamFeeder, StreamTask,
};
use feedstore_proto::sample::{BatchPlan, SampleView};
use feedstore_proto::stream::{StreamSpec, sample_key};

use crate::chat::ChatTokenizer;
use crate::manifest::{IndexedManifest, Record, Reject};
use crate::pipeline::{
    Event, Fetch, JobSender, Produced, ProducerConfig, ProducerError, Skeleton, Summary,
    make_sample, spawn_fetch,
};
use crate::profile::{Profiler, Stage, StageProfile};
use crate::vision::Scratch;

/// How often a producer reports its profile to the daemon (and once more at its end).
const REPORT_EVERY: Duration = Duration::from_secs(1);

/// Which stream to feed, and where each rank starts.
#[derive(Debug, Clone)]
pub struct FeedConfig {
    /// The stream (its record count must be the manifest's).
    pub spec: StreamSpec,
    /// Prefetch depth per rank, if the stream is new.
    pub depth: u32,
    /// Ranks on this node with the sequence number each starts at (from the consumers' saved
    /// states; 0 for a fresh run).
    pub ranks: Vec<StreamTask>,
    /// Ranks whose consumers use another node's daemon, with that daemon's peer address: this
    /// node's daemon takes their tasks there and hands the samples over (see `feedstore
    /// produce --ranks-at`).
    pub at: Vec<RankAt>,
    /// The peer address of a node every sample for another node passes through (the `relay`
    /// placement, for comparisons); empty for none.
    pub relay: String,
    /// Reuse samples still in the store (the decode-once cache) instead of making them again.
    pub cache: bool,
    /// Above 1: place each batch of this many samples of a rank in one object, if the stream is
    /// new (its depth must be at least this). The decode-once cache is then not looked up.
    pub batch: u32,
}

/// Records read by their index, as a stream's tasks name them: an indexed manifest's lines,
/// Parquet rows ([`crate::tables::ParquetRows`]) or shard samples ([`crate::shards::ShardRows`]).
pub trait RecordIndex: Send + Sync {
    /// How many records there are (the stream's `records`).
    fn len(&self) -> u64;

    /// Whether there are none.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Record `index`, with its images' bytes where the source holds them. May block on IO: it
    /// is called on the taker's thread and on blocking threads, never on the IO runtime.
    fn get(&self, index: u64) -> Result<Indexed, Reject>;

    /// A hint that record `index` will be asked for soon (a window's length ahead), for a
    /// source that reads records in pieces to start reading its piece. Nothing by default.
    fn prefetch(self: Arc<Self>, index: u64) {
        let _ = index;
    }
}

/// A record read by its index.
#[derive(Debug, Clone)]
pub struct Indexed {
    /// The record.
    pub record: Record,
    /// Its images' bytes, in the order of [`Record::images`], where the source holds them;
    /// `None`: the pipeline fetches them.
    pub images: Option<Vec<Bytes>>,
}

impl RecordIndex for IndexedManifest {
    fn len(&self) -> u64 {
        IndexedManifest::len(self)
    }

    fn get(&self, index: u64) -> Result<Indexed, Reject> {
        IndexedManifest::get(self, index).map(|record| Indexed {
            record,
            images: None,
        })
    }
}

/// A task and which of its candidate records is being tried.
#[derive(Debug, Clone, Copy)]
struct Work {
    task: StreamTask,
    candidate: u64,
}

impl Work {
    /// The same task with its next candidate record (this one was rejected).
    fn next(self) -> Work {
        Work {
            candidate: self.candidate + 1,
            ..self
        }
    }
}

enum Job {
    Sample {
        work: Work,
        index: u64,
        record: Record,
        images: Vec<Bytes>,
    },
    /// Every candidate was rejected.
    Failed { work: Work, index: u64 },
}

impl crate::pipeline::Ordered for Job {
    /// The task's position in its rank's order: every rank's earliest samples are made first.
    fn order(&self) -> u64 {
        match self {
            Job::Sample { work, .. } | Job::Failed { work, .. } => work.task.seq,
        }
    }
}

/// Marks a task finished when dropped.
struct Finished(Arc<Shared>);

impl Drop for Finished {
    fn drop(&mut self) {
        self.0.finished_one();
    }
}

/// A CPU worker's connection, with the stream puts it sent and has not read the replies of.
///
/// A put is sent without waiting ([`StreamFeeder::submit_put`]); the daemon serves it, and
/// trainers see its samples, before the worker's next request. Its reply is read just before
/// the worker sends its next put (by then it has come, read aside by the next sample's
/// reservation), when the worker finds no job ready, and as the worker ends. So a sample costs
/// its worker one wait for the daemon (the reservation) instead of two, and on a busy node
/// that wait is the daemon's turn on a core.
struct Worker {
    client: Client,
    feeder: StreamFeeder,
    shared: Arc<Shared>,
    profiler: Arc<Profiler>,
    sent: Vec<Sent>,
    /// The tasks of those puts: finished once their replies are read.
    finishing: Vec<Finished>,
}

impl Worker {
    /// Reads the replies of every put sent.
    fn confirm(&mut self) {
        for sent in self.sent.drain(..) {
            sent.confirm(&self.shared, &self.profiler);
        }
        self.finishing.clear();
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.confirm();
    }
}

/// A put sent, with what its reply decides: the samples to report as produced.
struct Sent {
    put: Result<PendingPut, feedstore_consumer::Error>,
    produced: Vec<(Work, Option<Produced>)>,
    /// Samples in it (a failed task is none).
    samples: usize,
}

impl Sent {
    /// Waits for the put's reply and reports each sample the stream took.
    fn confirm(self, shared: &Shared, profiler: &Profiler) {
        let started = Instant::now();
        let result = self.put.and_then(PendingPut::wait);
        // Part of the samples' write (which counted them).
        if self.samples > 0 {
            profiler.add_busy(Stage::Write, started.elapsed());
        }
        match result {
            Ok(results) => {
                for (r, (work, produced)) in results.into_iter().zip(self.produced) {
                    match r {
                        Ok(()) => {
                            if let Some(p) = produced {
                                shared.send(Event::Produced(p));
                            }
                        }
                        // A resume moved the window past this task: someone else's now.
                        Err(e) => {
                            tracing::debug!(?work, error = %e, "stream did not take a sample")
                        }
                    }
                }
            }
            // Closed while these samples were being made: nobody needs them.
            Err(feedstore_consumer::Error::Ended) => {
                tracing::debug!("the stream closed before the samples were put")
            }
            Err(e) => tracing::warn!(error = %e, "putting samples failed"),
        }
    }
}

/// This producer's tasks between the taker and the daemon.
#[derive(Debug)]
struct InFlight {
    tasks: usize,
    /// Since when none has been in flight (`None` while some are).
    idle_since: Option<Instant>,
}

/// A made sample (or a task no candidate could make) waiting for the rest of its batch.
struct Piece {
    work: Work,
    index: u64,
    made: Made,
    produced: Option<Produced>,
    key: u128,
    /// The feeder of the worker that made it: only the connection that reserved an object
    /// puts it.
    feeder: StreamFeeder,
}

/// A batch being made: how many of its tasks this producer took, and the samples made so far.
type Gathered = (usize, Vec<Piece>);

/// Samples of each batch being made (`--batch`), by (rank, batch number).
struct Gathering {
    batch: u64,
    open: Mutex<HashMap<(u32, u64), Gathered>>,
    /// Said once: batches whose samples cannot share an object.
    warned: AtomicBool,
}

impl Gathering {
    fn key(&self, task: StreamTask) -> (u32, u64) {
        (task.rank, task.seq / self.batch)
    }

    /// The taker took `task`: its batch waits for one more sample.
    fn expect(&self, task: StreamTask) {
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        open.entry(self.key(task)).or_default().0 += 1;
    }

    /// Adds a made sample; the whole batch once this was the last one this producer took.
    fn add(&self, piece: Piece) -> Option<Vec<Piece>> {
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        let key = self.key(piece.work.task);
        let (want, pieces) = open.entry(key).or_default();
        pieces.push(piece);
        if pieces.len() < *want {
            return None;
        }
        open.remove(&key).map(|(_, pieces)| pieces)
    }
}

/// What the threads share.
struct Shared {
    spec: StreamSpec,
    records: Arc<dyn RecordIndex>,
    /// Tasks taken and not yet put, and a wake-up for the taker when that falls below `limit`.
    in_flight: Mutex<InFlight>,
    room: Condvar,
    /// The most tasks in flight: enough to keep every fetch and worker busy, no more.
    limit: usize,
    /// How far ahead of a task its source is told to read ([`RecordIndex::prefetch`]): the
    /// prefetch depth this producer asks for (a stream made by another producer may have
    /// another; the hint is only a hint).
    ahead: u64,
    /// The taker has stopped taking (the stream ended, or the daemon went away).
    taker_done: AtomicBool,
    /// Told when the last task in flight is done after the taker stopped: the IO side ends.
    drained: tokio::sync::Notify,
    /// Records already reported as rejected (a record can be a candidate many times).
    reported: Mutex<HashSet<u64>>,
    events: Mutex<std::sync::mpsc::Sender<Event>>,
    /// What every sample's cache key starts with: the transform and the tokenizer.
    key_base: Vec<u8>,
    /// Batches being made, when samples are placed a batch per object.
    gathering: Option<Gathering>,
}

impl Shared {
    fn new(
        feed: &FeedConfig,
        records: Arc<dyn RecordIndex>,
        config: &ProducerConfig,
        tokenizer: &ChatTokenizer,
        limit: usize,
        events: std::sync::mpsc::Sender<Event>,
    ) -> Shared {
        Shared {
            spec: feed.spec.clone(),
            records,
            in_flight: Mutex::new(InFlight {
                tasks: 0,
                idle_since: Some(Instant::now()),
            }),
            room: Condvar::new(),
            limit,
            ahead: u64::from(feed.depth),
            taker_done: AtomicBool::new(false),
            drained: tokio::sync::Notify::new(),
            reported: Mutex::new(HashSet::new()),
            events: Mutex::new(events),
            // (The normalisation by name too: samples cached before it was said in their
            // metadata are not reused.)
            key_base: format!(
                "{:?} normalize {} patch {} merge {} tokenizer {:?}",
                config.transform,
                config.transform.normalization(),
                config.patch_size,
                config.merge_size,
                tokenizer.identity()
            )
            .into_bytes(),
            gathering: (feed.batch > 1).then(|| Gathering {
                batch: u64::from(feed.batch),
                open: Mutex::new(HashMap::new()),
                warned: AtomicBool::new(false),
            }),
        }
    }

    /// The record behind a task's `candidate`-th choice, or `None` when every candidate of the
    /// rank's share was tried.
    fn candidate(&self, work: Work) -> Option<u64> {
        self.spec
            .candidate(work.task.rank, work.task.seq, work.candidate)
    }

    /// Record `index`, read; a record read with its images' bytes counts as fetched, its
    /// read the fetch.
    fn read(&self, index: u64, profiler: &Profiler) -> Result<Indexed, Reject> {
        let started = Instant::now();
        let read = self.records.get(index);
        if let Ok(Indexed {
            images: Some(images),
            ..
        }) = &read
        {
            profiler.record(Stage::Fetch, started.elapsed());
            profiler.fetched(images.iter().map(|i| i.len() as u64).sum());
        }
        read
    }

    /// A sample's decode-once cache key: its record (id, resolved image sources, content, line)
    /// under this producer's transform and tokenizer.
    fn key(&self, record: &Record) -> u128 {
        sample_key(&[&self.key_base, format!("{record:?}").as_bytes()])
    }

    fn in_flight(&self) -> std::sync::MutexGuard<'_, InFlight> {
        self.in_flight.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits up to `wait` until fewer than `limit` tasks are in flight: how many more fit;
    /// `None` if the time ran out first.
    fn wait_for_room(&self, wait: Duration) -> Option<usize> {
        let (in_flight, _) = self
            .room
            .wait_timeout_while(self.in_flight(), wait, |f| f.tasks >= self.limit)
            .unwrap_or_else(|e| e.into_inner());
        (in_flight.tasks < self.limit).then(|| self.limit - in_flight.tasks)
    }

    /// `n` tasks were taken.
    fn started(&self, n: usize) {
        let mut in_flight = self.in_flight();
        in_flight.tasks += n;
        if n > 0 {
            in_flight.idle_since = None;
        }
    }

    /// Since when none of this producer's tasks has been in flight, if none is.
    fn idle_since(&self) -> Option<Instant> {
        self.in_flight().idle_since
    }

    /// A task was put (or given up): room for the taker, and the end when it was the last.
    fn finished_one(&self) {
        let mut in_flight = self.in_flight();
        in_flight.tasks -= 1;
        self.room.notify_one();
        if in_flight.tasks == 0 {
            in_flight.idle_since = Some(Instant::now());
            if self.taker_done.load(Ordering::Acquire) {
                self.drained.notify_one();
            }
        }
    }

    /// The taker stopped; the end now if nothing is in flight.
    fn taker_finished(&self) {
        let in_flight = self.in_flight();
        self.taker_done.store(true, Ordering::Release);
        if in_flight.tasks == 0 {
            self.drained.notify_one();
        }
    }

    /// Whether the taker stopped and no task is in flight.
    fn done(&self) -> bool {
        self.taker_done.load(Ordering::Acquire) && self.in_flight().tasks == 0
    }

    fn send(&self, event: Event) {
        let _ = self
            .events
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .send(event);
    }

    /// Reports a reject the first time its record fails.
    fn rejected(&self, index: u64, reject: Reject) {
        let first = self
            .reported
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(index);
        if first {
            self.send(Event::Rejected(reject));
        }
    }
}

/// Feeds a stream until its last epoch is made, calling `on_event` (on this thread) for every
/// sample put and every record rejected (once per record), and with [`Event::Idle`] while
/// nothing happens. Reports the run's profile to the daemon every second and at its end.
pub fn feed(
    config: &ProducerConfig,
    feed: &FeedConfig,
    tokenizer: Arc<ChatTokenizer>,
    fetcher: Arc<dyn Fetch>,
    records: Arc<dyn RecordIndex>,
    on_event: impl FnMut(&Event, &Profiler),
) -> Result<Summary, ProducerError> {
    if feed.spec.records != records.len() {
        return Err(ProducerError::Stream(
            feedstore_consumer::Error::StreamMismatch(format!(
                "the stream has {} records but its source has {}",
                feed.spec.records,
                records.len()
            )),
        ));
    }
    // One connection per worker (each puts what it wrote) plus the taker's.
    let name = &feed.spec.name;
    let (mut skeleton, mut clients) =
        Skeleton::<Job>::connect(config, 1, |i| format!("feeder-{name}-{i}"))?;
    let taker_client = clients.pop().expect("workers + 1 clients");
    let taker = StreamFeeder::join_batched_at(
        &taker_client,
        &feed.spec,
        feed.depth,
        feed.batch,
        &feed.ranks,
        &feed.at,
        &feed.relay,
    )
    .map_err(ProducerError::Stream)?;
    // (With the stream's batch size too: a put-only join that finds the stream gone, after a
    // daemon restart, may create it before the taker joins again, and must create the same.)
    let feeders = clients
        .iter()
        .map(|c| StreamFeeder::join_batched(c, &feed.spec, feed.depth, feed.batch, &[]))
        .collect::<Result<Vec<_>, _>>()
        .map_err(ProducerError::Stream)?;
    skeleton.started_now();

    let limit = skeleton.fetch_concurrency() + 2 * config.workers.max(1);
    let events = skeleton.events.clone();
    let shared = Arc::new(Shared::new(
        feed, records, config, &tokenizer, limit, events,
    ));
    // A task, with its candidate's record when the taker already read it (for its cache key).
    let (work_tx, work_rx) = tokio::sync::mpsc::unbounded_channel::<(Work, Option<Indexed>)>();
    for (client, feeder) in clients.into_iter().zip(feeders) {
        let profiler = skeleton.profiler.clone();
        let worker = Worker {
            client,
            feeder,
            shared: shared.clone(),
            profiler: profiler.clone(),
            sent: Vec::new(),
            finishing: Vec::new(),
        };
        let work = cpu_work(config, &tokenizer, &shared, &profiler, &work_tx);
        skeleton.cpu(worker, work, Worker::confirm);
    }
    let io = Io {
        shared: shared.clone(),
        fetcher,
        profiler: skeleton.profiler.clone(),
        jobs: skeleton.jobs.clone(),
        retry: work_tx.clone(),
        fetch_concurrency: skeleton.fetch_concurrency(),
    };
    skeleton.io(io.run(work_rx))?;
    // The taker (started after the IO side, whose runtime may fail to start).
    let taker_thread = spawn_taker(
        shared.clone(),
        (taker, taker_client),
        work_tx,
        (skeleton.profiler.clone(), skeleton.snapshots()),
        feed.cache,
    );

    // Events flow until every stage has dropped its sender (the shared one included).
    drop(shared);
    let summary = skeleton.finish(on_event);
    let (failure, taker, taker_client) = taker_thread.join().expect("the taker does not panic");
    // The last report, with the CPU workers' last samples, before the taker's connection goes.
    if failure.is_none()
        && let Err(e) = taker.report(&summary.profile.figures())
    {
        tracing::debug!(error = %e, "reporting the profile failed");
    }
    drop((taker, taker_client));
    if let Some(e) = failure {
        // The daemon went away or closed the stream: the run did not finish.
        return Err(ProducerError::Stream(e));
    }
    Ok(summary)
}

/// A sender of tasks to the IO side (with the candidate's record when already read).
type WorkSender = tokio::sync::mpsc::UnboundedSender<(Work, Option<Indexed>)>;

/// A CPU worker's job handler: make the sample, put it (or send the task back for its next
/// candidate).
fn cpu_work(
    config: &ProducerConfig,
    tokenizer: &Arc<ChatTokenizer>,
    shared: &Arc<Shared>,
    profiler: &Arc<Profiler>,
    work_tx: &WorkSender,
) -> impl FnMut(&mut Worker, &mut Scratch, Job) + Send + 'static {
    let (config, tokenizer, shared) = (config.clone(), tokenizer.clone(), shared.clone());
    let (profiler, work_tx) = (profiler.clone(), work_tx.clone());
    move |worker: &mut Worker, scratch: &mut Scratch, job| {
        let client = &worker.client;
        let (work, index, made, produced, key) = match job {
            Job::Failed { work, index } => (work, index, Made::Failed, None, 0),
            Job::Sample {
                work,
                index,
                record,
                images,
            } => match make_sample(
                &config, client, &tokenizer, &profiler, scratch, &record, images,
            ) {
                Ok((object, bytes)) => {
                    let produced = Produced {
                        handle: object.handle(),
                        line: record.line,
                        id: record.id.clone(),
                        bytes,
                    };
                    let key = shared.key(&record);
                    (work, index, Made::Written(object), Some(produced), key)
                }
                Err(reject) => {
                    shared.rejected(index, reject);
                    let _ = work_tx.send((work.next(), None));
                    return;
                }
            },
        };
        // The task is done once its put is confirmed, or however the put ends (a panic
        // included): the taker gets room and the IO side its end. (A sample waiting for the
        // rest of its batch is done once handed to the batch, as the last one's worker puts
        // them all.)
        let finished = Finished(shared.clone());
        let piece = Piece {
            work,
            index,
            made,
            produced,
            key,
            feeder: worker.feeder.clone(),
        };
        let pieces = match &shared.gathering {
            // The rest of its batch is still being made: the last one's worker puts it.
            Some(gathering) => match gathering.add(piece) {
                Some(pieces) => pieces,
                None => return,
            },
            None => vec![piece],
        };
        worker.confirm();
        let sent = put_pieces(&shared, &worker.client, &worker.feeder, &profiler, pieces);
        worker.sent.extend(sent);
        worker.finishing.push(finished);
    }
}

/// The IO side: walks each task's candidates to a record, fetches its images and queues the
/// job; a fetch that fails sends the task back for the next candidate. Ends when the taker is
/// done and no task is left in flight.
struct Io {
    shared: Arc<Shared>,
    fetcher: Arc<dyn Fetch>,
    profiler: Arc<Profiler>,
    jobs: JobSender<Job>,
    retry: WorkSender,
    fetch_concurrency: usize,
}

impl Io {
    async fn run(self, mut work_rx: tokio::sync::mpsc::UnboundedReceiver<(Work, Option<Indexed>)>) {
        let shared = &self.shared;
        let permits = Arc::new(tokio::sync::Semaphore::new(self.fetch_concurrency));
        loop {
            let (mut work, mut read) = tokio::select! {
                next = work_rx.recv() => match next {
                    Some(next) => next,
                    None => break,
                },
                () = shared.drained.notified() => {
                    if shared.done() {
                        break;
                    }
                    continue;
                }
            };
            // Walk the candidates until one reads as a record.
            let (index, read) = loop {
                let Some(index) = shared.candidate(work) else {
                    break (u64::MAX, None);
                };
                // The taker's read is for the first candidate; later ones are read here, on a
                // blocking thread (a Parquet row may wait for its row group).
                let result = match read.take() {
                    Some(read) => Ok(read),
                    None => read_blocking(shared, &self.profiler, index).await,
                };
                match result {
                    Ok(read) => break (index, Some(read)),
                    Err(reject) => {
                        shared.rejected(index, reject);
                        work.candidate += 1;
                    }
                }
            };
            let Some(Indexed { record, images }) = read else {
                let index = shared.spec.record_at(work.task.rank, work.task.seq);
                self.jobs.send(Job::Failed { work, index }, None);
                continue;
            };
            if let Some(images) = images {
                // Read with its record (its read was its fetch, counted there).
                let permit = permits.clone().acquire_owned().await.expect("never closed");
                let job = Job::Sample {
                    work,
                    index,
                    record,
                    images,
                };
                self.jobs.send(job, Some(permit));
                continue;
            }
            let (shared, retry) = (shared.clone(), self.retry.clone());
            let job = move |record, images| Job::Sample {
                work,
                index,
                record,
                images,
            };
            spawn_fetch(
                &permits,
                &self.fetcher,
                record,
                &self.profiler,
                &self.jobs,
                job,
                move |reject| {
                    shared.rejected(index, reject);
                    let _ = retry.send((work.next(), None));
                },
            )
            .await;
        }
    }
}

/// A task's first candidate, read, or `None` when it is rejected.
fn first_read(shared: &Shared, profiler: &Profiler, task: StreamTask) -> Option<Indexed> {
    let index = shared.candidate(Work { task, candidate: 0 })?;
    shared.read(index, profiler).ok()
}

/// Record `index`, read on a blocking thread.
async fn read_blocking(
    shared: &Arc<Shared>,
    profiler: &Arc<Profiler>,
    index: u64,
) -> Result<Indexed, Reject> {
    let (reading, profiler) = (shared.clone(), profiler.clone());
    tokio::task::spawn_blocking(move || reading.read(index, &profiler))
        .await
        .unwrap_or_else(|e| {
            Err(Reject {
                line: index + 1,
                id: None,
                stage: "read".into(),
                reason: format!("reading record {index} failed: {e}"),
            })
        })
}

/// The taker: asks the daemon for work while there is room in the pipeline, and reports the
/// profile to the daemon. Returns how it ended (an error when the daemon went away or closed
/// the stream) and its connection.
fn spawn_taker(
    shared: Arc<Shared>,
    (taker, taker_client): (StreamFeeder, Client),
    work_tx: WorkSender,
    (profiler, snapshot): (Arc<Profiler>, impl Fn() -> StageProfile + Send + 'static),
    cache: bool,
) -> std::thread::JoinHandle<(Option<feedstore_consumer::Error>, StreamFeeder, Client)> {
    std::thread::spawn(move || {
        let mut reported = Instant::now();
        let failure = loop {
            if reported.elapsed() >= REPORT_EVERY {
                reported = Instant::now();
                if let Err(e) = taker.report(&snapshot().figures()) {
                    tracing::debug!(error = %e, "reporting the profile failed");
                }
            }
            // A full pipeline (CPU-bound) keeps the taker here: it reports between waits.
            let Some(room) = shared.wait_for_room(REPORT_EVERY) else {
                continue;
            };
            let asked = Instant::now();
            let took = taker.take(room as u32, Duration::from_millis(200));
            // The daemon answers at once while a window has room. Time waited here with none
            // of this producer's own tasks in flight (they only finish while the taker waits)
            // is time every window was full of made samples, or of other producers' tasks: the
            // trainers set the pace. While some are in flight, the window may be full of this
            // producer's own work: not counted.
            if let Some(idle) = shared.idle_since() {
                profiler.backpressure(idle.max(asked).elapsed());
            }
            match took {
                Ok(Some(tasks)) => {
                    // What each rank reads a window from now, for its source to read ahead.
                    for task in &tasks {
                        let ahead = task.seq.saturating_add(shared.ahead);
                        if shared
                            .spec
                            .end_seq(task.rank)
                            .is_some_and(|end| ahead >= end)
                        {
                            continue;
                        }
                        let index = shared.spec.record_at(task.rank, ahead);
                        shared.records.clone().prefetch(index);
                    }
                    if let Some(gathering) = &shared.gathering {
                        tasks.iter().for_each(|&t| gathering.expect(t));
                    }
                    let tasks = if cache && shared.gathering.is_none() {
                        serve_from_cache(&shared, &taker, &profiler, tasks)
                    } else {
                        // Read here, off the IO runtime (a Parquet row may wait for its row
                        // group); a reject is read again, and reported, on the IO side.
                        tasks
                            .into_iter()
                            .map(|t| (t, first_read(&shared, &profiler, t)))
                            .collect()
                    };
                    shared.started(tasks.len());
                    for (task, record) in tasks {
                        let _ = work_tx.send((Work { task, candidate: 0 }, record));
                    }
                }
                Ok(None) => break None,
                Err(e) => break Some(e),
            }
        };
        shared.taker_finished();
        (failure, taker, taker_client)
    })
}

/// Sends the puts of made samples (a whole batch when placing batches), for the caller to
/// confirm ([`Sent::confirm`]). A batch placed in one object (on `client`) goes in one put on
/// `feeder`. Samples in objects of their own go through the feeder of the worker that reserved
/// them, one put per connection: on this worker's own (`feeder`) sent for the caller to confirm,
/// on another worker's confirmed here (so a connection carries at most one unconfirmed put,
/// its own worker's, however large the batch).
fn put_pieces(
    shared: &Shared,
    client: &Client,
    feeder: &StreamFeeder,
    profiler: &Profiler,
    mut pieces: Vec<Piece>,
) -> Vec<Sent> {
    // Not placing batches: the worker's own sample, on its own connection.
    if shared.gathering.is_none() {
        return vec![deliver(feeder, profiler, pieces)];
    }
    pieces.sort_by_key(|p| p.work.task.seq);
    let started = Instant::now();
    let placed = place_batch(shared, client, &mut pieces);
    // The copy is part of the samples' write.
    profiler.add_busy(Stage::Write, started.elapsed());
    if placed {
        return vec![deliver(feeder, profiler, pieces)];
    }
    let mut by_connection: Vec<(StreamFeeder, Vec<Piece>)> = Vec::new();
    for piece in pieces {
        match by_connection
            .iter_mut()
            .find(|(f, _)| f.same_connection(&piece.feeder))
        {
            Some((_, group)) => group.push(piece),
            None => by_connection.push((piece.feeder.clone(), vec![piece])),
        }
    }
    // Every put sent first, so none waits behind another connection's reply.
    let (own, others): (Vec<_>, Vec<_>) = by_connection
        .into_iter()
        .map(|(f, group)| (f.same_connection(feeder), deliver(&f, profiler, group)))
        .partition(|(own, _)| *own);
    for (_, sent) in others {
        sent.confirm(shared, profiler);
    }
    own.into_iter().map(|(_, sent)| sent).collect()
}

/// Sends one put of `pieces` on `feeder`, without waiting for its reply.
fn deliver(feeder: &StreamFeeder, profiler: &Profiler, pieces: Vec<Piece>) -> Sent {
    let put_started = Instant::now();
    let samples = pieces
        .iter()
        .filter(|p| !matches!(p.made, Made::Failed))
        .count();
    let mut produced = Vec::with_capacity(pieces.len());
    let deliveries = pieces
        .into_iter()
        .map(|p| {
            produced.push((p.work, p.produced));
            Delivery {
                task: p.work.task,
                record: p.index,
                key: p.key,
                made: p.made,
            }
        })
        .collect();
    let put = feeder.submit_put(deliveries);
    // Part of the samples' write (which counted them); a failed task is no sample.
    if samples > 0 {
        profiler.add_busy(Stage::Write, put_started.elapsed());
    }
    Sent {
        put,
        produced,
        samples,
    }
}

/// Copies a batch's made samples into one object, image 0 of each side by side, and makes the
/// pieces deliver that object instead of their own (given back when dropped). Leaves them as
/// they are, and says false, if they cannot share one (images of different shapes, no image,
/// no room).
fn place_batch(shared: &Shared, client: &Client, pieces: &mut [Piece]) -> bool {
    let written: Vec<usize> = (0..pieces.len())
        .filter(|&i| matches!(pieces[i].made, Made::Written(_)))
        .collect();
    if written.len() < 2 {
        return false;
    }
    let placed = {
        let views: Result<Vec<SampleView<'_>>, _> = written
            .iter()
            .map(|&i| match &pieces[i].made {
                Made::Written(w) => SampleView::new(w.as_slice()),
                _ => unreachable!("only written pieces"),
            })
            .collect();
        views.map_err(|e| e.to_string()).and_then(|views| {
            let (plans, infos): (Vec<_>, Vec<_>) = views.iter().map(SampleView::plan).unzip();
            let plan = BatchPlan::new(plans, &infos).map_err(|e| e.to_string())?;
            let mut object = client
                .create(plan.object_bytes())
                .map_err(|e| e.to_string())?;
            for (i, (view, info)) in views.iter().zip(&infos).enumerate() {
                plan.copy_from(object.as_mut_slice(), i, view, info)
                    .map_err(|e| e.to_string())?;
            }
            Ok::<(BatchPlan, ObjectWriter), String>((plan, object))
        })
    };
    let (plan, object) = match placed {
        Ok(placed) => placed,
        Err(why) => {
            let warned = shared.gathering.as_ref().map(|g| &g.warned);
            if warned.is_some_and(|w| !w.swap(true, Ordering::Relaxed)) {
                tracing::warn!(
                    "--batch: a batch's samples were put one object each ({why}); they share \
                     one when every sample has an image 0 of one shape (--image-size WxH) \
                     whose bytes are a multiple of 64"
                );
            }
            return false;
        }
    };
    let handle = object.handle();
    let mut object = Some(object);
    for (i, &p) in written.iter().enumerate() {
        let piece = &mut pieces[p];
        piece.made = match object.take() {
            Some(object) => Made::Written(object),
            None => Made::Part {
                handle,
                offset: plan.start(i),
            },
        };
        // Not its own object any more: the cache cannot name a sample inside another.
        piece.key = 0;
        if let Some(p) = &mut piece.produced {
            p.handle = handle;
        }
    }
    true
}

/// Puts every task whose sample the store still holds (by cache key) and returns the others,
/// each with its first candidate's record (read for the key, so not read again).
fn serve_from_cache(
    shared: &Shared,
    taker: &StreamFeeder,
    profiler: &Profiler,
    tasks: Vec<StreamTask>,
) -> Vec<(StreamTask, Option<Indexed>)> {
    let records: Vec<Option<(u64, Indexed)>> = tasks
        .iter()
        .map(|&task| {
            let index = shared.candidate(Work { task, candidate: 0 })?;
            shared.read(index, profiler).ok().map(|r| (index, r))
        })
        .collect();
    let keys: Vec<u128> = records
        .iter()
        .map(|r| r.as_ref().map_or(0, |(_, read)| shared.key(&read.record)))
        .collect();
    let found = match taker.lookup(&keys) {
        Ok(found) => found,
        Err(e) => {
            tracing::warn!(error = %e, "cache lookup failed; making the samples");
            return tasks
                .into_iter()
                .zip(records)
                .map(|(task, r)| (task, r.map(|(_, record)| record)))
                .collect();
        }
    };
    let mut misses = Vec::new();
    let mut hits = Vec::new();
    for ((task, record), (key, handle)) in tasks
        .into_iter()
        .zip(records)
        .zip(keys.into_iter().zip(found))
    {
        match (record, handle) {
            (Some((index, record)), Some(handle)) if key != 0 => hits.push((
                Delivery {
                    task,
                    record: index,
                    key,
                    made: Made::Existing(handle),
                },
                (record.record, handle),
            )),
            (record, _) => misses.push((task, record.map(|(_, record)| record))),
        }
    }
    if hits.is_empty() {
        return misses;
    }
    let (deliveries, records): (Vec<_>, Vec<_>) = hits.into_iter().unzip();
    match taker.put(deliveries) {
        Ok(results) => {
            for (result, (record, handle)) in results.into_iter().zip(records) {
                // Evicted between the lookup and the put: the daemon hands the task out again.
                if result.is_ok() {
                    profiler.cache_hits(1);
                    shared.send(Event::Produced(Produced {
                        handle,
                        line: record.line,
                        id: record.id,
                        bytes: 0,
                    }));
                }
            }
        }
        Err(e) => tracing::warn!(error = %e, "putting cached samples failed"),
    }
    misses
}
