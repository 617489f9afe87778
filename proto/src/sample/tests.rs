use super::*;
use proptest::prelude::*;

fn build(
    plan: &SamplePlan,
    info: &SampleInfo,
    fill: impl FnOnce(&mut SampleRegions<'_>),
) -> AlignedBuf {
    let mut object = AlignedBuf::zeroed(plan.object_bytes(info) as usize);
    let mut regions = plan.regions(object.as_mut_slice()).unwrap();
    fill(&mut regions);
    plan.finish(object.as_mut_slice(), info).unwrap();
    object
}

/// Samples made one object each, copied into a batch: every sample reads back the same
/// (a second image and metadata included), image 0 of each side by side; images of
/// another shape cannot be batched.
#[test]
fn samples_copied_into_a_batch_read_back_the_same() {
    let singles: Vec<AlignedBuf> = (0..3u8)
        .map(|i| {
            let mut plan = SamplePlan::new();
            plan.add_image(DType::U8, TensorLayout::Hwc, &[4, 4, 4]);
            plan.add_image(DType::F32, TensorLayout::Chw, &[1, 1, i as u32 + 1]);
            plan.set_token_count(usize::from(i) + 1);
            let info = SampleInfo {
                id: format!("s{i}"),
                source_keys: vec![format!("k{i}")],
                image_grid_thw: vec![[1, 2, 2], [1, 1, 1]],
                metadata: vec![KeyValue {
                    key: "line".into(),
                    value: i.to_string(),
                }],
            };
            build(&plan, &info, |r| {
                r.images[0].fill(i);
                r.images[1].fill(i + 100);
                r.tokens.fill(u32::from(i));
                r.labels.fill(-i32::from(i));
            })
        })
        .collect();
    let views: Vec<SampleView<'_>> = singles
        .iter()
        .map(|b| SampleView::new(b.as_slice()).unwrap())
        .collect();
    let (plans, infos): (Vec<_>, Vec<_>) = views.iter().map(SampleView::plan).unzip();
    let batch = BatchPlan::new(plans, &infos).unwrap();
    let mut object = AlignedBuf::zeroed(batch.object_bytes() as usize);
    for (i, view) in views.iter().enumerate() {
        batch
            .copy_from(object.as_mut_slice(), i, view, &infos[i])
            .unwrap();
    }
    for (i, single) in views.iter().enumerate() {
        let copy = SampleView::new(&object.as_slice()[batch.start(i) as usize..]).unwrap();
        assert_eq!(copy.plan().1, single.plan().1);
        assert_eq!(
            (copy.tokens(), copy.labels()),
            (single.tokens(), single.labels())
        );
        for k in 0..2 {
            assert_eq!(
                copy.image(k).unwrap().bytes(),
                single.image(k).unwrap().bytes()
            );
            assert_eq!(
                copy.image(k).unwrap().shape(),
                single.image(k).unwrap().shape()
            );
        }
    }
    let stack = batch.stack();
    let stacked = &object.as_slice()[stack.offset as usize..][..stack.len as usize];
    assert_eq!(stacked.len(), 3 * 64);
    assert!(
        stacked
            .chunks(64)
            .enumerate()
            .all(|(i, c)| c.iter().all(|&b| usize::from(b) == i))
    );
    // One image 0 of another shape: no stack.
    let mut other = SamplePlan::new();
    other.add_image(DType::U8, TensorLayout::Hwc, &[8, 4, 4]);
    let (mut plans, _): (Vec<_>, Vec<_>) = views.iter().map(SampleView::plan).unzip();
    plans[1] = other;
    assert!(matches!(
        BatchPlan::new(plans, &infos),
        Err(SampleError::Invalid(_))
    ));
}

/// Uses every accessor of a view that passed validation: none may panic.
pub(super) fn touch_everything(view: SampleView<'_>) {
    let _ = (
        view.id(),
        view.source_keys().count(),
        view.tokens().len(),
        view.labels().len(),
    );
    for i in 0..view.image_count() + 1 {
        if let Some(t) = view.image(i) {
            let _ = (
                t.shape(),
                t.layout(),
                t.as_u8(),
                t.as_f32(),
                t.as_f16(),
                t.as_bf16(),
            );
        }
        let _ = view.image_grid_thw(i);
    }
    let _ = view.metadata("split");
}

fn multimodal() -> (SamplePlan, SampleInfo) {
    let mut plan = SamplePlan::new();
    plan.add_image(DType::F32, TensorLayout::Chw, &[3, 28, 56]);
    plan.add_image(DType::BF16, TensorLayout::Hwc, &[14, 14, 3]);
    plan.add_image(DType::U8, TensorLayout::Hwc, &[5, 7, 3]);
    plan.set_token_count(37);
    let info = SampleInfo {
        id: "vqa-000042".into(),
        source_keys: vec![
            "s3://bucket/images/42.png".into(),
            "local/a.jpg".into(),
            "c.png".into(),
        ],
        image_grid_thw: vec![[1, 2, 4], [1, 1, 1], [1, 1, 1]],
        metadata: vec![KeyValue {
            key: "split".into(),
            value: "train".into(),
        }],
    };
    (plan, info)
}

#[test]
fn every_part_reads_back_in_place() {
    let (plan, info) = multimodal();
    let object = build(&plan, &info, |r| {
        for (i, v) in bytemuck::cast_slice_mut::<u8, f32>(r.images[0])
            .iter_mut()
            .enumerate()
        {
            *v = i as f32 * 0.5;
        }
        bytemuck::cast_slice_mut::<u8, half::bf16>(r.images[1]).fill(half::bf16::from_f32(1.5));
        r.images[2].fill(200);
        for (i, t) in r.tokens.iter_mut().enumerate() {
            *t = 151_000 + i as u32;
        }
        r.labels.fill(IGNORE_INDEX);
        r.labels[36] = 151_036;
    });
    let view = SampleView::new(object.as_slice()).unwrap();
    assert_eq!(view.id(), "vqa-000042");
    assert_eq!(view.source_keys().collect::<Vec<_>>(), info.source_keys);
    assert_eq!(view.image_count(), 3);
    let img = view.image(0).unwrap();
    assert_eq!(
        (img.dtype(), img.layout(), img.shape()),
        (DType::F32, TensorLayout::Chw, vec![3, 28, 56])
    );
    assert_eq!(img.as_f32().unwrap()[11], 5.5);
    assert!(img.as_u8().is_none(), "typed access checks the dtype");
    assert_eq!(view.image(1).unwrap().as_bf16().unwrap()[0].to_f32(), 1.5);
    assert_eq!(view.image(2).unwrap().as_u8().unwrap(), &[200u8; 105][..]);
    assert!(view.image(3).is_none());
    assert_eq!(view.tokens().len(), 37);
    assert_eq!(view.tokens()[5], 151_005);
    assert_eq!(view.labels()[36], 151_036);
    assert_eq!(view.labels()[0], IGNORE_INDEX);
    assert_eq!(view.image_grid_thw(0), Some([1, 2, 4]));
    assert_eq!(view.metadata("split"), Some("train"));
    // Every array is 64-byte aligned in place.
    for ptr in [
        img.bytes().as_ptr(),
        view.tokens().as_ptr().cast(),
        view.labels().as_ptr().cast(),
    ] {
        assert_eq!(ptr as usize % 64, 0);
    }
    assert!(
        object
            .as_slice()
            .as_ptr_range()
            .contains(&img.bytes().as_ptr()),
        "zero-copy"
    );
}

#[test]
fn text_only_sample_has_no_regions_but_tokens() {
    let mut plan = SamplePlan::new();
    plan.set_token_count(3);
    let info = SampleInfo {
        id: "t".into(),
        ..Default::default()
    };
    let object = build(&plan, &info, |r| r.tokens.copy_from_slice(&[1, 2, 3]));
    let view = SampleView::new(object.as_slice()).unwrap();
    assert_eq!((view.image_count(), view.tokens()), (0, &[1u32, 2, 3][..]));
}

#[test]
fn corrupt_samples_are_refused_not_trusted() {
    let (plan, info) = multimodal();
    let good = build(&plan, &info, |_| {});
    let archive_at = le_u64(good.as_slice(), 16) as usize;
    let mutate = |f: &dyn Fn(&mut [u8])| {
        let mut bad = good.clone();
        f(bad.as_mut_slice());
        SampleView::new(bad.as_slice()).map(touch_everything)
    };
    assert!(matches!(
        mutate(&|b| b[0] = b'X'),
        Err(SampleError::BadMagic)
    ));
    assert!(matches!(
        mutate(&|b| b[8] = 9),
        Err(SampleError::UnsupportedVersion { found: 9 })
    ));
    assert!(matches!(
        mutate(&|b| b[16..24].copy_from_slice(&u64::MAX.to_le_bytes())),
        Err(SampleError::BadHeader(_))
    ));
    assert!(matches!(
        mutate(&|b| b[24..32].copy_from_slice(&(1u64 << 40).to_le_bytes())),
        Err(SampleError::BadHeader(_))
    ));
    // Scribbling over the archive either fails validation or leaves a consistent view.
    for i in 0..(good.as_slice().len() - archive_at) {
        let _ = mutate(&|b| b[archive_at + i] ^= 0xFF);
    }
    // Truncated objects, and slices that do not start on the object's alignment.
    assert!(SampleView::new(&good.as_slice()[..archive_at]).is_err());
    assert!(matches!(
        SampleView::new(&good.as_slice()[1..]),
        Err(SampleError::Misaligned)
    ));
}

/// Found by the `sample` fuzz target: a zero-length region skipped the bounds check, and its
/// forged offset then sliced out of range.
#[test]
fn empty_region_with_forged_offset_is_harmless() {
    let mut plan = SamplePlan::new();
    plan.set_token_count(0);
    let info = SampleInfo {
        id: "e".into(),
        ..Default::default()
    };
    let mut plan_forged = plan.clone();
    plan_forged.tokens = Region {
        offset: 1 << 55,
        len: 0,
    };
    plan_forged.labels = Region {
        offset: u64::MAX - 8,
        len: 0,
    };
    let object = build(&plan_forged, &info, |_| {});
    let view = SampleView::new(object.as_slice()).unwrap();
    assert!(view.tokens().is_empty() && view.labels().is_empty());
    touch_everything(view);
}

/// Found by the fuzz target's oracle: an empty image region whose shape claims elements was
/// accepted, and a reader that sizes its array by the shape (numpy, DLPack, C) would have
/// read that many bytes from the object's start, past the object for a large shape.
#[test]
fn an_empty_region_must_match_its_shape() {
    let mut plan = SamplePlan::new();
    plan.add_image(DType::F32, TensorLayout::Hwc, &[1 << 10, 1 << 10, 3]);
    plan.set_token_count(0);
    let info = SampleInfo::default();
    let mut forged = plan.clone();
    forged.images[0].region.len = 0;
    let object = build(&forged, &info, |_| {});
    assert!(matches!(
        SampleView::new(object.as_slice()),
        Err(SampleError::BadRegion { what: "image", .. })
    ));
}

#[test]
fn writer_refuses_a_short_or_misaligned_buffer() {
    let (plan, info) = multimodal();
    let mut small = AlignedBuf::zeroed(plan.object_bytes(&info) as usize - 1);
    assert!(matches!(
        plan.finish(small.as_mut_slice(), &info),
        Err(SampleError::BufferTooSmall { .. })
    ));
    let mut big = AlignedBuf::zeroed(plan.object_bytes(&info) as usize + 1);
    assert!(matches!(
        plan.regions(&mut big.as_mut_slice()[1..]),
        Err(SampleError::Misaligned)
    ));
    let wrong = SampleInfo {
        image_grid_thw: vec![[1, 1, 1]],
        ..info
    };
    let mut ok = AlignedBuf::zeroed(plan.object_bytes(&wrong) as usize);
    assert!(matches!(
        plan.finish(ok.as_mut_slice(), &wrong),
        Err(SampleError::Invalid(_))
    ));
}

proptest! {
    /// The archive bound always suffices, whatever the sizes of the parts.
    #[test]
    fn archive_bound_always_suffices(
        id in ".{0,64}",
        keys in proptest::collection::vec(".{0,200}", 0..6),
        shapes in proptest::collection::vec(proptest::collection::vec(1u32..5, 1..5), 0..5),
        tokens in 0usize..300,
        meta in proptest::collection::vec((".{0,20}", ".{0,80}"), 0..5),
    ) {
        let mut plan = SamplePlan::new();
        for s in &shapes {
            plan.add_image(DType::F16, TensorLayout::Chw, s);
        }
        plan.set_token_count(tokens);
        let info = SampleInfo {
            id,
            source_keys: keys,
            image_grid_thw: vec![[1, 1, 1]; shapes.len()],
            metadata: meta.into_iter().map(|(key, value)| KeyValue { key, value }).collect(),
        };
        let object = build(&plan, &info, |_| {});
        let view = SampleView::new(object.as_slice()).unwrap();
        prop_assert_eq!(view.id(), info.id.as_str());
        prop_assert_eq!(view.tokens().len(), tokens);
    }

    /// Arbitrary bytes after a valid header never panic the reader.
    #[test]
    fn arbitrary_archive_bytes_never_panic(tail in proptest::collection::vec(any::<u8>(), 0..512)) {
        let mut object = AlignedBuf::zeroed(128 + tail.len());
        let b = object.as_mut_slice();
        b[..8].copy_from_slice(&SAMPLE_MAGIC);
        b[8..12].copy_from_slice(&SAMPLE_VERSION.to_le_bytes());
        b[16..24].copy_from_slice(&128u64.to_le_bytes());
        b[24..32].copy_from_slice(&(tail.len() as u64).to_le_bytes());
        b[128..].copy_from_slice(&tail);
        if let Ok(view) = SampleView::new(object.as_slice()) {
            touch_everything(view);
        }
    }
}
