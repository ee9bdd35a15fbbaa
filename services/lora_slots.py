"""One LoRA layer for the trainer and the sampler: every adapter of a base model in a slot of
stacked tensors, and each row of a forward routed to its own adapter, or to none.

PEFT adds modules per adapter and, for a batch whose rows use different adapters, walks every
adapter it holds in every layer: a step's cost grows with the adapters loaded, and loading one
is module surgery (measured: a one-row SmolLM2 sampling step from 97 to 150 ms as adapters went
from 1 to 32, ``load_adapter`` from 0.28 to 1.28 s). Here the base model's target ``nn.Linear``
modules are wrapped once, when the base is loaded (``install``), by a ``SlotLinear`` that holds,
per module and per rank class (8, 16, 32 ... up to ``max_rank``: an adapter goes into the
smallest at least its rank), ``A`` stacked as ``[n, class, in]`` and ``B`` as ``[n, out,
class]``, in float32 whatever the base's dtype. Loading an adapter copies its tensors into a free
place of its class's stacks (zeros past its rank: the padding adds nothing), growing them by
doubling when none is free; unloading frees the place. No module is added or removed after
``install``.

A forward runs inside ``Slots.routed(row_slots)``: row ``i`` of the batch uses slot
``row_slots[i]``, or no adapter for ``NO_ADAPTER``. Each wrapped module computes the base output,
then, for the rows that have an adapter on this module only, takes them (as views where each slot's
rows are one range, as in a trainer's pass; else gathered in slot order) and computes ``(x @ A[s]^T)
@ (B[s] * scale[s])^T`` for every slot of a rank class in one call: torch's grouped matmul
(``torch._grouped_mm``, with the rows' offsets per slot) where it runs float32, else one batched
matmul where the slots' rows are as many, else a plain matmul per slot. A base-model row costs
nothing more than the base; a step's cost follows the rows and the distinct adapters and rank
classes in the batch, not the adapters loaded. The arithmetic is PEFT's: the input cast to float32,
the delta computed in float32. A range of one adapter's rows (a run's pass alone, a sampler's rows
of one adapter) computes PEFT's product ``x @ A^T @ B^T`` with the slot's ``A`` and ``B`` at its
own rank, as views of the stacks. In float32 the second product, the scale and the sum are one
call into the base output where autograd allows it (``addmm_``, or ``baddbmm_`` for a batch of
equal ranges over every row: ``SlotLinear._by_spans``; a sampler's decoding step of 8
tinsmith/small rows through one adapter went from 7.2 to 2.3 ms over the base's); else the scale
goes on the rank-sized ``x @ A^T``, and several slots in one grouped call, or gathered rows, put
it on ``B``. Both are small tensors, where PEFT scales every row's delta, a pass over the output
each way (float32 rounding apart, the same). Where rows are gathered, the delta is added to their
base output in float32 and the sum cast back to the base's dtype; where each slot's rows are one
range, the delta is cast to the base's dtype and added in place to the range's rows of the base
output, so a trainer's pass builds nothing of the size of the whole output again (the same in
float32; in bfloat16, the delta rounded once more). How a module's input is cut into ranges is
worked out once per forward for the modules an adapter set applies to (``_Route.pieces``).

For training, ``Slots.bind`` gives a slot's adapter as float32 ``nn.Parameter``s of its own rank
that alias its places in the stacks (re-pointed when the stacks grow or are packed): an
optimizer's step on them is what the next forward computes with, and a forward with gradients
enabled builds each class's stack from the bound parameters (zero-padded to the class; a range
of one run's rows uses them as they are), so that backward gives every bound slot the gradient of
its own rows only. Several runs are trained in
one pass that way, each with its own optimizer.

Adapters on disk stay PEFT's (``adapter_config.json`` + ``adapter_model.safetensors``):
``read_adapter`` reads one (refusing what the layer does not compute: DoRA, per-module ranks),
``peft_weights`` maps a PEFT state dict to the modules here, ``to_peft`` maps back.

Owns: the slot layer, routing, and PEFT's adapter format. Does not own: which modules a run
targets (tinsmith/lora.py), or the device and its memory (the engines).
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import Tensor, nn

from tinsmith import artifacts

NO_ADAPTER = -1
# The ranks the stacks come in: an adapter goes into the smallest at least its rank, so that a
# rank-8 adapter does not take a rank-128 one's memory (an adapter of rank 5 pads to 8).
SMALLEST_CLASS = 8
# PEFT's state-dict keys: "base_model.model.<module path>.lora_A.weight" (and lora_B).
_PEFT_PREFIX = "base_model.model."
_PEFT_SUFFIXES = {"A": ".lora_A.weight", "B": ".lora_B.weight"}


def rank_class(rank: int) -> int:
    """The stack an adapter of ``rank`` goes into: the smallest power of two at least ``rank``,
    and at least ``SMALLEST_CLASS``."""
    return max(SMALLEST_CLASS, 1 << (rank - 1).bit_length())


@dataclass(frozen=True)
class _Route:
    """A forward's rows grouped by slot: for each slot used (ascending), the rows that use it."""

    slots: tuple[int, ...]
    rows: tuple[Tensor, ...]  # int64 row indices on the device, one tensor per slot
    total: int  # the rows of the forward, with and without an adapter
    # Each slot's rows as one range (start, end), where every slot's rows are consecutive (a
    # trainer's pass: each run's datums together; a sampler's batch of one adapter's rows): a
    # module then splits its input into them instead of gathering them, and adds each one's
    # delta in place. None otherwise.
    spans: tuple[tuple[int, int], ...] | None
    # How a module whose adapters are these slots cuts its input (``_pieces``), made by the
    # first such module of the forward and used by the others.
    pieces: dict[frozenset[int], _Pieces] = field(default_factory=dict, compare=False)


