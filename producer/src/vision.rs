//! Images: probe, plan, decode, resize, normalize, with the final pass writing straight into the
//! sample's region in shared memory.
//!
//! The order matters for both safety and speed:
//!
//! 1. The header is read first (a JPEG's by libjpeg in [`jpeg`], the others' by
//!    [`probe`]): format and dimensions. The decompression-bomb guard (`max_source_pixels`)
//!    refuses an image before a single pixel is decoded.
//! 2. [`ImageTransform::target_size`] decides the output size from the source's upright
//!    dimensions (fixed, shorter side, or Qwen-VL's `smart_resize`; the header's may be rotated
//!    by EXIF orientation). That size fixes the tensor's shape and the number of image tokens, so
//!    the sample's object is reserved at its final size before anything is written.
//! 3. [`ImageTransform::decode`] decodes a JPEG with libjpeg-turbo's decoder (the one Pillow
//!    links; [`jpeg`]) at the largest DCT scale, 1/2, 1/4 or 1/8, that keeps it at least
//!    the output size (Pillow's `Image.draft` rule; [`ImageTransform::jpeg_draft`]), so a 2048 px
//!    photo bound for 448 px never has its every pixel decoded; PNG/WebP/GIF (and CMYK JPEGs)
//!    go through `image` (zune-jpeg). The result is the RGB that Pillow (9.4, the goldens'
//!    version) makes with
//!    `ImageOps.exif_transpose(...).convert("RGB")`: EXIF orientation applied, 16-bit grey
//!    clipped, 16-bit colour by its high byte, alpha dropped, palettes and CMYK converted, an
//!    animation's first frame. (Not matched: orientation from XMP or PNG text chunks, and a GIF
//!    whose first frame leaves part of the canvas uncovered: black here, the background colour
//!    in Pillow.) It resizes with `fast_image_resize` (bicubic, Pillow's filter) and runs one
//!    pass that normalises, converts dtype and layout and writes into `dst`, which is the region
//!    of the object in shared memory. For `u8` HWC output the resize writes into `dst` directly.

use std::io::Cursor;

use fast_image_resize::images::{Image, ImageRef};
use fast_image_resize::{FilterType, PixelType, ResizeAlg, ResizeOptions, Resizer};
use feedstore_proto::sample::{DType, TensorLayout};

pub mod jpeg;

/// How to size the output.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ResizeMode {
    /// Exactly `width` × `height`; the aspect ratio is not kept.
    Fixed {
        /// Output width.
        width: u32,
        /// Output height.
        height: u32,
    },
    /// The shorter side becomes `size`; the other keeps the aspect ratio.
    ShorterSide(u32),
    /// Qwen-VL's `smart_resize`: both sides multiples of `factor` (patch × merge, 28 for
    /// Qwen2/2.5-VL), area within `min_pixels..=max_pixels`, aspect ratio kept as closely as
    /// that allows.
    QwenVl {
        /// Smallest area.
        min_pixels: u64,
        /// Largest area.
        max_pixels: u64,
        /// Side multiple.
        factor: u32,
    },
}

