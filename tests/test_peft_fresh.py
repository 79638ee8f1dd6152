"""Fresh PEFT adapters under FSDP2 (issue 43, item 2): ``fsdptk.hf.init_adapters``.

The usual start of a LoRA fine-tune: meta build -> ``peft.get_peft_model`` -> ``shard_model`` ->
base load -> ``init_adapters(model, seed=s)``, or PEFT after sharding: meta build -> ``shard_model``
-> base load -> ``get_peft_model`` -> ``init_adapters`` (Llama at 2 ranks FSDP on a named mesh, where
PEFT sizes LoRA from the local shard, and at 4 ranks HSDP 2 x 2). Judge: PEFT's own ``get_peft_model`` in one process
after ``torch.manual_seed(s)`` on the same base (transformers' ``from_pretrained``), for Llama (LoRA
on linear layers, FSDP at 2 ranks) and Qwen3-MoE (LoRA on attention and on the fused experts through
``target_parameters``, HSDP 2 x 2 at 4 ranks):

- every rank's full adapters (``full_tensor`` on every rank) equal PEFT's, bit for bit, though every
  rank seeded its own generator differently before the call, and its RNG state is left as it was;
  rank 0 alone builds them, and one engine load from rank 0 moves exactly the adapter keys;
- after one SGD step on each rank's own rows, every rank's full adapters are the same and equal
  PEFT's after one step on the whole batch (FSDP reduced the adapters' gradients), and the loss of
  the whole batch is PEFT's;
- ``save_adapter`` then writes what PEFT's ``save_pretrained`` writes of the same weights (keys,
  tensors, config);
- still refused after ``shard_model``, on every rank naming the key, the adapters untouched: a model
  that already ran a forward (ValueError), LoRA on parameters (PEFT's ParamWrapper,
  NotImplementedError); DoRA (its magnitude needs the base weights) a NotImplementedError.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from fsdptk.testing import RemoteError  # noqa: E402
from tests.test_hf_moe import build_reference  # noqa: E402 - after the skips

_SEED, _LR = 5, 0.5
_QB = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight"
_PEFT_SIZES_BY_GLOBAL_SHAPE = tuple(int(x) for x in peft.__version__.split(".")[:2]) >= (0, 22)
_EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
# family -> LoraConfig kwargs
LORAS = {
    "llama": dict(target_modules=["q_proj", "v_proj", "down_proj"]),
    "qwen3_moe": dict(target_modules=["q_proj"], target_parameters=_EXPERTS),
}
# (family, order: PEFT "before" or "after" shard_model, world size, ParallelDims kwargs or None)
CASES = [
    ("llama", "before", 2, None),
    ("qwen3_moe", "before", 4, {"dp_replicate": 2, "dp_shard": 2}),
    ("llama", "after", 2, {"dp_shard": 2}),  # a named mesh: PEFT sizes LoRA from the local shard
    ("llama", "after", 4, {"dp_replicate": 2, "dp_shard": 2}),
]


def _lora(family: str, **extra):
    return peft.LoraConfig(r=4, lora_alpha=8, **{**LORAS[family], **extra})


def _llama_reference(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("llama_base")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=250,
                                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(root)
    return {"src": root}


def _batch() -> torch.Tensor:
    return torch.randint(3, 250, (4, 8), generator=torch.Generator().manual_seed(7))


def _full_adapters(model) -> dict[str, torch.Tensor]:
    out = {}
    for n, p in model.named_parameters():
        if "lora_" in n:
            out[n] = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
    return out


def _meta_peft(src: str, lora):
    config = transformers.AutoConfig.from_pretrained(src)
    with torch.device("meta"):
        base = transformers.AutoModelForCausalLM.from_config(config)
    return peft.get_peft_model(base, lora)


def _mesh(dims):
    from fsdptk import ParallelDims

    if dims is None:
        return None
    pd = ParallelDims(**dims)
    pd.build_mesh("cpu")
    return pd


def _record_init():
    """Record, on this rank, how often the adapters are built and which loads move them."""
    import fsdptk._engine as engine
    import fsdptk._plans.peft_fresh as fresh

    built: list[int] = []
    loads: list[dict] = []
    build, distribute = fresh.fresh_adapter_state, engine.distribute

    def counting_build(*args, **kwargs):
        out = build(*args, **kwargs)
        built.append(len(out))
        return out

    def recording_distribute(plan, *args, **kwargs):
        loads.append({"keys": list(plan.keys), "src_rank0": plan.src_rank0})
        return distribute(plan, *args, **kwargs)

    fresh.fresh_adapter_state, engine.distribute = counting_build, recording_distribute

    def restore():
        fresh.fresh_adapter_state, engine.distribute = build, distribute

    return built, loads, restore


def _fresh(family: str, src: str, dims, order: str, out: str) -> dict:
    """On every rank, PEFT ``order`` ("before" / "after") shard_model: base load, init_adapters, one
    SGD step on own rows, save_adapter to ``out``."""
    import torch.distributed as dist

    from fsdptk import load_safetensors, shard_model, validate_no_params_on_meta_device
    from fsdptk.hf import init_adapters, no_split_modules, save_adapter

    rank, world = dist.get_rank(), dist.get_world_size()
    pd = _mesh(dims)
    if order == "before":
        model = _meta_peft(src, _lora(family))
        shard_model(model, no_split_modules(model), cpu_offload=False,
                    dp_mesh=pd.fsdp_mesh if pd else None)
        load_safetensors(model, src, strict=True)
        on_meta = sorted(n for n, p in model.named_parameters() if p.is_meta)
        peft_shapes: dict = {}
    else:
        config = transformers.AutoConfig.from_pretrained(src)
        with torch.device("meta"):
            base = transformers.AutoModelForCausalLM.from_config(config)
        shard_model(base, no_split_modules(base), cpu_offload=False,
                    dp_mesh=pd.fsdp_mesh if pd else None)
        load_safetensors(base, src, strict=True)
        torch.manual_seed(2000 + rank)  # PEFT draws each rank's own values
        model = peft.get_peft_model(base, _lora(family))
        on_meta = sorted(n for n, p in model.named_parameters() if p.is_meta)
        peft_shapes = {n: list(p.shape) for n, p in model.named_parameters() if "lora_" in n}
    torch.manual_seed(1000 + rank)  # every rank a different generator: no difference
    state = torch.random.get_rng_state()
    built, loads, restore = _record_init()
    try:
        keys = init_adapters(model, seed=_SEED)
    finally:
        restore()
    rng_kept = torch.equal(state, torch.random.get_rng_state())
    validate_no_params_on_meta_device(model)
    attached = _full_adapters(model)
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    batch = _batch()
    rows = batch.chunk(world)[rank]
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=_LR)
    model(input_ids=rows, labels=rows).loss.backward()
    opt.step()
    with torch.no_grad():
        whole = model(input_ids=batch, labels=batch).loss.item()
    save_adapter(model, out)
    return {"on_meta_before": on_meta, "keys": keys, "rng_kept": rng_kept, "attached": attached,
            "built": built, "loads": loads, "peft_shapes": peft_shapes,
            "stepped": _full_adapters(model), "trainable": trainable, "whole_loss": whole}


def _judge(family: str, src: str) -> dict:
    """PEFT in one process: manual_seed, get_peft_model, one SGD step on the whole batch."""
    base = transformers.AutoModelForCausalLM.from_pretrained(src)
    torch.manual_seed(_SEED)
    model = peft.get_peft_model(base, _lora(family))
    attached = _full_adapters(model)
    batch = _batch()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=_LR)
    model(input_ids=batch, labels=batch).loss.backward()
    opt.step()
    with torch.no_grad():
        whole = model(input_ids=batch, labels=batch).loss.item()
    return {"attached": attached, "stepped": _full_adapters(model), "whole_loss": whole,
            "trainable": sorted(n for n, p in model.named_parameters() if p.requires_grad),
            "model": model}


def _peft_save(model, weights: dict[str, torch.Tensor], path) -> tuple[dict, dict]:
    """PEFT's own save_pretrained of ``model`` holding ``weights``: (tensors, config)."""
    import json

    from safetensors.torch import load_file

    with torch.no_grad():
        for n, p in model.named_parameters():
            if n in weights:
                p.copy_(weights[n])
    model.save_pretrained(path)
    return (load_file(f"{path}/adapter_model.safetensors"),
            json.loads((path / "adapter_config.json").read_text()))


