"""Expert parallelism with transformers' real MoE models (Mixtral, Qwen3-MoE, DeepSeek-V3; tiny
configs written with ``save_pretrained``, nothing downloaded) on 4 gloo ranks, ``ep=2`` with
``dp_shard=4``, with ``dp_shard=2, tp=2`` and (Qwen3-MoE) with HSDP ``dp_replicate=2, dp_shard=2``;
the judge is transformers' single-process model:

- ``fsdptk.hf.from_pretrained(dims=ParallelDims(..., ep=2))``: logits, the whole-batch loss of a
  training step and the logits after it equal the single-process model's; every expert parameter
  is a DTensor ``Shard(0)`` over a mesh dim named ``ep``;
- ``gather_cpu_state_dict`` holds every expert (equal to the single-process trained state), and
  ``save_safetensors`` writes save_pretrained's Hub layout, which transformers loads (with one
  writer, and with ``writers=4`` the same tensors);
- each rank reads only its experts' bytes;
- full <-> sharded optimizer state by FQN (equal to single-process Adam's), ``save_dcp`` at
  ``ep=2`` on 4 ranks resumed with ``load_dcp`` on 2 ranks without EP, and that saved again and
  resumed at ``tp=2, ep=2`` on 4 ranks, exactly; the background save;
- the all-to-all dispatch against the unsharded experts module for drawn routings (hypothesis):
  outputs and every gradient;
- gradients: after one backward and FSDP's reduction, every expert and dense parameter's
  ``.grad`` (made full) equals transformers' single-process ``.grad`` on the whole batch, for every
  layout ``ParallelDims`` accepts at 4 and at 2 ranks (enumerated through ``ParallelDims`` itself),
  with ``reduce_dtype`` fp32, bf16 and fp16; the placements and mesh dims of expert and dense
  parameters and which experts each rank holds, as docs/expert_parallel.md states them; gpt-oss
  (logits and gradients) at ``ep=2`` and ``tp=2, ep=2``;
- errors on every rank: an ``ep`` that does not divide the experts, a model without an EP plan,
  ``shard_model`` without the expert mesh, or with an expert mesh larger than the dense one.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

transformers = pytest.importorskip("transformers")

from test_hf_moe import (  # noqa: E402
    _BATCH,
    _batch,
    _config,
    _files,
    _logits,
    _reads,
    assert_like_the_reference,
    build_reference,
    sgd_step,
)

from fsdptk import ParallelDims  # noqa: E402
from fsdptk.hf import from_pretrained  # noqa: E402

from _counting import raised  # noqa: E402

EP_LAYOUTS = [({"dp_shard": 4, "ep": 2}, f) for f in ("mixtral", "qwen3_moe", "deepseek_v3")]
EP_LAYOUTS += [({"dp_shard": 2, "tp": 2, "ep": 2}, f) for f in ("mixtral", "qwen3_moe", "deepseek_v3")]
# efsdp = 1 (each expert on one rank of a replica): FSDP's shard group has one rank
EP_LAYOUTS += [({"dp_replicate": 2, "dp_shard": 2, "ep": 2}, "qwen3_moe"), ({"dp_shard": 4, "ep": 4}, "qwen3_moe")]
_IDS = [f"{'tp2-' if 'tp' in d else 'hsdp-' if 'dp_replicate' in d else ''}ep{d['ep']}-{f}" for d, f in EP_LAYOUTS]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """family -> the Hub-layout directory and transformers' single-process results."""
    return lambda family: build_reference(tmp_path_factory, family)


def _expert_placements(model) -> dict[str, tuple]:
    """Every parameter of an expert-parallel module: (mesh dim names, placements as strings)."""
    from fsdptk import expert_modules

    out = {}
    for fqn in expert_modules(model):
        for n, p in model.get_submodule(fqn).named_parameters():
            out[f"{fqn}.{n}"] = (p.device_mesh.mesh_dim_names, tuple(repr(x) for x in p.placements),
                                 tuple(p.to_local().shape))
    return out


def _rows(dims: ParallelDims, batch: torch.Tensor) -> torch.Tensor:
    per = _BATCH // dims.dp_degree
    return batch[dims.dp_rank * per:(dims.dp_rank + 1) * per]


