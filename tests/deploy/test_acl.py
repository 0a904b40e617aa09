"""The ACL roles of deploy/acl.conf on a real redis-server of this module's own.

deploy/acl.conf is the one place the rules live: docs/deploy.md quotes it (checked
here), this module loads it as the server's ACL file, enables the three users with
passwords and runs a real producer, a real trainer and ``batchq status`` as them over
``redis://user:pass@host``. Each role does its job; none may FLUSHALL, CONFIG, reach
another queue's keys, or escape its rules through a Lua script.
"""

from __future__ import annotations

import json
import re
import sys
import threading
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from lua_text import reachable
from pipelines import examples_of, numbered
from waiting import wait_until

from batchq.cli import main as batchq_main
from batchq.client.connection import client_name, make_client, name_client
from batchq.host.embedded import EmbeddedRedis
from batchq.protocol.admin import delete_queue
from batchq.protocol.keys import QueueKeys
from consumer import ServerDataStream
from consumer import plan as plan_module
from producer import Producer

pytestmark = pytest.mark.timeout(90)

ROOT = Path(__file__).resolve().parents[2]
ACL_FILE = ROOT / "deploy" / "acl.conf"
DOCS = ROOT / "docs" / "deploy.md"
LUA_DIR = ROOT / "batchq" / "protocol" / "lua"
QUEUE = "tutorial"  # the queue deploy/acl.conf is written for
OTHER = "other"  # a queue the roles of QUEUE must not reach
SECRET = "app:secret"  # a key of some other application on the same server

# Which Lua scripts each role runs (producer/server.py, consumer/, batchq/protocol/reaper.py).
# Every redis.call in them runs as the calling user, so the role needs those commands.
ROLE_SCRIPTS = {
    "bq-producer": {
        "join",
        "lease",
        "push",
        "handback",
        "reap",
        "quarantine",
    },
    "bq-trainer": {
        "claim",
        "detach",
        "params",
        "pop",
        "reap",
        "requeue",
        "resume",
        "release",
    },
    "bq-monitor": set(),
}
PASSWORDS = {name: f"{name}-pw-{i}" for i, name in enumerate(ROLE_SCRIPTS)}


def acl_lines() -> dict[str, str]:
    """The ``user`` lines of deploy/acl.conf, by user name."""
    lines = {}
    for line in ACL_FILE.read_text().splitlines():
        if line.startswith("user "):
            lines[line.split()[1]] = line
    return lines


def rules_for_queue(line: str, queue: str) -> list[str]:
    """A user line's rules with the queue replaced, as the docs tell people to do."""
    return line.replace("{" + QUEUE + "}", "{" + queue + "}").split()[2:]


def url_of(server: EmbeddedRedis, user: str, password: str | None = None) -> str:
    return f"redis://{user}:{password or PASSWORDS[user]}@127.0.0.1:{server.port}/0"


@pytest.fixture(scope="module")
def acl_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    """A redis-server whose users are deploy/acl.conf's, plus an unrestricted default
    user for the test's own setup; each role user enabled with a password."""
    workdir = tmp_path_factory.mktemp("acl-redis")
    users = workdir / "users.acl"
    users.write_text(
        "user default on nopass ~* &* +@all\n"
        + "".join(line + "\n" for line in acl_lines().values())
    )
    with EmbeddedRedis(extra_args=["--aclfile", str(users)], workdir=str(workdir)) as server:
        admin = redis.Redis.from_url(server.url)
        try:
            for name, password in PASSWORDS.items():
                admin.execute_command("ACL", "SETUSER", name, "on", f">{password}")
            admin.hset(QueueKeys(OTHER).meta, mapping={"run": "someone-else"})
            admin.rpush(QueueKeys(OTHER).data, b"their frame")
            admin.set(SECRET, b"not batchq's")
        finally:
            admin.close()
        yield server


@pytest.fixture
def admin(acl_server: EmbeddedRedis) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(acl_server.url)
    try:
        yield client
    finally:
        client.close()


def client_as(server: EmbeddedRedis, user: str) -> redis.Redis:
    return redis.Redis.from_url(url_of(server, user))


# -- the rules themselves ----------------------------------------------------------------


def test_the_docs_quote_the_acl_file() -> None:
    docs = DOCS.read_text()
    assert set(acl_lines()) == set(ROLE_SCRIPTS)
    for name, line in acl_lines().items():
        assert line in docs, f"docs/deploy.md does not quote deploy/acl.conf's {name} line"


