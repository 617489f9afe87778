//! The producer pipeline end to end against a real store (an embedded `feedstored`: real socket,
//! real shared memory) and real files: a manifest that mixes good records with twelve kinds of
//! bad ones. Every good sample arrives readable with the right pixels and tokens; every bad one is
//! a reject with its line, id, stage and reason; the run never stops early and leaves nothing
//! half-written.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use common::{DATA, tokenizer};
use feedstore_consumer::{ConnectOptions, Role};
use feedstore_producer::chat::{Message, Role as Speaker, image_pad_tokens};
use feedstore_producer::manifest::Manifest;
use feedstore_producer::pipeline::{Event, LocalFiles, ProducerConfig, run};
use feedstore_producer::vision::Scratch;
use feedstore_proto::sample::SampleView;

fn scratch_dir(name: &str) -> PathBuf {
    let dir =
        std::env::temp_dir().join(format!("feedstore-producer-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn conv(image: &str, question: &str, answer: &str) -> String {
    serde_json::json!({
        "id": format!("good-{}", question.len()),
        "image": image,
        "conversations": [{"from": "human", "value": format!("<image>\n{question}")}, {"from": "gpt", "value": answer}],
    })
    .to_string()
}

fn write_images(dir: &Path) {
    for name in ["grace_hopper.jpg", "rocket.jpg", "chelsea.png"] {
        std::fs::copy(format!("{DATA}/photos/{name}"), dir.join(name)).unwrap();
    }
    let jpeg = std::fs::read(dir.join("rocket.jpg")).unwrap();
    std::fs::write(dir.join("truncated.jpg"), &jpeg[..jpeg.len() / 3]).unwrap();
    std::fs::write(
        dir.join("corrupt.png"),
        b"\x89PNG\r\n\x1a\nthis is not a png",
    )
    .unwrap();
    std::fs::write(dir.join("empty.jpg"), b"").unwrap();
    std::fs::write(dir.join("pic.bmp"), b"BM\x3a\x00\x00\x00\x00\x00\x00\x00").unwrap();
    let mut bomb = Vec::new();
    image::RgbImage::new(3000, 3000)
        .write_to(
            &mut std::io::Cursor::new(&mut bomb),
            image::ImageFormat::Png,
        )
        .unwrap();
    std::fs::write(dir.join("bomb.png"), bomb).unwrap();
    let mut sliver = Vec::new();
    image::RgbImage::new(3000, 10)
        .write_to(
            &mut std::io::Cursor::new(&mut sliver),
            image::ImageFormat::Png,
        )
        .unwrap();
    std::fs::write(dir.join("sliver.png"), sliver).unwrap();
}

#[test]
fn good_samples_arrive_and_every_bad_record_is_rejected_with_its_reason() {
    let dir = scratch_dir("mixed");
    write_images(&dir);
    let good = [
        conv("grace_hopper.jpg", "who is this?", "Grace Hopper."),
        conv("rocket.jpg", "what is launching?", "A rocket."),
        conv("chelsea.png", "what animal is this?", "A cat."),
        serde_json::json!({"id": "two", "images": ["chelsea.png", "rocket.jpg"], "conversations": [
            {"from": "human", "value": "<image>\n<image>\nwhich is warmer?"}, {"from": "gpt", "value": "The first."}]})
        .to_string(),
        serde_json::json!({"id": "plain", "text": "A plain text record, trained on in full."}).to_string(),
    ];
    // (line, expected stage, words in the reason)
    let bad: Vec<(String, &str, &str)> = vec![
        (conv("missing.jpg", "a", "b"), "fetch", "not found"),
        (conv("truncated.jpg", "bb", "b"), "decode", "truncated"),
        (conv("corrupt.png", "ccc", "b"), "decode", "corrupt"),
        (conv("empty.jpg", "dddd", "b"), "decode", ""),
        (
            conv("pic.bmp", "eeeee", "b"),
            "decode",
            "BMP images are not supported",
        ),
        (
            conv("bomb.png", "ffffff", "b"),
            "decode",
            "exceeds the limit",
        ),
        (conv("sliver.png", "ggggggg", "b"), "decode", "aspect ratio"),
        (
            conv("s3://bucket/key.jpg", "hhhhhhhh", "b"),
            "fetch",
            "unsupported source",
        ),
        (
            "{\"id\": \"broken\", \"conversations\": [".into(),
            "manifest",
            "malformed JSON",
        ),
        (
            "{\"id\": \"who\", \"conversations\": [{\"from\": \"robot\", \"value\": \"x\"}]}"
                .into(),
            "manifest",
            "unknown speaker",
        ),
        (
            serde_json::json!({"id": "long", "text": "word ".repeat(5000)}).to_string(),
            "tokenize",
            "exceed the maximum",
        ),
        (
            serde_json::json!({"id": "count", "image": "chelsea.png", "conversations": [
                {"from": "human", "value": "<image><image>"}, {"from": "gpt", "value": "x"}]})
            .to_string(),
            "tokenize",
            "placeholders",
        ),
    ];
    let mut lines: Vec<&str> = Vec::new();
    for (i, g) in good.iter().enumerate() {
        lines.push(g);
        if let Some((b, _, _)) = bad.get(i) {
            lines.push(b);
        }
    }
    for (b, _, _) in bad.iter().skip(good.len()) {
        lines.push(b);
    }
    let manifest_path = dir.join("manifest.jsonl");
    std::fs::write(&manifest_path, lines.join("\n")).unwrap();

    let socket = dir.join("feedstored.sock");
    let daemon = common::embedded_daemon(&socket, 256 << 20);

    let mut config = ProducerConfig::new(socket.clone());
    config.workers = 2;
    config.fetch_concurrency = 4;
    config.transform.max_source_pixels = 4_000_000;
    let tokenizer = Arc::new(tokenizer(4096));
    let manifest = Manifest::open(&manifest_path).unwrap();
    let (mut produced, mut rejects) = (Vec::new(), Vec::new());
    let summary = run(
        &config,
        tokenizer.clone(),
        Arc::new(LocalFiles::default()),
        manifest,
        |event, _| match event {
            Event::Produced(p) => produced.push(p.clone()),
            Event::Rejected(r) => rejects.push(r.clone()),
            Event::Idle => {}
        },
    )
    .unwrap();

    assert_eq!(summary.produced, good.len() as u64);
    assert_eq!(summary.rejected, bad.len() as u64);
    assert_eq!(
        produced.len() + rejects.len(),
        lines.len(),
        "every line accounted for once"
    );

    // Every bad record: its own line, the expected stage, a reason naming the problem.
    let by_line: BTreeMap<u64, _> = rejects.iter().map(|r| (r.line, r)).collect();
    assert_eq!(by_line.len(), bad.len(), "one reject per bad line");
    for (text, stage, words) in &bad {
        let line = lines.iter().position(|l| l == text).unwrap() as u64 + 1;
        let r = by_line
            .get(&line)
            .unwrap_or_else(|| panic!("line {line} not rejected"));
        assert_eq!(r.stage, *stage, "line {line}: {r:?}");
        assert!(
            r.reason.to_lowercase().contains(&words.to_lowercase()),
            "line {line}: {:?} lacks {words:?}",
            r.reason
        );
    }

    // Every good sample: readable, with the pixels a direct transform of the same bytes gives
    // and the token ids the tokenizer gives.
    let reader = ConnectOptions::new(Role::Reader)
        .socket(&socket)
        .connect()
        .unwrap();
    let mut scratch = Scratch::default();
    for p in &produced {
        let lease = reader.get(p.handle).unwrap();
        let sample = SampleView::new(&lease).unwrap();
        assert_eq!(sample.id(), p.id);
        let line = lines[p.line as usize - 1];
        let record: serde_json::Value = serde_json::from_str(line).unwrap();
        let mut pads = Vec::new();
        for (i, key) in sample.source_keys().enumerate() {
            let bytes = std::fs::read(key).unwrap();
            let t = &config.transform;
            let decoded = t.decode(&bytes).unwrap();
            let target = decoded.target;
            let mut expected = vec![0u8; sample.image(i).unwrap().bytes().len()];
            t.resize_into(&decoded.rgb, target, &mut expected, &mut scratch)
                .unwrap();
            assert!(
                sample.image(i).unwrap().bytes() == &expected[..],
                "{}: image {i} differs",
                p.id
            );
            assert!(
                reader.maps(sample.image(i).unwrap().bytes().as_ptr()),
                "in place in shared memory"
            );
            pads.push(image_pad_tokens(target.1, target.0, 14, 2));
            assert_eq!(
                sample.image_grid_thw(i),
                Some([1, target.1 / 14, target.0 / 14])
            );
        }
        let expected = match record.get("conversations") {
            Some(turns) => {
                let messages: Vec<Message> = turns
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|t| {
                        Message::new(
                            Speaker::from_llava(t["from"].as_str().unwrap()).unwrap(),
                            t["value"].as_str().unwrap(),
                        )
                    })
                    .collect();
                tokenizer.encode(&messages, &pads).unwrap()
            }
            None => tokenizer
                .encode_text(record["text"].as_str().unwrap())
                .unwrap(),
        };
        assert_eq!(sample.tokens(), &expected.ids[..], "{}", p.id);
        assert_eq!(sample.labels(), &expected.labels[..], "{}", p.id);
    }

    // Nothing half-written: no reservation left open, every sealed object is a produced sample.
    let stats = reader.stats().unwrap();
    assert_eq!(stats.objects_writing, 0);
    assert_eq!(stats.objects_sealed, good.len() as u64);
    // The profiler saw every stage.
    for (stage, _, items) in &summary.profile.stages {
        assert!(*items > 0, "stage {} recorded nothing", stage.name());
    }
    drop(reader);
    daemon.stop();
    let _ = std::fs::remove_dir_all(&dir); // (kept when the test fails, to look at)
}