# ---------------------------------------------------------------------------------------------
# run on every rank
def _ep_train_save(src: str, dims_kw: dict, out: str) -> dict:
    import torch.distributed as dist

    from fsdptk import gather_cpu_state_dict, save_safetensors

    dims = ParallelDims(**dims_kw)
    model = from_pretrained(src, dims=dims)
    batch = _batch()
    loaded = _logits(model, batch)
    placements = _expert_placements(model)
    loss = sgd_step(model, batch, dims.dp_degree, dims.dp_rank)
    trained = _logits(model, batch)
    full = gather_cpu_state_dict(model, dist.get_rank() == 0)
    save_safetensors(model, out)
    save_safetensors(model, f"{out}-writers", writers=4)  # every rank writes its files
    return {"loaded": loaded, "loss": loss, "trained": trained, "placements": placements, "full": full}


@pytest.mark.parametrize("dims_kw, family", EP_LAYOUTS, ids=_IDS)
def test_ep_loads_trains_gathers_and_saves_the_hub_layout(world, reference, tmp_path, dims_kw, family):
    ref = reference(family)
    results = world(4).run(_ep_train_save, str(ref["src"]), dims_kw, str(tmp_path / "out"))
    for r in results:
        assert_like_the_reference(r, ref)
        assert r["placements"], "no expert-parallel module"
        hsdp = "dp_replicate" in dims_kw
        holders = dims_kw["dp_shard"] * dims_kw.get("tp", 1)  # efsdp * ep: one copy of the experts
        for name, (dims, placements, local) in r["placements"].items():
            assert dims == (("dp_replicate",) if hsdp else ()) + ("efsdp", "ep"), (name, dims)
            assert placements[dims.index("ep")] == "Shard(dim=0)", (name, placements)
            full = ref["trained_sd"][name].shape
            assert local[0] == full[0] // holders and tuple(local[1:]) == tuple(full[1:]), (name, local)
    full, want = results[0]["full"], ref["trained_sd"]
    assert sorted(full) == sorted(want)  # every key, every expert
    for k in want:
        assert (full[k] - want[k]).abs().max().item() <= 1e-5, k
    assert all(not r["full"] for r in results[1:])
    hub, saved = _files(ref["src"]), _files(tmp_path / "out")
    assert sorted(saved) == sorted(hub)  # save_pretrained's per-expert keys
    many = _files(tmp_path / "out-writers")
    assert sorted(many) == sorted(saved) and all(torch.equal(many[k], saved[k]) for k in saved)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out",
                                                                    output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert (_logits(model, _batch()) - ref["trained"]).abs().max().item() <= 1e-4


@pytest.mark.parametrize("dims_kw", [{"dp_shard": 4, "ep": 2}, {"dp_shard": 2, "tp": 2, "ep": 2}],
                         ids=["ep2", "tp2-ep2"])
def test_each_ep_rank_reads_only_its_experts(world, reference, dims_kw):
    """8 experts, ep=2 x efsdp=2: each rank holds 2 whole experts and reads exactly their
    per-expert tensors, whole (experts are not tensor-parallel): a quarter of the experts' bytes."""
    ref = reference("qwen3_moe")
    hub = _files(ref["src"])
    expert_bytes = sum(t.numel() * t.element_size() for k, t in hub.items() if ".experts." in k)
    per_rank = world(4).run(_reads, str(ref["src"]), dims_kw)
    held = []
    for seen in per_rank:
        read = [(k, s, n) for k, s, n in seen if ".experts." in k]
        experts = {int(k.split(".experts.")[1].split(".")[0]) for k, _, _ in read}
        assert len(experts) == 2, sorted(experts)
        held.append(experts)
        assert sum(n for _, _, n in read) == expert_bytes // 4
        assert all(shape == tuple(hub[k].shape) for k, shape, _ in read)
    assert set().union(*held) == set(range(8))


