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
"""

from __future__ import annotations

import atexit
import collections
import ctypes
import hashlib
import multiprocessing
import multiprocessing.connection
import os
import random
import signal
import sys
import threading
import time
import traceback
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, List, Optional

import numpy as np
import torch
import torch.utils.data

import feedstore
from feedstore import _batch, _cache, _pool
from feedstore import _torch_private as private

__all__ = ["DataLoader"]

STATE_VERSION = 1
# How often a waiting trainer (and an idle worker) look up from their pipes: to check the
# loader's `timeout`, and (workers) whether the trainer is still there.
POLL_SECONDS = 1.0
# A worker that dies this many times in a row is an error, not bad luck.
MAX_ATTEMPTS = 3
# How long stopping waits for busy workers to finish their batch, before SIGTERM.
SHUTDOWN_SECONDS = 2.0


def _rng_state() -> tuple:
    """This process's random state as torch seeds it in a worker (Python, numpy, torch), in
    plain picklable form (a torch tensor sent over a pipe would go through a /dev/shm file)."""
    return (random.getstate(), np.random.get_state(), torch.get_rng_state().numpy().tobytes())


def _set_rng_state(state: tuple) -> None:
    python, numpy_state, torch_state = state
    random.setstate(python)
    np.random.set_state(numpy_state)
    torch.set_rng_state(torch.frombuffer(bytearray(torch_state), dtype=torch.uint8))


def _seed_like_torch(base_seed: int, worker_id: int) -> int:
    """Seeds Python, numpy and torch as torch's own worker loop does."""
    seed = base_seed + worker_id
    random.seed(seed)
    torch.manual_seed(seed)
    np.random.seed(private.numpy_seed(base_seed, worker_id))
    return seed


class _KeyErrorMessage(str):
    """A KeyError's message shown as written (a KeyError shows its argument's repr)."""

    def __repr__(self) -> str:
        return str(self)


class _Raised:
    """An exception raised in a worker, to raise again in the trainer, as torch's workers
    report theirs: the same type, its message saying where it happened followed by the
    worker's traceback (`RuntimeError` when the type cannot be made from a message). Made
    inside the `except` block that caught it."""

    def __init__(self, where: str) -> None:
        info = sys.exc_info()
        self.exc_type = info[0]
        self.where = where
        self.text = "".join(traceback.format_exception(*info))

    def reraise(self) -> None:
        message = f"Caught {self.exc_type.__name__} {self.where}.\nOriginal {self.text}"
        if self.exc_type is KeyError:
            message = _KeyErrorMessage(message)
        elif getattr(self.exc_type, "message", None):
            raise self.exc_type(message=message)  # (exceptions whose first argument is not text)
        try:
            exception = self.exc_type(message)
        except Exception:  # noqa: BLE001 (a type that takes other arguments)
            raise RuntimeError(message) from None
        raise exception


@dataclass
class _WorkerArgs:
    worker_id: int
    num_workers: int
    dataset: Any
    iterable: bool
    auto_collation: bool
    collate_fn: Any
    drop_last: bool
    base_seed: int
    init_fn: Any
    socket: Optional[str]
    on_error: str
    # Where this worker starts: the random state after its last batch that counts (None: fresh
    # seeds), and (iterable datasets) how many of its batches to make again and drop.
    rng: Optional[tuple] = None
    replay: int = 0
    # What an iterable dataset's task index looks like (what the replay fetches with).
    replay_index: Any = None
    # The decode-once cache's namespace (`sample_cache=True`), else None.
    cache: Optional[bytes] = None
    # Classes besides the builtins a batch (or a cached sample) may hold (`batch_classes`).
    classes: tuple = ()