/// Why an image was rejected. Each rejects one sample, not the run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ImageError {
    /// The bytes are no image format this build reads.
    #[error("unrecognised or unsupported image format")]
    UnknownFormat,
    /// The output size the resize rule gives is empty or larger than any model takes.
    #[error(
        "the resize would make a {width}x{height} image (an empty side, or more than {MAX_OUTPUT_PIXELS} pixels)"
    )]
    OutputSize {
        /// Output width.
        width: u32,
        /// Output height.
        height: u32,
    },
    /// A format recognised by its signature that this build does not decode.
    #[error("{0} images are not supported (JPEG, PNG, WebP and GIF are)")]
    Unsupported(String),
    /// The header or the pixel data is broken or truncated.
    #[error("corrupt image: {0}")]
    Corrupt(String),
    /// Zero width or height.
    #[error("image has zero width or height")]
    Empty,
    /// The data ends before the image does (a partial download, a cut file).
    #[error("truncated image: the data ends before the last pixel row")]
    Truncated,
    /// More pixels than allowed, refused before decoding (decompression-bomb guard).
    #[error("image of {width}x{height} exceeds the limit of {max_pixels} pixels")]
    TooLarge {
        /// Width from the header.
        width: u32,
        /// Height from the header.
        height: u32,
        /// The limit.
        max_pixels: u64,
    },
    /// Qwen-VL refuses aspect ratios over 200.
    #[error("aspect ratio {ratio:.0} exceeds 200")]
    AspectRatio {
        /// Longer side over shorter side.
        ratio: f64,
    },
    /// The destination region has the wrong size.
    #[error("destination of {have} bytes, {need} needed")]
    Destination {
        /// Bytes needed.
        need: usize,
        /// Bytes given.
        have: usize,
    },
    /// The resizer failed.
    #[error("resize failed: {0}")]
    Resize(String),
}

/// What [`probe`] learns from the header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Probe {
    /// Width in pixels.
    pub width: u32,
    /// Height in pixels.
    pub height: u32,
}

fn reader(encoded: &[u8]) -> Result<image::ImageReader<Cursor<&[u8]>>, ImageError> {
    let reader = image::ImageReader::new(Cursor::new(encoded))
        .with_guessed_format()
        .map_err(|e| ImageError::Corrupt(e.to_string()))?;
    use image::ImageFormat as F;
    match reader.format() {
        None => Err(ImageError::UnknownFormat),
        Some(F::Jpeg | F::Png | F::WebP | F::Gif) => Ok(reader),
        Some(other) => Err(ImageError::Unsupported(
            other
                .extensions_str()
                .first()
                .map_or_else(|| format!("{other:?}"), |e| e.to_uppercase()),
        )),
    }
}

fn classify(e: image::ImageError) -> ImageError {
    match e {
        image::ImageError::Unsupported(_) => ImageError::UnknownFormat,
        other => ImageError::Corrupt(other.to_string()),
    }
}

/// Reads the format and dimensions from the header, without decoding pixels, and applies the
/// decompression-bomb guard.
pub fn probe(encoded: &[u8], max_source_pixels: u64) -> Result<Probe, ImageError> {
    let (width, height) = reader(encoded)?.into_dimensions().map_err(classify)?;
    if width == 0 || height == 0 {
        return Err(ImageError::Empty);
    }
    if u64::from(width) * u64::from(height) > max_source_pixels {
        return Err(ImageError::TooLarge {
            width,
            height,
            max_pixels: max_source_pixels,
        });
    }
    Ok(Probe { width, height })
}

