"""``batchq status``: every queue (or one) as a table or JSON."""

from __future__ import annotations

import argparse
from typing import Any

from batchq.connection import call, describe_url, make_client, resolve_url
from batchq.keys import check_name
from batchq.monitor import list_queues, queue_status, render_table

__all__ = ["run_status"]


def _row(client: Any, queue: str) -> dict[str, Any]:
    return call(lambda: queue_status(client, queue), f"reading queue {queue}")


def run_status(args: argparse.Namespace) -> int:
    """Print the status of the queues on the server at ``args.url``."""
    url = resolve_url(args.url)
    client = make_client(url, socket_timeout_s=5.0)
    try:
        if args.queue:
            names = [check_name(args.queue, "queue")]
        else:
            names = call(lambda: list_queues(client), f"listing queues at {describe_url(url)}")
        rows = [_row(client, n) for n in names]
    finally:
        client.close()
    print(render_table(rows, as_json=args.json))
    return 0
