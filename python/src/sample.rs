//! Samples as Python objects whose arrays point into the shared-memory mapping.
//!
//! The ownership chain, as in arrow-rs: a [`Sample`] owns an `Arc<Held>` (a stream sample or
//! the lease on the object). Every numpy array it hands out has the `Sample` as its `base`, and
//! every DLPack capsule carries its own clone of the `Arc`. The object goes back to the store when
//! the last of them is gone, whichever that is. Arrays over the store's mapping are created
//! without `NPY_ARRAY_WRITEABLE` (the mapping is `PROT_READ`: a write would fault), so a write
//! raises `ValueError: assignment destination is read-only`. `Sample.private()` gives the same
//! object through a copy-on-write mapping of this process's own (`Held::Private`), whose
//! arrays and tensors are writable: a write copies the page it touches, and nobody else sees it.

use std::collections::BTreeMap;
use std::ffi::{c_int, c_void};
use std::sync::Arc;

use feedstore_consumer::{Lease, StreamSample};
use feedstore_proto::sample::{
    AlignedBuf, DType, SampleError, SampleView, TensorLayout, side_by_side,
};
use feedstore_shm::PrivateBytes;
use numpy::npyffi::{self, NPY_TYPES, PY_ARRAY_API, npy_intp};
use numpy::{PyArrayDescrMethods, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};

use crate::errors::{InvalidArgument, invalid_sample};

/// What keeps an object readable: a stream sample or a lease from `Client.get`, each holding
/// its own lease on the object.
pub enum Held {
    /// A sample from a stream (returned to the stream when dropped).
    Stream(StreamSample),
    /// A leased object (released when dropped).
    Lease(Lease),
    /// Memory of this process (a batch `Stream.next_stacked` had to stack by copying).
    Owned(AlignedBuf),
    /// A private copy-on-write view of another (`Sample.private()`), which it keeps alive:
    /// writable, its writes seen by nobody else.
    Private(PrivateBytes<Arc<Held>>),
}

impl Held {
    /// The bytes. Of a private view, as its users write them through arrays and tensors
    /// (possibly from another thread meanwhile): read them for parsing before any pointer is
    /// handed out, or copy out what is read, as the batch decoder does.
    fn bytes(&self) -> &[u8] {
        match self {
            Held::Stream(s) => s,
            Held::Lease(l) => l,
            Held::Owned(b) => b.as_slice(),
            // SAFETY: reads of memory this process's own code may write concurrently: the
            // bytes stay mapped and valid (the view owns its mapping); what a racing write
            // leaves is bytes the readers validate or copy, as those of shared memory.
            Held::Private(p) => unsafe { p.bytes() },
        }
    }

    /// The length in bytes, without making a slice of them.
    fn len(&self) -> usize {
        match self {
            Held::Private(p) => p.len(),
            held => held.bytes().len(),
        }
    }

    /// The first byte's address, without making a slice of the bytes.
    fn ptr(&self) -> *const u8 {
        match self {
            Held::Private(p) => p.as_ptr(),
            held => held.bytes().as_ptr(),
        }
    }

    /// Whether arrays and tensors over it may be written.
    fn writable(&self) -> bool {
        matches!(self, Held::Private(_) | Held::Owned(_))
    }

    /// The uid that wrote the object, as the daemon recorded it; `None` for memory of this
    /// process.
    fn writer(&self) -> Option<u32> {
        match self {
            Held::Stream(s) => Some(s.writer()),
            Held::Lease(l) => Some(l.writer()),
            Held::Owned(_) => None,
            Held::Private(p) => p.keep().writer(),
        }
    }

