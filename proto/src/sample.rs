//! Samples: the layout of one training sample inside a store object.
//!
//! A producer writes each sample **once**, straight into shared memory; a trainer reads it in
//! place. The object is laid out so that the bulk of it — image tensors, token ids, labels — is
//! plain little-endian arrays at 64-byte-aligned offsets, written directly by the decode/resize
//! and tokenize stages, and readable as typed slices (`&[f32]`, `&[u32]`, ...) without a copy.
//! Only the small part — id, source keys, tensor descriptors, image grids, metadata — is an rkyv
//! archive, serialised (`to_bytes_in`) straight into the object after the arrays:
//!
//! ```text
//! offset 0     64-byte header: magic "FSSAMPL1", version, archive offset and length
//! offset 64    region 0 (e.g. image 0, f32 CHW), 64-byte aligned
//!              region 1 (token ids, u32 LE), region 2 (labels, i32 LE, -100 = ignored), ...
//!              rkyv archive of `SampleMeta`, 64-byte aligned, root at its end
//! ```
//!
//! A reader never trusts the bytes: [`SampleView::new`] checks the header, validates the archive
//! with bytecheck, and checks every region's bounds, alignment and length against its shape before
//! handing out a slice.
//!
//! ```
//! use feedstore_proto::sample::{AlignedBuf, DType, SampleInfo, SamplePlan, SampleView, TensorLayout};
//!
//! # fn main() -> Result<(), feedstore_proto::sample::SampleError> {
//! let mut plan = SamplePlan::new();
//! let image = plan.add_image(DType::F32, TensorLayout::Chw, &[3, 2, 2]);
//! plan.set_token_count(4);
//! let info = SampleInfo { id: "s-1".into(), image_grid_thw: vec![[1, 1, 1]], ..Default::default() };
//!
//! // In production this buffer is an `ObjectWriter`'s slice of shared memory.
//! let mut object = AlignedBuf::zeroed(plan.object_bytes(&info) as usize);
//! let buf = object.as_mut_slice();
//! let mut regions = plan.regions(buf)?;
//! bytemuck::cast_slice_mut::<u8, f32>(regions.images[image]).fill(0.5);
//! regions.tokens.copy_from_slice(&[151644, 872, 198, 151645]);
//! regions.labels.copy_from_slice(&[-100, -100, 198, 151645]);
//! plan.finish(buf, &info)?;
//!
//! let sample = SampleView::new(buf)?;
//! assert_eq!(sample.id(), "s-1");
//! assert_eq!(sample.image(0).unwrap().as_f32().unwrap()[0], 0.5);
//! assert_eq!(sample.tokens(), &[151644, 872, 198, 151645]);
//! # Ok(())
//! # }
//! ```

use rkyv::rancor;
use rkyv::{Archive, Deserialize, Serialize};

#[cfg(not(target_endian = "little"))]
compile_error!("feedstore samples store arrays little-endian and read them in place");

/// First eight bytes of every sample object.
pub const SAMPLE_MAGIC: [u8; 8] = *b"FSSAMPL1";
/// Layout version written by this crate.
pub const SAMPLE_VERSION: u32 = 1;
/// Size of the fixed header.
pub const SAMPLE_HEADER_BYTES: u64 = 64;
/// Every region and the archive start at a multiple of this.
pub const REGION_ALIGN_BYTES: u64 = 64;
/// Label value for a token that does not count in the loss (Hugging Face's convention).
pub const IGNORE_INDEX: i32 = -100;

/// Element type of a tensor.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
#[rkyv(derive(Debug, Clone, Copy, PartialEq, Eq))]
pub enum DType {
    /// Unsigned bytes (raw pixels).
    U8,
    /// IEEE half precision.
    F16,
    /// bfloat16.
    BF16,
    /// IEEE single precision.
    F32,
}

impl DType {
    /// Bytes per element.
    pub fn size_bytes(self) -> u64 {
        match self {
            DType::U8 => 1,
            DType::F16 | DType::BF16 => 2,
            DType::F32 => 4,
        }
    }
}

impl ArchivedDType {
    fn native(&self) -> DType {
        match self {
            ArchivedDType::U8 => DType::U8,
            ArchivedDType::F16 => DType::F16,
            ArchivedDType::BF16 => DType::BF16,
            ArchivedDType::F32 => DType::F32,
        }
    }
}

