"""Scaling: the tutorial pipeline served by 1, 2, 4, 8 producers vs PyTorch's DataLoader.

Fuel's server tutorial, data-bound: 1000 examples x 128 features, batches of 100 (10 per
epoch), a Bottleneck loading 40 ms per batch, training 10 ms per batch. Loading sleeps,
so N processes load N batches at once even on 2 cores; 4 load as fast as training eats.

* batchq: N ``batchq serve batchq.cli.demo:tutorial_stream`` processes (own process
  groups) and a :class:`consumer.ServerDataStream` here;
* DataLoader: the same stream as a map-style torch Dataset (the epoch's plan from
  ``scheme.get_request_iterator(epoch=e)``, as the producers build it; an item sleeps
  --load-ms, then returns ``get_data(request=plan[i])``), ``DataLoader(batch_size=None,
  num_workers=N, prefetch_factor=2, persistent_workers=True)``;
* floor: the trainer's own training time, the sum of its sleeps as measured.

Start-up is not timed: the clock starts once all N producers have joined, and the first
--warmup epochs (which also start the DataLoader's workers) are not counted. batchq's
buffer (up to hwm frames queued + hwm prefetched, filled while the producers start) can
hide a supply deficit of a few % for tens of epochs: use e.g. --epochs 40 for the steady
state. Figures are printed, never asserted. Torch is optional: without it only batchq runs.

    python bench/scaling.py [--url URL] [--producers 1,2,4,8] [--hwm 10] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from batchq.cli.demo import _wait_for_producers, tutorial_stream
from batchq.client.connection import resolve_url
from batchq.host.procs import spawn, stop_group
from consumer import ServerDataStream
from producer.serving.sharding import find_root

_DatasetBase: Any = object
try:
    import torch
    from torch.utils.data import DataLoader, Dataset

    _DatasetBase = Dataset
    NO_TORCH = ""
    # Loading is a sleep: more workers than cores is the point here, not a mistake.
    warnings.filterwarnings("ignore", message="This DataLoader will create")
except ImportError as exc:  # torch is an optional dependency
    torch = None  # type: ignore[assignment]
    NO_TORCH = str(exc)

ENV = "BATCHQ_DEMO_"


class TutorialBatches(_DatasetBase):
    """The tutorial stream as a map-style Dataset: item ``e * B + i`` is batch i of epoch e.

    The epoch travels in the index: persistent workers hold their own copy of the dataset.

    Args:
        args: the parsed arguments (examples, features, batch_size, load_ms).
    """

    def __init__(self, args: argparse.Namespace) -> None:
        stream = tutorial_stream(args.examples, args.features, args.batch_size, args.load_ms)
        self.root = find_root(stream)  # the DataStream under the Bottleneck
        self.load_s = args.load_ms / 1000
        self._plans: dict[int, list[Any]] = {}
        self.batches = len(self.plan(0))

    def plan(self, epoch: int) -> list[Any]:
        """The requests of ``epoch``, as every batchq producer computes them."""
        if epoch not in self._plans:
            scheme = self.root.iteration_scheme
            self._plans = {epoch: list(scheme.get_request_iterator(epoch=epoch))}
        return self._plans[epoch]

    def __len__(self) -> int:
        return self.batches

    def __getitem__(self, index: int) -> tuple[Any, ...]:
        epoch, i = divmod(index, self.batches)
        time.sleep(self.load_s)  # the Bottleneck's loading step
        return self.root.get_data(request=self.plan(epoch)[i])


def train(get_iterator: Callable[[], Iterator[Any]], args: argparse.Namespace) -> dict[str, Any]:
    """Run warm-up + timed epochs, sleeping --train-ms per batch; time the timed ones."""
    train_s = args.train_ms / 1000
    out: dict[str, Any] = {"epochs_s": [], "floor_s": [], "first_wait_s": [], "batches": []}
    for e in range(args.warmup + args.epochs):
        t0 = time.perf_counter()
        trained, first, n = 0.0, None, 0
        with SIGNALS.deferred():  # the first iter(loader) forks the DataLoader's workers
            it = get_iterator()
        while True:
            w0 = time.perf_counter()
            try:
                next(it)
            except StopIteration:
                break
            t1 = time.perf_counter()
            first = t1 - w0 if first is None else first
            time.sleep(train_s)  # the "training step"
            trained += time.perf_counter() - t1
            n += 1
        if e < args.warmup:
            continue
        out["epochs_s"].append(time.perf_counter() - t0)
        out["floor_s"].append(trained)
        out["first_wait_s"].append(first or 0.0)
        out["batches"].append(n)
    out["time_s"] = statistics.fmean(out["epochs_s"])  # per epoch
    out["floor"] = statistics.fmean(out["floor_s"])
    out["ratio"] = out["time_s"] / out["floor"]
    return out


def producer_command(
    url: str, queue: str, hwm: int, args: argparse.Namespace
) -> tuple[list[str], dict[str, str]]:
    """The argv and environment of one ``batchq serve`` of the tutorial stream."""
    env = dict(os.environ)
    env |= {ENV + "EXAMPLES": str(args.examples), ENV + "FEATURES": str(args.features)}
    env |= {ENV + "BATCH_SIZE": str(args.batch_size), ENV + "LOAD_MS": str(args.load_ms)}
    argv = [sys.executable, "-m", "batchq.cli", "--log-level", "WARNING", "serve"]
    argv += ["batchq.cli.demo:tutorial_stream", "--url", url, "--queue", queue]
    argv += ["--hwm", str(hwm)]
    return argv, env


def run_batchq(url: str, n: int, hwm: int, args: argparse.Namespace) -> dict[str, Any]:
    """Train against ``n`` producer processes on a fresh queue; stop them all after."""
    queue = f"scaling-{n}-{uuid.uuid4().hex[:8]}"
    argv, env = producer_command(url, queue, hwm, args)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        with SIGNALS.deferred():
            procs.extend(spawn(argv, env=env) for _ in range(n))
        with ServerDataStream(("features",), url=url, queue=queue, hwm=hwm, timeout_s=30) as s:
            len(s)  # waits for the first producer's plan
            _wait_for_producers(url, queue, n)
            result = train(s.get_epoch_iterator, args)
            result["producers_used"] = len(s.producers_seen)
            s.close(finished=True)
        for p in procs:  # they see the finished run within 0.15 s and exit 0
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10.0)
    finally:
        codes = [stop_group(p, timeout_s=5.0) for p in procs]
    return result | {"exit_codes": codes}


def run_torch(n: int, args: argparse.Namespace) -> dict[str, Any]:
    """Train on a DataLoader with ``n`` persistent workers; shut them down after."""
    dataset = TutorialBatches(args)
    sampler: list[int] = []  # epoch e's indices, set before each iter(loader)
    loader: DataLoader[Any] = DataLoader(
        dataset,
        batch_size=None,
        sampler=sampler,
        num_workers=n,
        persistent_workers=n > 0,
        worker_init_fn=_worker_signals,
    )
    epochs = itertools.count()

    def epoch_iterator() -> Iterator[Any]:
        e, b = next(epochs), dataset.batches
        sampler[:] = range(e * b, (e + 1) * b)
        return iter(loader)

    try:
        return train(epoch_iterator, args)
    finally:  # the persistent workers live as long as the loader's iterator
        workers = getattr(loader, "_iterator", None)
        if workers is not None and hasattr(workers, "_shutdown_workers"):
            workers._shutdown_workers()


def _label(kind: str, hwm: int) -> str:
    return f"batchq hwm {hwm}" if kind == "batchq" else "DataLoader"


def bench(url: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Interleave the configurations, repeat by repeat; print one line per run."""
    configs = [("batchq", n, h) for n in args.producers for h in args.hwm]
    if torch is not None and not args.no_torch:
        configs += [("DataLoader", n, 0) for n in args.producers]
    configs.sort(key=lambda c: c[1])
    runs: list[dict[str, Any]] = []
    total = len(configs) * args.repeats
    for rep, (kind, n, hwm) in itertools.product(range(args.repeats), configs):
        head = f"  [{len(runs) + 1}/{total}] {_label(kind, hwm)}, {n} worker(s), repeat {rep + 1}"
        print(head + " ...", end="", flush=True)
        r = run_batchq(url, n, hwm, args) if kind == "batchq" else run_torch(n, args)
        runs.append({"kind": kind, "workers": n, "hwm": hwm, "repeat": rep, **r})
        epochs = " ".join(f"{x:.3f}" for x in r["epochs_s"])
        codes = [c for c in r.get("exit_codes", []) if c != 0]
        print(
            f" epochs {epochs} s, floor {r['floor']:.3f} s/epoch, x{r['ratio']:.2f}; "
            f"epoch-start wait {1000 * statistics.fmean(r['first_wait_s']):.1f} ms"
            + (f"; producer exit codes {codes}!" if codes else ""),
            flush=True,
        )
    return runs


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Medians over repeats, per (kind, workers, hwm)."""
    groups: dict[tuple[str, int, int], list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault((r["kind"], r["workers"], r["hwm"]), []).append(r)
    out = []
    for (kind, n, hwm), rs in groups.items():
        row: dict[str, Any] = {"kind": kind, "workers": n, "hwm": hwm, "runs": len(rs)}
        for key in ("time_s", "floor", "ratio"):
            row[key] = statistics.median(r[key] for r in rs)
        row["first_wait_ms"] = statistics.median(1000 * x for r in rs for x in r["first_wait_s"])
        out.append(row)
    return out


def print_table(summary: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """workers | floor | per kind: s/epoch and ratio to the floor (medians)."""
    order = sorted({(r["kind"] != "batchq", r["hwm"]) for r in summary})
    cols = [_label("DataLoader" if t else "batchq", h) for t, h in order]
    cell = {(r["workers"], _label(r["kind"], r["hwm"])): r for r in summary}
    print()
    print(f"{'':20}" + "".join(f"{name:>20}" for name in cols))
    print(f"{'workers':>8}{'floor s/ep':>12}" + f"{'s/epoch':>11}{'vs floor':>9}" * len(cols))
    for n in args.producers:
        floors = [r["floor"] for r in summary if r["workers"] == n]
        line = f"{n:>8}{statistics.median(floors):>12.3f}"
        for name in cols:
            r = cell.get((n, name))
            line += f"{r['time_s']:>11.3f}{r['ratio']:>9.2f}" if r else f"{'-':>20}"
        print(line)
    print(
        f"(medians of {args.repeats} run(s); {args.epochs} timed epochs after {args.warmup} "
        f"warm-up; target: batchq within 1.10 of the floor with 4 producers, and no worse "
        f"than DataLoader at equal worker counts)"
    )
    if torch is None or args.no_torch:
        why = "--no-torch" if args.no_torch else f"torch cannot be imported: {NO_TORCH}"
        print(f"DataLoader skipped ({why})")


@contextlib.contextmanager
def _redis(url: str | None) -> Iterator[str]:
    """The given URL, or an embedded redis-server's for the duration of the block."""
    if url:
        yield resolve_url(url)
        return
    from batchq.host.embedded import EmbeddedRedis

    server = EmbeddedRedis()
    try:
        with SIGNALS.deferred():
            server.start()
        print(f"embedded redis-server {server.version} at {server.url} (stopped at the end)")
        yield server.url
    finally:
        server.stop()


