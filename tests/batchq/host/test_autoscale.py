"""The autoscaler: its policy (pure), a simulated pool, and `serve --workers auto` live."""

from __future__ import annotations

import itertools
import json
import math
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from sleepy import SleepyTrainer
from waiting import wait_until

from batchq.cli import main
from batchq.errors import ConfigError
from batchq.host.autoscale import AUTO_MAX_WORKERS, Figures, ScalePolicy, ScaleState, decide
from batchq.monitoring.rows import queue_status
from batchq.monitoring.text import render_table
from batchq.protocol.keys import QueueKeys

# --------------------------------------------------------------------------- parsing


def test_workers_spec_is_n_min_max_or_auto() -> None:
    assert ScalePolicy.parse("3") == ScalePolicy(3, 3, auto=False)
    assert ScalePolicy.parse(2) == ScalePolicy(2, 2, auto=False)
    assert ScalePolicy.parse("2:16") == ScalePolicy(2, 16)
    assert ScalePolicy.parse("auto") == ScalePolicy(1, AUTO_MAX_WORKERS)
    for bad in ("0", "x", "3:2", "0:4", ":4", "1:", "auto:3", "-1"):
        with pytest.raises(ConfigError, match=r"--workers .* is not valid: expected N, MIN:MAX"):
            ScalePolicy.parse(bad)


def test_a_bad_workers_option_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "pipelines:numbered", "--workers", "4:2"]) == 2
    assert "--workers '4:2' is not valid" in capsys.readouterr().err


# --------------------------------------------------------------------------- the policy

P = ScalePolicy(1, 8)


def _f(verdict: str, alive: int, local: int | None = None, **kw: Any) -> Figures:
    return Figures(verdict=verdict, alive=alive, local=alive if local is None else local, **kw)


def test_bounds_come_first_and_a_fixed_pool_holds() -> None:
    s = ScaleState()
    assert decide(P, s, _f("trainer-bound", 0, recommended=1), 0).action == "add"
    assert decide(ScalePolicy(2, 4), s, _f("idle", 1, recommended=None), 0).count == 1
    got = decide(ScalePolicy(1, 4), s, _f("input-bound", 6, recommended=9), 0)
    assert (got.action, got.count) == ("retire", 2)
    assert (
        decide(ScalePolicy(3, 3, auto=False), s, _f("input-bound", 3, recommended=9), 0).action
        == "hold"
    )


def test_input_bound_adds_the_share_of_the_deficit() -> None:
    s = ScaleState()
    got = decide(P, s, _f("input-bound", 1, recommended=5), 0)
    assert (got.action, got.count) == ("add", 4) and "recommended 5" in got.reason
    # Two hosts share the queue: this one adds half (rounded up).
    assert decide(P, s, _f("input-bound", 2, 1, recommended=7, scalers=2), 0).count == 3
    # The estimate says enough but the trainer waits: one more.
    assert decide(P, s, _f("input-bound", 4, recommended=4), 0).count == 1
    # Never above the maximum.
    assert decide(P, s, _f("input-bound", 6, recommended=30), 0).count == 2
    assert decide(P, s, _f("input-bound", 8, recommended=30), 0).action == "hold"


def test_adding_needs_cpu_that_helps() -> None:
    s = ScaleState()
    starved = decide(P, s, _f("input-bound", 2, recommended=5, cause="cpu-starved"), 0)
    assert starved.action == "hold" and "CPU-starved" in starved.reason
    busy = _f("input-bound", 2, recommended=5, idle_cores=0.0, worker_cores=1.0)
    assert decide(P, s, busy, 0).action == "hold"
    some = _f("input-bound", 2, recommended=5, idle_cores=2.2, worker_cores=1.0)
    assert decide(P, s, some, 0).count == 2  # what fits in the idle CPU
    sleepers = _f("input-bound", 2, recommended=5, idle_cores=0.0, worker_cores=0.02)
    assert decide(P, s, sleepers, 0).count == 3  # workers that sleep cost next to nothing
    # A full queue: the trainer's waits are in the past (its window is 100 batches).
    past = decide(P, s, _f("input-bound", 2, recommended=5, full=True), 0)
    assert past.action == "hold" and "queue is full" in past.reason
    pending = decide(P, s, _f("input-bound", 2, recommended=5, pending=1), 0)
    assert pending.action == "hold" and "to join" in pending.reason


