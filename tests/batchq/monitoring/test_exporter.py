"""The Prometheus exporter: its scrape agrees with Redis; deploy/ refers only to its metrics."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from batchq.cli import main
from batchq.client.connection import make_client
from batchq.monitoring import exporter as exporter_module
from batchq.monitoring.exporter import METRIC_NAMES, BatchqCollector, start_exporter
from batchq.monitoring.rows import WAIT_BUCKETS_S
from batchq.monitoring.verdict import STALL_INPUT_BOUND
from batchq.protocol.fields import ProducerStat
from batchq.protocol.keys import QueueKeys
from batchq.wire.codec import FrameHeader, FrameKind, encode_frame
from producer import Producer

ROOT = Path(__file__).resolve().parents[3]
DEPLOY = ROOT / "deploy"

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> Samples:
    """Exposition text -> {(sample name, sorted labels): value}."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        return parse(reply.read().decode())


def _poll(check: Callable[[], Any], timeout_s: float = 20.0, what: str = "") -> Any:
    deadline = time.monotonic() + timeout_s
    while not (value := check()):
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.02)
    return value


@pytest.fixture
def serving(redis_url: str, queue_name: str) -> Iterator[Producer]:
    """A producer that has filled its queue (hwm 3) and waits for a trainer."""
    from pipelines import numbered

    producer = Producer(numbered(200, 20), redis_url, queue_name, hwm=3)
    thread = threading.Thread(target=producer.serve, daemon=True)
    thread.start()
    client = redis.Redis.from_url(redis_url)
    try:
        _poll(lambda: client.llen(QueueKeys(queue_name).data) == 3, what="a full queue")
        yield producer
    finally:
        client.close()
        producer.stop()
        thread.join(timeout=10)


def _trainer_figures(client: redis.Redis, keys: QueueKeys) -> None:
    """What a trainer's pop script leaves behind: counters, figures, a live claim."""
    sec, usec = client.time()
    now_ms = sec * 1000 + usec // 1000
    client.hset(keys.meta, mapping={"claim": "tok", "claim_deadline": now_ms + 60_000})
    counts = {f"wait_bucket:{i}": i + 1 for i in range(len(WAIT_BUCKETS_S) + 1)}
    client.hset(
        keys.stats,
        mapping={
            **counts, "trainer_wait_ms": 1500, "trainer_busy_ms": 2500, "popped": 7,
            "popped_bytes": 0, "dead:bad_magic": 2, "dead:too_short": 1, "epochs_completed": 1,
            "redone_shards": 4,
        },
    )  # fmt: skip
    client.hset(
        keys.trainer,
        mapping={"stall_fraction_recent": 0.25, "epoch": 1, "updated_ms": now_ms},
    )


def test_the_sizing_figures_are_exported(
    redis_url: str, redis_client: redis.Redis, queue_name: str
) -> None:
    keys = QueueKeys(queue_name)
    sec, usec = redis_client.time()
    now_ms = sec * 1000 + usec // 1000
    redis_client.hset(keys.meta, mapping={"run": "r", "hwm": 8, "claim": "t",
                                          "claim_deadline": now_ms + 60_000})  # fmt: skip
    redis_client.zadd(keys.producers, {"h-1-a": now_ms + 60_000, "h-2-b": now_ms + 60_000})
    pstats = {f"{p}:{k}": v for p in ("h-1-a", "h-2-b") for k, v in
              (("batches", 10), ("produce_ms", 1000))}  # fmt: skip
    redis_client.hset(keys.pstats, mapping=pstats)
    redis_client.hset(keys.trainer, mapping={"stall_fraction_recent": 0.5, "batches_per_s": 20,
                                             "updated_ms": now_ms})  # fmt: skip
    redis_client.hset(keys.stats, mapping={"autoscale_add": 5, "autoscale_retire": 2})
    client = make_client(redis_url)
    server = start_exporter(client, port=0, queues=[queue_name])
    try:
        got = scrape(server.port)
    finally:
        server.close()
        client.close()
    q = (("queue", queue_name),)
    assert got[("batchq_trainer_demand_batches_per_second", q)] == 40.0  # 20 / (1 - 0.5)
    assert got[("batchq_supply_batches_per_second", q)] == 20.0  # 2 producers at 10/s
    assert got[("batchq_producer_rate_batches_per_second", q)] == 10.0
    assert got[("batchq_recommended_producers", q)] == 5  # 4 x 1.05, rounded up
    assert got[("batchq_autoscale_decisions_total", (("action", "add"), *q))] == 5
    assert got[("batchq_autoscale_decisions_total", (("action", "retire"), *q))] == 2