/// Memory order of an image tensor.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
#[rkyv(derive(Debug, Clone, Copy, PartialEq, Eq))]
pub enum TensorLayout {
    /// Height, width, channels (as decoded).
    Hwc,
    /// Channels, height, width (as most vision towers read).
    Chw,
}

/// A byte range inside the sample object.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Default)]
#[rkyv(derive(Debug))]
pub struct Region {
    /// Offset from the object start, a multiple of [`REGION_ALIGN_BYTES`].
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
}

/// Describes one image tensor region.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct TensorDesc {
    /// Element type.
    pub dtype: DType,
    /// Memory order.
    pub layout: TensorLayout,
    /// Dimensions, outermost first (`[c, h, w]` for CHW).
    pub shape: Vec<u32>,
    /// Where the elements are.
    pub region: Region,
}

/// One metadata entry.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct KeyValue {
    /// Key.
    pub key: String,
    /// Value.
    pub value: String,
}

/// The archived part of a sample (small; the arrays it describes live beside it).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct SampleMeta {
    /// The record's id from the manifest.
    pub id: String,
    /// Where the sample came from (`s3://bucket/key`, file paths).
    pub source_keys: Vec<String>,
    /// Image tensors.
    pub images: Vec<TensorDesc>,
    /// Per image, the vision encoder's patch grid (temporal, height, width), as Qwen-VL's
    /// position ids need it.
    pub image_grid_thw: Vec<[u32; 3]>,
    /// Token ids, `u32` little-endian.
    pub tokens: Region,
    /// Labels, `i32` little-endian, one per token; [`IGNORE_INDEX`] where the loss is masked.
    pub labels: Region,
    /// Small free-form metadata.
    pub metadata: Vec<KeyValue>,
}

/// The parts of a sample the caller supplies beside the arrays.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SampleInfo {
    /// See [`SampleMeta::id`].
    pub id: String,
    /// See [`SampleMeta::source_keys`].
    pub source_keys: Vec<String>,
    /// See [`SampleMeta::image_grid_thw`]; one per image, or empty.
    pub image_grid_thw: Vec<[u32; 3]>,
    /// See [`SampleMeta::metadata`].
    pub metadata: Vec<KeyValue>,
}

