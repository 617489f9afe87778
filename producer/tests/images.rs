//! The image stage against Pillow: `smart_resize` sizes equal Qwen's Python rule, resized pixels
//! equal Pillow's bicubic resize of the same photo (within JPEG-decoder rounding), normalisation
//! and layout are exact, and bad images are refused with a reason.

use feedstore_producer::vision::{
    CLIP_MEAN, CLIP_STD, ImageError, ImageTransform, ResizeMode, Scratch, probe, smart_resize,
};
mod common;

use common::DATA;
use feedstore_proto::sample::{DType, TensorLayout};

fn goldens() -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(format!("{DATA}/resize_goldens.json")).unwrap())
        .unwrap()
}

/// Mean and largest absolute difference between two images' bytes.
fn differences(ours: &[u8], golden: &[u8]) -> (f64, u32) {
    assert_eq!(ours.len(), golden.len());
    let diffs = ours
        .iter()
        .zip(golden)
        .map(|(&a, &b)| u32::from(a.abs_diff(b)));
    let (sum, max) = diffs.fold((0u64, 0), |(sum, max), d| (sum + u64::from(d), max.max(d)));
    (sum as f64 / ours.len() as f64, max)
}

fn u8_hwc(width: u32, height: u32) -> ImageTransform {
    ImageTransform {
        resize: ResizeMode::Fixed { width, height },
        dtype: DType::U8,
        layout: TensorLayout::Hwc,
        ..ImageTransform::qwen_vl()
    }
}

#[test]
fn smart_resize_matches_qwens_python() {
    let g = goldens();
    let cases = g["smart_resize"].as_array().unwrap();
    assert_eq!(cases.len(), 360);
    for c in cases {
        let n = |k: &str| c[k].as_u64().unwrap();
        let got = smart_resize(
            n("height") as u32,
            n("width") as u32,
            28,
            n("min_pixels"),
            n("max_pixels"),
        );
        match (c["out_height"].as_u64(), got) {
            (Some(h), Ok((gh, gw))) => {
                assert_eq!((gh, gw), (h as u32, n("out_width") as u32), "{c}")
            }
            (None, Err(ImageError::AspectRatio { .. })) => {}
            (want, got) => panic!("{c}: expected {want:?}, got {got:?}"),
        }
    }
}

/// Against Pillow's bicubic resize of the same photo: of every pixel decoded (`jpeg_draft`
/// off), and, for JPEGs, of the DCT-scaled decode `Image.draft` gives (on, the default), at the
/// same scale Pillow picks.
#[test]
fn resized_pixels_match_pillow() {
    let g = goldens();
    let mut scratch = Scratch::default();
    for r in g["resized"].as_array().unwrap() {
        let photo = std::fs::read(format!("{DATA}/{}", r["photo"].as_str().unwrap())).unwrap();
        let (w, h) = (
            r["width"].as_u64().unwrap() as u32,
            r["height"].as_u64().unwrap() as u32,
        );
        let golden = image::open(format!("{DATA}/{}", r["golden"].as_str().unwrap()))
            .unwrap()
            .into_rgb8();
        let draft = r["draft_scale"].as_u64();
        let transform = ImageTransform {
            jpeg_draft: draft.is_some(),
            ..u8_hwc(w, h)
        };
        let decoded = transform.decode(&photo).unwrap();
        assert_eq!(decoded.target, (w, h));
        if let Some(scale) = draft {
            assert_eq!(
                u64::from(decoded.scale),
                scale,
                "{}: DCT scale",
                r["golden"]
            );
        }
        let mut ours = vec![0u8; (w * h * 3) as usize];
        transform
            .decode_into(&photo, (w, h), &mut ours, &mut scratch)
            .unwrap();
        let (mean, max) = differences(&ours, golden.as_raw());
        eprintln!("{}: {w}x{h} mean |diff| {mean:.3}, max {max}", r["golden"]);
        // The decode equals Pillow's (the same libjpeg-turbo decoder, DCT scaling included; PNG is
        // exact), so only the resize differs: fast_image_resize's bicubic against Pillow's.
        // Measured: mean <= 0.21, max 8 (JPEG detail), PNG max 2.
        assert!(mean < 0.3, "{}: mean |diff| {mean}", r["golden"]);
        assert!(max <= 8, "{}: max |diff| {max}", r["golden"]);
    }
}

