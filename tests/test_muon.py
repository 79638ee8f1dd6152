"""``fsdptk.Muon`` judged by ``torch.optim.Muon`` in one process with the same full gradients.

Transformers' tiny Llama and Qwen3-MoE (written with ``save_pretrained`` here, nothing
downloaded) loaded with ``fsdptk.hf.from_pretrained`` under FSDP at 2 and 4 ranks, HSDP, FSDP x
TP and expert parallelism (fused 3-D experts); after a real backward on each rank's rows, every
rank's ``.grad`` is made full (``DTensor.full_tensor()``) and set on a single-process copy stepped
by ``torch.optim.Muon`` (a fused expert tensor: each expert's slice as its own parameter). After
each step every parameter's and momentum buffer's full tensor must be equal bit for bit. Also:
``nesterov=False``, ``adjust_lr_fn="match_rms_adamw"``, weight decay 0; the state gathered at one
world size and loaded at another, and into a single-process ``torch.optim.Muon``; DCP save and
resume; errors on every rank; the owners' spread and the bytes moved; a hypothesis property over
random shapes and placements of plain DTensors.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

transformers = pytest.importorskip("transformers")

from fsdptk import ParallelDims  # noqa: E402

_BATCH, _SEQ = 4, 8
_LR = 2e-2
_FAMILIES = {
    "llama": ("LlamaConfig", {"tie_word_embeddings": True, "intermediate_size": 96}),
    "qwen3_moe": ("Qwen3MoeConfig", {"num_experts": 8, "moe_intermediate_size": 16, "intermediate_size": 64,
                                     "head_dim": 16, "num_experts_per_tok": 2}),
}
_REFS: dict[str, str] = {}


def _checkpoint(tmp_path_factory, family: str) -> str:
    """A save_pretrained directory of a tiny random ``family`` model (once per session)."""
    if family not in _REFS:
        cls, extra = _FAMILIES[family]
        kw = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=250, pad_token_id=0, bos_token_id=1, eos_token_id=2)
        root = tmp_path_factory.mktemp(f"muon-{family}")
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**{**kw, **extra})).save_pretrained(root)
        _REFS[family] = str(root)
    return _REFS[family]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return lambda family: _checkpoint(tmp_path_factory, family)


# ---------------------------------------------------------------------------------------------
# run on every rank


def _batch(dims: ParallelDims, step: int) -> torch.Tensor:
    batch = torch.randint(3, 250, (_BATCH, _SEQ), generator=torch.Generator().manual_seed(7 + step))
    per = _BATCH // dims.dp_degree
    return batch[dims.dp_rank * per:(dims.dp_rank + 1) * per]


def _muon_params(model) -> list[tuple[str, torch.Tensor]]:
    """The hidden matrices and experts (the usual split: embeddings, head, norms to AdamW)."""
    return [(n, p) for n, p in model.named_parameters()
            if p.ndim >= 2 and "embed_tokens" not in n and "lm_head" not in n]


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t.detach().clone()


class _Reference:
    """torch.optim.Muon in this one process over full copies (experts: a parameter per slice)."""

    def __init__(self, named: list[tuple[str, torch.Tensor]], kwargs: dict) -> None:
        self.params: dict[str, list[torch.nn.Parameter]] = {}
        self.fused: dict[str, bool] = {}
        for n, p in named:
            full = _full(p.detach())
            self.fused[n] = full.ndim == 3
            self.params[n] = [torch.nn.Parameter(q.clone()) for q in (full.unbind(0) if self.fused[n] else [full])]
        self.opt = torch.optim.Muon([q for qs in self.params.values() for q in qs], **kwargs)

    def step(self, grads: dict[str, torch.Tensor]) -> None:
        for n, qs in self.params.items():
            for q, g in zip(qs, grads[n].unbind(0) if self.fused[n] else [grads[n]]):
                q.grad = g.clone()
        self.opt.step()

    def value(self, n: str) -> torch.Tensor:
        qs = [q.detach() for q in self.params[n]]
        return torch.stack(qs) if self.fused[n] else qs[0]

    def buffer(self, n: str) -> torch.Tensor:
        bufs = [self.opt.state[q]["momentum_buffer"] for q in self.params[n]]
        return torch.stack(bufs) if self.fused[n] else bufs[0]


def _mismatches(model, opt, ref, rank0: bool) -> list[str]:
    """Names whose full parameter or momentum buffer differs from the reference's (rank 0)."""
    bad = []
    for n, p in _muon_params(model):
        full_p, full_b = _full(p.detach()), _full(opt.state[p]["momentum_buffer"])
        if rank0:
            if not torch.equal(full_p, ref.value(n)):
                bad.append(f"{n} param (max diff {(full_p - ref.value(n)).abs().max().item():.3g})")
            if not torch.equal(full_b, ref.buffer(n)):
                bad.append(f"{n} momentum_buffer")
    return bad


