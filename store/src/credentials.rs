//! Who is on the other end of a client's Unix-socket connection, as the kernel recorded it when
//! the client connected (in feedstore a *peer* is another node's daemon; this is not about them):
//! uid, primary gid and pid (`SO_PEERCRED`), every supplementary group (`SO_PEERGROUPS`, Linux
//! 4.13+), so `--socket-group` admits a member however it belongs to the group, and the process
//! itself (`SO_PEERPIDFD`, Linux 6.5+), which says when it exits and, with pidfs (Linux 6.9+),
//! names it across pid namespaces.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::Arc;

use feedstore_core::objects::Process;
use feedstore_proto::handover::PID_KEY;

/// A connected client's credentials, as the kernel recorded them.
#[derive(Debug, Clone)]
pub struct Credentials {
    /// Effective uid at connect.
    pub uid: u32,
    /// Effective primary gid at connect.
    pub gid: u32,
    /// Process id (0 when the client lives in another pid namespace).
    pub pid: i32,
    /// The primary gid and every supplementary group.
    pub groups: Vec<u32>,
    /// The process (its key 0 when the kernel cannot name it).
    pub process: Process,
}

impl Credentials {
    /// The credentials of the other end of a connected Unix socket.
    pub fn of(stream: &tokio::net::UnixStream) -> io::Result<Credentials> {
        let cred = stream.peer_cred()?;
        let mut groups = supplementary_groups(stream.as_raw_fd())?;
        groups.push(cred.gid());
        groups.sort_unstable();
        groups.dedup();
        let pid = cred.pid().unwrap_or(0);
        Ok(Credentials {
            uid: cred.uid(),
            gid: cred.gid(),
            pid,
            groups,
            process: process_of(stream.as_raw_fd(), pid),
        })
    }
}

/// `SO_PEERPIDFD` (asm-generic value, Linux 6.5+).
const SO_PEERPIDFD: libc::c_int = 77;
/// The file system pidfds live on from Linux 6.9 (`PIDFS_MAGIC`): each process's pidfds share
/// one inode number, never reused while the node runs.
const PIDFS_MAGIC: nix::sys::statfs::FsType = nix::sys::statfs::FsType(0x5049_4446);

/// Whether this kernel names processes by their pidfd's inode (pidfs, Linux 6.9+), which is
/// what recognises a client in another pid namespace across a takeover.
pub fn pidfs_names_processes() -> bool {
    let me = std::process::id() as libc::pid_t;
    // SAFETY: pidfd_open of this process's own pid, no flags.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, me, 0) };
    // SAFETY: on success, a fresh descriptor this process now owns.
    fd >= 0 && pidfs_inode(&unsafe { OwnedFd::from_raw_fd(fd as RawFd) }).is_some()
}

/// The process at the other end of `fd`: its pidfd where the kernel gives one (it says when
/// the process exited, whatever its pid namespace), and a key naming it — its pidfs inode,
/// else its pid (in this pid namespace; 0, unknown, in another).
fn process_of(fd: RawFd, pid: i32) -> Process {
    let pidfd = peer_pidfd(fd);
    let inode = pidfd.as_ref().and_then(pidfs_inode);
    let key = match inode {
        Some(ino) if ino != 0 && ino < PID_KEY => ino,
        _ if pid > 0 => PID_KEY | pid as u64,
        _ => 0,
    };
    Process {
        key,
        pidfd: pidfd.map(Arc::new),
        started: start_time(pid),
    }
}

/// When process `pid` (in this pid namespace) started, in clock ticks after boot (field 22 of
/// `/proc/<pid>/stat`); 0 when it cannot be read. With the pid, it names one process: a pid
/// given to another process later comes with a later start.
pub fn start_time(pid: i32) -> u64 {
    if pid <= 0 {
        return 0;
    }
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0;
    };
    // The command name (field 2) is in parentheses and may hold spaces and parentheses: the
    // fields after it follow the last ')'.
    stat.rsplit_once(')')
        .and_then(|(_, rest)| rest.split_whitespace().nth(19)?.parse().ok())
        .unwrap_or(0)
}

fn peer_pidfd(fd: RawFd) -> Option<OwnedFd> {
    let mut pidfd: libc::c_int = -1;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: `pidfd` and `len` are valid, writable and sized for the option's `int`; on
    // success the kernel installed a new descriptor in this process, owned by nothing else.
    let rc = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            SO_PEERPIDFD,
            (&mut pidfd as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    // SAFETY: see above: a fresh descriptor this process now owns.
    (rc == 0 && pidfd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(pidfd) })
}

/// The inode number of a pidfd on pidfs (one per process); `None` before Linux 6.9, where
/// every pidfd shares one anonymous inode.
fn pidfs_inode(pidfd: &OwnedFd) -> Option<u64> {
    let fs = nix::sys::statfs::fstatfs(pidfd).ok()?;
    if fs.filesystem_type() != PIDFS_MAGIC {
        return None;
    }
    Some(nix::sys::stat::fstat(pidfd).ok()?.st_ino)
}

/// Whether the process `pidfd` (or else `pid`, in this pid namespace) has exited: `false`
/// when neither can tell.
pub fn exited(process: &Process, pid: i32) -> bool {
    if let Some(pidfd) = &process.pidfd {
        let mut fds = [nix::poll::PollFd::new(
            std::os::fd::AsFd::as_fd(&**pidfd),
            nix::poll::PollFlags::POLLIN,
        )];
        // A pidfd polls readable once its process exited.
        return matches!(
            nix::poll::poll(&mut fds, nix::poll::PollTimeout::ZERO),
            Ok(n) if n > 0
        );
    }
    pid > 0
        && nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None)
            == Err(nix::errno::Errno::ESRCH)
}

