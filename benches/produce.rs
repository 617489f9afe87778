//! Producer CPU stage: decode + resize + normalise, samples per second on one core, against
//! Pillow + numpy, Pillow with `draft` + numpy (the DCT-scaled decode a careful Python user
//! writes) and SPDL (Meta's loader: FFmpeg decode + scale) doing the same transform on the same
//! images in the same run, at two output sizes (Qwen2.5-VL's default cap and 256 image tokens).
//!
//! Images are derived from the committed test photos (grace_hopper.jpg, rocket.jpg, chelsea.png):
//! each rescaled so its long side is 512, 1024 and 2048 px and re-encoded as JPEG (quality 90),
//! the sizes SFT data has. Both sides do: decode, convert to RGB, Qwen-VL smart resize (bicubic) to
//! 28-pixel multiples within 56²..1280·28² pixels, scale to 0..1, CLIP mean/std, CHW f32.
//!
//! Then the tokenize stage: a conversation rendered with Qwen3's chat template (minijinja), its
//! image expanded, tokenized and labelled, against the tokenizer alone on the finished text (the
//! floor any renderer pays; what the hand-written Qwen3 renderer this replaced cost) and against
//! Python `transformers` (`apply_chat_template` + the processor's expansion + the fast tokenizer)
//! in the same run.
//!
//! Run: `cargo bench --bench produce` (needs `pip install pillow numpy` for the image baselines,
//! `spdl` with FFmpeg's libraries for SPDL's, and `transformers` for the tokenize baseline;
//! `FEEDSTORE_BENCH_PYTHON` names another interpreter, a venv's, for all). The whole process is
//! pinned to one core.

use std::hint::black_box;
use std::process::Command;
use std::time::Instant;

use feedstore_producer::chat::{ChatTokenizer, Message, Role};
use feedstore_producer::jpeg;
use feedstore_producer::vision::{ImageTransform, ResizeMode, Scratch};

mod common;
use common::derive_images;

const PYTHON: &str = r#"
import io, math, sys, time
import numpy as np

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
mode, rounds, max_pixels, paths = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
data = [open(p, "rb").read() for p in paths]

def normalise(rgb):
    x = np.asarray(rgb, dtype=np.float32) / 255.0
    return np.ascontiguousarray(((x - mean) / std).transpose(2, 0, 1))

if mode == "spdl":
    import spdl.io
    def one(b):
        packets = spdl.io.demux_image(b)
        h, w = smart_resize(packets.codec.height, packets.codec.width, max_pixels=max_pixels)
        frames = spdl.io.decode_packets(
            packets, filter_desc=f"scale=w={w}:h={h}:flags=bicubic,format=pix_fmts=rgb24")
        return normalise(spdl.io.to_numpy(spdl.io.convert_frames(frames)))
else:
    from PIL import Image
    def one(b):
        im = Image.open(io.BytesIO(b))
        h, w = smart_resize(im.height, im.width, max_pixels=max_pixels)
        if mode == "draft":
            im.draft("RGB", (w, h))
        return normalise(im.convert("RGB").resize((w, h), Image.BICUBIC))

n, start = 0, time.perf_counter()
for _ in range(rounds):
    for b in data:
        one(b)
        n += 1
print(n / (time.perf_counter() - start))
"#;

/// One row of the image table: a pipeline's samples per second, or why it did not run.
struct Row {
    name: &'static str,
    rate: Result<f64, String>,
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let rounds = if quick { 2 } else { 8 };
    // One core for every pipeline: this process and the Python it starts (which inherits the
    // mask), so a decoder's own threads cannot spread.
    pin_to_one_core();
    let dir = std::env::temp_dir().join(format!("feedstore-bench-images-{}", std::process::id()));
    let paths = derive_images(&dir);
    let data: Vec<Vec<u8>> = paths.iter().map(|p| std::fs::read(p).unwrap()).collect();

