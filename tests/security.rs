//! Security claims tested as an attacker would hold them: from another uid (65534, `nobody`),
//! through every path a process of that uid has (`/proc/self/fd`, `fchmod`, a socket bound
//! first), against a real `feedstored`. These tests need root to act as other uids; without it
//! they say so and pass vacuously (CI runs as root).

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use feedstore_consumer::{ConnectOptions, Error, Role, Status, StreamFeeder};
use feedstore_proto::frame::{Request, Response};
use feedstore_proto::stream::{Shuffle, StreamSpec, Tail};

const LIMIT: Duration = Duration::from_secs(120);
const NOBODY: u32 = 65534;
const NOGROUP: u32 = 65534;

fn spec() -> StreamSpec {
    StreamSpec {
        name: "security".into(),
        records: 4,
        seed: 0,
        world: 1,
        shuffle: Shuffle::None,
        tail: Tail::Drop,
        epochs: Some(1),
        reshard: None,
    }
}

/// What each way of getting write access to a descriptor's memory gave.
fn write_attempts(fd: &OwnedFd, len: usize) -> String {
    let raw = fd.as_raw_fd();
    // SAFETY: a fresh mapping request over a descriptor this process owns; on success the
    // mapping is unmapped at once and never touched.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            raw,
            0,
        )
    };
    let mmap = if p == libc::MAP_FAILED {
        errno_name()
    } else {
        // SAFETY: unmapping the mapping made just above.
        unsafe { libc::munmap(p, len) };
        "MAPPED".into()
    };
    let reopen = match std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(format!("/proc/self/fd/{raw}"))
    {
        Ok(_) => "OPENED".into(),
        Err(e) => name_of(&e),
    };
    let chmod = match nix::sys::stat::fchmod(fd, nix::sys::stat::Mode::from_bits_truncate(0o666)) {
        Ok(()) => "CHANGED".into(),
        Err(e) => name_of(&e.into()),
    };
    format!("mmap={mmap} reopen={reopen} chmod={chmod}")
}

fn errno_name() -> String {
    name_of(&std::io::Error::last_os_error())
}

fn name_of(e: &std::io::Error) -> String {
    match e.raw_os_error() {
        Some(libc::EACCES) => "EACCES".into(),
        Some(libc::EPERM) => "EPERM".into(),
        _ => format!("{e}"),
    }
}

