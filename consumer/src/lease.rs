//! Read-only views of sealed objects, each holding its own lease.

use std::ops::Deref;
use std::sync::Arc;

use feedstore_proto::frame::{Opcode, Request, Response};
use feedstore_proto::{Handle, Location};
use feedstore_shm::{Mapping, PrivateBytes, SharedBytes};

use crate::client::{Link, unexpected};
use crate::{Client, Error};

/// One lease this connection holds on an object, returned to the daemon when dropped (with the
/// client's next request, or after its release delay). It keeps the connection open, so the
/// daemon cannot reclaim the lease while this lives.
#[derive(Debug)]
pub(crate) struct LeaseHold {
    client: Client,
    handle: Handle,
    /// The lineage of the client's link the lease came on: a lease from a daemon the client
    /// has left since is not returned to a daemon started afresh (only to one that took that
    /// one over).
    lineage: u64,
}

impl LeaseHold {
    /// Takes ownership of a lease the daemon granted `client`'s connection (its link of
    /// `lineage`) on `handle`.
    pub(crate) fn new(client: Client, handle: Handle, lineage: u64) -> LeaseHold {
        LeaseHold {
            client,
            handle,
            lineage,
        }
    }

    pub(crate) fn handle(&self) -> Handle {
        self.handle
    }
}

impl Drop for LeaseHold {
    fn drop(&mut self) {
        self.client.release(self.handle, self.lineage);
    }
}

/// Wraps the bytes a lease protects; an error (and the hold dropped, so the lease returned) if
/// the daemon named a range outside the mapping.
///
/// # Safety
/// `hold` owns a lease this process's connection holds on the sealed object at `loc` in
/// `mapping`, returned only when `hold` is dropped. (The daemon hands no writer a range
/// overlapping a leased object until the lease is returned.)
pub(crate) unsafe fn leased_bytes<H>(
    mapping: Arc<Mapping>,
    loc: Location,
    hold: H,
) -> Result<SharedBytes<H>, Error> {
    // SAFETY: per this function's contract, `hold` owns a lease on the sealed object at `loc`,
    // which keeps every writer off the range until `hold` is dropped.
    unsafe { SharedBytes::new(mapping, loc.offset, loc.len, hold) }
        .map_err(|_| Error::Protocol("daemon named a range outside its segment".into()))
}

/// A lease on a sealed object: derefs to its bytes, in place in shared memory.
///
/// While the lease lives the daemon will not evict, reuse or free the object (a delete waits for
/// it). The lease belongs to this view alone: dropping the `Client` it came from, or the daemon
/// going away, does not end it, and the segment stays mapped, so the bytes stay valid and
/// unchanged for the lease's whole life. Dropping the lease returns it: with the client's next
/// request, or after the connection's release delay (1 ms by default).
pub struct Lease {
    bytes: SharedBytes<LeaseHold>,
    writer: u32,
}

impl Lease {
    /// # Safety
    /// As [`leased_bytes`]: `hold` is the lease on the sealed object at `loc`.
    pub(crate) unsafe fn new(
        mapping: Arc<Mapping>,
        loc: Location,
        hold: LeaseHold,
        writer: u32,
    ) -> Result<Lease, Error> {
        Ok(Lease {
            // SAFETY: forwarded contract.
            bytes: unsafe { leased_bytes(mapping, loc, hold)? },
            writer,
        })
    }

    /// The object's handle.
    pub fn handle(&self) -> Handle {
        self.bytes.hold().handle()
    }

    /// The uid of the client that wrote the object, as the daemon recorded it when the object
    /// was created (for a copy pulled from another node, as that node's daemon recorded it):
    /// check it before trusting the object's structure (a batch object's, say).
    /// [`Got::UNKNOWN_WRITER`](feedstore_proto::frame::Got::UNKNOWN_WRITER) from a daemon that
    /// records no writers (feedstore 0.1.0).
    pub fn writer(&self) -> u32 {
        self.writer
    }

    /// The bytes (same as deref).
    pub fn as_bytes(&self) -> &[u8] {
        self
    }

    /// Builds this process's page tables of the object now, so the first read of it takes no
    /// page faults (a page fault every 64 KiB of a store's pages this process has not read
    /// before, about 0.05 s per GiB): for a thread that takes objects ahead of the thread that
    /// reads them. The cost is the faults', moved to this thread.
    pub fn prefault(&self) {
        self.bytes.prefault();
    }

    /// A private, writable copy-on-write view of the object (see
    /// [`SharedBytes::private_view`]): reads share the store's pages, a write copies the page it
    /// touches into this process alone.
    ///
    /// # Safety
    /// `keep` keeps this lease alive for the view's whole life (an `Arc` holding it, say): the
    /// view's unwritten pages show the object only while it is leased.
    pub unsafe fn private_view<K>(
        &self,
        keep: K,
        populate: bool,
    ) -> Result<PrivateBytes<K>, Error> {
        // SAFETY: the caller's contract is this one's.
        Ok(unsafe { self.bytes.private_view(keep, populate) }?)
    }
}

impl Deref for Lease {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        &self.bytes
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
            .field("handle", &self.handle())
            .field("len", &self.bytes.len())
            .finish()
    }
}

/// How a client gets objects: leases become views here, so the client module does not import
/// this one.
impl Client {
    /// Takes a lease on a sealed object and returns a read-only view of its bytes in shared
    /// memory. The lease is released when the view is dropped.
    pub fn get(&self, handle: Handle) -> Result<Lease, Error> {
        self.get_batch(&[handle])?
            .pop()
            .expect("one result per handle")
    }

    /// Leases several objects, in as few round trips as the frame limits allow (one for up to
    /// ~47k handles).
    pub fn get_batch(&self, handles: &[Handle]) -> Result<Vec<Result<Lease, Error>>, Error> {
        self.batched(Opcode::Get, handles, |chunk| {
            let (results, link) = match self.call_linked(&Request::Get {
                handles: chunk.to_vec(),
            })? {
                (Response::Got(r), link) if r.len() == chunk.len() => (r, link),
                (other, _) => return Err(unexpected(other)),
            };
            // Every lease taken becomes a `Lease` (released on drop) before any error returns.
            Ok(results
                .into_iter()
                .zip(chunk)
                .map(|(r, &handle)| match r {
                    Ok(got) => {
                        let writer = link.believed_writer(got.writer);
                        self.lease(&link, handle, got.location, writer)
                    }
                    Err(status) => Err(Error::from_status(status, handle, 0, "")),
                })
                .collect())
        })
    }

    /// Wraps the lease the daemon just granted this connection on `link` on `handle` at `loc`
    /// (on an error the lease is returned).
    fn lease(
        &self,
        link: &Link,
        handle: Handle,
        loc: Location,
        writer: u32,
    ) -> Result<Lease, Error> {
        let hold = LeaseHold::new(self.clone(), handle, link.lineage());
        let mapping = link.mapping(loc)?.clone();
        // SAFETY: the daemon answered this connection's get of `handle` on `link` with `loc`:
        // a lease on the sealed object there (in that link's mapping), now owned by `hold`
        // alone.
        unsafe { Lease::new(mapping, loc, hold, writer) }
    }
}
