"""feedstore.torch.DataLoader against torch's own DataLoader: the same batches (map-style and
iterable datasets, 0/2/4 workers, random transforms, DistributedSampler), every type through
shared memory, exact resume, a worker killed with SIGKILL, exceptions, Ctrl-C.

Every loader here has real worker processes writing into a real feedstored."""

import collections
import gc
import os
import pathlib
import random
import signal
import subprocess
import sys
import textwrap
import time
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the torch adapter needs torch (python3-torch)")
import torch.utils.data as tud  # noqa: E402

import feedstore  # noqa: E402
from feedstore.torch import DataLoader  # noqa: E402

Pair = collections.namedtuple("Pair", "left right")


class Augmented(tud.Dataset):
    """A map-style dataset whose samples draw from Python's, numpy's and torch's random state
    (a random augmentation), so equal batches mean equal seeds in each worker."""

    def __init__(self, n=37):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        jitter = torch.rand(()) + random.random() + float(np.random.rand())
        return {
            "image": torch.full((3, 8, 8), float(i)) + jitter,
            "label": i,
            "name": f"sample-{i}",
            "ids": np.arange(i, i + 4, dtype=np.int32),
        }


class Shards(tud.IterableDataset):
    """An iterable dataset sharded per worker as torch documents, with shards of different
    lengths (workers end at different times) and random draws."""

    def __init__(self, n=23):
        self.n = n

    def __iter__(self):
        info = tud.get_worker_info()
        w, workers = (info.id, info.num_workers) if info else (0, 1)
        for i in range(w, self.n + 5 * w, workers):
            yield torch.tensor([i, int(torch.randint(0, 1000, ()))])


def seeded(seed=5):
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return type(a) is type(b) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return (
            type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        )
    return type(a) is type(b) and a == b


def assert_same_batches(ours, theirs):
    assert len(ours) == len(theirs)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert same(a, b), f"batch {i} differs: {a} != {b}"


def both(dataset, daemon, **kwargs):
    """The batches of torch's DataLoader and of ours, from the same seeds."""
    seeded()
    theirs = list(tud.DataLoader(dataset, generator=torch.Generator().manual_seed(7), **kwargs))
    seeded()
    loader = DataLoader(
        dataset, socket=daemon.socket, generator=torch.Generator().manual_seed(7), **kwargs
    )
    ours = list(loader)
    return ours, theirs, loader


def store_empty(daemon):
    daemon.wait_for(
        "every batch object to be deleted",
        lambda s: s["objects_sealed"] + s["objects_writing"] + s["objects_delete_pending"] == 0,
    )


@pytest.mark.parametrize("workers", [0, 2, 4])
def test_map_style_batches_equal_torchs(daemon, workers):
    ours, theirs, loader = both(Augmented(), daemon, batch_size=4, shuffle=True, num_workers=workers)
    assert_same_batches(ours, theirs)
    if workers:
        assert loader.feedstore_counters.batches == len(theirs)
    del ours
    store_empty(daemon)


@pytest.mark.parametrize("workers", [0, 2, 4])
def test_iterable_batches_equal_torchs(daemon, workers):
    ours, theirs, _ = both(Shards(), daemon, batch_size=3, num_workers=workers)
    assert_same_batches(ours, theirs)
    ours, theirs, _ = both(Shards(), daemon, batch_size=3, num_workers=workers, drop_last=True)
    assert_same_batches(ours, theirs)


@pytest.mark.parametrize("workers", [0, 2])
def test_pin_memory_and_persistent_workers_give_torchs_batches_each_epoch(daemon, workers):
    """torch's own `pin_memory=True` and `persistent_workers=True` paths (pinning is skipped,
    with torch's warning, where no accelerator is found: both loaders alike)."""
    kwargs = dict(batch_size=4, shuffle=True, num_workers=workers, pin_memory=True,
                  persistent_workers=workers > 0)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*pin_memory.*")
        seeded()
        torchs = tud.DataLoader(Augmented(), generator=torch.Generator().manual_seed(7), **kwargs)
        theirs = [list(torchs) for _ in range(3)]
        seeded()
        loader = DataLoader(
            Augmented(), socket=daemon.socket, generator=torch.Generator().manual_seed(7), **kwargs
        )
        ours = [list(loader) for _ in range(3)]
    for epoch in range(3):
        assert_same_batches(ours[epoch], theirs[epoch])
    assert not same(ours[0], ours[1])  # (each epoch its own order)
    pinned = torch.cuda.is_available()
    assert all(b["image"].is_pinned() == pinned for b in ours[0])


