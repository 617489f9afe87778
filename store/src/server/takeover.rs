//! The daemon's side of `feedstored --takeover` (see `crate::handoff`): a connection whose
//! first request is [`Request::Takeover`] gets the daemon's state and descriptors, and the
//! daemon stops once the successor is ready (a two-step commit: the successor serves only once
//! the daemon said it stops and its connection closed).
//!
//! [`Request::Takeover`]: feedstore_proto::frame::Request::Takeover

use std::os::fd::AsRawFd;

use feedstore_proto::Status;
use feedstore_proto::handover::HANDOVER_FORMAT;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::{ConnEnd, Connection};
use crate::handoff::{
    HANDOVER_MAGIC, PIDFDS, PIDFDS_PER_MESSAGE, QUIESCE_DEADLINE, READY, STOPPING,
    SUCCESSOR_DEADLINE,
};

impl Connection {
    pub(super) async fn hand_over(&mut self, request_id: u32, format: u32) -> Result<(), ConnEnd> {
        let (uid, pid) = (self.credentials.uid, self.credentials.pid);
        if uid != self.shared.daemon_uid && uid != 0 {
            let message = format!(
                "uid {uid} may not take over this feedstored (it runs as uid {}): only its uid \
                 and root may",
                self.shared.daemon_uid
            );
            return self
                .refuse(request_id, Status::PermissionDenied, message)
                .await;
        }
        if format != HANDOVER_FORMAT {
            let message = format!(
                "this feedstored hands over in format {HANDOVER_FORMAT}, the successor reads \
                 format {format}: stop this one and start the other instead (its clients \
                 reconnect; the objects it holds are lost)"
            );
            return self.refuse(request_id, Status::Protocol, message).await;
        }
        let shared = self.shared.clone();
        let handoff = &shared.handoff;
        let Some(listeners) = handoff.listeners() else {
            let message = "this feedstored is not serving yet".to_string();
            return self.refuse(request_id, Status::InvalidState, message).await;
        };
        if !handoff.freeze() {
            let message = "another successor is taking this feedstored over".to_string();
            return self.refuse(request_id, Status::InUse, message).await;
        }
        // Frozen: no request starts, and each under way finishes or parks where it waits (a
        // bounded wait); so do the sweeper and, in a cluster, every pull before it reserves
        // memory or seals its copy and every peer's put before it publishes. What still runs
        // (pulls landing bytes in reservations of the daemon's own, peers served bytes of
        // objects they lease) changes nothing the table handed over says is in use, and ends
        // before the successor serves: the table handed over is the last.
        let quiet_by = tokio::time::Instant::now() + QUIESCE_DEADLINE;
        while handoff.busy() > 1 {
            if tokio::time::Instant::now() >= quiet_by {
                handoff.thaw();
                let message = format!(
                    "requests under way did not finish or wait within {QUIESCE_DEADLINE:?}: try \
                     again"
                );
                return self.refuse(request_id, Status::InUse, message).await;
            }
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
        let (state, pidfds) = self
            .shared
            .with_objects(|o| o.hand_over(listeners.peers.is_some(), listeners.metrics.is_some()));
        let bytes = state.encode();
        self.wbuf.clear();
        self.wbuf.extend_from_slice(HANDOVER_MAGIC);
        self.wbuf
            .extend_from_slice(&(bytes.len() as u64).to_le_bytes());
        self.wbuf.extend_from_slice(&bytes);
        let mut fds: Vec<i32> = self
            .shared
            .segments
            .iter()
            .map(|s| s.fd().as_raw_fd())
            .collect();
        fds.push(listeners.clients);
        fds.extend(listeners.peers);
        fds.extend(listeners.metrics);
        tracing::info!(
            successor_pid = pid,
            objects = state.objects.len(),
            processes = state.processes.len(),
            bytes = bytes.len(),
            "handing over to a successor (feedstored --takeover): serving nothing meanwhile"
        );
        let mut sent = self.send_with_fds_now(&fds).await;
        // Then the client processes' pidfds, a batch to a one-byte message.
        for batch in pidfds.chunks(PIDFDS_PER_MESSAGE) {
            if sent.is_err() {
                break;
            }
            let raw: Vec<i32> = batch.iter().map(|fd| fd.as_raw_fd()).collect();
            self.wbuf.clear();
            self.wbuf.push(PIDFDS);
            sent = self.send_with_fds_now(&raw).await;
        }
        // The successor says it is ready (its state built, nothing served yet); this daemon
        // answers that it stops, and stops. Anything else, and it serves on.
        let mut word = [0u8; 1];
        let answered = match sent {
            Ok(()) => tokio::time::timeout(SUCCESSOR_DEADLINE, self.stream.read(&mut word)).await,
            Err(e) => Ok(Err(std::io::Error::other(e.to_string()))),
        };
        let ready = matches!(answered, Ok(Ok(1))) && word[0] == READY;
        // The successor's connection is held open until this daemon's runtime is gone (every
        // task dropped, every worker thread joined, a pull landing bytes included): its close
        // is the successor's sign that nothing here touches the memory any more. Copied before
        // the daemon commits, so that a failure to copy it leaves the daemon serving.
        let (held, uncopied) =
            match ready.then(|| std::os::fd::AsFd::as_fd(&self.stream).try_clone_to_owned()) {
                Some(Ok(fd)) => (Some(fd), None),
                Some(Err(e)) => (None, Some(e)),
                None => (None, None),
            };
        // The ledger kept for a daemon started after a crash stops being this one's before
        // the successor is told this one stops (which the successor may serve on at once):
        // killed in between, systemd's next daemon starts afresh rather than from a table the
        // successor changed. Kept again if the word does not go.
        let had_ledger = held.is_some()
            && self.shared.with_objects(|o| {
                let had = o.ledger_generation().is_some();
                o.abandon_ledger();
                had
            });
        if let Some(held) = held
            && self.stream.write_all(&[STOPPING]).await.is_ok()
        {
            tracing::info!(
                successor_pid = pid,
                "the successor is ready: this feedstored stops (the socket is the successor's)"
            );
            // Under systemd: the successor is the service's main process from now on, told
            // before this one exits (the manager reads it before it learns of the exit).
            if pid > 0 {
                crate::notify::notify(&format!(
                    "MAINPID={pid}\nSTATUS=handed over to pid {pid} (feedstored --takeover)"
                ));
            }
            handoff.stop_for(held);
            std::future::pending::<()>().await;
        }
        let why = match (answered, uncopied) {
            (_, Some(e)) => format!("cannot keep its connection open: {e}"),
            (Err(_), None) => format!("no word within {SUCCESSOR_DEADLINE:?}"),
            (Ok(Ok(0)), None) => "it closed (see its own log for why)".into(),
            (Ok(Ok(_)), None) if ready => "it closed before this one's answer".into(),
            (Ok(Ok(_)), None) => format!("it said {} instead of being ready", word[0]),
            (Ok(Err(e)), None) => e.to_string(),
        };
        tracing::warn!(successor_pid = pid, reason = %why, "the successor did not take over: serving on");
        if had_ledger {
            crate::fdstore::keep_store(&self.shared, None);
        }
        handoff.thaw();
        Err(ConnEnd::Closed)
    }
}
