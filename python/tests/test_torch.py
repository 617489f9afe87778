"""feedstore.torch against real torch: DLPack sharing, DataLoader workers, exact resume, and the
Megatron-style example."""

import gc
import pathlib
import runpy

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the torch adapter needs torch (python3-torch)")

import feedstore  # noqa: E402
from feedstore.torch import StreamDataset  # noqa: E402
from conftest import finish, produce  # noqa: E402


def test_from_dlpack_maps_the_store_memory_privately(daemon):
    writer = feedstore.Client(daemon.socket, writer=True)
    pixels = np.arange(3 * 32 * 32, dtype=np.float32).reshape(3, 32, 32)
    handle = writer.put({"images": [pixels], "tokens": [1, 2, 3], "layout": "chw"})
    reader = feedstore.Client(daemon.socket)
    sample = reader.get(handle)
    image = torch.from_dlpack(sample.image(0))
    tokens = torch.from_dlpack(sample.tokens_tensor())
    # A copy-on-write mapping of its own over the object: writable like torch's tensors, and
    # a write copies only the page it touches, never reaching the store or the sample's view.
    assert image.data_ptr() != sample.images[0].ctypes.data
    assert image.dtype == torch.float32 and tuple(image.shape) == (3, 32, 32)
    assert torch.equal(image, torch.from_numpy(pixels))
    assert tokens.tolist() == [1, 2, 3]
    image[0, 0, 0] = -1.0
    assert float(sample.images[0][0, 0, 0]) == 0.0
    del sample
    gc.collect()
    reader.flush()
    assert daemon.stats()["leases"] == 1  # the tensors hold the lease
    assert float(image[2, 31, 31]) == 3 * 32 * 32 - 1
    del image, tokens
    gc.collect()
    reader.flush()
    daemon.wait_for("the tensors' lease to come back", lambda s: s["leases"] == 0)


def epoch_of(batches):
    return sorted(record for batch in batches for record in batch["record"])


def test_dataloader_with_two_workers_reads_each_sample_once(daemon, tmp_path):
    records = 24
    dataset = StreamDataset(
        "loader", records, rank=0, world=1, num_workers=2, socket=daemon.socket, wait=120
    )
    producer = produce(
        daemon, tmp_path, "loader", records, "--world", str(dataset.stream_world)
    )
    loader = dataset.loader(batch_size=4, collate_fn=lambda items: items_to_batch(items))
    batches = list(loader)
    records_seen = [item for batch in batches for item in batch["record"]]
    assert sorted(records_seen) == list(range(records))  # every sample exactly once
    assert {r for batch in batches for r in batch["rank"].tolist()} == {0, 1}
    for batch in batches:
        assert batch["pixel_values"].shape == (4, 64, 64, 3)
        assert batch["pixel_values"].dtype == torch.uint8
    finish(producer)


def items_to_batch(items):
    from feedstore.torch import collate

    batch = collate(items)
    batch["record"] = [item["record"] for item in items]
    return batch


@pytest.mark.parametrize("num_workers", [0, 2])
def test_state_dict_resumes_exactly(daemon, tmp_path, num_workers):
    records, name = 40, f"resume-{num_workers}"
    make = lambda: StreamDataset(  # noqa: E731
        name, records, rank=0, world=1, num_workers=num_workers, seed=3, epochs=2,
        socket=daemon.socket, wait=120,
    )
    dataset = make()
    producer = produce(
        daemon, tmp_path, name, records, "--world", str(dataset.stream_world),
        "--seed", "3", "--epochs", "2",
    )
    uninterrupted = [
        b["record"] for b in make_loader(make()).__iter__()
    ]
    flat_expected = [r for batch in uninterrupted for r in batch]
    finish(producer)

    # The same stream again, interrupted after 7 batches and resumed from the state dict.
    name2 = name + "-again"
    first = StreamDataset(
        name2, records, rank=0, world=1, num_workers=num_workers, seed=3, epochs=2,
        socket=daemon.socket, wait=120,
    )
    producer = produce(
        daemon, tmp_path, name2, records, "--world", str(first.stream_world),
        "--seed", "3", "--epochs", "2",
    )
    got = []
    for i, batch in enumerate(make_loader(first)):
        got.extend(batch["record"])
        if i == 6:
            break
    state = first.state_dict()
    del first
    gc.collect()
    resumed = StreamDataset(
        name2, records, rank=0, world=1, num_workers=num_workers, seed=3, epochs=2,
        socket=daemon.socket, wait=120,
    )
    resumed.load_state_dict(state)
    for batch in make_loader(resumed):
        got.extend(batch["record"])
    assert got == flat_expected
    assert sorted(got) == sorted(list(range(records)) * 2)  # each record once per epoch
    finish(producer)


def make_loader(dataset):
    return dataset.loader(batch_size=3, collate_fn=items_to_batch)


def test_megatron_style_example_runs(daemon, tmp_path):
    records = 12
    producer = produce(daemon, tmp_path, "megatron", records, "--world", "1")
    example = pathlib.Path(__file__).resolve().parents[1] / "examples" / "megatron_dataset.py"
    result = runpy.run_path(str(example), run_name="feedstore_example")
    steps = result["train"](socket=daemon.socket, name="megatron", records=records, steps=3,
                            micro_batch=4)
    assert sorted(r for step in steps for r in step) == list(range(records))
    finish(producer)