def test_a_scrape_matches_redis(
    redis_url: str, redis_client: redis.Redis, queue_name: str, serving: Producer
) -> None:
    keys = QueueKeys(queue_name)
    _trainer_figures(redis_client, keys)
    client = make_client(redis_url)
    server = start_exporter(client, port=0, queues=[queue_name])
    try:
        got = scrape(server.port)
    finally:
        server.close()
        client.close()
    q = (("queue", queue_name),)
    stats = {k.decode(): int(v) for k, v in redis_client.hgetall(keys.stats).items()}
    elements = redis_client.lrange(keys.data, 0, -1)
    assert got[("batchq_up", ())] == 1
    assert got[("batchq_queue_depth_items", q)] == redis_client.llen(keys.data) == 3
    assert got[("batchq_queue_capacity_items", q)] == 3
    assert got[("batchq_queue_depth_bytes", q)] == sum(map(len, elements))
    assert 0 <= got[("batchq_queue_oldest_frame_age_seconds", q)] < 60
    assert got[("batchq_frames_pushed_total", q)] == stats["pushed"] >= 3
    assert got[("batchq_frames_popped_total", q)] == 7
    assert got[("batchq_bytes_pushed_total", q)] == stats["pushed_bytes"]
    assert got[("batchq_producers_alive", q)] == 1
    assert got[("batchq_trainer_attached", q)] == 1
    assert got[("batchq_trainer_stall_ratio", q)] == 0.25
    assert got[("batchq_trainer_epoch", q)] == 1
    assert got[("batchq_trainer_busy_seconds_total", q)] == 2.5
    assert got[("batchq_redone_shards_total", q)] == 4
    assert got[("batchq_dead_frames_total", (("queue", queue_name), ("reason", "bad_magic")))] == 2
    # The histogram: cumulative buckets at WAIT_BUCKETS_S, then +Inf == count.
    bounds = [*map(repr, WAIT_BUCKETS_S), "+Inf"]
    cumulative = [sum(range(1, i + 2)) for i in range(len(bounds))]
    for le, count in zip(bounds, cumulative, strict=True):
        assert got[("batchq_trainer_wait_seconds_bucket", (("le", le), *q))] == count
    assert got[("batchq_trainer_wait_seconds_count", q)] == cumulative[-1]
    assert got[("batchq_trainer_wait_seconds_sum", q)] == 1.5
    (pid,) = [p.decode() for p in redis_client.zrange(keys.producers, 0, -1)]
    pq = (("producer", pid), ("queue", queue_name))
    pstats = {k.decode(): int(v) for k, v in redis_client.hgetall(keys.pstats).items()}
    assert got[("batchq_producer_frames_pushed_total", pq)] == pstats[f"{pid}:batches"]
    assert got[("batchq_producer_bytes_pushed_total", pq)] == pstats[f"{pid}:bytes"]
    assert ("batchq_producer_blocked_seconds_total", pq) in got
    labels = {k for _, labels in got for k, _ in labels}
    assert labels <= {"queue", "producer", "le", "reason", "action"}


def test_a_scrape_says_when_redis_is_unreachable() -> None:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(BatchqCollector(make_client("redis://127.0.0.1:1/0", socket_timeout_s=1)))
    got = parse(generate_latest(registry).decode())
    assert got == {("batchq_up", ()): 0}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _first_line(proc: subprocess.Popen[bytes], timeout_s: float = 30) -> str:
    """The process's first stdout line, read in a thread so that the wait is bounded."""
    lines: list[bytes] = []
    reader = threading.Thread(
        target=lambda: lines.append(proc.stdout.readline() if proc.stdout else b""),
        daemon=True,
    )
    reader.start()
    reader.join(timeout_s)
    if not lines:
        pytest.fail("the exporter printed nothing")
    return lines[0].decode()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_the_command_serves_until_a_signal_and_exits_0(
    redis_url: str,
    redis_client: redis.Redis,
    queue_name: str,
    spawn_proc: Callable[..., subprocess.Popen[bytes]],
    sig: signal.Signals,
) -> None:
    keys = QueueKeys(queue_name)
    redis_client.hset(keys.meta, mapping={"run": "r", "hwm": 5})
    frame = encode_frame(
        FrameHeader(FrameKind.END, run="r", epoch=0, shard=0, k=0, producer="p", count=0)
    )
    redis_client.lpush(keys.data, bytes(frame), bytes(frame))
    port = _free_port() if sig == signal.SIGTERM else 0
    # The stack's exact command (`batchq exporter --port P --url URL`), and one with --queue.
    argv = [sys.executable, "-m", "batchq.cli", "exporter", "--port", str(port)]
    argv += ["--url", redis_url] + ([] if port else ["--queue", queue_name])
    proc = spawn_proc(argv, stdout=subprocess.PIPE)
    line = _first_line(proc)
    match = re.search(r"http://127\.0\.0\.1:(\d+)/metrics", line)
    assert match, line
    got = scrape(int(match[1]))
    assert got[("batchq_queue_depth_items", (("queue", queue_name),))] == 2
    assert got[("batchq_queue_capacity_items", (("queue", queue_name),))] == 5
    proc.send_signal(sig)
    assert proc.wait(timeout=15) == 0


