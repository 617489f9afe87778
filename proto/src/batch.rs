//! The layout of a batch object: whatever structure a loader's `collate_fn` makes (dicts, lists,
//! tuples, strings, numbers, tensors, arrays), stored so that reading it cannot run code.
//!
//! ```text
//! 0       "FSBATCH2" | skeleton length (u64, little-endian)
//! 16      skeleton: the structure, in the tagged encoding below
//! ...     zero padding to a multiple of 64
//! data    every tensor's bytes, each at a 64-byte-aligned offset of the data region
//! ```
//!
//! The skeleton is a tree of [`Value`]s. Its encoding has one tag byte per value, lengths and
//! counts as `u32`, numbers little-endian:
//!
//! | tag | value | body |
//! |-----|-------|------|
//! | 0 | `None` | |
//! | 1, 2 | `False`, `True` | |
//! | 3 | an int that fits `i64` | `i64` |
//! | 4 | a larger int | length, its minimal two's-complement bytes (9 to [`MAX_BIG_INT_BYTES`]) |
//! | 5 | a float | `f64` bits |
//! | 6 | a complex | two `f64` |
//! | 7 | a str | length, UTF-8 |
//! | 8 | bytes | length, bytes |
//! | 9, 10 | a list, a tuple | count, values |
//! | 11, 12 | a dict, an `OrderedDict` | count, key and value pairs |
//! | 13 | a tensor, array or numpy scalar ([`Leaf`]) | kind, dtype, width, ndim, shape, offset, byte length |
//! | 14 | an object of a class the user allowed ([`Object`]) | class name, how it is built, arguments, state, items |
//!
//! Where Python's pickle names any callable to call, this format names a class only inside
//! [`Object`], and a reader builds one only if its user listed that very class: a batch from
//! the store, a peer or a file is data, never code. Decoding checks every length before it
//! trusts it (counts against the bytes left, nesting against [`MAX_DEPTH`], every leaf against
//! the data region), and refuses every non-canonical form, so what decodes re-encodes to the
//! same bytes (property-tested, and asserted by the `batch` fuzz target).
//!
//! Shared references are not kept (a tensor that appears twice is stored once, and read back as
//! two views of the same bytes); a structure that refers to itself is refused as too deep.

use crate::wire::{DecodeError, Reader, Writer};

/// First bytes of every batch object.
pub const MAGIC: [u8; 8] = *b"FSBATCH2";
/// First bytes of a batch object written by feedstore 0.1 before this format (a pickle): never
/// read, only recognised to say why.
pub const PICKLED_MAGIC: [u8; 8] = *b"FSBATCH1";
/// Bytes of the header: magic and skeleton length.
pub const HEADER_BYTES: usize = 16;
/// Alignment of the data region and of every leaf's bytes in it.
pub const ALIGN: u64 = 64;
/// The deepest nesting a skeleton may have (a structure that refers to itself ends here).
pub const MAX_DEPTH: usize = 100;
/// The most dimensions a leaf may have (numpy's own limit is 64).
pub const MAX_NDIM: usize = 64;
/// The most bytes of a big int.
pub const MAX_BIG_INT_BYTES: usize = 4096;

/// Element types a leaf may hold: plain numbers only, never Python objects.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Elem {
    /// `bool`.
    Bool = 0,
    /// `uint8`.
    U8 = 1,
    /// `int8`.
    I8 = 2,
    /// `int16`.
    I16 = 3,
    /// `int32`.
    I32 = 4,
    /// `int64`.
    I64 = 5,
    /// `uint16`.
    U16 = 6,
    /// `uint32`.
    U32 = 7,
    /// `uint64`.
    U64 = 8,
    /// `float16`.
    F16 = 9,
    /// `bfloat16` (torch only).
    BF16 = 10,
    /// `float32`.
    F32 = 11,
    /// `float64`.
    F64 = 12,
    /// `complex64`.
    C64 = 13,
    /// `complex128`.
    C128 = 14,
    /// Fixed-width text, numpy's `<U`: `width` UCS-4 code points per element (numpy only).
    Text = 15,
    /// Fixed-width bytes, numpy's `S`: `width` bytes per element (numpy only).
    Bytes = 16,
}

