"""A batch of any Python structure as one feedstore object, and back as views over it, without
pickle: reading a batch never runs code of its writer's choosing.

Layout of the object (``feedstore_proto::batch``, parsed and checked in Rust)::

    "FSBATCH2" | skeleton length (u64) | skeleton | padding | tensor data

The skeleton is the batch's structure in a tagged encoding of plain values: None, bool, int,
float, complex, str, bytes, list, tuple, dict, ``OrderedDict``, and references to tensors and
arrays (kind, dtype, shape, offset, length) whose bytes lie at 64-byte-aligned offsets of the
data region, written once by ``Reservation.write`` (a memcpy, without the GIL for large ones).
``default_collate``'s stacking is deferred (``Stacked``) so each sample's tensor is copied
straight into its slot of the batch tensor: the batch is written once, in place.

Anything else (a user's class, a named tuple, a PIL image) is refused when written, unless the
writer and every reader pass that class in ``classes`` (``DataLoader(batch_classes=...)``): then
it is stored as its class's name and its state, as pickle would reduce it, and a reader rebuilds
it from its own list of classes (``__new__`` and ``__setstate__``, or the instance dict), never
importing anything by name. Trust rule: list only classes that are safe to rebuild from any
state at all (their ``__new__``, ``__setstate__``, ``append`` / ``__setitem__`` for their items,
and, for a class whose own ``__reduce__`` calls itself, its constructor, all run with what the
bytes hold): a uid allowed to write to the store can rewrite any object's bytes.

And a reader reads only batches written by a uid it trusts: the writer's uid, recorded by the
daemon when the object was created (``Sample.writer_uid``), must be root's, the reader's own, or
one the user passes (``trusted_uids``); otherwise ``feedstore.UntrustedBatch``, before a byte of
the structure is parsed. Objects in the pickled format of earlier releases (``FSBATCH1``) are
refused the same way.

Reading makes every tensor a view of its bytes in the object (``Sample.buffer(offset, length)``
through DLPack: a storage per tensor), so the batch's tensors hold the object's lease: it goes
back to the store when the last of them is gone. They lie in a copy-on-write view of the
object of the reader's own (``Sample.private()``, one ``mmap`` per batch), so they are as
writable as torch's: a write copies the pages it touches and no other reader sees it, in a
trainer or in a worker (whose own mapping of the store is read-write).
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Iterable, List, Optional, Sequence, Tuple

import numpy as np
import torch

import feedstore

from feedstore import _native

class Stacked:
    """`torch.stack(parts)`, deferred: the parts are copied straight into the batch object."""

    __slots__ = ("parts", "shape", "dtype")

    def __init__(self, parts: Sequence[torch.Tensor]) -> None:
        self.parts = list(parts)
        self.shape = (len(self.parts), *self.parts[0].shape)
        self.dtype = self.parts[0].dtype

    def __reduce__(self):
        # Pickled outside a batch (a user's own queue): the stacked tensor itself.
        return (torch.stack, (self.parts,))


def stack_tensors(batch: Sequence[torch.Tensor], *, collate_fn_map=None) -> Any:
    """`default_collate`'s tensor rule with the copy deferred to the batch's write. Anything
    `torch.stack` would treat differently (dtypes or shapes that differ, tensors that are not
    dense CPU ones) is left to `torch.stack` itself, so the result is always torch's."""
    first = batch[0]
    if all(
        type(t) is torch.Tensor
        and t.layout == torch.strided
        and t.device.type == "cpu"
        and t.dtype == first.dtype
        and t.shape == first.shape
        for t in batch
    ):
        return Stacked(batch)
    return torch.stack(batch, 0)


def _collate_map() -> dict:
    from feedstore import _torch_private as private

    table = dict(private.default_collate_fn_map)
    table[torch.Tensor] = stack_tensors
    for kind, rule in list(table.items()):
        if rule is private.collate_numpy_array_fn:
            table[kind] = _numpy_arrays(rule)
    return table


