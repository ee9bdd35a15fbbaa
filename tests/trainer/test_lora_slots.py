"""The slot LoRA layer (services/lora_slots.py) against PEFT on the tiny model: a batch whose rows
use different adapters (of different ranks) or none gives each row PEFT's logits for its own
adapter; the gradients of a pass over several adapters' rows are, slot by slot, PEFT's for each
adapter alone; adapters come in and go out of slots in PEFT's on-disk format both ways."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from peft import (
    LoraConfig,
    PeftModel,
    get_peft_model,
    get_peft_model_state_dict,
    set_peft_model_state_dict,
)
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, PreTrainedModel

from services import lora_slots
from services.lora_slots import NO_ADAPTER
from tinsmith import lora, models

TARGETS = lora.target_modules("llama", attn=True, mlp=True, unembed=True)
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def base() -> PreTrainedModel:
    model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(
        models.materialize("tinsmith/tiny"), dtype=torch.float32
    )
    model.requires_grad_(False)
    model.eval()  # type: ignore[no-untyped-call]
    return model


def _peft(base: PreTrainedModel, rank: int, seed: int, targets: list[str] = TARGETS) -> PeftModel:
    """A PEFT adapter of ``rank`` with random A and B (B is zero at init: no delta to compare)."""
    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=lora.ALPHA, target_modules=targets, lora_dropout=0.0)
    model = get_peft_model(copy.deepcopy(base), config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn_like(param) * 0.05)
    return model


def _tokens(rows: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 500, (rows, 9), generator=generator)


def _slotted(base: PreTrainedModel) -> tuple[PreTrainedModel, lora_slots.Slots]:
    model = copy.deepcopy(base)
    names = {*lora.LAYOUTS["llama"]["attn"], *lora.LAYOUTS["llama"]["mlp"], "lm_head"}
    return model, lora_slots.install(model, names, max_rank=16)


def _load(slots: lora_slots.Slots, adapter: PeftModel, rank: int) -> int:
    weights = lora_slots.peft_weights(get_peft_model_state_dict(adapter))
    return slots.load(weights, rank=rank, scale=lora.ALPHA / rank)


def test_each_row_gets_its_own_adapter_s_logits_or_the_base_s(base: PreTrainedModel) -> None:
    four, sixteen = _peft(base, 4, seed=1), _peft(base, 16, seed=2, targets=["q_proj", "v_proj"])
    model, slots = _slotted(base)
    a, b = _load(slots, four, 4), _load(slots, sixteen, 16)
    tokens = _tokens(5, seed=3)
    routes = [a, NO_ADAPTER, b, a, b]
    with torch.no_grad(), slots.routed(routes):
        got = model(tokens).logits
    with torch.no_grad():
        want = {
            a: four(tokens).logits,
            b: sixteen(tokens).logits,
            NO_ADAPTER: base(tokens).logits,
        }
    for row, slot in enumerate(routes):
        assert (got[row] - want[slot][row]).abs().max().item() <= TOLERANCE, (row, slot)
    # Outside a routed forward, and routed to no adapter, the model is the base.
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, want[NO_ADAPTER])


def test_a_pass_over_several_adapters_gives_each_its_own_gradient(base: PreTrainedModel) -> None:
    four, eight = _peft(base, 4, seed=4), _peft(base, 8, seed=5)
    model, slots = _slotted(base)
    a, b = _load(slots, four, 4), _load(slots, eight, 8)
    bound = {a: slots.bind(a), b: slots.bind(b)}
    tokens = _tokens(4, seed=6)
    routes = [a, b, b, a]
    with slots.routed(routes):
        logits = model(tokens).logits
    logits.float().log_softmax(-1)[:, :-1].gather(-1, tokens[:, 1:, None]).sum().backward()
    for adapter, slot, rank in ((four, a, 4), (eight, b, 8)):
        rows = [row for row, s in enumerate(routes) if s == slot]
        alone = adapter(tokens[rows]).logits
        alone.float().log_softmax(-1)[:, :-1].gather(-1, tokens[rows, 1:, None]).sum().backward()
        grads = {
            name: param.grad for name, param in adapter.named_parameters() if param.grad is not None
        }
        assert set(bound[slot]) == set(slots.modules)
        for path, (param_a, param_b) in bound[slot].items():
            key = f"base_model.model.{path}.lora_A.default.weight"
            assert param_a.shape == (rank, slots.modules[path].base.in_features)
            assert param_a.grad is not None and param_b.grad is not None
            want_a = grads[key]
            want_b = grads[key.replace("lora_A", "lora_B")]
            assert (param_a.grad - want_a).abs().max().item() <= TOLERANCE, path
            assert (param_b.grad - want_b).abs().max().item() <= TOLERANCE, path


def test_a_bound_adapter_stays_its_slot_s_through_growing_and_packing(
    base: PreTrainedModel,
) -> None:
    """What is done to a bound adapter's parameters (an optimizer's step) is what the forwards
    compute with, before and after its stacks were reallocated, and the parameters stay the same
    objects (an optimizer's state is keyed by them)."""
    model, slots = _slotted(base)
    first = _load(slots, _peft(base, 4, seed=30), 4)
    params = slots.bind(first)
    objects = [id(p) for pair in params.values() for p in pair]
    tokens = _tokens(2, seed=31)

    def nudged_logits() -> torch.Tensor:
        with torch.no_grad():
            for param_a, param_b in params.values():
                param_a.mul_(1.5)
                param_b.add_(0.01)
            with slots.routed([first, first]):
                return model(tokens).logits

    def alone_logits() -> torch.Tensor:
        weights = {path: (a.detach(), b.detach()) for path, (a, b) in params.items()}
        reference, reference_slots = _slotted(base)
        slot = reference_slots.load(weights, rank=4, scale=lora.ALPHA / 4)
        with torch.no_grad(), reference_slots.routed([slot, slot]):
            return reference(tokens).logits

    assert (nudged_logits() - alone_logits()).abs().max().item() <= TOLERANCE
    others = [_load(slots, _peft(base, 8, seed=32 + n), 8) for n in range(3)]  # the class grows
    assert slots.capacity == {8: 4}
    assert (nudged_logits() - alone_logits()).abs().max().item() <= TOLERANCE
    for slot in others:
        slots.unload(slot)
    assert slots.shrink() > 0 and slots.capacity == {8: 1}
    assert (nudged_logits() - alone_logits()).abs().max().item() <= TOLERANCE
    assert [id(p) for pair in slots.bind(first).values() for p in pair] == objects


def test_adapters_go_in_and_out_in_peft_s_format(base: PreTrainedModel, tmp_path: Path) -> None:
    saved = _peft(base, 12, seed=7)
    saved.save_pretrained(tmp_path / "saved")
    model, slots = _slotted(base)
    first = _load(slots, _peft(base, 16, seed=8), 16)
    assert slots.where[first] == (16, 0)
    slots.unload(first)
    # Into the freed place of the rank-16 stacks: nothing of the rank-16 adapter is left past
    # rank 12.
    state = load_file(str(tmp_path / "saved" / "adapter_model.safetensors"))
    slot = slots.load(lora_slots.peft_weights(state), rank=12, scale=lora.ALPHA / 12)
    second = slots.load(lora_slots.peft_weights(state), rank=12, scale=lora.ALPHA / 12)
    assert (slots.where[slot], slots.where[second]) == ((16, 0), (16, 1))
    assert slots.capacity == {16: 2}  # no free place for the second: the stacks grew
    tokens = _tokens(2, seed=9)
    with torch.no_grad(), slots.routed([slot, second]):
        got = model(tokens).logits
    with torch.no_grad():
        want = saved(tokens).logits
    assert (got - want).abs().max().item() <= TOLERANCE
    # And back: the slot's weights, as a PEFT state dict, make another adapter this one.
    other = _peft(base, 12, seed=10)
    set_peft_model_state_dict(other, lora_slots.to_peft(slots.weights(slot)))
    with torch.no_grad():
        assert (other(tokens).logits - got).abs().max().item() <= TOLERANCE


def test_ranks_go_into_the_smallest_class_that_holds_them() -> None:
    assert [lora_slots.rank_class(r) for r in (1, 5, 8, 9, 16, 17, 100, 128)] == [
        8,
        8,
        8,
        16,
        16,
        32,
        128,
        128,
    ]


def test_a_route_to_an_empty_slot_is_refused(base: PreTrainedModel) -> None:
    _, slots = _slotted(base)
    with pytest.raises(ValueError, match="slot 1, which holds no adapter"), slots.routed([1]):
        pass
    with pytest.raises(ValueError, match=r"rank 32 is outside 1\.\.16"):
        slots.load({}, rank=32, scale=1.0)


@pytest.mark.parametrize("counts", [[3, 0, 7], [4, 4, 4]], ids=["per segment", "batched"])
def test_each_way_of_computing_segments_gives_each_its_own_product(
    monkeypatch: pytest.MonkeyPatch, counts: list[int]
) -> None:
    """Segment g of the rows times its own A and B: torch's grouped matmul where it runs float32
    (checked where it does), else one batched matmul for segments of one size, else a matmul
    per segment."""
    generator = torch.Generator().manual_seed(11)
    x = torch.randn(sum(counts), 6, generator=generator)
    a = torch.randn(3, 4, 6, generator=generator)
    b = torch.randn(3, 5, 4, generator=generator)
    bounds = [0, *torch.tensor(counts).cumsum(0).tolist()]
    want = torch.cat([(x[bounds[g] : bounds[g + 1]] @ a[g].T) @ b[g].T for g in range(len(counts))])
    if lora_slots._grouped_mm_works(x.device):
        grouped = lora_slots._segment_lora(x, a, b, counts)
        assert (grouped - want).abs().max().item() <= TOLERANCE
    monkeypatch.setitem(lora_slots._GROUPED, "cpu", False)
    got = lora_slots._segment_lora(x, a, b, counts)
    assert (got - want).abs().max().item() <= TOLERANCE


def test_free_places_are_given_back_and_the_adapters_left_compute_as_before(
    base: PreTrainedModel,
) -> None:
    model, slots = _slotted(base)
    adapters = [_peft(base, 8, seed=20 + n) for n in range(4)]
    held = [_load(slots, adapter, 8) for adapter in adapters]
    assert slots.capacity == {8: 4}
    tokens = _tokens(1, seed=12)
    with torch.no_grad(), slots.routed([held[2]]):
        before = model(tokens).logits
    full = slots.nbytes()
    assert full == sum(module.nbytes() for module in slots.modules.values())  # the stacks' own
    for slot in (held[0], held[1], held[3]):
        slots.unload(slot)
    assert slots.shrink(slack=4.0) == 0  # four places for one adapter: within that slack
    given = slots.shrink()
    assert given == full * 3 // 4 and slots.capacity == {8: 1}
    assert slots.nbytes() == sum(module.nbytes() for module in slots.modules.values())
    assert slots.where[held[2]] == (8, 0)
    with torch.no_grad(), slots.routed([held[2]]):
        assert torch.equal(model(tokens).logits, before)
    slots.unload(held[2])
    slots.shrink()
    assert slots.capacity == {} and slots.nbytes() == 0


def test_forwards_without_gradients_see_a_bound_adapter_s_steps_after_the_stacks_grow(
    base: PreTrainedModel,
) -> None:
    """A trained slot's forward-only passes compute with views of its places in the stacks;
    after the stacks grow (room reserved for more adapters) and its parameters are stepped in
    place, they compute its new weights, as a pass with gradients (through the parameters)
    does."""
    model, slots = _slotted(base)
    trained = _load(slots, _peft(base, 8, seed=30), 8)
    params = slots.bind(trained)
    tokens = _tokens(2, seed=31)
    with torch.no_grad(), slots.routed([trained, trained]):
        before = model(tokens).logits
    slots.reserve(8, 4)  # the rank-8 stacks grow: new tensors, the adapter copied over
    with torch.no_grad():
        for a, b in params.values():  # an optimizer's step: in place, on the parameters
            a.add_(0.01)
            b.add_(0.01)
    with slots.routed([trained, trained]):
        through_params = model(tokens).logits.detach()
        with torch.no_grad():
            through_views = model(tokens).logits
    assert (through_params - before).abs().max().item() > 1e-3  # the step moved them
    assert (through_views - through_params).abs().max().item() <= TOLERANCE


@torch.no_grad()
def test_a_slot_layer_multiplies_by_its_base_s_weights_as_they_are_now(
    base: PreTrainedModel,
) -> None:
    """The layer reads its base's parameters at each call: one replaced (a device move, a new
    tensor) or changed in place is what the next forward multiplies by."""
    _, slots = _slotted(base)
    layer = slots.modules["model.layers.0.self_attn.q_proj"]
    x = torch.randn(3, layer.base.in_features, generator=torch.Generator().manual_seed(5))
    layer.base.weight = torch.nn.Parameter(torch.randn_like(layer.base.weight))
    assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.base.weight, layer.base.bias))
    layer.base.weight.mul_(2.0)
    layer.base.bias = None
    assert torch.equal(layer(x), x @ layer.base.weight.T)
