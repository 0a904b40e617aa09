"""``batchq demo``: Fuel's server tutorial, in-process and served, side by side.

The experiment (Fuel's docs, "Using the data server"): 1000 examples of 128 features,
batches of 100, a Bottleneck transformer that spends ``load_ms`` per batch loading, and
a "training" step of ``train_ms`` per batch. In-process the two add up; served, the
producers load while the trainer trains, and the time approaches the floor (the sum
of the training steps).

With ``--json`` stdout holds exactly one JSON document, the results: the progress lines
(and whatever the producer processes print) go to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from batchq.client.connection import describe_url, make_client
from batchq.errors import ConfigError, ProducersLost
from batchq.host.embedded import url_or_embedded
from batchq.host.procs import spawn, stop_group
from batchq.protocol.keys import QueueKeys
from producer.datasets import IndexableDataset
from producer.schemes import ShuffledScheme
from producer.streams import DataStream
from producer.transformers import Transformer

if TYPE_CHECKING:
    from consumer import ServerDataStream

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
        # An array, not Fuel's list of lists: served, the lists would arrive as this
        # very array (as from Fuel's server), once numpy converted every int of each batch;
        # in-process they would stay lists.
        IndexableDataset({"features": np.zeros((examples, features), dtype=np.int64)}),
        iteration_scheme=ShuffledScheme(examples=examples, batch_size=batch_size),
    )
    return Bottleneck(stream, slowdown=load_ms / 1000)


def _train(
    epochs: int,
    get_iterator: Any,
    train_s: float,
    label: str,
    describe: Callable[[], str] | None = None,
) -> dict[str, Any]:
    """Run `epochs` epochs, sleeping train_s per batch; report times and stall.

    ``describe()`` adds to each epoch's line (the queue's depth and the verdict); the
    time it takes is left out of the figures.
    """
    start = time.perf_counter()
    per_epoch = []
    batches = 0
    waited = 0.0
    trained = 0.0
    aside = 0.0  # time spent describing, not training
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
        extra = ""
        if describe is not None:
            d0 = time.perf_counter()
            extra = f"; {describe()}"
            aside += time.perf_counter() - d0
        print(
            f"  {label:<10} epoch {epoch + 1}/{epochs}: {n} batches in {dt:6.3f} s, "
            f"waiting for data {100 * stall / dt:5.1f}% of it{extra}",
            flush=True,
        )
    total = time.perf_counter() - start - aside
    return {
        "time_s": total,
        "batches": batches,
        "wait_s": waited,
        "train_s": trained,
        "epochs_s": per_epoch,
    }


def _wait_exit(proc: Any, timeout_s: float) -> int | None:
    """The exit code of a producer that should exit on its own; stopped if it does not."""
    try:
        return int(proc.wait(timeout=timeout_s))
    except subprocess.TimeoutExpired:
        return stop_group(proc, timeout_s=5.0)


def _describer(client: Any, queue: str, stream: ServerDataStream) -> Callable[[], str]:
    """The served epoch lines' ending: queue depth, the trainer's rate, the verdict."""
    # The trainer side is imported where the trainer runs: every producer serving
    # tutorial_stream (the demo's, the tests') imports this module, and the monitoring
    # and consumer modules were a third of its import.
    from batchq.monitoring.rows import queue_status
    from batchq.monitoring.verdict import judge

    def describe() -> str:
        row = queue_status(client, queue)
        figures = stream.stats  # the epoch that just ended
        verdict, _ = judge(
            trainer="attached",
            producers_alive=row["producers_alive"],
            depths=[row["depth"]],
            hwm=row["hwm"],
            stall=figures["stall_fraction_epoch"],
        )
        rate = figures["batches_per_s"]
        return f"queue {row['depth']}/{row['hwm']}, {rate:.0f} batches/s, {verdict}"

    return describe


def _wait_for_producers(url: str, queue: str, count: int, timeout_s: float = 60.0) -> None:
    """Wait (bounded) until `count` producers have joined the queue."""
    from batchq.monitoring.rows import queue_status  # the trainer side's (_describer)

    client = make_client(url, key=QueueKeys(queue).meta)
    deadline = time.monotonic() + timeout_s
    try:
        while queue_status(client, queue)["producers_alive"] < count:
            if time.monotonic() > deadline:
                raise ProducersLost(0, [], timeout_s)
            time.sleep(0.05)
    finally:
        client.close()


def _served(url: str, producers: int, args: argparse.Namespace, load_ms: float) -> dict[str, Any]:
    """Run the trainer against `producers` producer processes on a queue of its own."""
    from consumer import ServerDataStream  # the trainer side's (_describer)

    queue = f"{QUEUE}-{producers}"
    env = dict(os.environ)
    env.update(
        {
            _ENV + "EXAMPLES": str(args.examples),
            _ENV + "FEATURES": str(args.features),
            _ENV + "BATCH_SIZE": str(args.batch_size),
            _ENV + "LOAD_MS": str(load_ms),
        }
    )
    argv = [sys.executable, "-m", "batchq.cli", "--log-level", "WARNING", "serve"]
    argv += ["batchq.cli.demo:tutorial_stream", "--url", url, "--queue", queue]
    argv += ["--hwm", str(args.hwm)]
    # With --json, stdout is the results' alone: the producers' goes to our stderr.
    out = _stderr_fd() if args.json else None
    procs = [spawn(argv, env=env, stdout=out) for _ in range(producers)]
    label = _producers_label(producers)
    try:
        print(f"served by {label} via {describe_url(url)}, queue {queue!r}:")
        with ServerDataStream(
            ("features",), False, url=url, hwm=args.hwm, queue=queue, timeout_s=30
        ) as stream:
            # Like Fuel's tutorial, where the server is started first: the clock starts
            # once the producers are up (len() waits for their plan).
            print(f"  waiting for the producers to start ... {len(stream)} batches per epoch")
            _wait_for_producers(url, queue, producers)
            client = make_client(url, key=QueueKeys(queue).meta)
            try:
                describe = _describer(client, queue, stream)
                result = _train(
                    args.epochs, stream.get_epoch_iterator, args.train_ms / 1000, label, describe
                )
            finally:
                client.close()
            stream.close(finished=True)
        # The finished run makes each producer exit 0 by itself.
        result["exit_codes"] = [_wait_exit(p, timeout_s=30.0) for p in procs]
    finally:
        for p in procs:
            stop_group(p, timeout_s=5.0)
    return result


def _stderr_fd() -> int:
    """The file descriptor of our stderr (2 where sys.stderr has none: a captured one)."""
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return 2


def _check_counts(args: argparse.Namespace) -> None:
    """Refuse a count option under 1."""
    for name in ("producers", "epochs", "examples", "features", "batch_size", "hwm"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(args, name)!r}: expected >= 1")


def _producers_label(n: int) -> str:
    return f"{n} producer{'s' if n > 1 else ''}"


def _print_table(runs: dict[str, dict[str, Any]], floor: float) -> None:
    """Each run's time against the floor and its waiting, and the speed-up of serving."""
    print()
    print(f"{'':24}{'time (s)':>10}{'vs floor':>10}{'waiting':>10}")
    for name, r in runs.items():
        wait = 100 * r["wait_s"] / r["time_s"]
        print(f"{name:24}{r['time_s']:10.3f}{r['time_s'] / floor:10.2f}{wait:9.1f}%")
    print(f"{'floor (training only)':24}{floor:10.3f}{1:10.2f}")
    best = min(r["time_s"] for name, r in runs.items() if name != "in-process")
    print(f"speed-up of serving: {runs['in-process']['time_s'] / best:.2f}x")