/// Decodes to RGB8 as Pillow's `ImageOps.exif_transpose(Image.open(f)).convert("RGB")` does:
/// the EXIF orientation applied, alpha dropped, 16-bit grey clipped to 255 and 16-bit colour
/// (or grey with alpha) cut to its high byte, palettes expanded, an animation's first frame.
///
/// The JPEGs that come here are CMYK and YCCK ones ([`jpeg`] decodes the rest), which
/// go to zune-jpeg directly: first in strict mode, so a truncated file is refused rather than
/// padded with grey (the lenient decoder, like a browser, renders what it has); a complete file
/// that strict mode dislikes for other reasons (stray bytes between markers, which real cameras
/// write) is decoded again leniently.
fn decode_rgb(encoded: &[u8], probe: Probe) -> Result<image::RgbImage, ImageError> {
    use image::ImageDecoder;
    let mut reader = reader(encoded)?;
    if reader.format() != Some(image::ImageFormat::Jpeg) {
        let mut limits = image::Limits::default();
        limits.max_image_width = Some(probe.width);
        limits.max_image_height = Some(probe.height);
        // A GIF frame larger than its header's canvas cannot allocate past the canvas either.
        limits.max_alloc = Some(u64::from(probe.width) * u64::from(probe.height) * 8 + (1 << 20));
        reader.limits(limits);
        let mut decoder = reader.into_decoder().map_err(classify)?;
        let orientation = decoder
            .orientation()
            .unwrap_or(image::metadata::Orientation::NoTransforms);
        // The file's own colour type (the decoder reports grey with a tRNS chunk as grey with
        // alpha): IHDR's bit depth and colour type, at bytes 24 and 25 of a PNG.
        let grey16 = encoded.starts_with(b"\x89PNG") && encoded.get(24..26) == Some(&[16, 0]);
        let decoded = image::DynamicImage::from_decoder(decoder).map_err(classify)?;
        return Ok(oriented(like_pillow(decoded, grey16), orientation));
    }
    let jpeg = |strict: bool| {
        let options = zune_core::options::DecoderOptions::default()
            .set_strict_mode(strict)
            .set_max_width(probe.width as usize)
            .set_max_height(probe.height as usize)
            .jpeg_set_out_colorspace(zune_core::colorspace::ColorSpace::RGB);
        let mut decoder = zune_jpeg::JpegDecoder::new_with_options(
            zune_core::bytestream::ZCursor::new(encoded),
            options,
        );
        let pixels = decoder.decode()?;
        let (w, h) = decoder
            .dimensions()
            .expect("dimensions known after decoding");
        let orientation = decoder
            .exif()
            .and_then(|exif| image::metadata::Orientation::from_exif_chunk(exif))
            .unwrap_or(image::metadata::Orientation::NoTransforms);
        Ok::<_, zune_jpeg::errors::DecodeErrors>((pixels, w as u32, h as u32, orientation))
    };
    let (pixels, w, h, orientation) = match jpeg(true) {
        Ok(decoded) => decoded,
        // Baseline scans run out as ExhaustedData, others as "Premature end of buffer".
        Err(zune_jpeg::errors::DecodeErrors::ExhaustedData) => return Err(ImageError::Truncated),
        Err(zune_jpeg::errors::DecodeErrors::FormatStatic(m)) if m.contains("Premature end") => {
            return Err(ImageError::Truncated);
        }
        Err(_) => jpeg(false).map_err(|e| ImageError::Corrupt(e.to_string()))?,
    };
    let rgb = image::RgbImage::from_raw(w, h, pixels)
        .ok_or_else(|| ImageError::Corrupt("decoder returned a short buffer".into()))?;
    Ok(oriented(rgb, orientation))
}

/// RGB8 as Pillow's `convert("RGB")` makes it from what its PNG reader opens: 16-bit grey
/// (`grey16`: the file's colour type, even when a tRNS chunk made the decoder add alpha) is mode
/// `I`, clipped to 255 (not scaled); 16-bit colour and grey-with-alpha are read by their high
/// byte; alpha is dropped, not composited.
fn like_pillow(decoded: image::DynamicImage, grey16: bool) -> image::RgbImage {
    use image::DynamicImage as D;
    let from = |width, height, pixels: Vec<u8>| {
        image::RgbImage::from_raw(width, height, pixels).expect("three bytes per pixel")
    };
    match decoded {
        D::ImageLuma16(grey) => {
            let (w, h) = grey.dimensions();
            let pixels = grey
                .into_raw()
                .into_iter()
                .flat_map(|v| [v.min(255) as u8; 3])
                .collect();
            from(w, h, pixels)
        }
        D::ImageLumaA16(grey) => {
            let (w, h) = grey.dimensions();
            let pixels = grey
                .into_raw()
                .chunks_exact(2)
                .flat_map(|p| {
                    [if grey16 {
                        p[0].min(255) as u8
                    } else {
                        (p[0] >> 8) as u8
                    }; 3]
                })
                .collect();
            from(w, h, pixels)
        }
        D::ImageRgb16(_) | D::ImageRgba16(_) => {
            let (w, h) = (decoded.width(), decoded.height());
            let pixels = decoded
                .into_rgba16()
                .into_raw()
                .chunks_exact(4)
                .flat_map(|p| [(p[0] >> 8) as u8, (p[1] >> 8) as u8, (p[2] >> 8) as u8])
                .collect();
            from(w, h, pixels)
        }
        other => other.into_rgb8(),
    }
}

