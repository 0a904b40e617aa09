"""train.py with a gate between a stripe's claim and its resume (fault injection): a
trainer that takes stripe k > 0 over marks that it got there (``<$TEST_GATE>.<pid>``) and
waits until the file ``$TEST_GATE`` exists before it resumes there, so that a test can
let other trainers claim that stripe in between. Same arguments as train.py."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

from train import main

import consumer.start

GATE_WAIT_S = 60.0  # a gate never opened fails the trainer instead of hanging it
_resume_stripe = consumer.start._resume_stripe


def _gated(*args: Any, **kwargs: Any) -> None:
    gate = Path(os.environ["TEST_GATE"])
    Path(f"{gate}.{os.getpid()}").touch()
    deadline = time.monotonic() + GATE_WAIT_S
    while not gate.exists():  # the test opens it once the others have claimed
        if time.monotonic() > deadline:
            raise TimeoutError(f"the gate {gate} was not opened within {GATE_WAIT_S} s")
        time.sleep(0.01)
    _resume_stripe(*args, **kwargs)


consumer.start._resume_stripe = _gated

if __name__ == "__main__":
    sys.exit(main())
