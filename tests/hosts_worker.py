"""One rank of a multi-host run (started by ``torchrun`` on simulated hosts, fsdptk.testing.hosts).

``python hosts_worker.py SPEC.json``: joins the process group torchrun describes, then runs the
spec's scenarios in sequence on each mesh, for each method. Around every step: a barrier, local
rank 0 of each host reads its host's link counters (``/sys`` of the host's own namespace; all ranks
of a host share the link), a barrier, the timed step, a barrier, the counters again. Each rank
writes ``rank<r>.json`` into the spec's ``out_dir``: per step the seconds, the check (``"ok"`` or
what differs from the single-process reference) and, on local rank 0, the link counters before and
after. Correctness is bit-exact against the reference state each rank rebuilds from the seed.

A step may return a callable instead of a check string: it runs after the counters are read
(checks that communicate, such as a sharded forward for the logits, stay out of the measurement).

Used by tests/test_hosts.py and ``python -m benchmarks hosts``. Methods on the ``layers`` x
Linear(dim, dim) model: ``fsdptk``, ``dcp`` (PyTorch's state-dict API), ``accelerate`` (its FSDP2
functions: ``fsdp2_load_full_state_dict``, ``Accelerator.get_state_dict``, ``save_model``). On
the Hugging Face model of ``hf_ckpt``: ``transformers`` (``from_pretrained(distributed_config=...)``,
``save_pretrained``) and ``fsdptk-hf`` (``fsdptk.hf.from_pretrained``, ``save_safetensors``). A
method skips the scenarios it has no call for. Spec keys: ``layers``, ``dim``, ``dtype``,
``meshes`` (``fsdp``, ``hsdp``), ``scenarios`` (``noop``, ``load``, ``shard_on_read``, ``gather``,
``save``, ``save_host`` (one writer per host), ``stream_host`` (a weight source, one owner per host), ``optim_load``, ``optim_gather``, ``kill_load``), ``methods``, ``repeats``, ``ckpt`` (a
directory with ``{host}`` in it: each host's own copy), ``out_dir``; for the HF methods
``hf_ckpt`` (likewise per host) and ``hf_ref`` (a ``torch.save`` file: ``input_ids`` and the
single-process ``logits``). A spec with ``runs`` (a list of such specs, each with its own
``out_dir``) runs each of them in turn in the one launch: interpreters, imports and the rendezvous
are paid once (tests/test_hosts.py runs fsdptk's scenarios and the peers' this way).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from fsdptk.testing.hosts import link_stats

SEED = 1234
HF_METHODS = ("transformers", "fsdptk-hf")  # the methods that load and save the HF model
HF_VOCAB, HF_HEADS = 4096, 8  # the HF Llama of write_hf_checkpoints
LOGITS_ATOL = 1e-5  # float32 logits: sharded reductions round differently (tests/test_hf_from_pretrained.py)


def build(layers: int, dim: int, dtype: torch.dtype, device: str = "meta") -> nn.Module:
    with torch.device(device):
        return nn.Sequential(*[nn.Linear(dim, dim, dtype=dtype) for _ in range(layers)])


def reference_state(layers: int, dim: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The full state dict every rank and the single-process reference rebuild from the seed."""
    gen = torch.Generator().manual_seed(SEED)
    sd = {}
    for i in range(layers):
        sd[f"{i}.weight"] = torch.randn(dim, dim, generator=gen).to(dtype)
        sd[f"{i}.bias"] = torch.randn(dim, generator=gen).to(dtype)
    return sd


def hf_config(layers: int, dim: int):
    """The HF model: a Llama with untied embeddings (every tensor saved once), float32."""
    import transformers

    return transformers.LlamaConfig(
        hidden_size=dim, intermediate_size=3 * dim, num_hidden_layers=layers,
        num_attention_heads=HF_HEADS, num_key_value_heads=HF_HEADS, vocab_size=HF_VOCAB,
        tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2, dtype="float32")


