//! Whatever bytes a producer left in an object, opening it as a sample returns a view or an
//! error; a view that passed validation never points outside the object, its regions have the
//! lengths their dtypes and shapes say, and every accessor is safe to call.

#![no_main]

use feedstore_proto::sample::{AlignedBuf, SampleView};
use libfuzzer_sys::fuzz_target;

/// Asserts `part` lies inside `object`.
fn inside(object: &[u8], part: &[u8], what: &str) {
    let (start, end) = (object.as_ptr() as usize, object.as_ptr() as usize + object.len());
    let (p, q) = (part.as_ptr() as usize, part.as_ptr() as usize + part.len());
    assert!(
        part.is_empty() || (start <= p && q <= end),
        "{what} at {p:#x}..{q:#x} leaves the object {start:#x}..{end:#x}"
    );
}

fn bytes_of<T>(s: &[T]) -> &[u8] {
    // SAFETY: plain integers viewed as their own bytes: same memory, same lifetime.
    unsafe { std::slice::from_raw_parts(s.as_ptr().cast(), std::mem::size_of_val(s)) }
}

fuzz_target!(|data: &[u8]| {
    let mut object = AlignedBuf::zeroed(data.len());
    object.as_mut_slice().copy_from_slice(data);
    let bytes = object.as_slice();
    if let Ok(view) = SampleView::new(bytes) {
        let _ = (view.id(), view.source_keys().count(), view.metadata("split"));
        inside(bytes, bytes_of(view.tokens()), "tokens");
        inside(bytes, bytes_of(view.labels()), "labels");
        assert_eq!(view.tokens().len(), view.labels().len(), "one label per token");
        for i in 0..view.image_count() + 1 {
            if let Some(t) = view.image(i) {
                inside(bytes, t.bytes(), "an image");
                let elements: usize = t.shape().iter().product();
                assert_eq!(
                    t.bytes().len(),
                    elements * t.dtype().size_bytes() as usize,
                    "an image's length is its shape times its dtype"
                );
                let _ = (t.layout(), t.as_u8(), t.as_f32(), t.as_f16(), t.as_bf16());
            }
            let _ = view.image_grid_thw(i);
        }
    }
});