def test_distributed_sampler_ranks_get_torchs_batches(daemon):
    dataset = Augmented(30)
    for rank in range(2):
        sampler = tud.DistributedSampler(dataset, num_replicas=2, rank=rank, seed=3)
        sampler.set_epoch(4)
        ours, theirs, _ = both(dataset, daemon, batch_size=4, sampler=sampler, num_workers=2)
        assert_same_batches(ours, theirs)


def test_only_torchs_own_samplers_are_drawn_off_the_trainers_thread():
    from feedstore._plan import _draws_alone

    data = list(range(10))
    g = torch.Generator().manual_seed(1)

    class Mine(tud.RandomSampler):
        pass

    class Drawing(tud.Sampler):
        def __init__(self):  # (torch 1.13's Sampler wants a data source; 2.x's none)
            pass

        def __iter__(self):
            return (random.randrange(10) for _ in range(10))

    alone = [
        tud.SequentialSampler(data),
        tud.RandomSampler(data),
        tud.RandomSampler(data, num_samples=5, generator=g),  # one permutation, at the first index
        tud.RandomSampler(data, replacement=True),  # a generator of its own after that
        tud.SubsetRandomSampler([1, 2, 3], generator=g),
        tud.WeightedRandomSampler([1.0] * 10, 5, generator=g),
        tud.DistributedSampler(data, num_replicas=2, rank=0),
        tud.BatchSampler(tud.RandomSampler(data), 4, drop_last=False),
    ]
    not_alone = [
        tud.RandomSampler(data, replacement=True, generator=g),  # the user's, every 32
        tud.RandomSampler(data, num_samples=25, generator=g),  # again at each pass
        tud.RandomSampler(data, generator=g),  # again, for nothing, when it runs out
        Mine(data),
        Drawing(),
        [3, 1, 2],
        tud.BatchSampler(Drawing(), 4, drop_last=False),
        type("MyBatches", (tud.BatchSampler,), {})(tud.SequentialSampler(data), 4, False),
    ]
    assert [_draws_alone(s) for s in alone] == [True] * len(alone)
    assert [_draws_alone(s) for s in not_alone] == [False] * len(not_alone)


@pytest.mark.parametrize("replacement", [True, False])
def test_a_sampler_sharing_the_trainers_generator_draws_where_torchs_does(daemon, replacement):
    # The sampler draws from `g`, which the trainer draws from too between batches: with
    # replacement 32 indices at a time; without (`shuffle=True, generator=g`), a permutation
    # at the first index and an empty one when it runs out, 4 batches before the last.
    # Each later draw must fall between the same two of the trainer's.
    dataset = Augmented(40)

    def run(make, **kwargs):
        g = torch.Generator().manual_seed(11)
        sampler = tud.RandomSampler(dataset, replacement=replacement, generator=g)
        loader = make(dataset, batch_size=2, sampler=sampler, num_workers=2, **kwargs)
        seeded()
        return [(b["label"], torch.randint(0, 10**6, (1,), generator=g)) for b in loader]

    theirs = run(tud.DataLoader)
    ours = run(DataLoader, socket=daemon.socket)
    assert_same_batches(ours, theirs)