def write_hf_checkpoints(work: Path, hosts: int, layers: int, dim: int) -> dict:
    """``save_pretrained`` of a seeded Llama, one copy per host, and the single-process logits.

    Returns the spec keys ``hf_ckpt`` and ``hf_ref`` and the checkpoint's tensor bytes.
    """
    import shutil

    import transformers

    torch.manual_seed(0)
    src = work / "host0" / "hf"
    transformers.AutoModelForCausalLM.from_config(hf_config(layers, dim)).save_pretrained(src)
    for h in range(1, hosts):
        shutil.copytree(src, work / f"host{h}" / "hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(src)  # one process: the reference
    ids = torch.randint(3, HF_VOCAB, (2, 16), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    torch.save({"input_ids": ids, "logits": logits}, work / "hf_ref.pt")
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    return {"hf_ckpt": str(work / "host{host}" / "hf"), "hf_ref": str(work / "hf_ref.pt"),
            "hf_model_bytes": nbytes}


def reference_optim(sd: dict[str, torch.Tensor]) -> dict:
    """A full AdamW state keyed by FQN (the layout of fsdptk and DCP), from the seed."""
    gen = torch.Generator().manual_seed(SEED + 1)
    state = {k: {"step": torch.tensor(3.0), "exp_avg": torch.randn(v.shape, generator=gen).to(v.dtype),
                 "exp_avg_sq": torch.rand(v.shape, generator=gen).to(v.dtype)} for k, v in sd.items()}
    group = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01, "amsgrad": False,
             "foreach": None, "maximize": False, "capturable": False, "differentiable": False,
             "fused": None, "decoupled_weight_decay": True, "params": list(sd)}
    return {"state": state, "param_groups": [group]}


def _mesh(kind: str):
    from torch.distributed.device_mesh import init_device_mesh

    world, k = dist.get_world_size(), int(os.environ["LOCAL_WORLD_SIZE"])
    if kind == "hsdp":  # rows are hosts (torchrun numbers ranks host by host): replicate across
        return init_device_mesh("cpu", (world // k, k), mesh_dim_names=("dp_replicate", "dp_shard"))
    return init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))


def sharded(spec: dict, mesh) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = build(spec["layers"], spec["dim"], getattr(torch, spec["dtype"]))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _local_ref(full: torch.Tensor, like) -> torch.Tensor:
    """This rank's slice of ``full`` for a DTensor laid out as ``like`` (local: no communication)."""
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None).to_local()


def check_shards(model: nn.Module, ref: dict[str, torch.Tensor]) -> str:
    for k, p in model.state_dict().items():
        want = _local_ref(ref[k], p)
        got = p.to_local()
        if got.dtype != want.dtype or not torch.equal(got, want):
            return f"shard of {k} differs from the reference"
    return "ok"


def read_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a saved directory (one file, or shards and an index)."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        out.update(load_file(f))
    return out


def check_full(got: dict, ref: dict[str, torch.Tensor]) -> str:
    if sorted(got) != sorted(ref):
        return f"keys differ: {sorted(set(got) ^ set(ref))[:5]}"
    for k, v in ref.items():
        if got[k].dtype != v.dtype or not torch.equal(got[k], v):
            return f"{k} differs from the reference"
    return "ok"


def check_hf_model(model: nn.Module, ref: dict[str, torch.Tensor], hf_ref: dict):
    """Every shard bit-exact (here), then the logits of a sharded forward (the returned callable:
    it all-gathers parameters, so it runs after the link counters are read)."""
    shards = "ok"
    state = model.state_dict()
    if sorted(state) != sorted(ref):
        shards = f"keys differ: {sorted(set(state) ^ set(ref))[:5]}"
    for k, p in state.items():
        if shards != "ok":
            break
        got = p.to_local() if hasattr(p, "to_local") else p
        want = _local_ref(ref[k], p) if hasattr(p, "to_local") else ref[k]
        if got.dtype != want.dtype or not torch.equal(got, want):
            shards = f"shard of {k} differs from the reference"

    def logits() -> str:  # collective: every rank runs the forward, whatever its shards said
        with torch.no_grad():
            got = model(input_ids=hf_ref["input_ids"]).logits
        diff = (got - hf_ref["logits"]).abs().max().item()
        if shards != "ok":
            return shards
        return "ok" if diff <= LOGITS_ATOL else f"logits differ from the single-process model's by {diff:.3g}"
    return logits


