"""``fsdptk.hf.from_pretrained``: the composition of fsdptk's public functions that loads a Hugging
Face checkpoint directory straight into an FSDP2 (and TP) model."""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn

from fsdptk._plans.ep_styles import check_experts_divide
from fsdptk.hf.build import _transformers, hf_ep_plan, hf_meta_model, hf_tp_plan
from fsdptk.predicates import no_split_modules

if TYPE_CHECKING:
    from peft import PeftConfig
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from fsdptk.mesh import ParallelDims

__all__ = ["from_pretrained"]

PathLike = str | os.PathLike[str]


# ----------------------------------------------------------------------------------------------
# from_pretrained: the composition of the public functions, for the common case
class _DirectoryView(NamedTuple):
    """What each rank tells the others about the checkpoint directory (one object exchange)."""

    arguments: Any  # _core.arguments.ArgumentsView of the call's arguments, agreed first
    error: Any  # error_payload(...) of this rank's argument or config failure, or None
    sees_config: bool  # this rank read config.json itself
    adapter_config: Any  # rank 0's peft.PeftConfig read from the adapter directory, else None


class _SentConfig(NamedTuple):
    """Rank 0's configs, sent to the ranks that do not see the directory."""

    config: Any  # transformers.PretrainedConfig
    generation_config: Any  # transformers.GenerationConfig | None


