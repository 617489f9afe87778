//! The objects family: create (waiting for space), seal, abort, delete, get (pulling another
//! node's object first when this node has no copy) and release.

use std::sync::Arc;
use std::time::Duration;

use feedstore_proto::frame::{CREATE_AHEAD, CREATE_PIN, Created, Request, Response};
use feedstore_proto::{Handle, Status};
use tokio::time::Instant;

use super::{ConnEnd, Connection, Shared, error};
use crate::cluster::Cluster;
use crate::objects::{ConnId, Objects};

impl Connection {
    /// A request of the objects family, answered.
    pub(super) async fn objects(
        &mut self,
        id: ConnId,
        request: Request,
    ) -> Result<Response, ConnEnd> {
        let shared = self.shared.clone();
        Ok(match request {
            Request::Create {
                sizes,
                timeout_ms,
                flags,
            } => {
                if sizes.is_empty() {
                    return Ok(error(Status::InvalidArgument, "empty create batch".into()));
                }
                let mut results = Vec::with_capacity(sizes.len());
                let wait =
                    Duration::from_millis(u64::from(timeout_ms.min(shared.max_create_wait_ms)));
                let deadline = Instant::now() + wait;
                for size in sizes {
                    let (pin, ahead) = (flags & CREATE_PIN != 0, flags & CREATE_AHEAD != 0);
                    results.push(self.create_one(id, size, pin, ahead, deadline).await?);
                }
                Response::Created(results)
            }
            Request::Seal { handles } => Response::Done(each(&shared, id, &handles, Objects::seal)),
            Request::Abort { handles } => {
                Response::Done(each(&shared, id, &handles, Objects::abort))
            }
            Request::Delete { handles } => {
                Response::Done(each(&shared, id, &handles, Objects::delete))
            }
            Request::Get { handles } => {
                let mut got: Vec<_> =
                    shared.with_objects(|o| handles.iter().map(|&h| o.lease(id, h)).collect());
                if let Some(cluster) = self.cluster.clone()
                    && got.contains(&Err(Status::WrongNode))
                {
                    self.pull_then_get(&cluster, id, &handles, &mut got).await?;
                }
                Response::Got(got)
            }
            other => {
                let op = other.opcode();
                return Err(ConnEnd::Protocol(format!(
                    "{op:?} is not an object request"
                )));
            }
        })
    }

    /// Pulls the objects of other nodes a get found no copy of (`WrongNode` in `got`), all at
    /// once, then leases the copies. Waits while the pulls run, serving the client's returns
    /// meanwhile, as a create waiting for space does. A copy evicted before this get could
    /// lease it is pulled again, twice at most, then reported `Full`.
    async fn pull_then_get(
        &mut self,
        cluster: &Arc<Cluster>,
        id: ConnId,
        handles: &[Handle],
        got: &mut [Result<feedstore_proto::frame::Got, Status>],
    ) -> Result<(), ConnEnd> {
        let shared = self.shared.clone();
        // One deadline for the whole get: the pulls end by their own (`--pull-timeout-ms`); this
        // one only guards against a lost task and bounds the re-pulls.
        let deadline = Instant::now() + cluster.config().pull_timeout + Duration::from_secs(5);
        for _ in 0..3 {
            let mut pulls = Vec::new();
            for (i, &h) in handles.iter().enumerate() {
                if got[i] == Err(Status::WrongNode) {
                    match cluster.pull(&shared, h) {
                        Ok(rx) => pulls.push((i, rx)),
                        Err(status) => {
                            shared.with_objects(Objects::note_limit_hit);
                            got[i] = Err(status);
                        }
                    }
                }
            }
            if pulls.is_empty() {
                return Ok(());
            }
            for (i, mut rx) in pulls {
                let outcome = loop {
                    if let Some(outcome) = rx.borrow_and_update().clone() {
                        break outcome.map_err(|e| e.status);
                    }
                    if rx.has_changed().is_err() || Instant::now() >= deadline {
                        break Err(Status::Unreachable);
                    }
                    self.wait_for(id, &mut rx, deadline).await?;
                };
                got[i] = outcome.and_then(|()| shared.with_objects(|o| o.lease(id, handles[i])));
            }
        }
        for r in got.iter_mut() {
            if *r == Err(Status::WrongNode) {
                *r = Err(Status::Full);
            }
        }
        Ok(())
    }

    pub(super) fn release(&self, id: ConnId, handles: &[Handle]) {
        self.shared.with_objects(|o| {
            for &h in handles {
                if let Err(status) = o.release(id, h) {
                    tracing::debug!(conn = id, handle = %h, %status, "release of a lease not held");
                }
            }
        });
    }

    /// One create, waiting for space until `deadline` while still serving releases.
    async fn create_one(
        &mut self,
        id: ConnId,
        size: u64,
        pinned: bool,
        ahead: bool,
        deadline: Instant,
    ) -> Result<Result<Created, Status>, ConnEnd> {
        let shared = self.shared.clone();
        let mut space = shared.space.subscribe();
        let mut waited = false;
        loop {
            space.borrow_and_update();
            match shared.with_objects(|o| o.create(id, size, pinned)) {
                Err(Status::Full) => {}
                other => return Ok(other),
            }
            if Instant::now() >= deadline {
                if ahead {
                    return Ok(Err(Status::Full));
                }
                let stats = shared.with_objects(|o| {
                    o.note_create_full();
                    o.stats()
                });
                tracing::warn!(
                    conn = id,
                    size,
                    used = stats.used_bytes,
                    capacity = stats.capacity_bytes,
                    leases = stats.leases,
                    pinned = stats.objects_pinned,
                    "create failed: store full of leased, pinned or unsealed objects"
                );
                return Ok(Err(Status::Full));
            }
            if !waited {
                waited = true;
                shared.with_objects(Objects::note_create_waited);
                tracing::debug!(conn = id, size, "create waiting for space");
            }
            self.wait_for(id, &mut space, deadline).await?;
        }
    }
}

fn each(
    shared: &Shared,
    id: ConnId,
    handles: &[Handle],
    op: fn(&mut Objects, ConnId, Handle) -> Result<(), Status>,
) -> Vec<Status> {
    shared.with_objects(|o| {
        handles
            .iter()
            .map(|&h| op(o, id, h).err().unwrap_or(Status::Ok))
            .collect()
    })
}
