//! The pull engine: a handle of another node fetched into this node's store, in ranges over
//! pooled connections to its owner, landed straight into a reservation and sealed under the
//! owner's handle; concurrent gets of one handle share one pull.

use super::*;

impl Cluster {
    /// Starts pulling `handle` from its owner, or joins the pull of it under way. The receiver
    /// holds `Some` once the pull ended; on success the copy is sealed and a get finds it.
    /// `LimitReached` when `--max-pulls` are under way.
    pub fn pull(
        self: &Arc<Self>,
        shared: &Arc<Shared>,
        handle: Handle,
    ) -> Result<watch::Receiver<Option<PullOutcome>>, Status> {
        self.pull_via(shared, handle, handle.node_id)
    }

    /// [`Cluster::pull`] from node `via` instead of the owner: a relay that holds (or fetches)
    /// a copy and serves it (the `relay` placement of streams).
    pub fn pull_via(
        self: &Arc<Self>,
        shared: &Arc<Shared>,
        handle: Handle,
        via: u32,
    ) -> Result<watch::Receiver<Option<PullOutcome>>, Status> {
        let mut inflight = self.lock_inflight();
        if let Some(rx) = inflight.get(&handle) {
            return Ok(rx.clone());
        }
        if inflight.len() >= self.config.max_pulls {
            return Err(Status::LimitReached);
        }
        let (tx, rx) = watch::channel(None);
        inflight.insert(handle, rx.clone());
        drop(inflight);
        let (this, shared) = (self.clone(), shared.clone());
        tokio::spawn(async move {
            // Out of the table however the task ends (a panic included), and before the waiters
            // hear: a get after a failure starts afresh, one after a success finds the copy.
            let entry = InFlight {
                cluster: &this,
                handle,
            };
            let started = std::time::Instant::now();
            let outcome = this
                .run_pull(&shared, handle, via)
                .await
                .map_err(|e| match e.status {
                    // The node the handle names says it is not its own: as good as unreachable.
                    Status::WrongNode => PullError {
                        status: Status::Unreachable,
                        ..e
                    },
                    _ => e,
                });
            this.count(handle, &outcome, started.elapsed());
            drop(entry);
            let _ = tx.send(Some(outcome.map(|_| ())));
        });
        Ok(rx)
    }

    /// Pulls `handle` through `via` (see [`Cluster::pull_via`]) and waits until the copy is
    /// sealed here, or says why not.
    pub(crate) async fn pulled(
        self: &Arc<Self>,
        shared: &Arc<Shared>,
        handle: Handle,
        via: u32,
    ) -> Result<(), Status> {
        let mut rx = self.pull_via(shared, handle, via)?;
        loop {
            if let Some(outcome) = rx.borrow_and_update().clone() {
                return outcome.map_err(|e| e.status);
            }
            if rx.changed().await.is_err() {
                return Err(Status::Unreachable);
            }
        }
    }

    pub(super) fn count(&self, handle: Handle, outcome: &Result<u64, PullError>, took: Duration) {
        let c = &self.counters;
        match outcome {
            Ok(bytes) => {
                c.pulls.fetch_add(1, Ordering::Relaxed);
                c.pulled_bytes.fetch_add(*bytes, Ordering::Relaxed);
                tracing::debug!(%handle, bytes, took_us = took.as_micros() as u64, "pulled");
            }
            Err(e) => {
                let counter = match e.status {
                    Status::Timeout => &c.fail_timeout,
                    Status::NotFound | Status::Stale | Status::NotSealed => &c.fail_missing,
                    Status::Corrupt => &c.fail_corrupt,
                    Status::Full | Status::TooLarge => &c.fail_full,
                    _ => &c.fail_unreachable,
                };
                counter.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(%handle, status = %e.status, reason = %e.message, "pull failed");
            }
        }
    }

    /// One pull, retried on fresh connections after a reset, within the pull timeout.
    pub(super) async fn run_pull(
        &self,
        shared: &Arc<Shared>,
        handle: Handle,
        via: u32,
    ) -> Result<u64, PullError> {
        let deadline = Instant::now() + self.config.pull_timeout;
        let mut attempt = 1;
        let mut forged = 0;
        loop {
            match self.try_pull(shared, handle, via, deadline).await {
                Err(e) if e.forged => {
                    // Bytes altered, replayed or forged on the way: counted, and asked again of
                    // the owner once, on a fresh connection (the channel was dropped).
                    self.note_forged_record();
                    forged += 1;
                    if forged > 1 || Instant::now() >= deadline {
                        return Err(e);
                    }
                    tracing::warn!(%handle, reason = %e.message, "pull failed its authentication; asking the owner again");
                }
                Err(e) if e.retry && attempt < ATTEMPTS => {
                    let backoff = Duration::from_millis(50 << attempt);
                    if Instant::now() + backoff >= deadline {
                        return Err(e);
                    }
                    tracing::info!(%handle, attempt, reason = %e.message, "pull failed; retrying");
                    attempt += 1;
                    tokio::time::sleep(backoff).await;
                }
                other => return other,
            }
        }
    }

