"""``batchq reset --queue Q``: delete a queue's keys, after confirmation."""

from __future__ import annotations

import argparse
import sys

from batchq.client.connection import describe_url, make_client, resolve_url
from batchq.monitoring.rows import queue_status
from batchq.protocol.admin import delete_queue
from batchq.protocol.keys import QueueKeys, check_name
from batchq.wire.shm import remove_segments

__all__ = ["run_reset"]


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
        if not args.yes:
            if not sys.stdin.isatty():
                print("not a terminal: pass --yes to confirm", file=sys.stderr)
                return 1
            answer = input(f"type the queue's name ({queue}) to confirm: ").strip()
            if answer != queue:
                print("not confirmed; nothing deleted")
                return 1
        deleted = sum(_delete(url, name) for name in names)
        print(f"deleted {deleted} keys of queue {queue!r}")
        removed = sum(remove_segments(args.shm_dir, name) for name in names)
        print(f"removed {removed} shared-memory segments of queue {queue!r} from {args.shm_dir}")
    finally:
        client.close()
    return 0


def _delete(url: str, queue: str) -> int:
    """Delete one queue's keys (a stripe's, on its own node)."""
    client = make_client(url, key=QueueKeys(queue).meta, socket_timeout_s=10.0)
    try:
        return delete_queue(client, queue)
    finally:
        client.close()
