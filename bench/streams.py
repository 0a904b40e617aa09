"""Streams for the benchmarks, importable by ``batchq serve`` (``streams:FACTORY``).

Put ``bench/`` on ``PYTHONPATH`` and serve one of:

* ``streams:constant_stream`` -- every request returns the same pre-built batch, so a
  producer measures batchq's own cost (encode, push, pop, decode) and not a pipeline's.
  Configured by environment variables, because ``batchq serve`` calls the factory with
  no arguments:

  ``BENCH_SHAPE``    the batch's shape, comma-separated (default ``128,3,32,32``)
  ``BENCH_DTYPE``    its numpy dtype (default ``float32``)
  ``BENCH_BATCHES``  requests (batches) per epoch (default ``300``)

* ``streams:tutorial_stream`` -- the tutorial's stream (:mod:`batchq.cli.demo`), reused.

Run as a script, this module serves ``constant_stream()`` through
:func:`producer.start_server` with ``inline_max_bytes`` raised above the frame size, so
that frames travel inside the capped-push script (a Producer option ``batchq serve``
does not expose)::

    python bench/streams.py --url URL --queue Q --hwm H --inline
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from batchq.cli.demo import tutorial_stream
from producer.datasets import Dataset
from producer.schemes import ConstantScheme
from producer.streams import DataStream

__all__ = ["ENV_BATCHES", "ENV_DTYPE", "ENV_SHAPE", "ConstantBatch", "constant_stream", "main"]

ENV_SHAPE = "BENCH_SHAPE"
ENV_DTYPE = "BENCH_DTYPE"
ENV_BATCHES = "BENCH_BATCHES"
DEFAULT_SHAPE = (128, 3, 32, 32)
DEFAULT_DTYPE = "float32"
DEFAULT_BATCHES = 300

# Re-exported so that `batchq serve streams:tutorial_stream` works with bench/ on the path.
tutorial_stream = tutorial_stream


def parse_shape(text: str) -> tuple[int, ...]:
    """Parse ``"128,3,32,32"`` (or ``128x3x32x32``) into a shape tuple.

    Raises:
        ValueError: a dimension is not a positive integer.
    """
    dims = tuple(int(d) for d in text.replace("x", ",").split(",") if d.strip())
    if not dims or any(d < 1 for d in dims):
        raise ValueError(f"shape {text!r}: expected positive integers, e.g. 128,3,32,32")
    return dims


def make_batch(shape: Sequence[int], dtype: str) -> np.ndarray:
    """A deterministic, non-constant batch (so nothing could compress or dedupe it)."""
    n = int(np.prod(shape))
    return (np.arange(n, dtype=np.int64) % 251).astype(dtype).reshape(tuple(shape))


class ConstantBatch(Dataset):
    """A dataset whose every request returns the same pre-built array (source ``x``).

    Args:
        batch: the array to return; built once, never copied here.
    """

    provides_sources = ("x",)

    def __init__(self, batch: np.ndarray) -> None:
        super().__init__()
        self.batch = batch

    def get_data(self, state: Any = None, request: Any = None) -> tuple[Any, ...]:
        """Return ``(batch,)`` whatever the request (a batch size from ConstantScheme)."""
        return (self.batch,)


def constant_stream(
    shape: Sequence[int] | None = None, dtype: str | None = None, batches: int | None = None
) -> DataStream:
    """A stream of ``batches`` identical batches per epoch; unset arguments from BENCH_*.

    Args:
        shape: the batch's shape (default ``$BENCH_SHAPE`` or 128,3,32,32).
        dtype: its dtype (default ``$BENCH_DTYPE`` or float32).
        batches: batches per epoch (default ``$BENCH_BATCHES`` or 300).

    Returns:
        A DataStream over :class:`ConstantBatch` with a ConstantScheme of ``batches``
        requests: one request is one batch, and every request is its own shard.
    """
    if shape is None:
        env = os.environ.get(ENV_SHAPE)
        shape = parse_shape(env) if env else DEFAULT_SHAPE
    dtype = dtype or os.environ.get(ENV_DTYPE, DEFAULT_DTYPE)
    batches = batches or int(os.environ.get(ENV_BATCHES, str(DEFAULT_BATCHES)))
    batch = make_batch(shape, dtype)
    scheme = ConstantScheme(int(shape[0]), times=batches)
    return DataStream(ConstantBatch(batch), iteration_scheme=scheme)


def main(argv: Sequence[str] | None = None) -> int:
    """Serve ``constant_stream()`` with Producer options ``batchq serve`` lacks."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--queue", required=True)
    parser.add_argument("--hwm", type=int, default=10)
    parser.add_argument(
        "--inline", action="store_true", help="frames travel inside the push script"
    )
    args = parser.parse_args(argv)
    from producer import start_server

    options: dict[str, Any] = {"inline_max_bytes": 1 << 62} if args.inline else {}
    return start_server(constant_stream(), url=args.url, queue=args.queue, hwm=args.hwm, **options)


if __name__ == "__main__":
    sys.exit(main())
