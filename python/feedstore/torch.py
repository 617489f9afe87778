"""feedstore as a PyTorch data source.

``StreamDataset`` is an ``IterableDataset`` over this rank's share of a feedstore stream. Its
samples are torch tensors over the store's shared memory (``torch.from_dlpack``; no copy):

    from feedstore.torch import StreamDataset, collate

    dataset = StreamDataset("sft", records=n, epochs=3)      # rank/world from torch.distributed
    loader = dataset.loader(batch_size=8)                     # a DataLoader that tracks state
    for batch in loader:
        model(batch["pixel_values"], batch["input_ids"])
        checkpoint["data"] = dataset.state_dict()             # exact resume
    ...
    dataset.load_state_dict(checkpoint["data"])               # continues with the next sample
    dataset.load_state_dict(every_ranks_checkpoint_data)      # ... at another world size

Producers run in their own processes, so ``num_workers=0`` is the natural setting: a worker
process would only add a copy (tensors crossing from a worker are moved into torch's own shared
memory). With ``num_workers=W`` each worker reads its own sub-share: the stream has
``world * W`` ranks (``stream_world``), worker ``w`` of rank ``r`` reading rank ``r * W + w``,
and producers must feed that many ranks.

Tensors from the store are as writable as torch's own: they lie in a copy-on-write mapping of
the reader's own over the store's pages (``Sample.private()``), so reading copies nothing and an
in-place op copies only the pages it touches, which no other reader sees.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional

import torch
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import IterableDataset, get_worker_info

import feedstore
from feedstore import _batch
from feedstore.loader import DataLoader

__all__ = ["DataLoader", "StreamDataset", "collate", "to_torch", "rank_and_world"]


def rank_and_world() -> tuple[int, int]:
    """This process's data-parallel rank and world size: from ``torch.distributed`` when it is
    initialised, else from ``RANK`` / ``WORLD_SIZE``, else (0, 1)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def to_torch(
    sample: feedstore.Sample,
    trusted_uids: Iterable[int] = (),
    batch_classes: Iterable[type] = (),
) -> Any:
    """A sample as a dict of torch tensors over shared memory (no copy):

    ``pixel_values``: list of image tensors; ``input_ids`` and ``labels``: int32;
    ``image_grid_thw``: int64 (n_images, 3); plus ``id``, ``seq`` and ``record``.

    The tensors are as writable as torch's own: they lie in a copy-on-write mapping of this
    process's (``Sample.private()``), so an in-place op copies the pages it touches and changes
    nothing another reader, a later epoch or the decode-once cache sees.

    An object written from a Python structure (``feedstore.ray.write_stream``, a
    ``feedstore.torch.DataLoader`` batch) comes back as that structure, its tensors and arrays
    views of shared memory, if root, this process's uid or one of ``trusted_uids`` wrote it
    (``feedstore.UntrustedBatch`` otherwise); objects of classes besides the builtins only if
    listed in ``batch_classes`` (see ``feedstore._batch``). Nothing in the object is unpickled.
    """
    if not sample.writable:
        sample = sample.private()
    if not sample.is_sample and _batch.is_batch(sample):
        return _batch.read(sample, classes=batch_classes, trusted_uids=trusted_uids)
    images = [torch.from_dlpack(sample.image(i)) for i in range(sample.image_count)]
    return {
        "pixel_values": images,
        "input_ids": torch.from_dlpack(sample.tokens_tensor()),
        "labels": torch.from_dlpack(sample.labels_tensor()),
        "image_grid_thw": torch.tensor(sample.image_grid_thw, dtype=torch.int64).reshape(-1, 3),
        "id": sample.id,
        "seq": sample.seq,
        "record": sample.record,
    }


def collate(items: List[Dict[str, Any]], pad_id: int = 0) -> Dict[str, Any]:
    """Batches ``to_torch`` dicts. Images are stacked into one tensor when every sample has one
    image of one shape (a copy, as any stacking is), else kept as a flat list of zero-copy
    tensors in sample order; token ids are padded with ``pad_id`` (labels with -100) and an
    ``attention_mask`` is added; ``seq`` / ``rank`` say where each sample stood in its stream."""
    images = [img for item in items for img in item["pixel_values"]]
    one_each = all(len(item["pixel_values"]) == 1 for item in items)
    if images and one_each and all(img.shape == images[0].shape for img in images):
        pixel_values: Any = torch.stack(images)
    else:
        pixel_values = images
    longest = max((len(item["input_ids"]) for item in items), default=0)
    input_ids = torch.full((len(items), longest), pad_id, dtype=torch.int64)
    labels = torch.full((len(items), longest), -100, dtype=torch.int64)
    attention_mask = torch.zeros((len(items), longest), dtype=torch.int64)
    for i, item in enumerate(items):
        n = len(item["input_ids"])
        input_ids[i, :n] = item["input_ids"]
        labels[i, :n] = item["labels"]
        attention_mask[i, :n] = 1
    return {
        "pixel_values": pixel_values,
        "input_ids": input_ids,
        "labels": labels,
        "attention_mask": attention_mask,
        "image_grid_thw": torch.cat([item["image_grid_thw"] for item in items]),
        "id": [item["id"] for item in items],
        "seq": torch.tensor([item["seq"] for item in items], dtype=torch.int64),
        "rank": torch.tensor([item["rank"] for item in items], dtype=torch.int64),
    }


