//! A run's progress: the bar or plain lines, the rejects and handles files, the readers of a
//! stream (`--idle-exit`), Ctrl-C, and the summary at the end.

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use feedstore_producer::feed::FeedConfig;
use feedstore_producer::pipeline::{Event, ProducerConfig, Summary};
use feedstore_producer::profile::Profiler;

use super::Args;

/// What a run has made so far, and how it is shown: a progress bar on a terminal (with an ETA
/// once the run's length is known), otherwise plain lines every half second, for logs; the
/// rejects and handles files; the readers of a stream, for `--idle-exit`. Called for every
/// event of the pipeline, and at least every half second.
pub(super) struct Progress {
    pub(super) bar: Option<indicatif::ProgressBar>,
    rejects: LazyFile,
    rejects_path: PathBuf,
    handles: Option<LazyFile>,
    /// The first failure to write the rejects or handles file: the run's error at its end.
    write_error: Option<anyhow::Error>,
    watch: Option<ReaderWatch>,
    workers: usize,
    fetch_concurrency: usize,
    started: Instant,
    /// When the last plain line was printed, and how many samples had been produced then
    /// (for the rate since).
    last: Instant,
    produced_then: u64,
    produced: u64,
    rejected: u64,
    bytes: u64,
}

impl Progress {
    pub(super) fn new(
        args: &Args,
        config: &ProducerConfig,
        rejects: LazyFile,
        handles: Option<LazyFile>,
    ) -> Progress {
        let bar = std::io::stderr().is_terminal().then(progress_bar);
        if let Some(bar) = &bar {
            let _ = BAR.set(bar.clone());
        }
        // A stream's producer whose trainers have all left ends after --idle-exit.
        let watch = match (&args.stream.stream, args.stream.idle_exit) {
            (Some(name), secs) if secs > 0 && args.stream.ranks_at.is_empty() => Some(
                ReaderWatch::new(&config.socket, name, Duration::from_secs(secs)),
            ),
            _ => None,
        };
        Progress {
            bar,
            rejects_path: rejects.path.clone(),
            rejects,
            handles,
            write_error: None,
            watch,
            workers: config.workers,
            fetch_concurrency: config.fetch_concurrency,
            started: Instant::now(),
            last: Instant::now(),
            produced_then: 0,
            produced: 0,
            rejected: 0,
            bytes: 0,
        }
    }

    /// A stream run's opening line, and the bar's length: this producer's share, its ranks'
    /// positions over every epoch.
    pub(super) fn feeding(&self, name: &str, feed: &FeedConfig, records: u64) {
        if let (Some(bar), Some(_)) = (&self.bar, feed.spec.epochs) {
            // (Each rank's end: a resharded stream's ranks end one sample apart at most.)
            let ends = feed.ranks.iter().filter_map(|r| feed.spec.end_seq(r.rank));
            bar.set_length(ends.sum());
            bar.set_style(bar_style(true));
        }
        // Through the bar (when there is one), which would draw over it otherwise.
        say_around(
            &self.bar,
            format!(
                "feeding stream {name:?}: {records} records, {} per rank per epoch, ranks {:?}, \
                 {} epoch(s); trainers open it with records={records}, seed={}, \
                 shuffle=\"{}\", tail=\"{}\", epochs={}",
                feed.spec.per_rank(),
                feed.ranks.iter().map(|r| r.rank).collect::<Vec<_>>(),
                feed.spec
                    .epochs
                    .map_or("unbounded".into(), |e| e.to_string()),
                feed.spec.seed,
                feed.spec.shuffle,
                feed.spec.tail,
                feed.spec.epochs.map_or("None".into(), |e| e.to_string()),
            ),
        );
    }