def _experiment(args: argparse.Namespace, load_ms: float) -> dict[str, dict[str, Any]]:
    """The in-process run, then the served ones (on an embedded redis-server unless
    ``--url``): each run's figures by its name."""
    stream = tutorial_stream(args.examples, args.features, args.batch_size, load_ms)
    print(
        f"tutorial: {args.epochs} epochs of {args.examples} examples x {args.features}, "
        f"batch {args.batch_size}, loading {load_ms:g} ms and training "
        f"{args.train_ms:g} ms per batch"
    )
    print("in-process (loading and training take turns):")
    runs = {
        "in-process": _train(
            args.epochs, stream.get_epoch_iterator, args.train_ms / 1000, "in-process"
        )
    }
    counts = [1] if args.producers == 1 else [1, args.producers]
    with url_or_embedded(args.url) as url:
        if not args.url:
            print(f"started an embedded redis-server at {url} (stopped at the end)")
        for n in counts:
            runs[f"served ({_producers_label(n)})"] = _served(url, n, args, load_ms)
    return runs


def _report(runs: dict[str, dict[str, Any]], as_json: bool) -> list[int]:
    """Print the runs (the table, or JSON); the served producers' exit codes."""
    served = [r for name, r in runs.items() if name != "in-process"]
    floor = min(r["train_s"] for r in served)  # the trainer's own measured training time
    codes = [c for r in served for c in r["exit_codes"]]
    if as_json:
        out = {name: {k: v for k, v in r.items() if k != "epochs_s"} for name, r in runs.items()}
        print(json.dumps({"runs": out, "floor_s": floor, "producer_exit_codes": codes}, indent=2))
    else:
        _print_table(runs, floor)
    return codes


def run_demo(args: argparse.Namespace) -> int:
    """Run the experiment and print the table, or with ``--json`` the results as one
    JSON document on stdout (the progress on stderr)."""
    _check_counts(args)
    # With several producers the point is a data-bound pipeline: loading slower than
    # training, which one producer cannot hide and several can.
    load_ms = args.load_ms if args.load_ms is not None else (5.0 if args.producers == 1 else 25.0)
    progress = contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext()
    with progress:
        runs = _experiment(args, load_ms)
    codes = _report(runs, args.json)
    return 0 if all(c == 0 for c in codes) else 1
