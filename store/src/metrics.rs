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
//! The HTTP/1.1 server is hyper's, bounded: one request per connection (no keep-alive), a request
//! head of at most 8 KiB (more gets `431`), the whole exchange within 2 s, at most 16 connections
//! at once (more get `503` at once, without waiting for their request: 64 such answers at a
//! time, each within 0.2 s, and beyond those the connection is closed), `GET /metrics` only.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::header::CONTENT_TYPE;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;

use feedstore_proto::StoreStats;
use feedstore_proto::frame::{PRODUCER_STAGES, ProducerFigures, RankInfo, StreamInfo};
use prometheus_client::encoding::prometheus_text;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::{Metric, Registry};
use tokio::net::TcpListener;

use crate::cluster::Cluster;
use crate::state::{Shared, Started};

/// The store counters that only grow (since the daemon started); every other one is a gauge.
const COUNTERS: [&str; 24] = [
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
    "reconnects",
];

const MAX_CONNECTIONS: usize = 16;
/// hyper's least read buffer; a request head that does not fit gets `431`.
const MAX_REQUEST_BYTES: usize = 8 << 10;
/// The whole exchange, from accepting to the last byte of the answer.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);

/// Connections over [`MAX_CONNECTIONS`] being told `503` at once; more are closed unanswered.
const MAX_BUSY: usize = 64;
/// The longest a `503` takes, its request read and dropped.
const BUSY_LINGER: Duration = Duration::from_millis(200);

/// Answers `503` without reading the request, then reads what the client sent (at most a
/// request head's worth) and drops it, until it stops sending.
async fn answer_busy(mut stream: tokio::net::TcpStream) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    if stream.write_all(BUSY).await.is_err() || stream.shutdown().await.is_err() {
        return;
    }
    let mut sink = [0u8; 1024];
    let mut left = MAX_REQUEST_BYTES;
    while left > 0 {
        match stream.read(&mut sink).await {
            Ok(0) | Err(_) => return,
            Ok(n) => left = left.saturating_sub(n),
        }
    }
}

/// The whole answer to a connection over [`MAX_CONNECTIONS`].
const BUSY: &[u8] =
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\nContent-Length: 5\r\nConnection: close\r\n\r\nbusy\n";

/// Serves scrapes until the task is aborted.
pub async fn serve(listener: TcpListener, shared: Arc<Shared>, cluster: Option<Arc<Cluster>>) {
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    let busy_slots = Arc::new(tokio::sync::Semaphore::new(MAX_BUSY));
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                tracing::warn!(error = %e, "metrics accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            // Over the bound: told so at once and closed, holding a small task for at most
            // BUSY_LINGER (what the client sent is read and dropped, so the close is not a
            // reset that loses the answer); past MAX_BUSY of those, closed at once.
            if let Ok(busy) = busy_slots.clone().try_acquire_owned() {
                tokio::spawn(async move {
                    let _busy = busy;
                    let _ = tokio::time::timeout(BUSY_LINGER, answer_busy(stream)).await;
                });
            }
            continue;
        };
        let (shared, cluster) = (shared.clone(), cluster.clone());
        tokio::spawn(async move {
            let service = service_fn(move |request| {
                let (shared, cluster) = (shared.clone(), cluster.clone());
                async move { Ok::<_, Infallible>(answer(&request, shared, cluster).await) }
            });
            // The whole exchange is bounded by REQUEST_TIMEOUT below; hyper's own header
            // timeout needs a timer this server does not give it.
            let connection = http1::Builder::new()
                .keep_alive(false)
                .header_read_timeout(None)
                .max_buf_size(MAX_REQUEST_BYTES)
                .serve_connection(TokioIo::new(stream), service);
            match tokio::time::timeout(REQUEST_TIMEOUT, connection).await {
                Ok(Err(e)) => tracing::debug!(error = %e, "metrics request failed"),
                Err(_) => tracing::debug!("metrics request timed out"),
                Ok(Ok(())) => {}
            }
            drop(slot);
        });
    }
}

/// The answer to one request: `GET /metrics` (any query) is the scrape, anything else an error.
async fn answer<B>(
    request: &Request<B>,
    shared: Arc<Shared>,
    cluster: Option<Arc<Cluster>>,
) -> Response<Full<Bytes>> {
    if request.method() != Method::GET {
        return reply(StatusCode::METHOD_NOT_ALLOWED, "GET only\n");
    }
    if request.uri().path() != "/metrics" {
        return reply(StatusCode::NOT_FOUND, "see /metrics\n");
    }
    // The snapshot takes the daemon's locks and the encoding grows with the streams: both off
    // the runtime thread that answers clients.
    let body = tokio::task::spawn_blocking(move || {
        let (mut stats, streams) = shared.snapshot();
        if let Some(cluster) = &cluster {
            cluster.add_stats(&mut stats);
        }
        encode(&stats, &streams, shared.started, shared.started_at)
    })
    .await;
    match body {
        Ok(body) => Response::builder()
            .header(CONTENT_TYPE, prometheus_text::CONTENT_TYPE)
            .body(Full::new(Bytes::from(body)))
            .expect("a static header"),
        Err(_) => reply(StatusCode::INTERNAL_SERVER_ERROR, ""),
    }
}

