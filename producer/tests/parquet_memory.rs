//! Parquet read in bounded memory: a file of 10,000 rows (each a 6.6 KB photo and a record, in
//! row groups of 500) is read with this process's heap never more than a few row groups above
//! where it started; and 300 damaged copies of a small file (bytes flipped, zeroed, cut, page
//! sizes forged) each end, within a minute, in rows and rejects, never a hang, a crash or a heap
//! past the page limit's bound. Its own test binary, so the allocator counts this reader alone.

use std::path::PathBuf;
use std::sync::Arc;

use feedstore_producer::input::LocalFiles;
use feedstore_producer::pipeline::Input;
use feedstore_producer::shards::Shard;
use feedstore_producer::tables::{PAGE_LIMIT, ParquetFiles};
use feedstore_testkit::alloc::{Counting, peak, reset_peak};
use feedstore_testkit::tar::{data_python, run_python_with};

mod common;

#[global_allocator]
static ALLOCATOR: Counting = Counting;

const SMALL: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/data/resized/grace_hopper-56-draft.png"
);

/// Writes `count` rows (id, the small photo as an Image, a conversation) in row groups of
/// `group` rows, pages of at most `page` bytes, no dictionaries.
fn write(out: &std::path::Path, count: usize, group: usize, page: usize) {
    let script = r#"
import json, sys
import pyarrow as pa, pyarrow.parquet as pq
spec = json.load(sys.stdin)
image = open(spec["image"], "rb").read()
n = spec["count"]
table = pa.table({
    "id": pa.array(["%06d" % i for i in range(n)]),
    # Each row's bytes its own (a PNG ignores what follows its end), so none are shared.
    "image": pa.array([{"bytes": image + i.to_bytes(4, "little"), "path": None} for i in range(n)],
                      type=pa.struct([("bytes", pa.binary()), ("path", pa.string())])),
    "conversations": pa.array([[{"from": "human", "value": "<image>\nsample %d" % i},
                                {"from": "gpt", "value": "ok"}] for i in range(n)]),
})
pq.write_table(table, spec["out"], row_group_size=spec["group"], data_page_size=spec["page"],
               use_dictionary=False)
"#;
    run_python_with(
        &data_python(),
        script,
        &serde_json::json!({"out": out, "image": SMALL, "count": count, "group": group, "page": page}),
    );
}

/// Reads `path` to its end, dropping each input as the pipeline does once a worker has made
/// it: (rows, rejects, the heap's growth at most), within a minute.
fn read(path: PathBuf, page_limit: u64) -> (usize, Vec<String>, usize) {
    let base = reset_peak();
    let make = move || {
        ParquetFiles::new(
            vec![Shard::Local(path)],
            Arc::new(LocalFiles::anywhere(1 << 20)),
            1 << 20,
            PathBuf::from("/"),
        )
        .with_page_limit(page_limit)
    };
    let (_, (rows, rejects)) = common::read_inputs(
        make,
        (0, Vec::new()),
        |(rows, rejects): &mut (usize, Vec<String>), input| match input {
            Input::Read(..) | Input::Record(_) => *rows += 1,
            Input::Rejected(r) => rejects.push(r.reason),
        },
    );
    (rows, rejects, peak().saturating_sub(base))
}

#[test]
fn ten_thousand_rows_and_damaged_files_are_read_in_bounded_memory() {
    let dir = std::env::temp_dir().join(format!(
        "feedstore-producer-{}-parquet-memory",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let image = std::fs::metadata(SMALL).unwrap().len() as usize + 4;

    let large = dir.join("large.parquet");
    write(&large, 10_000, 500, 1 << 20);
    let size = std::fs::metadata(&large).unwrap().len() as usize;
    let (rows, rejects, grown) = read(large, PAGE_LIMIT);
    assert_eq!((rows, rejects.len()), (10_000, 0), "{rejects:?}");
    // A row group (500 images, read whole), its decoded pages and the rows in flight: a few
    // row groups' worth, whatever the file's size.
    let group = 500 * image;
    assert!(
        grown <= 4 * group + (4 << 20) && grown < size / 4,
        "the heap grew by {grown} bytes, file {size}, row group about {group}"
    );

    // Damaged copies of a small file: 12 rows in row groups of 3, pages of 4 KiB.
    let small = dir.join("small.parquet");
    write(&small, 12, 3, 4 << 10);
    let good = std::fs::read(&small).unwrap();
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut random = move |below: usize| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        (seed % below as u64) as usize
    };
    let damaged = dir.join("damaged.parquet");
    let (mut read_rows, mut refused, mut panics) = (0, 0, 0);
    for round in 0..300 {
        let mut bytes = good.clone();
        let n = bytes.len();
        let what = match round % 5 {
            0 => {
                for _ in 0..1 + random(8) {
                    let at = random(n);
                    bytes[at] ^= 1 << random(8);
                }
                "bits flipped"
            }
            1 => {
                let at = random(n);
                let end = (at + 1 + random(64)).min(n);
                bytes[at..end].fill(0);
                "bytes zeroed"
            }
            2 => {
                bytes.truncate(random(n));
                "cut short"
            }
            // The footer, where sizes and offsets live.
            3 => {
                let footer = u32::from_le_bytes(good[n - 8..n - 4].try_into().unwrap()) as usize;
                let at = n - 8 - footer + random(footer);
                bytes[at] = random(256) as u8;
                "a footer byte replaced"
            }
            // A varint in the data made as large as it can be (a page size, a length).
            _ => {
                let at = random(n - 16);
                bytes[at..at + 5].copy_from_slice(&[0xff, 0xff, 0xff, 0xff, 0x0f]);
                "a varint forged"
            }
        };
        std::fs::write(&damaged, &bytes).unwrap();
        let (rows, rejects, grown) = read(damaged.clone(), 64 << 10);
        assert!(
            rows + rejects.len() >= 1 && rows <= 12,
            "round {round} ({what}): {rows} rows, {rejects:?}"
        );
        // The file, a row group decoded, a page at its limit: well under 16 MiB.
        assert!(
            grown < 16 << 20,
            "round {round} ({what}): the heap grew by {grown} bytes"
        );
        if what == "cut short" {
            assert_eq!((rows, rejects.len()), (0, 1), "round {round}: {rejects:?}");
        }
        read_rows += rows;
        refused += usize::from(!rejects.is_empty());
        panics += rejects
            .iter()
            .filter(|r| r.contains("the decoder gave up"))
            .count();
    }
    // Much of the damage lands in images' bytes, which no checksum covers: those rows are read
    // (and their images fail to decode in the pipeline).
    eprintln!(
        "{refused} of 300 damaged files refused in part or whole, {read_rows} rows read, \
         {panics} decoder panics caught"
    );
    assert!(
        refused > 60 && read_rows > 0,
        "{refused} refused, {read_rows} rows"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
