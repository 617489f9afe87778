"""The Python client against a real daemon and real producers: zero copy, read-only arrays,
lease lifetimes, the writer API, errors, batches into preallocated output, kill -9 and Ctrl-C."""

import gc
import json
import signal
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

import feedstore
from conftest import finish, produce


def mapping_of(address: int):
    """(permissions, path) of the mapping of this process that holds `address`."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= address < hi:
                return fields[1], fields[5].strip() if len(fields) > 5 else ""
    raise AssertionError(f"0x{address:x} is in no mapping")


def test_samples_are_read_only_arrays_in_the_store_mapping(daemon, tmp_path):
    producer = produce(daemon, tmp_path, "zero-copy", 6, "--shuffle", "none")
    with feedstore.Stream("zero-copy", 6, shuffle="none", socket=daemon.socket, wait=120) as stream:
        seen = []
        for sample in stream:
            image, tokens, labels = sample.images[0], sample.tokens, sample.labels
            assert sample.id == f"rec-{sample.record}"
            assert image.shape == (64, 64, 3) and image.dtype == np.uint8
            assert tokens.dtype == np.uint32 and labels.dtype == np.int32
            assert len(tokens) == len(labels) > 0
            assert (labels == -100).any() and (labels != -100).any()
            for array in (image, tokens, labels, sample.data):
                perms, path = mapping_of(array.ctypes.data)
                assert path.startswith("/memfd:feedstore:"), path
                assert perms.startswith("r-"), perms  # mapped read-only
                assert not array.flags.writeable
                assert array.base is sample
                with pytest.raises(ValueError, match="read-only"):
                    array[...] = 0
                with pytest.raises(ValueError):
                    array.setflags(write=True)
            seen.append(sample.record)
        assert seen == list(range(6))  # shuffle "none": manifest order
    finish(producer)


def test_a_sample_is_leased_until_its_last_array_is_gone(daemon, tmp_path):
    writer_client = feedstore.Client(daemon.socket, writer=True)
    handle = writer_client.put(np.arange(4096, dtype=np.float32).reshape(64, 64))
    reader = feedstore.Client(daemon.socket)
    sample = reader.get(handle)
    image = sample.images[0]
    assert image.dtype == np.float32 and image[1, 2] == 66.0
    assert daemon.stats()["leases"] == 1
    del sample  # the array still holds the lease
    gc.collect()
    reader.flush()
    assert daemon.stats()["leases"] == 1
    assert image.sum() == sum(range(4096))
    del image
    reader.flush()
    daemon.wait_for("the lease to come back", lambda s: s["leases"] == 0)


def test_stream_samples_go_back_when_their_arrays_are_dropped(daemon):
    writer = feedstore.Writer("held", 3, shuffle="none", socket=daemon.socket)
    for task in writer.take(max=3, wait=5.0):
        writer.put(task, np.full((16, 16, 3), task.record, dtype=np.uint8))
    assert daemon.stats()["leases"] == 3  # the stream holds them for rank 0
    stream = feedstore.Stream("held", 3, shuffle="none", socket=daemon.socket, wait=30)
    arrays = [sample.images[0] for sample in (next(stream) for _ in range(3))]
    gc.collect()
    stream.flush()
    # The stream's three, and one of its own for each sample (held by its array).
    assert daemon.stats()["leases"] == 6
    assert [int(a[0, 0, 0]) for a in arrays] == [0, 1, 2]
    del arrays
    gc.collect()
    stream.flush()
    daemon.wait_for("the samples to go back", lambda s: s["leases"] == 0)


def test_a_stream_dropped_before_its_last_samples_lets_the_producer_finish(daemon, tmp_path):
    # A trainer that reads its whole share and drops the stream while it still holds the last
    # batch (a returning function frees its locals in their order: on CPython 3.12+ the
    # Megatron example's dataset goes before its batch) has finished: the producer must not
    # wait for those samples to come back.
    records = 6
    producer = produce(daemon, tmp_path, "early", records, "--world", "1")
    stream = feedstore.Stream("early", records, socket=daemon.socket, wait=60)
    samples = [next(stream) for _ in range(records)]
    del stream
    finish(producer)
    assert sorted(s.record for s in samples) == list(range(records))
    assert all(len(s.tokens) > 0 for s in samples), "still readable after the producer left"
    assert daemon.stats()["leases"] == 2 * records
    del samples
    gc.collect()
    # Their own leases go back; the stream keeps one on each for a resume until it expires.
    daemon.wait_for("the samples to go back", lambda s: s["leases"] == records)


def test_a_batch_placed_in_one_object_reads_as_one_array(daemon):
    records, batch = 16, 4
    writer = feedstore.Writer(
        "stacked", records, shuffle="none", socket=daemon.socket, depth=16, batch=batch
    )
    put = 0
    while put < records:
        tasks = writer.take(max=1, wait=5.0)
        assert tasks and len(tasks) % batch == 0, "whole batches, past max"
        for i in range(0, len(tasks), batch):
            group = tasks[i : i + batch]
            assert [t.seq for t in group] == list(range(group[0].seq, group[0].seq + batch))
            # 3x8x8 f32: 768 bytes, a multiple of 64, as stacking in place needs.
            items = [
                {"images": [np.full((3, 8, 8), t.record, np.float32)], "tokens": [t.record], "layout": "chw"}
                for t in group
            ]
            writer.put_batch(group, items)
            put += len(group)
    with feedstore.Stream("stacked", records, shuffle="none", socket=daemon.socket, wait=30) as s:
        samples, stacked = s.next_stacked(batch)
        assert stacked.shape == (4, 3, 8, 8) and stacked.dtype == "float32"
        images = stacked.numpy()
        assert [int(i[0, 0, 0]) for i in images] == [0, 1, 2, 3]
        assert [int(x.tokens[0]) for x in samples] == [0, 1, 2, 3]
        # One view of the store's object: numpy's is read-only and says so.
        perms, path = mapping_of(stacked.data_ptr)
        assert perms == "r--s" and path.startswith("/memfd:feedstore:"), (perms, path)
        assert not images.flags.writeable
        with pytest.raises(ValueError):
            images[3, 2, 7, 7] = -1.0
        # torch's (DLPack) lies in a copy-on-write mapping of its own: writable as torch's
        # batches, and a write reaches neither the samples' own images nor the store.
        try:
            import torch
        except ImportError:
            torch = None
        if torch is not None:
            tensor = torch.from_dlpack(stacked)
            perms, _ = mapping_of(tensor.data_ptr())
            assert perms == "rw-p", perms
            tensor[3, 2, 7, 7] = -1.0
            assert int(tensor[3, 2, 7, 7]) == -1 and int(images[3, 2, 7, 7]) == 3
            assert int(samples[3].images[0][2, 7, 7]) == 3
            del tensor
        # The tensor alone keeps the batch's object.
        del samples, images
        gc.collect()
        s.flush()
        assert int(stacked.numpy()[3, 2, 6, 7]) == 3
        del stacked
        # Reading from inside a batch: 6..9 lies in two objects, so that one is a copy.
        firsts = lambda t: [int(i[0, 0, 0]) for i in t.numpy()]
        _, head = s.next_stacked(2)
        _, across = s.next_stacked(4)
        _, tail = s.next_stacked(2)
        assert (firsts(head), firsts(across), firsts(tail)) == ([4, 5], [6, 7, 8, 9], [10, 11])
        assert s.stacked_copies == 1
        assert across.numpy().flags.writeable  # (a copy: this process's memory)
        assert not np.shares_memory(across.numpy(), tail.numpy())
        _, last = s.next_stacked(4)
        assert firsts(last) == [12, 13, 14, 15] and s.stacked_copies == 1
        assert s.next_stacked(4) == ([], None)
    # What the tensors still hold goes back with them.
    assert daemon.stats()["leases"] >= 3
    del head, across, tail, last, _
    gc.collect()
    writer.close()  # and the stream's own
    daemon.wait_for("every lease to go back", lambda st: st["leases"] == 0)


def test_a_view_kept_long_does_not_stall_the_stream(daemon):
    """A batch's view kept past its step (for a log, for the epoch) holds its place in the
    prefetch window only until half the depth of later samples came back: the trainer reads
    on well past the depth (64, the default for batches of 4), and the kept view still reads
    its own batch."""
    records, batch = 160, 4
    writer = feedstore.Writer("kept", records, shuffle="none", socket=daemon.socket, batch=batch)

    def feed():
        while (tasks := writer.take(max=batch, wait=0.1)) is not None:
            for i in range(0, len(tasks), batch):
                group = tasks[i : i + batch]
                items = [
                    {"images": [np.full((3, 8, 8), t.record, np.float32)], "tokens": [t.record], "layout": "chw"}
                    for t in group
                ]
                writer.put_batch(group, items)

    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    with feedstore.Stream("kept", records, shuffle="none", socket=daemon.socket, wait=30) as s:
        _, kept = s.next_stacked(batch)
        seen = batch
        while True:
            samples, images = s.next_stacked(batch)
            if images is None:
                break
            seen += len(samples)
        del samples, images
        assert seen == records
        assert 1 <= s.figures()["passed_held"] <= batch
        assert [int(i[0, 0, 0]) for i in kept.numpy()] == [0, 1, 2, 3]
    feeder.join(timeout=60)
    assert not feeder.is_alive()


def test_next_stacked_hands_over_what_it_cannot_stack(daemon):
    writer = feedstore.Writer("uneven", 2, shuffle="none", socket=daemon.socket)
    for task in writer.take(max=2, wait=5.0):
        writer.put(task, np.zeros((4 + task.seq, 4, 4), np.uint8))
    with feedstore.Stream("uneven", 2, shuffle="none", socket=daemon.socket, wait=30) as s:
        with pytest.raises(feedstore.InvalidArgument) as e:
            s.next_stacked(2)
        assert "cannot be stacked" in str(e.value)
        # The samples were taken: they come with the error, not lost.
        assert [x.seq for x in e.value.samples] == [0, 1]
        assert e.value.samples[1].images[0].shape == (5, 4, 4)


def test_a_failed_sample_ends_a_batch_early_and_loses_nothing(daemon):
    writer = feedstore.Writer("holed", 8, shuffle="none", socket=daemon.socket)
    for task in writer.take(max=8, wait=5.0):
        if task.seq == 3:
            writer.fail(task)
        else:
            writer.put(task, np.full((4, 4, 4), task.seq, np.uint8))
    with feedstore.Stream("holed", 8, shuffle="none", socket=daemon.socket, wait=30) as s:
        assert [x.seq for x in s.next_batch(8)] == [0, 1, 2]
        with pytest.raises(feedstore.SampleFailed):
            s.next_batch(8)
        samples, images = s.next_stacked(8)
        assert [x.seq for x in samples] == [4, 5, 6, 7]
        assert [int(i[0, 0, 0]) for i in images.numpy()] == [4, 5, 6, 7]


def test_writer_publishes_dicts_arrays_and_bytes(daemon):
    records = 3
    writer = feedstore.Writer("written", records, shuffle="none", socket=daemon.socket)
    pixels = np.random.default_rng(7).integers(0, 255, (2, 8, 8, 3), dtype=np.uint8)
    made = {
        0: {
            "id": "dict",
            "images": [pixels[0], pixels[1].astype(np.float16)],
            "tokens": [5, 6, 7],
            "labels": [-100, 6, 7],
            "metadata": {"source": "python"},
        },
        1: pixels[0].astype(np.float32),
        2: b"raw bytes",
    }
    tasks = []
    while (taken := writer.take(max=8, wait=1.0)) is not None and len(tasks) < records:
        for task in taken:
            writer.put(task, made[task.record])
            tasks.append(task)
    assert sorted(t.seq for t in tasks) == [0, 1, 2]
    with feedstore.Stream("written", records, shuffle="none", socket=daemon.socket, wait=30) as s:
        first, second, third = list(s)
    assert first.id == "dict" and first.metadata == {"source": "python"}
    assert np.array_equal(first.images[0], pixels[0])
    assert first.images[1].dtype == np.float16
    assert np.array_equal(first.images[1], pixels[1].astype(np.float16))
    assert first.tokens.tolist() == [5, 6, 7] and first.labels.tolist() == [-100, 6, 7]
    assert second.images[0].dtype == np.float32 and np.array_equal(second.images[0], pixels[0])
    assert not third.is_sample and third.data.tobytes() == b"raw bytes"
    with pytest.raises(feedstore.InvalidSample):
        third.tokens


def test_next_batch_stacks_into_preallocated_output(daemon, tmp_path):
    producer = produce(daemon, tmp_path, "batches", 10, "--shuffle", "none")
    out = np.zeros((4, 64, 64, 3), dtype=np.uint8)
    with feedstore.Stream("batches", 10, shuffle="none", socket=daemon.socket, wait=120) as s:
        with pytest.raises(feedstore.InvalidArgument, match="this batch needs") as e:
            s.next_batch(1, out=np.zeros((1, 3), dtype=np.uint8))
        # The sample was read: it comes with the error, not lost.
        assert [x.seq for x in e.value.samples] == [0]
        sizes = []
        while batch := s.next_batch(4, out=out):
            for i, sample in enumerate(batch):
                assert np.array_equal(out[i], sample.images[0])
                assert out[i].ctypes.data != sample.images[0].ctypes.data
            sizes.append(len(batch))
        assert sizes == [4, 4, 1]
    finish(producer)


def test_errors_are_feedstore_exceptions(daemon, tmp_path):
    with pytest.raises(feedstore.ConnectError) as e:
        feedstore.Client(str(tmp_path / "nobody.sock"))
    assert isinstance(e.value, ConnectionError) and "is the daemon running" in str(e.value)
    with pytest.raises(feedstore.InvalidArgument):
        feedstore.Stream("bad", 10, rank=4, world=2, socket=daemon.socket)
    with pytest.raises(feedstore.InvalidArgument):
        feedstore.Stream("bad", 10, shuffle="sideways", socket=daemon.socket)
    with pytest.raises(feedstore.Timeout) as e:
        feedstore.Stream("nobody-made-this", 10, socket=daemon.socket, wait=0.3)
    assert "is a producer" in str(e.value)
    writers = [feedstore.Writer(name, 10, socket=daemon.socket) for name in ("spec", "empty")]
    with feedstore.Stream("spec", 10, socket=daemon.socket):
        with pytest.raises(feedstore.StreamMismatch):
            feedstore.Stream("spec", 11, socket=daemon.socket)
        with pytest.raises(feedstore.RankInUse) as e:
            feedstore.Stream("spec", 10, socket=daemon.socket)
        assert isinstance(e.value, RuntimeError) and "already has a consumer" in str(e.value)
    with pytest.raises(feedstore.Timeout) as e:
        next(feedstore.Stream("empty", 10, socket=daemon.socket, wait=0.3))
    assert isinstance(e.value, TimeoutError) and "are producers running" in str(e.value)
    del writers
    # Larger than any segment: never fits, and says so (code retrying on Full would loop).
    with pytest.raises(feedstore.TooLarge) as e:
        feedstore.Client(daemon.socket, writer=True).put(np.zeros(300 << 20, dtype=np.uint8))
    assert isinstance(e.value, ValueError) and not isinstance(e.value, feedstore.Full)
    assert "--segment-size" in str(e.value), "names the remedy"
    with pytest.raises(feedstore.NotFound):
        feedstore.Client(daemon.socket).get("1:1:7")
    with pytest.raises(feedstore.FeedstoreError):
        feedstore.Client(daemon.socket).get("not a handle")


def test_killing_a_python_reader_releases_its_leases(daemon):
    writer = feedstore.Client(daemon.socket, writer=True)
    handles = [writer.put(np.full((256, 256, 3), i, dtype=np.uint8)) for i in range(5)]
    reader = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                """
                import sys, feedstore
                client = feedstore.Client(sys.argv[1])
                held = [client.get(h).images[0] for h in sys.stdin.readline().split()]
                print(sum(int(a[0, 0, 0]) for a in held), flush=True)
                sys.stdin.readline()  # hold them until killed
                """
            ),
            daemon.socket,
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    reader.stdin.write(" ".join(handles) + "\n")
    reader.stdin.flush()
    assert reader.stdout.readline() == f"{sum(range(5))}\n"
    before = daemon.wait_for("the reader's leases", lambda s: s["leases"] == 5)
    reader.kill()
    reader.wait()
    after = daemon.wait_for("the leases to be reclaimed", lambda s: s["leases"] == 0)
    assert after["leases_reclaimed"] - before["leases_reclaimed"] == 5
    for i, h in enumerate(handles):  # nothing was lost
        assert feedstore.Client(daemon.socket).get(h).images[0][0, 0, 0] == i


@pytest.mark.parametrize("made", [False, True], ids=["for-the-stream", "for-a-sample"])
def test_ctrl_c_interrupts_a_wait(daemon, made):
    # Waiting for a producer to create the stream, or for a sample of a stream nobody feeds.
    writer = feedstore.Writer("nobody-feeds-this", 10, socket=daemon.socket) if made else None
    waiter = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                """
                import signal, sys, feedstore
                # Ctrl-C raises, as in a terminal (not ignored, as a background run inherits it).
                signal.signal(signal.SIGINT, signal.default_int_handler)
                print("waiting", flush=True)
                stream = feedstore.Stream("nobody-feeds-this", 10, socket=sys.argv[1], wait=600)
                next(stream)
                """
            ),
            daemon.socket,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert waiter.stdout.readline() == "waiting\n"
    daemon.wait_for("the reader to connect", lambda s: s["clients"] >= 1 + bool(writer))
    waiter.send_signal(signal.SIGINT)
    _, err = waiter.communicate(timeout=60)  # a hang fails here, long before the 600 s wait
    assert "KeyboardInterrupt" in err, err
    assert waiter.returncode != 0


def test_a_held_array_outlives_a_reopen_and_a_refilled_store(daemon):
    """Issue 11's reproduction: an array kept from a stream whose rank is reopened at a later
    position, while other work fills the store, still reads its own sample's bytes."""
    import torch

    writer = feedstore.Writer("s", 16, shuffle="none", socket=daemon.socket, depth=8)

    def feed():
        while (tasks := writer.take(max=8, wait=0.05)) is not None:
            for task in tasks:
                writer.put(task, np.full((64, 64, 3), task.record + 1, dtype=np.uint8))
            if not tasks:
                return

    feed()
    st = feedstore.Stream("s", records=16, rank=0, world=1, shuffle="none", socket=daemon.socket)
    a0 = next(st).images[0]  # a read-only array the user keeps (value 1 everywhere)
    tensor = torch.from_dlpack(next(st).image(0))  # and a tensor (value 2)
    next(st)
    state = st.state()
    del st  # the stream object goes; the array and the tensor stay
    gc.collect()
    st = feedstore.Stream("s", 16, shuffle="none", state=state, socket=daemon.socket)
    feed()
    c = feedstore.Client(daemon.socket, writer=True)
    for _ in range(3000):  # other work fills the store
        try:
            c.put(np.full(150000, 0xAB, np.uint8))
        except feedstore.Full:
            pass
    assert (a0 == 1).all() and int(tensor.min()) == int(tensor.max()) == 2
    assert next(st).record == 3  # the reopened rank continues where it stood
    writer.close()  # a close by the producer does not end the views either
    for _ in range(3000):
        try:
            c.put(np.full(150000, 0xAB, np.uint8))
        except feedstore.Full:
            pass
    assert (a0 == 1).all() and int(tensor.min()) == int(tensor.max()) == 2
    del a0, tensor, st
    gc.collect()
    c.flush()
    daemon.wait_for("every lease back", lambda s: s["leases"] == 0)


