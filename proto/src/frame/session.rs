//! The session family: hello and the segments it announces.

use crate::wire::{DecodeError, Reader, Wire, Writer};
use crate::{Role, SegmentInfo};

/// Hello request: role byte, client name, the client's frame limit.
pub(super) fn encode_hello(w: &mut Writer<'_>, role: Role, name: &str, max_frame_bytes: u32) {
    w.u8(role as u8);
    w.string(name);
    w.u32(max_frame_bytes);
}

pub(super) fn decode_hello(r: &mut Reader<'_>) -> Result<(Role, String, u32), DecodeError> {
    let role = Role::from_u8(r.u8()?).ok_or(DecodeError::InvalidValue { field: "role" })?;
    Ok((role, r.string()?, r.u32()?))
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
