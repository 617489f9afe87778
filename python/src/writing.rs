//! How Python's bytes get into the store: a [`Reservation`] (`Client.reserve`, or a stream
//! writer's `reserve`: bytes copied in, then sealed), and the object made for a Python item, as
//! it is (bytes) or as a sample (a dict of arrays and values, or an array), alone or as a batch.
//! A leaf below the client and the stream writer, which both write through it.

use std::sync::Mutex;

use feedstore_consumer::{Client, CreateOptions, ObjectWriter};
use feedstore_proto::sample::{
    BatchPlan, DType, KeyValue, SampleInfo, SamplePlan, SampleRegions, TensorLayout,
};
use numpy::{PyUntypedArray, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBytes, PyDict, PyMemoryView};

use crate::errors::{IntoPy, InvalidArgument};

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
        client: &Client,
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
        let (view, src, len) = bytes_of(py, data)?;
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
                // SAFETY: `src` is `len` readable bytes that stay where they are until `view`
                // drops after this call (`bytes_of`); `dst` is `len` bytes of this
                // reservation, writable by this connection alone, and no Python buffer views
                // it, so the two cannot overlap. (A raw copy, not a slice over `src`: another
                // Python thread may write the source meanwhile, which tears the copy but
                // reads no memory outside it.)
                unsafe {
                    std::ptr::copy_nonoverlapping(src as *const u8, dst.as_mut_ptr(), len);
                }
                Ok(())
            })
        };
        let result = if len >= DETACHED_COPY_BYTES {
            py.detach(copy)
        } else {
            copy()
        };
        drop(view);
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

/// `numpy.frombuffer`, looked up once.
static FROMBUFFER: PyOnceLock<Py<PyAny>> = PyOnceLock::new();

/// The bytes of a buffer of bytes (bytes, bytearray, memoryview, array.array, a uint8 numpy
/// array; C-contiguous): a memoryview over it, which holds the buffer's export for as long as
/// it lives (the memory cannot move or go: a bytearray with an export cannot be resized), and
/// the address and length of its bytes. The address comes through numpy, since the stable ABI
/// (abi3) has no buffer protocol before CPython 3.11.
fn bytes_of<'py>(
    py: Python<'py>,
    data: &Bound<'py, PyAny>,
) -> PyResult<(Bound<'py, PyMemoryView>, usize, usize)> {
    let not_bytes = |why: String| {
        InvalidArgument::new_err(format!("write takes a buffer of bytes (uint8): {why}"))
    };
    let view = PyMemoryView::from(data).map_err(|e| not_bytes(e.to_string()))?;
    let format: String = view.getattr("format")?.extract()?;
    if !matches!(format.as_str(), "B" | "b" | "c") {
        return Err(not_bytes(format!("its items have format '{format}'")));
    }
    if !view.getattr("c_contiguous")?.is_truthy()? {
        return Err(InvalidArgument::new_err(
            "write takes a C-contiguous buffer (use numpy.ascontiguousarray)",
        ));
    }
    let len: usize = view.getattr("nbytes")?.extract()?;
    if len == 0 {
        return Ok((view, 0, 0));
    }
    let frombuffer = FROMBUFFER.get_or_try_init(py, || {
        PyResult::Ok(py.import("numpy")?.getattr("frombuffer")?.unbind())
    })?;
    let array = frombuffer.bind(py).call1((&view, "uint8"))?;
    let array = array.cast::<PyUntypedArray>()?;
    // SAFETY: a live ndarray object over the view's bytes; reading its data pointer.
    let src = unsafe { (*array.as_array_ptr()).fields.data } as usize;
    Ok((view, src, len))
}

