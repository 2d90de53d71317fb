"""Make a large real pipeline-parallel DeepSpeed checkpoint on CPU for benchmarks (pp 2, ZeRO-1, bf16).

Run under torchrun with 2 x dp ranks, e.g. (about 268 M parameters, 3.7 GB on disk):

    DS_ACCELERATOR=cpu torchrun --standalone --nproc_per_node 2 bench/make_parallel_checkpoint.py \\
        --out .bench-work/pp2_dp1_bf16 --dim 1024 --hidden 4096 --layers 28 --vocab 32000

The model is the pipeline fixture's (tests/fixtures/parallel/models.py): a tied embedding / head
(TiedLayerSpec "embed"), ``--layers`` Blocks (LayerNorm + two Linears, with a float and an int64
buffer), a final LayerNorm; stages balanced by Block count. One AdamW step on random tokens, then
``engine.save_checkpoint(out)`` with Megatron-style universal_checkpoint_info (the tied weight as a
pipeline-replicated parameter). Writes ``<out>/bench_info.json`` (parameter count, timings, sizes).
``--bf16-optimizer`` adds "data_types": {"grad_accum_dtype": "fp32"} (DeepSpeed's BF16_Optimizer).
Peak memory is about 14 bytes per parameter of a stage on each rank of it (dp 1).
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as tdist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.fixtures.parallel import models as M  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pipeline_setup import adamw, size_arguments, start_deepspeed  # noqa: E402


def main():
    ap = size_arguments(__doc__)
    ap.add_argument("--bf16-optimizer", action="store_true")
    args = ap.parse_args()
    deepspeed, rank, world, dp = start_deepspeed(2)  # pp 2
    from deepspeed.pipe import PipelineModule

    t0 = time.perf_counter()
    specs = M.pipe_layer_specs(args.vocab, args.dim, tuple([args.hidden] * args.layers), seed=1234)
    model = PipelineModule(layers=specs, num_stages=2, loss_fn=M.pipe_loss, partition_method="type:Block")
    n_local = sum(p.numel() for p in model.parameters())
    opt = adamw(model, 1e-4)
    cfg = {"train_batch_size": dp, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
           "steps_per_print": 10**9, "zero_optimization": {"stage": 1}, "bf16": {"enabled": True}}
    if args.bf16_optimizer:
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    t_init = time.perf_counter()
    grid = model.mpu()
    g = torch.Generator().manual_seed(100 + grid.get_data_parallel_rank())
    ids = torch.randint(0, args.vocab, (1, args.seq), generator=g)
    tgt = torch.randint(0, args.vocab, (1, args.seq), generator=g)
    loss = engine.train_batch(data_iter=iter([(ids, tgt)]))
    t_step = time.perf_counter()
    info = {"universal_checkpoint_version": 0.4,
            "pipeline_replicated_parameter_patterns": [r"tied_modules\.embed\.weight$"],
            "tp_replicated_parameter_patterns": [], "parameter_with_row_parallelism_patterns": [],
            "vocabulary_parameter_patterns": [], "parameter_to_average_patterns": []}
    engine.save_checkpoint(str(args.out), client_state={"universal_checkpoint_info": info})
    tdist.barrier()
    t_save = time.perf_counter()
    per_stage = [None] * world
    tdist.all_gather_object(per_stage, (grid.get_stage_id(), grid.get_data_parallel_rank(), n_local))
    if rank == 0:
        stage_params = {s: n for s, d, n in per_stage if d == 0}
        tied = args.vocab * args.dim
        total = sum(stage_params.values()) - tied  # the tied weight lives on both stages
        files = {str(p.relative_to(args.out)): p.stat().st_size for p in sorted(args.out.rglob("*")) if p.is_file()}
        out = {"parameters": total, "parameters_per_stage": stage_params, "tied_parameters": tied,
               "pp": 2, "dp": dp, "zero_stage": 1, "dtype": "bf16",
               "optimizer": type(engine.optimizer).__name__, "loss": float(loss), "args": vars(args) | {"out": str(args.out)},
               "seconds": {"init": round(t_init - t0, 1), "step": round(t_step - t_init, 1),
                           "save": round(t_save - t_step, 1)},
               "bytes_on_disk": sum(files.values()), "files": files}
        (args.out / "bench_info.json").write_text(json.dumps(out, indent=1))
        print(f"{total / 1e6:.1f} M parameters ({stage_params}), {out['bytes_on_disk'] / 2**30:.2f} GiB, "
              f"init {out['seconds']['init']}s step {out['seconds']['step']}s save {out['seconds']['save']}s",
              flush=True)
    tdist.barrier()
    tdist.destroy_process_group()


if __name__ == "__main__":
    main()