def _source(tmp_path_factory, family: str) -> str:
    ref = _llama_reference(tmp_path_factory) if family == "llama" else build_reference(
        tmp_path_factory, family)
    return str(ref["src"])


@pytest.mark.parametrize(("family", "order", "n", "dims"), CASES,
                         ids=[f"{f}-{o}-{n}" for f, o, n, _ in CASES])
def test_fresh_adapters_are_peft_init_on_every_rank_before_and_after_a_step(
        world, tmp_path_factory, family, order, n, dims) -> None:
    import json

    from safetensors.torch import load_file

    src = _source(tmp_path_factory, family)
    judge = _judge(family, src)
    out = tmp_path_factory.mktemp("saved")
    results = world(n).run(_fresh, family, src, dims, order, str(out), timeout=240)
    assert any(".experts." in k for k in judge["attached"]) == (family == "qwen3_moe")
    for rank, r in enumerate(results):
        if order == "before":
            assert r["on_meta_before"] and all("lora_" in k for k in r["on_meta_before"]), (
                rank, "the adapters are on meta after the base load until init_adapters")
        else:  # PEFT's own per-rank values: PEFT 0.21 sizes them by the local shard on a named
            # mesh, 0.22 by the DTensor's global shape; fsdptk takes either
            assert not r["on_meta_before"], rank
            rows = 64 if _PEFT_SIZES_BY_GLOBAL_SHAPE else 64 // dims["dp_shard"]
            assert r["peft_shapes"][_QB] == [rows, 4], (rank, r["peft_shapes"][_QB])
        assert r["rng_kept"], rank
        # rank 0 alone builds the adapters; one load from rank 0 moves exactly the adapter keys
        assert r["built"] == ([len(judge["attached"])] if rank == 0 else []), (rank, r["built"])
        assert len(r["loads"]) == 1 and r["loads"][0]["src_rank0"], (rank, r["loads"])
        assert sorted(r["loads"][0]["keys"]) == sorted(judge["attached"]), rank
        assert r["trainable"] == judge["trainable"], rank
        assert sorted(r["keys"]) == sorted(judge["attached"]), rank
        assert sorted(r["attached"]) == sorted(judge["attached"])
        for k, want in judge["attached"].items():
            assert torch.equal(r["attached"][k], want), (rank, k)
            assert torch.equal(r["stepped"][k], results[0]["stepped"][k]), (rank, k)
            torch.testing.assert_close(r["stepped"][k], judge["stepped"][k], rtol=1e-5, atol=1e-6,
                                       msg=lambda m, k=k, rank=rank: f"rank {rank} {k}: {m}")
        assert abs(r["whole_loss"] - judge["whole_loss"]) < 1e-5, (rank, r["whole_loss"])
    moved = [k for k in judge["stepped"] if not torch.equal(judge["stepped"][k], judge["attached"][k])]
    assert any("lora_B" in k for k in moved), "the step changed the adapters (B starts at zero)"
    # save_adapter writes what PEFT's save_pretrained writes of the same (rank 0's trained) weights
    want, want_config = _peft_save(judge["model"], results[0]["stepped"], tmp_path_factory.mktemp("p"))
    got = load_file(f"{out}/adapter_model.safetensors")
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    got_config = json.loads((out / "adapter_config.json").read_text())
    skip = {"base_model_name_or_path"}  # the judge's from_pretrained path; fsdptk's from the config
    sets = {"target_modules", "target_parameters"}  # PEFT's sets: saved in each process's hash order
    assert {k: v for k, v in got_config.items() if k not in skip | sets} == {
        k: v for k, v in want_config.items() if k not in skip | sets}
    for k in sets:
        assert sorted(got_config[k] or []) == sorted(want_config[k] or []), k


