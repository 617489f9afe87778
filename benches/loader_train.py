"""A training loop fed by `torch.utils.data.DataLoader` and by `feedstore.torch.DataLoader`, side
by side in one run: the same Python dataset, the same CPUs, the same step.

The dataset is the demo's (256 records: real photos and easy-VQA images of 256-2048 px, and
their conversations): each sample is decoded with Pillow, resized to 448x448 (bicubic),
normalised with CLIP's mean and std into a float32 CHW tensor, and its conversation tokenized
with the Qwen3 tokenizer (Hugging Face `tokenizers`) into 64 ids. Each rank is its own trainer
process with its own loader (`DistributedSampler`), taking `--steps` batches of 16 and
"computing" for `--step-ms` after each (a sleep: a GPU step the CPU waits out).

Three loaders: torch's; feedstore's with `pool="rank"` (each rank its own `num_workers`
processes, as torch); feedstore's with `pool="node"` (worker `w` of every rank is one process of
the node's pool, so the ranks share `num_workers` processes). A fourth on request
(`--loaders ... feedstore-cache`): `pool="node"` with `sample_cache=True` (the decode-once
cache: each sample decoded once on the node, later epochs and the other ranks map it), its
daemon given room for the whole decoded data set besides the batches.

Per cell (loader x workers per rank x local ranks): the wait-time ratio (time in `next`, and in
starting and stopping each epoch's iterator, over the run; the first batch apart), samples/s of
all ranks together, the time to the first batch, and two peaks of memory. Each trainer reads
every page of its batches, as a copy to an accelerator would. "PSS" is the peak PSS of the whole
process tree (trainers, workers, for feedstore the daemon and the node pool's processes, which
are detached from it). "node" adds what PSS misses: the node's shared memory (/proc/meminfo's
Shmem, less what it was before the cell) counted once, mapped or not (torch's /dev/shm tensors
between a worker and its trainer; the store's pages), with the processes' private and file
pages as PSS splits them. `--breakdown` shows each peak by kind of process.

Usage (release binaries built; `feedstore demo` run once, which writes the data set to
~/.cache/feedstore/demo; `pip install tokenizers`):

    cargo build --release --bins -p feedstore && pip install ./python tokenizers
    python benches/loader_train.py [--steps 30] [--step-ms 250]
"""

import argparse
import warnings
import gzip
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from daemon import feedstored

REPO = pathlib.Path(__file__).resolve().parents[1]  # the repository (its test data)
MEAN = (0.48145466, 0.4578275, 0.40821073)
STD = (0.26862954, 0.26130258, 0.27577711)
SIDE, TOKENS, BATCH = 448, 64, 16


class Sft:
    """The demo's records as a map-style dataset: Pillow decode + resize + normalise, and the
    conversation tokenized."""

    def __init__(self, root, tokenizer_json):
        self.root = pathlib.Path(root)
        self.records = [json.loads(line) for line in open(self.root / "data.jsonl")]
        self.tokenizer_json = tokenizer_json
        self.tokenizer = None

    def __len__(self):
        return len(self.records)

    def __getitem__(self, i):
        import numpy as np
        import torch
        from PIL import Image
        from tokenizers import Tokenizer

        if self.tokenizer is None:
            self.tokenizer = Tokenizer.from_str(self.tokenizer_json)
        record = self.records[i]
        with Image.open(self.root / record["image"]) as image:
            rgb = image.convert("RGB").resize((SIDE, SIDE), Image.BICUBIC)
        pixels = np.asarray(rgb, dtype=np.float32) / 255.0
        pixels = (pixels - np.array(MEAN, dtype=np.float32)) / np.array(STD, dtype=np.float32)
        text = "\n".join(turn["value"] for turn in record["conversations"])
        ids = self.tokenizer.encode(text).ids[:TOKENS]
        ids += [0] * (TOKENS - len(ids))
        return {
            "pixel_values": torch.from_numpy(pixels.transpose(2, 0, 1).copy()),
            "input_ids": torch.tensor(ids, dtype=torch.int64),
            "id": record["id"],
        }


