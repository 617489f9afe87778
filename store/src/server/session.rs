//! The session family: a connection's hello (who may connect as what, the frame limit, the
//! segments' descriptors) and what a client of another protocol version is told.

use std::os::fd::AsRawFd;

use feedstore_proto::frame::{MIN_PAYLOAD_BYTES, Opcode, Response, Speaks};
use feedstore_proto::{MAX_CLIENT_NAME, Role, Status};

use super::{ConnEnd, Connection, error};
use crate::objects::ClientInfo;

impl Connection {
    /// Refuses the hello with a reply the client can show, then ends the connection.
    pub(super) async fn refuse(
        &mut self,
        request_id: u32,
        status: Status,
        message: String,
    ) -> Result<(), ConnEnd> {
        self.reply(Opcode::Hello, request_id, &error(status, message.clone()))
            .await?;
        Err(ConnEnd::Refused(message))
    }

    pub(super) async fn hello(
        &mut self,
        request_id: u32,
        role: Role,
        name: String,
        max_frame_bytes: u32,
        speaks: Speaks,
        reconnects: u32,
    ) -> Result<(), ConnEnd> {
        let shared = self.shared.clone();
        let ours = Speaks::ours();
        let Some(version) = ours.common(&speaks) else {
            // (Told in this daemon's newest version: an error reply reads the same in all.)
            let message = no_common_version(&ours, &speaks);
            return self.refuse(request_id, Status::Protocol, message).await;
        };
        self.version = version;
        if let Some(message) = shared.policy.refusal(&self.credentials, role) {
            return self
                .refuse(request_id, Status::PermissionDenied, message)
                .await;
        }
        if name.len() > MAX_CLIENT_NAME || name.chars().any(char::is_control) {
            let message = format!(
                "client name of {} bytes refused: at most {MAX_CLIENT_NAME} bytes of printable text",
                name.len()
            );
            return self
                .refuse(request_id, Status::InvalidArgument, message)
                .await;
        }
        if max_frame_bytes < MIN_PAYLOAD_BYTES {
            let message = format!(
                "the client accepts frames of {max_frame_bytes} bytes; at least {MIN_PAYLOAD_BYTES} are needed"
            );
            return self
                .refuse(request_id, Status::InvalidArgument, message)
                .await;
        }
        let info = ClientInfo {
            role,
            uid: self.credentials.uid,
            pid: self.credentials.pid,
            process: self.credentials.process.clone(),
            name: name.clone(),
            internal: false,
            // A uid allowed only to read holds at most its share of the store leased.
            capped: !shared.policy.may_write(&self.credentials),
        };
        let id = shared.with_objects(|o| {
            let id = o.connect(info);
            if reconnects > 0 {
                o.note_reconnected(id);
            }
            id
        });
        self.id = Some(id);
        self.role = role;
        self.client_limit = max_frame_bytes;
        self.name = name;
        if reconnects > 0 {
            tracing::info!(conn = id, pid = self.credentials.pid, uid = self.credentials.uid, ?role, name = ?self.name, protocol = version, client = %speaks.describe(), reconnects, "client connected again after its daemon went away");
        } else {
            tracing::info!(conn = id, pid = self.credentials.pid, uid = self.credentials.uid, ?role, name = ?self.name, protocol = version, client = %speaks.describe(), "client connected");
        }
        let response = Response::Hello {
            node_id: shared.node_id,
            epoch: shared.epoch,
            segments: shared.segment_infos(role),
            max_frame_bytes: shared.max_frame_bytes,
            speaks: ours,
        };
        self.wbuf.clear();
        self.encode_reply(Opcode::Hello, request_id, &response);
        let fds: Vec<i32> = match role {
            Role::Writer => shared.segments.iter().map(|s| s.fd().as_raw_fd()).collect(),
            Role::Reader => shared.readonly_fds.iter().map(|f| f.as_raw_fd()).collect(),
        };
        // The descriptors ride on the first byte of the reply; the rest follows as plain bytes.
        self.send_with_fds(&fds).await
    }
}

/// What a client of protocol `found`, older than any this daemon speaks, is told.
pub(super) fn version_mismatch(found: u16) -> String {
    no_common_version(&Speaks::ours(), &Speaks::implied(found))
}

/// What a client that shares no protocol version with this daemon is told: both sides'
/// releases and versions, and which to upgrade.
fn no_common_version(ours: &Speaks, client: &Speaks) -> String {
    let upgrade = if client.max < ours.min {
        "the client"
    } else {
        "this feedstored"
    };
    format!(
        "feedstored is {}, this client {}: no protocol version in common; upgrade {upgrade} \
         (clients and daemons of adjacent releases work together)",
        ours.describe(),
        client.describe()
    )
}
