// The tinsmith console: every view draws what one or two JSON routes of the REST API answer,
// asked with the browser's key exactly as the SDK asks them, and redraws itself every 2 s.
// No framework and no build step: elements are built with h(), text is always set as text
// (never parsed as HTML), and charts are inline SVG drawn by lineChart().

const API = "/api/v1";
const KEY = "tinsmith.apiKey";
const POLL_MS = 2000;
const PALETTE = ["#2f6fdb", "#d9622b", "#1d8a55", "#8e44ad", "#c23a3a", "#128a9c", "#b58900",
  "#5d6d7e", "#e83e8c", "#6c8e23"];
const SVG = "http://www.w3.org/2000/svg";

// -- talking to the API --------------------------------------------------------------------------

class ApiError extends Error {
  constructor(status, detail) {
    super(detail);
    this.status = status;
  }
}

async function api(path, { method = "GET", body, root = API } = {}) {
  const key = localStorage.getItem(KEY);
  if (!key) throw new ApiError(401, "");
  const headers = { "X-API-Key": key };
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const response = await fetch(root + path, {
    method, headers, body: body === undefined ? undefined : JSON.stringify(body),
  });
  const text = await response.text();
  let data;
  try { data = text ? JSON.parse(text) : {}; } catch { data = { detail: text }; }
  if (!response.ok) throw new ApiError(response.status, data.detail || response.statusText);
  return data;
}

const enc = encodeURIComponent;

// A checkpoint's REST path from its tinker:// path: /training_runs/RUN/checkpoints/KIND/NAME.
function checkpointRoute(tinkerPath) {
  const [run, kind, ...name] = tinkerPath.replace(/^tinker:\/\//, "").split("/");
  return `/training_runs/${enc(run)}/checkpoints/${enc(kind)}/${enc(name.join("/"))}`;
}

// -- building the page ---------------------------------------------------------------------------

function h(tag, attrs = {}, ...children) {
  const el = tag.startsWith("svg:")
    ? document.createElementNS(SVG, tag.slice(4)) : document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (value === undefined || value === null || value === false) continue;
    if (name.startsWith("on")) el.addEventListener(name.slice(2), value);
    else if (name === "dataset") Object.assign(el.dataset, value);
    // Through the CSSOM: the content security policy refuses style attributes.
    else if (name === "style" && typeof value === "object") {
      for (const [property, v] of Object.entries(value)) el.style.setProperty(property, v);
    }
    else el.setAttribute(name, value === true ? "" : String(value));
  }
  append(el, children);
  return el;
}

