"""feedstore on Ray: one daemon per Ray node, producers as Ray actors, trainers on Ray Train ranks.

Ray is the cluster engine here; feedstore is the data path. Ray places the processes and tells
the daemons where their peers are (each daemon is an actor pinned to its node, and the driver
hands every daemon the others' addresses); samples never travel through Ray's object store,
the driver or any head node: producers write them into their own node's shared memory, and each
rank's daemon pulls them straight from there, inside the rank's prefetch window::

    import ray, feedstore.ray as fray
    from ray.train import ScalingConfig
    from ray.train.torch import TorchTrainer

    ray.init()
    cluster = fray.start(capacity="8GiB")          # one feedstored per node, peers found via Ray
    job = fray.produce(cluster, "sft", manifest="/data/sft.jsonl", tokenizer="/data/tok.json",
                       world=8, epochs=1, placement="spread")

    def train_loop(config):
        with fray.open_stream("sft", records=100_000, epochs=1) as stream:  # rank from Ray Train
            for sample in stream:
                ...

    TorchTrainer(train_loop, scaling_config=ScalingConfig(num_workers=8)).fit()
    job.wait()
    cluster.shutdown()

Placements (the seed's comparison, one argument): ``"spread"`` (a producer actor per node,
``scheduling_strategy="SPREAD"``; each sample pulled straight from the node that made it),
``"colocated"`` (every producer on the driver's node, as Ray's default packing does) and
``"relay"`` (spread, with every sample for another node passing through the driver's node first,
as a coordinator relaying samples does).

The binaries (``feedstored``, ``feedstore``) must be installed on every node: the wheel
(``./scripts/wheel``) carries them into the environment's ``bin`` with this package, and
``bin_dir`` / ``$FEEDSTORE_BIN_DIR`` or ``PATH`` name others (``pip install ./python`` builds the
package alone, with a Rust toolchain). The manifest, images and tokenizer must be readable from
every node that runs a producer (a shared file system, or S3 through ``--s3-endpoint`` and the
other ``feedstore produce`` flags passed in ``args``). Nodes that join the Ray cluster after
``start`` get no daemon.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sysconfig
import tempfile
import time
from typing import Dict, List, Mapping, Optional, Sequence, Union

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

import feedstore

#: The Ray namespace feedstore's named actors live in.
NAMESPACE = "feedstore"

PLACEMENTS = ("spread", "colocated", "relay")


class StreamWrite:
    """A `write_stream` running in a thread of this process: `records` is the stream's record
    count (what readers pass), `wait()` returns once every record is written or raises what
    stopped it."""

    def __init__(self, records: int, run) -> None:
        import threading

        self.records = records
        self._error: Optional[BaseException] = None

        def body() -> None:
            try:
                run()
            except BaseException as e:  # noqa: BLE001 (re-raised by wait)
                self._error = e

        self._thread = threading.Thread(target=body, name="feedstore write_stream", daemon=True)
        self._thread.start()

    def wait(self, timeout: Optional[float] = None) -> int:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise feedstore.Timeout(f"the stream is still being written after {timeout} s")
        if self._error is not None:
            raise self._error
        return self.records


def write_stream(
    dataset: "ray.data.Dataset",
    name: str,
    *,
    world: int = 1,
    records: Optional[int] = None,
    batch_size: Optional[int] = None,
    socket: Optional[str] = None,
    depth: int = 64,
    timeout: float = 600.0,
    block: bool = True,
) -> Union[int, StreamWrite]:
    """Feeds a Ray Data pipeline into a stream.

    Item *i* of the pipeline (a row, or with ``batch_size`` a batch of that many rows as a dict
    of numpy arrays) becomes record *i*, written once into the node's shared memory as the
    structure it is. Trainer rank *r* of ``world`` reads records *r*, *r + world*, ... with
    ``feedstore.torch.StreamDataset(name, records, rank=r, world=world, shuffle="none")`` (or
    ``feedstore.Stream``), each as that structure with its arrays over shared memory: no copy
    into the trainer, no pickle of array bytes. The pipeline's order is kept
    (``preserve_order``), so the records are the same on every run; a record the ranks cannot
    share evenly (the tail) is not written.

    Writing waits while every reader's window (``depth`` records per rank) is full, so readers
    must read while it writes: ``block=False`` writes from a thread of this process and returns
    a ``StreamWrite`` at once (its ``records`` for the readers, ``wait()`` for the end);
    ``block=True`` returns the record count when done (readers in other processes). Raises
    ``feedstore.Timeout`` when readers take nothing for ``timeout`` seconds.

    Runs where it is called (the driver, or a Ray task on the node whose daemon it fills:
    ``socket`` defaults as for every client). ``records`` defaults to ``dataset.count()`` (which
    may run the pipeline once more) divided into batches.
    """
    from feedstore import _batch

    if batch_size is not None and batch_size < 1:
        raise feedstore.InvalidArgument(f"batch_size={batch_size}: at least 1")
    dataset.context.execution_options.preserve_order = True
    if records is None:
        rows = dataset.count()
        records = rows if batch_size is None else -(-rows // batch_size)
    needed = records // world * world
    writer = feedstore.Writer(
        name, records, world, shuffle="none", epochs=1, socket=socket, depth=depth
    )

    def run() -> None:
        try:
            write()
        except BaseException:
            writer.close()  # its readers see the end, not a wait for records never made
            raise

    def write() -> None:
        if batch_size is None:
            items = dataset.iter_rows()
        else:
            items = dataset.iter_batches(batch_size=batch_size, batch_format="numpy")
        due: Dict[int, "feedstore.Task"] = {}
        written = 0
        for record, item in enumerate(items):
            if record >= needed:
                break
            waited_since = time.monotonic()
            while record not in due:
                tasks = writer.take(max=256, wait=1.0)
                if tasks is None:
                    raise feedstore.InvalidArgument(
                        f"stream {name!r} needs no more records: an earlier writer fed it to "
                        f"its end, or it was closed (`feedstore stream close {name}` ends it, "
                        "so that it can be fed again)"
                    )
                for task in tasks:
                    due[task.record] = task
                if not tasks and time.monotonic() - waited_since > timeout:
                    raise feedstore.Timeout(
                        f"stream {name!r}: no reader took a record for {timeout:.0f} s (record "
                        f"{record} is due; every window of {depth} is full: are readers "
                        "reading while it writes? see block=False)"
                    )
            writer.publish(due.pop(record), _batch.fill(writer.reserve, item))
            written += 1
        if written < needed:
            raise feedstore.InvalidArgument(
                f"the pipeline gave {written} items, the stream {name!r} needs {needed} "
                f"({records} records for {world} ranks): pass the right `records`"
            )

    if not block:
        return StreamWrite(records, run)
    run()
    return records


def _binary(name: str, bin_dir: Optional[str]) -> str:
    for d in [bin_dir, os.environ.get("FEEDSTORE_BIN_DIR")]:
        if d and os.path.exists(os.path.join(d, name)):
            return os.path.join(d, name)
    # Then PATH, then where pip put the wheel's binaries: this environment's scripts directory
    # (on PATH only when the venv is activated).
    found = shutil.which(name) or shutil.which(name, path=sysconfig.get_path("scripts"))
    if not found:
        raise RuntimeError(
            f"{name} is not installed on node {ray.util.get_node_ip_address()}: put it on PATH, "
            "or pass bin_dir (or set $FEEDSTORE_BIN_DIR)"
        )
    return found


def _daemon_name(node_id: str) -> str:
    return f"feedstore-daemon-{node_id}"


@ray.remote(num_cpus=0)
class _Daemon:
    """One node's feedstored, started and stopped by this actor (pinned to the node)."""

    def __init__(self, index: int, capacity: str, port: int, secret: str, bin_dir: Optional[str],
                 extra: Sequence[str], run: str):
        self.run = run
        self.ip = ray.util.get_node_ip_address()
        self.port = port
        self.dir = tempfile.mkdtemp(prefix="feedstore-ray-")
        self.sock = os.path.join(self.dir, "feedstore.sock")
        self.peers = os.path.join(self.dir, "peers")
        secret_path = os.path.join(self.dir, "cluster-secret")
        fd = os.open(secret_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secret)
        with open(self.peers, "w") as f:
            f.write("")
        self.log = open(os.path.join(self.dir, "feedstored.log"), "wb")
        self.process = subprocess.Popen(
            [
                _binary("feedstored", bin_dir), "--socket", self.sock, "--capacity", capacity,
                "--node-id", str(index + 1), "--listen", f"{self.ip}:{port}",
                "--peers-file", self.peers, "--cluster-secret-file", secret_path,
                "--peer-refresh-secs", "1", *extra,
            ],
            stdout=subprocess.DEVNULL,
            stderr=self.log,
        )
        # Ready when it answers: a daemon allocates and zeroes (pre-faults) its whole capacity
        # before it binds its socket, ~1 s per GiB on a small machine (in cluster mode it maps
        # it with its page tables too).
        deadline = time.monotonic() + 600
        while True:
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"feedstored did not start on {self.ip}: {self.log_tail()}")
            if os.path.exists(self.sock):
                try:
                    # Kept for `stats` (one connection, not one per call).
                    self.client = feedstore.Client(self.sock, name="feedstore.ray daemon actor")
                    self.client.stats()
                    break
                except (feedstore.ConnectError, feedstore.Timeout, feedstore.Disconnected):
                    pass
            time.sleep(0.05)

    def log_tail(self) -> str:
        self.log.flush()
        with open(self.log.name, "rb") as f:
            return f.read()[-4000:].decode(errors="replace")

    def address(self) -> str:
        return f"{self.ip}:{self.port}"

    def socket(self) -> str:
        return self.sock

    def where(self) -> tuple:
        """This daemon's peer address, socket, and the id of the ``start`` that made it."""
        return self.address(), self.sock, self.run

    def set_peers(self, addresses: List[str]) -> None:
        """The daemon re-reads the file every second (``--peer-refresh-secs 1``)."""
        tmp = self.peers + ".tmp"
        with open(tmp, "w") as f:
            f.write("\n".join(addresses) + "\n")
        os.replace(tmp, self.peers)

    def stats(self) -> dict:
        return self.client.stats()

    def stop(self) -> None:
        self.client = None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


