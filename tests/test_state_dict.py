"""load_from_full_model_state_dict / gather_cpu_state_dict on real gloo worlds (2 and 4 ranks)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from _compare import tensor_diffs
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from fsdptk.testing import RemoteError
from fsdptk.testing.strategies import build_module, module_names, module_specs, random_state_dict

from _counting import counted

# ---------------------------------------------------------------------------------------------
# helpers run on every rank


def _mesh(layout: str):
    from torch.distributed.device_mesh import init_device_mesh

    if layout == "hsdp":
        return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    return init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp_shard",))


def _shard(model: nn.Module, names: list[str], layout: str) -> None:
    from torch.distributed.fsdp import fully_shard

    mesh = _mesh(layout)
    modules = dict(model.named_modules())
    for name in sorted(names, key=lambda n: -n.count(".")):  # bottom-up
        if not isinstance(modules[name], nn.ModuleList):  # FSDP2 needs a forward
            fully_shard(modules[name], mesh=mesh)
    fully_shard(model, mesh=mesh)


def _round_trip(spec, seed, names, layout, bcast, on_meta, bucket):
    from fsdptk import gather_cpu_state_dict, load_from_full_model_state_dict

    rank = dist.get_rank()
    sd = random_state_dict(spec, seed)
    model = build_module(spec, "meta" if on_meta else "cpu")
    _shard(model, names, layout)
    full = dict(sd) if (rank == 0 or not bcast) else {}
    given = sorted(full)
    res = load_from_full_model_state_dict(model, full, "cpu", strict=True,
                                          broadcast_from_rank0=bcast, bucket_bytes=bucket)
    released = sorted(full) == given and all(v.is_meta for v in full.values())  # keys kept
    ref = build_module(spec, "cpu")  # non-persistent buffers as the module's own hook makes them
    bufs = dict(model.named_buffers())
    buf_diffs = tensor_diffs({k: bufs[k] for k, _ in ref.named_buffers() if k not in sd},
                             {k: b for k, b in ref.named_buffers() if k not in sd})  # non-persistent ones
    tied_ok = not spec["tied"] or model.head.weight is model.embed.weight
    got = gather_cpu_state_dict(model, rank == 0, bucket_bytes=bucket)
    diffs = tensor_diffs(got, sd if rank == 0 else {}, order=True)
    return (diffs, buf_diffs, tied_ok, released, list(res.missing_keys))


@st.composite
def _cases(draw, world_size: int):
    spec = draw(module_specs())
    names = [n for n in module_names(spec) if n.startswith("body") and n != ""]
    chosen = draw(st.lists(st.sampled_from(names), unique=True, max_size=3)) if names else []
    layout = draw(st.sampled_from(["1d", "hsdp"] if world_size == 4 else ["1d"]))
    return spec, chosen, layout


@settings(max_examples=12, deadline=None)
@given(case=_cases(2), seed=st.integers(0, 2**16), bcast=st.booleans(), on_meta=st.booleans(),
       bucket=st.sampled_from([64, 1 << 20]))
def test_round_trip_2_ranks(world, case, seed, bcast, on_meta, bucket):
    spec, names, layout = case
    out = world(2).run(_round_trip, spec, seed, names, layout, bcast, on_meta, bucket)
    assert out == [([], [], True, True, [])] * 2


@settings(max_examples=12, deadline=None)
@given(case=_cases(4), seed=st.integers(0, 2**16), bcast=st.booleans(), on_meta=st.booleans(),
       bucket=st.sampled_from([64, 1 << 20]))
def test_round_trip_4_ranks(world, case, seed, bcast, on_meta, bucket):
    spec, names, layout = case
    out = world(4).run(_round_trip, spec, seed, names, layout, bcast, on_meta, bucket)
    assert out == [([], [], True, True, [])] * 4


# ---------------------------------------------------------------------------------------------
# FSDP + TP (Shard(0)/Shard(1) on a 2-D mesh; FSDP on top of TP gives _StridedShard)


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(6, 10)
        self.down = nn.Linear(10, 6)
        self.norm = nn.LayerNorm(6)


def _tp_round_trip(seed, bcast):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.distributed.tensor.placement_types import _StridedShard

    from fsdptk import gather_cpu_state_dict, load_from_full_model_state_dict

    torch.manual_seed(seed)
    sd = _MLP().state_dict()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    with torch.device("meta"):
        model = _MLP()
    parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    placements = {k: tuple(v.placements) for k, v in model.state_dict().items()}
    rank = dist.get_rank()
    load_from_full_model_state_dict(model, dict(sd) if rank == 0 or not bcast else {}, "cpu",
                                    strict=True, broadcast_from_rank0=bcast)
    got = gather_cpu_state_dict(model, rank == 0)
    strided = any(isinstance(p, _StridedShard) for ps in placements.values() for p in ps)
    return tensor_diffs(got, sd if rank == 0 else {}, order=True), strided


def test_fsdp_tp_round_trip(world):
    for bcast in (False, True):
        assert world(4).run(_tp_round_trip, 3, bcast) == [([], True)] * 4


# ---------------------------------------------------------------------------------------------
# meta-built model with tied embeddings and a RoPE-style non-persistent buffer, trained 3 steps


class _Rope(nn.Module):
    def __init__(self, dim: int, seq: int) -> None:
        super().__init__()
        self.dim, self.seq = dim, seq
        self.register_buffer("cache", torch.empty(seq, dim), persistent=False)
        if not self.cache.is_meta:
            self.rope_init()

    def rope_init(self) -> None:  # torchtune's hook name
        theta = 1.0 / (10000 ** (torch.arange(0, self.dim, 2).float() / self.dim))
        ang = torch.outer(torch.arange(self.seq).float(), theta)
        self.register_buffer("cache", torch.cat([ang.cos(), ang.sin()], dim=-1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.cache[: x.shape[1]]


class _TinyLM(nn.Module):
    def __init__(self, vocab: int = 11, dim: int = 8, seq: int = 5) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.rope = _Rope(dim, seq)
        self.layers = nn.ModuleList([nn.Linear(dim, dim) for _ in range(2)])
        self.norm = nn.RMSNorm(dim)
        self.out = nn.Linear(dim, vocab, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, tok: torch.Tensor) -> torch.Tensor:
        h = self.rope(self.embed(tok))
        for layer in self.layers:
            h = h + torch.tanh(layer(h))
        return self.out(self.norm(h))


def _train(model: nn.Module, steps: int = 3) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(7)
    losses = []
    for _ in range(steps):
        tok = torch.randint(0, 11, (4, 5), generator=gen)
        loss = nn.functional.cross_entropy(model(tok).flatten(0, 1).float(), tok.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _meta_train(sd, bcast):
    from torch.distributed.fsdp import fully_shard

    from fsdptk import load_from_full_model_state_dict, validate_no_params_on_meta_device

    with torch.device("meta"):
        model = _TinyLM()
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    rank = dist.get_rank()
    load_from_full_model_state_dict(model, dict(sd) if rank == 0 or not bcast else {}, "cpu",
                                    strict=True, broadcast_from_rank0=bcast)
    validate_no_params_on_meta_device(model)
    tied = model.out.weight is model.embed.weight
    return tied, _train(model)


def test_meta_model_trains_like_single_process(world):
    torch.manual_seed(0)
    ref = _TinyLM()
    sd = {k: v.clone() for k, v in ref.state_dict().items()}
    expected = _train(ref)
    for bcast in (False, True):
        for tied, losses in world(2).run(_meta_train, sd, bcast):
            assert tied
            assert torch.allclose(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# bad input: the same error on every rank, no hang, model untouched


class _WithIntBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 4)
        self.register_buffer("count", torch.zeros(2, dtype=torch.int64))


def _bad_load(kind, bcast, strict):
    from torch.distributed.fsdp import fully_shard

    from fsdptk import load_from_full_model_state_dict

    torch.manual_seed(0)
    model = _WithIntBuffer()
    fully_shard(model)
    before = {k: v.full_tensor() if hasattr(v, "full_tensor") else v.clone()
              for k, v in model.state_dict().items()}
    sd = {"lin.weight": torch.randn(4, 3), "lin.bias": torch.randn(4), "count": torch.ones(2, dtype=torch.int64)}
    if kind == "missing":
        del sd["lin.bias"]
    elif kind == "unexpected":
        sd["extra.weight"] = torch.ones(1)
    elif kind == "shape":
        sd["lin.weight"] = torch.randn(3, 4)
    elif kind == "float_into_int":
        sd["count"] = torch.ones(2)
    elif kind == "non_tensor":
        sd["lin.bias"] = [0.0] * 4
    rank = dist.get_rank()
    try:
        res = load_from_full_model_state_dict(model, sd if rank == 0 or not bcast else {}, "cpu",
                                              strict=strict, broadcast_from_rank0=bcast)
    except Exception as e:  # noqa: BLE001 - the test inspects it
        after = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
        untouched = all(torch.equal(after[k], v) for k, v in before.items())
        return type(e).__name__, str(e), untouched
    return "ok", (list(res.missing_keys), list(res.unexpected_keys)), True


def test_bad_input_errors_on_every_rank(world):
    cases = {
        "shape": ("ValueError", ["'lin.weight'", "[3, 4]", "[4, 3]"]),
        "float_into_int": ("ValueError", ["'count'", "torch.float32", "torch.int64"]),
        "non_tensor": ("TypeError", ["'lin.bias'", "list"]),
    }
    for bcast in (False, True):
        for kind, (exc, words) in cases.items():
            out = world(2).run(_bad_load, kind, bcast, False)
            for name, msg, untouched in out:
                assert name == exc, (kind, bcast, out)
                assert all(w in msg for w in words), (kind, msg)
                assert untouched
        assert world(2).run(_bad_load, "missing", bcast, False) == [("ok", (["lin.bias"], []), True)] * 2
        assert world(2).run(_bad_load, "unexpected", bcast, False) == [("ok", ([], ["extra.weight"]), True)] * 2
        for kind, key in (("missing", "lin.bias"), ("unexpected", "extra.weight")):
            for name, msg, untouched in world(2).run(_bad_load, kind, bcast, True):
                assert name == "StateDictMismatchError" and key in msg and untouched  # a RuntimeError


def _sources_differ():
    from fsdptk import load_from_full_model_state_dict

    model = nn.Linear(2, 2)
    sd = {"weight": torch.zeros(2, 2), "bias": torch.zeros(2)}
    if dist.get_rank() == 1:
        sd["bias"] = torch.zeros(3)
    load_from_full_model_state_dict(model, sd, "cpu")


def test_shape_error_on_one_rank_is_raised_on_all(world):
    try:
        world(2).run(_sources_differ)
    except RemoteError as e:
        for r in e.per_rank:
            assert isinstance(r, RemoteError) and r.exc_type == "ValueError"
            assert "rank 1: 'bias': shape mismatch" in r.message and "[3]" in r.message
    else:
        raise AssertionError("expected an error")


def _release(release):
    from fsdptk import load_from_full_model_state_dict

    model = nn.Linear(2, 3)
    sd = {"weight": torch.ones(3, 2), "bias": torch.ones(3)}
    keep = {k: v.clone() for k, v in sd.items()}
    load_from_full_model_state_dict(model, sd, "cpu", release_sd=release)
    model.weight.data.add_(1)  # the model must not share memory with the caller's tensors
    if release:  # torchtune's contract: memory freed (meta values), keys kept
        return sorted(sd), all(sd[k].is_meta and sd[k].shape == keep[k].shape for k in sd)
    return sorted(sd), all(torch.equal(sd[k], keep[k]) for k in sd)


def test_release_sd(world):
    assert world(2).run(_release, False) == [(["bias", "weight"], True)] * 2
    assert world(2).run(_release, True) == [(["bias", "weight"], True)] * 2


def _adapters():
    from torch.distributed.fsdp import fully_shard

    from fsdptk import gather_cpu_state_dict

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    model[0].weight.requires_grad_(False)
    model[0].bias.requires_grad_(False)
    full = {k: v.clone() for k, v in model.state_dict().items()}
    fully_shard(model)
    got = gather_cpu_state_dict(model, dist.get_rank() == 0, adapter_weights_only=True)
    by_name = gather_cpu_state_dict(model, dist.get_rank() == 0, adapter_weights_only=True,
                                    is_adapter=lambda fqn, _: fqn.endswith("bias"))
    return {k: torch.equal(v, full[k]) for k, v in got.items()}, sorted(by_name)


def test_adapter_weights_only(world):
    out = world(2).run(_adapters)
    assert out[0] == ({"1.weight": True, "1.bias": True}, ["0.bias", "1.bias"])
    assert out[1] == ({}, [])


# ---------------------------------------------------------------------------------------------
# CPU offload: a loaded DTensor is where its local tensor is (issue 15)


def _offload_model(mesh_type: str) -> nn.Module:
    """Linear(3, 5) + Linear(5, 2) on ``meta``, parameters as dim-0 sharded DTensors on a mesh of
    ``mesh_type``; a "cuda" mesh can be built on a CPU-only torch (no CUDA call happens), so the
    loaders' device handling for a GPU mesh is checked here too."""
    import os

    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    local_rank = os.environ.pop("LOCAL_RANK", None)  # else DeviceMesh calls torch.cuda.set_device
    try:
        mesh = DeviceMesh(mesh_type, torch.arange(dist.get_world_size()))
    finally:
        if local_rank is not None:
            os.environ["LOCAL_RANK"] = local_rank
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 2, bias=False))
    for mod in model:
        for name, p in list(mod.named_parameters(recurse=False)):
            local = torch.chunk(torch.empty(p.shape, device="meta"), dist.get_world_size())[dist.get_rank()]
            d = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=p.shape, stride=p.stride())
            mod.register_parameter(name, nn.Parameter(d))
    return model


