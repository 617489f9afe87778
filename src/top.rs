//! `feedstore top`: the seed's figure, live. Refreshes a view of every stream and attached rank:
//! the wait-time ratio between the reports seen at the last two views (and since the rank's
//! first request),
//! samples/s, the lag between ranks, the producers' stage profile over the interval, and a verdict
//! on where the time goes.

use std::collections::HashMap;
use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

use anyhow::Context;
use feedstore_consumer::Client;
use feedstore_producer::profile::StageProfile;
use feedstore_proto::Role;
use feedstore_proto::frame::{ProducerFigures, RankFigures, StreamInfo};
use feedstore_store::config::format_bytes;

use crate::SocketArg;

/// Arguments of `feedstore top`.
#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(flatten)]
    socket: SocketArg,
    /// Seconds between refreshes.
    #[arg(long, value_name = "SECONDS", default_value_t = 2.0)]
    interval: f64,
    /// Print this many views and stop [default: until Ctrl-C].
    #[arg(long, value_name = "N")]
    count: Option<u64>,
}

/// A rank's trainer waiting more than this share of its time is waiting for data.
const DATA_BOUND: f64 = 0.10;

pub fn run(args: Args) -> anyhow::Result<()> {
    if !(args.interval >= 0.1 && args.interval.is_finite() && args.interval <= 3600.0) {
        anyhow::bail!("--interval must be between 0.1 and 3600 seconds");
    }
    if args.count == Some(0) {
        anyhow::bail!("--count must be at least 1");
    }
    let socket = args.socket.path();
    let client = args.socket.inspect(Role::Reader, "feedstore-top")?;
    let terminal = std::io::stdout().is_terminal();
    let mut previous = Previous::default();
    let mut shown = 0u64;
    loop {
        let started = Instant::now();
        let view = render(&client, &socket.display().to_string(), &mut previous)?;
        let mut out = std::io::stdout().lock();
        if terminal {
            // Home and clear, then the view: one write, so the screen never shows half of it.
            write!(out, "\x1b[H\x1b[2J{view}")?;
        } else {
            writeln!(out, "{view}")?;
        }
        out.flush()?;
        drop(out);
        shown += 1;
        if args.count.is_some_and(|n| shown >= n) {
            return Ok(());
        }
        std::thread::sleep(
            Duration::from_secs_f64(args.interval).saturating_sub(started.elapsed()),
        );
    }
}

/// What the last view read, for the figures over the interval.
#[derive(Debug, Default)]
struct Previous {
    /// Each rank's figures and its window, by stream and rank.
    ranks: HashMap<(u32, u32), (RankFigures, Window)>,
    /// Each stream's producer figures and what grew over the last interval that saw a report.
    producers: HashMap<u32, (ProducerFigures, ProducerFigures)>,
}

/// One view; `previous` holds what the last view read.
fn render(client: &Client, socket: &str, previous: &mut Previous) -> anyhow::Result<String> {
    use std::fmt::Write;
    let s = client.stats().context("reading statistics")?;
    let streams = client.streams().context("listing streams")?;
    let mut v = String::new();
    writeln!(
        v,
        "feedstored at {socket}: {} of {} used, {} objects, {} clients, {} evictions, {} stream(s)",
        format_bytes(s.used_bytes),
        format_bytes(s.capacity_bytes),
        s.objects_sealed,
        s.clients,
        s.evictions,
        streams.len()
    )?;
    if s.attaches_waiting > 0 {
        writeln!(
            v,
            "{} trainer(s) waiting for a stream no producer has created yet (is `feedstore produce --stream` running, with the same name, as the same user?)",
            s.attaches_waiting
        )?;
    }
    let mut seen = Previous::default();
    for t in &streams {
        writeln!(v)?;
        writeln!(
            v,
            "stream {:?} (uid {}): {} producer connection(s), {} of {} rank(s) attached, depth {}, {} ready, {} being made, lag {}",
            t.name,
            t.owner_uid,
            t.producers,
            t.consumers,
            t.ranks,
            t.depth,
            t.ready,
            t.making,
            t.fastest - t.slowest
        )?;
        let producers = (t.producer.elapsed_us > 0).then(|| {
            let grown = match previous.producers.get(&t.id) {
                Some((before, _)) if t.producer.elapsed_us > before.elapsed_us => {
                    t.producer.since(before)
                }
                // No report since the last view (a producer leaving changes only the gauges):
                // the last interval stands.
                Some((_, grown)) => *grown,
                None => t.producer,
            };
            seen.producers.insert(t.id, (t.producer, grown));
            StageProfile::from_figures(&grown)
        });
        if let Some(p) = &producers {
            writeln!(
                v,
                "  producers: {} CPU worker(s), {} fetch(es) in flight, {} from the cache; {}",
                t.producer.cpu_workers,
                t.producer.fetch_in_flight,
                t.producer.cache_hits,
                p.verdict()
            )?;
        }
        if t.ranks_attached.is_empty() {
            writeln!(v, "  no trainer attached")?;
            continue;
        }
        writeln!(
            v,
            "  {:>6} {:>10} {:>10} {:>10} {:>9} {:>8} {:>12}",
            "rank", "wait now", "wait all", "samples/s", "taken", "ready", "first sample"
        )?;
        let mut waits = Vec::new();
        for r in &t.ranks_attached {
            let f = r.figures;
            let now = match previous.ranks.get(&(t.id, r.rank)) {
                // Nothing new since the last view (a trainer reports as it takes samples, not
                // on a clock): the last window stands.
                Some((before, window)) if *before == f => *window,
                Some((before, _)) => window(Some(*before), f),
                None => window(None, f),
            };
            seen.ranks.insert((t.id, r.rank), (f, now));
            // A rank with no figures yet (it has neither reported nor been seen waiting) says
            // nothing about the stream.
            if f.elapsed_us > 0 {
                waits.push(now.wait);
            }
            writeln!(
                v,
                "  {:>6} {:>9.1}% {:>9.1}% {:>10} {:>9} {:>8} {:>12}",
                r.rank,
                100.0 * now.wait,
                100.0 * f.wait_ratio(),
                now.rate.map_or("-".into(), |r| format!("{r:.1}")),
                f.taken,
                r.ready,
                if f.first_sample_us == 0 {
                    "-".to_string()
                } else {
                    format!("{:.3} s", f.first_sample_us as f64 / 1e6)
                }
            )?;
        }
        if t.consumers as usize > t.ranks_attached.len() {
            writeln!(
                v,
                "  ({} more rank(s) not listed)",
                t.consumers as usize - t.ranks_attached.len()
            )?;
        }
        if waits.is_empty() {
            // A rank's figures start with its first report (with its returns, every 64 samples
            // or when it waits) or the daemon seeing it wait: before that there is nothing to
            // judge, and 0% would read as "compute-bound".
            writeln!(
                v,
                "  verdict: none yet: no rank has reported its figures or been seen waiting"
            )?;
        } else {
            writeln!(v, "  verdict: {}", verdict(t, &waits, producers.as_ref()))?;
        }
    }
    *previous = seen;
    Ok(v)
}

