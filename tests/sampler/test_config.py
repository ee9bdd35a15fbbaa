"""The sampler's prefill bound comes from the environment, with the device's default."""

from __future__ import annotations

import pytest
import torch

from services.sampler.config import SamplerConfig
from services.sampler.engine import make_engine
from services.sampler.torch_engine import TorchEngine, default_prefill_tokens


def test_the_prefill_bound_defaults_to_the_devices_and_0_means_none(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    variable = "TINSMITH_SAMPLER_PREFILL_TOKENS"
    monkeypatch.setenv("TINSMITH_SAMPLER_ENGINE", "torch")
    for raw in (None, ""):
        if raw is None:
            monkeypatch.delenv(variable, raising=False)
        else:
            monkeypatch.setenv(variable, raw)
        config = SamplerConfig.from_env()
        assert config.prefill_tokens is None
    engine = make_engine(config)
    assert isinstance(engine, TorchEngine)
    assert engine.prefill_tokens == default_prefill_tokens(torch.device("cpu")) == 2048
    assert default_prefill_tokens(torch.device("cuda", 0)) == 16384
    for raw, value in (("0", 0), ("512", 512)):
        monkeypatch.setenv(variable, raw)
        config = SamplerConfig.from_env()
        assert config.prefill_tokens == value
        engine = make_engine(config)
        assert isinstance(engine, TorchEngine) and engine.prefill_tokens == value
    monkeypatch.setenv(variable, "many")
    with pytest.raises(SystemExit, match=variable):
        SamplerConfig.from_env()
