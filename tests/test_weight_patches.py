"""``weight_source(..., track_changes=True).iter_patches()`` (issue "Only what changed"): delta weight
sync in checkpoint coordinates.

Judged by transformers, never by fsdptk: after each AdamW step (fp32 master, bf16 on the wire) the
stepped model is gathered with torch's own full state dict (``get_model_state_dict``), loaded into
a single-process transformers model and written with ``save_pretrained``; the engine (seeded by
``iter_full``, then patched) must equal that checkpoint cast to the wire dtype, bit for bit, and the
patches' indices must be exactly the elements whose wire bits changed since the previous step (none
missing, none extra). Where vLLM 0.33 imports (the vLLM leg, ``bash scripts/test_vllm.sh``, runs this file's cases
too) the patches are applied by vLLM's own ``load_checkpoint_weight_patches`` to an engine-side
module whose ``load_weights`` is vLLM's ``default_weight_loader`` per Hub name, each patch first
accepted by vLLM's sparse trainer engine's validation; elsewhere by index (``index_copy_`` of the
flat tensor, as vLLM's loader does).

Also: what crosses ranks in a patch pass is at most an int32 index and a bf16 value per changed
element (plus each message's alignment), counted at the engine's wire; the ranks' baselines together
hold every Hub element once in bf16, no rank more than its own shards; abandoned passes (a patch
pass and a full pass whose first items the engine applied) are made exact by the next patch pass;
merged LoRA adapters are judged by PEFT's ``merge_and_unload().save_pretrained``; the errors come on
every rank before anything is yielded. vLLM's own judge is tests/test_vllm_patches.py.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

transformers = pytest.importorskip("transformers")

from _tiny_hub import bits as _bits  # noqa: E402
from _tiny_hub import config as _config  # noqa: E402
from _tiny_hub import save_full as _save_full  # noqa: E402
from _tiny_hub import step as _step  # noqa: E402
from _tiny_hub import tensors as _tensors  # noqa: E402

MESHES = {"fsdp2": (2, {"dp_shard": 2}), "fsdp4": (4, {"dp_shard": 4}), "tp": (4, {"dp_shard": 2, "tp": 2}),
          "hsdp": (4, {"dp_replicate": 2, "dp_shard": 2}), "ep": (4, {"dp_shard": 4, "ep": 2}),
          "tp_ep": (4, {"dp_shard": 2, "tp": 2, "ep": 2})}


def _rows(patches) -> list[tuple]:
    """Patches as picklable rows, checked for the record's contract on the way."""
    out = []
    for p in patches:
        assert p.indices.dtype == torch.int32 and p.indices.dim() == 1 and p.indices.is_contiguous(), p.name
        assert p.values.dim() == 1 and p.values.is_contiguous() and p.values.numel() == p.indices.numel(), p.name
        assert p.indices.numel() > 0, f"{p.name}: an empty patch"
        assert bool((p.indices[1:] > p.indices[:-1]).all()), f"{p.name}: indices not strictly ascending"
        out.append((p.name, p.indices.clone(), p.values.clone(), tuple(p.full_shape)))
    return out


def _sync(src: str, family: str, dims_kw: dict, owners, lr: float, steps: int, out: str) -> dict:
    """Seed an engine with iter_full, then after each AdamW step patch it; save_pretrained of each
    stepped model under ``out/step{k}`` (rank 0)."""
    from fsdptk import ParallelDims
    from fsdptk.hf import from_pretrained, weight_source

    model = from_pretrained(src, dims=ParallelDims(**dims_kw))
    source = weight_source(model, owners=owners, dtype=torch.bfloat16, track_changes=True)
    seed = {n: t.clone() for n, t in source.iter_full()}
    _save_full(model, family, Path(out) / "step0")
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    rows, sent = [], []
    for k in range(1, steps + 1):
        _step(model, opt, k)
        with _bytes_sent() as counter:
            rows.append(_rows(source.iter_patches()))
        sent.append(counter[0])
        _save_full(model, family, Path(out) / f"step{k}")
    again = _rows(source.iter_patches())  # no step since the last pass: nothing anywhere
    tracker = source._tracker
    return {"seed": seed, "patches": rows, "again": again, "owned": source.owned_names(dist.get_rank()),
            "sent": sent, "baseline_bytes": sum(t.nbytes for t in [*tracker.base.values(), *tracker.full.values()]),
            "local_elements": sum(t.to_local().numel() if hasattr(t, "to_local") else t.numel()
                                  for t in model.state_dict().values())}  # parameters and buffers


@contextmanager
def _bytes_sent():
    """Within the block: the bytes this rank posts to other ranks through the engine's wire."""
    from fsdptk._engine import wire

    counter = [0]
    real = wire.isend

    def counting(tensor, peer):
        counter[0] += tensor.numel() * tensor.element_size()
        return real(tensor, peer)

    wire.isend = counting
    try:
        yield counter
    finally:
        wire.isend = real


