"""Text in, text out: sampling for clients that hold no tokenizer (the console's playground, the
OpenAI-compatible routes).

A prompt is tokenized here with the base model's own ``tokenizer.json`` (the file the hub routes
serve), sampled through exactly the path the SDK takes (a session, a sampler on the checkpoint
or base model, sample requests on the sampler queue, with its batching, keys and quotas), and
each sequence decoded back to text. The session is the call's own: created for it, tagged with
the face that made it (``console``, ``openai``), and finished when the call ends, whatever
happened. A call that ends before its result (its client went away, or ``TIMEOUT_S`` passed)
cancels its sample requests, so no sampler computes for nobody.

Owns: the text sampling route's body, the tokenizers' and chat templates' cache, the call's
session, and waiting on (or streaming) a request of it. Does not own: what a tenant may sample
(operations.py decides, as for the SDK).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import pathlib
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

from tokenizers import Tokenizer

from tinsmith import events, models
from tinsmith._proto import bus_pb2 as bus
from tinsmith._proto import service_pb2 as svc
from tinsmith._proto import tinker_public_pb2 as tp
from tinsmith.failures import InvalidRequest, Unavailable
from tinsmith.limits import MAX_NUM_SAMPLES
from tinsmith.tenants import Tenant
from tinsmith.tensors import tokens_from_bytes

from . import checks, streams, wire
from . import operations as ops
from .handlers import Gateway

TIMEOUT_S = 300.0
MAX_PROMPT_CHARS = 100_000
STOP_REASONS = {tp.STOP_REASON_LENGTH: "length", tp.STOP_REASON_STOP: "stop"}


@dataclass(frozen=True)
class Target:
    """What a call samples: a sampler checkpoint (``model_path``) or a base model
    (``base_model``), as ``create_sampling_session`` names them, with the model's tokenizer."""

    spec: models.ModelSpec
    model_path: str
    base_model: str
    tokenizer: Tokenizer


