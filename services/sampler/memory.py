"""The torch engine's memory plan: what its tensors take on the device, counted from each base
model's config and dtype, and how many rows of a request fit the budget
(``TINSMITH_DEVICE_MEMORY_MB``, services/device.py) beside what the engine already holds.

What a base model's rows cost (``Costs``, in bytes):

- the KV cache, exactly: one row holds the keys and values of every layer for every cached
  column (``2 x layers x kv_heads x head_dim`` elements of the model's dtype) and its attention
  mask entry (int64). A running batch is left-padded to its widest row, so it holds ``rows x
  width`` columns, and each row grows by a column per token it samples. A batch reserves every
  row's columns at its last token, ``rows x width + sum(tokens still to sample)``: no later step
  holds more (rows that finish, or stop early, only give columns back), so a batch admitted
  within the budget stays within it until something else joins, which is checked again then;
- each row's logits between two steps (float32) and its position;
- a step's working memory, estimated from the model's shape: the forward's logits (model dtype,
  then float32) and their log-softmax, a token's activations, one request's sampling temporaries
  (tempered, top-k and top-p copies, sort indices, probabilities) and one cache layer held twice
  while the cache grows or new rows are merged in;
- a prefill's: its prompts' activations and their own cache before it is copied to rows, the
  attention mask, and the logits it keeps (every position when a prompt's scores are asked for:
  prompt logprobs over a long prompt and a large vocabulary are the largest single item).

The engine adds the bytes it holds that are not rows (``held``: base weights, adapters, prompts
kept for a request's later slices, all counted from the tensors themselves) and plans each step's
admissions against the budget (``Plan``). Counting stays the engine's own: torch's allocator does
not count CPU tensors, and on a GPU it also holds blocks that are free for reuse.

Owns: the arithmetic. Does not own: which request goes first (torch_engine.py's waiting line),
or the device and its budget (services/device.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

_INDEX = 8  # int64: attention masks, positions, token ids
_FLOAT = 4  # float32: logits, logprobs


@dataclass(frozen=True)
class Costs:
    """What one base model's tensors take in the torch engine, in bytes."""

    column: int  # one row's KV cache and mask entry, per cached column
    layer_column: int  # the same for one layer (what a layer's copy takes while it is replaced)
    logits_row: int  # one row's float32 logits and position, kept between two steps
    step_row: int  # one row's working memory in a decoding step
    sampling_row: int  # one row's temporaries while its request samples
    prefill_token: int  # a prompt token's activations and cache in a prefill
    logit: int  # one position's logits in the model's dtype
    score_position: int  # one prompt position's logits while its request's prompt is scored
    kept_position: int  # one prompt position kept (its cache) for a request's later slices
    kept_logits: int  # the logits kept with it

    @classmethod
    def of(cls, config: Mapping[str, object], dtype_bytes: int, vocab_size: int) -> Costs:
        """From a model's ``config.json`` and the size of its dtype."""

        def number(name: str, default: int = 0) -> int:
            value = config.get(name)
            return int(value) if isinstance(value, int | float) and value else default

        layers = number("num_hidden_layers")
        hidden = number("hidden_size")
        heads = number("num_attention_heads", 1)
        kv_heads = number("num_key_value_heads", heads)
        head_dim = number("head_dim", hidden // heads)
        intermediate = number("intermediate_size", 4 * hidden)
        layer_column = 2 * kv_heads * head_dim * dtype_bytes
        activations = (4 * hidden + 3 * intermediate) * dtype_bytes
        return cls(
            column=layers * layer_column + _INDEX,
            layer_column=layer_column,
            logits_row=vocab_size * _FLOAT + _INDEX,
            step_row=vocab_size * (dtype_bytes + 2 * _FLOAT) + activations,
            sampling_row=vocab_size * (6 * _FLOAT + _INDEX),
            prefill_token=activations + layers * layer_column + _INDEX,
            logit=vocab_size * dtype_bytes,
            score_position=vocab_size * 4 * _FLOAT,
            kept_position=layers * layer_column,
            kept_logits=vocab_size * _FLOAT,
        )


@dataclass(frozen=True)
class Rows:
    """One base model's running batch as planned for this step: its rows, width (cached
    columns) and the tokens its rows have still to sample; and the prompts this step prefills
    for it."""

    costs: Costs
    rows: int = 0
    width: int = 0
    remaining: int = 0
    prompts: int = 0  # prefilled this step
    prompt_width: int = 0  # the longest of them (they are left-padded to it)
    scored: bool = False  # whether the prefill keeps every position's logits
    longest_scored: int = 0  # the longest prompt whose scores are computed
    kept: int = 0  # bytes of prompts kept this step for later slices

    def parts(self, rows_per_request: int) -> dict[str, int]:
        """Its bytes: ``kv`` (the cache reserved to every row's last token, and the rows'
        logits), ``step`` (a decoding step's working memory) and ``prefill``."""
        c = self.costs
        columns = self.rows * self.width + self.remaining
        kv = columns * c.column + self.rows * c.logits_row + self.kept
        step = (
            self.rows * c.step_row
            + min(self.rows, rows_per_request) * c.sampling_row
            + columns * c.layer_column
        )
        prefill = 0
        if self.prompts:
            tokens = self.prompts * self.prompt_width
            positions = tokens if self.scored else self.prompts
            prefill = (
                tokens * c.prefill_token
                + tokens * self.prompt_width  # the attention mask, a byte a cell at least
                + positions * c.logit
                + self.longest_scored * c.score_position
            )
        return {"kv": kv, "step": step, "prefill": prefill}

    def total(self, rows_per_request: int) -> int:
        return sum(self.parts(rows_per_request).values())

    def joined(
        self, *, rows: int, prompt: int, max_tokens: int, fresh: bool, scores: bool, kept: int
    ) -> Rows:
        """These rows with ``rows`` more of one request (its prompt ``prompt`` tokens long, each
        to sample ``max_tokens``), prefilled this step if ``fresh`` (its prompt scored if
        ``scores``), keeping ``kept`` bytes of its prompt for later slices."""
        joined = replace(
            self,
            rows=self.rows + rows,
            width=max(self.width, prompt) if rows else self.width,
            remaining=self.remaining + rows * max(max_tokens, 0),
            kept=self.kept + kept,
        )
        if fresh:
            joined = replace(
                joined,
                prompts=self.prompts + 1,
                prompt_width=max(self.prompt_width, prompt),
                scored=self.scored or scores,
                longest_scored=max(self.longest_scored, prompt if scores else 0),
            )
        return joined


@dataclass(frozen=True)
class Ask:
    """A slice of one request to admit: its prompt's length, the tokens each of its sequences
    samples, whether its prompt is prefilled in this step (``fresh``) and scored
    (``scores``: prompt logprobs, top-k, targets or alternatives), and how many of its sequences
    have no row yet (``left``; those beyond the slice keep its prompt for later)."""

    prompt: int
    max_tokens: int
    fresh: bool
    scores: bool
    left: int


@dataclass
class Plan:
    """The engine's memory as it will be after this step's admissions: ``held`` (what is not
    rows: weights, adapters, kept prompts), and each base model's ``Rows``."""

    budget: int
    held: int
    rows_per_request: int
    bases: dict[str, Rows]

    def total(self) -> int:
        return self.held + sum(r.total(self.rows_per_request) for r in self.bases.values())

    def need(self, base: str, costs: Costs, ask: Ask, rows: int) -> int:
        """The total once ``rows`` rows of ``ask`` join ``base``'s batch."""
        others = sum(r.total(self.rows_per_request) for b, r in self.bases.items() if b != base)
        return (
            self.held + others + self._joined(base, costs, ask, rows).total(self.rows_per_request)
        )

    def fitting(self, base: str, costs: Costs, ask: Ask, want: int) -> int:
        """The most rows of ``ask``, up to ``want``, that fit the budget: -1 when not even its
        prefill does (with no row)."""
        if self.need(base, costs, ask, want) <= self.budget:
            return want
        low, high = -1, want  # need(low) fits (or low is -1), need(high) does not
        while high - low > 1:
            middle = (low + high) // 2
            if self.need(base, costs, ask, middle) <= self.budget:
                low = middle
            else:
                high = middle
        return low

    def take(self, base: str, costs: Costs, ask: Ask, rows: int) -> None:
        """Count ``rows`` rows of ``ask`` (and its prefill, if fresh) in ``base``'s batch."""
        self.bases[base] = self._joined(base, costs, ask, rows)

    def _joined(self, base: str, costs: Costs, ask: Ask, rows: int) -> Rows:
        current = self.bases.get(base) or Rows(costs)
        kept = 0
        if ask.fresh and rows < ask.left:  # its prompt is kept for the slices to come
            kept = ask.prompt * costs.kept_position + costs.kept_logits
        return current.joined(
            rows=rows,
            prompt=ask.prompt,
            max_tokens=ask.max_tokens,
            fresh=ask.fresh,
            scores=ask.scores,
            kept=kept,
        )
