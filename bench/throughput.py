"""Throughput: one producer process, one trainer (this process), batchq vs raw redis-py.

For each batch shape, measured against the same redis-server in the same run:

* ``raw``: a producer process LPUSHes pre-built bytes of the batch's size; this process
  BRPOPs them. Cap: the producer pushes only while the list holds fewer than hwm
  elements (LPUSH's reply is the new length; at the hwm it polls LLEN every 0.5 ms).
  Both sides use :func:`batchq.client.connection.make_client` and :func:`tune_malloc`.
* ``batchq``: ``batchq serve streams:constant_stream`` (a dataset that returns one
  pre-built array, see ``bench/streams.py``) and a :class:`consumer.ServerDataStream`
  iterating epoch after epoch (``--epoch-batches`` per epoch), both with
  ``transport='redis'``: every byte through Redis.
* ``shm``: the same with the default transport: the producer is on the trainer's host,
  so frames go through shared memory and Redis carries descriptors.
* ``fuel`` (with ``--fuel``): Fuel 0.2.0's own ZeroMQ server and ServerDataStream over
  the same constant batch, from a throwaway virtualenv (``bench/fuel_baseline.py``
  builds it from the registry's sdist on first use; never a dependency of batchq).
* ``inline`` (secondary): the same, but frames travel inside the capped-push script
  (``inline_max_bytes`` raised; served by ``python bench/streams.py --inline``).

Only the steady state counts: the clock starts when the first batch has arrived. The
trainer touches nothing; it only receives. Besides batches/s and MB/s it reports the CPU
each process spent per batch (producer from /proc, trainer from process_time, redis
from INFO cpu). Figures are printed, never asserted.

    python bench/throughput.py [--url URL] [--repeats 3] [--seconds 10] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

import batchq
from batchq.client.connection import make_client, tune_malloc
from batchq.host.embedded import url_or_embedded
from batchq.host.procs import spawn, stop_group
from consumer import ServerDataStream

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH_DIR)
from streams import ENV_BATCHES, ENV_DTYPE, ENV_SHAPE, make_batch  # noqa: E402

# (label, shape, dtype, batches per measurement)
SHAPES: list[tuple[str, tuple[int, ...], str, int]] = [
    ("128x3x32x32 float32", (128, 3, 32, 32), "float32", 1500),
    ("32x3x224x224 uint8", (32, 3, 224, 224), "uint8", 500),
    ("256x3x64x64 float32", (256, 3, 64, 64), "float32", 200),
]
KINDS = ("raw", "batchq", "shm", "inline", "fuel")
POLL_S = 0.0005
TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


@dataclass
class Run:
    """One measurement: ``batches`` received in ``seconds`` after the first one."""

    kind: str
    batches: int
    seconds: float
    batch_bytes: int
    cpu_ms: dict[str, float]  # CPU ms per batch: producer, trainer, redis

    @property
    def rate(self) -> float:
        """Batches per second."""
        return self.batches / self.seconds

    @property
    def mbps(self) -> float:
        """Payload MB (1e6 bytes) per second."""
        return self.rate * self.batch_bytes / 1e6


def _proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a live process (0 where /proc cannot say)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) * TICK_S
    except (OSError, IndexError, ValueError):
        return 0.0


def raw_producer(url: str, key: str, shape: tuple[int, ...], dtype: str, hwm: int) -> None:
    """The raw baseline's producer: LPUSH pre-built bytes while the list is below hwm."""
    tune_malloc()
    client = make_client(url)
    payload = make_batch(shape, dtype).tobytes()
    while True:
        depth = int(client.lpush(key, payload))
        while depth >= hwm:
            time.sleep(POLL_S)
            depth = int(client.llen(key))


def _argv(
    kind: str, url: str, name: str, shape: tuple[int, ...], dtype: str, args: Any
) -> list[str]:
    """The producer's command line for ``kind`` (``name``: the raw key or the queue)."""
    common = ["--url", url, "--hwm", str(args.hwm)]
    if kind == "raw":
        argv = [sys.executable, os.path.abspath(__file__), "--raw-producer", *common]
        return [*argv, "--key", name, "--shape", ",".join(map(str, shape)), "--dtype", dtype]
    if kind == "inline":
        script = os.path.join(BENCH_DIR, "streams.py")
        return [sys.executable, script, *common, "--queue", name, "--inline"]
    argv = [sys.executable, "-m", "batchq.cli", "--log-level", "WARNING", "serve"]
    argv += ["streams:constant_stream", *common, "--queue", name]
    argv += ["--transport", "auto" if kind == "shm" else "redis"]
    return [*argv, "--requests-per-shard", str(args.requests_per_shard)]


