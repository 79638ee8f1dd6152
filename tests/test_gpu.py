"""GPU-only checks (issue 15): CPU offload, bf16 mixed precision over NCCL, NCCL round trips, CUDA
memory. Every test here is marked ``gpu``: skipped with a reason where CUDA is not available, and
selected on a GPU machine by ``python -m pytest -m gpu`` (docs/testing.md, "GPU checks").

Each rank drives ``cuda:<rank>`` in a persistent :class:`fsdptk.testing.World` with an NCCL (or,
for CPU offload, ``cuda:nccl,cpu:gloo``) process group; the references are single-process fp32 runs
on CPU computed on every rank from the same seed.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fsdptk.testing import World

pytestmark = pytest.mark.gpu

_MAX_WORLD = 4


# ---------------------------------------------------------------------------------------------
# the model, data and reference (module level: they run on the ranks)


class _Net(nn.Module):
    """Embedding, residual MLP layers (the FSDP units), LayerNorm, head: every kind of shard."""

    def __init__(self, vocab: int, dim: int, hidden: int, n_layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim)) for _ in range(n_layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = h + layer(h)
        return self.head(self.norm(h))


_SMALL = {"vocab": 33, "dim": 12, "hidden": 20, "n_layers": 2}  # uneven shards at 2, 3 and 4 ranks
_B, _T = 2, 8  # per-rank batch


def _full_sd(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {k: v.detach().clone() for k, v in _Net(**cfg).state_dict().items()}


def _batch(cfg: dict, step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of a step (the same whatever steps were taken before: resumable)."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, cfg["vocab"], (world * _B, _T), generator=g)
    return x, torch.randint(0, cfg["vocab"], (world * _B, _T), generator=g)


def _loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


def _reference(cfg: dict, sd: dict, steps: int, world: int, opt_cls, lr: float) -> tuple[list[float], dict]:
    """fp32, one process, CPU, the full batch (the mean over ranks of equal slices)."""
    ref = _Net(**cfg)
    ref.load_state_dict(sd)
    opt = opt_cls(ref.parameters(), lr=lr)
    losses = []
    for s in range(steps):
        x, y = _batch(cfg, s, world)
        loss = _loss(ref(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in ref.state_dict().items()}


def _device() -> torch.device:
    return torch.device("cuda", dist.get_rank()) if torch.cuda.is_available() else torch.device("cpu")


def _meta_model(cfg: dict, *, cpu_offload: bool = False, mp_policy=None) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh

    from fsdptk import shard_model
    from fsdptk.predicates import layers

    with torch.device("meta"):
        model = _Net(**cfg)
    mesh = init_device_mesh(_device().type, (dist.get_world_size(),), mesh_dim_names=("dp_shard",))
    shard_model(model, [layers()], cpu_offload=cpu_offload, dp_mesh=mesh, mp_policy=mp_policy)
    return model


def _device_mismatches(tensors) -> list[str]:
    """Every DTensor must be where its local tensor is (the issue-15 invariant)."""
    from torch.distributed.tensor import DTensor

    return [f"{name}: DTensor on {t.device}, local tensor on {t.to_local().device}"
            for name, t in tensors if isinstance(t, DTensor) and t.device != t.to_local().device]


def _train(model: nn.Module, opt, cfg: dict, steps: range, world: int, device: torch.device) -> list[float]:
    """Steps of data-parallel training: rank r takes rows [r*B, (r+1)*B) of each global batch."""
    rank = dist.get_rank()
    losses = []
    for s in steps:
        xs, ys = (t[rank * _B:(rank + 1) * _B].to(device) for t in _batch(cfg, s, world))
        logits = model(xs)
        loss = _loss(logits, ys)
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().reshape(1).to(device)
        dist.all_reduce(mean)  # equal slices: the mean of the ranks' losses is the full-batch loss
        losses.append(mean.item() / world)
    return losses


def _gathered(model: nn.Module) -> dict[str, torch.Tensor]:
    from fsdptk import gather_cpu_state_dict

    return gather_cpu_state_dict(model, dist.get_rank() == 0)


# ---------------------------------------------------------------------------------------------
# worlds


@pytest.fixture(scope="module")
def gpu_world():
    """``gpu_world(n, backend)``: a persistent n-rank World on cuda:0..n-1 (skips if too few GPUs)."""
    worlds: dict[tuple[int, str], World] = {}

    def get(n: int, backend: str = "nccl") -> World:
        if torch.cuda.device_count() < n:
            pytest.skip(f"needs {n} GPUs, torch.cuda.device_count() is {torch.cuda.device_count()}")
        if (n, backend) not in worlds:
            worlds[(n, backend)] = World(n, backend=backend, timeout=300)
        return worlds[(n, backend)]

    yield get
    for w in worlds.values():
        w.close()


def _gpu_worlds() -> list[int]:
    return list(range(1, _MAX_WORLD + 1))


# ---------------------------------------------------------------------------------------------
# CPU offload: load (in-memory and safetensors), train, optimizer save / load, resume


def _offload_train(tmp: str, steps: int, more: int, lr: float) -> dict:
    from fsdptk import (
        get_full_optimizer_state_dict,
        load_from_full_model_state_dict,
        load_from_full_optimizer_state_dict,
        load_safetensors,
        save_safetensors,
    )

    rank, world, device = dist.get_rank(), dist.get_world_size(), _device()
    cfg = _SMALL
    sd = _full_sd(cfg, 0)
    model = _meta_model(cfg, cpu_offload=True)
    load_from_full_model_state_dict(model, dict(sd) if rank == 0 else {}, device, strict=True,
                                    cpu_offload=True, broadcast_from_rank0=True)
    bad = _device_mismatches(model.named_parameters())
    on_cpu = all(p.to_local().device.type == "cpu" for p in model.parameters())
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    losses = _train(model, opt, cfg, range(steps), world, device)  # FSDP2's lazy init runs here
    bad += _device_mismatches(model.named_parameters())

    # checkpoint: model as safetensors, optimizer as the full FQN-keyed state on rank 0
    save_safetensors(model, f"{tmp}/ckpt")
    osd = get_full_optimizer_state_dict(model, opt, rank == 0)
    resumed = _meta_model(cfg, cpu_offload=True)
    load_safetensors(resumed, f"{tmp}/ckpt", device=device, strict=True, cpu_offload=True)
    bad += _device_mismatches(resumed.named_parameters())
    opt2 = torch.optim.Adam(resumed.parameters(), lr=lr)
    load_from_full_optimizer_state_dict(resumed, opt2, osd if rank == 0 else {}, device,
                                        broadcast_from_rank0=True)
    state = [(f"state.{i}.{k}", v) for i, s in enumerate(opt2.state.values()) for k, v in s.items()
             if isinstance(v, torch.Tensor)]
    bad += _device_mismatches(state)
    state_on_cpu = all(getattr(v, "_local_tensor", v).device.type == "cpu" for _, v in state)

    cont = _train(model, opt, cfg, range(steps, steps + more), world, device)
    cont2 = _train(resumed, opt2, cfg, range(steps, steps + more), world, device)
    a, b = _gathered(model), _gathered(resumed)
    bad += _device_mismatches(resumed.named_parameters())
    return {"bad": bad, "on_cpu": on_cpu, "state_on_cpu": state_on_cpu, "n_state": len(state),
            "losses": losses + cont, "resumed_losses": cont2, "full": a,
            "identical": rank != 0 or (list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a))}


def test_cpu_offload_trains_like_one_process_and_resumes_bit_identically(gpu_world, tmp_path) -> None:
    n = min(2, torch.cuda.device_count())
    steps, more, lr = 3, 2, 1e-2
    res = gpu_world(n, "cuda:nccl,cpu:gloo").run(_offload_train, str(tmp_path), steps, more, lr)
    for r, out in enumerate(res):
        assert out["bad"] == [], f"rank {r}: {out['bad']}"
        assert out["on_cpu"] and out["state_on_cpu"] and out["n_state"] > 0, r
        assert out["resumed_losses"] == out["losses"][steps:], r  # resume is bit-identical
    assert res[0]["identical"]
    losses, ref = _reference(_SMALL, _full_sd(_SMALL, 0), steps + more, n, torch.optim.Adam, lr)
    torch.testing.assert_close(res[0]["losses"], losses, atol=1e-4, rtol=1e-4)
    for k, v in ref.items():
        torch.testing.assert_close(res[0]["full"][k], v, atol=1e-4, rtol=1e-4, msg=k)


# ---------------------------------------------------------------------------------------------
# bf16 mixed precision over NCCL against the fp32 single-process reference


def _bf16_train(steps: int, lr: float) -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from fsdptk import load_from_full_model_state_dict

    device = _device()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = _meta_model(_SMALL, mp_policy=mp)
    load_from_full_model_state_dict(model, _full_sd(_SMALL, 0), device, strict=True)
    bad = _device_mismatches(model.named_parameters())
    x = torch.zeros(1, _T, dtype=torch.long, device=device)
    with torch.no_grad():
        compute_dtype = model(x).dtype
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = _train(model, opt, _SMALL, range(steps), dist.get_world_size(), device)
    return {"bad": bad, "compute_dtype": compute_dtype, "losses": losses, "full": _gathered(model),
            "param_dtype": {str(p.dtype) for p in model.parameters()}}


def test_bf16_mixed_precision_over_nccl_matches_fp32_reference(gpu_world) -> None:
    n = min(2, torch.cuda.device_count())
    steps, lr = 4, 0.5
    res = gpu_world(n).run(_bf16_train, steps, lr)
    for r, out in enumerate(res):
        assert out["bad"] == [], f"rank {r}: {out['bad']}"
        # the forward ran in bf16 (not a vacuous comparison) while the sharded params stay fp32
        assert out["compute_dtype"] == torch.bfloat16 and out["param_dtype"] == {"torch.float32"}, r
    sd = _full_sd(_SMALL, 0)
    losses, ref = _reference(_SMALL, sd, steps, n, torch.optim.SGD, lr)
    # tolerances: bf16 compute vs fp32 (the same rank functions on CPU/gloo differ by <= 7e-4)
    torch.testing.assert_close(res[0]["losses"], losses, atol=0, rtol=5e-3)
    moved = max(float((ref[k] - sd[k]).abs().max()) for k in ref)
    assert moved > 0.05, f"the reference barely trained (max change {moved}); the check would be vacuous"
    for k, v in ref.items():
        torch.testing.assert_close(res[0]["full"][k], v, atol=3e-3, rtol=1e-2, msg=k)


# ---------------------------------------------------------------------------------------------
# NCCL round trips at every world size the machine allows


def _round_trip(tmp: str) -> dict:
    from fsdptk import load_from_full_model_state_dict, load_safetensors, save_safetensors

    rank, device = dist.get_rank(), _device()
    sd = _full_sd(_SMALL, 7)
    out: dict = {"bad": [], "equal": {}}
    for how in ("every_rank", "rank0"):
        model = _meta_model(_SMALL)
        src = dict(sd) if how == "every_rank" or rank == 0 else {}
        load_from_full_model_state_dict(model, src, device, strict=True, broadcast_from_rank0=how == "rank0")
        out["bad"] += _device_mismatches(model.named_parameters())
        out["bad"] += [f"{n}: local on {p.to_local().device}" for n, p in model.named_parameters()
                       if p.to_local().device != device]
        got = _gathered(model)
        out["equal"][f"load_{how}+gather"] = rank != 0 or _same(got, sd)
        if how == "rank0":
            save_safetensors(model, f"{tmp}/ckpt")
            if rank == 0:
                from safetensors.torch import load_file

                out["equal"]["save_safetensors"] = _same(load_file(f"{tmp}/ckpt/model.safetensors"), sd)
            dist.barrier()
    for shard_on_read in (True, False):
        model = _meta_model(_SMALL)
        load_safetensors(model, f"{tmp}/ckpt", device=device, strict=True, shard_on_read=shard_on_read)
        out["bad"] += _device_mismatches(model.named_parameters())
        got = _gathered(model)  # a collective: every rank calls it
        out["equal"][f"load_safetensors(shard_on_read={shard_on_read})"] = rank != 0 or _same(got, sd)
    return out


def _same(got: dict, want: dict) -> bool:
    return sorted(got) == sorted(want) and all(
        got[k].dtype == want[k].dtype and got[k].device.type == "cpu" and torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("n", _gpu_worlds())
def test_nccl_load_gather_save_round_trips(gpu_world, tmp_path, n: int) -> None:
    res = gpu_world(n).run(_round_trip, str(tmp_path))
    for r, out in enumerate(res):
        assert out["bad"] == [], f"rank {r}: {out['bad']}"
        assert out["equal"] and all(out["equal"].values()), f"rank {r}: {out['equal']}"
    assert "save_safetensors" in res[0]["equal"]


# ---------------------------------------------------------------------------------------------
# CUDA peak memory per rank: a broadcast_from_rank0 load holds its shards + at most one bucket


_BIG = {"vocab": 480, "dim": 240, "hidden": 960, "n_layers": 4}  # ~8 MB fp32; rows divide by 2, 3, 4


def _load_peak(bucket_bytes: int) -> dict:
    from fsdptk import load_from_full_model_state_dict

    rank, device = dist.get_rank(), _device()
    sd = _full_sd(_BIG, 3) if rank == 0 else {}  # host memory: the full state never goes to a GPU whole
    model = _meta_model(_BIG)
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    load_from_full_model_state_dict(model, sd, device, strict=True, broadcast_from_rank0=True,
                                    bucket_bytes=bucket_bytes)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    shards = sum(p.to_local().nbytes for p in model.parameters())
    total = sum(v.nbytes for v in sd.values())
    return {"peak": peak, "shard_bytes": shards, "full_bytes": total,
            "bad": _device_mismatches(model.named_parameters())}


def test_cuda_peak_memory_of_a_rank0_load_is_shards_plus_one_bucket(gpu_world) -> None:
    n = min(torch.cuda.device_count(), _MAX_WORLD)
    if n < 2:
        pytest.skip(f"needs 2 GPUs (a sender and a receiver), torch.cuda.device_count() is {n}")
    bucket = 1 << 20
    res = gpu_world(n).run(_load_peak, bucket)
    full = res[0]["full_bytes"]
    assert full > 6 * bucket  # many buckets, else the bound says nothing
    for r, out in enumerate(res):
        assert out["bad"] == [], f"rank {r}: {out['bad']}"
    table = [(r, out["peak"], out["shard_bytes"]) for r, out in enumerate(res)]
    for r, peak, shards in table[1:]:
        assert peak <= shards + bucket, f"rank {r}: CUDA peak {peak} > shards {shards} + bucket {bucket}; {table}"


# ---------------------------------------------------------------------------------------------
# point-to-point order on NCCL (docs/architecture.md, "Point-to-point order"): ranks that both send
# and receive in one bucket, with every message larger than NCCL's buffers (4 MiB by default), must
# not block each other. Without one batch per bucket, two ranks that each post "send to the other"
# first hang here (the test then fails at its timeout).

_LARGE = (4096, 4096)  # fp32: 64 MiB per tensor, at least 16 MiB per shard at 4 ranks
_P2P_TIMEOUT = 240


def _nccl_worlds() -> list[int]:
    return list(range(2, _MAX_WORLD + 1))


def _collect_to_alternating(shape: tuple[int, int], n_items: int) -> dict:
    """``collect`` of ``Shard(0)`` DTensors with each item's destination alternately rank 0 and 1:
    both ranks send to and receive from each other in every bucket."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from fsdptk._engine import collect

    rank, device = dist.get_rank(), _device()
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    gen = torch.Generator().manual_seed(11)
    fulls = {f"t{i}": torch.randn(shape, generator=gen) for i in range(n_items)}
    items = [(k, distribute_tensor(v.to(device), mesh, [Shard(0)], src_data_rank=None)) for k, v in fulls.items()]
    dests = [i % 2 for i in range(n_items)]
    got = {k: v for b in collect(items, dest=dests) for k, v in b}
    want = [k for k, d in zip(fulls, dests) if d == rank]
    return {"keys": sorted(got) == sorted(want), "equal": all(torch.equal(got[k], fulls[k]) for k in want)}


