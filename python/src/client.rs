//! A plain client: put objects, get them by handle, read the store's statistics.

use std::sync::Mutex;
use std::time::Duration;

use feedstore_consumer::{
    Client as RustClient, ConnectOptions, CreateOptions, Handle, ObjectWriter, Role, Status,
};
use pyo3::buffer::PyBuffer;
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

/// Copies of this size and above run without the GIL.
const DETACHED_COPY_BYTES: usize = 64 << 10;

/// A reserved, unsealed object (`Client.reserve`): invisible to every other client until
/// `seal`, given back to the store if dropped unsealed (or if this process dies). Python code
/// never holds a writable view of it: bytes go in through `write`, which copies them.
#[pyclass(module = "feedstore", frozen)]
pub struct Reservation {
    object: Mutex<Option<ObjectWriter>>,
}

impl Reservation {
    /// A reservation of `nbytes` from `client`; `pin`: never evicted once sealed (only
    /// deleted).
    pub fn reserve(
        py: Python<'_>,
        client: &RustClient,
        nbytes: u64,
        options: CreateOptions,
    ) -> PyResult<Reservation> {
        if nbytes == 0 {
            return Err(InvalidArgument::new_err(
                "an object needs at least one byte",
            ));
        }
        let object = py.detach(|| client.create_with(nbytes, options)).py_err()?;
        Ok(Reservation {
            object: Mutex::new(Some(object)),
        })
    }

    /// The unsealed object, taken out (the reservation is spent).
    pub fn take(&self) -> PyResult<ObjectWriter> {
        let object = self.object.lock().unwrap_or_else(|e| e.into_inner()).take();
        object.ok_or_else(|| {
            InvalidArgument::new_err("this reservation was already sealed or given back")
        })
    }

    fn with<T>(&self, f: impl FnOnce(&mut ObjectWriter) -> PyResult<T>) -> PyResult<T> {
        let mut object = self.object.lock().unwrap_or_else(|e| e.into_inner());
        match object.as_mut() {
            Some(object) => f(object),
            None => Err(InvalidArgument::new_err(
                "this reservation was already sealed or given back",
            )),
        }
    }
}

#[pymethods]
impl Reservation {
    /// Copies `data` (bytes, a bytearray, a C-contiguous uint8 numpy array or memoryview) into
    /// the object at byte `offset`.
    fn write(&self, py: Python<'_>, offset: usize, data: &Bound<'_, PyAny>) -> PyResult<()> {
        let buffer = PyBuffer::<u8>::get(data).map_err(|e| {
            InvalidArgument::new_err(format!("write takes a buffer of bytes (uint8): {e}"))
        })?;
        if !buffer.is_c_contiguous() {
            return Err(InvalidArgument::new_err(
                "write takes a C-contiguous buffer (use numpy.ascontiguousarray)",
            ));
        }
        let len = buffer.len_bytes();
        let src = buffer.buf_ptr() as usize;
        let copy = || {
            // The lock is taken where the copy runs: a large copy runs without the GIL, and a
            // thread holding the lock never waits for the GIL (another thread waiting for the
            // lock with the GIL would otherwise deadlock with it).
            self.with(|object| {
                let size = object.len();
                let Some(dst) = offset
                    .checked_add(len)
                    .filter(|&end| end <= size)
                    .map(|end| &mut object.as_mut_slice()[offset..end])
                else {
                    return Err(InvalidArgument::new_err(format!(
                        "{len} bytes at offset {offset} do not fit an object of {size} bytes"
                    )));
                };
                // SAFETY: `buffer` is a C-contiguous export of `len` bytes, kept alive (and its
                // memory with it, unresizable) until `buffer` drops after this call; `dst` is
                // `len` bytes of this reservation, writable by this connection alone, and no
                // Python buffer views it, so the two cannot overlap.
                let src = unsafe { std::slice::from_raw_parts(src as *const u8, len) };
                dst.copy_from_slice(src);
                Ok(())
            })
        };
        let result = if len >= DETACHED_COPY_BYTES {
            py.detach(copy)
        } else {
            copy()
        };
        drop(buffer);
        result
    }

    /// The handle the object will have once sealed, as text (nobody can get it before).
    #[getter]
    fn handle(&self) -> PyResult<String> {
        self.with(|object| Ok(object.handle().to_string()))
    }

    /// The object's size in bytes.
    fn __len__(&self) -> PyResult<usize> {
        self.with(|object| Ok(object.len()))
    }

    /// Publishes the object and returns its handle, as text. Readers see every byte written.
    fn seal(&self, py: Python<'_>) -> PyResult<String> {
        let object = self.take()?;
        let handle = py.detach(|| object.seal()).py_err()?;
        Ok(handle.to_string())
    }

    /// Gives the space back unsealed (also done when the reservation is dropped).
    fn abort(&self, py: Python<'_>) -> PyResult<()> {
        let object = self.object.lock().unwrap_or_else(|e| e.into_inner()).take();
        match object {
            Some(object) => py.detach(|| object.abort()).py_err(),
            None => Ok(()),
        }
    }
}
