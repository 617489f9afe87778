//! A `moto_server` process (PyPI `moto[server]`, installed by `.ci/run`) on a free loopback port.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running `moto_server`, killed on drop. It keeps everything in memory, so each test gets a
/// fresh, empty S3.
#[derive(Debug)]
pub struct Moto {
    child: Child,
    addr: SocketAddr,
}

impl Moto {
    /// Starts `moto_server` on a free port of 127.0.0.1 and waits (up to a minute) until it
    /// says it serves there. A free port found by binding port 0 can be taken by another
    /// process (another test's moto) before this one binds it: that one then fails and exits,
    /// while a connection to the port would still succeed, to the other server. So readiness is
    /// this child's own word ("Running on http://127.0.0.1:PORT" on its stderr), and a child
    /// that exits first is started again on another port, a few times.
    pub fn start() -> std::io::Result<Moto> {
        let mut last = None;
        for _ in 0..5 {
            match Self::start_once()? {
                Ok(moto) => return Ok(moto),
                Err(why) => last = Some(why),
            }
        }
        Err(std::io::Error::other(last.unwrap_or_default()))
    }

    /// One try: the server, or why it did not come up (`Err` of the outer result: it could
    /// not be started at all).
    fn start_once() -> std::io::Result<Result<Moto, String>> {
        use std::io::BufRead;
        let addr = TcpListener::bind("127.0.0.1:0")?.local_addr()?;
        let mut child = Command::new("moto_server")
            .args(["-H", "127.0.0.1", "-p", &addr.port().to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| {
                std::io::Error::new(
                    e.kind(),
                    format!("moto_server: {e}; install it with pip install 'moto[server]' (.ci/run does)"),
                )
            })?;
        // Its stderr is read to its end (a request log line each), so it never blocks on it;
        // the line saying where it serves is passed on.
        let stderr = child.stderr.take().expect("piped");
        let serving = format!("Running on http://{addr}");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                if line.contains(&serving) {
                    let _ = tx.send(());
                }
            }
        });
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut said = false;
        loop {
            said |= rx.recv_timeout(Duration::from_millis(50)).is_ok();
            if said && TcpStream::connect(addr).is_ok() {
                return Ok(Ok(Moto { child, addr }));
            }
            if let Some(status) = child.try_wait()? {
                return Ok(Err(format!("moto_server on {addr} exited: {status}")));
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                return Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("moto_server did not come up on {addr}"),
                ));
            }
        }
    }

    /// Where it listens.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Its endpoint URL, for `AWS_ENDPOINT_URL` or `--s3-endpoint`.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }
}

impl Drop for Moto {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
