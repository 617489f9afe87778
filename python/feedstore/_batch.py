"""A batch of any Python structure as one feedstore object, and back as views over it.

Layout of the object::

    magic (8 bytes) | skeleton length (u64, little-endian) | skeleton | padding | tensor data

The skeleton is the batch pickled with every CPU tensor and numpy array replaced by a
persistent reference (kind, dtype, shape, offset, length): pickle carries the structure, the
strings and the numbers, never a tensor's bytes. Each tensor's bytes lie at a 64-byte-aligned
offset of the data region, written once by `Reservation.write` (a memcpy, without the GIL for
large ones). `default_collate`'s stacking is deferred (`Stacked`) so each sample's tensor is
copied straight into its slot of the batch tensor: the batch is written once, in place.

Reading makes every tensor a view of its bytes in the object (`Sample.buffer(offset, length)`
through DLPack: a storage per tensor), so the batch's tensors hold the object's lease: it goes
back to the store when the last of them is gone. In a trainer (a reader) they are read-only
memory (numpy arrays say so; torch tensors cannot); in a worker (a writer, mapping the store
read-write) a write would change the object for every reader, so workers read views only
(`_cache`) or ask for copies.
"""

from __future__ import annotations

import io
import pickle
import struct
import warnings
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np
import torch

import feedstore

MAGIC = b"FSBATCH1"
HEADER = struct.Struct("<8sQ")
ALIGN = 64


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


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
    from torch.utils.data._utils import collate as torch_collate

    table = dict(torch_collate.default_collate_fn_map)
    table[torch.Tensor] = stack_tensors
    for kind, rule in list(table.items()):
        if rule is torch_collate.collate_numpy_array_fn:
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
    from torch.utils.data._utils.collate import collate

    return collate(batch, collate_fn_map=_collate_map())


def _uint8(t: torch.Tensor) -> np.ndarray:
    """A dense CPU tensor's bytes as a flat uint8 array (no copy when already contiguous)."""
    t = t.detach().resolve_conj().resolve_neg().contiguous()
    return t.reshape(-1).view(torch.uint8).numpy()


def _leaf(obj: Any) -> Optional[Tuple[str, str, Tuple[int, ...], List[np.ndarray], int]]:
    """(kind, dtype, shape, byte sources, length) for what is stored as raw bytes; None for
    what is pickled."""
    if type(obj) is Stacked:
        parts = [_uint8(t) for t in obj.parts]
        return "torch", str(obj.dtype), obj.shape, parts, sum(p.nbytes for p in parts)
    if isinstance(obj, torch.Tensor):
        if (
            type(obj) not in (torch.Tensor, torch.nn.Parameter)
            or obj.layout != torch.strided
            or obj.device.type != "cpu"
            or obj.is_quantized
        ):
            return None
        flat = _uint8(obj)
        return "torch", str(obj.dtype), tuple(obj.shape), [flat], flat.nbytes
    if type(obj) is np.ndarray and not obj.dtype.hasobject and obj.dtype.fields is None:
        flat = np.ascontiguousarray(obj).reshape(-1).view(np.uint8)
        return "numpy", obj.dtype.str, obj.shape, [flat], flat.nbytes
    return None


class _Pickler(pickle.Pickler):
    """Pickles a batch, setting every tensor's bytes aside (`leaves`) with its place in the
    data region."""

    def __init__(self, out: io.BytesIO) -> None:
        super().__init__(out, protocol=pickle.HIGHEST_PROTOCOL)
        self.leaves: List[Tuple[int, List[np.ndarray]]] = []
        self.data_len = 0

    def persistent_id(self, obj: Any) -> Any:
        leaf = _leaf(obj)
        if leaf is None:
            return None
        kind, dtype, shape, parts, nbytes = leaf
        self.leaves.append((self.data_len, parts))
        reference = (kind, dtype, tuple(int(d) for d in shape), self.data_len, nbytes)
        self.data_len = _align(self.data_len + nbytes)
        return reference


