//! Feeding a stream: the producer pipeline driven by a stream's tasks instead of a manifest's
//! order.
//!
//! ```text
//! taker thread ── StreamTake ──▶ tasks (rank, seq) ──▶ IO runtime: record = spec's candidate k,
//!      ▲                                                 read from the indexed manifest, fetch
//!      │ (windows slide as consumers return samples)         │
//!      │                                                     ▼ ordered queue
//! daemon ◀── StreamPut (seal + lease + publish) ◀── CPU workers: decode, resize, tokenize, write
//!                                                     │ a rejected record: try candidate k + 1
//!                                                     └──────────────────────────▶ IO runtime
//! ```
//!
//! The daemon decides which sequence numbers are made next (the ranks furthest behind first);
//! the spec decides which record each one is. A record that fails anywhere is replaced by the next
//! candidate of the same rank's share, the same way on every run, so each rank still gets its
//! full count and a resume reproduces the same samples.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use feedstore_consumer::{Delivery, Made, RankAt, StreamFeeder, StreamTask};
use feedstore_proto::stream::{StreamSpec, sample_key};

use crate::chat::ChatTokenizer;
use crate::manifest::{IndexedManifest, Record, Reject};
use crate::pipeline::{
    Event, Fetch, Produced, ProducerConfig, ProducerError, Skeleton, Summary, make_sample,
    spawn_fetch,
};
use crate::profile::{Profiler, Stage};

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
struct Finished<'a>(&'a Shared);

impl Drop for Finished<'_> {
    fn drop(&mut self) {
        self.0.finished_one();
    }
}

/// This producer's tasks between the taker and the daemon.
#[derive(Debug)]
struct InFlight {
    tasks: usize,
    /// Since when none has been in flight (`None` while some are).
    idle_since: Option<Instant>,
}

/// What the threads share.
struct Shared {
    spec: StreamSpec,
    manifest: Arc<IndexedManifest>,
    /// Tasks taken and not yet put, and a wake-up for the taker when that falls below `limit`.
    in_flight: Mutex<InFlight>,
    room: Condvar,
    /// The most tasks in flight: enough to keep every fetch and worker busy, no more.
    limit: usize,
    /// The taker has stopped taking (the stream ended, or the daemon went away).
    taker_done: AtomicBool,
    /// Told when the last task in flight is done after the taker stopped: the IO side ends.
    drained: tokio::sync::Notify,
    /// Records already reported as rejected (a record can be a candidate many times).
    reported: Mutex<HashSet<u64>>,
    events: Mutex<std::sync::mpsc::Sender<Event>>,
    /// What every sample's cache key starts with: the transform and the tokenizer.
    key_base: Vec<u8>,
}

