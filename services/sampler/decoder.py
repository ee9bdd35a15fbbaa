"""The sampler's forward of the llama family (llama, mistral, qwen2, qwen3 without sliding-window
layers): the same arithmetic as transformers' forward of those models, in a fraction of its calls.

Profiled on a 6M-parameter Qwen2 (tinsmith/small, one CPU thread), a decoding step of 8 rows
through transformers' ``model(...)`` took 6.5 to 7.1 ms, of which the matrix products, which
stream the weights from memory, are about 3: the rest is its Python around them (the mask built
from the 2D padding mask at every call, the modules' hooks and configuration lookups, the
attention interface's dispatch). This forward walks the same modules (the embedding, each
layer's norms, projections, ``act_fn`` and the rotary embedding, so the LoRA slot layer's
``SlotLinear`` projections route each row to its adapter as in the trainer) but calls them
directly, with one attention mask per forward: 5.0 to 5.4 ms for the same step, 1.25 to 1.3x
(``bench/sample_throughput.py`` measures what it gives through the system). It calls each
module's ``forward`` itself, without the module call around it; while any of them has hooks,
it calls them as modules, so that the hooks run.

The arithmetic is transformers': each projection and activation is the model's own module, the
rotary embedding its ``rotary_emb``. The norms are the family's RMSNorm fused (services/norms.py:
bit for bit the module's on the CPU, one kernel on a GPU). The rotation is the family's
rotate-half formula (``apply_rotary_pos_emb``), applied to a layer's queries and keys together,
one set of operations where transformers has two, with the sign of the half turned once a
forward rather than at each layer (``_rotate``). Attention is
``scaled_dot_product_attention`` with the module's ``scaling``, a single query position's heads
grouped by key-value head (transformers' ``pack_gqa``), several positions' keys and values
repeated per query head (its ``repeat_kv``). What differs is only where rounding can (a GPU's
fused norm sums the squares in its own order):
the mask of a prefill is always given (transformers lets SDPA build the causal one where nothing
is padded), and a padding position attends to itself (transformers, to every column): its output
is never read, and so stays finite. Tested against ``model(...)`` to float32 rounding for each
architecture, with adapters, left-padding and a cache (tests/sampler/test_decoder.py).

The cache is transformers' ``DynamicCache`` of plain layers, so the engine's batch bookkeeping
(merging, selecting, trimming rows) is the same whichever forward fills it; only the appending is
this forward's own (``_append``): each layer's keys and values are the first columns of buffers
with room to grow, written in place instead of concatenated at every step.

Owns: the forward of a supported model, and which models are supported (``Decoder.of``). Does not
own: batching, sampling, or adapters (torch_engine.py, lora_slots.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules import module as module_hooks
from transformers import PreTrainedModel
from transformers.cache_utils import DynamicCache, DynamicLayer

from services import norms
from services.norms import Norm

Forward = Callable[[Tensor], Tensor]

# The decoder layers this forward computes exactly as transformers does: the same residual
# pattern (norm, attention, residual; norm, MLP, residual), projections q/k/v/o and
# gate/up/down, and, for Qwen3, a norm of each head's queries and keys before the rotation.
LAYERS = frozenset(
    {"LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer"}
)


@dataclass(frozen=True)
class Output:
    """What a forward gives: the logits of the positions kept, and the cache it appended to."""

    logits: Tensor  # [rows, positions kept, vocab], in the model's dtype
    past_key_values: DynamicCache


@dataclass(frozen=True)
class _Layer:
    input_norm: Norm
    q: Forward
    k: Forward
    v: Forward
    o: Forward
    q_norm: Norm | None  # Qwen3's per-head norms
    k_norm: Norm | None
    post_norm: Norm
    gate: Forward
    up: Forward
    down: Forward
    act: Forward
    heads: int
    kv_heads: int
    head_dim: int
    scaling: float


@dataclass(frozen=True)
class _Calls:
    """What a forward calls, each module as ``call`` gives it (the module, or its forward)."""

    embed: Forward
    rotary: Callable[..., tuple[Tensor, Tensor]]
    head: Forward
    layers: list[_Layer]

    @classmethod
    def of(cls, model: PreTrainedModel, call: Callable[[nn.Module], Callable[..., Any]]) -> _Calls:
        inner = model.get_decoder()  # type: ignore[no-untyped-call]
        config = model.config
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        layers = [
            _Layer(
                input_norm=norms.fused(layer.input_layernorm),
                q=call(layer.self_attn.q_proj),
                k=call(layer.self_attn.k_proj),
                v=call(layer.self_attn.v_proj),
                o=call(layer.self_attn.o_proj),
                q_norm=_maybe_norm(getattr(layer.self_attn, "q_norm", None)),
                k_norm=_maybe_norm(getattr(layer.self_attn, "k_norm", None)),
                post_norm=norms.fused(layer.post_attention_layernorm),
                gate=call(layer.mlp.gate_proj),
                up=call(layer.mlp.up_proj),
                down=call(layer.mlp.down_proj),
                act=call(layer.mlp.act_fn),
                heads=heads,
                kv_heads=kv_heads,
                head_dim=layer.self_attn.head_dim,
                scaling=float(layer.self_attn.scaling),
            )
            for layer in inner.layers
        ]
        head = model.get_output_embeddings()  # type: ignore[no-untyped-call]
        return cls(call(inner.embed_tokens), call(inner.rotary_emb), call(head), layers)

    def modules(self) -> list[nn.Module]:
        """What this calls, where it calls modules."""
        called: list[object] = [self.embed, self.rotary, self.head]
        for layer in self.layers:
            called += [layer.q, layer.k, layer.v, layer.o, layer.gate, layer.up, layer.down]
            called.append(layer.act)
        return [m for m in called if isinstance(m, nn.Module)]


class Decoder:
    """The lean forward of one loaded model (``Decoder.of``)."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self.norm = norms.fused(model.get_decoder().norm)  # type: ignore[no-untyped-call]
        # Its modules' forwards, called without the module call around it (its hook and
        # tracing checks: a few microseconds a call, 2.8% of a tinsmith/small decoding step of
        # 50 such calls); and the modules, called as modules while any has hooks, so they run.
        self._direct = _Calls.of(model, lambda module: module.forward)
        self._as_modules = _Calls.of(model, lambda module: module)
        self._called = self._as_modules.modules()

    @classmethod
    def of(cls, model: PreTrainedModel) -> Decoder | None:
        """The lean forward of ``model``, or None where it computes something else (another
        architecture, sliding-window layers): such a model runs through ``model(...)``."""
        return cls(model) if why_not(model) is None else None

    def cache(self) -> DynamicCache:
        """An empty cache for a prefill."""
        return DynamicCache(config=self.model.config)

    def __call__(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        position_ids: Tensor,
        past_key_values: DynamicCache | None = None,
        logits_to_keep: int = 1,
        room: int = 0,
    ) -> Output:
        """``model(input_ids=..., attention_mask=..., position_ids=..., past_key_values=...,
        use_cache=True, logits_to_keep=...)``: ``input_ids`` and ``position_ids`` [rows, new
        positions], ``attention_mask`` [rows, cached + new columns] (1 where a column holds a
        token, 0 for padding), the cache appended to (a new one when None), the logits of the
        last ``logits_to_keep`` positions (0: all). A cache layer that has to grow to take the
        new positions grows by ``room`` columns more (``_append``)."""
        cache = past_key_values if past_key_values is not None else self.cache()
        new = input_ids.shape[1]
        calls = self._as_modules if self._hooked() else self._direct
        hidden = calls.embed(input_ids)
        cos, sin = calls.rotary(hidden, position_ids)
        cos, signed_sin = cos.unsqueeze(1), _signed(sin.unsqueeze(1))  # [rows, 1, new, head_dim]
        mask = _attention_mask(attention_mask, new)
        for index, layer in enumerate(calls.layers):
            residual = hidden
            hidden = layer.input_norm(hidden)
            cached = cast(DynamicLayer, cache.layers[index])  # plain layers only (why_not)
            hidden = self._attention(layer, cached, hidden, cos, signed_sin, mask, room)
            hidden = residual + hidden
            residual = hidden
            hidden = layer.post_norm(hidden)
            hidden = layer.down(layer.act(layer.gate(hidden)) * layer.up(hidden))
            hidden = residual + hidden
        hidden = self.norm(hidden)
        kept = hidden if logits_to_keep == 0 else hidden[:, -logits_to_keep:, :]
        return Output(calls.head(kept), cache)

    def _hooked(self) -> bool:
        """Whether a module this forward calls has forward hooks, or hooks for every module
        are registered (``register_module_forward_hook``)."""
        if module_hooks._global_forward_hooks or module_hooks._global_forward_pre_hooks:
            return True
        return any(m._forward_hooks or m._forward_pre_hooks for m in self._called)

    def _attention(
        self,
        layer: _Layer,
        cached: DynamicLayer,
        hidden: Tensor,
        cos: Tensor,
        signed_sin: Tensor,
        mask: Tensor,
        room: int,
    ) -> Tensor:
        rows, new, _ = hidden.shape
        shape = (rows, new, -1, layer.head_dim)
        q, k = layer.q(hidden).view(shape), layer.k(hidden).view(shape)
        if layer.q_norm is not None and layer.k_norm is not None:
            q, k = layer.q_norm(q), layer.k_norm(k)
        v = layer.v(hidden).view(shape).transpose(1, 2)
        rotated = _rotate(torch.cat((q, k), dim=2).transpose(1, 2), cos, signed_sin)
        q, k = rotated[:, : layer.heads], rotated[:, layer.heads :]
        keys, values = self._append(cached, k, v, room)
        groups = layer.heads // layer.kv_heads
        if new == 1 and groups > 1:
            # One position: its query heads grouped by their key-value head, as positions of it.
            packed = q.reshape(rows, layer.kv_heads, groups, layer.head_dim)
            out = F.scaled_dot_product_attention(
                packed, keys, values, attn_mask=mask, scale=layer.scaling
            ).reshape(rows, layer.heads, 1, layer.head_dim)
        else:
            if groups > 1:
                keys, values = _repeat(keys, groups), _repeat(values, groups)
            out = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask, scale=layer.scaling
            )
        projected: Tensor = layer.o(out.transpose(1, 2).reshape(rows, new, -1))
        return projected

    def _append(
        self, layer: DynamicLayer, keys: Tensor, values: Tensor, room: int
    ) -> tuple[Tensor, Tensor]:
        """``layer.update(keys, values)`` without copying the cache at every step: the layer's
        keys and values are the first columns of buffers with room for more columns (their
        strides say how many: ``_whole``), and the new positions are written after them. Where
        they are not (a new cache, or the engine merged, selected or trimmed rows, which makes
        new tensors) or the room is used up, they are copied into new buffers with ``room``
        columns to spare: the engine passes what its memory plan reserved for the rows (their
        tokens still to sample, over the rows), so that the buffers hold no more than was
        planned. The tensors own their buffers: nothing else keeps one alive."""
        if not layer.is_initialized:
            layer.lazy_initialization(keys, values)
        held_keys, held_values = layer.keys, layer.values
        assert held_keys is not None and held_values is not None
        length = held_keys.shape[-2] if held_keys.numel() else 0
        total = length + keys.shape[-2]
        whole_keys, whole_values = _whole(held_keys, total), _whole(held_values, total)
        if whole_keys is None or whole_values is None:
            shape = (*keys.shape[:-2], total + room, keys.shape[-1])
            whole_keys, whole_values = keys.new_empty(shape), values.new_empty(shape)
            if length:
                whole_keys[..., :length, :] = held_keys
                whole_values[..., :length, :] = held_values
        whole_keys[..., length:total, :] = keys
        whole_values[..., length:total, :] = values
        layer.keys, layer.values = whole_keys[..., :total, :], whole_values[..., :total, :]
        return layer.keys, layer.values


