// The model browser: reads the server's JSON API (same origin, the caller's token) and draws
// everything itself. No framework and no build step, so it ships as is and loads offline.
"use strict";

const TOKEN_KEY = "weightserve.token";
const TREE_PAGE = 500; // rows rendered at once in one group or a filtered list
const MAX_BARS = 48;
const SVG_NS = "http://www.w3.org/2000/svg";

const $ = (selector) => document.querySelector(selector);

/** An element with attributes (on*: listeners) and children (strings become text). */
function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === null || value === undefined || value === false) continue;
    if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value === true ? "" : value);
  }
  node.append(...children.filter((c) => c !== null && c !== undefined));
  return node;
}

function svg(tag, attrs = {}, ...children) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
  node.append(...children);
  return node;
}

function formatBytes(n) {
  const units = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (n >= 1000 && i < units.length - 1) { n /= 1000; i++; }
  return `${i ? n.toFixed(n < 10 ? 2 : 1) : n} ${units[i]}`;
}

function formatNumber(x) {
  if (x === null || x === undefined) return "–";
  if (x === 0 || (Math.abs(x) >= 1e-3 && Math.abs(x) < 1e6)) return String(Number(x.toPrecision(6)));
  return x.toExponential(4);
}

const shapeText = (shape) => `[${shape.join(", ")}]`;
// Model ids and tensor names may hold "/": encode each part, keep the separators.
const pathParts = (text) => text.split("/").map(encodeURIComponent).join("/");
const modelPath = (id) => `v1/models/${pathParts(id)}`;

class AuthRequired extends Error {}

function status(text, isError = false) {
  const node = $("#status");
  node.textContent = text;
  node.className = isError ? "error" : "muted";
}

/** GET a JSON route of this server with the stored token; 401 raises AuthRequired. */
async function api(path) {
  const token = sessionStorage.getItem(TOKEN_KEY);
  const headers = token ? { Authorization: `Bearer ${token}` } : {};
  const response = await fetch(path, { headers });
  if (response.ok) return response.json();
  let message = `${response.status} ${response.statusText}`;
  try {
    const body = await response.json();
    if (body.error) message = `${body.error.type}: ${body.error.message}`;
  } catch (_) { /* not our error format */ }
  if (response.status === 401) throw new AuthRequired(message);
  throw new Error(message);
}

// ------------------------------------------------------------------------------ the views

const views = ["#auth", "#models-view", "#model-view"];
function show(view) {
  for (const v of views) $(v).hidden = v !== view;
  $("#token-button").hidden = !sessionStorage.getItem(TOKEN_KEY);
}

function askForToken(message) {
  show("#auth");
  $("#auth-error").textContent = sessionStorage.getItem(TOKEN_KEY) ? message : "";
  $("#token-input").focus();
}

async function route() {
  const params = new URLSearchParams(location.hash.slice(1));
  try {
    if (params.has("m")) await showModel(params.get("m"), params.get("t"));
    else await showModels();
  } catch (error) {
    if (error instanceof AuthRequired) askForToken(error.message);
    else status(error.message, true);
  }
}

// ------------------------------------------------------------------------------ model list

let modelList = [];

async function showModels() {
  status("Loading models…");
  const listing = await api("v1/models");
  modelList = listing.models;
  renderModels();
  const problems = $("#problems");
  problems.replaceChildren();
  if (listing.problems.length) {
    problems.append(el("h3", {}, "Refused models"), el("ul", {},
      ...listing.problems.map((p) => el("li", {}, el("code", {}, p.model), `: ${p.reason}`))));
  }
  show("#models-view");
  status("");
  document.title = "weightserve";
}

function renderModels() {
  const words = $("#model-filter").value.toLowerCase().split(/\s+/).filter(Boolean);
  const shown = modelList.filter((m) =>
    words.every((w) => `${m.id} ${m.format}`.toLowerCase().includes(w)));
  $("#models tbody").replaceChildren(...shown.map((m) => el("tr", { "data-model": m.id },
    el("td", {}, el("a", { href: `#m=${encodeURIComponent(m.id)}`, class: "model-link" }, m.id)),
    el("td", {}, m.format),
    el("td", { class: "num", title: `${m.total_bytes} bytes` }, formatBytes(m.total_bytes)),
    el("td", { class: "num" }, String(m.tensor_count)),
    el("td", {}, el("code", {}, m.revision)),
    el("td", {}, m.state || m.cache_state || "served"),
  )));
  $("#model-count").textContent = `${shown.length} of ${modelList.length}`;
}

