"""The torch-free run: the tests of the parts that need no torch (the shared library, the gateway,
the checkpoint service, the manifests and images), for the Pythons whose environments have no
torch (``make test-pythons``: 3.12 and 3.13; CI's 3.11 environment runs everything).

A pytest plugin, loaded by name only (``python -m pytest -p tests.torch_free``), never by
``make test``. It selects the tests and guards the selection:

- only ``TORCH_FREE`` is collected: the top-level ``tests/test_*.py`` and the directories named
  there; the engines' tests (tests/trainer, tests/sampler) and the whole system's (tests/e2e)
  are not;
- ``NEEDS_TORCH`` leaves out, each with its reason, the files and tests among those that need
  torch all the same (a file: not collected; a test: deselected). An entry that names nothing
  collected is an error, so that the list does not outlive its tests;
- the run refuses to start where torch is installed (it would prove nothing), so that a selected
  test that imports torch, in the process or in a service it starts, fails; and a test skipped
  because torch is missing (``pytest.importorskip("torch")``) fails too: it belongs in
  ``NEEDS_TORCH``.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Generator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"

# Directories under tests/ collected besides the top-level test files.
TORCH_FREE = ("gateway", "checkpoint", "deploy")

# Files and tests among TORCH_FREE that need torch, with why. A file ("tests/x.py") is not
# collected; a test ("tests/x.py::name", every parametrization of it) is deselected.
NEEDS_TORCH: dict[str, str] = {
    "tests/test_device.py": "services/device.py is torch's device API",
    "tests/test_embedded.py": "each test starts the whole system (`tinsmith up`), engines included",
    "tests/test_keyadmin.py::test_up_announces_its_auth_mode_first_and_records_its_nats": (
        "starts the whole system"
    ),
    "tests/test_models.py::test_tiny_loads_in_transformers_with_no_missing_keys": (
        "runs the model in transformers"
    ),
    "tests/test_models.py::"
    "test_small_has_about_6m_parameters_loads_and_shares_the_tiny_tokenizer": (
        "runs the model in transformers"
    ),
    "tests/test_models.py::test_smollm2_logits_match_transformers_gguf_load": (
        "runs the model in transformers"
    ),
    "tests/test_models.py::test_smollm2_tokenizer_matches_transformers_gguf_tokenizer": (
        "transformers reads GGUF files with torch"
    ),
    "tests/deploy/test_health.py::test_a_service_stops_within_three_seconds_of_its_signal": (
        "starts every service, the trainer and the sampler too"
    ),
    "tests/deploy/test_health.py::"
    "test_the_trainer_and_the_sampler_are_ready_once_their_base_models_are_loaded": (
        "starts the trainer and the sampler"
    ),
    "tests/deploy/test_images.py::test_every_image_command_starts": (
        "starts every image's command, the trainer's and the sampler's too"
    ),
    "tests/deploy/test_manifests.py::test_the_overlays_device_settings_resolve_as_documented": (
        "reads the overlays' device settings with services/device.py"
    ),
}

_TORCH_MISSING = "could not import 'torch'"


def _relative(path: Path) -> str:
    try:
        return path.resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return path.as_posix()


def pytest_configure(config: pytest.Config) -> None:
    if importlib.util.find_spec("torch") is not None:
        raise pytest.UsageError(
            "tests.torch_free: torch is installed in this environment, so this run would not "
            "show that the selected tests need none; run it where torch is absent "
            "(`make test-pythons`), and everything else with `make test`"
        )


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    path = collection_path.resolve()
    if path == TESTS or TESTS not in path.parents:
        return None
    parts = path.relative_to(TESTS).parts
    if (len(parts) > 1 or path.is_dir()) and parts[0] not in TORCH_FREE:
        return True
    if _relative(path) in NEEDS_TORCH:
        return True
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tests = {name: reason for name, reason in NEEDS_TORCH.items() if "::" in name}
    files = {item.nodeid.partition("::")[0] for item in items}
    matched: set[str] = set()
    kept: list[pytest.Item] = []
    left_out: list[pytest.Item] = []
    for item in items:
        name = item.nodeid.partition("[")[0]
        if name in tests:
            matched.add(name)
            left_out.append(item)
        else:
            kept.append(item)
    stale = [n for n in tests if n.partition("::")[0] in files and n not in matched]
    stale += [n for n in NEEDS_TORCH if "::" not in n and not (ROOT / n).is_file()]
    if stale:
        raise pytest.UsageError(f"tests.torch_free: NEEDS_TORCH names no test: {stale}")
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = kept


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.skipped and _TORCH_MISSING in str(report.longrepr):
        report.outcome = "failed"
        report.longrepr = (
            f"{item.nodeid} needs torch (it skipped: {_TORCH_MISSING}); "
            "list it in NEEDS_TORCH in tests/torch_free.py, with why"
        )
    return report
