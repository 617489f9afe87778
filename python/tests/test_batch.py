"""Batch objects without pickle: every value a collate_fn makes round-trips, a class is stored
only if listed, a malformed object is an error (never a crash), and a batch planted by another
uid, or in the pickled format of earlier releases, is never read, let alone run."""

import collections
import dataclasses
import os
import pathlib
import pickle
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="batches hold torch tensors (python3-torch)")

import feedstore  # noqa: E402
from feedstore import _batch  # noqa: E402
from feedstore.torch import to_torch  # noqa: E402
from conftest import binary  # noqa: E402

Point = collections.namedtuple("Point", "x y")


@dataclasses.dataclass
class Labelled:
    name: str
    weights: torch.Tensor


class Slotted:
    __slots__ = ("a", "b")

    def __init__(self, a, b):
        self.a, self.b = a, b

    def __eq__(self, other):
        return type(other) is Slotted and (self.a, self.b) == (other.a, other.b)


def round_trip(daemon, batch, **read):
    writer = feedstore.Client(daemon.socket, writer=True)
    handle = _batch.write(writer, batch, classes=read.get("classes", ()))
    return _batch.read(feedstore.Client(daemon.socket).get(handle), **read)


def same(a, b):
    assert type(a) is type(b), (a, b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            same(x, y)
    elif isinstance(a, float) and a != a:
        assert b != b
    else:
        assert a == b


def test_every_builtin_value_round_trips(daemon):
    batch = {
        "none": None,
        "flags": [True, False],
        "ints": (0, -1, 2**63 - 1, -(2**63), 2**63, -(2**63) - 1, 7**300, -(7**301)),
        "floats": [0.25, -0.0, float("inf"), float("nan")],
        "complex": 1 - 2j,
        "text": "héllo \u2603",
        "bytes": b"\x00\xff",
        "nested": [[{"deep": (1, [2, {"deeper": ()}])}]],
        "ordered": collections.OrderedDict([("b", 1), ("a", 2)]),
        (1, "tuple key"): "keys of any hashable builtin",
        "bf16": torch.ones(2, 3, dtype=torch.bfloat16),
        "empty": torch.zeros(0, 4),
        "scalar_tensor": torch.tensor(7),
        "bool_tensor": torch.tensor([True, False]),
        "transposed": torch.arange(12.0).reshape(3, 4).t(),
        "text_array": np.array(["ab", "c", "\u2603"]),
        "bytes_array": np.array([b"ab", b"c"]),
        "big_endian": np.arange(4, dtype=">i4"),
        "np_scalar": np.float32(2.5),
        "np_int": np.int64(-3),
        "np_text": np.str_("word"),
    }
    back = round_trip(daemon, batch)
    expected = dict(batch)
    expected["transposed"] = batch["transposed"].contiguous()
    expected["big_endian"] = batch["big_endian"].astype("<i4")
    same(back, expected)
    assert type(back["np_scalar"]) is np.float32 and back["np_scalar"] == 2.5


def test_a_tensor_met_twice_is_stored_once(daemon):
    t = torch.arange(1000, dtype=torch.float64)
    writer = feedstore.Client(daemon.socket, writer=True)
    once = _batch.write(writer, {"a": t})
    twice = _batch.write(writer, {"a": t, "b": t})
    reader = feedstore.Client(daemon.socket)
    assert reader.get(twice).nbytes - reader.get(once).nbytes < t.numel() * 8
    back = _batch.read(reader.get(twice))
    same(back["a"], t)
    same(back["b"], t)


def test_a_class_is_stored_only_when_the_writer_and_reader_list_it(daemon):
    batch = {
        "point": Point(torch.ones(2), "y"),
        "labelled": Labelled("w", torch.zeros(3)),
        "slotted": Slotted(1, [2]),
    }
    writer = feedstore.Client(daemon.socket, writer=True)
    with pytest.raises(TypeError) as e:
        _batch.write(writer, batch)
    assert "Point" in str(e.value) and "batch_classes" in str(e.value)
    classes = [Point, Labelled, Slotted]
    back = round_trip(daemon, batch, classes=classes)
    assert type(back["point"]) is Point and back["point"].y == "y"
    same(back["point"].x, torch.ones(2))
    assert type(back["labelled"]) is Labelled and back["labelled"].name == "w"
    same(back["labelled"].weights, torch.zeros(3))
    assert back["slotted"] == Slotted(1, [2])
    # A reader that was not told of a class refuses the batch, naming it.
    handle = _batch.write(writer, {"p": Point(1, 2)}, classes=[Point])
    with pytest.raises(feedstore.UntrustedBatch) as e:
        _batch.read(feedstore.Client(daemon.socket).get(handle))
    assert "Point" in str(e.value) and "batch_classes" in str(e.value)
    # A class of the same name that is not the listed one is not it.
    Impostor = collections.namedtuple("Point", "x y")
    with pytest.raises(TypeError):
        _batch.write(writer, {"p": Impostor(1, 2)}, classes=[Point])


def test_what_a_batch_cannot_hold_is_named_when_written(daemon):
    writer = feedstore.Client(daemon.socket, writer=True)
    for bad, words in [
        (np.array([object()], dtype=object), "object"),
        ({1, 2}, "set"),
        (lambda: 0, "function"),
        (torch.ones(2).to_sparse(), "dense"),
    ]:
        with pytest.raises(TypeError) as e:
            _batch.write(writer, {"x": bad})
        assert words in str(e.value), str(e.value)
    looped = []
    looped.append(looped)
    with pytest.raises(ValueError) as e:
        _batch.write(writer, looped)
    assert "refers to itself" in str(e.value)


def raw_object(daemon, data: bytes) -> str:
    writer = feedstore.Client(daemon.socket, writer=True)
    reservation = writer.reserve(len(data))
    reservation.write(0, data)
    return reservation.seal()


def test_malformed_batch_objects_are_errors(daemon):
    reader = feedstore.Client(daemon.socket)
    good = bytearray(
        reader.get(_batch.write(feedstore.Client(daemon.socket, writer=True), {"t": torch.ones(4)})).data
    )
    cases = [
        good[:20],  # cut inside the skeleton
        good[:72],  # the tensor (bytes 64..80) cut short
        good[:8] + (10**9).to_bytes(8, "little") + good[16:],  # a skeleton longer than the object
        good[:16] + b"\x63" + good[17:],  # an unknown tag
        b"FSBATCH2" + (5).to_bytes(8, "little") + b"\x09\xff\xff\xff\x7f",  # a lying count
        b"FSBATCH2" + (501).to_bytes(8, "little") + b"\x09\x01\x00\x00\x00" * 100 + b"\x00",
    ]
    for data in cases:
        sample = reader.get(raw_object(daemon, bytes(data)))
        assert _batch.is_batch(sample)
        with pytest.raises(feedstore.Corrupt):
            _batch.read(sample)


def pickle_bomb(marker: pathlib.Path) -> bytes:
    """An object in the pickled batch format of earlier releases whose pickle, once loaded,
    creates `marker`."""

    class Bomb:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    skeleton = pickle.dumps(Bomb())
    return b"FSBATCH1" + len(skeleton).to_bytes(8, "little") + skeleton


def test_a_pickled_batch_is_refused_and_never_runs(daemon, tmp_path):
    marker = tmp_path / "ran"
    handle = raw_object(daemon, pickle_bomb(marker))
    sample = feedstore.Client(daemon.socket).get(handle)
    assert _batch.is_batch(sample)
    for read in (lambda: to_torch(sample), lambda: _batch.read(sample, trusted_uids=[os.geteuid()])):
        with pytest.raises(feedstore.UntrustedBatch) as e:
            read()
        assert "pickle" in str(e.value)
    assert not marker.exists()


NOBODY = 65534

ATTACKER = textwrap.dedent(
    """
    import os, sys, feedstore
    from feedstore import _batch
    import torch

    socket, marker = sys.argv[1], sys.argv[2]
    client = feedstore.Client(socket, writer=True)

    class Bomb:
        def __reduce__(self):
            return (os.system, ("touch " + marker,))

    import pickle
    skeleton = pickle.dumps(Bomb())
    bomb = b"FSBATCH1" + len(skeleton).to_bytes(8, "little") + skeleton
    reservation = client.reserve(len(bomb))
    reservation.write(0, bomb)
    planted = reservation.seal()
    forged = _batch.write(client, {"input_ids": torch.zeros(4, dtype=torch.int64)})
    print(planted, forged, flush=True)
    sys.stdin.read()
    """
)


@pytest.mark.skipif(os.geteuid() != 0, reason="acting as another uid needs root")
def test_batches_planted_by_another_uid_are_never_read_and_pickles_never_run(tmp_path):
    """A uid allowed to write (--allow-uid 65534) plants a pickle bomb and a well-formed batch
    and hands out their handles; root's trainer reads neither (and the bomb runs under no
    circumstances), unless it says it trusts that uid's well-formed batches. (Streams are per
    uid: root's trainer never reads another user's stream.)"""
    home = pathlib.Path(tempfile.mkdtemp(prefix="feedstore-plant-"))
    home.chmod(0o755)
    marker = home / "ran"
    socket = home / "feedstore.sock"
    log = open(home / "feedstored.log", "wb")
    daemon = subprocess.Popen(
        [binary("feedstored"), "--socket", socket, "--capacity", "64MiB", "--prefault", "false",
         "--allow-uid", str(NOBODY)],
        stderr=log,
    )
    attacker = None
    try:
        deadline = time.monotonic() + 30
        while not socket.exists():
            assert daemon.poll() is None and time.monotonic() < deadline
            time.sleep(0.01)

        def drop_to_nobody():
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)

        attacker = subprocess.Popen(
            [sys.executable, "-c", ATTACKER, str(socket), str(marker)],
            preexec_fn=drop_to_nobody,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**os.environ, "FEEDSTORE_DAEMON_UID": "0"},
        )
        planted, forged = attacker.stdout.readline().decode().split()
        reader = feedstore.Client(str(socket))
        bomb, batch = reader.get(planted), reader.get(forged)
        assert (bomb.writer_uid, batch.writer_uid) == (NOBODY, NOBODY)
        for sample in (bomb, batch):
            with pytest.raises(feedstore.UntrustedBatch) as e:
                to_torch(sample)
            assert "uid 65534" in str(e.value) and "trusted_uids" in str(e.value)
        # Trusting the uid reads its well-formed batch; its pickle is refused all the same.
        assert to_torch(batch, trusted_uids=[NOBODY])["input_ids"].tolist() == [0, 0, 0, 0]
        with pytest.raises(feedstore.UntrustedBatch):
            to_torch(bomb, trusted_uids=[NOBODY])
        assert not marker.exists(), "the pickle ran"
    finally:
        if attacker is not None:
            attacker.kill()
            attacker.wait()
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=30)
        log.close()
        for f in home.iterdir():
            f.unlink()
        home.rmdir()


