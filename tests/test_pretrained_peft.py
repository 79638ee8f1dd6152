"""Fresh PEFT adapters, and adapter directories, in the one call (issue 49):
``fsdptk.hf.from_pretrained(path, ..., peft_config=LoraConfig(...), seed=s)`` and
``from_pretrained(path, ..., adapter=directory)``.

Judge: PEFT's ``get_peft_model`` in one process after ``torch.manual_seed(s)`` on transformers'
``from_pretrained`` of the same base, and PEFT's ``save_pretrained``. Qwen3-MoE and Mixtral (LoRA
on ``q_proj`` and on the fused experts through ``target_parameters``, ``init_lora_weights=False`` so
B's blocks hold values too) at 2 and 4 ranks, under FSDP and under EP; Llama (LoRA on linear layers,
``target_modules``) at 4 ranks, HSDP 2 x 2 and FSDP x TP 2 x 2:

- every rank's full adapters equal PEFT's init bit for bit, though every rank seeded its generator
  differently before the call, and each rank's RNG state is left as it was;
- after one SGD step on each rank's own rows, every rank's full adapters are the same, and close to
  PEFT's after one step on the whole batch;
- ``save_adapter`` writes what PEFT's ``save_pretrained`` writes of the same weights;
- ``from_pretrained(..., adapter=that directory)`` gives back those adapters (trainable);
- refused on every rank before any weight is read: ``peft_config`` and ``adapter`` both, ranks that
  pass different seeds (named), a fresh DoRA (named), LoRA on the experts under EP x TP.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from tests.test_hf_moe import build_reference  # noqa: E402 - after the skips
from tests.test_peft_experts import _batch, _lora, assert_peft_saves_the_same, step_on_rows  # noqa: E402

_SEED = 5
# case -> (family, world size, ParallelDims kwargs or None (FSDP over every rank), reload the saved adapter)
CASES = {
    "qwen3_moe-2-fsdp": ("qwen3_moe", 2, None, False),
    "mixtral-2-ep": ("mixtral", 2, {"dp_shard": 2, "ep": 2}, True),
    "qwen3_moe-4-ep": ("qwen3_moe", 4, {"dp_shard": 4, "ep": 2}, False),
    "mixtral-4-fsdp": ("mixtral", 4, None, False),
    "llama-4-hsdp": ("llama", 4, {"dp_replicate": 2, "dp_shard": 2}, True),
    "llama-4-tp": ("llama", 4, {"dp_shard": 2, "tp": 2}, False),  # hf_tp_plan's LoRA styles
}


def _config(family: str):
    if family == "llama":  # dense: LoRA on linear layers, PEFT's default init (B zero)
        return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    return _lora()


_SOURCES: dict[str, str] = {}


def _source(tmp_path_factory, family: str) -> str:
    if family != "llama":
        return str(build_reference(tmp_path_factory, family)["src"])
    if family not in _SOURCES:
        root = tmp_path_factory.mktemp("llama_base")
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=250, pad_token_id=0, bos_token_id=1,
            eos_token_id=2)).save_pretrained(root)
        _SOURCES[family] = str(root)
    return _SOURCES[family]


def _full(model) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters() if "lora_" in n}


def _dims(dims):
    from fsdptk import ParallelDims

    return ParallelDims(**(dims or {}))


def _fresh(src: str, family: str, dims, out: str, reload: bool) -> dict:
    """On every rank: from_pretrained with fresh adapters (this rank's generator seeded its own way),
    one SGD step on this rank's rows, save_adapter; then (``reload``) from_pretrained of that directory."""
    import torch.distributed as dist

    from fsdptk.hf import from_pretrained, save_adapter

    rank = dist.get_rank()
    pd = _dims(dims)  # default: FSDP over every rank
    torch.manual_seed(1000 + rank)  # a rank whose seed differs makes no difference
    rng = torch.get_rng_state()
    model = from_pretrained(src, dims=pd, peft_config=_config(family), seed=_SEED)
    out_rng = torch.equal(torch.get_rng_state(), rng)
    init = _full(model)
    batch = _batch()
    model.train()
    step_on_rows(model, batch.chunk(pd.dp_degree)[pd.dp_rank], batch)  # a TP group shares its rows
    stepped = _full(model)
    save_adapter(model, out)
    result = {"kind": type(model).__name__, "rng_kept": out_rng, "init": init, "stepped": stepped,
              "trainable": sorted(n for n, p in model.named_parameters() if p.requires_grad)}
    if reload:
        again = from_pretrained(src, dims=_dims(dims), adapter=out)
        result["reloaded"] = _full(again)
        result["reloaded_trainable"] = sorted(n for n, p in again.named_parameters() if p.requires_grad)
    return result


@pytest.mark.parametrize("case", list(CASES))
def test_fresh_adapters_in_the_one_call_are_pefts_own(world, tmp_path_factory, case) -> None:
    family, n, dims, reload = CASES[case]
    src = _source(tmp_path_factory, family)
    torch.manual_seed(_SEED)
    judge = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(src), _config(family))
    init = {k: p.detach().clone() for k, p in judge.named_parameters() if "lora_" in k}
    step_on_rows(judge, _batch(), _batch())  # PEFT's step on the whole batch
    stepped = {k: p.detach().clone() for k, p in judge.named_parameters() if "lora_" in k}
    out = tmp_path_factory.mktemp(f"{case}_adapter")
    results = world(n).run(_fresh, src, family, dims, str(out), reload, timeout=240)
    for rank, r in enumerate(results):
        assert r["kind"].startswith("FSDPPeftModel") and r["rng_kept"], (rank, r["kind"], r["rng_kept"])
        assert sorted(r["init"]) == sorted(init) == r["trainable"], rank
        for k, want in init.items():
            assert torch.equal(r["init"][k], want), (rank, k)  # PEFT's init, bit for bit
            assert torch.equal(r["stepped"][k], results[0]["stepped"][k]), (rank, k)  # the same everywhere
            torch.testing.assert_close(r["stepped"][k], stepped[k], rtol=1e-5, atol=1e-6,
                                       msg=lambda m, k=k, rank=rank: f"rank {rank} {k}: {m}")
        if reload:
            assert r["reloaded_trainable"] == r["trainable"], rank
            assert all(torch.equal(r["reloaded"][k], r["stepped"][k]) for k in init), rank
    assert any(not torch.equal(stepped[k], init[k]) for k in init if ".lora_B." in k)  # the step moved B
    assert_peft_saves_the_same(out, src, results[0]["stepped"], _config(family), tmp_path_factory.mktemp("peft"),
                               marker=".lora_B." if family == "llama" else ".experts.lora_B")


