/* The node's live dashboard: polls this node's JSON API every 2 s and draws the swarm map, the loss
   curves, tokens/s, buffer fill, DiLoCo rounds, backups and recent events.

   The token: a node started with --api-token answers its data only to "Authorization: Bearer TOKEN".
   Open the page as /#token=TOKEN (the fragment never leaves the browser); the page keeps it for the
   tab (sessionStorage), takes it off the address bar, and sends it with every request.
   Everything a peer sent us (peer ids, addresses) is shown as text, never parsed as HTML. */
"use strict";

const POLL_MS = 2000;
const MAX_POINTS = 1800; // an hour of 2 s samples per chart
const MAX_EVENTS = 200;
const TOKEN_KEY = "p2pswarm-api-token";

const series = { t: [], train: [], rate: [], inFill: [], outFill: [] };
const charts = {};
let previous = null;

function apiToken() {
  const match = location.hash.match(/token=([^&]+)/);
  if (match) {
    sessionStorage.setItem(TOKEN_KEY, decodeURIComponent(match[1]));
    history.replaceState(null, "", location.pathname + location.search);
  }
  return sessionStorage.getItem(TOKEN_KEY);
}

class Unauthorized extends Error {}

async function get(path) {
  const token = apiToken();
  const response = await fetch(path, { headers: token ? { Authorization: "Bearer " + token } : {}, cache: "no-store" });
  if (response.status === 401) throw new Unauthorized();
  return response.ok ? response.json() : null; // 404: this role has no such part (a bootstrap node trains nothing)
}

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, value);
  for (const child of children) node.append(child instanceof Node ? child : String(child ?? ""));
  return node;
}

function short(peer) { return peer ? peer.slice(0, 4) + "…" + peer.slice(-6) : "?"; }
function fmt(value, digits = 3) { return value == null || Number.isNaN(value) ? "–" : Number(value).toFixed(digits); }
function mb(bytes) { return (bytes / 1e6).toFixed(1) + " MB"; }

function chart(id, label, names, xTime = true) {
  if (charts[id]) return charts[id];
  const box = document.getElementById(id);
  const colours = ["#2b6cb0", "#c05621", "#2f855a"];
  const opts = {
    width: Math.max(240, box.clientWidth), height: 180, legend: { live: false },
    scales: { x: { time: xTime } }, axes: [{}, { label, size: 50 }],
    series: [{}, ...names.map((name, i) => ({ label: name, stroke: colours[i], width: 2, points: { show: !xTime } }))],
  };
  charts[id] = new uPlot(opts, [[], ...names.map(() => [])], box);
  return charts[id];
}

function draw(id, label, names, data, xTime = true) {
  chart(id, label, names, xTime).setData(data);
  document.getElementById(id).dataset.points = String(data[1].filter((y) => y != null).length); // (tests read it)
}

function push(key, value) {
  series[key].push(value ?? null);
  if (series[key].length > MAX_POINTS) series[key].shift();
}

function pathBadge(peer, self, paths) {
  if (peer === self) return el("span", { class: "badge self" }, "this node");
  const kind = paths[peer];
  return el("span", { class: "badge " + (kind || "none") }, kind || "not connected");
}

function drawMap(stages, stats) {
  const box = document.getElementById("map");
  if (!stages || !stages.stages) return;
  const paths = stats.paths || {};
  const cards = Object.entries(stages.stages).sort((a, b) => Number(a[0]) - Number(b[0])).map(([stage, doc]) => {
    const rows = (doc.peers || []).map((p) => el("tr", { class: "peer-row", "data-peer": p.peer_id },
      el("td", { class: "peer", title: p.peer_id }, short(p.peer_id)), el("td", {}, pathBadge(p.peer_id, stats.peer_id, paths)),
      el("td", {}, `${fmt(p.throughput, 0)} tok/s, queue ${p.queue_depth ?? "–"}, round ${p.outer_round ?? "–"}` +
        (p.train_loss_bpb != null ? `, loss ${fmt(p.train_loss_bpb)}` : ""))));
    const health = doc.health || "unknown";
    return el("div", { class: "stage", "data-stage": stage },
      el("h3", {}, `stage ${stage}: layers ${doc.start}–${doc.end}`, el("span", { class: "badge " + health }, health),
        el("span", { class: "muted" }, `${(doc.peers || []).length} peer(s), ${(doc.backups || []).length} backup(s)`)),
      el("table", {}, el("tbody", {}, ...rows)));
  });
  box.replaceChildren(el("p", { class: "muted" }, `${stages.model} in ${stages.n_stages} stage(s), run ${stages.run}`),
    el("div", { class: "stages" }, ...cards));
}

