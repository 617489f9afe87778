"""What the stable ABI costs the Python paths: the same per-sample figures as python_get.py's
feedstore rows (the next sample of a stream, a get by handle, a put of a 4 MiB array) through two
builds of the extension, side by side, in alternating rounds on one daemon binary.

Usage (release binaries built; each directory holds an importable `feedstore` package):

    cargo build --release --bins -p feedstore
    python benches/abi3.py --build abi3=/path/to/abi3 --build full=/path/to/full [--rounds 3]

The abi3 build is the wheel's (unzip target/wheels/feedstore-*.whl); the other is the same
package with an extension built without pyo3's `abi3-py39` feature.
"""

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent

ROUND = """
import json, sys
import numpy as np
sys.path.insert(0, {benches!r})
from python_get import SIDE, bench_feedstore
rng = np.random.default_rng(0)
images = [rng.integers(0, 255, (SIDE, SIDE), dtype=np.uint8) for _ in range(32)]
get, get_p99, put, stream, stream_p99 = bench_feedstore(images, {gets})
import feedstore
print(json.dumps(dict(stream=stream, get=get, put=put, native=feedstore._native.__file__)))
"""


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", action="append", required=True, metavar="NAME=DIR",
                        help="a build to time: its name and the directory holding its package")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per build")
    parser.add_argument("--gets", type=int, default=2000, help="timed samples per round")
    args = parser.parse_args()
    builds = [b.split("=", 1) for b in args.build]
    figures = {name: [] for name, _ in builds}
    for _ in range(args.rounds):
        for name, path in builds:
            env = dict(os.environ, PYTHONPATH=path)
            out = subprocess.run(
                [sys.executable, "-c", ROUND.format(benches=str(HERE), gets=args.gets)],
                env=env, check=True, capture_output=True, text=True,
            ).stdout
            result = json.loads(out.strip().splitlines()[-1])
            print(f"  {name:<8} {result['native']}: stream {result['stream']:.2f} µs, "
                  f"get {result['get']:.1f} µs, put {result['put']:.0f} µs", flush=True)
            figures[name].append(result)
    base = builds[-1][0]
    print(f"medians over {args.rounds} rounds, against {base}:")
    for name, _ in builds:
        row = []
        for key, unit in (("stream", "µs"), ("get", "µs"), ("put", "µs")):
            value = statistics.median(r[key] for r in figures[name])
            ref = statistics.median(r[key] for r in figures[base])
            row.append(f"{key} {value:7.2f} {unit} ({value / ref:4.2f}x)")
        print(f"  {name:<8} " + "   ".join(row))


if __name__ == "__main__":
    main()
