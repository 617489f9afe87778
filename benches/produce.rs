//! Producer CPU stage: decode + resize + normalise, samples per second on one core, against
//! Pillow + numpy doing the same transform on the same images in the same run.
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
//! Run: `cargo bench --bench produce` (needs `pip install pillow numpy` for the image baseline and
//! `transformers` for the tokenize baseline; `FEEDSTORE_BENCH_PYTHON` names another interpreter,
//! a venv's, for both).

use std::hint::black_box;
use std::process::Command;
use std::time::Instant;

use feedstore_producer::chat::{ChatTokenizer, Message, Role};
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

    let python = Command::new(python())
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
    tokenize(quick);
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
    use std::io::Read;
    let gz = std::fs::read(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/producer/tests/data/qwen3-tokenizer.json.gz"
    ))
    .unwrap();
    let mut json = Vec::new();
    flate2::read::GzDecoder::new(&gz[..])
        .read_to_end(&mut json)
        .unwrap();
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
