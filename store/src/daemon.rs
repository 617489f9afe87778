//! Starting, running and stopping a daemon.

use std::os::fd::AsRawFd;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use feedstore_shm::{Segment, SegmentOptions, ShmError};
use tokio::net::UnixListener;

use crate::cluster::Cluster;
use crate::config::{DaemonConfig, format_bytes, meminfo_bytes};
use crate::objects::Objects;
use crate::server::serve_connection;
use crate::state::{AccessPolicy, ServeConfig, Shared, Started};

/// Why the daemon could not start. Each prints as one line a user can act on.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StartError {
    /// A live daemon already answers on the socket.
    #[error(
        "socket {path} is in use by another feedstored (pid {pid}); stop it, pass --socket, or \
         replace it keeping its store: feedstored --takeover"
    )]
    SocketInUse {
        /// The socket path.
        path: PathBuf,
        /// The other daemon's pid.
        pid: i32,
    },
    /// Binding or configuring the socket failed.
    #[error("cannot listen on {path}")]
    Socket {
        /// The socket path.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The requested capacity exceeds the memory the node can give.
    #[error(
        "capacity {} exceeds the {} of memory available on this node; lower --capacity",
        format_bytes(*capacity_bytes),
        format_bytes(*available_bytes)
    )]
    CapacityTooLarge {
        /// Requested capacity.
        capacity_bytes: u64,
        /// `MemAvailable`.
        available_bytes: u64,
    },
    /// `--socket-group` names no group.
    #[error("unknown group {name:?} for --socket-group")]
    UnknownGroup {
        /// The name given.
        name: String,
    },
    /// The socket's directory could be replaced or written by another user.
    #[error(
        "refusing socket directory {path}: {reason}; remove it or pass --socket in a directory \
         only this user can write"
    )]
    UnsafeSocketDir {
        /// The directory.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// Creating the shared memory failed.
    #[error(transparent)]
    Shm(#[from] ShmError),
    /// The cluster secret file is unusable, or the cluster settings are unsafe.
    #[error(transparent)]
    Secret(#[from] crate::cluster::auth::SecretError),
    /// The metrics port could not be bound.
    #[error("cannot serve metrics on {addr}")]
    MetricsListen {
        /// The address.
        addr: std::net::SocketAddr,
        /// Why.
        source: std::io::Error,
    },
    /// The peer port could not be bound.
    #[error("cannot listen for peers on {addr}")]
    PeerListen {
        /// The address.
        addr: std::net::SocketAddr,
        /// Why.
        source: std::io::Error,
    },
    /// The async runtime could not start.
    #[error("cannot start the runtime")]
    Runtime(#[source] std::io::Error),
    /// `--takeover` could not take the running daemon over (it serves on, untouched).
    #[error("cannot take over: {0}")]
    Takeover(String),
}

/// A daemon whose segments exist and whose socket is bound, ready to serve.
pub struct Daemon {
    shared: Arc<Shared>,
    /// This node's cluster, when it has one (`--listen`, `--peers`, `--peers-file`).
    cluster: Option<Arc<Cluster>>,
    listener: std::os::unix::net::UnixListener,
    /// Where other daemons connect (`--listen`).
    peer_listener: Option<std::net::TcpListener>,
    /// Where Prometheus scrapes (`--metrics-addr`).
    metrics_listener: Option<std::net::TcpListener>,
    socket: PathBuf,
    worker_threads: usize,
    /// The daemon this one took over (`--takeover`), and its pid: the two-step commit with it
    /// comes before this one serves anything.
    predecessor: Option<(std::os::unix::net::UnixStream, i32)>,
    /// Called once the daemon serves (its predecessor, if any, gone): `feedstored` tells the
    /// service manager and a waiting `--detach` parent.
    on_serving: Option<Box<dyn FnOnce() + Send>>,
    /// Keep the segments and a ledger of the table in the service manager's descriptor store
    /// (`--fd-store`), once serving; `Some(read)`: in place of what this daemon read its
    /// store back from.
    fd_store: Option<Option<crate::fdstore::Read>>,
}

impl Daemon {
    /// Creates the segments and binds the socket. Nothing is served until [`Daemon::serve`] or
    /// [`Daemon::spawn`].
    pub fn bind(config: &DaemonConfig) -> Result<Daemon, StartError> {
        // A stale socket: the daemon before this one went away without removing it (a crash,
        // a kill -9). Its memory may still be held by its clients, which let go of it as they
        // reconnect to this one: refusing to start for want of that memory would keep them
        // waiting for a daemon that never comes. So this one starts, and pre-faults once the
        // memory is back.
        // Under systemd with --fd-store, the memory and the table of a daemon before this one
        // that was killed, if the service manager kept them: served again.
        let passed = crate::fdstore::Passed::take();
        let restored = if config.fd_store {
            crate::fdstore::restore(config.node_id, passed)
        } else {
            if !passed.fds.is_empty() {
                tracing::info!(
                    descriptors = passed.fds.len(),
                    "the service manager kept descriptors for this daemon, which runs without \
                     --fd-store: it lets go of them"
                );
            }
            crate::fdstore::forget_passed(passed);
            None
        };
        let short = match check_capacity(config) {
            _ if restored.is_some() => None,
            Ok(()) => None,
            Err(StartError::CapacityTooLarge {
                capacity_bytes,
                available_bytes,
            }) if stale_socket(&config.socket) => {
                tracing::warn!(
                    capacity = %format_bytes(capacity_bytes),
                    available = %format_bytes(available_bytes),
                    "more capacity than MemAvailable, and a stale socket: the daemon before this \
                     one still holds memory through its clients, which let go of it as they \
                     reconnect; starting anyway, pre-faulting once the memory is available"
                );
                Some(capacity_bytes)
            }
            Err(e) => return Err(e),
        };
        let gid = socket_gid(config)?;
        // Everything about the socket that can fail is checked before seconds go into shared
        // memory: its length, its directory, another daemon on it.
        let daemon_uid = nix::unistd::geteuid().as_raw();
        let others = config
            .allow_uids
            .iter()
            .chain(&config.allow_reader_uids)
            .any(|&u| u != daemon_uid && u != 0);
        let access = if others {
            SocketAccess::AllowedUids
        } else if let Some(gid) = gid {
            SocketAccess::Group(gid)
        } else {
            SocketAccess::Owner
        };
        let manage_dir = config.socket == feedstore_proto::own_socket_path();
        prepare_socket(&config.socket, access, manage_dir)?;
        let secret = load_secret(config)?;
        let peer_listener = config
            .cluster
            .listen
            .map(|addr| {
                tcp_listener(addr).map_err(|source| StartError::PeerListen { addr, source })
            })
            .transpose()?;
        let metrics_listener = config
            .metrics_addr
            .map(|addr| {
                tcp_listener(addr).map_err(|source| StartError::MetricsListen { addr, source })
            })
            .transpose()?;
        let (segments, objects, restored_from) = match restored {
            Some(r) => (r.segments, Some(r.objects), Some(r.read)),
            None => (create_segments(config)?, None, None),
        };
        let started = if objects.is_some() {
            Started::Restored
        } else {
            Started::Fresh
        };
        let (shared, cluster) =
            shared_state(config, segments, objects, started, secret, daemon_uid, gid)?;
        // Bound last, when everything is mapped: a client that finds the socket is answered
        // at once. (The pre-fault of shmem, about 0.7 s per GiB, runs after, while the daemon
        // serves: its clients, waiting to reconnect after a restart, are not kept waiting.)
        let listener = bind_socket(&config.socket, access)?;
        let shared = Arc::new(shared);
        spawn_prefault(config, &shared, short)?;
        tracing::info!(
            socket = %config.socket.display(),
            node = %format!("{:08x}", config.node_id),
            epoch = %format!("{:08x}", shared.epoch()),
            "listening"
        );
        if let Some(l) = &peer_listener {
            tracing::info!(
                listen = %l.local_addr().map_or_else(|e| e.to_string(), |a| a.to_string()),
                authenticated = config.cluster.secret_file.is_some(),
                "listening for peers"
            );
        }
        if let Some(l) = &metrics_listener {
            tracing::info!(
                metrics = %l.local_addr().map_or_else(|e| e.to_string(), |a| format!("http://{a}/metrics")),
                "serving metrics"
            );
        }
        Ok(Daemon {
            shared,
            cluster,
            listener,
            peer_listener,
            metrics_listener,
            socket: config.socket.clone(),
            worker_threads: config.worker_threads,
            predecessor: None,
            on_serving: None,
            fd_store: config.fd_store.then_some(restored_from),
        })
    }

    /// Takes over from the daemon serving on `config.socket` (`--takeover`): its segments, its
    /// object table and its listeners, received over its socket (`crate::handoff`). The
    /// memory and the epoch are the predecessor's, so `--capacity` and `--segment-size` are
    /// whatever it had; the node id must be the same. Nothing is served until
    /// [`Daemon::serve`], which tells the predecessor to exit.
    pub fn take_over(config: &DaemonConfig) -> Result<Daemon, StartError> {
        // (Before the hand-over's pidfds arrive: one for each client process the daemon holds
        // something for, possibly more than a default soft limit of 1024.)
        raise_open_file_limit();
        let received = crate::handoff::receive(&config.socket).map_err(StartError::Takeover)?;
        let handed = &received.handover;
        // Everything the predecessor cannot help with is checked before it is told to go.
        if handed.node_id != config.node_id {
            return Err(StartError::Takeover(format!(
                "the running daemon is node {:08x} and this one would be node {:08x}: pass \
                 --node-id {} (its id in decimal)",
                handed.node_id, config.node_id, handed.node_id
            )));
        }
        let capacity: u64 = handed.segments.iter().sum();
        if capacity != config.capacity_bytes {
            tracing::info!(
                running = %format_bytes(capacity),
                configured = %format_bytes(config.capacity_bytes),
                "the memory is the running daemon's, taken over as it is (its capacity, segment \
                 size and huge pages): another capacity takes a restart, not a takeover"
            );
        }
        for (what, handed, flag, kept) in [
            (
                "peer",
                received.peers.is_some(),
                "--listen",
                config.cluster.listen.is_some(),
            ),
            (
                "metrics",
                received.metrics.is_some(),
                "--metrics-addr",
                config.metrics_addr.is_some(),
            ),
        ] {
            if handed && !kept {
                tracing::warn!(
                    "the running daemon served a {what} port and this one is given no {flag}: \
                     that port closes (pass the same {flag} to keep it)"
                );
            }
        }
        let mut objects = Objects::take_over(handed, received.pidfds)
            .map_err(|e| StartError::Takeover(e.to_string()))?;
        // When each process held for started, for a ledger (`--fd-store`) to name it by after a
        // crash: read while its pidfd says it runs, so its pid is still its own.
        for (orphan, pid, process) in objects.orphans() {
            // (Read before the pidfd says it runs: the pid was its own when read.)
            let started = crate::credentials::start_time(pid);
            if pid > 0 && process.pidfd.is_some() && !crate::credentials::exited(&process, pid) {
                objects.set_started(orphan, started);
            }
        }
        let segments = received
            .segments
            .into_iter()
            .zip(&handed.segments)
            .map(|(fd, &size)| Segment::adopt(fd, size, handed.hugetlb))
            .collect::<Result<Vec<_>, _>>()?;
        let daemon_uid = nix::unistd::geteuid().as_raw();
        let gid = socket_gid(config)?;
        let secret = load_secret(config)?;
        let peer_listener = match (received.peers, config.cluster.listen) {
            (Some(l), Some(_)) => Some(l),
            (_, Some(addr)) => {
                Some(tcp_listener(addr).map_err(|source| StartError::PeerListen { addr, source })?)
            }
            (_, None) => None,
        };
        let metrics_listener = match (received.metrics, config.metrics_addr) {
            (Some(l), Some(_)) => Some(l),
            (_, Some(addr)) => Some(
                tcp_listener(addr).map_err(|source| StartError::MetricsListen { addr, source })?,
            ),
            (_, None) => None,
        };
        let objects_handed = handed.objects.len();
        let (shared, cluster) = shared_state(
            config,
            segments,
            Some(objects),
            Started::TakenOver,
            secret,
            daemon_uid,
            gid,
        )?;
        tracing::info!(
            socket = %config.socket.display(),
            node = %format!("{:08x}", config.node_id),
            epoch = %format!("{:08x}", shared.epoch()),
            predecessor_pid = handed.pid,
            objects = objects_handed,
            "took over the running daemon's memory, objects and sockets"
        );
        // (What the predecessor had not pre-faulted yet; what it had is skipped at once.)
        let shared = Arc::new(shared);
        spawn_prefault(config, &shared, None)?;
        Ok(Daemon {
            shared,
            cluster,
            listener: received.clients,
            peer_listener,
            metrics_listener,
            socket: config.socket.clone(),
            worker_threads: config.worker_threads,
            predecessor: Some((received.daemon, handed.pid as i32)),
            on_serving: None,
            fd_store: config.fd_store.then_some(None),
        })
    }

    /// Calls `f` once the daemon serves (after the daemon it takes over has stopped).
    pub fn on_serving(mut self, f: impl FnOnce() + Send + 'static) -> Daemon {
        self.on_serving = Some(Box::new(f));
        self
    }

    /// The socket clients connect to.
    pub fn socket_path(&self) -> &Path {
        &self.socket
    }

    /// The state the daemon serves, for an embedding that reads it in-process (its
    /// statistics, say) rather than over the socket.
    pub fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    /// Serves on the calling thread until `shutdown` completes, then removes the socket file.
    pub fn serve(self, shutdown: impl Future<Output = ()>) -> Result<(), StartError> {
        let runtime = if self.worker_threads <= 1 {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
        } else {
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(self.worker_threads)
                .enable_all()
                .build()
        }
        .map_err(StartError::Runtime)?;
        let Daemon {
            shared,
            cluster,
            listener,
            peer_listener,
            metrics_listener,
            socket,
            predecessor,
            on_serving,
            fd_store,
            ..
        } = self;
        let kept = shared.clone();
        shared.handoff.serving_on(crate::handoff::Listeners {
            clients: listener.as_raw_fd(),
            peers: peer_listener.as_ref().map(AsRawFd::as_raw_fd),
            metrics: metrics_listener.as_ref().map(AsRawFd::as_raw_fd),
        });
        runtime.block_on(async move {
            listener
                .set_nonblocking(true)
                .map_err(|source| StartError::Socket {
                    path: socket.clone(),
                    source,
                })?;
            let listener =
                UnixListener::from_std(listener).map_err(|source| StartError::Socket {
                    path: socket.clone(),
                    source,
                })?;
            tokio::pin!(shutdown);
            if let Some((predecessor, pid)) = predecessor {
                // Nothing is served (no task started, nothing accepted) until the daemon
                // taken over has stopped: two daemons never serve the same memory.
                crate::handoff::commit(predecessor, pid as u32).map_err(StartError::Takeover)?;
                tracing::info!(
                    predecessor_pid = pid,
                    "the daemon taken over stopped: serving in its place"
                );
            }
            let kept =
                fd_store.is_some_and(|replaces| crate::fdstore::keep_store(&shared, replaces));
            if let Some(serving) = on_serving {
                serving();
            }
            let sweeper = {
                let shared = shared.clone();
                tokio::spawn(async move {
                    let mut tick = tokio::time::interval(shared.expiry_interval());
                    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                    loop {
                        tick.tick().await;
                        // (Parked while the daemon is handed over, like every request.)
                        let _busy = shared.handoff.enter().await;
                        shared.expire_streams();
                        shared.drop_what_gone_processes_held();
                    }
                })
            };
            let mut cluster_tasks = match &cluster {
                Some(cluster) => cluster.clone().start(&shared, peer_listener),
                None => Vec::new(),
            };
            if let Some(listener) = metrics_listener {
                match tokio::net::TcpListener::from_std(listener) {
                    Ok(listener) => cluster_tasks.push(tokio::spawn(crate::metrics::serve(
                        listener,
                        shared.clone(),
                        cluster.clone(),
                    ))),
                    Err(e) => tracing::error!(error = %e, "cannot serve the metrics listener"),
                }
            }
            let mut thawed = shared.handoff.thawed_watch();
            let mut done = shared.handoff.done_watch();
            let mut handed_over = false;
            // A stop asked for while handing over waits for the hand-over's end: the daemon
            // either handed over (and stops) or serves on (and then stops).
            let mut stop_asked = false;
            loop {
                tokio::select! {
                    // (None accepted while handing over: they wait in the backlog, which
                    // the successor accepts from.)
                    _ = thawed.changed() => if stop_asked && !shared.handoff.is_frozen() {
                        break;
                    },
                    _ = done.changed() => if *done.borrow() {
                        handed_over = true;
                        break;
                    },
                    accepted = listener.accept(), if !shared.handoff.is_frozen() => match accepted {
                        Ok((stream, _)) => {
                            tokio::spawn(serve_connection(shared.clone(), cluster.clone(), stream));
                        }
                        Err(e) => {
                            // Out of descriptors despite the limits (something else holds
                            // them): the client waits in the backlog and its hello times out
                            // with a clear error; back off rather than spin.
                            tracing::warn!(error = %e, "accept failed");
                            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                        }
                    },
                    _ = &mut shutdown, if !stop_asked => {
                        if !shared.handoff.is_frozen() {
                            break;
                        }
                        stop_asked = true;
                    },
                }
            }
            sweeper.abort();
            for task in cluster_tasks {
                task.abort();
            }
            let stats = shared.with_objects(|o| o.stats());
            if handed_over {
                tracing::info!(
                    objects = stats.objects_sealed,
                    clients = stats.clients,
                    "handed over: this daemon stops serving (the socket and the memory are the \
                     successor's)"
                );
            } else {
                let _ = std::fs::remove_file(&socket);
                if kept {
                    crate::fdstore::let_go(&shared);
                }
                tracing::info!(
                    objects = stats.objects_sealed,
                    clients = stats.clients,
                    used = %format_bytes(stats.used_bytes),
                    "shutting down; socket removed"
                );
            }
            Ok::<(), StartError>(())
        })?;
        // Dropping the runtime cancels every connection task (clients see end of stream) and
        // joins its worker threads; only then may a successor serve the same memory.
        drop(runtime);
        kept.handoff.release_successor();
        Ok(())
    }

    /// Serves on a background thread, for embedding (the demo, tests). The daemon stops when the
    /// returned handle is stopped or dropped.
    pub fn spawn(self) -> DaemonHandle {
        let socket = self.socket.clone();
        let shared = self.shared.clone();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("feedstored".into())
            .spawn(move || {
                if let Err(e) = self.serve(async {
                    let _ = stopped.await;
                }) {
                    tracing::error!(error = %e, "embedded daemon failed");
                }
            })
            .expect("spawning the daemon thread");
        DaemonHandle {
            stop: Some(stop),
            thread: Some(thread),
            socket,
            shared,
        }
    }
}

/// An embedded daemon running on a background thread.
pub struct DaemonHandle {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
    socket: PathBuf,
    shared: Arc<Shared>,
}

impl DaemonHandle {
    /// The socket clients connect to.
    pub fn socket_path(&self) -> &Path {
        &self.socket
    }

    /// The state the daemon serves, read in-process.
    pub fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    /// Stops serving and waits for the thread.
    pub fn stop(mut self) {
        self.stop_now();
    }

    fn stop_now(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for DaemonHandle {
    fn drop(&mut self) {
        self.stop_now();
    }
}

/// Fails if a live daemon answers on `path`; removes a stale socket left by a crash, and
/// refuses anything else at the path (it is not the daemon's to delete).
fn check_socket_free(path: &Path) -> Result<(), StartError> {
    use std::os::unix::fs::FileTypeExt;
    let sock_err = |source| StartError::Socket {
        path: path.to_owned(),
        source,
    };
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if !meta.file_type().is_socket() {
            return Err(sock_err(std::io::Error::new(
                std::io::ErrorKind::AlreadyExists,
                "something that is not a socket is there; the daemon deletes only a stale socket",
            )));
        }
        match std::os::unix::net::UnixStream::connect(path) {
            Ok(live) => {
                let pid =
                    nix::sys::socket::getsockopt(&live, nix::sys::socket::sockopt::PeerCredentials)
                        .map(|c| c.pid())
                        .unwrap_or(0);
                return Err(StartError::SocketInUse {
                    path: path.to_owned(),
                    pid,
                });
            }
            Err(_) => {
                tracing::info!(socket = %path.display(), "removing stale socket file from a previous run");
                std::fs::remove_file(path).map_err(sock_err)?;
            }
        }
    }
    Ok(())
}

/// Who the socket (and a directory the daemon makes for it) lets in; every peer is checked
/// again by its credentials at hello.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SocketAccess {
    /// The daemon's uid (and root): socket 0600, directory 0700.
    Owner,
    /// Also this group: socket and directory group-owned, 0660 and 0750.
    Group(u32),
    /// Also other uids on the allow-list: socket 0666, directory 0711 (search only).
    AllowedUids,
}

impl SocketAccess {
    fn modes(self) -> (u32, u32) {
        match self {
            SocketAccess::Owner => (0o600, 0o700),
            SocketAccess::Group(_) => (0o660, 0o750),
            SocketAccess::AllowedUids => (0o666, 0o711),
        }
    }
}

impl SocketAccess {
    fn group(self) -> Option<nix::unistd::Gid> {
        match self {
            SocketAccess::Group(gid) => Some(nix::unistd::Gid::from_raw(gid)),
            _ => None,
        }
    }
}

/// Checks the socket path can be bound (its length, its directory, no daemon on it) and makes
/// its directory if need be. `manage_dir`: the directory is the daemon's own default one, whose
/// mode it sets even if it exists (from a run with other access).
fn prepare_socket(path: &Path, access: SocketAccess, manage_dir: bool) -> Result<(), StartError> {
    // sun_path holds 108 bytes, its terminating NUL included.
    if path.as_os_str().len() >= 108 {
        return Err(StartError::Socket {
            path: path.to_owned(),
            source: std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "a socket path must be shorter than 108 bytes",
            ),
        });
    }
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        prepare_socket_dir(dir, access.modes().1, access.group(), manage_dir)?;
        warn_if_unreachable(dir, access);
    }
    check_socket_free(path)
}

/// Refuses a capacity the node cannot hold: over `MemAvailable`, unless the store will live
/// on reserved huge pages (not in `MemAvailable`), which are checked against the free ones.
fn check_capacity(config: &DaemonConfig) -> Result<(), StartError> {
    let huge_free = meminfo_bytes("Hugepagesize").and_then(|size| {
        let free = meminfo_bytes("HugePages_Free")? / 1024;
        Some(free * size)
    });
    let on_huge_pages = config.huge_pages != feedstore_shm::HugePages::Off
        && huge_free.is_some_and(|free| free >= config.capacity_bytes);
    if let Some(available) = meminfo_bytes("MemAvailable")
        && config.capacity_bytes > available
        && !on_huge_pages
    {
        return Err(StartError::CapacityTooLarge {
            capacity_bytes: config.capacity_bytes,
            available_bytes: available,
        });
    }
    Ok(())
}

/// The group `--socket-group` names, if any.
fn socket_gid(config: &DaemonConfig) -> Result<Option<u32>, StartError> {
    let Some(name) = &config.socket_group else {
        return Ok(None);
    };
    let group = nix::unistd::Group::from_name(name)
        .ok()
        .flatten()
        .ok_or_else(|| StartError::UnknownGroup { name: name.clone() })?;
    Ok(Some(group.gid.as_raw()))
}

/// The cluster secret (`--cluster-secret-file`), if any.
fn load_secret(config: &DaemonConfig) -> Result<Option<crate::cluster::auth::Secret>, StartError> {
    Ok(config
        .cluster
        .secret_file
        .as_deref()
        .map(crate::cluster::auth::Secret::load)
        .transpose()?)
}

/// Pre-faults the shared memory on a thread of its own (`--prefault`, [`Shared::prefault`])
/// while the daemon serves; with `wait_for`, only
/// once `MemAvailable` reaches that many bytes (the memory a crashed predecessor's clients
/// still held), for at most [`PREFAULT_WAIT`]: after that the pages are allocated as they are
/// first written.
fn spawn_prefault(
    config: &DaemonConfig,
    shared: &Arc<Shared>,
    wait_for: Option<u64>,
) -> Result<(), StartError> {
    if config.prefault {
        let shared = shared.clone();
        std::thread::Builder::new()
            .name("feedstore-prefault".into())
            .spawn(move || {
                if let Some(bytes) = wait_for {
                    let started = Instant::now();
                    while meminfo_bytes("MemAvailable").is_some_and(|a| a < bytes) {
                        if started.elapsed() >= PREFAULT_WAIT {
                            tracing::warn!(
                                waited_s = PREFAULT_WAIT.as_secs(),
                                "memory did not become available: not pre-faulting (pages are \
                                 allocated as they are first written, and writes may fail if \
                                 the node has no memory for them)"
                            );
                            return;
                        }
                        std::thread::sleep(std::time::Duration::from_millis(100));
                    }
                    tracing::info!(
                        waited_ms = started.elapsed().as_millis() as u64,
                        "memory available again: pre-faulting"
                    );
                }
                shared.prefault()
            })
            .map_err(StartError::Runtime)?;
    }
    Ok(())
}

/// How long a daemon started short of memory waits for it before it gives up pre-faulting.
const PREFAULT_WAIT: std::time::Duration = std::time::Duration::from_secs(120);

/// Whether `path` is a socket nobody answers on (left by a daemon that went away).
fn stale_socket(path: &Path) -> bool {
    use std::os::unix::fs::FileTypeExt;
    std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_socket()) && !listened_on(path)
}

