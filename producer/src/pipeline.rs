//! The producer pipeline: records in, sealed samples out, every failure a reject.
//!
//! ```text
//! manifest ──▶ fetch tasks (tokio, at most `fetch_concurrency` in flight) ──▶ ordered queue
//!          └─▶ rejects                                                          │
//!                       CPU workers (threads, one store connection each) ◀─────┘
//!                       probe → plan sizes → tokenize → reserve the object at its final size
//!                       → decode → resize/normalise into shared memory → finish → seal
//! ```
//!
//! IO never blocks a CPU worker and CPU work never runs on the IO runtime. The queue between
//! them hands out the earliest job first (a stream's earliest position, a manifest's earliest
//! line), and each job in it keeps its fetch's permit until a worker takes it, so a slow CPU
//! side holds fetches back (and memory stays bounded) instead of piling up images. A sample is
//! written exactly once, straight into its object; a failure after the object was reserved
//! drops the writer, which aborts it, so nothing half-written is ever visible.

use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use feedstore_consumer::{Client, ConnectOptions, Handle, ObjectWriter, PendingSeal, Role};
use feedstore_proto::sample::{AlignedBuf, KeyValue, SampleInfo, SamplePlan};

use crate::chat::{ChatTokenizer, image_pad_tokens};
pub use crate::input::LocalFiles;
use crate::manifest::{Content, Record, Reject};
use crate::profile::{Profiler, Stage, StageProfile};
use crate::vision::{ImageTransform, ResizeMode, Scratch};

pub use crate::source::{Fetch, FetchError};

/// How a producer runs.
#[derive(Debug, Clone)]
pub struct ProducerConfig {
    /// The daemon's socket.
    pub socket: PathBuf,
    /// Image fetches in flight at most.
    pub fetch_concurrency: usize,
    /// CPU workers (decode, resize, tokenize, write).
    pub workers: usize,
    /// The image transform.
    pub transform: ImageTransform,
    /// Vision patch size in pixels (14 for Qwen2/2.5-VL, 16 for Qwen3-VL).
    pub patch_size: u32,
    /// Patches merged per image token along each side (2 for Qwen-VL).
    pub merge_size: u32,
    /// How long a worker waits for store space before rejecting a sample as `write: store full`.
    pub create_timeout: Duration,
}

impl ProducerConfig {
    /// Defaults: 32 fetches in flight, one worker per core, Qwen2.5-VL's image settings.
    pub fn new(socket: PathBuf) -> ProducerConfig {
        ProducerConfig {
            socket,
            fetch_concurrency: 32,
            workers: std::thread::available_parallelism().map_or(1, |n| n.get()),
            transform: ImageTransform::qwen_vl(),
            patch_size: 14,
            merge_size: 2,
            create_timeout: Duration::from_secs(30),
        }
    }
}

/// The most CPU workers, and the most fetches in flight, a producer runs.
pub const MAX_PARALLEL: usize = 4096;

pub use crate::vision::MAX_OUTPUT_PIXELS;

