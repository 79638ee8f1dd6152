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
- errors on every rank: an ``ep`` that does not divide the experts, a model without an EP plan,
  ``shard_model`` without the expert mesh.
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


def test_shard_model_needs_the_expert_mesh(world):
    _same_on_every_rank(world(2).run(_shard_without_expert_mesh), "ValueError",
                        "expert_dp_mesh=dims.expert_fsdp_mesh")
