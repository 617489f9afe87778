//! feedstore producers: turn a manifest of multimodal records into samples written once into
//! the node's shared-memory store.
//!
//! - [`chat`]: conversations to token ids and loss labels with the model's own chat template
//!   ([`template`]: Jinja rendered as Hugging Face's `apply_chat_template` renders it) and the
//!   model's image-token expansion, matching Hugging Face's output token for token.
//! - [`feed`]: the same pipeline feeding a stream: the daemon hands out (rank, sequence number)
//!   tasks, the stream's spec names the record, a rejected record is replaced by the next of the
//!   rank's share.
//! - [`input`]: what a producer reads from the file system: regular files of bounded size,
//!   image paths kept beneath a root (`openat2(RESOLVE_BENEATH)`), nothing that blocks.
//! - [`manifest`]: LLaVA / Qwen-VL JSONL records, every bad line a [`manifest::Reject`] with its
//!   line number, id and reason, never the end of the run; indexed for random access by streams.
//! - [`shards`]: WebDataset tar shards, local or S3, read a chunk at a time: members sharing a
//!   key make a sample, a bad member or a shard cut short rejects only the samples it touches.
//! - [`tables`]: Parquet files (Hugging Face `datasets`: `Image` columns of bytes or paths), a
//!   row group at a time with every page header checked before it is decoded; a row is a record.
//! - [`pieces`]: records read by index (a stream's order) from files read a piece at a time:
//!   Parquet row groups (`tables::ParquetRows`), runs of a shard's samples
//!   (`shards::ShardRows`), each piece read whole once and cached.
//! - [`pipeline`]: records in, samples sealed in the store out: tokio fetches, CPU workers, every
//!   failure a reject, with the [`profile`] stage profiler naming the bottleneck.
//! - the S3 fetcher is the `feedstore-s3` crate (`producer/s3/`: AWS SDK, standard configuration,
//!   retries with backoff and jitter), so this one compiles while the SDK does.
//! - [`vision`]: probe (with a decompression-bomb guard), plan the output size, decode, resize
//!   (bicubic, matching Pillow) and normalise into the sample's region in one pass.
//!
//! The sample layout the producer writes lives in `feedstore_proto::sample`, the crate both the
//! producer and the readers depend on.
//!
//! ```no_run
//! use feedstore_producer::chat::{ChatTokenizer, Message, Role};
//!
//! # fn main() -> Result<(), feedstore_producer::chat::ChatError> {
//! let tokenizer = ChatTokenizer::from_file("tokenizer.json".as_ref(), 8192)?;
//! let conversation = [
//!     Message::new(Role::User, "<image>\nwhat is the blue shape?"),
//!     Message::new(Role::Assistant, "rectangle"),
//! ];
//! let encoded = tokenizer.encode(&conversation, &[4])?; // one image of 4 merged patches
//! assert_eq!(encoded.ids.len(), encoded.labels.len());
//! # Ok(())
//! # }
//! ```

pub mod chat;
pub mod feed;
pub mod input;
pub mod manifest;
pub mod pieces;
pub mod pipeline;
pub mod profile;
pub mod shards;
pub mod source;
pub mod tables;
pub mod template;
pub mod vision;

pub use vision::jpeg;
