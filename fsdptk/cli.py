"""``fsdptk`` / ``python -m fsdptk``: the shell side of fsdptk.

Subcommands:

- ``plan MODULE:FACTORY --world-size N``: the dry-run sharding report (:func:`fsdptk.describe_sharding`)
  of a model built on the meta device by ``FACTORY()`` from ``MODULE``; ``plan DIR`` builds a
  Hugging Face checkpoint directory's model (``config.json``, no weights read) on meta with
  ``AutoModelForCausalLM.from_config`` and uses its ``_no_split_modules`` classes as units.
- ``inspect PATH``: keys, shapes, dtypes and total size of a checkpoint (a ``.safetensors`` file, a
  directory of them, a DCP directory, or a ``torch.save`` file), without loading tensor data.
- ``convert SRC DST``: DCP directory <-> safetensors, memory-bounded (:mod:`fsdptk.checkpoint`);
  ``--quantize fp8|fp8-ue8m0|mxfp4``: an unquantized checkpoint -> a quantized release.
- ``demo``: the end-to-end example ``examples/train_llama.py``, launched on N local processes.

Exit codes: 0 success, 1 a bad path or a failure with a message on stderr, 2 bad arguments
(argparse's convention), otherwise the demo's own exit code.

Examples:
    .. code-block:: bash

        fsdptk plan examples.llama:tiny --world-size 4
        fsdptk plan $HF_HOME/hub/models--Qwen--Qwen2.5-0.5B/snapshots/<rev> --world-size 8
        fsdptk inspect runs/llama/checkpoints/step_000300/model.safetensors
        fsdptk demo --nproc 2 --steps 60
"""

from __future__ import annotations

import argparse
import fnmatch
import importlib
import json
import math
import os
import stat
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fsdptk import errors

__all__ = ["main", "build_parser", "inspect_checkpoint", "TensorInfo"]

# the demo script, for a source checkout (it is not part of the installed package)
_REPO_EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_llama.py"


# ----------------------------------------------------------------------------------------------
# inspect
class TensorInfo(dict):
    """One checkpoint entry: ``{"key", "dtype", "shape", "nbytes"}`` (a dict, JSON-ready)."""


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _regular(path: Path) -> int:
    """The size of ``path``; CLIError unless it is a regular file (a FIFO is never opened)."""
    from fsdptk._files.paths import file_kind

    try:
        st = os.stat(path)
    except OSError as e:
        raise errors.CLIError(f"{path}: {e.strerror or e}") from e
    if not stat.S_ISREG(st.st_mode):
        raise errors.CLIError(f"{path} is a {file_kind(st.st_mode)}, not a regular file; refusing to open it")
    return st.st_size


def _inspect_safetensors(files: Sequence[Path]) -> list[TensorInfo]:
    """Read only the JSON headers of safetensors files, checking every entry against the file size."""
    from fsdptk._files.safetensors_io import read_header

    out = []
    for f in files:
        size = _regular(f)
        try:
            out += [TensorInfo(key=e.key, dtype=_dtype_name(e.dtype) if e.dtype is not None else e.code,
                               shape=e.shape, nbytes=e.nbytes) for e in read_header(f, size)]
        except (OSError, ValueError, RecursionError) as e:
            what = "nested too deeply" if isinstance(e, RecursionError) else str(e)
            raise errors.CLIError(f"{f} is not a readable safetensors file ({what})") from e
    return out


