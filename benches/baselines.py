"""The loaders users would otherwise pick, side by side with feedstore, in one run: the same data,
the same S3 server and latency, the same step time and CPUs.

- feedstore: `feedstore demo --s3-endpoint ... --no-ladder --ranks 1` (its producers in Rust,
  the trainer reading its stream);
- a PyTorch DataLoader whose worker processes do what its users write: boto3 GET, PIL decode,
  Qwen-VL smart resize, CLIP normalisation to bf16 CHW, the Hugging Face tokenizer on the chat
  template with image pads, labels masked to the answer (num_workers 2 and 8);
- the seed's own design rebuilt with Ray: an async fetch actor (32 GETs in flight) putting bytes
  in Ray's object store, CPU actors preprocessing by reference, and a background prefetch queue
  of object refs ahead of the trainer, which `ray.get`s its batch.

Each trainer step waits for a batch, then sleeps the step time (the accelerator's compute). The
step time is the one `feedstore demo` chooses (a serial loader waits ~85%), unless given.
Memory is the peak proportional set size (PSS: shared pages divided among the processes that
map them) of each loader's whole process tree, sampled every 0.2 s.

Usage (release binaries built; ray, boto3, tokenizers, torch, Pillow, psutil installed;
moto_server on PATH):

    cargo build --release --bin feedstore
    python benches/baselines.py [--records 256] [--batch 16] [--steps 12] [--latency-ms 30-80]
"""

import argparse
import gzip
import io
import json
import math
import os
import pathlib
import queue
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
PATCH, MERGE = 14, 2
MIN_PIXELS, MAX_PIXELS = 3136, 640 * 640


# ---- the sample: the same work the producer does -------------------------------------------


