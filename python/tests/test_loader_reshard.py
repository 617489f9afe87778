"""feedstore.torch.DataLoader resumed at another world size: every rank's `state_dict()` from a
run of W ranks (torch's DistributedSampler), saved with uneven progress, loads into each rank of
a run of W'. Across the new ranks every sample the old ranks left of their epoch is read once,
none they read is read again, every new rank makes as many batches, and the epoch after is the
new world's ordinary one, as torch's own sampler deals it.

The loaders run real worker processes writing batches into a real feedstored (and, with
`num_workers=0`, in the trainer's process); the states go through torch.save and torch.load as
a checkpoint's do."""

import collections
import io

import pytest

torch = pytest.importorskip("torch", reason="the torch adapter needs torch (python3-torch)")
import torch.utils.data as tud  # noqa: E402

from feedstore import _elastic  # noqa: E402
from feedstore.torch import DataLoader  # noqa: E402

EPOCH = 5


class Indexed(tud.Dataset):
    """Sample i is i."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i


def loader(daemon, n, world, rank, batch=4, workers=2, drop_last=False, **kwargs):
    data = Indexed(n)
    sampler = tud.DistributedSampler(
        data, num_replicas=world, rank=rank, seed=3, drop_last=drop_last
    )
    sampler.set_epoch(EPOCH)
    return DataLoader(
        data, batch_size=batch, sampler=sampler, num_workers=workers, socket=daemon.socket,
        **kwargs,
    )


def take(dl, batches=None):
    """The indices of up to `batches` batches (all, with None), and the state after them."""
    read = []
    with iter(dl) as it:
        for _, batch in zip(range(batches if batches is not None else 10**9), it):
            read.append(batch.tolist())
        return read, dl.state_dict()


def checkpoint(states):
    """The states as a trainer's checkpoint carries them (torch.save, then torch.load)."""
    buffer = io.BytesIO()
    torch.save(states, buffer)
    buffer.seek(0)
    return torch.load(buffer)


def flat(batches):
    return [i for batch in batches for i in batch]


def resumed(daemon, n, states, world, **kwargs):
    """Each rank of `world` resumed from every old rank's `states`, read to the epoch's end."""
    out = []
    for rank in range(world):
        dl = loader(daemon, n, world, rank, **kwargs)
        dl.load_state_dict(checkpoint(states))
        out.append(take(dl))
    return out