#[test]
#[ignore = "child-process entry point, run by the tests below"]
fn child_process() {
    let Ok(task) = std::env::var(CHILD_ENV) else {
        return;
    };
    let socket = || std::path::PathBuf::from(std::env::var("FEEDSTORE_SOCKET").unwrap());
    let say = |s: String| {
        println!("READY {s}");
        std::io::stdout().flush().unwrap();
    };
    let mut words = task.split_whitespace();
    match words.next() {
        Some("connect") => match feedstore_consumer::Client::connect_reader() {
            Ok(c) => say(format!("ok {}", c.stats().unwrap().clients)),
            Err(e) => say(format!("err {e}")),
        },
        Some("connect-writer") => match feedstore_consumer::Client::connect_writer() {
            Ok(c) => say(format!("ok {}", c.stats().unwrap().clients)),
            Err(e) => say(format!("err {e}")),
        },
        // A reader of another uid tries every way to write the store's memory: a writable
        // mapping, reopening its own descriptor read-write, making the memfd writable.
        Some("write-attempts") => {
            // A stream of this uid, so its reader gets a ring too.
            let writer = feedstore_consumer::Client::connect_writer().unwrap();
            let _feeder = StreamFeeder::join(&writer, &spec(), 4, &[]).unwrap();
            let (mut raw, response, fds) = RawClient::hello(&socket(), Role::Reader, "attacker");
            let Response::Hello { segments, .. } = response else {
                panic!("{response:?}")
            };
            let segment = write_attempts(&fds[0], segments[0].size_bytes as usize);
            let (response, ring_fds) = raw.call_with_fds(&Request::StreamAttach {
                spec: spec(),
                rank: 0,
                seq: 0,
                timeout_ms: 10_000,
            });
            let Response::StreamAttached { ring_bytes, .. } = response else {
                panic!("{response:?}")
            };
            let ring = write_attempts(&ring_fds[0], ring_bytes as usize);
            say(format!("segment: {segment}; ring: {ring}"));
        }
        // Binds the socket path first and records what connecting clients send it.
        Some("impostor") => {
            let path = words.next().unwrap();
            let listener = std::os::unix::net::UnixListener::bind(path).unwrap();
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666)).unwrap();
            listener.set_nonblocking(true).unwrap();
            say("bound".into());
            // One line per connection: the bytes it received. Ends after one that sent some.
            let deadline = Instant::now() + Duration::from_secs(20);
            while Instant::now() < deadline {
                let Ok((mut s, _)) = listener.accept() else {
                    std::thread::sleep(Duration::from_millis(5));
                    continue;
                };
                s.set_nonblocking(false).unwrap();
                s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
                let (mut got, mut buf) = (0, [0u8; 4096]);
                while let Ok(n @ 1..) = s.read(&mut buf) {
                    got += n;
                }
                println!("GOT {got}");
                std::io::stdout().flush().unwrap();
                if got > 0 {
                    break;
                }
            }
        }
        // Files its own object, and the victim's, under the key the victim filed its sample
        // at, and under a key the victim has not used yet; says what each step got.
        Some("cache-plant") => {
            let key: u128 = words.next().unwrap().parse().unwrap();
            let victims: feedstore_consumer::Handle = words.next().unwrap().parse().unwrap();
            let filed = match feedstore_consumer::Client::connect_writer() {
                Ok(c) => {
                    let forged = c.put(&pattern(9, 4096)).unwrap();
                    let statuses = c
                        .cache_insert(&[(key, forged), (key + 1, forged), (key + 2, victims)])
                        .unwrap();
                    let mine = c.cache_lookup(&[key]).unwrap()[0] == Some(forged);
                    format!("{statuses:?} finds its own: {mine}")
                }
                Err(e) => format!("err {e}"),
            };
            let reader = feedstore_consumer::Client::connect_reader().unwrap();
            match reader.cache_insert(&[(key, victims)]) {
                Ok(s) => say(format!("{filed}; as a reader: {s:?}")),
                Err(e) => say(format!("{filed}; as a reader: err {e}")),
            }
        }
        // Leases every object named in a file (as a reader that learnt or guessed every handle
        // would), says how many it holds, and holds them until its stdin closes.
        Some("pin") => {
            let list = std::fs::read_to_string(words.next().unwrap()).unwrap();
            let handles: Vec<feedstore_consumer::Handle> =
                list.lines().map(|l| l.parse().unwrap()).collect();
            let reader = feedstore_consumer::Client::connect_reader().unwrap();
            let results = reader.get_batch(&handles).unwrap();
            let held = results.iter().filter(|r| r.is_ok()).count();
            let refused: Vec<String> = results
                .iter()
                .filter_map(|r| r.as_ref().err().map(ToString::to_string))
                .collect();
            say(format!(
                "held {held} refused {}: {}",
                refused.len(),
                refused.first().cloned().unwrap_or_default()
            ));
            let _ = std::io::stdin().read_to_end(&mut Vec::new());
            drop(results);
        }
        other => panic!("unknown child task {other:?}"),
    }
}

fn skip_unless_root(test: &str) -> bool {
    if !is_root() {
        eprintln!("SKIPPED {test}: needs root to act as another uid");
        return true;
    }
    false
}

/// A scratch directory other uids can enter (the test's own are 0700 under a root umask).
fn open_dir(test: &str) -> std::path::PathBuf {
    let dir = scratch_dir(test);
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    dir
}

/// Finding: a reader allowed with `--allow-uid` could not map its descriptor writable, but
/// could reopen it read-write through `/proc/self/fd/N` (the memfd kept mode 0777) and overwrite
/// a sealed object another reader then read.
#[test]
fn a_reader_of_another_uid_cannot_write_by_any_path() {
    let _w = watchdog("a_reader_of_another_uid_cannot_write_by_any_path", LIMIT);
    if skip_unless_root("a_reader_of_another_uid_cannot_write_by_any_path") {
        return;
    }
    let dir = open_dir("ro-paths");
    let daemon = DaemonProcess::start(&dir, &["--allow-uid", "65534"]);
    let writer = daemon.writer();
    let h = writer.put(&pattern(7, 4096)).unwrap();

    let mut cmd = child_command(&daemon.socket, "write-attempts");
    run_as(&mut cmd, NOBODY, NOGROUP, &[]);
    let said = child_says(&mut cmd);
    assert_eq!(
        said,
        "segment: mmap=EACCES reopen=EACCES chmod=EPERM; ring: mmap=EACCES reopen=EACCES chmod=EPERM",
        "every path to write access is closed"
    );
    assert_eq!(&*daemon.reader().get(h).unwrap(), &pattern(7, 4096)[..]);
}

