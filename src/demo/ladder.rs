//! The seed's experiment as a ladder of loaders, each a trainer loop over the same data, latency,
//! step time and CPUs:
//!
//! - (0) serial: fetch, decode, resize, normalise and tokenize each sample inside the training
//!   loop;
//! - (1) + concurrent fetch and CPU workers: each batch's images fetched at once, its samples
//!   made on every core, but the trainer still waits for its batch;
//! - (2) + background prefetch: batches made ahead in the background and handed over as copies
//!   through a socket (what a worker process pickling tensors to its trainer does);
//! - (3) feedstore: producers write each sample once into shared memory and the trainer takes it
//!   from its stream by handle (`super::run_feedstore`).
//!
//! Rungs 0-2 run the producer's own sample code (`make_sample_into`), writing into heap buffers,
//! so only the loading strategy differs between rungs.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use bytes::Bytes;
use feedstore_producer::chat::ChatTokenizer;
use feedstore_producer::manifest::{IndexedManifest, Record};
use feedstore_producer::pipeline::{Fetch, ProducerConfig, make_sample_into};
use feedstore_producer::profile::{Profiler, Stage};
use feedstore_producer::vision::Scratch;
use feedstore_proto::sample::{AlignedBuf, SampleView};

/// Per step: seconds waiting for the batch, seconds computing.
pub type Steps = Vec<(f64, f64)>;

/// A record with its images fetched.
type Fetched = (Record, Vec<Bytes>);

/// What a rung measured.
#[derive(Debug, Clone, serde::Serialize)]
pub struct RungResult {
    /// The rung's name.
    pub name: String,
    /// Per trainer rank, per step: seconds waiting for the batch, seconds computing.
    pub steps: Vec<Steps>,
    /// Samples the trainers consumed.
    pub samples: u64,
    /// Wall-clock seconds of the whole run (startup included).
    pub wall: f64,
    /// Seconds from start to each rank's first batch.
    pub first_batch: Vec<f64>,
}

impl RungResult {
    /// Waiting over waiting + computing, for one rank, in the steady state: the first step's
    /// wait is the cold start (reported as the time to first batch), not what a long run pays.
    pub fn wait_ratio_of(&self, rank: usize) -> f64 {
        ratio(steady(&self.steps[rank]))
    }

    /// The steady-state wait-time ratio over every rank's steps.
    pub fn wait_ratio(&self) -> f64 {
        ratio(self.steps.iter().flat_map(|s| steady(s)))
    }

    /// The result of one trainer's `train`.
    fn single(name: &str, started: Instant, (steps, samples, first): (Steps, u64, f64)) -> Self {
        RungResult {
            name: name.into(),
            steps: vec![steps],
            samples,
            wall: started.elapsed().as_secs_f64(),
            first_batch: vec![first],
        }
    }

    /// Samples per second in the steady state (after each rank's first batch), over all ranks:
    /// what a long run sustains. The cold start is `first_batch`.
    pub fn samples_per_sec(&self) -> f64 {
        let total_steps: usize = self.steps.iter().map(Vec::len).sum();
        if total_steps == 0 {
            return 0.0;
        }
        let batch = self.samples as f64 / total_steps as f64;
        self.steps
            .iter()
            .map(|steps| {
                let steady = steady(steps);
                let time: f64 = steady.iter().map(|(w, c)| w + c).sum();
                if time > 0.0 {
                    steady.len() as f64 * batch / time
                } else {
                    0.0
                }
            })
            .sum()
    }
}

/// A rank's steps after the first (all of them if there is only one).
fn steady(steps: &[(f64, f64)]) -> &[(f64, f64)] {
    if steps.len() > 1 { &steps[1..] } else { steps }
}

/// Waiting over waiting + computing.
fn ratio<'a>(steps: impl IntoIterator<Item = &'a (f64, f64)>) -> f64 {
    let (wait, compute) = steps
        .into_iter()
        .fold((0.0, 0.0), |(w, c), s| (w + s.0, c + s.1));
    if wait + compute == 0.0 {
        0.0
    } else {
        wait / (wait + compute)
    }
}

/// The settings every rung shares.
#[derive(Clone)]
pub struct Setup {
    pub config: ProducerConfig,
    pub tokenizer: Arc<ChatTokenizer>,
    pub manifest: Arc<IndexedManifest>,
    pub batch: usize,
    pub steps: usize,
    pub step_time: Duration,
    /// A fresh image source (each rung gets its own, with the same latencies).
    pub source: Arc<dyn Fn() -> Arc<dyn Fetch> + Send + Sync>,
}