#[test]
fn normalisation_dtype_and_layout_are_exact() {
    let photo = std::fs::read(format!("{DATA}/photos/chelsea.png")).unwrap();
    let p = probe(&photo, u64::MAX).unwrap();
    let qwen = ImageTransform::qwen_vl();
    let (w, h) = qwen.target_size(p.width, p.height).unwrap();
    assert_eq!((w % 28, h % 28), (0, 0));
    let mut scratch = Scratch::default();
    let mut hwc = vec![0u8; (w * h * 3) as usize];
    u8_hwc(w, h)
        .decode_into(&photo, (w, h), &mut hwc, &mut scratch)
        .unwrap();
    let mut chw = vec![0u8; (w * h * 3 * 4) as usize];
    qwen.decode_into(&photo, (w, h), &mut chw, &mut scratch)
        .unwrap();
    assert_eq!(qwen.shape(w, h), [3, h, w]);
    let chw: &[f32] = bytemuck::cast_slice(&chw);
    let plane = (w * h) as usize;
    for i in (0..plane).step_by(97) {
        for c in 0..3 {
            let want = (f32::from(hwc[i * 3 + c]) / 255.0 - CLIP_MEAN[c]) / CLIP_STD[c];
            assert_eq!(chw[c * plane + i], want, "pixel {i} channel {c}");
        }
    }
    let bf16 = ImageTransform {
        dtype: DType::BF16,
        layout: TensorLayout::Hwc,
        ..qwen.clone()
    };
    let mut out = vec![0u8; (w * h * 3 * 2) as usize];
    bf16.decode_into(&photo, (w, h), &mut out, &mut scratch)
        .unwrap();
    let out: &[half::bf16] = bytemuck::cast_slice(&out);
    assert_eq!(
        out[5],
        half::bf16::from_f32((f32::from(hwc[5]) / 255.0 - CLIP_MEAN[2]) / CLIP_STD[2])
    );
}

#[test]
fn bad_images_are_refused_with_a_reason() {
    let photo = std::fs::read(format!("{DATA}/photos/grace_hopper.jpg")).unwrap();
    let mut scratch = Scratch::default();
    let t = u8_hwc(28, 28);
    let mut dst = vec![0u8; 28 * 28 * 3];
    // Truncated JPEG: the header probes, but the pixels end early; refused, not padded with grey.
    let truncated = &photo[..photo.len() / 3];
    assert!(matches!(
        t.decode_into(truncated, (28, 28), &mut dst, &mut scratch),
        Err(ImageError::Truncated)
    ));
    // Stray bytes between markers (which real cameras write) are decoded as Pillow decodes
    // them: the warning is not an error, and the pixels are the file's.
    let sos = photo.windows(2).position(|w| w == [0xFF, 0xDA]).unwrap();
    let stray = [&photo[..sos], &[0x12, 0x34][..], &photo[sos..]].concat();
    let mut clean = vec![0u8; 28 * 28 * 3];
    t.decode_into(&photo, (28, 28), &mut clean, &mut scratch)
        .unwrap();
    t.decode_into(&stray, (28, 28), &mut dst, &mut scratch)
        .unwrap();
    assert_eq!(dst, clean);
    // A file that lacks only its final EOI marker has every pixel: decoded, as Pillow does.
    let no_eoi = &photo[..photo.len() - 2];
    assert_eq!(&photo[photo.len() - 2..], [0xFF, 0xD9]);
    t.decode_into(no_eoi, (28, 28), &mut dst, &mut scratch)
        .unwrap();
    assert_eq!(dst, clean);
    // A progressive file cut between or inside scans is truncated too.
    let progressive = std::fs::read(format!("{DATA}/convert/progressive.jpg")).unwrap();
    for cut in [progressive.len() / 3, progressive.len() * 9 / 10] {
        let err = t
            .decode_into(&progressive[..cut], (28, 28), &mut dst, &mut scratch)
            .unwrap_err();
        assert!(matches!(err, ImageError::Truncated), "cut at {cut}: {err}");
    }
    // A progressive file of more scans than any encoder writes (each costs the decoder a pass
    // over every block, so thousands would hold a worker for minutes): its last scan repeated.
    let last_scan = progressive
        .windows(2)
        .rposition(|w| w == [0xFF, 0xDA])
        .unwrap();
    let end = progressive.len() - 2;
    let mut many = progressive[..end].to_vec();
    for _ in 0..150 {
        many.extend_from_slice(&progressive[last_scan..end]);
    }
    many.extend_from_slice(&[0xFF, 0xD9]);
    let err = t
        .decode_into(&many, (28, 28), &mut dst, &mut scratch)
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "corrupt image: more than 100 scans (progressive files have about 10)"
    );
    // Truncated PNG too.
    let png = std::fs::read(format!("{DATA}/photos/chelsea.png")).unwrap();
    assert!(matches!(
        t.decode_into(&png[..png.len() / 2], (28, 28), &mut dst, &mut scratch),
        Err(ImageError::Corrupt(_))
    ));
    // Not an image at all, and a format this build recognises but does not read (BMP).
    assert!(matches!(
        probe(b"{\"json\": true}", u64::MAX),
        Err(ImageError::UnknownFormat)
    ));
    let err = probe(b"BM\x3a\x00\x00\x00\x00\x00\x00\x00", u64::MAX).unwrap_err();
    assert_eq!(
        err.to_string(),
        "BMP images are not supported (JPEG, PNG, WebP and GIF are)"
    );
    // Decompression bomb: a tiny PNG that claims a huge canvas is refused from its header.
    let mut bomb = Vec::new();
    image::RgbImage::new(20_000, 1)
        .write_to(
            &mut std::io::Cursor::new(&mut bomb),
            image::ImageFormat::Png,
        )
        .unwrap();
    let guarded = ImageTransform {
        max_source_pixels: 10_000,
        ..t.clone()
    };
    assert!(bomb.len() < 1000, "the bomb is small on disk");
    assert!(matches!(
        guarded.decode_into(&bomb, (28, 28), &mut dst, &mut scratch),
        Err(ImageError::TooLarge {
            width: 20_000,
            height: 1,
            ..
        })
    ));
    // Absurd aspect ratio under Qwen-VL sizing, and a wrong-sized destination.
    assert!(matches!(
        ImageTransform::qwen_vl().target_size(20_000, 1),
        Err(ImageError::AspectRatio { .. })
    ));
    assert!(matches!(
        t.decode_into(&photo, (28, 28), &mut dst[1..], &mut scratch),
        Err(ImageError::Destination { .. })
    ));
    // And the good photo still decodes after all that.
    t.decode_into(&photo, (28, 28), &mut dst, &mut scratch)
        .unwrap();
}

