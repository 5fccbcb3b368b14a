// The Bios console: reads /console/api/* with the key as a bearer token and draws tables and SVG charts.
"use strict";

const KEY_ITEM = "bios-console-key";
const REFRESH_MS = 3000;
const COLOURS = ["#2563eb", "#dc2626", "#059669", "#d97706", "#7c3aed", "#0891b2", "#db2777", "#4b5563"];
let key = localStorage.getItem(KEY_ITEM) || "";
let filterText = "";
const selected = new Set();            // runs ticked in the runs table, for the compare view
const settings = {smoothing: 0, logY: false, hovering: false};  // chart settings, kept across refreshes

class AuthError extends Error {}

// A key passed as ?key=... (handy for scripts) is kept like a typed one and taken out of the address bar.
(function keyFromAddress() {
  const url = new URL(location.href);
  const given = url.searchParams.get("key");
  if (given) {
    key = given;
    localStorage.setItem(KEY_ITEM, given);
    url.searchParams.delete("key");
    history.replaceState(null, "", url.pathname + url.search + url.hash);
  }
})();

async function api(path) {
  const response = await fetch("/console/api/" + path, {headers: key ? {Authorization: "Bearer " + key} : {}});
  const body = await response.json();
  if (response.status === 401) throw new AuthError(body.detail);
  if (!response.ok) throw new Error(body.detail || response.statusText);
  return body;
}

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value !== null && value !== undefined) node.setAttribute(name, value);
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function svg(tag, attrs, text) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, value);
  if (text !== undefined) node.textContent = text;
  return node;
}

// Tables scroll inside their own box, so a wide one never pushes the page sideways.
function table(headers, rows, attrs) {
  return el("div", {class: "scroll"}, el("table", attrs,
    el("thead", {}, el("tr", {}, headers.map(h => el("th", {}, h)))), el("tbody", {}, rows)));
}

// ------------------------------------------------------------------------------------------ numbers

// How every number is shown (runs table, summary, steps table, chart ticks, hover):
//   below 0.001 in size (not 0): exponent, 4 significant digits        0.000012345 -> 1.235e-5
//   0.001 up to 1,000:           4 significant digits, no trailing 0s  0.5 -> 0.5, 12.3456 -> 12.35
//   1,000 up to 1e15:            rounded to a whole number, thousands  1230.2 -> 1,230, 99999 -> 99,999
//   1e15 and beyond:             exponent, 4 significant digits        1.2e16 -> 1.2e16
// Digits before the decimal point are never dropped; only zeros after it are.
const SIGNIFICANT = 4, TINY = 1e-3, GROUPED = 1e3, HUGE = 1e15;

function formatNumber(value) {
  if (value === null || value === undefined) return "-";
  const x = Number(value);
  if (Number.isNaN(x)) return "-";
  if (!Number.isFinite(x)) return x > 0 ? "∞" : "-∞";
  if (x === 0) return "0";
  const size = Math.abs(x), sign = x < 0 ? "-" : "";
  if (size < TINY || size >= HUGE) return sign + exponent(size);
  const digits = size.toPrecision(SIGNIFICANT);
  if (Number(digits) >= GROUPED) return sign + thousands(Math.round(size));
  return sign + (digits.includes(".") ? digits.replace(/\.?0+$/, "") : digits);
}

function exponent(size) {
  const [mantissa, power] = size.toExponential(SIGNIFICANT - 1).split("e");
  return mantissa.replace(/\.?0+$/, "") + "e" + power.replace("+", "");
}

function thousands(whole) {
  return String(whole).replace(/\B(?=(\d{3})+(?!\d))/g, ",");
}

const fmt = {
  num: formatNumber,
  time: t => new Date(t * 1000).toLocaleString(),
  age: s => s.toFixed(1) + " s",
};

// ------------------------------------------------------------------------------------------ series

// Exponential moving average, debiased at the start (as TensorBoard's slider), so it starts at the data.
function smooth(points, weight) {
  if (!weight) return points;
  let average = 0, norm = 0;
  return points.map(([x, y]) => {
    average = weight * average + (1 - weight) * y;
    norm = weight * norm + (1 - weight);
    return [x, average / norm];
  });
}

function finitePoints(xs, ys) {
  return xs.map((x, i) => [x, ys[i]]).filter(([x, y]) => Number.isFinite(x) && Number.isFinite(y)
    && (!settings.logY || y > 0));
}