function drawBackups(backups) {
  const box = document.getElementById("backups");
  if (!backups) { box.replaceChildren(el("p", { class: "muted" }, "this node holds no backups")); return; }
  const rows = (backups.held || []).map((h) => el("tr", {}, el("td", {}, "stage " + h.stage),
    el("td", {}, "round " + h.round), el("td", {}, mb(h.bytes || 0)), el("td", { class: "peer" }, short(h.from))));
  box.replaceChildren(el("table", {}, el("tbody", {}, ...rows)),
    el("p", { class: "figure" }, `${mb(backups.held_bytes || 0)} held of ${mb(backups.budget_bytes || 0)}, ` +
      `${mb(backups.bytes_served || 0)} served, ${(backups.recent_refusals || []).length} recent refusal(s)`));
}

function addEvent(text) {
  const list = document.getElementById("events");
  list.prepend(el("li", {}, el("time", {}, new Date().toLocaleTimeString()), text));
  while (list.children.length > MAX_EVENTS) list.lastChild.remove();
}

function num(doc, ...keys) {
  let value = doc;
  for (const key of keys) value = value && typeof value === "object" ? value[key] : undefined;
  return typeof value === "number" ? value : 0;
}

function refusals(now) {
  return num(now.stats, "inbound_connections", "refused") + num(now.stats, "pool", "inbound_refused") +
    num(now.stats, "pool", "circuit_refusals") + Object.values((now.backups || {}).refused || {}).reduce((a, b) => a + b, 0);
}

function noteEvents(now) {
  if (!previous) { addEvent(`watching ${now.stats.role} node ${short(now.stats.peer_id)}`); return; }
  const before = new Set(previous.stats.connected_peers || []), after = new Set(now.stats.connected_peers || []);
  for (const p of after) if (!before.has(p)) addEvent(`connected to ${short(p)} (${(now.stats.paths || {})[p] || "?"})`);
  for (const p of before) if (!after.has(p)) addEvent(`disconnected from ${short(p)}`);
  const counted = [[["swarm", "router", "failovers"], "failover(s) to another replica"],
    [["swarm", "delivery", "lost"], "micro-batch(es) lost"], [["stats", "rebalance", "moves"], "move(s) to another stage"]];
  for (const [[part, ...keys], what] of counted) {
    const delta = num(now[part], ...keys) - num(previous[part], ...keys);
    if (delta > 0) addEvent(`${delta} ${what}`);
  }
  const refused = refusals(now) - refusals(previous);
  if (refused > 0) addEvent(`${refused} refusal(s) (connections, streams, circuits, backups)`);
  if (now.stats.stage !== previous.stats.stage) addEvent(`now serving stage ${now.stats.stage}`);
  const last = (now.diloco || {}).last_round;
  if (last && last.round !== ((previous.diloco || {}).last_round || {}).round) {
    addEvent(`outer round ${last.round} done: ${(last.members || []).length} member(s), ${mb(last.bytes_sent || 0)} sent, ${fmt(last.seconds, 2)} s`);
  }
  const healthBefore = ((previous.stages || {}).health || {}).stages || {};
  for (const [stage, health] of Object.entries(((now.stages || {}).health || {}).stages || {})) {
    if (healthBefore[stage] && healthBefore[stage] !== health) addEvent(`stage ${stage} is ${health}`);
  }
}

const heldoutSeen = new Map(); // outer round -> held-out bpb, from the last stage's records (a node of another stage)

function lastStagePeers(stages) {
  const all = Object.entries((stages || {}).stages || {});
  return all.length ? (all.find(([s]) => Number(s) === stages.n_stages - 1) || [null, {}])[1].peers || [] : [];
}

function mean(values) {
  const known = values.filter((v) => v != null);
  return known.length ? known.reduce((a, b) => a + b, 0) / known.length : null;
}

/* The loss is computed by the last stage. There, this node's own figures; on another stage, what the last
   stage's peers report in their signed stage records (shown only: nothing here decides anything by it). */
