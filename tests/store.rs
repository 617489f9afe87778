//! End-to-end tests of the store core: a real `feedstored` process, real client processes, the
//! real socket and real shared memory.

mod common;

use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::time::Duration;

use common::*;
use feedstore_consumer::{ConnectOptions, CreateOptions, Error, Handle, Role};
use feedstore_proto::frame::{Request, Response};
use feedstore_shm::{Access, Mapping};
use feedstore_testkit::systemd::{FeedstoredUnit, ServiceManager};
use nix::sys::signal::Signal;

const LIMIT: Duration = Duration::from_secs(120);

/// Entry point of the client processes the crash tests spawn and kill; it does nothing unless
/// the parent set [`CHILD_ENV`].
#[test]
#[ignore = "child-process entry point, run by the crash tests"]
fn child_process() {
    let Ok(task) = std::env::var(CHILD_ENV) else {
        return;
    };
    let mut words = task.split_whitespace();
    let say = |s: String| {
        println!("READY {s}");
        std::io::stdout().flush().unwrap();
    };
    match words.next() {
        // Reserve an object, write half of it, never seal.
        Some("write-half") => {
            let size: u64 = words.next().unwrap().parse().unwrap();
            let client = feedstore_consumer::Client::connect_writer().unwrap();
            let mut w = client.create(size).unwrap();
            let half = w.len() / 2;
            w.as_mut_slice()[..half].fill(0xEE);
            say(w.handle().to_string());
            std::thread::sleep(Duration::from_secs(3600));
            drop(w);
        }
        // Lease every handle given (each several times) and hold the leases.
        Some("hold-leases") => {
            let client = feedstore_consumer::Client::connect_reader().unwrap();
            let leases = lease_three_times(&client, words);
            say(format!("{}", leases.len()));
            std::thread::sleep(Duration::from_secs(3600));
            drop(leases);
        }
        // Lease every handle given three times; once told (a line on standard input), return
        // the leases (through a new connection if the daemon changed) and say so; then wait
        // for another line before exiting.
        Some("hold-until-told") => {
            let client = feedstore_consumer::Client::connect_reader().unwrap();
            let leases = lease_three_times(&client, words);
            say(format!("{} {}", leases.len(), std::process::id()));
            let mut line = String::new();
            std::io::stdin().read_line(&mut line).unwrap();
            drop(leases);
            client.flush_releases();
            // (A call that goes through: the releases before it were sent.)
            client.stats().unwrap();
            say(format!("released after {} reconnects", client.reconnects()));
            line.clear();
            std::io::stdin().read_line(&mut line).unwrap();
        }
        // Put self-describing objects forever, printing each sealed handle; the parent kills
        // this process at a random moment, often mid-write.
        Some("put-loop") => {
            let seed: u64 = words.next().unwrap().parse().unwrap();
            let client = feedstore_consumer::Client::connect_writer().unwrap();
            let mut x = seed | 1;
            println!("READY");
            loop {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let len = 16 + (x % (256 << 10)) as usize;
                let Ok(mut w) = client.create(len as u64) else {
                    continue;
                };
                write_self_describing(w.as_mut_slice(), x);
                let h = w.seal().unwrap();
                println!("H {h}");
            }
        }
        other => panic!("unknown child task {other:?}"),
    }
}

#[test]
fn put_get_bytes_equal() {
    let _w = watchdog("put_get_bytes_equal", LIMIT);
    let dir = scratch_dir("put-get");
    let daemon = DaemonProcess::start(&dir, &[]);
    let writer = daemon.writer();
    let reader = daemon.reader();
    let sizes = [1usize, 63, 64, 65, 4095, 4096, 4097, 1 << 20, (4 << 20) + 3];
    let mut handles = Vec::new();
    for (i, &size) in sizes.iter().enumerate() {
        handles.push((writer.put(&pattern(i as u64, size)).unwrap(), i, size));
    }
    for &(h, i, size) in &handles {
        let lease = reader.get(h).unwrap();
        assert_eq!(lease.len(), size);
        assert!(
            *lease == pattern(i as u64, size)[..],
            "object {i} of {size} bytes differs"
        );
        assert!(
            reader.maps(lease.as_ptr()),
            "the view points into the shared mapping"
        );
        assert_eq!(
            lease.as_ptr() as usize % 64,
            0,
            "objects are 64-byte aligned"
        );
    }
    // Batched variants.
    let blobs: Vec<Vec<u8>> = (0..50)
        .map(|i| pattern(100 + i, 1000 + i as usize))
        .collect();
    let refs: Vec<&[u8]> = blobs.iter().map(Vec::as_slice).collect();
    let batch = writer.put_batch(&refs).unwrap();
    let leases = reader.get_batch(&batch).unwrap();
    for (lease, blob) in leases.iter().zip(&blobs) {
        assert_eq!(&**lease.as_ref().unwrap(), blob.as_slice());
    }
    let s = reader.stats().unwrap();
    assert_eq!(s.objects_sealed, (sizes.len() + blobs.len()) as u64);
    assert_eq!(s.leases, 50);
    // Dropped leases reach the daemon even if this client makes no further call (the release
    // flusher); observe through the other connection.
    drop(leases);
    wait_for_stats(&writer, "batch leases released", |s| s.leases == 0);
}

/// A put pipeline (the next reservation asked for before the copy, seals not waited for)
/// writes each object once and in order: its client's later requests are served after the
/// seals; another connection sees each object's bytes or "not sealed", never other bytes, and
/// every object after a flush; sizes may change from put to put; a full store fails a put as a
/// plain put fails; dropping the pipeline gives back the reservation it kept ready.
#[test]
fn put_pipeline_seals_in_order_and_gives_back_what_it_reserved() {
    let _w = watchdog("put_pipeline_seals_in_order", LIMIT);
    let dir = scratch_dir("put-pipeline");
    let daemon = DaemonProcess::start(&dir, &["--capacity", "8MiB"]);
    let writer = daemon.writer();
    let reader = daemon.reader();
    let sizes = [
        4096usize,
        4096,
        4096,
        1 << 20,
        1 << 20,
        100,
        100,
        4096,
        1,
        4096,
    ];
    let mut pipeline = writer.put_pipeline();
    let mut handles = Vec::new();
    for (i, &size) in sizes.iter().enumerate() {
        let h = pipeline.put(&pattern(i as u64, size)).unwrap();
        match reader.get(h) {
            Ok(lease) => assert!(*lease == pattern(i as u64, size)[..], "object {i}"),
            Err(Error::NotSealed { .. }) => {}
            Err(e) => panic!("object {i}: {e}"),
        }
        handles.push(h);
    }
    // Served after every seal this connection sent: all sealed, one reservation kept ready.
    let s = writer.stats().unwrap();
    assert_eq!(s.objects_sealed, sizes.len() as u64);
    assert_eq!(s.objects_writing, 1, "the next reservation, ready");
    pipeline.flush().unwrap();
    for (i, (&h, &size)) in handles.iter().zip(&sizes).enumerate() {
        assert!(
            *reader.get(h).unwrap() == pattern(i as u64, size)[..],
            "object {i}"
        );
    }
    drop(pipeline);
    let s = writer.stats().unwrap();
    assert_eq!(s.objects_writing, 0, "the kept reservation is given back");
    assert_eq!(s.objects_sealed, sizes.len() as u64);

    // A full store: everything leased, so nothing can be evicted. The reservation asked for
    // ahead fails at once; the put that needed it waits as a plain put does (the test client's
    // create timeout: 200 ms), then fails Full.
    let mut pipeline = writer.put_pipeline();
    let mut held = Vec::new();
    let err = loop {
        match pipeline.put(&pattern(7, 1 << 20)) {
            Ok(h) => {
                pipeline.flush().unwrap();
                held.push(reader.get(h).unwrap());
            }
            Err(e) => break e,
        }
        assert!(held.len() < 16, "an 8 MiB store held more than 16 MiB");
    };
    assert!(matches!(err, Error::Full { .. }), "{err}");
    // Only the put's own create counts as refused: the reservation asked for ahead is not.
    assert_eq!(writer.stats().unwrap().creates_full, 1);
    drop(pipeline);
    drop(held);
    wait_for_stats(&writer, "nothing left reserved", |s| s.objects_writing == 0);
}

