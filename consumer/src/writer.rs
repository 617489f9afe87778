//! Writable reservations: reserve -> write -> seal.

use std::sync::Arc;

use feedstore_proto::frame::{Opcode, Request};
use feedstore_proto::{Handle, Location};
use feedstore_shm::Mapping;

use crate::{Client, Error};

/// A reserved, unsealed object: writable by this client only, invisible to everyone else.
///
/// The typestate of a write: [`Client::create`] reserves, [`ObjectWriter::as_mut_slice`] writes in
/// place, [`ObjectWriter::seal`] publishes and gives the handle readers use. There is no way to
/// hand out a handle to unsealed bytes. Dropping the writer unsealed aborts the object; so does
/// the daemon if this process dies mid-write.
pub struct ObjectWriter {
    client: Client,
    handle: Handle,
    mapping: Arc<Mapping>,
    location: Location,
    done: bool,
}

impl ObjectWriter {
    pub(crate) fn new(
        client: Client,
        handle: Handle,
        mapping: Arc<Mapping>,
        location: Location,
    ) -> Self {
        ObjectWriter {
            client,
            handle,
            mapping,
            location,
            done: false,
        }
    }

    /// The handle the object will have once sealed. Until then no other client can get it.
    pub fn handle(&self) -> Handle {
        self.handle
    }

    /// Length of the object in bytes.
    pub fn len(&self) -> usize {
        self.location.len as usize
    }

    /// Whether the object is empty (never: objects have at least one byte).
    pub fn is_empty(&self) -> bool {
        self.location.len == 0
    }

    /// The object's bytes in shared memory, to write in place. Freshly reserved space holds
    /// whatever an earlier object left there; write every byte you mean to publish.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: the daemon reserved this range for this connection alone until seal or abort,
        // and `&mut self` makes this the only view of it in this process.
        unsafe {
            self.mapping
                .bytes_mut(self.location.offset, self.location.len)
        }
        .expect("writers map segments read-write, and the range was checked")
    }

    /// Publishes the object: immutable and visible to every client from now on.
    pub fn seal(mut self) -> Result<Handle, Error> {
        self.done = true;
        let handle = self.handle;
        self.client
            .each(Opcode::Seal, &[handle], |handles| Request::Seal { handles })?
            .pop()
            .expect("one result")?;
        Ok(handle)
    }

    /// Seals several writers, in as few round trips as the frame limits allow. On failure the
    /// writers that were not sealed are aborted.
    pub fn seal_batch(
        client: &Client,
        mut writers: Vec<ObjectWriter>,
    ) -> Result<Vec<Handle>, Error> {
        let handles: Vec<Handle> = writers.iter().map(|w| w.handle).collect();
        let results = client.each(Opcode::Seal, &handles, |handles| Request::Seal { handles })?;
        let mut first_err = None;
        for (w, r) in writers.iter_mut().zip(results) {
            match r {
                Ok(()) => w.done = true,
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        drop(writers); // aborts the unsealed ones
        match first_err {
            Some(e) => Err(e),
            None => Ok(handles),
        }
    }

    /// Hands the reservation over unsealed (to a stream put, which seals it in the daemon); the
    /// writer no longer aborts it on drop.
    pub(crate) fn hand_over(mut self) -> Handle {
        self.done = true;
        self.handle
    }

    /// Gives the reservation back unsealed.
    pub fn abort(mut self) -> Result<(), Error> {
        self.done = true;
        let handle = self.handle;
        self.client
            .each(Opcode::Abort, &[handle], |handles| Request::Abort {
                handles,
            })?
            .pop()
            .expect("one result")
    }
}

impl std::fmt::Debug for ObjectWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ObjectWriter")
            .field("handle", &self.handle)
            .field("len", &self.location.len)
            .finish()
    }
}

impl Drop for ObjectWriter {
    fn drop(&mut self) {
        if !self.done {
            let handle = self.handle;
            if let Err(e) = self
                .client
                .each(Opcode::Abort, &[handle], |handles| Request::Abort {
                    handles,
                })
            {
                tracing::debug!(%handle, error = %e, "abort of a dropped writer failed");
            }
        }
    }
}
