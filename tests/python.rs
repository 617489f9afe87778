//! The Python package's tests (python/tests, pytest), run by `cargo test` so the README's one
//! test command covers them: this builds the extension from the current source, stages it next
//! to the package's Python modules, and runs pytest against the daemon and producer binaries
//! cargo built for this test, once per torch users run:
//!
//! - `$FEEDSTORE_PYTHON`, else Debian's `/usr/bin/python3` (`python3-torch`: torch 1.13, numpy
//!   1.24; `scripts/test` points it at a venv over it that adds Ray);
//! - `$FEEDSTORE_PYPI_PYTHON`, else `/opt/feedstore-torch/bin/python`: PyPI's current torch with
//!   numpy 2.
//!
//! Each needs numpy, pytest and torch; `scripts/test` installs both.

use std::path::{Path, PathBuf};
use std::process::Command;

fn debian_interpreter() -> String {
    std::env::var("FEEDSTORE_PYTHON").unwrap_or_else(|_| {
        if Path::new("/usr/bin/python3").exists() {
            "/usr/bin/python3".into()
        } else {
            "python3".into()
        }
    })
}

fn pypi_interpreter() -> String {
    std::env::var("FEEDSTORE_PYPI_PYTHON")
        .unwrap_or_else(|_| "/opt/feedstore-torch/bin/python".into())
}

/// The interpreter's torch and numpy versions, or a failure saying what is missing.
fn versions(python: &str) -> String {
    let check = Command::new(python)
        .args([
            "-c",
            "import numpy, pytest, torch; print('torch', torch.__version__, 'numpy', numpy.__version__)",
        ])
        .output()
        .unwrap_or_else(|e| panic!("cannot run {python}: {e} (./scripts/test --install-only installs it)"));
    assert!(
        check.status.success(),
        "{python} lacks numpy, pytest or torch (./scripts/test --install-only installs them): {}",
        String::from_utf8_lossy(&check.stderr)
    );
    String::from_utf8_lossy(&check.stdout).trim().to_string()
}

#[test]
fn python_package_tests_pass() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    // Both checked before anything runs: a missing venv fails at once, not after one suite.
    let interpreters: Vec<(String, String)> = [debian_interpreter(), pypi_interpreter()]
        .into_iter()
        .map(|python| {
            let versions = versions(&python);
            (python, versions)
        })
        .collect();

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
    let mut failed = Vec::new();
    // One after the other: the suites start daemons and worker processes of their own.
    for (python, versions) in &interpreters {
        eprintln!("== pytest with {python} ({versions})");
        let status = Command::new(python)
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
        if !status.success() {
            failed.push(format!("{python} ({versions}): {status}"));
        }
    }
    let _ = std::fs::remove_dir_all(&stage);
    assert!(
        failed.is_empty(),
        "pytest failed with {}",
        failed.join("; ")
    );
}
