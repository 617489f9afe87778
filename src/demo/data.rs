//! The demo's data set: multimodal SFT records derived from real photos and easy-VQA, built once
//! and cached.
//!
//! The sources are embedded in the binary (`data/demo/`, with their attribution), so the demo
//! needs nothing but itself. Each record gets its own image, re-cropped, re-scaled to a realistic
//! size (256 to 2048 px on the long side, as SFT data has) and re-encoded: photos as JPEG
//! (quality 70 to 95) with a captioning turn, easy-VQA's 64×64 shapes as PNG with their real
//! question and answer. Everything follows from the seed, so two builds are identical.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use image::{DynamicImage, GenericImageView, imageops::FilterType};

/// Bumped whenever the derivation changes, so a stale cache is rebuilt.
const VERSION: &str = "feedstore demo data v1";

/// The embedded photos.
const PHOTOS: [(&str, &[u8]); 10] = [
    (
        "astronaut",
        include_bytes!("../../data/demo/photos/astronaut.png"),
    ),
    (
        "chelsea the cat",
        include_bytes!("../../data/demo/photos/chelsea.png"),
    ),
    (
        "a temple in China",
        include_bytes!("../../data/demo/photos/china.jpg"),
    ),
    (
        "a cup of coffee",
        include_bytes!("../../data/demo/photos/coffee.png"),
    ),
    (
        "a flower",
        include_bytes!("../../data/demo/photos/flower.jpg"),
    ),
    (
        "Grace Hopper",
        include_bytes!("../../data/demo/photos/grace_hopper.jpg"),
    ),
    (
        "the Hubble deep field",
        include_bytes!("../../data/demo/photos/hubble_deep_field.jpg"),
    ),
    (
        "a motorcycle",
        include_bytes!("../../data/demo/photos/motorcycle_left.png"),
    ),
    (
        "a retina",
        include_bytes!("../../data/demo/photos/retina.jpg"),
    ),
    (
        "a rocket launch",
        include_bytes!("../../data/demo/photos/rocket.jpg"),
    ),
];

/// The first 300 images of easy-VQA's test split and their questions.
const EASY_VQA: &[u8] = include_bytes!("../../data/demo/easy-vqa-test-300.tar.gz");

/// Aspect ratios (width, height) of the photo crops.
const ASPECTS: [(u32, u32); 5] = [(1, 1), (4, 3), (3, 4), (16, 9), (9, 16)];

/// A built data set.
#[derive(Debug, Clone)]
pub struct DataSet {
    /// The manifest (LLaVA-style JSONL; image paths relative to it).
    pub manifest: PathBuf,
    /// Records in it.
    pub records: u64,
    /// Bytes of encoded images.
    pub image_bytes: u64,
    /// Whether this run built it (false: reused from the cache).
    pub built: bool,
}

/// SplitMix64: the derivation's only source of randomness.
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// easy-VQA's questions and images.
struct EasyVqa {
    questions: Vec<(String, String, usize)>,
    images: Vec<DynamicImage>,
}

fn easy_vqa() -> anyhow::Result<EasyVqa> {
    let mut archive = tar::Archive::new(flate2::read::GzDecoder::new(EASY_VQA));
    let mut questions = None;
    let mut images = std::collections::BTreeMap::new();
    for entry in archive.entries()? {
        let mut entry = entry?;
        let path = entry.path()?.to_string_lossy().into_owned();
        let mut bytes = Vec::new();
        entry.read_to_end(&mut bytes)?;
        if path == "questions.json" {
            let parsed: Vec<(String, String, usize)> = serde_json::from_slice(&bytes)?;
            questions = Some(parsed);
        } else if let Some(id) = path
            .strip_prefix("images/")
            .and_then(|p| p.strip_suffix(".png"))
        {
            let id: usize = id.parse().context("easy-VQA image name")?;
            images.insert(id, image::load_from_memory(&bytes)?);
        }
    }
    let questions = questions.context("easy-VQA questions.json missing")?;
    let images: Vec<DynamicImage> = images.into_values().collect();
    if questions.iter().any(|q| q.2 >= images.len()) {
        bail!("easy-VQA subset: a question refers to a missing image");
    }
    Ok(EasyVqa { questions, images })
}

