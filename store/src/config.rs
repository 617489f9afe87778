//! Daemon configuration: defaults, `feedstore.toml`, command-line flags, in that order of
//! increasing precedence.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use feedstore_core::streams::StreamLimits;
use feedstore_shm::HugePages;
use serde::Deserialize;

pub use feedstore_core::format_bytes;

/// Most segments a daemon may have: all their descriptors travel in one `SCM_RIGHTS` message,
/// which the kernel caps at 253.
pub const MAX_SEGMENTS: u64 = 250;

/// Everything the daemon needs to start, fully resolved.
#[derive(Debug, Clone)]
pub struct DaemonConfig {
    /// Unix socket path clients connect to.
    pub socket: PathBuf,
    /// Total shared memory owned by the daemon.
    pub capacity_bytes: u64,
    /// Size of each segment; the last one takes the remainder. The largest object is one segment.
    pub segment_bytes: u64,
    /// Huge page policy.
    pub huge_pages: HugePages,
    /// Allocate and zero every page (huge pages at start, shmem once the daemon serves) so
    /// producers write into warm memory.
    pub prefault: bool,
    /// Keep the segments and the object table in the service manager's file descriptor store
    /// (`--fd-store`), so that a daemon systemd starts again after a crash serves the same
    /// objects.
    pub fd_store: bool,
    /// This node's id in handles.
    pub node_id: u32,
    /// Group given access to the socket (mode 0660 instead of 0600).
    pub socket_group: Option<String>,
    /// Uids allowed besides the daemon's own and root, as readers and writers.
    pub allow_uids: Vec<u32>,
    /// Uids allowed as readers only.
    pub allow_reader_uids: Vec<u32>,
    /// Largest frame payload accepted from a client.
    pub max_frame_bytes: u32,
    /// Longest a create may wait for space, whatever the client asks.
    pub max_create_wait_ms: u32,
    /// Tokio worker threads; 1 runs everything on one thread (lowest latency).
    pub worker_threads: usize,
    /// What clients may hold and ask for.
    pub limits: Limits,
    /// Other nodes: who may pull from this one, and whom this one pulls from.
    pub cluster: ClusterConfig,
    /// Where Prometheus scrapes `/metrics` (`--metrics-addr`); none by default.
    pub metrics_addr: Option<std::net::SocketAddr>,
}

/// What one client, or all of them together, may make the daemon hold. Every resource a client
/// can create is bounded by one of these; a refusal is a clear error naming the setting, and is
/// counted in `limits_hit`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    /// Connections open at once.
    pub max_connections: usize,
    /// Connections open at once from one uid.
    pub max_connections_per_uid: usize,
    /// How long a new connection may take to say hello.
    pub hello_timeout: Duration,
    /// Requests a client may queue behind one that waits (for space, tasks or samples).
    pub max_queued_requests: usize,
    /// Leases one connection may hold.
    pub max_leases_per_connection: u64,
    /// Percent of the store a uid allowed only to read (`--allow-reader-uid`) may hold leased
    /// at once, over all its connections.
    pub reader_lease_percent: u64,
    /// Streams open at once.
    pub max_streams: usize,
    /// Shared memory for stream delivery rings, over all streams.
    pub max_ring_bytes: u64,
    /// A stream with no producer and no consumer for this long is closed.
    pub stream_idle_timeout: Duration,
    /// Rings attached at once (each holds a descriptor and a mapping in the daemon); not a
    /// flag: the daemon fits it, with the connections, under its open-file limit.
    pub max_rings: usize,
}

impl Default for Limits {
    fn default() -> Self {
        let streams = StreamLimits::default();
        Limits {
            max_connections: 1024,
            max_connections_per_uid: 256,
            hello_timeout: Duration::from_secs(5),
            max_queued_requests: 64,
            max_leases_per_connection: 1 << 20,
            reader_lease_percent: 25,
            max_streams: streams.max_streams,
            max_ring_bytes: streams.max_ring_bytes,
            stream_idle_timeout: streams.stream_idle_timeout,
            max_rings: streams.max_rings,
        }
    }
}

