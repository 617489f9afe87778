//! Where the demo's images come from: local files (or an S3 endpoint) behind S3-like latency.
//!
//! Object stores answer each GET after tens of milliseconds however small the object; that
//! per-request latency, not bandwidth, is what a serial loader pays per sample. The delay of each
//! request is drawn uniformly from the configured range, from a hash of the seed, the key and how
//! many times that key was asked for: loaders given sources with the same seed meet the same
//! latencies.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use feedstore_producer::manifest::ImageSource;
use feedstore_producer::pipeline::{Fetch, FetchError, LocalFiles};

/// Another source (local files by default), each request answered after a delay in
/// `[low, high]`.
pub struct Delayed {
    inner: Arc<dyn Fetch>,
    low: Duration,
    high: Duration,
    seed: u64,
    asked: Mutex<HashMap<String, u64>>,
}

impl Delayed {
    /// Local files with delays drawn from `[low, high]`.
    pub fn new(low: Duration, high: Duration, seed: u64) -> Delayed {
        Delayed::wrap(Arc::new(LocalFiles::default()), low, high, seed)
    }

    /// `inner` with delays drawn from `[low, high]` added to its own.
    pub fn wrap(inner: Arc<dyn Fetch>, low: Duration, high: Duration, seed: u64) -> Delayed {
        Delayed {
            inner,
            low,
            high: high.max(low),
            seed,
            asked: Mutex::new(HashMap::new()),
        }
    }

    /// The delay of this request for `key`.
    fn delay(&self, key: &str) -> Duration {
        let nth = {
            let mut asked = self.asked.lock().unwrap_or_else(|e| e.into_inner());
            let n = asked.entry(key.to_owned()).or_insert(0);
            *n += 1;
            *n
        };
        let h = feedstore_proto::stream::sample_key(&[
            &self.seed.to_le_bytes(),
            key.as_bytes(),
            &nth.to_le_bytes(),
        ]) as u64;
        let span = (self.high - self.low).as_micros() as u64;
        self.low + Duration::from_micros(if span == 0 { 0 } else { h % (span + 1) })
    }
}

impl Fetch for Delayed {
    fn fetch<'a>(
        &'a self,
        source: &'a ImageSource,
    ) -> Pin<Box<dyn Future<Output = Result<Bytes, FetchError>> + Send + 'a>> {
        Box::pin(async move {
            tokio::time::sleep(self.delay(&source.to_string())).await;
            self.inner.fetch(source).await
        })
    }
}