function losses(now) {
  const swarm = now.swarm || {};
  if (swarm.last || swarm.train_loss_bpb != null) {
    const rounds = swarm.heldout_by_round || [];
    return { train: swarm.train_loss_bpb, rounds: rounds.map((h) => h.outer_round), heldout: rounds.map((h) => h.bpb), from: "this node" };
  }
  const peers = lastStagePeers(now.stages);
  for (const p of peers) if (p.heldout_bpb != null && !heldoutSeen.has(p.outer_round)) heldoutSeen.set(p.outer_round, p.heldout_bpb);
  const rounds = [...heldoutSeen.keys()].sort((a, b) => a - b);
  return { train: mean(peers.map((p) => p.train_loss_bpb)), rounds, heldout: rounds.map((r) => heldoutSeen.get(r)),
    from: "the last stage's records" };
}

function drawCharts(now) {
  const swarm = now.swarm || {};
  const loss = losses(now);
  push("t", Date.now() / 1000);
  push("train", loss.train);
  push("rate", swarm.tokens_per_s);
  const fill = (q) => (q && q.capacity ? q.items / q.capacity : null);
  push("inFill", fill(swarm.inbound));
  push("outFill", fill(swarm.outbound));
  draw("loss-chart", "bits per byte", ["train loss"], [series.t, series.train]);
  document.getElementById("loss-figure").textContent = `train ${fmt(loss.train)} bpb (${loss.from}), step ${swarm.step ?? "–"}`;
  draw("heldout-chart", "bits per byte", ["held-out"], [loss.rounds, loss.heldout], false);
  const n = loss.rounds.length;
  document.getElementById("heldout-figure").textContent = n
    ? `outer round ${loss.rounds[n - 1]}: ${fmt(loss.heldout[n - 1])} bpb (${loss.from})` : "no held-out score yet";
  draw("rate-chart", "tokens/s", ["tokens/s"], [series.t, series.rate]);
  document.getElementById("rate-figure").textContent = `${fmt(swarm.tokens_per_s, 0)} tok/s, ${swarm.tokens ?? 0} tokens trained`;
  draw("fill-chart", "fill", ["inbound", "outbound"], [series.t, series.inFill, series.outFill]);
  document.getElementById("fill-figure").textContent = swarm.inbound
    ? `inbound ${swarm.inbound.items}/${swarm.inbound.capacity}, outbound ${swarm.outbound.items}/${swarm.outbound.capacity}` : "";
  const rounds = (now.diloco || {}).rounds || [];
  draw("rounds-chart", "MB", ["sent", "received"], [rounds.map((r) => r.round),
    rounds.map((r) => (r.bytes_sent || 0) / 1e6), rounds.map((r) => (r.bytes_received || 0) / 1e6)], false);
  const d = now.diloco;
  document.getElementById("rounds-figure").textContent = d
    ? `outer round ${d.outer_round}, ${d.phase}; ${mb(d.bytes_sent || 0)} sent, ${mb(d.bytes_received || 0)} received in all` : "";
}

async function poll() {
  const problem = document.getElementById("problem");
  try {
    const [stats, stages, swarm, diloco, backups] = await Promise.all(
      ["/api/stats", "/api/stages", "/api/swarm", "/api/diloco", "/api/backups"].map(get));
    const now = { stats: stats || {}, stages, swarm, diloco, backups };
    document.getElementById("node").textContent =
      `${now.stats.role || "?"} ${short(now.stats.peer_id)}` + (now.stats.stage != null ? `, stage ${now.stats.stage}` : "") +
      `, ${(now.stats.connected_peers || []).length} connected, up ${fmt(now.stats.uptime_s, 0)} s`;
    drawMap(stages, now.stats);
    drawCharts(now);
    drawBackups(backups);
    noteEvents(now);
    previous = now;
    problem.hidden = true;
    document.getElementById("updated").textContent = "updated " + new Date().toLocaleTimeString();
  } catch (error) {
    problem.hidden = false;
    problem.textContent = error instanceof Unauthorized
      ? "This node needs its API token: open this page as /#token=YOUR_TOKEN (the node's --api-token)."
      : `The node does not answer (${error.message}); trying again every ${POLL_MS / 1000} s.`;
  }
}

window.addEventListener("resize", () => {
  for (const [id, c] of Object.entries(charts)) c.setSize({ width: Math.max(240, document.getElementById(id).clientWidth), height: 180 });
});
poll();
setInterval(poll, POLL_MS);
