"""feedstore.torch.DataLoader(pool="node"): one worker pool per node, shared by every trainer
that loads the same data. Each trainer's batches are still torch's for its own sampler and
seeds; a pool's process killed with SIGKILL is started again; a trainer killed with SIGKILL
loses its batches to the store, not to a leak; another uid can neither reach a pool nor plant
one.

Every pool here is real: detached processes serving real Unix sockets, writing into a real
feedstored, shared by loaders in this process and in other real processes."""

import fcntl
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

torch = pytest.importorskip("torch", reason="the torch adapter needs torch (python3-torch)")
import torch.utils.data as tud  # noqa: E402

from feedstore import _pool  # noqa: E402
from feedstore.torch import DataLoader  # noqa: E402
from test_loader import (  # noqa: E402
    Augmented,
    DiesOnce,
    Shards,
    assert_same_batches,
    seeded,
    store_empty,
)

TESTS = pathlib.Path(__file__).parent


@pytest.fixture
def pools(monkeypatch):
    """A pool directory of this test's own (short: a socket's path has 108 bytes) and pools that
    linger one second; at the end, waits for every pool process to be gone (each holds its
    slot's lock while it lives)."""
    run = tempfile.mkdtemp(prefix="fsp")
    monkeypatch.setenv("XDG_RUNTIME_DIR", run)
    monkeypatch.setenv("FEEDSTORE_POOL_LINGER_SECONDS", "1")
    yield pathlib.Path(run) / f"feedstore-pools-{os.getuid()}"
    deadline = time.monotonic() + 60
    while any(map(held, pathlib.Path(run).glob("*/*.lock"))):
        assert time.monotonic() < deadline, "a pool process stayed past its linger"
        time.sleep(0.05)
    shutil.rmtree(run)


def held(lock):
    """Whether a process holds `lock` (a pool's slot process, while it lives)."""
    try:
        fd = os.open(lock, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def torchs(dataset, **kwargs):
    seeded()
    return list(tud.DataLoader(dataset, generator=torch.Generator().manual_seed(7), **kwargs))


def pooled(dataset, daemon, **kwargs):
    return DataLoader(
        dataset, socket=daemon.socket, pool="node", generator=torch.Generator().manual_seed(7),
        **kwargs,
    )


def pids(iterator):
    """The pool processes serving an iterator's workers."""
    return sorted(w.pid for w in iterator._workers)


def test_two_loaders_share_one_pool_and_each_gets_torchs_batches(daemon, pools):
    """Two trainers' loaders over the same data, side by side: one process per slot serves
    both, each trainer's random augmentations come from its own workers' seeds."""
    theirs = torchs(Augmented(), batch_size=4, shuffle=True, num_workers=2)
    first, second = (pooled(Augmented(), daemon, batch_size=4, shuffle=True, num_workers=2)
                     for _ in range(2))
    seeded()
    a = iter(first)
    seeded()
    b = iter(second)
    ours = [next(a), next(b)]
    assert pids(a) == pids(b) and len(set(pids(a))) == 2
    assert os.getpid() not in pids(a)
    ours_a, ours_b = [ours[0], *a], [ours[1], *b]
    assert_same_batches(ours_a, theirs)
    assert_same_batches(ours_b, theirs)
    del ours, ours_a, ours_b
    store_empty(daemon)


def test_a_pool_process_killed_with_sigkill_is_started_again_for_both_loaders(
    daemon, pools, tmp_path
):
    marker = tmp_path / "killed"
    theirs = torchs(Augmented(), batch_size=4, shuffle=True, num_workers=2)
    loaders = [pooled(DiesOnce(marker), daemon, batch_size=4, shuffle=True, num_workers=2)
               for _ in range(2)]
    iterators = []
    for loader in loaders:
        seeded()
        iterators.append(iter(loader))
    ours = [[], []]
    for pair in zip(*iterators):
        for mine, batch in zip(ours, pair):
            mine.append(batch)
    assert marker.exists()  # a pool process really died
    # (A loader whose session in it had not started yet is simply connected again.)
    assert [l.feedstore_counters.worker_restarts for l in loaders] in ([1, 1], [1, 0], [0, 1])
    for mine in ours:
        assert_same_batches(mine, theirs)
    del ours, pair, batch, mine
    store_empty(daemon)


RANK = """
import sys, time, torch, torch.utils.data as tud
sys.path.insert(0, {tests!r})
from test_loader import Augmented
from feedstore.torch import DataLoader

loader = DataLoader(Augmented(), batch_size=4, shuffle=True, num_workers=2, pool="node",
                    socket={socket!r}, generator=torch.Generator().manual_seed(7))
iterator = iter(loader)
batch = next(iterator)
print(sorted(w.pid for w in iterator._workers), flush=True)
time.sleep(600)  # killed here, holding a batch, with more made for it in the pool
"""


def test_a_trainer_killed_with_sigkill_leaves_nothing_in_the_store_and_the_pool_serves_on(
    daemon, pools, tmp_path
):
    script = tmp_path / "rank.py"
    script.write_text(RANK.format(tests=str(TESTS), socket=daemon.socket))
    rank = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=dict(os.environ))
    try:
        line = rank.stdout.readline().decode()
        assert line, rank.stderr.read().decode()[-3000:]
        their_pids = eval(line)
        theirs = torchs(Augmented(), batch_size=4, shuffle=True, num_workers=2)
        loader = pooled(Augmented(), daemon, batch_size=4, shuffle=True, num_workers=2)
        seeded()
        iterator = iter(loader)
        ours = [next(iterator)]
        assert pids(iterator) == their_pids  # the other process's pool
        rank.kill()
        rank.wait(timeout=60)
        ours += list(iterator)
        assert_same_batches(ours, theirs)
        assert loader.feedstore_counters.worker_restarts == 0
    finally:
        rank.kill()
        rank.wait(timeout=60)
    del ours
    store_empty(daemon)


