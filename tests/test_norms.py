"""services/norms.py: the llama family's RMSNorm modules fused give, on the CPU, the modules' own
outputs and gradients bit for bit, in float32 and bfloat16; a model fused so computes what it
computed before."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
)

from services import norms
from tests.calls import record_calls

SIZES = {
    "hidden_size": 48,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 61,
    "max_position_embeddings": 64,
}
CONFIGS: dict[str, PretrainedConfig] = {
    "llama": LlamaConfig(**SIZES),
    "mistral": MistralConfig(**SIZES, sliding_window=None),
    "qwen2": Qwen2Config(**SIZES),
    "qwen3": Qwen3Config(**SIZES, head_dim=16),
}


def _model(arch: str, dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS[arch], dtype=torch.float32)
    with torch.no_grad():  # norms away from 1, so that their weights matter
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    return model.to(dtype).eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", list(CONFIGS))
def test_each_norm_fused_is_the_module_bit_for_bit_with_its_gradients(
    arch: str, dtype: torch.dtype
) -> None:
    model = _model(arch, dtype)
    found = [m for m in model.modules() if type(m).__name__ in norms.NORMS]
    assert len(found) == 2 * 2 + 1 + (2 * 2 if arch == "qwen3" else 0)  # Qwen3: q/k norms too
    generator = torch.Generator().manual_seed(1)
    for module in found:
        size = module.weight.shape[0]
        x = (torch.randn(3, 5, size, generator=generator) * 3).to(dtype).requires_grad_(True)
        push = torch.randn(3, 5, size, generator=generator).to(dtype)
        fused = norms.fused(module)
        assert isinstance(fused, norms.RMSNorm)
        want = module(x)
        (grad_want,) = torch.autograd.grad((want * push).sum(), x)
        got = fused(x)
        (grad_got,) = torch.autograd.grad((got * push).sum(), x)
        assert torch.equal(got, want)
        assert torch.equal(grad_got, grad_want)


def test_a_fused_model_computes_what_it_did(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model("qwen3", torch.float32)
    ids = torch.randint(0, SIZES["vocab_size"], (2, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        before = model(input_ids=ids).logits
    assert norms.fuse(model) == 9
    calls = record_calls(monkeypatch, norms.RMSNorm, "__call__")
    with torch.no_grad():
        after = model(input_ids=ids).logits
    assert len(calls) == 9  # every norm of the forward ran fused
    assert torch.equal(after, before)


def test_other_norms_are_left_as_they_are() -> None:
    gpt2 = AutoModelForCausalLM.from_config(
        GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=50)
    )
    assert norms.fuse(gpt2) == 0
    layer_norm = gpt2.transformer.ln_f
    assert norms.fused(layer_norm) is layer_norm