def _vllm() -> Any:
    """vLLM 0.33's sparse engine module where it imports (the vLLM leg), else None."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return None
    try:
        from vllm.distributed.weight_transfer import sparse_nccl_engine
    except ImportError:
        return None
    return sparse_nccl_engine


class _EngineModule(torch.nn.Module):
    """The engine's tensors (shared, not copied) as parameters under their Hub names, loaded through
    vLLM's ``default_weight_loader`` as a vLLM model's ``load_weights`` loads checkpoint tensors."""

    def __init__(self, engine: dict[str, torch.Tensor]) -> None:
        super().__init__()
        for name, t in engine.items():
            *path, leaf = name.split(".")
            mod: torch.nn.Module = self
            for part in path:
                if part not in mod._modules:
                    mod.add_module(part, torch.nn.Module())
                mod = mod._modules[part]  # type: ignore[assignment]
            mod.register_parameter(leaf, torch.nn.Parameter(t, requires_grad=False))

    def load_weights(self, weights) -> set[str]:
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        params = dict(self.named_parameters())
        for name, tensor in weights:
            default_weight_loader(params[name], tensor)
        return {name for name, _ in weights}


def _apply(engine: dict[str, torch.Tensor], rows: list[tuple]) -> None:
    """The patches applied to the engine: by vLLM's own ``load_checkpoint_weight_patches`` where vLLM
    imports (each patch first accepted by its sparse trainer engine's validation, then converted as
    its ``receive_weights`` converts it), else by ``index_copy_`` of the flat tensor."""
    vllm = _vllm()
    if vllm is None:
        for name, idx, vals, shape in rows:
            t = engine[name]
            assert tuple(t.shape) == shape, (name, t.shape, shape)
            t.view(-1).index_copy_(0, idx.long(), vals.to(t.dtype))
        return
    from vllm.model_executor.model_loader.checkpoint_weight_patch import (
        CheckpointWeightPatch,
        load_checkpoint_weight_patches,
    )

    patches = []
    for name, idx, vals, shape in rows:
        patch = vllm.SparseWeightPatch(name, idx, vals, shape)
        vllm.SparseNCCLTrainerWeightTransferEngine._validate_patch(patch)
        patches.append(CheckpointWeightPatch(name=name, shape=tuple(shape), dtype=vals.dtype, values=vals,
                                             indices=idx))
    if patches:
        loaded = load_checkpoint_weight_patches(_EngineModule(engine), patches)
        assert loaded == {p.name for p in patches}, loaded


def _check_bytes_and_memory(results: list[dict], ckpt: list[dict[str, torch.Tensor]]) -> None:
    """Only changed elements cross ranks, each once to each owner: what every rank posted in a patch
    pass is at most 6 bytes (an int32 index and a bf16 value) per changed element and owner, plus each
    message's alignment (16 bytes for each of a piece's two parts). The baseline: the ranks together keep each Hub
    element once, in bf16 (2 bytes), and no rank more than its own shards' elements."""
    steps = len(results[0]["sent"])
    names = len(ckpt[0])
    owners = max(sum(n in r["owned"] for r in results) for n in ckpt[0])  # per name: 1, or every rank
    for k in range(1, steps + 1):
        changed = sum(int((_bits(ckpt[k][n]) != _bits(ckpt[k - 1][n])).sum()) for n in ckpt[k])
        sent = sum(r["sent"][k - 1] for r in results)
        assert sent <= owners * (6 * changed + 32 * names * len(results)), (k, sent, changed, owners)
    if all("baseline_bytes" in r for r in results):
        hub_elements = sum(t.numel() for t in ckpt[0].values())
        assert sum(r["baseline_bytes"] for r in results) == 2 * hub_elements
        for r in results:
            assert r["baseline_bytes"] <= 2 * r["local_elements"], (r["baseline_bytes"], r["local_elements"])


def _check(results: list[dict], out: Path, steps: int) -> None:
    ckpt = [{n: t.to(torch.bfloat16) if t.is_floating_point() else t for n, t in _tensors(out / f"step{k}").items()}
            for k in range(steps + 1)]
    engine: dict[str, torch.Tensor] = {}
    for r in results:
        engine.update(r["seed"])
        assert r["again"] == [], [row[0] for row in r["again"]]
    assert set(engine) == set(ckpt[0]), set(engine) ^ set(ckpt[0])
    for n, t in engine.items():
        assert torch.equal(_bits(t), _bits(ckpt[0][n])), n
    for k in range(1, steps + 1):
        got: dict[str, torch.Tensor] = {}
        values: dict[str, torch.Tensor] = {}
        for r in results:
            rows = r["patches"][k - 1]
            assert all(name in r["owned"] for name, *_ in rows)
            fresh = []
            for row in rows:
                name, idx, vals, _ = row
                if name in got:  # several owners of one name (owners="all"): the same patch on each
                    assert torch.equal(got[name], idx.long()) and torch.equal(_bits(values[name]), _bits(vals)), name
                    continue
                got[name], values[name] = idx.long(), vals
                fresh.append(row)
            _apply(engine, fresh)
        for n, want in ckpt[k].items():
            changed = (_bits(want) != _bits(ckpt[k - 1][n])).view(-1).nonzero().squeeze(1)
            idx = got.get(n, torch.empty(0, dtype=torch.long))
            assert torch.equal(idx, changed), (f"step {k} {n}: {idx.numel()} indices sent, {changed.numel()} "
                                               "elements changed")
            assert torch.equal(_bits(engine[n]), _bits(want)), f"step {k} {n}: the engine differs"
        assert got, f"step {k}: nothing changed at all"
    if "sent" in results[0]:
        _check_bytes_and_memory(results, ckpt)



