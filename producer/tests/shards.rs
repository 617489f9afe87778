//! WebDataset shards read as the producer's inputs, from real tar files written by Python's
//! `tarfile` (as `webdataset`'s writers make them, in pax, GNU and ustar form): samples
//! grouped by key with their records and image bytes; a corrupt header, a member over its
//! limit, a shard cut short and a missing shard each reject only what they touch, naming the
//! shard and byte (`shard_memory.rs` reads a shard of 10,000 samples in bounded memory).

mod common;

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use common::DATA;
use feedstore_producer::feed::{Indexed, RecordIndex};
use feedstore_producer::input::LocalFiles;
use feedstore_producer::manifest::{Content, Reject};
use feedstore_producer::pipeline::Input;
use feedstore_producer::shards::{Shard, ShardRows, Shards, expand, shard_list};
use feedstore_producer::source::ImageSource;
use feedstore_testkit::tar::python_tar;

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

/// Every input of `shards`, read to the end: within a minute, or the test fails.
fn read_all(shards: Vec<Shard>, max_image_bytes: u64) -> (Vec<Input>, Shards) {
    let (reader, all) = common::read_inputs(
        move || {
            Shards::new(
                shards,
                Arc::new(LocalFiles::anywhere(max_image_bytes)),
                max_image_bytes,
            )
        },
        Vec::new(),
        Vec::push,
    );
    (all, reader)
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
/// ustar's 100 bytes, members that belong to no sample, and img2dataset's caption beside a
/// `.json` of metadata.
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
        (
            format!("{long}/000004.json"),
            json(serde_json::json!({"text": "just words"})),
        ),
        (format!("{long}/000005.jpeg"), rocket.clone()),
        (
            format!("{long}/000005.json"),
            json(serde_json::json!({"id": 5, "conversations": conversation("what?", "a rocket")})),
        ),
        ("README".into(), b"no dot: not a sample's".to_vec()),
        // img2dataset's form: a .json of metadata beside the caption.
        ("000006.jpg".into(), hopper.clone()),
        ("000006.txt".into(), b"an admiral\n".to_vec()),
        (
            "000006.json".into(),
            json(
                serde_json::json!({"url": "https://example.com/1.jpg", "caption": "an admiral", "width": 517}),
            ),
        ),
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
            [
                "vqa-1",
                "000002",
                "000003",
                &format!("{long}/000004"),
                "5",
                "000006"
            ],
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
        assert_eq!(samples[5].1, std::slice::from_ref(&hopper));
        assert!(
            matches!(&samples[5].2, Content::Conversation(t) if t[1].content == "an admiral"),
            "{:?}",
            samples[5].2
        );
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

/// What goes wrong rejects only the samples it touches, naming the shard and the byte: a
/// corrupt header (the samples on both sides of it, since the member lost may be either's;
/// reading goes on at the next good one), a block of zeros amid the members, an image over the
/// limit, a record naming an image the sample lacks, a sample with no record, a caption with no
/// image, a missing shard, a directory, a device, a FIFO, a compressed shard, a file that is not
/// a tar, a shard cut short inside a member and one cut at a member's end.
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
        ("c.jpg", hopper.clone()),
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
        ("g.json", record("g")),
        ("g.png", chelsea.clone()),
        ("h.txt", b"a caption with no image".to_vec()),
        ("i.json", record("i")),
        ("i.jpg", hopper.clone()),
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
    // b.jpg's header loses its checksum.
    let mut corrupt = bytes.clone();
    corrupt[at("b.jpg") + 150] ^= 0x5a;
    let corrupt_tar = dir.join("corrupt.tar");
    std::fs::write(&corrupt_tar, &corrupt).unwrap();
    // g.png (chelsea, 240 KB) is over a limit the JPEGs (61 KB) are under.
    assert!(chelsea.len() > 2 * hopper.len());
    let limit = 2 * hopper.len() as u64;
    let fifo = dir.join("fifo.tar");
    assert!(
        std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap()
            .success()
    );
    let gzipped = dir.join("gz.tar.gz");
    let mut gzip = vec![0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 3];
    gzip.resize(4096, 7);
    std::fs::write(&gzipped, &gzip).unwrap();
    let short = dir.join("short.tar");
    std::fs::write(&short, [0x1f, 0x8b, 8]).unwrap();
    let not_tar = dir.join("photo.tar");
    std::fs::write(&not_tar, &hopper).unwrap();
    let (inputs, reader) = read_all(
        vec![
            Shard::Local(corrupt_tar.clone()),
            Shard::Local(dir.join("missing.tar")),
            Shard::Local(dir.clone()),
            Shard::Local("/dev/zero".into()),
            Shard::Local(fifo),
            Shard::Local(gzipped),
            Shard::Local(not_tar),
            Shard::Local(short),
        ],
        limit,
    );
    let (samples, rejects) = split(inputs);
    let ids: Vec<&str> = samples.iter().map(|s| s.0.as_str()).collect();
    assert_eq!(ids, ["a", "f", "i"]);
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
            "{shard}: sample b (from byte {}): a corrupt tar header at byte {}",
            at("b.json"),
            at("b.jpg")
        )),
        "{b}"
    );
    assert!(
        b.contains(&format!("reading went on at byte {}", at("c.json"))),
        "{b}"
    );
    let c = reason("c");
    assert!(
        c.contains("may have been lost to a corrupt tar header"),
        "{c}"
    );
    assert!(reason("g").contains("over the"), "{}", reason("g"));
    assert!(
        reason("h").contains("a caption (.txt) with no image"),
        "{}",
        reason("h")
    );
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
    // Shards that cannot be read: one reject each, saying why.
    let unreadable: Vec<&str> = rejects[rejects.len() - 7..]
        .iter()
        .map(|r| {
            assert!(r.1.is_none(), "{r:?}");
            r.2.as_str()
        })
        .collect();
    for (reject, want) in unreadable.iter().zip([
        "missing.tar: No such file",
        "is a directory",
        "is a character device",
        "is a FIFO",
        "a gzip-compressed file, not a tar file",
        "not a tar file: no header in it checks out",
        "not a tar file: a gzip-compressed file",
    ]) {
        assert!(reject.contains(want), "{reject} lacks {want:?}");
    }
    assert_eq!(reader.stats().unreadable.load(Ordering::Relaxed), 7);
    // Lines number samples in the order read, rejects included.
    let lines: Vec<u64> = rejects.iter().map(|r| r.0).collect();
    assert!(lines.windows(2).all(|w| w[0] < w[1]), "{lines:?}");

    // A block of zeros where f.jpg's header was: not the end (the next block is not zeros),
    // so f and the sample after it are rejected and i still read.
    let mut zeroed = bytes.clone();
    zeroed[at("f.jpg")..at("f.jpg") + 512].fill(0);
    let zeroed_tar = dir.join("zeroed.tar");
    std::fs::write(&zeroed_tar, &zeroed).unwrap();
    let (samples, rejects) = split(read_all(vec![Shard::Local(zeroed_tar)], 64 << 20).0);
    assert_eq!(
        samples.iter().map(|s| s.0.as_str()).collect::<Vec<_>>(),
        ["a", "b", "c", "i"]
    );
    let f = rejects
        .iter()
        .find(|r| r.1.as_deref() == Some("f"))
        .unwrap();
    assert!(f.2.contains("a block of zeros amid the members"), "{f:?}");

    // Cut inside i.jpg: the samples before as in the whole shard, i rejected as cut short.
    let cut = dir.join("cut.tar");
    let end = at("i.jpg") + 512 + 100;
    std::fs::write(&cut, &bytes[..end]).unwrap();
    let (samples, rejects) = split(read_all(vec![Shard::Local(cut.clone())], 64 << 20).0);
    assert_eq!(
        samples.iter().map(|s| s.0.as_str()).collect::<Vec<_>>(),
        ["a", "b", "c", "f", "g"]
    );
    let i = rejects
        .iter()
        .find(|r| r.1.as_deref() == Some("i"))
        .unwrap();
    assert!(
        i.2.contains(&format!(
            "cut short in member i.jpg (of {} bytes), which starts at byte {}: the shard ends at byte {end}",
            hopper.len(),
            at("i.jpg")
        )),
        "{i:?}"
    );
    // Cut where i.jpg's header would be: i has its record but maybe not its image, so it is
    // rejected too (a shard ends with tar's end-of-archive blocks).
    std::fs::write(&cut, &bytes[..at("i.jpg")]).unwrap();
    let (_, rejects) = split(read_all(vec![Shard::Local(cut)], 64 << 20).0);
    let i = rejects
        .iter()
        .find(|r| r.1.as_deref() == Some("i"))
        .unwrap();
    assert!(i.2.contains("without tar's end-of-archive blocks"), "{i:?}");
}