impl Limits {
    /// The part of the limits the core's streams keep.
    pub fn streams(&self) -> StreamLimits {
        StreamLimits {
            max_streams: self.max_streams,
            max_ring_bytes: self.max_ring_bytes,
            stream_idle_timeout: self.stream_idle_timeout,
            max_rings: self.max_rings,
        }
    }
}

/// The default capacity: 2 GiB, or a quarter of the node's memory if that is less.
pub fn default_capacity_bytes() -> u64 {
    let quarter = meminfo_bytes("MemTotal").map_or(u64::MAX, |t| t / 4);
    (2u64 << 30).min(quarter).max(64 << 20)
}

impl Default for DaemonConfig {
    fn default() -> Self {
        let capacity_bytes = default_capacity_bytes();
        DaemonConfig {
            socket: feedstore_proto::default_socket_path(),
            capacity_bytes,
            segment_bytes: capacity_bytes,
            huge_pages: HugePages::Auto,
            prefault: true,
            // (Only where systemd started this very process: its children inherit both.)
            fd_store: std::env::var("FDSTORE")
                .ok()
                .and_then(|n| n.parse::<u32>().ok())
                .is_some_and(|n| n > 0)
                && std::env::var("SYSTEMD_EXEC_PID")
                    .ok()
                    .and_then(|p| p.parse::<u32>().ok())
                    .is_some_and(|p| p == std::process::id()),
            node_id: default_node_id(),
            socket_group: None,
            allow_uids: Vec::new(),
            allow_reader_uids: Vec::new(),
            max_frame_bytes: feedstore_proto::frame::MAX_PAYLOAD_BYTES,
            max_create_wait_ms: 10 * 60 * 1000,
            worker_threads: 1,
            limits: Limits::default(),
            cluster: ClusterConfig::default(),
            metrics_addr: None,
        }
    }
}