def _refused_after_sharding(src: str, case: str) -> dict:
    """PEFT after shard_model where init_adapters still refuses: a model that already ran a forward
    (FSDP2's lazy init collected its units), LoRA on parameters (PEFT's ParamWrapper)."""
    from fsdptk import load_safetensors, shard_model
    from fsdptk.hf import init_adapters, no_split_modules

    config = transformers.AutoConfig.from_pretrained(src)
    with torch.device("meta"):
        base = transformers.AutoModelForCausalLM.from_config(config)
    pd = _mesh({"dp_shard": 2})
    shard_model(base, no_split_modules(base), cpu_offload=False, dp_mesh=pd.fsdp_mesh)
    load_safetensors(base, src, strict=True)
    if case == "forward":
        base(input_ids=_batch())
        lora = _lora("llama")
    else:
        lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=[],
                               target_parameters=["mlp.down_proj.weight"])
    model = peft.get_peft_model(base, lora)
    before = _full_adapters(model)
    try:
        init_adapters(model, seed=_SEED)
    except (ValueError, NotImplementedError) as e:
        after = _full_adapters(model)
        return {"error": f"{type(e).__name__}: {e}", "unchanged": sorted(before) == sorted(after)
                and all(torch.equal(before[k], after[k]) for k in before)}
    return {"error": None}