def assert_left_once(n, old_reads, new_reads, new_world):
    """What the new ranks read is what the old ones left, each once, and as many per rank:
    padded, as DistributedSampler pads an epoch, with at most new_world - 1 repeats."""
    old = set(old_reads)
    new = collections.Counter(new_reads)
    assert not old & set(new), "a sample the old ranks read was read again"
    assert old | set(new) == set(range(n)), "a sample was never read"
    left = n - len(old)
    assert len(new_reads) == -(-left // new_world) * new_world
    assert sum(new.values()) - len(new) == len(new_reads) - left < new_world


@pytest.mark.parametrize("workers", [2, 0])
@pytest.mark.parametrize(
    # Batches of 4; each old rank's batches taken (of 8 for 2 ranks of 60 samples, 4 for 4
    # ranks, 5 for 3, 15 for 1): a rank that took nothing, one in its last batch, one done.
    "n, old_world, taken, new_world",
    [(60, 2, [0, 7], 3), (62, 4, [1, 3, 0, 4], 2), (60, 3, [2, 5, 4], 1), (61, 1, [14], 4)],
)
def test_a_loader_resumes_at_another_world_size(daemon, workers, n, old_world, taken, new_world):
    old = [take(loader(daemon, n, old_world, r, workers=workers), k) for r, k in enumerate(taken)]
    states = [state for _, state in old]
    # Small, whatever the data set: the epoch's seed and size, and the count each rank took.
    new = resumed(daemon, n, states, new_world, workers=workers)
    reshard = new[0][1]["reshard"]
    assert reshard["levels"][0]["tasks"] == taken
    assert len(repr(reshard)) < 400, reshard
    lengths = {len(batches) for batches, _ in new}
    assert len(lengths) == 1, "new ranks make different numbers of batches (DDP would hang)"
    # The old run read, each rank, what torch's own sampler dealt it.
    for rank, (batches, _) in enumerate(old):
        sampler = tud.DistributedSampler(range(n), num_replicas=old_world, rank=rank, seed=3)
        sampler.set_epoch(EPOCH)
        assert flat(batches) == list(sampler)[: len(flat(batches))]
    assert_left_once(
        n,
        [i for batches, _ in old for i in flat(batches)],
        [i for batches, _ in new for i in flat(batches)],
        new_world,
    )
    # Each new rank ends its resharded epoch; the next is the new world's ordinary epoch.
    for rank, (_, state) in enumerate(new):
        assert state["finished"]
        dl = loader(daemon, n, new_world, rank, workers=workers)
        dl.load_state_dict(checkpoint(state))
        dl.sampler.set_epoch(EPOCH + 1)
        again, _ = take(dl)
        expected = tud.DistributedSampler(range(n), num_replicas=new_world, rank=rank, seed=3)
        expected.set_epoch(EPOCH + 1)
        assert flat(again) == list(expected)


def test_persistent_workers_go_on_to_the_ordinary_epoch(daemon):
    n, states = 40, []
    for rank, k in enumerate([2, 1]):
        states.append(take(loader(daemon, n, 2, rank), k)[1])
    dl = loader(daemon, n, 3, 1, persistent_workers=True)
    dl.load_state_dict(states)
    first = flat(b.tolist() for b in dl)
    assert len(first) == -(-(n - 12) // 3)
    dl.sampler.set_epoch(EPOCH + 1)
    second = flat(b.tolist() for b in dl)  # (the same workers: a new epoch, not a resume)
    expected = tud.DistributedSampler(range(n), num_replicas=3, rank=1, seed=3)
    expected.set_epoch(EPOCH + 1)
    assert second == list(expected)
    dl.close()


def test_a_resharded_epoch_resumes_and_reshards_again(daemon):
    """2 ranks → 3 (which stop part-way) → 2 again, and a resharded rank resumed at its own
    world in the middle: every sample of the epoch read once over the three runs."""
    n = 90
    first = [take(loader(daemon, n, 2, r, workers=0), k) for r, k in enumerate([3, 6])]
    second = []
    for rank, k in enumerate([2, 0, 4]):
        dl = loader(daemon, n, 3, rank)
        dl.load_state_dict(checkpoint([state for _, state in first]))
        second.append(take(dl, k))
    # Rank 2 saved mid-share and resumes from its own state at the same world: it goes on
    # where it stood, as the uninterrupted share would.
    dl = loader(daemon, n, 3, 2)
    dl.load_state_dict(checkpoint([state for _, state in first]))
    whole, _ = take(dl)
    dl = loader(daemon, n, 3, 2)
    dl.load_state_dict(checkpoint(second[2][1]))
    assert second[2][0] + take(dl)[0] == whole
    dl = loader(daemon, n, 3, 2)
    dl.load_state_dict(checkpoint([state for _, state in second]))  # the list, same world
    assert second[2][0] + take(dl)[0] == whole

    third = resumed(daemon, n, [state for _, state in second], 2, workers=0)
    assert len(third[0][1]["reshard"]["levels"]) == 2
    before = [i for run in (first, second) for batches, _ in run for i in flat(batches)]
    assert len(before) == len(set(before)), "the first two runs read a sample twice"
    assert_left_once(n, before, [i for batches, _ in third for i in flat(batches)], 2)


def test_states_saved_before_the_first_batch_of_a_resharded_epoch(daemon):
    """A run resharded 2 → 3 checkpoints before any rank's first batch: its states reload at
    3, and at 2 they reshard what the 2 ranks left with no new level (a run that read nothing
    adds no padding or cut of its own)."""
    n = 50
    kw = dict(workers=0)
    first = [take(loader(daemon, n, 2, r, **kw), k) for r, k in enumerate([2, 1])]
    saved = []
    for rank in range(3):
        dl = loader(daemon, n, 3, rank, **kw)
        dl.load_state_dict(checkpoint([state for _, state in first]))
        saved.append(checkpoint(dl.state_dict()))  # loaded, never iterated
    levels = saved[0]["reshard"]["levels"]
    at_three = []
    for rank in range(3):
        dl = loader(daemon, n, 3, rank, **kw)
        dl.load_state_dict(checkpoint(saved))
        at_three.append(take(dl)[0])
    at_two = resumed(daemon, n, saved, 2, **kw)
    assert at_two[0][1]["reshard"]["levels"] == levels
    read = [i for batches, _ in first for i in flat(batches)]
    for new_reads, world in (
        ([i for batches in at_three for i in flat(batches)], 3),
        ([i for batches, _ in at_two for i in flat(batches)], 2),
    ):
        assert_left_once(n, read, new_reads, world)


def test_a_refused_resume_is_kept_for_the_next_iteration(daemon):
    """`iter()` refusing a resharded state (the sampler at another epoch) keeps it: after
    `set_epoch`, the loader resumes it, not the ordinary epoch."""
    n = 40
    states = [take(loader(daemon, n, 2, r, workers=0), k)[1] for r, k in enumerate([1, 2])]
    expected = resumed(daemon, n, states, 3, workers=0)[0][0]
    dl = loader(daemon, n, 3, 0, workers=0)
    dl.load_state_dict(checkpoint(states))
    dl.sampler.set_epoch(EPOCH + 1)
    with pytest.raises(ValueError, match=rf"set_epoch\({EPOCH}\)"):
        iter(dl)
    dl.sampler.set_epoch(EPOCH)
    assert take(dl)[0] == expected


def test_drop_last_cuts_what_is_left_as_the_sampler_cuts_an_epoch(daemon):
    n = 50
    old = [take(loader(daemon, n, 2, r, drop_last=True, workers=0), k) for r, k in enumerate([1, 2])]
    new = resumed(daemon, n, [s for _, s in old], 4, drop_last=True, workers=0)
    left = n - 12
    reads = [i for batches, _ in new for i in flat(batches)]
    assert len(reads) == left - left % 4 == len(set(reads))
    assert not set(reads) & {i for batches, _ in old for i in flat(batches)}


def test_torchs_sampler_deals_as_feedstore_reads_it():
    """`_deal` is DistributedSampler's padding and dealing, on this torch (a torch that dealt
    otherwise is refused at load, not resumed from the wrong samples)."""
    for n in (1, 5, 16, 17, 23):
        for world in (1, 2, 3, 4, 7):
            for drop_last in (False, True):
                base = {"size": n, "seed": 1, "shuffle": True, "epoch": 2}
                order = _elastic._first_order(base)
                grid = _elastic._deal(order, world, drop_last)
                for rank in range(world):
                    sampler = tud.DistributedSampler(
                        range(n), num_replicas=world, rank=rank, seed=1, drop_last=drop_last
                    )
                    sampler.set_epoch(2)
                    assert grid[:, rank].tolist() == list(sampler), (n, world, drop_last)


def test_what_cannot_be_resharded_is_refused(daemon):
    n = 40
    states = [take(loader(daemon, n, 2, r, workers=0), k)[1] for r, k in enumerate([1, 2])]
    new = loader(daemon, n, 3, 0, workers=0)
    with pytest.raises(ValueError, match="rank 1's is missing"):
        new.load_state_dict([states[0], states[0] | {"sampler": states[0]["sampler"] | {"rank": 2}}])
    with pytest.raises(ValueError, match="two states are rank 0's"):
        new.load_state_dict([states[0], states[0]])
    # One rank's state at another world size says what to pass.
    with pytest.raises(ValueError, match="pass the list of every rank's state"):
        new.load_state_dict(states[0])
    # Another epoch's states are refused, and a resharded epoch resumes only in its epoch.
    with pytest.raises(ValueError, match="of epochs 5 and 9"):
        new.load_state_dict([states[0], states[1] | {"sampler": states[1]["sampler"] | {"epoch": 9}}])
    new.load_state_dict(states)
    new.sampler.set_epoch(EPOCH + 1)
    with pytest.raises(ValueError, match=rf"call sampler.set_epoch\({EPOCH}\)"):
        iter(new)
    # Another sampler has no order across ranks to reshard.
    plain = DataLoader(Indexed(n), batch_size=4, shuffle=True, socket=daemon.socket)
    with pytest.raises(ValueError, match="not torch's DistributedSampler"):
        plain.load_state_dict(states)
    # A forged reshard is refused, bounded before anything is made of it.
    forged = dict(states[0], reshard={"base": {}, "levels": []})
    with pytest.raises(ValueError, match="no epoch it resumes"):
        dl = loader(daemon, n, 2, 0, workers=0)
        dl.load_state_dict(forged)
        iter(dl)
    # More resizes in one epoch than streams allow are refused.
    deep = {
        "base": {"size": n, "seed": 3, "shuffle": True, "epoch": EPOCH},
        "levels": [{"world": 2, "drop_last": False, "batch": 4, "batch_drop_last": False,
                    "tasks": [0, 1]}] * 9,
    }
    dl = loader(daemon, n, 2, 0, workers=0)
    dl.load_state_dict(dict(states[0], reshard=deep))
    with pytest.raises(ValueError, match="resized more than 8 times"):
        iter(dl)
    huge = {
        "base": {"size": n, "seed": 3, "shuffle": True, "epoch": EPOCH},
        "levels": [{"world": 70000, "drop_last": False, "batch": 4, "batch_drop_last": False,
                    "tasks": [0] * 70000}],
    }
    dl = loader(daemon, n, 2, 0, workers=0)
    dl.load_state_dict(dict(states[0], reshard=huge))
    with pytest.raises(ValueError, match="more than 65536 old ranks"):
        iter(dl)
    # Every old rank at its epoch's start (or end): nothing to reshard, the ordinary epoch.
    fresh = [take(loader(daemon, n, 2, r, workers=0), 0)[1] for r in range(2)]
    # (A loader never iterated stands at the start of its sampler's epoch too.)
    fresh[1] = loader(daemon, n, 2, 1, workers=0).state_dict()
    dl = loader(daemon, n, 3, 0, workers=0)
    dl.load_state_dict(fresh)
    expected = tud.DistributedSampler(range(n), num_replicas=3, rank=0, seed=3)
    expected.set_epoch(EPOCH)
    assert flat(take(dl)[0]) == list(expected)
