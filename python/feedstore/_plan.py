"""The sampler's side of ``feedstore.torch.DataLoader``, what both of its iterators share: each
epoch's indices drawn from the loader's sampler where and when torch draws them, the workers'
base seed, the random state an epoch starts from (saved for an exact resume), pinning, and the
iterator without workers (``num_workers=0``), which makes batches in the trainer's process."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.utils.data

from feedstore import _elastic
from feedstore import _torch_private as private
from feedstore._worker import _MISSING, _Fetcher, _WorkerArgs, _rng_state, _set_rng_state

if TYPE_CHECKING:
    from feedstore.loader import DataLoader

# Whether a torch profiler records (asked at each `next`; bound once, as a lookup costs too).
_profiler_enabled = private.profiler_enabled


def _generator_state(loader: "DataLoader") -> Any:
    """What the sampler draws from: the loader's generator, else the global random states
    (torch's, and Python's and numpy's, which custom samplers use)."""
    return loader.generator.get_state() if loader.generator is not None else _rng_state()




class _Epoch:
    """How an epoch's random draws start: from the loader's generator (or torch's global state)
    as it stands, or, on a resume, from the state saved at that epoch's start.

    torch draws the workers' base seed when an iterator is made (not again for persistent
    workers' later epochs) and the sampler's permutation at its first index (lazily). A
    resumed epoch makes the same draws from the saved state: the base seed (or, for a later
    epoch of persistent workers, the saved one) and then the first index at once, before the
    global state, when that is what it drew from, is put back (the trainer's own use of it is
    the trainer's to restore)."""

    @staticmethod
    def begin(loader: "DataLoader", it: Any, resume: Optional[dict], init) -> None:
        if resume is None or resume.get("rng") is None:
            it._rng_at_start = _generator_state(loader)
            it._draws_base_seed = True
            init()
            return
        saved_rng = resume["rng"]
        it._rng_at_start = saved_rng
        it._draws_base_seed = resume.get("draws_base_seed", True)
        current = _rng_state()
        try:
            if it._draws_base_seed:
                _Epoch._set(loader, saved_rng)
                init()
            else:
                init()  # its base seed draw is not this epoch's: the saved seed replaces it
                it._base_seed = resume["base_seed"]
                _Epoch._set(loader, saved_rng)
            it._prime()
        finally:
            if loader.generator is None:
                _set_rng_state(current)

    @staticmethod
    def _set(loader: "DataLoader", state: Any) -> None:
        if loader.generator is not None:
            loader.generator.set_state(state)
        else:
            _set_rng_state(state)


def _accelerator_available() -> bool:
    """Whether pinned memory means anything here (torch's test: an accelerator, else CUDA)."""
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and hasattr(accelerator, "is_available"):
        return accelerator.is_available()
    return torch.cuda.is_available()


def _pin(batch: Any) -> Any:
    """The batch with its tensors copied into pinned (page-locked) memory, as torch's
    ``pin_memory=True`` does: dicts, lists, tuples and named tuples walked, anything with a
    ``pin_memory()`` method pinned, the rest as it is."""
    if isinstance(batch, torch.Tensor) or (
        hasattr(batch, "pin_memory") and callable(batch.pin_memory) and not isinstance(batch, type)
    ):
        return batch.pin_memory()
    if isinstance(batch, dict):
        pinned = {key: _pin(value) for key, value in batch.items()}
        if type(batch) is dict:
            return pinned
        try:
            return type(batch)(pinned)
        except TypeError:
            return pinned
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(_pin(value) for value in batch))
    if isinstance(batch, (list, tuple)):
        pinned_items = [_pin(value) for value in batch]
        return pinned_items if isinstance(batch, list) else tuple(pinned_items)
    return batch


