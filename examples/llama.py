"""A Llama-style decoder in plain PyTorch, with Hugging Face parameter names.

RMSNorm, rotary position embeddings (RoPE) with a non-persistent cos/sin cache, grouped-query
attention (GQA), a SwiGLU MLP, and optionally tied input/output embeddings. Parameter names follow
Hugging Face's ``LlamaForCausalLM`` (``model.layers.0.self_attn.q_proj.weight``, ...) and RoPE uses
the same "rotate half" layout, so a Llama checkpoint in HF layout (``config.json`` +
``*.safetensors``) loads into it unchanged, and what the example saves is an HF-layout directory.

Nothing here knows about FSDP: the training script shards this model with fsdptk.

Meta-device construction: build under ``torch.device("meta")``, shard, then either load weights
with an fsdptk loader (it allocates the shards and recomputes the RoPE cache, which is in no state
dict, through :meth:`RotaryEmbedding.reset_buffers`) or, to train from scratch, call
``fsdptk.materialize(model, device)`` (never a bare ``to_empty``: it leaves uninitialised memory)
and then :meth:`LlamaForCausalLM.init_weights`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "LlamaConfig",
    "RMSNorm",
    "RotaryEmbedding",
    "Attention",
    "MLP",
    "DecoderLayer",
    "LlamaModel",
    "LlamaForCausalLM",
    "reset_non_persistent_buffers",
    "tiny",
]


@dataclass
class LlamaConfig:
    """Model shape, with the field names of Hugging Face's ``LlamaConfig`` (``config.json``)."""

    vocab_size: int = 256
    hidden_size: int = 128
    intermediate_size: int = 352
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 512
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                f"({self.num_attention_heads})"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be divisible by "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if (self.hidden_size // self.num_attention_heads) % 2:
            raise ValueError(
                f"head dim ({self.hidden_size // self.num_attention_heads}) must be even for RoPE"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def to_hf_dict(self) -> dict[str, Any]:
        """The ``config.json`` content of an HF ``LlamaForCausalLM`` with this shape."""
        d = dataclasses.asdict(self)
        d.update(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu")
        return d

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> LlamaConfig:
        """Read the fields this model understands from an HF ``config.json`` dict."""
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in names}
        kwargs.setdefault("num_key_value_heads", d.get("num_attention_heads", cls.num_attention_heads))
        return cls(**kwargs)

    def save(self, directory: str | Path) -> Path:
        """Write ``config.json`` into ``directory`` and return its path."""
        path = Path(directory) / "config.json"
        path.write_text(json.dumps(self.to_hf_dict(), indent=2, sort_keys=True) + "\n")
        return path

    @classmethod
    def load(cls, directory: str | Path) -> LlamaConfig:
        """Read ``directory/config.json``."""
        return cls.from_hf_dict(json.loads((Path(directory) / "config.json").read_text()))


def tiny(**overrides: Any) -> LlamaForCausalLM:
    """The example's default model (about 0.6 M parameters), built on the current default device.

    Used as ``examples.llama:tiny`` by ``fsdptk plan``.
    """
    return LlamaForCausalLM(LlamaConfig(**overrides))


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (computed in float32)."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """RoPE cos/sin tables for positions ``0..max_seq_len-1``, kept as NON-persistent buffers.

    The tables are not in the state dict: they are derived from the shape. A model built on the
    meta device gets them from fsdptk's loaders or ``fsdptk.materialize`` (both call
    :meth:`reset_buffers`); a bare ``to_empty`` would leave garbage here.
    """

    def __init__(self, head_dim: int, max_seq_len: int, theta: float = 10000.0) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_seq_len = max_seq_len
        self.theta = theta
        self.register_buffer("cos", torch.empty(max_seq_len, head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_seq_len, head_dim), persistent=False)
        if self.cos.device.type != "meta":
            self.reset_buffers()

    def reset_buffers(self) -> None:
        """Recompute the cos/sin tables in place (on the buffers' current device)."""
        device = self.cos.device
        if device.type == "meta":
            return
        inv_freq = 1.0 / (
            self.theta
            ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device) / self.head_dim)
        )
        t = torch.arange(self.max_seq_len, dtype=torch.float32, device=device)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        with torch.no_grad():
            self.cos.copy_(emb.cos())
            self.sin.copy_(emb.sin())

    def forward(self, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        if seq_len > self.max_seq_len:
            raise ValueError(
                f"sequence length ({seq_len}) exceeds max_position_embeddings ({self.max_seq_len})"
            )
        return self.cos[:seq_len], self.sin[:seq_len]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (batch, heads, seq, head_dim); cos/sin: (seq, head_dim)
    return (x.float() * cos + _rotate_half(x.float()) * sin).to(x.dtype)


class Attention(nn.Module):
    """Causal grouped-query attention.

    ``num_heads``, ``num_kv_heads`` and ``embed_dim`` are the attributes that
    :func:`fsdptk.prepare_mha_for_tp` divides by the tensor-parallel degree: the forward pass
    reshapes with them, so after column-wise ``q/k/v`` and row-wise ``o`` sharding each TP rank
    works on its own heads.
    """

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.embed_dim = cfg.hidden_size
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
        rep = self.num_heads // self.num_kv_heads
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out = out.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim)
        return self.o_proj(out)


class MLP(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm transformer block: attention and MLP, each with a residual connection."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """Embedding, decoder layers (``layers.<i>``: the FSDP units), final norm, RoPE tables."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        cos, sin = self.rotary_emb(tokens.shape[1])
        h = self.embed_tokens(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.norm(h)


class LlamaForCausalLM(nn.Module):
    """Decoder plus the output projection ``lm_head`` (tied to the embedding when configured).

    Example:
        >>> import torch
        >>> model = LlamaForCausalLM(LlamaConfig(hidden_size=32, num_hidden_layers=1))
        >>> model(torch.zeros(2, 8, dtype=torch.long)).shape
        torch.Size([2, 8, 256])
    """

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Map token ids ``(batch, seq)`` to logits ``(batch, seq, vocab_size)``."""
        return self.lm_head(self.model(tokens))

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Fresh weights (normal, std 0.02; residual projections scaled by depth) and RoPE tables.

        Args:
            seed: seeds a private generator so the result does not depend on the global RNG.
        """
        gen = torch.Generator(device="cpu")
        gen.manual_seed(0 if seed is None else seed)
        depth_std = 0.02 / math.sqrt(2 * self.config.num_hidden_layers)
        for name, p in self.named_parameters():  # tied parameters appear once
            if name.endswith("layernorm.weight") or name == "model.norm.weight":
                p.fill_(1.0)
                continue
            std = depth_std if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32).mul_(std).to(p))
        reset_non_persistent_buffers(self)

    def num_params(self) -> int:
        """Number of distinct parameters (a tied weight counts once)."""
        return sum(p.numel() for p in self.parameters())


def reset_non_persistent_buffers(model: nn.Module) -> None:
    """Call ``reset_buffers()`` on every submodule that has it (here: the RoPE tables)."""
    for module in model.modules():
        fn = getattr(module, "reset_buffers", None)
        if callable(fn):
            fn()
