"""The ``batchq`` command: serve, demo, status, top, exporter, report, dead, reset.

Redis is always ``--url`` (default: the BATCHQ_URL environment variable, else
redis://localhost:6379/0; ``demo`` starts an embedded redis-server when neither is set).
Unlike the rest of ``batchq``, the CLI may import ``producer`` and ``consumer``.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from batchq.cli.config import Parser, apply_environment, run_config
from batchq.cli.factory_args import add_factory_args
from batchq.client.connection import ENV_URL
from batchq.client.urls import CLUSTER_SCHEMES, SENTINEL_SCHEMES, SERVER_SCHEMES
from batchq.errors import BatchQueueError
from batchq.monitoring import STATUS_SCHEMA_VERSION

__all__ = ["LOG_LEVELS", "main"]

#: The values --log-level (BATCHQ_LOG_LEVEL) accepts, in any case.
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _log_level(text: str) -> str:
    """--log-level's value as logging's name of the level.

    Raises:
        argparse.ArgumentTypeError: not one of :data:`LOG_LEVELS` (its message names the
            value and them; :func:`batchq.cli.config.apply_environment` puts the
            variable's name before it).
    """
    if text.upper() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not valid: expected one of {', '.join(LOG_LEVELS)} (in any case)"
        )
    return text.upper()


def _add_url(parser: argparse.ArgumentParser, default: str = "redis://localhost:6379/0") -> None:
    """The --url option; ``default``: what the command uses when neither --url nor
    BATCHQ_URL is given."""
    schemes = ", ".join(f"{s}://" for s in (*SERVER_SCHEMES, *CLUSTER_SCHEMES, *SENTINEL_SCHEMES))
    parser.add_argument(
        "--url",
        default=None,
        help=f"Redis URL, one of {schemes} (rediss: TLS; a cluster: "
        "redis+cluster://host:port[,host:port...]/, Sentinel: "
        "redis+sentinel://host:port[,host:port...]/<master-name>[/<db>]; default: "
        f"${ENV_URL}, else {default})",
    )


def _add_monitoring(parser: Parser, sub: Any) -> None:
    """The subcommands top, exporter and report."""
    top = parser.add_command(
        sub,
        "top",
        help="watch every queue (or one) live: depth, stall, rates, verdict",
        description="A live view of the queues, refreshed every --interval seconds: depth "
        "vs hwm, bytes held, oldest frame, producers and their rates, the trainer's stall "
        "and epoch, sparklines of depth and stall, and the verdict (input-bound, "
        "trainer-bound, balanced). Ctrl-C quits.",
    )
    _add_url(top)
    top.add_argument(
        "--queue",
        default=None,
        help="only this queue (with --once, exit 2 if no key of it is there; live, say so "
        "and wait for it)",
    )
    top.add_argument(
        "--interval", type=float, default=1.0, help="seconds between refreshes (default 1)"
    )
    top.add_argument("--once", action="store_true", help="print one screen and exit")
    top.add_argument(
        "--json",
        action="store_true",
        help="with --once (refused without: the live screen is redrawn in place): print "
        "the rows of status --json, each with top's rate_in, rate_out, depth_series and "
        "stall_series added at its end, instead of the screen",
    )

    exporter = parser.add_command(
        sub,
        "exporter",
        help="serve Prometheus metrics of the queues (needs the 'exporter' extra)",
        description="Serve /metrics for Prometheus, reading Redis on every scrape, until "
        "SIGTERM or SIGINT (exit 0). Needs prometheus-client: pip install "
        "'batchq[exporter]'.",
    )
    _add_url(exporter)
    exporter.add_argument(
        "--port", type=int, default=9108, help="HTTP port to listen on (default 9108; 0: any)"
    )
    exporter.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default 127.0.0.1, this host only; 0.0.0.0 for every "
        "interface, e.g. in a container)",
    )
    exporter.add_argument(
        "--queue",
        action="append",
        default=None,
        help="export this queue (repeatable; default: every queue on the server)",
    )

    report = parser.add_command(
        sub,
        "report",
        help="plot a queue's depth, stall and throughput to a PNG (needs the 'report' extra)",
        description="Plot depth, the trainer's stall % and throughput over the run from "
        "the queue's history list (one sample a second, the last hour) into an image. "
        "Needs matplotlib: pip install 'batchq[report]'.",
    )
    _add_url(report)
    report.add_argument("--queue", required=True, help="the queue to plot")
    report.add_argument(
        "--out", default="report.png", help="the image to write (default report.png)"
    )
    report.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object instead of the lines (the image is written all the "
        "same): its path, the samples' count and span, the mean stall, the run's "
        "quarantined examples and cache figures, and every plotted series (fields: "
        "batchq/cli/report.py)",
    )


def build_parser() -> Parser:
    """The argument parser of the ``batchq`` command."""
    parser = Parser(
        prog="batchq",
        description="Feed a trainer from many data-preparation processes through Redis.",
    )
    parser.add_argument(
        "--log-level",
        type=_log_level,
        default="INFO",
        help=f"logging level, one of {', '.join(LOG_LEVELS)}, in any case (default INFO); "
        "before the command: batchq --log-level DEBUG serve ...",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = parser.add_command(
        sub,
        "serve",
        help="serve the stream that MODULE:FACTORY() returns",
        description="Serve the stream that MODULE:FACTORY() returns into a queue, epoch "
        "after epoch, until the trainer finishes the run (exit 0), no trainer has claimed "
        "the run for --orphan-exit-s (exit 0), or SIGTERM/SIGINT. MODULE is imported with "
        "the current folder first on the module path, as python -m does.",
    )
    serve.add_argument(
        "factory",
        metavar="MODULE:FACTORY",
        help="e.g. mypkg.data:make_stream (the current folder is on the path, as with python -m)",
    )
    add_factory_args(serve)
    _add_url(serve)
    serve.add_argument("--queue", default="default", help="the queue's name")
    serve.add_argument(
        "--hwm", type=int, default=10, help="queue cap (the run's, set by its first producer)"
    )
    serve.add_argument(
        "--stripes",
        type=int,
        default=1,
        help="split the queue over this many Redis slots (on a cluster, masters), each "
        "with its own list and cap; fixed when the run is created (default 1)",
    )
    serve.add_argument(
        "--workers",
        default="1",
        help="producer processes to run: N, or MIN:MAX / auto (1:16) to scale on the "
        "trainer's demand (batchq.host.autoscale)",
    )
    serve.add_argument(
        "--worker-start",
        choices=("fork", "spawn"),
        default="fork",
        help="how --workers starts a worker: fork (from the pool's process, which imported "
        "the factory and built the stream once; falls back to spawn where fork is not "
        "safe) or spawn (a fresh `python -m batchq.cli serve` each; default fork)",
    )
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
    serve.add_argument(
        "--orphan-exit-s",
        type=float,
        default=600.0,
        help="exit 0 once no trainer has claimed the run for this long (a crashed "
        "trainer; a restarted one may resume within it; default 600; 0: never)",
    )
    serve.add_argument(
        "--transport",
        choices=("auto", "shm", "redis"),
        default="auto",
        help="auto: frames go through shared memory while the trainer is on this host; "
        "redis: always through Redis",
    )
    serve.add_argument(
        "--shm-dir", default="/dev/shm", help="the shared-memory folder (default /dev/shm)"
    )
    serve.add_argument(
        "--on-sample-error",
        choices=("raise", "quarantine"),
        default=None,
        help="an example whose read raises: raise (the shard fails, retried; the default) "
        "or quarantine (recorded, replaced by a substitute drawn alike in every producer; "
        "map-style torch and Hugging Face datasets, and Fuel pipelines reading examples by "
        "index; `batchq dead` lists them)",
    )
    serve.add_argument(
        "--max-quarantined",
        type=float,
        default=None,
        help="with quarantine: the fraction of an epoch's examples that may be quarantined "
        "before the producers fail the run naming them (default 0.01)",
    )
    serve.add_argument(
        "--build-timeout-s",
        type=float,
        default=None,
        help="the longest one batch's build may take; past it the attempt fails naming the "
        "example, the shard goes to another producer, and this one exits (default: none)",
    )

    demo = parser.add_command(
        sub,
        "demo",
        help="run the tutorial experiment: in-process vs served",
        description="Run Fuel's tutorial experiment (N batches per epoch, a loading delay "
        "per batch, a training delay per batch) once in-process and once through "
        "producer processes, and print the times side by side. Without --url it starts "
        "a private redis-server on a free loopback port and stops it at the end.",
    )
    _add_url(demo, "an embedded redis-server on a free loopback port")
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
    demo.add_argument(
        "--json",
        action="store_true",
        help="print the results as one JSON document on stdout (the progress on stderr)",
    )

    status = parser.add_command(
        sub,
        "status",
        help="show every queue (or one): depth vs hwm, producers, stall, verdict",
        description="Show every queue on the server, or the one named: depth (LLEN of "
        "its data list) against its hwm, bytes held, the oldest frame's age, producers "
        "alive and their rates, leases, the trainer's stall and epoch, frames served, "
        "and a verdict: input-bound, trainer-bound or balanced. --json prints the rows "
        "documented in batchq/monitoring/rows.py (schema version "
        f"{STATUS_SCHEMA_VERSION}).",
    )
    _add_url(status)
    status.add_argument(
        "--queue",
        default=None,
        help="only this queue (exit 2, listing the queues there, if no key of it is there)",
    )
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.add_argument(
        "--shm-dir",
        default="/dev/shm",
        help="where this host's segments are counted (shm_segments, shm_bytes; default /dev/shm)",
    )
    _add_monitoring(parser, sub)
    config = parser.add_command(
        sub,
        "config",
        help="print the effective configuration (secrets masked)",
        description="Print every option of every command with its environment variable "
        "(BATCHQ_ plus the option's name: --heartbeat-ttl-s reads BATCHQ_HEARTBEAT_TTL_S), "
        "its effective value and where it came from. Passwords in URLs are masked.",
    )
    config.add_argument("--json", action="store_true", help="machine-readable output")

    dead = parser.add_command(
        sub,
        "dead",
        help="list the examples a run quarantined, with their errors",
        description="List the examples of the queue's run whose read raised and which "
        "were replaced by substitutes (on_sample_error='quarantine'): epoch, index, the "
        "substitute, the error's type and message, the producer. --json adds the "
        "tracebacks.",
    )
    _add_url(dead)
    dead.add_argument(
        "--queue",
        required=True,
        help="the queue to look at (exit 2, listing the queues there, if no key of it is there)",
    )
    dead.add_argument("--json", action="store_true", help="machine-readable output")

    reset = parser.add_command(
        sub,
        "reset",
        help="delete a queue's keys (and only those), after confirmation",
        description="Delete every key of one queue (bq:{Q}:*): its run, frames, leases, "
        "ledger and counters. Producers and trainers of that queue stop or start over. "
        "Asks for the queue's name unless --yes.",
    )
    _add_url(reset)
    reset.add_argument("--queue", required=True, help="the queue to delete")
    reset.add_argument("--yes", action="store_true", help="do not ask")
    reset.add_argument(
        "--shm-dir",
        default="/dev/shm",
        help="also remove the queue's shared-memory segments from this folder (this host)",
    )
    return parser


_COMMANDS = {
    "dead": ("batchq.cli.queues", "run_dead"),
    "demo": ("batchq.cli.demo", "run_demo"),
    "exporter": ("batchq.cli.top", "run_exporter"),
    "report": ("batchq.cli.report", "run_report"),
    "reset": ("batchq.cli.queues", "run_reset"),
    "serve": ("batchq.cli.serve", "run_serve"),
    "status": ("batchq.cli.queues", "run_status"),
    "top": ("batchq.cli.top", "run_top"),
}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``batchq`` command; returns the exit code."""
    parser = build_parser()
    try:
        apply_environment(parser)  # every option: BATCHQ_<OPTION> (batchq/cli/config.py)
    except BatchQueueError as e:
        print(f"batchq: {e}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level,  # one of LOG_LEVELS (_log_level)
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        if args.command == "config":
            return run_config(args, parser)
        # Each command's module is imported only when it runs: `status` needs no numpy.
        module_name, function = _COMMANDS[args.command]
        run = getattr(importlib.import_module(module_name), function)
        return int(run(args))
    except BatchQueueError as e:
        print(f"batchq {args.command}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `batchq config | head`: the reader has gone, not an error
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - Python flushes it at exit
        return 0


if __name__ == "__main__":
    sys.exit(main())