class _LoaderIter:
    """What both iterators take from their loader, through its public attributes, as torch's
    own iterators take it: an epoch's sampler iterator (`_sampler_iter`), the workers' base
    seed drawn from the loader's generator (at the same point of torch's, so the global random
    state moves as torch's does), and `__next__` with torch's profiler scope when a profiler
    records. The sampler's first index can be taken ahead (`_prime`: so that its random draw
    happens where it must on a resume)."""

    def _setup(self, loader: "DataLoader") -> None:
        self._dataset = loader.dataset
        self._iterable = isinstance(loader.dataset, torch.utils.data.IterableDataset)
        self._auto_collation = loader.batch_sampler is not None
        self._drop_last = loader.drop_last
        self._num_workers = loader.num_workers
        self._prefetch_factor = loader.prefetch_factor or 2  # (None on torch 2 without workers)
        self._pin_memory = bool(loader.pin_memory) and _accelerator_available()
        if loader.pin_memory and not self._pin_memory:
            warnings.warn(
                "'pin_memory' argument is set as true but no accelerator is found, then device "
                "pinned memory won't be used.",
                stacklevel=3,
            )
        self._timeout = loader.timeout
        self._collate_fn = loader.collate_fn
        self._persistent_workers = loader.persistent_workers
        self._profile_name = f"enumerate(DataLoader)#{type(self).__name__}.__next__"
        self._new_epoch(loader)
        self._base_seed = (
            torch.empty((), dtype=torch.int64).random_(generator=loader.generator).item()
        )

    def _new_epoch(self, loader: "DataLoader") -> None:
        # An epoch resumed at another world size (`_elastic`) reads the rank's part of what
        # the old ranks left in place of the sampler; later epochs are the sampler's.
        reshard, self._reshard_next = getattr(self, "_reshard_next", None), None
        if reshard is None:
            self._index_sampler = loader.batch_sampler if self._auto_collation else loader.sampler
        else:
            self._index_sampler = _elastic.share(reshard, loader)
        self._epoch_reshard = reshard
        self._epoch_sampler = _elastic.describe(loader)
        self._sampler_iter = iter(self._index_sampler)
        self._num_yielded = 0
        self._len_called = private.iterable_len_called(loader)
        self._primed: Optional[list] = None

    def __iter__(self) -> "_LoaderIter":
        return self

    def __len__(self) -> int:
        return len(self._index_sampler)

    def __getstate__(self) -> Any:
        raise NotImplementedError(f"{type(self).__name__} cannot be pickled")

    def close(self) -> None:
        """Stops what the iterator runs (its workers; nothing without workers)."""

    def __enter__(self) -> "_LoaderIter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __next__(self) -> Any:
        if _profiler_enabled():
            with torch.autograd.profiler.record_function(self._profile_name):
                return self._next_counted()
        return self._next_counted()

    def _next_counted(self) -> Any:
        data = self._next_data()
        self._num_yielded += 1
        expected = self._len_called
        if self._iterable and expected is not None and self._num_yielded > expected:
            warnings.warn(
                f"Length of IterableDataset {self._dataset} was reported to be {expected} (when "
                f"accessing len(dataloader)), but {self._num_yielded} samples have been fetched."
            )
        return data

    def _next_data(self) -> Any:
        raise NotImplementedError

    def _epoch_state(self) -> dict:
        """What a state says of the epoch's draws: the DistributedSampler's (what resuming at
        another world size needs) and, in a resharded epoch, its reshard."""
        state = {"sampler": self._epoch_sampler}
        if self._epoch_reshard is not None:
            state["reshard"] = self._epoch_reshard
        return state

    def _prime(self) -> None:
        try:
            self._primed = [next(self._sampler_iter)]
        except StopIteration:
            self._primed = []
            self._sampler_iter = iter(())

    def _next_index(self) -> Any:
        primed = self._primed
        if primed:
            return primed.pop()
        return next(self._sampler_iter)


