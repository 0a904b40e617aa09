"""The trainer's reader: from a popped element to a frame filed in the ledger.

A lower layer than the stream: it knows the run only through
:class:`~consumer.reader.settings.RunView` (the trainer's session is one). The thread
that pops (``thread``; what it is given: ``settings``; several, one per stripe:
``Readers``) and the parts it is made of: resolving an element (``fetch``; shared
memory: ``shm_frames``), decoding, screening and filing (``filing``), the dead list
(``dead``), the trainer's figures and what the next pop sends of them (``stats``), a
replaced key waited out (``guards``), dead producers and missing shards (``repair``);
the trainer's sources and dtypes (``prepare``), the buffer (``buffer``; a stripe's view
of it: ``stripes``) and the ledger it owns (``ledger``; one shard and its rules:
``shard_state``).
"""
