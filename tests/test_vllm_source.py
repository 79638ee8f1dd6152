"""``fsdptk.hf.weight_source`` against vLLM 0.33's own weight-transfer protocol.

These tests run only where ``vllm.distributed.weight_transfer.base`` imports (it does on CPU):
``bash scripts/test_vllm.sh`` makes such an environment (``.venv-vllm``: vLLM 0.33, torch 2.14,
transformers < 5.21) and runs them there. Elsewhere every test here is skipped.

On a tiny transformers Llama under FSDP2 at 2 ranks (tied and untied embeddings):

- the source is an instance of vLLM's ``WeightSource`` (vLLM's ``__init_subclass__`` checked that
  its ``metadata`` is a ``functools.cached_property``), implements ``iter_full`` and ``iter_local``,
  and every metadata record is vLLM's own ``ParamMeta`` (whose ``__post_init__`` validated it; a
  copy built from its fields is accepted and equal), the same on every rank;
- ``owners=1``: every record is owned by rank 0 alone, as vLLM's NCCL broadcast engine requires
  (it rejects a source whose first owner is not rank 0), and vLLM's own check of a sender's
  iteration against the metadata (``NCCLTrainerWeightTransferEngine._checked_iter``) passes;
- vLLM's ``ModuleSource`` on the same model yields the same tensors, bit for bit, under the module's
  names (for a Llama the Hub names, apart from a tied ``lm_head.weight``, which neither yields), and
  where fsdptk declares a tensor with ModuleSource's owners, mesh and placements, the same
  ``iter_local`` piece;
- each rank's ``iter_full`` and ``iter_local`` yield exactly ``owned_names(rank)`` in metadata order,
  and the source's ``owned_names`` is vLLM's base-class definition (the names whose records list
  the rank in ``owners``: vLLM's records say who yields a name in either mode);
- ``owners=2``: the union of both ranks' ``iter_full`` is the same set of tensors.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch


def _vllm_base() -> Any:
    return pytest.importorskip("vllm.distributed.weight_transfer.base")


def _config(tie: bool) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=128, tie_word_embeddings=tie)


def _sharded_llama(tie: bool) -> Any:
    """A tiny Llama under FSDP2 (one unit per decoder layer), rank 0's random weights scattered."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from fsdptk import load_from_full_model_state_dict, shard_model
    from fsdptk.hf import hf_meta_model, no_split_modules

    model = hf_meta_model(_config(tie))
    shard_model(model, no_split_modules(model), cpu_offload=False)
    full: dict[str, torch.Tensor] = {}
    if dist.get_rank() == 0:
        torch.manual_seed(0)
        full = AutoModelForCausalLM.from_config(_config(tie)).state_dict()
    load_from_full_model_state_dict(model, full, "cpu", strict=True, broadcast_from_rank0=True)
    return model


def _records(metadata: list[Any]) -> list[tuple]:
    """The metadata as plain, picklable values (to compare across ranks)."""
    return [(m.name, str(m.dtype), tuple(m.shape), m.owners, m.mesh_shape, repr(m.placements)) for m in metadata]


