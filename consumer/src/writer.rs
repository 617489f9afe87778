//! Writable reservations: reserve -> write -> seal.

use std::collections::VecDeque;
use std::sync::Arc;

use feedstore_proto::Status;
use feedstore_proto::frame::{CREATE_AHEAD, CREATE_PIN, Created, Opcode, Request, Response};
use feedstore_proto::{Handle, Location};
use feedstore_shm::Mapping;

use crate::client::unexpected;
use crate::client::{Link, Ticket};
use crate::{Client, CreateOptions, Error};

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
        populate: bool,
        client: Client,
        handle: Handle,
        mapping: Arc<Mapping>,
        location: Location,
    ) -> Self {
        if populate {
            mapping.populate_write(location.offset, location.len);
        }
        client
            .inner
            .writers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(handle);
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

    /// The object's bytes as written so far (to read back what was written, e.g. to copy a
    /// finished sample elsewhere).
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: the range is this connection's unsealed reservation: no other client writes
        // it, and `&self` rules out this writer's `&mut` view while this one lives.
        unsafe { self.mapping.bytes(self.location.offset, self.location.len) }
            .expect("the range was checked when the object was reserved")
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

    /// Publishes the object without waiting for the daemon's reply: the seal is sent, and
    /// [`PendingSeal::wait`] reads whether it took. The daemon serves this connection's
    /// requests in order, so the object is sealed before any later request of this client is
    /// served; another connection that looks the handle up before then gets "not sealed",
    /// never other bytes: hand the handle to others once `wait` returned it. A writer making
    /// many objects sends a seal, makes its next object (whose reservation reads the seal's
    /// reply aside) and then waits: one round trip per object instead of two. If the seal
    /// cannot be sent the object is given back and `wait` says why.
    pub fn seal_later(mut self) -> PendingSeal {
        let handle = self.handle;
        let sent = self.client.submit(
            &Request::Seal {
                handles: vec![handle],
            },
            None,
        );
        // Sent: the daemon owns the outcome. Not sent: dropping the writer gives it back.
        if sent.is_ok() {
            self.done = true;
        }
        PendingSeal {
            client: self.client.clone(),
            handle,
            sent: Some(sent),
        }
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
        self.client
            .inner
            .writers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&self.handle);
        // (Never waits for a daemon that went away to come back: its reservations went with
        // it, or its successor drops them with this process.)
        if !self.done && !self.client.link_broken() {
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

/// A seal sent without waiting for its reply ([`ObjectWriter::seal_later`]). Dropping it
/// unread waits for the reply (giving the object back if the seal failed) and drops the
/// outcome.
#[must_use = "the object is only known sealed once waited for"]
pub struct PendingSeal {
    client: Client,
    handle: Handle,
    sent: Option<Result<Ticket, Error>>,
}

impl PendingSeal {
    /// The object's handle (not to be handed to another connection before `wait` returns it).
    pub fn handle(&self) -> Handle {
        self.handle
    }

    /// Waits for the seal's reply: the handle, now visible to every client, or why the seal
    /// failed (the object is then given back).
    pub fn wait(mut self) -> Result<Handle, Error> {
        self.finish()
    }

    fn finish(&mut self) -> Result<Handle, Error> {
        let Some(sent) = self.sent.take() else {
            return Ok(self.handle);
        };
        // Not sent: the writer gave the object back as it dropped.
        let ticket = sent?;
        confirm_one(&self.client, ticket, Some(self.handle)).map(|()| self.handle)
    }
}

/// Reads the reply to a one-handle request sent with [`Client::submit`]: a seal of `handle`
/// (whose object is given back if the seal failed, and the failure returned), or, for `None`,
/// an abort (whose failure is no one's concern: the daemon takes the space back when the
/// connection closes).
fn confirm_one(client: &Client, ticket: Ticket, handle: Option<Handle>) -> Result<(), Error> {
    let failure = match client.collect(ticket) {
        Ok(Response::Done(statuses)) if statuses.len() == 1 => (statuses[0] != Status::Ok)
            .then(|| Error::from_status(statuses[0], handle.unwrap_or_default(), 0, "")),
        Ok(other) => Some(Error::Protocol(format!("unexpected reply {other:?}"))),
        Err(e) => Some(e),
    };
    match (failure, handle) {
        (Some(failure), Some(handle)) => {
            // Best effort: the daemon also takes it back when the connection closes.
            let _ = client.each(Opcode::Abort, &[handle], |handles| Request::Abort {
                handles,
            });
            Err(failure)
        }
        _ => Ok(()),
    }
}

impl std::fmt::Debug for PendingSeal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PendingSeal")
            .field("handle", &self.handle)
            .field("waited", &self.sent.is_none())
            .finish()
    }
}

impl Drop for PendingSeal {
    fn drop(&mut self) {
        if let Err(e) = self.finish() {
            tracing::debug!(handle = %self.handle, error = %e, "a seal dropped unread failed");
        }
    }
}