def test_the_command_names_the_extra_when_prometheus_client_is_missing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    monkeypatch.delitem(sys.modules, "batchq.monitoring.exporter", raising=False)
    assert main(["exporter", "--url", "redis://127.0.0.1:1/0", "--port", "0"]) == 2
    assert "pip install 'batchq[exporter]'" in capsys.readouterr().err


def test_the_command_refuses_a_port_it_cannot_use(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["exporter", "--url", "redis://127.0.0.1:1/0", "--port", "70000"]) == 2
    assert "70000" in capsys.readouterr().err


def test_wait_buckets_have_one_definition() -> None:
    from consumer.reader import stats

    assert stats.WAIT_BUCKETS_S is WAIT_BUCKETS_S
    assert list(WAIT_BUCKETS_S) == sorted(WAIT_BUCKETS_S)


def test_the_documented_metrics_are_the_exposed_ones() -> None:
    doc = exporter_module.__doc__ or ""
    documented = re.findall(r"^``(batchq_\w+)``", doc, flags=re.MULTILINE)
    assert [re.sub(r"_total$", "", n) for n in documented] == list(METRIC_NAMES)


# --------------------------------------------------------------------------- deploy/


def _exposed_names(redis_url: str, redis_client: redis.Redis, queue: str) -> set[str]:
    """Every sample name the exporter writes when every family has a sample."""
    keys = QueueKeys(queue)
    _trainer_figures(redis_client, keys)
    # The sizing gauges need a trainer rate and a producer rate (two history samples).
    redis_client.hset(keys.trainer, "batches_per_s", 12.0)
    now = float(redis_client.time()[0])
    redis_client.lpush(
        keys.history,
        *[json.dumps({"t": now - 2 + i, "producers": 1, "built": 10 * i, "build_ms": 900 * i})
          for i in range(2)],
    )  # fmt: skip
    for producer in redis_client.zrange(keys.producers, 0, -1):  # builds under 1 ms
        redis_client.hset(keys.pstats, producer.decode() + ":produce_ms", 50)
        for name, value in zip(ProducerStat.CACHE, (30, 10, 4096, 1500), strict=True):
            redis_client.hset(keys.pstats, f"{producer.decode()}:{name}", value)  # it caches
    registry = CollectorRegistry(auto_describe=False)
    client = make_client(redis_url)
    registry.register(BatchqCollector(client, [queue]))
    text = generate_latest(registry).decode()
    client.close()
    families = {f.name for f in text_string_to_metric_families(text)}
    assert families == set(METRIC_NAMES)  # every family has samples here
    return {name for name, _ in parse(text)}


def _metrics_in(expr: str) -> set[str]:
    return set(re.findall(r"\bbatchq_[a-z_]+\b", expr))


def test_dashboard_and_alerts_use_only_metrics_the_exporter_exposes(
    redis_url: str, redis_client: redis.Redis, queue_name: str, serving: Producer
) -> None:
    exposed = _exposed_names(redis_url, redis_client, queue_name)
    dashboard = json.loads((DEPLOY / "grafana/dashboards/batchq.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs.append(dashboard["templating"]["list"][0]["definition"])
    alerts = yaml.safe_load((DEPLOY / "prometheus/alerts.yml").read_text())
    rules = [r for g in alerts["groups"] for r in g["rules"]]
    exprs += [r["expr"] for r in rules]
    used = set().union(*map(_metrics_in, exprs))
    assert used and used <= exposed, used - exposed
    # Every panel reads the provisioned data source; ids are unique.
    datasources = yaml.safe_load(
        (DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text()
    )
    (ds,) = datasources["datasources"]
    assert all(p["datasource"]["uid"] == ds["uid"] for p in dashboard["panels"])
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    providers = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/batchq.yml").read_text())
    assert providers["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    # The alerts cover the three situations the verdict names, with its thresholds.
    by_name = {r["alert"]: r for r in rules}
    assert {"BatchqInputBound", "BatchqTrainerBound", "BatchqNoProducers"} <= set(by_name)
    assert all(r["labels"]["severity"] and r["annotations"]["summary"] for r in rules)
    assert f">= {STALL_INPUT_BOUND:.2f}" in by_name["BatchqInputBound"]["expr"]
    assert ">= 0.75 *" in by_name["BatchqTrainerBound"]["expr"]