class Cluster:
    """The daemons ``start`` made, one per Ray node, by node id, and the run's rank registry."""

    def __init__(self, daemons: Dict[str, "ray.actor.ActorHandle"], addresses: Dict[str, str],
                 registry: "ray.actor.ActorHandle"):
        self.daemons = daemons
        self.addresses = addresses
        self.registry = registry

    def stats(self) -> Dict[str, dict]:
        """Every node's ``feedstore stat`` figures, by node id."""
        ids = list(self.daemons)
        return dict(zip(ids, ray.get([self.daemons[i].stats.remote() for i in ids])))

    def shutdown(self, wait: bool = True) -> None:
        """Stops every daemon (SIGTERM), removes its files, and the rank registry. Call it when
        the job ends (in a ``finally``): daemon actors outlive nothing, but their temporary
        folders stay behind a driver that exits without it."""
        try:
            stops = [d.stop.remote() for d in self.daemons.values()]
            if wait:
                ray.get(stops)
            else:
                ray.wait(stops, num_returns=len(stops), timeout=60)
        finally:
            for actor in [*self.daemons.values(), self.registry]:
                ray.kill(actor)


def start(capacity: str = "4GiB", port: int = 7070, *, bin_dir: Optional[str] = None,
          args: Sequence[str] = (), timeout: float = 120.0) -> Cluster:
    """Starts one feedstored per alive Ray node (an actor pinned to it, named by the node's id),
    each listening on ``port`` of the node's address (``port + i`` for the i-th node when several
    Ray nodes share an address, as in Ray's local test clusters), tells each where the others
    are, and waits until every daemon sees all its peers. The cluster secret is made here and
    handed to the daemons through Ray."""
    nodes = sorted((n for n in ray.nodes() if n["Alive"]), key=lambda n: n["NodeID"])
    if not nodes:
        raise RuntimeError("no alive Ray nodes")
    shared_ip = len({n["NodeManagerAddress"] for n in nodes}) < len(nodes)
    secret = secrets.token_hex(32)
    # Owned by this driver and pinned to its node: it lives as long as the job, not as long as
    # whichever worker first opened a stream; a later `start` makes a fresh one.
    run = secrets.token_hex(6)
    registry = _Ranks.options(
        name=_registry_name(run),
        namespace=NAMESPACE,
        scheduling_strategy=NodeAffinitySchedulingStrategy(
            ray.get_runtime_context().get_node_id(), soft=False
        ),
    ).remote()
    daemons = {}
    try:
        for i, node in enumerate(nodes):
            name = _daemon_name(node["NodeID"])
            try:
                ray.get_actor(name, namespace=NAMESPACE)
                raise RuntimeError(
                    f"a feedstore daemon already runs on node {node['NodeID']}: call "
                    "shutdown() on the cluster start() returned before starting another"
                )
            except ValueError:
                pass
            daemons[node["NodeID"]] = _Daemon.options(
                name=name,
                namespace=NAMESPACE,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False),
            ).remote(i, capacity, port + i if shared_ip else port, secret, bin_dir, list(args), run)
        addresses = dict(zip(daemons, ray.get([d.address.remote() for d in daemons.values()])))
        ray.get([d.set_peers.remote(list(addresses.values())) for d in daemons.values()])
        deadline = time.monotonic() + timeout
        for node_id, d in daemons.items():
            while ray.get(d.stats.remote())["peers_up"] < len(daemons) - 1:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"the daemon on node {node_id} does not see its {len(daemons) - 1} "
                        "peers: " + ray.get(d.log_tail.remote())
                    )
                time.sleep(0.1)
    except BaseException:
        # Whatever did start is stopped, its files removed.
        Cluster(daemons, {}, registry).shutdown(wait=False)
        raise
    return Cluster(daemons, addresses, registry)


