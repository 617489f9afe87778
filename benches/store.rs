//! Store-core benchmarks, each a ratio against a baseline measured in the same run:
//!
//! 1. put (reserve + copy into shared memory + seal) of 4 KiB to 16 MiB, plain and through a
//!    `PutPipeline` (next reservation ready, seal not waited for), vs a plain `memcpy` of the
//!    same bytes, both into destinations cycling through 16 regions (as a producer's are);
//! 2. get round trip (get + lease release) vs a bare Unix-socket ping-pong of the same frame
//!    sizes with a server process that does nothing else;
//! 3. small-object put + get operations per second, and batched gets;
//! 4. the stream hand-off (next sample from the ring to a validated view), interleaved with 2,
//!    and stream throughput with 1 and 8 consumers;
//! 5. the batch hand-off: 32 images of 448x448x3 f32 stacked by copying (what
//!    `next_batch(out=)` does) vs as one view of a batch a producer placed in one object;
//! 6. first touch: copying into (and reading from) a fresh mapping of allocated shared memory,
//!    page faults against page tables built first (`Mapping::populate_write`, what a writer
//!    does when it reserves an object) and against a mapping whose page tables exist.
//!
//! The daemon is the real `feedstored` binary in its own process; the ping-pong server is this
//! binary re-run in its own process. Run: `cargo bench --bench store` (add `-- --quick` for a
//! short run, `-- --first-touch` for table 6 alone, `-- --put` for table 1 alone,
//! `--no-write-through` to time the puts from a fresh store, `-- --ledger` for table 7 alone).
//!
//! 7. what keeping the object table in a ledger (`--fd-store`) costs the daemon: a lease and
//!    its release, and a create, seal and delete, on the object table itself (no socket),
//!    with a ledger and without, blocks interleaved.
//! 8. what resuming at another world size costs (`-- --reshard`, alone): mapping a sequence
//!    number to its record (what a producer does per sample) in a resharded stream's share
//!    against the same stream's ordinary epochs, blocks interleaved; the reshard itself and its
//!    text, for 1,024 ranks of an epoch of 10^9 records resumed at 768.

