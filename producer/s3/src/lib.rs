//! Fetching from S3 (or any S3-compatible store) through the AWS SDK: the producer's
//! [`Fetch`] for `s3://` sources.
//!
//! A crate of its own so that the producer's pipeline (decode, resize, tokenize) compiles while
//! the AWS SDK does: a cold release build of the workspace waited on aws-sdk-s3 and then on the
//! whole producer, one after the other.
//!
//! Configured the standard AWS way: `AWS_ENDPOINT_URL`, `AWS_REGION`, and the usual credential
//! chain (environment, profile), with options to override the endpoint and region and to force
//! path-style addressing (needed by most self-hosted stores). Transient failures (throttling,
//! 5xx, timeouts, connection resets) are retried with exponential backoff and jitter: by the
//! SDK's standard mode up to the response head, and here when a body is cut off or stalls. A missing key or bucket and a refused access are final: the sample is
//! rejected with the reason.

use bytes::Bytes;
use std::time::Duration;

use aws_config::BehaviorVersion;
use aws_config::retry::RetryConfig;
use aws_config::timeout::TimeoutConfig;
use aws_sdk_s3::config::http::HttpResponse;
use aws_sdk_s3::error::{DisplayErrorContext, SdkError};
use aws_smithy_http_client::tls::{Provider, rustls_provider::CryptoMode};

use feedstore_producer::input::{DEFAULT_MAX_IMAGE_BYTES, LocalFiles};
use feedstore_producer::source::{Fetch, FetchError, Fetching, ImageSource};

/// How to reach S3.
#[derive(Debug, Clone)]
pub struct S3Options {
    /// Endpoint URL [default: `AWS_ENDPOINT_URL`, else AWS].
    pub endpoint: Option<String>,
    /// Region [default: `AWS_REGION` / profile, else us-east-1].
    pub region: Option<String>,
    /// Address buckets as `endpoint/bucket/key` instead of `bucket.endpoint/key`.
    pub force_path_style: bool,
    /// Attempts per object, the first included.
    pub max_attempts: u32,
    /// Backoff before the first retry; doubles each time, with jitter.
    pub initial_backoff: Duration,
    /// Limit on one attempt: the request up to its response head, and then the whole body.
    pub attempt_timeout: Duration,
    /// Static access key id and secret, for self-hosted stores and tests [default: the standard
    /// credential chain].
    pub static_credentials: Option<(String, String)>,
    /// The largest object read: larger ones are refused by their `Content-Length` before the
    /// body is read, and a body that runs past it is cut off.
    pub max_object_bytes: u64,
}

impl Default for S3Options {
    fn default() -> Self {
        S3Options {
            endpoint: None,
            region: None,
            force_path_style: false,
            max_attempts: 5,
            initial_backoff: Duration::from_millis(100),
            attempt_timeout: Duration::from_secs(30),
            static_credentials: None,
            max_object_bytes: DEFAULT_MAX_IMAGE_BYTES,
        }
    }
}

/// Fetches `s3://` sources through the SDK and local paths from disk.
#[derive(Debug, Clone)]
pub struct S3Fetcher {
    client: aws_sdk_s3::Client,
    local: LocalFiles,
    max_attempts: u32,
    initial_backoff: Duration,
    attempt_timeout: Duration,
    max_object_bytes: u64,
    /// Where requests go, for messages.
    endpoint: String,
}