class _Fetcher:
    """torch's fetchers (map-style and iterable), sample by sample so that a failing sample is
    named (and can be skipped)."""

    def __init__(
        self,
        args: _WorkerArgs,
        into_store: bool = True,
        client: Optional["feedstore.Client"] = None,
    ) -> None:
        self.args = args
        # Batches written into the store stack `default_collate`'s tensors there, once.
        deferred = into_store and _batch.is_default_collate(args.collate_fn)
        self.collate = _batch.default_collate if deferred else args.collate_fn
        self.iterator = iter(args.dataset) if args.iterable else None
        self.ended = False
        self.skipped = 0
        # (feedstore's `default_collate` only reads a sample's tensors: those found in the
        # cache are handed to it as views; a user's collate_fn gets copies.)
        self.cache = None
        if args.cache is not None and client is not None and not args.iterable:
            self.cache = _cache.SampleCache(
                client, args.cache, deferred, _rng_state, args.classes
            )
        self.counts = _cache.Counts()

    def _failed(self, index: Any) -> None:
        """A sample raised: re-raise with where it happened, unless skipping."""
        if self.args.on_error == "skip":
            self.skipped += 1
            return
        if self.args.num_workers == 0:
            raise  # (in the trainer's process: the exception itself, as torch's)
        raise _SampleError(
            _Raised(
                f"in feedstore DataLoader worker process {self.args.worker_id} "
                f"(sample index {index!r})"
            )
        )

    def _item(self, index: Any) -> Any:
        """One sample, or `_MISSING` when it raised and is skipped."""
        try:
            return self.args.dataset[index]
        except Exception:
            self._failed(index)
            return _MISSING

    def _next(self) -> Any:
        """The iterator's next sample, or `_MISSING` when it raised and is skipped."""
        try:
            return next(self.iterator)
        except StopIteration:
            raise
        except Exception:
            self._failed("next(iter(dataset))")
            return _MISSING

    def _samples(self, indices: Any) -> List[Any]:
        """The samples of `indices` (`_MISSING` where skipped), through the cache."""
        samples, counts = self.cache.samples(indices, self._item, _MISSING)
        self.counts.add(counts)
        return samples

    def fetch(self, index: Any) -> Any:
        """The batch for `index` (collated), `_MISSING` when every sample was skipped; raises
        StopIteration at an iterable dataset's end."""
        args = self.args
        if self.cache is not None:
            # (Sample by sample, `__getitems__` or not: each is looked up on its own.)
            if args.auto_collation:
                data = [item for item in self._samples(index) if item is not _MISSING]
                return self.collate(data) if data else _MISSING
            item = self._samples([index])[0]
            return _MISSING if item is _MISSING else self.collate(item)
        if args.iterable:
            if self.ended:
                raise StopIteration
            if not args.auto_collation:
                while True:
                    item = self._next()
                    if item is not _MISSING:
                        return self.collate(item)
            data: List[Any] = []
            for _ in index:
                try:
                    item = self._next()
                except StopIteration:
                    self.ended = True
                    break
                if item is not _MISSING:
                    data.append(item)
            if self.ended and (not data or (args.drop_last and len(data) < len(index))):
                raise StopIteration
        elif args.auto_collation:
            getitems = getattr(args.dataset, "__getitems__", None)
            if getitems and args.on_error == "raise":
                data = getitems(index)
            else:
                data = [item for item in map(self._item, index) if item is not _MISSING]
        else:
            item = self._item(index)
            return _MISSING if item is _MISSING else self.collate(item)
        return self.collate(data) if data else _MISSING


class _SampleError(Exception):
    def __init__(self, wrapper: _Raised) -> None:
        self.wrapper = wrapper


_MISSING = object()


