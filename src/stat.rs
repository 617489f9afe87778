//! `feedstore stat`.

use anyhow::Context;
use feedstore_producer::profile::StageProfile;
use feedstore_proto::Role;
use feedstore_proto::StoreStats;
use feedstore_proto::frame::{PRODUCER_STAGES, ProducerFigures, StreamInfo};
use feedstore_store::config::format_bytes;

use crate::SocketArg;

/// Arguments of `feedstore stat`.
#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(flatten)]
    socket: SocketArg,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let socket = args.socket.path();
    let client = args.socket.inspect(Role::Reader, "feedstore-stat")?;
    let s = client.stats().context("reading statistics")?;
    let streams = client.streams().context("listing streams")?;
    let daemon = client.daemon();
    if args.json {
        let mut json = as_json(&s, &streams);
        json["daemon"] = serde_json::json!({
            "release": daemon.release, "protocol_min": daemon.min, "protocol_max": daemon.max,
            "features": daemon.features, "protocol": client.protocol(),
        });
        println!("{json}");
        return Ok(());
    }
    println!(
        "feedstored at {} (node {:08x}, epoch {:08x})",
        socket.display(),
        client.node_id(),
        client.epoch()
    );
    println!(
        "  release         {}; this connection speaks protocol {}",
        daemon.describe(),
        client.protocol()
    );
    print_store(&s);
    if streams.is_empty() {
        println!("  streams         none");
    }
    if s.attaches_waiting > 0 {
        println!(
            "  {} trainer(s) waiting for a stream no producer has created yet (is `feedstore produce --stream` running, with the same name, as the same user?)",
            s.attaches_waiting
        );
    }
    for t in &streams {
        print_stream(t);
    }
    Ok(())
}

/// Everything `stat` shows, as one JSON object (`--json`).
fn as_json(s: &StoreStats, streams: &[StreamInfo]) -> serde_json::Value {
    let mut object: serde_json::Map<String, serde_json::Value> = s
        .named()
        .into_iter()
        .map(|(name, value)| (name.to_owned(), value.into()))
        .collect();
    object.insert("free_bytes".into(), s.free_bytes().into());
    object.insert("fragmentation".into(), s.fragmentation().into());
    object.insert("huge_pages".into(), (s.huge_pages != 0).into());
    object.insert(
        "streams".into(),
        streams
            .iter()
            .map(|t| {
                serde_json::json!({
                    "id": t.id, "owner_uid": t.owner_uid, "name": t.name, "depth": t.depth,
                    "producers": t.producers,
                    "consumers": t.consumers, "ranks": t.ranks, "ready": t.ready,
                    "making": t.making, "put": t.put, "returned": t.returned,
                    "slowest": t.slowest, "fastest": t.fastest,
                    "cold_start_us": t.cold_start_us,
                    "ranks_attached": t.ranks_attached.iter().map(|r| serde_json::json!({
                        "rank": r.rank, "released": r.released, "ready": r.ready,
                        "waited_us": r.figures.waited_us, "taken": r.figures.taken,
                        "elapsed_us": r.figures.elapsed_us,
                        "first_sample_us": r.figures.first_sample_us,
                        "wait_ratio": r.figures.wait_ratio(),
                    })).collect::<Vec<_>>(),
                    "producer": producer_json(&t.producer),
                })
            })
            .collect(),
    );
    serde_json::Value::Object(object)
}

