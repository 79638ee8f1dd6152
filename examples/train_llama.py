"""Train a small Llama-style model with FSDP2 + fsdptk: the end-to-end job to copy.

Run (CPU, 2 processes; unchanged on GPUs, where it uses NCCL)::

    torchrun --nproc_per_node=2 examples/train_llama.py            # trains, saves, prints the path
    torchrun --nproc_per_node=2 examples/train_llama.py            # again: resumes from the latest save

What it shows, in the order a real job does it (each step is one fsdptk call or a few lines):

1. build the model on the ``meta`` device (no memory for weights yet);
2. optional tensor parallel (``prepare_mha_for_tp`` + ``apply_tp``) before FSDP, because FSDP2
   shards the DTensors TP creates; optional activation checkpointing (wraps the blocks) before
   sharding, so the checkpoint wrappers sit inside the FSDP units;
3. ``shard_model``: ``fully_shard`` each decoder layer, then the root (bottom-up), with optional
   mixed precision, CPU offload and prefetch;
4. ``load_from_full_model_state_dict`` from a safetensors checkpoint (an HF-layout directory; with
   none given, a fresh default one is written first), rank 0 reading and each rank receiving only
   its shards; the RoPE tables (non-persistent buffers) are recomputed by the loader, which calls
   the module's ``reset_buffers()``;
5. AdamW with linear warmup + cosine decay, byte-level batches from a ``DistributedSampler``;
6. every ``--save-every`` steps and at the end: the model as ``model.safetensors`` (HF layout,
   loadable by any single process), the optimizer as one full file or a DCP directory, and the
   step; a restart resumes from the latest complete save and reproduces the uninterrupted loss
   curve exactly (``tests/test_example.py`` checks that). Saves run in the background
   (``save_safetensors_async`` / ``save_dcp_async``): training goes on once every rank has copied
   its shards, and the log says how long each save blocked training and how long it took;
   ``--sync-save`` saves synchronously instead.
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `import llama` however this file is run

from bytedata import DEFAULT_CORPUS, ByteWindows, StepBatches, load_corpus  # noqa: E402
from checkpointing import (  # noqa: E402
    PendingCheckpoint,
    latest_checkpoint,
    load_optimizer,
    read_train_state,
    save_checkpoint,
    start_checkpoint,
)
from llama import LlamaConfig, LlamaForCausalLM  # noqa: E402

from safetensors.torch import save_file  # noqa: E402

import fsdptk  # noqa: E402
from fsdptk.predicates import layers  # noqa: E402

__all__ = ["main", "parse_args", "RunResult", "build_model", "load_plain_model", "latest_checkpoint"]


# ----------------------------------------------------------------------------------------------
# arguments
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line (``argv=None`` reads ``sys.argv``)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("run")
    g.add_argument("--out-dir", default="runs/llama", help="checkpoints and the default initial weights go here")
    g.add_argument("--init-from", default=None, help="HF-layout directory (config.json + *.safetensors) to start from")
    g.add_argument("--corpus", default=str(DEFAULT_CORPUS), help="training text (byte-level tokens)")
    g.add_argument("--steps", type=int, default=300, help="total optimizer steps")
    g.add_argument("--batch-size", type=int, default=8, help="sequences per step per data-parallel rank")
    g.add_argument("--seq-len", type=int, default=128)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    g.add_argument("--log-every", type=int, default=25)
    g.add_argument("--no-progress", action="store_true", help="no progress bar (log lines only)")
    g = p.add_argument_group("optimizer")
    g.add_argument("--lr", type=float, default=3e-3)
    g.add_argument("--min-lr", type=float, default=3e-4)
    g.add_argument("--warmup-steps", type=int, default=30)
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--grad-clip", type=float, default=1.0, help="0 disables clipping")
    g = p.add_argument_group("checkpointing")
    g.add_argument("--save-every", type=int, default=100, help="also saves at the last step")
    g.add_argument("--keep", type=int, default=2, help="checkpoints kept (older ones are deleted)")
    g.add_argument("--optimizer-format", choices=["full", "dcp"], default="full",
                   help="full: one optimizer.pt keyed by parameter name; dcp: model + optimizer shards as a DCP directory")
    g.add_argument("--sync-save", action="store_true",
                   help="save synchronously (default: in the background, while training goes on)")
    g.add_argument("--no-resume", dest="resume", action="store_false", help="ignore existing checkpoints")
    g.add_argument("--stop-after", type=int, default=None,
                   help="save and exit after this step, as if interrupted (to demonstrate resuming)")
    g = p.add_argument_group("model (used when no checkpoint gives a config.json)")
    g.add_argument("--dim", type=int, default=128)
    g.add_argument("--layers", type=int, default=4)
    g.add_argument("--heads", type=int, default=4)
    g.add_argument("--kv-heads", type=int, default=2)
    g.add_argument("--ffn-dim", type=int, default=352)
    g.add_argument("--tie-embeddings", action="store_true")
    g = p.add_argument_group("parallelism and memory")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    g.add_argument("--dp-replicate", type=int, default=1, help="HSDP replica groups")
    g.add_argument("--mixed-precision", choices=["none", "bf16"], default="none",
                   help="bf16: bf16 compute and all-gathers, fp32 gradient reduction and master weights")
    g.add_argument("--cpu-offload", action="store_true", help="parameters/gradients/optimizer on CPU (needs a GPU)")
    g.add_argument("--activation-checkpointing", action="store_true")
    g.add_argument("--prefetch", type=int, default=1, help="FSDP units to prefetch ahead (forward and backward)")
    g.add_argument("--no-reshard-after-forward", dest="reshard_after_forward", action="store_false")
    args = p.parse_args(argv)
    for name in ("steps", "batch_size", "seq_len", "log_every", "save_every", "keep"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


@dataclass
class RunResult:
    """What :func:`main` returns (the same on every rank)."""

    losses: dict[int, float] = field(default_factory=dict)  # 1-based step -> mean loss over ranks
    checkpoint: str | None = None  # last checkpoint written (or resumed from, if nothing was trained)
    resumed_from: int | None = None  # step of the checkpoint this run started from
    final_step: int = 0
    val_loss: float | None = None
    model: Any = field(default=None, repr=False, compare=False)  # the sharded model (this rank)


# ----------------------------------------------------------------------------------------------
# process group and device
def _init_distributed(device_arg: str) -> bool:
    """Join the process group torchrun describes (or a 1-process group); True if we created it."""
    if dist.is_initialized():
        return False
    use_cuda = device_arg == "cuda" or (device_arg == "auto" and torch.cuda.is_available())
    if "RANK" not in os.environ:  # plain `python train_llama.py`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    backend = fsdptk.get_distributed_backend("cuda" if use_cuda else "cpu")
    if use_cuda:  # bind the rank to its GPU up front (barriers and NCCL know the device)
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group(backend, device_id=device)
    else:
        dist.init_process_group(backend)
    return True


def _device(device_arg: str) -> torch.device:
    if device_arg == "cuda" or (device_arg == "auto" and torch.cuda.is_available()):
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def _peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB -> MiB (peak RSS)


def _broadcast(obj: Any) -> Any:
    """Rank 0's value of ``obj`` on every rank (decisions about files are made once)."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# ----------------------------------------------------------------------------------------------
