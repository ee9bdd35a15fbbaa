"""The trainer's settings come from the environment, with defaults for what is not set."""

from __future__ import annotations

import pytest
import torch

from services.trainer.config import TrainerConfig
from services.trainer.engine import default_slice_tokens
from services.trainer.fusion import default_limits

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


_FUSION = ("TINSMITH_TRAINER_FUSE_TOKENS", "TINSMITH_TRAINER_FUSE_REQUEST_TOKENS")


def test_fusion_limits_default_to_the_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unset, the fusion limits are the device's (the CPU's smaller than an accelerator's);
    set, they are what is set, 0 tokens a pass meaning no fusing; a request limit of 0 or a
    word is refused with the variable's name."""
    for name in _FUSION:
        monkeypatch.delenv(name, raising=False)
    defaults = TrainerConfig.from_env()
    assert (defaults.fuse_tokens, defaults.fuse_request_tokens) == (None, None)
    assert default_limits(torch.device("cpu")) == (2048, 128)
    assert default_limits(torch.device("cuda", 0)) == (16384, 4096)
    assert default_limits(torch.device("mps")) == (16384, 4096)

    monkeypatch.setenv("TINSMITH_TRAINER_FUSE_TOKENS", "0")
    monkeypatch.setenv("TINSMITH_TRAINER_FUSE_REQUEST_TOKENS", "96")
    configured = TrainerConfig.from_env()
    assert (configured.fuse_tokens, configured.fuse_request_tokens) == (0, 96)

    for raw in ("0", "many"):
        monkeypatch.setenv("TINSMITH_TRAINER_FUSE_REQUEST_TOKENS", raw)
        with pytest.raises(SystemExit, match="TINSMITH_TRAINER_FUSE_REQUEST_TOKENS"):
            TrainerConfig.from_env()


def test_the_slice_defaults_to_the_devices_and_0_means_none(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Unset or empty (as the deploy's env file has it), the trainer's slice is the device's
    (the size of a fused pass); set, what is set, 0 meaning no bound; a word is refused."""
    for raw in (None, ""):
        if raw is None:
            monkeypatch.delenv("TINSMITH_TRAINER_SLICE_TOKENS", raising=False)
        else:
            monkeypatch.setenv("TINSMITH_TRAINER_SLICE_TOKENS", raw)
        assert TrainerConfig.from_env().slice_tokens is None
    assert default_slice_tokens(torch.device("cpu")) == default_limits(torch.device("cpu"))[0]
    assert default_slice_tokens(torch.device("cuda", 0)) == 16384
    for raw, value in (("0", 0), ("4096", 4096)):
        monkeypatch.setenv("TINSMITH_TRAINER_SLICE_TOKENS", raw)
        assert TrainerConfig.from_env().slice_tokens == value
    monkeypatch.setenv("TINSMITH_TRAINER_SLICE_TOKENS", "many")
    with pytest.raises(SystemExit, match="TINSMITH_TRAINER_SLICE_TOKENS"):
        TrainerConfig.from_env()
