//! Streams from Python: a rank reading its share ([`Stream`]) and Python code publishing
//! samples into a stream ([`Writer`]).

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use feedstore_consumer::stream::{Delivery, Made, StreamFeeder, StreamOptions};
use feedstore_consumer::{Client, ConnectOptions, CreateOptions, Error, Role, StreamTask};
use feedstore_proto::reshard::{read_state, reshard_texts, resume, state_text};
use feedstore_proto::stream::{StreamSpec, StreamState, default_depth};
use pyo3::exceptions::PyKeyboardInterrupt;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::{Disconnected, FeedstoreError, IntoPy, InvalidArgument, Timeout, to_py};
use crate::sample::{Sample, Tensor, stack_images, stacked};
use crate::writing::{Reservation, write_batch, write_item};

/// How long one wait lasts before Python gets to check for Ctrl-C.
const WAIT_SLICE: Duration = Duration::from_millis(100);

/// The spec from keyword arguments, the same for `Stream` and `Writer`.
#[allow(clippy::too_many_arguments)]
fn spec(
    name: &str,
    records: u64,
    world: u32,
    seed: u64,
    shuffle: &str,
    tail: &str,
    epochs: Option<u64>,
) -> PyResult<StreamSpec> {
    Ok(StreamSpec {
        name: name.to_owned(),
        records,
        seed,
        world,
        shuffle: shuffle.parse().map_err(InvalidArgument::new_err)?,
        tail: tail.parse().map_err(InvalidArgument::new_err)?,
        epochs,
        reshard: None,
    })
}

fn socket_path(socket: Option<String>) -> std::path::PathBuf {
    socket.map_or_else(feedstore_proto::client_socket_path, Into::into)
}

/// How long `Stream(...)` waits for its stream to appear before it says what it waits for.
const OPEN_TELL_AFTER: Duration = Duration::from_secs(3);

/// The warning of a `Stream(...)` still waiting for its stream: what to check.
fn waiting_for_stream(name: &str, socket: &std::path::Path, wait: Duration) -> String {
    format!(
        "waiting for stream {name:?} on {}: no producer of this user has created it yet \
         (waiting up to {:.0} s); is `feedstore produce --stream {name}` (or a \
         feedstore.Writer) running on this node with the same records, seed, world, shuffle, \
         tail and epochs?",
        socket.display(),
        wait.as_secs_f64()
    )
}

/// What `Stream.next_stacked` returns: the samples, and their images stacked.
type StackedBatch = (Vec<Py<Sample>>, Option<Tensor>);

/// One data-parallel rank's share of a stream, in order, with prefetch. Iterate it for
/// `Sample`s; save `state()` with a checkpoint and pass it back as `state=` to continue with
/// exactly the next sample.
///
/// Waits release the GIL and wake for Ctrl-C every 100 ms.
#[pyclass(module = "feedstore", frozen)]
pub struct Stream {
    inner: Mutex<Option<feedstore_consumer::Stream>>,
    wait: Duration,
    name: String,
    rank: u32,
    /// Batches `next_stacked` had to copy (not placed side by side).
    stacked_copies: AtomicU64,
    /// An error met after `next_batch` had taken some samples: those went to the caller, this
    /// is raised by the next call.
    pending: Mutex<Option<PyErr>>,
}

impl Stream {
    fn with<T>(
        &self,
        f: impl FnOnce(&mut feedstore_consumer::Stream) -> Result<T, Error>,
    ) -> PyResult<T> {
        let mut guard = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let stream = guard
            .as_mut()
            .ok_or_else(|| FeedstoreError::new_err(format!("stream {:?} is closed", self.name)))?;
        f(stream).py_err()
    }

