//! Batches as Python structures, written and read without pickle: the walk between Python
//! objects and [`feedstore_proto::batch::Value`], whose encoding cannot name code.
//!
//! Writing (`encode_batch`) walks a structure of exact builtin types (None, bool, int, float,
//! complex, str, bytes, list, tuple, dict, `OrderedDict`); everything else goes to the caller's
//! `leaf` function, which describes tensors and arrays (their bytes go to the data region), and
//! then to the user's allowed classes, reduced as pickle would (`__reduce_ex__(4)`) but only into
//! this format. Anything else is a `TypeError` naming the type: a batch never holds what a
//! reader cannot rebuild without running code of the writer's choosing.
//!
//! Reading (`decode_batch`) first checks who wrote the object (the uid the daemon recorded,
//! against the uids the reader trusts), then parses and validates the whole skeleton in Rust,
//! then builds the structure. The only classes it ever calls are builtins, `OrderedDict`, and
//! classes the reader listed itself, looked up in that list by name (never imported).

use std::collections::HashMap;

use feedstore_proto::batch::{self, Build, Elem, Leaf, LeafKind, Object, Value};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{
    PyBool, PyBytes, PyComplex, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple, PyType,
};

use crate::errors::{Corrupt, UntrustedBatch};
use crate::sample::Sample;

/// `module:qualname` of a class, as a batch names it.
fn class_name(cls: &Bound<'_, PyType>) -> PyResult<String> {
    Ok(format!(
        "{}:{}",
        cls.getattr("__module__")?.extract::<String>()?,
        cls.getattr("__qualname__")?.extract::<String>()?
    ))
}

/// The classes a user allowed, by the name a batch gives them.
fn allowed<'py>(
    classes: Option<&Bound<'py, PyAny>>,
) -> PyResult<HashMap<String, Bound<'py, PyType>>> {
    let mut out = HashMap::new();
    if let Some(classes) = classes {
        for item in classes.try_iter()? {
            let cls = item?.cast_into::<PyType>().map_err(|e| {
                PyTypeError::new_err(format!(
                    "batch_classes holds {}, not a class",
                    e.into_inner()
                ))
            })?;
            out.insert(class_name(&cls)?, cls);
        }
    }
    Ok(out)
}

