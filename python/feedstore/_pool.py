"""One worker pool per node: worker processes that several trainer processes share.

``feedstore.torch.DataLoader(..., pool="node")`` keys a pool by what its workers run (see
``digest``, and the loader's ``_feedstore_pool_key``). Slot
``w`` of a pool is one process: worker ``w`` of every trainer with that key (the local ranks of a
job, the jobs of a sweep over the same data) is a session in it, so N ranks with ``num_workers``
workers each run ``num_workers`` worker processes, not N times as many.

What is here is the plumbing, with no torch in it:

- The pool's files live in a directory only this user can use (``$XDG_RUNTIME_DIR`` or
  ``/tmp``, ``feedstore-pools-<uid>``, mode 0700, checked before each use). Both ends check the
  other's uid on the socket (``SO_PEERCRED``): a session carries pickles, so a peer of another
  uid is refused whatever the file modes.
- A slot's process holds an exclusive ``flock`` on ``<key>-<slot>.lock`` for as long as it
  lives, and the kernel drops it when the process dies however it dies. A trainer that cannot
  connect takes the lock; if it gets it, no process serves the slot and it starts one (forked
  from itself, so the process has the trainer's dataset as torch's forked workers do); if not,
  one is starting and it connects again. Two trainers never start the same slot twice.
- The process is detached (forked twice, its own session) so that it outlives the trainer that
  started it, and every file descriptor it inherited is pointed at /dev/null: the trainer's
  connections to the store (and anything else it had open) end when the trainer ends, not when
  the pool does. Each trainer sends its stdout and stderr with its connection (``SCM_RIGHTS``):
  what the dataset's code prints in a session goes to that trainer's output, and an idle pool
  holds no trainer's pipes open (a parent reading a trainer's output to its end is not kept
  waiting). It leaves once no session has been open for ``FEEDSTORE_POOL_LINGER_SECONDS``
  (default 10); the last one out removes its socket and lock files.
- A slot's process makes one trainer's batch at a time, its messages in turn; a trainer that
  joins waits for the batch in hand to finish.
"""

from __future__ import annotations

import ctypes
import fcntl
import gc
import hashlib
import os
import pickle
import select
import signal
import socket
import stat
import struct
import sys
import time
import traceback
import types
from multiprocessing.connection import Connection, wait
from typing import Callable, Optional

# How long a slot's process stays after its last session ends (unless
# $FEEDSTORE_POOL_LINGER_SECONDS says otherwise): the next epoch of a loader without persistent
# workers, or a job of a sweep started a little later, finds it warm.
LINGER_SECONDS = 10.0
# How long a trainer tries to reach a slot's process (starting it when none holds the slot).
CONNECT_SECONDS = 30.0
# A slot whose process dies this many times before accepting a connection is an error.
MAX_STARTS = 3
POLL_SECONDS = 1.0
# How long a peer that connected has to send its stdout and stderr.
ACCEPT_SECONDS = 2.0
# Sessions one slot's process takes at once (trainers beyond it are refused, and retry).
MAX_SESSIONS = 256
# How long a trainer waits for a slot's process to take its session (it may be making a batch
# for another trainer first), unless the loader's `timeout` says otherwise.
HELLO_SECONDS = 60.0
_CREDS = struct.Struct("3i")  # struct ucred: pid, uid, gid


def pool_dir() -> str:
    """This user's directory for pool sockets and locks, made if missing; refused if it is
    anything but a directory of this uid that no one else can enter."""
    base = os.environ.get("XDG_RUNTIME_DIR") or ""
    if not os.path.isdir(base):
        base = "/tmp"
    path = os.path.join(base, f"feedstore-pools-{os.getuid()}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise PermissionError(
            f"{path} must be a directory of uid {os.getuid()} with mode 0700 (it holds this "
            "user's worker pools): remove it, or point XDG_RUNTIME_DIR elsewhere"
        )
    return path


class _Hasher:
    """A file that hashes what is written to it (the pickle is never held whole)."""

    def __init__(self) -> None:
        self.sha = hashlib.sha256()

    def write(self, data: bytes) -> None:
        self.sha.update(data)