def _inspect_dcp(directory: Path) -> list[TensorInfo]:
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    from fsdptk._files.safe_pickle import safe_reader

    try:
        meta = safe_reader(directory).read_metadata()
    except (OSError, ValueError) as e:  # CheckpointError: unsafe, corrupt, or a missing data file
        raise errors.CLIError(f"{directory}/.metadata is not readable DCP metadata ({type(e).__name__}: {e})") from e
    out = []
    for key, md in meta.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            out.append(TensorInfo(key=key, dtype="object", shape=[], nbytes=0))
            continue
        try:
            if not isinstance(md, TensorStorageMetadata):
                raise TypeError(f"a {type(md).__name__}")
            dtype = md.properties.dtype
            shape = [int(d) for d in md.size]
            nbytes = math.prod(shape) * dtype.itemsize
        except (AttributeError, TypeError, ValueError) as e:
            raise errors.CLIError(f"{directory}/.metadata: entry {key!r} is not tensor metadata ({e})") from e
        out.append(TensorInfo(key=key, dtype=_dtype_name(dtype), shape=shape, nbytes=nbytes))
    return out


def _inspect_torch_save(path: Path) -> list[TensorInfo]:
    import torch

    _regular(path)
    try:  # weights_only: a torch.save file runs no code here
        obj = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as e:  # noqa: BLE001
        raise errors.CLIError(f"{path} is not a readable torch.save file ({type(e).__name__}: "
                       f"{str(e).strip().splitlines()[0] if str(e).strip() else ''})") from e
    out: list[TensorInfo] = []

    def walk(prefix: str, x: Any) -> None:
        if isinstance(x, torch.Tensor):
            out.append(TensorInfo(key=prefix, dtype=_dtype_name(x.dtype), shape=list(x.shape),
                                  nbytes=x.numel() * x.element_size()))
        elif isinstance(x, dict):
            for k, v in x.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(x, (list, tuple)) and any(isinstance(v, (torch.Tensor, dict)) for v in x):
            for i, v in enumerate(x):
                walk(f"{prefix}.{i}" if prefix else str(i), v)

    walk("", obj)
    return out


def _safetensors_files(path: Path) -> list[Path]:
    """The files a safetensors checkpoint path reads, as the loader resolves them (the single
    ``model.safetensors`` before an index; index entries must be plain names)."""
    from fsdptk._files.paths import plain_name
    from fsdptk._files.safetensors_io import resolve_files

    try:
        index, files = resolve_files(path)
        if index is None:
            return files
        weight_map = json.loads(index.read_text())["weight_map"]
        names = [plain_name(v, what=f"index {str(index)!r} (key {k!r})") for k, v in weight_map.items()]
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        raise errors.CLIError(f"{path}: {type(e).__name__}: {e}") from e
    return [index.parent / n for n in dict.fromkeys(names)]


def inspect_checkpoint(path: str | os.PathLike[str]) -> tuple[str, list[TensorInfo]]:
    """Describe a checkpoint's entries without loading tensor data (except for ``torch.save`` files,
    which are memory-mapped and read with ``weights_only=True``). No code from the file runs, and
    only regular files are opened.

    Args:
        path: a ``.safetensors`` file or index; a directory with ``*.safetensors`` files (resolved as
            the loader does: ``model.safetensors``, else the index, else every file); a DCP
            directory (with ``.metadata``); or a ``torch.save`` file (``.pt``/``.pth``/``.bin``).

    Returns:
        tuple[str, list[TensorInfo]]: the detected format (``"safetensors"``, ``"dcp"`` or
        ``"torch"``) and one entry per tensor, in file order.

    Raises:
        CLIError: when the path does not exist, holds no recognisable checkpoint, or is corrupt
            (a header entry outside the file, unsafe DCP metadata, a missing data file, ...).

    Examples:
        >>> import tempfile, torch
        >>> from safetensors.torch import save_file
        >>> from fsdptk.cli import inspect_checkpoint
        >>> d = tempfile.mkdtemp()
        >>> save_file({"w": torch.zeros(2, 3)}, f"{d}/m.safetensors")
        >>> inspect_checkpoint(f"{d}/m.safetensors")
        ('safetensors', [{'key': 'w', 'dtype': 'float32', 'shape': [2, 3], 'nbytes': 24}])
    """
    p = Path(path)
    if not p.exists():
        raise errors.CLIError(f"no such file or directory: {p}")
    if p.is_dir():
        if os.path.lexists(p / ".metadata"):
            return "dcp", _inspect_dcp(p)
        if any(p.glob("*.safetensors")) or any(p.glob("*.safetensors.index.json")):
            return "safetensors", _inspect_safetensors(_safetensors_files(p))
        raise errors.CLIError(f"{p} holds neither *.safetensors files nor a DCP .metadata file")
    if p.suffix == ".safetensors":
        return "safetensors", _inspect_safetensors([p])
    if p.name.endswith(".safetensors.index.json"):
        _regular(p)
        return "safetensors", _inspect_safetensors(_safetensors_files(p))
    if p.suffix in {".pt", ".pth", ".bin"}:
        return "torch", _inspect_torch_save(p)
    raise errors.CLIError(f"{p}: unknown checkpoint type (expected .safetensors, .pt/.pth/.bin or a directory)")