/// One record: its image file (encoded) and its JSONL line.
fn derive(
    i: u64,
    seed: u64,
    sides: (u32, u32),
    photos: &[(&str, DynamicImage)],
    vqa: &EasyVqa,
) -> anyhow::Result<(String, Vec<u8>, String)> {
    let r = |k: u64| mix(seed ^ mix(i.wrapping_mul(0x100) + k));
    let long = sides.0 + (r(1) % u64::from(sides.1 - sides.0 + 1)) as u32;
    let (file, bytes, human, answer) = if i.is_multiple_of(2) {
        let (question, answer, image) = &vqa.questions[(i / 2) as usize % vqa.questions.len()];
        let img = vqa.images[*image].resize_exact(long, long, FilterType::Triangle);
        let mut bytes = Vec::new();
        img.write_to(
            &mut std::io::Cursor::new(&mut bytes),
            image::ImageFormat::Png,
        )?;
        (
            format!("images/{i:05}.png"),
            bytes,
            question.clone(),
            answer.clone(),
        )
    } else {
        let (name, photo) = &photos[(i / 2) as usize % photos.len()];
        let (aw, ah) = ASPECTS[(r(2) % ASPECTS.len() as u64) as usize];
        let (pw, ph) = photo.dimensions();
        // The largest crop of this aspect, at a random place.
        let scale = (pw as f64 / aw as f64).min(ph as f64 / ah as f64);
        let (cw, ch) = ((aw as f64 * scale) as u32, (ah as f64 * scale) as u32);
        let x = (r(3) % u64::from(pw - cw + 1)) as u32;
        let y = (r(4) % u64::from(ph - ch + 1)) as u32;
        let (w, h) = if cw >= ch {
            (long, (long as u64 * ch as u64 / cw as u64).max(1) as u32)
        } else {
            ((long as u64 * cw as u64 / ch as u64).max(1) as u32, long)
        };
        let img = photo
            .crop_imm(x, y, cw, ch)
            .resize_exact(w, h, FilterType::Triangle)
            .into_rgb8();
        let quality = 70 + (r(5) % 26) as u8;
        let mut bytes = Vec::new();
        image::codecs::jpeg::JpegEncoder::new_with_quality(&mut bytes, quality)
            .encode_image(&img)?;
        (
            format!("images/{i:05}.jpg"),
            bytes,
            "Describe this photo.".to_owned(),
            format!("A photo of {name}, {w}x{h} pixels."),
        )
    };
    let line = serde_json::json!({
        "id": format!("demo-{i:05}"),
        "image": file,
        "conversations": [
            {"from": "human", "value": format!("<image>\n{human}")},
            {"from": "gpt", "value": answer},
        ],
    })
    .to_string();
    Ok((file, bytes, line))
}

/// The data set of `records` records in `dir`, images `sides.0` to `sides.1` px on their long
/// side: reused if a build with the same settings is there, else built (in parallel, with
/// progress on stderr) and left for next time.
pub fn build(dir: &Path, records: u64, seed: u64, sides: (u32, u32)) -> anyhow::Result<DataSet> {
    if sides.0 == 0 || sides.1 < sides.0 {
        bail!(
            "image sides {}-{}: expected 0 < LOW <= HIGH",
            sides.0,
            sides.1
        );
    }
    let stamp = format!(
        "{VERSION}\nrecords {records}\nseed {seed}\nsides {}-{}\n",
        sides.0, sides.1
    );
    let manifest = dir.join("data.jsonl");
    if std::fs::read_to_string(dir.join("STAMP")).is_ok_and(|s| s.starts_with(&stamp)) {
        let image_bytes = std::fs::read_dir(dir.join("images"))?
            .map(|e| Ok(e?.metadata()?.len()))
            .sum::<std::io::Result<u64>>()?;
        return Ok(DataSet {
            manifest,
            records,
            image_bytes,
            built: false,
        });
    }
    let started = Instant::now();
    eprintln!(
        "building the demo data set once ({records} records derived from 10 real photos and \
         easy-VQA: re-cropped, re-scaled to {}-{} px, re-encoded) in {}",
        sides.0,
        sides.1,
        dir.display()
    );
    let staging = dir.with_extension("building");
    let _ = std::fs::remove_dir_all(&staging);
    std::fs::create_dir_all(staging.join("images"))
        .with_context(|| format!("creating {}", staging.display()))?;
    let photos: Vec<(&str, DynamicImage)> = PHOTOS
        .iter()
        .map(|(name, bytes)| Ok((*name, image::load_from_memory(bytes)?)))
        .collect::<anyhow::Result<_>>()?;
    let vqa = easy_vqa()?;

    let (lines, image_bytes) = derive_all(&staging, records, seed, sides, &photos, &vqa)?;
    let mut out = std::io::BufWriter::new(std::fs::File::create(staging.join("data.jsonl"))?);
    for line in &lines {
        writeln!(out, "{line}")?;
    }
    out.flush()?;
    std::fs::write(staging.join("STAMP"), &stamp)?;
    let _ = std::fs::remove_dir_all(dir);
    std::fs::rename(&staging, dir)
        .with_context(|| format!("moving the data set into {}", dir.display()))?;
    eprintln!(
        "  built in {:.1} s: {records} images, {:.0} MB encoded",
        started.elapsed().as_secs_f64(),
        image_bytes as f64 / 1e6
    );
    Ok(DataSet {
        manifest,
        records,
        image_bytes,
        built: true,
    })
}

