//! `feedstore top`: the seed's figure, live. Refreshes a view of every stream and attached rank:
//! the wait-time ratio over the interval between the last two views (and since the rank's first
//! request), samples/s between the last two views that saw the rank's count of samples move, the
//! lag between ranks, the producers' stage profile over the interval, and a verdict on where the
//! time goes.

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
    let connect = || args.socket.inspect(Role::Reader, "feedstore-top");
    let mut client = Some(connect()?);
    let terminal = std::io::stdout().is_terminal();
    let mut previous = Previous::default();
    let mut shown = 0u64;
    // Since when the daemon is gone: top says so and connects again at each view until one
    // answers on the socket (a daemon restarted, its clients reconnecting).
    let mut gone_since: Option<Instant> = None;
    loop {
        let started = Instant::now();
        if client.is_none() {
            client = connect().ok();
        }
        let rendered = match &client {
            Some(c) => render(c, &socket.display().to_string(), &mut previous).map(Some),
            None => Ok(None),
        };
        let view = match rendered {
            Ok(Some(view)) => {
                gone_since = None;
                view
            }
            Ok(None) => gone_view(&socket, *gone_since.get_or_insert(started)),
            Err(e) if daemon_gone(&e) => {
                client = None;
                previous = Previous::default();
                gone_view(&socket, *gone_since.get_or_insert(started))
            }
            Err(e) => return Err(e),
        };
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

/// Whether `e` says the daemon went away (killed, crashed, restarting).
fn daemon_gone(e: &anyhow::Error) -> bool {
    matches!(
        e.downcast_ref::<feedstore_consumer::Error>(),
        Some(
            feedstore_consumer::Error::Disconnected { .. }
                | feedstore_consumer::Error::ShuttingDown
        )
    )
}

/// The view while no daemon answers on the socket.
fn gone_view(socket: &std::path::Path, since: Instant) -> String {
    format!(
        "feedstored at {} went away {:.0} s ago: connecting again at each view (its clients \
         reconnect if FEEDSTORE_RECONNECT_TIMEOUT is set)\n",
        socket.display(),
        since.elapsed().as_secs_f64()
    )
}

/// What the last view read, for the figures over the interval.
#[derive(Debug, Default)]
struct Previous {
    /// Each rank's figures and its window, by stream and rank.
    ranks: HashMap<(u32, u32), Window>,
    /// Each stream's producer figures and what grew over the last interval that saw a report.
    producers: HashMap<u32, (ProducerFigures, ProducerFigures)>,
}

/// One view; `previous` holds what the last view read.
fn render(client: &Client, socket: &str, previous: &mut Previous) -> anyhow::Result<String> {
    use std::fmt::Write;
    let s = client.stats().context("reading statistics")?;
    let streams = client.streams().context("listing streams")?;
    let mut v = String::new();
    write!(
        v,
        "feedstored at {socket}: {} of {} used, {} objects, {} clients, {} evictions, {} stream(s)",
        format_bytes(s.used_bytes),
        format_bytes(s.capacity_bytes),
        s.objects_sealed,
        s.clients,
        s.evictions,
        streams.len()
    )?;
    if s.reconnects > 0 {
        write!(
            v,
            "; {} reconnects of clients whose daemon went away ({} connected now)",
            s.reconnects, s.reconnected_clients
        )?;
    }
    writeln!(v)?;
    if s.attaches_waiting > 0 {
        writeln!(
            v,
            "{} trainer(s) waiting for a stream no producer has created yet (is `feedstore produce --stream` running, with the same name, as the same user?)",
            s.attaches_waiting
        )?;
    }
    let mut seen = Previous::default();
    for t in &streams {
        render_stream(&mut v, t, previous, &mut seen)?;
    }
    *previous = seen;
    Ok(v)
}

/// One stream's part of the view: its window, its producers over the last interval, each
/// attached rank's wait (the last interval and the whole run), and a verdict. Notes what it
/// read in `seen`, for the next view's intervals.
fn render_stream(
    v: &mut String,
    t: &StreamInfo,
    previous: &Previous,
    seen: &mut Previous,
) -> anyhow::Result<()> {
    use std::fmt::Write;
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
        return Ok(());
    }
    writeln!(
        v,
        "  {:>6} {:>10} {:>10} {:>10} {:>9} {:>8} {:>12}",
        "rank", "wait now", "wait all", "samples/s", "taken", "ready", "first sample"
    )?;
    let mut waits = Vec::new();
    for r in &t.ranks_attached {
        let f = r.figures;
        let now = window(previous.ranks.get(&(t.id, r.rank)), f);
        seen.ranks.insert((t.id, r.rank), now);
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
    Ok(())
}

/// A rank's figures over the last interval.
#[derive(Debug, Clone, Copy)]
struct Window {
    /// The figures this view read.
    figures: RankFigures,
    /// Share of the interval spent waiting (since the first request on the first view).
    wait: f64,
    /// The figures at the last view that saw the count of samples move, the rate's start.
    moved: RankFigures,
    /// Samples per second between the last two views that saw the count move (a consumer
    /// reports its count with its returns, every 64 samples or when it waits, while the
    /// daemon's estimate of its time runs on); `None` until two have.
    rate: Option<f64>,
}

fn window(before: Option<&Window>, now: RankFigures) -> Window {
    match before {
        // A consumer that reopened restarts its figures: take them from zero.
        Some(b) if now.elapsed_us >= b.figures.elapsed_us && now.taken >= b.figures.taken => {
            let elapsed = now.elapsed_us - b.figures.elapsed_us;
            let wait = if elapsed == 0 {
                // Nothing new since the last view: the last window stands.
                b.wait
            } else {
                (now.waited_us.saturating_sub(b.figures.waited_us) as f64 / elapsed as f64).min(1.0)
            };
            let (moved, rate) =
                if now.taken == b.moved.taken || now.elapsed_us <= b.moved.elapsed_us {
                    (b.moved, b.rate)
                } else {
                    let seconds = (now.elapsed_us - b.moved.elapsed_us) as f64 / 1e6;
                    (now, Some((now.taken - b.moved.taken) as f64 / seconds))
                };
            Window {
                figures: now,
                wait,
                moved,
                rate,
            }
        }
        _ => Window {
            figures: now,
            wait: now.wait_ratio(),
            moved: now,
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
        let first = window(None, figures(1_000_000, 10, 4_000_000));
        assert!((first.wait - 0.25).abs() < 1e-9);
        assert_eq!(first.rate, None);
        let w = window(Some(&first), figures(1_500_000, 30, 5_000_000));
        assert!((w.wait - 0.5).abs() < 1e-9);
        assert_eq!(w.rate, Some(20.0));
        let reopened = window(Some(&w), figures(100_000, 2, 1_000_000));
        assert!((reopened.wait - 0.1).abs() < 1e-9);
        assert_eq!(reopened.rate, None);
    }

    /// Between reports the daemon's estimate of a rank's time runs on while its count stands
    /// still: the rate spans the views that saw the count move, and a view with nothing new
    /// keeps the last window.
    #[test]
    fn the_rate_spans_the_views_that_saw_the_count_move() {
        let a = window(None, figures(0, 0, 1_000_000));
        let b = window(Some(&a), figures(0, 64, 2_000_000));
        assert_eq!(b.rate, Some(64.0));
        // Computing on, no report: no waiting, the count and the rate stand.
        let c = window(Some(&b), figures(0, 64, 4_000_000));
        assert_eq!((c.wait, c.rate), (0.0, Some(64.0)));
        let d = window(Some(&c), figures(0, 64, 4_000_000));
        assert_eq!((d.wait, d.rate), (0.0, Some(64.0)));
        // The next report: 64 more over the 4 s since the count last moved.
        let e = window(Some(&d), figures(500_000, 128, 6_000_000));
        assert_eq!(e.rate, Some(16.0));
        assert!((e.wait - 0.25).abs() < 1e-9);
    }
}