/// A trainer's loop: `steps` times, wait for a batch of `batch` samples (`next_batch` returns
/// how many it got), then compute for `step_time`. Returns each step's (wait, compute). Its
/// progress lines name `rank` when there is one (several trainers print side by side).
pub fn train(
    setup: &Setup,
    started: Instant,
    rank: Option<u32>,
    mut next_batch: impl FnMut() -> anyhow::Result<usize>,
) -> anyhow::Result<(Steps, u64, f64)> {
    let mut steps = Vec::with_capacity(setup.steps);
    let mut samples = 0;
    let mut first_batch = 0.0;
    let mut shown = Instant::now();
    for step in 0..setup.steps {
        if shown.elapsed() >= Duration::from_secs(3) {
            shown = Instant::now();
            let waited: f64 = steps.iter().map(|s: &(f64, f64)| s.0).sum();
            let who = rank.map_or(String::new(), |r| format!("rank {r}: "));
            eprintln!(
                "  {who}step {step}/{}, {waited:.1} s spent waiting so far",
                setup.steps
            );
        }
        let t = Instant::now();
        let got = next_batch()?;
        let wait = t.elapsed();
        if got != setup.batch {
            bail!(
                "step {step}: a batch of {got} samples, expected {}",
                setup.batch
            );
        }
        if step == 0 {
            first_batch = started.elapsed().as_secs_f64();
        }
        samples += got as u64;
        // The model's step: the accelerator computes, the host thread waits for it.
        std::thread::sleep(setup.step_time);
        steps.push((wait.as_secs_f64(), setup.step_time.as_secs_f64()));
    }
    Ok((steps, samples, first_batch))
}

/// Record `i` of the manifest (wrapping), with its images fetched.
async fn fetch_record(
    manifest: &IndexedManifest,
    source: &dyn Fetch,
    i: u64,
) -> anyhow::Result<Fetched> {
    let record = manifest
        .get(i % manifest.len())
        .map_err(|r| anyhow::anyhow!("record {}: {}", r.line, r.reason))?;
    let mut images = Vec::with_capacity(record.images.len());
    for image in &record.images {
        images.push(
            source
                .fetch(image)
                .await
                .map_err(|e| anyhow::anyhow!("{image}: {e}"))?,
        );
    }
    Ok((record, images))
}

/// Makes one sample in a heap buffer and checks it is a valid sample.
fn make(
    setup: &Setup,
    profiler: &Profiler,
    scratch: &mut Scratch,
    record: &Record,
    images: Vec<Bytes>,
) -> anyhow::Result<AlignedBuf> {
    let (buf, _) = make_sample_into(
        &setup.config,
        &setup.tokenizer,
        profiler,
        scratch,
        record,
        images,
        |size| Ok(AlignedBuf::zeroed(size as usize)),
    )
    .map_err(|r| anyhow::anyhow!("record {} ({}): {}", r.line, r.stage, r.reason))?;
    SampleView::new(buf.as_slice()).context("a sample the trainer cannot read")?;
    Ok(buf)
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting a runtime")
}

/// Rung 0: everything in the training loop, one sample after the other.
pub fn serial(setup: &Setup) -> anyhow::Result<RungResult> {
    let started = Instant::now();
    let rt = runtime()?;
    let source = (setup.source)();
    let profiler = Profiler::default();
    let mut scratch = Scratch::default();
    let mut next = 0u64;
    let mut batch = Vec::with_capacity(setup.batch);
    let trained = train(setup, started, None, || {
        batch.clear();
        for _ in 0..setup.batch {
            let t = Instant::now();
            let (record, images) = rt.block_on(fetch_record(&setup.manifest, &*source, next))?;
            profiler.record(Stage::Fetch, t.elapsed());
            next += 1;
            batch.push(make(setup, &profiler, &mut scratch, &record, images)?);
        }
        Ok(batch.len())
    })?;
    Ok(RungResult::single(
        "0 serial loader in the training loop",
        started,
        trained,
    ))
}

/// One batch made with every image fetched at once and the samples spread over `workers`
/// threads (the shared step of rungs 1 and 2).
fn make_batch(
    setup: &Setup,
    rt: &tokio::runtime::Runtime,
    source: &dyn Fetch,
    profiler: &Profiler,
    first: u64,
) -> anyhow::Result<Vec<AlignedBuf>> {
    let fetched = rt.block_on(futures_util::future::try_join_all(
        (first..first + setup.batch as u64).map(|i| fetch_record(&setup.manifest, source, i)),
    ))?;
    let jobs: Vec<std::sync::Mutex<Option<Fetched>>> = fetched
        .into_iter()
        .map(|j| std::sync::Mutex::new(Some(j)))
        .collect();
    let next = AtomicUsize::new(0);
    let workers = setup.config.workers.max(1).min(jobs.len());
    let mut made: Vec<(usize, AlignedBuf)> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..workers)
            .map(|_| {
                scope.spawn(|| -> anyhow::Result<Vec<(usize, AlignedBuf)>> {
                    let mut scratch = Scratch::default();
                    let mut out = Vec::new();
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(job) = jobs.get(i) else {
                            return Ok(out);
                        };
                        let (record, images) = job
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .take()
                            .expect("each job taken once");
                        out.push((i, make(setup, profiler, &mut scratch, &record, images)?));
                    }
                })
            })
            .collect();
        let mut all = Vec::new();
        for h in handles {
            all.extend(h.join().expect("a worker panicked")?);
        }
        anyhow::Ok(all)
    })?;
    made.sort_by_key(|(i, _)| *i);
    Ok(made.into_iter().map(|(_, b)| b).collect())
}

