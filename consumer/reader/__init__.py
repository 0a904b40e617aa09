"""The trainer's reader: from a popped element to a frame filed in the ledger.

The thread that pops (``thread``; its settings: ``settings``) and the parts it is made
of: resolving an element (``fetch``; referenced frames: ``receive``; shared memory:
``shm_frames``), decoding and filing (``filing``), the dead list (``dead``), what the
next pop sends (``accounting``), a replaced key waited out (``guards``), dead producers
and missing shards (``repair``); the trainer's sources and dtypes (``prepare``), the
buffer (``buffer``) and the ledger it owns (``ledger``; its rules: ``impossible``).
"""