def _offload_load(mesh_type: str, cpu_offload: bool, how: str, tmp: str):
    from fsdptk import gather_cpu_state_dict, load_from_full_model_state_dict, load_safetensors

    rank = dist.get_rank()
    torch.manual_seed(0)
    full = {"0.weight": torch.randn(5, 3), "0.bias": torch.randn(5), "1.weight": torch.randn(2, 5)}
    model = _offload_model(mesh_type)
    if how == "file":
        if rank == 0:
            from safetensors.torch import save_file

            save_file(full, f"{tmp}/model.safetensors")
        dist.barrier()
        load_safetensors(model, tmp, device="cpu", strict=True, cpu_offload=cpu_offload)
    else:
        sd = dict(full) if rank == 0 or how == "local" else {}
        load_from_full_model_state_dict(model, sd, "cpu", strict=True, cpu_offload=cpu_offload,
                                        broadcast_from_rank0=how == "bcast")
    devices = {n: (str(p.device), str(p.to_local().device), type(p).__name__, p.device_mesh.device_type)
               for n, p in model.named_parameters()}
    got = gather_cpu_state_dict(model, rank == 0)
    same = rank != 0 or (list(got) == list(full) and all(torch.equal(got[k], v) for k, v in full.items()))
    return devices, same


def test_loaded_dtensor_device_matches_its_local_tensor(world, tmp_path):
    # Regression: DTensor.from_local moved a CPU-offloaded shard to the mesh's device type, and
    # FSDP2 then copied it back into pinned CPU memory: .device said cuda, .to_local() was on CPU,
    # and FSDP2's lazy init refused ("FSDP parameters should be materialized on CPU ...").
    # On a CPU-only torch the old code failed outright on a cuda mesh ("not compiled with CUDA").
    w = world(2)
    for mesh_type, cpu_offload, how in [("cpu", False, "local"), ("cpu", True, "bcast"),
                                        ("cuda", True, "local"), ("cuda", True, "bcast"),
                                        ("cuda", True, "file")]:
        for devices, same in w.run(_offload_load, mesh_type, cpu_offload, how, str(tmp_path)):
            assert same, (mesh_type, cpu_offload, how)
            assert set(devices) == {"0.weight", "0.bias", "1.weight"}
            for name, (dev, local_dev, kind, mesh_dev) in devices.items():
                assert (kind, mesh_dev) == ("DTensor", mesh_type), (name, mesh_type, how)
                assert dev == local_dev == "cpu", (name, mesh_type, cpu_offload, how, dev, local_dev)


