"""feedstore.ray.write_stream: a Ray Data pipeline's batches into a stream, read by trainer
ranks with StreamDataset, through a real local Ray instance and a real feedstored."""

import numpy as np
import pytest

ray = pytest.importorskip("ray")
torch = pytest.importorskip("torch", reason="the torch adapter needs torch (python3-torch)")

import feedstore  # noqa: E402
import feedstore.ray as fray  # noqa: E402
from feedstore.torch import StreamDataset  # noqa: E402


@pytest.fixture
def local_ray():
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             object_store_memory=100 * 1024 * 1024)
    yield
    ray.shutdown()


def test_a_ray_data_pipeline_lands_in_a_stream_read_in_place(daemon, local_ray):
    pipeline = ray.data.range(42).map(
        lambda row: {"id": row["id"], "pixels": np.full((3, 4), row["id"], dtype=np.float32)}
    )
    records = fray.write_stream(pipeline, "raydata", world=2, batch_size=4, socket=daemon.socket)
    assert records == 11  # 42 rows in batches of 4; the ranks share 10 of them
    for rank in range(2):
        dataset = StreamDataset("raydata", records, rank=rank, world=2, shuffle="none",
                                socket=daemon.socket, wait=60)
        batches = list(dataset)
        assert len(batches) == 5
        for k, batch in enumerate(batches):
            record = rank + 2 * k
            ids = list(range(4 * record, 4 * record + 4))
            assert batch["id"].tolist() == ids
            assert batch["pixels"].shape == (4, 3, 4) and batch["pixels"].dtype == np.float32
            # A private (copy-on-write) view of the store's memory: writable, and a write
            # stays in this batch.
            assert batch["pixels"].flags.writeable
            assert (batch["pixels"][:, 0, 0] == np.array(ids, dtype=np.float32)).all()
            batch["pixels"][:] = -1


def test_write_stream_says_so_when_the_pipeline_is_shorter_than_the_stream(daemon, local_ray):
    with pytest.raises(feedstore.InvalidArgument, match="gave 6 items"):
        fray.write_stream(ray.data.range(6), "short", world=2, records=10, socket=daemon.socket)


def test_write_stream_in_the_background_while_ranks_read_more_than_their_windows(daemon, local_ray):
    """300 records against windows of 8: the writer must wait for readers, who read as it
    writes (block=False)."""
    writing = fray.write_stream(ray.data.range(300), "background", world=2, depth=8,
                                socket=daemon.socket, block=False)
    assert writing.records == 300
    ranks = [StreamDataset("background", writing.records, rank=r, world=2, shuffle="none",
                           socket=daemon.socket, wait=60) for r in range(2)]
    iterators = [iter(d) for d in ranks]
    seen = [[], []]
    for _ in range(150):
        for r in range(2):
            seen[r].append(int(next(iterators[r])["id"]))
    assert writing.wait(timeout=60) == 300
    assert seen == [list(range(0, 300, 2)), list(range(1, 300, 2))]
