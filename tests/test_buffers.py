"""Non-persistent buffers after a meta build (issue 12): recomputed, kept real, or sent from rank 0.

Real Hugging Face models (transformers 5.x, tiny configs, random init, no download), a torchtune
style ``rope_init`` module, and an FSDP2-article style model whose parameter-less rotary module
re-initialises itself in ``reset_parameters()``. Every buffer must equal the CPU-built model's,
bit for bit, on every rank.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fsdptk import (
    load_from_full_model_state_dict,
    load_safetensors,
    materialize,
    params_on_meta,
    register_buffer_init,
    save_safetensors,
)
from fsdptk.testing import RemoteError

from _counting import OBJECT_COLLECTIVES, counted

try:  # in the test extra; only the Hugging Face tests need it
    import transformers
except ImportError:  # pragma: no cover
    transformers = None
needs_hf = pytest.mark.skipif(transformers is None, reason="transformers is not installed")

FAMILIES = ["llama", "llama_tied", "qwen2", "gemma3", "mistral", "phi3"]
_SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=256)


def _config(family: str):
    t = transformers
    if family.startswith("llama"):
        return t.LlamaConfig(**_SMALL, tie_word_embeddings=family == "llama_tied")
    if family == "qwen2":
        return t.Qwen2Config(**_SMALL)
    if family == "mistral":
        return t.MistralConfig(**_SMALL)
    if family == "phi3":
        return t.Phi3Config(**_SMALL, pad_token_id=0)
    # both layer types, so both rotary tables (sliding and full) exist
    return t.Gemma3TextConfig(**_SMALL, head_dim=16, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                              layer_types=["sliding_attention", "full_attention"])


def _hf(family: str, device: str = "cpu", seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    with torch.device(device):
        return transformers.AutoModelForCausalLM.from_config(_config(family))


def _nonpersistent(model: nn.Module) -> dict[str, torch.Tensor]:
    sd = model.state_dict()
    return {k: b for k, b in model.named_buffers() if k not in sd}


def _same_buffers(model: nn.Module, ref: nn.Module) -> bool:
    got, want = dict(model.named_buffers()), dict(ref.named_buffers())
    return sorted(got) == sorted(want) and all(
        got[k].dtype == v.dtype and got[k].device == v.device and torch.equal(got[k], v)
        for k, v in want.items())


# ---------------------------------------------------------------------------------------------
# an FSDP2-article style model, and a torchtune-style RoPE (hook name rope_init)


class ArticleRotary(nn.Module):
    """No parameters; cos/sin tables are non-persistent buffers, recomputed by reset_parameters."""

    def __init__(self, head_dim: int, max_seq: int, theta: float = 10000.0) -> None:
        super().__init__()
        self.head_dim, self.max_seq, self.theta = head_dim, max_seq, theta
        self.register_buffer("cos", torch.empty(max_seq, head_dim // 2), persistent=False)
        self.register_buffer("sin", torch.empty(max_seq, head_dim // 2), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        dev = self.cos.device
        inv = 1.0 / self.theta ** (torch.arange(0, self.head_dim, 2, device=dev).float() / self.head_dim)
        ang = torch.outer(torch.arange(self.max_seq, device=dev).float(), inv)
        self.cos.copy_(ang.cos())
        self.sin.copy_(ang.sin())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[-1] // 2
        c, s = self.cos[: x.shape[1]], self.sin[: x.shape[1]]
        return torch.cat([x[..., :n] * c - x[..., n:] * s, x[..., :n] * s + x[..., n:] * c], -1)


class ArticleModel(nn.Module):
    def __init__(self, vocab: int = 32, dim: int = 16, seq: int = 8) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.rotary = ArticleRotary(dim, seq)
        self.layers = nn.ModuleList([nn.Linear(dim, dim) for _ in range(2)])
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tok: torch.Tensor) -> torch.Tensor:
        h = self.rotary(self.tok_embeddings(tok))
        for layer in self.layers:
            h = h + torch.tanh(layer(h))
        return self.output(self.norm(h))


class TuneRope(nn.Module):
    """torchtune 0.6.1's Llama3ScaledRoPE shape: rope_init returns early on meta, sets a flag."""

    def __init__(self, dim: int = 8, max_seq_len: int = 6) -> None:
        super().__init__()
        self.dim, self.max_seq_len = dim, max_seq_len
        self.is_cache_built = False
        self.rope_init()

    def rope_init(self) -> None:
        theta = 1.0 / (500000 ** (torch.arange(0, self.dim, 2)[: self.dim // 2].float() / self.dim))
        if theta.is_meta:
            return
        self.register_buffer("theta", theta, persistent=False)
        idx = torch.einsum("i, j -> ij", torch.arange(self.max_seq_len, dtype=theta.dtype), theta)
        self.register_buffer("cache", torch.stack([idx.cos(), idx.sin()], -1), persistent=False)
        self.is_cache_built = True


class MaskOnly(nn.Module):
    """A non-persistent buffer and no rule at all (no hook, no reset_parameters, not HF)."""

    def __init__(self, n: int = 4) -> None:
        super().__init__()
        self.proj = nn.Linear(n, n)
        self.register_buffer("mask", torch.randn(n, n), persistent=False)


# ---------------------------------------------------------------------------------------------
# single process


@needs_hf
@pytest.mark.parametrize("family", FAMILIES)
def test_hf_meta_build_materialize_and_load_match_cpu_build(family):
    from fsdptk._plans.buffers import meta_nonpersistent as _meta_nonpersistent
    from fsdptk._plans.buffers import recompute as _recompute

    ref = _hf(family)
    meta = _hf(family, "meta")
    todo = _meta_nonpersistent(meta)
    assert todo  # the rotary tables (and Gemma's embed_scale) are left on meta by transformers
    values, failed = _recompute(meta, todo, None)
    assert not failed and all("_init_weights" in v.rule for v in values.values())  # HF's own path
    assert _same_buffers(materialize(meta, "cpu"), ref)
    assert all(not p.abs().sum() for p in meta.parameters())  # zeros, never uninitialised memory
    loaded = _hf(family, "meta")
    res = load_from_full_model_state_dict(loaded, ref.state_dict(), "cpu", strict=True,
                                          release_sd=False)
    assert not res.missing_keys and not res.unexpected_keys
    assert _same_buffers(loaded, ref)
    tok = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(1))
    assert torch.equal(loaded(tok).logits, ref(tok).logits)
    with params_on_meta():  # the construction context: parameters on meta, buffers real
        kept = transformers.AutoModelForCausalLM.from_config(_config(family))
    assert all(p.is_meta for p in kept.parameters()) and _same_buffers(kept, ref)


@needs_hf
def test_hf_init_path_never_redraws_parameters():
    ref = _hf("gemma3")
    model = _hf("gemma3")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for fqn in _nonpersistent(model):  # only the buffers are lost, the parameters are real
        mod_name, _, name = fqn.rpartition(".")
        mod = model.get_submodule(mod_name)
        mod._buffers[name] = torch.empty_like(mod._buffers[name], device="meta")
    materialize(model, "cpu")
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())  # embed weight kept
    assert _same_buffers(model, ref)


def test_article_model_reset_parameters_rule():
    torch.manual_seed(0)
    ref = ArticleModel()
    with torch.device("meta"):
        model = ArticleModel()
    load_from_full_model_state_dict(model, ref.state_dict(), "cpu", strict=True, release_sd=False)
    assert _same_buffers(model, ref)
    tok = torch.randint(0, 32, (2, 8))
    assert torch.equal(model(tok), ref(tok))
    with torch.device("meta"):
        model = ArticleModel()
    assert _same_buffers(materialize(model, "cpu").rotary, ref.rotary)


def test_torchtune_rope_init_rule_copies_flags_back():
    ref = nn.Sequential(nn.Linear(8, 8), TuneRope())
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 8), TuneRope())
    assert not model[1].is_cache_built
    load_from_full_model_state_dict(model, ref.state_dict(), "cpu", strict=True, release_sd=False)
    assert model[1].is_cache_built and _same_buffers(model, ref)


