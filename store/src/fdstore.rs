//! The service manager's file descriptor store (`sd_notify(3)`'s `FDSTORE=1`, spoken without
//! libsystemd), where a daemon run with `--fd-store` keeps its segments and its ledger (the
//! object table, `feedstore_core::objects::ledger`) so that, killed and started again by
//! systemd, it finds them among the descriptors it is passed (`sd_listen_fds(3)`:
//! `$LISTEN_PID`, `$LISTEN_FDS`, `$LISTEN_FDNAMES`, from descriptor 3) and serves the same
//! objects. The unit needs `FileDescriptorStoreMax=` (systemd keeps nothing by default) and
//! `NotifyAccess=all` (a daemon that took over is not the process systemd started).
//!
//! Names: `segment-<i>` for segment `i`, `ledger-<generation>` for a ledger.

use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;

use feedstore_core::objects::ledger::LedgerStore;

/// The first descriptor the service manager passes.
const LISTEN_FDS_START: RawFd = 3;

/// Descriptors the service manager passed this process at its start, by name.
#[derive(Debug, Default)]
pub struct Passed {
    /// `(name, descriptor)`, in the order passed.
    pub fds: Vec<(String, OwnedFd)>,
}

impl Passed {
    /// Takes the descriptors the service manager passed (none when `$LISTEN_PID` is not this
    /// process). Each becomes close-on-exec.
    pub fn take() -> Passed {
        let var = |name| std::env::var(name).ok();
        let mine = var("LISTEN_PID")
            .and_then(|p| p.parse::<u32>().ok())
            .is_some_and(|p| p == std::process::id());
        let count = var("LISTEN_FDS")
            .and_then(|n| n.parse::<i32>().ok())
            .unwrap_or(0);
        if !mine || count <= 0 {
            return Passed::default();
        }
        let names = var("LISTEN_FDNAMES").unwrap_or_default();
        let mut names = names.split(':');
        let fds = (0..count.min(65_536))
            .filter_map(|i| {
                let raw = LISTEN_FDS_START + i;
                let name = names.next().unwrap_or("unknown").to_string();
                // Only a descriptor that is open: the variables could lie.
                nix::fcntl::fcntl(
                    // SAFETY: a plain number, borrowed only for this call.
                    unsafe { BorrowedFd::borrow_raw(raw) },
                    nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::FD_CLOEXEC),
                )
                .ok()?;
                // SAFETY: the service manager passed this descriptor to this process (it is
                // open, checked above); nothing else in the process owns it.
                Some((name, unsafe { OwnedFd::from_raw_fd(raw) }))
            })
            .collect();
        Passed { fds }
    }

    /// Takes the descriptors named `name`.
    pub fn named(&mut self, name: &str) -> Vec<OwnedFd> {
        let (out, keep) = std::mem::take(&mut self.fds)
            .into_iter()
            .partition(|(n, _)| n == name);
        self.fds = keep;
        out.into_iter().map(|(_, fd)| fd).collect()
    }

    /// Takes the descriptors whose names start with `prefix`, with the rest of their names.
    pub fn prefixed(&mut self, prefix: &str) -> Vec<(String, OwnedFd)> {
        let (out, keep): (Vec<_>, Vec<_>) = std::mem::take(&mut self.fds)
            .into_iter()
            .partition(|(n, _)| n.starts_with(prefix));
        self.fds = keep;
        out.into_iter()
            .map(|(n, fd)| (n[prefix.len()..].to_string(), fd))
            .collect()
    }
}

