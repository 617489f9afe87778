//! The stats family: the store's counters, a count then that many `u64`s in field order.
//!
//! The count must equal the field count of the connection's version: a new counter is a new
//! protocol version (appended: an older version's fields are the first ones), and a value has
//! one encoding.

use crate::StoreStats;
use crate::wire::{DecodeError, Reader, Wire, Writer};

/// The fields of protocols 10 and 11: the first ones, before the reconnects' counters.
const FIELDS_BEFORE_12: usize = StoreStats::FIELDS - 2;

/// The fields of protocol 9 (feedstore 0.1.0): before the reader share's and the authenticated
/// peers' counters too.
const FIELDS_BEFORE_10: usize = FIELDS_BEFORE_12 - 3;

/// How many fields a stats reply of `version` carries.
fn fields_in(version: u16) -> usize {
    if version < 10 {
        FIELDS_BEFORE_10
    } else if version < 12 {
        FIELDS_BEFORE_12
    } else {
        StoreStats::FIELDS
    }
}

impl Wire for StoreStats {
    const MIN_BYTES: usize = 4 + 8 * FIELDS_BEFORE_10;
    fn encode(&self, w: &mut Writer<'_>) {
        let fields = self.named();
        let n = fields_in(w.version);
        w.count(n);
        for (_, value) in &fields[..n] {
            w.u64(*value);
        }
    }
    fn decode(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        let n = r.count(8)?;
        if n != fields_in(r.version) {
            return Err(DecodeError::InvalidValue {
                field: "stats field count",
            });
        }
        // (Counters an older daemon does not keep read as zero.)
        let mut fields = [0u64; StoreStats::FIELDS];
        for f in &mut fields[..n] {
            *f = r.u64()?;
        }
        Ok(StoreStats::from_fields(&fields))
    }
}
