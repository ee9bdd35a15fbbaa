"""The LoRA layout of each supported architecture: which modules `train_attn`, `train_mlp` and
`train_unembed` put adapters on, and the fixed hyperparameters every run shares.

Owns: the table of architectures a run can be created on (a base model of another architecture
is refused with the list of supported ones), and the LoRA policy. Does not own: building
adapters (the trainer does, with peft).

Policy: alpha is fixed at 32, so the LoRA scale is 32 / rank and a learning rate carries across
ranks; dropout is 0, so RL importance ratios between sampler and trainer are exact.
"""

from __future__ import annotations

from tinsmith.failures import InvalidRequest

ALPHA = 32
DROPOUT = 0.0

_LLAMA_LIKE = {
    "attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
    "unembed": ("lm_head",),
}
# model_type (config.json) -> modules per group. These share Llama's module names.
LAYOUTS: dict[str, dict[str, tuple[str, ...]]] = {
    arch: _LLAMA_LIKE for arch in ("llama", "qwen2", "qwen3", "mistral")
}


def target_modules(arch: str, *, attn: bool, mlp: bool, unembed: bool) -> list[str]:
    """The module names a run's adapter goes on; refuses architectures without a layout."""
    layout = LAYOUTS.get(arch)
    if layout is None:
        raise InvalidRequest(
            f"LoRA training is not supported for architecture {arch!r}; supported: "
            f"{', '.join(sorted(LAYOUTS))}"
        )
    chosen = [("attn", attn), ("mlp", mlp), ("unembed", unembed)]
    return [name for group, wanted in chosen if wanted for name in layout[group]]