def _refused(src: str, case: str, adapter: str) -> tuple[str, str]:
    import torch.distributed as dist

    from fsdptk import ParallelDims
    from fsdptk.hf import from_pretrained

    rank = dist.get_rank()
    kwargs: dict = {"peft_config": _lora()}
    if case == "both":
        kwargs["adapter"] = adapter
    elif case == "seeds":
        kwargs["seed"] = rank
    elif case == "dora":
        kwargs["peft_config"] = peft.LoraConfig(r=4, target_modules=["q_proj"], use_dora=True)
    elif case == "ep x tp":
        kwargs["dims"] = ParallelDims(dp_shard=1, tp=2, ep=2)
    elif case == "adapter on rank 0 only":
        kwargs = {"adapter": adapter} if rank == 0 else {}
    elif case == "not an adapter directory":
        kwargs = {"adapter": adapter}
    try:
        from_pretrained(src, **kwargs)
    except Exception as e:  # noqa: BLE001 - compared across ranks by the test
        return type(e).__name__, str(e)
    return "no error", ""


_REFUSALS = {
    "both": ("ValueError", ["peft_config", "adapter", "not both"]),
    "seeds": ("ValueError", ["from_pretrained: the ranks disagree on seed", "rank 0 passed 0", "rank 1 passed 1"]),
    "dora": ("NotImplementedError", ["lora_magnitude_vector", "load a saved adapter"]),
    "adapter on rank 0 only": ("ValueError", ["from_pretrained: the ranks disagree on adapter",
                                              "rank 0 passed 'a directory', rank 1 passed None"]),
    "not an adapter directory": ("FileNotFoundError", ["has no adapter_config.json"]),
    "ep x tp": ("NotImplementedError", ["LoRA on the experts under expert parallelism with tensor parallelism",
                                        "base_model.model.model.layers.0.mlp.experts"]),
}


@pytest.mark.parametrize("case", list(_REFUSALS))
def test_what_the_composition_refuses_is_refused_on_every_rank(world, tmp_path_factory, case) -> None:
    src = _source(tmp_path_factory, "qwen3_moe")
    kind, needles = _REFUSALS[case]
    for rank, (got, message) in enumerate(world(2).run(_refused, src, case, src, timeout=120)):
        assert got == kind, (rank, got, message)
        for needle in needles:
            assert needle in message, (rank, needle, message)
