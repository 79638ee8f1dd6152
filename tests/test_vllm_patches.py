"""``weight_source(..., track_changes=True).iter_patches()`` judged by vLLM 0.33's own sparse engine.

These tests run only where ``vllm.distributed.weight_transfer.sparse_nccl_engine`` imports (it does
on CPU): ``bash scripts/test_vllm.sh`` makes such an environment (``.venv-vllm``: vLLM 0.33, torch
2.14, transformers < 5.21) and runs them there. Elsewhere every test here is skipped.

The engine is a single-process ``torch.nn.Module`` with one bf16 parameter per Hub name (nested
modules, so ``named_parameters()`` gives the Hub names), shaped as the source's metadata says;
its ``load_weights`` is a vLLM model's: each ``(name, tensor)`` goes through vLLM's
``default_weight_loader`` and the loaded names are returned. It is seeded by ``load_weights`` with
every owner's ``iter_full()`` (bf16 on the wire). Then, after each of 3 AdamW steps (lr 1e-4, fp32
master), every owner's ``iter_patches()`` is gathered and, as vLLM does it:

- each patch is an instance of vLLM's ``SparseWeightPatch`` and passes the trainer engine's check
  (``SparseNCCLTrainerWeightTransferEngine._validate_patch``); its name is one the yielding rank
  owns by vLLM's definition (``WeightSource.owned_names``), and no name comes from two ranks;
- each is turned into a ``CheckpointWeightPatch`` exactly as the receiver's
  ``SparseNCCLWeightTransferEngine.receive_weights`` does (shape ``tuple(full_shape)``, dtype the
  values' dtype) and applied with vLLM's ``load_checkpoint_weight_patches`` (which checks range,
  duplicates and NaN, then loads NaN-masked tensors through ``load_weights``).

The reference is transformers, never fsdptk: after each step torch's own full state dict
(``get_model_state_dict(full_state_dict=True, cpu_offload=True)``) is loaded into a single-process
transformers model on rank 0 and written with ``save_pretrained``. The engine must equal that
checkpoint cast to bf16, bit for bit, and each name's patch indices must be exactly the elements
whose bf16 bits changed since the previous step's checkpoint (none missing, none extra; a name with
nothing changed has no patch). The metadata's names and shapes must be the checkpoint's. A further
``iter_patches()`` with no step in between yields nothing on any rank.

Cases: a tiny Llama with untied and with tied embeddings under FSDP2 at 2 ranks, ``owners=1``; a
tiny Qwen3-MoE (fused experts in the model, one Hub tensor per expert) under expert parallelism at
4 ranks (``ParallelDims(dp_shard=4, ep=2)``), ``owners=4``.

vLLM's sending path: ``SparseNCCLTrainerWeightTransferEngine._prepare_patches`` (what
``send_weights`` and ``send_weight_chunk`` run before the first byte moves) accepts every step's
patches of every case unchanged. The engine is constructed without NCCL (``trainer_init`` is not
called; a stub client that must not be called), and its ``model_update_group``, which
``_prepare_patches`` only checks is set, is a placeholder object. The broadcast itself
(``_broadcast_chunk``) is not run: it needs a CUDA stream and a live NCCL group.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

sparse = pytest.importorskip("vllm.distributed.weight_transfer.sparse_nccl_engine")
transformers = pytest.importorskip("transformers")

from _tiny_hub import bits as _bits  # noqa: E402
from _tiny_hub import hub_dir as _hub_dir  # noqa: E402
from _tiny_hub import save_full as _save_full  # noqa: E402
from _tiny_hub import step as _step  # noqa: E402
from _tiny_hub import tensors as _tensors  # noqa: E402

STEPS = 3
WIRE = torch.bfloat16
# case id -> (family, world size, ParallelDims kwargs, owners)
CASES = {"llama-fsdp2-owners1": ("llama", 2, {"dp_shard": 2}, 1),
         "llama_tied-fsdp2-owners1": ("llama_tied", 2, {"dp_shard": 2}, 1),
         "qwen3_moe-ep-owners4": ("qwen3_moe", 4, {"dp_shard": 4, "ep": 2}, 4)}


def _gather(obj: Any) -> list[Any] | None:
    """Every rank's ``obj`` on rank 0 (pickled now: later passes cannot change what was sent)."""
    out: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def _train_and_patch(src: str, case: str, out: str) -> dict[str, Any] | None:
    """Seed with iter_full, then after each AdamW step gather every rank's iter_patches() on rank 0;
    save_pretrained of the model at the seed and after each step under ``out/step{k}``. Returns, on
    rank 0, what each rank yielded (indexed by rank) and the metadata; None elsewhere."""
    from vllm.distributed.weight_transfer.base import WeightSource

    from fsdptk import ParallelDims
    from fsdptk.hf import from_pretrained, weight_source

    family, _, dims_kw, owners = CASES[case]
    model = from_pretrained(src, dims=ParallelDims(**dims_kw))
    source = weight_source(model, owners=owners, dtype=WIRE, track_changes=True)
    rank = dist.get_rank()
    meta = [(m.name, tuple(m.shape), m.dtype) for m in source.metadata]
    owned = _gather(WeightSource.owned_names(source, rank))  # vLLM's definition, from the records
    seed = _gather(list(source.iter_full()))
    _save_full(model, family, Path(out) / "step0")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    patches = []
    for k in range(1, STEPS + 1):
        _step(model, opt, k)
        patches.append(_gather(list(source.iter_patches())))
        _save_full(model, family, Path(out) / f"step{k}")
    again = _gather(list(source.iter_patches()))  # no step since the last pass
    if rank != 0:
        return None
    return {"meta": meta, "owned": owned, "seed": seed, "patches": patches, "again": again}


