"""feedstore.ray on a real multi-node Ray cluster on this machine: one raylet per network
namespace (two nodes joined by veth pairs through a bridge, made and removed by the test), one
feedstored per Ray node started through Ray, producer actors placed by the placement under
test, and Ray Train's TorchTrainer workers as the ranks. Each rank must read exactly what the same
stream delivers on a single daemon, sample for sample, and samples must cross the nodes.

Needs root (namespaces) and Ray (`pip install "ray[train]"`; .ci/run installs it)."""

import json
import os
import pathlib
import signal
import subprocess
import sys

import pytest

ray = pytest.importorskip("ray")

import feedstore  # noqa: E402

from conftest import DATA, binary, finish, manifest, produce  # noqa: E402

RECORDS, WORLD, EPOCHS = 48, 4, 2
IMAGE_ARGS = ["--image-size", "64x64", "--dtype", "u8", "--layout", "hwc", "--workers", "1",
              "--prefetch", "4", "--image-root", str(DATA / "photos")]
HERE = pathlib.Path(__file__).resolve().parent
RAY = str(pathlib.Path(sys.executable).parent / "ray")


def run(*cmd, check=True, **kwargs):
    return subprocess.run([str(c) for c in cmd], check=check, capture_output=True, **kwargs)


class Lan:
    """Two namespaces joined by veth pairs through a bridge in a hub namespace, 10.78.0.0/24."""

    def __init__(self, n: int):
        prefix = f"fsray{os.getpid()}"
        self.hub = f"{prefix}hub"
        self.nodes = [f"{prefix}n{i}" for i in range(n)]
        self.remove()
        run("ip", "netns", "add", self.hub)
        run("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
        run("ip", "-n", self.hub, "link", "set", "br0", "up")
        for i, ns in enumerate(self.nodes):
            run("ip", "netns", "add", ns)
            run("ip", "-n", self.hub, "link", "add", f"p{i}", "type", "veth", "peer", "name",
                "eth0", "netns", ns)
            run("ip", "-n", self.hub, "link", "set", f"p{i}", "master", "br0", "up")
            run("ip", "-n", ns, "addr", "add", f"{self.ip(i)}/24", "dev", "eth0")
            run("ip", "-n", ns, "link", "set", "eth0", "up")
            run("ip", "-n", ns, "link", "set", "lo", "up")

    def ip(self, i: int) -> str:
        return f"10.78.0.{i + 1}"

    def exec(self, i: int, *cmd, **kwargs):
        return run("ip", "netns", "exec", self.nodes[i], *cmd, **kwargs)

    def kill_processes(self):
        for ns in self.nodes:
            pids = run("ip", "netns", "pids", ns, check=False).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def remove(self):
        for ns in [*self.nodes, self.hub]:
            run("ip", "netns", "del", ns, check=False)


@pytest.fixture
def ray_nodes(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to make network namespaces")
    lan = Lan(2)
    env = dict(os.environ)
    # The workers import the staged package and this directory.
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    # Ray keeps per-user state in ~/.ray (an auth token a local `ray.init()` leaves there makes
    # this cluster refuse its own driver): the test's cluster has a home of its own.
    env["HOME"] = str(tmp_path / "home")
    os.makedirs(env["HOME"])
    # Ray Train's torch process group (gloo) on the nodes' link, not on the host name's address.
    env["GLOO_SOCKET_IFNAME"] = "eth0"
    # Samples never go through Ray's object store: keep its shared memory small.
    common = ["--num-cpus=3", "--disable-usage-stats", "--object-store-memory=200000000"]
    try:
        lan.exec(0, RAY, "start", "--head", f"--node-ip-address={lan.ip(0)}", "--port=6379",
                 "--include-dashboard=false", *common, env=env)
        lan.exec(1, RAY, "start", f"--address={lan.ip(0)}:6379",
                 f"--node-ip-address={lan.ip(1)}", *common, env=env)
        yield lan, env
    except subprocess.CalledProcessError as e:
        raise AssertionError(f"{e.cmd} failed:\n{e.stderr.decode()[-4000:]}") from None
    finally:
        # Every process of this cluster lives in one of its namespaces: stop those (`ray stop`
        # would stop every Ray on the machine).
        lan.kill_processes()
        lan.remove()


def reference(daemon, tmp_path):
    """Each rank's (seq, record, id) as a single daemon delivers the stream."""
    producer = produce(daemon, tmp_path, "reference", RECORDS, "--world", str(WORLD),
                       "--epochs", str(EPOCHS))
    ranks = []
    for rank in range(WORLD):
        with feedstore.Stream("reference", RECORDS, rank, WORLD, epochs=EPOCHS,
                              socket=daemon.socket, wait=120) as stream:
            ranks.append([[s.seq, s.record, s.id] for s in stream])
    finish(producer)
    return ranks


@pytest.mark.parametrize(
    "placement, kill",
    [("spread", None), ("relay", None), ("spread", "producer"), ("spread", "rank"),
     ("spread", "move")],
)
def test_ray_train_ranks_on_two_nodes_read_their_shares_in_order(
    ray_nodes, daemon, tmp_path, placement, kill
):
    """`kill="producer"`: the worker node's producer process is killed with SIGKILL once
    samples flow; the other node's producer makes what it left. `kill="rank"`: the Ray Train
    worker of world rank 1 kills itself with SIGKILL mid-epoch, after the ranks checkpointed their
    stream states twice; Ray Train restarts the worker group (which may place world ranks on
    other nodes than before)
    and each stream rank resumes from its checkpoint on its node. `kill="move"`: ranks as plain
    actors pinned to nodes read a few samples and are killed; the same world ranks restart on
    the other node each, so every one resumes a stream rank of its new node from the saved
    states. In every case no stream rank loses or repeats a sample."""
    lan, env = ray_nodes
    expected = reference(daemon, tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    config = {
        "address": f"{lan.ip(0)}:6379", "ip": lan.ip(0), "stream": f"ray-{placement}",
        "records": RECORDS, "world": WORLD, "epochs": EPOCHS, "placement": placement,
        "manifest": str(manifest(tmp_path / "ray.jsonl", RECORDS)),
        "tokenizer": str(tmp_path / "tokenizer.json"), "args": IMAGE_ARGS,
        "bin_dir": str(binary("feedstored").parent), "out": str(out),
        "kill_producer": kill == "producer", "kill_rank": kill == "rank",
        "move_ranks": kill == "move",
        "pause": 0.02 if kill else 0.0, "checkpoint_every": 4 if kill == "rank" else 0,
    }
    done = lan.exec(0, sys.executable, HERE / "ray_driver.py", json.dumps(config), check=False,
                    env=env, timeout=600)
    assert done.returncode == 0, done.stderr.decode()[-6000:]
    seen = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
    for rank in range(WORLD):
        assert seen[rank]["seen"] == expected[rank], f"rank {rank}"
    assert len({s["node"] for s in seen}) == 2, "Ray Train spread the ranks over both nodes"
    result = json.loads((out / "stats.json").read_text())
    stats = result["stats"]
    assert len(stats) == 2
    assert sum(s["pulls"] for s in stats.values()) > 0, f"samples crossed nodes: {stats}"
    for s in stats.values():
        assert s["leases"] == 0 and s["pulls_in_flight"] == 0, s
    if kill:
        assert "killed" in result["killed"], result["killed"]
    if kill == "rank":
        assert all(s["resumed"] for s in seen), "every worker of the restarted group resumed"
        # Whether Ray Train put world ranks on other nodes this time (then they read other
        # stream ranks) is its choice: both ways must lose and repeat nothing.
        moved = [r for r, s in enumerate(seen) if s["world_rank"] != r]
        print(f"stream ranks read by another world rank after the restart: {moved}")
    if kill == "move":
        # Each world rank now runs on the other node, so reads another stream rank, which
        # stays on the node where it first opened.
        for rank, s in enumerate(seen):
            assert s["world_rank"] != rank and s["node"] == s["first_node"], s
    if kill == "producer":
        codes = sorted(p["returncode"] for p in result["producers"])
        assert codes == [-9, 0], result["producers"]
    if placement == "relay":
        # Every sample for a rank on the worker node passed through the head node's daemon.
        assert max(s["served_reads"] for s in stats.values()) > 0


def test_a_ray_run_resumes_with_another_number_of_workers(ray_nodes, daemon, tmp_path):
    """Four ranks (plain actors, two per node) read a few samples each, unevenly (one none),
    and stop with their producers; the run resumes with three: `feedstore.ray.produce(states=)`
    and `open_stream(state=)` reshard the four states. Each new rank reads exactly what the
    same resharded stream delivers on a single daemon, the old ranks what a run of four does,
    and together both runs read every record once per epoch."""
    import collections

    lan, env = ray_nodes
    name, counts = "ray-resize", [3, 0, 11, 2]
    expected_before = reference(daemon, tmp_path)
    states = [feedstore.state_at(name, RECORDS, r, counts[r], WORLD, epochs=EPOCHS)
              for r in range(WORLD)]
    # The same resume on one daemon: what each new rank must read.
    resumed = feedstore.reshard(states, 3, name=name, records=RECORDS, epochs=EPOCHS)
    states_file = tmp_path / "states.txt"
    states_file.write_text("".join(s + "\n" for s in states))
    producer = produce(daemon, tmp_path, name, RECORDS, "--world", "3", "--epochs",
                       str(EPOCHS), "--resume", str(states_file))
    expected_after = []
    for rank in range(3):
        with feedstore.Stream(name, RECORDS, rank, 3, epochs=EPOCHS, state=resumed[rank],
                              socket=daemon.socket, wait=120) as stream:
            expected_after.append([[s.seq, s.record, s.id] for s in stream])
    finish(producer)

    out = tmp_path / "out"
    out.mkdir()
    config = {
        "address": f"{lan.ip(0)}:6379", "ip": lan.ip(0), "stream": name,
        "records": RECORDS, "world": WORLD, "new_world": 3, "counts": counts, "epochs": EPOCHS,
        "placement": "spread", "manifest": str(manifest(tmp_path / "ray.jsonl", RECORDS)),
        "tokenizer": str(tmp_path / "tokenizer.json"), "args": IMAGE_ARGS,
        "bin_dir": str(binary("feedstored").parent), "out": str(out),
        "kill_producer": False, "kill_rank": False, "move_ranks": False, "pause": 0.0,
        "checkpoint_every": 0,
    }
    done = lan.exec(0, sys.executable, HERE / "ray_driver.py", json.dumps(config), check=False,
                    env=env, timeout=600)
    assert done.returncode == 0, done.stderr.decode()[-6000:]
    before = sorted(json.loads((out / "before.json").read_text()), key=lambda b: b["rank"])
    assert [b["state"] for b in before] == states
    for rank, b in enumerate(before):
        assert b["seen"] == expected_before[rank][: counts[rank]], f"old rank {rank}"
    after = [json.loads((out / f"rank{r}.json").read_text()) for r in range(3)]
    for rank in range(3):
        assert after[rank]["seen"] == expected_after[rank], f"new rank {rank}"
    assert len({a["node"] for a in after}) == 2, "the new ranks read on both nodes"
    read = collections.Counter(
        s[1] for runs in ([b["seen"] for b in before], [a["seen"] for a in after])
        for seen in runs for s in seen
    )
    assert read == {r: EPOCHS for r in range(RECORDS)}, "every record once per epoch"
    stats = json.loads((out / "stats.json").read_text())["stats"]
    for s in stats.values():
        assert s["leases"] == 0 and s["pulls_in_flight"] == 0, s


def test_restarted_world_ranks_pair_with_their_nodes_stream_ranks():
    """How every worker of a restarted group maps its world rank to a stream rank (the same in
    all of them): own rank kept where it is one of the node's, the rest in order."""
    from feedstore.ray import _pair

    placement = {0: "a", 1: "a", 2: "b", 3: "b"}
    assert _pair(placement, placement) == {0: 0, 1: 1, 2: 2, 3: 3}
    swapped = {0: "b", 1: "b", 2: "a", 3: "a"}
    assert _pair(placement, swapped) == {0: 2, 1: 3, 2: 0, 3: 1}
    mixed = {0: "a", 1: "b", 2: "a", 3: "b"}
    assert _pair(placement, mixed) == {0: 0, 2: 1, 1: 2, 3: 3}
    # Three workers where the node has two stream ranks: the third gets none (open_stream
    # says why), and no stream rank is given twice.
    crowded = {0: "a", 1: "a", 2: "a", 3: "b"}
    pairs = _pair(placement, crowded)
    assert 2 not in pairs and len(set(pairs.values())) == len(pairs)