def _draws_alone(sampler: Any) -> bool:
    """Whether, once its first index is drawn, the sampler's later indices touch no random
    state but their own: torch's samplers (exactly those types), which draw their whole order
    at the first index, or from a generator of their own made then. Such a sampler's next
    indices can be drawn on the receiving thread, off the trainer's `next`, with the same order
    and no draw moved past the trainer's own use of a random state. Any other sampler is drawn
    in the trainer's `next`, where torch draws it."""
    samplers = torch.utils.data.sampler
    if type(sampler) is samplers.BatchSampler:
        sampler = sampler.sampler
    if type(sampler) is samplers.RandomSampler:
        # A generator of the user's (perhaps the trainer's code draws from it too) is drawn
        # from past the first index: every 32 indices with replacement; without, at each pass
        # over the data and once more when it runs out (a permutation cut to the remainder,
        # drawn even when that is empty: with as many samples as the data, the default, that
        # draw falls inside a later `next`). Only fewer samples than the data draw just once.
        return sampler.generator is None or (
            not sampler.replacement and sampler.num_samples < len(sampler.data_source)
        )
    return type(sampler) in (
        samplers.SequentialSampler,
        samplers.SubsetRandomSampler,
        samplers.WeightedRandomSampler,
        torch.utils.data.distributed.DistributedSampler,
        _elastic._Share,
    )


class _InProcessIter(_LoaderIter):
    """`num_workers=0`: samples made and collated in the trainer's process, as torch's own
    in-process loading (there is nothing to hand over), with the state this loader saves and
    resumes, and `on_error="skip"`."""

    def __init__(self, loader: "DataLoader", resume: Optional[dict]) -> None:
        self._loader = loader
        self._reshard_next = (resume or {}).get("reshard")
        _Epoch.begin(loader, self, resume, lambda: self._setup(loader))
        if resume is None or resume.get("rng") is None:
            # torch's in-process iterator draws the permutation at the first `next`, not at
            # `iter`: the state to save is the one just before it (and the base seed, drawn
            # at `iter`, is saved as it is).
            self._rng_at_start = None
            self._draws_base_seed = False
        self._fetcher = _Fetcher(
            _WorkerArgs(
                worker_id=0, num_workers=0, dataset=self._dataset, iterable=self._iterable,
                auto_collation=self._auto_collation, collate_fn=self._collate_fn,
                drop_last=self._drop_last, base_seed=self._base_seed, init_fn=None,
                socket=None, on_error=loader.feedstore_on_error,
            ),
            into_store=False,
        )
        tasks = (resume or {}).get("tasks", 0)
        if self._iterable and tasks:
            # The batches the trainer had, made again and dropped; their random draws come
            # from (and go back to) the trainer's own random state, which is the trainer's.
            state = _rng_state()
            try:
                for _ in range(tasks):
                    try:
                        self._fetch(self._next_index())
                    except StopIteration:
                        break
                    except Exception:  # noqa: BLE001 (it failed so the first time, and said so)
                        pass
            finally:
                _set_rng_state(state)
        else:
            for _ in range(tasks):
                self._next_index()
        self._num_yielded = (resume or {}).get("batches", 0)
        self._tasks_taken = tasks
        self._ended = False
        self._closed = False

    def _next_index(self) -> Any:
        if self._rng_at_start is None:
            self._rng_at_start = _generator_state(self._loader)
        return super()._next_index()

    def _fetch(self, index: Any) -> Any:
        batch = self._fetcher.fetch(index)
        self._loader._feedstore_counts.skipped_samples += self._fetcher.skipped
        self._fetcher.skipped = 0
        return batch

    def close(self) -> None:
        """Ends the iterator: a later ``next`` raises StopIteration (there are no workers to
        stop)."""
        self._closed = True

    def _next_data(self) -> Any:
        if self._closed:
            raise StopIteration
        while True:
            try:
                batch = self._fetch(self._next_index())
            except StopIteration:
                self._ended = True
                raise
            except Exception:
                self._tasks_taken += 1  # a failed batch is behind the trainer too
                raise
            self._tasks_taken += 1
            if batch is _MISSING:
                continue  # every sample of the batch was skipped
            if self._pin_memory:
                batch = _pin(batch)
            return batch

    def feedstore_state(self) -> dict:
        finished = self._ended
        if not finished and not self._iterable:
            finished = self._tasks_taken >= len(self._index_sampler)
        return {
            "tasks": self._tasks_taken,
            "batches": self._num_yielded,
            "finished": finished,
            "rng": self._rng_at_start,
            "draws_base_seed": self._draws_base_seed,
            "base_seed": self._base_seed,
            **self._epoch_state(),
        }
