"""Resuming at another world size from Python, against a real daemon: `feedstore.reshard` turns
every rank's saved state into one per rank of the new world, and `Writer(states=)` and
`Stream(state=)` resume from them. Every sample the old run left of the epochs it began is read
exactly once, and the epoch after is the new world's uninterrupted run."""

import collections
import threading
import time

import pytest

import feedstore

SPEC = dict(records=37, seed=9, shuffle="full", tail="drop", epochs=2)


def writer(daemon, name, world, states=None):
    """A writer of the stream, once the daemon has seen the last run's go (its stream, of
    another spec, gives way only when nobody uses it)."""
    deadline = time.monotonic() + 20
    while True:
        try:
            return feedstore.Writer(
                name, world=world, states=states, depth=8, socket=daemon.socket, **SPEC
            )
        except feedstore.StreamMismatch:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def feed(w, stop):
    """Puts each task's sample (its id and tokens name its record) until `stop`."""
    while not stop.is_set():
        tasks = w.take(max=16, wait=0.05)
        if tasks is None:
            return
        for t in tasks:
            w.put(t, {"id": f"record-{t.record}", "tokens": [t.record]})


def read(daemon, name, world, rank, n, state=None):
    """Up to `n` records of `rank` from `state` on, and the state after them."""
    records = []
    with feedstore.Stream(
        name, rank=rank, world=world, state=state, socket=daemon.socket, wait=30, **SPEC
    ) as s:
        while len(records) < n and (sample := next(s, None)) is not None:
            assert sample.id == f"record-{sample.record}"
            records.append(sample.record)
        return records, s.state()


def fed(daemon, name, world, states, body):
    """`body()` while a writer feeds every rank from `states` (or the start)."""
    w = writer(daemon, name, world, states)
    stop = threading.Event()
    thread = threading.Thread(target=feed, args=(w, stop))
    thread.start()
    try:
        return body()
    finally:
        stop.set()
        thread.join()
        del w


def run(daemon, name, world, reads, states=None):
    """One run: each rank reading up to its count from `states` (or the start). The records
    each rank read, and its state after them."""
    return fed(
        daemon,
        name,
        world,
        states,
        lambda: [
            read(daemon, name, world, rank, reads[rank], None if states is None else states[rank])
            for rank in range(world)
        ],
    )


