"""A stacked batch from a stream in Python, as a torch tensor: `Stream.next_batch(n, out=)`
(copies each image into a preallocated array, which `torch.from_numpy` shares) against
`Stream.next_stacked(n)` over batches a producer placed in one object (`Writer(batch=n)` +
`put_batch`: one read-only tensor over shared memory, `torch.from_dlpack`, no copy), side by side
in one run.

Each batch is `--batch` images of 3 x `--size` x `--size` float32 (default 32 of 448 x 448: the
issue's trial, 2.4 MB each, 73 MiB a batch). Before each round, two writers fill both streams'
windows with `--ahead` batches, so every timed call finds its batch ready: what is measured is
the hand-off alone. Rounds alternate nothing else (the writers are idle while the reader runs).

Usage (release binaries built; the feedstore package and torch importable):

    cargo build --release --bins -p feedstore && pip install ./python
    python benches/stacked.py [--rounds 4]
"""

import argparse
import statistics
import time

import numpy as np
import torch

import feedstore
from daemon import feedstored


def fill(writer, batch, ahead, image, batched):
    """Puts `ahead` batches' samples: one object per sample, or one per batch."""
    made = 0
    while made < ahead * batch:
        tasks = writer.take(max=batch, wait=5.0)
        assert tasks, "the stream's window is full before the round's batches were made"
        for i in range(0, len(tasks), batch):
            group = tasks[i : i + batch]
            items = [{"images": [image], "tokens": [t.record], "layout": "chw"} for t in group]
            if batched:
                writer.put_batch(group, items)
            else:
                for task, item in zip(group, items):
                    writer.put(task, item)
            made += len(group)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--size", type=int, default=448)
    p.add_argument("--ahead", type=int, default=6, help="batches made before each round")
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args()
    n, ahead = args.batch, args.ahead
    image = np.ones((3, args.size, args.size), np.float32)
    per_batch = n * image.nbytes
    records = n * ahead * args.rounds
    capacity = f"{(3 * ahead * per_batch >> 20) + 256}MiB"
    with feedstored(capacity) as socket:
        spec = dict(shuffle="none", socket=socket, depth=n * ahead)
        writers = {
            "copy": feedstore.Writer("bench-copy", records, **spec),
            "view": feedstore.Writer("bench-view", records, batch=n, **spec),
        }
        streams = {
            name: feedstore.Stream(f"bench-{name}", records, shuffle="none", socket=socket, wait=60)
            for name in writers
        }
        out = np.empty((n, *image.shape), np.float32)
        out.fill(0)  # touched once: page faults are not timed
        stacked = torch.from_numpy(out)  # the copies land in this tensor's memory
        times = {"copy": [], "view": []}
        for _ in range(args.rounds):
            for name, writer in writers.items():
                fill(writer, n, ahead, image, batched=name == "view")
            for _ in range(ahead):
                t = time.perf_counter()
                batch = streams["copy"].next_batch(n, out=out)
                times["copy"].append(time.perf_counter() - t)
                assert stacked.shape == (n, *image.shape)
                del batch
            for _ in range(ahead):
                t = time.perf_counter()
                batch, images = streams["view"].next_stacked(n)
                tensor = torch.from_dlpack(images)
                times["view"].append(time.perf_counter() - t)
                assert tensor.shape == stacked.shape
                del batch, images, tensor
            for stream in streams.values():
                stream.flush()  # the dropped batches go back: the windows have room again
        assert streams["view"].stacked_copies == 0, "every batch should have been one view"
    copy = statistics.median(times["copy"])
    print(
        f"## Python: a stacked batch of {n} images of 3x{args.size}x{args.size} f32 "
        f"({per_batch / 2**20:.1f} MiB) to a torch tensor, ready in the ring; "
        f"{len(times['copy'])} batches each"
    )
    print()
    print("| per batch | p50 | mean | max | vs next_batch(out=) (p50) |")
    print("|---|---|---|---|---|")
    for name, label in [
        ("copy", "`next_batch(n, out=)`: copies each image into the array (baseline)"),
        ("view", "`next_stacked(n)` + `torch.from_dlpack`: one view of a batch placed in one object"),
    ]:
        t = times[name]
        print(
            f"| {label} | {statistics.median(t) * 1e6:.1f} us | {statistics.mean(t) * 1e6:.1f} us"
            f" | {max(t) * 1e6:.1f} us | {copy / statistics.median(t):.0f}x |"
        )


if __name__ == "__main__":
    main()
