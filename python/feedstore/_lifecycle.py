"""The trainer's side of its workers' lives: starting them (processes of its own, or sessions in
the node's pool), starting one again after it died, and stopping them all, on ``close()``, at
the epoch's end, on an error, at interpreter exit, or (a backstop) when the iterator is
collected. ``_StoreIter`` inherits these from ``_Workers``; they use its state under its
lock."""

from __future__ import annotations

import atexit
import collections
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Deque, Dict, List, Optional

import feedstore
from feedstore import _pool
from feedstore._worker import POLL_SECONDS, _PoolSlot, _Shared, _WorkerArgs, _worker_main

if TYPE_CHECKING:
    from feedstore._store_iter import _StoreIter

# A worker that dies this many times in a row is an error, not bad luck.
MAX_ATTEMPTS = 3
# How long stopping waits for busy workers to finish their batch, before SIGTERM.
SHUTDOWN_SECONDS = 2.0


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




# Live iterators with workers, stopped in order at interpreter exit: before multiprocessing's
# own exit handler (registered earlier, so run later) terminates their workers.
_LIVE: "weakref.WeakSet[_StoreIter]" = weakref.WeakSet()
# Set by `_stop_all` at interpreter exit: no worker is started again after that.
_EXITING = False


def exiting() -> bool:
    """Whether the interpreter is exiting (multiprocessing's exit handler ends the workers)."""
    return _EXITING


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


class _Workers:
    """Starting, restarting and stopping an iterator's workers (mixed into `_StoreIter`)."""

    def close(self) -> None:
        """Stops the workers now and gives their batches back: what leaving a ``with`` block
        and ``DataLoader.close()`` do. Batches already taken stay valid; a later ``next``
        raises StopIteration, and so does one waiting on another thread. Without it the
        workers stop at the epoch's end (unless persistent), on an error, at exit, or when the
        iterator is collected."""
        self._shutdown()

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
            stopping = lambda: self._shut or exiting()  # noqa: E731
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
        with self._cond:  # (a `next` waiting on another thread sees `_shut` and ends)
            for task in list(self._tasks.values()):  # (`next`'s fast path may be in flight)
                task.batch = None  # (batches replied were given back when mapped)
            self._tasks.clear()
            self._cond.notify_all()
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
        # The trainer's connection goes now, not with the iterator (a loader with persistent
        # workers keeps its last one): batches already taken hold their own.
        self._client = None
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