def _adam_state_and_dcp(src: str, dims_kw: dict | None, out: str, save: bool,
                        load_from: str = "dcp", then_save: str | None = None) -> dict:
    """A step of Adam saved to ``dcp`` (save), or a fresh model resumed from ``load_from`` and
    saved again to ``then_save``; the full model and optimizer states on rank 0, and the
    optimizer state's full -> sharded -> full round trip."""
    import torch.distributed as dist

    from fsdptk import (
        gather_cpu_state_dict,
        get_full_optimizer_state_dict,
        load_dcp,
        load_from_full_optimizer_state_dict,
        save_dcp,
        save_safetensors_async,
    )

    rank0 = dist.get_rank() == 0
    dims = ParallelDims(**dims_kw) if dims_kw else ParallelDims()
    model = from_pretrained(src, dims=dims)
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    if save:
        rows = _rows(dims, _batch())
        model(input_ids=rows, labels=rows).loss.backward()
        opt.step()
        opt.zero_grad()
        save_dcp(model, f"{out}/dcp", opt)
        save_safetensors_async(model, f"{out}/async").wait()
    else:
        load_dcp(model, f"{out}/{load_from}", opt)
        if then_save:
            save_dcp(model, f"{out}/{then_save}", opt)
    full_opt = get_full_optimizer_state_dict(model, opt, rank0)
    again = torch.optim.Adam(model.parameters(), lr=1e-3)
    load_from_full_optimizer_state_dict(model, again, full_opt, "cpu", broadcast_from_rank0=True)
    return {"model": gather_cpu_state_dict(model, rank0), "opt": full_opt,
            "round_trip": get_full_optimizer_state_dict(model, again, rank0)}


def _opt_tensors(full_opt: dict) -> dict[tuple[str, str], torch.Tensor]:
    return {(fqn, k): v for fqn, st_ in full_opt["state"].items() for k, v in st_.items()
            if isinstance(v, torch.Tensor) and v.dim()}


def test_optimizer_state_and_dcp_resume_across_ep_degrees(world, reference, tmp_path):
    ref = reference("qwen3_moe")
    src = str(ref["src"])
    saved = world(4).run(_adam_state_and_dcp, src, {"dp_shard": 4, "ep": 2}, str(tmp_path), True)[0]
    # the single-process judge: transformers' model, the same step of Adam on the whole batch
    model = transformers.AutoModelForCausalLM.from_pretrained(src)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    batch = _batch()
    model(input_ids=batch, labels=batch).loss.backward()
    opt.step()
    names = {id(p): n for n, p in model.named_parameters()}
    want = {(names[id(p)], k): v for p, s in opt.state.items() for k, v in s.items() if v.dim()}
    got = _opt_tensors(saved["opt"])
    assert sorted(got) == sorted(want)
    assert any(".experts." in fqn for fqn, _ in got)
    for key, v in want.items():
        assert (got[key] - v).abs().max().item() <= 1e-6, key
    for key, v in _opt_tensors(saved["round_trip"]).items():
        assert torch.equal(v, got[key]), key
    resumed = world(2).run(_adam_state_and_dcp, src, None, str(tmp_path), False, "dcp", "no-ep")[0]
    # and back: saved without EP on 2 ranks, resumed at ep=2 with TP on 4
    back = world(4).run(_adam_state_and_dcp, src, {"dp_shard": 2, "tp": 2, "ep": 2}, str(tmp_path),
                        False, "no-ep")[0]
    for run in (resumed, back):
        assert sorted(run["model"]) == sorted(saved["model"])
        for k, v in saved["model"].items():
            assert torch.equal(run["model"][k], v), k
        again = _opt_tensors(run["opt"])
        assert sorted(again) == sorted(got)
        for key, v in got.items():
            assert torch.equal(again[key], v), key
    hub, written = _files(ref["src"]), _files(tmp_path / "async")  # the background save, Hub layout
    assert sorted(written) == sorted(hub)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "async").state_dict()
    for k, v in saved["model"].items():
        assert torch.equal(loaded[k], v), k


# ---------------------------------------------------------------------------------------------
# the dispatch alone, against the unsharded experts module
def _grad(t: torch.Tensor) -> torch.Tensor:
    return t.grad if t.grad is not None else torch.zeros_like(t)


