//! The `feedstored` daemon: owner of a node's shared memory and of every object in it.
//!
//! One daemon runs per node. It creates the shared-memory segments (memfd, huge pages when the
//! node has them, pre-faulted), and serves clients over a Unix socket: writers reserve an object,
//! write it in place and seal it; readers get a lease on a sealed object and read it in place.
//! The daemon copies no object bytes on one node; it only hands out byte ranges and tracks who
//! holds what. Across nodes it moves them: a pull lands another node's object straight from the
//! socket into this node's shared memory, once per node.
//!
//! Key decision: all bookkeeping (allocator, object table, leases, LRU) lives in the daemon's
//! private memory behind a single lock, and every client's holdings are tied to its socket
//! connection. A client that dies — even by `kill -9` — closes its socket, and the daemon
//! reclaims everything it held. No client can corrupt the metadata, because no client can reach
//! it.
//!
//! Layers, bottom up. The synchronous core, the crate `feedstore-core` (`store/core/`, re-exported
//! here): [`alloc`] (free space in a segment), [`objects`] (object lifecycle, leases, eviction),
//! [`streams`] (ordered delivery to trainer ranks, with [`cache`], the decode-once cache). On top,
//! this crate's I/O: [`peer`] (who is connecting), [`server`] (the socket protocol), [`cluster`]
//! (pulling other nodes' objects over TCP), [`metrics`] (the Prometheus endpoint), [`daemon`]
//! (start, serve, stop), [`cli`] (the binary's flags).
//!
//! ```no_run
//! use feedstore_store::{config::DaemonConfig, daemon::Daemon};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let config = DaemonConfig {
//!     socket: "/tmp/feedstore-example.sock".into(),
//!     capacity_bytes: 256 << 20,
//!     segment_bytes: 256 << 20,
//!     ..DaemonConfig::default()
//! };
//! let daemon = Daemon::bind(&config)?.spawn(); // serves on a background thread
//! // ... connect clients to daemon.socket_path() ...
//! daemon.stop();
//! # Ok(())
//! # }
//! ```

/// The decode-once cache (part of the core's streams).
pub use feedstore_core::streams::cache;
pub use feedstore_core::{alloc, objects, random_bytes, streams};

pub mod cli;
pub mod cluster;
pub mod config;
pub mod credentials;
pub mod daemon;
pub mod fdstore;
mod handoff;
pub mod metrics;
pub mod notify;
pub mod server;
pub mod state;