def local_daemon() -> "ray.actor.ActorHandle":
    """The daemon actor of the node this code runs on (a task, an actor or a Ray Train worker)."""
    node_id = ray.get_runtime_context().get_node_id()
    try:
        return ray.get_actor(_daemon_name(node_id), namespace=NAMESPACE)
    except ValueError:
        raise RuntimeError(
            f"no feedstore daemon on Ray node {node_id}: call feedstore.ray.start() first "
            "(nodes that joined after it have none)"
        ) from None


def local_socket() -> str:
    """The socket of this node's daemon."""
    return ray.get(local_daemon().socket.remote())


@ray.remote(num_cpus=0)
class _Ranks:
    """Where each stream rank reads: its node's daemon address, per stream. Told by the ranks
    when they first open a stream, asked by the producers and by restarted workers; it carries
    no samples and assigns no tasks. Once every rank has said where it is, the placement is
    fixed: producers feed each rank's window on that node from then on."""

    def __init__(self):
        self.world: Dict[str, int] = {}
        self.at: Dict[str, Dict[int, str]] = {}

    def claim(self, stream: str, rank: int, world: int, address: str) -> Optional[Dict[int, str]]:
        """Before the placement is fixed, records that ``rank`` reads on ``address`` and
        returns None (where a rank first opens is where it reads); afterwards returns the
        placement, unchanged. A rank of another world size than the placement's starts a new
        one: a run resumed at another size (its states resharded) places its ranks anew."""
        if self.world.get(stream) != world:
            self.world[stream], self.at[stream] = world, {}
        at = self.at[stream]
        if len(at) == world:
            return dict(at)
        at[rank] = address
        return None

    def placement(self, stream: str, world: int) -> Optional[Dict[int, str]]:
        """The placement once every rank of a run of ``world`` ranks has said where it reads;
        None before (and for a run of another size than the latest ranks')."""
        at = self.at.get(stream, {})
        return dict(at) if self.world.get(stream) == world and len(at) == world else None


