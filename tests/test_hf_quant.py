"""Quantized releases dequantized on read, with the real transformers as the judge (tiny models
written here and quantized by the tests' own reference code, nothing downloaded):

- FP8 block-quantized checkpoints (``<w>`` float8_e4m3fn + ``<w>_scale_inv``, the config's
  ``quantization_config``): a Llama and a Qwen3-MoE in the Hub layout (per-expert weights, each with
  its scales) at 2 ranks (FSDP) and 4 (FSDP x TP): the logits equal transformers' dequantizing load
  (``FineGrainedFP8Config(dequantize=True)``);
- MXFP4 gpt-oss (``_blocks`` / ``_scales``, transposed against the fused experts) against
  ``Mxfp4Config(dequantize=True)``;
- shapes that are not multiples of the block (the grid rounded up, as DeepSeek-V3 ships it, which
  transformers' dequantizing load refuses): every parameter equals the reference dequantization
  exactly, in float32 and bfloat16, with float32 and ue8m0 scales;
- the save writes an unquantized checkpoint with no ``quantization_config`` that transformers
  loads as is; each rank reads only its share of the quantized bytes and the scale blocks its
  shard intersects; bad input is one error on every rank.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402

from fsdptk.hf import from_pretrained  # noqa: E402

from _counting import file_reads, raised  # noqa: E402

_ATOL = 1e-5
_FP8_MAX = 448.0
_BATCH = torch.randint(3, 250, (2, 8), generator=torch.Generator().manual_seed(7))


# ---------------------------------------------------------------------------------------------
# the tests' reference quantizers and dequantizers
def fp8_quantize(w: torch.Tensor, block: tuple[int, int], ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 weight, scale_inv grid) with the grid rounded up where a dim is not a multiple."""
    rows, cols = w.shape[-2:]
    gr, gc = -(-rows // block[0]), -(-cols // block[1])
    scale = torch.ones(*w.shape[:-2], gr, gc)
    for i in range(gr):
        for j in range(gc):
            tile = w[..., i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]]
            amax = tile.abs().amax(dim=(-2, -1)).float()
            s = torch.where(amax > 0, amax / _FP8_MAX, torch.ones_like(amax))
            if ue8m0:
                s = torch.pow(2.0, torch.ceil(torch.log2(s)))
            scale[..., i, j] = s
    q = (w.float() / reference_scales(scale, w.shape, block)).clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn)
    if ue8m0:
        return q, scale.to(torch.float8_e8m0fnu)
    return q, scale


def reference_scales(scale: torch.Tensor, shape, block) -> torch.Tensor:
    s = scale.float().repeat_interleave(block[0], -2).repeat_interleave(block[1], -1)
    return s[..., :shape[-2], :shape[-1]]


def fp8_dequantize(q: torch.Tensor, scale: torch.Tensor, block, dtype) -> torch.Tensor:
    return (q.float() * reference_scales(scale, q.shape, block)).to(dtype)


FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def mxfp4_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's ``[E, cols, rows]`` expert tensor -> gpt-oss ``_blocks`` [E, rows, cols/32, 16]
    and ``_scales`` [E, rows, cols/32] (transposed, groups of 32, low nibble first)."""
    t = w.transpose(1, 2).float()  # [E, rows, cols]
    e, r, c = t.shape
    g = t.reshape(e, r, c // 32, 32)
    amax = g.abs().amax(-1)
    exp = torch.where(amax > 0, torch.ceil(torch.log2(amax / 6.0)), torch.zeros_like(amax)).clamp(-127, 127)
    scaled = g / torch.exp2(exp).unsqueeze(-1)
    idx = (scaled.unsqueeze(-1) - FP4).abs().argmin(-1).to(torch.uint8)  # nearest FP4 value
    packed = idx[..., 0::2] | (idx[..., 1::2] << 4)
    return packed.contiguous(), (exp + 127).to(torch.uint8).contiguous()


# ---------------------------------------------------------------------------------------------
# checkpoints
def _dense(family: str, root: Path, **over) -> Path:
    torch.manual_seed(0)
    kw = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=250, pad_token_id=0, bos_token_id=1, eos_token_id=2,
              tie_word_embeddings=False)
    if family == "qwen3_moe":
        cls = transformers.Qwen3MoeConfig
        kw.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, head_dim=16)
    elif family == "gpt_oss":
        cls = transformers.GptOssConfig
        kw.update(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64, head_dim=16)
    else:
        cls = transformers.LlamaConfig
    kw.update(over)
    transformers.AutoModelForCausalLM.from_config(cls(**kw)).save_pretrained(root)
    return root


def _quantize_dir(src: Path, dst: Path, block: tuple[int, int], *, ue8m0: bool = False) -> dict:
    """``src`` re-written as an FP8 release: every projection weight quantized (embeddings, norms,
    routers and lm_head kept, as the releases do). Returns {key: (q, scale)}."""
    shutil.copytree(src, dst)
    tensors = {}
    for f in src.glob("*.safetensors"):
        tensors.update(load_file(f))
    for f in dst.glob("*.safetensors*"):
        f.unlink()
    out, pairs = {}, {}
    for k, t in tensors.items():
        if k.endswith("_proj.weight") and t.dim() == 2:
            q, s = fp8_quantize(t, block, ue8m0)
            out[k], out[k.removesuffix(".weight") + ".weight_scale_inv"] = q, s
            pairs[k] = (q, s)
        else:
            out[k] = t
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": list(block),
                                  "activation_scheme": "dynamic", **({"scale_fmt": "ue8m0"} if ue8m0 else {})}
    (dst / "config.json").write_text(json.dumps(cfg))
    return pairs


def _mxfp4_dir(src: Path, dst: Path) -> None:
    shutil.copytree(src, dst)
    tensors = load_file(src / "model.safetensors")
    (dst / "model.safetensors").unlink()
    out = {}
    for k, t in tensors.items():
        if k.endswith(("experts.gate_up_proj", "experts.down_proj")):
            out[k + "_blocks"], out[k + "_scales"] = mxfp4_quantize(t)
        else:
            out[k] = t
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (dst / "config.json").write_text(json.dumps(cfg))


def _judge(path: Path, method: str):
    config = (transformers.FineGrainedFP8Config(dequantize=True) if method == "fp8"
              else transformers.Mxfp4Config(dequantize=True))
    model = transformers.AutoModelForCausalLM.from_pretrained(path, quantization_config=config,
                                                              dtype=torch.float32)
    with torch.no_grad():
        return model(input_ids=_BATCH).logits


def _logits(model):
    with torch.no_grad():
        out = model(input_ids=_BATCH).logits
    return out.full_tensor() if hasattr(out, "full_tensor") else out


_DIRS: dict[str, tuple[Path, torch.Tensor]] = {}


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """name -> (a quantized release directory, transformers' dequantizing load's logits)."""

    def get(name: str):
        if name not in _DIRS:
            root = tmp_path_factory.mktemp(name)
            if name == "gpt_oss":
                _mxfp4_dir(_dense("gpt_oss", root / "dense"), root / "q")
                _DIRS[name] = (root / "q", _judge(root / "q", "mxfp4"))
            else:
                _quantize_dir(_dense(name, root / "dense"), root / "q", (32, 32))
                _DIRS[name] = (root / "q", _judge(root / "q", "fp8"))
        return _DIRS[name]

    return get


# ---------------------------------------------------------------------------------------------
def _load_and_save(path: str, dims_kw, out: str) -> dict:
    from fsdptk import ParallelDims, save_safetensors

    model = from_pretrained(path, dims=None if dims_kw is None else ParallelDims(**dims_kw), dtype=torch.float32)
    logits = _logits(model)
    save_safetensors(model, out)
    return {"logits": logits}


CASES = [(2, None, "llama"), (4, {"dp_shard": 2, "tp": 2}, "llama"), (2, None, "qwen3_moe"),
         (4, {"dp_shard": 2, "tp": 2}, "qwen3_moe"), (2, None, "gpt_oss")]


@pytest.mark.parametrize("ranks, dims_kw, name", CASES,
                         ids=[f"{n}ranks-{'tp' if d else 'fsdp'}-{m}" for n, d, m in CASES])
def test_dequantized_load_matches_transformers_and_saves_unquantized(world, release, tmp_path, ranks,
                                                                     dims_kw, name):
    path, want = release(name)
    for r in world(ranks).run(_load_and_save, str(path), dims_kw, str(tmp_path)):
        diff = (r["logits"] - want).abs().max().item()
        assert diff <= _ATOL, f"logits differ from transformers' dequantizing load by {diff}"
    config = json.loads((tmp_path / "config.json").read_text())
    assert "quantization_config" not in config
    saved = load_file(tmp_path / "model.safetensors")
    assert not any(k.endswith(("_scale_inv", "_blocks", "_scales")) for k in saved)
    assert all(t.dtype == torch.float32 for t in saved.values() if t.is_floating_point())
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)  # as is: no quantization
    assert (_logits(plain) - want).abs().max().item() <= _ATOL


def _params(path: str, dtype) -> dict:
    from fsdptk import gather_cpu_state_dict

    model = from_pretrained(path, dtype=dtype)
    return gather_cpu_state_dict(model, torch.distributed.get_rank() == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("ue8m0", [False, True], ids=["f32-scales", "ue8m0-scales"])
def test_ragged_block_grids_equal_the_reference_dequantization(world, tmp_path, dtype, ue8m0):
    """hidden 80 and intermediate 144 under 32 x 32 blocks: 3 x 5 grids rounded up (transformers
    refuses: "Weight shape (80, 144) not divisible by scale grid (3, 5)")."""
    dense = _dense("llama", tmp_path / "dense", hidden_size=80, intermediate_size=144, num_attention_heads=5,
                   num_key_value_heads=5)
    pairs = _quantize_dir(dense, tmp_path / "q", (32, 32), ue8m0=ue8m0)
    got = world(2).run(_params, str(tmp_path / "q"), dtype)[0]
    plain = load_file(dense / "model.safetensors")
    for k, v in got.items():
        if k in pairs:
            q, s = pairs[k]
            assert torch.equal(v, fp8_dequantize(q, s, (32, 32), dtype)), k
        else:
            assert torch.equal(v, plain[k].to(dtype)), k
    assert any(tuple(pairs[k][1].shape) == (3, 5) for k in pairs)  # a rounded-up grid was read


def _reads(path: str) -> list[tuple[str, int]]:
    with file_reads() as seen:
        from_pretrained(path, dtype=torch.float32)
    return [(k, n) for k, _, n in seen]


def test_each_rank_reads_its_share_of_the_quantized_bytes_and_scales(world, release):
    """4 FSDP ranks over an FP8 Qwen3-MoE: 4 experts, one per rank, so each rank reads one quarter
    of the experts' FP8 bytes and of their scales; of the dense projections (rows split in 4,
    blocks of 32 rows) a quarter of the FP8 bytes and the scale rows its rows intersect."""
    path, _ = release("qwen3_moe")
    files = load_file(path / "model.safetensors")
    nbytes = {k: t.numel() * t.element_size() for k, t in files.items()}
    per_rank = world(4).run(_reads, str(path))
    for seen in per_rank:
        read: dict[str, int] = {}
        for k, n in seen:
            read[k] = read.get(k, 0) + n
        for kind in ("experts", "self_attn"):
            q = [k for k in files if kind in k and k.endswith(".weight") and files[k].dtype == torch.float8_e4m3fn]
            s = [k.removesuffix(".weight") + ".weight_scale_inv" for k in q]
            assert sum(read.get(k, 0) for k in q) == sum(nbytes[k] for k in q) // 4, kind
            scale_read = sum(read.get(k, 0) for k in s)
            if kind == "experts":
                assert scale_read == sum(nbytes[k] for k in s) // 4
            else:  # each rank's rows lie in one row of blocks: its scale row, whole
                assert scale_read == sum(nbytes[k] // files[k].shape[0] for k in s)


def _error(path: str) -> tuple[str, str]:
    return raised(from_pretrained, path)


@pytest.mark.parametrize("breakage, needles", [
    ("no scale", ["model.layers.0.self_attn.q_proj.weight", "weight_scale_inv", "scales are missing"]),
    ("bad grid", ["model.layers.0.self_attn.q_proj.weight_scale_inv", "[1, 2]", "[2, 2]", "[32, 32]"]),
    ("unknown method", ["quant_method 'awq'"]),
])
def test_bad_quantized_input_is_one_error_on_every_rank(world, release, tmp_path, breakage, needles):
    path, _ = release("llama")
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    tensors = load_file(bad / "model.safetensors")
    if breakage == "no scale":
        del tensors["model.layers.0.self_attn.q_proj.weight_scale_inv"]
    elif breakage == "bad grid":
        tensors["model.layers.0.self_attn.q_proj.weight_scale_inv"] = torch.ones(1, 2)
    else:
        cfg = json.loads((bad / "config.json").read_text())
        cfg["quantization_config"]["quant_method"] = "awq"
        (bad / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    results = world(2).run(_error, str(bad))
    for kind, message in results:
        assert kind == "ConversionError", (kind, message)
        for n in needles:
            assert n in message, (n, message)


# ---------------------------------------------------------------------------------------------
# uint8 exponent scales (MXFP8-style ``2 ** (byte - 127)``)
def _load_logits(path: str) -> torch.Tensor:
    return _logits(from_pretrained(path, dtype=torch.float32))


def test_uint8_exponent_scales_equal_their_definition_and_transformers(world, tmp_path):
    """ue8m0 scales stored as their raw uint8 exponent bytes: every dequantized parameter equals
    ``q * 2 ** (byte - 127)`` computed here from the definition, and transformers' own
    dequantization of the same pair; the logits equal transformers' dequantizing load."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    dense = _dense("llama", tmp_path / "dense")
    pairs = _quantize_dir(dense, tmp_path / "q", (32, 32), ue8m0=True)
    tensors = load_file(tmp_path / "q" / "model.safetensors")
    tensors = {k: v.view(torch.uint8) if k.endswith("_scale_inv") else v for k, v in tensors.items()}
    save_file(tensors, tmp_path / "q" / "model.safetensors", metadata={"format": "pt"})
    assert any(t.dtype == torch.uint8 for t in load_file(tmp_path / "q" / "model.safetensors").values())
    got = world(2).run(_params, str(tmp_path / "q"), torch.float32)[0]
    judge = Fp8Dequantize(None)
    for k, (q, s) in pairs.items():
        exps = s.view(torch.uint8)
        by_definition = torch.pow(2.0, exps.to(torch.float32) - 127.0)
        want = (q.float() * reference_scales(by_definition, q.shape, (32, 32))).float()
        assert torch.equal(got[k], want), k
        assert torch.equal(got[k], judge._dequantize_one(q, exps, torch.float32)), k
    assert not torch.equal(got["model.layers.0.self_attn.q_proj.weight"],
                           pairs["model.layers.0.self_attn.q_proj.weight"][0].float())  # scaled, not raw
    want_logits = _judge(tmp_path / "q", "fp8")
    for logits in world(2).run(_load_logits, str(tmp_path / "q")):
        assert (logits - want_logits).abs().max().item() <= _ATOL


