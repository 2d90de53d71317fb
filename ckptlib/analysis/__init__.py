"""Looking at checkpoints and outputs without changing them: the summary ``ckpt inspect`` prints
(:mod:`.summary`), health statistics and problems (:mod:`.health`, :mod:`.healthrules`, :mod:`.tensorstats`,
:mod:`.scan`), any two tensor sets compared (:mod:`.tensorsets`, :mod:`.compare`, :mod:`.tensordiff`) and a
run's output verified against its plan (:mod:`.verify`).

May import: :mod:`ckptlib.deepspeed` and every layer below it (io, system, layout, plan, the vocabulary).
"""