/// Whether something listens on `socket`: a daemon serving, or one whose backlog is full (a
/// connect that would wait). Only no such file or a refusal say no; the connect never blocks.
pub(crate) fn listened_on(socket: &Path) -> bool {
    use nix::sys::socket::{AddressFamily, SockFlag, SockType, UnixAddr, connect, socket as open};
    let Ok(addr) = UnixAddr::new(socket) else {
        return false;
    };
    let Ok(fd) = open(
        AddressFamily::Unix,
        SockType::Stream,
        SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
        None,
    ) else {
        return true;
    };
    !matches!(
        connect(fd.as_raw_fd(), &addr),
        Err(nix::errno::Errno::ENOENT | nix::errno::Errno::ECONNREFUSED)
    )
}

/// A non-blocking TCP listener on `addr` (peers, metrics).
fn tcp_listener(addr: std::net::SocketAddr) -> std::io::Result<std::net::TcpListener> {
    let listener = std::net::TcpListener::bind(addr)?;
    listener.set_nonblocking(true)?;
    Ok(listener)
}

/// The store's shared memory, one segment per `--segment-size`. With `--prefault`, huge pages
/// are allocated here (too few reserved fails the start, not a write later); other memory is
/// pre-faulted once the daemon serves ([`Shared::prefault`]), so that a daemon started again
/// in place of one that went away answers its clients at once.
fn create_segments(config: &DaemonConfig) -> Result<Vec<Segment>, StartError> {
    let started = Instant::now();
    let mut segments = Vec::new();
    for (i, size) in config.segment_sizes().into_iter().enumerate() {
        let segment = Segment::create(&SegmentOptions {
            name: format!("segment-{i}"),
            size_bytes: size,
            huge_pages: config.huge_pages,
            prefault: false,
        })?;
        if config.prefault && segment.is_hugetlb() {
            segment.prefault(8)?;
        }
        segments.push(segment);
    }
    let hugetlb = segments.iter().all(Segment::is_hugetlb);
    tracing::info!(
        capacity = %format_bytes(segments.iter().map(Segment::size_bytes).sum()),
        segments = segments.len(),
        huge_pages = hugetlb,
        prefault = config.prefault,
        elapsed_ms = started.elapsed().as_millis() as u64,
        "shared memory ready"
    );
    if !hugetlb {
        log_thp_state();
    }
    Ok(segments)
}