def _train(src: str, dims_kw: dict, steps: int, kwargs: dict) -> list[list[str]]:
    """``steps`` Muon steps on the sharded model; per step, the names that differ from
    torch.optim.Muon's single-process step (reported by rank 0; [] elsewhere)."""
    import torch.distributed as dist

    from fsdptk import Muon
    from fsdptk.hf import from_pretrained

    dims = ParallelDims(**dims_kw)
    model = from_pretrained(src, dims=dims)
    named = _muon_params(model)
    rank0 = dist.get_rank() == 0
    ref = _Reference(named, kwargs)
    opt = Muon([p for _, p in named], **kwargs)
    out = []
    for step in range(steps):
        rows = _batch(dims, step)
        model(input_ids=rows, labels=rows).loss.backward()
        grads = {n: _full(p.grad) for n, p in named}
        if rank0:
            ref.step(grads)
        opt.step()
        out.append(_mismatches(model, opt, ref, rank0))
        model.zero_grad()
    return out


_LAYOUTS = [
    (2, {"dp_shard": 2}, "llama"),
    (4, {"dp_shard": 4}, "llama"),
    (4, {"dp_replicate": 2, "dp_shard": 2}, "llama"),
    (4, {"dp_shard": 2, "tp": 2}, "llama"),
    (4, {"dp_shard": 4, "ep": 2}, "qwen3_moe"),
    (4, {"dp_shard": 2, "tp": 2, "ep": 2}, "qwen3_moe"),
    (4, {"dp_replicate": 2, "dp_shard": 2, "ep": 2}, "qwen3_moe"),  # experts over 3 mesh dims
]
_IDS = ["fsdp2-llama", "fsdp4-llama", "hsdp-llama", "tp-llama", "ep-qwen3moe", "tp-ep-qwen3moe", "hsdp-ep-qwen3moe"]


@pytest.mark.parametrize("ranks, dims_kw, family", _LAYOUTS, ids=_IDS)
def test_muon_equals_torch_muon_bit_for_bit(world, checkpoint, ranks, dims_kw, family):
    results = world(ranks).run(_train, checkpoint(family), dims_kw, 3, {"lr": _LR})
    assert results[0] == [[], [], []]


_VARIANTS = [{"lr": _LR, "nesterov": False}, {"lr": _LR, "adjust_lr_fn": "match_rms_adamw"},
             {"lr": _LR, "weight_decay": 0.0, "momentum": 0.9}]


@pytest.mark.parametrize("kwargs", _VARIANTS, ids=["no-nesterov", "match-rms-adamw", "no-weight-decay"])
def test_muon_options_equal_torch_muon(world, checkpoint, kwargs):
    results = world(2).run(_train, checkpoint("qwen3_moe"), {"dp_shard": 2, "ep": 2}, 2, kwargs)
    assert results[0] == [[], []]


# ---------------------------------------------------------------------------------------------
# state: full <-> sharded by FQN, another world size, single-process torch.optim.Muon, DCP


