"""The bytes path: reading files, streaming tensor bytes through fixed buffers, casting, writing
atomically. Knows file formats, nothing about DeepSpeed.

- :mod:`.sources` — open files read by byte range; :mod:`.sinks` — files written with write-behind;
- :mod:`.streaming` — range lists copied (and cast) through :class:`~.streaming.ChunkBuffers`;
- :mod:`.casting` — float32/bfloat16/float16 casts on raw bytes, bit for bit torch's; :mod:`.castcopy` —
  chunks cast piece by piece on two cores, from the source files into a sink;
- :mod:`.threads` — the room a new thread needs, and the cast helper thread (casts on two cores);
- :mod:`.stformat` — the safetensors layout; :mod:`.torchzip` — torch's zip files and the safe unpickler;
- :mod:`.output` — the atomic output folder (temp, then rename).

May import: the vocabulary and ``plan`` at the package's top, :mod:`ckptlib.layout`, :mod:`ckptlib.system`.
"""