use std::hint::black_box;
use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use feedstore_consumer::{
    Client, ConnectOptions, Delivery, Made, Role, Stream, StreamFeeder, StreamOptions, StreamTask,
    stacked_image,
};
use feedstore_proto::Handle;
use feedstore_proto::frame::{Request, Response};
use feedstore_proto::stream::{Shuffle, StreamSpec, Tail};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|a| a == "--echo-server") {
        echo_server(
            Path::new(&args[i + 1]),
            args[i + 2].parse().unwrap(),
            args[i + 3].parse().unwrap(),
        );
        return;
    }
    let quick = args.iter().any(|a| a == "--quick");
    let scale = if quick { 10 } else { 1 };
    if args.iter().any(|a| a == "--reshard") {
        reshard_cost(quick);
        return;
    }
    if args.iter().any(|a| a == "--ledger") {
        // That table alone (the object table in this process).
        ledger_cost(quick);
        return;
    }
    if args.iter().any(|a| a == "--first-touch") {
        // That table alone (it needs no daemon).
        first_touch(quick);
        return;
    }

    let dir = std::env::temp_dir().join(format!("feedstore-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let socket = dir.join("feedstored.sock");
    let cpus = num_cpus();
    let daemon = Spawned::daemon(&socket);
    // Servers on the last CPU, this client on the first, so the baseline server and the daemon
    // pay the same cross-core wake-up (the scheduler's placement otherwise varies run to run).
    pin(daemon.0.id(), last_cpu());
    pin(0, 0);
    let writer = connect(&socket, Role::Writer);
    let reader = connect(&socket, Role::Reader);

    println!(
        "feedstore store-core benchmarks ({} cores, {}; servers pinned to CPU {}, client to CPU 0)",
        cpus,
        cpu_model(),
        last_cpu()
    );
    println!();
    // `--no-write-through`: the puts timed from a fresh store (the writer's first pass builds
    // its page tables as it goes), for the comparison BENCHMARKS.md records.
    let write_through = !args.iter().any(|a| a == "--no-write-through");
    put_vs_memcpy(
        &writer,
        &connect(&socket, Role::Writer),
        scale,
        write_through,
    );
    if args.iter().any(|a| a == "--put") {
        // That table alone.
        let _ = std::fs::remove_dir_all(&dir);
        return;
    }
    get_vs_ping_pong(&writer, &reader, &socket, &dir, scale);
    small_objects(&writer, &reader, scale);
    stream_throughput(&writer, &socket, scale);
    batch_handoff(&writer, &socket, scale);
    first_touch(quick);
    let _ = std::fs::remove_dir_all(&dir);
}

/// What the first write or read of each page of a process's mapping costs: a segment allocated
/// as the daemon allocates its own (`fallocate`), 4 MiB at a time (a sample), seconds per GiB.
/// Each round maps it afresh three times: written with faults; written with `populate_write`
/// first, then written again (page tables built); read with faults, then read again.
fn first_touch(quick: bool) {
    use feedstore_shm::{Access, HugePages, Mapping, Segment, SegmentOptions};
    const CHUNK: u64 = 4 << 20;
    let size: u64 = if quick { 256 << 20 } else { 1 << 30 };
    let seg = Segment::create(&SegmentOptions {
        name: "bench-first-touch".into(),
        size_bytes: size,
        huge_pages: HugePages::Off,
        prefault: true,
    })
    .unwrap();
    let map = |access| {
        let fd = match access {
            Access::ReadWrite => seg.fd().try_clone_to_owned().unwrap(),
            Access::ReadOnly => seg.reopen_readonly().unwrap(),
        };
        Mapping::new(fd, size, access, false).unwrap()
    };
    let src = vec![7u8; CHUNK as usize];
    let rounds = if quick { 1 } else { 3 };
    let mut secs = [0f64; 5];
    let write = |m: &Mapping, at: u64| {
        // SAFETY: this bench is the only user of the segment.
        unsafe { m.bytes_mut(at, CHUNK) }
            .unwrap()
            .copy_from_slice(&src);
    };
    let read = |m: &Mapping, at: u64| {
        // SAFETY: this bench is the only user of the segment.
        let bytes = unsafe { m.bytes(at, CHUNK) }.unwrap();
        black_box(bytes.iter().step_by(64).fold(0u8, |a, &b| a ^ b));
    };
    let pass = |m: &Mapping, each: &dyn Fn(&Mapping, u64)| {
        let t = Instant::now();
        for at in (0..size).step_by(CHUNK as usize) {
            each(m, at);
        }
        t.elapsed().as_secs_f64()
    };
    for _ in 0..rounds {
        secs[0] += pass(&map(Access::ReadWrite), &write);
        let built = map(Access::ReadWrite);
        secs[1] += pass(&built, &|m, at| {
            m.populate_write(at, CHUNK);
            write(m, at);
        });
        secs[2] += pass(&built, &write);
        let ro = map(Access::ReadOnly);
        secs[3] += pass(&ro, &read);
        secs[4] += pass(&ro, &read);
    }
    let per_gib = secs.map(|s| s / rounds as f64 / (size as f64 / f64::from(1u32 << 30)));
    println!(
        "## first touch of shared memory: seconds per GiB, 4 MiB at a time ({} MiB segment, {rounds} round(s))",
        size >> 20
    );
    println!();
    println!(
        "| write: copy into a fresh mapping (a fault per page) | write: `populate_write`, then copy | write: copy, page tables built | read: a fresh mapping (a fault per 64 KiB) | read: page tables built |"
    );
    println!("|---|---|---|---|---|");
    println!(
        "| {:.3} s | {:.3} s | {:.3} s | {:.3} s | {:.3} s |",
        per_gib[0], per_gib[1], per_gib[2], per_gib[3], per_gib[4]
    );
    println!();
}

fn connect(socket: &Path, role: Role) -> Client {
    ConnectOptions::new(role)
        .socket(socket)
        .name("bench")
        .connect()
        .expect("connecting to feedstored")
}

/// The bench daemon's store.
const STORE_BYTES: u64 = 512 << 20;

/// A child process killed on drop.
struct Spawned(Child);

impl Spawned {
    fn daemon(socket: &Path) -> Spawned {
        let child = Command::new(env!("CARGO_BIN_EXE_feedstored"))
            .args([
                "--socket",
                socket.to_str().unwrap(),
                "--capacity",
                &format!("{}MiB", STORE_BYTES >> 20),
                "--prefault",
                "true",
            ])
            .env("FEEDSTORE_LOG", "warn")
            .stdout(Stdio::null())
            .spawn()
            .expect("starting feedstored");
        wait_for_socket(socket);
        Spawned(child)
    }
}

impl Drop for Spawned {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn wait_for_socket(socket: &Path) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while UnixStream::connect(socket).is_err() {
        assert!(
            Instant::now() < deadline,
            "{} never came up",
            socket.display()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Baseline and subject alternate in blocks, so both see the same machine state (this 2-vCPU VM's
/// timing drifts between runs by more than the effects measured here).
/// Destinations a put or memcpy cycles through: a producer writes each sample into memory no
/// recent sample used, so from 4 MiB up neither side's destination stays in the cache (16 × 4 MiB
/// is twice this machine's L3; the small objects' 16 regions stay cached either way).
const RING: usize = 16;

/// `deleter`, a connection of its own, deletes old objects (untimed) so the puts' connection
/// carries nothing but the puts: a delete on it would first read the pipeline's replies aside,
/// taking that wait out of the timed puts.
fn put_vs_memcpy(writer: &Client, deleter: &Client, scale: u64, write_through: bool) {
    println!(
        "## put vs memcpy (same bytes; destinations cycle through {RING} regions, as a producer's do; blocks interleaved)"
    );
    println!();
    println!(
        "| object | put | memcpy GB/s (p50) | put GB/s (p50) | put / memcpy (p50) | put p50 | put p99 | memcpy p99 | put / memcpy (p99) |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    if write_through {
        write_through_the_store(writer, deleter);
    }
    for (size, iters) in [
        (4usize << 10, 20_000u64),
        (64 << 10, 10_000),
        (4 << 20, 1_000),
        (16 << 20, 200),
    ] {
        let iters = iters / scale;
        let src: Vec<u8> = (0..size).map(|i| i as u8).collect();
        // Baseline: copies into already-faulted buffers, as the store's pre-faulted segment is.
        let mut dsts: Vec<Vec<u8>> = (0..RING).map(|_| vec![1u8; size]).collect();
        let (mut memcpy, mut put, mut piped) = (Vec::new(), Vec::new(), Vec::new());
        let mut pipeline = writer.put_pipeline();
        // Blocks of each in turn, as a steady producer puts back to back (interleaving single
        // iterations would leave the daemon idle through every memcpy, which a producer's
        // stream of puts does not).
        let block = (iters / 20).clamp(10, 200) as usize;
        let mut next = 0;
        for round in 0..(iters as usize / block).max(1) + 1 {
            for _ in 0..block {
                let dst = &mut dsts[next % RING];
                next += 1;
                let t = Instant::now();
                dst.copy_from_slice(black_box(&src));
                black_box(dst);
                if round > 0 {
                    memcpy.push(t.elapsed());
                }
            }
            // The objects of the last RING puts stay; older ones are deleted (untimed), so the
            // store reuses space no recent put wrote.
            let timed = |put_one: &mut dyn FnMut() -> Handle, times: &mut Vec<Duration>| {
                let mut live = std::collections::VecDeque::new();
                for _ in 0..block {
                    let t = Instant::now();
                    let h = put_one();
                    let p = t.elapsed();
                    live.push_back(h);
                    if live.len() >= RING {
                        deleter.delete(live.pop_front().unwrap()).unwrap();
                    }
                    if round > 0 {
                        times.push(p);
                    }
                }
                live
            };
            let mut live = timed(&mut || writer.put(black_box(&src)).unwrap(), &mut put);
            deleter.delete_batch(live.make_contiguous()).unwrap();
            // The same through a pipeline: the next reservation asked for before the copy, the
            // seal sent without waiting. The object deleted is RING puts old: its seal was
            // served long before.
            let mut live = timed(&mut || pipeline.put(black_box(&src)).unwrap(), &mut piped);
            pipeline.flush().unwrap();
            deleter.delete_batch(live.make_contiguous()).unwrap();
        }
        drop(pipeline);
        for v in [&mut memcpy, &mut put, &mut piped] {
            v.sort_unstable();
        }
        let gbps = |d: Duration| size as f64 / d.as_secs_f64() / 1e9;
        for (name, put) in [("put", &put), ("put_pipeline", &piped)] {
            println!(
                "| {} | {name} | {:.2} | {:.2} | {:.2}x | {} | {} | {} | {:.2}x |",
                human(size as u64),
                gbps(pct(&memcpy, 0.5)),
                gbps(pct(put, 0.5)),
                pct(&memcpy, 0.5).as_secs_f64() / pct(put, 0.5).as_secs_f64(),
                us(pct(put, 0.50)),
                us(pct(put, 0.99)),
                us(pct(&memcpy, 0.99)),
                pct(&memcpy, 0.99).as_secs_f64() / pct(put, 0.99).as_secs_f64(),
            );
        }
    }
    println!();
}

/// A producer in its steady state has written through the whole store before: its page tables
/// are built (its first pass costs more, see `first_touch`). So does the writer here, untimed,
/// before the puts are timed: objects of 16 MiB until the store has been filled (or said it
/// is full), then deleted.
fn write_through_the_store(writer: &Client, deleter: &Client) {
    let chunk = vec![0u8; 16 << 20];
    let mut live = Vec::new();
    for _ in 0..(STORE_BYTES / chunk.len() as u64) {
        match writer.put(&chunk) {
            Ok(h) => live.push(h),
            Err(_) => break, // full: every page it could give is written
        }
    }
    for h in live {
        let _ = deleter.delete(h); // (evicted already, if the store made room that way)
    }
}

fn get_vs_ping_pong(writer: &Client, reader: &Client, socket: &Path, dir: &Path, scale: u64) {
    let iters = 50_000 / scale;
    let h = writer.put(&vec![7u8; 4 << 20]).unwrap();
    // The exact frame sizes a get exchanges.
    let (mut req, mut resp) = (Vec::new(), Vec::new());
    Request::Get { handles: vec![h] }
        .encode(1, feedstore_proto::frame::MAX_PAYLOAD_BYTES, &mut req)
        .unwrap();
    Response::Got(vec![Ok(feedstore_proto::frame::Got {
        location: feedstore_proto::Location {
            segment: 0,
            offset: 0,
            len: 1,
        },
        writer: 0,
    })])
    .encode(
        feedstore_proto::frame::Opcode::Get,
        1,
        feedstore_proto::frame::MAX_PAYLOAD_BYTES,
        &mut resp,
    )
    .unwrap();
    let echo_socket = dir.join("echo.sock");
    let echo = spawn_echo(&echo_socket, req.len(), resp.len());
    pin(echo.0.id(), last_cpu());
    let mut stream = UnixStream::connect(&echo_socket).unwrap();
    let mut reply = vec![0u8; resp.len()];
    let kept_reader = connect(socket, Role::Reader);
    let mut kept = Vec::with_capacity(1000);
    // A stream whose producer (a thread pinned with the servers) keeps the ring full of one
    // real sample, so each next_sample below is the fast path: ring slot -> validated view.
    let sample = sample_object(writer);
    let spec = stream_spec("bench-handoff", 1);
    let feeding = feed_stream(socket, &spec, sample, 1024);
    let mut ranks = Stream::open(
        socket,
        &spec,
        0,
        None,
        StreamOptions {
            return_batch: 256,
            ..StreamOptions::default()
        },
    )
    .unwrap();
    std::thread::sleep(Duration::from_millis(200)); // the ring fills
    let (mut ping, mut get, mut get_release, mut get_kept, mut handoff) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    // Blocks of BLOCK iterations of each path in turn: each path runs in its own steady state,
    // and drift over the run hits all of them alike. The first block of each is warm-up.
    const BLOCK: u64 = 200;
    for block in 0..(iters / BLOCK).max(1) + 1 {
        let warm = block > 0;
        for _ in 0..BLOCK {
            let t = Instant::now();
            stream.write_all(&req).unwrap();
            stream.read_exact(&mut reply).unwrap();
            if warm {
                ping.push(t.elapsed());
            }
        }
        for _ in 0..BLOCK {
            // A get whose lease is dropped at once; its release rides with the next request.
            let t = Instant::now();
            let lease = reader.get(h).unwrap();
            let g = t.elapsed();
            black_box(lease[0]);
            drop(lease);
            if warm {
                get.push(g);
                get_release.push(t.elapsed());
            }
        }
        for _ in 0..BLOCK {
            // A get on a connection that keeps its leases (dropped 1000 at a time).
            let t = Instant::now();
            kept.push(kept_reader.get(h).unwrap());
            if warm {
                get_kept.push(t.elapsed());
            }
            if kept.len() == 1000 {
                kept.clear();
            }
        }
        for _ in 0..BLOCK {
            // The stream hand-off: next sample from the ring, validated, dropped.
            let t = Instant::now();
            let s = ranks.next_sample().unwrap().unwrap();
            let view = s.view().unwrap();
            black_box(view.tokens().len());
            drop(s);
            if warm {
                handoff.push(t.elapsed());
            }
        }
    }
    drop(kept);
    drop(ranks);
    feeding.stop();
    // Batched: 64 handles per round trip.
    let batch: Vec<Handle> = (0..64)
        .map(|i| writer.put(&[i as u8; 4096]).unwrap())
        .collect();
    let rounds = iters / 64;
    let t = Instant::now();
    for _ in 0..rounds {
        let leases = reader.get_batch(&batch).unwrap();
        black_box(&leases);
    }
    let per_object_batched = t.elapsed() / (rounds * 64) as u32;
    let handoff_mean = handoff.iter().sum::<Duration>() / handoff.len().max(1) as u32;
    for v in [
        &mut ping,
        &mut get,
        &mut get_release,
        &mut get_kept,
        &mut handoff,
    ] {
        v.sort_unstable();
    }
    println!(
        "## get round trip vs bare Unix-socket ping-pong ({}-byte request, {}-byte reply, blocks of 200 interleaved)",
        req.len(),
        resp.len()
    );
    println!();
    println!("| path | p50 | p99 | p50 / ping-pong p50 |");
    println!("|---|---|---|---|");
    let row = |name: &str, v: &[Duration]| {
        println!(
            "| {name} | {} | {} | {:.2}x |",
            us(pct(v, 0.5)),
            us(pct(v, 0.99)),
            pct(v, 0.5).as_secs_f64() / pct(&ping, 0.5).as_secs_f64()
        )
    };
    row("bare socket ping-pong (baseline)", &ping);
    row("get: handle -> zero-copy view of a 4 MiB object", &get);
    row(
        "get + drop (release rides with the next request)",
        &get_release,
    );
    row("get on a connection holding its leases", &get_kept);
    row(
        "stream hand-off: next_sample -> validated SampleView -> drop (no round trip)",
        &handoff,
    );
    println!(
        "| get_batch of 64, per object | {} | | {:.2}x |",
        us(per_object_batched),
        per_object_batched.as_secs_f64() / pct(&ping, 0.5).as_secs_f64()
    );
    println!();
    println!(
        "stream hand-off: mean {} (every 256th sample also sends the one-way return of the last 256), max {}",
        us(handoff_mean),
        us(*handoff.last().unwrap_or(&Duration::ZERO))
    );
    println!();
}

fn small_objects(writer: &Client, reader: &Client, scale: u64) {
    let iters = 20_000 / scale;
    let payload = [42u8; 64];
    let t = Instant::now();
    let mut handles = Vec::with_capacity(iters as usize);
    for _ in 0..iters {
        let h = writer.put(&payload).unwrap();
        drop(reader.get(h).unwrap());
        handles.push(h);
    }
    let pair = t.elapsed();
    let t = Instant::now();
    for h in &handles {
        drop(black_box(reader.get(*h).unwrap()));
    }
    let gets = t.elapsed();
    // Batched puts: 64 objects per create round trip and per seal round trip.
    let blobs: Vec<Vec<u8>> = (0..64).map(|i| vec![i as u8; 4096]).collect();
    let refs: Vec<&[u8]> = blobs.iter().map(Vec::as_slice).collect();
    let rounds = (iters / 64).max(1);
    let t = Instant::now();
    for _ in 0..rounds {
        let handles = writer.put_batch(&refs).unwrap();
        writer.delete_batch(&handles).unwrap();
    }
    let batched = t.elapsed() / (rounds * 64) as u32;
    println!("## small objects (64 B)");
    println!();
    println!("| operation | per second | per operation |");
    println!("|---|---|---|");
    println!(
        "| put + get (one of each) | {:.0} | {} |",
        iters as f64 / pair.as_secs_f64(),
        us(pair / iters as u32)
    );
    println!(
        "| get + release | {:.0} | {} |",
        iters as f64 / gets.as_secs_f64(),
        us(gets / iters as u32)
    );
    println!(
        "| put_batch of 64 x 4 KiB + delete_batch, per object | {:.0} | {} |",
        1.0 / batched.as_secs_f64(),
        us(batched)
    );
    println!("| Ray 2.60 `ray.get`, this machine (reference, not this run) | 3,769 | 265 us |");
    println!();
}

fn spawn_echo(socket: &Path, req: usize, resp: usize) -> Spawned {
    let child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--echo-server",
            socket.to_str().unwrap(),
            &req.to_string(),
            &resp.to_string(),
        ])
        .spawn()
        .unwrap();
    wait_for_socket(socket);
    Spawned(child)
}

/// The baseline server: reads a request of `req` bytes, answers `resp` bytes, nothing else.
fn echo_server(socket: &Path, req: usize, resp: usize) {
    let _ = std::fs::remove_file(socket);
    let listener = UnixListener::bind(socket).unwrap();
    let mut inbuf = vec![0u8; req];
    let outbuf = vec![0u8; resp];
    for stream in listener.incoming() {
        let Ok(mut stream) = stream else { continue };
        while stream.read_exact(&mut inbuf).is_ok() {
            if stream.write_all(&outbuf).is_err() {
                break;
            }
        }
    }
}

/// The last CPU this process may run on, read once before any pinning.
fn last_cpu() -> usize {
    static LAST: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *LAST.get_or_init(|| num_cpus().saturating_sub(1))
}

/// Pins a process (0 = this one) to one CPU.
fn pin(pid: u32, cpu: usize) {
    let mut set = nix::sched::CpuSet::new();
    if set.set(cpu).is_ok() {
        let _ = nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(pid as i32), &set);
    }
}

fn pct(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() - 1) as f64 * p) as usize]
}

