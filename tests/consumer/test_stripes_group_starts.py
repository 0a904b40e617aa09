"""Groups starting on a striped queue (issue 38, stripes x groups), against a real
redis-server with trainer and producer processes; every epoch exact:

- a group whose trainer is between its claim of stripe 1 and its resume there (a claim
  that started that stripe's run) while another group claims the stripe: the run claimed
  lives on through the resume (it was replaced, and the other group's ranks died with
  ``RunChanged``);
- a group killed and restarted without a state with another number of ranks, in a run
  that a job's ranks named (stripe 1's run is the one they name alike): claim.lua takes
  its new slot over and marks its ranks done until their resume, which must follow
  (they waited for ever).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
import redis
from data_parallel import (
    BATCH,
    EXAMPLES,
    check_epoch,
    checkpoint_ranks,
    plans,
    rank_argv,
    shares,
    spawn_ranks,
)
from train import lines
from waiting import wait_until

from batchq.protocol.admin import delete_queue
from batchq.protocol.keys import QueueKeys
from batchq.protocol.layout import stripe_run_id

STRIPES = 2
EPOCHS = 3
SUPPORT = Path(__file__).resolve().parents[1] / "support"


def stripe_keys(queue: str) -> list[QueueKeys]:
    """Every stripe's keys (stripe 0: the queue's)."""
    return [QueueKeys(queue).stripe(k, STRIPES) for k in range(STRIPES)]


@pytest.fixture
def striped(redis_client: redis.Redis, queue_name: str) -> Any:
    """Every stripe's keys, the stripes deleted afterwards (``queue_name`` deletes only
    the queue's own)."""
    yield stripe_keys(queue_name)
    for keys in stripe_keys(queue_name):
        delete_queue(redis_client, keys.queue)


def group_job(
    spawn_proc: Any, url: str, queue: str, outs: list[Path], group: str, epochs: int = EPOCHS
) -> list[Any]:
    """The ranks of one group (none: the default group) as trainer processes, each
    finishing its group at the end."""
    named = ["--group", group] if group else []
    return spawn_ranks(spawn_proc, url, queue, outs, epochs, "--finish", *named)


def check_group(outs: list[Path]) -> None:
    """Every epoch of the plan (its first EPOCHS), split among the group's ranks slot by
    slot."""
    for plan, per_rank in zip(plans(EPOCHS), shares(outs, EPOCHS), strict=True):
        check_epoch(plan, per_rank, len(outs))


def claims_lapsed(client: redis.Redis, stripes: list[QueueKeys], group: str) -> bool:
    """Whether every claim field of ``group``'s slot has passed its deadline, in every
    stripe (the server's clock)."""
    sec, usec = client.time()
    now_ms = sec * 1000 + usec // 1000
    for keys in stripes:
        slot = int(client.hget(keys.groups, group) or 0)
        fields = client.hgetall(keys.meta)
        tag = f"claim_deadline@{slot}".encode()
        if any(k.startswith(tag) and int(v) >= now_ms for k, v in fields.items()):
            return False
    return True


@pytest.mark.timeout(120)
def test_a_group_claiming_a_stripe_another_is_starting_keeps_its_run(
    redis_url: str,
    redis_client: redis.Redis,
    queue_name: str,
    striped: list[QueueKeys],
    spawn_proc: Any,
    serve_argv: Any,
    serve_env: Any,
    tmp_path: Path,
) -> None:
    env = serve_env(examples=EXAMPLES, batch_size=BATCH, slow_ms=5)
    serve = serve_argv("--hwm", "4", "--stripes", str(STRIPES), "--heartbeat-ttl-s", "10")
    producers = [spawn_proc(serve, env=env) for _ in range(2)]
    wait_until(lambda: redis_client.hget(striped[1].meta, "run"), what="stripe 1's run")
    # Group a (2 ranks: another world than the producers' run, so its claim starts
    # stripe 1's run) stops between that claim and its resume...
    gate = tmp_path / "gate"
    outs_a = [tmp_path / f"a{r}.jsonl" for r in range(2)]
    job_a = [
        spawn_proc([sys.executable, str(SUPPORT / "gated_train.py"), *argv[2:]], env=env_a)
        for argv, env_a in (
            (rank_argv(redis_url, queue_name, out, EPOCHS, r, 2, "--finish", "--group", "a"),
             {**env, "TEST_GATE": str(gate)})
            for r, out in enumerate(outs_a)
        )
    ]  # fmt: skip
    wait_until(lambda: list(tmp_path.glob("gate.*")), what="a between its claim and resume")
    # ... while group b claims stripe 1's run: then a resumes there.
    outs_b = [tmp_path / f"b{r}.jsonl" for r in range(2)]
    job_b = group_job(spawn_proc, redis_url, queue_name, outs_b, "b")
    wait_until(lambda: redis_client.hget(striped[1].groups, "b"), what="b in stripe 1")
    gate.touch()
    wait_until(lambda: min(len(lines(o)) for o in outs_b) >= 8, what="b reads")
    os.killpg(producers[0].pid, signal.SIGKILL)  # mid-epoch, holding leases in both stripes
    producers[0].wait(timeout=10)
    for proc in job_a + job_b:
        assert proc.wait(timeout=90) == 0
    assert producers[1].wait(timeout=30) == 0  # the run ended in every stripe
    check_group(outs_a)
    check_group(outs_b)