    /// A private, writable view of `held`'s object (`Sample.private()`): copy-on-write over
    /// the store's pages for an object in shared memory, a copy for memory of this process.
    fn private(held: &Arc<Held>, populate: bool) -> PyResult<Held> {
        let err = |e: feedstore_consumer::Error| crate::errors::to_py(e);
        match &**held {
            Held::Stream(s) => Ok(Held::Private(
                // SAFETY: the view keeps `held`, which owns the sample, so the object stays
                // leased for the view's life (the view unmaps before it drops `keep`).
                unsafe { s.private_view(held.clone(), populate) }.map_err(err)?,
            )),
            Held::Lease(l) => Ok(Held::Private(
                // SAFETY: as above, `held` owning the lease.
                unsafe { l.private_view(held.clone(), populate) }.map_err(err)?,
            )),
            Held::Owned(b) => {
                let mut copy = AlignedBuf::zeroed(b.as_slice().len());
                copy.as_mut_slice().copy_from_slice(b.as_slice());
                Ok(Held::Owned(copy))
            }
            // A fresh view of the object, without this view's writes.
            Held::Private(p) => Held::private(p.keep(), populate),
        }
    }
}

/// One tensor of a sample: where it lies in the object and what it holds.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    offset: usize,
    len: usize,
    dtype: DType,
    layout: TensorLayout,
    shape: Vec<usize>,
}

impl TensorInfo {
    fn of(
        base: &[u8],
        bytes: &[u8],
        dtype: DType,
        layout: TensorLayout,
        shape: Vec<usize>,
    ) -> Self {
        TensorInfo {
            offset: bytes.as_ptr() as usize - base.as_ptr() as usize,
            len: bytes.len(),
            dtype,
            layout,
            shape,
        }
    }

    /// Bytes of this tensor.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Its shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Its dtype.
    pub fn dtype(&self) -> DType {
        self.dtype
    }
}

/// The parts of a validated sample, located once (validation walks the whole archive).
struct Parsed {
    id: String,
    source_keys: Vec<String>,
    images: Vec<TensorInfo>,
    grids: Vec<[u32; 3]>,
    tokens: TensorInfo,
    labels: TensorInfo,
    metadata: Vec<(String, String)>,
}

fn parse(bytes: &[u8]) -> Result<Parsed, SampleError> {
    let view = SampleView::new(bytes)?;
    let images = (0..view.image_count())
        .map(|i| {
            let t = view.image(i).expect("index below image_count");
            TensorInfo::of(bytes, t.bytes(), t.dtype(), t.layout(), t.shape())
        })
        .collect();
    let tokens = view.tokens();
    let labels = view.labels();
    let flat = |b: &[u8], n: usize| TensorInfo::of(bytes, b, DType::U8, TensorLayout::Hwc, vec![n]);
    Ok(Parsed {
        id: view.id().to_owned(),
        source_keys: view.source_keys().map(str::to_owned).collect(),
        grids: (0..view.image_count())
            .filter_map(|i| view.image_grid_thw(i))
            .collect(),
        images,
        tokens: flat(bytemuck_bytes(tokens), tokens.len()),
        labels: flat(bytemuck_bytes(labels), labels.len()),
        metadata: view
            .metadata_entries()
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect(),
    })
}

fn bytemuck_bytes<T>(s: &[T]) -> &[u8] {
    // SAFETY: plain integers viewed as their bytes: same memory, same lifetime, any alignment.
    unsafe { std::slice::from_raw_parts(s.as_ptr().cast(), std::mem::size_of_val(s)) }
}

/// Element types as the arrays see them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Elem {
    U8,
    U32,
    I32,
    F16,
    /// numpy has no bfloat16: arrays show the raw bits as uint16; DLPack says bfloat16.
    BF16,
    F32,
}

impl Elem {
    fn of(dtype: DType) -> Elem {
        match dtype {
            DType::U8 => Elem::U8,
            DType::F16 => Elem::F16,
            DType::BF16 => Elem::BF16,
            DType::F32 => Elem::F32,
        }
    }

    fn size(self) -> usize {
        match self {
            Elem::U8 => 1,
            Elem::F16 | Elem::BF16 => 2,
            Elem::U32 | Elem::I32 | Elem::F32 => 4,
        }
    }

    fn npy(self) -> NPY_TYPES {
        match self {
            Elem::U8 => NPY_TYPES::NPY_UBYTE,
            Elem::U32 => NPY_TYPES::NPY_UINT,
            Elem::I32 => NPY_TYPES::NPY_INT,
            Elem::F16 => NPY_TYPES::NPY_HALF,
            Elem::BF16 => NPY_TYPES::NPY_USHORT,
            Elem::F32 => NPY_TYPES::NPY_FLOAT,
        }
    }