def test_each_role_allows_every_command_its_lua_scripts_call() -> None:
    scripts = {p.stem for p in LUA_DIR.glob("*.lua")}
    # A new script must be given to the roles that run it (update ROLE_SCRIPTS).
    assert set().union(*ROLE_SCRIPTS.values()) == scripts
    for name, line in acl_lines().items():
        allowed = {rule[1:] for rule in line.split() if rule.startswith("+")}
        for script in sorted(ROLE_SCRIPTS[name]):
            # Its own text and the lib/*.lua functions it calls: what it can run.
            source = reachable(script)
            called = {c.lower() for c in re.findall(r"redis\.p?call\(\s*'(\w+)'", source)}
            assert called, f"no redis.call found in {script}.lua"
            missing = called - allowed
            assert not missing, f"{name} runs {script}.lua, which calls {sorted(missing)}"
        if ROLE_SCRIPTS[name]:
            assert {"evalsha", "script|load"} <= allowed
        assert not {"eval", "flushall", "flushdb", "config", "keys"} & allowed


# -- each role does its job ----------------------------------------------------------------


def _read_epochs(url: str, queue: str, epochs: int, **options: Any) -> list[list[int]]:
    """Read ``epochs`` epochs as a trainer (bad frames skipped); finish the run."""
    served = []
    with ServerDataStream(
        ("features", "targets"),
        url=url,
        queue=queue,
        timeout_s=30,
        on_bad_frame="skip",
        **options,
    ) as stream:
        for _ in range(epochs):
            served.append(sorted(x for f, _ in stream.get_epoch_iterator() for x in examples_of(f)))
        stream.close(finished=True)
    return served


