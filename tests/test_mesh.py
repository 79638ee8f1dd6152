"""ParallelDims: degree inference and validation (single process), meshes on 2 and 4 ranks."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from fsdptk import ParallelDims
from fsdptk.testing import RemoteError

_deg = st.integers(1, 4)


@given(_deg, _deg, _deg)
def test_dp_shard_is_inferred(rep: int, shard: int, tp: int) -> None:
    dims = ParallelDims(dp_replicate=rep, tp=tp, world_size=rep * shard * tp)
    assert (dims.dp_replicate, dims.dp_shard, dims.tp) == (rep, shard, tp)
    assert dims.dp_degree == rep * shard
    assert dims.hsdp_enabled == (rep > 1) and dims.tp_enabled == (tp > 1)
    names = dims.mesh_dim_names
    assert "dp_shard" in names and ("dp_replicate" in names) == (rep > 1)
    assert ("tp" in names) == (tp > 1)
    assert list(names) == [n for n in ("dp_replicate", "dp_shard", "tp") if n in names]
    prod = 1
    for s in dims.mesh_shape:
        prod *= s
    assert prod == dims.world_size


@given(_deg, _deg, _deg, st.integers(1, 64))
def test_wrong_product_names_every_degree(rep: int, shard: int, tp: int, world: int) -> None:
    if rep * shard * tp == world:
        assert ParallelDims(rep, shard, tp, world).dp_shard == shard
        return
    with pytest.raises(ValueError) as e:
        ParallelDims(dp_replicate=rep, dp_shard=shard, tp=tp, world_size=world)
    msg = str(e.value)
    for part in (f"dp_replicate ({rep})", f"dp_shard ({shard})", f"tp ({tp})",
                 f"world size ({world})"):
        assert part in msg


def test_inference_and_type_errors() -> None:
    with pytest.raises(ValueError, match=r"cannot infer dp_shard: world size \(6\).*tp \(4\)"):
        ParallelDims(tp=4, world_size=6)
    with pytest.raises(ValueError, match="dp_replicate must be >= 1, got 0"):
        ParallelDims(dp_replicate=0, world_size=2)
    with pytest.raises(ValueError, match="tp must be >= 1, got -1"):
        ParallelDims(tp=-1, world_size=2)
    with pytest.raises(TypeError, match="dp_shard must be an int"):
        ParallelDims(dp_shard=2.0, world_size=2)  # type: ignore[arg-type]
    assert ParallelDims().world_size == 1  # no process group: a single process
    assert ParallelDims().mesh_dim_names == ("dp_shard",)


def test_mesh_needs_a_process_group_and_a_build() -> None:
    dims = ParallelDims(world_size=1)
    with pytest.raises(RuntimeError, match="build_mesh"):
        _ = dims.fsdp_mesh
    with pytest.raises(RuntimeError, match="init_process_group"):
        dims.build_mesh("cpu")


def _mesh_facts(rep: int, shard: int, tp: int) -> dict:
    dims = ParallelDims(dp_replicate=rep, dp_shard=shard, tp=tp)
    mesh = dims.build_mesh("cpu")
    assert dims.build_mesh("cpu") is mesh
    fsdp = dims.fsdp_mesh
    tp_mesh = dims.tp_mesh if dims.tp_enabled else None
    return {
        "names": mesh.mesh_dim_names,
        "shape": tuple(mesh.shape),
        "fsdp_names": fsdp.mesh_dim_names,
        "fsdp_shape": tuple(fsdp.shape),
        "fsdp_ranks": sorted(fsdp.mesh.flatten().tolist()),
        "tp_ranks": sorted(tp_mesh.mesh.flatten().tolist()) if tp_mesh is not None else None,
        "dp_rank": dims.dp_rank,
        "rank": dist.get_rank(),
    }


@pytest.mark.parametrize(
    ("n", "rep", "shard", "tp", "names"),
    [
        (2, 1, -1, 1, ("dp_shard",)),
        (4, 2, -1, 1, ("dp_replicate", "dp_shard")),
        (4, 1, -1, 2, ("dp_shard", "tp")),
        (4, 2, 1, 2, ("dp_replicate", "dp_shard", "tp")),
        (2, 1, 1, 2, ("dp_shard", "tp")),
    ],
)
def test_build_mesh_and_slices(world, n, rep, shard, tp, names) -> None:
    res = world(n).run(_mesh_facts, rep, shard, tp)
    dims = ParallelDims(rep, shard, tp, world_size=n)
    for r in res:
        assert r["names"] == names and r["shape"] == dims.mesh_shape
        hsdp = rep > 1
        assert r["fsdp_names"] == (("dp_replicate", "dp_shard") if hsdp else ("dp_shard",))
        assert r["fsdp_shape"] == ((rep, dims.dp_shard) if hsdp else (dims.dp_shard,))
        assert r["rank"] in r["fsdp_ranks"] and len(r["fsdp_ranks"]) == dims.dp_degree
        if tp > 1:
            # TP is the innermost dim: its ranks are adjacent
            assert r["tp_ranks"] == list(range(r["rank"] // tp * tp, r["rank"] // tp * tp + tp))
    # dp ranks cover 0..dp_degree-1; the TP ranks of one group share a dp rank
    dp_ranks = [r["dp_rank"] for r in res]
    assert sorted(set(dp_ranks)) == list(range(dims.dp_degree))
    assert all(dp_ranks[i] == dp_ranks[i // tp * tp] for i in range(n))


def _build_wrong_size() -> None:
    ParallelDims(dp_shard=4, world_size=4).build_mesh("cpu")


def _tp_mesh_without_tp() -> None:
    dims = ParallelDims()
    dims.build_mesh("cpu")
    _ = dims.tp_mesh


def test_mesh_errors_on_every_rank(world) -> None:
    res = world(2).run(_build_wrong_size, return_exceptions=True)
    assert all(isinstance(r, RemoteError) and r.exc_type == "ValueError" for r in res)
    assert "process group has 2 ranks but ParallelDims was built for world size 4" in res[0].message
    res = world(2).run(_tp_mesh_without_tp, return_exceptions=True)
    assert all(isinstance(r, RemoteError) and "no TP mesh: tp=1" in r.message for r in res)


# ---------------------------------------------------------------------------------------------
# expert parallelism: ep borrows the ranks of dp_shard and tp
@given(_deg, _deg, _deg, st.integers(1, 8))
def test_ep_divides_dp_shard_times_tp_and_is_a_multiple_of_tp(rep: int, shard: int, tp: int, ep: int) -> None:
    world = rep * shard * tp
    if ep > 1 and ((shard * tp) % ep or ep % tp):
        with pytest.raises(ValueError) as e:
            ParallelDims(dp_replicate=rep, dp_shard=shard, tp=tp, ep=ep, world_size=world)
        assert f"ep ({ep})" in str(e.value)
        assert (f"dp_shard * tp ({shard} * {tp} = {shard * tp})" in str(e.value)
                or f"multiple of tp ({tp})" in str(e.value))
        return
    dims = ParallelDims(dp_replicate=rep, dp_shard=shard, tp=tp, ep=ep, world_size=world)
    assert dims.ep_enabled == (ep > 1) and dims.efsdp * ep == shard * tp
    assert dims.expert_mesh_dim_names == (("dp_replicate",) if rep > 1 else ()) + ("efsdp", "ep")
    prod = 1
    for s in dims.expert_mesh_shape:
        prod *= s
    assert prod == world  # the expert mesh covers the same ranks


def _expert_mesh_facts(kw: dict) -> dict:
    dims = ParallelDims(**kw)
    dims.build_mesh("cpu")
    ranks = lambda m: sorted(m.mesh.flatten().tolist())  # noqa: E731
    return {"ep": ranks(dims.ep_mesh), "efsdp": ranks(dims.expert_fsdp_mesh),
            "efsdp_names": dims.expert_fsdp_mesh.mesh_dim_names,
            "tp": ranks(dims.tp_mesh) if dims.tp_enabled else None, "rank": dist.get_rank()}


@pytest.mark.parametrize("kw, ep_groups, efsdp_groups", [
    ({"dp_shard": 4, "ep": 2}, [[0, 1], [2, 3]], [[0, 2], [1, 3]]),
    ({"dp_shard": 2, "tp": 2, "ep": 2}, [[0, 1], [2, 3]], [[0, 2], [1, 3]]),
    ({"dp_shard": 4, "ep": 4}, [[0, 1, 2, 3]], [[0], [1], [2], [3]]),
    ({"dp_replicate": 2, "dp_shard": 2, "ep": 2}, [[0, 1], [2, 3]], [[0, 2], [1, 3]]),
], ids=["ep2", "tp2-ep2", "ep4", "hsdp-ep2"])
def test_expert_mesh_groups(world, kw, ep_groups, efsdp_groups) -> None:
    for r in world(4).run(_expert_mesh_facts, kw):
        assert r["ep"] in ep_groups and r["rank"] in r["ep"]
        assert r["efsdp"] in efsdp_groups and r["rank"] in r["efsdp"]
        if r["tp"] is not None:  # an EP group holds whole TP groups
            assert set(r["tp"]) <= set(r["ep"])
        hsdp = "dp_replicate" in kw
        assert r["efsdp_names"] == (("dp_replicate", "efsdp") if hsdp else ("efsdp",))


def _expert_mesh_without_ep() -> None:
    dims = ParallelDims()
    dims.build_mesh("cpu")
    _ = dims.ep_mesh


def test_expert_mesh_without_ep_is_an_error(world) -> None:
    res = world(2).run(_expert_mesh_without_ep, return_exceptions=True)
    assert all(isinstance(r, RemoteError) and "no expert mesh: ep=1" in r.message for r in res)
