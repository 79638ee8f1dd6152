"""fsdptk.hf_tp_plan: a Hugging Face model's own tensor-parallel plan, translated into DTensor
styles, with the real transformers (tiny configs, random init, nothing downloaded).

- 2-D end to end on 4 gloo ranks, mesh (dp_shard=2, tp=2): meta build -> hf_tp_plan + apply_tp ->
  shard_model over dp -> load_safetensors -> logits equal a single-process reference on every rank
  -> 3 AdamW steps (each dp rank its half of the batch) give the reference's losses and state ->
  save_safetensors -> from_pretrained, for Llama tied / untied, Qwen2 (GQA) and Llama with
  sequence parallel; in float32, and in float64, where logits, gradients and the trained state
  must match to 1e-12.
- Each style string against transformers' own implementation of it (2 ranks, module level): the
  same output, input gradient and full parameter gradient, and the unsharded module's.
- GQA with fewer KV heads than TP ranks, Qwen3's replicated q/k norms, refusals.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from fsdptk import hf_tp_plan  # noqa: E402
from fsdptk._plans.hf_tp import COMPOSITE, REFUSED, TRANSLATED, describe_hf_2d  # noqa: E402
from fsdptk.predicates import no_split_modules  # noqa: E402

_LR, _STEPS, _BATCH, _SEQ = 1e-3, 3, 4, 8
# Tolerances against the single-process reference, per parameter dtype. In float32 the sharded
# reductions (TP's all-reduces, FSDP's reduce-scatter over the dp halves) round differently from
# one process (logits and gradients agree to ~2e-7), and AdamW divides by sqrt(v): on the odd
# entry whose gradient is ~eps (1e-8) a 1e-10 rounding difference moves the update by a visible
# fraction of lr, so the trained state differs by up to ~lr / 20 (measured at lr 1e-3: 3e-7 to
# 5e-6 for Llama / Qwen2, 6e-5 for Qwen3; ten times that at lr 1e-2). The same runs in float64
# agree to ~5e-15 in logits, gradients and trained state, so they are compared at 1e-12 there:
# the float32 differences are rounding, not a different step. The loss itself is float32 in both
# (transformers upcasts the logits for it).
_ATOL = {torch.float32: {"logits": 1e-5, "grads": 1e-5, "state": 1e-4},
         torch.float64: {"logits": 1e-12, "grads": 1e-12, "state": 1e-12}}
# family -> (config class, extra arguments); vocab 250: the (dp, tp) shards of the vocab are uneven
FAMILIES = {
    "llama": ("LlamaConfig", {"tie_word_embeddings": False}),
    "llama_tied": ("LlamaConfig", {"tie_word_embeddings": True}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": False}),
    # per-head q_norm / k_norm: replicated_with_grad_allreduce, under FSDP2
    "qwen3": ("Qwen3Config", {"tie_word_embeddings": False, "head_dim": 16}),
    # one KV head, tp 2: k/v replicated over the TP ranks (ReplicatedKVColwise), FSDP-sharded
    "llama_1kv": ("LlamaConfig", {"tie_word_embeddings": False, "num_key_value_heads": 1}),
}


def _config(family: str, **over):
    cls, extra = FAMILIES[family]
    kw = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=250, pad_token_id=0, bos_token_id=1,
              eos_token_id=2)
    return getattr(transformers, cls)(**{**kw, **extra, **over})


def _batch() -> torch.Tensor:
    return torch.randint(3, 250, (_BATCH, _SEQ), generator=torch.Generator().manual_seed(7))


def _step(model, opt, rows: torch.Tensor, grads: dict | None = None) -> torch.Tensor:
    """One AdamW step; ``grads`` (if given) receives every full gradient before the step (AdamW
    is blind to a gradient's scale, so a doubled or halved gradient shows only here)."""
    loss = model(input_ids=rows, labels=rows).loss
    loss.backward()
    if grads is not None:
        for n, p in model.named_parameters():
            g = p.grad
            grads[n] = g.full_tensor() if hasattr(g, "full_tensor") else g.clone()
    opt.step()
    opt.zero_grad()
    return loss.detach()


_REFS: dict[tuple[str, torch.dtype], dict] = {}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """(family, dtype) -> a CPU-built model's save_pretrained directory, its logits on the batch,
    and its losses and state after 3 AdamW steps on the whole batch (one process)."""

    def get(family: str, dtype: torch.dtype = torch.float32) -> dict:
        if (family, dtype) not in _REFS:
            root = tmp_path_factory.mktemp(family)
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(_config(family), dtype=dtype)
            model.save_pretrained(root / "src")
            batch = _batch()
            with torch.no_grad():
                logits = model(input_ids=batch).logits
            opt = torch.optim.AdamW(model.parameters(), lr=_LR)
            grads: dict = {}
            losses = [_step(model, opt, batch, grads if i == 0 else None).item()
                      for i in range(_STEPS)]
            state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            _REFS[family, dtype] = {"src": root / "src", "logits": logits, "losses": losses,
                                    "grads": grads, "state": state}
        return _REFS[family, dtype]

    return get


# ---------------------------------------------------------------------------------------------
# 2-D: (dp_shard=2, tp=2) on 4 ranks
def _two_d(family: str, dtype: torch.dtype, src: str, mode: str, sequence_parallel: bool,
           ref_logits: torch.Tensor, out: str) -> dict:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from fsdptk import ParallelDims, apply_tp, gather_cpu_state_dict, load_safetensors, save_safetensors, shard_model

    dims = ParallelDims(dp_shard=2, tp=2)
    dims.build_mesh("cpu")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(_config(family), dtype=dtype)
    n_params = len(list(model.parameters()))
    plan = hf_tp_plan(model, sequence_parallel=sequence_parallel)
    apply_tp(model, dims.tp_mesh, plan)
    tied_after_tp = model.lm_head.weight is model.model.embed_tokens.weight
    shard_model(model, no_split_modules(model), cpu_offload=False, dp_mesh=dims.fsdp_mesh)
    res = load_safetensors(model, src, shard_on_read=mode == "shard_on_read", strict=True)
    q = model.model.layers[0].self_attn.q_proj.weight

    batch = _batch()
    with torch.no_grad():
        diff = (model(input_ids=batch).logits - ref_logits).abs().max().item()
    opt = torch.optim.AdamW(model.parameters(), lr=_LR)
    per = _BATCH // dims.dp_degree
    rows = batch[dims.dp_rank * per:(dims.dp_rank + 1) * per]  # this dp rank's half
    losses, grads = [], {}
    for i in range(_STEPS):
        loss = _step(model, opt, rows, grads if i == 0 else None)
        dist.all_reduce(loss, group=dims.fsdp_mesh.get_group())  # the whole batch's mean loss
        losses.append(loss.item() / dims.dp_degree)
    save_safetensors(model, out)
    gathered = gather_cpu_state_dict(model, dist.get_rank() == 0)
    return {
        "grads": grads if dist.get_rank() == 0 else {},
        "missing": list(res.missing_keys), "unexpected": list(res.unexpected_keys),
        "logits_diff": diff, "losses": losses, "gathered": gathered,
        "tied": (tied_after_tp, model.lm_head.weight is model.model.embed_tokens.weight),
        "n_params": (n_params, len(list(model.parameters()))),
        "q_proj": (q.device_mesh.mesh_dim_names, tuple(type(p).__name__ for p in q.placements),
                   tuple(q.to_local().shape)),
        "plan_types": {k: type(v).__name__ for k, v in plan.items()},
        "local_bytes": sum(p.to_local().numel() * p.element_size() for p in model.parameters()),
    }


_F32, _F64 = torch.float32, torch.float64
CASES = [  # (family, read mode, sequence parallel, dtype)
    ("llama", "shard_on_read", False, _F32),
    ("llama_tied", "rank0_read", False, _F32),
    ("qwen2", "shard_on_read", False, _F32),
    ("llama", "rank0_read", True, _F32),
    ("llama_tied", "shard_on_read", True, _F32),
    ("qwen3", "rank0_read", True, _F32),
    ("llama_1kv", "shard_on_read", True, _F32),
    # again in float64 (the other read mode): the same trained state to 1e-12
    ("llama", "rank0_read", False, _F64),
    ("llama_tied", "shard_on_read", False, _F64),
    ("qwen2", "rank0_read", False, _F64),
    ("llama", "shard_on_read", True, _F64),
    ("qwen3", "shard_on_read", True, _F64),
]


@pytest.mark.parametrize("family, mode, sp, dtype", CASES, ids=[
    f"{f}-{m}{'-sp' if sp else ''}-{str(d).removeprefix('torch.')}" for f, m, sp, d in CASES])
def test_two_d_matches_single_process_and_saves_for_from_pretrained(world, reference, tmp_path,
                                                                     family, mode, sp, dtype):
    ref = reference(family, dtype)
    atol = _ATOL[dtype]
    results = world(4).run(_two_d, family, dtype, str(ref["src"]), mode, sp, ref["logits"],
                           str(tmp_path / "out"))
    r0 = results[0]
    tied = bool(_config(family).tie_word_embeddings)
    for r in results:
        assert r["missing"] == [] and r["unexpected"] == []
        assert r["logits_diff"] <= atol["logits"], \
            f"logits differ from the reference by {r['logits_diff']}"
        torch.testing.assert_close(r["losses"], ref["losses"], rtol=0, atol=1e-5)
        assert r["tied"] == (tied, tied)  # a tied embedding / lm_head stays one Parameter
        assert r["n_params"][0] == r["n_params"][1]
        # 2-D: FSDP's dp shard of TP's column shard (q_proj 64 x 64 -> 32 rows per tp rank -> 16)
        assert r["q_proj"] == (("dp_shard", "tp"), ("_StridedShard", "Shard"), (16, 64))
    assert all(r["gathered"] == {} for r in results[1:])
    # the first step's full gradients (FSDP's mean over the dp halves = the whole batch's)
    assert sorted(r0["grads"]) == sorted(ref["grads"])
    for key, value in r0["grads"].items():
        assert value.dtype == dtype
        diff = (value - ref["grads"][key]).abs().max().item()
        assert diff <= atol["grads"], f"{key}: the gradient differs from the reference by {diff}"
    gathered = r0["gathered"]
    assert sorted(gathered) == sorted(ref["state"])
    for key, value in gathered.items():
        assert value.dtype == ref["state"][key].dtype, key
        diff = (value - ref["state"][key]).abs().max().item()
        assert diff <= atol["state"], f"{key}: the trained state differs by {diff}"
    # the dry-run planner (what `fsdptk plan DIR --tp 2` prints) gives the largest rank's bytes
    meta = _meta(family, dtype=dtype)
    planned = describe_hf_2d(meta, no_split_modules(meta), world_size=4, tp=2,
                             sequence_parallel=sp)
    assert planned.world_size == 2
    assert max(r["local_bytes"] for r in results) == planned.total_bytes_per_rank
    types = r0["plan_types"]
    if sp:
        assert types["model.norm"] == "SequenceParallel"
        assert types["model.layers.0.mlp"] == "GatherSequence"
    else:
        assert "model.norm" not in types
    if family == "qwen3":
        assert types["model.layers.0.self_attn.q_norm"] == "ReplicatedPartialGrad"
    if family == "llama_1kv":
        assert types["model.layers.0.self_attn.k_proj"] == "ReplicatedKVColwise"

    # the saved directory loads as is and holds exactly the gathered state
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", output_loading_info=True)
    assert {k: sorted(v) for k, v in info.items() if k != "error_msgs"} == {
        "missing_keys": [], "unexpected_keys": [], "mismatched_keys": []}
    sd = loaded.state_dict()
    assert sorted(sd) == sorted(gathered)
    for key, value in gathered.items():
        assert sd[key].dtype == value.dtype and torch.equal(sd[key], value), key
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == tied


# ---------------------------------------------------------------------------------------------
# each style string against transformers' own implementation of it (2 ranks, module level)
class _Holder(nn.Module):
    """One module under test, with the one-rule plan a transformers model would declare."""

    def __init__(self, module: nn.Module, string: str) -> None:
        super().__init__()
        self.m = module
        self.tp_plan = {"m": string}
        # what transformers >= 5.25's apply_tensor_parallelism reads off the model (the styles
        # tested here use neither: no head-replicating sub-mesh, no config field)
        self.config = transformers.PretrainedConfig()
        self._mesh_manager = None


def _norm(dim: int) -> nn.Module:
    norm = transformers.models.llama.modeling_llama.LlamaRMSNorm(dim)
    with torch.no_grad():
        norm.weight.normal_()
    return norm


def _module_case(string: str, r: int, n: int):
    """(module, full input, this rank's input, output slicer, input-grad slicer, reference fn)."""
    torch.manual_seed(sorted(TRANSLATED).index(string))
    whole = lambda t: t  # noqa: E731
    last = lambda t: t.chunk(n, -1)[r]  # noqa: E731
    if string.startswith("embedding"):
        return nn.Embedding(10, 8), torch.randint(0, 10, (2, 3)), None, whole, None, None
    if string == "sequence_parallel":  # a norm on this rank's sequence shard
        seq = lambda t: t.chunk(n, 1)[r]  # noqa: E731
        return _norm(8), torch.randn(2, 4, 8), seq, seq, seq, None
    if string == "replicated_with_grad_allreduce":  # a per-head norm on this rank's heads
        heads = lambda t: t.chunk(n, 2)[r]  # noqa: E731
        return _norm(4), torch.randn(2, 3, 4, 4), heads, heads, heads, None
    if string == "all_reduce":  # each rank holds a partial sum: the output is their total
        x = torch.randn(n, 3, 8)
        pick = lambda t: t[r]  # noqa: E731
        total = lambda m, x: sum(m(x[i]) for i in range(n))  # noqa: E731
        return nn.Linear(8, 6, bias=False), x, pick, whole, pick, total
    if string.startswith("rowwise"):
        split = last if string == "rowwise" else whole  # _rep / _split_input: a replicated input
        return nn.Linear(12, 8), torch.randn(2, 3, 12), split, whole, split, None
    out = last if string == "colwise" else whole
    return nn.Linear(8, 12), torch.randn(2, 3, 8), whole, out, whole, None


def _grads(module: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
            for n, p in module.named_parameters()}


def _local(t):
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _each_string(strings: list[str]) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    from fsdptk import apply_tp

    r, n = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("tp",))
    facts = {}
    for s in strings:
        base, x, rank_in, out_sl, grad_sl, ref_fn = _module_case(s, r, n)
        g = None
        outs, in_grads, grads, params = {}, {}, {}, {}
        for who in ("ref", "ours", "hf"):
            holder = _Holder(copy.deepcopy(base), s)
            if who == "ours":
                plan = hf_tp_plan(holder)
                facts.setdefault(s, {})["style"] = type(plan["m"]).__name__ if plan else None
                if plan:
                    apply_tp(holder, mesh, plan)
            elif who == "hf":  # transformers' own: the module's parameters, then the module
                hf_plan = {f"m.{p}": s for p, _ in holder.m.named_parameters()}
                apply_tensor_parallelism(holder, mesh, {**hf_plan, "m": s})
            xin = x if who == "ref" or rank_in is None else rank_in(x)
            xin = xin.clone().requires_grad_(xin.is_floating_point())
            if who == "ref" and ref_fn is not None:
                out = ref_fn(holder.m, xin)
            else:
                out = _local(holder.m(xin))
            if g is None:
                g = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
            (out * (g if who == "ref" else out_sl(g))).sum().backward()
            outs[who] = out if who != "ref" else out_sl(out)
            in_grads[who] = None if xin.grad is None else (
                xin.grad if who != "ref" or grad_sl is None else grad_sl(xin.grad))
            grads[who] = _grads(holder.m)
            params[who] = {k: _local(v).detach() for k, v in holder.m.named_parameters()}

        def diff(a, b):
            return max((float((a[k] - b[k]).abs().max()) for k in a), default=0.0)

        facts[s].update(
            out_vs_hf=float((outs["ours"] - outs["hf"]).detach().abs().max()),
            out_vs_ref=float((outs["ours"] - outs["ref"]).detach().abs().max()),
            in_grad_vs_hf=None if in_grads["ours"] is None else float(
                (in_grads["ours"] - in_grads["hf"]).abs().max()),
            in_grad_vs_ref=None if in_grads["ours"] is None or s == "all_reduce" else float(
                (in_grads["ours"] - in_grads["ref"]).abs().max()),
            grad_vs_hf=diff(grads["ours"], grads["hf"]),
            grad_vs_ref=None if s == "all_reduce" else diff(grads["ours"], grads["ref"]),
            local_params_vs_hf=diff(params["ours"], params["hf"]),
            local_shapes={k: tuple(v.shape) for k, v in params["ours"].items()},
        )
    facts["uneven"] = _uneven_features(mesh)
    return facts


