//! The 16-byte object handle.

use std::fmt;

/// The name of one object, valid on any process of any node.
///
/// Layout on the wire and in shared memory (little-endian, 16 bytes, no padding):
///
/// | bytes  | field        | meaning                                                            |
/// |--------|--------------|--------------------------------------------------------------------|
/// | 0..4   | `node_id`    | the node whose daemon owns the object (cross-node pulls route on it) |
/// | 4..8   | `epoch`      | random per daemon start: handles from a previous run are [`Stale`](crate::Status::Stale) |
/// | 8..12  | `slot`       | index in the daemon's object table                                  |
/// | 12..16 | `generation` | bumped each time the slot is reused                                 |
///
/// Only the owning daemon can resolve a handle; a forged one either names an empty slot
/// (`NotFound`) or a reused one (`Stale`), and never resolves to another object's bytes.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
#[repr(C)]
pub struct Handle {
    /// The owning node.
    pub node_id: u32,
    /// The owning daemon's start epoch.
    pub epoch: u32,
    /// Index in the owning daemon's object table.
    pub slot: u32,
    /// Reuse counter of that slot.
    pub generation: u32,
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
        out[8..12].copy_from_slice(&self.slot.to_le_bytes());
        out[12..16].copy_from_slice(&self.generation.to_le_bytes());
        out
    }

    /// Parses the wire form. Any 16 bytes form a handle; whether it names a live object is the
    /// owning daemon's call.
    pub fn from_bytes(b: [u8; Self::WIRE_BYTES]) -> Handle {
        let word = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        Handle {
            node_id: word(0),
            epoch: word(4),
            slot: word(8),
            generation: word(12),
        }
    }
}

impl fmt::Debug for Handle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// `node:epoch:slot:generation` in hex, the form logs and the CLI print and parse.
impl fmt::Display for Handle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:08x}:{:08x}:{:x}:{:x}",
            self.node_id, self.epoch, self.slot, self.generation
        )
    }
}

/// Error parsing a handle's text form.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid handle {text:?}: expected node:epoch:slot:generation in hex")]
pub struct ParseHandleError {
    text: String,
}

impl std::str::FromStr for Handle {
    type Err = ParseHandleError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = || ParseHandleError { text: s.to_owned() };
        let mut parts = s.split(':').map(|p| u32::from_str_radix(p, 16));
        let mut next = || parts.next().ok_or_else(err)?.map_err(|_| err());
        let handle = Handle {
            node_id: next()?,
            epoch: next()?,
            slot: next()?,
            generation: next()?,
        };
        if s.split(':').count() != 4 {
            return Err(err());
        }
        Ok(handle)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn bytes_round_trip(node_id: u32, epoch: u32, slot: u32, generation: u32) {
            let h = Handle { node_id, epoch, slot, generation };
            prop_assert_eq!(Handle::from_bytes(h.to_bytes()), h);
            prop_assert_eq!(h.to_string().parse::<Handle>().unwrap(), h);
        }
    }

    #[test]
    fn text_form_rejects_garbage() {
        assert!("1:2:3".parse::<Handle>().is_err());
        assert!("1:2:3:4:5".parse::<Handle>().is_err());
        assert!("zz:2:3:4".parse::<Handle>().is_err());
    }
}
