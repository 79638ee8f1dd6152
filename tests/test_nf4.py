"""NF4 parameters: re-quantised from the FULL tensor, sharded on 1-D and 2-D meshes, gathered."""

from __future__ import annotations

import torch
import torch.distributed as dist
from _compare import tensor_diffs
from torch import nn


class _QLinear(nn.Module):
    """A frozen NF4 base weight plus a trainable adapter, like a QLoRA linear."""

    def __init__(self, rows: int = 32, cols: int = 64) -> None:
        super().__init__()
        from fsdptk.nf4 import to_nf4

        w = torch.zeros(rows, cols, dtype=torch.bfloat16)
        self.weight = nn.Parameter(to_nf4(w, 64, 8), requires_grad=False)
        self.lora_a = nn.Parameter(torch.zeros(4, cols))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - not used
        return x


def _nf4_round_trip(sd, layout, bcast):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from fsdptk import gather_cpu_state_dict, load_from_full_model_state_dict
    from fsdptk.nf4 import chunk, dequantize, is_nf4, to_nf4

    if layout == "hsdp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    else:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    with torch.device("meta"):
        model = nn.Sequential(_QLinear(), _QLinear())
    for m in model:
        fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    rank = dist.get_rank()
    load_from_full_model_state_dict(model, dict(sd) if rank == 0 or not bcast else {}, "cpu",
                                    strict=True, broadcast_from_rank0=bcast)
    local = model[0].weight.to_local()
    # torchtune's reference: quantise the full tensor, take this rank's dim-0 chunk
    coord = mesh.get_coordinate()[-1]
    ref = chunk(to_nf4(sd["0.weight"], 64, 8), [(mesh.size(-1), coord)])
    shard_ok = is_nf4(local) and torch.equal(dequantize(local), dequantize(ref))
    got = gather_cpu_state_dict(model, rank == 0)
    want = {k: dequantize(to_nf4(v, 64, 8)) if k.endswith("weight") else v for k, v in sd.items()}
    return shard_ok, tensor_diffs(got, {} if rank else want)


def _full_sd() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    sd = {}
    for i in range(2):
        sd[f"{i}.weight"] = torch.randn(32, 64, generator=gen).to(torch.bfloat16)
        sd[f"{i}.lora_a"] = torch.randn(4, 64, generator=gen)
    return sd


def test_nf4_1d(world):
    for bcast in (False, True):
        assert world(2).run(_nf4_round_trip, _full_sd(), "1d", bcast) == [(True, [])] * 2


def test_nf4_hsdp_2d_mesh(world):
    for bcast in (False, True):
        assert world(4).run(_nf4_round_trip, _full_sd(), "hsdp", bcast) == [(True, [])] * 4


def test_nf4_helpers_single_process():
    from fsdptk.nf4 import chunk, dequantize, from_inner_tensors, inner_tensors, nf4_block_sizes, quantize_like, to_nf4

    w = torch.randn(16, 64, dtype=torch.bfloat16)
    q = to_nf4(w, 64, 8)
    assert nf4_block_sizes(q) == (64, 8)
    assert torch.equal(dequantize(quantize_like(w.float(), q)), dequantize(q))
    halves = [chunk(q, [(2, i)]) for i in range(2)]
    assert torch.equal(torch.cat([dequantize(h) for h in halves]), dequantize(q))
    assert torch.equal(dequantize(from_inner_tensors(inner_tensors(q), q)), dequantize(q))
    try:
        chunk(q, [(3, 0)])
    except ValueError as e:
        assert "[16, 64]" in str(e) and "3" in str(e)
    else:
        raise AssertionError("an uneven NF4 split must be a ValueError")


def test_import_fsdptk_does_not_import_torchao():
    import subprocess
    import sys

    code = "import sys, fsdptk, fsdptk.state_dict, fsdptk._engine; print('torchao' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False" and out.stderr == ""