impl S3Fetcher {
    /// Builds a client from the standard AWS configuration and `options`.
    pub async fn new(options: &S3Options) -> S3Fetcher {
        let http = aws_smithy_http_client::Builder::new()
            .tls_provider(Provider::Rustls(CryptoMode::AwsLc))
            .build_https();
        let mut loader = aws_config::defaults(BehaviorVersion::latest())
            .http_client(http)
            .retry_config(
                RetryConfig::standard()
                    .with_max_attempts(options.max_attempts.max(1))
                    .with_initial_backoff(options.initial_backoff),
            )
            .timeout_config(
                TimeoutConfig::builder()
                    .connect_timeout(Duration::from_secs(5).min(options.attempt_timeout))
                    .operation_attempt_timeout(options.attempt_timeout)
                    .build(),
            );
        if let Some(endpoint) = &options.endpoint {
            loader = loader.endpoint_url(endpoint);
        }
        if let Some((id, secret)) = &options.static_credentials {
            let credentials =
                aws_sdk_s3::config::Credentials::new(id, secret, None, None, "feedstore-static");
            loader = loader.credentials_provider(credentials);
        }
        let region = options
            .region
            .clone()
            .or_else(|| std::env::var("AWS_REGION").ok());
        loader = loader.region(aws_config::Region::new(
            region.unwrap_or_else(|| "us-east-1".into()),
        ));
        let shared = loader.load().await;
        let config = aws_sdk_s3::config::Builder::from(&shared)
            .force_path_style(options.force_path_style)
            .build();
        S3Fetcher {
            client: aws_sdk_s3::Client::from_conf(config),
            local: LocalFiles::default(),
            max_attempts: options.max_attempts.max(1),
            initial_backoff: options.initial_backoff,
            attempt_timeout: options.attempt_timeout,
            max_object_bytes: options.max_object_bytes,
            endpoint: options
                .endpoint
                .clone()
                .or_else(|| std::env::var("AWS_ENDPOINT_URL").ok())
                .unwrap_or_else(|| "AWS S3".into()),
        }
    }

    /// Reads local paths with `local` (confined beneath a root, say) instead of from anywhere.
    pub fn with_local(mut self, local: LocalFiles) -> S3Fetcher {
        self.local = local;
        self
    }

    /// The SDK client (to create buckets and upload in tests and tools).
    pub fn client(&self) -> &aws_sdk_s3::Client {
        &self.client
    }

    /// The object, or a part of it, retried as a whole on a body cut off or stalled; with the
    /// object's length where the reply says it (a ranged one's `Content-Range`).
    async fn get(
        &self,
        bucket: &str,
        key: &str,
        part: Part,
    ) -> Result<(Bytes, Option<u64>), FetchError> {
        let uri = format!("s3://{bucket}/{key}");
        let mut attempt = 1;
        loop {
            let request = self.client.get_object().bucket(bucket).key(key);
            let request = match part {
                Part::Range(_, 0) | Part::Tail(0) => return Ok((Bytes::new(), None)),
                Part::Range(offset, len) => {
                    request.range(format!("bytes={offset}-{}", offset.saturating_add(len - 1)))
                }
                Part::Tail(len) => request.range(format!("bytes=-{len}")),
                Part::Whole => request,
            };
            let response = match request.send().await {
                Ok(response) => response,
                // A range starting at or past the end (or any range of an empty object):
                // nothing there.
                Err(SdkError::ServiceError(e))
                    if part != Part::Whole && e.raw().status().as_u16() == 416 =>
                {
                    let total = match part {
                        Part::Tail(_) => Some(0),
                        _ => None,
                    };
                    return Ok((Bytes::new(), total));
                }
                Err(e) => return Err(request_error(&uri, &self.endpoint, e)),
            };
            let max = match part {
                Part::Whole => self.max_object_bytes,
                Part::Range(_, len) | Part::Tail(len) => len,
            };
            let too_large = |size: &str| match part {
                Part::Whole => too_large(&uri, size, max),
                _ => FetchError::Other(format!(
                    "{uri} from {}: a GET of {max} bytes got {size} (does the server ignore \
                     Range?)",
                    self.endpoint
                )),
            };
            if let Some(length) = response.content_length().filter(|&n| n as u64 > max) {
                return Err(too_large(&length.to_string()));
            }
            // A ranged reply says which bytes it holds, of how many: `bytes FIRST-LAST/TOTAL`.
            let span = response.content_range().map(parse_content_range);
            // The SDK retries a request until its response head arrives; a body cut off or
            // stalled after that is retried here, the whole GET again.
            let body = collect_bounded(response.body, max);
            let failure = match tokio::time::timeout(self.attempt_timeout, body).await {
                Ok(Ok(Some(body))) => {
                    let got = body.len() as u64;
                    let checked = match part {
                        Part::Whole => Ok(Some(got)),
                        Part::Range(offset, len) => {
                            check_range((offset, len), span, got).map(|()| span.flatten()?.1)
                        }
                        Part::Tail(len) => check_tail(len, span, got),
                    };
                    match checked {
                        Ok(total) => return Ok((body, total)),
                        Err(e) => e,
                    }
                }
                Ok(Ok(None)) => {
                    return Err(too_large("more than that (past its length)"));
                }
                Ok(Err(e)) => format!("body: {}", DisplayErrorContext(&e)),
                Err(_) => format!(
                    "body not complete within the {:?} attempt timeout",
                    self.attempt_timeout
                ),
            };
            if attempt >= self.max_attempts {
                return Err(FetchError::Other(format!(
                    "{uri} from {}: {failure} (after {attempt} attempts)",
                    self.endpoint
                )));
            }
            tracing::debug!(%uri, attempt, %failure, "retrying");
            tokio::time::sleep(backoff(self.initial_backoff, attempt)).await;
            attempt += 1;
        }
    }
}

