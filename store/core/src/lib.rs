//! The store's synchronous core: what `feedstored` knows, with no async runtime and no sockets.
//!
//! Everything here is plain state with methods, owned by the daemon behind one mutex and
//! unit-tested alone: [`alloc`] (free space in a segment), [`objects`] (the object table,
//! leases, pins and LRU eviction, keyed handles), and [`streams`] (ordered delivery to trainer
//! ranks: windows, delivery rings, remote feeding, the decode-once cache). The daemon crate
//! (`feedstore-store`, in `store/`) owns the sockets, tasks and timers and calls into it; what
//! a connection does reaches this crate as a method call with the connection's id.
//!
//! The only system calls made here are those of the shared memory itself (a stream's delivery
//! rings are memfd segments the core creates and writes) and one read of `/dev/urandom` for the
//! object table's key.

pub mod alloc;
pub mod objects;
pub mod streams;

/// `n` random bytes from the kernel.
pub fn random_bytes<const N: usize>() -> [u8; N] {
    use std::io::Read;
    let mut out = [0u8; N];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut out))
        .expect("reading /dev/urandom");
    out
}

/// Formats bytes for people: `1.5 GiB`.
pub fn format_bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut i = 0;
    while v >= 1024.0 && i + 1 < UNITS.len() {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", UNITS[i])
    }
}
