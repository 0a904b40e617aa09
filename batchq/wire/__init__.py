"""The frame format: what one list element is, byte for byte.

The codec (``codec``) and the values it packs (``values``), the frame's kinds and header
rules (``frame``), a frame as pieces for the wire (``pieces``), the reference element of a
frame stored under its own key (``refs``) and the shared-memory segment and descriptor
formats (``shm``). Imports nothing of batchq but ``batchq.errors``.
"""
