//! The stats family: the store's counters, a count then that many `u64`s in field order.
//!
//! The count must equal this version's field count: a new counter is a new protocol version,
//! and a value has one encoding.

use crate::StoreStats;
use crate::wire::{DecodeError, Reader, Wire, Writer};

impl Wire for StoreStats {
    const MIN_BYTES: usize = 4 + 8 * StoreStats::FIELDS;
    fn encode(&self, w: &mut Writer<'_>) {
        let fields = self.named();
        w.count(fields.len());
        for (_, value) in fields {
            w.u64(value);
        }
    }
    fn decode(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        let n = r.count(8)?;
        if n != StoreStats::FIELDS {
            return Err(DecodeError::InvalidValue {
                field: "stats field count",
            });
        }
        let mut fields = [0u64; StoreStats::FIELDS];
        for f in &mut fields {
            *f = r.u64()?;
        }
        Ok(StoreStats::from_fields(&fields))
    }
}