/// Settings a user can give, as `feedstored` flags or as keys of a `feedstore.toml` file (the same
/// names, kebab-case). Every one is optional; what is not given keeps its default, and flags
/// override the file.
///
/// ```toml
/// socket = "/run/feedstore/feedstored.sock"
/// capacity = "8GiB"
/// huge-pages = "auto"
/// prefault = true
/// socket-group = "trainers"
/// allow-uids = [1001, 1002]
/// max-connections-per-uid = 64
/// ```
#[derive(Debug, Default, Deserialize, clap::Args)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct Settings {
    /// Unix socket to listen on [default: $FEEDSTORE_SOCKET, else /run/feedstore/feedstore.sock
    /// for root, else $XDG_RUNTIME_DIR/feedstore/feedstore.sock or
    /// /tmp/feedstore-<uid>/feedstore.sock]. The default directory gets mode 0700 (0750 with
    /// --socket-group, 0711 with --allow-uid or --allow-reader-uid); other users must be able to
    /// reach it ($XDG_RUNTIME_DIR is private: pass --socket to share the daemon).
    #[arg(long, value_name = "PATH")]
    pub socket: Option<PathBuf>,

    /// Total shared memory to own, e.g. 512MiB or 8GiB [default: 2GiB, or a quarter of RAM if
    /// less]. Must fit in available memory.
    #[arg(long, value_name = "SIZE")]
    pub capacity: Option<String>,

    /// Split the capacity into segments of this size (the largest object is one segment)
    /// [default: one segment].
    #[arg(long, value_name = "SIZE")]
    pub segment_size: Option<String>,

    /// Huge pages: `auto` uses them when enough are reserved, `on` refuses to start without
    /// them, `off` never uses them [default: auto].
    #[arg(long, value_name = "MODE")]
    pub huge_pages: Option<String>,

    /// Allocate and zero all shared memory (about 1 s per GiB on a small VM), so writers never
    /// pay for it: huge pages before the daemon answers, other memory on a thread of its own
    /// once it does [default: true].
    #[arg(long, value_name = "BOOL")]
    pub prefault: Option<bool>,

    /// Keep the shared memory and the object table in systemd's file descriptor store
    /// (`FDSTORE=1`; the unit needs FileDescriptorStoreMax= of at least the segments plus 2, and
    /// NotifyAccess=all), so that a daemon systemd starts again after a crash serves the same
    /// objects, views held across the crash included; outside systemd it only warns [default:
    /// true where systemd says the unit has such a store ($FDSTORE, systemd 254+)].
    #[arg(long, value_name = "BOOL", num_args = 0..=1, default_missing_value = "true")]
    pub fd_store: Option<bool>,

    /// This node's id in object handles, a decimal number up to 4294967295 (handles and logs
    /// show it in hex) [default: a hash of the host name].
    #[arg(long, value_name = "ID")]
    pub node_id: Option<u32>,

    /// Let members of this group connect, as primary or supplementary group (socket mode 0660,
    /// or 0666 with --allow-uid).
    #[arg(long, value_name = "GROUP")]
    pub socket_group: Option<String>,

    /// Also allow this uid to connect, as reader or writer (repeatable; `allow-uids = [...]`
    /// in the file). The daemon's own uid and root always may. The socket becomes mode 0666;
    /// every peer's uid is checked (SO_PEERCRED) before it is served.
    #[arg(long = "allow-uid", value_name = "UID")]
    pub allow_uids: Option<Vec<u32>>,

    /// Also allow this uid to connect as a reader only: it maps the store read-only and cannot
    /// write by any path, and holds at most --reader-lease-percent of the store leased
    /// (repeatable; `allow-reader-uids = [...]` in the file).
    #[arg(long = "allow-reader-uid", value_name = "UID")]
    pub allow_reader_uids: Option<Vec<u32>>,

    /// Largest frame payload accepted from a client, e.g. 1MiB, at least 64KiB [default: 1MiB].
    #[arg(long, value_name = "BYTES")]
    pub max_frame_bytes: Option<String>,

    /// Connections open at once [default: 1024].
    #[arg(long, value_name = "N")]
    pub max_connections: Option<usize>,

    /// Connections open at once from one uid [default: 256].
    #[arg(long, value_name = "N")]
    pub max_connections_per_uid: Option<usize>,

    /// Milliseconds a new connection may take to say hello before it is closed [default: 5000].
    #[arg(long, value_name = "MS")]
    pub hello_timeout_ms: Option<u64>,

    /// Requests a client may queue behind one that waits (for space, tasks or samples); more
    /// closes the connection [default: 64].
    #[arg(long, value_name = "N")]
    pub max_queued_requests: Option<usize>,

    /// Leases one connection may hold at once [default: 1048576].
    #[arg(long, value_name = "N")]
    pub max_leases_per_connection: Option<u64>,

    /// Percent of the store's capacity (a whole number, 1 to 100) a uid allowed only to read
    /// (--allow-reader-uid) may hold leased at once, over all its connections; its gets past
    /// that fail with LimitReached, so such a uid cannot pin the store against the writers (nor
    /// read an object larger than its share) [default: 25].
    #[arg(long, value_name = "PERCENT")]
    pub reader_lease_percent: Option<u64>,

    /// Streams open at once [default: 1024].
    #[arg(long, value_name = "N")]
    pub max_streams: Option<usize>,

    /// Shared memory for stream delivery rings, over all streams, e.g. 64MiB: 64 bytes per slot
    /// of prefetch depth per attached rank, in whole pages (4 KiB at least), counted until the
    /// consumer's connection closes [default: 64MiB].
    #[arg(long, value_name = "SIZE")]
    pub max_ring_bytes: Option<String>,

    /// Seconds a stream may go without any producer or consumer before it is closed and its
    /// samples go back to the store [default: 600].
    #[arg(long, value_name = "SECONDS")]
    pub stream_idle_secs: Option<u64>,

    /// Async worker threads; 1 serves everything on one thread, the lowest latency [default: 1].
    #[arg(long, value_name = "N")]
    pub worker_threads: Option<usize>,

    /// Serve Prometheus metrics at http://ADDR:PORT/metrics, e.g. 127.0.0.1:9464: the store's
    /// counters, each stream's, and each attached rank's wait-time ratio, samples and time to
    /// first sample as its trainer reports them [default: off]. Anyone who can reach the address
    /// reads stream names and counts: bind to loopback or a private network.
    #[arg(long, value_name = "ADDR:PORT")]
    pub metrics_addr: Option<String>,

    /// Accept other nodes' daemons (never clients) on this TCP address, e.g. 0.0.0.0:7070, so
    /// they can pull this node's objects. Needs --cluster-secret-file.
    #[arg(long, value_name = "ADDR:PORT", help_heading = "Cluster")]
    pub listen: Option<String>,

    /// Other nodes' daemons to pull from, as host:port, comma-separated or repeated: addresses,
    /// or a DNS name that resolves to every node (a Kubernetes headless service), resolved again
    /// every --peer-refresh-secs. This node's own address may be among them.
    #[arg(
        long,
        value_name = "HOST:PORT,...",
        value_delimiter = ',',
        help_heading = "Cluster"
    )]
    pub peers: Option<Vec<String>>,

    /// A file of peers, one host:port per line (# comments), read again at every refresh.
    #[arg(long, value_name = "FILE", help_heading = "Cluster")]
    pub peers_file: Option<PathBuf>,

    /// The secret every daemon of the cluster shares, required with --listen, --peers or
    /// --peers-file (16 to 4096 bytes, a trailing newline not counted; mode 0600 or 0400; e.g.
    /// `head -c 32 /dev/urandom | base64`): peers prove it to each other at every connection
    /// (HMAC-SHA256 challenge-response), and every message after that carries a tag under keys
    /// derived from it (GMAC): transfers are authenticated, not encrypted.
    #[arg(long, value_name = "FILE", help_heading = "Cluster")]
    pub cluster_secret_file: Option<PathBuf>,

    /// The longest a pull of another node's object may take, retries included; a get waiting
    /// for it then fails with a timeout [default: 30000].
    #[arg(long, value_name = "MS", help_heading = "Cluster")]
    pub pull_timeout_ms: Option<u64>,

    /// Connections to each peer at most; each carries one range at a time, so this many
    /// objects (or ranges of a large one) are in flight per peer [default: 4].
    #[arg(long, value_name = "N", help_heading = "Cluster")]
    pub peer_connections: Option<usize>,

    /// Seconds between resolving the peer list again [default: 10].
    #[arg(long, value_name = "SECONDS", help_heading = "Cluster")]
    pub peer_refresh_secs: Option<u64>,

    /// Pulls under way at once, over all clients; a get beyond is refused with LimitReached
    /// [default: 4096].
    #[arg(long, value_name = "N", help_heading = "Cluster")]
    pub max_pulls: Option<usize>,

    /// Connections other daemons may have open to this one; each pulling node keeps up to its
    /// --peer-connections open [default: 256].
    #[arg(long, value_name = "N", help_heading = "Cluster")]
    pub max_peer_connections: Option<usize>,
}

