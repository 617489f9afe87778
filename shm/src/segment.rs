//! Daemon-side segments: memfd files sized, sealed and pre-faulted once.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};

use nix::fcntl::{FallocateFlags, FcntlArg, OFlag, SealFlag};
use nix::sys::memfd::{MFdFlags, memfd_create};
use nix::sys::stat::Mode;

use crate::{Access, Mapping, ShmError};

/// Whether segments use hugetlbfs pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HugePages {
    /// Huge pages when enough are reserved; otherwise 4 KiB pages (with `MADV_HUGEPAGE` advice
    /// in each mapping, which helps where shmem THP is enabled).
    #[default]
    Auto,
    /// Huge pages or refuse to start.
    On,
    /// Always 4 KiB pages.
    Off,
}

/// How to create a [`Segment`].
#[derive(Debug, Clone)]
pub struct SegmentOptions {
    /// Name shown in `/proc/<pid>/fd` (`memfd:<name>`).
    pub name: String,
    /// Requested size; rounded up to the page size in use.
    pub size_bytes: u64,
    /// Huge page policy.
    pub huge_pages: HugePages,
    /// Allocate and zero every page now (`fallocate`, then a fault on each page), so the first
    /// write by a producer does not pay for page allocation and zeroing (measured here: ~0.7
    /// GB/s cold vs 11-18 GB/s warm).
    pub prefault: bool,
}

/// The node's huge page reserve, read from `/proc/meminfo`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HugePageInfo {
    /// Default huge page size in bytes.
    pub page_bytes: u64,
    /// Free pages in the reserve.
    pub free_pages: u64,
}

impl HugePageInfo {
    /// Reads `/proc/meminfo`; `None` when the kernel has no hugetlb support.
    pub fn read() -> Option<HugePageInfo> {
        let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
        let field = |name: &str| {
            meminfo.lines().find_map(|l| {
                let rest = l.strip_prefix(name)?.trim_start_matches(':').trim();
                rest.split_whitespace().next()?.parse::<u64>().ok()
            })
        };
        Some(HugePageInfo {
            page_bytes: field("Hugepagesize")? * 1024,
            free_pages: field("HugePages_Free")?,
        })
    }

    fn pages_for(&self, size_bytes: u64) -> u64 {
        size_bytes.div_ceil(self.page_bytes)
    }
}

/// A shared-memory segment owned by the daemon.
///
/// Its size never changes after creation (sealed), so any mapping of it stays valid for its whole
/// length for as long as it exists.
#[derive(Debug)]
pub struct Segment {
    fd: OwnedFd,
    size_bytes: u64,
    hugetlb: bool,
}

impl Segment {
    /// Creates, sizes, seals and (optionally) pre-faults a segment.
    pub fn create(opts: &SegmentOptions) -> Result<Segment, ShmError> {
        let huge = HugePageInfo::read();
        let want_huge = match (opts.huge_pages, huge) {
            (HugePages::Off, _) => false,
            (HugePages::On, None) => {
                return Err(ShmError::HugePagesUnavailable {
                    needed_pages: opts.size_bytes.div_ceil(2 << 20),
                    free_pages: 0,
                });
            }
            (HugePages::On, Some(info)) => {
                let needed_pages = info.pages_for(opts.size_bytes);
                if info.free_pages < needed_pages {
                    return Err(ShmError::HugePagesUnavailable {
                        needed_pages,
                        free_pages: info.free_pages,
                    });
                }
                true
            }
            (HugePages::Auto, Some(info)) => info.free_pages >= info.pages_for(opts.size_bytes),
            (HugePages::Auto, None) => false,
        };
        if want_huge {
            match Self::create_with(opts, true) {
                Ok(seg) => return Ok(seg),
                // Another process took the pages between our look and our allocation.
                Err(err) if opts.huge_pages == HugePages::Auto => {
                    tracing::warn!(error = %err, "huge page segment failed; falling back to 4 KiB pages");
                }
                Err(err) => return Err(err),
            }
        }
        Self::create_with(opts, false)
    }

