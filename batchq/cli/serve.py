"""``batchq serve MODULE:FACTORY``: run producers for the stream FACTORY() returns."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from typing import Any

from batchq.cli.factory_args import ENV_ARGS, as_stream, call_factory, load_factory
from batchq.client.connection import ENV_URL, make_client, resolve_url
from batchq.host.autoscale import ScalePolicy
from batchq.host.pool import WorkerPool
from batchq.host.procs import spawn, stop_group
from batchq.protocol.keys import QueueKeys

__all__ = ["run_serve"]

log = logging.getLogger(__name__)


def run_serve(args: argparse.Namespace) -> int:
    """Serve in this process, or supervise ``--workers`` producer processes."""
    policy = ScalePolicy.parse(args.workers)
    url = resolve_url(args.url)
    if policy.auto or policy.min_workers > 1:
        return _supervise(args, url, policy)
    from producer import start_server

    stream = as_stream(call_factory(load_factory(args.factory), args.factory, args.factory_args))
    return start_server(
        stream,
        hwm=args.hwm,
        queue=args.queue,
        url=url,
        requests_per_shard=args.requests_per_shard,
        heartbeat_ttl_s=args.heartbeat_ttl_s,
        orphan_exit_s=getattr(args, "orphan_exit_s", 600.0) or None,
        transport=args.transport,
        shm_dir=args.shm_dir,
        stripes=args.stripes,
    )


def _supervise(args: argparse.Namespace, url: str, policy: ScalePolicy) -> int:
    # Each worker is a plain `batchq serve` in its own process group; SIGTERM/SIGINT to
    # the supervisor is passed on, so its workers hand their leases back.
    load_factory(args.factory)  # fail early, in the parent, on a bad spec
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
    # The URL may hold a password: pass it in the environment, not on command lines.
    env = {**os.environ, ENV_URL: url}
    env[ENV_ARGS] = json.dumps(args.factory_args)  # the factory's arguments, same way
    stopping = threading.Event()

    def forward(signum: int, _frame: Any) -> None:
        stopping.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, forward)
    if (
        policy.auto
    ):  # --workers auto or MIN:MAX: batchq.host.autoscale decides, batchq.host.pool acts
        client = make_client(url, key=QueueKeys(args.queue).meta)
        try:
            pool = WorkerPool(client, args.queue, policy, lambda: spawn(argv, env=env))
            return pool.run(stopping)
        finally:
            client.close()
    procs = [spawn(argv, env=env) for _ in range(policy.min_workers)]
    codes: list[int] = []
    try:
        for proc in procs:
            while proc.poll() is None and not stopping.is_set():
                stopping.wait(0.2)
            if stopping.is_set():
                break
            codes.append(proc.returncode)
    finally:
        for proc in procs:
            code = stop_group(proc, timeout_s=10.0)
            if stopping.is_set() and code is not None:
                codes.append(code)
    log.info("workers exited with %s", codes)
    return max((abs(c) for c in codes), default=0)
