//! The byte level of the control protocol: little-endian cursors and the [`Wire`] trait every
//! message part implements. A leaf: it knows nothing about frames or streams, so every other
//! module builds on it and none of them on each other.

use crate::Handle;

/// Why bytes could not be decoded as a frame. Any of these closes the connection.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// The first two bytes are not the protocol's magic: the peer is not speaking this protocol.
    #[error("bad magic {found:#06x} (not a feedstore peer?)")]
    BadMagic {
        /// What arrived.
        found: u16,
    },
    /// The peer speaks a protocol version older than any this side speaks.
    #[error(
        "unsupported protocol version {found}: older than any this side speaks (its newest is \
         {expected})"
    )]
    UnsupportedVersion {
        /// What arrived.
        found: u16,
        /// The newest version this side speaks.
        expected: u16,
    },
    /// The opcode is unknown or not valid in this direction.
    #[error("unknown opcode {found:#06x}")]
    UnknownOpcode {
        /// What arrived.
        found: u16,
    },
    /// The header announces a payload larger than the receiver accepts.
    #[error("frame payload of {len} bytes exceeds the maximum of {max}")]
    Oversized {
        /// Announced payload length.
        len: u32,
        /// The receiver's maximum.
        max: u32,
    },
    /// The payload ends before a field does.
    #[error("truncated payload: needed {need} more bytes, {have} left")]
    Truncated {
        /// Bytes needed.
        need: usize,
        /// Bytes left.
        have: usize,
    },
    /// The payload has bytes after its last field.
    #[error("{extra} trailing bytes after the payload")]
    TrailingBytes {
        /// Number of extra bytes.
        extra: usize,
    },
    /// A field holds a value outside its domain.
    #[error("invalid value in field {field}")]
    InvalidValue {
        /// The field.
        field: &'static str,
    },
    /// The reserved flags are not zero.
    #[error("reserved header flags set: {found:#06x}")]
    ReservedFlags {
        /// What arrived.
        found: u16,
    },
}

/// A part of a message: how it is written and read, side by side.
///
/// `decode(encode(x)) == x` for every value a sender may build (property-tested for each
/// implementation), and decoding never trusts a length it has not checked.
pub(crate) trait Wire: Sized {
    /// The fewest bytes any value encodes to. A list's decoder checks its element count against
    /// it before reserving memory, so a forged count cannot make it allocate what the frame does
    /// not hold. Tested against the encoding of the smallest value.
    const MIN_BYTES: usize;

    /// Appends the value.
    fn encode(&self, w: &mut Writer<'_>);

    /// Reads one value.
    fn decode(r: &mut Reader<'_>) -> Result<Self, DecodeError>;
}

/// Longest string a frame carries: client names, stream names and error messages are all far
/// shorter (see their own limits); this only bounds the wire form.
pub(crate) const MAX_STRING_BYTES: usize = u16::MAX as usize;

/// Reads a message's parts; `version` is the control protocol version the sender spoke (parts
/// whose layout changed between versions read it; everything else ignores it).
pub(crate) struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    pub(crate) version: u16,
}

/// The control protocol version whose layout of the parts they share the peer protocol and the
/// batch format use: pinned, so that a new control version never changes their bytes.
pub(crate) const SHARED_LAYOUT: u16 = 11;

impl<'a> Reader<'a> {
    /// A reader of the parts' shared layout ([`SHARED_LAYOUT`]): for what reads the same in
    /// every version (a frame header) and for the formats pinned to it.
    pub(crate) fn new(buf: &'a [u8]) -> Self {
        Reader::at(buf, SHARED_LAYOUT)
    }

    /// A reader of a sender that spoke `version`.
    pub(crate) fn at(buf: &'a [u8], version: u16) -> Self {
        Reader {
            buf,
            pos: 0,
            version,
        }
    }

    fn left(&self) -> usize {
        self.buf.len() - self.pos
    }

    pub(crate) fn bytes(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        let have = self.left();
        if n > have {
            return Err(DecodeError::Truncated { need: n, have });
        }
        let out = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(out)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.bytes(N)?);
        Ok(out)
    }

    pub(crate) fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.array::<1>()?[0])
    }
    pub(crate) fn u16(&mut self) -> Result<u16, DecodeError> {
        Ok(u16::from_le_bytes(self.array()?))
    }
    pub(crate) fn u32(&mut self) -> Result<u32, DecodeError> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    pub(crate) fn u64(&mut self) -> Result<u64, DecodeError> {
        Ok(u64::from_le_bytes(self.array()?))
    }
    pub(crate) fn u128(&mut self) -> Result<u128, DecodeError> {
        Ok(u128::from_le_bytes(self.array()?))
    }
    /// A byte that must be 0 or 1.
    pub(crate) fn bool(&mut self, field: &'static str) -> Result<bool, DecodeError> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            _ => Err(DecodeError::InvalidValue { field }),
        }
    }

    /// A `u32` element count, checked against what the remaining bytes can hold at
    /// `min_element_bytes` each, so a forged count cannot make the decoder reserve memory it
    /// will never fill.
    pub(crate) fn count(&mut self, min_element_bytes: usize) -> Result<usize, DecodeError> {
        let n = self.u32()? as usize;
        let have = self.left();
        match n.checked_mul(min_element_bytes.max(1)) {
            Some(need) if need <= have => Ok(n),
            _ => Err(DecodeError::Truncated {
                need: n.saturating_mul(min_element_bytes.max(1)),
                have,
            }),
        }
    }

    /// A length-prefixed list.
    pub(crate) fn list<T: Wire>(&mut self) -> Result<Vec<T>, DecodeError> {
        let n = self.count(T::MIN_BYTES)?;
        (0..n).map(|_| T::decode(self)).collect()
    }

    pub(crate) fn string(&mut self) -> Result<String, DecodeError> {
        let n = self.u16()? as usize;
        let raw = self.bytes(n)?;
        std::str::from_utf8(raw)
            .map(str::to_owned)
            .map_err(|_| DecodeError::InvalidValue { field: "string" })
    }

    /// Skips what is left: fields a newer version appended to a hello.
    pub(crate) fn skip_rest(&mut self) {
        self.pos = self.buf.len();
    }

    pub(crate) fn finish(self) -> Result<(), DecodeError> {
        let extra = self.left();
        if extra == 0 {
            Ok(())
        } else {
            Err(DecodeError::TrailingBytes { extra })
        }
    }
}