def _maybe_norm(module: nn.Module | None) -> Norm | None:
    return None if module is None else norms.fused(module)


def _signed(sin: Tensor) -> Tensor:
    """``sin`` with its first half negated: what ``_rotate`` multiplies the halves of ``x``,
    swapped, by."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def _rotate(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """The family's rotary embedding of ``x`` [rows, heads, positions, head_dim], with ``cos``
    and ``_signed(sin)`` [rows, 1, positions, head_dim]: ``x * cos + rotate_half(x) * sin``, as
    ``apply_rotary_pos_emb`` computes it for queries and for keys. ``rotate_half(x)`` is the
    halves swapped, the first negated; negating ``sin``'s first half once a forward instead
    gives the same products bit for bit, and the swap is one ``roll``: two operations fewer for
    each layer."""
    return (x * cos) + (x.roll(x.shape[-1] // 2, dims=-1) * signed_sin)


def _whole(held: Tensor, total: int) -> Tensor | None:
    """The buffer ``held`` ([rows, heads, columns, size]) is the first columns of, seen whole,
    when it has room for ``total`` columns; None when it has not, or ``held`` is no such view
    (a tensor of its own, a view that starts elsewhere)."""
    if held.dim() != 4 or held.numel() == 0 or held.storage_offset() != 0:
        return None
    rows, heads, _, size = held.shape
    if held.stride(3) != 1 or held.stride(2) != size or held.stride(1) % size:
        return None
    capacity = held.stride(1) // size
    if capacity < total or held.stride(0) != heads * capacity * size:
        return None
    if held.untyped_storage().nbytes() < rows * held.stride(0) * held.element_size():
        return None
    return held.as_strided((rows, heads, capacity, size), held.stride())


def why_not(model: PreTrainedModel) -> str | None:
    """Why ``Decoder`` does not compute ``model`` as transformers does, or None when it does."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        return "it has no list of decoder layers"
    kind = type(layers[0]).__name__
    if kind not in LAYERS:
        return f"its decoder layers are {kind}, not one of {', '.join(sorted(LAYERS))}"
    if not all(type(layer) is DynamicLayer for layer in DynamicCache(config=model.config).layers):
        return "it has sliding-window attention layers"
    if getattr(model.config, "pretraining_tp", 1) != 1:
        return "its projections are split for tensor parallelism (pretraining_tp)"
    return None


def _attention_mask(columns: Tensor, new: int) -> Tensor:
    """The attention mask of ``new`` positions at the end of ``columns`` ([rows, columns], 1 for
    a token): [rows, 1, new, columns], True where a position attends: to every earlier or same
    column that holds a token, and always to itself (a padding position too, so that its output
    stays finite)."""
    held = columns.bool()[:, None, None, :]
    if new == 1:
        return held
    width = columns.shape[1]
    here = torch.arange(width - new, width, device=columns.device)[:, None]
    there = torch.arange(width, device=columns.device)[None, :]
    return (held & (there <= here)) | (there == here)


def _repeat(states: Tensor, groups: int) -> Tensor:
    """[rows, kv heads, columns, size] with each key-value head repeated for its query heads."""
    rows, kv_heads, columns, size = states.shape
    expanded = states[:, :, None].expand(rows, kv_heads, groups, columns, size)
    return expanded.reshape(rows, kv_heads * groups, columns, size)
