"""Frames in shared memory on the trainer's own host: names, formats and clean-up.

When a producer runs on the trainer's host, a frame's bytes go into a *segment*, a file
in the shared-memory folder (``shm_dir``, default ``/dev/shm``), and the Redis list
carries a small *descriptor* under the same capped push as any frame. This module holds
what both sides share; the producer's pool is :mod:`producer.serving.transport`, the trainer's
mapping :mod:`consumer.reader.shm_frames`.

Host identity (published by the trainer in meta field
:data:`batchq.protocol.fields.MetaField.SHM_HOST`)::

    <boot id>:<st_dev of shm_dir>:<st_ino of shm_dir>:<effective uid>

Two processes with the same identity see the same folder of the same running kernel
(another machine, a rebooted one, another container's private /dev/shm or another
folder all differ), so a producer cannot be fooled into writing where the trainer does
not look; the uid is in it because segments are 0600 and the trainer opens only its
own user's files (a producer running as another user goes through Redis).

Segment name: ``batchq-<queue>-<run>-<producer>-<n>`` in ``shm_dir``, mode 0600, with
``-`` inside the queue name and the producer id written as ``~`` (a character neither may
contain), so the five fields split without ambiguity; ``n`` counts the producer's
segments and is never reused by that producer in that run.

Segment layout (little-endian)::

    0   b"BQSG"     magic
    4   u32         version (2)
    8   u64         gen: the generation of the frame inside (written by the producer,
                    after the frame's bytes)
    16  u64         released[0]: the last generation group slot 0's trainer is done with
                    (written by that trainer when nothing of its batch is referenced
                    any more; a run of one group has only this one)
    24  u64         retired: 1 once the producer left; the trainer then unlinks the
                    segment when it releases it
    32  u64         the frame's length
    40  u64         targets: the group slots whose lists got the descriptor of ``gen``
                    (bit i for slot i, :mod:`batchq.protocol.groups`; 1: slot 0 alone),
                    written by the producer before the push (and again if the push left
                    a group out)
    48  16 bytes    reserved, zero
    64  31 x u64    released[1..31]: group slot i's, at 64 + 8 (i - 1)
    312 8 bytes     reserved, zero
    320 ...         the frame (the codec's layout), capacity = file size - 320

A frame pushed for several groups (one descriptor in each group's list) is mapped by
every trainer on the host; each writes its own slot's word. A segment is free for its
producer to overwrite exactly when ``released[i] == gen`` for every slot i of
``targets`` (:func:`all_released`).

Descriptor (one list element)::

    b"BQM\\x01" + msgpack {"seg": name, "gen": int, "len": int, "host": identity}
"""

from __future__ import annotations

import functools
import logging
import os
import re
import stat
import struct
from dataclasses import dataclass
from typing import Any

import msgpack

from batchq.errors import ConfigError, FrameError

__all__ = [
    "DEFAULT_SHM_DIR",
    "DESCRIPTOR_MAGIC",
    "ENV_TRANSPORT",
    "HEADER",
    "HEADER_BYTES",
    "RELEASE_SLOTS",
    "SEGMENT_MAGIC",
    "SEGMENT_MODE",
    "SEGMENT_VERSION",
    "Descriptor",
    "SegmentName",
    "all_released",
    "decode_descriptor",
    "encode_descriptor",
    "host_identity",
    "is_descriptor",
    "list_segments",
    "parse_segment_name",
    "release_offset",
    "remove_segments",
    "resolve_transport",
    "segment_name",
    "segments_usage",
]

log = logging.getLogger(__name__)

DEFAULT_SHM_DIR = "/dev/shm"
SEGMENT_MAGIC = b"BQSG"
SEGMENT_MODE = 0o600  # a segment's mode; the trainer refuses one with another
DESCRIPTOR_MAGIC = b"BQM\x01"
SEGMENT_VERSION = 2
# The header's first 64 bytes: magic, version, gen, released[0], retired, length, targets.
HEADER = struct.Struct("<4sIQQQQQ16x")
HEADER_BYTES = 320  # the whole header: the first 64 bytes, then released[1..31]
OFF_GEN, OFF_RELEASED, OFF_RETIRED, OFF_LEN, OFF_TARGETS = 8, 16, 24, 32, 40
OFF_RELEASED_MORE = 64  # released[1], then one u64 per group slot
RELEASE_SLOTS = 32  # group slots with a release word (batchq.protocol.layout.MAX_GROUPS)
_U64 = struct.Struct("<Q")
_MAX_DESCRIPTOR = 1024  # bytes; a descriptor names a file, it is never a payload
_PART = r"[A-Za-z0-9_.~]{1,128}"
_NAME_RE = re.compile(rf"^batchq-({_PART})-([0-9a-f]{{1,64}})-({_PART})-([0-9]{{1,18}})$")
_BOOT_ID = "/proc/sys/kernel/random/boot_id"
ENV_TRANSPORT = "BATCHQ_TRANSPORT"
TRANSPORTS = ("auto", "shm", "redis")