/// A configuration error, printed as one line by the binary.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The config file could not be read.
    #[error("cannot read config file {path}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The config file is not valid TOML for this schema.
    #[error("invalid config file {path}: {message}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// The parser's message.
        message: String,
    },
    /// A value is out of its domain.
    #[error("invalid {key}: {message}")]
    Value {
        /// The key or flag.
        key: &'static str,
        /// Why.
        message: String,
    },
}

impl Settings {
    /// Reads and parses a `feedstore.toml` file.
    pub fn load(path: &Path) -> Result<Settings, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        toml::from_str(&text).map_err(|e| ConfigError::Parse {
            path: path.to_owned(),
            message: e.message().to_owned(),
        })
    }

    /// Applies the settings that are given over `cfg`.
    pub fn apply(self, cfg: &mut DaemonConfig) -> Result<(), ConfigError> {
        let bytes =
            |key, v: &str| parse_bytes(v).map_err(|message| ConfigError::Value { key, message });
        if let Some(v) = self.socket {
            cfg.socket = v;
        }
        if let Some(v) = self.capacity {
            cfg.capacity_bytes = bytes("capacity", &v)?;
            cfg.segment_bytes = cfg.capacity_bytes;
        }
        if let Some(v) = self.segment_size {
            cfg.segment_bytes = bytes("segment-size", &v)?;
        }
        if let Some(v) = self.huge_pages {
            cfg.huge_pages = parse_huge_pages(&v)?;
        }
        cfg.prefault = self.prefault.unwrap_or(cfg.prefault);
        cfg.fd_store = self.fd_store.unwrap_or(cfg.fd_store);
        cfg.node_id = self.node_id.unwrap_or(cfg.node_id);
        cfg.socket_group = self.socket_group.or(cfg.socket_group.take());
        cfg.allow_uids = self
            .allow_uids
            .unwrap_or(std::mem::take(&mut cfg.allow_uids));
        cfg.allow_reader_uids = self
            .allow_reader_uids
            .unwrap_or(std::mem::take(&mut cfg.allow_reader_uids));
        if let Some(v) = self.max_frame_bytes {
            let max = bytes("max-frame-bytes", &v)?;
            cfg.max_frame_bytes = u32::try_from(max).map_err(|_| ConfigError::Value {
                key: "max-frame-bytes",
                message: format!("{v:?} is over 4GiB"),
            })?;
        }
        cfg.worker_threads = self.worker_threads.unwrap_or(cfg.worker_threads);
        let l = &mut cfg.limits;
        l.max_connections = self.max_connections.unwrap_or(l.max_connections);
        l.max_connections_per_uid = self
            .max_connections_per_uid
            .unwrap_or(l.max_connections_per_uid);
        if let Some(ms) = self.hello_timeout_ms {
            l.hello_timeout = Duration::from_millis(ms);
        }
        l.max_queued_requests = self.max_queued_requests.unwrap_or(l.max_queued_requests);
        l.max_leases_per_connection = self
            .max_leases_per_connection
            .unwrap_or(l.max_leases_per_connection);
        l.reader_lease_percent = self.reader_lease_percent.unwrap_or(l.reader_lease_percent);
        l.max_streams = self.max_streams.unwrap_or(l.max_streams);
        if let Some(v) = self.max_ring_bytes {
            l.max_ring_bytes = bytes("max-ring-bytes", &v)?;
        }
        if let Some(secs) = self.stream_idle_secs {
            l.stream_idle_timeout = Duration::from_secs(secs);
        }
        if let Some(v) = self.metrics_addr {
            cfg.metrics_addr = Some(v.parse().map_err(|_| ConfigError::Value {
                key: "metrics-addr",
                message: format!("{v:?} is not an ADDR:PORT such as 127.0.0.1:9464"),
            })?);
        }
        let c = &mut cfg.cluster;
        if let Some(v) = self.listen {
            c.listen = Some(v.parse().map_err(|_| ConfigError::Value {
                key: "listen",
                message: format!("{v:?} is not an ADDR:PORT such as 0.0.0.0:7070"),
            })?);
        }
        c.peers = self.peers.unwrap_or(std::mem::take(&mut c.peers));
        c.peers_file = self.peers_file.or(c.peers_file.take());
        c.secret_file = self.cluster_secret_file.or(c.secret_file.take());
        if let Some(ms) = self.pull_timeout_ms {
            c.pull_timeout = Duration::from_millis(ms);
        }
        c.connections_per_peer = self.peer_connections.unwrap_or(c.connections_per_peer);
        if let Some(secs) = self.peer_refresh_secs {
            c.refresh = Duration::from_secs(secs);
        }
        c.max_pulls = self.max_pulls.unwrap_or(c.max_pulls);
        c.max_peer_connections = self.max_peer_connections.unwrap_or(c.max_peer_connections);
        Ok(())
    }
}

