"""shard_model, describe_sharding, apply_activation_checkpointing.

Training equivalence on the persistent world (2 and 4 ranks, gloo): a model sharded by shard_model
and trained with Adam matches the same model trained in one process on the concatenated batch.
Values are loaded with DTensor's distribute_tensor (not fsdptk's state-dict helpers, issue 4).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import event, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

from fsdptk import (
    ParallelDims,
    ShardingPlan,
    apply_activation_checkpointing,
    describe_sharding,
    get_shard_conditions,
    shard_model,
)
from fsdptk.errors import ShardConditionError
from fsdptk.predicates import any_of, by_glob, by_name, by_type, clean_fqn, layers, not_
from fsdptk.testing import RemoteError
from fsdptk.testing.strategies import TestBlock, build_module, module_specs

V, D, H, T, B = 13, 6, 10, 3, 2  # vocab, width, hidden, tokens, rows per dp rank (odd sizes: padding)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.fc1 = nn.Linear(D, H)
        self.fc2 = nn.Linear(H, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


class Tiny(nn.Module):
    def __init__(self, n_layers: int = 3, tied: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.layers = nn.ModuleList(Block() for _ in range(n_layers))
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, V, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


def _reference(seed: int, tied: bool) -> Tiny:
    torch.manual_seed(seed)
    return Tiny(tied=tied)


def _batches(seed: int, steps: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randint(0, V, (steps, dp * B, T), generator=g)
    y = torch.randint(0, V, (steps, dp * B, T), generator=g)
    return x, y


def _loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, V), y.reshape(-1))


def _load_full(model: nn.Module, full: dict[str, torch.Tensor]) -> None:
    """Copy full values into the sharded model's local shards (DTensor placement math)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    with torch.no_grad():
        for name, p in model.named_parameters():
            src = full[clean_fqn(name)]
            if isinstance(p, DTensor):
                part = distribute_tensor(src, p.device_mesh, p.placements, src_data_rank=None)
                p.to_local().copy_(part.to_local())
            else:
                p.copy_(src)


def _train_sharded(cfg: dict) -> dict:
    """On every rank: shard, load the reference init, train; return errors vs the reference."""
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
    seed, steps, tied = cfg.get("seed", 0), cfg.get("steps", 3), cfg.get("tied", False)
    dims = ParallelDims(dp_replicate=cfg.get("rep", 1), tp=cfg.get("tp", 1))
    dims.build_mesh("cpu")
    ref = _reference(seed, tied)
    full = {k: v.detach().clone() for k, v in ref.named_parameters(remove_duplicate=False)}
    if cfg.get("meta", True):
        with torch.device("meta"):
            model = Tiny(tied=tied)
    else:
        model = _reference(seed, tied)
    if dims.tp_enabled:
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        for block in model.layers:
            parallelize_module(block, dims.tp_mesh, {"fc1": ColwiseParallel(),
                                                     "fc2": RowwiseParallel()})
    if cfg.get("ac"):
        apply_activation_checkpointing(model, layers(), mode=cfg["ac"])
    mp = None
    if cfg.get("bf16"):
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    conds = cfg.get("conds", [get_shard_conditions])
    plan = shard_model(model, conds, cpu_offload=False, dp_mesh=dims.fsdp_mesh, mp_policy=mp,
                       forward_prefetch=cfg.get("prefetch", 0),
                       backward_prefetch=cfg.get("prefetch", 0))
    if cfg.get("meta", True):
        model.to_empty(device="cpu")
        _load_full(model, full)
    x, y = _batches(seed, steps, dims.dp_degree)
    dp_rank = dims.dp_rank
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    for step in range(steps):
        sl = slice(dp_rank * B, (dp_rank + 1) * B)
        _loss(model(x[step, sl]), y[step, sl]).backward()
        opt.step()
        opt.zero_grad()
        if mp is None:
            _loss(ref(x[step]), y[step]).backward()
        else:  # the same casting: bf16 compute per dp rank's batch, fp32 average of gradients
            for r in range(dims.dp_degree):
                lo = slice(r * B, (r + 1) * B)
                cast = {k: v.to(torch.bfloat16) for k, v in ref.named_parameters()}
                out = torch.func.functional_call(ref, cast, (x[step, lo],))
                (_loss(out, y[step, lo]) / dims.dp_degree).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    errs = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        got = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
        want = dict(ref.named_parameters(remove_duplicate=False))[clean_fqn(name)]
        errs[clean_fqn(name)] = (got - want).abs().max().item()
    moved = max((ref.embed.weight - full["embed.weight"]).abs().max().item(), 0.0)
    fsdp_units = sorted(clean_fqn(n) for n, m in model.named_modules() if isinstance(m, FSDPModule))
    prefetch = {}
    for n, m in model.named_modules():
        if isinstance(m, FSDPModule):
            st_ = m._get_fsdp_state()
            prefetch[clean_fqn(n)] = (len(st_._states_to_forward_prefetch),
                                      len(st_._states_to_backward_prefetch))
    return {
        "errs": errs,
        "moved": moved,
        "tie": bool(tied and model.head.weight is model.embed.weight),
        "n_params": len(list(model.parameters())),
        "units": fsdp_units,
        "plan": str(plan),
        "prefetch": prefetch,
        "placements": {clean_fqn(n): str(p.placements) for n, p in model.named_parameters()},
    }


