//! The feedstore client: what producers and trainers link to talk to their node's `feedstored`.
//! It lives in `consumer/` (the folder the design names), yet it serves writers as well as
//! readers: [`Client`] in either role, and streams from both sides ([`Stream`], [`StreamFeeder`]).
//!
//! Objects live in shared memory owned by the daemon. A writer reserves an object, writes it in
//! place and seals it; from then on any process on the node can read it by [`Handle`] without a
//! copy: [`Client::get`] returns a [`Lease`] that derefs to the bytes where they lie.
//!
//! Key decision: the socket carries only small control frames (about 40 bytes for a get); object
//! bytes never cross it. Segments are mapped once per connection — read-only for readers, so the
//! kernel rejects a stray write — and each get is one round trip that returns an offset into a
//! mapping the client already has. Dropping a lease queues a one-way release that rides in the
//! same `send` as the next request (or goes alone 1 ms later), so reading costs one round trip and
//! one daemon wake-up, not two.
//!
//! ```no_run
//! use feedstore_consumer::Client;
//!
//! # fn main() -> Result<(), feedstore_consumer::Error> {
//! let writer = Client::connect_writer()?;
//! let handle = writer.put(b"a decoded sample")?;
//!
//! let reader = Client::connect_reader()?;
//! let sample = reader.get(handle)?; // a lease: no copy, released on drop
//! assert_eq!(&*sample, b"a decoded sample");
//! # Ok(())
//! # }
//! ```

mod client;
mod error;
mod lease;
pub mod stream;
mod writer;

pub use client::{Client, ConnectOptions, CreateOptions};
pub use error::Error;
pub use feedstore_proto::frame::{ProducerFigures, RankAt, StreamTask};
pub use feedstore_proto::{Handle, Role, Status, StoreStats};
pub use lease::Lease;
pub use stream::{
    Delivery, Made, PendingPut, StackedImage, Stream, StreamFeeder, StreamOptions, StreamSample,
    stacked_image,
};
pub use writer::{ObjectWriter, PendingSeal, PutPipeline};
