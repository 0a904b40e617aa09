"""Fan-out: the trials of a sweep reading one pool of producers (groups, issue 31) against
a queue and a pool of producers per trial, and against one trial alone.

Every trial reads the same pipeline: a CPU-bound build (``--build-ms`` of numpy work per
batch, ~1 MB float32 frames) and a training step that waits ``--step-ms`` (a GPU step:
the trainer's own CPU is small). Three runs, in this order, on one private
redis-server:

* ``single``: one trainer (no group), ``--producers`` producers: the rate one trial gets;
* ``groups``: ``--groups`` trainers, each ``group=g<i>``, on one queue, ``--producers``
  producers: every batch built once for all of them;
* ``queues``: ``--groups`` queues, each with one trainer and ``--producers`` producers
  of its own (what a sweep does without groups).

Trainers are processes started first (the groups register before any batch is built),
read ``--batches`` batches each and ``close(finished=True)``; producers are
``batchq serve`` processes that exit when their run ends. Measured: each trainer's rate
after its first ``WARMUP`` batches, the producers' CPU from the moment all of them had
joined their run (their start, imports included, is a fixed cost that sharing does not
change) to their exit (``os.wait4``: user + system; everything they built, the look-ahead
past the last batch read included) and Redis' CPU, per batch delivered to a trainer.
Printed (and with --json as JSON), per round and as the median over ``--repeats``
interleaved rounds: the rate of the slowest group against the single trial's (target:
within 1.1x) and the pipeline's CPU per delivered batch of the groups against the
separate queues' (target: at most 0.3x).

    python bench/fanout.py [--groups 4] [--producers N] [--batches 400] [--repeats 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from typing import Any

import numpy as np
import redis

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
WARMUP = 20  # batches each trainer reads before its clock starts
ENV_BUILD_MS = "FANOUT_BUILD_MS"
ROWS, COLS = 256, 1024  # a batch: 256 x 1024 float32 = 1 MiB


def pipeline() -> Any:
    """The served stream (``batchq serve fanout:pipeline``): numbered examples, each batch
    built with FANOUT_BUILD_MS of numpy work."""
    from producer.datasets import IndexableDataset
    from producer.schemes import ShuffledScheme
    from producer.streams import DataStream
    from producer.transformers import Mapping

    examples = 64 * ROWS
    dataset = IndexableDataset({"x": np.arange(examples, dtype=np.float32)})
    scheme = ShuffledScheme(examples=examples, batch_size=ROWS, rng=7)
    stream = DataStream.default_stream(dataset, iteration_scheme=scheme)
    return Mapping(stream, Build(float(os.environ.get(ENV_BUILD_MS, "10"))))


class Build:
    """A batch's build: numpy work until ``build_ms`` of CPU has gone, then the frame."""

    def __init__(self, build_ms: float) -> None:
        self.build_s = build_ms / 1000
        self.work = np.random.default_rng(0).random((96, 96))

    def __call__(self, data: tuple[Any, ...]) -> tuple[np.ndarray]:
        start = time.process_time()
        m = self.work
        while time.process_time() - start < self.build_s:
            m = np.tanh(m @ self.work)
        out = np.empty((ROWS, COLS), dtype=np.float32)
        out[:] = data[0][:, None] + float(m[0, 0])
        return (out,)


def trainer_main(args: argparse.Namespace) -> int:
    """One trial: read --batches batches, a --step-ms sleep each, print its figures."""
    from consumer import ServerDataStream

    stream = ServerDataStream(
        ("x",), url=args.url, queue=args.queue, group=args.group or None, hwm=args.hwm,
        timeout_s=120,
    )  # fmt: skip
    n, t0 = 0, 0.0
    while n < args.batches:
        for _ in stream.get_epoch_iterator():
            n += 1
            if n == WARMUP:
                t0 = time.perf_counter()
            time.sleep(args.step_ms / 1000)
            if n >= args.batches:
                break
    seconds = time.perf_counter() - t0
    stream.close(finished=True)
    print(json.dumps({"rate": (n - WARMUP) / seconds, "batches": n, "cpu_s": time.process_time()}))
    return 0


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (BENCH_DIR, env.get("PYTHONPATH")) if p)
    return env


def _trainer(args: argparse.Namespace, queue: str, group: str) -> subprocess.Popen[str]:
    argv = [sys.executable, os.path.abspath(__file__), "--trainer", "--url", args.url]
    argv += ["--queue", queue, "--group", group, "--batches", str(args.batches)]
    argv += ["--step-ms", str(args.step_ms), "--hwm", str(args.hwm)]
    return subprocess.Popen(argv, env=_env(), stdout=subprocess.PIPE, text=True)


def _producer(args: argparse.Namespace, queue: str) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "batchq.cli", "--log-level", "WARNING", "serve"]
    argv += ["fanout:pipeline", "--url", args.url, "--queue", queue, "--hwm", str(args.hwm)]
    env = _env() | {ENV_BUILD_MS: str(args.build_ms)}
    return subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL)


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a live process so far (/proc)."""
    with open(f"/proc/{pid}/stat", "rb") as fh:
        fields = fh.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _claimed(client: redis.Redis, queue: str, group: str) -> bool:
    """Whether the queue's trainer (of ``group``) has claimed the run."""
    meta = f"bq:{{{queue}}}:meta"
    if group:
        return bool(client.hexists(f"bq:{{{queue}}}:groups", group))
    return bool(client.hexists(meta, "claim"))