_ACCELERATOR: list = []


def accelerator():
    """accelerate's ``Accelerator`` in FSDP2 mode (one per process).

    accelerate sets ``DistributedType.FSDP`` only for accelerator devices (``state.py``: a CPU
    world is ``MULTI_CPU`` whatever plugin is passed), so on this CPU machine the shared state is
    switched to FSDP2 after construction: what accelerate sets itself on GPUs, so that its own
    FSDP2 branches (``get_state_dict``, ``save_model``) run unchanged.
    """
    if not _ACCELERATOR:
        from accelerate import Accelerator
        from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

        acc = Accelerator(cpu=True)
        acc.state.fsdp_plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
        acc.state.distributed_type = DistributedType.FSDP
        assert acc.is_fsdp2
        _ACCELERATOR.append(acc)
    return _ACCELERATOR[0]


def check_optim_shards(opt, model: nn.Module, ref: dict) -> str:
    names = {p: n for n, p in model.named_parameters()}
    for p, st in opt.state.items():
        for key in ("exp_avg", "exp_avg_sq"):
            want = _local_ref(ref["state"][names[p]][key], st[key])
            if not torch.equal(st[key].to_local(), want):
                return f"optimizer {key} of {names[p]} differs from the reference"
    return "ok"


def check_optim_full(got: dict, ref: dict) -> str:
    if sorted(got.get("state", {})) != sorted(ref["state"]):
        return "optimizer state keys differ"
    for k, st in ref["state"].items():
        for key, v in st.items():
            g = got["state"][k][key]
            if not torch.equal(torch.as_tensor(g).to(v.dtype), v):
                return f"optimizer {key} of {k} differs from the reference"
    return "ok"


