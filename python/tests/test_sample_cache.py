"""feedstore.torch.DataLoader(sample_cache=True): the decode-once cache. A sample is made once
on the node, whichever epoch, loader or job asks for it again; a sample whose making draws
from a random state is never shared, and the batches stay torch's; a store too small for the
whole data set evicts filed samples, never a batch; a user's collate_fn gets samples it may
change.

Every sample here is made by a real worker process (forked per rank, or a node pool's),
filed in a real feedstored and mapped from it by other real processes; each making is
counted by the dataset itself, in a file the processes append to."""

import os
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the torch adapter needs torch (python3-torch)")
import torch.utils.data as tud  # noqa: E402

import feedstore  # noqa: E402
from feedstore.torch import DataLoader  # noqa: E402
from test_loader import assert_same_batches, same, seeded, store_empty  # noqa: E402
from test_pool import pools  # noqa: E402,F401 (a fixture)


class Logged(tud.Dataset):
    """A decoded-image stand-in that appends each index it makes to a file (one line per
    making, from any process). `random_every`: every such sample also draws from the global
    random states (a random augmentation); `mib`: the image's size."""

    def __init__(self, log=None, n=24, random_every=0, mib=0.0):
        self.log, self.n, self.random_every, self.mib = log, n, random_every, mib

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.log is not None:
            fd = os.open(self.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
            os.write(fd, f"{i}\n".encode())
            os.close(fd)
        side = max(8, int((self.mib * 2**20 / 12) ** 0.5))
        image = torch.arange(3 * side * side, dtype=torch.float32).reshape(3, side, side) + i
        if self.random_every and i % self.random_every == 0:
            image = image + torch.rand(()) + float(np.random.rand())
        return {"image": image, "ids": np.arange(i, i + 4, dtype=np.int64), "name": f"s{i}"}


def made(log):
    """How many times each index was made."""
    counts = {}
    if log.exists():
        for line in log.read_text().split():
            counts[int(line)] = counts.get(int(line), 0) + 1
    return counts


def assert_torchs_epochs(loader, theirs, seed=5):
    """`loader`'s epochs equal `theirs` (torch's, from the same seeds); no batch is kept."""
    seeded(seed)
    for epoch in theirs:
        got = 0
        for i, batch in enumerate(loader):
            assert same(batch, epoch[i]), f"batch {i} differs"
            got += 1
        assert got == len(epoch)


def torchs(dataset, n=2, seed=5, **kwargs):
    seeded(seed)
    loader = tud.DataLoader(dataset, generator=torch.Generator().manual_seed(7), **kwargs)
    return [list(loader) for _ in range(n)]


def ours(dataset, daemon, seed=7, **kwargs):
    return DataLoader(
        dataset, socket=daemon.socket, sample_cache=True,
        generator=torch.Generator().manual_seed(seed), **kwargs,
    )


@pytest.mark.parametrize("pool", ["rank", "node"])
def test_each_sample_is_made_once_across_epochs_and_jobs(daemon, pools, tmp_path, pool):
    log = tmp_path / "made"
    kwargs = dict(batch_size=4, shuffle=True, num_workers=2)
    theirs = torchs(Logged(), **kwargs)
    loader = ours(Logged(log), daemon, pool=pool, **kwargs)
    assert_torchs_epochs(loader, theirs)
    assert made(log) == {i: 1 for i in range(24)}, "each sample made once in two epochs"
    c = loader.feedstore_counters
    assert (c.cache_filed, c.cache_hits, c.cache_random, c.cache_unfiled) == (24, 24, 0, 0)
    # Another job of a sweep over the same data: another seed, a loader of its own.
    other = ours(Logged(log), daemon, seed=11, pool=pool, **kwargs)
    theirs = tud.DataLoader(Logged(), generator=torch.Generator().manual_seed(11), **kwargs)
    assert_same_batches(list(other), list(theirs))
    assert made(log) == {i: 1 for i in range(24)}, "the other job made nothing"
    assert other.feedstore_counters.cache_hits == 24
    only_filed_samples(daemon, 24)


def only_filed_samples(daemon, n):
    """Waits until the store holds the `n` filed samples alone (the batches deleted)."""
    stats = daemon.wait_for(
        f"the batches deleted, {n} samples left",
        lambda s: s["objects_sealed"] == n and s["objects_delete_pending"] == 0,
    )
    assert (stats["cache_entries"], stats["objects_pinned"], stats["leases"]) == (n, 0, 0)
    return stats


def test_cached_arrays_are_stacked_from_their_memory_without_a_warning(daemon):
    # What a worker's collate gets from the cache: private (copy-on-write) views of a filed
    # sample's object, writable as torch's own samples are, and still not copied.
    from feedstore import _batch

    client = feedstore.Client(daemon.socket, writer=True)
    handles = [_batch.write(client, {"ids": np.arange(i, i + 4)}) for i in range(3)]
    samples = [_batch.read(client.get(h)) for h in handles]
    assert samples[0]["ids"].flags.writeable, "a private view: writable like torch's samples"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (torch warns on each read-only array it is given)
        batch = _batch.default_collate(samples)
    stacked = batch["ids"]
    assert type(stacked) is _batch.Stacked, "stacking deferred to the batch's write"
    for part, sample in zip(stacked.parts, samples):
        assert part.data_ptr() == sample["ids"].__array_interface__["data"][0], "not copied"
    expected = tud.default_collate([{"ids": np.arange(i, i + 4)} for i in range(3)])
    assert torch.equal(torch.stack(stacked.parts), expected["ids"])
    del batch, stacked, samples
    for h in handles:
        client.delete(h)


def test_samples_drawing_random_numbers_are_never_shared_and_batches_stay_torchs(
    daemon, tmp_path
):
    log = tmp_path / "made"
    kwargs = dict(batch_size=3, shuffle=True, num_workers=2)
    theirs = torchs(Logged(random_every=3), n=3, **kwargs)
    loader = ours(Logged(log, random_every=3), daemon, **kwargs)
    assert_torchs_epochs(loader, theirs)
    counts = made(log)
    assert {i for i, k in counts.items() if k == 3} == set(range(0, 24, 3)), counts
    assert {i for i, k in counts.items() if k == 1} == set(range(24)) - set(range(0, 24, 3))
    c = loader.feedstore_counters
    assert (c.cache_filed, c.cache_random, c.cache_hits) == (16, 24, 32)
    only_filed_samples(daemon, 16)


def test_a_store_smaller_than_the_data_set_evicts_filed_samples_never_a_batch(daemon, tmp_path):
    log = tmp_path / "made"
    # 48 samples of 8 MiB (384 MiB) through a 256 MiB store.
    kwargs = dict(batch_size=2, shuffle=True, num_workers=2)
    loader = ours(Logged(log, n=48, mib=8), daemon, **kwargs)
    theirs = torchs(Logged(n=48, mib=8), **kwargs)
    assert_torchs_epochs(loader, theirs)
    c = loader.feedstore_counters
    assert c.cache_hits < 48 and c.cache_filed + c.cache_unfiled == 96 - c.cache_hits, c
    assert sum(made(log).values()) == 96 - c.cache_hits
    stats = daemon.wait_for(
        "the batches deleted", lambda s: s["objects_pinned"] + s["objects_delete_pending"] == 0
    )
    assert stats["evictions"] > 0 and stats["leases"] == 0, stats


def scaled_in_place(batch):
    """A collate_fn that changes its samples in place (as padding code does)."""
    for sample in batch:
        sample["image"] *= 2
        sample["ids"] += 1
    return tud.default_collate(batch)


def test_a_users_collate_fn_may_change_the_samples_it_is_given(daemon, tmp_path):
    log = tmp_path / "made"
    kwargs = dict(batch_size=4, shuffle=True, num_workers=2, collate_fn=scaled_in_place)
    loader = ours(Logged(log), daemon, **kwargs)
    assert_torchs_epochs(loader, torchs(Logged(), n=3, **kwargs))
    assert made(log) == {i: 1 for i in range(24)}, "filed as made, before the collate"
    assert loader.feedstore_counters.cache_hits == 48


def test_sample_cache_asks_for_workers_and_a_map_style_dataset(daemon):
    with pytest.raises(ValueError, match="num_workers > 0"):
        DataLoader(Logged(), socket=daemon.socket, sample_cache=True)


def test_filed_samples_outlive_the_loader_and_give_way_to_a_put(daemon, tmp_path):
    log = tmp_path / "made"
    loader = ours(Logged(log), daemon, batch_size=4, num_workers=2)
    list(loader)
    del loader
    stats = only_filed_samples(daemon, 24)
    # Evictable: a reservation of the whole store takes their room at once, without waiting.
    client = feedstore.Client(daemon.socket, writer=True)
    client.reserve(stats["capacity_bytes"], timeout=0).abort()
    store_empty(daemon)
    # Evicted samples are made again (and filed again).
    again = ours(Logged(log), daemon, batch_size=4, num_workers=2)
    list(again)
    assert made(log) == {i: 2 for i in range(24)}
    assert (again.feedstore_counters.cache_hits, again.feedstore_counters.cache_filed) == (0, 24)


def test_a_cache_that_files_nothing_says_so_once(daemon):
    # Every sample moves the global random state (a random augmentation): none can be filed.
    loader = ours(Logged(random_every=1), daemon, batch_size=4, num_workers=2)
    with pytest.warns(UserWarning, match="sample_cache=True filed none of the") as record:
        for _ in range(2):
            assert sum(1 for _ in loader) == 6
    assert sum("filed none" in str(w.message) for w in record) == 1, "once per loader"
    c = loader.feedstore_counters
    assert (c.cache_filed, c.cache_hits, c.cache_random) == (0, 0, 48)