@pytest.mark.parametrize(("case", "needle"), [
    ("forward", "ValueError: adapter tensor 'base_model.model.model.layers.0.self_attn.q_proj"
                ".lora_A.default.weight' (shape [4, 64]) is a plain tensor of a sharded model, and "
                "the model already ran a forward"),
    ("param_wrapper", "NotImplementedError: adapter tensor 'base_model.model.model.layers.0.mlp."
                      "down_proj.lora_A.default.weight'"),
], ids=["forward", "param_wrapper"])
def test_adapters_attached_after_sharding_still_refused_on_every_rank(world, tmp_path_factory, case,
                                                                      needle) -> None:
    src = _source(tmp_path_factory, "llama")
    for rank, r in enumerate(world(2).run(_refused_after_sharding, src, case, timeout=180)):
        assert r["error"] is not None and r["error"].startswith(needle), (rank, r["error"])
        assert "before the first forward" in r["error"] if case == "forward" else (
            "ParamWrapper" in r["error"] and "peft#3080" in r["error"]), r["error"]
        assert r["unchanged"], rank


def _dora(src: str) -> None:
    from fsdptk import shard_model
    from fsdptk.hf import init_adapters, no_split_modules

    model = _meta_peft(src, _lora("llama", use_dora=True))
    shard_model(model, no_split_modules(model), cpu_offload=False)
    init_adapters(model, seed=_SEED)


def test_dora_is_refused_on_every_rank(world, tmp_path_factory) -> None:
    src = _source(tmp_path_factory, "llama")
    with pytest.raises(RemoteError) as info:
        world(2).run(_dora, src, timeout=180)
    outcomes = info.value.per_rank
    assert all(isinstance(o, RemoteError) and o.exc_type == "NotImplementedError" for o in outcomes)
    assert all("lora_magnitude_vector" in o.message for o in outcomes), outcomes[0].message


# --------------------------------------------------------------------------- the caller's RNG state
class _Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = torch.nn.Linear(16, 12)
        self.v = torch.nn.Linear(12, 16)


def _tiny_peft(seed: int | None, device: str = "cpu"):
    """PEFT LoRA on a tiny model: with ``seed``, ``get_peft_model`` after ``torch.manual_seed(seed)``
    (the judge); without, on meta (what init_adapters fills)."""
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q", "v"], init_lora_weights="gaussian")
    base = _Tiny().to(device)
    if seed is None:
        with torch.device("meta"):
            return peft.get_peft_model(base, config)
    torch.manual_seed(seed)
    return peft.get_peft_model(base, config)


def _lora_values(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().cpu() for n, p in model.named_parameters() if "lora_" in n}


def test_init_adapters_seeds_no_device_generator_and_keeps_the_cpu_state(monkeypatch) -> None:
    """``torch.manual_seed`` reseeds every CUDA generator: init_adapters must not call it (nor any
    other CUDA seeding), must leave the CPU generator's state as it was, and still give the values
    of ``get_peft_model`` after ``torch.manual_seed(seed)`` (one process, no process group)."""
    from fsdptk.hf import init_adapters

    judge = _lora_values(_tiny_peft(_SEED))
    model = _tiny_peft(None)
    calls: list[str] = []
    for name in ("manual_seed", "manual_seed_all", "seed", "seed_all", "set_rng_state", "set_rng_state_all"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, _name=name, **k: calls.append(_name))
    torch.random.default_generator.manual_seed(77)
    torch.rand(3)
    state = torch.random.get_rng_state()
    keys = init_adapters(model, seed=_SEED)
    assert calls == []
    assert torch.equal(state, torch.random.get_rng_state())
    got = _lora_values(model)
    assert sorted(keys) == sorted(judge) == sorted(got)
    for k, v in judge.items():
        assert torch.equal(got[k], v), k
    assert any(v.abs().sum() > 0 for v in got.values())  # gaussian A: the generator was drawn from


@pytest.mark.gpu
def test_init_adapters_leaves_every_cuda_generator_as_it_was() -> None:
    """On a GPU: every CUDA generator's state (and the CPU one's) is the same after the call, and
    the adapters (on the GPU, where the base is) are PEFT's after ``torch.manual_seed(seed)``."""
    from fsdptk.hf import init_adapters

    judge = _lora_values(_tiny_peft(_SEED))
    model = _tiny_peft(None, device="cuda")
    torch.cuda.manual_seed_all(4321)
    torch.rand(3, device="cuda")
    cuda_states, cpu_state = torch.cuda.get_rng_state_all(), torch.random.get_rng_state()
    init_adapters(model, seed=_SEED)
    after = torch.cuda.get_rng_state_all()
    assert len(after) == len(cuda_states) and all(torch.equal(a, b) for a, b in zip(cuda_states, after))
    assert torch.equal(cpu_state, torch.random.get_rng_state())
    assert all(p.device.type == "cuda" for n, p in model.named_parameters() if "lora_" in n)
    got = _lora_values(model)
    assert sorted(got) == sorted(judge) and all(torch.equal(got[k], v) for k, v in judge.items())
