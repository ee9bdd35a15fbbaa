"""The web console in a real browser (Debian's Chromium, driven by Playwright) against a running
``tinsmith up`` with real runs in it, trained through the official SDK. Each page is loaded and
what it shows is checked against the API's numbers and the SDK's; publish, the TTL, the sampler
playground and the trace export are clicked through. Screenshots go to ``TINSMITH_SCREENSHOTS``
(a temporary directory by default); the ones in docs/ came from::

    TINSMITH_SCREENSHOTS=docs .venv/bin/python -m pytest tests/e2e/test_console.py
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
import tinker
from playwright.sync_api import Browser, Page, expect, sync_playwright
from tinker import types

from tests.browser import chromium_path
from tests.conftest import RunningSystem
from tests.e2e.test_tenancy import issue

pytestmark = pytest.mark.e2e

KEY_STORAGE = "tinsmith.apiKey"  # where console.js keeps the key
BASE = "tinsmith/tiny"
# Seconds a page may take to show what the API has (it refreshes every 2 s).
SHOWN_S = 15


@dataclass
class World:
    """What the tests trained: a sweep of runs, one with sampler weights, all one tenant's."""

    system: RunningSystem
    key: str
    sweep: str
    runs: list[str]
    losses: dict[str, float]  # each run's last loss:sum, as the SDK returned it
    sampler_path: str
    training: tinker.TrainingClient  # the first run's, to train on while a page watches

    def api(self, path: str, key: str | None = None) -> Any:
        answer = httpx.get(
            f"{self.system.url}/api/v1{path}",
            headers={"X-API-Key": key or self.key},
            timeout=30,
        )
        assert answer.status_code == 200, answer.text
        return answer.json()

    def page_url(self, fragment: str) -> str:
        return f"{self.system.url}/console/#/{fragment}"


def _datum(tokens: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


def _step(training: tinker.TrainingClient, learning_rate: float) -> float:
    batch = [_datum(list(range(3, 40))), _datum(list(range(60, 90)))]
    result = training.forward_backward(batch, "cross_entropy").result(timeout=120)
    training.optim_step(types.AdamParams(learning_rate=learning_rate)).result(timeout=120)
    return float(result.metrics["loss:sum"])


@pytest.fixture(scope="module")
def world(system: RunningSystem) -> Iterator[World]:
    tenant = f"console-{uuid.uuid4().hex[:6]}"
    key, _ = issue(system, tenant, admin=True)  # an admin: the engines page too
    sweep = f"sweep-{uuid.uuid4().hex[:6]}"
    service = tinker.ServiceClient(base_url=system.url, api_key=key)
    runs, losses, clients = [], {}, []
    for rank, learning_rate, steps in ((4, 1e-3, 4), (8, 1e-2, 4), (4, 3e-4, 3)):
        training = service.create_lora_training_client(
            BASE, rank=rank, user_metadata={"sweep": sweep, "variant": f"r{rank}"}
        ).result()
        for _ in range(steps):
            losses[training.model_id] = _step(training, learning_rate)
        runs.append(training.model_id)
        clients.append(training)
    sampler_path = clients[0].save_weights_for_sampler("console").result(timeout=120).path
    yield World(system, key, sweep, runs, losses, sampler_path, clients[0])
    service.close("success").result(timeout=60)  # its session's heartbeat ends with it


@pytest.fixture(scope="module")
def browser(world: World) -> Iterator[Browser]:
    """Started after ``world``: Playwright's sync API runs an event loop in this thread from
    here on, and ``issue`` (asyncio.run) cannot run beside it."""
    executable = chromium_path()
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=executable, args=["--no-sandbox"])
        yield launched
        launched.close()


@pytest.fixture(scope="module")
def screenshots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = os.environ.get("TINSMITH_SCREENSHOTS")
    return Path(where) if where else tmp_path_factory.mktemp("screenshots")