impl Elem {
    /// Every element type, by code.
    pub const ALL: [Elem; 17] = [
        Elem::Bool,
        Elem::U8,
        Elem::I8,
        Elem::I16,
        Elem::I32,
        Elem::I64,
        Elem::U16,
        Elem::U32,
        Elem::U64,
        Elem::F16,
        Elem::BF16,
        Elem::F32,
        Elem::F64,
        Elem::C64,
        Elem::C128,
        Elem::Text,
        Elem::Bytes,
    ];

    /// The element type with this code.
    pub fn from_u8(code: u8) -> Option<Elem> {
        Elem::ALL.get(usize::from(code)).copied()
    }

    /// Bytes per element, for elements `width` wide (text and bytes; 0 for numbers).
    pub fn size(self, width: u32) -> u64 {
        match self {
            Elem::Bool | Elem::U8 | Elem::I8 => 1,
            Elem::I16 | Elem::U16 | Elem::F16 | Elem::BF16 => 2,
            Elem::I32 | Elem::U32 | Elem::F32 => 4,
            Elem::I64 | Elem::U64 | Elem::F64 | Elem::C64 => 8,
            Elem::C128 => 16,
            Elem::Text => 4 * u64::from(width),
            Elem::Bytes => u64::from(width),
        }
    }

    /// Whether its elements have a width of their own (text, bytes).
    pub fn is_sized(self) -> bool {
        matches!(self, Elem::Text | Elem::Bytes)
    }
}

/// What a leaf's bytes become when read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum LeafKind {
    /// A torch tensor.
    Tensor = 0,
    /// A numpy array.
    Array = 1,
    /// A numpy scalar (`np.float32(1.5)`): no dimensions.
    Scalar = 2,
}

impl LeafKind {
    /// The kind with this code.
    pub fn from_u8(code: u8) -> Option<LeafKind> {
        Some(match code {
            0 => LeafKind::Tensor,
            1 => LeafKind::Array,
            2 => LeafKind::Scalar,
            _ => return None,
        })
    }
}

/// A tensor's place in the data region.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Leaf {
    /// Tensor, array or scalar.
    pub kind: LeafKind,
    /// Its element type.
    pub elem: Elem,
    /// Characters or bytes per element for text and bytes (at least 1); 0 for numbers.
    pub width: u32,
    /// Its shape (empty for a scalar or a 0-d tensor).
    pub shape: Vec<u64>,
    /// Offset of its bytes from the start of the data region, a multiple of [`ALIGN`].
    pub offset: u64,
    /// Its bytes: the product of the shape times the element size.
    pub nbytes: u64,
}

impl Leaf {
    /// A leaf whose parts agree, or why not: the element type fits the kind (bfloat16 is
    /// torch's alone; text and bytes are numpy's, and only they have a width), a scalar has no
    /// dimensions, at most [`MAX_NDIM`], and `nbytes` is what the shape holds. (Where it lies
    /// is checked against its object by [`parse`].)
    pub fn checked(
        kind: LeafKind,
        elem: Elem,
        width: u32,
        shape: Vec<u64>,
        offset: u64,
        nbytes: u64,
    ) -> Result<Leaf, String> {
        if shape.len() > MAX_NDIM || (kind == LeafKind::Scalar && !shape.is_empty()) {
            return Err(format!("a {kind:?} leaf of {} dimensions", shape.len()));
        }
        if (kind != LeafKind::Tensor && elem == Elem::BF16)
            || (kind == LeafKind::Tensor && elem.is_sized())
            || (elem.is_sized() != (width != 0))
        {
            return Err(format!("a {kind:?} leaf of {elem:?} elements {width} wide"));
        }
        if Leaf::bytes_for(elem, width, &shape) != Some(nbytes) {
            return Err(format!(
                "a {elem:?} leaf of shape {shape:?} cannot hold {nbytes} bytes"
            ));
        }
        Ok(Leaf {
            kind,
            elem,
            width,
            shape,
            offset,
            nbytes,
        })
    }

    /// The bytes a leaf of this element type, width and shape holds, if that fits a `u64`.
    pub fn bytes_for(elem: Elem, width: u32, shape: &[u64]) -> Option<u64> {
        shape
            .iter()
            .try_fold(elem.size(width), |n, &d| n.checked_mul(d))
    }
}