/// What every connection shares: the object table over `segments`, who may connect, the
/// limits; and the cluster (its pull engine, its peers) when there is one.
fn shared_state(
    config: &DaemonConfig,
    segments: Vec<Segment>,
    handed: Option<Objects>,
    started: Started,
    secret: Option<crate::cluster::auth::Secret>,
    daemon_uid: u32,
    gid: Option<u32>,
) -> Result<(Shared, Option<Arc<Cluster>>), StartError> {
    let hugetlb = segments.iter().all(Segment::is_hugetlb);
    let sizes: Vec<u64> = segments.iter().map(Segment::size_bytes).collect();
    let mut uids: std::collections::HashSet<u32> = config.allow_uids.iter().copied().collect();
    uids.insert(daemon_uid);
    let reader_uids = config.allow_reader_uids.iter().copied().collect();
    let limits = fit_connections_to_descriptors(config.limits.clone());
    // A daemon taken over keeps its epoch: its handles stay valid.
    let mut objects = match handed {
        Some(objects) => objects,
        None => Objects::new(config.node_id, random_epoch(), &sizes, hugetlb),
    };
    let epoch = objects.epoch();
    let cluster = config.cluster.enabled().then(|| {
        let engine_conn = objects.connect(crate::objects::ClientInfo {
            role: feedstore_proto::Role::Writer,
            uid: daemon_uid,
            pid: std::process::id() as i32,
            process: crate::objects::Process::default(),
            name: "pull engine".into(),
            internal: true,
            capped: false,
        });
        Arc::new(crate::cluster::Cluster::new(
            config.cluster.clone(),
            config.node_id,
            epoch,
            secret,
            engine_conn,
        ))
    });
    let shared = Shared::new(
        objects,
        segments,
        ServeConfig {
            node_id: config.node_id,
            epoch,
            policy: AccessPolicy {
                uids,
                reader_uids,
                gid,
            },
            max_frame_bytes: config.max_frame_bytes,
            max_create_wait_ms: config.max_create_wait_ms,
            limits,
            daemon_uid,
            cluster: cluster.is_some(),
            started,
        },
    )?;
    Ok((shared, cluster))
}