def _dispatch_matches(cases: list[tuple[int, int, int]], tp: int) -> list[str]:
    """For each (tokens, top_k, seed): EP output and gradients == the whole module's. Every rank
    draws its own tokens (ranks of one TP group the same ones)."""
    import copy

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from fsdptk import apply_ep

    world_size, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world_size // tp, tp), mesh_dim_names=("dp", "tp"))
    ep_mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",))
    batch_rank = mesh.get_local_rank("dp")
    cfg = _config("qwen3_moe")
    failures = []
    for tokens, top_k, seed in cases:
        torch.manual_seed(seed)
        whole = Qwen3MoeExperts(cfg)
        for p in whole.parameters():
            torch.nn.init.normal_(p, std=0.1)
        ep = copy.deepcopy(whole)
        apply_ep(ep, ep_mesh, lambda n, m: n == "", tp_mesh=mesh["tp"] if tp > 1 else None)
        g = torch.Generator().manual_seed(seed * 100 + batch_rank)
        n = tokens + batch_rank  # ranks of different batches hold different token counts
        hidden = torch.randn(n, cfg.hidden_size, generator=g)
        index = torch.stack([torch.randperm(cfg.num_experts, generator=g)[:top_k] for _ in range(n)]
                            ) if n else torch.zeros(0, top_k, dtype=torch.long)
        weights = torch.rand(n, top_k, generator=g)
        outs, grads = [], []
        for module in (whole, ep):
            h, w = hidden.clone().requires_grad_(), weights.clone().requires_grad_()
            out = module(h, index, w)
            loss = (out * torch.arange(out.numel()).view_as(out).sin()).sum()
            if loss.requires_grad:  # the whole module on no tokens builds no graph
                loss.backward()
            outs.append(out.detach())
            grads.append((_grad(h), _grad(w)))
        local = cfg.num_experts // world_size
        if not torch.allclose(outs[0], outs[1], atol=1e-6):
            failures.append(f"{(tokens, top_k, seed)}: outputs differ")
        for name, a, b in (("hidden", grads[0][0], grads[1][0]), ("weights", grads[0][1], grads[1][1])):
            if not torch.allclose(a, b, atol=1e-6):
                failures.append(f"{(tokens, top_k, seed)}: {name} gradients differ")
        for pname, p in whole.named_parameters():
            total = _grad(p).clone()
            dist.all_reduce(total)  # every rank's tokens reach the experts
            total /= tp  # a TP group's ranks hold the same tokens: count them once
            mine = total[rank * local:(rank + 1) * local]
            got = getattr(ep, pname).grad.to_local()
            if not torch.allclose(mine, got, atol=1e-5):
                failures.append(f"{(tokens, top_k, seed)}: {pname} gradient differs")
    return failures


@settings(max_examples=4)
@given(cases=st.lists(st.tuples(st.integers(0, 9), st.integers(1, 3), st.integers(0, 10**6)),
                      min_size=1, max_size=3))
def test_all_to_all_dispatch_equals_the_whole_module(world, cases):
    for failures in world(2).run(_dispatch_matches, cases, 1):
        assert not failures, failures


def test_dispatch_with_tp_slices_tokens_once(world):
    """ep=4 holding two TP groups of 2 (each pair shares a batch): each token computed once."""
    for failures in world(4).run(_dispatch_matches, [(5, 2, 1), (0, 1, 2), (1, 3, 3)], 2):
        assert not failures, failures


# ---------------------------------------------------------------------------------------------
# errors, on every rank
def _ep_error(src: str, dims_kw: dict) -> tuple[str, str]:
    return raised(lambda: from_pretrained(src, dims=ParallelDims(**dims_kw)))


def _same_on_every_rank(results, kind: str, *needles: str) -> None:
    for r in results:
        assert r[0] == kind, r
        for n in needles:
            assert n in r[1], (n, r[1])


def test_ep_that_does_not_divide_the_experts_is_named_on_every_rank(world, tmp_path):
    cfg = _config("qwen3_moe")
    cfg.num_experts = 6
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    results = world(4).run(_ep_error, str(tmp_path), {"dp_shard": 4, "ep": 4})
    _same_on_every_rank(results, "ValueError", "ep (4)", "number of experts (6)",
                        "model.layers.0.mlp.experts")


def test_model_without_an_ep_plan_is_refused_on_every_rank(world, tmp_path):
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    results = world(2).run(_ep_error, str(tmp_path), {"dp_shard": 2, "ep": 2})
    _same_on_every_rank(results, "ValueError", "LlamaForCausalLM", "no expert-parallel plan")


