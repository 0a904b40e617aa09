"""The run's change log of producer parameters: what ``set_params`` recorded, and the
params in effect at any global batch index (a pure function of the log).

A log is an ordered list of entries ``(version, index, params)``: ``params`` is the
JSON mapping one ``set_params`` call passed, ``index`` the global batch index from which
it applies (:func:`batchq.protocol.ranks.BatchNumbering`), ``version`` 1, 2, 3... in
call order (the order params.lua appended them). At global batch index i:

* the params in effect are the fold (``dict`` merge, later over earlier) of the params
  of every entry whose index is <= i, taken in (index, version) order;
* the version in effect is the largest version among those entries (0 when none).

A change appended with an index below an existing entry's (a retroactive change) gives
every batch from its index on a new version, so batches built before it are told from
the ones built after: a frame carries the version in effect at its index when it was
built (``pv`` in its header), and one whose version is not the trainer's for that index
is never yielded.

The JSON form (the ``params`` key in Redis, ``state_dict()['params']``) of an entry is
``{"version": v, "index": i, "id": call id, "params": {...}}`` (``id`` names the call
that made it: ranks of a job making the same call at the same step add it once); the
Redis key holds ``{"run": run id, "entries": [...]}`` (see
:mod:`batchq.protocol.layout`). Sizes are bounded (:data:`layout.PARAMS_LOG_MAX_BYTES`,
:data:`layout.PARAMS_MAX_ENTRIES`), so a log read from Redis never holds more memory
than that, whatever is there.
"""

from __future__ import annotations

import bisect
import json
import math
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from batchq.errors import ConfigError
from batchq.protocol.layout import PARAMS_LOG_MAX_BYTES, PARAMS_MAX_ENTRIES

__all__ = [
    "EMPTY_PARAMS",
    "ParamsEntry",
    "ParamsLog",
    "check_params",
    "dump_params",
    "freeze",
    "merged",
    "thaw",
]

EMPTY_PARAMS: Mapping[str, Any] = types.MappingProxyType({})
_MAX_DEPTH = 32  # nesting of a params value


def freeze(value: Any) -> Any:
    """A read-only deep copy of a JSON value: mappings as ``MappingProxyType``, lists as
    tuples (what ``params()`` hands out: a pipeline cannot change the run's params)."""
    if isinstance(value, Mapping):
        return types.MappingProxyType({str(k): freeze(v) for k, v in value.items()})
    if isinstance(value, list | tuple):
        return tuple(freeze(v) for v in value)
    return value


