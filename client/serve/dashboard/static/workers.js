// pagedkv dashboard: the workers panel, drawn from each "pagedkv:snapshot" event that dashboard.js dispatches
// on the document (snapshot.workers and the workers_* counters, client/serve/dashboard/snapshot.py).
//
// A row per worker, every node's, with its state as a badge: ready (takes work), down (its step failed;
// probed until it maps the pool again) or draining (takes no new work until undrained or restarted).
// Rows carry data-worker, data-node and data-state, for people and for tests; text only, never HTML.
"use strict";

(() => {
  const box = document.getElementById("workers");
  const note = document.getElementById("workers-note");
  const tbody = box.querySelector("tbody");
  const rows = new Map();  // "node|address" -> its row, kept between snapshots and changed in place

  function ago(seconds) {
    const s = Math.max(0, Math.floor(seconds));
    if (s < 60) return `${s} s`;
    if (s < 3600) return `${Math.floor(s / 60)} min ${s % 60} s`;
    return `${Math.floor(s / 3600)} h ${Math.floor(s / 60) % 60} min`;
  }

  function td(cls) {
    const c = document.createElement("td");
    if (cls) c.className = cls;
    return c;
  }

  function set(cell, text) {
    if (cell.textContent !== text) cell.textContent = text;
  }

  function row(w, now) {
    const key = `${w.node}|${w.address}`;
    let tr = rows.get(key);
    if (!tr) {
      tr = document.createElement("tr");
      Object.assign(tr.dataset, { worker: w.address, node: w.node });
      tr.append(td(), td("node"), td(), td(), ...[0, 1, 2, 3, 4].map(() => td("num")));
      tr.children[0].textContent = w.address;
      tr.children[1].textContent = w.node;
      const badge = document.createElement("span");
      badge.className = "badge";
      tr.children[2].append(badge);
      rows.set(key, tr);
    }
    const c = tr.children, badge = c[2].firstChild;
    if (tr.dataset.state !== w.state) tr.dataset.state = badge.dataset.state = badge.textContent = w.state;
    c[0].title = w.instance_id ? `process ${w.instance_id}` : "";
    set(c[3], w.since === null ? "since start" : `for ${ago(now - w.since)}`);
    c[3].title = w.since === null ? "" : `${w.state} since ${new Date(w.since * 1000).toLocaleTimeString()}`;
    [w.requests, w.sequences, w.waiting, w.failures, w.restarts].forEach((v, i) => set(c[4 + i], String(v)));
    tr.seen = true;
    return tr;
  }

  document.addEventListener("pagedkv:snapshot", (e) => {
    const snap = e.detail, workers = snap.workers || [], c = snap.counters;
    box.hidden = !workers.length;
    box.classList.toggle("no-nodes", !workers.some((w) => w.node));
    const age = c.last_step_age_s;
    note.textContent = `${c.workers_ready} of ${c.workers_total} ready · ${c.worker_failovers} failovers · ` +
      (age === null || age === undefined ? "no step yet" : `last step ${ago(age)} ago`);
    for (const tr of rows.values()) tr.seen = false;
    const order = workers.map((w) => row(w, snap.time));
    for (const [key, tr] of rows) if (!tr.seen) rows.delete(key);
    const now = tbody.children;
    if (now.length !== order.length || order.some((tr, i) => now[i] !== tr)) tbody.replaceChildren(...order);
  });
})();