    /// DLPack's (type code, bits).
    fn dlpack(self) -> (u8, u8) {
        match self {
            Elem::U8 => (1, 8),
            Elem::U32 => (1, 32),
            Elem::I32 => (0, 32),
            Elem::F16 => (2, 16),
            Elem::BF16 => (4, 16),
            Elem::F32 => (2, 32),
        }
    }

    fn name(self) -> &'static str {
        match self {
            Elem::U8 => "uint8",
            Elem::U32 => "uint32",
            Elem::I32 => "int32",
            Elem::F16 => "float16",
            Elem::BF16 => "bfloat16",
            Elem::F32 => "float32",
        }
    }
}

/// A numpy array over `len` bytes at `ptr`, kept alive by `owner` (its `base`): read-only
/// unless `writable`.
///
/// # Safety
/// `ptr..ptr + product(shape) * elem.size()` is readable (and writable, if `writable`) and
/// stays valid for as long as `owner` lives; unchanged by others, if not `writable`.
unsafe fn array_over<'py>(
    owner: Bound<'py, PyAny>,
    ptr: *const u8,
    shape: &[usize],
    elem: Elem,
    writable: bool,
) -> PyResult<Bound<'py, PyAny>> {
    let py = owner.py();
    let mut dims: Vec<npy_intp> = shape.iter().map(|&d| d as npy_intp).collect();
    // SAFETY: the numpy C API is initialised by the numpy crate on first use; the descriptor
    // reference is stolen by PyArray_NewFromDescr. Flags without NPY_ARRAY_WRITEABLE make the
    // array read-only; numpy derives contiguity and alignment itself for given data.
    // SAFETY: the numpy C API is initialised by the numpy crate on first use.
    let descr = unsafe { PY_ARRAY_API.PyArray_DescrFromType(py, elem.npy() as c_int) };
    // SAFETY: as above.
    let subtype = unsafe { npyffi::get_type_object(py, npyffi::NpyTypes::PyArray_Type) };
    // SAFETY: the descriptor reference is stolen by PyArray_NewFromDescr; `dims` outlives the
    // call. Flags without NPY_ARRAY_WRITEABLE make the array read-only; numpy derives contiguity
    // and alignment itself for given data.
    let array = unsafe {
        PY_ARRAY_API.PyArray_NewFromDescr(
            py,
            subtype,
            descr,
            dims.len() as c_int,
            dims.as_mut_ptr(),
            std::ptr::null_mut(),
            ptr as *mut c_void,
            if writable {
                npyffi::NPY_ARRAY_WRITEABLE
            } else {
                0
            },
            std::ptr::null_mut(),
        )
    };
    if array.is_null() {
        return Err(PyErr::fetch(py));
    }
    // SAFETY: `array` is a new reference to a fresh ndarray.
    let array = unsafe { Bound::from_owned_ptr(py, array) };
    // SAFETY: a fresh array without a base; SetBaseObject steals the owner reference, which
    // keeps the memory alive per this function's contract.
    let status = unsafe {
        PY_ARRAY_API.PyArray_SetBaseObject(
            py,
            array.as_ptr().cast::<npyffi::PyArrayObject>(),
            owner.into_ptr(),
        )
    };
    if status != 0 {
        return Err(PyErr::fetch(py));
    }
    Ok(array)
}

/// A sample (or any object) in shared memory. Its arrays are read-only views of the store's
/// mapping, or writable ones of a copy-on-write mapping of this process's (`private()`); its
/// tensors' DLPack exports are always writable that way. The sample goes back to the store
/// when this object and every array and tensor made from it are gone.
#[pyclass(module = "feedstore", frozen)]
pub struct Sample {
    held: Arc<Held>,
    parsed: Result<Parsed, SampleError>,
    seq: Option<u64>,
    record: Option<u64>,
    handle: String,
}

impl Sample {
    /// A sample from a stream, validated here (call without the GIL).
    pub fn from_stream(sample: StreamSample) -> Sample {
        let (seq, record, handle) = (sample.seq(), sample.record(), sample.handle().to_string());
        Sample::new(Held::Stream(sample), Some(seq), Some(record), handle)
    }