# A module's input cut into row ranges, in row order: each range's size, and for a range the
# adapters apply to, (start, end, rank class, [(slot, index in the class's stacks, rows)]),
# None for rows no adapter of the module applies to.
_Piece = tuple[int, int, int, list[tuple[int, int, int]]]
_Pieces = tuple[list[int], list[_Piece | None]]


@dataclass
class Slots:
    """The adapter slots of one base model, shared by its wrapped modules. A slot is a handle:
    its adapter lives at an index of the stack of its rank class in every module."""

    max_rank: int
    device: torch.device
    modules: dict[str, SlotLinear] = field(default_factory=dict)  # by module path
    ranks: dict[int, int] = field(default_factory=dict)  # occupied slot -> its adapter's rank
    where: dict[int, tuple[int, int]] = field(default_factory=dict)  # slot -> (class, index)
    capacity: dict[int, int] = field(default_factory=dict)  # rank class -> stack length
    # Trainable slots: module path -> (A [rank, in], B [out, rank]) aliasing the stacks.
    bound: dict[int, dict[str, tuple[nn.Parameter, nn.Parameter]]] = field(default_factory=dict)
    route: _Route | None = None  # the forward being run
    _next: int = 0  # the next slot handle
    scales: dict[int, float] = field(default_factory=dict)  # occupied slot -> its scale

    def nbytes(self) -> int:
        """The stacks' bytes: what the slots take on the device, used or not (every module has
        a stack of each rank class, as long as the class's capacity)."""
        return sum(length * self._place_bytes(klass) for klass, length in self.capacity.items())

    def _place_bytes(self, klass: int) -> int:
        """One place of a rank class across every module's stacks: its A, B and scale."""
        return sum(
            4 * (klass * (m.base.in_features + m.base.out_features) + 1)
            for m in self.modules.values()
        )

    def load(self, weights: Mapping[str, tuple[Tensor, Tensor]], rank: int, scale: float) -> int:
        """Copy an adapter into a free place of its rank class's stacks (growing them if none is
        free) and return its slot. ``weights``: for each module path it targets, its
        ``(A [rank, in], B [out, rank])``; the modules it does not name get no delta from it."""
        if not 0 < rank <= self.max_rank:
            raise ValueError(f"rank {rank} is outside 1..{self.max_rank}, the slots' maximum")
        unknown = sorted(set(weights) - set(self.modules))
        if unknown:
            raise ValueError(f"the adapter names modules the base has no slot for: {unknown[:3]}")
        klass = rank_class(rank)
        taken = {index for c, index in self.where.values() if c == klass}
        size = self.capacity.get(klass, 0)
        index = next((i for i in range(size) if i not in taken), size)
        if index == size:
            self._grow(klass, max(1, 2 * size))
        slot, self._next = self._next, self._next + 1
        with torch.no_grad():
            for path, module in self.modules.items():
                module.put(slot, klass, index, weights.get(path), rank, scale)
        self.ranks[slot] = rank
        self.scales[slot] = scale
        self.where[slot] = (klass, index)
        return slot

    def bytes_of(self, weights: Mapping[str, tuple[Tensor, Tensor]], rank: int) -> int:
        """What an adapter takes in the stacks: its modules' places at its rank class."""
        klass = rank_class(rank)
        total = 0
        for path in weights:
            base = self.modules[path].base
            total += 4 * (klass * (base.in_features + base.out_features) + 1)
        return total

    def growth_bytes(self, rank: int) -> int:
        """What the stacks grow by to take one more adapter of ``rank`` (0 with a free place)."""
        klass = rank_class(rank)
        size = self.capacity.get(klass, 0)
        if sum(1 for c, _ in self.where.values() if c == klass) < size:
            return 0
        return self._place_bytes(klass) * (max(1, 2 * size) - size)

    def reserve(self, rank: int, count: int) -> None:
        """Make the stacks of ``rank``'s class hold ``count`` adapters, so that loading one
        of them copies nothing else."""
        klass = rank_class(rank)
        if self.capacity.get(klass, 0) < count:
            self._grow(klass, count)

    def shrink(self, slack: float = 1.0) -> int:
        """Give back the stacks' free places: a rank class whose stacks are more than ``slack``
        times as long as its adapters need is packed into stacks just long enough (its adapters
        move to the first places; their slots stay). Returns the bytes given back."""
        before = self.nbytes()
        for klass, length in list(self.capacity.items()):
            owners = sorted((index, slot) for slot, (c, index) in self.where.items() if c == klass)
            if length <= slack * len(owners):
                continue
            order = [index for index, _ in owners]
            for module in self.modules.values():
                module.pack(klass, order)
            for new_index, (_, slot) in enumerate(owners):
                self.where[slot] = (klass, new_index)
            self.capacity[klass] = len(owners)
            if not owners:
                del self.capacity[klass]
            self._rebind(klass)
        return before - self.nbytes()

    def _grow(self, klass: int, length: int) -> None:
        for module in self.modules.values():
            module.resize(klass, length)
        self.capacity[klass] = length
        self._rebind(klass)

    def _rebind(self, klass: int) -> None:
        """Point the bound parameters of ``klass``'s slots at their places in its new stacks
        (the same Parameter objects: an optimizer keeps its state for them)."""
        for slot, params in self.bound.items():
            if self.where[slot][0] != klass:
                continue
            rank = self.ranks[slot]
            for path, (a, b) in params.items():
                stack_a, stack_b = self.modules[path].slices(slot)
                assert stack_a is not None and stack_b is not None
                a.data, b.data = stack_a[:rank], stack_b[:, :rank]

    def unload(self, slot: int) -> None:
        """Free a slot (its place is overwritten by the next adapter loaded there)."""
        if self.ranks.pop(slot, None) is None:
            return
        del self.where[slot], self.scales[slot]
        self.bound.pop(slot, None)
        for module in self.modules.values():
            module.present.discard(slot)
            module._views.pop(slot, None)

    def weights(self, slot: int) -> dict[str, tuple[Tensor, Tensor]]:
        """A slot's adapter as ``{module path: (A [rank, in], B [out, rank])}`` (copies)."""
        rank = self.ranks[slot]
        found = {}
        for path, module in self.modules.items():
            a, b = module.slices(slot)
            if a is not None and b is not None:
                found[path] = (a[:rank].detach().clone(), b[:, :rank].detach().clone())
        return found

    def bind(self, slot: int) -> dict[str, tuple[nn.Parameter, nn.Parameter]]:
        """The slot's adapter as trainable float32 parameters, ``{module path: (A [rank, in],
        B [out, rank])}``, that alias its places in the stacks: what is done to them (an
        optimizer's step, a checkpoint copied in) the forwards compute with, and a forward with
        gradients enabled gives them the gradient of the slot's own rows. The same objects for
        as long as the slot holds its adapter."""
        params = self.bound.get(slot)
        if params is None:
            rank = self.ranks[slot]
            params = {}
            for path, module in self.modules.items():
                a, b = module.slices(slot)
                if a is not None and b is not None:
                    params[path] = (
                        nn.Parameter(a[:rank].detach()),
                        nn.Parameter(b[:, :rank].detach()),
                    )
            self.bound[slot] = params
        return params

    @contextlib.contextmanager
    def routed(self, row_slots: Sequence[int] | Tensor) -> Iterator[None]:
        """Run the forwards inside with row ``i`` (of the first dimension of each module's
        input: a sequence, or a position of flattened ones) using slot ``row_slots[i]``
        (``NO_ADAPTER``: none). Routes nest: the one outside is back after the block."""
        if isinstance(row_slots, Tensor):
            row_slots = row_slots.tolist()
        used = tuple(sorted(set(row_slots) - {NO_ADAPTER}))
        slots = torch.as_tensor(row_slots, dtype=torch.int64, device="cpu")
        for slot in used:
            if slot not in self.ranks:
                row = int((slots == slot).nonzero()[0])
                raise ValueError(f"row {row} is routed to slot {slot}, which holds no adapter")
        found = [(slots == s).nonzero().flatten() for s in used]
        spans = tuple((int(r[0]), int(r[-1]) + 1) for r in found)
        consecutive = all(
            end - start == len(r) for (start, end), r in zip(spans, found, strict=True)
        )
        rows = tuple(r.to(self.device) for r in found)
        # Rows that all go without an adapter are no route at all: each module is its base.
        route = _Route(used, rows, len(slots), spans if consecutive else None) if used else None
        outer, self.route = self.route, route
        try:
            yield
        finally:
            self.route = outer