/// Finding: the default socket lived in world-writable `/tmp` and clients never checked who
/// answered: an impostor run as `nobody` bound the path first, received a root writer's data and
/// fed a root reader its own bytes. Clients now refuse a socket served by an untrusted uid
/// before sending a byte.
#[test]
fn clients_refuse_a_socket_another_user_bound_first() {
    let _w = watchdog("clients_refuse_a_socket_another_user_bound_first", LIMIT);
    if skip_unless_root("clients_refuse_a_socket_another_user_bound_first") {
        return;
    }
    let dir = scratch_dir("impostor");
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
    let path = dir.join("feedstore.sock");
    let mut cmd = child_command(&path, &format!("impostor {}", path.display()));
    run_as(&mut cmd, NOBODY, NOGROUP, &[]);
    let mut impostor = cmd.spawn().unwrap();
    let mut out = BufReader::new(impostor.stdout.take().unwrap());
    let mut line = String::new();
    while !line.contains("READY") {
        line.clear();
        assert!(
            out.read_line(&mut line).unwrap() > 0,
            "impostor did not start"
        );
    }
    for role in [Role::Writer, Role::Reader] {
        let err = ConnectOptions::new(role)
            .socket(&path)
            .hello_timeout(Duration::from_millis(500))
            .connect()
            .unwrap_err();
        assert!(
            matches!(&err, Error::UntrustedDaemon { uid: NOBODY, .. }),
            "{role:?}: {err}"
        );
        assert!(err.to_string().contains("FEEDSTORE_DAEMON_UID"), "{err}");
    }
    // Trusting that uid explicitly lets the hello through (the impostor sees bytes, then the
    // client gives up on it): the check above is what kept it out.
    let err = ConnectOptions::new(Role::Writer)
        .socket(&path)
        .daemon_uid(NOBODY)
        .hello_timeout(Duration::from_millis(500))
        .connect()
        .unwrap_err();
    assert!(matches!(err, Error::Timeout(_)), "{err}");
    let mut got = Vec::new();
    for line in out.lines() {
        if let Some(n) = line.unwrap().strip_prefix("GOT ") {
            got.push(n.parse::<usize>().unwrap());
        }
    }
    assert_eq!(got.len(), 3, "three connections: {got:?}");
    assert_eq!(got[..2], [0, 0], "the refused clients sent nothing");
    assert!(got[2] > 0, "the trusting client sent its hello");
    let _ = impostor.kill();
    let _ = impostor.wait();
}