fn us(d: Duration) -> String {
    format!("{:.1} us", d.as_secs_f64() * 1e6)
}

fn human(b: u64) -> String {
    if b >= 1 << 20 {
        format!("{} MiB", b >> 20)
    } else {
        format!("{} KiB", b >> 10)
    }
}

/// Where a ledger is kept in this table: held in this process (what the service manager's
/// descriptor store does for the daemon, which it is told of only when a ledger is replaced,
/// once per doubling; none happens in the timed loops).
struct KeptHere(Vec<std::os::fd::OwnedFd>);

impl feedstore_store::objects::ledger::LedgerStore for KeptHere {
    fn generation(&self) -> u64 {
        self.0.len() as u64 + 1
    }
    fn segment_ids(&self) -> Vec<u64> {
        vec![1]
    }
    fn keep(
        &mut self,
        ledger: std::os::fd::BorrowedFd<'_>,
        _generation: u64,
        _replaces: Option<u64>,
    ) -> std::io::Result<()> {
        self.0.push(ledger.try_clone_to_owned()?);
        Ok(())
    }
    fn forget(&mut self, _generation: u64) {}
}

/// Table 7: nanoseconds per lease + release and per create + seal + delete on the object
/// table, with a ledger kept and without, in interleaved blocks (the daemon does these under
/// its objects lock; a get's round trip over the socket is some 17-24 µs around them).
fn reshard_cost(quick: bool) {
    use feedstore_proto::reshard::Reshard;
    use feedstore_proto::stream::StreamState;
    let old = StreamSpec {
        name: "bench".into(),
        records: 1_000_000_000,
        seed: 3,
        world: 1024,
        shuffle: Shuffle::Full,
        tail: Tail::Drop,
        epochs: Some(3),
        reshard: None,
    };
    let per_rank = old.per_rank();
    let (mut together, mut apart) = (Vec::new(), Vec::new());
    for r in 0..old.world {
        together.push(StreamState::at(&old, r, per_rank / 2));
        // Positions spread over the second half of the epoch.
        let seq = per_rank / 2 + u64::from(r) * 97_531 % (per_rank / 2);
        apart.push(StreamState::at(&old, r, seq));
    }
    let t = Instant::now();
    let reshard = Reshard::new(&old, &apart, 768).unwrap();
    let made = t.elapsed();
    let stopped_together = Reshard::new(&old, &together, 768).unwrap().to_text().len();
    let text = reshard.to_text().len();
    let resharded = reshard.spec();
    let plain = resharded.plain();
    let share = reshard.share(5);
    let rounds = if quick { 20 } else { 200 };
    let block = 10_000u64;
    let mut took = [Duration::ZERO; 2];
    for round in 0..rounds {
        let base = round * block % (share - block);
        let t = Instant::now();
        for seq in base..base + block {
            black_box(resharded.record_at(5, black_box(seq)));
        }
        took[0] += t.elapsed();
        let t = Instant::now();
        for seq in base..base + block {
            black_box(plain.record_at(5, black_box(seq)));
        }
        took[1] += t.elapsed();
    }
    let ns = |d: Duration| d.as_nanos() as f64 / (rounds * block) as f64;
    println!(
        "8. resuming 1,024 ranks of an epoch of 10^9 records at 768 ({rounds} x {block} sequence numbers each, interleaved)"
    );
    println!();
    println!("| | figure |");
    println!("|---|---|");
    println!(
        "| record of a sequence number, inside the share of the reshard | {:.0} ns |",
        ns(took[0])
    );
    println!(
        "| record of a sequence number, ordinary epochs | {:.0} ns |",
        ns(took[1])
    );
    println!("| ratio | {:.2}x |", ns(took[0]) / ns(took[1]));
    println!(
        "| `Reshard::new`, ranks at 1,024 different positions | {:.2} ms |",
        made.as_secs_f64() * 1e3
    );
    println!("| its text, ranks at 1,024 different positions | {text} bytes |");
    println!("| its text, ranks stopped together | {stopped_together} bytes |");
}

