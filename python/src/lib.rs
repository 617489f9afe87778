//! feedstore for Python: a trainer reads its stream's samples as read-only numpy arrays and
//! DLPack tensors over the store's shared memory, with no copy and no pickling.
//!
//! Thin on purpose: every class wraps the Rust client (`feedstore_consumer`); [`errors`] is the
//! one place Rust errors become Python exceptions; [`sample`] holds the ownership chain that
//! keeps an object leased while any array over it lives. The Python half of the package
//! (`feedstore/`) adds the PyTorch adapter.

mod batch;
mod client;
mod errors;
mod sample;
mod stream;
mod writing;

use pyo3::prelude::*;

/// The native half of the `feedstore` package.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    errors::register(m)?;
    m.add_class::<client::Client>()?;
    m.add_class::<writing::Reservation>()?;
    m.add_class::<stream::Stream>()?;
    m.add_class::<stream::Writer>()?;
    m.add_class::<stream::Task>()?;
    m.add_class::<sample::Sample>()?;
    m.add_class::<sample::Tensor>()?;
    m.add_function(wrap_pyfunction!(stream::state_at, m)?)?;
    m.add_function(wrap_pyfunction!(stream::reshard, m)?)?;
    m.add_function(wrap_pyfunction!(batch::encode_batch, m)?)?;
    m.add_function(wrap_pyfunction!(batch::decode_batch, m)?)?;
    m.add_function(wrap_pyfunction!(batch::is_batch, m)?)?;
    m.add_function(wrap_pyfunction!(batch::batch_header, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
