//! The stage profiler: where a producer's time goes, and which knob to turn.
//!
//! Every fix to a data pipeline exposes the next bottleneck, so the producer measures each stage
//! as it runs: busy time and item count per stage, how long CPU workers sat idle waiting for
//! fetched images (the pipeline is fetch-bound), and how long fetched images waited for a free
//! CPU worker (it is CPU-bound), and, feeding a stream, how long it waited for the daemon to
//! hand out work while every rank's window was full (the trainers are the bottleneck).
//! [`StageProfile::verdict`] turns those into one sentence naming the bottleneck and the flag to
//! change. A stream's producers report these figures to the daemon ([`StageProfile::figures`]),
//! which sums them for `feedstore top` and the metrics ([`StageProfile::from_figures`]).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use feedstore_proto::frame::ProducerFigures;

/// A pipeline stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// Reading image bytes (S3 or local files).
    Fetch,
    /// Decoding the image.
    Decode,
    /// Resizing, normalising and writing pixels into shared memory.
    Resize,
    /// Chat template, tokenization, labels.
    Tokenize,
    /// Reserving, finishing and sealing the object.
    Write,
}

/// All stages, in pipeline order.
pub const STAGES: [Stage; 5] = [
    Stage::Fetch,
    Stage::Decode,
    Stage::Resize,
    Stage::Tokenize,
    Stage::Write,
];

impl Stage {
    /// Lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            Stage::Fetch => "fetch",
            Stage::Decode => "decode",
            Stage::Resize => "resize+normalize",
            Stage::Tokenize => "tokenize",
            Stage::Write => "write",
        }
    }
}

#[derive(Debug, Default)]
struct Counter {
    busy_ns: AtomicU64,
    items: AtomicU64,
}

/// Live counters, shared by every task and worker of one producer.
#[derive(Debug, Default)]
pub struct Profiler {
    stages: [Counter; 5],
    /// CPU workers waiting for work.
    cpu_idle_ns: AtomicU64,
    /// Fetched records waiting for a CPU worker.
    fetch_blocked_ns: AtomicU64,
    fetch_in_flight: AtomicU64,
    fetched_bytes: AtomicU64,
    fetches_ok: AtomicU64,
    fetch_failures: AtomicU64,
    first_fetch_failure: std::sync::OnceLock<String>,
    startup_ns: AtomicU64,
    /// Waiting for work while every rank's prefetch window was full.
    backpressure_ns: AtomicU64,
    cache_hits: AtomicU64,
}

impl Profiler {
    /// Adds busy time to a stage.
    pub fn record(&self, stage: Stage, busy: Duration) {
        let c = &self.stages[stage as usize];
        c.busy_ns
            .fetch_add(busy.as_nanos() as u64, Ordering::Relaxed);
        c.items.fetch_add(1, Ordering::Relaxed);
    }

    /// Adds busy time to a stage for an item already counted (a sample's put into its stream,
    /// after its write).
    pub fn add_busy(&self, stage: Stage, busy: Duration) {
        self.stages[stage as usize]
            .busy_ns
            .fetch_add(busy.as_nanos() as u64, Ordering::Relaxed);
    }

    /// Adds time a CPU worker spent waiting for input.
    pub fn cpu_idle(&self, d: Duration) {
        self.cpu_idle_ns
            .fetch_add(d.as_nanos() as u64, Ordering::Relaxed);
    }

    /// Adds time a fetched record waited for a CPU worker.
    pub fn fetch_blocked(&self, d: Duration) {
        self.fetch_blocked_ns
            .fetch_add(d.as_nanos() as u64, Ordering::Relaxed);
    }

    /// Records how long the producer took to start (its CPU workers connecting to the store)
    /// before any work could run.
    pub fn started(&self, startup: Duration) {
        self.startup_ns
            .store(startup.as_nanos() as u64, Ordering::Relaxed);
    }