def _registry_name(run: str) -> str:
    return f"feedstore-ranks-{run}"


def _registry(run: str) -> "ray.actor.ActorHandle":
    try:
        return ray.get_actor(_registry_name(run), namespace=NAMESPACE)
    except ValueError:
        raise RuntimeError(
            "the feedstore.ray cluster of this node's daemon is gone (its driver ended)"
        ) from None


def _group_addresses(rank: int, world: int, address: str) -> Optional[Dict[int, str]]:
    """Every world rank's daemon address, gathered over the torch.distributed group when one
    of ``world`` ranks is initialised (as in a TorchTrainer loop); None otherwise."""
    import sys

    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    if dist.get_world_size() != world or dist.get_rank() != rank:
        return None
    gathered: List[Optional[tuple]] = [None] * world
    dist.all_gather_object(gathered, (rank, address))
    return dict(gathered)


def _pair(placement: Dict[int, str], group: Dict[int, str]) -> Dict[int, int]:
    """World rank to stream rank, the same in every worker: on each node, a world rank that is
    one of the node's stream ranks keeps it, the others take the node's remaining stream ranks
    in order."""
    pairs: Dict[int, int] = {}
    for address in set(group.values()):
        streams = sorted(r for r, a in placement.items() if a == address)
        workers = sorted(w for w, a in group.items() if a == address)
        for w in workers:
            if w in streams:
                pairs[w] = w
        rest = [s for s in streams if s not in pairs.values()]
        for w, s in zip([w for w in workers if w not in pairs], rest):
            pairs[w] = s
    return pairs