    /// The next sample, waiting in slices so that signals get through.
    fn next_sample(&self, py: Python<'_>) -> PyResult<Option<Sample>> {
        let deadline = Instant::now() + self.wait;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let slice = left.min(WAIT_SLICE).max(Duration::from_millis(1));
            let got = py.detach(|| {
                let mut guard = self.inner.lock().unwrap_or_else(|e| e.into_inner());
                guard.as_mut().map(|stream| {
                    stream
                        .next_sample_within(slice)
                        .map(|s| s.map(Sample::from_stream))
                })
            });
            match got {
                None => {
                    return Err(FeedstoreError::new_err(format!(
                        "stream {:?} is closed",
                        self.name
                    )));
                }
                Some(Ok(sample)) => return Ok(sample),
                Some(Err(Error::Timeout(_))) if !left.is_zero() => py.check_signals()?,
                Some(Err(Error::Timeout(_))) => {
                    return Err(Timeout::new_err(format!(
                        "no sample for rank {} of stream {:?} within {:?}: are producers running?",
                        self.rank, self.name, self.wait
                    )));
                }
                Some(Err(e)) => return Err(to_py(e)),
            }
        }
    }
}

#[pymethods]
impl Stream {
    /// Opens `rank`'s share of the stream `name` over `records` manifest records on the daemon
    /// at `socket` (default: `$FEEDSTORE_SOCKET`, else this user's daemon, else the system
    /// daemon's). Producers and every rank must pass the same spec: `world`, `seed`, `shuffle`
    /// ("full", "none", "block:N"), `tail` ("drop", "pad") and `epochs` (None: until closed).
    /// `state` is a string from `state()` (or from `feedstore.reshard`, to resume a run saved
    /// at another world size); `wait` the seconds to wait for a producer to create
    /// the stream, and then for each sample, before raising `feedstore.Timeout`. (The prefetch
    /// depth is the stream's, set by its producer; `depth` is accepted and ignored, with a
    /// `DeprecationWarning`.)
    #[new]
    #[pyo3(signature = (name, records, rank=0, world=1, *, seed=0, shuffle="full", tail="drop",
        epochs=Some(1), state=None, socket=None, wait=300.0, depth=None),
        text_signature = "(name, records, rank=0, world=1, *, seed=0, shuffle='full', \
        tail='drop', epochs=1, state=None, socket=None, wait=300.0, depth=None)")]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        name: &str,
        records: u64,
        rank: u32,
        world: u32,
        seed: u64,
        shuffle: &str,
        tail: &str,
        epochs: Option<u64>,
        state: Option<&str>,
        socket: Option<String>,
        wait: f64,
        depth: Option<u32>,
    ) -> PyResult<Stream> {
        if depth.is_some() {
            let warning = py.get_type::<pyo3::exceptions::PyDeprecationWarning>();
            PyErr::warn(
                py,
                &warning,
                c"Stream(depth=) is ignored: the prefetch depth is the stream's, set by its \
                  producer (Writer(depth=), feedstore produce --prefetch)",
                1,
            )?;
        }
        let mut spec = spec(name, records, world, seed, shuffle, tail, epochs)?;
        let from = match state {
            None => None,
            Some(text) => {
                let (resumed, state) = read_state(&spec, text).map_err(InvalidArgument::new_err)?;
                spec = resumed;
                Some(state)
            }
        };
        let wait = Duration::try_from_secs_f64(wait).map_err(|_| {
            InvalidArgument::new_err("wait must be a non-negative number of seconds")
        })?;
        let options = StreamOptions {
            wait,
            ..StreamOptions::default()
        };
        let socket = socket_path(socket);
        // Waiting for a producer to create the stream: look for Ctrl-C every 100 ms, and say
        // once, after a few seconds, what is awaited (a wrong name or socket would otherwise
        // look like a hang for the whole `wait`).
        let mut interrupted = None;
        let started = std::time::Instant::now();
        let mut told = false;
        let stream = py.detach(|| {
            feedstore_consumer::Stream::open_interruptible(
                socket.clone(),
                &spec,
                rank,
                from,
                options,
                || {
                    Python::attach(|py| {
                        py.check_signals()?;
                        if !told && started.elapsed() >= OPEN_TELL_AFTER {
                            told = true;
                            let text = waiting_for_stream(name, &socket, wait);
                            let warning = py.get_type::<pyo3::exceptions::PyUserWarning>();
                            // (Warnings turned into errors must not end the wait.)
                            let text = std::ffi::CString::new(text)?;
                            let _ = PyErr::warn(py, &warning, &text, 1);
                        }
                        Ok(())
                    })
                    .map_err(|e: PyErr| {
                        interrupted = Some(e);
                        Error::Interrupted
                    })
                },
            )
        });
        let stream = match (stream, interrupted) {
            (Err(Error::Interrupted), Some(signal)) => return Err(signal),
            (stream, _) => stream.py_err()?,
        };
        Ok(Stream {
            inner: Mutex::new(Some(stream)),
            wait,
            name: name.to_owned(),
            rank,
            stacked_copies: AtomicU64::new(0),
            pending: Mutex::new(None),
        })
    }

    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__(&self, py: Python<'_>) -> PyResult<Option<Sample>> {
        self.next_sample(py)
    }

    /// Up to `n` samples: fewer at the end, or before an error (a failed sample, a timeout),
    /// which the next call raises (the samples taken are never lost). With `out`, a writable
    /// C-contiguous array of
    /// shape `(n, *image_shape)`, image `image` of each sample is also copied into `out[i]`
    /// (without the GIL), for a model that wants one stacked batch tensor; if they cannot be
    /// (`out` of another shape or dtype, images that differ), the error's `samples` attribute
    /// holds the samples taken.
    #[pyo3(signature = (n, out=None, image=0))]
    fn next_batch(
        &self,
        py: Python<'_>,
        n: usize,
        out: Option<Bound<'_, PyAny>>,
        image: usize,
    ) -> PyResult<Vec<Py<Sample>>> {
        if let Some(e) = self
            .pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            return Err(e);
        }
        let mut batch = Vec::with_capacity(n.min(1024));
        while batch.len() < n {
            match self.next_sample(py) {
                Ok(Some(sample)) => batch.push(Py::new(py, sample)?),
                Ok(None) => break,
                // The samples taken are the caller's (the stream is past them): they come back
                // now, the error with the next call. Ctrl-C stops at once.
                Err(e) if !batch.is_empty() && !e.is_instance_of::<PyKeyboardInterrupt>(py) => {
                    *self.pending.lock().unwrap_or_else(|e| e.into_inner()) = Some(e);
                    break;
                }
                Err(e) => return Err(e),
            }
        }
        if let Some(out) = out {
            let out = if batch.len() < n {
                out.get_item(pyo3::types::PySlice::new(py, 0, batch.len() as isize, 1))?
            } else {
                out
            };
            if let Err(e) = stack_images(py, &batch, image, &out) {
                // The samples are this reader's now: they come with the error, not lost.
                e.value(py).setattr("samples", batch)?;
                return Err(e);
            }
        }
        Ok(batch)
    }

    /// Up to `n` samples and image `image` of each stacked into one `(len(samples), *shape)`
    /// `Tensor`: a view of shared memory, with no copy, when a producer placed the batch in
    /// one object (`Writer(batch=n)` and `put_batch`) and this reader reads whole batches from
    /// a multiple of `n`; otherwise a stacked copy (counted in `stacked_copies`). Over shared
    /// memory, `t.numpy()` is read-only and `torch.from_dlpack(t)` writable through a
    /// copy-on-write mapping of its own (one mmap, whose page tables are built as it is first
    /// read: BENCHMARKS.md). `([], None)` with no samples left. The tensor keeps the batch's
    /// object leased while it lives. If the images cannot be stacked (a sample without image
    /// `image`, images of different shapes, dtypes or layouts), raises `InvalidArgument` whose
    /// `samples` attribute holds the samples taken.
    #[pyo3(signature = (n, image=0))]
    fn next_stacked(&self, py: Python<'_>, n: usize, image: usize) -> PyResult<StackedBatch> {
        let batch = self.next_batch(py, n, None, image)?;
        if batch.is_empty() {
            return Ok((batch, None));
        }
        let (images, copied) = match stacked(py, &batch, image) {
            Ok(stacked) => stacked,
            // The samples are this reader's now (its position is past them): hand them over
            // with the error, so nothing is lost.
            Err(e) => {
                e.value(py).setattr("samples", batch)?;
                return Err(e);
            }
        };
        if copied {
            self.stacked_copies.fetch_add(1, Ordering::Relaxed);
        }
        Ok((batch, Some(images)))
    }

    /// Batches `next_stacked` had to copy, because their samples were not side by side in
    /// one object.
    #[getter]
    fn stacked_copies(&self) -> u64 {
        self.stacked_copies.load(Ordering::Relaxed)
    }

    /// Where the stream stands, as text: save it with a checkpoint. (A stream resumed at
    /// another world size prefixes it with what the old run left: see `feedstore.reshard`.)
    fn state(&self) -> PyResult<String> {
        self.with(|s| Ok(state_text(s.spec(), &s.state())))
    }

    /// What this consumer measured of its own reading, as it reports it to the daemon (and
    /// `feedstore top` and the metrics show it): `waited` (seconds spent waiting for samples
    /// not yet made), `taken` (samples), `elapsed` (seconds since its first request: waiting
    /// plus the trainer's own work), `wait_ratio` (waited / elapsed: the wait-time ratio) and
    /// `first_sample` (seconds from opening to the first sample; None before it), and
    /// `passed_held` (samples kept so long that the prefetch window moved past them).
    fn figures<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let (f, passed_held) = self.with(|s| Ok((s.figures(), s.passed_held())))?;
        let dict = PyDict::new(py);
        dict.set_item("waited", f.waited_us as f64 / 1e6)?;
        dict.set_item("taken", f.taken)?;
        dict.set_item("elapsed", f.elapsed_us as f64 / 1e6)?;
        dict.set_item("wait_ratio", f.wait_ratio())?;
        dict.set_item(
            "first_sample",
            (f.first_sample_us > 0).then(|| f.first_sample_us as f64 / 1e6),
        )?;
        dict.set_item("passed_held", passed_held)?;
        Ok(dict)
    }

    /// Seconds from opening the stream to its first sample (None before it).
    #[getter]
    fn time_to_first_sample(&self) -> PyResult<Option<f64>> {
        self.with(|s| Ok(s.time_to_first_sample().map(|d| d.as_secs_f64())))
    }

    /// How many times this rank attached again after its daemon went away and came back on
    /// the same socket (with ``FEEDSTORE_RECONNECT_TIMEOUT`` set): it went on from its next
    /// sample each time.
    #[getter]
    fn reattached(&self) -> PyResult<u64> {
        self.with(|s| Ok(s.reattached()))
    }

    /// The stream's name.
    #[getter]
    fn name(&self) -> &str {
        &self.name
    }

    /// This consumer's rank.
    #[getter]
    fn rank(&self) -> u32 {
        self.rank
    }

    /// Tells the daemon now which samples were dropped (otherwise done in batches).
    fn flush(&self) -> PyResult<()> {
        self.with(|s| {
            s.flush_returns();
            Ok(())
        })
    }

    /// Detaches the rank, so another consumer may attach to it. Samples already handed out (and
    /// their arrays and tensors) stay valid: each holds its own lease.
    fn close(&self) {
        drop(self.inner.lock().unwrap_or_else(|e| e.into_inner()).take());
    }

    fn __enter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __exit__(
        &self,
        _t: Option<Bound<'_, PyAny>>,
        _v: Option<Bound<'_, PyAny>>,
        _tb: Option<Bound<'_, PyAny>>,
    ) {
        self.close();
    }
}

