"""The first batch of fresh processes (issue 40): ``python bench/imagefolder.py --startup``.

The pipeline is examples/imagefolder.py's (see bench/imagefolder.py). Each round, in
turn: a fresh DataLoader job (``DataLoader(num_workers=N, persistent_workers=True)``),
then batchq with its workers forked from the pool (``batchq serve ... --workers N``),
then the same with ``--worker-start spawn`` (a fresh ``python -m batchq.cli serve`` per
worker: the fallback, and the path before the pool imported once; the baseline). Every
side is a fresh process launched by this script and timed from its launch (wall clock,
handed to it) to its loop holding its first batch:

* cold: the pool and the trainer launched at the same moment;
* producers first: the trainer launched once the queue is at its cap; also its first
  iteration -> first batch, and each worker's start -> first push (``status``);
* resumed: a trainer restarted from the first one's checkpoint while the producers keep
  running, from its first iteration (imports done, state loaded) to its first batch,
  against the DataLoader job's imports done -> first batch;
* ``--workers 1:2`` under an input-bound trainer: from the autoscaler's decision to add
  a worker to that worker's first push; and ``--workers 2:2`` adding its minimum at its
  first tick (the same start, without the wait for an input-bound verdict).

Median of ``--startup-rounds`` (3) alternated rounds; figures and ratios are printed,
never asserted. ``--startup-cold-only`` runs the cold case alone (seconds a round, where
a full round takes minutes: for many alternated rounds of two trees). The children run
this file with ``--role``.
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
from typing import Any

import torch
from torch.utils.data import DataLoader

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from batchq.host.embedded import url_or_embedded  # noqa: E402
from batchq.host.procs import spawn, stop_group  # noqa: E402
from consumer import ServerDataStream  # noqa: E402
from consumer.torch import TorchStream  # noqa: E402
from examples.imagefolder import imagefolder, normalise  # noqa: E402

__all__ = ["startup_bench"]


def _startup_role(args: argparse.Namespace) -> int:
    """A child's part: 'loader' (a fresh DataLoader job) or 'trainer' (a fresh batchq
    trainer; --state resumes, --take N batches then saves its state and detaches).
    Prints one JSON line of figures."""
    launched = args.launched
    if args.role == "loader":
        from producer.torch import import_torchvision

        import_torchvision()  # the DataLoader job's imports: torchvision too
    imports_done = time.time()  # this module's imports (torch, consumer) are done
    out: dict[str, Any] = {}
    if args.role == "loader":
        loader = DataLoader(
            imagefolder(args.root, args.images),
            batch_size=args.batch_size,
            shuffle=True,
            generator=torch.Generator().manual_seed(0),
            num_workers=args.workers,
            persistent_workers=True,
        )
        x, _ = next(iter(loader))
        got = time.time()
        normalise(x)
    else:
        stream = ServerDataStream(
            None, False, url=args.url, queue=args.queue, hwm=args.hwm, timeout_s=120
        )
        ts = TorchStream(stream)
        if args.state:
            with open(args.state) as fh:
                ts.load_state_dict(json.load(fh))
        first_iter = time.time()
        it = iter(ts)
        x, _ = next(it)
        got = time.time()
        normalise(x)
        out["first_iter_to_first_s"] = got - first_iter
        out["stats_first_batch_s"] = ts.stats["first_batch_s"]
        for _ in range(args.take):
            next(it)
        if args.save:
            with open(args.save, "w") as fh:
                json.dump(ts.state_dict(), fh)
            ts.close()  # detached: the producers keep running for the next trainer
        else:
            ts.close(finished=True)
    out["launch_to_first_s"] = got - launched
    out["imports_to_first_s"] = got - imports_done
    print(json.dumps(out), flush=True)
    return 0


def _child(role: str, args: argparse.Namespace, env: dict[str, str], **extra: Any) -> Any:
    """Launch this script as ``role`` now (its launch time passed to it)."""
    argv = [sys.executable, os.path.abspath(__file__), "--role", role]
    argv += ["--launched", repr(time.time()), "--root", args.root, "--images", str(args.images)]
    argv += ["--batch-size", str(args.batch_size), "--workers", str(args.workers)]
    argv += ["--hwm", str(args.hwm)]
    for k, v in extra.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    return spawn(argv, env=env, stdout=subprocess.PIPE)


def _figures(proc: Any) -> dict[str, Any]:
    out, _ = proc.communicate(timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"a startup child exited with {proc.returncode}")
    return dict(json.loads(out.decode().strip().splitlines()[-1]))


def _serve_argv(
    url: str, queue: str, args: argparse.Namespace, workers: str, how: str
) -> list[str]:
    argv = [sys.executable, "-m", "batchq.cli", "--log-level", "WARNING", "serve"]
    argv += ["examples.imagefolder:make_loader", "--url", url, "--queue", queue]
    argv += ["--hwm", str(args.hwm), "--workers", workers, "--worker-start", how]
    argv += ["--arg", f"root={args.root}", "--arg", f"images={args.images}"]
    argv += ["--arg", f"batch_size={args.batch_size}", "--heartbeat-ttl-s", "1"]
    return argv


def _row(client: Any, queue: str) -> dict[str, Any]:
    from batchq.monitoring.rows import queue_status

    return queue_status(client, queue)


def _until(what: str, cond: Any, timeout_s: float = 120.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.02)
    raise RuntimeError(f"timed out waiting for {what}")


def _startup_round(
    url: str, how: str, args: argparse.Namespace, env: dict[str, str]
) -> dict[str, Any]:
    """One round of the batchq side with workers started by ``how`` (fork or spawn)."""
    from batchq.client.connection import make_client

    client = make_client(url)
    res: dict[str, Any] = {}
    workers = str(args.workers)
    # Cold: the pool and the trainer launched at the same moment.
    queue = f"bench-start-{uuid.uuid4().hex[:8]}"
    pool = spawn(_serve_argv(url, queue, args, workers, how), env=env)
    trainer = _child("trainer", args, env, url=url, queue=queue)
    try:
        res["cold"] = _figures(trainer)
        pool.wait(timeout=60)
    finally:
        stop_group(pool, timeout_s=10.0)
    if getattr(args, "startup_cold_only", False):
        client.close()
        return res
    # Producers first: the trainer arrives at a queue filled to its cap; then a trainer
    # restarted from the first one's checkpoint while the producers keep running.
    queue = f"bench-start-{uuid.uuid4().hex[:8]}"
    pool = spawn(_serve_argv(url, queue, args, workers, how), env=env)
    state = os.path.join(args.root, f"{queue}.state.json")
    try:
        _until("a full queue", lambda: _row(client, queue)["depth"] >= args.hwm)
        first = _child("trainer", args, env, url=url, queue=queue, take=20, save=state)
        res["warm"] = _figures(first)
        pushes = [p["first_push_s"] for p in _row(client, queue)["producers"]]
        res["first_push_s"] = [p for p in pushes if p is not None]
        _until("a full queue again", lambda: _row(client, queue)["depth"] >= args.hwm)
        res["resume"] = _figures(_child("trainer", args, env, url=url, queue=queue, state=state))
        pool.wait(timeout=60)
    finally:
        stop_group(pool, timeout_s=10.0)
        with contextlib.suppress(OSError):
            os.remove(state)
    res["auto"] = _startup_auto(url, how, args, env, client)
    res["auto_min"] = _startup_auto_min(url, how, args, env, client)
    client.close()
    return res


def _startup_auto_min(
    url: str, how: str, args: argparse.Namespace, env: dict[str, str], client: Any
) -> float:
    """``--workers 2:2``: the autoscaler's pool adds its minimum at its first tick (the
    same start as an add under load): from that decision to each worker's first push
    (their median; no trainer yet, the queue has room)."""
    queue = f"bench-start-{uuid.uuid4().hex[:8]}"
    pool = spawn(_serve_argv(url, queue, args, "2:2", how), env=env)
    try:
        # The queue full: every push that will happen without a trainer happened; each
        # worker's figure is written by its next heartbeat.
        _until("a full queue", lambda: _row(client, queue)["depth"] >= args.hwm)

        def pushes() -> list[float] | None:
            firsts = [p["first_push_s"] for p in _row(client, queue)["producers"]]
            return [f for f in firsts if f] if len(firsts) == 2 and any(firsts) else None

        rows = _until("the workers' first push", pushes)
        return float(statistics.median(rows))
    finally:
        stop_group(pool, timeout_s=10.0)


def _startup_auto(
    url: str, how: str, args: argparse.Namespace, env: dict[str, str], client: Any
) -> float | None:
    """``--workers 1:2`` under an input-bound trainer: from the decision to add a worker
    (the scalelog entry's time) to that worker's first push."""
    from batchq.protocol.keys import QueueKeys

    queue = f"bench-start-{uuid.uuid4().hex[:8]}"
    pool = spawn(_serve_argv(url, queue, args, "1:2", how), env=env)
    stream = ServerDataStream(None, False, url=url, queue=queue, hwm=args.hwm, timeout_s=120)
    keys = QueueKeys(queue)
    try:
        with TorchStream(stream) as ts:
            first_ids: set[str] = set()
            added: dict[str, Any] | None = None
            deadline = time.monotonic() + 90
            while added is None and time.monotonic() < deadline:
                for _x, _ in ts:  # input-bound: the autoscaler adds the second worker
                    if not first_ids:
                        first_ids = {p["id"] for p in _row(client, queue)["producers"]}
                    log = [json.loads(e) for e in client.lrange(keys.scalelog, 0, -1)]
                    adds = [e for e in log if e["action"] == "add" and e["workers"] == 2]
                    if adds:
                        added = adds[-1]
                        break
                    # Input-bound, but the host has no idle core for a worker (2 cores:
                    # the trainer and one worker): the autoscaler rightly holds.
                    held = [e for e in log if e["action"] == "hold" and "idle cores" in e["reason"]]
                    if len(held) >= 3:
                        print(f"  ({how}) --workers 1:2 held: {held[0]['reason']}", flush=True)
                        return None
            if added is None:
                return None

            def new_push() -> Any:
                rows = _row(client, queue)["producers"]
                return [p for p in rows if p["id"] not in first_ids and p["first_push_s"]]

            for _x, _ in ts:  # keep the trainer taking until the new worker's figure shows
                new = new_push()
                if new:
                    break
            else:
                new = _until("the new worker's first push", new_push, 30)
            # first_push_s counts from the worker's start (its fork, or its process's),
            # which came right after the decision the scalelog entry timed.
            ts.close(finished=True)
            return float(new[0]["first_push_s"])
    finally:
        stop_group(pool, timeout_s=10.0)


def startup_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Median of ``--startup-rounds`` alternated rounds: DataLoader, batchq (fork),
    batchq (spawn: the fallback, today's path)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p),
    }
    rounds: list[dict[str, Any]] = []
    with url_or_embedded(args.url) as url:
        for r in range(args.startup_rounds):
            row = {
                "loader": _figures(_child("loader", args, env)),
                "fork": _startup_round(url, "fork", args, env),
                "spawn": _startup_round(url, "spawn", args, env),
            }
            print(f"round {r}: {json.dumps(row)}", flush=True)
            rounds.append(row)
    _print_startup(rounds)
    return {"rounds": rounds}


def _print_startup(rounds: list[dict[str, Any]]) -> None:
    def med(path: Any) -> float:
        vals = [v for v in (path(r) for r in rounds) if v is not None]
        return statistics.median(vals) if vals else float("nan")

    loader = med(lambda r: r["loader"]["launch_to_first_s"])
    loader_span = med(lambda r: r["loader"]["imports_to_first_s"])
    print(f"\n== first batch, fresh processes, median of {len(rounds)} rounds ==")
    print(f"DataLoader(num_workers=2, persistent): launch -> first batch {loader:.3f} s, "
          f"imports done -> first batch {loader_span:.3f} s")  # fmt: skip
    if "warm" not in rounds[0]["fork"]:  # --startup-cold-only
        _print_cold(rounds, loader)
        return
    for how in ("fork", "spawn"):
        cold = med(lambda r, h=how: r[h]["cold"]["launch_to_first_s"])
        warm = med(lambda r, h=how: r[h]["warm"]["launch_to_first_s"])
        warm_it = med(lambda r, h=how: r[h]["warm"]["first_iter_to_first_s"])
        resume = med(lambda r, h=how: r[h]["resume"]["first_iter_to_first_s"])
        push = med(lambda r, h=how: min(r[h]["first_push_s"], default=None))
        auto = med(lambda r, h=how: r[h]["auto"])
        auto_min = med(lambda r, h=how: r[h]["auto_min"])
        seen = sum(1 for r in rounds if r[how]["auto"] is not None)
        print(f"batchq, workers by {how}:")
        print(f"  cold (pool and trainer launched together): {cold:.3f} s, "
              f"{cold / loader:.2f}x the DataLoader's")  # fmt: skip
        print(f"  producers first: launch -> first batch {warm:.3f} s ({warm / loader:.2f}x), "
              f"first iteration -> first batch {warm_it * 1000:.1f} ms; a worker's start -> "
              f"first push {push:.3f} s")  # fmt: skip
        print(f"  resumed from a checkpoint, producers running: first iteration -> first "
              f"batch {resume * 1000:.1f} ms ({resume / loader_span:.3f}x the DataLoader's "
              f"imports -> first batch)")  # fmt: skip
        print(
            f"  --workers 1:2 adding a worker under an input-bound trainer: decision -> "
            f"its first push {auto:.3f} s ({seen} of {len(rounds)} rounds added one)"
        )
        print(f"  --workers 2:2 adding its minimum: decision -> first push {auto_min:.3f} s")
    cold_f = med(lambda r: r["fork"]["cold"]["launch_to_first_s"])
    cold_s = med(lambda r: r["spawn"]["cold"]["launch_to_first_s"])
    add_f, add_s = med(lambda r: r["fork"]["auto_min"]), med(lambda r: r["spawn"]["auto_min"])
    print(f"fork vs spawn: cold first batch {cold_f / cold_s:.2f}x, a worker added "
          f"(decision -> first push) {add_f / add_s:.3f}x")  # fmt: skip


def _print_cold(rounds: list[dict[str, Any]], loader: float) -> None:
    """The cold lines alone (``--startup-cold-only``), with each round's ratio."""
    for how in ("fork", "spawn"):
        pairs = [(r[how]["cold"]["launch_to_first_s"], r["loader"]["launch_to_first_s"])
                 for r in rounds]  # fmt: skip
        cold = statistics.median(c for c, _ in pairs)
        each = ", ".join(f"{c:.3f} s ({c / d:.2f}x)" for c, d in pairs)
        print(f"batchq, workers by {how}: cold {cold:.3f} s, {cold / loader:.2f}x the "
              f"DataLoader's; per round {each}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """A child's part (``--role``); the bench itself runs from bench/imagefolder.py."""
    p = argparse.ArgumentParser(description="a child of bench/imagefolder.py --startup")
    p.add_argument("--role", choices=("loader", "trainer"), required=True)
    p.add_argument("--launched", type=float, required=True)
    p.add_argument("--root", required=True)
    p.add_argument("--images", type=int, required=True)
    p.add_argument("--batch-size", type=int, required=True)
    p.add_argument("--workers", type=int, required=True)
    p.add_argument("--hwm", type=int, required=True)
    p.add_argument("--url", default=None)
    p.add_argument("--queue", default="")
    p.add_argument("--state", default="")
    p.add_argument("--save", default="")
    p.add_argument("--take", type=int, default=0)
    return _startup_role(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
