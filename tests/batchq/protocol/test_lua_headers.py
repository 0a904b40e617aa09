"""Every Lua script names its KEYS and ARGV at its top, and every typed wrapper of
batchq.protocol's wrappers name exactly what its script's header declares."""

from __future__ import annotations

import re
from typing import Any

import pytest

from batchq.errors import ProtocolError
from batchq.protocol import params_scripts, producer_scripts, recovery_scripts, trainer_scripts
from batchq.protocol.calls import SCRIPTS, Call, build_call, parse_header
from batchq.protocol.keys import QueueKeys
from batchq.protocol.trainer_scripts import ResumeArgs

K = QueueKeys("hdr")
LITERAL_INDEX = re.compile(r"\b(KEYS|ARGV)\[\d+\]")


class Recorder:
    """Stands in for a client, its pool and its connection: records the EVALSHA a
    wrapper sends (calls.round_trip) and replies STATE_LOST."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[Any], list[Any]]] = []
        self.connection_pool = self

    def get_connection(self) -> Recorder:
        return self

    def release(self, connection: Recorder) -> None:
        pass

    def pack_commands(self, commands: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
        return commands

    def send_packed_command(self, commands: list[tuple[Any, ...]]) -> None:
        for name, sha, numkeys, *rest in commands:
            assert name == "EVALSHA"
            self.calls.append((sha, list(rest[:numkeys]), list(rest[numkeys:])))

    def read_response(self) -> list[Any]:
        return [b"STATE_LOST"]


def _sent(run: Any) -> tuple[str, list[Any], list[Any]]:
    client = Recorder()
    run(client)
    (call,) = client.calls
    return call


WRAPPERS: dict[str, Any] = {
    "join": lambda c: producer_scripts.join(
        c, K, producer="p", fingerprint="fp", hwm=3, shards=4, window=2, new_run="r",
        new_incarnation="i", heartbeat_ttl_ms=1, version="1", epoch_batches=None,
        age_ms=0, no_create=False,
    ),
    "lease": lambda c: producer_scripts.lease_call(
        K, incarnation="i", run="r", producer="p", token="t", heartbeat_ttl_ms=1,
        prefetch=1, groups=3, world=2, after="4/6:s",
    ).run(c),
    "push": lambda c: producer_scripts.push_call(
        K, targets=0b101, rank=1, world=2, groups=3, frame_key=K.frame("r", "p", 1),
        incarnation="i", run="r", producer="p", entry="3/5:t", element=b"x", last=True,
        heartbeat_ttl_ms=1, frame_bytes=1, blocked_ms=0, produce_ms=0,
    ).run(c),
    "handback": lambda c: producer_scripts.handback(
        c, K, incarnation="i", run="r", producer="p", entry="3:t"
    ),
    "quarantine": lambda c: producer_scripts.quarantine(
        c, K, incarnation="i", run="r", index=7, record="{}"
    ),
    "reap": lambda c: recovery_scripts.reap(
        c, K, incarnation="i", why="dead", producers=["a", "b"]
    ),
    "requeue": lambda c: recovery_scripts.requeue(
        c, K, incarnation="i", run="r", data=K.data, shards=[1, 2], alive=["a"],
        rank=("next:0", [0, 1]),
    ),
    "claim": lambda c: trainer_scripts.claim(
        c, K, op="acquire", token="t", claim_ttl_ms=1, run_id="r", new_incarnation="i",
        takeover_run="", version="1", group="g", rank=0, world=2, even="pad", resumed="",
        incarnation="", groups=2, key_world=2, max_lag=4, slot=0,
    ),
    "pop": lambda c: trainer_scripts.pop(
        c, K, data=K.data, trainer=K.trainer, history=K.history, incarnation="i", run="r",
        token="t", room=1, floor=0, claim_ttl_ms=1, extra_popped=0, nbytes=0,
        figures=(0, 0, 0, "", "", ""), suffix="",
    ),
    "params": lambda c: params_scripts.params(
        c, K, op="rebuild", incarnation="i", run="r", token="t", suffix=":1", index=2,
        rebuild=[params_scripts.Rebuild("0:3", 1, 3)],
    ),
    "resume": lambda c: trainer_scripts.resume(
        c, K, ResumeArgs(
            token="t", new_run="r", takeover_run="", first=0, fingerprint="fp", hwm="",
            shards=4, window=1, epoch_batches=-1, group="g", rank=0, world=2, even="pad",
            step=0, held=False, slot=1, acquired="r0", claim_ttl_ms=1,
        ),
        groups=2, key_world=2, remap=(0, {1: 0}), ledger=[("0:1", "d")],
    ),
    "release": lambda c: trainer_scripts.release_call(
        K, [K.frame("r", "p", 1), K.frame("r", "p", 2)]
    ).run(c),
    "detach": lambda c: trainer_scripts.detach(
        c, K, incarnation="i", run="r", token="t", position="p", frames=[b"f2", b"f1"],
    ),
}  # fmt: skip


def test_every_script_has_a_wrapper() -> None:
    assert sorted(WRAPPERS) == sorted(SCRIPTS)


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_the_header_names_every_fixed_key_and_argument(name: str) -> None:
    source = SCRIPTS[name].source
    header = SCRIPTS[name].header
    assert header.keys and header.args
    # Below the header, a fixed position is never spelled: only the named locals, or a
    # computed index into a declared tail.
    lines = source.splitlines()
    body = [ln for ln in lines if not ln.startswith("local ") and not ln.startswith("--")]
    code = [ln.split("--")[0] for ln in body]
    literal = [ln for ln in code if LITERAL_INDEX.search(ln)]
    assert literal == []
    if not header.keys_tail:
        assert "KEYS[" not in "\n".join(code)
    if not header.args_tail:
        assert "ARGV[" not in "\n".join(code)


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_the_wrapper_sends_what_the_header_declares(name: str) -> None:
    sha, keys, args = _sent(WRAPPERS[name])
    header = SCRIPTS[name].header
    assert sha == SCRIPTS[name].sha
    assert len(keys) >= len(header.keys) and len(args) >= len(header.args)
    assert all(k.startswith("bq:{hdr}:") for k in keys)  # one hash tag: Cluster-safe
    if not header.keys_tail:
        assert len(keys) == len(header.keys)
    if not header.args_tail:
        assert len(args) == len(header.args)


def test_the_closed_producers_reap_sends_what_reaps_header_declares() -> None:
    # reap.lua serves two wrappers: dead or leaving producers, and killed ones (closed).
    sha, keys, args = _sent(
        lambda c: recovery_scripts.gone(c, K, incarnation="i", closed={"a": "1,2"})
    )
    header = SCRIPTS["reap"].header
    assert sha == SCRIPTS["reap"].sha
    assert len(keys) == len(header.keys) + 1 and len(args) == len(header.args) + 2
    assert dict(zip(header.args, args, strict=False))["why"] == "closed"
    assert all(k.startswith("bq:{hdr}:") for k in keys)


def test_a_failed_attempt_sends_what_handbacks_header_declares() -> None:
    # handback.lua serves two wrappers: a shard handed back untouched, and a failed attempt.
    sha, keys, args = _sent(
        lambda c: producer_scripts.fail(
            c, K, incarnation="i", run="r", producer="p", entry="3:t", max_attempts=3
        )
    )
    header = SCRIPTS["handback"].header
    assert sha == SCRIPTS["handback"].sha
    assert len(keys) == len(header.keys) and len(args) == len(header.args)
    assert dict(zip(header.args, args, strict=True))["max_attempts"] == 3
    _, _, untouched = _sent(WRAPPERS["handback"])
    assert dict(zip(header.args, untouched, strict=True))["max_attempts"] == 0


def test_named_positions_follow_the_header() -> None:
    _, keys, args = _sent(WRAPPERS["push"])
    header = SCRIPTS["push"].header
    named_keys, named_args = keys[: len(header.keys)], args[: len(header.args)]
    assert dict(zip(header.keys, named_keys, strict=True))["lease"] == K.lease("p")
    assert dict(zip(header.args, named_args, strict=True))["entry"] == "3/5:t"


def test_a_call_naming_what_the_header_lacks_is_refused() -> None:
    with pytest.raises(ProtocolError, match="misses"):
        build_call("handback", list, {"meta": K.meta}, {})
    with pytest.raises(ProtocolError, match="no KEYS/ARGV tail"):
        build_call("handback", list, {}, {}, more_keys=["x"])


def test_a_header_out_of_order_is_refused() -> None:
    with pytest.raises(ProtocolError, match="expected KEYS"):
        parse_header("bad", "local a_key = KEYS[2]\n")
    with pytest.raises(ProtocolError, match="must end in _key"):
        parse_header("bad", "local meta = KEYS[1]\n")
    with pytest.raises(ProtocolError, match="tail starts"):
        parse_header("bad", "local a_key = KEYS[1]\n-- KEYS[3..]: more\n")


def test_a_call_can_be_queued_in_a_pipeline() -> None:
    sent: list[tuple[Any, ...]] = []

    class Pipe:
        def execute_command(self, *argv: Any) -> None:
            sent.append(argv)

    call: Call[Any] = producer_scripts.lease_call(
        K, incarnation="i", run="r", producer="p", token="t", heartbeat_ttl_ms=1,
        prefetch=0, groups=0, world=1,
    )  # fmt: skip
    call.queue(Pipe())
    assert sent[0][:3] == ("EVALSHA", SCRIPTS["lease"].sha, 8)
    assert call.parse([b"OK", b"7", 0, 0, 1, 1, b"r:2", 2]).attempts == 2  # failed before
    assert call.parse([b"OK", b"7", 0, 0, 1, 1, b"r:2"]).g == 7
    assert call.parse([b"OK", b"7", 0, 0, 1, 1, b"r:2"]).params == "r:2"  # the params stamp
