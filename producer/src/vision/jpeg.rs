//! JPEG decoding with libjpeg-turbo's decoder (MozJPEG's fork of it, built from source by
//! `mozjpeg-sys`; its decoder is libjpeg-turbo's, the one Pillow links, and its RGB equalled
//! Pillow's byte for byte on the test photos), with DCT-domain scaling: a JPEG decoded straight
//! to 1/2, 1/4 or 1/8 of its size costs far less than every pixel decoded and then shrunk.
//! [`decode`] picks the scale as Pillow's `Image.draft` does.
//!
//! libjpeg reports a fatal error through `error_exit`, which must not return: ours unwinds with
//! [`std::panic::resume_unwind`] and a payload of our own type (no panic hook runs, nothing is
//! printed), `mozjpeg-sys` builds the C code to let unwinds pass, and [`decode`] catches that
//! payload as an error (any other panic goes on unwinding). Warnings are silent, as in Pillow,
//! but three things are watched:
//! - more than [`MAX_SCANS`] scans ends the decode: libjpeg has no limit of its own, and a
//!   progressive file of thousands of tiny scans, each making the decoder visit every block,
//!   would hold a worker for minutes;
//! - data that ends before the image does makes the image [`ImageError::Truncated`] rather than
//!   padded with grey: the end-of-data warning with entropy-coded data cut short, or in a file
//!   of several scans (a progressive file cut between scans); a file that lacks only its final
//!   EOI marker decodes, as it does in Pillow;
//! - the EXIF orientation is read by [`exif_orientation`] from the first APP1 segment before the
//!   first scan, not from libjpeg's saved markers (which would keep every APP1 segment in the
//!   file, each small one costing a hundred bytes of allocations).

use std::cell::Cell;
use std::os::raw::c_int;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};

use image::metadata::Orientation;
use mozjpeg::Decompress;
use mozjpeg_sys::{
    J_COLOR_SPACE, JERR_FILE_READ, JTRC_SOS, JWRN_HIT_MARKER, JWRN_JPEG_EOF, jpeg_common_struct,
    jpeg_error_mgr,
};

use super::ImageError;

/// The most scans a JPEG may have (zune-jpeg's default cap too; encoders write a dozen or so).
pub const MAX_SCANS: u32 = 100;

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
/// down to a power of two no larger than 8. `target` is in the stored orientation (a Pillow user
/// who passes `draft` the upright size of a rotated photo may get another scale).
pub fn draft_scale(width: u32, height: u32, target: (u32, u32)) -> u32 {
    let (tw, th) = (target.0.max(1), target.1.max(1));
    let ratio = (width / tw).min(height / th);
    [8, 4, 2].into_iter().find(|&s| ratio >= s).unwrap_or(1)
}

/// The EXIF orientation in the first `Exif` APP1 segment before the first scan (none: upright).
pub fn exif_orientation(encoded: &[u8]) -> Orientation {
    let mut at = 2; // past SOI
    while let Some(&[0xFF, marker]) = encoded.get(at..at + 2) {
        match marker {
            0xFF => at += 1, // fill byte
            0x01 | 0xD0..=0xD8 => at += 2,
            0xD9 | 0xDA => break, // the end, or the first scan
            _ => {
                let Some(&[hi, lo]) = encoded.get(at + 2..at + 4) else {
                    break;
                };
                let len = usize::from(u16::from_be_bytes([hi, lo])).max(2);
                let Some(body) = encoded.get(at + 4..at + 2 + len) else {
                    break;
                };
                if marker == 0xE1
                    && let Some(tiff) = body.strip_prefix(b"Exif\0\0")
                {
                    return Orientation::from_exif_chunk(tiff).unwrap_or(Orientation::NoTransforms);
                }
                at += 2 + len;
            }
        }
    }
    Orientation::NoTransforms
}

/// What the callbacks saw during one decode on this thread.
#[derive(Debug, Default, Clone, Copy)]
struct Seen {
    /// The data ended: libjpeg's source was asked for bytes past the end.
    ended: bool,
    /// Entropy-coded data stopped before the bits the decoder needed.
    cut_short: bool,
    /// Scans started.
    scans: u32,
}