def test_producer_trainer_and_monitor_do_their_jobs_as_their_users(
    acl_server: EmbeddedRedis,
    admin: redis.Redis,
    spawn_proc: Callable[..., Any],
    serve_env: Callable[..., dict[str, str]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    keys = QueueKeys(QUEUE)
    # A real producer process (`batchq serve`), frames inline in the list.
    argv = [sys.executable, "-m", "batchq.cli", "--log-level", "WARNING", "serve"]
    argv += ["pipelines:numbered", "--url", url_of(acl_server, "bq-producer")]
    argv += ["--queue", QUEUE, "--hwm", "4"]
    proc = spawn_proc(argv, env=serve_env())
    wait_until(lambda: admin.hget(keys.meta, "run"), timeout_s=30, what="the producer to join")
    admin.rpush(
        keys.data, b"garbage that is no frame"
    )  # popped first: the trainer files it as dead

    served = _read_epochs(url_of(acl_server, "bq-trainer"), QUEUE, 2)
    assert served == [list(range(200))] * 2
    assert proc.wait(timeout=30) == 0  # the finished run lets it exit 0
    assert admin.llen(keys.dead) == 1  # the trainer could write the dead list
    assert admin.hget(keys.stats, "dead:bad_magic") == b"1"

    monitor_url = url_of(acl_server, "bq-monitor")
    assert batchq_main(["status", "--url", monitor_url, "--json"]) == 0
    rows = {row["queue"]: row for row in json.loads(capsys.readouterr().out)}
    assert rows[QUEUE]["trainer"] == "finished"
    assert rows[QUEUE]["popped"] >= 20
    assert rows[QUEUE]["dead"] == 1

    # The exporter reads as the monitor too (batchq_up is 0 when a read is refused).
    exporter = pytest.importorskip("batchq.monitoring.exporter")
    client = make_client(monitor_url)
    server = exporter.start_exporter(client, port=0)
    try:
        url = f"http://127.0.0.1:{server.port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            metrics = response.read().decode()
    finally:
        server.close()
        client.close()
    assert re.search(r"^batchq_up 1\.0$", metrics, re.M), metrics
    assert re.search(r'^batchq_frames_popped_total\{queue="tutorial"\} [1-9]', metrics, re.M)


def test_frames_stored_by_reference_work_for_the_roles_of_another_queue(
    acl_server: EmbeddedRedis, admin: redis.Redis
) -> None:
    # The docs' recipe for another queue: the same lines with {tutorial} replaced. Every
    # frame travels by reference here (SET + a name in the list; the trainer checks its
    # size with STRLEN, then fetches it with GETDEL).
    queue = "big"
    for name, line in acl_lines().items():
        rules = rules_for_queue(line, queue)
        admin.execute_command("ACL", "SETUSER", f"{name}-{queue}", *rules, "on", ">pw")
    url = url_of(acl_server, f"bq-producer-{queue}", "pw")
    producer = Producer(numbered(100, 20), url, queue, 4, inline_max_bytes=1)
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(producer.serve()), daemon=True)
    thread.start()
    try:
        trainer_url = url_of(acl_server, f"bq-trainer-{queue}", "pw")
        served = _read_epochs(trainer_url, queue, 2, max_frame_bytes=1 << 20)
        assert served == [list(range(100))] * 2
        thread.join(timeout=30)
        assert result == [0]
    finally:
        producer.stop()
        thread.join(timeout=10)
    keys = QueueKeys(queue)
    assert int(admin.hget(keys.stats, "pushed") or 0) >= 10
    # The finished trainer deleted the frames stored but never popped (SCAN + DEL).
    assert not list(admin.scan_iter(match=keys.frame_pattern))


# -- and nothing else ------------------------------------------------------------------------


def test_groups_of_a_run_do_their_jobs_as_the_trainer_user(
    acl_server: EmbeddedRedis,
    admin: redis.Redis,
    spawn_proc: Callable[..., Any],
    serve_env: Callable[..., dict[str, str]],
) -> None:
    delete_queue(admin, QUEUE)  # the run the earlier tests finished
    argv = [sys.executable, "-m", "batchq.cli", "--log-level", "WARNING", "serve"]
    argv += ["pipelines:numbered", "--url", url_of(acl_server, "bq-producer")]
    argv += ["--queue", QUEUE, "--hwm", "4", "--transport", "redis"]
    served: dict[str, list[list[int]]] = {}

    def read(group: str) -> None:
        served[group] = _read_epochs(
            url_of(acl_server, "bq-trainer"), QUEUE, 2, group=group, transport="redis"
        )

    readers = [threading.Thread(target=read, args=(g,), daemon=True) for g in ("a", "b")]
    for t in readers:
        t.start()
    wait_until(lambda: admin.hlen(QueueKeys(QUEUE).groups) == 2, what="two groups")
    # Frames of 300 KB: stored once by reference for both, read and released by each.
    proc = spawn_proc(argv, env=serve_env(pad_bytes=300_000))
    for t in readers:
        t.join(timeout=60)
        assert not t.is_alive()
    assert served == {"a": [list(range(200))] * 2, "b": [list(range(200))] * 2}
    assert proc.wait(timeout=30) == 0


def test_len_before_any_producer_is_woken_as_the_trainer_user(
    acl_server: EmbeddedRedis,
    admin: redis.Redis,
    spawn_proc: Callable[..., Any],
    serve_env: Callable[..., dict[str, str]],
) -> None:
    # Lightning asks len() before its first iteration: the wait joins the plan's
    # waiters (SADD, SREM as the trainer) and the producer's join counts them (SCARD).
    delete_queue(admin, QUEUE)
    keys = QueueKeys(QUEUE)
    stream = ServerDataStream(
        ("features", "targets"), url=url_of(acl_server, "bq-trainer"), queue=QUEUE, timeout_s=60
    )
    lengths: list[int] = []
    errors: list[BaseException] = []

    def length() -> None:
        try:
            lengths.append(len(stream))
        except BaseException as e:  # reported by the test
            errors.append(e)

    waiter = threading.Thread(target=length, daemon=True)
    waiter.start()
    wait_until(lambda: admin.scard(keys.planwait) == 1 or errors, what="len() waiting")
    assert not errors, errors
    argv = [sys.executable, "-m", "batchq.cli", "--log-level", "WARNING", "serve"]
    argv += ["pipelines:numbered", "--url", url_of(acl_server, "bq-producer")]
    spawn_proc([*argv, "--queue", QUEUE, "--hwm", "4"], env=serve_env())
    waiter.join(timeout=60)
    assert not waiter.is_alive() and not errors, errors
    assert lengths == [10] and not admin.exists(keys.planwait)
    stream.close()


def test_len_as_a_trainer_user_of_an_older_acl_file_reads_until_the_plan(
    acl_server: EmbeddedRedis,
    admin: redis.Redis,
    spawn_proc: Callable[..., Any],
    serve_env: Callable[..., dict[str, str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A trainer user written from an ACL file before the plan's waiters (no SADD): its
    # len() cannot join the set, and waits by reading every BLOCK_S instead.
    delete_queue(admin, QUEUE)
    rules = acl_lines()["bq-trainer"].split()[2:]  # after "user bq-trainer"
    rules = [r for r in rules if r not in ("+sadd", "+srem")]
    admin.execute_command("ACL", "SETUSER", "old-trainer", *rules, "on", ">old-secret")
    joins: list[bool] = []
    real_join = plan_module._join_waiters
    monkeypatch.setattr(
        plan_module, "_join_waiters", lambda *a: joins.append(real_join(*a)) or joins[-1]
    )
    stream = ServerDataStream(
        ("features", "targets"),
        url=url_of(acl_server, "old-trainer", "old-secret"),
        queue=QUEUE,
        timeout_s=60,
    )
    lengths: list[int] = []
    waiter = threading.Thread(target=lambda: lengths.append(len(stream)), daemon=True)
    waiter.start()
    try:
        wait_until(lambda: joins, what="len() to try the waiters' set")
        assert joins == [False]  # refused: it reads every BLOCK_S instead
        argv = [sys.executable, "-m", "batchq.cli", "--log-level", "WARNING", "serve"]
        argv += ["pipelines:numbered", "--url", url_of(acl_server, "bq-producer")]
        spawn_proc([*argv, "--queue", QUEUE, "--hwm", "4"], env=serve_env())
        waiter.join(timeout=60)
        assert not waiter.is_alive() and lengths == [10]
    finally:
        stream.close()
        admin.execute_command("ACL", "DELUSER", "old-trainer")


@pytest.mark.parametrize("user", sorted(ROLE_SCRIPTS))
def test_no_role_can_flush_configure_or_read_other_applications_keys(
    acl_server: EmbeddedRedis, user: str
) -> None:
    client = client_as(acl_server, user)
    try:
        assert client.ping()
        for command in (["FLUSHALL"], ["FLUSHDB"], ["CONFIG", "GET", "*"], ["KEYS", "*"]):
            with pytest.raises(redis.exceptions.NoPermissionError):
                client.execute_command(*command)
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.get(SECRET)
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.set(SECRET, b"overwritten")
    finally:
        client.close()


@pytest.mark.parametrize("user", ["bq-producer", "bq-trainer"])
def test_producer_and_trainer_cannot_touch_another_queue(
    acl_server: EmbeddedRedis, admin: redis.Redis, user: str
) -> None:
    other = QueueKeys(OTHER)
    client = client_as(acl_server, user)
    try:
        for call in (
            lambda: client.hgetall(other.meta),
            lambda: client.llen(other.data),
            lambda: client.lpush(other.data, b"x"),
            lambda: client.delete(other.meta),
            lambda: client.execute_command("GETDEL", other.frame("r", "p", 1)),
        ):
            with pytest.raises(redis.exceptions.NoPermissionError):
                call()
        # SCRIPT LOAD is no way around the rules: a script runs with its caller's rights.
        read = client.script_load("return redis.call('HGETALL', KEYS[1])")
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.evalsha(read, 1, other.meta)
        sneaky = client.script_load(f"return redis.call('DEL', '{other.data}')")
        with pytest.raises(redis.exceptions.ResponseError, match="can't access"):
            client.evalsha(sneaky, 0)
        flush = client.script_load("return redis.call('FLUSHALL')")
        with pytest.raises(redis.exceptions.ResponseError, match="can't run this command"):
            client.evalsha(flush, 0)
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.eval("return 1", 0)
    finally:
        client.close()
    assert admin.llen(other.data) == 1  # untouched
    assert admin.hget(other.meta, "run") == b"someone-else"


def test_the_monitor_reads_every_queue_and_writes_nothing(
    acl_server: EmbeddedRedis, admin: redis.Redis
) -> None:
    other = QueueKeys(OTHER)
    client = client_as(acl_server, "bq-monitor")
    try:
        assert client.hgetall(other.meta) == {b"run": b"someone-else"}
        assert client.llen(other.data) == 1
        assert client.lindex(other.data, 0) == b"their frame"
        assert "redis_version" in client.info("server")
        for call in (
            lambda: client.hset(other.meta, "run", "mine"),
            lambda: client.lpush(other.data, b"x"),
            lambda: client.rpop(other.data),
            lambda: client.delete(other.meta),
            lambda: client.script_load("return 1"),
            lambda: client.eval("return 1", 0),
        ):
            with pytest.raises(redis.exceptions.NoPermissionError):
                call()
    finally:
        client.close()
    assert admin.llen(other.data) == 1


def test_the_trainer_role_names_its_connections_and_a_role_that_cannot_stays_unnamed(
    acl_server: EmbeddedRedis, admin: redis.Redis
) -> None:
    """The trainer's claim records its connections' name (a restart takes a dead
    trainer's claim at once, issue 39); a server refusing CLIENT SETNAME leaves the
    client unnamed and working, the claim left to its lapse."""
    trainer = make_client(url_of(acl_server, "bq-trainer"), key=QueueKeys(QUEUE).meta)
    monitor = make_client(url_of(acl_server, "bq-monitor"))
    try:
        assert name_client(trainer, "bq-trainer-test-1-abc")
        assert client_name(trainer) == "bq-trainer-test-1-abc"
        assert trainer.ping()
        listed = admin.execute_command("CLIENT", "LIST")
        assert "name=bq-trainer-test-1-abc " in str(listed)
        assert not name_client(monitor, "bq-trainer-test-2-abc")  # no +client|setname
        assert client_name(monitor) == "" and monitor.ping()
    finally:
        trainer.close()
        monitor.close()
