"""A cache directory as the tests look at it (producer.cache_segment's layout): its
entries and where their bytes are, its files, its bytes on disk.

Tests tear, corrupt or replace an entry by writing over its bytes in its segment, as a
killed writer, a bad disk or another program would.
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path

from producer.cache_segment import Place, entry_places


def stage_dirs(directory: Path) -> list[Path]:
    """The stages' directories (named by 32 hex digits: nothing else there is the cache's)."""
    if not directory.exists():
        return []
    return sorted(p for p in directory.iterdir() if p.is_dir() and _STAGE.fullmatch(p.name))


_STAGE = re.compile("[0-9a-f]{32}")


def entries(directory: Path) -> dict[tuple[str, int], Place]:
    """Every entry the index of every stage names: (stage directory's name, index) -> place."""
    out: dict[tuple[str, int], Place] = {}
    for stage in stage_dirs(directory):
        for index, place in entry_places(str(stage)).items():
            out[(stage.name, index)] = place
    return out


def files(directory: Path) -> list[Path]:
    """The stages' files (segments and indexes)."""
    return sorted(p for stage in stage_dirs(directory) for p in stage.iterdir() if p.is_file())


def disk_bytes(directory: Path) -> int:
    """The stages' files' bytes (what the ledger counts)."""
    total = 0
    for p in files(directory):
        with contextlib.suppress(FileNotFoundError):  # a segment sealed meanwhile
            total += p.stat().st_size
    return total


def entry_bytes(place: Place) -> bytes:
    """An entry's bytes as its segment holds them."""
    with open(place.path, "rb") as f:
        f.seek(place.offset)
        return f.read(place.length)


def overwrite(place: Place, data: bytes, at: int = 0) -> None:
    """Write ``data`` over an entry's bytes, from its ``at``-th (the segment's size kept
    unless ``data`` runs past its end)."""
    fd = os.open(place.path, os.O_WRONLY)
    try:
        os.pwrite(fd, data, place.offset + at)
    finally:
        os.close(fd)