function append(el, children) {
  for (const child of children.flat(Infinity)) {
    if (child === undefined || child === null || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return el;
}

const card = (...children) => h("section", { class: "card" }, ...children);
const stat = (label, value, attrs = {}) =>
  h("div", { class: "stat" }, h("div", { class: "label" }, label),
    h("div", { class: "value", ...attrs }, value));

// -- formatting ----------------------------------------------------------------------------------

// A number to read: 5 significant digits (3 for an axis tick), exponents only where needed.
function num(value, short = false) {
  if (value === null || value === undefined) return "—";
  if (typeof value !== "number") return String(value);
  if (Number.isInteger(value) && Math.abs(value) < 1e7) return value.toLocaleString("en-US");
  const size = Math.abs(value);
  if (size !== 0 && (size >= 1e6 || size < 1e-3)) return value.toExponential(short ? 2 : 3);
  return String(Number(value.toPrecision(short ? 3 : 5)));
}

function bytes(value) {
  if (value === null || value === undefined) return "—";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (value >= 1024 && i < units.length - 1) { value /= 1024; i += 1; }
  return `${value.toFixed(i ? 1 : 0)} ${units[i]}`;
}

function ms(seconds) {
  if (seconds === null || seconds === undefined) return "—";
  return seconds < 1 ? `${(seconds * 1000).toFixed(1)} ms` : `${seconds.toFixed(2)} s`;
}

function ago(when) {
  if (!when) return "—";
  const seconds = (Date.now() - (typeof when === "number" ? when * 1000 : Date.parse(when))) / 1000;
  if (seconds < 60) return `${Math.max(0, Math.round(seconds))} s ago`;
  if (seconds < 3600) return `${Math.round(seconds / 60)} min ago`;
  if (seconds < 86400) return `${Math.round(seconds / 3600)} h ago`;
  return `${Math.round(seconds / 86400)} d ago`;
}

function statusChip(status) {
  return h("span", { class: `chip ${status}`, dataset: { test: "status" } }, status);
}

// -- charts --------------------------------------------------------------------------------------

// Round tick positions covering [low, high].
function ticks(low, high, count = 5) {
  if (low === high) { low -= 1; high += 1; }
  const raw = (high - low) / count;
  const magnitude = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 2.5, 5, 10].map((m) => m * magnitude).find((s) => s >= raw);
  const out = [];
  for (let t = Math.ceil(low / step) * step; t <= high + step * 1e-9; t += step) {
    out.push(Number(t.toPrecision(12)));
  }
  return out;
}

// series: [{name, points: [[x, y|null], ...], color?}]. A null y breaks the line there.
function lineChart(series, { width = 560, height = 220, xLabel = "step", yFormat = num,
  xFormat = num, yMin, yMax } = {}) {
  const pad = { left: 58, right: 14, top: 10, bottom: 30 };
  const finite = series.flatMap((s) => s.points).filter(([, y]) => Number.isFinite(y));
  const svg = h("svg:svg", { class: "chart", viewBox: `0 0 ${width} ${height}`,
    role: "img", "aria-label": series.map((s) => s.name).join(", ") });
  if (!finite.length) {
    svg.append(h("svg:text", { x: width / 2, y: height / 2, "text-anchor": "middle" },
      "no points yet"));
    return svg;
  }
  const xs = finite.map(([x]) => x);
  const ys = finite.map(([, y]) => y);
  let [x0, x1] = [Math.min(...xs), Math.max(...xs)];
  let [y0, y1] = [yMin ?? Math.min(...ys), yMax ?? Math.max(...ys)];
  if (x0 === x1) { x0 -= 1; x1 += 1; }
  if (y0 === y1) { const d = Math.abs(y0) * 0.05 || 1; y0 -= d; y1 += d; }
  const yTicks = ticks(y0, y1, 4);
  y0 = Math.min(y0, yTicks[0]);
  y1 = Math.max(y1, yTicks[yTicks.length - 1]);
  const X = (x) => pad.left + ((x - x0) / (x1 - x0)) * (width - pad.left - pad.right);
  const Y = (y) => height - pad.bottom - ((y - y0) / (y1 - y0)) * (height - pad.top - pad.bottom);
  const grid = h("svg:g", { class: "grid" });
  for (const t of yTicks) {
    grid.append(h("svg:line", { x1: pad.left, x2: width - pad.right, y1: Y(t), y2: Y(t) }),
      h("svg:text", { x: pad.left - 6, y: Y(t) + 4, "text-anchor": "end" }, yFormat(t, true)));
  }
  // Steps are whole numbers: no tick between two of them.
  const whole = xs.every(Number.isInteger);
  const xTicks = ticks(x0, x1, 6).filter((t) => t >= x0 && t <= x1 && (!whole || Number.isInteger(t)));
  for (const t of xTicks) {
    grid.append(h("svg:text", { x: X(t), y: height - pad.bottom + 16, "text-anchor": "middle" },
      xFormat(t)));
  }
  svg.append(grid,
    h("svg:line", { class: "axis", x1: pad.left, x2: pad.left, y1: pad.top, y2: height - pad.bottom }),
    h("svg:line", { class: "axis", x1: pad.left, x2: width - pad.right,
      y1: height - pad.bottom, y2: height - pad.bottom }),
    h("svg:text", { x: width - pad.right, y: height - 4, "text-anchor": "end" }, xLabel));
  series.forEach((s, i) => {
    const color = s.color || PALETTE[i % PALETTE.length];
    let run = [];
    const flush = () => {
      if (run.length > 1) {
        svg.append(h("svg:polyline", { stroke: color, points: run.join(" ") }));
      }
      run = [];
    };
    for (const [x, y] of s.points) {
      if (Number.isFinite(y)) run.push(`${X(x).toFixed(1)},${Y(y).toFixed(1)}`);
      else flush();
    }
    flush();
    const points = s.points.filter(([, y]) => Number.isFinite(y));
    // Every point answers a hover with its value; the last one is always drawn.
    for (const [index, [x, y]] of points.entries()) {
      const last = index === points.length - 1;
      if (!last && points.length > 120) continue;
      svg.append(h("svg:circle", { cx: X(x), cy: Y(y), r: last ? 3 : 2,
        fill: color, "fill-opacity": last ? 1 : 0.5 },
      h("svg:title", {}, `${s.name}\n${xLabel} ${xFormat(x)}: ${yFormat(y)}`)));
    }
  });
  return svg;
}

function legend(series) {
  return h("div", { class: "legend" }, series.map((s, i) =>
    h("span", { style: { "--swatch": s.color || PALETTE[i % PALETTE.length] } }, s.name)));
}

function sparkline(values, width = 110, height = 26) {
  const finite = values.filter(Number.isFinite);
  const svg = h("svg:svg", { class: "spark", width, height, viewBox: `0 0 ${width} ${height}` });
  if (finite.length < 2) return svg;
  const [low, high] = [Math.min(...finite), Math.max(...finite)];
  const points = values.map((v, i) => Number.isFinite(v)
    ? `${((i / (values.length - 1)) * (width - 4) + 2).toFixed(1)},`
      + `${(height - 2 - ((v - low) / (high - low || 1)) * (height - 4)).toFixed(1)}`
    : null).filter(Boolean);
  svg.append(h("svg:polyline", { points: points.join(" ") }));
  return svg;
}

// -- the frame: routing, live refresh, the key ---------------------------------------------------

const main = document.getElementById("main");
let generation = 0;

// Run refresh() now and every POLL_MS until the view changes, one at a time. Returns a function
// that refreshes at once (after an action), or as soon as the refresh under way ends.
function live(refresh) {
  const mine = generation;
  let timer = null;
  let running = false;
  let again = false;
  const tick = async () => {
    if (mine !== generation) return;
    if (running) { again = true; return; }
    clearTimeout(timer);
    running = true;
    try {
      await refresh();
      notice("");
      document.getElementById("live").textContent = `live · ${new Date().toLocaleTimeString()}`;
    } catch (error) {
      if (mine === generation) failed(error);
    } finally {
      running = false;
    }
    if (mine === generation) timer = setTimeout(tick, again ? 0 : POLL_MS);
    again = false;
  };
  tick();
  return tick;
}

function notice(text) {
  const box = document.getElementById("notice");
  box.textContent = text;
  box.hidden = !text;
}

function failed(error) {
  if (error instanceof ApiError && error.status === 401) askForKey(error.message);
  else notice(error.message || String(error));
}

function askForKey(why) {
  const dialog = document.getElementById("key-dialog");
  const reason = document.getElementById("key-why");
  reason.textContent = why || "";
  reason.hidden = !why;
  if (!dialog.open) dialog.showModal();
}

function setupKey() {
  const dialog = document.getElementById("key-dialog");
  document.getElementById("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    localStorage.setItem(KEY, document.getElementById("key-input").value.trim());
    document.getElementById("key-input").value = "";
    dialog.close();
    route();
  });
  document.getElementById("key-forget").addEventListener("click", () => {
    localStorage.removeItem(KEY);
    dialog.close();
    askForKey("");
  });
  document.getElementById("change-key").addEventListener("click", () => askForKey(""));
}