/// How a reader builds an [`Object`], mirroring what Python's `__reduce_ex__` returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Build {
    /// `cls.__new__(cls, *args)` (`copyreg.__newobj__`, what plain classes, dataclasses and
    /// named tuples reduce to).
    New = 0,
    /// `cls(*args)` (a class whose `__reduce__` names itself).
    Call = 1,
}

/// An object of a class its user allowed, and what rebuilds it: its class's `__new__` (or the
/// class itself) with `args`, then `state` as pickle applies it (`__setstate__`, else the
/// instance dict and slots), then `list_items` appended and `dict_items` set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Object {
    /// `module:qualname` of the class.
    pub class: String,
    /// How it is built.
    pub build: Build,
    /// The arguments: a [`Value::Tuple`].
    pub args: Value,
    /// The state, or `None`.
    pub state: Value,
    /// Items to append: a [`Value::List`], or `None`.
    pub list_items: Value,
    /// Items to set: a [`Value::Dict`], or `None`.
    pub dict_items: Value,
}

/// One node of a batch's structure.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Value {
    /// `None`.
    None,
    /// `True` or `False`.
    Bool(bool),
    /// An int that fits `i64`.
    Int(i64),
    /// A larger int: its minimal two's-complement bytes, little-endian, 9 or more.
    BigInt(Vec<u8>),
    /// A float, bit for bit (NaN payloads included).
    Float(u64),
    /// A complex: real and imaginary parts' bits.
    Complex(u64, u64),
    /// A str.
    Str(String),
    /// A bytes.
    Bytes(Vec<u8>),
    /// A list.
    List(Vec<Value>),
    /// A tuple.
    Tuple(Vec<Value>),
    /// A dict, in its order.
    Dict(Vec<(Value, Value)>),
    /// A `collections.OrderedDict`, in its order.
    OrderedDict(Vec<(Value, Value)>),
    /// Bytes in the data region.
    Leaf(Leaf),
    /// An object of an allowed class.
    Object(Box<Object>),
}

const NONE: u8 = 0;
const FALSE: u8 = 1;
const TRUE: u8 = 2;
const INT: u8 = 3;
const BIG_INT: u8 = 4;
const FLOAT: u8 = 5;
const COMPLEX: u8 = 6;
const STR: u8 = 7;
const BYTES: u8 = 8;
const LIST: u8 = 9;
const TUPLE: u8 = 10;
const DICT: u8 = 11;
const ORDERED_DICT: u8 = 12;
const LEAF: u8 = 13;
const OBJECT: u8 = 14;

/// Why a batch object was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BatchError {
    /// Not a batch object at all.
    #[error("not a feedstore batch (magic {0:02x?})")]
    NotABatch([u8; 8]),
    /// A batch written with pickle by an earlier feedstore: refused, never unpickled.
    #[error(
        "a batch written with pickle by an earlier feedstore: refused, since reading it could \
         run code; write it again with this version"
    )]
    Pickled,
    /// The header or skeleton is malformed.
    #[error("malformed batch skeleton: {0}")]
    Skeleton(#[from] DecodeError),
    /// A leaf lies outside the data region or does not match its shape.
    #[error("malformed batch: {0}")]
    Leaf(String),
}

/// Where the data region starts for a skeleton of `skeleton_len` bytes.
pub fn data_start(skeleton_len: usize) -> u64 {
    (HEADER_BYTES as u64 + skeleton_len as u64).next_multiple_of(ALIGN)
}

/// The header: magic and skeleton length.
pub fn header(skeleton_len: usize) -> [u8; HEADER_BYTES] {
    let mut h = [0u8; HEADER_BYTES];
    h[..8].copy_from_slice(&MAGIC);
    h[8..].copy_from_slice(&(skeleton_len as u64).to_le_bytes());
    h
}

/// Whether `object` starts like a batch object (of this format or the pickled one).
pub fn is_batch(object: &[u8]) -> bool {
    object.len() >= HEADER_BYTES && (object[..8] == MAGIC || object[..8] == PICKLED_MAGIC)
}

