"""Python per-sample cost of getting a 4 MiB image as an array, side by side in one run:

- feedstore: `Client.get(handle).images[0]` (a read-only numpy view of shared memory; the lease
  is returned when the array goes), through the real daemon;
- Ray: `ray.get(ref)` of the same array from Ray's object store (also zero-copy for numpy);
- a torch DataLoader with 2 worker processes handing the same tensor to the trainer process.

Usage (release binaries built; the feedstore package importable; `ray` and `torch` installed):

    cargo build --release --bins -p feedstore && pip install ./python ray
    python benches/python_get.py [--gets 2000]

Prints one table of per-sample times and each baseline's ratio to feedstore.
"""

import argparse
import statistics
import time

import numpy as np

from daemon import feedstored
SIDE = 2048  # 2048 x 2048 uint8 = 4 MiB


def per_call(fn, n):
    """Median and p99 of `n` timed calls, in microseconds."""
    times = []
    for i in range(n):
        start = time.perf_counter_ns()
        fn(i)
        times.append((time.perf_counter_ns() - start) / 1000)
    times.sort()
    return statistics.median(times), times[int(len(times) * 0.99)]


def bench_feedstore(images, gets):
    import feedstore

    with feedstored("1GiB") as socket:
        writer = feedstore.Client(socket, writer=True)
        start = time.perf_counter()
        handles = [writer.put(image) for image in images]
        put_us = (time.perf_counter() - start) / len(images) * 1e6
        reader = feedstore.Client(socket)

        def get(i):
            array = reader.get(handles[i % len(handles)]).images[0]
            assert array.shape == (SIDE, SIDE)

        per_call(get, 50)  # warm up
        median, p99 = per_call(get, gets)

        # The trainer's path: the next sample of a stream, from its shared-memory ring. The
        # window (64) is filled first, so only the hand-off is timed, not the writer.
        stream_writer = feedstore.Writer("bench", gets, shuffle="none", socket=socket)
        stream = feedstore.Stream("bench", gets, shuffle="none", socket=socket)
        times = []
        while len(times) < gets:
            tasks = stream_writer.take(max=64, wait=5.0) or []
            for task in tasks:
                stream_writer.put(task, images[task.record % len(images)])
            for _ in tasks:
                start = time.perf_counter_ns()
                array = next(stream).images[0]
                times.append((time.perf_counter_ns() - start) / 1000)
                assert array.shape == (SIDE, SIDE)
                del array
        times.sort()
        stream_median, stream_p99 = statistics.median(times), times[int(len(times) * 0.99)]
        return median, p99, put_us, stream_median, stream_p99


def bench_ray(images, gets):
    import ray

    ray.init(address="local", num_cpus=2, object_store_memory=1 << 30, include_dashboard=False,
             log_to_driver=False)
    try:
        start = time.perf_counter()
        refs = [ray.put(image) for image in images]
        put_us = (time.perf_counter() - start) / len(images) * 1e6

        def get(i):
            array = ray.get(refs[i % len(refs)])
            assert array.shape == (SIDE, SIDE)

        per_call(get, 50)
        median, p99 = per_call(get, gets)
        return median, p99, put_us
    finally:
        ray.shutdown()


class Images:
    """A map-style dataset of 4 MiB uint8 tensors (made in the worker; only the hand-off to the
    trainer process is measured)."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        import torch

        return torch.full((SIDE, SIDE), i % 251, dtype=torch.uint8)


def bench_dataloader(samples):
    import torch.utils.data

    loader = torch.utils.data.DataLoader(Images(samples), batch_size=None, num_workers=2)
    it = iter(loader)
    for _ in range(20):  # workers started and warm
        next(it)
    start = time.perf_counter()
    count = 0
    for tensor in it:
        assert tensor.shape == (SIDE, SIDE)
        count += 1
    return (time.perf_counter() - start) / count * 1e6


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gets", type=int, default=2000, help="timed gets per store")
    parser.add_argument("--objects", type=int, default=32, help="distinct 4 MiB arrays")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 255, (SIDE, SIDE), dtype=np.uint8) for _ in range(args.objects)]

    fs_median, fs_p99, fs_put, st_median, st_p99 = bench_feedstore(images, args.gets)
    ray_median, ray_p99, ray_put = bench_ray(images, args.gets)
    dl = bench_dataloader(max(200, args.gets // 10))
    print(f"per-sample cost of a 4 MiB image in Python ({args.gets} gets, same run)")
    print(f"{'path':<44}{'median µs':>11}{'p99 µs':>10}{'vs stream':>11}{'vs get':>9}")
    rows = [
        ("feedstore next(stream).images[0]", st_median, st_p99),
        ("feedstore Client.get(h).images[0]", fs_median, fs_p99),
        ("Ray ray.get(ref)", ray_median, ray_p99),
        ("torch DataLoader, 2 workers (mean)", dl, None),
    ]
    for name, median, p99 in rows:
        p99_text = f"{p99:>10.1f}" if p99 is not None else f"{'':>10}"
        print(f"{name:<44}{median:>11.1f}{p99_text}{median / st_median:>10.0f}x"
              f"{median / fs_median:>8.1f}x")
    print(f"put of a 4 MiB array: feedstore {fs_put:.0f} µs, Ray {ray_put:.0f} µs "
          f"({ray_put / fs_put:.1f}x)")


if __name__ == "__main__":
    main()