@contextlib.contextmanager
def _opened(browser: Browser, key: str | None) -> Iterator[Page]:
    """A page in a fresh browser profile (with ``key``: one that entered it before); closed
    after, and failing the test if any script on it raised."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    if key is not None:
        context.add_init_script(f"localStorage.setItem({KEY_STORAGE!r}, {json.dumps(key)})")
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    try:
        yield page
    finally:
        context.close()
    assert not errors, errors


@pytest.fixture
def page(browser: Browser, world: World) -> Iterator[Page]:
    with _opened(browser, world.key) as opened:
        yield opened


def _value(page: Page, selector: str) -> float:
    return float(page.locator(selector).first.get_attribute("data-value") or "nan")


def test_the_console_asks_for_a_key_once_and_keeps_it_in_the_browser(
    browser: Browser, world: World
) -> None:
    with _opened(browser, None) as page:
        _enter_keys(page, world)


def _enter_keys(page: Page, world: World) -> None:
    page.goto(f"{world.system.url}/console")  # redirected to /console/
    expect(page.locator("#key-dialog")).to_be_visible()
    page.fill("#key-input", "tml-not-a-key-anyone-issued")
    page.click("#key-form button[type=submit]")
    # In open mode an unknown tml- key is a tenant of its own, with no runs.
    expect(page.locator("main")).to_contain_text("No runs yet", timeout=SHOWN_S * 1000)

    page.click("#change-key")
    page.fill("#key-input", world.key)
    page.click("#key-form button[type=submit]")
    expect(page.locator("[data-test=runs] tbody tr")).to_have_count(3, timeout=SHOWN_S * 1000)
    page.reload()  # the key is kept: no dialog
    expect(page.locator("[data-test=runs] tbody tr")).to_have_count(3, timeout=SHOWN_S * 1000)
    expect(page.locator("#key-dialog")).to_be_hidden()

    page.click("#change-key")
    page.click("#key-forget")
    page.goto(f"{world.system.url}/console/#/engines")
    expect(page.locator("#key-dialog")).to_be_visible()
    assert page.evaluate(f"localStorage.getItem({KEY_STORAGE!r})") is None


def test_the_runs_page_lists_the_tenant_s_runs_with_their_last_loss(
    page: Page, world: World, screenshots: Path
) -> None:
    page.goto(world.page_url("runs"))
    rows = page.locator("[data-test=runs] tbody tr")
    expect(rows).to_have_count(3, timeout=SHOWN_S * 1000)
    listed = world.api("/console/runs")["runs"]
    # Newest first, as the API lists them.
    assert [row.get_attribute("data-run") for row in rows.all()] == [
        run["training_run_id"] for run in listed
    ]
    for run in world.runs:
        row = page.locator(f"tr[data-run='{run}']")
        shown = float(row.locator("[data-test=last-loss]").get_attribute("data-value") or "nan")
        assert math.isclose(shown, world.losses[run], rel_tol=1e-6)
        expect(row.locator("td").nth(1)).to_have_text(BASE)
        expect(row.locator("svg.spark polyline")).to_have_count(1)
    page.screenshot(path=screenshots / "console-runs.png")

    page.fill("input[name=sweep]", "no-such-sweep")
    page.click("button:text('Filter')")
    expect(page.locator("main")).to_contain_text("No runs yet", timeout=SHOWN_S * 1000)
    page.fill("input[name=sweep]", world.sweep)
    page.click("button:text('Filter')")
    expect(rows).to_have_count(3, timeout=SHOWN_S * 1000)


def test_the_run_page_follows_the_run_live_and_acts_on_its_checkpoints(
    page: Page, world: World, screenshots: Path
) -> None:
    run = world.runs[0]
    page.goto(world.page_url(f"runs/{quote(run, safe='')}"))
    last_loss = page.locator("[data-test=last-loss]")
    expect(last_loss).to_have_attribute("data-value", re.compile(r"\d"), timeout=SHOWN_S * 1000)
    api_loss = world.api(f"/training_runs/{quote(run)}/metrics")["metrics"]["loss:sum"]
    assert _value(page, "[data-test=last-loss]") == api_loss[-1][1]
    assert math.isclose(api_loss[-1][1], world.losses[run], rel_tol=1e-6)
    expect(page.locator("[data-metric='loss:sum'] svg polyline")).to_have_count(1)
    expect(page.locator("[data-metric='grad_norm:mean'] svg")).to_have_count(1)

    # Live: a step taken while the page is open shows up without a reload.
    steps_before = int(page.locator("[data-test=steps]").inner_text())
    new_loss = _step(world.training, 1e-3)
    expect(page.locator("[data-test=steps]")).to_have_text(
        str(steps_before + 1), timeout=SHOWN_S * 1000
    )
    expect(last_loss).not_to_have_attribute("data-value", str(api_loss[-1][1]))
    assert math.isclose(_value(page, "[data-test=last-loss]"), new_loss, rel_tol=1e-6)

    # The request timeline: the API's newest requests, with their queue and compute times.
    requests = world.api(f"/training_runs/{quote(run)}/requests?limit=60")["requests"]
    timeline = page.locator("[data-test=timeline] tbody tr")
    expect(timeline.first).to_have_attribute("data-request", requests[0]["request_id"])
    assert timeline.count() == len(requests)

    # Publish the sampler checkpoint from the page; the API then says it is public.
    row = page.locator(f"[data-test=checkpoints] tr[data-path='{world.sampler_path}']")
    expect(row.locator("[data-test=public]")).to_have_text("no")
    row.locator("[data-test=publish]").click()
    expect(row.locator("[data-test=public]")).to_have_text("yes", timeout=SHOWN_S * 1000)
    listed = world.api(f"/training_runs/{quote(run)}/checkpoints")["checkpoints"]
    (saved,) = [c for c in listed if c["tinker_path"] == world.sampler_path]
    assert saved["public"] is True
    # And a TTL: the API then says when it expires.
    row.locator("input[name=ttl]").fill("86400")
    row.locator("button:text('Set')").click()
    expect(row.locator("td").nth(4)).not_to_have_text("never", timeout=SHOWN_S * 1000)
    listed = world.api(f"/training_runs/{quote(run)}/checkpoints")["checkpoints"]
    (saved,) = [c for c in listed if c["tinker_path"] == world.sampler_path]
    assert saved["expires_at"] is not None

    # The playground samples the run's sampler checkpoint.
    page.select_option("[data-test=model]", world.sampler_path)
    page.fill("[data-test=prompt]", "The quick brown fox")
    page.fill("input[name=num_samples]", "3")
    page.fill("input[name=max_tokens]", "6")
    page.click("[data-test=sample]")
    completions = page.locator("[data-test=completion]")
    expect(completions).to_have_count(3, timeout=60_000)
    assert all(text for text in completions.all_inner_texts())
    expect(page.locator("[data-test=samples]")).to_contain_text(world.sampler_path)
    page.screenshot(path=screenshots / "console-run.png", full_page=True)
    # As chat: the prompt is the user's message, through the model's chat template.
    page.check("[data-test=chat]")
    page.fill("input[name=num_samples]", "2")
    page.click("[data-test=sample]")
    expect(page.locator("[data-test=samples]")).to_contain_text("the chat template applied")
    expect(completions).to_have_count(2, timeout=60_000)
    page.uncheck("[data-test=chat]")

    # The session's trace: a link to a Chrome trace of this session's requests.
    page.click("[data-test=trace]")
    link = page.locator("[data-test=trace-link]")
    expect(link).to_be_visible(timeout=SHOWN_S * 1000)
    trace = httpx.get(link.get_attribute("href") or "", timeout=30).json()
    slices = {
        event["args"].get("request_id") for event in trace["traceEvents"] if event["ph"] == "X"
    }
    assert requests[0]["request_id"] in slices

    # Delete, once the browser's confirmation is accepted: the checkpoint is gone from the API.
    page.once("dialog", lambda dialog: dialog.accept())
    row.locator("button:text('Delete')").click()
    expect(row).to_have_count(0, timeout=SHOWN_S * 1000)
    listed = world.api(f"/training_runs/{quote(run)}/checkpoints")["checkpoints"]
    assert world.sampler_path not in {c["tinker_path"] for c in listed}


def test_the_sweep_page_compares_the_runs_and_filters_the_improvements(
    page: Page, world: World, screenshots: Path
) -> None:
    page.goto(world.page_url(f"sweeps/{world.sweep}"))
    rows = page.locator("[data-test=sweep] tbody tr")
    expect(rows).to_have_count(3, timeout=SHOWN_S * 1000)
    sweep = world.api(f"/sweeps/{world.sweep}")
    assert [row.get_attribute("data-run") for row in rows.all()] == [
        run["training_run_id"] for run in sweep["runs"]
    ]
    # What differs: the rank, the learning rate and the variant noted in user_metadata.
    headers = page.locator("[data-test=sweep] thead th").all_inner_texts()
    assert {"LORA_RANK", "LEARNING_RATE", "VARIANT"} <= {h.upper() for h in headers}
    best = sweep["best"]
    expect(page.locator("tr.best")).to_have_attribute("data-run", best["training_run_id"])
    expect(page.locator("[data-test=best]")).to_contain_text(
        f"{best['value']:.5g}"[:4], timeout=SHOWN_S * 1000
    )
    expect(page.locator("svg.chart polyline")).to_have_count(3)
    page.screenshot(path=screenshots / "console-sweep.png", full_page=True)

    # Improvements only: the runs that beat every run launched before them.
    record, improving = math.inf, []
    for run in sweep["runs"]:
        if run["best"] and run["best"]["value"] < record:
            record = run["best"]["value"]
            improving.append(run["training_run_id"])
    page.check("[data-test=improvements]")
    expect(rows).to_have_count(len(improving), timeout=SHOWN_S * 1000)
    assert [row.get_attribute("data-run") for row in rows.all()] == improving

    # Another metric: the grad norm, best at its highest.
    page.fill("input[name=metric]", "grad_norm:mean")
    page.select_option("select[name=goal]", "max")
    expect(page.locator("main")).to_contain_text("higher is better", timeout=SHOWN_S * 1000)


def test_the_engines_page_shows_each_engine_s_duty_cycle_to_an_admin_only(
    page: Page, world: World, browser: Browser, screenshots: Path
) -> None:
    page.goto(world.page_url("engines"))
    rows = page.locator("[data-test=replicas] tbody tr")
    expect(rows.first).to_be_visible(timeout=SHOWN_S * 1000)
    engines = world.api("/engines")
    shown = {row.get_attribute("data-replica") for row in rows.all()}
    assert {e["replica"] for e in engines["engines"] if e["service"] in ("trainer", "sampler")} <= (
        shown
    )
    expect(page.locator("[data-service=trainer] svg polyline")).not_to_have_count(0)
    tenant = next(name for name, usage in engines["tenants"].items() if usage["runs"] == 3)
    expect(page.locator(f"[data-test=tenants] tr[data-tenant='{tenant}'] td").nth(2)).to_have_text(
        "3"
    )
    page.screenshot(path=screenshots / "console-engines.png", full_page=True)

    with _opened(browser, f"tml-console-{uuid.uuid4().hex[:8]}") as tenant_page:
        tenant_page.goto(world.page_url("engines"))
        expect(tenant_page.locator("[data-test=forbidden]")).to_contain_text(
            "admin key", timeout=SHOWN_S * 1000
        )


def test_the_console_s_files_are_served_without_a_key_and_hold_to_their_origin(
    world: World,
) -> None:
    for name in ("", "console.js", "console.css"):
        answer = httpx.get(f"{world.system.url}/console/{name}", timeout=30)
        assert answer.status_code == 200
        assert "script-src 'self'" in answer.headers["Content-Security-Policy"]
    assert httpx.get(f"{world.system.url}/console/secrets.txt", timeout=30).status_code == 404
    assert httpx.get(f"{world.system.url}/console/..%2Fhttp.py", timeout=30).status_code == 404
    # The data is not: every route the console reads wants the key.
    assert httpx.get(f"{world.system.url}/api/v1/console/runs", timeout=30).status_code == 401