fn reply(status: StatusCode, text: &'static str) -> Response<Full<Bytes>> {
    Response::builder()
        .status(status)
        .header(CONTENT_TYPE, "text/plain")
        .body(Full::new(Bytes::from_static(text.as_bytes())))
        .expect("a static header")
}

type Labels = Vec<(&'static str, String)>;

/// A metric read off one labelled item (a stream, a rank, a stream's producers): its name, its
/// help, and how to read it.
type Figure<T> = (&'static str, &'static str, fn(&T) -> u64);

/// The snapshot in the Prometheus text format.
pub fn encode(
    stats: &StoreStats,
    streams: &[StreamInfo],
    started: Started,
    started_at: u64,
) -> String {
    let mut registry = Registry::with_prefix("feedstore");
    register_build(&mut registry);
    register_start(&mut registry, started, started_at);
    register_store(&mut registry, stats);
    register_streams(&mut registry, streams);
    register_ranks(&mut registry, streams);
    register_producers(&mut registry, streams);
    let mut out = String::new();
    prometheus_text::encode(&mut out, &registry).expect("writing to a String");
    out
}

/// `feedstore_build_info`, always 1: the daemon's release and the protocols it speaks, as
/// labels (`version`; `protocol_min` and `protocol`, the oldest and newest control protocols it
/// serves; `peer_protocol`), to join on or alert on a skewed fleet.
fn register_build(registry: &mut Registry) {
    let build = Family::<Labels, Gauge>::default();
    let labels = vec![
        ("version", env!("CARGO_PKG_VERSION").to_string()),
        (
            "protocol_min",
            feedstore_proto::frame::MIN_VERSION.to_string(),
        ),
        ("protocol", feedstore_proto::frame::VERSION.to_string()),
        (
            "peer_protocol",
            feedstore_proto::peer::PEER_VERSION.to_string(),
        ),
    ];
    build.get_or_create(&labels).set(1);
    registry.register(
        "build_info",
        "The daemon's release and the protocol versions it speaks (always 1)",
        build,
    );
}

/// `feedstore_daemon_start_time_seconds`: when this daemon started (Unix time), labelled with
/// how it came by its store (`how`: `fresh`, `takeover` from a running daemon, or `restored`
/// after a crash from what systemd kept). The daemons of a node replace one another: each
/// start is a new value, so `changes(...)` over a window, by `how`, counts takeovers and
/// restarts.
fn register_start(registry: &mut Registry, started: Started, at: u64) {
    let start = Family::<Labels, Gauge>::default();
    start
        .get_or_create(&vec![("how", started.as_str().to_string())])
        .set(saturating(at));
    registry.register(
        "daemon_start_time_seconds",
        "When this daemon started (Unix time), by how it came by its store: fresh, takeover or restored",
        start,
    );
}

/// The store's own figures: counters where they only grow, gauges otherwise.
fn register_store(registry: &mut Registry, stats: &StoreStats) {
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
            gauge.set(saturating(value));
            registry.register(name, help, gauge);
        }
    }
}

