//! Errors across the C boundary: a status code for the caller's `switch`, and the message for
//! `fs_last_error`, kept per thread.

use std::cell::RefCell;
use std::ffi::{CString, c_char};

use feedstore_consumer::Error;

use crate::FsStatus;

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

/// A failure on its way to C.
pub(crate) struct FfiError {
    pub(crate) status: FsStatus,
    pub(crate) message: String,
}

impl FfiError {
    pub(crate) fn invalid(message: impl Into<String>) -> FfiError {
        FfiError {
            status: FsStatus::ErrInvalidArgument,
            message: message.into(),
        }
    }
}

impl From<Error> for FfiError {
    fn from(e: Error) -> FfiError {
        let status = match &e {
            Error::Connect { .. } => FsStatus::ErrConnect,
            Error::Disconnected { .. } => FsStatus::ErrDisconnected,
            Error::Timeout(_) => FsStatus::ErrTimeout,
            Error::StreamMismatch(_) => FsStatus::ErrMismatch,
            Error::NotFound { .. } | Error::Stale { .. } | Error::WrongNode { .. } => {
                FsStatus::ErrNotFound
            }
            Error::Full { .. } => FsStatus::ErrFull,
            Error::TooLarge { .. } => FsStatus::ErrTooLarge,
            Error::LimitReached(_) => FsStatus::ErrLimitReached,
            Error::Unreachable { .. } => FsStatus::ErrUnreachable,
            Error::Corrupt { .. } => FsStatus::ErrCorrupt,
            Error::InvalidArgument(_) | Error::Encode(_) => FsStatus::ErrInvalidArgument,
            Error::PermissionDenied { .. } | Error::UntrustedDaemon { .. } => {
                FsStatus::ErrPermissionDenied
            }
            Error::SampleFailed { .. } => FsStatus::ErrSampleFailed,
            Error::WindowFull { .. } => FsStatus::ErrWindowFull,
            _ => FsStatus::ErrOther,
        };
        // The whole chain, so the C caller sees the cause ("connection refused", ...).
        let message = feedstore_proto::error_chain(&e);
        FfiError { status, message }
    }
}

impl From<feedstore_proto::sample::SampleError> for FfiError {
    fn from(e: feedstore_proto::sample::SampleError) -> FfiError {
        FfiError {
            status: FsStatus::ErrInvalidSample,
            message: format!("invalid sample: {e}"),
        }
    }
}

/// Runs the body of an exported function: its error becomes a status and the thread's last
/// error message, and a panic (a bug) never unwinds into C.
pub(crate) fn guard(body: impl FnOnce() -> Result<FsStatus, FfiError>) -> FsStatus {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(body)) {
        Ok(Ok(status)) => status,
        Ok(Err(e)) => {
            set_last_error(&e.message);
            e.status
        }
        Err(_) => {
            set_last_error("a panic inside feedstore (a bug; please report it)");
            FsStatus::ErrPanic
        }
    }
}

fn set_last_error(message: &str) {
    let text = CString::new(message.replace('\0', " ")).unwrap_or_default();
    LAST_ERROR.with(|e| *e.borrow_mut() = text);
}

/// The calling thread's last error message.
pub(crate) fn last_error() -> *const c_char {
    LAST_ERROR.with(|e| e.borrow().as_ptr())
}
