//! Little-endian cursor helpers; every read is bounds-checked.

use crate::frame::DecodeError;

pub(crate) struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub(crate) fn new(buf: &'a [u8]) -> Self {
        Reader { buf, pos: 0 }
    }

    pub(crate) fn bytes(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        let have = self.buf.len() - self.pos;
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
    pub(crate) fn handle(&mut self) -> Result<crate::Handle, DecodeError> {
        Ok(crate::Handle::from_bytes(self.array()?))
    }

    /// A `u32` element count, checked against what the remaining bytes can hold so a forged count
    /// cannot make the decoder reserve memory it will never fill.
    pub(crate) fn count(&mut self, element_bytes: usize) -> Result<usize, DecodeError> {
        let n = self.u32()? as usize;
        let have = self.buf.len() - self.pos;
        match n.checked_mul(element_bytes) {
            Some(need) if need <= have => Ok(n),
            _ => Err(DecodeError::Truncated {
                need: n.saturating_mul(element_bytes),
                have,
            }),
        }
    }

    pub(crate) fn string(&mut self) -> Result<String, DecodeError> {
        let n = self.u16()? as usize;
        let raw = self.bytes(n)?;
        std::str::from_utf8(raw)
            .map(str::to_owned)
            .map_err(|_| DecodeError::InvalidValue { field: "string" })
    }

    pub(crate) fn finish(self) -> Result<(), DecodeError> {
        let extra = self.buf.len() - self.pos;
        if extra == 0 {
            Ok(())
        } else {
            Err(DecodeError::TrailingBytes { extra })
        }
    }
}

pub(crate) struct Writer<'a> {
    pub(crate) buf: &'a mut Vec<u8>,
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
    pub(crate) fn handle(&mut self, h: crate::Handle) {
        self.buf.extend_from_slice(&h.to_bytes());
    }
    pub(crate) fn count(&mut self, n: usize) {
        self.u32(u32::try_from(n).expect("element count fits u32; frames are bounded"));
    }
    /// Strings are short labels (client names, error messages); longer ones are cut at a char
    /// boundary.
    pub(crate) fn string(&mut self, s: &str) {
        let mut end = s.len().min(1024);
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        self.u16(end as u16);
        self.buf.extend_from_slice(&s.as_bytes()[..end]);
    }
}
