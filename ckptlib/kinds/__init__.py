"""What a checkpoint can hold, named once: the kinds of optimizer state (:mod:`.optimizers`) and peft adapters
(:mod:`.adapters`).

Every command reads these tables instead of spelling out state keys of its own: what an optimizer keeps per
element, which of its keys cannot be negative, whether it counts steps, how ZeRO lays each key out, and what
torch calls the same state. Plain data and pure functions.

May import: the vocabulary at the package's top (``ckptlib.errors``, ``units``, ``dtypes``, ``mesh``,
``progress``); nothing else of ckptlib.
"""