class StreamDataset(IterableDataset):
    """This rank's share of a feedstore stream, as an ``IterableDataset``.

    The spec arguments (``name``, ``records``, ``seed``, ``shuffle``, ``tail``, ``epochs``) must
    match the producers'. ``rank`` / ``world`` default to ``rank_and_world()``; ``num_workers``
    is the DataLoader's (the stream then has ``world * max(1, num_workers)`` ranks).
    ``transform`` maps each ``to_torch`` dict before it is yielded. ``trusted_uids`` and
    ``batch_classes``: see ``to_torch`` (for streams of batch objects).
    """

    def __init__(
        self,
        name: str,
        records: int,
        *,
        rank: Optional[int] = None,
        world: Optional[int] = None,
        num_workers: int = 0,
        seed: int = 0,
        shuffle: str = "full",
        tail: str = "drop",
        epochs: Optional[int] = 1,
        socket: Optional[str] = None,
        depth: Optional[int] = None,
        wait: float = 300.0,
        transform: Optional[Callable[[Dict[str, Any]], Any]] = None,
        trusted_uids: Iterable[int] = (),
        batch_classes: Iterable[type] = (),
    ) -> None:
        super().__init__()
        default_rank, default_world = rank_and_world()
        self.rank = default_rank if rank is None else rank
        self.world = default_world if world is None else world
        self.num_workers = num_workers
        self.spec = dict(seed=seed, shuffle=shuffle, tail=tail, epochs=epochs)
        self.name, self.records = name, records
        if depth is not None:
            import warnings

            warnings.warn(
                "StreamDataset(depth=) is ignored: the prefetch depth is the stream's, set by its "
                "producer",
                DeprecationWarning,
                stacklevel=2,
            )
        self.socket, self.wait = socket, wait
        self.transform = transform
        self.trusted_uids = tuple(trusted_uids)
        self.batch_classes = tuple(batch_classes)
        # Per stream rank: samples consumed (the next sequence number), as the trainer saw them.
        self._consumed: Dict[int, int] = {}
        # Batches the trainer consumed through worker processes (see `_stream_rank`).
        self._batches = 0
        # A run resumed at another world size: where each of its stream ranks starts, as
        # `feedstore.reshard` said (state texts carrying what the old run left).
        self._starts: Dict[int, str] = {}

    @property
    def workers(self) -> int:
        return max(1, self.num_workers)

    @property
    def stream_world(self) -> int:
        """Ranks of the underlying stream: what producers must feed (``--world``)."""
        return self.world * self.workers

    def stream_ranks(self) -> List[int]:
        """The stream ranks this trainer rank reads (one per DataLoader worker)."""
        return [self.rank * self.workers + w for w in range(self.workers)]

    def _stream_rank(self) -> int:
        info = get_worker_info()
        if info is None:
            if self.num_workers:
                raise feedstore.InvalidArgument(
                    f"dataset made for num_workers={self.num_workers} iterated without workers"
                )
            return self.rank
        if info.num_workers != self.workers:
            raise feedstore.InvalidArgument(
                f"DataLoader has {info.num_workers} workers, the dataset was made for "
                f"num_workers={self.num_workers}"
            )
        # The DataLoader takes batch i from worker i mod W, starting with worker 0 each time it
        # is iterated. After n batches, the next is due from sub-share n mod W: rotate, so a
        # resumed loader hands out batches in exactly the order an uninterrupted one would.
        return self.rank * self.workers + (info.id + self._batches) % self.workers

    def _state(self, stream_rank: int) -> Optional[str]:
        seq = self._consumed.get(stream_rank)
        start = self._starts.get(stream_rank)
        if seq is None:
            return start
        return feedstore.state_at(
            self.name,
            self.records,
            stream_rank,
            seq,
            self.stream_world,
            resumed=start,
            **self.spec,
        )

    def open(self, stream_rank: int) -> feedstore.Stream:
        """Opens one stream rank where this dataset's state says it stands."""
        return feedstore.Stream(
            self.name,
            self.records,
            stream_rank,
            self.stream_world,
            state=self._state(stream_rank),
            socket=self.socket,
            wait=self.wait,
            **self.spec,
        )

    def __iter__(self) -> Iterator[Any]:
        stream_rank = self._stream_rank()
        with self.open(stream_rank) as stream:
            for sample in stream:
                seq, is_sample = sample.seq, sample.is_sample
                item = to_torch(sample, self.trusted_uids, self.batch_classes)
                if is_sample:
                    item["rank"] = stream_rank
                del sample  # the tensors keep it leased for as long as they live
                self._consumed[stream_rank] = seq + 1
                yield self.transform(item) if self.transform else item

    def observe(self, batch: Dict[str, Any]) -> None:
        """Records that the trainer consumed ``batch`` (a ``collate`` result): needed with
        worker processes, whose iteration the dataset in this process cannot see.
        ``loader()`` calls it for you."""
        for rank, seq in zip(batch["rank"].tolist(), batch["seq"].tolist()):
            self._consumed[rank] = max(self._consumed.get(rank, 0), seq + 1)
        self._batches += 1

    def state_dict(self) -> Dict[str, Any]:
        """Where each stream rank stands: the samples consumed so far, and every stream rank's
        state text of this trainer rank (``states``: what ``feedstore.reshard`` and
        ``feedstore produce --resume`` take; a rank that read nothing stands at its start)."""
        states = {}
        for r in self.stream_ranks():
            states[r] = self._state(r) or feedstore.state_at(
                self.name, self.records, r, 0, self.stream_world, **self.spec
            )
        return {
            "name": self.name,
            "stream_world": self.stream_world,
            "consumed": dict(self._consumed),
            "batches": self._batches,
            "states": states,
        }

    def load_state_dict(self, state: Any) -> None:
        """Resumes from ``state_dict()``: the next iteration continues with exactly the next
        sample of every stream rank.

        To resume at another world size (or another ``num_workers``), pass the list of every
        trainer rank's ``state_dict()`` from the old run: the stream ranks are resharded
        (``feedstore.reshard``), so that across the new ranks every sample the old run left of
        the epochs it had begun is read once. Its producers resume from the same states
        (``feedstore produce --resume`` with every ``states`` text, one per line, or
        ``Writer(states=feedstore.reshard(...))``). Passing the list at the same world
        resumes as passing this rank's own state does."""
        if isinstance(state, (list, tuple)):
            self._load_every_rank(list(state))
            return
        if state["name"] != self.name or state["stream_world"] != self.stream_world:
            raise feedstore.StreamMismatch(
                f"state of stream {state['name']!r} with {state['stream_world']} ranks, "
                f"not {self.name!r} with {self.stream_world} (to resume at another world "
                "size, pass every rank's state_dict() as a list)"
            )
        self._consumed = {int(k): int(v) for k, v in state["consumed"].items()}
        self._batches = int(state.get("batches", 0))
        # Where each rank stood (a resharded run's states carry its reshard, which the states
        # of later samples keep).
        self._starts = {int(r): s for r, s in state.get("states", {}).items()}

    def _load_every_rank(self, states: List[Dict[str, Any]]) -> None:
        """``load_state_dict`` from every old trainer rank's state: resharded when the stream
        had another number of ranks."""
        if not states:
            raise feedstore.InvalidArgument("no states: pass every old rank's state_dict()")
        worlds = {s["stream_world"] for s in states}
        names = {s["name"] for s in states}
        if names != {self.name} or len(worlds) != 1:
            raise feedstore.StreamMismatch(
                f"states of streams {sorted(names)} with {sorted(worlds)} ranks: pass every rank's "
                f"state_dict() of one run of stream {self.name!r}"
            )
        old_world = worlds.pop()
        if old_world == self.stream_world:
            # This rank's own state_dict says all (its batch count included).
            mine = set(self.stream_ranks())
            own = [s for s in states if {int(r) for r in s.get("states", s["consumed"])} == mine]
            if own:
                self.load_state_dict(own[0])
                return
        texts: Dict[int, str] = {}
        for s in states:
            texts.update({int(r): t for r, t in s.get("states", {}).items()})
            # (A state_dict from before states were saved says only what was consumed.)
            for r, seq in s["consumed"].items():
                if int(r) not in texts:
                    texts[int(r)] = feedstore.state_at(
                        self.name, self.records, int(r), int(seq), old_world, **self.spec
                    )
        missing = [r for r in range(old_world) if r not in texts]
        if missing:
            raise feedstore.InvalidArgument(
                f"no state for stream rank {missing[0]} of the {old_world}: pass every trainer "
                "rank's state_dict() (each saves its own)"
            )
        ordered = [texts[r] for r in range(old_world)]
        if old_world != self.stream_world:
            ordered = feedstore.reshard(
                ordered, self.stream_world, name=self.name, records=self.records, **self.spec
            )
        self._consumed = {}
        self._batches = 0
        self._starts = {r: ordered[r] for r in self.stream_ranks()}

    def loader(self, batch_size: int, **kwargs: Any) -> "_TrackingLoader":
        """A ``DataLoader`` over this dataset with ``collate`` and ``num_workers`` set, which
        records each batch it hands out (so ``state_dict()`` is exact with workers too)."""
        kwargs.setdefault("collate_fn", collate)
        loader = TorchDataLoader(
            self, batch_size=batch_size, num_workers=self.num_workers, **kwargs
        )
        return _TrackingLoader(self, loader)


class _TrackingLoader:
    """Iterates a DataLoader and records every batch as consumed by the trainer."""

    def __init__(self, dataset: StreamDataset, loader: TorchDataLoader) -> None:
        self.dataset, self.loader = dataset, loader

    def __iter__(self) -> Iterator[Dict[str, Any]]:
        for batch in self.loader:
            self.dataset.observe(batch)
            yield batch