def _human(nbytes: int) -> str:
    size = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.2f} {unit}"
        size /= 1024
    raise AssertionError  # unreachable


def _as_model(path: Path) -> list[TensorInfo]:
    """A Hugging Face directory's tensors under the model's keys (through transformers' conversion)."""
    import torch

    from fsdptk._engine.sources import SAFETENSORS_DTYPES
    from fsdptk.conversions import resolve_load

    if not (path.is_dir() and (path / "config.json").is_file()):
        raise errors.CLIError(f"--as-model needs a Hugging Face checkpoint directory with config.json, got {path}")
    model = _hf_plan_model(path, {}, None, False)
    infos = _inspect_safetensors(_safetensors_files(path))
    dtypes = {k: v for k, v in ((str(d).removeprefix("torch."), d) for d in SAFETENSORS_DTYPES.values())}
    metas = {i["key"]: (tuple(i["shape"]), dtypes.get(i["dtype"], torch.float32)) for i in infos}
    try:
        nodes = resolve_load(model, "auto", metas)
    except ValueError as e:
        raise errors.CLIError(f"{path}: {e}") from e
    if nodes is None:
        return infos
    nbytes = {i["key"]: i["nbytes"] for i in infos}
    return [TensorInfo(key=k, dtype=_dtype_name(n.dtype), shape=list(n.shape),
                       nbytes=sum(nbytes[f] for f in set(n.files())), sources=len(set(n.files())))
            for k, n in nodes.items()]


def _cmd_inspect(args: argparse.Namespace) -> int:
    fmt, infos = inspect_checkpoint(args.path)
    if args.as_model:
        infos, fmt = _as_model(Path(args.path)), "safetensors, as the model reads it"
    if args.filter:
        infos = [i for i in infos if fnmatch.fnmatchcase(i["key"], args.filter)]
    total = sum(i["nbytes"] for i in infos)
    if args.json:
        print(json.dumps({"format": fmt, "path": str(args.path), "tensors": infos,
                          "num_tensors": len(infos), "total_bytes": total}, indent=1))
        return 0
    width = max([len(i["key"]) for i in infos] + [3])
    print(f"{args.path} ({fmt})")
    print(f"{'key':<{width}}  {'dtype':<9}  {'shape':<18}  size")
    for i in infos:
        shape = "(" + ", ".join(map(str, i["shape"])) + ")"
        print(f"{i['key']:<{width}}  {i['dtype']:<9}  {shape:<18}  {_human(i['nbytes'])}")
    numel = sum(math.prod(i["shape"]) for i in infos if i["dtype"] != "object")
    print(f"total: {len(infos)} tensors, {numel:,} elements, {_human(total)} ({total:,} bytes)")
    return 0