    /// An object leased by `Client.get`.
    pub fn from_lease(lease: Lease) -> Sample {
        let handle = lease.handle().to_string();
        Sample::new(Held::Lease(lease), None, None, handle)
    }

    /// A private, writable view of this sample (`Sample.private()`); call without the GIL.
    pub fn private_view(&self, populate: bool) -> PyResult<Sample> {
        let held = Held::private(&self.held, populate)?;
        Ok(Sample::new(
            held,
            self.seq,
            self.record,
            self.handle.clone(),
        ))
    }

    fn new(held: Held, seq: Option<u64>, record: Option<u64>, handle: String) -> Sample {
        let parsed = parse(held.bytes());
        Sample {
            held: Arc::new(held),
            parsed,
            seq,
            record,
            handle,
        }
    }

    fn parsed(&self) -> PyResult<&Parsed> {
        self.parsed.as_ref().map_err(invalid_sample)
    }

    /// Image `i`'s location, for batch stacking.
    pub fn image_info(&self, i: usize) -> PyResult<&TensorInfo> {
        let parsed = self.parsed()?;
        parsed.images.get(i).ok_or_else(|| {
            InvalidArgument::new_err(format!(
                "sample {:?} has {} image(s), no image {i}",
                parsed.id,
                parsed.images.len()
            ))
        })
    }

    /// The whole object's bytes.
    pub fn held_bytes(&self) -> &[u8] {
        self.held.bytes()
    }

    /// The object's handle as text.
    pub fn handle_text(&self) -> &str {
        &self.handle
    }

    /// The uid that wrote the object, as the daemon recorded it; `None` for memory of this
    /// process (a batch `Stream.next_stacked` had to copy).
    pub fn writer(&self) -> Option<u32> {
        self.held.writer()
    }

    /// The bytes of `info`.
    pub fn bytes_of(&self, info: &TensorInfo) -> &[u8] {
        &self.held.bytes()[info.offset..info.offset + info.len]
    }

    fn array<'py>(
        slf: &Bound<'py, Sample>,
        info: &TensorInfo,
        elem: Elem,
    ) -> PyResult<Bound<'py, PyAny>> {
        let held = &slf.get().held;
        let start = held.ptr().wrapping_add(info.offset);
        // SAFETY: `info` was located inside the object by validation; the object stays leased
        // and mapped while the `Sample` (the array's base) lives, and sealed objects never
        // change; a writable one is this process's own memory.
        unsafe {
            array_over(
                slf.clone().into_any(),
                start,
                &info.shape,
                elem,
                held.writable(),
            )
        }
    }
}

#[pymethods]
impl Sample {
    /// The rank's sequence number of this sample (None for an object from `Client.get`).
    #[getter]
    fn seq(&self) -> Option<u64> {
        self.seq
    }

    /// The manifest record it was made from (None for an object from `Client.get`).
    #[getter]
    fn record(&self) -> Option<u64> {
        self.record
    }

    /// The object's handle, as text (`Client.get` takes it).
    #[getter]
    fn handle(&self) -> &str {
        &self.handle
    }

    /// The uid of the process that wrote the object, as the daemon recorded it when the object
    /// was created (for a copy pulled from another node, as that node's daemon recorded it);
    /// None for memory of this process.
    #[getter]
    fn writer_uid(&self) -> Option<u32> {
        self.writer()
    }

    /// Size of the object in bytes.
    #[getter]
    fn nbytes(&self) -> usize {
        self.held.len()
    }

    /// Whether the object is a valid sample (else only `data` is available).
    #[getter]
    fn is_sample(&self) -> bool {
        self.parsed.is_ok()
    }

    /// The record's id.
    #[getter]
    fn id(&self) -> PyResult<&str> {
        Ok(&self.parsed()?.id)
    }

    /// Where the sample came from (the image keys).
    #[getter]
    fn source_keys(&self) -> PyResult<Vec<String>> {
        Ok(self.parsed()?.source_keys.clone())
    }

