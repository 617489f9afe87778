//! What the benchmarks share: test images derived from the committed photos.

#![allow(dead_code)]

use std::path::{Path, PathBuf};

/// The S3 benches' flags: `--quick` (a shorter run) and `--latency-ms N`, the latency the
/// proxy adds to every request (default 50 ms).
pub fn s3_bench_flags() -> (bool, std::time::Duration) {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    let latency = std::time::Duration::from_millis(
        args.iter()
            .position(|a| a == "--latency-ms")
            .and_then(|i| args.get(i + 1))
            .map_or(50, |v| v.parse().expect("--latency-ms N")),
    );
    (quick, latency)
}

/// The committed test photos.
pub const PHOTOS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/producer/tests/data/photos");

/// Writes the 9 benchmark JPEGs into `dir`: each test photo rescaled so its long side is 512,
/// 1024 and 2048 px, re-encoded at quality 90 (the sizes SFT data has).
pub fn derive_images(dir: &Path) -> Vec<PathBuf> {
    std::fs::create_dir_all(dir).unwrap();
    let mut out = Vec::new();
    for name in ["grace_hopper.jpg", "rocket.jpg", "chelsea.png"] {
        let img = image::open(format!("{PHOTOS}/{name}")).unwrap().into_rgb8();
        for long in [512u32, 1024, 2048] {
            let (w, h) = img.dimensions();
            let scale = f64::from(long) / f64::from(w.max(h));
            let (nw, nh) = (
                (f64::from(w) * scale).round() as u32,
                (f64::from(h) * scale).round() as u32,
            );
            let resized =
                image::imageops::resize(&img, nw, nh, image::imageops::FilterType::Triangle);
            let path = dir.join(format!("{}-{long}.jpg", name.split('.').next().unwrap()));
            let mut bytes = Vec::new();
            image::codecs::jpeg::JpegEncoder::new_with_quality(&mut bytes, 90)
                .encode_image(&resized)
                .unwrap();
            std::fs::write(&path, bytes).unwrap();
            out.push(path);
        }
    }
    out
}

/// The Qwen3 `tokenizer.json`, decompressed from the committed copy.
pub fn tokenizer_json() -> Vec<u8> {
    use std::io::Read;
    let gz = std::fs::read(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/producer/tests/data/qwen3-tokenizer.json.gz"
    ))
    .unwrap();
    let mut json = Vec::new();
    flate2::read::GzDecoder::new(&gz[..])
        .read_to_end(&mut json)
        .unwrap();
    json
}

/// S3 client options for a moto server (or a proxy in front of it) at `endpoint`.
pub fn s3_options(endpoint: String) -> feedstore_s3::S3Options {
    feedstore_s3::S3Options {
        endpoint: Some(endpoint),
        force_path_style: true,
        static_credentials: Some(("bench".into(), "bench".into())),
        ..feedstore_s3::S3Options::default()
    }
}

/// A store of `capacity_bytes` (one segment) served from this process on `socket`.
pub fn embedded_daemon(
    socket: &Path,
    capacity_bytes: u64,
) -> feedstore_store::daemon::DaemonHandle {
    let config = feedstore_store::config::DaemonConfig {
        socket: socket.to_owned(),
        capacity_bytes,
        segment_bytes: capacity_bytes,
        ..feedstore_store::config::DaemonConfig::default()
    };
    feedstore_store::daemon::Daemon::bind(&config)
        .unwrap()
        .spawn()
}