def trainer(args):
    """One rank: iterate its loader for `steps` batches; print its figures as JSON."""
    # torch's advice against more workers than cores: this bench runs 2 and 4 on purpose.
    warnings.filterwarnings("ignore", message="This DataLoader will create")
    import torch
    import torch.utils.data as tud

    tokenizer = gzip.decompress(
        (REPO / "producer/tests/data/qwen3-tokenizer.json.gz").read_bytes()
    ).decode()
    dataset = Sft(args.data, tokenizer)
    sampler = tud.DistributedSampler(dataset, num_replicas=args.ranks, rank=args.rank, seed=0)
    options = dict(batch_size=BATCH, sampler=sampler, num_workers=args.workers, drop_last=True,
                   persistent_workers=args.persistent_workers)
    if args.loader.startswith("feedstore"):
        from feedstore.torch import DataLoader

        pool = "rank" if args.loader == "feedstore" else "node"
        loader = DataLoader(dataset, socket=args.socket, pool=pool,
                            sample_cache=args.loader == "feedstore-cache", **options)
    else:
        loader = tud.DataLoader(dataset, **options)
    waited, steps, epoch, starts, stops = 0.0, 0, 0, 0.0, 0.0
    start = time.perf_counter()
    first = None
    while steps < args.steps:
        sampler.set_epoch(epoch)
        before = time.perf_counter()
        iterator = iter(loader)
        if first is not None:
            waited += time.perf_counter() - before  # an epoch's start is waited for too
            starts += time.perf_counter() - before
        while steps < args.steps:
            before = time.perf_counter()
            try:
                batch = next(iterator)
            except StopIteration:
                break
            got = time.perf_counter()
            if first is None:
                first = got - start
            else:
                waited += got - before  # the first batch is reported on its own
            pixels = batch["pixel_values"]
            assert pixels.shape == (BATCH, 3, SIDE, SIDE)
            # Every page of the batch read, as a copy to the accelerator reads it (one float
            # per 4 KiB: the pages, not the arithmetic).
            float(pixels.view(-1)[::1024].sum())
            del pixels
            del batch
            time.sleep(args.step_ms / 1000)
            steps += 1
        epoch += 1
        before = time.perf_counter()
        del iterator  # (stopping the workers: waited for too)
        waited += time.perf_counter() - before
        stops += time.perf_counter() - before
    elapsed = time.perf_counter() - start - first
    print(json.dumps({"first": first, "waited": waited, "elapsed": elapsed, "steps": steps,
                      "starts": starts, "stops": stops, "epochs": epoch}))


def tree(root):
    """The pids of `root` and all its descendants."""
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(ppid, []).append(int(entry))
    pids, todo = [], [root]
    while todo:
        pid = todo.pop()
        pids.append(pid)
        todo += children.get(pid, [])
    return pids


def pool_pids(run_dir):
    """The processes of the node's worker pools under `run_dir` (detached: not in the tree),
    known by the slot lock each holds open."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fds = os.listdir(f"/proc/{entry}/fd")
            if any(os.readlink(f"/proc/{entry}/fd/{fd}").startswith(run_dir) for fd in fds):
                pids.append(int(entry))
        except OSError:
            continue
    return pids


PARTS = ("Pss_Anon", "Pss_File", "Pss_Shmem")


def pss_parts(pid):
    """`pid`'s PSS in KiB, split as smaps_rollup splits it: {"Pss": .., "Pss_Anon": .., ...}."""
    parts = dict.fromkeys(("Pss", *PARTS), 0)
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                name = line.split(":", 1)[0]
                if name in parts:
                    parts[name] += int(line.split()[1])
    except OSError:
        pass
    return parts


