"""fsdptk.tp / fsdptk.tp_plan: prepare_mha_for_tp, TP plans and TP x FSDP end to end (4 gloo ranks).

The reference is the same tiny Llama-style model run in one process (this test process): with
TP=2 x FSDP=2, TP=2 alone and TP=4 (also GQA with replicated KV heads) the distributed model must
give the same logits and, after a few SGD steps, the same gathered parameters, to tolerance.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

import fsdptk
from fsdptk import ParallelDims, shard_model
from fsdptk.predicates import layers
from fsdptk.state_dict import gather_cpu_state_dict, load_from_full_model_state_dict
from fsdptk.tp import apply_tp, prepare_mha_for_tp
from fsdptk.tp_plan import GatherSequence, ReplicatedKVColwise, build_tp_plan, llama_tp_plan

# --------------------------------------------------------------------------- the tiny model

NAMES = {  # Meta/torchtitan names and Hugging Face names of the same Llama block
    "meta": dict(emb="tok_embeddings", attn="attention", mlp="feed_forward", n1="attention_norm",
                 n2="ffn_norm", out="output", q="wq", k="wk", v="wv", o="wo", gate="w1",
                 up="w3", down="w2"),
    "hf": dict(emb="embed_tokens", attn="self_attn", mlp="mlp", n1="input_layernorm",
               n2="post_attention_layernorm", out="lm_head", q="q_proj", k="k_proj",
               v="v_proj", o="o_proj", gate="gate_proj", up="up_proj", down="down_proj"),
}
HF_ATTRS = dict(num_heads_attr="config.num_attention_heads",
                num_kv_heads_attr="config.num_key_value_heads", embed_dim_attr="config.hidden_size")


def spec(**kw: Any) -> dict:
    base = dict(vocab=64, dim=32, heads=4, kv_heads=2, ffn=48, layers=2, names="meta",
                batch=4, seq=8, seed=0, dtype=torch.float32)
    return {**base, **kw}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rope(x: torch.Tensor) -> torch.Tensor:  # (b, s, h, d), positions 0..s-1, no buffers
    s, d = x.shape[1], x.shape[-1]
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    ang = torch.outer(torch.arange(s, dtype=torch.float32), inv)[None, :, None, :]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    cos, sin = ang.cos(), ang.sin()
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), -1).flatten(-2)


class Attention(nn.Module):
    """Reshapes with its own head attributes (HF style: a shared config's), like real ones."""

    def __init__(self, sp: dict, config: SimpleNamespace | None) -> None:
        super().__init__()
        n, dim, hd = NAMES[sp["names"]], sp["dim"], sp["dim"] // sp["heads"]
        self.n, self.head_dim, self.config = n, hd, config
        if config is None:
            self.num_heads, self.num_kv_heads, self.embed_dim = sp["heads"], sp["kv_heads"], dim
        for role, out in (("q", sp["heads"]), ("k", sp["kv_heads"]), ("v", sp["kv_heads"])):
            setattr(self, n[role], nn.Linear(dim, out * hd, bias=False))
        setattr(self, n["o"], nn.Linear(sp["heads"] * hd, dim, bias=False))

    def counts(self) -> tuple[int, int, int]:
        c = self.config
        if c is None:
            return self.num_heads, self.num_kv_heads, self.embed_dim
        return c.num_attention_heads, c.num_key_value_heads, c.hidden_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, kv, e = self.counts()
        b, s = x.shape[0], x.shape[1]
        q = getattr(self, self.n["q"])(x).view(b, s, h, self.head_dim)
        k = getattr(self, self.n["k"])(x).view(b, s, kv, self.head_dim)
        v = getattr(self, self.n["v"])(x).view(b, s, kv, self.head_dim)
        q, k = _rope(q), _rope(k)
        k, v = (t.repeat_interleave(h // kv, dim=2) for t in (k, v))
        o = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True)
        return getattr(self, self.n["o"])(o.transpose(1, 2).reshape(b, s, e))


class MLP(nn.Module):
    def __init__(self, sp: dict) -> None:
        super().__init__()
        self.n = n = NAMES[sp["names"]]
        setattr(self, n["gate"], nn.Linear(sp["dim"], sp["ffn"], bias=False))
        setattr(self, n["up"], nn.Linear(sp["dim"], sp["ffn"], bias=False))
        setattr(self, n["down"], nn.Linear(sp["ffn"], sp["dim"], bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, u, d = (getattr(self, self.n[r]) for r in ("gate", "up", "down"))
        return d(F.silu(g(x)) * u(x))


class Block(nn.Module):
    def __init__(self, sp: dict, config: SimpleNamespace | None) -> None:
        super().__init__()
        self.n = n = NAMES[sp["names"]]
        setattr(self, n["n1"], RMSNorm(sp["dim"]))
        setattr(self, n["attn"], Attention(sp, config))
        setattr(self, n["n2"], RMSNorm(sp["dim"]))
        setattr(self, n["mlp"], MLP(sp))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = self.n
        x = x + getattr(self, n["attn"])(getattr(self, n["n1"])(x))
        return x + getattr(self, n["mlp"])(getattr(self, n["n2"])(x))


class TinyLlama(nn.Module):
    def __init__(self, sp: dict) -> None:
        super().__init__()
        self.n = n = NAMES[sp["names"]]
        cfg = None
        if sp["names"] == "hf":  # one config object shared by every attention module
            cfg = SimpleNamespace(num_attention_heads=sp["heads"],
                                  num_key_value_heads=sp["kv_heads"], hidden_size=sp["dim"])
        setattr(self, n["emb"], nn.Embedding(sp["vocab"], sp["dim"]))
        self.layers = nn.ModuleList(Block(sp, cfg) for _ in range(sp["layers"]))
        self.norm = RMSNorm(sp["dim"])
        setattr(self, n["out"], nn.Linear(sp["dim"], sp["vocab"], bias=False))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = getattr(self, self.n["emb"])(tokens)
        for layer in self.layers:
            h = layer(h)
        return getattr(self, self.n["out"])(self.norm(h))


def build(sp: dict, device: str = "cpu") -> TinyLlama:
    torch.manual_seed(sp["seed"])
    with torch.device(device):
        model = TinyLlama(sp).to(sp["dtype"])
    if device != "meta":
        with torch.no_grad():  # non-trivial norm weights, so their gradients matter
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.add_(torch.randn_like(p) * 0.1)
    return model


def data(sp: dict, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * sp["seed"] + step)
    tok = torch.randint(0, sp["vocab"], (sp["batch"], sp["seq"] + 1), generator=g)
    return tok[:, :-1], tok[:, 1:]


def _loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1))


def reference(sp: dict, steps: int, lr: float = 0.5) -> tuple[torch.Tensor, dict]:
    model = build(sp)
    logits = model(data(sp, 0)[0]).detach()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(steps):
        x, y = data(sp, step)
        _loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return logits, {k: v.detach().clone() for k, v in model.state_dict().items()}


# --------------------------------------------------------------------------- distributed pieces


def _load(model: nn.Module, full_sd: dict) -> None:
    """fsdptk's loader (its scatter of each rank's (dp, tp) pieces is what is under test)."""
    load_from_full_model_state_dict(model, full_sd, torch.device("cpu"), strict=True)


def _gather(model: nn.Module) -> dict:
    """fsdptk's gather: the full CPU state dict on rank 0, ``{}`` elsewhere."""
    return gather_cpu_state_dict(model, dist.get_rank() == 0)


def _mesh(dp: int, tp: int):
    dims = ParallelDims(dp_shard=dp, tp=tp)
    dims.build_mesh("cpu")
    return dims.fsdp_mesh, dims.tp_mesh  # 1-D dp_shard mesh (FSDP), 1-D tp mesh


def _parallel_model(sp: dict, *, dp: int, tp: int, fsdp: bool, sequence_parallel: bool,
                    replicate_kv: bool = False) -> nn.Module:
    """The composition, in the order that works (see docs/tensor_parallel.md):
    meta init (no rank builds the full model) -> prepare_mha_for_tp (plain attributes) ->
    TP plan (TP first: FSDP2 then shards TP's DTensors over the dp dim; the reverse is not
    supported) -> FSDP over dp -> load (after sharding: each rank receives only its shards)."""
    mesh, tp_mesh = _mesh(dp, tp)
    model = build(sp, "meta")
    extra = HF_ATTRS if sp["names"] == "hf" else {}
    pred = (lambda n, m: isinstance(m, Attention)) if extra else None
    prepare_mha_for_tp(model, tp_mesh, attn_predicate=pred, replicate_kv_heads=replicate_kv,
                       **extra)
    plan = llama_tp_plan(model, sequence_parallel=sequence_parallel,
                         num_kv_heads=sp["kv_heads"] if replicate_kv else None)
    apply_tp(model, tp_mesh, plan)
    if fsdp:
        shard_model(model, [layers()], cpu_offload=False, dp_mesh=mesh)
    _load(model, build(sp).state_dict())
    return model


def _train_and_compare(sp: dict, dp: int, tp: int, fsdp: bool, sequence_parallel: bool,
                       steps: int, replicate_kv: bool = False, lr: float = 0.5) -> dict:
    model = _parallel_model(sp, dp=dp, tp=tp, fsdp=fsdp, sequence_parallel=sequence_parallel,
                            replicate_kv=replicate_kv)
    rank = dist.get_rank()
    # with FSDP each dp rank takes its slice of the batch; without, every rank the whole batch
    dp_rank, per = (rank // tp, sp["batch"] // dp) if fsdp else (0, sp["batch"])
    sl = slice(dp_rank * per, (dp_rank + 1) * per)
    # optimizer first: with a root that keeps its parameters gathered after forward
    # (root_reshard_after_forward=False) an optimizer built later would hold temporary tensors
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    with torch.no_grad():
        logits = model(data(sp, 0)[0][sl]).clone()
    for step in range(steps):
        x, y = data(sp, step)
        _loss(model(x[sl]), y[sl]).backward()
        opt.step()
        opt.zero_grad()
    return dict(logits=logits, rows=(sl.start, sl.stop), params=_gather(model))


CASES = {
    "tp2xfsdp2": dict(sp=spec(), dp=2, tp=2, fsdp=True, sequence_parallel=False),
    "tp2xfsdp2-sp-hf": dict(sp=spec(names="hf"), dp=2, tp=2, fsdp=True, sequence_parallel=True),
    "tp2-alone-hf": dict(sp=spec(names="hf"), dp=2, tp=2, fsdp=False, sequence_parallel=False),
    "tp4-mha-sp": dict(sp=spec(kv_heads=4), dp=1, tp=4, fsdp=False, sequence_parallel=True),
    "tp4-gqa-replicated-kv": dict(sp=spec(heads=8, kv_heads=2), dp=1, tp=4, fsdp=False,
                                  sequence_parallel=False, replicate_kv=True),
    "tp2xfsdp2-gqa-1kv-sp": dict(sp=spec(kv_heads=1), dp=2, tp=2, fsdp=True,
                                 sequence_parallel=True, replicate_kv=True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_tp_matches_single_process(world, case: str) -> None:
    c = CASES[case]
    steps = 3
    ref_logits, ref_params = reference(c["sp"], steps)
    res = world(4).run(_train_and_compare, steps=steps, **c)
    for r in res:
        lo, hi = r["rows"]
        torch.testing.assert_close(r["logits"], ref_logits[lo:hi], atol=2e-5, rtol=1e-4)
    got = res[0]["params"]
    assert set(got) == set(ref_params)
    init = build(c["sp"]).state_dict()
    assert not torch.equal(ref_params["norm.weight"], init["norm.weight"])  # it trained
    for k, v in ref_params.items():
        torch.testing.assert_close(got[k], v, atol=2e-5, rtol=1e-4, msg=lambda m, k=k: f"{k}: {m}")
    assert all(r["params"] == {} for r in res[1:])


# --------------------------------------------------------------------------- load / gather on 2-D


def _roundtrip(sp: dict, sd_seed: int, sequence_parallel: bool) -> dict | None:
    """Load a random full state dict into TP=2 x FSDP=2 and gather it back (rank 0's dict)."""
    g = torch.Generator().manual_seed(sd_seed)
    full = {k: torch.randn(v.shape, generator=g).to(v.dtype)
            for k, v in build(sp).state_dict().items()}
    mesh, tp_mesh = _mesh(2, 2)
    model = build(sp, "meta")
    apply_tp(model, tp_mesh, llama_tp_plan(model, sequence_parallel=sequence_parallel))
    shard_model(model, [layers()], cpu_offload=False, dp_mesh=mesh)
    _load(model, dict(full))  # a copy: release_sd may drop the entries it loaded
    # every parameter is a DTensor holding exactly its piece of the full tensor (DTensor's own
    # placement math is the oracle), so load and gather cannot hide each other's mistakes
    meshes = {tuple(p.device_mesh.mesh_dim_names) for p in model.parameters()}
    wrong = []
    for name, p in model.named_parameters():
        want = distribute_tensor(full[name], p.device_mesh, p.placements, src_data_rank=None)
        if not torch.equal(p.to_local(), want.to_local()):
            wrong.append(name)
    assert not wrong, f"rank {dist.get_rank()}: wrong local shards for {wrong}"
    back = _gather(model)
    if dist.get_rank() != 0:
        return None
    return dict(full=full, back=back, meshes=meshes)


@settings(max_examples=10)
@given(seed=st.integers(0, 2**16), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       names=st.sampled_from(["meta", "hf"]), sequence_parallel=st.booleans())
def test_load_gather_roundtrip_2d_bit_exact(world, seed: int, dtype: torch.dtype, names: str,
                                            sequence_parallel: bool) -> None:
    sp = spec(names=names, dtype=dtype, vocab=60, ffn=40)  # odd sizes: uneven dp shards
    res = world(4).run(_roundtrip, sp, seed, sequence_parallel)[0]
    # TP'd parameters live on the 2-D (dp_shard, tp) mesh; without sequence parallel the norms
    # are not TP'd and only FSDP-sharded
    assert res["meshes"] == ({("dp_shard", "tp")} if sequence_parallel else
                             {("dp_shard", "tp"), ("dp_shard",)})
    assert list(res["back"]) == list(res["full"])
    for k, v in res["full"].items():
        assert res["back"][k].dtype == v.dtype and torch.equal(res["back"][k], v), k


# --------------------------------------------------------------------------- bad input, no mutation


def _snapshot(model: nn.Module) -> list:
    out = []
    for fqn, m in model.named_modules():
        attrs = tuple(getattr(m, a, None) for a in ("num_heads", "num_kv_heads", "embed_dim"))
        cfg = getattr(m, "config", None)
        if cfg is not None:
            attrs += tuple(vars(cfg).values())
        params = tuple(type(p).__name__ for p in m.parameters(recurse=False))
        out.append((fqn, attrs, params))
    return out


def _bad_inputs() -> dict:
    _, tp_mesh = _mesh(1, 4)
    mesh2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    cases = {}

    def attempt(name: str, model: nn.Module, fn: Any) -> None:
        before = _snapshot(model)
        try:
            fn(model)
            cases[name] = ("no error", "", _snapshot(model) == before)
        except (ValueError, TypeError) as e:
            cases[name] = (type(e).__name__, str(e), _snapshot(model) == before)

    def last_layer_bad(**kw: Any) -> TinyLlama:  # layer 0 is fine, so "validate all first" shows
        model = build(spec(heads=8, kv_heads=4), "meta")
        attn = model.layers[1].attention
        for k, v in kw.items():
            if v is None:
                delattr(attn, k)
            else:
                setattr(attn, k, v)
        return model

    attempt("kv_not_divisible", last_layer_bad(num_kv_heads=6, num_heads=12),
            lambda m: prepare_mha_for_tp(m, tp_mesh))
    attempt("heads_not_divisible", last_layer_bad(num_heads=6, num_kv_heads=6),
            lambda m: prepare_mha_for_tp(m, tp_mesh))
    attempt("kv_below_tp", build(spec(heads=8, kv_heads=2), "meta"),
            lambda m: prepare_mha_for_tp(m, tp_mesh))
    attempt("kv_not_a_divisor_of_tp", last_layer_bad(num_kv_heads=3, num_heads=12),
            lambda m: prepare_mha_for_tp(m, tp_mesh, replicate_kv_heads=True))
    attempt("missing_kv_attr", last_layer_bad(num_kv_heads=None),
            lambda m: prepare_mha_for_tp(m, tp_mesh))
    attempt("missing_embed_dim", last_layer_bad(embed_dim=None),
            lambda m: prepare_mha_for_tp(m, tp_mesh))
    attempt("mesh_2d_prepare", build(spec(), "meta"), lambda m: prepare_mha_for_tp(m, mesh2d))
    attempt("mesh_2d_apply", build(spec(), "meta"),
            lambda m: apply_tp(m, mesh2d, llama_tp_plan(m)))
    attempt("no_attention", build(spec(names="hf"), "meta"),
            lambda m: prepare_mha_for_tp(m, tp_mesh))
    attempt("plan_key_missing", build(spec(), "meta"),
            lambda m: apply_tp(m, tp_mesh, {"layers.0.attention.wq": ColwiseParallel(),
                                            "layers.9.attention.wq": ColwiseParallel()}))
    attempt("plan_value_not_style", build(spec(), "meta"),
            lambda m: apply_tp(m, tp_mesh, {"layers.0.attention.wq": "colwise"}))
    # problems parallelize_module would only meet half-way: the first entries are fine
    attempt("colwise_on_a_norm", build(spec(), "meta"),
            lambda m: apply_tp(m, tp_mesh, {"layers.0.attention.wq": ColwiseParallel(),
                                            "layers.1.attention_norm": ColwiseParallel()}))
    attempt("replicated_kv_cannot_split", build(spec(), "meta"),
            lambda m: apply_tp(m, tp_mesh, {"layers.0.attention.wq": ColwiseParallel(),
                                            "layers.0.attention.wk": ReplicatedKVColwise(3)}))
    prepared = build(spec(heads=8, kv_heads=4), "meta")
    prepare_mha_for_tp(prepared, tp_mesh)  # 8 -> 2 heads: a second call must not make it 0
    attempt("prepared_twice", prepared, lambda m: prepare_mha_for_tp(m, tp_mesh))
    twice = build(spec(), "meta")
    apply_tp(twice, tp_mesh, {"layers.1.attention.wq": ColwiseParallel()})
    attempt("already_parallel", twice,
            lambda m: apply_tp(m, tp_mesh, {"layers.0.attention.wq": ColwiseParallel(),
                                            "layers.1.attention.wq": ColwiseParallel()}))
    return cases


def test_bad_input_errors_on_every_rank_and_model_untouched(world) -> None:
    res = world(4).run(_bad_inputs)
    expect = {
        "kv_not_divisible": ("'layers.1.attention'", "Number of KV heads (6) must be divisible by "
                             "tensor parallel size (4)."),
        "heads_not_divisible": ("'layers.1.attention'", "Number of attention heads (6) must be "
                                "divisible by tensor parallel size (4)."),
        "kv_below_tp": ("Number of KV heads (2) must be divisible by tensor parallel size (4).",
                        "replicate_kv_heads=True"),
        "kv_not_a_divisor_of_tp": ("'layers.1.attention'", "tensor parallel size (4) must be a "
                                   "multiple of the number of KV heads (3)"),
        "missing_kv_attr": ("'layers.1.attention'", "no attribute 'num_kv_heads'"),
        "missing_embed_dim": ("'layers.1.attention'", "no attribute 'embed_dim'"),
        "mesh_2d_prepare": ("1-D", "(2, 2)", "mesh['tp']"),
        "mesh_2d_apply": ("1-D", "(2, 2)"),
        "no_attention": ("found no attention module",),
        "plan_key_missing": ("'layers.9.attention.wq'",),
        "plan_value_not_style": ("plan['layers.0.attention.wq']", "str"),
        "colwise_on_a_norm": ("plan['layers.1.attention_norm'] is ColwiseParallel", "RMSNorm"),
        "replicated_kv_cannot_split": ("cannot split 3 KV heads over tensor parallel size 4",
                                       "'layers.0.attention.wk'"),
        "already_parallel": ("'layers.1.attention.wq'", "already DTensors"),
        "prepared_twice": ("'layers.0.attention'", "already prepared by prepare_mha_for_tp for "
                           "tensor parallel size 4", "num_heads 8 -> 2", "call it once per model"),
    }
    for rank, cases in enumerate(res):
        assert set(cases) == set(expect)
        for name, parts in expect.items():
            kind, msg, untouched = cases[name]
            assert kind in ("ValueError", "TypeError"), (rank, name, kind)
            assert untouched, (rank, name, "model was modified")
            for part in parts:
                assert part in msg, (rank, name, msg)


# --------------------------------------------------------------------------- finding attention


class Encoder(nn.Module):  # an encoder that is NOT tensor parallel: its attention must stay as is
    def __init__(self) -> None:
        super().__init__()
        self.attn = Attention(spec(heads=4, kv_heads=4), None)


class Fusion(nn.Module):  # fusion-style wrapper: fsdptk does not know this class
    def __init__(self, sp: dict) -> None:
        super().__init__()
        self.encoder = Encoder()
        self.decoder = build(sp, "meta")
        self.decoder.num_heads = sp["heads"]  # decoders record num_heads too (torchtune does)


def _prepare_variants() -> dict:
    _, tp_mesh = _mesh(2, 2)
    out = {}
    fusion = Fusion(spec(heads=8, kv_heads=4))
    with torch.device("meta"):
        fusion.encoder = Encoder()
    prepare_mha_for_tp(fusion, tp_mesh)
    a = fusion.decoder.layers[1].attention
    out["fusion"] = dict(decoder=(a.num_heads, a.num_kv_heads, a.embed_dim),
                         decoder_root=fusion.decoder.num_heads,
                         encoder=(fusion.encoder.attn.num_heads, fusion.encoder.attn.num_kv_heads))
    hf = build(spec(names="hf", heads=8, kv_heads=4), "meta")
    prepare_mha_for_tp(hf, tp_mesh, attn_predicate=lambda n, m: isinstance(m, Attention),
                       **HF_ATTRS)
    cfg = hf.layers[0].self_attn.config
    out["hf_config"] = (cfg is hf.layers[1].self_attn.config, cfg.num_attention_heads,
                        cfg.num_key_value_heads, cfg.hidden_size)
    mha = build(spec(heads=8, kv_heads=8), "meta")
    prepare_mha_for_tp(mha, tp_mesh, num_kv_heads_attr=None, embed_dim_attr=None)
    a = mha.layers[0].attention
    out["mha_only"] = (a.num_heads, a.num_kv_heads, a.embed_dim)
    rep = build(spec(heads=8, kv_heads=1), "meta")
    prepare_mha_for_tp(rep, tp_mesh, replicate_kv_heads=True)
    a = rep.layers[0].attention
    out["replicated"] = (a.num_heads, a.num_kv_heads, a.embed_dim)
    return out


def test_prepare_mha_for_tp_finds_attention_by_attribute_config_and_decoder(world) -> None:
    res = world(4).run(_prepare_variants)
    assert all(r == res[0] for r in res)
    r = res[0]
    assert r["fusion"] == dict(decoder=(4, 2, 16), decoder_root=8, encoder=(4, 4))
    assert r["hf_config"] == (True, 4, 2, 16)  # shared config divided once, not once per layer
    assert r["mha_only"] == (4, 8, 32)
    assert r["replicated"] == (4, 1, 16)


# --------------------------------------------------------------------------- plans (no mesh needed)


def test_llama_tp_plan_both_naming_schemes() -> None:
    for names, n in NAMES.items():
        model = build(spec(names=names), "meta")
        plan = llama_tp_plan(model)
        col = {f"layers.{i}.{n[b]}.{n[r]}" for i in range(2) for b, r in
               (("attn", "q"), ("attn", "k"), ("attn", "v"), ("mlp", "gate"), ("mlp", "up"))}
        row = {f"layers.{i}.{n[b]}.{n[r]}" for i in range(2)
               for b, r in (("attn", "o"), ("mlp", "down"))}
        assert set(plan) == col | row | {n["emb"], n["out"]}
        assert all(type(plan[f]) is ColwiseParallel for f in col | {n["out"]})
        assert all(type(plan[f]) is RowwiseParallel for f in row | {n["emb"]})
        sp_plan = llama_tp_plan(model, sequence_parallel=True)
        blocks = {f"layers.{i}.{n[b]}" for i in range(2) for b in ("attn", "mlp")}
        norms = {f"layers.{i}.{n[k]}" for i in range(2) for k in ("n1", "n2")} | {"norm"}
        assert set(sp_plan) == set(plan) | blocks | norms
        assert all(isinstance(sp_plan[f], GatherSequence) for f in blocks)
        assert all(isinstance(sp_plan[f], SequenceParallel) for f in norms)
        assert set(llama_tp_plan(model, embeddings_and_output=False)) == col | row
        kv = llama_tp_plan(model, num_kv_heads=2)
        assert isinstance(kv[f"layers.0.{n['attn']}.{n['k']}"], ReplicatedKVColwise)


def test_llama_tp_plan_errors() -> None:
    model = build(spec(), "meta")
    del model.layers[0].feed_forward.w3, model.layers[1].feed_forward.w3
    with pytest.raises(ValueError, match="Linear named w3/up_proj"):
        llama_tp_plan(model)
    model = build(spec(), "meta")
    model.output.weight = model.tok_embeddings.weight
    tied = r"'tok_embeddings.weight' and 'output.weight' are the same tensor \(tied"
    with pytest.raises(ValueError, match=tied):
        llama_tp_plan(model)
    assert "output" not in llama_tp_plan(model, embeddings_and_output=False)
    with pytest.raises(ValueError, match="sequence_parallel=True needs embeddings_and_output"):
        llama_tp_plan(model, sequence_parallel=True, embeddings_and_output=False)
    for bad in (0, 2.0, True):
        with pytest.raises(ValueError, match=f"positive int, got {bad!r}"):
            ReplicatedKVColwise(bad)  # type: ignore[arg-type]


def test_build_tp_plan_rules() -> None:
    model = build(spec(), "meta")
    col, row = ColwiseParallel(), RowwiseParallel()
    plan = build_tp_plan(model, [("layers.0.*.wq", row), ("*.wq", col),
                           (lambda n, m: isinstance(m, nn.Linear) and n.endswith("w2"), row)])
    assert plan == {"layers.0.attention.wq": row, "layers.0.feed_forward.w2": row,
                    "layers.1.attention.wq": col, "layers.1.feed_forward.w2": row}  # first wins
    assert build_tp_plan(model, {"output": col}) == {"output": col}
    with pytest.raises(ValueError, match=r"'\*\.nope' -> ColwiseParallel"):
        build_tp_plan(model, [("*.wq", col), ("*.nope", col)])
    with pytest.raises(ValueError, match=r"'layers.1.attention.wq' -> RowwiseParallel"):
        build_tp_plan(model, [("*.wq", col), ("layers.1.attention.wq", row)])  # shadowed
    assert build_tp_plan(model, [("*.nope", col), ("*.wo", row)], allow_unmatched=True).keys() == {
        "layers.0.attention.wo", "layers.1.attention.wo"}
    with pytest.raises(TypeError, match="style must be a ParallelStyle"):
        build_tp_plan(model, [("*.wq", "colwise")])
    with pytest.raises(TypeError, match="str glob or a callable"):
        build_tp_plan(model, [(3, col)])


def test_public_exports() -> None:
    for name in ("prepare_mha_for_tp", "apply_tp", "build_tp_plan", "llama_tp_plan"):
        assert getattr(fsdptk, name) is globals()[name]


# --------------------------------------------------------------------------- the shared mesh concatenation


def _shared_concatenation() -> dict:
    from torch.distributed.device_mesh import DeviceMesh

    from fsdptk._core.compat import shared_mesh_concatenation

    before = DeviceMesh.__dict__["_concatenate"]
    mesh, tp_mesh = _mesh(2, 2)
    out: dict = {}
    with shared_mesh_concatenation():
        a = DeviceMesh._concatenate([mesh, tp_mesh])
        with shared_mesh_concatenation():  # nested: the same patch, the same cache
            b = DeviceMesh._concatenate([mesh, tp_mesh])
        c = DeviceMesh._concatenate([mesh, tp_mesh])
        out["inner_restored_early"] = DeviceMesh.__dict__["_concatenate"] is before
    plain = DeviceMesh._concatenate([mesh, tp_mesh])
    out["one_object"] = a is b is c
    out["equal_to_plain"] = a == plain and a.mesh_dim_names == plain.mesh_dim_names
    out["plain_is_new"] = plain is not a
    out["restored"] = DeviceMesh.__dict__["_concatenate"] is before
    try:
        with shared_mesh_concatenation():
            raise KeyError("inside")
    except KeyError:
        out["restored_after_error"] = DeviceMesh.__dict__["_concatenate"] is before
    # shard_model over TP: every TP parameter's sharded spec on one (dp, tp) mesh object
    model = _parallel_model(spec(), dp=2, tp=2, fsdp=True, sequence_parallel=False)
    two_d = {id(p.device_mesh) for p in model.parameters() if p.device_mesh.ndim == 2}
    out["two_d_meshes"] = len(two_d)
    out["restored_after_shard_model"] = DeviceMesh.__dict__["_concatenate"] is before
    with torch.no_grad():  # and the model still runs and matches the single-process model
        x, _ = data(spec(), 0)
        out["max_diff"] = float((_full(model(x)) - build(spec())(x)).abs().max())
    return out


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def test_shard_model_shares_one_concatenated_mesh_and_restores_torch() -> None:
    """fully_shard concatenates (dp, tp) once per TP parameter; inside shard_model the equal
    concatenations are one DeviceMesh (compat.shared_mesh_concatenation), equal to the one torch
    builds, and torch's own function is back after the block (nested, after an error).

    On workers of its own (a fork each: fractions of a second): in the suite's shared world, after
    some other module's tests (seen once under pytest-xdist's order, not reproduced by repeating
    this test), the parameters came out on two equal (dp, tp) mesh objects instead of one."""
    from fsdptk.testing import World

    with World(4) as fresh:
        outs = fresh.run(_shared_concatenation)
    for out in outs:
        assert out["one_object"] and out["equal_to_plain"] and out["plain_is_new"], out
        assert not out["inner_restored_early"], out
        assert out["restored"] and out["restored_after_error"] and out["restored_after_shard_model"], out
        assert out["two_d_meshes"] == 1, out
        assert out["max_diff"] < 1e-5, out


def _concatenation_block(entered: Any, leave: Any, fail: bool) -> None:
    """One thread's ``shared_mesh_concatenation`` block: open until ``leave`` is set."""
    from fsdptk._core.compat import shared_mesh_concatenation

    with shared_mesh_concatenation():
        entered.set()
        assert leave.wait(30), "the test never let this block exit"
        if fail:
            raise KeyError("inside")


@pytest.mark.parametrize("order", ["first-out-first", "last-out-first"])
@pytest.mark.parametrize("fail", [False, True], ids=["ok", "error"])
def test_blocks_in_two_threads_exiting_in_any_order_restore_torch(order: str, fail: bool) -> None:
    """A enters, B enters, then A or B exits first (with an exception, or not): the patch stays
    installed while either block is open, and torch's own function is back once both are out."""
    import threading

    from torch.distributed.device_mesh import DeviceMesh

    torch_own = DeviceMesh.__dict__["_concatenate"]
    events = {name: (threading.Event(), threading.Event()) for name in "AB"}
    errors: list[BaseException] = []

    def run(name: str) -> None:
        try:
            _concatenation_block(*events[name], fail)
        except BaseException as e:  # noqa: BLE001 - reported by the test thread
            errors.append(e)

    threads = {name: threading.Thread(target=run, args=(name,)) for name in "AB"}
    for name in "AB":  # A enters, then B
        threads[name].start()
        assert events[name][0].wait(30), name
    assert DeviceMesh.__dict__["_concatenate"] is not torch_own
    first, second = ("A", "B") if order == "first-out-first" else ("B", "A")
    events[first][1].set()
    threads[first].join(30)
    assert DeviceMesh.__dict__["_concatenate"] is not torch_own  # the other block is still open
    events[second][1].set()
    threads[second].join(30)
    try:
        assert DeviceMesh.__dict__["_concatenate"] is torch_own
        assert [type(e) for e in errors] == ([KeyError, KeyError] if fail else [])
    finally:
        DeviceMesh._concatenate = torch_own  # never leave the patch to the other tests
