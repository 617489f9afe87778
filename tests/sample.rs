//! A sample written once, in place, into shared memory by a writer, and read in place by a reader
//! through a lease: typed views that point into the reader's read-only mapping.

mod common;

use std::time::Duration;

use common::*;
use feedstore_proto::sample::{
    DType, IGNORE_INDEX, KeyValue, SampleInfo, SamplePlan, SampleView, TensorLayout,
};

#[test]
fn sample_is_written_in_place_and_read_zero_copy() {
    let _w = watchdog(
        "sample_is_written_in_place_and_read_zero_copy",
        Duration::from_secs(60),
    );
    let dir = scratch_dir("sample");
    let daemon = DaemonProcess::start(&dir, &[]);
    let (writer, reader) = (daemon.writer(), daemon.reader());

    let mut plan = SamplePlan::new();
    plan.add_image(DType::F32, TensorLayout::Chw, &[3, 448, 448]);
    plan.set_token_count(300);
    let info = SampleInfo {
        id: "vqa-7".into(),
        source_keys: vec!["s3://datasets/vqa/7.png".into()],
        image_grid_thw: vec![[1, 32, 32]],
        metadata: vec![KeyValue {
            key: "split".into(),
            value: "train".into(),
        }],
    };
    let mut object = writer.create(plan.object_bytes(&info)).unwrap();
    let buf = object.as_mut_slice();
    let regions = plan.regions(buf).unwrap();
    for (i, v) in bytemuck::cast_slice_mut::<u8, f32>(regions.images.into_iter().next().unwrap())
        .iter_mut()
        .enumerate()
    {
        *v = (i % 255) as f32 / 255.0;
    }
    for (i, t) in regions.tokens.iter_mut().enumerate() {
        *t = i as u32 * 7;
    }
    regions.labels.fill(IGNORE_INDEX);
    plan.finish(object.as_mut_slice(), &info).unwrap();
    let handle = object.seal().unwrap();

    let lease = reader.get(handle).unwrap();
    let sample = SampleView::new(&lease).unwrap();
    assert_eq!(sample.id(), "vqa-7");
    let image = sample.image(0).unwrap();
    assert_eq!(image.shape(), vec![3, 448, 448]);
    let pixels = image.as_f32().unwrap();
    assert_eq!(pixels.len(), 3 * 448 * 448);
    assert!(
        pixels
            .iter()
            .enumerate()
            .all(|(i, &v)| v == (i % 255) as f32 / 255.0)
    );
    assert_eq!(sample.tokens()[299], 299 * 7);
    assert_eq!(sample.image_grid_thw(0), Some([1, 32, 32]));
    // Zero-copy: the typed views lie inside the reader's read-only mapping of the segment.
    assert!(reader.maps(pixels.as_ptr().cast()));
    assert!(reader.maps(sample.tokens().as_ptr().cast()));
}
