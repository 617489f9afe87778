//! Client-side mappings of segments, and the one type that hands their bytes out.

use std::ops::Deref;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use memmap2::{Advice, MmapMut, MmapOptions, MmapRaw};

use crate::ShmError;

// The delivery ring's words are loaded atomically on read-only mappings, which the standard
// library allows for relaxed loads of at most a pointer's width: 64-bit targets only.
const _: () = assert!(
    std::mem::size_of::<usize>() == 8,
    "feedstore needs a 64-bit target"
);

/// How a segment is mapped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// `PROT_READ`; the only choice for a descriptor opened read-only.
    ReadOnly,
    /// `PROT_READ | PROT_WRITE`.
    ReadWrite,
}

/// What makes two mappings of a process the same (see [`Mapping::shared`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct MappingKey {
    /// The caller's: the daemon's node, its start epoch, the segment's index.
    identity: (u32, u32, u32),
    /// Device and inode.
    inode: (u64, u64),
    len: u64,
    access: Access,
    /// The descriptor's open mode (`O_ACCMODE`).
    mode: i32,
}

/// The process whose mappings [`mapped_list`] holds: a forked child sees another pid and maps
/// its own.
static LIST_OWNER: AtomicU32 = AtomicU32::new(0);

/// The live mappings made by [`Mapping::shared`] in this process.
fn mapped_list() -> std::sync::MutexGuard<'static, Vec<(MappingKey, Weak<Mapping>)>> {
    static MAPPED: std::sync::Mutex<Vec<(MappingKey, Weak<Mapping>)>> =
        std::sync::Mutex::new(Vec::new());
    MAPPED.lock().unwrap_or_else(|e| e.into_inner())
}

/// A whole segment mapped `MAP_SHARED` into this process.
///
/// The mapping owns its descriptor's memory for as long as it lives: dropping the daemon's
/// segment, or the daemon itself dying, does not unmap it. Views handed to users keep the
/// mapping alive through an `Arc` ([`SharedBytes`]). `&Mapping` gives no safe access to the
/// bytes, so it is shared between threads freely.
#[derive(Debug)]
pub struct Mapping {
    map: MmapRaw,
    access: Access,
    /// Of a read-write mapping, one bit per page, made on the first [`Mapping::populate_write`]:
    /// set once that page's writable page-table entry was built in this process. A bit is not
    /// cleared when the kernel drops the entry (swap, a collapse into a huge page, a forked
    /// child that inherited this mapping without its page tables): such a page faults in on
    /// touch, as it would without this.
    populated: std::sync::OnceLock<Box<[AtomicU64]>>,
    /// `log2` of the granule `populated` counts in: the page size (a huge page on hugetlbfs).
    page_shift: u32,
    /// `MADV_POPULATE_*` is refused for good (a kernel before 5.14, a seccomp filter): pages
    /// fault in on touch.
    no_populate: AtomicBool,
    /// The segment's descriptor, for private (copy-on-write) mappings of its objects; closed
    /// by [`Mapping::without_private_views`] where none will be made (the daemon's mappings,
    /// a stream's ring), so a mapping costs a descriptor only where it must.
    fd: Option<OwnedFd>,
    /// Whether the segment lives on hugetlbfs (whose private mappings reserve huge pages).
    hugetlb: bool,
}

impl Mapping {
    /// This mapping with the descriptor kept for private views closed: for a mapping of which
    /// no [`SharedBytes::private_view`] is made (the daemon's own, a stream's ring), so that it
    /// holds no descriptor beyond the mapping itself.
    pub fn without_private_views(mut self) -> Mapping {
        self.fd = None;
        self
    }

    /// Maps the first `len` bytes of a segment descriptor.
    ///
    /// Refuses descriptors that are not sealed against shrinking or are shorter than `len`, so the
    /// mapping can never be truncated under this process (which would turn reads into `SIGBUS`).
    /// `populate` builds the page tables now (`MAP_POPULATE`) instead of on first touch, so the
    /// first get or put of each page does not pay a page fault.
    pub fn new(fd: OwnedFd, len: u64, access: Access, populate: bool) -> Result<Mapping, ShmError> {
        check_sealed(fd.as_fd(), len)?;
        let map_err = |source: std::io::Error| ShmError::Map {
            len,
            access,
            source,
        };
        let len_usize = usize::try_from(len)
            .map_err(|_| map_err(std::io::Error::from_raw_os_error(libc::EFBIG)))?;
        let mut opts = MmapOptions::new();
        opts.len(len_usize);
        if populate {
            opts.populate();
        }
        let map = match access {
            Access::ReadOnly => opts.map_raw_read_only(&fd),
            Access::ReadWrite => opts.map_raw(&fd),
        }
        .map_err(map_err)?;
        // Best effort: only effective where shmem THP is `advise` or stronger.
        let _ = map.advise(Advice::HugePage);
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        let page = u64::try_from(page).unwrap_or(4096);
        // A hugetlbfs descriptor's pages are its block size (a memfd on shmem reports a huge
        // page's size there too when transparent huge pages are on, but maps 4 KiB pages as
        // well: only hugetlbfs counts).
        let hugetlb = nix::sys::statfs::fstatfs(fd.as_fd())
            .is_ok_and(|fs| fs.filesystem_type() == nix::sys::statfs::HUGETLBFS_MAGIC);
        let block = if hugetlb {
            nix::sys::stat::fstat(fd.as_fd()).map_or(0, |s| s.st_blksize as u64)
        } else {
            0
        };
        let granule = page.max(block);
        let granule = if granule.is_power_of_two() {
            granule
        } else {
            4096
        };
        let populated = std::sync::OnceLock::new();
        if populate && access == Access::ReadWrite {
            // MAP_POPULATE built every page-table entry already.
            let _ = populated.set(Self::bitmap(len, granule, u64::MAX));
        }
        Ok(Mapping {
            map,
            access,
            populated,
            page_shift: granule.trailing_zeros(),
            no_populate: AtomicBool::new(false),
            fd: Some(fd),
            hugetlb,
        })
    }

