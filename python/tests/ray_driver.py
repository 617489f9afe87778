"""The Ray driver of test_ray.py, run inside node 0's network namespace: starts the daemons
through feedstore.ray, producers by placement, and Ray Train's TorchTrainer workers as ranks,
each writing what it read to OUT/rank{r}.json; then writes the nodes' stats to OUT/stats.json."""

import json
import os
import signal
import sys
import threading
import time

import ray
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

import feedstore.ray as fray


def train_loop(config):
    import json
    import time

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
            time.sleep(config["pause"])
        # The last sample's view (and its lease) would otherwise live as long as this worker.
        sample = None
    with open(f"{config['out']}/rank{rank}.json", "w") as f:
        json.dump({"node": ray.get_runtime_context().get_node_id(), "seen": seen}, f)


def kill_a_producer(cluster, done):
    """Once samples flow between the nodes, kill -9 the `feedstore produce` process feeding the
    stream from the worker node (its actor's node), mid-epoch."""
    here = ray.util.get_node_ip_address() + ":"
    node_id = [n for n, a in cluster.addresses.items() if not a.startswith(here)][0]
    socket = ray.get(cluster.daemons[node_id].socket.remote())
    deadline = time.monotonic() + 120
    while sum(s["pulls"] for s in cluster.stats().values()) < 8:
        if time.monotonic() > deadline:
            done["error"] = "no samples crossed the nodes"
            return
        time.sleep(0.05)
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"produce" in argv and socket.encode() in argv:
            os.kill(int(pid), signal.SIGKILL)
            done["killed"] = f"producer {pid} on node {node_id}"
            return
    done["error"] = f"no producer process found for {socket}"


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
        killer, killed = None, {}
        if config["kill_producer"]:
            killer = threading.Thread(target=kill_a_producer, args=(cluster, killed), daemon=True)
            killer.start()
        TorchTrainer(
            train_loop,
            train_loop_config=config,
            scaling_config=ScalingConfig(
                num_workers=config["world"], resources_per_worker={"CPU": 1},
                placement_strategy="SPREAD",
            ),
            run_config=RunConfig(storage_path=config["out"] + "/results"),
        ).fit()
        producers = job.wait(timeout=300, check=not config["kill_producer"])
        if killer:
            killer.join()
        # Returns are one-way messages: let the last ones land before looking (bounded).
        deadline = time.monotonic() + 30
        while True:
            stats = cluster.stats()
            idle = all(s["leases"] == 0 and s["pulls_in_flight"] == 0 for s in stats.values())
            if idle or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        with open(config["out"] + "/stats.json", "w") as f:
            json.dump({"stats": stats, "producers": producers, "killed": killed}, f)
    finally:
        cluster.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