@dataclass
class _Stack:
    """One rank class's adapters on one module: ``A`` [n, rank, in], ``B`` [n, out, rank]."""

    A: Tensor
    B: Tensor
    scale: Tensor  # [n]


class SlotLinear(nn.Module):
    """A frozen ``nn.Linear`` plus the LoRA delta of each row's adapter (see the module doc)."""

    def __init__(self, base: nn.Linear, slots: Slots, path: str) -> None:
        super().__init__()
        self.base = base
        # The base's parameters by name, read at each call: without the module's attribute
        # lookup (``nn.Module.__getattr__``, three a call, 1-2% of a decoding step).
        self._base_parameters = base._parameters
        self.slots = slots
        self.path = path  # in the model: the key of this module's parameters in ``Slots.bound``
        # Plain tensors, not nn.Parameters: a trained slot's parameters alias its places.
        self.stacks: dict[int, _Stack] = {}
        self.present: set[int] = set()  # the slots whose adapter targets this module
        # Each slot's ``A`` and ``B`` at its rank, as views of the stacks (``_own``); dropped
        # whenever the stacks are written or replaced.
        self._views: dict[int, tuple[Tensor, Tensor]] = {}

    def nbytes(self) -> int:
        return sum(s.A.nbytes + s.B.nbytes + s.scale.nbytes for s in self.stacks.values())

    def resize(self, klass: int, length: int) -> None:
        self._views.clear()
        weight = self.base.weight
        old = self.stacks.get(klass)
        new = _Stack(
            A=torch.zeros(length, klass, self.base.in_features, device=weight.device),
            B=torch.zeros(length, self.base.out_features, klass, device=weight.device),
            scale=torch.zeros(length, device=weight.device),
        )
        if old is not None:
            kept = old.A.shape[0]
            with torch.no_grad():
                new.A[:kept], new.B[:kept], new.scale[:kept] = old.A, old.B, old.scale
        self.stacks[klass] = new

    def pack(self, klass: int, order: list[int]) -> None:
        """Keep only the places ``order`` of a rank class's stacks, in that order."""
        self._views.clear()
        stack = self.stacks[klass]
        if not order:
            del self.stacks[klass]
            return
        kept = torch.tensor(order, dtype=torch.int64, device=stack.A.device)
        with torch.no_grad():
            packed = _Stack(
                A=stack.A.index_select(0, kept),
                B=stack.B.index_select(0, kept),
                scale=stack.scale.index_select(0, kept),
            )
        self.stacks[klass] = packed

    def put(
        self,
        slot: int,
        klass: int,
        index: int,
        pair: tuple[Tensor, Tensor] | None,
        rank: int,
        scale: float,
    ) -> None:
        self._views.clear()
        stack = self.stacks[klass]
        stack.A[index].zero_()
        stack.B[index].zero_()
        stack.scale[index] = scale if pair is not None else 0.0
        if pair is None:
            self.present.discard(slot)
            return
        a, b = pair
        stack.A[index, :rank] = a.to(stack.A.device, torch.float32)
        stack.B[index, :, :rank] = b.to(stack.B.device, torch.float32)
        self.present.add(slot)

    def slices(self, slot: int) -> tuple[Tensor | None, Tensor | None]:
        """The slot's ``A`` [class, in] and ``B`` [out, class] on this module (views of the
        stacks); None where it does not target it."""
        if slot not in self.present:
            return None, None
        klass, index = self.slots.where[slot]
        stack = self.stacks[klass]
        return stack.A[index], stack.B[index]

    def _pairs(self, klass: int, groups: Sequence[tuple[int, int]]) -> tuple[Tensor, Tensor]:
        """The ``A`` [g, class, in] and ``B`` [g, out, class] times its scale of the
        ``(slot, index)`` of ``groups`` (one rank class): picked from the stacks, or, with
        gradients enabled and a bound slot among them, stacked from the bound parameters (padded
        with zeros to the class), so that the backward reaches them. The scale goes on ``B``,
        a small tensor, rather than on every row's delta."""
        stack = self.stacks[klass]
        used = torch.tensor([i for _, i in groups], dtype=torch.int64, device=stack.A.device)
        scale = stack.scale.index_select(0, used)[:, None, None]
        bound = self.slots.bound
        if not (torch.is_grad_enabled() and any(slot in bound for slot, _ in groups)):
            return stack.A.index_select(0, used), stack.B.index_select(0, used) * scale
        a_parts, b_parts = [], []
        for slot, index in groups:
            params = bound.get(slot)
            if params is None:
                a_parts.append(stack.A[index])
                b_parts.append(stack.B[index])
                continue
            a, b = params[self.path]
            pad = klass - a.shape[0]
            a_parts.append(nn.functional.pad(a, (0, 0, 0, pad)) if pad else a)
            b_parts.append(nn.functional.pad(b, (0, pad)) if pad else b)
        return torch.stack(a_parts), torch.stack(b_parts) * scale

    def forward(self, x: Tensor) -> Tensor:
        parameters = self._base_parameters
        weight, bias = cast(Tensor, parameters["weight"]), parameters.get("bias")
        route = self.slots.route
        if route is not None and route.spans is not None:
            return self._by_spans(x, weight, bias, route)
        out = nn.functional.linear(x, weight, bias)
        if route is None:
            return out
        by_class: dict[int, list[tuple[int, int, Tensor]]] = {}
        for slot, rows in zip(route.slots, route.rows, strict=True):
            if slot in self.present:
                klass, index = self.slots.where[slot]
                by_class.setdefault(klass, []).append((slot, index, rows))
        if not by_class:
            return out
        all_rows, deltas = [], []
        for klass, groups in sorted(by_class.items()):
            rows = torch.cat([r for _, _, r in groups]) if len(groups) > 1 else groups[0][2]
            picked = x.index_select(0, rows)  # [n, ..., in]: this class's rows with an adapter
            flat = picked.reshape(-1, picked.shape[-1]).to(torch.float32)
            per_row = flat.shape[0] // rows.numel()  # tokens per row
            counts = [r.numel() * per_row for _, _, r in groups]
            a, b = self._pairs(klass, [(slot, index) for slot, index, _ in groups])
            delta = _segment_lora(flat, a, b, counts)
            deltas.append(delta.view(*picked.shape[:-1], delta.shape[-1]))
            all_rows.append(rows)
        rows = torch.cat(all_rows) if len(all_rows) > 1 else all_rows[0]
        delta = torch.cat(deltas) if len(deltas) > 1 else deltas[0]
        merged = out.index_select(0, rows).to(torch.float32) + delta
        return out.index_copy(0, rows, merged.to(out.dtype))

    def _by_spans(self, x: Tensor, weight: Tensor, bias: Tensor | None, route: _Route) -> Tensor:
        """The forward of a route whose slots each have one range of rows: ``x`` split into the
        ranges (views, whose backward is one join), and each range's delta (an ``x A^T B^T``; a
        rank class's adjacent ranges in one call, ``_pieces``) added in place to its tokens of
        the base output (whose backward passes the gradient through), so that nothing of the
        size of the whole output is built again. The delta is computed in float32 and added in
        the output's dtype.

        In float32 the second product, the scale and the sum are one call into the output
        (``addmm_`` for one adapter's range, ``baddbmm_`` for a batch of equal ranges that
        covers every row: a fused pass's runs). For that, the base output is computed as a
        tensor of that call's shape, [tokens, out] or [ranges, tokens, out], and viewed back to
        ``x``'s shape at the end: a product added in place to the whole of a tensor is one
        autograd node, where one added to a view of it would rewrite the tensor's history.
        Measured on the CPU (tinsmith/small, one thread, against the product, then the sum,
        alternating in one process): a trainer's pass of one run 1.04-1.09x as fast at 2 x 128
        tokens and 1.06x at 16; a fused pass of 4 such runs 1.01-1.04x; a sampler's forward of
        8 adapters' 8 rows each 1.085x a decoding step, 1.076x a 32-token prefill."""
        present = frozenset(slot for slot in route.slots if slot in self.present)
        if not present:
            return nn.functional.linear(x, weight, bias)
        pieces = route.pieces.get(present)
        if pieces is None:
            pieces = route.pieces[present] = self._pieces(route, present, x.device)
        sizes, plan = pieces
        tokens = x.reshape(-1, x.shape[-1])
        per_row = tokens.shape[0] // route.total  # tokens per row
        only = plan[0] if len(plan) == 1 else None
        batch = len(only[3]) if only is not None and not _grouped_mm_works(x.device) else 1
        out = nn.functional.linear(
            tokens.reshape(batch, -1, tokens.shape[-1]) if batch > 1 else tokens, weight, bias
        )
        split = torch.split(tokens, [n * per_row for n in sizes]) if len(sizes) > 1 else (tokens,)
        grad = torch.is_grad_enabled()
        for piece, part in zip(split, plan, strict=True):
            if part is None:
                continue
            start, end, klass, members = part
            whole = end - start == route.total
            flat = piece.to(torch.float32)
            if len(members) == 1:
                slot, index, _ = members[0]
                a, b = self._own(slot, klass, index)
                hidden, scale = F.linear(flat, a), self.slots.scales[slot]
                if out.dtype == torch.float32 and (whole or not grad):
                    # The whole output itself (see above), or a range of it as a view.
                    target = out if whole else out[start * per_row : end * per_row]
                    target.addmm_(hidden, b.T, alpha=scale)  # target += scale hidden B^T
                    continue
                # The scale on the rank-sized hidden, not on the output-sized delta.
                delta = F.linear(hidden * scale, b)
            else:
                a, b = self._pairs(klass, [(slot, index) for slot, index, _ in members])
                if batch > 1 and out.dtype == torch.float32:  # a batch over every row
                    hidden = torch.bmm(flat.reshape(batch, -1, flat.shape[-1]), a.transpose(1, 2))
                    out.baddbmm_(hidden, b.transpose(1, 2))
                    continue
                delta = _segment_lora(flat, a, b, [rows * per_row for _, _, rows in members])
            added = delta.to(out.dtype)
            if whole:
                out.add_(added.view(out.shape))
            elif grad:
                # Autograd takes an in-place add to a range of the base output (a tensor that
                # needed no gradient until now) only as index_add_ (whose backward gathers the
                # range's gradient: a pass of one run's rows is the case above, without it).
                at = torch.arange(start * per_row, end * per_row, device=out.device)
                out.index_add_(0, at, added)
            else:
                out[start * per_row : end * per_row].add_(added)
        return out.view(*x.shape[:-1], out.shape[-1])

    def _own(self, slot: int, klass: int, index: int) -> tuple[Tensor, Tensor]:
        """One slot's ``A`` [rank, in] and ``B`` [out, rank] on this module, as they are: views
        of its places in the stacks at its own rank (nothing copied), or, with gradients enabled
        and the slot bound, its parameters (the same memory), so that the backward reaches
        them."""
        if torch.is_grad_enabled() and slot in self.slots.bound:
            return self.slots.bound[slot][self.path]
        views = self._views.get(slot)
        if views is None:
            stack, rank = self.stacks[klass], self.slots.ranks[slot]
            views = self._views[slot] = (stack.A[index, :rank], stack.B[index, :, :rank])
        return views

    def _pieces(self, route: _Route, present: frozenset[int], device: torch.device) -> _Pieces:
        """How this module cuts its input for ``route``, given the route's slots whose adapters
        apply to it: the ranges in row order (adjacent ranges of one rank class are one where a
        grouped matmul runs, or where they are of one size, for a batched one: ``_segment_lora``),
        and the rows between them that no adapter applies to."""
        assert route.spans is not None
        ranges: list[_Piece] = []
        grouped = _grouped_mm_works(device)
        for (start, end), slot in sorted(zip(route.spans, route.slots, strict=True)):
            if slot not in present:
                continue
            klass, index = self.slots.where[slot]
            last = ranges[-1] if ranges else None
            if (
                last is not None
                and last[1] == start
                and last[2] == klass
                and (grouped or last[3][0][2] == end - start)  # grouped, or batched (_segment_lora)
            ):
                ranges[-1] = (last[0], end, klass, [*last[3], (slot, index, end - start)])
            else:
                ranges.append((start, end, klass, [(slot, index, end - start)]))
        sizes: list[int] = []
        plan: list[_Piece | None] = []
        at = 0
        for part in ranges:
            start, end = part[0], part[1]
            if start > at:
                sizes.append(start - at)
                plan.append(None)
            sizes.append(end - start)
            plan.append(part)
            at = end
        if at < route.total:
            sizes.append(route.total - at)
            plan.append(None)
        return sizes, plan