def _numpy_arrays(rule: Callable) -> Callable:
    """torch's rule for numpy arrays (each made a tensor over the same memory, then stacked),
    quiet about read-only arrays: a sample from the decode-once cache is a view of its object,
    which the stacking only reads, so it is not copied to be made writable first."""

    def collate_numpy_arrays(batch: Sequence[Any], *, collate_fn_map=None) -> Any:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            return rule(batch, collate_fn_map=collate_fn_map)

    return collate_numpy_arrays


def default_collate(batch: List[Any]) -> Any:
    """torch's `default_collate`, with tensor stacking deferred to the write (see `Stacked`)."""
    from feedstore import _torch_private as private

    return private.collate(batch, collate_fn_map=_collate_map())


# Element types by the code a batch stores (`feedstore_proto::batch::Elem`): plain numbers only.
_TORCH_DTYPES = [
    getattr(torch, name, None)
    for name in (
        "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
        "float16", "bfloat16", "float32", "float64", "complex64", "complex128",
    )
]
_NUMPY_DTYPES = [
    np.dtype(name) if name else None
    for name in (
        "bool", "<u1", "<i1", "<i2", "<i4", "<i8", "<u2", "<u4", "<u8",
        "<f2", None, "<f4", "<f8", "<c8", "<c16",
    )
]
_TORCH_CODES = {dtype: code for code, dtype in enumerate(_TORCH_DTYPES) if dtype is not None}
_NUMPY_CODES = {dtype: code for code, dtype in enumerate(_NUMPY_DTYPES) if dtype is not None}
# Fixed-width text (numpy's "<U": 4 bytes a character) and bytes ("S"), each with its width.
TEXT, BYTES = 15, 16
# The numpy scalar types a batch holds (what `np.float32(1.5)` and `np.str_("a")` are).
_NUMPY_SCALARS = frozenset({d.type for d in _NUMPY_CODES} | {np.str_, np.bytes_})
TENSOR, ARRAY, SCALAR = 0, 1, 2


def _uint8(t: torch.Tensor) -> np.ndarray:
    """A dense CPU tensor's bytes as a flat uint8 array (no copy when already contiguous)."""
    t = t.detach().resolve_conj().resolve_neg().contiguous()
    return t.reshape(-1).view(torch.uint8).numpy()


def _torch_code(t: torch.Tensor) -> int:
    code = _TORCH_CODES.get(t.dtype)
    if code is None:
        raise TypeError(f"a batch cannot hold a tensor of {t.dtype}")
    return code


def _numpy(array: np.ndarray) -> Tuple[int, int, np.ndarray]:
    """An array's element code, width (text and bytes) and bytes, little-endian and
    contiguous."""
    dtype = array.dtype
    if dtype.byteorder == ">":
        dtype = dtype.newbyteorder("<")
        array = array.astype(dtype)
    if dtype.kind == "U" and dtype.itemsize:
        code, width = TEXT, dtype.itemsize // 4
    elif dtype.kind == "S" and dtype.itemsize:
        code, width = BYTES, dtype.itemsize
    else:
        code, width = _NUMPY_CODES.get(dtype), 0
    if code is None:
        raise TypeError(
            f"a batch cannot hold a numpy array of {array.dtype} (numbers, bools, fixed-width "
            "text and bytes only: an object array would need its objects pickled)"
        )
    return code, width, np.ascontiguousarray(array).reshape(-1).view(np.uint8)


def _numpy_dtype(code: int, width: int) -> np.dtype:
    if code == TEXT:
        return np.dtype(f"<U{width}")
    if code == BYTES:
        return np.dtype(f"S{width}")
    dtype = _NUMPY_DTYPES[code]
    if dtype is None:
        raise feedstore.Corrupt(f"a numpy leaf of dtype code {code}")
    return dtype


