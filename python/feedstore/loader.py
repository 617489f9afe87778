"""``feedstore.torch.DataLoader``: torch's DataLoader with its worker-to-trainer hand-off through
feedstore's shared memory.

The user's code is unchanged: the same constructor, the same ``dataset[i]`` / ``__iter__`` and
``collate_fn`` running in worker processes, the same batches in the same order (the sampler and
the seeds are drawn exactly as torch draws them, and each worker's random state is torch's).
What changes is the hand-off: a worker writes each batch once into the node's feedstore as one
object (``feedstore._batch``: the structure in an encoding that cannot run code, every
tensor's bytes copied in place, ``default_collate``'s stack written straight into the batch)
and sends the trainer its handle through a pipe; the trainer maps the object and gets tensors
over it. Nothing of a batch is pickled, and there is no ``/dev/shm`` file per tensor.

Beyond torch: ``state_dict()`` / ``load_state_dict()`` resume exactly (the next batch is the one
an uninterrupted run would have yielded, prefetched ones included), a worker killed mid-batch is
started again and makes its batches again, and ``on_error="skip"`` drops samples whose
``__getitem__`` raises, counting them.

Worker processes talk to the trainer over one pipe each (indices in, handles out); the trainer
waits on every pipe and every worker's process sentinel at once, so a dead worker is seen at
once, not after a timeout.

Where each part lives: the worker side, what runs in a worker process (``_worker``); the
sampler's side, each epoch's draws, its resume and the iterator without workers (``_plan``); the
iterator with workers, dispatching tasks and taking batches in order (``_store_iter``); the
threads that carry tasks out and replies in (``_transport``); starting, restarting and stopping
the workers (``_lifecycle``); the node's pool (``_pool``), batches in the store (``_batch``) and
the decode-once cache (``_cache``); an epoch resumed at another number of ranks
(``_elastic``). The imports run one way, from this module down to
``_worker``.

Stopping: ``close()`` (or leaving ``with loader:`` / ``with iter(loader) as batches:``) stops
the workers at once and gives their batches back. Without it they stop at the epoch's end
(unless ``persistent_workers``), on an error, at interpreter exit, or, as a backstop, when the
iterator is collected.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import sys
import weakref
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.utils.data

import feedstore
from feedstore import _elastic, _lifecycle, _pool
from feedstore._plan import _InProcessIter
from feedstore._store_iter import _StoreIter

__all__ = ["DataLoader"]

STATE_VERSION = 1


@dataclass
class _Counters:
    batches: int = 0
    worker_restarts: int = 0
    # Batches made again because their object went with a daemon that went away.
    batches_remade: int = 0
    skipped_samples: int = 0
    failed_batches: int = 0
    handoff_seconds: float = 0.0
    # The decode-once cache (`sample_cache=True`): samples mapped from it instead of made,
    # made and filed, made and not filed because making them moved a random state, and made
    # and not filed (no room without waiting, does not pickle, filed by another worker first).
    cache_hits: int = 0
    cache_filed: int = 0
    cache_random: int = 0
    cache_unfiled: int = 0


def _tensor_identity(obj: Any) -> Optional[str]:
    """A tensor as the pool key sees it: dtype, shape and bytes (torch's own pickle names its
    storage by address, which differs from process to process)."""
    if not isinstance(obj, torch.Tensor) or obj.layout != torch.strided or obj.is_quantized:
        return None
    try:
        raw = obj.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    except (RuntimeError, TypeError):
        return None  # (pickled as torch does: a pool of this process's own)
    return f"torch.Tensor {obj.dtype} {tuple(obj.shape)} {hashlib.sha256(raw).hexdigest()}"


class DataLoader(torch.utils.data.DataLoader):
    """``torch.utils.data.DataLoader`` with worker batches handed over through feedstore.

    Takes torch's arguments (and passes any others on to torch), plus:

    - ``socket``: the node's feedstored (default: ``$FEEDSTORE_SOCKET``, else this user's,
      else the system daemon's). Needed only with ``num_workers > 0``.
    - ``on_error``: ``"raise"`` (torch's behaviour: the worker's exception is raised in the
      trainer, with the sample's index and the worker's traceback) or ``"skip"`` (the sample is
      left out of its batch and counted in ``feedstore_counters.skipped_samples``; a batch with
      no samples left is skipped).
    - ``pool``: ``"rank"`` (each trainer its own ``num_workers`` processes, as torch) or
      ``"node"`` (one pool per node: worker ``w`` of every trainer on this node with the same
      key is one process, so local ranks and the jobs of a sweep share ``num_workers``
      processes). The key: the pickle of the dataset, ``collate_fn`` and ``worker_init_fn``,
      the source files of the modules of their classes and functions, the daemon's socket
      (configure data through the dataset's attributes: module globals are the starting
      trainer's). Each trainer's worker is a session with its own random states and worker
      info, so its batches are torch's when samples depend on their index and those random
      states; the dataset object, module globals, and the environment, cgroup, CPU affinity
      and memory the process inherited from the trainer that started it are shared.
      Map-style datasets, fork start method; ``worker_init_fn`` runs once per trainer's worker
      in the shared process; a process makes one batch at a time and leaves
      ``FEEDSTORE_POOL_LINGER_SECONDS`` (default 10) after its last trainer.
    - ``sample_cache``: ``True`` shares each sample made among the workers of the node (the
      decode-once cache): a worker files ``dataset[i]`` in the store, and any worker of this
      user with the same key (as ``pool``'s: this loader's other epochs, the other local ranks,
      other jobs over the same data) maps it instead of making it again. Only for datasets whose
      ``dataset[i]`` depends on ``i`` alone: a sample whose making moved Python's, numpy's or
      torch's global random state (a random augmentation) is never filed
      (``feedstore_counters.cache_random``), nor one that does not pickle. Filed samples fill
      the store's free room and are evicted, least recently used first, when batches need it:
      size ``--capacity`` for both. Map-style datasets with workers. The key sees what the
      dataset object holds, not settings it reads from module globals or the environment: a
      later job gets the samples an earlier one filed under the same key.
    - ``batch_classes``: classes besides the builtins (dict, list, tuple, str, numbers, None),
      tensors and numpy arrays that a batch, or a cached sample, may hold: a named tuple, a
      dataclass, a ``transformers.BatchEncoding``. Batches cross processes without pickle: a
      class not listed is a ``TypeError`` in the worker, and a reader rebuilds a listed class
      from its state with the class it was given (``__new__``, then ``__setstate__`` or the
      instance dict), never by importing a name the bytes carry. List only classes that are
      safe to rebuild from any state at all: a uid allowed to write to the store can rewrite
      any object's bytes (docs/SECURITY.md).

    Batches are torch's, element for element. Their tensors are views of one shared-memory
    object, mapped copy-on-write into the trainer: reading copies nothing, and in-place ops work
    as on torch's batches (``labels[labels == pad] = -100``), each first write to a 4 KiB page
    copying that page into the trainer's own memory, seen by nobody else. The object goes back
    to the store when the last of a batch's tensors is gone.
    """

    def __init__(
        self,
        *args: Any,
        socket: Optional[str] = None,
        on_error: str = "raise",
        pool: str = "rank",
        sample_cache: bool = False,
        batch_classes: Any = (),
        **kwargs: Any,
    ) -> None:
        if not isinstance(sample_cache, bool):
            raise TypeError(f"sample_cache={sample_cache!r}: expected True or False")
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error={on_error!r}: expected 'raise' or 'skip'")
        if pool not in ("rank", "node"):
            raise ValueError(f"pool={pool!r}: expected 'rank' or 'node'")
        self.feedstore_socket = socket
        self.feedstore_on_error = on_error
        self.feedstore_pool = pool
        self.feedstore_sample_cache = sample_cache
        self.feedstore_batch_classes = tuple(batch_classes)
        for cls in self.feedstore_batch_classes:
            if not isinstance(cls, type):
                raise TypeError(f"batch_classes holds {cls!r}, not a class")
        self._feedstore_counts = _Counters()
        # The warning that sample_cache filed nothing: made once, said by the next `next`.
        self._cache_warned = False
        self._cache_warning: Optional[str] = None
        self._feedstore_resume: Optional[dict] = None
        # The latest iterator: held strongly only for persistent workers (as torch does), so
        # that an iterator the trainer drops stops its workers; what it last stood at is kept.
        self._feedstore_current: Any = None
        self._feedstore_last: Optional[dict] = None
        self._feedstore_generation = 0
        # torch's arguments, positional or not, as torch takes them.
        super().__init__(*args, **kwargs)
        iterable = isinstance(self.dataset, torch.utils.data.IterableDataset)
        if sample_cache and (self.num_workers == 0 or iterable):
            raise ValueError(
                "sample_cache=True needs workers (num_workers > 0) and a map-style dataset: "
                "samples are filed by their index, by the workers that make them"
            )
        if pool == "node" and self.num_workers > 0:
            if iterable:
                raise ValueError(
                    "pool='node' shares workers of map-style datasets only: an iterable "
                    "dataset's workers each hold their own place in its stream"
                )
            context = self.multiprocessing_context or multiprocessing.get_context()
            if context.get_start_method() != "fork":
                raise ValueError(
                    "pool='node' forks the pool's processes from the trainer (they get its "
                    f"dataset as forked workers do); the start method is "
                    f"{context.get_start_method()!r}: pass multiprocessing_context='fork'"
                )

    def _feedstore_pool_key(self) -> str:
        """The node pool's key: what its processes run (and which daemon, feedstore and Python
        they run with). Hashed for each iterator, as torch forks its workers for each: a
        dataset changed between epochs gets a pool of its own, and a dataset holding its data
        in memory is pickled (into the hash, not into memory) each time."""
        _pool.linger_seconds()  # (a bad value is the trainer's error, not a silent process's)
        return _pool.digest(
            (self.dataset, self.collate_fn, self.worker_init_fn),
            self.feedstore_socket,
            os.environ.get("FEEDSTORE_SOCKET"),
            feedstore.__version__,
            sys.executable,
            identity=_tensor_identity,
        )

    def _feedstore_take_resume(self) -> Optional[dict]:
        resume, self._feedstore_resume = self._feedstore_resume, None
        if resume is not None and resume.get("finished"):
            # Saved at an epoch's end: the next epoch starts afresh from the random state the
            # saved one left (a generator's; the global one is the trainer's to restore).
            if self.generator is not None and resume.get("rng_after") is not None:
                self.generator.set_state(resume["rng_after"])
            return None
        return resume

    @property
    def feedstore_counters(self) -> _Counters:
        """The loader's counters, summed over its life (see the class's note)."""
        book = getattr(self._feedstore_iterator(), "_book_taken", None)
        if book is not None:
            book()  # (batches `next` took and the outbox thread has not booked yet)
        return self._feedstore_counts

    def _feedstore_iterator(self) -> Any:
        current = self._feedstore_current
        return current() if isinstance(current, weakref.ref) else current

    def _feedstore_remember(self, state: dict) -> None:
        self._feedstore_last = state

    def __iter__(self) -> Any:
        pending = self._feedstore_resume
        resume = self._feedstore_take_resume()
        current = self._feedstore_iterator()
        reuse = (
            self.persistent_workers
            and resume is None
            and isinstance(current, _StoreIter)
            and not current._shut
        )
        if reuse:
            iterator = current
            try:
                iterator._reset(self)
            except BaseException:
                iterator._shutdown()  # (a timeout, Ctrl-C, a worker that kept dying)
                raise
        else:
            self._feedstore_generation += 1  # a new iterator: the state to keep is its
            try:
                if self.num_workers == 0:
                    iterator = _InProcessIter(self, resume)
                else:
                    iterator = _StoreIter(self, resume)
            except BaseException:
                # Refused (a resharded epoch another than the sampler's) or not started: the
                # next iteration resumes the same state, not the ordinary epoch.
                self._feedstore_resume = pending
                raise
        # (Without workers there is nothing to stop: the iterator is kept.)
        keep = self.persistent_workers or self.num_workers == 0
        self._feedstore_current = iterator if keep else weakref.ref(iterator)
        self._feedstore_last = None
        return iterator

    def close(self) -> None:
        """Stops the workers of every live iterator of this loader (persistent or not) and
        gives their batches back; batches already taken stay valid, and those iterators end
        (a later ``next`` raises StopIteration). The loader can be iterated again afterwards,
        with new workers: with ``persistent_workers``, that next epoch draws a new base seed,
        as torch's does for a new iterator. Processes of a node pool (``pool="node"``) stay
        for ``FEEDSTORE_POOL_LINGER_SECONDS`` to serve other trainers. Leaving
        ``with loader:`` calls it."""
        for iterator in [it for it in list(_lifecycle._LIVE) if it._loader is self]:
            iterator.close()
        current = self._feedstore_iterator()
        if current is not None:
            current.close()

    def __enter__(self) -> "DataLoader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def state_dict(self) -> dict:
        """Where the current epoch stands: `load_state_dict` on a new loader (same dataset,
        sampler, batch size and workers) makes its next batch the one this loader would
        yield next. Save it with the trainer's checkpoint; under data parallelism, save every
        rank's (a list of them resumes at another number of ranks: `load_state_dict`)."""
        state: dict = {"version": STATE_VERSION, "num_workers": self.num_workers}
        current = self._feedstore_iterator()
        if self._feedstore_resume is not None:
            state.update(self._feedstore_resume)  # loaded, not iterated yet: still where it was
            return state
        if current is not None and not getattr(current, "_shut", False):
            state.update(current.feedstore_state())
        elif self._feedstore_last is not None:
            state.update(self._feedstore_last)
        else:
            state.update(tasks=0, batches=0, finished=False, rng=None)
            sampler = _elastic.describe(self)  # at the start of the sampler's epoch
            if sampler is not None:
                state["sampler"] = sampler
            return state
        # Where a finished epoch left the loader's generator: the next epoch starts there.
        state["rng_after"] = self.generator.get_state() if self.generator is not None else None
        return state

    def load_state_dict(self, state: Any) -> None:
        """Makes the next iteration resume where `state` (from `state_dict`) stood.

        Under data parallelism with torch's ``DistributedSampler``, `state` may be the list of
        every rank's ``state_dict()`` of a run with another number of ranks (saved in the same
        epoch, at any batch of it): this rank then reads its part of what the old ranks left of
        their epoch, none the old ranks read, in as many batches on every rank: dealt as the
        sampler deals an epoch, so the last round is padded by repeating samples left (or cut,
        with the sampler's ``drop_last``), and the batch sampler's ``drop_last`` drops a short
        last batch as in any epoch. The epoch after is the new world's ordinary one. Call
        ``sampler.set_epoch`` with the saved epoch before iterating, as after any resume (the
        next one if every rank had finished it). With as many ranks as before, the list resumes
        this rank from its own state."""
        if isinstance(state, (list, tuple)):
            resume = _elastic.plan(list(state), self)
            if resume is None:
                self._feedstore_resume = None  # nothing left of the epoch: the next starts
                return
            if "version" not in resume:
                resume = {"version": STATE_VERSION, "num_workers": self.num_workers, **resume}
            state = resume
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            version = state.get("version") if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"not a feedstore DataLoader state (version {version})")
        if state["num_workers"] != self.num_workers:
            raise ValueError(
                f"the state was saved with num_workers={state['num_workers']}, this loader has "
                f"{self.num_workers}: batches would come from other workers' random states"
            )
        saved, now = state.get("sampler"), _elastic.describe(self)
        if saved and now and (saved.get("world"), saved.get("rank")) != (now["world"], now["rank"]):
            raise ValueError(
                f"the state is rank {saved.get('rank')}'s of {saved.get('world')} ranks and this "
                f"loader's sampler is rank {now['rank']} of {now['world']}: pass the list of "
                "every rank's state to resume at another number of ranks"
            )
        self._feedstore_resume = state
