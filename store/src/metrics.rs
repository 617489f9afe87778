//! Prometheus metrics: `feedstored --metrics-addr 127.0.0.1:9464` serves `GET /metrics` in the
//! Prometheus text format (0.0.4), encoded by `prometheus-client`.
//!
//! Each scrape takes one snapshot under the daemon's locks (the store's counters, every stream,
//! every attached rank's figures as its consumer last reported them, plus the waits seen since
//! and, unless it has read its whole share, the time since as run time)
//! and encodes it on a blocking thread, off the runtime that serves clients; nothing is kept
//! between scrapes. Names follow Prometheus conventions: a `feedstore_` prefix, base units
//! (`_bytes`, `_seconds`), `_total` on counters. Per stream the labels are `stream` and `uid`;
//! per rank, `stream`, `uid` and `rank`.
//!
//! The wait-time ratio of a rank over a window is
//! `rate(feedstore_rank_wait_seconds_total[1m]) / rate(feedstore_rank_run_seconds_total[1m])`;
//! `feedstore_rank_wait_ratio` is the same since its consumer's first request.
//!
//! A stream's producers on this node report their stage profile (`feedstore_producer_*`, summed
//! over the producers, labelled `stream`, `uid` and, per stage, `stage`); the verdict's inputs
//! over a window: CPU workers idle (fetch-bound) is
//! `rate(feedstore_producer_cpu_idle_seconds_total[5m]) / rate(feedstore_producer_worker_seconds_total[5m])`,
//! producers held back by full windows (trainer-bound) is
//! `rate(feedstore_producer_backpressure_seconds_total[5m]) / rate(feedstore_producer_run_seconds_total[5m])`.
//!
//! The server is small on purpose: one request per connection (`Connection: close`), a request
//! head of at most 8 KiB read within 2 s, at most 16 connections at once (more get `503` at
//! once), `GET /metrics` only.

use std::sync::Arc;
use std::time::Duration;

use feedstore_proto::StoreStats;
use feedstore_proto::frame::{PRODUCER_STAGES, ProducerFigures, StreamInfo};
use prometheus_client::encoding::prometheus_text;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::server::Shared;

/// The store counters that only grow (since the daemon started); every other one is a gauge.
const COUNTERS: [&str; 23] = [
    "evictions",
    "evicted_bytes",
    "creates_waited",
    "creates_full",
    "aborted_on_disconnect",
    "leases_reclaimed",
    "cache_lookups",
    "cache_hits",
    "limits_hit",
    "streams_expired",
    "pulls",
    "pulled_bytes",
    "pull_failures_unreachable",
    "pull_failures_timeout",
    "pull_failures_missing",
    "pull_failures_corrupt",
    "pull_failures_full",
    "peers_refused",
    "served_reads",
    "served_bytes",
    "lease_share_refusals",
    "peer_frames_rejected",
    "peer_handshakes_dropped",
];

const MAX_CONNECTIONS: usize = 16;
const MAX_REQUEST_BYTES: usize = 8 << 10;
const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);

/// Serves scrapes until the task is aborted.
pub async fn serve(listener: TcpListener, shared: Arc<Shared>) {
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    loop {
        let (mut stream, _) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                tracing::warn!(error = %e, "metrics accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            // Over the bound: told so at once (within the timeout), and closed.
            tokio::spawn(async move {
                let busy = respond(
                    &mut stream,
                    "503 Service Unavailable",
                    "text/plain",
                    "busy\n",
                );
                let _ = tokio::time::timeout(REQUEST_TIMEOUT, busy).await;
            });
            continue;
        };
        let shared = shared.clone();
        tokio::spawn(async move {
            let _slot = slot;
            if let Err(e) = tokio::time::timeout(REQUEST_TIMEOUT, answer(stream, shared)).await {
                tracing::debug!(error = %e, "metrics request timed out");
            }
        });
    }
}