    /// The same object through a mapping of this process's own, copy-on-write: its arrays and
    /// tensors are writable, a write copies only the page (4 KiB) it touches into this
    /// process's memory, and nobody else sees it (not the store, other readers, later epochs,
    /// the decode-once cache, nor this sample). Reading costs what this sample's reads do. It
    /// holds this sample's lease. On huge-page segments (hugetlbfs) the object is copied
    /// instead. `prefault=True` builds its page tables now.
    #[pyo3(signature = (*, prefault = false))]
    fn private(&self, py: Python<'_>, prefault: bool) -> PyResult<Sample> {
        py.detach(|| self.private_view(prefault))
    }

    /// Whether its arrays and tensors may be written (a `private()` view, or a copy in this
    /// process's memory); else they are read-only views of the store.
    #[getter]
    fn writable(&self) -> bool {
        self.held.writable()
    }

    /// The whole object as a uint8 array (for objects that are not samples): read-only, or
    /// writable for a `private()` view.
    #[getter]
    fn data<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        let len = slf.get().held.len();
        let info = TensorInfo {
            offset: 0,
            len,
            dtype: DType::U8,
            layout: TensorLayout::Hwc,
            shape: vec![len],
        };
        Sample::array(slf, &info, Elem::U8)
    }

    /// Token ids: a uint32 array in shared memory (read-only unless the sample is private).
    #[getter]
    fn tokens<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        Sample::array(slf, &slf.get().parsed()?.tokens, Elem::U32)
    }

    /// Labels (-100 where the loss is masked): an int32 array in shared memory (read-only
    /// unless the sample is private).
    #[getter]
    fn labels<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        Sample::array(slf, &slf.get().parsed()?.labels, Elem::I32)
    }

    /// The image tensors: arrays in shared memory, read-only unless the sample is private
    /// (bfloat16 shows as uint16 bits; use `tensor(i)` with `torch.from_dlpack` for a real
    /// bfloat16 tensor).
    #[getter]
    fn images<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyList>> {
        let arrays = slf
            .get()
            .parsed()?
            .images
            .iter()
            .map(|info| Sample::array(slf, info, Elem::of(info.dtype)))
            .collect::<PyResult<Vec<_>>>()?;
        PyList::new(slf.py(), arrays)
    }

    /// Number of images.
    #[getter]
    fn image_count(&self) -> PyResult<usize> {
        Ok(self.parsed()?.images.len())
    }

    /// Layout of each image: "hwc" or "chw".
    #[getter]
    fn image_layouts(&self) -> PyResult<Vec<&'static str>> {
        Ok(self
            .parsed()?
            .images
            .iter()
            .map(|t| match t.layout {
                TensorLayout::Hwc => "hwc",
                TensorLayout::Chw => "chw",
            })
            .collect())
    }

    /// Each image's patch grid (temporal, height, width), as Qwen-VL's `image_grid_thw`.
    #[getter]
    fn image_grid_thw(&self) -> PyResult<Vec<(u32, u32, u32)>> {
        Ok(self
            .parsed()?
            .grids
            .iter()
            .map(|g| (g[0], g[1], g[2]))
            .collect())
    }

    /// Metadata entries.
    #[getter]
    fn metadata<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let dict = PyDict::new(py);
        for (k, v) in &self.parsed()?.metadata {
            dict.set_item(k, v)?;
        }
        Ok(dict)
    }

    /// Image `i` as a `Tensor` (for `torch.from_dlpack`, which shares its memory).
    fn image(slf: &Bound<'_, Self>, i: usize) -> PyResult<Tensor> {
        let sample = slf.get();
        let info = sample.image_info(i)?.clone();
        Ok(Tensor {
            held: sample.held.clone(),
            elem: Elem::of(info.dtype),
            info,
        })
    }

    /// `length` bytes of the object from `offset` (default: all of it) as a uint8 `Tensor`
    /// (for `torch.from_dlpack`, which shares the memory; `feedstore.torch`'s batches make
    /// each tensor from one). Its `numpy()` is read-only unless the sample is private; its
    /// DLPack export is writable, privately (see `Tensor`).
    #[pyo3(signature = (offset=0, length=None))]
    fn buffer(&self, offset: usize, length: Option<usize>) -> PyResult<Tensor> {
        let size = self.held.len();
        let len = length.unwrap_or(size.saturating_sub(offset));
        if offset.checked_add(len).is_none_or(|end| end > size) {
            return Err(InvalidArgument::new_err(format!(
                "{len} bytes at offset {offset} lie outside an object of {size} bytes"
            )));
        }
        Ok(Tensor {
            held: self.held.clone(),
            info: TensorInfo {
                offset,
                len,
                dtype: DType::U8,
                layout: TensorLayout::Hwc,
                shape: vec![len],
            },
            elem: Elem::U8,
        })
    }

    /// The token ids as an int32 `Tensor` (for `torch.from_dlpack`: torch before 2.3 has no
    /// uint32, and vocabularies stay far below 2**31, so the bits read the same).
    fn tokens_tensor(&self) -> PyResult<Tensor> {
        Ok(Tensor {
            held: self.held.clone(),
            info: self.parsed()?.tokens.clone(),
            elem: Elem::I32,
        })
    }

    /// The labels as a `Tensor` (for `torch.from_dlpack`).
    fn labels_tensor(&self) -> PyResult<Tensor> {
        Ok(Tensor {
            held: self.held.clone(),
            info: self.parsed()?.labels.clone(),
            elem: Elem::I32,
        })
    }

    fn __repr__(&self) -> String {
        match &self.parsed {
            Ok(p) => format!(
                "Sample(id={:?}, seq={:?}, record={:?}, images={:?}, tokens={})",
                p.id,
                self.seq,
                self.record,
                p.images.iter().map(|t| t.shape.clone()).collect::<Vec<_>>(),
                p.tokens.shape[0]
            ),
            Err(_) => format!(
                "Sample(handle={}, nbytes={}, not a sample)",
                self.handle,
                self.held.len()
            ),
        }
    }
}