def shmem_kib():
    """The node's shared memory in KiB (/proc/meminfo's Shmem): every page of every memfd and
    /dev/shm file, mapped or not, counted once."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Shmem:"):
                return int(line.split()[1])
    return 0


def cell(args, loader, workers, ranks):
    """Runs one cell: `ranks` trainer processes; returns their figures and the peak PSS."""
    if loader == "torch":
        return ranks_run(args, loader, workers, ranks, socket="")
    # Sized as the README says: room for each rank's prefetched batches (2 per worker) and the
    # two it holds (the one in use, the one being taken), plus slack.
    batch_mib = BATCH * 3 * SIDE * SIDE * 4 / 2**20 + 1
    capacity = int(ranks * (2 * workers + 2) * batch_mib) + 64
    if loader == "feedstore-cache":
        capacity += int(256 * (batch_mib - 1) / BATCH) + 64  # every decoded sample
    with feedstored(f"{capacity}MiB", "--prefault", "false") as socket:
        return ranks_run(args, loader, workers, ranks, socket)


def ranks_run(args, loader, workers, ranks, socket):
    peak, node, at_peak, done = 0, 0, {}, threading.Event()
    shmem_before = shmem_kib()
    # The cell's own pool directory (its pools are counted, then gone before the next cell).
    run_dir = tempfile.mkdtemp(prefix="fsb")
    env = dict(os.environ, XDG_RUNTIME_DIR=run_dir, FEEDSTORE_POOL_LINGER_SECONDS="1")

    def kind(pid, trainers, pool):
        if pid in pool:
            return "pool"
        if pid in trainers:
            return "trainers"
        try:
            with open(f"/proc/{pid}/comm") as f:
                return "daemon" if f.read().strip() == "feedstored" else "workers"
        except OSError:
            return "workers"

    def watch():
        nonlocal peak, node, at_peak
        trainers = {proc.pid for proc in procs}
        while not done.is_set():
            pool = set(pool_pids(run_dir))
            parts = {}
            for pid in (set(tree(os.getpid())) - {os.getpid()}) | pool:
                for name, kib in pss_parts(pid).items():
                    key = (kind(pid, trainers, pool), name)
                    parts[key] = parts.get(key, 0) + kib
            peak = max(peak, sum(kib for (_, name), kib in parts.items() if name == "Pss"))
            # The node's memory: private and file pages as PSS splits them, and shared memory
            # (the store's segments; torch's /dev/shm tensors) counted once, mapped or not.
            mine = sum(kib for (_, name), kib in parts.items() if name in PARTS[:2])
            if mine + shmem_kib() - shmem_before > node:
                node, at_peak = mine + shmem_kib() - shmem_before, parts
            time.sleep(0.05)

    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--trainer", "--loader", loader, "--workers", str(workers),
             "--ranks", str(ranks), "--rank", str(rank), "--socket", socket, "--data", args.data,
             "--steps", str(args.steps), "--step-ms", str(args.step_ms),
             *(["--persistent-workers"] if args.persistent_workers else [])],
            stdout=subprocess.PIPE,
            env=env,
        )
        for rank in range(ranks)
    ]
    watcher = threading.Thread(target=watch)
    watcher.start()
    results = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=1800)
            if proc.returncode != 0:
                raise SystemExit(f"a {loader} trainer failed ({proc.returncode})")
            results.append(json.loads(out.decode().strip().splitlines()[-1]))
            if os.environ.get("FEEDSTORE_BENCH_VERBOSE"):
                print(f"  rank {len(results) - 1}: {results[-1]}", flush=True)
    finally:
        done.set()
        watcher.join()
        deadline = time.monotonic() + 60
        while pool_pids(run_dir) and time.monotonic() < deadline:
            time.sleep(0.1)  # (pools leave a second after their last trainer)
        for pid in pool_pids(run_dir):
            os.kill(pid, signal.SIGTERM)  # (one that did not: not left to the next cell)
        shutil.rmtree(run_dir, ignore_errors=True)
    waited = sum(r["waited"] for r in results)
    elapsed = sum(r["elapsed"] for r in results)
    samples_per_s = sum(r["steps"] * BATCH / r["elapsed"] for r in results)
    first = max(r["first"] for r in results)
    if args.breakdown:
        for who in ("trainers", "workers", "pool", "daemon"):
            if (who, "Pss") in at_peak:
                split = ", ".join(f"{name[4:].lower()} {at_peak[(who, name)] / 1024:.0f}"
                                  for name in PARTS)
                print(f"      {who:<9} {at_peak[(who, 'Pss')] / 1024:>6.0f} MiB  ({split})")
    return waited / elapsed, samples_per_s, first, peak / 1024, node / 1024


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--step-ms", type=float, default=250)
    parser.add_argument("--data", default=str(pathlib.Path.home() / ".cache/feedstore/demo"))
    parser.add_argument("--workers", type=int, nargs="*", default=[2, 4])
    parser.add_argument("--ranks", type=int, nargs="*", default=[1, 2])
    parser.add_argument("--loaders", nargs="*", default=["torch", "feedstore", "feedstore-node"],
                        help="feedstore: pool='rank' (workers per rank, as torch); "
                        "feedstore-node: pool='node' (one pool shared by the ranks); "
                        "feedstore-cache: pool='node', sample_cache=True")
    parser.add_argument("--persistent-workers", action="store_true",
                        help="every loader keeps its workers from epoch to epoch")
    parser.add_argument("--breakdown", action="store_true",
                        help="after each cell, the PSS at the node's peak by kind of process "
                        "(trainers, their workers, the node's pool, the daemon), split "
                        "anon/file/shmem")
    # One trainer rank (run by the cells).
    parser.add_argument("--trainer", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--loader", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--socket", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trainer:
        args.workers, args.ranks = args.workers[0], args.ranks[0]
        return trainer(args)
    if not (pathlib.Path(args.data) / "data.jsonl").exists():
        raise SystemExit(f"no data set at {args.data}: run `feedstore demo` once")
    print(f"{args.steps} steps of {BATCH} per rank, step {args.step_ms:.0f} ms, "
          f"{SIDE}x{SIDE} float32 images + {TOKENS} tokens")
    print(f"{'workers':>7} {'ranks':>5} {'loader':<15} {'wait':>7} {'samples/s':>10} "
          f"{'first s':>8} {'peak PSS MiB':>13} {'peak node MiB':>14}")
    for workers in args.workers:
        for ranks in args.ranks:
            for loader in args.loaders:
                wait, rate, first, peak, node = cell(args, loader, workers, ranks)
                print(f"{workers:>7} {ranks:>5} {loader:<15} {wait:>7.1%} {rate:>10.1f} "
                      f"{first:>8.2f} {peak:>13.0f} {node:>14.0f}", flush=True)


if __name__ == "__main__":
    main()
