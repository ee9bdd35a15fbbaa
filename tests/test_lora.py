"""The LoRA layout per architecture, and the refusal of architectures without one."""

from __future__ import annotations

import pytest

from tinsmith import lora
from tinsmith.failures import InvalidRequest


def test_groups_select_their_modules() -> None:
    assert lora.target_modules("qwen2", attn=True, mlp=False, unembed=False) == [
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
    ]
    assert lora.target_modules("llama", attn=False, mlp=True, unembed=True) == [
        "gate_proj",
        "up_proj",
        "down_proj",
        "lm_head",
    ]


def test_an_architecture_without_a_layout_is_refused_with_the_supported_ones() -> None:
    with pytest.raises(InvalidRequest, match=r"'gpt2'.*llama, mistral, qwen2, qwen3"):
        lora.target_modules("gpt2", attn=True, mlp=True, unembed=True)
