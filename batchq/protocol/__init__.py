"""The Redis protocol: what is stored where, and the scripts that change it.

Key names (``keys``), hash fields (``fields``), every other format (``layout``), the split
among data-parallel ranks (``ranks``) and among groups (``groups``), the scripts' status
words and the errors they become (``words``), one typed function per script with its
typed reply, by who calls it (``producer_scripts``, ``trainer_scripts``,
``recovery_scripts``, ``params_scripts``), a script's header and its call (``calls``)
and the Lua sources (``lua/``). Imports the frame format and the errors only.
"""
