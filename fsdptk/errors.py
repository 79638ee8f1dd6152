"""Every exception class fsdptk defines, in one module.

Each subclasses the built-in exception that code written before it existed catches, so
``except ValueError`` / ``except RuntimeError`` / ``except BlockingIOError`` keep working:

- :class:`CheckpointError` (``ValueError``): a checkpoint that cannot be used as it is.
- :class:`ConversionError` (a ``CheckpointError``): checkpoint tensors a conversion cannot combine
  into the model's (a missing per-expert tensor, shapes that do not stack).
- :class:`CheckpointLockedError` (``BlockingIOError``): another writer holds a checkpoint's lock.
- :class:`ShardConditionError` (``RuntimeError``): a shard condition raised on a module.
- :class:`StateDictMismatchError` (``RuntimeError``): a strict model or optimizer load whose keys
  do not match; carries ``missing_keys`` and ``unexpected_keys``.
- :class:`CLIError` (``Exception``): a user-facing failure of ``python -m fsdptk``.

The classes are also importable from the modules that raise them (``fsdptk.checkpoint``,
``fsdptk.sharding``, ``fsdptk.cli``, ...) and from ``fsdptk`` itself. This module imports nothing
heavy (no torch).

Examples:
    >>> from fsdptk.errors import StateDictMismatchError
    >>> e = StateDictMismatchError.for_keys(["b"], ["c"], "Linear")
    >>> isinstance(e, RuntimeError), e.missing_keys, e.unexpected_keys
    (True, ['b'], ['c'])
    >>> [line.strip() for line in str(e).splitlines()]
    ['Error(s) in loading state_dict for Linear:', 'Missing key(s) in state_dict: "b".', 'Unexpected key(s) in state_dict: "c".']
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "CheckpointError",
    "ConversionError",
    "CheckpointLockedError",
    "ShardConditionError",
    "StateDictMismatchError",
    "CLIError",
]


class CheckpointError(ValueError):
    """A checkpoint that cannot be used as it is: corrupt, truncated, inconsistent or mismatched."""


class ConversionError(CheckpointError):
    """Checkpoint tensors that a conversion (:mod:`fsdptk.conversions`) cannot combine into the
    model's: a missing per-expert tensor (named), tensors that do not stack or concatenate (both
    shapes named), two checkpoint keys for one model key."""


class CheckpointLockedError(BlockingIOError):
    """Another writer holds the lock of a checkpoint target (the message names it)."""


class ShardConditionError(RuntimeError):
    """A shard condition raised while being evaluated on a module (nothing was sharded)."""


class CLIError(Exception):
    """A user-facing failure: printed as ``fsdptk <command>: error: <message>``, exit code 1."""


class StateDictMismatchError(RuntimeError, ValueError):
    """A strict load whose keys do not match: raised on every rank, before anything changes.

    Raised alike by strict model loads (:func:`fsdptk.load_from_full_model_state_dict`,
    :func:`fsdptk.load_safetensors`, :func:`fsdptk.load_dcp`) and strict optimizer loads
    (:func:`fsdptk.load_from_full_optimizer_state_dict`). It is a ``RuntimeError``, as torch's
    ``load_state_dict(strict=True)`` raises (so torchtune-style ``except RuntimeError`` works), and
    a ``ValueError``, as fsdptk's optimizer load raised before this class existed.

    Args:
        message: the message; :meth:`for_keys` builds torch's strict message.
        missing_keys: keys the target has and the state lacks.
        unexpected_keys: keys the state has and the target lacks.

    Attributes:
        missing_keys (list[str]): as given.
        unexpected_keys (list[str]): as given.
    """

    def __init__(self, message: str, *, missing_keys: Sequence[str] = (),
                 unexpected_keys: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.missing_keys = list(missing_keys)
        self.unexpected_keys = list(unexpected_keys)

    @classmethod
    def for_keys(cls, missing_keys: Sequence[str], unexpected_keys: Sequence[str],
                 name: str = "model") -> StateDictMismatchError:
        """The error with torch's ``load_state_dict(strict=True)`` message for ``name``.

        Args:
            missing_keys: keys the target has and the state lacks.
            unexpected_keys: keys the state has and the target lacks.
            name: what was loaded (the model's class name).

        Returns:
            StateDictMismatchError: ``Error(s) in loading state_dict for <name>:`` then one line
            per kind of key, as torch words it.
        """
        msgs = []
        if missing_keys:
            msgs.append("Missing key(s) in state_dict: {}. ".format(", ".join(f'"{k}"' for k in missing_keys)))
        if unexpected_keys:
            msgs.append("Unexpected key(s) in state_dict: {}. ".format(
                ", ".join(f'"{k}"' for k in unexpected_keys)))
        return cls(f"Error(s) in loading state_dict for {name}:\n\t" + "\n\t".join(msgs),
                   missing_keys=missing_keys, unexpected_keys=unexpected_keys)

    def __reduce__(self) -> tuple[type, tuple[str], dict[str, list[str]]]:
        return type(self), (str(self),), {"missing_keys": self.missing_keys,
                                           "unexpected_keys": self.unexpected_keys}
