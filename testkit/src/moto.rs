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
    /// Starts `moto_server` on 127.0.0.1 and waits (up to a minute) until it accepts connections.
    pub fn start() -> std::io::Result<Moto> {
        let addr = TcpListener::bind("127.0.0.1:0")?.local_addr()?;
        let mut child = Command::new("moto_server")
            .args(["-H", "127.0.0.1", "-p", &addr.port().to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| {
                std::io::Error::new(
                    e.kind(),
                    format!("moto_server: {e}; install it with pip install 'moto[server]' (.ci/run does)"),
                )
            })?;
        let deadline = Instant::now() + Duration::from_secs(60);
        while TcpStream::connect(addr).is_err() {
            if let Some(status) = child.try_wait()? {
                return Err(std::io::Error::other(format!(
                    "moto_server exited: {status}"
                )));
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                return Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("moto_server did not come up on {addr}"),
                ));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(Moto { child, addr })
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