const ROUTES = [
  [/^#\/runs\/([^?]+)$/, runPage],
  [/^#\/sweeps\/([^?]+)(?:\?(.*))?$/, sweepPage],
  [/^#\/engines$/, enginesPage],
  [/^(?:#\/runs)?(?:\?(.*))?$/, runsPage],
];

function route() {
  generation += 1;
  notice("");
  const hash = location.hash || "#/runs";
  for (const link of document.querySelectorAll("[data-nav]")) {
    link.classList.toggle("active", hash.startsWith(`#/${link.dataset.nav}`)
      || (link.dataset.nav === "runs" && hash.startsWith("#/sweeps")));
  }
  main.replaceChildren();
  if (!localStorage.getItem(KEY)) { askForKey(""); return; }
  for (const [pattern, view] of ROUTES) {
    const match = hash.match(pattern);
    if (match) {
      view(...match.slice(1).map((part) => (part === undefined ? undefined : decodeURIComponent(part))));
      return;
    }
  }
  main.append(card(h("h2", {}, "No such page"), h("a", { href: "#/runs" }, "Back to the runs")));
}

// -- Runs ----------------------------------------------------------------------------------------

function runsPage(query) {
  const params = new URLSearchParams(query || "");
  const tag = h("input", { name: "tag", placeholder: "any tag", value: params.get("tag") || "" });
  const sweep = h("input", { name: "sweep", placeholder: "any sweep",
    value: params.get("sweep") || "" });
  const filter = h("form", { class: "row", onsubmit: (event) => {
    event.preventDefault();
    const next = new URLSearchParams();
    if (tag.value.trim()) next.set("tag", tag.value.trim());
    if (sweep.value.trim()) next.set("sweep", sweep.value.trim());
    location.hash = `#/runs${next.toString() ? `?${next}` : ""}`;
  } }, h("label", {}, "Tag", tag), h("label", {}, "Sweep", sweep),
  h("button", { type: "submit" }, "Filter"));
  const body = h("div", {}, h("p", { class: "muted" }, "Loading…"));
  main.append(card(h("div", { class: "row" }, h("h2", {}, "Training runs"),
    h("span", { class: "spacer" }), filter), body));

  return live(async () => {
    const search = new URLSearchParams({ limit: "100" });
    if (params.get("tag")) search.set("tag", params.get("tag"));
    if (params.get("sweep")) search.set("sweep", params.get("sweep"));
    const answer = await api(`/console/runs?${search}`);
    if (!answer.runs.length) {
      body.replaceChildren(h("p", { class: "muted" },
        "No runs yet. Point the SDK here (TINKER_BASE_URL) and create a training client."));
      return;
    }
    body.replaceChildren(h("table", { dataset: { test: "runs" } },
      h("thead", {}, h("tr", {}, ["Run", "Base model", "Rank", "Loss", "Steps", "Last loss",
        "LR", "Status", "Sweep", "Loss by step", "Last request"].map((name) =>
        h("th", { class: ["Rank", "Steps", "Last loss", "LR"].includes(name) ? "num" : "" },
          name)))),
      h("tbody", {}, answer.runs.map((run) => h("tr", { dataset: { run: run.training_run_id } },
        h("td", {}, h("a", { href: `#/runs/${enc(run.training_run_id)}`, class: "mono" },
          run.training_run_id),
        run.tags.map((t) => h("span", { class: "chip" }, t))),
        h("td", {}, run.base_model),
        h("td", { class: "num" }, run.lora_rank),
        h("td", {}, run.loss_fn || "—"),
        h("td", { class: "num" }, run.steps),
        h("td", { class: "num", dataset: { test: "last-loss", value: run.last_loss ?? "" } },
          num(run.last_loss)),
        h("td", { class: "num" }, num(run.learning_rate)),
        h("td", {}, statusChip(run.status)),
        h("td", {}, run.sweep ? h("a", { href: `#/sweeps/${enc(run.sweep)}` }, run.sweep) : "—"),
        h("td", {}, sparkline(run.sparkline)),
        h("td", { class: "muted" }, ago(run.last_request_time)))))),
    answer.cursor.total_count > answer.runs.length
      ? h("p", { class: "muted" }, `The newest ${answer.runs.length} of ${answer.cursor.total_count}.`)
      : "");
  });
}

// -- Run -----------------------------------------------------------------------------------------

const LOSS = "loss:sum";

function runPage(runId) {
  const header = card(h("p", { class: "muted" }, "Loading…"));
  const charts = card(h("h2", {}, "Metrics by step"));
  const chartGrid = h("div", { class: "grid" });
  charts.append(chartGrid);
  const timeline = card(h("h2", {}, "Request timeline"));
  const timelineBody = h("div", {});
  timeline.append(h("p", { class: "muted" }, "Newest first: each request's time",
    h("span", { class: "key", style: { background: "var(--queue)" } }), "in the queue,",
    h("span", { class: "key", style: { background: "var(--compute)" } }), "computing and",
    h("span", { class: "key", style: { background: "var(--store)" } }), "storing its result"),
  timelineBody);
  const checkpoints = card(h("h2", {}, "Checkpoints"));
  const checkpointBody = h("div", {});
  checkpoints.append(checkpointBody);
  const playground = playgroundCard();
  let sessionId = "";
  const trace = h("span", { class: "row" },
    h("button", { type: "button", dataset: { test: "trace" }, onclick: async (event) => {
      event.target.disabled = true;
      try {
        const answer = await api(`/sessions/${enc(sessionId)}/trace_export`);
        trace.replaceChildren(h("a", { href: answer.url, download: "trace.json",
          dataset: { test: "trace-link" } }, "Download the session's trace"),
        h("span", { class: "muted" }, "(Chrome trace format: open it in ui.perfetto.dev)"));
      } catch (error) { failed(error); event.target.disabled = false; }
    } }, "Export the session trace"));
  main.append(header, charts, checkpoints, playground.element, timeline);

  const refresh = live(async () => {
    const [metrics, requests, saved] = await Promise.all([
      api(`/training_runs/${enc(runId)}/metrics`),
      api(`/training_runs/${enc(runId)}/requests?limit=60`),
      api(`/training_runs/${enc(runId)}/checkpoints`),
    ]);
    sessionId = metrics.run.session_id;
    drawRunHeader(header, metrics.run, metrics, trace);
    drawCharts(chartGrid, metrics.metrics);
    drawTimeline(timelineBody, requests.requests);
    drawCheckpoints(checkpointBody, saved.checkpoints, () => refresh());
    playground.models(metrics.run.base_model, saved.checkpoints);
  });
}

function drawRunHeader(header, run, metrics, trace) {
  const loss = metrics.metrics[LOSS] || [];
  const last = loss.length ? loss[loss.length - 1][1] : null;
  header.replaceChildren(
    h("div", { class: "row" }, h("h1", { class: "mono" }, run.training_run_id),
      statusChip(run.status),
      run.sweep ? h("a", { href: `#/sweeps/${enc(run.sweep)}` }, `sweep ${run.sweep}`) : null,
      run.tags.map((t) => h("span", { class: "chip" }, t))),
    h("div", { class: "stats" },
      stat("Base model", run.base_model),
      stat("LoRA rank", run.lora_rank),
      stat("Loss", run.loss_fn || "—"),
      stat("Steps", metrics.steps, { dataset: { test: "steps" } }),
      stat(`Last ${LOSS}`, num(last), { dataset: { test: "last-loss", value: last ?? "" } }),
      stat("Created", ago(run.created_at)),
      stat("Last request", ago(run.last_request_time))),
    Object.keys(run.user_metadata).length
      ? h("p", { class: "muted" }, "user_metadata: ", h("code", {}, JSON.stringify(run.user_metadata)))
      : "",
    h("p", {}, trace));
}

// The loss first, then the loss's own metrics, then the rest; one small chart each.
function drawCharts(grid, metrics) {
  const names = Object.keys(metrics).sort((a, b) => rank(a) - rank(b) || a.localeCompare(b));
  grid.replaceChildren(...names.map((name) => h("div", { dataset: { metric: name } },
    h("div", { class: "chart-title" }, name, " ",
      h("span", { class: "muted" }, num(lastValue(metrics[name])))),
    lineChart([{ name, points: metrics[name] }], { height: 180 }))));
  if (!names.length) grid.append(h("p", { class: "muted" }, "No steps yet."));
}

function rank(name) {
  if (name === LOSS) return 0;
  if (name.startsWith("loss") || name.includes("reward") || name.startsWith("heldout")) return 1;
  if (name.includes(":")) return 2;
  return 1;
}

function lastValue(points) {
  return points && points.length ? points[points.length - 1][1] : null;
}

function drawTimeline(body, requests) {
  if (!requests.length) { body.replaceChildren(h("p", { class: "muted" }, "No requests yet.")); return; }
  const longest = Math.max(...requests.map((r) =>
    (r.queue_s || 0) + (r.compute_s || 0) + (r.store_s || 0)), 1e-6);
  const width = (seconds) => `${Math.max(0, (seconds || 0) / longest) * 100}%`;
  body.replaceChildren(h("table", { dataset: { test: "timeline" } },
    h("thead", {}, h("tr", {}, ["Request", "Step", "Status", "Queue", "Compute", "Store", ""]
      .map((n) => h("th", { class: ["Queue", "Compute", "Store", "Step"].includes(n) ? "num" : "" }, n)))),
    h("tbody", {}, requests.map((r) => h("tr", { dataset: { request: r.request_id } },
      h("td", { title: r.request_id }, h("span", { class: "mono" }, r.op),
        r.error ? h("div", { class: "error" }, r.error) : null),
      h("td", { class: "num" }, r.step ?? "—"),
      h("td", {}, r.status),
      h("td", { class: "num" }, ms(r.queue_s)),
      h("td", { class: "num" }, ms(r.compute_s)),
      h("td", { class: "num" }, ms(r.store_s)),
      h("td", { style: { width: "34%" } }, h("div", { class: "bar" },
        h("span", { class: "queue", style: { width: width(r.queue_s) } }),
        h("span", { class: "compute", style: { width: width(r.compute_s) } }),
        h("span", { class: "store", style: { width: width(r.store_s) } }))))))));
}

function drawCheckpoints(body, checkpoints, reload) {
  if (!checkpoints.length) {
    body.replaceChildren(h("p", { class: "muted" },
      "None yet: save_state or save_weights_for_sampler makes one."));
    return;
  }
  // A redraw must not wipe a TTL being typed: wait until the field loses focus.
  if (body.contains(document.activeElement) && document.activeElement.tagName === "INPUT") return;
  const act = (method, suffix, bodyOf) => async (event) => {
    const path = event.target.closest("tr").dataset.path;
    if (method === "DELETE" && !suffix && !confirm(`Delete ${path}? Its files go too.`)) return;
    event.target.disabled = true;
    try {
      await api(checkpointRoute(path) + suffix, { method, body: bodyOf && bodyOf(event) });
      reload();
    } catch (error) { failed(error); event.target.disabled = false; }
  };
  const ttlOf = (event) => {
    const value = event.target.closest("tr").querySelector("input[name=ttl]").value.trim();
    return { ttl_seconds: value === "" ? null : Number(value) };
  };
  body.replaceChildren(h("table", { dataset: { test: "checkpoints" } },
    h("thead", {}, h("tr", {}, ["Checkpoint", "Kind", "Size", "Saved", "Expires", "Public", "TTL (s)", ""]
      .map((n) => h("th", { class: n === "Size" ? "num" : "" }, n)))),
    h("tbody", {}, checkpoints.map((c) => h("tr", { dataset: { path: c.tinker_path } },
      h("td", { class: "mono", title: c.tinker_path }, c.checkpoint_id),
      h("td", {}, c.checkpoint_type),
      h("td", { class: "num" }, bytes(c.size_bytes)),
      h("td", {}, ago(c.time)),
      h("td", {}, c.expires_at ? new Date(c.expires_at).toLocaleString() : "never"),
      h("td", { dataset: { test: "public" } }, c.public ? "yes" : "no"),
      h("td", {}, h("input", { name: "ttl", type: "number", min: 0, placeholder: "none" }),
        " ", h("button", { type: "button", onclick: act("PUT", "/ttl", ttlOf) }, "Set")),
      h("td", { class: "row" },
        c.public
          ? h("button", { type: "button", dataset: { test: "unpublish" },
            onclick: act("DELETE", "/publish") }, "Unpublish")
          : h("button", { type: "button", dataset: { test: "publish" },
            onclick: act("POST", "/publish") }, "Publish"),
        h("button", { type: "button", class: "danger", onclick: act("DELETE", "") },
          "Delete")))))));
}

// The sampler playground: a prompt, sampled from one of the run's sampler checkpoints (or its
// base model) through POST /api/v1/sample_text, or, as chat, as the user's message through the
// model's chat template (POST /v1/chat/completions, the OpenAI-compatible route).
async function samplePlayground(chosen, prompt, samples, params, chat) {
  if (!chat) {
    const answer = await api("/sample_text", { method: "POST", body: {
      prompt,
      ...(chosen.startsWith("tinker://") ? { model_path: chosen } : { base_model: chosen }),
      num_samples: samples,
      sampling_params: params,
    } });
    return { model: answer.model_path || answer.base_model, promptTokens: answer.prompt_tokens,
      texts: answer.sequences.map((s) => ({ text: s.text, tokens: s.tokens.length,
        stop: s.stop_reason })) };
  }
  const answer = await api("/chat/completions", { method: "POST", root: "/v1", body: {
    model: chosen, messages: [{ role: "user", content: prompt }], n: samples, logprobs: true,
    ...params,
  } });
  // A choice's logprobs are its answer's tokens (the end of turn is cut, as a stop string).
  return { model: answer.model, promptTokens: answer.usage.prompt_tokens,
    texts: answer.choices.map((c) => ({ text: c.message.content,
      tokens: c.logprobs.content.length, stop: c.finish_reason })) };
}

function playgroundCard() {
  const model = h("select", { name: "model", dataset: { test: "model" } });
  const prompt = h("textarea", { name: "prompt", rows: 4, placeholder: "A prompt, as text",
    dataset: { test: "prompt" } });
  const maxTokens = h("input", { name: "max_tokens", type: "number", min: 1, value: 32 });
  const temperature = h("input", { name: "temperature", type: "number", min: 0, step: 0.1,
    value: 0.7 });
  const samples = h("input", { name: "num_samples", type: "number", min: 1, max: 16, value: 2 });
  const stop = h("input", { name: "stop", placeholder: "e.g. \\n or <|im_end|>", size: 18 });
  const chat = h("input", { name: "chat", type: "checkbox", dataset: { test: "chat" } });
  const out = h("div", { dataset: { test: "samples" } });
  const go = h("button", { type: "submit", class: "primary", dataset: { test: "sample" } }, "Sample");
  const form = h("form", { onsubmit: async (event) => {
    event.preventDefault();
    go.disabled = true;
    out.replaceChildren(h("p", { class: "muted" }, "Sampling…"));
    const chosen = model.value;
    const params = { max_tokens: Number(maxTokens.value), temperature: Number(temperature.value) };
    if (stop.value) params.stop = stop.value.split("|").map((s) => s.replace(/\\n/g, "\n"));
    try {
      const answer = await samplePlayground(chosen, prompt.value, Number(samples.value), params,
        chat.checked);
      out.replaceChildren(h("p", { class: "muted" },
        `${answer.texts.length} from ${answer.model}; prompt ${answer.promptTokens} tokens`
        + (chat.checked ? " (the chat template applied)" : "")),
      h("ol", { class: "samples" }, answer.texts.map((s) => h("li", {},
        chat.checked ? "" : h("span", { class: "prompt" }, prompt.value),
        h("span", { dataset: { test: "completion" } }, s.text),
        h("div", { class: "muted" }, `${s.tokens} tokens, stopped: ${s.stop}`)))));
    } catch (error) {
      out.replaceChildren(h("p", { class: "error", dataset: { test: "sample-error" } }, error.message));
    } finally {
      go.disabled = false;
    }
  } }, h("div", { class: "row" }, h("label", {}, "Weights", model),
    h("label", {}, "Max tokens", maxTokens), h("label", {}, "Temperature", temperature),
    h("label", {}, "Samples", samples), h("label", {}, "Stop at", stop),
    h("label", { title: "Send the prompt as the user's message, through the model's chat template" },
      chat, " Chat")),
  h("p", {}, prompt), h("div", { class: "row" }, go,
    h("span", { class: "muted" }, "Several stop strings: separate them with |; \\n is a newline.")));
  const element = card(h("h2", {}, "Sampler playground"), form, out);
  let offered = "";
  return {
    element,
    // Offer the run's sampler checkpoints, newest first, then its base model; keep the choice.
    models(baseModel, checkpoints) {
      const paths = checkpoints.filter((c) => c.checkpoint_type === "sampler")
        .sort((a, b) => Date.parse(b.time) - Date.parse(a.time)).map((c) => c.tinker_path);
      const key = [baseModel, ...paths].join("\n");
      if (key === offered) return;
      offered = key;
      const chosen = model.value;
      model.replaceChildren(...paths.map((p) => h("option", { value: p }, p.split("/").slice(-2).join("/"))),
        h("option", { value: baseModel }, `${baseModel} (base model)`));
      if ([...model.options].some((o) => o.value === chosen)) model.value = chosen;
    },
  };
}

// -- Sweep ---------------------------------------------------------------------------------------

function sweepPage(sweepId, query) {
  const params = new URLSearchParams(query || "");
  const metric = h("input", { name: "metric", value: params.get("metric") || LOSS,
    list: "metric-names", size: 22 });
  const names = h("datalist", { id: "metric-names" });
  const goal = h("select", { name: "goal" },
    ["auto", "min", "max"].map((g) => h("option", { value: g === "auto" ? "" : g,
      selected: (params.get("goal") || "") === (g === "auto" ? "" : g) }, g)));
  const improvements = h("input", { type: "checkbox", name: "improvements",
    checked: params.get("improvements") === "1", dataset: { test: "improvements" } });
  const apply = () => {
    const next = new URLSearchParams();
    if (metric.value.trim() && metric.value.trim() !== LOSS) next.set("metric", metric.value.trim());
    if (goal.value) next.set("goal", goal.value);
    if (improvements.checked) next.set("improvements", "1");
    location.hash = `#/sweeps/${enc(sweepId)}${next.toString() ? `?${next}` : ""}`;
  };
  const controls = h("form", { class: "row", onsubmit: (e) => { e.preventDefault(); apply(); } },
    h("label", {}, "Metric", metric, names), h("label", {}, "Goal", goal),
    h("label", {}, improvements, " improvements only"), h("button", { type: "submit" }, "Show"));
  improvements.addEventListener("change", apply);
  goal.addEventListener("change", apply);
  const title = h("div", {});
  const chart = h("div", {});
  const table = h("div", {});
  main.append(card(h("div", { class: "row" }, h("h2", {}, `Sweep ${sweepId}`),
    h("span", { class: "spacer" }), controls), title, chart), card(table));

  let namesFor = "";
  return live(async () => {
    const search = new URLSearchParams();
    if (params.get("metric")) search.set("metric", params.get("metric"));
    if (params.get("goal")) search.set("goal", params.get("goal"));
    const sweep = await api(`/sweeps/${enc(sweepId)}?${search}`);
    if (sweep.runs.length && namesFor !== sweep.runs[0].training_run_id) {
      namesFor = sweep.runs[0].training_run_id;
      const first = await api(`/training_runs/${enc(namesFor)}/metrics`);
      names.replaceChildren(...Object.keys(first.metrics).sort().map((n) => h("option", { value: n })));
    }
    const shown = improvements.checked ? improving(sweep.runs, sweep.goal) : sweep.runs;
    const series = shown.map((run) => ({ name: label(run, sweep.differs), points: run.series,
      color: PALETTE[sweep.runs.indexOf(run) % PALETTE.length] }));
    title.replaceChildren(h("p", { class: "muted" },
      `${sweep.runs.length} runs; ${sweep.metric} (${sweep.goal === "min" ? "lower" : "higher"} is better)`,
      improvements.checked ? `; ${shown.length} improved on every run launched before them` : "",
      sweep.best ? h("span", {}, "; best so far: ", h("strong", { dataset: { test: "best" } },
        num(sweep.best.value)), " by ", h("a", { href: `#/runs/${enc(sweep.best.training_run_id)}`,
        class: "mono" }, sweep.best.training_run_id), ` at step ${sweep.best.step}`) : ""));
    chart.replaceChildren(lineChart(series, { height: 280, width: 900 }), legend(series));
    const keys = sweep.differs;
    table.replaceChildren(h("h2", {}, "What differs"), h("table", { dataset: { test: "sweep" } },
      h("thead", {}, h("tr", {}, h("th", {}, "Run"), keys.map((k) => h("th", {}, k)),
        ["Steps", "Status", `Best ${sweep.metric}`, "At step", "Latest"].map((n) =>
          h("th", { class: n === "Status" ? "" : "num" }, n)))),
      h("tbody", {}, shown.map((run) => h("tr", {
        class: sweep.best && sweep.best.training_run_id === run.training_run_id ? "best" : "",
        dataset: { run: run.training_run_id } },
      h("td", {}, h("span", { class: "key",
        style: { background: PALETTE[sweep.runs.indexOf(run) % PALETTE.length], margin: "0 6px 0 0" } }),
      h("a", { href: `#/runs/${enc(run.training_run_id)}`, class: "mono" }, run.training_run_id)),
      keys.map((k) => h("td", {}, configValue(run.config[k]))),
      h("td", { class: "num" }, run.steps), h("td", {}, statusChip(run.status)),
      h("td", { class: "num", dataset: { test: "run-best" } }, num(run.best && run.best.value)),
      h("td", { class: "num" }, run.best ? run.best.step : "—"),
      h("td", { class: "num" }, num(lastValue(run.series))))))));
  });
}

// The runs (in launch order) whose best beat the best of every run launched before them.
function improving(runs, goal) {
  const better = (a, b) => (goal === "min" ? a < b : a > b);
  let record = null;
  return runs.filter((run) => {
    if (!run.best) return false;
    if (record === null || better(run.best.value, record)) { record = run.best.value; return true; }
    return false;
  });
}

function label(run, keys) {
  const parts = keys.map((k) => `${k}=${configValue(run.config[k])}`);
  return parts.length ? parts.join(" ") : run.training_run_id;
}

function configValue(value) {
  return typeof value === "number" ? num(value) : value === null || value === undefined ? "—" : String(value);
}

// -- Engines -------------------------------------------------------------------------------------

function enginesPage() {
  const charts = card(h("h2", {}, "Busy share (the duty cycle)"));
  const chartBody = h("div", { class: "grid" });
  charts.append(h("p", { class: "muted" },
    "The share of each 2 s that each replica's compute thread was busy, over the last minutes."),
  chartBody);
  const replicas = card(h("h2", {}, "Replicas"));
  const replicaBody = h("div", {});
  replicas.append(replicaBody);
  const tenants = card(h("h2", {}, "Usage per tenant"));
  const tenantBody = h("div", {});
  tenants.append(tenantBody);
  main.append(charts, replicas, tenants);

  return live(async () => {
    let answer;
    try {
      answer = await api("/engines");
    } catch (error) {
      if (error.status !== 403) throw error;
      main.replaceChildren(card(h("h2", {}, "Engines"),
        h("p", { class: "error", dataset: { test: "forbidden" } }, error.message)));
      generation += 1;  // nothing to refresh for this key
      return;
    }
    const now = Date.now() / 1000;
    // The engines first: theirs is the duty cycle that matters.
    const order = (service) => ["trainer", "sampler"].indexOf(service) >>> 0;
    const services = [...new Set(answer.engines.map((e) => e.service))]
      .sort((a, b) => order(a) - order(b) || a.localeCompare(b));
    chartBody.replaceChildren(...services.map((service) => {
      const series = answer.engines.filter((e) => e.service === service).map((e) => ({
        name: e.replica, points: e.busy.map(([t, share]) => [t - now, share * 100]) }));
      return h("div", { dataset: { service } }, h("div", { class: "chart-title" }, service),
        lineChart(series, { height: 170, xLabel: "seconds ago", yMin: 0, yMax: 100,
          yFormat: (v) => `${num(v, true)}%`, xFormat: (v) => num(Math.round(v)) }), legend(series));
    }));
    replicaBody.replaceChildren(h("table", { dataset: { test: "replicas" } },
      h("thead", {}, h("tr", {}, ["Service", "Replica", "Busy now", "Queue", "Base models",
        "Adapters", "Memory", "GPU memory", "Seen"].map((n) => h("th", {}, n)))),
      h("tbody", {}, answer.engines.map((e) => {
        const g = e.gauges;
        const busy = e.busy.length ? e.busy[e.busy.length - 1][1] : null;
        return h("tr", { dataset: { replica: e.replica } },
          h("td", {}, e.service), h("td", { class: "mono" }, e.replica),
          h("td", { class: "num", dataset: { test: "busy" } }, busy === null ? "—" : `${Math.round(busy * 100)}%`),
          h("td", {}, labelled(g["tinsmith.queue.depth"], num)),
          h("td", { class: "num" }, num(g["tinsmith.base_models.loaded"])),
          h("td", {}, labelled(g["tinsmith.adapters.loaded"], num)),
          h("td", { class: "num" }, bytes(g["process.memory.usage"])),
          h("td", {}, labelled(g["tinsmith.gpu.memory"], bytes)),
          h("td", { class: "muted" }, ago(e.seen_at)));
      }))));
    const rows = Object.entries(answer.tenants);
    tenantBody.replaceChildren(rows.length ? h("table", { dataset: { test: "tenants" } },
      h("thead", {}, h("tr", {}, ["Tenant", "Sessions", "Runs", "In flight", "Queued samples",
        "Checkpoints"].map((n) => h("th", { class: n === "Tenant" ? "" : "num" }, n)))),
      h("tbody", {}, rows.map(([name, u]) => h("tr", { dataset: { tenant: name } },
        h("td", {}, name), h("td", { class: "num" }, u.sessions), h("td", { class: "num" }, u.runs),
        h("td", { class: "num" }, u.inflight), h("td", { class: "num" }, u.queued_samples),
        h("td", { class: "num" }, bytes(u.checkpoint_bytes))))))
      : h("p", { class: "muted" }, "No tenant holds anything."));
  });
}

// A gauge with labels ({"label=value,...": number}) as "value: number" lines; a plain one as is.
function labelled(gauge, format) {
  if (gauge === undefined || gauge === null) return "—";
  if (typeof gauge === "number") return format(gauge);
  const entries = Object.entries(gauge);
  if (!entries.length) return "—";
  return entries.map(([labels, value]) => h("div", {}, h("span", { class: "muted" },
    labels.split(",").map((l) => l.split("=").slice(1).join("=")).join(" "), ": "), format(value)));
}

setupKey();
window.addEventListener("hashchange", route);
route();
