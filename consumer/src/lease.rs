//! Read-only views of sealed objects.

use std::ops::Deref;
use std::sync::Arc;

use feedstore_proto::{Handle, Location};
use feedstore_shm::Mapping;

use crate::Client;

/// A lease on a sealed object: derefs to its bytes, in place in shared memory.
///
/// While the lease lives the daemon will not evict, reuse or free the object (a delete waits for
/// it). Dropping the lease returns it to the daemon: with the client's next request, or after
/// the connection's release delay (1 ms by default), whichever comes first. The view keeps the segment mapped even if the
/// client or the daemon goes away, so the bytes stay valid for the lease's whole life.
pub struct Lease {
    client: Client,
    handle: Handle,
    /// Keeps the memory mapped for as long as the view exists.
    _mapping: Arc<Mapping>,
    ptr: *const u8,
    len: usize,
}

// SAFETY: the view is immutable bytes in a mapping that the `Arc` keeps alive; the daemon keeps the
// range immutable while the lease is held. Nothing is tied to the creating thread.
unsafe impl Send for Lease {}
// SAFETY: as above; `&Lease` only gives `&[u8]`.
unsafe impl Sync for Lease {}

impl Lease {
    pub(crate) fn new(
        client: Client,
        handle: Handle,
        mapping: Arc<Mapping>,
        loc: Location,
    ) -> Lease {
        let ptr = mapping
            .range_ptr(loc.offset, loc.len)
            .expect("range checked by Client::mapping");
        Lease {
            client,
            handle,
            _mapping: mapping,
            ptr,
            len: loc.len as usize,
        }
    }

    /// The object's handle.
    pub fn handle(&self) -> Handle {
        self.handle
    }

    /// The bytes (same as deref).
    pub fn as_bytes(&self) -> &[u8] {
        self
    }
}

impl Deref for Lease {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr..ptr+len` lies inside the mapping (checked at construction) that
        // `_mapping` keeps alive; the object is sealed and leased, so the daemon hands no writer a
        // range overlapping it until the lease is returned in `drop`.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl AsRef<[u8]> for Lease {
    fn as_ref(&self) -> &[u8] {
        self
    }
}

impl std::fmt::Debug for Lease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lease")
            .field("handle", &self.handle)
            .field("len", &self.len)
            .finish()
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.client.release(self.handle);
    }
}