CASES = [("llama", "fsdp2", 1), ("llama_tied", "fsdp4", 4), ("llama", "hsdp", 2), ("llama", "tp", "all"),
         ("qwen3_moe", "ep", 1), ("qwen3_moe", "tp_ep", 4), ("mixtral", "ep", 4), ("deepseek_v3", "fsdp4", 1)]


@pytest.mark.parametrize(("family", "mesh", "owners"), CASES, ids=[f"{f}-{m}-owners{o}" for f, m, o in CASES])
def test_patches_bring_the_engine_to_save_pretrained_exactly(world, hub, tmp_path, family, mesh, owners) -> None:
    n, dims_kw = MESHES[mesh]
    steps = 2
    results = world(n).run(_sync, str(hub(family)), family, dims_kw, owners, 1e-4, steps, str(tmp_path),
                           timeout=240)
    _check(results, tmp_path, steps)


# ----------------------------------------------------------------------------------------------
# abandoned passes: the engine applied any prefix; the next patch pass makes it exact
def _holds(p, index: tuple[int, ...]) -> tuple[torch.Tensor, tuple[int, ...]] | None:
    """This rank's local tensor of ``p`` and ``index`` in it, when it holds that element."""
    from torch.distributed.tensor import DTensor

    from fsdptk._engine.layouts import dtensor_box

    if not isinstance(p, DTensor):
        return p.data, index
    box = dtensor_box(p)
    local = []
    for b, i in zip(box, index):
        positions = list(range(b.start, b.stop)) if isinstance(b, slice) else list(b)
        if i not in positions:
            return None
        local.append(positions.index(i))
    return p.to_local(), tuple(local)


def _abandon(src: str, family: str, dims_kw: dict, owners, out: str) -> dict:
    """Seed; change one element by hand; a patch pass the leaver abandons after applying its first
    patch; the element changed back by hand, a step; a complete patch pass (checkpoint ``a``);
    a step; a full pass the leaver abandons after applying its first two tensors; a step; a
    complete patch pass (checkpoint ``b``). Every rank applies what it was handed."""
    from fsdptk import ParallelDims
    from fsdptk.hf import from_pretrained, weight_source

    rank = dist.get_rank()
    model = from_pretrained(src, dims=ParallelDims(**dims_kw))
    source = weight_source(model, owners=owners, dtype=torch.bfloat16, track_changes=True)
    first = source.metadata[0]
    leaver = first.owners[0]
    engine = {n: t.clone() for n, t in source.iter_full()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    embed = model.get_input_embeddings().weight
    held = _holds(embed, (5, 3))
    old = None
    last = source.metadata[-1]  # changed by hand too: handed out after the leaver left, so never applied
    assert last.owners == first.owners, "the leaver owns the last name too"
    tail = _holds(dict(model.named_parameters())[last.name], (0,) * len(last.shape))
    with torch.no_grad():
        if held is not None:
            old = held[0][held[1]].clone()
            held[0][held[1]] += 1.0
        if tail is not None:
            tail[0][tail[1]] += 1.0  # an Adam step of 1e-4 leaves its bf16 bits as they are
    errors = []

    def drain(it, stop_after: int | None, apply) -> None:
        try:
            for i, item in enumerate(it):
                apply(item)
                if rank == leaver and stop_after is not None and i + 1 == stop_after:
                    break
        except RuntimeError as e:
            errors.append(str(e))

    def apply_patch(p) -> None:
        _apply(engine, _rows([p]))  # vLLM's loader where vLLM imports

    def apply_full(pair) -> None:
        engine[pair[0]].copy_(pair[1])

    drain(source.iter_patches(), 1, apply_patch)  # the leaver applied the first by-hand change, then left
    if held is not None:
        with torch.no_grad():
            held[0][held[1]] = old  # changed back: in no plain diff against the old baseline
    _step(model, opt, 1)
    drain(source.iter_patches(), None, apply_patch)
    _save_full(model, family, Path(out) / "a")
    after_a = {n: t.clone() for n, t in engine.items()}
    _step(model, opt, 2)
    drain(source.iter_full(), 2, apply_full)
    _step(model, opt, 3)
    drain(source.iter_patches(), None, apply_patch)
    _save_full(model, family, Path(out) / "b")
    return {"a": after_a, "b": engine, "errors": errors, "leaver": leaver, "first": first.name}


@pytest.mark.parametrize(("family", "mesh", "owners"), [("llama", "fsdp4", 1), ("qwen3_moe", "ep", 1)],
                         ids=["llama-fsdp4-owners1", "qwen3_moe-ep-owners1"])
def test_an_abandoned_pass_whose_prefix_the_engine_applied_is_made_exact(world, hub, tmp_path, family, mesh,
                                                                           owners) -> None:
    n, dims_kw = MESHES[mesh]
    results = world(n).run(_abandon, str(hub(family)), family, dims_kw, owners, str(tmp_path), timeout=240)
    leaver = results[0]["leaver"]
    for r, res in enumerate(results):  # the leaver left quietly twice; every other rank raised twice, naming it
        if r == leaver:
            assert res["errors"] == [], res["errors"]
        else:
            assert len(res["errors"]) == 2 and all(f"rank {leaver} stopped" in e for e in res["errors"]), res["errors"]
    for tag in ("a", "b"):
        want = {k: t.to(torch.bfloat16) for k, t in _tensors(tmp_path / tag).items()}
        got: dict[str, torch.Tensor] = {}
        for res in results:
            got.update(res[tag])
        assert set(got) == set(want)
        bad = [k for k in want if not torch.equal(_bits(got[k]), _bits(want[k]))]
        assert not bad, f"{tag}: the engine differs at {bad[:5]}"


# ----------------------------------------------------------------------------------------------
# merged LoRA adapters: compared on their owners (the merge needs the whole factors)
_LORA = {"llama": {"target_modules": ["q_proj", "v_proj"]},
         "qwen3_moe": {"target_modules": ["q_proj"], "target_parameters": ["mlp.experts.gate_up_proj",
                                                                          "mlp.experts.down_proj"]}}


def _peft_model(src: str, family: str):
    import peft

    base = transformers.AutoModelForCausalLM.from_pretrained(src)
    torch.manual_seed(1)
    return peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, **_LORA[family]))


