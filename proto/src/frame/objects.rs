//! The object family: sizes and handles out, per-item results back.
//!
//! Every result has a fixed size whether it succeeded or not, and a failed one carries zeros
//! where a success carries its handle or location: one encoding per value, so a decoded reply
//! re-encodes to the same bytes.

use crate::wire::{DecodeError, Reader, Wire, Writer};
use crate::{Handle, Location, Status};

/// A reservation made by `Create`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Created {
    /// The object's handle (usable by others once sealed).
    pub handle: Handle,
    /// Where to write it.
    pub location: Location,
}

impl Created {
    /// Bytes of one create result: handle, status, location.
    pub const WIRE_BYTES: usize = Handle::WIRE_BYTES + 2 + LOCATION_BYTES;
}

/// A decode-once cache entry ([`super::Request::CacheInsert`]): a sample key and the sealed
/// object holding that sample.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheEntry {
    /// The sample's key (never 0: 0 means "no key").
    pub key: u128,
    /// The object.
    pub handle: Handle,
}

impl CacheEntry {
    /// Bytes of one entry: key, handle.
    pub const WIRE_BYTES: usize = 16 + Handle::WIRE_BYTES;
}

impl Wire for CacheEntry {
    const MIN_BYTES: usize = CacheEntry::WIRE_BYTES;
    fn encode(&self, w: &mut Writer<'_>) {
        w.u128(self.key);
        self.handle.encode(w);
    }
    fn decode(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        Ok(CacheEntry {
            key: r.u128()?,
            handle: Handle::decode(r)?,
        })
    }
}

/// A lease taken by `Get`: where the object lives, and who wrote it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Got {
    /// Where the object lives.
    pub location: Location,
    /// The uid of the client that wrote the object, as the daemon recorded it when the object
    /// was created (for a copy of another node's object, as that node's daemon recorded it). A
    /// reader checks it before it trusts a batch object's structure.
    pub writer: u32,
}

impl Got {
    /// The writer of a get result from a daemon that does not record writers (protocol 9,
    /// feedstore 0.1.0: no [`super::feature::WRITERS`]).
    pub const UNKNOWN_WRITER: u32 = u32::MAX;
}

/// The first protocol version whose get results name the writer.
const WRITERS_SINCE: u16 = 10;
/// The first protocol version with [`Status::OverShare`] (no release spoke 10 without it).
const OVER_SHARE_SINCE: u16 = 10;

/// Bytes of a location: segment, offset, length.
const LOCATION_BYTES: usize = 4 + 8 + 8;
/// Bytes of one get result: status, location, writer (the most of any version).
pub(super) const GOT_BYTES: usize = 2 + LOCATION_BYTES + 4;
/// Bytes of one cache lookup result: present, handle.
pub(super) const CACHED_BYTES: usize = 1 + Handle::WIRE_BYTES;

impl Wire for Status {
    const MIN_BYTES: usize = 2;
    fn encode(&self, w: &mut Writer<'_>) {
        // Protocol 9 has no `OverShare`: its clients hear of the reader share as the operator's
        // limit it is.
        let status = match self {
            Status::OverShare if w.version < OVER_SHARE_SINCE => Status::LimitReached,
            other => *other,
        };
        w.u16(status as u16);
    }
    fn decode(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        match Status::from_u16(r.u16()?) {
            Some(Status::OverShare) if r.version < OVER_SHARE_SINCE => None,
            status => status,
        }
        .ok_or(DecodeError::InvalidValue { field: "status" })
    }
}

impl Wire for Location {
    const MIN_BYTES: usize = LOCATION_BYTES;
    fn encode(&self, w: &mut Writer<'_>) {
        w.u32(self.segment);
        w.u64(self.offset);
        w.u64(self.len);
    }
    fn decode(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        Ok(Location {
            segment: r.u32()?,
            offset: r.u64()?,
            len: r.u64()?,
        })
    }
}

const NO_LOCATION: Location = Location {
    segment: 0,
    offset: 0,
    len: 0,
};

/// A status, then the value on success or zeros on failure (a success is never sent as an
/// error status, so `Ok` decodes only as `Ok(_)`).
fn encode_result<T: Wire>(w: &mut Writer<'_>, result: &Result<T, Status>, zero: &T) {
    match result {
        Ok(value) => {
            Status::Ok.encode(w);
            value.encode(w);
        }
        Err(status) => {
            status.encode(w);
            zero.encode(w);
        }
    }
}

fn decode_result<T: Wire + PartialEq>(
    r: &mut Reader<'_>,
    zero: &T,
    field: &'static str,
) -> Result<Result<T, Status>, DecodeError> {
    let status = Status::decode(r)?;
    let value = T::decode(r)?;
    match status {
        Status::Ok => Ok(Ok(value)),
        status if value == *zero => Ok(Err(status)),
        _ => Err(DecodeError::InvalidValue { field }),
    }
}

/// The location, then (from protocol 10 on) the writer.
impl Wire for Got {
    const MIN_BYTES: usize = LOCATION_BYTES;
    fn encode(&self, w: &mut Writer<'_>) {
        self.location.encode(w);
        if w.version >= WRITERS_SINCE {
            w.u32(self.writer);
        }
    }
    fn decode(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        Ok(Got {
            location: Location::decode(r)?,
            writer: if r.version >= WRITERS_SINCE {
                r.u32()?
            } else {
                Got::UNKNOWN_WRITER
            },
        })
    }
}

const NO_GOT: Got = Got {
    location: NO_LOCATION,
    writer: 0,
};

impl Wire for Result<Got, Status> {
    const MIN_BYTES: usize = 2 + Got::MIN_BYTES;
    fn encode(&self, w: &mut Writer<'_>) {
        encode_result(w, self, &NO_GOT);
    }
    fn decode(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        let no_got = Got {
            writer: if r.version >= WRITERS_SINCE {
                0
            } else {
                Got::UNKNOWN_WRITER
            },
            ..NO_GOT
        };
        decode_result(r, &no_got, "get result")
    }
}

impl Wire for Created {
    const MIN_BYTES: usize = Handle::WIRE_BYTES + LOCATION_BYTES;
    fn encode(&self, w: &mut Writer<'_>) {
        self.handle.encode(w);
        self.location.encode(w);
    }
    fn decode(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        Ok(Created {
            handle: Handle::decode(r)?,
            location: Location::decode(r)?,
        })
    }
}

/// A create result: status first, then handle and location (zeros on failure).
impl Wire for Result<Created, Status> {
    const MIN_BYTES: usize = Created::WIRE_BYTES;
    fn encode(&self, w: &mut Writer<'_>) {
        encode_result(w, self, &NO_CREATED);
    }
    fn decode(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        decode_result(r, &NO_CREATED, "create result")
    }
}

const NO_CREATED: Created = Created {
    handle: Handle {
        node_id: 0,
        epoch: 0,
        id: 0,
    },
    location: NO_LOCATION,
};

/// A cache lookup result: a present byte, then the handle (zeros when absent).
impl Wire for Option<Handle> {
    const MIN_BYTES: usize = CACHED_BYTES;
    fn encode(&self, w: &mut Writer<'_>) {
        w.bool(self.is_some());
        self.unwrap_or_default().encode(w);
    }
    fn decode(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        let present = r.bool("present")?;
        let handle = Handle::decode(r)?;
        match (present, handle == Handle::default()) {
            (true, _) => Ok(Some(handle)),
            (false, true) => Ok(None),
            (false, false) => Err(DecodeError::InvalidValue {
                field: "absent handle",
            }),
        }
    }
}
