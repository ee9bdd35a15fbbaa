"""The OpenAI-compatible routes, driven by the official ``openai`` client: completions and chat
completions answer what the SDK's ``sample`` draws for the same tokens and seed, stop strings
are cut as OpenAI cuts them, streams add up to the plain answers, chat goes through the model's
own template (as ``transformers`` renders it), models are listed and read per tenant, and every
refusal is OpenAI's error with tinsmith's detail."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import tinker
from tinker import types
from tokenizers import Tokenizer
from transformers import AutoTokenizer

from tests.conftest import RunningSystem
from tests.e2e.test_grpc import _sampler_lets_go
from tinsmith import models

pytestmark = pytest.mark.e2e
BASE = "tinsmith/tiny"
PROMPT = "the quick brown fox"
CHAT = [
    {"role": "system", "content": "Answer in pig latin."},
    {"role": "user", "content": "hello there"},
]


class User:
    def __init__(self, system: RunningSystem) -> None:
        self.key = f"tml-openai-{uuid.uuid4().hex[:8]}"
        self.url = system.url
        self.service = tinker.ServiceClient(base_url=system.url, api_key=self.key)
        self.client = openai.OpenAI(base_url=system.url + "/v1", api_key=self.key, max_retries=0)
        self.http = httpx.Client(
            base_url=system.url + "/api/v1", headers={"X-API-Key": self.key}, timeout=120
        )

    def close(self) -> None:
        self.client.close()
        self.http.close()


@pytest.fixture(scope="module")
def user(system: RunningSystem) -> Iterator[User]:
    me = User(system)
    yield me
    me.close()
    me.service.close("success").result(timeout=30)


@pytest.fixture(scope="module")
def sampler_path(user: User) -> str:
    training = user.service.create_lora_training_client(BASE, rank=4).result()
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(list(range(5, 30))),
        loss_fn_inputs={"target_tokens": list(range(6, 31)), "weights": [1.0] * 25},
    )
    training.forward_backward([datum], "cross_entropy").result(timeout=120)
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=120)
    return str(training.save_weights_for_sampler("openai").result(timeout=120).path)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_str(models.hub_snapshot(BASE).files["tokenizer.json"].decode())


def _sdk_sample(
    user: User, path: str, tokens: list[int], n: int, **params: Any
) -> types.SampleResponse:
    client = user.service.create_sampling_client(model_path=path).result()
    return client.sample(
        types.ModelInput.from_ints(tokens), n, types.SamplingParams(**params)
    ).result(timeout=120)


def test_a_completion_is_the_sdk_s_sample_of_the_same_tokens(
    user: User, sampler_path: str, tokenizer: Tokenizer
) -> None:
    answer = user.client.completions.create(
        model=sampler_path,
        prompt=PROMPT,
        max_tokens=12,
        temperature=1.0,
        seed=77,
        n=2,
        logprobs=0,
    )
    tokens = tokenizer.encode(PROMPT, add_special_tokens=False).ids
    expected = _sdk_sample(user, sampler_path, tokens, 2, max_tokens=12, temperature=1.0, seed=77)
    assert answer.model == sampler_path and answer.object == "text_completion"
    assert [c.index for c in answer.choices] == [0, 1]
    for choice, sequence in zip(answer.choices, expected.sequences, strict=True):
        assert choice.text == tokenizer.decode(sequence.tokens, skip_special_tokens=False)
        assert choice.finish_reason == "length"
        assert choice.logprobs is not None
        assert choice.logprobs.token_logprobs == pytest.approx(sequence.logprobs, abs=1e-4)
        assert choice.logprobs.tokens == [
            tokenizer.decode([t], skip_special_tokens=False) for t in sequence.tokens
        ]
        assert choice.logprobs.text_offset is not None
        assert choice.logprobs.text_offset[0] == 0
        assert choice.logprobs.text_offset == sorted(choice.logprobs.text_offset)
    assert answer.usage is not None
    assert answer.usage.prompt_tokens == len(tokens)
    assert answer.usage.completion_tokens == 24 and answer.usage.total_tokens == 24 + len(tokens)

    # Several prompts in one call, as texts or as token ids: a choice per prompt and sample.
    both = user.client.completions.create(
        model=sampler_path, prompt=[PROMPT, "hello"], max_tokens=3, n=2
    )
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    by_ids = user.client.completions.create(
        model=sampler_path, prompt=tokens, max_tokens=12, temperature=1.0, seed=77, n=2
    )
    assert [c.text for c in by_ids.choices] == [c.text for c in answer.choices]


def test_top_logprobs_are_the_most_likely_tokens(
    user: User, sampler_path: str, tokenizer: Tokenizer
) -> None:
    answer = user.client.completions.create(
        model=sampler_path, prompt=PROMPT, max_tokens=6, temperature=0.0, logprobs=3
    )
    logprobs = answer.choices[0].logprobs
    assert logprobs is not None and logprobs.top_logprobs is not None
    assert logprobs.tokens is not None and logprobs.token_logprobs is not None
    assert len(logprobs.top_logprobs) == len(logprobs.tokens) == 6
    for token, value, top in zip(
        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True
    ):
        assert 1 <= len(top) <= 3
        # Greedy: the sampled token is the most likely one, with the same logprob.
        best = max(top, key=lambda t: top[t])
        assert best == token and top[best] == pytest.approx(value, abs=1e-4)


def test_stop_strings_are_cut_from_the_text_as_openai_does(user: User, sampler_path: str) -> None:
    whole = user.client.completions.create(
        model=sampler_path, prompt=PROMPT, max_tokens=40, temperature=1.0, seed=5
    )
    text = whole.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert len(stop.strip()) >= 2, f"pick another seed: {text!r}"
    cut = user.client.completions.create(
        model=sampler_path,
        prompt=PROMPT,
        max_tokens=40,
        temperature=1.0,
        seed=5,
        stop=[stop, "never appears here"],
    )
    assert cut.choices[0].text == text[: text.find(stop)]
    assert cut.choices[0].finish_reason == "stop"
    # Streamed, the stop string never goes out, not even its beginning.
    streamed = user.client.completions.create(
        model=sampler_path,
        prompt=PROMPT,
        max_tokens=40,
        temperature=1.0,
        seed=5,
        stop=stop,
        stream=True,
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text[: text.find(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_a_stream_adds_up_to_the_plain_answer(user: User, sampler_path: str) -> None:
    params: dict[str, Any] = {
        "model": sampler_path,
        "prompt": PROMPT,
        "max_tokens": 60,
        "seed": 11,
        "n": 2,
        "logprobs": 0,
    }
    whole = user.client.completions.create(**params)
    stream = user.client.completions.create(
        **params, stream=True, stream_options={"include_usage": True}
    )
    texts, logprobs, reasons = ["", ""], [[], []], [None, None]
    arrivals, usage = [], None
    for chunk in stream:
        arrivals.append(time.monotonic())
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.logprobs is not None and choice.logprobs.token_logprobs is not None:
                logprobs[choice.index] += choice.logprobs.token_logprobs
            reasons[choice.index] = choice.finish_reason or reasons[choice.index]
    assert len(arrivals) > 5, "the tokens came in one piece, not as generated"
    assert texts == [c.text for c in whole.choices]
    assert reasons == ["length", "length"]
    for mine, choice in zip(logprobs, whole.choices, strict=True):
        assert choice.logprobs is not None
        assert mine == pytest.approx(choice.logprobs.token_logprobs, abs=1e-4)
    assert usage is not None and whole.usage is not None
    assert usage.completion_tokens == whole.usage.completion_tokens == 120


def test_chat_goes_through_the_model_s_template(
    user: User, sampler_path: str, tokenizer: Tokenizer
) -> None:
    template = AutoTokenizer.from_pretrained(str(models.materialize(BASE)))
    prompt = list(
        template.apply_chat_template(
            CHAT, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )
    answer = user.client.chat.completions.create(
        model=sampler_path,
        messages=CHAT,
        max_tokens=10,
        seed=3,
        temperature=1.0,
        logprobs=True,
        top_logprobs=2,
    )
    assert answer.object == "chat.completion"
    assert answer.usage is not None and answer.usage.prompt_tokens == len(prompt)
    expected = _sdk_sample(user, sampler_path, prompt, 1, max_tokens=10, seed=3, temperature=1.0)
    sequence = expected.sequences[0]
    text = tokenizer.decode(sequence.tokens, skip_special_tokens=False)
    # The end of the turn (the template's end-of-sequence token) is cut, as a stop string.
    text = text.split("<|endoftext|>")[0]
    message = answer.choices[0].message
    assert message.role == "assistant" and message.content == text
    logprobs = answer.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    kept = logprobs.content
    assert [t.logprob for t in kept] == pytest.approx(sequence.logprobs[: len(kept)], abs=1e-4)
    assert all(len(t.top_logprobs) == 2 for t in kept)

    stream = user.client.chat.completions.create(
        model=sampler_path, messages=CHAT, max_tokens=10, seed=3, temperature=1.0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == answer.choices[0].finish_reason


def test_models_lists_what_the_caller_may_use(
    system: RunningSystem, user: User, sampler_path: str
) -> None:
    listed = [m.id for m in user.client.models.list()]
    assert BASE in listed and sampler_path in listed
    assert user.client.models.retrieve(sampler_path).id == sampler_path
    stranger = User(system)
    try:
        assert sampler_path not in [m.id for m in stranger.client.models.list()]
        with pytest.raises(openai.NotFoundError):
            stranger.client.completions.create(model=sampler_path, prompt="hi", max_tokens=2)
        with pytest.raises(openai.NotFoundError):
            stranger.client.models.retrieve(sampler_path)
        rest = tinker.RestClient(base_url=system.url, api_key=user.key)
        rest.publish_checkpoint_from_tinker_path(sampler_path).result(timeout=60)
        shown = stranger.client.completions.create(model=sampler_path, prompt="hi", max_tokens=2)
        assert shown.choices[0].text is not None
    finally:
        stranger.close()
    # Tinker's own base URL and model spelling work too.
    tinker_style = openai.OpenAI(
        base_url=system.url + "/oai/api/v1", api_key=user.key, max_retries=0
    )
    answer = tinker_style.completions.create(
        model=f"{BASE};{sampler_path}", prompt="hi", max_tokens=2
    )
    assert len(answer.choices) == 1
    tinker_style.close()


def test_each_call_is_a_session_of_its_own_that_is_finished(user: User, sampler_path: str) -> None:
    def sessions() -> tuple[int, int]:
        opened = user.http.get("/usage").json()["tenants"][0]["sessions"]
        listed = user.http.get("/sessions", params={"limit": 1000}).json()["sessions"]
        return opened, len(listed)

    opened, made = sessions()
    user.client.completions.create(model=sampler_path, prompt="hi", max_tokens=2)
    list(user.client.completions.create(model=BASE, prompt="hi", max_tokens=2, stream=True))
    assert sessions() == (opened, made + 2)
    # Each holds the sampler of its call, and nothing else.
    for session in user.http.get("/sessions", params={"limit": 2}).json()["sessions"]:
        held = user.http.get(f"/sessions/{session}").json()
        assert len(held["sampler_ids"]) == 1 and held["training_run_ids"] == []


def test_a_stream_the_client_leaves_cancels_its_sample(system: RunningSystem, user: User) -> None:
    # 16 x 1000 tokens keep the sampler busy for several seconds if nothing cancels them.
    stream = user.client.completions.create(
        model=BASE, prompt=PROMPT, max_tokens=1000, n=16, stream=True
    )
    first = next(iter(stream))
    assert first.choices
    stream.close()
    _sampler_lets_go(system, within_s=2.0)


def test_keys_come_as_bearer_or_x_api_key(system: RunningSystem, user: User) -> None:
    wrong = openai.OpenAI(base_url=system.url + "/v1", api_key="not a key", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as refused:
        wrong.models.list()
    wrong.close()
    assert refused.value.status_code == 401
    plain = httpx.get(system.url + "/v1/models", headers={"X-API-Key": user.key}, timeout=30)
    assert plain.status_code == 200 and plain.json()["object"] == "list"


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"max_tokens": 2}, "'prompt' must be"),
        ({"prompt": [], "max_tokens": 2}, "'prompt' must be"),
        ({"prompt": "hi", "n": 0}, "n"),
        ({"prompt": "hi", "top_p": 2}, "top_p"),
        ({"prompt": "hi", "temperature": -1}, "temperature"),
        ({"prompt": "hi", "stop": [""]}, "'stop'"),
        ({"prompt": "hi", "logprobs": 99}, "logprobs"),
        ({"prompt": "hi", "echo": True}, "'echo' is not supported"),
        ({"prompt": "hi", "logit_bias": {"5": 10}}, "'logit_bias' is not supported"),
        ({"prompt": "hi", "best_of": 3}, "best_of"),
        ({"prompt": "hi", "max_tokens": 10**6}, "context length"),
        ({"prompt": [[5, 10**9]]}, "vocabulary"),
        ({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
    ],
)
def test_a_bad_completion_is_a_400_in_openai_s_shape(
    user: User, sampler_path: str, body: dict[str, Any], says: str
) -> None:
    answer = httpx.post(
        user.url + "/v1/completions",
        json={"model": sampler_path, **body},
        headers={"Authorization": f"Bearer {user.key}"},
        timeout=60,
    )
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert says in error["message"] and error["type"] == "invalid_request_error"
    assert answer.json()["detail"] == error["message"]


def test_bad_chats_and_unknown_models_are_refused(user: User, sampler_path: str) -> None:
    with pytest.raises(openai.BadRequestError) as image:
        user.client.chat.completions.create(
            model=sampler_path,
            messages=[
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
            ],
        )
    assert "not text" in image.value.message
    with pytest.raises(openai.NotFoundError) as unknown:
        user.client.completions.create(model="no/such-model", prompt="hi")
    assert unknown.value.code == "model_not_found" and "tinsmith/tiny" in unknown.value.message
    with pytest.raises(openai.BadRequestError) as mismatched:
        user.client.completions.create(model=f"tinsmith/small;{sampler_path}", prompt="hi")
    assert "was trained on tinsmith/tiny" in mismatched.value.message