/// One tensor of a sample, in place in shared memory, exportable with DLPack:
/// `torch.from_dlpack(t)` gives a writable tensor over the same pages, through a copy-on-write
/// view of this process's own when the sample's is the store's read-only mapping (a write
/// copies the page it touches; nobody else sees it). `numpy()` gives an array over the
/// sample's own view: read-only (numpy raises on a write) unless the sample is private.
#[pyclass(module = "feedstore", frozen)]
pub struct Tensor {
    held: Arc<Held>,
    info: TensorInfo,
    elem: Elem,
}

impl Tensor {
    fn ptr(&self) -> *const u8 {
        // (Inside the object: located by validation or by `buffer`'s bounds check.)
        self.held.ptr().wrapping_add(self.info.offset)
    }
}

#[pymethods]
impl Tensor {
    /// Dimensions, outermost first.
    #[getter]
    fn shape<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, &self.info.shape)
    }

    /// Element type name ("uint8", "float16", "bfloat16", "float32", "uint32", "int32").
    #[getter]
    fn dtype(&self) -> &'static str {
        self.elem.name()
    }

    /// Address of the first element (inside the store's mapping).
    #[getter]
    fn data_ptr(&self) -> usize {
        self.ptr() as usize
    }

    /// Bytes of data.
    #[getter]
    fn nbytes(&self) -> usize {
        self.info.len
    }

    /// A numpy array over the same memory: read-only (a write raises) unless the sample is
    /// private (`Sample.private()`).
    fn numpy<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        let t = slf.get();
        // SAFETY: the tensor's range lies in the object (located by validation), which stays
        // leased and mapped while this `Tensor`, the array's base, lives.
        unsafe {
            array_over(
                slf.clone().into_any(),
                t.ptr(),
                &t.info.shape,
                t.elem,
                t.held.writable(),
            )
        }
    }

    #[pyo3(signature = (dtype=None, copy=None))]
    fn __array__<'py>(
        slf: &Bound<'py, Self>,
        dtype: Option<Bound<'py, PyAny>>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let array = Tensor::numpy(slf)?;
        match (dtype, copy) {
            (None, None | Some(false)) => Ok(array),
            (dtype, _) => array.call_method1(
                "astype",
                (dtype.map_or_else(|| array.getattr("dtype"), Ok)?,),
            ),
        }
    }

    /// (device type, device id): kDLCPU, 0.
    fn __dlpack_device__(&self) -> (i32, i32) {
        (DL_CPU, 0)
    }

    /// A DLPack capsule over the tensor's memory; the capsule (then the consumer's tensor) keeps
    /// the sample leased.
    #[pyo3(signature = (*, stream=None, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__<'py>(
        &self,
        py: Python<'py>,
        stream: Option<Bound<'py, PyAny>>,
        max_version: Option<Bound<'py, PyAny>>,
        dl_device: Option<Bound<'py, PyAny>>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let _ = (stream, max_version, dl_device);
        if copy == Some(true) {
            return Err(InvalidArgument::new_err(
                "feedstore tensors are exported without copying (copy=True is not supported)",
            ));
        }
        // torch has no read-only tensors and DLPack before 1.0 no read-only flag: a tensor
        // over the store's PROT_READ mapping would die of SIGSEGV at its first in-place op. A
        // read-only sample's tensor goes out through a private copy-on-write view instead
        // (one mmap): reads share the store's pages, a write copies the page it touches.
        let held = if self.held.writable() {
            self.held.clone()
        } else {
            Arc::new(Held::private(&self.held, false)?)
        };
        let ptr = held.ptr().wrapping_add(self.info.offset);
        dlpack::capsule(py, held, ptr, &self.info.shape, self.elem)
    }

    fn __len__(&self) -> usize {
        self.info.shape.first().copied().unwrap_or(0)
    }

    fn __repr__(&self) -> String {
        format!(
            "Tensor(shape={:?}, dtype={}, data_ptr=0x{:x})",
            self.info.shape,
            self.elem.name(),
            self.ptr() as usize
        )
    }
}