def test_every_type_round_trips_through_shared_memory(daemon):
    def collate(items):
        n = len(items)
        return {
            "float32": torch.arange(n * 6, dtype=torch.float32).reshape(n, 2, 3),
            "transposed": torch.arange(12.0).reshape(3, 4).t(),
            "bfloat16": torch.ones(n, 2, dtype=torch.bfloat16),
            "int64": torch.tensor([i for i in items]),
            "bool": torch.tensor([i % 2 == 0 for i in items]),
            "complex": torch.tensor([1 + 2j]),
            "scalar": torch.tensor(7),
            "empty": torch.zeros(0, 3),
            "numpy": np.arange(n * 3, dtype=np.float16).reshape(n, 3),
            "numpy_strings": np.array(["ab", "c"]),
            "numpy_scalar": np.float64(2.5),
            "text": [f"item {i}" for i in items],
            "bytes": b"\x00\xff",
            "number": 3,
            "float": 0.25,
            "none": None,
            "nested": (torch.ones(2), Pair(torch.zeros(1, dtype=torch.int8), "right")),
        }

    expected = [collate(list(range(i, i + 2))) for i in (0, 2, 4)]
    loader = DataLoader(
        range(6), batch_size=2, num_workers=2, collate_fn=collate, socket=daemon.socket,
        batch_classes=[Pair],
    )
    batches = list(loader)
    assert_same_batches(batches, expected)
    batch = batches[0]
    # Writable as torch's (copy-on-write: the store's object is untouched, see test_writable).
    assert batch["numpy"].flags.writeable
    # The tensors are views of one store object, leased until the last of them is gone.
    assert daemon.stats()["leases"] == 3
    tensor = batch["float32"]
    del batches, batch
    import gc

    gc.collect()
    feedstore.Client(daemon.socket).flush()
    assert float(tensor[-1, -1, -1]) == 11.0
    del tensor
    gc.collect()
    daemon.wait_for("the batches' leases to come back", lambda s: s["leases"] == 0)
    store_empty(daemon)


def test_default_collate_writes_the_stacked_batch_once_into_one_object(daemon):
    dataset = [torch.full((64, 64), float(i)) for i in range(8)]
    loader = DataLoader(dataset, batch_size=8, num_workers=2, socket=daemon.socket)
    (batch,) = list(loader)
    assert torch.equal(batch, torch.stack(dataset))
    stats = daemon.stats()
    assert stats["objects_sealed"] + stats["objects_delete_pending"] == 1
    assert stats["leases"] == 1
    assert stats["used_bytes"] >= batch.numel() * 4


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("kind", ["map", "iterable"])
def test_state_dict_resumes_exactly_mid_epoch(daemon, workers, kind):
    dataset = Augmented() if kind == "map" else Shards()
    options = dict(batch_size=3, num_workers=workers, socket=daemon.socket)
    if kind == "map":
        options["shuffle"] = True

    def make():
        return DataLoader(dataset, generator=torch.Generator().manual_seed(11), **options)

    seeded()
    whole = list(make())
    seeded()
    loader = make()
    iterator = iter(loader)
    head = [next(iterator) for _ in range(5)]  # workers have prefetched beyond these
    state = loader.state_dict()
    del iterator
    resumed = make()
    resumed.load_state_dict(state)
    assert_same_batches(head + list(resumed), whole)
    # Saved at the epoch's end: the next epoch is the next one, not an empty one.
    state = resumed.state_dict()
    assert state["finished"]
    again = make()
    again.load_state_dict(state)
    assert len(list(again)) == len(whole)


def test_load_state_dict_refuses_another_worker_count(daemon):
    loader = DataLoader(range(8), batch_size=2, num_workers=2, socket=daemon.socket)
    other = DataLoader(range(8), batch_size=2, num_workers=0)
    with pytest.raises(ValueError, match="num_workers=2"):
        other.load_state_dict(loader.state_dict())


class DiesOnce(tud.Dataset):
    """Sample 13's first worker is killed with SIGKILL while making it (a crash, the OOM
    killer); the marker file makes the restarted worker go on."""

    def __init__(self, marker):
        self.marker = str(marker)
        self.inner = Augmented()

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, i):
        if i == 13 and not os.path.exists(self.marker):
            pathlib.Path(self.marker).write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)
        return self.inner[i]


def test_a_worker_killed_with_sigkill_is_restarted_and_its_batches_made_again(daemon, tmp_path):
    marker = tmp_path / "killed"
    seeded()
    theirs = list(
        tud.DataLoader(Augmented(), batch_size=4, shuffle=True, num_workers=2,
                       generator=torch.Generator().manual_seed(7))
    )
    seeded()
    loader = DataLoader(
        DiesOnce(marker), batch_size=4, shuffle=True, num_workers=2, socket=daemon.socket,
        generator=torch.Generator().manual_seed(7),
    )
    ours = list(loader)
    assert marker.exists()  # a worker really died
    assert loader.feedstore_counters.worker_restarts == 1
    # Exactly torch's batches: the restarted worker starts from its last batch's random state.
    assert_same_batches(ours, theirs)
    del ours
    store_empty(daemon)