    fn bitmap(len: u64, granule: u64, fill: u64) -> Box<[AtomicU64]> {
        (0..len.div_ceil(granule).div_ceil(64))
            .map(|_| AtomicU64::new(fill))
            .collect()
    }

    /// Maps a segment descriptor as [`Mapping::new`] does (without populating), unless this
    /// process already maps the same memory the same way: then that mapping, shared. Every
    /// connection of a process receives the store's descriptors; mapping them once per process
    /// instead of once per connection spares a producer with N workers N page tables of the
    /// whole store.
    ///
    /// "The same" is the same `identity` (the caller's: the daemon's node, its start epoch and
    /// the segment's index, so a restarted daemon's segments never match an old mapping), the
    /// same inode, length, access and descriptor open mode, while a mapping of it lives. A
    /// process forked from the one that filled the list maps its own (it never takes the
    /// list's lock, which a thread of its parent may have held at the fork).
    pub fn shared(
        fd: OwnedFd,
        len: u64,
        access: Access,
        identity: (u32, u32, u32),
    ) -> Result<Arc<Mapping>, ShmError> {
        let os = |source: nix::Error| ShmError::Map {
            len,
            access,
            source: std::io::Error::from(source),
        };
        let stat = nix::sys::stat::fstat(fd.as_fd()).map_err(os)?;
        let mode = nix::fcntl::fcntl(fd.as_fd(), nix::fcntl::FcntlArg::F_GETFL).map_err(os)?
            & libc::O_ACCMODE;
        let key = MappingKey {
            identity,
            inode: (stat.st_dev as u64, stat.st_ino as u64),
            len,
            access,
            mode,
        };
        let pid = std::process::id();
        let owner = match LIST_OWNER.compare_exchange(0, pid, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => pid,
            Err(owner) => owner,
        };
        if owner != pid {
            return Ok(Arc::new(Mapping::new(fd, len, access, false)?));
        }
        let find = |mapped: &mut Vec<(MappingKey, Weak<Mapping>)>| {
            mapped.retain(|(_, weak)| weak.strong_count() > 0);
            mapped
                .iter()
                .find(|(k, _)| *k == key)
                .and_then(|(_, weak)| weak.upgrade())
        };
        if let Some(existing) = find(&mut mapped_list()) {
            return Ok(existing);
        }
        // Mapped without the lock held; another connection of this process may have mapped it
        // meanwhile, and then theirs is kept (ours goes).
        let mapping = Arc::new(Mapping::new(fd, len, access, false)?);
        let mut mapped = mapped_list();
        if let Some(existing) = find(&mut mapped) {
            return Ok(existing);
        }
        mapped.push((key, Arc::downgrade(&mapping)));
        Ok(mapping)
    }

