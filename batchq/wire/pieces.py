"""A Redis value sent as several buffers (the codec builds them, the connection's packer
writes them): its own module, so that the codec does not import the connection."""

from __future__ import annotations

__all__ = ["Pieces"]


class Pieces:
    """One Redis value sent as several buffers, back to back, without joining them.

    A command argument of this type is written as one bulk string (its total length,
    then each buffer as it is): a frame's header and its arrays' own memory go to the
    socket without being copied into one buffer first.

    Args:
        buffers: the value's parts, in order (bytes, or byte-format memoryviews).
        nbytes: their total length.
    """

    def __init__(self, buffers: list[bytes | memoryview], nbytes: int) -> None:
        self.buffers = buffers
        self.nbytes = nbytes

    def __len__(self) -> int:
        return self.nbytes

    def __bytes__(self) -> bytes:
        return b"".join(bytes(b) for b in self.buffers)

    def __repr__(self) -> str:
        return f"Pieces({len(self.buffers)} buffers, {self.nbytes} bytes)"