/// Shard lists are bounded: names, brace groups, the shards a pattern or a list names.
#[test]
fn shard_lists_and_patterns_are_bounded() {
    let long = format!("{{{}0..9}}.tar", "0".repeat(5000));
    assert!(expand(&long, 100).unwrap_err().contains("at most 4096"));
    assert!(
        expand(&"{a}".repeat(17), 100)
            .unwrap_err()
            .contains("over 16 brace groups")
    );
    assert!(
        expand(&format!("{{{}}}", ",".repeat(2000)), 1000)
            .unwrap_err()
            .contains("over 1000")
    );
    assert!(expand(&format!("x-{{{}1..2}}", "0".repeat(30)), 100).is_err());
    assert!(expand("a.tar", 0).is_err());
    let dir = scratch_dir("bounded");
    let list = dir.join("many.txt");
    std::fs::write(&list, "s-{0000000..1048575}.tar\none-more.tar\n").unwrap();
    let err = shard_list(&[format!("@{}", list.display())]).unwrap_err();
    assert!(err.contains("over 0 shards"), "{err}");
}

/// A shard mutated at random, 400 times (header bytes flipped, header blocks zeroed, blocks cut
/// out, the end cut off, and blocks forged into headers that check out but lie about their
/// size, octal or base-256 up to 2^64 - 1) is read to its end every time, within a minute and
/// without a panic: each input a reject naming the shard or a sample the shard had, whole (its
/// one image; byte for byte the original unless a forged header or a block cut out redrew the
/// members' bounds, which tar, with no checksum over data, cannot tell).
#[test]
fn mutated_shards_end_in_samples_or_rejects() {
    let dir = scratch_dir("mutated");
    let record = |id: &str| json(serde_json::json!({"conversations": conversation(id, "a")}));
    let small = std::fs::read(format!("{DATA}/resized/grace_hopper-56-draft.png")).unwrap();
    let keys: Vec<String> = (0..12).map(|i| format!("{i:03}")).collect();
    let names: Vec<(String, String)> = keys
        .iter()
        .map(|k| (format!("{k}.json"), format!("{k}.png")))
        .collect();
    let mut members = Vec::new();
    for (k, (j, p)) in keys.iter().zip(&names) {
        members.push((j.as_str(), record(k)));
        members.push((p.as_str(), small.clone()));
    }
    let good = dir.join("good.tar");
    python_tar(&good, "pax", &members);
    let bytes = std::fs::read(&good).unwrap();
    let headers: Vec<usize> = (0..bytes.len() / 512)
        .map(|b| b * 512)
        .filter(|&b| &bytes[b + 257..b + 262] == b"ustar")
        .collect();
    assert!(headers.len() >= 2 * keys.len());
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    /// Sets the checksum of the header in `h` to match it.
    fn checksum(h: &mut [u8]) {
        h[148..156].fill(b' ');
        let sum: u64 = h.iter().map(|&b| u64::from(b)).sum();
        h[148..155].copy_from_slice(format!("{sum:06o}\0").as_bytes());
    }
    let mutated = dir.join("mutated.tar");
    let shard = mutated.display().to_string();
    let mut refused = 0;
    for round in 0..400 {
        let mut m = bytes.clone();
        let mut forged = false;
        // Blocks cut out and the end cut off come last, so the header offsets hold until then.
        let mut ops: Vec<u64> = (0..1 + next() % 3).map(|_| next() % 6).collect();
        ops.sort_by_key(|&op| matches!(op, 2 | 3));
        for op in ops {
            let header = headers[(next() % headers.len() as u64) as usize];
            let any = (next() % (m.len() as u64 / 512)) as usize * 512;
            match op {
                0 if header < m.len() => m[header + (next() % 512) as usize] ^= 1 << (next() % 8),
                1 if header + 512 <= m.len() => m[header..header + 512].fill(0),
                // A block cut out of a member's data goes unseen where the member's end then
                // meets a later header (tar has no checksum over data): another redrawing.
                2 if any + 512 <= m.len() => {
                    m.drain(any..any + 512);
                    forged = true;
                }
                3 => m.truncate((next() % m.len() as u64) as usize),
                // A block forged into a header with a size in octal.
                4 if any + 512 <= m.len() => {
                    let h = &mut m[any..any + 512];
                    h[124..135].copy_from_slice(format!("{:011o}", next() % (1 << 33)).as_bytes());
                    h[257..263].copy_from_slice(b"ustar\0");
                    checksum(h);
                    forged = true;
                }
                // A header's size in base-256, anything up to 2^64 - 1.
                5 if header + 512 <= m.len() => {
                    let h = &mut m[header..header + 512];
                    h[124..128].copy_from_slice(&[0x80, 0, 0, 0]);
                    let size = match next() % 3 {
                        0 => u64::MAX - next() % 4096,
                        1 => next(),
                        _ => next() % (1 << 20),
                    };
                    h[128..136].copy_from_slice(&size.to_be_bytes());
                    checksum(h);
                    forged = true;
                }
                _ => {}
            }
            if m.len() < 512 {
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
                Input::Read(record, images) => {
                    assert!(
                        keys.contains(&record.id),
                        "round {round}: a sample {:?} the shard never had",
                        record.id
                    );
                    assert_eq!(images.len(), 1, "round {round}: {}", record.id);
                    assert!(
                        forged || images[0][..] == small[..],
                        "round {round}: sample {} with other bytes than its image's",
                        record.id
                    );
                }
                Input::Rejected(r) => {
                    assert!(r.reason.contains(&shard), "round {round}: {r:?}")
                }
                Input::Record(_) => unreachable!(),
            }
        }
        // Indexed for a stream: the index refuses the shard (one the one-pass read could not
        // read to its end), or reads by index give what the one-pass read gave, sample by
        // sample, in any order.
        let indexed = ShardRows::open(
            vec![Shard::Local(mutated.clone())],
            Arc::new(LocalFiles::anywhere(1 << 20)),
            1 << 20,
            (4 << 10, 1 << 20),
            |_| true,
        );
        let Ok(rows) = indexed else {
            refused += 1;
            continue;
        };
        let expected: Vec<Compared> = inputs.into_iter().map(compared).collect();
        assert_eq!(rows.len(), expected.len() as u64, "round {round}");
        for i in (0..rows.len()).rev() {
            assert_eq!(
                compared_read(rows.get(i)),
                expected[i as usize],
                "round {round}: sample {i}"
            );
        }
    }
    // Most damage leaves a shard that reads to its end (samples around it rejected).
    assert!(
        refused < 200,
        "{refused} of 400 damaged shards refused by the index"
    );
}