impl ProducerConfig {
    /// Checks the settings before any work is done; the error is one line naming the setting.
    pub fn validate(&self) -> Result<(), String> {
        let (patch, merge) = (self.patch_size, self.merge_size);
        for (what, n) in [
            ("workers", self.workers),
            ("fetch concurrency", self.fetch_concurrency),
        ] {
            if !(1..=MAX_PARALLEL).contains(&n) {
                return Err(format!("{what} ({n}) must be between 1 and {MAX_PARALLEL}"));
            }
        }
        if patch == 0 || merge == 0 || patch > 1024 || merge > 64 {
            return Err(format!(
                "patch size ({patch}) must be 1 to 1024 and merge size ({merge}) 1 to 64"
            ));
        }
        let factor = u64::from(patch) * u64::from(merge);
        let side = |what: String, n: u64| {
            if n < factor {
                Err(format!(
                    "{what}: each side must be at least patch × merge = {factor} pixels, or \
                     the image gets no image token"
                ))
            } else {
                Ok(())
            }
        };
        match self.transform.resize {
            ResizeMode::Fixed { width, height } => {
                let what = format!("image size {width}x{height}");
                side(what.clone(), width.into())?;
                side(what.clone(), height.into())?;
                if u64::from(width) * u64::from(height) > MAX_OUTPUT_PIXELS {
                    return Err(format!(
                        "{what}: more than {MAX_OUTPUT_PIXELS} pixels per image"
                    ));
                }
            }
            ResizeMode::ShorterSide(size) => {
                side(format!("image size short:{size}"), size.into())?;
                if u64::from(size) * u64::from(size) > MAX_OUTPUT_PIXELS {
                    return Err(format!(
                        "image size short:{size}: more than {MAX_OUTPUT_PIXELS} pixels per image"
                    ));
                }
            }
            ResizeMode::QwenVl {
                min_pixels,
                max_pixels,
                factor: resize_factor,
            } => {
                if u64::from(resize_factor) != factor {
                    return Err(format!(
                        "the qwen resize's side multiple ({resize_factor}) must be patch × merge \
                         ({factor})"
                    ));
                }
                if min_pixels > max_pixels {
                    return Err(format!(
                        "min pixels ({min_pixels}) is above max pixels ({max_pixels})"
                    ));
                }
                if max_pixels < factor * factor || max_pixels > MAX_OUTPUT_PIXELS {
                    return Err(format!(
                        "max pixels ({max_pixels}) must be between patch × merge squared \
                         ({}) and {MAX_OUTPUT_PIXELS}",
                        factor * factor
                    ));
                }
            }
        }
        if self.transform.max_source_pixels == 0 {
            return Err("max source pixels must be at least 1".into());
        }
        Ok(())
    }
}

/// One sample sealed in the store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Produced {
    /// Its handle.
    pub handle: Handle,
    /// Manifest line.
    pub line: u64,
    /// Record id.
    pub id: String,
    /// Object size in bytes.
    pub bytes: u64,
}

/// Something the pipeline reports as it runs.
#[derive(Debug)]
pub enum Event {
    /// A sample was sealed.
    Produced(Produced),
    /// A record was rejected.
    Rejected(Reject),
    /// Nothing happened for [`IDLE_TICK`]: a run stalled (on its inputs, or on full windows)
    /// still gets its caller called, to draw progress or notice an interrupt.
    Idle,
}

/// How long a run goes without an event before its caller is called with [`Event::Idle`].
pub const IDLE_TICK: Duration = Duration::from_millis(500);

/// The end of a run.
#[derive(Debug, Clone)]
pub struct Summary {
    /// Samples sealed.
    pub produced: u64,
    /// Records rejected.
    pub rejected: u64,
    /// Where the time went.
    pub profile: StageProfile,
}

impl Summary {
    /// Rejected over all records seen.
    pub fn reject_rate(&self) -> f64 {
        let total = self.produced + self.rejected;
        if total == 0 {
            0.0
        } else {
            self.rejected as f64 / total as f64
        }
    }
}