class _WorkerLoop:
    """A worker process: indices in, batch handles out, until told to stop or orphaned.

    Ctrl-C is the trainer's to handle (it stops the workers in order, so their batches are
    given back); a worker whose trainer is gone, or that is sent SIGTERM, deletes what it made
    and leaves."""

    def __init__(
        self,
        conn: multiprocessing.connection.Connection,
        args: _WorkerArgs,
        client: Optional["feedstore.Client"] = None,
        pooled: bool = False,
    ) -> None:
        self.conn, self.args = conn, args
        # The trainer that forked it: a worker whose parent changed is an orphan and leaves. A
        # node pool's process is detached from whoever started it (its parent is the
        # intermediate process that forked it, until that exits, then init): its sessions end
        # when their connections do, never by its parent.
        self.parent = None if pooled else os.getppid()
        # A pool's sessions share their process's connection to the store.
        self.client = client
        self.fetcher: Optional[_Fetcher] = None
        self.init_error: Optional[_Raised] = None
        # Handles of batches sent and not yet given back (deleted at exit, whatever the
        # trainer managed to read), and how many deletes were asked for and done.
        self.mine: set = set()
        self.deleted = 0
        # Messages read ahead of their turn (to see a stop queued behind tasks).
        self.pending: Deque[Any] = collections.deque()

    def run(self) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        # SIGTERM (multiprocessing's exit handler in a trainer that stops on an exception,
        # a container's stop) ends the worker through `finally`, deleting what it made.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        try:
            self.start()
            while self.step():
                pass
        except (EOFError, BrokenPipeError):
            pass  # the trainer closed its end
        finally:
            self.finish()

    def finish(self) -> None:
        """Deletes every batch it made that was not given back (whatever the trainer read)."""
        for handle in list(self.mine):
            self.delete(handle)

    def start(self) -> None:
        args = self.args
        torch.set_num_threads(1)
        seed = _seed_like_torch(args.base_seed, args.worker_id)
        private.set_worker_info(
            private.WorkerInfo(
                id=args.worker_id, num_workers=args.num_workers, seed=seed, dataset=args.dataset
            )
        )
        try:
            if self.client is None:
                self.client = feedstore.Client(
                    args.socket, writer=True, name=f"DataLoader worker {args.worker_id}"
                )
            if args.init_fn is not None:
                args.init_fn(args.worker_id)
            if args.rng is not None:
                # After `worker_init_fn`, which often reseeds: the state saved after the last
                # batch already includes what it did.
                _set_rng_state(args.rng)
            self.fetcher = _Fetcher(args, client=self.client)
            for _ in range(args.replay):
                # An iterable dataset's batches this worker made before: made again, dropped.
                try:
                    self.fetcher.fetch(args.replay_index)
                except StopIteration:
                    break
                except Exception:  # noqa: BLE001 (it failed so the first time, and said so)
                    pass
        except Exception:
            self.init_error = _Raised(self.where())

    def where(self) -> str:
        return f"in feedstore DataLoader worker process {self.args.worker_id}"

    def delete(self, handle: str) -> None:
        self.mine.discard(handle)
        try:
            if self.client is not None:
                self.client.delete(handle)
        except feedstore.FeedstoreError:
            pass  # already gone (deleted before a crash, or a daemon restart)

    def step(self) -> bool:
        """Handles one message from the trainer; False when it is time to leave."""
        if self.orphan():
            return False  # an orphan leaves, idle or not
        if not self.pending and not self.conn.poll(POLL_SECONDS):
            return True
        return self.handle(self.recv())

    def recv(self) -> Any:
        """The trainer's next message (read ahead, or from the pipe)."""
        return self.pending.popleft() if self.pending else self.conn.recv()

    def stop_queued(self) -> bool:
        """Whether the trainer said stop (or left) behind the message at hand: the messages
        waiting in the pipe are read ahead to see. Its tasks then go unmade, as torch's
        workers skip theirs once told they are done: stopping waits for the batch being made
        at most, not for the prefetched ones queued behind it."""
        try:
            while self.conn.poll(0):
                self.pending.append(self.conn.recv())
        except (EOFError, OSError):
            return True
        return self.orphan() or any(message is None for message in self.pending)

    def orphan(self) -> bool:
        """Whether the trainer that forked this worker is gone (never, for a pool session)."""
        return self.parent is not None and os.getppid() != self.parent

    def handle(self, message: Any) -> bool:
        """Does what one message asks; False when it is time to leave."""
        if message is None:
            return False
        if message[0] == "delete":
            self.delete(message[1])
            self.deleted += 1
        elif message == "epoch":
            # Persistent workers, a new epoch: a new iterator, the random state going on (and
            # said, so that a state saved early in the epoch resumes from it).
            if self.init_error is None:
                self.fetcher = _Fetcher(self.args, client=self.client)
            self.conn.send(("epoch", None if self.args.iterable else _rng_state()))
        elif not self.stop_queued():
            self.conn.send(self.make(*message))
            _trim()  # (the batch's samples are gone by now)
        return True

    def write(self, batch: Any) -> str:
        """The batch as one object, pinned: the store never evicts a batch the trainer has not
        mapped yet (it waits for room instead), and the trainer has it deleted."""
        def reserve(nbytes: int) -> "feedstore.Reservation":
            reservation = self.client.reserve(nbytes, pin=True)
            # Announced before it is sealed: if this process is killed between the seal and
            # the reply, the trainer has the pinned object deleted all the same.
            self.conn.send(("reserved", reservation.handle))
            return reservation

        try:
            return _batch.fill(reserve, batch, self.args.classes).seal()
        except feedstore.Full as e:
            raise feedstore.Full(
                f"{e}. The store needs room for prefetch_factor x num_workers batches and the "
                "ones the trainer holds (any tensor kept from a batch keeps all of it): start "
                "feedstored with a larger --capacity, or lower prefetch_factor or num_workers"
            ) from None

    def make(self, task: int, index: Any) -> tuple:
        """The reply for one task: (kind, task, payload, random state, skipped, cache counts,
        deleted)."""
        if self.init_error is not None:
            return ("error", task, self.init_error, None, 0, None, self.deleted)
        fetcher = self.fetcher
        skipped_before = fetcher.skipped
        fetcher.counts = _cache.Counts()
        try:
            batch = fetcher.fetch(index)
            if batch is _MISSING:
                kind, payload = "empty", None
            else:
                payload = self.write(batch)
                self.mine.add(payload)
                kind = "ok"
        except StopIteration:
            kind, payload = "stop", None
        except _SampleError as e:
            kind, payload = "error", e.wrapper
        except Exception:
            kind, payload = "error", _Raised(self.where())
        rng = None if self.args.iterable else _rng_state()
        skipped = fetcher.skipped - skipped_before
        return (kind, task, payload, rng, skipped, fetcher.counts, self.deleted)


def _libc_trim():
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None  # not glibc


_MALLOC_TRIM = _libc_trim()


