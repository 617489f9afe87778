//! WebDataset shards read as the producer's inputs, from real tar files written by Python's
//! `tarfile` (as `webdataset`'s writers make them, in pax, GNU and ustar form): samples
//! grouped by key with their records and image bytes; a corrupt header, a member over its
//! limit, a shard cut short and a missing shard each reject only what they touch, naming the
//! shard and byte; and a shard of 10,000 samples read with the reader's memory under a bound.

mod common;

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use common::DATA;
use feedstore_producer::input::LocalFiles;
use feedstore_producer::manifest::Content;
use feedstore_producer::pipeline::{Input, Inputs};
use feedstore_producer::shards::{CHUNK_BYTES, Shard, Shards, expand, shard_list};
use feedstore_producer::source::ImageSource;
use feedstore_testkit::tar::{python_tar, run_python};

fn scratch_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "feedstore-producer-{}-shards-{name}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn photo(name: &str) -> Vec<u8> {
    std::fs::read(format!("{DATA}/photos/{name}")).unwrap()
}

fn json(value: serde_json::Value) -> Vec<u8> {
    value.to_string().into_bytes()
}

/// Every input of `shards`, read to the end.
fn read_all(shards: Vec<Shard>, max_image_bytes: u64) -> (Vec<Input>, Shards) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut reader = Shards::new(
        shards,
        Arc::new(LocalFiles::anywhere(max_image_bytes)),
        max_image_bytes,
    );
    let inputs = runtime.block_on(async {
        let mut all = Vec::new();
        while let Some(input) = reader.next().await {
            all.push(input);
        }
        all
    });
    (inputs, reader)
}

/// (id, images' bytes, content) of each sample; (line, id, reason) of each reject.
type Read = (String, Vec<Vec<u8>>, Content);
type Rejected = (u64, Option<String>, String);
fn split(inputs: Vec<Input>) -> (Vec<Read>, Vec<Rejected>) {
    let (mut samples, mut rejects) = (Vec::new(), Vec::new());
    for input in inputs {
        match input {
            Input::Read(record, images) => {
                assert_eq!(record.images.len(), images.len());
                samples.push((
                    record.id,
                    images.iter().map(|b| b.to_vec()).collect(),
                    record.content,
                ));
            }
            Input::Rejected(r) => rejects.push((r.line, r.id, r.reason)),
            Input::Record(r) => panic!("a shard's sample {} came without its images", r.id),
        }
    }
    (samples, rejects)
}

fn conversation(question: &str, answer: &str) -> serde_json::Value {
    serde_json::json!([
        {"from": "human", "value": format!("<image>\n{question}")},
        {"from": "gpt", "value": answer},
    ])
}

#[test]
fn brace_patterns_and_lists_name_shards() {
    assert_eq!(
        expand("s3://b/shard-{000..002}.tar", 100).unwrap(),
        [
            "s3://b/shard-000.tar",
            "s3://b/shard-001.tar",
            "s3://b/shard-002.tar"
        ]
    );
    assert_eq!(
        expand("{train,val}-{8..10}.tar", 100).unwrap(),
        [
            "train-8.tar",
            "train-9.tar",
            "train-10.tar",
            "val-8.tar",
            "val-9.tar",
            "val-10.tar"
        ]
    );
    assert!(
        expand("a-{0..99}-{0..99}.tar", 1000)
            .unwrap_err()
            .contains("over 1000")
    );
    assert!(expand("a-{0..18446744073709551615}.tar", 1000).is_err());
    assert!(
        expand("a-{5..1}.tar", 10)
            .unwrap_err()
            .contains("empty range")
    );
    assert!(expand("a-{0..3.tar", 10).unwrap_err().contains("without"));
    assert!(expand("a-{{0..3}}.tar", 10).unwrap_err().contains("nested"));

    let dir = scratch_dir("list");
    let list = dir.join("shards.txt");
    std::fs::write(
        &list,
        "# train\nlocal-{0..1}.tar\n\n/abs/x.tar\ns3://bucket/a/b.tar\n",
    )
    .unwrap();
    let shards = shard_list(&[format!("@{}", list.display()), "y.tar".into()]).unwrap();
    assert_eq!(
        shards,
        [
            Shard::Local(dir.join("local-0.tar")),
            Shard::Local(dir.join("local-1.tar")),
            Shard::Local("/abs/x.tar".into()),
            Shard::S3 {
                bucket: "bucket".into(),
                key: "a/b.tar".into()
            },
            Shard::Local("y.tar".into()),
        ]
    );
    assert!(shard_list(&["s3://bucket".into()]).is_err());
    assert!(
        shard_list(&[format!("@{}", dir.display())])
            .unwrap_err()
            .contains("directory")
    );
}

