"""The decode-once cache of `feedstore.torch.DataLoader(sample_cache=True)`.

A worker that makes `dataset[i]` files the sample in the store, as an object of its own (the
batch format of `_batch`, unpinned: evicted, least recently used first, when a batch needs the
room), under a key: a hash of the index and of the cache's namespace (the loader's pool key:
the pickled dataset, collate_fn and worker_init_fn, the source of their modules, the daemon,
feedstore and Python). Any worker of this uid on the node that needs the same sample, in any
epoch, any rank, any job with the same key, maps it instead of making it again.

Only samples that are a function of their index may be shared. The user says so by asking for
the cache; a sample whose making changed Python's, numpy's or torch's global random state (a
random augmentation drawing from them) is never filed, and counted. Skipping a sample found in
the cache then leaves those random states as making it would have, so the batches stay torch's.
What this cannot see: draws from a generator of the dataset's own, or under `fork_rng` (the
state put back after), or changes the net draw hides.
"""

from __future__ import annotations

import hashlib
import pickle
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence

import numpy as np

import feedstore
from . import _batch


# A sample looked up and not found after all (evicted since the lookup).
_GONE = object()


@dataclass
class Counts:
    """What one batch did with the cache."""

    # Samples mapped from the cache instead of made.
    hits: int = 0
    # Samples made and filed.
    filed: int = 0
    # Samples made and not filed: their making moved a global random state.
    random: int = 0
    # Samples made and not filed: no room without waiting, a sample or an index that does not
    # pickle, or another worker filed the same sample first.
    unfiled: int = 0

    def add(self, other: "Counts") -> None:
        self.hits += other.hits
        self.filed += other.filed
        self.random += other.random
        self.unfiled += other.unfiled


def same_random_state(a: tuple, b: tuple) -> bool:
    """Whether two `_rng_state()`s (Python, numpy, torch) are equal."""
    (python_a, numpy_a, torch_a), (python_b, numpy_b, torch_b) = a, b
    return (
        python_a == python_b
        and torch_a == torch_b
        and numpy_a[0] == numpy_b[0]
        and np.array_equal(numpy_a[1], numpy_b[1])
        and tuple(numpy_a[2:]) == tuple(numpy_b[2:])
    )


class SampleCache:
    """One worker's use of the cache. `views`: samples found are handed to the collate as
    views of their objects, for feedstore's own `default_collate`, which only reads them; else
    every tensor and array is a copy the user's `collate_fn` may change."""

    def __init__(
        self,
        client: "feedstore.Client",
        namespace: bytes,
        views: bool,
        random_state: Callable[[], tuple],
        classes: tuple = (),
    ) -> None:
        self.client = client
        self.namespace = namespace
        self.views = views
        self.random_state = random_state
        self.classes = classes

    def key(self, index: Any) -> Optional[int]:
        """The sample's key (never 0), or None for an index that does not pickle."""
        try:
            raw = pickle.dumps(index, protocol=4)
        except Exception:  # noqa: BLE001 (any index the user's sampler yields)
            return None
        digest = hashlib.blake2b(raw, digest_size=16, key=self.namespace[:64]).digest()
        return int.from_bytes(digest, "little") or 1

    def samples(
        self, indices: Sequence[Any], make: Callable[[Any], Any], missing: Any
    ) -> "tuple[List[Any], Counts]":
        """`make(i)` for each index, in order (`missing` where it skipped the sample): mapped
        from the cache where a worker filed it, else made and, when its making left the random
        states alone, filed."""
        counts = Counts()
        keys = [self.key(i) for i in indices]
        wanted = [k for k in keys if k is not None]
        try:
            found = dict(zip(wanted, self.client.cache_lookup(wanted))) if wanted else {}
        except feedstore.FeedstoreError:
            found = {}  # (the batch's write says what is wrong with the store)
        out: List[Any] = []
        filing: List[tuple] = []
        try:
            for index, key in zip(indices, keys):
                handle = found.get(key)
                item = self._read(handle) if handle is not None else _GONE
                if item is not _GONE:
                    counts.hits += 1
                    out.append(item)
                    continue
                before = self.random_state()
                item = make(index)
                out.append(item)
                if item is missing:
                    continue
                if not same_random_state(before, self.random_state()):
                    counts.random += 1
                    continue
                handle = self._write(item) if key is not None else None
                if handle is None:
                    counts.unfiled += 1
                else:
                    filing.append((key, handle))
        finally:
            counts.filed = self._file(filing)
            counts.unfiled += len(filing) - counts.filed
        return out, counts

    def _read(self, handle: str) -> Any:
        """The sample filed as `handle`, or `_GONE` when it was evicted since the lookup (or is
        not a sample: never filed by this module)."""
        try:
            sample = self.client.get(handle)
            if not _batch.is_batch(sample):
                return _GONE
            return _batch.read(
                sample,
                copy_numpy=not self.views,
                copy_torch=not self.views,
                classes=self.classes,
            )
        except Exception:  # noqa: BLE001 (gone, or it no longer reads: a class not allowed)
            return _GONE

    def _write(self, item: Any) -> Optional[str]:
        """`item` as an object of its own (evictable), or None when the store has no room for
        it without waiting, or a batch cannot hold it (a class not in `batch_classes`)."""
        try:
            reserve = lambda n: self.client.reserve(n, timeout=0)  # noqa: E731
            return _batch.fill(reserve, item, self.classes).seal()
        except feedstore.Full:
            return None
        except Exception:  # noqa: BLE001 (whatever the user's sample raises when walked)
            return None

    def _file(self, filing: List[tuple]) -> int:
        """Files what was written; an object the daemon did not take (another worker's copy
        filed first, the cache's bound) is deleted: nothing would find it. How many were
        filed."""
        if not filing:
            return 0
        try:
            taken = self.client.cache_insert(filing)
        except feedstore.FeedstoreError:
            taken = [False] * len(filing)
        for (_, handle), ok in zip(filing, taken):
            if not ok:
                try:
                    self.client.delete(handle)
                except feedstore.FeedstoreError:
                    pass  # (gone with the daemon)
        return sum(taken)