# ----------------------------------------------------------------------------------------------
# plan
def _load_factory(spec: str) -> Any:
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise errors.CLIError(f"model must be given as MODULE:FACTORY (e.g. examples.llama:tiny) or be a "
                       f"Hugging Face checkpoint directory, got {spec!r}")
    if os.getcwd() not in sys.path:  # like `python -m`: modules of the current directory import
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise errors.CLIError(f"cannot import module {module_name!r} ({e})") from e
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise errors.CLIError(f"module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise errors.CLIError(f"{spec} is not callable")
    return obj


def _one_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[0] if lines else ''}"


def _hf_plan_model(path: Path, kwargs: dict[str, Any], dtype: Any, trust_remote_code: bool) -> Any:
    """An HF checkpoint directory (or config file) built on meta; every failure is one line."""
    from fsdptk.hf import hf_meta_model

    try:
        return hf_meta_model(path, dtype=dtype, trust_remote_code=trust_remote_code, **kwargs)
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds on a bad config
        raise errors.CLIError(f"cannot build a model from {path}: {_one_line(e)}") from e


def _cmd_plan(args: argparse.Namespace) -> int:
    import torch

    from fsdptk import describe_sharding, get_shard_conditions
    from fsdptk.predicates import by_glob, no_split_modules

    try:
        kwargs = json.loads(args.kwargs)
    except json.JSONDecodeError as e:
        raise errors.CLIError(f"--kwargs is not valid JSON ({e}): {args.kwargs!r}") from e
    if not isinstance(kwargs, dict):
        raise errors.CLIError(f"--kwargs must be a JSON object, got {args.kwargs!r}")
    dtype = getattr(torch, args.dtype) if args.dtype else None
    hf = Path(args.model).exists()  # an HF checkpoint directory (config.json) or a config file
    if hf:
        model = _hf_plan_model(Path(args.model), kwargs, dtype, args.trust_remote_code)
    else:
        factory = _load_factory(args.model)
        with torch.device("meta"):
            model = factory(**kwargs)
        if not isinstance(model, torch.nn.Module):
            raise errors.CLIError(f"{args.model}(...) returned {type(model).__name__}, not an nn.Module")
        if dtype is not None:
            model = model.to(dtype)
    conditions: list[Any] = []
    if not args.no_layers:
        try:
            conditions.append(no_split_modules(model) if hf else get_shard_conditions)
        except ValueError as e:
            raise errors.CLIError(f"{e}; or pass --no-layers --glob PATTERN") from e
    if args.glob:
        conditions.append(by_glob(*args.glob))
    if not conditions:
        raise errors.CLIError("no shard condition: drop --no-layers or give --glob PATTERN")
    try:
        if args.tp > 1:  # the model's own TP plan, then FSDP over world_size // tp ranks
            if not hf:
                raise ValueError("--tp needs a Hugging Face checkpoint directory (its own TP plan)")
            from fsdptk._plans.hf_tp import describe_hf_2d

            plan = describe_hf_2d(model, conditions, world_size=args.world_size, tp=args.tp)
            print(f"Tensor parallel: tp {args.tp} x dp_shard {args.world_size // args.tp} "
                  f"(the model's own tp_plan); bytes/rank is one rank's TP shard, FSDP-sharded")
        else:
            plan = describe_sharding(model, conditions, world_size=args.world_size)
        ep_lines = _ep_lines(model, args) if args.ep > 1 else []
    except ValueError as e:
        raise errors.CLIError(str(e)) from e
    print(plan)
    for line in ep_lines:
        print(line)
    if hf:
        _print_layout(Path(args.model), model)
    return 0