/// Binds the socket at `path` (prepared by [`prepare_socket`]) with the mode `access` needs.
fn bind_socket(
    path: &Path,
    access: SocketAccess,
) -> Result<std::os::unix::net::UnixListener, StartError> {
    let sock_err = |source| StartError::Socket {
        path: path.to_owned(),
        source,
    };
    let (socket_mode, _) = access.modes();
    let group = access.group();
    // A stale socket may have appeared since the checks (another daemon that died meanwhile).
    check_socket_free(path)?;
    let listener = std::os::unix::net::UnixListener::bind(path).map_err(sock_err)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(socket_mode))
        .map_err(sock_err)?;
    if group.is_some() {
        nix::unistd::chown(path, None, group).map_err(|e| sock_err(e.into()))?;
    }
    Ok(listener)
}

/// Makes the socket's directory if it is missing (with `mode`, group-owned by `group`), and
/// refuses one another user could write: whoever can write it can replace the socket with
/// their own. An existing directory must belong to this user or root, and be writable by
/// nobody else unless it is sticky (like `/tmp`, where nobody can remove another's socket).
fn prepare_socket_dir(
    dir: &Path,
    mode: u32,
    group: Option<nix::unistd::Gid>,
    manage: bool,
) -> Result<(), StartError> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt};
    let unsafe_dir = |reason: String| StartError::UnsafeSocketDir {
        path: dir.to_owned(),
        reason,
    };
    let sock_err = |source| StartError::Socket {
        path: dir.to_owned(),
        source,
    };
    match std::fs::symlink_metadata(dir) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
                std::fs::create_dir_all(parent).map_err(sock_err)?;
            }
            std::fs::DirBuilder::new()
                .mode(mode)
                .create(dir)
                .map_err(sock_err)?;
            // The umask may have taken bits away; set exactly what is meant.
            std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode))
                .map_err(sock_err)?;
            if group.is_some() {
                nix::unistd::chown(dir, None, group).map_err(|e| sock_err(e.into()))?;
            }
            Ok(())
        }
        Err(e) => Err(sock_err(e)),
        Ok(meta) => {
            let me = nix::unistd::geteuid().as_raw();
            if !meta.is_dir() {
                return Err(unsafe_dir("not a directory (a symbolic link?)".into()));
            }
            if meta.uid() != me && meta.uid() != 0 {
                return Err(unsafe_dir(format!("it belongs to uid {}", meta.uid())));
            }
            let sticky = meta.mode() & 0o1000 != 0;
            if meta.mode() & 0o022 != 0 && !sticky {
                return Err(unsafe_dir(format!(
                    "other users can write it (mode {:o})",
                    meta.mode() & 0o7777
                )));
            }
            if manage && meta.uid() == me {
                std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode))
                    .map_err(sock_err)?;
                if group.is_some() {
                    nix::unistd::chown(dir, None, group).map_err(|e| sock_err(e.into()))?;
                }
            }
            Ok(())
        }
    }
}