/// Reads `/proc/self/maps` for the permissions of the mapping containing `ptr`.
fn mapping_perms(ptr: *const u8) -> String {
    let addr = ptr as usize;
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    for line in maps.lines() {
        let mut f = line.split_whitespace();
        let (range, perms) = (f.next().unwrap(), f.next().unwrap());
        let (lo, hi) = range.split_once('-').unwrap();
        let (lo, hi) = (
            usize::from_str_radix(lo, 16).unwrap(),
            usize::from_str_radix(hi, 16).unwrap(),
        );
        if (lo..hi).contains(&addr) {
            return perms.to_owned();
        }
    }
    panic!("{ptr:?} is not mapped");
}

/// Connecting maps the store without building its page tables (building a whole store's is
/// what delayed the first sample: 0.3 s of CPU per GiB); a writer builds those of the object it
/// reserves (and at most 64 KiB beside it), before the copy, once; a reader maps what it reads,
/// not the object or the store.
#[test]
fn page_tables_are_built_for_what_is_used_only() {
    let _w = watchdog("page_tables_are_built_for_what_is_used_only", LIMIT);
    // Page-sized figures: transparent huge pages for shared memory could map 2 MiB at a time.
    if let Some(on) = feedstore_shm::shmem_thp_mode().filter(|m| !matches!(*m, "never" | "deny")) {
        eprintln!("skipped: shared-memory transparent huge pages are {on}");
        return;
    }
    let rss_kib = |ptr| feedstore_shm::resident_kib(ptr).unwrap().expect("mapped");
    let dir = scratch_dir("page-tables");
    let daemon = DaemonProcess::start(&dir, &["--huge-pages", "off"]);
    let (writer, reader) = (daemon.writer(), daemon.reader());
    let mut object = writer.create(1 << 20).unwrap();
    let base = object.as_slice().as_ptr();
    let built = rss_kib(base);
    assert!(
        (1024..=1032).contains(&built),
        "the writer built the page tables of its 1 MiB object and no more: {built} KiB of a 64 MiB store"
    );
    object.as_mut_slice().fill(7);
    let handle = object.seal().unwrap();
    let again = writer.put(&[9; 4096]).unwrap();
    let now = rss_kib(base);
    assert!(
        now > built && now <= built + 64,
        "one more page, and at most the rest of its 64 KiB (page tables are built with a read \
         fault, which maps the ready pages around it): {built} KiB, then {now} KiB"
    );
    let lease = reader.get(handle).unwrap();
    let first = lease.as_ptr();
    assert_eq!(rss_kib(first), 0, "a get maps nothing");
    assert_eq!(std::hint::black_box(lease[0]), 7);
    let read = rss_kib(first);
    assert!(
        (4..1024).contains(&read),
        "one byte read maps its neighbourhood, not the object: {read} KiB"
    );
    assert_eq!(&*reader.get(again).unwrap(), &[9; 4096][..]);
    // A receiving thread builds a reader's page tables of a whole object ahead of its reading.
    let big = writer.put(&vec![3; 1 << 20]).unwrap();
    let ahead = reader.get(big).unwrap();
    let before = rss_kib(ahead.as_ptr());
    ahead.prefault();
    let mapped = rss_kib(ahead.as_ptr());
    assert!(
        mapped > before && mapped >= 1024,
        "the 1 MiB object's pages mapped: {before} KiB before, {mapped} KiB after"
    );
    assert!(ahead.iter().all(|&b| b == 3));
}

#[test]
fn reader_cannot_write() {
    let _w = watchdog("reader_cannot_write", LIMIT);
    let dir = scratch_dir("reader-ro");
    let daemon = DaemonProcess::start(&dir, &[]);
    // 1. The descriptor a reader receives refuses a writable mapping.
    let (_raw, response, fds) = RawClient::hello(&daemon.socket, Role::Reader, "raw");
    let Response::Hello { segments, .. } = response else {
        panic!("{response:?}")
    };
    assert_eq!(fds.len(), segments.len());
    let size = segments[0].size_bytes;
    let fd = fds.into_iter().next().unwrap();
    let raw = std::os::fd::AsRawFd::as_raw_fd(&fd);
    // SAFETY: a fresh mapping request; the kernel refuses it before anything is mapped.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            size as usize,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            raw,
            0,
        )
    };
    assert_eq!(p, libc::MAP_FAILED);
    assert_eq!(
        std::io::Error::last_os_error().raw_os_error(),
        Some(libc::EACCES)
    );
    let err = Mapping::new(fd.try_clone().unwrap(), size, Access::ReadWrite, false).unwrap_err();
    assert_eq!(
        err.os_error().and_then(|e| e.raw_os_error()),
        Some(libc::EACCES)
    );
    // A read-only mapping cannot be upgraded with mprotect either.
    let ro = Mapping::new(fd, size, Access::ReadOnly, false).unwrap();
    let ptr = ro.range_ptr(0, 4096).unwrap();
    // SAFETY: changing protection of a page we mapped; the kernel refuses it.
    let rc = unsafe { libc::mprotect(ptr.cast(), 4096, libc::PROT_READ | libc::PROT_WRITE) };
    assert_eq!(rc, -1);
    assert_eq!(
        std::io::Error::last_os_error().raw_os_error(),
        Some(libc::EACCES)
    );

    // 2. The client library maps reader views read-only, and readers cannot create.
    let writer = daemon.writer();
    let reader = daemon.reader();
    let h = writer.put(b"immutable").unwrap();
    let lease = reader.get(h).unwrap();
    assert_eq!(mapping_perms(lease.as_ptr()), "r--s");
    assert!(matches!(
        reader.create(10),
        Err(Error::PermissionDenied { .. })
    ));
    assert!(matches!(
        reader.delete(h),
        Err(Error::PermissionDenied { .. })
    ));
    // The writer's own view is read-write.
    let w = writer.create(10).unwrap();
    drop(w);
}

#[test]
fn writer_killed_mid_write_is_reclaimed() {
    let _w = watchdog("writer_killed_mid_write_is_reclaimed", LIMIT);
    let dir = scratch_dir("kill-writer");
    let daemon = DaemonProcess::start(&dir, &[]);
    let observer = daemon.writer();
    let before = observer.stats().unwrap();
    let mut child = ClientProcess::spawn(&daemon.socket, "write-half 3000000");
    let detail = child.ready();
    let handle: Handle = detail.parse().unwrap();
    let s = observer.stats().unwrap();
    assert_eq!(s.objects_writing, 1);
    assert!(s.used_bytes >= 3_000_000);
    // Half-written: invisible to everyone.
    assert!(matches!(
        daemon.reader().get(handle),
        Err(Error::NotSealed { .. })
    ));
    child.kill9();
    let s = wait_for_stats(&observer, "the killed writer's object to be aborted", |s| {
        s.objects_writing == 0
    });
    assert_eq!(s.used_bytes, before.used_bytes, "space reclaimed");
    assert_eq!(s.aborted_on_disconnect, 1);
    assert!(matches!(
        daemon.reader().get(handle),
        Err(Error::NotFound { .. })
    ));
    // The space is usable again: the whole store fits one object now.
    let big = observer.create(s.capacity_bytes).unwrap();
    big.abort().unwrap();
    assert!(
        daemon
            .log_text()
            .contains("reclaimed its unsealed objects and leases")
    );
}

#[test]
fn reader_killed_holding_leases_is_reclaimed() {
    let _w = watchdog("reader_killed_holding_leases_is_reclaimed", LIMIT);
    let dir = scratch_dir("kill-reader");
    let daemon = DaemonProcess::start(&dir, &[]);
    let writer = daemon.writer();
    let handles: Vec<Handle> = (0..4)
        .map(|i| writer.put(&pattern(i, 1 << 20)).unwrap())
        .collect();
    let list = handles
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(" ");
    let mut child = ClientProcess::spawn(&daemon.socket, &format!("hold-leases {list}"));
    assert_eq!(child.ready(), "12");
    assert_eq!(writer.stats().unwrap().leases, 12);
    // Deleting a leased object only hides it; its bytes stay until the holder lets go.
    writer.delete(handles[0]).unwrap();
    let s = writer.stats().unwrap();
    assert_eq!((s.objects_delete_pending, s.objects_sealed), (1, 3));
    let used_with_pending = s.used_bytes;
    // Leased objects are never evicted: a create needing their space fails Full.
    let free = s.capacity_bytes - used_with_pending;
    assert!(matches!(
        writer.create_with(
            free + (1 << 20),
            CreateOptions {
                timeout: Some(Duration::ZERO),
                pin: false
            }
        ),
        Err(Error::Full { .. })
    ));
    child.kill9();
    let s = wait_for_stats(&writer, "leases to be reclaimed", |s| s.leases == 0);
    assert_eq!(s.leases_reclaimed, 12);
    assert_eq!(s.objects_delete_pending, 0, "the pending delete completed");
    assert_eq!(s.used_bytes, used_with_pending - (1 << 20));
    // The remaining objects are intact and readable.
    let reader = daemon.reader();
    for (i, h) in handles.iter().enumerate().skip(1) {
        assert!(*reader.get(*h).unwrap() == pattern(i as u64, 1 << 20)[..]);
    }
}