def _ep_lines(model: Any, args: argparse.Namespace) -> list[str]:
    """The dense and expert meshes of ``--ep`` and what each rank holds of the experts."""
    from fsdptk._plans.ep_styles import check_experts_divide
    from fsdptk._plans.hf_ep import experts_from_plan
    from fsdptk._plans.sharding import _fmt_bytes
    from fsdptk.mesh import ParallelDims

    if args.world_size % args.tp:
        raise ValueError(f"tp ({args.tp}) must divide the world size ({args.world_size})")
    dims = ParallelDims(dp_shard=args.world_size // args.tp, tp=args.tp, ep=args.ep,
                        world_size=args.world_size)
    experts = experts_from_plan(model)
    check_experts_divide(model, experts, dims.ep)
    counts = sorted({p.shape[0] for f in experts for p in model.get_submodule(f).parameters()})
    expert_bytes = sum(p.numel() * p.element_size() for f in experts
                       for p in model.get_submodule(f).parameters())
    per = ", ".join(f"{n // dims.ep}" for n in counts)
    dense = " x ".join(f"{n} {s}" for n, s in zip(dims.mesh_dim_names, dims.mesh_shape))
    expert = " x ".join(f"{n} {s}" for n, s in zip(dims.expert_mesh_dim_names, dims.expert_mesh_shape))
    return [
        f"Expert parallel: ep {dims.ep} (the model's own ep_plan: {len(experts)} experts modules of "
        f"{', '.join(map(str, counts))} experts); the experts are not tensor-parallel",
        f"  dense mesh:  {dense}",
        f"  expert mesh: {expert}",
        f"  each rank: {per} whole experts of each module, FSDP-sharded over efsdp {dims.efsdp} "
        f"ranks: {_fmt_bytes(expert_bytes // (dims.dp_shard * dims.tp))} of the experts' "
        f"{_fmt_bytes(expert_bytes)}",
    ]


def _print_layout(path: Path, model: Any) -> None:
    """One line on how the directory's checkpoint maps onto the model when it is converted (the
    Hub layout of a MoE model, docs/layouts.md); nothing when it holds the model's own keys."""
    if not (path.is_dir() and (any(path.glob("*.safetensors")) or any(path.glob("*.safetensors.index.json")))):
        return
    try:
        infos = _as_model(path)
    except errors.CLIError as e:
        print(f"Checkpoint layout: cannot be read into the model ({e})")
        return
    converted = [i for i in infos if i.get("sources", 1) > 1]
    if converted:
        print(f"Checkpoint layout: Hub (transformers' conversion for {type(model).__name__}): "
              f"{len(converted)} model tensors are read from {sum(i['sources'] for i in converted)} "
              "checkpoint tensors; each rank reads only the ones its shards cover")


# ----------------------------------------------------------------------------------------------
# convert
def _cmd_convert(args: argparse.Namespace) -> int:
    from fsdptk import checkpoint as ckpt
    from fsdptk._files.paths import check_disjoint

    src, dst = Path(args.src), Path(args.dst)
    if not src.exists():
        raise errors.CLIError(f"no such file or directory: {src}")
    try:
        check_disjoint(src, dst)  # the destination is replaced as a whole: never over the source
    except ValueError as e:
        raise errors.CLIError(str(e)) from e
    if args.quantize is not None:
        return _cmd_quantize(args, src, dst)
    to = args.to
    if to is None:
        to = "safetensors" if (src.is_dir() and (src / ".metadata").is_file()) else "dcp"
    prefix = args.prefix
    config = None if args.keep_keys else Path(args.config) if args.config else (
        src if to == "dcp" and src.is_dir() and (src / "config.json").is_file() else None)
    model = _hf_plan_model(config, {}, None, False) if config is not None else None
    try:
        if to == "safetensors":
            if not (src.is_dir() and (src / ".metadata").is_file()):
                raise errors.CLIError(f"{src} is not a DCP checkpoint directory (no .metadata file)")
            out = ckpt.dcp_to_safetensors(src, dst, prefix=prefix or None,
                                          max_shard_size=args.max_shard_size, model=model)
        else:
            if not (src.suffix == ".safetensors" or (src.is_dir() and any(src.glob("*.safetensors")))):
                raise errors.CLIError(f"{src} is neither a .safetensors file nor a directory of them")
            out = ckpt.safetensors_to_dcp(src, dst, prefix=prefix, model=model)
    except (ValueError, OSError) as e:  # CheckpointError is a ValueError; FileNotFoundError an OSError
        raise errors.CLIError(f"{type(e).__name__}: {e}") from e
    print(f"wrote {to}: {out}")
    return 0


