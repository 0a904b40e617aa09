"""The tutorial experiment (``batchq demo``), timed against its floor.

Fuel's server tutorial: 1000 examples of 128 features, batches of 100, a Bottleneck that
spends 5 ms loading each batch and a training step of 10 ms per batch, 5 epochs. Each
repeat runs it in-process (loading and training take turns) and served by one producer
process (``batchq serve streams:tutorial_stream``; the stream is
:func:`batchq.cli.demo.tutorial_stream`, reused).

* floor: the trainer's own training time, the sum of the sleeps as measured with
  ``perf_counter`` (a 10 ms sleep takes a little longer than 10 ms);
* served/floor: the served time over that floor (target <= 1.05);
* round trips: the Redis commands (a pipeline counts once) the trainer process sent,
  counted in this process by wrapping redis-py's ``send_packed_command``: per epoch,
  and inside each epoch boundary (from the end of an epoch's last training step to the
  arrival of the next epoch's first batch).

The served clock starts once the producer has published its plan (``len(stream)`` waits
for it), so producer start-up is not counted, as in Fuel's tutorial where the server is
started first. Figures are printed, never asserted.

    python bench/tutorial.py [--url URL] [--repeats 5] [--json]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from redis.connection import AbstractConnection

import batchq
from batchq.cli.demo import tutorial_stream
from batchq.host.embedded import url_or_embedded
from batchq.host.procs import spawn, stop_group
from consumer import ServerDataStream

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
ENV = "BATCHQ_DEMO_"


class RoundTrips:
    """Counts this process's Redis round trips, per thread, by wrapping redis-py."""

    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        original = AbstractConnection.send_packed_command
        counts = self.counts

        def counting(conn: Any, command: Any, check_health: bool = True) -> Any:
            counts[threading.current_thread().name] += 1
            return original(conn, command, check_health)

        AbstractConnection.send_packed_command = counting  # type: ignore[method-assign]

    def total(self) -> int:
        """Round trips of every thread so far."""
        return sum(self.counts.values())


def train(
    epochs: int, get_iterator: Callable[[], Iterator[Any]], train_s: float, rt: RoundTrips
) -> dict[str, Any]:
    """Run ``epochs`` epochs, sleeping ``train_s`` per batch, measuring every sleep."""
    start = time.perf_counter()
    out: dict[str, Any] = {"batches": 0, "wait_s": 0.0, "floor_s": 0.0, "epoch_rt": []}
    out |= {"boundary_s": [], "boundary_rt": []}
    step_end: tuple[float, int] | None = None
    for _ in range(epochs):
        rt0 = rt.total()
        it = get_iterator()
        first = True
        while True:
            w0 = time.perf_counter()
            try:
                next(it)
            except StopIteration:
                break
            now = time.perf_counter()
            out["wait_s"] += now - w0
            if out["batches"] == 0:
                out["first_wait_s"] = now - w0
            if first and step_end is not None:
                out["boundary_s"].append(now - step_end[0])
                out["boundary_rt"].append(rt.total() - step_end[1])
            first = False
            s0 = time.perf_counter()
            time.sleep(train_s)
            step_end = (time.perf_counter(), rt.total())
            out["floor_s"] += step_end[0] - s0
            out["batches"] += 1
        out["epoch_rt"].append(rt.total() - rt0)
    out["time_s"] = time.perf_counter() - start
    return out


def served(url: str, args: Any, rt: RoundTrips) -> dict[str, Any]:
    """One served run: start a producer, wait for its plan, then train on the stream."""
    queue = f"tutorial-{uuid.uuid4().hex[:8]}"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (BENCH_DIR, env.get("PYTHONPATH")) if p)
    env.update({ENV + "EXAMPLES": "1000", ENV + "FEATURES": "128", ENV + "BATCH_SIZE": "100"})
    env[ENV + "LOAD_MS"] = str(args.load_ms)
    argv = [sys.executable, "-m", "batchq.cli", "--log-level", "WARNING", "serve"]
    argv += ["streams:tutorial_stream", "--url", url, "--queue", queue, "--hwm", str(args.hwm)]
    proc = spawn(argv, env=env)
    try:
        with ServerDataStream(
            ("features",), url=url, queue=queue, hwm=args.hwm, timeout_s=30
        ) as stream:
            batches_per_epoch = len(stream)  # waits until the producer has joined
            rt.counts.clear()
            result = train(args.epochs, stream.get_epoch_iterator, args.train_ms / 1000, rt)
            stream.close(finished=True)
        result["code"] = proc.wait(timeout=10)
        result["per_thread_rt"] = dict(rt.counts)
        result["batches_per_epoch"] = batches_per_epoch
        return result
    finally:
        stop_group(proc, timeout_s=5.0)


def _stats(values: list[float], best: Callable[[list[float]], float] = min) -> dict[str, float]:
    """Median and best (by default the lowest) of ``values``."""
    return {"median": statistics.median(values), "best": best(values)}