class _KeyPickler(pickle.Pickler):
    """Pickles what a pool runs into a hash that is the same in every process that has the
    same objects: `identity(obj)` may stand in for an object whose pickle is not (torch's
    names a tensor's storage by its address); and it notes the module of every class and
    function it meets (a class pickles by its name: its code is hashed from its source)."""

    def __init__(self, file: _Hasher, identity: Callable[[object], Optional[str]]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.identity = identity
        self.modules: set = set()

    def reducer_override(self, obj: object):  # noqa: ANN201 (pickle's protocol)
        owner = obj if isinstance(obj, (type, types.FunctionType, types.BuiltinFunctionType)) \
            else type(obj)
        module = getattr(owner, "__module__", None)
        if isinstance(module, str):
            self.modules.add(module)
        if not isinstance(obj, type):
            name = self.identity(obj)
            if name is not None:
                return (str, (name,))
        return NotImplemented


def _code_files(modules: set) -> list:
    files = []
    for name in sorted(modules):
        path = getattr(sys.modules.get(name), "__file__", None)
        if path and os.path.isfile(path):
            files.append(path)
    return files


def digest(code: tuple, *parts: object, identity=lambda obj: None) -> str:
    """The pool key: what the workers run (`code`: the dataset, collate_fn and
    worker_init_fn) and `parts`, pickled into a hash (never held whole), with the source files
    of the modules of every class and function in them. Objects that do not pickle (lambdas,
    open files) cannot be shared by key. A set pickles in its iteration order, which for
    strings differs from process to process (PYTHONHASHSEED): such trainers get pools of
    their own."""
    hasher = _Hasher()
    pickler = _KeyPickler(hasher, identity)
    try:
        pickler.dump((code, parts))
    except Exception as e:  # noqa: BLE001 (pickle raises many kinds)
        raise TypeError(
            "pool='node' shares worker processes between trainers that run the same code on "
            "the same data, known by the pickle of the dataset, collate_fn and worker_init_fn; "
            f"one of them does not pickle ({type(e).__name__}: {e}). Use pool='rank' (each "
            "trainer its own workers), or make them picklable (no lambdas or open files)"
        ) from e
    for path in _code_files(pickler.modules):
        hasher.write(path.encode())
        with open(path, "rb") as f:
            hasher.write(f.read())
    return hasher.sha.hexdigest()[:32]


def peer_uid(sock: socket.socket) -> int:
    _, uid, _ = _CREDS.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDS.size))
    return uid


def _paths(key: str, slot: int) -> tuple:
    base = os.path.join(pool_dir(), f"{key}-{slot}")
    if len(os.fsencode(base + ".sock")) > 107:
        raise ValueError(
            f"{base}.sock is longer than a Unix socket's path may be (107 bytes): point "
            "XDG_RUNTIME_DIR at a shorter directory"
        )
    return base + ".sock", base + ".lock"


def _same_file(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _own_output() -> list:
    """This process's stdout and stderr, each /dev/null where it has none."""
    fds = []
    for fd in (1, 2):
        try:
            os.fstat(fd)
            fds.append(os.dup(fd))
        except OSError:
            fds.append(os.open(os.devnull, os.O_WRONLY))
    return fds


def _try_connect(path: str) -> Optional[Connection]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(POLL_SECONDS)  # (a backlog full of abandoned connections blocks)
        sock.connect(path)
        sock.settimeout(None)
    except (FileNotFoundError, ConnectionRefusedError, TimeoutError):
        sock.close()
        return None
    if peer_uid(sock) != os.getuid():
        sock.close()
        raise PermissionError(f"{path} is served by another uid: refusing to send it work")
    fds = _own_output()
    try:
        # This process's stdout and stderr: what the session's code prints goes where this
        # process's own output goes (and not to the process that started the pool).
        socket.send_fds(sock, [b"o"], fds)
    except OSError:
        sock.close()
        return None  # it was leaving: connect again
    finally:
        for fd in fds:
            os.close(fd)
    return Connection(sock.detach())


class Stopped(Exception):
    """The caller's `stop()` said to give up (its loader is stopping)."""


def connect(
    key: str, slot: int, start: Callable[[int, str], None], stop: Callable[[], bool] = bool
) -> Connection:
    """A connection to slot `slot` of pool `key`. When no process holds the slot, `start(lock_fd,
    socket_path)` is called to start one (it must fork a process that keeps `lock_fd` and
    serves `socket_path`; this process closes its own copy of the fd afterwards). Raises
    `Stopped` as soon as `stop()` is true."""
    sock_path, lock_path = _paths(key, slot)
    deadline = time.monotonic() + CONNECT_SECONDS
    starts = 0
    while True:
        if stop():
            raise Stopped
        conn = _try_connect(sock_path)
        if conn is not None:
            return conn
        fd = _above_stdio(os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600))
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            # A process leaving removes its lock file before its lock goes: a lock taken on a
            # file no longer at the path locks nothing anyone else will look at.
            current = _same_file(os.fstat(fd), os.stat(lock_path))
        except (BlockingIOError, FileNotFoundError):
            pass  # its process is alive and not listening yet, or just left
        else:
            if current and starts >= MAX_STARTS:
                raise RuntimeError(
                    f"worker pool slot {slot} ({sock_path}): its process died {starts} times "
                    "before taking a connection"
                )
            if current:
                starts += 1
                start(fd, sock_path)
        finally:
            os.close(fd)
        if time.monotonic() > deadline:
            raise TimeoutError(f"worker pool slot {slot}: no process at {sock_path} after "
                               f"{CONNECT_SECONDS:.0f} s")
        time.sleep(0.01)