def _cmd_quantize(args: argparse.Namespace, src: Path, dst: Path) -> int:
    """``convert --quantize``: an unquantized Hub checkpoint (or a DCP directory, through a
    safetensors copy beside ``dst`` that is deleted after) -> a quantized release."""
    import shutil
    import tempfile

    from fsdptk import checkpoint as ckpt

    if args.to == "dcp":
        raise errors.CLIError("--quantize writes a safetensors release; it cannot be combined with --to dcp")
    try:
        block = tuple(int(n) for n in args.block_size.split(","))
    except ValueError as e:
        raise errors.CLIError(f"--block-size must be two ints 'rows,columns', got {args.block_size!r}") from e
    is_dcp = src.is_dir() and (src / ".metadata").is_file()
    config = Path(args.config) if args.config else src
    if not (config / "config.json").is_file():
        raise errors.CLIError(f"--quantize needs the model's config.json: {config} has none (pass --config DIR)")
    model = _hf_plan_model(config, {}, None, False)
    staging = None
    try:
        if is_dcp:  # the DCP checkpoint in the Hub layout first, one batch at a time
            dst.parent.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=f".{dst.name}.unquantized.", dir=dst.parent))
            ckpt.dcp_to_safetensors(src, staging / "hub", prefix=args.prefix or None,
                                    max_shard_size=args.max_shard_size, model=model)
        out = _write_quantized(staging / "hub" if staging else src, dst, model, args.quantize, block,
                               args.max_shard_size)
    except (ValueError, TypeError, OSError) as e:  # bad --quantize/--block-size, CheckpointError, a full disk
        raise errors.CLIError(f"{type(e).__name__}: {e}") from e
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
    print(f"wrote {args.quantize} release: {out}")
    return 0


def _write_quantized(src: Path, dst: Path, model: Any, quantize: str, block: tuple[int, ...],
                     max_shard_size: str) -> Path:
    """Each tensor of the Hub checkpoint ``src`` read, quantized as a save of ``model`` would
    (fsdptk._plans.quant_save), written and dropped; ``config.json`` with the release's
    ``quantization_config``, renamed in after the weights commit."""
    from fsdptk._engine.sources import as_source
    from fsdptk._files.common import progress_bar
    from fsdptk._files.hf_config import stage_hf_config
    from fsdptk._files.safetensors_io import SafetensorsCheckpoint
    from fsdptk._files.safetensors_writer import ShardedWriter
    from fsdptk._plans.hf_convert import hub_nodes, quantization, quantized_leaves
    from fsdptk._plans.quant_save import plan_quantized, quant_format

    fmt = quant_format(quantize, block)
    if fmt is None or quantization(model) is not None:
        raise ValueError(f"{src} is already a quantized release (its config.json has a quantization_config)")
    with SafetensorsCheckpoint(src) as reader:
        metas = {k: as_source(reader).meta(k) for k in reader}
        trees = hub_nodes(model, metas) or {}  # which model tensor each Hub tensor is (the default rule)
        plan = plan_quantized(model, fmt, metas, {f: k for k, n in trees.items() for f in n.files()})
        nodes = quantized_leaves(model, plan.metas, plan.config)
        writer = ShardedWriter(dst, [(k, m.dtype, m.shape) for k, m in plan.metas.items()],
                               max_shard_size=max_shard_size)
        try:
            dtype = next((m.dtype for m in metas.values() if m.dtype.is_floating_point), None)
            staged = stage_hf_config(model, dst, dtype=dtype, quantization_config=plan.config)
            if staged is not None:
                writer.after_commit(staged.commit)
            with progress_bar(writer.total_size, f"quantize {src.name}", None) as bar:
                for key in metas:
                    for name, piece in nodes[key].split(reader[key]):
                        bar.update(writer.write(name, piece.contiguous()))
            return writer.commit()
        except BaseException:
            writer.abort()
            raise


