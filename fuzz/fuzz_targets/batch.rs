//! Whatever bytes a writer left in an object, reading it as a batch returns a structure or an
//! error: never a panic, never an allocation sized by a forged count, never a leaf outside the
//! object; and whatever parses re-encodes to exactly the bytes it came from (one encoding per
//! value), and decodes back to the same structure.

#![no_main]

use feedstore_proto::batch::{self, Value};
use libfuzzer_sys::fuzz_target;

/// Every leaf of `v` lies inside the data region of `data_len` bytes.
fn leaves_inside(v: &Value, data_len: u64) {
    match v {
        Value::Leaf(l) => assert!(l.offset + l.nbytes <= data_len, "{l:?} past {data_len}"),
        Value::List(items) | Value::Tuple(items) => {
            items.iter().for_each(|i| leaves_inside(i, data_len))
        }
        Value::Dict(pairs) | Value::OrderedDict(pairs) => pairs.iter().for_each(|(k, v)| {
            leaves_inside(k, data_len);
            leaves_inside(v, data_len);
        }),
        Value::Object(o) => {
            for part in [&o.args, &o.state, &o.list_items, &o.dict_items] {
                leaves_inside(part, data_len);
            }
        }
        _ => {}
    }
}

fuzz_target!(|data: &[u8]| {
    // The input as a whole object, and as a bare skeleton behind a well-formed header.
    if let Ok((value, start)) = batch::parse(data) {
        leaves_inside(&value, (data.len() as u64).saturating_sub(start));
        let skeleton = batch::encode(&value);
        assert_eq!(&data[batch::HEADER_BYTES..batch::HEADER_BYTES + skeleton.len()], &skeleton[..]);
        assert_eq!(batch::header(skeleton.len())[..], data[..batch::HEADER_BYTES]);
    }
    let data_len = 1 << 16;
    if let Ok(value) = batch::decode(data, data_len) {
        leaves_inside(&value, data_len);
        let again = batch::encode(&value);
        assert_eq!(&again[..], data, "{value:?} re-encodes to the same bytes");
        assert_eq!(batch::decode(&again, data_len).unwrap(), value);
    }
});