@pytest.mark.parametrize("n", _nccl_worlds())
def test_nccl_collect_to_per_item_destinations_with_large_messages(gpu_world, n: int) -> None:
    res = gpu_world(n).run(_collect_to_alternating, _LARGE, 4, timeout=_P2P_TIMEOUT)
    assert res == [{"keys": True, "equal": True}] * n, res


def _saved_equals(path: str, want: dict[str, torch.Tensor]) -> bool:
    """Every tensor of the checkpoint directory (read on this rank) equals ``want``."""
    from pathlib import Path

    from safetensors.torch import load_file

    got: dict[str, torch.Tensor] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        got.update(load_file(str(f)))
    return sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)


def _save_with_two_writers(tmp: str, shape: tuple[int, int], n_layers: int) -> dict:
    """A model of large Linear layers, FSDP-sharded, saved with ``writers=2`` in one file per
    tensor: each writer gathers its files' tensors from the others, so both writers send and
    receive in every bucket."""
    from pathlib import Path

    from torch.distributed.device_mesh import init_device_mesh

    from fsdptk import load_from_full_model_state_dict, save_safetensors, shard_model
    from fsdptk.predicates import by_type

    rank, device = dist.get_rank(), _device()
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(shape[1], shape[0], bias=False) for _ in range(n_layers)])
    mesh = init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("dp_shard",))
    shard_model(model, [by_type(nn.Linear)], cpu_offload=False, dp_mesh=mesh)
    gen = torch.Generator().manual_seed(3)
    sd = {f"{i}.weight": torch.randn(shape, generator=gen) for i in range(n_layers)}
    load_from_full_model_state_dict(model, dict(sd), device, strict=True)
    nbytes = shape[0] * shape[1] * 4
    save_safetensors(model, f"{tmp}/ckpt", writers=2, max_shard_size=nbytes + 1024, write_config=False)
    dist.barrier()
    files = len(list(Path(f"{tmp}/ckpt").glob("*.safetensors")))
    return {"files": files, "equal": rank != 0 or _saved_equals(f"{tmp}/ckpt", sd)}