#[test]
fn forged_and_stale_handles_are_rejected() {
    let _w = watchdog("forged_and_stale_handles_are_rejected", LIMIT);
    let dir = scratch_dir("forged");
    let daemon = DaemonProcess::start(&dir, &["--node-id", "7"]);
    let writer = daemon.writer();
    let reader = daemon.reader();
    let live: Vec<Handle> = (0..16)
        .map(|i| writer.put(&pattern(i, 100)).unwrap())
        .collect();
    // Random handles, and random ones on this node and epoch: none resolves.
    let mut x = 0x1234_5678_9abc_def0u64;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    for i in 0..2000 {
        let mut h = Handle {
            node_id: next() as u32,
            epoch: next() as u32,
            id: next(),
        };
        if i % 2 == 0 {
            // This node and epoch, ids next to live ones': ids are not a count.
            h.node_id = 7;
            h.epoch = live[0].epoch;
            h.id = live[i % live.len()].id.wrapping_add(1 + next() % 64);
            if live.iter().any(|l| l.id == h.id) {
                continue;
            }
        }
        match reader.get(h) {
            Err(Error::NotFound { .. } | Error::Stale { .. } | Error::WrongNode { .. }) => {}
            other => panic!("forged handle {h} gave {other:?}"),
        }
    }
    // A deleted object's handle, after its slot was used again: not found, never the new one.
    let victim = live[3];
    writer.delete(victim).unwrap();
    assert!(matches!(reader.get(victim), Err(Error::NotFound { .. })));
    let reused = writer.put(&pattern(1000, 100)).unwrap();
    assert_ne!(reused.id, victim.id);
    assert!(matches!(reader.get(victim), Err(Error::NotFound { .. })));
    assert_eq!(&*reader.get(reused).unwrap(), &pattern(1000, 100)[..]);
    // Every live object still reads its own bytes.
    for (i, h) in live.iter().enumerate().filter(|(i, _)| *i != 3) {
        assert_eq!(&*reader.get(*h).unwrap(), &pattern(i as u64, 100)[..]);
    }
}

#[test]
fn full_store_evicts_lru_then_applies_backpressure() {
    let _w = watchdog("full_store_evicts_lru_then_applies_backpressure", LIMIT);
    let dir = scratch_dir("full");
    let daemon = DaemonProcess::start(&dir, &["--capacity", "8MiB"]);
    let writer = daemon.writer();
    let reader = daemon.reader();
    let mib = |i: u64| pattern(i, 1 << 20);
    let first: Vec<Handle> = (0..8).map(|i| writer.put(&mib(i)).unwrap()).collect();
    // Touch object 0 so it is recently used; 1 is now the least recently used.
    drop(reader.get(first[0]).unwrap());
    let ninth = writer.put(&mib(8)).unwrap();
    let s = writer.stats().unwrap();
    assert_eq!(s.evictions, 1);
    assert!(
        matches!(
            reader.get(first[1]),
            Err(Error::NotFound { .. } | Error::Stale { .. })
        ),
        "LRU victim"
    );
    assert_eq!(
        &*reader.get(first[0]).unwrap(),
        &mib(0)[..],
        "recently used survives"
    );
    // Lease everything that is left: nothing is evictable, so a create waits then fails Full.
    let mut held: Vec<_> = first
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != 1)
        .map(|(_, h)| reader.get(*h).unwrap())
        .collect();
    held.push(reader.get(ninth).unwrap());
    let err = writer
        .create_with(
            1 << 20,
            CreateOptions {
                timeout: Some(Duration::from_millis(100)),
                pin: false,
            },
        )
        .unwrap_err();
    assert!(
        matches!(err, Error::Full { size_bytes } if size_bytes == 1 << 20),
        "{err:?}"
    );
    let s = writer.stats().unwrap();
    assert_eq!((s.creates_waited, s.creates_full), (1, 1));
    assert!(
        s.used_bytes <= s.capacity_bytes,
        "never grows past capacity"
    );
    // A create waiting for space succeeds as soon as a lease is released elsewhere.
    let waiter = {
        let writer = writer.clone();
        std::thread::spawn(move || {
            let mut w = writer
                .create_with(
                    1 << 20,
                    CreateOptions {
                        timeout: Some(Duration::from_secs(60)),
                        pin: false,
                    },
                )
                .unwrap();
            w.as_mut_slice().fill(7);
            w.seal().unwrap()
        })
    };
    // Poll through another connection: the waiting create occupies the writer's.
    wait_for_stats(&reader, "the create to start waiting", |s| {
        s.creates_waited == 2
    });
    held.pop(); // releases the ninth object's lease: now evictable
    let tenth = waiter.join().unwrap();
    assert!(reader.get(tenth).unwrap().iter().all(|&b| b == 7));
    assert_eq!(writer.stats().unwrap().evictions, 2);
    // A pinned object is never evicted.
    drop(held);
    let pinned = {
        let mut w = writer
            .create_with(
                1 << 20,
                CreateOptions {
                    timeout: None,
                    pin: true,
                },
            )
            .unwrap();
        w.as_mut_slice().copy_from_slice(&mib(99));
        w.seal().unwrap()
    };
    for i in 0..20 {
        writer.put(&mib(200 + i)).unwrap();
    }
    assert_eq!(&*reader.get(pinned).unwrap(), &mib(99)[..]);
    assert_eq!(writer.stats().unwrap().objects_pinned, 1);
    // Larger than the store: refused at once, not waited for.
    assert!(matches!(
        writer.create(9 << 20),
        Err(Error::TooLarge { .. })
    ));
}

/// Opens a raw connection, sends `bytes`, and reports whether the daemon closed it.
fn send_raw_expect_close(socket: &std::path::Path, bytes: &[u8]) {
    let mut s = UnixStream::connect(socket).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let _ = s.write_all(bytes);
    let mut buf = [0u8; 256];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return,
            Ok(_) => continue, // an error reply may precede the close
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return,
            Err(e) => panic!("daemon did not close a connection after bad input: {e}"),
        }
    }
}

fn hello_bytes() -> Vec<u8> {
    let mut out = Vec::new();
    Request::Hello {
        role: Role::Writer,
        client_name: "raw".into(),
        max_frame_bytes: feedstore_proto::frame::MAX_PAYLOAD_BYTES,
        speaks: feedstore_proto::frame::Speaks::ours(),
        reconnects: 0,
    }
    .encode(1, feedstore_proto::frame::MAX_PAYLOAD_BYTES, &mut out)
    .unwrap();
    out
}

#[test]
fn malformed_frames_are_rejected() {
    let _w = watchdog("malformed_frames_are_rejected", LIMIT);
    let dir = scratch_dir("malformed");
    let daemon = DaemonProcess::start(&dir, &[]);
    // A healthy client with a lease, to show nobody else is harmed.
    let writer = daemon.writer();
    let bystander = daemon.reader();
    let h = writer.put(b"still here").unwrap();
    let lease = bystander.get(h).unwrap();

    // Garbage instead of a header.
    send_raw_expect_close(&daemon.socket, b"GET / HTTP/1.1\r\n\r\n");
    // A valid header announcing a payload over the maximum.
    let mut oversized = Vec::new();
    Request::Stats
        .encode(1, feedstore_proto::frame::MAX_PAYLOAD_BYTES, &mut oversized)
        .unwrap();
    oversized[12..16].copy_from_slice(&(64u32 << 20).to_le_bytes());
    send_raw_expect_close(&daemon.socket, &oversized);
    // A protocol version older than any the daemon speaks.
    let mut version = hello_bytes();
    version[2..4].copy_from_slice(&(feedstore_proto::frame::MIN_VERSION - 1).to_le_bytes());
    send_raw_expect_close(&daemon.socket, &version);
    // A request before hello.
    let mut early = Vec::new();
    Request::Stats
        .encode(1, feedstore_proto::frame::MAX_PAYLOAD_BYTES, &mut early)
        .unwrap();
    send_raw_expect_close(&daemon.socket, &early);
    // A truncated frame, then end of stream.
    let hello = hello_bytes();
    {
        let mut s = UnixStream::connect(&daemon.socket).unwrap();
        s.write_all(&hello[..hello.len() - 3]).unwrap();
    }
    // A frame whose element count lies about its length.
    let mut lying = hello_bytes();
    let mut get = Vec::new();
    Request::Get { handles: vec![h] }
        .encode(2, feedstore_proto::frame::MAX_PAYLOAD_BYTES, &mut get)
        .unwrap();
    get[16..20].copy_from_slice(&1000u32.to_le_bytes());
    lying.extend_from_slice(&get);
    send_raw_expect_close(&daemon.socket, &lying);
    // An unknown opcode after a good hello.
    let mut unknown = hello_bytes();
    let mut stats = Vec::new();
    Request::Stats
        .encode(2, feedstore_proto::frame::MAX_PAYLOAD_BYTES, &mut stats)
        .unwrap();
    stats[4] = 0x55;
    unknown.extend_from_slice(&stats);
    send_raw_expect_close(&daemon.socket, &unknown);

    // The bystander's lease, connection and data are untouched; the daemon still serves.
    assert_eq!(&*lease, b"still here");
    assert_eq!(&*bystander.get(h).unwrap(), b"still here");
    // The temporary lease above is released within the client's release delay.
    wait_for_stats(&writer, "raw connections gone, one lease left", |s| {
        s.clients == 2 && s.leases == 1
    });
    let log = daemon.log_text();
    for reason in [
        "bad magic",
        "exceeds the maximum",
        "the client speaks protocol 8, this daemon 9-",
        "before hello",
        "truncated",
        "unknown opcode",
    ] {
        assert!(
            log.contains(reason),
            "daemon log should name {reason:?}:\n{log}"
        );
    }
}