def _shard_without_expert_mesh() -> tuple[str, str]:
    from fsdptk import apply_ep, shard_model
    from fsdptk.hf import hf_ep_plan, hf_meta_model, no_split_modules

    dims = ParallelDims(dp_shard=2, ep=2)
    dims.build_mesh("cpu")
    model = hf_meta_model(_config("qwen3_moe"))
    apply_ep(model, dims.ep_mesh, hf_ep_plan(model))
    return raised(lambda: shard_model(model, no_split_modules(model), cpu_offload=False,
                                      dp_mesh=dims.fsdp_mesh))


def _shard_with_a_smaller_dense_mesh() -> tuple[str, str, bool]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule

    from fsdptk import apply_ep, shard_model
    from fsdptk.hf import hf_ep_plan, hf_meta_model, no_split_modules

    dims = ParallelDims(dp_shard=4, ep=2)
    dims.build_mesh("cpu")
    model = hf_meta_model(_config("qwen3_moe"))
    apply_ep(model, dims.ep_mesh, hf_ep_plan(model))
    one = init_device_mesh("cpu", (4, 1), mesh_dim_names=("a", "b"))["b"]
    kind, msg = raised(lambda: shard_model(model, no_split_modules(model), cpu_offload=False,
                                           dp_mesh=one, expert_dp_mesh=dims.expert_fsdp_mesh))
    return kind, msg, any(isinstance(m, FSDPModule) for m in model.modules())


def test_expert_mesh_larger_than_the_dense_mesh_is_refused_before_sharding(world):
    """The experts' gradient scale (expert mesh size / dense dp size) would exceed 1."""
    for kind, msg, sharded in world(4).run(_shard_with_a_smaller_dense_mesh):
        assert (kind, sharded) == ("ValueError", False), (kind, msg)
        assert "expert_dp_mesh has 2 ranks" in msg and "(1)" in msg, msg


def test_shard_model_needs_the_expert_mesh(world):
    _same_on_every_rank(world(2).run(_shard_without_expert_mesh), "ValueError",
                        "expert_dp_mesh=dims.expert_fsdp_mesh")