class Faulty(tud.Dataset):
    def __len__(self):
        return 12

    def __getitem__(self, i):
        if i in (5, 6):
            raise ValueError(f"sample {i} is corrupt")
        return torch.tensor([i])


def test_an_exception_in_getitem_is_raised_with_its_index_and_traceback(daemon):
    loader = DataLoader(Faulty(), batch_size=4, num_workers=2, socket=daemon.socket)
    iterator = iter(loader)
    assert torch.equal(next(iterator), torch.tensor([[0], [1], [2], [3]]))
    with pytest.raises(ValueError) as raised:
        next(iterator)
    message = str(raised.value)
    assert "sample index 5" in message
    assert "sample 5 is corrupt" in message and "Traceback" in message
    assert "__getitem__" in message
    # As with torch, the iterator goes on with the next batch.
    assert torch.equal(next(iterator), torch.tensor([[8], [9], [10], [11]]))
    with pytest.raises(StopIteration):
        next(iterator)
    del iterator
    store_empty(daemon)


@pytest.mark.parametrize("workers", [0, 2])
def test_on_error_skip_leaves_bad_samples_out_and_counts_them(daemon, workers):
    loader = DataLoader(
        Faulty(), batch_size=4, num_workers=workers, socket=daemon.socket, on_error="skip"
    )
    batches = [b.flatten().tolist() for b in loader]
    assert batches == [[0, 1, 2, 3], [4, 7], [8, 9, 10, 11]]
    assert loader.feedstore_counters.skipped_samples == 2


