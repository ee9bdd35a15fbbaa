"""One short story told with whichever ``tinker`` SDK the Python running it has installed,
against a running tinsmith: the protocol suite for every SDK version tinsmith supports.

    python tests/sdk_story.py BASE_URL API_KEY BASE_MODEL

It is a plain script (it needs the SDK, and numpy and httpx, which the SDK depends on; nothing of
tinsmith's), so that each SDK version's own virtual environment can run it; the tests in
``tests/e2e/test_sdk_versions.py`` do. The story: a session, a LoRA run, ``forward``,
``forward_backward``, ``optim_step``, ``save_state``, a run created from that state with its
optimizer and one without, sampler weights, ``sample`` with prompt logprobs,
``compute_logprobs``, the REST catalog, and (0.34.0 and before) the checkpoint archive. Every
step checks values, not only that a call returned: forward's logprobs are forward_backward's, the
loss moves after a step, a run created from state scores as the saved one did and then steps as
the original (with the optimizer) or not (without), the sampler's prompt logprobs are
compute_logprobs' and the trained run's, and an archive holds its checkpoint's files byte for
byte as they download one by one.

It prints one JSON line: ``{"sdk": version, "passed": [steps], "skipped": {step: why},
"values": {...}}``. A step the version's SDK lacks the method for is skipped, and ``skipped``
says why; nothing is skipped silently. A failing step ends the story: the JSON line then has
``"failed": step`` and ``"error"``, the traceback goes to stderr, and the exit status is 1.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import inspect
import io
import json
import math
import os
import subprocess
import sys
import tarfile
import tempfile
import traceback
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import tinker
from tinker import types

ADAM = types.AdamParams(learning_rate=1e-2)
# Two runs on the same weights, fed the same tokens, agree this closely (float32 on one CPU).
SAME = 1e-5
# A sampler and a trainer compute the same logprobs with different kernels.
CLOSE = 1e-3
# The marker a checkpoint archive ends with: the old CLI's push-hf refuses an archive without it.
COMPLETE = "checkpoint_complete"


class StoryFailed(Exception):
    """A value the story checks was not what it should be."""


def check(condition: bool, message: str) -> None:
    if not condition:
        raise StoryFailed(message)


class _Failed(Exception):
    """A step that failed, and why: what ends the story."""

    def __init__(self, step: str, error: Exception) -> None:
        super().__init__(f"{step}: {type(error).__name__}: {error}")
        self.step = step
        self.error = error


class Story:
    """What the story has told so far: the steps passed and skipped, and the values measured."""

    def __init__(self) -> None:
        self.passed: list[str] = []
        self.skipped: dict[str, str] = {}
        self.values: dict[str, Any] = {}

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[None]:
        try:
            yield
        except Exception as error:
            raise _Failed(name, error) from error
        self.passed.append(name)

    def method(self, owner: Any, name: str, step: str) -> Any:
        """``owner``'s method ``name``, or None with ``step`` recorded as skipped for its lack."""
        found = getattr(owner, name, None)
        if found is None:
            self.skipped[step] = f"{type(owner).__name__}.{name} does not exist in this version"
        return found


def resolved(value: Any) -> Any:
    """A client, whether the SDK returned it (older versions) or a future of it (newer ones)."""
    result = getattr(type(value), "result", None)
    return value.result() if callable(result) else value


def datum(tokens: list[int], weights: list[float] | None = None) -> types.Datum:
    """Next-token prediction over ``tokens``: input all but the last, targets all but the first."""
    n = len(tokens) - 1
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tokens[1:],
            "weights": weights if weights is not None else [1.0] * n,
        },
    )


def batch(seed: int) -> list[types.Datum]:
    rng = np.random.default_rng(seed)
    out = []
    for length in (9, 6, 12):
        tokens = rng.integers(3, 500, size=length + 1).tolist()
        out.append(datum(tokens, rng.uniform(0.5, 1.5, size=length).tolist()))
    return out


def logprobs(output: Any) -> list[np.ndarray]:
    """Each datum's logprobs from a forward or forward_backward output."""
    return [np.asarray(o["logprobs"].tolist(), dtype=np.float64) for o in output.loss_fn_outputs]


def weighted_loss(data: list[types.Datum], per_datum: list[np.ndarray]) -> float:
    """cross_entropy's loss:sum for these logprobs: the weighted sum of the negated logprobs."""
    total = 0.0
    for d, lp in zip(data, per_datum, strict=True):
        total -= float(np.dot(np.asarray(d.loss_fn_inputs["weights"].tolist()), lp))
    return total