// ------------------------------------------------------------------------------ one model

let current = null; // {info, tree, byName}

async function showModel(id, tensorName) {
  if (!current || current.info.id !== id) {
    status(`Loading ${id}…`);
    const info = await api(modelPath(id));
    current = { info, tree: buildTree(info.tensors), byName: new Map() };
    for (const t of info.tensors) current.byName.set(t.name, t);
    renderModel();
  }
  show("#model-view");
  status("");
  if (tensorName && current.byName.has(tensorName)) await selectTensor(tensorName);
}

function renderModel() {
  const { info } = current;
  document.title = `${info.id} · weightserve`;
  $("#model-title").textContent = info.id;
  $("#model-facts").replaceChildren(...facts([
    ["Format", info.format],
    ["Revision", el("code", { id: "model-revision" }, info.revision)],
    ["Size", `${formatBytes(info.total_bytes)} (${info.total_bytes} bytes)`],
    ["Tensors", el("span", { id: "model-tensor-count" }, String(info.tensor_count))],
    info.files ? ["Files", info.files.map((f) => f.name || f).join(", ")] : null,
  ]));
  $("#tensor-filter").value = "";
  $("#snippet-prefix").value = "";
  $("#tensor-detail").hidden = true;
  renderTree();
  renderBytesChart();
  renderSnippets();
  renderMetadata(info.metadata);
}

function facts(rows) {
  return rows.filter(Boolean).map(([key, value]) => el("div", {}, el("dt", {}, key), el("dd", {}, value)));
}

// A tree of name prefixes split at ".": model.layers.0.attn.weight lives in model. > layers. >
// 0. > attn.; a chain of groups with one child each folds into one row (model.layers.).
function buildTree(tensors) {
  const root = { label: "", prefix: "", groups: new Map(), tensors: [], count: 0, bytes: 0 };
  for (const t of tensors) {
    const parts = t.name.split(".");
    let node = root;
    node.count++; node.bytes += t.nbytes;
    for (const part of parts.slice(0, -1)) {
      const prefix = `${node.prefix}${part}.`;
      let child = node.groups.get(part);
      if (!child) {
        child = { label: `${part}.`, prefix, groups: new Map(), tensors: [], count: 0, bytes: 0 };
        node.groups.set(part, child);
      }
      node = child;
      node.count++; node.bytes += t.nbytes;
    }
    node.tensors.push(t);
  }
  const fold = (node) => {
    for (const [key, child] of node.groups) {
      while (child.tensors.length === 0 && child.groups.size === 1) {
        const only = child.groups.values().next().value;
        child.label += only.label; child.prefix = only.prefix; child.groups = only.groups;
        child.tensors = only.tensors;
      }
      if (child.groups.size === 0 && child.tensors.length === 1) { // a group of one: the tensor
        node.groups.delete(key);
        node.tensors.push(child.tensors[0]);
      } else {
        fold(child);
      }
    }
  };
  fold(root);
  return root;
}

const naturalOrder = new Intl.Collator(undefined, { numeric: true }).compare;

function renderTree() {
  const tree = $("#tree");
  const words = $("#tensor-filter").value.trim().toLowerCase();
  if (words) {
    const matches = current.info.tensors.filter((t) => t.name.toLowerCase().includes(words));
    tree.replaceChildren(el("p", { class: "muted" }, `${matches.length} matching tensors`));
    appendPaged(tree, matches, (t) => tensorRow(t, t.name));
  } else {
    tree.replaceChildren(...groupChildren(current.tree));
  }
}