/// Inputs Pillow converts specially, against what `ImageOps.exif_transpose(...).convert("RGB")`
/// makes of them (`make_convert_goldens.py`): EXIF orientation applied, 16-bit grey clipped and
/// 16-bit colour cut to its high byte, palettes expanded, alpha dropped, CMYK converted, an
/// animation's first frame; greyscale and progressive JPEGs. Lossless inputs and JPEGs (the
/// same libjpeg-turbo decoder) must match exactly; CMYK JPEGs (zune-jpeg) within its rounding.
#[test]
fn special_inputs_decode_as_pillow_converts_them() {
    let goldens: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(format!("{DATA}/convert/goldens.json")).unwrap(),
    )
    .unwrap();
    // Every pixel decoded: the goldens are Pillow's full-size decodes.
    let transform = ImageTransform {
        jpeg_draft: false,
        ..ImageTransform::qwen_vl()
    };
    let cases = goldens["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 13);
    for case in cases {
        let input = case["input"].as_str().unwrap();
        let encoded = std::fs::read(format!("{DATA}/{input}")).unwrap();
        let ours = transform
            .decode(&encoded)
            .unwrap_or_else(|e| panic!("{input}: {e}"))
            .rgb;
        let golden = image::open(format!("{DATA}/{}", case["golden"].as_str().unwrap()))
            .unwrap()
            .into_rgb8();
        assert_eq!(
            ours.dimensions(),
            golden.dimensions(),
            "{input}: upright size"
        );
        let (mean, max) = differences(ours.as_raw(), golden.as_raw());
        eprintln!("{input}: mean |diff| {mean:.3}, max {max}");
        if input.ends_with("cmyk.jpg") {
            // CMYK goes to zune-jpeg, which rounds its IDCT differently from libjpeg.
            assert!(mean < 0.5 && max <= 8, "{input}: mean {mean}, max {max}");
        } else if input.ends_with(".jpg") {
            assert_eq!(max, 0, "{input}: Pillow's decoder, exact (mean {mean})");
        } else {
            assert_eq!(max, 0, "{input}: lossless input, exact (mean {mean})");
        }
    }
}

/// A rotated JPEG decoded at a DCT scale: the scale is chosen for the stored orientation (the
/// output size is upright), the result is upright, and it is the full decode's picture.
#[test]
fn a_rotated_jpeg_is_scaled_in_its_stored_orientation() {
    let encoded = std::fs::read(format!("{DATA}/convert/exif6.jpg")).unwrap();
    // Stored 96x64, orientation 6: upright 64x96. An upright 16x24 output allows 1/4.
    let drafted = u8_hwc(16, 24).decode(&encoded).unwrap();
    assert_eq!(drafted.scale, 4);
    assert_eq!(drafted.rgb.dimensions(), (16, 24));
    assert_eq!(drafted.target, (16, 24));
    let full = ImageTransform {
        jpeg_draft: false,
        ..u8_hwc(16, 24)
    };
    let mut scratch = Scratch::default();
    let (mut ours, mut reference) = (vec![0u8; 16 * 24 * 3], vec![0u8; 16 * 24 * 3]);
    u8_hwc(16, 24)
        .decode_into(&encoded, (16, 24), &mut ours, &mut scratch)
        .unwrap();
    full.decode_into(&encoded, (16, 24), &mut reference, &mut scratch)
        .unwrap();
    let (mean, _) = differences(&ours, &reference);
    assert!(
        mean < 6.0,
        "the scaled decode's picture differs: mean {mean}"
    );
}