def _train_and_save(src: str, dims_kw: dict, dcp_dir: str) -> tuple[dict, dict]:
    """Two Muon steps, then the full model and optimizer state on rank 0 and a DCP checkpoint."""
    import torch.distributed as dist

    from fsdptk import Muon, gather_cpu_state_dict, get_full_optimizer_state_dict
    from fsdptk.checkpoint import save_dcp
    from fsdptk.hf import from_pretrained

    dims = ParallelDims(**dims_kw)
    model = from_pretrained(src, dims=dims)
    opt = Muon([p for _, p in _muon_params(model)], lr=_LR)
    for step in range(2):
        rows = _batch(dims, step)
        model(input_ids=rows, labels=rows).loss.backward()
        opt.step()
        model.zero_grad()
    rank0 = dist.get_rank() == 0
    full_sd = gather_cpu_state_dict(model, rank0)
    full_osd = get_full_optimizer_state_dict(model, opt, rank0)
    save_dcp(model, dcp_dir, opt)
    return full_sd, full_osd


def _resume_and_step(src: str, dims_kw: dict, full_sd: dict, full_osd: dict, dcp_dir: str | None) -> list[str]:
    """Resume (from the full state, or from DCP) and take one step; what differs from a single-process
    torch.optim.Muon that loaded the full state dict (rank 0's report)."""
    import torch.distributed as dist

    from fsdptk import Muon, load_from_full_model_state_dict, load_from_full_optimizer_state_dict
    from fsdptk.checkpoint import load_dcp
    from fsdptk.hf import from_pretrained

    dims = ParallelDims(**dims_kw)
    model = from_pretrained(src, dims=dims)
    if dcp_dir is None:  # the model's load assigns new parameters: the optimizer comes after it
        load_from_full_model_state_dict(model, full_sd, "cpu", release_sd=False)
    named = _muon_params(model)
    opt = Muon([p for _, p in named], lr=_LR)
    if dcp_dir is None:
        load_from_full_optimizer_state_dict(model, opt, full_osd, "cpu")
    else:
        load_dcp(model, dcp_dir, opt)
    bad = [f"{n} resumed momentum_buffer" for n, p in named
           if not torch.equal(_full(opt.state[p]["momentum_buffer"]), full_osd["state"][n]["momentum_buffer"])]
    rows = _batch(dims, 2)
    model(input_ids=rows, labels=rows).loss.backward()
    grads = {n: _full(p.grad) for n, p in named}
    opt.step()
    if dist.get_rank() != 0:
        _ = [(_full(p.detach()), _full(opt.state[p]["momentum_buffer"])) for _, p in named]  # collectives
        return []
    # the full state dict in torch's own format (integer ids in group order) into torch.optim.Muon
    fqns = full_osd["param_groups"][0]["params"]
    ref = _Reference([(n, full_sd[n]) for n in fqns], {"lr": _LR})
    qs = [q for n in fqns for q in ref.params[n]]
    ref.opt.load_state_dict({"state": {i: full_osd["state"][n] for i, n in enumerate(fqns)},
                             "param_groups": [{**full_osd["param_groups"][0], "params": list(range(len(qs)))}]})
    ref.step(grads)
    return bad + _mismatches(model, opt, ref, True)


def test_state_resumes_at_another_world_size_and_in_torch_muon(world, checkpoint, tmp_path):
    src = checkpoint("llama")
    full_sd, full_osd = world(4).run(_train_and_save, src, {"dp_shard": 2, "tp": 2}, str(tmp_path / "dcp"))[0]
    assert sorted(full_osd["state"]) == sorted(full_osd["param_groups"][0]["params"])
    assert all(sorted(s) == ["momentum_buffer"] for s in full_osd["state"].values())
    for dcp_dir in (None, str(tmp_path / "dcp")):
        results = world(2).run(_resume_and_step, src, {"dp_shard": 2}, full_sd, full_osd, dcp_dir)
        assert results[0] == [], dcp_dir


# ---------------------------------------------------------------------------------------------
# errors on every rank