def measure_fuel(shape: tuple[int, ...], dtype: str, count: int, args: Any) -> Run:
    """Fuel 0.2.0's server and client (both in the Fuel virtualenv), same batch."""
    from fuel_baseline import fuel_python

    python = str(fuel_python())
    script = os.path.join(BENCH_DIR, "fuel_baseline.py")
    with socket.socket() as s:  # a free port for the ZeroMQ PUSH socket
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    dims = ",".join(map(str, shape))
    server = [python, script, "serve", port, dims, dtype, str(args.epoch_batches), str(args.hwm)]
    proc = spawn(server, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        receive = [python, script, "receive", port, dims, str(args.hwm), str(count)]
        cpu0 = _proc_cpu_s(proc.pid)
        done = subprocess.run(
            [*receive, str(args.seconds)],
            capture_output=True,
            text=True,
            timeout=args.seconds + 60,
            check=True,
        )
        cpu1 = _proc_cpu_s(proc.pid)
    finally:
        stop_group(proc, timeout_s=5.0)
    got = json.loads(done.stdout.strip().splitlines()[-1])
    n = max(int(got["batches"]), 1)
    used = {"producer": 1000 * (cpu1 - cpu0) / n, "trainer": 1000 * got["cpu_s"] / n}
    used["redis"] = 0.0
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return Run("fuel", int(got["batches"]), float(got["seconds"]), nbytes, used)


def measure(kind: str, url: str, shape: tuple[int, ...], dtype: str, count: int, args: Any) -> Run:
    """One measurement of ``kind``: start its producer, receive, stop everything."""
    name = f"bench-{kind}-{uuid.uuid4().hex[:8]}"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (BENCH_DIR, env.get("PYTHONPATH")) if p)
    env |= {ENV_SHAPE: ",".join(map(str, shape)), ENV_DTYPE: dtype}
    env[ENV_BATCHES] = str(args.epoch_batches)
    if kind == "fuel":
        return measure_fuel(shape, dtype, count, args)
    client = make_client(url)
    transport = "auto" if kind == "shm" else "redis"
    stream = ServerDataStream(
        ("x",), url=url, queue=name, hwm=args.hwm, timeout_s=30, transport=transport
    )
    receive: Callable[[], object]
    if kind == "raw":

        def receive() -> object:
            popped = client.brpop([name], timeout=5)
            if popped is None:
                raise RuntimeError("the raw producer sent nothing for 5 s")
            return popped[1]
    else:

        def epochs() -> Iterator[object]:
            while True:
                yield from stream.get_epoch_iterator()

        receive = epochs().__next__
    proc = spawn(_argv(kind, url, name, shape, dtype, args), env=env)

    def cpu() -> tuple[float, float, float]:
        info = client.info("cpu")
        server = float(info["used_cpu_sys"]) + float(info["used_cpu_user"])
        return _proc_cpu_s(proc.pid), time.process_time(), server

    try:
        receive()
        cpu0, t0, n = cpu(), time.perf_counter(), 0
        while n < count and time.perf_counter() - t0 < args.seconds:
            receive()
            n += 1
        dt, cpu1 = time.perf_counter() - t0, cpu()
        if kind != "raw":
            stream.close(finished=True)
            proc.wait(timeout=10)
    finally:
        stream.close()
        stop_group(proc, timeout_s=5.0)
        client.delete(name)
        client.close()
    deltas = zip(("producer", "trainer", "redis"), cpu0, cpu1, strict=True)
    used = {w: 1000 * (b - a) / max(n, 1) for w, a, b in deltas}
    return Run(kind, n, dt, int(np.prod(shape)) * np.dtype(dtype).itemsize, used)


def summarize(runs: list[Run]) -> dict[str, Any]:
    """Best and median batches/s and MB/s, and the median CPU ms per batch."""
    rates, mbps = [r.rate for r in runs], [r.mbps for r in runs]
    cpu = {w: statistics.median(r.cpu_ms[w] for r in runs) for w in runs[0].cpu_ms}
    return {
        "best_batches_s": max(rates),
        "median_batches_s": statistics.median(rates),
        "best_mb_s": max(mbps),
        "median_mb_s": statistics.median(mbps),
        "median_cpu_ms_per_batch": cpu | {"total": sum(cpu.values())},
    }


def bench(url: str, args: Any) -> dict[str, Any]:
    """Measure every shape and kind, interleaving the repeats; print progress."""
    results: dict[str, Any] = {}
    kinds = [k for k in KINDS if (args.inline or k != "inline") and (args.fuel or k != "fuel")]
    for label, shape, dtype, count in SHAPES:
        if args.only and not any(o in label for o in args.only):
            continue
        runs: dict[str, list[Run]] = {k: [] for k in kinds}
        for rep in range(1, args.repeats + 1):
            for kind in kinds:
                run = measure(kind, url, shape, dtype, args.batches or count, args)
                runs[kind].append(run)
                cpu = "/".join(f"{v:.2f}" for v in run.cpu_ms.values())
                print(
                    f"  {label:<20} {kind:<7} {rep}/{args.repeats}: {run.batches:4d} batches "
                    f"in {run.seconds:6.3f} s = {run.rate:6.1f} batches/s, {run.mbps:6.1f} MB/s; "
                    f"CPU ms/batch producer/trainer/redis {cpu}",
                    flush=True,
                )
        summary = {k: summarize(v) for k, v in runs.items()}
        for kind in kinds[1:]:
            s, raw = summary[kind], summary["raw"]
            s["ratio_median"] = s["median_batches_s"] / raw["median_batches_s"]
            s["ratio_best"] = s["best_batches_s"] / raw["best_batches_s"]
        if "fuel" in summary:
            for kind in ("batchq", "shm"):
                s, fuel = summary[kind], summary["fuel"]
                s["vs_fuel_median"] = s["median_batches_s"] / fuel["median_batches_s"]
                # Each round measures both within seconds: the median of the rounds' own
                # ratios shrugs off a machine whose speed swings between rounds.
                pairs = zip(runs[kind], runs["fuel"], strict=True)
                s["vs_fuel_paired"] = statistics.median(a.rate / b.rate for a, b in pairs)
        results[label] = {
            "summary": summary,
            "runs": {k: [asdict(r) for r in v] for k, v in runs.items()},
        }
    return results