# ---------------------------------------------------------------------------------------------
# gradients: every parameter's reduced .grad against transformers' single-process model, for
# every layout ParallelDims accepts (enumerated through ParallelDims itself, so a newly accepted
# layout is covered), fp32 and a low-precision reduce_dtype; and where the experts live
def accepted_ep_layouts(world_size: int) -> list[dict]:
    """Every ``ParallelDims(dp_replicate, dp_shard, tp, ep>1)`` the mesh accepts at ``world_size``
    ranks: the constructor is the judge (ep divides dp_shard * tp and is a multiple of tp)."""
    out = []
    for r in range(1, world_size + 1):
        for t in range(1, world_size + 1):
            if world_size % (r * t):
                continue
            for ep in range(2, world_size + 1):
                kw = {"dp_replicate": r, "dp_shard": world_size // (r * t), "tp": t, "ep": ep}
                try:
                    ParallelDims(**kw, world_size=world_size)
                except ValueError:
                    continue
                out.append(kw)
    return out


def _layout_id(kw: dict) -> str:
    return "-".join(f"{k.replace('dp_', '')}{v}" for k, v in kw.items())


GRAD_LAYOUTS = [(n, kw) for n in (4, 2) for kw in accepted_ep_layouts(n)]
_GRAD_FAMILIES = {  # tiny and TP-able at tp=4 (4 KV heads, vocab divisible by 4)
    "qwen3_moe": ("Qwen3MoeConfig", {"num_experts": 8, "moe_intermediate_size": 16,
                                     "intermediate_size": 32, "head_dim": 8}),
    "gpt_oss": ("GptOssConfig", {"num_local_experts": 8, "intermediate_size": 16, "head_dim": 8}),
}
# fp32 reduction: the only differences are summation orders: rtol 1e-5 and atol 1e-5 of the
# tensor's largest |want| (measured: at most 1.1e-6 of it; gradients here are ~1e-3, so a fixed
# atol of 1e-6 would pass a relative error of 2e-4; this one fails at 2e-5). A 16-bit
# reduce_dtype (unit roundoff u = finfo.eps / 2: 2**-8 for bf16, 2**-11 for fp16): each gradient is
# rounded on the cast to it, the pre-division (fp16), each partial sum of the reduce-scatter (at
# most 2 here) and of the all-reduce (1), the post-division and the cast back: at most 7 roundings,
# so |got - want| <= 8u * (scale of the summands), taken per tensor as its largest |want|
# (measured: at most 2u for bf16, 3.4u for fp16). A wrong divisor is a factor >= 2: an error of
# >= 50% of that tensor's largest entry.
_FP32_RTOL = 1e-5


def _low_precision_bound(reduce_dtype: str) -> float:
    """8 unit roundoffs of ``reduce_dtype``, relative to a tensor's largest entry (see above)."""
    return 8 * torch.finfo(getattr(torch, reduce_dtype)).eps / 2


def _grad_config(family: str):
    cls, extra = _GRAD_FAMILIES[family]
    kw = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
              vocab_size=128, num_experts_per_tok=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return getattr(transformers, cls)(**{**kw, **extra})


_GRAD_REFS: dict[str, dict] = {}


@pytest.fixture(scope="module")
def grad_reference(tmp_path_factory):
    """family -> a save_pretrained directory, transformers' single-process logits and every
    parameter's .grad of the mean loss over the whole batch."""

    def build(family: str) -> dict:
        if family not in _GRAD_REFS:
            root = tmp_path_factory.mktemp(f"grads-{family}")
            torch.manual_seed(0)
            transformers.AutoModelForCausalLM.from_config(_grad_config(family)).save_pretrained(root)
            model = transformers.AutoModelForCausalLM.from_pretrained(root)
            batch = _grad_batch()
            logits = _logits(model, batch)
            model.train()
            model(input_ids=batch, labels=batch).loss.backward()
            _GRAD_REFS[family] = {"src": root, "logits": logits,
                                  "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}
        return _GRAD_REFS[family]

    return build


def _grad_batch() -> torch.Tensor:
    return torch.randint(3, 128, (_BATCH, 8), generator=torch.Generator().manual_seed(11))


def _held_experts(p) -> list[int]:
    """The experts (rows of the full tensor) this rank's local shard of ``p`` holds."""
    full, local = p.full_tensor(), p.to_local()
    return [next(j for j in range(full.shape[0]) if torch.equal(full[j], row)) for row in local]


def _ep_grads(src: str, dims_kw: dict, reduce_dtype: str | None) -> dict:
    """One backward of this rank's rows (the loss is each rank's mean, so FSDP's average over the
    data-parallel ranks is the whole batch's mean); every parameter's full reduced .grad (rank 0),
    every parameter's mesh dims and placements, the experts each rank holds, the logits."""
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.tensor import DTensor

    from fsdptk import expert_modules

    dims = ParallelDims(**dims_kw)
    mp = MixedPrecisionPolicy(reduce_dtype=getattr(torch, reduce_dtype)) if reduce_dtype else None
    model = from_pretrained(src, dims=dims, mp_policy=mp)
    logits = _logits(model, _grad_batch())
    model.train()
    per = _BATCH // dims.dp_degree
    rows = _grad_batch()[dims.dp_rank * per:(dims.dp_rank + 1) * per]
    model(input_ids=rows, labels=rows).loss.backward()
    grads, layout = {}, {}
    for n, p in model.named_parameters():  # the same order on every rank: collectives line up
        g = p.grad
        grads[n] = g.full_tensor() if isinstance(g, DTensor) else g
        layout[n] = (p.device_mesh.mesh_dim_names, tuple(repr(x) for x in p.placements))
    held = {f: _held_experts(next(model.get_submodule(f).parameters())) for f in expert_modules(model)}
    return {"grads": grads if dist.get_rank() == 0 else {}, "layout": layout, "held": held,
            "logits": logits}


def _expected_held(dims: ParallelDims, rank: int, experts: int) -> list[int]:
    """What docs/expert_parallel.md says rank ``rank`` holds: the ep rank's contiguous range of
    experts, of which the efsdp rank's contiguous part (FSDP's Shard(0) of that range); the expert
    mesh is (dp_replicate, efsdp, ep) over the ranks in order."""
    ep_rank, efsdp_rank = rank % dims.ep, (rank // dims.ep) % dims.efsdp
    per_ep = experts // dims.ep
    per = per_ep // dims.efsdp
    start = ep_rank * per_ep + efsdp_rank * per
    return list(range(start, start + per))


def _check_grads(results: list[dict], ref: dict, reduce_dtype: str | None) -> None:
    got = results[0]["grads"]
    assert sorted(got) == sorted(ref["grads"])
    assert any(".experts." in n for n in got)
    for n, want in ref["grads"].items():
        g = got[n]
        assert g.dtype == want.dtype and g.shape == want.shape, (n, g.dtype, g.shape)
        if reduce_dtype is None:
            torch.testing.assert_close(g, want, rtol=_FP32_RTOL, atol=_FP32_RTOL * want.abs().max().item(),
                                       msg=lambda m, n=n: f"{n}: {m}")
        else:
            bound = _low_precision_bound(reduce_dtype) * want.abs().max().item()
            err = (g - want).abs().max().item()
            assert err <= bound, f"{n}: {reduce_dtype}-reduced gradient off by {err} > {bound}"
    for r in results:
        assert (r["logits"] - ref["logits"]).abs().max().item() <= 1e-5


def _check_layout(results: list[dict], dims_kw: dict, family: str) -> None:
    """The placements docs/expert_parallel.md states, on every rank: experts ``Shard(0)`` over
    ``ep`` and FSDP's (strided) shard of the rank's range over ``efsdp``, replicated over
    ``dp_replicate``; dense parameters FSDP's ``Shard(0)`` over ``dp_shard`` (strided over a TP
    dim-0 shard), replicated over ``dp_replicate``, then their TP placement; and which experts each
    rank holds."""
    dims = ParallelDims(**dims_kw, world_size=len(results))
    hsdp = ("dp_replicate",) if dims.dp_replicate > 1 else ()
    replicas = ("Replicate()",) * len(hsdp)
    cfg = _grad_config(family)
    experts = getattr(cfg, "num_experts", None) or cfg.num_local_experts
    for rank, r in enumerate(results):
        assert r["held"], "no expert-parallel module"
        for n, (mesh_dims, placements) in r["layout"].items():
            if ".experts." in n:
                assert mesh_dims == hsdp + ("efsdp", "ep"), (n, mesh_dims)
                assert placements == replicas + (f"_StridedShard(dim=0, sf={dims.ep})", "Shard(dim=0)"), (
                    n, placements)
                continue
            tp = mesh_dims[len(hsdp) + 1:]
            assert mesh_dims[:len(hsdp) + 1] == hsdp + ("dp_shard",) and tp in ((), ("tp",)), (n, mesh_dims)
            assert not tp or dims.tp > 1, (n, mesh_dims)
            on_tp_dim0 = tp and placements[-1] == "Shard(dim=0)"
            fsdp = f"_StridedShard(dim=0, sf={dims.tp})" if on_tp_dim0 else "Shard(dim=0)"
            assert placements[:len(hsdp) + 1] == replicas + (fsdp,), (n, placements)
        for fqn, held in r["held"].items():
            assert held == _expected_held(dims, rank, experts), (rank, fqn, held)


@pytest.mark.parametrize("reduce_dtype", [None, "bfloat16", "float16"], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("ranks, dims_kw", GRAD_LAYOUTS, ids=[f"{n}ranks-{_layout_id(kw)}" for n, kw in GRAD_LAYOUTS])
def test_ep_gradients_equal_the_single_process_model(world, grad_reference, ranks, dims_kw, reduce_dtype):
    ref = grad_reference("qwen3_moe")
    results = world(ranks).run(_ep_grads, str(ref["src"]), dims_kw, reduce_dtype)
    _check_grads(results, ref, reduce_dtype)
    if reduce_dtype is None:
        _check_layout(results, dims_kw, "qwen3_moe")


@pytest.mark.parametrize("dims_kw", [{"dp_shard": 4, "ep": 2}, {"dp_shard": 2, "tp": 2, "ep": 2}],
                         ids=["ep2", "tp2-ep2"])
def test_gpt_oss_under_ep_equals_the_single_process_model(world, grad_reference, dims_kw):
    """gpt-oss (biased experts, interleaved gate/up, sinks, sliding window) at 4 ranks: logits and
    every gradient against transformers' single-process model."""
    ref = grad_reference("gpt_oss")
    results = world(4).run(_ep_grads, str(ref["src"]), dims_kw, None)
    _check_grads(results, ref, None)
    _check_layout(results, dims_kw, "gpt_oss")
