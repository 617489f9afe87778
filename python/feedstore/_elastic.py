"""A ``feedstore.torch.DataLoader`` epoch resumed at another world size.

Under data parallelism each rank's loader draws from torch's ``DistributedSampler``: the epoch's
order (a permutation seeded by ``seed + epoch``, or ``range``) padded, or cut, to a multiple of
the world size, and rank ``r`` reads the order's slots ``r, r + world, ...``. A rank's saved
state says how many batches of its slots it took. Given every rank's state, what the old ranks
left is known exactly: each rank's slots past the batches it took, in slot order, less any
sample some rank already read (a padding slot repeats a sample another rank may have taken).
That remainder is dealt to the new ranks as ``DistributedSampler`` deals an epoch, padded or
cut by the new sampler's ``drop_last`` so that every rank has as many batches (DDP steps in
lockstep), and each new rank reads its part in place of its sampler for the rest of the epoch.
The epoch after is the new world's ordinary one.

The description a resharded epoch saves is small and independent of the data set's size: the
epoch's seed and size, and for each reshard (an epoch resharded again is one more level) the old
world, its batch size and each old rank's count of batches taken. Every part of the remainder
is made again from it, with torch's own sampler for the permutation."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, List, Optional

import torch
import torch.utils.data
from torch.utils.data.distributed import DistributedSampler

if TYPE_CHECKING:
    from feedstore.loader import DataLoader

# What a state's reshard may hold: old ranks summed over its levels (each a count per rank),
# and levels (resizes within one epoch; each is one pass over the epoch's order), as streams'.
MAX_CELLS = 65536
MAX_LEVELS = 8

_BASE_KEYS = ("size", "seed", "shuffle", "epoch")
# What every old rank's sampler must agree on (the first three are the epoch's order's).
_LEVEL_KEYS = ("size", "seed", "shuffle", "drop_last", "batch", "batch_drop_last")


class _Share(torch.utils.data.Sampler):
    """A new rank's part of what the old ranks left: a fixed list, no random draws."""

    def __init__(self, indices: List[int]) -> None:
        self._indices = indices

    def __iter__(self):
        return iter(self._indices)

    def __len__(self) -> int:
        return len(self._indices)


def _sampler(loader: "DataLoader") -> Optional[DistributedSampler]:
    """The loader's DistributedSampler when it is one this module can reshard: torch's own
    (exactly that type), under torch's own BatchSampler or none."""
    batches = loader.batch_sampler
    if batches is not None and type(batches) is not torch.utils.data.BatchSampler:
        return None
    sampler = batches.sampler if batches is not None else loader.sampler
    return sampler if type(sampler) is DistributedSampler else None


def describe(loader: "DataLoader") -> Optional[dict]:
    """The epoch's draws as a reshard needs them (saved with each state), taken when the epoch
    begins; None for any other sampler."""
    sampler = _sampler(loader)
    if sampler is None or isinstance(loader.dataset, torch.utils.data.IterableDataset):
        return None
    batches = loader.batch_sampler
    return {
        "size": len(sampler.dataset),
        "seed": int(sampler.seed),
        "shuffle": bool(sampler.shuffle),
        "epoch": int(sampler.epoch),
        "world": int(sampler.num_replicas),
        "rank": int(sampler.rank),
        "drop_last": bool(sampler.drop_last),
        "batch": int(batches.batch_size) if batches is not None else 1,
        "batch_drop_last": bool(batches.drop_last) if batches is not None else False,
    }


def _cannot(why: str) -> ValueError:
    return ValueError(f"cannot resume this DataLoader at another world size: {why}")


def _int(value: Any, what: str, low: int = 0) -> int:
    if type(value) is not int or value < low:
        raise _cannot(f"{what} is {value!r}, not an integer of at least {low}")
    return value


def _checked_levels(reshard: Any) -> list:
    """A saved reshard's levels, their types and sizes checked (it comes from a checkpoint)."""
    if not isinstance(reshard, dict) or not isinstance(reshard.get("levels"), list):
        raise _cannot(f"the state's reshard is {reshard!r}")
    base = reshard.get("base")
    if not isinstance(base, dict) or set(base) != set(_BASE_KEYS):
        raise _cannot(f"the state's reshard has no epoch it resumes ({base!r})")
    for key in ("size", "seed", "epoch"):
        _int(base[key], f"the reshard's {key}")
    if len(reshard["levels"]) > MAX_LEVELS:
        raise _cannot(
            f"the epoch was resized more than {MAX_LEVELS} times: resume at the same number "
            "of ranks until it ends, then resize"
        )
    cells = 0
    for level in reshard["levels"]:
        if not isinstance(level, dict) or not isinstance(level.get("tasks"), list):
            raise _cannot(f"a level of the state's reshard is {level!r}")
        world = _int(level.get("world"), "an old world size", 1)
        if len(level["tasks"]) != world:
            raise _cannot(f"a level of world {world} has {len(level['tasks'])} ranks' counts")
        _int(level.get("batch"), "a batch size", 1)
        if type(level.get("drop_last")) is not bool or type(level.get("batch_drop_last")) is not bool:
            raise _cannot(f"a level of the state's reshard is {level!r}")
        for taken in level["tasks"]:
            _int(taken, "a count of batches")
        cells += world
        if cells > MAX_CELLS:
            raise _cannot(f"its reshards hold more than {MAX_CELLS} old ranks")
    return reshard["levels"]