/// Appends a message's parts for a receiver of control protocol `version` (parts whose layout
/// changed between versions read it; everything else ignores it).
pub(crate) struct Writer<'a> {
    pub(crate) buf: &'a mut Vec<u8>,
    pub(crate) version: u16,
}

impl<'a> Writer<'a> {
    /// A writer of the parts' shared layout ([`SHARED_LAYOUT`]).
    pub(crate) fn new(buf: &'a mut Vec<u8>) -> Self {
        Writer {
            buf,
            version: SHARED_LAYOUT,
        }
    }
}

impl Writer<'_> {
    pub(crate) fn u8(&mut self, v: u8) {
        self.buf.push(v);
    }
    pub(crate) fn u16(&mut self, v: u16) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    pub(crate) fn u32(&mut self, v: u32) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    pub(crate) fn u64(&mut self, v: u64) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    pub(crate) fn u128(&mut self, v: u128) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    pub(crate) fn bool(&mut self, v: bool) {
        self.u8(u8::from(v));
    }
    /// A list's element count. Lists longer than `u32::MAX` cannot be in a frame, whose
    /// payload length is a `u32`; the frame limit refuses them long before.
    pub(crate) fn count(&mut self, n: usize) {
        self.u32(u32::try_from(n).unwrap_or(u32::MAX));
    }
    pub(crate) fn list<T: Wire>(&mut self, items: &[T]) {
        self.count(items.len());
        for item in items {
            item.encode(self);
        }
    }
    /// A string of at most [`MAX_STRING_BYTES`]; the senders of longer text (error messages)
    /// shorten it first with [`truncate`].
    pub(crate) fn string(&mut self, s: &str) {
        let s = truncate(s, MAX_STRING_BYTES);
        self.u16(s.len() as u16);
        self.buf.extend_from_slice(s.as_bytes());
    }
}

/// `s` cut to at most `max` bytes at a character boundary.
pub fn truncate(s: &str, max: usize) -> &str {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

impl Wire for Handle {
    const MIN_BYTES: usize = Handle::WIRE_BYTES;
    fn encode(&self, w: &mut Writer<'_>) {
        w.buf.extend_from_slice(&self.to_bytes());
    }
    fn decode(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        Ok(Handle::from_bytes(r.array()?))
    }
}

impl Wire for u64 {
    const MIN_BYTES: usize = 8;
    fn encode(&self, w: &mut Writer<'_>) {
        w.u64(*self);
    }
    fn decode(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        r.u64()
    }
}

impl Wire for u128 {
    const MIN_BYTES: usize = 16;
    fn encode(&self, w: &mut Writer<'_>) {
        w.u128(*self);
    }
    fn decode(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        r.u128()
    }
}

/// Test helpers shared by every family's round-trip properties.
#[cfg(test)]
pub(crate) mod testing {
    use super::*;

    /// Encodes `value`, checks the bytes decode back to it and are at least `MIN_BYTES` long.
    pub(crate) fn round_trip<T: Wire + PartialEq + std::fmt::Debug>(value: &T) {
        let mut buf = Vec::new();
        value.encode(&mut Writer::new(&mut buf));
        assert!(
            buf.len() >= T::MIN_BYTES,
            "{value:?} encodes to {} bytes, under MIN_BYTES {}",
            buf.len(),
            T::MIN_BYTES
        );
        let mut r = Reader::new(&buf);
        assert_eq!(&T::decode(&mut r).unwrap(), value);
        r.finish().unwrap();
    }

    /// Checks that the smallest value encodes to exactly `MIN_BYTES`.
    pub(crate) fn min_bytes_is_tight<T: Wire>(smallest: &T) {
        min_bytes_is_tight_at(super::SHARED_LAYOUT, smallest);
    }

    /// Checks that the smallest value, in the version where it is smallest, encodes to exactly
    /// `MIN_BYTES`.
    pub(crate) fn min_bytes_is_tight_at<T: Wire>(version: u16, smallest: &T) {
        let mut buf = Vec::new();
        smallest.encode(&mut Writer {
            buf: &mut buf,
            version,
        });
        assert_eq!(
            buf.len(),
            T::MIN_BYTES,
            "MIN_BYTES is not the smallest encoding"
        );
    }
}