def _segment_lora(x: Tensor, a: Tensor, b: Tensor, counts: list[int]) -> Tensor:
    """``x`` [N, in] in consecutive segments of ``counts`` rows, segment ``g`` times
    ``a[g]^T`` [in, r] then ``b[g]^T`` [r, out]: [N, out]. One grouped matmul each way where it
    runs float32; else, for segments of one size (the runs of a fused pass with as many datums
    each, a sampler's requests of as many rows), one batched matmul each way; else a matmul per
    segment."""
    if len(counts) == 1:
        return (x @ a[0].T) @ b[0].T
    if _grouped_mm_works(x.device):
        offsets = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
        hidden = torch._grouped_mm(x, a.transpose(1, 2), offs=offsets)
        return torch._grouped_mm(hidden, b.transpose(1, 2), offs=offsets)
    if len(set(counts)) == 1:
        segments = x.reshape(len(counts), counts[0], x.shape[-1])
        hidden = torch.bmm(segments, a.transpose(1, 2))
        return torch.bmm(hidden, b.transpose(1, 2)).view(x.shape[0], b.shape[1])
    parts = torch.split(x, counts)
    return torch.cat([(part @ a[g].T) @ b[g].T for g, part in enumerate(parts)])


_GROUPED: dict[str, bool] = {}


