"""The trainer's settings come from the environment, with defaults for what is not set."""

from __future__ import annotations

import pytest

from services.trainer.config import TrainerConfig


def test_the_queue_settings_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TINSMITH_TRAINER_ACK_WAIT_S", raising=False)
    monkeypatch.delenv("TINSMITH_TRAINER_BUFFER_MB", raising=False)
    defaults = TrainerConfig.from_env()
    monkeypatch.setenv("TINSMITH_TRAINER_ACK_WAIT_S", "12.5")
    monkeypatch.setenv("TINSMITH_TRAINER_BUFFER_MB", "0.5")
    configured = TrainerConfig.from_env()

    assert (defaults.ack_wait_s, defaults.buffer_bytes) == (60.0, 256 * 2**20)
    assert (configured.ack_wait_s, configured.buffer_bytes) == (12.5, 2**19)
