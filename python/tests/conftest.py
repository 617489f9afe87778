"""Fixtures: a real feedstored per test, real `feedstore produce` processes, real photos and the
real Qwen3 tokenizer (the repository's test data, producer/tests/data).

The binaries come from $FEEDSTORE_BIN_DIR (set by tests/python.rs, which builds them), else
from target/release or target/debug of this checkout.
"""

import gzip
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
DATA = REPO / "producer" / "tests" / "data"
PHOTOS = sorted((DATA / "photos").glob("*.*"))


def binary(name: str) -> pathlib.Path:
    dirs = [os.environ.get("FEEDSTORE_BIN_DIR")] if os.environ.get("FEEDSTORE_BIN_DIR") else []
    dirs += [REPO / "target" / "release", REPO / "target" / "debug"]
    for d in dirs:
        path = pathlib.Path(d) / name
        if path.exists():
            return path
    raise RuntimeError(f"{name} is not built: run `cargo build --release --bins`")


def start_daemon(socket: pathlib.Path, log: pathlib.Path, *extra: str) -> subprocess.Popen:
    """Starts feedstored on `socket` (its log appended to `log`) and waits until it answers
    there: a socket file left by a daemon killed with kill -9 refuses connections until then."""
    import socket as sockets

    with open(log, "ab") as stderr:
        process = subprocess.Popen(
            [binary("feedstored"), "--socket", socket, "--capacity", "256MiB", "--prefault", "false",
             *extra],
            stderr=stderr,
        )
    deadline = time.monotonic() + 30
    while True:
        try:
            with sockets.socket(sockets.AF_UNIX) as probe:
                probe.connect(str(socket))
            return process
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"feedstored did not start: {log.read_text()}") from None
            time.sleep(0.01)


class Daemon:
    def __init__(self, socket: pathlib.Path, process: subprocess.Popen, log: pathlib.Path):
        self.socket = str(socket)
        self.process = process
        self.log = log

    def kill_and_start_again(self, pause: float = 0.0) -> None:
        """kill -9 on the daemon, then a new one on the same socket `pause` seconds later."""
        self.process.kill()
        self.process.wait(timeout=30)
        time.sleep(pause)
        self.process = start_daemon(pathlib.Path(self.socket), self.log)

    def take_over(self) -> None:
        """`feedstored --takeover` in place of the daemon: returns once the old one exited
        (cleanly) and the new one serves."""
        successor = start_daemon(pathlib.Path(self.socket), self.log, "--takeover")
        assert self.process.wait(timeout=60) == 0, self.log.read_text()
        self.process = successor

    def stats(self) -> dict:
        import feedstore

        return feedstore.Client(self.socket).stats()

    def wait_for(self, what, predicate, timeout: float = 60.0) -> dict:
        """Polls the daemon's stats until `predicate(stats)` holds (fails the test after
        `timeout`: a bound on a hang, not a timing assertion)."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.stats()
            if predicate(stats):
                return stats
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: stats stayed {stats}")
            time.sleep(0.02)


@pytest.fixture
def daemon(tmp_path):
    socket = tmp_path / "feedstore.sock"
    # The daemon's log goes to a file: a pipe nobody reads would fill (a line per connection)
    # and block the daemon.
    log = tmp_path / "feedstored.log"
    daemon = Daemon(socket, start_daemon(socket, log), log)
    yield daemon
    # (The daemon a test started again in its place, if it did.)
    daemon.process.send_signal(signal.SIGTERM)
    daemon.process.wait(timeout=30)


def manifest(path: pathlib.Path, records: int) -> pathlib.Path:
    """`records` LLaVA-style records over the real photos (record i: photo i mod n), with
    conversations whose text names the record, so each sample can be checked."""
    with open(path, "w") as f:
        for i in range(records):
            photo = PHOTOS[i % len(PHOTOS)]
            f.write(
                json.dumps(
                    {
                        "id": f"rec-{i}",
                        "image": str(photo),
                        "conversations": [
                            {"from": "human", "value": f"<image>\nWhat is in picture {i}?"},
                            {"from": "gpt", "value": f"Picture {i} shows {photo.stem}."},
                        ],
                    }
                )
                + "\n"
            )
    return path


def produce(daemon: Daemon, tmp_path, name: str, records: int, *args: str) -> subprocess.Popen:
    """Starts `feedstore produce --stream name` over a fresh manifest (64x64 uint8 HWC images)."""
    path = manifest(tmp_path / f"{name}.jsonl", records)
    tokenizer = tmp_path / "tokenizer.json"
    if not tokenizer.exists():
        tokenizer.write_bytes(gzip.decompress((DATA / "qwen3-tokenizer.json.gz").read_bytes()))
    return subprocess.Popen(
        [
            binary("feedstore"), "produce", "--socket", daemon.socket,
            "--manifest", path, "--tokenizer", tokenizer,
            "--image-size", "64x64", "--dtype", "u8", "--layout", "hwc", "--workers", "1",
            "--image-root", DATA / "photos", "--stream", name, *args,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def finish(producer: subprocess.Popen) -> None:
    """Waits for a producer and fails the test if it failed."""
    _, err = producer.communicate(timeout=300)
    assert producer.returncode == 0, err.decode()


@pytest.fixture
def python() -> str:
    return sys.executable
