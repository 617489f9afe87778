//! The one place Rust errors become Python exceptions.
//!
//! Every exception derives from `feedstore.FeedstoreError`; each also derives from the builtin a
//! Python caller would reach for first (`TimeoutError`, `ConnectionError`, `KeyError`,
//! `ValueError`, `MemoryError`, `PermissionError`, `RuntimeError`), so generic handlers keep
//! working.

use feedstore_consumer::Error;
use feedstore_proto::error_chain as message;
use feedstore_proto::sample::SampleError;
use pyo3::exceptions::{
    PyConnectionError, PyException, PyIOError, PyKeyError, PyMemoryError, PyPermissionError,
    PyRuntimeError, PyTimeoutError, PyValueError,
};
use pyo3::prelude::*;
use pyo3::types::PyTuple;

pyo3::create_exception!(
    feedstore,
    FeedstoreError,
    PyException,
    "Base class of every feedstore error."
);

/// Defines `feedstore.<name>(FeedstoreError, <builtin>)`, created once per interpreter.
macro_rules! exception {
    ($name:ident, $builtin:ty, $doc:literal) => {
        #[doc = $doc]
        pub struct $name;

        impl $name {
            pub fn type_object(py: Python<'_>) -> &Bound<'_, pyo3::types::PyType> {
                static TYPE: pyo3::sync::PyOnceLock<Py<pyo3::types::PyType>> =
                    pyo3::sync::PyOnceLock::new();
                TYPE.get_or_init(py, || {
                    derived(py, stringify!($name), $doc, &py.get_type::<$builtin>())
                })
                .bind(py)
            }

            pub fn new_err(message: impl Into<String>) -> PyErr {
                let message = message.into();
                Python::attach(|py| {
                    PyErr::from_value(
                        Self::type_object(py)
                            .call1((message,))
                            .expect("constructing a feedstore exception"),
                    )
                })
            }
        }
    };
}

/// A new exception class deriving from `FeedstoreError` and `builtin`.
fn derived(
    py: Python<'_>,
    name: &str,
    doc: &str,
    builtin: &Bound<'_, pyo3::types::PyType>,
) -> Py<pyo3::types::PyType> {
    let bases = PyTuple::new(py, [py.get_type::<FeedstoreError>(), builtin.clone()])
        .expect("a tuple of two types");
    let namespace = pyo3::types::PyDict::new(py);
    namespace
        .set_item("__doc__", doc)
        .and_then(|()| namespace.set_item("__module__", "feedstore"))
        .expect("setting class attributes");
    py.get_type::<pyo3::types::PyType>()
        .call1((name, bases, namespace))
        .and_then(|t| Ok(t.cast_into::<pyo3::types::PyType>()?.unbind()))
        .expect("creating an exception class")
}

exception!(
    ConnectError,
    PyConnectionError,
    "No feedstored answers on the socket (is the daemon running?)."
);
exception!(
    Disconnected,
    PyConnectionError,
    "The daemon went away; reconnect (handles from before a restart are stale)."
);
exception!(
    NotFound,
    PyKeyError,
    "No live object has this handle (deleted, evicted, stale or another node's)."
);
exception!(
    Full,
    PyMemoryError,
    "The store has no room for the object within the timeout: retry later."
);
exception!(
    TooLarge,
    PyValueError,
    "The object is larger than any segment: it can never fit, so retrying will not help."
);
exception!(
    LimitReached,
    PyMemoryError,
    "A limit the daemon's operator set was reached (connections, streams, leases); the message names the setting."
);
exception!(
    Timeout,
    PyTimeoutError,
    "Nothing arrived within the wait (are producers running?)."
);
exception!(
    StreamMismatch,
    PyValueError,
    "The stream exists with another spec, or the saved state is another stream's or rank's."
);
exception!(
    RankInUse,
    PyRuntimeError,
    "The stream rank already has a consumer (another process reads it, or a dead one's connection is not closed yet)."
);
exception!(
    SampleFailed,
    PyValueError,
    "No good record could stand in for this position; the stream goes on with the next."
);
exception!(
    WindowFull,
    PyMemoryError,
    "This rank holds its whole prefetch depth: drop some samples to read on."
);
exception!(
    Unreachable,
    PyConnectionError,
    "The node owning a handle could not be reached (no peer has its node id, or its daemon went away mid-transfer)."
);
exception!(
    Corrupt,
    PyIOError,
    "An object's bytes are not what they claim: a pull that failed its authentication (nothing \
was handed out), or a batch object whose structure does not parse."
);
exception!(
    UntrustedBatch,
    PyPermissionError,
    "A batch object this reader will not read: written by a uid it does not trust, holding a \
class it was not told to accept, or in the pickled format of an earlier release."
);
exception!(
    InvalidSample,
    PyValueError,
    "An object is not a valid feedstore sample."
);
exception!(
    PermissionDenied,
    PyPermissionError,
    "This connection may not do that, or the socket is served by an untrusted uid."
);
exception!(
    InvalidArgument,
    PyValueError,
    "An argument is out of range or malformed."
);

/// Adds the exception classes to the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("FeedstoreError", py.get_type::<FeedstoreError>())?;
    m.add("ConnectError", ConnectError::type_object(py))?;
    m.add("Disconnected", Disconnected::type_object(py))?;
    m.add("NotFound", NotFound::type_object(py))?;
    m.add("Full", Full::type_object(py))?;
    m.add("TooLarge", TooLarge::type_object(py))?;
    m.add("LimitReached", LimitReached::type_object(py))?;
    m.add("Timeout", Timeout::type_object(py))?;
    m.add("Unreachable", Unreachable::type_object(py))?;
    m.add("Corrupt", Corrupt::type_object(py))?;
    m.add("UntrustedBatch", UntrustedBatch::type_object(py))?;
    m.add("StreamMismatch", StreamMismatch::type_object(py))?;
    m.add("RankInUse", RankInUse::type_object(py))?;
    m.add("SampleFailed", SampleFailed::type_object(py))?;
    m.add("WindowFull", WindowFull::type_object(py))?;
    m.add("InvalidSample", InvalidSample::type_object(py))?;
    m.add("PermissionDenied", PermissionDenied::type_object(py))?;
    m.add("InvalidArgument", InvalidArgument::type_object(py))?;
    Ok(())
}