    for (label, max_pixels) in [
        (
            "Qwen2.5-VL's default, at most 1280 image tokens (1280·28² px)",
            1280 * 28 * 28,
        ),
        (
            "at most 256 image tokens (256·28² px, about 448×448)",
            256 * 28 * 28,
        ),
    ] {
        let transform = ImageTransform {
            resize: ResizeMode::QwenVl {
                min_pixels: 56 * 56,
                max_pixels,
                factor: 28,
            },
            ..ImageTransform::qwen_vl()
        };
        let full = ImageTransform {
            jpeg_draft: false,
            ..transform.clone()
        };
        let [ours, ours_full] = feedstore_rates([&transform, &full], &data, rounds);
        let baseline = |mode: &str| python_rate(mode, rounds, max_pixels, &paths);
        let rows = [
            Row {
                name: "Pillow + numpy (baseline)",
                rate: baseline("plain"),
            },
            Row {
                name: "Pillow with `draft` + numpy",
                rate: baseline("draft"),
            },
            Row {
                name: "SPDL (FFmpeg decode + bicubic scale) + numpy",
                rate: baseline("spdl"),
            },
            Row {
                name: "feedstore, every pixel decoded (`jpeg_draft` off)",
                rate: Ok(ours_full),
            },
            Row {
                name: "feedstore (libjpeg-turbo at the DCT scale, fast_image_resize, LUT normalise)",
                rate: Ok(ours),
            },
        ];
        println!(
            "## decode + resize + normalise, one core: {label} ({} derived JPEGs, long side 512-2048 px, {rounds} rounds)",
            paths.len()
        );
        println!();
        println!("| pipeline | samples/s | vs Pillow + numpy | vs Pillow with draft |");
        println!("|---|---|---|---|");
        let ratio = |rate: f64, row: usize| match &rows[row].rate {
            Ok(base) => format!("{:.2}x", rate / base),
            Err(_) => "-".into(),
        };
        for row in &rows {
            match &row.rate {
                Ok(rate) => println!(
                    "| {} | {rate:.1} | {} | {} |",
                    row.name,
                    ratio(*rate, 0),
                    ratio(*rate, 1)
                ),
                Err(why) => println!("| {} | not run: {why} | | |", row.name),
            }
        }
        println!();
    }
    decoders(&paths, &data, rounds);
    stages(&data, rounds);
    let _ = std::fs::remove_dir_all(&dir);
    tokenize(quick);
}

/// The decoder choice: milliseconds per JPEG, decode to RGB only, by long side: zune-jpeg and
/// libjpeg-turbo (mozjpeg-sys's build) decoding every pixel, and libjpeg-turbo at the DCT scale
/// a 256-token output allows.
fn decoders(paths: &[std::path::PathBuf], data: &[Vec<u8>], rounds: usize) {
    let small = ImageTransform {
        resize: ResizeMode::QwenVl {
            min_pixels: 56 * 56,
            max_pixels: 256 * 28 * 28,
            factor: 28,
        },
        ..ImageTransform::qwen_vl()
    };
    let time = |f: &mut dyn FnMut(&[u8])| {
        let mut per_side = std::collections::BTreeMap::<u32, (f64, u32)>::new();
        for (path, bytes) in paths.iter().zip(data) {
            let side: u32 = path
                .file_stem()
                .and_then(|s| s.to_str())
                .and_then(|s| s.rsplit('-').next())
                .and_then(|s| s.parse().ok())
                .unwrap();
            let started = Instant::now();
            for _ in 0..rounds * 2 {
                f(bytes);
            }
            let entry = per_side.entry(side).or_default();
            entry.0 += started.elapsed().as_secs_f64() * 1e3 / (rounds * 2) as f64;
            entry.1 += 1;
        }
        per_side
            .into_iter()
            .map(|(side, (ms, n))| (side, ms / f64::from(n)))
            .collect::<Vec<_>>()
    };
    let zune = time(&mut |bytes| {
        let options = zune_core::options::DecoderOptions::default()
            .jpeg_set_out_colorspace(zune_core::colorspace::ColorSpace::RGB);
        let mut decoder = zune_jpeg::JpegDecoder::new_with_options(
            zune_core::bytestream::ZCursor::new(bytes),
            options,
        );
        black_box(decoder.decode().unwrap());
    });
    let full = time(&mut |bytes| {
        black_box(jpeg::decode(bytes, |_| Ok(1)).unwrap());
    });
    let scaled = time(&mut |bytes| {
        black_box(
            jpeg::decode(bytes, |h| {
                let target = small.target_size(h.width, h.height)?;
                Ok(jpeg::draft_scale(h.width, h.height, target))
            })
            .unwrap(),
        );
    });
    println!("## JPEG decode only, ms per image, one core (the decoder choice)");
    println!();
    println!(
        "| long side | zune-jpeg 0.5 | libjpeg-turbo (mozjpeg-sys) | libjpeg-turbo at the DCT scale for 256 tokens |"
    );
    println!("|---|---|---|---|");
    for ((side, z), ((_, f), (_, s))) in zune.iter().zip(full.iter().zip(&scaled)) {
        println!("| {side} px | {z:.2} | {f:.2} | {s:.2} |");
    }
    println!();
}

