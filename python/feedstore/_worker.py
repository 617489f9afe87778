"""The worker side of ``feedstore.torch.DataLoader``: what runs in a worker process (one of a
trainer's own, or a session in a process of the node's pool). A worker takes task messages
(indices) from its trainer's pipe, makes each batch as torch's fetchers do (through the
decode-once cache when asked), writes it once into the store as one pinned object
(``feedstore._batch``), and replies with its handle; it deletes what it made when the trainer
gives a batch back, stops, or is gone. Random states and worker info are torch's, so the
batches are the ones torch's own workers would make."""

from __future__ import annotations

import collections
import ctypes
import multiprocessing
import multiprocessing.connection
import os
import random
import signal
import sys
import traceback
from dataclasses import dataclass
from typing import Any, Deque, List, Optional

import numpy as np
import torch

import feedstore
from feedstore import _batch, _cache, _pool
from feedstore import _torch_private as private

# How often a waiting trainer (and an idle worker) look up from their pipes: to check the
# loader's `timeout`, and (workers) whether the trainer is still there.
POLL_SECONDS = 1.0

def _rng_state() -> tuple:
    """This process's random state as torch seeds it in a worker (Python, numpy, torch), in
    plain form: tuples, numbers and bytes (a torch tensor sent over a pipe would go through a
    /dev/shm file, and a numpy array in a saved state would not load under
    ``torch.load(weights_only=True)``, current torch's default)."""
    name, key, *rest = np.random.get_state()
    numpy_state = (name, np.ascontiguousarray(key, dtype=np.uint32).tobytes(), *rest)
    return (random.getstate(), numpy_state, torch.get_rng_state().numpy().tobytes())


def _set_rng_state(state: tuple) -> None:
    python, (name, key, *rest), torch_state = state
    random.setstate(python)
    if isinstance(key, bytes):
        key = np.frombuffer(key, dtype=np.uint32)
    np.random.set_state((name, key, *rest))
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
        elif message[0] == "remake":
            # A batch whose object went with a daemon that went away (killed, then started
            # again): made again from the random state it was first made from, so it is the
            # same batch, while this worker's own state goes on as it stood.
            _, task, index, rng = message
            saved = _rng_state()
            if rng is not None:
                _set_rng_state(rng)
            try:
                reply = self.make(task, index)
            finally:
                _set_rng_state(saved)
            self.conn.send(reply)
            _trim()
        elif not self.stop_queued():
            self.conn.send(self.make(*message))
            _trim()  # (the batch's samples are gone by now)
        return True

    def write(self, batch: Any) -> str:
        """The batch as one object, pinned: the store never evicts a batch the trainer has not
        mapped yet (it waits for room instead), and the trainer has it deleted."""
        reserved = []

        def reserve(nbytes: int) -> "feedstore.Reservation":
            reservation = self.client.reserve(nbytes, pin=True)
            # Announced before it is sealed: if this process is killed between the seal and
            # the reply, the trainer has the pinned object deleted all the same.
            self.conn.send(("reserved", reservation.handle))
            reserved.append(reservation.handle)
            return reservation

        try:
            for attempt in range(MAX_WRITES):
                try:
                    return _batch.fill(reserve, batch, self.args.classes).seal()
                except feedstore.NotFound:
                    # Reserved in a daemon that went away before the seal (the client
                    # reconnected to the one started in its place): written again there.
                    if (
                        attempt + 1 == MAX_WRITES
                        or not reserved
                        or not self.client.predates(reserved[-1])
                    ):
                        raise
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


# Writes of one batch, each into a daemon started after the last went away, before its error
# stands.
MAX_WRITES = 3


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
