"""How many bytes `ckpt inspect` reads from a checkpoint, against its size on disk.

    python bench/inspect_bytes.py PATH [PATH ...]
"""
import sys
import time

import ckptlib
from ckptlib.units import human_bytes

for path in sys.argv[1:]:
    t0 = time.perf_counter()
    with ckptlib.open_checkpoint(path) as ck:
        ckptlib.describe(ck)
        dt = time.perf_counter() - t0
        print(f"{path}: stage {ck.zero_stage} {ck.dtype} dp={ck.dp_world_size}: read {human_bytes(ck.stats.bytes_read)} "
              f"of {human_bytes(ck.total_bytes)} ({100 * ck.stats.bytes_read / ck.total_bytes:.4f}%) in {dt * 1000:.0f} ms")
