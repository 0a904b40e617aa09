"""The one-shot commands on the queues of a server: ``batchq status`` (every queue, or
one, as a table with a verdict per queue, or JSON), ``batchq dead`` (the examples a
queue's run quarantined, with their errors) and ``batchq reset`` (a queue's keys
deleted, after confirmation).

Each opens one client, reads (or deletes) and prints. ``dead`` lists what a stream read
with ``on_sample_error='quarantine'`` recorded when it replaced an example whose read
raised by a substitute (producer/quarantine.py, quarantine.lua): oldest epoch first, as
a table (one line per example, the error's last line) or, with --json, every field (the
traceback in full, as recorded).

A queue named by ``--queue`` (``status``, ``dead``) must exist: some key of it is on the
server (:func:`batchq.monitoring.rows.queue_exists`). Otherwise the command says that no
such queue is there and lists those that are, exit 2, rather than show an empty one.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from batchq.client.connection import call, describe_url, make_client, resolve_url
from batchq.monitoring.rows import list_queues, queue_status, require_queue, status_rows
from batchq.monitoring.text import columns, render_table
from batchq.protocol.admin import delete_queue
from batchq.protocol.keys import QueueKeys, check_name
from batchq.protocol.layout import read_quarantine
from batchq.wire.shm import remove_segments

__all__ = ["run_dead", "run_reset", "run_status"]

_MESSAGE_CHARS = 70  # of an error's message in the table


def run_status(args: argparse.Namespace) -> int:
    """Print the status of the queues on the server at ``args.url``.

    Raises:
        ConfigError: ``--queue`` names a queue that does not exist there
            (:func:`batchq.monitoring.rows.require_queue`).
    """
    url = resolve_url(args.url)
    where = describe_url(url)
    client = make_client(url, socket_timeout_s=5.0)
    try:
        if args.queue:
            names = [check_name(args.queue, "queue")]
            call(
                lambda: require_queue(client, names[0], where), f"reading queues at {where}", client
            )
        else:
            names = call(lambda: list_queues(client), f"listing queues at {where}", client)
        rows = call(
            lambda: status_rows(client, names, args.shm_dir), f"reading queues at {where}", client
        )
    finally:
        client.close()
    print(render_table(rows, as_json=args.json))
    return 0


def run_dead(args: argparse.Namespace) -> int:
    """Print the queue's quarantined examples.

    Raises:
        ConfigError: the queue does not exist (:func:`batchq.monitoring.rows.require_queue`).
    """
    queue = check_name(args.queue, "queue")
    url = resolve_url(args.url)
    keys = QueueKeys(queue)
    where = describe_url(url)
    client = make_client(url, key=keys.meta, socket_timeout_s=10.0)
    try:
        call(lambda: require_queue(client, queue, where), f"reading {queue} at {where}", client)
        found = call(lambda: read_quarantine(client, keys), f"reading {queue} at {where}", client)
    finally:
        client.close()
    if args.json:
        out = {"queue": queue, "run": found.run, "count": found.count, "examples": found.records}
        print(json.dumps(out, indent=2))
        return 0
    print(
        f"queue {queue}: {found.count} example(s) quarantined in run {found.run or '-'}"
        + (f" ({len(found.records)} recorded)" if len(found.records) < found.count else "")
    )
    if found.records:
        header = ("epoch", "index", "substitute", "error", "message", "producer")
        print("\n".join(columns([header, *(_dead_line(r) for r in found.records)])))
    return 0


def _dead_line(record: dict[str, Any]) -> tuple[str, ...]:
    """One quarantined example as a line of the table (the message's first words)."""
    return (
        str(record["epoch"]),
        str(record["index"]),
        "-" if record["substitute"] < 0 else str(record["substitute"]),
        record["error_type"],
        " ".join(record["message"].split())[:_MESSAGE_CHARS],
        record["producer"],
    )


def run_reset(args: argparse.Namespace) -> int:
    """Show what would go, ask (unless --yes), delete; 1 if the user declined."""
    queue = check_name(args.queue, "queue")
    url = resolve_url(args.url)
    client = make_client(url, key=QueueKeys(queue).meta, socket_timeout_s=10.0)
    try:
        row = queue_status(client, queue)
        # A striped queue is its stripes: each deleted on its own node.
        names = [queue, *(s["queue"] for s in row["stripes"][1:])]
        print(
            f"queue {queue!r} at {describe_url(url)}: {row['depth']} frames queued, "
            f"{row['producers_alive']} producers alive, trainer {row['trainer']}; "
            f"every key matching {', '.join(QueueKeys(n).pattern for n in names)} will be "
            "deleted"
        )
        if not args.yes and not _confirmed(queue):
            return 1
        deleted = sum(_delete(url, name) for name in names)
        print(f"deleted {deleted} keys of queue {queue!r}")
        removed = sum(remove_segments(args.shm_dir, name) for name in names)
        print(f"removed {removed} shared-memory segments of queue {queue!r} from {args.shm_dir}")
    finally:
        client.close()
    return 0


def _confirmed(queue: str) -> bool:
    """Whether the user typed the queue's name (never without a terminal)."""
    if not sys.stdin.isatty():
        print("not a terminal: pass --yes to confirm", file=sys.stderr)
        return False
    answer = input(f"type the queue's name ({queue}) to confirm: ").strip()
    if answer != queue:
        print("not confirmed; nothing deleted")
        return False
    return True


def _delete(url: str, queue: str) -> int:
    """Delete one queue's keys (a stripe's, on its own node)."""
    client = make_client(url, key=QueueKeys(queue).meta, socket_timeout_s=10.0)
    try:
        return delete_queue(client, queue)
    finally:
        client.close()