struct Encoder<'py> {
    leaf: Bound<'py, PyAny>,
    classes: HashMap<String, Bound<'py, PyType>>,
    ordered_dict: Bound<'py, PyAny>,
    newobj: Bound<'py, PyAny>,
    /// Leaves found so far: the bytes sources the caller writes, at their offsets.
    leaves: Vec<(u64, Bound<'py, PyAny>)>,
    /// Leaves by object identity: an object met twice is stored once. The object is kept
    /// alive with its entry, so its address cannot be another object's later in the walk (a
    /// temporary a class's `__reduce_ex__` made and dropped).
    seen: HashMap<usize, (Bound<'py, PyAny>, Value)>,
    data_len: u64,
}

impl<'py> Encoder<'py> {
    fn value(&mut self, obj: &Bound<'py, PyAny>, depth: usize) -> PyResult<Value> {
        if depth >= batch::MAX_DEPTH {
            return Err(PyValueError::new_err(format!(
                "the batch nests deeper than {} levels (or refers to itself)",
                batch::MAX_DEPTH
            )));
        }
        let py = obj.py();
        let depth = depth + 1;
        if obj.is_none() {
            return Ok(Value::None);
        }
        if obj.is_exact_instance_of::<PyBool>() {
            return Ok(Value::Bool(obj.extract()?));
        }
        if obj.is_exact_instance_of::<PyInt>() {
            if let Ok(i) = obj.extract::<i64>() {
                return Ok(Value::Int(i));
            }
            let negative: bool = obj.lt(0)?;
            let magnitude = if negative {
                obj.call_method0("__invert__")?
            } else {
                obj.clone()
            };
            let bits: usize = magnitude.call_method0("bit_length")?.extract()?;
            let n = (bits + 8) / 8;
            if n > batch::MAX_BIG_INT_BYTES {
                return Err(PyValueError::new_err(format!(
                    "an int of {bits} bits is too large for a batch"
                )));
            }
            let kwargs = PyDict::new(py);
            kwargs.set_item("signed", true)?;
            let bytes = obj.call_method("to_bytes", (n, "little"), Some(&kwargs))?;
            return Ok(Value::BigInt(bytes.extract()?));
        }
        if obj.is_exact_instance_of::<PyFloat>() {
            return Ok(Value::Float(obj.extract::<f64>()?.to_bits()));
        }
        if obj.is_exact_instance_of::<PyComplex>() {
            let c = obj.cast::<PyComplex>()?;
            return Ok(Value::Complex(c.real().to_bits(), c.imag().to_bits()));
        }
        if obj.is_exact_instance_of::<PyString>() {
            return Ok(Value::Str(obj.extract()?));
        }
        if obj.is_exact_instance_of::<PyBytes>() {
            return Ok(Value::Bytes(obj.cast::<PyBytes>()?.as_bytes().to_vec()));
        }
        if obj.is_exact_instance_of::<PyList>() {
            let items = obj
                .cast::<PyList>()?
                .iter()
                .map(|item| self.value(&item, depth))
                .collect::<PyResult<_>>()?;
            return Ok(Value::List(items));
        }
        if obj.is_exact_instance_of::<PyTuple>() {
            let items = obj
                .cast::<PyTuple>()?
                .iter()
                .map(|item| self.value(&item, depth))
                .collect::<PyResult<_>>()?;
            return Ok(Value::Tuple(items));
        }
        if obj.is_exact_instance_of::<PyDict>() || obj.get_type().is(&self.ordered_dict) {
            let ordered = !obj.is_exact_instance_of::<PyDict>();
            let mut pairs = Vec::new();
            for item in obj.call_method0("items")?.try_iter()? {
                let (k, v): (Bound<'py, PyAny>, Bound<'py, PyAny>) = item?.extract()?;
                pairs.push((self.value(&k, depth)?, self.value(&v, depth)?));
            }
            return Ok(if ordered {
                Value::OrderedDict(pairs)
            } else {
                Value::Dict(pairs)
            });
        }
        let key = obj.as_ptr() as usize;
        if let Some((_, v)) = self.seen.get(&key) {
            return Ok(v.clone());
        }
        let described = self.leaf.call1((obj,))?;
        if !described.is_none() {
            let v = self.store_leaf(&described)?;
            self.seen.insert(key, (obj.clone(), v.clone()));
            return Ok(v);
        }
        self.object(obj, depth)
    }

    /// A leaf the caller described as `(kind, dtype code, width, shape, nbytes, source)`:
    /// placed in the data region, its source kept for the caller to write there.
    fn store_leaf(&mut self, described: &Bound<'py, PyAny>) -> PyResult<Value> {
        type Described<'py> = (u8, u8, u32, Vec<u64>, u64, Bound<'py, PyAny>);
        let (kind, elem, width, shape, nbytes, source): Described<'py> = described.extract()?;
        let kind = LeafKind::from_u8(kind)
            .ok_or_else(|| PyValueError::new_err(format!("leaf kind {kind}")))?;
        let elem =
            Elem::from_u8(elem).ok_or_else(|| PyValueError::new_err(format!("dtype {elem}")))?;
        let offset = self.data_len;
        let leaf = Leaf::checked(kind, elem, width, shape, offset, nbytes)
            .map_err(PyValueError::new_err)?;
        self.data_len = (offset + nbytes).next_multiple_of(batch::ALIGN);
        self.leaves.push((offset, source));
        Ok(Value::Leaf(leaf))
    }

    /// An object of a class the user allowed, reduced as pickle would, into this format.
    fn object(&mut self, obj: &Bound<'py, PyAny>, depth: usize) -> PyResult<Value> {
        let cls = obj.get_type();
        let name = class_name(&cls)?;
        if !self.classes.get(&name).is_some_and(|c| c.is(&cls)) {
            return Err(PyTypeError::new_err(format!(
                "a batch cannot hold a {name} by default: a reader would have to run its code \
                 to rebuild it. Return dicts, lists, tuples, numbers, strings, tensors and \
                 arrays from collate_fn, or list the class in batch_classes= \
                 (DataLoader(batch_classes=[...]); to_torch(..., batch_classes=[...]) where \
                 such objects are read) if it is safe to rebuild from any state"
            )));
        }
        let reduced = obj.call_method1("__reduce_ex__", (4,))?;
        let parts = reduced.cast::<PyTuple>().map_err(|_| {
            PyTypeError::new_err(format!("{name}.__reduce_ex__ did not return a tuple"))
        })?;
        let part = |i: usize| -> Bound<'py, PyAny> {
            parts
                .get_item(i)
                .unwrap_or_else(|_| obj.py().None().into_bound(obj.py()))
        };
        if parts.len() < 2 || parts.len() > 6 || !part(5).is_none() {
            return Err(PyTypeError::new_err(format!(
                "{name} reduces to a form a batch cannot hold"
            )));
        }
        let (callable, args) = (part(0), part(1));
        let args = args.cast_into::<PyTuple>().map_err(|_| {
            PyTypeError::new_err(format!("{name} reduces with arguments not a tuple"))
        })?;
        let (build, args) =
            if callable.is(&self.newobj) && args.len() >= 1 && args.get_item(0)?.is(&cls) {
                (Build::New, args.get_slice(1, args.len()))
            } else if callable.is(&cls) {
                (Build::Call, args)
            } else {
                return Err(PyTypeError::new_err(format!(
                    "{name} reduces to a call of {}, not of its class: a batch cannot hold it",
                    callable.repr()?
                )));
            };
        let list_items = match part(3) {
            items if items.is_none() => Value::None,
            items => Value::List(
                items
                    .try_iter()?
                    .map(|item| self.value(&item?, depth))
                    .collect::<PyResult<_>>()?,
            ),
        };
        let dict_items = match part(4) {
            items if items.is_none() => Value::None,
            items => {
                let mut pairs = Vec::new();
                for item in items.try_iter()? {
                    let (k, v): (Bound<'py, PyAny>, Bound<'py, PyAny>) = item?.extract()?;
                    pairs.push((self.value(&k, depth)?, self.value(&v, depth)?));
                }
                Value::Dict(pairs)
            }
        };
        Ok(Value::Object(Box::new(Object {
            class: name,
            build,
            args: self.value(args.as_any(), depth)?,
            state: self.value(&part(2), depth)?,
            list_items,
            dict_items,
        })))
    }
}

