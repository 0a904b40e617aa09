"""Every field of the meta, stats and trainer hashes a script uses is declared once in
batchq.protocol.fields (and the per-rank and prefixed formats come from there); so are
the per-producer counters push.lua and pop.lua spell and the history sample's fields
pop.lua adds; the key types the scripts check are batchq.protocol.keys.KEY_TYPES."""

from __future__ import annotations

import re

import pytest
from lua_text import reachable

from batchq.protocol import keys as keys_module
from batchq.protocol.calls import SCRIPTS
from batchq.protocol.fields import (
    HistoryField,
    MetaField,
    ProducerStat,
    StatsField,
    TrainerField,
    autoscale_field,
    dead_field,
    parse_producer_stat_field,
    producer_stat_field,
    wait_bucket_field,
)
from batchq.protocol.keys import KEY_TYPES, QueueKeys
from batchq.protocol.ranks import rank_field

CALL = re.compile(r"\bcall\('H[A-Z]+', (meta|stats|trainer)_key")
LITERAL = re.compile(r"'([a-z_:]+)'")
# A per-producer counter: `producer .. ':batches'` (push.lua), `p .. ':produce_ms'` (pop.lua).
PSTAT = re.compile(r"\b\w+ \.\. ':([a-z_]+)'")
# join.lua's meta fields set where missing, else checked: `set_or_check('stripes', ...)`.
SET_OR_CHECK = re.compile(r"\bset_or_check\('([a-z_]+)'")
# pop.lua adds the queue side to the history sample it decoded into `s`.
SAMPLE_FIELD = re.compile(r"\bs\['([a-z_]+)'\] =")
# A key's expected type: `{data_key, 'list'}` in a type table, `TYPE', frame_key).ok ~= 'string'`.
TYPED = re.compile(r"\{(\w+)_key, '(\w+)'\}|'TYPE', (\w+)_key\)\.ok ~= '(\w+)'")


def _declared(cls: type) -> set[str]:
    return {v for k, v in vars(cls).items() if k.isupper() and isinstance(v, str)}


def _fields_used(source: str, key: str) -> set[str]:
    """The quoted field names of every H* call on ``<key>_key`` (its arguments up to the
    closing parenthesis, over several lines), a per-rank ``'<name>:'`` prefix as name."""
    found: set[str] = set()
    for match in CALL.finditer(source):
        if match.group(1) != key:
            continue
        depth, end = 0, match.start()
        for end in range(source.index("(", match.start()), len(source)):
            depth += {"(": 1, ")": -1}.get(source[end], 0)
            if depth == 0:
                break
        found |= {name.rstrip(":") for name in LITERAL.findall(source[match.end() : end])}
    if key == "meta":
        found |= set(SET_OR_CHECK.findall(source))
    return found


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_every_field_a_script_uses_is_declared(name: str) -> None:
    source = SCRIPTS[name].source
    for key, cls in (("meta", MetaField), ("stats", StatsField), ("trainer", TrainerField)):
        unknown = _fields_used(source, key) - _declared(cls)
        assert not unknown, f"{name}.lua uses {key} fields {sorted(unknown)} not in {cls.__name__}"


def test_the_scan_finds_fields_over_several_lines() -> None:
    # lease.lua's HMGET of meta spans two lines; pop.lua calls through a local `call`.
    assert {"run", "remap_epoch"} <= _fields_used(SCRIPTS["lease"].source, "meta")
    assert {"popped", "wait_bucket"} <= _fields_used(SCRIPTS["pop"].source, "stats")
    assert _fields_used(SCRIPTS["pop"].source, "trainer") == {"updated_ms"}


def test_formats() -> None:
    assert rank_field(MetaField.CLAIM_DEADLINE, 2, 4) == "claim_deadline:2"
    assert rank_field(MetaField.CLAIM_DEADLINE, 0, 1) == "claim_deadline"
    assert wait_bucket_field(3) == "wait_bucket:3"
    assert dead_field("checksum") == "dead:checksum"
    assert autoscale_field("add") == "autoscale_add"
    assert set(MetaField.PER_RANK) <= _declared(MetaField)
    assert set(TrainerField.PUBLISHED) <= _declared(TrainerField)


def _pstats_used(name: str) -> set[str]:
    """The counters script ``name`` names in pstats fields, in its own text and the library
    functions it calls (none if it has no pstats key)."""
    source = reachable(name)
    return set(PSTAT.findall(source)) if "pstats_key" in source else set()


def _types_checked(source: str) -> dict[str, str]:
    """Key name -> the type the script checks it has."""
    found: dict[str, str] = {}
    for m in TYPED.finditer(source):
        key, kind = (m[1], m[2]) if m[1] else (m[3], m[4])
        assert found.setdefault(key, kind) == kind, f"{key} checked as two types"
    return found


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_every_per_producer_counter_a_script_uses_is_declared(name: str) -> None:
    unknown = _pstats_used(name) - _declared(ProducerStat)
    assert not unknown, f"{name}.lua uses pstats counters {sorted(unknown)} not in ProducerStat"


def test_push_counts_every_per_producer_counter_and_pop_sums_two() -> None:
    assert _pstats_used("push") == set(ProducerStat.ALL)
    # The others are the cache's, set by the producer's heartbeat (no script writes them).
    assert _declared(ProducerStat) == set(ProducerStat.ALL) | set(ProducerStat.CACHE)
    assert not set(ProducerStat.ALL) & set(ProducerStat.CACHE)
    assert _pstats_used("pop") == {ProducerStat.BATCHES, ProducerStat.PRODUCE_MS}


def test_pop_adds_the_queue_side_of_the_history_sample() -> None:
    assert set(SAMPLE_FIELD.findall(SCRIPTS["pop"].source)) == set(HistoryField.QUEUE_SIDE)
    sides = (*HistoryField.TRAINER_SIDE, *HistoryField.QUEUE_SIDE)
    assert sorted(sides) == sorted(_declared(HistoryField))  # each once, on one side


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_every_key_type_a_script_checks_is_the_declared_one(name: str) -> None:
    checked = _types_checked(SCRIPTS[name].source)
    wrong = {k: t for k, t in checked.items() if KEY_TYPES.get(k) != t}
    assert not wrong, f"{name}.lua checks {wrong}; KEY_TYPES says otherwise"


def test_the_type_scan_finds_the_scripts_tables() -> None:
    assert _types_checked(SCRIPTS["pop"].source) == {
        "meta": "hash", "incarnation": "string", "data": "list",
    }  # fmt: skip
    push = _types_checked(SCRIPTS["push"].source)
    assert {"producers", "lease", "pstats", "frame"} <= set(push)


def test_the_keys_docstring_shows_the_declared_types() -> None:
    doc = keys_module.__doc__ or ""
    shown = {
        m[1]: m[2].lower() for m in re.finditer(r"^    bq:\{Q\}:(\w+)\S*\s+([A-Z]+)\b", doc, re.M)
    }
    assert shown == dict(KEY_TYPES)
    k = QueueKeys("q")
    assert k.types("meta", "data") == {k.meta: "hash", k.data: "list"}


def test_per_producer_counter_fields() -> None:
    field = producer_stat_field("host-12-abcdef", ProducerStat.PRODUCE_MS)
    assert field == "host-12-abcdef:produce_ms"
    assert parse_producer_stat_field(field) == ("host-12-abcdef", "produce_ms")
    assert parse_producer_stat_field("no-colon") is None