def _grouped_mm_works(device: torch.device) -> bool:
    """Whether ``torch._grouped_mm`` runs float32 on this kind of device (tried once, and
    checked against plain matmuls): where it does not, a plain matmul per segment."""
    kind = device.type
    if kind not in _GROUPED:
        try:
            x = torch.arange(12.0, device=device).reshape(4, 3)
            w = torch.arange(18.0, device=device).reshape(2, 3, 3)
            offsets = torch.tensor([1, 4], device=device, dtype=torch.int32)
            got = torch._grouped_mm(x, w, offs=offsets)
            want = torch.cat([x[:1] @ w[0], x[1:] @ w[1]])
            _GROUPED[kind] = bool(torch.equal(got, want))
        except (RuntimeError, AttributeError, NotImplementedError):
            _GROUPED[kind] = False
    return _GROUPED[kind]


def install(model: nn.Module, names: Iterable[str], max_rank: int) -> Slots:
    """Wrap every ``nn.Linear`` of ``model`` whose own name is in ``names`` (``q_proj``,
    ``lm_head``...) in a ``SlotLinear``, once, and return their slots (empty: the stacks of a
    rank class are made with its first adapter)."""
    wanted = set(names)
    device = next(model.parameters()).device
    slots = Slots(max_rank=max_rank, device=device)
    targets = [
        (path, module)
        for path, module in model.named_modules()
        if isinstance(module, nn.Linear) and path.rsplit(".", 1)[-1] in wanted
    ]
    for path, module in targets:
        parent_path, _, child = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        wrapped = SlotLinear(module, slots, path)
        setattr(parent, child, wrapped)
        slots.modules[path] = wrapped
    return slots