# -- the engine side (the test process) ---------------------------------------------------------------


class _Engine(torch.nn.Module):
    """One bf16 parameter per Hub name, loaded as a vLLM model loads checkpoint weights."""

    def __init__(self, shapes: dict[str, tuple[int, ...]]) -> None:
        super().__init__()
        for name, shape in shapes.items():
            *path, leaf = name.split(".")
            mod: torch.nn.Module = self
            for part in path:
                if part not in mod._modules:
                    mod.add_module(part, torch.nn.Module())
                mod = mod._modules[part]
            # NaN until seeded: a name the seed misses cannot equal the checkpoint by chance
            mod.register_parameter(leaf, torch.nn.Parameter(torch.full(shape, float("nan"), dtype=WIRE),
                                                            requires_grad=False))

    def load_weights(self, weights: Any) -> set[str]:
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            param = params[name]
            getattr(param, "weight_loader", default_weight_loader)(param, tensor)
            loaded.add(name)
        return loaded


def _checkpoint(path: Path) -> dict[str, torch.Tensor]:
    return {n: t.to(WIRE) if t.is_floating_point() else t for n, t in _tensors(path).items()}


def _receive(patches: list[Any]) -> list[Any]:
    """The patches as vLLM's SparseNCCLWeightTransferEngine.receive_weights builds them."""
    from vllm.model_executor.model_loader.checkpoint_weight_patch import CheckpointWeightPatch

    return [CheckpointWeightPatch(name=p.name, shape=tuple(p.full_shape), dtype=p.values.dtype, values=p.values,
                                  indices=p.indices) for p in patches]