    /// Counts a fetch that succeeded, and its bytes.
    pub fn fetched(&self, bytes: u64) {
        self.fetched_bytes.fetch_add(bytes, Ordering::Relaxed);
        self.fetches_ok.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a fetch that failed; the first failure's reason is kept for the verdict.
    pub fn fetch_failed(&self, reason: &str) {
        self.fetch_failures.fetch_add(1, Ordering::Relaxed);
        let _ = self.first_fetch_failure.set(reason.to_owned());
    }

    /// Adds time spent waiting for the daemon to hand out work (every window full).
    pub fn backpressure(&self, d: Duration) {
        self.backpressure_ns
            .fetch_add(d.as_nanos() as u64, Ordering::Relaxed);
    }

    /// Counts samples served from the decode-once cache.
    pub fn cache_hits(&self, n: u64) {
        self.cache_hits.fetch_add(n, Ordering::Relaxed);
    }

    /// A fetch started (+1) or ended (-1).
    pub fn fetch_in_flight(&self, delta: i64) {
        if delta >= 0 {
            self.fetch_in_flight
                .fetch_add(delta as u64, Ordering::Relaxed);
        } else {
            self.fetch_in_flight
                .fetch_sub(delta.unsigned_abs(), Ordering::Relaxed);
        }
    }

    /// A snapshot.
    pub fn snapshot(
        &self,
        wall: Duration,
        cpu_workers: usize,
        fetch_concurrency: usize,
    ) -> StageProfile {
        let ns = |a: &AtomicU64| Duration::from_nanos(a.load(Ordering::Relaxed));
        let startup = ns(&self.startup_ns).min(wall);
        StageProfile {
            wall,
            cpu_workers,
            fetch_concurrency,
            stages: STAGES.map(|s| {
                let c = &self.stages[s as usize];
                (s, ns(&c.busy_ns), c.items.load(Ordering::Relaxed))
            }),
            cpu_idle: ns(&self.cpu_idle_ns),
            fetch_blocked: ns(&self.fetch_blocked_ns),
            fetch_in_flight: self.fetch_in_flight.load(Ordering::Relaxed),
            fetched_bytes: self.fetched_bytes.load(Ordering::Relaxed),
            fetches_ok: self.fetches_ok.load(Ordering::Relaxed),
            fetch_failures: self.fetch_failures.load(Ordering::Relaxed),
            first_fetch_failure: self.first_fetch_failure.get().cloned(),
            startup,
            worker_time: (wall - startup)
                .checked_mul(u32::try_from(cpu_workers).unwrap_or(u32::MAX))
                .unwrap_or(Duration::MAX),
            backpressure: ns(&self.backpressure_ns),
            cache_hits: self.cache_hits.load(Ordering::Relaxed),
        }
    }
}

fn share(part: Duration, whole: Duration) -> f64 {
    if whole.is_zero() {
        0.0
    } else {
        (part.as_secs_f64() / whole.as_secs_f64()).min(1.0)
    }
}

/// What the profiler measured, at one moment.
#[derive(Debug, Clone)]
pub struct StageProfile {
    /// Wall-clock time so far.
    pub wall: Duration,
    /// CPU workers.
    pub cpu_workers: usize,
    /// Fetch concurrency limit.
    pub fetch_concurrency: usize,
    /// Per stage: busy time (summed over concurrent tasks) and items.
    pub stages: [(Stage, Duration, u64); 5],
    /// Total time CPU workers waited for fetched input.
    pub cpu_idle: Duration,
    /// Total time fetched records waited for a CPU worker.
    pub fetch_blocked: Duration,
    /// Fetches in flight now.
    pub fetch_in_flight: u64,
    /// Bytes fetched.
    pub fetched_bytes: u64,
    /// Fetches that succeeded.
    pub fetches_ok: u64,
    /// Fetches that failed.
    pub fetch_failures: u64,
    /// The first failed fetch's reason.
    pub first_fetch_failure: Option<String>,
    /// Time before the CPU workers could start (connecting to the store, mapping its memory).
    pub startup: Duration,
    /// The CPU workers' time since they started: workers × (wall − startup).
    pub worker_time: Duration,
    /// Time spent waiting for work while every rank's prefetch window was full.
    pub backpressure: Duration,
    /// Samples served from the decode-once cache.
    pub cache_hits: u64,
}

impl StageProfile {
    /// Share of the CPU workers' time since they started spent waiting for input.
    pub fn cpu_idle_share(&self) -> f64 {
        share(self.cpu_idle, self.worker_time)
    }

    /// Share of the time since the workers started spent waiting for work while every rank's
    /// prefetch window was full.
    pub fn backpressure_share(&self) -> f64 {
        share(self.backpressure, self.wall.saturating_sub(self.startup))
    }