/// Parses a whole batch object: its structure, each leaf's offset relative to the data region,
/// and where that region starts. Every leaf is checked to lie inside the object.
///
/// The skeleton is copied out of `object` before it is decoded, so each of its bytes is read
/// once: an object in shared memory that a writer process changes meanwhile (breaking the
/// protocol) cannot make a value checked once differ when it is used (a string validated as
/// UTF-8, then copied).
pub fn parse(object: &[u8]) -> Result<(Value, u64), BatchError> {
    let Some(head) = object.first_chunk::<HEADER_BYTES>() else {
        let mut magic = [0u8; 8];
        let n = object.len().min(8);
        magic[..n].copy_from_slice(&object[..n]);
        return Err(BatchError::NotABatch(magic));
    };
    let magic: [u8; 8] = head[..8].try_into().expect("8 bytes");
    if magic == PICKLED_MAGIC {
        return Err(BatchError::Pickled);
    }
    if magic != MAGIC {
        return Err(BatchError::NotABatch(magic));
    }
    let skeleton_len = u64::from_le_bytes(head[8..].try_into().expect("8 bytes"));
    let rest = (object.len() - HEADER_BYTES) as u64;
    if skeleton_len > rest {
        return Err(BatchError::Leaf(format!(
            "a skeleton of {skeleton_len} bytes in an object of {}",
            object.len()
        )));
    }
    let skeleton = object[HEADER_BYTES..HEADER_BYTES + skeleton_len as usize].to_vec();
    let start = data_start(skeleton.len());
    let data_len = (object.len() as u64).saturating_sub(start);
    let value = decode(&skeleton, data_len)?;
    Ok((value, start))
}

/// Encodes a skeleton.
pub fn encode(value: &Value) -> Vec<u8> {
    let mut buf = Vec::with_capacity(256);
    encode_into(value, &mut Writer::new(&mut buf));
    buf
}

fn encode_into(value: &Value, w: &mut Writer<'_>) {
    let len = |w: &mut Writer<'_>, n: usize| {
        w.u32(u32::try_from(n).expect("a skeleton part under 4 GiB"))
    };
    match value {
        Value::None => w.u8(NONE),
        Value::Bool(false) => w.u8(FALSE),
        Value::Bool(true) => w.u8(TRUE),
        Value::Int(i) => {
            w.u8(INT);
            w.u64(*i as u64);
        }
        Value::BigInt(b) => {
            w.u8(BIG_INT);
            len(w, b.len());
            w.buf.extend_from_slice(b);
        }
        Value::Float(bits) => {
            w.u8(FLOAT);
            w.u64(*bits);
        }
        Value::Complex(re, im) => {
            w.u8(COMPLEX);
            w.u64(*re);
            w.u64(*im);
        }
        Value::Str(s) => {
            w.u8(STR);
            len(w, s.len());
            w.buf.extend_from_slice(s.as_bytes());
        }
        Value::Bytes(b) => {
            w.u8(BYTES);
            len(w, b.len());
            w.buf.extend_from_slice(b);
        }
        Value::List(items) | Value::Tuple(items) => {
            w.u8(if matches!(value, Value::List(_)) {
                LIST
            } else {
                TUPLE
            });
            len(w, items.len());
            for item in items {
                encode_into(item, w);
            }
        }
        Value::Dict(pairs) | Value::OrderedDict(pairs) => {
            w.u8(if matches!(value, Value::Dict(_)) {
                DICT
            } else {
                ORDERED_DICT
            });
            len(w, pairs.len());
            for (k, v) in pairs {
                encode_into(k, w);
                encode_into(v, w);
            }
        }
        Value::Leaf(leaf) => {
            w.u8(LEAF);
            w.u8(leaf.kind as u8);
            w.u8(leaf.elem as u8);
            w.u32(leaf.width);
            w.u8(u8::try_from(leaf.shape.len()).expect("at most MAX_NDIM dimensions"));
            for &d in &leaf.shape {
                w.u64(d);
            }
            w.u64(leaf.offset);
            w.u64(leaf.nbytes);
        }
        Value::Object(o) => {
            w.u8(OBJECT);
            len(w, o.class.len());
            w.buf.extend_from_slice(o.class.as_bytes());
            w.u8(o.build as u8);
            encode_into(&o.args, w);
            encode_into(&o.state, w);
            encode_into(&o.list_items, w);
            encode_into(&o.dict_items, w);
        }
    }
}

/// Decodes a skeleton whose leaves must lie in a data region of `data_len` bytes. Refuses
/// trailing bytes and every non-canonical form.
pub fn decode(skeleton: &[u8], data_len: u64) -> Result<Value, BatchError> {
    let mut r = Reader::new(skeleton);
    let value = decode_value(&mut r, data_len, 0)?;
    r.finish()?;
    Ok(value)
}

