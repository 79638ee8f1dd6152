"""Shard-condition predicates: torchtune's rule, factories, composition, reprs (single process)."""

from __future__ import annotations

import functools
import pickle

import pytest
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from fsdptk import get_shard_conditions
from fsdptk.predicates import (
    Predicate,
    all_of,
    any_of,
    by_glob,
    by_name,
    by_type,
    clean_fqn,
    describe_predicate,
    layers,
    no_split_modules,
    not_,
)

_part = st.one_of(
    st.sampled_from(["layers", "blocks", "h", "attn", "mlp", "output", "tok_embeddings", "0", "1"]),
    st.integers(0, 30).map(str),
    st.text("abcxyz_", min_size=1, max_size=4),
)
_names = st.lists(_part, min_size=0, max_size=5).map(".".join)
_MODULES = [nn.Linear(1, 1), nn.Embedding(2, 1), nn.LayerNorm(1), nn.Sequential(), nn.Identity()]
_modules = st.sampled_from(_MODULES)


def _torchtune_rule(name: str, names_to_match: list[str] | None) -> bool:
    """torchtune 0.6 ``get_shard_conditions``, copied as the oracle."""
    if names_to_match and name in names_to_match:
        return True
    name_list = name.split(".")
    if len(name_list) >= 2:
        return name_list[-2] == "layers" and str.isdigit(name_list[-1])
    return False


@given(_names, st.none() | st.lists(_names, max_size=3))
def test_get_shard_conditions_matches_torchtune(name: str, names_to_match: list[str] | None) -> None:
    got = get_shard_conditions(name, nn.Identity(), names_to_match, "extra", key="ignored")
    assert got == _torchtune_rule(name, names_to_match)


def test_get_shard_conditions_examples() -> None:
    m = nn.Identity()
    assert get_shard_conditions("model.layers.12", m)
    assert not get_shard_conditions("model.layers.12.attn", m)
    assert not get_shard_conditions("layers", m)
    assert get_shard_conditions("output", m, ["output"])
    assert not get_shard_conditions("output", m, None)


@given(_names, _modules)
def test_factories_agree_with_their_definitions(name: str, module: nn.Module) -> None:
    parts = name.split(".")
    assert by_name("a.b", name)(name, module)
    assert by_name("a.b", "layers.0")(name, module) == (name in {"a.b", "layers.0"})
    assert by_glob("*")(name, module)
    assert by_glob("*.mlp")(name, module) == name.endswith(".mlp")
    assert by_type(nn.Linear)(name, module) == isinstance(module, nn.Linear)
    assert by_type(nn.Linear, nn.Embedding)(name, module) == isinstance(
        module, (nn.Linear, nn.Embedding)
    )
    is_item = len(parts) >= 2 and parts[-1].isdigit()
    assert layers()(name, module) == (is_item and parts[-2] == "layers")
    assert layers("blocks", "h")(name, module) == (is_item and parts[-2] in {"blocks", "h"})


_preds = st.sampled_from(
    [by_name("layers.0", "output"), by_glob("*.attn*"), by_type(nn.Linear), layers(),
     layers("blocks"), get_shard_conditions]
)


@given(st.lists(_preds, min_size=1, max_size=4), _names, _modules)
def test_composition_is_boolean_logic(preds: list, name: str, module: nn.Module) -> None:
    vals = [bool(p(name, module)) for p in preds]
    assert any_of(*preds)(name, module) == any(vals)
    assert all_of(*preds)(name, module) == all(vals)
    assert not_(preds[0])(name, module) == (not vals[0])
    # operators on Predicate objects, and De Morgan
    p, q = layers(), by_type(nn.Linear)
    assert (p | q)(name, module) == (p(name, module) or q(name, module))
    assert (p & q)(name, module) == (p(name, module) and q(name, module))
    assert (~(p | q))(name, module) == ((~p) & (~q))(name, module)


def test_reprs_are_readable_and_nested_any_all_flatten() -> None:
    cond = layers() | by_type(nn.Embedding) | by_glob("output*")
    assert repr(cond) == "any_of(layers('layers'), by_type(Embedding), by_glob('output*'))"
    assert repr(all_of(all_of(layers(), by_name("x")), not_(by_type(nn.Linear)))) == (
        "all_of(layers('layers'), by_name('x'), not_(by_type(Linear)))"
    )
    assert repr(by_name(["a", "b"], "c")) == "by_name('a', 'b', 'c')"
    assert describe_predicate(get_shard_conditions) == "get_shard_conditions"
    part = functools.partial(get_shard_conditions, names_to_match=["output"])
    assert describe_predicate(part) == "partial(get_shard_conditions, names_to_match=['output'])"
    assert repr(any_of(get_shard_conditions, layers())) == (
        "any_of(get_shard_conditions, layers('layers'))"
    )


