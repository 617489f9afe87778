//! The owner's side of a pull: the TCP listener other daemons connect to, and the loop that
//! sends them ranges of this node's objects straight from the shared-memory segments.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use feedstore_proto::peer::{ReadReply, ReadRequest};
use feedstore_proto::{Handle, Role, Status};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::Cluster;
use super::auth::Side;
use super::transport::{HANDSHAKE_TIMEOUT, LinkError, PIECE_BYTES, handshake, tune};
use crate::objects::{ClientInfo, ConnId};
use crate::server::Shared;

/// How long a peer connection may sit idle before the owner closes it.
const IDLE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(300);

/// Accepts peer connections until the task is dropped (at shutdown).
pub(crate) async fn listen(shared: Arc<Shared>, cluster: Arc<Cluster>, listener: TcpListener) {
    loop {
        match listener.accept().await {
            Ok((stream, addr)) => {
                let Some(slot) = cluster.admit_peer_connection(addr) else {
                    drop(stream);
                    continue;
                };
                let (shared, cluster) = (shared.clone(), cluster.clone());
                tokio::spawn(async move {
                    serve_peer(&shared, &cluster, stream, addr).await;
                    drop(slot);
                });
            }
            Err(e) => {
                tracing::warn!(error = %e, "peer accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
        }
    }
}

/// A peer's connection registered in the object table: the leases it takes while sending are
/// returned when it ends, however it ends.
struct PeerConn<'a> {
    shared: &'a Shared,
    id: ConnId,
}

impl Drop for PeerConn<'_> {
    fn drop(&mut self) {
        self.shared.with_objects(|o| o.disconnect(self.id));
    }
}

/// A lease a peer connection holds on one object while it sends bytes of it.
struct SendLease<'a> {
    shared: &'a Shared,
    conn: ConnId,
    handle: Handle,
}

impl Drop for SendLease<'_> {
    fn drop(&mut self) {
        let _ = self
            .shared
            .with_objects(|o| o.release(self.conn, self.handle));
    }
}

async fn serve_peer(
    shared: &Arc<Shared>,
    cluster: &Arc<Cluster>,
    mut stream: TcpStream,
    addr: SocketAddr,
) {
    tune(&stream);
    let shake = tokio::time::timeout(
        HANDSHAKE_TIMEOUT,
        handshake(&mut stream, cluster.transport.local(), Side::Acceptor, 0),
    )
    .await
    .unwrap_or(Err(LinkError::Timeout(HANDSHAKE_TIMEOUT)));
    let peer = match shake {
        Ok(peer) => peer,
        Err(LinkError::SelfConnection) => return,
        Err(e) if e.is_refusal() => {
            cluster
                .counters
                .peers_refused
                .fetch_add(1, Ordering::Relaxed);
            // Once per address and reason: a refused peer comes back every refresh.
            cluster.log_once(
                &addr.ip().to_string(),
                format!("peer connection from {addr} refused: {e}"),
            );
            return;
        }
        Err(e) => {
            tracing::warn!(peer = %addr, error = %e, "peer handshake failed");
            return;
        }
    };
    if peer.streams {
        super::session::serve_session(shared.clone(), cluster.clone(), stream, addr, peer).await;
        return;
    }
    let id = shared.with_objects(|o| {
        o.connect(ClientInfo {
            role: Role::Reader,
            uid: 0,
            pid: 0,
            name: format!("peer {addr} (node {:08x})", peer.node_id),
            // Holds one lease at a time, while it sends.
            internal: true,
        })
    });
    let conn = PeerConn { shared, id };
    tracing::debug!(peer = %addr, node = %format!("{:08x}", peer.node_id), "peer connected");
    let end = loop {
        let mut raw = [0u8; ReadRequest::BYTES];
        // A pooled connection left idle this long is closed; the puller opens a fresh one.
        match tokio::time::timeout(IDLE_TIMEOUT, stream.read_exact(&mut raw)).await {
            Err(_) => break Some(format!("idle for {IDLE_TIMEOUT:?}")),
            Ok(Ok(_)) => {}
            Ok(Err(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => break None,
            Ok(Err(e)) => break Some(e.to_string()),
        }
        let request = match ReadRequest::from_bytes(&raw) {
            Ok(r) => r,
            Err(e) => break Some(format!("malformed request: {e}")),
        };
        if let Err(e) = send_range(&conn, shared, cluster, &mut stream, request).await {
            break Some(e.to_string());
        }
    };
    match end {
        None => tracing::debug!(peer = %addr, "peer disconnected"),
        Some(reason) => tracing::info!(peer = %addr, %reason, "peer connection closed"),
    }
}

/// Answers one request: a refusal, or the range's bytes written from the segment to the socket
/// under a lease, followed by their checksum.
async fn send_range(
    conn: &PeerConn<'_>,
    shared: &Arc<Shared>,
    cluster: &Arc<Cluster>,
    stream: &mut TcpStream,
    request: ReadRequest,
) -> std::io::Result<()> {
    let handle = request.handle;
    let mut got = shared.with_objects(|o| o.get(conn.id, handle));
    if got == Err(Status::WrongNode) {
        // A third node's object: this node relays it (the `relay` placement), pulling a copy
        // from its owner first.
        got = match cluster.pulled(shared, handle, handle.node_id).await {
            Ok(()) => shared.with_objects(|o| o.get(conn.id, handle)),
            Err(status) => Err(status),
        };
    }
    let location = match got {
        Ok(location) => location,
        Err(status) => {
            return stream
                .write_all(&ReadReply::refused(status).to_bytes())
                .await;
        }
    };
    let lease = SendLease {
        shared,
        conn: conn.id,
        handle,
    };
    if request.offset >= location.len {
        drop(lease);
        let refusal = ReadReply::refused(Status::InvalidArgument);
        return stream.write_all(&refusal.to_bytes()).await;
    }
    let len = request.len.min(location.len - request.offset);
    let reply = ReadReply {
        status: Status::Ok,
        total: location.len,
        offset: request.offset,
        len,
    };
    let mapping = shared.mapping(location.segment);
    // SAFETY: `lease` holds a lease on the sealed object at `location` until after the last
    // use of `bytes`: the daemon hands no writer a range overlapping a leased object, so the
    // bytes stay unchanged meanwhile (a writer process scribbling outside its reservation
    // breaks that, as for every reader). The range lies inside the object.
    let bytes = unsafe { mapping.bytes(location.offset + request.offset, len) }
        .expect("an object lies inside its segment");
    stream.write_all(&reply.to_bytes()).await?;
    let mut crc = 0u32;
    for piece in bytes.chunks(PIECE_BYTES) {
        // From the segment to the socket: no buffer between.
        stream.write_all(piece).await?;
        crc = crc32c::crc32c_append(crc, piece);
    }
    stream.write_all(&crc.to_le_bytes()).await?;
    drop(lease);
    cluster
        .counters
        .served_reads
        .fetch_add(1, Ordering::Relaxed);
    cluster
        .counters
        .served_bytes
        .fetch_add(len, Ordering::Relaxed);
    Ok(())
}
