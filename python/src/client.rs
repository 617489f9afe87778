//! A plain client: put objects, get them by handle, read the store's statistics.

use feedstore_consumer::{Client as RustClient, ConnectOptions, Handle, Role};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::{IntoPy, InvalidArgument};
use crate::sample::Sample;
use crate::stream::write_item;

/// A connection to the node's feedstored. `writer=True` may put objects; a reader maps the
/// store read-only.
#[pyclass(module = "feedstore", frozen)]
pub struct Client {
    inner: RustClient,
}

fn handle(text: &str) -> PyResult<Handle> {
    text.parse()
        .map_err(|_| InvalidArgument::new_err(format!("{text:?} is not a feedstore handle")))
}

#[pymethods]
impl Client {
    /// Connects to the daemon at `socket` (default: `$FEEDSTORE_SOCKET`, else this user's
    /// daemon, else the system daemon's).
    #[new]
    #[pyo3(signature = (socket=None, *, writer=false, name=None))]
    fn new(
        py: Python<'_>,
        socket: Option<String>,
        writer: bool,
        name: Option<String>,
    ) -> PyResult<Client> {
        let role = if writer { Role::Writer } else { Role::Reader };
        let mut options = ConnectOptions::new(role);
        if let Some(socket) = socket {
            options = options.socket(socket);
        }
        if let Some(name) = name {
            options = options.name(name);
        }
        let inner = py.detach(|| options.connect()).py_err()?;
        Ok(Client { inner })
    }

    /// Writes `item` once into shared memory and seals it: `bytes` as they are, a numpy array
    /// or a sample dict (see `Writer.put`) as a sample. Returns the handle, as text.
    fn put(&self, py: Python<'_>, item: &Bound<'_, PyAny>) -> PyResult<String> {
        let object = write_item(&self.inner, item)?;
        let handle = py.detach(|| object.seal()).py_err()?;
        Ok(handle.to_string())
    }

    /// The object with this handle, leased until the returned `Sample` and every array made
    /// from it are gone.
    fn get(&self, py: Python<'_>, handle: &str) -> PyResult<Sample> {
        let handle = self::handle(handle)?;
        py.detach(|| self.inner.get(handle).map(Sample::from_lease))
            .py_err()
    }

    /// Deletes an object (once its leases are returned).
    fn delete(&self, py: Python<'_>, handle: &str) -> PyResult<()> {
        let handle = self::handle(handle)?;
        py.detach(|| self.inner.delete(handle)).py_err()
    }

    /// The store's counters (bytes, objects, leases, clients, streams, cache), as a dict.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let stats = py.detach(|| self.inner.stats()).py_err()?;
        let dict = PyDict::new(py);
        for (name, value) in stats.named() {
            dict.set_item(name, value)?;
        }
        Ok(dict)
    }

    /// Returns dropped leases to the daemon now (otherwise within a millisecond).
    fn flush(&self) {
        self.inner.flush_releases();
    }
}