    /// Builds the writable page-table entries of the pages under `offset..offset + len` that
    /// this process has not built yet (one call per run of such pages), before a writer copies
    /// into a freshly reserved object. The first write of a page of shared memory costs a page
    /// fault either way; taken ahead in one call, the copy then runs at memory speed. Only the
    /// pages a writer is about to fill are done, when it reserves them: connecting builds no
    /// page tables, so the first sample is not made behind those of a whole store, and a
    /// process that writes a little of a large store maps a little of it. A page is done once
    /// per process (a bit per page remembers it; the bitmap, 32 KiB per GiB of 4 KiB pages, is
    /// made on the first call).
    ///
    /// It asks for `MADV_POPULATE_READ`, not `_WRITE`: the store's segments are shared memory
    /// (memfd, shmem or hugetlbfs), whose shared writable mappings the kernel maps writable on
    /// a read fault (nothing to track for writeback) and 16 pages per fault (fault-around),
    /// where a write fault maps one page. Measured on a 1 GiB memfd whose pages were zeroed,
    /// seconds per GiB (a C program, three rounds, 2026-12-03): the copy faulting page by page
    /// 0.49-0.51; `MADV_POPULATE_WRITE` 0.19-0.24 and then the copy 0.04; `MADV_POPULATE_READ`
    /// 0.08-0.09 and then the copy 0.04. (`cargo bench --bench store -- --first-touch` measures
    /// this function and the copy together: 0.13 s per GiB.) Were a kernel to map them
    /// read-only, the copy would take one write-protect fault per page, as without this, and
    /// still see the right bytes.
    ///
    /// Contents are untouched. A no-op on a read-only mapping, a range outside the mapping, or
    /// where the kernel refuses `MADV_POPULATE_READ` (before 5.14, or a seccomp filter): then
    /// pages fault in on touch.
    pub fn populate_write(&self, offset: u64, len: u64) {
        let end = offset.saturating_add(len).min(self.map.len() as u64);
        if self.access != Access::ReadWrite
            || offset >= end
            || self.no_populate.load(Ordering::Relaxed)
        {
            return;
        }
        let shift = self.page_shift;
        let populated = self
            .populated
            .get_or_init(|| Self::bitmap(self.map.len() as u64, 1 << shift, 0));
        let (first, last) = (offset >> shift, (end - 1) >> shift);
        let bit = |page: u64| (&populated[(page / 64) as usize], 1u64 << (page % 64));
        let built = |page: u64| {
            let (word, mask) = bit(page);
            word.load(Ordering::Relaxed) & mask != 0
        };
        let mut page = first;
        while page <= last {
            // Skip what is built, a word at a time where it can.
            if page % 64 == 0 && bit(page).0.load(Ordering::Relaxed) == u64::MAX {
                page += 64;
                continue;
            }
            if built(page) {
                page += 1;
                continue;
            }
            // A run of pages not built yet: one call.
            let start = page;
            while page <= last && !built(page) {
                page += 1;
            }
            // The mapping's last page may be partial (segments are sized in 4 KiB pages).
            let at = (start << shift) as usize;
            let run = (((page - start) << shift) as usize).min(self.map.len() - at);
            if !self.populate(Advice::PopulateRead, at, run) {
                return;
            }
            for p in start..page {
                let (word, mask) = bit(p);
                word.fetch_or(mask, Ordering::Relaxed);
            }
        }
    }

    /// `MADV_POPULATE_READ` or `_WRITE` over `len` bytes at `at`: whether it was done. Refused
    /// for good (a kernel before 5.14, a seccomp filter): no later call asks again. Anything
    /// else (memory pressure, a page the kernel could not fault): the access faults the pages
    /// in as it goes.
    fn populate(&self, advice: Advice, at: usize, len: usize) -> bool {
        match self.map.advise_range(advice, at, len) {
            Ok(()) => true,
            Err(e) => {
                if matches!(
                    e.raw_os_error(),
                    Some(libc::EINVAL | libc::EPERM | libc::ENOSYS)
                ) {
                    self.no_populate.store(true, Ordering::Relaxed);
                }
                tracing::debug!(error = %e, ?advice, "building page tables ahead of use failed");
                false
            }
        }
    }

    /// Builds this process's page tables of the pages under `offset..offset + len` for reading
    /// (`MADV_POPULATE_READ`), so a first read of them takes no page faults: for a thread that
    /// receives objects ahead of the thread that reads them (a loader's receiving thread).
    /// Costs about what the faults would (a read fault maps 64 KiB; about 0.05 s per GiB over a
    /// read of mapped pages; little for pages already mapped), on the calling thread. Contents
    /// are untouched; the range is clipped to the mapping; where the kernel refuses it (before
    /// 5.14, a seccomp filter) the read faults the pages in, and later calls do nothing.
    pub fn populate_read(&self, offset: u64, len: u64) {
        let map_len = self.map.len() as u64;
        let end = offset.saturating_add(len).min(map_len);
        if offset >= end || self.no_populate.load(Ordering::Relaxed) {
            return;
        }
        // memmap2 aligns the start down to a page; the kernel rounds the length up.
        self.populate(
            Advice::PopulateRead,
            offset as usize,
            (end - offset) as usize,
        );
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether the mapping is empty (never, for a real segment).
    pub fn is_empty(&self) -> bool {
        self.map.len() == 0
    }

    /// How the mapping was made.
    pub fn access(&self) -> Access {
        self.access
    }

    /// Whether `ptr` points into this mapping.
    pub fn contains(&self, ptr: *const u8) -> bool {
        let start = self.map.as_ptr() as usize;
        (start..start + self.map.len()).contains(&(ptr as usize))
    }

    /// Pointer to `offset`, if `offset..offset + len` lies inside the mapping.
    pub fn range_ptr(&self, offset: u64, len: u64) -> Option<*mut u8> {
        let end = offset.checked_add(len)?;
        if end > self.map.len() as u64 {
            return None;
        }
        // `offset <= len() <= isize::MAX`, so the add stays inside the allocation.
        Some(self.map.as_mut_ptr().wrapping_add(offset as usize))
    }

    /// Borrows `len` bytes at `offset` for reading.
    ///
    /// # Safety
    /// The caller must hold a right to read the range that keeps it immutable for the returned
    /// lifetime: in feedstore, a lease on a sealed object. The daemon never hands out a writable
    /// range that overlaps a sealed or leased object; a writer process that scribbles outside its
    /// own reservation breaks that contract, which this process cannot check.
    pub unsafe fn bytes(&self, offset: u64, len: u64) -> Option<&[u8]> {
        let ptr = self.range_ptr(offset, len)?;
        // SAFETY: the range lies inside the live mapping (checked above); immutability for the
        // lifetime is the caller's contract.
        Some(unsafe { std::slice::from_raw_parts(ptr, len as usize) })
    }

    /// Borrows `len` bytes at `offset` for writing. `None` for a read-only mapping or a range
    /// outside it.
    ///
    /// # Safety
    /// The caller must have exclusive write access to the range for the returned lifetime: in
    /// feedstore, an unsealed reservation created by this client. No other `&[u8]` or `&mut [u8]`
    /// over the range may exist in this process meanwhile.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn bytes_mut(&self, offset: u64, len: u64) -> Option<&mut [u8]> {
        if self.access != Access::ReadWrite {
            return None;
        }
        let ptr = self.range_ptr(offset, len)?;
        // SAFETY: the range lies inside a live writable mapping (checked above); exclusivity for
        // the lifetime is the caller's contract.
        Some(unsafe { std::slice::from_raw_parts_mut(ptr, len as usize) })
    }