/// Why a sample could not be written or read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SampleError {
    /// The buffer is shorter than the layout needs.
    #[error("buffer of {have} bytes is smaller than the {need} the sample needs")]
    BufferTooSmall {
        /// Bytes needed.
        need: u64,
        /// Bytes given.
        have: u64,
    },
    /// The buffer does not start on a 64-byte boundary (objects in the store always do).
    #[error("sample buffer is not 64-byte aligned")]
    Misaligned,
    /// The first bytes are not a sample header.
    #[error("not a feedstore sample (bad magic)")]
    BadMagic,
    /// A layout version this crate does not read.
    #[error("unsupported sample layout version {found} (this side reads {SAMPLE_VERSION})")]
    UnsupportedVersion {
        /// What the header says.
        found: u32,
    },
    /// The header points outside the object.
    #[error("sample header is inconsistent: {0}")]
    BadHeader(&'static str),
    /// The archive failed validation.
    #[error("sample metadata failed validation")]
    Archive(#[source] rancor::Error),
    /// A region is out of bounds, misaligned, or does not match its shape.
    #[error("sample region {what}: {problem}")]
    BadRegion {
        /// Which region.
        what: &'static str,
        /// What is wrong.
        problem: &'static str,
    },
    /// The plan and the supplied info disagree (one grid per image).
    #[error("invalid sample: {0}")]
    Invalid(&'static str),
}

/// The layout of one sample, planned before any pixel or token is written, so the object can be
/// reserved at its final size and every stage can write its part in place.
#[derive(Debug, Clone)]
pub struct SamplePlan {
    images: Vec<TensorDesc>,
    tokens: Region,
    labels: Region,
    cursor: u64,
    /// Where the archive goes when a [`BatchPlan`] placed it (past other samples' images);
    /// otherwise right after the last region.
    archive_at: Option<u64>,
}

impl Default for SamplePlan {
    fn default() -> Self {
        Self::new()
    }
}

fn align_up(v: u64) -> u64 {
    v.next_multiple_of(REGION_ALIGN_BYTES)
}

impl SamplePlan {
    /// An empty plan: no images, no tokens.
    pub fn new() -> SamplePlan {
        SamplePlan {
            images: Vec::new(),
            tokens: Region::default(),
            labels: Region::default(),
            cursor: SAMPLE_HEADER_BYTES,
            archive_at: None,
        }
    }

    fn region(&mut self, len: u64) -> Region {
        let offset = align_up(self.cursor);
        self.cursor = offset + len;
        Region { offset, len }
    }

    /// Adds an image tensor; returns its index in [`SampleRegions::images`].
    pub fn add_image(&mut self, dtype: DType, layout: TensorLayout, shape: &[u32]) -> usize {
        let elements: u64 = shape.iter().map(|&d| u64::from(d)).product();
        let region = self.region(elements * dtype.size_bytes());
        self.images.push(TensorDesc {
            dtype,
            layout,
            shape: shape.to_vec(),
            region,
        });
        self.images.len() - 1
    }

    /// Reserves `n` token ids and `n` labels.
    pub fn set_token_count(&mut self, n: usize) {
        self.tokens = self.region(n as u64 * 4);
        self.labels = self.region(n as u64 * 4);
    }

    fn archive_offset(&self) -> u64 {
        self.archive_at.unwrap_or(align_up(self.cursor))
    }

    /// An upper bound on the archive's size, from the sizes of what it holds. rkyv stores a
    /// string or vector as 8 inline bytes plus its out-of-line data, aligned; this counts each
    /// piece generously so serialising straight into the object can never run short.
    fn archive_bound(&self, info: &SampleInfo) -> u64 {
        let string = |s: &str| s.len() as u64 + 16;
        256 + string(&info.id)
            + info.source_keys.iter().map(|s| string(s) + 8).sum::<u64>()
            + self
                .images
                .iter()
                .map(|t| 64 + 4 * t.shape.len() as u64)
                .sum::<u64>()
            + 16 * info.image_grid_thw.len() as u64
            + info
                .metadata
                .iter()
                .map(|kv| string(&kv.key) + string(&kv.value) + 8)
                .sum::<u64>()
    }

    /// The size to reserve for the object.
    pub fn object_bytes(&self, info: &SampleInfo) -> u64 {
        self.archive_offset() + self.archive_bound(info)
    }

    /// Splits a reserved object into its writable regions.
    pub fn regions<'a>(&self, buf: &'a mut [u8]) -> Result<SampleRegions<'a>, SampleError> {
        check_buffer(buf, self.archive_offset())?;
        // Carve the regions off in increasing offset order (a batch places image 0 after the
        // tokens), then hand them out in the plan's order.
        let mut order: Vec<(Region, usize)> = self
            .images
            .iter()
            .map(|t| t.region)
            .chain([self.tokens, self.labels])
            .enumerate()
            .map(|(i, r)| (r, i))
            .filter(|(r, _)| r.len != 0)
            .collect();
        order.sort_by_key(|(r, _)| r.offset);
        let mut carved: Vec<&'a mut [u8]> =
            (0..self.images.len() + 2).map(|_| &mut [][..]).collect();
        let mut rest: &'a mut [u8] = buf;
        let mut consumed = 0u64;
        for (r, i) in order {
            let tail = std::mem::take(&mut rest);
            let (_, tail) = tail.split_at_mut((r.offset - consumed) as usize);
            let (region, tail) = tail.split_at_mut(r.len as usize);
            rest = tail;
            consumed = r.offset + r.len;
            carved[i] = region;
        }
        let labels = carved.pop().expect("labels slot");
        let tokens = carved.pop().expect("tokens slot");
        // An empty typed slice has its own (aligned) dangling pointer; an empty byte slice cast
        // to u32 would not.
        let tokens: &mut [u32] = match tokens.len() {
            0 => &mut [],
            _ => bytemuck::cast_slice_mut(tokens),
        };
        let labels: &mut [i32] = match labels.len() {
            0 => &mut [],
            _ => bytemuck::cast_slice_mut(labels),
        };
        Ok(SampleRegions {
            images: carved,
            tokens,
            labels,
        })
    }

    /// Writes the archive and the header once the regions are filled. Call before sealing.
    pub fn finish(&self, buf: &mut [u8], info: &SampleInfo) -> Result<(), SampleError> {
        let need = self.object_bytes(info);
        check_buffer(buf, need)?;
        if !info.image_grid_thw.is_empty() && info.image_grid_thw.len() != self.images.len() {
            return Err(SampleError::Invalid(
                "image_grid_thw needs one grid per image",
            ));
        }
        let meta = SampleMeta {
            id: info.id.clone(),
            source_keys: info.source_keys.clone(),
            images: self.images.clone(),
            image_grid_thw: info.image_grid_thw.clone(),
            tokens: self.tokens,
            labels: self.labels,
            metadata: info.metadata.clone(),
        };
        let at = self.archive_offset() as usize;
        let writer = rkyv::ser::writer::Buffer::from(&mut buf[at..need as usize]);
        let written = rkyv::api::high::to_bytes_in::<_, rancor::Error>(&meta, writer)
            .map_err(SampleError::Archive)?;
        let archive_len = written.len() as u64;
        let header = &mut buf[..SAMPLE_HEADER_BYTES as usize];
        header.fill(0);
        header[0..8].copy_from_slice(&SAMPLE_MAGIC);
        header[8..12].copy_from_slice(&SAMPLE_VERSION.to_le_bytes());
        header[16..24].copy_from_slice(&(at as u64).to_le_bytes());
        header[24..32].copy_from_slice(&archive_len.to_le_bytes());
        Ok(())
    }
}