# ---------------------------------------------------------------------------------------------
# fixed costs (issue 14, point 1): every pre-flight check of a call rides in its ONE metadata
# exchange, so the only collectives before the first byte moves are that exchange and the first
# bucket's status agreement

_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object", "broadcast", "broadcast_object_list", "barrier",
                "gather", "gather_object", "scatter", "scatter_object_list", "reduce", "all_to_all")
_P2P = ("isend", "irecv", "send", "recv")


def _calls_before_data(op: str):
    """The torch.distributed calls fsdptk makes before its first point-to-point transfer, and the
    total number of collectives of the call (real calls, counted on the way through)."""
    from torch.distributed.fsdp import fully_shard

    from fsdptk import gather_cpu_state_dict, load_from_full_model_state_dict

    rank = dist.get_rank()
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256))
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    load_from_full_model_state_dict(model, ref.state_dict(), "cpu")
    with counted(_COLLECTIVES + _P2P) as calls:
        if op == "load":
            load_from_full_model_state_dict(model, ref.state_dict() if rank == 0 else {}, "cpu",
                                            broadcast_from_rank0=True)
        else:
            got = gather_cpu_state_dict(model, rank == 0)
    if op == "load":
        ok = all(torch.equal(p.full_tensor(), q) for p, q in zip(model.parameters(), ref.parameters()))
    else:
        ok = all(torch.equal(got[k], v) for k, v in ref.state_dict().items()) if rank == 0 else got == {}
    first = next(i for i, c in enumerate(calls) if c in _P2P)
    return calls[:first], sum(c in _COLLECTIVES for c in calls), ok


def test_no_collective_before_the_metadata_exchange(world):
    for op in ("load", "gather"):
        for before, collectives, ok in world(2).run(_calls_before_data, op):
            # was ["all_reduce", "all_gather_object", "all_reduce"]: the argument check had its own
            assert before == ["all_gather_object", "all_reduce"], (op, before)
            # then a load agrees once more after its transfers (receivers' unpacking) and once at
            # the end (the caller's code); a gather only at the end
            assert collectives == {"load": 4, "gather": 3}[op], (op, collectives)
            assert ok
