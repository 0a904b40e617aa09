"""The torch adapter's device path on a CUDA machine: batches/s into a loop that trains on the GPU.

For each batch shape, in the same run against the same redis-server, alternating:

* ``loader``: ``DataLoader(dataset, batch_size=None, num_workers=2, pin_memory=True,
  persistent_workers=True)`` over one pre-built numpy batch per item; the loop copies
  each batch with ``.to(device, non_blocking=True)`` (PyTorch's own recipe);
* ``batchq``: ``batchq serve streams:constant_stream`` (the same pre-built batch) into
  ``TorchStream(stream, device='cuda')``: the reader thread copies each batch into a
  reused pinned buffer, the next ``prefetch`` batches go to the device on a side stream;
* ``batchq_to``: the same producer into a CPU ``TorchStream``; the loop calls
  ``.to(device)`` itself (what a user who names no device does).

The loop's step runs on the GPU: the batch's sum, then ``torch.cuda._sleep`` for about
``--step-ms``, then ``.item()`` of the sum (as ``loss.item()`` would). The ceiling is one
batch per step. Printed: batches/s (median of the repeats), each kind against the loader,
and each against the ceiling. Figures are printed, never asserted.

``--check`` then serves batches each filled with one value (a counter) through
``TorchStream(device='cuda', prefetch=4)`` under the same step and counts the device
batches that are not uniform: a pinned buffer reused while its copy was in flight, or a
device batch read before its copy ended, would mix two batches' values.

    python bench/cuda_path.py [--url URL] [--repeats 3] [--seconds 4] [--step-ms 5] [--check]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from itertools import count
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

from batchq.host.embedded import url_or_embedded
from batchq.host.procs import stop_group
from consumer import ServerDataStream
from consumer.torch import TorchStream
from producer.datasets import Dataset
from producer.schemes import ConstantScheme
from producer.streams import DataStream

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH_DIR)
from streams import ENV_BATCHES, ENV_DTYPE, ENV_SHAPE, parse_shape  # noqa: E402
from torch_loader import SHAPES, PrebuiltBatches  # noqa: E402
from torch_loader import _serve as serve  # noqa: E402

KINDS = ("loader", "batchq", "batchq_to")
warnings.filterwarnings("ignore", message="This DataLoader will create")


class StampedBatches(Dataset):
    """Each request gives a batch filled with the next value of a counter (source ``x``)."""

    provides_sources = ("x",)

    def __init__(self, shape: tuple[int, ...], dtype: str) -> None:
        super().__init__()
        self.shape, self.dtype = shape, dtype
        self.counter = count()

    def get_data(self, state: Any = None, request: Any = None) -> tuple[Any, ...]:
        """One uniform batch: its every element is the counter's next value mod 251."""
        return (np.full(self.shape, next(self.counter) % 251, dtype=self.dtype),)


def stamped_stream() -> DataStream:
    """``batchq serve cuda_path:stamped_stream``: uniform batches, shape from BENCH_*."""
    shape = parse_shape(os.environ.get(ENV_SHAPE, "64,3,224,224"))
    batches = int(os.environ.get(ENV_BATCHES, "200"))
    scheme = ConstantScheme(shape[0], times=batches)
    return DataStream(
        StampedBatches(shape, os.environ.get(ENV_DTYPE, "uint8")), iteration_scheme=scheme
    )


def sleep_cycles(step_ms: float) -> int:
    """The ``torch.cuda._sleep`` cycles that take about ``step_ms`` on this GPU."""
    probe = 10_000_000
    torch.cuda._sleep(probe)  # warm
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    torch.cuda._sleep(probe)
    torch.cuda.synchronize()
    return int(probe * step_ms / 1000 / (time.perf_counter() - t0))


def _serve(
    url: str, factory: str, shape: tuple[int, ...], dtype: str, args: Any
) -> tuple[Any, str]:
    return serve(url, shape, dtype, args, factory, ("--workers", str(args.workers)))


def _forever(source: Any) -> Iterator[Any]:
    while True:
        yield from source.get_epoch_iterator()


