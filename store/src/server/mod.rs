//! The control socket: one tokio task per client connection.
//!
//! A connection's life: it is admitted against the connection limits, its client's uid and
//! groups are checked against the allow-list, the client says hello (within the hello timeout,
//! with a printable name and its frame limit) and receives one descriptor per segment by
//! `SCM_RIGHTS` (read-only for readers), then frames flow until the client goes away — for any
//! reason, `kill -9` included — at which point its unsealed objects are aborted and its leases
//! returned. A malformed or oversized frame closes that one connection with a logged reason.
//!
//! A request that waits (a create for space, a take for tasks, a wait for a sample, an attach
//! for its stream) waits here, not in the state: it re-tries whenever the state it depends on
//! moves, until its deadline. While it waits the connection keeps reading, so leases and samples
//! the same client returns from another thread still reach the daemon (otherwise a client could
//! deadlock against its own returns); other requests queue behind it, at most
//! `--max-queued-requests`.
//!
//! The state all connections share, and its locks, is [`crate::state::Shared`]; a connection
//! holds the cluster beside it when this node has one.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use feedstore_proto::frame::{DecodeError, Request, Response};
use feedstore_proto::{Role, Status};
use tokio::net::UnixStream;

use crate::cluster::Cluster;
use crate::credentials::Credentials;
use crate::objects::ConnId;
use crate::state::Shared;
use crate::streams::StreamError;

/// Why a connection ended.
#[derive(Debug, thiserror::Error)]
enum ConnEnd {
    #[error("client closed the connection")]
    Closed,
    #[error("socket error")]
    Io(#[from] std::io::Error),
    #[error("malformed frame: {0}")]
    Malformed(#[from] DecodeError),
    #[error("protocol violation: {0}")]
    Protocol(String),
    #[error("refused at hello: {0}")]
    Refused(String),
    #[error("no hello within {0:?} (--hello-timeout-ms)")]
    HelloTimeout(Duration),
    #[error(
        "the client speaks protocol {found}, this daemon {}-{}",
        feedstore_proto::frame::MIN_VERSION,
        feedstore_proto::frame::VERSION
    )]
    Version { found: u16, request_id: u32 },
}

/// One client's connection. Dropping it (at the end, or when its task is cancelled or panics)
/// aborts what the client was writing and returns its leases, stream tasks and ring.
struct Connection {
    shared: Arc<Shared>,
    /// This node's cluster, if it has one: gets pull other nodes' objects through it, streams
    /// feed other nodes' ranks.
    cluster: Option<Arc<Cluster>>,
    stream: UnixStream,
    rbuf: Vec<u8>,
    wbuf: Vec<u8>,
    /// Requests (with their ids) read while another was waiting, to be handled after it.
    deferred: VecDeque<(u32, Request)>,
    /// Frame bytes of the deferred requests.
    deferred_bytes: usize,
    id: Option<ConnId>,
    role: Role,
    credentials: Credentials,
    /// The largest reply payload the client accepts (from its hello).
    client_limit: u32,
    name: String,
    /// The protocol version agreed at hello (this daemon's own until then): every frame after
    /// the hello is in it, both ways.
    version: u16,
}

impl Drop for Connection {
    fn drop(&mut self) {
        let Some(id) = self.id else {
            return;
        };
        self.shared.attaches_waiting.end(id);
        if self.shared.handoff.is_done() {
            // Handed over: what the client held is its successor's to keep, not this one's
            // to reclaim (this daemon is exiting).
            return;
        }
        let reclaimed = self.shared.with_streams(|s, o| {
            s.disconnect(id);
            o.disconnect(id)
        });
        let (pid, name) = (self.credentials.pid, &self.name);
        if reclaimed.aborted + reclaimed.leases > 0 {
            tracing::info!(
                conn = id, pid, name = ?name,
                aborted_objects = reclaimed.aborted,
                released_leases = reclaimed.leases,
                "client disconnected; reclaimed its unsealed objects and leases"
            );
        } else {
            tracing::info!(conn = id, pid, name = ?name, "client disconnected");
        }
    }
}

mod connection;
mod objects;
mod session;
mod streams;
mod takeover;

pub use connection::serve_connection;

fn error(status: Status, message: String) -> Response {
    Response::Error {
        status,
        message: feedstore_proto::truncate(&message, 1024).to_owned(),
    }
}

fn stream_error(e: StreamError) -> Response {
    error(e.status, e.message)
}

fn stream_reply<T>(result: Result<T, StreamError>, ok: impl FnOnce(T) -> Response) -> Response {
    result.map_or_else(stream_error, ok)
}
