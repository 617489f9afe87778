//! The streams family (and the decode-once cache the streams keep): list, join, attach, take,
//! put, wait, detach, close; returns and producers' reports arrive one-way.

use std::collections::HashMap;
use std::os::fd::AsRawFd;

use feedstore_proto::frame::{
    Opcode, ProducerFigures, RankAt, RankFigures, Request, Response, StreamItem, StreamTask,
    TakeTasks,
};
use feedstore_proto::stream::StreamSpec;
use feedstore_proto::{Role, Status};

use super::{ConnEnd, Connection, error, stream_error, stream_reply};
use crate::objects::ConnId;
use crate::streams::{MAX_BATCH, Placement, StreamError, Window};

impl Connection {
    /// A request of the streams family, answered; any other request is handed back.
    pub(super) async fn streams(
        &mut self,
        id: ConnId,
        request: Request,
    ) -> Result<Result<Response, Request>, ConnEnd> {
        let shared = self.shared.clone();
        Ok(Ok(match request {
            Request::CacheLookup { keys } => {
                Response::Cached(shared.with_streams(|s, o| s.lookup(o, id, &keys)))
            }
            Request::CacheInsert { entries } => {
                if self.role != Role::Writer {
                    let message = "only writers file samples in the cache";
                    return Ok(Ok(error(Status::PermissionDenied, message.into())));
                }
                Response::Done(shared.with_streams(|s, o| s.insert(o, id, &entries)))
            }
            Request::StreamList { after } => {
                // The page's fixed part: the list's count and the `more` byte.
                let budget = self.client_limit as usize - 5;
                let (streams, more) = shared.with_streams(|s, o| s.list(o, id, after, budget));
                Response::Streams { streams, more }
            }
            Request::StreamJoin {
                spec,
                depth,
                batch,
                ranks,
                at,
                relay,
            } => {
                self.stream_join(id, spec, Window { depth, batch }, &ranks, &at, &relay)
                    .await
            }
            Request::StreamTake(TakeTasks {
                stream,
                max,
                timeout_ms,
            }) => {
                // No more tasks than the client's limit lets the reply carry, a batched stream's
                // last whole batch included (up to `MAX_BATCH - 1` past `max`).
                let fits = (self.client_limit as usize - 4) / StreamTask::WIRE_BYTES;
                let fits = fits.saturating_sub(MAX_BATCH as usize - 1).max(1);
                let max = max.clamp(1, fits as u32);
                self.wait_until(id, timeout_ms, |expired| {
                    match shared.with_streams(|s, _| s.take(id, stream, max, None)) {
                        Ok(tasks) if !tasks.is_empty() || expired => Some(Response::Tasks(tasks)),
                        Ok(_) => None,
                        Err(e) => Some(stream_error(e)),
                    }
                })
                .await?
            }
            Request::StreamPut { stream, items } => self.stream_put(id, stream, &items),
            Request::StreamWait {
                stream,
                rank,
                seq,
                timeout_ms,
            } => {
                // Asking past the end: the consumer has read all of its share, which lets the
                // producers waiting for work stop.
                shared.with_streams(|s, _| s.finish(id, stream, rank, seq));
                self.wait_until(id, timeout_ms, |expired| {
                    match shared.with_streams(|s, _| s.poll(id, stream, rank, seq)) {
                        Ok(Some(status)) => Some(Response::Done(vec![status])),
                        Ok(None) if expired => Some(Response::Done(vec![Status::Timeout])),
                        Ok(None) => None,
                        Err(e) => Some(stream_error(e)),
                    }
                })
                .await?
            }
            Request::StreamDetach { stream, rank, next } => stream_reply(
                shared.with_streams(|s, o| s.detach(o, id, stream, rank, next)),
                |()| Response::Done(vec![Status::Ok]),
            ),
            Request::StreamClose { stream } => {
                stream_reply(shared.with_streams(|s, o| s.close(o, id, stream)), |()| {
                    Response::Done(vec![Status::Ok])
                })
            }
            other => return Ok(Err(other)),
        }))
    }

    /// A producer joins a stream (creating it if it is the first): its ranks placed where
    /// `at` and `relay` say, and a feeder started for each other node that serves some.
    async fn stream_join(
        &mut self,
        id: ConnId,
        spec: StreamSpec,
        window: Window,
        ranks: &[StreamTask],
        at: &[RankAt],
        relay: &str,
    ) -> Response {
        let shared = self.shared.clone();
        let placement = match self.locate(at, relay).await {
            Ok(placement) => placement,
            Err(e) => return stream_error(e),
        };
        let joined = shared.with_streams(|s, o| s.join(o, id, &spec, window, ranks, &placement));
        if let (Ok((stream, feeders)), Some(cluster)) = (&joined, &self.cluster) {
            for &node in feeders {
                tokio::spawn(crate::cluster::feed_remote(
                    shared.clone(),
                    cluster.clone(),
                    *stream,
                    node,
                ));
            }
        }
        stream_reply(joined, |(stream, _)| Response::StreamJoined { stream })
    }

