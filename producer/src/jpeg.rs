//! JPEG decoding with libjpeg-turbo's decoder (built from source by `mozjpeg-sys`, the same
//! decoder Pillow links), so a decoded JPEG equals Pillow's, and with its DCT-domain scaling: a
//! JPEG decoded straight to 1/2, 1/4 or 1/8 of its size costs far less than every pixel decoded
//! and then shrunk. [`decode`] picks the scale as Pillow's `Image.draft` does.
//!
//! libjpeg reports a fatal error through `error_exit`, which must not return: ours unwinds with
//! [`std::panic::resume_unwind`] (no panic hook, no message on stderr), `mozjpeg-sys` builds the
//! C code to let it pass, and [`decode`] catches it as an error. Warnings are silent; the one that
//! says the data ended early is remembered, so a truncated file is refused rather than padded
//! with grey.

use std::cell::Cell;
use std::os::raw::c_int;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};

use image::metadata::Orientation;
use mozjpeg::{Decompress, Marker};
use mozjpeg_sys::{J_COLOR_SPACE, JWRN_JPEG_EOF, jpeg_common_struct, jpeg_error_mgr};

use crate::vision::ImageError;

/// What the header says, before any pixel is decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// Width as stored (before the EXIF orientation).
    pub width: u32,
    /// Height as stored.
    pub height: u32,
    /// The EXIF orientation.
    pub orientation: Orientation,
}

impl Header {
    /// `(width, height)` once the EXIF orientation is applied.
    pub fn upright(&self) -> (u32, u32) {
        if swaps_axes(self.orientation) {
            (self.height, self.width)
        } else {
            (self.width, self.height)
        }
    }
}

/// Whether turning an image upright swaps its width and height.
pub fn swaps_axes(orientation: Orientation) -> bool {
    use Orientation as O;
    matches!(
        orientation,
        O::Rotate90 | O::Rotate270 | O::Rotate90FlipH | O::Rotate270FlipH
    )
}

/// The largest DCT scale denominator (8, 4, 2 or 1) that keeps a `width` × `height` image at
/// least `target` in both sides: Pillow's `Image.draft` rule, `min(w // tw, h // th)` rounded
/// down to a power of two no larger than 8.
pub fn draft_scale(width: u32, height: u32, target: (u32, u32)) -> u32 {
    let (tw, th) = (target.0.max(1), target.1.max(1));
    let ratio = (width / tw).min(height / th);
    [8, 4, 2].into_iter().find(|&s| ratio >= s).unwrap_or(1)
}

thread_local! {
    /// Set by a warning that the data ended before the image did.
    static ENDED_EARLY: Cell<bool> = const { Cell::new(false) };
}

extern "C-unwind" fn on_message(cinfo: &mut jpeg_common_struct, level: c_int) {
    // SAFETY: libjpeg calls this with the structure whose `err` we installed; it stays valid for
    // the call.
    let code = unsafe { cinfo.err.as_ref() }.map_or(0, |err| err.msg_code);
    if level < 0 && code == JWRN_JPEG_EOF as c_int {
        ENDED_EARLY.with(|e| e.set(true));
    }
}

extern "C-unwind" fn on_error(cinfo: &mut jpeg_common_struct) {
    let mut text = [0u8; 80];
    // SAFETY: libjpeg calls this with the structure whose `err` we installed. `format_message`
    // writes at most JMSG_LENGTH_MAX (80) bytes, NUL included, into its buffer; the binding
    // declares the buffer shared, so it is called through the type that says it writes (the
    // `mozjpeg` crate does the same).
    let format = unsafe { cinfo.err.as_ref() }.and_then(|err| err.format_message);
    let message = match format {
        Some(format) => {
            type Writes = unsafe extern "C-unwind" fn(&mut jpeg_common_struct, &mut [u8; 80]);
            // SAFETY: the same function with the buffer's true mutability; the ABI is unchanged.
            let format: Writes = unsafe { std::mem::transmute(format) };
            // SAFETY: see above.
            unsafe { format(cinfo, &mut text) };
            let end = text.iter().position(|&c| c == 0).unwrap_or(text.len());
            String::from_utf8_lossy(&text[..end]).into_owned()
        }
        None => "libjpeg failed".to_owned(),
    };
    resume_unwind(Box::new(message));
}

fn error_manager() -> jpeg_error_mgr {
    // SAFETY: an all-zero `jpeg_error_mgr` is what libjpeg's own examples pass to
    // `jpeg_std_error`, which fills every field.
    let mut err: jpeg_error_mgr = unsafe { std::mem::zeroed() };
    // SAFETY: `err` is a valid, exclusive `jpeg_error_mgr`.
    unsafe { mozjpeg_sys::jpeg_std_error(&mut err) };
    err.error_exit = Some(on_error);
    err.emit_message = Some(on_message);
    err
}

