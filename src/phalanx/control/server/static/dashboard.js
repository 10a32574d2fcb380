// Phalanx's live dashboard: signs in with the cluster token (kept in sessionStorage), polls the controller's
// /v1/dashboard and /v1/jobs/{id}/dashboard every second, and draws the node grid, the jobs table and the
// selected job's curves, goodput bar and timeline as plain SVG. No library, no network beyond the controller.
"use strict";

const TOKEN_KEY = "phalanx-token";
const POLL_MS = 1000;
const FETCH_TIMEOUT_MS = 10000;
const SVG = "http://www.w3.org/2000/svg";
const CATEGORY_COLORS = {
  productive: "#2e9d5b", replayed: "#b8d98a", initialization: "#6c8ebf", checkpoint_save: "#9b7fd1",
  checkpoint_restore: "#c59be8", failure_detection: "#e0533d", waiting_for_nodes: "#f0a33a",
  recovery: "#f3c74a", resizing: "#7ec8c8", idle: "#c9cdd3",
};
const PHASE_COLORS = { fault: "#c0392b", detect: "#e0533d", regroup: "#f0a33a", restore: "#9b7fd1",
  first_step: "#2e9d5b", straggler: "#d35400" };
const MAX_WATERFALLS = 3;  // the newest recoveries drawn zoomed
const OUTCOME_COLORS = { null: "#6c8ebf", succeeded: "#2e9d5b", cancelled: "#9aa0a6" };

let selectedJob = null;
let timer = null;

const $ = (id) => document.getElementById(id);

function el(tag, attrs = {}, text) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) if (v !== undefined && v !== null) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}

function svgEl(tag, attrs = {}, text) {
  const e = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}

function fmt(v, digits = 2) {
  if (v === null || v === undefined || Number.isNaN(v)) return "–";
  if (Math.abs(v) >= 10000) return Math.round(v).toLocaleString("en-US");
  return Number(v).toFixed(digits);
}

function secs(s) {
  if (s === null || s === undefined) return "–";
  return s < 10 ? `${s.toFixed(2)} s` : s < 120 ? `${s.toFixed(1)} s` : `${Math.floor(s / 60)} min ${Math.round(s % 60)} s`;
}

// ---- sign-in -------------------------------------------------------------------------------------------
class Unauthorized extends Error {}

async function api(path) {
  const token = sessionStorage.getItem(TOKEN_KEY);
  // a reply that never comes must not stop the polling: give up after FETCH_TIMEOUT_MS and poll again
  const r = await fetch(path, { headers: { Authorization: `Bearer ${token}` }, cache: "no-store",
    signal: AbortSignal.timeout(FETCH_TIMEOUT_MS) });
  if (r.status === 401) throw new Unauthorized("the controller refused the token");
  if (!r.ok) throw new Error(`${path}: HTTP ${r.status}`);
  return r.json();
}

function showSignIn(message) {
  clearTimeout(timer);
  sessionStorage.removeItem(TOKEN_KEY);
  $("app").hidden = true;
  $("sign-out").hidden = true;
  $("signin").hidden = false;
  $("node-grid").replaceChildren();  // no data of the cluster stays on the page
  $("signin-error").textContent = message || "";
  $("cluster").textContent = "";
  $("updated").textContent = "";
}

function showApp() {
  $("signin").hidden = true;
  $("app").hidden = false;
  $("sign-out").hidden = false;
}

$("signin-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  sessionStorage.setItem(TOKEN_KEY, $("token-input").value.trim());
  $("token-input").value = "";
  refresh();
});
$("sign-out").addEventListener("click", () => showSignIn("signed out"));

// ---- polling -------------------------------------------------------------------------------------------
async function refresh() {
  clearTimeout(timer);
  if (!sessionStorage.getItem(TOKEN_KEY)) return showSignIn();
  try {
    const overview = await api("/v1/dashboard");
    showApp();
    drawOverview(overview);
    const jobs = overview.jobs;
    if (!jobs.some((j) => j.id === selectedJob)) {
      const active = jobs.filter((j) => ["pending", "running", "recovering"].includes(j.state));
      selectedJob = (active.length ? active[active.length - 1] : jobs[jobs.length - 1] || {}).id || null;
    }
    $("job").hidden = !selectedJob;
    if (selectedJob) drawJob(await api(`/v1/jobs/${encodeURIComponent(selectedJob)}/dashboard`));
    $("updated").textContent = `updated ${new Date().toLocaleTimeString()}`;
    $("updated").className = "";
  } catch (err) {
    if (err instanceof Unauthorized) return showSignIn("That token was refused: check the cluster's token file.");
    $("updated").textContent = `controller unreachable (${err.message}); retrying`;
    $("updated").className = "stale";
  }
  timer = setTimeout(refresh, POLL_MS);
}