#[test]
fn daemon_restart_is_seen_as_disconnected() {
    let _w = watchdog("daemon_restart_is_seen_as_disconnected", LIMIT);
    let dir = scratch_dir("restart");
    let mut daemon = DaemonProcess::start(&dir, &[]);
    let writer = daemon.writer();
    let reader = daemon.reader();
    let h = writer.put(b"before the restart").unwrap();
    let lease = reader.get(h).unwrap();
    let status = daemon.signal_and_wait(Signal::SIGTERM);
    assert!(status.success(), "clean exit on SIGTERM: {status}");
    assert!(!daemon.socket.exists(), "socket file removed on shutdown");
    assert!(matches!(reader.get(h), Err(Error::Disconnected { .. })));
    assert!(matches!(writer.put(b"x"), Err(Error::Disconnected { .. })));
    assert!(
        matches!(writer.stats(), Err(Error::Disconnected { .. })),
        "stays disconnected"
    );
    // The old view still reads its bytes: the mapping outlives the daemon.
    assert_eq!(&*lease, b"before the restart");
    drop(lease); // the release goes nowhere, quietly

    let daemon2 = DaemonProcess::start(&dir, &[]);
    let reader2 = daemon2.reader();
    assert_ne!(reader2.epoch(), reader.epoch());
    assert!(
        matches!(reader2.get(h), Err(Error::Stale { .. })),
        "old handles are stale"
    );
    let h2 = daemon2.writer().put(b"after").unwrap();
    assert_eq!(&*reader2.get(h2).unwrap(), b"after");
}

/// A client that reconnects, through a kill -9 of its daemon and a new daemon started on the
/// same socket 0.3 s later: the call that found the daemon gone waits for the new one and goes
/// through; the old daemon's objects are gone (`Stale`), a view taken before still reads its
/// bytes and its release goes nowhere; and a daemon that does not come back is an error that
/// says so, once the timeout is over.
#[test]
fn a_client_that_reconnects_goes_on_with_a_daemon_started_again() {
    let _w = watchdog("a_client_that_reconnects_goes_on", LIMIT);
    let dir = scratch_dir("reconnect");
    let daemon = DaemonProcess::start(&dir, &[]);
    let socket = daemon.socket.clone();
    let connect = |role, timeout| {
        ConnectOptions::new(role)
            .socket(&socket)
            .reconnect_timeout(timeout)
            .connect()
            .unwrap()
    };
    let writer = connect(Role::Writer, Duration::from_secs(20));
    let reader = connect(Role::Reader, Duration::from_secs(20));
    let h = writer.put(b"before the kill").unwrap();
    let lease = reader.get(h).unwrap();
    let epoch = reader.epoch();
    let kill9 = |mut d: DaemonProcess| {
        let pid = nix::unistd::Pid::from_raw(d.child.id() as i32);
        nix::sys::signal::kill(pid, Signal::SIGKILL).unwrap();
        d.child.wait().unwrap();
    };
    kill9(daemon);
    let restarted = std::thread::spawn({
        let dir = dir.clone();
        move || {
            std::thread::sleep(Duration::from_millis(300));
            DaemonProcess::start(&dir, &[])
        }
    });
    // Sent to the dead daemon, it waits for the new one and goes through there.
    let h2 = writer.put(b"after").unwrap();
    let daemon2 = restarted.join().unwrap();
    assert_eq!(writer.reconnects(), 1);
    assert!(
        matches!(reader.get(h), Err(Error::Stale { .. })),
        "the old daemon's objects went with it"
    );
    assert_eq!(reader.reconnects(), 1);
    assert_ne!(reader.epoch(), epoch);
    assert_eq!(&*reader.get(h2).unwrap(), b"after");
    assert_eq!(
        &*lease, b"before the kill",
        "a view from before reads its own bytes"
    );
    drop(lease);
    reader.flush_releases();
    let stats = reader.stats().unwrap();
    assert_eq!(stats.leases, 0, "{stats:?}");
    assert!(
        !daemon2.log_text().contains("release of a lease not held"),
        "the old daemon's lease is not returned to the new one"
    );
    // The new daemon counts and logs the clients that came back.
    assert_eq!((stats.reconnects, stats.reconnected_clients), (2, 2));
    assert!(
        daemon2
            .log_text()
            .contains("client connected again after its daemon went away"),
        "{}",
        daemon2.log_text()
    );

    // `feedstore top` says the daemon went away, and goes on with the next one.
    let mut top = std::process::Command::new(env!("CARGO_BIN_EXE_feedstore"))
        .args(["top", "--interval", "0.1", "--count", "3000", "--socket"])
        .arg(&socket)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufRead::lines(std::io::BufReader::new(top.stdout.take().unwrap()));
    let mut until = |what: &str| {
        let mut seen = Vec::new();
        for line in lines.by_ref() {
            let line = line.unwrap();
            if line.contains(what) {
                return;
            }
            seen.push(line);
        }
        panic!("top ended before {what:?}: {seen:#?}");
    };
    until("2 reconnects of clients whose daemon went away (2 connected now)");
    kill9(daemon2);
    until("went away");
    let daemon3 = DaemonProcess::start(&dir, &[]);
    writer.put(b"on the third").unwrap();
    until("1 reconnects of clients whose daemon went away (1 connected now)");
    top.kill().unwrap();
    top.wait().unwrap();

    let quick = connect(Role::Reader, Duration::from_millis(300));
    kill9(daemon3);
    let e = quick.stats().unwrap_err();
    assert!(matches!(e, Error::Disconnected { .. }), "{e}");
    let text = feedstore_proto::error_chain(&e);
    assert!(
        text.contains("did not come back within 300ms"),
        "the error says it gave up: {text}"
    );
}