def _trim() -> None:
    """Gives the heap's free pages back to the system after a batch. A sample's decode buffers
    (a 2048 px image is 12 MiB) come from the heap once glibc has raised its mmap threshold,
    and a worker's heap otherwise keeps the peak of every batch it made."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


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


def _worker_main(conn: multiprocessing.connection.Connection, args: _WorkerArgs) -> None:
    _WorkerLoop(conn, args).run()


@dataclass
class _Shared:
    """What every session of a node's pool runs (the pool's key is their digest)."""

    dataset: Any
    collate_fn: Any
    init_fn: Any
    socket: Optional[str]


class _PoolSlot:
    """A process of a node's worker pool (``pool="node"``; see ``feedstore._pool``): worker
    `slot` of every trainer with the pool's key is a session here, a `_WorkerLoop` of its own
    (its random state, its worker info, the batches it made). Sessions take turns, one message
    each; the process's random state and worker info are those of the session at hand, so each
    trainer's batches are the ones its own worker would make."""

    def __init__(self, slot: int, shared: _Shared) -> None:
        self.slot, self.shared = slot, shared
        self.client: Optional[feedstore.Client] = None
        self.current: Optional[_PoolSession] = None

    def open(self, conn: multiprocessing.connection.Connection, fds: list) -> "_PoolSession":
        return _PoolSession(self, conn, fds)

    def switch(self, session: "_PoolSession") -> None:
        if self.current is session:
            return
        if self.current is not None:
            self.current.saved = (_rng_state(), private.worker_info())
        self.current = session
        # What the session's code prints goes to its own trainer's stdout and stderr.
        _pool.output_to(session.fds)
        if session.saved is not None:
            _set_rng_state(session.saved[0])
            private.set_worker_info(session.saved[1])

    def serve(self, lock_fd: int, path: str) -> None:
        torch.set_num_threads(1)
        _pool.run_slot(lock_fd, path, self.open)


class _PoolSession:
    """One trainer's worker in a pool's process: a hello (that worker's arguments), then the
    messages a worker of its own would get; the batches it made and were not given back are
    deleted when the trainer leaves or is gone."""

    def __init__(
        self, slot: _PoolSlot, conn: multiprocessing.connection.Connection, fds: list
    ) -> None:
        self.slot, self.conn, self.fds = slot, conn, fds
        self.loop: Optional[_WorkerLoop] = None
        self.saved: Optional[tuple] = None

    def step(self) -> bool:
        """Reads and handles its next message, the process switched to this session (so
        what it prints, tracebacks included, goes to its trainer); False when it ends."""
        self.slot.switch(self)
        try:
            message = self.loop.recv() if self.loop is not None else self.conn.recv()
        except (EOFError, OSError):
            return False  # its trainer is gone
        if _pool.trainer_gone(self.conn):
            return False  # (and its queued tasks with it: nobody would take their batches)
        try:
            return self.handle(message)
        except (BrokenPipeError, ConnectionResetError):
            return False  # its trainer went while it was answered: nothing to report to it

    def handle(self, message: Any) -> bool:
        slot = self.slot
        if self.loop is None:
            if not (isinstance(message, tuple) and message[0] == "hello"):
                return False
            shared = slot.shared
            if slot.client is not None:
                try:
                    slot.client.stats()  # (the daemon may have restarted while it lingered)
                except feedstore.FeedstoreError:
                    slot.client = None  # sessions still on it see their errors
            if slot.client is None:
                try:
                    slot.client = feedstore.Client(
                        shared.socket, writer=True, name=f"DataLoader pool worker {slot.slot}"
                    )
                except feedstore.FeedstoreError:
                    pass  # the session's start tries again, and says why in its replies
            args = _WorkerArgs(
                **message[1],
                dataset=shared.dataset,
                collate_fn=shared.collate_fn,
                init_fn=shared.init_fn,
                socket=shared.socket,
            )
            self.loop = _WorkerLoop(self.conn, args, slot.client, pooled=True)
            self.loop.start()
            slot.client = slot.client or self.loop.client
            self.conn.send(("hello", os.getpid()))
            return True
        if message is None:
            # The trainer stops: what it was not given back goes, and it hears that it did.
            self.loop.finish()
            self.conn.send(("bye",))
            return False
        return self.loop.handle(message)

    def pending(self) -> bool:
        """Whether it has messages read ahead, to handle before its socket is read again."""
        return self.loop is not None and bool(self.loop.pending)

    def close(self) -> None:
        try:
            if self.loop is not None:
                self.loop.finish()
        finally:
            if self.slot.current is self:
                # Its trainer's pipes are let go now, whoever else is still served.
                self.slot.current = None
                _pool.output_to(None)
            for fd in self.fds:
                os.close(fd)
            self.fds = []


@dataclass
class _Task:
    worker: int
    index: Any
    # The worker's reply: (kind, task, payload, random state, skipped, deletes done).
    reply: Optional[tuple] = None
    # The batch, mapped by the pump as the reply came.
    batch: Any = None


@dataclass
class _Worker:
    process: Any
    conn: multiprocessing.connection.Connection
    # Tasks done (replied) and the random state after the last of them.
    done: int = 0
    rng: Optional[tuple] = None
    # The same, counting only tasks the trainer has taken: what a saved state resumes from.
    taken: int = 0
    taken_rng: Optional[tuple] = None
    active: bool = True
    # Deaths since its last reply: a worker that keeps dying is an error, not bad luck.
    deaths: int = 0
    # Batch objects this process was asked to delete and has not yet said it did (replies
    # carry how many it has): sent again to its replacement if it dies.
    unconfirmed: Deque[str] = field(default_factory=collections.deque)
    deletes_confirmed: int = 0
    # Batch objects it reserved and has not replied with yet.
    reserved: set = field(default_factory=set)
    # Whether it has started the current epoch (persistent workers).
    in_epoch: bool = True
    # A pool's process (`process` is None): its pid, as its hello said.
    pid: Optional[int] = None


