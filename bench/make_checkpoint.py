"""Make a large real DeepSpeed checkpoint on CPU for benchmarks.

Run under torchrun, e.g. (about 1 GB of fp32 weights, 4 ranks, ZeRO-2, bf16):

    DS_ACCELERATOR=cpu torchrun --standalone --nproc_per_node 4 bench/make_checkpoint.py \
        --out .bench-work/z2_bf16_w4 --stage 2 --dtype bf16 --hidden 2048 --layers 32 --vocab 32000

The model is an embedding, ``layers`` square Linear layers and a head; one AdamW step, then save.
"""
from __future__ import annotations

import argparse
import importlib
import os
import time

import torch
import torch.nn as nn


class BigNet(nn.Module):
    def __init__(self, vocab: int, hidden: int, layers: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, x):
        h = self.embed(x)
        for layer in self.layers:
            h = torch.relu(layer(h))
        return self.head(self.norm(h))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--stage", type=int, default=2)
    ap.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="bf16")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=56)
    ap.add_argument("--vocab", type=int, default=32000)
    args = ap.parse_args()

    import deepspeed

    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    acc = deepspeed.accelerator.get_accelerator()
    acc.is_fp16_supported = lambda: True
    acc.supported_dtypes = lambda: [torch.float, torch.bfloat16, torch.float16]
    torch.manual_seed(0)
    t0 = time.time()
    model = BigNet(args.vocab, args.hidden, args.layers)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": args.stage},
        "bf16": {"enabled": args.dtype == "bf16"},
        "fp16": {"enabled": args.dtype == "fp16", "initial_scale_power": 8},
    }
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4),
                                           config=config)
    x = torch.randint(0, args.vocab, (1, 8))
    loss = engine(x).float().logsumexp(-1).mean()
    engine.backward(loss)
    engine.step()
    engine.save_checkpoint(args.out, client_state={"universal_checkpoint_info": {"universal_checkpoint_version": 0.4}})
    if int(os.environ.get("RANK", 0)) == 0:
        n = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
        print(f"saved {args.out}: {n / 1e6:.1f} M parameters ({4 * n / 2**20:.0f} MiB fp32) in {time.time() - t0:.0f} s")
    engine.destroy()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