fn ledger_cost(quick: bool) {
    use feedstore_store::objects::{ClientInfo, Objects, Process};
    let table = |ledger: bool| {
        let mut o = Objects::new(1, 1, &[1 << 30], false);
        if ledger {
            o.keep_ledger(Box::new(KeptHere(Vec::new()))).unwrap();
        }
        let info = |role, key| ClientInfo {
            role,
            uid: 0,
            pid: 1,
            process: Process {
                key,
                pidfd: None,
                started: 0,
            },
            name: String::new(),
            internal: false,
            capped: false,
        };
        let w = o.connect(info(Role::Writer, 10));
        let r = o.connect(info(Role::Reader, 20));
        let handles: Vec<Handle> = (0..1024)
            .map(|_| {
                let c = o.create(w, 4096, false).unwrap();
                o.seal(w, c.handle).unwrap();
                c.handle
            })
            .collect();
        (o, w, r, handles)
    };
    let (mut plain, mut kept) = (table(false), table(true));
    let rounds = if quick { 20 } else { 200 };
    let block = 10_000;
    let mut lease = [Duration::ZERO; 2];
    let mut create = [Duration::ZERO; 2];
    for _ in 0..rounds {
        for (i, (o, w, r, handles)) in [&mut plain, &mut kept].into_iter().enumerate() {
            let t = Instant::now();
            for n in 0..block {
                let h = handles[n % handles.len()];
                o.get(*r, h).unwrap();
                o.release(*r, h).unwrap();
            }
            lease[i] += t.elapsed();
            let t = Instant::now();
            for _ in 0..block {
                let c = o.create(*w, 4096, false).unwrap();
                o.seal(*w, c.handle).unwrap();
                o.delete(*w, c.handle).unwrap();
            }
            create[i] += t.elapsed();
        }
    }
    let ns = |d: Duration| d.as_nanos() as f64 / f64::from(rounds * block as u32);
    println!(
        "7. the object table with a ledger kept (--fd-store) and without ({rounds} x {block} each, interleaved)"
    );
    println!();
    println!("| operation | without | with a ledger | added |");
    println!("|---|---|---|---|");
    for (what, d) in [
        ("lease + release", lease),
        ("create + seal + delete", create),
    ] {
        println!(
            "| {what} | {:.0} ns | {:.0} ns | {:+.0} ns |",
            ns(d[0]),
            ns(d[1]),
            ns(d[1]) - ns(d[0])
        );
    }
    println!();
}

