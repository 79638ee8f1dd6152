"""Suite-wide settings. The ``world`` fixture comes from fsdptk's pytest plugin (fsdptk.testing)."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

# Multi-process properties are slow per example: no deadline, and hypothesis must not complain that
# a session-scoped fixture is shared across examples.
settings.register_profile(
    "fsdptk",
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    print_blob=True,
)
settings.register_profile("ci", parent=settings.get_profile("fsdptk"), derandomize=True)
settings.load_profile("ci" if os.environ.get("CI") else "fsdptk")

if os.environ.get("PYTEST_XDIST_WORKER"):
    # two workers on two cores (scripts/test.sh): one intra-op thread per process, here and in what
    # the tests launch (the worlds' workers set it themselves), so no thread spins waiting for a core
    os.environ.setdefault("OMP_NUM_THREADS", "1")

# What the fork server of the suite's worlds imports once for all their workers (see
# fsdptk/testing/_preload.py): the Hugging Face stack most tests use; a world's (re)start is then a
# fork, not a fresh interpreter importing it again.
os.environ.setdefault("FSDPTK_WORLD_PRELOAD", ",".join([
    "transformers", "peft", "fsdptk.hf", "transformers.models.llama.modeling_llama",
    "transformers.models.qwen3_moe.modeling_qwen3_moe", "transformers.models.mixtral.modeling_mixtral",
    "transformers.models.deepseek_v3.modeling_deepseek_v3",
]))


# The modules that take longest (seconds on the 2-core CI machine, one process, `--durations=0`),
# longest first. Under pytest-xdist (scripts/test.sh: two workers, a module at a time) they are
# handed out first, so that no long module starts last while the other worker idles.
_LONGEST_FIRST = (
    "test_weight_source.py",  # 80 s
    "test_hosts.py",  # 58 s
    "test_ep.py",  # 46 s
    "test_quantize_out.py",  # 32 s
    "test_weight_patches.py",  # 27 s
    "test_muon.py",  # 26 s
    "test_peft_experts.py",  # 25 s
    "test_hf_from_pretrained.py",  # 24 s
    "test_hf_tp.py",  # 24 s
    "test_testing_world.py",  # 24 s
    "test_writers.py",  # 23 s
    "test_bench_report.py",  # 23 s
    "test_pretrained_peft.py",  # 22 s
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip tests marked ``gpu`` (registered in pyproject.toml) where CUDA is not available, and
    under pytest-xdist put the longest modules first (``_LONGEST_FIRST``; the order within a module
    is kept).

    ``python -m pytest -m gpu`` selects exactly those tests (see docs/testing.md, "GPU checks").
    """
    import torch

    if os.environ.get("PYTEST_XDIST_WORKER"):  # every worker sorts alike: the collections agree
        torch.set_num_threads(1)  # as OMP_NUM_THREADS above, should torch have read it already
        rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
        items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False); on a GPU "
                                   "machine run: python -m pytest -m gpu")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def hub(tmp_path_factory: pytest.TempPathFactory):
    """``family`` -> the ``save_pretrained`` directory of a tiny transformers model of that family
    (tests/_tiny_hub.py), written once per session; the tests only read it."""
    from _tiny_hub import hub_dir

    made: dict[str, object] = {}

    def get(family: str):
        if family not in made:
            made[family] = hub_dir(tmp_path_factory.mktemp(family), family)
        return made[family]

    return get