def peft_weights(state: Mapping[str, Tensor]) -> dict[str, tuple[Tensor, Tensor]]:
    """A PEFT adapter's state dict as ``{module path: (A, B)}``."""
    found: dict[str, dict[str, Tensor]] = {}
    for key, tensor in state.items():
        for part, suffix in _PEFT_SUFFIXES.items():
            if key.startswith(_PEFT_PREFIX) and key.endswith(suffix):
                path = key[len(_PEFT_PREFIX) : -len(suffix)]
                found.setdefault(path, {})[part] = tensor
    incomplete = sorted(path for path, parts in found.items() if len(parts) != 2)
    if incomplete:
        raise ValueError(f"the adapter lacks lora_A or lora_B for {incomplete[:3]}")
    return {path: (parts["A"], parts["B"]) for path, parts in found.items()}


def peft_key(path: str, part: str) -> str:
    """PEFT's adapter-neutral state-dict key of a module's ``A`` or ``B`` (``part``)."""
    return _PEFT_PREFIX + path + _PEFT_SUFFIXES[part]


def to_peft(weights: Mapping[str, tuple[Tensor, Tensor]]) -> dict[str, Tensor]:
    """``{module path: (A, B)}`` as a PEFT state dict."""
    state = {}
    for path, (a, b) in weights.items():
        state[peft_key(path, "A")] = a
        state[peft_key(path, "B")] = b
    return state