@dataclass
class _Counters:
    batches: int = 0
    worker_restarts: int = 0
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


def _generator_state(loader: "DataLoader") -> Any:
    """What the sampler draws from: the loader's generator, else the global random states
    (torch's, and Python's and numpy's, which custom samplers use)."""
    return loader.generator.get_state() if loader.generator is not None else _rng_state()


class _TimedOut(RuntimeError):
    """No batch within the loader's `timeout` (torch's error: a `RuntimeError`)."""


class _Outbox:
    """Sends messages to workers from a thread of its own, in order. Waking a sleeping
    process through a pipe costs the sender 100-400 us on a small VM; a trainer's `next`
    pays only for waking this thread. A pipe is closed under the same lock as each write, so
    a message for a dead worker's pipe fails instead of reaching whatever reuses the fd.

    The thread also runs `on_fill` (the iterator's: the window refilled) when `next` asks
    (`want_fill`). It sleeps on `_kick`, a lock used as a one-slot semaphore: released (from
    any thread) when there is something to do, taken by the thread before it looks. Releasing
    a lock keeps the GIL (a pipe's write gives it up for the syscall, and a thread woken just
    before takes it then, so `next` would wait out that thread's whole turn)."""

    def __init__(self) -> None:
        self._queue: Deque[tuple] = collections.deque()
        self._kick = threading.Lock()
        self._kick.acquire()  # (released: something to do)
        self._lock = threading.Lock()
        self._stopping = False
        self._sending = False  # (the thread is inside `_send_queued`)
        self.fill_wanted = False
        self.on_fill: Optional[Callable[[], None]] = None
        self._thread = threading.Thread(target=self._run, name="feedstore DataLoader outbox", daemon=True)
        self._thread.start()

    def kick(self) -> None:
        try:
            self._kick.release()
        except RuntimeError:
            pass  # (released already: the thread looks once more anyway)

    def send(self, conn: multiprocessing.connection.Connection, message: Any) -> None:
        self._queue.append((conn, message))
        self.kick()

    def want_fill(self) -> None:
        self.fill_wanted = True
        self.kick()

    def close(self, conn: multiprocessing.connection.Connection) -> None:
        with self._lock:
            conn.close()

    def stop(self) -> None:
        """Sends what is queued, then ends the thread."""
        self._stopping = True
        self.kick()
        if threading.current_thread() is not self._thread:
            self._thread.join()
        elif not self._sending:
            # The iterator's last reference was dropped in `on_fill`, and its shutdown runs
            # here: what it queued (the workers' stops) goes now, not after it waited for them.
            # (Not from inside a send, where a garbage collection could run it: `_lock` is
            # held there, and the send under way goes on with the queue once it returns.)
            self._send_queued()

    def _run(self) -> None:
        while True:
            self._kick.acquire()
            # Everything queued before the release that woke it is seen here.
            while True:
                if self.fill_wanted and not self._stopping:
                    self.fill_wanted = False
                    on_fill = self.on_fill
                    if on_fill is not None:
                        on_fill()
                if not self._send_queued():
                    break
            if self._stopping and not self._queue:
                return

    def _send_queued(self) -> bool:
        """Sends the queued messages in order; whether there were any."""
        sent = False
        while True:
            try:
                conn, message = self._queue.popleft()
            except IndexError:
                return sent
            sent = True
            with self._lock:
                self._sending = True
                try:
                    conn.send(message)
                except (OSError, ValueError):
                    pass  # a dead worker's pipe
                finally:
                    self._sending = False


# Live iterators with workers, stopped in order at interpreter exit: before multiprocessing's
# own exit handler (registered earlier, so run later) terminates their workers.
_LIVE: "weakref.WeakSet[_StoreIter]" = weakref.WeakSet()
# Whether a torch profiler records (asked at each `next`; bound once, as a lookup costs too).
_profiler_enabled = private.profiler_enabled


def _filler(ref: "weakref.ref[_StoreIter]") -> Callable[[], None]:
    """The outbox thread's `on_fill` for an iterator it holds weakly."""

    def fill() -> None:
        iterator = ref()
        if iterator is None:
            return
        with iterator._cond:
            if iterator._draws_behind and not iterator._shut:
                try:
                    iterator._book()
                    iterator._fill()
                except BaseException as e:  # noqa: BLE001 (a sampler's error: raised in `next`)
                    iterator._error = e
                    iterator._draws_behind = False  # (`next` takes the slow path, which raises it)
                    iterator._cond.notify_all()

    return fill


_EXITING = False
# Held while an iterator is marked stopped (the trainer, `__del__` and the exit hook may race).
_SHUTTING = threading.Lock()