fn check_buffer(buf: &[u8], need: u64) -> Result<(), SampleError> {
    if !(buf.as_ptr() as usize).is_multiple_of(REGION_ALIGN_BYTES as usize) {
        return Err(SampleError::Misaligned);
    }
    if (buf.len() as u64) < need {
        return Err(SampleError::BufferTooSmall {
            need,
            have: buf.len() as u64,
        });
    }
    Ok(())
}

/// Several samples in one object, image 0 of every sample side by side: one stacked
/// `(n, *shape)` tensor a trainer reads as a whole batch, with no copy.
///
/// Each sample stays a complete sample starting at [`BatchPlan::start`] and running to the
/// object's end (what a stream item's `offset` names), so [`SampleView::new`] reads it as any
/// other. The object is laid out as
///
/// ```text
/// sample 0: header, other images, tokens, labels | sample 1: ... | sample n-1: ...
/// image 0 of sample 0 | image 0 of sample 1 | ... | image 0 of sample n-1   (the stack)
/// archive of sample 0 | archive of sample 1 | ...
/// ```
///
/// so each sample's regions lie between its header and its archive, as [`SampleView`] checks.
///
/// ```
/// use feedstore_proto::sample::{AlignedBuf, BatchPlan, DType, SampleInfo, SamplePlan, SampleView, TensorLayout};
///
/// # fn main() -> Result<(), feedstore_proto::sample::SampleError> {
/// let infos: Vec<SampleInfo> = (0..3).map(|i| SampleInfo { id: format!("s-{i}"), ..Default::default() }).collect();
/// let plans: Vec<SamplePlan> = (0..3).map(|i| {
///     let mut p = SamplePlan::new();
///     p.add_image(DType::F32, TensorLayout::Chw, &[1, 4, 4]);
///     p.set_token_count(2 + i);
///     p
/// }).collect();
/// let batch = BatchPlan::new(plans, &infos)?;
/// let mut object = AlignedBuf::zeroed(batch.object_bytes() as usize);
/// for (i, info) in infos.iter().enumerate() {
///     let mut regions = batch.regions(object.as_mut_slice(), i)?;
///     bytemuck::cast_slice_mut::<u8, f32>(regions.images[0]).fill(i as f32);
///     batch.finish(object.as_mut_slice(), i, info)?;
/// }
/// let second = SampleView::new(&object.as_slice()[batch.start(1) as usize..])?;
/// assert_eq!(second.id(), "s-1");
/// let stack = batch.stack();
/// let all: &[f32] = bytemuck::cast_slice(&object.as_slice()[stack.offset as usize..][..stack.len as usize]);
/// assert_eq!((all[0], all[16], all[47]), (0.0, 1.0, 2.0));
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct BatchPlan {
    /// Each sample's start, its plan (relative to that start) and the archive room it has.
    samples: Vec<(u64, SamplePlan, u64)>,
    stack: Region,
    bytes: u64,
}

