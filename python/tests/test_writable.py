"""Batches and samples as writable as torch's: in-place ops on what a DataLoader, a stream or
`Client.get(private=True)` hands out work, through a copy-on-write mapping of the reader's own,
and change nothing another reader, a later epoch or the decode-once cache sees. What stays a
view of the store's read-only mapping says so (numpy's `writeable` flag) and raises."""

import gc

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the torch adapter needs torch (python3-torch)")
import torch.utils.data as tud  # noqa: E402

import feedstore  # noqa: E402
from conftest import finish, produce  # noqa: E402
from feedstore.torch import DataLoader, StreamDataset, to_torch  # noqa: E402

PAD = 7


class Tokens(tud.Dataset):
    """Samples with an image and labels that hold padding, as a training loop masks it."""

    def __len__(self):
        return 24

    def __getitem__(self, i):
        labels = torch.arange(i, i + 16) % 10
        return {"image": torch.full((3, 32, 32), float(i)), "labels": labels}


def private_dirty_kib(address: int) -> int:
    """Private_Dirty of the mapping of this process that holds `address` (pages it copied)."""
    with open("/proc/self/smaps") as smaps:
        inside = False
        for line in smaps:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "Private_Dirty:":
                return int(line.split()[1])
    raise AssertionError(f"0x{address:x} is in no mapping")


def test_in_place_ops_on_loader_batches_work_and_reach_no_later_epoch_or_cache(daemon):
    loader = DataLoader(
        Tokens(), batch_size=4, num_workers=2, sample_cache=True, socket=daemon.socket
    )
    expected = list(tud.DataLoader(Tokens(), batch_size=4))
    for b, batch in enumerate(loader):
        image, labels = batch["image"], batch["labels"]
        labels[labels == PAD] = -100  # the lines of every training loop
        image += 1
        image.div_(2)
        image.numpy()[0, 0, 0, 0] = 5  # numpy says writeable, and it is
        assert image.numpy().flags.writeable
        assert (labels == -100).any() and not (labels == PAD).any()
        assert float(image[0, 0, 0, 0]) == 5.0 and float(image[0, 0, 0, 1]) == (4 * b + 1) / 2
    # The next epoch reads every sample from the decode-once cache: untouched by the writes.
    second = list(loader)
    assert loader.feedstore_counters.cache_hits >= len(Tokens())
    for ours, theirs in zip(second, expected):
        assert torch.equal(ours["image"], theirs["image"])
        assert torch.equal(ours["labels"], theirs["labels"])
    del second, batch, image, labels
    gc.collect()


def test_a_private_view_is_writable_and_changes_nothing_another_reader_sees(daemon):
    writer = feedstore.Client(daemon.socket, writer=True)
    original = np.arange(1 << 18, dtype=np.float32)  # 1 MiB: 256 pages
    handle = writer.put(original)
    reader, other = feedstore.Client(daemon.socket), feedstore.Client(daemon.socket)

    shared = reader.get(handle)
    assert not shared.writable and not shared.images[0].flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        shared.images[0][0] = 1

    mine = reader.get(handle, private=True)
    assert mine.writable
    image = mine.images[0]
    assert image.flags.writeable and np.array_equal(image, original)
    # Reading copied nothing; the first write copies the one page it touches.
    assert private_dirty_kib(image.ctypes.data) == 0
    image[1000] = -1.0
    assert private_dirty_kib(image.ctypes.data) == 4
    image[1001] = -2.0  # (the same page)
    assert private_dirty_kib(image.ctypes.data) == 4
    tensor = torch.from_dlpack(mine.image(0))
    tensor.mul_(2)  # every page
    assert float(tensor[1000]) == -2.0 and float(tensor[5]) == 10.0

    # Nobody else sees it: the store's object, another client, another private view.
    assert np.array_equal(shared.images[0], original)
    assert np.array_equal(other.get(handle).images[0], original)
    again = mine.private()
    assert np.array_equal(again.images[0], original)
    del mine, image, tensor, again, shared
    gc.collect()
    reader.flush()
    writer.delete(handle)
    daemon.wait_for("the object to go", lambda s: s["objects_sealed"] == 0)


def test_stream_samples_take_in_place_ops_through_to_torch_and_stream_dataset(daemon, tmp_path):
    producer = produce(daemon, tmp_path, "writable", 8, "--shuffle", "none")
    with feedstore.Stream("writable", 8, shuffle="none", socket=daemon.socket, wait=120) as stream:
        sample = next(stream)
        before = sample.images[0].copy()
        as_torch = to_torch(sample)
        pixels, labels = as_torch["pixel_values"][0], as_torch["labels"]
        pixels += 1
        labels[labels == -100] = 0
        assert not (labels == -100).any()
        # The sample's own arrays (the store's mapping) are untouched.
        assert np.array_equal(sample.images[0], before)
        assert (sample.labels == -100).any()
        assert not sample.images[0].flags.writeable
        # A tensor straight from the sample's DLPack export is writable too, privately.
        first_token = int(sample.tokens[0])
        direct, ids = torch.from_dlpack(sample.image(0)), torch.from_dlpack(sample.tokens_tensor())
        direct += 1
        ids[0] = first_token + 1
        assert torch.equal(direct, torch.from_numpy(before) + 1)
        assert np.array_equal(sample.images[0], before) and int(sample.tokens[0]) == first_token
        # The producer ends when its readers have read the stream to its end.
        assert sum(1 for _ in stream) == 7
    finish(producer)

    producer = produce(daemon, tmp_path, "writable-ds", 8, "--shuffle", "none")
    dataset = StreamDataset("writable-ds", 8, shuffle="none", socket=daemon.socket, wait=120)
    seen = 0
    for item in tud.DataLoader(dataset, batch_size=None):
        item["pixel_values"][0].add_(1)
        item["labels"][item["labels"] == -100] = 0
        item["input_ids"][0] = 0
        seen += 1
    assert seen == 8
    finish(producer)