    /// The mapping as 64-bit words that this and other processes access only atomically (a
    /// delivery ring). `None` for a read-only mapping, where a store would fault.
    pub fn atomic_words(&self) -> Option<&[AtomicU64]> {
        if self.access != Access::ReadWrite {
            return None;
        }
        let ptr = self.map.as_mut_ptr().cast::<AtomicU64>();
        // SAFETY: the mapping is page-aligned (so 8-byte aligned), writable, and lives as long as
        // `&self`; `AtomicU64` has the layout of `u64` and permits concurrent access by other
        // threads and, through the shared mapping, other processes, which by contract touch these
        // words only atomically too.
        Some(unsafe { std::slice::from_raw_parts(ptr, self.map.len() / 8) })
    }

    /// Atomically loads 64-bit word `index` (byte offset `8 × index`) with relaxed ordering;
    /// also on a read-only mapping. Callers order their loads with fences. Panics past the end.
    pub fn load_word_relaxed(&self, index: usize) -> u64 {
        assert!(
            index < self.map.len() / 8,
            "word {index} outside the mapping"
        );
        let ptr = self.map.as_mut_ptr().cast::<u64>().wrapping_add(index);
        // SAFETY: the word lies inside the live, page-aligned mapping (checked above). It may be
        // read-only: the standard library guarantees only relaxed atomic loads of at most a
        // pointer's width to work on read-only memory ("Atomic accesses to read-only memory" in
        // `core::sync::atomic`), which is exactly this load (an acquire load may be lowered to
        // an instruction that writes); nothing here stores through it.
        unsafe { AtomicU64::from_ptr(ptr) }.load(Ordering::Relaxed)
    }
}

/// Bytes of a shared mapping, handed out with what keeps them valid: the mapping itself (an
/// `Arc`, so the memory stays mapped whatever else is dropped) and a hold `H` (in feedstore, a
/// lease on a sealed object, returned when `H` is dropped) that keeps them from changing.
///
/// The only safe way shared-memory bytes reach a user: no raw pointer escapes it but through
/// [`SharedBytes::private_view`] (an `unsafe fn`, whose caller keeps the hold for the view's
/// life), and it needs no hand-written `Send`/`Sync` (it is `Send`/`Sync` when `H` is).
pub struct SharedBytes<H> {
    /// Dropped first: the bytes are given back while still mapped.
    hold: H,
    mapping: Arc<Mapping>,
    offset: usize,
    len: usize,
}

impl<H> SharedBytes<H> {
    /// `len` bytes at `offset` of `mapping`, valid for as long as `hold` lives. Gives `hold`
    /// back if the range is not inside the mapping.
    ///
    /// # Safety
    /// For as long as `hold` is alive, nothing may write the range: in feedstore, `hold` owns a
    /// lease on a sealed object, and the daemon hands no writer a range overlapping a leased
    /// object until the lease is returned (which only dropping `hold` does). A writer process
    /// that scribbles outside its own reservation breaks that contract, which this process
    /// cannot check; readers' mappings are read-only, so no reader can.
    pub unsafe fn new(mapping: Arc<Mapping>, offset: u64, len: u64, hold: H) -> Result<Self, H> {
        if mapping.range_ptr(offset, len).is_none() {
            return Err(hold);
        }
        Ok(SharedBytes {
            hold,
            mapping,
            // Both fit `usize`: the range lies inside a mapping of `usize` length.
            offset: offset as usize,
            len: len as usize,
        })
    }

    /// What keeps the bytes valid.
    pub fn hold(&self) -> &H {
        &self.hold
    }

    /// Builds this process's page tables of the bytes now ([`Mapping::populate_read`]), so
    /// their first read takes no page faults.
    pub fn prefault(&self) {
        self.mapping
            .populate_read(self.offset as u64, self.len as u64);
    }

