//! A fault-injecting HTTP/1.1 proxy on loopback, standing in for netem and a flaky network.
//!
//! It understands just enough HTTP/1.1 to act per request, not per byte: it reads each request
//! from a kept-alive client connection, waits the plan's latency, picks the first [`Rule`] whose
//! path fragment matches and whose budget is not spent, and then either answers itself (a 5xx
//! with an S3-style XML error, a reset) or forwards the request to the upstream server on a fresh
//! connection and relays the response, whole, trickled, stalled or cut off midway.
//!
//! Bounded on purpose: it binds 127.0.0.1 only, serves at most [`MAX_CONNECTIONS`] clients at
//! once, and refuses request heads over 64 KiB and bodies over 64 MiB.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Client connections served at once; more wait in the listen backlog.
pub const MAX_CONNECTIONS: usize = 512;
const MAX_HEAD: usize = 64 << 10;
const MAX_BODY: usize = 64 << 20;
const MAX_LOG: usize = 100_000;

/// What the proxy does to requests. Replace it while the proxy runs with [`FaultProxy::set_plan`].
#[derive(Debug, Clone, Default)]
pub struct Plan {
    /// Added before every request is answered or forwarded.
    pub latency: Duration,
    /// Faults by request path; the first matching rule with budget left applies.
    pub rules: Vec<Rule>,
}

/// A fault for requests whose target contains a fragment.
#[derive(Debug, Clone)]
pub struct Rule {
    /// Matches requests whose target (path and query) contains this.
    pub path_contains: String,
    /// How many matching requests get the fault; later ones pass through.
    pub times: u32,
    /// What happens to them.
    pub fault: Fault,
}

impl Rule {
    /// Every request whose target contains `path_contains` gets `fault`.
    pub fn new(path_contains: impl Into<String>, fault: Fault) -> Rule {
        Rule {
            path_contains: path_contains.into(),
            times: u32::MAX,
            fault,
        }
    }

    /// Only the first `n` matching requests get the fault.
    pub fn times(mut self, n: u32) -> Rule {
        self.times = n;
        self
    }
}

/// What happens to a request a rule matches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fault {
    /// The proxy answers with this status and an S3-style XML error; upstream never sees it.
    Status(u16),
    /// The connection is reset (RST) after the request is read; no response.
    ResetBeforeResponse,
    /// The response head and half the body are relayed, then the connection is reset.
    ResetMidBody,
    /// The response is relayed `chunk` bytes at a time with `pause` after each.
    SlowBody {
        /// Bytes per write.
        chunk: usize,
        /// Pause after each write.
        pause: Duration,
    },
    /// The head and half the body are relayed, then nothing for this long, then the rest.
    StallBody(Duration),
    /// Extra latency for this request, on top of the plan's.
    Latency(Duration),
}

/// One request as the proxy saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seen {
    /// Method and target, e.g. `GET /bucket/key?x-id=GetObject`.
    pub request: String,
    /// The fault applied, if any.
    pub fault: Option<Fault>,
}

struct Shared {
    upstream: SocketAddr,
    plan: Mutex<Plan>,
    used: Mutex<Vec<u32>>,
    log: Mutex<VecDeque<Seen>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Shared {
    /// The fault for a request, spending one from its rule's budget.
    fn choose(&self, request: &str) -> Option<Fault> {
        let plan = lock(&self.plan);
        let mut used = lock(&self.used);
        used.resize(plan.rules.len(), 0);
        let fault = plan
            .rules
            .iter()
            .zip(used.iter_mut())
            .find(|(rule, used)| request.contains(&rule.path_contains) && **used < rule.times)
            .map(|(rule, used)| {
                *used += 1;
                rule.fault.clone()
            });
        let mut log = lock(&self.log);
        if log.len() == MAX_LOG {
            log.pop_front();
        }
        log.push_back(Seen {
            request: request.to_owned(),
            fault: fault.clone(),
        });
        fault
    }

    fn latency(&self) -> Duration {
        lock(&self.plan).latency
    }
}

/// A running proxy: its own tokio runtime, stopped on drop.
pub struct FaultProxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
    runtime: Option<tokio::runtime::Runtime>,
}