    pub(super) async fn try_pull(
        &self,
        shared: &Arc<Shared>,
        handle: Handle,
        via: u32,
        deadline: Instant,
    ) -> Result<u64, PullError> {
        let peer = self.peer_for(via, deadline).await?;
        let mut first = self.channel(&peer, deadline).await?;
        let head = first
            .channel
            .request(handle, 0, RANGE_BYTES, deadline)
            .await
            .inspect_err(|e| self.on_error(&peer, e))?;
        // No connection is held while waiting for room: the pulls that would make room may need
        // it. Without room now, this one lets go of its connection and asks again later.
        let reserved = Reservation::now(shared, self.engine_conn, head.total).await?;
        let (mut copy, first) = match reserved {
            Some(copy) => (copy, Some(first)),
            None => {
                drop(first);
                let copy = Reservation::new(shared, self.engine_conn, head.total, deadline).await?;
                (copy, None)
            }
        };
        let bytes = copy.bytes_mut();
        let (lead, rest) = bytes.split_at_mut(head.len as usize);
        // Every connection goes back to the pool as soon as its range is in, so concurrent
        // pulls never wait on each other's connections.
        let lead = async {
            match first {
                Some(mut first) => {
                    first.channel.receive(lead, deadline).await?;
                    Self::recycle(&peer, first);
                    Ok(())
                }
                None => {
                    self.pull_range(&peer, handle, 0, head.total, lead, deadline)
                        .await
                }
            }
        };
        // The other ranges go over other connections to the same peer, at once.
        let rest = rest
            .chunks_mut(RANGE_BYTES as usize)
            .enumerate()
            .map(|(i, dest)| {
                let offset = head.len + i as u64 * RANGE_BYTES;
                self.pull_range(&peer, handle, offset, head.total, dest, deadline)
            });
        tokio::try_join!(lead, futures_util::future::try_join_all(rest))
            .inspect_err(|e| self.on_error(&peer, e))?;
        // (Not while the daemon is handed over: a copy sealed after its table was sent would
        // be one the successor does not know, in memory it may reuse.)
        let _busy = shared.handoff.enter().await;
        copy.seal_as(handle, head.writer)?;
        Ok(head.total)
    }

    /// One more range of an object whose length (`total`) the first range told.
    pub(super) async fn pull_range(
        &self,
        peer: &Arc<Peer>,
        handle: Handle,
        offset: u64,
        total: u64,
        dest: &mut [u8],
        deadline: Instant,
    ) -> Result<(), PullError> {
        let mut pooled = self.channel(peer, deadline).await?;
        let head = pooled
            .channel
            .request(handle, offset, dest.len() as u64, deadline)
            .await?;
        if head.total != total {
            return Err(PullError::fatal(
                Status::Stale,
                format!("{handle} changed length on its owner during the pull"),
            ));
        }
        pooled.channel.receive(dest, deadline).await?;
        Self::recycle(peer, pooled);
        Ok(())
    }

    pub(super) fn recycle(peer: &Peer, pooled: Pooled) {
        peer.idle
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(pooled.channel);
    }

    /// After a failed step: a network failure makes the pooled connections suspect (the peer
    /// may have restarted), so they are closed and fresh ones opened next time.
    pub(super) fn on_error(&self, peer: &Peer, e: &PullError) {
        if e.retry {
            peer.idle.lock().unwrap_or_else(|e| e.into_inner()).clear();
        }
    }

    /// A connection to `peer`: an idle one, or a new one while fewer than
    /// `--peer-connections` are open.
    pub(super) async fn channel(
        &self,
        peer: &Arc<Peer>,
        deadline: Instant,
    ) -> Result<Pooled, PullError> {
        let permit = tokio::time::timeout_at(deadline, peer.permits.clone().acquire_owned())
            .await
            .map_err(|_| {
                PullError::fatal(
                    Status::Timeout,
                    format!(
                        "no connection to node {:08x} free within the pull timeout",
                        peer.node_id
                    ),
                )
            })?
            .expect("the semaphore is never closed");
        let idle = peer.idle.lock().unwrap_or_else(|e| e.into_inner()).pop();
        if let Some(channel) = idle {
            return Ok(Pooled {
                channel,
                _permit: permit,
            });
        }
        match self.transport.connect(peer.addr, deadline).await {
            Ok(channel) if channel.peer().node_id == peer.node_id => {
                peer.up.store(true, Ordering::Relaxed);
                Ok(Pooled {
                    channel,
                    _permit: permit,
                })
            }
            Ok(channel) => {
                // Another node took the address: probe it again as a new peer.
                peer.up.store(false, Ordering::Relaxed);
                self.kick.notify_one();
                Err(PullError::fatal(
                    Status::Unreachable,
                    format!(
                        "{} now answers as node {:08x}, not {:08x}",
                        peer.addr,
                        channel.peer().node_id,
                        peer.node_id
                    ),
                ))
            }
            Err(e) => {
                peer.up.store(false, Ordering::Relaxed);
                if e.is_refusal() {
                    self.counters.peers_refused.fetch_add(1, Ordering::Relaxed);
                }
                self.kick.notify_one();
                let mut err = PullError::from(e);
                err.message = format!(
                    "node {:08x} at {}: {}",
                    peer.node_id, peer.addr, err.message
                );
                Err(err)
            }
        }
    }

