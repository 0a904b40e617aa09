"""A mixture served by producer processes (``batchq serve pipelines:mixture``): the
trainer re-weights it from a known batch with set_params; no example of b before that
batch, b's share after it within 4 standard deviations, each source's passes without
repeats; a resume mid-mixture gives, like the uninterrupted run, exactly the batches the
mixture's pure function gives for the run's log (byte for byte)."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import numpy as np
import pytest
from mixing import check_passes
from pipelines import mixture

from batchq.protocol.params_log import ParamsLog
from consumer import ServerDataStream
from producer import control

SIZES = {"a": 30, "b": 20}
BATCH, PER_EPOCH, EPOCHS = 8, 25, 4
CHANGE, STATE_AT = 30, 55  # the weights change at batch 30; the checkpoint after 55


@pytest.mark.timeout(120)
def test_a_mixture_reweighted_mid_run_and_resumed_is_exact(
    redis_url: str, queue_name: str, spawn_proc: Any, serve_argv: Any, serve_env: Any
) -> None:
    env = serve_env(
        a_examples=SIZES["a"], b_examples=SIZES["b"], batch_size=BATCH, batches=PER_EPOCH,
        seed=7, slow_ms=1,
    )  # fmt: skip
    for _ in range(2):
        spawn_proc(serve_argv("--hwm", "4", factory="pipelines:mixture"), env=env)
    got: list[tuple[np.ndarray, np.ndarray]] = []
    first = ServerDataStream(("x", "source"), url=redis_url, queue=queue_name, stall_s=1.0)
    while len(got) < STATE_AT:
        for x, source in first.get_epoch_iterator():
            got.append((x, source))
            if len(got) == 10:
                reweigh = {"weights": {"a": 0.5, "b": 0.5}}
                assert first.set_params(reweigh, at_batch=CHANGE) == CHANGE
            if len(got) == STATE_AT:
                break
    state = first.state_dict()
    first.close()
    second = ServerDataStream(("x", "source"), url=redis_url, queue=queue_name, stall_s=1.0)
    second.load_state_dict(state)
    while second.epoch + 1 < EPOCHS:
        got += list(second.get_epoch_iterator())
    second.close(finished=True)
    assert len(got) == EPOCHS * PER_EPOCH
    # Every batch is the mixture's pure function of (seed, g, the log), byte for byte.
    log = ParamsLog.from_json(state["params"])
    reference = mixture()
    for g, (x, source) in enumerate(got):
        with control.building(log, g):
            want_x, want_source = reference.get_data(g)
        assert x.tobytes() == want_x.tobytes() and source.tobytes() == want_source.tobytes()
    labels = [list(source) for _, source in got]
    assert not any("b" in row for row in labels[:CHANGE])
    after = Counter(s for row in labels[CHANGE:] for s in row)
    n = (len(got) - CHANGE) * BATCH
    assert abs(after["b"] - n / 2) <= 4 * math.sqrt(n / 4)
    for name, size in SIZES.items():
        seq = [[int(v) % 10_000 for v in x[source == name]] for x, source in got]
        check_passes(seq, size)
