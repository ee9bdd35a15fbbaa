"""OpenAI-compatible inference: ``POST /v1/completions``, ``POST /v1/chat/completions``,
``GET /v1/models`` and ``GET /v1/models/{model}``, for the tools that speak the OpenAI API (its
SDKs, evaluation harnesses, chat front ends). The same routes answer under ``/oai/api/v1``, the
base URL of Tinker's own OpenAI-compatible service, so a client moves by changing its host.

A model is named as Tinker names it: a ``tinker://`` sampler checkpoint path, a base model's
name, or ``<base model>;<tinker:// path>`` (the checkpoint, checked to be of that base model).
Each call is sampled by ``text.TextSampling``: a session of its own tagged ``openai``, a sampler
on the model, and one sample request per prompt on the sampler queue, with the batching, keys,
quotas and limits of the SDK's ``sample``. The key comes as ``Authorization: Bearer <key>``
(what OpenAI clients send) or ``X-API-Key``; errors are OpenAI's ``{"error": {...}}`` beside the
usual ``detail`` (http.py).

What a choice answers: the text of its tokens up to the first stop string (the request's, and
for chat the template's end-of-turn token), without it, as OpenAI does; ``finish_reason`` is
``stop`` or ``length``; logprobs are each sampled token's, with the ``k`` most likely tokens at
each position when asked (the sampler's ``topk_sample_logprobs``). Streaming sends server-sent
events as the sampler generates: a choice's text goes out once it cannot change, so a partial
UTF-8 character, or text that may be the beginning of a stop string, waits for the next tokens.
With top alternatives asked, a streamed choice's logprobs come in its last event (the sampler
computes them with the result); without, each event carries its tokens' logprobs.

Owns: reading OpenAI requests into sample commands, chat templates, each choice's text and
logprobs, and the events. Does not own: sampling (the sampler), what a tenant may read
(operations.py), the error shape (http.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import functools
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from typing import Any

import jinja2
import numpy as np
from aiohttp import web
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from tinsmith import models
from tinsmith._proto import bus_pb2 as bus
from tinsmith._proto import service_pb2 as svc
from tinsmith._proto import tinker_public_pb2 as tp
from tinsmith.failures import InvalidRequest, NotFound, TinsmithError
from tinsmith.limits import MAX_NUM_SAMPLES, MAX_TOPK_LOGPROBS
from tinsmith.tenants import Tenant
from tinsmith.tensors import tokens_from_bytes

from . import wire
from .rest import Rest, read_json, tenant_of
from .text import (
    MAX_PROMPT_CHARS,
    STOP_REASONS,
    Target,
    TextSampling,
    model_file,
    tokenizer_config_of,
    tokenizer_of,
)

log = logging.getLogger(__name__)

PREFIXES = ("/v1", "/oai/api/v1")
TAG = "openai"  # the tag of the sessions these calls make
MAX_PROMPTS = 64  # prompts in one completions call (each is one sample request)
MAX_STOPS = 16
MAX_MESSAGES = 1024
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /completions
MAX_LISTED_CHECKPOINTS = 1000
# Parameters OpenAI accepts that change what is sampled, and this server does not do: each is
# accepted at its neutral value only, so that no call silently gets something else.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "echo": (None, False),
    "suffix": (None, ""),
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
}
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}


def serves(path: str) -> bool:
    """Whether ``path`` is one of these routes' (its errors take OpenAI's shape)."""
    return any(path == prefix or path.startswith(prefix + "/") for prefix in PREFIXES)


def error_body(status: int, body: dict[str, Any]) -> dict[str, Any]:
    """An error as OpenAI's clients read it (``error.message``; the client raises the class of
    the status), beside tinsmith's own ``detail``."""
    detail = str(body.get("detail", ""))
    kind = _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    code = "model_not_found" if status == 404 and "model" in detail else None
    return {"error": {"message": detail, "type": kind, "param": None, "code": code}, **body}


def add_routes(app: web.Application, sampling: TextSampling, rest: Rest) -> None:
    face = OpenAiFace(sampling, rest)
    for prefix in PREFIXES:
        app.router.add_post(prefix + "/completions", face.completions)
        app.router.add_post(prefix + "/chat/completions", face.chat_completions)
        app.router.add_get(prefix + "/models", face.list_models)
        app.router.add_get(prefix + "/models/{model:.+}", face.get_model)