function groupChildren(node) {
  const groups = [...node.groups.values()].sort((a, b) => naturalOrder(a.label, b.label));
  const rows = groups.map(groupRow);
  const holder = el("div");
  appendPaged(holder, node.tensors, (t) => tensorRow(t, t.name.slice(node.prefix.length)));
  return [...rows, ...holder.childNodes];
}

function groupRow(group) {
  const children = el("div", { class: "children" });
  const details = el("details", { "data-prefix": group.prefix },
    el("summary", {},
      el("span", { class: "group mono" }, group.label),
      el("span", { class: "meta" }, `${group.count} tensors · ${formatBytes(group.bytes)}`)),
    children);
  details.addEventListener("toggle", () => {
    if (!details.open) return;
    if (!children.hasChildNodes()) children.append(...groupChildren(group)); // only when opened
    $("#snippet-prefix").value = group.prefix;
    renderSnippets();
  });
  return details;
}

/** Append rows for items, TREE_PAGE at a time, with a button for the rest. */
function appendPaged(parent, items, render, start = 0) {
  const end = Math.min(items.length, start + TREE_PAGE);
  for (let i = start; i < end; i++) parent.append(render(items[i]));
  if (end < items.length) {
    const more = el("button", { type: "button", class: "more link" }, `Show ${items.length - end} more`);
    more.addEventListener("click", () => { more.remove(); appendPaged(parent, items, render, end); });
    parent.append(more);
  }
}

function tensorRow(t, label) {
  return el("button", {
    type: "button", class: "tensor mono", "data-name": t.name, "aria-pressed": "false",
    title: t.name, onclick: () => { location.hash = `m=${encodeURIComponent(current.info.id)}&t=${encodeURIComponent(t.name)}`; },
  },
  el("span", {}, label),
  el("span", {}, t.dtype),
  el("span", {}, shapeText(t.logical_shape)),
  el("span", {}, t.encoding || ""),
  el("span", { class: "bytes" }, formatBytes(t.nbytes)));
}

async function selectTensor(name) {
  const t = current.byName.get(name);
  for (const row of document.querySelectorAll(".tensor[aria-pressed=true]")) row.setAttribute("aria-pressed", "false");
  for (const row of document.querySelectorAll(".tensor")) {
    if (row.dataset.name === name) row.setAttribute("aria-pressed", "true");
  }
  $("#tensor-detail").hidden = false;
  $("#tensor-title").textContent = t.name;
  $("#tensor-facts").replaceChildren(...facts([
    ["dtype", el("span", { id: "tensor-dtype" }, t.dtype)],
    ["shape", el("span", { id: "tensor-shape" }, shapeText(t.logical_shape))],
    t.encoding ? ["quantization", el("span", { id: "tensor-encoding" }, t.encoding)] : null,
    t.encoding ? ["served as", `${t.dtype} ${shapeText(t.shape)}`] : null,
    ["bytes", `${formatBytes(t.nbytes)} (${t.nbytes})`],
  ]));
  const statsBox = $("#stats");
  statsBox.replaceChildren(el("p", { class: "muted" }, "Computing statistics…"));
  const stats = await api(`${modelPath(current.info.id)}/-/stats/${pathParts(name)}`);
  if (current.byName.get(name) !== t) return; // another model was opened meanwhile
  statsBox.replaceChildren(
    el("dl", { class: "facts", id: "stats-facts" }, ...facts([
      ["values", stats.values],
      ["sampled", `${stats.sampled} of ${stats.count}`],
      ["min", formatNumber(stats.min)], ["max", formatNumber(stats.max)],
      ["mean", formatNumber(stats.mean)], ["std", formatNumber(stats.std)],
      ["NaN", el("span", { id: "stats-nan" }, String(stats.nan_count))],
      ["Inf", el("span", { id: "stats-inf" }, String(stats.inf_count))],
    ])),
    histogramChart(stats.histogram));
}

// ------------------------------------------------------------------------------ charts