def open_stream(name: str, records: int, *, rank: Optional[int] = None,
                world: Optional[int] = None,
                state: Union[None, str, Mapping[int, str]] = None,
                wait: float = 300.0, **kwargs) -> feedstore.Stream:
    """Opens a share of stream ``name`` on this node's daemon, after telling the stream's
    producers where it reads. ``rank`` and ``world`` default to Ray Train's world rank and size
    (inside a ``TorchTrainer`` loop); ``wait`` bounds the whole open; the other arguments are
    ``feedstore.Stream``'s and must match the producers'.

    A stream rank's window (its order, prefetch and resume point) lives on the node where the
    rank first opened the stream, and producers feed it there. When Ray Train restarts the
    worker group after a failure it may put world rank 3 on the node where rank 0 read, so a
    restarted worker reads a stream rank *of its own node*: inside a torch.distributed group of
    ``world`` ranks (a TorchTrainer loop) every worker learns where the others are (one small
    all-gather: call ``open_stream`` on every rank, as with any collective) and all pair world
    ranks with their nodes' stream ranks the same way, a world rank keeping its own when that is
    one of its node's; outside one (plain actors), a worker takes the first stream rank of its
    node that no live consumer reads. ``stream.rank`` may thus differ from the world rank:
    save ``stream.state()`` under ``stream.rank`` with the checkpoint and pass the states of
    all ranks back as ``state={stream_rank: state, ...}`` (a Ray Train checkpoint that every
    worker reports to holds them all; string keys from JSON are accepted). A worker whose
    stream rank has no state in a non-empty mapping raises ``ValueError`` rather than start
    that rank over. A plain ``state`` string resumes the world rank's own stream rank only.
    States of every rank of a run with another number of workers (ranks ``0..n-1``, ``n`` not
    ``world``) are resharded for this one (``feedstore.reshard``): across the new ranks, every
    sample the old run left of the epochs it began is read once. Its producers must resume from
    the same states: ``produce(..., states=[...])``.
    Raises ``feedstore.RankInUse`` when no stream rank of this node is free within ``wait``
    (a consumer still holds it: a live worker, or a process that inherited a dead worker's
    connection, such as a forked DataLoader worker), and ``RuntimeError`` when this node has
    none to give (the restarted group put more workers here than the first had: give workers
    resources that keep the count per node)."""
    if rank is None or world is None:
        from ray.train import get_context

        context = get_context()
        rank = context.get_world_rank() if rank is None else rank
        world = context.get_world_size() if world is None else world
    deadline = time.monotonic() + wait
    address, socket, run = ray.get(local_daemon().where.remote())
    group = _group_addresses(rank, world, address)
    placement = ray.get(_registry(run).claim.remote(name, rank, world, address))
    if isinstance(state, str):
        states = {rank: state}
    else:
        states = {int(r): s for r, s in (state or {}).items()}
        if states and len(states) != world and set(states) == set(range(len(states))):
            spec = {k: v for k, v in kwargs.items() if k in ("seed", "shuffle", "tail", "epochs")}
            resharded = feedstore.reshard(
                [states[r] for r in range(len(states))], world, name=name, records=records, **spec
            )
            states = dict(enumerate(resharded))
    if placement is None:
        candidates = [rank]
    elif group is not None:
        candidates = [r for r in [_pair(placement, group).get(rank)] if r is not None]
    else:
        here = sorted(r for r, a in placement.items() if a == address)
        candidates = sorted(here, key=lambda r: r != rank)
    if isinstance(state, str):
        candidates = [r for r in candidates if r == rank]
    elif states:
        missing = [r for r in candidates if r not in states]
        if group is not None and missing:
            raise ValueError(
                f"no saved state for rank {missing[0]} of stream {name!r}, which world rank "
                f"{rank} reads now: pass the states of all ranks (state={{rank: state}})"
            )
        candidates = [r for r in candidates if r in states]
    if not candidates:
        raise RuntimeError(
            f"no rank of stream {name!r} to read on this node ({address}) for world rank {rank}"
            + ("" if placement is None else
               f"; its ranks here are {sorted(r for r, a in placement.items() if a == address)}")
            + ". A stream rank reads on the node where it first opened, so a restarted worker "
            "group must keep as many workers per node as the first had (resources per worker "
            "that fill each node do)"
            + (", and a plain state string resumes only this world rank's own stream rank"
               if isinstance(state, str) else "")
        )
    if placement is not None and not states:
        import warnings

        warnings.warn(
            f"world rank {rank} opens stream {name!r} again without a saved state: its stream "
            "rank starts over from the beginning (pass state={rank: stream.state(), ...} to "
            "resume)",
            stacklevel=2,
        )
        if group is None:
            # Without states, a worker may not take over another worker's rank.
            candidates = [r for r in candidates if r == rank]
    while True:
        for candidate in candidates:
            try:
                return feedstore.Stream(
                    name, records, candidate, world, socket=socket, state=states.get(candidate),
                    wait=max(deadline - time.monotonic(), 0.1), **kwargs,
                )
            except feedstore.RankInUse:
                # Read by a live worker, or a dead one's connection is not closed yet.
                continue
            except feedstore.Timeout as e:
                if placement is None:
                    raise feedstore.Timeout(
                        f"{e}; the producers start once all {world} ranks of stream {name!r} "
                        "have opened it (have they? each rank opens it once)"
                    ) from None
                raise
        if time.monotonic() > deadline:
            raise feedstore.RankInUse(
                f"stream {name!r}: every stream rank world rank {rank} may read on this node "
                f"({candidates}) still had a consumer after {wait} s"
            )
        time.sleep(0.1)


