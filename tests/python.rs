//! The Python package's tests (python/tests, pytest), run by `cargo test` so the README's one
//! test command covers them: this builds the extension from the current source, stages it next
//! to the package's Python modules, and runs pytest against the daemon and producer binaries
//! cargo built for this test. The interpreter is `$FEEDSTORE_PYTHON`, else Debian's
//! `/usr/bin/python3` (where `python3-torch` lives), else `python3`; it needs numpy, pytest and
//! torch (`.ci/run` installs them).

use std::path::{Path, PathBuf};
use std::process::Command;

fn interpreter() -> String {
    std::env::var("FEEDSTORE_PYTHON").unwrap_or_else(|_| {
        if Path::new("/usr/bin/python3").exists() {
            "/usr/bin/python3".into()
        } else {
            "python3".into()
        }
    })
}

#[test]
fn python_package_tests_pass() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let python = interpreter();
    let check = Command::new(&python)
        .args(["-c", "import numpy, pytest, torch"])
        .output()
        .unwrap_or_else(|e| panic!("cannot run {python}: {e}"));
    assert!(
        check.status.success(),
        "{python} lacks numpy, pytest or torch (Debian: apt-get install python3-numpy \
         python3-pytest python3-torch; see .ci/run): {}",
        String::from_utf8_lossy(&check.stderr)
    );

    let target = feedstore_testkit::build_library("feedstore-python");

    let stage = std::env::temp_dir().join(format!("feedstore-python-{}", std::process::id()));
    let package = stage.join("feedstore");
    let _ = std::fs::remove_dir_all(&stage);
    std::fs::create_dir_all(&package).unwrap();
    for entry in std::fs::read_dir(root.join("python/feedstore")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "py") {
            std::fs::copy(&path, package.join(path.file_name().unwrap())).unwrap();
        }
    }
    std::fs::copy(target.join("lib_native.so"), package.join("_native.so")).unwrap();

    let bin_dir = Path::new(env!("CARGO_BIN_EXE_feedstored"))
        .parent()
        .unwrap();
    let status = Command::new(&python)
        .args(["-m", "pytest", "-q", "-p", "no:cacheprovider"])
        // Only this suite's conftest.py: none from directories above the checkout.
        .arg(format!("--rootdir={}", root.join("python").display()))
        .arg(format!(
            "--confcutdir={}",
            root.join("python/tests").display()
        ))
        .arg(root.join("python/tests"))
        .env("PYTHONPATH", &stage)
        .env("FEEDSTORE_BIN_DIR", bin_dir)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .status()
        .unwrap();
    let _ = std::fs::remove_dir_all(&stage);
    assert!(status.success(), "pytest failed: {status}");
}