/// A rank's figures over the last interval.
#[derive(Debug, Clone, Copy)]
struct Window {
    /// Share of the interval spent waiting (since the first request on the first view).
    wait: f64,
    /// Samples per second over the interval; `None` on the first view.
    rate: Option<f64>,
}

fn window(before: Option<RankFigures>, now: RankFigures) -> Window {
    match before {
        // A consumer that reopened restarts its figures: take them from zero.
        Some(b) if now.elapsed_us > b.elapsed_us && now.taken >= b.taken => {
            let elapsed = (now.elapsed_us - b.elapsed_us) as f64;
            Window {
                wait: (now.waited_us.saturating_sub(b.waited_us) as f64 / elapsed).min(1.0),
                rate: Some((now.taken - b.taken) as f64 / (elapsed / 1e6)),
            }
        }
        _ => Window {
            wait: now.wait_ratio(),
            rate: None,
        },
    }
}

/// Where a stream's time goes, from its ranks' wait over the interval and what its producers
/// reported over it.
fn verdict(t: &StreamInfo, waits: &[f64], producers: Option<&StageProfile>) -> String {
    let worst = waits.iter().copied().fold(0.0, f64::max);
    let mean = waits.iter().sum::<f64>() / waits.len().max(1) as f64;
    if worst <= DATA_BOUND {
        format!(
            "compute-bound: the trainers wait {:.1}% of their time (at most {:.1}%); data keeps up",
            100.0 * mean,
            100.0 * worst
        )
    } else if t.producers == 0 {
        format!(
            "data-bound: trainers wait {:.1}% of their time and no producer is joined: start `feedstore produce --stream`",
            100.0 * mean
        )
    } else if let Some(p) = producers {
        format!(
            "data-bound: trainers wait {:.1}% of their time (worst rank {:.1}%): the producers are behind; they are {}",
            100.0 * mean,
            100.0 * worst,
            p.verdict()
        )
    } else {
        format!(
            "data-bound: trainers wait {:.1}% of their time (worst rank {:.1}%): the producers are behind and have not reported their profile yet",
            100.0 * mean,
            100.0 * worst
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn figures(waited_us: u64, taken: u64, elapsed_us: u64) -> RankFigures {
        RankFigures {
            waited_us,
            taken,
            elapsed_us,
            first_sample_us: 1,
        }
    }

    #[test]
    fn the_window_is_the_interval_and_a_reopened_consumer_starts_over() {
        let w = window(
            Some(figures(1_000_000, 10, 4_000_000)),
            figures(1_500_000, 30, 5_000_000),
        );
        assert!((w.wait - 0.5).abs() < 1e-9);
        assert_eq!(w.rate, Some(20.0));
        let w = window(
            Some(figures(1_000_000, 10, 4_000_000)),
            figures(100_000, 2, 1_000_000),
        );
        assert!((w.wait - 0.1).abs() < 1e-9);
        assert_eq!(w.rate, None);
    }
}