/// The state text (as `Stream.state()` gives) of `rank` standing before its `seq`-th sample of
/// the stream with this spec: what a checkpoint saves for a rank that has consumed `seq`
/// samples, when the consumer that read them is in another process. For a run resumed at
/// another world size, `resumed` is a state text of that run (from `feedstore.reshard`): the
/// sequence numbers are that run's.
#[pyfunction]
#[pyo3(signature = (name, records, rank, seq, world=1, *, seed=0, shuffle="full", tail="drop",
    epochs=Some(1), resumed=None), text_signature = "(name, records, rank, seq, world=1, *, \
    seed=0, shuffle='full', tail='drop', epochs=1, resumed=None)")]
#[allow(clippy::too_many_arguments)]
pub fn state_at(
    name: &str,
    records: u64,
    rank: u32,
    seq: u64,
    world: u32,
    seed: u64,
    shuffle: &str,
    tail: &str,
    epochs: Option<u64>,
    resumed: Option<&str>,
) -> PyResult<String> {
    let mut spec = spec(name, records, world, seed, shuffle, tail, epochs)?;
    if let Some(text) = resumed {
        spec = read_state(&spec, text).map_err(InvalidArgument::new_err)?.0;
    }
    spec.check(rank)
        .map_err(|e| InvalidArgument::new_err(e.to_string()))?;
    Ok(state_text(&spec, &StreamState::at(&spec, rank, seq)))
}