    /// One event of the pipeline (or its half-second idle tick).
    pub(super) fn on_event(&mut self, event: &Event, profiler: &Profiler) {
        if !matches!(event, Event::Idle) && self.write_error.is_none() {
            // The run has made something: this run's files replace the last run's now.
            let handles = &mut self.handles;
            let created = self
                .rejects
                .file()
                .and_then(|_| handles.as_mut().map_or(Ok(()), |h| h.file().map(|_| ())));
            if let Err(e) = created {
                self.write_error = Some(e);
            }
        }
        match event {
            Event::Produced(p) => {
                self.produced += 1;
                self.bytes += p.bytes;
                if let Some(out) = self.handles.as_mut() {
                    let row = serde_json::json!({
                        "line": p.line, "id": p.id, "handle": p.handle.to_string(), "bytes": p.bytes,
                    });
                    if let Err(e) = out.line(&row.to_string()) {
                        self.write_error.get_or_insert(e);
                    }
                }
            }
            Event::Rejected(r) => {
                self.rejected += 1;
                let line = serde_json::to_string(r).expect("rejects serialise");
                if let Err(e) = self.rejects.line(&line) {
                    self.write_error.get_or_insert(e);
                }
            }
            Event::Idle => {}
        }
        let gone = self.watch.as_mut().and_then(ReaderWatch::gone_for);
        if let Some((why, status)) = self.stop_asked() {
            self.exit(&why, status, profiler);
        }
        if let Some(bar) = &self.bar {
            bar.set_position(self.produced + self.rejected);
        }
        if self.last.elapsed() >= Duration::from_millis(500) {
            self.report(gone, profiler);
        }
    }

    /// Why the run must stop now, and its exit status: a signal, or readers gone too long.
    fn stop_asked(&self) -> Option<(String, i32)> {
        if INTERRUPTED.load(Ordering::Relaxed) {
            return Some((
                "interrupted".to_owned(),
                128 + INTERRUPTED_BY.load(Ordering::Relaxed),
            ));
        }
        self.watch.as_ref().filter(|w| w.expired()).map(|watch| {
            let why = format!(
                "every reader of stream {:?} left {} s ago (--idle-exit); stopping",
                watch.name,
                watch.limit.as_secs()
            );
            (why, READERS_GONE_STATUS)
        })
    }

    /// Ends the process with `status` after printing the profile so far. The daemon takes back
    /// what this process held (unsealed objects, tasks in flight) when its connections close.
    fn exit(&mut self, why: &str, status: i32, profiler: &Profiler) -> ! {
        if let Some(bar) = &self.bar {
            // The profile printed next says where the run stood.
            bar.finish_and_clear();
        }
        // What was written so far stays readable.
        let _ = self.rejects.flush();
        if let Some(out) = self.handles.as_mut() {
            let _ = out.flush();
        }
        let wall = self.started.elapsed();
        let profile = profiler.snapshot(wall, self.workers, self.fetch_concurrency);
        println!(
            "{why} after {:.2} s: produced {} samples ({:.1} MB), rejected {} (listed in {}); \
             the profile so far:",
            wall.as_secs_f64(),
            self.produced,
            self.bytes as f64 / 1e6,
            self.rejected,
            self.rejects_path.display()
        );
        print!("{}", profile.table());
        println!("verdict: {}", profile.verdict());
        let _ = std::io::stdout().flush();
        std::process::exit(status);
    }

    /// The bar's message, or a plain line: counts, rates, fetches in flight, and the
    /// profiler's verdict (or how long the stream's readers have been gone).
    fn report(&mut self, gone: Option<Duration>, profiler: &Profiler) {
        let since = self.last.elapsed();
        self.last = Instant::now();
        let rate_now = (self.produced - self.produced_then) as f64 / since.as_secs_f64();
        self.produced_then = self.produced;
        let wall = self.started.elapsed();
        let profile = profiler.snapshot(wall, self.workers, self.fetch_concurrency);
        let verdict = match (gone, &self.watch) {
            (Some(gone), Some(watch)) => format!(
                "no reader attached for {} s (exiting at {} s, --idle-exit)",
                gone.as_secs(),
                watch.limit.as_secs()
            ),
            _ => profile.verdict(),
        };
        let mb_per_s = self.bytes as f64 / 1e6 / wall.as_secs_f64();
        match &self.bar {
            Some(bar) => bar.set_message(format!(
                "{} rejected, {mb_per_s:.0} MB/s, {} fetches in flight; {verdict}",
                self.rejected, profile.fetch_in_flight,
            )),
            None => eprintln!(
                "  {} produced, {} rejected, {rate_now:.1} samples/s now ({:.1} over the run), \
                 {mb_per_s:.0} MB/s into the store, {} fetches in flight; {verdict}",
                self.produced,
                self.rejected,
                self.produced as f64 / wall.as_secs_f64(),
                profile.fetch_in_flight,
            ),
        }
    }

