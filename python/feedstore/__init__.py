"""feedstore for Python: samples read in place from the node's shared-memory store.

A trainer rank opens its share of a stream and iterates samples whose arrays are read-only numpy
views of the store's memory (no copy, no pickling)::

    import feedstore

    with feedstore.Stream("sft", records=10_000, rank=0, world=8, epochs=3) as stream:
        for sample in stream:
            pixels = sample.images[0]          # read-only numpy array in shared memory
            ids = sample.tokens                # uint32, in place
            image = torch.from_dlpack(sample.image(0))   # same pages, copy-on-write
            checkpoint["data"] = stream.state()          # exact resume

Python code can publish samples too (``Writer``), and ``feedstore.torch`` plugs streams into a
PyTorch ``DataLoader``. Every error is a ``feedstore.FeedstoreError``.
"""

# numpy is imported here, in Python, before the extension first needs its C API: a Ctrl-C
# during numpy's (slow, first) import then raises KeyboardInterrupt as usual, instead of
# interrupting an import the extension makes from inside Rust (which cannot recover).
import numpy  # noqa: F401

from feedstore._native import (
    Client,
    ConnectError,
    Disconnected,
    FeedstoreError,
    Full,
    InvalidArgument,
    InvalidSample,
    LimitReached,
    NotFound,
    PermissionDenied,
    Reservation,
    Sample,
    SampleFailed,
    Stream,
    RankInUse,
    StreamMismatch,
    Task,
    Tensor,
    Timeout,
    TooLarge,
    Unreachable,
    UntrustedBatch,
    Corrupt,
    WindowFull,
    Writer,
    __version__,
    reshard,
    state_at,
)

__all__ = [
    "Client",
    "ConnectError",
    "Disconnected",
    "FeedstoreError",
    "Full",
    "InvalidArgument",
    "InvalidSample",
    "LimitReached",
    "NotFound",
    "PermissionDenied",
    "Reservation",
    "Sample",
    "SampleFailed",
    "Stream",
    "RankInUse",
    "StreamMismatch",
    "Task",
    "Tensor",
    "Timeout",
    "TooLarge",
    "Unreachable",
    "UntrustedBatch",
    "Corrupt",
    "WindowFull",
    "Writer",
    "__version__",
    "reshard",
    "state_at",
]


def _check_reconnect_timeout():
    """Warns once, at import, about a ``FEEDSTORE_RECONNECT_TIMEOUT`` the clients ignore (the
    Rust half logs it, where Python shows nothing): it is a number of seconds."""
    import math
    import os
    import warnings

    text = os.environ.get("FEEDSTORE_RECONNECT_TIMEOUT")
    if text is None:
        return
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds >= 0):
        warnings.warn(
            f"FEEDSTORE_RECONNECT_TIMEOUT={text!r} is not a number of seconds (such as 60): "
            "clients do not reconnect when their daemon goes away",
            RuntimeWarning,
            stacklevel=3,
        )


_check_reconnect_timeout()