    /// What a producer reports to the daemon.
    pub fn figures(&self) -> ProducerFigures {
        let us = |d: Duration| d.as_micros().min(u128::from(u64::MAX)) as u64;
        ProducerFigures {
            elapsed_us: us(self.wall),
            startup_us: us(self.startup),
            worker_us: us(self.worker_time),
            stage_busy_us: self.stages.map(|(_, busy, _)| us(busy)),
            stage_items: self.stages.map(|(_, _, items)| items),
            cpu_idle_us: us(self.cpu_idle),
            fetch_blocked_us: us(self.fetch_blocked),
            backpressure_us: us(self.backpressure),
            fetched_bytes: self.fetched_bytes,
            fetches_ok: self.fetches_ok,
            fetch_failures: self.fetch_failures,
            cache_hits: self.cache_hits,
            cpu_workers: self.cpu_workers as u64,
            fetch_concurrency: self.fetch_concurrency as u64,
            fetch_in_flight: self.fetch_in_flight,
        }
    }

    /// A profile from reported figures (one producer's, a sum of several, or what grew between
    /// two readings: [`ProducerFigures::since`]). Its verdict reads them as one producer's.
    pub fn from_figures(f: &ProducerFigures) -> StageProfile {
        let us = Duration::from_micros;
        let mut stages = STAGES.map(|s| (s, Duration::ZERO, 0));
        for (i, stage) in stages.iter_mut().enumerate() {
            stage.1 = us(f.stage_busy_us[i]);
            stage.2 = f.stage_items[i];
        }
        StageProfile {
            wall: us(f.elapsed_us),
            cpu_workers: f.cpu_workers as usize,
            fetch_concurrency: f.fetch_concurrency as usize,
            stages,
            cpu_idle: us(f.cpu_idle_us),
            fetch_blocked: us(f.fetch_blocked_us),
            fetch_in_flight: f.fetch_in_flight,
            fetched_bytes: f.fetched_bytes,
            fetches_ok: f.fetches_ok,
            fetch_failures: f.fetch_failures,
            first_fetch_failure: None,
            startup: us(f.startup_us.min(f.elapsed_us)),
            worker_time: us(f.worker_us),
            backpressure: us(f.backpressure_us),
            cache_hits: f.cache_hits,
        }
    }

    /// One sentence: the bottleneck and the knob to turn.
    pub fn verdict(&self) -> String {
        if self.fetches_ok == 0 && self.fetch_failures > 0 {
            return format!(
                "every image fetch failed ({} fetches): {}",
                self.fetch_failures,
                self.first_fetch_failure
                    .as_deref()
                    .unwrap_or("no reason kept")
            );
        }
        let decoded = self.stages[Stage::Decode as usize].2;
        if self.cache_hits > 0 && self.fetches_ok == 0 && decoded == 0 {
            return format!(
                "served from the decode-once cache: {} samples reused, nothing fetched or decoded",
                self.cache_hits
            );
        }
        let waiting = self.backpressure_share();
        if waiting > 0.5 {
            return format!(
                "trainer-bound: every rank's prefetch window was full {:.0}% of the time; the \
                 producers keep up (more workers would not help)",
                waiting * 100.0
            );
        }
        let idle = self.cpu_idle_share();
        let fetch_busy = self.stages[0].1.as_secs_f64();
        let blocked = self.fetch_blocked.as_secs_f64();
        if idle > 0.5 && blocked < fetch_busy * 0.1 {
            format!(
                "fetch-bound: CPU workers waited for images {:.0}% of the time; raise --fetch-concurrency (now {})",
                idle * 100.0,
                self.fetch_concurrency
            )
        } else if blocked > fetch_busy * 0.25 || idle < 0.1 {
            let (stage, busy, _) = self.stages[1..]
                .iter()
                .max_by_key(|(_, busy, _)| *busy)
                .copied()
                .expect("four CPU stages");
            format!(
                "CPU-bound: fetched images waited for a worker; {} takes the most time ({:.1} s); add cores or --workers (now {})",
                stage.name(),
                busy.as_secs_f64(),
                self.cpu_workers
            )
        } else {
            "balanced: neither fetching nor CPU work waits on the other for long".into()
        }
    }