/// Where one image's time goes, at Qwen2.5-VL's default cap (1280 tokens): the decode, the
/// resize alone (u8 HWC output, which the resize writes straight into the destination), and
/// the resize with the pass that normalises, converts to f32 and lays out CHW, against the
/// floor of that pass: writing its output (`memset` of the same bytes into the same buffer).
fn stages(data: &[Vec<u8>], rounds: usize) {
    use feedstore_proto::sample::{DType, TensorLayout};
    let f32_chw = ImageTransform::qwen_vl();
    let u8_hwc = ImageTransform {
        dtype: DType::U8,
        layout: TensorLayout::Hwc,
        ..f32_chw.clone()
    };
    let mut scratch = Scratch::default();
    // The f32 output as bytes, 4-aligned as the store's regions are.
    let (mut dst, mut out_f32) = (Vec::new(), Vec::<f32>::new());
    let mut ms = [0f64; 4];
    for round in 0..=rounds {
        for bytes in data {
            let t = Instant::now();
            let decoded = f32_chw.decode(bytes).unwrap();
            let decode = t.elapsed();
            let (w, h) = decoded.target;
            let pixels = (w * h) as usize;
            dst.resize(pixels * 3, 0);
            let t = Instant::now();
            u8_hwc
                .resize_into(&decoded.rgb, decoded.target, &mut dst, &mut scratch)
                .unwrap();
            let resize = t.elapsed();
            out_f32.resize(pixels * 3, 0.0);
            let out: &mut [u8] = bytemuck::cast_slice_mut(&mut out_f32);
            let t = Instant::now();
            f32_chw
                .resize_into(&decoded.rgb, decoded.target, out, &mut scratch)
                .unwrap();
            let both = t.elapsed();
            black_box((&dst, &out));
            let t = Instant::now();
            out.fill(black_box(1));
            let floor = t.elapsed();
            black_box(&out);
            if round > 0 {
                for (sum, d) in ms.iter_mut().zip([decode, resize, both, floor]) {
                    *sum += d.as_secs_f64() * 1e3;
                }
            }
        }
    }
    let [decode, resize, both, floor] = ms.map(|m| m / (rounds * data.len()) as f64);
    println!(
        "## where one image's time goes, one core, at most 1280 image tokens (ms per image, mean)"
    );
    println!();
    println!(
        "| decode (libjpeg-turbo at the DCT scale) | resize (u8 HWC, written in place) | resize + normalise to f32 CHW | the normalise pass | writing its output (memset floor) |"
    );
    println!("|---|---|---|---|---|");
    println!(
        "| {decode:.2} | {resize:.2} | {both:.2} | {:.2} | {floor:.2} |",
        both - resize
    );
    println!();
}