# model
def build_model(cfg: LlamaConfig, dims: fsdptk.ParallelDims, args: argparse.Namespace,
                device: torch.device) -> LlamaForCausalLM:
    """Meta model -> (TP) -> (activation checkpointing) -> FSDP2 (still on ``meta``).

    Load weights next (:func:`_load_weights`): the loader materialises the shards on ``device`` and
    recomputes the RoPE tables, which are in no state dict, with ``RotaryEmbedding.reset_buffers()``.
    """
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    if dims.tp_enabled:  # TP first: FSDP2 then shards the DTensors TP made
        plan = fsdptk.llama_tp_plan(model, embeddings_and_output=not cfg.tie_word_embeddings)
        fsdptk.prepare_mha_for_tp(model, dims.tp_mesh)
        fsdptk.apply_tp(model, dims.tp_mesh, plan)
    if args.activation_checkpointing:  # wrap blocks before sharding: wrappers live inside FSDP units
        fsdptk.apply_activation_checkpointing(model, layers())
    mp_policy = None
    if args.mixed_precision == "bf16":
        from torch.distributed.fsdp import MixedPrecisionPolicy

        mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fsdptk.shard_model(
        model,
        [fsdptk.get_shard_conditions],  # every `...layers.<i>` is an FSDP unit; the root is the last
        cpu_offload=args.cpu_offload,
        reshard_after_forward=args.reshard_after_forward,
        dp_mesh=dims.fsdp_mesh,
        mp_policy=mp_policy,
        forward_prefetch=args.prefetch,
        backward_prefetch=args.prefetch,
    )
    return model


