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
    Gated,
    Shards,
    assert_same_batches,
    same,
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


def torchs(dataset, seed=7, **kwargs):
    seeded(seed)
    return list(tud.DataLoader(dataset, generator=torch.Generator().manual_seed(seed), **kwargs))


def pooled(dataset, daemon, seed=7, **kwargs):
    return DataLoader(
        dataset, socket=daemon.socket, pool="node",
        generator=torch.Generator().manual_seed(seed), **kwargs,
    )


def pids(iterator):
    """The pool processes serving an iterator's workers."""
    return sorted(w.pid for w in iterator._workers)


def test_two_loaders_share_one_pool_and_each_gets_torchs_batches(daemon, pools):
    """Two trainers' loaders over the same data, side by side, with seeds of their own: one
    process per slot serves both, and each trainer's random augmentations come from its own
    workers' seeds (a session's random state never leaks into the other's)."""
    theirs = [torchs(Augmented(), batch_size=4, shuffle=True, num_workers=2, seed=seed)
              for seed in (7, 8)]
    iterators = []
    for seed in (7, 8):
        loader = pooled(Augmented(), daemon, batch_size=4, shuffle=True, num_workers=2,
                        seed=seed)
        seeded(seed)
        iterators.append(iter(loader))
    a, b = iterators
    assert pids(a) == pids(b) and len(set(pids(a))) == 2
    assert os.getpid() not in pids(a)
    ours = [[], []]
    for pair in zip(a, b):  # alternating: the sessions take turns in each process
        for mine, batch in zip(ours, pair):
            mine.append(batch)
    for mine, expected in zip(ours, theirs):
        assert_same_batches(mine, expected)
    assert not any(map(same, ours[0], ours[1]))  # the seeds did differ
    del ours, pair, batch, mine, iterators, a, b
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
        seeded(7)
        iterators.append(iter(loader))
    ours = [[], []]
    for pair in zip(*iterators):
        for mine, batch in zip(ours, pair):
            mine.append(batch)
    assert marker.exists()  # a pool process really died
    killed = int((tmp_path / "killed").read_text())
    assert killed not in pids(iterators[0]) + pids(iterators[1])  # replaced, for both
    # (A loader whose session in it had not started yet is simply connected again.)
    assert [l.feedstore_counters.worker_restarts for l in loaders] in ([1, 1], [1, 0], [0, 1])
    for mine in ours:
        assert_same_batches(mine, theirs)
    del ours, pair, batch, mine
    store_empty(daemon)


def test_a_pool_session_is_no_orphan_when_its_process_changes_parent(monkeypatch):
    """A pool's process is a detached grandchild: its parent is the process that forked it until
    that exits, then init. A session opened in between took its process for an orphan once the
    parent changed, and left its tasks unmade without a reply: its trainer waited forever (one
    run in about forty of the SIGKILL test above). A forked worker of a trainer's own still
    leaves when its trainer is gone."""
    from multiprocessing import Pipe

    from feedstore._worker import _WorkerArgs, _WorkerLoop

    args = _WorkerArgs(
        worker_id=0, num_workers=1, dataset=[], iterable=False, auto_collation=False,
        collate_fn=None, drop_last=False, base_seed=0, init_fn=None, socket=None,
        on_error="raise",
    )
    pooled, forked = Pipe(), Pipe()
    sessions = [_WorkerLoop(pooled[0], args, pooled=True), _WorkerLoop(forked[0], args)]
    for ends, loop in zip((pooled, forked), sessions):
        ends[1].send((7, [1, 2]))  # a task queued behind the one at hand
        assert not loop.stop_queued()
    parent = os.getppid()
    monkeypatch.setattr(os, "getppid", lambda: parent + 1)  # the parent went
    assert [loop.stop_queued() for loop in sessions] == [False, True]
    assert [loop.orphan() for loop in sessions] == [False, True]


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
    daemon, pools, tmp_path, monkeypatch
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
        seeded(7)
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
    for linger in ("abc", "-1"):
        os.environ["FEEDSTORE_POOL_LINGER_SECONDS"] = linger
        with pytest.raises(ValueError, match="FEEDSTORE_POOL_LINGER_SECONDS"):
            iter(pooled(Augmented(), daemon, batch_size=4, num_workers=2))
    assert not list(pools.glob("*"))  # nothing was started


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
    # Through the file system: the pool's directory is its uid's alone (everything above it
    # open to all, the socket itself too).
    pools.parent.chmod(0o755)
    path.chmod(0o777)
    try:
        done = subprocess.run(NOBODY + [attack], capture_output=True, timeout=60)
    finally:
        pools.parent.chmod(0o700)
        path.chmod(0o600)
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
    """Two trainers one after the other on one lingering pool process, while a third (this
    process, persistent workers) keeps a session open in it: each trainer's output has what
    the dataset printed for it, and ends when the trainer does (the pool holds no finished
    trainer's pipe open, whoever else it serves)."""
    monkeypatch.setenv("FEEDSTORE_POOL_LINGER_SECONDS", "300")
    script = tmp_path / "chatty.py"
    script.write_text(CHATTY.format(tests=str(TESTS), socket=daemon.socket))
    outputs = []
    pool_pids = set()
    staying = None
    try:
        for _ in range(2):
            # (subprocess.run reads each trainer's output to its end: a pool holding the pipe
            # would stall it until its timeout.)
            done = subprocess.run([sys.executable, str(script)], capture_output=True, timeout=200)
            assert done.returncode == 0, done.stderr.decode()[-3000:]
            outputs.append(done.stdout.decode().splitlines())
            pool_pids.add(int(outputs[-1][-1].split()[1]))
            if len(outputs) == 1:
                # A session of this process's, open (and idle) from now on in the same process.
                staying = iter(DataLoader(Chatty(), batch_size=2, num_workers=1, pool="node",
                                          socket=daemon.socket, persistent_workers=True))
                next(staying)
                assert pids(staying) == sorted(pool_pids)
        assert len(pool_pids) == 1  # one process served all
        for lines in outputs:
            assert sorted(lines[:-1]) == [f"made {i}" for i in range(6)]
        assert any(map(held, pools.glob("*.lock")))  # it lingers
    finally:
        if staying is not None:
            staying._shutdown()  # (before the pool goes: it would be started again)
        for pid in pool_pids:
            os.kill(pid, signal.SIGTERM)


