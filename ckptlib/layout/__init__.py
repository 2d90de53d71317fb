"""Pure layout arithmetic, no I/O and no torch: which element range of which tensor lives where.

- :mod:`.ranges` — byte and element ranges of stored tensors (a plan's sources are lists of them);
- :mod:`.flat` — ZeRO's flat groups: padding, partitions per rank, ZeRO-3 chunks, N -> M re-slicing;
- :mod:`.placement` — where the blocks of a parallel layout sit in the full tensor.

May import: the vocabulary at the package's top (``ckptlib.errors``, ``units``, ``dtypes``, ``mesh``,
``progress``). Property tests live beside it (tests/test_layout.py).
"""