// Steps of 1, 2 or 5 times a power of ten, about `count` of them across [lo, hi], and the range they span.
function niceTicks(lo, hi, count) {
  if (lo === hi) { const pad = Math.abs(lo) * 0.1 || 1; lo -= pad; hi += pad; }
  const rough = (hi - lo) / count, power = 10 ** Math.floor(Math.log10(rough));
  const step = [1, 2, 5, 10].map(m => m * power).find(s => s >= rough);
  const first = Math.floor(lo / step), last = Math.ceil(hi / step);
  const ticks = [];
  for (let i = first; i <= last; i++) ticks.push(Number((i * step).toPrecision(12)));
  return {ticks, lo: first * step, hi: last * step};
}

// Powers of ten around [lo, hi] (lo > 0), at most about eight labelled.
function logTicks(lo, hi) {
  let first = Math.floor(Math.log10(lo)), last = Math.ceil(Math.log10(hi));
  if (first === last) { first -= 1; last += 1; }
  const every = Math.ceil((last - first) / 8), ticks = [];
  for (let p = first; p <= last; p += every) ticks.push(Number((10 ** p).toPrecision(12)));
  return {ticks, lo: 10 ** first, hi: 10 ** last};
}

// ------------------------------------------------------------------------------------------ charts

const W = 480, H = 250, M = {left: 62, right: 14, top: 12, bottom: 38};

