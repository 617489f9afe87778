//! `feedstore demo`, the README's main job, as a user runs it (scaled down): the whole ladder and
//! a feedstore run with two ranks over a freshly built data set, the scaling view, and the S3
//! mode against a real moto_server. Checks the printed figures, the JSON report's structure, the
//! plot, and that the feedstore ranks were handed every record of the epoch exactly once between
//! them. Timings are printed, never asserted.

mod common;

use std::path::Path;
use std::process::{Command, Output};

use common::scratch_dir;

/// Runs `feedstore demo` with `args`, its data set, report and plot in `dir`; returns the output
/// and the report. `configure` adds to the command (environment, for S3).
fn demo(
    dir: &Path,
    name: &str,
    args: &[&str],
    configure: impl FnOnce(&mut Command),
) -> (Output, serde_json::Value) {
    let report = dir.join(format!("{name}.json"));
    let mut command = Command::new(env!("CARGO_BIN_EXE_feedstore"));
    command
        .arg("demo")
        .args(args)
        .args(["--records=32", "--image-sides=64-256", "--capacity=256MiB"])
        .arg("--data-dir")
        .arg(dir.join("data"))
        .arg("--report")
        .arg(&report)
        .arg("--plot")
        .arg(dir.join(format!("{name}.png")))
        .env_remove("AWS_ENDPOINT_URL");
    configure(&mut command);
    let out = command.output().unwrap();
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let report = serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    (out, report)
}

/// Every record the feedstore run's ranks were handed, sorted.
fn delivered(report: &serde_json::Value) -> Vec<u64> {
    let mut records: Vec<u64> = report["feedstore"]["delivered_records"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|rank| rank.as_array().unwrap().iter().map(|r| r.as_u64().unwrap()))
        .collect();
    records.sort_unstable();
    records
}

