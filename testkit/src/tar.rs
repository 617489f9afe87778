//! WebDataset shards for tests, written by Python's `tarfile` (what `webdataset`'s writers
//! use), so the reader is tested against real tar files, not ones made by its own rules; and
//! the Python that writes other test data (Parquet through pyarrow and `datasets`).

use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};

/// Writes a tar at `out` in `format` (`pax`, `gnu` or `ustar`) holding each `(name, bytes)`
/// in order.
pub fn python_tar(out: &Path, format: &str, members: &[(&str, Vec<u8>)]) {
    let dir = out.with_extension("members");
    std::fs::create_dir_all(&dir).unwrap();
    let mut list = Vec::new();
    for (i, (name, bytes)) in members.iter().enumerate() {
        let file = dir.join(i.to_string());
        std::fs::write(&file, bytes).unwrap();
        list.push(serde_json::json!([name, file]));
    }
    run_python(
        r#"
import json, sys, tarfile
spec = json.load(sys.stdin)
formats = {"pax": tarfile.PAX_FORMAT, "gnu": tarfile.GNU_FORMAT, "ustar": tarfile.USTAR_FORMAT}
with tarfile.open(spec["out"], "w", format=formats[spec["format"]]) as tar:
    for name, path in spec["members"]:
        tar.add(path, arcname=name)
"#,
        &serde_json::json!({"out": out, "format": format, "members": list}),
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Runs `script` with `python3`, `input` as JSON on its stdin; panics unless it succeeds.
pub fn run_python(script: &str, input: &serde_json::Value) {
    run_python_with("python3", script, input)
}

/// The Python that has pyarrow and Hugging Face `datasets`: `$FEEDSTORE_PYTHON`, else the venv
/// `scripts/test --install-only` makes (`/opt/feedstore-ray`).
pub fn data_python() -> String {
    std::env::var("FEEDSTORE_PYTHON").unwrap_or_else(|_| "/opt/feedstore-ray/bin/python".into())
}

/// Runs `script` with `python`, `input` as JSON on its stdin; panics unless it succeeds.
pub fn run_python_with(python: &str, script: &str, input: &serde_json::Value) {
    let mut child = Command::new(python)
        .args(["-c", script])
        .stdin(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{python} runs: {e}"));
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.to_string().as_bytes())
        .unwrap();
    assert!(child.wait().unwrap().success(), "{python} failed");
}