def smart_resize(height, width, factor=PATCH * MERGE):
    """Qwen-VL's resize target: sides multiples of `factor`, area within [MIN, MAX]."""
    h = max(factor, round(height / factor) * factor)
    w = max(factor, round(width / factor) * factor)
    if h * w > MAX_PIXELS:
        beta = math.sqrt(height * width / MAX_PIXELS)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < MIN_PIXELS:
        beta = math.sqrt(MIN_PIXELS / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


class Maker:
    """Fetches and preprocesses records; one per worker process or actor."""

    def __init__(self, endpoint, latency, tokenizer_path):
        import boto3
        from tokenizers import Tokenizer

        self.s3 = boto3.client(
            "s3", endpoint_url=endpoint, region_name="us-east-1",
            aws_access_key_id="test", aws_secret_access_key="test",
        )
        self.latency = latency
        self.tokenizer = Tokenizer.from_file(tokenizer_path)
        self.rng = random.Random(os.getpid())

    def fetch(self, key):
        time.sleep(self.rng.uniform(*self.latency))  # the same per-request latency as feedstore's
        bucket, _, path = key[len("s3://"):].partition("/")
        return self.s3.get_object(Bucket=bucket, Key=path)["Body"].read()

    def make(self, record, data):
        import numpy as np
        import torch
        from PIL import Image

        image = Image.open(io.BytesIO(data)).convert("RGB")
        h, w = smart_resize(image.height, image.width)
        image = image.resize((w, h), Image.BICUBIC)
        pixels = (np.asarray(image, dtype=np.float32) / 255.0 - CLIP_MEAN) / CLIP_STD
        pixels = torch.from_numpy(pixels.transpose(2, 0, 1).copy()).to(torch.bfloat16)
        pads = (h // PATCH // MERGE) * (w // PATCH // MERGE)
        turns = record["conversations"]
        question = turns[0]["value"].replace(
            "<image>", "<|vision_start|>" + "<|image_pad|>" * pads + "<|vision_end|>"
        )
        prompt = f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
        answer = f"{turns[1]['value']}<|im_end|>\n"
        prompt_ids = self.tokenizer.encode(prompt, add_special_tokens=False).ids
        answer_ids = self.tokenizer.encode(answer, add_special_tokens=False).ids
        ids = torch.tensor(prompt_ids + answer_ids, dtype=torch.int64)
        labels = ids.clone()
        labels[: len(prompt_ids)] = -100
        return {"pixel_values": pixels, "input_ids": ids, "labels": labels, "id": record["id"]}


# ---- measuring ------------------------------------------------------------------------------


class PeakMemory:
    """Samples the PSS of a process tree (this process and its descendants) in the background."""

    def __init__(self, root_pid=None):
        import psutil

        self.root = psutil.Process(root_pid or os.getpid())
        self.peak = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _pss(self):
        total = 0
        for p in [self.root] + self.root.children(recursive=True):
            try:
                total += p.memory_full_info().pss
            except Exception:  # gone, or not ours to read
                pass
        return total

    def _run(self):
        while not self.stop.is_set():
            self.peak = max(self.peak, self._pss())
            time.sleep(0.2)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def train(next_batch, steps, step_time):
    """The trainer loop: per step, (seconds waiting for the batch, seconds computing)."""
    log = []
    started = time.perf_counter()
    first = None
    for _ in range(steps):
        t = time.perf_counter()
        batch = next_batch()
        wait = time.perf_counter() - t
        if first is None:
            first = time.perf_counter() - started
        time.sleep(step_time)
        log.append((wait, step_time))
        del batch
    return log, first


def summary(name, log, first, batch, peak):
    steady = log[1:] if len(log) > 1 else log
    wait = sum(w for w, _ in steady)
    compute = sum(c for _, c in steady)
    return {
        "name": name,
        "wait_ratio": wait / (wait + compute),
        "samples_per_sec": len(steady) * batch / (wait + compute),
        "first_batch_s": first,
        "peak_pss_bytes": peak,
    }


# ---- the loaders ----------------------------------------------------------------------------


class Records:
    def __init__(self, manifest):
        self.records = [json.loads(line) for line in open(manifest)]

    def __getitem__(self, i):
        return self.records[i % len(self.records)]


def run_dataloader(args, records, endpoint, tokenizer, step_time, workers):
    import torch.utils.data

    class Samples(torch.utils.data.Dataset):
        def __len__(self):
            return args.steps * args.batch

        def __getitem__(self, i):
            if not hasattr(self, "maker"):
                self.maker = Maker(endpoint, args.latency, tokenizer)
            record = records[i]
            return self.maker.make(record, self.maker.fetch(record["image"]))

    prefetch = max(1, args.prefetch // args.batch // workers) if workers else None
    loader = torch.utils.data.DataLoader(
        Samples(), batch_size=args.batch, num_workers=workers, prefetch_factor=prefetch,
        collate_fn=lambda items: items,
    )
    with PeakMemory() as memory:
        it = iter(loader)
        log, first = train(lambda: next(it), args.steps, step_time)
        del it
    return summary(f"PyTorch DataLoader, {workers} worker processes", log, first, args.batch,
                   memory.peak)


def run_ray(args, records, endpoint, tokenizer, step_time):
    import ray

    ray.init(address="local", num_cpus=args.workers, include_dashboard=False,
             log_to_driver=False, object_store_memory=512 << 20)
    try:
        @ray.remote
        class Fetcher:
            """Async GETs, many in flight; bytes go to the object store."""

            def __init__(self):
                self.maker = Maker(endpoint, args.latency, tokenizer)

            async def fetch(self, key):
                import asyncio

                return await asyncio.to_thread(self.maker.fetch, key)

        @ray.remote(num_cpus=1)
        class Preprocessor:
            def __init__(self):
                self.maker = Maker(endpoint, args.latency, tokenizer)

            def make(self, record, data):
                return self.maker.make(record, data)

        fetcher = Fetcher.options(max_concurrency=32).remote()
        cpus = [Preprocessor.remote() for _ in range(args.workers)]
        refs = queue.Queue(maxsize=max(args.prefetch, args.batch))

        def prefetcher():
            for i in range(args.steps * args.batch):
                record = records[i]
                data = fetcher.fetch.remote(record["image"])
                refs.put(cpus[i % len(cpus)].make.remote(record, data))

        with PeakMemory() as memory:
            threading.Thread(target=prefetcher, daemon=True).start()
            log, first = train(
                lambda: ray.get([refs.get() for _ in range(args.batch)]), args.steps, step_time
            )
        return summary("Ray: async fetch actor, CPU actors, prefetch queue of refs", log, first,
                       args.batch, memory.peak)
    finally:
        ray.shutdown()


def run_feedstore(args, endpoint, data_dir, step_time):
    report = pathlib.Path(tempfile.mkdtemp()) / "report.json"
    command = [
        str(REPO / "target" / "release" / "feedstore"), "demo", "--no-ladder", "--ranks", "1",
        "--records", str(args.records), "--batch", str(args.batch), "--steps", str(args.steps),
        "--latency-ms", args.latency_ms, "--workers", str(args.workers),
        "--prefetch", str(args.prefetch), "--capacity", "256MiB",
        "--s3-endpoint", endpoint, "--data-dir", str(data_dir), "--report", str(report),
        "--plot", str(report.with_suffix(".png")),
    ]
    if step_time is not None:
        command += ["--step-time", str(step_time)]
    env = dict(os.environ, AWS_ACCESS_KEY_ID="test", AWS_SECRET_ACCESS_KEY="test",
               AWS_REGION="us-east-1", AWS_EC2_METADATA_DISABLED="true")
    with PeakMemory() as memory:
        subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL)
    result = json.loads(report.read_text())
    run = result["feedstore"]["run"]
    return result, {
        "name": "feedstore (producers in Rust, trainer reads its stream)",
        "wait_ratio": run["wait_ratio"],
        "samples_per_sec": run["samples_per_sec"],
        "first_batch_s": max(run["first_batch_s"]),
        "peak_pss_bytes": memory.peak,
    }


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--latency-ms", default="30-80")
    parser.add_argument("--workers", type=int, default=os.cpu_count())
    parser.add_argument("--prefetch", type=int, default=32)
    parser.add_argument("--step-time", type=float, default=None)
    parser.add_argument("--data-dir", default=None,
                        help="the demo's data set cache [default: a fresh temporary folder]")
    args = parser.parse_args()
    low, high = (float(x) / 1e3 for x in args.latency_ms.split("-"))
    args.latency = (low, high)

    port = free_port()
    moto = subprocess.Popen(["moto_server", "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        data_dir = pathlib.Path(args.data_dir or tempfile.mkdtemp())
        print("feedstore (this also builds the data set and uploads it to S3 once) ...",
              file=sys.stderr)
        report, feedstore = run_feedstore(args, endpoint, data_dir, args.step_time)
        step_time = report["settings"]["step_time_s"]
        manifest = next(data_dir.glob("data-s3-*.jsonl"))
        records = Records(manifest)
        tokenizer = pathlib.Path(tempfile.mkdtemp()) / "tokenizer.json"
        tokenizer.write_bytes(gzip.decompress(
            (REPO / "producer/tests/data/qwen3-tokenizer.json.gz").read_bytes()))
        rows = [feedstore]
        for workers in (2, 8):
            print(f"PyTorch DataLoader with {workers} workers ...", file=sys.stderr)
            rows.append(run_dataloader(args, records, endpoint, str(tokenizer), step_time,
                                       workers))
        print("Ray ...", file=sys.stderr)
        rows.append(run_ray(args, records, endpoint, str(tokenizer), step_time))
    finally:
        moto.terminate()
        moto.wait()

    print(f"same data ({args.records} records in S3 via moto, {args.latency_ms} ms per GET), "
          f"batch {args.batch}, {args.steps} steps, step time {step_time:.3f} s, "
          f"{args.workers} CPU workers/actors on {os.cpu_count()} cores")
    print(f"{'loader':<62}{'wait':>8}{'samples/s':>11}{'first batch':>13}{'peak PSS':>11}")
    for r in rows:
        print(f"{r['name']:<62}{100 * r['wait_ratio']:>7.1f}%{r['samples_per_sec']:>11.1f}"
              f"{r['first_batch_s']:>12.2f}s{r['peak_pss_bytes'] / 2**20:>8.0f} MiB")
    best = min(r["wait_ratio"] for r in rows[1:])
    print(f"feedstore waits {100 * feedstore['wait_ratio']:.1f}% of the time, the best baseline "
          f"{100 * best:.1f}%: {feedstore['wait_ratio'] / best:.3f}x (goal: at most 0.5x)")


if __name__ == "__main__":
    main()