def _check_from_pretrained_args(dims: Any, dtype: Any, mp_policy: Any, activation_checkpointing: Any,
                                shard_on_read: Any, trust_remote_code: Any, peft_config: Any = None,
                                adapter: Any = None, seed: Any = 0) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from fsdptk.mesh import ParallelDims

    _check_adapter_args(peft_config, adapter, seed)

    for name, value, kind, what in (
            ("dims", dims, ParallelDims, "a ParallelDims or None"),
            ("dtype", dtype, torch.dtype, "a torch.dtype or None"),
            ("mp_policy", mp_policy, MixedPrecisionPolicy, "a MixedPrecisionPolicy or None"),
            ("shard_on_read", shard_on_read, bool, "a bool or None")):
        if value is not None and not isinstance(value, kind):
            raise TypeError(f"{name} must be {what}, got {type(value).__name__} ({value!r})")
    for name, value in (("activation_checkpointing", activation_checkpointing),
                        ("trust_remote_code", trust_remote_code)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {type(value).__name__} ({value!r})")


def _check_adapter_args(peft_config: Any, adapter: Any, seed: Any) -> None:
    """``peft_config`` (a ``peft.PeftConfig``), ``adapter`` (a directory path) and ``seed`` (an
    int): at most one of the first two."""
    if peft_config is not None and adapter is not None:
        raise ValueError(
            "from_pretrained takes peft_config (fresh adapters, PEFT's init from seed) or adapter "
            f"(an adapter directory, its config read from it), not both: got peft_config="
            f"{type(peft_config).__name__} and adapter={adapter!r}")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int, got {type(seed).__name__} ({seed!r})")
    if adapter is not None and not isinstance(adapter, (str, os.PathLike)):
        raise TypeError(f"adapter must be a directory path (str or os.PathLike), got "
                        f"{type(adapter).__name__} ({adapter!r})")
    if peft_config is not None:
        from peft import PeftConfig

        if not isinstance(peft_config, PeftConfig):
            raise TypeError(f"peft_config must be a peft.PeftConfig (e.g. peft.LoraConfig(...)), got "
                            f"{type(peft_config).__name__} ({peft_config!r})")


def _peft_config_view(peft_config: Any) -> Any:
    """``peft_config`` as the ranks compare it: its ``to_dict()`` with sets sorted (PEFT keeps
    ``target_modules`` as a set, whose order differs between processes)."""
    try:
        fields = peft_config.to_dict()
    except Exception:  # noqa: BLE001 - not a PeftConfig (refused with the other checks): as given
        return peft_config
    return {k: sorted(v, key=repr) if isinstance(v, (set, frozenset)) else v for k, v in sorted(fields.items())}


def _read_adapter_config(adapter: Path) -> Any:
    """The ``peft.PeftConfig`` of an adapter directory, by PEFT's own loader of
    ``adapter_config.json``, made trainable (``inference_mode=False``, as PEFT's
    ``from_pretrained(..., is_trainable=True)``).

    Raises:
        FileNotFoundError: ``adapter_config.json`` or ``adapter_model.safetensors`` is missing.
    """
    from peft import PeftConfig

    from fsdptk.hf.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS

    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if not (adapter / name).is_file():
            raise FileNotFoundError(f"adapter directory {str(adapter)!r} has no {name}: adapter= takes a "
                                    "directory PEFT's save_pretrained (or fsdptk.hf.save_adapter) wrote")
    config = PeftConfig.from_pretrained(str(adapter))
    config.inference_mode = False
    return config


def _dims_for_world(dims: ParallelDims | None, world_size: int,
                    mp_policy: MixedPrecisionPolicy | None) -> ParallelDims:
    """``dims`` (default: FSDP over every rank), checked against the real world size."""
    from fsdptk._core.dist import has_process_group
    from fsdptk.mesh import ParallelDims

    dims = ParallelDims(world_size=world_size) if dims is None else dims
    if dims.world_size != world_size:
        raise ValueError(
            f"the process group has {world_size} ranks but dims are for world size "
            f"{dims.world_size} (dp_replicate={dims.dp_replicate}, dp_shard={dims.dp_shard}, "
            f"tp={dims.tp}): build ParallelDims with world_size=None (read from the process "
            "group) or degrees whose product is the world size")
    if not has_process_group() and mp_policy is not None:
        raise ValueError("mp_policy is FSDP's mixed precision and needs a process group "
                         "(torch.distributed.init_process_group): without one nothing is sharded")
    return dims


def _arguments(dims: Any, dtype: Any, mp_policy: Any, activation_checkpointing: Any, device: Any,
               shard_on_read: Any, trust_remote_code: Any, world_size: int, peft_config: Any = None,
               adapter: Any = None, seed: Any = 0) -> Any:
    """This rank's view of the arguments that change what the ranks exchange: ``dims`` by its
    degrees (``None`` as the default it stands for), the device by its type (each rank has its
    own index), ``peft_config`` by its fields, ``adapter`` by whether one is given (each host may
    name its directory its own way; rank 0's config is the one used), the rest as given."""
    from fsdptk._core.arguments import arguments_view
    from fsdptk.mesh import ParallelDims

    if dims is None:
        dims = ParallelDims(world_size=world_size)
    try:
        device = None if device is None else torch.device(device).type
    except (RuntimeError, TypeError):  # a bad device is the caller's error, raised later as it was
        pass
    return arguments_view("from_pretrained", dims=dims, dtype=dtype, mp_policy=mp_policy,
                          activation_checkpointing=activation_checkpointing, device=device,
                          shard_on_read=shard_on_read, trust_remote_code=trust_remote_code,
                          peft_config=_peft_config_view(peft_config),
                          adapter=None if adapter is None else "a directory", seed=seed)


def _meta_model_on_every_rank(directory: Path, dims: ParallelDims | None, dtype: torch.dtype | None,
                              mp_policy: MixedPrecisionPolicy | None, check_args: Any,
                              trust_remote_code: bool, arguments: Any, adapter: PathLike | None = None,
                              ) -> tuple[nn.Module, ParallelDims, Any]:
    """The model on ``meta``, the checked dims and the adapter directory's PEFT config (``None``
    without ``adapter``) on every rank, or one error on every rank.

    ``check_args()`` validates the arguments first. Rank 0 reads the directory's config (so it must
    see the directory); so does every other rank that sees ``config.json``. Their outcomes and
    every rank's ``arguments`` (:func:`_arguments`: ranks that differ raise one ValueError naming
    them, before any mesh is built) are agreed in one exchange; when some rank does not see the
    directory (files on rank 0's host only), rank 0's config is sent to it. Rank 0 reads
    ``adapter``'s config (:func:`_read_adapter_config`); every rank gets it in the same exchange.
    """
    from fsdptk._core.arguments import check_arguments
    from fsdptk._core.dist import all_gather_object, error_payload, raise_lowest, world

    world_size, rank = world()
    model, error, adapter_config = None, None, None
    try:
        check_args()
        dims = _dims_for_world(dims, world_size, mp_policy)
        if rank == 0 or (directory / "config.json").is_file():
            if not directory.is_dir():
                raise FileNotFoundError(f"{str(directory)!r} is not a directory: from_pretrained "
                                        "takes a checkpoint directory (config.json + safetensors)")
            model = hf_meta_model(directory, dtype=dtype, trust_remote_code=trust_remote_code)
            _read_generation_config(model, directory)
            no_split_modules(model)  # a model without units fails here, before any mesh
        if adapter is not None and rank == 0:
            adapter_config = _read_adapter_config(Path(adapter))
    except Exception as e:  # noqa: BLE001 - agreed just below
        error = e
    views = all_gather_object(_DirectoryView(arguments=arguments, error=error_payload(error),
                                             sees_config=model is not None, adapter_config=adapter_config))
    check_arguments([v.arguments for v in views])
    raise_lowest([v.error for v in views], error)
    blind = [r for r, v in enumerate(views) if not v.sees_config]
    if blind:
        if trust_remote_code:  # the model's code is in the directory: every rank needs it
            raise FileNotFoundError(
                f"trust_remote_code=True needs the checkpoint directory on every rank; ranks "
                f"{blind} do not see {str(directory / 'config.json')!r}")
        mine = (_SentConfig(config=model.config, generation_config=model.generation_config)
                if rank == 0 and model is not None else None)
        sent = all_gather_object(mine)[0]
        assert sent is not None, "rank 0 read the config (agreed above)"
        if model is None:
            model = hf_meta_model(sent.config, dtype=dtype)
            model.generation_config = sent.generation_config
    assert model is not None and dims is not None, "agreed above: every rank has a model and dims"
    return model, dims, views[0].adapter_config


def _read_generation_config(model: nn.Module, directory: Path) -> None:
    """``generation_config.json`` onto the model, as transformers' ``from_pretrained`` does."""
    if not (directory / "generation_config.json").is_file():
        return
    can_generate = getattr(model, "can_generate", None)
    if callable(can_generate) and can_generate():
        model.generation_config = _transformers().GenerationConfig.from_pretrained(
            str(directory), local_files_only=True)


def from_pretrained(
    path: PathLike,
    *,
    dims: ParallelDims | None = None,
    dtype: torch.dtype | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    activation_checkpointing: bool = False,
    device: torch.device | str | None = None,
    shard_on_read: bool | None = None,
    trust_remote_code: bool = False,
    peft_config: PeftConfig | None = None,
    adapter: PathLike | None = None,
    seed: int = 0,
) -> nn.Module:
    """Load a Hugging Face checkpoint directory straight into an FSDP2 (and TP) model.

    The one call for the common case. It is exactly this composition of fsdptk's public
    functions, in this order (write it out yourself to change any step)::

        dims = dims or ParallelDims()                          # FSDP over the whole world
        model = hf_meta_model(path, dtype=dtype)               # config.json -> model on meta
        mesh = dims.build_mesh(device.type)
        if peft_config or adapter:                             # PEFT before TP / EP / FSDP
            model = get_peft_model(model, peft_config or PeftConfig.from_pretrained(adapter))
        experts = hf_ep_plan(model) if dims.ep > 1 else []     # the model's own EP plan
        if dims.tp > 1:                                        # TP first: FSDP shards TP's DTensors
            apply_tp(model, dims.tp_mesh, {f: s for f, s in hf_tp_plan(model).items()
                                           if f not in experts (nor under them)})
        if dims.ep > 1:                                        # experts Shard(0) over ep
            apply_ep(model, dims.ep_mesh, experts, tp_mesh=dims.tp_mesh if dims.tp > 1 else None)
        if activation_checkpointing:                           # AC before FSDP
            apply_activation_checkpointing(model, no_split_modules(model))
        shard_model(model, no_split_modules(model), cpu_offload=False,
                    dp_mesh=dims.fsdp_mesh, mp_policy=mp_policy,   # HSDP when dp_replicate > 1
                    expert_dp_mesh=dims.expert_fsdp_mesh if dims.ep > 1 else None)
        load_safetensors(model, path, device=device, shard_on_read=shard_on_read, strict=True)
        if adapter:                                            # the adapter directory's weights
            load_adapter(model, adapter, shard_on_read=shard_on_read)
        elif peft_config:                                      # PEFT's own init from seed
            init_adapters(model, seed=seed, device=device)
        model.eval()                                           # as transformers returns it

    ``load_safetensors`` also recomputes the non-persistent buffers (rotary tables) that the meta
    build left on ``meta``. Collective: call it on every rank with the same arguments.

    Arguments are agreed first: ranks that pass different ``dims`` (any degree), ``dtype``,
    ``mp_policy``, ``activation_checkpointing``, device type, ``shard_on_read``,
    ``trust_remote_code``, ``peft_config`` (its fields), ``seed``, or an ``adapter`` on some ranks
    only raise, on every rank, one ValueError naming each and every rank's value, before any mesh is
    built or any weight is read.

    PEFT adapters (LoRA): with ``peft_config`` the ``meta``-built model is wrapped with PEFT's
    ``get_peft_model`` first (the adapters made on ``meta``: no memory, no random draw), so tensor,
    expert and data parallelism shard the adapters with their layers, LoRA on parameters
    (``target_parameters``, e.g. on a MoE model's fused experts) included, which PEFT cannot attach
    to a model already sharded. After the base load the adapters get PEFT's own initialisation
    after ``torch.manual_seed(seed)`` (:func:`fsdptk.hf.init_adapters`): the values
    ``get_peft_model`` gives in one process after that seed, on every rank, whatever each rank's
    own seed; the caller's RNG state is left as it was. ``seed`` must be the same on every rank
    (agreed with the arguments above). With ``adapter`` instead, the config is read from the
    directory (PEFT's own ``PeftConfig.from_pretrained``, on rank 0; made trainable, as PEFT's
    ``from_pretrained(..., is_trainable=True)``) and its weights are loaded
    (:func:`fsdptk.hf.load_adapter`, ``strict=True``). Refused on every rank before any weight is
    read, as the written-out composition refuses them: both ``peft_config`` and ``adapter``, fresh
    adapters PEFT initialises from the base weights (DoRA, PiSSA, ...: start those from an adapter
    directory), LoRA on the experts under EP x TP. The result is a ``peft.PeftModel``: save its
    adapters with :func:`fsdptk.hf.save_adapter`.

    Failures are agreed: a directory without ``config.json`` (rank 0 must see it), dims whose
    product is not the world size, a TP size the attention heads do not divide, a model without a
    TP plan or without ``_no_split_modules`` raise the same error on every rank (the failing
    rank's exception, ``(on rank N)`` elsewhere) before any mesh is built (the config checks) or
    before any weight is read (the TP and sharding checks). Reading the weights then has
    ``load_safetensors``' own failure model (every rank raises a read error of any rank).

    Without a process group (one process) nothing is sharded: the model is built on ``meta`` and
    loaded whole, so the same script runs unchanged under ``python`` and ``torchrun``.

    Python's cyclic garbage collector is kept off the objects that existed before the call
    (``gc.freeze()`` for the call, ``gc.unfreeze()`` after it, on errors too; paused instead where
    the caller froze objects itself): building the model creates hundreds of thousands of
    objects, none of them garbage, and the collector's passes over everything took about 1 s of a
    4 GB load on 4 ranks; collections during the call examine only what it makes. One full
    collection runs first (where the collector is enabled), so garbage made before the call (a
    model dropped just before a reload) is freed then, not held through the load and after it.

    Args:
        path: a checkpoint directory: ``config.json`` and ``model.safetensors`` (or shards and
            ``model.safetensors.index.json``), e.g. a ``save_pretrained`` or ``save_safetensors``
            directory or an HF-cache snapshot. Rank 0 must see it; a rank that does not (files on
            rank 0's host only) gets rank 0's config and its weights from rank 0.
        dims: the parallel degrees (``ParallelDims(dp_replicate=..., dp_shard=..., tp=...,
            ep=...)``); ``None``: FSDP over every rank. Keep your own to read ``dims.dp_rank`` for
            the batch. ``ep > 1`` shards an MoE model's experts by its own EP plan
            (:func:`fsdptk.hf.hf_ep_plan`, docs/expert_parallel.md).
        dtype: the parameters' dtype (default: the config's ``dtype``, else float32); the file's
            values are cast to it.
        mp_policy: FSDP2's ``MixedPrecisionPolicy`` for every unit (``None``: full precision).
        activation_checkpointing: recompute each ``_no_split_modules`` block (decoder layer) in
            backward.
        device: where the shards live (default: the current accelerator, else CPU); the mesh is
            built for its type. On GPUs set the current device of each rank first.
        shard_on_read: ``True``: every rank reads only its own slices of the files; ``False``:
            rank 0 reads and sends each rank its bytes; ``None`` (default): ``True`` when every
            rank can open the files, else rank 0 reads (see :func:`fsdptk.load_safetensors`).
        trust_remote_code: allow a model defined by code in the directory (every rank must then
            see the directory).
        peft_config: a ``peft.PeftConfig`` (e.g. ``LoraConfig(r=8, target_modules=[...])``): fresh
            adapters, PEFT's init from ``seed``.
        adapter: a PEFT adapter directory (``adapter_config.json`` and
            ``adapter_model.safetensors``, as ``save_pretrained`` or :func:`fsdptk.hf.save_adapter`
            write it); rank 0 must see it.
        seed: the seed PEFT's initialisation of fresh adapters is replayed from (the same on every
            rank).

    Returns:
        nn.Module: the sharded model in eval mode (call ``model.train()`` to train), every
        parameter a DTensor over ``dims``' mesh, ``model.config`` and ``model.generation_config``
        as the directory has them (a ``peft.PeftModel`` with ``peft_config`` or ``adapter``, only
        its adapters trainable); :func:`fsdptk.save_safetensors` saves it back as a directory
        this function (and transformers' ``from_pretrained``) loads.

    Raises:
        FileNotFoundError: no directory or no ``config.json`` on rank 0, or a missing weight file;
            an ``adapter`` without ``adapter_config.json`` or ``adapter_model.safetensors`` on rank 0.
        NotImplementedError: fresh adapters PEFT initialises from the base weights (DoRA, PiSSA,
            ...), or a composition fsdptk does not build (LoRA on the experts under EP x TP);
            named, on every rank, before any weight is read.
        ValueError: ``peft_config`` and ``adapter`` both; ranks that passed different arguments
            (above); dims that do not match the
            world size, heads the TP size does not divide, a model without a TP plan (``tp > 1``),
            without an EP plan (``ep > 1``; also an ``ep`` that does not divide the number of
            experts) or without ``_no_split_modules``, an unknown ``model_type``; ``mp_policy``
            without a process group.
        StateDictMismatchError: the files' keys are not the model's (strict load).
        TypeError: an argument of the wrong type.

    Examples:
        >>> import tempfile, torch
        >>> from transformers import AutoModelForCausalLM, LlamaConfig
        >>> from fsdptk.hf import from_pretrained
        >>> ckpt = tempfile.mkdtemp()
        >>> AutoModelForCausalLM.from_config(LlamaConfig(hidden_size=64, intermediate_size=128,
        ...     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        ...     vocab_size=256)).save_pretrained(ckpt)
        >>> model = from_pretrained(ckpt)  # under torchrun: sharded over every rank
        >>> type(model).__name__, model.training
        ('LlamaForCausalLM', False)
        >>> model(input_ids=torch.tensor([[1, 2, 3]])).logits.shape
        torch.Size([1, 3, 256])

        Fresh LoRA adapters in the same call: PEFT's own init from ``seed``, whatever the caller's
        RNG (on every rank alike under torchrun; LoRA on a MoE model's experts works the same, with
        ``target_parameters``):

        >>> from peft import LoraConfig, get_peft_model
        >>> lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        >>> tuned = from_pretrained(ckpt, peft_config=lora, seed=7)
        >>> _ = torch.manual_seed(7)
        >>> judge = get_peft_model(AutoModelForCausalLM.from_pretrained(ckpt), lora)
        >>> all(torch.equal(p, dict(judge.named_parameters())[n])
        ...     for n, p in tuned.named_parameters() if p.requires_grad)
        True
    """
    with _gc_quiet():
        return _from_pretrained(Path(path), dims, dtype, mp_policy, activation_checkpointing, device,
                                shard_on_read, trust_remote_code, _Adapters(peft_config, adapter, seed))


@contextlib.contextmanager
def _gc_quiet() -> Iterator[None]:
    """Keep Python's cyclic garbage collector off what existed before the block (restored as it
    was, on errors too).

    Building a transformers model imports its modules and creates hundreds of thousands of
    objects; a full collection examines every tracked object of the process, and the collector ran
    hundreds of times over objects none of which was garbage (measured: 2.5 s of collections in
    one 4 GB load on 4 ranks). ``gc.freeze()`` moves what exists to the permanent generation, so
    the collections that still run during the block examine only what the block makes, and the
    garbage the block's first-use imports leave (cycles) is freed as it goes, where pausing the
    collector kept it until after the call (about 6 MB more at the load's peak per rank, measured
    beside transformers: ``benchmarks/NOTES_hf.md``). ``gc.unfreeze()`` afterwards returns those
    objects to the oldest generation.

    Garbage first: one full collection (``gc.collect()``) runs before the freeze. Frozen, garbage
    would outlive the call and then sit in the oldest generation, which only the rare full
    collections examine: a model the caller dropped just before a reload (its cycles, in any
    generation) would be held through the load, beside the new one, and after it. The one
    collection examines the heap once (about 0.1 s for 370,000 objects, torch and transformers
    imported, on this project's 2-core machine), where the collections it replaces examined it
    hundreds of times.

    Where the caller froze objects itself (``gc.get_freeze_count() > 0``) unfreezing would also
    unfreeze theirs, so the collector is paused instead (``gc.disable()``, after the same full
    collection, which leaves their frozen objects alone); where it is disabled already, nothing
    changes (no collection either).
    """
    if not gc.isenabled():
        yield
        return
    gc.collect()
    if gc.get_freeze_count():
        gc.disable()
        try:
            yield
        finally:
            gc.enable()
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class _Adapters(NamedTuple):
    """:func:`from_pretrained`'s PEFT arguments, as the caller gave them."""

    peft_config: Any  # peft.PeftConfig: fresh adapters, PEFT's init from seed
    adapter: Any  # an adapter directory (str or os.PathLike)
    seed: Any  # int


def _wrap_with_peft(model: nn.Module, config: Any) -> nn.Module:
    """``peft.get_peft_model(model, config)`` on the ``meta``-built model: the adapters made on
    ``meta`` (no memory, no random draw), the caller's RNG state as it was."""
    from peft import get_peft_model

    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        return get_peft_model(model, config)


def _from_pretrained(directory: Path, dims: ParallelDims | None, dtype: torch.dtype | None,
                     mp_policy: MixedPrecisionPolicy | None, activation_checkpointing: bool,
                     device: torch.device | str | None, shard_on_read: bool | None,
                     trust_remote_code: bool, adapters: _Adapters | None = None) -> nn.Module:
    """:func:`from_pretrained`'s composition (inside :func:`_gc_quiet`)."""
    from fsdptk._core.dist import agreed, has_process_group, world
    from fsdptk._files.common import infer_device
    from fsdptk._plans.peft_fresh import fresh_adapter_plan
    from fsdptk.activation import apply_activation_checkpointing
    from fsdptk.checkpoint import load_safetensors
    from fsdptk.ep import apply_ep
    from fsdptk.hf.adapters import init_adapters, load_adapter
    from fsdptk.sharding import shard_model
    from fsdptk.tp import apply_tp

    peft_config, adapter, seed = adapters or _Adapters(None, None, 0)
    model, dims, adapter_config = _meta_model_on_every_rank(
        directory, dims, dtype, mp_policy,
        lambda: _check_from_pretrained_args(dims, dtype, mp_policy, activation_checkpointing,
                                            shard_on_read, trust_remote_code, peft_config, adapter, seed),
        trust_remote_code,
        _arguments(dims, dtype, mp_policy, activation_checkpointing, device, shard_on_read,
                   trust_remote_code, world()[0], peft_config, adapter, seed),
        adapter)
    peft_config = peft_config if adapter_config is None else adapter_config
    device = infer_device(model) if device is None else torch.device(device)
    units = no_split_modules(model)
    if has_process_group():
        dims.build_mesh(device.type)
    with agreed():  # every check of PEFT, TP, EP, AC and FSDP runs before any weight is read
        if peft_config is not None:  # PEFT first: TP, EP and FSDP then shard the adapters too
            model = _wrap_with_peft(model, peft_config)
            if adapter is None:  # DoRA, PiSSA, ... refused by name here, before anything is sharded
                fresh_adapter_plan(model, ["default"])
            units = no_split_modules(model)
        experts = hf_ep_plan(model) if dims.ep_enabled else []
        if experts:
            check_experts_divide(model, experts, dims.ep)
        if dims.tp_enabled:
            plan = hf_tp_plan(model)
            apply_tp(model, dims.tp_mesh, {f: s for f, s in plan.items()
                                           if not any(f == e or f.startswith(e + ".") for e in experts)})
        if experts:
            apply_ep(model, dims.ep_mesh, experts,
                     tp_mesh=dims.tp_mesh if dims.tp_enabled else None)
        if activation_checkpointing:
            apply_activation_checkpointing(model, units)
        if has_process_group():
            shard_model(model, units, cpu_offload=False, dp_mesh=dims.fsdp_mesh,
                        mp_policy=mp_policy,
                        expert_dp_mesh=dims.expert_fsdp_mesh if experts else None)
    load_safetensors(model, directory, device=device, shard_on_read=shard_on_read, strict=True)
    if peft_config is not None and adapter is not None:
        load_adapter(model, adapter, shard_on_read=shard_on_read)
    elif peft_config is not None:
        init_adapters(model, seed=seed, device=device)
    model.eval()
    return model
