"""Tiny transformers models in the Hub layout, shared by the weight-source tests (the main suite's
and the vLLM leg's): their configs, ``save_pretrained`` directories, a checkpoint read back, the
stepped model written by transformers from torch's own full state dict, and bit-level comparison."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file

COMMON = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "pad_token_id": 0,
          "bos_token_id": 1, "eos_token_id": 2}
# family -> (transformers config class, its sizes): tiny models with 8 experts for the MoE families
FAMILIES = {
    "llama": ("LlamaConfig", {"hidden_size": 64, "intermediate_size": 96, "vocab_size": 130,
                              "tie_word_embeddings": False}),
    "llama_tied": ("LlamaConfig", {"hidden_size": 64, "intermediate_size": 96, "vocab_size": 130,
                                   "tie_word_embeddings": True}),
    "qwen3_moe": ("Qwen3MoeConfig", {"hidden_size": 32, "vocab_size": 96, "num_experts_per_tok": 2, "num_experts": 8,
                                     "moe_intermediate_size": 16, "intermediate_size": 32, "head_dim": 8}),
    "mixtral": ("MixtralConfig", {"hidden_size": 32, "vocab_size": 96, "num_local_experts": 8,
                                  "num_experts_per_tok": 2, "intermediate_size": 16}),
    "deepseek_v3": ("DeepseekV3Config", {"hidden_size": 32, "vocab_size": 96, "n_routed_experts": 8,
                                         "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                                         "intermediate_size": 48, "n_shared_experts": 1,
                                         "first_k_dense_replace": 1, "q_lora_rank": 16, "kv_lora_rank": 16,
                                         "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8,
                                         "n_group": 2, "topk_group": 1, "num_key_value_heads": 4}),
    "gpt_oss": ("GptOssConfig", {"hidden_size": 32, "vocab_size": 96, "num_local_experts": 8,
                                 "num_experts_per_tok": 2, "intermediate_size": 16, "head_dim": 8}),
}


def config(family: str) -> Any:
    """The tiny config of ``family`` (2 layers)."""
    import transformers

    cls, extra = FAMILIES[family]
    return getattr(transformers, cls)(**{**COMMON, **extra})


def hub_dir(root: Path, family: str) -> Path:
    """``save_pretrained`` of a tiny ``family`` model built with ``from_config`` (seed 0): the Hub layout."""
    import transformers

    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config(family)).save_pretrained(root)
    return root


def tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors files in ``path``."""
    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        out.update(load_file(f))
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bits as integers of its element size (bit-for-bit comparison: NaN == NaN, -0 != +0)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def save_full(model: Any, family: str, out: Path) -> None:
    """On every rank: torch's own full state dict of the (sharded) model, written by transformers'
    ``save_pretrained`` from a single-process model on rank 0."""
    import transformers
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        ref = transformers.AutoModelForCausalLM.from_config(config(family))
        missing, unexpected = ref.load_state_dict(full, strict=False)
        assert not unexpected and all("rotary" in k or "inv_freq" in k for k in missing), (missing, unexpected)
        ref.save_pretrained(out)
    dist.barrier()


def step(model: Any, opt: torch.optim.Optimizer, seed: int) -> None:
    """One training step on a fixed random batch of token ids."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 90, (2, 12), generator=g)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
