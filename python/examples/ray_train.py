"""Ray Train ranks fed by feedstore across a Ray cluster: one daemon per node, producers spread
over the nodes, each rank reading its share zero-copy from its own node's store.

    python python/examples/ray_train.py --manifest /data/sft.jsonl --tokenizer /data/tok.json \\
        --records 10000 --workers 8 [--placement spread|colocated|relay] [--bin-dir target/release]

The manifest, its images and the tokenizer must be readable on every node (or pass S3 flags of
`feedstore produce` after `--`)."""

import argparse
import time

import ray
from ray.train import ScalingConfig
from ray.train.torch import TorchTrainer

import feedstore.ray as fray


def train_loop(config):
    import torch

    import feedstore.ray as fray

    with fray.open_stream(config["stream"], config["records"], epochs=config["epochs"]) as s:
        started, samples = time.monotonic(), 0
        for batch in iter(lambda: s.next_batch(config["batch"]), []):
            pixels = [torch.from_dlpack(sample.image(0)) for sample in batch]  # no copy
            samples += len(pixels)
        ray.train.report({"samples_per_sec": samples / (time.monotonic() - started)})


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--manifest", required=True)
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--records", type=int, required=True)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--placement", default="spread", choices=fray.PLACEMENTS)
    p.add_argument("--bin-dir")
    p.add_argument("produce_args", nargs="*", help="more `feedstore produce` flags, after --")
    a = p.parse_args()
    ray.init()
    cluster = fray.start(capacity="8GiB", bin_dir=a.bin_dir)
    try:
        job = fray.produce(cluster, "example", manifest=a.manifest, tokenizer=a.tokenizer,
                           world=a.workers, epochs=a.epochs, placement=a.placement,
                           args=a.produce_args, bin_dir=a.bin_dir)
        result = TorchTrainer(
            train_loop,
            train_loop_config={"stream": "example", "records": a.records, "epochs": a.epochs,
                               "batch": a.batch},
            scaling_config=ScalingConfig(num_workers=a.workers, placement_strategy="SPREAD"),
        ).fit()
        job.wait()
        print("rank 0:", result.metrics, "nodes:", {k[:8]: v["pulls"] for k, v in cluster.stats().items()})
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    main()