/// Requests a [`PutPipeline`] sent and has not read the replies of, at most.
const MAX_UNCONFIRMED: usize = 8;

/// Many puts back to back, with the daemon's replies off the critical path (issue 17).
///
/// A plain [`Client::put`] makes two round trips around its copy, create and seal, and the seal
/// reaches a daemon that slept through the copy: waking it costs more than the round trip. The
/// pipeline keeps the next reservation ready (asked for, of the last put's size, before the copy
/// starts, so the daemon answers while the copy runs) and sends each seal without waiting for its
/// reply, which is read during a later put. A put of another size than the last one's reserves
/// in a round trip of its own (the unused reservation is given back without waiting), and so
/// does a put that finds the store full (the reservation asked for ahead never waits for space).
///
/// **When an object is visible.** The daemon serves a connection's requests in order, so an
/// object is sealed before any later request of this client is served: a stream put, a get, a
/// handle sent on with this client all see it sealed. Another connection that looks a handle up
/// before the seal arrives gets [`Error`] "not sealed", never other bytes. Call
/// [`PutPipeline::flush`] before handing handles to another process; it also returns the first
/// seal that failed (its object is given back). Dropping the pipeline gives back the
/// reservation kept ready and waits for the seals; a failure then is only logged.
pub struct PutPipeline {
    client: Client,
    /// The reservation asked for ahead, and its size.
    ahead: Option<(Ticket, u64)>,
    /// Requests sent whose replies are not read yet, oldest first: seals (with their handle,
    /// given back if the seal fails) and aborts of unused reservations.
    unconfirmed: VecDeque<(Ticket, Option<Handle>)>,
    /// The first failure, for the next call to return.
    failed: Option<Error>,
}

impl PutPipeline {
    pub(crate) fn new(client: Client) -> PutPipeline {
        PutPipeline {
            client,
            ahead: None,
            unconfirmed: VecDeque::new(),
            failed: None,
        }
    }

    /// Writes `bytes` as a new object and seals it (see the type's note on when another
    /// connection sees it).
    pub fn put(&mut self, bytes: &[u8]) -> Result<Handle, Error> {
        self.confirm(MAX_UNCONFIRMED - 2)?;
        let size = bytes.len() as u64;
        let mut writer = match self.take_ahead(size) {
            Some(writer) => writer,
            None => self.client.create(size)?,
        };
        // The next one, asked for now so the daemon answers while this copy runs. It must not
        // wait for space (a full store would hold this connection's seals behind it): when the
        // store is full the next put reserves in a round trip of its own, waiting as a put does.
        // If it cannot be sent, the next put does without it.
        let next = Request::Create {
            sizes: vec![size],
            timeout_ms: 0,
            flags: CREATE_AHEAD,
        };
        self.ahead = self.client.submit(&next, None).ok().map(|t| (t, size));
        writer.as_mut_slice().copy_from_slice(bytes);
        // Sent before the writer lets go: if the seal cannot be sent, dropping the writer gives
        // the object back.
        let handle = writer.handle();
        let ticket = self.client.submit(
            &Request::Seal {
                handles: vec![handle],
            },
            None,
        )?;
        writer.hand_over();
        self.unconfirmed.push_back((ticket, Some(handle)));
        Ok(handle)
    }

    /// Waits until every seal sent is confirmed: from then on every connection sees the objects.
    /// Returns the first failure since the last call.
    pub fn flush(&mut self) -> Result<(), Error> {
        self.confirm(0)
    }

    /// The reservation asked for ahead, if it was made and is of `size`; one of another size
    /// is given back (without waiting for the reply).
    fn take_ahead(&mut self, size: u64) -> Option<ObjectWriter> {
        let (ticket, _) = self.ahead.take()?;
        let (created, link) = match self.client.collect_linked(ticket) {
            Ok((Response::Created(mut results), link)) if results.len() == 1 => {
                (results.pop()?.ok()?, link)
            }
            _ => return None,
        };
        if created.location.len == size {
            return self.client.writer(&link, created).ok();
        }
        let abort = Request::Abort {
            handles: vec![created.handle],
        };
        match self.client.submit(&abort, None) {
            Ok(ticket) => self.unconfirmed.push_back((ticket, None)),
            // Given back in a round trip, then (or by the daemon when the connection closes).
            Err(_) => drop(self.client.writer_with(&link, created, false)),
        }
        None
    }

    /// Reads replies until at most `keep` are outstanding, and returns the first failure.
    fn confirm(&mut self, keep: usize) -> Result<(), Error> {
        while self.unconfirmed.len() > keep {
            let (ticket, handle) = self.unconfirmed.pop_front().expect("longer than keep");
            if let Err(failure) = confirm_one(&self.client, ticket, handle) {
                self.failed.get_or_insert(failure);
            }
        }
        self.failed.take().map_or(Ok(()), Err)
    }
}

impl std::fmt::Debug for PutPipeline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PutPipeline")
            .field("reservation_ready", &self.ahead.is_some())
            .field("unconfirmed", &self.unconfirmed.len())
            .finish()
    }
}