/// `pixels` turned upright as its EXIF orientation says.
fn oriented(pixels: image::RgbImage, orientation: image::metadata::Orientation) -> image::RgbImage {
    if orientation == image::metadata::Orientation::NoTransforms {
        return pixels;
    }
    let mut upright = image::DynamicImage::ImageRgb8(pixels);
    upright.apply_orientation(orientation);
    upright.into_rgb8()
}

/// The most pixels an output image may have: far more than any vision-language model takes,
/// and small enough that one image's tensor fits a store.
pub const MAX_OUTPUT_PIXELS: u64 = 1 << 26;

/// Mean and standard deviation per channel of OpenAI CLIP, which Qwen-VL's processor uses.
pub const CLIP_MEAN: [f32; 3] = [0.481_454_66, 0.457_827_5, 0.408_210_73];
/// See [`CLIP_MEAN`]. Quoted digit for digit from the reference processor (`OPENAI_CLIP_STD`).
#[allow(clippy::excessive_precision)]
pub const CLIP_STD: [f32; 3] = [0.268_629_54, 0.261_302_58, 0.275_777_11];
/// SigLIP's (SigLIP 2's, and the Qwen3-VL vision encoder's) mean and standard deviation: 0.5 per
/// channel, pixels to -1..1.
pub const SIGLIP_MEAN: [f32; 3] = [0.5; 3];
/// See [`SIGLIP_MEAN`].
pub const SIGLIP_STD: [f32; 3] = [0.5; 3];
/// ImageNet's mean and standard deviation (torchvision's and timm's default).
pub const IMAGENET_MEAN: [f32; 3] = [0.485, 0.456, 0.406];
/// See [`IMAGENET_MEAN`].
pub const IMAGENET_STD: [f32; 3] = [0.229, 0.224, 0.225];

/// The named normalisations, `(x / 255 - mean) / std` per channel: (name, mean, std). `none`
/// keeps pixels on the 0..1 scale.
pub const NORMALIZATIONS: [(&str, [f32; 3], [f32; 3]); 4] = [
    ("clip", CLIP_MEAN, CLIP_STD),
    ("siglip", SIGLIP_MEAN, SIGLIP_STD),
    ("imagenet", IMAGENET_MEAN, IMAGENET_STD),
    ("none", [0.0; 3], [1.0; 3]),
];

/// A decoded image, upright, and the output size its source asks for.
#[derive(Debug)]
pub struct Decoded {
    /// RGB8 pixels: the source's upright size, or less where a JPEG was decoded at a DCT scale.
    pub rgb: image::RgbImage,
    /// The output `(width, height)`: [`ImageTransform::target_size`] of the source's upright
    /// size (not of `rgb`'s), or the size the caller asked for.
    pub target: (u32, u32),
    /// The JPEG DCT scale denominator the decode used: 1 (every pixel), 2, 4 or 8.
    pub scale: u32,
}

/// The whole image transform of one pipeline.
#[derive(Debug, Clone, PartialEq)]
pub struct ImageTransform {
    /// Output size rule.
    pub resize: ResizeMode,
    /// Per-channel mean, on the 0..1 scale (ignored for `u8` output).
    pub mean: [f32; 3],
    /// Per-channel standard deviation, on the 0..1 scale (ignored for `u8` output).
    pub std: [f32; 3],
    /// Output element type.
    pub dtype: DType,
    /// Output memory order.
    pub layout: TensorLayout,
    /// Decompression-bomb guard: images with more pixels are refused before decoding.
    pub max_source_pixels: u64,
    /// Decode a JPEG at the largest DCT scale (1/2, 1/4, 1/8) that keeps it at least the output
    /// size, then resize, as Pillow's `Image.draft` does; `false` decodes every pixel, as
    /// transformers' image processors do (equal to their pixels within resize rounding).
    pub jpeg_draft: bool,
}

