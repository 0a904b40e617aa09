"""The frame format: what one list element is, byte for byte.

The codec (``codec``) and the values it packs (``values``; one item encoded and
decoded, lists sent as arrays among them: ``items``),
the frame's kinds, header rules, its pieces for the wire and the reference element of a
frame stored under its own key (``frame``), and the shared-memory segment and
descriptor formats (``shm``). Imports nothing of batchq but ``batchq.errors``.
"""
