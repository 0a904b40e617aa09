"""Autoscale: ``batchq serve --workers auto`` against the best fixed pool, in one run.

The workload of bench/scaling.py (Fuel's server tutorial: 1000 examples x 128 features,
batches of 100, a Bottleneck loading 40 ms per batch, training 10 ms per batch: about 4
producers keep the trainer at its floor, and loading sleeps, so that holds on 2 cores).

1. fixed pools (``--fixed``, default 1,2,4,6,8 producers) through scaling.run_batchq:
   the mean epoch time of each; the best is the baseline.
2. one ``batchq serve --workers auto`` (starting from 1 worker) for ``--auto-s``
   seconds of training: each epoch's time and the pool's size. The pool has converged
   at its last decision (the queue's scalelog); printed are the time to converge (from
   the first batch), the mean epoch time after it, and its ratio to the best fixed
   pool's (the goal: within 1.1x), plus the time until the trainer first ran within
   1.1x of its floor over 5 epochs in a row.

Figures are printed, never asserted; the machine's load is printed with them.

    python bench/autoscale.py [--url URL] [--fixed 1,2,4,6,8] [--auto-s 60] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/scaling.py

from scaling import ENV, SIGNALS, _counts, _redis, run_batchq

from batchq.client.connection import make_client
from batchq.host.procs import spawn, stop_group
from batchq.monitoring.rows import queue_status
from batchq.protocol.keys import QueueKeys
from consumer import ServerDataStream


def run_auto(url: str, args: argparse.Namespace) -> dict[str, Any]:
    """Train for --auto-s seconds against one ``serve --workers auto``; per-epoch figures."""
    queue = f"autoscale-{uuid.uuid4().hex[:8]}"
    env = dict(os.environ)
    env |= {ENV + "EXAMPLES": str(args.examples), ENV + "FEATURES": str(args.features)}
    env |= {ENV + "BATCH_SIZE": str(args.batch_size), ENV + "LOAD_MS": str(args.load_ms)}
    argv = [sys.executable, "-m", "batchq.cli", "--log-level", "WARNING", "serve"]
    argv += ["batchq.cli.demo:tutorial_stream", "--url", url, "--queue", queue]
    argv += ["--hwm", str(args.hwm), "--workers", args.workers]
    client = make_client(url)
    start_wall = time.time()
    train_s = args.train_ms / 1000
    epochs: list[dict[str, float]] = []
    with SIGNALS.deferred():
        serve = spawn(argv, env=env)
    try:
        with ServerDataStream(("features",), url=url, queue=queue, hwm=args.hwm) as s:
            len(s)  # waits for the first producer's plan
            start, start_wall = time.perf_counter(), time.time()
            while time.perf_counter() - start < args.auto_s:
                t0, trained = time.perf_counter(), 0.0
                for _ in s.get_epoch_iterator():
                    t1 = time.perf_counter()
                    time.sleep(train_s)
                    trained += time.perf_counter() - t1
                t_end = time.perf_counter()
                alive = queue_status(client, queue)["producers_alive"]
                epochs.append(
                    {"end_s": t_end - start, "time_s": t_end - t0, "floor_s": trained,
                     "producers": alive}
                )  # fmt: skip
            s.close(finished=True)
        log = [json.loads(e) for e in client.lrange(QueueKeys(queue).scalelog, 0, -1)][::-1]
        with contextlib.suppress(subprocess.TimeoutExpired):  # its workers see the end
            serve.wait(timeout=15.0)
    finally:
        code = stop_group(serve, timeout_s=15.0)
        client.close()
    return {"epochs": epochs, "decisions": log, "exit_code": code, "start_wall": start_wall}


def summarize_auto(auto: dict[str, Any]) -> dict[str, Any]:
    """Time to converge, the epoch time after it, and the time to reach 1.1x of the floor."""
    epochs, log = auto["epochs"], auto["decisions"]
    if not epochs:
        return {"converged_s": None, "epoch_s": None}
    # Decision times are wall clock; the epochs' are seconds from the first batch.
    last = max((e["t"] for e in log if e["action"] != "hold"), default=None)
    converged = 0.0 if last is None else max(0.0, last - auto["start_wall"])
    after = [e for e in epochs if e["end_s"] - e["time_s"] >= converged]
    within: float | None = None
    for i in range(len(epochs) - 4):
        window = epochs[i : i + 5]
        if sum(e["time_s"] for e in window) <= 1.1 * sum(e["floor_s"] for e in window):
            within = window[0]["end_s"] - window[0]["time_s"]
            break
    return {
        "converged_s": converged,
        "within_1_1_s": within,
        "epochs_after": len(after),
        "epoch_s": statistics.fmean(e["time_s"] for e in after) if after else None,
        "floor_s": statistics.fmean(e["floor_s"] for e in after) if after else None,
        "final_pool": epochs[-1]["producers"],
        "decisions": [f"{e['action']} {e['count']} -> {e['workers']}" for e in log],
    }


def _secs(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} s"


def main(argv: list[str] | None = None) -> int:
    """Run the fixed pools, then the autoscaled one; print the comparison."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=None, help="Redis URL (default: an embedded server)")
    p.add_argument("--fixed", type=_counts, default=[1, 2, 4, 6, 8], help="fixed pool sizes")
    p.add_argument("--workers", default="auto", help="the autoscaled pool's --workers")
    p.add_argument("--auto-s", type=float, default=60.0, help="seconds of autoscaled training")
    p.add_argument("--epochs", type=int, default=20, help="timed epochs per fixed pool")
    p.add_argument("--warmup", type=int, default=2, help="untimed epochs first (fixed pools)")
    p.add_argument("--hwm", type=int, default=10)
    p.add_argument("--examples", type=int, default=1000)
    p.add_argument("--features", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=100)
    p.add_argument("--load-ms", type=float, default=40.0, help="loading time per batch")
    p.add_argument("--train-ms", type=float, default=10.0, help="training time per batch")
    p.add_argument("--json", action="store_true", help="print the results as JSON at the end")
    args = p.parse_args(argv)
    load0 = os.getloadavg()[0]
    print(
        f"autoscale: loading {args.load_ms:g} ms, training {args.train_ms:g} ms per batch; "
        f"fixed pools {args.fixed}, then --workers {args.workers} for {args.auto_s:g} s"
    )
    try:
        with _redis(args.url) as url:
            fixed = {}
            for n in args.fixed:
                r = run_batchq(url, n, args.hwm, args)
                fixed[n] = r
                print(f"  fixed {n}: {1000 * r['time_s']:.0f} ms/epoch ({r['ratio']:.2f}x floor)")
            auto = run_auto(url, args)
    except KeyboardInterrupt:
        print("\ninterrupted; everything started was stopped", file=sys.stderr)
        return 130
    best_n = min(fixed, key=lambda n: fixed[n]["time_s"])
    best = fixed[best_n]["time_s"]
    s = summarize_auto(auto)
    print(f"best fixed pool: {best_n} producers, {1000 * best:.0f} ms/epoch")
    if s["epoch_s"] is None:
        print("autoscaled: no epoch after the last decision (raise --auto-s)")
    else:
        print(
            f"autoscaled: converged {s['converged_s']:.1f} s after the first batch to "
            f"{s['final_pool']} producers; then {1000 * s['epoch_s']:.0f} ms/epoch over "
            f"{s['epochs_after']} epochs ({s['epoch_s'] / s['floor_s']:.2f}x its floor) = "
            f"{s['epoch_s'] / best:.2f}x the best fixed pool "
            f"(goal <= 1.10x); within 1.1x of the floor from "
            f"{_secs(s['within_1_1_s'])}"
        )
    print(f"decisions: {', '.join(s['decisions']) or 'none'}")
    print(f"{os.cpu_count()} cpus, 1-min load {load0:.2f} before, {os.getloadavg()[0]:.2f} after")
    if args.json:
        out = {"fixed": {n: r["time_s"] for n, r in fixed.items()}, "auto": s, "args": vars(args)}
        print(json.dumps(out))
    return 0 if auto["exit_code"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
