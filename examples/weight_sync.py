"""Stream an FSDP2 trainer's weights into a separate inference process: the loop of an RL trainer.

Run (CPU, gloo, no downloads; the script starts every process itself)::

    python examples/weight_sync.py                         # 2 trainer ranks + 1 inference process
    python examples/weight_sync.py --steps 12 --sync-every 3

Reinforcement-learning trainers (GRPO, PPO, online DPO) push the policy's weights to an inference
engine after every few optimizer steps. This script runs that loop end to end with three processes:

- **the trainer world** (ranks 0 and 1, one gloo process group of 2): a tiny transformers Llama built
  on ``meta`` from a config (``fsdptk.hf.hf_meta_model``), sharded with ``fsdptk.shard_model`` (one
  FSDP2 unit per decoder layer), its initial weights scattered from rank 0
  (``load_from_full_model_state_dict(..., broadcast_from_rank0=True)``), trained with AdamW on random
  tokens (a fixed batch per rank);
- **the inference process**: a plain transformers model built from the same config (random weights
  until the first sync), outside the trainer world, as an inference engine is;
- **the transfer channel**: a second, separate gloo group of 2 (trainer rank 0 and the inference
  process, with a store of its own), as vLLM's NCCL weight-transfer engine opens its own group
  between the trainer's rank 0 and the engine's workers. The trainer world never sees it.

Each sync (the initial weights, then every ``--sync-every`` steps and after the last one):

1. every trainer rank iterates ONE ``fsdptk.hf.weight_source(model, track_changes=True)`` made
   before training (each pass reflects the current weights). With ``owners=1`` rank 0 owns every
   name: rank 1 only drives the iterator (its shards travel point to point to rank 0) and rank 0
   sends on the channel. The first sync is ``source.iter_full()``: the metadata (names, dtypes,
   shapes: what vLLM's ``update_weights`` request carries), then each full tensor as it comes. Every
   later sync is ``source.iter_patches()``: only the elements whose bits changed since the last
   sync, as ``SparseWeightPatch(name, indices, values, full_shape)`` records in the Hub checkpoint's
   coordinates; rank 0 collects them, sends their names, dtypes and counts (what vLLM's sparse
   engine's update info carries), then each patch's int32 indices and values;
2. the inference process receives them: the full tensors are loaded with
   ``load_state_dict(strict=True)`` (Hub names: for a Llama the module's own), each patch is applied
   in place with ``index_copy_`` into the flat parameter of its name (as vLLM applies one); it then
   generates a few tokens greedily;
3. the trainer ranks run the sharded model's forward on a probe batch (FSDP gathers the weights),
   rank 0 sends those logits, and the inference process checks that its own logits on the probe are
   equal, bit for bit. It answers ok or not; on "not ok" every trainer rank exits with 1, and so do
   the inference process and this script.

Each side prints, per sync, how many elements it sent or applied out of the model's total. The
weights travel in float32 (the logits are compared bit for bit), where an AdamW step changes
nearly every element; with ``dtype=torch.bfloat16`` on the wire a step changes a fraction of them
(docs/weight_sync.md, "Only what changed").

See docs/weight_sync.md for the protocol, ``owners``, memory and failures.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import socket
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["main", "parse_args", "Channel"]

_TIMEOUT = datetime.timedelta(seconds=60)  # a peer that does not answer fails the run, never hangs it


# ----------------------------------------------------------------------------------------------
# arguments and the shared model config
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line (``argv=None`` reads ``sys.argv``)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=6, help="optimizer steps")
    p.add_argument("--sync-every", type=int, default=2, help="stream the weights after every N steps")
    p.add_argument("--trainer-ranks", type=int, default=2, help="ranks of the trainer world (FSDP)")
    p.add_argument("--new-tokens", type=int, default=4, help="tokens the inference process generates")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds before the script gives up")
    args = p.parse_args(argv)
    for name in ("steps", "sync_every", "trainer_ranks", "new_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def _config(args: argparse.Namespace) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                       num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                       vocab_size=256, pad_token_id=0, bos_token_id=1, eos_token_id=None)


def _probe() -> torch.Tensor:
    """The batch both sides compute logits on (the same on every process)."""
    return torch.randint(3, 256, (2, 12), generator=torch.Generator().manual_seed(1234))


# ----------------------------------------------------------------------------------------------
# the transfer channel: a gloo group of 2 of its own (trainer rank 0 = 0, inference = 1)
@dataclass
class Channel:
    """Point-to-point messages to the one peer of a 2-process group outside the trainer world."""

    group: Any  # dist.ProcessGroupGloo
    peer: int

    @classmethod
    def open(cls, port: int, rank: int) -> Channel:
        """Join the 2-process group on ``port`` (rank 0 hosts its store)."""
        store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=_TIMEOUT)
        return cls(dist.ProcessGroupGloo(store, rank, 2, _TIMEOUT), 1 - rank)

    def send(self, tensor: torch.Tensor) -> None:
        self.group.send([tensor.contiguous()], self.peer, 0).wait()

    def recv(self, tensor: torch.Tensor) -> torch.Tensor:
        self.group.recv([tensor], self.peer, 0).wait()
        return tensor

    def send_json(self, obj: Any) -> None:
        data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
        self.send(torch.tensor([data.numel()], dtype=torch.int64))
        self.send(data)

    def recv_json(self) -> Any:
        size = int(self.recv(torch.zeros(1, dtype=torch.int64)))
        return json.loads(bytes(self.recv(torch.empty(size, dtype=torch.uint8)).tolist()))


# ----------------------------------------------------------------------------------------------
# the trainer (every rank of the trainer world)
def _build_trainer_model(args: argparse.Namespace) -> Any:
    """Meta build -> FSDP2 -> weights from rank 0 (each rank receives only its shards)."""
    from transformers import AutoModelForCausalLM

    import fsdptk
    from fsdptk.hf import hf_meta_model, no_split_modules

    config = _config(args)
    model = hf_meta_model(config)
    fsdptk.shard_model(model, no_split_modules(model), cpu_offload=False)
    full_sd: dict[str, torch.Tensor] = {}
    if dist.get_rank() == 0:
        torch.manual_seed(0)
        full_sd = AutoModelForCausalLM.from_config(config).state_dict()
    fsdptk.load_from_full_model_state_dict(model, full_sd, "cpu", strict=True, broadcast_from_rank0=True)
    return model


def _send_full(source: Any, channel: Channel | None, step: int) -> tuple[int, int, int]:
    """Stream ``source.iter_full()``: the metadata first, then each tensor as it arrives. Returns
    (tensors, elements, bytes) sent."""
    if channel is not None:  # the metadata first: names, dtypes and shapes, in iteration order
        channel.send_json({"step": step, "mode": "full",
                           "params": [[m.name, str(m.dtype).removeprefix("torch."), list(m.shape)]
                                      for m in source.metadata]})
    sent, elements, nbytes = 0, 0, 0
    for _name, tensor in source.iter_full():  # every rank drives it; only rank 0 (the owner) gets tensors
        if channel is not None:
            channel.send(tensor)
            sent, elements = sent + 1, elements + tensor.numel()
            nbytes += tensor.numel() * tensor.element_size()
    return sent, elements, nbytes


def _send_patches(source: Any, channel: Channel | None, step: int) -> tuple[int, int, int]:
    """Collect ``source.iter_patches()`` (only what changed since the last sync), then send the
    patches' names, dtypes and counts, and each patch's indices and values. Returns (patches,
    elements, bytes) sent."""
    # every rank drives it; only rank 0 (the owner) gets patches. The pass completes here, so the source
    # takes the engine as holding them: were a send below to fail, the next sync would be iter_full
    patches = list(source.iter_patches())
    if channel is None:
        return 0, 0, 0
    channel.send_json({"step": step, "mode": "patches",
                       "patches": [[p.name, str(p.values.dtype).removeprefix("torch."), p.indices.numel()]
                                   for p in patches]})
    elements, nbytes = 0, 0
    for p in patches:
        channel.send(p.indices)  # int32, strictly ascending flat indices into the full Hub tensor
        channel.send(p.values)
        elements += p.indices.numel()
        nbytes += p.indices.numel() * p.indices.element_size() + p.values.numel() * p.values.element_size()
    return len(patches), elements, nbytes


def _push_weights(model: Any, source: Any, channel: Channel | None, step: int, full: bool) -> bool:
    """One sync: ``source.iter_full()`` (``full``) or ``source.iter_patches()`` to the inference
    process, then compare logits."""
    t0 = time.perf_counter()
    sent, elements, nbytes = (_send_full if full else _send_patches)(source, channel, step)
    model.eval()
    with torch.no_grad():
        logits = model(_probe()).logits  # the sharded model's forward: FSDP gathers the weights
    model.train()
    ok = torch.zeros(1, dtype=torch.int32)
    if channel is not None:
        channel.send(logits)
        channel.recv(ok)
        total = sum(math.prod(m.shape) for m in source.metadata)
        print(f"[trainer] step {step}: sent {sent} {'tensors' if full else 'patches'}, {elements} of {total} "
              f"elements ({nbytes / 2**20:.2f} MiB) in {time.perf_counter() - t0:.3f} s", flush=True)
    dist.broadcast(ok, src=0)  # the inference process's verdict, on every trainer rank
    return bool(ok.item())


def _trainer(rank: int, args: argparse.Namespace, ports: tuple[int, int]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports[0]}", rank=rank,
                            world_size=args.trainer_ranks, timeout=_TIMEOUT)
    import fsdptk.hf

    channel = Channel.open(ports[1], 0) if rank == 0 else None
    model = _build_trainer_model(args)
    # owners=1: rank 0 owns every name (vLLM's broadcast engines); track_changes: a baseline for patches
    source = fsdptk.hf.weight_source(model, track_changes=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    # each rank its own fixed batch of random tokens: the loss falls as the model memorises it
    batch = torch.randint(3, 256, (4, 16), generator=torch.Generator().manual_seed(100 + rank))
    ok = _push_weights(model, source, channel, 0, full=True)  # the first sync: everything
    for step in range(1, args.steps + 1):
        if not ok:
            break
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0:
            print(f"[trainer] step {step}: loss {loss.item():.4f}", flush=True)
        if step % args.sync_every == 0 or step == args.steps:
            ok = _push_weights(model, source, channel, step, full=False)  # only what changed
    if channel is not None:
        channel.send_json({"stop": True})
    dist.barrier()  # nobody tears down gloo while a peer is still in a collective
    dist.destroy_process_group()
    if not ok:
        sys.exit(1)


# ----------------------------------------------------------------------------------------------
# the inference process (outside the trainer world)
def _load_full(model: Any, channel: Channel, header: dict[str, Any]) -> str:
    """Receive every tensor of a full sync and load them all; returns what was done, for the log."""
    received = {name: channel.recv(torch.empty(shape, dtype=getattr(torch, dtype)))
                for name, dtype, shape in header["params"]}
    model.load_state_dict(received, strict=True)  # Hub names = the module's names for a Llama
    total = sum(t.numel() for t in model.state_dict().values())
    elements = sum(t.numel() for t in received.values())
    return f"loaded {len(received)} tensors, {elements} of {total} elements"


def _apply_patches(model: Any, channel: Channel, header: dict[str, Any]) -> str:
    """Receive each patch (int32 flat indices, values) and copy it into the flat tensor of its Hub
    name, in place, as vLLM applies a ``SparseWeightPatch``; returns what was done, for the log."""
    state = model.state_dict()  # Hub names = the module's names for a Llama; these share the parameters' memory
    elements = 0
    for name, dtype, count in header["patches"]:
        target = state[name]
        indices = channel.recv(torch.empty(count, dtype=torch.int32))
        values = channel.recv(torch.empty(count, dtype=getattr(torch, dtype)))
        with torch.no_grad():  # index_copy_ refuses another dtype or an index out of range
            target.view(-1).index_copy_(0, indices.long(), values)
        elements += count
    total = sum(t.numel() for t in state.values())
    return f"patched {len(header['patches'])} tensors, {elements} of {total} elements"


def _inference(args: argparse.Namespace, ports: tuple[int, int]) -> None:
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM

    channel = Channel.open(ports[1], 1)
    torch.manual_seed(123)  # NOT the trainer's weights: everything it knows comes from the syncs
    model = AutoModelForCausalLM.from_config(_config(args)).eval()
    probe, syncs, failed = _probe(), 0, False
    while True:
        header = channel.recv_json()
        if header.get("stop"):
            break
        if header["mode"] == "full":
            applied = _load_full(model, channel, header)
        else:
            applied = _apply_patches(model, channel, header)
        with torch.no_grad():
            logits = model(probe).logits
            tokens = model.generate(probe[:1], max_new_tokens=args.new_tokens, do_sample=False)
        theirs = channel.recv(torch.empty_like(logits))
        same = torch.equal(logits, theirs)
        verdict = ("equal to" if same else
                   f"DIFFERENT (max |diff| {(logits - theirs).abs().max().item():.3g}) from")
        print(f"[inference] step {header['step']}: {applied}; logits {verdict} the trainer's; greedy "
              f"continuation {tokens[0, probe.shape[1]:].tolist()}", flush=True)
        channel.send(torch.tensor([int(same)], dtype=torch.int32))
        syncs, failed = syncs + 1, failed or not same
    if failed:
        sys.exit(1)
    print(f"[inference] {syncs} syncs, the logits equal after each", flush=True)


# ----------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(argv: list[str] | None = None) -> int:
    """Start the trainer ranks and the inference process; 0 when every process succeeded."""
    args = parse_args(argv)
    ports = (_free_port(), _free_port())
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_trainer, args=(r, args, ports), name=f"trainer rank {r}")
             for r in range(args.trainer_ranks)]
    procs.append(ctx.Process(target=_inference, args=(args, ports), name="inference"))
    for p in procs:
        p.start()
    deadline = time.monotonic() + args.timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():  # only this script's own children
            p.terminate()
            p.join()
            print(f"[weight_sync] {p.name} did not finish within {args.timeout:.0f} s", flush=True)
    failed = [f"{p.name} (exit code {p.exitcode})" for p in procs if p.exitcode != 0]
    if failed:
        print(f"[weight_sync] FAILED: {', '.join(failed)}", flush=True)
        return 1
    print("[weight_sync] OK", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