const DL_CPU: i32 = 1;

/// A hand-written DLPack (0.8 ABI, unversioned `dltensor` capsule, as torch 1.13+ and numpy
/// read it) export.
mod dlpack;

/// Image `index` of every sample, stacked `(len(samples), *shape)`, as a `Tensor`: a view of
/// shared memory when a producer placed the samples side by side in one object in this order
/// (`Writer.put_batch`, a `BatchPlan`), kept alive through the first sample's lease; otherwise
/// (`copied`) a stacked copy in this process's memory. An error if the images differ in shape
/// or dtype, or a sample has no image `index`.
pub fn stacked(py: Python<'_>, samples: &[Py<Sample>], index: usize) -> PyResult<(Tensor, bool)> {
    let first = samples
        .first()
        .ok_or_else(|| InvalidArgument::new_err("no samples to stack"))?
        .get();
    let head = first.image_info(index)?.clone();
    let mut parts = Vec::with_capacity(samples.len());
    for s in samples {
        let s = s.get();
        let info = s.image_info(index)?;
        if info.shape != head.shape || info.dtype != head.dtype || info.layout != head.layout {
            return Err(InvalidArgument::new_err(format!(
                "image {index} of the batch differs in shape, dtype or layout ({:?} {:?} {:?} \
                 and {:?} {:?} {:?}): it cannot be stacked",
                head.shape, head.dtype, head.layout, info.shape, info.dtype, info.layout
            )));
        }
        parts.push(s.bytes_of(info));
    }
    let mut shape = vec![samples.len()];
    shape.extend_from_slice(&head.shape);
    let elem = Elem::of(head.dtype);
    // Read through the first sample: it runs to its object's end, and its lease keeps the
    // object (every image found inside it) alive while the tensor lives.
    let within = first.held.bytes();
    if let Some(range) = side_by_side(within, &parts) {
        let info = TensorInfo::of(within, &within[range], head.dtype, head.layout, shape);
        // Over the first sample's hold: `numpy()` gives a read-only array of the store's
        // pages, and `__dlpack__` (torch) a copy-on-write view of its own, made then (one
        // mmap; its page tables are built as it is read), so the hand-off maps nothing.
        let held = first.held.clone();
        return Ok((Tensor { held, info, elem }, false));
    }
    let mut buf = AlignedBuf::zeroed(head.len * samples.len());
    let sources = parts
        .iter()
        .map(|p| (p.as_ptr() as usize, p.len()))
        .collect();
    // SAFETY: each source is a leased sample's image that `samples` keeps alive for this call;
    // `buf` (this call's own) holds their total, `head.len` each (equal shapes and dtypes).
    unsafe { gather(py, sources, buf.as_mut_slice().as_mut_ptr() as usize) };
    let info = TensorInfo::of(
        buf.as_slice(),
        buf.as_slice(),
        head.dtype,
        head.layout,
        shape,
    );
    let held = Arc::new(Held::Owned(buf));
    Ok((Tensor { held, info, elem }, true))
}

