//! Who is on the other end of a client's Unix-socket connection, as the kernel recorded it when
//! the client connected (in feedstore a *peer* is another node's daemon; this is not about them):
//! uid, primary gid and pid (`SO_PEERCRED`) and every supplementary group (`SO_PEERGROUPS`, Linux
//! 4.13+), so `--socket-group` admits a member however it belongs to the group.

use std::io;
use std::os::fd::{AsRawFd, RawFd};

/// A connected client's credentials, as the kernel recorded them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Credentials {
    /// Effective uid at connect.
    pub uid: u32,
    /// Effective primary gid at connect.
    pub gid: u32,
    /// Process id (0 when the client lives in another pid namespace).
    pub pid: i32,
    /// The primary gid and every supplementary group.
    pub groups: Vec<u32>,
}

impl Credentials {
    /// The credentials of the other end of a connected Unix socket.
    pub fn of(stream: &tokio::net::UnixStream) -> io::Result<Credentials> {
        let cred = stream.peer_cred()?;
        let mut groups = supplementary_groups(stream.as_raw_fd())?;
        groups.push(cred.gid());
        groups.sort_unstable();
        groups.dedup();
        Ok(Credentials {
            uid: cred.uid(),
            gid: cred.gid(),
            pid: cred.pid().unwrap_or(0),
            groups,
        })
    }
}

/// `SO_PEERGROUPS` (asm-generic value; the architectures this is built for use it).
const SO_PEERGROUPS: libc::c_int = 59;

/// The connected process's supplementary groups. The kernel says how much room it needs when
/// the buffer is short (`ERANGE`), bounded by `NGROUPS_MAX` (65536).
fn supplementary_groups(fd: RawFd) -> io::Result<Vec<u32>> {
    let mut groups: Vec<libc::gid_t> = vec![0; 64];
    loop {
        let mut len = (groups.len() * std::mem::size_of::<libc::gid_t>()) as libc::socklen_t;
        // SAFETY: `groups` is a writable buffer of `len` bytes that lives across the call, and
        // `len` is a valid, writable `socklen_t`; the kernel writes at most `len` bytes and
        // stores the length it used (or needs) in `len`.
        let rc = unsafe {
            libc::getsockopt(
                fd,
                libc::SOL_SOCKET,
                SO_PEERGROUPS,
                groups.as_mut_ptr().cast(),
                &mut len,
            )
        };
        let n = len as usize / std::mem::size_of::<libc::gid_t>();
        if rc == 0 {
            groups.truncate(n);
            return Ok(groups);
        }
        let err = io::Error::last_os_error();
        if err.raw_os_error() == Some(libc::ERANGE) && n > groups.len() && n <= 65536 {
            groups.resize(n, 0);
            continue;
        }
        return Err(err);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_client_reports_its_own_groups() {
        let (a, _b) = tokio::net::UnixStream::pair().unwrap();
        let client = Credentials::of(&a).unwrap();
        assert_eq!(client.uid, nix::unistd::geteuid().as_raw());
        assert_eq!(client.pid, std::process::id() as i32);
        let mut ours: Vec<u32> = nix::unistd::getgroups()
            .unwrap()
            .into_iter()
            .map(|g| g.as_raw())
            .collect();
        ours.push(nix::unistd::getegid().as_raw());
        ours.sort_unstable();
        ours.dedup();
        assert_eq!(client.groups, ours);
    }
}
