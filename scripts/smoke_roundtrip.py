"""Smallest honest end-to-end round trip (used by scripts/demo.sh until the full example lands).

Run with: torchrun --nproc_per_node=2 scripts/smoke_roundtrip.py
Builds a model on meta, shards it with FSDP2 over gloo, materialises it from a full state dict,
runs a few Adam steps, gathers the full parameters and checks them against one process.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import distribute_tensor

from fsdptk import get_distributed_backend, get_world_size_and_rank, validate_no_params_on_meta_device


def build() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))


def main() -> None:
    dist.init_process_group(get_distributed_backend("cpu"))
    world, rank = get_world_size_and_rank()
    torch.manual_seed(0)
    reference = build()
    full_sd = reference.state_dict()
    with torch.device("meta"):
        model = build()
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    sharded = {k: distribute_tensor(v, p.device_mesh, p.placements, src_data_rank=None)
               for (k, v), p in zip(full_sd.items(), model.state_dict().values())}
    model.load_state_dict(sharded, assign=True)
    validate_no_params_on_meta_device(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-2)
    data = torch.randn(world, 8, 16, generator=torch.Generator().manual_seed(1))
    for step in range(5):
        loss = model(data[rank]).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = sum(reference(x).pow(2).mean() for x in data) / world
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        if rank == 0:
            print(f"step {step}: loss {loss.item():.5f} (single-process {ref_loss.item():.5f})")
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}
    err = max((full[k] - v).abs().max().item() for k, v in reference.state_dict().items())
    if rank == 0:
        print(f"max |sharded - single-process| after 5 steps: {err:.2e}")
    dist.destroy_process_group()
    if err > 1e-5:
        raise SystemExit(f"round trip mismatch: {err}")


if __name__ == "__main__":
    main()