/// The daemon's default socket is in a directory only its user can write, and it refuses a
/// directory another user prepared.
#[test]
fn the_default_socket_lives_in_a_private_directory() {
    let _w = watchdog("the_default_socket_lives_in_a_private_directory", LIMIT);
    if skip_unless_root("the_default_socket_lives_in_a_private_directory") {
        return;
    }
    let dir = open_dir("default-socket");
    let runtime = dir.join("run");
    std::fs::create_dir(&runtime).unwrap();
    nix::unistd::chown(&runtime, Some(NOBODY.into()), Some(NOGROUP.into())).unwrap();
    std::fs::set_permissions(&runtime, std::fs::Permissions::from_mode(0o700)).unwrap();
    let start = |runtime: &Path| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_feedstored"));
        cmd.args([
            "--capacity",
            "16MiB",
            "--prefault",
            "false",
            "--huge-pages",
            "off",
        ])
        .env_remove("FEEDSTORE_SOCKET")
        .env("XDG_RUNTIME_DIR", runtime)
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
        run_as(&mut cmd, NOBODY, NOGROUP, &[]);
        KillOnDrop(cmd.spawn().unwrap())
    };
    let mut daemon = start(&runtime);
    let socket = runtime.join("feedstore/feedstore.sock");
    let deadline = Instant::now() + Duration::from_secs(20);
    while !socket.exists() {
        assert!(daemon.0.try_wait().unwrap().is_none(), "feedstored exited");
        assert!(
            Instant::now() < deadline,
            "no socket at {}",
            socket.display()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let meta = std::fs::metadata(socket.parent().unwrap()).unwrap();
    assert_eq!((meta.uid(), meta.mode() & 0o7777), (NOBODY, 0o700));
    assert_eq!(std::fs::metadata(&socket).unwrap().mode() & 0o777, 0o600);
    // A client of that user finds it by default.
    let mut cmd = child_command(&socket, "connect");
    cmd.env_remove("FEEDSTORE_SOCKET")
        .env("XDG_RUNTIME_DIR", &runtime);
    run_as(&mut cmd, NOBODY, NOGROUP, &[]);
    assert!(child_says(&mut cmd).starts_with("ok"));
    drop(daemon);

    // Another user (65533) prepared the directory, writable by all: the daemon refuses it.
    let trap = dir.join("trap");
    std::fs::create_dir_all(trap.join("feedstore")).unwrap();
    nix::unistd::chown(&trap, Some(NOBODY.into()), Some(NOGROUP.into())).unwrap();
    nix::unistd::chown(&trap.join("feedstore"), Some(65533.into()), None).unwrap();
    std::fs::set_permissions(
        trap.join("feedstore"),
        std::fs::Permissions::from_mode(0o777),
    )
    .unwrap();
    let mut refused = start(&trap);
    let status = refused.0.wait().unwrap();
    let mut err = String::new();
    std::io::Read::read_to_string(&mut refused.0.stderr.take().unwrap(), &mut err).unwrap();
    assert!(!status.success());
    assert!(
        err.contains("refusing socket directory") && err.contains("uid 65533"),
        "{err}"
    );
}

/// Finding: `--socket-group` admitted only peers whose primary gid was the group; a member
/// through a supplementary group was refused.
#[test]
fn socket_group_members_connect_through_supplementary_groups() {
    let _w = watchdog(
        "socket_group_members_connect_through_supplementary_groups",
        LIMIT,
    );
    if skip_unless_root("socket_group_members_connect_through_supplementary_groups") {
        return;
    }
    let dir = open_dir("groups");
    let daemon = DaemonProcess::start(&dir, &["--socket-group", "nogroup"]);
    assert_eq!(
        std::fs::metadata(&daemon.socket).unwrap().mode() & 0o777,
        0o660
    );
    let connect = |gid: u32, groups: &[u32]| {
        let mut cmd = child_command(&daemon.socket, "connect");
        run_as(&mut cmd, NOBODY, gid, groups);
        child_says(&mut cmd)
    };
    assert!(connect(NOGROUP, &[]).starts_with("ok"), "primary group");
    assert!(
        connect(1000, &[NOGROUP]).starts_with("ok"),
        "supplementary group"
    );
    let outsider = connect(1000, &[]);
    assert!(
        outsider.starts_with("err cannot connect"),
        "not a member: {outsider}"
    );
}

/// The decode-once cache is per uid: another uid allowed as a writer files its own objects in
/// its own part (one key each), never this user's objects, and a trainer of this uid never
/// finds what it filed (a planted sample would be read as this user's data); a reader files
/// nothing. (What keeps an allowed writer from changing the bytes of this user's sealed
/// objects is the daemon's trust in its writers, not the cache.)
#[test]
fn another_uid_cannot_plant_samples_in_a_users_cache() {
    let _w = watchdog("another_uid_cannot_plant_samples_in_a_users_cache", LIMIT);
    if skip_unless_root("another_uid_cannot_plant_samples_in_a_users_cache") {
        return;
    }
    let dir = open_dir("cache-plant");
    let daemon = DaemonProcess::start(&dir, &["--allow-uid", "65534"]);
    let victim = daemon.writer();
    let sample = victim.put(&pattern(7, 4096)).unwrap();
    let key = 0x5eed_u128 << 64;
    assert_eq!(
        victim.cache_insert(&[(key, sample)]).unwrap(),
        vec![Status::Ok]
    );
    let mut cmd = child_command(&daemon.socket, &format!("cache-plant {key} {sample}"));
    run_as(&mut cmd, NOBODY, NOGROUP, &[]);
    let said = child_says(&mut cmd);
    assert_eq!(
        said,
        "[Ok, InUse, NotOwner] finds its own: true; as a reader: err permission denied: only \
         writers file samples in the cache",
        "the attacker's own part only"
    );
    assert_eq!(
        victim.cache_lookup(&[key, key + 1, key + 2]).unwrap(),
        vec![Some(sample), None, None],
        "the victim finds its own sample, and nothing the attacker filed"
    );
    assert_eq!(
        &*daemon.reader().get(sample).unwrap(),
        &pattern(7, 4096)[..]
    );
}

/// A uid allowed as a reader only cannot become a writer by saying so at hello.
#[test]
fn reader_only_uids_cannot_connect_as_writers() {
    let _w = watchdog("reader_only_uids_cannot_connect_as_writers", LIMIT);
    if skip_unless_root("reader_only_uids_cannot_connect_as_writers") {
        return;
    }
    let dir = open_dir("reader-only");
    let daemon = DaemonProcess::start(&dir, &["--allow-reader-uid", "65534"]);
    let connect = |task: &str| {
        let mut cmd = child_command(&daemon.socket, task);
        run_as(&mut cmd, NOBODY, NOGROUP, &[]);
        child_says(&mut cmd)
    };
    assert!(connect("connect").starts_with("ok"), "as a reader");
    let said = connect("connect-writer");
    assert!(
        said.starts_with("err permission denied") && said.contains("may only read"),
        "{said}"
    );
}

/// A uid the daemon does not allow is refused at hello even where the socket's mode lets it
/// connect, with a reason on both sides.
#[test]
fn uids_not_allowed_are_refused_at_hello() {
    let _w = watchdog("uids_not_allowed_are_refused_at_hello", LIMIT);
    if skip_unless_root("uids_not_allowed_are_refused_at_hello") {
        return;
    }
    let dir = open_dir("uids");
    // Another uid is allowed, so the socket is 0666 and any local process can connect to it.
    let daemon = DaemonProcess::start(&dir, &["--allow-uid", "12345"]);
    assert_eq!(
        std::fs::metadata(&daemon.socket).unwrap().mode() & 0o777,
        0o666
    );
    let mut cmd = child_command(&daemon.socket, "connect");
    run_as(&mut cmd, NOBODY, NOGROUP, &[]);
    let said = child_says(&mut cmd);
    assert!(
        said.starts_with("err permission denied") && said.contains("uid 65534"),
        "{said}"
    );
    assert!(daemon.log_text().contains("not allowed"));
}

/// Finding: a uid allowed only to read could lease every object it could name (handles were a
/// count then), deleted ones included, and root's next large reserve failed with `Full`. Now a
/// reader-only uid holds at most its share of the store (`--reader-lease-percent`, 25% by
/// default) and the writers' creates evict the rest.
#[test]
fn a_reader_uid_holding_every_lease_it_can_does_not_block_roots_reserve() {
    let _w = watchdog("a_reader_uid_holding_every_lease", LIMIT);
    if skip_unless_root("a_reader_uid_holding_every_lease") {
        return;
    }
    let dir = open_dir("pin");
    let daemon = DaemonProcess::start(
        &dir,
        &["--capacity", "64MiB", "--allow-reader-uid", "65534"],
    );
    let root = daemon.writer();
    let handles: Vec<_> = (0..15)
        .map(|i| root.put(&pattern(i, 4 << 20)).unwrap())
        .collect();
    let list = dir.join("handles");
    let text: String = handles.iter().map(|h| format!("{h}\n")).collect();
    std::fs::write(&list, text).unwrap();
    std::fs::set_permissions(&list, std::fs::Permissions::from_mode(0o644)).unwrap();
    let mut cmd = child_command(&daemon.socket, &format!("pin {}", list.display()));
    cmd.stdin(Stdio::piped());
    run_as(&mut cmd, NOBODY, NOGROUP, &[]);
    let mut child = KillOnDrop(cmd.spawn().unwrap());
    let mut out = BufReader::new(child.0.stdout.take().unwrap());
    let mut line = String::new();
    while !line.contains("READY") {
        line.clear();
        assert!(out.read_line(&mut line).unwrap() > 0, "the reader exited");
    }
    // 16 MiB of 64: four objects of 4 MiB; the other eleven refused, saying why.
    assert!(line.contains("held 4 refused 11"), "{line}");
    assert!(line.contains("reader-lease-percent"), "{line}");
    let s = root.stats().unwrap();
    assert_eq!(s.lease_share_refusals, 11);
    // Root reserves 40 MiB at once: the objects the reader does not hold are evicted.
    let big = root
        .create(40 << 20)
        .expect("root's reserve is not blocked by the reader's leases");
    drop(big);
    drop(child.0.stdin.take());
    let _ = child.0.wait();
}
