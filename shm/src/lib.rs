//! The unsafe bottom layer of feedstore: memfd segments and their mappings.
//!
//! The daemon creates [`Segment`]s: anonymous `memfd` files (on hugetlbfs pages when the node has
//! them reserved), sized once, sealed against shrinking and growing, and pre-faulted so producers
//! always write into warm memory. Clients receive a segment's file descriptor over the control
//! socket and wrap it in a [`Mapping`]:
//!
//! - a reader gets a descriptor re-opened `O_RDONLY`, so the kernel itself refuses a writable
//!   mapping (`EACCES`): a trainer bug cannot scribble over a sample another rank is reading.
//!   The memfd's mode is 0400, so a reader of another uid cannot open it again for writing
//!   through `/proc/self/fd/N` either;
//! - a writer gets the read-write descriptor.
//!
//! Bytes reach users only as [`SharedBytes`]: a view that owns the mapping (an `Arc`) and the
//! hold that keeps the bytes unchanged (a lease), so it cannot outlive either.
//!
//! Key decision: the size seals (`F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL`) are what make the
//! mapping safe to hand out. Without them any holder of the descriptor could `ftruncate` it and
//! every other process touching the tail would die of `SIGBUS`. [`Mapping::new`] refuses a
//! descriptor that lacks them.
//!
//! All `unsafe` of the shared-memory path lives in this crate.
//!
//! ```
//! use feedstore_shm::{Access, HugePages, Mapping, Segment, SegmentOptions};
//!
//! # fn main() -> Result<(), feedstore_shm::ShmError> {
//! let segment = Segment::create(&SegmentOptions {
//!     name: "doc".into(),
//!     size_bytes: 1 << 20,
//!     huge_pages: HugePages::Off,
//!     prefault: true,
//! })?;
//! let reader_fd = segment.reopen_readonly()?;
//! let view = Mapping::new(reader_fd, segment.size_bytes(), Access::ReadOnly, false)?;
//! assert_eq!(view.len(), 1 << 20);
//! # Ok(())
//! # }
//! ```

mod mapping;
mod proc;
mod segment;

pub use mapping::{Access, Mapping, PrivateBytes, SharedBytes};
pub use proc::{resident_kib, shmem_thp_mode};
pub use segment::{HugePageInfo, HugePages, Segment, SegmentOptions};

use std::io;

/// Errors of the shared-memory layer. Each keeps the OS error as its `source()`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ShmError {
    /// `memfd_create` failed.
    #[error("cannot create shared-memory segment {name:?}")]
    Create {
        /// Segment name.
        name: String,
        /// The OS error.
        source: io::Error,
    },
    /// Sizing the segment failed.
    #[error("cannot size shared-memory segment to {size_bytes} bytes")]
    Resize {
        /// Requested size.
        size_bytes: u64,
        /// The OS error.
        source: io::Error,
    },
    /// Adding or reading seals failed.
    #[error("cannot seal shared-memory segment")]
    Seal {
        /// The OS error.
        source: io::Error,
    },
    /// Pre-faulting (allocating every page up front) failed: usually not enough memory.
    #[error("cannot pre-fault {size_bytes} bytes of shared memory (not enough memory?)")]
    Prefault {
        /// Segment size.
        size_bytes: u64,
        /// The OS error.
        source: io::Error,
    },
    /// Huge pages were required but too few are reserved.
    #[error(
        "huge pages required but only {free_pages} of the {needed_pages} needed are free; \
         reserve more with `echo N > /proc/sys/vm/nr_hugepages` or use --huge-pages auto"
    )]
    HugePagesUnavailable {
        /// Pages of the default huge page size needed.
        needed_pages: u64,
        /// Pages currently free.
        free_pages: u64,
    },
    /// Re-opening a descriptor read-only failed.
    #[error("cannot re-open segment descriptor read-only")]
    Reopen {
        /// The OS error.
        source: io::Error,
    },
    /// The descriptor is not a sealed segment of at least the announced size.
    #[error("descriptor is not a sealed feedstore segment: {reason}")]
    NotASegment {
        /// What was wrong.
        reason: String,
    },
    /// `mmap` failed; `EACCES` for a writable mapping of a read-only descriptor.
    #[error("cannot map {len} bytes {access:?}")]
    Map {
        /// Mapping length.
        len: u64,
        /// Requested access.
        access: Access,
        /// The OS error.
        source: io::Error,
    },
}

impl ShmError {
    /// The underlying OS error, if any.
    pub fn os_error(&self) -> Option<&io::Error> {
        match self {
            ShmError::Create { source, .. }
            | ShmError::Resize { source, .. }
            | ShmError::Seal { source }
            | ShmError::Prefault { source, .. }
            | ShmError::Reopen { source }
            | ShmError::Map { source, .. } => Some(source),
            ShmError::HugePagesUnavailable { .. } | ShmError::NotASegment { .. } => None,
        }
    }
}
