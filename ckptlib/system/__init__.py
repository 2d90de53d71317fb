"""The machine: memory measured and predicted (:mod:`.memory`), allocation failures told apart from other
errors (:mod:`.allocation`), the garbage collector paused while large metadata is parsed (:mod:`.gcpause`).

May import: the vocabulary at the package's top (``ckptlib.errors``, ``units``, ...).
"""
