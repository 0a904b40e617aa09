"""``batchq dead --queue Q``: the examples the queue's run quarantined, with their errors.

A stream read with ``on_sample_error='quarantine'`` replaces an example whose read raised
by a substitute and records it (producer/quarantine.py, quarantine.lua): this lists
those records, oldest epoch first, as a table (one line per example, the error's last
line) or, with --json, every field (the traceback in full, as recorded).
"""

from __future__ import annotations

import argparse
import json

from batchq.client.connection import call, describe_url, make_client, resolve_url
from batchq.protocol.keys import QueueKeys, check_name
from batchq.protocol.quarantine_records import read_quarantine

__all__ = ["run_dead"]

_MESSAGE_CHARS = 70  # of an error's message in the table


def run_dead(args: argparse.Namespace) -> int:
    """Print the queue's quarantined examples."""
    queue = check_name(args.queue, "queue")
    url = resolve_url(args.url)
    keys = QueueKeys(queue)
    client = make_client(url, key=keys.meta, socket_timeout_s=10.0)
    try:
        found = call(
            lambda: read_quarantine(client, keys), f"reading {queue} at {describe_url(url)}"
        )
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
    if not found.records:
        return 0
    header = ("epoch", "index", "substitute", "error", "message", "producer")
    lines = [header] + [
        (
            str(r["epoch"]),
            str(r["index"]),
            "-" if r["substitute"] < 0 else str(r["substitute"]),
            r["error_type"],
            " ".join(r["message"].split())[:_MESSAGE_CHARS],
            r["producer"],
        )
        for r in found.records
    ]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    for line in lines:
        print("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip())
    return 0
