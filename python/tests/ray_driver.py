"""The Ray driver of test_ray.py, run inside node 0's network namespace: starts the daemons
through feedstore.ray, producers by placement, and Ray Train's TorchTrainer workers (or, to move
ranks between nodes, plain actors) as ranks, each writing what its stream rank read to
OUT/rank{r}.json; then writes the nodes' stats to OUT/stats.json."""

import json
import os
import signal
import sys
import threading
import time

import ray
from ray.train import FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

import feedstore.ray as fray


def train_loop(config):
    import json
    import os
    import signal
    import tempfile
    import time

    import ray.train

    import feedstore.ray as fray

    # Resume from the last checkpoint (after a worker was killed): every stream rank's state and
    # what it read up to it, saved together, as a trainer saves them with its model. A restarted
    # worker may read another stream rank than before (one of its node's), so all are loaded.
    states, seens = {}, {}
    checkpoint = ray.train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as d:
            for name in os.listdir(d):
                if name.startswith("rank"):
                    with open(os.path.join(d, name)) as f:
                        saved = json.load(f)
                    states[saved["rank"]], seens[saved["rank"]] = saved["state"], saved["seen"]
    with fray.open_stream(
        config["stream"], config["records"], epochs=config["epochs"], wait=120, state=states
    ) as stream:
        rank = stream.rank
        seen = seens.get(rank, [])
        for sample in stream:
            assert sample.images[0].shape == (64, 64, 3)
            seen.append([sample.seq, sample.record, sample.id])
            time.sleep(config["pause"])
            # The rank kill: in the first attempt, world rank 1 kill -9s its own process mid-epoch
            # (after two checkpoints), wherever the scheduler's timing is; Ray Train restarts the
            # group from the last checkpoint.
            if (config["kill_rank"] and not checkpoint and len(seen) == 10
                    and ray.train.get_context().get_world_rank() == 1):
                os.kill(os.getpid(), signal.SIGKILL)
            if config["checkpoint_every"] and len(seen) % config["checkpoint_every"] == 0:
                with tempfile.TemporaryDirectory() as d:
                    with open(os.path.join(d, f"rank{rank}.json"), "w") as f:
                        json.dump({"rank": rank, "state": stream.state(), "seen": seen}, f)
                    ray.train.report(
                        {"read": len(seen)}, checkpoint=ray.train.Checkpoint.from_directory(d)
                    )
        # The last sample's view (and its lease) would otherwise live as long as this worker.
        sample = None
    context = ray.train.get_context()
    with open(f"{config['out']}/rank{rank}.json", "w") as f:
        json.dump({
            "node": ray.get_runtime_context().get_node_id(), "seen": seen,
            "world_rank": context.get_world_rank(), "resumed": bool(checkpoint),
        }, f)


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


@ray.remote(num_cpus=1)
class Reader:
    """A rank as a plain Ray actor pinned to a node (for moving world ranks between nodes, which
    Ray Train's placement does not let a test choose)."""

    def read(self, config, rank, states, count):
        """Reads up to `count` samples (None: to the end); returns the stream rank it got, what
        it read and, when it stopped early, its state, leaving the stream open (the actor is
        then killed, as a crashed worker would be)."""
        stream = fray.open_stream(config["stream"], config["records"], rank=rank,
                                  world=config["world"], epochs=config["epochs"], wait=120,
                                  state=states)
        self.stream, seen = stream, []
        while count is None or len(seen) < count:
            sample = next(stream, None)
            if sample is None:
                break
            seen.append([sample.seq, sample.record, sample.id])
        if count is not None and len(seen) == count:
            return {"rank": stream.rank, "seen": seen, "state": stream.state(),
                    "node": ray.get_runtime_context().get_node_id()}
        sample = None
        stream.close()
        return {"rank": stream.rank, "seen": seen,
                "node": ray.get_runtime_context().get_node_id()}