def test_ctrl_c_stops_the_workers_and_gives_their_batches_back(daemon, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import signal, sys, time, torch
            from feedstore.torch import DataLoader

            # Ctrl-C raises, as in a terminal (a test run started in the background inherits
            # SIGINT ignored, and Python then leaves it ignored).
            signal.signal(signal.SIGINT, signal.default_int_handler)

            class Slow(torch.utils.data.Dataset):
                def __len__(self):
                    return 10_000
                def __getitem__(self, i):
                    time.sleep(0.01)
                    return torch.zeros(256, 1024)

            loader = DataLoader(Slow(), batch_size=4, num_workers=2, socket={daemon.socket!r})
            for i, batch in enumerate(loader):
                if i == 3:
                    print("training", flush=True)
            """
        )
    )
    env = dict(os.environ)
    process = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
        start_new_session=True,
    )
    assert process.stdout.readline() == b"training\n"
    os.killpg(process.pid, signal.SIGINT)  # as a terminal's Ctrl-C: the whole group
    _, stderr = process.communicate(timeout=60)
    assert process.returncode != 0 and b"KeyboardInterrupt" in stderr
    daemon.wait_for("every worker to disconnect", lambda s: s["clients"] <= 1)
    store_empty(daemon)


class Sleepy(tud.Dataset):
    """Index 4 takes `seconds`; the others none."""

    def __init__(self, seconds=3.0):
        self.seconds = seconds

    def __len__(self):
        return 8

    def __getitem__(self, i):
        if i == 4:
            time.sleep(self.seconds)
        return i


def test_a_timeout_is_raised_and_the_iterator_goes_on_as_torchs(daemon):
    def run(make, **kwargs):
        outcomes = []
        iterator = iter(make(Sleepy(), batch_size=2, num_workers=2, timeout=0.5, **kwargs))
        while True:
            try:
                outcomes.append(next(iterator).tolist())
            except StopIteration:
                return outcomes
            except RuntimeError as e:
                assert "DataLoader timed out after 0.5 seconds" in str(e)
                outcomes.append("timed out")

    # (A loaded machine may also time out before the first batches: only the batches, and a
    # timeout just before the slow one, are the same in every run.)
    for outcomes in (run(tud.DataLoader), run(DataLoader, socket=daemon.socket)):
        assert [o for o in outcomes if o != "timed out"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
        assert outcomes[outcomes.index([4, 5]) - 1] == "timed out"
    store_empty(daemon)


def test_persistent_workers_that_do_not_start_the_next_epoch_in_time_are_a_timeout(daemon):
    # Worker 0 makes batch 0, then batch 2 (index 4: 6 s); the next epoch waits for it.
    for make, kwargs in ((tud.DataLoader, {}), (DataLoader, {"socket": daemon.socket})):
        loader = make(
            Sleepy(6.0), batch_size=2, num_workers=2, timeout=0.5, persistent_workers=True, **kwargs
        )
        iterator = iter(loader)
        while True:
            try:
                assert next(iterator).tolist() == [0, 1]
                break
            except RuntimeError as e:  # (a loaded machine: the workers still starting)
                assert "timed out" in str(e)
        with pytest.raises(RuntimeError, match="DataLoader timed out after 0.5 seconds"):
            iter(loader)
        del iterator, loader
    store_empty(daemon)


class Gated(tud.Dataset):
    """Index 0 at once; every other index once the gate file exists. Each index started and
    made is appended to a log file (`start i`, then `i`; from any process)."""

    def __init__(self, gate, log):
        self.gate, self.log = str(gate), str(log)

    def __len__(self):
        return 64

    def note(self, line):
        fd = os.open(self.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        os.write(fd, f"{line}\n".encode())
        os.close(fd)

    def __getitem__(self, i):
        self.note(f"start {i}")
        deadline = time.monotonic() + 60
        while i and not os.path.exists(self.gate) and time.monotonic() < deadline:
            time.sleep(0.005)
        self.note(i)
        return torch.tensor([i])


def test_a_hugging_face_dataset_with_set_transform_gives_torchs_batches(daemon):
    datasets = pytest.importorskip("datasets", reason="Hugging Face datasets (in Ray's venv)")
    table = datasets.Dataset.from_dict(
        {"text": [f"caption {i}" for i in range(30)], "pixels": [[i, i + 1, i + 2] for i in range(30)]}
    )

    def transform(batch):
        return {
            "pixels": [torch.tensor(p, dtype=torch.float32) / 255 + torch.rand(()) for p in batch["pixels"]],
            "text": [t.upper() for t in batch["text"]],
        }

    table.set_transform(transform)
    ours, theirs, _ = both(table, daemon, batch_size=4, shuffle=True, num_workers=2)
    assert_same_batches(ours, theirs)
    assert ours[0]["pixels"].shape == (4, 3) and ours[0]["text"][0].startswith("CAPTION")


DISTRIBUTED_RANK = """
import sys, torch, torch.distributed as dist, torch.utils.data as tud
sys.path.insert(0, {tests!r})
from test_loader import Augmented, same, seeded
from feedstore.torch import DataLoader

dist.init_process_group("gloo", init_method="file://{rendezvous}", rank=int(sys.argv[1]), world_size=2)
dataset = Augmented(30)
seen = []
for loader_type, extra in ((tud.DataLoader, {{}}), (DataLoader, {{"socket": {socket!r}}})):
    sampler = tud.DistributedSampler(dataset, seed=3)  # rank and world from torch.distributed
    sampler.set_epoch(1)
    seeded()
    seen.append(list(loader_type(dataset, batch_size=4, sampler=sampler, num_workers=2,
                                 generator=torch.Generator().manual_seed(7), **extra)))
assert len(seen[0]) == len(seen[1]) and all(same(a, b) for a, b in zip(*seen))
print(sorted(int(l) for batch in seen[1] for l in batch["label"]))
dist.destroy_process_group()
"""


def test_distributed_sampler_with_ranks_from_torch_distributed(daemon, tmp_path):
    """Two real ranks joined by torch.distributed (gloo): each rank's batches equal torch's,
    and together they cover the data set."""
    script = tmp_path / "rank.py"
    script.write_text(
        DISTRIBUTED_RANK.format(
            tests=str(pathlib.Path(__file__).parent),
            rendezvous=tmp_path / "rendezvous",
            socket=daemon.socket,
        )
    )
    ranks = [
        subprocess.Popen([sys.executable, str(script), str(rank)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=dict(os.environ))
        for rank in range(2)
    ]
    labels = []
    for rank in ranks:
        out, err = rank.communicate(timeout=300)
        assert rank.returncode == 0, err.decode()[-3000:]
        labels += eval(out.decode().strip().splitlines()[-1])
    assert sorted(labels) == list(range(30))


def test_persistent_workers_after_a_break_and_an_error_give_torchs_next_epochs(daemon):
    """A `break` leaves batches in flight and an error ends nothing: the next epochs are still
    torch's (late replies of an earlier epoch are dropped, not taken for this one's)."""

    def epochs(loader_type, **extra):
        seeded()
        loader = loader_type(Augmented(24), batch_size=2, shuffle=True, num_workers=2,
                             persistent_workers=True, generator=torch.Generator().manual_seed(7),
                             **extra)
        for batch in loader:
            break
        return [[b["label"].tolist() for b in loader] for _ in range(2)]

    assert epochs(DataLoader, socket=daemon.socket) == epochs(tud.DataLoader)


def test_two_iterators_of_one_loader_run_side_by_side_as_torchs(daemon):
    def pairs(loader_type, **extra):
        seeded()
        loader = loader_type(Augmented(20), batch_size=4, shuffle=True, num_workers=2,
                             generator=torch.Generator().manual_seed(7), **extra)
        return [(a["label"].tolist(), b["label"].tolist()) for a, b in zip(loader, loader)]

    assert pairs(DataLoader, socket=daemon.socket) == pairs(tud.DataLoader)


def test_an_iterator_dropped_after_a_break_stops_its_workers_and_gives_its_batches_back(daemon):
    loader = DataLoader(Augmented(40), batch_size=4, num_workers=2, socket=daemon.socket)
    for batch in loader:
        break
    del batch
    daemon.wait_for("the workers and the trainer's connection to go", lambda s: s["clients"] <= 1)
    store_empty(daemon)
    assert loader.state_dict()["batches"] == 1  # what it stood at is kept


class Reseeding(tud.Dataset):
    """Draws from numpy's global state, which a common worker_init_fn reseeds."""

    def __len__(self):
        return 24

    def __getitem__(self, i):
        return torch.tensor([i, int(np.random.randint(0, 1 << 30))])