@pytest.mark.parametrize("n", _nccl_worlds())
def test_nccl_save_with_two_writers_and_large_messages(gpu_world, tmp_path, n: int) -> None:
    res = gpu_world(n).run(_save_with_two_writers, str(tmp_path), _LARGE, 4, timeout=_P2P_TIMEOUT)
    assert all(r["equal"] for r in res), res
    assert res[0]["files"] == 4, res  # one file per tensor: the writers share them


class _Experts(nn.Module):
    """Fused expert weights ``[experts, ...]`` (what :func:`fsdptk.apply_ep` shards over ``ep``)."""

    def __init__(self, experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(experts, dim, 2 * hidden))
        self.down_proj = nn.Parameter(torch.empty(experts, hidden, dim))


class _MoELayer(nn.Module):
    """A dense projection beside an experts module (no forward: saved, not run)."""

    def __init__(self, experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim, bias=False)
        self.experts = _Experts(experts, dim, hidden)


class _MoE(nn.Module):
    """Layers of :class:`_MoELayer` (the FSDP units)."""

    def __init__(self, n_layers: int, experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_MoELayer(experts, dim, hidden) for _ in range(n_layers))


def _ep_save(tmp: str, n_layers: int, experts_n: int, dim: int, hidden: int) -> dict:
    """Expert parallelism (``ep=2`` over ``dp_shard=world``): experts ``Shard(0)`` over ``ep``,
    saved with ``writers=2``, one file per tensor, and gathered to rank 0."""
    from torch.distributed.tensor import Shard

    from fsdptk import (
        ParallelDims,
        apply_ep,
        gather_cpu_state_dict,
        load_from_full_model_state_dict,
        save_safetensors,
        shard_model,
    )
    from fsdptk.predicates import layers

    rank, world, device = dist.get_rank(), dist.get_world_size(), _device()
    dims = ParallelDims(dp_shard=world, ep=2)
    dims.build_mesh(device.type)
    with torch.device("meta"):
        model = _MoE(n_layers, experts_n, dim, hidden)
    apply_ep(model, dims.ep_mesh, lambda name, m: isinstance(m, _Experts))
    shard_model(model, [layers()], cpu_offload=False, dp_mesh=dims.fsdp_mesh, expert_dp_mesh=dims.expert_fsdp_mesh)
    gen = torch.Generator().manual_seed(5)
    sd = {k: torch.randn(v.shape, generator=gen) for k, v in model.state_dict().items()}
    load_from_full_model_state_dict(model, dict(sd), device, strict=True)
    experts = [p for n, p in model.named_parameters() if ".experts." in n]
    ep_sharded = len(experts) == 2 * n_layers and all(
        p.placements[p.device_mesh.mesh_dim_names.index("ep")] == Shard(0) for p in experts)
    biggest = max(v.numel() * v.element_size() for v in sd.values())
    save_safetensors(model, f"{tmp}/ep", writers=2, max_shard_size=biggest + 1024, write_config=False)
    dist.barrier()
    full = gather_cpu_state_dict(model, rank == 0)
    return {"ep_sharded": ep_sharded, "saved": rank != 0 or _saved_equals(f"{tmp}/ep", sd),
            "gathered": rank != 0 or (sorted(full) == sorted(sd) and all(torch.equal(full[k], sd[k]) for k in sd))}