/// Sends `state` with `fds` to the service manager (`$NOTIFY_SOCKET`), waiting for room in
/// its socket rather than dropping the message.
fn notify_with_fds(state: &str, fds: &[RawFd]) -> std::io::Result<()> {
    use nix::sys::socket::{
        AddressFamily, ControlMessage, MsgFlags, SockFlag, SockType, UnixAddr, sendmsg, socket,
    };
    let path = std::env::var_os("NOTIFY_SOCKET")
        .ok_or_else(|| std::io::Error::other("no $NOTIFY_SOCKET: not run by a service manager"))?;
    let path = path.as_bytes();
    let addr = match path.split_first() {
        Some((b'@', name)) => UnixAddr::new_abstract(name)?,
        Some((b'/', _)) => UnixAddr::new(path)?,
        _ => {
            return Err(std::io::Error::other(
                "$NOTIFY_SOCKET is neither a path nor an abstract name",
            ));
        }
    };
    let socket = socket(
        AddressFamily::Unix,
        SockType::Datagram,
        SockFlag::SOCK_CLOEXEC,
        None,
    )?;
    let iov = [std::io::IoSlice::new(state.as_bytes())];
    let rights = [ControlMessage::ScmRights(fds)];
    let cmsgs: &[ControlMessage<'_>] = if fds.is_empty() { &[] } else { &rights };
    sendmsg(
        socket.as_raw_fd(),
        &iov,
        cmsgs,
        MsgFlags::empty(),
        Some(&addr),
    )?;
    Ok(())
}

/// Asks the service manager to keep `fd` under `name`.
pub fn keep(name: &str, fd: BorrowedFd<'_>) -> std::io::Result<()> {
    notify_with_fds(&format!("FDSTORE=1\nFDNAME={name}"), &[fd.as_raw_fd()])
}

/// Asks the service manager to close what it keeps under `name`.
pub fn forget(name: &str) {
    if let Err(e) = notify_with_fds(&format!("FDSTOREREMOVE=1\nFDNAME={name}"), &[]) {
        tracing::warn!(error = %e, name, "cannot tell the service manager to let go of a descriptor");
    }
}

/// The name a segment is kept under.
pub fn segment_name(index: usize) -> String {
    format!("segment-{index}")
}

/// The name a ledger is kept under.
pub fn ledger_name(generation: u64) -> String {
    format!("ledger-{generation}")
}

/// The node's boot-time clock in nanoseconds: later for every daemon started later on the node.
fn boot_time_ns() -> u64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `t` is a valid, writable timespec; CLOCK_BOOTTIME exists on every Linux this
    // builds for.
    if unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut t) } != 0 {
        return 0;
    }
    (t.tv_sec as u64)
        .saturating_mul(1_000_000_000)
        .saturating_add(t.tv_nsec as u64)
}

/// The service manager, keeping a daemon's ledgers.
#[derive(Debug)]
pub struct ServiceManager;

impl LedgerStore for ServiceManager {
    fn generation(&self) -> u64 {
        boot_time_ns()
    }

    fn keep(
        &mut self,
        ledger: BorrowedFd<'_>,
        generation: u64,
        replaces: Option<u64>,
    ) -> std::io::Result<()> {
        keep(&ledger_name(generation), ledger)?;
        if let Some(old) = replaces {
            forget(&ledger_name(old));
        }
        Ok(())
    }

    fn forget(&mut self, generation: u64) {
        forget(&ledger_name(generation));
    }
}

/// A store read back from what the service manager kept.
pub(crate) struct Restored {
    pub objects: feedstore_core::objects::Objects,
    pub segments: Vec<feedstore_shm::Segment>,
    /// The ledger it was read from (let go of once the daemon keeps its own).
    pub generation: u64,
}