def _deal(order: torch.Tensor, world: int, drop_last: bool) -> torch.Tensor:
    """`order` as DistributedSampler deals it: padded with its start (or cut, with
    `drop_last`) to a multiple of `world`, one row per round, rank r's slots in column r."""
    n = len(order)
    if drop_last and n % world:
        per_rank = math.ceil((n - world) / world)
    else:
        per_rank = math.ceil(n / world)
    total = per_rank * world
    if total > n:
        order = torch.cat([order, order.repeat(math.ceil((total - n) / n))[: total - n]])
    return order[:total].view(per_rank, world)


def _first_order(base: dict) -> torch.Tensor:
    """The epoch's order as torch's DistributedSampler draws it (its own code: one rank of a
    world of one is the whole permutation, before padding)."""
    whole = DistributedSampler(
        range(base["size"]), num_replicas=1, rank=0, shuffle=base["shuffle"], seed=base["seed"]
    )
    whole.set_epoch(base["epoch"])
    return torch.tensor(list(whole), dtype=torch.int64)


def _left(order: torch.Tensor, level: dict) -> torch.Tensor:
    """What the ranks of `level` left of `order`: each rank's slots past the batches it took
    (and, with the batch sampler's `drop_last`, before the slots no batch of its would read),
    in slot order, without the samples some rank read and without repeats."""
    grid = _deal(order, level["world"], level["drop_last"])
    rounds = grid.shape[0]
    batch = level["batch"]
    readable = rounds - rounds % batch if level["batch_drop_last"] else rounds
    # (In Python's integers first: a forged batch size cannot overflow.)
    taken = torch.tensor([min(t * batch, readable) for t in level["tasks"]], dtype=torch.int64)
    slot = torch.arange(rounds, dtype=torch.int64).unsqueeze(1)
    left = grid[(slot >= taken) & (slot < readable)]  # (row-major: slot order)
    read = grid[slot < taken]
    if len(read):
        left = left[~torch.isin(left, read)]
    if len(torch.unique(left)) != len(left):
        # Padding repeats samples (never more than a world's worth): the first of each stays.
        seen: set = set()
        kept = [i for i in left.tolist() if not (i in seen or seen.add(i))]
        left = torch.tensor(kept, dtype=torch.int64)
    return left


def _check_torchs_deal(order: torch.Tensor, base: dict, level: dict) -> None:
    """`_deal` gives rank 0 of the first level what torch's DistributedSampler gives it (a
    torch that dealt otherwise would resume the wrong samples: refused, not guessed)."""
    sampler = DistributedSampler(
        range(base["size"]), num_replicas=level["world"], rank=0, shuffle=base["shuffle"],
        seed=base["seed"], drop_last=level["drop_last"],
    )
    sampler.set_epoch(base["epoch"])
    if list(sampler) != _deal(order, level["world"], level["drop_last"])[:, 0].tolist():
        raise _cannot(
            f"torch {torch.__version__}'s DistributedSampler deals an epoch other than "
            "feedstore knows; report it"
        )


def share(reshard: Any, loader: "DataLoader") -> torch.utils.data.Sampler:
    """The loader's part of a resharded epoch: its indices (or batches of them, as the loader's
    batch sampler makes them), drawn in place of its sampler for the rest of the epoch."""
    levels = _checked_levels(reshard)
    base = reshard["base"]
    now = describe(loader)
    if now is None:
        raise _cannot(
            "the state resumes a DistributedSampler's epoch, and this loader has another sampler"
        )
    differ = [key for key in _BASE_KEYS if now[key] != base[key]]
    if differ:
        saved = ", ".join(f"{key}={base[key]!r}" for key in differ)
        ours = ", ".join(f"{key}={now[key]!r}" for key in differ)
        fix = (
            f"call sampler.set_epoch({base['epoch']}) before iterating"
            if differ == ["epoch"]
            else "the dataset, seed and shuffle must be the old run's"
        )
        raise ValueError(
            f"the state resumes the epoch of a DistributedSampler with {saved}; this loader's "
            f"has {ours} ({fix})"
        )
    order = _first_order(base)
    if levels:
        _check_torchs_deal(order, base, levels[0])
    for level in levels:
        order = _left(order, level)
    indices = _deal(order, now["world"], now["drop_last"])[:, now["rank"]].tolist()
    batches = loader.batch_sampler
    if batches is None:
        return _Share(indices)
    return torch.utils.data.BatchSampler(_Share(indices), batches.batch_size, batches.drop_last)