def test_trainer_bound_retires_only_beyond_the_spare() -> None:
    s = ScaleState()
    assert decide(P, s, _f("trainer-bound", 3, recommended=2), 0).action == "hold"
    got = decide(P, s, _f("trainer-bound", 6, recommended=2), 0)
    assert (got.action, got.count) == ("retire", 3)  # down to recommended + spare
    assert decide(P, s, _f("trainer-bound", 6, 2, recommended=2, scalers=3), 0).count == 1
    assert decide(ScalePolicy(4, 8), s, _f("trainer-bound", 4, recommended=1), 0).action == "hold"
    assert decide(P, s, _f("balanced", 6, recommended=2), 0).action == "hold"
    assert decide(P, s, _f("trainer-bound", 6, recommended=None), 0).action == "hold"


def test_cooldown_and_at_most_one_reversal_a_minute() -> None:
    s = ScaleState()
    up = decide(P, s, _f("input-bound", 1, recommended=4), 0)
    s.record(up, 0)
    assert decide(P, s, _f("input-bound", 4, recommended=6), 3).reason.startswith("cooling")
    down = decide(P, s, _f("trainer-bound", 6, recommended=2), 10)
    assert down.action == "retire"  # the first reversal
    s.record(down, 10)
    assert s.reversals == 1
    held = decide(P, s, _f("input-bound", 3, recommended=6), 30)
    assert held.action == "hold" and "reversal" in held.reason
    assert decide(P, s, _f("input-bound", 3, recommended=6), 71).action == "add"
    # The same direction again is no reversal.
    again = decide(P, s, _f("trainer-bound", 6, recommended=1), 80)
    s.record(again, 80)
    assert again.action == "retire" and s.reversals == 1


def _simulate(
    need_of: Callable[[float], float], seconds: int, seed: int, scalers: int = 1
) -> tuple[list[list[int]], list[tuple[float, int]]]:
    """A model of the pool: workers join 2 s after their start, figures are noisy."""
    rng = random.Random(seed)
    rate = 10.0
    policies = [ScalePolicy(1, 16) for _ in range(scalers)]
    states = [ScaleState() for _ in range(scalers)]
    started: list[list[float]] = [[] for _ in range(scalers)]
    sizes, changes = [], []
    lease_until = -1.0
    for t in range(seconds):
        joined = sum(1 for s in started for at in s if t - at >= 2)
        need = need_of(t)
        ratio = need / joined if joined else math.inf
        verdict = "input-bound" if ratio > 1.02 else "trainer-bound" if ratio < 0.9 else "balanced"
        measured_rate = rate * rng.uniform(0.9, 1.1)
        recommended = max(1, math.ceil(round(need * rate / measured_rate * 1.05, 6)))
        for i in range(scalers):
            f = Figures(
                verdict=verdict,
                alive=sum(len(s) for s in started),  # joined + pending
                local=len(started[i]),
                recommended=recommended if joined else None,
                scalers=scalers,
            )
            d = decide(policies[i], states[i], f, t)
            bounds = f.local < 1
            if d.action != "hold" and not bounds:
                if t < lease_until:
                    continue
                lease_until = t + 5
            if d.action == "add":
                started[i] += [t] * d.count
            elif d.action == "retire":
                del started[i][-d.count :]
            if d.action != "hold":
                states[i].record(d, t)
                changes.append((t, d.direction))
        sizes.append([len(s) for s in started])
    return sizes, changes


def _reversals(changes: list[tuple[float, int]]) -> list[float]:
    out, last = [], 0
    for t, direction in changes:
        if last and direction != last:
            out.append(t)
        last = direction
    return out


@pytest.mark.parametrize("scalers", [1, 2, 3])
@pytest.mark.parametrize("seed", range(5))
def test_a_simulated_pool_converges_shrinks_and_does_not_oscillate(seed: int, scalers: int) -> None:
    sizes, changes = _simulate(lambda t: 4.0 if t < 100 else 1.5, 240, seed, scalers)
    totals = [sum(s) for s in sizes]
    assert 4 <= totals[30] <= 6, totals[:31]  # converged within 30 s, without overshoot
    assert max(totals[:100]) <= 6  # several hosts never overshoot the recommendation
    assert 2 <= totals[-1] <= 3, totals[100:]  # shrunk to within the spare of the need
    reversals = _reversals(changes)
    assert all(b - a >= 60 for a, b in itertools.pairwise(reversals)), changes


# --------------------------------------------------------------------------- live


