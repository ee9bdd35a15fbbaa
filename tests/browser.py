"""A real browser for the console's tests: Debian's ``chromium`` package, driven by Playwright.

Playwright's own browser download cannot work offline, so the tests launch the system's
Chromium by its path (``executable_path``). If it is missing, the set-up installs it with
apt-get (as root, or through passwordless sudo). Where it still cannot be had, the tests fail
in CI (``CI=true``, as ``.ci/run`` sets it) and are skipped elsewhere with what to install.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

PACKAGE = "chromium"
CANDIDATES = ("chromium", "chromium-browser")
INSTALL_TIMEOUT_S = 900


def chromium_path() -> str:
    """The path of the system's Chromium, installed first if it is missing."""
    found = _find()
    if found:
        return found
    tried = _install()
    found = _find()
    if found:
        return found
    message = (
        f"the console's browser tests need Debian's {PACKAGE} package (apt-get install "
        f"{PACKAGE}); installing it failed: {tried}"
    )
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(message)
    pytest.skip(message)


def _find() -> str | None:
    for name in CANDIDATES:
        path = shutil.which(name)
        if path:
            return path
    return None


def _install() -> str:
    """Install the package; what went wrong, if it did."""
    apt = shutil.which("apt-get")
    if apt is None:
        return "this machine has no apt-get"
    prefix: list[str] = []
    if os.geteuid() != 0:
        sudo = shutil.which("sudo")
        if sudo is None:
            return "not root, and no sudo"
        prefix = [sudo, "-n"]
    install = [*prefix, apt, "install", "-y", "--no-install-recommends", PACKAGE]
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    done = subprocess.run(
        install, env=env, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S
    )
    if done.returncode != 0:  # the package lists may be missing or stale: refresh them once
        subprocess.run([*prefix, apt, "update"], env=env, capture_output=True, check=False)
        done = subprocess.run(
            install, env=env, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S
        )
    return "" if done.returncode == 0 else (done.stderr or done.stdout).strip()[-500:]