fn num_cpus() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_owned())
        })
        .unwrap_or_else(|| "unknown CPU".into())
}

/// A small real sample (one 3x32x32 u8 image, 64 tokens), sealed.
fn sample_object(writer: &Client) -> Handle {
    use feedstore_proto::sample::{DType, SampleInfo, SamplePlan, TensorLayout};
    let mut plan = SamplePlan::new();
    plan.add_image(DType::U8, TensorLayout::Chw, &[3, 32, 32]);
    plan.set_token_count(64);
    let info = SampleInfo {
        id: "bench".into(),
        source_keys: vec!["s3://bench/0.jpg".into()],
        image_grid_thw: vec![[1, 2, 2]],
        metadata: Vec::new(),
    };
    let mut w = writer.create(plan.object_bytes(&info)).unwrap();
    {
        let mut regions = plan.regions(w.as_mut_slice()).unwrap();
        regions.images[0].fill(9);
        regions.tokens.fill(7);
        regions.labels.fill(7);
    }
    plan.finish(w.as_mut_slice(), &info).unwrap();
    w.seal().unwrap()
}

fn stream_spec(name: &str, world: u32) -> StreamSpec {
    StreamSpec {
        name: name.into(),
        records: 1 << 40,
        seed: 1,
        world,
        shuffle: Shuffle::Full,
        tail: Tail::Drop,
        epochs: Some(1),
        reshard: None,
    }
}