# -- requests ---------------------------------------------------------------------------------


@dataclass
class _Call:
    """One OpenAI call, read and checked: what to sample and how to answer it."""

    chat: bool
    model: str  # as the caller named it, echoed in the answer
    target: Target
    prompts: list[list[int]]
    command: bus.Sample  # without its prompt
    stops: tuple[str, ...]  # cut from each choice's text, with what follows
    logprobs: int | None  # None: none; else the number of top alternatives at each position
    stream: bool
    include_usage: bool
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def n(self) -> int:
        return self.command.num_samples


class OpenAiFace:
    def __init__(self, sampling: TextSampling, rest: Rest) -> None:
        self.sampling = sampling
        self.rest = rest

    async def completions(self, request: web.Request) -> web.StreamResponse:
        tenant, body = tenant_of(request), await read_json(request)
        target = await self._target(tenant, _model(body))
        prompts = _prompts(body, target.tokenizer)
        logprobs = _opt_int(body, "logprobs", 0, MAX_TOPK_LOGPROBS)
        call = self._call(body, target, prompts, chat=False, logprobs=logprobs, stops=())
        return await self._answer(request, tenant, call)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        tenant, body = tenant_of(request), await read_json(request)
        target = await self._target(tenant, _model(body))
        config = tokenizer_config_of(target.spec.name)
        text = _render(target.spec.name, config, _messages(body), body)
        prompt = target.tokenizer.encode(text, add_special_tokens=False).ids
        if _flag(body, "logprobs"):
            logprobs: int | None = _opt_int(body, "top_logprobs", 0, MAX_TOPK_LOGPROBS) or 0
        elif body.get("top_logprobs") is not None:
            raise InvalidRequest("'top_logprobs' needs 'logprobs': true")
        else:
            logprobs = None
        end = _special(config, "eos_token")
        call = self._call(
            body, target, [prompt], chat=True, logprobs=logprobs, stops=(end,) if end else ()
        )
        return await self._answer(request, tenant, call)

    async def list_models(self, request: web.Request) -> web.StreamResponse:
        """The base models this deployment serves, then the caller's sampler checkpoints, newest
        first (at most ``MAX_LISTED_CHECKPOINTS``). Another tenant's published checkpoint can be
        used by its path, but is not listed."""
        tenant = tenant_of(request)
        names = [
            m["model_name"] for m in self.sampling.gateway.server_capabilities()["supported_models"]
        ]
        data = [_model_object(name, 0, "tinsmith") for name in names]
        found = json.loads(
            await self.rest.ask("user_checkpoints", tenant, limit=MAX_LISTED_CHECKPOINTS, offset=0)
        )
        for checkpoint in found["checkpoints"]:
            if checkpoint.get("checkpoint_type") == "sampler":
                data.append(
                    _model_object(
                        checkpoint["tinker_path"], _timestamp(checkpoint.get("time")), tenant.name
                    )
                )
        return web.json_response({"object": "list", "data": data})

    async def get_model(self, request: web.Request) -> web.StreamResponse:
        tenant, name = tenant_of(request), request.match_info["model"]
        target = await self._target(tenant, name)
        owner = tenant.name if target.model_path else "tinsmith"
        return web.json_response(_model_object(name, 0, owner))

    async def _target(self, tenant: Tenant, model: str) -> Target:
        """The model a call names, once the tenant may read it. An unknown base model is a 404
        (OpenAI's ``model_not_found``) that lists the ones served."""
        if ";" in model:
            base, _, path = model.partition(";")
            if not path.startswith("tinker://"):
                raise InvalidRequest(
                    "a model named '<base model>;<checkpoint>' needs a tinker:// sampler "
                    "checkpoint path after the ';'"
                )
        elif model.startswith("tinker://"):
            base, path = "", model
        else:
            base, path = model, ""
        try:
            target = await self.sampling.target(
                tenant, model_path=path, base_model="" if path else base
            )
        except InvalidRequest as error:
            if path or not error.detail.startswith("unknown base model"):
                raise
            raise NotFound(f"the model {model[:200]!r} does not exist: {error.detail}") from None
        if path and base and base != target.spec.name:
            raise InvalidRequest(
                f"{path} was trained on {target.spec.name}, not {base[:200]!r}: name its base "
                "model, or the path alone"
            )
        return target

    def _call(
        self,
        body: dict[str, Any],
        target: Target,
        prompts: list[list[int]],
        *,
        chat: bool,
        logprobs: int | None,
        stops: tuple[str, ...],
    ) -> _Call:
        """The sample command for each prompt, checked (by the same checks as the SDK's
        sample) before anything is appended."""
        for name, neutral in _NEUTRAL.items():
            if name in body and body[name] not in neutral:
                shown = " or ".join(json.dumps(value) for value in neutral if value is not None)
                raise InvalidRequest(
                    f"{name!r} is not supported here (tinsmith samples with temperature, top_p, "
                    f"stop, seed, n and max_tokens): leave it out, or send {shown}"
                )
        n = _opt_int(body, "n", 1, MAX_NUM_SAMPLES) or 1
        best_of = _opt_int(body, "best_of", 1, MAX_NUM_SAMPLES)
        if best_of is not None and best_of != n:
            raise InvalidRequest(
                f"'best_of' ({best_of}) must equal 'n' ({n}): this server returns every sample"
            )
        user_stops = _stop(body.get("stop"))
        max_tokens = _max_tokens(body, chat, target, prompts)
        asked = {name: body[name] for name in ("temperature", "top_p", "seed") if name in body}
        params = wire.sampling_params(
            {
                **{name: value for name, value in asked.items() if value is not None},
                "max_tokens": max_tokens,
                "stop": [*user_stops, *stops] or None,
            }
        )
        command = bus.Sample(params=params, num_samples=n, topk_sample_logprobs=logprobs or 0)
        for prompt in prompts:
            one = bus.Sample()
            one.CopyFrom(command)
            one.prompt.extend(prompt)
            self.sampling.check(target, one)
        stream = _flag(body, "stream")
        options = body.get("stream_options")
        if options is not None and (not stream or not isinstance(options, dict)):
            raise InvalidRequest("'stream_options' is an object, and only for 'stream': true")
        include_usage = bool(options) and _flag(options or {}, "include_usage")
        return _Call(
            chat=chat,
            model=str(body["model"]),
            target=target,
            prompts=prompts,
            command=command,
            stops=tuple(
                dict.fromkeys(s for s in (*user_stops, *stops, *_eos_texts(target.spec.name)) if s)
            ),
            logprobs=logprobs,
            stream=stream,
            include_usage=include_usage,
        )

    # -- answers -------------------------------------------------------------------------------

    async def _answer(
        self, request: web.Request, tenant: Tenant, call: _Call
    ) -> web.StreamResponse:
        async with contextlib.AsyncExitStack() as held:
            sampler_id = await held.enter_async_context(
                self.sampling.sampler(tenant, call.target, TAG)
            )
            commands = []
            for prompt in call.prompts:
                command = bus.Sample()
                command.CopyFrom(call.command)
                command.prompt.extend(prompt)
                commands.append(command)
            if call.stream:
                return await self._events(request, tenant, call, sampler_id, commands, held)
            async with asyncio.TaskGroup() as group:
                pending = [
                    group.create_task(self.sampling.sample(tenant, sampler_id, seq, command))
                    for seq, command in enumerate(commands)
                ]
        choices: list[_Choice] = []
        for task in pending:
            for sequence in task.result().sequences:
                choice = _Choice(len(choices), call)
                choice.finish(sequence)
                choices.append(choice)
        kind = "chat.completion" if call.chat else "text_completion"
        return web.json_response(
            {
                **_header(call, kind),
                "choices": [choice.whole() for choice in choices],
                "usage": _usage(call, choices),
            }
        )

    async def _events(
        self,
        request: web.Request,
        tenant: Tenant,
        call: _Call,
        sampler_id: str,
        commands: list[bus.Sample],
        session: contextlib.AsyncExitStack,
    ) -> web.StreamResponse:
        """Answer with server-sent events as the sampler generates. The response begins with
        the first tokens, so a call refused on the way (a full queue) is still a plain error;
        one that fails after it began ends with an error event. The call's ``session`` is
        finished before the last event, so a client that has read it sees it finished."""
        kind = "chat.completion.chunk" if call.chat else "text_completion"
        choices = [_Choice(i, call) for i in range(len(commands) * call.n)]
        response: web.StreamResponse | None = None

        async def send(event: dict[str, Any] | str) -> None:
            nonlocal response
            if response is None:
                response = web.StreamResponse(
                    headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
                )
                await response.prepare(request)
                if call.chat:  # each choice begins with its role
                    for choice in choices:
                        await send(_chunk(call, kind, [choice.opening()]))
            data = event if isinstance(event, str) else json.dumps(event)
            await response.write(f"data: {data}\n\n".encode())

        streams = [
            self.sampling.stream(tenant, sampler_id, seq, command)
            for seq, command in enumerate(commands)
        ]
        try:
            merged = _merged(streams)
            async with contextlib.aclosing(merged):
                async for seq, chunk in merged:
                    parts = self._parts(call, choices, seq, chunk)
                    if parts:
                        await send(_chunk(call, kind, parts))
        except TinsmithError as error:
            if response is None:
                raise
            await session.aclose()
            await send(error_body(error.http_status, {"detail": error.detail}))
            await send("[DONE]")
            return response
        await session.aclose()
        if call.include_usage:
            await send({**_header(call, kind), "choices": [], "usage": _usage(call, choices)})
        await send("[DONE]")
        assert response is not None
        await response.write_eof()
        return response

    @staticmethod
    def _parts(
        call: _Call, choices: list[_Choice], seq: int, chunk: svc.SampleChunk
    ) -> list[dict[str, Any]]:
        """What one chunk of prompt ``seq``'s stream adds to its choices' answers."""
        for delta in chunk.deltas:
            choices[seq * call.n + delta.index].extend(delta.tokens, delta.logprobs)
        touched = {seq * call.n + delta.index for delta in chunk.deltas}
        if chunk.HasField("response"):
            for index, sequence in enumerate(chunk.response.sequences):
                choices[seq * call.n + index].finish(sequence)
                touched.add(seq * call.n + index)
        parts = (choices[i].news() for i in sorted(touched))
        return [part for part in parts if part is not None]