@atexit.register
def _stop_all() -> None:
    global _EXITING
    _EXITING = True
    for iterator in list(_LIVE):
        try:
            iterator._shutdown()
        except Exception:  # noqa: BLE001 (best effort at exit)
            pass


def _pump(ref: "weakref.ref[_StoreIter]") -> None:
    """The trainer's receiving thread: takes workers' replies as they come and maps each batch
    at once (a lease, views of the object, pinned if asked), restarts dead workers, and wakes
    the trainer, so that `next(loader)` finds its batch ready. It holds the iterator only while
    handling what arrived, so an iterator the trainer drops is collected (and its workers
    stopped)."""
    while True:
        iterator = ref()
        if iterator is None or iterator._shut or _EXITING:
            return  # (at exit, `_stop_all` stops it; nothing more to pump meanwhile)
        with iterator._cond:
            waitables = iterator._waitables()
        del iterator  # (perhaps the last reference: then it is stopped here, its pipes closed)
        try:
            ready = multiprocessing.connection.wait(waitables, timeout=POLL_SECONDS)
        except (OSError, ValueError):
            ready = []  # closed under it: the iterator is stopped (checked next)
        iterator = ref()
        if iterator is None or iterator._shut:
            return
        with iterator._cond:
            try:
                iterator._handle(ready)
            except BaseException as e:  # noqa: BLE001 (raised in the trainer's thread)
                iterator._error = e
                iterator._draws_behind = False  # (`next` takes the slow path, which raises it)
                iterator._cond.notify_all()
                return
            iterator._cond.notify_all()
        del iterator


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
        self._index_sampler = loader.batch_sampler if self._auto_collation else loader.sampler
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
    )


