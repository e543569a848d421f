// The tokenway dashboard: fetch GET /dashboard/api/snapshot every 2 s and redraw every panel.
//
//   snapshot ── traces (newest first) ──► recent table, selected request's waterfall + details
//            ── summary ────────────────► KPIs, "where the time went"
//            ── timeseries (1 per s) ───► throughput, KV usage, prefix-cache hit rate charts
//            ── engine ─────────────────► KPIs, current hit rate; null on a server without a local
//                                          engine (a gateway): its panels are greyed out
//            ── replicas ───────────────► the Replicas table (pool -> replica -> health, load, tallies)
//            ── batches ────────────────► the Batches panel: the running batches' progress, the queue's
//                                          depth, this server's lines (null: no batch runner)
//
// Request ids, models and errors come from callers: all text goes in through textContent
// (el() below, or append(string)), never innerHTML.
"use strict";

const API_URL = "/dashboard/api/snapshot?limit=50";
const REFRESH_MS = 2000;
const KEY_STORAGE = "tokenway.adminKey";
const WINDOW_S = 300; // the charts' x axis: the last five minutes, as timeseries holds
const SVG_NS = "http://www.w3.org/2000/svg";
const STAGE_COLORS = {
  auth: "#818cf8", validation: "#a78bfa", routing: "#c084fc", safety: "#f87171", tokenize: "#e879f9",
  guard: "#fb923c",
  limits: "#f472b6",
  queue: "#fbbf24", prefill: "#38bdf8", decode: "#34d399", postprocess: "#a3e635", billing: "#94a3b8",
};

const state = {
  snapshot: null,
  selectedId: null,
  pinned: false, // false: the newest request is selected on every refresh
  paused: false,
  timer: null,
};

// ---- DOM helpers ----------------------------------------------------------------------------

function el(tag, props = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(props)) {
    if (value === null || value === undefined) continue;
    if (name === "class") node.className = value;
    else if (name === "text") node.textContent = value;
    else if (name === "style") Object.assign(node.style, value);
    else if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else node.setAttribute(name, value);
  }
  node.append(...children.filter((child) => child !== null && child !== undefined));
  return node;
}

function svg(tag, attrs = {}) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, value);
  return node;
}

const $ = (id) => document.getElementById(id);

// ---- formatting -----------------------------------------------------------------------------

function fmtMs(ms) {
  if (ms === null || ms === undefined) return "—";
  if (ms === 0) return "0";
  if (ms < 1) return ms.toFixed(2);
  if (ms < 100) return ms.toFixed(1);
  return Math.round(ms).toLocaleString("en-US");
}

function msText(ms) {
  return ms === null || ms === undefined ? "—" : `${fmtMs(ms)} ms`;
}

function fmtPct(share) {
  if (share === null || share === undefined) return "—";
  if (share > 0 && share < 0.001) return "<0.1%";
  return (share * 100).toFixed(1) + "%";
}

function fmtRate(value) {
  if (value === null || value === undefined) return "—";
  return value < 10 ? value.toFixed(2) : value.toFixed(1);
}

function fmtCost(usd) {
  if (usd === null || usd === undefined) return "—";
  return usd === 0 ? "$0" : "$" + usd.toFixed(usd < 0.01 ? 6 : 4);
}

function clock(unixSeconds, withMs = true) {
  const date = new Date(unixSeconds * 1000);
  const hms = date.toLocaleTimeString("en-GB", { hour12: false });
  return withMs ? `${hms}.${String(date.getMilliseconds()).padStart(3, "0")}` : hms;
}

function dateTime(unixSeconds) {
  return new Date(unixSeconds * 1000).toLocaleDateString("en-CA") + " " + clock(unixSeconds, false);
}

function niceStep(rough) {
  const power = 10 ** Math.floor(Math.log10(rough));
  const step = [1, 2, 2.5, 5, 10].find((m) => m * power >= rough);
  return step * power;
}

function niceCeil(value) {
  // The chart's top gridline: a nice number >= value whose half is nice too.
  return value > 0 ? niceStep(value / 2) * 2 : 1;
}

// ---- the admin key --------------------------------------------------------------------------