/// A walked batch: its skeleton, each leaf's byte source at its offset, the data region's size.
type Encoded<'py> = (Bound<'py, PyBytes>, Vec<(u64, Bound<'py, PyAny>)>, u64);

/// The slot names `cls` and its bases declare (`__slots__`).
fn declared_slots(cls: &Bound<'_, PyType>) -> PyResult<std::collections::HashSet<String>> {
    let mut names = std::collections::HashSet::new();
    for klass in cls.getattr("__mro__")?.try_iter()? {
        let Ok(slots) = klass?.getattr("__dict__")?.get_item("__slots__") else {
            continue;
        };
        if let Ok(one) = slots.extract::<String>() {
            names.insert(one);
        } else {
            for name in slots.try_iter()? {
                names.insert(name?.extract()?);
            }
        }
    }
    Ok(names)
}

/// Walks `batch` into a skeleton: `(skeleton, [(offset, source)], data_len)`. `leaf(obj)`
/// describes a tensor or array as `(kind, dtype code, width, shape, nbytes, source)` or
/// returns None;
/// `classes` are the classes besides the builtins a batch may hold.
#[pyfunction]
#[pyo3(signature = (batch, leaf, classes=None))]
pub fn encode_batch<'py>(
    batch: &Bound<'py, PyAny>,
    leaf: Bound<'py, PyAny>,
    classes: Option<&Bound<'py, PyAny>>,
) -> PyResult<Encoded<'py>> {
    let py = batch.py();
    let mut encoder = Encoder {
        leaf,
        classes: allowed(classes)?,
        ordered_dict: py.import("collections")?.getattr("OrderedDict")?,
        newobj: py.import("copyreg")?.getattr("__newobj__")?,
        leaves: Vec::new(),
        seen: HashMap::new(),
        data_len: 0,
    };
    let value = encoder.value(batch, 0)?;
    let skeleton = batch::encode(&value);
    Ok((
        PyBytes::new(py, &skeleton),
        encoder.leaves,
        encoder.data_len,
    ))
}

struct Decoder<'py> {
    make_leaf: Bound<'py, PyAny>,
    classes: HashMap<String, Bound<'py, PyType>>,
    data_start: u64,
}