/// Samples by key, in every tar form Python writes: a record and its image, a caption, a
/// record naming its images out of the shard's order, chat `messages`, names longer than
/// ustar's 100 bytes, and members that belong to no sample.
#[test]
fn samples_are_grouped_by_key_with_their_records_and_images() {
    let dir = scratch_dir("forms");
    let (hopper, chelsea, rocket) = (
        photo("grace_hopper.jpg"),
        photo("chelsea.png"),
        photo("rocket.jpg"),
    );
    let long = format!("{}/deep", "d".repeat(120));
    let members: Vec<(String, Vec<u8>)> = vec![
        (
            "000001.json".into(),
            json(
                serde_json::json!({"id": "vqa-1", "conversations": conversation("who?", "an admiral")}),
            ),
        ),
        ("000001.jpg".into(), hopper.clone()),
        ("000002.png".into(), chelsea.clone()),
        ("000002.txt".into(), b"a cat on a blanket\n".to_vec()),
        ("000002.cls".into(), b"7".to_vec()),
        ("000003.0.jpg".into(), rocket.clone()),
        ("000003.1.png".into(), chelsea.clone()),
        (
            "000003.json".into(),
            json(serde_json::json!({
                "images": ["1.png", "000003.0.jpg"],
                "messages": [
                    {"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "same?"}]},
                    {"role": "assistant", "content": "no"},
                ],
            })),
        ),
        (format!("{long}/000004.txt"), b"just words".to_vec()),
        (format!("{long}/000005.jpeg"), rocket.clone()),
        (
            format!("{long}/000005.json"),
            json(serde_json::json!({"id": 5, "conversations": conversation("what?", "a rocket")})),
        ),
        ("README".into(), b"no dot: not a sample's".to_vec()),
    ];
    let members: Vec<(&str, Vec<u8>)> = members
        .iter()
        .map(|(n, b)| (n.as_str(), b.clone()))
        .collect();
    for format in ["pax", "gnu"] {
        let tar = dir.join(format!("{format}.tar"));
        python_tar(&tar, format, &members);
        let (inputs, _) = read_all(vec![Shard::Local(tar.clone())], 64 << 20);
        let (samples, rejects) = split(inputs);
        assert_eq!(rejects, [], "{format}");
        let ids: Vec<&str> = samples.iter().map(|s| s.0.as_str()).collect();
        assert_eq!(
            ids,
            ["vqa-1", "000002", "000003", &format!("{long}/000004"), "5"],
            "{format}"
        );
        assert_eq!(samples[0].1, std::slice::from_ref(&hopper));
        assert_eq!(
            samples[1].2,
            Content::Conversation(vec![
                feedstore_producer::chat::Message::new(
                    feedstore_producer::chat::Role::User,
                    "<image>"
                ),
                feedstore_producer::chat::Message::new(
                    feedstore_producer::chat::Role::Assistant,
                    "a cat on a blanket"
                ),
            ])
        );
        assert_eq!(samples[1].1, std::slice::from_ref(&chelsea));
        // The record's order, not the shard's.
        assert_eq!(samples[2].1, [chelsea.clone(), rocket.clone()]);
        let Content::Conversation(turns) = &samples[2].2 else {
            panic!("a conversation")
        };
        assert_eq!(turns[0].content, "<image><image>same?");
        assert_eq!(samples[3].2, Content::Text("just words".into()));
        assert_eq!(samples[4].1, std::slice::from_ref(&rocket));
    }
    // Where each image came from, in the sample's metadata.
    let (inputs, _) = read_all(vec![Shard::Local(dir.join("pax.tar"))], 64 << 20);
    let Input::Read(record, _) = &inputs[0] else {
        panic!("a sample")
    };
    assert!(matches!(
        &record.images[0],
        ImageSource::Member { name, offset, .. } if name == "000001.jpg" && *offset > 0
    ));
}

/// What goes wrong rejects only the sample it is in, naming the shard and the byte: a corrupt
/// header (reading goes on at the next good one), an image over the limit, a record naming an
/// image the sample lacks, a sample with no record, a missing shard, a shard cut short inside
/// a member and one cut at a member's end.
#[test]
fn bad_members_and_shards_reject_only_what_they_touch() {
    let dir = scratch_dir("bad");
    let (hopper, chelsea) = (photo("grace_hopper.jpg"), photo("chelsea.png"));
    let record =
        |id: &str| json(serde_json::json!({"id": id, "conversations": conversation("q", "a")}));
    let members = vec![
        ("a.json", record("a")),
        ("a.jpg", hopper.clone()),
        ("b.json", record("b")),
        ("b.jpg", hopper.clone()),
        ("c.json", record("c")),
        ("c.png", chelsea.clone()),
        ("d.jpg", hopper.clone()),
        (
            "e.json",
            json(
                serde_json::json!({"id": "e", "image": "e.webp", "conversations": conversation("q", "a")}),
            ),
        ),
        ("e.jpg", hopper.clone()),
        ("f.json", record("f")),
        ("f.jpg", hopper.clone()),
    ];
    let tar = dir.join("good.tar");
    python_tar(&tar, "ustar", &members);
    let bytes = std::fs::read(&tar).unwrap();
    // Member offsets: each header is where its name is.
    let at = |name: &str| {
        bytes
            .windows(name.len() + 1)
            .position(|w| &w[..name.len()] == name.as_bytes() && w[name.len()] == 0)
            .unwrap()
    };
    // b.jpg's header loses its checksum; c.png is over a limit set between the photos' sizes.
    let mut corrupt = bytes.clone();
    corrupt[at("b.jpg") + 150] ^= 0x5a;
    let corrupt_tar = dir.join("corrupt.tar");
    std::fs::write(&corrupt_tar, &corrupt).unwrap();
    // c.png (chelsea, 240 KB) is over a limit the JPEGs (61 KB) are under.
    assert!(chelsea.len() > 2 * hopper.len());
    let limit = 2 * hopper.len() as u64;
    let over = "c";
    let (inputs, _) = read_all(
        vec![
            Shard::Local(corrupt_tar.clone()),
            Shard::Local(dir.join("missing.tar")),
            Shard::Local(dir.clone()),
            Shard::Local("/dev/zero".into()),
        ],
        limit,
    );
    let (samples, rejects) = split(inputs);
    let ids: Vec<&str> = samples.iter().map(|s| s.0.as_str()).collect();
    assert_eq!(ids, ["a", "f"]);
    let shard = corrupt_tar.display().to_string();
    let reason = |id: &str| {
        rejects
            .iter()
            .find(|r| r.1.as_deref() == Some(id))
            .unwrap_or_else(|| panic!("no reject for {id}: {rejects:?}"))
            .2
            .clone()
    };
    let b = reason("b");
    assert!(
        b.starts_with(&format!(
            "{shard} at byte {}: a corrupt tar header at byte {}",
            at("b.json"),
            at("b.jpg")
        )),
        "{b}"
    );
    assert!(
        b.contains(&format!("reading went on at byte {}", at("c.json"))),
        "{b}"
    );
    assert!(reason(over).contains("over the"), "{}", reason(over));
    assert!(
        reason("d").contains("no .json or .txt member (images: d.jpg)"),
        "{}",
        reason("d")
    );
    assert!(
        reason("e").contains("names image \"e.webp\""),
        "{}",
        reason("e")
    );
    // Shards that cannot be read: one reject each, saying why, without reading a byte.
    let unreadable: Vec<&str> = rejects[rejects.len() - 3..]
        .iter()
        .map(|r| {
            assert!(r.1.is_none() && r.2.contains("cannot open shard"), "{r:?}");
            r.2.as_str()
        })
        .collect();
    assert!(unreadable[0].contains("missing.tar"), "{unreadable:?}");
    assert!(unreadable[1].contains("is a directory"), "{unreadable:?}");
    assert!(
        unreadable[2].contains("is a character device"),
        "{unreadable:?}"
    );
    // Lines number samples in the order read, rejects included.
    let lines: Vec<u64> = rejects.iter().map(|r| r.0).collect();
    assert!(lines.windows(2).all(|w| w[0] < w[1]), "{lines:?}");

    // Cut inside f.jpg: a to e as before, f rejected as cut short.
    let cut = dir.join("cut.tar");
    std::fs::write(&cut, &bytes[..at("f.jpg") + 512 + 100]).unwrap();
    let (samples, rejects) = split(read_all(vec![Shard::Local(cut.clone())], 64 << 20).0);
    assert_eq!(
        samples.iter().map(|s| s.0.as_str()).collect::<Vec<_>>(),
        ["a", "b", "c"]
    );
    let f = rejects
        .iter()
        .find(|r| r.1.as_deref() == Some("f"))
        .unwrap();
    assert!(f.2.contains("cut short in member f.jpg"), "{f:?}");
    // Cut where f.jpg's header would be: f has its record but maybe not its image, so it is
    // rejected too (a shard ends with tar's end-of-archive blocks).
    std::fs::write(&cut, &bytes[..at("f.jpg")]).unwrap();
    let (_, rejects) = split(read_all(vec![Shard::Local(cut)], 64 << 20).0);
    let f = rejects
        .iter()
        .find(|r| r.1.as_deref() == Some("f"))
        .unwrap();
    assert!(f.2.contains("without tar's end-of-archive blocks"), "{f:?}");
}

/// A shard of 10,000 samples (about 240 MB, each sample an image, a record and a 16 KB member
/// no sample uses) is read whole while the reader never holds more than one chunk and one
/// sample: memory is bounded by the chunk, not the shard.
#[test]
fn a_shard_of_ten_thousand_samples_is_read_in_bounded_memory() {
    let dir = scratch_dir("large");
    let tar = dir.join("large.tar");
    // A 56×56 photo, 6.6 KB.
    let small = format!("{DATA}/resized/grace_hopper-56-draft.png");
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
        add(tar, key + ".npy", bytes([i % 251]) * spec["filler"])
        add(tar, key + ".png", image)
        add(tar, key + ".json", json.dumps({"conversations": [
            {"from": "human", "value": "<image>\nsample %d" % i},
            {"from": "gpt", "value": "ok"}]}).encode())
"#;
    run_python(
        script,
        &serde_json::json!({"out": tar, "image": small, "count": 10_000, "filler": 16 << 10}),
    );
    let size = std::fs::metadata(&tar).unwrap().len();
    let image = std::fs::metadata(&small).unwrap().len();
    let (inputs, reader) = read_all(vec![Shard::Local(tar.clone())], 64 << 20);
    let (samples, rejects) = split(inputs);
    assert_eq!(rejects, []);
    assert_eq!(samples.len(), 10_000);
    assert_eq!(samples[9_999].0, "009999");
    let stats = reader.stats();
    let peak = stats.peak_held.load(Ordering::Relaxed);
    // One chunk (its buffer grows by at most a chunk past a member's end) and one sample.
    let bound = 2 * CHUNK_BYTES + image + 4096;
    assert!(
        peak <= bound && peak < size / 8,
        "held {peak} bytes at most, bound {bound}, shard {size}"
    );
    // Read once, a chunk at a time (members no sample uses are jumped over where they run
    // past the chunk).
    let (read, requests) = (
        stats.bytes.load(Ordering::Relaxed),
        stats.requests.load(Ordering::Relaxed),
    );
    assert!(read <= size, "read {read} of {size}");
    assert!(requests <= 2 * (size / CHUNK_BYTES + 1), "{requests} reads");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A shard mutated at random, 400 times (bytes flipped, headers' fields overwritten, blocks
/// zeroed or cut out, the end cut off), is read to its end every time without a panic: each
/// input a sample whose key the shard had, or a reject saying where.
#[test]
fn mutated_shards_end_in_samples_or_rejects() {
    let dir = scratch_dir("mutated");
    let record = |id: &str| json(serde_json::json!({"conversations": conversation(id, "a")}));
    let small = std::fs::read(format!("{DATA}/resized/grace_hopper-56-draft.png")).unwrap();
    let mut members = Vec::new();
    let keys: Vec<String> = (0..12).map(|i| format!("{i:03}")).collect();
    let names: Vec<(String, String)> = keys
        .iter()
        .map(|k| (format!("{k}.json"), format!("{k}.png")))
        .collect();
    for (k, (j, p)) in keys.iter().zip(&names) {
        members.push((j.as_str(), record(k)));
        members.push((p.as_str(), small.clone()));
    }
    let good = dir.join("good.tar");
    python_tar(&good, "pax", &members);
    let bytes = std::fs::read(&good).unwrap();
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    let mutated = dir.join("mutated.tar");
    for round in 0..400 {
        let mut m = bytes.clone();
        for _ in 0..1 + next() % 4 {
            let at = (next() % m.len() as u64) as usize;
            let block = at - at % 512;
            let block_end = (block + 512).min(m.len());
            match next() % 5 {
                0 => m[at] ^= 1 << (next() % 8),
                // A block's size field set to any size, its checksum made right: a header
                // that checks out but lies (or a block of data forged into a header).
                1 if block_end - block == 512 => {
                    let h = &mut m[block..block_end];
                    let size = format!("{:011o}", next() % (1 << 33));
                    h[124..135].copy_from_slice(size.as_bytes());
                    h[148..156].fill(b' ');
                    let sum: u64 = h.iter().map(|&b| u64::from(b)).sum();
                    h[148..155].copy_from_slice(format!("{sum:06o}\0").as_bytes());
                }
                2 => m[block..block_end].fill(0),
                3 => {
                    m.drain(block..block_end);
                }
                _ => m.truncate(at),
            }
            if m.is_empty() {
                break;
            }
        }
        std::fs::write(&mutated, &m).unwrap();
        let (inputs, _) = read_all(vec![Shard::Local(mutated.clone())], 1 << 20);
        assert!(
            inputs.len() <= 3 * keys.len() + 8,
            "round {round}: {} inputs",
            inputs.len()
        );
        for input in &inputs {
            match input {
                Input::Read(record, _) => assert!(
                    keys.iter().any(|k| record.id.starts_with(k.as_str())),
                    "round {round}: a sample {:?} the shard never had",
                    record.id
                ),
                Input::Rejected(r) => assert!(
                    r.reason.contains(&mutated.display().to_string()),
                    "round {round}: {r:?}"
                ),
                Input::Record(_) => unreachable!(),
            }
        }
    }
}