impl std::fmt::Debug for FaultProxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FaultProxy")
            .field("addr", &self.addr)
            .field("upstream", &self.shared.upstream)
            .finish()
    }
}

impl FaultProxy {
    /// Starts a proxy on a free 127.0.0.1 port in front of `upstream`.
    pub fn start(upstream: SocketAddr, plan: Plan) -> std::io::Result<FaultProxy> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("fault-proxy")
            .enable_all()
            .build()?;
        let listener = runtime.block_on(TcpListener::bind("127.0.0.1:0"))?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            upstream,
            used: Mutex::new(vec![0; plan.rules.len()]),
            plan: Mutex::new(plan),
            log: Mutex::new(VecDeque::new()),
        });
        let permits = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
        let accepting = shared.clone();
        runtime.spawn(async move {
            loop {
                let Ok(permit) = permits.clone().acquire_owned().await else {
                    return;
                };
                let Ok((client, _)) = listener.accept().await else {
                    continue;
                };
                let shared = accepting.clone();
                tokio::spawn(async move {
                    // A client that hangs up or sends garbage ends its own connection only.
                    let _ = serve(client, &shared).await;
                    drop(permit);
                });
            }
        });
        Ok(FaultProxy {
            addr,
            shared,
            runtime: Some(runtime),
        })
    }

    /// Where it listens.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Its endpoint URL, to give a client instead of the upstream's.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Replaces the plan; rule budgets start again from zero.
    pub fn set_plan(&self, plan: Plan) {
        let mut current = lock(&self.shared.plan);
        *lock(&self.shared.used) = vec![0; plan.rules.len()];
        *current = plan;
    }

    /// Every request seen so far (the last 100,000), oldest first.
    pub fn seen(&self) -> Vec<Seen> {
        lock(&self.shared.log).iter().cloned().collect()
    }

    /// Requests seen whose target contains `fragment`.
    pub fn requests_for(&self, fragment: &str) -> usize {
        lock(&self.shared.log)
            .iter()
            .filter(|s| s.request.contains(fragment))
            .count()
    }

    /// Faults applied so far.
    pub fn faults(&self) -> usize {
        lock(&self.shared.log)
            .iter()
            .filter(|s| s.fault.is_some())
            .count()
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

/// A parsed HTTP/1.1 message head.
struct Head {
    /// The start line, without CRLF.
    start: String,
    /// Header lines as (name, value).
    headers: Vec<(String, String)>,
}

impl Head {
    fn parse(bytes: &[u8]) -> std::io::Result<Head> {
        let text = std::str::from_utf8(bytes).map_err(|_| bad("head is not UTF-8"))?;
        let mut lines = text.split("\r\n");
        let start = lines.next().unwrap_or_default().to_owned();
        let headers = lines
            .filter(|l| !l.is_empty())
            .map(|l| {
                let (name, value) = l.split_once(':').ok_or_else(|| bad("header without ':'"))?;
                Ok((name.trim().to_owned(), value.trim().to_owned()))
            })
            .collect::<std::io::Result<_>>()?;
        Ok(Head { start, headers })
    }

    fn get(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    fn has_token(&self, name: &str, token: &str) -> bool {
        self.get(name)
            .is_some_and(|v| v.split(',').any(|t| t.trim().eq_ignore_ascii_case(token)))
    }

    fn content_length(&self) -> std::io::Result<usize> {
        self.get("content-length")
            .map_or(Ok(0), |v| v.parse().map_err(|_| bad("bad content-length")))
    }

    /// The head re-serialised without the named hop-by-hop headers, plus `extra` lines.
    fn write(&self, drop: &[&str], extra: &[&str]) -> Vec<u8> {
        let mut out = format!("{}\r\n", self.start);
        for (name, value) in &self.headers {
            if !drop.iter().any(|d| name.eq_ignore_ascii_case(d)) {
                out.push_str(&format!("{name}: {value}\r\n"));
            }
        }
        for line in extra {
            out.push_str(line);
            out.push_str("\r\n");
        }
        out.push_str("\r\n");
        out.into_bytes()
    }
}

fn bad(what: &str) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, what.to_owned())
}