def write(client: "feedstore.Client", batch: Any, pin: bool = False) -> str:
    """Writes `batch` as one object and returns its handle (`pin`: never evicted, only
    deleted)."""
    return fill(lambda nbytes: client.reserve(nbytes, pin=pin), batch).seal()


def fill(reserve: Callable[[int], "feedstore.Reservation"], batch: Any) -> "feedstore.Reservation":
    """Writes `batch` into a reservation of the size it needs (from `reserve`), unsealed."""
    out = io.BytesIO()
    pickler = _Pickler(out)
    pickler.dump(batch)
    skeleton = out.getbuffer()
    data_start = _align(HEADER.size + len(skeleton))
    reservation = reserve(data_start + pickler.data_len)
    reservation.write(0, HEADER.pack(MAGIC, len(skeleton)))
    reservation.write(HEADER.size, skeleton)
    for offset, parts in pickler.leaves:
        at = data_start + offset
        for part in parts:
            if part.nbytes:
                reservation.write(at, part)
            at += part.nbytes
    return reservation


_TORCH_DTYPES = {
    str(getattr(torch, name)): getattr(torch, name)
    for name in dir(torch)
    if isinstance(getattr(torch, name, None), torch.dtype)
}


class _Unpickler(pickle.Unpickler):
    """Loads a batch's skeleton, making each tensor reference a view of the object (or, as
    asked, a copy)."""

    def __init__(
        self,
        sample: "feedstore.Sample",
        raw: np.ndarray,
        skeleton_len: int,
        copy_numpy: bool,
        copy_torch: bool,
    ) -> None:
        super().__init__(io.BytesIO(raw[HEADER.size : HEADER.size + skeleton_len].tobytes()))
        self.sample = sample
        self.raw = raw
        self.data_start = _align(HEADER.size + skeleton_len)
        self.copy_numpy, self.copy_torch = copy_numpy, copy_torch

    def persistent_load(self, reference: Any) -> Any:
        kind, dtype, shape, offset, nbytes = reference
        at = self.data_start + offset
        if offset < 0 or nbytes < 0 or at + nbytes > len(self.raw):
            raise feedstore.Corrupt(f"a tensor at {offset}+{nbytes} lies outside the batch object")
        if kind == "numpy":
            array = self.raw[at : at + nbytes].view(np.dtype(dtype)).reshape(shape)
            return array.copy() if self.copy_numpy else array
        # A storage of its own per tensor (each holding the lease): `torch.save` of a batch or
        # of one tensor sees only that tensor's bytes.
        flat = torch.from_dlpack(self.sample.buffer(at, nbytes))
        tensor = flat.view(_TORCH_DTYPES[dtype]).view(shape)
        return tensor.clone() if self.copy_torch else tensor


def is_batch(sample: "feedstore.Sample") -> bool:
    """Whether `sample` holds an object made by `write` / `fill`."""
    return sample.nbytes >= HEADER.size and sample.data[: len(MAGIC)].tobytes() == MAGIC


def read(sample: "feedstore.Sample", copy_numpy: bool = False, copy_torch: bool = False) -> Any:
    """The batch in `sample` (an object made by `write`), its tensors views of the object
    (`copy_numpy`, `copy_torch`: writable copies instead)."""
    raw = sample.data
    if len(raw) < HEADER.size:
        raise feedstore.Corrupt(f"a batch object of {len(raw)} bytes has no header")
    magic, skeleton_len = HEADER.unpack(raw[: HEADER.size].tobytes())
    if magic != MAGIC or HEADER.size + skeleton_len > len(raw):
        raise feedstore.Corrupt("the object is not a feedstore batch")
    return _Unpickler(sample, raw, skeleton_len, copy_numpy, copy_torch).load()


def is_default_collate(fn: Optional[Callable]) -> bool:
    from torch.utils.data._utils import collate as torch_collate

    return fn is torch_collate.default_collate