def test_a_malformed_session_is_closed_alone(daemon, pools):
    """A session whose hello is not a worker's (a bug, another version) ends that session
    only: the process serves on, for the trainers it had."""
    iterator = iter(pooled(Augmented(), daemon, batch_size=4, num_workers=2))
    first = next(iterator)
    served_by = pids(iterator)
    for hello in (("hello", {"no such argument": 1}), "not a tuple", ("hello",)):
        (path,) = pools.glob("*-0.sock")
        conn = _pool._try_connect(str(path))
        conn.send(hello)
        with pytest.raises(EOFError):
            conn.recv()  # closed, no reply
        conn.close()
    assert 1 + len(list(iterator)) == 10
    assert pids(iterator) == served_by
    del first, iterator
    store_empty(daemon)


def test_a_pool_lingering_across_a_daemon_restart_connects_to_the_new_daemon(
    daemon, pools, tmp_path, monkeypatch
):
    from conftest import binary

    monkeypatch.setenv("FEEDSTORE_POOL_LINGER_SECONDS", "60")
    theirs = torchs(Augmented(), batch_size=4, num_workers=2)
    seeded(7)
    iterator = iter(pooled(Augmented(), daemon, batch_size=4, num_workers=2))
    served_by = pids(iterator)
    try:
        assert_same_batches(list(iterator), theirs)
        # The pool lingers, connected to a daemon that now goes and comes back.
        daemon.process.send_signal(signal.SIGTERM)
        daemon.process.wait(timeout=30)
        with open(tmp_path / "feedstored-2.log", "wb") as log:
            daemon.process = subprocess.Popen(
                [binary("feedstored"), "--socket", daemon.socket, "--capacity", "256MiB",
                 "--prefault", "false"], stderr=log,
            )
        deadline = time.monotonic() + 60
        while not os.path.exists(daemon.socket):
            assert time.monotonic() < deadline, "feedstored did not come back"
            time.sleep(0.01)
        seeded(7)
        iterator = iter(pooled(Augmented(), daemon, batch_size=4, num_workers=2))
        assert pids(iterator) == served_by  # the same processes, on the new daemon
        assert_same_batches(list(iterator), theirs)
    finally:
        del iterator
        for pid in served_by:
            os.kill(pid, signal.SIGTERM)


class Slow(Augmented):
    """`Augmented`, 50 ms a sample."""

    def __getitem__(self, i):
        time.sleep(0.05)
        return super().__getitem__(i)


