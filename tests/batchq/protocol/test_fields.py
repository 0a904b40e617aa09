"""Every field of the meta, stats and trainer hashes a script uses is declared once in
batchq.protocol.fields (and the per-rank and prefixed formats come from there)."""

from __future__ import annotations

import re

import pytest

from batchq.protocol.calls import SCRIPTS
from batchq.protocol.fields import (
    MetaField,
    StatsField,
    TrainerField,
    autoscale_field,
    dead_field,
    wait_bucket_field,
)
from batchq.protocol.ranks import rank_field

CALL = re.compile(r"\bcall\('H[A-Z]+', (meta|stats|trainer)_key")
LITERAL = re.compile(r"'([a-z_:]+)'")


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