@given(_names, _modules)
def test_predicates_pickle_round_trip(name: str, module: nn.Module) -> None:
    cond = (layers() | by_type(nn.Embedding)) & ~by_glob("x*")
    back = pickle.loads(pickle.dumps(cond))
    assert isinstance(back, Predicate)
    assert repr(back) == repr(cond)
    assert back(name, module) == cond(name, module)


def test_clean_fqn() -> None:
    assert clean_fqn("layers.0._checkpoint_wrapped_module.attn.weight") == "layers.0.attn.weight"
    assert clean_fqn("_orig_mod.layers.1") == "layers.1"
    assert clean_fqn("_checkpoint_wrapped_module") == ""
    assert clean_fqn("layers.0.w") == "layers.0.w"


@pytest.mark.parametrize(
    ("call", "exc", "text"),
    [
        (lambda: by_name(), ValueError, "at least one name"),
        (lambda: by_name("a", 3), TypeError, "3"),
        (lambda: by_glob(), ValueError, "at least one name"),
        (lambda: by_type(int), TypeError, "int"),
        (lambda: by_type(), ValueError, "at least one type"),
        (lambda: any_of(), ValueError, "at least one predicate"),
        (lambda: all_of(layers(), "layers"), TypeError, "'layers'"),
        (lambda: not_(None), TypeError, "None"),
        (lambda: layers(1), TypeError, "1"),
    ],
)
def test_bad_arguments_are_clear_errors(call, exc, text) -> None:
    with pytest.raises(exc, match=text):
        call()


# -- no_split_modules (HF models: tests/test_hf.py) ---------------------------------------------
class _Block(nn.Linear):
    pass


class _SubBlock(_Block):
    pass


class _Inner(nn.Module):
    _no_split_modules = ["_Block"]  # noqa: RUF012 - the HF convention: a class-level list

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Block(2, 2), _SubBlock(2, 2)])


class _Outer(nn.Module):
    """A plain module holding a sub-model that declares its blocks, plus one declaring its own."""

    _no_split_modules = ("_Extra",)

    def __init__(self) -> None:
        super().__init__()
        self.inner = _Inner()
        self.extra = nn.Sequential(nn.Linear(2, 2))
        self.head = nn.Linear(2, 2)


def test_no_split_modules_gathers_sub_models_and_matches_by_class_name() -> None:
    model = _Outer()
    model.extra.__class__ = type("_Extra", (nn.Sequential,), {})
    cond = no_split_modules(model)
    assert repr(cond) == "no_split_modules(_Block, _Extra)"
    matched = [n for n, m in model.named_modules() if n and cond(n, m)]
    assert matched == ["inner.blocks.0", "inner.blocks.1", "extra"]  # a subclass matches too
    again = pickle.loads(pickle.dumps(cond))
    assert [n for n, m in model.named_modules() if n and again(n, m)] == matched


def test_no_split_modules_matches_fsdp_style_subclasses_by_base_name() -> None:
    cond = no_split_modules(_Inner())
    fsdp_like = type("FSDP_Block", (_Block,), {})(2, 2)  # fully_shard's dynamic FSDP<Class>
    assert cond("blocks.0", fsdp_like) and not cond("head", nn.Linear(2, 2))


@pytest.mark.parametrize(
    ("make", "exc", "text"),
    [
        (lambda: nn.Sequential(nn.Linear(2, 2)), ValueError, "Sequential declares no _no_split_modules"),
        (lambda: type("Empty", (nn.Sequential,), {"_no_split_modules": []})(nn.Linear(2, 2)),
         ValueError, "Empty declares no _no_split_modules"),
        (lambda: type("Odd", (nn.Sequential,), {"_no_split_modules": ["Missing"]})(nn.Linear(2, 2)),
         ValueError, r"Odd declares _no_split_modules \['Missing'\] but holds no module"),
        (lambda: "model", TypeError, "got str"),
    ],
)
def test_no_split_modules_errors_name_the_model(make, exc, text) -> None:
    with pytest.raises(exc, match=text):
        no_split_modules(make())