/// Reads one request head and answers it.
async fn answer(mut stream: TcpStream, shared: Arc<Shared>) {
    let mut head = Vec::with_capacity(1024);
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        match stream.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => head.extend_from_slice(&buf[..n]),
        }
        if head.len() > MAX_REQUEST_BYTES {
            respond(&mut stream, "431 Request Header Fields Too Large", "", "").await;
            return;
        }
    }
    let line = head.split(|&b| b == b'\r').next().unwrap_or_default();
    let mut words = line.split(|&b| b == b' ');
    let (method, path) = (
        words.next().unwrap_or_default(),
        words.next().unwrap_or_default(),
    );
    let path = path.split(|&b| b == b'?').next().unwrap_or_default();
    match (method, path) {
        (b"GET", b"/metrics") => {
            // The snapshot takes the daemon's locks and the encoding grows with the streams:
            // both off the runtime thread that answers clients.
            let body = tokio::task::spawn_blocking(move || {
                let (stats, streams) = shared.snapshot();
                encode(&stats, &streams)
            })
            .await;
            match body {
                Ok(body) => {
                    respond(&mut stream, "200 OK", prometheus_text::CONTENT_TYPE, &body).await;
                }
                Err(_) => {
                    respond(&mut stream, "500 Internal Server Error", "text/plain", "").await;
                }
            }
        }
        (b"GET", _) => {
            respond(&mut stream, "404 Not Found", "text/plain", "see /metrics\n").await;
        }
        _ => {
            respond(
                &mut stream,
                "405 Method Not Allowed",
                "text/plain",
                "GET only\n",
            )
            .await
        }
    }
}

async fn respond(stream: &mut TcpStream, status: &str, content_type: &str, body: &str) {
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    let _ = stream.write_all(head.as_bytes()).await;
    let _ = stream.write_all(body.as_bytes()).await;
    let _ = stream.shutdown().await;
}