    /// The run's end: the bar finished, the files flushed, the summary and profile printed;
    /// an error if a file could not be written or too many records were rejected.
    /// Where the rejects go.
    pub(super) fn rejects_path(&self) -> &std::path::Path {
        &self.rejects_path
    }

    pub(super) fn finish(mut self, summary: &Summary, max_reject_rate: f64) -> anyhow::Result<()> {
        if let Some(bar) = &self.bar {
            // Several producers share ranks, or a resume started past 0: the bar's length was
            // an upper bound; end it where it stands.
            if bar.length().is_some_and(|len| len > bar.position()) {
                bar.set_length(bar.position());
            }
            bar.finish();
        }
        self.rejects.flush()?;
        if let Some(out) = self.handles.as_mut() {
            out.flush()?;
        }
        if let Some(e) = self.write_error {
            return Err(e);
        }
        let wall = summary.profile.wall.as_secs_f64();
        println!(
            "produced {} samples ({:.1} MB) in {:.2} s: {:.1} samples/s; rejected {} ({:.1}%), \
             listed in {}",
            summary.produced,
            self.bytes as f64 / 1e6,
            wall,
            summary.produced as f64 / wall.max(1e-9),
            summary.rejected,
            summary.reject_rate() * 100.0,
            self.rejects_path.display()
        );
        print!("{}", summary.profile.table());
        println!("verdict: {}", summary.profile.verdict());
        if summary.reject_rate() > max_reject_rate {
            bail!(
                "{:.1}% of records were rejected, above --max-reject-rate {:.1}%; see {}",
                summary.reject_rate() * 100.0,
                max_reject_rate * 100.0,
                self.rejects_path.display()
            );
        }
        Ok(())
    }
}

/// A stream producer's view of its readers: it asks the daemon twice a second how many
/// trainers are attached to the stream and how far they read, and says when they are gone.
struct ReaderWatch {
    socket: PathBuf,
    name: String,
    /// How long readers may be gone before the run ends (`--idle-exit`).
    limit: Duration,
    client: Option<feedstore_consumer::Client>,
    asked: Option<Instant>,
    /// A reader has been seen (attached, or its reading moved `progress`).
    seen: bool,
    /// Since when no reader is attached (after one was).
    gone_since: Option<Instant>,
    /// The stream's samples returned by its readers, and its fastest rank's position, when
    /// last asked: a reader that came and went between two asks moved one of them.
    progress: Option<(u64, u64)>,
}

/// The exit status of a producer that stopped because its readers were gone (`--idle-exit`).
const READERS_GONE_STATUS: i32 = 3;

impl ReaderWatch {
    /// How often the daemon is asked (a request as cheap as `feedstore stat`'s).
    const EVERY: Duration = Duration::from_millis(500);

    fn new(socket: &Path, name: &str, limit: Duration) -> ReaderWatch {
        ReaderWatch {
            socket: socket.to_owned(),
            name: name.to_owned(),
            limit,
            client: None,
            asked: None,
            seen: false,
            gone_since: None,
            progress: None,
        }
    }