impl DaemonConfig {
    /// Checks values that no parser can: sizes in range, segments that tile the capacity.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.capacity_bytes < (1 << 20) {
            return Err(ConfigError::Value {
                key: "capacity",
                message: "must be at least 1MiB".into(),
            });
        }
        if self.segment_bytes == 0 || self.segment_bytes > self.capacity_bytes {
            return Err(ConfigError::Value {
                key: "segment-size",
                message: format!(
                    "must be between 1 byte and the capacity ({})",
                    format_bytes(self.capacity_bytes)
                ),
            });
        }
        if self.capacity_bytes.div_ceil(self.segment_bytes) > MAX_SEGMENTS {
            return Err(ConfigError::Value {
                key: "segment-size",
                message: format!("more than {MAX_SEGMENTS} segments; raise it"),
            });
        }
        if self.max_frame_bytes < feedstore_proto::frame::MIN_PAYLOAD_BYTES {
            return Err(ConfigError::Value {
                key: "max-frame-bytes",
                message: format!(
                    "must be at least {}",
                    feedstore_proto::frame::MIN_PAYLOAD_BYTES
                ),
            });
        }
        let l = &self.limits;
        for (key, value, least) in [
            ("max-connections", l.max_connections as u64, 1),
            (
                "max-connections-per-uid",
                l.max_connections_per_uid as u64,
                1,
            ),
            ("hello-timeout-ms", l.hello_timeout.as_millis() as u64, 1),
            ("max-queued-requests", l.max_queued_requests as u64, 1),
            ("max-leases-per-connection", l.max_leases_per_connection, 1),
            ("reader-lease-percent", l.reader_lease_percent, 1),
            ("max-streams", l.max_streams as u64, 1),
            // One ring of the smallest depth: a whole page.
            ("max-ring-bytes", l.max_ring_bytes, 4096),
            ("stream-idle-secs", l.stream_idle_timeout.as_secs(), 1),
        ] {
            if value < least {
                return Err(ConfigError::Value {
                    key,
                    message: if least == 1 {
                        "must be at least 1".into()
                    } else {
                        format!("must be at least {} (one ring)", format_bytes(least))
                    },
                });
            }
        }
        if l.reader_lease_percent > 100 {
            return Err(ConfigError::Value {
                key: "reader-lease-percent",
                message: "must be at most 100".into(),
            });
        }
        if l.max_connections_per_uid > l.max_connections {
            return Err(ConfigError::Value {
                key: "max-connections-per-uid",
                message: format!(
                    "{} is more than --max-connections ({})",
                    l.max_connections_per_uid, l.max_connections
                ),
            });
        }
        if self.worker_threads == 0 {
            return Err(ConfigError::Value {
                key: "worker-threads",
                message: "must be at least 1".into(),
            });
        }
        self.validate_cluster()
    }

    fn validate_cluster(&self) -> Result<(), ConfigError> {
        let c = &self.cluster;
        // Even on loopback: the peer port skips the socket's uid checks, so without a secret
        // any local user could read every object through it.
        if c.enabled() && c.secret_file.is_none() {
            return Err(ConfigError::Value {
                key: "cluster-secret-file",
                message: "--listen, --peers and --peers-file need the cluster's shared secret \
                          (make one with `head -c 32 /dev/urandom | base64 > FILE; chmod 600 FILE`)"
                    .into(),
            });
        }
        for (key, value) in [
            ("pull-timeout-ms", c.pull_timeout.as_millis() as u64),
            ("peer-connections", c.connections_per_peer as u64),
            ("peer-refresh-secs", c.refresh.as_secs()),
            ("max-pulls", c.max_pulls as u64),
            ("max-peer-connections", c.max_peer_connections as u64),
        ] {
            if value == 0 {
                return Err(ConfigError::Value {
                    key,
                    message: "must be at least 1".into(),
                });
            }
        }
        if c.peers.iter().any(|p| !p.contains(':')) {
            return Err(ConfigError::Value {
                key: "peers",
                message: format!("{:?}: each peer is HOST:PORT", c.peers),
            });
        }
        Ok(())
    }

    /// Segment sizes tiling the capacity.
    pub fn segment_sizes(&self) -> Vec<u64> {
        let mut left = self.capacity_bytes;
        let mut sizes = Vec::new();
        while left > 0 {
            let s = left.min(self.segment_bytes);
            sizes.push(s);
            left -= s;
        }
        sizes
    }
}