/// Why a run could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ProducerError {
    /// The store is not reachable.
    #[error("cannot connect to the store")]
    Connect(#[source] feedstore_consumer::Error),
    /// The async runtime could not start.
    #[error("cannot start the runtime")]
    Runtime(#[source] std::io::Error),
    /// The stream refused this producer (another spec under its name, say).
    #[error("cannot feed the stream")]
    Stream(#[source] feedstore_consumer::Error),
    /// A setting is out of range ([`ProducerConfig::validate`] says which).
    #[error("{0}")]
    Invalid(String),
}

struct Job {
    record: Record,
    images: Vec<Bytes>,
}

impl Ordered for Job {
    fn order(&self) -> u64 {
        self.record.line
    }
}

/// Where a job stands in its run: the CPU workers take the lowest first.
pub(crate) trait Ordered {
    fn order(&self) -> u64;
}

/// The queue between the IO side and the CPU workers. Fetched jobs wait here and go to the
/// next free worker lowest order first (a stream's earliest position, a manifest's earliest
/// line), not in the order their fetches happened to end: a rank's first batch is made first.
/// Each job keeps its fetch's permit until a worker takes it, so jobs waiting here count against
/// the fetches in flight and the queue is as bounded as they are.
pub(crate) struct JobQueue<J> {
    state: std::sync::Mutex<Waiting<J>>,
    ready: std::sync::Condvar,
}

struct Waiting<J> {
    jobs: std::collections::BinaryHeap<Queued<J>>,
    /// Senders alive: the queue is closed when none is left.
    senders: usize,
    /// Workers alive ([`JobQueue::worker`]). When the last one ends (a panic outside a
    /// sample's own guard, say) the queue drops its jobs, giving their fetches' permits back,
    /// and every later job, so the IO side ends instead of waiting for room forever.
    workers: usize,
    /// No worker is left.
    orphaned: bool,
    /// Jobs queued so far: equal orders go first in, first out.
    arrivals: u64,
}

struct Queued<J> {
    key: std::cmp::Reverse<(u64, u64)>,
    queued: Instant,
    job: J,
    /// The fetch's permit (none for a job that fetched nothing: a task whose every candidate
    /// was rejected).
    permit: Option<tokio::sync::OwnedSemaphorePermit>,
}

impl<J> PartialEq for Queued<J> {
    fn eq(&self, other: &Self) -> bool {
        self.key == other.key
    }
}
impl<J> Eq for Queued<J> {}
impl<J> PartialOrd for Queued<J> {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl<J> Ord for Queued<J> {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.key.cmp(&other.key)
    }
}

/// A worker's registration on a [`JobQueue`]; the last one dropped orphans the queue.
struct WorkerAlive<J>(Arc<JobQueue<J>>);

impl<J> Drop for WorkerAlive<J> {
    fn drop(&mut self) {
        let mut state = self.0.lock();
        state.workers -= 1;
        if state.workers == 0 {
            state.orphaned = true;
            let jobs = std::mem::take(&mut state.jobs);
            drop(state);
            drop(jobs);
        }
    }
}

/// Puts jobs on a [`JobQueue`]; the queue closes when the last sender is dropped.
pub(crate) struct JobSender<J>(Arc<JobQueue<J>>);

impl<J: Ordered> JobSender<J> {
    /// Queues `job`, which keeps `permit` (its fetch's) until a worker takes it. Never waits.
    pub(crate) fn send(&self, job: J, permit: Option<tokio::sync::OwnedSemaphorePermit>) {
        let mut state = self.0.lock();
        if state.orphaned {
            return; // no worker will take it: dropped, its permit with it
        }
        state.arrivals += 1;
        let key = std::cmp::Reverse((job.order(), state.arrivals));
        state.jobs.push(Queued {
            key,
            queued: Instant::now(),
            job,
            permit,
        });
        drop(state);
        self.0.ready.notify_one();
    }
}

impl<J> Clone for JobSender<J> {
    fn clone(&self) -> Self {
        self.0.lock().senders += 1;
        JobSender(self.0.clone())
    }
}

impl<J> Drop for JobSender<J> {
    fn drop(&mut self) {
        let mut state = self.0.lock();
        state.senders -= 1;
        if state.senders == 0 {
            drop(state);
            self.0.ready.notify_all();
        }
    }
}

impl<J> JobQueue<J> {
    fn new() -> (JobSender<J>, Arc<JobQueue<J>>) {
        let queue = Arc::new(JobQueue {
            state: std::sync::Mutex::new(Waiting {
                jobs: std::collections::BinaryHeap::new(),
                senders: 1,
                workers: 0,
                orphaned: false,
                arrivals: 0,
            }),
            ready: std::sync::Condvar::new(),
        });
        (JobSender(queue.clone()), queue)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Waiting<J>> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Registers a worker until the returned guard drops (when its thread ends, by a panic
    /// too).
    fn worker(self: &Arc<Self>) -> WorkerAlive<J> {
        self.lock().workers += 1;
        WorkerAlive(self.clone())
    }

    /// [`JobQueue::next_or_idle`] with nothing to do before waiting.
    #[cfg(test)]
    fn next(&self, profiler: &Profiler) -> Option<J> {
        self.next_or_idle(profiler, || {})
    }

    /// A CPU worker's next job, the lowest order waiting; the wait counts as the worker's idle
    /// time, the job's wait as fetched work waiting for a worker. `None` once every sender is
    /// gone and no job is left. When no job is ready it first calls `idle` (outside the queue's
    /// lock, not counted as idle time): a worker's chance to finish what it left pending.
    fn next_or_idle(&self, profiler: &Profiler, idle: impl FnOnce()) -> Option<J> {
        let mut idle = Some(idle);
        let mut waited = Instant::now();
        let mut state = self.lock();
        let job = loop {
            if let Some(queued) = state.jobs.pop() {
                if queued.permit.is_some() {
                    profiler.fetch_blocked(queued.queued.elapsed());
                }
                break Some(queued.job);
            }
            if state.senders == 0 {
                break None;
            }
            if let Some(idle) = idle.take() {
                drop(state);
                idle();
                waited = Instant::now();
                state = self.lock();
                continue;
            }
            state = self.ready.wait(state).unwrap_or_else(|e| e.into_inner());
        };
        drop(state);
        profiler.cpu_idle(waited.elapsed());
        job
    }
}

/// The skeleton every producer run is built on, in named stages: [`Skeleton::connect`] (one
/// store connection per CPU worker, made in parallel: each maps the store, which is the
/// producer's cold start), [`Skeleton::cpu`] (worker threads, each with its own state, draining
/// one ordered queue of jobs), [`Skeleton::io`] (one thread whose tokio runtime fetches and
/// queues jobs) and [`Skeleton::finish`] (events to the caller's thread until every stage has
/// ended: no polling). [`run`] (a manifest, once) and [`crate::feed::feed`] (a stream's tasks)
/// differ only in where jobs come from and what a worker does with a sample.
pub(crate) struct Skeleton<J> {
    /// The run's stage profiler.
    pub(crate) profiler: Arc<Profiler>,
    started: Instant,
    workers: usize,
    fetch_concurrency: usize,
    /// Where the IO side queues jobs for the CPU workers (each holding its fetch's permit until
    /// taken: a slow CPU side holds fetches back).
    pub(crate) jobs: JobSender<J>,
    queue: Arc<JobQueue<J>>,
    /// Where samples and rejects go; the run ends when every clone is gone.
    pub(crate) events: std::sync::mpsc::Sender<Event>,
    received: std::sync::mpsc::Receiver<Event>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl<J: Send + 'static> Skeleton<J> {
    /// Connects one writer per CPU worker and `extra` more (named by `name(i)`), in parallel.
    pub(crate) fn connect(
        config: &ProducerConfig,
        extra: usize,
        name: impl Fn(usize) -> String + Sync,
    ) -> Result<(Skeleton<J>, Vec<Client>), ProducerError> {
        config.validate().map_err(ProducerError::Invalid)?;
        let started = Instant::now();
        let workers = config.workers.max(1);
        let name = &name;
        let clients = std::thread::scope(|scope| {
            let connecting: Vec<_> = (0..workers + extra)
                .map(|i| {
                    scope.spawn(move || {
                        ConnectOptions::new(Role::Writer)
                            .socket(&config.socket)
                            .name(name(i))
                            .create_timeout(config.create_timeout)
                            .connect()
                            .map_err(ProducerError::Connect)
                    })
                })
                .collect();
            connecting
                .into_iter()
                .map(|c| c.join().expect("connecting does not panic"))
                .collect::<Result<Vec<Client>, _>>()
        })?;
        let profiler = Arc::new(Profiler::default());
        profiler.started(started.elapsed());
        let (jobs, queue) = JobQueue::new();
        let (events, received) = std::sync::mpsc::channel();
        let skeleton = Skeleton {
            profiler,
            started,
            workers,
            fetch_concurrency: config.fetch_concurrency.max(1),
            jobs,
            queue,
            events,
            received,
            threads: Vec::new(),
        };
        Ok((skeleton, clients))
    }

    /// Counts the time until now as the producer's start-up (after joining a stream, say).
    pub(crate) fn started_now(&self) {
        self.profiler.started(self.started.elapsed());
    }

    /// Takes the profile as of any moment, from any thread.
    pub(crate) fn snapshots(&self) -> impl Fn() -> StageProfile + Send + 'static {
        let (profiler, started) = (self.profiler.clone(), self.started);
        let (workers, fetch_concurrency) = (self.workers, self.fetch_concurrency);
        move || profiler.snapshot(started.elapsed(), workers, fetch_concurrency)
    }

    /// Fetches in flight at most.
    pub(crate) fn fetch_concurrency(&self) -> usize {
        self.fetch_concurrency
    }

    /// Starts a CPU worker owning `state` (its connection): `work` handles each job, until the
    /// queue is closed and empty; `idle` is called whenever the worker finds no job ready,
    /// before it waits for one (what is still pending when the queue closes is for `state`'s
    /// `Drop`).
    pub(crate) fn cpu<W: Send + 'static>(
        &mut self,
        mut state: W,
        mut work: impl FnMut(&mut W, &mut Scratch, J) + Send + 'static,
        mut idle: impl FnMut(&mut W) + Send + 'static,
    ) {
        let (queue, profiler) = (self.queue.clone(), self.profiler.clone());
        let alive = queue.worker();
        self.threads.push(std::thread::spawn(move || {
            let _alive = alive;
            let mut scratch = Scratch::default();
            while let Some(job) = queue.next_or_idle(&profiler, || idle(&mut state)) {
                work(&mut state, &mut scratch, job);
            }
        }));
    }

    /// Runs `io` on the IO thread's runtime (current-thread: IO never takes a CPU worker's
    /// core).
    pub(crate) fn io(
        &mut self,
        io: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), ProducerError> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(ProducerError::Runtime)?;
        self.threads
            .push(std::thread::spawn(move || runtime.block_on(io)));
        Ok(())
    }

    /// Hands every event to `on_event` (on this thread), and [`Event::Idle`] while none comes,
    /// until the stages have all ended and
    /// dropped their senders, joins their threads, and sums the run up.
    pub(crate) fn finish(self, mut on_event: impl FnMut(&Event, &Profiler)) -> Summary {
        let Skeleton {
            profiler,
            started,
            workers,
            fetch_concurrency,
            jobs,
            queue,
            events,
            received,
            threads,
        } = self;
        drop((jobs, queue, events));
        let (mut produced, mut rejected) = (0, 0);
        loop {
            let event = match received.recv_timeout(IDLE_TICK) {
                Ok(event) => event,
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => Event::Idle,
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break,
            };
            match &event {
                Event::Produced(_) => produced += 1,
                Event::Rejected(_) => rejected += 1,
                Event::Idle => {}
            }
            on_event(&event, &profiler);
        }
        for t in threads {
            t.join().expect("a producer thread does not panic");
        }
        Summary {
            produced,
            rejected,
            profile: profiler.snapshot(started.elapsed(), workers, fetch_concurrency),
        }
    }
}

/// What the pipeline reads, one at a time: a record whose images it fetches, a record read
/// together with its images (a shard's sample), or a reject.
#[derive(Debug)]
pub enum Input {
    /// A record; its images are fetched.
    Record(Record),
    /// A record and its images' bytes, in the order of [`Record::images`].
    Read(Record, Vec<Bytes>),
    /// A record that will not be produced.
    Rejected(Reject),
}

/// Where the pipeline's inputs come from, read on its IO runtime (so reading may await: a
/// shard's next chunk from S3). The pipeline asks for the next input only once the last one
/// holds one of its `fetch_concurrency` permits (held until a worker takes it), so the inputs
/// held at once are bounded by that plus one.
pub trait Inputs: Send + 'static {
    /// The next input, `None` at the end.
    fn next(&mut self) -> impl Future<Output = Option<Input>> + Send;
}

