"""The public API's consistency rules: model first, one exception module, one ``bucket_bytes``
convention, no ignored argument, ``is_rank_zero`` checked against the real rank."""

from __future__ import annotations

import inspect
import pickle
import re
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fsdptk
from fsdptk import errors


def test_exceptions_live_in_errors_only() -> None:
    import importlib
    import pkgutil

    classes = {v for v in vars(errors).values() if isinstance(v, type) and issubclass(v, Exception)
               and v.__module__ == "fsdptk.errors"}
    assert {c.__name__ for c in classes} == set(errors.__all__)
    for cls in classes:  # the top-level package lists some of them, from fsdptk.errors
        assert getattr(fsdptk, cls.__name__, cls) is cls
    # no other public module exports an exception class (one import path each)
    for info in pkgutil.iter_modules(fsdptk.__path__):
        if info.name.startswith("_") or info.name in ("errors", "testing"):
            continue
        mod = importlib.import_module(f"fsdptk.{info.name}")
        exported = {name for name in getattr(mod, "__all__", ())
                    if isinstance(getattr(mod, name), type) and issubclass(getattr(mod, name), Exception)}
        assert not exported, (info.name, exported)
    for old in ("fsdptk.checkpoint.CheckpointError", "fsdptk.dcp.CheckpointError", "fsdptk.checkpoint.CheckpointLockedError",
                "fsdptk.sharding.ShardConditionError", "fsdptk.cli.CLIError",
                "fsdptk.dcp.convert_dcp_to_safetensors", "fsdptk.checkpoint.convert_safetensors_to_dcp"):
        module, name = old.rsplit(".", 1)
        assert not hasattr(importlib.import_module(module), name), old
    assert issubclass(errors.StateDictMismatchError, RuntimeError)
    assert issubclass(errors.StateDictMismatchError, ValueError)


def test_mismatch_error_pickles_with_its_keys() -> None:
    e = errors.StateDictMismatchError.for_keys(["a"], ["b", "c"], "Net")
    back = pickle.loads(pickle.dumps(e))
    assert (back.missing_keys, back.unexpected_keys, str(back)) == (["a"], ["b", "c"], str(e))
    # the same text as torch's own strict load_state_dict
    with pytest.raises(RuntimeError) as torch_err:
        nn.Linear(2, 2).load_state_dict({"weight": torch.ones(2, 2), "x": torch.ones(1)})
    ours = errors.StateDictMismatchError.for_keys(["bias"], ["x"], "Linear")
    assert str(ours) == str(torch_err.value)


def test_strict_model_loads_raise_the_mismatch_error(tmp_path) -> None:
    from safetensors.torch import save_file

    from fsdptk import load_dcp, load_from_full_model_state_dict, load_safetensors, save_dcp

    sd = {"weight": torch.ones(3, 2), "extra": torch.ones(1)}
    for load in (lambda m: load_from_full_model_state_dict(m, dict(sd), "cpu", strict=True),
                 lambda m: load_safetensors(m, tmp_path / "m.safetensors", strict=True)):
        save_file(sd, tmp_path / "m.safetensors")
        model = nn.Linear(2, 3)
        before = model.weight.detach().clone()
        with pytest.raises(errors.StateDictMismatchError) as err:
            load(model)
        assert (err.value.missing_keys, err.value.unexpected_keys) == (["bias"], ["extra"])
        assert 'Missing key(s) in state_dict: "bias".' in str(err.value)
        assert torch.equal(model.weight, before)
    save_dcp(nn.Linear(2, 3), tmp_path / "dcp")
    target = nn.Linear(2, 3, bias=False)
    with pytest.raises(errors.StateDictMismatchError) as err:
        load_dcp(target, tmp_path / "dcp")
    assert (err.value.missing_keys, err.value.unexpected_keys) == ([], ["bias"])
    assert load_dcp(target, tmp_path / "dcp", strict=False) == {}


def test_strict_optimizer_load_raises_the_mismatch_error() -> None:
    from fsdptk import get_full_optimizer_state_dict, load_from_full_optimizer_state_dict

    model = nn.Linear(2, 3)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    osd = get_full_optimizer_state_dict(model, opt, True)
    osd["param_groups"][0]["params"].append("nope.weight")
    with pytest.raises(errors.StateDictMismatchError) as err:
        load_from_full_optimizer_state_dict(model, torch.optim.Adam(model.parameters()), osd, "cpu")
    assert (err.value.missing_keys, err.value.unexpected_keys) == ([], ["nope.weight"])
    assert isinstance(err.value, ValueError) and isinstance(err.value, RuntimeError)


def test_dcp_takes_the_model_first_and_names_the_old_order(tmp_path) -> None:
    from fsdptk import load_dcp, save_dcp

    model = nn.Linear(2, 3)
    with pytest.raises(TypeError, match=r"call save_dcp\(model, path, optimizer, extra=\.\.\.\) instead "
                                        r"of save_dcp\(path, model, optimizer, extra=\.\.\.\)"):
        save_dcp(tmp_path / "c", model)
    assert not (tmp_path / "c").exists()
    save_dcp(model, tmp_path / "c")
    with pytest.raises(TypeError, match=r"call load_dcp\(model, path, optimizer\)"):
        load_dcp(str(tmp_path / "c"), model)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got dict"):
        load_dcp({}, tmp_path / "c")
    for fn in (save_dcp, load_dcp):
        assert list(inspect.signature(fn).parameters)[:3] == ["model", "path", "optimizer"]


