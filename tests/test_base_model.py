"""services/base_model.py: a base model loaded for the engines holds its host weights in memory of
its own (aligned, not the checkpoint file's mapping), the same values as the file's, with tied
weights still tied, frozen, in eval mode and with its norms fused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from services import base_model, lora_slots, norms
from services.device import Placement
from services.sampler.torch_engine import TorchEngine
from tinsmith import models

CPU = Placement(torch.device("cpu"), torch.float32, 1 << 30)


def _mapped_files() -> list[tuple[int, int, str]]:
    """The address ranges of this process mapped from files, with the files' paths."""
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith("/"):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            ranges.append((start, end, fields[5]))
    return ranges


def _in_a_mapping_of(tensor: torch.Tensor, suffix: str) -> bool:
    address = tensor.data_ptr()
    return any(
        start <= address < end and path.endswith(suffix) for start, end, path in _mapped_files()
    )


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return models.materialize(models.TINY, tmp_path_factory.mktemp("cache"))


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads Linux's /proc/self/maps")
def test_the_host_weights_are_the_files_values_in_memory_of_their_own(tiny_dir: Path) -> None:
    mapped = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    model = base_model.load(tiny_dir, CPU)
    state, want = model.state_dict(), mapped.state_dict()
    assert state.keys() == want.keys()
    for name, tensor in state.items():
        assert torch.equal(tensor, want[name]), name
        assert tensor.data_ptr() % 64 == 0, f"{name} at {tensor.data_ptr():#x}"
        assert not _in_a_mapping_of(tensor, ".safetensors"), name
    assert not any(p.requires_grad for p in model.parameters())
    assert not model.training
    fused = [m for m in model.modules() if type(m).__name__ in norms.NORMS]
    assert fused and all(isinstance(m.forward, norms.RMSNorm) for m in fused)


def test_tied_weights_stay_tied(tmp_path: Path) -> None:
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=50,
        tie_word_embeddings=True,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    model = base_model.load(tmp_path, CPU)
    embed = model.get_input_embeddings().weight
    assert model.get_output_embeddings().weight is embed  # type: ignore[no-untyped-call]


def test_weights_bytes_reads_the_headers(tiny_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    cells = sum(t.numel() for t in model.state_dict().values() if t.dtype.is_floating_point)
    assert base_model.weights_bytes(tiny_dir, torch.float32) == 4 * cells
    assert base_model.weights_bytes(tiny_dir, torch.bfloat16) == 2 * cells


def test_few_rows_stores_the_linear_weights_transposed_and_computes_the_same(
    tiny_dir: Path,
) -> None:
    rows = base_model.load(tiny_dir, CPU)
    columns = base_model.load(tiny_dir, CPU, few_rows=True)
    linear = [n for n, m in columns.named_modules() if isinstance(m, torch.nn.Linear)]
    assert len(linear) == 2 * 7 + 1  # tiny's two layers' projections, and the head
    for name in linear:
        weight = columns.get_submodule(name).weight
        out, inputs = weight.shape
        assert weight.stride() == (1, out), name
        assert rows.get_submodule(name).weight.stride() == (inputs, 1), name
        assert torch.equal(weight, rows.get_submodule(name).weight), name
        assert weight.data_ptr() % 64 == 0, name
    ids = torch.randint(0, 512, (3, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = rows(input_ids=ids).logits, columns(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_torch_sampler_keeps_its_base_weights_transposed_on_the_cpu() -> None:
    engine = TorchEngine(models.default_cache_dir(), placement=CPU)
    engine.load_base(models.TINY)
    model = engine.bases[models.TINY].model
    projections = [m.base for m in model.modules() if isinstance(m, lora_slots.SlotLinear)]
    assert projections
    assert all(p.weight.stride() == (1, p.weight.shape[0]) for p in projections)