class TextSampling:
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def target(self, tenant: Tenant, *, model_path: str = "", base_model: str = "") -> Target:
        """The checkpoint or base model to sample, once the tenant may read it (another
        tenant's unpublished checkpoint is a 404, an unknown model a 400 naming those there
        are)."""
        if model_path:
            found = await self.gateway.decide(tenant, ops.readable_checkpoint, model_path)
            spec = models.get(found.base_model)
        else:
            spec = models.get(base_model)
        tokenizer = await asyncio.to_thread(tokenizer_of, spec.name)
        return Target(spec, model_path, "" if model_path else spec.name, tokenizer)

    def check(self, target: Target, command: bus.Sample) -> None:
        """Refuse, before anything is appended, a request the sampler would refuse."""
        checks.check_sample(self.gateway.config.limits, target.spec, command)

    @contextlib.asynccontextmanager
    async def sampler(self, tenant: Tenant, target: Target, tag: str) -> AsyncIterator[str]:
        """A session of the call's own (tagged ``tag``) with a sampler on ``target``; the
        session is finished when the call leaves, whatever happened."""
        session_id = await self.gateway.perform(
            tenant, ops.create_session, ops.CreateSession(tags=(tag,))
        )
        try:
            yield await self.gateway.perform(
                tenant,
                ops.create_sampler,
                ops.CreateSampler(
                    session_id, 0, base_model=target.base_model, model_path=target.model_path
                ),
            )
        finally:
            await self.gateway.perform(
                tenant, ops.finish_session, ops.SessionRef(session_id, reason="completed")
            )

    async def sample(
        self, tenant: Tenant, sampler_id: str, seq_id: int, command: bus.Sample
    ) -> tp.SampleResponse:
        """Accept one sample request and wait for its result; cancel it if the wait ends
        first."""
        accepted = await self.gateway.perform(
            tenant, ops.sample, ops.Sample(sampler_id, seq_id, command)
        )
        try:
            body, _ = await self.gateway.result(tenant, accepted.request_id, TIMEOUT_S)
        except TimeoutError as exc:
            raise self._cancel(tenant, accepted.request_id, timed_out=True) from exc
        except asyncio.CancelledError:
            self._cancel(tenant, accepted.request_id, timed_out=False)
            raise
        return tp.SampleResponse.FromString(body)

    async def stream(
        self, tenant: Tenant, sampler_id: str, seq_id: int, command: bus.Sample
    ) -> AsyncGenerator[svc.SampleChunk, None]:
        """Accept one sample request with ``stream`` and yield its tokens as the sampler makes
        them (``streams.relayed``): the last chunk carries the result. Closing the iterator
        before the last chunk cancels the request. Use it with ``contextlib.aclosing``."""
        request_id = events.request_id(sampler_id, seq_id)
        with self.gateway.watch(request_id) as progress:  # before the sampler can send any
            await self.gateway.perform(
                tenant, ops.sample, ops.Sample(sampler_id, seq_id, command, stream=True)
            )
            finished = timed_out = False
            try:
                chunks = streams.relayed(self.gateway, tenant, request_id, progress, TIMEOUT_S)
                async with contextlib.aclosing(chunks):
                    async for chunk in chunks:
                        finished = chunk.HasField("response")
                        yield chunk
            except TimeoutError as exc:
                timed_out = True
                raise self._cancel(tenant, request_id, timed_out=True) from exc
            finally:
                if not finished and not timed_out:  # the caller stopped, or the call failed
                    self._cancel(tenant, request_id, timed_out=False)

    def _cancel(self, tenant: Tenant, request_id: str, *, timed_out: bool) -> Unavailable:
        """Cancel the request in the background (the calling task may be cancelled itself);
        the error to answer the call with, if it timed out."""
        reason = f"no result within {TIMEOUT_S:g} s" if timed_out else "its client went away"
        detail = f"text sample {request_id} was cancelled: {reason}"
        self.gateway.log.bus.spawn(self.gateway.cancel_sample(tenant, request_id, detail))
        return Unavailable(f"{detail}; the samplers are busy, try again later")

    # -- POST /api/v1/sample_text --------------------------------------------------------------

    async def sample_text(self, tenant: Tenant, body: dict[str, Any]) -> dict[str, Any]:
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
        target = await self.target(tenant, model_path=model_path, base_model=base_model)
        tokens = target.tokenizer.encode(prompt, add_special_tokens=False).ids
        command = bus.Sample(prompt=tokens, params=params, num_samples=num_samples)
        self.check(target, command)
        async with self.sampler(tenant, target, "console") as sampler_id:
            response = await self.sample(tenant, sampler_id, 0, command)
        sequences = []
        for sequence in response.sequences:
            ids = tokens_from_bytes(sequence.tokens).tolist()
            sequences.append(
                {
                    "text": target.tokenizer.decode(ids, skip_special_tokens=False),
                    "tokens": ids,
                    "stop_reason": STOP_REASONS.get(sequence.stop_reason, "unknown"),
                }
            )
        return {
            "model_path": model_path or None,
            "base_model": target.spec.name,
            "prompt_tokens": len(tokens),
            "sequences": sequences,
        }


@functools.lru_cache(maxsize=16)
def tokenizer_of(base_model: str) -> Tokenizer:
    """The base model's tokenizer: a built-in model's from its hub snapshot (the same bytes
    the SDK's clients load), a served directory's from its ``tokenizer.json``."""
    return Tokenizer.from_str(model_file(base_model, "tokenizer.json").decode())


@functools.lru_cache(maxsize=16)
def tokenizer_config_of(base_model: str) -> dict[str, Any]:
    """The model's ``tokenizer_config.json`` (its special tokens and chat template), with the
    template of a separate ``chat_template.jinja`` where the model has one; {} if neither."""
    try:
        config = json.loads(model_file(base_model, "tokenizer_config.json"))
    except FileNotFoundError:
        config = {}
    if not isinstance(config, dict):
        config = {}
    with contextlib.suppress(FileNotFoundError):
        config["chat_template"] = model_file(base_model, "chat_template.jinja").decode()
    return config


def model_file(base_model: str, name: str) -> bytes:
    """A file of the model's directory or hub snapshot (``FileNotFoundError`` if none)."""
    spec = models.get(base_model)
    if spec.source == "local":
        return (pathlib.Path(spec.location) / name).read_bytes()
    files = models.hub_snapshot(spec.name).files
    if name not in files:
        raise FileNotFoundError(f"{spec.name} has no {name}")
    return files[name]