/// A producer thread (pinned with the servers) putting one sample object for every task.
struct Feeding {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<u64>,
}

impl Feeding {
    fn stop(self) -> u64 {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.thread.join().unwrap()
    }
}

fn feed_stream(socket: &Path, spec: &StreamSpec, sample: Handle, depth: u32) -> Feeding {
    feed_with(socket, spec, depth, 1, move |_| Made::Existing(sample))
}

/// A producer thread (pinned with the servers) putting what `made` says for every task, on a
/// stream whose ranks hand out `batch` tasks at a time.
fn feed_with(
    socket: &Path,
    spec: &StreamSpec,
    depth: u32,
    batch: u32,
    made: impl Fn(StreamTask) -> Made + Send + 'static,
) -> Feeding {
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (socket, spec, flag) = (socket.to_owned(), spec.clone(), stop.clone());
    let thread = std::thread::spawn(move || {
        pin(0, last_cpu());
        let client = connect(&socket, Role::Writer);
        let ranks: Vec<StreamTask> = (0..spec.world)
            .map(|rank| StreamTask { rank, seq: 0 })
            .collect();
        let feeder = StreamFeeder::join_batched(&client, &spec, depth, batch, &ranks).unwrap();
        let mut put = 0;
        while !flag.load(std::sync::atomic::Ordering::Relaxed) {
            let Some(tasks) = feeder.take(256, Duration::from_millis(20)).unwrap() else {
                break;
            };
            let made = tasks
                .into_iter()
                .map(|task| Delivery {
                    task,
                    record: 0,
                    key: 0,
                    made: made(task),
                })
                .collect::<Vec<_>>();
            put += made.len() as u64;
            if !made.is_empty() {
                feeder.put(made).unwrap();
            }
        }
        feeder.close().unwrap();
        put
    });
    Feeding { stop, thread }
}

