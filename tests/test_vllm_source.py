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
- ``owners=2``: the union of both ranks' ``iter_full`` is the same set of tensors;
- ``owners="all"``: every rank owns every name (what vLLM's IPC engine checks), every record passes
  vLLM's M2N conversion (``m2n_param_meta``: owned by every rank in rank order) and each
  ``iter_local`` piece has the shape M2N's layout math implies (``expected_local_shape``, the check
  of its sender); ``iter_full`` gives every rank every tensor.
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
    """On every rank: the protocol checks for owners=1, owners=2 and owners="all"; returns what to
    compare across ranks."""
    import torch.distributed as dist

    import fsdptk.hf

    base = _vllm_base()
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _sharded_llama(tie)
    vllm_source = base.ModuleSource(model)
    module_meta = {m.name: m for m in vllm_source.metadata}
    module_local = {n: t.clone() for n, t in vllm_source.iter_local()}
    out: dict[str, Any] = {"module_full": {n: t.clone() for n, t in vllm_source.iter_full()},  # all-gathers
                           "same_layout_pieces": 0}
    for owners in (1, world, "all"):
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
        local = {n: t.clone() for n, t in source.iter_local()}
        assert list(local) == source.owned_names(rank)  # both modes: exactly the owned names
        for m in meta:  # a record laid out as ModuleSource lays it out: the same iter_local piece
            theirs = module_meta.get(m.name)
            if m.name in local and theirs is not None and (m.owners, m.mesh_shape, m.placements) == (
                    theirs.owners, theirs.mesh_shape, theirs.placements):
                assert torch.equal(local[m.name], module_local[m.name]), m.name
                out["same_layout_pieces"] += 1
        if owners == "all":
            _check_m2n_and_ipc(source, local, rank, world)
        key = str(owners)
        out[f"meta{key}"] = _records(meta)
        out[f"full{key}"] = {n: t.clone() for n, t in full}
        if owners == 1:  # as vLLM's NCCL engine drives it: the sender checks its stream against the
            # metadata (its own _checked_iter), the other ranks only drive iter_full
            from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerWeightTransferEngine

            if rank == 0:
                checked = list(NCCLTrainerWeightTransferEngine._checked_iter(source, meta))
                assert [n for n, _ in checked] == [m.name for m in meta]
            else:
                assert list(source.iter_full()) == []
    return out


def _check_m2n_and_ipc(source: Any, local: dict[str, torch.Tensor], rank: int, world: int) -> None:
    """owners="all" as vLLM's M2N and IPC engines read it (their own checks, on CPU)."""
    from vllm.distributed.weight_transfer.m2n_common import (
        check_transferable,
        expected_local_shape,
        m2n_param_meta,
    )

    # IPC (trainer_init): every rank owns every parameter
    assert len(source.owned_names(rank)) == len(source.metadata)
    for m in source.metadata:
        m2n = m2n_param_meta(m, world)  # raises unless owned by every rank in rank order
        check_transferable(m.name, m.dtype, m.shape)
        # M2N's _send: the piece iter_local yields has the shape the record's layout implies
        assert tuple(local[m.name].shape) == expected_local_shape(m2n), (m.name, m, tuple(local[m.name].shape))


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_weight_source_is_a_vllm_weight_source_and_matches_module_source(world, tie):
    _vllm_base()
    res = world(2).run(_check_against_vllm, tie)
    r0, r1 = res
    for owners in ("1", "2", "all"):  # metadata identical on every rank
        assert r0[f"meta{owners}"] == r1[f"meta{owners}"]

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
    # owners="all": every rank gets every tensor whole, as ModuleSource.iter_full gives it; and the
    # dim-0 FSDP shards are declared as ModuleSource declares them (the same iter_local pieces)
    for r in res:
        assert sorted(r["fullall"]) == sorted(ours)
        assert all(torch.equal(t, ours[name]) for name, t in r["fullall"].items())
        assert r["same_layout_pieces"] > 0