/// What part of an object a GET asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Part {
    /// All of it.
    Whole,
    /// At most `len` bytes from `offset`.
    Range(u64, u64),
    /// Its last `len` bytes, or all of it when shorter.
    Tail(u64),
}

/// The object's length, if `got` bytes answer a GET of its last `len`: a `Content-Range` that
/// ends at its total and holds what came (all of it, when the object is shorter than `len`).
fn check_tail(
    len: u64,
    span: Option<Option<(u64, Option<u64>)>>,
    got: u64,
) -> Result<Option<u64>, String> {
    match span {
        Some(Some((first, Some(total))))
            if first.checked_add(got) == Some(total) && (got == len || first == 0) =>
        {
            Ok(Some(total))
        }
        // No Content-Range: the whole object came back, shorter than `len`.
        None if got <= len => Ok(Some(got)),
        _ => Err(format!(
            "a GET of the last {len} bytes came back with {got} bytes and Content-Range \
             {span:?}"
        )),
    }
}

/// `Content-Range: bytes FIRST-LAST/TOTAL` as (first, total), `None` where it is not that.
fn parse_content_range(header: &str) -> Option<(u64, Option<u64>)> {
    let (span, total) = header.strip_prefix("bytes ")?.split_once('/')?;
    let first = span.split_once('-')?.0.trim().parse().ok()?;
    Some((first, total.trim().parse().ok()))
}

/// Whether `got` bytes answer a GET of `len` bytes from `offset`, as the reply's `span` says
/// (`None`: no Content-Range): from `offset`, and short only at the object's end. A reply
/// without one is the whole object, which answers a range from 0 only.
fn check_range(
    (offset, len): (u64, u64),
    span: Option<Option<(u64, Option<u64>)>>,
    got: u64,
) -> Result<(), String> {
    match span {
        None if offset == 0 => Ok(()),
        None => Err(format!(
            "a GET of bytes {offset}.. came back without a Content-Range (does the server \
             ignore Range?)"
        )),
        Some(None) => Err("a Content-Range that is not `bytes FIRST-LAST/TOTAL`".into()),
        Some(Some((first, _))) if first != offset => Err(format!(
            "a GET of bytes {offset}.. came back with bytes {first}.."
        )),
        Some(Some((_, total))) if got < len && total != Some(offset + got) => Err(format!(
            "a GET of {len} bytes from {offset} got {got}, short of the object's end \
             ({total:?} bytes)"
        )),
        Some(_) => Ok(()),
    }
}

