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

1. every trainer rank iterates ``source.iter_full()`` of ONE ``fsdptk.hf.weight_source(model)``
   made before training (each pass reflects the current weights). With ``owners=1`` rank 0 owns
   every name: rank 1 only drives the iterator (its shards travel point to point to rank 0) and rank
   0 sends each full tensor on the channel as it comes, after the metadata (names, dtypes, shapes:
   what vLLM's ``update_weights`` request carries);
2. the inference process receives each tensor, loads them all with ``load_state_dict(strict=True)``
   (Hub names: for a Llama the module's own), and generates a few tokens greedily;
3. the trainer ranks run the sharded model's forward on a probe batch (FSDP gathers the weights),
   rank 0 sends those logits, and the inference process checks that its own logits on the probe are
   equal, bit for bit. It answers ok or not; on "not ok" every trainer rank exits with 1, and so do
   the inference process and this script.

See docs/weight_sync.md for the protocol, ``owners``, memory and failures.
"""

from __future__ import annotations

import argparse
import datetime
import json
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


def _push_weights(model: Any, source: Any, channel: Channel | None, step: int) -> bool:
    """One sync: stream ``source.iter_full()`` to the inference process, then compare logits."""
    t0 = time.perf_counter()
    if channel is not None:  # the metadata first: names, dtypes and shapes, in iteration order
        channel.send_json({"step": step, "params": [[m.name, str(m.dtype).removeprefix("torch."), list(m.shape)]
                                                    for m in source.metadata]})
    sent, nbytes = 0, 0
    for _name, tensor in source.iter_full():  # every rank drives it; only rank 0 (the owner) gets tensors
        if channel is not None:
            channel.send(tensor)
            sent, nbytes = sent + 1, nbytes + tensor.numel() * tensor.element_size()
    model.eval()
    with torch.no_grad():
        logits = model(_probe()).logits  # the sharded model's forward: FSDP gathers the weights
    model.train()
    ok = torch.zeros(1, dtype=torch.int32)
    if channel is not None:
        channel.send(logits)
        channel.recv(ok)
        print(f"[trainer] step {step}: sent {sent} tensors ({nbytes / 2**20:.2f} MiB) in "
              f"{time.perf_counter() - t0:.3f} s", flush=True)
    dist.broadcast(ok, src=0)  # the inference process's verdict, on every trainer rank
    return bool(ok.item())


def _trainer(rank: int, args: argparse.Namespace, ports: tuple[int, int]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports[0]}", rank=rank,
                            world_size=args.trainer_ranks, timeout=_TIMEOUT)
    import fsdptk.hf

    channel = Channel.open(ports[1], 0) if rank == 0 else None
    model = _build_trainer_model(args)
    source = fsdptk.hf.weight_source(model)  # owners=1: rank 0 owns every name (vLLM's broadcast engines)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    # each rank its own fixed batch of random tokens: the loss falls as the model memorises it
    batch = torch.randint(3, 256, (4, 16), generator=torch.Generator().manual_seed(100 + rank))
    ok = _push_weights(model, source, channel, 0)
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
            ok = _push_weights(model, source, channel, step)
    if channel is not None:
        channel.send_json({"stop": True})
    dist.barrier()  # nobody tears down gloo while a peer is still in a collective
    dist.destroy_process_group()
    if not ok:
        sys.exit(1)


# ----------------------------------------------------------------------------------------------
# the inference process (outside the trainer world)
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
        received = {name: channel.recv(torch.empty(shape, dtype=getattr(torch, dtype)))
                    for name, dtype, shape in header["params"]}
        model.load_state_dict(received, strict=True)  # Hub names = the module's names for a Llama
        with torch.no_grad():
            logits = model(probe).logits
            tokens = model.generate(probe[:1], max_new_tokens=args.new_tokens, do_sample=False)
        theirs = channel.recv(torch.empty_like(logits))
        same = torch.equal(logits, theirs)
        verdict = ("equal to" if same else
                   f"DIFFERENT (max |diff| {(logits - theirs).abs().max().item():.3g}) from")
        print(f"[inference] step {header['step']}: loaded {len(received)} tensors; logits {verdict} the "
              f"trainer's; greedy continuation {tokens[0, probe.shape[1]:].tolist()}", flush=True)
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