/// A manifest (any iterator of records and rejects) as [`Inputs`].
#[derive(Debug)]
pub struct Records<I>(pub I);

impl<I: Iterator<Item = Result<Record, Reject>> + Send + 'static> Inputs for Records<I> {
    async fn next(&mut self) -> Option<Input> {
        Some(match self.0.next()? {
            Ok(record) => Input::Record(record),
            Err(reject) => Input::Rejected(reject),
        })
    }
}

/// Runs the pipeline over `records` to the end, calling `on_event` (on this thread) for every
/// sample and reject as they happen, and with [`Event::Idle`] while nothing happens.
pub fn run(
    config: &ProducerConfig,
    tokenizer: Arc<ChatTokenizer>,
    fetcher: Arc<dyn Fetch>,
    records: impl Iterator<Item = Result<Record, Reject>> + Send + 'static,
    on_event: impl FnMut(&Event, &Profiler),
) -> Result<Summary, ProducerError> {
    run_inputs(config, tokenizer, fetcher, Records(records), on_event)
}

/// [`run`] over any [`Inputs`]: a manifest's records, or a shard's samples.
pub fn run_inputs(
    config: &ProducerConfig,
    tokenizer: Arc<ChatTokenizer>,
    fetcher: Arc<dyn Fetch>,
    mut inputs: impl Inputs,
    on_event: impl FnMut(&Event, &Profiler),
) -> Result<Summary, ProducerError> {
    let (mut skeleton, clients) =
        Skeleton::<Job>::connect(config, 0, |i| format!("producer-worker-{i}"))?;
    for client in clients {
        let (tokenizer, config) = (tokenizer.clone(), config.clone());
        let sealer = Sealer {
            client,
            events: skeleton.events.clone(),
            profiler: skeleton.profiler.clone(),
            sealing: None,
        };
        let work = move |sealer: &mut Sealer, scratch: &mut Scratch, job| {
            let made = make(
                &config,
                &sealer.client,
                &tokenizer,
                &sealer.profiler,
                scratch,
                job,
            );
            // The last sample's seal: its reply was read aside by this one's reservation.
            sealer.confirm();
            match made {
                Ok((object, produced)) => {
                    let started = Instant::now();
                    let seal = object.seal_later();
                    // Part of the sample's write (which counted it).
                    sealer.profiler.add_busy(Stage::Write, started.elapsed());
                    sealer.sealing = Some((seal, produced));
                }
                Err(r) => {
                    let _ = sealer.events.send(Event::Rejected(r));
                }
            }
        };
        skeleton.cpu(sealer, work, Sealer::confirm);
    }
    let fetch_concurrency = skeleton.fetch_concurrency();
    let (job_tx, event_tx, profiler) = (
        skeleton.jobs.clone(),
        skeleton.events.clone(),
        skeleton.profiler.clone(),
    );
    skeleton.io(async move {
        let permits = Arc::new(tokio::sync::Semaphore::new(fetch_concurrency));
        loop {
            let started = Instant::now();
            let record = match inputs.next().await {
                None => break,
                Some(Input::Record(record)) => record,
                Some(Input::Rejected(reject)) => {
                    let _ = event_tx.send(Event::Rejected(reject));
                    continue;
                }
                Some(Input::Read(record, images)) => {
                    // Reading it was its fetch.
                    profiler.record(Stage::Fetch, started.elapsed());
                    profiler.fetched(images.iter().map(|i| i.len() as u64).sum());
                    let permit = permits.clone().acquire_owned().await.expect("never closed");
                    job_tx.send(Job { record, images }, Some(permit));
                    continue;
                }
            };
            let event_tx = event_tx.clone();
            let job = |record, images| Job { record, images };
            spawn_fetch(
                &permits,
                &fetcher,
                record,
                &profiler,
                &job_tx,
                job,
                move |reject| {
                    let _ = event_tx.send(Event::Rejected(reject));
                },
            )
            .await;
        }
        // Every fetch holds a permit until a worker takes its job: all permits back means done.
        let _ = permits.acquire_many(fetch_concurrency as u32).await;
    })?;
    Ok(skeleton.finish(on_event))
}

