"""The Redis protocol: what is stored where, and the scripts that change it.

Key names (``keys``), hash fields (``fields``), every other format (``layout``), the split
among data-parallel ranks (``ranks``), the scripts' status words (``words``), typed replies
(``replies``), one typed function per script (``scripts``), a script's header and its call
(``calls``) and the Lua sources (``lua/``). Imports the frame format and the errors only.
"""