def move_ranks(cluster, config, killed):
    """World ranks 0-1 read on node 0 and 2-3 on node 1 until a few samples in, are killed, and
    restart from their states with the nodes swapped: each must resume a stream rank of its new
    node (its stream rank then differs from its world rank), and each stream rank must read on
    from where it stopped."""
    nodes = sorted(cluster.addresses, key=lambda n: cluster.addresses[n])
    half = config["world"] // 2

    def readers(order):
        return [Reader.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
            order[rank // half], soft=False)).remote() for rank in range(config["world"])]

    first = readers(nodes)
    before = ray.get([a.read.remote(config, r, None, 3) for r, a in enumerate(first)])
    for actor in first:
        ray.kill(actor)
    killed["killed"] = f"{len(first)} reader actors"
    states = {b["rank"]: b["state"] for b in before}
    second = readers(nodes[::-1])
    after = ray.get([a.read.remote(config, r, states, None) for r, a in enumerate(second)])
    for world_rank, a in enumerate(after):
        b = next(b for b in before if b["rank"] == a["rank"])
        with open(f"{config['out']}/rank{a['rank']}.json", "w") as f:
            json.dump({"node": a["node"], "seen": b["seen"] + a["seen"], "world_rank": world_rank,
                       "resumed": True, "first_node": b["node"]}, f)


def resize(cluster, config, job, killed):
    """World ranks 0-1 read on node 0 and 2-3 on node 1 (`config["counts"]` samples each) and
    are killed with their producers; the run resumes with `config["new_world"]` ranks, first
    and second halves on nodes 0 and 1, whose producers and ranks reshard the old ranks'
    states. Writes what each old rank read (before.json) and each new rank (rank{r}.json)."""
    nodes = sorted(cluster.addresses, key=lambda n: cluster.addresses[n])

    def readers(world):
        return [Reader.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
            nodes[rank * 2 // world], soft=False)).remote() for rank in range(world)]

    first = readers(config["world"])
    before = ray.get([a.read.remote(config, r, None, config["counts"][r])
                      for r, a in enumerate(first)])
    for actor in first:
        ray.kill(actor)
    stopped = job.stop()
    killed["killed"] = f"{len(first)} reader actors, {len(stopped)} producers"
    states = [b["state"] for b in sorted(before, key=lambda b: b["rank"])]
    new = dict(config, world=config["new_world"])
    job = fray.produce(
        cluster, config["stream"], manifest=config["manifest"], tokenizer=config["tokenizer"],
        world=new["world"], epochs=config["epochs"], placement=config["placement"],
        args=config["args"], bin_dir=config["bin_dir"], states=states,
    )
    second = readers(new["world"])
    try:
        after = ray.get([a.read.remote(new, r, dict(enumerate(states)), None)
                         for r, a in enumerate(second)])
    except Exception:
        # What the producers said is the likeliest why.
        for p in job.stop():
            print(f"producer on {p['node']}: {p['returncode']}\n{p['stderr']}", file=sys.stderr)
        raise
    with open(f"{config['out']}/before.json", "w") as f:
        json.dump(before, f)
    for world_rank, a in enumerate(after):
        with open(f"{config['out']}/rank{a['rank']}.json", "w") as f:
            json.dump({"node": a["node"], "seen": a["seen"], "world_rank": world_rank}, f)
    return job


def train(config):
    """Ray Train's workers as the ranks (the group restarted once from the checkpoints when a
    worker is killed)."""
    TorchTrainer(
        train_loop,
        train_loop_config=config,
        scaling_config=ScalingConfig(
            num_workers=config["world"], resources_per_worker={"CPU": 1},
            placement_strategy="SPREAD",
        ),
        run_config=RunConfig(
            storage_path=config["out"] + "/results",
            failure_config=FailureConfig(max_failures=1 if config["kill_rank"] else 0),
        ),
    ).fit()


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
        if config["move_ranks"]:
            move_ranks(cluster, config, killed)
        elif config.get("new_world"):
            job = resize(cluster, config, job, killed)
        else:
            train(config)
            if config["kill_rank"]:
                killed["killed"] = "the Ray Train worker of world rank 1, by itself"
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