// A line chart of one or more series [{label, colour, points: [[step, value], ...]}], with axes, ticks,
// optional smoothing and a hover line that names the step and each series' value there.
function chart(name, title, series, yLabel) {
  const shown = series.filter(s => s.points.length);
  const count = series.reduce((n, s) => n + s.points.length, 0);
  const box = el("div", {class: "chart", id: "chart-" + name, "data-points": count}, el("h3", {}, title));
  const plot = svg("svg", {viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": title});
  box.append(plot);
  if (!shown.length) {
    plot.append(svg("text", {x: M.left, y: 30}, "no data yet"));
    return box;
  }
  const all = shown.flatMap(s => s.points);
  const xAxis = niceTicks(Math.min(...all.map(p => p[0])), Math.max(...all.map(p => p[0])), 6);
  xAxis.ticks = xAxis.ticks.filter(t => Number.isInteger(t));
  const ys = all.map(p => p[1]);
  const yAxis = settings.logY ? logTicks(Math.min(...ys), Math.max(...ys)) : niceTicks(Math.min(...ys), Math.max(...ys), 5);
  const sx = x => M.left + (x - xAxis.lo) / (xAxis.hi - xAxis.lo) * (W - M.left - M.right);
  const ty = settings.logY ? Math.log10 : (y => y);
  const sy = y => H - M.bottom - (ty(y) - ty(yAxis.lo)) / (ty(yAxis.hi) - ty(yAxis.lo)) * (H - M.top - M.bottom);
  drawAxes(plot, xAxis.ticks, yAxis.ticks, sx, sy, yLabel);
  const few = count <= 200 * series.length;
  for (const s of shown) {
    const line = smooth(s.points, settings.smoothing);
    if (settings.smoothing) plot.append(svg("polyline", {class: "raw", stroke: s.colour, points: path(s.points, sx, sy)}));
    plot.append(svg("polyline", {class: "line", stroke: s.colour, points: path(line, sx, sy), "data-series": s.label}));
    if (few) for (const [x, y] of s.points) plot.append(svg("circle", {class: "pt", fill: s.colour, cx: sx(x), cy: sy(y), r: 2}));
  }
  if (series.length > 1) box.append(legend(series));
  addHover(box, plot, shown, sx, sy);
  return box;
}

function path(points, sx, sy) {
  return points.map(([x, y]) => `${sx(x).toFixed(2)},${sy(y).toFixed(2)}`).join(" ");
}

function drawAxes(plot, xTicks, yTicks, sx, sy, yLabel) {
  const x0 = M.left, x1 = W - M.right, y0 = H - M.bottom, y1 = M.top;
  for (const t of yTicks) {
    plot.append(svg("line", {class: "grid", x1: x0, x2: x1, y1: sy(t), y2: sy(t)}));
    plot.append(svg("text", {class: "tick y-tick", x: x0 - 5, y: sy(t) + 3, "text-anchor": "end"}, fmt.num(t)));
  }
  for (const t of xTicks) {
    plot.append(svg("line", {class: "axis", x1: sx(t), x2: sx(t), y1: y0, y2: y0 + 4}));
    plot.append(svg("text", {class: "tick x-tick", x: sx(t), y: y0 + 15, "text-anchor": "middle"}, fmt.num(t)));
  }
  plot.append(svg("line", {class: "axis", x1: x0, x2: x1, y1: y0, y2: y0}));
  plot.append(svg("line", {class: "axis", x1: x0, x2: x0, y1: y0, y2: y1}));
  plot.append(svg("text", {class: "axis-label", x: (x0 + x1) / 2, y: H - 4, "text-anchor": "middle"}, "step"));
  plot.append(svg("text", {class: "axis-label", x: 12, y: (y0 + y1) / 2, "text-anchor": "middle",
                           transform: `rotate(-90 12 ${(y0 + y1) / 2})`}, yLabel));
}

function legend(series) {
  return el("div", {class: "legend"}, series.map(s => el("span", {},
    el("i", {style: `background:${s.colour}`}), s.label)));
}

// Moving over the plot marks the nearest step and shows each series' value there (raw, and smoothed when on).
function addHover(box, plot, series, sx, sy) {
  const marks = svg("g", {class: "hover"});
  const tip = el("div", {class: "tip", hidden: "hidden"});
  plot.append(marks);
  box.append(tip);
  const steps = [...new Set(series.flatMap(s => s.points.map(p => p[0])))].sort((a, b) => a - b);
  const smoothed = series.map(s => new Map(smooth(s.points, settings.smoothing)));
  const raw = series.map(s => new Map(s.points));
  plot.addEventListener("mousemove", event => {
    const rect = plot.getBoundingClientRect();
    const x = (event.clientX - rect.left) / rect.width * W;
    const step = steps.reduce((best, s) => Math.abs(sx(s) - x) < Math.abs(sx(best) - x) ? s : best, steps[0]);
    marks.replaceChildren(svg("line", {x1: sx(step), x2: sx(step), y1: M.top, y2: H - M.bottom}));
    const lines = [el("b", {class: "tip-step"}, "step " + fmt.num(step))];
    series.forEach((s, i) => {
      if (!raw[i].has(step)) return;
      marks.append(svg("circle", {cx: sx(step), cy: sy(smoothed[i].get(step)), r: 3.5, fill: s.colour}));
      const value = fmt.num(raw[i].get(step));
      const text = settings.smoothing ? `${value} (smoothed ${fmt.num(smoothed[i].get(step))})` : value;
      lines.push(el("div", {class: "tip-row", "data-series": s.label},
        el("i", {style: `background:${s.colour}`}), `${s.label}: `, el("span", {class: "tip-value"}, text)));
    });
    tip.replaceChildren(...lines);
    tip.hidden = false;
    tip.style.left = Math.min(event.clientX - box.getBoundingClientRect().left + 14, box.clientWidth - tip.offsetWidth - 4) + "px";
    settings.hovering = true;
  });
  plot.addEventListener("mouseleave", () => {
    marks.replaceChildren();
    tip.hidden = true;
    settings.hovering = false;
  });
}

// Smoothing and log scale apply to every chart on the page; changing them redraws it.
function chartControls() {
  const slider = el("input", {id: "smoothing", type: "range", min: 0, max: 0.99, step: 0.01, value: settings.smoothing});
  const shown = el("output", {id: "smoothing-value"}, settings.smoothing.toFixed(2));
  const log = el("input", {id: "log-y", type: "checkbox", checked: settings.logY ? "checked" : null});
  slider.addEventListener("input", () => { settings.smoothing = Number(slider.value); shown.textContent = settings.smoothing.toFixed(2); });
  slider.addEventListener("change", () => render());
  log.addEventListener("change", () => { settings.logY = log.checked; render(); });
  return el("div", {class: "controls"},
    el("label", {}, "smoothing (EMA) ", slider, " ", shown),
    el("label", {}, log, " log scale"));
}

// The charts of one or more runs: each metric a chart, each run a line on it.
function runCharts(runs) {
  const series = (metric, derive) => runs.map((run, i) => ({
    label: run.summary.training_run_id, colour: COLOURS[i % COLOURS.length],
    points: finitePoints(run.points.map(q => q.step), derive ? derive(run.points) : run.points.map(q => q[metric] ?? NaN)),
  }));
  return el("div", {class: "charts"},
    chart("loss", "loss (loss:sum per step)", series("loss"), "loss:sum"),
    chart("loss-per-token", "loss per token (loss:sum / input tokens)", series("loss_per_token"), "loss / token"),
    chart("grad-norm", "gradient norm", series("grad_norm"), "grad norm"),
    chart("lr", "learning rate", series("learning_rate"), "learning rate"),
    chart("tokens-per-s", "tokens per second", series(null, tokensPerSecond), "tokens / s"));
}

function tokensPerSecond(points) {
  return points.map((q, i) => i === 0 ? NaN :
    (q.total_tokens - points[i - 1].total_tokens) / Math.max(q.time - points[i - 1].time, 1e-9));
}

// ------------------------------------------------------------------------------------------ views

async function runsView(main) {
  const [who, runs, cluster] = await Promise.all([api("whoami"), api("runs"), api("cluster")]);
  showWho(who);
  const filter = el("input", {id: "filter", placeholder: "filter runs (id, base model, status)", value: filterText});
  const shown = runs.runs.filter(r => [r.training_run_id, r.base_model, r.status].join(" ").includes(filterText));
  const known = new Set(runs.runs.map(r => r.training_run_id));
  for (const id of selected) if (!known.has(id)) selected.delete(id);
  const compare = el("button", {id: "compare", disabled: selected.size < 2 ? "disabled" : null},
                     `compare selected (${selected.size})`);
  compare.addEventListener("click", () => { location.hash = "#/compare/" + [...selected].map(encodeURIComponent).join(","); });
  const rows = shown.map(r => el("tr", {class: "run", "data-run": r.training_run_id},
    el("td", {}, pick(r.training_run_id, compare)),
    el("td", {}, el("a", {href: "#/run/" + encodeURIComponent(r.training_run_id)}, r.training_run_id)),
    el("td", {}, r.base_model), el("td", {}, r.status), el("td", {class: "num"}, fmt.num(r.steps)),
    el("td", {class: "num"}, fmt.num(r.tokens)), el("td", {class: "num last-loss"}, fmt.num(r.last_loss)),
    el("td", {}, r.last_checkpoint || "-"), who.admin ? el("td", {}, r.owner) : null));
  const headers = ["", "run", "base model", "status", "steps", "tokens", "last loss", "last checkpoint"];
  main.replaceChildren(
    el("h2", {}, `Runs (${runs.total_count})`), el("div", {class: "controls"}, filter, compare),
    table(who.admin ? [...headers, "owner"] : headers, rows, {id: "runs"}),
    ...clusterTables(cluster, runs.runs));
  filter.addEventListener("input", () => {
    filterText = filter.value;
    render().then(() => { const f = document.getElementById("filter"); f.focus(); f.selectionStart = f.value.length; });
  });
}

// The runs table's tick box: ticked runs stay ticked across refreshes and feed the compare button.
function pick(runId, compare) {
  const box = el("input", {type: "checkbox", class: "pick", "aria-label": "compare " + runId,
                           checked: selected.has(runId) ? "checked" : null});
  box.addEventListener("change", () => {
    if (box.checked) selected.add(runId); else selected.delete(runId);
    compare.textContent = `compare selected (${selected.size})`;
    compare.disabled = selected.size < 2;
  });
  return box;
}

function clusterTables(status, runs) {
  const workers = status.workers.map(w => el("tr", {class: "worker", "data-worker": w.worker_id},
    el("td", {}, w.worker_id), el("td", {class: "state-" + w.state}, w.state), el("td", {}, w.device),
    el("td", {class: "models"}, (w.models || []).join(", ") || "-"),
    el("td", {class: "num memory"}, w.memory_bytes ? (w.memory_bytes / 2 ** 30).toFixed(1) + " GiB" : "-"),
    el("td", {}, w.host), el("td", {class: "num"}, w.pid), el("td", {class: "num"}, fmt.age(w.last_heartbeat_age_s)),
    el("td", {}, w.note)));
  const groups = status.groups.map(g => el("tr", {class: "group", "data-group": g.group_id},
    el("td", {}, g.models.join(", ")), el("td", {class: "num tp"}, g.tp), el("td", {class: "num replicas"}, g.replicas),
    el("td", {}, g.formed.join(", ") || "none formed yet")));
  const dtypes = {};
  for (const r of runs) if (r.base_dtype) dtypes[r.base_model] = r.base_dtype;
  const longest = status.longest_rows || {}, forward = status.longest_forward_rows || {};
  const tokens = (rows, model) => rows[model] ? `${rows[model]} tokens` : "-";
  const pools = [...new Set([...Object.keys(status.plans), ...Object.keys(dtypes)])].map(model => el("tr", {},
    el("td", {}, model), el("td", {}, dtypes[model] || "-"),
    el("td", {class: "num longest-row"}, tokens(longest, model)),
    el("td", {class: "num longest-forward-row"}, tokens(forward, model)),
    el("td", {}, status.plans[model] || "-")));
  const cycles = Math.max(status.cycles_run, 1);
  const phases = Object.entries(status.phase_seconds).map(([phase, seconds]) => el("tr", {},
    el("td", {}, phase), el("td", {class: "num"}, seconds.toFixed(3)), el("td", {class: "num"},
      (1000 * seconds / cycles).toFixed(1))));
  const busy = status.uptime_s ? (100 * status.busy_s / status.uptime_s).toFixed(0) : "0";
  return [
    el("h2", {}, `Workers (generation ${status.generation})`),
    table(["worker", "state", "device", "base models", "memory", "host", "pid", "heartbeat", "note"], workers,
          {id: "workers"}),
    el("h2", {}, "Groups"), table(["base models", "TP", "replicas", "running on"], groups, {id: "groups"}),
    el("ul", {id: "placement-notes"}, status.placement_notes.map(note => el("li", {}, note))),
    el("h2", {}, "Base models"), table(["base model", "base dtype", "longest trained row", "longest forward-only row", "memory plan"], pools, {id: "pools"}),
    el("h2", {}, "Queue and cycles"),
    el("p", {id: "queue"}, `${status.queue_depth} request(s) queued; ${status.cycles_run} cycle(s) run, busy ${busy}% ` +
       `of ${status.uptime_s.toFixed(0)} s; ` + (status.cycle_s ? `a cycle every ${status.cycle_s} s` : "cycles back to back")),
    table(["phase", "seconds in all", "ms per cycle"], phases, {id: "phases"}),
  ];
}

function facts(id, pairs) {
  return el("table", {id, class: "facts"}, el("tbody", {}, pairs.map(([k, v]) =>
    el("tr", {"data-key": k}, el("th", {}, k), el("td", {}, shownValue(v))))));
}

function shownValue(v) {
  return v === null || v === undefined ? "-" : typeof v === "number" ? fmt.num(v) : String(v);
}

async function runView(main, runId) {
  const [who, run] = await Promise.all([api("whoami"), api("runs/" + encodeURIComponent(runId))]);
  showWho(who);
  const s = run.summary, last = run.points[run.points.length - 1];
  const summary = [["run", s.training_run_id], ["status", s.status], ["owner", s.owner], ["steps", s.steps],
    ["tokens", s.tokens], ["last loss", s.last_loss ?? "-"], ["last loss per token", last ? last.loss_per_token ?? "-" : "-"],
    ["created", fmt.time(s.created)]];
  const metadata = Object.entries(run.user_metadata || {});
  main.replaceChildren(
    el("p", {}, el("a", {href: "#/"}, "← all runs")),
    el("h2", {}, "Run " + s.training_run_id),
    el("div", {class: "panels"},
      el("section", {}, el("h3", {}, "Summary"), facts("summary", summary)),
      el("section", {}, el("h3", {}, "Config"), facts("config", Object.entries(run.config))),
      metadata.length ? el("section", {}, el("h3", {}, "User metadata"), facts("user-metadata", metadata)) : null),
    chartControls(), runCharts([run]),
    el("h2", {}, "Steps"), stepsTable(run.points),
    el("h2", {}, "Checkpoints"), checkpointsTable(run.checkpoints));
}

// One row per recorded step, newest first, with every metric the step's results reported.
function stepsTable(points) {
  const extra = [...new Set(points.flatMap(q => Object.keys(q.metrics)))].filter(k => k !== "loss:sum").sort();
  const rows = [...points].reverse().map(q => el("tr", {class: "step", "data-step": q.step},
    el("td", {class: "num"}, fmt.num(q.step)), el("td", {class: "num"}, fmt.num(q.loss)),
    el("td", {class: "num"}, fmt.num(q.loss_per_token)), el("td", {class: "num"}, fmt.num(q.tokens)),
    el("td", {class: "num"}, fmt.num(q.grad_norm)), el("td", {class: "num"}, fmt.num(q.learning_rate)),
    extra.map(k => el("td", {class: "num"}, fmt.num(q.metrics[k]))), el("td", {}, fmt.time(q.time))));
  return el("div", {class: "scroll tall"}, el("table", {id: "steps"},
    el("thead", {}, el("tr", {}, ["step", "loss:sum", "loss / token", "tokens", "grad norm", "learning rate",
                                  ...extra, "time"].map(h => el("th", {}, h)))),
    el("tbody", {}, rows)));
}

function checkpointsTable(checkpoints) {
  const rows = checkpoints.map(c => {
    const command = `bios checkpoint export ${c.path} ./exported`;
    const copy = el("code", {class: "copy", title: "click to copy"}, command);
    copy.addEventListener("click", () => navigator.clipboard && navigator.clipboard.writeText(command));
    return el("tr", {}, el("td", {}, c.path), el("td", {}, c.type), el("td", {class: "num"}, fmt.num(c.size_bytes)),
              el("td", {}, fmt.time(c.time)), el("td", {}, copy));
  });
  return table(["path", "type", "bytes", "saved", "export"], rows, {id: "checkpoints"});
}

// Two or more runs side by side: their configs in one table (differences marked) and every chart overlaid.
async function compareView(main, runIds) {
  const [who, ...runs] = await Promise.all([api("whoami"), ...runIds.map(id => api("runs/" + encodeURIComponent(id)))]);
  showWho(who);
  const keys = [...new Set(runs.flatMap(r => [...Object.keys(r.config),
    ...Object.keys(r.user_metadata || {}).map(k => "metadata " + k)]))];
  const value = (r, k) => k.startsWith("metadata ") ? (r.user_metadata || {})[k.slice(9)] : r.config[k];
  const rows = [
    ["steps", ...runs.map(r => r.summary.steps)], ["last loss", ...runs.map(r => r.summary.last_loss)],
    ...keys.map(k => [k, ...runs.map(r => value(r, k))])].map(([k, ...vs]) =>
    el("tr", {class: new Set(vs.map(String)).size > 1 ? "differs" : null, "data-key": k}, el("th", {}, k),
       vs.map(v => el("td", {}, shownValue(v)))));
  const heads = runs.map((r, i) => el("span", {}, el("i", {style: `background:${COLOURS[i % COLOURS.length]}`}),
    el("a", {href: "#/run/" + encodeURIComponent(r.summary.training_run_id)}, r.summary.training_run_id)));
  main.replaceChildren(
    el("p", {}, el("a", {href: "#/"}, "← all runs")),
    el("h2", {}, `Comparing ${runs.length} runs`),
    table(["", ...heads], rows, {id: "compare-config"}),
    chartControls(), runCharts(runs));
}

function showWho(who) {
  document.getElementById("who").textContent =
    !who.keys ? "local cluster (no keys)" : who.admin ? "admin: every key's runs" : "key " + who.owner;
  document.getElementById("forget").hidden = !key;
}

// ------------------------------------------------------------------------------------------ routing

async function render() {
  const main = document.getElementById("view");
  const login = document.getElementById("login");
  const run = location.hash.match(/^#\/run\/(.+)$/);
  const compare = location.hash.match(/^#\/compare\/(.+)$/);
  try {
    if (run) await runView(main, decodeURIComponent(run[1]));
    else if (compare) await compareView(main, compare[1].split(",").map(decodeURIComponent));
    else await runsView(main);
    login.hidden = true;
    main.setAttribute("data-ready", "1");
  } catch (error) {
    if (error instanceof AuthError) {
      login.hidden = false;
      main.replaceChildren();
      document.getElementById("login-error").textContent = key ? error.message : "";
    } else {
      main.replaceChildren(el("p", {class: "error"}, "could not load: " + error.message));
    }
  }
}

// A refresh would drop what the user is doing: typing a filter, dragging the slider, reading a hover.
function busy() {
  const active = document.activeElement;
  return settings.hovering || (active !== null && active.tagName === "INPUT" && active.type !== "checkbox");
}

document.getElementById("login").addEventListener("submit", event => {
  event.preventDefault();
  key = document.getElementById("key").value.trim();
  localStorage.setItem(KEY_ITEM, key);
  render();
});
document.getElementById("forget").addEventListener("click", () => {
  key = "";
  localStorage.removeItem(KEY_ITEM);
  render();
});
window.addEventListener("hashchange", render);
render();
setInterval(() => { if (!busy()) render(); }, REFRESH_MS);