def start_daemon(home: pathlib.Path, name: str, *args: str) -> subprocess.Popen:
    socket = home / f"{name}.sock"
    with open(home / f"{name}.log", "wb") as log:
        process = subprocess.Popen(
            [binary("feedstored"), "--socket", socket, "--capacity", "64MiB", "--prefault",
             "false", *args],
            stderr=log,
        )
    deadline = time.monotonic() + 30
    while not socket.exists():
        assert process.poll() is None and time.monotonic() < deadline, (home / f"{name}.log").read_text()
        time.sleep(0.01)
    return process


def test_a_pickle_planted_on_a_peer_never_runs_on_the_node_that_pulls_it(tmp_path):
    """Node A (a peer holding the cluster secret) has a pickle bomb in its store; node B's
    trainer pulls it by handle (the copy is sealed on B) and refuses it; a well-formed batch
    from A reads as written, its writer's uid as A's daemon recorded it."""
    import socket as sockets

    ports = []
    for _ in range(2):
        with sockets.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    secret = tmp_path / "secret"
    secret.write_text("the-cluster-secret-of-this-test\n")
    secret.chmod(0o600)
    a_addr, b_addr = (f"127.0.0.1:{p}" for p in ports)
    common = ["--cluster-secret-file", str(secret), "--peers", f"{a_addr},{b_addr}"]
    a = start_daemon(tmp_path, "a", "--node-id", "1", "--listen", a_addr, *common)
    b = start_daemon(tmp_path, "b", "--node-id", "2", "--listen", b_addr, *common)
    try:
        writer = feedstore.Client(str(tmp_path / "a.sock"), writer=True)
        marker = tmp_path / "ran"
        bomb = pickle_bomb(marker)
        reservation = writer.reserve(len(bomb))
        reservation.write(0, bomb)
        planted = reservation.seal()
        batch = _batch.write(writer, {"pixel_values": torch.arange(6.0).reshape(2, 3)})
        reader = feedstore.Client(str(tmp_path / "b.sock"))
        pulled = reader.get(planted)
        with pytest.raises(feedstore.UntrustedBatch):
            to_torch(pulled)
        assert not marker.exists(), "the pickle ran"
        good = reader.get(batch)
        assert good.writer_uid == os.geteuid()
        assert to_torch(good)["pixel_values"].tolist() == [[0, 1, 2], [3, 4, 5]]
        assert feedstore.Client(str(tmp_path / "b.sock")).stats()["pulls"] == 2
    finally:
        for p in (a, b):
            p.send_signal(signal.SIGTERM)
            p.wait(timeout=30)


