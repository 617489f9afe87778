//! Test data shared by the producer's integration tests.

#![allow(dead_code)]

use std::io::Read;

use feedstore_producer::chat::ChatTokenizer;

/// The committed test data folder.
pub const DATA: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data");

/// Reads every input of the reader `make` makes, on a thread of its own with a current-thread
/// runtime, handing each to `each` with `state` (which may drop it, as the pipeline does once a
/// worker has made it): within a minute, or the test fails. Returns the reader and the state.
pub fn read_inputs<I, S>(
    make: impl FnOnce() -> I + Send + 'static,
    mut state: S,
    mut each: impl FnMut(&mut S, feedstore_producer::pipeline::Input) + Send + 'static,
) -> (I, S)
where
    I: feedstore_producer::pipeline::Inputs,
    S: Send + 'static,
{
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let mut reader = make();
        runtime.block_on(async {
            while let Some(input) = reader.next().await {
                each(&mut state, input);
            }
        });
        let _ = tx.send((reader, state));
    });
    rx.recv_timeout(std::time::Duration::from_secs(60))
        .expect("reading ended within a minute")
}

/// The Qwen3 `tokenizer.json`, decompressed from the committed copy.
pub fn tokenizer_json() -> Vec<u8> {
    let gz = std::fs::read(format!("{DATA}/qwen3-tokenizer.json.gz")).unwrap();
    let mut json = Vec::new();
    flate2::read::GzDecoder::new(&gz[..])
        .read_to_end(&mut json)
        .unwrap();
    json
}

/// The Qwen3 chat tokenizer with a token limit.
pub fn tokenizer(max_tokens: usize) -> ChatTokenizer {
    ChatTokenizer::from_bytes(&tokenizer_json(), max_tokens).unwrap()
}

/// A real daemon (socket, shared memory) serving on a background thread of this process.
pub fn embedded_daemon(
    socket: &std::path::Path,
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