class Leave(BaseException):
    """Raised in a slot's process by SIGTERM: it deletes what its sessions made and leaves
    (a BaseException, so that a session's `except Exception` does not take it)."""


def _leave_on_sigterm(*_: object) -> None:
    raise Leave


def _above_stdio(fd: int) -> int:
    """`fd` moved to 3 or above (a process started with stdout closed would otherwise get
    the lock on 1, which the slot's output switching points elsewhere)."""
    if fd > 2:
        return fd
    moved = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3)
    os.close(fd)
    return moved


def detach(lock_fd: int, main: Callable[[], None]) -> None:
    """Runs `main` in a detached grandchild of this process (its own session) that keeps
    `lock_fd` (its slot's lock) and nothing else this process had open; returns once the child
    in between is reaped. The grandchild ends with `os._exit`: nothing of this process's (its
    exit hooks, its objects' finalizers) runs there. It stays in this process's cgroup and
    keeps its CPU affinity and environment."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()  # (or the child would write it again, to someone else)
        except (OSError, ValueError, AttributeError):
            pass
    pid = os.fork()
    if pid:
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass  # (SIGCHLD ignored: the kernel reaped it)
        return
    code = 1
    try:
        os.setsid()
        if os.fork():
            os._exit(0)
        _release_inherited(keep={lock_fd})
        # Everything inherited from the trainer out of the collector's sight: its collections
        # would otherwise write to every object's header, copying the trainer's whole heap
        # into this process page by page.
        gc.freeze()
        _name_process(b"feedstore-pool")
        # Python's streams afresh: another thread of the trainer may have held a stream's
        # buffer lock at the fork, which nothing here would ever release.
        _fresh_streams()
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # a trainer's closed pipe: an error
        signal.signal(signal.SIGTERM, _leave_on_sigterm)
        main()
        code = 0
    except Leave:
        code = 0
    except BaseException:  # noqa: BLE001 (nothing above it to raise to)
        traceback.print_exc()
    finally:
        os._exit(code)


def _name_process(name: bytes) -> None:
    """What `ps -o comm` and `top` show (the command line stays the starting trainer's)."""
    try:
        ctypes.CDLL(None).prctl(15, name, 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def _fresh_streams() -> None:
    """New `sys.stdout` and `sys.stderr` over fds 1 and 2, encoded as the old ones were.
    (Objects that kept the old ones, a logging handler made before the fork, write through
    them to whichever trainer fds 1 and 2 point at then.)"""
    for name, fd in (("stdout", 1), ("stderr", 2)):
        old = getattr(sys, name)
        encoding = getattr(old, "encoding", None) or "utf-8"
        errors = getattr(old, "errors", None) or "backslashreplace"
        setattr(sys, name, open(fd, "w", closefd=False, buffering=1, encoding=encoding,
                                errors=errors))


def _release_inherited(keep: set) -> None:
    """Points every inherited descriptor but `keep` (stdin, stdout and stderr too) at
    /dev/null. Closing them would free their numbers for reuse while objects of the parent's
    (a client's socket, a file) still name them; /dev/null keeps the numbers taken and lets
    the connections go."""
    null = os.open(os.devnull, os.O_RDWR)
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd in keep or fd == null:
            continue
        try:
            os.dup2(null, fd, inheritable=False)
        except OSError:
            pass  # (the listing's own descriptor, closed by now)
    os.close(null)


def output_to(fds: Optional[list]) -> None:
    """Points stdout and stderr at `fds` (a session's trainer's), or at /dev/null, after
    writing out what is buffered for the previous ones. Output that cannot be written there
    (that trainer's pipe has no reader any more) is dropped, not kept for the next one."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            _fresh_streams()  # (a failed flush keeps its buffer: dropped with the object)
            break
    null = os.open(os.devnull, os.O_WRONLY) if fds is None else None
    os.dup2(null if fds is None else fds[0], 1)
    os.dup2(null if fds is None else fds[1], 2)
    if null is not None:
        os.close(null)


def linger_seconds() -> float:
    """$FEEDSTORE_POOL_LINGER_SECONDS, or the default; checked by the trainer before it starts
    a process (whose own errors nobody would see)."""
    value = os.environ.get("FEEDSTORE_POOL_LINGER_SECONDS", "")
    try:
        linger = float(value) if value else LINGER_SECONDS
    except ValueError:
        linger = -1.0
    if not 0 <= linger < float("inf"):
        raise ValueError(
            f"FEEDSTORE_POOL_LINGER_SECONDS={value!r}: expected the seconds a pool's process "
            "stays after its last trainer (0 or more)"
        )
    return linger


def run_slot(lock_fd: int, path: str, open_session) -> None:
    """A slot process's life: binds `path`, serves, and as it leaves removes its socket and
    lock files, each only if it is still the file this process made (the directory may have
    been removed and made again, with another process's files in it)."""
    listener, sock_stat = _listen(path)
    try:
        serve(listener, open_session)
    finally:
        for file, made in ((path, sock_stat), (_lock_path(path), os.fstat(lock_fd))):
            try:
                if _same_file(os.stat(file), made):
                    os.unlink(file)
            except FileNotFoundError:
                pass


def _lock_path(sock_path: str) -> str:
    return sock_path.removesuffix(".sock") + ".lock"


def _listen(path: str) -> tuple:
    """The slot's socket, bound afresh (a dead process's socket file is removed: the lock says
    no process serves it), and the inode of its file."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    os.chmod(path, 0o600)
    sock.listen(64)
    return sock, os.stat(path)


def _accept(listener: socket.socket) -> Optional[tuple]:
    """The next session's connection and its trainer's stdout and stderr; None for a peer of
    another uid (closed unread), one that did not send them in time, or a failed accept (out
    of descriptors: the connection stays queued, and is tried again a little later)."""
    try:
        sock, _ = listener.accept()
    except OSError:
        time.sleep(0.1)
        return None
    if peer_uid(sock) != os.getuid():
        sock.close()
        return None
    fds: list = []
    try:
        sock.settimeout(ACCEPT_SECONDS)
        _, fds, _, _ = socket.recv_fds(sock, 1, 2)
        sock.settimeout(None)
    except OSError:
        pass
    if len(fds) != 2:
        for fd in fds:
            os.close(fd)
        sock.close()
        return None
    for fd in fds:
        os.set_inheritable(fd, False)
    return Connection(sock.detach()), fds


def _report() -> None:
    """The exception being handled, on stderr (that of the session at hand), if it can be."""
    try:
        traceback.print_exc()
    except Exception:  # noqa: BLE001 (its trainer's stderr is gone or cannot take it)
        pass


def trainer_gone(conn: Connection) -> bool:
    """Whether the trainer at the other end of `conn` has closed it (died), whatever it sent
    before: its queued tasks are not worth making."""
    poller = select.poll()
    poller.register(conn.fileno(), select.POLLHUP | select.POLLRDHUP)
    return any(events & (select.POLLHUP | select.POLLRDHUP) for _, events in poller.poll(0))


def serve(listener: socket.socket, open_session) -> None:
    """The slot process's loop: accepts sessions (at most `MAX_SESSIONS`), lets each ready
    session take its next message in turn (`open_session(conn, fds)` returns an object with
    `step() -> bool`, which reads and handles one message with the process switched to that
    session, `pending() -> bool`, whether it has messages read ahead (it is ready whatever its
    socket says), and `close()`; `fds` are its trainer's stdout and stderr, the session's to
    close), and returns once no session has been open for `linger_seconds()`. A session whose
    step fails (a message that does not unpickle, an error outside what a worker reports,
    `SystemExit`) is closed alone, its traceback on its own trainer's stderr."""
    linger = linger_seconds()
    sessions: dict = {}
    idle_since = time.monotonic()
    # Until its first session, it waits for the trainer that started it at least as long as
    # that trainer tries to connect.
    first = max(linger, CONNECT_SECONDS)

    def end(conn: Connection) -> None:
        nonlocal idle_since
        session = sessions.pop(conn)
        try:
            session.close()
        except Exception:  # noqa: BLE001 (a session's failure is its own)
            _report()
        conn.close()
        if not sessions:
            idle_since = time.monotonic()
            output_to(None)

    try:
        while sessions or time.monotonic() - idle_since < first:
            ahead = [conn for conn, session in sessions.items() if session.pending()]
            ready = wait([listener, *sessions], timeout=0 if ahead else POLL_SECONDS)
            for item in dict.fromkeys([*ready, *ahead]):
                if item is listener:
                    accepted = _accept(listener)
                    if accepted is None:
                        continue
                    conn, fds = accepted
                    if len(sessions) >= MAX_SESSIONS:
                        for fd in fds:
                            os.close(fd)
                        conn.close()
                        continue
                    sessions[conn] = open_session(conn, fds)
                    first = linger
                    continue
                try:
                    more = sessions[item].step()
                except (Exception, SystemExit):  # noqa: BLE001 (this session's alone)
                    _report()
                    more = False
                if not more:
                    end(item)
    finally:
        # What the sessions made is deleted whatever comes: a second SIGTERM waits.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        for conn in list(sessions):
            end(conn)
