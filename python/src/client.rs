//! A plain client: put objects, get them by handle, read the store's statistics.

use std::time::Duration;

use feedstore_consumer::{
    Client as RustClient, ConnectOptions, CreateOptions, Handle, Role, Status,
};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::{IntoPy, InvalidArgument};
use crate::sample::Sample;
use crate::writing::{Reservation, write_item};

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

    /// Reserves a writable object of `nbytes` bytes (waiting for space up to `timeout`
    /// seconds, by default the connection's create timeout; 0: `Full` at once), for writing in
    /// pieces with `Reservation.write` and publishing with `seal`. `pin=True`: the sealed object
    /// is never evicted, only deleted.
    #[pyo3(signature = (nbytes, *, pin=false, timeout=None))]
    fn reserve(
        &self,
        py: Python<'_>,
        nbytes: u64,
        pin: bool,
        timeout: Option<f64>,
    ) -> PyResult<Reservation> {
        let timeout = timeout
            .map(|t| {
                Duration::try_from_secs_f64(t).map_err(|_| {
                    InvalidArgument::new_err(format!("timeout={t}: expected seconds >= 0"))
                })
            })
            .transpose()?;
        Reservation::reserve(py, &self.inner, nbytes, CreateOptions { timeout, pin })
    }

    /// Looks keys (ints below 2**128, not 0) up in the daemon's decode-once cache: per key, the
    /// handle of the object this uid filed under it (`cache_insert`, or a producer's put), or
    /// None. A handle found can still be evicted before `get` (which then raises `NotFound`).
    fn cache_lookup(&self, py: Python<'_>, keys: Vec<u128>) -> PyResult<Vec<Option<String>>> {
        let found = py.detach(|| self.inner.cache_lookup(&keys)).py_err()?;
        Ok(found
            .into_iter()
            .map(|h| h.map(|h| h.to_string()))
            .collect())
    }

    /// Files sealed objects in the daemon's decode-once cache: `entries` are (key, handle)
    /// pairs, keys ints below 2**128 and not 0. Per entry, whether it was filed (not: the
    /// object is gone, the key already names another live object, or the cache holds as many
    /// entries as it may). An entry lasts as long as its object; an object not pinned stays
    /// evictable. Writers only.
    fn cache_insert(&self, py: Python<'_>, entries: Vec<(u128, String)>) -> PyResult<Vec<bool>> {
        let entries = entries
            .iter()
            .map(|(key, text)| Ok((*key, handle(text)?)))
            .collect::<PyResult<Vec<_>>>()?;
        let filed = py.detach(|| self.inner.cache_insert(&entries)).py_err()?;
        Ok(filed.iter().map(|&s| s == Status::Ok).collect())
    }

    /// The object with this handle, leased until the returned `Sample` and every array made
    /// from it are gone. `prefault=True` also builds this process's page tables of it now, so
    /// the first read of it takes no page faults (for a thread that takes objects ahead of the
    /// one that reads them; the cost is the faults', on this call).
    /// `private=True` gives it as `Sample.private()` does: writable, copy-on-write.
    #[pyo3(signature = (handle, *, prefault = false, private = false))]
    fn get(&self, py: Python<'_>, handle: &str, prefault: bool, private: bool) -> PyResult<Sample> {
        let handle = self::handle(handle)?;
        py.detach(|| {
            let lease = self.inner.get(handle).py_err()?;
            if prefault && !private {
                lease.prefault();
            }
            let sample = Sample::from_lease(lease);
            if private {
                return sample.private_view(prefault);
            }
            Ok(sample)
        })
    }

    /// Whether `handle` names an object of this node's daemon from before the one this client
    /// talks to now (it went away, and the client reconnected): that object went with it.
    fn predates(&self, handle: &str) -> PyResult<bool> {
        Ok(self.inner.predates(self::handle(handle)?))
    }

    /// How many times this client reconnected after its daemon went away (with
    /// `FEEDSTORE_RECONNECT_TIMEOUT` set).
    #[getter]
    fn reconnects(&self) -> u64 {
        self.inner.reconnects()
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
