//! The service manager's file descriptor store (`sd_notify(3)`'s `FDSTORE=1`, spoken without
//! libsystemd), where a daemon run with `--fd-store` keeps its segments and its ledger (the
//! object table, `feedstore_core::objects::ledger`) so that, killed and started again by
//! systemd, it finds them among the descriptors it is passed (`sd_listen_fds(3)`:
//! `$LISTEN_PID`, `$LISTEN_FDS`, `$LISTEN_FDNAMES`, from descriptor 3) and serves the same
//! objects. The unit needs `FileDescriptorStoreMax=` (systemd keeps nothing by default) and
//! `NotifyAccess=all` (a daemon that took over is not the process systemd started).
//!
//! Names: `segment-<i>` for segment `i`, `ledger-<generation>` for a ledger.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

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
    /// process), once per process: a second call (a second daemon in one process) gets none.
    /// Each becomes close-on-exec.
    pub fn take() -> Passed {
        static TAKEN: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
        if TAKEN.swap(true, std::sync::atomic::Ordering::SeqCst) {
            return Passed::default();
        }
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
                // SAFETY: fcntl on a plain number touches no memory; a number that is not an
                // open descriptor fails with EBADF.
                if unsafe { libc::fcntl(raw, libc::F_SETFD, libc::FD_CLOEXEC) } != 0 {
                    return None;
                }
                // SAFETY: the service manager passed this descriptor to this process (it is
                // open, checked above); nothing else in the process owns it.
                Some((name, unsafe { OwnedFd::from_raw_fd(raw) }))
            })
            .collect();
        Passed { fds }
    }
}