# ----------------------------------------------------------------------------------------------
# demo
def _cmd_demo(args: argparse.Namespace, extra: list[str]) -> int:
    script = Path(args.script) if args.script else _REPO_EXAMPLE
    if not script.is_file():
        raise errors.CLIError(
            f"example script not found: {script} (the demo runs examples/train_llama.py from a source "
            "checkout; pass --script PATH)"
        )
    base = [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={args.nproc}", str(script), *extra]
    runs = [base + ["--stop-after", str(args.interrupt_at)], base] if args.interrupt_at else [base]
    for i, cmd in enumerate(runs):
        if len(runs) > 1:
            what = f"interrupted at step {args.interrupt_at}" if i == 0 else "resumed"
            print(f"[demo] run {i + 1}/{len(runs)} ({what}): {' '.join(cmd)}", flush=True)
        else:
            print(f"[demo] {' '.join(cmd)}", flush=True)
        rc = subprocess.call(cmd)
        if rc != 0:
            print(f"fsdptk demo: error: the example exited with code {rc}", file=sys.stderr)
            return rc
    return 0


# ----------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``fsdptk`` command (exposed for documentation and tests)."""
    parser = argparse.ArgumentParser(prog="fsdptk", description="fsdptk command line: plan, inspect, convert, demo.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("plan", help="dry-run sharding report of a model for a world size")
    p.add_argument("model", help="MODULE:FACTORY, called on the meta device (e.g. examples.llama:tiny), "
                                 "or a Hugging Face checkpoint directory with config.json")
    p.add_argument("--world-size", type=int, required=True, help="ranks each parameter is sharded over")
    p.add_argument("--kwargs", default="{}",
                   help="JSON object of keyword arguments for FACTORY, or of config overrides for a "
                        "checkpoint directory (e.g. '{\"num_hidden_layers\": 4}')")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="parameter dtype (default: the factory's, or the config's dtype)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="allow a checkpoint directory's own model code (transformers' option)")
    p.add_argument("--glob", action="append", default=[], metavar="PATTERN",
                   help="also make modules whose FQN matches PATTERN units (repeatable)")
    p.add_argument("--no-layers", action="store_true",
                   help="do not use the default rule (`layers.<i>`, or a checkpoint directory's "
                        "_no_split_modules classes)")
    p.add_argument("--tp", type=int, default=1, metavar="N",
                   help="tensor-parallel degree for a checkpoint directory: apply its own tp_plan "
                        "(fsdptk.hf_tp_plan), then FSDP over world-size / N ranks")
    p.add_argument("--ep", type=int, default=1, metavar="N",
                   help="expert-parallel degree for an MoE checkpoint directory: print the dense and "
                        "expert meshes and what each rank holds of the experts (its own ep_plan)")

    p = sub.add_parser("inspect", help="keys, shapes, dtypes and size of a checkpoint")
    p.add_argument("path", help=".safetensors file, directory of them, DCP directory, or .pt file")
    p.add_argument("--filter", metavar="GLOB", help="only keys matching GLOB")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--as-model", action="store_true",
                   help="a Hugging Face directory (config.json): list the tensors under the model's "
                        "keys, as fsdptk reads them through transformers' conversion for the model "
                        "(per-expert MoE tensors as one fused tensor; docs/layouts.md)")

    p = sub.add_parser("convert", help="DCP directory <-> safetensors")
    p.add_argument("src", help="a DCP directory, or a .safetensors file / directory of them")
    p.add_argument("dst", help="output path")
    p.add_argument("--to", choices=["safetensors", "dcp"], default=None,
                   help="target format (default: the other one)")
    p.add_argument("--prefix", default="model.",
                   help="DCP key prefix of the model's tensors: stripped when writing safetensors, "
                        "added when writing DCP ('model.' is what fsdptk.save_dcp writes; '' = all keys)")
    p.add_argument("--max-shard-size", default="5GB", help="safetensors bytes per file (e.g. 500MB)")
    p.add_argument("--config", metavar="DIR", default=None,
                   help="a Hugging Face directory whose config.json names the model: DCP holds the "
                        "model's keys, safetensors the Hub layout (docs/layouts.md). Default: the "
                        "safetensors directory's own config.json when it has one")
    p.add_argument("--keep-keys", action="store_true",
                   help="no layout conversion: the keys as the source holds them")
    p.add_argument("--quantize", choices=["fp8", "fp8-ue8m0", "mxfp4"], default=None,
                   help="write a quantized release (docs/layouts.md, 'Writing quantized releases') of an "
                        "unquantized Hub checkpoint or DCP directory (with --config), one tensor at a time")
    p.add_argument("--block-size", default="128,128", metavar="ROWS,COLS",
                   help="FP8 block of --quantize fp8 / fp8-ue8m0 (default 128,128)")

    p = sub.add_parser("demo", help="run examples/train_llama.py on local processes; "
                                    "other arguments go to the example",
                       allow_abbrev=False)  # `--s...` of the example must not match `--script`
    p.add_argument("--nproc", type=int, default=2, help="processes (torchrun --nproc_per_node)")
    p.add_argument("--interrupt-at", type=int, default=None, metavar="STEP",
                   help="stop the first run at STEP, then run again to show it resuming")
    p.add_argument("--script", default=None, help="the example script (default: the checkout's)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``fsdptk`` and ``python -m fsdptk``.

    Args:
        argv: arguments without the program name (``None``: ``sys.argv[1:]``).

    Returns:
        int: the exit code (0 ok, 1 bad path or failure, 2 bad arguments). Any error, expected or
        not, is one line on stderr (``fsdptk <command>: error: ...``), never a traceback.

    Examples:
        >>> from fsdptk.cli import main
        >>> main(["inspect", "/does/not/exist"])
        1
    """
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args, extra = parser.parse_known_args(argv)
        if extra and args.command != "demo":
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        if args.command == "plan" and args.world_size < 1:
            parser.error(f"argument --world-size: must be >= 1, got {args.world_size}")
        if args.command == "plan" and args.tp < 1:
            parser.error(f"argument --tp: must be >= 1, got {args.tp}")
        if args.command == "plan" and args.ep < 1:
            parser.error(f"argument --ep: must be >= 1, got {args.ep}")
        if args.command == "plan" and args.ep > 1 and not Path(args.model).exists():
            parser.error("argument --ep needs a Hugging Face checkpoint directory (its own ep_plan)")
        if args.command == "demo" and args.nproc < 1:
            parser.error(f"argument --nproc: must be >= 1, got {args.nproc}")
    except SystemExit as e:  # argparse: 2 for bad arguments, 0 for --help
        return int(e.code) if isinstance(e.code, int) else 2
    try:
        if args.command == "inspect":
            return _cmd_inspect(args)
        if args.command == "plan":
            return _cmd_plan(args)
        if args.command == "convert":
            return _cmd_convert(args)
        return _cmd_demo(args, extra)
    except errors.CLIError as e:
        print(f"fsdptk {args.command}: error: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # `fsdptk inspect ... | head`
        return 0
    except KeyboardInterrupt:
        print(f"fsdptk {args.command}: interrupted", file=sys.stderr)
        return 130
    except (SystemExit, GeneratorExit):
        raise
    except BaseException as e:  # noqa: BLE001 - never a traceback for bad input or a bad file
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        print(f"fsdptk {args.command}: error: {type(e).__name__}: {lines[0] if lines else ''}",
              file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