    /// The mapping the bytes lie in.
    pub fn mapping(&self) -> &Arc<Mapping> {
        &self.mapping
    }

    /// A private, writable view of the same bytes, kept valid by `keep` (what keeps `self`'s
    /// hold alive: the view's pages that were not written are still the shared ones, and show
    /// the object only while it is held).
    ///
    /// The view is a `MAP_PRIVATE` mapping of the object's pages of the segment: reads share
    /// the store's pages (nothing is copied), and a write copies the one page it touches into
    /// this process's memory (a page fault and 4 KiB copied), seen by nobody else: not the
    /// store, not other readers, not another view of the same object. `populate` builds its
    /// page tables now (`MADV_POPULATE_READ`), as [`SharedBytes::prefault`] does. On hugetlbfs,
    /// where a private mapping would reserve a huge page per 2 MiB for copies that may never
    /// happen (and `SIGBUS` a write when none is free), the bytes are copied into anonymous
    /// memory instead ([`PrivateBytes::copied`]).
    ///
    /// # Safety
    /// `keep` keeps `self`'s hold (the lease on the object) alive for the view's whole life:
    /// once the object's range is reused for another object, the view's unwritten pages would
    /// show that object's bytes.
    pub unsafe fn private_view<K>(
        &self,
        keep: K,
        populate: bool,
    ) -> Result<PrivateBytes<K>, ShmError> {
        let map_err = |source: std::io::Error| ShmError::Map {
            len: self.len as u64,
            access: Access::ReadWrite,
            source,
        };
        if self.len == 0 {
            return Ok(PrivateBytes {
                _map: None,
                ptr: std::ptr::NonNull::dangling().as_ptr(),
                len: 0,
                copied: false,
                keep,
            });
        }
        let mapping = &self.mapping;
        let copied = mapping.hugetlb;
        let mut map = if copied {
            let mut map = MmapOptions::new()
                .len(self.len)
                .map_anon()
                .map_err(map_err)?;
            map.copy_from_slice(self);
            map
        } else {
            let mut opts = MmapOptions::new();
            // memmap2 maps from the page below `offset` and points past the difference.
            opts.offset(self.offset as u64).len(self.len);
            let fd = mapping.fd.as_ref().ok_or_else(|| {
                map_err(std::io::Error::other(
                    "a mapping made without private views (its descriptor closed)",
                ))
            })?;
            // SAFETY: the descriptor is a segment sealed against shrinking (checked when the
            // mapping was made), so no page of the mapping can be truncated away; the mapping is
            // private, so nothing this process writes to it reaches the segment. Its unwritten
            // pages follow the segment's: the object's bytes are immutable while `keep` holds
            // it (this function's contract); the bytes of the first and last pages beyond the
            // object may change, but no pointer handed out reaches them.
            unsafe { opts.map_copy(fd) }.map_err(map_err)?
        };
        if populate && !copied {
            let _ = map.advise(Advice::PopulateRead);
        }
        let ptr = map.as_mut_ptr();
        Ok(PrivateBytes {
            _map: Some(map),
            ptr,
            len: self.len,
            copied,
            keep,
        })
    }
}

/// A private, writable view of an object's bytes (see [`SharedBytes::private_view`]): this
/// process's own copy-on-write mapping, unmapped when dropped (before `keep` is).
///
/// Its bytes are handed out as a raw pointer ([`PrivateBytes::as_ptr`]), which its users write
/// through (numpy arrays, torch tensors); [`PrivateBytes::bytes`] reads them.
pub struct PrivateBytes<K> {
    /// Dropped first: unmapped before what keeps the shared pages under it goes. (Only held:
    /// `ptr` is its first byte.)
    _map: Option<MmapMut>,
    ptr: *mut u8,
    len: usize,
    copied: bool,
    keep: K,
}

// SAFETY: the mapping is this value's own (moving it between threads moves nothing shared);
// `&PrivateBytes` hands out a raw pointer and a slice whose use with concurrent writes through
// that pointer is governed by `bytes`' contract, not by the type.
unsafe impl<K: Send> Send for PrivateBytes<K> {}
// SAFETY: as above.
unsafe impl<K: Sync> Sync for PrivateBytes<K> {}

impl<K> PrivateBytes<K> {
    /// The first byte, writable.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether the bytes were copied (hugetlbfs) rather than mapped copy-on-write.
    pub fn copied(&self) -> bool {
        self.copied
    }

    /// What keeps the shared pages under it valid.
    pub fn keep(&self) -> &K {
        &self.keep
    }

    /// The bytes.
    ///
    /// # Safety
    /// Nothing writes through [`PrivateBytes::as_ptr`] while the slice lives.
    pub unsafe fn bytes(&self) -> &[u8] {
        // SAFETY: `ptr..ptr + len` is this value's mapping (or dangling with len 0); the
        // caller rules out writes for the slice's life.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl<K> std::fmt::Debug for PrivateBytes<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrivateBytes")
            .field("len", &self.len)
            .field("copied", &self.copied)
            .finish()
    }
}