def test_rebuilding_an_allowed_class_runs_no_more_than_its_reduce_asks(daemon):
    """A batch rewritten to call an allowed class that does not reduce to a call of itself, or
    to set an attribute its slots do not declare, is refused: an allowed class is rebuilt the
    way it reduces, not any way the bytes say."""
    writer = feedstore.Client(daemon.socket, writer=True)
    reader = feedstore.Client(daemon.socket)

    def rewritten(batch, classes, old: bytes, new: bytes):
        data = bytes(reader.get(_batch.write(writer, batch, classes=classes)).data)
        assert data.count(old) == 1
        return reader.get(raw_object(daemon, data.replace(old, new)))

    name = f"{Point.__module__}:{Point.__qualname__}".encode()
    head = b"\x0e" + len(name).to_bytes(4, "little") + name
    called = rewritten({"p": Point(1, 2)}, [Point], head + b"\x00", head + b"\x01")
    with pytest.raises(feedstore.UntrustedBatch) as e:
        _batch.read(called, classes=[Point])
    assert "does not reduce to a call" in str(e.value)
    slot = b"\x07\x01\x00\x00\x00b"
    other = rewritten({"s": Slotted(1, 2)}, [Slotted], slot, b"\x07\x01\x00\x00\x00z")
    with pytest.raises(feedstore.UntrustedBatch) as e:
        _batch.read(other, classes=[Slotted])
    assert "no such slot" in str(e.value)
