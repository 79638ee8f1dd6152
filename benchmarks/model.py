"""The benchmark model: a small Llama-style decoder of configurable size, built on ``meta``.

Parameter names follow Hugging Face's ``LlamaForCausalLM`` (``model.layers.0.self_attn.q_proj.weight``,
...) and :func:`write_checkpoint` writes an HF-layout directory (``config.json`` +
``model.safetensors``), so the same checkpoint also feeds ``examples/train_llama.py`` for the
time-to-first-step scenario. Nothing here knows about FSDP or fsdptk.

Sizes are given in GB (10**9 bytes) of parameters in the chosen dtype; :func:`config_for_size`
picks the width and the number of layers that come closest.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "BenchConfig",
    "config_for_size",
    "build_model",
    "layer_fqns",
    "param_specs",
    "make_full_state_dict",
    "write_checkpoint",
]

GENERATOR_VERSION = 2  # bump when make_full_state_dict's values change (invalidates cached checkpoints)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class BenchConfig:
    """Shape of the benchmark model (the field names of HF's ``LlamaConfig``)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    dtype: str = "float32"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def num_params(self) -> int:
        return sum(math.prod(shape) for _, shape in param_specs(self))

    def nbytes(self) -> int:
        return self.num_params() * self.torch_dtype.itemsize

    def hf_config(self) -> dict:
        """``config.json`` content of an HF ``LlamaForCausalLM`` with this shape."""
        d = asdict(self)
        d.pop("dtype")
        d.update(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
                 max_position_embeddings=512, rope_theta=10000.0, rms_norm_eps=1e-5,
                 tie_word_embeddings=False, torch_dtype=self.dtype)
        return d


def config_for_size(size_gb: float, dtype: str = "float32") -> BenchConfig:
    """The configuration whose parameters take closest to ``size_gb`` GB in ``dtype``.

    Width grows with size (256 / 512 / 1024 hidden), heads of 64, GQA with 4 query heads per KV
    head, a SwiGLU MLP of ~8/3 the width; the number of layers fills the rest.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    target = size_gb * 1e9 / DTYPES[dtype].itemsize
    if target < 20e6:
        hidden, vocab = 256, 2048
    elif target < 40e6:
        hidden, vocab = 512, 8192
    else:
        hidden, vocab = 1024, 16384
    heads = hidden // 64
    ffn = int(round(hidden * 8 / 3 / 64)) * 64
    probe = BenchConfig(vocab, hidden, ffn, 1, heads, max(1, heads // 4), dtype)
    per_layer = probe.num_params() - BenchConfig(vocab, hidden, ffn, 0, heads, max(1, heads // 4), dtype).num_params()
    fixed = probe.num_params() - per_layer
    layers = max(1, round((target - fixed) / per_layer))
    return BenchConfig(vocab, hidden, ffn, layers, heads, max(1, heads // 4), dtype)


def param_specs(cfg: BenchConfig) -> list[tuple[str, tuple[int, ...]]]:
    """``(fqn, shape)`` of every parameter, in registration order (= ``state_dict`` order)."""
    h, kv = cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim
    specs: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (cfg.vocab_size, h))]
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        specs += [
            (p + "self_attn.q_proj.weight", (h, h)),
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.weight", (kv, h)),
            (p + "self_attn.o_proj.weight", (h, h)),
            (p + "mlp.gate_proj.weight", (cfg.intermediate_size, h)),
            (p + "mlp.up_proj.weight", (cfg.intermediate_size, h)),
            (p + "mlp.down_proj.weight", (h, cfg.intermediate_size)),
            (p + "input_layernorm.weight", (h,)),
            (p + "post_attention_layernorm.weight", (h,)),
        ]
    specs += [("model.norm.weight", (h,)), ("lm_head.weight", (cfg.vocab_size, h))]
    return specs


class _RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * self.weight


def _rope(x: torch.Tensor) -> torch.Tensor:
    """Rotary embedding computed on the fly (no buffers: nothing outside the state dict)."""
    seq, dim = x.shape[-2], x.shape[-1]
    inv = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float32, device=x.device) / dim))
    ang = torch.outer(torch.arange(seq, dtype=torch.float32, device=x.device), inv)
    cos, sin = torch.cat([ang.cos()] * 2, -1).to(x.dtype), torch.cat([ang.sin()] * 2, -1).to(x.dtype)
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


class _Attention(nn.Module):
    def __init__(self, cfg: BenchConfig) -> None:
        super().__init__()
        h, kv = cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj, self.k_proj = nn.Linear(h, h, bias=False), nn.Linear(h, kv, bias=False)
        self.v_proj, self.o_proj = nn.Linear(h, kv, bias=False), nn.Linear(h, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        out = F.scaled_dot_product_attention(_rope(q), _rope(k), v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class _MLP(nn.Module):
    def __init__(self, cfg: BenchConfig) -> None:
        super().__init__()
        h, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj, self.up_proj = nn.Linear(h, f, bias=False), nn.Linear(h, f, bias=False)
        self.down_proj = nn.Linear(f, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, cfg: BenchConfig) -> None:
        super().__init__()
        self.self_attn, self.mlp = _Attention(cfg), _MLP(cfg)
        self.input_layernorm = _RMSNorm(cfg.hidden_size)
        self.post_attention_layernorm = _RMSNorm(cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class _Body(nn.Module):
    def __init__(self, cfg: BenchConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(_Layer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = _RMSNorm(cfg.hidden_size)


class BenchLlama(nn.Module):
    """Llama-style decoder with HF parameter names and no buffers."""

    def __init__(self, cfg: BenchConfig) -> None:
        super().__init__()
        self.model = _Body(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(tokens)
        for layer in self.model.layers:
            x = layer(x)
        return self.lm_head(self.model.norm(x))


def build_model(cfg: BenchConfig, device: str | torch.device = "meta") -> BenchLlama:
    """The model on ``device`` (``meta`` by default: no memory for weights) in ``cfg.dtype``."""
    with torch.device(device):
        return BenchLlama(cfg).to(cfg.torch_dtype)


def layer_fqns(cfg: BenchConfig) -> list[str]:
    """FQNs of the decoder layers (the FSDP units below the root)."""
    return [f"model.layers.{i}" for i in range(cfg.num_hidden_layers)]


def make_full_state_dict(cfg: BenchConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """A deterministic full CPU state dict for ``cfg`` (values ~ N(0, 0.02), norms 1).

    Matrices are tiled from a 4 MB pool of normal samples at a per-tensor offset, so building a
    GB-sized state dict costs about one memcpy of it (values repeat; no benchmark depends on that).
    """
    gen = torch.Generator().manual_seed(seed)
    pool = torch.empty(1 << 20, dtype=torch.float32).normal_(0.0, 0.02, generator=gen).to(cfg.torch_dtype)
    sd: dict[str, torch.Tensor] = {}
    for i, (fqn, shape) in enumerate(param_specs(cfg)):
        t = torch.empty(shape, dtype=cfg.torch_dtype)
        if len(shape) == 1:
            t.fill_(1.0)
        else:
            flat, start = t.view(-1), (i * 7919) % pool.numel()
            done = 0
            while done < flat.numel():
                n = min(pool.numel() - start, flat.numel() - done)
                flat[done:done + n].copy_(pool[start:start + n])
                done, start = done + n, 0
        sd[fqn] = t
    return sd


def write_checkpoint(cfg: BenchConfig, directory: str | Path, seed: int = 0) -> Path:
    """Write ``config.json`` + ``model.safetensors`` (HF layout) for ``cfg`` into ``directory``."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(make_full_state_dict(cfg, seed), str(directory / "model.safetensors.tmp"),
              metadata={"format": "pt"})
    (directory / "model.safetensors.tmp").replace(directory / "model.safetensors")
    (directory / "config.json").write_text(json.dumps(cfg.hf_config(), indent=2) + "\n")
    return directory
