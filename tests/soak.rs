//! The soak test of issue 11: for a few minutes, writers put objects of random sizes, readers
//! get and hold them, and stream ranks read, hold samples across random reopens of their
//! stream, while the small store evicts and reuses space all the time. Every view's bytes are
//! checked in full when it is taken and again just before it is dropped: a view that ever sees
//! another object's bytes is a mismatch. At the end every lease is back and the whole store can
//! be allocated again (nothing leaked).
//!
//! Not part of `cargo test`: run it with
//! `cargo test --release --test soak -- --ignored --nocapture` (`FEEDSTORE_SOAK_SECS`, default
//! 180). Its figures are in BENCHMARKS.md.

mod common;

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use feedstore_consumer::{
    Client, Delivery, Error, Handle, Made, Stream, StreamFeeder, StreamOptions, StreamTask,
};
use feedstore_proto::stream::{Shuffle, StreamSpec, Tail};

#[derive(Default)]
struct Counters {
    puts: AtomicU64,
    gets: AtomicU64,
    bytes_checked: AtomicU64,
    samples: AtomicU64,
    reopens: AtomicU64,
    mismatches: AtomicU64,
}

impl Counters {
    fn check(&self, ok: bool, len: usize) {
        self.bytes_checked.fetch_add(len as u64, Ordering::Relaxed);
        if !ok {
            self.mismatches.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// A small xorshift generator per thread.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// The bytes of record `r`'s sample: self-describing, of a size fixed by the record.
fn sample_len(record: u64) -> usize {
    64 + (record.wrapping_mul(7919) % (192 << 10)) as usize
}

fn spec() -> StreamSpec {
    StreamSpec {
        name: "soak".into(),
        records: 1000,
        seed: 11,
        world: 2,
        shuffle: Shuffle::Full,
        tail: Tail::Drop,
        epochs: None,
        reshard: None,
    }
}

#[test]
#[ignore = "a soak of minutes: cargo test --release --test soak -- --ignored --nocapture"]
fn views_never_see_another_objects_bytes() {
    let secs: u64 = std::env::var("FEEDSTORE_SOAK_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(180);
    let _w = watchdog(
        "views_never_see_another_objects_bytes",
        Duration::from_secs(secs + 300),
    );
    let dir = scratch_dir("soak");
    let daemon = DaemonProcess::start(&dir, &["--capacity", "64MiB"]);
    let socket = daemon.socket.clone();
    let observer = daemon.reader();
    let baseline = observer.stats().unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let counters = Arc::new(Counters::default());
    let recent: Arc<Mutex<VecDeque<Handle>>> = Arc::default();
    let max_leases = Arc::new(AtomicU64::new(0));
    let mut threads = Vec::new();

    // Writers: self-describing objects of 16 B to 256 KiB, as fast as they go.
    for w in 0..2u64 {
        let (stop, counters, recent, writer) = (
            stop.clone(),
            counters.clone(),
            recent.clone(),
            daemon.writer(),
        );
        threads.push(std::thread::spawn(move || {
            let mut rng = Rng(0x5EED + w);
            while !stop.load(Ordering::Relaxed) {
                let len = 16 + rng.below(256 << 10) as usize;
                let Ok(mut object) = writer.create(len as u64) else {
                    continue; // full of held objects for a moment
                };
                write_self_describing(object.as_mut_slice(), rng.next());
                let handle = object.seal().unwrap();
                counters.puts.fetch_add(1, Ordering::Relaxed);
                let mut r = recent.lock().unwrap();
                r.push_back(handle);
                if r.len() > 256 {
                    r.pop_front();
                }
            }
        }));
    }

    // Readers: get recent objects (many already evicted), hold some for a while.
    for r in 0..2u64 {
        let (stop, counters, recent, reader) = (
            stop.clone(),
            counters.clone(),
            recent.clone(),
            daemon.reader(),
        );
        threads.push(std::thread::spawn(move || {
            let mut rng = Rng(0xBEEF + r);
            let mut held = VecDeque::new();
            while !stop.load(Ordering::Relaxed) {
                let handle = {
                    let recent = recent.lock().unwrap();
                    if recent.is_empty() {
                        continue;
                    }
                    recent[rng.below(recent.len() as u64) as usize]
                };
                match reader.get(handle) {
                    Ok(lease) => {
                        counters.gets.fetch_add(1, Ordering::Relaxed);
                        counters.check(is_self_describing(&lease), lease.len());
                        held.push_back(lease);
                    }
                    Err(Error::NotFound { .. } | Error::Stale { .. }) => {}
                    Err(e) => panic!("get: {e}"),
                }
                if held.len() > 1 + rng.below(16) as usize {
                    let lease = held.pop_front().unwrap();
                    counters.check(is_self_describing(&lease), lease.len());
                }
            }
            for lease in held {
                counters.check(is_self_describing(&lease), lease.len());
            }
        }));
    }

    // The stream's producer: every sample made fresh, self-describing for its record.
    {
        let (stop, writer) = (stop.clone(), daemon.writer());
        threads.push(std::thread::spawn(move || {
            let s = spec();
            let starts: Vec<StreamTask> = (0..s.world)
                .map(|rank| StreamTask { rank, seq: 0 })
                .collect();
            let feeder = StreamFeeder::join(&writer, &s, 16, &starts).unwrap();
            while !stop.load(Ordering::Relaxed) {
                let Some(tasks) = feeder.take(8, Duration::from_millis(50)).unwrap() else {
                    return;
                };
                let made: Vec<Delivery> = tasks
                    .into_iter()
                    .map(|task| {
                        let record = s.record_at(task.rank, task.seq);
                        // The store may be full of held objects for a moment: wait it out.
                        let mut object = loop {
                            match writer.create(sample_len(record) as u64) {
                                Ok(object) => break object,
                                Err(Error::Full { .. }) => {}
                                Err(e) => panic!("create: {e}"),
                            }
                        };
                        write_self_describing(object.as_mut_slice(), record);
                        Delivery {
                            task,
                            record,
                            key: 0,
                            made: Made::Written(object),
                        }
                    })
                    .collect();
                // A resume may have moved a window past a task (Stale): nothing to do.
                feeder.put(made).unwrap();
            }
            feeder.close().unwrap();
        }));
    }

    // Two ranks: read in order, hold a few samples across random reopens of the stream.
    for rank in 0..2u32 {
        let (stop, counters, socket) = (stop.clone(), counters.clone(), socket.clone());
        threads.push(std::thread::spawn(move || {
            let s = spec();
            let mut rng = Rng(0xCAFE + u64::from(rank));
            let options = StreamOptions {
                wait: Duration::from_secs(60),
                ..StreamOptions::default()
            };
            let mut stream = Stream::open(&socket, &s, rank, None, options.clone()).unwrap();
            let mut held = VecDeque::new();
            let mut expected_seq = 0;
            while !stop.load(Ordering::Relaxed) {
                let sample = match stream.next_sample_within(Duration::from_millis(200)) {
                    Ok(Some(sample)) => sample,
                    Ok(None) => break,
                    Err(Error::Timeout(_)) => continue,
                    Err(Error::WindowFull { .. }) => {
                        held.clear();
                        continue;
                    }
                    Err(e) => panic!("rank {rank}: {e}"),
                };
                assert_eq!(sample.seq(), expected_seq, "rank {rank} in order");
                expected_seq += 1;
                counters.samples.fetch_add(1, Ordering::Relaxed);
                let ok = sample.record() == s.record_at(rank, sample.seq())
                    && is_self_describing(&sample)
                    && u64::from_le_bytes(sample[..8].try_into().unwrap()) == sample.record();
                counters.check(ok, sample.len());
                if rng.below(4) == 0 {
                    held.push_back(sample);
                    if held.len() > 6 {
                        let old = held.pop_front().unwrap();
                        counters.check(is_self_describing(&old), old.len());
                    }
                }
                if rng.below(64) == 0 {
                    // Reopen from the state, keeping the held samples.
                    let state = stream.state();
                    drop(stream);
                    stream = Stream::open(&socket, &s, rank, Some(state), options.clone()).unwrap();
                    counters.reopens.fetch_add(1, Ordering::Relaxed);
                    for old in &held {
                        counters.check(is_self_describing(old), old.len());
                    }
                }
            }
            for old in held {
                counters.check(is_self_describing(&old), old.len());
            }
        }));
    }

    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(secs) {
        std::thread::sleep(Duration::from_millis(100));
        let leases = observer.stats().unwrap().leases;
        max_leases.fetch_max(leases, Ordering::Relaxed);
    }
    stop.store(true, Ordering::Relaxed);
    for t in threads {
        t.join().unwrap();
    }
    let elapsed = started.elapsed();

    let end = wait_for_stats(&observer, "every lease back", |s| {
        s.leases == 0 && s.objects_writing == 0
    });
    // Nothing leaked: the whole store can be had again, and given back.
    let writer: Client = daemon.writer();
    let all = writer.create(end.capacity_bytes - 64).unwrap();
    drop(all);
    let after = wait_for_stats(&observer, "the store empty again", |s| {
        s.used_bytes == baseline.used_bytes
    });
    let c = &counters;
    println!(
        "soak: {:.0} s; {} objects put, {} gets, {} stream samples, {} reopens; {:.1} GiB checked; \
         {} evictions; at most {} leases at once; {} mismatches; leases {} and used bytes {} at the end",
        elapsed.as_secs_f64(),
        c.puts.load(Ordering::Relaxed),
        c.gets.load(Ordering::Relaxed),
        c.samples.load(Ordering::Relaxed),
        c.reopens.load(Ordering::Relaxed),
        c.bytes_checked.load(Ordering::Relaxed) as f64 / (1u64 << 30) as f64,
        after.evictions,
        max_leases.load(Ordering::Relaxed),
        c.mismatches.load(Ordering::Relaxed),
        after.leases,
        after.used_bytes,
    );
    assert_eq!(
        c.mismatches.load(Ordering::Relaxed),
        0,
        "a view saw bytes not its own"
    );
    assert!(c.reopens.load(Ordering::Relaxed) > 0 && after.evictions > 0);
}