type Labels = Vec<(&'static str, String)>;

/// A per-stream metric: its name, its help, and how to read it off a stream.
type StreamFigure = (&'static str, &'static str, fn(&StreamInfo) -> u64);

/// A gauge family of floats.
type Floats = Family<Labels, Gauge<f64, std::sync::atomic::AtomicU64>>;
/// A counter family of floats (seconds).
type FloatCounters = Family<Labels, Counter<f64, std::sync::atomic::AtomicU64>>;
/// A counter family of whole numbers.
type Counts = Family<Labels, Counter>;
/// A gauge family of whole numbers.
type Levels = Family<Labels, Gauge>;

/// The snapshot in the Prometheus text format.
pub fn encode(stats: &StoreStats, streams: &[StreamInfo]) -> String {
    let mut registry = Registry::with_prefix("feedstore");
    for (name, help, value) in stats.described() {
        // prometheus-client ends the help with a period of its own.
        let help = help.split_whitespace().collect::<Vec<_>>().join(" ");
        let help = help.trim_end_matches('.');
        if COUNTERS.contains(&name) {
            let counter: Counter = Counter::default();
            counter.inc_by(value);
            registry.register(name, help, counter);
        } else {
            let gauge: Gauge = Gauge::default();
            gauge.set(i64::try_from(value).unwrap_or(i64::MAX));
            registry.register(name, help, gauge);
        }
    }

    let stream_levels: [StreamFigure; 7] = [
        (
            "stream_ready_samples",
            "Samples made and not yet returned, over the stream's ranks on this node",
            |t| t.ready,
        ),
        ("stream_making_samples", "Samples at producers", |t| {
            t.making
        }),
        (
            "stream_lag_samples",
            "How far the slowest rank trails the fastest, in samples",
            |t| t.fastest - t.slowest,
        ),
        ("stream_producers", "Producer connections joined", |t| {
            u64::from(t.producers)
        }),
        ("stream_consumers", "Ranks with a consumer attached", |t| {
            u64::from(t.consumers)
        }),
        ("stream_depth_samples", "Prefetch depth per rank", |t| {
            u64::from(t.depth)
        }),
        ("stream_ranks", "Ranks known on this node", |t| {
            u64::from(t.ranks)
        }),
    ];
    for (name, help, value) in stream_levels {
        let family = Levels::default();
        for t in streams {
            family
                .get_or_create(&stream_labels(t))
                .set(i64::try_from(value(t)).unwrap_or(i64::MAX));
        }
        registry.register(name, help, family);
    }
    let stream_counts: [StreamFigure; 2] = [
        ("stream_put_samples", "Samples put by producers", |t| t.put),
        (
            "stream_returned_samples",
            "Samples returned by consumers",
            |t| t.returned,
        ),
    ];
    for (name, help, value) in stream_counts {
        let family = Counts::default();
        for t in streams {
            family.get_or_create(&stream_labels(t)).inc_by(value(t));
        }
        registry.register(name, help, family);
    }
    let cold = Floats::default();
    for t in streams.iter().filter(|t| t.cold_start_us > 0) {
        cold.get_or_create(&stream_labels(t))
            .set(t.cold_start_us as f64 / 1e6);
    }
    registry.register(
        "stream_cold_start_seconds",
        "From the stream's creation to its first sample put",
        cold,
    );

    let ranks = || {
        streams.iter().flat_map(|t| {
            t.ranks_attached.iter().map(move |r| {
                let mut labels = stream_labels(t);
                labels.push(("rank", r.rank.to_string()));
                (labels, r)
            })
        })
    };
    let seconds = |us: u64| us as f64 / 1e6;
    let waited = FloatCounters::default();
    let run = FloatCounters::default();
    let taken = Counts::default();
    let ratio = Floats::default();
    let first = Floats::default();
    let released = Levels::default();
    let ready = Levels::default();
    for (labels, r) in ranks() {
        let f = &r.figures;
        waited.get_or_create(&labels).inc_by(seconds(f.waited_us));
        run.get_or_create(&labels).inc_by(seconds(f.elapsed_us));
        taken.get_or_create(&labels).inc_by(f.taken);
        ratio.get_or_create(&labels).set(f.wait_ratio());
        if f.first_sample_us > 0 {
            first.get_or_create(&labels).set(seconds(f.first_sample_us));
        }
        released
            .get_or_create(&labels)
            .set(i64::try_from(r.released).unwrap_or(i64::MAX));
        ready.get_or_create(&labels).set(i64::from(r.ready));
    }
    registry.register(
        "rank_wait_seconds",
        "Time the rank's consumer spent waiting for samples not yet made, as it reports it (since its first request), plus a wait under way",
        waited,
    );
    registry.register(
        "rank_run_seconds",
        "Time since the rank's consumer first asked for a sample, as it reports it plus the time since (up to the end of its share): waiting plus the trainer's own work",
        run,
    );
    registry.register(
        "rank_taken_samples",
        "Samples the rank's trainer took",
        taken,
    );
    registry.register(
        "rank_wait_ratio",
        "The share of its time the rank's consumer waited for data, since its first request (the seed's wait-time ratio)",
        ratio,
    );
    registry.register(
        "rank_first_sample_seconds",
        "From opening the stream to the rank's first sample",
        first,
    );
    registry.register(
        "rank_released_samples",
        "The rank's position: the first sequence number its consumer has not returned",
        released,
    );
    registry.register(
        "rank_ready_samples",
        "Samples made and waiting in the rank's window",
        ready,
    );
    register_producers(&mut registry, streams);
    let mut out = String::new();
    prometheus_text::encode(&mut out, &registry).expect("writing to a String");
    out
}

/// A producer figure: its name, its help, and how to read it off the producers' sum.
type ProducerFigure = (&'static str, &'static str, fn(&ProducerFigures) -> u64);

/// The producers' stage profiles, per stream (those whose producers reported).
fn register_producers(registry: &mut Registry, streams: &[StreamInfo]) {
    let reported = || streams.iter().filter(|t| t.producer.elapsed_us > 0);
    let times: [ProducerFigure; 6] = [
        (
            "producer_run_seconds",
            "Time since each producer started, summed over the stream's producers",
            |f| f.elapsed_us,
        ),
        (
            "producer_startup_seconds",
            "Time before the producers' CPU workers could start (connecting, mapping the store, joining)",
            |f| f.startup_us,
        ),
        (
            "producer_worker_seconds",
            "The CPU workers' time since they started (workers times their running time)",
            |f| f.worker_us,
        ),
        (
            "producer_cpu_idle_seconds",
            "Time CPU workers waited for fetched input (high: fetch-bound)",
            |f| f.cpu_idle_us,
        ),
        (
            "producer_fetch_blocked_seconds",
            "Time fetched records waited for a CPU worker (high: CPU-bound)",
            |f| f.fetch_blocked_us,
        ),
        (
            "producer_backpressure_seconds",
            "Time producers waited for work while every rank's prefetch window was full (high: trainer-bound)",
            |f| f.backpressure_us,
        ),
    ];
    for (name, help, value) in times {
        let family = FloatCounters::default();
        for t in reported() {
            family
                .get_or_create(&stream_labels(t))
                .inc_by(value(&t.producer) as f64 / 1e6);
        }
        registry.register(name, help, family);
    }
    let counts: [ProducerFigure; 4] = [
        ("producer_fetched_bytes", "Image bytes fetched", |f| {
            f.fetched_bytes
        }),
        ("producer_fetches", "Image fetches that succeeded", |f| {
            f.fetches_ok
        }),
        (
            "producer_fetch_failures",
            "Image fetches that failed",
            |f| f.fetch_failures,
        ),
        (
            "producer_cache_hit_samples",
            "Samples served from the decode-once cache instead of being made",
            |f| f.cache_hits,
        ),
    ];
    for (name, help, value) in counts {
        let family = Counts::default();
        for t in reported() {
            family
                .get_or_create(&stream_labels(t))
                .inc_by(value(&t.producer));
        }
        registry.register(name, help, family);
    }
    let levels: [ProducerFigure; 3] = [
        (
            "producer_cpu_workers",
            "CPU workers of the stream's producers joined now",
            |f| f.cpu_workers,
        ),
        (
            "producer_fetch_concurrency",
            "Most fetches in flight, over the producers joined now",
            |f| f.fetch_concurrency,
        ),
        ("producer_fetches_in_flight", "Fetches in flight now", |f| {
            f.fetch_in_flight
        }),
    ];
    for (name, help, value) in levels {
        let family = Levels::default();
        for t in reported() {
            family
                .get_or_create(&stream_labels(t))
                .set(i64::try_from(value(&t.producer)).unwrap_or(i64::MAX));
        }
        registry.register(name, help, family);
    }
    let busy = FloatCounters::default();
    let items = Counts::default();
    for t in reported() {
        for (i, stage) in PRODUCER_STAGES.iter().enumerate() {
            let mut labels = stream_labels(t);
            labels.push(("stage", (*stage).to_owned()));
            busy.get_or_create(&labels)
                .inc_by(t.producer.stage_busy_us[i] as f64 / 1e6);
            items
                .get_or_create(&labels)
                .inc_by(t.producer.stage_items[i]);
        }
    }
    registry.register(
        "producer_stage_busy_seconds",
        "Busy time per pipeline stage, summed over concurrent tasks",
        busy,
    );
    registry.register(
        "producer_stage_items",
        "Items through each pipeline stage",
        items,
    );
}

fn stream_labels(t: &StreamInfo) -> Labels {
    vec![("stream", t.name.clone()), ("uid", t.owner_uid.to_string())]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_counter_named_here_is_a_store_statistic() {
        let names: Vec<&str> = StoreStats::default()
            .named()
            .iter()
            .map(|(n, _)| *n)
            .collect();
        for counter in COUNTERS {
            assert!(names.contains(&counter), "{counter}");
        }
    }
}