def release_offset(slot: int) -> int:
    """Where group slot ``slot``'s release word is in a segment's header.

    Raises:
        ConfigError: a slot without one (0..RELEASE_SLOTS - 1).
    """
    if not 0 <= slot < RELEASE_SLOTS:
        raise ConfigError(f"group slot {slot} has no release word: expected 0..{RELEASE_SLOTS - 1}")
    return OFF_RELEASED if slot == 0 else OFF_RELEASED_MORE + 8 * (slot - 1)


def all_released(header: Any, gen: int) -> bool:
    """Whether every group slot a segment's frame of ``gen`` went to released it
    (``header``: the segment's first HEADER_BYTES, or its mapping)."""
    targets = _U64.unpack_from(header, OFF_TARGETS)[0] & ((1 << RELEASE_SLOTS) - 1) or 1
    slot = 0
    while targets >> slot:
        if targets >> slot & 1 and _U64.unpack_from(header, release_offset(slot))[0] != gen:
            return False
        slot += 1
    return True


def resolve_transport(transport: str | None) -> str:
    """The transport to use: the argument, else ``BATCHQ_TRANSPORT``, else 'auto'.

    'auto' uses shared memory when the trainer is on the same host ('shm' is the same:
    shared memory can only be used there); 'redis' never does.
    (The one setting the library reads from the environment besides ``BATCHQ_URL``: both
    sides must agree, and a launcher sets it once for all processes.)

    Raises:
        ConfigError: not one of 'auto', 'redis'.
    """
    if transport is not None:
        value, what = transport, "transport"
    else:
        value, what = os.environ.get(ENV_TRANSPORT) or "auto", ENV_TRANSPORT
    if value not in TRANSPORTS:
        raise ConfigError(f"{what} {value!r} is not valid: expected 'auto', 'shm' or 'redis'")
    return "auto" if value == "shm" else value


def host_identity(shm_dir: str = DEFAULT_SHM_DIR) -> str | None:
    """This host's identity for ``shm_dir``, or None where shared memory is not usable.

    None when the folder is missing, not a directory, not writable, or the kernel's boot
    id cannot be read.
    """
    try:
        with open(_BOOT_ID) as f:
            boot = f.read().strip()
        st = os.stat(shm_dir)
    except OSError:
        return None
    if not boot or not stat.S_ISDIR(st.st_mode) or not os.access(shm_dir, os.W_OK | os.X_OK):
        return None
    return f"{boot}:{st.st_dev}:{st.st_ino}:{os.geteuid()}"


def _esc(part: str) -> str:
    return part.replace("-", "~")


@dataclass(frozen=True)
class SegmentName:
    """The fields of a segment's name (queue and producer as they were given)."""

    queue: str
    run: str
    producer: str
    n: int


def segment_name(queue: str, run: str, producer: str, n: int) -> str:
    """The file name of ``producer``'s ``n``-th segment for ``run`` of ``queue``."""
    return f"batchq-{_esc(queue)}-{run}-{_esc(producer)}-{n}"


@functools.lru_cache(maxsize=4096)  # a pure function; the trainer asks it per descriptor
def parse_segment_name(name: str) -> SegmentName | None:
    """Split a segment's file name; None for anything that is not one."""
    match = _NAME_RE.match(name)
    if match is None:
        return None
    queue, run, producer, n = match.groups()
    return SegmentName(queue.replace("~", "-"), run, producer.replace("~", "-"), int(n))


# --------------------------------------------------------------------------- descriptors


@dataclass(frozen=True)
class Descriptor:
    """A decoded descriptor: which segment, which generation, how many bytes."""

    segment: str
    gen: int
    length: int
    host: str


def encode_descriptor(segment: str, gen: int, length: int, host: str) -> bytes:
    """The list element that stands for a frame held in ``segment``."""
    body: bytes = msgpack.packb({"seg": segment, "gen": gen, "len": length, "host": host})
    return DESCRIPTOR_MAGIC + body


def is_descriptor(elem: Any) -> bool:
    """Whether ``elem`` looks like a descriptor (a cheap prefix check)."""
    return isinstance(elem, bytes | bytearray | memoryview) and bytes(elem[:4]) == DESCRIPTOR_MAGIC