def reseed(worker_id):
    np.random.seed(torch.initial_seed() % 2**32)


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_is_exact_from_the_global_random_state_and_with_a_reseeding_init_fn(daemon, workers):
    def make():
        return DataLoader(Reseeding(), batch_size=2, shuffle=True, num_workers=workers,
                          worker_init_fn=reseed if workers else None, socket=daemon.socket)

    seeded()
    whole = list(make())
    seeded()
    loader = make()
    iterator = iter(loader)
    head = [next(iterator) for _ in range(4)]
    state = loader.state_dict()
    del iterator
    torch.manual_seed(1234)  # the trainer's own draws since: not the loader's business
    resumed = make()
    resumed.load_state_dict(state)
    assert_same_batches(head + list(resumed), whole)


def test_reservation_writes_from_two_threads_do_not_deadlock(daemon):
    import threading

    client = feedstore.Client(daemon.socket, writer=True)
    reservation = client.reserve(64 << 20)
    big = np.ones(64 << 20, dtype=np.uint8)
    done = []

    def write():
        for _ in range(5):
            reservation.write(0, big)  # a large copy, without the GIL
        done.append(True)

    thread = threading.Thread(target=write)
    thread.start()
    for _ in range(200):
        assert len(reservation) == 64 << 20
    thread.join(timeout=60)
    assert done and not thread.is_alive()
    handle = reservation.seal()
    assert feedstore.Client(daemon.socket).get(handle).data[-1] == 1