def _check_step(k: int, per_rank: list[list[Any]], owned: list[list[str]], engine: _Engine,
                before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> None:
    from vllm.model_executor.model_loader.checkpoint_weight_patch import load_checkpoint_weight_patches

    trainer = sparse.SparseNCCLTrainerWeightTransferEngine
    patches, sent = [], {}
    for rank, mine in enumerate(per_rank):
        for p in mine:
            assert isinstance(p, sparse.SparseWeightPatch), f"step {k} rank {rank}: {type(p).__mro__}"
            trainer._validate_patch(p)
            assert p.name in owned[rank], f"step {k}: rank {rank} sent {p.name}, which it does not own"
            assert p.name not in sent, f"step {k}: {p.name} sent by two ranks"
            assert p.values.dtype == WIRE, (p.name, p.values.dtype)
            sent[p.name] = p.indices.long()
            patches.append(p)
    assert sent, f"step {k}: nothing changed at all"
    loaded = load_checkpoint_weight_patches(engine, _receive(patches))
    assert loaded == set(sent), set(sent) ^ loaded
    params = dict(engine.named_parameters())
    for name, want in after.items():
        changed = (_bits(want) != _bits(before[name])).view(-1).nonzero().squeeze(1)
        got = sent.get(name, torch.empty(0, dtype=torch.long))
        if not torch.equal(got, changed):
            extra = sorted(set(got.tolist()) - set(changed.tolist()))
            missing = sorted(set(changed.tolist()) - set(got.tolist()))
            raise AssertionError(f"step {k} {name}: {got.numel()} indices sent, {changed.numel()} elements "
                                 f"changed; extra {extra[:8]}, missing {missing[:8]}")
        differ = int((_bits(params[name].data) != _bits(want)).sum())
        assert differ == 0, f"step {k} {name}: the engine differs from save_pretrained in {differ} elements"


@pytest.fixture(scope="module")
def synced(world, tmp_path_factory) -> Any:
    """``synced(case)``: the case's training run (once per module) and where its checkpoints are."""
    made: dict[str, tuple[dict[str, Any], Path]] = {}

    def get(case: str) -> tuple[dict[str, Any], Path]:
        if case not in made:
            family, n, _, _ = CASES[case]
            hub = _hub_dir(tmp_path_factory.mktemp(f"{family}-hub"), family)
            out = tmp_path_factory.mktemp(case)
            made[case] = (world(n).run(_train_and_patch, str(hub), case, str(out), timeout=240)[0], out)
        return made[case]

    return get


@pytest.mark.parametrize("case", list(CASES))
def test_vllm_applies_the_patches_to_save_pretrained_exactly(synced, case) -> None:
    res, out = synced(case)
    ckpt = [_checkpoint(out / f"step{k}") for k in range(STEPS + 1)]
    shapes = {name: shape for name, shape, _ in res["meta"]}
    assert {n: tuple(t.shape) for n, t in ckpt[0].items()} == shapes, set(shapes) ^ set(ckpt[0])
    assert all(dtype == WIRE for _, _, dtype in res["meta"])
    engine = _Engine(shapes)
    seed = [item for mine in res["seed"] for item in mine]
    assert engine.load_weights(seed) == set(shapes)
    assert len(seed) == len(shapes), "a name seeded by two ranks"
    params = dict(engine.named_parameters())
    for name, want in ckpt[0].items():
        assert torch.equal(_bits(params[name].data), _bits(want)), f"seed {name}: differs from save_pretrained"
    for k in range(1, STEPS + 1):
        _check_step(k, res["patches"][k - 1], res["owned"], engine, ckpt[k - 1], ckpt[k])
    assert all(mine == [] for mine in res["again"]), [[p.name for p in mine] for mine in res["again"]]


class _Client:
    """vLLM's VLLMWeightSyncClient protocol; _prepare_patches must not call it."""

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        raise AssertionError("called")

    def start_weight_update(self) -> None:
        raise AssertionError("called")

    def update_weights(self, update_info: Any) -> None:
        raise AssertionError("called")

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        raise AssertionError("called")


@pytest.mark.parametrize("case", list(CASES))
def test_vllm_trainer_engine_prepares_the_patches(synced, case) -> None:
    res, _ = synced(case)
    sender = sparse.SparseNCCLTrainerWeightTransferEngine(client=_Client(), is_sender=True)
    sender.model_update_group = object()  # stands for the NCCL group; _prepare_patches checks it is set
    for k, per_rank in enumerate(res["patches"], start=1):
        patches = [p for mine in per_rank for p in mine]
        prepared = sender._prepare_patches(iter(patches))
        assert len(prepared) == len(patches) and all(a is b for a, b in zip(prepared, patches)), f"step {k}"
