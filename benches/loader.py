"""Per-batch hand-off of `feedstore.torch.DataLoader` against `torch.utils.data.DataLoader`,
side by side in one run, the same dataset, workers and step.

Each batch is `--batch` samples of `--sample-mib` MiB of float32 (default 8 x 8 MiB = a 64 MiB
batch), stacked by `default_collate` in the workers. The trainer's step (`--step` seconds of
sleep) is longer than a worker needs for a batch, so when the trainer asks, the batch is ready:
what `next(loader)` costs is the hand-off alone (torch: unpickling the batch's storage, receiving
its file descriptor, mapping it; feedstore: a handle through a pipe, a lease, views of the
object). The second figure adds the trainer's first read of every page of the batch (one float
per 4 KiB page), which a fresh mapping pays in page faults.

Usage (release binaries built; the feedstore package importable; torch installed):

    cargo build --release --bins -p feedstore && pip install ./python
    python benches/loader.py [--batches 30]
"""

import argparse
import statistics
import time

import torch
import torch.utils.data

from daemon import feedstored


class Samples(torch.utils.data.Dataset):
    """Samples of one size, made once per worker (only the hand-off is measured)."""

    def __init__(self, n, floats):
        self.n, self.floats = n, floats
        self.sample = None

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.sample is None:
            self.sample = torch.ones(self.floats)
        return self.sample


def compute(step, busy):
    """The trainer's step: asleep (a GPU step the CPU waits out) or busy (a CPU kept hot, as
    a trainer launching kernels is, in a C call that releases the GIL)."""
    if not busy:
        time.sleep(step)
        return
    end = time.perf_counter() + step
    a = torch.ones(256, 256)
    while time.perf_counter() < end:
        a @ a


def run(loader, batches, step, busy):
    """Median and p90 of `next(loader)`, and of `next` plus a read of every page, in ms."""
    nexts, touched = [], []
    iterator = iter(loader)
    next(iterator)  # workers started, first batch made
    for _ in range(batches):
        compute(step, busy)
        start = time.perf_counter()
        batch = next(iterator)
        got = time.perf_counter()
        float(batch.view(-1)[::1024].sum())  # one float per 4 KiB page
        done = time.perf_counter()
        nexts.append((got - start) * 1e3)
        touched.append((done - start) * 1e3)
        del batch
    del iterator

    def figures(times):
        times.sort()
        return statistics.median(times), times[int(len(times) * 0.9)]

    return figures(nexts), figures(touched)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=30)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--sample-mib", type=int, default=8)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--step", type=float, default=0.3)
    parser.add_argument("--busy", action="store_true", help="a busy step instead of a sleep")
    args = parser.parse_args()

    from feedstore.torch import DataLoader

    floats = args.sample_mib * (1 << 20) // 4
    dataset = Samples((args.batches + 2) * args.batch, floats)
    options = dict(batch_size=args.batch, num_workers=args.workers)
    with feedstored("2GiB") as socket:
        rows = []
        for name, loader in (
            ("torch.utils.data.DataLoader", torch.utils.data.DataLoader(dataset, **options)),
            ("feedstore.torch.DataLoader", DataLoader(dataset, socket=socket, **options)),
        ):
            rows.append((name, *run(loader, args.batches, args.step, args.busy)))

    mib = args.batch * args.sample_mib
    print(f"hand-off of a {mib} MiB batch ({args.batch} x {args.sample_mib} MiB float32), "
          f"{args.workers} workers, {args.batches} batches, "
          f"step {args.step} s {'busy' if args.busy else 'asleep'}")
    print(f"{'loader':<30} {'next() ms':>12} {'p90':>8} {'+ read ms':>12} {'p90':>8}")
    ours = rows[-1]
    for name, (median, p90), (touch, touch90) in rows:
        print(f"{name:<30} {median:>12.3f} {p90:>8.3f} {touch:>12.3f} {touch90:>8.3f}")
    (torch_next, _), (torch_touch, _) = rows[0][1], rows[0][2]
    print(f"torch / feedstore: next() {torch_next / ours[1][0]:.0f}x, "
          f"next() + read {torch_touch / ours[2][0]:.1f}x")


if __name__ == "__main__":
    main()
