"""A frame stored under its own Redis key: the *reference* element the data list holds
in its place.

A reference is ``REF_MAGIC + key`` (the key's UTF-8 bytes, at most 1024 of them,
printable, without spaces). The producer SETs a large frame under
``bq:{Q}:frame:<producer>:<n>`` (:mod:`batchq.protocol.keys`) and pushes its reference; the
trainer checks that the key is one of this queue's frame keys before reading it, so a
hostile element can never make it read (or delete) another key.
"""

from __future__ import annotations

from typing import Any

from batchq.errors import ConfigError, FrameError

__all__ = ["REF_MAGIC", "decode_ref", "encode_ref", "is_ref"]

REF_MAGIC = b"BQR\x01"
_MAX_REF_KEY = 1024  # bytes; a reference names a Redis key, not a payload


def encode_ref(key: str) -> bytes:
    """Encode a reference element that points at the Redis key holding a large frame.

    Raises:
        ConfigError: the key is empty, too long, or contains whitespace/control chars.
    """
    if not isinstance(key, str) or not _key_ok(key):
        raise ConfigError(f"reference key {key!r}: expected a printable str without spaces")
    encoded = key.encode("utf-8")
    if len(encoded) > _MAX_REF_KEY:
        raise ConfigError(f"reference key of {len(encoded)} bytes, at most {_MAX_REF_KEY}")
    return REF_MAGIC + encoded


def decode_ref(elem: bytes | bytearray | memoryview, key_prefix: str) -> str:
    """Decode a reference element and check that it names a key of this queue.

    Args:
        elem: the list element.
        key_prefix: the prefix every frame key of this queue starts with.

    Returns:
        The key.

    Raises:
        FrameError: ``bad_ref`` when the element is not a valid reference under
            ``key_prefix``.
    """
    if not is_ref(elem):
        raise FrameError("bad_ref", f"starts with {bytes(elem[:4])!r}, expected {REF_MAGIC!r}")
    raw = bytes(elem[len(REF_MAGIC) :])
    if len(raw) > _MAX_REF_KEY:
        raise FrameError("bad_ref", f"key of {len(raw)} bytes, at most {_MAX_REF_KEY}")
    try:
        key = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise FrameError("bad_ref", f"key {raw[:64]!r} is not utf-8") from None
    if not _key_ok(key) or not key.startswith(key_prefix):
        raise FrameError(
            "bad_ref", f"key {key[:200]!r}: expected a printable key starting with {key_prefix!r}"
        )
    return key


def _key_ok(key: str) -> bool:
    # isprintable() is False for control, format and separator characters except " ".
    return bool(key) and key.isprintable() and " " not in key


def is_ref(elem: Any) -> bool:
    """Whether ``elem`` looks like a reference element (a cheap prefix check)."""
    return isinstance(elem, bytes | bytearray | memoryview) and bytes(elem[:4]) == REF_MAGIC