@pytest.mark.timeout(300)
def test_serve_workers_auto_converges_then_shrinks_when_the_trainer_slows(
    redis_url: str,
    redis_client: Any,
    queue_name: str,
    spawn_proc: Callable[..., Any],
    serve_argv: Callable[..., list[str]],
    serve_env: Callable[..., dict[str, str]],
    tmp_path: Path,
) -> None:
    # Producers build 10 batches/s (a 100 ms sleep), the trainer works 25 ms a batch: it
    # needs 4 producers (the recommendation, with its margin, says 5).
    env = serve_env(examples=20000, batch_size=10, slow_ms=100)
    argv = serve_argv("--workers", "auto", "--hwm", "8")
    argv[argv.index("WARNING")] = "INFO"  # the decisions, in the log
    serve_log = tmp_path / "serve.log"
    with serve_log.open("wb") as err:
        serve = spawn_proc(argv, env=env, stderr=err)
    keys = QueueKeys(queue_name)
    with SleepyTrainer(redis_url, queue_name, busy_s=0.025) as trainer:

        def converged() -> Any:
            assert serve.poll() is None and trainer.error is None
            slowdown = trainer.slowdown()
            row = queue_status(redis_client, queue_name)
            return slowdown is not None and slowdown <= 1.1 and row["producers_alive"] >= 4 and row

        # The bound is 30 s; a loaded 2-core machine may start processes slowly.
        row = wait_until(converged, 120, "a pool that keeps the trainer within 1.1x")
        grown = row["producers_alive"]
        assert 4 <= grown <= 6, row
        # status shows the autoscaler and its last decision.
        assert row["autoscalers"] == 1 and row["autoscale_added"] >= grown
        assert row["autoscale_last"]["action"] == "add"
        assert "autoscale: 1 autoscaler(s)" in render_table([row])
        # The trainer slows down to 150 ms a batch: one producer is enough; the pool keeps
        # one spare beyond the recommendation and retires the rest.
        trainer.busy_s = 0.15
        slowed_at = time.time()
        wait_until(
            lambda: (
                queue_status(redis_client, queue_name)["producers_alive"] <= 3
                and b'"retire"' in (redis_client.lindex(keys.scalelog, 0) or b"")
            ),
            120,
            "the pool to shrink",
        )
        assert trainer.error is None and serve.poll() is None
    log = [json.loads(e) for e in redis_client.lrange(keys.scalelog, 0, -1)][::-1]
    actions = [e["action"] for e in log]
    assert "add" in actions and actions[-1] == "retire", json.dumps(log, indent=1)
    for e in log:  # every decision carries its figures
        assert e["reason"] and e["figures"]["verdict"] and e["figures"]["local"] >= 0, e
    # The bound: the pool reached the size that converged within 30 s of its start
    # (decision times: the wait above also covers starting processes on a loaded machine).
    grew = [e for e in log if e["action"] == "add" and e["t"] < slowed_at]
    assert grew[-1]["t"] - log[0]["t"] <= 30, log
    changes = [(e["t"], 1 if e["action"] == "add" else -1) for e in log]
    reversals = _reversals(changes)
    assert all(b - a >= 60 for a, b in itertools.pairwise(reversals)), log
    decisions = [line for line in serve_log.read_text().splitlines() if "autoscaler " in line]
    assert len(decisions) == len(log) and all("figures {" in line for line in decisions)
    stats = redis_client.hgetall(keys.stats)
    assert int(stats[b"autoscale_add"]) == sum(e["count"] for e in log if e["action"] == "add")
    assert int(stats[b"autoscale_retire"]) >= 1


@pytest.mark.timeout(300)
def test_two_autoscaled_hosts_share_the_deficit_without_overshooting(
    redis_url: str,
    redis_client: Any,
    queue_name: str,
    spawn_proc: Callable[..., Any],
    serve_argv: Callable[..., list[str]],
    serve_env: Callable[..., dict[str, str]],
) -> None:
    # The same need as above (4 producers, 5 recommended), served by two autoscalers.
    env = serve_env(examples=20000, batch_size=10, slow_ms=100)
    serves = [spawn_proc(serve_argv("--workers", "auto", "--hwm", "8"), env=env) for _ in "ab"]
    keys = QueueKeys(queue_name)
    seen: list[int] = []
    with SleepyTrainer(redis_url, queue_name, busy_s=0.025) as trainer:

        def converged() -> Any:
            assert all(s.poll() is None for s in serves) and trainer.error is None
            row = queue_status(redis_client, queue_name)
            seen.append(row["producers_alive"])
            slowdown = trainer.slowdown()
            return slowdown is not None and slowdown <= 1.1 and row["producers_alive"] >= 4 and row

        row = wait_until(converged, 120, "two pools that keep the trainer within 1.1x")
        assert redis_client.zcard(keys.scalers) == 2 and row["autoscalers"] == 2
    log = [json.loads(e) for e in redis_client.lrange(keys.scalelog, 0, -1)]
    scalers = {e["scaler"] for e in log}
    assert len(scalers) == 2, log  # both took part (each started its minimum, at least)
    # Never more than the recommendation and its spare, together.
    assert max(seen) <= row["recommended_producers"] + 1, (seen, log)