impl Shared {
    /// The record behind a task's `candidate`-th choice, or `None` when every candidate of the
    /// rank's share was tried.
    fn candidate(&self, work: Work) -> Option<u64> {
        let per_rank = self.spec.per_rank();
        if work.candidate >= per_rank {
            return None;
        }
        let (epoch, position) = (work.task.seq / per_rank, work.task.seq % per_rank);
        let seq = epoch * per_rank + (position + work.candidate) % per_rank;
        Some(self.spec.record_at(work.task.rank, seq))
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
    manifest: Arc<IndexedManifest>,
    on_event: impl FnMut(&Event, &Profiler),
) -> Result<Summary, ProducerError> {
    if feed.spec.records != manifest.len() {
        return Err(ProducerError::Stream(
            feedstore_consumer::Error::StreamMismatch(format!(
                "the stream has {} records but the manifest has {}",
                feed.spec.records,
                manifest.len()
            )),
        ));
    }
    // One connection per worker (each puts what it wrote) plus the taker's.
    let name = &feed.spec.name;
    let (mut skeleton, mut clients) =
        Skeleton::<Job>::connect(config, 1, |i| format!("feeder-{name}-{i}"))?;
    let taker_client = clients.pop().expect("workers + 1 clients");
    let taker = StreamFeeder::join_at(
        &taker_client,
        &feed.spec,
        feed.depth,
        &feed.ranks,
        &feed.at,
        &feed.relay,
    )
    .map_err(ProducerError::Stream)?;
    let feeders = clients
        .iter()
        .map(|c| StreamFeeder::join(c, &feed.spec, feed.depth, &[]))
        .collect::<Result<Vec<_>, _>>()
        .map_err(ProducerError::Stream)?;
    skeleton.started_now();

    let workers = config.workers.max(1);
    let shared = Arc::new(Shared {
        spec: feed.spec.clone(),
        manifest,
        in_flight: Mutex::new(InFlight {
            tasks: 0,
            idle_since: Some(Instant::now()),
        }),
        room: Condvar::new(),
        limit: skeleton.fetch_concurrency() + 2 * workers,
        taker_done: AtomicBool::new(false),
        drained: tokio::sync::Notify::new(),
        reported: Mutex::new(HashSet::new()),
        events: Mutex::new(skeleton.events.clone()),
        key_base: format!(
            "{:?} patch {} merge {} tokenizer {:?}",
            config.transform,
            config.patch_size,
            config.merge_size,
            tokenizer.identity()
        )
        .into_bytes(),
    });
    // A task, with its candidate's record when the taker already read it (for its cache key).
    let (work_tx, mut work_rx) = tokio::sync::mpsc::unbounded_channel::<(Work, Option<Record>)>();

    // CPU: make the sample, put it (or try the next candidate).
    for (client, feeder) in clients.into_iter().zip(feeders) {
        let (work_tx, shared, profiler) =
            (work_tx.clone(), shared.clone(), skeleton.profiler.clone());
        let (tokenizer, config) = (tokenizer.clone(), config.clone());
        skeleton.cpu((client, feeder), move |(client, feeder), scratch, job| {
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
            // The task is done however the put ends (a panic included): the taker gets room
            // and the IO side its end.
            let _finished = Finished(&shared);
            let put_started = Instant::now();
            let sample = matches!(made, Made::Written(_));
            let result = feeder.put(vec![Delivery {
                task: work.task,
                record: index,
                key,
                made,
            }]);
            // Part of the sample's write (which counted it); a failed task is no sample.
            if sample {
                profiler.add_busy(Stage::Write, put_started.elapsed());
            }
            let result = result.and_then(|mut r| {
                r.pop().ok_or_else(|| {
                    feedstore_consumer::Error::Protocol("a put answered without a result".into())
                })
            });
            match result {
                Ok(Ok(())) => {
                    if let Some(p) = produced {
                        shared.send(Event::Produced(p));
                    }
                }
                // A resume moved the window past this task: someone else's now.
                Ok(Err(e)) => tracing::debug!(?work, error = %e, "stream did not take a sample"),
                // Closed while this sample was being made: nobody needs it.
                Err(feedstore_consumer::Error::Ended) => {
                    tracing::debug!(?work, "the stream closed before the sample was put")
                }
                Err(e) => tracing::warn!(?work, error = %e, "putting a sample failed"),
            }
        });
    }

    // IO: walk each task's candidates to a record, fetch its images, queue the job; fetches
    // that fail send the task back for the next candidate. Ends when the taker is done and no
    // task is left in flight.
    let fetch_concurrency = skeleton.fetch_concurrency();
    let (job_tx, io_shared, profiler) = (
        skeleton.jobs.clone(),
        shared.clone(),
        skeleton.profiler.clone(),
    );
    let (retry_tx, taker_tx) = (work_tx.clone(), work_tx);
    skeleton.io(async move {
        let shared = io_shared;
        let permits = Arc::new(tokio::sync::Semaphore::new(fetch_concurrency));
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
            let (index, record) = loop {
                let Some(index) = shared.candidate(work) else {
                    break (u64::MAX, None);
                };
                // The taker's read is for the first candidate; later ones read here.
                match read.take().map_or_else(|| shared.manifest.get(index), Ok) {
                    Ok(record) => break (index, Some(record)),
                    Err(reject) => {
                        shared.rejected(index, reject);
                        work.candidate += 1;
                    }
                }
            };
            let Some(record) = record else {
                let index = shared.spec.record_at(work.task.rank, work.task.seq);
                job_tx.send(Job::Failed { work, index }, None);
                continue;
            };
            let (shared, retry) = (shared.clone(), retry_tx.clone());
            let job = move |record, images| Job::Sample {
                work,
                index,
                record,
                images,
            };
            spawn_fetch(
                &permits,
                &fetcher,
                record,
                &profiler,
                &job_tx,
                job,
                move |reject| {
                    shared.rejected(index, reject);
                    let _ = retry.send((work.next(), None));
                },
            )
            .await;
        }
    })?;
    // The taker: asks the daemon for work while there is room in the pipeline (started after
    // the IO side, whose runtime may fail to start), and reports the profile to the daemon.
    let cache = feed.cache;
    let taker_thread = {
        let (shared, work_tx) = (shared.clone(), taker_tx);
        let (profiler, snapshot) = (skeleton.profiler.clone(), skeleton.snapshots());
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
                // The daemon answers at once while a window has room. Time waited here with
                // none of this producer's own tasks in flight (they only finish while the
                // taker waits) is time every window was full of made samples, or of other
                // producers' tasks: the trainers set the pace. While some are in flight, the
                // window may be full of this producer's own work: not counted.
                if let Some(idle) = shared.idle_since() {
                    profiler.backpressure(idle.max(asked).elapsed());
                }
                match took {
                    Ok(Some(tasks)) => {
                        let tasks = if cache {
                            serve_from_cache(&shared, &taker, &profiler, tasks)
                        } else {
                            tasks.into_iter().map(|t| (t, None)).collect()
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
    };

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

/// Puts every task whose sample the store still holds (by cache key) and returns the others,
/// each with its first candidate's record (read for the key, so not read again).
fn serve_from_cache(
    shared: &Shared,
    taker: &StreamFeeder,
    profiler: &Profiler,
    tasks: Vec<StreamTask>,
) -> Vec<(StreamTask, Option<Record>)> {
    let records: Vec<Option<(u64, Record)>> = tasks
        .iter()
        .map(|&task| {
            let index = shared.candidate(Work { task, candidate: 0 })?;
            shared.manifest.get(index).ok().map(|r| (index, r))
        })
        .collect();
    let keys: Vec<u128> = records
        .iter()
        .map(|r| r.as_ref().map_or(0, |(_, record)| shared.key(record)))
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
                (record, handle),
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