    /// The peer that owns `node_id`. Before the first round of finding peers has finished, waits
    /// for it (within the deadline); after, a node nobody answers for is `Unreachable` at once.
    pub(super) async fn peer_for(
        &self,
        node_id: u32,
        deadline: Instant,
    ) -> Result<Arc<Peer>, PullError> {
        let mut rounds = self.rounds.subscribe();
        loop {
            let round = *rounds.borrow_and_update();
            if let Some(peer) = self.lock_members().by_node.get(&node_id) {
                return Ok(peer.clone());
            }
            if round > 0 {
                self.kick.notify_one();
                return Err(PullError::fatal(
                    Status::Unreachable,
                    format!(
                        "no peer has node id {node_id:08x} (peers: {})",
                        self.describe_peers()
                    ),
                ));
            }
            if tokio::time::timeout_at(deadline, rounds.changed())
                .await
                .is_err()
            {
                return Err(PullError::fatal(
                    Status::Timeout,
                    "no peer found before the pull timeout".to_string(),
                ));
            }
        }
    }
}

/// A pull's entry in the in-flight table, removed when dropped.
struct InFlight<'a> {
    cluster: &'a Cluster,
    handle: Handle,
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.cluster.lock_inflight().remove(&self.handle);
    }
}

/// Room for a pulled copy in this node's store, reserved by the pull engine's connection.
/// Dropped unsealed (any failure, or shutdown), it is aborted: no half-written copy is ever
/// visible.
struct Reservation {
    shared: Arc<Shared>,
    conn: ConnId,
    created: Created,
    sealed: bool,
}

impl Reservation {
    /// Reserves `size` bytes if there is room now (evicting if need be); `None` if not. Waits
    /// while the daemon is handed over: memory reserved (or an object evicted) after its
    /// table was sent would be memory the successor hands out again.
    pub(super) async fn now(
        shared: &Arc<Shared>,
        conn: ConnId,
        size: u64,
    ) -> Result<Option<Reservation>, PullError> {
        let _busy = shared.handoff.enter().await;
        match shared.with_objects(|o| o.create(conn, size, false)) {
            Ok(created) => Ok(Some(Reservation {
                shared: shared.clone(),
                conn,
                created,
                sealed: false,
            })),
            Err(Status::Full) => Ok(None),
            Err(status) => Err(PullError::fatal(
                status,
                format!("cannot reserve {size} bytes for a copy: {status}"),
            )),
        }
    }

    /// Reserves `size` bytes, waiting for space (eviction, releases) until `deadline`.
    pub(super) async fn new(
        shared: &Arc<Shared>,
        conn: ConnId,
        size: u64,
        deadline: Instant,
    ) -> Result<Reservation, PullError> {
        let mut space = shared.space_events();
        loop {
            space.borrow_and_update();
            if let Some(copy) = Reservation::now(shared, conn, size).await? {
                return Ok(copy);
            }
            if tokio::time::timeout_at(deadline, space.changed())
                .await
                .is_err()
            {
                shared.with_objects(|o| o.note_create_full());
                return Err(PullError::fatal(
                    Status::Full,
                    format!("no room for a copy of {size} bytes within the pull timeout"),
                ));
            }
        }
    }

    /// The reservation's bytes, to land the pulled ranges in.
    pub(super) fn bytes_mut(&mut self) -> &mut [u8] {
        let loc = self.created.location;
        // SAFETY: the range is an unsealed reservation of the engine's connection: no client can
        // get it (it is not sealed) and the daemon hands no writer a range overlapping it, so
        // nothing else reads or writes it; `&mut self` makes this the only borrow in this
        // process. It lies inside its segment.
        unsafe {
            self.shared
                .mapping(loc.segment)
                .bytes_mut(loc.offset, loc.len)
        }
        .expect("the daemon maps its segments read-write, and objects lie inside them")
    }

    /// Seals the copy under its owner's handle, as written by the uid the owner named.
    /// (Should another copy of it have been sealed meanwhile, that one stays, this one is
    /// dropped, and the pull succeeded all the same.)
    pub(super) fn seal_as(mut self, origin: Handle, writer: u32) -> Result<(), PullError> {
        let (conn, handle) = (self.conn, self.created.handle);
        match self
            .shared
            .with_objects(|o| o.seal_copy(conn, handle, origin, writer))
        {
            Ok(()) | Err(Status::InvalidState) => {
                self.sealed = true;
                Ok(())
            }
            Err(status) => Err(PullError::fatal(
                status,
                format!("cannot seal the copy of {origin}: {status}"),
            )),
        }
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if !self.sealed {
            let (conn, handle) = (self.conn, self.created.handle);
            let _ = self.shared.with_objects(|o| o.abort(conn, handle));
        }
    }
}