// ---- nodes and jobs ------------------------------------------------------------------------------------
function drawOverview(o) {
  const c = $("cluster");
  c.textContent = `${o.cluster.name} · ${o.cluster.status}`;
  c.dataset.status = o.cluster.status;
  c.title = o.cluster.reason || "";
  const grid = $("node-grid");
  grid.replaceChildren();
  const live = o.nodes.filter((n) => n.live);
  $("node-counts").textContent = `${live.filter((n) => n.role === "member").length} members, ` +
    `${live.filter((n) => n.role === "spare").length} spares, ${o.nodes.length - live.length} retired`;
  const order = (n) => (n.live ? 0 : 1);
  for (const n of [...o.nodes].sort((a, b) => order(a) - order(b))) {
    const tile = el("div", { class: "node", "data-node": n.name, "data-state": n.state, "data-role": n.role,
      "data-group": n.group, title: n.reason || "" });
    const head = el("div", { class: "node-head" });
    head.append(el("span", { class: "node-name" }, n.name), el("span", { class: `role ${n.role}` }, n.role));
    if (n.straggler) {
      tile.dataset.straggler = "true";
      head.append(el("span", { class: "role straggler", title: "a rank on this node is flagged as a straggler" }, "straggler"));
    }
    tile.append(head, el("div", { class: "node-state" }, n.state));
    const rows = [["group", n.group], ["health", n.health || "–"], ["job", n.job || "–"],
      ["heartbeat", n.heartbeat_age_s === null ? "–" : `${n.heartbeat_age_s.toFixed(1)} s ago`]];
    for (const [k, v] of rows) {
      const row = el("div", { class: "kv" });
      row.append(el("span", {}, k), el("span", { "data-field": k }, v));
      tile.append(row);
    }
    if (n.state !== "healthy" && n.reason) tile.append(el("div", { class: "node-reason" }, n.reason));
    grid.append(tile);
  }
  const body = $("jobs").querySelector("tbody");
  body.replaceChildren();
  for (const j of o.jobs) {
    const tr = el("tr", { "data-job": j.id, "data-state": j.state, class: j.id === selectedJob ? "selected" : "" });
    const cells = [j.id, j.name, j.state, j.recovery, (j.nodes || []).join(", ") || "–", j.generation,
      j.step ?? "–", fmt(j.loss, 3), fmt(j.tokens_per_s, 0), j.goodput === null ? "–" : `${(j.goodput * 100).toFixed(1)} %`,
      j.node_faults];
    cells.forEach((v, i) => tr.append(el("td", i === 2 ? { class: `state ${j.state}` } : {}, String(v))));
    tr.addEventListener("click", () => { selectedJob = j.id; refresh(); });
    body.append(tr);
  }
}

// ---- one job -------------------------------------------------------------------------------------------
function drawJob(d) {
  const j = d.job;
  $("job-title").textContent = `${j.id} (${j.name}) · ${j.state}`;
  $("job").dataset.job = j.id;
  $("job").dataset.state = j.state;
  $("job-reason").textContent = j.reason || "";
  const s = d.series;
  lineChart($("chart-loss"), s.step, s.loss, "#3b6fd4", 3);
  lineChart($("chart-tps"), s.step, s.tokens_per_s, "#2e9d5b", 0);
  drawGoodput(d.goodput);
  drawTimeline(d.timeline);
}

function lineChart(svg, xs, ys, color, digits) {
  const W = 460, H = 190, L = 56, R = 12, T = 10, B = 26;
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  svg.replaceChildren();
  const pts = xs.map((x, i) => [x, ys[i]]).filter((p) => p[1] !== null && p[1] !== undefined);
  svg.dataset.points = pts.length;
  if (!pts.length) {
    svg.append(svgEl("text", { x: W / 2, y: H / 2, class: "empty", "text-anchor": "middle" }, "no steps yet"));
    return;
  }
  let [x0, x1] = [Math.min(...pts.map((p) => p[0])), Math.max(...pts.map((p) => p[0]))];
  let [y0, y1] = [Math.min(...pts.map((p) => p[1])), Math.max(...pts.map((p) => p[1]))];
  if (x1 === x0) x1 = x0 + 1;
  if (y1 === y0) { y0 -= 0.5; y1 += 0.5; }
  const pad = (y1 - y0) * 0.06; y0 -= pad; y1 += pad;
  const sx = (x) => L + ((x - x0) / (x1 - x0)) * (W - L - R);
  const sy = (y) => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
  for (let i = 0; i <= 4; i++) {
    const y = y0 + ((y1 - y0) * i) / 4;
    svg.append(svgEl("line", { x1: L, x2: W - R, y1: sy(y), y2: sy(y), class: "grid" }));
    svg.append(svgEl("text", { x: L - 6, y: sy(y) + 4, "text-anchor": "end", class: "tick" }, fmt(y, digits)));
  }
  for (const x of [x0, Math.round((x0 + x1) / 2), x1]) {
    svg.append(svgEl("text", { x: sx(x), y: H - 8, "text-anchor": "middle", class: "tick" }, `${x}`));
  }
  // a step trained again (after a restart) starts a new segment: the curve shows the resume as a jump back
  let d = "";
  pts.forEach((p, i) => { d += `${i && p[0] > pts[i - 1][0] ? "L" : "M"}${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`; });
  svg.append(svgEl("path", { d, fill: "none", stroke: color, "stroke-width": 2, class: "curve" }));
  const last = pts[pts.length - 1];
  svg.append(svgEl("circle", { cx: sx(last[0]), cy: sy(last[1]), r: 3.5, fill: color }));
}