@pytest.mark.parametrize("event", ["kill -9", "takeover"])
def test_a_loader_goes_on_across_its_daemon_killed_and_started_again(
    daemon, pools, monkeypatch, event
):
    """Issue 37: the daemon killed (kill -9) mid-epoch and started again on the same socket,
    with FEEDSTORE_RECONNECT_TIMEOUT set: the trainer and the pool's processes reconnect, the
    batches that went with the old daemon are made again (from the random state they were
    first made from), and the epoch is torch's, batch for batch; the batches taken before the
    kill still read their own bytes after it. Taken over instead (`feedstored --takeover`),
    no batch is lost: none is made again."""
    monkeypatch.setenv("FEEDSTORE_RECONNECT_TIMEOUT", "30")
    theirs = torchs(Slow(), batch_size=4, shuffle=True, num_workers=2)
    seeded(7)
    loader = pooled(Slow(), daemon, batch_size=4, shuffle=True, num_workers=2)
    iterator = iter(loader)
    served_by = pids(iterator)
    ours = [next(iterator) for _ in range(3)]
    with iterator._cond:
        # The trainer's pump held off: the workers seal the batches they are making (0.2 s
        # each) into the old daemon, and their replies wait; the kill lands on those batches
        # (made again) and on the ones being made (written again into the new daemon).
        time.sleep(1.0)
        if event == "takeover":
            daemon.take_over()
        else:
            daemon.kill_and_start_again(pause=0.2)
    ours += list(iterator)
    assert_same_batches(ours, theirs)
    if event == "takeover":
        assert loader.feedstore_counters.batches_remade == 0
    else:
        assert loader.feedstore_counters.batches_remade > 0
    assert pids(iterator) == served_by, "the same pool processes, on the new daemon"
    del ours, iterator
    store_empty(daemon)


TENSORS = """
import sys, torch, torch.utils.data as tud
sys.path.insert(0, {tests!r})
from feedstore.torch import DataLoader

dataset = tud.TensorDataset(torch.arange(40.0).reshape(20, 2), torch.arange(20))
iterator = iter(DataLoader(dataset, batch_size=4, num_workers=2, pool="node",
                           socket={socket!r}))
print(sorted(w.pid for w in iterator._workers), flush=True)
assert sum(len(b[0]) for b in iterator) == 20
"""


def test_ranks_over_tensors_share_a_pool_and_a_changed_dataset_gets_its_own(
    daemon, pools, tmp_path, monkeypatch
):
    """torch pickles a tensor's storage under its address: the key must not (every rank
    would start its own pool). Ranks told their rank by argument share it too; a dataset
    changed between epochs gets a pool of its own."""
    monkeypatch.setenv("FEEDSTORE_POOL_LINGER_SECONDS", "60")
    script = tmp_path / "tensors.py"
    script.write_text(TENSORS.format(tests=str(TESTS), socket=daemon.socket))
    served = set()
    try:
        for rank in range(2):
            done = subprocess.run(
                [sys.executable, str(script), f"--local_rank={rank}", "--lr", "3"],
                capture_output=True, timeout=200,
            )
            assert done.returncode == 0, done.stderr.decode()[-3000:]
            served.add(done.stdout.decode().splitlines()[0])
        assert len(served) == 1  # the second rank joined the first's pool

        dataset = Augmented(37)
        loader = pooled(dataset, daemon, batch_size=4, num_workers=2)
        before = loader._feedstore_pool_key()
        dataset.n = 36
        assert loader._feedstore_pool_key() != before
    finally:
        for pid in eval(served.pop()) if served else []:
            os.kill(pid, signal.SIGTERM)


@pytest.mark.parametrize("pool", ["rank", "node"])
def test_stopping_leaves_the_prefetched_batches_unmade(daemon, pools, tmp_path, pool):
    gate, log = tmp_path / "gate", tmp_path / "made"
    loader = DataLoader(
        Gated(gate, log), batch_size=1, num_workers=1, prefetch_factor=4, pool=pool,
        socket=daemon.socket,
    )
    iterator = iter(loader)
    assert next(iterator).tolist() == [[0]]
    deadline = time.monotonic() + 60  # (a bound on a hang, not a timing assertion)
    while "start 1" not in log.read_text():
        assert time.monotonic() < deadline, "the worker never started index 1"
        time.sleep(0.005)
    # The worker is making 1 (waiting at the gate), with 2-4 queued behind it.
    stop = iterator._outbox.stop

    def stop_then_open():
        stop()  # (the stop is in the worker's pipe now, behind the queued tasks)
        gate.touch()

    iterator._outbox.stop = stop_then_open
    iterator._shutdown()
    made = sorted(int(line) for line in log.read_text().splitlines() if line.isdigit())
    assert made == [0, 1], "the batch being made is finished; the queued ones are not made"
    if pool == "rank":
        assert iterator._workers[0].process.exitcode == 0, "it left on its own"
    store_empty(daemon)
