"""Steering the producers: the trainer's time per batch around a set_params change.

A pipeline that reads ``producer.control.params()`` in every batch (``batchq serve
params_change:steered_stream``: numbered batches behind a Bottleneck of --load-ms, each
batch scaled by ``params()['scale']``) served by --producers processes, trained for
--batches batches (--train-ms per batch), three times in one invocation on fresh queues:

* ``none``: no change (the baseline);
* ``default``: ``set_params({'scale': 2})`` at step --at, at the default index (the
  trainer's position plus the run's look-ahead D: nothing built yet is stale);
* ``at_batch``: the same change with ``at_batch`` one batch past the position: every
  batch built ahead (the trainer's buffer, the list, the shards being built) is stale,
  dropped and built again.

Printed: the mean time per batch (the wait for the batch plus the training step) in
blocks of 5 steps around the change, each run's total, the frames rebuilt, and the
at_batch run's extra time against the rebuild's cost (rebuilt x load-ms / producers,
what producers spend building them again): the claim is that a change costs the
trainer no stall beyond the batches it rebuilds. Each run is checked to yield the
scaled batches exactly from the index set_params returned. Figures are printed, never
asserted.

    python bench/params_change.py [--url URL] [--producers 2] [--batches 200] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from typing import Any

import numpy as np
from recovery import _redis

from batchq.cli.demo import Bottleneck, _wait_for_producers
from batchq.host.procs import spawn, stop_group
from consumer import ServerDataStream
from producer import control
from producer.datasets import IndexableDataset
from producer.schemes import SequentialScheme
from producer.streams import DataStream
from producer.transformers import Mapping

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
ENV = "BATCHQ_BENCH_"
BLOCK = 5  # steps per printed mean


def _scaled(data: tuple[Any, ...]) -> tuple[Any, ...]:
    """The batch scaled by the params in effect for it (1 before any change)."""
    return (data[0] * int(control.params().get("scale", 1)),)


def steered_stream() -> Any:
    """Numbered batches of 50 x 64 int32 (example i's features all i), loading --load-ms
    each, scaled by ``params()['scale']``; sizes from BATCHQ_BENCH_*."""
    examples = int(os.environ.get(ENV + "EXAMPLES", "10000"))
    load_ms = float(os.environ.get(ENV + "LOAD_MS", "10"))
    data = np.repeat(np.arange(examples, dtype=np.int32)[:, None], 64, axis=1)
    stream = DataStream(
        IndexableDataset({"features": data}),
        iteration_scheme=SequentialScheme(examples=examples, batch_size=50),
    )
    return Mapping(Bottleneck(stream, slowdown=load_ms / 1000), _scaled)


def run(url: str, args: argparse.Namespace, mode: str) -> dict[str, Any]:
    queue = f"params-{mode}-{uuid.uuid4().hex[:8]}"
    env = dict(os.environ)
    env |= {ENV + "EXAMPLES": str(args.batches * 50), ENV + "LOAD_MS": str(args.load_ms)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [BENCH_DIR, env.get("PYTHONPATH")]))
    argv = [sys.executable, "-m", "batchq.cli", "--log-level", "ERROR", "serve",
            "params_change:steered_stream", "--url", url, "--queue", queue,
            "--hwm", str(args.hwm)]  # fmt: skip
    procs = [spawn(argv, env=env) for _ in range(args.producers)]
    steps: list[float] = []
    index = None
    exact = True
    try:
        with ServerDataStream(("features",), url=url, queue=queue, timeout_s=60) as s:
            len(s)
            _wait_for_producers(url, queue, args.producers)
            it = s.get_epoch_iterator()
            for step in range(args.batches):
                t0 = time.perf_counter()
                (features,) = next(it)
                time.sleep(args.train_ms / 1000)
                steps.append(time.perf_counter() - t0)
                scale = 2 if index is not None and step >= index else 1
                exact = exact and int(features[0, 0]) == step * 50 * scale
                if step + 1 == args.at and mode != "none":
                    where = {"at_batch": step + 2} if mode == "at_batch" else {}
                    index = s.set_params({"scale": 2}, **where)
            rebuilt = s.stats["rebuilt_params"]
            s.close(finished=True)
    finally:
        for p in procs:
            stop_group(p, timeout_s=5.0)
    return {"mode": mode, "steps_s": steps, "index": index, "rebuilt": rebuilt, "exact": exact,
            "total_s": sum(steps)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a Redis URL (default: an embedded redis-server)")
    parser.add_argument("--producers", type=int, default=2)
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--at", type=int, default=80, help="the step of the change")
    parser.add_argument("--load-ms", type=float, default=10.0)
    parser.add_argument("--train-ms", type=float, default=10.0)
    parser.add_argument("--hwm", type=int, default=10)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    with _redis(args.url) as url:
        runs = [run(url, args, mode) for mode in ("none", "default", "at_batch")]
    if args.json:
        print(json.dumps(runs, indent=2))
        return 0
    print(
        f"{args.producers} producers ({args.load_ms:g} ms a batch), training {args.train_ms:g} "
        f"ms a batch, run cap {args.hwm}; the change after step {args.at}"
    )
    first = max(0, args.at - 2 * BLOCK)
    blocks = range(first, min(args.batches, args.at + 10 * BLOCK), BLOCK)
    print("ms per batch, steps " + " ".join(f"{b:>6}" for b in blocks))
    for r in runs:
        means = [1000 * float(np.mean(r["steps_s"][b : b + BLOCK])) for b in blocks]
        print(f"{r['mode']:<19}" + " ".join(f"{m:>6.1f}" for m in means))
    base = runs[0]["total_s"]
    print(f"{'run':<10}{'total s':>9}{'vs none s':>11}{'index':>7}{'rebuilt':>9}{'exact':>7}")
    for r in runs:
        print(
            f"{r['mode']:<10}{r['total_s']:>9.3f}{r['total_s'] - base:>+11.3f}"
            f"{r['index']!s:>7}{r['rebuilt']:>9}{'yes' if r['exact'] else 'NO':>7}"
        )
    cost = runs[2]["rebuilt"] * args.load_ms / 1000 / args.producers
    print(
        f"at_batch: {runs[2]['total_s'] - base:+.3f} s against the rebuild's cost of "
        f"{cost:.3f} s ({runs[2]['rebuilt']} frames x {args.load_ms:g} ms / "
        f"{args.producers} producers)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