thread_local! {
    static SEEN: Cell<Seen> = Cell::new(Seen::default());
}

/// The payload our callbacks unwind with: libjpeg's message, and whether it means the data
/// ended early.
struct LibjpegFailed {
    message: String,
    ended: bool,
}

/// libjpeg's longest formatted message, NUL included (`JMSG_LENGTH_MAX` in its `jpeglib.h`; the
/// Rust binding's signature says 80).
const MESSAGE_BYTES: usize = 200;

extern "C-unwind" fn on_message(cinfo: &mut jpeg_common_struct, level: c_int) {
    // SAFETY: libjpeg calls this with the structure whose `err` we installed; it stays valid for
    // the call.
    let code = unsafe { cinfo.err.as_ref() }.map_or(0, |err| err.msg_code);
    let mut seen = SEEN.with(Cell::get);
    if level < 0 && code == JWRN_JPEG_EOF as c_int {
        seen.ended = true;
    } else if level < 0 && code == JWRN_HIT_MARKER as c_int {
        seen.cut_short = true;
    } else if level > 0 && code == JTRC_SOS as c_int {
        seen.scans += 1;
    }
    SEEN.with(|s| s.set(seen));
    if seen.scans > MAX_SCANS {
        resume_unwind(Box::new(LibjpegFailed {
            message: format!("more than {MAX_SCANS} scans (progressive files have about 10)"),
            ended: false,
        }));
    }
}

extern "C-unwind" fn on_error(cinfo: &mut jpeg_common_struct) {
    // SAFETY: as in `on_message`.
    let err = unsafe { cinfo.err.as_ref() };
    let code = err.map_or(0, |err| err.msg_code);
    let message = match err.and_then(|err| err.format_message) {
        Some(format) => {
            let mut text = [0u8; MESSAGE_BYTES];
            type Writes = unsafe extern "C-unwind" fn(*mut jpeg_common_struct, *mut u8);
            // SAFETY: the same C function, `void format_message(j_common_ptr, char *buffer)`,
            // through a signature that says what it does: it writes up to JMSG_LENGTH_MAX
            // bytes, NUL included (the binding's type says a shared 80-byte array). Same ABI.
            let format: Writes = unsafe { std::mem::transmute(format) };
            // SAFETY: `cinfo` is valid for the call and `text` holds JMSG_LENGTH_MAX bytes.
            unsafe { format(cinfo, text.as_mut_ptr()) };
            let end = text.iter().position(|&c| c == 0).unwrap_or(text.len());
            String::from_utf8_lossy(&text[..end]).into_owned()
        }
        None => format!("libjpeg error {code}"),
    };
    resume_unwind(Box::new(LibjpegFailed {
        message,
        // The source fails a skip past the end of the data with a read error.
        ended: code == JERR_FILE_READ as c_int,
    }));
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

/// Runs `f` over a decompressor of `encoded`, turning libjpeg's errors into [`ImageError`]s.
fn with_decompress<T>(
    encoded: &[u8],
    f: impl FnOnce(Decompress<&[u8]>) -> std::io::Result<T>,
) -> Result<T, ImageError> {
    SEEN.with(|s| s.set(Seen::default()));
    let run = catch_unwind(AssertUnwindSafe(|| {
        let decompress = mozjpeg::decompress::DecompressBuilder::new()
            .with_err(error_manager())
            .from_mem(encoded)?;
        f(decompress)
    }));
    let seen = SEEN.with(Cell::get);
    let truncated = seen.ended && (seen.cut_short || seen.scans != 1);
    match run {
        Ok(_) if truncated => Err(ImageError::Truncated),
        Ok(Ok(value)) => Ok(value),
        Ok(Err(e)) => Err(ImageError::Corrupt(e.to_string())),
        Err(payload) => match payload.downcast::<LibjpegFailed>() {
            Ok(failed) if failed.ended || truncated => Err(ImageError::Truncated),
            Ok(failed) => Err(ImageError::Corrupt(failed.message)),
            Err(other) => resume_unwind(other),
        },
    }
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
            orientation: exif_orientation(encoded),
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