/// A client error as the matching Python exception.
pub fn to_py(e: Error) -> PyErr {
    let text = message(&e);
    match e {
        // The hint names the CLI's flag; Python callers pass `socket=`.
        Error::Connect { .. } => {
            ConnectError::new_err(text.replace("pass --socket", "pass socket="))
        }
        Error::VersionMismatch { .. } => ConnectError::new_err(text),
        Error::Disconnected { .. } | Error::ShuttingDown => Disconnected::new_err(text),
        Error::NotFound { .. } | Error::Stale { .. } | Error::WrongNode { .. } => {
            NotFound::new_err(text)
        }
        Error::Full { .. } => Full::new_err(text),
        Error::TooLarge { .. } => TooLarge::new_err(text),
        Error::LimitReached(_) => LimitReached::new_err(text),
        Error::Timeout(_) => Timeout::new_err(text),
        Error::Unreachable { .. } => Unreachable::new_err(text),
        Error::Corrupt { .. } => Corrupt::new_err(text),
        Error::StreamMismatch(_) => StreamMismatch::new_err(text),
        Error::RankInUse(_) => RankInUse::new_err(text),
        Error::SampleFailed { .. } => SampleFailed::new_err(text),
        Error::WindowFull { .. } => WindowFull::new_err(text),
        Error::PermissionDenied { .. } | Error::UntrustedDaemon { .. } => {
            PermissionDenied::new_err(text)
        }
        Error::InvalidArgument(_) | Error::Encode(_) => InvalidArgument::new_err(text),
        _ => FeedstoreError::new_err(text),
    }
}

/// A sample that fails validation.
pub fn invalid_sample(e: &SampleError) -> PyErr {
    InvalidSample::new_err(format!("not a valid sample: {}", message(e)))
}

/// Extension for `?` on client results.
pub trait IntoPy<T> {
    /// The result with its error as a Python exception.
    fn py_err(self) -> PyResult<T>;
}

impl<T> IntoPy<T> for Result<T, Error> {
    fn py_err(self) -> PyResult<T> {
        self.map_err(to_py)
    }
}