fn invalid(field: &'static str) -> BatchError {
    BatchError::Skeleton(DecodeError::InvalidValue { field })
}

fn decode_value(r: &mut Reader<'_>, data_len: u64, depth: usize) -> Result<Value, BatchError> {
    if depth >= MAX_DEPTH {
        return Err(invalid("nesting deeper than MAX_DEPTH"));
    }
    let next = |r: &mut Reader<'_>| decode_value(r, data_len, depth + 1);
    Ok(match r.u8()? {
        NONE => Value::None,
        FALSE => Value::Bool(false),
        TRUE => Value::Bool(true),
        INT => Value::Int(r.u64()? as i64),
        BIG_INT => {
            let n = r.count(1)?;
            let b = r.bytes(n)?;
            if !(9..=MAX_BIG_INT_BYTES).contains(&n) || !minimal_twos_complement(b) {
                return Err(invalid("big int"));
            }
            Value::BigInt(b.to_vec())
        }
        FLOAT => Value::Float(r.u64()?),
        COMPLEX => Value::Complex(r.u64()?, r.u64()?),
        STR => {
            let n = r.count(1)?;
            let s = std::str::from_utf8(r.bytes(n)?).map_err(|_| invalid("str"))?;
            Value::Str(s.to_owned())
        }
        BYTES => {
            let n = r.count(1)?;
            Value::Bytes(r.bytes(n)?.to_vec())
        }
        tag @ (LIST | TUPLE) => {
            let n = r.count(1)?;
            let items = (0..n).map(|_| next(r)).collect::<Result<Vec<_>, _>>()?;
            if tag == LIST {
                Value::List(items)
            } else {
                Value::Tuple(items)
            }
        }
        tag @ (DICT | ORDERED_DICT) => {
            let n = r.count(2)?;
            let pairs = (0..n)
                .map(|_| Ok((next(r)?, next(r)?)))
                .collect::<Result<Vec<_>, BatchError>>()?;
            if tag == DICT {
                Value::Dict(pairs)
            } else {
                Value::OrderedDict(pairs)
            }
        }
        LEAF => Value::Leaf(decode_leaf(r, data_len)?),
        OBJECT => {
            let n = r.count(1)?;
            let class = std::str::from_utf8(r.bytes(n)?).map_err(|_| invalid("class name"))?;
            if class.is_empty() || class.chars().any(char::is_control) {
                return Err(invalid("class name"));
            }
            let build = match r.u8()? {
                0 => Build::New,
                1 => Build::Call,
                _ => return Err(invalid("object build")),
            };
            let object = Object {
                class: class.to_owned(),
                build,
                args: next(r)?,
                state: next(r)?,
                list_items: next(r)?,
                dict_items: next(r)?,
            };
            if !matches!(object.args, Value::Tuple(_))
                || !matches!(object.list_items, Value::None | Value::List(_))
                || !matches!(object.dict_items, Value::None | Value::Dict(_))
            {
                return Err(invalid("object parts"));
            }
            Value::Object(Box::new(object))
        }
        _ => return Err(invalid("skeleton tag")),
    })
}

fn decode_leaf(r: &mut Reader<'_>, data_len: u64) -> Result<Leaf, BatchError> {
    let kind = LeafKind::from_u8(r.u8()?).ok_or(invalid("leaf kind"))?;
    let elem = Elem::from_u8(r.u8()?).ok_or(invalid("leaf dtype"))?;
    let width = r.u32()?;
    let ndim = usize::from(r.u8()?);
    if ndim > MAX_NDIM {
        return Err(invalid("leaf dimensions"));
    }
    let shape = (0..ndim).map(|_| r.u64()).collect::<Result<Vec<_>, _>>()?;
    let offset = r.u64()?;
    let nbytes = r.u64()?;
    let leaf = Leaf::checked(kind, elem, width, shape, offset, nbytes).map_err(BatchError::Leaf)?;
    let inside = offset
        .checked_add(nbytes)
        .is_some_and(|end| end <= data_len);
    if offset % ALIGN != 0 || !inside {
        return Err(BatchError::Leaf(format!(
            "a leaf at {offset}+{nbytes} lies outside the data region of {data_len} bytes"
        )));
    }
    Ok(leaf)
}