/// An array's bytes, dtype and shape (C-contiguous arrays only: they are copied as they lie).
fn array_parts<'a>(array: &'a Bound<'_, PyAny>) -> PyResult<(DType, Vec<u32>, &'a [u8])> {
    let array = array.cast::<PyUntypedArray>().map_err(|_| {
        InvalidArgument::new_err("images must be numpy arrays (uint8, float16 or float32)")
    })?;
    if !array.is_c_contiguous() {
        return Err(InvalidArgument::new_err(
            "image arrays must be C-contiguous (use numpy.ascontiguousarray)",
        ));
    }
    let name: String = array.dtype().str()?.to_string();
    let dtype = match name.as_str() {
        "uint8" => DType::U8,
        "float16" => DType::F16,
        "float32" => DType::F32,
        other => {
            return Err(InvalidArgument::new_err(format!(
                "image dtype {other} is not uint8, float16 or float32"
            )));
        }
    };
    let shape = array
        .shape()
        .iter()
        .map(|&d| u32::try_from(d).map_err(|_| InvalidArgument::new_err("dimension too large")))
        .collect::<PyResult<Vec<u32>>>()?;
    let len = array.len() * dtype.size_bytes() as usize;
    // SAFETY: a live, C-contiguous array of `len` bytes; the borrow lives as long as `array`,
    // and the caller holds the GIL for the copy (no Python code runs meanwhile).
    let data = unsafe { (*array.as_array_ptr()).fields.data };
    // SAFETY: as above: `len` readable bytes at `data`.
    let bytes = unsafe { std::slice::from_raw_parts(data as *const u8, len) };
    Ok((dtype, shape, bytes))
}

/// A sample dict (`images`, `tokens`, `labels`, `id`, `metadata`, `image_grid_thw`,
/// `layout`) or a single image array, read and checked, not yet written.
struct PySample<'py> {
    info: SampleInfo,
    images: Vec<Bound<'py, PyAny>>,
    layout: TensorLayout,
    tokens: Vec<u32>,
    labels: Vec<i32>,
}

impl<'py> PySample<'py> {
    fn parse(item: &Bound<'py, PyAny>) -> PyResult<PySample<'py>> {
        let dict = item.cast::<PyDict>().ok();
        let get = |key: &str| -> PyResult<Option<Bound<'_, PyAny>>> {
            match &dict {
                Some(d) => d.get_item(key),
                None => Ok(None),
            }
        };
        let images: Vec<Bound<'_, PyAny>> = match &dict {
            Some(_) => match get("images")? {
                Some(list) => list.extract()?,
                None => Vec::new(),
            },
            None => vec![item.clone()],
        };
        let layout = match get("layout")?
            .map(|l| l.extract::<String>())
            .transpose()?
            .as_deref()
        {
            None | Some("hwc") => TensorLayout::Hwc,
            Some("chw") => TensorLayout::Chw,
            Some(other) => {
                return Err(InvalidArgument::new_err(format!(
                    "layout {other:?}: expected \"hwc\" or \"chw\""
                )));
            }
        };
        let tokens: Vec<u32> = get("tokens")?
            .map(|t| t.extract())
            .transpose()?
            .unwrap_or_default();
        let labels: Vec<i32> = match get("labels")? {
            Some(l) => l.extract()?,
            None => vec![feedstore_proto::sample::IGNORE_INDEX; tokens.len()],
        };
        if labels.len() != tokens.len() {
            return Err(InvalidArgument::new_err(format!(
                "{} labels for {} tokens",
                labels.len(),
                tokens.len()
            )));
        }
        let metadata: Vec<(String, String)> = match get("metadata")? {
            Some(m) => m
                .cast::<PyDict>()
                .map_err(|_| InvalidArgument::new_err("metadata must be a dict of str to str"))?
                .items()
                .extract()?,
            None => Vec::new(),
        };
        let info = SampleInfo {
            id: get("id")?
                .map(|i| i.extract())
                .transpose()?
                .unwrap_or_default(),
            source_keys: get("source_keys")?
                .map(|k| k.extract())
                .transpose()?
                .unwrap_or_default(),
            image_grid_thw: get("image_grid_thw")?
                .map(|g| g.extract())
                .transpose()?
                .unwrap_or_default(),
            metadata: metadata
                .into_iter()
                .map(|(key, value)| KeyValue { key, value })
                .collect(),
        };
        Ok(PySample {
            info,
            images,
            layout,
            tokens,
            labels,
        })
    }

    /// Its layout as an object of its own.
    fn plan(&self) -> PyResult<SamplePlan> {
        let mut plan = SamplePlan::new();
        for image in &self.images {
            let (dtype, shape, _) = array_parts(image)?;
            plan.add_image(dtype, self.layout, &shape);
        }
        plan.set_token_count(self.tokens.len());
        Ok(plan)
    }

    /// Copies its arrays into the regions planned for it.
    fn fill(&self, regions: SampleRegions<'_>) -> PyResult<()> {
        for (image, region) in self.images.iter().zip(regions.images) {
            region.copy_from_slice(array_parts(image)?.2);
        }
        regions.tokens.copy_from_slice(&self.tokens);
        regions.labels.copy_from_slice(&self.labels);
        Ok(())
    }
}