class _StoreIter(_LoaderIter):
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

    def _start_worker(self, w: int, rng: Optional[tuple], replay: int) -> None:
        if self._pool_key is not None:
            self._workers[w] = self._join_pool({w: rng})[w]
            return
        args = _WorkerArgs(worker_id=w, rng=rng, replay=replay, **self._base_args)
        ours, theirs = self._context.Pipe(duplex=True)
        process = self._context.Process(target=_worker_main, args=(theirs, args), daemon=True)
        process.start()
        theirs.close()
        self._workers[w] = _Worker(process=process, conn=ours)

    def _join_pool(
        self, rngs: Dict[int, Optional[tuple]], stop: Callable[[], bool] = bool
    ) -> Dict[int, _Worker]:
        """Workers `rngs` (id: random state to start from) as sessions in the same slots of
        the node's pool, whose processes are started (forked from here, as torch forks its
        workers) where none serves the slot. Each session is open once its process said hello;
        a process that closes the connection before (it was leaving: its linger ran out) is
        connected to again, or started again. Touches none of the iterator's state; raises
        `_pool.Stopped` as soon as `stop()` is true."""
        joined: Dict[int, _Worker] = {}
        shared = _Shared(
            dataset=self._dataset,
            collate_fn=self._collate_fn,
            init_fn=self._loader.worker_init_fn,
            socket=self._loader.feedstore_socket,
        )
        own = {k: v for k, v in self._base_args.items() if not hasattr(shared, k)}

        def starter(w: int):
            def start(lock_fd: int, path: str) -> None:
                _pool.detach(lock_fd, lambda: _PoolSlot(w, shared).serve(lock_fd, path))

            return start

        pending = dict(rngs)
        for _ in range(_pool.MAX_STARTS + 1):
            conns: Dict[int, multiprocessing.connection.Connection] = {}
            try:
                for w in pending:
                    conns[w] = _pool.connect(self._pool_key, w, starter(w), stop)
                for w, conn in list(conns.items()):
                    try:
                        conn.send(("hello", dict(own, worker_id=w, rng=pending[w], replay=0)))
                    except OSError:
                        conn.close()
                        del conns[w]
                for w, conn in list(conns.items()):
                    try:
                        # (The process may be making a batch for another trainer first.)
                        wait = self._timeout if self._timeout > 0 else _pool.HELLO_SECONDS
                        deadline = time.monotonic() + wait
                        while not conn.poll(min(POLL_SECONDS, deadline - time.monotonic())):
                            if stop():
                                raise _pool.Stopped
                            if time.monotonic() < deadline:
                                continue
                            raise RuntimeError(
                                f"DataLoader timed out after {wait:g} seconds waiting for "
                                f"worker {w}'s process in the node's pool to take it (a batch "
                                "of another trainer's taking that long, or a hung dataset)"
                            )
                        kind, pid = conn.recv()
                    except (EOFError, OSError):
                        conn.close()
                        del conns[w]
                        continue
                    assert kind == "hello", kind
                    joined[w] = _Worker(process=None, conn=conn, pid=pid)
                    del conns[w], pending[w]
            except BaseException:
                for worker in joined.values():
                    worker.conn.close()
                raise
            finally:
                for conn in conns.values():
                    conn.close()  # (not taken: an error on the way)
            if not pending:
                return joined
        for worker in joined.values():
            worker.conn.close()
        raise RuntimeError(
            f"DataLoader workers {sorted(pending)} in the node's pool: their processes keep "
            "closing the connection before taking the session"
        )

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
        if _EXITING:
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
        if kind != "stop" and rng is not None:
            worker.rng = rng  # the worker's state after this batch, wanted or not
        task = self._tasks.get(task_id)
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

    def _give_back(self, w: int, handle: str) -> None:
        """Asks worker `w` to delete a batch object it made."""
        worker = self._workers[w]
        worker.unconfirmed.append(handle)
        # (To a dead worker, lost: its replacement is sent what it had not confirmed.)
        self._outbox.send(worker.conn, ("delete", handle))

    def _restart(self, w: int) -> None:
        """A worker died (kill -9, a crash in native code): start it again from its last reply
        and send it its outstanding tasks again. It is forked from this (the pump) thread, as
        torch forks from the trainer's: a dataset that holds locks of other threads across a
        fork would need the "forkserver" or "spawn" multiprocessing_context."""
        worker = self._workers[w]
        # Replies it managed to send before dying still count.
        try:
            while worker.conn.poll(0):
                self._accept(w, worker.conn.recv())
        except (EOFError, OSError):
            pass
        if worker.process is not None:
            worker.process.join(timeout=POLL_SECONDS)
            code = worker.process.exitcode
            how = f"killed by {signal.Signals(-code).name}" if code and code < 0 else \
                f"exit code {code}"
            what = f"DataLoader worker {w} (pid {worker.process.pid}) exited unexpectedly"
        else:
            how = "its process closed the connection"
            what = f"DataLoader worker {w} in the node's pool (pid {worker.pid}) is gone"
        self._outbox.close(worker.conn)
        pending = sorted(
            i for i, t in list(self._tasks.items()) if t.worker == w and t.reply is None
        )
        worker.deaths += 1
        if worker.deaths >= MAX_ATTEMPTS:
            where = f" making batch {pending[0] - self._epoch_start} (indices " \
                f"{self._tasks[pending[0]].index!r})" if pending else ""
            raise RuntimeError(f"{what} ({how}) {worker.deaths} times in a row{where}")
        if worker.process is None:
            # Joining the pool can take a while (a slot's process started, or finishing
            # another trainer's batch first): the trainer's thread is not kept out of the
            # iterator meanwhile (it takes the batches already mapped; stopping ends the join
            # within a poll). What it sends this worker in between goes to the closed
            # connection and is sent again below (its tasks are pending then). The pump holds
            # the lock once here (`_pump` -> `_handle`), so one release lets the trainer in.
            rng = worker.rng
            stopping = lambda: self._shut or _EXITING  # noqa: E731
            self._cond.release()
            try:
                new = self._join_pool({w: rng}, stop=stopping)[w]
            except _pool.Stopped:
                return  # (the old worker's batches are deleted by the shutdown)
            finally:
                self._cond.acquire()
            if stopping():
                new.conn.close()  # (the trainer stopped meanwhile: the session ends)
                return
            self._workers[w] = new
            pending = sorted(
                i for i, t in list(self._tasks.items()) if t.worker == w and t.reply is None
            )
        else:
            self._start_worker(w, rng=worker.rng, replay=worker.done if self._iterable else 0)
            new = self._workers[w]
        self._loader._feedstore_counts.worker_restarts += 1
        new.done, new.rng, new.taken, new.taken_rng, new.active, new.deaths = (
            worker.done, worker.rng, worker.taken, worker.taken_rng, worker.active, worker.deaths
        )
        # (A fresh process starts the epoch with a fresh iterator: it has nothing to say.)
        if not worker.in_epoch and worker.rng is not None:
            new.taken_rng = worker.rng
        # Deletes it had not confirmed, and a batch it reserved (pinned) and may have sealed
        # without replying (one not sealed went with its connection: the delete finds none).
        for handle in [*worker.unconfirmed, *worker.reserved]:
            self._give_back(w, handle)
        for i in pending:
            self._outbox.send(new.conn, (i, self._tasks[i].index))

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
            }

    def _shutdown(self) -> None:
        """Stops the pump and the workers. Workers get one deadline together; one still busy
        then is sent SIGTERM (it deletes what it made and leaves), and SIGKILL only if that does
        not end it. What a worker that did not end on its own could not delete (batches it was
        asked to delete, one it had reserved) is deleted here."""
        with _SHUTTING:
            if getattr(self, "_shut", True):
                return
            self._shut = True
            self._draws_behind = False  # (`next`'s fast path is closed)
        if hasattr(self, "_sampler_done") and self._generation == self._loader._feedstore_generation:
            self._loader._feedstore_remember(self.feedstore_state())
        try:
            os.write(self._wake_write, b"x")
        except BlockingIOError:
            pass  # (a wake is pending)
        if self._thread is not None and threading.current_thread() is not self._thread:
            self._thread.join()
        for task in list(self._tasks.values()):  # (`next`'s fast path may be in flight)
            task.batch = None  # (batches replied were given back when mapped)
        self._tasks.clear()
        live = [w for w in self._workers if w is not None]
        for worker in live:
            self._outbox.send(worker.conn, None)
        self._outbox.stop()
        deadline = time.monotonic() + SHUTDOWN_SECONDS
        leftovers = []
        for worker in live:
            if worker.process is None:
                # A pool's session: it deletes what it made and says so; a process that died
                # (or is busy past the deadline) leaves its pinned batches to this side.
                bye, made = self._said_bye(worker.conn, deadline)
                if not bye:
                    leftovers += [*worker.unconfirmed, *worker.reserved, *made]
                continue
            worker.process.join(timeout=max(0.0, deadline - time.monotonic()))
        for worker in live:
            if worker.process is None:
                worker.conn.close()
                continue
            forced = worker.process.is_alive()
            if forced:
                worker.process.terminate()
                worker.process.join(timeout=SHUTDOWN_SECONDS)
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join()
            if forced or worker.process.exitcode != 0:
                leftovers += [*worker.unconfirmed, *worker.reserved]
            worker.conn.close()
        if leftovers:
            self._delete(leftovers)
        os.close(self._wake_read)
        os.close(self._wake_write)
        _LIVE.discard(self)

    @staticmethod
    def _said_bye(conn: multiprocessing.connection.Connection, deadline: float) -> tuple:
        """Whether a pool's session, told to stop, said it had, and the batches its last
        replies named (reserved or made: to delete, if it did not say so)."""
        made = []
        try:
            while conn.poll(max(0.0, deadline - time.monotonic())):
                reply = conn.recv()
                if reply == ("bye",):
                    return True, made
                if reply[0] == "reserved" or (reply[0] == "ok" and isinstance(reply[2], str)):
                    made.append(reply[1] if reply[0] == "reserved" else reply[2])
        except (EOFError, OSError):
            pass
        return False, made

    def _delete(self, handles: List[str]) -> None:
        """Deletes batch objects whose workers are gone, through a writer connection of its
        own (the trainer's maps the store read-only). Already deleted ones are skipped."""
        try:
            client = feedstore.Client(
                self._loader.feedstore_socket, writer=True, name="DataLoader cleanup"
            )
        except feedstore.FeedstoreError:
            return  # the daemon is gone, and its objects with it
        for handle in handles:
            try:
                client.delete(handle)
            except feedstore.FeedstoreError:
                pass

    def __del__(self) -> None:
        if getattr(self, "_shut", True):
            return
        try:
            self._shutdown()
        except Exception:  # noqa: BLE001
            pass  # interpreter shutdown: the workers notice the trainer is gone