    fn create_with(opts: &SegmentOptions, hugetlb: bool) -> Result<Segment, ShmError> {
        let name =
            CString::new(format!("feedstore:{}", opts.name)).map_err(|_| ShmError::Create {
                name: opts.name.clone(),
                source: io::Error::new(io::ErrorKind::InvalidInput, "name contains NUL"),
            })?;
        let mut flags = MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING;
        if hugetlb {
            flags |= MFdFlags::MFD_HUGETLB;
        }
        let fd = memfd_create(name.as_c_str(), flags).map_err(|e| ShmError::Create {
            name: opts.name.clone(),
            source: e.into(),
        })?;
        // A memfd is born mode 0777, so anyone holding a read-only descriptor could open it
        // again read-write through `/proc/self/fd/N`. Mode 0400: no other uid can open it for
        // writing by any path (the daemon's own read-only reopen still works), while writers
        // keep the read-write descriptor they are passed.
        nix::sys::stat::fchmod(&fd, Mode::S_IRUSR).map_err(|e| ShmError::Create {
            name: opts.name.clone(),
            source: e.into(),
        })?;

        let page = if hugetlb {
            HugePageInfo::read().map_or(2 << 20, |i| i.page_bytes)
        } else {
            page_size()
        };
        let size_bytes = opts.size_bytes.max(1).next_multiple_of(page);
        let resize_err = |e: nix::Error| ShmError::Resize {
            size_bytes,
            source: e.into(),
        };
        let len = i64::try_from(size_bytes).map_err(|_| resize_err(nix::Error::EFBIG))?;
        nix::unistd::ftruncate(&fd, len).map_err(resize_err)?;
        let seals = SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_GROW | SealFlag::F_SEAL_SEAL;
        nix::fcntl::fcntl(&fd, FcntlArg::F_ADD_SEALS(seals))
            .map_err(|e| ShmError::Seal { source: e.into() })?;
        let segment = Segment {
            fd,
            size_bytes,
            hugetlb,
        };
        if opts.prefault {
            segment.prefault(8)?;
        }
        tracing::debug!(name = %opts.name, size_bytes, hugetlb, prefault = opts.prefault, "segment created");
        Ok(segment)
    }

    /// Allocates every page of the segment and zeroes it, so no writer or reader pays for that
    /// later (about 0.7 s per GiB of shmem on a 2-vCPU VM). Safe while the segment is in use:
    /// `fallocate` leaves the pages that exist as they are, and the read faults that zero the
    /// rest find a page a writer touched first already filled. Fails (`ENOSPC`, `ENOMEM`) where
    /// the memory is not there: hugetlbfs without enough reserved pages, say. Shmem is zeroed
    /// on up to `threads` threads.
    pub fn prefault(&self, threads: usize) -> Result<(), ShmError> {
        let size_bytes = self.size_bytes;
        let len = i64::try_from(size_bytes).expect("checked at creation");
        nix::fcntl::fallocate(&self.fd, FallocateFlags::empty(), 0, len).map_err(|e| {
            ShmError::Prefault {
                size_bytes,
                source: e.into(),
            }
        })?;
        // hugetlbfs zeroes its pages as it allocates them; shmem leaves them for the first fault
        // to zero.
        if !self.hugetlb {
            zero_now(&self.fd, size_bytes, threads)?;
        }
        Ok(())
    }

    /// The read-write descriptor (for writers).
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// A segment another daemon made, from its read-write descriptor (a daemon taking over
    /// from it): checked to be sealed against shrinking, and at least `size_bytes` long.
    pub fn adopt(fd: OwnedFd, size_bytes: u64, hugetlb: bool) -> Result<Segment, ShmError> {
        use std::os::fd::AsFd;
        crate::mapping::check_sealed(fd.as_fd(), size_bytes)?;
        Ok(Segment {
            fd,
            size_bytes,
            hugetlb,
        })
    }

    /// A new descriptor for the same memory opened `O_RDONLY` (for readers): mapping it writable
    /// fails with `EACCES`, and `mprotect` cannot upgrade a mapping of it either.
    pub fn reopen_readonly(&self) -> Result<OwnedFd, ShmError> {
        let path = format!("/proc/self/fd/{}", self.fd.as_raw_fd());
        let fd = nix::fcntl::open(
            path.as_str(),
            OFlag::O_RDONLY | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| ShmError::Reopen { source: e.into() })?;
        Ok(fd)
    }

    /// Size in bytes (the requested size rounded up to whole pages).
    pub fn size_bytes(&self) -> u64 {
        self.size_bytes
    }

    /// Whether the segment lives on hugetlbfs pages.
    pub fn is_hugetlb(&self) -> bool {
        self.hugetlb
    }
}

/// The base page size.
pub(crate) fn page_size() -> u64 {
    nix::unistd::sysconf(nix::unistd::SysconfVar::PAGE_SIZE)
        .ok()
        .flatten()
        .map_or(4096, |v| v as u64)
}