def _lora_sync(src: str, family: str, dims_kw: dict, owners, out: str) -> dict:
    """A PEFT LoRA model sharded (FSDP, or EP then FSDP), streamed merged: seeded by iter_full, then
    patched after each AdamW step of the adapters; rank 0 saves PEFT's own
    ``merge_and_unload().save_pretrained`` of the stepped adapters (torch's full state dict loaded
    into an unsharded copy) under ``out/step{k}``."""
    import copy

    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from fsdptk import ParallelDims, shard_model
    from fsdptk.hf import no_split_modules, weight_source

    model = _peft_model(src, family)
    dims = ParallelDims(**dims_kw)
    dims.build_mesh("cpu")
    experts = []
    if dims.ep > 1:
        from fsdptk import apply_ep
        from fsdptk.hf import hf_ep_plan

        experts = hf_ep_plan(model)
        apply_ep(model, dims.ep_mesh, experts)
    shard_model(model, no_split_modules(model), cpu_offload=False, dp_mesh=dims.fsdp_mesh,
                expert_dp_mesh=dims.expert_fsdp_mesh if experts else None)
    source = weight_source(model, adapters="merged", owners=owners, dtype=torch.bfloat16, track_changes=True)
    seed = {n: t.clone() for n, t in source.iter_full()}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    rows = []
    for k in range(1, 3):
        _step(model, opt, k)
        rows.append(_rows(source.iter_patches()))
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if dist.get_rank() == 0:
            ref = _peft_model(src, family)
            ref.load_state_dict(full, strict=True)
            copy.deepcopy(ref).merge_and_unload().save_pretrained(Path(out) / f"step{k}")
        dist.barrier()
    if dist.get_rank() == 0:  # step 0: the adapters as they were seeded
        _peft_model(src, family).merge_and_unload().save_pretrained(Path(out) / "step0")
    return {"seed": seed, "patches": rows, "again": _rows(source.iter_patches()),
            "owned": source.owned_names(dist.get_rank())}


@pytest.mark.parametrize(("family", "mesh", "owners"), [("llama", "fsdp2", 1), ("qwen3_moe", "ep", 4)],
                         ids=["llama-fsdp2-owners1", "qwen3_moe-ep-owners4"])
def test_merged_lora_patches_are_merge_and_unloads_changes(world, hub, tmp_path, family, mesh, owners) -> None:
    n, dims_kw = MESHES[mesh]
    results = world(n).run(_lora_sync, str(hub(family)), family, dims_kw, owners, str(tmp_path), timeout=240)
    _check(results, tmp_path, 2)


# ----------------------------------------------------------------------------------------------
# errors: on every rank, before anything is yielded
def _errors(src: str) -> dict:
    from fsdptk import ParallelDims
    from fsdptk.hf import from_pretrained, weight_source

    rank = dist.get_rank()
    model = from_pretrained(src, dims=ParallelDims(dp_shard=2))
    out: dict[str, str] = {}

    def catch(tag: str, fn) -> None:
        try:
            fn()
        except (ValueError, TypeError) as e:
            out[tag] = f"{type(e).__name__}: {e}"

    plain = weight_source(model)
    catch("untracked", lambda: list(plain.iter_patches()))
    source = weight_source(model, dtype=torch.bfloat16, track_changes=True)
    catch("no_baseline", lambda: list(source.iter_patches()))
    it = source.iter_full()  # a first pass abandoned on rank 0: still no baseline
    try:
        for _ in it:
            if rank == 0:
                break
    except RuntimeError:
        pass
    del it
    catch("abandoned_first", lambda: list(source.iter_patches()))
    list(source.iter_full())
    norm = model.model.norm.weight
    with torch.no_grad():
        if rank == 1:  # rank 1's shard only: every rank raises, before anything is yielded
            norm.to_local()[:3] = float("nan")
    got: list = []
    catch("nan", lambda: got.extend(source.iter_patches()))
    out["yielded_before_nan"] = str(len(got))
    catch("quantize", lambda: weight_source(model, quantize="fp8", track_changes=True))
    catch("bool", lambda: weight_source(model, track_changes="yes"))
    return out


