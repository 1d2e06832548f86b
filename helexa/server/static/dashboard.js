// helexa operator page: polls GET /v1/dashboard and draws it. No libraries, no network beyond this server.
"use strict";
(function () {
  const DATA_URL = "/v1/dashboard";
  const KEY_STORE = "helexa.apiKey";
  // cell character -> [state name, legend label, RGBA]
  const STATES = {
    u: ["in_use", "in use", [59, 130, 246]],
    r: ["reserved", "reserved, not yet allocated", [245, 158, 11]],
    e: ["empty", "empty", [44, 50, 61]],
    c: ["cached", "cached (evictable)", [20, 184, 166]],
    s: ["retained", "retained (agent session)", [168, 85, 247]],
  };
  const ORDER = ["u", "r", "e", "c", "s"];
  const $ = (id) => document.getElementById(id);
  const fmt = (n) => (n === null || n === undefined ? "–" : Number(n).toLocaleString("en-US"));
  const secs = (s) => {
    if (s === null || s === undefined) return "–";
    if (s < 1) return s < 0.05 ? "now" : s.toFixed(1) + " s";
    if (s < 120) return Math.round(s) + " s";
    if (s < 7200) return Math.floor(Math.round(s) / 60) + " min " + (Math.round(s) % 60) + " s";
    return (s / 3600).toFixed(1) + " h";
  };

  const state = { data: null, updates: 0, lastOk: 0, timer: null, layout: null, highlight: null, pointer: null };

  function el(tag, cls, text) {
    const node = document.createElement(tag);
    if (cls) node.className = cls;
    if (text !== undefined && text !== null) node.textContent = String(text);
    return node;
  }

  // ------------------------------------------------------------------ fetching

  function apiKey() {
    try { return sessionStorage.getItem(KEY_STORE) || ""; } catch (e) { return ""; }
  }

  async function poll() {
    clearTimeout(state.timer);
    let wait = 2000;
    try {
      const key = apiKey();
      const response = await fetch(DATA_URL, {
        cache: "no-store",
        headers: key ? { Authorization: "Bearer " + key } : {},
      });
      if (response.status === 401) {
        showLogin(key ? "That key was refused." : "");
        return; // no polling until a key is given
      }
      if (!response.ok) throw new Error("HTTP " + response.status);
      const data = await response.json();
      hideLogin();
      render(data);
      wait = Math.max(250, data.poll_ms || 500);
    } catch (err) {
      $("updated").textContent = "no answer from the server (" + err.message + "); retrying";
      $("updated").classList.add("stale");
    }
    state.timer = setTimeout(poll, wait);
  }

  function showLogin(message) {
    $("login").hidden = false;
    $("main").hidden = true;
    $("login-error").textContent = message;
    $("updated").textContent = "needs the API key";
    $("key").focus();
  }

  function hideLogin() {
    $("login").hidden = true;
    $("main").hidden = false;
    $("forget").hidden = !apiKey();
  }

  // ------------------------------------------------------------------ rendering

  function render(data) {
    state.data = data;
    state.updates += 1;
    state.lastOk = Date.now();
    renderHeader(data);
    renderTotals(data.admission);
    drawMap(data.blocks, data.admission);
    renderQueue(data.queue, data.admission);
    renderRunning(data.running, data.admission);
    renderRejections(data.rejections, data.admission);
    renderSparks(data.series);
    const updated = $("updated");
    updated.textContent = "updated " + new Date(data.time * 1000).toLocaleTimeString() + " · every " +
      (data.poll_ms / 1000) + " s";
    updated.classList.remove("stale");
    updated.dataset.updates = String(state.updates);
    document.body.dataset.updates = String(state.updates);
  }

  function renderHeader(data) {
    const m = data.model;
    const parts = [m.name, m.device, m.dtype];
    if (m.kv_cache_dtype && m.kv_cache_dtype !== "auto") parts.push("kv " + m.kv_cache_dtype);
    if (m.quantization && !["none", "auto"].includes(m.quantization)) parts.push(m.quantization);
    parts.push("max_model_len " + fmt(m.max_model_len));
    parts.push(data.admission.policy + " policy");
    $("model-line").textContent = parts.join(" · ");
    const shown = m.draining ? "draining" : m.state;
    const badge = $("state");
    badge.dataset.state = shown;
    badge.textContent = shown === "reloading" && m.reload_seconds_left !== null
      ? "reloading (~" + secs(m.reload_seconds_left) + ")" : shown;
    const fault = $("fault");
    fault.hidden = !m.fault_cause;
    fault.textContent = m.fault_cause ? "model poisoned: " + m.fault_cause : "";
    const faults = m.device_faults ? " · device faults " + m.device_faults + ", reloads " + m.model_reloads : "";
    $("budget").textContent = (m.budget || "kv budget: (not loaded)") + faults;
    const notice = $("notice");
    notice.hidden = data.blocks.exact;
    notice.textContent = data.blocks.exact ? "" :
      "The block map was read a moment after the totals (the engine moved between the two reads).";
  }

  const TOTALS = [
    ["pool"],
    ["blocks_total", "blocks total"],
    ["blocks_empty", "empty"],
    ["blocks_cached", "cached (evictable)"],
    ["blocks_retained", "of which retained"],
    ["blocks_in_use", "in use"],
    ["blocks_orphaned", "in use, owner gone (shared)"],
    ["admission"],
    ["blocks_reserved", "reserved"],
    ["blocks_available", "available (total − reserved)"],
    ["in_flight", "in flight", "max_in_flight"],
    ["queue_depth", "queued", "max_queue_depth"],
    ["admitted_total", "admitted"],
    ["admitted_after_wait", "admitted after waiting"],
    ["preemptions", "preemptions"],
    ["tiers below the pool", undefined, undefined, "any"],
    ["blocks_host", "host memory: blocks", undefined, "host"],
    ["kv_tiers.host.loads", "host: loaded / written", "kv_tiers.host.writes", "host"],
    ["kv_tiers.host.drops", "host: dropped / failed", "kv_tiers.host.failures", "host"],
    ["blocks_disk", "disk: blocks", undefined, "disk"],
    ["kv_tiers.disk.loads", "disk: loaded / written", "kv_tiers.disk.writes", "disk"],
    ["kv_tiers.disk.drops", "disk: dropped / failed", "kv_tiers.disk.failures", "disk"],
    ["rejected"],
    ["rejected.queue_full", "queue_full (429)"],
    ["rejected.kv_timeout", "kv_timeout (503)"],
    ["rejected.model_reloading", "model_reloading (503)"],
    ["rejected.kv_unservable", "kv_unservable (400)"],
  ];

  function field(admission, name) {
    return name.split(".").reduce((obj, key) => (obj ? obj[key] : undefined), admission);
  }

  function renderTotals(admission) {
    const body = $("totals").tBodies[0];
    body.replaceChildren();
    const tiers = admission.kv_tiers || {};
    for (const [name, label, limit, tier] of TOTALS) {
      if (tier && !(tier === "any" ? Object.keys(tiers).length : tiers[tier])) continue; // a tier that is off
      const row = el("tr");
      if (label === undefined) {
        row.className = "group";
        const cell = el("td", "", name);
        cell.colSpan = 2;
        row.append(cell);
      } else {
        const value = el("td");
        const number = el("span", "", fmt(field(admission, name)));
        number.dataset.field = name;
        value.append(number);
        if (limit) {
          const max = el("span", "", " / " + fmt(field(admission, limit)));
          value.append(max);
        }
        row.append(el("td", "", label), value);
      }
      body.append(row);
    }
    $("pool-caption").textContent = fmt(admission.blocks_total) + " blocks of " + admission.block_size + " tokens";
  }

  // ------------------------------------------------------------------ the block map (canvas, one cell per block)

  function layout(total, width) {
    const maxHeight = Math.max(160, Math.min(520, Math.round(window.innerHeight * 0.55)));
    for (let size = 36; size >= 1; size--) {
      const cols = Math.max(1, Math.floor(width / size));
      const rows = Math.ceil(total / cols);
      if (rows * size <= maxHeight || size === 1) {
        return { size, cols, rows, gap: size >= 5 ? 1 : 0, width: cols * size, height: Math.max(1, rows * size) };
      }
    }
    return null;
  }

  function drawMap(blocks, admission) {
    const canvas = $("map");
    const cells = blocks.cells;
    const total = cells.length;
    const width = Math.max(120, Math.floor($("map-wrap").clientWidth));
    const lay = layout(total, width);
    state.layout = lay;
    const t0 = performance.now();
    const ratio = 1; // cells are whole CSS pixels; drawn 1:1 and scaled by the browser
    canvas.width = lay.width * ratio;
    canvas.height = lay.height * ratio;
    canvas.style.width = lay.width + "px";
    canvas.style.height = lay.height + "px";
    const ctx = canvas.getContext("2d");
    const image = ctx.createImageData(canvas.width, canvas.height);
    const pixels = new Uint32Array(image.data.buffer);
    const colour = {};
    const counts = {};
    for (const c of ORDER) {
      const [r, g, b] = STATES[c][2];
      colour[c] = (255 << 24) | (b << 16) | (g << 8) | r; // little-endian RGBA
      counts[c] = 0;
    }
    const inner = lay.size - lay.gap;
    const stride = canvas.width;
    for (let i = 0; i < total; i++) {
      const c = cells[i];
      counts[c] += 1;
      const value = colour[c];
      const x0 = (i % lay.cols) * lay.size;
      const y0 = Math.floor(i / lay.cols) * lay.size;
      for (let y = 0; y < inner; y++) {
        const row = (y0 + y) * stride + x0;
        for (let x = 0; x < inner; x++) pixels[row + x] = value;
      }
    }
    ctx.putImageData(image, 0, 0);
    const highlight = $("map-highlight");
    highlight.width = canvas.width;
    highlight.height = canvas.height;
    highlight.style.width = canvas.style.width;
    highlight.style.height = canvas.style.height;
    if (state.pointer) onMapMove(state.pointer); // the block under the pointer may have changed
    drawHighlight(); // resizing cleared the highlight canvas
    // What was drawn, for anyone checking the page (and the tests): cells per state, and the time it took.
    canvas.dataset.blocks = String(total);
    for (const c of ORDER) canvas.dataset["count_" + STATES[c][0]] = String(counts[c]);
    canvas.dataset.drawMs = (performance.now() - t0).toFixed(1);
    renderLegend(counts, admission);
  }

  function renderLegend(counts, admission) {
    const legend = $("legend");
    legend.replaceChildren();
    for (const c of ORDER) {
      const [name, label] = STATES[c];
      const item = el("li");
      item.append(el("span", "swatch " + name), el("span", "", label));
      const count = el("span", "count", fmt(counts[c]));
      count.dataset.cells = name;
      item.append(count);
      legend.append(item);
    }
    const note = el("li", "legend-note");
    note.append(el("span", "caption",
      "in use + reserved = " + fmt(counts.u + counts.r) + " reserved; the rest = " +
      fmt(counts.e + counts.c + counts.s) + " available"));
    legend.append(note);
  }

  function ownersOf(block) {
    const found = [];
    for (const owner of state.data.blocks.owners) {
      const r = owner.runs;
      for (let k = 0; k < r.length; k += 2) {
        if (block >= r[k] && block < r[k] + r[k + 1]) { found.push(owner); break; }
      }
    }
    return found;
  }

  function drawHighlight() {
    const canvas = $("map-highlight");
    const ctx = canvas.getContext("2d");
    ctx.clearRect(0, 0, canvas.width, canvas.height);
    const lay = state.layout;
    const owner = state.highlight && state.data
      ? state.data.blocks.owners.find((o) => o.id === state.highlight) : null;
    if (!owner || !lay) return;
    const r = owner.runs;
    const inner = Math.max(1, lay.size - lay.gap);
    const ring = inner >= 8; // big cells keep their colour inside a white ring; small ones turn white
    ctx.fillStyle = "rgba(255, 255, 255, 0.9)";
    ctx.strokeStyle = "#ffffff";
    ctx.lineWidth = 2;
    for (let k = 0; k < r.length; k += 2) {
      for (let b = r[k]; b < r[k] + r[k + 1]; b++) {
        const x = (b % lay.cols) * lay.size;
        const y = Math.floor(b / lay.cols) * lay.size;
        if (ring) ctx.strokeRect(x + 1, y + 1, inner - 2, inner - 2);
        else ctx.fillRect(x, y, inner, inner);
      }
    }
  }

  function setHighlight(id) {
    if (state.highlight === id) return;
    state.highlight = id;
    drawHighlight();
    for (const row of document.querySelectorAll("tr[data-owner]")) markHighlight(row);
  }

  // A request's row is marked while the block map highlights its blocks (a hovered block's owner).
  function markHighlight(row) {
    row.classList.toggle("active", row.dataset.owner === state.highlight);
  }

  function onMapMove(event) {
    const lay = state.layout;
    const data = state.data;
    const tip = $("tip");
    if (!lay || !data) return;
    state.pointer = { clientX: event.clientX, clientY: event.clientY };
    const rect = $("map").getBoundingClientRect();
    const x = event.clientX - rect.left;
    const y = event.clientY - rect.top;
    const col = Math.floor(x / lay.size);
    const block = Math.floor(y / lay.size) * lay.cols + col;
    if (col < 0 || col >= lay.cols || block < 0 || block >= data.blocks.cells.length) {
      tip.hidden = true;
      setHighlight(null);
      return;
    }
    const kind = STATES[data.blocks.cells[block]];
    const owners = ownersOf(block);
    const lines = ["block " + block + " · " + kind[1]];
    for (const o of owners) {
      lines.push(o.kind === "session" ? "retained for session " + o.id
        : "held by " + o.id + (o.session ? " (session " + o.session + ")" : ""));
    }
    if (owners.length > 1 && owners.every((o) => o.kind === "request")) lines.push("shared by " + owners.length);
    tip.replaceChildren(...lines.map((line) => el("div", "", line)));
    tip.hidden = false;
    const wrap = $("map-wrap").getBoundingClientRect();
    tip.style.left = Math.min(x + 14, wrap.width - 260) + "px";
    tip.style.top = (y + 14) + "px";
    setHighlight(owners.length ? owners[0].id : null);
  }

  // ------------------------------------------------------------------ queue, running, rejections

  function requestCell(id, session) {
    const cell = el("td");
    cell.append(el("span", "rid", id));
    if (session) cell.append(el("span", "session", session));
    return cell;
  }

  // Rows are rebuilt on every poll; a request's row keeps its highlight (`markHighlight`).
  function fillTable(id, rows, makeRow) {
    const body = $(id).tBodies[0];
    const made = rows.map(makeRow);
    for (const row of made) if (row.dataset.owner !== undefined) markHighlight(row);
    body.replaceChildren(...made);
    $(id).hidden = rows.length === 0;
    $(id + "-empty").hidden = rows.length > 0;
  }

  function renderQueue(queue, admission) {
    $("queue-caption").textContent = fmt(admission.queue_depth) + " of " + fmt(admission.max_queue_depth) +
      " · wait limit " + secs(admission.max_wait_secs);
    fillTable("queue", queue, (q) => {
      const row = el("tr");
      row.dataset.owner = q.id;
      const position = el("td", "num", q.position);
      if (q.preempted) position.append(el("span", "badge", "preempted ×" + q.preempted));
      const start = el("td", "num", q.est_start_s < 0.05 ? "next grant" : "in " + secs(q.est_start_s));
      start.dataset.estStart = String(q.est_start_s);
      row.append(position, requestCell(q.id, q.session), el("td", "num", fmt(q.prompt_tokens)),
        el("td", "num", fmt(q.max_tokens)), el("td", "num", fmt(q.blocks_needed)),
        el("td", "num", secs(q.waited_s)), start,
        el("td", "num", q.deadline_s === null ? "never" : secs(Math.max(0, q.deadline_s))));
      return row;
    });
  }

  function renderRunning(running, admission) {
    $("running-caption").textContent = fmt(admission.in_flight) + " of " + fmt(admission.max_in_flight);
    fillTable("running", running, (r) => {
      const row = el("tr");
      row.dataset.owner = r.id;
      const progress = el("div", "progress");
      const bar = el("div", "bar");
      bar.style.width = (100 * r.tokens_generated / Math.max(1, r.max_tokens)).toFixed(1) + "%";
      progress.append(bar, el("span", "label", fmt(r.tokens_generated) + " / " + fmt(r.max_tokens)));
      const progressCell = el("td");
      progressCell.append(progress);
      row.append(requestCell(r.id, r.session), progressCell,
        el("td", "num", fmt(r.prompt_prefilled) + " / " + fmt(r.prompt_tokens)),
        el("td", "num", fmt(r.blocks_charged) + " / " + fmt(r.blocks_reserved)),
        el("td", "num", fmt(r.shared_blocks)), el("td", "num", secs(r.running_s)));
      return row;
    });
  }

  function renderRejections(rejections, admission) {
    const counts = Object.entries(admission.rejected).filter(([, n]) => n > 0)
      .map(([reason, n]) => reason + " " + fmt(n));
    $("rejections-caption").textContent = counts.length
      ? "since start: " + counts.join(", ") + " · the newest " + rejections.length + " below, newest first" : "";
    fillTable("rejections", rejections, (r) => {
      const row = el("tr");
      row.dataset.reason = r.reason;
      const time = el("td", "num", new Date(r.at * 1000).toLocaleTimeString());
      const status = el("td");
      status.append(el("span", "status s" + r.status, r.status + " " + r.code));
      const why = el("td", "why");
      why.append(el("div", "message", r.message), el("div", "arith", r.arithmetic));
      if (r.request_id) why.append(el("div", "arith", "request " + r.request_id));
      const retry = el("td", "num", r.retry_after === null ? "none (permanent)" : r.retry_after + " s");
      row.append(time, el("td", "reason", r.reason), status, retry, why);
      return row;
    });
  }

  // ------------------------------------------------------------------ sparklines

  function spark(svgId, values, colour) {
    const svg = $(svgId);
    svg.replaceChildren();
    const points = values.map((v, i) => [i, v]).filter(([, v]) => v !== null && v !== undefined);
    if (points.length < 2) return;
    const max = Math.max(...points.map(([, v]) => v), 1e-9);
    const n = Math.max(values.length - 1, 1);
    const coords = points.map(([i, v]) => (300 * i / n).toFixed(1) + "," + (58 - 54 * v / max).toFixed(1));
    const ns = "http://www.w3.org/2000/svg";
    const area = document.createElementNS(ns, "polygon");
    area.setAttribute("points", coords[0].split(",")[0] + ",60 " + coords.join(" ") + " " +
      coords[coords.length - 1].split(",")[0] + ",60");
    area.setAttribute("fill", colour);
    area.setAttribute("fill-opacity", "0.15");
    const line = document.createElementNS(ns, "polyline");
    line.setAttribute("points", coords.join(" "));
    line.setAttribute("fill", "none");
    line.setAttribute("stroke", colour);
    line.setAttribute("stroke-width", "1.5");
    line.setAttribute("vector-effect", "non-scaling-stroke");
    svg.append(area, line);
  }

  function renderSparks(series) {
    const points = series.points || [];
    const tps = points.map((p) => p.generation_tps);
    const step = points.map((p) => p.step_ms);
    spark("spark-tps", tps, "#60a5fa");
    spark("spark-step", step, "#f59e0b");
    const last = points[points.length - 1];
    $("tps-now").textContent = last ? fmt(Math.round(last.generation_tps)) + " tokens/s" : "collecting…";
    const lastStep = [...step].reverse().find((v) => v !== null && v !== undefined);
    $("step-now").textContent = lastStep !== undefined ? lastStep.toFixed(1) + " ms" : "idle";
  }

  // ------------------------------------------------------------------ wiring

  function start() {
    $("login").addEventListener("submit", (event) => {
      event.preventDefault();
      try { sessionStorage.setItem(KEY_STORE, $("key").value.trim()); } catch (e) { /* storage disabled */ }
      $("key").value = "";
      poll();
    });
    $("forget").addEventListener("click", (event) => {
      event.preventDefault();
      try { sessionStorage.removeItem(KEY_STORE); } catch (e) { /* storage disabled */ }
      poll();
    });
    const map = $("map");
    map.addEventListener("mousemove", onMapMove);
    map.addEventListener("mouseleave", () => { state.pointer = null; $("tip").hidden = true; setHighlight(null); });
    for (const id of ["queue", "running"]) {
      const body = $(id).tBodies[0];
      body.addEventListener("mouseover", (event) => {
        const row = event.target.closest("tr[data-owner]");
        setHighlight(row ? row.dataset.owner : null);
      });
      body.addEventListener("mouseleave", () => setHighlight(null));
    }
    window.addEventListener("resize", () => { if (state.data) drawMap(state.data.blocks, state.data.admission); });
    setInterval(() => {
      if (state.lastOk && state.data && Date.now() - state.lastOk > 3 * state.data.poll_ms + 2000) {
        $("updated").classList.add("stale");
      }
    }, 1000);
    poll();
  }

  // For operators' scripts and the tests: the last data drawn, and the drawing functions.
  window.helexaDashboard = { render, drawMap, layout, get data() { return state.data; }, poll };
  start();
})();