/// Resumes a run at another world size: `states` holds every rank's `Stream.state()` text from
/// a run of `len(states)` ranks of the stream the keywords describe (the same as its `Stream`s
/// and `Writer`s took, `world` aside); returns one state text per rank of a run of `world`
/// ranks, in rank order. Across the new ranks, every sample of the epochs the old ranks had
/// begun that none of them read is read exactly once (their uneven progress included), in
/// shares that differ by one sample at most; later epochs are the new world's ordinary ones.
/// Open rank `r`'s `Stream(..., rank=r, world=world, state=new[r])`, and the producers with
/// `Writer(..., world=world, states=new)`. Raises `InvalidArgument` for states of another
/// stream, a rank missing or twice, or states that cannot be resharded (see the message).
#[pyfunction]
#[pyo3(signature = (states, world, *, name, records, seed=0, shuffle="full", tail="drop",
    epochs=Some(1)), text_signature = "(states, world, *, name, records, seed=0, \
    shuffle='full', tail='drop', epochs=1)")]
#[allow(clippy::too_many_arguments)]
pub fn reshard(
    states: Vec<String>,
    world: u32,
    name: &str,
    records: u64,
    seed: u64,
    shuffle: &str,
    tail: &str,
    epochs: Option<u64>,
) -> PyResult<Vec<String>> {
    let spec = spec(name, records, world, seed, shuffle, tail, epochs)?;
    let texts: Vec<&str> = states.iter().map(String::as_str).collect();
    reshard_texts(&spec, &texts, world).map_err(|e| InvalidArgument::new_err(e.to_string()))
}