impl BatchPlan {
    /// Places the samples (each planned as for an object of its own) in one object. Every
    /// sample needs an image 0, all of one dtype, layout and shape, whose size is a multiple of
    /// 64 bytes (so the images are both aligned and back to back); `infos` (one per plan) size
    /// the archives.
    pub fn new(plans: Vec<SamplePlan>, infos: &[SampleInfo]) -> Result<BatchPlan, SampleError> {
        if plans.is_empty() || plans.len() != infos.len() {
            return Err(SampleError::Invalid(
                "a batch needs one or more samples, each with its info",
            ));
        }
        let first = plans[0].images.first().ok_or(SampleError::Invalid(
            "a batch stacks image 0: every sample needs one",
        ))?;
        let (dtype, layout, shape, len) = (
            first.dtype,
            first.layout,
            first.shape.clone(),
            first.region.len,
        );
        if len % REGION_ALIGN_BYTES != 0 {
            return Err(SampleError::Invalid(
                "a stacked image must be a multiple of 64 bytes",
            ));
        }
        // Each sample's head (header, other images, tokens, labels), back to back.
        let mut placed = Vec::with_capacity(plans.len());
        let mut cursor = 0u64;
        for plan in plans {
            match plan.images.first() {
                Some(t) if t.dtype == dtype && t.layout == layout && t.shape == shape => {}
                _ => {
                    return Err(SampleError::Invalid(
                        "every sample of a batch needs an image 0 of the same dtype, layout and shape",
                    ));
                }
            }
            let mut head = SamplePlan::new();
            head.images.push(plan.images[0].clone());
            for t in &plan.images[1..] {
                let region = head.region(t.region.len);
                head.images.push(TensorDesc {
                    region,
                    ..t.clone()
                });
            }
            head.tokens = head.region(plan.tokens.len);
            head.labels = head.region(plan.labels.len);
            let start = cursor;
            cursor = start + align_up(head.cursor);
            placed.push((start, head));
        }
        let stack = Region {
            offset: cursor,
            len: len * placed.len() as u64,
        };
        let mut archive = stack.offset + stack.len;
        let mut samples = Vec::with_capacity(placed.len());
        for (i, (start, mut plan)) in placed.into_iter().enumerate() {
            plan.images[0].region.offset = stack.offset + i as u64 * len - start;
            plan.archive_at = Some(archive - start);
            let room = align_up(plan.archive_bound(&infos[i]));
            archive += room;
            samples.push((start, plan, room));
        }
        Ok(BatchPlan {
            samples,
            stack,
            bytes: archive,
        })
    }

    /// Samples in the batch.
    pub fn len(&self) -> usize {
        self.samples.len()
    }

    /// Whether it has no samples (never: [`BatchPlan::new`] refuses that).
    pub fn is_empty(&self) -> bool {
        self.samples.is_empty()
    }

    /// The size to reserve for the object.
    pub fn object_bytes(&self) -> u64 {
        self.bytes
    }

    /// Where sample `i` starts in the object (its stream item's `offset`).
    pub fn start(&self, i: usize) -> u64 {
        self.samples[i].0
    }

    /// Where the stacked images lie in the object.
    pub fn stack(&self) -> Region {
        self.stack
    }