impl Drop for PutPipeline {
    fn drop(&mut self) {
        let _ = self.take_ahead(u64::MAX);
        if let Err(e) = self.flush() {
            tracing::warn!(error = %e, "a pipelined put failed (call flush() to see it)");
        }
    }
}

/// How a client makes objects: reservations become writers here, so the client itself knows
/// nothing of them.
impl Client {
    /// Reserves a writable object of `size_bytes` bytes, waiting for space up to the connection's
    /// create timeout. Write it through [`ObjectWriter::as_mut_slice`], then seal it.
    pub fn create(&self, size_bytes: u64) -> Result<ObjectWriter, Error> {
        self.create_with(size_bytes, CreateOptions::default())
    }

    /// [`Client::create`] with explicit options.
    pub fn create_with(&self, size_bytes: u64, opts: CreateOptions) -> Result<ObjectWriter, Error> {
        self.create_batch(&[size_bytes], opts)?
            .pop()
            .expect("one result per size")
    }

    /// Reserves one object per size in one round trip. Each result stands alone: a `Full` for one
    /// size does not undo the others.
    pub fn create_batch(
        &self,
        sizes_bytes: &[u64],
        opts: CreateOptions,
    ) -> Result<Vec<Result<ObjectWriter, Error>>, Error> {
        if sizes_bytes.is_empty() {
            return Ok(Vec::new());
        }
        let timeout = opts.timeout.unwrap_or(self.inner.create_timeout);
        self.batched(Opcode::Create, sizes_bytes, |sizes| {
            let request = Request::Create {
                sizes: sizes.to_vec(),
                timeout_ms: u32::try_from(timeout.as_millis()).unwrap_or(u32::MAX),
                flags: if opts.pin { CREATE_PIN } else { 0 },
            };
            let (results, link) = match self.call_linked(&request)? {
                (Response::Created(r), link) if r.len() == sizes.len() => (r, link),
                (other, _) => return Err(unexpected(other)),
            };
            // Each reservation becomes a writer (aborted on drop) at once, so a later chunk that
            // fails as a whole aborts the earlier chunks' reservations as they are dropped.
            Ok(results
                .into_iter()
                .zip(sizes)
                .map(|(r, &size)| match r {
                    Ok(created) => self.writer(&link, created),
                    Err(status) => Err(Error::from_status(status, Handle::default(), size, "")),
                })
                .collect())
        })
    }

    /// The writer of a reservation the daemon just made for this connection on `link`
    /// (aborted if the daemon named a range outside its segments).
    pub(crate) fn writer(&self, link: &Link, created: Created) -> Result<ObjectWriter, Error> {
        self.writer_with(link, created, self.inner.populate)
    }

    /// [`Client::writer`], building the object's page tables or not (not for one about to be
    /// aborted).
    pub(crate) fn writer_with(
        &self,
        link: &Link,
        created: Created,
        populate: bool,
    ) -> Result<ObjectWriter, Error> {
        match link.mapping(created.location) {
            Ok(mapping) => Ok(ObjectWriter::new(
                populate,
                self.clone(),
                created.handle,
                mapping.clone(),
                created.location,
            )),
            Err(e) => {
                let handle = created.handle;
                let _ = self.each(Opcode::Abort, &[handle], |handles| Request::Abort {
                    handles,
                });
                Err(e)
            }
        }
    }

    /// Writes `bytes` as a new sealed object: reserve, one copy into shared memory, seal.
    pub fn put(&self, bytes: &[u8]) -> Result<Handle, Error> {
        let mut writer = self.create(bytes.len() as u64)?;
        writer.as_mut_slice().copy_from_slice(bytes);
        writer.seal()
    }

    /// A pipeline for many puts from this thread, with the daemon's replies off the critical
    /// path: see [`PutPipeline`].
    pub fn put_pipeline(&self) -> PutPipeline {
        PutPipeline::new(self.clone())
    }

    /// Writes several objects in two round trips (one create batch, one seal batch; more when
    /// the batch is larger than a frame). On a failure the objects not yet sealed are aborted
    /// and the first error returned; nothing is sealed unless every object was reserved, but a
    /// batch larger than a frame that fails while sealing may leave its earlier chunks sealed.
    pub fn put_batch(&self, objects: &[&[u8]]) -> Result<Vec<Handle>, Error> {
        let sizes: Vec<u64> = objects.iter().map(|o| o.len() as u64).collect();
        let writers = self.create_batch(&sizes, CreateOptions::default())?;
        let mut ok = Vec::with_capacity(writers.len());
        let mut first_err = None;
        for w in writers {
            match w {
                Ok(w) => ok.push(w),
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        if let Some(e) = first_err {
            drop(ok); // aborts each reservation
            return Err(e);
        }
        for (w, bytes) in ok.iter_mut().zip(objects) {
            w.as_mut_slice().copy_from_slice(bytes);
        }
        ObjectWriter::seal_batch(self, ok)
    }
}