/// A sample a stream wants: rank `rank`'s `seq`-th sample, made from manifest record `record`.
#[pyclass(module = "feedstore", frozen, eq, hash)]
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Task {
    /// The rank.
    #[pyo3(get)]
    rank: u32,
    /// Its sequence number.
    #[pyo3(get)]
    seq: u64,
    /// The record to make it from.
    #[pyo3(get)]
    record: u64,
}

#[pymethods]
impl Task {
    fn __repr__(&self) -> String {
        format!(
            "Task(rank={}, seq={}, record={})",
            self.rank, self.seq, self.record
        )
    }
}

/// Publishes samples into a stream from Python (existing preprocessing, Ray actors): take
/// tasks, make each task's record, put it. Every sample is written once, straight into shared
/// memory, and readers get it by handle.
#[pyclass(module = "feedstore", frozen)]
pub struct Writer {
    client: Client,
    feeder: StreamFeeder,
    /// Since when `take` has found no task (`None` while it finds some), and whether the
    /// writer was told why.
    idle: Mutex<Option<(Instant, bool)>>,
}

/// How long `Writer.take` finds no task before it says what it waits for.
const WRITER_TELL_AFTER: Duration = Duration::from_secs(5);

#[pymethods]
impl Writer {
    /// Joins the stream as a producer for `ranks` (default: all), creating it if new. The spec
    /// arguments must match the readers'. `states` lists the readers' saved state texts (any
    /// order; from `Stream.state()` or `feedstore.reshard`): their ranks start where those say,
    /// and a resharded run's producers must pass them. Every rank's states of a run at another
    /// world size are resharded to `world` first, as `feedstore.reshard` does. `start` maps
    /// ranks to the sequence number their readers resume at otherwise. Both apply to ranks the
    /// daemon does not know yet.
    /// `depth` and `batch` apply if the stream is new: samples made ahead of each reader (the
    /// samples it holds included; default 64, or with `batch` the larger of 64 and three
    /// batches: one held, one ready, one being made), and (above 1, at most 1024) tasks
    /// handed out a batch at a time for `put_batch` (`depth` at least `batch`).
    #[new]
    #[pyo3(signature = (name, records, world=1, *, seed=0, shuffle="full", tail="drop",
        epochs=Some(1), ranks=None, start=None, socket=None, depth=None, batch=1, states=None),
        text_signature = "(name, records, world=1, *, seed=0, shuffle='full', tail='drop', \
        epochs=1, ranks=None, start=None, socket=None, depth=None, batch=1, states=None)")]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        name: &str,
        records: u64,
        world: u32,
        seed: u64,
        shuffle: &str,
        tail: &str,
        epochs: Option<u64>,
        ranks: Option<Vec<u32>>,
        start: Option<std::collections::HashMap<u32, u64>>,
        socket: Option<String>,
        depth: Option<u32>,
        batch: u32,
        states: Option<Vec<String>>,
    ) -> PyResult<Writer> {
        let depth = depth.unwrap_or_else(|| default_depth(batch));
        let mut spec = spec(name, records, world, seed, shuffle, tail, epochs)?;
        let ranks = ranks.unwrap_or_else(|| (0..world).collect());
        let mut start = start.unwrap_or_default();
        if let Some(states) = states {
            let texts: Vec<&str> = states.iter().map(String::as_str).collect();
            let (resumed, states, _) = resume(&spec, &texts).map_err(InvalidArgument::new_err)?;
            for state in states {
                start.insert(state.rank, state.seq(&resumed));
            }
            spec = resumed;
        }
        let tasks: Vec<StreamTask> = ranks
            .iter()
            .map(|&rank| {
                spec.check(rank)
                    .map_err(|e| InvalidArgument::new_err(e.to_string()))?;
                Ok(StreamTask {
                    rank,
                    seq: start.get(&rank).copied().unwrap_or(0),
                })
            })
            .collect::<PyResult<_>>()?;
        let socket = socket_path(socket);
        let (client, feeder) = py
            .detach(|| {
                let client = ConnectOptions::new(Role::Writer)
                    .socket(socket)
                    .name(format!("{name} python writer"))
                    .connect()?;
                let feeder = StreamFeeder::join_batched(&client, &spec, depth, batch, &tasks)?;
                Ok::<_, Error>((client, feeder))
            })
            .py_err()?;
        Ok(Writer {
            client,
            feeder,
            idle: Mutex::new(None),
        })
    }

    /// Up to `max` tasks, waiting up to `wait` seconds while every reader's window is full
    /// (an empty list then). None once the stream needs nothing more. A stream made with
    /// `batch=n` hands out whole batches (a rank's `k*n .. k*n+n-1`, consecutive in the list;
    /// the rest of one after a resume inside it), even past `max`. After 5 s of finding no
    /// task it warns once (a `UserWarning`), saying how many readers are attached and how
    /// many samples they hold.
    #[pyo3(signature = (max=16, wait=1.0))]
    fn take(&self, py: Python<'_>, max: u32, wait: f64) -> PyResult<Option<Vec<Task>>> {
        let wait = Duration::try_from_secs_f64(wait).map_err(|_| {
            InvalidArgument::new_err("wait must be a non-negative number of seconds")
        })?;
        let spec = self.feeder.spec();
        let tasks = py.detach(|| self.feeder.take(max, wait)).py_err()?;
        if let Some(tasks) = &tasks {
            self.note_idle(py, tasks.is_empty());
        }
        Ok(tasks.map(|tasks| {
            tasks
                .into_iter()
                .map(|t| Task {
                    rank: t.rank,
                    seq: t.seq,
                    record: spec.record_at(t.rank, t.seq),
                })
                .collect()
        }))
    }

    /// Puts the sample for `task`: a dict (`images`: list of uint8/float16/float32 arrays,
    /// `tokens`, `labels`, `id`, `metadata`, `image_grid_thw`, `layout`), a single image
    /// array, or `bytes` (readers see those as `Sample.data`). Written once into shared
    /// memory and published to the task's rank.
    fn put(&self, py: Python<'_>, task: &Task, item: &Bound<'_, PyAny>) -> PyResult<()> {
        let object = write_item(&self.client, item)?;
        self.deliver(py, task, Made::Written(object))
    }

    /// Puts the samples for `tasks` (one item each, as `put` takes) in one object, image 0 of
    /// each side by side, so a reader's `Stream.next_stacked` hands the batch's images out as
    /// one array with no copy. For a writer made with `batch=n`, whose `take` hands out whole
    /// batches: put each batch's tasks together. Every image 0 must have one shape and dtype,
    /// of a multiple of 64 bytes. Raises for the first task the stream did not take.
    fn put_batch(
        &self,
        py: Python<'_>,
        tasks: Vec<PyRef<'_, Task>>,
        items: Vec<Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        if tasks.len() != items.len() {
            return Err(InvalidArgument::new_err(format!(
                "{} tasks and {} items: one item per task",
                tasks.len(),
                items.len()
            )));
        }
        let (plan, object) = write_batch(&self.client, &items)?;
        let tasks: Vec<(StreamTask, u64)> = tasks
            .iter()
            .map(|t| {
                let task = StreamTask {
                    rank: t.rank,
                    seq: t.seq,
                };
                (task, t.record)
            })
            .collect();
        let results = py
            .detach(|| self.feeder.put_batch(&tasks, &plan, object))
            .py_err()?;
        results.into_iter().try_for_each(|r| r.map_err(to_py))
    }

    /// Reserves an object of `nbytes` on this writer's connection, to fill with
    /// `Reservation.write` and publish with `publish` (`feedstore.ray.write_stream` writes any
    /// Python structure this way).
    fn reserve(&self, py: Python<'_>, nbytes: u64) -> PyResult<Reservation> {
        Reservation::reserve(py, &self.client, nbytes, CreateOptions::default())
    }

    /// Publishes a filled reservation (from this writer's `reserve`) as the sample for `task`.
    fn publish(&self, py: Python<'_>, task: &Task, reservation: &Reservation) -> PyResult<()> {
        let object = reservation.take()?;
        self.deliver(py, task, Made::Written(object))
    }

    /// Marks `task` as impossible (its record is bad): its reader gets `feedstore.SampleFailed`
    /// at that position and goes on.
    fn fail(&self, py: Python<'_>, task: &Task) -> PyResult<()> {
        self.deliver(py, task, Made::Failed)
    }

    /// Closes the stream for everyone (readers see its end).
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.feeder.close()).py_err()
    }
}

