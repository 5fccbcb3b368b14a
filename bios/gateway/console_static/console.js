// The Bios console: reads /console/api/* with the key as a bearer token and draws tables and SVG charts.
"use strict";

const KEY_ITEM = "bios-console-key";
const REFRESH_MS = 3000;
let key = localStorage.getItem(KEY_ITEM) || "";
let filterText = "";

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

function svg(tag, attrs) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, value);
  return node;
}

function table(headers, rows, attrs) {
  return el("table", attrs, el("thead", {}, el("tr", {}, headers.map(h => el("th", {}, h)))),
            el("tbody", {}, rows));
}

const fmt = {
  num: v => (v === null || v === undefined) ? "-" : Number(v).toPrecision(4).replace(/\.?0+$/, ""),
  time: t => new Date(t * 1000).toLocaleString(),
  age: s => s.toFixed(1) + " s",
};

// ------------------------------------------------------------------------------------------ charts

function chart(name, title, xs, ys) {
  const points = xs.map((x, i) => [x, ys[i]]).filter(([x, y]) => Number.isFinite(x) && Number.isFinite(y));
  const box = el("div", {class: "chart", id: "chart-" + name, "data-points": points.length}, el("h3", {}, title));
  const W = 400, H = 160, P = 28;
  const plot = svg("svg", {viewBox: `0 0 ${W} ${H}`, preserveAspectRatio: "none"});
  if (points.length) {
    const [x0, x1] = [Math.min(...points.map(p => p[0])), Math.max(...points.map(p => p[0]))];
    const [y0, y1] = [Math.min(...points.map(p => p[1])), Math.max(...points.map(p => p[1]))];
    const sx = x => P + (x1 === x0 ? 0.5 : (x - x0) / (x1 - x0)) * (W - 2 * P);
    const sy = y => H - P + 8 - (y1 === y0 ? 0.5 : (y - y0) / (y1 - y0)) * (H - 2 * P);
    plot.append(svg("polyline", {points: points.map(([x, y]) => `${sx(x)},${sy(y)}`).join(" ")}));
    for (const [x, y] of points) plot.append(svg("circle", {class: "pt", cx: sx(x), cy: sy(y), r: 1.8}));
    const label = (x, y, text, anchor) => {
      const node = svg("text", {x, y, "text-anchor": anchor}); node.textContent = text; plot.append(node);
    };
    label(2, 10, fmt.num(y1), "start");
    label(2, H - 4, fmt.num(y0), "start");
    label(W - 2, H - 4, "step " + x1, "end");
  } else {
    const node = svg("text", {x: 8, y: 20}); node.textContent = "no data yet"; plot.append(node);
  }
  box.append(plot);
  return box;
}

// ------------------------------------------------------------------------------------------ views

async function runsView(view) {
  const [who, runs, cluster] = await Promise.all([api("whoami"), api("runs"), api("cluster")]);
  showWho(who);
  const filter = el("input", {id: "filter", placeholder: "filter runs (id, base model, status)", value: filterText});
  const shown = runs.runs.filter(r => [r.training_run_id, r.base_model, r.status].join(" ").includes(filterText));
  const rows = shown.map(r => el("tr", {class: "run", "data-run": r.training_run_id},
    el("td", {}, el("a", {href: "#/run/" + encodeURIComponent(r.training_run_id)}, r.training_run_id)),
    el("td", {}, r.base_model), el("td", {}, r.status), el("td", {class: "num"}, r.steps),
    el("td", {class: "num"}, r.tokens), el("td", {class: "num"}, fmt.num(r.last_loss)),
    el("td", {}, r.last_checkpoint || "-"), who.admin ? el("td", {}, r.owner) : null));
  const headers = ["run", "base model", "status", "steps", "tokens", "last loss", "last checkpoint"];
  view.replaceChildren(
    el("h2", {}, `Runs (${runs.total_count})`), filter,
    table(who.admin ? [...headers, "owner"] : headers, rows, {id: "runs"}),
    ...clusterTables(cluster, runs.runs));
  filter.addEventListener("input", () => {
    filterText = filter.value;
    render().then(() => { const f = document.getElementById("filter"); f.focus(); f.selectionStart = f.value.length; });
  });
}