function histogramChart({ edges, counts }) {
  if (!counts.length) return el("p", { class: "muted" }, "No finite values to draw.");
  const width = 440, height = 150, pad = 22;
  const top = Math.max(...counts, 1);
  const barWidth = (width - 2 * pad) / counts.length;
  const chart = svg("svg", { class: "chart", id: "histogram", viewBox: `0 0 ${width} ${height + 18}`,
    width: "100%", role: "img", "aria-label": `Histogram of ${counts.length} bins` });
  counts.forEach((count, i) => {
    const h = (count / top) * (height - pad);
    chart.append(svg("rect", {
      class: "bar", x: pad + i * barWidth, y: height - h, width: Math.max(barWidth - 1, 1), height: h,
      "data-count": count,
    }, svg("title", {}, `${formatNumber(edges[i])} … ${formatNumber(edges[i + 1])}: ${count}`)));
  });
  chart.append(
    svg("line", { class: "axis", x1: pad, x2: width - pad, y1: height, y2: height }),
    svg("text", { x: pad, y: height + 14 }, formatNumber(edges[0])),
    svg("text", { x: width - pad, y: height + 14, "text-anchor": "end" }, formatNumber(edges[edges.length - 1])),
    svg("text", { x: pad, y: 10 }, `max ${top}`));
  return chart;
}

// Bytes per layer where names have a numbered part (model.layers.7., blk.7.), else per module.
function byteGroups(tensors) {
  const sums = new Map();
  for (const t of tensors) {
    const parts = t.name.split(".");
    const numbered = parts.findIndex((p) => /^\d+$/.test(p));
    const key = numbered >= 0 ? parts.slice(0, numbered + 1).join(".")
      : parts.length > 1 ? parts.slice(0, -1).join(".") : t.name;
    sums.set(key, (sums.get(key) || 0) + t.nbytes);
  }
  let groups = [...sums.entries()].sort((a, b) => naturalOrder(a[0], b[0])); // blk.2 before blk.10
  if (groups.length > MAX_BARS) {
    groups.sort((a, b) => b[1] - a[1]);
    const rest = groups.slice(MAX_BARS - 1).reduce((sum, [, n]) => sum + n, 0);
    groups = [...groups.slice(0, MAX_BARS - 1), [`${groups.length - MAX_BARS + 1} others`, rest]];
  }
  return groups;
}

function renderBytesChart() {
  const groups = byteGroups(current.info.tensors);
  const row = 17, labelWidth = 190, width = 460;
  const top = Math.max(1, ...groups.map(([, n]) => n));
  const chart = svg("svg", { class: "chart", id: "bytes-svg", viewBox: `0 0 ${width} ${groups.length * row + 4}`,
    width: "100%", role: "img", "aria-label": "Bytes per group" });
  groups.forEach(([name, n], i) => {
    const y = i * row + 2;
    const w = Math.max(1, (n / top) * (width - labelWidth - 70));
    const shortName = name.length > 30 ? `…${name.slice(-29)}` : name;
    chart.append(
      svg("text", { x: labelWidth - 6, y: y + 12, "text-anchor": "end" }, shortName),
      svg("rect", { class: "bar", x: labelWidth, y, width: w, height: row - 4, "data-bytes": n },
        svg("title", {}, `${name}: ${formatBytes(n)}`)),
      svg("text", { x: labelWidth + w + 4, y: y + 12 }, formatBytes(n)));
  });
  $("#bytes-chart").replaceChildren(chart);
}

// ------------------------------------------------------------------------------ snippets

