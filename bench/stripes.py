"""Stripes: one producer host's worth of 1.57 MB batches through 1, 2 and 3 stripes of a
queue on a local 3-master Redis Cluster.

The cluster is three redis-servers of the suite's binary started here
(tests/support/redis_cluster.py: equal ranges of slots, met with CLUSTER MEET). For each
stripe count N a fresh queue is served by ``--producers`` processes
(``batchq serve streams:constant_stream --stripes N --transport redis``: every byte
through Redis) and read by a :class:`consumer.ServerDataStream` in this process; after
the first batch, batches are counted for ``--seconds``. Reported: batches/s and MB/s,
each master's CPU per batch (``INFO cpu``, user + system, before and after), and which
master holds which stripe. Figures are printed, never asserted.

The model. A master is one thread: the aggregate rate through N stripes on N masters is
bounded by the sum of their cores, N x (1 / the CPU a batch costs its master), and by the
producers' and the trainer's own CPU. Striping moves the Redis side of a batch from one
master to N; it cannot make a batch cheaper. So on a machine with fewer free cores than
producers + trainer + N masters (this one has 2) the rate cannot grow: watch the
per-master CPU per batch spread over the masters instead (each carries ~1/N of the
batches at the same cost each). Where a machine with more cores is lent, run it there.

    python bench/stripes.py [--producers 2] [--seconds 8] [--stripes 1,2,3] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np

from batchq.client.cluster import key_slot
from batchq.client.connection import tune_malloc
from batchq.host.procs import spawn, stop_group
from batchq.protocol.keys import QueueKeys
from consumer import ServerDataStream

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
SUPPORT_DIR = os.path.join(os.path.dirname(BENCH_DIR), "tests", "support")
sys.path.insert(0, BENCH_DIR)
sys.path.insert(0, SUPPORT_DIR)
from redis_cluster import LocalCluster  # noqa: E402
from streams import ENV_BATCHES, ENV_DTYPE, ENV_SHAPE  # noqa: E402

SHAPE, DTYPE = (128, 3, 32, 32), "float32"  # 1.57 MB
BATCH_BYTES = int(np.prod(SHAPE)) * np.dtype(DTYPE).itemsize


def node_cpu_s(cluster: LocalCluster) -> list[float]:
    """Each master's user + system CPU seconds so far."""
    with cluster.clients() as nodes:
        return [
            float(info["used_cpu_sys"]) + float(info["used_cpu_user"])
            for info in (n.info("cpu") for n in nodes)
        ]


def measure(cluster: LocalCluster, stripes: int, args: Any) -> dict[str, Any]:
    """One stripe count: serve, receive for ``args.seconds``, stop everything."""
    queue = f"bench-stripes{stripes}-{uuid.uuid4().hex[:8]}"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (BENCH_DIR, env.get("PYTHONPATH")) if p)
    env |= {ENV_SHAPE: ",".join(map(str, SHAPE)), ENV_DTYPE: DTYPE, ENV_BATCHES: "300"}
    argv = [sys.executable, "-m", "batchq.cli", "--log-level", "WARNING", "serve"]
    argv += ["streams:constant_stream", "--url", cluster.url, "--queue", queue]
    argv += ["--hwm", str(args.hwm), "--stripes", str(stripes), "--transport", "redis"]
    procs = [spawn(argv, env=env) for _ in range(args.producers)]
    stream = ServerDataStream(
        ("x",), url=cluster.url, queue=queue, hwm=args.hwm, timeout_s=60, transport="redis"
    )

    def batches() -> Iterator[object]:
        while True:
            yield from stream.get_epoch_iterator()

    received = batches()
    try:
        next(received)
        cpu0, t0, n = node_cpu_s(cluster), time.perf_counter(), 0
        while time.perf_counter() - t0 < args.seconds:
            next(received)
            n += 1
        seconds, cpu1 = time.perf_counter() - t0, node_cpu_s(cluster)
    finally:
        stream.close(finished=True)
        for proc in procs:
            stop_group(proc, timeout_s=10.0)
    where = [
        cluster.node_of_slot(key_slot(QueueKeys(queue).stripe(k, stripes).meta))
        for k in range(stripes)
    ]
    return {
        "stripes": stripes,
        "batches": n,
        "seconds": round(seconds, 2),
        "batches_per_s": round(n / seconds, 1),
        "mb_per_s": round(n / seconds * BATCH_BYTES / 1e6, 1),
        "node_cpu_ms_per_batch": [
            round(1000 * (b - a) / max(n, 1), 3) for a, b in zip(cpu0, cpu1, strict=True)
        ],
        "stripe_nodes": where,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--producers", type=int, default=2, help="producer processes")
    parser.add_argument("--seconds", type=float, default=8.0, help="measured time per count")
    parser.add_argument("--stripes", default="1,2,3", help="stripe counts to measure")
    parser.add_argument("--hwm", type=int, default=10)
    parser.add_argument("--json", action="store_true", help="print JSON lines")
    args = parser.parse_args(argv)
    tune_malloc()
    counts = [int(c) for c in args.stripes.split(",")]
    with LocalCluster(3) as cluster:
        cores = os.cpu_count()
        print(f"3-master local cluster, {args.producers} producers, 1.57 MB batches through "
              f"Redis, {cores} cores on this machine")  # fmt: skip
        results = [measure(cluster, n, args) for n in counts]
    base = results[0]["batches_per_s"]
    for r in results:
        if args.json:
            print(json.dumps(r))
            continue
        cpu = r["node_cpu_ms_per_batch"]
        print(
            f"  {r['stripes']} stripe(s) on masters {r['stripe_nodes']}: "
            f"{r['batches_per_s']:7.1f} batches/s ({r['mb_per_s']:6.0f} MB/s, "
            f"{r['batches_per_s'] / base:4.2f}x of 1 stripe); master CPU ms per batch "
            f"{' / '.join(f'{c:.3f}' for c in cpu)} (sum {sum(cpu):.3f})"
        )
    print(
        "model: each master is one thread; through N stripes the rate is bounded by "
        "N / (a batch's CPU on its master) and by the producers' and the trainer's CPU"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