function drawGoodput(g) {
  const svg = $("goodput-bar"), legend = $("goodput-legend");
  svg.replaceChildren(); legend.replaceChildren();
  const W = Math.max(svg.clientWidth || 940, 600), H = 26;
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  if (!g || g.wall_s <= 0) { $("goodput-ratio").textContent = "(no run files yet)"; return; }
  $("goodput-ratio").textContent = `${(g.goodput * 100).toFixed(1)} % productive of ${secs(g.wall_s)}`;
  svg.dataset.goodput = g.goodput;
  let x = 0;
  for (const [cat, s] of Object.entries(g.seconds)) {
    if (s <= 0) continue;
    const w = (s / g.wall_s) * W;
    const r = svgEl("rect", { x, y: 0, width: Math.max(w, 0.5), height: H, fill: CATEGORY_COLORS[cat] || "#888",
      "data-category": cat });
    r.append(svgEl("title", {}, `${cat}: ${secs(s)} (${((s / g.wall_s) * 100).toFixed(1)} %)`));
    svg.append(r);
    x += w;
    const item = el("span", { class: "legend-item", "data-category": cat, "data-seconds": s.toFixed(3) });
    item.append(el("i", { style: `background:${CATEGORY_COLORS[cat] || "#888"}` }),
      document.createTextNode(`${cat.replaceAll("_", " ")} ${secs(s)} · ${((s / g.wall_s) * 100).toFixed(1)} %`));
    legend.append(item);
  }
}

function drawTimeline(t) {
  const svg = $("timeline-chart");
  svg.replaceChildren();
  const W = Math.max(svg.clientWidth || 940, 600), L = 96, R = 10, rowH = 22;  // drawn at its size: text unscaled
  const gens = t.generations, entries = t.entries;
  const recoveries = groupRecoveries(entries).slice(-MAX_WATERFALLS);
  const top = 10 + rowH * 2 + 24;
  const H = top + recoveries.reduce((h, r) => h + 26 + r.phases.length * 18, 0) + 6;
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  const t0 = t.start, t1 = Math.max(t.end, t0 + 1);
  const sx = (v) => L + ((Math.min(Math.max(v, t0), t1) - t0) / (t1 - t0)) * (W - L - R);
  svg.append(svgEl("text", { x: 4, y: 24, class: "row-label" }, "generations"));
  svg.append(svgEl("text", { x: 4, y: 24 + rowH, class: "row-label" }, "recoveries"));
  for (const g of gens) {
    const end = g.end ?? t.end, x = sx(g.start);
    const r = svgEl("rect", { x, y: 10, width: Math.max(sx(end) - x, 1), height: rowH - 6, rx: 3,
      fill: OUTCOME_COLORS[g.outcome] || "#c0392b", "data-generation": g.generation, "data-outcome": g.outcome || "running" });
    r.append(svgEl("title", {}, `generation ${g.generation}: ${g.outcome || "running"} ${g.reason || ""}`));
    svg.append(r);
    svg.append(svgEl("text", { x: x + 4, y: 23, class: "bar-label" }, `gen ${g.generation}`));
  }
  for (const e of entries) {
    const x = sx(e.start), y = 10 + rowH;
    let shape;
    if (e.kind === "fault") {
      shape = svgEl("path", { d: `M${x},${y} l6,8 l-6,8 l-6,-8 z`, fill: PHASE_COLORS.fault });
      svg.append(svgEl("line", { x1: x, x2: x, y1: 8, y2: y + 18, stroke: PHASE_COLORS.fault, "stroke-dasharray": "3 2" }));
    } else {
      shape = svgEl("rect", { x, y: y + 2, width: Math.max(sx(e.start + e.seconds) - x, 2), height: rowH - 8,
        fill: PHASE_COLORS[e.kind] || "#888" });
    }
    shape.setAttribute("data-kind", e.kind);
    shape.append(svgEl("title", {}, `${e.kind}: ${secs(e.seconds)} ${e.detail || ""}`));
    svg.append(shape);
  }
  for (const m of t.marks || []) {  // stragglers flagged: a marker on the recoveries row
    const x = sx(m.start), y = 10 + rowH;
    const mark = svgEl("path", { d: `M${x - 5},${y + 14} l5,-10 l5,10 z`, fill: PHASE_COLORS.straggler, "data-kind": "straggler" });
    mark.append(svgEl("title", {}, m.detail || "straggler"));
    svg.append(mark);
  }
  for (const frac of [0, 0.25, 0.5, 0.75, 1]) {
    const v = t0 + (t1 - t0) * frac;
    svg.append(svgEl("text", { x: sx(v), y: top - 4, "text-anchor": frac === 0 ? "start" : frac === 1 ? "end" : "middle",
      class: "tick" }, `+${secs(v - t0)}`));
  }
  let y = top;
  for (const r of recoveries) y = drawWaterfall(svg, r, y, W, L, t0);
  drawTimelineTable(t, gens, entries.concat(t.marks || []));
}