def test_registry_init_buffers_and_precedence(tmp_path):
    def mine(m: nn.Module) -> None:
        m.cos = torch.full_like(m.cos, 2.0)
        m.sin = torch.zeros_like(m.sin)

    handle = register_buffer_init(ArticleRotary, mine)
    try:
        with torch.device("meta"):
            model = ArticleRotary(4, 3)
        assert torch.equal(materialize(model, "cpu").cos, torch.full((3, 2), 2.0))  # beats reset_parameters
        with torch.device("meta"):
            model = ArticleRotary(4, 3)
        materialize(model, "cpu", init_buffers=lambda m: (m.cos.fill_(5), m.sin.fill_(6)))
        assert model.cos.eq(5).all() and model.sin.eq(6).all()  # init_buffers beats everything
    finally:
        handle.remove()
    with torch.device("meta"):
        model = ArticleRotary(4, 3)
    assert torch.equal(materialize(model, "cpu").cos, ArticleRotary(4, 3).cos)  # back to the default
    # a predicate, and load_safetensors' init_buffers=
    handle = register_buffer_init(lambda m: hasattr(m, "mask"), lambda m: m.mask.fill_(7.0))
    try:
        src = MaskOnly()
        save_safetensors(src, tmp_path)
        with torch.device("meta"):
            dst = MaskOnly()
        load_safetensors(dst, tmp_path, strict=True)
        assert dst.mask.eq(7.0).all() and torch.equal(dst.proj.weight, src.proj.weight)
        with torch.device("meta"):
            dst = MaskOnly()
        load_safetensors(dst, tmp_path, init_buffers=lambda m: m.mask.fill_(3.0))
        assert dst.mask.eq(3.0).all()
    finally:
        handle.remove()
    with pytest.raises(TypeError, match="fn must be callable"):
        register_buffer_init(ArticleRotary, None)  # type: ignore[arg-type]
    for bad in ("ArticleRotary", (), (ArticleRotary, "x")):
        with pytest.raises(TypeError, match="match must be a module class"):
            register_buffer_init(bad, mine)  # type: ignore[arg-type]