def test_errors_are_raised_on_every_rank_before_anything_is_yielded(world, hub) -> None:
    results = world(2).run(_errors, str(hub("llama")), timeout=180)
    assert len(results) == 2
    for res in results:
        assert "track_changes=True" in res["untracked"], res
        assert "no baseline: run iter_full first" in res["no_baseline"], res
        assert "no baseline" in res["abandoned_first"], res
        assert "'model.norm.weight': 3 changed elements NaN now" in res["nan"], res
        assert res["yielded_before_nan"] == "0"
        assert "track_changes=True with quantize='fp8'" in res["quantize"], res
        assert res["bool"].startswith("TypeError: track_changes must be a bool"), res


def test_a_hub_tensor_int32_indices_cannot_address_is_refused_at_creation() -> None:
    from fsdptk.hf import weight_source

    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.zeros(1, 1).expand(2**31, 1))  # 2**31 elements, one stored
    with pytest.raises(ValueError, match=r"'w' has 2147483648 elements .* int32 flat indices"):
        weight_source(model, track_changes=True)
    weight_source(model)  # without tracking it is fine


def test_a_changed_integer_tensor_is_refused_by_name() -> None:
    from fsdptk.hf import weight_source

    model = torch.nn.Linear(3, 2)
    model.register_buffer("count", torch.zeros(2, dtype=torch.int64))
    source = weight_source(model, track_changes=True)
    list(source.iter_full())
    model.count += 1
    with pytest.raises(ValueError, match="'count': an integer tensor changed"):
        list(source.iter_patches())


# ----------------------------------------------------------------------------------------------
# properties: the index map, and the round trip on one process
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@st.composite
def _boxes(draw):
    """A shape and a box in it: per dim a slice or an ascending tuple of indices (_StridedShard's)."""
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=4)))
    box = []
    for n in shape:
        if draw(st.booleans()):
            a = draw(st.integers(0, n - 1))
            box.append(slice(a, draw(st.integers(a + 1, n))))
        else:
            box.append(tuple(sorted(draw(st.sets(st.integers(0, n - 1), min_size=1)))))
    return shape, tuple(box)


@settings(max_examples=60, deadline=None)
@given(_boxes(), st.data())
def test_local_positions_map_to_the_hub_tensors_flat_indices(case, data) -> None:
    from fsdptk._engine.layouts import box_shape, extract
    from fsdptk.hf._weight_patches import hub_flat

    shape, box = case
    numbered = torch.arange(torch.Size(shape).numel()).view(shape)  # each element its own flat index
    piece = extract(numbered, box)
    assert tuple(piece.shape) == box_shape(box)
    local = torch.tensor(sorted(data.draw(st.sets(st.integers(0, piece.numel() - 1), max_size=8))),
                         dtype=data.draw(st.sampled_from([torch.int32, torch.int64])))  # int32: a comparison's
    got = hub_flat(local, box, shape)
    assert got.dtype == torch.int32  # under 2**31 elements: the patch's own index dtype
    assert got.tolist() == piece.reshape(-1)[local.long()].tolist()


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**31 - 1), st.lists(st.tuples(st.integers(0, 5), st.integers(0, 3)), min_size=1, max_size=12),
       st.sampled_from([None, 1000]))
def test_patches_round_trip_on_one_process(seed, edits, bucket_bytes) -> None:
    """A model with fused experts (per-expert Hub tensors): random edits (bf16 rounding may hide
    some) patched into a copy of the first full pass equal the next full pass, and the indices are
    exactly the elements whose bf16 bits changed; also compared in chunks of a tiny bucket (1000
    bytes: 333 bf16 elements, most pieces cut in many)."""
    from fsdptk.hf import weight_source

    torch.manual_seed(seed % 1000)
    model = transformers.AutoModelForCausalLM.from_config(_config("qwen3_moe"))
    source = weight_source(model, dtype=torch.bfloat16, track_changes=True, bucket_bytes=bucket_bytes)
    engine = {n: t.clone() for n, t in source.iter_full()}
    before = {n: t.clone() for n, t in engine.items()}
    params = list(model.parameters())
    with torch.no_grad():
        for which, scale in edits:
            p = params[(which * 7 + seed) % len(params)]
            flat = p.view(-1)
            flat[(seed + which) % flat.numel()] += 10.0 ** -scale  # 1e-3 may round away in bf16
    patches = list(source.iter_patches())
    _apply(engine, _rows(patches))
    now = dict(source.iter_full())
    for n, t in now.items():
        assert torch.equal(_bits(engine[n]), _bits(t)), n
        changed = (_bits(t) != _bits(before[n])).view(-1).nonzero().squeeze(1)
        got = next((p.indices.long() for p in patches if p.name == n), torch.empty(0, dtype=torch.long))
        assert torch.equal(got, changed), n