/// Sends `state` with `fds` to the service manager, never waiting (some are sent under the
/// objects lock): a service manager too busy to take it is a failure, and a ledger is then not
/// kept.
fn notify_with_fds(state: &str, fds: &[RawFd]) -> std::io::Result<()> {
    crate::notify::send(state, fds, false)
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

/// The service manager, keeping a daemon's ledgers beside its segments.
#[derive(Debug)]
pub struct ServiceManager {
    /// The ids of the segments it keeps (their memfds' inodes), in order.
    pub segment_ids: Vec<u64>,
}

impl LedgerStore for ServiceManager {
    fn generation(&self) -> u64 {
        boot_time_ns()
    }

    fn segment_ids(&self) -> Vec<u64> {
        self.segment_ids.clone()
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
    /// What it was read from, let go of once the daemon serves ([`keep_store`]).
    pub read: Read,
}

/// What a daemon read its store back from: the ledger (its name and descriptor) and the rest
/// the service manager passed. Until the daemon serves, they stay as they were: a daemon that
/// fails to start leaves the next one the same store to read back.
pub(crate) struct Read {
    ledger: (String, OwnedFd),
    rest: Passed,
}

/// The id a segment is known by in a ledger: its memfd's inode.
pub(crate) fn segment_id(fd: BorrowedFd<'_>) -> u64 {
    nix::sys::stat::fstat(fd).map_or(0, |s| s.st_ino)
}

/// Lets go of every descriptor the service manager passed (`--fd-store` is off, or what it
/// kept is not served again).
pub(crate) fn forget_passed(passed: Passed) {
    let mut names: Vec<String> = passed.fds.into_iter().map(|(name, _)| name).collect();
    names.sort();
    names.dedup();
    for name in names {
        forget(&name);
    }
}

/// Reads the store back from the descriptors the service manager passed (a daemon run with
/// `--fd-store`, started again after it was killed): the segments and the ledger of the
/// highest generation, with what processes that exited since held dropped. `None` when there
/// is nothing to read back, or what there is cannot be trusted (said why): then everything
/// passed is let go of, and the daemon starts afresh. The ledger read is marked abandoned at
/// once: from now on only a ledger this daemon keeps describes the store.
pub(crate) fn restore(node_id: u32, mut passed: Passed) -> Option<Restored> {
    use feedstore_core::objects::ledger;
    if passed.fds.is_empty() {
        return None;
    }
    // What was passed goes back to the service manager's hands with `chosen` (the ledger
    // read, if any) when the store is not served again.
    let give_up = |why: &str, mut passed: Passed, chosen: Option<(String, OwnedFd)>| {
        tracing::warn!(
            "the store the service manager kept is not served again ({why}): starting afresh"
        );
        passed.fds.extend(chosen);
        forget_passed(passed);
        None
    };
    // Only the latest ledger can be the table: an older one may say less is held than is. So
    // a ledger whose generation cannot be read leaves none to trust.
    let ledgers: Vec<(usize, Option<u64>)> = passed
        .fds
        .iter()
        .enumerate()
        .filter(|(_, (name, _))| name.starts_with("ledger-"))
        .map(|(i, (_, fd))| (i, ledger::generation(fd)))
        .collect();
    if ledgers.iter().any(|(_, g)| g.is_none()) {
        return give_up("a ledger that cannot be read", passed, None);
    }
    let latest = ledgers.into_iter().filter_map(|(i, g)| Some((g?, i))).max();
    let Some((generation, at)) = latest else {
        return give_up("no ledger", passed, None);
    };
    let chosen = passed.fds.remove(at);
    let recovered = match chosen.1.try_clone().map(ledger::read) {
        Ok(Ok(Some(r))) => r,
        Ok(Ok(None)) => {
            let why = format!("ledger {generation} is abandoned or incomplete");
            return give_up(&why, passed, Some(chosen));
        }
        Ok(Err(e)) => return give_up(&e.to_string(), passed, Some(chosen)),
        Err(e) => return give_up(&e.to_string(), passed, Some(chosen)),
    };
    let mut handover = recovered.handover;
    if handover.node_id != node_id {
        let why = format!(
            "it is node {:08x}'s, this daemon is node {node_id:08x}",
            handover.node_id
        );
        return give_up(&why, passed, Some(chosen));
    }
    // Each segment is the descriptor of its name whose memfd is the one the ledger names.
    let mut adopted = Vec::new();
    for (i, (&size, &id)) in handover
        .segments
        .iter()
        .zip(&recovered.segment_ids)
        .enumerate()
    {
        let name = segment_name(i);
        let found = passed
            .fds
            .iter()
            .find(|(n, fd)| *n == name && id != 0 && segment_id(fd.as_fd()) == id);
        let adopt = found
            .ok_or_else(|| "its memory was not kept".to_string())
            .and_then(|(_, fd)| {
                let fd = fd.try_clone().map_err(|e| e.to_string())?;
                feedstore_shm::Segment::adopt(fd, size, handover.hugetlb).map_err(|e| e.to_string())
            });
        match adopt {
            Ok(segment) => adopted.push(segment),
            Err(e) => return give_up(&format!("segment {i}: {e}"), passed, Some(chosen)),
        }
    }
    let pidfds = find_processes(&mut handover, &recovered.started);
    let mut objects = match feedstore_core::objects::Objects::take_over(&handover, pidfds) {
        Ok(objects) => objects,
        Err(e) => return give_up(&e.to_string(), passed, Some(chosen)),
    };
    for (orphan, pid, process) in objects.orphans() {
        let started = recovered.started.get(&process.key).copied().unwrap_or(0);
        if pid > 0 && started != 0 {
            objects.set_started(orphan, started);
        }
    }
    tracing::info!(
        generation,
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
        read: Read {
            ledger: chosen,
            rest: passed,
        },
    })
}

/// Finds the processes a table read back names (`started`: when each started, by key): those
/// still running get their pidfds (in the table's order, for
/// [`feedstore_core::objects::Objects::take_over`]); what those that exited held is dropped;
/// the rest (another pid namespace's, unnamed, or a pid that cannot be told apart) stay held
/// for until a daemon starts afresh.
fn find_processes(
    h: &mut feedstore_proto::handover::Handover,
    started: &std::collections::HashMap<u64, u64>,
) -> Vec<OwnedFd> {
    use feedstore_proto::handover::UNNAMED_KEY;
    let same_pids =
        h.pid_namespace != 0 && h.pid_namespace == feedstore_core::objects::pid_namespace();
    let mut gone = std::collections::HashSet::new();
    let mut pidfds = Vec::new();
    for p in &mut h.processes {
        if !same_pids || p.key & UNNAMED_KEY != 0 {
            continue;
        }
        let since = started.get(&p.key).copied().unwrap_or(0);
        match crate::credentials::find(p.pid, p.key, since) {
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
/// keeping its own), in place of what it read its store back from, if anything. Whether it is
/// kept.
pub(crate) fn keep_store(shared: &crate::state::Shared, read: Option<Read>) -> bool {
    // The ledger read describes the store no more (this daemon changes it from now on): marked
    // so before anything else, so that if this daemon keeps none, the next starts afresh. The
    // rest passed goes (older ledgers, other memory kept under a segment's name, the segments,
    // which are kept again below: systemd cannot let go of one of two descriptors of a name).
    let replaces = read.map(|Read { ledger, rest }| {
        if let Err(e) = feedstore_core::objects::ledger::abandon(&ledger.1) {
            tracing::warn!(error = %e, name = ledger.0, "cannot mark the ledger read abandoned");
            forget(&ledger.0);
        }
        forget_passed(rest);
        ledger.0
    });
    let why_not = |e: &dyn std::fmt::Display| {
        tracing::warn!(
            error = %e,
            "--fd-store: cannot keep the store in the service manager's descriptor store (a \
             daemon started after this one is killed starts afresh)"
        );
        false
    };
    if std::env::var_os("NOTIFY_SOCKET").is_none() {
        return why_not(&"not run by systemd (no $NOTIFY_SOCKET)");
    }
    // (Room for every segment and two ledgers: a new one is kept before the old one goes.)
    let needed = shared.segments.len() + 2;
    if let Some(room) = std::env::var("FDSTORE")
        .ok()
        .and_then(|n| n.parse::<usize>().ok())
        && room < needed
    {
        return why_not(&format!(
            "the unit's FileDescriptorStoreMax={room} has no room for {needed} descriptors (the \
             segments and two ledgers)"
        ));
    }
    for (i, segment) in shared.segments.iter().enumerate() {
        if let Err(e) = keep(&segment_name(i), segment.fd()) {
            return why_not(&e);
        }
    }
    let store = ServiceManager {
        segment_ids: shared.segments.iter().map(|s| segment_id(s.fd())).collect(),
    };
    match shared.with_objects(|o| o.keep_ledger(Box::new(store))) {
        Ok(()) => {
            if let Some(old) = replaces {
                forget(&old);
            }
            true
        }
        Err(e) => why_not(&e),
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
