"""Optimizer state (fsdptk.optim) on real gloo worlds of 2 and 4 ranks: layout vs DCP, exact resume
at the same and at another world size (1-D FSDP, HSDP, FSDP + TP), single-process state into a
sharded optimizer, a property test gather(load(osd)) == osd, and bad input on every rank."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from fsdptk.testing.strategies import build_module, module_names, module_specs, random_state_dict

from _counting import OBJECT_COLLECTIVES, counted

N_STEPS, M_STEPS = 3, 3

# ---------------------------------------------------------------------------------------------
# a small LM-like model: tied embedding / head, two linears (TP-able), a norm with a frozen bias


class _Net(nn.Module):
    def __init__(self, vocab: int = 13, dim: int = 8, hidden: int = 12) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList([nn.Linear(dim, hidden), nn.Linear(hidden, dim)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tok: torch.Tensor) -> torch.Tensor:
        h = self.embed(tok)
        h = h + self.layers[1](torch.tanh(self.layers[0](h)))
        return self.head(self.norm(h))


def _init_sd(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return _Net().state_dict()


def _make_opt(model: nn.Module, kind: str = "adamw") -> torch.optim.Optimizer:
    """Two groups (decay / no decay); ``norm.bias`` is frozen but stays in its group (no state)."""
    model.norm.bias.requires_grad_(False)
    decay = [p for _, p in model.named_parameters() if p.ndim >= 2]
    other = [p for _, p in model.named_parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0, "lr": 3e-2}]
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=1e-2, momentum=0.9)
    return torch.optim.AdamW(groups, lr=1e-2, betas=(0.8, 0.95))


def _dp() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


def _shard(model: nn.Module, layout: str) -> tuple[int, int]:
    """Shard ``model`` for ``layout``; returns this rank's (data-parallel rank, data-parallel size)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    world = dist.get_world_size()
    if layout == "tp":
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"layers.0": ColwiseParallel(), "layers.1": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
        return mesh["dp"].get_local_rank(), mesh["dp"].size()
    if layout == "hsdp":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    else:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return _dp()


def _loaded(layout: str = "1d", seed: int = 0) -> tuple[nn.Module, int, int]:
    from fsdptk import load_from_full_model_state_dict

    with torch.device("meta"):
        model = _Net()
    dp_rank, dp_size = _shard(model, layout)
    load_from_full_model_state_dict(model, _init_sd(seed), "cpu", strict=True)
    return model, dp_rank, dp_size