/// Copies each source (address, length) back to back into `dst`, without the GIL.
///
/// # Safety
/// Each source is that many readable bytes, alive and unchanged through the call; `dst` is
/// their total of writable bytes, overlapping none of them.
unsafe fn gather(py: Python<'_>, sources: Vec<(usize, usize)>, dst: usize) {
    py.detach(|| {
        let mut at = dst;
        for (src, len) in sources {
            // SAFETY: per this function's contract.
            unsafe { std::ptr::copy_nonoverlapping(src as *const u8, at as *mut u8, len) };
            at += len;
        }
    });
}

/// Copies image `index` of every sample into `out` (a writable, C-contiguous array of
/// `len(samples)` images of the samples' shape and dtype), without the GIL.
pub fn stack_images(
    py: Python<'_>,
    samples: &[Py<Sample>],
    index: usize,
    out: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let array = out
        .cast::<numpy::PyUntypedArray>()
        .map_err(|_| InvalidArgument::new_err("out must be a numpy array"))?;
    // SAFETY: a live ndarray object; reading its flags and data pointer.
    let (flags, data) = unsafe {
        let raw = &(*array.as_array_ptr()).fields;
        (raw.flags, raw.data as usize)
    };
    if flags & npyffi::NPY_ARRAY_WRITEABLE == 0 || flags & npyffi::NPY_ARRAY_C_CONTIGUOUS == 0 {
        return Err(InvalidArgument::new_err(
            "out must be a writable, C-contiguous numpy array",
        ));
    }
    let shapes: BTreeMap<(Vec<usize>, &'static str), usize> =
        samples.iter().try_fold(BTreeMap::new(), |mut m, s| {
            let info = s.get().image_info(index)?;
            *m.entry((info.shape.clone(), Elem::of(info.dtype).name()))
                .or_insert(0) += 1;
            PyResult::Ok(m)
        })?;
    let Some(((shape, dtype), _)) = shapes.iter().next().filter(|_| shapes.len() == 1) else {
        if samples.is_empty() {
            return Ok(());
        }
        return Err(InvalidArgument::new_err(format!(
            "images of the batch differ in shape or dtype ({:?}): they cannot be stacked",
            shapes.keys().collect::<Vec<_>>()
        )));
    };
    let mut want = vec![samples.len()];
    want.extend_from_slice(shape);
    let itemsize = Elem::of(samples[0].get().image_info(index)?.dtype).size();
    let out_dtype: String = array.dtype().str()?.to_string();
    let dtype_ok = match *dtype {
        "bfloat16" => array.dtype().itemsize() == 2,
        name => out_dtype == name,
    };
    if array.shape() != want.as_slice() || !dtype_ok {
        return Err(InvalidArgument::new_err(format!(
            "out has shape {:?} and dtype {out_dtype}; this batch needs {want:?} of {dtype}",
            array.shape()
        )));
    }
    let per = shape.iter().product::<usize>() * itemsize;
    let sources: Vec<(usize, usize)> = samples
        .iter()
        .map(|s| {
            let s = s.get();
            let info = s.image_info(index).expect("checked above");
            (s.bytes_of(info).as_ptr() as usize, info.len)
        })
        .collect();
    debug_assert!(sources.iter().all(|&(_, len)| len == per));
    // SAFETY: `out` holds `samples.len() * per` writable bytes (shape and dtype checked,
    // C-contiguous); each source is `per` bytes of a leased sample that `samples` keeps alive;
    // the store's mapping and a numpy buffer never overlap.
    unsafe { gather(py, sources, data) };
    Ok(())
}
