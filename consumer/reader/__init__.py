"""The trainer's reader: from a popped element to a frame filed in the ledger.

The thread that pops (``thread``), the checks on what it pops (``guards``), resolving an
element (``fetch``; referenced frames: ``receive``; shared memory: ``shm_frames``), the
trainer's sources and dtypes (``prepare``), the buffer (``buffer``) and the ledger it owns
(``ledger``).
"""
