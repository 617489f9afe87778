//! Where image bytes come from: an [`ImageSource`] (a file on this node or an S3 object, as a
//! manifest names it, or a member of a WebDataset shard), the [`Fetch`] trait each kind of source implements
//! (`input::LocalFiles`, `feedstore_s3::S3Fetcher`), and why a fetch failed. A leaf: the
//! manifest names sources, the inputs and the S3 client fetch them, the pipeline drives
//! fetches, and this module knows none of them.

use std::path::PathBuf;
use std::pin::Pin;

use bytes::Bytes;

/// Where an image comes from.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum ImageSource {
    /// An object in S3 (or an S3-compatible store).
    S3 {
        /// Bucket.
        bucket: String,
        /// Key.
        key: String,
    },
    /// A file on this node, as the manifest names it.
    Local {
        /// The manifest's folder (absolute), which a relative `path` resolves against unless
        /// the reader is given another image root.
        base: PathBuf,
        /// The path as written: absolute, or relative to the image root.
        path: PathBuf,
    },
    /// A member of a WebDataset shard, read with its shard (never fetched on its own).
    Member {
        /// The shard, as [`crate::shards::Shard`] shows it.
        shard: String,
        /// The member's name in the tar.
        name: String,
        /// Where its header starts in the shard.
        offset: u64,
    },
}

impl ImageSource {
    /// A local file at `path` as written, in a manifest whose folder is `base`.
    pub fn local(base: impl Into<PathBuf>, path: impl Into<PathBuf>) -> ImageSource {
        ImageSource::Local {
            base: base.into(),
            path: path.into(),
        }
    }
}

impl std::fmt::Display for ImageSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ImageSource::S3 { bucket, key } => write!(f, "s3://{bucket}/{key}"),
            ImageSource::Local { base, path } => write!(f, "{}", base.join(path).display()),
            ImageSource::Member {
                shard,
                name,
                offset,
            } => write!(f, "{shard}#{name}@{offset}"),
        }
    }
}

/// Why an image could not be fetched.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FetchError {
    /// No such object or file.
    #[error("not found: {0}")]
    NotFound(String),
    /// The source refused access.
    #[error("access denied: {0}")]
    AccessDenied(String),
    /// This fetcher does not serve that kind of source.
    #[error("unsupported source {0}")]
    Unsupported(String),
    /// The input is not one the producer reads: not a regular file, or outside the image root.
    #[error("{0}")]
    Invalid(String),
    /// The file or object is larger than the limit.
    #[error("{0}")]
    TooLarge(String),
    /// Any other failure, after retries where they apply.
    #[error("{0}")]
    Other(String),
}

/// A fetch under way: what [`Fetch`]'s methods return.
pub type Fetching<'a, T> = Pin<Box<dyn Future<Output = Result<T, FetchError>> + Send + 'a>>;

/// Where image bytes come from. One implementation per kind of source; the pipeline does not
/// know which it is talking to.
pub trait Fetch: Send + Sync + 'static {
    /// Reads the whole object. `Bytes`, so a client's own buffer is handed over, not copied.
    fn fetch<'a>(&'a self, source: &'a ImageSource) -> Fetching<'a, Bytes>;

    /// Reads at most `len` bytes of the object from byte `offset` (a shard, a chunk at a
    /// time): fewer only where the object ends, none at or past its end. Not every source
    /// serves ranges: the default refuses.
    fn fetch_range<'a>(
        &'a self,
        source: &'a ImageSource,
        offset: u64,
        len: u64,
    ) -> Fetching<'a, Bytes> {
        let _ = (offset, len);
        Box::pin(async move { Err(FetchError::Unsupported(format!("{source} (ranged reads)"))) })
    }

    /// The object's last `len` bytes (all of it, when shorter) and its length: a Parquet
    /// file's footer, read from its end. Not every source serves it: the default refuses.
    fn fetch_tail<'a>(&'a self, source: &'a ImageSource, len: u64) -> Fetching<'a, (Bytes, u64)> {
        let _ = len;
        Box::pin(async move { Err(FetchError::Unsupported(format!("{source} (its end)"))) })
    }
}
