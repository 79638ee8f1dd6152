"""Calls in a form the public API no longer takes: one TypeError that says how to call it now.

The API rule (docs/api.md) changed some signatures of fsdptk's own functions (the model first,
the optimizer named ``optimizer``). A call in the old form fails at once with :func:`old_form`'s
message, never silently binding its arguments to other parameters:

- an argument order that changed: the function checks its arguments and raises
  ``old_form(...)`` (``save_dcp(path, model)``);
- a keyword that was renamed: the function is decorated with :func:`renamed_keywords`
  (``get_optimizer_param_groups(model, opt=...)``).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar, cast

F = TypeVar("F", bound=Callable[..., Any])


def old_form(fn: str, rule: str, now: str, before: str, detail: str = "") -> TypeError:
    """The TypeError for ``fn(before)``, a form ``fn`` no longer takes.

    Args:
        fn: the function's name (``"save_dcp"``).
        rule: what changed, completing ``"fn() <rule>"`` (``"takes the model first"``).
        now: the arguments as they are passed now (``"model, path"``).
        before: the arguments in the old form (``"path, model"``).
        detail: appended to the message (what the call passed, in parentheses).

    Returns:
        TypeError: ``"fn() <rule>: call fn(<now>) instead of fn(<before>)<detail>"``.
    """
    return TypeError(f"{fn}() {rule}: call {fn}({now}) instead of {fn}({before}){detail}")


def renamed_keywords(**renamed: str) -> Callable[[F], F]:
    """Decorate a function whose keyword arguments were renamed (``opt="optimizer"``): a call
    passing an old name raises :func:`old_form` naming the new one. Signature, docstring and
    return value are the function's own (generators included: the check runs at the call)."""

    def decorate(fn: F) -> F:
        params = inspect.signature(fn).parameters
        required = [p.name for p in params.values()
                    if p.default is inspect.Parameter.empty
                    and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            for old, new in renamed.items():
                if old in kwargs:
                    head = ", ".join(n for n in required if n != new)
                    raise old_form(fn.__name__, f"names its {old!r} argument {new!r}",
                                   f"{head}, {new}=...", f"{head}, {old}=...")
            return fn(*args, **kwargs)

        return cast(F, call)

    return decorate