/// The store's lines: memory, objects, leases, clients, limits, the cache, the cluster.
fn print_store(s: &StoreStats) {
    let pct = |a: u64, b: u64| {
        if b == 0 {
            0.0
        } else {
            100.0 * a as f64 / b as f64
        }
    };
    println!(
        "  capacity        {} in {} segment(s), {}",
        format_bytes(s.capacity_bytes),
        s.segments,
        if s.huge_pages != 0 {
            "huge pages"
        } else {
            "4 KiB pages"
        }
    );
    println!(
        "  used            {} ({:.1}%)",
        format_bytes(s.used_bytes),
        pct(s.used_bytes, s.capacity_bytes)
    );
    println!(
        "  largest free    {} (fragmentation {:.1}%)",
        format_bytes(s.largest_free_bytes),
        100.0 * s.fragmentation()
    );
    println!(
        "  objects         {} sealed, {} being written, {} pinned, {} deleted awaiting release",
        s.objects_sealed, s.objects_writing, s.objects_pinned, s.objects_delete_pending
    );
    println!("  leases          {}", s.leases);
    println!("  clients         {} (this one included)", s.clients);
    println!(
        "  evictions       {} ({})",
        s.evictions,
        format_bytes(s.evicted_bytes)
    );
    println!(
        "  backpressure    {} creates waited, {} failed full",
        s.creates_waited, s.creates_full
    );
    println!(
        "  crash recovery  {} unsealed objects aborted, {} leases reclaimed; {} reconnects of clients whose daemon went away ({} connected now)",
        s.aborted_on_disconnect, s.leases_reclaimed, s.reconnects, s.reconnected_clients
    );
    println!(
        "  limits          {} refusals (connections, streams, rings, leases, queued requests, silent connections; {} gets over a reader's share), {} in rings, {} idle streams expired",
        s.limits_hit,
        s.lease_share_refusals,
        format_bytes(s.ring_bytes),
        s.streams_expired
    );
    println!(
        "  decode-once     {} lookups, {:.1}% hits, {} samples known",
        s.cache_lookups,
        100.0 * s.cache_hit_rate(),
        s.cache_entries
    );
    println!(
        "  cluster         {} peer(s) up, {} refused handshake(s), {} connection(s) dropped before proving the secret, {} record(s) failed their authentication; {} copies of other nodes' objects here",
        s.peers_up,
        s.peers_refused,
        s.peer_handshakes_dropped,
        s.peer_frames_rejected,
        s.objects_pulled
    );
    println!(
        "  pulls           {} done ({}), {} in flight; failed: {} unreachable, {} timed out, {} gone on the owner, {} corrupt, {} no room",
        s.pulls,
        format_bytes(s.pulled_bytes),
        s.pulls_in_flight,
        s.pull_failures_unreachable,
        s.pull_failures_timeout,
        s.pull_failures_missing,
        s.pull_failures_corrupt,
        s.pull_failures_full
    );
    println!(
        "  served to peers {} range(s), {}",
        s.served_reads,
        format_bytes(s.served_bytes)
    );
}

/// One stream's lines: its window, its producers' profile, its ranks.
fn print_stream(t: &StreamInfo) {
    println!(
        "  stream {:?} (uid {}): depth {}, {} producer connection(s), {} of {} rank(s) attached, {} ready, {} being made, {} put, {} returned, lag {} (slowest rank at {}), cold start {}",
        t.name,
        t.owner_uid,
        t.depth,
        t.producers,
        t.consumers,
        t.ranks,
        t.ready,
        t.making,
        t.put,
        t.returned,
        t.fastest - t.slowest,
        t.slowest,
        if t.cold_start_us == 0 {
            "pending".to_string()
        } else {
            format!("{:.2} s", t.cold_start_us as f64 / 1e6)
        }
    );
    if t.producer.elapsed_us > 0 {
        let p = StageProfile::from_figures(&t.producer);
        println!(
            "    producers (all reports so far): {} CPU worker(s) now; {}",
            t.producer.cpu_workers,
            p.verdict()
        );
        for line in p.table().lines() {
            println!("    {line}");
        }
    }
    if (t.consumers as usize) > t.ranks_attached.len() {
        println!(
            "    ({} more attached rank(s) not listed)",
            t.consumers as usize - t.ranks_attached.len()
        );
    }
    for r in &t.ranks_attached {
        let f = &r.figures;
        let rate = if f.elapsed_us == 0 {
            0.0
        } else {
            f.taken as f64 / (f.elapsed_us as f64 / 1e6)
        };
        println!(
            "    rank {}: at {}, {} ready; its trainer waited {:.1}% of {:.1} s, {} samples ({:.1}/s), first sample after {}",
            r.rank,
            r.released,
            r.ready,
            100.0 * f.wait_ratio(),
            f.elapsed_us as f64 / 1e6,
            f.taken,
            rate,
            if f.first_sample_us == 0 {
                "(none yet)".to_string()
            } else {
                format!("{:.3} s", f.first_sample_us as f64 / 1e6)
            }
        );
    }
}

/// The producers' figures as `feedstore stat --json` prints them, with their verdict.
fn producer_json(f: &ProducerFigures) -> serde_json::Value {
    let per_stage = |values: &[u64; 5]| {
        PRODUCER_STAGES
            .iter()
            .zip(values)
            .map(|(stage, v)| ((*stage).to_owned(), serde_json::Value::from(*v)))
            .collect::<serde_json::Map<_, _>>()
    };
    serde_json::json!({
        "elapsed_us": f.elapsed_us, "startup_us": f.startup_us, "worker_us": f.worker_us,
        "stage_busy_us": per_stage(&f.stage_busy_us), "stage_items": per_stage(&f.stage_items),
        "cpu_idle_us": f.cpu_idle_us, "fetch_blocked_us": f.fetch_blocked_us,
        "backpressure_us": f.backpressure_us, "fetched_bytes": f.fetched_bytes,
        "fetches_ok": f.fetches_ok, "fetch_failures": f.fetch_failures,
        "cache_hits": f.cache_hits, "cpu_workers": f.cpu_workers,
        "fetch_concurrency": f.fetch_concurrency, "fetch_in_flight": f.fetch_in_flight,
        "verdict": (f.elapsed_us > 0).then(|| StageProfile::from_figures(f).verdict()),
    })
}