    /// How long the readers have been gone, asking the daemon when it is time to.
    fn gone_for(&mut self) -> Option<Duration> {
        if self.asked.is_none_or(|at| at.elapsed() >= Self::EVERY) {
            self.asked = Some(Instant::now());
            if let Some((readers, moved)) = self.readers() {
                let read = self.progress.is_some_and(|before| moved != before);
                self.progress = Some(moved);
                self.seen |= readers > 0 || read;
                self.gone_since = match (readers, self.gone_since) {
                    (0, since) if self.seen && !read => since.or_else(|| Some(Instant::now())),
                    _ => None,
                };
            }
        }
        self.gone_since.map(|since| since.elapsed())
    }

    /// Trainers attached to this user's stream of this name, and the samples they returned
    /// and the fastest rank's position so far; `None` when the daemon cannot be asked (the
    /// run's own requests will say why).
    fn readers(&mut self) -> Option<(u32, (u64, u64))> {
        if self.client.is_none() {
            self.client = feedstore_consumer::ConnectOptions::new(feedstore_proto::Role::Reader)
                .socket(&self.socket)
                .name("feedstore produce (readers)")
                .populate(false)
                .connect()
                .ok();
        }
        let uid = nix::unistd::getuid().as_raw();
        match self.client.as_ref()?.streams() {
            Ok(streams) => Some(
                streams
                    .iter()
                    .filter(|s| s.name == self.name && s.owner_uid == uid)
                    .fold((0, (0, 0)), |(n, (r, f)), s| {
                        (n + s.consumers, (r + s.returned, f.max(s.fastest)))
                    }),
            ),
            Err(_) => {
                self.client = None;
                None
            }
        }
    }

    /// Whether the readers have been gone longer than the limit.
    fn expired(&self) -> bool {
        self.gone_since
            .is_some_and(|since| since.elapsed() >= self.limit)
    }
}

/// An output file (rejects, handles) created when the run makes its first sample or reject, or
/// by the final flush of a run that made none: a run that fails before making anything (no
/// daemon, a manifest that is a directory) leaves an earlier run's file as it was. Whether it
/// can be written is checked up front, without touching it.
pub(super) struct LazyFile {
    path: PathBuf,
    file: Option<std::io::BufWriter<std::fs::File>>,
}

impl LazyFile {
    pub(super) fn new(path: &std::path::Path) -> anyhow::Result<LazyFile> {
        use nix::unistd::{AccessFlags, access};
        let dir = match path.parent() {
            Some(dir) if !dir.as_os_str().is_empty() => dir,
            _ => std::path::Path::new("."),
        };
        let target = if path.exists() { path } else { dir };
        access(target, AccessFlags::W_OK)
            .with_context(|| format!("{} cannot be written", path.display()))?;
        Ok(LazyFile {
            path: path.to_owned(),
            file: None,
        })
    }

    fn file(&mut self) -> anyhow::Result<&mut std::io::BufWriter<std::fs::File>> {
        if self.file.is_none() {
            let file = std::fs::File::create(&self.path)
                .with_context(|| format!("creating {}", self.path.display()))?;
            self.file = Some(std::io::BufWriter::new(file));
        }
        Ok(self.file.as_mut().expect("just created"))
    }

    fn line(&mut self, line: &str) -> anyhow::Result<()> {
        let path = self.path.display().to_string();
        writeln!(self.file()?, "{line}").with_context(|| format!("writing {path}"))
    }

    fn flush(&mut self) -> anyhow::Result<()> {
        let path = self.path.display().to_string();
        self.file()?
            .flush()
            .with_context(|| format!("writing {path}"))
    }
}

/// The progress bar being drawn, if any: log lines are written around it.
static BAR: std::sync::OnceLock<indicatif::ProgressBar> = std::sync::OnceLock::new();

/// Stderr for log lines: with a progress bar drawn, the bar steps aside for each line (a log
/// line written through it would garble both).
pub struct AroundTheBar;