@settings(max_examples=80, deadline=None)
@given(st.integers(0, 700), st.data())
def test_positions_are_the_set_elements_at_any_density(n, data) -> None:
    from fsdptk.hf._weight_patches import positions

    set_ = data.draw(st.sets(st.integers(0, max(n - 1, 0)), max_size=n)) if n else set()
    start = data.draw(st.integers(0, 9))  # a mask that starts inside its storage too
    mask = torch.zeros(n + start, dtype=torch.bool)
    mask[[start + i for i in set_]] = True
    assert positions(mask[start:]).tolist() == sorted(set_)


# ----------------------------------------------------------------------------------------------
# the full pass moves the wire dtype: each holder casts before it sends
def _full_pass_bytes(src: str) -> dict:
    from fsdptk import ParallelDims
    from fsdptk.hf import from_pretrained, weight_source

    model = from_pretrained(src, dims=ParallelDims(dp_shard=2))
    out = {}
    for dtype in (None, torch.bfloat16):
        source = weight_source(model, dtype=dtype)
        with _bytes_sent() as counter:
            got = {n: t.clone() for n, t in source.iter_full()}
        out[str(dtype)] = (counter[0], got)
    out["local_bytes"] = sum(t.to_local().numel() * t.element_size() for t in model.state_dict().values()
                             if hasattr(t, "to_local"))
    return out


def test_a_bf16_full_pass_of_an_fp32_model_moves_half_the_bytes(world, hub) -> None:
    results = world(2).run(_full_pass_bytes, str(hub("llama")), timeout=180)
    sent_fp32 = results[1]["None"][0]
    sent_bf16 = results[1]["torch.bfloat16"][0]
    assert sent_fp32 >= results[1]["local_bytes"] > 0  # rank 1 sends rank 0 its shards
    assert sent_bf16 <= sent_fp32 // 2 + 16 * 64, (sent_bf16, sent_fp32)  # cast before sending (+ alignment)
    _, full32_0 = results[0]["None"]
    _, full16_0 = results[0]["torch.bfloat16"]
    assert set(full16_0) == set(full32_0) and full16_0
    for n, t in full32_0.items():  # the cast of the full tensor, bit for bit
        assert full16_0[n].dtype == torch.bfloat16 and torch.equal(_bits(full16_0[n]), _bits(t.to(torch.bfloat16))), n


@settings(max_examples=80, deadline=None)
@given(st.sampled_from([torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.float8_e4m3fn]),
       st.integers(0, 300), st.integers(0, 7), st.data())
def test_changed_positions_are_the_elements_whose_bits_differ(dtype, n, start, data) -> None:
    """Word-wise comparison equals the element-wise one, at any length, storage offset and dtype,
    with NaN (same bits: unchanged) and -0 / +0 (different bits: changed)."""
    from fsdptk.hf._weight_patches import changed_positions

    base = torch.randn(n + start).to(dtype)
    new = base.clone()
    for i in data.draw(st.sets(st.integers(0, max(n - 1, 0)), max_size=n)) if n else []:
        new[start + i] = data.draw(st.sampled_from([1.5, -0.0, 0.0, float("nan"), -2.0]))
    if n:
        base[start] = float("nan")
        new[start] = float("nan")  # NaN on both sides, the same bits
    a, b = new[start:], base[start:]
    want = (_bits(a) != _bits(b)).nonzero().squeeze(1)
    assert torch.equal(changed_positions(a, b), want)


@st.composite
def _views(draw):
    """A tensor of 1-4 dims, any sizes, as a view of a larger one: permuted dims, a step, an offset."""
    shape = draw(st.lists(st.integers(0, 7), min_size=1, max_size=4))
    steps = [draw(st.integers(1, 2)) for _ in shape]
    base = torch.arange(torch.Size([n * k + 1 for n, k in zip(shape, steps)]).numel())
    t = base.view([n * k + 1 for n, k in zip(shape, steps)])
    t = t[tuple(slice(1 if draw(st.booleans()) else 0, None, k) for k in steps)]
    t = t[tuple(slice(0, n) for n in shape)]
    return t.permute(draw(st.permutations(range(len(shape)))))


@settings(max_examples=100, deadline=None)
@given(_views(), st.integers(1, 40))
def test_chunks_cover_a_view_in_order_each_within_the_bound(t, elements) -> None:
    """The comparison's chunks: consecutive runs of the flat C order, none over ``elements``, each
    a view (no copy), whatever the layout."""
    from fsdptk.hf._weight_patches import chunks

    flat = t.reshape(-1)
    at = 0
    for off, part in chunks(t, elements):
        assert off == at and part.numel() <= elements
        assert part.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()  # a view
        assert torch.equal(part.reshape(-1), flat[off:off + part.numel()])
        at += part.numel()
    assert at == t.numel()


@settings(max_examples=25, deadline=None)
@given(st.integers(24, 96), st.lists(st.tuples(st.integers(0, 2), st.integers(0, 10_000)), max_size=40),
       st.booleans())