/// Waits for one of `permits` (the fetches allowed in flight), then fetches `record`'s images
/// in a task of its own and queues `job(record, images)` for the CPU workers, or hands the
/// reject to `rejected`. The permit is held until a worker takes the job.
pub(crate) async fn spawn_fetch<J: Ordered + Send + 'static>(
    permits: &Arc<tokio::sync::Semaphore>,
    fetcher: &Arc<dyn Fetch>,
    record: Record,
    profiler: &Arc<Profiler>,
    jobs: &JobSender<J>,
    job: impl FnOnce(Record, Vec<Bytes>) -> J + Send + 'static,
    rejected: impl FnOnce(Reject) + Send + 'static,
) {
    let permit = permits.clone().acquire_owned().await.expect("never closed");
    let (fetcher, profiler, jobs) = (fetcher.clone(), profiler.clone(), jobs.clone());
    tokio::spawn(async move {
        match fetch_all(&*fetcher, &record, &profiler).await {
            Ok(images) => jobs.send(job(record, images), Some(permit)),
            Err(reject) => rejected(reject),
        }
    });
}

pub(crate) async fn fetch_all(
    fetcher: &dyn Fetch,
    record: &Record,
    profiler: &Profiler,
) -> Result<Vec<Bytes>, Reject> {
    let mut images = Vec::with_capacity(record.images.len());
    for source in &record.images {
        profiler.fetch_in_flight(1);
        let started = Instant::now();
        let result = fetcher.fetch(source).await;
        profiler.fetch_in_flight(-1);
        profiler.record(Stage::Fetch, started.elapsed());
        match result {
            Ok(bytes) => {
                profiler.fetched(bytes.len() as u64);
                images.push(bytes);
            }
            // Every FetchError names its source already.
            Err(e) => {
                let reason = e.to_string();
                profiler.fetch_failed(&reason);
                return Err(reject(record, "fetch", reason));
            }
        }
    }
    Ok(images)
}

