"""batchq.wire.shm: host identity, segment names, descriptors, clean-up."""

from __future__ import annotations

import os
from pathlib import Path

import msgpack
import pytest

from batchq.errors import ConfigError, FrameError
from batchq.wire import shm


def test_segment_names_split_without_ambiguity_even_with_dashes() -> None:
    name = shm.segment_name("my-queue", "0123abcd", "host-12-ab", 7)
    assert name == "batchq-my~queue-0123abcd-host~12~ab-7"
    parsed = shm.parse_segment_name(name)
    assert parsed == shm.SegmentName("my-queue", "0123abcd", "host-12-ab", 7)


@pytest.mark.parametrize(
    "name",
    ["../etc/passwd", "batchq-q-run-p", "batchq-q-RUN-p-1", "batchq-q-ab-p-1/x", "other-q-a-p-1"],
)
def test_anything_else_is_not_a_segment_name(name: str) -> None:
    assert shm.parse_segment_name(name) is None


def test_host_identity_names_the_boot_and_the_folder(tmp_path: Path) -> None:
    here = shm.host_identity(str(tmp_path))
    assert here is not None and here == shm.host_identity(str(tmp_path))
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    assert here.startswith(boot + ":")
    assert here.endswith(f":{os.geteuid()}")  # segments are 0600: only one user reads them
    other = tmp_path / "other"
    other.mkdir()
    assert shm.host_identity(str(other)) != here  # another folder: another inode
    assert shm.host_identity(str(tmp_path / "missing")) is None


def test_descriptor_round_trip() -> None:
    name = shm.segment_name("q", "ab12", "p", 3)
    elem = shm.encode_descriptor(name, 5, 1000, "host")
    assert shm.is_descriptor(elem) and len(elem) < 128
    assert shm.decode_descriptor(elem, "q") == shm.Descriptor(name, 5, 1000, "host")


def _desc(body: object) -> bytes:
    return shm.DESCRIPTOR_MAGIC + msgpack.packb(body)


GOOD = {"seg": "batchq-q-ab12-p-1", "gen": 1, "len": 10, "host": "h"}


@pytest.mark.parametrize(
    ("elem", "reason"),
    [
        (shm.DESCRIPTOR_MAGIC + b"\xc1\xff", "shm_bad"),
        (_desc([1, 2]), "shm_bad"),
        (_desc({**GOOD, "extra": 1}), "shm_bad"),
        (_desc({k: v for k, v in GOOD.items() if k != "gen"}), "shm_bad"),
        (_desc({**GOOD, "gen": 0}), "shm_bad"),
        (_desc({**GOOD, "len": True}), "shm_bad"),
        (_desc({**GOOD, "host": 3}), "shm_bad"),
        (_desc({**GOOD, "seg": "../../etc/passwd"}), "shm_outside"),
        (_desc({**GOOD, "seg": "/dev/shm/batchq-q-ab12-p-1"}), "shm_outside"),
        (_desc({**GOOD, "seg": "batchq-other-ab12-p-1"}), "shm_outside"),
        (_desc({**GOOD, "seg": 12}), "shm_outside"),
        (shm.DESCRIPTOR_MAGIC + b"\x00" * 2000, "shm_bad"),
    ],
)
def test_hostile_descriptors_are_frame_errors_with_a_reason(elem: bytes, reason: str) -> None:
    with pytest.raises(FrameError) as info:
        shm.decode_descriptor(elem, "q")
    assert info.value.reason == reason


def test_remove_segments_filters_by_queue_run_and_producer(tmp_path: Path) -> None:
    names = [
        shm.segment_name("q", "aa", "p1", 1),
        shm.segment_name("q", "bb", "p1", 1),
        shm.segment_name("q", "bb", "p2", 1),
        shm.segment_name("q-x", "bb", "p2", 1),  # another queue whose name starts alike
        "unrelated",
    ]
    for name in names:
        (tmp_path / name).write_bytes(b"x" * 100)
    assert shm.segments_usage(str(tmp_path), "q")[0] == 3
    assert shm.remove_segments(str(tmp_path), "q", keep_run="bb", keep_producers={"p2"}) == 1
    assert sorted(os.listdir(tmp_path)) == sorted(names[1:])
    assert shm.remove_segments(str(tmp_path), "q", only_producer="p2") == 1
    assert shm.remove_segments(str(tmp_path), "q", only_run="aa") == 0  # gone already
    assert shm.remove_segments(str(tmp_path), "q") == 1
    assert sorted(os.listdir(tmp_path)) == sorted(names[3:])


def test_transport_setting_from_the_argument_then_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(shm.ENV_TRANSPORT, raising=False)
    assert shm.resolve_transport(None) == "auto"
    monkeypatch.setenv(shm.ENV_TRANSPORT, "redis")
    assert shm.resolve_transport(None) == "redis"
    assert shm.resolve_transport("auto") == "auto"
    assert shm.resolve_transport("shm") == "auto"  # shared memory where it can be used
    with pytest.raises(ConfigError, match="'tcp'"):
        shm.resolve_transport("tcp")
    monkeypatch.setenv(shm.ENV_TRANSPORT, "zmq")
    with pytest.raises(ConfigError, match="BATCHQ_TRANSPORT 'zmq' is not valid"):
        shm.resolve_transport(None)