@pytest.mark.parametrize("n", [m for m in _nccl_worlds() if m % 2 == 0])
def test_nccl_expert_parallel_save_with_two_writers_and_large_messages(gpu_world, tmp_path, n: int) -> None:
    """Experts of 64 MiB (``gate_up_proj``: 4 experts x 1024 x 4096 fp32), ``ep=2``."""
    res = gpu_world(n).run(_ep_save, str(tmp_path), 2, 4, 1024, 2048, timeout=_P2P_TIMEOUT)
    assert res == [{"ep_sharded": True, "saved": True, "gathered": True}] * n, res


# ---------------------------------------------------------------------------------------------
# weights out to an inference engine over NCCL (issue 41): fsdptk.hf.weight_source on CUDA shards


def _fp8_rule(name: str, t: torch.Tensor) -> bool:
    return name.startswith("layers.") and t.dim() == 2


_STREAMS = {  # the kinds of stream an RL trainer pushes: bf16 rollouts and an FP8 release
    "bf16": {"dtype": torch.bfloat16},
    "fp8": {"dtype": torch.bfloat16, "quantize": "fp8", "block_size": (16, 16), "quantize_if": _fp8_rule},
}


def _raw(t: torch.Tensor) -> tuple[str, tuple[int, ...], torch.Tensor]:
    """A tensor as its dtype, shape and bytes (float8 tensors do not cross a process boundary on
    every torch: the World's result pickles them through a storage that has no dtype)."""
    return str(t.dtype), tuple(t.shape), t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().clone()