pub(crate) fn reject(record: &Record, stage: &str, reason: String) -> Reject {
    let reason = match &record.origin {
        Some(origin) => format!("{origin}: {reason}"),
        None => reason,
    };
    Reject {
        line: record.line,
        id: Some(record.id.clone()),
        stage: stage.into(),
        reason,
    }
}

/// One sample, start to just before its seal, on a CPU worker.
fn make(
    config: &ProducerConfig,
    client: &Client,
    tokenizer: &ChatTokenizer,
    profiler: &Profiler,
    scratch: &mut Scratch,
    job: Job,
) -> Result<(ObjectWriter, Produced), Reject> {
    let Job { record, images } = job;
    let (object, size) = make_sample(
        config, client, tokenizer, profiler, scratch, &record, images,
    )?;
    let produced = Produced {
        handle: object.handle(),
        line: record.line,
        id: record.id,
        bytes: size,
    };
    Ok((object, produced))
}

/// A CPU worker's connection in a manifest run, with the seal it sent and has not read the
/// reply of ([`ObjectWriter::seal_later`]). The reply is read just before the worker seals its
/// next sample (by then it has come, read aside by that sample's reservation), when the worker
/// finds no job ready, and as it ends; only then is the sample reported, so a handle is handed
/// on only once every connection sees it sealed. A sample costs its worker one wait for the
/// daemon (the reservation) instead of two.
struct Sealer {
    client: Client,
    events: std::sync::mpsc::Sender<Event>,
    profiler: Arc<Profiler>,
    sealing: Option<(PendingSeal, Produced)>,
}