impl ImageTransform {
    /// Qwen2/2.5-VL's defaults: smart resize to 28-pixel multiples within 56² to 1280 × 28²
    /// pixels, CLIP normalisation, f32 CHW.
    pub fn qwen_vl() -> ImageTransform {
        ImageTransform {
            resize: ResizeMode::QwenVl {
                min_pixels: 56 * 56,
                max_pixels: 14 * 14 * 4 * 1280,
                factor: 28,
            },
            mean: CLIP_MEAN,
            std: CLIP_STD,
            dtype: DType::F32,
            layout: TensorLayout::Chw,
            max_source_pixels: 64 << 20,
            jpeg_draft: true,
        }
    }

    /// The normalisation in words, as each sample records it: a name of [`NORMALIZATIONS`],
    /// `mean=R,G,B std=R,G,B` for another, or `u8` for `u8` output (pixels as decoded, 0..255).
    pub fn normalization(&self) -> String {
        if self.dtype == DType::U8 {
            return "u8".into();
        }
        let named = NORMALIZATIONS
            .iter()
            .find(|(_, mean, std)| *mean == self.mean && *std == self.std);
        match named {
            Some((name, _, _)) => (*name).into(),
            None => {
                let list = |v: [f32; 3]| format!("{},{},{}", v[0], v[1], v[2]);
                format!("mean={} std={}", list(self.mean), list(self.std))
            }
        }
    }

    /// The output `(width, height)` for a source of `width` × `height`.
    pub fn target_size(&self, width: u32, height: u32) -> Result<(u32, u32), ImageError> {
        if width == 0 || height == 0 {
            return Err(ImageError::Empty);
        }
        let (w, h) = match self.resize {
            ResizeMode::Fixed { width, height } => (width, height),
            ResizeMode::ShorterSide(size) => {
                let scale = f64::from(size) / f64::from(width.min(height));
                let w = (f64::from(width) * scale).round().min(f64::from(u32::MAX)) as u32;
                let h = (f64::from(height) * scale).round().min(f64::from(u32::MAX)) as u32;
                (w.max(1), h.max(1))
            }
            ResizeMode::QwenVl {
                min_pixels,
                max_pixels,
                factor,
            } => {
                smart_resize(height, width, factor, min_pixels, max_pixels).map(|(h, w)| (w, h))?
            }
        };
        // A side of 0 (Qwen's rule with a tiny max area) or a huge one (a long, thin image
        // under `short:N`): refused rather than written.
        if w == 0 || h == 0 || u64::from(w) * u64::from(h) > MAX_OUTPUT_PIXELS {
            return Err(ImageError::OutputSize {
                width: w,
                height: h,
            });
        }
        Ok((w, h))
    }

    /// The output tensor's shape for an output of `width` × `height`.
    pub fn shape(&self, width: u32, height: u32) -> [u32; 3] {
        match self.layout {
            TensorLayout::Hwc => [height, width, 3],
            TensorLayout::Chw => [3, height, width],
        }
    }

    /// Decodes `encoded`, resizes it to `target` and writes the normalised tensor into `dst`
    /// (`shape(target) × dtype` bytes). `scratch` is reused between calls on one worker.
    pub fn decode_into(
        &self,
        encoded: &[u8],
        target: (u32, u32),
        dst: &mut [u8],
        scratch: &mut Scratch,
    ) -> Result<(), ImageError> {
        let decoded = self.decode_for(encoded, Some(target))?;
        self.resize_into(&decoded.rgb, target, dst, scratch)
    }

    /// Decodes to upright RGB8, after the header check and the decompression-bomb guard, with
    /// the output size the source asks for ([`ImageTransform::target_size`] of its upright size).
    /// A JPEG is decoded at the DCT scale that size allows (see [`ImageTransform::jpeg_draft`]).
    pub fn decode(&self, encoded: &[u8]) -> Result<Decoded, ImageError> {
        self.decode_for(encoded, None)
    }