def _load_weights(model: LlamaForCausalLM, directory: Path, device: torch.device, *,
                  cpu_offload: bool = False) -> None:
    """Every rank reads only its own slices of the safetensors files (or, when the files are not
    visible to every rank, rank 0 reads and scatters each rank its bytes). A tied output weight
    stored once (HF convention) fills both modules; any other missing or extra key is an error.
    Non-persistent buffers still on meta (the RoPE tables) are recomputed by ``reset_buffers()``."""
    fsdptk.load_safetensors(model, directory, device=device, strict=True, cpu_offload=cpu_offload)


def load_plain_model(directory: str | Path, device: str | torch.device = "cpu") -> LlamaForCausalLM:
    """Load a checkpoint this script wrote (or any HF-layout Llama) into a plain, unsharded model.

    No process group needed: this is how the result is used for inference or evaluation.
    """
    directory = Path(directory)
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig.load(directory))  # RoPE tables computed here
    fsdptk.load_safetensors(model, directory, strict=True)
    return model


def _write_default_init(directory: Path, cfg: LlamaConfig, seed: int) -> Path:
    """Rank 0 writes fresh weights as an HF-layout directory (again only when the model flags
    changed); everyone waits for it."""
    fresh = (directory / "model.safetensors").is_file() and (directory / "config.json").is_file() \
        and LlamaConfig.load(directory) == cfg
    if dist.get_rank() == 0 and not fresh:
        model = LlamaForCausalLM(cfg)
        model.init_weights(seed)
        tmp = directory.with_name(directory.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_file(_hf_state_dict(model.state_dict(), cfg), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        cfg.save(tmp)
        shutil.rmtree(directory, ignore_errors=True)
        os.replace(tmp, directory)
        print(f"[init] wrote fresh weights ({model.num_params():,} parameters) to {directory}", flush=True)
    dist.barrier()
    return directory


def _hf_state_dict(sd: dict[str, torch.Tensor], cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    """HF convention: a tied output projection is not stored (it is the embedding)."""
    if cfg.tie_word_embeddings:
        sd = {k: v for k, v in sd.items() if k != "lm_head.weight"}
    return sd


# ----------------------------------------------------------------------------------------------
# training
def _lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warmup to ``lr``, then cosine decay to ``min_lr`` at ``steps`` (a function of the step
    alone, so resuming needs no scheduler state)."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    progress = (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps)
    return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


def _clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """``clip_grad_norm_`` for parameters on different meshes (with TP: norms are only FSDP-sharded,
    projections FSDP x TP), which ``torch.nn.utils.clip_grad_norm_`` cannot combine in one op."""
    by_mesh: dict[Any, list[torch.nn.Parameter]] = {}
    for p in params:
        if p.grad is not None:
            by_mesh.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    norms = []
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group])
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total = torch.linalg.vector_norm(torch.stack(norms))
    for group in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total


def _mean_over_ranks(values: torch.Tensor) -> torch.Tensor:
    values = values.detach().float().clone()
    dist.all_reduce(values)
    return values / dist.get_world_size()


@torch.no_grad()
def _val_loss(model: LlamaForCausalLM, val: ByteWindows, dims: fsdptk.ParallelDims,
              batch_size: int, device: torch.device, max_batches: int = 4) -> float:
    """Mean loss over the same held-out windows, split over data-parallel ranks."""
    n = min(len(val), max_batches * batch_size * dims.dp_degree)
    mine = list(range(dims.dp_rank, n, dims.dp_degree)) or [0]
    total = torch.zeros(2, device=device)
    for i in range(0, len(mine), batch_size):
        xs, ys = zip(*(val[j] for j in mine[i : i + batch_size]))
        logits = model(torch.stack(xs).to(device))
        total[0] += F.cross_entropy(logits.flatten(0, 1).float(), torch.stack(ys).to(device).flatten(), reduction="sum")
        total[1] += ys[0].numel() * len(ys)
    dist.all_reduce(total)
    return (total[0] / total[1]).item()


class _Logger:
    """Rank 0 prints; a tqdm progress bar when stderr is a terminal."""

    def __init__(self, args: argparse.Namespace, start: int) -> None:
        self.rank0 = dist.get_rank() == 0
        self.bar = None
        if self.rank0 and not args.no_progress and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=args.steps, initial=start, desc="train", unit="step", dynamic_ncols=True)

    def step(self, loss: float, lr: float) -> None:
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}")

    def print(self, msg: str) -> None:
        if not self.rank0:
            return
        if self.bar is not None:
            self.bar.write(msg)
        else:
            print(msg, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _weights_source(args: argparse.Namespace, out: Path, ckpt_root: Path) -> tuple[Path, str | None]:
    """``(weights directory, resumed checkpoint or None)``: rank 0 decides, every rank agrees."""
    latest = latest_checkpoint(ckpt_root) if args.resume and dist.get_rank() == 0 else None
    resume = _broadcast(None if latest is None else str(latest))
    if resume is not None:
        return Path(resume), resume
    if args.init_from is not None:
        weights = Path(args.init_from)
        if not (weights / "config.json").is_file():
            raise FileNotFoundError(f"--init-from {weights}: no config.json (expected an HF-layout directory)")
        return weights, None
    cfg = LlamaConfig(hidden_size=args.dim, num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.kv_heads, intermediate_size=args.ffn_dim,
                      max_position_embeddings=max(512, args.seq_len), tie_word_embeddings=args.tie_embeddings)
    return _write_default_init(out / "init", cfg, args.seed), None


def train(args: argparse.Namespace) -> RunResult:
    """The training job on an initialised process group (see the module docstring)."""
    device = _device(args.device)
    world_size, rank = fsdptk.get_world_size_and_rank()
    torch.manual_seed(args.seed)
    out, result = Path(args.out_dir), RunResult()
    ckpt_root = out / "checkpoints"

    # 1. where the weights come from: the latest save (resume), --init-from, or fresh defaults
    weights, resume = _weights_source(args, out, ckpt_root)
    cfg = LlamaConfig.load(weights)

    # 2. mesh, meta model, TP/AC/FSDP, then weights (each rank gets its shards only)
    dims = fsdptk.ParallelDims(dp_replicate=args.dp_replicate, tp=args.tp, world_size=world_size)
    dims.build_mesh(device.type)
    model = build_model(cfg, dims, args, device)
    _load_weights(model, weights, device, cpu_offload=args.cpu_offload)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    start, history = 0, {}  # history: losses of the steps before this run (saved with each checkpoint)
    if resume is not None:
        load_optimizer(weights, model, opt, torch.device("cpu") if args.cpu_offload else device)
        state = read_train_state(weights)
        start, result.resumed_from, result.checkpoint = state["step"], state["step"], str(weights)
        history = {int(k): v for k, v in state["losses"].items()}
    if rank == 0:
        how = f"resumed from {weights} at step {start}" if resume else f"starting from {weights}"
        print(f"[train] {how}; world {world_size} (dp_replicate {dims.dp_replicate}, dp_shard {dims.dp_shard}, "
              f"tp {dims.tp}) on {device.type}; {sum(p.numel() for p in model.parameters()):,} parameters", flush=True)

    # 3. data: the batch of step s is fixed by (seed, s), so resuming needs no loader state
    train_data, val_data = load_corpus(args.corpus)
    dataset, val = ByteWindows(train_data, args.seq_len), ByteWindows(val_data, args.seq_len)
    batches = StepBatches(dataset, args.batch_size, dp_size=dims.dp_degree, dp_rank=dims.dp_rank, seed=args.seed)
    stop = min(args.steps, args.stop_after) if args.stop_after is not None else args.steps

    # 4. the loop
    log = _Logger(args, start)
    pending: PendingCheckpoint | None = None  # the checkpoint being written in the background
    t0, tokens, window = time.perf_counter(), 0, []
    model.train()
    for step in range(start, stop):
        lr = _lr_at(step, args)
        for group in opt.param_groups:
            group["lr"] = lr
        x, y = batches(step)
        logits = model(x.to(device))
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.to(device).flatten())
        loss.backward()
        if args.grad_clip > 0:
            _clip_grad_norm(list(model.parameters()), args.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        tokens += x.numel() * dims.dp_degree
        done = step + 1
        result.losses[done] = _mean_over_ranks(loss).item()
        window.append(result.losses[done])
        log.step(result.losses[done], lr)
        if done % args.log_every == 0 or done == stop:
            dt = time.perf_counter() - t0
            peaks = [None] * world_size
            dist.all_gather_object(peaks, round(_peak_memory_mb(device), 1))
            kind = "allocated" if device.type == "cuda" else "RSS"
            log.print(f"step {done:5d}/{args.steps} | loss {sum(window) / len(window):.4f} (mean of "
                      f"{len(window)}) | lr {lr:.2e} | {tokens / dt:,.0f} tok/s | peak {kind} MiB per rank {peaks}")
            t0, tokens, window = time.perf_counter(), 0, []
        if done % args.save_every == 0 or done == stop:
            losses = {**history, **result.losses}
            if args.sync_save:
                t_save = time.perf_counter()
                result.checkpoint = str(save_checkpoint(ckpt_root, done, model, opt, losses, args))
                log.print(f"saved checkpoint: {result.checkpoint} (synchronous: blocked training "
                          f"{time.perf_counter() - t_save:.2f}s)")
            else:
                if pending is not None:  # one background save at a time: finish the previous one
                    result.checkpoint = _finish(pending, log)
                pending = start_checkpoint(ckpt_root, done, model, opt, losses, args)
                log.print(f"checkpoint of step {done}: blocked training {pending.blocked_s:.2f}s, "
                          "writing in the background")
    if pending is not None:
        result.checkpoint = _finish(pending, log)
    log.close()
    result.final_step = max(start, stop)

    # 5. summary
    model.eval()
    result.val_loss = _val_loss(model, val, dims, args.batch_size, device)
    result.model = model
    if rank == 0:
        if result.losses:
            first, last = min(result.losses), max(result.losses)
            print(f"[train] loss {result.losses[first]:.4f} (step {first}) -> {result.losses[last]:.4f} "
                  f"(step {last}); validation loss {result.val_loss:.4f}", flush=True)
        else:
            print(f"[train] nothing to do: already at step {start}/{args.steps}; validation loss of the "
                  f"loaded model {result.val_loss:.4f} (pass a larger --steps to train on)", flush=True)
        if result.final_step < args.steps:
            print(f"[train] stopped at step {result.final_step}/{args.steps}; run again to resume", flush=True)
        print(f"[train] checkpoint: {result.checkpoint}", flush=True)
    return result


def _finish(pending: PendingCheckpoint, log: _Logger) -> str:
    """Wait for a background checkpoint (every rank), rename it into place, log its times."""
    t = time.perf_counter()
    path = pending.finish()
    log.print(f"saved checkpoint: {path} (step {pending.step}: blocked training {pending.blocked_s:.2f}s, "
              f"the save took {pending.seconds:.2f}s, {time.perf_counter() - t:.2f}s spent waiting for it)")
    return str(path)


def main(argv: list[str] | None = None) -> RunResult:
    """Parse ``argv``, join (or create) the process group, train, and return the results."""
    args = parse_args(argv)
    created = _init_distributed(args.device)
    try:
        return train(args)
    finally:
        if created:
            dist.barrier()  # nobody tears down gloo while a peer is still in a collective
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