class _Choice:
    """One choice's tokens as they arrive, and what of its text and logprobs has been sent."""

    def __init__(self, index: int, call: _Call) -> None:
        self.index = index
        self.call = call
        self.tokenizer: Tokenizer = call.target.tokenizer
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.top: list[list[tuple[int, float]]] = []  # at each position, once finished
        self.sent_text = ""
        self.sent_tokens = 0
        self.finish_reason: str | None = None
        self.reported = False  # its finish reason has gone out

    def extend(self, tokens: bytes, logprobs: bytes) -> None:
        self.ids.extend(np.frombuffer(tokens, "<i4").tolist())
        self.logprobs.extend(np.frombuffer(logprobs, "<f4").tolist())

    def finish(self, sequence: tp.SampledSequence) -> None:
        """The stored result: the choice's whole sequence (a stream's last chunk has moved the
        tokens not streamed into the deltas)."""
        if sequence.tokens:
            self.ids = tokens_from_bytes(sequence.tokens).tolist()
            self.logprobs = np.frombuffer(sequence.logprobs, "<f4").tolist()
        if sequence.HasField("topk_sampled_logprobs"):
            top = sequence.topk_sampled_logprobs
            k = max(int(top.k), 1)
            ids = np.frombuffer(top.token_ids, "<i4").reshape(-1, k)
            values = np.frombuffer(top.logprobs, "<f4").reshape(-1, k)
            self.top = [
                [(int(i), float(v)) for i, v in zip(row_ids, row, strict=True) if i >= 0]
                for row_ids, row in zip(ids, values, strict=True)
            ]
        self.finish_reason = STOP_REASONS.get(sequence.stop_reason, "stop")

    def text(self) -> str:
        """What may be sent of the text: up to the first stop string; while unfinished, without
        a partial character at its end or what could begin a stop string."""
        text = self.tokenizer.decode(self.ids, skip_special_tokens=False)
        cut = _first_stop(text, self.call.stops)
        if cut is not None:
            return text[:cut]
        if self.finish_reason is not None:
            return text
        text = text.rstrip("\ufffd")
        return text[: len(text) - _stop_prefix(text, self.call.stops)]

    def _kept_tokens(self, text: str) -> int:
        """How many tokens begin within ``text``: those from a stop string on are not the
        answer's."""
        kept = self.sent_tokens
        while kept < len(self.ids) and self._start(kept) < len(text):
            kept += 1
        return kept

    def _start(self, i: int) -> int:
        """Where token ``i`` begins in the text (a partial character before it not counted)."""
        prefix = self.tokenizer.decode(self.ids[:i], skip_special_tokens=False)
        return len(prefix.rstrip("\ufffd"))

    def whole(self) -> dict[str, Any]:
        """The choice in a plain answer."""
        text = self.text()
        answer: dict[str, Any] = {"index": self.index, "finish_reason": self.finish_reason}
        logprobs = self._logprobs(0, self._kept_tokens(text), text)
        if self.call.chat:
            answer["message"] = {"role": "assistant", "content": text}
        else:
            answer["text"] = text
        answer["logprobs"] = logprobs
        return answer

    def opening(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }

    def news(self) -> dict[str, Any] | None:
        """The choice's part of the next event: its text not sent yet, its tokens' logprobs
        (all of them at the end when top alternatives are asked), and its finish reason once
        known; None when there is nothing new."""
        text = self.text()
        if not text.startswith(self.sent_text):  # a decoder that is not prefix-stable
            log.warning("choice %d: its text changed after it was sent", self.index)
            text = self.sent_text + text[len(self.sent_text) :]
        new_text = text[len(self.sent_text) :]
        finished = self.finish_reason is not None
        holding = bool(self.call.logprobs) and not finished  # the top-k come with the result
        asked = self.call.logprobs is not None and not holding
        kept = self._kept_tokens(text) if asked else self.sent_tokens
        logprobs = self._logprobs(self.sent_tokens, kept, text) if kept > self.sent_tokens else None
        if not new_text and logprobs is None and (not finished or self.reported):
            return None
        part: dict[str, Any] = {"index": self.index}
        if self.call.chat:
            part["delta"] = {"content": new_text} if new_text else {}
        else:
            part["text"] = new_text
        part["logprobs"] = logprobs
        part["finish_reason"] = self.finish_reason
        self.sent_text, self.sent_tokens = text, kept
        self.reported = finished
        return part

    def _logprobs(self, start: int, end: int, text: str) -> dict[str, Any] | None:
        """Tokens ``start:end`` in the shape the route answers, or None if none were asked."""
        if self.call.logprobs is None:
            return None
        pieces = [self._piece(i) for i in range(start, end)]
        tops = [self._top(i) for i in range(start, end)]
        if self.call.chat:
            return {
                "content": [
                    {
                        "token": piece,
                        "logprob": self.logprobs[i],
                        "bytes": list(piece.encode()),
                        "top_logprobs": [
                            {"token": t, "logprob": v, "bytes": list(t.encode())} for t, v in top
                        ],
                    }
                    for i, piece, top in zip(range(start, end), pieces, tops, strict=True)
                ]
            }
        return {
            "tokens": pieces,
            "token_logprobs": self.logprobs[start:end],
            "top_logprobs": [_most_likely(top) for top in tops] if self.call.logprobs else None,
            "text_offset": [min(self._start(i), len(text)) for i in range(start, end)],
        }

    def _piece(self, i: int) -> str:
        return self.tokenizer.decode([self.ids[i]], skip_special_tokens=False)

    def _top(self, i: int) -> list[tuple[str, float]]:
        if not self.call.logprobs or i >= len(self.top):
            return []
        return [
            (self.tokenizer.decode([t], skip_special_tokens=False), v)
            for t, v in self.top[i][: self.call.logprobs]
        ]