impl<H> Deref for SharedBytes<H> {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        let ptr = self.mapping.map.as_ptr().wrapping_add(self.offset);
        // SAFETY: `offset..offset + len` lies inside the mapping (checked in `new`), which the
        // `Arc` keeps mapped; `hold` keeps the range unchanged for as long as `self` lives
        // (`new`'s contract), so a shared slice for `&self`'s lifetime is sound.
        unsafe { std::slice::from_raw_parts(ptr, self.len) }
    }
}

impl<H> AsRef<[u8]> for SharedBytes<H> {
    fn as_ref(&self) -> &[u8] {
        self
    }
}

impl<H: std::fmt::Debug> std::fmt::Debug for SharedBytes<H> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedBytes")
            .field("hold", &self.hold)
            .field("offset", &self.offset)
            .field("len", &self.len)
            .finish()
    }
}

/// Checks that `fd` is a segment sealed against size changes and at least `len` bytes long: what
/// a mapping needs so that nobody can shrink the memory under it.
pub(crate) fn check_sealed(fd: std::os::fd::BorrowedFd<'_>, len: u64) -> Result<(), ShmError> {
    let seals = nix::fcntl::fcntl(fd, nix::fcntl::FcntlArg::F_GET_SEALS).map_err(|e| {
        ShmError::NotASegment {
            reason: format!("F_GET_SEALS failed: {e}"),
        }
    })?;
    let seals = nix::fcntl::SealFlag::from_bits_truncate(seals);
    if !seals.contains(nix::fcntl::SealFlag::F_SEAL_SHRINK) {
        return Err(ShmError::NotASegment {
            reason: "not sealed against shrinking".into(),
        });
    }
    let actual = nix::sys::stat::fstat(fd)
        .map_err(|e| ShmError::NotASegment {
            reason: format!("fstat failed: {e}"),
        })?
        .st_size as u64;
    if actual < len {
        return Err(ShmError::NotASegment {
            reason: format!("descriptor holds {actual} bytes, {len} announced"),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{HugePages, Segment, SegmentOptions};

    fn segment() -> Segment {
        Segment::create(&SegmentOptions {
            name: "map-test".into(),
            size_bytes: 1 << 16,
            huge_pages: HugePages::Off,
            prefault: true,
        })
        .unwrap()
    }

    /// A read-write and a read-only mapping of `seg`, both populated.
    fn both_ways(seg: &Segment) -> (Mapping, Mapping) {
        let rw = Mapping::new(
            seg.fd().try_clone_to_owned().unwrap(),
            seg.size_bytes(),
            Access::ReadWrite,
            true,
        )
        .unwrap();
        let ro = Mapping::new(
            seg.reopen_readonly().unwrap(),
            seg.size_bytes(),
            Access::ReadOnly,
            true,
        )
        .unwrap();
        (rw, ro)
    }

    #[test]
    fn readonly_descriptor_refuses_a_writable_mapping() {
        let seg = segment();
        let ro = seg.reopen_readonly().unwrap();
        let err = Mapping::new(ro, seg.size_bytes(), Access::ReadWrite, false).unwrap_err();
        let os = err.os_error().and_then(|e| e.raw_os_error());
        assert_eq!(os, Some(libc::EACCES), "{err}");
    }

    #[test]
    fn a_private_view_is_writable_and_its_writes_reach_nobody_else() {
        let seg = segment();
        let (rw, ro) = both_ways(&seg);
        let ro = Arc::new(ro);
        // An object that straddles a page boundary at an unaligned offset.
        let (offset, len) = (4096 - 100, 5000usize);
        // SAFETY: nothing else maps the test's segment; the range is in bounds.
        let object = unsafe { rw.bytes_mut(offset as u64, len as u64) }.unwrap();
        for (i, b) in object.iter_mut().enumerate() {
            *b = (i % 251) as u8;
        }
        let expected: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
        // SAFETY: nothing writes the range while the views live but the views themselves.
        let shared =
            unsafe { SharedBytes::new(ro.clone(), offset as u64, len as u64, ()) }.unwrap();
        // SAFETY: nothing reuses the range while the views live (the test holds the segment).
        let first = unsafe { shared.private_view("keep", true) }.unwrap();
        // SAFETY: as above.
        let second = unsafe { shared.private_view("keep", false) }.unwrap();
        assert!(!first.copied() && first.len() == len && *first.keep() == "keep");
        // SAFETY: no writes while the slices are read.
        assert_eq!(unsafe { first.bytes() }, &expected[..]);
        {
            // SAFETY: the view's own range; nothing else reads it while the slice lives.
            let view = unsafe { std::slice::from_raw_parts_mut(first.as_ptr(), len) };
            view[0] = 7;
            view[len - 1] = 9;
        }
        // SAFETY: as above.
        let a = unsafe { first.bytes() };
        // SAFETY: as above.
        let b = unsafe { second.bytes() };
        assert_eq!((a[0], a[len - 1]), (7, 9));
        assert_eq!(&a[1..len - 1], &expected[1..len - 1]);
        assert_eq!(b, &expected[..], "another view of the object saw the write");
        assert_eq!(&*shared, &expected[..], "the store's pages saw the write");
        // Unwritten pages are the shared ones: the store's later bytes show through them
        // (which a lease rules out for a real object).
        object[2000] = 1;
        // SAFETY: as above.
        assert_eq!(unsafe { first.bytes() }[2000], 1);
        drop(first);
        // SAFETY: as above.
        assert_eq!(unsafe { second.bytes() }[0], expected[0]);
        // SAFETY: in bounds; empty.
        let empty = unsafe { SharedBytes::new(ro, 0, 0, ()) }.unwrap();
        // SAFETY: an empty view maps nothing.
        assert!(unsafe { empty.private_view((), true) }.unwrap().is_empty());
    }

    #[test]
    fn writes_through_one_mapping_are_seen_through_another() {
        let seg = segment();
        let (rw, ro) = both_ways(&seg);
        // SAFETY: this test is the only user of the range.
        unsafe { rw.bytes_mut(128, 4).unwrap() }.copy_from_slice(b"feed");
        // SAFETY: no writer touches the range any more.
        assert_eq!(unsafe { ro.bytes(128, 4).unwrap() }, b"feed");
        // SAFETY: a read-only mapping never yields a mutable slice.
        assert!(unsafe { ro.bytes_mut(128, 4) }.is_none());
        // SAFETY: out-of-range requests return None before any slice is formed.
        assert!(unsafe { ro.bytes(seg.size_bytes() - 2, 4) }.is_none());
        // SAFETY: as above; an overflowing range is refused.
        assert!(unsafe { ro.bytes(u64::MAX, 2) }.is_none());
    }

    /// Connections of one process map a store once: the same memory the same way gives the same
    /// mapping while it lives; another access, another segment, another daemon start, or a
    /// mapping gone: a new one.
    #[test]
    fn a_process_maps_the_same_memory_once() {
        let (seg, other) = (segment(), segment());
        let id = (7, 1, 0);
        let rw = || seg.fd().try_clone_to_owned().unwrap();
        let share = |fd, access, id| Mapping::shared(fd, seg.size_bytes(), access, id).unwrap();
        let first = share(rw(), Access::ReadWrite, id);
        assert!(Arc::ptr_eq(&first, &share(rw(), Access::ReadWrite, id)));
        let ro = share(seg.reopen_readonly().unwrap(), Access::ReadOnly, id);
        assert!(ro.access() == Access::ReadOnly && !Arc::ptr_eq(&first, &ro));
        let restarted = share(rw(), Access::ReadWrite, (7, 2, 0));
        assert!(!Arc::ptr_eq(&first, &restarted), "another daemon start");
        let elsewhere = share(
            other.fd().try_clone_to_owned().unwrap(),
            Access::ReadWrite,
            id,
        );
        assert!(!Arc::ptr_eq(&first, &elsewhere), "another segment");
        // A read-only mapping made from a read-write descriptor is not handed to readers.
        let ro_of_rw = share(rw(), Access::ReadOnly, id);
        assert!(!Arc::ptr_eq(&ro, &ro_of_rw));

        let weak = Arc::downgrade(&first);
        drop(first);
        assert!(weak.upgrade().is_none(), "the list holds no mapping alive");
    }

    /// A writer's page tables are built for the pages it is about to fill (and at most the
    /// kernel's 64 KiB of fault-around beside them), writable: writing them takes no fault; the
    /// contents stay; a read-only mapping builds none; a mapping made with MAP_POPULATE has them
    /// all.
    #[test]
    fn page_tables_are_built_for_what_is_written_only() {
        // Page-sized figures: transparent huge pages for shared memory could map more at once.
        if let Some(on) = crate::shmem_thp_mode().filter(|m| !matches!(*m, "never" | "deny")) {
            eprintln!("skipped: shared-memory transparent huge pages are {on}");
            return;
        }
        let rss_kib = |ptr| crate::resident_kib(ptr).unwrap().expect("mapped");
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as u64;
        let kib = page / 1024;
        let pages = 64;
        let seg = Segment::create(&SegmentOptions {
            name: "populate-test".into(),
            size_bytes: pages * page,
            huge_pages: HugePages::Off,
            prefault: true,
        })
        .unwrap();
        let rw = Mapping::shared(
            seg.fd().try_clone_to_owned().unwrap(),
            seg.size_bytes(),
            Access::ReadWrite,
            (9, 1, 0),
        )
        .unwrap();
        let base = rw.map.as_ptr();
        let mapped = |pages| crate::proc::mapped_pages(base, page, pages);
        let minor_faults = || {
            // SAFETY: getrusage writes the struct it is given.
            let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
            // SAFETY: as above.
            let got = unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut usage) };
            assert_eq!(got, 0);
            usage.ru_minflt
        };
        // Writing a byte into each page of `range` takes no page fault.
        let writes_without_faults = |range: std::ops::Range<u64>| {
            let before = minor_faults();
            for p in range {
                // SAFETY: this test is the only user of the range.
                unsafe { rw.bytes_mut(p * page + 8, 1).unwrap() }.copy_from_slice(&[p as u8]);
            }
            minor_faults() == before
        };
        assert_eq!(rss_kib(base), 0, "mapping builds no page tables");
        // SAFETY: this test is the only user of the range.
        unsafe { rw.bytes_mut(64, 4).unwrap() }.copy_from_slice(b"kept");
        assert_eq!(mapped(0..pages), [0], "a write faults its page in");
        // Pages 2, 3 and 4. A read fault may map the rest of its 64 KiB-aligned window of
        // virtual addresses too (fault-around): at most 15 pages either side.
        rw.populate_write(2 * page + 100, 2 * page + 500);
        let built = mapped(0..pages);
        assert!(built.starts_with(&[0]) && [2, 3, 4].iter().all(|p| built.contains(p)));
        assert!(
            built.iter().all(|&p| p < 20),
            "nothing beyond fault-around: {built:?}"
        );
        rw.populate_write(0, 0);
        rw.populate_write(seg.size_bytes(), page);
        assert!(mapped(20..pages).is_empty(), "nothing outside the range");
        // What it is for: writing the built pages takes no page fault (built by a read,
        // `MADV_POPULATE_READ`: shared memory is mapped writable on a read). Asserted on x86-64:
        // an arm64 core without hardware dirty-bit tracking faults to mark a page dirty.
        let dirty_bit_in_hardware = cfg!(target_arch = "x86_64");
        assert!(
            writes_without_faults(2..5) || !dirty_bit_in_hardware,
            "a write of a built page faults"
        );
        rw.populate_write(40 * page, 8 * page);
        assert!((40..48).all(|p| mapped(p..p + 1) == [p]));
        assert!(
            writes_without_faults(40..48) || !dirty_bit_in_hardware,
            "a write of a built page faults"
        );
        assert!(!rw.no_populate.load(Ordering::Relaxed));

        let ro = Mapping::new(
            seg.reopen_readonly().unwrap(),
            seg.size_bytes(),
            Access::ReadOnly,
            false,
        )
        .unwrap();
        ro.populate_write(0, seg.size_bytes());
        assert_eq!(rss_kib(ro.map.as_ptr()), 0, "a reader builds none");
        // SAFETY: no writer touches the range any more.
        assert_eq!(unsafe { ro.bytes(64, 4).unwrap() }, b"kept");

        let populated = Mapping::new(
            seg.fd().try_clone_to_owned().unwrap(),
            seg.size_bytes(),
            Access::ReadWrite,
            true,
        )
        .unwrap();
        assert_eq!(rss_kib(populated.map.as_ptr()), pages * kib);
        populated.populate_write(0, seg.size_bytes());
        assert_eq!(rss_kib(populated.map.as_ptr()), pages * kib);
    }

    #[test]
    fn shared_bytes_keep_their_mapping_and_range() {
        let seg = segment();
        let (rw, ro) = both_ways(&seg);
        // SAFETY: this test is the only user of the range.
        unsafe { rw.bytes_mut(64, 3).unwrap() }.copy_from_slice(b"abc");
        let ro = Arc::new(ro);
        let dropped = Arc::new(std::sync::atomic::AtomicBool::new(false));
        struct Hold(Arc<std::sync::atomic::AtomicBool>);
        impl Drop for Hold {
            fn drop(&mut self) {
                self.0.store(true, Ordering::Relaxed);
            }
        }
        // SAFETY: nothing writes the range while the view lives.
        let view = unsafe { SharedBytes::new(ro.clone(), 64, 3, Hold(dropped.clone())) }
            .ok()
            .unwrap();
        drop(ro);
        drop(seg);
        assert_eq!(&*view, b"abc", "the view keeps the memory mapped");
        drop(view);
        assert!(
            dropped.load(Ordering::Relaxed),
            "dropping the view drops its hold"
        );
        let ro = Arc::new(
            Mapping::new(
                segment().reopen_readonly().unwrap(),
                1 << 16,
                Access::ReadOnly,
                false,
            )
            .unwrap(),
        );
        // SAFETY: the range is refused before any slice is formed.
        let refused = unsafe { SharedBytes::new(ro, (1 << 16) - 1, 2, 7u8) };
        assert_eq!(refused.err(), Some(7), "the hold comes back");
    }

    fn assert_send_sync<T: Send + Sync>() {}

    #[test]
    fn shared_bytes_are_send_and_sync_without_unsafe_impls() {
        assert_send_sync::<SharedBytes<()>>();
        assert_send_sync::<Mapping>();
    }

    #[test]
    fn unsealed_descriptor_is_refused() {
        let fd = nix::sys::memfd::memfd_create(c"plain", nix::sys::memfd::MFdFlags::MFD_CLOEXEC)
            .unwrap();
        nix::unistd::ftruncate(&fd, 4096).unwrap();
        let err = Mapping::new(fd, 4096, Access::ReadOnly, false).unwrap_err();
        assert!(matches!(err, ShmError::NotASegment { .. }), "{err}");
    }
}