function renderSnippets() {
  const origin = new URL(".", location.href).href.replace(/\/$/, "");
  const id = current.info.id;
  const url = `${origin}/${modelPath(id)}`;
  const prefix = $("#snippet-prefix").value;
  const py = JSON.stringify(prefix);
  const tokenNote = sessionStorage.getItem(TOKEN_KEY)
    ? "# the clients read the token from WEIGHTSERVE_TOKEN\n" : "";
  const auth = sessionStorage.getItem(TOKEN_KEY) ? ' -H "Authorization: Bearer $WEIGHTSERVE_TOKEN"' : "";
  const query = prefix ? `?prefix=${encodeURIComponent(prefix)}` : "";
  const snippets = [
    ["Python: arrays", `${tokenNote}from weightserve.client import Client\n\narrays = Client(${JSON.stringify(origin)}).model(${JSON.stringify(id)}).fetch(prefix=${py})`],
    ["Python: RemoteWeights (MAX Weights protocol)", `${tokenNote}from weightserve.client import RemoteWeights\n\nweights = RemoteWeights(${JSON.stringify(url)})\ndata = {name: w.data() for name, w in weights.items() if name.startswith(${py})}`],
    ["PyTorch state dict", `${tokenNote}from weightserve.client import RemoteWeights\n\nstate_dict = RemoteWeights(${JSON.stringify(url)}).torch_state_dict(${prefix ? `prefix=${py}` : ""})`],
    ["Command line", `weightserve pull ${url}${prefix ? ` --prefix ${shellQuote(prefix)}` : ""} --out ./${shellQuote(id.split("/").pop())}`],
    ["curl", `curl -s${auth} ${shellQuote(url)}   # info JSON\ncurl -s${auth} -o tensors.arrows ${shellQuote(`${url}/-/stream${query}`)}`],
  ];
  $("#snippets").replaceChildren(...snippets.flatMap(([title, code]) => {
    const pre = el("pre", {}, el("code", {}, code));
    const copy = el("button", { type: "button", class: "link", "aria-label": `Copy: ${title}` }, "Copy");
    copy.addEventListener("click", () => copyText(code, copy));
    return [el("div", { class: "snippet-head" }, el("strong", {}, title), copy), pre];
  }));
}

function shellQuote(text) {
  return /^[\w@%+=:,./-]+$/.test(text) ? text : `'${text.replace(/'/g, "'\\''")}'`;
}

async function copyText(text, button) {
  try {
    await navigator.clipboard.writeText(text);
    button.textContent = "Copied";
  } catch (_) { // no clipboard access (plain-HTTP origin that is not localhost): select instead
    const range = document.createRange();
    range.selectNodeContents(button.parentElement.nextElementSibling);
    getSelection().removeAllRanges(); getSelection().addRange(range);
    button.textContent = "Selected: press Ctrl+C";
  }
  setTimeout(() => { button.textContent = "Copy"; }, 1500);
}

// ------------------------------------------------------------------------------ metadata

const SHOWN_ITEMS = 8;
const SHOWN_CHARS = 300;

function shorten(value) {
  if (Array.isArray(value)) {
    const head = value.slice(0, SHOWN_ITEMS).map(shorten).join(", ");
    return value.length > SHOWN_ITEMS ? `[${head}, … (${value.length} items)]` : `[${head}]`;
  }
  const text = typeof value === "string" ? value : JSON.stringify(value);
  return text.length > SHOWN_CHARS ? `${text.slice(0, SHOWN_CHARS)}… (${text.length} chars)` : text;
}

function renderMetadata(metadata) {
  const entries = Object.entries(metadata || {}).filter(([key]) => key !== "gguf.value_types");
  if (!entries.length) { $("#metadata").replaceChildren(el("p", { class: "muted" }, "None.")); return; }
  $("#metadata").replaceChildren(el("table", { class: "grid" }, el("tbody", {},
    ...entries.map(([key, value]) => el("tr", {}, el("td", { class: "mono" }, key), el("td", { class: "mono" }, shorten(value)))))));
}

// ------------------------------------------------------------------------------ start

function start() {
  $("#server-address").textContent = location.host;
  $("#model-filter").addEventListener("input", renderModels);
  let pending = 0;
  $("#tensor-filter").addEventListener("input", () => {
    clearTimeout(pending);
    pending = setTimeout(renderTree, 120); // a keystroke does not re-render thousands of rows
  });
  $("#snippet-prefix").addEventListener("input", renderSnippets);
  $("#token-form").addEventListener("submit", (event) => {
    event.preventDefault();
    sessionStorage.setItem(TOKEN_KEY, $("#token-input").value.trim());
    $("#token-input").value = "";
    modelList = []; current = null;
    route();
  });
  $("#token-button").addEventListener("click", () => {
    sessionStorage.removeItem(TOKEN_KEY);
    current = null;
    askForToken("");
  });
  window.addEventListener("hashchange", route);
  route();
}

start();
