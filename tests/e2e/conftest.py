"""Fixtures shared by the end-to-end tests that run tinker-cookbook recipes."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cookbook_env import ensure_cookbook_venv


@pytest.fixture(scope="session")
def cookbook_python() -> Path:
    """The python of the cookbook's own virtual environment, built once into the cache."""
    return ensure_cookbook_venv()