/// Parses `auto`, `on` or `off`.
pub fn parse_huge_pages(s: &str) -> Result<HugePages, ConfigError> {
    match s.to_ascii_lowercase().as_str() {
        "auto" => Ok(HugePages::Auto),
        "on" | "true" | "yes" => Ok(HugePages::On),
        "off" | "false" | "no" => Ok(HugePages::Off),
        _ => Err(ConfigError::Value {
            key: "huge-pages",
            message: format!("{s:?} is not auto, on or off"),
        }),
    }
}

/// Parses a byte size: `4096`, `64KiB`, `512MiB`, `8GiB`, `1.5G` (K/M/G/T are powers of 1024
/// too, as for memory everywhere else on the node).
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let value: f64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a size such as 512MiB or 8GiB"))?;
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        other => {
            return Err(format!(
                "unknown unit {other:?} in {s:?} (use B, KiB, MiB, GiB or TiB)"
            ));
        }
    };
    let bytes = value * (1u64 << shift) as f64;
    if !(bytes.is_finite() && bytes >= 0.0 && bytes < u64::MAX as f64) {
        return Err(format!("{s:?} is out of range"));
    }
    Ok(bytes as u64)
}

/// A field of `/proc/meminfo`, in bytes.
pub fn meminfo_bytes(field: &str) -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    text.lines().find_map(|l| {
        let rest = l.strip_prefix(field)?.strip_prefix(':')?;
        Some(rest.split_whitespace().next()?.parse::<u64>().ok()? * 1024)
    })
}

