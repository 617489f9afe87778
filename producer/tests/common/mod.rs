//! Test data shared by the producer's integration tests.

#![allow(dead_code)]

use std::io::Read;

use feedstore_producer::chat::ChatTokenizer;

/// The committed test data folder.
pub const DATA: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data");

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
