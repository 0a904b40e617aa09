"""producer.serving.frames: a batch's header and the frame that ends a shard (the
producer's fixed PushSettings they carry)."""

from __future__ import annotations

from batchq.protocol.keys import QueueKeys
from batchq.wire import codec
from producer.serving.frames import PushSettings, batch_header, end_frame

SETTINGS = PushSettings(QueueKeys("f"), "p", ("x", "y"), False, None, 1024, 1000, 3)


def test_a_batch_header_names_its_place_and_counts_the_last() -> None:
    header = batch_header(SETTINGS, "run", 2, 5, 3, True, 4)
    assert (header.run, header.epoch, header.shard, header.k) == ("run", 2, 5, 3)
    assert header.g == 4 * 5 + 3 and header.count == 4 and header.sources == ("x", "y")
    assert batch_header(SETTINGS, "run", 2, 5, 3, False, None).g == -1


def test_a_shard_ends_with_its_count_or_the_pipelines_error() -> None:
    end = codec.decode_frame(end_frame("p", "run", 1, 2, 7))
    assert end.kind == codec.FrameKind.END and end.count == 7 and end.error is None
    try:
        raise ValueError("the user's bug")
    except ValueError as e:
        error = codec.decode_frame(end_frame("p", "run", 1, 2, 3, e))
    assert error.kind == codec.FrameKind.ERROR and error.count == 3
    assert "the user's bug" in str(error.error) and error.error_name == "ValueError"