def _check_against_vllm(tie: bool) -> dict[str, Any]:
    """On every rank: the protocol checks for owners=1 and owners=2; returns what to compare."""
    import torch.distributed as dist

    import fsdptk.hf

    base = _vllm_base()
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _sharded_llama(tie)
    out: dict[str, Any] = {}
    for owners in (1, world):
        source = fsdptk.hf.weight_source(model, owners=owners)
        assert isinstance(source, base.WeightSource), type(source).__mro__
        assert source.implements_iter_full() and source.implements_iter_local()
        meta = source.metadata
        assert meta is source.metadata  # cached: engines read it repeatedly
        assert meta and all(type(m) is base.ParamMeta for m in meta)
        for m in meta:  # vLLM's __post_init__ accepts the record's fields again and gives an equal record
            again = base.ParamMeta(m.name, m.dtype, m.shape, owners=m.owners, mesh_shape=m.mesh_shape,
                                   placements=m.placements)
            assert again == m, (again, m)
            assert m.placements is None or all(isinstance(p, (base.Shard, base.Replicate)) for p in m.placements)
        if owners == 1:  # rank 0 owns every name: vLLM's NCCL broadcast engine needs owners[0] == 0
            assert all(m.owners == (0,) for m in meta), [(m.name, m.owners) for m in meta if m.owners != (0,)]
        full = list(source.iter_full())
        # vLLM: both modes yield exactly owned_names(rank), which its base class derives from the
        # records' owners; the source's own owned_names must agree with that definition
        assert source.owned_names(rank) == base.WeightSource.owned_names(source, rank)
        assert [n for n, _ in full] == source.owned_names(rank)
        by_name = {m.name: m for m in meta}
        for name, t in full:
            assert t.dtype == by_name[name].dtype and tuple(t.shape) == by_name[name].shape, name
            assert not isinstance(t, torch.distributed.tensor.DTensor)
        local = [(n, t.clone()) for n, t in source.iter_local()]
        assert [n for n, _ in local] == source.owned_names(rank)  # both modes: exactly the owned names
        out[f"meta{owners}"] = _records(meta)
        out[f"full{owners}"] = {n: t.clone() for n, t in full}
        out[f"local{owners}"] = dict(local)
        if owners == 1 and rank == 0:  # vLLM's own check of the sender's stream against the metadata
            try:
                from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerWeightTransferEngine
            except ImportError as e:  # pragma: no cover - the engine module needs what CPU builds lack
                out["checked_iter"] = f"skipped: {e}"
            else:
                checked = list(NCCLTrainerWeightTransferEngine._checked_iter(source, meta))
                assert [n for n, _ in checked] == [m.name for m in meta]
                out["checked_iter"] = len(checked)
    vllm_source = base.ModuleSource(model)
    out["module_names"] = [m.name for m in vllm_source.metadata]
    out["module_full"] = {n: t.clone() for n, t in vllm_source.iter_full()}  # every rank all-gathers
    # where fsdptk declares a tensor exactly as ModuleSource does (same owners, mesh and placements),
    # both iter_local yield the same piece on this rank
    module_local = {n: t.clone() for n, t in vllm_source.iter_local()}
    module_meta = {m.name: m for m in vllm_source.metadata}
    same_layout = 0
    for owners in (1, world):
        for m in _records_of(model, owners):
            theirs = module_meta.get(m.name)
            if theirs is None or (m.owners, m.mesh_shape, m.placements) != (
                    theirs.owners, theirs.mesh_shape, theirs.placements):
                continue
            if m.name in out[f"local{owners}"]:
                assert torch.equal(out[f"local{owners}"][m.name], module_local[m.name]), m.name
                same_layout += 1
    out["same_layout_pieces"] = same_layout
    return out


def _records_of(model: Any, owners: int) -> list[Any]:
    import fsdptk.hf

    return fsdptk.hf.weight_source(model, owners=owners).metadata


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_weight_source_is_a_vllm_weight_source_and_matches_module_source(world, tie):
    _vllm_base()
    res = world(2).run(_check_against_vllm, tie)
    r0, r1 = res
    for owners in (1, 2):  # metadata identical on every rank
        assert r0[f"meta{owners}"] == r1[f"meta{owners}"]
    assert isinstance(r0["checked_iter"], int) or r0["checked_iter"].startswith("skipped")

    ours = r0["full1"]  # owners=1: rank 0 has every name, rank 1 none
    assert r1["full1"] == {}
    theirs = r0["module_full"]
    assert sorted(theirs) == sorted(r1["module_full"])
    # Hub names vs module names: the same for a Llama; a tied lm_head.weight is in neither
    # (save_pretrained leaves it out, named_parameters() lists the shared Parameter once)
    assert sorted(ours) == sorted(theirs), (sorted(set(ours) ^ set(theirs)))
    if tie:
        assert "lm_head.weight" not in ours
    for name, t in ours.items():
        assert torch.equal(t, theirs[name]), name
        assert torch.equal(t, r1["module_full"][name]), name

    # owners=2: the names split between the ranks, the union the same tensors
    split = [set(r["full2"]) for r in res]
    assert not split[0] & split[1] and split[0] | split[1] == set(ours)
    assert all(split), "owners=2 gives each rank some names on this model"
    for r in res:
        for name, t in r["full2"].items():
            assert torch.equal(t, ours[name]), name
