//! The service manager's notification protocol (`sd_notify(3)`), spoken without libsystemd:
//! one datagram of `KEY=value` lines to the socket `$NOTIFY_SOCKET` names. Under a unit with
//! `Type=notify` the daemon says `READY=1` once it serves; a daemon handing itself over to a
//! successor (`systemctl reload`, which runs `feedstored --takeover --detach`) says
//! `MAINPID=` the successor's pid before it stops, so the service manager follows the
//! successor instead of taking the old daemon's exit for the service's end.
//!
//! Without `$NOTIFY_SOCKET` (not under systemd) every call does nothing.

use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::ffi::OsStrExt;

use nix::sys::socket::{
    AddressFamily, ControlMessage, MsgFlags, SockFlag, SockType, UnixAddr, sendmsg, socket,
};

/// The variable naming the service manager's socket.
const NOTIFY_SOCKET: &str = "NOTIFY_SOCKET";

/// Sends `state` (newline-separated `KEY=value` assignments) to the service manager: `false`
/// when there is none, or it could not be reached (logged at debug: a daemon run by hand
/// under a stale variable serves on regardless).
pub fn notify(state: &str) -> bool {
    if std::env::var_os(NOTIFY_SOCKET).is_none() {
        return false;
    }
    match send(state, &[], true) {
        Ok(()) => true,
        Err(e) => {
            tracing::debug!(error = %e, state, "cannot notify the service manager");
            false
        }
    }
}

/// Sends `state` with the descriptors `fds` (`SCM_RIGHTS`, for `FDSTORE=1`) to the service
/// manager; `wait`: for room in its socket, else a full socket is an error.
pub fn send(state: &str, fds: &[RawFd], wait: bool) -> std::io::Result<()> {
    let path = std::env::var_os(NOTIFY_SOCKET)
        .ok_or_else(|| std::io::Error::other("no $NOTIFY_SOCKET: not run by a service manager"))?;
    let addr = address(path.as_bytes())?;
    let socket = socket(
        AddressFamily::Unix,
        SockType::Datagram,
        SockFlag::SOCK_CLOEXEC,
        None,
    )?;
    let iov = [std::io::IoSlice::new(state.as_bytes())];
    let rights = [ControlMessage::ScmRights(fds)];
    let cmsgs: &[ControlMessage<'_>] = if fds.is_empty() { &[] } else { &rights };
    let flags = if wait {
        MsgFlags::empty()
    } else {
        MsgFlags::MSG_DONTWAIT
    };
    sendmsg(socket.as_raw_fd(), &iov, cmsgs, flags, Some(&addr))?;
    Ok(())
}

/// The socket `$NOTIFY_SOCKET` names: a path, or an abstract name after `@`.
fn address(name: &[u8]) -> std::io::Result<UnixAddr> {
    match name.split_first() {
        Some((b'@', abstract_name)) => Ok(UnixAddr::new_abstract(abstract_name)?),
        Some((b'/', _)) => Ok(UnixAddr::new(name)?),
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