def test_a_stream_goes_on_across_a_daemon_killed_and_started_again(daemon, tmp_path, monkeypatch):
    """Issue 37: with FEEDSTORE_RECONNECT_TIMEOUT set, a reader and a producer whose daemon is
    killed (kill -9) and started again on the same socket 0.2 s later go on by themselves: the
    reader gets every sample once, and an array it read before the kill still reads its own
    bytes after it."""
    monkeypatch.setenv("FEEDSTORE_RECONNECT_TIMEOUT", "30")
    records = 24
    producer = produce(daemon, tmp_path, "restart", records, "--world", "1")
    stream = feedstore.Stream("restart", records, socket=daemon.socket, wait=60)
    first = next(stream)
    kept, expected = first.images[0], first.images[0].copy()
    seen = [first.record] + [next(stream).record for _ in range(7)]
    del first
    daemon.kill_and_start_again(pause=0.2)
    seen += [sample.record for sample in stream]
    finish(producer)
    assert sorted(seen) == list(range(records)), seen
    assert stream.reattached == 1
    assert np.array_equal(kept, expected)


def test_a_forked_child_leaves_the_parents_leases_alone(daemon):
    """A process forked from a reader (a DataLoader worker, say) cannot use its parent's client,
    and dropping an inherited sample does not return the parent's lease."""
    import os

    writer = feedstore.Client(daemon.socket, writer=True)
    handle = writer.put(np.full(4096, 5, np.uint8))
    reader = feedstore.Client(daemon.socket)
    sample = reader.get(handle)
    pid = os.fork()
    if pid == 0:  # the child: report through the exit code only
        code = 3
        try:
            try:
                reader.get(handle)
                code = 1
            except feedstore.FeedstoreError as e:
                code = 0 if "fork" in str(e) else 2
            del sample  # the inherited view goes: it must not return the parent's lease
            gc.collect()
            reader.flush()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0
    reader.flush()
    assert daemon.stats()["leases"] == 1, "the parent still holds its lease"
    assert (sample.images[0] == 5).all()
    del sample
    gc.collect()
    reader.flush()
    daemon.wait_for("the parent's lease back", lambda s: s["leases"] == 0)