#[test]
fn the_demo_runs_the_ladder_and_delivers_every_sample_once() {
    let dir = scratch_dir("demo");
    let (out, report) = demo(
        &dir,
        "ladder",
        &["--ranks=2", "--batch=4", "--steps=4", "--latency-ms=1-3"],
        |c| {
            c.args(["--step-time=0.01", "--prefetch=8"]);
        },
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("building the demo data set once"),
        "{stderr}"
    );
    for line in [
        "0 serial loader in the training loop",
        "1 + concurrent fetch and CPU workers",
        "2 + background prefetch (copies)",
        "3 feedstore: shared memory, by handle",
        "feedstore, 2 ranks:",
        "rank 0: wait",
        "rank 1: wait",
        "store:",
        "verdict:",
    ] {
        assert!(stdout.contains(line), "{line:?} missing from:\n{stdout}");
    }
    let ladder = report["ladder"].as_array().unwrap();
    assert_eq!(ladder.len(), 4);
    for rung in ladder {
        let ratio = rung["wait_ratio"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&ratio), "{rung}");
        assert!(rung["samples_per_sec"].as_f64().unwrap() > 0.0);
        assert_eq!(rung["samples"], 16, "4 steps of 4 samples: {rung}");
        assert_eq!(rung["steps"][0].as_array().unwrap().len(), 4);
    }
    let feedstore = &report["feedstore"];
    assert_eq!(feedstore["ranks"], 2);
    assert_eq!(
        feedstore["wait_ratio_per_rank"].as_array().unwrap().len(),
        2
    );
    assert!(feedstore["profile"]["verdict"].as_str().unwrap().len() > 10);
    assert!(feedstore["store"]["used_bytes"].as_u64().unwrap() > 0);
    assert_eq!(report["settings"]["records"], 32);
    let plot = image::open(dir.join("ladder.png")).expect("a PNG plot");
    assert!(plot.width() >= 800 && plot.height() >= 300);
    // 2 ranks x 4 steps x 4 samples = one epoch of 32 records: each handed out exactly once.
    assert_eq!(delivered(&report), (0..32).collect::<Vec<_>>());

    // A second run reuses the data set, and adds the scaling view.
    let (out, report) = demo(
        &dir,
        "scaling",
        &["--ranks=1", "--batch=4", "--steps=2", "--latency-ms=0-1"],
        |c| {
            c.args(["--step-time=0", "--no-ladder", "--scaling"]);
        },
    );
    assert!(!String::from_utf8_lossy(&out.stderr).contains("building"));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("cached") && stdout.contains("scaling"),
        "{stdout}"
    );
    let cells = report["scaling"].as_array().unwrap();
    // 1, 2 and 4 ranks; half and double the batch; three times the latency.
    assert_eq!(cells.len(), 6, "{cells:?}");
    for cell in cells {
        for loader in ["copies", "feedstore"] {
            let ranks = cell["ranks"].as_u64().unwrap() as usize;
            assert_eq!(
                cell[loader]["steps"].as_array().unwrap().len(),
                ranks,
                "{cell}"
            );
            assert!((0.0..=1.0).contains(&cell[loader]["wait_ratio"].as_f64().unwrap()));
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_demo_serves_its_images_from_an_s3_endpoint() {
    let moto = feedstore_testkit::moto::Moto::start().expect("moto_server (see .ci/run)");
    let dir = scratch_dir("demo-s3");
    let (out, report) = demo(
        &dir,
        "s3",
        &["--ranks=2", "--batch=4", "--steps=4", "--latency-ms=0-2"],
        |c| {
            c.args(["--step-time=0.01", "--no-ladder", "--s3-bucket=demo-test"])
                .arg(format!("--s3-endpoint={}", moto.endpoint()))
                .env("AWS_ACCESS_KEY_ID", "test")
                .env("AWS_SECRET_ACCESS_KEY", "test")
                .env("AWS_REGION", "us-east-1")
                // Nothing from this machine's AWS set-up.
                .env("AWS_CONFIG_FILE", dir.join("no-aws-config"))
                .env(
                    "AWS_SHARED_CREDENTIALS_FILE",
                    dir.join("no-aws-credentials"),
                )
                .env("AWS_EC2_METADATA_DISABLED", "true")
                .env_remove("AWS_PROFILE");
        },
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("uploading the data set's 32 images"),
        "{stderr}"
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("images in S3 at"), "{stdout}");
    assert_eq!(report["settings"]["s3_endpoint"], moto.endpoint());
    assert_eq!(delivered(&report), (0..32).collect::<Vec<_>>());
    let _ = std::fs::remove_dir_all(&dir);
}

/// `demo --nodes`, scaled down: two namespaced nodes with capped links, every placement at both
/// scales; each run's ranks get every step's batch, the links carried traffic, and the verdict
/// lines and report are there. Without root it refuses, saying why and what to do instead.
#[test]
fn the_nodes_demo_compares_placements_across_namespaced_nodes() {
    let dir = scratch_dir("demo-nodes");
    if !common::is_root() {
        eprintln!("SKIPPED the_nodes_demo_compares_placements: needs root to make namespaces");
        return;
    }
    let (out, report) = demo(
        &dir,
        "nodes",
        &[
            "--nodes=2",
            "--batch=2",
            "--steps=4",
            "--latency-ms=0-2",
            "--link-rate=400mbit",
            "--step-time=0.02",
        ],
        |_| {},
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    for line in [
        "x4: spread + pull",
        "base: spread and colocated",
        "x4: relay",
    ] {
        assert!(stdout.contains(line), "{line:?} missing from:\n{stdout}");
    }
    let runs = report["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 6, "three placements at two scales");
    for run in runs {
        let (ranks, batch) = (
            run["ranks"].as_u64().unwrap(),
            run["batch"].as_u64().unwrap(),
        );
        assert_eq!(run["samples"].as_u64().unwrap(), ranks * batch * 4, "{run}");
        let links: Vec<u64> = run["link_bytes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| b.as_u64().unwrap())
            .collect();
        assert!(
            links.iter().all(|&b| b > 0),
            "both links carried samples: {run}"
        );
    }
    assert_eq!(report["link_rate_bits"].as_u64(), Some(400_000_000));
    assert!(dir.join("nodes.png").exists());

    // A user without root is told what it needs.
    let data = dir.join("data");
    let mut command = Command::new(env!("CARGO_BIN_EXE_feedstore"));
    command
        .args(["demo", "--nodes=2", "--records=32", "--image-sides=64-256"])
        .arg("--data-dir")
        .arg(&data)
        .current_dir(&dir);
    std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
    common::run_as(&mut command, 65534, 65534, &[]);
    let out = command.output().unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--nodes needs root"), "{stderr}");
}