/// Reads the store back from the descriptors the service manager passed (a daemon run with
/// `--fd-store`, started again after it was killed): the segments and the latest complete
/// ledger, with what processes that exited since held dropped. `None` when there is nothing
/// to read back, or what there is cannot be trusted (said why): then everything passed is
/// let go of, and the daemon starts afresh.
pub(crate) fn restore(node_id: u32, mut passed: Passed) -> Option<Restored> {
    use feedstore_core::objects::ledger;
    if passed.fds.is_empty() {
        return None;
    }
    // Names to let go of whatever happens: ledgers not read, descriptors of no known kind.
    let mut stale = Vec::new();
    let mut best: Option<(ledger::Recovered, String)> = None;
    for (generation, fd) in passed.prefixed("ledger-") {
        let name = ledger_name_of(&generation);
        match ledger::read(fd) {
            Ok(Some(r)) if best.as_ref().is_none_or(|b| b.0.generation < r.generation) => {
                stale.extend(best.replace((r, name)).map(|(_, older)| older));
            }
            Ok(_) => stale.push(name),
            Err(e) => {
                tracing::warn!(error = %e, name, "a ledger the service manager kept is not read");
                stale.push(name);
            }
        }
    }
    let segments = passed.prefixed("segment-");
    stale.extend(passed.fds.drain(..).map(|(name, _)| name));
    let mut segment_names: Vec<String> = segments
        .iter()
        .map(|(i, _)| format!("segment-{i}"))
        .collect();
    segment_names.sort();
    segment_names.dedup();
    let give_up = |why: &str, mine: Option<&str>| {
        tracing::warn!(
            "the store the service manager kept is not served again ({why}): starting afresh"
        );
        for name in stale
            .iter()
            .chain(&segment_names)
            .map(String::as_str)
            .chain(mine)
        {
            forget(name);
        }
        None
    };
    let Some((recovered, name)) = best else {
        return give_up("no complete ledger", None);
    };
    let mut handover = recovered.handover;
    if handover.node_id != node_id {
        let why = format!(
            "it is node {:08x}'s, this daemon is node {node_id:08x}",
            handover.node_id
        );
        return give_up(&why, Some(&name));
    }
    // The segments in order, each once (a name kept twice is one memory kept twice).
    let mut by_index: std::collections::BTreeMap<usize, OwnedFd> = Default::default();
    for (i, fd) in segments {
        if let Ok(i) = i.parse::<usize>() {
            by_index.entry(i).or_insert(fd);
        }
    }
    let mut adopted = Vec::new();
    for (i, &size) in handover.segments.iter().enumerate() {
        let adopt = by_index
            .remove(&i)
            .ok_or_else(|| "it was not kept".to_string())
            .and_then(|fd| {
                feedstore_shm::Segment::adopt(fd, size, handover.hugetlb).map_err(|e| e.to_string())
            });
        match adopt {
            Ok(segment) => adopted.push(segment),
            Err(e) => return give_up(&format!("segment {i}: {e}"), Some(&name)),
        }
    }
    let pidfds = find_processes(&mut handover);
    let objects = match feedstore_core::objects::Objects::take_over(&handover, pidfds) {
        Ok(objects) => objects,
        Err(e) => return give_up(&e.to_string(), Some(&name)),
    };
    // Segments the table does not have (a larger store before) go too.
    for name in stale
        .iter()
        .cloned()
        .chain(by_index.keys().map(|&i| segment_name(i)))
    {
        forget(&name);
    }
    tracing::info!(
        generation = recovered.generation,
        objects = handover.objects.len(),
        processes = handover.processes.len(),
        crashed_pid = handover.pid,
        epoch = %format!("{:08x}", handover.epoch),
        "read the store back from the service manager's descriptor store: the objects of the \
         daemon before this one are served again, with the same handles"
    );
    Some(Restored {
        objects,
        segments: adopted,
        generation: recovered.generation,
    })
}

fn ledger_name_of(rest: &str) -> String {
    format!("ledger-{rest}")
}

/// Finds the processes a table read back names: those still running get their pidfds (in
/// the table's order, for [`feedstore_core::objects::Objects::take_over`]); what those that
/// exited held is dropped; the rest (another pid namespace's, unnamed) stay held for until
/// a daemon starts afresh.
fn find_processes(h: &mut feedstore_proto::handover::Handover) -> Vec<OwnedFd> {
    use feedstore_proto::handover::UNNAMED_KEY;
    let same_pids =
        h.pid_namespace != 0 && h.pid_namespace == feedstore_core::objects::pid_namespace();
    let mut gone = std::collections::HashSet::new();
    let mut pidfds = Vec::new();
    for p in &mut h.processes {
        if !same_pids || p.key & UNNAMED_KEY != 0 {
            continue;
        }
        match crate::credentials::find(p.pid, p.key) {
            crate::credentials::Found::Running(pidfd) => {
                p.pidfd = true;
                pidfds.push(pidfd);
            }
            crate::credentials::Found::Gone => {
                gone.insert(p.key);
            }
            crate::credentials::Found::Unknown => {}
        }
    }
    feedstore_core::objects::ledger::forget_processes(h, &gone);
    pidfds
}

/// Keeps the daemon's segments and a ledger of its table in the service manager's store
/// (once it serves: a daemon taking over keeps its ledger only once its predecessor stopped
/// keeping its own), in place of the ledger of generation `replaces`.
pub(crate) fn keep_store(shared: &crate::state::Shared, replaces: Option<u64>) {
    for (i, segment) in shared.segments.iter().enumerate() {
        if let Err(e) = keep(&segment_name(i), segment.fd()) {
            tracing::warn!(
                error = %e,
                "cannot keep the segments in the service manager's descriptor store: a daemon \
                 started after this one is killed starts afresh"
            );
            return;
        }
    }
    match shared.with_objects(|o| o.keep_ledger(Box::new(ServiceManager))) {
        Ok(()) => {
            if let Some(old) = replaces {
                forget(&ledger_name(old));
            }
        }
        Err(e) => tracing::warn!(
            error = %e,
            "cannot keep the object table in the service manager's descriptor store: a daemon \
             started after this one is killed starts afresh"
        ),
    }
}

/// Lets go of everything kept in the service manager's store (the daemon stops: its store
/// ends with it).
pub(crate) fn let_go(shared: &crate::state::Shared) {
    shared.with_objects(|o| o.abandon_ledger());
    for i in 0..shared.segments.len() {
        forget(&segment_name(i));
    }
}
