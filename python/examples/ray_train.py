"""Ray Train ranks fed by feedstore across a Ray cluster: one daemon per node, producers spread
over the nodes, each rank reading its share zero-copy from its own node's store.

    python python/examples/ray_train.py --manifest /data/sft.jsonl --tokenizer /data/tok.json \\
        --records 10000 --workers 8 [--placement spread|colocated|relay] [--bin-dir target/release]

With `--resize-to N --stop-after K`, the run stops after K batches per rank (each rank's stream
state in a Ray Train checkpoint, as a preempted job's would be) and resumes from that checkpoint
with N workers: the producers and the ranks reshard the saved states, so that every sample the
first run left is read once, by the N ranks.

The manifest, its images and the tokenizer must be readable on every node (or pass S3 flags of
`feedstore produce` after `--`)."""

import argparse
import json
import os
import tempfile
import time

import ray
from ray.train import Checkpoint, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

import feedstore.ray as fray


def saved_states(checkpoint):
    """Every stream rank's state in a checkpoint the ranks reported to: {stream rank: state}."""
    states = {}
    if checkpoint:
        with checkpoint.as_directory() as d:
            for name in os.listdir(d):
                if name.startswith("stream-rank"):
                    with open(os.path.join(d, name)) as f:
                        saved = json.load(f)
                    states[saved["rank"]] = saved["state"]
    return states


def train_loop(config):
    import torch

    import feedstore.ray as fray

    # From this run's checkpoint after a restart, or the one it resumes (of a run with as many
    # workers or another number: open_stream reshards the states when their count differs).
    states = saved_states(ray.train.get_checkpoint() or config["resume"])
    with fray.open_stream(config["stream"], config["records"], epochs=config["epochs"],
                          state=states) as s:
        started, samples, batches = time.monotonic(), 0, 0
        for batch in iter(lambda: s.next_batch(config["batch"]), []):
            pixels = [torch.from_dlpack(sample.image(0)) for sample in batch]  # no copy
            samples, batches = samples + len(pixels), batches + 1
            if batches == config["stop_after"]:
                break
        metrics = {"samples_per_sec": samples / (time.monotonic() - started), "samples": samples}
        with tempfile.TemporaryDirectory() as d:
            with open(os.path.join(d, f"stream-rank{s.rank}.json"), "w") as f:
                json.dump({"rank": s.rank, "state": s.state()}, f)
            ray.train.report(metrics, checkpoint=Checkpoint.from_directory(d))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--manifest", required=True)
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--records", type=int, required=True)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--placement", default="spread", choices=fray.PLACEMENTS)
    p.add_argument("--resize-to", type=int, help="resume the run with this many workers")
    p.add_argument("--stop-after", type=int, default=0,
                   help="batches per rank before the run stops (with --resize-to)")
    p.add_argument("--bin-dir")
    p.add_argument("produce_args", nargs="*", help="more `feedstore produce` flags, after --")
    a = p.parse_args()
    ray.init()
    cluster = fray.start(capacity="8GiB", bin_dir=a.bin_dir)
    storage = tempfile.mkdtemp(prefix="feedstore-ray-example-")

    def run(workers, stop_after, checkpoint=None):
        states = saved_states(checkpoint)
        job = fray.produce(cluster, "example", manifest=a.manifest, tokenizer=a.tokenizer,
                           world=workers, epochs=a.epochs, placement=a.placement,
                           args=a.produce_args, bin_dir=a.bin_dir,
                           states=[states[r] for r in sorted(states)] or None)
        result = TorchTrainer(
            train_loop,
            train_loop_config={"stream": "example", "records": a.records, "epochs": a.epochs,
                               "batch": a.batch, "stop_after": stop_after,
                               "resume": checkpoint},
            scaling_config=ScalingConfig(num_workers=workers, placement_strategy="SPREAD"),
            run_config=RunConfig(storage_path=storage),
        ).fit()
        if stop_after:
            job.stop()  # a run stopped early leaves its producers waiting for ranks gone
        else:
            job.wait()
        print(f"{workers} workers, rank 0:", result.metrics,
              "nodes:", {k[:8]: v["pulls"] for k, v in cluster.stats().items()})
        return result

    try:
        if a.resize_to:
            first = run(a.workers, a.stop_after)
            run(a.resize_to, 0, first.checkpoint)
        else:
            run(a.workers, 0)
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    main()