/// Whether little-endian two's-complement bytes are the shortest form of their value.
pub fn minimal_twos_complement(b: &[u8]) -> bool {
    match b {
        [] => false,
        [_] => true,
        [.., second, last] => {
            // The top byte is redundant if it only repeats the sign of the byte below it.
            !((*last == 0 && second & 0x80 == 0) || (*last == 0xff && second & 0x80 != 0))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn leaf(max_offset_blocks: u64) -> impl Strategy<Value = Leaf> {
        (
            0u8..3,
            0u8..17,
            1u32..9,
            proptest::collection::vec(0u64..5, 0..4),
            0..max_offset_blocks,
        )
            .prop_map(|(kind, elem, width, shape, block)| {
                let kind = LeafKind::from_u8(kind).unwrap();
                let mut elem = Elem::from_u8(elem).unwrap();
                if (kind != LeafKind::Tensor && elem == Elem::BF16)
                    || (kind == LeafKind::Tensor && elem.is_sized())
                {
                    elem = Elem::F32;
                }
                let width = if elem.is_sized() { width } else { 0 };
                let shape = if kind == LeafKind::Scalar {
                    vec![]
                } else {
                    shape
                };
                let nbytes = Leaf::bytes_for(elem, width, &shape).unwrap();
                Leaf {
                    kind,
                    elem,
                    width,
                    shape,
                    offset: block * ALIGN,
                    nbytes,
                }
            })
    }

    fn big_int() -> impl Strategy<Value = Vec<u8>> {
        proptest::collection::vec(any::<u8>(), 9..20)
            .prop_filter_map("minimal", |b| minimal_twos_complement(&b).then_some(b))
    }

    fn value() -> impl Strategy<Value = Value> {
        let scalar = prop_oneof![
            Just(Value::None),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(Value::Int),
            big_int().prop_map(Value::BigInt),
            any::<u64>().prop_map(Value::Float),
            (any::<u64>(), any::<u64>()).prop_map(|(a, b)| Value::Complex(a, b)),
            ".{0,12}".prop_map(Value::Str),
            proptest::collection::vec(any::<u8>(), 0..12).prop_map(Value::Bytes),
            leaf(16).prop_map(Value::Leaf),
        ];
        scalar.prop_recursive(4, 64, 6, |inner| {
            let pairs = proptest::collection::vec((inner.clone(), inner.clone()), 0..4);
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..6).prop_map(Value::List),
                proptest::collection::vec(inner.clone(), 0..6).prop_map(Value::Tuple),
                pairs.clone().prop_map(Value::Dict),
                pairs.clone().prop_map(Value::OrderedDict),
                (
                    "[a-z._:]{1,20}",
                    any::<bool>(),
                    proptest::collection::vec(inner.clone(), 0..3),
                    inner.clone(),
                    proptest::option::of(proptest::collection::vec(inner.clone(), 0..3)),
                    proptest::option::of(pairs),
                )
                    .prop_map(|(class, call, args, state, list, dict)| {
                        Value::Object(Box::new(Object {
                            class,
                            build: if call { Build::Call } else { Build::New },
                            args: Value::Tuple(args),
                            state,
                            list_items: list.map_or(Value::None, Value::List),
                            dict_items: dict.map_or(Value::None, Value::Dict),
                        }))
                    }),
            ]
        })
    }

    proptest! {
        #[test]
        fn skeletons_round_trip(v in value()) {
            let wire = encode(&v);
            let back = decode(&wire, 16 * ALIGN + 4096).unwrap();
            prop_assert_eq!(&back, &v);
            prop_assert_eq!(encode(&back), wire);
        }

        /// Whatever decodes re-encodes to the same bytes; nothing panics.
        #[test]
        fn any_bytes_decode_canonically_or_fail(b in proptest::collection::vec(any::<u8>(), 0..200)) {
            if let Ok(v) = decode(&b, 1 << 20) {
                prop_assert_eq!(encode(&v), b);
            }
        }

        #[test]
        fn big_ints_have_one_form(b in proptest::collection::vec(any::<u8>(), 1..12)) {
            // Sign-extending a minimal form makes a longer, non-minimal one.
            if minimal_twos_complement(&b) {
                let mut longer = b.clone();
                longer.push(if b[b.len() - 1] & 0x80 != 0 { 0xff } else { 0 });
                prop_assert!(!minimal_twos_complement(&longer));
            }
        }
    }

    fn object_with(skeleton: &[u8], data: usize) -> Vec<u8> {
        let mut object = header(skeleton.len()).to_vec();
        object.extend_from_slice(skeleton);
        object.resize(data_start(skeleton.len()) as usize + data, 0);
        object
    }

    #[test]
    fn a_whole_object_parses_with_its_leaves_inside() {
        let tensor = Leaf {
            kind: LeafKind::Tensor,
            elem: Elem::F32,
            width: 0,
            shape: vec![2, 3],
            offset: 64,
            nbytes: 24,
        };
        let v = Value::Dict(vec![(
            Value::Str("pixel_values".into()),
            Value::Leaf(tensor),
        )]);
        let skeleton = encode(&v);
        let object = object_with(&skeleton, 88);
        let (back, start) = parse(&object).unwrap();
        assert_eq!((back, start), (v.clone(), data_start(skeleton.len())));
        assert_eq!(start % ALIGN, 0);
        // One byte short of the data the leaf names.
        let short = object_with(&encode(&v), 87);
        assert!(matches!(parse(&short), Err(BatchError::Leaf(_))));
    }

    #[test]
    fn lies_are_refused() {
        let leaf = |elem, shape: Vec<u64>, offset, nbytes| {
            encode(&Value::Leaf(Leaf {
                kind: LeafKind::Array,
                elem,
                width: if elem == Elem::Text { 2 } else { 0 },
                shape,
                offset,
                nbytes,
            }))
        };
        assert!(decode(&leaf(Elem::F32, vec![4], 0, 16), 16).is_ok());
        assert!(
            decode(&leaf(Elem::F32, vec![4], 0, 15), 16).is_err(),
            "size"
        );
        assert!(
            decode(&leaf(Elem::F32, vec![4], 64, 16), 64).is_err(),
            "past end"
        );
        assert!(
            decode(&leaf(Elem::U8, vec![1], 1, 1), 64).is_err(),
            "unaligned"
        );
        assert!(
            decode(&leaf(Elem::F64, vec![u64::MAX, 2], 0, 0), 64).is_err(),
            "overflowing shape"
        );
        assert!(
            decode(&leaf(Elem::BF16, vec![1], 0, 2), 64).is_err(),
            "numpy has no bfloat16"
        );
        assert!(decode(&leaf(Elem::Text, vec![3], 0, 24), 64).is_ok());
        assert!(
            decode(&leaf(Elem::Text, vec![3], 0, 12), 64).is_err(),
            "width"
        );
        // A count larger than the bytes left, an unknown tag, trailing bytes.
        assert!(decode(&[LIST, 0xff, 0xff, 0xff, 0xff], 0).is_err());
        assert!(decode(&[99], 0).is_err());
        assert!(decode(&[NONE, NONE], 0).is_err());
        // Nested past the limit (a structure referring to itself ends here).
        let mut deep = vec![];
        for _ in 0..MAX_DEPTH {
            deep.extend_from_slice(&[LIST, 1, 0, 0, 0]);
        }
        deep.push(NONE);
        assert!(decode(&deep, 0).is_err());
        // A big int that fits an i64, or carries a redundant sign byte.
        let mut small = vec![BIG_INT, 9, 0, 0, 0];
        small.extend_from_slice(&[1, 0, 0, 0, 0, 0, 0, 0, 0]);
        assert!(decode(&small, 0).is_err());
        // An object whose arguments are not a tuple.
        let bad = encode(&Value::Object(Box::new(Object {
            class: "m:C".into(),
            build: Build::New,
            args: Value::List(vec![]),
            state: Value::None,
            list_items: Value::None,
            dict_items: Value::None,
        })));
        assert!(decode(&bad, 0).is_err());
    }

    #[test]
    fn pickled_batches_are_named_and_refused() {
        let mut old = b"FSBATCH1".to_vec();
        old.extend_from_slice(&[0; 8]);
        assert!(is_batch(&old));
        assert_eq!(parse(&old), Err(BatchError::Pickled));
        assert!(matches!(
            parse(b"not a batch at all"),
            Err(BatchError::NotABatch(_))
        ));
        assert!(matches!(parse(b"short"), Err(BatchError::NotABatch(_))));
    }
}