function takeKeyFromHash() {
  // #key=<value> (possibly among other #a=b&... parts): keep it for this tab, drop it from the URL.
  const parts = location.hash.replace(/^#/, "").split("&").filter(Boolean);
  const keyPart = parts.find((part) => part.startsWith("key="));
  if (!keyPart) return;
  let key = keyPart.slice(4);
  try { key = decodeURIComponent(key); } catch (_) { /* not percent-encoded: take it as it is */ }
  if (key) sessionStorage.setItem(KEY_STORAGE, key);
  const rest = parts.filter((part) => part !== keyPart).join("&");
  history.replaceState(null, "", location.pathname + location.search + (rest ? "#" + rest : ""));
}

function showKeyForm(message) {
  $("auth").hidden = false;
  $("auth-message").textContent = message || "";
  if (document.activeElement !== $("auth-key")) $("auth-key").focus();
}

function onKeySubmit(event) {
  event.preventDefault();
  const key = $("auth-key").value.trim();
  if (!key) return;
  sessionStorage.setItem(KEY_STORAGE, key);
  $("auth-key").value = "";
  $("auth").hidden = true;
  refresh();
}

// ---- polling --------------------------------------------------------------------------------

async function errorMessage(response) {
  const text = await response.text();
  try {
    return JSON.parse(text).error.message;
  } catch (_) {
    return text.slice(0, 300) || `HTTP ${response.status}`;
  }
}

function setStatus(kind, text) {
  $("status").className = `status ${kind}`;
  $("status").querySelector(".status-text").textContent = text;
  $("forget-key").hidden = !sessionStorage.getItem(KEY_STORAGE);
}

async function refresh() {
  clearTimeout(state.timer);
  const key = sessionStorage.getItem(KEY_STORAGE);
  const headers = key ? { Authorization: `Bearer ${key}` } : {};
  try {
    const response = await fetch(API_URL, { headers, cache: "no-store" });
    if (response.status === 401 || response.status === 403) {
      // Polling stops here and resumes when a key is submitted: a wrong key is not retried.
      showKeyForm(await errorMessage(response));
      setStatus("error", `${response.status}: admin key required`);
      return;
    }
    if (!response.ok) throw new Error(await errorMessage(response));
    state.snapshot = await response.json();
    $("auth").hidden = true;
    render();
    setStatus(state.paused ? "paused" : "live", `${state.paused ? "paused" : "live"} · updated ${clock(Date.now() / 1000, false)}`);
  } catch (error) {
    setStatus("error", `offline: ${error.message}`);
  }
  if (!state.paused) state.timer = setTimeout(refresh, REFRESH_MS);
}

// ---- rendering ------------------------------------------------------------------------------

function stagesOf(snapshot) {
  return snapshot.stages || Object.keys(STAGE_COLORS);
}

function stageColor(stage) {
  return STAGE_COLORS[stage] || "#64748b";
}

function render() {
  const snapshot = state.snapshot;
  if (!snapshot) return;
  const traces = snapshot.traces || [];
  if (!state.pinned || !traces.some((trace) => trace.request_id === state.selectedId)) {
    state.selectedId = traces.length ? traces[0].request_id : null;
    state.pinned = false;
  }
  const selected = traces.find((trace) => trace.request_id === state.selectedId) || null;
  const engine = snapshot.engine ?? null;
  const replicas = replicaRows(snapshot.replicas);
  renderKpis(snapshot, engine, replicas);
  renderEngineState(engine);
  renderCharts(snapshot.timeseries || [], engine);
  renderReplicas(replicas);
  renderBatches(snapshot.batches ?? null);
  renderWaterfall(selected, stagesOf(snapshot));
  renderDetails(selected);
  renderRecent(traces, stagesOf(snapshot));
  renderWhere(snapshot.summary, stagesOf(snapshot));
  $("selection-mode").textContent = selected ? (state.pinned ? "pinned" : "following the newest") : "";
  $("follow-newest").hidden = !state.pinned;
}

function select(requestId) {
  state.selectedId = requestId;
  state.pinned = true;
  render();
}

function renderKpis(snapshot, engine, replicas) {
  const summary = snapshot.summary || {};
  const series = snapshot.timeseries || [];
  const last = series.length ? series[series.length - 1] : {};
  const total = summary.total || {};
  const cards = [
    ["Requests", String(summary.num_requests ?? 0), `${summary.num_completed ?? 0} completed`],
    ["Latency p50", msText(total.p50_ms), `p99 ${msText(total.p99_ms)}`],
    ["TTFT p50", msText(summary.ttft_p50_ms), `TPOT p50 ${msText(summary.tpot_p50_ms)}`],
    ["Tokens / s", fmtRate(last.tokens_per_s), `${fmtRate(last.requests_per_s)} requests / s`],
    ["Replicas up", `${replicas.filter((r) => r.available).length} / ${replicas.length}`,
      `${replicas.reduce((sum, r) => sum + (r.num_in_flight || 0), 0)} calls in flight`],
    engine ? ["Running", String(engine.num_running), `${engine.num_waiting} waiting`]
      : ["Running", "—", "no local engine", "off"],
    engine ? ["KV blocks free", engine.kv_blocks_free.toLocaleString("en-US"),
      `of ${engine.kv_blocks_total.toLocaleString("en-US")} · ${engine.num_preemptions} preempted`]
      : ["KV blocks free", "—", "no local engine", "off"],
  ];
  $("kpis").replaceChildren(...cards.map(([label, value, sub, off]) => el("div", { class: off ? "kpi off" : "kpi" },
    el("div", { class: "kpi-label", text: label }),
    el("div", { class: "kpi-value", text: value }),
    el("div", { class: "kpi-sub", title: sub, text: sub }))));
}

// The waterfall: one row per stage on the request's own timeline. A bar starts where the
// previous stages ended (their sum) and is as wide as its own ms.
function renderWaterfall(trace, stages) {
  const box = $("waterfall");
  if (!trace) {
    box.removeAttribute("data-request-id");
    box.replaceChildren(el("p", { class: "empty", text: "No requests yet: send one to /v1/chat/completions." }));
    return;
  }
  box.dataset.requestId = trace.request_id;
  const stagesMs = trace.stages_ms || {};
  const summed = stages.reduce((sum, stage) => sum + (stagesMs[stage] || 0), 0);
  const total = trace.total_ms > 0 ? trace.total_ms : summed;
  const at = (ms) => (total > 0 ? Math.min(100, (100 * ms) / total) : 0);
  const step = total > 0 ? niceStep(total / 6) : 1;
  const ticks = [];
  for (let t = 0; t <= total + 1e-9; t += step) ticks.push(t);

  const axis = el("div", { class: "wf-axis" });
  const decimals = (String(+step.toPrecision(6)).split(".")[1] || "").length; // 0.25 -> 2, 100 -> 0
  for (const t of ticks) axis.append(el("span", { class: "wf-tick", style: { left: `${at(t)}%` }, text: t.toFixed(decimals) }));
  const grid = el("div", { class: "wf-grid" });
  for (const t of ticks) grid.append(el("span", { class: "wf-gridline", style: { left: `${at(t)}%` } }));
  if (trace.ttft_ms !== null && trace.ttft_ms !== undefined && trace.ttft_ms <= total) {
    grid.append(el("span", { class: "wf-marker", style: { left: `${at(trace.ttft_ms)}%` } },
      el("span", { class: "wf-marker-label", text: `TTFT ${fmtMs(trace.ttft_ms)} ms` })));
  }

  const rows = [el("div", { class: "wf-row wf-head" },
    el("span", { class: "wf-stage", text: "stage" }), axis,
    el("span", { class: "wf-ms", text: "ms" }), el("span", { class: "wf-share", text: "share" }))];
  let offset = 0;
  for (const stage of stages) {
    const ms = stagesMs[stage] || 0;
    const share = total > 0 ? ms / total : 0;
    const bar = el("span", {
      class: "wf-bar" + (ms > 0 ? "" : " zero"),
      title: `${stage}: ${fmtMs(ms)} ms (${fmtPct(share)}), from ${fmtMs(offset)} to ${fmtMs(offset + ms)} ms`,
      style: { left: `${at(offset)}%`, width: `${at(ms)}%`, background: stageColor(stage) },
    });
    rows.push(el("div", { class: "wf-row", "data-stage": stage },
      el("span", { class: "wf-stage" }, el("i", { class: "swatch", style: { background: stageColor(stage) } }), stage),
      el("span", { class: "wf-track" }, bar),
      el("span", { class: "wf-ms", text: fmtMs(ms) }),
      el("span", { class: "wf-share", text: fmtPct(share) })));
    offset += ms;
  }
  rows.push(el("div", { class: "wf-row wf-total" },
    el("span", { class: "wf-stage", text: "total" }), el("span", { class: "wf-track" }),
    el("span", { class: "wf-ms", text: fmtMs(total) }), el("span", { class: "wf-share", text: "100%" })));
  box.replaceChildren(el("div", { class: "wf-body" }, grid, ...rows));
}

function renderDetails(trace) {
  const box = $("request-details");
  if (!trace) {
    box.replaceChildren(el("p", { class: "empty", text: "Nothing selected." }));
    return;
  }
  const sampling = Object.entries(trace.sampling || {}).map(([k, v]) => `${k}=${v}`).join(" ");
  const items = [
    ["Request id", el("code", { text: trace.request_id })],
    ["Endpoint", trace.endpoint],
    ["Model", trace.model],
    ["Replica", routeText(trace.route)],
    ["Key", trace.key_id],
    ["Status", statusPill(trace.status)],
    ["Started", new Date(trace.started_at * 1000).toLocaleDateString("en-CA") + " " + clock(trace.started_at)],
    ["Mode", `${trace.stream ? "stream" : "non-stream"} · n=${trace.num_choices}`],
    ["Tokens", `${trace.prompt_tokens} prompt (${trace.cached_tokens} cached) · ${trace.completion_tokens} completion`],
    ["TTFT / TPOT", `${msText(trace.ttft_ms)} / ${msText(trace.tpot_ms)}`],
    ["Total", msText(trace.total_ms)],
    ["Finish", trace.finish_reason || "—"],
    ["Cost", fmtCost(trace.cost_usd)],
    ["Sampling", sampling || "—"],
  ];
  if (trace.batch_line) items.push(["Batch line", el("code", { text: trace.batch_line })]);
  if (trace.limit_kind) items.push(["Limited by", trace.limit_kind]);
  if (trace.traceparent) items.push(["traceparent", el("code", { text: trace.traceparent })]);
  const list = el("dl", { class: "kv" });
  for (const [label, value] of items) list.append(el("dt", { text: label }), el("dd", {}, value));
  const notes = [];
  if (trace.cache_explanation) {
    notes.push(el("div", { class: "callout cache" },
      el("strong", { text: `Prefix cache${trace.cache_reason ? ` (${trace.cache_reason})` : ""}: ` }),
      trace.cache_explanation));
  }
  if (trace.error) notes.push(el("div", { class: "callout error" }, el("strong", { text: "Error: " }), trace.error));
  box.replaceChildren(list, ...notes);
}

function routeText(route) {
  if (!route) return "—";
  if (!route.replica) return `none of ${route.pool} (${route.failed_attempts} failed)`;
  const failed = route.failed_attempts ? ` · after ${route.failed_attempts} failed` : "";
  return `${route.pool} / ${route.replica} (${route.reason}${failed})`;
}

function statusPill(status) {
  const kind = status >= 500 ? "bad" : status >= 400 ? "warn" : "ok";
  return el("span", { class: `pill ${kind}`, text: String(status) });
}

function stageMix(trace, stages) {
  const total = trace.total_ms || 0;
  const mix = el("span", { class: "mix", title: "stages on this request's timeline" });
  if (total <= 0) return mix;
  for (const stage of stages) {
    const ms = (trace.stages_ms || {})[stage] || 0;
    if (ms > 0) mix.append(el("i", { style: { width: `${(100 * ms) / total}%`, background: stageColor(stage) } }));
  }
  return mix;
}

function renderRecent(traces, stages) {
  const body = $("recent").tBodies[0];
  $("recent-count").textContent = `${traces.length} newest · click a row to see its waterfall`;
  if (!traces.length) {
    body.replaceChildren(el("tr", {}, el("td", { colspan: "13", class: "empty", text: "No requests yet." })));
    return;
  }
  body.replaceChildren(...traces.map((trace) => {
    const selected = trace.request_id === state.selectedId;
    return el("tr", {
      "data-request-id": trace.request_id,
      class: selected ? "selected" : null,
      "aria-selected": String(selected),
      tabindex: "0",
      onclick: () => select(trace.request_id),
      onkeydown: (event) => { if (event.key === "Enter" || event.key === " ") { event.preventDefault(); select(trace.request_id); } },
    },
    el("td", { class: "mono", text: clock(trace.started_at) }),
    el("td", { class: "mono id", title: trace.request_id, text: trace.request_id }),
    el("td", { text: trace.endpoint }),
    el("td", { class: "model", title: trace.model, text: trace.model }),
    el("td", { class: "replica", title: routeText(trace.route), text: trace.route ? trace.route.replica || "—" : "—" }),
    el("td", {}, statusPill(trace.status)),
    el("td", { class: "num", text: String(trace.prompt_tokens) }),
    el("td", { class: "num", text: String(trace.cached_tokens) }),
    el("td", { class: "num", text: String(trace.completion_tokens) }),
    el("td", { class: "num", text: fmtMs(trace.ttft_ms) }),
    el("td", { class: "num", text: fmtMs(trace.total_ms) }),
    el("td", {}, stageMix(trace, stages)),
    el("td", { class: trace.error ? "finish error-text" : "finish", title: trace.error || null,
      text: trace.finish_reason || (trace.error ? "error" : "—") }));
  }));
}

function renderWhere(summary, stages) {
  const box = $("where-time-went");
  if (!summary || !summary.num_completed) {
    $("where-caption").textContent = "";
    box.replaceChildren(el("p", { class: "empty", text: "No completed requests yet." }));
    return;
  }
  $("where-caption").textContent = `over the last ${summary.num_requests} requests (${summary.num_completed} ` +
    "completed) · share of their summed end-to-end time";
  const rowsByStage = summary.stages || {};
  const stacked = el("div", { class: "stacked" });
  const legend = el("div", { class: "legend" });
  for (const stage of stages) {
    const share = (rowsByStage[stage] || {}).share || 0;
    if (share > 0) {
      stacked.append(el("span", { class: "stacked-seg", title: `${stage}: ${fmtPct(share)}`,
        style: { width: `${100 * share}%`, background: stageColor(stage) } }));
    }
    legend.append(el("span", { class: "legend-item" }, el("i", { class: "swatch", style: { background: stageColor(stage) } }),
      `${stage} ${fmtPct(share)}`));
  }
  const table = el("table", { class: "where-table" }, el("thead", {}, el("tr", {},
    ...["Stage", "Share", "", "Mean ms", "p50 ms", "p99 ms"].map((h, i) => el("th", { class: i > 1 ? "num" : null, text: h })))));
  const body = el("tbody");
  for (const stage of stages) {
    const row = rowsByStage[stage] || {};
    body.append(el("tr", { "data-stage": stage },
      el("td", {}, el("i", { class: "swatch", style: { background: stageColor(stage) } }), stage),
      el("td", { class: "share-cell" }, el("span", { class: "share-track" },
        el("span", { class: "share-bar", style: { width: `${100 * (row.share || 0)}%`, background: stageColor(stage) } }))),
      el("td", { class: "num", text: fmtPct(row.share) }),
      el("td", { class: "num", text: fmtMs(row.mean_ms) }),
      el("td", { class: "num", text: fmtMs(row.p50_ms) }),
      el("td", { class: "num", text: fmtMs(row.p99_ms) })));
  }
  const total = summary.total || {};
  body.append(el("tr", { class: "total" }, el("td", { text: "total" }), el("td"), el("td", { class: "num", text: "100%" }),
    el("td", { class: "num", text: fmtMs(total.mean_ms) }), el("td", { class: "num", text: fmtMs(total.p50_ms) }),
    el("td", { class: "num", text: fmtMs(total.p99_ms) })));
  table.append(body);
  const figures = [["mean", total.mean_ms], ["p50", total.p50_ms], ["p99", total.p99_ms],
    ["TTFT p50", summary.ttft_p50_ms], ["TPOT p50", summary.tpot_p50_ms]];
  const stats = el("dl", { class: "where-stats" });
  for (const [label, ms] of figures) stats.append(el("div", {}, el("dt", { text: label }), el("dd", { text: msText(ms) })));
  box.replaceChildren(el("div", { class: "where-overview" }, stacked, legend, stats), table);
}

// ---- replicas -------------------------------------------------------------------------------

function replicaRows(poolToReplicas) {
  // pool -> replica -> stats (as /engine/stats has them) as rows, in the router's order.
  return Object.entries(poolToReplicas || {}).flatMap(([pool, nameToReplica]) =>
    Object.entries(nameToReplica).map(([name, replica]) => ({ ...replica, pool, name })));
}

function renderReplicas(rows) {
  const body = $("replicas").tBodies[0];
  const numUp = rows.filter((r) => r.available).length;
  $("replicas-caption").textContent = rows.length ? `${numUp} of ${rows.length} up · calls, failures and hit rate since start` : "";
  if (!rows.length) {
    body.replaceChildren(el("tr", {}, el("td", { colspan: "9", class: "empty", text: "No replicas." })));
    return;
  }
  const count = (n) => (n ?? 0).toLocaleString("en-US");
  body.replaceChildren(...rows.map((r) => {
    const failureShare = r.num_failures && r.num_calls
      ? el("span", { class: "sub", text: `(${fmtPct(r.num_failures / r.num_calls)})` }) : null;
    return el("tr", { "data-pool": r.pool, "data-replica": r.name, "data-health": r.available ? "up" : "down",
      class: r.available ? null : "down" },
    el("td", { text: r.pool }),
    el("td", { class: "mono", text: r.name }),
    el("td", { text: r.kind }),
    el("td", { class: "health" }, el("span", { class: `pill ${r.available ? "ok" : "bad"}`,
      text: r.available ? "up" : r.unavailable_reason || "down" })),
    el("td", { class: "num", text: count(r.num_in_flight) }),
    el("td", { class: "num", text: count(r.num_outstanding_tokens) }),
    el("td", { class: "num", text: count(r.num_calls) }),
    el("td", { class: "num" }, count(r.num_failures), failureShare),
    el("td", { class: "num", title: `${count(r.cached_tokens)} of ${count(r.prompt_tokens)} prompt tokens cached · ` +
      `${count(r.completion_tokens)} completion tokens`, text: fmtPct(r.prefix_cache_hit_rate) }));
  }));
}

// ---- batches --------------------------------------------------------------------------------

function renderBatches(batches) {
  const body = $("batches").tBodies[0];
  const queue = batches ? batches.queue : null;
  $("batches-panel").classList.toggle("off", !batches);
  if (!queue) {
    $("batches-caption").textContent = "";
    const text = batches ? "Not read yet: the batch runner reads the queue every few seconds." : "No batch runner.";
    body.replaceChildren(el("tr", {}, el("td", { colspan: "11", class: "empty", text })));
    return;
  }
  const count = (n) => (n ?? 0).toLocaleString("en-US");
  const done = batches.num_lines_by_outcome || {};
  $("batches-caption").textContent = `${count(queue.num_lines_pending)} lines waiting · ` +
    `${count(queue.num_lines_claimed)} held by runners · this server: ${count(batches.num_running)} running, ` +
    `${count(done.succeeded)} succeeded, ${count(done.failed)} failed, ${count(batches.num_deferred)} deferred · ` +
    `as of ${clock(batches.overview_at, false)}`;
  if (!queue.running.length) {
    body.replaceChildren(el("tr", {}, el("td", { colspan: "11", class: "empty", text: "No batch running." })));
    return;
  }
  body.replaceChildren(...queue.running.map((b) => {
    // Ended lines (cancelled and expired ones too) of all of them: the bar's share.
    const numEnded = b.total - b.pending;
    const share = b.total ? numEnded / b.total : 0;
    const failedShare = b.total ? b.failed / b.total : 0;
    return el("tr", { "data-batch": b.id },
      el("td", { class: "mono", text: b.id }),
      el("td", { class: "mono", text: b.key_id }),
      el("td", { text: b.model || "—" }),
      el("td", { text: b.endpoint }),
      el("td", {}, el("span", { class: `pill ${b.status === "in_progress" ? "ok" : "warn"}`, text: b.status })),
      el("td", { class: "progress-cell", title: `${count(numEnded)} of ${count(b.total)} lines ended` },
        el("div", { class: "progress" },
          el("div", { class: "progress-done", style: { width: `${(share - failedShare) * 100}%` } }),
          el("div", { class: "progress-failed", style: { width: `${failedShare * 100}%` } })),
        el("span", { class: "progress-text", text: `${count(numEnded)} / ${count(b.total)} · ${fmtPct(share)}` })),
      el("td", { class: "num", text: count(b.succeeded) }),
      el("td", { class: "num", text: count(b.failed) }),
      el("td", { class: "num", text: count(b.pending) }),
      el("td", { text: dateTime(b.created_at) }),
      el("td", { text: dateTime(b.expires_at) }));
  }));
}

// ---- line charts ----------------------------------------------------------------------------

function renderEngineState(engine) {
  for (const panel of document.querySelectorAll(".engine-panel")) {
    panel.classList.toggle("off", !engine);
    panel.dataset.engine = engine ? "on" : "off";
    panel.querySelector(".engine-off-note").hidden = !!engine;
  }
}

// `engine` is null without a local engine: the charts are drawn empty (their panels greyed out).
function renderCharts(series, engine) {
  const width = $("throughput-chart").clientWidth;
  const times = series.map((point) => point.t);
  const last = series.length ? series[series.length - 1] : {};
  $("throughput-chart").replaceChildren(
    lineChart(times, { name: "tokens / s", color: "#34d399", values: series.map((p) => p.tokens_per_s), format: fmtRate, width }),
    lineChart(times, { name: "requests / s", color: "#38bdf8", values: series.map((p) => p.requests_per_s), format: fmtRate, width }));
  const used = last.kv_blocks_used ?? (engine ? engine.kv_blocks_total - engine.kv_blocks_free : null);
  const total = last.kv_blocks_total ?? (engine ? engine.kv_blocks_total : null);
  $("kv-chart").replaceChildren(
    lineChart(times, { name: `KV usage · ${used ?? "—"} of ${total ?? "—"} blocks`,
      color: "#fbbf24", values: series.map((p) => p.kv_usage), format: fmtPct, percent: true, width }),
    lineChart(times, { name: "running / waiting", color: "#818cf8", values: series.map((p) => p.running), format: String,
      second: { color: "#f472b6", values: series.map((p) => p.waiting) }, width }));
  const hitRate = engine ? engine.prefix_cache_hit_rate : null;
  $("hit-rate").textContent = fmtPct(hitRate);
  $("hit-rate-chart").replaceChildren(lineChart(times,
    { name: "hit rate", color: "#c084fc", values: series.map((p) => p.prefix_cache_hit_rate), format: fmtPct, percent: true, yMax: 1, tall: true, width }));
}

// One small SVG line chart over the last WINDOW_S seconds; `second` is an optional second line
// on the same axis. Hovering shows the values at the nearest point.
function lineChart(times, spec) {
  const figure = el("figure", { class: "chart" });
  const current = spec.values.length ? spec.values[spec.values.length - 1] : null;
  const currentText = spec.second && current !== null ? `${current} / ${spec.second.values[spec.second.values.length - 1]}`
    : current === null || current === undefined ? "—" : spec.format(current);
  figure.append(el("figcaption", {}, el("span", { class: "chart-name" }, el("i", { class: "swatch", style: { background: spec.color } }),
    spec.name), el("span", { class: "chart-now", text: currentText })));
  const width = Math.max(200, spec.width || 360);
  const height = spec.tall ? 150 : 92;
  const pad = { left: 44, right: 8, top: 8, bottom: 18 };
  const plotW = width - pad.left - pad.right;
  const plotH = height - pad.top - pad.bottom;
  const chart = svg("svg", { width, height, viewBox: `0 0 ${width} ${height}`, class: "chart-svg", role: "img" });
  const lines = [spec, spec.second].filter(Boolean);
  const maxValue = Math.max(0, ...lines.flatMap((line) => line.values.filter((v) => v !== null && v !== undefined)));
  const yMax = spec.yMax ?? (spec.percent ? Math.min(1, niceCeil(maxValue)) : niceCeil(maxValue));
  const tEnd = times.length ? times[times.length - 1] : 0;
  const x = (t) => pad.left + plotW * (1 - Math.min(WINDOW_S, tEnd - t) / WINDOW_S);
  const y = (v) => pad.top + plotH * (1 - Math.min(v, yMax) / yMax);

  for (const fraction of [0, 0.5, 1]) {
    const value = yMax * fraction;
    chart.append(svg("line", { x1: pad.left, x2: width - pad.right, y1: y(value), y2: y(value), class: "gridline" }));
    const label = svg("text", { x: pad.left - 6, y: y(value) + 3, class: "axis-label", "text-anchor": "end" });
    label.textContent = spec.percent ? `${+(value * 100).toFixed(value < 0.1 ? 1 : 0)}%` : compact(value);
    chart.append(label);
  }
  for (let ago = WINDOW_S; ago >= 0; ago -= 60) {
    const label = svg("text", { x: x(tEnd - ago), y: height - 4, class: "axis-label",
      "text-anchor": ago === WINDOW_S ? "start" : ago === 0 ? "end" : "middle" });
    label.textContent = ago === 0 ? "now" : `-${ago / 60}m`;
    chart.append(label);
  }
  if (!times.length) {
    const empty = svg("text", { x: pad.left + plotW / 2, y: pad.top + plotH / 2, class: "axis-label", "text-anchor": "middle" });
    empty.textContent = "no data yet";
    chart.append(empty);
  }
  lines.forEach((line, index) => {
    const segments = [];
    let segment = [];
    times.forEach((t, i) => {
      const v = line.values[i];
      if (v === null || v === undefined || tEnd - t > WINDOW_S) {
        if (segment.length) segments.push(segment);
        segment = [];
      } else segment.push([x(t), y(v)]);
    });
    if (segment.length) segments.push(segment);
    for (const points of segments) {
      const d = points.map(([px, py], i) => `${i ? "L" : "M"}${px.toFixed(1)},${py.toFixed(1)}`).join("");
      if (index === 0) {
        const base = y(0).toFixed(1);
        chart.append(svg("path", { d: `${d}L${points[points.length - 1][0].toFixed(1)},${base}L${points[0][0].toFixed(1)},${base}Z`,
          fill: line.color, "fill-opacity": "0.14", stroke: "none" }));
      }
      chart.append(svg("path", { d, fill: "none", stroke: line.color, "stroke-width": "1.6", "stroke-linejoin": "round" }));
    }
    // The latest point as a dot: a series of one point draws no line.
    const lastPoint = segments.length ? segments[segments.length - 1].at(-1) : null;
    if (lastPoint) chart.append(svg("circle", { cx: lastPoint[0], cy: lastPoint[1], r: 2.5, fill: line.color }));
  });
  addHover(figure, chart, times, lines, { x, y, pad, height, spec });
  figure.append(chart);
  return figure;
}

function compact(value) {
  if (value >= 1000) return `${+(value / 1000).toFixed(1)}k`;
  return String(+value.toFixed(value < 10 ? 2 : 0));
}

function addHover(figure, chart, times, lines, { x, y, pad, height, spec }) {
  const guide = svg("line", { y1: pad.top, y2: height - pad.bottom, class: "hover-line", visibility: "hidden" });
  const dots = lines.map((line) => svg("circle", { r: 3, fill: line.color, visibility: "hidden" }));
  const tip = el("div", { class: "chart-tip", hidden: "" });
  chart.append(guide, ...dots);
  figure.append(tip);
  chart.addEventListener("mousemove", (event) => {
    if (!times.length) return;
    const mouseX = event.offsetX;
    let nearest = 0;
    times.forEach((t, i) => { if (Math.abs(x(t) - mouseX) < Math.abs(x(times[nearest]) - mouseX)) nearest = i; });
    const px = x(times[nearest]);
    guide.setAttribute("x1", px); guide.setAttribute("x2", px); guide.setAttribute("visibility", "visible");
    const parts = [clock(times[nearest], false)];
    lines.forEach((line, i) => {
      const v = line.values[nearest];
      if (v === null || v === undefined) { dots[i].setAttribute("visibility", "hidden"); return; }
      dots[i].setAttribute("cx", px); dots[i].setAttribute("cy", y(v)); dots[i].setAttribute("visibility", "visible");
      parts.push(spec.format(v));
    });
    tip.textContent = parts.join("  ·  ");
    tip.hidden = false;
    tip.style.left = `${Math.min(px + 8, chart.clientWidth - tip.offsetWidth)}px`;
  });
  chart.addEventListener("mouseleave", () => {
    tip.hidden = true;
    guide.setAttribute("visibility", "hidden");
    dots.forEach((dot) => dot.setAttribute("visibility", "hidden"));
  });
}

// ---- start ----------------------------------------------------------------------------------

function start() {
  takeKeyFromHash();
  $("auth-form").addEventListener("submit", onKeySubmit);
  $("forget-key").addEventListener("click", () => {
    sessionStorage.removeItem(KEY_STORAGE);
    refresh();
  });
  $("pause").addEventListener("click", () => {
    state.paused = !state.paused;
    $("pause").textContent = state.paused ? "Resume" : "Pause";
    refresh();
  });
  $("follow-newest").addEventListener("click", () => {
    state.pinned = false;
    render();
  });
  let resizeTimer = null;
  window.addEventListener("resize", () => {
    clearTimeout(resizeTimer);
    resizeTimer = setTimeout(render, 150);
  });
  refresh();
}

start();
