//! Producer CPU stage: decode + resize + normalise, samples per second on one core, against
//! Pillow + numpy doing the same transform on the same images in the same run.
//!
//! Images are derived from the committed test photos (grace_hopper.jpg, rocket.jpg, chelsea.png):
//! each rescaled so its long side is 512, 1024 and 2048 px and re-encoded as JPEG (quality 90),
//! the sizes SFT data has. Both sides do: decode, convert to RGB, Qwen-VL smart resize (bicubic) to
//! 28-pixel multiples within 56²..1280·28² pixels, scale to 0..1, CLIP mean/std, CHW f32.
//!
//! Run: `cargo bench --bench produce` (needs `pip install pillow numpy` for the baseline).

use std::hint::black_box;
use std::process::Command;
use std::time::Instant;

use feedstore_producer::vision::{ImageTransform, Scratch};

mod common;
use common::derive_images;

const PYTHON: &str = r#"
import math, sys, time
import numpy as np
from PIL import Image

def smart_resize(h, w, factor=28, min_pixels=56*56, max_pixels=14*14*4*1280):
    hb = max(factor, round(h / factor) * factor)
    wb = max(factor, round(w / factor) * factor)
    if hb * wb > max_pixels:
        beta = math.sqrt(h * w / max_pixels)
        hb = math.floor(h / beta / factor) * factor
        wb = math.floor(w / beta / factor) * factor
    elif hb * wb < min_pixels:
        beta = math.sqrt(min_pixels / (h * w))
        hb = math.ceil(h * beta / factor) * factor
        wb = math.ceil(w * beta / factor) * factor
    return hb, wb

mean = np.array([0.48145466, 0.4578275, 0.40821073], dtype=np.float32)
std = np.array([0.26862954, 0.26130258, 0.27577711], dtype=np.float32)
paths, rounds = sys.argv[2:], int(sys.argv[1])
data = [open(p, "rb").read() for p in paths]
import io
n, start = 0, time.perf_counter()
for _ in range(rounds):
    for b in data:
        im = Image.open(io.BytesIO(b)).convert("RGB")
        h, w = smart_resize(im.height, im.width)
        x = np.asarray(im.resize((w, h), Image.BICUBIC), dtype=np.float32) / 255.0
        x = np.ascontiguousarray(((x - mean) / std).transpose(2, 0, 1))
        n += 1
print(n / (time.perf_counter() - start))
"#;

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let rounds = if quick { 2 } else { 8 };
    let dir = std::env::temp_dir().join(format!("feedstore-bench-images-{}", std::process::id()));
    let paths = derive_images(&dir);
    let data: Vec<Vec<u8>> = paths.iter().map(|p| std::fs::read(p).unwrap()).collect();

    // feedstore: one thread, into a reused destination buffer (the shared-memory region in the
    // producer).
    let transform = ImageTransform::qwen_vl();
    let mut scratch = Scratch::default();
    let mut dst = Vec::new();
    let mut n = 0u64;
    let started = Instant::now();
    for _ in 0..rounds {
        for bytes in &data {
            let rgb = transform.decode(bytes).unwrap();
            let target = transform.target_size(rgb.width(), rgb.height()).unwrap();
            dst.resize((target.0 * target.1 * 3 * 4) as usize, 0u8);
            transform
                .resize_into(&rgb, target, &mut dst, &mut scratch)
                .unwrap();
            black_box(&dst);
            n += 1;
        }
    }
    let ours = n as f64 / started.elapsed().as_secs_f64();

    let python = Command::new("python3")
        .arg("-c")
        .arg(PYTHON)
        .arg(rounds.to_string())
        .args(&paths)
        // This machine sets OpenBLAS overrides that slow a current numpy; the baseline runs
        // without them, as a user's would.
        .env_remove("OPENBLAS_CORETYPE")
        .env_remove("OPENBLAS_L2_SIZE")
        .env("OMP_NUM_THREADS", "1")
        .env("OPENBLAS_NUM_THREADS", "1")
        .output();
    let pil = match python {
        Ok(out) if out.status.success() => String::from_utf8_lossy(&out.stdout)
            .trim()
            .parse::<f64>()
            .ok(),
        Ok(out) => {
            eprintln!(
                "Pillow baseline failed (pip install pillow numpy): {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
            None
        }
        Err(e) => {
            eprintln!("python3 not runnable: {e}");
            None
        }
    };
    println!(
        "## decode + resize + normalise, one core ({} derived JPEGs, long side 512-2048 px, {rounds} rounds)",
        paths.len()
    );
    println!();
    println!("| pipeline | samples/s | vs Pillow + numpy |");
    println!("|---|---|---|");
    if let Some(pil) = pil {
        println!("| Pillow + numpy (baseline) | {pil:.1} | 1.00x |");
        println!(
            "| feedstore (zune-jpeg, fast_image_resize, LUT normalise) | {ours:.1} | {:.2}x |",
            ours / pil
        );
    } else {
        println!(
            "| feedstore (zune-jpeg, fast_image_resize, LUT normalise) | {ours:.1} | baseline not run |"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
