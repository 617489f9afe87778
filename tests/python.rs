//! The Python package's tests (python/tests, pytest), run by `cargo test` so the README's one
//! test command covers them: this builds the extension from the current source, stages it next
//! to the package's Python modules, and runs pytest against the daemon and producer binaries
//! cargo built for this test, once per torch users run:
//!
//! - `$FEEDSTORE_PYTHON`, else Debian's `/usr/bin/python3` (`python3-torch`: torch 1.13, numpy
//!   1.24; `scripts/test` points it at a venv over it that adds Ray);
//! - `$FEEDSTORE_PYPI_PYTHON`, else `/opt/feedstore-torch/bin/python`: PyPI's current torch with
//!   numpy 2;
//! - `$FEEDSTORE_OLDEST_PYTHON`, else `/opt/feedstore-torch21/bin/python`: the oldest torch 2
//!   the package supports (2.1) with numpy 1.26, on CPython 3.9, the oldest Python it supports.
//!
//! Each needs numpy, pytest and torch; `scripts/test` installs all three. The extension is not
//! built for the stable ABI, so an interpreter of another CPython version than the `python3` that
//! pyo3 builds for gets a build of its own.

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

fn oldest_interpreter() -> String {
    std::env::var("FEEDSTORE_OLDEST_PYTHON")
        .unwrap_or_else(|_| "/opt/feedstore-torch21/bin/python".into())
}

/// An interpreter the suite runs on: its path, its CPython version ("3.11") and what it has
/// ("python 3.11.2 torch 2.15.0 numpy 2.4.0").
struct Interpreter {
    python: String,
    version: String,
    has: String,
}

/// `python`'s versions, or a failure saying what is missing.
fn interpreter(python: &str) -> Interpreter {
    let check = Command::new(python)
        .args([
            "-c",
            "import platform, sys, numpy, pytest, torch\n\
             print('%d.%d' % sys.version_info[:2])\n\
             print('python', platform.python_version(), 'torch', torch.__version__, \
                   'numpy', numpy.__version__)",
        ])
        .output()
        .unwrap_or_else(|e| {
            panic!("cannot run {python}: {e} (./scripts/test --install-only installs it)")
        });
    assert!(
        check.status.success(),
        "{python} lacks numpy, pytest or torch (./scripts/test --install-only installs them): {}",
        String::from_utf8_lossy(&check.stderr)
    );
    let out = String::from_utf8_lossy(&check.stdout);
    let (version, has) = out.trim().split_once('\n').expect("two lines");
    Interpreter {
        python: python.to_string(),
        version: version.to_string(),
        has: has.to_string(),
    }
}

/// The CPython version that pyo3 builds the workspace's extension for, found as pyo3 finds its
/// interpreter: `PYO3_PYTHON`, else an active virtualenv's or conda environment's python, else
/// `python3` on PATH.
fn default_version() -> String {
    let env_python = |var: &str, bin: &str| {
        std::env::var_os(var)
            .filter(|v| !v.is_empty())
            .map(|v| PathBuf::from(v).join(bin))
    };
    let python = std::env::var_os("PYO3_PYTHON")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| env_python("VIRTUAL_ENV", "bin/python"))
        .or_else(|| env_python("CONDA_PREFIX", "bin/python"))
        .unwrap_or_else(|| PathBuf::from("python3"));
    let out = Command::new(&python)
        .args(["-c", "import sys; print('%d.%d' % sys.version_info[:2])"])
        .output()
        .unwrap_or_else(|e| panic!("{} (pyo3 builds for it): {e}", python.display()));
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// A directory for PYTHONPATH holding the package's Python modules and the extension found in
/// `lib_dir`.
fn stage(root: &Path, lib_dir: &Path, version: &str) -> PathBuf {
    let stage =
        std::env::temp_dir().join(format!("feedstore-python-{}-{version}", std::process::id()));
    let package = stage.join("feedstore");
    let _ = std::fs::remove_dir_all(&stage);
    std::fs::create_dir_all(&package).unwrap();
    for entry in std::fs::read_dir(root.join("python/feedstore")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "py") {
            std::fs::copy(&path, package.join(path.file_name().unwrap())).unwrap();
        }
    }
    std::fs::copy(lib_dir.join("lib_native.so"), package.join("_native.so")).unwrap();
    stage
}

#[test]
fn python_package_tests_pass() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    // All checked before anything runs: a missing venv fails at once, not after a suite.
    let interpreters: Vec<Interpreter> = [
        debian_interpreter(),
        pypi_interpreter(),
        oldest_interpreter(),
    ]
    .iter()
    .map(|python| interpreter(python))
    .collect();
    let default = default_version();
    let workspace_build = feedstore_testkit::build_library("feedstore-python");
    let bin_dir = Path::new(env!("CARGO_BIN_EXE_feedstored"))
        .parent()
        .unwrap();
    let mut failed = Vec::new();
    // One after the other: the suites start daemons and worker processes of their own.
    for Interpreter {
        python,
        version,
        has,
    } in &interpreters
    {
        let lib_dir = if *version == default {
            workspace_build.clone()
        } else {
            feedstore_testkit::build_python_extension("feedstore-python", python, version)
        };
        let stage = stage(&root, &lib_dir, version);
        eprintln!("== pytest with {python} ({has})");
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
            failed.push(format!("{python} ({has}): {status}"));
        }
        let _ = std::fs::remove_dir_all(&stage);
    }
    assert!(
        failed.is_empty(),
        "pytest failed with {}",
        failed.join("; ")
    );
}