/// Writes a sample dict or a single image array (see [`PySample`]) into a fresh reservation.
fn write_sample(client: &Client, item: &Bound<'_, PyAny>) -> PyResult<ObjectWriter> {
    let sample = PySample::parse(item)?;
    let plan = sample.plan()?;
    let mut object = client.create(plan.object_bytes(&sample.info)).py_err()?;
    let regions = plan
        .regions(object.as_mut_slice())
        .map_err(|e| crate::errors::invalid_sample(&e))?;
    sample.fill(regions)?;
    plan.finish(object.as_mut_slice(), &sample.info)
        .map_err(|e| crate::errors::invalid_sample(&e))?;
    Ok(object)
}

/// Writes samples (dicts or arrays, as [`write_sample`]) into one fresh reservation, image 0
/// of each side by side ([`BatchPlan`]).
pub fn write_batch(
    client: &Client,
    items: &[Bound<'_, PyAny>],
) -> PyResult<(BatchPlan, ObjectWriter)> {
    let samples = items
        .iter()
        .map(PySample::parse)
        .collect::<PyResult<Vec<_>>>()?;
    let plans = samples
        .iter()
        .map(PySample::plan)
        .collect::<PyResult<Vec<_>>>()?;
    let infos: Vec<SampleInfo> = samples.iter().map(|s| s.info.clone()).collect();
    let plan = BatchPlan::new(plans, &infos).map_err(|e| crate::errors::invalid_sample(&e))?;
    let mut object = client.create(plan.object_bytes()).py_err()?;
    for (i, sample) in samples.iter().enumerate() {
        let regions = plan
            .regions(object.as_mut_slice(), i)
            .map_err(|e| crate::errors::invalid_sample(&e))?;
        sample.fill(regions)?;
        plan.finish(object.as_mut_slice(), i, &sample.info)
            .map_err(|e| crate::errors::invalid_sample(&e))?;
    }
    Ok((plan, object))
}

/// Writes raw bytes into a fresh reservation.
pub fn write_bytes(client: &Client, bytes: &[u8]) -> PyResult<ObjectWriter> {
    if bytes.is_empty() {
        return Err(InvalidArgument::new_err(
            "an object needs at least one byte",
        ));
    }
    let mut object = client.create(bytes.len() as u64).py_err()?;
    object.as_mut_slice().copy_from_slice(bytes);
    Ok(object)
}

/// An object for `item`: bytes as they are; a dict or an array as a sample.
pub fn write_item(client: &Client, item: &Bound<'_, PyAny>) -> PyResult<ObjectWriter> {
    match item.cast::<PyBytes>() {
        Ok(bytes) => write_bytes(client, bytes.as_bytes()),
        Err(_) => write_sample(client, item),
    }
}