impl Sealer {
    /// Reads the reply of the seal sent, and reports its sample (or why it was refused).
    fn confirm(&mut self) {
        let Some((seal, produced)) = self.sealing.take() else {
            return;
        };
        let started = Instant::now();
        let sealed = seal.wait();
        self.profiler.add_busy(Stage::Write, started.elapsed());
        let event = match sealed {
            Ok(_) => Event::Produced(produced),
            Err(e) => Event::Rejected(Reject {
                line: produced.line,
                id: Some(produced.id),
                stage: "write".into(),
                reason: e.to_string(),
            }),
        };
        let _ = self.events.send(event);
    }
}

impl Drop for Sealer {
    fn drop(&mut self) {
        self.confirm();
    }
}

/// Where a sample is written: a reservation in the store (the producer's case), or a plain
/// 64-byte-aligned heap buffer (a loader without a store, as the demo's baselines are).
pub trait SampleBuffer {
    /// The buffer's bytes, to write the sample into.
    fn bytes_mut(&mut self) -> &mut [u8];
}

impl SampleBuffer for ObjectWriter {
    fn bytes_mut(&mut self) -> &mut [u8] {
        self.as_mut_slice()
    }
}

impl SampleBuffer for AlignedBuf {
    fn bytes_mut(&mut self) -> &mut [u8] {
        self.as_mut_slice()
    }
}