/// feedstore's decode, resize and normalise on this thread, into a reused destination buffer
/// (the shared-memory region in the producer): samples per second for each transform, measured
/// in alternating rounds after one untimed round each (buffers, tables and caches warm).
fn feedstore_rates<const N: usize>(
    transforms: [&ImageTransform; N],
    data: &[Vec<u8>],
    rounds: usize,
) -> [f64; N] {
    let mut scratch = Scratch::default();
    // f32 elements, so the bytes are aligned as the store's regions are.
    let mut dst = Vec::<f32>::new();
    let mut seconds = [0f64; N];
    for round in 0..=rounds {
        for (t, transform) in transforms.iter().enumerate() {
            let started = Instant::now();
            for bytes in data {
                let decoded = transform.decode(bytes).unwrap();
                let (w, h) = decoded.target;
                dst.resize((w * h * 3) as usize, 0.0);
                transform
                    .resize_into(
                        &decoded.rgb,
                        decoded.target,
                        bytemuck::cast_slice_mut(&mut dst),
                        &mut scratch,
                    )
                    .unwrap();
                black_box(&dst);
            }
            if round > 0 {
                seconds[t] += started.elapsed().as_secs_f64();
            }
        }
    }
    seconds.map(|s| (rounds * data.len()) as f64 / s)
}

/// A Python baseline's samples per second: `plain` Pillow, Pillow with `draft`, or `spdl`.
fn python_rate(
    mode: &str,
    rounds: usize,
    max_pixels: u64,
    paths: &[std::path::PathBuf],
) -> Result<f64, String> {
    let out = Command::new(python())
        .arg("-c")
        .arg(PYTHON)
        .args([mode.to_string(), rounds.to_string(), max_pixels.to_string()])
        .args(paths)
        // This machine sets OpenBLAS overrides that slow a current numpy; the baseline runs
        // without them, as a user's would.
        .env_remove("OPENBLAS_CORETYPE")
        .env_remove("OPENBLAS_L2_SIZE")
        .env("OMP_NUM_THREADS", "1")
        .env("OPENBLAS_NUM_THREADS", "1")
        .output()
        .map_err(|e| format!("{} not runnable: {e}", python()))?;
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        return Err(stderr.trim().lines().last().unwrap_or("failed").to_string());
    }
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse::<f64>()
        .map_err(|e| e.to_string())
}

/// Restricts this process (and what it starts) to the first CPU it may run on.
fn pin_to_one_core() {
    let allowed = nix::sched::sched_getaffinity(nix::unistd::Pid::from_raw(0)).unwrap();
    let first = (0..nix::sched::CpuSet::count())
        .find(|&c| allowed.is_set(c).unwrap_or(false))
        .unwrap();
    let mut one = nix::sched::CpuSet::new();
    one.set(first).unwrap();
    nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &one).unwrap();
}

fn python() -> String {
    std::env::var("FEEDSTORE_BENCH_PYTHON").unwrap_or_else(|_| "python3".into())
}

const TRANSFORMERS: &str = r#"
import json, sys, time
from transformers import PreTrainedTokenizerFast
tok = PreTrainedTokenizerFast(tokenizer_file=sys.argv[1])
template, rounds = open(sys.argv[2]).read(), int(sys.argv[3])
cases = json.loads(sys.argv[4])
out = []
for messages, pads in cases:
    start = time.perf_counter()
    for _ in range(rounds):
        text = tok.apply_chat_template(messages, chat_template=template, tokenize=False)
        for n in pads:
            text = text.replace("<image>", "<|vision_start|>" + "<|image_pad|>" * n + "<|vision_end|>", 1)
        tok(text, add_special_tokens=False, return_offsets_mapping=True)
    out.append((time.perf_counter() - start) / rounds * 1e6)
print(json.dumps(out))
"#;

