//! Test harness pieces shared by feedstore's integration tests, benchmarks and multi-node demo.
//!
//! Tests talk to real components: a real S3-compatible server ([`moto::Moto`], PyPI's
//! `moto[server]`) and real sockets. This kernel has no netem, so network latency and faults come
//! from [`proxy::FaultProxy`], an HTTP/1.1 proxy on loopback that adds per-request latency,
//! answers with 5xx, stalls or trickles bodies, and resets connections, following a [`proxy::Plan`]
//! that a test can change while it runs.
//!
//! ```no_run
//! use std::time::Duration;
//! use feedstore_testkit::moto::Moto;
//! use feedstore_testkit::proxy::{Fault, FaultProxy, Plan, Rule};
//!
//! let moto = Moto::start()?;
//! let proxy = FaultProxy::start(moto.addr(), Plan {
//!     latency: Duration::from_millis(20),
//!     rules: vec![Rule::new("img/flaky.jpg", Fault::Status(503)).times(2)],
//! })?;
//! // Point the S3 client at proxy.endpoint(): every request waits 20 ms, and the first two
//! // requests for img/flaky.jpg get a 503.
//! # Ok::<(), std::io::Error>(())
//! ```

pub mod alloc;
pub mod moto;
pub mod proxy;
pub mod systemd;
pub mod tar;

/// `target/<profile>` of the running test executable: where cargo put it, the workspace's
/// binaries and the libraries a test builds with a nested `cargo build` of the same profile.
pub fn target_dir() -> std::path::PathBuf {
    let exe = std::env::current_exe().expect("the test executable's path");
    exe.parent()
        .and_then(|deps| deps.parent())
        .expect("tests run from target/<profile>/deps")
        .to_owned()
}

/// Builds `package`'s library with the running test's profile into the same target directory
/// (`cargo test` builds neither cdylibs nor staticlibs of other packages), and returns that
/// directory.
pub fn build_library(package: &str) -> std::path::PathBuf {
    cargo_build_library(package, std::process::Command::new(env!("CARGO")));
    target_dir()
}

/// Builds the Python extension `package` for the interpreter `python` (pyo3 reads
/// `PYO3_PYTHON`) in a target directory of its own, `target/python<version>`, so that this build
/// and the workspace's (for the `python3` on PATH) never undo each other; returns the directory
/// its library is in.
pub fn build_python_extension(package: &str, python: &str, version: &str) -> std::path::PathBuf {
    let profile = target_dir();
    let own = profile
        .parent()
        .expect("target/<profile> has a parent")
        .join(format!("python{version}"));
    let mut cargo = std::process::Command::new(env!("CARGO"));
    cargo
        .env("PYO3_PYTHON", python)
        .env("CARGO_TARGET_DIR", &own);
    cargo_build_library(package, cargo);
    own.join(profile.file_name().expect("the profile's directory"))
}

fn cargo_build_library(package: &str, mut build: std::process::Command) {
    build.args(["build", "--locked", "-p", package, "--lib"]);
    if !cfg!(debug_assertions) {
        build.arg("--release");
    }
    let out = build
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("running cargo");
    assert!(
        out.status.success(),
        "building {package}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}
