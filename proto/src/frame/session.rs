//! The session family: hello and the segments it announces.

use crate::wire::{DecodeError, Reader, Wire, Writer};
use crate::{Role, SegmentInfo};

/// The first protocol version whose hellos say how many times the client connected again.
pub const RECONNECTS_SINCE: u16 = 12;

/// Hello request: role byte, client name, the client's frame limit, from protocol 11 on what it
/// speaks, and from protocol 12 on how many times it connected again.
pub(super) fn encode_hello(
    w: &mut Writer<'_>,
    role: Role,
    name: &str,
    max_frame_bytes: u32,
    speaks: &Speaks,
    reconnects: u32,
) {
    w.u8(role as u8);
    w.string(name);
    w.u32(max_frame_bytes);
    speaks.encode_since_negotiation(w);
    if w.version >= RECONNECTS_SINCE {
        w.u32(reconnects);
    }
}

pub(super) fn decode_hello(r: &mut Reader<'_>) -> Result<super::Request, DecodeError> {
    let role = Role::from_u8(r.u8()?).ok_or(DecodeError::InvalidValue { field: "role" })?;
    let (client_name, max_frame_bytes) = (r.string()?, r.u32()?);
    let speaks = Speaks::decode_since_negotiation(r)?;
    let reconnects = if r.version >= RECONNECTS_SINCE {
        r.u32()?
    } else {
        0
    };
    skip_newer(r);
    Ok(super::Request::Hello {
        role,
        client_name,
        max_frame_bytes,
        speaks,
        reconnects,
    })
}

/// Skips the fields a version newer than this crate's appended to a hello or its reply (a
/// hello is read before the versions are agreed); in a version this side speaks, the hello is
/// exactly what it reads (one encoding per value).
pub(super) fn skip_newer(r: &mut Reader<'_>) {
    if r.version > super::VERSION {
        r.skip_rest();
    }
}

/// The first protocol version whose hellos say what each side speaks ([`Speaks`]).
pub const NEGOTIATED_SINCE: u16 = 11;

/// Optional features a side of a connection may have, as bits of [`Speaks::features`]. Both
/// sides use only the features both have.
pub mod feature {
    /// The daemon records the uid that wrote each object and names it in get results and ring
    /// entries (protocol 10 on), which a reader checks before it trusts a batch's structure.
    pub const WRITERS: u64 = 1 << 0;
}

/// Every feature this crate has.
pub const FEATURES: u64 = feature::WRITERS;

/// What one side of a hello says of itself: the control protocol versions it speaks, its
/// optional features, and its release. Sent from protocol [`NEGOTIATED_SINCE`] on; of a side
/// that spoke an older hello it is [`Speaks::implied`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Speaks {
    /// The oldest protocol version it speaks.
    pub min: u16,
    /// The newest.
    pub max: u16,
    /// Bits of [`feature`].
    pub features: u64,
    /// Its release ("0.2.0"); empty where not known.
    pub release: String,
}

impl Speaks {
    /// This build's.
    pub fn ours() -> Speaks {
        Speaks {
            min: super::MIN_VERSION,
            max: super::VERSION,
            features: FEATURES,
            release: env!("CARGO_PKG_VERSION").to_string(),
        }
    }

    /// A side whose hello was of `version`, before hellos said more: that version alone, the
    /// features it implies, and the release that spoke it (protocol 9 is 0.1.0's; 10 was only
    /// ever spoken by builds between 0.1.0 and 0.2.0).
    pub fn implied(version: u16) -> Speaks {
        Speaks {
            min: version,
            max: version,
            features: if version >= 10 { feature::WRITERS } else { 0 },
            release: if version == 9 {
                "0.1.0".into()
            } else {
                String::new()
            },
        }
    }

    /// The newest version both sides speak, if they share one.
    pub fn common(&self, other: &Speaks) -> Option<u16> {
        let (low, high) = (self.min.max(other.min), self.max.min(other.max));
        (low <= high).then_some(high)
    }

    /// "feedstore 0.2.0 (protocols 9-11)", for messages.
    pub fn describe(&self) -> String {
        let release = if self.release.is_empty() {
            "an unreleased build".to_string()
        } else {
            format!("feedstore {}", self.release)
        };
        if self.min == self.max {
            format!("{release} (protocol {})", self.max)
        } else {
            format!("{release} (protocols {}-{})", self.min, self.max)
        }
    }

    /// Appended to a hello and its reply from [`NEGOTIATED_SINCE`] on. A release that is not
    /// [`Speaks::valid_release`] is sent empty (unknown), never as a hello the other side
    /// refuses.
    pub(super) fn encode_since_negotiation(&self, w: &mut Writer<'_>) {
        if w.version >= NEGOTIATED_SINCE {
            w.u16(self.min);
            w.u16(self.max);
            w.u64(self.features);
            w.string(if Speaks::valid_release(&self.release) {
                &self.release
            } else {
                ""
            });
        }
    }

    /// A release as versions are written: at most 32 bytes of ASCII letters, digits, `.`, `+`
    /// and `-` (it is logged and shown to users; nothing else is accepted from the other side).
    pub fn valid_release(release: &str) -> bool {
        release.len() <= 32
            && release
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"+-.".contains(&b))
    }

    /// Read from a hello or its reply of [`NEGOTIATED_SINCE`] on; implied before. (The caller
    /// skips what a newer version appended after: [`skip_newer`].)
    pub(super) fn decode_since_negotiation(r: &mut Reader<'_>) -> Result<Speaks, DecodeError> {
        if r.version < NEGOTIATED_SINCE {
            return Ok(Speaks::implied(r.version));
        }
        let speaks = Speaks {
            min: r.u16()?,
            max: r.u16()?,
            features: r.u64()?,
            release: r.string()?,
        };
        if speaks.min > speaks.max || !Speaks::valid_release(&speaks.release) {
            return Err(DecodeError::InvalidValue {
                field: "versions spoken",
            });
        }
        Ok(speaks)
    }
}

impl Wire for SegmentInfo {
    const MIN_BYTES: usize = 16;
    fn encode(&self, w: &mut Writer<'_>) {
        w.u32(self.id);
        w.u64(self.size_bytes);
        w.u32(self.flags);
    }
    fn decode(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        Ok(SegmentInfo {
            id: r.u32()?,
            size_bytes: r.u64()?,
            flags: r.u32()?,
        })
    }
}
