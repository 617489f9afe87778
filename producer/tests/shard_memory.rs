//! A shard of 10,000 samples (about 260 MB: each sample a 6.6 KB photo, a record and a member
//! no sample uses, 16 KB, or 5 MiB for every 2,000th) is read whole with this process's heap
//! never more than two chunks and a sample above where it started: memory is bounded by the
//! chunk, not the shard. Its own test binary, so the allocator counts this reader alone.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use feedstore_producer::input::LocalFiles;
use feedstore_producer::pipeline::{Input, Inputs};
use feedstore_producer::shards::{CHUNK_BYTES, Shard, Shards};
use feedstore_testkit::alloc::{Counting, peak, reset_peak};
use feedstore_testkit::tar::run_python;

#[global_allocator]
static ALLOCATOR: Counting = Counting;

#[test]
fn a_shard_of_ten_thousand_samples_is_read_in_bounded_memory() {
    let dir = std::env::temp_dir().join(format!(
        "feedstore-producer-{}-shard-memory",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let tar = dir.join("large.tar");
    let small = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/resized/grace_hopper-56-draft.png"
    );
    let script = r#"
import io, json, sys, tarfile
spec = json.load(sys.stdin)
image = open(spec["image"], "rb").read()
def add(tar, name, data):
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))
with tarfile.open(spec["out"], "w") as tar:
    for i in range(spec["count"]):
        key = "%06d" % i
        filler = spec["large"] if i % 2000 == 1 else spec["filler"]
        add(tar, key + ".npy", bytes([i % 251]) * filler)
        add(tar, key + ".png", image)
        add(tar, key + ".json", json.dumps({"conversations": [
            {"from": "human", "value": "<image>\nsample %d" % i},
            {"from": "gpt", "value": "ok"}]}).encode())
"#;
    run_python(
        script,
        &serde_json::json!({
            "out": tar, "image": small, "count": 10_000, "filler": 16 << 10, "large": 5 << 20,
        }),
    );
    let size = std::fs::metadata(&tar).unwrap().len();
    let image = std::fs::metadata(small).unwrap().len() as usize;

    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut reader = Shards::new(
        vec![Shard::Local(tar.clone())],
        Arc::new(LocalFiles::anywhere(64 << 20)),
        64 << 20,
    );
    let base = reset_peak();
    // Each sample is taken and dropped, as the pipeline does once a worker has made it.
    let (mut samples, mut last) = (0, String::new());
    runtime.block_on(async {
        while let Some(input) = reader.next().await {
            match input {
                Input::Read(record, images) => {
                    assert_eq!(images.len(), 1);
                    assert_eq!(images[0].len(), image);
                    samples += 1;
                    last = record.id;
                }
                other => panic!("{other:?}"),
            }
        }
    });
    let peak = peak() - base;
    assert_eq!((samples, last.as_str()), (10_000, "009999"));
    // Two chunks (the buffer grows by at most a chunk past a member's end), one sample, and
    // what a sample's record and the reader's bookkeeping take.
    let bound = 2 * CHUNK_BYTES as usize + image + (256 << 10);
    assert!(
        peak <= bound && (peak as u64) < size / 32,
        "the heap grew by {peak} bytes at most, bound {bound}, shard {size}"
    );
    // The reader's own account agrees.
    let stats = reader.stats();
    let held = stats.peak_held.load(Ordering::Relaxed);
    assert!((CHUNK_BYTES..=bound as u64).contains(&held), "{held}");
    // Read once, a chunk at a time: the 5 MiB members are jumped over, not read.
    let (read, requests) = (
        stats.bytes.load(Ordering::Relaxed),
        stats.requests.load(Ordering::Relaxed),
    );
    assert!(read < size - 4 * (4 << 20), "read {read} of {size}");
    assert!(requests <= 2 * (size / CHUNK_BYTES + 1), "{requests} reads");
    std::fs::remove_dir_all(&dir).unwrap();
}
