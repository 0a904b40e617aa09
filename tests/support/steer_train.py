"""A trainer process that steers its producers (``pipelines:steered``): the resume tests
of set_params.

Reads epochs and writes one JSON line per batch to --out, flushed: [step, epoch, a
digest of the batch's bytes (features, targets, params), the params it was built with].
At step 7 (batches yielded) it calls ``set_params({'level': 1}, at_batch=9)``, at step
25 ``set_params({'level': 2, 'aug': 0.5})`` (the default index), each returned index
logged on stderr. With --state-out and --state-at N it saves ``{"step": N, "state":
state_dict()}`` after batch N; with --hold-at N it waits after writing batch N (to be
killed there); with --state-in it resumes from such a file.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import threading
from typing import Any

from consumer import ServerDataStream

CALLS: dict[int, tuple[dict[str, Any], dict[str, Any]]] = {
    7: ({"level": 1}, {"at_batch": 9}),
    25: ({"level": 2, "aug": 0.5}, {}),
}


def digest(features: Any, targets: Any, params: str) -> str:
    """The batch's bytes, hashed: two batches with one digest are byte-identical."""
    return hashlib.sha256(features.tobytes() + targets.tobytes() + params.encode()).hexdigest()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--queue", required=True)
    parser.add_argument("--epochs", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--state-in")
    parser.add_argument("--state-out")
    parser.add_argument("--state-at", type=int)
    parser.add_argument("--hold-at", type=int)
    args = parser.parse_args()
    stream = ServerDataStream(
        ("features", "targets", "params"),
        url=args.url,
        queue=args.queue,
        timeout_s=60,
        stall_s=1.0,
        claim_ttl_s=2.0,
    )
    step = 0
    if args.state_in:
        with open(args.state_in) as f:
            saved = json.load(f)
        stream.load_state_dict(saved["state"])
        step = saved["step"]
    with open(args.out, "a") as out:
        while stream.epoch + 1 < args.epochs:
            for features, targets, params in stream.get_epoch_iterator():
                step += 1
                line = [step, stream.epoch, digest(features, targets, params), params]
                out.write(json.dumps(line) + "\n")
                out.flush()
                if step in CALLS:
                    update, where = CALLS[step]
                    index = stream.set_params(update, **where)
                    print(f"step {step}: index {index}", file=sys.stderr, flush=True)
                if args.state_out and step == args.state_at:
                    tmp = args.state_out + ".tmp"
                    with open(tmp, "w") as f:
                        json.dump({"step": step, "state": stream.state_dict()}, f)
                    os.replace(tmp, args.state_out)
                if step == args.hold_at:
                    threading.Event().wait()  # until killed
    stream.close(finished=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