def _most_likely(top: list[tuple[str, float]]) -> dict[str, float]:
    """Top alternatives as completions answer them, a dict by text: where two tokens read the
    same (parts of one character), the likelier one's."""
    found: dict[str, float] = {}
    for text, value in top:
        found.setdefault(text, value)
    return found


def _header(call: _Call, kind: str) -> dict[str, Any]:
    prefix = "chatcmpl" if call.chat else "cmpl"
    return {
        "id": f"{prefix}-{call.id}",
        "object": kind,
        "created": call.created,
        "model": call.model,
    }


def _chunk(call: _Call, kind: str, parts: list[dict[str, Any]]) -> dict[str, Any]:
    return {**_header(call, kind), "choices": parts}


def _usage(call: _Call, choices: Sequence[_Choice]) -> dict[str, int]:
    prompt = sum(len(p) for p in call.prompts)
    completion = sum(len(c.ids) for c in choices)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


async def _merged(
    streams: list[AsyncGenerator[svc.SampleChunk, None]],
) -> AsyncGenerator[tuple[int, svc.SampleChunk], None]:
    """The chunks of several streams as they come, each with its stream's index. The first
    error ends it; leaving it closes every stream (which cancels its request)."""
    queue: asyncio.Queue[tuple[int, svc.SampleChunk | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncGenerator[svc.SampleChunk, None]) -> None:
        try:
            async with contextlib.aclosing(stream):
                async for chunk in stream:
                    queue.put_nowait((index, chunk))
            queue.put_nowait((index, None))
        except Exception as error:
            queue.put_nowait((index, error))

    tasks = [asyncio.ensure_future(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            index, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


# -- reading requests -------------------------------------------------------------------------


def _model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model or len(model) > 2048:
        raise InvalidRequest(
            "'model' must name what to sample: a tinker:// sampler checkpoint path, a base "
            "model's name (GET /v1/models lists them), or '<base model>;<tinker:// path>'"
        )
    return model


def _prompts(body: dict[str, Any], tokenizer: Tokenizer) -> list[list[int]]:
    """``prompt``: a text, a list of texts, a list of token ids, or a list of lists of them."""
    prompt = body.get("prompt")
    what = (
        "'prompt' must be a text, a list of texts, a list of token ids, or a list of lists of "
        f"token ids (at most {MAX_PROMPTS} prompts, each not empty)"
    )
    single = isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt)
    if isinstance(prompt, str) or single:
        prompt = [prompt]
    if not isinstance(prompt, list) or not 1 <= len(prompt) <= MAX_PROMPTS:
        raise InvalidRequest(what)
    prompts = []
    for item in prompt:
        if isinstance(item, str) and 0 < len(item) <= MAX_PROMPT_CHARS:
            prompts.append(tokenizer.encode(item, add_special_tokens=False).ids)
        elif isinstance(item, list) and item and all(_is_int(t) for t in item):
            prompts.append(wire.token_ids(item, "prompt token ids"))
        else:
            raise InvalidRequest(what)
    if any(not p for p in prompts):
        raise InvalidRequest("a prompt encodes to no tokens: send some text")
    return prompts


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """``messages``, each with a ``role`` and text ``content`` (a string, or text parts, which
    are joined); other fields of a message (``name``) go to the template as they are."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not 1 <= len(messages) <= MAX_MESSAGES:
        raise InvalidRequest(f"'messages' must be a list of 1 to {MAX_MESSAGES} messages")
    read = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InvalidRequest(f"messages[{i}] must be an object with a 'role'")
        content = message.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise InvalidRequest(
                        f"messages[{i}].content has a part that is not text: the models "
                        "served here read text only"
                    )
                parts.append(str(part.get("text", "")))
            content = "".join(parts)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise InvalidRequest(f"messages[{i}].content must be a text or a list of text parts")
        read.append({**message, "content": content})
    return read


def _render(
    name: str, config: dict[str, Any], messages: list[dict[str, Any]], body: dict[str, Any]
) -> str:
    """The conversation through the model's chat template, ending with the assistant's turn
    opened (or, with ``continue_final_message``, with the last message left open)."""
    source = config.get("chat_template")
    if isinstance(source, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if not isinstance(source, str) or not source:
        raise InvalidRequest(
            f"{name} has no chat template: use /v1/completions with the text to continue"
        )
    continuing = _flag(body, "continue_final_message")
    generation = not continuing and body.get("add_generation_prompt", True) is not False
    tokens = {
        key: text
        for key in ("bos_token", "eos_token", "pad_token", "unk_token")
        if (text := _special(config, key))
    }
    try:
        rendered = _template(source).render(
            messages=messages, add_generation_prompt=generation, **tokens
        )
    except jinja2.TemplateError as error:
        raise InvalidRequest(f"{name}'s chat template refused the messages: {error}") from None
    if continuing:
        last = messages[-1]["content"]
        end = rendered.rfind(last) if last else -1
        if end < 0:
            raise InvalidRequest(
                "continue_final_message: the last message's text was not found in the template"
            )
        rendered = rendered[: end + len(last)]
    if len(rendered) > MAX_PROMPT_CHARS:
        raise InvalidRequest(f"the conversation is over {MAX_PROMPT_CHARS} characters")
    return rendered


@functools.lru_cache(maxsize=16)
def _template(source: str) -> jinja2.Template:
    """A chat template compiled as Hugging Face renders them: sandboxed, trimmed blocks,
    ``raise_exception`` and ``strftime_now``, and a ``tojson`` that keeps non-ASCII text."""

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(value: Any, indent: int | None = None) -> str:
        return json.dumps(value, ensure_ascii=False, indent=indent)

    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    try:
        return environment.from_string(source)
    except jinja2.TemplateError as error:
        raise InvalidRequest(f"the model's chat template does not compile: {error}") from None


def _special(config: dict[str, Any], key: str) -> str:
    value = config.get(key)
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


@functools.lru_cache(maxsize=16)
def _eos_texts(base_model: str) -> tuple[str, ...]:
    """The model's end-of-sequence tokens as text (the sampler stops at them): cut from a
    choice's text like a stop string."""
    ids = models.eos_ids_of(json.loads(model_file(base_model, "config.json")))
    return tuple(tokenizer_of(base_model).decode([i], skip_special_tokens=False) for i in ids)


def _max_tokens(body: dict[str, Any], chat: bool, target: Target, prompts: list[list[int]]) -> int:
    """``max_tokens`` (chat: or ``max_completion_tokens``). Left out: 16 for completions, as
    OpenAI does; for chat, the rest of the model's context."""
    names = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
    for name in names:
        value = _opt_int(body, name, 1, 2**31 - 1)
        if value is not None:
            return value
    if not chat:
        return DEFAULT_COMPLETION_TOKENS
    room = target.spec.max_context_length - max(len(p) for p in prompts)
    if room < 1:
        raise InvalidRequest(
            f"the conversation takes {max(len(p) for p in prompts)} tokens, "
            f"{target.spec.name}'s whole context ({target.spec.max_context_length})"
        )
    return room


def _stop(value: Any) -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if (
        not isinstance(stops, list)
        or len(stops) > MAX_STOPS
        or not all(isinstance(s, str) and s for s in stops)
    ):
        raise InvalidRequest(f"'stop' must be a string or a list of at most {MAX_STOPS} strings")
    return list(stops)


def _opt_int(body: dict[str, Any], name: str, minimum: int, maximum: int) -> int | None:
    if body.get(name) is None:
        return None
    return wire.req_int(body, name, minimum=minimum, maximum=maximum)


def _flag(body: dict[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise InvalidRequest(f"'{name}' must be true or false")
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _first_stop(text: str, stops: Sequence[str]) -> int | None:
    found = [i for i in (text.find(stop) for stop in stops) if i >= 0]
    return min(found) if found else None


def _stop_prefix(text: str, stops: Sequence[str]) -> int:
    """The length of the longest end of ``text`` that begins a stop string (held back: the
    next tokens may complete it)."""
    longest = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    return longest


def _model_object(name: str, created: int, owner: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": created, "owned_by": owner}


def _timestamp(value: Any) -> int:
    with contextlib.suppress(TypeError, ValueError):
        return int(datetime.datetime.fromisoformat(str(value)).timestamp())
    return 0