def test_loaders_with_other_data_get_pools_of_their_own(daemon, pools):
    a = iter(pooled(Augmented(37), daemon, batch_size=4, num_workers=2))
    b = iter(pooled(Augmented(38), daemon, batch_size=4, num_workers=2))
    next(a), next(b)
    assert not set(pids(a)) & set(pids(b))
    assert len(list(pools.glob("*.sock"))) == 4
    del a, b


def test_what_a_pool_cannot_share_is_refused_with_a_reason(daemon, pools):
    with pytest.raises(TypeError, match="does not pickle"):
        iter(pooled(Augmented(), daemon, batch_size=4, num_workers=2,
                    collate_fn=lambda batch: batch))
    with pytest.raises(ValueError, match="map-style datasets only"):
        pooled(Shards(), daemon, batch_size=4, num_workers=2)
    with pytest.raises(ValueError, match="expected 'rank' or 'node'"):
        DataLoader(Augmented(), pool="cluster")


NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c"]


@pytest.mark.skipif(os.getuid() != 0 or not shutil.which("setpriv"),
                    reason="needs root and setpriv to act as another uid")
def test_another_uid_can_neither_reach_a_pool_nor_plant_one(daemon, pools, tmp_path):
    loader = pooled(Augmented(), daemon, batch_size=4, num_workers=2)
    iterator = iter(loader)
    next(iterator)
    (path,) = [p for p in pools.glob("*-0.sock")]
    witness = tmp_path / "planted"
    # A session's first message is unpickled: this one would run code as the pool's uid.
    attack = textwrap.dedent(
        f"""
        import os, pickle, socket, struct, sys
        class Evil:
            def __reduce__(self):
                return (os.system, ("touch {witness}",))
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect({str(path)!r})
        except PermissionError:
            print("refused by the file system"); sys.exit(0)
        data = pickle.dumps(("hello", Evil()))
        try:
            s.sendall(struct.pack("!i", len(data)) + data)
            print("closed unread" if s.recv(1) == b"" else "answered")
        except (BrokenPipeError, ConnectionResetError):
            print("closed unread")
        """
    )
    # Through the file system: the pool's directory is its uid's alone.
    done = subprocess.run(NOBODY + [attack], capture_output=True, timeout=60)
    assert done.stdout.decode().strip() == "refused by the file system", done.stderr.decode()
    # With the modes opened (an admin's mistake), the pool still checks who connects.
    for opened in (pools.parent, pools):
        opened.chmod(0o755)
    path.chmod(0o777)
    try:
        done = subprocess.run(NOBODY + [attack], capture_output=True, timeout=60)
    finally:
        for opened in (pools.parent, pools):
            opened.chmod(0o700)
        path.chmod(0o600)
    assert done.stdout.decode().strip() == "closed unread", done.stderr.decode()
    assert not witness.exists()
    assert len(list(iterator)) == 9  # the pool served on
    del iterator

    # A directory planted where the pools would go, by another uid, is refused.
    planted = pathlib.Path(tempfile.mkdtemp(prefix="fsq"))
    try:
        planted.chmod(0o1777)
        subprocess.run(NOBODY + [f"import os; os.mkdir({str(planted / 'feedstore-pools-0')!r}, 0o777)"],
                       check=True, timeout=60)
        os.environ["XDG_RUNTIME_DIR"] = str(planted)
        with pytest.raises(PermissionError, match="mode 0700"):
            iter(pooled(Augmented(), daemon, batch_size=4, num_workers=2))
    finally:
        shutil.rmtree(planted)


class Chatty(tud.Dataset):
    """Says what it makes on stdout."""

    def __len__(self):
        return 6

    def __getitem__(self, i):
        print(f"made {i}", flush=True)
        return torch.tensor(i)


CHATTY = """
import sys
sys.path.insert(0, {tests!r})
from test_pool import Chatty
from feedstore.torch import DataLoader

iterator = iter(DataLoader(Chatty(), batch_size=2, num_workers=1, pool="node", socket={socket!r}))
pid = iterator._workers[0].pid
assert [int(x) for batch in iterator for x in batch] == list(range(6))
print("pool", pid)
"""


def test_what_the_dataset_prints_goes_to_the_trainer_it_works_for(daemon, pools, tmp_path,
                                                                  monkeypatch):
    """Two trainers one after the other on one lingering pool process: each trainer's output
    has what the dataset printed for it, and ends when the trainer does (the pool does not hold
    the first trainer's pipe open while it lingers)."""
    monkeypatch.setenv("FEEDSTORE_POOL_LINGER_SECONDS", "300")
    script = tmp_path / "chatty.py"
    script.write_text(CHATTY.format(tests=str(TESTS), socket=daemon.socket))
    outputs = []
    for _ in range(2):
        done = subprocess.run([sys.executable, str(script)], capture_output=True, timeout=200)
        assert done.returncode == 0, done.stderr.decode()[-3000:]
        outputs.append(done.stdout.decode().splitlines())
        # The pipe ended while the pool lives on.
        assert any(map(held, pools.glob("*.lock")))
    pids = {lines[-1] for lines in outputs}
    assert len(pids) == 1  # one process served both
    for lines in outputs:
        assert sorted(lines[:-1]) == [f"made {i}" for i in range(6)]
    os.kill(int(pids.pop().split()[1]), signal.SIGTERM)
