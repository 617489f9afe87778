"""The Ray driver of test_ray.py, run inside node 0's network namespace: starts the daemons
through feedstore.ray, producers by placement, and Ray Train's TorchTrainer workers as ranks,
each writing what it read to OUT/rank{r}.json; then writes the nodes' stats to OUT/stats.json."""

import json
import sys
import time

import ray
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

import feedstore.ray as fray


def train_loop(config):
    import json

    import ray.train

    import feedstore.ray as fray

    rank = ray.train.get_context().get_world_rank()
    seen = []
    with fray.open_stream(
        config["stream"], config["records"], epochs=config["epochs"], wait=120
    ) as stream:
        for sample in stream:
            assert sample.images[0].shape == (64, 64, 3)
            seen.append([sample.seq, sample.record, sample.id])
        # The last sample's view (and its lease) would otherwise live as long as this worker.
        sample = None
    with open(f"{config['out']}/rank{rank}.json", "w") as f:
        json.dump({"node": ray.get_runtime_context().get_node_id(), "seen": seen}, f)


def main():
    config = json.loads(sys.argv[1])
    ray.init(address=config["address"], _node_ip_address=config["ip"])
    cluster = fray.start(capacity="256MiB", bin_dir=config["bin_dir"], args=["--prefault", "false"])
    try:
        job = fray.produce(
            cluster, config["stream"], manifest=config["manifest"], tokenizer=config["tokenizer"],
            world=config["world"], epochs=config["epochs"], placement=config["placement"],
            args=config["args"], bin_dir=config["bin_dir"],
        )
        TorchTrainer(
            train_loop,
            train_loop_config=config,
            scaling_config=ScalingConfig(
                num_workers=config["world"], resources_per_worker={"CPU": 1},
                placement_strategy="SPREAD",
            ),
            run_config=RunConfig(storage_path=config["out"] + "/results"),
        ).fit()
        producers = job.wait(timeout=300)
        # Returns are one-way messages: let the last ones land before looking (bounded).
        deadline = time.monotonic() + 30
        while True:
            stats = cluster.stats()
            idle = all(s["leases"] == 0 and s["pulls_in_flight"] == 0 for s in stats.values())
            if idle or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        with open(config["out"] + "/stats.json", "w") as f:
            json.dump({"stats": stats, "producers": producers}, f)
    finally:
        cluster.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
