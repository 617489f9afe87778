//! `feedstore check`: the store exercised end to end through the real socket and shared memory.
//!
//! A producer thread writes objects (reserve, fill in place, seal) and hands their handles to
//! reader threads over a bounded queue; each reader gets the object by handle, verifies every
//! byte against the pattern the producer wrote, and drops the lease. The store is smaller than
//! what the producer writes, so LRU eviction and backpressure take part too.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use feedstore_consumer::{Client, ConnectOptions, Handle};
use feedstore_proto::Role;
use feedstore_store::config::{format_bytes, parse_bytes};

use crate::SocketArg;

/// Arguments of `feedstore check`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Use the daemon already listening here instead of starting an embedded one.
    #[command(flatten)]
    socket: SocketArg,
    /// Capacity of the embedded daemon.
    #[arg(long, value_name = "SIZE", default_value = "256MiB", value_parser = parse_bytes)]
    capacity: u64,
    /// Number of large objects the producer writes.
    #[arg(long, value_name = "N", default_value_t = 1500)]
    objects: u64,
    /// Size of each large object.
    #[arg(long, value_name = "SIZE", default_value = "4MiB", value_parser = parse_bytes)]
    object_size: u64,
    /// Reader threads, each with its own connection.
    #[arg(long, value_name = "N", default_value_t = 2)]
    readers: usize,
    /// Small (4 KiB) put + get round trips for the operations-per-second figure.
    #[arg(long, value_name = "N", default_value_t = 20_000)]
    small_ops: u64,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    if args.objects == 0 || args.object_size < 8 || args.readers == 0 {
        bail!("--objects and --readers must be at least 1 and --object-size at least 8 bytes");
    }
    let (socket, _daemon) = match &args.socket.socket {
        Some(path) => {
            eprintln!("using the daemon at {}", path.display());
            (path.clone(), None)
        }
        None => {
            let started = Instant::now();
            let (socket, daemon) = crate::EmbeddedDaemon::start("check", args.capacity)?;
            eprintln!(
                "started an embedded feedstored: {} of shared memory, pre-faulted in {:.0} ms, socket {}",
                format_bytes(args.capacity),
                started.elapsed().as_secs_f64() * 1e3,
                socket.display()
            );
            (socket, Some(daemon))
        }
    };
    let connect = |role, name: &str| {
        ConnectOptions::new(role)
            .socket(&socket)
            .name(name)
            .connect()
            .context("connecting to the daemon")
    };
    let writer = connect(Role::Writer, "demo-producer")?;
    large_objects(&args, &writer, &connect)?;
    let reader = connect(Role::Reader, "demo-small-reader")?;
    small_objects(&args, &writer, &reader)?;
    // Asked on the reader's connection: its last release is still queued and rides in the same
    // send, so the figures show the store at rest.
    let s = reader.stats()?;
    println!(
        "store: {} used of {}, {} objects, {} leases, {} evictions ({}), {} creates waited for space, fragmentation {:.1}%",
        format_bytes(s.used_bytes),
        format_bytes(s.capacity_bytes),
        s.objects_sealed,
        s.leases,
        s.evictions,
        format_bytes(s.evicted_bytes),
        s.creates_waited,
        100.0 * s.fragmentation()
    );
    Ok(())
}