/// A stable node id: FNV-1a of the host name, so every daemon on a host agrees without config.
pub fn default_node_id() -> u32 {
    let host = nix::unistd::gethostname()
        .map(|h| h.to_string_lossy().into_owned())
        .unwrap_or_default();
    host.bytes().fold(0x811c_9dc5u32, |h, b| {
        (h ^ u32::from(b)).wrapping_mul(0x0100_0193)
    })
}

/// How this node joins a cluster.
#[derive(Debug, Clone)]
pub struct ClusterConfig {
    /// Where other daemons connect (`--listen`).
    pub listen: Option<SocketAddr>,
    /// Peers as `host:port`: addresses or DNS names (`--peers`).
    pub peers: Vec<String>,
    /// A file of peers, one `host:port` per line, re-read at each refresh (`--peers-file`).
    pub peers_file: Option<PathBuf>,
    /// The shared cluster secret (`--cluster-secret-file`).
    pub secret_file: Option<PathBuf>,
    /// The longest one pull may take, retries included (`--pull-timeout-ms`).
    pub pull_timeout: Duration,
    /// Connections to one peer at most, each carrying one range at a time
    /// (`--peer-connections`).
    pub connections_per_peer: usize,
    /// How often peer names are resolved again (`--peer-refresh-secs`).
    pub refresh: Duration,
    /// Pulls under way at once, over all clients (`--max-pulls`).
    pub max_pulls: usize,
    /// Connections other daemons may have open to this one (`--max-peer-connections`).
    pub max_peer_connections: usize,
}

impl Default for ClusterConfig {
    fn default() -> Self {
        ClusterConfig {
            listen: None,
            peers: Vec::new(),
            peers_file: None,
            secret_file: None,
            pull_timeout: Duration::from_secs(30),
            connections_per_peer: 4,
            refresh: Duration::from_secs(10),
            max_pulls: 4096,
            max_peer_connections: 256,
        }
    }
}

impl ClusterConfig {
    /// Whether this node talks to other nodes at all.
    pub fn enabled(&self) -> bool {
        self.listen.is_some() || !self.peers.is_empty() || self.peers_file.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_in_binary_units() {
        assert_eq!(parse_bytes("4096").unwrap(), 4096);
        assert_eq!(parse_bytes("64KiB").unwrap(), 64 << 10);
        assert_eq!(parse_bytes("8GiB").unwrap(), 8 << 30);
        assert_eq!(parse_bytes("1.5G").unwrap(), 3 << 29);
        assert_eq!(parse_bytes(" 2 MiB ").unwrap(), 2 << 20);
        assert!(parse_bytes("lots").is_err());
        assert!(
            parse_bytes("3 parsecs")
                .unwrap_err()
                .contains("unknown unit")
        );
    }

    #[test]
    fn file_overrides_defaults_and_rejects_unknown_keys() {
        let mut cfg = DaemonConfig::default();
        let file: Settings = toml::from_str("capacity = \"64MiB\"\nhuge-pages = \"off\"").unwrap();
        file.apply(&mut cfg).unwrap();
        assert_eq!(cfg.capacity_bytes, 64 << 20);
        assert_eq!(cfg.segment_bytes, 64 << 20);
        assert_eq!(cfg.huge_pages, HugePages::Off);
        assert!(toml::from_str::<Settings>("capacty = \"1GiB\"").is_err());
    }

    #[test]
    fn segments_tile_the_capacity() {
        let cfg = DaemonConfig {
            capacity_bytes: 10 << 20,
            segment_bytes: 4 << 20,
            ..Default::default()
        };
        assert_eq!(cfg.segment_sizes(), vec![4 << 20, 4 << 20, 2 << 20]);
    }
}
