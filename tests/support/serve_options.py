"""A producer process serving ``MODULE:FACTORY()`` through ``start_server`` with options
``batchq serve`` has no flags for (build_timeout_s, max_attempts); its exit code is 3
when serving raised a BatchQueueError (the message on stderr)."""

from __future__ import annotations

import argparse
import importlib
import sys

from batchq.errors import BatchQueueError
from producer import start_server


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("factory")
    parser.add_argument("--url", required=True)
    parser.add_argument("--queue", required=True)
    parser.add_argument("--hwm", type=int, default=4)
    parser.add_argument("--build-timeout-s", type=float)
    parser.add_argument("--max-attempts", type=int, default=3)
    args = parser.parse_args()
    module, name = args.factory.split(":")
    stream = getattr(importlib.import_module(module), name)()
    try:
        return start_server(
            stream, args.hwm, url=args.url, queue=args.queue,
            build_timeout_s=args.build_timeout_s, max_attempts=args.max_attempts,
        )  # fmt: skip
    except BatchQueueError as e:
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
