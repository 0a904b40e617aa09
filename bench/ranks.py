"""Data-parallel ranks: 1, 2 and 4 ranks fed by one shared pool of producers, vs the floor.

The data-bound tutorial workload of bench/scaling.py (a Bottleneck loading --load-ms per
batch, 4000 examples in batches of 100: 40 batches per epoch), read by R ranks
(``ServerDataStream(rank=r, world_size=R)``, one thread each, as the ranks of a DDP job:
a barrier after every step stands for the all-reduce, so the job moves at its slowest
rank's pace). Every rank trains --train-ms per batch (a sleep). The same --producers
``batchq serve`` processes serve every configuration (a fresh queue each), enough for
the largest R: the question is whether splitting the epoch among ranks costs anything.

* floor: the job's own training time per epoch: ceil(40 / R) steps of --train-ms, as
  measured (the sum of the sleeps of the slowest rank);
* batchq: the job's epoch time (from one epoch's end on every rank to the next's).

Start-up and --warmup epochs are not timed. Figures are printed, never asserted.

    python bench/ranks.py [--url URL] [--ranks 1,2,4] [--producers 6] [--json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
import threading
import time
import uuid
from typing import Any

from scaling import SIGNALS, _counts, _redis, producer_command  # bench/: this folder

from batchq.cli.demo import _wait_for_producers
from batchq.host.procs import spawn, stop_group
from consumer import ServerDataStream


def _rank(
    url: str,
    queue: str,
    rank: int,
    world: int,
    barrier: threading.Barrier,
    args: argparse.Namespace,
    out: dict[int, Any],
) -> None:
    """One rank's epochs: the end time of each and the time it trained."""
    train_s = args.train_ms / 1000
    ends, trained = [], []
    stream = ServerDataStream(
        ("features",), url=url, queue=queue, hwm=args.hwm, rank=rank, world_size=world
    )
    try:
        for _ in range(args.warmup + args.epochs):
            spent = 0.0
            for _batch in stream.get_epoch_iterator():
                t0 = time.perf_counter()
                time.sleep(train_s)
                spent += time.perf_counter() - t0
                barrier.wait(timeout=60)  # the all-reduce: every rank at every step
            ends.append(time.perf_counter())
            trained.append(spent)
        out[rank] = {"ends": ends, "trained": trained}
        stream.close(finished=True)
    except BaseException as e:  # reported by the main thread
        barrier.abort()
        out[rank] = {"error": repr(e)}
        stream.close()


def run(url: str, world: int, args: argparse.Namespace) -> dict[str, Any]:
    """R ranks against --producers producer processes on a fresh queue."""
    queue = f"ranks-{world}-{uuid.uuid4().hex[:8]}"
    argv, env = producer_command(url, queue, args.hwm, args)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        with SIGNALS.deferred():
            procs.extend(spawn(argv, env=env) for _ in range(args.producers))
        _wait_for_producers(url, queue, args.producers)
        barrier = threading.Barrier(world)
        out: dict[int, Any] = {}
        threads = [
            threading.Thread(target=_rank, args=(url, queue, r, world, barrier, args, out))
            for r in range(world)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        errors = [o["error"] for o in out.values() if "error" in o]
        if errors:
            raise RuntimeError(f"a rank failed: {errors[0]}")
        for p in procs:
            p.wait(timeout=10.0)  # the last rank's finish ends the run: they exit 0
    finally:
        codes = [stop_group(p, timeout_s=5.0) for p in procs]
    w = args.warmup
    ends = [max(out[r]["ends"][e] for r in out) for e in range(w - 1, w + args.epochs)]
    epochs = [b - a for a, b in itertools.pairwise(ends)]
    floors = [max(out[r]["trained"][e] for r in out) for e in range(w, w + args.epochs)]
    return {
        "ranks": world,
        "epochs_s": epochs,
        "time_s": statistics.fmean(epochs),
        "floor": statistics.fmean(floors),
        "ratio": statistics.fmean(epochs) / statistics.fmean(floors),
        "exit_codes": codes,
    }


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments, run every rank count, print the table (and JSON)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=None, help="Redis URL (default: an embedded server)")
    p.add_argument("--ranks", type=_counts, default=[1, 2, 4], help="e.g. 1,2,4")
    p.add_argument("--producers", type=int, default=6, help="the shared pool's size")
    p.add_argument("--hwm", type=int, default=10)
    p.add_argument("--epochs", type=int, default=4, help="timed epochs per run")
    p.add_argument("--warmup", type=int, default=1, help="untimed epochs first")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--examples", type=int, default=4000)
    p.add_argument("--features", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=100)
    p.add_argument("--load-ms", type=float, default=40.0, help="loading time per batch")
    p.add_argument("--train-ms", type=float, default=40.0, help="training time per step")
    p.add_argument("--json", action="store_true", help="print the results as JSON at the end")
    args = p.parse_args(argv)
    if args.warmup < 1:
        p.error("--warmup must be >= 1 (the first timed epoch starts at its end)")
    runs = []
    with _redis(args.url) as url:
        for rep in range(args.repeats):
            for world in args.ranks:
                print(f"  {world} rank(s), {args.producers} producers, repeat {rep + 1} ...",
                      end="", flush=True)  # fmt: skip
                r = run(url, world, args)
                runs.append(r)
                epochs = " ".join(f"{x:.3f}" for x in r["epochs_s"])
                print(f" epochs {epochs} s, floor {r['floor']:.3f} s, x{r['ratio']:.2f}")
    print()
    print(f"{'ranks':>6}{'floor s/ep':>12}{'s/epoch':>10}{'vs floor':>10}")
    for world in args.ranks:
        rs = [r for r in runs if r["ranks"] == world]
        floor = statistics.median(r["floor"] for r in rs)
        took = statistics.median(r["time_s"] for r in rs)
        ratio = statistics.median(r["ratio"] for r in rs)
        print(f"{world:>6}{floor:>12.3f}{took:>10.3f}{ratio:>10.2f}")
    print(f"(medians of {args.repeats} run(s); goal: every rank count within 1.05x of its floor)")
    if args.json:
        print(json.dumps(runs, indent=2))
    return 0


if __name__ == "__main__":
    import signal

    signal.signal(signal.SIGINT, SIGNALS.handler)
    signal.signal(signal.SIGTERM, SIGNALS.handler)
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