    /// A producer puts samples it made; those for ranks served by another node are forwarded.
    fn stream_put(&mut self, id: ConnId, stream: u32, items: &[StreamItem]) -> Response {
        let shared = self.shared.clone();
        if self.role != Role::Writer {
            let message = "only writers put samples into streams";
            return error(Status::PermissionDenied, message.into());
        }
        let (put, forwards) = shared.with_streams(|s, o| {
            let put = s.put(o, id, stream, items, true);
            (put, s.forwards(o))
        });
        if let Some(cluster) = &self.cluster
            && !forwards.is_empty()
        {
            crate::cluster::forward(&shared, cluster, forwards);
        }
        stream_reply(put, Response::Done)
    }

    /// A consumer attaches to a rank, waiting (up to `timeout_ms`) for a producer to create
    /// the stream; the reply carries the ring's read-only descriptor.
    pub(super) async fn stream_attach(
        &mut self,
        id: ConnId,
        request_id: u32,
        spec: StreamSpec,
        rank: u32,
        seq: u64,
        timeout_ms: u32,
    ) -> Result<(), ConnEnd> {
        let shared = self.shared.clone();
        let op = Opcode::StreamAttach;
        let attached = self
            .wait_until(id, timeout_ms, |expired| {
                let attached = shared.with_streams(|s, o| -> Result<_, StreamError> {
                    let (stream, ring) = s.attach(o, id, &spec, rank, seq)?;
                    let fd = ring.readonly_fd().map_err(|e| StreamError {
                        status: Status::Full,
                        message: format!("cannot share the ring: {e}"),
                    })?;
                    Ok((stream, ring.capacity(), ring.size_bytes(), fd))
                });
                match attached {
                    Err(e) if e.status == Status::NotFound && !expired => {
                        shared.attaches_waiting.begin(id);
                        None
                    }
                    Err(e) if e.status == Status::NotFound => {
                        shared.attaches_waiting.ran_out(id);
                        Some(Err(StreamError {
                            status: Status::Timeout,
                            message: e.message,
                        }))
                    }
                    other => {
                        shared.attaches_waiting.end(id);
                        Some(other)
                    }
                }
            })
            .await?;
        match attached {
            Ok((stream, capacity, ring_bytes, fd)) => {
                let response = Response::StreamAttached {
                    stream,
                    capacity,
                    ring_bytes,
                };
                self.wbuf.clear();
                self.encode_reply(op, request_id, &response);
                self.send_with_fds(&[fd.as_raw_fd()]).await
            }
            Err(e) => self.reply(op, request_id, &stream_error(e)).await,
        }
    }

    /// The node owning each rank of `at` (ranks at this node's own address are left out), and
    /// the relay's node.
    async fn locate(&self, at: &[RankAt], relay: &str) -> Result<Placement, StreamError> {
        let mut placement = Placement::default();
        if at.is_empty() && relay.is_empty() {
            return Ok(placement);
        }
        let Some(cluster) = &self.cluster else {
            return Err(StreamError {
                status: Status::InvalidArgument,
                message: "ranks on other nodes need this daemon in a cluster (feedstored \
                          --listen, --peers, --cluster-secret-file)"
                    .into(),
            });
        };
        let unreachable = |message| StreamError {
            status: Status::Unreachable,
            message,
        };
        if !relay.is_empty() {
            placement.relay = cluster.node_at(relay).await.map_err(unreachable)?;
        }
        let mut nodes: HashMap<&str, Option<u32>> = HashMap::new();
        for r in at {
            let node = match nodes.get(r.addr.as_str()) {
                Some(&node) => node,
                None => {
                    let node = cluster.node_at(&r.addr).await.map_err(unreachable)?;
                    nodes.insert(&r.addr, node);
                    node
                }
            };
            if let Some(node) = node {
                placement.owners.insert(r.rank, node);
            }
        }
        Ok(placement)
    }

    pub(super) fn stream_release(
        &self,
        id: ConnId,
        stream: u32,
        rank: u32,
        upto: u64,
        figures: RankFigures,
    ) {
        if let Err(e) = self
            .shared
            .with_streams(|s, o| s.release(o, id, stream, rank, upto, figures))
        {
            tracing::debug!(conn = id, stream, rank, upto, error = %e, "stream release refused");
        }
    }

    pub(super) fn producer_report(&self, id: ConnId, stream: u32, figures: &ProducerFigures) {
        if let Err(e) = self
            .shared
            .with_streams(|s, _| s.producer_report(id, stream, figures))
        {
            tracing::debug!(conn = id, stream, error = %e, "producer report refused");
        }
    }
}