/// Phase 1: large objects, one producer to `--readers` readers, every byte verified.
fn large_objects(
    args: &Args,
    writer: &Client,
    connect: &dyn Fn(Role, &str) -> anyhow::Result<Client>,
) -> anyhow::Result<()> {
    eprintln!(
        "phase 1: {} objects of {} from 1 producer to {} readers (writes {} through a {} store)",
        args.objects,
        format_bytes(args.object_size),
        args.readers,
        format_bytes(args.objects * args.object_size),
        format_bytes(writer.stats()?.capacity_bytes),
    );
    let read = Arc::new(AtomicU64::new(0));
    let (tx, rx) = mpsc::sync_channel::<(u64, Handle)>(16);
    let rx = Arc::new(std::sync::Mutex::new(rx));
    let mut reader_threads = Vec::new();
    for r in 0..args.readers {
        let client = connect(Role::Reader, &format!("demo-reader-{r}"))?;
        let (rx, read) = (rx.clone(), read.clone());
        reader_threads.push(std::thread::spawn(move || read_loop(&client, &rx, &read)));
    }
    let started = Instant::now();
    let mut put_time = Duration::ZERO;
    let mut last_report = Instant::now();
    for i in 0..args.objects {
        let t = Instant::now();
        let mut w = writer.create(args.object_size)?;
        fill(w.as_mut_slice(), i);
        let handle = w.seal()?;
        put_time += t.elapsed();
        tx.send((i, handle)).context("readers stopped early")?;
        if last_report.elapsed() > Duration::from_millis(500) {
            last_report = Instant::now();
            eprintln!(
                "  {}/{} written, {} read and verified",
                i + 1,
                args.objects,
                read.load(Ordering::Relaxed)
            );
        }
    }
    drop(tx);
    let mut latencies = Vec::new();
    for t in reader_threads {
        latencies.extend(t.join().expect("reader thread panicked")?);
    }
    let elapsed = started.elapsed();
    let total_bytes = args.objects * args.object_size;
    latencies.sort_unstable();
    let pct = |p: f64| latencies[((latencies.len() - 1) as f64 * p) as usize];
    println!(
        "large objects: {} x {}",
        args.objects,
        format_bytes(args.object_size)
    );
    println!(
        "  producer: create + fill in place + seal at {:.2} GB/s ({:.0} us per object)",
        total_bytes as f64 / put_time.as_secs_f64() / 1e9,
        put_time.as_secs_f64() * 1e6 / args.objects as f64
    );
    println!(
        "  readers:  get by handle p50 {:.1} us, p99 {:.1} us (zero-copy view; verifying the bytes is extra)",
        pct(0.5).as_secs_f64() * 1e6,
        pct(0.99).as_secs_f64() * 1e6
    );
    println!(
        "  end to end: {} verified in {:.2} s ({:.2} GB/s)",
        format_bytes(total_bytes),
        elapsed.as_secs_f64(),
        total_bytes as f64 / elapsed.as_secs_f64() / 1e9
    );

    Ok(())
}

/// Phase 2: small objects, one client, put + get + delete per operation.
fn small_objects(args: &Args, writer: &Client, reader: &Client) -> anyhow::Result<()> {
    eprintln!(
        "phase 2: {} rounds of put + get + delete of a 4 KiB object",
        args.small_ops
    );
    let payload = vec![0xA5u8; 4096];
    let started = Instant::now();
    for _ in 0..args.small_ops {
        let h = writer.put(&payload)?;
        let lease = reader.get(h)?;
        if lease[4095] != 0xA5 {
            bail!("small object {h} read back wrong");
        }
        drop(lease);
        writer.delete(h)?;
    }
    let secs = started.elapsed().as_secs_f64();
    println!(
        "small objects: {:.0} put+get+delete operations/s ({:.1} us each; for comparison, BENCHMARKS.md has Ray 2.60 and feedstore gets measured side by side)",
        args.small_ops as f64 / secs,
        secs * 1e6 / args.small_ops as f64
    );

    Ok(())
}

/// Gets each handle, checks every byte, drops the lease; returns get latencies.
fn read_loop(
    client: &Client,
    rx: &std::sync::Mutex<mpsc::Receiver<(u64, Handle)>>,
    read: &AtomicU64,
) -> anyhow::Result<Vec<Duration>> {
    let mut latencies = Vec::new();
    loop {
        let next = rx.lock().expect("queue lock").recv();
        let Ok((index, handle)) = next else {
            return Ok(latencies);
        };
        let t = Instant::now();
        let lease = client
            .get(handle)
            .with_context(|| format!("get of object {index}"))?;
        latencies.push(t.elapsed());
        if !verify(&lease, index) {
            bail!("object {index} ({handle}) read back different bytes than were written");
        }
        drop(lease);
        read.fetch_add(1, Ordering::Relaxed);
    }
}

/// The pattern of object `index`: little-endian words `index * 2^32 + word number`.
fn fill(buf: &mut [u8], index: u64) {
    for (i, chunk) in buf.chunks_mut(8).enumerate() {
        let word = (index << 32 | i as u64).to_le_bytes();
        chunk.copy_from_slice(&word[..chunk.len()]);
    }
}

fn verify(buf: &[u8], index: u64) -> bool {
    buf.chunks(8)
        .enumerate()
        .all(|(i, chunk)| chunk == &(index << 32 | i as u64).to_le_bytes()[..chunk.len()])
}
