"""``batchq exporter``: a Prometheus endpoint for the queues, until SIGTERM/SIGINT (exit 0)."""

from __future__ import annotations

import argparse
import signal
import threading
from typing import Any

from batchq.client.connection import describe_url, make_client, resolve_url
from batchq.errors import ConfigError
from batchq.protocol.keys import check_name

__all__ = ["run_exporter"]

MISSING = "batchq exporter needs prometheus-client: pip install 'batchq[exporter]'"


def run_exporter(args: argparse.Namespace) -> int:
    """Serve ``/metrics`` until SIGTERM or SIGINT; 0 when stopped by either."""
    try:
        from batchq.monitoring.exporter import start_exporter
    except ImportError as e:
        raise ConfigError(f"{MISSING} ({e})") from None
    queues = [check_name(q, "queue") for q in args.queue or []]
    url = resolve_url(args.url)
    client = make_client(url, socket_timeout_s=5.0)
    stop = threading.Event()

    def _stop(_signum: int, _frame: Any) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, _stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server = start_exporter(client, port=args.port, host=args.host, queues=queues)
        try:
            what = ", ".join(queues) if queues else "every queue"
            host = f"[{args.host}]" if ":" in args.host else args.host
            print(
                f"batchq exporter: serving http://{host}:{server.port}/metrics "
                f"({what} at {describe_url(url)})",
                flush=True,
            )
            while not stop.wait(1.0):
                pass
        finally:
            server.close()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        client.close()
    return 0
