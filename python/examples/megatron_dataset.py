"""Megatron-style use of feedstore: a dataset indexable per step.

Megatron-LM's data path asks its dataset for sample indices in order (a batch sampler walks
``consumed_samples, consumed_samples + 1, ...`` for this data-parallel rank) and checkpoints
``consumed_samples``. ``StreamIndexedDataset`` maps index ``i`` to the ``i``-th sample of this
rank's share of a feedstore stream, so a resumed job (``consumed_samples`` from its checkpoint)
continues with exactly the next sample, and every array is a zero-copy view of shared memory.

Run it against a daemon that a producer feeds, e.g.::

    feedstore produce --manifest data.jsonl --tokenizer tokenizer.json --stream megatron
    python python/examples/megatron_dataset.py --name megatron --records 1000
"""

import argparse

import feedstore


class StreamIndexedDataset:
    """Index ``i`` is this rank's ``i``-th sample. Indices must come in order (as Megatron's
    samplers give them); start anywhere with ``consumed_samples``."""

    def __init__(self, name, records, rank=0, world=1, consumed_samples=0, socket=None, **spec):
        self.name, self.records, self.rank, self.world = name, records, rank, world
        self.spec = spec
        state = feedstore.state_at(name, records, rank, consumed_samples, world, **spec)
        self.stream = feedstore.Stream(name, records, rank, world, state=state, socket=socket,
                                       **spec)
        self.next_index = consumed_samples

    def __len__(self):
        per_rank = self.records // self.world
        if self.spec.get("tail") == "pad":
            per_rank = -(-self.records // self.world)
        return per_rank * self.spec.get("epochs", 1)

    def __getitem__(self, index):
        if index != self.next_index:
            raise IndexError(f"samples are read in order: expected index {self.next_index}")
        sample = next(self.stream)
        self.next_index += 1
        return {
            "id": sample.id,
            "record": sample.record,
            "tokens": sample.tokens,        # read-only views of shared memory
            "labels": sample.labels,
            "images": sample.images,
        }


def train(socket, name, records, steps, micro_batch, consumed_samples=0):
    """A stand-in for Megatron's loop: each step reads one micro-batch by index. Returns the
    records each step read."""
    dataset = StreamIndexedDataset(name, records, consumed_samples=consumed_samples,
                                   socket=socket, shuffle="full", epochs=1)
    read = []
    index = consumed_samples
    for step in range(steps):
        batch = [dataset[i] for i in range(index, index + micro_batch)]
        index += micro_batch
        read.append([item["record"] for item in batch])
        print(f"step {step}: records {read[-1]}, "
              f"tokens per sample {[len(item['tokens']) for item in batch]}")
    return read


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", required=True, help="the stream's name")
    parser.add_argument("--records", type=int, required=True, help="records in the manifest")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--consumed-samples", type=int, default=0)
    parser.add_argument("--socket", default=None)
    args = parser.parse_args()
    train(args.socket, args.name, args.records, args.steps, args.micro_batch,
          args.consumed_samples)