/// Derives `records` images into `staging/images` on every core, saying how far it got every
/// 2 s: each record's manifest line, in order, and the images' encoded bytes.
fn derive_all(
    staging: &Path,
    records: u64,
    seed: u64,
    sides: (u32, u32),
    photos: &[(&str, DynamicImage)],
    vqa: &EasyVqa,
) -> anyhow::Result<(Vec<String>, u64)> {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()) as u64;
    let done = AtomicU64::new(0);
    let bytes = AtomicU64::new(0);
    let lines: Vec<String> = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..threads)
            .map(|t| {
                let (done, bytes) = (&done, &bytes);
                scope.spawn(move || -> anyhow::Result<Vec<(u64, String)>> {
                    let mut lines = Vec::new();
                    for i in (t..records).step_by(threads as usize) {
                        let (file, encoded, line) = derive(i, seed, sides, photos, vqa)?;
                        std::fs::write(staging.join(&file), &encoded)?;
                        bytes.fetch_add(encoded.len() as u64, Ordering::Relaxed);
                        done.fetch_add(1, Ordering::Relaxed);
                        lines.push((i, line));
                    }
                    Ok(lines)
                })
            })
            .collect();
        let mut last = Instant::now();
        while workers.iter().any(|w| !w.is_finished()) {
            std::thread::sleep(Duration::from_millis(50));
            if last.elapsed() >= Duration::from_secs(2) {
                last = Instant::now();
                eprintln!(
                    "  {}/{records} images derived",
                    done.load(Ordering::Relaxed)
                );
            }
        }
        let mut lines = Vec::with_capacity(records as usize);
        for w in workers {
            lines.extend(w.join().expect("a data set worker panicked")?);
        }
        lines.sort_by_key(|(i, _)| *i);
        anyhow::Ok(lines.into_iter().map(|(_, l)| l).collect())
    })?;
    Ok((lines, bytes.load(Ordering::Relaxed)))
}

/// The data set's images in an S3 bucket: uploaded once (under a prefix named after the data
/// set's settings, with a `STAMP` object written last), and a manifest whose images are
/// `s3://` keys there.
pub fn to_s3(
    data: &DataSet,
    client: &aws_sdk_s3::Client,
    rt: &tokio::runtime::Runtime,
    bucket: &str,
) -> anyhow::Result<DataSet> {
    let dir = data
        .manifest
        .parent()
        .context("manifest without a folder")?;
    let stamp = std::fs::read(dir.join("STAMP"))?;
    let prefix = format!(
        "feedstore-demo-{:016x}",
        feedstore_proto::stream::sample_key(&[&stamp]) as u64
    );
    rt.block_on(async {
        if let Err(e) = client.create_bucket().bucket(bucket).send().await {
            let exists = e.as_service_error().is_some_and(|s| {
                s.is_bucket_already_owned_by_you() || s.is_bucket_already_exists()
            });
            if !exists {
                return Err(anyhow::anyhow!(
                    "creating bucket {bucket}: {}",
                    aws_sdk_s3::error::DisplayErrorContext(&e)
                ));
            }
        }
        let stamp_key = format!("{prefix}/STAMP");
        let uploaded = client
            .head_object()
            .bucket(bucket)
            .key(&stamp_key)
            .send()
            .await
            .is_ok();
        if !uploaded {
            let files: Vec<_> = std::fs::read_dir(dir.join("images"))?
                .map(|e| e.map(|e| e.path()))
                .collect::<std::io::Result<_>>()?;
            eprintln!(
                "uploading the data set's {} images to s3://{bucket}/{prefix}/ once",
                files.len()
            );
            for (i, path) in files.iter().enumerate() {
                let name = path
                    .file_name()
                    .and_then(|n| n.to_str())
                    .context("image name")?;
                client
                    .put_object()
                    .bucket(bucket)
                    .key(format!("{prefix}/images/{name}"))
                    .body(std::fs::read(path)?.into())
                    .send()
                    .await
                    .map_err(|e| {
                        anyhow::anyhow!(
                            "uploading {name}: {}",
                            aws_sdk_s3::error::DisplayErrorContext(&e)
                        )
                    })?;
                if (i + 1) % 64 == 0 {
                    eprintln!("  {}/{} uploaded", i + 1, files.len());
                }
            }
            client
                .put_object()
                .bucket(bucket)
                .key(&stamp_key)
                .body(stamp.clone().into())
                .send()
                .await
                .map_err(|e| anyhow::anyhow!("{}", aws_sdk_s3::error::DisplayErrorContext(&e)))?;
        }
        anyhow::Ok(())
    })?;
    let manifest = dir.join(format!("data-s3-{bucket}.jsonl"));
    let mut out = std::io::BufWriter::new(std::fs::File::create(&manifest)?);
    for line in std::fs::read_to_string(&data.manifest)?.lines() {
        let mut record: serde_json::Value = serde_json::from_str(line)?;
        let image = record["image"].as_str().context("record without image")?;
        record["image"] = format!("s3://{bucket}/{prefix}/{image}").into();
        writeln!(out, "{record}")?;
    }
    out.flush()?;
    Ok(DataSet {
        manifest,
        ..data.clone()
    })
}