/// What a pid and a process key recorded by an earlier daemon on this node say now.
#[derive(Debug)]
pub enum Found {
    /// The same process runs: its pidfd.
    Running(OwnedFd),
    /// It exited (its pid names nothing, or another process).
    Gone,
    /// Nothing can tell (no pidfd_open, or a key that does not name by pidfs).
    Unknown,
}

/// Finds the process `key` named with pid `pid` (in this pid namespace), which started at
/// `started` (0 unknown): a pidfs key must be the inode of the pid's pidfd now, else the pid
/// names another process; a key made of a pid (no pidfs) must come with the start time the
/// pid's process has now.
pub fn find(pid: i32, key: u64, started: u64) -> Found {
    if pid <= 0 {
        return Found::Unknown;
    }
    // SAFETY: pidfd_open of a plain pid, no flags.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return match nix::errno::Errno::last() {
            nix::errno::Errno::ESRCH => Found::Gone,
            _ => Found::Unknown,
        };
    }
    // SAFETY: a fresh descriptor this process now owns.
    let pidfd = unsafe { OwnedFd::from_raw_fd(fd as RawFd) };
    if key & PID_KEY != 0 {
        // (Read after the pidfd is open: the pid cannot pass to another process meanwhile
        // unless this one exits, which the pidfd then says.)
        return match start_time(pid) {
            _ if started == 0 => Found::Unknown,
            now if now == started => Found::Running(pidfd),
            0 => Found::Unknown,
            _ => Found::Gone,
        };
    }
    match pidfs_inode(&pidfd) {
        Some(inode) if inode == key => Found::Running(pidfd),
        Some(_) => Found::Gone,
        None => Found::Unknown,
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
        assert_ne!(client.process.key, 0, "this process is named");
        assert!(!exited(&client.process, client.pid), "and it runs");
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

#[cfg(test)]
mod process_tests {
    use super::*;

    /// A process another namespace cannot see by pid is still named and seen to exit: two
    /// connections from one child process share its key, another process's differs, and once
    /// the child exited its pidfd says so.
    #[tokio::test]
    async fn a_process_is_named_by_its_pidfd_and_seen_to_exit() {
        let dir = std::env::temp_dir().join(format!("feedstore-cred-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("s");
        let listener = tokio::net::UnixListener::bind(&path).unwrap();
        let mut child = std::process::Command::new("python3")
            .arg("-c")
            .arg(format!(
                "import socket,sys,time\n\
                 a=socket.socket(socket.AF_UNIX); a.connect('{p}')\n\
                 b=socket.socket(socket.AF_UNIX); b.connect('{p}')\n\
                 sys.stdin.read()",
                p = path.display()
            ))
            .stdin(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let (a, _) = listener.accept().await.unwrap();
        let (b, _) = listener.accept().await.unwrap();
        let (ca, cb) = (Credentials::of(&a).unwrap(), Credentials::of(&b).unwrap());
        if ca.process.pidfd.is_none() {
            eprintln!("SKIPPED: no SO_PEERPIDFD before Linux 6.5");
            drop(child.stdin.take());
            child.wait().unwrap();
            return;
        }
        let (mine, _other) = tokio::net::UnixStream::pair().unwrap();
        let me = Credentials::of(&mine).unwrap();
        assert_eq!(ca.process.key, cb.process.key);
        assert_ne!(ca.process.key, me.process.key);
        assert!(!exited(&ca.process, 0), "running");
        drop(child.stdin.take());
        child.wait().unwrap();
        assert!(exited(&ca.process, 0), "exited, told by its pidfd alone");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A process recorded by pid and key is found again while it runs, and not once it
    /// exited, nor where its pid names another process.
    #[test]
    fn a_recorded_process_is_found_again_only_while_it_runs() {
        let mut child = std::process::Command::new("sleep")
            .arg("60")
            .spawn()
            .unwrap();
        let pid = child.id() as i32;
        let started = start_time(pid);
        assert_ne!(started, 0, "its start time");
        let Found::Running(pidfd) = find(pid, PID_KEY | pid as u64, started) else {
            panic!("a running child, by pid and start time");
        };
        assert!(
            matches!(find(pid, PID_KEY | pid as u64, started + 1), Found::Gone),
            "the pid names a process started at another time"
        );
        assert!(
            matches!(find(pid, PID_KEY | pid as u64, 0), Found::Unknown),
            "a pid alone names nobody for sure"
        );
        let Some(key) = pidfs_inode(&pidfd) else {
            eprintln!("SKIPPED: no pidfs before Linux 6.9");
            child.kill().unwrap();
            child.wait().unwrap();
            return;
        };
        assert!(
            matches!(find(pid, key, 0), Found::Running(_)),
            "by its pidfs key"
        );
        assert!(
            matches!(find(pid, key ^ 1, 0), Found::Gone),
            "the pid names another process than the key"
        );
        assert!(
            matches!(find(0, key, 0), Found::Unknown),
            "no pid to look for"
        );
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(matches!(find(pid, key, 0), Found::Gone), "exited");
    }
}