    fn decode_for(
        &self,
        encoded: &[u8],
        target: Option<(u32, u32)>,
    ) -> Result<Decoded, ImageError> {
        // A JPEG's header is read by libjpeg itself, which applies the same guard before any
        // pixel is decoded; `probe` reads the others' (and a CMYK JPEG's, below).
        if reader(encoded)?.format() == Some(image::ImageFormat::Jpeg) {
            let mut wanted = target;
            let decoded = jpeg::decode(encoded, |header| {
                if u64::from(header.width) * u64::from(header.height) > self.max_source_pixels {
                    return Err(ImageError::TooLarge {
                        width: header.width,
                        height: header.height,
                        max_pixels: self.max_source_pixels,
                    });
                }
                let (w, h) = header.upright();
                let target = match target {
                    Some(target) => target,
                    None => self.target_size(w, h)?,
                };
                wanted = Some(target);
                if !self.jpeg_draft {
                    return Ok(1);
                }
                let stored = if jpeg::swaps_axes(header.orientation) {
                    (target.1, target.0)
                } else {
                    target
                };
                Ok(jpeg::draft_scale(header.width, header.height, stored))
            })?;
            if let (Some(decoded), Some(target)) = (decoded, wanted) {
                return Ok(Decoded {
                    rgb: oriented(decoded.pixels, decoded.orientation),
                    target,
                    scale: decoded.scale,
                });
            }
        }
        let rgb = decode_rgb(encoded, probe(encoded, self.max_source_pixels)?)?;
        let target = match target {
            Some(target) => target,
            None => self.target_size(rgb.width(), rgb.height())?,
        };
        Ok(Decoded {
            rgb,
            target,
            scale: 1,
        })
    }

    /// Resizes decoded pixels to `target` and writes the normalised tensor into `dst`
    /// (`shape(target) × dtype` bytes): the pass that writes shared memory.
    pub fn resize_into(
        &self,
        rgb: &image::RgbImage,
        target: (u32, u32),
        dst: &mut [u8],
        scratch: &mut Scratch,
    ) -> Result<(), ImageError> {
        let (tw, th) = target;
        let pixels = tw as usize * th as usize;
        let need = pixels * 3 * self.dtype.size_bytes() as usize;
        if dst.len() != need {
            return Err(ImageError::Destination {
                need,
                have: dst.len(),
            });
        }
        let (sw, sh) = rgb.dimensions();
        let direct = self.dtype == DType::U8 && self.layout == TensorLayout::Hwc;
        let resized: &[u8] = if (sw, sh) == (tw, th) {
            if direct {
                dst.copy_from_slice(rgb.as_raw());
                return Ok(());
            }
            rgb.as_raw()
        } else {
            let src = ImageRef::new(sw, sh, rgb.as_raw(), PixelType::U8x3)
                .map_err(|e| ImageError::Resize(e.to_string()))?;
            let out: &mut [u8] = if direct {
                dst
            } else {
                scratch.rgb.resize(pixels * 3, 0);
                &mut scratch.rgb
            };
            let mut out_image = Image::from_slice_u8(tw, th, out, PixelType::U8x3)
                .map_err(|e| ImageError::Resize(e.to_string()))?;
            let options =
                ResizeOptions::new().resize_alg(ResizeAlg::Convolution(FilterType::CatmullRom));
            scratch
                .resizer
                .resize(&src, &mut out_image, &options)
                .map_err(|e| ImageError::Resize(e.to_string()))?;
            if direct {
                return Ok(());
            }
            &scratch.rgb
        };
        self.normalize(resized, dst);
        Ok(())
    }