/// Rung 1: concurrent fetch and CPU workers, no prefetch.
pub fn concurrent(setup: &Setup) -> anyhow::Result<RungResult> {
    let started = Instant::now();
    let rt = runtime()?;
    let source = (setup.source)();
    let profiler = Profiler::default();
    let mut next = 0u64;
    let trained = train(setup, started, None, || {
        let batch = make_batch(setup, &rt, &*source, &profiler, next)?;
        next += setup.batch as u64;
        Ok(batch.len())
    })?;
    Ok(RungResult::single(
        "1 + concurrent fetch and CPU workers",
        started,
        trained,
    ))
}

/// Rung 2: rung 1's batches made ahead in the background (up to `prefetch` batches) and handed
/// to the trainer as copies through a socket, as a worker process's queue does. With several
/// `ranks`, each trainer has its own loader, the CPU workers split between them.
pub fn prefetch(setup: &Setup, prefetch: usize, ranks: usize) -> anyhow::Result<RungResult> {
    let started = Instant::now();
    let mut per_rank = setup.clone();
    per_rank.config.workers = (setup.config.workers / ranks.max(1)).max(1);
    let trainers: Vec<_> = (0..ranks.max(1))
        .map(|rank| {
            let setup = per_rank.clone();
            std::thread::spawn(move || prefetch_rank(&setup, prefetch, rank, ranks, started))
        })
        .collect();
    let mut result = RungResult {
        name: if ranks > 1 {
            format!("2 + background prefetch (copies), {ranks} ranks")
        } else {
            "2 + background prefetch (copies)".into()
        },
        steps: Vec::new(),
        samples: 0,
        wall: 0.0,
        first_batch: Vec::new(),
    };
    for t in trainers {
        let (steps, samples, first) = t.join().expect("a trainer panicked")?;
        result.steps.push(steps);
        result.samples += samples;
        result.first_batch.push(first);
    }
    result.wall = started.elapsed().as_secs_f64();
    Ok(result)
}

/// One rank of rung 2: its loader threads and its trainer loop.
fn prefetch_rank(
    setup: &Setup,
    prefetch: usize,
    rank: usize,
    ranks: usize,
    started: Instant,
) -> anyhow::Result<(Steps, u64, f64)> {
    let (tx, rx) = mpsc::sync_channel::<Vec<AlignedBuf>>(prefetch.max(1));
    let (mut to_trainer, mut from_loader) = UnixStream::pair().context("a socket pair")?;
    let maker = {
        let setup = setup.clone();
        std::thread::spawn(move || -> anyhow::Result<()> {
            let rt = runtime()?;
            let source = (setup.source)();
            let profiler = Profiler::default();
            // This rank's share: every `ranks`-th batch of the record sequence.
            for step in 0..setup.steps {
                let first = ((step * ranks + rank) * setup.batch) as u64;
                let batch = make_batch(&setup, &rt, &*source, &profiler, first)?;
                if tx.send(batch).is_err() {
                    break;
                }
            }
            Ok(())
        })
    };
    // The queue's feeder: serialises each sample onto the socket (length, then bytes).
    let feeder = std::thread::spawn(move || -> std::io::Result<()> {
        for batch in rx {
            for sample in batch {
                to_trainer.write_all(&(sample.as_slice().len() as u64).to_le_bytes())?;
                to_trainer.write_all(sample.as_slice())?;
            }
        }
        Ok(())
    });
    let mut received = Vec::with_capacity(setup.batch);
    let result = train(setup, started, None, || {
        received.clear();
        for _ in 0..setup.batch {
            let mut len = [0u8; 8];
            from_loader
                .read_exact(&mut len)
                .context("the loader went away")?;
            let mut sample = AlignedBuf::zeroed(u64::from_le_bytes(len) as usize);
            from_loader.read_exact(sample.as_mut_slice())?;
            SampleView::new(sample.as_slice()).context("a sample the trainer cannot read")?;
            received.push(sample);
        }
        Ok(received.len())
    });
    drop(from_loader);
    let made = maker.join().expect("the loader thread panicked");
    let _ = feeder.join();
    let result = result?;
    made?;
    Ok(result)
}