def _ranks_at(placement: Dict[int, str]) -> str:
    by_node: Dict[str, List[int]] = {}
    for rank, address in sorted(placement.items()):
        by_node.setdefault(address, []).append(rank)
    return ",".join(f"{a}={','.join(map(str, ranks))}" for a, ranks in by_node.items())


@ray.remote(num_cpus=1, max_concurrency=2)
class _Producer:
    """`feedstore produce --stream` on this actor's node, once every rank has said where it is
    (two threads: `stop` while `run` waits for the process)."""

    def __init__(self) -> None:
        self.process: Optional[subprocess.Popen] = None
        self.stopped = False

    def stop(self) -> None:
        """Stops the producer process (SIGTERM: it leaves the stream and prints its profile),
        or keeps it from starting."""
        self.stopped = True
        if self.process is not None:
            self.process.send_signal(signal.SIGTERM)

    def run(self, stream: str, world: int, argv: List[str], relay: Optional[str],
            bin_dir: Optional[str], timeout: float, states: Optional[List[str]] = None) -> dict:
        _, socket, run = ray.get(local_daemon().where.remote())
        registry = _registry(run)
        deadline = time.monotonic() + timeout
        while (placement := ray.get(registry.placement.remote(stream, world))) is None:
            if self.stopped:
                return {"node": ray.get_runtime_context().get_node_id(), "returncode": 0,
                        "stdout": "", "stderr": "stopped before it started"}
            if time.monotonic() > deadline:
                raise RuntimeError(f"the ranks of stream {stream!r} did not all open it in time")
            time.sleep(0.2)
        with tempfile.TemporaryDirectory() as scratch:
            resume = []
            if states:
                # (`feedstore produce` reshards a run of another world size's states itself.)
                path = os.path.join(scratch, "states.txt")
                with open(path, "w") as f:
                    f.write("".join(s + "\n" for s in states))
                resume = ["--resume", path]
            command = [
                _binary("feedstore", bin_dir), "produce", "--socket", socket,
                "--stream", stream, "--world", str(world), "--ranks-at", _ranks_at(placement),
                *(["--relay", relay] if relay else []), *resume, *argv,
            ]
            if self.stopped:
                return {"node": ray.get_runtime_context().get_node_id(), "returncode": 0,
                        "stdout": "", "stderr": "stopped before it started"}
            self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            if self.stopped:  # (`stop` ran between the check and the start)
                self.process.send_signal(signal.SIGTERM)
            stdout, stderr = self.process.communicate()
        return {
            "node": ray.get_runtime_context().get_node_id(),
            "returncode": self.process.returncode,
            # The summary, stage profile and verdict; the progress lines and errors.
            "stdout": stdout.decode(errors="replace")[-4000:],
            "stderr": stderr.decode(errors="replace")[-4000:],
        }