def _info(state: Any) -> dict:
    """A saved state's sampler description, its types checked (it comes from a checkpoint)."""
    info = state.get("sampler") if isinstance(state, dict) else None
    if not isinstance(info, dict):
        raise _cannot(
            "a state has no DistributedSampler epoch (saved by a feedstore before 0.2.0, or "
            "by a loader with another sampler)"
        )
    for key in ("size", "seed", "epoch", "rank"):
        _int(info.get(key), f"the saved sampler's {key}")
    _int(info.get("world"), "the saved sampler's world", 1)
    _int(info.get("batch"), "the saved batch size", 1)
    for key in ("shuffle", "drop_last", "batch_drop_last"):
        if type(info.get(key)) is not bool:
            raise _cannot(f"the saved sampler's {key} is {info.get(key)!r}")
    return info


def plan(states: list, loader: "DataLoader") -> Optional[dict]:
    """The state that resumes `loader`'s rank from every old rank's `state_dict()` (a list, in
    any order): the rank's own when the world is the same, else a resharded epoch; None when
    the old ranks left nothing of their epoch (the next starts afresh)."""
    now = describe(loader)
    if now is None:
        raise _cannot(
            "the loader's sampler is not torch's DistributedSampler (under torch's BatchSampler), "
            "whose order across ranks feedstore knows"
        )
    by_rank: dict = {}
    for state in states:
        rank = _info(state)["rank"]
        if rank in by_rank:
            raise _cannot(f"two states are rank {rank}'s")
        by_rank[rank] = state
    world = len(by_rank)
    if world == 0 or world > MAX_CELLS:
        raise _cannot(f"{world} states given")
    worlds = sorted({s["sampler"]["world"] for s in by_rank.values()})
    missing = [r for r in range(world) if r not in by_rank]
    if missing or worlds != [world]:
        raise _cannot(
            f"pass every old rank's state: the states say world {worlds[0]}"
            + (f" (and {worlds[1:]})" if len(worlds) > 1 else "")
            + (f", and rank {missing[0]}'s is missing" if missing else f", {world} given")
        )
    ordered = [by_rank[r] for r in range(world)]
    if world == now["world"]:
        return ordered[now["rank"]]  # the same world: the rank's own state
    first = ordered[0]["sampler"]
    for state in ordered:
        if any(state["sampler"][key] != first[key] for key in _LEVEL_KEYS):
            raise _cannot(
                "the states are of samplers of different data sets, seeds or batches: "
                f"{first} and {state['sampler']}"
            )
    unfinished = [s["sampler"]["epoch"] for s in ordered if not s.get("finished")]
    if not unfinished:
        return None  # every old rank at its epoch's end: the next starts afresh
    epoch = max(unfinished)
    taken: list = []
    reshards: list = []
    for state in ordered:
        at = state["sampler"]["epoch"]
        if at == epoch - 1 and state.get("finished"):
            taken.append(0)  # done with the epoch before: at this one's start
            reshards.append(None)
        elif at == epoch:
            taken.append(_int(state.get("tasks"), "a count of batches"))
            reshards.append(state.get("reshard"))
        else:
            raise _cannot(
                f"the states are of epochs {at} and {epoch}: save every rank's state in the same "
                "epoch (ranks may stand at different batches of it)"
            )
    if any(reshard != reshards[0] for reshard in reshards):
        raise _cannot("the states are of different runs (their epoch was resharded otherwise)")
    if reshards[0] is None and not any(taken):
        return None  # every old rank at the epoch's start: the new world's ordinary epoch
    base = {key: first[key] for key in _BASE_KEYS}
    base["epoch"] = epoch
    levels = []
    if reshards[0] is not None:
        levels = list(_checked_levels(reshards[0]))
        if reshards[0]["base"] != base:
            raise _cannot("the states' reshard is of another epoch than theirs")
    if any(taken):
        # (A run that read nothing of its share adds no level: its deal's padding or cut
        # would only change what is left.)
        level = {key: first[key] for key in ("world", *_LEVEL_KEYS[3:])}
        levels.append(dict(level, tasks=taken))
    reshard = {"base": base, "levels": levels}
    _checked_levels(reshard)
    return {
        "tasks": 0,
        "batches": 0,
        "finished": False,
        "rng": None,
        "reshard": reshard,
        # What this rank's sampler draws in that epoch: a state saved before the first batch
        # is placed (and resharded again) by it.
        "sampler": dict(now, epoch=epoch),
    }