    fn sample<'b>(
        &self,
        buf: &'b mut [u8],
        i: usize,
    ) -> Result<(&SamplePlan, &'b mut [u8]), SampleError> {
        let (start, plan, _) = self
            .samples
            .get(i)
            .ok_or(SampleError::Invalid("no such sample in the batch"))?;
        check_buffer(buf, self.bytes)?;
        Ok((plan, &mut buf[*start as usize..]))
    }

    /// Sample `i`'s writable regions in the object `buf` (its image 0 is its slot of the stack).
    pub fn regions<'a>(
        &self,
        buf: &'a mut [u8],
        i: usize,
    ) -> Result<SampleRegions<'a>, SampleError> {
        let (plan, buf) = self.sample(buf, i)?;
        plan.regions(buf)
    }

    /// Writes sample `i` as a copy of `view`, which must be the sample this plan was made
    /// for, with its `info` (`BatchPlan::new` from its [`SampleView::plan`]).
    pub fn copy_from(
        &self,
        buf: &mut [u8],
        i: usize,
        view: &SampleView<'_>,
        info: &SampleInfo,
    ) -> Result<(), SampleError> {
        let regions = self.regions(buf, i)?;
        if regions.images.len() != view.image_count() || regions.tokens.len() != view.tokens().len()
        {
            return Err(SampleError::Invalid(
                "the sample is not the one the batch was planned for",
            ));
        }
        for (k, dst) in regions.images.into_iter().enumerate() {
            let src = view.image(k).expect("counted").bytes();
            if src.len() != dst.len() {
                return Err(SampleError::Invalid(
                    "the sample is not the one the batch was planned for",
                ));
            }
            dst.copy_from_slice(src);
        }
        regions.tokens.copy_from_slice(view.tokens());
        regions.labels.copy_from_slice(view.labels());
        self.finish(buf, i, info)
    }

    /// Writes sample `i`'s archive and header once its regions are filled.
    pub fn finish(&self, buf: &mut [u8], i: usize, info: &SampleInfo) -> Result<(), SampleError> {
        let room = self.samples.get(i).map_or(0, |s| s.2);
        let (plan, buf) = self.sample(buf, i)?;
        // The archive's room was sized by the info the batch was planned with: a larger one
        // would run into the next sample's.
        if plan.archive_bound(info) > room {
            return Err(SampleError::Invalid(
                "the info is larger than the one the batch was planned with",
            ));
        }
        plan.finish(buf, info)
    }
}

/// Where `parts` lie inside `within`, as one range of it, when each follows the one before
/// with no gap (the images of a batch a [`BatchPlan`] placed, read through the first sample,
/// which runs to its object's end); `None` when they do not, or reach past `within`.
pub fn side_by_side(within: &[u8], parts: &[&[u8]]) -> Option<std::ops::Range<usize>> {
    let base = within.as_ptr() as usize;
    let start = (parts.first()?.as_ptr() as usize).checked_sub(base)?;
    let mut end = start;
    for part in parts {
        if part.as_ptr() as usize != base.checked_add(end)? {
            return None;
        }
        end = end.checked_add(part.len())?;
    }
    (end <= within.len()).then_some(start..end)
}

/// The writable regions of a reserved sample object.
#[derive(Debug)]
pub struct SampleRegions<'a> {
    /// One byte slice per image, in [`SamplePlan::add_image`] order; cast it to the dtype's
    /// element type with `bytemuck::cast_slice_mut`.
    pub images: Vec<&'a mut [u8]>,
    /// Token ids.
    pub tokens: &'a mut [u32],
    /// Labels, [`IGNORE_INDEX`] where masked.
    pub labels: &'a mut [i32],
}

/// A validated, zero-copy view of a sample.
#[derive(Debug, Clone, Copy)]
pub struct SampleView<'a> {
    bytes: &'a [u8],
    meta: &'a ArchivedSampleMeta,
}