class ProduceJob:
    """Producer actors running; ``wait`` for them to finish."""

    def __init__(self, refs, actors):
        self.refs = refs
        self.actors = actors

    def wait(self, timeout: Optional[float] = None, check: bool = True) -> List[dict]:
        """Waits for every producer and returns each one's node, exit status, stdout (its
        summary, stage profile and verdict) and stderr; with
        ``check``, raises if one failed (the others still made every sample: what a failed
        producer took goes back to its rank's window)."""
        results = ray.get(self.refs, timeout=timeout)
        for r in results:
            if check and r["returncode"] != 0:
                raise RuntimeError(f"a producer on node {r['node']} failed:\n{r['stderr']}")
        return results

    def stop(self, timeout: Optional[float] = 60) -> List[dict]:
        """Stops every producer (a run that ends before its stream does, to resume later or at
        another size) and returns what ``wait`` does, without checking exit statuses. Its
        actors go, and their CPUs with them."""
        try:
            ray.get([a.stop.remote() for a in self.actors], timeout=timeout)
            return self.wait(timeout=timeout, check=False)
        finally:
            for actor in self.actors:
                ray.kill(actor)


def produce(cluster: Cluster, stream: str, *, manifest: str, tokenizer: str, world: int,
            epochs: int = 1, seed: int = 0, placement: str = "spread",
            producers: Optional[int] = None, args: Sequence[str] = (),
            bin_dir: Optional[str] = None, timeout: float = 600.0,
            states: Optional[Sequence[str]] = None) -> ProduceJob:
    """Starts producers for ``stream`` (``world`` ranks, ``epochs``, ``seed``) by ``placement``:
    ``producers`` actors (default: one per node) running ``feedstore produce`` with this
    node's daemon, ``args`` passed on (``--workers``, ``--image-size``, S3 flags, ...). They
    begin once every rank has opened the stream (``open_stream``) and so said where it is.
    ``states``: the ranks' saved states to resume from (``feedstore produce --resume``), those
    of every rank of a run with another number of workers included (resharded to ``world``, as
    ``open_stream`` does for the ranks)."""
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {PLACEMENTS}, not {placement!r}")
    count = producers or len(cluster.daemons)
    argv = [
        "--manifest", manifest, "--tokenizer", tokenizer, "--epochs", str(epochs),
        "--seed", str(seed), *args,
    ]
    here = ray.get_runtime_context().get_node_id()
    if placement == "colocated":
        strategy = NodeAffinitySchedulingStrategy(here, soft=False)
    else:
        strategy = "SPREAD"
    relay = cluster.addresses[here] if placement == "relay" else None
    actors = [_Producer.options(scheduling_strategy=strategy).remote() for _ in range(count)]
    states = list(states) if states is not None else None
    refs = [a.run.remote(stream, world, argv, relay, bin_dir, timeout, states) for a in actors]
    return ProduceJob(refs, actors)