def _reference_streams(sd: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """The same streams from the unsharded model on the CPU, in one process (no process group):
    what the CPU tests check against vLLM's own classes and ``per_block_cast_to_fp8``."""
    from fsdptk.hf import weight_source

    plain = _Net(**_BIG)
    plain.load_state_dict(sd)
    return {kind: {name: _raw(t) for name, t in weight_source(plain, conversion=None, **kw).iter_full()}
            for kind, kw in _STREAMS.items()}


def _weight_stream(bucket_bytes: int) -> dict:
    """Every owner mode and stream kind from CUDA shards over NCCL: what each rank yields, where its
    tensors are, and the CUDA memory the pass took beyond the shards; then two passes with
    ``keep_buffers`` around SGD steps, each against the model's gathered weights."""
    from fsdptk import load_from_full_model_state_dict
    from fsdptk.hf import weight_source

    rank, world, device = dist.get_rank(), dist.get_world_size(), _device()
    sd = _full_sd(_BIG, 5)
    model = _meta_model(_BIG)
    load_from_full_model_state_dict(model, dict(sd), device, strict=True)
    out: dict = {"got": {}, "owned": {}, "devices": set(), "peak": {}, "bad": []}
    for owners in sorted({1, world}) + ["all"]:
        for kind, kw in _STREAMS.items():
            source = weight_source(model, conversion=None, owners=owners, bucket_bytes=bucket_bytes, **kw)
            torch.cuda.synchronize(device)
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            got = {}
            for name, t in source.iter_full():
                out["devices"].add(t.device.type)
                got[name] = _raw(t)
            torch.cuda.synchronize(device)
            out["peak"][f"{owners}/{kind}"] = torch.cuda.max_memory_allocated(device) - base
            out["got"][f"{owners}/{kind}"] = got
            out["owned"][f"{owners}/{kind}"] = source.owned_names(rank)
    # two passes of one reused source around training steps: each reads the current weights
    source = weight_source(model, conversion=None, owners=1, bucket_bytes=bucket_bytes, dtype=torch.bfloat16,
                           keep_buffers=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out["passes"] = []
    for s in range(2):
        _train(model, opt, _BIG, range(s, s + 1), world, device)
        streamed = {name: t.clone() for name, t in source.iter_full()}
        full = _gathered(model)
        out["passes"].append(rank != 0 or (sorted(streamed) == sorted(full) and all(
            torch.equal(streamed[k], full[k].to(torch.bfloat16)) for k in full)))
    out["bad"] += _device_mismatches(model.named_parameters())
    return out


@pytest.mark.parametrize("n", _gpu_worlds())
def test_nccl_weight_source_streams_what_the_unsharded_cpu_model_streams(gpu_world, n: int) -> None:
    """bf16 and FP8 streams from CUDA shards over NCCL, owners 1, W and "all": every rank yields
    its owned names as CPU tensors, bit for bit the single-process CPU stream of the same weights
    (quantized on the GPU's gathered tensors or not, the same bytes), every name once (owners 1
    and W) or on every rank ("all"); the CUDA memory a pass takes beyond the shards stays within
    two buckets and the largest tensor; a kept source streams the current weights after each step."""
    bucket = 1 << 20
    res = gpu_world(n).run(_weight_stream, bucket, timeout=_P2P_TIMEOUT)
    ref = _reference_streams(_full_sd(_BIG, 5))
    largest = max(t.numel() * 4 for t in _full_sd(_BIG, 5).values())
    for key in res[0]["got"]:
        owners, kind = key.split("/")
        want = ref[kind]
        owned = [r["owned"][key] for r in res]
        if owners == "all":
            assert all(o == list(want) for o in owned), (key, owned)
        else:
            assert sorted(name for o in owned for name in o) == sorted(want), (key, owned)  # every name, once
        for r, out in enumerate(res):
            got = out["got"][key]
            assert list(got) == out["owned"][key], (key, r, list(got))
            diff = [k for k in got if got[k][:2] != want[k][:2] or not torch.equal(got[k][2], want[k][2])]
            assert diff == [], f"{key} rank {r}: not the CPU stream's bytes: {diff}"
            assert out["peak"][key] <= 2 * bucket + largest, (key, r, out["peak"][key])
    assert any(d == str(torch.float8_e4m3fn) for d, _, _ in ref["fp8"].values())  # the rule chose weights
    assert any(d == str(torch.float8_e4m3fn) for d, _, _ in res[0]["got"]["1/fp8"].values())
    for r, out in enumerate(res):
        assert out["devices"] == {"cpu"}, (r, out["devices"])
        assert out["passes"] == [True, True], (r, out["passes"])
        assert out["bad"] == [], (r, out["bad"])
