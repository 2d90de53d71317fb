"""Throughput of ckptlib.io.casting (numpy) against torch's ``copy_`` on 16 MiB chunks (what the streaming
buffers hold: 4 Mi float32 elements).

    python bench/casting_bench.py [--reps 30]

For each pair it times, on the same input: torch's ``out.copy_(chunk)`` with its default threads and with
one thread, ckptlib.io.casting with one reused :class:`~ckptlib.io.casting.Scratch` (one thread), and the
same split over two threads (numpy releases the GIL; the caller gives each half its own scratch).
Single-threaded runs are timed by the process's CPU time (robust to other load on the machine), the
multi-threaded ones by wall time.
Inputs: normal values (weights) and the same with one NaN every 1000 elements (the NaN path).
Medians in GB/s of input bytes.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ckptlib.io import casting  # noqa: E402

CHUNK = 16 * 2**20


def timed(fn, reps: int, clock=time.perf_counter) -> float:
    """Median seconds of ``fn()`` by ``clock``: wall time, or the process's CPU time (``time.process_time``,
    which other load on the machine does not inflate much) for single-threaded work."""
    fn()
    times = []
    for _ in range(reps):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    n = CHUNK // 4
    f32 = (rng.standard_normal(n) * 0.02).astype(np.float32)
    with_nans = f32.copy()
    with_nans[::1000] = np.nan
    pool = ThreadPoolExecutor(2)
    scratches = [casting.Scratch(), casting.Scratch()]
    default_threads = torch.get_num_threads()
    print(f"torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()}, {default_threads} threads), "
          f"numpy {np.__version__}; {CHUNK >> 20} MiB of float32 per chunk; GB/s of input, median of {args.reps}")
    print(f"| cast | input | torch copy_ ({default_threads} threads) | torch copy_ (1 thread) | ckptlib.io.casting "
          "(1 thread) | ckptlib.io.casting (2 threads) | time, ours / torch, 1 thread each |")
    print("|---|---|---|---|---|---|---|")
    pairs = [("float32", "bfloat16", casting.f32_to_bf16), ("float32", "float16", casting.f32_to_f16),
             ("bfloat16", "float32", casting.bf16_to_f32), ("float16", "float32", casting.f16_to_f32)]
    for src_name, dst_name, fn in pairs:
        for label, data in (("normal", f32), ("1 NaN / 1000", with_nans)):
            src_t = torch.from_numpy(data).to(getattr(torch, src_name))
            src = src_t.view(torch.uint8).numpy() if src_name != "float32" else data
            count = src_t.numel()
            out_t = torch.empty(count, dtype=getattr(torch, dst_name))
            out = out_t.view(torch.uint8).numpy()
            nbytes = src_t.numel() * src_t.element_size()
            t_torch = timed(lambda: out_t.copy_(src_t), args.reps)
            torch.set_num_threads(1)
            t_torch1 = timed(lambda: out_t.copy_(src_t), args.reps, time.process_time)
            torch.set_num_threads(default_threads)
            want = out_t.clone()
            t_ours = timed(lambda: fn(src, out, scratches[0]), args.reps, time.process_time)
            assert torch.equal(out_t.view(torch.uint8), want.view(torch.uint8)), (src_name, dst_name, label)
            half_in, half_out = nbytes // 2, count // 2 * out_t.element_size()
            srcb, outb = memoryview(src).cast("B"), memoryview(out).cast("B")

            def two():
                futs = [pool.submit(fn, srcb[:half_in], outb[:half_out], scratches[0]),
                        pool.submit(fn, srcb[half_in:], outb[half_out:], scratches[1])]
                for f in futs:
                    f.result()
            t_two = timed(two, args.reps)
            assert torch.equal(out_t.view(torch.uint8), want.view(torch.uint8))
            gbs = lambda t: f"{nbytes / t / 1e9:.2f}"  # noqa: E731
            print(f"| {src_name} -> {dst_name} | {label} | {gbs(t_torch)} | {gbs(t_torch1)} | {gbs(t_ours)} | "
                  f"{gbs(t_two)} | {t_ours / t_torch1:.1f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