def _check_equiv(res: list[dict], tol: float) -> dict:
    for r in res:
        assert r["moved"] > 1e-3  # training actually changed the weights
        worst = max(r["errs"].items(), key=lambda kv: kv[1])
        assert worst[1] <= tol, f"{worst[0]} differs by {worst[1]:.3g} (> {tol})"
    return res[0]


LAYERS = ["layers.0", "layers.1", "layers.2"]


def test_fsdp_1d_matches_single_process(world) -> None:
    r = _check_equiv(world(2).run(_train_sharded, {"meta": False}), 1e-5)
    assert r["units"] == ["", *LAYERS]
    assert set(r["placements"].values()) == {"(Shard(dim=0),)"}


def test_hsdp_2x2_matches_single_process(world) -> None:
    r = _check_equiv(world(4).run(_train_sharded, {"rep": 2}), 1e-5)
    assert set(r["placements"].values()) == {"(Replicate(), Shard(dim=0))"}


def test_fsdp_after_tp_matches_single_process(world) -> None:
    r = _check_equiv(world(4).run(_train_sharded, {"tp": 2, "meta": False}), 1e-5)
    assert r["placements"]["layers.0.fc1.weight"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"
    assert r["placements"]["embed.weight"] == "(Shard(dim=0),)"


def test_mixed_precision_matches_same_casting(world) -> None:
    # reference: bf16 forward/backward per dp rank, fp32 gradient average, fp32 Adam (FSDP2's
    # MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)); only summation order differs
    _check_equiv(world(2).run(_train_sharded, {"bf16": True}), 1e-5)


def test_prefetch_depth_2(world) -> None:
    r = _check_equiv(world(2).run(_train_sharded, {"prefetch": 2}), 1e-5)
    # units in forward order: layers.0 -> layers.1 -> layers.2
    assert r["prefetch"]["layers.0"] == (2, 0)
    assert r["prefetch"]["layers.1"] == (1, 1)
    assert r["prefetch"]["layers.2"] == (0, 2)


@pytest.mark.parametrize(
    ("conds", "units"),
    [
        ([get_shard_conditions], ["", *LAYERS]),  # tie left to the root
        ([layers(), by_name("embed", "head")], ["", "embed", "head", *LAYERS]),  # one group
        ([layers(), by_name("head")], ["", *LAYERS]),  # head alone would split the tie
    ],
)
def test_tied_embeddings_stay_tied(world, conds, units) -> None:
    r = _check_equiv(world(2).run(_train_sharded, {"tied": True, "conds": conds}), 1e-5)
    assert r["tie"] and r["units"] == units
    assert r["errs"]["head.weight"] == r["errs"]["embed.weight"]
    assert r["n_params"] == 1 + 3 * 6 + 2  # one shared Parameter, stepped once


@pytest.mark.parametrize("mode", ["composable", "wrapper"])
def test_activation_checkpointing_then_shard(world, mode) -> None:
    r = _check_equiv(world(2).run(_train_sharded, {"ac": mode}), 1e-5)
    assert r["units"] == ["", *LAYERS]  # the same units as without AC


# ------------------------------------------------------------------------------------------
# property: random trees and predicates


_TYPES = [nn.Linear, nn.Embedding, nn.LayerNorm, nn.RMSNorm, nn.Conv1d, nn.Sequential,
          nn.ModuleList, TestBlock]


@st.composite
def _spec_and_pred(draw):
    spec = draw(module_specs(max_leaves=6))
    names = [n for n, _ in build_module(spec, "meta").named_modules() if n]
    atoms = [
        st.lists(st.sampled_from(names), min_size=1, max_size=3).map(lambda ns: by_name(*ns)),
        st.lists(st.sampled_from(_TYPES), min_size=1, max_size=2).map(lambda ts: by_type(*ts)),
        st.sampled_from([by_glob("body.*"), by_glob("*.0"), layers("body"), by_glob("*head*")]),
    ]
    atom = st.one_of(atoms)
    pred = draw(st.one_of(atom, st.tuples(atom, atom).map(lambda ab: any_of(*ab)),
                          st.tuples(atom, atom).map(lambda ab: ab[0] & not_(ab[1]))))
    return spec, pred


def _shard_spec(spec: dict, pred) -> dict:
    model = build_module(spec, "meta")
    try:
        shard_model(model, [pred], cpu_offload=False)
    except ValueError as e:
        untouched = not any(isinstance(m, FSDPModule) for m in model.modules())
        return {"error": str(e), "untouched": untouched}
    return {
        "fsdp": sorted(n for n, m in model.named_modules() if isinstance(m, FSDPModule)),
        "placements": sorted({str(p.placements) for p in model.parameters()}),
        "all_dtensor": all(type(p).__name__ == "DTensor" for p in model.parameters()),
        "tie": model.head.weight is model.embed.weight if spec["tied"] else None,
    }


@settings(max_examples=25, deadline=None)
@given(_spec_and_pred())
def test_property_units_are_exactly_the_matches(world, spec_pred) -> None:
    spec, pred = spec_pred
    meta = build_module(spec, "meta")
    matched = {n for n, m in meta.named_modules() if n and pred(n, m)}
    containers = {n for n in matched if isinstance(dict(meta.named_modules())[n], nn.ModuleList)}
    any_match = bool(matched)
    if spec["tied"] and len({"embed", "head"} & matched) == 1:
        matched -= {"embed", "head"}  # one side of a tie alone: left to the root
    kind = "no match" if not any_match else "container" if containers else "sharded"
    event(f"{kind}{' (tied)' if spec['tied'] else ''}")
    res = world(2).run(_shard_spec, spec, pred)
    for r in res:
        if not any_match or containers:
            assert "error" in r and r["untouched"], r
            assert ("no module matched" in r["error"]) if not any_match else (
                "containers without forward" in r["error"])
            continue
        assert "error" not in r, r
        assert r["fsdp"] == sorted(matched | {""})
        assert r["all_dtensor"] and r["placements"] in ([], ["(Shard(dim=0),)"])
        assert r["tie"] in (None, True)


# ------------------------------------------------------------------------------------------
# dry run


def test_describe_sharding_on_meta_counts_padding_and_ties() -> None:
    with torch.device("meta"):
        model = Tiny(tied=True)
    plan = describe_sharding(model, [layers(), by_name("embed", "head")], world_size=4)
    assert isinstance(plan, ShardingPlan) and plan.world_size == 4
    names = [u.name for u in plan.units]
    assert names == ["embed + head", *LAYERS, "<root>"]
    emb = plan.units[0]
    assert (emb.num_params, emb.numel, emb.nbytes) == (1, V * D, V * D * 4)
    assert emb.nbytes_per_rank == -(-V // 4) * D * 4  # 13 rows padded to 16 over 4 ranks
    blk = plan.units[1]
    assert blk.num_params == 6 and blk.numel == 2 * D + D * H + H + H * D + D
    rows = [D, D, H, H, D, D]  # dim 0 of norm.w, norm.b, fc1.w, fc1.b, fc2.w, fc2.b
    cols = [1, 1, D, 1, H, 1]
    assert blk.nbytes_per_rank == sum(-(-r // 4) * c * 4 for r, c in zip(rows, cols))
    assert plan.units[-1].rule == "root" and plan.units[-1].numel == 2 * D  # final norm
    assert plan.total_numel == sum(p.numel() for p in model.parameters())
    assert plan.total_bytes_per_rank == sum(u.nbytes_per_rank for u in plan.units)
    text = str(plan)
    assert "by_name('embed', 'head')" in text and "layers('layers')" in text
    assert "grouped into one unit" in text and "total" in text
    plan1 = describe_sharding(model, layers(), world_size=1)
    assert plan1.total_bytes_per_rank == plan1.total_bytes


def _nested_tie_model() -> nn.Module:
    model = nn.Module()
    model.a = nn.Sequential()
    model.a.x = nn.Linear(4, 4)
    model.a.y = nn.Linear(4, 4)
    model.b = nn.Linear(4, 4)
    model.c = nn.Linear(4, 4)
    model.b.weight = model.a.x.weight
    return model


def _shard_nested_tie(names: list[str]) -> list[str]:
    model = _nested_tie_model()
    shard_model(model, [by_name(*names)], cpu_offload=False)
    assert model.b.weight is model.a.x.weight
    return sorted(n for n, m in model.named_modules() if isinstance(m, FSDPModule))


def test_nested_ties_shard_for_real(world) -> None:
    # FSDP2 itself rejects a parameter in two units: these plans must be accepted by fully_shard
    assert world(2).run(_shard_nested_tie, ["a", "a.x", "b", "c"])[0] == ["", "c"]
    assert world(2).run(_shard_nested_tie, ["a.x", "b", "c"])[0] == ["", "a.x", "b", "c"]


def test_ties_across_nested_units_fall_back_to_the_common_parent() -> None:
    # a.x shares a weight with b; a.x sits inside unit a, b does not: no valid group exists
    model = nn.Module()
    model.a = nn.Sequential()
    model.a.x = nn.Linear(4, 4)
    model.a.y = nn.Linear(4, 4)
    model.b = nn.Linear(4, 4)
    model.c = nn.Linear(4, 4)
    model.b.weight = model.a.x.weight
    plan = describe_sharding(model, [by_name("a", "a.x", "b", "c")], world_size=2)
    assert [u.fqns for u in plan.units] == [("c",), ("",)]
    shared = plan.units[-1]
    # the root holds a.x (w, b), a.y (w, b), b.bias; the shared weight counted once
    assert shared.num_params == 5 and shared.numel == 2 * 16 + 3 * 4
    assert len(plan.notes) == 2 and all("stays with the unit of '<root>'" in n for n in plan.notes)
    # siblings under the same enclosing unit are grouped instead
    grouped = describe_sharding(model, [by_name("a.x", "b", "c")], world_size=2)
    assert [u.fqns for u in grouped.units] == [("a.x", "b"), ("c",), ("",)]


def test_describe_sharding_sees_through_checkpoint_wrapper() -> None:
    model = Tiny()
    before = describe_sharding(model, [by_type(Block)], world_size=2)
    sd_keys = sorted(model.state_dict())
    apply_activation_checkpointing(model, by_type(Block), mode="wrapper")
    assert "_checkpoint_wrapped_module" in next(n for n, _ in model.layers.named_parameters())
    assert sorted(model.state_dict()) == sd_keys  # the wrapper strips its prefix
    after = describe_sharding(model, [by_type(Block)], world_size=2)
    assert [u.fqns for u in after.units] == [u.fqns for u in before.units]


def test_activation_checkpointing_same_gradients_and_names() -> None:
    torch.manual_seed(0)
    base, model = Tiny(), Tiny()
    model.load_state_dict(base.state_dict())
    keys = sorted(model.state_dict())
    assert apply_activation_checkpointing(model, layers()) == LAYERS
    assert sorted(model.state_dict()) == keys
    x = torch.randint(0, V, (2, T))
    base(x).sum().backward()
    model(x).sum().backward()
    for (n, p), q in zip(base.named_parameters(), model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=n)
    with pytest.raises(ValueError, match=r"already activation-checkpointed"):
        apply_activation_checkpointing(model, layers())
    with pytest.raises(ValueError, match=r"no module matched the checkpoint conditions \[by_name"):
        apply_activation_checkpointing(Tiny(), by_name("nope"))
    with pytest.raises(ValueError, match="mode must be"):
        apply_activation_checkpointing(Tiny(), layers(), mode="x")  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------
# bad input


def _boom(name: str, module: nn.Module) -> bool:
    if name == "layers.1":
        raise KeyError("kaboom")
    return False


def test_bad_input_without_process_group() -> None:
    model = Tiny()
    with pytest.raises(ValueError, match=r"no module matched the shard conditions \[by_glob"):
        describe_sharding(model, [by_glob("zzz*")], world_size=2)
    with pytest.raises(ShardConditionError, match=r"_boom raised KeyError on module 'layers.1'"):
        describe_sharding(model, [layers("x"), _boom], world_size=2)
    with pytest.raises(ValueError, match="containers without forward"):
        describe_sharding(model, [by_name("layers")], world_size=2)
    with pytest.raises(ValueError, match="world_size must be a positive int, got 0"):
        describe_sharding(model, [layers()], world_size=0)
    with pytest.raises(ValueError, match="shard_conditions is empty"):
        describe_sharding(model, [], world_size=2)
    with pytest.raises(TypeError, match=r"shard_conditions\[1\] is not callable"):
        describe_sharding(model, [layers(), "layers"], world_size=2)
    model.scale = nn.Parameter(torch.tensor(1.0))
    with pytest.raises(ValueError, match=r"scalar \(0-dim\) parameters: \['scale'\]"):
        describe_sharding(model, [layers()], world_size=2)
    # cpu_offload on a CPU-only machine: a clear error before anything is touched
    if not torch.accelerator.is_available():
        plain = Tiny()
        with pytest.raises(RuntimeError, match="cpu_offload=True needs an accelerator"):
            shard_model(plain, [layers()], cpu_offload=True)
        assert not any(isinstance(m, FSDPModule) for m in plain.modules())
    with pytest.raises(RuntimeError, match="needs a dp_mesh or an initialised"):
        shard_model(Tiny(), [layers()], cpu_offload=False)


def _bad_shard(case: str) -> dict:
    model = Tiny()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    kw: dict = {"cpu_offload": False}
    conds = [layers()]
    if case == "raises":
        conds = [layers("x"), _boom]
    elif case == "nothing":
        conds = [by_name("nope"), by_type(nn.GRU)]
    elif case == "mesh3d":
        from torch.distributed.device_mesh import init_device_mesh

        kw["dp_mesh"] = init_device_mesh("cpu", (1, 2, 1), mesh_dim_names=("a", "b", "c"))
    elif case == "sharded":
        shard_model(model, [layers()], cpu_offload=False)
        before = None
    elif case == "prefetch":
        kw["forward_prefetch"] = -1
    try:
        shard_model(model, conds, **kw)
    finally:
        if before is not None:
            assert not any(isinstance(m, FSDPModule) for m in model.modules())
            for n, p in model.named_parameters():
                assert type(p) is nn.Parameter and p.equal(before[n]), n
    return {}


@pytest.mark.parametrize(
    ("case", "exc", "text"),
    [
        ("raises", "ShardConditionError",
         "shard condition _boom raised KeyError on module 'layers.1' (Block)"),
        ("nothing", "ValueError",
         "no module matched the shard conditions [by_name('nope'), by_type(GRU)]"),
        ("mesh3d", "ValueError", "dp_mesh must be 1-D (FSDP) or 2-D (HSDP"),
        ("sharded", "ValueError", "the model is already sharded: module '<root>'"),
        ("prefetch", "ValueError", "forward_prefetch must be an int >= 0"),
    ],
)
def test_bad_input_is_a_clear_error_on_every_rank(world, case, exc, text) -> None:
    res = world(2).run(_bad_shard, case, return_exceptions=True)
    for r in res:
        assert isinstance(r, RemoteError) and r.exc_type == exc, r
        assert text in r.message, r.message


def _logged_steps() -> list[str]:
    import logging

    records: list[str] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    log = logging.getLogger("fsdptk")
    handler, level = _Keep(), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        model = Tiny(tied=True)
        apply_activation_checkpointing(model, layers())
        shard_model(model, [layers(), by_name("head")], cpu_offload=False, forward_prefetch=1)
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    return records


def test_each_step_is_logged_once_on_rank_zero(world) -> None:
    rank0, rank1 = world(2).run(_logged_steps)
    assert rank1 == []
    assert sum("apply_activation_checkpointing: 3 modules" in m for m in rank0) == 1
    assert sum("applied fully_shard to 3 units + root over 2 shard ranks" in m for m in rank0) == 1
    assert sum("not sharding head separately" in m for m in rank0) == 1
    assert sum("explicit prefetch over 3 units (forward depth 1" in m for m in rank0) == 1


def _root_state_after_forward(root_reshard) -> tuple[str, str]:
    model = Tiny()
    shard_model(model, [layers()], cpu_offload=False, root_reshard_after_forward=root_reshard)
    with torch.no_grad():  # an eval forward: no backward comes to reshard the root
        model(torch.randint(0, V, (B, T)))
    after_forward = type(model.norm.weight).__name__
    model.reshard()
    return after_forward, type(model.norm.weight).__name__


def test_root_reshard_policy(world) -> None:
    w = world(2)
    assert w.run(_root_state_after_forward, None) == [("DTensor", "DTensor")] * 2
    # False: the root's parameters stay gathered (plain tensors) until backward or reshard()
    assert w.run(_root_state_after_forward, False) == [("Parameter", "DTensor")] * 2
    res = w.run(_root_state_after_forward, "yes", return_exceptions=True)
    assert all(r.exc_type == "TypeError" and "root_reshard_after_forward" in r.message
               for r in res)


def test_wrong_mesh_size_is_a_value_error() -> None:
    with pytest.raises(ValueError, match=r"dp_replicate \(2\) \* dp_shard \(3\) \* tp \(1\) = 6"):
        ParallelDims(dp_replicate=2, dp_shard=3, world_size=4)


@pytest.mark.gpu  # CPUOffloadPolicy needs an accelerator (FSDP2 copies offloaded parameters to it)
def test_cpu_offload_matches_single_process(tmp_path) -> None:
    # a one-rank group in this process: the persistent world is gloo on CPU, offload needs a device
    from torch.distributed.device_mesh import init_device_mesh

    dev = torch.accelerator.current_accelerator().type
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group(f"{dev}:{dist.Backend.default_device_backend_map[dev]},cpu:gloo",
                            store=store, rank=0, world_size=1)
    try:
        ref = _reference(0, False)
        model = _reference(0, False)
        shard_model(model, [layers()], cpu_offload=True, dp_mesh=init_device_mesh(dev, (1,)))
        assert all(p.to_local().device.type == "cpu" for p in model.parameters())
        x, y = _batches(0, 3, 1)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
        for step in range(3):
            _loss(model(x[step].to(dev)), y[step].to(dev)).backward()
            opt.step()
            opt.zero_grad()
            _loss(ref(x[step]), y[step]).backward()
            ref_opt.step()
            ref_opt.zero_grad()
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.full_tensor().cpu(), q.detach(), atol=1e-4, rtol=1e-4,
                                       msg=n)
    finally:
        dist.destroy_process_group()
