//! The S3 fetcher against a real S3-compatible server on loopback (`moto_server`, from PyPI's
//! `moto[server]`, which `.ci/run` installs): objects come back byte for byte, a missing key or
//! bucket is a clear not-found, and the pipeline produces from `s3://` references, rejecting the
//! missing one with its reason.

mod common;

use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::DATA;
use feedstore_producer::manifest::{ImageSource, Manifest};
use feedstore_producer::pipeline::{Event, Fetch, FetchError, ProducerConfig, run};
use feedstore_producer::s3::{S3Fetcher, S3Options};

/// A `moto_server` process on a free loopback port, killed on drop.
struct Moto {
    child: Child,
    port: u16,
}

impl Moto {
    fn start() -> Moto {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let child = Command::new("moto_server")
            .args(["-H", "127.0.0.1", "-p", &port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("moto_server must be installed: pip install 'moto[server]' (.ci/run does)");
        let deadline = Instant::now() + Duration::from_secs(60);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "moto_server did not come up on port {port}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        Moto { child, port }
    }
}

impl Drop for Moto {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn options(port: u16) -> S3Options {
    S3Options {
        endpoint: Some(format!("http://127.0.0.1:{port}")),
        region: Some("us-east-1".into()),
        force_path_style: true,
        static_credentials: Some(("testing".into(), "testing".into())),
        attempt_timeout: Duration::from_secs(10),
        ..S3Options::default()
    }
}

fn s3(bucket: &str, key: &str) -> ImageSource {
    ImageSource::S3 {
        bucket: bucket.into(),
        key: key.into(),
    }
}

#[test]
fn fetches_from_s3_and_rejects_missing_objects() {
    let moto = Moto::start();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let fetcher = runtime.block_on(S3Fetcher::new(&options(moto.port)));
    let photos = ["grace_hopper.jpg", "rocket.jpg", "chelsea.png"];
    runtime.block_on(async {
        fetcher
            .client()
            .create_bucket()
            .bucket("vqa")
            .send()
            .await
            .unwrap();
        for name in photos {
            let body = std::fs::read(format!("{DATA}/photos/{name}")).unwrap();
            fetcher
                .client()
                .put_object()
                .bucket("vqa")
                .key(format!("img/{name}"))
                .body(body.into())
                .send()
                .await
                .unwrap();
        }
        let got = fetcher.fetch(&s3("vqa", "img/rocket.jpg")).await.unwrap();
        assert_eq!(
            got,
            std::fs::read(format!("{DATA}/photos/rocket.jpg")).unwrap(),
            "byte for byte"
        );
        assert!(matches!(
            fetcher.fetch(&s3("vqa", "img/nope.jpg")).await,
            Err(FetchError::NotFound(_))
        ));
        assert!(matches!(
            fetcher.fetch(&s3("no-such-bucket", "x.jpg")).await,
            Err(FetchError::NotFound(_))
        ));
    });

    // The pipeline over s3:// references.
    let dir = std::env::temp_dir().join(format!("feedstore-s3-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let mut lines: Vec<String> = photos
        .iter()
        .map(|name| {
            serde_json::json!({"id": name, "image": format!("s3://vqa/img/{name}"), "conversations": [
                {"from": "human", "value": "<image>\nwhat is this?"}, {"from": "gpt", "value": "a photo"}]})
            .to_string()
        })
        .collect();
    lines.push(
        serde_json::json!({"id": "missing", "image": "s3://vqa/img/missing.jpg", "conversations": [
            {"from": "human", "value": "<image>\n?"}, {"from": "gpt", "value": "!"}]})
        .to_string(),
    );
    let manifest_path = dir.join("m.jsonl");
    std::fs::write(&manifest_path, lines.join("\n")).unwrap();
    let socket = dir.join("feedstored.sock");
    let daemon = common::embedded_daemon(&socket, 128 << 20);
    let tokenizer = Arc::new(common::tokenizer(4096));
    let mut config = ProducerConfig::new(socket);
    config.workers = 2;
    let mut rejects = Vec::new();
    let summary = run(
        &config,
        tokenizer,
        Arc::new(fetcher),
        Manifest::open(&manifest_path).unwrap(),
        |e, _| {
            if let Event::Rejected(r) = e {
                rejects.push(r.clone());
            }
        },
    )
    .unwrap();
    assert_eq!((summary.produced, summary.rejected), (3, 1));
    assert_eq!(rejects[0].id.as_deref(), Some("missing"));
    assert_eq!(rejects[0].stage, "fetch");
    assert!(
        rejects[0]
            .reason
            .contains("not found: s3://vqa/img/missing.jpg"),
        "{:?}",
        rejects[0].reason
    );
    daemon.stop();
}