/// Warns when the clients `access` admits cannot reach the socket: a directory on the way
/// that they cannot search (`$XDG_RUNTIME_DIR` is 0700).
fn warn_if_unreachable(dir: &Path, access: SocketAccess) {
    use std::os::unix::fs::MetadataExt;
    let needed = match access {
        SocketAccess::Owner => return,
        SocketAccess::Group(_) => 0o011,
        SocketAccess::AllowedUids => 0o001,
    };
    for ancestor in dir.ancestors() {
        if let Ok(meta) = std::fs::metadata(ancestor)
            && meta.mode() & needed == 0
        {
            tracing::warn!(
                directory = %ancestor.display(),
                mode = format!("{:o}", meta.mode() & 0o7777),
                "clients of other users cannot reach the socket through this directory; pass \
                 --socket in a directory they can search"
            );
            return;
        }
    }
}

/// Raises the soft open-file limit to the hard one; the soft limit in force after.
fn raise_open_file_limit() -> Option<u64> {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).ok()?;
    Some(
        if soft < hard && setrlimit(Resource::RLIMIT_NOFILE, hard, hard).is_ok() {
            hard
        } else {
            soft
        },
    )
}

/// Keeps connections (two descriptors each) and attached rings (one) under the descriptors this
/// process may open, raising the soft limit to the hard one first, so a client over a limit
/// gets a clear refusal rather than an accept or a ring that fails for want of a descriptor.
fn fit_connections_to_descriptors(mut limits: crate::config::Limits) -> crate::config::Limits {
    let Some(soft) = raise_open_file_limit() else {
        return limits;
    };
    // Room for segments, the listener, logs and the runtime; the rest is shared by connections
    // and rings, half each at most. A connection holds two: its socket and its client's pidfd.
    // (The pidfds of the processes held for since a takeover come on top: one for each process
    // that held something then and has not exited since.)
    let room = usize::try_from(soft.saturating_sub(512))
        .unwrap_or(usize::MAX)
        .max(32);
    if limits.max_connections > room / 4 {
        tracing::warn!(
            asked = limits.max_connections,
            using = room / 4,
            open_files = soft,
            "lowering --max-connections to fit the open-file limit"
        );
        limits.max_connections = room / 4;
        limits.max_connections_per_uid = limits.max_connections_per_uid.min(room / 4);
    }
    limits.max_rings = limits.max_rings.min(room / 2);
    limits
}

fn log_thp_state() {
    let active = feedstore_shm::shmem_thp_mode().unwrap_or("unknown");
    tracing::info!(
        shmem_thp = active,
        "segments use 4 KiB pages; reserve huge pages (/proc/sys/vm/nr_hugepages) for faster first writes"
    );
}

/// A non-zero random number, different for each daemon start, so handles from an earlier run are
/// recognised as stale.
fn random_epoch() -> u32 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos(),
    );
    h.write_u32(std::process::id());
    (h.finish() as u32).max(1)
}
