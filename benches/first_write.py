"""What writing to a batch costs now that batches are copy-on-write views (issue 34, part 2):
the private view itself (one `mmap(MAP_PRIVATE)` per batch), the first write to each page (a
fault that copies the page), and an in-place op over a whole batch, against the same op on a
tensor of the process's own memory (what torch's DataLoader hands over) and against copying the
batch first (`clone()`, what a loader that copies to be safe pays), in one run.

The batch is a `feedstore.torch.DataLoader` batch as the store holds it: one tensor of 32 images
of 3x448x448 float32 (73.5 MiB), written once with `_batch.write`, read with `_batch.read`
(whose tensors lie in one private view). Each round reads the batch afresh, so every first
write meets pages not yet copied.

Usage (release binaries built; the feedstore package and torch importable):

    cargo build --release --bins -p feedstore && pip install ./python
    python benches/first_write.py [--rounds 8] [--threads 1]
"""

import argparse
import statistics
import time

import torch

import feedstore
from daemon import feedstored
from feedstore import _batch

PAGE = 4096


def timed(f):
    t = time.perf_counter()
    out = f()
    return time.perf_counter() - t, out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--threads", type=int, default=1, help="torch's intra-op threads")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    shape = (32, 3, 448, 448)
    source = torch.rand(shape)
    nbytes = source.numel() * 4
    pages = nbytes // PAGE
    per_page = PAGE // 4  # float32 elements per page
    rows = {k: [] for k in ("view", "first", "again", "div_store", "div_own", "clone", "fault_own",
                            "read_store", "read_own")}
    with feedstored("1GiB") as socket:
        client = feedstore.Client(socket, writer=True)
        handle = _batch.write(client, {"pixel_values": source})
        for _ in range(args.rounds):
            stored = client.get(handle)
            # The private view: one mapping for the batch.
            t, private = timed(stored.private)
            rows["view"].append(t)
            x = _batch.read(private)["pixel_values"]
            assert x.data_ptr() != 0 and torch.equal(x[0, 0, 0, :4], source[0, 0, 0, :4])
            flat = x.view(-1)
            # The first write to each page: one element per page, every page faulted and copied.
            t, _ = timed(lambda: flat[::per_page].add_(1.0))
            rows["first"].append(t / pages)
            # The same writes again: the pages are this process's now.
            t, _ = timed(lambda: flat[::per_page].add_(1.0))
            rows["again"].append(t / pages)
            del x, flat, private, stored
            # A whole-batch in-place op on a fresh read (`x.div_(255)`), against the same op on
            # memory of the process's own, against copying the batch first.
            x = _batch.read(client.get(handle))["pixel_values"]
            t, _ = timed(lambda: x.div_(255.0))
            rows["div_store"].append(t)
            own = torch.empty(shape)
            t, _ = timed(lambda: own.fill_(0.0))  # a fresh allocation's first touch
            rows["fault_own"].append(t)
            own.copy_(source)
            t, _ = timed(lambda: own.div_(255.0))
            rows["div_own"].append(t)
            y = _batch.read(client.get(handle))["pixel_values"]
            t, _ = timed(y.clone)
            rows["clone"].append(t)
            # A read of the whole batch (what a copy to the GPU does): the first through a
            # fresh private view builds its page tables; the same read of own memory.
            z = _batch.read(client.get(handle))["pixel_values"]
            t, _ = timed(z.sum)
            rows["read_store"].append(t)
            t, _ = timed(own.sum)
            rows["read_own"].append(t)
            del x, y, z, own
            client.flush()
        client.delete(handle)
    med = {k: statistics.median(v) for k, v in rows.items()}
    print(f"## Writing to a batch of 32 x 3x448x448 f32 ({nbytes / 2**20:.1f} MiB, {pages} pages), "
          f"{args.rounds} rounds, medians, torch threads {args.threads}")
    print()
    print("| what | time | per 4 KiB page |")
    print("|---|---|---|")
    print(f"| the private view (`Sample.private()`, one mmap) | {med['view'] * 1e6:.1f} us | |")
    print(f"| first write to each page of the view (fault + page copy) | "
          f"{med['first'] * pages * 1e3:.1f} ms | {med['first'] * 1e6:.2f} us |")
    print(f"| the same writes again (pages already private) | "
          f"{med['again'] * pages * 1e3:.2f} ms | {med['again'] * 1e6:.3f} us |")
    print(f"| first touch of a fresh `torch.empty` of the size (zero-fill faults) | "
          f"{med['fault_own'] * 1e3:.1f} ms | {med['fault_own'] / pages * 1e6:.2f} us |")
    print(f"| `x.div_(255)` on a batch from the store (every page copied on write) | "
          f"{med['div_store'] * 1e3:.1f} ms | |")
    print(f"| `x.div_(255)` on a tensor of the process's own memory (torch's batch) | "
          f"{med['div_own'] * 1e3:.1f} ms | |")
    print(f"| `x.clone()` of a batch from the store (a loader that copies to be safe) | "
          f"{med['clone'] * 1e3:.1f} ms | |")
    print(f"| `x.sum()`, the first read of a batch from the store (page tables built) | "
          f"{med['read_store'] * 1e3:.1f} ms | {med['read_store'] / pages * 1e6:.2f} us |")
    print(f"| `x.sum()` of a tensor of the process's own memory | "
          f"{med['read_own'] * 1e3:.1f} ms | {med['read_own'] / pages * 1e6:.2f} us |")


if __name__ == "__main__":
    main()
