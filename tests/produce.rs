//! `feedstore produce` as a user runs it: a real `feedstored` process, a manifest with good and
//! bad records, a rejects file, a summary with the stage profile and verdict, and a non-zero exit
//! when the reject rate passes the threshold.

mod common;

use std::io::Read;
use std::process::Command;
use std::time::Duration;

use common::*;

const DATA: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/producer/tests/data");

#[test]
fn produce_writes_samples_and_lists_rejects() {
    let _w = watchdog(
        "produce_writes_samples_and_lists_rejects",
        Duration::from_secs(120),
    );
    let dir = scratch_dir("produce");
    let daemon = DaemonProcess::start(&dir, &[]);
    let gz = std::fs::read(format!("{DATA}/qwen3-tokenizer.json.gz")).unwrap();
    let mut json = Vec::new();
    flate2::read::GzDecoder::new(&gz[..])
        .read_to_end(&mut json)
        .unwrap();
    let tokenizer = dir.join("tokenizer.json");
    std::fs::write(&tokenizer, json).unwrap();
    let record = |id: &str, image: &str| {
        serde_json::json!({"id": id, "image": image, "conversations": [
            {"from": "human", "value": "<image>\nwhat is this?"}, {"from": "gpt", "value": "a photo"}]})
        .to_string()
    };
    let manifest = dir.join("m.jsonl");
    let lines = [
        record("hopper", &format!("{DATA}/photos/grace_hopper.jpg")),
        record("cat", &format!("{DATA}/photos/chelsea.png")),
        record("gone", "no/such/file.jpg"),
        "{\"id\": \"half\", \"conversations\": [".to_string(),
    ];
    std::fs::write(&manifest, lines.join("\n")).unwrap();
    let run = |extra: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_feedstore"))
            .args(["produce", "--socket", daemon.socket.to_str().unwrap()])
            .args([
                "--manifest",
                manifest.to_str().unwrap(),
                "--tokenizer",
                tokenizer.to_str().unwrap(),
            ])
            .args(["--workers", "2"])
            .args(extra)
            .output()
            .unwrap()
    };
    let out = run(&["--max-reject-rate", "0.6"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("produced 2 samples"), "{stdout}");
    assert!(stdout.contains("rejected 2 (50.0%)"), "{stdout}");
    assert!(stdout.contains("verdict: "), "{stdout}");
    for stage in ["fetch", "decode", "resize+normalize", "tokenize", "write"] {
        assert!(stdout.contains(stage), "profile lists {stage}: {stdout}");
    }
    let rejects = std::fs::read_to_string(dir.join("m.jsonl.rejects.jsonl")).unwrap();
    let rows: Vec<serde_json::Value> = rejects
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 2);
    let gone = rows.iter().find(|r| r["id"] == "gone").unwrap();
    assert_eq!(
        (gone["line"].as_u64(), gone["stage"].as_str()),
        (Some(3), Some("fetch"))
    );
    let half = rows.iter().find(|r| r["line"] == 4).unwrap();
    assert_eq!(half["stage"], "manifest");
    assert_eq!(daemon.reader().stats().unwrap().objects_sealed, 2);

    // The same run with the default 5% threshold fails, saying why.
    let out = run(&[]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("above --max-reject-rate"), "{stderr}");
}
