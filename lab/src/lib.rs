//! The worlds `feedstore demo` and the multi-node tests run in, outside the daemon's and the
//! producer's code paths: [`netns`] (nodes as network namespaces on one bridge, links capped like
//! NICs) and [`delayed`] (an image source whose every request waits as an object store's
//! does). The shipped binary links this crate for its demo; the test-only pieces (a moto S3
//! server, the fault-injecting proxy) stay in `feedstore-testkit`, which it does not link.

pub mod delayed;
pub mod netns;