def test_a_reservation_takes_any_buffer_of_bytes_and_refuses_the_rest(daemon):
    # The extension is built on the stable ABI, which has no buffer protocol before CPython
    # 3.11: write holds a memoryview of its data and finds the bytes through numpy. Each kind
    # of buffer of bytes lands byte for byte; buffers of other items are refused.
    import array

    client = feedstore.Client(daemon.socket, writer=True)
    reservation = client.reserve(40)
    pieces = [
        b"0123",
        bytearray(b"4567"),
        memoryview(bytearray(b"89ab")),
        np.frombuffer(b"cdef", dtype=np.uint8),
        np.arange(16, dtype=np.uint8)[4:8],
        array.array("B", b"ghij"),
        memoryview(b"xxklmnxx")[2:6],
    ]
    expected = b""
    for piece in pieces:
        reservation.write(len(expected), piece)
        expected += bytes(piece)
    refused = [
        (np.zeros(2, dtype=np.float32), "uint8"),
        (np.zeros(8, dtype=np.uint8)[::2], "C-contiguous"),
        (memoryview(b"abcdefgh")[::2], "C-contiguous"),
        (memoryview(np.zeros(2, dtype=np.float32)), "format 'f'"),
        (array.array("f", [1.0]), "format 'f'"),
        ("text", "buffer of bytes"),
        (b"x" * 41, "do not fit"),
    ]
    for data, why in refused:
        with pytest.raises(feedstore.InvalidArgument, match=why):
            reservation.write(0, data)
    reservation.write(len(expected), bytes(40 - len(expected)))
    handle = reservation.seal()
    assert bytes(feedstore.Client(daemon.socket).get(handle).data) == expected.ljust(40, b"\0")


