"""Text in, text out: sampling for clients that hold no tokenizer (the console's playground).

A prompt is tokenized here with the base model's own ``tokenizer.json`` (the file the hub routes
serve), sampled through exactly the path the SDK takes (a session, a sampler on the checkpoint
or base model, one sample request on the sampler queue, with its batching, keys and quotas),
and each sequence decoded back to text. The session is the call's own: created for it, tagged
``console``, and finished when the call ends, whatever happened. A call that ends before its
result (its client went away, or ``TIMEOUT_S`` passed) cancels the sample request, so no sampler
computes for nobody.

Owns: the text sampling route's body, the tokenizers' cache and the call's session. Does not
own: what a tenant may sample (operations.py decides, as for the SDK).
"""

from __future__ import annotations

import asyncio
import functools
import pathlib
from typing import Any

from tokenizers import Tokenizer

from tinsmith import models
from tinsmith._proto import bus_pb2 as bus
from tinsmith._proto import tinker_public_pb2 as tp
from tinsmith.failures import InvalidRequest, Unavailable
from tinsmith.limits import MAX_NUM_SAMPLES
from tinsmith.tenants import Tenant
from tinsmith.tensors import tokens_from_bytes

from . import checks, wire
from . import operations as ops
from .handlers import Gateway

TIMEOUT_S = 300.0
MAX_PROMPT_CHARS = 100_000
_STOP_REASONS = {tp.STOP_REASON_LENGTH: "length", tp.STOP_REASON_STOP: "stop"}


class TextSampler:
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def sample(self, tenant: Tenant, body: dict[str, Any]) -> dict[str, Any]:
        """``body``: ``prompt`` (text), ``model_path`` (a ``tinker://`` sampler checkpoint) or
        ``base_model``, ``num_samples``, and ``sampling_params`` as the SDK sends them
        (``max_tokens``, ``temperature``, ``top_p``, ``top_k``, ``seed``, ``stop`` strings).
        The answer: each sequence's text, tokens and stop reason, and the prompt's token count."""
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or not prompt or len(prompt) > MAX_PROMPT_CHARS:
            raise InvalidRequest(
                f"'prompt' must be the text to continue, 1 to {MAX_PROMPT_CHARS} characters"
            )
        model_path, base_model = wire.text(body, "model_path"), wire.text(body, "base_model")
        if bool(model_path) == bool(base_model):
            raise InvalidRequest(
                "name one model: 'model_path' (a tinker:// sampler checkpoint) or 'base_model'"
            )
        params = wire.sampling_params(body.get("sampling_params"))
        num_samples = wire.req_int(
            body, "num_samples", minimum=1, maximum=MAX_NUM_SAMPLES, default=1
        )
        # Everything that can refuse the call does so before it appends anything.
        if model_path:
            found = await self.gateway.decide(tenant, ops.readable_checkpoint, model_path)
            spec = models.get(found.base_model)
        else:
            spec = models.get(base_model)
        tokenizer = await asyncio.to_thread(_tokenizer, spec.name)
        tokens = tokenizer.encode(prompt, add_special_tokens=False).ids
        command = bus.Sample(prompt=tokens, params=params, num_samples=num_samples)
        checks.check_sample(self.gateway.config.limits, spec, command)
        session_id = await self.gateway.perform(
            tenant, ops.create_session, ops.CreateSession(tags=("console",))
        )
        try:
            sampler_id = await self.gateway.perform(
                tenant,
                ops.create_sampler,
                ops.CreateSampler(session_id, 0, base_model=base_model, model_path=model_path),
            )
            response = await self._result(tenant, ops.Sample(sampler_id, 0, command))
        finally:
            await self.gateway.perform(
                tenant, ops.finish_session, ops.SessionRef(session_id, reason="completed")
            )
        sequences = []
        for sequence in response.sequences:
            ids = tokens_from_bytes(sequence.tokens).tolist()
            sequences.append(
                {
                    "text": tokenizer.decode(ids, skip_special_tokens=False),
                    "tokens": ids,
                    "stop_reason": _STOP_REASONS.get(sequence.stop_reason, "unknown"),
                }
            )
        return {
            "model_path": model_path or None,
            "base_model": spec.name,
            "prompt_tokens": len(tokens),
            "sequences": sequences,
        }

    async def _result(self, tenant: Tenant, request: ops.Sample) -> tp.SampleResponse:
        """Accept the request and wait for its result; cancel it if the wait ends first."""
        accepted = await self.gateway.perform(tenant, ops.sample, request)
        try:
            body, _ = await self.gateway.result(tenant, accepted.request_id, TIMEOUT_S)
        except (TimeoutError, asyncio.CancelledError) as exc:
            why = (
                f"no result within {TIMEOUT_S:g} s"
                if isinstance(exc, TimeoutError)
                else "its client went away"
            )
            detail = f"text sample {accepted.request_id} was cancelled: {why}"
            # In the background: this task may be cancelled itself.
            self.gateway.log.bus.spawn(
                self.gateway.cancel_sample(tenant, accepted.request_id, detail)
            )
            if isinstance(exc, TimeoutError):
                raise Unavailable(f"{detail}; the samplers are busy, try again later") from exc
            raise
        return tp.SampleResponse.FromString(body)


@functools.lru_cache(maxsize=16)
def _tokenizer(base_model: str) -> Tokenizer:
    """The base model's tokenizer: a built-in model's from its hub snapshot (the same bytes
    the SDK's clients load), a served directory's from its ``tokenizer.json``."""
    spec = models.get(base_model)
    if spec.source == "local":
        return Tokenizer.from_file(str(pathlib.Path(spec.location) / "tokenizer.json"))
    return Tokenizer.from_str(models.hub_snapshot(spec.name).files["tokenizer.json"].decode())