impl<'py> Decoder<'py> {
    fn build(&self, py: Python<'py>, value: &Value) -> PyResult<Bound<'py, PyAny>> {
        Ok(match value {
            Value::None => py.None().into_bound(py),
            Value::Bool(b) => PyBool::new(py, *b).to_owned().into_any(),
            Value::Int(i) => i.into_pyobject(py)?.into_any(),
            Value::BigInt(bytes) => {
                let kwargs = PyDict::new(py);
                kwargs.set_item("signed", true)?;
                py.get_type::<PyInt>().call_method(
                    "from_bytes",
                    (PyBytes::new(py, bytes), "little"),
                    Some(&kwargs),
                )?
            }
            Value::Float(bits) => PyFloat::new(py, f64::from_bits(*bits)).into_any(),
            Value::Complex(re, im) => {
                PyComplex::from_doubles(py, f64::from_bits(*re), f64::from_bits(*im)).into_any()
            }
            Value::Str(s) => PyString::new(py, s).into_any(),
            Value::Bytes(b) => PyBytes::new(py, b).into_any(),
            Value::List(items) => PyList::new(py, self.all(py, items)?)?.into_any(),
            Value::Tuple(items) => PyTuple::new(py, self.all(py, items)?)?.into_any(),
            Value::Dict(pairs) => self.dict(py, pairs)?.into_any(),
            Value::OrderedDict(pairs) => {
                let pairs: Vec<Bound<'py, PyTuple>> = pairs
                    .iter()
                    .map(|(k, v)| PyTuple::new(py, [self.build(py, k)?, self.build(py, v)?]))
                    .collect::<PyResult<_>>()?;
                py.import("collections")?
                    .getattr("OrderedDict")?
                    .call1((PyList::new(py, pairs)?,))?
            }
            Value::Leaf(leaf) => self.make_leaf.call1((
                leaf.kind as u8,
                leaf.elem as u8,
                leaf.width,
                PyTuple::new(py, &leaf.shape)?,
                self.data_start + leaf.offset,
                leaf.nbytes,
            ))?,
            Value::Object(o) => self.object(py, o)?,
        })
    }

    fn all(&self, py: Python<'py>, items: &[Value]) -> PyResult<Vec<Bound<'py, PyAny>>> {
        items.iter().map(|v| self.build(py, v)).collect()
    }

    fn dict(&self, py: Python<'py>, pairs: &[(Value, Value)]) -> PyResult<Bound<'py, PyDict>> {
        let dict = PyDict::new(py);
        for (k, v) in pairs {
            dict.set_item(self.build(py, k)?, self.build(py, v)?)?;
        }
        Ok(dict)
    }

    /// Rebuilds an object of an allowed class as pickle's `NEWOBJ`/`REDUCE` and `BUILD` would,
    /// with the class taken from the reader's own list, never imported by name. Narrower than
    /// pickle: the class is called with arguments (`Build::Call`) only if it defines its own
    /// `__reduce__` or `__reduce_ex__` (so reduces that way itself), and slot state sets only
    /// the slots the class declares.
    fn object(&self, py: Python<'py>, o: &Object) -> PyResult<Bound<'py, PyAny>> {
        let Some(cls) = self.classes.get(&o.class) else {
            return Err(UntrustedBatch::new_err(format!(
                "the batch holds a {}, a class this reader was not told to accept: pass it in \
                 batch_classes= if its writer is trusted",
                o.class
            )));
        };
        let Value::Tuple(args) = &o.args else {
            return Err(Corrupt::new_err("an object's arguments are not a tuple"));
        };
        let args = PyTuple::new(py, self.all(py, args)?)?;
        let obj = match o.build {
            Build::New => {
                let mut with_cls = vec![cls.clone().into_any()];
                with_cls.extend(args.iter());
                cls.call_method1("__new__", PyTuple::new(py, with_cls)?)?
            }
            Build::Call => {
                let object = py.import("builtins")?.getattr("object")?;
                let own = |name: &str| -> PyResult<bool> {
                    Ok(!cls.getattr(name)?.is(&object.getattr(name)?))
                };
                if !own("__reduce__")? && !own("__reduce_ex__")? {
                    return Err(UntrustedBatch::new_err(format!(
                        "the batch calls {} with arguments, but that class does not reduce to \
                         a call of itself",
                        o.class
                    )));
                }
                cls.call1(args)?
            }
        };
        if !matches!(o.state, Value::None) {
            let state = self.build(py, &o.state)?;
            if let Ok(setstate) = obj.getattr("__setstate__") {
                setstate.call1((state,))?;
            } else {
                let (state, slots) = match state.cast::<PyTuple>() {
                    Ok(t) if t.len() == 2 => (t.get_item(0)?, Some(t.get_item(1)?)),
                    _ => (state.clone(), None),
                };
                if !state.is_none() {
                    let Ok(attributes) = obj.getattr("__dict__") else {
                        return Err(UntrustedBatch::new_err(format!(
                            "the batch sets instance attributes on a {}, which has none",
                            o.class
                        )));
                    };
                    attributes.call_method1("update", (state,))?;
                }
                if let Some(slots) = slots.filter(|s| !s.is_none()) {
                    let declared = declared_slots(cls)?;
                    for item in slots.call_method0("items")?.try_iter()? {
                        let (k, v): (String, Bound<'py, PyAny>) = item?.extract()?;
                        if !declared.contains(&k) {
                            return Err(UntrustedBatch::new_err(format!(
                                "the batch sets {k:?} on a {}, which declares no such slot",
                                o.class
                            )));
                        }
                        obj.setattr(k.as_str(), v)?;
                    }
                }
            }
        }
        if let Value::List(items) = &o.list_items {
            for item in items {
                obj.call_method1("append", (self.build(py, item)?,))?;
            }
        }
        if let Value::Dict(pairs) = &o.dict_items {
            for (k, v) in pairs {
                obj.set_item(self.build(py, k)?, self.build(py, v)?)?;
            }
        }
        Ok(obj)
    }
}

/// Reads the batch object `sample` holds, if a trusted uid wrote it: every leaf becomes
/// `make_leaf(kind, dtype code, width, shape, offset, nbytes)` (offsets from the object's
/// start), every object of a class in `classes` is rebuilt, and nothing else is called. `trusted`:
/// the uids whose batches this reader accepts besides root's and this process's own.
#[pyfunction]
#[pyo3(signature = (sample, make_leaf, classes=None, trusted=Vec::new()))]
pub fn decode_batch<'py>(
    sample: &Bound<'py, Sample>,
    make_leaf: Bound<'py, PyAny>,
    classes: Option<&Bound<'py, PyAny>>,
    trusted: Vec<u32>,
) -> PyResult<Bound<'py, PyAny>> {
    let py = sample.py();
    let s = sample.get();
    let me = nix::unistd::geteuid().as_raw();
    {
        // Memory of this process (no writer recorded) is not a batch object of the store's.
        let writer = s.writer().unwrap_or(u32::MAX);
        if s.writer() == Some(feedstore_proto::frame::Got::UNKNOWN_WRITER) {
            return Err(UntrustedBatch::new_err(format!(
                "batch object {} came from a feedstored that does not record who wrote its \
                 objects (feedstore 0.1.0, protocol 9, lacks the 'writers' feature), so this \
                 reader cannot check that a trusted uid wrote it: upgrade feedstored to read \
                 batches",
                s.handle_text()
            )));
        }
        if writer != 0 && writer != me && !trusted.contains(&writer) {
            return Err(UntrustedBatch::new_err(format!(
                "batch object {} was written by uid {writer}, which this reader (uid {me}) does \
                 not trust: its structure is not read. Pass trusted_uids=[{writer}] if that \
                 user's batches are yours to read",
                s.handle_text()
            )));
        }
    }
    let (value, data_start) = batch::parse(s.held_bytes()).map_err(|e| match e {
        batch::BatchError::Pickled => {
            UntrustedBatch::new_err(format!("object {}: {e}", s.handle_text()))
        }
        e => Corrupt::new_err(format!("object {}: {e}", s.handle_text())),
    })?;
    let decoder = Decoder {
        make_leaf,
        classes: allowed(classes)?,
        data_start,
    };
    decoder.build(py, &value)
}

/// Whether `sample` holds a batch object (of this format, or the pickled one of earlier
/// releases, which `decode_batch` refuses with a reason).
#[pyfunction]
pub fn is_batch(sample: &Bound<'_, Sample>) -> bool {
    batch::is_batch(sample.get().held_bytes())
}

/// The header of a batch object with a skeleton of `skeleton_len` bytes, and where its data
/// region starts.
#[pyfunction]
pub fn batch_header(py: Python<'_>, skeleton_len: usize) -> (Bound<'_, PyBytes>, u64) {
    (
        PyBytes::new(py, &batch::header(skeleton_len)),
        batch::data_start(skeleton_len),
    )
}