def max_diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    check(len(a) == len(b), f"{len(a)} outputs against {len(b)}")
    for x, y in zip(a, b, strict=True):
        check(x.shape == y.shape, f"shapes {x.shape} and {y.shape} differ")
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b, strict=True))


def forward(training: Any, data: list[types.Datum]) -> list[np.ndarray]:
    return logprobs(training.forward(data, "cross_entropy").result())


def train_step(training: Any, data: list[types.Datum]) -> None:
    fb = training.forward_backward(data, "cross_entropy")
    training.optim_step(ADAM).result()
    fb.result()


def rest_client(service: Any, base_url: str, api_key: str) -> Any:
    """A RestClient as the version makes one: on its own (newer) or from the ServiceClient."""
    rest = getattr(tinker, "RestClient", None)
    if rest is not None and "base_url" in inspect.signature(rest.__init__).parameters:
        return rest(base_url=base_url, api_key=api_key)
    return service.create_rest_client()


def fetched(urls: dict[str, str]) -> dict[str, bytes]:
    """Each file of a checkpoint from its download URL (no API key: the URL is the credential)."""
    return {
        name: httpx.get(url, timeout=60).raise_for_status().content for name, url in urls.items()
    }


def file_urls(base_url: str, api_key: str, tinker_path: str) -> dict[str, str]:
    """A download URL per file of any checkpoint, from the route that ``get_external_weights_urls``
    calls (that method, 0.34.0 and later, takes external weights only; older versions lack it)."""
    run, checkpoint = tinker_path.removeprefix("tinker://").split("/", 1)
    answer = httpx.get(
        f"{base_url}/api/v1/training_runs/{run}/checkpoints/{checkpoint}/external_weights_urls",
        headers={"X-API-Key": api_key},
        timeout=60,
    )
    urls: dict[str, str] = answer.raise_for_status().json()["urls"]
    return urls


def archived(answer: Any) -> dict[str, bytes]:
    """The files of a checkpoint archive, from the URL the SDK's archive method answered, read as
    the old CLI extracts it: a tar of regular files at its root."""
    check(answer.expires > datetime.now(UTC) + timedelta(minutes=30), f"expires {answer.expires}")
    data = httpx.get(answer.url, timeout=60).raise_for_status().content
    files = {}
    with tarfile.open(fileobj=io.BytesIO(data), mode="r") as tar:
        for member in tar.getmembers():
            check(member.isreg() and "/" not in member.name, f"archive member {member.name}")
            extracted = tar.extractfile(member)
            assert extracted is not None
            files[member.name] = extracted.read()
    return files


def cli_download(base_url: str, api_key: str, tinker_path: str) -> dict[str, bytes]:
    """``tinker checkpoint download`` of this version: the files it extracts."""
    with tempfile.TemporaryDirectory() as out:
        command = ["--format", "json", "checkpoint", "download", tinker_path, "--output", out]
        done = subprocess.run(
            [str(Path(sys.executable).parent / "tinker"), *command],
            env={**os.environ, "TINKER_BASE_URL": base_url, "TINKER_API_KEY": api_key},
            capture_output=True,
            text=True,
            timeout=120,
        )
        check(done.returncode == 0, f"tinker checkpoint download: {done.stdout}{done.stderr}")
        (directory,) = Path(out).iterdir()
        check(directory.name == tinker_path.removeprefix("tinker://").replace("/", "_"), out)
        return {p.name: p.read_bytes() for p in directory.iterdir()}


