"""The trainer's settings come from the environment, with defaults for what is not set."""

from __future__ import annotations

import pytest

from services.trainer.config import TrainerConfig

_FLEET = ("TINSMITH_REPLICA", "TINSMITH_TRAINER_LEASE_S", "TINSMITH_SNAPSHOT_EVERY")


def test_the_fleet_settings_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in _FLEET:
        monkeypatch.delenv(name, raising=False)
    defaults = TrainerConfig.from_env()
    for name, value in zip(_FLEET, ("trainer-7", "1.5", "5"), strict=True):
        monkeypatch.setenv(name, value)
    configured = TrainerConfig.from_env()

    assert (defaults.replica, defaults.lease_s, defaults.snapshot_every) == ("", 3.0, 20)
    assert (configured.replica, configured.lease_s, configured.snapshot_every) == (
        "trainer-7",
        1.5,
        5,
    )