def bench(url: str, args: Any) -> dict[str, Any]:
    """Interleave in-process and served runs; return the per-run figures and summaries."""
    rt = RoundTrips()
    runs: list[dict[str, Any]] = []
    for rep in range(1, args.repeats + 1):
        stream = tutorial_stream(1000, 128, 100, args.load_ms)
        local = train(args.epochs, stream.get_epoch_iterator, args.train_ms / 1000, rt)
        srv = served(url, args, rt)
        ratio = srv["time_s"] / srv["floor_s"]
        runs.append({"in_process": local, "served": srv, "served_over_floor": ratio})
        print(
            f"  run {rep}/{args.repeats}: in-process {local['time_s']:.3f} s, served "
            f"{srv['time_s']:.3f} s, floor {srv['floor_s']:.3f} s, served/floor {ratio:.3f}, "
            f"trainer waited {srv['wait_s'] * 1000:.1f} ms",
            flush=True,
        )
    boundary_rt = [x for r in runs for x in r["served"]["boundary_rt"]]
    boundary_ms = [1000 * x for r in runs for x in r["served"]["boundary_s"]]
    epoch_rt = [x for r in runs for x in r["served"]["epoch_rt"][1:]]  # epoch 0 starts up
    summary = {
        "in_process_s": _stats([r["in_process"]["time_s"] for r in runs]),
        "served_s": _stats([r["served"]["time_s"] for r in runs]),
        "floor_s": _stats([r["served"]["floor_s"] for r in runs]),
        "served_over_floor": _stats([r["served_over_floor"] for r in runs]),
        "served_wait_ms": _stats([1000 * r["served"]["wait_s"] for r in runs]),
        "first_batch_ms": _stats([1000 * r["served"]["first_wait_s"] for r in runs]),
        "first_epoch_rt": _stats([r["served"]["epoch_rt"][0] for r in runs]),
        "epoch_rt": _stats(epoch_rt) if epoch_rt else {},
        "boundary_rt": _stats(boundary_rt) if boundary_rt else {},
        "boundary_ms": _stats(boundary_ms) if boundary_ms else {},
    }
    return {"summary": summary, "runs": runs}


def print_table(res: dict[str, Any], args: Any) -> None:
    """Median and best of each figure."""
    s = res["summary"]
    nominal = args.epochs * 10 * args.train_ms / 1000
    rows = [
        ("in-process (s)", s["in_process_s"], ".3f"),
        ("served, 1 producer (s)", s["served_s"], ".3f"),
        ("floor, measured sleeps (s)", s["floor_s"], ".3f"),
        ("served / floor", s["served_over_floor"], ".3f"),
        ("trainer waited for data (ms)", s["served_wait_ms"], ".1f"),
        ("  of which for the first batch", s["first_batch_ms"], ".1f"),
        ("round trips, first epoch", s["first_epoch_rt"], ".0f"),
        ("round trips, later epochs", s["epoch_rt"], ".0f"),
        ("round trips, epoch boundary", s["boundary_rt"], ".0f"),
        ("epoch boundary (ms)", s["boundary_ms"], ".2f"),
    ]
    print()
    print(f"{'':32}{'median':>10}{'best':>10}")
    for name, st, fmt in rows:
        if st:
            print(f"{name:32}{st['median']:>10{fmt}}{st['best']:>10{fmt}}")
    print(
        f"(nominal floor {nominal:.3f} s; 'best' is the lowest value; target served/floor <= 1.05)"
    )


def _sigterm(signum: int, frame: Any) -> None:
    """SIGTERM unwinds like Ctrl-C, so that every ``finally`` stops what it started."""
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments, run the experiment, print the table (or JSON)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=None, help="Redis URL (default: an embedded server)")
    p.add_argument("--repeats", type=int, default=5, help="runs of each kind")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--load-ms", type=float, default=5.0, help="loading time per batch")
    p.add_argument("--train-ms", type=float, default=10.0, help="training time per batch")
    p.add_argument("--hwm", type=int, default=10)
    p.add_argument("--json", action="store_true", help="print the results as JSON at the end")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, _sigterm)
    load0 = os.getloadavg()[0]
    try:
        with url_or_embedded(args.url) as url:
            if not args.url:
                print(f"embedded redis-server at {url} (stopped at the end)")
            print(
                f"tutorial: {args.epochs} epochs x 10 batches of 100 x 128, loading "
                f"{args.load_ms:g} ms, training {args.train_ms:g} ms per batch; {args.repeats} runs"
            )
            res = bench(url, args)
    except KeyboardInterrupt:
        print("interrupted; everything started was stopped", file=sys.stderr)
        return 130
    git = ["git", "-C", BENCH_DIR, "describe", "--always", "--dirty"]
    meta: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M"), "cpus": os.cpu_count()}
    meta["git"] = subprocess.run(git, capture_output=True, text=True).stdout.strip()
    meta["batchq_from"] = os.path.dirname(os.path.dirname(os.path.abspath(batchq.__file__)))
    meta |= {"loadavg_before": load0, "loadavg_after": os.getloadavg()[0]}
    print_table(res, args)
    print(
        f"{meta['date']}, git {meta['git']} (batchq from {meta['batchq_from']}), "
        f"{meta['cpus']} cpus, 1-min load average "
        f"{load0:.2f} before, {meta['loadavg_after']:.2f} after"
    )
    if args.json:
        print(json.dumps({"meta": meta, **res}, indent=2))
    return 0 if all(r["served"]["code"] == 0 for r in res["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