# ---------------------------------------------------------------------------------------------
# bad quantized layouts: one error on every rank, from the metadata, the model unchanged
def _local(model) -> dict[str, torch.Tensor]:
    return {k: (v.to_local() if hasattr(v, "to_local") else v).detach().clone()
            for k, v in model.state_dict().items()}


def _load_into_a_sharded_model(path: str) -> tuple[str, str, list[str]]:
    """The unquantized model of ``path``'s config (real values), FSDP-sharded, then
    ``load_safetensors`` of the bad release: (error class, message, keys whose values changed)."""
    from fsdptk import load_safetensors, shard_model
    from fsdptk.predicates import no_split_modules

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(path))
    shard_model(model, no_split_modules(model), cpu_offload=False)
    before = _local(model)
    kind, message = raised(load_safetensors, model, path)
    after = _local(model)
    return kind, message, [k for k in before if not torch.equal(before[k], after[k])]


def _break(root: Path, breakage: str) -> None:
    tensors = load_file(root / "model.safetensors")
    cfg = json.loads((root / "config.json").read_text())
    quant = cfg["quantization_config"]
    if breakage.startswith("block "):
        quant["weight_block_size"] = json.loads(breakage.removeprefix("block "))
    elif breakage == "1-D weight with scales":
        norm = "model.layers.0.input_layernorm.weight"
        tensors[norm] = tensors[norm].to(torch.float8_e4m3fn)
        tensors[norm + "_scale_inv"] = torch.ones(1)
    elif breakage == "scale rank":
        key = "model.layers.0.self_attn.q_proj.weight_scale_inv"
        tensors[key] = tensors[key].reshape(1, *tensors[key].shape)
    elif breakage == "scale dtype":
        key = "model.layers.0.self_attn.q_proj.weight_scale_inv"
        tensors[key] = tensors[key].to(torch.int32)
    elif breakage == "mxfp4 groups of 8":
        key = "model.layers.0.mlp.experts.down_proj_blocks"
        tensors[key] = tensors[key].reshape(*tensors[key].shape[:-2], -1, 8)
    elif breakage == "mxfp4 float scales":
        key = "model.layers.0.mlp.experts.down_proj_scales"
        tensors[key] = tensors[key].to(torch.float32)
    else:
        raise AssertionError(breakage)
    save_file(tensors, root / "model.safetensors", metadata={"format": "pt"})
    (root / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("breakage, needles", [
    ("block [0, 32]", ["weight_block_size [0, 32]", "config.json's quantization_config", "positive ints"]),
    ('block ["a", 32]', ["weight_block_size ['a', 32]", "config.json's quantization_config", "positive ints"]),
    ("block [32, 32, 32]", ["weight_block_size [32, 32, 32]", "list of two ints"]),
    ("block 32", ["weight_block_size 32", "list of two ints"]),
    ("1-D weight with scales", ["'model.layers.0.input_layernorm.weight' has shape [64] (1-D)",
                                "'model.layers.0.input_layernorm.weight_scale_inv' of shape [1]"]),
    ("scale rank", ["'model.layers.0.self_attn.q_proj.weight_scale_inv' has shape [1, 2, 2]",
                    "shape [64, 64]", "needs a scale grid of [2, 2]"]),
    ("scale dtype", ["'model.layers.0.self_attn.q_proj.weight_scale_inv'", "torch.int32"]),
    ("mxfp4 groups of 8", ["'model.layers.0.mlp.experts.down_proj_blocks' (shape [4, 64, 4, 8])",
                           "'model.layers.0.mlp.experts.down_proj_scales' (shape [4, 64, 2])"]),
    ("mxfp4 float scales", ["'model.layers.0.mlp.experts.down_proj_scales' is torch.float32", "uint8"]),
])
def test_bad_quantized_layouts_are_refused_from_the_metadata_the_model_unchanged(world, tmp_path, breakage,
                                                                                  needles):
    if breakage.startswith("mxfp4"):
        _mxfp4_dir(_dense("gpt_oss", tmp_path / "dense"), tmp_path / "q")
    else:
        _quantize_dir(_dense("llama", tmp_path / "dense"), tmp_path / "q", (32, 32))
    _break(tmp_path / "q", breakage)
    for kind, message, changed in world(2).run(_load_into_a_sharded_model, str(tmp_path / "q"), timeout=60):
        assert kind == "ConversionError", (kind, message)
        assert all(n in message for n in needles), (needles, message)
        assert changed == [], changed
