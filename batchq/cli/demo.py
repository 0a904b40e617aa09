"""``batchq demo``: Fuel's server tutorial, in-process and served, side by side.

The experiment (Fuel's docs, "Using the data server"): 1000 examples of 128 features,
batches of 100, a Bottleneck transformer that spends ``load_ms`` per batch loading, and
a "training" step of ``train_ms`` per batch. In-process the two add up; served, the
producers load while the trainer trains, and the time approaches the floor (the sum
of the training steps).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

from batchq.connection import describe_url, resolve_url
from batchq.errors import ConfigError
from batchq.procs import spawn, stop_group
from consumer import ServerDataStream
from producer.datasets import IndexableDataset
from producer.schemes import ShuffledScheme
from producer.streams import DataStream
from producer.transformers import Transformer

__all__ = ["Bottleneck", "run_demo", "tutorial_stream"]

QUEUE = "demo"
_ENV = "BATCHQ_DEMO_"


class Bottleneck(Transformer):
    """Fuel's tutorial transformer, unchanged: a fixed loading delay per batch."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.slowdown = kwargs.pop("slowdown", 0)
        super().__init__(*args, **kwargs)

    def get_data(self, request: Any = None) -> Any:
        if request is not None:
            raise ValueError
        time.sleep(self.slowdown)
        return next(self.child_epoch_iterator)


def tutorial_stream(
    examples: int | None = None,
    features: int | None = None,
    batch_size: int | None = None,
    load_ms: float | None = None,
) -> Any:
    """The tutorial's stream; unset arguments come from BATCHQ_DEMO_* (for `serve`)."""
    examples = examples or int(os.environ.get(_ENV + "EXAMPLES", "1000"))
    features = features or int(os.environ.get(_ENV + "FEATURES", "128"))
    batch_size = batch_size or int(os.environ.get(_ENV + "BATCH_SIZE", "100"))
    if load_ms is None:
        load_ms = float(os.environ.get(_ENV + "LOAD_MS", "5"))
    stream = DataStream.default_stream(
        IndexableDataset({"features": [[0] * features] * examples}),
        iteration_scheme=ShuffledScheme(examples=examples, batch_size=batch_size),
    )
    return Bottleneck(stream, slowdown=load_ms / 1000)


def _train(epochs: int, get_iterator: Any, train_s: float, label: str) -> dict[str, Any]:
    """Run `epochs` epochs, sleeping train_s per batch; report times and stall."""
    start = time.perf_counter()
    per_epoch = []
    batches = 0
    waited = 0.0
    trained = 0.0
    for epoch in range(epochs):
        t0 = time.perf_counter()
        n = 0
        stall = 0.0
        it = get_iterator()
        while True:
            w0 = time.perf_counter()
            try:
                next(it)
            except StopIteration:
                break
            t1 = time.perf_counter()
            stall += t1 - w0
            time.sleep(train_s)  # the "training step"
            trained += time.perf_counter() - t1
            n += 1
        dt = time.perf_counter() - t0
        per_epoch.append(dt)
        batches += n
        waited += stall
        print(
            f"  {label:<10} epoch {epoch + 1}/{epochs}: {n} batches in {dt:6.3f} s, "
            f"waiting for data {100 * stall / dt:5.1f}% of it",
            flush=True,
        )
    total = time.perf_counter() - start
    return {
        "time_s": total,
        "batches": batches,
        "wait_s": waited,
        "train_s": trained,
        "epochs_s": per_epoch,
    }


@contextlib.contextmanager
def _redis(url: str | None) -> Iterator[str]:
    if url:
        yield resolve_url(url)
        return
    from batchq.embedded import EmbeddedRedis

    with EmbeddedRedis() as server:
        print(f"started an embedded redis-server at {server.url} (stopped at the end)")
        yield server.url


def run_demo(args: argparse.Namespace) -> int:
    """Run the experiment and print the table (or JSON)."""
    for name in ("producers", "epochs", "examples", "features", "batch_size", "hwm"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(args, name)!r}: expected >= 1")
    train_s = args.train_ms / 1000
    stream = tutorial_stream(args.examples, args.features, args.batch_size, args.load_ms)
    print(
        f"tutorial: {args.epochs} epochs of {args.examples} examples x {args.features}, "
        f"batch {args.batch_size}, loading {args.load_ms:g} ms and training "
        f"{args.train_ms:g} ms per batch"
    )
    print("in-process (loading and training take turns):")
    local = _train(args.epochs, stream.get_epoch_iterator, train_s, "in-process")

    with _redis(args.url) as url:
        env = dict(os.environ)
        env.update(
            {
                _ENV + "EXAMPLES": str(args.examples),
                _ENV + "FEATURES": str(args.features),
                _ENV + "BATCH_SIZE": str(args.batch_size),
                _ENV + "LOAD_MS": str(args.load_ms),
            }
        )
        argv = [
            sys.executable,
            "-m",
            "batchq.cli",
            "--log-level",
            "WARNING",
            "serve",
            "batchq.cli.demo:tutorial_stream",
            "--url",
            url,
            "--queue",
            QUEUE,
            "--hwm",
            str(args.hwm),
        ]
        procs = [spawn(argv, env=env) for _ in range(args.producers)]
        try:
            print(f"served by {args.producers} producer process(es) via {describe_url(url)}:")
            with ServerDataStream(
                ("features",), False, url=url, hwm=args.hwm, queue=QUEUE, timeout_s=30
            ) as served_stream:
                # Like Fuel's tutorial, where the server is started first: the clock
                # starts once the producers are up (len() waits for their plan).
                print(
                    f"  waiting for the producer(s) to start ... {len(served_stream)} "
                    "batches per epoch"
                )
                served = _train(args.epochs, served_stream.get_epoch_iterator, train_s, "served")
                served_stream.close(finished=True)
            codes = [stop_group(p, timeout_s=10.0) for p in procs]
        finally:
            for p in procs:
                stop_group(p, timeout_s=5.0)

    floor = served["train_s"]  # the trainer's own measured training time
    result = {
        "in_process_s": local["time_s"],
        "served_s": served["time_s"],
        "floor_s": floor,
        "speedup": local["time_s"] / served["time_s"],
        "served_over_floor": served["time_s"] / floor,
        "served_wait_fraction": served["wait_s"] / served["time_s"],
        "producers": args.producers,
        "producer_exit_codes": codes,
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print()
        print(f"{'':24}{'time (s)':>10}{'vs floor':>10}")
        print(f"{'in-process':24}{local['time_s']:10.3f}{local['time_s'] / floor:10.2f}")
        label = f"served ({args.producers} producer{'s' if args.producers > 1 else ''})"
        print(f"{label:24}{served['time_s']:10.3f}{served['time_s'] / floor:10.2f}")
        print(f"{'floor (training only)':24}{floor:10.3f}{1:10.2f}")
        print(f"speed-up of serving: {result['speedup']:.2f}x")
    return 0 if all(c == 0 for c in codes) else 1
