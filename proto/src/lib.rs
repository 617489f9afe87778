//! What both sides of a feedstore socket or mapping must agree on.
//!
//! This crate is the contract between the `feedstored` daemon and every client (Rust, C, Python,
//! and later a peer node pulling objects by handle). It holds no `unsafe` and no I/O
//! beyond finding the default socket path:
//!
//! - [`Handle`]: the fixed 16-byte name of an object — node id, daemon epoch, a random id.
//!   A handle stays meaningful across processes and nodes; a stale or forged one resolves to
//!   [`Status::NotFound`] or [`Status::Stale`], never to another object's bytes.
//! - [`frame`]: the length-prefixed, versioned binary frames spoken over the daemon's Unix socket,
//!   with a size limit each side announces at hello and every encoder checks, so a malformed
//!   peer can cost at most one connection and a large batch is split, never refused mid-way.
//! - [`Status`]: the wire status codes a caller can act on.
//! - [`sample`]: the layout of a training sample inside an object — raw aligned arrays written in
//!   place, plus a small rkyv archive describing them, validated by every reader.
//!
//! Key decision: frames are hand-encoded little-endian structs rather than a serde format, so the
//! layout is the documentation, decoding is allocation-light and every length is checked before
//! it is trusted (the bytes come from another process).
//!
//! ```
//! use feedstore_proto::{frame::{Request, Frame}, Handle};
//!
//! # fn main() -> Result<(), feedstore_proto::frame::DecodeError> {
//! let handle = Handle { node_id: 7, epoch: 42, id: 0x5eed };
//! let mut wire = Vec::new();
//! Request::Get { handles: vec![handle] }
//!     .encode(9, feedstore_proto::frame::MAX_PAYLOAD_BYTES, &mut wire)
//!     .expect("a one-handle get fits any limit");
//! let frame = Frame::parse(&wire, feedstore_proto::frame::MAX_PAYLOAD_BYTES)?.expect("whole frame");
//! assert_eq!(frame.header.request_id, 9);
//! assert_eq!(Request::decode(&frame)?, Request::Get { handles: vec![handle] });
//! # Ok(())
//! # }
//! ```

pub mod batch;
pub mod frame;
mod handle;
pub mod handover;
pub mod peer;
pub mod peer_stream;
pub mod ring;
pub mod sample;
mod stats;
mod status;
pub mod stream;
/// Resuming a stream at another world size (a part of [`stream`]).
pub use stream::reshard;
mod wire;

pub use handle::Handle;
pub use stats::StoreStats;
pub use status::Status;
pub use wire::truncate;

/// Every object's offset and reserved length is a multiple of this many bytes, so tensors laid
/// out in an object are aligned for SIMD loads and never share a cache line with a neighbour.
pub const OBJECT_ALIGN_BYTES: u64 = 64;

/// Environment variable both the daemon and clients read for the socket path.
pub const SOCKET_ENV: &str = "FEEDSTORE_SOCKET";

/// Environment variable naming the uid a client expects the daemon to run as, when it is
/// neither the client's own nor root.
pub const DAEMON_UID_ENV: &str = "FEEDSTORE_DAEMON_UID";

/// Environment variable giving, in seconds, how long a client whose daemon went away tries to
/// reconnect to a daemon started again on the same socket before it gives up (0, the default
/// when unset: it does not try).
pub const RECONNECT_ENV: &str = "FEEDSTORE_RECONNECT_TIMEOUT";

/// The socket of a daemon run by root (a system service): in `/run/feedstore`, a directory
/// only root (and the configured socket group) can write.
pub const SYSTEM_SOCKET: &str = "/run/feedstore/feedstore.sock";

/// Longest client name a hello may carry, in bytes.
pub const MAX_CLIENT_NAME: usize = 256;