def test_chunked_comparison_finds_exactly_the_changed_elements(bucket_bytes, edits, abandon) -> None:
    """Pieces of every layout (contiguous fp32 and bf16, a transposed bf16 view whose rows exceed a
    chunk) compared in chunks of a few elements: the patches are exactly the elements whose bits
    changed, and after an abandoned pass also those it compared (8 to 32 elements a chunk)."""
    from fsdptk.hf import weight_source

    torch.manual_seed(len(edits))
    model = torch.nn.Module()
    model.a = torch.nn.Parameter(torch.randn(7, 45))
    model.b = torch.nn.Parameter(torch.randn(37, 53).to(torch.bfloat16))
    model.c = torch.nn.Parameter(torch.randn(53, 37).to(torch.bfloat16).t())  # rows of 53 elements, strided
    source = weight_source(model, dtype=torch.bfloat16, bucket_bytes=bucket_bytes, track_changes=True)
    params = [model.a, model.b, model.c]
    before = {n: t.clone() for n, t in source.iter_full()}
    sent: dict[str, set[int]] = {}
    if abandon:  # a pass whose comparison ran and which its consumer left after the first patch
        with torch.no_grad():
            model.a[0, 0] += 1.0
            model.c[36, 52] += 1.0
        gen = source.iter_patches()
        next(gen)
        gen.close()
        sent = {"a": {0}, "c": {36 * 53 + 52}}
    with torch.no_grad():
        for which, at in edits:
            p = params[which]
            p[at % p.shape[0], at // p.shape[0] % p.shape[1]] += 1.0
    patches = {name: idx.tolist() for name, idx, _, _ in _rows(source.iter_patches())}
    for n, t in source.iter_full():
        changed = set((_bits(t) != _bits(before[n])).view(-1).nonzero().squeeze(1).tolist())
        assert patches.get(n, []) == sorted(changed | sent.get(n, set())), n


# ----------------------------------------------------------------------------------------------
# the comparison's memory: chunks of a bucket, never a copy of a whole piece
def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/self/status")


def _compare_peaks(bucket_bytes: int) -> dict:
    """On a replicated module of a contiguous fp32 matrix and a transposed bf16 one (bf16 wire):
    the peak RSS above before of each comparison (RSS follows live memory: glibc maps every
    block of 128 KiB or more on its own), and the positions sent after an abandoned pass."""
    import ctypes
    import gc

    from fsdptk.hf import weight_source

    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.b = torch.nn.Parameter(torch.randn(2048, 2048).to(torch.bfloat16).t())  # 8 MiB, not contiguous
    model.a = torch.nn.Parameter(torch.randn(2048, 2048))  # 16 MiB fp32, last: its bf16 baseline is 8 MiB
    source = weight_source(model, dtype=torch.bfloat16, bucket_bytes=bucket_bytes, track_changes=True)
    tracker = source._tracker
    out: dict = {}

    def peak(fn):
        gc.collect()
        libc.malloc_trim(0)
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to VmRSS
        before = _status_bytes("VmRSS")
        res = fn()
        return _status_bytes("VmHWM") - before, res

    out["fill"], _ = peak(lambda: tracker.diff(source._items(), patch=False))  # the baseline, made
    out["baseline"] = sum(t.nbytes for t in tracker.base.values())
    tracker.finish(False)
    list(source.iter_full())  # completes: the baseline is what the engine holds
    for _ in range(2):  # the first pass warms up (pages of code and of the process group's first use)
        with torch.no_grad():
            model.a[7, 11] += 1.0
            model.b[2000, 3] += 1.0  # its storage is transposed: the Hub tensor's flat 2000 * 2048 + 3 all the same
        dist.barrier()
        out["patch"], rows = peak(lambda: [(p.name, p.indices.tolist()) for p in source.iter_patches()])
    out["patches"] = rows
    # an abandoned pass leaves positions uncertain: the next comparison sends them with what changed
    uncertain = {key: torch.arange(5, base.numel(), 100_003, dtype=torch.int32) for key, base in tracker.base.items()}
    tracker.uncertain = dict(uncertain)
    with torch.no_grad():
        model.a[2047, 2047] += 1.0
    out["uncertain"], diffs = peak(lambda: tracker.diff(source._items(), patch=True))
    out["sel"] = {key[0]: d.sel.tolist() for key, d in diffs.items()}
    out["want"] = {key[0]: sorted(set(u.tolist()) | ({2047 * 2048 + 2047} if key[0] == "a" else set()))
                   for key, u in uncertain.items()}
    tracker.finish(True)
    out["keys"] = sorted(key[0] for key in tracker.base)
    return out


def test_comparing_holds_a_chunk_of_a_bucket_never_a_whole_piece(world) -> None:
    """Pieces 32 times a bucket (8 MiB of bf16 against 256 KiB): making the baseline costs the
    baseline alone, and a patch pass (or the comparison after an abandoned pass) stays within 2 MiB
    above it; a copy of a whole piece (8 MiB: the cast of ``a``, the contiguous copy of ``b``)
    exceeds each bound. Measured on this test: 0.02 / 0.10 / 0.79 MiB (making / patch /
    uncertain); with the whole-piece comparison it replaced, 7.9 / 8.9 / 11.9 MiB."""
    bucket_bytes = 256 * 2**10
    bound = 2 * 2**20
    results = world(2).run(_compare_peaks, bucket_bytes, timeout=180)
    assert sorted(k for r in results for k in r["keys"]) == ["a", "b"]  # one holder keeps each
    assert results[0]["patches"] == [("b", [2000 * 2048 + 3]), ("a", [7 * 2048 + 11])], results[0]["patches"]
    for rank, r in enumerate(results):
        assert r["fill"] <= r["baseline"] + bound, (rank, r["fill"], r["baseline"])
        assert r["patch"] <= bound, (rank, r["patch"])
        assert r["uncertain"] <= bound, (rank, r["uncertain"])
        assert r["sel"] == {k: v for k, v in r["want"].items() if v}, rank


# ----------------------------------------------------------------------------------------------
# the owner's memory: one patch assembled at a time
def _merged_before_each_patch() -> list[tuple[str, int]]:
    """Twelve names in one bucket, every element changed: per yielded patch, its name and how many
    patches the owner had assembled (``merge_parts``) by then."""
    import fsdptk.hf._weight_patches as wp
    from fsdptk.hf import weight_source

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(6)])
    source = weight_source(model, dtype=torch.bfloat16, track_changes=True)  # 16 MiB buckets: one
    list(source.iter_full())
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    merged: list[int] = []
    real = wp.merge_parts

    def counting(parts):
        merged.append(1)
        return real(parts)

    wp.merge_parts = counting
    try:
        return [(patch.name, len(merged)) for patch in source.iter_patches()]
    finally:
        wp.merge_parts = real


