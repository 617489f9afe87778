//! The service manager's notification protocol (`sd_notify(3)`), spoken without libsystemd:
//! one datagram of `KEY=value` lines to the socket `$NOTIFY_SOCKET` names. Under a unit with
//! `Type=notify` the daemon says `READY=1` once it serves; a daemon handing itself over to a
//! successor (`systemctl reload`, which runs `feedstored --takeover --detach`) says
//! `MAINPID=` the successor's pid before it stops, so the service manager follows the
//! successor instead of taking the old daemon's exit for the service's end.
//!
//! Without `$NOTIFY_SOCKET` (not under systemd) every call does nothing.

use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram};

/// The variable naming the service manager's socket.
const NOTIFY_SOCKET: &str = "NOTIFY_SOCKET";

/// Sends `state` (newline-separated `KEY=value` assignments) to the service manager: `false`
/// when there is none, or it could not be reached (logged at debug: a daemon run by hand
/// under a stale variable serves on regardless).
pub fn notify(state: &str) -> bool {
    let Some(path) = std::env::var_os(NOTIFY_SOCKET) else {
        return false;
    };
    let sent = address(path.as_bytes()).and_then(|addr| {
        let socket = UnixDatagram::unbound()?;
        socket.send_to_addr(state.as_bytes(), &addr)
    });
    match sent {
        Ok(_) => true,
        Err(e) => {
            tracing::debug!(error = %e, state, "cannot notify the service manager");
            false
        }
    }
}

/// The socket `$NOTIFY_SOCKET` names: a path, or an abstract name after `@`.
fn address(name: &[u8]) -> std::io::Result<SocketAddr> {
    use std::os::linux::net::SocketAddrExt;
    match name.split_first() {
        Some((b'@', abstract_name)) => SocketAddr::from_abstract_name(abstract_name),
        Some((b'/', _)) => SocketAddr::from_pathname(std::ffi::OsStr::from_bytes(name)),
        _ => Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "$NOTIFY_SOCKET is neither a path nor an abstract name",
        )),
    }
}

/// Tells the service manager the daemon serves (`READY=1`), with its pid as the service's main
/// process (a successor started by `systemctl reload` is not the process it started).
pub fn ready(status: &str) -> bool {
    notify(&format!(
        "READY=1\nMAINPID={}\nSTATUS={status}",
        std::process::id()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_socket_is_a_path_or_an_abstract_name() {
        assert!(address(b"/run/systemd/notify").is_ok());
        assert!(address(b"@/org/freedesktop/systemd1/notify/1").is_ok());
        assert!(address(b"relative/path").is_err());
        assert!(address(b"").is_err());
    }
}
