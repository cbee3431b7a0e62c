// pagedkv dashboard: the charts of the last minutes (snapshot.history, client/serve/dashboard/rates.py), drawn
// as SVG from each "pagedkv:snapshot" event that dashboard.js dispatches on the document.
"use strict";

(() => {
  // Seconds of history the charts span at most (client/serve/dashboard/rates.py: SPAN).
  const SPAN = 300;
  let chartsKey = "";   // the history the charts last drew
  const num = (x) => (x >= 100 ? Math.round(x).toLocaleString("en-US") : (+x).toFixed(1).replace(/\.0$/, ""));

  function renderCharts(snap) {
    const h = snap.history || [];
    const key = `${h.length}:${h.length ? h[h.length - 1].time : 0}`;
    if (key === chartsKey) return;  // a new point every 5 s: redrawn then
    chartsKey = key;
    const pts = (f) => h.filter((p) => f(p) !== null && f(p) !== undefined).map((p) => [p.time, f(p)]);
    chart("kv_usage", snap.time, [pts((p) => 100 * p.kv_usage)], "%", 100);
    chart("prefix_cache_hit_rate", snap.time,
      [pts((p) => (p.prefix_cache_hit_rate === null ? null : 100 * p.prefix_cache_hit_rate))], "%", 100);
    chart("tokens_per_s", snap.time,
      [pts((p) => p.prompt_tokens_per_s), pts((p) => p.generation_tokens_per_s)], "", null);
    chart("preemptions", snap.time, [pts((p) => p.preemptions)], "", null);
  }

  function chart(name, now, series, unit, fixedMax) {
    const W = 240, H = 64, top = 10, bottom = 12;
    const svg = document.querySelector(`.chart[data-series="${name}"] svg`);
    svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
    const ns = "http://www.w3.org/2000/svg";
    const text = (x, y, s, anchor) => {
      const t = document.createElementNS(ns, "text");
      t.setAttribute("x", x); t.setAttribute("y", y); t.setAttribute("text-anchor", anchor || "start");
      t.textContent = s;
      return t;
    };
    const all = series.flat();
    const max = fixedMax ?? Math.max(1, ...all.map((p) => p[1]));
    // The x axis spans the history there is: from a minute up to SPAN seconds.
    const span = Math.min(SPAN, Math.max(60, ...all.map((p) => now - p[0])));
    const ago = span >= SPAN ? `${SPAN / 60} min ago` : `${Math.round(span)} s ago`;
    const parts = [text(0, 8, `${num(max)}${unit}`), text(0, H - 1, ago), text(W, H - 1, "now", "end")];
    if (!all.length) parts.push(text(W / 2, H / 2, "a point every 5 s while watched", "middle"));
    series.forEach((s, i) => {
      if (!s.length) return;
      const line = document.createElementNS(ns, "polyline");
      line.setAttribute("class", `s${i}`);
      const x = (t) => (W * Math.max(0, 1 - (now - t) / span)).toFixed(1);
      const y = (v) => (H - bottom - (H - top - bottom) * Math.min(1, v / max)).toFixed(1);
      line.setAttribute("points", s.map(([t, v]) => `${x(t)},${y(v)}`).join(" "));
      parts.push(line);
    });
    svg.replaceChildren(...parts);
  }

  document.addEventListener("pagedkv:snapshot", (e) => renderCharts(e.detail));
})();