/// `feedstored --takeover` in place of a running daemon: the old one exits, the same handles
/// read the same bytes, a view held across it is untouched, a reservation made before is
/// sealed after, leases taken before are returned to the successor, and what a process that
/// never came back held is dropped when it dies.
#[test]
fn a_daemon_taken_over_keeps_every_object_lease_and_reservation() {
    let _w = watchdog("a_daemon_taken_over_keeps_every_object", LIMIT);
    let dir = scratch_dir("takeover");
    // (Streams idle for 1 s expire: the sweep that also drops what gone processes held runs
    // every 250 ms.)
    let flags = ["--stream-idle-secs", "1"];
    let daemon = DaemonProcess::start(&dir, &flags);
    let socket = daemon.socket.clone();
    let connect = |role| {
        ConnectOptions::new(role)
            .socket(&socket)
            .reconnect_timeout(Duration::from_secs(20))
            .connect()
            .unwrap()
    };
    let writer = connect(Role::Writer);
    let reader = connect(Role::Reader);
    let h = writer.put(b"before the takeover").unwrap();
    let view = reader.get(h).unwrap();
    let mut reserved = writer.create(4096).unwrap();
    reserved.as_mut_slice().fill(0x42);
    let held = writer
        .put(b"held by a process that never reconnects")
        .unwrap();
    let mut holder = ClientProcess::spawn(&socket, &format!("hold-leases {held}"));
    assert_eq!(holder.ready(), "3");
    let epoch = reader.epoch();
    let before = reader.stats().unwrap();

    let daemon = daemon.take_over(&dir, &flags);
    assert!(
        daemon
            .log_text()
            .contains("took over the running daemon's memory, objects and sockets"),
        "{}",
        daemon.log_text()
    );
    // The reservation made before is sealed by the successor, and reads back.
    let sealed = reserved.seal().unwrap();
    assert_eq!(writer.reconnects(), 1);
    assert_eq!(&*reader.get(sealed).unwrap(), &[0x42; 4096][..]);
    assert_eq!(
        reader.epoch(),
        epoch,
        "the same epoch: every handle stays valid"
    );
    assert_eq!(&*reader.get(h).unwrap(), b"before the takeover");
    assert_eq!(
        &*view, b"before the takeover",
        "a view from before is untouched"
    );
    let after = reader.stats().unwrap();
    assert_eq!(after.used_bytes, before.used_bytes);
    assert_eq!(after.objects_sealed, before.objects_sealed + 1);
    // The view's lease, taken before, is returned to the successor.
    let leases_with_view = after.leases;
    drop(view);
    reader.flush_releases();
    assert_eq!(reader.stats().unwrap().leases, leases_with_view - 1);
    assert!(
        !daemon.log_text().contains("release of a lease not held"),
        "{}",
        daemon.log_text()
    );
    // The holder never came back: its three leases go when it dies.
    assert!(reader.stats().unwrap().leases >= 3);
    holder.kill9();
    wait_for_leases(&reader, &daemon, 0);
    assert!(
        daemon
            .log_text()
            .contains("a client process gone since the hand-over")
    );

    // A takeover that cannot happen leaves the daemon serving: another node id.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_feedstored"))
        .args(["--takeover", "--node-id", "12345", "--socket"])
        .arg(&socket)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("cannot take over") && err.contains("--node-id"),
        "{err}"
    );
    assert_eq!(&*reader.get(h).unwrap(), b"before the takeover");
    assert_eq!(
        reader.reconnects(),
        1,
        "the daemon served on without a break"
    );
}