def test_optimizer_is_named_optimizer_and_opt_says_how_to_call() -> None:
    from fsdptk import get_optimizer_param_groups, iter_full_optimizer_state, to_fqn_optimizer_state_dict

    model = nn.Linear(2, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    calls = {
        get_optimizer_param_groups: ((model,), "get_optimizer_param_groups(model, optimizer=...) instead of "
                                               "get_optimizer_param_groups(model, opt=...)"),
        iter_full_optimizer_state: ((model,), "iter_full_optimizer_state(model, optimizer=...) instead of "
                                              "iter_full_optimizer_state(model, opt=...)"),
        to_fqn_optimizer_state_dict: ((model, opt.state_dict()),
                                      "to_fqn_optimizer_state_dict(model, osd, optimizer=...) instead of "
                                      "to_fqn_optimizer_state_dict(model, osd, opt=...)"),
    }
    for fn, (args, how) in calls.items():
        assert "optimizer" in inspect.signature(fn).parameters and "opt" not in inspect.signature(fn).parameters
        with pytest.raises(TypeError, match=rf"names its 'opt' argument 'optimizer': call {re.escape(how)}"):
            fn(*args, opt=opt)
        fn(*args, optimizer=opt)  # the new name works
    assert get_optimizer_param_groups(model, opt)[0]["params"] == ["weight", "bias"]  # positionally too


def test_load_safetensors_is_strict_by_default(tmp_path) -> None:
    from torch.nn.modules.module import _IncompatibleKeys

    from fsdptk import load_safetensors, save_safetensors

    sig = inspect.signature(load_safetensors)
    assert sig.parameters["strict"].default is True and sig.return_annotation in ("_IncompatibleKeys",
                                                                                  _IncompatibleKeys)
    assert all(p.kind is p.KEYWORD_ONLY for name, p in sig.parameters.items() if name not in ("model", "path"))
    save_safetensors(nn.Linear(2, 3), tmp_path)
    with pytest.raises(errors.StateDictMismatchError):
        load_safetensors(nn.Linear(2, 3, bias=False), tmp_path)
    res = load_safetensors(nn.Linear(2, 3, bias=False), tmp_path, strict=False)
    assert isinstance(res, _IncompatibleKeys) and res.unexpected_keys == ["bias"]


def test_bucket_bytes_is_one_convention() -> None:
    from fsdptk._engine import DEFAULT_BUCKET_BYTES

    assert DEFAULT_BUCKET_BYTES == 16 * 2**20
    names = [n for n in fsdptk.__all__ if callable(getattr(fsdptk, n)) and not isinstance(getattr(fsdptk, n), type)]
    seen = []
    for name in names:
        param = inspect.signature(getattr(fsdptk, name)).parameters.get("bucket_bytes")
        if param is not None:
            seen.append(name)
            assert param.default is None and param.annotation == "int | None", (name, param)
            assert "16 MiB" in inspect.getdoc(getattr(fsdptk, name)), name
    assert len(seen) >= 7, seen
    model = nn.Linear(2, 3)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match=f"bucket_bytes must be a positive int.*got {bad!r}"):
            fsdptk.gather_cpu_state_dict(model, True, bucket_bytes=bad)
    small = fsdptk.gather_cpu_state_dict(model, True, bucket_bytes=8)
    assert all(torch.equal(small[k], v) for k, v in model.state_dict().items())


def test_gather_device_is_checked_not_ignored() -> None:
    """torchtune's meaning: the device the gather communicates on. Without a process group
    nothing is communicated, so any device is accepted silently."""
    model = nn.Linear(2, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert sorted(fsdptk.gather_cpu_state_dict(model, True, torch.device("cpu"))) == ["bias", "weight"]


def _gather_warnings():
    model = nn.Linear(2, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for call in (lambda ok, dev: fsdptk.gather_cpu_state_dict(model, ok, dev),
                 lambda ok, dev: fsdptk.get_full_optimizer_state_dict(model, opt, ok, dev)):
        for ok, dev in ((dist.get_rank() == 0, "cpu"), (True, None), (dist.get_rank() == 0, "meta")):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                got = call(ok, dev)
            out.append((bool(got), [str(w.message) for w in caught]))
    return out


def test_is_rank_zero_and_device_mismatches_warn(world) -> None:
    rank0, rank1 = world(2).run(_gather_warnings)
    for fn, (right, every_rank_true, bad_device) in (("gather_cpu_state_dict", rank0[:3]),
                                                       ("get_full_optimizer_state_dict", rank0[3:])):
        assert right == (True, []) and every_rank_true == (True, [])
        assert bad_device[0] and any(f"{fn}(device='meta') is not used" in m and "gloo" in m
                                     for m in bad_device[1]), bad_device
    for fn, (right, every_rank_true, _) in (("gather_cpu_state_dict", rank1[:3]),
                                             ("get_full_optimizer_state_dict", rank1[3:])):
        assert right == (False, [])
        got, msgs = every_rank_true
        assert not got and any(f"{fn}(is_rank_zero=True) called on global rank 1" in m for m in msgs), msgs
