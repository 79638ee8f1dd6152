"""Optimizer-state scenarios (AdamW): gather the full state on rank 0, load a full state; all libraries."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from .common import Ctx, all_sum, check_full_on_rank0, close, host, materialise_random, sumsq_local
from .model import param_specs


# ----------------------------------------------------------------------------------------------
# scenario: optimizer state (AdamW) gather and load
def _make_opt(ctx: Ctx, *, step: bool) -> torch.optim.Optimizer:
    """AdamW over the sharded model; ``step``: one step, so that it has state.

    The step keeps this rank's memory high-water mark low (grad aliases the parameter, no foreach
    temporaries over all parameters at once), so that the timed operation's own peak shows.
    """
    opt = torch.optim.AdamW(ctx.model.parameters(), lr=1e-3, foreach=False)
    if step:
        for p in ctx.model.parameters():
            p.grad = p.detach()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return opt


def _opt_state_setup(ctx: Ctx) -> None:
    materialise_random(ctx)
    ctx.data["opt"] = _make_opt(ctx, step=True)


def _opt_local_tensors(ctx: Ctx) -> list[torch.Tensor]:
    return [v for s in ctx.data["opt"].state.values() for v in s.values() if v.dim() > 0]


def _ogather_fsdptk(ctx: Ctx) -> None:
    from fsdptk import get_full_optimizer_state_dict

    ctx.data["full"] = get_full_optimizer_state_dict(ctx.model, ctx.data["opt"], ctx.rank == 0)


def _ogather_dcp(ctx: Ctx) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    ctx.data["full"] = get_optimizer_state_dict(
        ctx.model, ctx.data["opt"], options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _ogather_torchtune(ctx: Ctx) -> None:
    from torchtune.training import get_full_optimizer_state_dict

    ctx.data["full"] = get_full_optimizer_state_dict(ctx.model, ctx.data["opt"], ctx.rank == 0)


def _check_ogather(ctx: Ctx) -> str:
    full = ctx.data.pop("full")
    if ctx.rank == 0:
        n = len(full.get("state", {}))
        if n != len(param_specs(ctx.cfg)):
            check_full_on_rank0(ctx, {}, _opt_local_tensors(ctx))  # keep the collectives matched
            return f"rank 0's state has {n} entries, expected {len(param_specs(ctx.cfg))}"
    return check_full_on_rank0(ctx, full.get("state", {}) if ctx.rank == 0 else full, _opt_local_tensors(ctx))


def _full_osd(ctx: Ctx, *, by_fqn: bool) -> dict:
    """A full AdamW state for the model, as a single-process AdamW after one step would hold it.

    ``by_fqn``: keyed by parameter FQN (DCP's and fsdptk's layout); else by position (torchtune's
    and ``torch.optim``'s own layout).
    """
    gen = torch.Generator().manual_seed(99)
    specs = param_specs(ctx.cfg)
    state, sumsq = {}, 0.0
    for i, (fqn, shape) in enumerate(specs):
        avg = torch.empty(shape, dtype=ctx.cfg.torch_dtype).normal_(0.0, 1e-3, generator=gen)
        sq = avg.square()
        sumsq += float(avg.double().pow(2).sum()) + float(sq.double().pow(2).sum())
        state[fqn if by_fqn else i] = {"step": torch.tensor(1.0), "exp_avg": avg, "exp_avg_sq": sq}
    group = {k: v for k, v in ctx.data["opt"].state_dict()["param_groups"][0].items() if k != "params"}
    group["params"] = [fqn for fqn, _ in specs] if by_fqn else list(range(len(specs)))
    ctx.data["expected_osd_sumsq"] = sumsq
    return {"state": state, "param_groups": [group]}


def _oload_setup(by_fqn: bool, every_rank: bool) -> Callable[[Ctx], None]:
    def setup(ctx: Ctx) -> None:
        materialise_random(ctx)
        ctx.data["opt"] = _make_opt(ctx, step=False)
        # only the ranks that hold the state build it (a rank's high-water mark must not include it)
        ctx.data["osd"] = host(ctx, _full_osd(ctx, by_fqn=by_fqn)) if (every_rank or ctx.rank == 0) else {}
        box = [ctx.data.get("expected_osd_sumsq")]
        dist.broadcast_object_list(box, src=0)
        ctx.data["expected_osd_sumsq"] = box[0]

    return setup


def _oload_fsdptk(ctx: Ctx) -> None:
    from fsdptk import load_from_full_optimizer_state_dict

    load_from_full_optimizer_state_dict(ctx.model, ctx.data["opt"], ctx.data.pop("osd"), ctx.device,
                                        broadcast_from_rank0=True)


def _oload_dcp(ctx: Ctx) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(ctx.model, ctx.data["opt"], ctx.data.pop("osd"),
                             options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))


def _oload_torchtune(ctx: Ctx) -> None:
    from torchtune.training import load_from_full_optimizer_state_dict

    load_from_full_optimizer_state_dict(ctx.model, ctx.data["opt"], ctx.data.pop("osd"), ctx.device)


def _check_oload(ctx: Ctx) -> str:
    opt = ctx.data["opt"]
    if len(opt.state) != len(param_specs(ctx.cfg)):
        return f"rank {ctx.rank}: optimizer has state for {len(opt.state)} parameters, expected {len(param_specs(ctx.cfg))}"
    got = all_sum(sumsq_local(_opt_local_tensors(ctx)))
    want = ctx.data["expected_osd_sumsq"]
    return "ok" if close(got, want) else f"optimizer state sum of squares {got:.6g} != full state's {want:.6g}"
