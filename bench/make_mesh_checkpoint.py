"""Make a large real pipeline x tensor x data (3D) DeepSpeed checkpoint on CPU for benchmarks (pp 2 x tp 2,
ZeRO-1, bf16, Megatron-style tensor parallelism with the pipeline grid as the mpu).

Run under torchrun with 4 x dp ranks, e.g. (about 268 M parameters):

    DS_ACCELERATOR=cpu torchrun --standalone --nproc_per_node 4 bench/make_mesh_checkpoint.py \\
        --out .bench-work/pp2_tp2_bf16 --dim 1024 --hidden 4096 --layers 28 --vocab 32000

The model is the 3D fixture's (tests/fixtures/mesh/models.py): a tied embedding / head replicated over the
tensor ranks, ``--layers`` TPBlocks (LayerNorm, column-parallel fc1, row-parallel fc2), a final LayerNorm;
``partition_method="uniform"``. One AdamW step on random tokens, then ``engine.save_checkpoint(out)`` with
the split rules as ``universal_checkpoint_info`` (what Megatron-DeepSpeed saves), so that DeepSpeed's
``ds_to_universal`` can read it too. Writes ``<out>/bench_info.json`` (parameters, timings, sizes).
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as tdist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.fixtures.mesh import models as MM  # noqa: E402
from tests.fixtures.parallel.models import pipe_loss  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pipeline_setup import adamw, size_arguments, start_deepspeed  # noqa: E402


def main():
    args = size_arguments(__doc__).parse_args()
    deepspeed, rank, world, dp = start_deepspeed(4)  # pp 2 x tp 2
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    t0 = time.perf_counter()
    topo = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=dp)
    tp_rank = topo.get_coord(rank).model
    hidden = tuple([args.hidden] * args.layers)
    specs = MM.layer_specs(args.vocab, args.dim, hidden, 2468, (), 2, tp_rank)
    model = PipelineModule(layers=specs, topology=topo, loss_fn=pipe_loss, partition_method="uniform")
    MM._TP["group"] = model.mpu().get_slice_parallel_group()
    n_local = sum(p.numel() for p in model.parameters())
    cfg = {"train_batch_size": dp, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
           "steps_per_print": 10**9, "zero_optimization": {"stage": 1}, "bf16": {"enabled": True},
           "gradient_clipping": 0.0}
    optimizer = adamw(model, 1e-3)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=cfg)
    t_init = time.perf_counter()
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, args.vocab, (dp, args.seq), generator=g)
    d = engine.grid.get_data_parallel_rank()
    batch = [(ids[d:d + 1], ids[d:d + 1])]
    engine.train_batch(data_iter=iter(batch))
    t_step = time.perf_counter()
    info = {k: v for k, v in MM.mesh_rules().items()}
    engine.save_checkpoint(str(args.out), client_state={"universal_checkpoint_info": info})
    t_save = time.perf_counter()
    counts = [None] * world
    tdist.all_gather_object(counts, (engine.grid.get_stage_id(), tp_rank, n_local))
    if rank == 0:
        per_rank = {f"stage {s} tp {t}": n for s, t, n in counts}
        info = {"local_parameters": per_rank, "dim": args.dim, "hidden": args.hidden, "layers": args.layers,
                "vocab": args.vocab, "dp": dp,
                "seconds": {"init": round(t_init - t0, 1), "step": round(t_step - t_init, 1),
                            "save": round(t_save - t_step, 1)},
                "bytes": sum(f.stat().st_size for f in args.out.rglob("*") if f.is_file())}
        (args.out / "bench_info.json").write_text(json.dumps(info, indent=1))
        print(json.dumps(info), flush=True)
    tdist.barrier()
    tdist.destroy_process_group()


if __name__ == "__main__":
    main()