def decode_descriptor(elem: bytes | bytearray | memoryview, queue: str) -> Descriptor:
    """Decode and validate a descriptor of ``queue``.

    Raises:
        FrameError: ``shm_bad`` for a malformed descriptor, ``shm_outside`` for a name
            that is not a segment of this queue (a path, another queue, a symlink trick).
    """
    body = _descriptor_body(bytes(elem))
    seg, gen, length, host = body["seg"], body["gen"], body["len"], body["host"]
    for name, value, kind in (("gen", gen, int), ("len", length, int)):
        if type(value) is not kind or value < 1:
            raise FrameError("shm_bad", f"descriptor {name!r} is {value!r}, expected an int >= 1")
    if not isinstance(host, str):
        raise FrameError("shm_bad", f"descriptor 'host' is {host!r}, expected a str")
    parsed = parse_segment_name(seg) if isinstance(seg, str) else None
    if parsed is None or parsed.queue != queue:
        raise FrameError(
            "shm_outside",
            f"segment {str(seg)[:200]!r} is not a segment of queue {queue!r} "
            "(expected batchq-<queue>-<run>-<producer>-<n>)",
        )
    return Descriptor(seg, gen, length, host)


def _descriptor_body(raw: bytes) -> dict[str, Any]:
    """A descriptor's msgpack map, with exactly its four keys (values not yet checked).

    Raises:
        FrameError: ``shm_bad``: no magic, too long, not msgpack, or other keys.
    """
    if not raw.startswith(DESCRIPTOR_MAGIC):
        raise FrameError("shm_bad", f"starts with {raw[:4]!r}, expected {DESCRIPTOR_MAGIC!r}")
    if len(raw) > _MAX_DESCRIPTOR:
        raise FrameError("shm_bad", f"descriptor of {len(raw)} bytes, at most {_MAX_DESCRIPTOR}")
    try:
        body = msgpack.unpackb(raw[4:], raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several types for garbage
        raise FrameError("shm_bad", f"descriptor is not msgpack: {type(e).__name__}") from None
    if not isinstance(body, dict) or set(body) != {"seg", "gen", "len", "host"}:
        keys = sorted(map(str, body)) if isinstance(body, dict) else type(body).__name__
        raise FrameError("shm_bad", f"descriptor has {keys}, expected seg, gen, len, host")
    return body


# --------------------------------------------------------------------------- clean-up


def list_segments(shm_dir: str, queue: str) -> list[tuple[str, SegmentName]]:
    """(file name, parsed name) of ``queue``'s segments in ``shm_dir``."""
    prefix = f"batchq-{_esc(queue)}-"
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return []
    out = []
    for name in names:
        if name.startswith(prefix):
            parsed = parse_segment_name(name)
            if parsed is not None and parsed.queue == queue:
                out.append((name, parsed))
    return out


def remove_segments(
    shm_dir: str,
    queue: str,
    *,
    keep_run: str | None = None,
    keep_producers: frozenset[str] | set[str] = frozenset(),
    only_producer: str | None = None,
    only_run: str | None = None,
) -> int:
    """Unlink ``queue``'s segments in ``shm_dir``; returns how many went.

    Unlinking is always safe for a process that has the segment mapped: its mapping
    stays valid until it drops it. What must not go is a segment whose descriptor may
    still be popped: hence the filters.

    Args:
        shm_dir: the shared-memory folder.
        queue: the queue.
        keep_run: keep the segments of this run (the current one).
        keep_producers: keep the segments of these producers, whatever their run (they
            are alive and may have joined a newer run than the caller saw).
        only_producer: remove only this producer's segments.
        only_run: remove only this run's segments (a finished run's: a new run may have
            started on this host meanwhile).
    """
    removed = 0
    for name, parsed in list_segments(shm_dir, queue):
        if parsed.run == keep_run or parsed.producer in keep_producers:
            continue
        if only_producer not in (None, parsed.producer) or only_run not in (None, parsed.run):
            continue
        try:
            os.unlink(os.path.join(shm_dir, name))
            removed += 1
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("could not remove shared-memory segment %s: %s", name, e)
    if removed:
        log.info("queue %s: removed %d shared-memory segments from %s", queue, removed, shm_dir)
    return removed


def segments_usage(shm_dir: str, queue: str) -> tuple[int, int]:
    """(segments, bytes allocated) of ``queue`` in ``shm_dir`` on this host."""
    count = used = 0
    for name, _parsed in list_segments(shm_dir, queue):
        try:
            st = os.stat(os.path.join(shm_dir, name), follow_symlinks=False)
        except OSError:
            continue
        count += 1
        used += st.st_blocks * 512
    return count, used