def test_an_explicit_rule_that_fails_is_final():
    # ArticleRotary has an automatic rule (reset_parameters), yet a failing registration or
    # init_buffers= is the error: it never falls back silently to another rule
    handle = register_buffer_init(ArticleRotary, lambda m: None)  # leaves the buffers unset
    try:
        with torch.device("meta"):
            model = ArticleRotary(4, 3)
        with pytest.raises(ValueError, match=r"left \['cos', 'sin'\] unset"):
            materialize(model, "cpu")
        assert model.cos.is_meta  # untouched
    finally:
        handle.remove()
    with pytest.raises(ValueError, match="init_buffers raised ZeroDivisionError"):
        materialize(model, "cpu", init_buffers=lambda m: 1 / 0)
    assert torch.equal(materialize(model, "cpu").cos, ArticleRotary(4, 3).cos)  # automatic rule


def test_no_rule_error_names_buffers_and_remedies_and_changes_nothing():
    src = MaskOnly()
    with torch.device("meta"):
        model = MaskOnly()
    for call in (lambda: load_from_full_model_state_dict(model, src.state_dict(), "cpu"),
                 lambda: materialize(model, "cpu")):
        with pytest.raises(ValueError) as info:
            call()
        msg = str(info.value)
        assert "['mask']" in msg and "register_buffer_init" in msg and "init_buffers=" in msg
        assert "params_on_meta" in msg
        assert model.proj.weight.is_meta and model.mask.is_meta  # untouched
    boom = register_buffer_init(MaskOnly, lambda m: 1 / 0)
    try:
        with pytest.raises(ValueError, match="ZeroDivisionError"):
            materialize(model, "cpu")
    finally:
        boom.remove()


def test_params_on_meta_buffers_kept_by_loaders():
    torch.manual_seed(3)
    ref = ArticleModel()
    with params_on_meta():
        model = ArticleModel()
    assert all(p.is_meta for p in model.parameters()) and _same_buffers(model, ref)
    model.rotary.cos.add_(1.0)  # a real buffer is kept as it is, never recomputed
    kept = model.rotary.cos.clone()
    load_from_full_model_state_dict(model, ref.state_dict(), "cpu", strict=True)
    assert torch.equal(model.rotary.cos, kept) and torch.equal(model.rotary.sin, ref.rotary.sin)
    assert torch.equal(model.output.weight, ref.output.weight)


# ---------------------------------------------------------------------------------------------
# release_sd: torchtune's contract (memory freed, keys kept)


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 4)
        self.head = nn.Linear(4, 5, bias=False)
        self.head.weight = self.embed.weight