/// One sample written into a new object of the store, everything but the seal: the caller
/// seals it or hands it to a stream. Profiles each stage; the write stage's reservation and
/// finishing are counted here, the seal by the caller.
pub(crate) fn make_sample(
    config: &ProducerConfig,
    client: &Client,
    tokenizer: &ChatTokenizer,
    profiler: &Profiler,
    scratch: &mut Scratch,
    record: &Record,
    images: Vec<Bytes>,
) -> Result<(ObjectWriter, u64), Reject> {
    let reserve = |size: u64| client.create(size).map_err(|e| e.to_string());
    // A panic in a decoder, the resizer or the tokenizer on one hostile record rejects that
    // record (its reservation is aborted as the writer unwinds), not the worker and the run.
    let made = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        make_sample_into(
            config, tokenizer, profiler, scratch, record, images, reserve,
        )
    }));
    made.unwrap_or_else(|_| {
        *scratch = Scratch::default();
        Err(reject(
            record,
            "decode",
            "the producer panicked on this record (a bug: please report it with the record)".into(),
        ))
    })
}

/// One sample — decode, resize, normalise, tokenize — written into the buffer `reserve` gives
/// for its size (a failure drops the buffer: nothing half-written is kept).
#[allow(clippy::too_many_arguments)]
pub fn make_sample_into<B: SampleBuffer>(
    config: &ProducerConfig,
    tokenizer: &ChatTokenizer,
    profiler: &Profiler,
    scratch: &mut Scratch,
    record: &Record,
    images: Vec<Bytes>,
    reserve: impl FnOnce(u64) -> Result<B, String>,
) -> Result<(B, u64), Reject> {
    let t = &config.transform;

    // Decode first: the sizes, the token count and the object's size all follow from it.
    let started = Instant::now();
    let mut decoded = Vec::with_capacity(images.len());
    for (bytes, source) in images.iter().zip(&record.images) {
        let image = t
            .decode(bytes)
            .map_err(|e| reject(record, "decode", format!("{source}: {e}")))?;
        decoded.push((image.rgb, image.target));
    }
    drop(images);
    profiler.record(Stage::Decode, started.elapsed());

    let started = Instant::now();
    let pads: Vec<usize> = decoded
        .iter()
        .map(|(_, (w, h))| image_pad_tokens(*h, *w, config.patch_size, config.merge_size))
        .collect();
    let encoded = match &record.content {
        Content::Conversation(messages) => {
            tokenizer.encode_with_tools(messages, record.tools.as_ref(), &pads)
        }
        Content::Text(text) => tokenizer.encode_text(text),
    }
    .map_err(|e| reject(record, "tokenize", e.to_string()))?;
    profiler.record(Stage::Tokenize, started.elapsed());

    let mut plan = SamplePlan::new();
    for (_, (w, h)) in &decoded {
        let shape = t.shape(*w, *h);
        plan.add_image(t.dtype, t.layout, &shape);
    }
    plan.set_token_count(encoded.ids.len());
    let info = SampleInfo {
        id: record.id.clone(),
        source_keys: record.images.iter().map(ToString::to_string).collect(),
        image_grid_thw: decoded
            .iter()
            .map(|(_, (w, h))| [1, h / config.patch_size, w / config.patch_size])
            .collect(),
        metadata: vec![
            KeyValue {
                key: "line".into(),
                value: record.line.to_string(),
            },
            // What the pixels are: a reader checks it against what its model expects.
            KeyValue {
                key: "normalize".into(),
                value: t.normalization(),
            },
        ],
    };

    let started = Instant::now();
    let size = plan.object_bytes(&info);
    let mut object = reserve(size).map_err(|e| reject(record, "write", e))?;
    let reserving = started.elapsed();

    // From here on a failure drops `object`, which aborts it: nothing half-written is visible.
    let started = Instant::now();
    {
        let regions = plan
            .regions(object.bytes_mut())
            .map_err(|e| reject(record, "write", e.to_string()))?;
        for ((rgb, target), region) in decoded.iter().zip(regions.images) {
            t.resize_into(rgb, *target, region, scratch)
                .map_err(|e| reject(record, "decode", e.to_string()))?;
        }
        regions.tokens.copy_from_slice(&encoded.ids);
        regions.labels.copy_from_slice(&encoded.labels);
    }
    profiler.record(Stage::Resize, started.elapsed());

    let started = Instant::now();
    plan.finish(object.bytes_mut(), &info)
        .map_err(|e| reject(record, "write", e.to_string()))?;
    profiler.record(Stage::Write, reserving + started.elapsed());
    Ok((object, size))
}

#[cfg(test)]
mod job_queue_tests;