/// Samples per second through streams: 1 and 8 ranks reading at once, each sample validated.
fn stream_throughput(writer: &Client, socket: &Path, scale: u64) {
    let sample = sample_object(writer);
    let per_consumer = 200_000 / scale;
    println!(
        "## stream throughput (one producer thread putting one ready sample; each consumer validates every sample)"
    );
    println!();
    println!("| consumers | samples/s, all together | per consumer |");
    println!("|---|---|---|");
    for world in [1u32, 8] {
        let spec = stream_spec(&format!("bench-throughput-{world}"), world);
        let feeding = feed_stream(socket, &spec, sample, 256);
        let started = Instant::now();
        let consumers: Vec<_> = (0..world)
            .map(|rank| {
                let (socket, spec) = (socket.to_owned(), spec.clone());
                std::thread::spawn(move || {
                    let mut stream = Stream::open(
                        &socket,
                        &spec,
                        rank,
                        None,
                        StreamOptions {
                            return_batch: 32,
                            ..StreamOptions::default()
                        },
                    )
                    .unwrap();
                    for _ in 0..per_consumer / u64::from(world) {
                        let s = stream.next_sample().unwrap().unwrap();
                        black_box(s.view().unwrap().tokens().len());
                    }
                })
            })
            .collect();
        for c in consumers {
            c.join().unwrap();
        }
        let total = (per_consumer / u64::from(world)) * u64::from(world);
        let rate = total as f64 / started.elapsed().as_secs_f64();
        feeding.stop();
        println!("| {world} | {:.0} | {:.0} |", rate, rate / f64::from(world));
    }
    println!();
}

/// Images per batch and their shape in the batch hand-off (the trial: Qwen-VL-sized
/// 448x448 RGB, f32 CHW, 2.4 MB each).
const BATCH: usize = 32;
const BIG_IMAGE: [u32; 3] = [3, 448, 448];

fn big_plan() -> (
    feedstore_proto::sample::SamplePlan,
    feedstore_proto::sample::SampleInfo,
) {
    use feedstore_proto::sample::{DType, SampleInfo, SamplePlan, TensorLayout};
    let mut plan = SamplePlan::new();
    plan.add_image(DType::F32, TensorLayout::Chw, &BIG_IMAGE);
    plan.set_token_count(256);
    let info = SampleInfo {
        id: "bench".into(),
        source_keys: vec!["s3://bench/0.jpg".into()],
        image_grid_thw: vec![[1, 32, 32]],
        metadata: Vec::new(),
    };
    (plan, info)
}