/// Microseconds per conversation: feedstore's encode, the tokenizer alone on the finished text,
/// and Python transformers.
fn tokenize(quick: bool) {
    let json = common::tokenizer_json();
    let chat = ChatTokenizer::from_bytes(&json, 1 << 20).unwrap();
    let plain = tokenizers::Tokenizer::from_bytes(&json).unwrap();
    let m = |role: Role, content: &str| Message::new(role, content);
    let cases: Vec<(&str, Vec<Message>, Vec<usize>)> = vec![
        (
            "VQA: one image (256 tokens), one reply",
            vec![
                m(
                    Role::User,
                    "<image>\nWhat is the person in the picture holding?",
                ),
                m(Role::Assistant, "A book with a red cover."),
            ],
            vec![256],
        ),
        (
            "system + 4 turns, one image (256 tokens)",
            vec![
                m(Role::System, "You are a careful visual assistant."),
                m(Role::User, "<image>\nDescribe the scene."),
                m(
                    Role::Assistant,
                    "A rocket on a launch pad under a clear sky, with service towers on both sides.",
                ),
                m(Role::User, "Is it day or night?"),
                m(
                    Role::Assistant,
                    "Day: the sky is bright blue and the shadows are short.",
                ),
            ],
            vec![256],
        ),
        (
            "text, 8 turns",
            (0..8)
                .map(|i| {
                    if i % 2 == 0 {
                        m(Role::User, &format!("Question {i}: what is {i} times {i}?"))
                    } else {
                        m(
                            Role::Assistant,
                            &format!("The answer is {}.", (i - 1) * (i - 1)),
                        )
                    }
                })
                .collect(),
            vec![],
        ),
        (
            "text, 400 turns (replies found by markers)",
            (0..400)
                .map(|i| {
                    if i % 2 == 0 {
                        m(Role::User, &format!("Step {i}: run the next tool."))
                    } else {
                        m(Role::Assistant, &format!("Ran it; result {i}."))
                    }
                })
                .collect(),
            vec![],
        ),
    ];
    let rounds = if quick { 20 } else { 200 };
    let time = |f: &mut dyn FnMut()| {
        for _ in 0..rounds / 10 {
            f();
        }
        let started = Instant::now();
        for _ in 0..rounds {
            f();
        }
        started.elapsed().as_secs_f64() / rounds as f64 * 1e6
    };
    let dir = std::env::temp_dir().join(format!("feedstore-bench-tok-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let tokenizer_path = dir.join("tokenizer.json");
    std::fs::write(&tokenizer_path, &json).unwrap();
    let template_path = dir.join("qwen3.jinja");
    std::fs::write(&template_path, feedstore_producer::template::QWEN3).unwrap();
    let python_cases: Vec<serde_json::Value> = cases
        .iter()
        .map(|(_, messages, pads)| {
            let messages: Vec<_> = messages
                .iter()
                .map(|m| serde_json::json!({"role": m.role.name(), "content": m.content}))
                .collect();
            serde_json::json!([messages, pads])
        })
        .collect();
    let python_rounds = (rounds / 2).to_string();
    let hf: Option<Vec<f64>> = Command::new(python())
        .args(["-c", TRANSFORMERS])
        .arg(&tokenizer_path)
        .arg(&template_path)
        .arg(&python_rounds)
        .arg(serde_json::Value::from(python_cases).to_string())
        .env("TOKENIZERS_PARALLELISM", "false")
        .env("RAYON_NUM_THREADS", "1")
        .output()
        .ok()
        .filter(|out| {
            if !out.status.success() {
                eprintln!(
                    "transformers baseline not run (pip install transformers): {}",
                    String::from_utf8_lossy(&out.stderr)
                        .lines()
                        .last()
                        .unwrap_or("")
                );
            }
            out.status.success()
        })
        .and_then(|out| serde_json::from_slice(&out.stdout).ok());
    let _ = std::fs::remove_dir_all(&dir);

    println!();
    println!(
        "## tokenize: chat template + image expansion + tokenizer + labels, one core ({rounds} rounds)"
    );
    println!();
    println!(
        "| conversation | feedstore (minijinja) µs | tokenizer alone µs | template + labels share | transformers µs | vs transformers |"
    );
    println!("|---|---|---|---|---|---|");
    for (i, (name, messages, pads)) in cases.iter().enumerate() {
        let ours = time(&mut || {
            black_box(chat.encode(messages, pads).unwrap());
        });
        // The same finished text, tokenized alone.
        let text = {
            let encoded = chat.encode(messages, pads).unwrap();
            plain.decode(&encoded.ids, false).unwrap()
        };
        let alone = time(&mut || {
            black_box(plain.encode(text.as_str(), false).unwrap());
        });
        let share = (ours - alone) / ours * 100.0;
        match hf.as_ref().and_then(|hf| hf.get(i)) {
            Some(hf) => println!(
                "| {name} | {ours:.1} | {alone:.1} | {share:.0}% | {hf:.1} | {:.1}x |",
                hf / ours
            ),
            None => println!("| {name} | {ours:.1} | {alone:.1} | {share:.0}% | not run | |"),
        }
    }
}