/// Where this user's daemon listens when neither a flag nor [`SOCKET_ENV`] says: never a path
/// another user could bind first.
///
/// - root: [`SYSTEM_SOCKET`];
/// - others: `$XDG_RUNTIME_DIR/feedstore/feedstore.sock` (the user's private runtime
///   directory), else `/tmp/feedstore-<uid>/feedstore.sock`, in a directory the daemon
///   creates with mode 0700 and refuses to use if another user owns it.
pub fn default_socket_path() -> std::path::PathBuf {
    if let Some(path) = std::env::var_os(SOCKET_ENV) {
        return path.into();
    }
    own_socket_path()
}

/// The socket a client connects to by default: [`SOCKET_ENV`], else this user's own daemon
/// ([`default_socket_path`]) if it is there, else the system daemon's if that is there, else
/// this user's (so the error names it).
pub fn client_socket_path() -> std::path::PathBuf {
    if let Some(path) = std::env::var_os(SOCKET_ENV) {
        return path.into();
    }
    let own = own_socket_path();
    if own.exists() {
        return own;
    }
    // The system daemon's socket, if it is there or its directory is closed to this user (then
    // the connect says so, rather than that this user's own daemon is missing).
    match std::fs::symlink_metadata(SYSTEM_SOCKET) {
        Ok(_) => SYSTEM_SOCKET.into(),
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => SYSTEM_SOCKET.into(),
        Err(_) => own,
    }
}

/// This user's default socket, whatever [`SOCKET_ENV`] says (see [`default_socket_path`]).
pub fn own_socket_path() -> std::path::PathBuf {
    let uid = current_uid();
    if uid == 0 {
        return SYSTEM_SOCKET.into();
    }
    match std::env::var_os("XDG_RUNTIME_DIR") {
        Some(dir) if std::path::Path::new(&dir).is_dir() => {
            std::path::Path::new(&dir).join("feedstore/feedstore.sock")
        }
        _ => format!("/tmp/feedstore-{uid}/feedstore.sock").into(),
    }
}

/// The effective uid of this process, read without `unsafe`: `/proc/self` belongs to it.
pub fn current_uid() -> u32 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self")
        .map(|m| m.uid())
        .unwrap_or(0)
}

/// What a client asks to be when it connects.
///
/// Readers receive read-only segment file descriptors and can only map them `PROT_READ`;
/// writers receive read-write descriptors and may create objects.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Role {
    /// Maps segments read-only; may get, release and read stats.
    Reader = 1,
    /// Maps segments read-write; may also create, seal, abort and delete.
    Writer = 2,
}

impl Role {
    /// Decodes the wire byte.
    pub fn from_u8(v: u8) -> Option<Role> {
        match v {
            1 => Some(Role::Reader),
            2 => Some(Role::Writer),
            _ => None,
        }
    }
}

/// A shared-memory segment as the daemon announces it in its hello reply.
///
/// The segment's file descriptor travels beside the frame by `SCM_RIGHTS`, in the same order as
/// the segments are listed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentInfo {
    /// Index of the segment; object locations name it.
    pub id: u32,
    /// Length of the mapping in bytes.
    pub size_bytes: u64,
    /// Bit set of `SEGMENT_*` flags.
    pub flags: u32,
}

/// [`SegmentInfo::flags`]: the segment is backed by hugetlbfs pages.
pub const SEGMENT_HUGETLB: u32 = 1;
/// [`SegmentInfo::flags`]: the descriptor that came with it allows writable mappings.
pub const SEGMENT_WRITABLE: u32 = 2;

/// Where a sealed or reserved object lives: a byte range in one segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Location {
    /// The segment's id.
    pub segment: u32,
    /// Offset from the start of the segment, a multiple of [`OBJECT_ALIGN_BYTES`].
    pub offset: u64,
    /// The object's length in bytes as the writer asked for it.
    pub len: u64,
}

/// An error and its causes on one line (`a: b: c`; a cause the line already holds is not
/// repeated): how every binary and binding reports one.
pub fn error_chain(err: &dyn std::error::Error) -> String {
    let mut line = err.to_string();
    let mut source = err.source();
    while let Some(s) = source {
        let cause = s.to_string();
        // A message that already says its cause (`...: {source}`) does not repeat it.
        if !line.contains(&cause) {
            line.push_str(": ");
            line.push_str(&cause);
        }
        source = s.source();
    }
    line
}