def _construct(bad_on: list[int]) -> tuple[str, str]:
    """Muon over a Linear's weight, and its bias on the ranks in ``bad_on``."""
    import torch.distributed as dist

    from fsdptk import Muon

    from _counting import raised

    lin = torch.nn.Linear(4, 3)
    named = [("proj.weight", lin.weight)] + ([("proj.bias", lin.bias)] if dist.get_rank() in bad_on else [])
    return raised(Muon, named)


def _step_with_grads(grad_on: list[int]) -> tuple[str, str]:
    """A step where only the ranks in ``grad_on`` have a gradient for the second matrix."""
    import torch.distributed as dist

    from fsdptk import Muon

    from _counting import raised

    a, b = torch.nn.Parameter(torch.ones(4, 3)), torch.nn.Parameter(torch.ones(3, 2))
    opt = Muon([a, b])
    a.grad = torch.ones(4, 3)
    if dist.get_rank() in grad_on:
        b.grad = torch.ones(3, 2)
    elif grad_on == []:  # every rank has both gradients, but rank 1's learning rate differs
        b.grad = torch.ones(3, 2)
        opt.param_groups[0]["lr"] = 0.5 if dist.get_rank() == 1 else 1e-3
    out = raised(opt.step)
    assert not opt.state[a], "a failed step changes nothing"
    assert torch.equal(a.detach(), torch.ones(4, 3))
    return out


def test_a_bad_parameter_is_named_on_every_rank(world):
    for bad_on in ([0, 1], [1]):
        results = world(2).run(_construct, bad_on)
        assert len({r[0] for r in results}) == 1 and results[0][0] == "ValueError", results
        for _kind, msg in results:
            assert "'proj.bias' has shape [3] (1-D)" in msg and "AdamW" in msg, msg
    assert world(2).run(_construct, []) == [("no error", "")] * 2


def test_a_step_whose_ranks_disagree_fails_on_every_rank_and_changes_nothing(world):
    for grad_on in ([0], []):
        results = world(2).run(_step_with_grads, grad_on)
        assert [r[0] for r in results] == ["ValueError"] * 2
        assert all("differ between rank 0 and ranks [1]" in r[1] for r in results), results


