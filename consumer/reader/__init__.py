"""The trainer's reader: from a popped element to a frame filed in the ledger.

A lower layer than the stream: it knows the run only through
:class:`~consumer.plan.RunView` (the trainer's session is one) and the buffer through
its reader side (:class:`~consumer.plan.ReaderBuffer`). The thread that pops
(``thread``; several, one per stripe: ``Readers``; what it is given:
:class:`~consumer.stream_options.ReaderSettings`) and the parts it is made of: resolving
an element (``fetch``; shared memory: ``shm_frames``), decoding, screening and filing
(``filing``, with the dead list), the figures ``stream.stats`` shows (the trainer's,
and the run's beside them) and what the next pop sends of them (``stats``), dead
producers, missing shards and a replaced key waited out (``repair``); the trainer's
sources and dtypes (``prepare``), the buffer (``buffer``, with a stripe's view of it)
and the ledger it owns (``ledger``; one shard and its rules: ``shard_state``).
"""
