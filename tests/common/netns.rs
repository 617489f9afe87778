//! Network namespaces for multi-node tests and benchmarks (`feedstore_lab::netns`), with a
//! thread-entering helper that panics as a test should.

#![allow(dead_code, unused_imports)]

pub use feedstore_lab::netns::Lan;

/// Moves the calling thread into namespace `name` (threads it starts afterwards live there too).
pub fn enter(name: &str) {
    feedstore_lab::netns::enter(name).unwrap_or_else(|e| panic!("entering {name}: {e}"));
}