@dataclass(frozen=True)
class Adapter:
    """A PEFT adapter as the slots take it."""

    weights: dict[str, tuple[Tensor, Tensor]]  # module path -> (A [rank, in], B [out, rank])
    rank: int
    scale: float

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def read_adapter(directory: Path, device: torch.device | str = "cpu") -> Adapter:
    """The PEFT adapter saved in ``directory`` (``adapter_config.json`` and
    ``adapter_model.safetensors``); ValueError for what the layer does not compute."""
    config = json.loads((directory / artifacts.ADAPTER_CONFIG).read_text())
    unsupported = [
        name
        for name, present in (
            ("DoRA (use_dora)", config.get("use_dora")),
            ("per-module ranks (rank_pattern)", config.get("rank_pattern")),
            ("per-module alphas (alpha_pattern)", config.get("alpha_pattern")),
            ("fan_in_fan_out", config.get("fan_in_fan_out")),
        )
        if present
    ]
    if unsupported:
        raise ValueError(f"the adapter uses what tinsmith's LoRA layer does not: {unsupported}")
    rank = int(config["r"])
    alpha = float(config.get("lora_alpha", rank))
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    state = load_file(str(directory / artifacts.ADAPTER_WEIGHTS), device=str(device))
    return Adapter(peft_weights(state), rank, scale)