const STREAM_LEVELS: [Figure<StreamInfo>; 7] = [
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

const STREAM_COUNTS: [Figure<StreamInfo>; 2] = [
    ("stream_put_samples", "Samples put by producers", |t| t.put),
    (
        "stream_returned_samples",
        "Samples returned by consumers",
        |t| t.returned,
    ),
];

const STREAM_SECONDS: [Figure<StreamInfo>; 1] = [(
    "stream_cold_start_seconds",
    "From the stream's creation to its first sample put",
    |t| t.cold_start_us,
)];

/// Per stream, labelled `stream` and `uid`.
fn register_streams(registry: &mut Registry, streams: &[StreamInfo]) {
    let labelled = || streams.iter().map(|t| (stream_labels(t), t));
    register_family(registry, labelled, &STREAM_LEVELS, set_level);
    register_family(registry, labelled, &STREAM_COUNTS, add_count);
    // A stream that has not put its first sample has no cold start yet.
    let started = || labelled().filter(|(_, t)| t.cold_start_us > 0);
    register_family(registry, started, &STREAM_SECONDS, set_seconds);
}

const RANK_SECONDS: [Figure<RankInfo>; 2] = [
    (
        "rank_wait_seconds",
        "Time the rank's consumer spent waiting for samples not yet made, as it reports it (since its first request), plus a wait under way",
        |r| r.figures.waited_us,
    ),
    (
        "rank_run_seconds",
        "Time since the rank's consumer first asked for a sample, as it reports it plus the time since (up to the end of its share): waiting plus the trainer's own work",
        |r| r.figures.elapsed_us,
    ),
];

const RANK_COUNTS: [Figure<RankInfo>; 1] = [(
    "rank_taken_samples",
    "Samples the rank's trainer took",
    |r| r.figures.taken,
)];

const RANK_LEVELS: [Figure<RankInfo>; 2] = [
    (
        "rank_released_samples",
        "The rank's position: the first sequence number its consumer has not returned",
        |r| r.released,
    ),
    (
        "rank_ready_samples",
        "Samples made and waiting in the rank's window",
        |r| u64::from(r.ready),
    ),
];

const RANK_FIRST_SAMPLE: [Figure<RankInfo>; 1] = [(
    "rank_first_sample_seconds",
    "From opening the stream to the rank's first sample",
    |r| r.figures.first_sample_us,
)];

/// Per attached rank, labelled `stream`, `uid` and `rank`.
fn register_ranks(registry: &mut Registry, streams: &[StreamInfo]) {
    let labelled = || {
        streams.iter().flat_map(|t| {
            t.ranks_attached.iter().map(move |r| {
                let mut labels = stream_labels(t);
                labels.push(("rank", r.rank.to_string()));
                (labels, r)
            })
        })
    };
    register_family(registry, labelled, &RANK_SECONDS, add_seconds);
    register_family(registry, labelled, &RANK_COUNTS, add_count);
    register_family(registry, labelled, &RANK_LEVELS, set_level);
    let ratio = Floats::default();
    for (labels, r) in labelled() {
        ratio.get_or_create(&labels).set(r.figures.wait_ratio());
    }
    registry.register(
        "rank_wait_ratio",
        "The share of its time the rank's consumer waited for data, since its first request (the seed's wait-time ratio)",
        ratio,
    );
    // A rank that has had no sample yet has no first-sample time.
    let served = || labelled().filter(|(_, r)| r.figures.first_sample_us > 0);
    register_family(registry, served, &RANK_FIRST_SAMPLE, set_seconds);
}

const PRODUCER_SECONDS: [Figure<ProducerFigures>; 6] = [
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

const PRODUCER_COUNTS: [Figure<ProducerFigures>; 4] = [
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

const PRODUCER_LEVELS: [Figure<ProducerFigures>; 3] = [
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

/// The producers' stage profiles, per stream (those whose producers reported), summed over the
/// stream's producers on this node.
fn register_producers(registry: &mut Registry, streams: &[StreamInfo]) {
    let labelled = || {
        streams
            .iter()
            .filter(|t| t.producer.elapsed_us > 0)
            .map(|t| (stream_labels(t), &t.producer))
    };
    register_family(registry, labelled, &PRODUCER_SECONDS, add_seconds);
    register_family(registry, labelled, &PRODUCER_COUNTS, add_count);
    register_family(registry, labelled, &PRODUCER_LEVELS, set_level);
    let busy = FloatCounters::default();
    let items = Counts::default();
    for (labels, producer) in labelled() {
        for (i, stage) in PRODUCER_STAGES.iter().enumerate() {
            let mut labels = labels.clone();
            labels.push(("stage", (*stage).to_owned()));
            busy.get_or_create(&labels)
                .inc_by(seconds(producer.stage_busy_us[i]));
            items.get_or_create(&labels).inc_by(producer.stage_items[i]);
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

/// One family per figure, each item's value read off it and recorded by `record` into the
/// item's metric of kind `M` (a counter or a gauge, of whole numbers or of seconds).
fn register_family<'a, T: 'a, I, M>(
    registry: &mut Registry,
    items: impl Fn() -> I,
    figures: &[Figure<T>],
    record: fn(&M, u64),
) where
    I: Iterator<Item = (Labels, &'a T)>,
    M: Default,
    Family<Labels, M>: Metric,
{
    for (name, help, value) in figures {
        let family = Family::<Labels, M>::default();
        for (labels, item) in items() {
            record(&family.get_or_create(&labels), value(item));
        }
        registry.register(*name, *help, family);
    }
}

/// A gauge of whole numbers set to `v`.
fn set_level(g: &Gauge, v: u64) {
    g.set(saturating(v));
}

/// A counter of whole numbers raised by `v`.
fn add_count(c: &Counter, v: u64) {
    c.inc_by(v);
}

/// A counter of seconds raised by `v` microseconds.
fn add_seconds(c: &FloatCounter, v: u64) {
    c.inc_by(seconds(v));
}

/// A gauge of seconds (a duration measured once) set to `v` microseconds.
fn set_seconds(g: &FloatGauge, v: u64) {
    g.set(seconds(v));
}

/// A gauge of seconds.
type FloatGauge = Gauge<f64, std::sync::atomic::AtomicU64>;
/// A counter of seconds.
type FloatCounter = Counter<f64, std::sync::atomic::AtomicU64>;

/// A gauge family of floats.
type Floats = Family<Labels, FloatGauge>;
/// A counter family of floats (seconds).
type FloatCounters = Family<Labels, FloatCounter>;
/// A counter family of whole numbers.
type Counts = Family<Labels, Counter>;

fn seconds(us: u64) -> f64 {
    us as f64 / 1e6
}

fn saturating(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
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