function clusterTables(status, runs) {
  const workers = status.workers.map(w => el("tr", {class: "worker", "data-worker": w.worker_id},
    el("td", {}, w.worker_id), el("td", {class: "state-" + w.state}, w.state), el("td", {}, w.device),
    el("td", {}, w.host), el("td", {class: "num"}, w.pid), el("td", {class: "num"}, fmt.age(w.last_heartbeat_age_s)),
    el("td", {}, w.note)));
  const dtypes = {};
  for (const r of runs) if (r.base_dtype) dtypes[r.base_model] = r.base_dtype;
  const pools = [...new Set([...Object.keys(status.plans), ...Object.keys(dtypes)])].map(model => el("tr", {},
    el("td", {}, model), el("td", {}, dtypes[model] || "-"), el("td", {}, status.plans[model] || "-")));
  const cycles = Math.max(status.cycles_run, 1);
  const phases = Object.entries(status.phase_seconds).map(([phase, seconds]) => el("tr", {},
    el("td", {}, phase), el("td", {class: "num"}, seconds.toFixed(3)), el("td", {class: "num"},
      (1000 * seconds / cycles).toFixed(1))));
  const busy = status.uptime_s ? (100 * status.busy_s / status.uptime_s).toFixed(0) : "0";
  return [
    el("h2", {}, `Workers (generation ${status.generation})`),
    table(["worker", "state", "device", "host", "pid", "heartbeat", "note"], workers, {id: "workers"}),
    el("h2", {}, "Base models"), table(["base model", "base dtype", "memory plan"], pools, {id: "pools"}),
    el("h2", {}, "Queue and cycles"),
    el("p", {id: "queue"}, `${status.queue_depth} request(s) queued; ${status.cycles_run} cycle(s) run, busy ${busy}% ` +
       `of ${status.uptime_s.toFixed(0)} s; ` + (status.cycle_s ? `a cycle every ${status.cycle_s} s` : "cycles back to back")),
    table(["phase", "seconds in all", "ms per cycle"], phases, {id: "phases"}),
  ];
}

async function runView(view, runId) {
  const [who, run] = await Promise.all([api("whoami"), api("runs/" + encodeURIComponent(runId))]);
  showWho(who);
  const s = run.summary, p = run.points;
  const steps = p.map(q => q.step);
  const tokensPerS = p.map((q, i) => i === 0 ? NaN :
    (q.total_tokens - p[i - 1].total_tokens) / Math.max(q.time - p[i - 1].time, 1e-9));
  const facts = [["run", s.training_run_id], ["base model", s.base_model], ["status", s.status],
    ["steps", s.steps], ["tokens", s.tokens], ["last loss", fmt.num(s.last_loss)], ["created", fmt.time(s.created)]];
  const checkpoints = run.checkpoints.map(c => {
    const command = `bios checkpoint export ${c.path} ./exported`;
    const copy = el("code", {class: "copy", title: "click to copy"}, command);
    copy.addEventListener("click", () => navigator.clipboard && navigator.clipboard.writeText(command));
    return el("tr", {}, el("td", {}, c.path), el("td", {}, c.type), el("td", {class: "num"}, c.size_bytes),
              el("td", {}, fmt.time(c.time)), el("td", {}, copy));
  });
  view.replaceChildren(
    el("p", {}, el("a", {href: "#/"}, "← all runs")),
    el("h2", {}, "Run " + s.training_run_id),
    el("table", {id: "summary"}, el("tbody", {}, facts.map(([k, v]) => el("tr", {}, el("th", {}, k), el("td", {}, v))))),
    el("div", {class: "charts"},
      chart("loss", "loss (loss:sum per step)", steps, p.map(q => q.loss === null ? NaN : q.loss)),
      chart("grad-norm", "gradient norm", steps, p.map(q => q.grad_norm === null ? NaN : q.grad_norm)),
      chart("lr", "learning rate", steps, p.map(q => q.learning_rate === null ? NaN : q.learning_rate)),
      chart("tokens-per-s", "tokens per second", steps, tokensPerS)),
    el("h2", {}, "Checkpoints"),
    table(["path", "type", "bytes", "saved", "export"], checkpoints, {id: "checkpoints"}));
}

function showWho(who) {
  document.getElementById("who").textContent =
    !who.keys ? "local cluster (no keys)" : who.admin ? "admin: every key's runs" : "key " + who.owner;
  document.getElementById("forget").hidden = !key;
}

// ------------------------------------------------------------------------------------------ routing

async function render() {
  const view = document.getElementById("view");
  const login = document.getElementById("login");
  const match = location.hash.match(/^#\/run\/(.+)$/);
  try {
    if (match) await runView(view, decodeURIComponent(match[1]));
    else await runsView(view);
    login.hidden = true;
    view.setAttribute("data-ready", "1");
  } catch (error) {
    if (error instanceof AuthError) {
      login.hidden = false;
      view.replaceChildren();
      document.getElementById("login-error").textContent = key ? error.message : "";
    } else {
      view.replaceChildren(el("p", {class: "error"}, "could not load: " + error.message));
    }
  }
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
setInterval(() => { if (document.activeElement === null || document.activeElement.id !== "filter") render(); }, REFRESH_MS);
