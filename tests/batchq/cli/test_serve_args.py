"""``batchq serve MODULE:FACTORY --arg k=v``: keyword arguments for the factory."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pipelines import examples_of

from batchq.cli import build_parser, main
from batchq.cli.config import apply_environment
from batchq.cli.factory_args import call_factory, parse_args_text
from batchq.errors import ConfigError
from consumer import ServerDataStream


def test_values_are_json_when_they_parse_else_strings() -> None:
    got = parse_args_text("seed=3 lr=0.5 on=true none=null sizes=[1,2] size=large q='\"3\"' e=")
    assert got == {
        "seed": 3,
        "lr": 0.5,
        "on": True,
        "none": None,
        "sizes": [1, 2],
        "size": "large",
        "q": "3",
        "e": "",
    }
    assert parse_args_text('{"seed": 3, "size": "large"}') == {"seed": 3, "size": "large"}
    assert parse_args_text("path='a b=c'") == {"path": "a b=c"}


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("seed", "expected KEY=VALUE"),
        ("=3", "identifier"),
        ("my-seed=3", "identifier"),
        ('{"seed": 3', "JSON object"),
        ("[1, 2]", "KEY=VALUE"),
        ("name='unterminated", "not valid"),
    ],
)
def test_bad_arguments_are_refused_naming_them(text: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        parse_args_text(text)


def parser() -> Any:
    out = build_parser()
    apply_environment(out)
    return out


def test_the_command_line_wins_over_the_environment_key_by_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("BATCHQ_ARGS", "seed=1 size=small")
    args = parser().parse_args(
        ["serve", "m:f", "--arg", "seed=3", "--arg", "extra=[1]", "--arg", "n=2 m=x"]
    )
    assert args.factory_args == {"seed": 3, "size": "small", "extra": [1], "n": 2, "m": "x"}
    monkeypatch.delenv("BATCHQ_ARGS")
    assert parser().parse_args(["serve", "m:f"]).factory_args == {}


def test_config_shows_the_arguments_with_secrets_masked(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("BATCHQ_ARGS", '{"seed": 3, "api_token": "hunter2"}')
    assert main(["config", "--json"]) == 0
    rows = {(r["command"], r["option"]): r for r in json.loads(capsys.readouterr().out)}
    row = rows[("serve", "--args")]
    assert row["variable"] == "BATCHQ_ARGS"
    assert row["value"] == {"seed": 3, "api_token": "***"}
    assert row["source"] == "environment"


def test_a_bad_environment_value_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("BATCHQ_ARGS", "seed")
    assert main(["config"]) == 2
    assert "BATCHQ_ARGS='seed' is not valid" in capsys.readouterr().err


def test_arguments_the_factory_does_not_take_are_refused_by_name() -> None:
    def make(seed: int = 0, *, size: str = "small") -> tuple[int, str]:
        return seed, size

    assert call_factory(make, "m:make", {"seed": 3, "size": "large"}) == (3, "large")
    with pytest.raises(ConfigError) as info:
        call_factory(make, "m:make", {"colour": "red"})
    message = str(info.value)
    assert "'m:make'" in message and "colour" in message and "make(seed:" in message


def _served(url: str, queue: str) -> list[list[int]]:
    with ServerDataStream(("features", "targets"), False, url=url, queue=queue) as stream:
        batches = [examples_of(f) for f, _ in stream.get_epoch_iterator()]
        stream.close(finished=True)
    return batches


def test_serve_passes_the_arguments_to_the_factory(
    redis_url: str, queue_name: str, spawn_proc: Any, serve_argv: Any, serve_env: Any
) -> None:
    argv = serve_argv("--arg", "examples=60", "--arg", "batch_size=20", "--arg", "shuffled=false")
    proc = spawn_proc(argv, env=serve_env())
    assert _served(redis_url, queue_name) == [
        list(range(20)),
        list(range(20, 40)),
        list(range(40, 60)),
    ]
    assert proc.wait(timeout=30) == 0


def test_workers_get_the_arguments_from_the_environment(
    redis_url: str, queue_name: str, spawn_proc: Any, serve_argv: Any, serve_env: Any
) -> None:
    env = serve_env()
    env["BATCHQ_ARGS"] = "examples=40 shuffled=false"
    proc = spawn_proc(serve_argv("--workers", "2", "--arg", "batch_size=10"), env=env)
    assert _served(redis_url, queue_name) == [list(range(i, i + 10)) for i in range(0, 40, 10)]
    assert proc.wait(timeout=30) == 0


def test_serve_with_an_argument_the_factory_lacks_exits_2(
    spawn_proc: Any, serve_argv: Any, serve_env: Any
) -> None:
    proc = spawn_proc(serve_argv("--arg", "colour=red"), env=serve_env(), stderr=-1)
    assert proc.wait(timeout=30) == 2
    err = proc.stderr.read().decode()
    assert "colour" in err and "numbered" in err
