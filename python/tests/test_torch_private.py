"""The pieces of torch's private API feedstore uses (feedstore/_torch_private.py), checked on the
torch this runs with: CI runs the suite on Debian's torch 1.13 and PyPI's current one."""

import subprocess
import sys
import textwrap

import torch
import torch.utils.data as tud

from feedstore import _torch_private as private

# torch's numpy seeds for (base seed, worker id), as torch 1.13 and 2.15 compute them: the
# reimplementation must give these whether or not this torch still has its private function.
NUMPY_SEEDS = {
    (0, 0): [2968811710, 3677149159, 745650761, 2884920346],
    (1, 3): [457190280, 2660306227, 859341110, 354512857],
    (2**63 - 1, 7): [3706660862, 1642455348, 3333652763, 3068748488],
    (123456789012345, 2): [2489945240, 1229698660, 1198667051, 1606050886],
}


def test_numpy_seed_is_torchs():
    for (base, worker), seed in NUMPY_SEEDS.items():
        assert private.numpy_seed(base, worker) == seed
    generate = getattr(tud._utils.worker, "_generate_state", None)
    if generate is not None:
        generator = torch.Generator().manual_seed(5)
        for worker in range(8):
            base = torch.empty((), dtype=torch.int64).random_(generator=generator).item()
            assert private.numpy_seed(base, worker) == generate(base, worker)


def test_worker_info_set_here_is_what_get_worker_info_returns():
    # In a process of its own: the global would outlive the test here.
    code = textwrap.dedent(
        """
        import torch.utils.data as tud
        from feedstore import _torch_private as private
        assert tud.get_worker_info() is None
        info = private.WorkerInfo(id=2, num_workers=4, seed=11, dataset=[1, 2])
        private.set_worker_info(info)
        got = tud.get_worker_info()
        assert got is info and private.worker_info() is info, got
        assert (got.id, got.num_workers, got.seed, got.dataset) == (2, 4, 11, [1, 2])
        private.set_worker_info(None)
        assert tud.get_worker_info() is None
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_collate_with_a_rule_table_is_default_collates():
    samples = [{"x": torch.tensor([i, i + 1]), "y": i, "s": "a"} for i in range(3)]
    calls = []

    def stack(batch, *, collate_fn_map=None):
        calls.append(len(batch))
        return torch.stack(batch, 0)

    table = dict(private.default_collate_fn_map)
    table[torch.Tensor] = stack
    mine = private.collate(samples, collate_fn_map=table)
    theirs = tud.default_collate(samples)
    assert calls == [3]
    assert torch.equal(mine["x"], theirs["x"]) and torch.equal(mine["y"], theirs["y"])
    assert mine["s"] == theirs["s"] == ["a", "a", "a"]
    import numpy as np

    assert private.default_collate_fn_map[np.ndarray] is private.collate_numpy_array_fn


def test_profiler_enabled_while_a_profiler_records():
    assert not private.profiler_enabled()
    with torch.autograd.profiler.profile():
        assert private.profiler_enabled()
    assert not private.profiler_enabled()


def test_iterable_len_called_is_the_datasets_length_once_len_was_asked():
    class Counted(tud.IterableDataset):
        def __iter__(self):
            return iter(range(10))

        def __len__(self):
            return 10

    loader = tud.DataLoader(Counted(), batch_size=4)
    assert private.iterable_len_called(loader) is None
    assert len(loader) == 3
    assert private.iterable_len_called(loader) == 10  # (torch keeps the dataset's length)
