use super::*;

#[repr(C)]
struct DLDevice {
    device_type: i32,
    device_id: i32,
}

#[repr(C)]
struct DLDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

#[repr(C)]
struct DLTensor {
    data: *mut c_void,
    device: DLDevice,
    ndim: i32,
    dtype: DLDataType,
    shape: *mut i64,
    strides: *mut i64,
    byte_offset: u64,
}

#[repr(C)]
struct DLManagedTensor {
    dl_tensor: DLTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

/// What the managed tensor owns: the hold on the object and the shape array.
struct Context {
    _held: Arc<Held>,
    shape: Vec<i64>,
}

const NAME: &std::ffi::CStr = c"dltensor";

/// Frees the managed tensor: called by the consumer when its tensor dies, or by the capsule
/// if nobody consumed it. Needs no GIL (it touches no Python object).
unsafe extern "C" fn deleter(managed: *mut DLManagedTensor) {
    if managed.is_null() {
        return;
    }
    // SAFETY: `managed` came from `Box::into_raw` in `capsule`, and DLPack calls the
    // deleter once; its context likewise.
    let managed = unsafe { Box::from_raw(managed) };
    // SAFETY: as above, the context is a boxed `Context` owned by this tensor alone.
    drop(unsafe { Box::from_raw(managed.manager_ctx.cast::<Context>()) });
}

/// The capsule's destructor: frees the tensor unless a consumer took it (and renamed the
/// capsule to `used_dltensor`).
unsafe extern "C" fn capsule_destructor(capsule: *mut pyo3::ffi::PyObject) {
    // SAFETY: called by Python with the GIL on a live capsule.
    if unsafe { pyo3::ffi::PyCapsule_IsValid(capsule, NAME.as_ptr()) } == 1 {
        // SAFETY: as above; a valid `dltensor` capsule holds our managed tensor.
        let managed = unsafe { pyo3::ffi::PyCapsule_GetPointer(capsule, NAME.as_ptr()) };
        // SAFETY: not consumed (still named `dltensor`), so it is ours to free, once.
        unsafe { deleter(managed.cast()) };
    }
}

pub(super) fn capsule<'py>(
    py: Python<'py>,
    held: Arc<Held>,
    data: *const u8,
    shape: &[usize],
    elem: Elem,
) -> PyResult<Bound<'py, PyAny>> {
    let mut context = Box::new(Context {
        _held: held,
        shape: shape.iter().map(|&d| d as i64).collect(),
    });
    let (code, bits) = elem.dlpack();
    let managed = Box::new(DLManagedTensor {
        dl_tensor: DLTensor {
            data: data as *mut c_void,
            device: DLDevice {
                device_type: DL_CPU,
                device_id: 0,
            },
            ndim: context.shape.len() as i32,
            dtype: DLDataType {
                code,
                bits,
                lanes: 1,
            },
            shape: context.shape.as_mut_ptr(),
            // Null strides: compact row-major.
            strides: std::ptr::null_mut(),
            byte_offset: 0,
        },
        manager_ctx: Box::into_raw(context).cast(),
        deleter: Some(deleter),
    });
    let managed = Box::into_raw(managed);
    // SAFETY: a valid pointer and a static name; on failure the tensor is freed here.
    let capsule = unsafe {
        pyo3::ffi::PyCapsule_New(managed.cast(), NAME.as_ptr(), Some(capsule_destructor))
    };
    if capsule.is_null() {
        // SAFETY: the capsule was not created, so this is the only owner.
        unsafe { deleter(managed) };
        return Err(PyErr::fetch(py));
    }
    // SAFETY: a new reference.
    Ok(unsafe { Bound::from_owned_ptr(py, capsule) })
}
