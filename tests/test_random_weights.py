"""bench/random_weights.py: a model directory with a built-in model's shape, config and
tokenizer, and random weights, served as a local model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from bench import random_weights
from tinsmith import models


def test_a_random_model_has_the_shape_and_files_of_the_one_it_is_like(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = models.materialize(models.TINY)
    out = tmp_path / "tiny-random"
    copied = random_weights.copy_skeleton(source, out)
    assert {"config.json", "tokenizer.json"} <= set(copied)
    assert not random_weights.has_weights(out)

    count = random_weights.write_random_weights(out)
    assert random_weights.has_weights(out)
    real = AutoModelForCausalLM.from_pretrained(source)
    drawn = AutoModelForCausalLM.from_pretrained(out)
    assert count == sum(p.numel() for p in real.parameters())
    shapes = {name: p.shape for name, p in real.named_parameters()}
    assert {name: p.shape for name, p in drawn.named_parameters()} == shapes
    weight = "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(real.get_parameter(weight), drawn.get_parameter(weight))

    monkeypatch.setenv(models.MODEL_DIRS_VARIABLE, str(tmp_path))
    spec = models.get(str(out))
    assert (spec.shape, spec.vocab_size) == (models.get(models.TINY).shape, real.config.vocab_size)