def test_a_consumer_depth_is_ignored_with_a_warning(daemon):
    feedstore.Writer("deep", 4, socket=daemon.socket, depth=2)
    with pytest.warns(DeprecationWarning, match="depth"):
        feedstore.Stream("deep", 4, socket=daemon.socket, depth=64).close()


def test_a_stream_reports_what_it_measured(daemon):
    writer = feedstore.Writer("measured", 3, shuffle="none", socket=daemon.socket)
    for task in writer.take(max=3, wait=5.0):
        writer.put(task, np.full((8, 8, 3), task.record, dtype=np.uint8))
    stream = feedstore.Stream("measured", 3, shuffle="none", socket=daemon.socket, wait=30)
    before = stream.figures()
    assert before["taken"] == 0 and before["first_sample"] is None
    samples = [next(stream) for _ in range(3)]
    figures = stream.figures()
    assert figures["taken"] == 3
    assert figures["first_sample"] is not None and figures["first_sample"] > 0
    assert 0 <= figures["waited"] <= figures["elapsed"]
    assert figures["wait_ratio"] == pytest.approx(figures["waited"] / figures["elapsed"])
    assert figures["first_sample"] == pytest.approx(stream.time_to_first_sample, abs=1e-6)
    del samples


def test_a_writer_finding_no_task_says_what_it_waits_for(daemon):
    writer = feedstore.Writer("stalled", 8, shuffle="none", socket=daemon.socket, depth=2)
    stream = feedstore.Stream("stalled", 8, shuffle="none", socket=daemon.socket, wait=30)
    with pytest.warns(UserWarning, match="1 of 1 ranks have a reader attached") as told:
        for _ in range(20):  # a bound: the warning comes after 5 s of empty takes
            tasks = writer.take(max=4, wait=0.5)
            for task in tasks:
                writer.put(task, np.zeros((8, 8, 3), dtype=np.uint8))
            if any("Writer.take found no task" in str(w.message) for w in told):
                break
    (message,) = [str(w.message) for w in told if "stalled" in str(w.message)]
    assert "2 samples made and not returned" in message, message
    stream.close()
    writer.close()


def test_waiting_for_a_stream_nobody_made_says_so_while_it_waits(daemon):
    with pytest.warns(UserWarning, match="no producer of this user has created it") as told:
        with pytest.raises(feedstore.Timeout):
            feedstore.Stream("nobody-yet", 10, socket=daemon.socket, wait=4.5)
    assert sum("nobody-yet" in str(w.message) for w in told) == 1, "said once"


@pytest.mark.parametrize("value", ["30s", "abc", "-1"])
def test_a_reconnect_timeout_that_is_not_seconds_is_warned_about_at_import(value):
    import os

    env = dict(os.environ, FEEDSTORE_RECONNECT_TIMEOUT=value)
    out = subprocess.run(
        [sys.executable, "-W", "always", "-c", "import feedstore"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert "is not a number of seconds" in out.stderr, out.stderr
    fine = subprocess.run(
        [sys.executable, "-W", "always", "-c", "import feedstore"],
        env=dict(os.environ, FEEDSTORE_RECONNECT_TIMEOUT="60"),
        capture_output=True,
        text=True,
        check=True,
    )
    assert "FEEDSTORE_RECONNECT_TIMEOUT" not in fine.stderr