def _release_keeps_keys(bcast: bool, release: bool):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    ref = _Tied()
    sd = {**{k: v.clone() for k, v in ref.state_dict().items()}, "extra": torch.ones(2)}
    with torch.device("meta"):
        model = _Tied()
    fully_shard(model)
    full = dict(sd)  # every rank passes the full dict, as torchtune's recipes do
    res = load_from_full_model_state_dict(model, full, "cpu", broadcast_from_rank0=bcast,
                                          release_sd=release)
    lora_state_dict_empty = not full  # what the LoRA recipe checks afterwards
    loaded = ["embed.weight", "head.weight"]
    freed = all(full[k].is_meta and full[k].shape == sd[k].shape and full[k].dtype == sd[k].dtype
                for k in loaded)
    untouched = all(full[k] is sd[k] for k in loaded)
    ok = torch.equal(model.embed.weight.full_tensor(), ref.embed.weight)
    return (sorted(full), lora_state_dict_empty, freed if release else untouched,
            full["extra"] is sd["extra"], list(res.unexpected_keys), ok)


def test_release_sd_frees_memory_and_keeps_keys(world):
    keys = ["embed.weight", "extra", "head.weight"]
    for bcast in (False, True):
        for release in (True, False):
            got = world(2).run(_release_keeps_keys, bcast, release)
            assert got == [(keys, False, True, True, ["extra"], True)] * 2, (bcast, release)


# ---------------------------------------------------------------------------------------------
# multi-rank: HF models on meta -> shard -> load (three ways) -> every rank equals the CPU build


def _hf_multi_rank(path: str, families: list[str]):
    from fsdptk import gather_cpu_state_dict, get_shard_conditions, shard_model
    from fsdptk.predicates import by_name

    rank = dist.get_rank()
    out = []
    for family in families:
        ref = _hf(family)
        save_safetensors(ref, f"{path}/{family}")
        tok = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(1))
        want = ref(tok).logits
        for mode in ("broadcast", "shard_on_read", "rank0_read", "materialize"):
            model = _hf(family, "meta")
            # the embedding is its own unit: Gemma's embed_scale lives on an FSDP-wrapped module
            shard_model(model, [get_shard_conditions, by_name("model.embed_tokens")], cpu_offload=False)
            if mode == "broadcast":
                load_from_full_model_state_dict(model, ref.state_dict() if rank == 0 else {}, "cpu",
                                                strict=True, broadcast_from_rank0=True)
            elif mode == "materialize":
                materialize(model, "cpu")
                load_from_full_model_state_dict(model, ref.state_dict(), "cpu", strict=True)
            else:
                load_safetensors(model, f"{path}/{family}", strict=True,
                                 shard_on_read=mode == "shard_on_read")
            got = gather_cpu_state_dict(model, rank == 0)
            params_ok = rank != 0 or all(torch.equal(got[k], v) for k, v in ref.state_dict().items())
            logits_ok = torch.allclose(model(tok).logits, want, rtol=1e-5, atol=1e-6)
            out.append((family, mode, _same_buffers(model, ref), params_ok, logits_ok))
    return out


@needs_hf
@pytest.mark.parametrize("n", [2, 4])
def test_hf_models_on_meta_load_on_every_rank(world, tmp_path, n):
    families = ["llama_tied", "gemma3"] if n == 2 else ["llama", "qwen2"]
    got = world(n).run(_hf_multi_rank, str(tmp_path), families, timeout=180)
    for rank_out in got:
        assert [r[2:] for r in rank_out] == [(True, True, True)] * len(rank_out), rank_out


def _no_rule_every_rank():
    with torch.device("meta"):
        model = MaskOnly()
    sd = MaskOnly().state_dict()
    try:
        load_from_full_model_state_dict(model, sd, "cpu")
    finally:
        assert model.proj.weight.is_meta  # nothing changed on any rank


def test_no_rule_error_on_every_rank(world):
    with pytest.raises(RemoteError) as info:
        world(2).run(_no_rule_every_rank)
    for r in info.value.per_rank:
        assert isinstance(r, RemoteError) and r.exc_type == "ValueError"
        assert "'mask'" in r.message and "register_buffer_init" in r.message


# ---------------------------------------------------------------------------------------------
# rank 0 holds a real model, the other ranks build on meta: 40 broadcast loads in one group