def tell(story: Story, base_url: str, api_key: str, base_model: str) -> None:
    values = story.values
    first, second, third = batch(1), batch(2), batch(3)

    with story.step("session"):
        service = tinker.ServiceClient(base_url=base_url, api_key=api_key)
        rest = rest_client(service, base_url, api_key)
        # The RestClient's where it has one (newer versions), else the ServiceClient's.
        if hasattr(rest, "get_server_capabilities"):
            capabilities = rest.get_server_capabilities().result()
        else:
            capabilities = service.get_server_capabilities()
        names = [m.model_name for m in capabilities.supported_models]
        check(base_model in names, f"{base_model} is not among the server's models {names}")

    with story.step("create_lora_training_client"):
        training = resolved(
            service.create_lora_training_client(base_model=base_model, rank=8, seed=7)
        )
        session_id, kind, number = training.model_id.rsplit(":", 2)
        check(kind == "train" and number.isdigit(), f"run id {training.model_id}")
        info = training.get_info()
        check(info.model_data.model_name == base_model, f"get_info names {info.model_data}")
        check(info.lora_rank == 8, f"get_info says rank {info.lora_rank}")

    with story.step("forward"):
        before = forward(training, first)
        for d, lp in zip(first, before, strict=True):
            check(lp.shape == (d.model_input.length,), f"logprobs of shape {lp.shape}")
            check(bool(np.all(lp < 0)) and bool(np.all(np.isfinite(lp))), f"logprobs {lp}")

    with story.step("forward_backward"):
        output = training.forward_backward(first, "cross_entropy").result()
        values["forward_vs_forward_backward"] = max_diff(logprobs(output), before)
        check(values["forward_vs_forward_backward"] <= SAME, "forward and forward_backward differ")
        values["loss_before"] = output.metrics["loss:sum"]
        expected = weighted_loss(first, before)
        check(
            math.isclose(values["loss_before"], expected, rel_tol=1e-4),
            f"loss:sum {values['loss_before']} is not the weighted sum {expected}",
        )

    with story.step("optim_step"):
        training.optim_step(ADAM).result()
        after = forward(training, first)
        values["loss_after"] = weighted_loss(first, after)
        check(
            values["loss_after"] < values["loss_before"] - 1e-3,
            f"a step on the batch left its loss at {values['loss_after']}",
        )

    with story.step("save_state"):
        state = training.save_state("story-state").result().path
        check(state == f"tinker://{training.model_id}/weights/story-state", state)
        # The original goes on from the saved state: a step on the second batch, scored on
        # the third.
        train_step(training, second)
        reference = forward(training, third)

    runs = [training]
    step = "create_training_client_from_state_with_optimizer"
    with_optimizer = story.method(service, step, step)
    if with_optimizer is not None:
        with story.step(step):
            resumed = resolved(with_optimizer(state))
            runs.append(resumed)
            check(resumed.model_id != training.model_id, "the resumed run is the original")
            values["with_optimizer_at_save"] = max_diff(forward(resumed, first), after)
            check(values["with_optimizer_at_save"] <= SAME, "it does not score as the saved run")
            train_step(resumed, second)
            values["with_optimizer_next_step"] = max_diff(forward(resumed, third), reference)
            check(
                values["with_optimizer_next_step"] <= SAME,
                "with the optimizer restored, the next step differs from the original's",
            )

    with story.step("create_training_client_from_state"):
        fresh = resolved(service.create_training_client_from_state(state))
        runs.append(fresh)
        values["without_optimizer_at_save"] = max_diff(forward(fresh, first), after)
        check(values["without_optimizer_at_save"] <= SAME, "it does not score as the saved run")
        train_step(fresh, second)
        values["without_optimizer_next_step"] = max_diff(forward(fresh, third), reference)
        check(
            values["without_optimizer_next_step"] > 100 * SAME,
            "a fresh optimizer stepped exactly as the restored one",
        )

    prompt_tokens = [5, 77, 130, 9, 250, 31, 402, 18]
    prompt = types.ModelInput.from_ints(prompt_tokens)
    with story.step("save_weights_for_sampler"):
        sampler_path = training.save_weights_for_sampler("story-sampler").result().path
        expected = f"tinker://{training.model_id}/sampler_weights/story-sampler"
        check(sampler_path == expected, sampler_path)
        sampler = resolved(service.create_sampling_client(model_path=sampler_path))
        # What the trained run gives the prompt's tokens, for the sampler to agree with.
        trained = forward(training, [datum(prompt_tokens)])[0]

    with story.step("sample_with_prompt_logprobs"):
        params = types.SamplingParams(max_tokens=6, seed=11, temperature=1.0)
        response = sampler.sample(prompt, 2, params, include_prompt_logprobs=True).result()
        check(len(response.sequences) == 2, f"{len(response.sequences)} sequences")
        for sequence in response.sequences:
            check(1 <= len(sequence.tokens) <= 6, f"{len(sequence.tokens)} tokens")
            check(sequence.logprobs is not None, "no logprobs for the sampled tokens")
            check(len(sequence.logprobs) == len(sequence.tokens), "a logprob per token")
        sampled = response.prompt_logprobs
        check(sampled is not None, "no prompt logprobs")
        check(len(sampled) == len(prompt_tokens), f"{len(sampled)} prompt logprobs")
        check(sampled[0] is None, "the first prompt token has a logprob")
        sampled_lp = np.asarray(sampled[1:], dtype=np.float64)
        values["sampler_vs_trained_run"] = max_diff([sampled_lp], [trained])
        check(
            values["sampler_vs_trained_run"] <= CLOSE,
            "the sampler's prompt logprobs are not the trained run's",
        )

    compute_logprobs = story.method(sampler, "compute_logprobs", "compute_logprobs")
    if compute_logprobs is not None:
        with story.step("compute_logprobs"):
            computed = compute_logprobs(prompt).result()
            check(len(computed) == len(prompt_tokens) and computed[0] is None, f"{computed}")
            computed_lp = np.asarray(computed[1:], dtype=np.float64)
            values["compute_logprobs_vs_sample"] = max_diff([computed_lp], [sampled_lp])
            check(values["compute_logprobs_vs_sample"] <= SAME, "compute_logprobs differs")

    with story.step("rest_catalog"):
        listed = rest.list_training_runs(limit=100).result().training_runs
        listed_ids = {run.training_run_id for run in listed}
        run_ids = {run.model_id for run in runs}
        check(run_ids <= listed_ids, f"{run_ids - listed_ids} not listed")
        session = rest.get_session(session_id).result()
        check(set(session.training_run_ids) == run_ids, f"the session's runs {session}")
        run_info = rest.get_training_run(training.model_id).result()
        check(run_info.base_model == base_model, f"the run's base model {run_info.base_model}")
        check(run_info.lora_rank == 8, f"the run's rank {run_info.lora_rank}")
        checkpoints = rest.list_checkpoints(training.model_id).result().checkpoints
        paths = {c.checkpoint_id: c.tinker_path for c in checkpoints}
        expected_paths = {
            "weights/story-state": state,
            "sampler_weights/story-sampler": sampler_path,
        }
        check(paths == expected_paths, f"checkpoints {paths}")

    weights_info = story.method(rest, "get_weights_info_by_tinker_path", "weights_info")
    if weights_info is not None:
        with story.step("weights_info"):
            weights = weights_info(state).result()
            check(weights.base_model == base_model and weights.lora_rank == 8, f"{weights}")

    step = "checkpoint_archive"
    archive = story.method(rest, "get_checkpoint_archive_url_from_tinker_path", step)
    if archive is not None:
        with story.step(step):
            # Each checkpoint's archive is its files, byte for byte as each downloads alone,
            # and the marker; by path or by run and checkpoint id, and through the CLI.
            expected = {}
            for path in (state, sampler_path):
                expected[path] = {**fetched(file_urls(base_url, api_key, path)), COMPLETE: b""}
                check(archived(archive(path).result()) == expected[path], f"the archive of {path}")
            by_id = rest.get_checkpoint_archive_url(training.model_id, "weights/story-state")
            check(archived(by_id.result()) == expected[state], "the archive by checkpoint id")
            check(cli_download(base_url, api_key, state) == expected[state], "the CLI's download")
            values["archive_members"] = sorted(expected[state])
            export = getattr(training, "save_weights_external", None)
            if export is not None and hasattr(rest, "get_external_weights_urls"):
                # The same weights exported: what the SDK's own get_external_weights_urls gives.
                exported = export("story-export").result().path
                files = fetched(rest.get_external_weights_urls(exported).result().urls)
                check(archived(archive(exported).result()) == {**files, COMPLETE: b""}, exported)
                check(
                    {**files, COMPLETE: b""} == expected[sampler_path],
                    "the export of the sampler's weights differs from their archive",
                )
                values["export_members"] = sorted(files)

    close = story.method(service, "close", "close")
    if close is not None:
        with story.step("close"):
            close("success").result(timeout=30)


def main(argv: list[str]) -> int:
    if len(argv) != 4:
        print(__doc__, file=sys.stderr)
        return 2
    base_url, api_key, base_model = argv[1:]
    story = Story()
    report: dict[str, Any] = {"sdk": importlib.metadata.version("tinker")}
    try:
        tell(story, base_url, api_key, base_model)
    except _Failed as failed:
        traceback.print_exception(failed.error, file=sys.stderr)
        report.update(failed=failed.step, error=f"{type(failed.error).__name__}: {failed.error}")
    report.update(passed=story.passed, skipped=story.skipped, values=story.values)
    print(json.dumps(report))
    return 1 if "failed" in report else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