class Signals:
    """SIGINT/SIGTERM raise KeyboardInterrupt once (every ``finally`` then stops what it
    started), but not while forking, where it could leave a lock held (logging's at-fork
    hook) or a child unrecorded: there it waits until the fork is done."""

    def __init__(self) -> None:
        self.deferring = 0
        self.pending = False
        self.stopping = False  # later signals are ignored: let the cleanup finish

    def handler(self, signum: int, frame: Any) -> None:
        """The handler to install for SIGINT and SIGTERM."""
        if self.deferring or self.stopping:
            self.pending = True
            return
        self.stopping = True
        raise KeyboardInterrupt

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """Hold signals back for the block; raise KeyboardInterrupt after it if one came."""
        self.deferring += 1
        try:
            yield
        finally:
            self.deferring -= 1
            if self.pending and not self.deferring and not self.stopping:
                self.stopping = True
                raise KeyboardInterrupt


SIGNALS = Signals()


def _worker_signals(worker_id: int) -> None:
    """DataLoader workers (forked from this process) get the default handlers back."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _counts(text: str) -> list[int]:
    values = [int(x) for x in text.split(",") if x.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a comma list of integers >= 1")
    return values


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments, run every configuration, print the table (and JSON)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=None, help="Redis URL (default: an embedded server)")
    p.add_argument("--producers", type=_counts, default=[1, 2, 4, 8], help="e.g. 1,2,4,8")
    p.add_argument("--hwm", type=_counts, default=[10], help="batchq hwm(s), e.g. 10,40")
    p.add_argument("--epochs", type=int, default=3, help="timed epochs per run")
    p.add_argument("--warmup", type=int, default=1, help="untimed epochs first")
    p.add_argument("--repeats", type=int, default=1, help="runs of each configuration")
    p.add_argument("--examples", type=int, default=1000)
    p.add_argument("--features", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=100)
    p.add_argument("--load-ms", type=float, default=40.0, help="loading time per batch")
    p.add_argument("--train-ms", type=float, default=10.0, help="training time per batch")
    p.add_argument("--no-torch", action="store_true", help="skip the DataLoader runs")
    p.add_argument("--json", action="store_true", help="print the results as JSON at the end")
    args = p.parse_args(argv)
    if min(args.epochs, args.repeats) < 1 or args.warmup < 0:
        p.error("--epochs and --repeats must be >= 1, --warmup >= 0")
    signal.signal(signal.SIGTERM, SIGNALS.handler)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not if ignored
        signal.signal(signal.SIGINT, SIGNALS.handler)
    load0 = os.getloadavg()[0]
    print(
        f"scaling: {args.warmup}+{args.epochs} epochs of {args.examples} x {args.features}, "
        f"batch {args.batch_size}, loading {args.load_ms:g} ms, training {args.train_ms:g} ms "
        f"per batch; workers {args.producers}; torch {torch.__version__ if torch else 'absent'}"
    )
    try:
        with _redis(args.url) as url:
            runs = bench(url, args)
    except KeyboardInterrupt:
        print("\ninterrupted; everything started was stopped", file=sys.stderr)
        return 130
    summary = summarize(runs)
    print_table(summary, args)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "cpus": os.cpu_count(), "load": load0}
    meta["load_after"] = os.getloadavg()[0]
    print(f"{meta['cpus']} cpus, 1-min load {load0:.2f} before, {meta['load_after']:.2f} after")
    if args.json:
        print(json.dumps({"meta": meta, "args": vars(args), "summary": summary, "runs": runs}))
    codes = [c for r in runs for c in r.get("exit_codes", [])]
    return 0 if all(c == 0 for c in codes) else 1


if __name__ == "__main__":
    sys.exit(main())