class _Mlp(nn.Module):
    """colwise 8 -> 13 features (7 and 6 per rank), rowwise 13 -> 8."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 13), nn.Linear(13, 8)
        self.tp_plan = {"up": "colwise", "down": "rowwise"}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def _uneven_features(mesh) -> dict:
    """Widths that do not divide by the TP size work, as in transformers (torch's own
    RowwiseParallel would take the 6 local features for 12 global ones)."""
    from fsdptk import apply_tp

    torch.manual_seed(0)
    ref = _Mlp()
    ours = copy.deepcopy(ref)
    apply_tp(ours, mesh, hf_tp_plan(ours))
    x = torch.randn(2, 3, 8)
    out, want = ours(x), ref(x)
    out.sum().backward()
    want.sum().backward()
    grads = _grads(ours)
    return {"out": float((out - want).detach().abs().max()),
            "grad": max(float((grads[n] - p.grad).abs().max()) for n, p in ref.named_parameters()),
            "up_rows": _local(ours.up.weight).shape[0]}


_STRING_FACTS: dict = {}


@pytest.fixture(scope="module")
def string_facts(world):
    if not _STRING_FACTS:
        per_rank = world(2).run(_each_string, sorted(TRANSLATED))
        _STRING_FACTS.update(rank=per_rank)
    return _STRING_FACTS["rank"]


EXPECTED_STYLE = {
    "colwise": "ColwiseKeepTied", "colwise_rep": "ColwiseKeepTied",
    "colwise_gather_output": "ColwiseKeepTied", "rowwise": "RowwiseKeepTied",
    "rowwise_rep": "RowwiseKeepTied", "rowwise_split_input": "RowwiseKeepTied",
    "embedding_rowwise": "RowwiseKeepTied", "embedding_colwise": "ColwiseKeepTied",
    "sequence_parallel": "SequenceParallel", "replicated_with_grad_allreduce":
    "ReplicatedPartialGrad", "all_reduce": "PrepareModuleOutput", "replicate": None,
}


@pytest.mark.parametrize("string", sorted(TRANSLATED))
def test_each_style_string_matches_transformers_own(string_facts, string):
    for facts in string_facts:
        f = facts[string]
        assert f["style"] == EXPECTED_STYLE[string]
        # the same output, input gradient, full parameter gradient and local shards as
        # transformers' implementation, and as the unsharded module (all_reduce: the sum of the
        # ranks' partial outputs; its gradients are defined only by transformers' behaviour)
        for key in ("out_vs_hf", "out_vs_ref", "in_grad_vs_hf", "in_grad_vs_ref", "grad_vs_hf",
                    "grad_vs_ref", "local_params_vs_hf"):
            assert f[key] is None or f[key] <= 1e-6, (key, f[key])
        # None only where nothing exists to compare: an embedding's integer input has no
        # gradient; all_reduce's unsharded reference has no gradient of its own
        absent = {k for k, v in f.items() if v is None and k != "style"}
        assert absent == ({"in_grad_vs_hf", "in_grad_vs_ref"} if string.startswith("embedding")
                          else {"in_grad_vs_ref", "grad_vs_ref"} if string == "all_reduce"
                          else set()), absent
    sharded = {k: v for k, v in string_facts[0][string]["local_shapes"].items()}
    if string in ("colwise", "colwise_rep", "colwise_gather_output"):
        assert sharded == {"weight": (6, 8), "bias": (6,)}
    elif string.startswith("rowwise"):
        assert sharded == {"weight": (8, 6), "bias": (8,)}
    elif string == "embedding_rowwise":
        assert sharded == {"weight": (5, 8)}
    elif string == "embedding_colwise":
        assert sharded == {"weight": (10, 4)}


def test_widths_that_do_not_divide_by_the_tp_size(string_facts):
    assert sorted(f["uneven"]["up_rows"] for f in string_facts) == [6, 7]
    for facts in string_facts:
        assert facts["uneven"]["out"] <= 1e-6 and facts["uneven"]["grad"] <= 1e-6, facts["uneven"]


def test_moe_plans_keep_the_experts_split_and_translate_mla_on_every_supported_release():
    """transformers 5.25 dropped the fused experts from its TP plans (EP only) and gave DeepSeek-V3
    head-split attention with ``mla_kv_a_proj``: the translated plan still splits the experts over
    TP (as 5.23 declared), and the MLA projection becomes MlaKvAProj; transposed experts (gpt-oss)
    are never given the non-transposed split."""
    from fsdptk._plans.tp_mla import MlaKvAProj
    from fsdptk._plans.tp_styles import MoEExpertsTP

    def meta(cls: str, **kw):
        with torch.device("meta"):
            config = getattr(transformers, cls)(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                                num_key_value_heads=4, vocab_size=128, **kw)
            return transformers.AutoModelForCausalLM.from_config(config)

    qwen = hf_tp_plan(meta("Qwen3MoeConfig", num_experts=4, moe_intermediate_size=16, head_dim=16))
    experts = {f: s for f, s in qwen.items() if f.endswith("mlp.experts")}
    assert sorted(experts) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert all(isinstance(s, MoEExpertsTP) and s.params == {"gate_up_proj": "packed_colwise", "down_proj": "rowwise"}
               for s in experts.values())
    deepseek = meta("DeepseekV3Config", n_routed_experts=4, moe_intermediate_size=16, intermediate_size=64,
                    first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
                    qk_nope_head_dim=8, v_head_dim=8, n_group=2, topk_group=1)
    plan = hf_tp_plan(deepseek)
    assert isinstance(plan["model.layers.1.mlp.experts"], MoEExpertsTP)
    declares_mla = "mla_kv_a_proj" in dict(deepseek.tp_plan).values()
    assert declares_mla == (tuple(int(x) for x in transformers.__version__.split(".")[:2]) >= (5, 25))
    mla = [f for f, s in plan.items() if isinstance(s, MlaKvAProj)]
    assert mla == ([f"model.layers.{i}.self_attn.kv_a_proj_with_mqa" for i in range(2)] if declares_mla else [])
    assert all(plan[f].rope_dim == 8 for f in mla)
    gpt_oss = meta("GptOssConfig", num_local_experts=4, intermediate_size=32, head_dim=16)
    try:
        gplan = hf_tp_plan(gpt_oss)
    except ValueError as e:  # transformers 5.23: gpt-oss declares no TP plan at all
        assert "declares no tensor-parallel plan" in str(e)
    else:
        assert not any(isinstance(s, MoEExpertsTP) for s in gplan.values())


def test_every_transformers_style_string_is_translated_or_refused():
    from transformers.distributed import expert_parallel, tensor_parallel  # noqa: F401 (registers)
    from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES

    assert not set(TRANSLATED) & set(REFUSED) and not (set(TRANSLATED) | set(REFUSED)) & set(COMPOSITE)
    known = set(TRANSLATED) | set(REFUSED) | set(COMPOSITE)
    # every string of the installed release is known; the only extra ones are strings another
    # supported release has and this one lacks
    version = tuple(int(x) for x in transformers.__version__.split(".")[:2])
    absent = ({s for s, since in _DROPPED_STYLES.items() if version >= since}
              | {s for s, since in _ADDED_STYLES.items() if version < since})
    assert set(ALL_PARALLEL_STYLES) <= known, sorted(set(ALL_PARALLEL_STYLES) - known)
    assert known - set(ALL_PARALLEL_STYLES) == absent


# style strings of the supported releases (5.23 to 5.25) that not every one of them has:
# string -> the first release without it / with it
_DROPPED_STYLES = {"moe_identity_expert": (5, 25)}
_ADDED_STYLES = {"unit_colwise": (5, 25), "unit_rowwise": (5, 25)}


# ---------------------------------------------------------------------------------------------
# tensor parallel alone (2 ranks): GQA with fewer KV heads than ranks, per-head norms, fused
# projections: logits and every full gradient equal the unsharded model's
TP_ONLY = {  # case -> (config class, overrides)
    "llama_1kv": ("LlamaConfig", {"num_key_value_heads": 1}),  # 1 KV head, tp 2: replicated
    "qwen3": ("Qwen3Config", {"head_dim": 16}),  # q_norm / k_norm: replicated_with_grad_allreduce
    # tied, scaled embedding, q_norm / k_norm, sliding and full attention layers
    # (vocab 251: the TP ranks' vocabulary shards are uneven, 126 and 125 rows)
    "gemma3": ("Gemma3TextConfig", {"head_dim": 16, "tie_word_embeddings": True,
                                    "vocab_size": 251}),
    # fused qkv_proj / gate_up_proj: colwise_gather_output, then rowwise_split_input
    "phi3": ("Phi3Config", {}),
}


def _tp_config(case: str, **over):
    cls, extra = TP_ONLY[case]
    kw = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=250, tie_word_embeddings=False, pad_token_id=0,
              bos_token_id=1, eos_token_id=2)
    return getattr(transformers, cls)(**{**kw, **extra, **over})


def _tp_only(cases: list[str]) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from fsdptk import apply_tp

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    batch = _batch()
    facts = {}
    for case in cases:
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(_tp_config(case))
        ref = copy.deepcopy(model)
        plan = hf_tp_plan(model)
        apply_tp(model, mesh, plan)
        out = model(input_ids=batch, labels=batch)
        out.loss.backward()
        ref_out = ref(input_ids=batch, labels=batch)
        ref_out.loss.backward()
        grads = {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                 for n, p in model.named_parameters()}
        attn = model.model.layers[0].self_attn
        facts[case] = {
            "logits_diff": float((out.logits - ref_out.logits).detach().abs().max()),
            "grad_diff": max(float((grads[n] - p.grad).abs().max())
                             for n, p in ref.named_parameters()),
            "kv_groups": attn.num_key_value_groups,
            "tied": model.lm_head.weight is model.model.embed_tokens.weight,
            "styles": {k.removeprefix("model.layers.0."): type(v).__name__
                       for k, v in plan.items() if k.startswith("model.layers.0.")},
        }
    # heads that do not divide: refused on every rank before any module changes
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        _tp_config("llama_1kv", hidden_size=48, num_attention_heads=3, num_key_value_heads=3))
    try:
        apply_tp(model, mesh, hf_tp_plan(model))
        facts["bad_heads"] = None
    except ValueError as e:
        facts["bad_heads"] = (str(e), any(isinstance(p, DTensor) for p in model.parameters()))
    return facts


def test_tp_alone_gqa_per_head_norms_and_fused_projections(world):
    results = world(2).run(_tp_only, list(TP_ONLY))
    for facts in results:
        for case in TP_ONLY:
            f = facts[case]
            assert f["logits_diff"] <= 1e-5, (case, f["logits_diff"])
            assert f["grad_diff"] <= 1e-5, (case, f["grad_diff"])
        one_kv = facts["llama_1kv"]
        # 4 query heads, 1 KV head, 2 ranks: each rank 2 query heads and a replica of the KV head
        assert one_kv["kv_groups"] == 2
        assert one_kv["styles"]["self_attn.k_proj"] == "ReplicatedKVColwise"
        assert one_kv["styles"]["self_attn"] == "HFAttentionHeads"
        for case in ("qwen3", "gemma3"):
            assert facts[case]["kv_groups"] == 2  # 4 / 2 heads, evenly split: unchanged
            assert facts[case]["styles"]["self_attn.q_norm"] == "ReplicatedPartialGrad"
        assert facts["gemma3"]["tied"]
        assert facts["phi3"]["styles"] == {  # no head split: the attention sees every head
            "self_attn.qkv_proj": "ColwiseKeepTied", "self_attn.o_proj": "RowwiseKeepTied",
            "mlp.gate_up_proj": "ColwiseKeepTied", "mlp.down_proj": "RowwiseKeepTied"}
        msg, changed = facts["bad_heads"]
        assert "model.layers.0.self_attn" in msg and "Number of attention heads (3) must be " \
            "divisible by tensor parallel size (2)" in msg
        assert not changed


# ---------------------------------------------------------------------------------------------
# single process: the plan itself, and what is refused
def _meta(family: str, dtype: torch.dtype = torch.float32, **over):
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(_config(family, **over), dtype=dtype)


def test_plan_for_llama_keys_layouts_and_order():
    from torch.distributed.tensor import Replicate, Shard

    model = _meta("llama_tied")
    params = {n: p for n, p in model.named_parameters()}
    plan = hf_tp_plan(model)
    layer = ["self_attn", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
             "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    assert list(plan) == ["model.embed_tokens", *[f"model.layers.{i}.{m}" for i in (0, 1)
                                                  for m in layer], "lm_head"]
    assert {n: p for n, p in model.named_parameters()} == params  # only read
    emb, head = plan["model.embed_tokens"], plan["lm_head"]
    assert (emb.input_layouts, emb.output_layouts) == ((Replicate(),), (Replicate(),))
    assert (head.input_layouts, head.output_layouts) == ((Replicate(),), (Replicate(),))
    q, o = plan["model.layers.0.self_attn.q_proj"], plan["model.layers.0.self_attn.o_proj"]
    assert (q.output_layouts, q.use_local_output) == ((Shard(-1),), True)
    assert (o.input_layouts, o.output_layouts) == ((Shard(-1),), (Replicate(),))
    # the two ends of the tied weight know each other
    assert emb.tied == {"weight": [(model.lm_head, "weight")]}
    assert head.tied == {"weight": [(model.model.embed_tokens, "weight")]}
    assert hf_tp_plan(_meta("llama"))["lm_head"].tied == {}  # untied: nothing to keep

    sp = hf_tp_plan(model, sequence_parallel=True)
    assert sp["model.embed_tokens"].output_layouts == (Shard(1),)
    assert sp["lm_head"].input_layouts == (Shard(1),)
    assert sp["model.layers.0.self_attn.o_proj"].output_layouts == (Shard(1),)
    assert sp["model.layers.0.self_attn"].gather_sequence
    assert {k for k, v in sp.items() if type(v).__name__ == "SequenceParallel"} == {
        "model.layers.0.input_layernorm", "model.layers.0.post_attention_layernorm",
        "model.layers.1.input_layernorm", "model.layers.1.post_attention_layernorm", "model.norm"}


def _with_plan(rules: dict, family: str = "llama"):
    model = _meta(family)
    model._tp_plan = rules  # what model.tp_plan returns
    return model


@pytest.mark.parametrize("string", sorted(REFUSED))
def test_refused_strings_name_the_string_and_the_module(string):
    model = _with_plan({"model.layers.*.mlp.gate_proj": string})
    with pytest.raises(ValueError, match=rf"style '{string}' of module "
                                         r"'model\.layers\.0\.mlp\.gate_proj'.*no translation"):
        hf_tp_plan(model)


def test_other_refusals():
    with pytest.raises(ValueError, match=r"style 'gather' of module 'model\.norm'.*unknown"):
        hf_tp_plan(_with_plan({"model.norm": "gather"}))
    with pytest.raises(ValueError, match=r"'colwise' of module 'model\.embed_tokens' shards an "
                                         r"nn\.Linear, but the module is a Embedding"):
        hf_tp_plan(_with_plan({"model.embed_tokens": "colwise"}))
    with pytest.raises(ValueError, match=r"rule 'model\.layers\.\*\.mlp\.up_proj\.weight' -> "
                                         r"'colwise' names the parameter"):
        hf_tp_plan(_with_plan({"model.layers.*.mlp.up_proj.weight": "colwise"}))
    with pytest.raises(ValueError, match="declares no tensor-parallel plan"):
        hf_tp_plan(_with_plan({}))
    # the tied weight: hidden-dim sharded by the embedding, vocab-sharded by lm_head
    with pytest.raises(ValueError, match=r"tied parameter placed differently.*"
                                         r"'model\.embed_tokens\.weight' Shard\(1\)"):
        hf_tp_plan(_with_plan({"model.embed_tokens": "embedding_colwise",
                               "lm_head": "colwise_gather_output"}, "llama_tied"))
    with pytest.raises(ValueError, match=r"tied parameter.*'lm_head\.weight' unsharded"):
        hf_tp_plan(_with_plan({"model.embed_tokens": "embedding_rowwise"}, "llama_tied"))
    with pytest.raises(ValueError, match="sequence_parallel=True needs a plan"):
        hf_tp_plan(_with_plan({"model.layers.*.mlp.down_proj": "rowwise"}),
                   sequence_parallel=True)
    ends = {"model.embed_tokens": "embedding_rowwise", "lm_head": "colwise_gather_output"}
    with pytest.raises(ValueError, match=r"other modules outside blocks "
                                         r"\{'model\.layers\.0\.mlp': 'all_reduce'"):
        hf_tp_plan(_with_plan({**ends, "model.layers.*.mlp": "all_reduce",
                               "model.layers.*.mlp.down_proj": "rowwise"}),
                   sequence_parallel=True)
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn\.q_proj' \(Linear\) "
                                         r"holds parameters outside"):
        hf_tp_plan(_with_plan({**ends, "model.layers.*.mlp.down_proj": "rowwise"}),
                   sequence_parallel=True)
    with pytest.raises(TypeError, match="must be an nn.Module"):
        hf_tp_plan({"lm_head": "colwise"})


def test_public_name():
    import fsdptk
    import fsdptk.hf

    assert fsdptk.hf_tp_plan is hf_tp_plan
    assert "hf_tp_plan" in fsdptk.__all__
    assert fsdptk.hf.hf_tp_plan is hf_tp_plan


def test_plan_cli_reports_tp_times_fsdp_bytes_for_an_hf_directory(tmp_path, capsys, monkeypatch):
    from pathlib import Path

    from fsdptk.cli import main

    _config("qwen2").save_pretrained(tmp_path)  # config.json is all `plan` reads
    assert main(["plan", str(tmp_path), "--world-size", "4", "--tp", "2"]) == 0
    out = capsys.readouterr().out
    meta = _meta("qwen2")
    planned = describe_hf_2d(meta, no_split_modules(meta), world_size=4, tp=2)
    assert "Tensor parallel: tp 2 x dp_shard 2" in out
    assert str(planned) in out
    assert main(["plan", str(tmp_path), "--world-size", "4"]) == 0  # FSDP alone: 4-way shards
    fsdp_only = capsys.readouterr().out
    assert "Tensor parallel" not in fsdp_only and "over 4 rank(s)" in fsdp_only
    # 4 heads do not split over 8 TP ranks: one line on stderr, exit code 1
    assert main(["plan", str(tmp_path), "--world-size", "8", "--tp", "8"]) == 1
    assert "Number of attention heads (4) must be divisible by tensor parallel size (8)" in \
        capsys.readouterr().err
    assert main(["plan", str(tmp_path), "--world-size", "4", "--tp", "3"]) == 1
    assert "must be a positive divisor of the world size (4)" in capsys.readouterr().err
    # a model factory declares no TP plan of its own; --tp 0 is a usage error
    monkeypatch.chdir(Path(__file__).resolve().parent.parent)
    monkeypatch.syspath_prepend(str(Path.cwd()))
    assert main(["plan", "examples.llama:tiny", "--world-size", "4", "--tp", "2"]) == 1
    assert "--tp needs a Hugging Face checkpoint directory" in capsys.readouterr().err
    assert main(["plan", str(tmp_path), "--world-size", "4", "--tp", "0"]) == 2
    assert "--tp: must be >= 1, got 0" in capsys.readouterr().err
