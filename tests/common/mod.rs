//! Harness for the end-to-end tests: a real `feedstored` process per test, real client processes
//! (this test binary re-executed in a child role), deadlines instead of sleeps, and a watchdog so
//! a deadlock fails the run instead of hanging it.

#![allow(dead_code)]

pub mod netns;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use feedstore_consumer::{Client, ConnectOptions, Role, StoreStats};

/// A fresh directory for one test.
pub fn scratch_dir(test: &str) -> PathBuf {
    static N: AtomicU32 = AtomicU32::new(0);
    static CLEAN_AT_EXIT: std::sync::Once = std::sync::Once::new();
    CLEAN_AT_EXIT.call_once(|| {
        // SAFETY: registers a plain function that lives for the whole process.
        unsafe { libc::atexit(remove_scratch_dirs) };
    });
    let dir = std::env::temp_dir().join(format!(
        "feedstore-test-{}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed),
        test
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// At exit, removes the scratch directories this process made (their daemons are gone by
/// then: each is killed when its test ends), unless `FEEDSTORE_KEEP_TEST_DIRS` is set (to read
/// a failed test's logs).
extern "C" fn remove_scratch_dirs() {
    if std::env::var_os("FEEDSTORE_KEEP_TEST_DIRS").is_some() {
        return;
    }
    let prefix = format!("feedstore-test-{}-", std::process::id());
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for entry in entries.flatten() {
        if entry.file_name().to_string_lossy().starts_with(&prefix) {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

/// A `feedstored` child process, killed on drop.
pub struct DaemonProcess {
    pub child: Child,
    pub socket: PathBuf,
    pub log: PathBuf,
}

impl DaemonProcess {
    /// Starts `feedstored` on a socket in `dir` with extra flags, and waits until it answers.
    pub fn start(dir: &Path, extra: &[&str]) -> DaemonProcess {
        DaemonProcess::start_named(dir, "feedstored", &[], extra)
    }

    /// Starts `feedstored` with its socket and log named `name` in `dir`, run through `prefix`
    /// (`ip netns exec NS`, say) when it is not empty.
    pub fn start_named(dir: &Path, name: &str, prefix: &[&str], extra: &[&str]) -> DaemonProcess {
        let socket = dir.join(format!("{name}.sock"));
        // One log per start (a daemon started again, or taking over, keeps its predecessor's).
        static STARTS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let log = dir.join(format!(
            "{name}-{}.log",
            STARTS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ));
        let mut cmd = match prefix.split_first() {
            Some((program, args)) => {
                let mut cmd = Command::new(program);
                cmd.args(args).arg(env!("CARGO_BIN_EXE_feedstored"));
                cmd
            }
            None => Command::new(env!("CARGO_BIN_EXE_feedstored")),
        };
        cmd.arg("--socket").arg(&socket);
        if !extra.contains(&"--capacity") {
            cmd.args(["--capacity", "64MiB"]);
        }
        cmd.args(extra);
        cmd.env("FEEDSTORE_LOG", "debug");
        cmd.stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap());
        let child = cmd.spawn().expect("spawning feedstored");
        let mut d = DaemonProcess { child, socket, log };
        if let Err(e) = d.wait_ready() {
            panic!("{e}");
        }
        d
    }

    /// Starts `feedstored` named `name` in `dir` listening for peers on a free port of
    /// 127.0.0.1, with the flags `args` makes of that address; returns it and the address. A
    /// port another test took between being found free and the daemon binding it is tried
    /// again with another.
    pub fn start_listening(
        dir: &Path,
        name: &str,
        args: impl Fn(&str) -> Vec<String>,
    ) -> (DaemonProcess, String) {
        for _ in 0..10 {
            let addr = format!("127.0.0.1:{}", free_port());
            let mut flags = vec!["--listen".to_owned(), addr.clone()];
            flags.extend(args(&addr));
            let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
            let socket = dir.join(format!("{name}.sock"));
            let log = dir.join(format!("{name}-{}.log", std::process::id()));
            let child = Command::new(env!("CARGO_BIN_EXE_feedstored"))
                .arg("--socket")
                .arg(&socket)
                .args(&flags)
                .env("FEEDSTORE_LOG", "debug")
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(&log).unwrap())
                .spawn()
                .expect("spawning feedstored");
            let mut d = DaemonProcess { child, socket, log };
            match d.wait_ready() {
                Ok(()) => return (d, addr),
                Err(e) if e.contains("Address already in use") => continue,
                Err(e) => panic!("{e}"),
            }
        }
        panic!("no free port for {name} after 10 tries");
    }

    /// Starts `feedstored --takeover` with the same socket (and `extra` flags) in place of
    /// this daemon, and waits until this one exited (successfully) and the successor serves.
    pub fn take_over(self, dir: &Path, extra: &[&str]) -> DaemonProcess {
        self.take_over_via(dir, &[], extra)
    }

    /// [`DaemonProcess::take_over`], the successor run through `prefix` (`ip netns exec NS`).
    pub fn take_over_via(mut self, dir: &Path, prefix: &[&str], extra: &[&str]) -> DaemonProcess {
        let mut flags = vec!["--takeover"];
        flags.extend_from_slice(extra);
        let name = self
            .socket
            .file_stem()
            .and_then(|s| s.to_str())
            .unwrap_or("feedstored")
            .to_owned();
        let successor = DaemonProcess::start_named(dir, &name, prefix, &flags);
        let status = wait_child(&mut self.child, Duration::from_secs(60));
        assert!(
            status.success(),
            "the daemon taken over exits cleanly ({status}):\n{}",
            self.log_text()
        );
        successor
    }

    fn wait_ready(&mut self) -> Result<(), String> {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return Err(format!(
                    "feedstored exited early with {status}:\n{}",
                    self.log_text()
                ));
            }
            if std::os::unix::net::UnixStream::connect(&self.socket).is_ok() {
                return Ok(());
            }
            assert!(
                Instant::now() < deadline,
                "feedstored did not come up:\n{}",
                self.log_text()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn writer(&self) -> Client {
        connect(&self.socket, Role::Writer)
    }

    pub fn reader(&self) -> Client {
        connect(&self.socket, Role::Reader)
    }

    /// Sends a signal and waits for the exit status.
    pub fn signal_and_wait(
        &mut self,
        signal: nix::sys::signal::Signal,
    ) -> std::process::ExitStatus {
        let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        nix::sys::signal::kill(pid, signal).unwrap();
        wait_child(&mut self.child, Duration::from_secs(20))
    }
}

impl Drop for DaemonProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!(
                "--- feedstored log ({}) ---\n{}",
                self.log.display(),
                self.log_text()
            );
        }
    }
}

pub fn connect(socket: &Path, role: Role) -> Client {
    ConnectOptions::new(role)
        .socket(socket)
        .create_timeout(Duration::from_millis(200))
        .connect()
        .expect("connecting to feedstored")
}

pub fn wait_child(child: &mut Child, limit: Duration) -> std::process::ExitStatus {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        assert!(
            Instant::now() < deadline,
            "child {} did not exit",
            child.id()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Polls the daemon's stats until `pred` holds, or fails after 20 s with the last snapshot.
pub fn wait_for_stats(
    client: &Client,
    what: &str,
    pred: impl Fn(&StoreStats) -> bool,
) -> StoreStats {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let s = client.stats().unwrap();
        if pred(&s) {
            return s;
        }
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {what}; last stats {s:#?}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A client process: this test binary re-run as the ignored `child_process` test, told what to
/// do through the environment. It prints `READY <detail>` once in position and then waits to be
/// killed.
pub struct ClientProcess {
    pub child: Child,
    stdout: Option<BufReader<ChildStdout>>,
}

pub const CHILD_ENV: &str = "FEEDSTORE_TEST_CHILD";

impl ClientProcess {
    pub fn spawn(socket: &Path, role_args: &str) -> ClientProcess {
        ClientProcess::spawn_with(socket, role_args, &[])
    }

    /// [`ClientProcess::spawn`] with more environment variables.
    pub fn spawn_with(socket: &Path, role_args: &str, env: &[(&str, &str)]) -> ClientProcess {
        let cmd = Command::new(std::env::current_exe().unwrap());
        ClientProcess::run(cmd, socket, role_args, env, Stdio::inherit())
    }

    /// [`ClientProcess::spawn_with`] run through `prefix` (`unshare --pid --fork`, say), its
    /// standard input a pipe the test writes lines to ([`ClientProcess::tell`]).
    pub fn spawn_via(
        prefix: &[&str],
        socket: &Path,
        role_args: &str,
        env: &[(&str, &str)],
    ) -> ClientProcess {
        let (program, args) = prefix.split_first().expect("a prefix");
        let mut cmd = Command::new(program);
        cmd.args(args).arg(std::env::current_exe().unwrap());
        ClientProcess::run(cmd, socket, role_args, env, Stdio::piped())
    }

    /// Runs `cmd` (this test binary, maybe behind a prefix) as the child entry point.
    fn run(
        mut cmd: Command,
        socket: &Path,
        role_args: &str,
        env: &[(&str, &str)],
        stdin: Stdio,
    ) -> ClientProcess {
        let mut child = cmd
            .args([
                "--ignored",
                "--exact",
                "child_process",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD_ENV, role_args)
            .env("FEEDSTORE_SOCKET", socket)
            .envs(env.iter().copied())
            .stdin(stdin)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let stdout = Some(BufReader::new(child.stdout.take().unwrap()));
        ClientProcess { child, stdout }
    }

    /// Waits until the child exits successfully and returns the sum of the numbers it printed
    /// after `reattached ` (a stream's consumer says how often it attached again).
    pub fn finish_reattached(&mut self, limit: Duration) -> u64 {
        let status = wait_child(&mut self.child, limit);
        assert!(status.success(), "a process failed: {status}");
        self.take_stdout()
            .lines()
            .filter_map(|line| {
                line.unwrap()
                    .strip_prefix("reattached ")
                    .map(|n| n.parse::<u64>().unwrap())
            })
            .sum()
    }

    /// Writes a line to the child's standard input ([`ClientProcess::spawn_via`]).
    pub fn tell(&mut self, line: &str) {
        use std::io::Write;
        let stdin = self.child.stdin.as_mut().expect("spawned with a pipe");
        writeln!(stdin, "{line}").unwrap();
        stdin.flush().unwrap();
    }

    /// Waits for the child's `READY` line and returns what follows it.
    pub fn ready(&mut self) -> String {
        let mut line = String::new();
        loop {
            line.clear();
            let n = self
                .stdout
                .as_mut()
                .expect("stdout not handed over")
                .read_line(&mut line)
                .unwrap();
            assert!(n > 0, "client process exited before it was ready");
            // libtest may print its own "test child_process ... " before the child's line.
            if let Some(at) = line.find("READY") {
                return line[at + "READY".len()..].trim().to_owned();
            }
        }
    }

    /// Hands over the child's remaining output (after `READY`).
    pub fn take_stdout(&mut self) -> BufReader<ChildStdout> {
        self.stdout.take().expect("stdout handed over once")
    }

    pub fn kill9(mut self) {
        let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL).unwrap();
        let status = wait_child(&mut self.child, Duration::from_secs(20));
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(status.signal(), Some(libc::SIGKILL));
    }
}

/// Aborts the whole test process if a test runs longer than `limit` (a deadlock must fail CI,
/// not hang it). Dropping the guard disarms it.
pub struct Watchdog {
    _disarm: std::sync::mpsc::Sender<()>,
}

pub fn watchdog(test: &'static str, limit: Duration) -> Watchdog {
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    std::thread::spawn(move || {
        if let Err(std::sync::mpsc::RecvTimeoutError::Timeout) = rx.recv_timeout(limit) {
            eprintln!("watchdog: test {test} still running after {limit:?}; aborting");
            std::process::abort();
        }
    });
    Watchdog { _disarm: tx }
}

/// Fills `buf` (at least 16 bytes) with `[seed u64][len u64][pattern(seed)...]`, checkable
/// without knowing `seed`.
pub fn write_self_describing(buf: &mut [u8], seed: u64) {
    let len = buf.len();
    buf[..8].copy_from_slice(&seed.to_le_bytes());
    buf[8..16].copy_from_slice(&(len as u64).to_le_bytes());
    fill_pattern(&mut buf[16..], seed);
}

/// Whether `buf` is what [`write_self_describing`] wrote, every byte checked.
pub fn is_self_describing(buf: &[u8]) -> bool {
    if buf.len() < 16 {
        return false;
    }
    let seed = u64::from_le_bytes(buf[..8].try_into().unwrap());
    let len = u64::from_le_bytes(buf[8..16].try_into().unwrap()) as usize;
    len == buf.len() && pattern_matches(&buf[16..], seed)
}

/// Writes [`pattern`]`(seed, buf.len())` into `buf` without allocating.
pub fn fill_pattern(buf: &mut [u8], seed: u64) {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    for b in buf {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
}

/// Whether `buf` holds [`pattern`]`(seed, buf.len())`.
pub fn pattern_matches(buf: &[u8], seed: u64) -> bool {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    buf.iter().all(|&b| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        b == x as u8
    })
}

/// Writes objects of `each` bytes through `writer` until `total` bytes went in (a store full of
/// leased objects refuses some: skipped): every block nothing holds is evicted and written
/// again, so a view whose lease was lost would show other bytes.
pub fn churn(writer: &Client, total: u64, each: u64) {
    let mut written = 0;
    let mut seed = 0xC0FFEE;
    while written < total {
        seed += 1;
        if let Ok(mut w) = writer.create(each) {
            fill_pattern(w.as_mut_slice(), seed);
            w.seal().unwrap();
        }
        written += each;
    }
}

/// Deterministic bytes for object `seed`.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// A client speaking the protocol by hand, to do what the library never would (pipeline,
/// forge, hold descriptors) the way an attacker's program could.
/// A raw client after its hello: the client, the daemon's reply and the descriptors with it.
pub type Greeted = (
    RawClient,
    feedstore_proto::frame::Response,
    Vec<std::os::fd::OwnedFd>,
);

pub struct RawClient {
    pub stream: std::os::unix::net::UnixStream,
    next_id: u32,
    rbuf: Vec<u8>,
    /// The protocol version its frames are in (a client of an older release speaks its own).
    pub version: u16,
}

impl RawClient {
    /// Connects without saying hello.
    pub fn connect(socket: &Path) -> std::io::Result<RawClient> {
        let stream = std::os::unix::net::UnixStream::connect(socket)?;
        stream.set_read_timeout(Some(Duration::from_secs(30)))?;
        Ok(RawClient {
            stream,
            next_id: 1,
            rbuf: Vec::new(),
            version: feedstore_proto::frame::VERSION,
        })
    }

    /// Connects and says hello; returns the reply and the segment descriptors.
    pub fn hello(socket: &Path, role: Role, name: &str) -> Greeted {
        RawClient::hello_in(feedstore_proto::frame::VERSION, socket, role, name)
    }

    /// [`RawClient::hello`] as a client of protocol `version` says it (one before 11 says
    /// nothing of the versions it speaks), which its later frames are in too.
    pub fn hello_in(version: u16, socket: &Path, role: Role, name: &str) -> Greeted {
        let mut raw = RawClient::connect(socket).unwrap();
        raw.version = version;
        let (response, fds) = raw.call_with_fds(&feedstore_proto::frame::Request::Hello {
            role,
            client_name: name.into(),
            max_frame_bytes: feedstore_proto::frame::MAX_PAYLOAD_BYTES,
            speaks: feedstore_proto::frame::Speaks::ours(),
            reconnects: 0,
        });
        (raw, response, fds)
    }

    /// Sends a request without waiting for its reply.
    pub fn send(&mut self, request: &feedstore_proto::frame::Request) {
        self.try_send(request).unwrap();
    }

    /// Sends a request, reporting a socket error (the daemon closed the connection).
    pub fn try_send(&mut self, request: &feedstore_proto::frame::Request) -> std::io::Result<()> {
        let mut out = Vec::new();
        request
            .encode_in(self.version, self.next_id, u32::MAX, &mut out)
            .unwrap();
        self.next_id += 1;
        use std::io::Write;
        self.stream.write_all(&out)
    }

    /// Sends a request and reads its reply.
    pub fn call(
        &mut self,
        request: &feedstore_proto::frame::Request,
    ) -> feedstore_proto::frame::Response {
        self.call_with_fds(request).0
    }

    /// Sends a request and reads its reply with the descriptors that ride along.
    pub fn call_with_fds(
        &mut self,
        request: &feedstore_proto::frame::Request,
    ) -> (feedstore_proto::frame::Response, Vec<std::os::fd::OwnedFd>) {
        self.send(request);
        self.read_reply()
    }

    /// Reads the next reply frame and any descriptors.
    pub fn read_reply(&mut self) -> (feedstore_proto::frame::Response, Vec<std::os::fd::OwnedFd>) {
        use feedstore_proto::frame::{Frame, Response};
        use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
        let mut fds = Vec::new();
        loop {
            if let Some(frame) = Frame::parse(&self.rbuf, u32::MAX).unwrap() {
                assert_eq!(
                    frame.header.version, self.version,
                    "a reply in the client's protocol version"
                );
                let len = frame.len();
                let response = Response::decode(&frame).unwrap();
                self.rbuf.drain(..len);
                return (response, fds);
            }
            let mut buf = vec![0u8; 64 << 10];
            let mut cmsg = nix::cmsg_space!([RawFd; 253]);
            let mut iov = [std::io::IoSliceMut::new(&mut buf)];
            let msg = nix::sys::socket::recvmsg::<()>(
                self.stream.as_raw_fd(),
                &mut iov,
                Some(&mut cmsg),
                nix::sys::socket::MsgFlags::MSG_CMSG_CLOEXEC,
            )
            .unwrap();
            for c in msg.cmsgs().unwrap() {
                if let nix::sys::socket::ControlMessageOwned::ScmRights(raw) = c {
                    // SAFETY: received just now by SCM_RIGHTS; owned by nobody else.
                    fds.extend(
                        raw.into_iter()
                            .map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }),
                    );
                }
            }
            let n = msg.bytes;
            assert!(n > 0, "the daemon closed the connection");
            self.rbuf.extend_from_slice(&buf[..n]);
        }
    }

    /// Waits until the daemon closes the connection (an error reply may come first); panics if
    /// it does not within 30 s.
    pub fn expect_closed(&mut self) {
        use std::io::Read;
        let mut buf = [0u8; 4096];
        loop {
            match self.stream.read(&mut buf) {
                Ok(0) => return,
                Ok(_) => continue,
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return,
                Err(e) => panic!("the daemon did not close the connection: {e}"),
            }
        }
    }
}

/// Makes `cmd` run as `uid` with primary group `gid` and exactly `groups` as supplementary
/// groups (the test runs as root): how the security tests act as another local user.
pub fn run_as(cmd: &mut Command, uid: u32, gid: u32, groups: &[u32]) {
    use std::os::unix::process::CommandExt;
    let groups: Vec<nix::unistd::Gid> = groups
        .iter()
        .map(|&g| nix::unistd::Gid::from_raw(g))
        .collect();
    let drop_privileges = move || -> std::io::Result<()> {
        use nix::unistd::{Gid, Uid, setgid, setgroups, setuid};
        setgroups(&groups)?;
        setgid(Gid::from_raw(gid))?;
        setuid(Uid::from_raw(uid))?;
        Ok(())
    };
    // SAFETY: the closure makes only async-signal-safe system calls (setgroups, setgid, setuid)
    // between fork and exec, and allocates nothing (the group list was built before).
    unsafe { cmd.pre_exec(drop_privileges) };
}

/// A child process killed when this goes out of scope, a failing test's included.
pub struct KillOnDrop(pub Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Whether the tests run as root (the security tests need to act as other uids).
pub fn is_root() -> bool {
    nix::unistd::geteuid().is_root()
}

/// This test binary's ignored `child_process` entry, told what to do through `task`, as a
/// command to adjust (a uid, more environment) before it is run.
pub fn child_command(socket: &Path, task: &str) -> Command {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([
        "--ignored",
        "--exact",
        "child_process",
        "--nocapture",
        "--test-threads=1",
    ])
    .env(CHILD_ENV, task)
    .env("FEEDSTORE_SOCKET", socket)
    .stdout(Stdio::piped());
    cmd
}

/// Runs a child command to its end and returns the text after its `READY`.
pub fn child_says(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let at = text.find("READY").unwrap_or_else(|| {
        panic!(
            "child said: {text}\n{}",
            String::from_utf8_lossy(&out.stderr)
        )
    });
    text[at + "READY".len()..]
        .lines()
        .next()
        .unwrap_or_default()
        .trim()
        .to_owned()
}

/// `tmux` on a server of its own (`-L server`), without the user's configuration: a real
/// terminal for tests of what programs draw there.
pub fn tmux(server: &str, args: &[&str]) -> std::process::Output {
    Command::new("tmux")
        .args(["-L", server, "-f", "/dev/null"])
        .args(args)
        .output()
        .expect("tmux (./scripts/test installs it)")
}

/// The producer's test data: the committed tokenizer, chat goldens.
pub const PRODUCER_DATA: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/producer/tests/data");

/// The committed Qwen3 tokenizer, decompressed into `dir`.
pub fn tokenizer_file(dir: &Path) -> PathBuf {
    use std::io::Read;
    let gz = std::fs::read(format!("{PRODUCER_DATA}/qwen3-tokenizer.json.gz")).unwrap();
    let mut json = Vec::new();
    flate2::read::GzDecoder::new(&gz[..])
        .read_to_end(&mut json)
        .unwrap();
    let path = dir.join("tokenizer.json");
    std::fs::write(&path, json).unwrap();
    path
}

/// A small PNG of `width` × `height` black pixels.
pub fn png(width: u32, height: u32) -> Vec<u8> {
    let mut out = Vec::new();
    image::RgbImage::new(width, height)
        .write_to(&mut std::io::Cursor::new(&mut out), image::ImageFormat::Png)
        .unwrap();
    out
}

/// A LLaVA-style record with one image.
pub fn llava(id: &str, image: &str, turns: &serde_json::Value) -> String {
    serde_json::json!({"id": id, "image": image, "conversations": turns}).to_string()
}

/// `feedstore produce` against the daemon at `socket`, with a manifest and a tokenizer.
pub fn produce_command(socket: &Path, manifest: &Path, tokenizer: &Path) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_feedstore"));
    cmd.arg("produce")
        .arg("--socket")
        .arg(socket)
        .arg("--manifest")
        .arg(manifest)
        .arg("--tokenizer")
        .arg(tokenizer);
    cmd
}

/// `GET path` on 127.0.0.1:`port`: the status line and the body.
pub fn http_get(port: u16, path: &str) -> (String, String) {
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    std::io::Write::write_fmt(
        &mut stream,
        format_args!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"),
    )
    .unwrap();
    let mut reply = String::new();
    std::io::Read::read_to_string(&mut stream, &mut reply).unwrap();
    let (head, body) = reply.split_once("\r\n\r\n").unwrap_or((&reply, ""));
    (
        head.lines().next().unwrap_or("").to_owned(),
        body.to_owned(),
    )
}

/// A port free on 127.0.0.1 now (a daemon binds it right after).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}
