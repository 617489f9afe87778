"""How long a trainer reading zero-copy batches waits, by prefetch depth: `feedstore produce
--batch 32` (each batch placed in one object) read with `Stream.next_stacked(32)` +
`torch.from_dlpack`, at the default depth (3 batches), at two batches (the former advice) and
at four, against the copying path (`produce` without `--batch`, `next_batch(32, out=)`), all
in one run on the same data and CPUs, configurations alternating round by round.

The data is the demo's (256 records: real photos and easy-VQA images of 256-2048 px, and their
conversations), made into 448x448 f32 CHW images (2.4 MB) and Qwen3 tokens by `feedstore
produce --workers 2`. The trainer takes `--steps` batches of 32 and "computes" for `--step-ms`
after each (a sleep: a GPU step the CPU waits out), holding each batch until it has the next,
as `for batch in loader:` does. The wait ratio is the time in the read over
read + step, the first batch apart (the cold start).

Usage (release binaries built; `feedstore demo` run once, which writes the data set to
~/.cache/feedstore/demo):

    cargo build --release --bins -p feedstore && pip install ./python
    python benches/stacked_wait.py [--rounds 2] [--steps 24] [--step-ms 400]
"""

import argparse
import gzip
import os
import pathlib
import statistics
import subprocess
import tempfile
import time

import numpy as np
import torch

import feedstore
from daemon import feedstored

REPO = pathlib.Path(__file__).resolve().parents[1]
BATCH, SIDE = 32, 448


def run(args, data, tokenizer, label, batched, depth):
    """One configuration: a fresh daemon and producer, one trainer; returns its wait ratio
    and how many batches were copied rather than viewed."""
    records = sum(1 for _ in open(data / "data.jsonl"))
    steps_total = args.steps + 1
    epochs = -(-steps_total * BATCH // records)
    capacity = f"{(max(depth or 0, 3 * BATCH) + 2 * BATCH) * 3 * SIDE * SIDE * 4 // 2**20 + 256}MiB"
    with feedstored(capacity) as socket:
        name = f"wait-{label}"
        produce = [
            REPO / "target" / "release" / "feedstore", "produce", "--socket", socket,
            "--manifest", data / "data.jsonl", "--tokenizer", tokenizer,
            "--stream", name, "--world", "1", "--epochs", str(epochs),
            "--image-size", f"{SIDE}x{SIDE}", "--dtype", "f32", "--workers", "2",
            "--no-cache",  # every epoch made again, as with --batch (no decode-once cache)
        ]
        if batched:
            produce += ["--batch", str(BATCH)]
        if depth is not None:
            produce += ["--prefetch", str(depth)]
        producer = subprocess.Popen(produce, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            stream = feedstore.Stream(name, records, epochs=epochs, socket=socket, wait=120)
            out = np.zeros((BATCH, 3, SIDE, SIDE), np.float32)  # touched: no page faults timed
            waits, step = [], args.step_ms / 1000
            parts = []
            held = None  # the batch being trained on, dropped once the next is in hand
            for k in range(steps_total):
                t = time.perf_counter()
                if batched:
                    samples, images = stream.next_stacked(BATCH)
                    got = time.perf_counter()
                    tensor = torch.from_dlpack(images)
                    if args.verbose:
                        parts.append((round((got - t) * 1e3, 2), round((time.perf_counter() - got) * 1e3, 2)))
                else:
                    samples = stream.next_batch(BATCH, out=out)
                    tensor = torch.from_numpy(out)
                waited = time.perf_counter() - t
                assert len(samples) == BATCH and tensor.shape == (BATCH, 3, SIDE, SIDE)
                if k > 0:
                    waits.append(waited)
                # As `for batch in loader:` does: the last batch is let go only now.
                held = (samples, tensor)
                del samples, tensor
                if batched:
                    del images
                time.sleep(step)
            del held
            copies = stream.stacked_copies if batched else None
        finally:
            producer.kill()
            producer.wait()
    wait = sum(waits)
    ratio = wait / (wait + step * len(waits))
    if args.verbose:
        print(f"  {label}: waits ms {[round(w * 1e3, 1) for w in waits]}")
        print(f"  {label}: next_stacked, from_dlpack ms {parts}")
    return ratio, copies


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=24, help="timed batches per configuration")
    p.add_argument("--step-ms", type=float, default=400.0)
    p.add_argument("--verbose", action="store_true", help="print each step's wait")
    p.add_argument("--data", type=pathlib.Path,
                   default=pathlib.Path(os.environ.get("XDG_CACHE_HOME", pathlib.Path.home() / ".cache"))
                   / "feedstore" / "demo")
    args = p.parse_args()
    if not (args.data / "data.jsonl").exists():
        raise SystemExit(f"no {args.data}/data.jsonl: run `feedstore demo` once first")
    tokenizer = pathlib.Path(tempfile.mkdtemp()) / "tokenizer.json"
    tokenizer.write_bytes(gzip.decompress(
        (REPO / "producer/tests/data/qwen3-tokenizer.json.gz").read_bytes()))
    configs = [
        ("copy", "copies: `produce`, `next_batch(32, out=)`", False, None),
        ("d64", "view: `produce --batch 32 --prefetch 64` (2 batches)", True, 64),
        ("default", "**view: `produce --batch 32`, default depth (3 batches)**", True, None),
        ("d128", "view: `produce --batch 32 --prefetch 128` (4 batches)", True, 128),
    ]
    ratios = {label: [] for label, *_ in configs}
    for r in range(args.rounds):
        for label, _, batched, depth in configs:
            ratio, copies = run(args, args.data, tokenizer, label, batched, depth)
            assert copies in (None, 0), f"{label}: {copies} batches were copied, not viewed"
            ratios[label].append(ratio)
            print(f"round {r + 1}/{args.rounds}: {label:8} wait {100 * ratio:5.1f}%", flush=True)
    print()
    print(f"## Trainer wait, batches of {BATCH} x 3x{SIDE}x{SIDE} f32, step {args.step_ms:.0f} ms, "
          f"{args.steps} steps after the first, {args.rounds} rounds")
    print()
    print("| reader | wait (per round) | median |")
    print("|---|---|---|")
    for label, text, *_ in configs:
        each = " / ".join(f"{100 * x:.1f}%" for x in ratios[label])
        print(f"| {text} | {each} | {100 * statistics.median(ratios[label]):.1f}% |")


if __name__ == "__main__":
    main()
