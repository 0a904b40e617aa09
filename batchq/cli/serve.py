"""``batchq serve MODULE:FACTORY``: run producers for the stream FACTORY() returns.

With ``--workers`` (N, MIN:MAX or auto) this process is the pool: it imports the factory,
calls it and plans the stream (the probe batch that names the sources, the shard plan)
once, then forks each worker from itself (:func:`batchq.host.procs.fork_child`), so a worker starts
serving in milliseconds instead of an interpreter's start, an import of the factory and
its own plan. Where a fork is not safe (no fork on this platform, another thread runs in
this process) or ``--worker-start spawn`` asks, each worker is a fresh
``python -m batchq.cli serve`` instead, as before. Either way the pool keeps its workers:
one killed by a signal is replaced (:mod:`batchq.host.pool`).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import redis

from batchq.cli.factory_args import ENV_ARGS, as_stream, call_factory, load_factory
from batchq.client.connection import ENV_URL, StopEvent, make_client, resolve_url
from batchq.errors import BatchQueueError, ConfigError
from batchq.host.autoscale import ScalePolicy
from batchq.host.pool import REPLACE_EXIT_CODE, WorkerPool, keep_workers
from batchq.host.procs import Child, fork_child, fork_refused, spawn
from batchq.protocol.keys import QueueKeys

__all__ = ["run_serve"]

log = logging.getLogger(__name__)


def run_serve(args: argparse.Namespace) -> int:
    """Serve in this process, or supervise ``--workers`` producer processes (the
    process's SIGINT/SIGTERM handlers are as they were after)."""
    previous: dict[signal.Signals, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, _exit_before_serving)
    try:
        return _run_serve(args)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _run_serve(args: argparse.Namespace) -> int:
    policy = ScalePolicy.parse(args.workers)
    url = resolve_url(args.url)
    if policy.auto or policy.min_workers > 1:
        return _supervise(args, url, policy)
    # The job's start: this process's, before the factory's imports (a replica of a job
    # whose run finished while it imported is told by it, join.lua), or, in a worker a
    # pool spawned, the pool's (a worker it replaced after the finish is a replica too).
    job_started_s = _pool_started() or _job_started()
    # Frozen after, as a pool's: else the first full collections, in the first epoch,
    # visit every object of torch's imports (0.3-0.8 s of a producer, bench/README.md).
    with _collector_paused(freeze=True):
        stream = _stream(args)
    return _serve(stream, None, args, url, None, job_started_s)


def _exit_before_serving(_signum: int, _frame: Any) -> None:
    """SIGTERM/SIGINT before the producer (or the pool) installs its own handlers, while
    the factory imports and the plan's probe runs: nothing is held yet (no lease, no
    worker), so the stop is an exit 0, as it is later (Python's default was -15)."""
    raise SystemExit(0)


#: The environment variable a pool's spawned worker finds the pool's start in (wall
#: clock, s): the job it belongs to started then.
ENV_JOB_STARTED = "BATCHQ_JOB_STARTED_S"


def _pool_started() -> float | None:
    """The pool's start a spawned worker was given (taken out of the environment, so no
    process this one starts inherits it), or None.

    Raises:
        ConfigError: the value is not a number of seconds.
    """
    text = os.environ.pop(ENV_JOB_STARTED, None)
    if text is None:
        return None
    try:
        return float(text)
    except ValueError:
        raise ConfigError(
            f"{ENV_JOB_STARTED}={text!r} is not valid: expected the pool's start, in seconds "
            "since the epoch (set by `batchq serve --workers` for the workers it spawns)"
        ) from None


def _job_started() -> float:
    """This process's start (wall clock, s), the start of the job it serves."""
    from producer.serving.heartbeat import process_started_s

    return process_started_s()


def _opt(args: argparse.Namespace, name: str) -> Any:
    """An optional serve flag's value (None where the namespace has none: one built by a
    caller that predates the flag, as the pool's tests build theirs)."""
    return getattr(args, name, None)


@contextlib.contextmanager
def _collector_paused(freeze: bool = False) -> Iterator[None]:
    """Pause Python's cyclic garbage collector for the block (as it was after).

    A factory's imports (torch, torchvision) make objects by the million, and the full
    collections they set off visit every one: 0.3-0.4 s of a 2.4 s start on this
    project's machine, on the first batch's path (bench/README.md, issue 40). Objects
    freed by their reference counts are freed as ever; cycles wait for the collector.

    Args:
        freeze: after the block, move every object the process holds to the
            collector's permanent generation (``gc.freeze``, what Python advises before
            a fork): no collection visits them again, in this process or a forked
            worker, where the first young collection would otherwise visit all that the
            block made (about 0.1 s here), and a full one would write to (copy) every
            page the worker shares with the pool. A cycle that was garbage then is
            never collected (once, at start).
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if freeze:
            gc.freeze()
        if enabled:
            gc.enable()


def _stream(args: argparse.Namespace) -> Any:
    """The factory's stream (imported and called here, the collector paused), with
    ``--on-sample-error`` and ``--max-quarantined`` set on its root before any plan is
    made of it (the plan's fingerprint names a stream that quarantines, in a forked
    worker's pool as in a spawned worker)."""
    with _collector_paused():
        factory = load_factory(args.factory)
        stream = as_stream(call_factory(factory, args.factory, args.factory_args))
    on_error, most = _opt(args, "on_sample_error"), _opt(args, "max_quarantined")
    if on_error is not None or most is not None:
        from producer.quarantine import set_sample_errors

        set_sample_errors(stream, on_error, most)
    return stream


def _serve(
    stream: Any,
    plan: Any,
    args: argparse.Namespace,
    url: str,
    started_at: float | None = None,
    job_started_s: float | None = None,
) -> int:
    """Serve ``stream`` in this process (``plan``: its shard plan, made already, or None;
    ``started_at``: the worker's start, wall clock, where it is not the process's;
    ``job_started_s``: the job's, the pool's where a pool started the worker).
    A build past ``--build-timeout-s`` exits :data:`REPLACE_EXIT_CODE`: the stuck read
    cannot be interrupted, so this worker goes and a pool replaces it."""
    from producer import start_server
    from producer.errors import BuildTimeout

    try:
        return start_server(
            stream,
            hwm=args.hwm,
            queue=args.queue,
            url=url,
            requests_per_shard=None if plan is not None else args.requests_per_shard,
            heartbeat_ttl_s=args.heartbeat_ttl_s,
            orphan_exit_s=getattr(args, "orphan_exit_s", 600.0) or None,
            transport=args.transport,
            shm_dir=args.shm_dir,
            stripes=args.stripes,
            started_at=started_at,
            job_started_s=job_started_s,
            build_timeout_s=_opt(args, "build_timeout_s"),
            **({"shard_plan": plan} if plan is not None else {}),
        )
    except BuildTimeout as e:
        log.error("%s; exiting %d to be replaced", e, REPLACE_EXIT_CODE)
        return REPLACE_EXIT_CODE
    except BatchQueueError as e:
        # As main() says it, one line and exit 2: a forked worker's error never reaches
        # main(), and a traceback per worker buried a wrong URL or a refused pipeline.
        print(f"batchq serve: {e}", file=sys.stderr, flush=True)
        return 2


def _spawner(args: argparse.Namespace, url: str, job_started_s: float) -> Callable[[], Child]:
    """Start a worker as a fresh ``python -m batchq.cli serve`` in its own process group
    (``job_started_s``: the pool's start, the job's)."""
    argv = [
        sys.executable,
        "-m",
        "batchq.cli",
        "--log-level",
        str(args.log_level),
        "serve",
        args.factory,
        "--queue",
        args.queue,
        "--hwm",
        str(args.hwm),
        "--stripes",
        str(args.stripes),
        "--heartbeat-ttl-s",
        str(args.heartbeat_ttl_s),
        "--orphan-exit-s",
        str(getattr(args, "orphan_exit_s", 600.0)),
        "--transport",
        args.transport,
        "--shm-dir",
        args.shm_dir,
    ]
    if args.requests_per_shard is not None:
        argv += ["--requests-per-shard", str(args.requests_per_shard)]
    for flag, value in (
        ("--on-sample-error", _opt(args, "on_sample_error")),
        ("--max-quarantined", _opt(args, "max_quarantined")),
        ("--build-timeout-s", _opt(args, "build_timeout_s")),
    ):
        if value is not None:
            argv += [flag, str(value)]
    # The URL may hold a password: pass it in the environment, not on command lines.
    env = {**os.environ, ENV_URL: url}
    env[ENV_ARGS] = json.dumps(args.factory_args)  # the factory's arguments, same way
    env[ENV_JOB_STARTED] = repr(job_started_s)
    return lambda: spawn(argv, env=env)


def _forker(
    args: argparse.Namespace,
    url: str,
    spawner: Callable[[], Child],
    client: redis.Redis | None,
    job_started_s: float,
) -> Callable[[], Child]:
    """Build the stream and its plan here, once; then start each worker as a fork of this
    process, or with ``spawner`` when a fork is not safe at that moment (every worker's
    job started with the pool, ``job_started_s``: a worker forked to replace another
    after the run finished is a late replica, and exits 0)."""
    from producer.serving.sharding import ShardPlan

    with _collector_paused(freeze=True):  # what the workers share, made once
        stream = _stream(args)
        torch = sys.modules.get("torch")  # imported by the factory, if at all
        if torch is not None:
            # The probe batch runs here: on one thread, as in the workers, so no OpenMP
            # pool of this process exists when it forks (a forked one has no threads).
            torch.set_num_threads(1)
        plan = ShardPlan(stream, args.requests_per_shard)  # the probe batch too (sources)
    warned: list[str] = []

    def start() -> Child:
        refused = fork_refused()
        if refused is not None:
            if refused not in warned:
                log.warning("cannot fork a worker: %s; starting a fresh process", refused)
                warned.append(refused)
            return spawner()
        if client is not None:
            client.connection_pool.disconnect()  # no socket of ours in the child
        forked_at = time.time()  # the worker's start: its first_push_s counts from here
        return fork_child(lambda: _serve(stream, plan, args, url, forked_at, job_started_s))

    return start


def _supervise(args: argparse.Namespace, url: str, policy: ScalePolicy) -> int:
    # Each worker runs in its own process group; SIGTERM/SIGINT to the supervisor is
    # passed on, so its workers hand their leases back.
    stopping = StopEvent()  # set by a signal handler: threading.Event's set may deadlock there

    def forward(signum: int, _frame: Any) -> None:
        stopping.set()

    job_started_s = _job_started()
    spawner = _spawner(args, url, job_started_s)
    client = make_client(url, key=QueueKeys(args.queue).meta) if policy.auto else None
    try:
        start_by = getattr(args, "worker_start", "fork")
        refused = fork_refused() if start_by == "fork" else "--worker-start spawn"
        if refused is None:
            start = _forker(args, url, spawner, client, job_started_s)
        else:
            log.info("workers start as fresh processes: %s", refused)
            load_factory(args.factory)  # fail early, in the parent, on a bad spec
            start = spawner
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, forward)
        if client is not None:
            # --workers auto or MIN:MAX: batchq.host.autoscale decides, batchq.host.pool acts
            return WorkerPool(client, args.queue, policy, start).run(stopping)
        return keep_workers(start, policy.min_workers, stopping)
    finally:
        if client is not None:
            client.close()