# ---------------------------------------------------------------------------------------------
# the steps: each returns a check string; setup happens before the counters are read
class Steps:
    def __init__(self, spec: dict, mesh_kind: str, method: str) -> None:
        self.spec, self.method, self.mesh_kind = spec, method, mesh_kind
        self.rank = dist.get_rank()
        self.dtype = getattr(torch, spec["dtype"])
        self.ref = reference_state(spec["layers"], spec["dim"], self.dtype)
        self.mesh = _mesh(mesh_kind)
        self.model = None
        self.opt = None
        host_ckpt = spec["ckpt"].format(host=os.environ["FSDPTK_HOST"])
        self.ckpt = Path(host_ckpt)
        self.save_dir = Path(spec["out_dir"]) / f"save-{mesh_kind}-{method}"
        self.hf = method in HF_METHODS
        if self.hf:
            from safetensors.torch import load_file

            self.hf_ckpt = Path(spec["hf_ckpt"].format(host=os.environ["FSDPTK_HOST"]))
            self.hf_state = load_file(self.hf_ckpt / "model.safetensors")
            self.hf_ref = torch.load(spec["hf_ref"], weights_only=True)
            # imported here, untimed: the first timed load would otherwise pay transformers' lazy imports
            import transformers.distributed.fsdp  # noqa: F401
            import transformers.models.llama.modeling_llama  # noqa: F401

            import fsdptk.hf  # noqa: F401

    def fresh_model(self) -> nn.Module:
        self.model = sharded(self.spec, self.mesh)
        return self.model

    def loaded_model(self) -> nn.Module:
        """A model holding the reference values (loaded untimed by shard-on-read: no traffic)."""
        from fsdptk import load_safetensors

        model = self.fresh_model()
        load_safetensors(model, self.ckpt, shard_on_read=True, strict=True)
        return model

    def optimizer(self, model: nn.Module):
        return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)

    # setups return the callable to time
    def setup(self, scenario: str):
        """The callable to time, or ``None`` where the method has no call for the scenario."""
        if scenario == "noop":
            return self.setup_noop()
        if self.hf:
            return getattr(self, f"setup_hf_{scenario}", lambda: None)()
        if self.method == "accelerate":
            return getattr(self, f"setup_accelerate_{scenario}", lambda: None)()
        return getattr(self, f"setup_{scenario}")()

    # accelerate 1.15, FSDP2 (accelerate/utils/fsdp_utils.py, accelerator.py); the Linear model
    def setup_accelerate_load(self):
        from accelerate.utils.fsdp_utils import fsdp2_load_full_state_dict

        acc = accelerator()
        model = self.fresh_model()
        full = dict(self.ref) if self.rank == 0 else {}

        def run():
            fsdp2_load_full_state_dict(acc, model, full)  # a world broadcast, then distribute_tensor
            return check_shards(model, self.ref)
        return run

    def setup_accelerate_gather(self):
        acc = accelerator()
        model = self.loaded_model()

        def run():
            got = acc.get_state_dict(model)  # FSDP2: get_model_state_dict(full_state_dict, cpu_offload)
            return check_full(got, self.ref) if self.rank == 0 else ("ok" if not got else "non-empty")
        return run

    def setup_accelerate_save(self):
        acc = accelerator()
        model = self.loaded_model()
        out = self.save_dir

        def run():
            acc.save_model(model, out, safe_serialization=True)  # get_state_dict, then rank 0 writes
            if self.rank:
                return "ok"
            from safetensors.torch import load_file

            return check_full(load_file(out / "model.safetensors"), self.ref)
        return run

    # the HF model: transformers' distributed path and fsdptk.hf on the same checkpoint
    def _hf_load(self):
        """The timed load of the HF model from this host's own copy (shard-on-read for both)."""
        world, k = dist.get_world_size(), int(os.environ["LOCAL_WORLD_SIZE"])
        hsdp = self.mesh_kind == "hsdp"
        if self.method == "transformers":
            import transformers
            from transformers.distributed import DistributedConfig

            config = DistributedConfig(fsdp_size=k if hsdp else world, dp_replicate_size=world // k if hsdp else 1)
            return transformers.AutoModelForCausalLM.from_pretrained(self.hf_ckpt, distributed_config=config)
        from fsdptk import ParallelDims
        from fsdptk.hf import from_pretrained

        dims = ParallelDims(dp_replicate=world // k, dp_shard=k) if hsdp else None
        return from_pretrained(self.hf_ckpt, dims=dims)

    def setup_hf_shard_on_read(self):
        def run():
            return check_hf_model(self._hf_load(), self.hf_state, self.hf_ref)
        return run

    def setup_hf_save(self):
        model = self._hf_load()  # untimed; reads this host's copy: no traffic
        out = self.save_dir
        if self.method == "transformers":
            def save():
                model.save_pretrained(out)  # FSDP: gather_full_state_dict, then rank 0 writes
        else:
            from fsdptk import save_safetensors

            def save():
                save_safetensors(model, out, progress=False)

        def run():
            save()
            if self.rank:
                return "ok"
            from safetensors.torch import load_file

            return check_full(load_file(out / "model.safetensors"), self.hf_state)
        return run

    def setup_noop(self):
        return lambda: "ok"

    def setup_load(self):
        model = self.fresh_model()
        full = dict(self.ref) if self.rank == 0 else {}
        if self.method == "fsdptk":
            from fsdptk import load_from_full_model_state_dict

            def run():
                load_from_full_model_state_dict(model, full, "cpu", strict=True, broadcast_from_rank0=True)
                return check_shards(model, self.ref)
        else:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                set_model_state_dict,
            )

            model.to_empty(device="cpu")

            def run():
                set_model_state_dict(model, full, options=StateDictOptions(
                    full_state_dict=True, broadcast_from_rank0=True))
                return check_shards(model, self.ref)
        return run

    def setup_shard_on_read(self):
        if self.method != "fsdptk":
            return None
        from fsdptk import load_safetensors

        model = self.fresh_model()

        def run():
            load_safetensors(model, self.ckpt, shard_on_read=True, strict=True)
            return check_shards(model, self.ref)
        return run

    def setup_gather(self):
        model = self.loaded_model()
        if self.method == "fsdptk":
            from fsdptk import gather_cpu_state_dict

            def get():
                return gather_cpu_state_dict(model, self.rank == 0)
        else:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                get_model_state_dict,
            )

            def get():
                return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                            cpu_offload=True))

        def run():
            got = get()
            return check_full(got, self.ref) if self.rank == 0 else ("ok" if not got else "non-empty")
        return run

    def setup_save_host(self):
        """``save_safetensors(writers="host")``: one writer per host, each gathering and writing
        about 1/H of the files (fsdptk only)."""
        return self.setup_save(writers="host") if self.method == "fsdptk" else None

    def setup_stream_host(self):
        """``fsdptk.hf.weight_source(owners="host")``: the first rank of each host owns about 1/H of
        the tensors and streams them whole (``iter_full``), each gathered to its owner only, as the
        save with one writer per host gathers (fsdptk only)."""
        if self.method != "fsdptk":
            return None
        from fsdptk.hf import weight_source

        model = self.loaded_model()
        source = weight_source(model, conversion=None, owners="host")
        world, local = dist.get_world_size(), int(os.environ["LOCAL_RANK"])

        def run():
            got = dict(source.iter_full())
            mine = source.owned_names(self.rank)
            owners = {r for r in range(world) if source.owned_names(r)}
            if sorted(got) != sorted(mine):
                return f"rank {self.rank} yielded {sorted(got)[:3]} but owns {sorted(mine)[:3]}"
            if (local == 0) != bool(mine) or len(owners) != world // int(os.environ["LOCAL_WORLD_SIZE"]):
                return f"owners are ranks {sorted(owners)}: not the first rank of each host"
            if sorted(n for r in owners for n in source.owned_names(r)) != sorted(self.ref):
                return "the owners' names are not every tensor once"
            return check_full(got, {k: self.ref[k] for k in mine})
        return run

    def setup_save(self, writers: int | str = 1):
        model = self.loaded_model()
        out = self.save_dir

        if self.method == "fsdptk":
            from fsdptk import save_safetensors

            def save():
                save_safetensors(model, out, progress=False, writers=writers)
        else:
            from safetensors.torch import save_file
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                get_model_state_dict,
            )

            def save():
                sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                          cpu_offload=True))
                if self.rank == 0:
                    out.mkdir(parents=True, exist_ok=True)
                    save_file(sd, out / "model.safetensors", metadata={"format": "pt"})

        def run():
            save()
            if self.rank:
                return "ok"
            return check_full(read_checkpoint(out), self.ref)
        return run

    def setup_optim_load(self):
        model = self.loaded_model()
        opt = self.optimizer(model)
        ref = reference_optim(self.ref)
        full = ref if self.rank == 0 else {}
        if self.method == "fsdptk":
            from fsdptk import load_from_full_optimizer_state_dict

            def load():
                load_from_full_optimizer_state_dict(model, opt, full, "cpu", broadcast_from_rank0=True)
        else:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                set_optimizer_state_dict,
            )

            def load():
                set_optimizer_state_dict(model, opt, full, options=StateDictOptions(
                    full_state_dict=True, broadcast_from_rank0=True))

        def run():
            load()
            return check_optim_shards(opt, model, ref)
        return run

    def setup_optim_gather(self):
        model = self.loaded_model()
        opt = self.optimizer(model)
        ref = reference_optim(self.ref)
        from fsdptk import load_from_full_optimizer_state_dict

        # each rank holds the full state: no traffic for tensor data, and outside the window
        load_from_full_optimizer_state_dict(model, opt, ref, "cpu")
        if self.method == "fsdptk":
            from fsdptk import get_full_optimizer_state_dict

            def get():
                return get_full_optimizer_state_dict(model, opt, self.rank == 0)
        else:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                get_optimizer_state_dict,
            )

            def get():
                return get_optimizer_state_dict(model, opt, options=StateDictOptions(
                    full_state_dict=True, cpu_offload=True))

        def run():
            got = get()
            return check_optim_full(got, ref) if self.rank == 0 else "ok"
        return run


