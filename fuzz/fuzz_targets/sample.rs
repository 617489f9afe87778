//! Whatever bytes a producer left in an object, opening it as a sample returns a view or an
//! error, and every accessor of a view that passed validation is safe to call.

#![no_main]

use feedstore_proto::sample::{AlignedBuf, SampleView};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut object = AlignedBuf::zeroed(data.len());
    object.as_mut_slice().copy_from_slice(data);
    if let Ok(view) = SampleView::new(object.as_slice()) {
        let _ = (view.id(), view.source_keys().count(), view.tokens().len(), view.labels().len());
        for i in 0..view.image_count() + 1 {
            if let Some(t) = view.image(i) {
                let _ = (t.shape(), t.layout(), t.as_u8(), t.as_f32(), t.as_f16(), t.as_bf16());
            }
            let _ = view.image_grid_thw(i);
        }
        let _ = view.metadata("split");
    }
});
