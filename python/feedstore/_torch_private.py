"""Every piece of torch's private API this package uses, in one place (tested on each supported
torch by tests/test_torch_private.py: 1.13 and 2.1 to the current release).

The DataLoader is built on torch's public API (samplers, ``default_collate``,
``get_worker_info``, ``torch.multiprocessing``). What cannot be:

- ``get_worker_info()`` reads a module global of torch's worker loop, and torch has no public
  way to set it for a worker it did not start: `set_worker_info`.
- ``default_collate``'s rules per type (``collate_fn_map``, public since torch 1.13 as an
  argument of ``torch.utils.data._utils.collate.collate``): feedstore's collate replaces the
  tensor rule to defer the stack to the batch's write (`collate`, `default_collate_fn_map`,
  `collate_numpy_array_fn`).
- How torch seeds numpy in a worker (a hash of the base seed and the worker id, a private
  function): reimplemented here (`numpy_seed`) and checked against torch's where it has one.
- Whether the autograd profiler records (torch's own ``__next__`` opens a profiler scope;
  entering one costs 0.1-0.3 ms a batch, so it is opened only when one records).
- How often ``len()`` of an iterable dataset's loader was taken (for torch's warning when it
  yields more batches than that).

A name missing from a future torch fails at import with the name, not in a worker.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional

import torch
from torch.utils.data import _utils as _data_utils

# `collate(batch, collate_fn_map=...)`: default_collate with its table of rules per type.
collate: Callable[..., Any] = _data_utils.collate.collate
default_collate_fn_map: dict = _data_utils.collate.default_collate_fn_map
collate_numpy_array_fn: Callable[..., Any] = _data_utils.collate.collate_numpy_array_fn

WorkerInfo = _data_utils.worker.WorkerInfo


def set_worker_info(info: Optional[Any]) -> None:
    """What ``torch.utils.data.get_worker_info()`` returns in this process from now on."""
    _data_utils.worker._worker_info = info


def worker_info() -> Optional[Any]:
    return _data_utils.worker._worker_info


_MASK32 = 0xFFFFFFFF


def numpy_seed(base_seed: int, worker_id: int) -> List[int]:
    """The seed torch's worker loop gives ``np.random.seed`` in worker `worker_id`: four 32-bit
    words of a hash of the two (numpy's SeedSequence hash, as torch writes it)."""
    init_a, mult_a, init_b, mult_b = 0x43B0D7E5, 0x931E8875, 0x8B51F9DD, 0x58F38DED
    mix_l, mix_r, shift = 0xCA01F9DD, 0x4973F715, 16
    const_a = init_a

    def hash_a(value: int) -> int:
        nonlocal const_a
        value = (value ^ const_a) & _MASK32
        const_a = (const_a * mult_a) & _MASK32
        value = (value * const_a) & _MASK32
        return (value ^ (value >> shift)) & _MASK32

    def mix(x: int, y: int) -> int:
        result = ((mix_l * x) & _MASK32) - ((mix_r * y) & _MASK32)
        result &= _MASK32
        return (result ^ (result >> shift)) & _MASK32

    entropy = [worker_id, base_seed & _MASK32, base_seed >> 32, 0]
    pool = [hash_a(value) for value in entropy]
    for src in range(4):
        for dst in range(4):
            if src != dst:
                pool[dst] = mix(pool[dst], hash_a(pool[src]))
    const_b, state = init_b, []
    for value in pool:
        value = (value ^ const_b) & _MASK32
        const_b = (const_b * mult_b) & _MASK32
        value = (value * const_b) & _MASK32
        state.append((value ^ (value >> shift)) & _MASK32)
    return state


def profiler_enabled() -> bool:
    return torch.autograd._profiler_enabled()


def iterable_len_called(loader: Any) -> Optional[int]:
    """An iterable dataset's length, once ``len(loader)`` asked for it (else None)."""
    return getattr(loader, "_IterableDataset_len_called", None)