def thaw(value: Any) -> Any:
    """A frozen value (:func:`freeze`, ``control.params()``) as plain JSON types again:
    dicts and lists, for ``json.dumps``."""
    if isinstance(value, Mapping):
        return {k: thaw(v) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return [thaw(v) for v in value]
    return value


def _check_value(value: Any, where: str, depth: int) -> None:
    """Refuse what JSON cannot carry exactly (the producers read it back from JSON)."""
    if depth > _MAX_DEPTH:
        raise ConfigError(f"params{where} nests deeper than {_MAX_DEPTH} levels")
    if value is None or isinstance(value, bool | int | str):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ConfigError(f"params{where} = {value!r} is not valid: expected a finite number")
        return
    if isinstance(value, Mapping):
        for k, v in value.items():
            if not isinstance(k, str):
                raise ConfigError(
                    f"params{where} has the key {k!r}: expected str keys (JSON objects)"
                )
            _check_value(v, f"{where}[{k!r}]", depth + 1)
        return
    if isinstance(value, list | tuple):
        for i, v in enumerate(value):
            _check_value(v, f"{where}[{i}]", depth + 1)
        return
    raise ConfigError(
        f"params{where} = {value!r} ({type(value).__name__}) is not valid: expected a JSON "
        "value (None, bool, int, float, str, a list or a mapping with str keys)"
    )


def check_params(params: Any) -> dict[str, Any]:
    """Validate a ``set_params`` argument: a JSON-serialisable mapping with str keys whose
    JSON is at most :data:`PARAMS_LOG_MAX_BYTES`; returns it as plain JSON types.

    Raises:
        ConfigError: naming the value and what was expected.
    """
    if not isinstance(params, Mapping):
        raise ConfigError(
            f"params {params!r} is not valid: expected a mapping of str keys to JSON values"
        )
    _check_value(params, "", 0)
    plain: dict[str, Any] = thaw(params)
    size = len(dump_params(plain))
    if size > PARAMS_LOG_MAX_BYTES:
        raise ConfigError(
            f"params of {size} bytes as JSON are not valid: expected at most "
            f"{PARAMS_LOG_MAX_BYTES} bytes (the whole change log's cap)"
        )
    return plain


def dump_params(params: Mapping[str, Any]) -> str:
    """The canonical JSON of a params mapping (sorted keys, no spaces): what params.lua
    stores, byte for byte, and what a call's id hashes."""
    return json.dumps(thaw(params), sort_keys=True, separators=(",", ":"), allow_nan=False)


@dataclass(frozen=True)
class ParamsEntry:
    """One ``set_params`` call as recorded.

    Attributes:
        version: its place in call order (1, 2, 3...).
        index: the global batch index from which it applies.
        params: the update it made (read-only).
        call_id: names the call (ranks making the same call add it once).
    """

    version: int
    index: int
    params: Mapping[str, Any]
    call_id: str = ""

    def to_json(self) -> dict[str, Any]:
        """The entry's JSON form."""
        return {
            "version": self.version,
            "index": self.index,
            "id": self.call_id,
            "params": thaw(self.params),
        }


def _entry(raw: Any, where: str) -> ParamsEntry:
    """An entry from its JSON form, or ConfigError naming what is wrong."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where} = {raw!r} is not valid: expected an entry object")
    version, index, params = raw.get("version"), raw.get("index"), raw.get("params")
    call_id = raw.get("id", "")
    for name, value in (("version", version), ("index", index)):
        if type(value) is not int or value < (1 if name == "version" else 0):
            raise ConfigError(
                f"{where}[{name!r}] = {value!r} is not valid: expected an integer >= "
                f"{1 if name == 'version' else 0}"
            )
    if not isinstance(call_id, str):
        raise ConfigError(f"{where}['id'] = {call_id!r} is not valid: expected a str")
    return ParamsEntry(int(version), int(index), freeze(check_params(params)), call_id)  # type: ignore[arg-type]


@dataclass(frozen=True)
class ParamsLog:
    """A run's change log (immutable: :meth:`add` returns a new log).

    Attributes:
        entries: the entries in version order (versions 1..n).
    """

    entries: tuple[ParamsEntry, ...] = ()
    # Derived, for O(log n) lookups: entries sorted by (index, version), their indices,
    # the running maximum of their versions, and the folded params after each.
    _order: tuple[ParamsEntry, ...] = field(default=(), repr=False, compare=False)
    _indices: tuple[int, ...] = field(default=(), repr=False, compare=False)
    _versions: tuple[int, ...] = field(default=(), repr=False, compare=False)
    _folds: tuple[Mapping[str, Any], ...] = field(default=(), repr=False, compare=False)

    def __post_init__(self) -> None:
        for i, entry in enumerate(self.entries):
            if entry.version != i + 1:
                raise ConfigError(
                    f"params log entry {i} has version {entry.version}: expected {i + 1} "
                    "(versions count the calls, 1, 2, 3...)"
                )
        if len(self.entries) > PARAMS_MAX_ENTRIES:
            raise ConfigError(
                f"a params log of {len(self.entries)} entries is not valid: expected at "
                f"most {PARAMS_MAX_ENTRIES}"
            )
        order = tuple(sorted(self.entries, key=lambda e: (e.index, e.version)))
        versions, folds, top = [], [], 0
        folded: dict[str, Any] = {}
        for entry in order:
            top = max(top, entry.version)
            versions.append(top)
            folded = {**folded, **entry.params}
            folds.append(types.MappingProxyType(dict(folded)))
        object.__setattr__(self, "_order", order)
        object.__setattr__(self, "_indices", tuple(e.index for e in order))
        object.__setattr__(self, "_versions", tuple(versions))
        object.__setattr__(self, "_folds", tuple(folds))

    @property
    def version(self) -> int:
        """The log's version: the number of entries (0 for an empty log)."""
        return len(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def _last_at(self, index: int) -> int:
        """How many entries (in (index, version) order) apply at ``index``."""
        return bisect.bisect_right(self._indices, index)

    def version_at(self, index: int) -> int:
        """The version in effect at global batch index ``index`` (0: no entry applies)."""
        n = self._last_at(index)
        return self._versions[n - 1] if n else 0

    def params_at(self, index: int) -> Mapping[str, Any]:
        """The params in effect at ``index`` (read-only; empty when no entry applies)."""
        n = self._last_at(index)
        return self._folds[n - 1] if n else EMPTY_PARAMS

    def at(self, index: int) -> tuple[int, Mapping[str, Any]]:
        """(version, params) in effect at global batch index ``index``."""
        n = self._last_at(index)
        return (self._versions[n - 1], self._folds[n - 1]) if n else (0, EMPTY_PARAMS)

    def first_index_of(self, key: str) -> int | None:
        """The smallest index of an entry that sets ``key`` (None: no entry does)."""
        found = [e.index for e in self.entries if key in e.params]
        return min(found) if found else None

    def find(self, call_id: str) -> ParamsEntry | None:
        """The entry made by the call ``call_id``, if any."""
        for entry in self.entries:
            if call_id and entry.call_id == call_id:
                return entry
        return None

    def add(self, index: int, params: Mapping[str, Any], call_id: str = "") -> ParamsLog:
        """A new log with one more entry (the next version) at ``index``.

        Raises:
            ConfigError: ``params`` is not a JSON mapping, ``index`` is not an int >= 0,
                or the log would exceed its caps.
        """
        if type(index) is not int or index < 0:
            raise ConfigError(f"index {index!r} is not valid: expected an integer >= 0")
        entry = ParamsEntry(len(self.entries) + 1, index, freeze(check_params(params)), call_id)
        log = ParamsLog((*self.entries, entry))
        log.check_size()
        return log

    def extends(self, other: ParamsLog) -> bool:
        """Whether this log is ``other`` followed by zero or more entries."""
        return self.entries[: len(other.entries)] == other.entries

    def check_size(self) -> None:
        """Raises ConfigError when the log's JSON exceeds :data:`PARAMS_LOG_MAX_BYTES`."""
        size = len(self.entries_json())
        if size > PARAMS_LOG_MAX_BYTES:
            raise ConfigError(
                f"the params log would take {size} bytes as JSON: expected at most "
                f"{PARAMS_LOG_MAX_BYTES} (fewer or smaller set_params calls)"
            )

    # -- JSON ----------------------------------------------------------------------------

    def to_json(self) -> list[dict[str, Any]]:
        """The entries' JSON form (``state_dict()['params']``)."""
        return [e.to_json() for e in self.entries]

    def entries_json(self) -> str:
        """The entries as one JSON array, canonical (sorted keys, no spaces)."""
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: Any, what: str = "params log") -> ParamsLog:
        """A log from its entries' JSON form (a list; None: empty).

        Raises:
            ConfigError: not a list of entries with versions 1..n, or over the caps.
        """
        if raw is None:
            return cls()
        if not isinstance(raw, Sequence) or isinstance(raw, str | bytes):
            raise ConfigError(f"{what} {raw!r} is not valid: expected a list of entries")
        if len(raw) > PARAMS_MAX_ENTRIES:
            raise ConfigError(
                f"{what} of {len(raw)} entries is not valid: expected at most {PARAMS_MAX_ENTRIES}"
            )
        return cls(tuple(_entry(e, f"{what}[{i}]") for i, e in enumerate(raw)))

    @classmethod
    def from_stored(cls, raw: bytes | str | None, run: str) -> ParamsLog:
        """The log of run ``run`` from the Redis key's value (``{"run", "entries"}``):
        empty when there is none or it is another run's.

        Raises:
            ConfigError: the value is over the cap or not a log.
        """
        if not raw:
            return cls()
        if len(raw) > PARAMS_LOG_MAX_BYTES + 64:
            raise ConfigError(
                f"the stored params log is over {PARAMS_LOG_MAX_BYTES} bytes: not batchq's"
            )
        try:
            value = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise ConfigError(f"the stored params log is not JSON: {e}") from None
        if not isinstance(value, Mapping) or not isinstance(value.get("run"), str):
            raise ConfigError("the stored params log is not valid: expected {run, entries}")
        if value["run"] != run:
            return cls()
        return cls.from_json(value.get("entries"), "the stored params log")


def merged(mine: ParamsLog, theirs: ParamsLog) -> ParamsLog:
    """The longer of two logs of one run, one being a prefix of the other.

    Raises:
        ConfigError: they disagree on an entry (not the same run's log).
    """
    longer, shorter = (mine, theirs) if len(mine) >= len(theirs) else (theirs, mine)
    if not longer.extends(shorter):
        raise ConfigError(
            "two params logs of one run disagree (an entry of the same version differs): "
            "expected one to extend the other"
        )
    return longer
