"""The iterator of a loader with workers: tasks dispatched in torch's order, batches taken in
order as the pump maps them, a worker's death survived, and where the epoch stands
(``feedstore_state``) for an exact resume. Its workers' lives (start, restart, stop) are
``_lifecycle._Workers``'; the threads that carry tasks and replies are in ``_transport``."""

from __future__ import annotations

import collections
import multiprocessing
import os
import threading
import time
import warnings
import weakref
from typing import TYPE_CHECKING, Any, Deque, Dict, List, Optional

import feedstore
from feedstore import _batch
from feedstore._lifecycle import _LIVE, _Worker, _Workers, exiting
from feedstore._plan import (
    _Epoch,
    _LoaderIter,
    _draws_alone,
    _generator_state,
    _pin,
    _profiler_enabled,
)
from feedstore._transport import _Outbox, _Task, _TimedOut, _filler, _pump
from feedstore._worker import POLL_SECONDS, _Raised

if TYPE_CHECKING:
    from feedstore.loader import DataLoader


class _StoreIter(_Workers, _LoaderIter):
    """One epoch (or, with persistent workers, every epoch) of a loader with workers.

    Two threads share it under `_cond`: the trainer's (`_next_data`: dispatching indices,
    taking batches in order) and `_pump` (replies, deaths, mapping batches). Task ids count up
    across the epochs of persistent workers, so a late reply from an earlier epoch is known as
    such."""

    def __init__(self, loader: "DataLoader", resume: Optional[dict]) -> None:
        self._loader = loader
        self._generation = loader._feedstore_generation
        self._shut = False
        self._thread: Optional[threading.Thread] = None
        self._tasks: Dict[int, _Task] = {}
        self._send_idx = self._rcvd_idx = self._epoch_start = 0
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        # Taken by `next`'s fast path, not booked yet (appended without the lock, popped under it).
        self._taken: Deque[_Task] = collections.deque()
        self._error: Optional[BaseException] = None
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_write, False)  # (full: a wake is pending anyway)
        # Whether the sampler's next indices are drawn behind the trainer's back, by the outbox
        # thread (see `_draws_alone`); off while an epoch's bookkeeping is set up.
        self._draws_behind = False
        self._outbox = _Outbox()
        self._outbox.on_fill = _filler(weakref.ref(self))
        self._workers: List[Optional[_Worker]] = []
        self._reshard_next = (resume or {}).get("reshard")
        _Epoch.begin(loader, self, resume, lambda: self._setup(loader))
        self._context = loader.multiprocessing_context or multiprocessing.get_context()
        self._workers = [None] * self._num_workers
        self._base_args = dict(
            num_workers=self._num_workers,
            dataset=self._dataset,
            iterable=self._iterable,
            auto_collation=self._auto_collation,
            collate_fn=self._collate_fn,
            drop_last=self._drop_last,
            base_seed=self._base_seed,
            init_fn=loader.worker_init_fn,
            socket=loader.feedstore_socket,
            on_error=loader.feedstore_on_error,
            classes=loader.feedstore_batch_classes,
            replay_index=[None] * (loader.batch_size or 1) if self._auto_collation else None,
        )
        self._pool_key: Optional[str] = None
        try:
            if loader.feedstore_pool == "node":
                self._pool_key = loader._feedstore_pool_key()
            if loader.feedstore_sample_cache:
                try:
                    key = self._pool_key or loader._feedstore_pool_key()
                except TypeError as e:
                    raise TypeError(
                        "sample_cache=True files samples under a key made from the pickle of "
                        "the dataset, collate_fn and worker_init_fn, and one of them does not "
                        f"pickle ({e.__cause__!r}): make them picklable (no lambdas or open "
                        "files), or leave the cache off"
                    ) from e.__cause__
                self._base_args["cache"] = bytes.fromhex(key)
            saved = (resume or {}).get("workers")
            if self._pool_key is not None:
                joined = self._join_pool(
                    {w: saved["rng"][w] if saved else None for w in range(self._num_workers)}
                )
                for w, worker in joined.items():
                    self._workers[w] = worker
            for w in range(self._num_workers):
                rng = saved["rng"][w] if saved else None
                taken = saved["tasks"][w] if saved else 0
                if self._pool_key is None:
                    self._start_worker(w, rng=rng, replay=taken if self._iterable else 0)
                worker = self._workers[w]
                worker.done = worker.taken = taken
                worker.rng = worker.taken_rng = rng
                worker.active = saved["active"][w] if saved else True
            # Connected after the workers are forked, so they do not hold its socket open.
            self._client = feedstore.Client(loader.feedstore_socket, name="DataLoader trainer")
            with self._cond:
                self._begin(resume)
        except BaseException:
            self._shutdown()
            raise
        self._thread = threading.Thread(
            target=_pump, args=(weakref.ref(self),), name="feedstore DataLoader", daemon=True
        )
        self._thread.start()
        _LIVE.add(self)

    # The epoch's bookkeeping (also run again for each epoch of persistent workers).
    def _begin(self, resume: Optional[dict]) -> None:
        tasks = (resume or {}).get("tasks", 0)
        self._num_yielded = (resume or {}).get("batches", 0)
        if not self._iterable:
            for _ in range(tasks):
                self._next_index()  # batches the trainer already had: their indices, skipped
        self._tasks = {}
        self._epoch_start = self._send_idx
        self._send_idx = self._rcvd_idx = self._epoch_start + tasks
        if self._iterable and resume:
            self._next_worker = resume["next_worker"]
        else:
            self._next_worker = tasks % max(1, self._num_workers)
        self._sampler_done = False
        for _ in range(self._prefetch_factor * self._num_workers):
            self._try_put_index()
        # An iterable dataset's workers end at times of their own, and which of them is still
        # active decides where each later task goes: those are dispatched where torch does.
        self._draws_behind = not self._iterable and _draws_alone(self._index_sampler)

    def _reset(self, loader, first_iter=False) -> None:
        """A new epoch on the same (persistent) workers, as torch's `_reset`: a new sampler
        iterator, no new seeds. Tasks of the last epoch still out are dropped as they come."""
        with self._cond:
            self._draws_behind = False  # (until `_begin` has set the new epoch up)
            self._book()
            self._rng_at_start = _generator_state(loader)
            self._draws_base_seed = False
            self._new_epoch(loader)
            for worker in self._workers:
                if worker is not None:
                    self._outbox.send(worker.conn, "epoch")
                    worker.active = True
                    worker.in_epoch = False
            # As torch waits for its workers' acknowledgements: their tasks of the last epoch
            # come first, and the random state each then has is where this epoch starts.
            # (Within the loader's timeout, as torch's; `__iter__` stops the iterator then.)
            deadline = time.monotonic() + self._timeout if self._timeout > 0 else None
            while not all(w.in_epoch for w in self._workers if w):
                if self._error is not None:
                    raise self._error
                if self._shut:
                    raise RuntimeError("the DataLoader was closed while its next epoch started")
                wait = POLL_SECONDS if deadline is None else deadline - time.monotonic()
                if wait <= 0:
                    raise RuntimeError(
                        f"DataLoader timed out after {self._timeout} seconds waiting for its "
                        "workers to finish the last epoch's batches and start the next"
                    )
                self._cond.wait(min(wait, POLL_SECONDS))
            for worker in self._workers:
                if worker is not None:
                    worker.done = worker.taken = 0
            self._begin(None)

    def _try_put_index(self) -> None:
        if self._sampler_done or not any(w.active for w in self._workers if w):
            return
        # (A snapshot: `next`'s fast path deletes from `_tasks` without the lock.)
        outstanding = sum(1 for t in list(self._tasks.values()) if t.reply is None)
        if outstanding >= self._prefetch_factor * self._num_workers:
            return
        try:
            index = self._next_index()
        except StopIteration:
            self._sampler_done = True
            return
        while True:
            w = self._next_worker
            self._next_worker = (w + 1) % self._num_workers
            if self._workers[w] is not None and self._workers[w].active:
                break
        self._tasks[self._send_idx] = _Task(worker=w, index=index)
        self._outbox.send(self._workers[w].conn, (self._send_idx, index))
        self._send_idx += 1

    def __next__(self) -> Any:
        if _profiler_enabled():
            return super().__next__()  # inside the profiler's record_function, as torch's
        # torch's `__next__` without the profiler's scope (some 0.1-0.3 ms a batch when no
        # profiler runs), first its fast path: the next batch mapped, a sampler drawn behind
        # (by the outbox thread). What is left of `next` then is Python run with caches cold
        # after the trainer's step (0.01-0.03 ms a line), so it does the least it can: the
        # batch is booked against its worker (`_book`) by the outbox thread, which it wakes
        # anyway (`want_fill`: the window refilled).
        #
        # It takes no lock: each step is one operation on a dict, a deque or an attribute only
        # this thread writes (`_rcvd_idx`, `_num_yielded`), atomic in CPython; the other
        # threads read `_tasks` through snapshots (`list(...)`), and the pump sets a task's
        # batch after its reply. `_draws_behind` is off once the iterator stopped or failed.
        try:
            tasks, index = self._tasks, self._rcvd_idx
            task = tasks.get(index)
            batch = None if task is None else task.batch
            if batch is not None and self._draws_behind:
                tasks.pop(index, None)  # (None: a shutdown from another thread cleared them)
                self._rcvd_idx = index + 1
                self._taken.append(task)
                self._outbox.want_fill()
                self._num_yielded += 1  # (map-style: no length to check)
                task.batch = None
                if self._loader._cache_warning is not None:
                    self._say_nothing_filed()
                return batch
        except BaseException:
            self._shutdown()  # (Ctrl-C: as `_next_data`)
            raise
        return self._next_counted()

    def _next_data(self) -> Any:
        if self._shut:
            raise StopIteration
        try:
            with self._cond:
                task = self._next_task()
                if task is not None:
                    batch, error = self._take(task)
        except _TimedOut:
            raise  # (as torch's: the iterator stays, and a later `next` waits for the batch again)
        except BaseException:
            # Ctrl-C, a worker that keeps dying: stop the workers (and give their batches back)
            # before it propagates; the iterator is done.
            self._shutdown()
            raise
        if task is None:
            if not self._persistent_workers:
                self._shutdown()
            raise StopIteration
        if error is not None:
            # One batch's error (as torch: the iterator goes on with the next batch).
            if isinstance(error, _Raised):
                error.reraise()
            raise error
        if self._loader._cache_warning is not None:
            self._say_nothing_filed()
        return batch

    def _next_task(self) -> Optional[_Task]:
        """The next task with a batch or an error (None at the epoch's end), waiting up to the
        loader's timeout; tasks with nothing to yield are booked and passed over."""
        self._book()
        timeout = self._timeout if self._timeout > 0 else None
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._error is not None:
                raise self._error
            if self._shut:
                return None  # (closed from another thread: the epoch ends here)
            while self._rcvd_idx < self._send_idx:
                task = self._tasks[self._rcvd_idx]
                if task.reply is not None or self._workers[task.worker].active:
                    break
                del self._tasks[self._rcvd_idx]  # its worker's dataset ended before it
                self._rcvd_idx += 1
            if self._rcvd_idx >= self._send_idx:
                if self._draws_behind and not self._sampler_done:
                    self._try_put_index()  # (taken before the pump drew the next)
                    if self._rcvd_idx < self._send_idx:
                        continue
                return None
            task = self._tasks[self._rcvd_idx]
            if task.reply is None:
                wait = POLL_SECONDS if deadline is None else deadline - time.monotonic()
                if wait <= 0:
                    raise _TimedOut(f"DataLoader timed out after {self._timeout} seconds")
                self._cond.wait(min(wait, POLL_SECONDS))
                continue
            del self._tasks[self._rcvd_idx]
            self._rcvd_idx += 1
            self._replace_taken()
            if task.reply[0] in ("ok", "error"):
                return task
            self._count(task)  # an iterable worker's end, or a batch of skipped samples

    def _replace_taken(self) -> None:
        """A task was taken: its place in the window goes to the sampler's next index, drawn
        and sent here or, where the sampler allows (`_draws_alone`), by the outbox thread,
        which the trainer only wakes (the draw and the dispatch were half of what `next` cost)."""
        if not self._draws_behind:
            self._try_put_index()
        elif not self._sampler_done:
            self._outbox.want_fill()

    def _fill(self) -> None:
        """The outbox thread's side of `_replace_taken` (and the pump's, after replies):
        indices drawn and sent until the window (taken tasks aside) is full again, as the
        trainer's dispatch would have left it."""
        limit = self._prefetch_factor * self._num_workers
        while len(self._tasks) < limit:
            sent = self._send_idx
            self._try_put_index()
            if self._send_idx == sent:
                return

    def _count(self, task: _Task) -> None:
        """Books a taken task against its worker (what a saved state resumes from)."""
        kind, _, _, rng, skipped, cache, _ = task.reply
        worker = self._workers[task.worker]
        counters = self._loader._feedstore_counts
        counters.skipped_samples += skipped
        if cache is not None:
            counters.cache_hits += cache.hits
            counters.cache_filed += cache.filed
            counters.cache_random += cache.random
            counters.cache_unfiled += cache.unfiled
            self._check_nothing_filed()
        if kind == "stop":
            worker.active = False
        else:
            worker.taken += 1
            worker.taken_rng = rng

    def _take(self, task: _Task) -> tuple:
        """(batch, None), or (None, the error) for a task whose batch failed."""
        self._book()
        self._count(task)
        counters = self._loader._feedstore_counts
        if task.reply[0] == "error":
            counters.failed_batches += 1
            return None, task.reply[2]
        counters.batches += 1
        batch, task.batch = task.batch, None
        return batch, None

    def _check_nothing_filed(self) -> None:
        """Notes (any thread) that ``sample_cache=True`` filed no sample of two batches' worth
        or more: the cache costs a key per sample and saves nothing. Said once per loader, by
        the trainer's next ``next`` (``_say_nothing_filed``)."""
        loader, c = self._loader, self._loader._feedstore_counts
        if loader._cache_warned or c.cache_filed or c.cache_hits:
            return
        unfiled = c.cache_random + c.cache_unfiled
        if unfiled < 2 * (loader.batch_size or 1):
            return
        loader._cache_warned = True
        loader._cache_warning = (
            f"sample_cache=True filed none of the {unfiled} samples made so far "
            f"({c.cache_random} moved Python's, numpy's or torch's global random state, a "
            f"random augmentation; {c.cache_unfiled} could not be filed: no room, or a class "
            "a batch cannot hold), so each is made again every epoch: pass "
            "sample_cache=False, or draw the augmentation after the cache (in collate_fn or "
            "the training step)"
        )

    def _say_nothing_filed(self) -> None:
        message, self._loader._cache_warning = self._loader._cache_warning, None
        if message:
            warnings.warn(message, stacklevel=3)  # (the training loop's `next`)

    def _book(self) -> None:
        """Books the batches `next` took on its fast path (in order, before anything later)."""
        while self._taken:
            self._count(self._taken.popleft())
            self._loader._feedstore_counts.batches += 1

    def _book_taken(self) -> None:
        with self._cond:
            self._book()

    # The pump thread's side (under `_cond`).
    def _waitables(self) -> list:
        live = [w for w in self._workers if w is not None]
        sentinels = [w.process.sentinel for w in live if w.process is not None]
        return [self._wake_read, *(w.conn for w in live), *sentinels]

    def _handle(self, ready: list) -> None:
        self._book()
        if self._wake_read in ready:
            os.read(self._wake_read, 4096)
        if exiting():
            return  # multiprocessing's exit handler is ending the workers: no restarts
        dead = set()
        for w, worker in enumerate(self._workers):
            if worker is None:
                continue
            if worker.conn in ready:
                try:
                    while worker.conn.poll(0):
                        self._accept(w, worker.conn.recv())
                except (EOFError, OSError):
                    dead.add(w)
            if worker.process is not None and worker.process.sentinel in ready:
                dead.add(w)
        for w in sorted(dead):
            if self._shut:
                break  # (stopping: nothing is started again)
            self._restart(w)
        if self._draws_behind and not self._shut:
            self._fill()

    def _accept(self, w: int, reply: tuple) -> None:
        worker = self._workers[w]
        if reply[0] == "reserved":
            worker.reserved.add(reply[1])
            return
        if reply[0] == "epoch":
            if reply[1] is not None:
                worker.rng = worker.taken_rng = reply[1]
            worker.in_epoch = True
            return
        kind, task_id, payload, rng, deleted = reply[0], reply[1], reply[2], reply[3], reply[-1]
        # One reservation at a time: a reply ends it (sealed and sent, or given back).
        worker.reserved.clear()
        worker.deaths = 0
        while worker.deletes_confirmed < deleted and worker.unconfirmed:
            worker.unconfirmed.popleft()
            worker.deletes_confirmed += 1
        task = self._tasks.get(task_id)
        made_from = worker.rng  # (the state this batch was made from)
        if task is not None and task.remade_rng is not None:
            # A batch made again: the worker's state did not move, and the batch's own state
            # after it is the one its first making said.
            reply = (*reply[:3], task.remade_rng, *reply[4:])
        elif kind != "stop" and rng is not None:
            worker.rng = rng  # the worker's state after this batch, wanted or not
        if task is None or task.worker != w or task.reply is not None:
            if kind == "ok":
                self._give_back(w, payload)  # a stale reply (an earlier epoch); nobody reads it
            return
        batch = None
        if kind == "ok":
            # Mapped now, while the trainer computes: its `next` finds views ready.
            started = time.perf_counter()
            try:
                # Its page tables too: the trainer's first read is then the memory traffic.
                batch = _batch.read(
                    # (Writable as torch's batches: copy-on-write, for this trainer alone.)
                    self._client.get(payload, prefault=True, private=True),
                    classes=self._loader.feedstore_batch_classes,
                )
                if self._pin_memory:
                    batch = _pin(batch)
            except feedstore.NotFound as e:
                if self._iterable or not self._client.predates(payload) or task.remade_rng:
                    reply = ("error", task_id, e, *reply[3:])
                else:
                    # Its object went with a daemon that went away (killed, then started
                    # again): the worker makes the same batch again, into the new one.
                    self._give_back(w, payload)
                    task.remade_rng = reply[3]
                    self._outbox.send(worker.conn, ("remake", task_id, task.index, made_from))
                    self._loader._feedstore_counts.batches_remade += 1
                    return
                batch = None
            except Exception as e:  # noqa: BLE001 (raised when the trainer takes it)
                reply = ("error", task_id, e, *reply[3:])
                batch = None
            # Trainers map the store read-only and cannot delete: the worker that made the
            # batch deletes it, and the store frees it once the batch's tensors are gone.
            self._give_back(w, payload)
            self._loader._feedstore_counts.handoff_seconds += time.perf_counter() - started
        # The reply first: `next`'s fast path, which takes the lock no more, takes a task once
        # its batch is set, and books it by the reply.
        task.reply = reply
        task.batch = batch
        if kind != "stop":
            worker.done += 1

    def feedstore_state(self) -> dict:
        """Where this epoch stands, for `DataLoader.state_dict`."""
        with self._cond:
            self._book()
            finished = self._rcvd_idx >= self._send_idx and (
                self._sampler_done or not any(w.active for w in self._workers if w)
            )
            head = self._tasks.get(self._rcvd_idx)
            workers = list(self._workers)
            return {
                "tasks": self._rcvd_idx - self._epoch_start,
                "batches": self._num_yielded,
                "next_worker": head.worker if head else self._next_worker,
                "finished": finished,
                "rng": self._rng_at_start,
                "draws_base_seed": self._draws_base_seed,
                "base_seed": self._base_seed,
                "workers": {
                    "rng": [w.taken_rng if w else None for w in workers],
                    "tasks": [w.taken if w else 0 for w in workers],
                    "active": [w.active if w else False for w in workers],
                },
                **self._epoch_state(),
            }