impl Writer {
    /// Keeps the idle time of `take`, and warns once per idle spell past
    /// [`WRITER_TELL_AFTER`].
    fn note_idle(&self, py: Python<'_>, empty: bool) {
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        if !empty {
            *idle = None;
            return;
        }
        let (since, told) = idle.get_or_insert((Instant::now(), false));
        if *told || since.elapsed() < WRITER_TELL_AFTER {
            return;
        }
        *told = true;
        let waited = since.elapsed();
        drop(idle);
        let text = self.why_idle(py, waited);
        let warning = py.get_type::<pyo3::exceptions::PyUserWarning>();
        // (Warnings turned into errors must not end the writer's loop.)
        if let Ok(text) = std::ffi::CString::new(text) {
            let _ = PyErr::warn(py, &warning, &text, 1);
        }
    }

    /// What a writer that finds no task waits for, from the daemon's list of streams.
    fn why_idle(&self, py: Python<'_>, waited: Duration) -> String {
        let name = &self.feeder.spec().name;
        let info = py
            .detach(|| self.client.streams())
            .ok()
            .and_then(|list| list.into_iter().find(|s| &s.name == name));
        let head = format!(
            "stream {name:?}: Writer.take found no task for {:.0} s",
            waited.as_secs_f64()
        );
        let Some(info) = info else {
            return format!("{head}, and the daemon no longer lists the stream");
        };
        if info.consumers == 0 {
            return format!(
                "{head}: no reader is attached, and {} samples made wait for one (each \
                 rank's window holds {}); start the readers, or close the writer if they \
                 are done",
                info.ready, info.depth
            );
        }
        format!(
            "{head}: {} of {} ranks have a reader attached, and the windows are full ({} \
             samples made and not returned; {} per rank at most). take() goes on when readers \
             return samples; a reader that stopped before the end of its share holds its \
             window until it closes its stream",
            info.consumers, info.ranks, info.ready, info.depth
        )
    }

    fn deliver(&self, py: Python<'_>, task: &Task, made: Made) -> PyResult<()> {
        let delivery = Delivery {
            task: StreamTask {
                rank: task.rank,
                seq: task.seq,
            },
            record: task.record,
            key: 0,
            made,
        };
        let mut results = py.detach(|| self.feeder.put(vec![delivery])).py_err()?;
        match results.pop() {
            Some(Ok(())) => Ok(()),
            Some(Err(e)) => Err(to_py(e)),
            None => Err(Disconnected::new_err(
                "the daemon answered a put with nothing",
            )),
        }
    }
}