/// A sample as compared between a one-pass read and a read by index: (id, images' bytes,
/// content, origin), or (line, id, reason) of its reject.
type Compared = Result<(u64, String, Vec<Vec<u8>>, Content, String), Rejected>;

fn compared(input: Input) -> Compared {
    match input {
        Input::Read(record, images) => Ok((
            record.line,
            record.id,
            images.iter().map(|b| b.to_vec()).collect(),
            record.content,
            record.origin.unwrap_or_default().into(),
        )),
        Input::Rejected(r) => Err((r.line, r.id, r.reason)),
        Input::Record(r) => panic!("a shard's sample {} came without its images", r.id),
    }
}

fn compared_read(read: Result<Indexed, Reject>) -> Compared {
    match read {
        Ok(Indexed {
            record,
            images: Some(images),
        }) => compared(Input::Read(record, images)),
        Ok(Indexed { record, .. }) => compared(Input::Record(record)),
        Err(reject) => compared(Input::Rejected(reject)),
    }
}

/// `ShardRows`, a stream's source: samples read by index, in any order and from several
/// threads, are the samples (and rejects) a one-pass read gives, line for line, over shards in
/// pax, GNU and ustar form (long names in extended headers before their members) cut into
/// several pieces. A piece is read once while the cache holds it and again (counted) after;
/// a shard written again after it was indexed is refused; a missing shard stops the index.
#[test]
fn samples_by_index_are_the_samples_a_one_pass_read_gives() {
    let dir = scratch_dir("index");
    let photos = [
        photo("grace_hopper.jpg"),
        photo("chelsea.png"),
        photo("rocket.jpg"),
    ];
    let long = format!("{}/deep", "d".repeat(120));
    let members_of = |tag: &str, n: usize| -> Vec<(String, Vec<u8>)> {
        let mut members = Vec::new();
        for i in 0..n {
            let key = match i % 3 {
                0 => format!("{long}/{tag}{i:03}"),
                _ => format!("{tag}{i:03}"),
            };
            members.push((
                format!("{key}.json"),
                json(serde_json::json!({"conversations": conversation(&format!("what is {i}?"), "this")})),
            ));
            members.push((format!("{key}.jpg"), photos[i % 3].clone()));
        }
        members
    };
    let mut shards = Vec::new();
    for (n, format) in ["pax", "gnu", "ustar"].iter().enumerate() {
        let members = members_of(&format!("s{n}-"), 9);
        // (ustar has no long names: its keys stay short.)
        let members: Vec<(String, Vec<u8>)> = match *format {
            "ustar" => members
                .into_iter()
                .map(|(name, bytes)| (name.replace(&format!("{long}/"), ""), bytes))
                .collect(),
            _ => members,
        };
        let members: Vec<(&str, Vec<u8>)> = members
            .iter()
            .map(|(m, b)| (m.as_str(), b.clone()))
            .collect();
        let tar = dir.join(format!("{format}.tar"));
        python_tar(&tar, format, &members);
        shards.push(Shard::Local(tar));
    }
    // Chelsea (240 KB) is over the limit: its samples are rejects, in both reads alike.
    let max_image_bytes = 200 << 10;
    let (inputs, _) = read_all(shards.clone(), max_image_bytes);
    let expected: Vec<Compared> = inputs.into_iter().map(compared).collect();
    assert_eq!(expected.len(), 27);
    assert_eq!(expected.iter().filter(|e| e.is_err()).count(), 9);

    let open = |cache_bytes: u64| {
        ShardRows::open(
            shards.clone(),
            Arc::new(LocalFiles::anywhere(max_image_bytes)),
            max_image_bytes,
            (300 << 10, cache_bytes),
            |_| true,
        )
        .unwrap()
    };
    let same = |rows: &ShardRows, index: u64| {
        assert_eq!(
            compared_read(rows.get(index)),
            expected[index as usize],
            "sample {index}"
        );
    };

    // Out of order, with room for every piece: each read once.
    let rows = open(1 << 30);
    assert_eq!(rows.len(), 27);
    let pieces = rows.pieces();
    assert!(pieces > 3, "several pieces a shard: {pieces}");
    for i in 0..27 {
        same(&rows, (i * 7) % 27);
    }
    assert_eq!(rows.reads().reread.load(Ordering::Relaxed), 0);
    assert!(rows.get(27).is_err());

    // Four threads at once, each its own order, reading ahead too.
    let rows = Arc::new(open(1 << 30));
    rows.clone().prefetch(26);
    std::thread::scope(|scope| {
        for t in 0..4u64 {
            let rows = rows.clone();
            scope.spawn(move || {
                for i in 0..27 {
                    same(&rows, (i * (t * 2 + 1) + t) % 27);
                }
            });
        }
    });
    assert_eq!(rows.reads().reread.load(Ordering::Relaxed), 0);

    // A cache of one piece, read back and forth: pieces read again, the same samples.
    let rows = open(1);
    for i in 0..27u64 {
        same(&rows, if i % 2 == 0 { i / 2 } else { 26 - i / 2 });
    }
    assert!(rows.reads().reread.load(Ordering::Relaxed) > 0);

    // A shard written again once indexed: its samples are refused, the others still read.
    let rows = open(1 << 30);
    let Shard::Local(gnu) = &shards[1] else {
        unreachable!()
    };
    let members = members_of("again-", 9);
    let members: Vec<(&str, Vec<u8>)> = members
        .iter()
        .map(|(m, b)| (m.as_str(), b.clone()))
        .collect();
    python_tar(gnu, "gnu", &members);
    let changed = rows.get(10).unwrap_err();
    assert!(
        changed
            .reason
            .contains("it changed since the stream started"),
        "{changed:?}"
    );
    same(&rows, 0);

    // A shard that is not there stops the index, naming it.
    let mut missing = shards.clone();
    missing.push(Shard::Local(dir.join("nowhere.tar")));
    let error = ShardRows::open(
        missing,
        Arc::new(LocalFiles::anywhere(max_image_bytes)),
        max_image_bytes,
        (300 << 10, 1 << 30),
        |_| true,
    )
    .unwrap_err();
    assert!(error.contains("nowhere.tar"), "{error}");
    let _ = std::fs::remove_dir_all(&dir);
}