class _InProcessIter(_LoaderIter):
    """`num_workers=0`: samples made and collated in the trainer's process, as torch's own
    in-process loading (there is nothing to hand over), with the state this loader saves and
    resumes, and `on_error="skip"`."""

    def __init__(self, loader: "DataLoader", resume: Optional[dict]) -> None:
        self._loader = loader
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

    def _next_index(self) -> Any:
        if self._rng_at_start is None:
            self._rng_at_start = _generator_state(self._loader)
        return super()._next_index()

    def _fetch(self, index: Any) -> Any:
        batch = self._fetcher.fetch(index)
        self._loader._feedstore_counts.skipped_samples += self._fetcher.skipped
        self._fetcher.skipped = 0
        return batch

    def _next_data(self) -> Any:
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
        }


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
            if self.num_workers == 0:
                iterator = _InProcessIter(self, resume)
            else:
                iterator = _StoreIter(self, resume)
        # (Without workers there is nothing to stop: the iterator is kept.)
        keep = self.persistent_workers or self.num_workers == 0
        self._feedstore_current = iterator if keep else weakref.ref(iterator)
        self._feedstore_last = None
        return iterator

    def state_dict(self) -> dict:
        """Where the current epoch stands: `load_state_dict` on a new loader (same dataset,
        sampler, batch size and workers) makes its next batch the one this loader would
        yield next. Save it with the trainer's checkpoint."""
        state: dict = {"version": STATE_VERSION, "num_workers": self.num_workers}
        current = self._feedstore_iterator()
        if current is not None and not getattr(current, "_shut", False):
            state.update(current.feedstore_state())
        elif self._feedstore_last is not None:
            state.update(self._feedstore_last)
        else:
            state.update(tasks=0, batches=0, finished=False, rng=None)
            return state
        # Where a finished epoch left the loader's generator: the next epoch starts there.
        state["rng_after"] = self.generator.get_state() if self.generator is not None else None
        return state

    def load_state_dict(self, state: dict) -> None:
        """Makes the next iteration resume where `state` (from `state_dict`) stood."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"not a feedstore DataLoader state (version {state.get('version')})")
        if state["num_workers"] != self.num_workers:
            raise ValueError(
                f"the state was saved with num_workers={state['num_workers']}, this loader has "
                f"{self.num_workers}: batches would come from other workers' random states"
            )
        self._feedstore_resume = state