fn too_large(uri: &str, size: &str, max: u64) -> FetchError {
    FetchError::TooLarge(format!(
        "{uri} is {size} bytes, over the {max}-byte limit (--max-image-bytes)"
    ))
}

/// The whole body if it holds at most `max` bytes, `None` as soon as it runs past them.
async fn collect_bounded(
    mut body: aws_sdk_s3::primitives::ByteStream,
    max: u64,
) -> Result<Option<Bytes>, aws_sdk_s3::primitives::ByteStreamError> {
    let (mut chunks, mut total) = (Vec::new(), 0u64);
    while let Some(chunk) = body.try_next().await? {
        total += chunk.len() as u64;
        if total > max {
            return Ok(None);
        }
        chunks.push(chunk);
    }
    // One chunk is handed over as it is; several are joined once.
    Ok(Some(match chunks.len() {
        1 => chunks.pop().expect("one chunk"),
        _ => Bytes::from(chunks.concat()),
    }))
}

/// The innermost cause of `e`: the OS error or the server's words, without the layers of
/// SDK types around it.
fn root_cause(e: &(dyn std::error::Error + 'static)) -> String {
    let mut cause = e;
    while let Some(next) = cause.source() {
        cause = next;
    }
    cause.to_string()
}

/// One line saying what went wrong with a request, for the reject; the whole chain goes to the
/// debug log (`FEEDSTORE_LOG=debug`).
fn describe(
    e: &SdkError<aws_sdk_s3::operation::get_object::GetObjectError, HttpResponse>,
) -> String {
    use aws_sdk_s3::error::ProvideErrorMetadata;
    match e {
        SdkError::ServiceError(s) => {
            let status = s.raw().status().as_u16();
            match (s.err().code(), s.err().message()) {
                (Some(code), Some(message)) => format!("HTTP {status} {code}: {message}"),
                (Some(code), None) => format!("HTTP {status} {code}"),
                _ => format!("HTTP {status}"),
            }
        }
        SdkError::TimeoutError(_) => "timed out".into(),
        SdkError::DispatchFailure(d) if d.is_timeout() => {
            format!("timed out connecting: {}", root_cause(e))
        }
        SdkError::DispatchFailure(d) if d.is_io() => {
            format!("cannot connect: {}", root_cause(e))
        }
        // Credentials that could not be loaded, among others.
        SdkError::DispatchFailure(_) => format!("cannot send the request: {}", root_cause(e)),
        SdkError::ResponseError(_) => format!("bad response: {}", root_cause(e)),
        _ => format!("cannot send the request: {}", root_cause(e)),
    }
}

/// Maps a request error (after the SDK's own retries) to a fetch error.
fn request_error(
    uri: &str,
    endpoint: &str,
    e: SdkError<aws_sdk_s3::operation::get_object::GetObjectError, HttpResponse>,
) -> FetchError {
    tracing::debug!(%uri, error = %DisplayErrorContext(&e), "S3 request failed");
    let status = match &e {
        SdkError::ServiceError(s) => Some(s.raw().status().as_u16()),
        _ => None,
    };
    let no_such_key = matches!(&e, SdkError::ServiceError(s) if s.err().is_no_such_key());
    let said = describe(&e);
    match status {
        _ if no_such_key => FetchError::NotFound(uri.to_owned()),
        Some(404) => FetchError::NotFound(format!("{uri} ({said})")),
        Some(403) => FetchError::AccessDenied(format!("{uri} ({said})")),
        _ => FetchError::Other(format!("{uri} from {endpoint}: {said} (after retries)")),
    }
}

/// Exponential backoff with full jitter: a random wait in [0, initial × 2^(attempt-1)], capped
/// at 20 s, as the SDK's standard retry mode does.
fn backoff(initial: Duration, attempt: u32) -> Duration {
    use std::hash::{BuildHasher, Hasher};
    let ceiling = initial
        .saturating_mul(1 << (attempt - 1).min(16))
        .min(Duration::from_secs(20));
    // A randomly keyed hasher is jitter enough, without a dependency on a RNG.
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u32(attempt);
    let unit = (hasher.finish() >> 11) as f64 / (1u64 << 53) as f64;
    ceiling.mul_f64(unit)
}

impl Fetch for S3Fetcher {
    fn fetch<'a>(&'a self, source: &'a ImageSource) -> Fetching<'a, Bytes> {
        match source {
            ImageSource::S3 { bucket, key } => {
                Box::pin(async move { Ok(self.get(bucket, key, Part::Whole).await?.0) })
            }
            _ => self.local.fetch(source),
        }
    }

    fn fetch_range<'a>(
        &'a self,
        source: &'a ImageSource,
        offset: u64,
        len: u64,
    ) -> Fetching<'a, Bytes> {
        match source {
            ImageSource::S3 { bucket, key } => {
                Box::pin(
                    async move { Ok(self.get(bucket, key, Part::Range(offset, len)).await?.0) },
                )
            }
            _ => self.local.fetch_range(source, offset, len),
        }
    }

    fn fetch_tail<'a>(&'a self, source: &'a ImageSource, len: u64) -> Fetching<'a, (Bytes, u64)> {
        match source {
            ImageSource::S3 { bucket, key } => Box::pin(async move {
                let uri = format!("s3://{bucket}/{key}");
                match self.get(bucket, key, Part::Tail(len)).await? {
                    (tail, Some(total)) => Ok((tail, total)),
                    (_, None) => Err(FetchError::Other(format!(
                        "{uri} from {}: a GET of its end did not say its length",
                        self.endpoint
                    ))),
                }
            }),
            _ => self.local.fetch_tail(source, len),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reply_for_the_end_must_end_the_object_and_say_its_length() {
        let span = |h: &str| Some(parse_content_range(h));
        assert_eq!(check_tail(10, span("bytes 90-99/100"), 10), Ok(Some(100)));
        // An object shorter than asked: all of it.
        assert_eq!(check_tail(10, span("bytes 0-6/7"), 7), Ok(Some(7)));
        assert_eq!(check_tail(10, None, 7), Ok(Some(7)));
        // Not its end, short in the middle, no total, too much without a range.
        assert!(check_tail(10, span("bytes 80-89/100"), 10).is_err());
        assert!(check_tail(10, span("bytes 95-99/100"), 5).is_err());
        assert!(check_tail(10, span("bytes 90-99/*"), 10).is_err());
        assert!(check_tail(10, None, 11).is_err());
    }

    #[test]
    fn a_ranged_reply_must_hold_the_bytes_asked_or_end_the_object() {
        let span = |h: &str| Some(parse_content_range(h));
        assert_eq!(parse_content_range("bytes 5-9/20"), Some((5, Some(20))));
        assert_eq!(parse_content_range("bytes 5-9/*"), Some((5, None)));
        assert_eq!(parse_content_range("items 5-9/20"), None);
        // Whole, or short at the end.
        assert!(check_range((0, 10), span("bytes 0-9/20"), 10).is_ok());
        assert!(check_range((10, 10), span("bytes 10-14/15"), 5).is_ok());
        // A whole object for a range from 0 is the range.
        assert!(check_range((0, 10), None, 7).is_ok());
        // Short before the end, another start, no Content-Range past 0, a bad header.
        assert!(
            check_range((10, 10), span("bytes 10-14/20"), 5)
                .unwrap_err()
                .contains("short")
        );
        assert!(check_range((10, 10), span("bytes 10-14/*"), 5).is_err());
        assert!(
            check_range((10, 10), span("bytes 0-9/20"), 10)
                .unwrap_err()
                .contains("bytes 0")
        );
        assert!(
            check_range((10, 10), None, 10)
                .unwrap_err()
                .contains("ignore Range")
        );
        assert!(check_range((10, 10), span("nonsense"), 10).is_err());
    }
}