def _counters() -> dict | None:
    if os.environ.get("LOCAL_RANK") != "0":
        return None
    return link_stats().__dict__


def measured(fn) -> dict:
    """Run ``fn`` between barriers, with this host's link counters read before and after."""
    dist.barrier()
    before = _counters()
    dist.barrier()
    t0 = time.perf_counter()
    try:
        check = fn()
    except Exception as e:  # noqa: BLE001 - recorded, then the run goes on
        check = f"error: {type(e).__name__}: {e}"
    seconds = time.perf_counter() - t0
    dist.barrier()
    after = _counters()
    if callable(check):  # a check that communicates: outside the measurement
        try:
            check = check()
        except Exception as e:  # noqa: BLE001
            check = f"error in the check: {type(e).__name__}: {e}"
    return {"seconds": seconds, "check": check, "before": before, "after": after}


def kill_load(spec: dict, out: Path) -> None:
    """Load in a loop until a host dies; record what this rank raised and when."""
    from fsdptk import load_from_full_model_state_dict

    steps = Steps(spec, "fsdp", "fsdptk")
    model = steps.fresh_model()
    full = steps.ref if steps.rank == 0 else {}
    marker = Path(spec["out_dir"]) / f"loading-rank{steps.rank}"
    n = 0
    try:
        while True:
            load_from_full_model_state_dict(model, dict(full), "cpu", broadcast_from_rank0=True)
            n += 1
            if n == 1:
                marker.write_text(os.environ["FSDPTK_HOST"])
    except BaseException as e:  # noqa: BLE001 - what the survivors raise is the result
        rec = {"rank": steps.rank, "host": int(os.environ["FSDPTK_HOST"]), "loads": n,
               "raised_at": time.time(), "exc_type": type(e).__name__, "message": str(e)[:4000],
               "traceback": traceback.format_exc()[-4000:]}
        out.write_text(json.dumps(rec, indent=1))
        os._exit(0)  # a clean exit: torchrun must not kill this host's other rank before it writes


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    import faulthandler
    import signal

    stacks = open(Path(spec["out_dir"]) / f"stacks-rank{os.environ['RANK']}.txt", "w")  # noqa: SIM115
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)  # for a hung rank
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if spec.get("scenarios") == ["kill_load"]:
        kill_load(spec, Path(spec["out_dir"]) / f"rank{rank}.json")
        return 0
    for run in spec.get("runs", [spec]):
        scenarios(run, rank)
    dist.barrier()
    os._exit(0)  # no destroy_process_group: gloo's teardown can abort at exit (benchmarks/worker.py)


def scenarios(spec: dict, rank: int) -> None:
    """Every scenario of ``spec`` on each of its meshes, for each method; ``rank<r>.json`` into
    its ``out_dir``."""
    out = Path(spec["out_dir"]) / f"rank{rank}.json"
    records = []
    for mesh_kind in spec["meshes"]:
        for rep in range(spec.get("repeats", 1)):
            for method in spec["methods"]:
                steps = Steps(spec, mesh_kind, method)
                for scenario in spec["scenarios"]:
                    base = {"mesh": mesh_kind, "method": method, "scenario": scenario, "repeat": rep,
                            "rank": rank, "host": int(os.environ["FSDPTK_HOST"])}
                    fn = steps.setup(scenario)
                    if fn is None:
                        continue
                    records.append({**base, **measured(fn)})
                    steps.model = steps.opt = None
    out.write_text(json.dumps(records))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