// each recovery's phases, zoomed: from the fault to the end of the first step, one bar per phase
function groupRecoveries(entries) {
  const byGen = new Map();
  for (const e of entries) {
    const key = `${e.after}`;
    if (!byGen.has(key)) byGen.set(key, { after: e.after, generation: e.generation, fault: null, phases: [] });
    const r = byGen.get(key);
    if (e.kind === "fault") r.fault = e; else r.phases.push(e);
  }
  return [...byGen.values()].filter((r) => r.fault);
}

function drawWaterfall(svg, r, y, W, L, t0) {
  const a = r.fault.start;
  const b = Math.max(a + 0.5, ...r.phases.map((p) => p.start + p.seconds));
  const scale = (v) => L + ((v - a) / (b - a)) * (W - L - 320);  // room on the right for the labels
  const total = b - a;
  svg.append(svgEl("line", { x1: 4, x2: W - 4, y1: y + 4, y2: y + 4, class: "grid" }));
  svg.append(svgEl("text", { x: 4, y: y + 18, class: "waterfall-title", "data-recovery": r.generation ?? "" },
    `recovery ${r.generation ? `→ generation ${r.generation}` : `after generation ${r.after}`}: ` +
    `fault at +${secs(a - t0)}, ${secs(total)} to the end of the first step`));
  svg.append(svgEl("line", { x1: scale(a), x2: scale(a), y1: y + 22, y2: y + 24 + r.phases.length * 18,
    stroke: PHASE_COLORS.fault, "stroke-width": 2 }));
  y += 26;
  for (const p of r.phases) {
    svg.append(svgEl("text", { x: L - 8, y: y + 11, "text-anchor": "end", class: "row-label" }, p.kind.replace("_", " ")));
    const x = scale(p.start), w = Math.max(scale(p.start + p.seconds) - x, 2);
    const bar = svgEl("rect", { x, y: y + 2, width: w, height: 12, rx: 2, fill: PHASE_COLORS[p.kind] || "#888",
      "data-kind": p.kind, "data-seconds": p.seconds.toFixed(3) });
    bar.append(svgEl("title", {}, `${p.kind}: ${secs(p.seconds)} ${p.detail || ""}`));
    svg.append(bar);
    svg.append(svgEl("text", { x: x + w + 6, y: y + 12, class: "phase-label" }, `${secs(p.seconds)}  ${p.detail || ""}`));
    y += 18;
  }
  return y;
}

function drawTimelineTable(t, gens, entries) {
  const body = $("timeline").querySelector("tbody");
  body.replaceChildren();
  const rows = gens.map((g) => ({ start: g.start, generation: g.generation, kind: "generation",
    seconds: (g.end ?? t.end) - g.start, detail: `${g.outcome || "running"} on ${g.nodes.join(", ")}` +
      (g.reason ? ` — ${g.reason}` : "") }))
    .concat(entries.map((e) => ({ ...e, generation: e.generation ?? e.after })));
  rows.sort((a, b) => a.start - b.start);
  for (const r of rows) {
    const tr = el("tr", { "data-kind": r.kind, "data-generation": r.generation, "data-seconds": r.seconds.toFixed(3) });
    const what = el("td", {}); what.append(el("span", { class: `kind ${r.kind}` }, r.kind.replace("_", " ")));
    tr.append(el("td", {}, `+${secs(r.start - t.start)}`), el("td", {}, String(r.generation ?? "–")), what,
      el("td", {}, r.kind === "fault" ? "–" : secs(r.seconds)), el("td", { class: "detail" }, r.detail || ""));
    body.append(tr);
  }
}

refresh();