/// Runs `f` over a decompressor of `encoded` that keeps APP1 (EXIF), turning libjpeg's errors
/// into [`ImageError`]s.
fn with_decompress<T>(
    encoded: &[u8],
    f: impl FnOnce(Decompress<&[u8]>) -> std::io::Result<T>,
) -> Result<T, ImageError> {
    ENDED_EARLY.with(|e| e.set(false));
    let run = catch_unwind(AssertUnwindSafe(|| {
        let decompress = mozjpeg::decompress::DecompressBuilder::new()
            .with_err(error_manager())
            .with_markers(&[Marker::APP(1)])
            .from_mem(encoded)?;
        f(decompress)
    }));
    let ended_early = ENDED_EARLY.with(Cell::get);
    match run {
        _ if ended_early => Err(ImageError::Truncated),
        Ok(Ok(value)) => Ok(value),
        Ok(Err(e)) => Err(ImageError::Corrupt(e.to_string())),
        Err(payload) => Err(ImageError::Corrupt(
            payload
                .downcast::<String>()
                .map_or_else(|_| "libjpeg failed".to_owned(), |m| *m),
        )),
    }
}

fn orientation(decompress: &Decompress<&[u8]>) -> Orientation {
    decompress
        .markers()
        .find_map(|m| match m.marker {
            Marker::APP(1) => m.data.strip_prefix(b"Exif\0\0"),
            _ => None,
        })
        .and_then(Orientation::from_exif_chunk)
        .unwrap_or(Orientation::NoTransforms)
}

/// A decoded JPEG: RGB8 pixels as stored (not yet turned upright) and the EXIF orientation.
#[derive(Debug)]
pub struct Decoded {
    /// The pixels, `width × height × 3`.
    pub pixels: image::RgbImage,
    /// The EXIF orientation, to apply.
    pub orientation: Orientation,
    /// The DCT scale denominator used (1 = full size).
    pub scale: u32,
}

/// Decodes `encoded` to RGB8 at the DCT scale `scale(&header)` returns (1, 2, 4 or 8), or `None`
/// for a CMYK or YCCK file (libjpeg does not convert those to RGB; the caller decodes them
/// another way). A file whose data ends before its image does is [`ImageError::Truncated`].
pub fn decode(
    encoded: &[u8],
    scale: impl FnOnce(&Header) -> Result<u32, ImageError>,
) -> Result<Option<Decoded>, ImageError> {
    let mut chosen = Ok(1);
    let decoded = with_decompress(encoded, |mut decompress| {
        if matches!(
            decompress.color_space(),
            J_COLOR_SPACE::JCS_CMYK | J_COLOR_SPACE::JCS_YCCK
        ) {
            return Ok(None);
        }
        let (width, height) = decompress.size();
        let header = Header {
            width: width as u32,
            height: height as u32,
            orientation: orientation(&decompress),
        };
        chosen = scale(&header);
        let denominator = match chosen {
            Ok(s @ (1 | 2 | 4 | 8)) => s,
            _ => return Ok(None),
        };
        decompress.scale((8 / denominator) as u8);
        let mut started = decompress.rgb()?;
        let (w, h) = (started.width(), started.height());
        let mut pixels = vec![0u8; w * h * 3];
        started.read_scanlines_into(&mut pixels)?;
        started.finish()?;
        let pixels =
            image::RgbImage::from_raw(w as u32, h as u32, pixels).expect("three bytes per pixel");
        Ok(Some(Decoded {
            pixels,
            orientation: header.orientation,
            scale: denominator,
        }))
    })?;
    chosen?;
    Ok(decoded)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_scale_is_pillows_draft_rule() {
        // `min(w // tw, h // th)` rounded down to 8, 4, 2 or 1.
        assert_eq!(draft_scale(2048, 1366, (1232, 812)), 1);
        assert_eq!(draft_scale(2048, 1366, (532, 364)), 2);
        assert_eq!(draft_scale(2048, 1366, (448, 308)), 4);
        assert_eq!(draft_scale(2048, 1366, (252, 168)), 8);
        assert_eq!(draft_scale(2048, 1366, (28, 28)), 8);
        assert_eq!(draft_scale(600, 2048, (300, 1000)), 2);
        assert_eq!(draft_scale(600, 2048, (301, 1000)), 1);
        assert_eq!(draft_scale(100, 100, (0, 0)), 8);
    }

    #[test]
    fn libjpegs_errors_are_errors_with_its_words() {
        // A frame of no components: a fatal error, unwound out of the C code and returned, on
        // every call (the decoder is not left poisoned).
        let empty = b"\xFF\xD8\xFF\xC0\x00\x08\x08\x00\x10\x00\x10\x00\xFF\xD9";
        for _ in 0..3 {
            let err = decode(empty, |_| Ok(1)).unwrap_err();
            match err {
                ImageError::Corrupt(message) => {
                    assert!(message.starts_with("Empty JPEG image"), "{message}")
                }
                other => panic!("{other:?}"),
            }
        }
        assert!(matches!(
            decode(b"\xFF\xD8", |_| Ok(1)),
            Err(ImageError::Truncated)
        ));
        assert!(matches!(
            decode(b"not a jpeg", |_| Ok(1)),
            Err(ImageError::Corrupt(_))
        ));
    }
}
