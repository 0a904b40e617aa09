"""The ``batchq`` command: serve, demo, status, reset.

Redis is always ``--url`` (default: the BATCHQ_URL environment variable, else
redis://localhost:6379/0; ``demo`` starts an embedded redis-server when neither is set).
Unlike the rest of ``batchq``, the CLI may import ``producer`` and ``consumer``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from batchq.connection import ENV_URL
from batchq.errors import BatchQueueError

__all__ = ["main"]


def _add_url(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url",
        default=os.environ.get(ENV_URL),
        help=f"Redis URL, redis:// or rediss:// (default: ${ENV_URL}, else "
        "redis://localhost:6379/0)",
    )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``batchq`` command."""
    parser = argparse.ArgumentParser(
        prog="batchq",
        description="Feed a trainer from many data-preparation processes through Redis.",
    )
    parser.add_argument(
        "--log-level", default="INFO", help="logging level (DEBUG, INFO, WARNING; default INFO)"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser(
        "serve",
        help="serve the stream that MODULE:FACTORY() returns",
        description="Serve the stream that MODULE:FACTORY() returns into a queue, epoch "
        "after epoch, until the trainer finishes the run (exit 0) or SIGTERM/SIGINT.",
    )
    serve.add_argument("factory", metavar="MODULE:FACTORY", help="e.g. mypkg.data:make_stream")
    _add_url(serve)
    serve.add_argument("--queue", default=os.environ.get("BATCHQ_QUEUE", "default"))
    serve.add_argument(
        "--hwm", type=int, default=int(os.environ.get("BATCHQ_HWM", "10")), help="queue cap"
    )
    serve.add_argument("--workers", type=int, default=1, help="producer processes to run")
    serve.add_argument(
        "--requests-per-shard",
        type=int,
        default=None,
        help="consecutive requests per shard (default: the smallest exact cut)",
    )
    serve.add_argument(
        "--heartbeat-ttl-s",
        type=float,
        default=10.0,
        help="a producer silent this long is declared dead and its shards redone",
    )

    demo = sub.add_parser(
        "demo",
        help="run the tutorial experiment: in-process vs served",
        description="Run Fuel's tutorial experiment (N batches per epoch, a loading delay "
        "per batch, a training delay per batch) once in-process and once through "
        "producer processes, and print the times side by side. Without --url it starts "
        "a private redis-server on a free loopback port and stops it at the end.",
    )
    _add_url(demo)
    demo.add_argument(
        "--producers",
        type=int,
        default=1,
        help="with N > 1, run 1 and N producers side by side",
    )
    demo.add_argument("--epochs", type=int, default=5)
    demo.add_argument("--examples", type=int, default=1000)
    demo.add_argument("--features", type=int, default=128)
    demo.add_argument("--batch-size", type=int, default=100)
    demo.add_argument(
        "--load-ms",
        type=float,
        default=None,
        help="loading time per batch (default 5; 25 with --producers > 1: data-bound)",
    )
    demo.add_argument("--train-ms", type=float, default=10.0, help="training time per batch")
    demo.add_argument("--hwm", type=int, default=10)
    demo.add_argument("--json", action="store_true", help="print the results as JSON")

    status = sub.add_parser(
        "status",
        help="show every queue (or one): depth vs hwm, producers, batches served",
        description="Show every queue on the server, or the one named: depth (LLEN of "
        "its data list) against its hwm, producers alive, leases, frames served.",
    )
    _add_url(status)
    status.add_argument("--queue", default=None, help="only this queue")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    reset = sub.add_parser(
        "reset",
        help="delete a queue's keys (and only those), after confirmation",
        description="Delete every key of one queue (bq:{Q}:*): its run, frames, leases, "
        "ledger and counters. Producers and trainers of that queue stop or start over. "
        "Asks for the queue's name unless --yes.",
    )
    _add_url(reset)
    reset.add_argument("--queue", required=True, help="the queue to delete")
    reset.add_argument("--yes", action="store_true", help="do not ask")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``batchq`` command; returns the exit code."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        if args.command == "serve":
            from batchq.cli.serve import run_serve

            return run_serve(args)
        if args.command == "demo":
            from batchq.cli.demo import run_demo

            return run_demo(args)
        if args.command == "reset":
            from batchq.cli.reset import run_reset

            return run_reset(args)
        if args.command == "status":
            from batchq.cli.status import run_status

            return run_status(args)
    except BatchQueueError as e:
        print(f"batchq {args.command}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 2


if __name__ == "__main__":
    sys.exit(main())
