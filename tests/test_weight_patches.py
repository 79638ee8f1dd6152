"""``weight_source(..., track_changes=True).iter_patches()`` (issue "Only what changed"): delta weight
sync in checkpoint coordinates.

Judged by transformers, never by fsdptk: after each AdamW step (fp32 master, bf16 on the wire) the
stepped model is gathered with torch's own full state dict (``get_model_state_dict``), loaded into
a single-process transformers model and written with ``save_pretrained``; the engine (seeded by
``iter_full``, then patched) must equal that checkpoint cast to the wire dtype, bit for bit, and the
patches' indices must be exactly the elements whose wire bits changed since the previous step (none
missing, none extra). Where vLLM 0.33 imports (``bash scripts/test_vllm.sh``) the engine is an
engine-side module patched by vLLM's own ``load_checkpoint_weight_patches`` through vLLM's
``default_weight_loader``, each patch accepted by vLLM's sparse trainer engine's validation first;
elsewhere the patches are applied by index (``index_copy_`` of the flat tensor, as vLLM does).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

transformers = pytest.importorskip("transformers")

MESHES = {"fsdp2": (2, {"dp_shard": 2}), "fsdp4": (4, {"dp_shard": 4}), "tp": (4, {"dp_shard": 2, "tp": 2}),
          "hsdp": (4, {"dp_replicate": 2, "dp_shard": 2}), "ep": (4, {"dp_shard": 4, "ep": 2}),
          "tp_ep": (4, {"dp_shard": 2, "tp": 2, "ep": 2})}

FAMILIES = {
    "llama": ("LlamaConfig", {"hidden_size": 64, "intermediate_size": 96, "vocab_size": 130,
                              "tie_word_embeddings": False}),
    "llama_tied": ("LlamaConfig", {"hidden_size": 64, "intermediate_size": 96, "vocab_size": 130,
                                   "tie_word_embeddings": True}),
    "qwen3_moe": ("Qwen3MoeConfig", {"hidden_size": 32, "vocab_size": 96, "num_experts_per_tok": 2, "num_experts": 8,
                                     "moe_intermediate_size": 16, "intermediate_size": 32, "head_dim": 8}),
    "mixtral": ("MixtralConfig", {"hidden_size": 32, "vocab_size": 96, "num_local_experts": 8,
                                  "num_experts_per_tok": 2, "intermediate_size": 16}),
    "deepseek_v3": ("DeepseekV3Config", {"hidden_size": 32, "vocab_size": 96, "n_routed_experts": 8,
                                         "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                                         "intermediate_size": 48, "n_shared_experts": 1,
                                         "first_k_dense_replace": 1, "q_lora_rank": 16, "kv_lora_rank": 16,
                                         "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8,
                                         "n_group": 2, "topk_group": 1, "num_key_value_heads": 4}),
}


def _config(family: str) -> Any:
    cls, extra = FAMILIES[family]
    kw = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "pad_token_id": 0,
          "bos_token_id": 1, "eos_token_id": 2, **extra}
    return getattr(transformers, cls)(**kw)


def _hub_dir(root: Path, family: str) -> Path:
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(_config(family)).save_pretrained(root)
    return root


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


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


def _save_full(model, family: str, out: Path) -> None:
    """torch's own full state dict of the stepped model, written by transformers' save_pretrained
    from a single-process model (rank 0)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        ref = transformers.AutoModelForCausalLM.from_config(_config(family))
        missing, unexpected = ref.load_state_dict(full, strict=False)
        assert not unexpected and all("rotary" in k or "inv_freq" in k for k in missing), (missing, unexpected)
        ref.save_pretrained(out)
    dist.barrier()


def _step(model, opt, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 90, (2, 12), generator=g)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


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
    rows = []
    for k in range(1, steps + 1):
        _step(model, opt, k)
        rows.append(_rows(source.iter_patches()))
        _save_full(model, family, Path(out) / f"step{k}")
    again = _rows(source.iter_patches())  # no step since the last pass: nothing anywhere
    return {"seed": seed, "patches": rows, "again": again, "owned": source.owned_names(dist.get_rank())}


def _apply(engine: dict[str, torch.Tensor], rows: list[tuple]) -> None:
    for name, idx, vals, shape in rows:
        t = engine[name]
        assert tuple(t.shape) == shape, (name, t.shape, shape)
        t.view(-1).index_copy_(0, idx.long(), vals.to(t.dtype))


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
        for r in results:
            rows = r["patches"][k - 1]
            assert all(name in r["owned"] for name, *_ in rows)
            for name, idx, _, _ in rows:
                assert name not in got, f"{name}: patched by two owners"
                got[name] = idx.long()
            _apply(engine, rows)
        for n, want in ckpt[k].items():
            changed = (_bits(want) != _bits(ckpt[k - 1][n])).view(-1).nonzero().squeeze(1)
            idx = got.get(n, torch.empty(0, dtype=torch.long))
            assert torch.equal(idx, changed), (f"step {k} {n}: {idx.numel()} indices sent, {changed.numel()} "
                                               "elements changed")
            assert torch.equal(_bits(engine[n]), _bits(want)), f"step {k} {n}: the engine differs"
        assert got, f"step {k}: nothing changed at all"


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    made: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in made:
            made[family] = _hub_dir(tmp_path_factory.mktemp(family), family)
        return made[family]

    return get


CASES = [("llama", "fsdp2", 1), ("llama_tied", "fsdp4", 4), ("llama", "hsdp", 2), ("llama", "tp", 1),
         ("qwen3_moe", "ep", 1), ("qwen3_moe", "tp_ep", 4), ("mixtral", "ep", 4), ("deepseek_v3", "fsdp4", 1)]


@pytest.mark.parametrize(("family", "mesh", "owners"), CASES, ids=[f"{f}-{m}-owners{o}" for f, m, o in CASES])
def test_patches_bring_the_engine_to_save_pretrained_exactly(world, hub, tmp_path, family, mesh, owners) -> None:
    n, dims_kw = MESHES[mesh]
    steps = 2
    results = world(n).run(_sync, str(hub(family)), family, dims_kw, owners, 1e-4, steps, str(tmp_path),
                           timeout=240)
    _check(results, tmp_path, steps)