@pytest.mark.parametrize(
    "old_world, reads, new_world",
    [(2, [7, 0], 3), (4, [3, 11, 8, 5], 2), (3, [11, 12, 9], 1), (1, [20], 4)],
)
def test_a_run_resumes_at_another_world_size(daemon, old_world, reads, new_world):
    name = f"elastic-{old_world}-{new_world}"
    old = run(daemon, name, old_world, reads)
    states = [state for _, state in old]
    new_states = feedstore.reshard(states, new_world, name=name, **SPEC)
    assert len(new_states) == new_world
    # Small, whatever the data set: the old world's counts, run-length coded.
    assert all(len(s) < 200 for s in new_states), new_states
    new = run(daemon, name, new_world, [10**9] * new_world, new_states)

    # Past the epochs the old ranks had begun, each new rank reads the new world's ordinary
    # epochs, as a run at the new world from the start reads them.
    per_old, per_new = SPEC["records"] // old_world, SPEC["records"] // new_world
    begun = max(-(-n // per_old) for n in reads)
    whole = (SPEC["epochs"] - begun) * per_new
    second = [records for records, _ in new]
    fresh = run(daemon, f"{name}-fresh", new_world, [SPEC["epochs"] * per_new] * new_world)
    for rank, records in enumerate(second):
        assert records[len(records) - whole :] == fresh[rank][0][begun * per_new :]
    # Before that, what the old ranks left, in shares that differ by one at most: together
    # with what they read, each epoch begun read once, as an uninterrupted run at the old world
    # reads it.
    shares = [len(records) - whole for records in second]
    assert max(shares) - min(shares) <= 1, shares
    read = collections.Counter(r for records, _ in old for r in records)
    read.update(r for records in second for r in records[: len(records) - whole])
    uninterrupted = run(daemon, f"{name}-whole", old_world, [begun * per_old] * old_world)
    assert read == collections.Counter(r for records, _ in uninterrupted for r in records)
    assert sum(read.values()) == begun * per_old * old_world


def test_a_resharded_run_resumes_at_another_size_again_mid_share(daemon):
    """2 ranks → 3, stopped while every new rank still reads its share of what the 2 left →
    2 again: what the 3 left of their shares comes first, and over the three runs each sample
    of the epoch is read once; the epoch after is a run of 2's."""
    name = "elastic-nested"
    first = run(daemon, name, 2, [7, 0])
    to_three = feedstore.reshard([state for _, state in first], 3, name=name, **SPEC)
    second = run(daemon, name, 3, [2, 0, 5], to_three)
    to_two = feedstore.reshard([state for _, state in second], 2, name=name, **SPEC)
    assert all("|r2:" in s for s in to_two), to_two
    third = run(daemon, name, 2, [10**9] * 2, to_two)

    per_rank = SPEC["records"] // 2
    left = 2 * per_rank - 7 - 7  # the epoch less what the first two runs read
    shares = [len(records) - per_rank for records, _ in third]
    assert sorted(shares) == [left // 2, left - left // 2], shares
    fresh = run(daemon, f"{name}-fresh", 2, [2 * per_rank] * 2)
    for rank, (records, _) in enumerate(third):
        assert records[shares[rank] :] == fresh[rank][0][per_rank:]
    read = collections.Counter(r for records, _ in first + second for r in records)
    read.update(r for rank, (records, _) in enumerate(third) for r in records[: shares[rank]])
    assert read == collections.Counter(r for records, _ in fresh for r in records[:per_rank])


def test_reshard_refuses_what_it_cannot_resume(daemon):
    spec = dict(name="refused", **SPEC)
    at = lambda rank, seq, world: feedstore.state_at(  # noqa: E731
        "refused", SPEC["records"], rank, seq, world, seed=9, epochs=2
    )
    states = [at(0, 3, 2), at(1, 5, 2)]
    with pytest.raises(feedstore.InvalidArgument, match="2 states for a world of 2|one per rank"):
        feedstore.reshard([states[0], states[0]], 3, **spec)
    # A rank missing (rank 1's state alone): said so, not a digest mismatch.
    with pytest.raises(feedstore.InvalidArgument, match="1 states for a world of 1: one per rank"):
        feedstore.reshard([states[1]], 3, **spec)
    # Another spec's states say which settings must be the old run's.
    with pytest.raises(feedstore.InvalidArgument, match="epochs .1 unless given."):
        feedstore.reshard(states, 3, **dict(spec, epochs=None))
    with pytest.raises(feedstore.InvalidArgument, match="another stream"):
        feedstore.reshard(states, 3, **dict(spec, seed=10))
    new = feedstore.reshard(states, 3, **spec)
    # A resharded state opens only at its world, and a stream it does not belong to refuses it.
    with pytest.raises(feedstore.InvalidArgument, match="a world of 3, not 2"):
        feedstore.Stream("refused", rank=0, world=2, state=new[0], socket=daemon.socket, **SPEC)
    with pytest.raises(feedstore.InvalidArgument, match="not a stream state"):
        feedstore.Stream("refused", rank=0, world=3, state="r1:zz@1:2", socket=daemon.socket, **SPEC)


def test_a_stream_dataset_resumes_at_another_world_size(daemon):
    """Every trainer rank's `StreamDataset.state_dict()` from a run of 2 loads into each rank of
    a run of 3, which reads what was left once, then the next epoch as a run of 3 does."""
    from feedstore.torch import StreamDataset

    name = "elastic-dataset"

    def dataset(rank, world):
        return StreamDataset(name, rank=rank, world=world, socket=daemon.socket, wait=30, **SPEC)

    def take(ds, n):
        records = []
        for item in ds:
            records.append(item["record"])
            if len(records) == n:
                break
        return records

    old = [dataset(r, 2) for r in range(2)]
    first = fed(daemon, name, 2, None, lambda: [take(ds, n) for ds, n in zip(old, [5, 12])])
    saved = [ds.state_dict() for ds in old]
    # A state from another world is refused unless it is every rank's.
    with pytest.raises(feedstore.StreamMismatch, match="pass every rank"):
        dataset(0, 3).load_state_dict(saved[0])
    # Every old rank's, or nothing: a trainer rank's state_dict missing is refused.
    with pytest.raises(feedstore.InvalidArgument, match="no state for stream rank 1"):
        dataset(0, 3).load_state_dict(saved[:1])
    new = [dataset(r, 3) for r in range(3)]
    for ds in new:
        ds.load_state_dict(saved)
    # The writer takes the old run's states as they are (it reshards them the same way).
    texts = [t for s in saved for t in s["states"].values()]
    second = fed(daemon, name, 3, texts, lambda: [take(ds, 10**9) for ds in new])
    # Checkpoints of the new run resume it at its own world too.
    assert new[0].state_dict()["states"][0].startswith("r1:")
    per_new = SPEC["records"] // 3
    fresh = run(daemon, f"{name}-fresh", 3, [2 * per_new] * 3)
    for rank, records in enumerate(second):
        assert records[-per_new:] == fresh[rank][0][per_new:]
    read = collections.Counter(r for records in first for r in records)
    read.update(r for records in second for r in records[:-per_new])
    whole = run(daemon, f"{name}-whole", 2, [SPEC["records"] // 2] * 2)
    assert read == collections.Counter(r for records, _ in whole for r in records)
