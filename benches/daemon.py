"""A private feedstored for the Python benches: started on a fresh socket, stopped on exit."""

import contextlib
import os
import pathlib
import signal
import subprocess
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def feedstored(capacity: str, *args: str):
    """Runs `target/release/feedstored --capacity CAPACITY ARGS...`; yields its socket path."""
    socket = os.path.join(tempfile.mkdtemp(), "bench.sock")
    daemon = subprocess.Popen(
        [REPO / "target" / "release" / "feedstored", "--socket", socket, "--capacity", capacity,
         *args],
        stderr=subprocess.DEVNULL,
    )
    try:
        while not os.path.exists(socket):
            if daemon.poll() is not None:
                raise SystemExit(f"feedstored exited ({daemon.returncode}): is it built?")
            time.sleep(0.01)
        yield socket
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait()