class _Stress(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = MaskOnly(6)  # no rule: rank 0's values are sent
        self.rotary = ArticleRotary(6, 5)  # reset_parameters: recomputed where it is on meta
        self.layers = nn.ModuleList([nn.Linear(6, 6) for _ in range(2)])


def _stress(loads: int):
    from torch.distributed.fsdp import fully_shard

    rank = dist.get_rank()
    ok = []
    for i in range(loads):
        torch.manual_seed(i)
        ref = _Stress()  # every rank knows the expected values (same seed)
        if rank == 0:
            torch.manual_seed(i)
            model = _Stress()
        else:
            with torch.device("meta"):
                model = _Stress()
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
        sd = ref.state_dict() if rank == 0 else {}
        load_from_full_model_state_dict(model, sd, "cpu", broadcast_from_rank0=True)
        ok.append(_same_buffers(model, ref)
                  and torch.equal(model.layers[1].weight.full_tensor(), ref.layers[1].weight))
    return ok


def _buffer_send_fails_on_rank0():
    from torch.distributed.fsdp import fully_shard

    import fsdptk._engine.scatter as engine

    rank = dist.get_rank()
    torch.manual_seed(0)
    if rank == 0:
        model = _Stress()
    else:
        with torch.device("meta"):
            model = _Stress()
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    sd = _Stress().state_dict() if rank == 0 else {}
    inner = engine._rank0_pieces

    def flaky(plan, *args):  # only the scatter of rank 0's buffers (MaskOnly has no rule) fails
        if "body.mask" in plan.keys:
            raise OSError("reading the mask failed")
        return inner(plan, *args)

    engine._rank0_pieces = flaky
    try:
        load_from_full_model_state_dict(model, sd, "cpu", broadcast_from_rank0=True)
        got = "no error"
    except OSError as e:
        got = str(e)
    finally:
        engine._rank0_pieces = inner
    local = [p.to_local() for p in model.parameters()]
    untouched = rank == 0 or (all(t.is_meta for t in local) and model.body.mask.is_meta)
    return "reading the mask failed" in got, untouched


def test_a_failed_buffer_send_leaves_the_model_untouched(world):
    assert world(2).run(_buffer_send_fails_on_rank0, timeout=60) == [(True, True)] * 2


@pytest.mark.parametrize("n", [2, 4])
def test_forty_broadcast_loads_rank0_real_others_meta(world, n):
    assert world(n).run(_stress, 40, timeout=120) == [[True] * 40] * n


def _object_collectives_of_a_buffer_broadcast():
    """Rank 0 real, the others on meta with no rule for the buffers: the load sends rank 0's
    buffers, and makes ONE object collective before any tensor moves (the buffers' shapes travel
    with the load's metadata)."""
    from torch.distributed.fsdp import fully_shard

    rank = dist.get_rank()
    torch.manual_seed(0)
    ref = _Stress()
    if rank == 0:
        torch.manual_seed(0)
        model = _Stress()
    else:
        with torch.device("meta"):
            model = _Stress()
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    with counted(OBJECT_COLLECTIVES) as calls:
        load_from_full_model_state_dict(model, ref.state_dict() if rank == 0 else {}, "cpu", broadcast_from_rank0=True)
    return calls, _same_buffers(model, ref)


def test_a_buffer_broadcast_needs_no_second_object_collective(world):
    assert world(2).run(_object_collectives_of_a_buffer_broadcast) == [(["all_gather_object"], True)] * 2


class _MaskOf(nn.Module):
    def __init__(self, m: int) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("mask", torch.randn(m), persistent=False)


def _buffer_broadcast_with_different_shapes():
    rank = dist.get_rank()
    if rank == 0:
        model = _MaskOf(6)
    else:
        with torch.device("meta"):
            model = _MaskOf(7)  # built differently: its buffer cannot take rank 0's values
    try:
        load_from_full_model_state_dict(model, {}, "cpu", broadcast_from_rank0=True, strict=False)
    except ValueError as e:
        return "'mask': shape [6] on rank 0, [[7]] on ranks [1]" in str(e) or str(e)
    return "no error"


def test_a_buffer_rank0_cannot_send_is_an_error_on_every_rank(world):
    assert world(2).run(_buffer_broadcast_with_different_shapes, timeout=60) == [True, True]