def _leaf(obj: Any) -> Optional[Tuple[int, int, int, Tuple[int, ...], int, List[np.ndarray]]]:
    """(kind, dtype code, width, shape, byte length, byte sources) for what is stored as raw
    bytes in the data region; None for everything else."""
    if type(obj) is Stacked:
        parts = [_uint8(t) for t in obj.parts]
        shape = tuple(int(d) for d in obj.shape)
        return TENSOR, _torch_code(obj.parts[0]), 0, shape, sum(p.nbytes for p in parts), parts
    if isinstance(obj, torch.Tensor):
        if type(obj) not in (torch.Tensor, torch.nn.Parameter):
            raise TypeError(f"a batch cannot hold a {type(obj).__name__} (a tensor subclass)")
        if obj.layout != torch.strided or obj.device.type != "cpu" or obj.is_quantized:
            raise TypeError(
                f"a batch holds dense CPU tensors only, not one on {obj.device} with layout "
                f"{obj.layout}"
            )
        flat = _uint8(obj)
        return TENSOR, _torch_code(obj), 0, tuple(int(d) for d in obj.shape), flat.nbytes, [flat]
    if type(obj) is np.ndarray:
        code, width, flat = _numpy(obj)
        return ARRAY, code, width, tuple(int(d) for d in obj.shape), flat.nbytes, [flat]
    if type(obj) in _NUMPY_SCALARS:
        code, width, flat = _numpy(np.asarray(obj))
        return SCALAR, code, width, (), flat.nbytes, [flat]
    return None


def write(
    client: "feedstore.Client",
    batch: Any,
    pin: bool = False,
    classes: Iterable[type] = (),
) -> str:
    """Writes `batch` as one object and returns its handle (`pin`: never evicted, only
    deleted)."""
    return fill(lambda nbytes: client.reserve(nbytes, pin=pin), batch, classes).seal()


def fill(
    reserve: Callable[[int], "feedstore.Reservation"],
    batch: Any,
    classes: Iterable[type] = (),
) -> "feedstore.Reservation":
    """Writes `batch` into a reservation of the size it needs (from `reserve`), unsealed.
    `TypeError` for what a batch cannot hold (see the module's documentation)."""
    skeleton, leaves, data_len = _native.encode_batch(batch, _leaf, list(classes))
    header, data_start = _native.batch_header(len(skeleton))
    reservation = reserve(data_start + data_len)
    reservation.write(0, header)
    reservation.write(len(header), skeleton)
    for offset, parts in leaves:
        at = data_start + offset
        for part in parts:
            if part.nbytes:
                reservation.write(at, part)
            at += part.nbytes
    return reservation


def is_batch(sample: "feedstore.Sample") -> bool:
    """Whether `sample` holds a batch object (of this format, or of the pickled one that
    `read` refuses)."""
    return _native.is_batch(sample)


def read(
    sample: "feedstore.Sample",
    copy_numpy: bool = False,
    copy_torch: bool = False,
    classes: Iterable[type] = (),
    trusted_uids: Iterable[int] = (),
) -> Any:
    """The batch in `sample` (an object made by `write`), its tensors views of the object
    (`copy_numpy`, `copy_torch`: writable copies instead). `feedstore.UntrustedBatch` if the
    uid that wrote it is not root's, this process's or one of `trusted_uids`, or it holds a
    class not in `classes`; `feedstore.Corrupt` if it does not parse."""
    if not copy_torch and not sample.writable:
        # One copy-on-write view for all the tensors (each DLPack export of a read-only
        # sample would map one of its own).
        sample = sample.private()
    raw = sample.data

    def make_leaf(
        kind: int, code: int, width: int, shape: Tuple[int, ...], offset: int, nbytes: int
    ) -> Any:
        if kind == TENSOR:
            dtype = _TORCH_DTYPES[code]
            if dtype is None:
                raise feedstore.Corrupt(f"the batch holds a tensor of a dtype this torch lacks")
            # A storage of its own per tensor (each holding the lease): `torch.save` of a batch
            # or of one tensor sees only that tensor's bytes.
            flat = torch.from_dlpack(sample.buffer(offset, nbytes))
            tensor = flat.view(dtype).view(shape)
            return tensor.clone() if copy_torch else tensor
        array = raw[offset : offset + nbytes].view(_numpy_dtype(code, width))
        if kind == SCALAR:
            return array[0]
        array = array.reshape(shape)
        return array.copy() if copy_numpy else array

    return _native.decode_batch(sample, make_leaf, list(classes), [int(u) for u in trusted_uids])


def is_default_collate(fn: Optional[Callable]) -> bool:
    return fn is torch.utils.data.default_collate
