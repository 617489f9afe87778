"""The trainer's side of the hand-off: tasks out to the workers through a thread of their own
(``_Outbox``), and replies in through another (``_pump``), which maps each batch as it comes
so that ``next`` finds it ready. Both hold the iterator weakly: an iterator the trainer drops
is collected, and its workers stopped."""

from __future__ import annotations

import collections
import multiprocessing
import multiprocessing.connection
import threading
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Deque, Optional

from feedstore import _lifecycle
from feedstore import _torch_private as private
from feedstore._worker import POLL_SECONDS

if TYPE_CHECKING:
    from feedstore._store_iter import _StoreIter


@dataclass
class _Task:
    worker: int
    index: Any
    # The worker's reply: (kind, task, payload, random state, skipped, deletes done).
    reply: Optional[tuple] = None
    # The batch, mapped by the pump as the reply came.
    batch: Any = None
    # Made again (its object went with a daemon that went away): the random state after the
    # batch, as its first making said.
    remade_rng: Any = None




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


def _pump(ref: "weakref.ref[_StoreIter]") -> None:
    """The trainer's receiving thread: takes workers' replies as they come and maps each batch
    at once (a lease, views of the object, pinned if asked), restarts dead workers, and wakes
    the trainer, so that `next(loader)` finds its batch ready. It holds the iterator only while
    handling what arrived, so an iterator the trainer drops is collected (and its workers
    stopped)."""
    while True:
        iterator = ref()
        if iterator is None or iterator._shut or _lifecycle.exiting():
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
