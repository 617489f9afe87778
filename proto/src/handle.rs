//! The 16-byte object handle.

use std::fmt;

/// The name of one object, valid on any process of any node.
///
/// Layout on the wire and in shared memory (little-endian, 16 bytes, no padding):
///
/// | bytes  | field     | meaning                                                                |
/// |--------|-----------|------------------------------------------------------------------------|
/// | 0..4   | `node_id` | the node whose daemon owns the object (cross-node pulls route on it)   |
/// | 4..8   | `epoch`   | random per daemon start: handles from a previous run are [`Stale`](crate::Status::Stale) |
/// | 8..16  | `id`      | drawn at random by the owning daemon when the object is created         |
///
/// Only the owning daemon can resolve a handle. The id is 64 unpredictable bits (a keyed
/// pseudorandom function of a counter), never reused while its object lives, so handles cannot
/// be enumerated: a client that guesses finds one of the store's live objects with odds of
/// (live objects) in 2^64 per guess. A forged or stale handle is
/// [`NotFound`](crate::Status::NotFound) (or `Stale` from another epoch) and never resolves to
/// another object's bytes.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
#[repr(C)]
pub struct Handle {
    /// The owning node.
    pub node_id: u32,
    /// The owning daemon's start epoch.
    pub epoch: u32,
    /// The object's random id on its owner.
    pub id: u64,
}

const _: () = assert!(std::mem::size_of::<Handle>() == Handle::WIRE_BYTES);

impl Handle {
    /// Size of a handle on the wire.
    pub const WIRE_BYTES: usize = 16;

    /// The wire form.
    pub fn to_bytes(self) -> [u8; Self::WIRE_BYTES] {
        let mut out = [0u8; Self::WIRE_BYTES];
        out[0..4].copy_from_slice(&self.node_id.to_le_bytes());
        out[4..8].copy_from_slice(&self.epoch.to_le_bytes());
        out[8..16].copy_from_slice(&self.id.to_le_bytes());
        out
    }

    /// Parses the wire form. Any 16 bytes form a handle; whether it names a live object is the
    /// owning daemon's call.
    pub fn from_bytes(b: [u8; Self::WIRE_BYTES]) -> Handle {
        Handle {
            node_id: u32::from_le_bytes(b[0..4].try_into().expect("4 bytes")),
            epoch: u32::from_le_bytes(b[4..8].try_into().expect("4 bytes")),
            id: u64::from_le_bytes(b[8..16].try_into().expect("8 bytes")),
        }
    }
}

impl fmt::Debug for Handle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// `node:epoch:id` in hex, the form logs and the CLI print and parse.
impl fmt::Display for Handle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:08x}:{:08x}:{:016x}",
            self.node_id, self.epoch, self.id
        )
    }
}

/// Error parsing a handle's text form.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid handle {text:?}: expected node:epoch:id in hex")]
pub struct ParseHandleError {
    text: String,
}

impl std::str::FromStr for Handle {
    type Err = ParseHandleError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = || ParseHandleError { text: s.to_owned() };
        let parts: Vec<&str> = s.split(':').collect();
        let [node, epoch, id] = parts[..] else {
            return Err(err());
        };
        Ok(Handle {
            node_id: u32::from_str_radix(node, 16).map_err(|_| err())?,
            epoch: u32::from_str_radix(epoch, 16).map_err(|_| err())?,
            id: u64::from_str_radix(id, 16).map_err(|_| err())?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn bytes_round_trip(node_id: u32, epoch: u32, id: u64) {
            let h = Handle { node_id, epoch, id };
            prop_assert_eq!(Handle::from_bytes(h.to_bytes()), h);
            prop_assert_eq!(h.to_string().parse::<Handle>().unwrap(), h);
        }
    }

    #[test]
    fn text_form_rejects_garbage() {
        assert!("1:2".parse::<Handle>().is_err());
        assert!("1:2:3:4".parse::<Handle>().is_err());
        assert!("zz:2:3".parse::<Handle>().is_err());
        assert!(
            "1:2:10000000000000000".parse::<Handle>().is_err(),
            "over 64 bits"
        );
    }
}