fn le_u64(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

impl<'a> SampleView<'a> {
    /// Checks and opens a sample: header, archive (bytecheck), and every region.
    pub fn new(bytes: &'a [u8]) -> Result<SampleView<'a>, SampleError> {
        if !(bytes.as_ptr() as usize).is_multiple_of(REGION_ALIGN_BYTES as usize) {
            return Err(SampleError::Misaligned);
        }
        if (bytes.len() as u64) < SAMPLE_HEADER_BYTES {
            return Err(SampleError::BufferTooSmall {
                need: SAMPLE_HEADER_BYTES,
                have: bytes.len() as u64,
            });
        }
        if bytes[0..8] != SAMPLE_MAGIC {
            return Err(SampleError::BadMagic);
        }
        let version = u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes"));
        if version != SAMPLE_VERSION {
            return Err(SampleError::UnsupportedVersion { found: version });
        }
        let (at, len) = (le_u64(bytes, 16), le_u64(bytes, 24));
        if at < SAMPLE_HEADER_BYTES || at % REGION_ALIGN_BYTES != 0 {
            return Err(SampleError::BadHeader("archive offset"));
        }
        let end = at.checked_add(len).filter(|&e| e <= bytes.len() as u64);
        let end = end.ok_or(SampleError::BadHeader("archive beyond the object"))?;
        let meta =
            rkyv::access::<ArchivedSampleMeta, rancor::Error>(&bytes[at as usize..end as usize])
                .map_err(SampleError::Archive)?;
        let view = SampleView { bytes, meta };
        view.check_regions(at)?;
        Ok(view)
    }

    fn check_regions(&self, archive_offset: u64) -> Result<(), SampleError> {
        let check = |what, r: &ArchivedRegion, expect_len: Option<u64>| {
            let (offset, len) = (r.offset.to_native(), r.len.to_native());
            let bad = |problem| Err(SampleError::BadRegion { what, problem });
            // Before the empty case: an empty region whose shape claims elements would let a
            // reader that sizes its view by the shape (numpy, DLPack, C) read past it.
            if expect_len.is_some_and(|e| e != len) {
                return bad("length does not match its shape");
            }
            if len == 0 {
                return Ok(());
            }
            if offset < SAMPLE_HEADER_BYTES || offset % REGION_ALIGN_BYTES != 0 {
                return bad("misaligned or inside the header");
            }
            if offset.checked_add(len).is_none_or(|e| e > archive_offset) {
                return bad("out of bounds");
            }
            Ok(())
        };
        for t in self.meta.images.iter() {
            let elements = t
                .shape
                .iter()
                .try_fold(1u64, |acc, d| acc.checked_mul(u64::from(d.to_native())));
            let expect = elements.and_then(|e| e.checked_mul(t.dtype.native().size_bytes()));
            let expect = expect.ok_or(SampleError::BadRegion {
                what: "image",
                problem: "shape overflows",
            })?;
            check("image", &t.region, Some(expect))?;
        }
        let tokens = self.meta.tokens.len.to_native();
        if !tokens.is_multiple_of(4) {
            return Err(SampleError::BadRegion {
                what: "tokens",
                problem: "not whole u32s",
            });
        }
        check("tokens", &self.meta.tokens, None)?;
        check("labels", &self.meta.labels, Some(tokens))?;
        let grids = self.meta.image_grid_thw.len();
        if grids != 0 && grids != self.meta.images.len() {
            return Err(SampleError::Invalid(
                "image_grid_thw needs one grid per image",
            ));
        }
        Ok(())
    }

    /// The bytes of a region `check_regions` accepted. An empty region reads as empty wherever
    /// its offset points (validation does not look at it), taken at the object's aligned start so
    /// typed casts of it stay aligned.
    fn region(&self, r: &ArchivedRegion) -> &'a [u8] {
        let (offset, len) = (r.offset.to_native() as usize, r.len.to_native() as usize);
        if len == 0 {
            return &self.bytes[..0];
        }
        &self.bytes[offset..offset + len]
    }

    /// The plan and info that write this sample again (to move it into a [`BatchPlan`]).
    pub fn plan(&self) -> (SamplePlan, SampleInfo) {
        let mut plan = SamplePlan::new();
        for i in 0..self.image_count() {
            let t = self.image(i).expect("counted");
            let shape: Vec<u32> = t.shape().iter().map(|&d| d as u32).collect();
            plan.add_image(t.dtype(), t.layout(), &shape);
        }
        plan.set_token_count(self.tokens().len());
        let info = SampleInfo {
            id: self.id().to_owned(),
            source_keys: self.source_keys().map(str::to_owned).collect(),
            image_grid_thw: self
                .meta
                .image_grid_thw
                .iter()
                .map(|g| g.map(|d| d.to_native()))
                .collect(),
            metadata: self
                .metadata_entries()
                .map(|(key, value)| KeyValue {
                    key: key.to_owned(),
                    value: value.to_owned(),
                })
                .collect(),
        };
        (plan, info)
    }

    /// The record's id.
    pub fn id(&self) -> &'a str {
        self.meta.id.as_str()
    }

    /// Where the sample came from.
    pub fn source_keys(&self) -> impl Iterator<Item = &'a str> + 'a {
        self.meta.source_keys.iter().map(|s| s.as_str())
    }

    /// Number of images.
    pub fn image_count(&self) -> usize {
        self.meta.images.len()
    }

    /// Image `i`.
    pub fn image(&self, i: usize) -> Option<TensorView<'a>> {
        let t = self.meta.images.get(i)?;
        Some(TensorView {
            desc: t,
            bytes: self.region(&t.region),
        })
    }

    /// The patch grid of image `i`, as (temporal, height, width).
    pub fn image_grid_thw(&self, i: usize) -> Option<[u32; 3]> {
        self.meta
            .image_grid_thw
            .get(i)
            .map(|g| [g[0].to_native(), g[1].to_native(), g[2].to_native()])
    }

    /// Token ids, in place.
    pub fn tokens(&self) -> &'a [u32] {
        bytemuck::cast_slice(self.region(&self.meta.tokens))
    }

    /// Labels, in place; [`IGNORE_INDEX`] where the loss is masked.
    pub fn labels(&self) -> &'a [i32] {
        bytemuck::cast_slice(self.region(&self.meta.labels))
    }

    /// Every metadata entry, in the order written.
    pub fn metadata_entries(&self) -> impl Iterator<Item = (&'a str, &'a str)> + 'a {
        self.meta
            .metadata
            .iter()
            .map(|kv| (kv.key.as_str(), kv.value.as_str()))
    }

    /// A metadata value.
    pub fn metadata(&self, key: &str) -> Option<&'a str> {
        self.meta
            .metadata
            .iter()
            .find(|kv| kv.key.as_str() == key)
            .map(|kv| kv.value.as_str())
    }
}