/// The batch hand-off: what a trainer's step waits for between asking for a batch of 32 ready
/// images and holding them as one stacked tensor. Baseline: `next_batch(32)` and a copy of each
/// image into a stacked buffer (what `next_batch(out=)` does; 32 samples of their own, distinct
/// objects). Subject: `next_batch(32)` and `stacked_image`, one view of a batch a producer
/// placed in one object. Both streams are kept full by producer threads putting ready objects
/// (so neither side waits for data); blocks of 16 batches alternate.
fn batch_handoff(writer: &Client, socket: &Path, scale: u64) {
    use feedstore_proto::sample::BatchPlan;
    // 32 samples of their own.
    let singles: Vec<Handle> = (0..BATCH)
        .map(|i| {
            let (plan, info) = big_plan();
            let mut w = writer.create(plan.object_bytes(&info)).unwrap();
            {
                let mut regions = plan.regions(w.as_mut_slice()).unwrap();
                bytemuck::cast_slice_mut::<u8, f32>(regions.images[0]).fill(i as f32);
                regions.tokens.fill(7);
            }
            plan.finish(w.as_mut_slice(), &info).unwrap();
            w.seal().unwrap()
        })
        .collect();
    // The same 32 placed as one batch.
    let (plans, infos): (Vec<_>, Vec<_>) = (0..BATCH).map(|_| big_plan()).unzip();
    let plan = BatchPlan::new(plans, &infos).unwrap();
    let mut w = writer.create(plan.object_bytes()).unwrap();
    for (i, info) in infos.iter().enumerate() {
        let mut regions = plan.regions(w.as_mut_slice(), i).unwrap();
        bytemuck::cast_slice_mut::<u8, f32>(regions.images[0]).fill(i as f32);
        regions.tokens.fill(7);
        plan.finish(w.as_mut_slice(), i, info).unwrap();
    }
    let placed = w.seal().unwrap();
    let starts: Vec<u64> = (0..BATCH).map(|i| plan.start(i)).collect();

    let depth = 16 * BATCH as u32;
    let copy_spec = stream_spec("bench-batch-copy", 1);
    let view_spec = stream_spec("bench-batch-view", 1);
    let feeding = [
        feed_with(socket, &copy_spec, depth, 1, move |t| {
            Made::Existing(singles[t.seq as usize % BATCH])
        }),
        feed_with(socket, &view_spec, depth, BATCH as u32, move |t| {
            Made::Part {
                handle: placed,
                offset: starts[t.seq as usize % BATCH],
            }
        }),
    ];
    let open =
        |spec: &StreamSpec| Stream::open(socket, spec, 0, None, StreamOptions::default()).unwrap();
    let (mut copying, mut viewing) = (open(&copy_spec), open(&view_spec));
    let per_image: usize = BIG_IMAGE.iter().map(|&d| d as usize).product::<usize>() * 4;
    // The stacked destination, touched once so page faults are not timed.
    let mut out = vec![1u8; BATCH * per_image];
    let (mut copied, mut viewed) = (Vec::new(), Vec::new());
    let blocks = 8 / scale.min(4);
    for _ in 0..blocks {
        // Let both producers fill their windows (16 batches each).
        std::thread::sleep(Duration::from_millis(300));
        for _ in 0..16 {
            let t = Instant::now();
            let batch = copying.next_batch(BATCH).unwrap();
            for (s, dst) in batch.iter().zip(out.chunks_mut(per_image)) {
                dst.copy_from_slice(s.view().unwrap().image(0).unwrap().bytes());
            }
            black_box(&out);
            copied.push(t.elapsed());
            drop(batch);
        }
        for _ in 0..16 {
            let t = Instant::now();
            let batch = viewing.next_batch(BATCH).unwrap();
            let stacked = stacked_image(&batch, 0)
                .unwrap()
                .expect("placed side by side");
            black_box(stacked.bytes.len());
            viewed.push(t.elapsed());
            drop(batch);
        }
    }
    drop((copying, viewing));
    for f in feeding {
        f.stop();
    }
    copied.sort();
    viewed.sort();
    let mean = |v: &[Duration]| v.iter().sum::<Duration>() / v.len() as u32;
    println!(
        "## batch hand-off: {BATCH} images of {}x{}x{} f32 ({} per batch), ready in the ring; {} batches each, blocks of 16 alternating",
        BIG_IMAGE[0],
        BIG_IMAGE[1],
        BIG_IMAGE[2],
        human((BATCH * per_image) as u64),
        copied.len()
    );
    println!();
    println!("| per batch | p50 | p99 | mean | vs copy (p50) |");
    println!("|---|---|---|---|---|");
    for (name, v) in [
        (
            "next_batch + copy into a stacked buffer (next_batch(out=), baseline)",
            &copied,
        ),
        (
            "next_batch + stacked_image: one view of a batch placed in one object",
            &viewed,
        ),
    ] {
        println!(
            "| {name} | {} | {} | {} | {:.0}x |",
            us(pct(v, 0.5)),
            us(pct(v, 0.99)),
            us(mean(v)),
            pct(&copied, 0.5).as_secs_f64() / pct(v, 0.5).as_secs_f64()
        );
    }
    println!();
}
