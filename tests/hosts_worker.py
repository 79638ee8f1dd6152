"""One rank of a multi-host run (started by ``torchrun`` on simulated hosts, fsdptk.testing.hosts).

``python hosts_worker.py SPEC.json``: joins the process group torchrun describes, then runs the
spec's scenarios in sequence on each mesh, for each method. Around every step: a barrier, local
rank 0 of each host reads its host's link counters (``/sys`` of the host's own namespace; all ranks
of a host share the link), a barrier, the timed step, a barrier, the counters again. Each rank
writes ``rank<r>.json`` into the spec's ``out_dir``: per step the seconds, the check (``"ok"`` or
what differs from the single-process reference) and, on local rank 0, the link counters before and
after. Correctness is bit-exact against the reference state each rank rebuilds from the seed.

Used by tests/test_hosts.py (methods ``fsdptk``) and ``python -m benchmarks hosts`` (``fsdptk``
and ``dcp``). Spec keys: ``layers``, ``dim`` (the model: ``layers`` x Linear(dim, dim)),
``dtype``, ``meshes`` (``fsdp``, ``hsdp``), ``scenarios`` (``noop``, ``load``, ``shard_on_read``,
``gather``, ``save``, ``optim_load``, ``optim_gather``, ``kill_load``), ``methods``, ``repeats``,
``ckpt`` (a directory with ``{host}`` in it: each host's own copy), ``out_dir``.
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


def check_full(got: dict, ref: dict[str, torch.Tensor]) -> str:
    if sorted(got) != sorted(ref):
        return f"keys differ: {sorted(set(got) ^ set(ref))[:5]}"
    for k, v in ref.items():
        if got[k].dtype != v.dtype or not torch.equal(got[k], v):
            return f"{k} differs from the reference"
    return "ok"


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
        return getattr(self, f"setup_{scenario}")()

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

    def setup_save(self):
        model = self.loaded_model()
        out = self.save_dir

        if self.method == "fsdptk":
            from fsdptk import save_safetensors

            def save():
                save_safetensors(model, out, progress=False)
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
            from safetensors.torch import load_file

            return check_full(load_file(out / "model.safetensors"), self.ref)
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
    return {"seconds": seconds, "check": check, "before": before, "after": _counters()}


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
    out = Path(spec["out_dir"]) / f"rank{rank}.json"
    if spec["scenarios"] == ["kill_load"]:
        kill_load(spec, out)
        return 0
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
    dist.barrier()
    os._exit(0)  # no destroy_process_group: gloo's teardown can abort at exit (benchmarks/worker.py)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