/// A zero-copy view of one image tensor.
#[derive(Debug, Clone, Copy)]
pub struct TensorView<'a> {
    desc: &'a ArchivedTensorDesc,
    bytes: &'a [u8],
}

impl<'a> TensorView<'a> {
    /// Element type.
    pub fn dtype(&self) -> DType {
        self.desc.dtype.native()
    }

    /// Memory order.
    pub fn layout(&self) -> TensorLayout {
        match self.desc.layout {
            ArchivedTensorLayout::Hwc => TensorLayout::Hwc,
            ArchivedTensorLayout::Chw => TensorLayout::Chw,
        }
    }

    /// Dimensions, outermost first.
    pub fn shape(&self) -> Vec<usize> {
        self.desc
            .shape
            .iter()
            .map(|d| d.to_native() as usize)
            .collect()
    }

    /// The raw little-endian bytes.
    pub fn bytes(&self) -> &'a [u8] {
        self.bytes
    }

    /// The elements, if the dtype is `U8`.
    pub fn as_u8(&self) -> Option<&'a [u8]> {
        (self.dtype() == DType::U8).then_some(self.bytes)
    }

    /// The elements, if the dtype is `F32`.
    pub fn as_f32(&self) -> Option<&'a [f32]> {
        (self.dtype() == DType::F32).then(|| bytemuck::cast_slice(self.bytes))
    }

    /// The elements, if the dtype is `F16`.
    pub fn as_f16(&self) -> Option<&'a [half::f16]> {
        (self.dtype() == DType::F16).then(|| bytemuck::cast_slice(self.bytes))
    }

    /// The elements, if the dtype is `BF16`.
    pub fn as_bf16(&self) -> Option<&'a [half::bf16]> {
        (self.dtype() == DType::BF16).then(|| bytemuck::cast_slice(self.bytes))
    }
}

/// A zeroed, 64-byte-aligned heap buffer, for building or checking samples outside the store
/// (tests, staging). Objects in the store are already aligned.
#[derive(Clone)]
pub struct AlignedBuf {
    blocks: Vec<Block>,
    len: usize,
}

#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C, align(64))]
struct Block([u8; 64]);

impl AlignedBuf {
    /// `len` zero bytes.
    pub fn zeroed(len: usize) -> AlignedBuf {
        AlignedBuf {
            blocks: vec![Block([0; 64]); len.div_ceil(64)],
            len,
        }
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        &bytemuck::cast_slice(&self.blocks)[..self.len]
    }

    /// The bytes, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut bytemuck::cast_slice_mut(&mut self.blocks)[..self.len]
    }
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AlignedBuf")
            .field("len", &self.len)
            .finish()
    }
}

#[cfg(test)]
mod tests;