def test_a_trainer_exiting_with_a_live_iterator_stops_its_workers_without_restarting_them(
    daemon, tmp_path
):
    script = tmp_path / "exit.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import torch
            from feedstore.torch import DataLoader

            loader = DataLoader([torch.zeros(1024, 1024)] * 64, batch_size=4, num_workers=2,
                                persistent_workers=True, socket={daemon.socket!r})
            iterator = iter(loader)
            next(iterator)
            print("exiting", flush=True)
            """
        )
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    daemon.wait_for("every worker to disconnect", lambda s: s["clients"] <= 1)
    store_empty(daemon)
    log = (tmp_path / "feedstored.log").read_text()
    assert log.count('role=Writer name="DataLoader worker') == 2  # none started again


def test_a_store_smaller_than_the_batches_in_flight_makes_workers_wait_not_lose_batches(daemon):
    """8 batches of 32 MiB in flight against a 256 MiB store: workers wait for room (batch
    objects are pinned, never evicted before the trainer maps them) and every batch comes."""
    samples = [torch.full((2 << 20,), float(i)) for i in range(48)]  # 8 MiB each
    loader = DataLoader(samples, batch_size=4, num_workers=2, prefetch_factor=4,
                        socket=daemon.socket)
    firsts = []
    for batch in loader:
        firsts.append(float(batch[0, 0]))
        if len(firsts) == 1:
            # Workers fill the store while the trainer holds its first batch.
            daemon.wait_for("a worker to wait for room", lambda s: s["creates_waited"] > 0)
    assert firsts == [float(i) for i in range(0, 48, 4)]
    assert daemon.stats()["evictions"] == 0
    del batch
    store_empty(daemon)


class Flaky(tud.IterableDataset):
    """An iterable dataset whose iterator raises at one item and goes on after it."""

    def __iter__(self):
        info = tud.get_worker_info()
        w, workers = (info.id, info.num_workers) if info else (0, 1)
        return FlakyIterator(list(range(w, 30, workers)))


class FlakyIterator:
    def __init__(self, items):
        self.items = items

    def __iter__(self):
        return self

    def __next__(self):
        if not self.items:
            raise StopIteration
        item = self.items.pop(0)
        if item == 6:
            raise ValueError("item 6 is corrupt")
        return torch.tensor([item, int(torch.randint(0, 1000, ()))])


def outcomes(iterator, limit=None):
    """Batches as lists, errors as "error", until the end (or `limit` outcomes)."""
    seen = []
    while limit is None or len(seen) < limit:
        try:
            seen.append(next(iterator).tolist())
        except StopIteration:
            break
        except ValueError:
            seen.append("error")
    return seen


@pytest.mark.parametrize("workers", [0, 2])
def test_an_iterable_dataset_resumes_exactly_after_a_failed_batch(daemon, workers):
    def make():
        return DataLoader(Flaky(), batch_size=2, num_workers=workers, socket=daemon.socket)

    seeded()
    whole = outcomes(iter(make()))
    assert "error" in whole
    seeded()
    loader = make()
    iterator = iter(loader)
    head = outcomes(iterator, limit=whole.index("error") + 2)
    state = loader.state_dict()
    del iterator
    resumed = make()
    resumed.load_state_dict(state)
    assert head + outcomes(iter(resumed)) == whole


def test_persistent_workers_resume_exactly_early_in_a_later_epoch(daemon):
    def make():
        return DataLoader(Augmented(24), batch_size=2, shuffle=True, num_workers=2,
                          persistent_workers=True, generator=torch.Generator().manual_seed(7),
                          socket=daemon.socket)

    def labels(batches):
        return [b["label"].tolist() + b["image"][:, 0, 0, 0].tolist() for b in batches]

    seeded()
    loader = make()
    for _ in loader:
        break  # epoch 1 left early: its tasks still out draw random numbers in the workers
    iterator = iter(loader)
    head = [next(iterator)]
    state = loader.state_dict()
    rest = list(iterator)
    resumed = make()
    resumed.load_state_dict(state)
    assert labels(list(resumed)) == labels(rest)
    assert len(head) + len(rest) == 12


def test_stopping_with_workers_stuck_waiting_for_room_leaves_no_batch_behind(daemon):
    """The trainer keeps 6 batches of 32 MiB in a 256 MiB store: workers block waiting for room
    (and cannot run the deletes they are sent). Dropping everything stops them by signal, and
    the trainer deletes what they could not."""
    samples = [torch.full((2 << 20,), float(i)) for i in range(64)]  # 8 MiB each
    loader = DataLoader(samples, batch_size=4, num_workers=2, socket=daemon.socket)
    iterator = iter(loader)
    kept = [next(iterator) for _ in range(6)]
    daemon.wait_for("a worker to wait for room", lambda s: s["creates_waited"] > 0)
    del kept, iterator
    daemon.wait_for("the workers and the trainer's connection to go", lambda s: s["clients"] <= 1)
    store_empty(daemon)
    assert daemon.stats()["objects_pinned"] == 0


def test_close_and_with_stop_the_workers_without_the_garbage_collector(daemon):
    """Stopping does not wait for the collector: a loader with persistent workers, its iterator
    still referenced, stops them at `close()` (processes ended, their batches given back, a
    batch already taken still readable), and a `with` block, around the loader or an iterator,
    closes it on the way out."""
    gc.disable()
    try:
        loader = DataLoader(
            Augmented(40), batch_size=4, num_workers=2, persistent_workers=True,
            socket=daemon.socket,
        )
        iterator = iter(loader)
        kept = next(iterator)
        processes = [worker.process for worker in iterator._workers]
        loader.close()
        assert [p.is_alive() for p in processes] == [False, False]
        assert kept["label"].tolist() == list(range(4))
        del kept  # (its tensors hold the batch's object until they go)
        store_empty(daemon)
        with pytest.raises(StopIteration):
            next(iterator)
        assert loader.state_dict()["batches"] == 1

        with DataLoader(
            Augmented(12), batch_size=4, num_workers=2, persistent_workers=True,
            socket=daemon.socket,
        ) as loader:
            assert [b["label"].tolist() for b in loader][0] == [0, 1, 2, 3]
            live = loader._feedstore_iterator()
            assert not live._shut  # (persistent: kept for the next epoch)
        assert live._shut and not any(w.process.is_alive() for w in live._workers)

        loader = DataLoader(Augmented(12), batch_size=4, num_workers=2, socket=daemon.socket)
        with iter(loader) as it:
            next(it)
        assert it._shut
        store_empty(daemon)

        # Every live iterator of the loader stops, not only its latest.
        loader = DataLoader(Augmented(12), batch_size=4, num_workers=2, socket=daemon.socket)
        first, second = iter(loader), iter(loader)
        next(first), next(second)
        workers = [w.process for it in (first, second) for w in it._workers]
        loader.close()
        assert not any(p.is_alive() for p in workers)
        for it in (first, second):
            with pytest.raises(StopIteration):
                next(it)
        store_empty(daemon)

        # Without workers there is nothing to stop; the iterator ends all the same.
        loader = DataLoader(Augmented(12), batch_size=4, socket=daemon.socket)
        with loader, iter(loader) as it:
            assert next(it)["label"].tolist() == [0, 1, 2, 3]
        with pytest.raises(StopIteration):
            next(it)
        loader.close()
    finally:
        gc.enable()
