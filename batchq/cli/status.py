"""``batchq status``: every queue (or one) as a table with a verdict per queue, or JSON."""

from __future__ import annotations

import argparse

from batchq.client.connection import call, describe_url, make_client, resolve_url
from batchq.monitoring.rows import list_queues, status_rows
from batchq.monitoring.text import render_table
from batchq.protocol.keys import check_name

__all__ = ["run_status"]


def run_status(args: argparse.Namespace) -> int:
    """Print the status of the queues on the server at ``args.url``."""
    url = resolve_url(args.url)
    client = make_client(url, socket_timeout_s=5.0)
    try:
        if args.queue:
            names = [check_name(args.queue, "queue")]
        else:
            names = call(lambda: list_queues(client), f"listing queues at {describe_url(url)}")
        rows = call(
            lambda: status_rows(client, names, args.shm_dir),
            f"reading queues at {describe_url(url)}",
        )
    finally:
        client.close()
    print(render_table(rows, as_json=args.json))
    return 0