def _train(model: nn.Module, opt: torch.optim.Optimizer, start: int, steps: int, dp_rank: int,
           dp_size: int, device: torch.device | str = "cpu") -> None:
    """``steps`` steps on a global batch of 8 sequences per step (step-seeded), split over dp ranks."""
    for step in range(start, start + steps):
        tok = torch.randint(0, 13, (8, 5), generator=torch.Generator().manual_seed(1000 + step))
        tok = tok.chunk(dp_size)[dp_rank].to(device)
        loss = nn.functional.cross_entropy(model(tok).flatten(0, 1), tok.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()


def _job(layout, model_sd, start, steps, osd=None, bcast=False):
    """Fresh meta model on this world, load model (+ optimizer) state, train, gather both on rank 0."""
    from fsdptk import (
        gather_cpu_state_dict,
        get_full_optimizer_state_dict,
        load_from_full_model_state_dict,
        load_from_full_optimizer_state_dict,
    )

    rank = dist.get_rank()
    with torch.device("meta"):
        model = _Net()
    dp_rank, dp_size = _shard(model, layout)
    reads = rank == 0 or not bcast
    load_from_full_model_state_dict(model, model_sd if reads else {}, "cpu", strict=True,
                                    broadcast_from_rank0=bcast, release_sd=False)
    opt = _make_opt(model)
    if osd is not None:
        res = load_from_full_optimizer_state_dict(model, opt, osd if reads else {}, "cpu",
                                                  broadcast_from_rank0=bcast)
        assert not res.missing_keys and not res.unexpected_keys
    _train(model, opt, start, steps, dp_rank, dp_size)
    msd = gather_cpu_state_dict(model, rank == 0)
    full_osd = get_full_optimizer_state_dict(model, opt, rank == 0)
    return (msd, full_osd) if rank == 0 else (msd, full_osd) == ({}, {})


def _max_diff(a: dict, b: dict) -> float:
    return max((x.float() - b[k].float()).abs().max().item() for k, x in a.items())


def _osd_equal(a: dict, b: dict) -> bool:
    if a["param_groups"] != b["param_groups"] or list(a["state"]) != list(b["state"]):
        return False
    return all(list(s) == list(b["state"][f]) and all(torch.equal(v, b["state"][f][k]) for k, v in s.items())
               for f, s in a["state"].items())


def _resume(world, size_a, layout_a, size_b, layout_b, bcast):
    """(uninterrupted N+M run at size_a, run resumed at size_b from step N of a run at size_a)."""
    sd = _init_sd(0)
    full = world(size_a).run(_job, layout_a, sd, 0, N_STEPS + M_STEPS)
    part = world(size_a).run(_job, layout_a, sd, 0, N_STEPS)
    assert all(part[1:])  # other ranks got {}
    msd, osd = part[0]
    assert sorted(osd["state"]) == ["embed.weight", "layers.0.bias", "layers.0.weight", "layers.1.bias",
                                    "layers.1.weight", "norm.weight"]  # tied once; frozen norm.bias: no state
    resumed = world(size_b).run(_job, layout_b, msd, N_STEPS, M_STEPS, osd=osd, bcast=bcast)
    assert all(resumed[1:])
    return full[0], resumed[0]


@pytest.mark.parametrize("size,layout,bcast", [(2, "1d", False), (4, "hsdp", True), (4, "tp", True)])
def test_exact_resume_same_world_size(world, size, layout, bcast):
    (full_m, full_o), (res_m, res_o) = _resume(world, size, layout, size, layout, bcast)
    assert list(res_m) == list(full_m)
    assert all(torch.equal(res_m[k], v) for k, v in full_m.items()), _max_diff(res_m, full_m)
    assert _osd_equal(res_o, full_o)
    assert res_o["state"]["embed.weight"]["step"].item() == N_STEPS + M_STEPS


@pytest.mark.parametrize("size_a,layout_a,size_b,layout_b", [(2, "1d", 4, "hsdp"), (4, "tp", 2, "1d")])
def test_resume_at_another_world_size(world, size_a, layout_a, size_b, layout_b):
    (full_m, full_o), (res_m, res_o) = _resume(world, size_a, layout_a, size_b, layout_b, True)
    assert _max_diff(res_m, full_m) < 1e-5
    assert res_o["param_groups"] == full_o["param_groups"]
    for f, s in full_o["state"].items():
        torch.testing.assert_close(res_o["state"][f], s, rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# a plain single-process optimizer's state (integer ids) into a sharded one


def _single_to_sharded(sd, bcast):
    from fsdptk import (
        gather_cpu_state_dict,
        get_full_optimizer_state_dict,
        load_from_full_model_state_dict,
        load_from_full_optimizer_state_dict,
    )

    rank = dist.get_rank()
    plain = _Net()
    plain.load_state_dict(sd)
    plain_opt = _make_opt(plain)
    _train(plain, plain_opt, 0, N_STEPS, 0, 1)
    saved_m = copy.deepcopy(plain.state_dict())
    saved_o = copy.deepcopy(plain_opt.state_dict())  # integer ids
    _train(plain, plain_opt, N_STEPS, M_STEPS, 0, 1)  # the reference continues single-process

    with torch.device("meta"):
        model = _Net()
    _shard(model, "1d")
    load_from_full_model_state_dict(model, saved_m, "cpu", strict=True, release_sd=False)
    opt = _make_opt(model)
    load_from_full_optimizer_state_dict(model, opt, saved_o if rank == 0 or not bcast else {}, "cpu",
                                        broadcast_from_rank0=bcast)
    _train(model, opt, N_STEPS, M_STEPS, 0, 1)  # every rank sees the full batch, as the plain run did
    got = gather_cpu_state_dict(model, rank == 0)
    got_o = get_full_optimizer_state_dict(model, opt, rank == 0)
    if rank:
        return True
    ref = plain.state_dict()
    same_m = all(torch.equal(got[k], ref[k]) for k in ref)
    fqn_of = {id(p): n for n, p in plain.named_parameters()}
    same_o = sorted(got_o["state"]) == sorted(fqn_of[id(p)] for p in plain_opt.state) and all(
        torch.equal(got_o["state"][fqn_of[id(p)]][k], v) for p, s in plain_opt.state.items() for k, v in s.items())
    return same_m, same_o, got_o["param_groups"][1]["lr"], _max_diff(got, ref)


@pytest.mark.parametrize("bcast", [False, True])
def test_single_process_state_continues_identically(world, bcast):
    out = world(2).run(_single_to_sharded, _init_sd(1), bcast)
    assert out[1] is True
    same_m, same_o, lr, diff = out[0]
    assert (same_m, same_o, lr) == (True, True, 3e-2), diff


# ---------------------------------------------------------------------------------------------
# the layout is DCP's full optimizer state dict (and both directions interoperate)


def _vs_dcp(layout):
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    from fsdptk import get_full_optimizer_state_dict, iter_full_optimizer_state, load_from_full_model_state_dict

    rank = dist.get_rank()
    with torch.device("meta"):
        model = _Net()
    dp_rank, dp_size = _shard(model, layout)
    load_from_full_model_state_dict(model, _init_sd(2), "cpu", strict=True)
    opt = _make_opt(model)
    _train(model, opt, 0, 2, dp_rank, dp_size)
    ours = get_full_optimizer_state_dict(model, opt, rank == 0)
    streamed = [b for b in iter_full_optimizer_state(model, opt, bucket_bytes=100)]
    dcp = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    # DCP loads our dict into a fresh optimizer: the live state must be the same shards
    opt2 = _make_opt(model)
    set_optimizer_state_dict(model, opt2, ours if rank == 0 else {},
                             options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    same_live = all(torch.equal(opt2.state[p][k].to_local() if hasattr(v, "to_local") else opt2.state[p][k],
                                v.to_local() if hasattr(v, "to_local") else v)
                    for p, s in opt.state.items() for k, v in s.items())
    if rank:
        return ours == {} and all(b == [] for b in streamed), same_live
    flat = [fqn for b in streamed for fqn, _ in b]
    stream_ok = flat == list(ours["state"]) and all(
        torch.equal(v, ours["state"][f][k]) for b in streamed for f, s in b for k, v in s.items())
    return _osd_equal(ours, dcp), stream_ok, same_live, len(streamed) > 3


@pytest.mark.parametrize("size,layout", [(2, "1d"), (4, "tp")])
def test_layout_matches_dcp(world, size, layout):
    out = world(size).run(_vs_dcp, layout)
    assert out[0] == (True, True, True, True)
    assert all(o == (True, True) for o in out[1:])


# ---------------------------------------------------------------------------------------------
# property: gather(load(osd)) == osd over random models, optimizers, groups and frozen params

_OPTIMIZERS = {
    "adam": lambda g: torch.optim.Adam(g, lr=1e-3, amsgrad=True),
    "adamw": lambda g: torch.optim.AdamW(g, lr=1e-3),
    "sgd": lambda g: torch.optim.SGD(g, lr=1e-2, momentum=0.9),
    "adagrad": lambda g: torch.optim.Adagrad(g, lr=1e-2),
    "rmsprop": lambda g: torch.optim.RMSprop(g, lr=1e-2, momentum=0.5, centered=True),
}


def _groups_by_fqn(model: nn.Module, assign: dict[str, int], lrs: list[float], reverse: bool) -> list[dict]:
    params = dict(model.named_parameters())
    order = sorted(set(assign.values()), reverse=reverse)
    return [{"params": [params[f] for f in (reversed(list(assign)) if reverse else assign) if assign[f] == g],
             "lr": lrs[g]} for g in order]


def _make_case(spec, seed, kind, assign, frozen, lrs):
    """Single process: a real optimizer step on random gradients -> the FQN-layout full state."""
    from fsdptk import to_fqn_optimizer_state_dict

    model = build_module(spec, "cpu")
    model.load_state_dict(random_state_dict(spec, seed))
    gen = torch.Generator().manual_seed(seed)
    for fqn, p in model.named_parameters():
        if fqn not in frozen:
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
    opt = _OPTIMIZERS[kind](_groups_by_fqn(model, assign, lrs, reverse=False))
    opt.step()
    return to_fqn_optimizer_state_dict(model, opt.state_dict(), optimizer=opt)


def _round_trip(spec, seed, names, layout, kind, assign, frozen, lrs, osd, bcast, bucket):
    from fsdptk import (
        get_full_optimizer_state_dict,
        load_from_full_model_state_dict,
        load_from_full_optimizer_state_dict,
    )

    rank = dist.get_rank()
    model = build_module(spec, "meta")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    world = dist.get_world_size()
    mesh = (init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp_replicate", "dp_shard"))
            if layout == "hsdp" else init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",)))
    modules = dict(model.named_modules())
    for name in sorted(names, key=lambda n: -n.count(".")):
        if not isinstance(modules[name], nn.ModuleList):
            fully_shard(modules[name], mesh=mesh)
    fully_shard(model, mesh=mesh)
    load_from_full_model_state_dict(model, random_state_dict(spec, seed), "cpu", strict=True)
    for fqn, p in model.named_parameters():
        p.requires_grad_(fqn not in frozen)
    # groups in the reverse order, parameters reversed inside them: matching must be by FQN
    opt = _OPTIMIZERS[kind](_groups_by_fqn(model, assign, [0.5] * len(lrs), reverse=True))
    mine = osd if rank == 0 or not bcast else {}
    before = copy.deepcopy(mine)
    load_from_full_optimizer_state_dict(model, opt, mine, "cpu", broadcast_from_rank0=bcast,
                                        bucket_bytes=bucket)
    untouched = _same_nested(mine, before)
    got = get_full_optimizer_state_dict(model, opt, rank == 0, bucket_bytes=bucket)
    if rank:
        return got == {}, untouched
    same = (_hypers_by_fqn(got["param_groups"]) == _hypers_by_fqn(osd["param_groups"])
            and sorted(got["state"]) == sorted(osd["state"])
            and all(list(s) == list(got["state"][f]) and all(
                got["state"][f][k].dtype == v.dtype and torch.equal(got["state"][f][k], v) for k, v in s.items())
                for f, s in osd["state"].items()))
    return same, untouched


def _hypers_by_fqn(groups: list[dict]) -> dict[str, dict]:
    return {f: {k: v for k, v in g.items() if k != "params"} for g in groups for f in g["params"]}


def _same_nested(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same_nested(v, b[k]) for k, v in a.items())
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same_nested(x, y) for x, y in zip(a, b))
    return a == b


@st.composite
def _cases(draw, world_size: int):
    spec = draw(module_specs(max_leaves=5))
    fqns = [n for n, _ in build_module(spec, "meta").named_parameters()]
    n_groups = draw(st.integers(1, 3))
    assign = {f: draw(st.integers(0, n_groups - 1)) for f in fqns}
    frozen = draw(st.lists(st.sampled_from(fqns), unique=True, max_size=2)) if fqns else []
    mods = [n for n in module_names(spec) if n.startswith("body")]
    names = draw(st.lists(st.sampled_from(mods), unique=True, max_size=3)) if mods else []
    layout = draw(st.sampled_from(["1d", "hsdp"] if world_size == 4 else ["1d"]))
    return spec, assign, frozen, names, layout, [1e-3 * (g + 1) for g in range(n_groups)]


def _property(world, size, case, seed, kind, bcast, bucket):
    spec, assign, frozen, names, layout, lrs = case
    osd = _make_case(spec, seed, kind, assign, frozen, lrs)
    out = world(size).run(_round_trip, spec, seed, names, layout, kind, assign, frozen, lrs, osd, bcast, bucket)
    assert out == [(True, True)] * size


@settings(max_examples=12, deadline=None)
@given(case=_cases(2), seed=st.integers(0, 2**16), kind=st.sampled_from(sorted(_OPTIMIZERS)),
       bcast=st.booleans(), bucket=st.sampled_from([64, 1 << 20]))
def test_gather_load_round_trip_2_ranks(world, case, seed, kind, bcast, bucket):
    _property(world, 2, case, seed, kind, bcast, bucket)


@settings(max_examples=10, deadline=None)
@given(case=_cases(4), seed=st.integers(0, 2**16), kind=st.sampled_from(sorted(_OPTIMIZERS)),
       bcast=st.booleans(), bucket=st.sampled_from([64, 1 << 20]))
def test_gather_load_round_trip_4_ranks(world, case, seed, kind, bcast, bucket):
    _property(world, 4, case, seed, kind, bcast, bucket)


# ---------------------------------------------------------------------------------------------
# state not initialised yet, release_sd, strict=False


def _uninitialised():
    from fsdptk import get_full_optimizer_state_dict, load_from_full_optimizer_state_dict

    rank = dist.get_rank()
    model, _, _ = _loaded()
    opt = _make_opt(model)
    osd = get_full_optimizer_state_dict(model, opt, True)  # every rank asks: only rank 0 gets it
    opt2 = _make_opt(model)
    for g in opt2.param_groups:
        g["lr"] = 9.0
    load_from_full_optimizer_state_dict(model, opt2, osd if rank == 0 else {}, "cpu", broadcast_from_rank0=True)
    return osd.get("state"), [g["lr"] for g in opt2.param_groups], len(opt2.state)


def test_state_not_initialised(world):
    out = world(2).run(_uninitialised)
    assert out[0] == ({}, [1e-2, 3e-2], 0)
    assert out[1] == (None, [1e-2, 3e-2], 0)


def _release_and_non_strict():
    from fsdptk import get_full_optimizer_state_dict, load_from_full_optimizer_state_dict

    rank = dist.get_rank()
    model, dp_rank, dp_size = _loaded()
    opt = _make_opt(model)
    _train(model, opt, 0, 1, dp_rank, dp_size)
    osd = get_full_optimizer_state_dict(model, opt, True)
    full = osd if rank == 0 else {}
    load_from_full_optimizer_state_dict(model, _make_opt(model), full, "cpu", broadcast_from_rank0=True,
                                        release_sd=True)
    released = sorted(k for s in full.get("state", {}).values() for k in s)  # only "step" is left
    # strict=False: a parameter unknown to the saved state keeps its state, unknown saved ones are ignored
    osd2 = get_full_optimizer_state_dict(model, opt, True)
    if rank == 0:
        osd2["state"]["ghost.weight"] = {"step": torch.tensor(1.0)}
        osd2["param_groups"][0]["params"] = ["ghost.weight"] + osd2["param_groups"][0]["params"][1:]
    opt3 = _make_opt(model)
    res = load_from_full_optimizer_state_dict(model, opt3, osd2 if rank == 0 else {}, "cpu",
                                              broadcast_from_rank0=True, strict=False)
    return released, res.missing_keys, res.unexpected_keys, len(opt3.state), len(opt.state)


def test_release_sd_and_strict_false(world):
    out = world(2).run(_release_and_non_strict)
    released, missing, unexpected, n3, n = out[0]
    assert released == ["step"] * 6
    assert (missing, unexpected) == (["embed.weight"], ["ghost.weight"])
    assert n3 == n - 1  # embed.weight: not in the saved groups, nothing to keep on a fresh optimizer
    assert n == 6  # 7 parameters (tied once), norm.bias frozen
    assert out[1] == ([], ["embed.weight"], ["ghost.weight"], 5, 6)


# ---------------------------------------------------------------------------------------------
# fixed costs: one object collective per call before data moves (issue 14, point 2)

def _count_object_collectives(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` with torch.distributed's object collectives counted (real calls)."""
    with counted(OBJECT_COLLECTIVES) as calls:
        out = fn(*args, **kwargs)
    return out, calls


def _object_collectives(bcast, layout):
    from fsdptk import get_full_optimizer_state_dict, iter_full_optimizer_state, load_from_full_optimizer_state_dict

    rank = dist.get_rank()
    model, dp_rank, dp_size = _loaded(layout)
    opt = _make_opt(model)
    _train(model, opt, 0, 1, dp_rank, dp_size)
    box = [get_full_optimizer_state_dict(model, opt, True)]
    dist.broadcast_object_list(box, src=0)  # every rank holds the same full state
    osd = box[0]
    fresh = _make_opt(model)
    res, load_calls = _count_object_collectives(
        load_from_full_optimizer_state_dict, model, fresh, osd if rank == 0 or not bcast else {}, "cpu",
        broadcast_from_rank0=bcast, bucket_bytes=256)  # tiny buckets: many data steps, still one
    got, gather_calls = _count_object_collectives(get_full_optimizer_state_dict, model, fresh, rank == 0,
                                                  bucket_bytes=256)
    _, iter_calls = _count_object_collectives(lambda: list(iter_full_optimizer_state(model, fresh)))
    same = _osd_equal(got, osd) if rank == 0 else got == {}
    return load_calls, gather_calls, iter_calls, same, (res.missing_keys, res.unexpected_keys)


@pytest.mark.parametrize("layout", ["1d", "tp"])
@pytest.mark.parametrize("bcast", [True, False])
def test_one_object_collective_per_call(world, bcast, layout):
    for rank_out in world(2).run(_object_collectives, bcast, layout):
        load_calls, gather_calls, iter_calls, same, keys = rank_out
        assert load_calls == ["all_gather_object"], load_calls  # the view rides with the metadata
        assert gather_calls == ["all_gather_object"] and iter_calls == ["all_gather_object"], gather_calls
        assert same and keys == ([], [])


# ---------------------------------------------------------------------------------------------
# bad input: the same clear error on every rank, no hang, the optimizer untouched


def _bad(case, bcast):
    from torch.distributed.tensor import DTensor

    from fsdptk import get_full_optimizer_state_dict, load_from_full_optimizer_state_dict

    rank = dist.get_rank()
    model, dp_rank, dp_size = _loaded()
    opt = _make_opt(model)
    _train(model, opt, 0, 1, dp_rank, dp_size)
    box = [get_full_optimizer_state_dict(model, opt, True)]
    dist.broadcast_object_list(box, src=0)  # every rank holds the same full state
    osd = box[0]
    if rank == 0 or (not bcast and case != "differ"):  # broadcast: only rank 0's copy is read
        st_, groups = osd["state"], osd["param_groups"]
        if case == "unknown":
            st_["nope.weight"] = {"exp_avg": torch.zeros(2)}
            groups[0]["params"].append("nope.weight")
        elif case == "shape":
            st_["layers.0.weight"]["exp_avg_sq"] = torch.zeros(12, 7)
        elif case == "groups":  # saved: every weight in its own group -> our group 0 cannot be matched
            groups[:1] = [dict(groups[0], params=[f]) for f in groups[0]["params"]]
        elif case == "mixed":
            st_[0] = st_.pop("layers.0.bias")
        elif case == "bad_id":
            osd = copy.deepcopy(opt.state_dict())
            osd["param_groups"][0]["params"].append(99)
        elif case == "dtensor":
            w = model.norm.weight
            st_["norm.weight"]["exp_avg"] = DTensor.from_local(torch.zeros(4), w.device_mesh, w.placements,
                                                               run_check=False, shape=w.shape, stride=w.stride())
        elif case == "missing":
            del st_["layers.1.bias"]
            groups[1]["params"].remove("layers.1.bias")
        elif case == "differ":
            groups[0]["lr"] = 0.5
    fresh = _make_opt(model)
    try:
        load_from_full_optimizer_state_dict(model, fresh, osd if rank == 0 or not bcast else {}, "cpu",
                                            broadcast_from_rank0=bcast)
    except (ValueError, TypeError) as e:
        return type(e).__name__, str(e), len(fresh.state), [g["lr"] for g in fresh.param_groups]
    return None


_BAD = {
    "unknown": "'nope.weight' is not a parameter of the model",
    "shape": "'state.layers.0.weight.exp_avg_sq': shape mismatch: the source has [12, 7], the model has [12, 8]",
    "groups": "param group 0 of the optimizer cannot be matched: its parameters come from saved param groups "
              "[0, 1, 2]",
    "mixed": "must be all parameter FQNs (str) or all integer ids",
    "bad_id": "integer optimizer ids [99] have no parameter",
    "dtensor": "state['norm.weight']['exp_avg'] is a DTensor",
    "missing": "no saved param group lists the optimizer's parameter(s) ['layers.1.bias']",
    "differ": "the full optimizer states differ between rank 0 and ranks [1]",
}


@pytest.mark.parametrize("case", sorted(_BAD))
def test_bad_input_raises_on_every_rank(world, case):
    for bcast in (False,) if case == "differ" else (True, False):
        out = world(2).run(_bad, case, bcast, timeout=60)
        for rank_out in out:
            assert rank_out is not None, f"{case}: no error"
            kind, msg, n_state, lrs = rank_out
            # a strict key mismatch is StateDictMismatchError (a ValueError and a RuntimeError)
            expected = "StateDictMismatchError" if case in ("unknown", "missing") else "ValueError"
            assert kind == expected and _BAD[case] in msg, msg
            assert (n_state, lrs) == (0, [1e-2, 3e-2])  # the optimizer was not changed


def test_optimizer_created_before_sharding_is_a_clear_error():
    from fsdptk import get_full_optimizer_state_dict

    model = _Net()
    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    with pytest.raises(ValueError, match=r"param group 0 of SGD holds a parameter of shape \[2\]"):
        get_full_optimizer_state_dict(model, opt, True)


def test_int_ids_follow_named_parameters_or_param_names():
    from fsdptk import to_fqn_optimizer_state_dict

    model = _Net()
    model.norm.bias.requires_grad_(False)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    _train(model, opt, 0, 1, 0, 1)
    sd = opt.state_dict()
    got = to_fqn_optimizer_state_dict(model, sd, param_names=trainable)
    assert got["param_groups"][0]["params"] == trainable
    buf = opt.state[model.norm.weight]["momentum_buffer"]
    assert torch.equal(got["state"]["norm.weight"]["momentum_buffer"], buf)
    named = torch.optim.SGD(list(model.named_parameters())[1:], lr=0.1)  # torch's "param_names"
    assert to_fqn_optimizer_state_dict(model, named.state_dict())["param_groups"][0]["params"] == \
        [n for n, _ in model.named_parameters()][1:]
    # one saved group (model order) into the two-group optimizer: ids by named_parameters order,
    # both groups take the saved group's hyper-parameters (matched by FQN, not position)
    from fsdptk import load_from_full_optimizer_state_dict

    single = torch.optim.SGD(model.parameters(), lr=0.25, momentum=0.9)
    _train(model, single, 0, 1, 0, 1)
    two = _make_opt(model, "sgd")
    assert not load_from_full_optimizer_state_dict(model, two, single.state_dict(), "cpu").missing_keys
    assert [g["lr"] for g in two.param_groups] == [0.25, 0.25]
    assert all(torch.equal(two.state[p]["momentum_buffer"], s["momentum_buffer"]) for p, s in single.state.items())
    alias = {"state": {}, "param_groups": [{"lr": 0.1, "params": ["head.weight"]}]}  # the tied alias
    assert to_fqn_optimizer_state_dict(model, alias)["param_groups"][0]["params"] == ["embed.weight"]


@pytest.mark.gpu  # FSDP2's CPUOffloadPolicy needs an accelerator
def test_cpu_offload_state_lives_on_cpu():  # pragma: no cover - needs a GPU
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    from fsdptk import get_full_optimizer_state_dict, load_from_full_optimizer_state_dict

    device = torch.accelerator.current_accelerator()
    with torch.device(device):
        model = _Net()
    own_pg = not dist.is_initialized()
    if own_pg:
        from fsdptk import get_distributed_backend

        dist.init_process_group(get_distributed_backend(device.type, offload_ops_to_cpu=True),
                                init_method="tcp://127.0.0.1:29533", rank=0, world_size=1)
    try:
        fully_shard(model, offload_policy=CPUOffloadPolicy())
        opt = _make_opt(model)
        _train(model, opt, 0, 2, 0, 1, device)
        osd = get_full_optimizer_state_dict(model, opt, True)
        opt2 = _make_opt(model)
        load_from_full_optimizer_state_dict(model, opt2, osd, device)
        assert all(v.device.type == "cpu" for s in opt2.state.values() for v in s.values())
        assert _osd_equal(get_full_optimizer_state_dict(model, opt2, True), osd)
    finally:
        if own_pg:
            dist.destroy_process_group()


def test_state_held_in_plain_dicts_is_known_to_the_engine_as_held():
    """Saved state in plain dicts is read without allocating, so a rank-0 load moves its large
    dim-0 shards in one bucket; state behind another Mapping is read bucket by bucket."""
    from types import MappingProxyType

    from fsdptk._engine.sources import NestedSource

    t = torch.ones(4, 2)
    rows = [("state.w.exp_avg", "w", "exp_avg")]
    assert NestedSource({"w": {"exp_avg": t}}, rows).meta("state.w.exp_avg").held_on == "cpu"
    for state in ({"w": MappingProxyType({"exp_avg": t})}, MappingProxyType({"w": {"exp_avg": t}}),
                  {"w": {"exp_avg": t.t()}}):  # not a plain dict, or not contiguous
        assert NestedSource(state, rows).meta("state.w.exp_avg").held_on is None