def _owner_fails_mid_step(ns_steps_on: dict) -> tuple[str, str, bool]:
    """A step whose Newton-Schulz raises on the owners only (torch refuses ``ns_steps >= 100`` inside
    its function, after the bucket's agreement): the error on every rank, nothing changed."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from fsdptk import Muon

    from _counting import raised

    mesh = _MESHES.setdefault((2,), init_device_mesh("cpu", (2,)))
    full = torch.arange(48, dtype=torch.float32).reshape(8, 6) / 48
    params = [torch.nn.Parameter(distribute_tensor(full.clone(), mesh, [Shard(0)], src_data_rank=None)),
              torch.nn.Parameter(distribute_tensor(full.T.clone(), mesh, [Shard(1)], src_data_rank=None))]
    opt = Muon([{"params": [params[0]]}, {"params": [params[1]], "ns_steps": ns_steps_on["second"]}], lr=_LR)
    for p in params:
        p.grad = distribute_tensor(torch.ones(p.shape), mesh, p.placements, src_data_rank=None)
    kind, msg = raised(opt.step)
    unchanged = (not opt.state[params[0]] and not opt.state[params[1]]
                 and torch.equal(params[0].full_tensor(), full) and torch.equal(params[1].full_tensor(), full.T))
    return kind, msg, unchanged


def test_an_owner_failing_mid_step_fails_every_rank_and_changes_nothing(world):
    results = world(2).run(_owner_fails_mid_step, {"second": 100})
    assert [r[0] for r in results] == ["ValueError"] * 2, results
    assert all("Number of steps must be less than 100" in r[1] and r[2] for r in results), results
    assert world(2).run(_owner_fails_mid_step, {"second": 5}) == [("no error", "", False)] * 2


def _plain_replicated() -> bool:
    """Plain (replicated) tensors on every rank: one owner orthogonalizes, every rank gets it."""
    from fsdptk import Muon

    gen = torch.Generator().manual_seed(3)
    fulls = [torch.randn(5, 7, generator=gen), torch.randn(3, 6, 2, generator=gen)]
    params = [torch.nn.Parameter(f.clone()) for f in fulls]
    ref = _Reference([(str(i), f) for i, f in enumerate(fulls)], {"lr": _LR})
    opt = Muon((p for p in params), lr=_LR)  # a generator, as torch optimizers take
    same = True
    for _ in range(2):
        grads = {str(i): torch.randn(f.shape, generator=gen) for i, f in enumerate(fulls)}
        for i, p in enumerate(params):
            p.grad = grads[str(i)].clone()
        opt.step()
        ref.step(grads)
        same &= all(torch.equal(p.detach(), ref.value(str(i))) for i, p in enumerate(params))
    return same


def test_plain_replicated_tensors_equal_torch_muon_on_every_rank(world):
    assert world(2).run(_plain_replicated) == [True, True]


def test_torch_muon_refusals_are_kept():
    from fsdptk import Muon

    w = torch.nn.Parameter(torch.zeros(2, 2))
    for kwargs, needle in [({"lr": -1.0}, "Learning rate"), ({"adjust_lr_fn": "nope"}, "nope"),
                           ({"momentum": -0.1}, "momentum")]:
        with pytest.raises(ValueError, match=needle):
            Muon([w], **kwargs)
    with pytest.raises(ValueError, match="complex"):
        Muon([torch.nn.Parameter(torch.zeros(2, 2, dtype=torch.complex64))])
    with pytest.raises(ValueError, match=r"\[2, 2, 2, 2\] \(4-D\)"):
        Muon([torch.nn.Parameter(torch.zeros(2, 2, 2, 2))])
    opt = Muon([w])
    w.grad = torch.zeros(2, 2).to_sparse()
    with pytest.raises(RuntimeError, match="sparse gradients"):
        opt.step()


# ---------------------------------------------------------------------------------------------
# the plan: owners spread by Newton-Schulz work, each piece to its owner and back once


def _llama_like_shapes(layers: int = 8, h: int = 512, f: int = 1408, kv: int = 128) -> list[tuple[int, ...]]:
    one = [(h, h), (kv, h), (kv, h), (h, h), (f, h), (f, h), (h, f)]
    return one * layers + [(8, f, h), (8, h, f)]


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_owners_share_the_work_and_bytes_travel_once_each_way(world_size):
    from fsdptk._engine.layouts import box_shape
    from fsdptk._plans.muon_plan import WIRE_DTYPE, bucket_view, ns_cost, plan_step

    shapes = _llama_like_shapes()

    def rows(n: int, r: int) -> slice:
        per = -(-n // world_size)
        return slice(min(r * per, n), min((r + 1) * per, n))

    boxes = [[(rows(s[0], r), *(slice(0, d) for d in s[1:])) for s in shapes] for r in range(world_size)]
    plan = plan_step(shapes, boxes, ["h"] * world_size, bucket_bytes=4 * 2**20)
    mean = sum(plan.load) / world_size
    assert max(plan.load) <= 1.25 * mean, plan.load
    assert sum(plan.load) == sum(ns_cost(m.shape) for m in plan.matrices)
    sent = sum(m.nbytes for b in plan.buckets for r in range(world_size)
               for m in (bucket_view(plan, b, r).there + bucket_view(plan, b, r).back) if not m.recv)
    received = sum(m.nbytes for b in plan.buckets for r in range(world_size)
                   for m in (bucket_view(plan, b, r).there + bucket_view(plan, b, r).back) if m.recv)
    # each piece a rank does not own goes to the owner and comes back: once each way
    one_way = sum(box_shape(p.box)[0] * box_shape(p.box)[1] * WIRE_DTYPE.itemsize for r in range(world_size)
                  for i, p in enumerate(plan.pieces[r]) if p is not None and plan.owners[i] != r)
    messages = sum(len(bucket_view(plan, b, r).there) + len(bucket_view(plan, b, r).back)
                   for b in plan.buckets for r in range(world_size))
    assert sent == received
    assert 2 * one_way <= sent <= 2 * one_way + 16 * messages  # (16-byte alignment in the flat buffers)
    matrices = sum(m.shape[0] * m.shape[1] * WIRE_DTYPE.itemsize for m in plan.matrices)
    assert sent <= 2 * matrices * (world_size - 1) / world_size + 16 * messages


def test_an_expert_held_whole_stays_with_its_holder():
    from fsdptk._plans.muon_plan import bucket_view, plan_step

    # 4 experts, 2 whole ones per rank (expert parallelism): no piece needs to travel
    boxes = [[(slice(0, 2), slice(0, 16), slice(0, 8))], [(slice(2, 4), slice(0, 16), slice(0, 8))]]
    plan = plan_step([(4, 16, 8)], boxes, ["h", "h"], bucket_bytes=2**20)
    assert plan.owners == [0, 0, 1, 1]
    assert all(not bucket_view(plan, b, r).there and not bucket_view(plan, b, r).back
               for b in plan.buckets for r in range(2))


# ---------------------------------------------------------------------------------------------
# property: random shapes and placements of plain DTensors, against torch.optim.Muon

_MESHES: dict[tuple[int, ...], object] = {}  # per worker: one mesh per shape (built once)


def _random_dtensors(case: dict) -> bool:
    """Two steps of Muon over DTensors of the drawn shapes and placements: every rank compares the
    full parameters and momentum buffers with its own single-process torch.optim.Muon."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from fsdptk import Muon

    mesh_shape = tuple(case["mesh"])
    if mesh_shape not in _MESHES:
        _MESHES[mesh_shape] = init_device_mesh("cpu", mesh_shape)
    mesh = _MESHES[mesh_shape]
    gen = torch.Generator().manual_seed(case["seed"])
    fulls = [torch.randn(shape, generator=gen) for shape, _ in case["params"]]

    def placed(full: torch.Tensor, names: list[str]) -> torch.Tensor:
        placements = [Replicate() if n == "R" else Shard(int(n[1:])) for n in names]
        return distribute_tensor(full, mesh, placements, src_data_rank=None)

    params = [torch.nn.Parameter(placed(f, names)) for f, (_, names) in zip(fulls, case["params"])]
    ref = _Reference([(str(i), f) for i, f in enumerate(fulls)], case["kwargs"])
    opt = Muon(params, **case["kwargs"])
    same = True
    for _ in range(2):
        grads = {str(i): torch.randn(f.shape, generator=gen) for i, f in enumerate(fulls)}
        for i, (p, (_, names)) in enumerate(zip(params, case["params"])):
            p.grad = placed(grads[str(i)], names)
        opt.step()
        ref.step(grads)
        for i, p in enumerate(params):
            same &= torch.equal(p.full_tensor(), ref.value(str(i)))
            same &= torch.equal(opt.state[p]["momentum_buffer"].full_tensor(), ref.buffer(str(i)))
    return bool(same)


@st.composite
def _dtensor_cases(draw) -> dict:
    mesh = draw(st.sampled_from([(4,), (2, 2)]))
    params = []
    for _ in range(draw(st.integers(1, 3))):
        ndim = draw(st.sampled_from([2, 3]))
        shape = tuple(draw(st.integers(1, 4 if (ndim == 3 and d == 0) else 9)) for d in range(ndim))
        names = [draw(st.sampled_from(["R", *(f"S{d}" for d in range(ndim))])) for _ in mesh]
        params.append((shape, names))
    kwargs = draw(st.sampled_from([{"lr": 0.02}, {"lr": 0.02, "nesterov": False},
                                   {"lr": 0.02, "adjust_lr_fn": "match_rms_adamw", "weight_decay": 0.0}]))
    return {"mesh": mesh, "params": params, "kwargs": kwargs, "seed": draw(st.integers(0, 2**16))}


@settings(max_examples=25, deadline=None)
@given(case=_dtensor_cases())
def test_random_shapes_and_placements_equal_torch_muon(world, case):
    assert world(4).run(_random_dtensors, case) == [True] * 4