def test_the_owner_assembles_one_patch_at_a_time(world) -> None:
    """The owner merges a name's parts (its own and the other holders') just before it yields that
    name's patch, never a whole bucket of merged copies ahead of the consumer: with all twelve
    names in one bucket, the n-th patch is yielded after n merges (the whole bucket, 12, before the
    first, when the bucket was assembled first)."""
    results = world(2).run(_merged_before_each_patch, timeout=120)
    owner = results[0]
    assert [n for n, _ in owner] == [f"{i}.{w}" for i in range(6) for w in ("weight", "bias")], owner
    assert [k for _, k in owner] == list(range(1, 13)), owner
    assert results[1] == []


# ----------------------------------------------------------------------------------------------
# large patches of whole-row shards: received in place, into the patch's own two tensors
def _large_patches_in_place(owners) -> dict:
    """FSDP over the world: every element of ``0.weight`` changed, every other local element of
    ``1.weight`` on every rank, one element of ``2.weight``. On each owner, each patch against the
    bits that changed between the full passes around it; the names sent in place on every rank."""
    import fsdptk.hf._weight_patches as wp
    from fsdptk import shard_model
    from fsdptk.hf import weight_source

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 256), torch.nn.Linear(16, 16))
    shard_model(model, [lambda name, module: name in ("0", "1", "2")], cpu_offload=False)
    source = weight_source(model, dtype=torch.bfloat16, track_changes=True, owners=owners)
    before = {n: t.clone() for n, t in source.iter_full()}
    with torch.no_grad():
        model[0].weight.add_(1.0)
        model[1].weight.to_local().view(-1)[::2] += 1.0
        if dist.get_rank() == 0:
            model[2].weight.to_local()[0, 3] += 1.0
    chosen: list[list[str]] = []
    real = wp._direct_names

    def recording(tracker, names, views):
        out = real(tracker, names, views)
        chosen.append(sorted(out))
        return out

    wp._direct_names = recording
    try:
        rows = [(p.name, p.indices, p.values) for p in source.iter_patches()]
    finally:
        wp._direct_names = real
    after = dict(source.iter_full())
    checked = {}
    for name, idx, vals in rows:
        want = (_bits(after[name]) != _bits(before[name])).view(-1).nonzero().squeeze(1)
        assert idx.dtype == torch.int32 and idx.is_contiguous() and vals.is_contiguous(), name
        assert torch.equal(idx.long(), want), name
        assert torch.equal(_bits(vals), _bits(after[name].reshape(-1)[want])), name
        checked[name] = idx.numel()
    return {"checked": checked, "owned": sorted(after), "direct": chosen}


@pytest.mark.parametrize("owners", [1, 2])
def test_large_patches_of_whole_row_shards_are_received_in_place(world, owners) -> None:
    """Patches of 256 KiB and more whose holders keep whole rows (FSDP's Shard(0)) travel as two
    messages per holder straight into the patch's index and value tensors, in the holders' row
    order; small ones stay packed. Either way each owner's patches are exactly the changed bits,
    int32 indices ascending, values the new bits, contiguous."""
    results = world(4).run(_large_patches_in_place, owners, timeout=180)
    changed = {"0.weight": 512 * 256, "1.weight": 256 * 512 // 2, "2.weight": 1}  # 6 B each: 786 KB, 393 KB, 6 B
    checked: dict[str, int] = {}
    for r in results:
        assert [d for d in r["direct"] if d] == [["0.weight", "1.weight"]], r["direct"]  # the same on every rank
        assert set(r["checked"]) <= set(r["owned"]), r
        for name, n in r["checked"].items():
            assert name not in checked, f"{name}: a patch on two owners"
            checked[name] = n
    assert checked == changed