def measure(
    kind: str, url: str, shape: tuple[int, ...], dtype: str, cycles: int, args: Any
) -> float:
    """Batches/s of one run of ``kind`` after its first batch."""
    device = torch.device("cuda")
    proc = ts = None
    move: Callable[[Any], torch.Tensor]
    if kind == "loader":
        loader = DataLoader(
            PrebuiltBatches(shape, dtype, args.epoch_batches),
            batch_size=None,
            num_workers=2,
            pin_memory=True,
            persistent_workers=True,
        )

        def loader_batches() -> Iterator[Any]:
            while True:
                yield from loader

        batches: Iterator[Any] = loader_batches()
        move = lambda b: b.to(device, non_blocking=True)  # noqa: E731
    else:
        proc, queue = _serve(url, "streams:constant_stream", shape, dtype, args)
        stream = ServerDataStream(("x",), url=url, queue=queue, hwm=args.hwm, timeout_s=30)
        ts = TorchStream(stream, device=device if kind == "batchq" else None)
        batches = _forever(ts)
        move = (lambda b: b[0]) if kind == "batchq" else (lambda b: b[0].to(device))
    try:

        def step(batch: Any) -> None:
            total = move(batch).sum(dtype=torch.float32)
            torch.cuda._sleep(cycles)
            total.item()

        step(next(batches))
        t0, n = time.perf_counter(), 0
        while time.perf_counter() - t0 < args.seconds:
            step(next(batches))
            n += 1
        return n / (time.perf_counter() - t0)
    finally:
        if ts is not None:
            ts.stream.close(finished=True)
        if proc is not None:
            stop_group(proc, timeout_s=5.0)
        batches.close()  # type: ignore[attr-defined]


def check(url: str, cycles: int, args: Any) -> None:
    """Count device batches that are not uniform (a copy raced with a reuse)."""
    shape, dtype = (64, 3, 224, 224), "uint8"
    proc, queue = _serve(url, "cuda_path:stamped_stream", shape, dtype, args)
    stream = ServerDataStream(("x",), url=url, queue=queue, hwm=args.hwm, timeout_s=30)
    torn = seen = 0
    try:
        with TorchStream(stream, device="cuda", prefetch=4) as ts:
            for (x,) in _forever(ts):
                # Read the batch after a step's time on the loop's stream: a copy not
                # waited for, or its pinned source rewritten, shows as two values.
                torch.cuda._sleep(cycles)
                if int(x.amin()) != int(x.amax()):
                    torn += 1
                seen += 1
                if seen >= args.check_batches:
                    break
            pooled = ts.pool.allocated if ts.pool is not None else 0
    finally:
        stop_group(proc, timeout_s=5.0)
    print(f"check: {seen} batches of {shape} {dtype} on the device, {torn} not uniform; "
          f"pinned buffers allocated {pooled}", flush=True)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments, run the benchmark, print the table."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=None, help="Redis URL (default: an embedded server)")
    p.add_argument("--hwm", type=int, default=10, help="queue cap")
    p.add_argument("--workers", type=int, default=2, help="producer processes per run")
    p.add_argument("--repeats", type=int, default=3, help="runs per kind and shape")
    p.add_argument("--seconds", type=float, default=4.0, help="seconds per run")
    p.add_argument("--step-ms", type=float, default=5.0, help="the GPU step's duration")
    p.add_argument("--epoch-batches", type=int, default=200, help="batches per epoch")
    p.add_argument("--check", action="store_true", help="also count torn device batches")
    p.add_argument("--check-batches", type=int, default=400, help="batches the check reads")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA: torch.cuda.is_available() is False", file=sys.stderr)
        return 2
    cycles = sleep_cycles(args.step_ms)
    ceiling = 1000 / args.step_ms
    gpu = torch.cuda.get_device_name()
    print(f"torch {torch.__version__}, {gpu}, {os.cpu_count()} CPUs, step {args.step_ms} ms "
          f"({cycles} cycles): ceiling {ceiling:.0f} batches/s", flush=True)  # fmt: skip
    rows = []
    with url_or_embedded(args.url) as url:
        for label, shape, dtype in SHAPES:
            rates: dict[str, list[float]] = {k: [] for k in KINDS}
            for rep in range(1, args.repeats + 1):
                for kind in KINDS:
                    rates[kind].append(measure(kind, url, shape, dtype, cycles, args))
                    print(f"  {label:<20} {kind:<9} {rep}/{args.repeats}: "
                          f"{rates[kind][-1]:7.1f} batches/s", flush=True)  # fmt: skip
            rows.append((label, {k: statistics.median(v) for k, v in rates.items()}))
        if args.check:
            check(url, cycles, args)
    head = f"{'shape':<22}" + "".join(f"{k:>11}" for k in KINDS)
    head += f"{'batchq/loader':>15}{'batchq_to/loader':>18}{'batchq/ceiling':>16}"
    print(f"\n{head}\n{'-' * len(head)}")
    for label, m in rows:
        print(f"{label:<22}" + "".join(f"{m[k]:11.1f}" for k in KINDS)
              + f"{m['batchq'] / m['loader']:15.2f}{m['batchq_to'] / m['loader']:18.2f}"
              + f"{m['batchq'] / ceiling:16.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
