//! The owner's side of a pull: the TCP listener other daemons connect to, and the loop that
//! sends them ranges of this node's objects straight from the shared-memory segments.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use feedstore_proto::peer::{PIECE_BYTES, ReadReply, ReadRequest, TAG_BYTES};
use feedstore_proto::{Handle, Role, Status};
use tokio::io::AsyncReadExt;
use tokio::net::{TcpListener, TcpStream};

use super::Cluster;
use super::auth::Side;
use super::record::{Records, Sealer};
use super::transport::{HANDSHAKE_TIMEOUT, LinkError, PeerIdentity, handshake, tune, write_record};
use crate::objects::{ClientInfo, ConnId};
use crate::state::Shared;

/// How long a peer connection may sit idle before the owner closes it.
const IDLE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(300);

/// Accepts peer connections until the task is dropped (at shutdown). A connection first gets a
/// place in the handshake budget ([`super::Handshakes`]), and a place among the peer
/// connections only once it proved the cluster secret.
pub(crate) async fn listen(shared: Arc<Shared>, cluster: Arc<Cluster>, listener: TcpListener) {
    loop {
        match listener.accept().await {
            Ok((stream, addr)) => {
                let ticket = cluster.begin_handshake(addr);
                let (shared, cluster) = (shared.clone(), cluster.clone());
                tokio::spawn(async move {
                    serve_peer(&shared, &cluster, stream, addr, ticket).await;
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
    mut ticket: super::HandshakeTicket,
) {
    tune(&stream);
    let Some((peer, records)) = accept_handshake(cluster, &mut stream, addr, &mut ticket).await
    else {
        return;
    };
    drop(ticket);
    let Some(_slot) = cluster.admit_peer_connection(addr) else {
        return;
    };
    if peer.streams {
        super::session::serve_session(shared.clone(), cluster.clone(), stream, addr, peer, records)
            .await;
        return;
    }
    let id = shared.with_objects(|o| {
        o.connect(ClientInfo {
            role: Role::Reader,
            uid: 0,
            pid: 0,
            process: crate::objects::Process::default(),
            name: format!("peer {addr} (node {:08x})", peer.node_id),
            // Holds one lease at a time, while it sends.
            internal: true,
            capped: false,
        })
    });
    let conn = PeerConn { shared, id };
    let Records {
        mut sealer,
        mut opener,
    } = records;
    tracing::debug!(peer = %addr, node = %format!("{:08x}", peer.node_id), "peer connected");
    let end = loop {
        let mut raw = [0u8; ReadRequest::BYTES + TAG_BYTES];
        // A pooled connection left idle this long is closed; the puller opens a fresh one.
        match tokio::time::timeout(IDLE_TIMEOUT, stream.read_exact(&mut raw)).await {
            Err(_) => break Some(format!("idle for {IDLE_TIMEOUT:?}")),
            Ok(Ok(_)) => {}
            Ok(Err(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => break None,
            Ok(Err(e)) => break Some(e.to_string()),
        }
        let (body, tag) = raw.split_at(ReadRequest::BYTES);
        if let Err(e) = opener.open(body, tag.try_into().expect("a tag's bytes")) {
            cluster.note_forged_record();
            break Some(e.to_string());
        }
        let request = match ReadRequest::from_bytes(body.try_into().expect("a request's bytes")) {
            Ok(r) => r,
            Err(e) => break Some(format!("malformed request: {e}")),
        };
        if let Err(e) = send_range(&conn, shared, cluster, &mut stream, &mut sealer, request).await
        {
            break Some(e.to_string());
        }
    };
    match end {
        None => tracing::debug!(peer = %addr, "peer disconnected"),
        Some(reason) => tracing::info!(peer = %addr, %reason, "peer connection closed"),
    }
}

/// The acceptor's side of a peer's handshake, within [`HANDSHAKE_TIMEOUT`] and while the
/// handshake budget keeps `ticket`: the peer and its record layer, or `None` (counted and
/// logged: refused, dropped, or this node connecting to itself).
async fn accept_handshake(
    cluster: &Arc<Cluster>,
    stream: &mut TcpStream,
    addr: SocketAddr,
    ticket: &mut super::HandshakeTicket,
) -> Option<(PeerIdentity, Records)> {
    let shake = async {
        tokio::time::timeout(
            HANDSHAKE_TIMEOUT,
            handshake(stream, cluster.transport.local(), Side::Acceptor, 0),
        )
        .await
        .unwrap_or(Err(LinkError::Timeout(HANDSHAKE_TIMEOUT)))
    };
    // A newer connection may take this one's place in the handshake budget meanwhile.
    let shake = tokio::select! {
        shake = shake => shake,
        _ = ticket.evicted() => {
            cluster.note_handshake_dropped(addr, "the handshake budget was full; the oldest went");
            return None;
        }
    };
    match shake {
        Ok(done) => Some(done),
        Err(LinkError::SelfConnection) => None,
        Err(e) if e.is_refusal() => {
            cluster
                .counters
                .peers_refused
                .fetch_add(1, Ordering::Relaxed);
            cluster.log_limited(format!("peer connection from {addr}: {e}"));
            None
        }
        Err(e) => {
            let why = match e {
                LinkError::Timeout(t) => {
                    format!(
                        "no complete handshake within {t:?} (a port scanner, or a peer behind a stalled link)"
                    )
                }
                e => e.to_string(),
            };
            cluster.note_handshake_dropped(addr, &why);
            None
        }
    }
}

/// Answers one request: a refusal, or the range's bytes written from the segment to the socket
/// under a lease, as records of at most [`PIECE_BYTES`], each with its tag.
async fn send_range(
    conn: &PeerConn<'_>,
    shared: &Arc<Shared>,
    cluster: &Arc<Cluster>,
    stream: &mut TcpStream,
    sealer: &mut Sealer,
    request: ReadRequest,
) -> std::io::Result<()> {
    let handle = request.handle;
    let mut got = shared.with_objects(|o| o.lease(conn.id, handle));
    if got == Err(Status::WrongNode) {
        // A third node's object: this node relays it (the `relay` placement), pulling a copy
        // from its owner first.
        got = match cluster.pulled(shared, handle, handle.node_id).await {
            Ok(()) => shared.with_objects(|o| o.lease(conn.id, handle)),
            Err(status) => Err(status),
        };
    }
    let got = match got {
        Ok(got) => got,
        Err(status) => {
            return write_record(
                stream,
                sealer,
                &ReadReply::refused(handle, status).to_bytes(),
            )
            .await;
        }
    };
    let location = got.location;
    let lease = SendLease {
        shared,
        conn: conn.id,
        handle,
    };
    if request.offset >= location.len {
        drop(lease);
        let refusal = ReadReply::refused(handle, Status::InvalidArgument);
        return write_record(stream, sealer, &refusal.to_bytes()).await;
    }
    let len = request.len.min(location.len - request.offset);
    let reply = ReadReply {
        status: Status::Ok,
        handle,
        writer: got.writer,
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
    write_record(stream, sealer, &reply.to_bytes()).await?;
    for piece in bytes.chunks(PIECE_BYTES) {
        // From the segment to the socket: no buffer between.
        write_record(stream, sealer, piece).await?;
    }
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