#[test]
fn daemon_command_line_errors_are_one_clear_line() {
    let _w = watchdog("daemon_command_line_errors_are_one_clear_line", LIMIT);
    let dir = scratch_dir("cli");
    let daemon = DaemonProcess::start(&dir, &[]);
    let mode = std::fs::metadata(&daemon.socket)
        .unwrap()
        .permissions()
        .mode()
        & 0o777;
    assert_eq!(mode, 0o600, "socket is private by default");
    let run = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_feedstored"))
            .args(args)
            .output()
            .unwrap();
        (
            out.status,
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let sock = daemon.socket.to_str().unwrap();
    let (status, err) = run(&["--socket", sock, "--capacity", "16MiB"]);
    assert!(!status.success());
    assert!(err.contains("in use by another feedstored"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "one line: {err}");

    let other = dir.join("other.sock");
    let other = other.to_str().unwrap();
    let (status, err) = run(&["--socket", other, "--capacity", "100TiB"]);
    assert!(!status.success());
    assert!(
        err.contains("exceeds") && err.contains("available"),
        "{err}"
    );

    let (status, err) = run(&["--socket", other, "--capacity", "lots"]);
    assert!(!status.success());
    assert!(err.contains("512MiB"), "{err}");

    let (status, err) = run(&[
        "--socket",
        other,
        "--capacity",
        "64MiB",
        "--huge-pages",
        "on",
        "--prefault",
        "false",
    ]);
    let free = feedstore_shm::HugePageInfo::read().map_or(0, |i| i.free_pages * i.page_bytes);
    if free < 64 << 20 {
        assert!(!status.success());
        assert!(err.contains("/proc/sys/vm/nr_hugepages"), "{err}");
    }
    // Anything at the socket path but a stale socket is the user's, not the daemon's to delete;
    // and the path is checked before seconds go into shared memory.
    let precious = dir.join("notes.txt");
    std::fs::write(&precious, "precious").unwrap();
    let (status, err) = run(&[
        "--socket",
        precious.to_str().unwrap(),
        "--capacity",
        "16MiB",
    ]);
    assert!(!status.success());
    assert!(err.contains("not a socket"), "{err}");
    assert_eq!(std::fs::read_to_string(&precious).unwrap(), "precious");
    let long = dir.join("d".repeat(120)).join("x.sock");
    let (status, err) = run(&["--socket", long.to_str().unwrap(), "--capacity", "16MiB"]);
    assert!(!status.success());
    assert!(err.contains("shorter than 108 bytes"), "{err}");
    assert!(
        !dir.join("d".repeat(120)).exists(),
        "no directory left behind"
    );
    let (status, err) = run(&["--socket", other, "--max-frame-bytes", "1KiB"]);
    assert!(!status.success() && err.contains("at least 65536"), "{err}");
    let (status, err) = run(&["--socket", other, "--max-ring-bytes", "1KiB"]);
    assert!(!status.success() && err.contains("one ring"), "{err}");

    let config = dir.join("feedstore.toml");
    std::fs::write(&config, "capacty = \"1GiB\"\n").unwrap();
    let (status, err) = run(&["--config", config.to_str().unwrap()]);
    assert!(!status.success());
    assert!(
        err.contains("unknown field") && err.contains("capacty"),
        "{err}"
    );

    let (status, out) = {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_feedstored"))
            .arg("--help")
            .output()
            .unwrap();
        (
            out.status,
            String::from_utf8_lossy(&out.stdout).into_owned(),
        )
    };
    assert!(status.success());
    for flag in [
        "--socket",
        "--capacity",
        "--huge-pages",
        "--config",
        "--prefault",
        "--allow-uid",
    ] {
        assert!(out.contains(flag), "--help lists {flag}");
    }
}

#[test]
fn stat_command_prints_the_store() {
    let _w = watchdog("stat_command_prints_the_store", LIMIT);
    let dir = scratch_dir("stat");
    let daemon = DaemonProcess::start(&dir, &["--capacity", "32MiB"]);
    let writer = daemon.writer();
    let h = writer.put(&[1u8; 1 << 20]).unwrap();
    let _lease = daemon.reader().get(h).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_feedstore"))
        .args(["stat", "--socket", daemon.socket.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    for field in [
        "capacity        32.0 MiB",
        "used            1.0 MiB",
        "1 sealed",
        "leases          1",
        "fragmentation",
        "evictions",
    ] {
        assert!(text.contains(field), "stat output lacks {field:?}:\n{text}");
    }
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_feedstore"))
        .args([
            "stat",
            "--socket",
            dir.join("nobody.sock").to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("is the daemon running?"), "{err}");
}

/// Reserves huge pages for the duration of a test (root only) and gives them back on drop.
struct HugePageReserve {
    previous: Option<u64>,
}

const NR_HUGEPAGES: &str = "/proc/sys/vm/nr_hugepages";

impl HugePageReserve {
    fn add(pages: u64) -> Option<HugePageReserve> {
        let previous: u64 = std::fs::read_to_string(NR_HUGEPAGES)
            .ok()?
            .trim()
            .parse()
            .ok()?;
        std::fs::write(NR_HUGEPAGES, (previous + pages).to_string()).ok()?;
        let reserve = HugePageReserve {
            previous: Some(previous),
        };
        let free = feedstore_shm::HugePageInfo::read().map_or(0, |i| i.free_pages);
        (free >= pages).then_some(reserve)
    }
}

impl Drop for HugePageReserve {
    fn drop(&mut self) {
        if let Some(previous) = self.previous {
            let _ = std::fs::write(NR_HUGEPAGES, previous.to_string());
        }
    }
}

#[test]
fn huge_page_segments_serve_objects() {
    let _w = watchdog("huge_page_segments_serve_objects", LIMIT);
    let Some(_reserve) = HugePageReserve::add(40) else {
        eprintln!(
            "SKIPPED huge_page_segments_serve_objects: cannot reserve huge pages here (needs root)"
        );
        return;
    };
    let dir = scratch_dir("huge");
    let daemon = DaemonProcess::start(&dir, &["--capacity", "64MiB", "--huge-pages", "on"]);
    let writer = daemon.writer();
    let reader = daemon.reader();
    let s = writer.stats().unwrap();
    assert_eq!(s.huge_pages, 1, "segments on hugetlbfs");
    let blob = pattern(5, 3 << 20);
    let h = writer.put(&blob).unwrap();
    let lease = reader.get(h).unwrap();
    assert_eq!(&*lease, &blob[..]);
    assert_eq!(mapping_perms(lease.as_ptr()), "r--s");
    let text = std::process::Command::new(env!("CARGO_BIN_EXE_feedstore"))
        .args(["stat", "--socket", daemon.socket.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&text.stdout).contains("huge pages"));
    drop(lease);
    drop(daemon); // before the reserve is given back
}

#[test]
fn writers_killed_at_random_never_expose_partial_objects() {
    use std::io::BufRead;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::{Arc, Mutex, mpsc};
    let _w = watchdog(
        "writers_killed_at_random_never_expose_partial_objects",
        LIMIT,
    );
    let dir = scratch_dir("stress");
    // Small: eviction and backpressure run throughout.
    let daemon = DaemonProcess::start(&dir, &["--capacity", "8MiB"]);
    let (tx, rx) = mpsc::channel::<Handle>();
    let rx = Arc::new(Mutex::new(rx));
    let (verified, gone) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let readers: Vec<_> = (0..2)
        .map(|_| {
            let (client, rx, verified, gone) =
                (daemon.reader(), rx.clone(), verified.clone(), gone.clone());
            std::thread::spawn(move || {
                loop {
                    let Ok(h) = rx.lock().unwrap().recv() else {
                        return;
                    };
                    match client.get(h) {
                        Ok(lease) => {
                            assert!(
                                is_self_describing(&lease),
                                "object {h} read back partial or foreign bytes"
                            );
                            verified.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(Error::NotFound { .. } | Error::Stale { .. }) => {
                            gone.fetch_add(1, Ordering::Relaxed); // evicted before we got to it
                        }
                        Err(e) => panic!("get of {h}: {e}"),
                    }
                }
            })
        })
        .collect();
    let mut x = 0x5eed_u64;
    let mut kills = 0;
    for round in 0..12u64 {
        let mut writers: Vec<ClientProcess> = (0..2)
            .map(|i| {
                ClientProcess::spawn(&daemon.socket, &format!("put-loop {}", round * 10 + i + 1))
            })
            .collect();
        for w in &mut writers {
            w.ready();
        }
        // Forward handles as they are sealed, for a random 20-120 ms, then kill -9 both.
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let until = std::time::Instant::now() + Duration::from_millis(20 + x % 100);
        let forwarders: Vec<_> = writers
            .iter_mut()
            .map(|w| {
                let stdout = w.take_stdout();
                let tx = tx.clone();
                std::thread::spawn(move || {
                    for line in stdout.lines() {
                        let Ok(line) = line else { return };
                        if let Some(h) = line.strip_prefix("H ") {
                            let _ = tx.send(h.trim().parse().unwrap());
                        }
                    }
                })
            })
            .collect();
        std::thread::sleep(until.saturating_duration_since(std::time::Instant::now()));
        for w in writers {
            w.kill9();
            kills += 1;
        }
        for f in forwarders {
            f.join().unwrap();
        }
    }
    drop(tx);
    for r in readers {
        r.join().unwrap();
    }
    let observer = daemon.writer();
    let s = wait_for_stats(
        &observer,
        "every killed writer's reservation to be aborted",
        |s| s.objects_writing == 0 && s.leases == 0,
    );
    assert!(
        verified.load(Ordering::Relaxed) > 0,
        "readers verified objects"
    );
    assert!(s.evictions > 0, "eviction took part");
    assert_eq!(s.clients, 1, "only the observer is left");
    eprintln!(
        "stress: {kills} writers killed, {} objects verified, {} evicted before read, {} reservations aborted",
        verified.load(Ordering::Relaxed),
        gone.load(Ordering::Relaxed),
        s.aborted_on_disconnect
    );
    // Every byte is reclaimable: no reservation or lease of a killed writer leaked.
    let big = observer
        .create(s.capacity_bytes)
        .expect("whole store reclaimable");
    big.abort().unwrap();
}

/// A client that shares no protocol version with the daemon is told why, in words naming both
/// sides' versions and which to upgrade, before the daemon closes: not a silent `Disconnected`
/// with the reason only in the daemon's log.
#[test]
fn a_client_of_no_common_protocol_version_is_told_both_versions() {
    use feedstore_proto::frame::{
        Frame, HEADER_BYTES, MAX_PAYLOAD_BYTES, MIN_VERSION, Speaks, VERSION,
    };
    let _w = watchdog("a_client_of_no_common_protocol_version", LIMIT);
    let dir = scratch_dir("version");
    let daemon = DaemonProcess::start(&dir, &[]);
    let too_new = Speaks {
        min: VERSION + 1,
        max: VERSION + 2,
        features: 0,
        release: "9.9.0".into(),
    };
    // (header version, what the hello says it speaks, what to upgrade)
    let cases = [
        (
            MIN_VERSION - 1,
            Speaks::implied(MIN_VERSION - 1),
            "the client",
        ),
        (1, Speaks::implied(1), "the client"),
        (VERSION + 2, too_new, "this feedstored"),
    ];
    for (version, speaks, upgrade) in cases {
        let mut hello = Vec::new();
        Request::Hello {
            role: Role::Reader,
            client_name: "from another release".into(),
            max_frame_bytes: MAX_PAYLOAD_BYTES,
            speaks: speaks.clone(),
            reconnects: 0,
        }
        .encode_in(version.max(MIN_VERSION), 7, MAX_PAYLOAD_BYTES, &mut hello)
        .unwrap();
        hello[2..4].copy_from_slice(&version.to_le_bytes());
        let mut s = UnixStream::connect(&daemon.socket).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.write_all(&hello).unwrap();
        let mut reply = Vec::new();
        s.read_to_end(&mut reply).unwrap();
        assert!(reply.len() > HEADER_BYTES, "an answer, then the close");
        // What any client reads first: a header of the daemon's newest version.
        assert_eq!(u16::from_le_bytes([reply[2], reply[3]]), VERSION);
        let frame = Frame::parse(&reply, MAX_PAYLOAD_BYTES).unwrap().unwrap();
        assert_eq!(frame.header.request_id, 7);
        let Response::Error { message, .. } = Response::decode(&frame).unwrap() else {
            panic!("an error reply")
        };
        let daemon_side = format!(
            "feedstored is feedstore {} (protocols {MIN_VERSION}-{VERSION})",
            env!("CARGO_PKG_VERSION")
        );
        assert!(message.contains(&daemon_side), "{message}");
        assert!(message.contains(&speaks.describe()), "{message}");
        assert!(message.contains(&format!("upgrade {upgrade}")), "{message}");
    }
    assert!(
        daemon.log_text().contains(&format!(
            "client speaks protocol {}, this daemon {MIN_VERSION}-{VERSION}",
            MIN_VERSION - 1
        )),
        "{}",
        daemon.log_text()
    );
    // This version's clients are served as ever, in the newest version.
    let reader = daemon.reader();
    assert!(reader.stats().is_ok());
    assert_eq!(reader.protocol(), VERSION);
    assert_eq!(reader.daemon(), Speaks::ours());
}

/// A client of the previous release (0.1.0: protocol 9, a hello that says nothing of versions)
/// is served in its own version: every reply in the layout it reads.
#[test]
fn a_protocol_9_client_is_served_in_its_own_layout() {
    use feedstore_proto::frame::{Got, MIN_VERSION, Speaks};
    let _w = watchdog("a_protocol_9_client", LIMIT);
    let dir = scratch_dir("protocol-9");
    let daemon = DaemonProcess::start(&dir, &[]);
    assert_eq!(MIN_VERSION, 9);
    let (mut old, response, fds) = RawClient::hello_in(9, &daemon.socket, Role::Writer, "0.1.0");
    let Response::Hello {
        segments, speaks, ..
    } = response
    else {
        panic!("a hello reply: {response:?}")
    };
    assert_eq!(fds.len(), segments.len());
    assert_eq!(
        speaks,
        Speaks::implied(9),
        "a protocol 9 reply says nothing more"
    );
    // A put and a get, as 0.1.0's client makes them.
    let Response::Created(created) = old.call(&Request::Create {
        sizes: vec![64],
        timeout_ms: 0,
        flags: 0,
    }) else {
        panic!("a create reply")
    };
    let handle = created[0].unwrap().handle;
    assert!(matches!(
        old.call(&Request::Seal { handles: vec![handle] }),
        Response::Done(s) if s == [feedstore_proto::Status::Ok]
    ));
    let Response::Got(got) = old.call(&Request::Get {
        handles: vec![handle],
    }) else {
        panic!("a get reply")
    };
    // Read in protocol 9, a result has no writer: its bytes were laid out without one.
    assert_eq!(got[0].unwrap().writer, Got::UNKNOWN_WRITER);
    let Response::Stats(stats) = old.call(&Request::Stats) else {
        panic!("a stats reply")
    };
    assert_eq!(stats.leases, 1, "its own lease");
    // Every reply came in protocol 9 (the raw client checks each header's version).
    assert!(
        daemon.log_text().contains("protocol=9"),
        "{}",
        daemon.log_text()
    );
    // A client of this release beside it speaks the newest version.
    assert_eq!(daemon.reader().protocol(), feedstore_proto::frame::VERSION);
}

/// The unit in deploy/systemd, run by a real systemd: `systemctl start` waits for the daemon's
/// READY=1; `systemctl reload` (twice) hands the daemon over to a successor, which becomes the
/// service's main process, with the clients' objects, views and handles kept; a `kill -9` of
/// the daemon is restarted by systemd with the memory and ledger it kept (`--fd-store`), and its
/// clients go on with the same objects, views and reservations; `systemctl stop` leaves nothing
/// running and nothing kept.
#[test]
fn the_systemd_unit_starts_reloads_by_takeover_restarts_and_stops() {
    if !is_root() || !std::path::Path::new("/lib/systemd/systemd").exists() {
        eprintln!("SKIPPED the_systemd_unit: needs root and systemd installed");
        return;
    }
    let _w = watchdog("the_systemd_unit", Duration::from_secs(240));
    let dir = scratch_dir("systemd");
    let manager = ServiceManager::start(&dir);
    let metrics = free_port();
    let FeedstoredUnit { socket, log } = FeedstoredUnit::install(
        &manager,
        &dir,
        env!("CARGO_BIN_EXE_feedstored"),
        &format!("capacity = \"64MiB\"\nmetrics-addr = \"127.0.0.1:{metrics}\""),
        "RestartSec=100ms\nEnvironment=FEEDSTORE_LOG=debug",
    );
    let unit = FeedstoredUnit::NAME;
    manager.must(&["start", unit]);
    // `start` returned: the daemon said READY=1, so it serves.
    assert_eq!(manager.show(unit, "ActiveState"), "active");
    assert_eq!(manager.show(unit, "StatusText"), "serving");
    // How each daemon came by its store, in the metrics: fresh, taken over, read back.
    let started = |how: &str| {
        let (_, scrape) = http_get(metrics, "/metrics");
        assert!(
            scrape.contains(&format!(
                "feedstore_daemon_start_time_seconds{{how=\"{how}\"}} "
            )),
            "{how}: {scrape}"
        );
    };
    started("fresh");
    let first = manager.show(unit, "MainPID");
    let connect = |role| {
        ConnectOptions::new(role)
            .socket(&socket)
            .reconnect_timeout(Duration::from_secs(30))
            .connect()
            .unwrap()
    };
    let (writer, reader) = (connect(Role::Writer), connect(Role::Reader));
    let mut bytes = vec![0u8; 3 << 20];
    fill_pattern(&mut bytes, 37);
    let h = writer.put(&bytes).unwrap();
    let view = reader.get(h).unwrap();

    let mut main = first.clone();
    for reload in 1..=2 {
        manager.must(&["reload", unit]);
        let now = manager.show(unit, "MainPID");
        assert_ne!(
            now, main,
            "reload {reload}: the successor is the main process"
        );
        let cmdline = std::fs::read(format!("/proc/{now}/cmdline")).unwrap_or_default();
        assert!(
            String::from_utf8_lossy(&cmdline).contains("--takeover"),
            "reload {reload}: MainPID {now} is the daemon that took over"
        );
        assert_eq!(manager.show(unit, "ActiveState"), "active");
        assert!(
            manager
                .show(unit, "StatusText")
                .contains("took over from the daemon before")
        );
        let old = nix::unistd::Pid::from_raw(main.parse().unwrap());
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while nix::sys::signal::kill(old, None).is_ok() {
            assert!(std::time::Instant::now() < deadline, "the old daemon exits");
            std::thread::sleep(Duration::from_millis(20));
        }
        main = now;
        assert!(
            pattern_matches(&reader.get(h).unwrap(), 37),
            "reload {reload}"
        );
        assert!(writer.put(b"after a reload").is_ok());
        started("takeover");
    }
    assert_eq!(writer.reconnects(), 2);
    // Every block nothing holds written again: the view's lease came through both reloads.
    churn(&writer, 128 << 20, 4 << 20);
    assert!(
        pattern_matches(&view, 37),
        "a view held across both reloads"
    );
    assert_eq!(manager.show(unit, "NRestarts"), "0");

    // The service manager keeps the segment and one ledger (--fd-store), whichever daemon
    // took over: a segment kept again is kept once, a successor's ledger replaces the last.
    assert_eq!(manager.show(unit, "NFileDescriptorStore"), "2");

    // A crash: systemd starts it again (Restart=on-failure) with the memory and the ledger it
    // kept, and the clients go on with the same objects: the same handles, the view held
    // across it, a reservation being written when it happened.
    // What processes that exit while the daemon is down held is dropped when it comes back:
    // three leases of one, a reservation of another (the daemon is stopped before they are
    // killed, so it never sees them go).
    let mut pending = writer.create(1 << 20).unwrap();
    let half = pending.as_mut_slice().len() / 2;
    fill_pattern(&mut pending.as_mut_slice()[..half], 41);
    let mut holder = ClientProcess::spawn(&socket, &format!("hold-leases {h}"));
    assert_eq!(holder.ready(), "3");
    let mut half_writer = ClientProcess::spawn(&socket, "write-half 4096");
    half_writer.ready();
    let s = writer.stats().unwrap();
    assert_eq!((s.leases, s.objects_writing), (4, 2), "{s:?}");
    let pid = nix::unistd::Pid::from_raw(main.parse().unwrap());
    nix::sys::signal::kill(pid, Signal::SIGSTOP).unwrap();
    holder.kill9();
    half_writer.kill9();
    nix::sys::signal::kill(pid, Signal::SIGKILL).unwrap();
    manager.wait(unit, "NRestarts", |n| n == "1");
    manager.wait(unit, "ActiveState", |s| s == "active");
    fill_pattern(&mut pending.as_mut_slice()[half..], 43);
    let sealed = pending
        .seal()
        .expect("a reservation from before the crash seals after it");
    let got = reader.get(sealed).unwrap();
    assert!(pattern_matches(&got[..half], 41) && pattern_matches(&got[half..], 43));
    drop(got);
    assert!(
        pattern_matches(&reader.get(h).unwrap(), 37),
        "the crashed daemon's objects are served again, by their handles"
    );
    // Every block nothing holds written again: the view's lease came through the crash too.
    churn(&writer, 128 << 20, 4 << 20);
    assert!(pattern_matches(&view, 37), "a view from before the crash");
    let s = writer.stats().unwrap();
    assert_eq!(
        (s.leases, s.objects_writing),
        (1, 0),
        "the view's lease, held since before the crash; nothing of the processes gone"
    );
    drop(view);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while writer.stats().unwrap().leases != 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the view's lease is returned"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let after = writer.put(b"after the crash").unwrap();
    assert_eq!(&*reader.get(after).unwrap(), b"after the crash");
    assert_eq!(manager.show(unit, "NFileDescriptorStore"), "2");
    started("restored");
    // A daemon that was read back keeps a ledger of its own: killed too, its successor reads
    // that one (the first was let go of).
    let restored = manager.show(unit, "MainPID");
    let pid = nix::unistd::Pid::from_raw(restored.parse().unwrap());
    nix::sys::signal::kill(pid, Signal::SIGKILL).unwrap();
    manager.wait(unit, "NRestarts", |n| n == "2");
    manager.wait(unit, "ActiveState", |s| s == "active");
    assert_eq!(&*reader.get(after).unwrap(), b"after the crash");
    assert!(
        pattern_matches(&reader.get(h).unwrap(), 37),
        "twice read back"
    );
    assert_eq!(manager.show(unit, "NFileDescriptorStore"), "2");

    manager.must(&["stop", unit]);
    assert_eq!(manager.show(unit, "ActiveState"), "inactive");
    assert_eq!(manager.show(unit, "MainPID"), "0");
    assert!(!socket.exists(), "the socket is removed");
    assert_eq!(manager.show(unit, "NFileDescriptorStore"), "0");
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(
        text.contains("handed over: this daemon stops serving"),
        "{text}"
    );
    assert_eq!(text.matches("read the store back").count(), 2, "{text}");
}

/// Clients in another pid namespace than the daemon's (the daemon in a container of its own:
/// their pid reads 0 to it) get back at a takeover what they held, as any client: the daemon
/// names each process by its pidfd (`SO_PEERPIDFD`), hands the pidfds over, and the successor
/// returns a process's leases to its new connections and drops them once its pidfd says it
/// exited.
#[test]
fn clients_in_another_pid_namespace_get_back_what_they_held_at_a_takeover() {
    if !is_root() || !feedstore_store::credentials::pidfs_names_processes() {
        eprintln!(
            "SKIPPED clients_in_another_pid_namespace: needs root to make pid namespaces, and \
             pidfs (Linux 6.9+) to name processes across them"
        );
        return;
    }
    let _w = watchdog("clients_in_another_pid_namespace", LIMIT);
    let dir = scratch_dir("takeover-pidns");
    let flags = ["--stream-idle-secs", "1"];
    // The daemon, and later its successor, each in a pid namespace of its own.
    let ns = ["unshare", "--pid", "--fork", "--kill-child"];
    let daemon = DaemonProcess::start_named(&dir, "feedstored", &ns, &flags);
    let writer = daemon.writer();
    let h = writer.put(b"held from another pid namespace").unwrap();
    let reconnect = [(feedstore_proto::RECONNECT_ENV, "20")];
    let spawn =
        |task: String| ClientProcess::spawn_via(&["env"], &daemon.socket, &task, &reconnect);
    let mut returning = Killed(spawn(format!("hold-until-told {h}")));
    let mut dying = spawn(format!("hold-leases {h}"));
    assert!(returning.0.ready().starts_with("3 "));
    assert_eq!(dying.ready(), "3");
    let log = daemon.log_text();
    assert!(
        log.contains("pid=0") && !log.contains(&format!("pid={}", std::process::id())),
        "the daemon sees its clients as pid 0: {log}"
    );
    let reader = daemon.reader();
    assert_eq!(reader.stats().unwrap().leases, 6);

    let daemon = daemon.take_over_via(&dir, &ns, &flags);
    let reader = daemon.reader();
    assert_eq!(reader.stats().unwrap().leases, 6, "held for both processes");
    // One dies without coming back: its pidfd says so, and what it held goes.
    dying.kill9();
    wait_for_leases(&reader, &daemon, 3);
    // The other returns its leases through a new connection, and is still running.
    returning.0.tell("release");
    assert_eq!(returning.0.ready(), "released after 1 reconnects");
    assert_eq!(reader.stats().unwrap().leases, 0);
    let log = daemon.log_text();
    assert!(!log.contains("release of a lease not held"), "{log}");
    assert!(
        log.contains("a client process gone since the hand-over"),
        "{log}"
    );
    returning.0.tell("exit");
    assert!(wait_child(&mut returning.0.child, Duration::from_secs(20)).success());
    assert_eq!(&*reader.get(h).unwrap(), b"held from another pid namespace");
}

/// A child process killed when the test ends, however it ends.
struct Killed(ClientProcess);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.child.kill();
        let _ = self.0.child.wait();
    }
}

/// What a Kubernetes DaemonSet's rolling update runs, each pod's daemon started alike:
/// `--takeover=auto` starts afresh where no daemon answers and takes over where one does;
/// the daemon handed over stays (`--stay-after-handover`), holding nothing, until SIGTERM,
/// instead of exiting for its supervisor to start it again; `--ready-file` is there exactly
/// while this daemon serves.
#[test]
fn a_daemon_started_alike_each_time_takes_over_or_starts_and_stays_until_told() {
    let _w = watchdog("a_daemon_started_alike_each_time", LIMIT);
    let dir = scratch_dir("takeover-auto");
    let (ready_a, ready_b) = (dir.join("a.ready"), dir.join("b.ready"));
    let flags = |ready: &std::path::Path| {
        vec![
            "--takeover=auto".to_owned(),
            "--stay-after-handover".to_owned(),
            "--ready-file".to_owned(),
            ready.display().to_string(),
        ]
    };
    let a_flags = flags(&ready_a);
    let a_flags: Vec<&str> = a_flags.iter().map(String::as_str).collect();
    let mut a = DaemonProcess::start(&dir, &a_flags);
    assert!(
        a.log_text()
            .contains("no daemon answers on the socket; starting afresh"),
        "{}",
        a.log_text()
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while !ready_a.exists() {
        assert!(std::time::Instant::now() < deadline, "a's ready file");
        std::thread::sleep(Duration::from_millis(10));
    }
    let writer = ConnectOptions::new(Role::Writer)
        .socket(&a.socket)
        .reconnect_timeout(Duration::from_secs(20))
        .connect()
        .unwrap();
    let h = writer.put(b"kept across the rolling update").unwrap();

    let b_flags = flags(&ready_b);
    let b_flags: Vec<&str> = b_flags.iter().map(String::as_str).collect();
    let mut b = DaemonProcess::start(&dir, &b_flags);
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while !ready_b.exists() || ready_a.exists() {
        assert!(
            std::time::Instant::now() < deadline,
            "b ready, a not: {}",
            a.log_text()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(&*writer.get(h).unwrap(), b"kept across the rolling update");
    assert_eq!(writer.reconnects(), 1);
    assert!(
        a.child.try_wait().unwrap().is_none(),
        "the daemon handed over stays until told"
    );
    assert!(a.log_text().contains("staying until SIGTERM"));
    // (Once its pre-fault, which may still run on a thread of its own, is done.)
    let memfds = || {
        std::fs::read_dir(format!("/proc/{}/fd", a.child.id()))
            .unwrap()
            .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
            .filter(|target| target.to_string_lossy().starts_with("/memfd:"))
            .count()
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while memfds() != 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the daemon handed over holds none of the store's memory"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let status = a.signal_and_wait(Signal::SIGTERM);
    assert!(status.success(), "{status}");
    assert!(b.socket.exists(), "the successor's socket is left alone");
    assert_eq!(&*writer.get(h).unwrap(), b"kept across the rolling update");
    assert!(b.signal_and_wait(Signal::SIGTERM).success());
    assert!(!ready_b.exists(), "removed when the daemon stops");
}

/// Waits (at most 30 s) until `daemon` counts `leases` leases in all.
fn wait_for_leases(reader: &feedstore_consumer::Client, daemon: &DaemonProcess, leases: u64) {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while reader.stats().unwrap().leases != leases {
        assert!(
            std::time::Instant::now() < deadline,
            "{}",
            daemon.log_text()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Leases each handle in `words` three times (a child's task).
fn lease_three_times<'a>(
    client: &feedstore_consumer::Client,
    words: impl Iterator<Item = &'a str>,
) -> Vec<feedstore_consumer::Lease> {
    let mut leases = Vec::new();
    for h in words {
        let h: Handle = h.parse().unwrap();
        for _ in 0..3 {
            leases.push(client.get(h).unwrap());
        }
    }
    leases
}

/// A daemon started in place of one that went away (a stale socket left at its path), on a
/// node short of the memory its store needs (the old daemon's clients hold the old store until
/// they reconnect), starts anyway and pre-faults later, instead of refusing the clients that
/// wait for it; the same capacity without a stale socket is refused.
#[test]
fn a_daemon_replacing_one_that_went_away_starts_short_of_memory() {
    let _w = watchdog("a_daemon_replacing_one_that_went_away", LIMIT);
    let dir = scratch_dir("short-of-memory");
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap();
    let available_kib: u64 = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap();
    // More than the node has (never touched: the memory is not pre-faulted meanwhile).
    let capacity = format!("{}MiB", available_kib / 1024 + 2048);
    let socket = dir.join("feedstored.sock");
    let refused = std::process::Command::new(env!("CARGO_BIN_EXE_feedstored"))
        .args(["--capacity", &capacity, "--huge-pages", "off", "--socket"])
        .arg(&socket)
        .output()
        .unwrap();
    assert!(!refused.status.success());
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("of memory available on this node"),
        "{}",
        String::from_utf8_lossy(&refused.stderr)
    );
    // The socket a daemon killed with kill -9 leaves: bound, nobody listening.
    drop(std::os::unix::net::UnixListener::bind(&socket).unwrap());
    let daemon = DaemonProcess::start(&dir, &["--capacity", &capacity, "--huge-pages", "off"]);
    assert!(
        daemon.log_text().contains("starting anyway"),
        "{}",
        daemon.log_text()
    );
    let writer = daemon.writer();
    let h = writer.put(b"served short of memory").unwrap();
    assert_eq!(&*daemon.reader().get(h).unwrap(), b"served short of memory");
}