impl Write for AroundTheBar {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.write_all(buf)?;
        Ok(buf.len())
    }

    fn write_all(&mut self, buf: &[u8]) -> std::io::Result<()> {
        match BAR.get().filter(|bar| !bar.is_finished()) {
            Some(bar) => bar.suspend(|| std::io::stderr().write_all(buf)),
            None => std::io::stderr().write_all(buf),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        std::io::stderr().flush()
    }
}

/// Set by the first SIGINT or SIGTERM.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

/// Whether the first SIGINT or SIGTERM came (see [`catch_interrupts`]).
pub(super) fn was_interrupted() -> bool {
    INTERRUPTED.load(Ordering::Relaxed)
}
/// Which signal it was: the exit status is 128 + its number, as if it had killed the process.
static INTERRUPTED_BY: AtomicI32 = AtomicI32::new(0);

extern "C" fn interrupted(signal: nix::libc::c_int) {
    INTERRUPTED_BY.store(signal, Ordering::Relaxed);
    INTERRUPTED.store(true, Ordering::Relaxed);
    // The next SIGINT or SIGTERM, of either kind, ends the process at once.
    for signal in [nix::libc::SIGINT, nix::libc::SIGTERM] {
        // SAFETY: signal(2) is async-signal-safe, and SIG_DFL is a valid disposition.
        unsafe { nix::libc::signal(signal, nix::libc::SIG_DFL) };
    }
}

/// The first SIGINT or SIGTERM sets [`INTERRUPTED`] (the run's event loop, called at least every
/// half second once the run has started, prints the profile so far and exits with 128 + the
/// signal's number); a second one ends the process at once. A signal the process was started
/// ignoring (`nohup`, a script's `&`) stays ignored.
pub(super) fn catch_interrupts() {
    use nix::sys::signal::{SaFlags, SigAction, SigHandler, SigSet, Signal, sigaction};
    let action = SigAction::new(
        SigHandler::Handler(interrupted),
        SaFlags::SA_RESTART,
        SigSet::empty(),
    );
    for signal in [Signal::SIGINT, Signal::SIGTERM] {
        // SAFETY: the handler only stores to atomics and calls signal(2), both
        // async-signal-safe.
        match unsafe { sigaction(signal, &action) } {
            Ok(old) if old.handler() == SigHandler::SigIgn => {
                // SAFETY: puts back the disposition the process started with.
                let _ = unsafe { sigaction(signal, &old) };
            }
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(?signal, error = %e, "cannot catch the signal; it ends the run without a profile")
            }
        }
    }
}

/// Prints a line on stderr above the progress bar, if one is drawn.
fn say_around(bar: &Option<indicatif::ProgressBar>, line: String) {
    match bar {
        Some(bar) => bar.suspend(|| eprintln!("{line}")),
        None => eprintln!("{line}"),
    }
}

/// Abandons the progress bar when the run ends early (an error), so what is printed next is
/// not drawn over.
pub(super) struct BarOnError(pub(super) Option<indicatif::ProgressBar>);

impl Drop for BarOnError {
    fn drop(&mut self) {
        if let Some(bar) = &self.0
            && !bar.is_finished()
        {
            bar.abandon();
        }
    }
}

/// A progress bar on stderr: records done, rate, elapsed, and the profiler's verdict as its
/// message; a length (and an ETA) once the run's size is known.
fn progress_bar() -> indicatif::ProgressBar {
    // Drawn as records finish (no ticker thread): nothing draws before the first one, so the
    // run's opening lines stay whole.
    indicatif::ProgressBar::no_length().with_style(bar_style(false))
}

fn bar_style(known_length: bool) -> indicatif::ProgressStyle {
    let template = if known_length {
        "{spinner} [{elapsed_precise}] {bar:40} {pos}/{len} records, {per_sec}, ETA {eta}\n  {wide_msg}"
    } else {
        "{spinner} [{elapsed_precise}] {pos} records, {per_sec}\n  {wide_msg}"
    };
    indicatif::ProgressStyle::with_template(template).expect("a valid template")
}