/// Reads one message head from `stream`, with what was read past it left in `buf`. `None` on a
/// clean end of stream before any byte.
async fn read_head(stream: &mut TcpStream, buf: &mut Vec<u8>) -> std::io::Result<Option<Head>> {
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = Head::parse(&buf[..end])?;
            buf.drain(..end + 4);
            return Ok(Some(head));
        }
        if buf.len() > MAX_HEAD {
            return Err(bad("head over 64 KiB"));
        }
        let mut chunk = [0u8; 16 << 10];
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            return if buf.is_empty() {
                Ok(None)
            } else {
                Err(bad("end of stream inside a head"))
            };
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

/// Serves one client connection, request after request.
async fn serve(mut client: TcpStream, shared: &Shared) -> std::io::Result<()> {
    client.set_nodelay(true)?;
    let mut buf = Vec::new();
    while let Some(request) = read_head(&mut client, &mut buf).await? {
        if request.has_token("transfer-encoding", "chunked") {
            client
                .write_all(b"HTTP/1.1 501 Not Implemented\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
                .await?;
            return Ok(());
        }
        let body = read_body(&mut client, &mut buf, &request).await?;
        let keep_alive = !request.has_token("connection", "close");

        let target = request
            .start
            .rsplit_once(' ')
            .map_or(&*request.start, |(m, _)| m);
        let fault = shared.choose(target);
        let mut delay = shared.latency();
        if let Some(Fault::Latency(extra)) = &fault {
            delay += *extra;
        }
        tokio::time::sleep(delay).await;

        match &fault {
            Some(Fault::Status(code)) => {
                client.write_all(&error_response(*code)).await?;
                if !keep_alive {
                    return Ok(());
                }
                continue;
            }
            Some(Fault::ResetBeforeResponse) => {
                client.set_zero_linger()?;
                return Ok(());
            }
            _ => {}
        }

        let is_head = request.start.starts_with("HEAD ");
        let mut upstream = TcpStream::connect(shared.upstream).await?;
        upstream.set_nodelay(true)?;
        let mut forward = request.write(
            &["connection", "expect", "keep-alive"],
            &["connection: close"],
        );
        forward.extend_from_slice(&body);
        upstream.write_all(&forward).await?;
        let mut upstream_buf = Vec::new();
        let response = read_head(&mut upstream, &mut upstream_buf)
            .await?
            .ok_or_else(|| bad("upstream closed without a response"))?;
        upstream.read_to_end(&mut upstream_buf).await?;
        let body = upstream_buf;
        let framed = is_head
            || response.get("content-length").is_some()
            || response.has_token("transfer-encoding", "chunked");
        let close = !keep_alive || !framed;
        let head = response.write(
            &["connection", "keep-alive"],
            if close { &["connection: close"] } else { &[] },
        );
        client.write_all(&head).await?;
        let half = body.len() / 2;
        match fault {
            Some(Fault::ResetMidBody) => {
                client.write_all(&body[..half]).await?;
                client.flush().await?;
                // Let the bytes leave before the reset discards what is still queued.
                tokio::time::sleep(Duration::from_millis(20)).await;
                client.set_zero_linger()?;
                return Ok(());
            }
            Some(Fault::SlowBody { chunk, pause }) => {
                for piece in body.chunks(chunk.max(1)) {
                    client.write_all(piece).await?;
                    tokio::time::sleep(pause).await;
                }
            }
            Some(Fault::StallBody(stall)) => {
                client.write_all(&body[..half]).await?;
                tokio::time::sleep(stall).await;
                client.write_all(&body[half..]).await?;
            }
            _ => client.write_all(&body).await?,
        }
        if close {
            return Ok(());
        }
    }
    Ok(())
}

/// A request's body (`content-length` bytes, at most [`MAX_BODY`]), read after what `buf`
/// already holds; `100 Continue` first when the client waits for it.
async fn read_body(
    client: &mut TcpStream,
    buf: &mut Vec<u8>,
    request: &Head,
) -> std::io::Result<Vec<u8>> {
    let length = request.content_length()?;
    if length > MAX_BODY {
        return Err(bad("request body over 64 MiB"));
    }
    if request.has_token("expect", "100-continue") && buf.len() < length {
        client.write_all(b"HTTP/1.1 100 Continue\r\n\r\n").await?;
    }
    while buf.len() < length {
        let mut chunk = vec![0u8; (length - buf.len()).min(1 << 20)];
        let n = client.read(&mut chunk).await?;
        if n == 0 {
            return Err(bad("end of stream inside a request body"));
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    Ok(buf.drain(..length).collect())
}

/// A complete error response in S3's XML form.
fn error_response(status: u16) -> Vec<u8> {
    let (code, reason) = match status {
        403 => ("AccessDenied", "Forbidden"),
        404 => ("NoSuchKey", "Not Found"),
        500 => ("InternalError", "Internal Server Error"),
        503 => ("SlowDown", "Service Unavailable"),
        _ => ("InternalError", "Error"),
    };
    let body = format!(
        "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>{code}</Code><Message>injected by the test proxy</Message><RequestId>fault-proxy</RequestId></Error>"
    );
    format!(
        "HTTP/1.1 {status} {reason}\r\ncontent-type: application/xml\r\ncontent-length: {}\r\nx-amz-request-id: fault-proxy\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    /// A tiny upstream that answers every request with `hello` and closes.
    fn upstream() -> SocketAddr {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        std::thread::spawn(move || {
            for mut conn in listener.incoming().flatten() {
                let mut buf = [0u8; 4096];
                let mut got = Vec::new();
                while !got.windows(4).any(|w| w == b"\r\n\r\n") {
                    let n = conn.read(&mut buf).unwrap();
                    if n == 0 {
                        break;
                    }
                    got.extend_from_slice(&buf[..n]);
                }
                let _ = conn.write_all(
                    b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\nconnection: close\r\n\r\nhello",
                );
            }
        });
        addr
    }

    fn get(conn: &mut std::net::TcpStream, path: &str) -> std::io::Result<String> {
        write!(conn, "GET {path} HTTP/1.1\r\nhost: x\r\n\r\n")?;
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            let n = conn.read(&mut buf)?;
            if n == 0 {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
            got.extend_from_slice(&buf[..n]);
            let text = String::from_utf8_lossy(&got);
            if let Some((head, body)) = text.split_once("\r\n\r\n") {
                let len: usize = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length: "))
                    .unwrap()
                    .parse()
                    .unwrap();
                if body.len() >= len {
                    return Ok(text.into_owned());
                }
            }
        }
    }

    #[test]
    fn relays_keeps_alive_and_applies_rules_in_budget() {
        let proxy = FaultProxy::start(
            upstream(),
            Plan {
                latency: Duration::ZERO,
                rules: vec![Rule::new("/flaky", Fault::Status(503)).times(2)],
            },
        )
        .unwrap();
        let mut conn = std::net::TcpStream::connect(proxy.addr()).unwrap();
        // One client connection carries every request: the upstream's `connection: close` is
        // not passed on.
        assert!(get(&mut conn, "/a").unwrap().ends_with("hello"));
        let first = get(&mut conn, "/flaky").unwrap();
        assert!(first.starts_with("HTTP/1.1 503") && first.contains("<Code>SlowDown</Code>"));
        assert!(
            get(&mut conn, "/flaky")
                .unwrap()
                .starts_with("HTTP/1.1 503")
        );
        assert!(
            get(&mut conn, "/flaky").unwrap().ends_with("hello"),
            "budget spent"
        );
        assert_eq!(proxy.requests_for("/flaky"), 3);
        assert_eq!(proxy.faults(), 2);
    }

    #[test]
    fn resets_and_cuts_bodies() {
        let proxy = FaultProxy::start(
            upstream(),
            Plan {
                latency: Duration::ZERO,
                rules: vec![
                    Rule::new("/reset", Fault::ResetBeforeResponse),
                    Rule::new("/cut", Fault::ResetMidBody),
                ],
            },
        )
        .unwrap();
        let mut conn = std::net::TcpStream::connect(proxy.addr()).unwrap();
        let err = get(&mut conn, "/reset").unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::ConnectionReset, "{err}");
        let mut conn = std::net::TcpStream::connect(proxy.addr()).unwrap();
        let err = get(&mut conn, "/cut").unwrap_err();
        assert!(
            matches!(
                err.kind(),
                std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::UnexpectedEof
            ),
            "{err}"
        );
    }
}