def run(args: argparse.Namespace, mode: str) -> dict[str, Any]:
    """One run of ``mode`` ('single', 'groups', 'queues'): the trainers' rates and the
    producers' and Redis' CPU per delivered batch."""
    client = redis.Redis.from_url(args.url)
    tag = uuid.uuid4().hex[:6]
    if mode == "single":
        readers = [(f"fan-{tag}", "")]
    elif mode == "groups":
        readers = [(f"fan-{tag}", f"g{i}") for i in range(args.groups)]
    else:
        readers = [(f"fan-{tag}-{i}", "") for i in range(args.groups)]
    trainers = [_trainer(args, q, g) for q, g in readers]
    deadline = time.monotonic() + 60
    while not all(_claimed(client, q, g) for q, g in readers):
        if time.monotonic() > deadline:
            raise RuntimeError("the trainers did not claim their runs within 60 s")
        time.sleep(0.05)
    cpu = client.info("cpu")
    redis0 = float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"])
    queues = sorted({q for q, _ in readers})
    producers = [_producer(args, q) for q in queues for _ in range(args.producers)]
    while any(client.zcard(f"bq:{{{q}}}:producers") < args.producers for q in queues):
        if time.monotonic() > deadline + 60:
            raise RuntimeError("the producers did not join within 60 s")
        time.sleep(0.01)
    started_s = sum(_cpu_s(p.pid) for p in producers)  # imports and joins: not the pipeline
    figures = []
    for t in trainers:
        out, _ = t.communicate(timeout=600)
        figures.append(json.loads(out.strip().splitlines()[-1]))
    producer_s = 0.0
    for p in producers:
        _pid, _status, usage = os.wait4(p.pid, 0)
        p.returncode = 0
        producer_s += usage.ru_utime + usage.ru_stime
    producer_s -= started_s
    cpu = client.info("cpu")
    redis_s = float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"]) - redis0
    for q in queues:
        client.delete(*client.keys(f"bq:{{{q}}}:*") or [f"bq:{{{q}}}:meta"])
    client.close()
    delivered = sum(f["batches"] for f in figures)
    return {
        "mode": mode,
        "rates": [f["rate"] for f in figures],
        "delivered": delivered,
        "producer_ms_per_batch": 1000 * producer_s / delivered,
        "redis_ms_per_batch": 1000 * redis_s / delivered,
        "trainer_ms_per_batch": 1000 * sum(f["cpu_s"] for f in figures) / delivered,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a Redis URL (default: a private redis-server)")
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--producers", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--batches", type=int, default=400, help="per trainer")
    parser.add_argument("--step-ms", type=float, default=15.0, help="each training step")
    parser.add_argument("--build-ms", type=float, default=10.0, help="CPU to build a batch")
    parser.add_argument("--hwm", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2, help="interleaved rounds")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--trainer", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--queue", help=argparse.SUPPRESS)
    parser.add_argument("--group", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trainer:
        return trainer_main(args)
    server = None
    if args.url is None:
        from batchq.host.embedded import EmbeddedRedis

        server = EmbeddedRedis()
        server.start()
        args.url = server.url
    try:
        # Interleaved (single, groups, queues, single, ...): drift on a shared machine
        # hits every mode alike; each repeat's ratios, then their medians.
        repeats = [
            {mode: run(args, mode) for mode in ("single", "groups", "queues")}
            for _ in range(args.repeats)
        ]
    finally:
        if server is not None:
            server.stop()
    for runs in repeats:
        runs["ratios"] = {
            "slowest_group_vs_single": runs["single"]["rates"][0] / min(runs["groups"]["rates"]),
            "pipeline_cpu_groups_vs_queues": (
                runs["groups"]["producer_ms_per_batch"] / runs["queues"]["producer_ms_per_batch"]
            ),
        }
    medians = {
        name: statistics.median(r["ratios"][name] for r in repeats)
        for name in ("slowest_group_vs_single", "pipeline_cpu_groups_vs_queues")
    }
    if args.json:
        print(json.dumps({"repeats": repeats, "medians": medians}, indent=2))
        return 0
    print(
        f"{args.groups} trials, {args.producers} producers per pool, {args.batches} batches "
        f"each, {args.build_ms:g} ms build, {args.step_ms:g} ms step (cores: {os.cpu_count()})"
    )
    for i, runs in enumerate(repeats):
        print(f"repeat {i + 1}:")
        for mode in ("single", "groups", "queues"):
            r = runs[mode]
            rates = ", ".join(f"{x:.1f}" for x in r["rates"])
            print(
                f"  {mode:7s} rates {rates} batches/s; per delivered batch: pipeline "
                f"{r['producer_ms_per_batch']:.2f} ms, redis {r['redis_ms_per_batch']:.2f} ms, "
                f"trainer {r['trainer_ms_per_batch']:.2f} ms CPU"
            )
        ratios = runs["ratios"]
        print(
            f"  single / slowest group {ratios['slowest_group_vs_single']:.3f}x, pipeline CPU "
            f"groups / queues {ratios['pipeline_cpu_groups_vs_queues']:.3f}x"
        )
    print(
        f"median over {args.repeats}: the slowest group's rate: single / it = "
        f"{medians['slowest_group_vs_single']:.3f}x (target <= 1.1); pipeline CPU per "
        f"delivered batch, groups / separate queues = "
        f"{medians['pipeline_cpu_groups_vs_queues']:.3f}x (target <= 0.3)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