    /// One pass over the resized RGB pixels: per-channel lookup table (256 entries: every `u8`
    /// value's normalised output, already in the output dtype), layout transpose, written into
    /// `dst`, each output element once.
    fn normalize(&self, rgb: &[u8], dst: &mut [u8]) {
        let lut: [[f32; 256]; 3] = std::array::from_fn(|c| {
            std::array::from_fn(|v| (v as f32 / 255.0 - self.mean[c]) / self.std[c])
        });
        let layout = self.layout;
        match self.dtype {
            DType::U8 => {
                let identity = std::array::from_fn(|_| std::array::from_fn(|v| v as u8));
                write_converted(rgb, &identity, dst, layout);
            }
            DType::F32 => {
                write_converted(rgb, &lut, bytemuck::cast_slice_mut::<u8, f32>(dst), layout)
            }
            DType::F16 => write_converted(
                rgb,
                &lut.map(|c| c.map(half::f16::from_f32)),
                bytemuck::cast_slice_mut::<u8, half::f16>(dst),
                layout,
            ),
            DType::BF16 => write_converted(
                rgb,
                &lut.map(|c| c.map(half::bf16::from_f32)),
                bytemuck::cast_slice_mut::<u8, half::bf16>(dst),
                layout,
            ),
        }
    }
}

/// Writes `table[c][value]` for every channel value of the interleaved `rgb` pixels into `dst`
/// in `layout`: HWC keeps the interleave, CHW writes three planes, each a sequential stream
/// (the planes are split up front, so the loop has no index arithmetic or bounds checks).
fn write_converted<T: Copy>(
    rgb: &[u8],
    table: &[[T; 256]; 3],
    dst: &mut [T],
    layout: TensorLayout,
) {
    let [t0, t1, t2] = table;
    match layout {
        TensorLayout::Hwc => {
            for (out, px) in dst.chunks_exact_mut(3).zip(rgb.chunks_exact(3)) {
                out[0] = t0[usize::from(px[0])];
                out[1] = t1[usize::from(px[1])];
                out[2] = t2[usize::from(px[2])];
            }
        }
        TensorLayout::Chw => {
            let plane = rgb.len() / 3;
            let (r, rest) = dst.split_at_mut(plane);
            let (g, b) = rest.split_at_mut(plane);
            for (((px, r), g), b) in rgb.chunks_exact(3).zip(r).zip(g).zip(b) {
                *r = t0[usize::from(px[0])];
                *g = t1[usize::from(px[1])];
                *b = t2[usize::from(px[2])];
            }
        }
    }
}

/// Buffers reused from one image to the next on a worker.
#[derive(Default)]
pub struct Scratch {
    rgb: Vec<u8>,
    resizer: Resizer,
}

impl std::fmt::Debug for Scratch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scratch")
            .field("rgb_capacity", &self.rgb.capacity())
            .finish()
    }
}

/// Qwen-VL's `smart_resize`, returning `(height, width)`: both multiples of `factor`, the area
/// brought within `[min_pixels, max_pixels]` by scaling both sides by the same factor. Rounds half
/// to even, as the Python original's `round` does.
pub fn smart_resize(
    height: u32,
    width: u32,
    factor: u32,
    min_pixels: u64,
    max_pixels: u64,
) -> Result<(u32, u32), ImageError> {
    let (h, w, f) = (f64::from(height), f64::from(width), f64::from(factor));
    let ratio = h.max(w) / h.min(w);
    if ratio > 200.0 {
        return Err(ImageError::AspectRatio { ratio });
    }
    let round_by = |v: f64| (v / f).round_ties_even() * f;
    let mut h_bar = f.max(round_by(h));
    let mut w_bar = f.max(round_by(w));
    if h_bar * w_bar > max_pixels as f64 {
        let beta = (h * w / max_pixels as f64).sqrt();
        h_bar = (h / beta / f).floor() * f;
        w_bar = (w / beta / f).floor() * f;
    } else if h_bar * w_bar < min_pixels as f64 {
        let beta = (min_pixels as f64 / (h * w)).sqrt();
        h_bar = (h * beta / f).ceil() * f;
        w_bar = (w * beta / f).ceil() * f;
    }
    Ok((h_bar as u32, w_bar as u32))
}
