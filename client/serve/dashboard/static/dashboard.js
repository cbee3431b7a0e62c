// pagedkv dashboard: draws the snapshots of GET /dashboard/events (their fields are listed in
// client/serve/dashboard/snapshot.py; the block map's encoding in client/serve/dashboard/block_states.py).
// No build step and no library: the DOM for the grid and the tables, SVG for the charts. Each snapshot
// drawn is dispatched on the document as a "pagedkv:snapshot" event, which the other panels' scripts
// draw from: charts.js (the last minutes) and workers.js (the workers and their states).
//
// Flow: GET /dashboard/snapshot paints first (401: the login form; 403: the server has no
// --admin-api-key); then an EventSource on /dashboard/events (it sends the HttpOnly session
// cookie that POST /dashboard/login set). While the tab is hidden the stream is closed, so an
// idle tab costs the server nothing.
//
// Elements carry what they draw as data attributes (data-block, data-state, data-refcount on
// grid cells and table entries; data-request, data-seq on rows), for people and for tests.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const STATE = ["free", "used", "cached"];
  // Block-table entries drawn per sequence at most (the rest as "+N").
  const MAX_ROW_BLOCKS = 96;

  let source = null;    // the EventSource, while connected
  let retry = null;     // the timer of the next start()
  let last = null;      // the last snapshot drawn
  let selected = null;  // the selected row's request id ("lease:<id>" for a lease)
  const rows = new Map(); // the requests table's rows by request and sequence (seqRow)
  const emptyRow = el("tr", { class: "empty" }, el("td", { colspan: "6", class: "none" }, "no requests"));
  const grids = {};     // grid element id -> {mode, per, cells, keys}

  function setStatus(state, text) {
    const s = $("status");
    s.dataset.state = state;
    s.textContent = text;
  }

  function show(which) {
    $("login").hidden = which !== "login";
    $("board").hidden = which !== "board";
    $("logout").hidden = which !== "board";
  }

  function loginError(text) {
    const p = $("login-error");
    p.textContent = text;
    p.hidden = !text;
  }

  function el(tag, attrs, ...children) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "class") e.className = v;
      else if (k === "data") Object.assign(e.dataset, v);
      else e.setAttribute(k, v);
    }
    for (const c of children) e.append(c);
    return e;
  }

  // A [value, length, value, length, ...] list (block_states.runs) as one value per block.
  function unruns(runs, n) {
    const out = new Uint32Array(n);
    let at = 0;
    for (let i = 0; i + 1 < runs.length && at < n; i += 2) {
      out.fill(runs[i], at, Math.min(n, at + runs[i + 1]));
      at += runs[i + 1];
    }
    return out;
  }

  const pct = (x) => (x === null || x === undefined ? "n/a" : `${(100 * x).toFixed(1)}%`);
  const num = (x) => (x >= 100 ? Math.round(x).toLocaleString("en-US") : (+x).toFixed(1).replace(/\.0$/, ""));

  // ------------------------------------------------------------------ connection
  async function start() {
    clearTimeout(retry);
    let r;
    try {
      r = await fetch("/dashboard/snapshot", { credentials: "same-origin", cache: "no-store" });
    } catch (e) {
      setStatus("down", "server unreachable");
      retry = setTimeout(start, 3000);
      return;
    }
    const body = await r.json().catch(() => null);
    if (r.status === 401 || r.status === 403) {
      if (source) source.close();
      source = null;
      show("login");
      setStatus("idle", "not logged in");
      const forbidden = r.status === 403;
      $("login-form").hidden = forbidden;
      if (forbidden) loginError(body?.error?.message || "the dashboard is not enabled on this server");
      return;
    }
    show("board");
    if (r.ok && body) render(body);
    else if (body?.type === "error") feedError(body);
    connect();
  }

  function connect() {
    if (source) source.close();
    if (document.visibilityState === "hidden") return;
    const es = new EventSource("/dashboard/events");
    source = es;
    es.addEventListener("snapshot", (e) => {
      $("feed-error").hidden = true;
      render(JSON.parse(e.data));
    });
    es.addEventListener("error", (e) => {
      if (e.data !== undefined) {  // the feed's own "event: error": the memory service did not answer
        feedError(JSON.parse(e.data));
        return;
      }
      if (es.readyState === EventSource.CLOSED) {  // refused (logged out, expired): start over
        es.close();
        if (source === es) source = null;
        setStatus("down", "disconnected");
        retry = setTimeout(start, 2000);
      } else {
        setStatus("down", "reconnecting");
      }
    });
  }

  function feedError(err) {
    const p = $("feed-error");
    p.textContent = `snapshot ${err.seq}: ${err.message}`;
    p.hidden = false;
    setStatus("error", "feed error");
  }

  // ------------------------------------------------------------------ drawing
  function render(snap) {
    last = snap;
    document.body.dataset.seq = snap.seq;
    const scope = $("scope");
    scope.hidden = false;
    scope.textContent = snap.scope;
    scope.title = snap.scope_note || "";
    setStatus("live", `snapshot ${snap.seq} · ${new Date(snap.time * 1000).toLocaleTimeString()}`);
    renderCounters(snap);
    const sel = selectedBlocks(snap);
    renderGrid("grid", snap.pool, sel.device);
    $("pool-note").textContent = tierNote(snap.pool);
    $("host").hidden = !snap.host;
    if (snap.host) {
      renderGrid("host-grid", snap.host, sel.host);
      $("host-note").textContent = tierNote(snap.host);
    }
    renderRequests(snap);
    const f = snap.feed;
    $("feed-cost").textContent = f ? `a snapshot every ${f.interval_s} s while watched · the last one took ` +
      `${f.last_tick_ms.toFixed(1)} ms in the server (${f.last_tick_cpu_ms.toFixed(1)} ms of CPU)` : "";
    document.dispatchEvent(new CustomEvent("pagedkv:snapshot", { detail: snap }));
  }

  function tierNote(tier) {
    const each = tier.encoding === "cells" ? `one cell per ${tier.blocks_per_cell} blocks (heat map: share used)` : "one cell per block";
    const c = tier.counts;
    return `${tier.total_blocks.toLocaleString("en-US")} blocks${tier.block_size ? ` of ${tier.block_size} tokens` : ""} · ` +
      `${c.used} used, ${c.cached} cached, ${c.free} free · ${each}` + (tier.exact ? "" : " · approximate (see GetStats above)");
  }

  function renderCounters(snap) {
    const st = snap.stats, c = snap.counters;
    const cards = [
      ["total_blocks", "blocks", st.total_blocks.toLocaleString("en-US")],
      ["used_blocks", "used", st.used_blocks.toLocaleString("en-US")],
      ["cached_blocks", "cached", st.cached_blocks.toLocaleString("en-US")],
      ["free_blocks", "free", st.free_blocks.toLocaleString("en-US")],
      ["kv_cache_dtype", "KV cache", `${st.kv_cache_dtype || "?"} · ${Number(st.token_capacity || 0).toLocaleString("en-US")} tokens`],
      ["kv_usage", "KV usage", pct(c.kv_usage)],
      ["prefix_cache_hit_rate", "prefix-cache hit rate", pct(c.prefix_cache_hit_rate)],
      ["num_sequences", "sequences", String(st.num_sequences)],
      ["num_leases", "leases", String(st.num_leases)],
      ["preemptions", "preemptions", String(c.preemptions)],
      ["prompt_tokens_per_s", "prompt tokens/s", num(c.now.prompt_tokens_per_s)],
      ["generation_tokens_per_s", "output tokens/s", num(c.now.generation_tokens_per_s)],
    ];
    if (st.host_total_blocks) cards.push(["host_used_blocks", "host tier used", `${st.host_used_blocks} / ${st.host_total_blocks}`]);
    if (st.disk) {  // the disk tier (--disk-cache-dir): blocks on disk, tokens read back, blocks dropped as corrupt
      cards.push(["disk_blocks", "disk tier", `${st.disk.blocks} / ${st.disk.slots} blocks`]);
      cards.push(["disk_hits", "disk hits (tokens)", Number(st.disk.hits).toLocaleString("en-US")]);
      cards.push(["disk_checksum_failures", "disk checksum failures", String(st.disk.checksum_failures)]);
    }
    if (st.pins && (st.pins.num_pins || st.pins.retained_blocks)) {  // prefix pins (POST /admin/pins) and what they left
      cards.push(["pinned_blocks", "pinned", `${st.pins.num_pins} pins · ${st.pins.pinned_blocks} blocks`]);
      cards.push(["retained_blocks", "retained (priority)", `${st.pins.retained_blocks} blocks`]);
    }
    const box = $("counters");
    if (box.children.length !== cards.length) {  // built once (again when a tier or a pin appears)
      box.replaceChildren(...cards.map(([key, label]) =>
        el("div", { class: "card", data: { counter: key } }, el("div", { class: "label" }, label), el("div", { class: "value" }))));
    }
    cards.forEach(([, , value], i) => {
      const v = box.children[i].lastChild;
      if (v.textContent !== value) v.textContent = value;
    });
  }

  // The selected row's blocks: {device: Set, host: Set}.
  function selectedBlocks(snap) {
    const device = new Set(), host = new Set();
    if (selected === null) return { device, host };
    const seqs = [];
    for (const r of [...snap.requests.running, ...snap.requests.waiting]) if (r.request_id === selected) seqs.push(...r.sequences);
    for (const l of snap.leases) if (`lease:${l.lease_id}` === selected) seqs.push(...l.sequences);
    for (const s of seqs) {
      (s.block_ids || []).forEach((b, i) => ((s.media && s.media[i] === 1) ? host : device).add(b));
    }
    return { device, host };
  }

  function renderGrid(id, tier, sel) {
    const box = $(id);
    const mode = tier.encoding;
    const n = mode === "blocks" ? tier.total_blocks : tier.cells.used.length;
    let g = grids[id];
    if (!g || g.mode !== mode || g.cells.length !== n || g.per !== tier.blocks_per_cell) {
      const cells = [];
      for (let i = 0; i < n; i++) cells.push(el("div", { class: mode === "blocks" ? "b" : "h" }));
      box.replaceChildren(...cells);
      box.classList.toggle("heat", mode === "cells");
      g = grids[id] = { mode, per: tier.blocks_per_cell, cells, keys: new Array(n).fill("") };
    }
    box.dataset.encoding = mode;
    box.dataset.totalBlocks = tier.total_blocks;
    box.dataset.cells = n;
    if (mode === "blocks") {
      const st = unruns(tier.state_runs, n), rc = unruns(tier.refcount_runs, n);
      for (let i = 0; i < n; i++) {
        const s = STATE[st[i]] || "free", r = rc[i], on = sel.has(i);
        const key = `${s}${r}${on ? "*" : ""}`;
        if (g.keys[i] === key) continue;
        g.keys[i] = key;
        const c = g.cells[i];
        c.className = `b s-${s}${r > 1 ? " shared" : ""}${on ? " sel" : ""}`;
        Object.assign(c.dataset, { block: i, state: s, refcount: r });
        c.textContent = r > 1 ? (r < 10 ? String(r) : "+") : "";
        c.title = `block ${i}: ${s}${s === "used" ? `, refcount ${r}` : ""}`;
      }
      return;
    }
    const per = tier.blocks_per_cell, { used, cached, free, max_refcount: maxRc } = tier.cells;
    const onCells = new Set([...sel].map((b) => Math.floor(b / per)));
    for (let i = 0; i < n; i++) {
      const blocks = used[i] + cached[i] + free[i], on = onCells.has(i);
      const key = `${used[i]}/${cached[i]}/${maxRc[i]}${on ? "*" : ""}`;
      if (g.keys[i] === key) continue;
      g.keys[i] = key;
      const c = g.cells[i];
      c.className = `h${on ? " sel" : ""}`;
      const u = blocks ? used[i] / blocks : 0, q = blocks ? cached[i] / blocks : 0;
      c.style.background = used[i] ? `hsl(135, 55%, ${Math.round(82 - 52 * u)}%)`
        : cached[i] ? `hsl(214, 80%, ${Math.round(85 - 25 * q)}%)` : "var(--free)";
      Object.assign(c.dataset, { first: i * per, used: used[i], cached: cached[i], free: free[i], maxRefcount: maxRc[i] });
      c.title = `blocks ${i * per}-${i * per + blocks - 1}: ${used[i]} used, ${cached[i]} cached, ${free[i]} free` +
        (maxRc[i] > 1 ? `, refcount up to ${maxRc[i]}` : "");
    }
  }

  function blockTable(s) {
    if (s.seq_id === null) return el("span", { class: "none" }, "no blocks");
    if (!s.block_ids) return el("span", { class: "none" }, "table not sent (too many sequences)");
    if (!s.block_ids.length) return el("span", { class: "none" }, "no blocks");
    const td = document.createDocumentFragment();
    s.block_ids.slice(0, MAX_ROW_BLOCKS).forEach((b, i) => {
      const rc = s.ref_counts ? s.ref_counts[i] : null, host = s.media && s.media[i] === 1;
      const span = el("span", { class: `blk${rc > 1 ? " shared" : ""}${host ? " host" : ""}`,
        data: { block: b, refcount: rc ?? "" }, title: `block ${b}${rc !== null ? `, refcount ${rc}` : ""}${host ? ", host tier" : ""}` }, String(b));
      if (rc > 1) span.append(el("sup", {}, `×${rc}`));
      td.append(span);
    });
    if (s.block_ids.length > MAX_ROW_BLOCKS) td.append(el("span", { class: "none" }, ` +${s.block_ids.length - MAX_ROW_BLOCKS} more`));
    return td;
  }

  // A row per sequence, kept between snapshots and changed in place: during decode only a row's
  // token count changes every step, and its block table once per block.
  function seqRow(rowId, label, status, s) {
    const key = `${rowId}|${s.seq_id ?? `i${s.index}`}`;
    let tr = rows.get(key);
    if (!tr) {
      tr = el("tr", { data: { request: rowId, seq: s.seq_id ?? "", sample: s.index ?? "" } },
        el("td", {}, label), el("td"), el("td", { class: "num" }, s.index ?? ""),
        el("td", { class: "num" }, s.seq_id ?? "-"), el("td", { class: "num" }), el("td", { class: "table" }));
      tr.drawn = {};
      rows.set(key, tr);
    }
    const cells = tr.children, drawn = tr.drawn;
    const table = JSON.stringify([s.seq_id, s.block_ids, s.ref_counts, s.media]);
    if (drawn.status !== status) cells[1].textContent = tr.dataset.status = drawn.status = status;
    if (drawn.tokens !== s.num_tokens) cells[4].textContent = drawn.tokens = s.num_tokens;
    if (drawn.table !== table) {
      cells[5].replaceChildren(blockTable(s));
      drawn.table = table;
    }
    tr.classList.toggle("selected", rowId === selected);
    tr.seen = true;
    return tr;
  }

  function renderRequests(snap) {
    const { running, waiting } = snap.requests;
    $("requests-note").textContent = `${running.length} running · ${waiting.length} waiting · ${snap.leases.length} other leases` +
      (snap.truncated ? " · some tables not sent" : "");
    const order = [];
    for (const tr of rows.values()) tr.seen = false;
    for (const r of [...running, ...waiting]) {
      for (const s of r.sequences) order.push(seqRow(r.request_id, r.request_id, s.finished ? "finished" : r.status, s));
    }
    for (const l of snap.leases) {
      for (const s of l.sequences) order.push(seqRow(`lease:${l.lease_id}`, `lease ${l.lease_id.slice(0, 8)}`, s.swapped ? "swapped" : "lease", s));
    }
    for (const [key, tr] of rows) if (!tr.seen) rows.delete(key);
    if (!order.length) order.push(emptyRow);
    const tbody = document.querySelector("#requests tbody");
    const now = tbody.children;
    if (now.length !== order.length || order.some((tr, i) => now[i] !== tr)) tbody.replaceChildren(...order);
  }

  // One listener for every row: a click selects its request (again: unselects).
  document.querySelector("#requests tbody").addEventListener("click", (e) => {
    const tr = e.target.closest("tr[data-request]");
    if (!tr) return;
    selected = selected === tr.dataset.request ? null : tr.dataset.request;
    if (last) render(last);
  });

  // ------------------------------------------------------------------ login, logout, visibility
  $("login-form").addEventListener("submit", async (e) => {
    e.preventDefault();
    loginError("");
    let r;
    try {
      r = await fetch("/dashboard/login", { method: "POST", credentials: "same-origin",
        headers: { "Content-Type": "application/json" }, body: JSON.stringify({ key: $("key").value }) });
    } catch (err) {
      loginError("the server did not answer");
      return;
    }
    if (r.ok) {
      $("key").value = "";
      start();
      return;
    }
    const body = await r.json().catch(() => null);
    loginError(body?.error?.message || `login refused (HTTP ${r.status})`);
  });

  $("logout").addEventListener("click", async () => {
    if (source) source.close();
    source = null;
    await fetch("/dashboard/logout", { method: "POST", credentials: "same-origin" }).catch(() => null);
    show("login");
    setStatus("idle", "logged out");
  });

  document.addEventListener("visibilitychange", () => {
    if (document.visibilityState === "hidden") {
      if (source) source.close();
      source = null;
      setStatus("idle", "paused while hidden");
    } else if (!$("board").hidden) {
      start();
    }
  });

  start();
})();