def print_table(results: dict[str, Any]) -> None:
    """The results as a table: median and best, the ratio to raw, CPU per batch."""
    head = f"{'shape':<21}{'path':<7}{'batches/s':>16}{'MB/s':>14}{'vs raw (vs fuel)':>36}"
    head += f"{'CPU ms/batch: prod train redis total':>38}"
    print(f"\n{'':<28}{'median  best':>16}{'median  best':>14}{'median best':>36}\n{head}")
    print("-" * len(head))
    for label, res in results.items():
        for kind, s in res["summary"].items():
            ratio = f"{s['ratio_median']:.2f} {s['ratio_best']:.2f}" if kind != "raw" else ""
            if "vs_fuel_median" in s:
                ratio += f" ({s['vs_fuel_median']:.2f}x fuel, {s['vs_fuel_paired']:.2f} paired)"
            cpu = " ".join(f"{v:5.2f}" for v in s["median_cpu_ms_per_batch"].values())
            line = f"{label:<21}{kind:<7}{s['median_batches_s']:9.1f}{s['best_batches_s']:7.1f}"
            print(f"{line}{s['median_mb_s']:7.1f}{s['best_mb_s']:7.1f}{ratio:>36}{cpu:>38}")


def _meta(load0: float, args: Any) -> dict[str, Any]:
    """When, where and with what the figures were measured."""
    git = subprocess.run(
        ["git", "-C", BENCH_DIR, "describe", "--always", "--dirty"], capture_output=True, text=True
    ).stdout.strip()
    return {
        "date": time.strftime("%Y-%m-%d %H:%M"), "cpus": os.cpu_count(), "git": git,
        "batchq_from": os.path.dirname(os.path.dirname(os.path.abspath(batchq.__file__))),
        "loadavg_before": load0, "loadavg_after": os.getloadavg()[0], **vars(args),
    }  # fmt: skip


def _sigterm(signum: int, frame: Any) -> None:
    """SIGTERM unwinds like Ctrl-C, so that every ``finally`` stops what it started."""
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments, run the benchmark, print the table (or JSON)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=None, help="Redis URL (default: an embedded server)")
    p.add_argument("--hwm", type=int, default=10, help="queue cap (both paths)")
    p.add_argument("--repeats", type=int, default=3, help="measurements per path and shape")
    p.add_argument("--seconds", type=float, default=10.0, help="most seconds per measurement")
    p.add_argument("--batches", type=int, default=0, help="per measurement (0: 1500 / 500)")
    p.add_argument("--epoch-batches", type=int, default=300, help="batchq's epoch length")
    p.add_argument("--requests-per-shard", type=int, default=1, help="batchq serve's option")
    p.add_argument("--no-inline", dest="inline", action="store_false", help="skip the inline path")
    p.add_argument("--fuel", action="store_true", help="add Fuel 0.2.0's ZeroMQ server")
    p.add_argument(
        "--only", action="append", default=None, help="only shapes whose label contains this"
    )
    p.add_argument("--json", action="store_true", help="print the results as JSON at the end")
    p.add_argument("--raw-producer", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--key", help=argparse.SUPPRESS)
    p.add_argument("--shape", help=argparse.SUPPRESS)
    p.add_argument("--dtype", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.raw_producer:
        shape = tuple(int(d) for d in args.shape.split(","))
        raw_producer(args.url, args.key, shape, args.dtype, args.hwm)
        return 0
    signal.signal(signal.SIGTERM, _sigterm)
    tune_malloc()
    load0 = os.getloadavg()[0]
    try:
        with url_or_embedded(args.url) as url:
            if not args.url:
                print(f"embedded redis-server at {url} (stopped at the end)")
            print(
                f"throughput: hwm {args.hwm}, {args.repeats} repeats, <= {args.seconds:g} s "
                f"each, batchq epochs of {args.epoch_batches} batches"
            )
            results = bench(url, args)
    except KeyboardInterrupt:
        print("interrupted; everything started was stopped", file=sys.stderr)
        return 130
    meta = _meta(load0, args)
    print_table(results)
    print(f"{meta['date']}, git {meta['git']} (batchq from {meta['batchq_from']}), ", end="")
    print(f"{meta['cpus']} cpus, 1-min load average ", end="")
    print(f"{load0:.2f} before, {meta['loadavg_after']:.2f} after")
    if args.json:
        print(json.dumps({"meta": meta, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