@pytest.mark.timeout(120)
def test_a_group_restarted_with_more_ranks_in_a_run_a_job_named_reads_every_epoch(
    redis_url: str,
    redis_client: redis.Redis,
    queue_name: str,
    striped: list[QueueKeys],
    spawn_proc: Any,
    serve_argv: Any,
    serve_env: Any,
    tmp_path: Path,
) -> None:
    env = serve_env(examples=EXAMPLES, batch_size=BATCH, slow_ms=5)
    serve = serve_argv("--hwm", "4", "--stripes", str(STRIPES), "--heartbeat-ttl-s", "2")
    producers = [spawn_proc(serve, env=env) for _ in range(2)]
    # A job of 2 ranks (the default group), reading on past this test: stripe 1's run
    # becomes the one its ranks name.
    outs_job = [tmp_path / f"job{r}.jsonl" for r in range(2)]
    group_job(spawn_proc, redis_url, queue_name, outs_job, "", epochs=100)

    def named() -> bool:
        runs = [redis_client.hget(keys.meta, "run") for keys in striped]
        return runs[1] == stripe_run_id(runs[0].decode(), 1).encode() if runs[0] else False

    wait_until(named, what="stripe 1's run named by the job")
    # Group c joins with 1 rank, is killed, and comes back with 2 and no state.
    first = group_job(spawn_proc, redis_url, queue_name, [tmp_path / "c.jsonl"], "c")
    wait_until(lambda: len(lines(tmp_path / "c.jsonl")) >= 4, what="c reads")
    os.killpg(first[0].pid, signal.SIGKILL)
    first[0].wait(timeout=10)
    wait_until(lambda: claims_lapsed(redis_client, striped, "c"), what="c's claims lapse")
    outs_c = [tmp_path / f"c{r}.jsonl" for r in range(2)]
    again = group_job(spawn_proc, redis_url, queue_name, outs_c, "c")
    wait_until(lambda: min(len(lines(o)) for o in outs_c) >= 4, what="c reads again")
    os.killpg(producers[0].pid, signal.SIGKILL)  # mid-epoch
    producers[0].wait(timeout=10)
    for proc in again:
        assert proc.wait(timeout=90) == 0
    check_group(outs_c)  # from epoch 0 again, as a group that joins late
    per_rank = len(plans(1)[0]) // 2  # 11 batches a rank an epoch
    wait_until(lambda: min(len(lines(o)) for o in outs_job) >= EPOCHS * per_rank, what="the job")
    check_group(outs_job)


@pytest.mark.timeout(120)
def test_a_groups_ranks_resume_a_checkpoint_on_a_striped_queue_whose_runs_are_gone(
    redis_url: str,
    redis_client: redis.Redis,
    queue_name: str,
    striped: list[QueueKeys],
    spawn_proc: Any,
    serve_argv: Any,
    serve_env: Any,
    tmp_path: Path,
) -> None:
    # Stripe 0's run is replaced by the resume (the checkpoint's is gone), so each
    # stripe's is, by every rank alike: one rank's claim on stripe 1 starts a run there
    # and the other's lands in it; a rank that kept the run it started lost it to the
    # other's resume (RunChanged), and a rank waiting for the plan in the run it claimed
    # found the job's resumed run instead (RunChanged).
    env = serve_env(examples=EXAMPLES, batch_size=BATCH, slow_ms=5)
    serve = serve_argv("--hwm", "4", "--stripes", str(STRIPES), "--heartbeat-ttl-s", "2")
    producers = [spawn_proc(serve, env=env) for _ in range(2)]
    outs, states = checkpoint_ranks(
        spawn_proc, redis_url, queue_name, tmp_path, EPOCHS, 2, 5, "--group", "a"
    )
    saved = tmp_path / "all.json"
    saved.write_text(json.dumps(states))
    for proc in producers:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    for keys in striped:  # Redis lost the queue (or it was reset)
        delete_queue(redis_client, keys.queue)
    producers = [spawn_proc(serve, env=env) for _ in range(2)]
    outs_b = [tmp_path / f"b{r}.jsonl" for r in range(2)]
    second = spawn_ranks(
        spawn_proc, redis_url, queue_name, outs_b, EPOCHS, "--finish", "--group", "a",
        "--state-in", str(saved),
    )  # fmt: skip
    for proc in second:
        assert proc.wait(timeout=90) == 0
    # Epoch 0 is the first job's 5 batches a rank and the resumed rest; then every epoch.
    before, after = shares(outs, EPOCHS), shares(outs_b, EPOCHS)
    check_epoch(plans(1)[0], [a + b for a, b in zip(before[0], after[0], strict=True)], 2)
    for plan, per_rank in zip(plans(EPOCHS)[1:], after[1:], strict=True):
        check_epoch(plan, per_rank, 2)
