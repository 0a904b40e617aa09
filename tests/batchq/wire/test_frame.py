"""The frame's kinds and the header rules the encoder and the decoder share."""

from __future__ import annotations

from typing import Any

import pytest

from batchq.wire import codec, frame
from batchq.wire.frame import FrameKind, header_problem, is_int


def _header(**changes: Any) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "run": "r", "ep": 0, "sh": 1, "k": 0, "g": 3, "pid": "p", "last": False, "src": ["x"],
    }  # fmt: skip
    fields.update(changes)
    return {k: v for k, v in fields.items() if v is not None}


def test_a_valid_header_has_no_problem() -> None:
    assert header_problem(FrameKind.BATCH, _header()) is None
    assert header_problem(FrameKind.BATCH, _header(last=True, n=2, t=1.5)) is None
    assert header_problem(FrameKind.END, _header(src=[], last=True, n=0)) is None
    assert header_problem(FrameKind.ERROR, _header(src=[], last=True, n=0, err="tb")) is None


@pytest.mark.parametrize(
    ("kind", "changes", "names"),
    [
        (FrameKind.BATCH, {"ep": -1}, "'ep' (epoch) is -1, expected >= 0"),
        (FrameKind.BATCH, {"k": True}, "'k' (k)"),
        (FrameKind.BATCH, {"g": -2}, "expected >= -1"),
        (FrameKind.BATCH, {"run": 5}, "'run' (run id)"),
        (FrameKind.BATCH, {"src": ["x", "x"]}, "unique strs"),
        (FrameKind.BATCH, {"last": True}, "'n' (count)"),
        (FrameKind.BATCH, {"n": 2}, "'n' (count)"),
        (FrameKind.END, {"last": True, "n": 0}, "carry no data"),
        (FrameKind.ERROR, {"src": [], "last": True, "n": 0}, "need the traceback"),
        (FrameKind.BATCH, {"err": "tb"}, "belong to ERROR frames"),
        (FrameKind.BATCH, {"t": "now"}, "'t' (produced_at)"),
    ],
)
def test_each_broken_field_is_named(kind: FrameKind, changes: dict[str, Any], names: str) -> None:
    problem = header_problem(kind, _header(**changes))
    assert problem is not None and names in problem


def test_is_int_refuses_bools_and_values_below_the_bound() -> None:
    assert is_int(0, 0) and is_int(-1, -1)
    assert not is_int(True, 0) and not is_int(-1, 0) and not is_int(1.0, 0)


def test_the_codec_re_exports_the_frame_types() -> None:
    assert codec.Frame is frame.Frame and codec.FrameKind is frame.FrameKind
    assert codec.FrameHeader is frame.FrameHeader and codec.MAGIC == frame.MAGIC == b"BQF"
