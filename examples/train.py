"""The trainer of the docker-compose stack: reads the queue, reports time and stall per epoch.

``python -m examples.train`` connects to ``BATCHQ_URL``, reads ``--epochs`` epochs from
queue ``BATCHQ_QUEUE`` with a :class:`consumer.ServerDataStream`, spends ``--train-ms``
per batch "training", and prints, for every epoch, its time and its *stall*: the share
of that time the trainer spent waiting for data. At the end it finishes the run
(``close(finished=True)``), so every producer exits 0 and, with ``restart: on-failure``,
stays down.

Every flag defaults to an environment variable, so the compose file configures it:

==================  ====================  =========  ===================================
flag                variable              default    meaning
==================  ====================  =========  ===================================
``--url``           ``BATCHQ_URL``        localhost  Redis URL (redis://, rediss://)
``--queue``         ``BATCHQ_QUEUE``      tutorial   the queue to read
``--epochs``        ``BATCHQ_EPOCHS``     5          epochs to read before finishing
``--train-ms``      ``BATCHQ_TRAIN_MS``   10         simulated training time per batch
``--hwm``           ``BATCHQ_PREFETCH``   10         batches prefetched ahead
``--timeout-s``     ``BATCHQ_TIMEOUT_S``  60         give up when no producer is alive
==================  ====================  =========  ===================================

Exit codes: 0 when every epoch was read and the run finished, 2 on a batchq error (no
producers, a producer's pipeline raised, ...), 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from batchq.client.connection import ENV_URL, describe_url, resolve_url
from batchq.errors import BatchQueueError
from consumer import ServerDataStream

__all__ = ["EpochReport", "main", "train"]

SOURCES = ("features",)


def _positive(
    kind: type[int] | type[float], allow_zero: bool = False
) -> Callable[[str], int | float]:
    """An argparse ``type`` accepting numbers > 0 (>= 0 with ``allow_zero``)."""

    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not valid: expected {'a' if kind is float else 'an'} {kind.__name__}"
            ) from None
        if value < 0 or (value == 0 and not allow_zero):
            raise argparse.ArgumentTypeError(
                f"{text!r} is not valid: expected {'>=' if allow_zero else '>'} 0"
            )
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


def build_parser() -> argparse.ArgumentParser:
    """The command line of the example trainer (defaults from the environment)."""
    env = os.environ.get
    parser = argparse.ArgumentParser(
        prog="python -m examples.train",
        description="Read epochs from a batchq queue, print time and stall per epoch, then "
        "finish the run so that the producers exit 0.",
    )
    parser.add_argument("--url", default=env(ENV_URL), help=f"Redis URL (default ${ENV_URL})")
    parser.add_argument(
        "--queue",
        default=env("BATCHQ_QUEUE", "tutorial"),
        help="the queue (default $BATCHQ_QUEUE, else tutorial)",
    )
    parser.add_argument(
        "--epochs",
        type=_positive(int),
        default=env("BATCHQ_EPOCHS", "5"),
        help="epochs to read (default $BATCHQ_EPOCHS, else 5)",
    )
    parser.add_argument(
        "--train-ms",
        type=_positive(float, allow_zero=True),
        default=env("BATCHQ_TRAIN_MS", "10"),
        help="simulated training time per batch (default $BATCHQ_TRAIN_MS, else 10)",
    )
    parser.add_argument(
        "--hwm",
        type=_positive(int),
        default=env("BATCHQ_PREFETCH", "10"),
        help="batches the trainer prefetches (default $BATCHQ_PREFETCH, else 10)",
    )
    parser.add_argument(
        "--timeout-s",
        type=_positive(float),
        default=env("BATCHQ_TIMEOUT_S", "60"),
        help="give up after this long without a live producer (default $BATCHQ_TIMEOUT_S, else 60)",
    )
    return parser


@dataclass(frozen=True)
class EpochReport:
    """What one epoch took.

    Attributes:
        epoch: the epoch's number (0-based).
        batches: batches read.
        time_s: wall time of the epoch.
        wait_s: time spent waiting for the next batch.
    """

    epoch: int
    batches: int
    time_s: float
    wait_s: float

    @property
    def stall(self) -> float:
        """The share of the epoch's time spent waiting for data (0..1)."""
        return self.wait_s / self.time_s if self.time_s > 0 else 0.0


def train(stream: ServerDataStream, epochs: int, train_s: float) -> list[EpochReport]:
    """Read ``epochs`` epochs, "training" ``train_s`` per batch; print a line per epoch.

    Args:
        stream: the trainer's stream.
        epochs: how many epochs to read.
        train_s: seconds of simulated training per batch.

    Returns:
        One report per epoch.
    """
    reports = []
    for _ in range(epochs):
        start = time.perf_counter()
        batches, wait_s = 0, 0.0
        iterator = stream.get_epoch_iterator()
        while True:
            asked = time.perf_counter()
            try:
                (_features,) = next(iterator)  # your model takes the batch here
            except StopIteration:
                wait_s += time.perf_counter() - asked
                break
            wait_s += time.perf_counter() - asked
            batches += 1
            time.sleep(train_s)  # the training step: replace with your model's
        report = EpochReport(stream.epoch, batches, time.perf_counter() - start, wait_s)
        reports.append(report)
        print(
            f"epoch {report.epoch + 1}/{epochs}: {report.batches} batches in "
            f"{report.time_s:.3f} s, stall {100 * report.stall:.1f}%",
            flush=True,
        )
    return reports


def main(argv: Sequence[str] | None = None) -> int:
    """Run the example trainer; returns the exit code."""
    args = build_parser().parse_args(argv)
    try:
        url = resolve_url(args.url)
        print(f"trainer: reading queue {args.queue!r} at {describe_url(url)}", flush=True)
        with ServerDataStream(
            SOURCES, False, hwm=args.hwm, queue=args.queue, url=url, timeout_s=args.timeout_s
        ) as stream:
            print(f"trainer: {len(stream)} batches per epoch", flush=True)
            reports = train(stream, args.epochs, args.train_ms / 1000)
            stream.close(finished=True)  # every producer exits 0
    except BatchQueueError as e:
        print(f"trainer: {e}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        return 130
    total = sum(r.time_s for r in reports)
    waited = sum(r.wait_s for r in reports)
    print(
        f"trainer: finished {len(reports)} epochs, {sum(r.batches for r in reports)} batches "
        f"in {total:.3f} s, stall {100 * waited / total if total else 0.0:.1f}%; "
        "the run is finished, producers exit 0",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