/// Zeroes the pages `fallocate` gave a shmem file (sealed). shmem allocates them but leaves
/// each to be zeroed by the first fault on it, in whichever process makes it: a producer's first
/// pass over the store (0.3-1.2 s of its CPU per GiB on a 2-vCPU VM, in the stage that writes
/// samples). Here a temporary read-only mapping faults each page in
/// ([`Mapping::populate_read`]), 64 MiB at a time on up to 8 threads, and is unmapped: later
/// mappings find the pages ready and build only their own page tables. Where the kernel refuses
/// `MADV_POPULATE_READ` (before 5.14) the pages are zeroed at first touch, as before.
fn zero_now(fd: &OwnedFd, size_bytes: u64, threads: usize) -> Result<(), ShmError> {
    const CHUNK: u64 = 64 << 20;
    let fd = fd
        .try_clone()
        .map_err(|source| ShmError::Prefault { size_bytes, source })?;
    let map = Mapping::new(fd, size_bytes, Access::ReadOnly, false)?;
    let chunks = size_bytes.div_ceil(CHUNK);
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get() as u64)
        .clamp(1, threads.max(1) as u64)
        .min(chunks.max(1));
    let next = std::sync::atomic::AtomicU64::new(0);
    let zero = || {
        loop {
            let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            if i >= chunks {
                break;
            }
            map.populate_read(i * CHUNK, CHUNK);
        }
    };
    // A small segment (a stream's ring) is done on this thread.
    if threads == 1 {
        zero();
    } else {
        std::thread::scope(|scope| {
            for _ in 0..threads {
                scope.spawn(zero);
            }
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segment_is_sealed_against_resizing() {
        let seg = Segment::create(&SegmentOptions {
            name: "t".into(),
            size_bytes: 10_000,
            huge_pages: HugePages::Off,
            prefault: true,
        })
        .unwrap();
        assert_eq!(seg.size_bytes() % page_size(), 0);
        assert!(seg.size_bytes() >= 10_000);
        let err = nix::unistd::ftruncate(seg.fd(), 0).unwrap_err();
        assert_eq!(err, nix::Error::EPERM);
        crate::mapping::check_sealed(seg.fd(), seg.size_bytes()).unwrap();
        let ro = seg.reopen_readonly().unwrap();
        crate::mapping::check_sealed(ro.as_fd(), seg.size_bytes()).unwrap();
        let mode = nix::sys::stat::fstat(seg.fd()).unwrap().st_mode & 0o7777;
        assert_eq!(mode, 0o400, "nobody else can open it for writing");
    }

    /// shmem leaves the pages `fallocate` gives for the first fault to zero; a pre-faulted
    /// segment has them zeroed. Seen from a fresh mapping: a read fault maps the 64 KiB around
    /// the page (fault-around) only where those pages are ready, and one page where the fault
    /// itself has to make it.
    #[test]
    fn prefault_leaves_no_page_for_a_reader_or_writer_to_zero() {
        if let Some(on) = crate::shmem_thp_mode().filter(|m| !matches!(*m, "never" | "deny")) {
            eprintln!("skipped: shared-memory transparent huge pages are {on}");
            return;
        }
        let page = page_size();
        if page != 4096 {
            eprintln!("skipped: the figures are for 4 KiB pages and 64 KiB of fault-around");
            return;
        }
        let first_read_maps = |prefault| {
            let seg = Segment::create(&SegmentOptions {
                name: "t".into(),
                size_bytes: 32 * page,
                huge_pages: HugePages::Off,
                prefault,
            })
            .unwrap();
            let map = memmap2::MmapOptions::new()
                .len(seg.size_bytes() as usize)
                .map_raw_read_only(&seg.fd().try_clone_to_owned().unwrap())
                .unwrap();
            // SAFETY: inside the mapping; nobody writes the segment.
            let byte = unsafe { map.as_ptr().add(8) };
            // SAFETY: as above.
            assert_eq!(unsafe { std::ptr::read_volatile(byte) }, 0);
            crate::proc::mapped_pages(map.as_ptr(), page, 0..32).len()
        };
        assert_eq!(
            first_read_maps(false),
            1,
            "no fault-around over pages to be made"
        );
        assert!(
            first_read_maps(true) > 1,
            "the fault had to make its page: prefault left it unzeroed"
        );
    }

    #[test]
    fn huge_pages_on_without_reserve_names_the_knob() {
        let Some(info) = HugePageInfo::read() else {
            return;
        };
        let size = (info.free_pages + 1) * info.page_bytes;
        let err = Segment::create(&SegmentOptions {
            name: "t".into(),
            size_bytes: size,
            huge_pages: HugePages::On,
            prefault: false,
        })
        .unwrap_err();
        assert!(
            err.to_string().contains("/proc/sys/vm/nr_hugepages"),
            "{err}"
        );
    }
}