    /// A table of the stages, for the end-of-run report.
    pub fn table(&self) -> String {
        let mut out = String::from("  stage              busy (s)   items   per item\n");
        for (stage, busy, items) in &self.stages {
            let per = if *items == 0 {
                0.0
            } else {
                busy.as_secs_f64() * 1e3 / *items as f64
            };
            out.push_str(&format!(
                "  {:<18} {:>8.2} {:>7}   {:>6.2} ms\n",
                stage.name(),
                busy.as_secs_f64(),
                items,
                per
            ));
        }
        out.push_str(&format!(
            "  startup {:.2} s (CPU workers connecting to the store and mapping it)\n",
            self.startup.as_secs_f64()
        ));
        out.push_str(&format!(
            "  CPU workers idle {:.0}% of the time; fetched records waited {:.2} s for a worker; {:.1} MB fetched\n",
            self.cpu_idle_share() * 100.0,
            self.fetch_blocked.as_secs_f64(),
            self.fetched_bytes as f64 / 1e6
        ));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn profile(cpu_idle_s: u64, fetch_blocked_s: u64, fetch_busy_s: u64) -> StageProfile {
        let p = Profiler::default();
        p.record(Stage::Fetch, Duration::from_secs(fetch_busy_s));
        p.record(Stage::Decode, Duration::from_secs(3));
        p.record(Stage::Resize, Duration::from_secs(5));
        p.cpu_idle(Duration::from_secs(cpu_idle_s));
        p.fetch_blocked(Duration::from_secs(fetch_blocked_s));
        p.started(Duration::from_secs(2));
        p.snapshot(Duration::from_secs(12), 2, 8)
    }

    #[test]
    fn verdict_names_the_bottleneck_and_the_knob() {
        let fetch_bound = profile(16, 0, 40).verdict();
        assert!(
            fetch_bound.starts_with("fetch-bound")
                && fetch_bound.contains("--fetch-concurrency (now 8)"),
            "{fetch_bound}"
        );
        let cpu_bound = profile(0, 30, 40).verdict();
        assert!(
            cpu_bound.starts_with("CPU-bound") && cpu_bound.contains("resize+normalize"),
            "{cpu_bound}"
        );
        assert!(profile(6, 2, 40).verdict().starts_with("balanced"));
    }

    #[test]
    fn verdict_says_when_the_trainers_or_the_cache_are_why() {
        let p = Profiler::default();
        p.record(Stage::Fetch, Duration::from_secs(4));
        p.record(Stage::Decode, Duration::from_secs(1));
        p.started(Duration::from_secs(2));
        p.backpressure(Duration::from_secs(7));
        let verdict = p.snapshot(Duration::from_secs(12), 2, 8).verdict();
        assert!(
            verdict.starts_with("trainer-bound") && verdict.contains("70%"),
            "{verdict}"
        );
        let cached = Profiler::default();
        cached.cache_hits(40);
        cached.cpu_idle(Duration::from_secs(9));
        let verdict = cached.snapshot(Duration::from_secs(5), 2, 8).verdict();
        assert!(
            verdict.contains("decode-once cache: 40 samples"),
            "{verdict}"
        );
    }

    #[test]
    fn stages_are_in_the_order_the_protocol_counts_them() {
        for (stage, name) in STAGES.iter().zip(feedstore_proto::frame::PRODUCER_STAGES) {
            assert!(stage.name().starts_with(name), "{stage:?} is not {name}");
        }
    }

    /// What the daemon sums and `feedstore top` reads back is the profile the producer had.
    #[test]
    fn figures_round_trip_through_a_profile() {
        let p = profile(16, 1, 40);
        let back = StageProfile::from_figures(&p.figures());
        assert_eq!(back.figures(), p.figures());
        assert_eq!(back.verdict(), p.verdict());
        assert_eq!(back.cpu_idle_share(), p.cpu_idle_share());
    }

    #[test]
    fn verdict_says_when_every_fetch_failed() {
        let p = Profiler::default();
        p.fetch_failed("s3://b/k from http://127.0.0.1:9: connection refused");
        p.fetch_failed("s3://b/j from http://127.0.0.1:9: connection refused");
        p.cpu_idle(Duration::from_secs(1));
        let verdict = p.snapshot(Duration::from_secs(2), 1, 8).verdict();
        assert_eq!(
            verdict,
            "every image fetch failed (2 fetches): s3://b/k from http://127.0.0.1:9: connection \
             refused"
        );
        p.fetched(100);
        assert!(
            !p.snapshot(Duration::from_secs(2), 1, 8)
                .verdict()
                .starts_with("fetch failed")
        );
    }
}
