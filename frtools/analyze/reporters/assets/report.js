/* frtools report: draws the progress map, the timeline and the lateness chart from the
   embedded JSON. Plain JS and canvas, no library, no request. */
"use strict";
window.addEventListener("error", function (ev) {
  document.body.setAttribute("data-error", String(ev.message || ev));
});
(function () {
  const D = JSON.parse(document.getElementById("frtools-data").textContent);
  const R = D.ranks.list || Array.from({ length: D.ranks.n }, function (_, i) { return i; });
  const NR = R.length;
  const IDX = new Map();
  R.forEach(function (r, i) { IDX.set(r, i); });
  const role = function (r) { const i = IDX.get(r); return i === undefined ? "." : D.roles[i]; };
  const css = getComputedStyle(document.documentElement);
  const v = function (name) { return css.getPropertyValue(name).trim(); };
  const COL = {
    d: v("--done"), p: v("--pending"), u: v("--unknown"), b: v("--behind"), n: v("--norec"),
    guilty: v("--guilty"), waiting: v("--waiting"), ink: v("--ink"), dim: v("--dim"),
    line: v("--line"), panel: v("--panel"),
  };
  const FONT = "12px system-ui, -apple-system, 'Segoe UI', 'DejaVu Sans', sans-serif";
  const STATE_TEXT = {
    d: "issued the latest, completed", u: "issued the latest, completion unknown",
    p: "issued the latest, not completed", b: "never issued the group's latest",
    n: "no record",
  };
  // severity: the worst state of several ranks drawn in one pixel column shows
  const SEV = { d: 1, u: 2, p: 3, n: 4, b: 5 };
  const SEV_COL = [null, COL.d, COL.u, COL.p, COL.n, COL.b];
  const SEV_KEY = [null, "d", "u", "p", "n", "b"];
  // groups arrive as columns (see html.py _groups_payload): rebuild one object per group
  function parseRanks(text) {
    const out = [];
    text.split(",").forEach(function (term) {
      if (!term) return;
      const colon = term.split(":"), ends = colon[0].split("-");
      const a = Number(ends[0]), b = ends.length > 1 ? Number(ends[1]) : a;
      const step = colon.length > 1 ? Number(colon[1]) : 1;
      for (let r = a; r <= b; r += step) out.push(r);
    });
    return out;
  }
  const GC = D.map.groups, G = [];
  {
    let at = 0;
    GC.names.forEach(function (name, gi) {
      const m = parseRanks(GC.members[gi]), top = GC.latest[gi];
      const back = function (list, k) { const x = list[at + k]; return x === null || top < 0 ? -1 : top - x; };
      const g = { n: name, d: GC.descs[GC.kind[gi]], m: m, latest: top, i: [], c: [], s: GC.states.substr(at, m.length) };
      for (let k = 0; k < m.length; k++) { g.i.push(back(GC.issued_behind, k)); g.c.push(back(GC.completed_behind, k)); }
      at += m.length;
      G.push(g);
    });
  }
  const groupName = function (gi) {
    if (gi < 0 || gi >= G.length) return "?";
    const g = G[gi];
    return "group " + g.n + (g.d ? " (" + g.d + ")" : "");
  };
  const tip = document.getElementById("tip");
  function showTip(ev, text) {
    tip.textContent = text;
    tip.hidden = false;
    const w = tip.offsetWidth, h = tip.offsetHeight;
    let x = ev.clientX + 14, y = ev.clientY + 14;
    if (x + w > window.innerWidth - 4) x = Math.max(4, ev.clientX - w - 14);
    if (y + h > window.innerHeight - 4) y = Math.max(4, ev.clientY - h - 14);
    tip.style.left = x + "px";
    tip.style.top = y + "px";
  }
  function hideTip() { tip.hidden = true; }
  function setup(cv, w, h) {
    const dpr = window.devicePixelRatio || 1;
    cv.width = Math.max(1, Math.round(w * dpr));
    cv.height = Math.max(1, Math.round(h * dpr));
    cv.style.height = h + "px";
    const ctx = cv.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.font = FONT;
    ctx.textBaseline = "middle";
    return ctx;
  }
  function fit(ctx, text, width) {
    if (ctx.measureText(text).width <= width) return text;
    let lo = 0, hi = text.length;
    while (lo < hi) {
      const mid = (lo + hi + 1) >> 1;
      if (ctx.measureText(text.slice(0, mid) + "…").width <= width) lo = mid; else hi = mid - 1;
    }
    return text.slice(0, lo) + "…";
  }
  function rankText(list, limit) {
    const s = list.slice().sort(function (a, b) { return a - b; });
    const parts = [];
    for (let i = 0; i < s.length;) {
      let j = i;
      while (j + 1 < s.length && s[j + 1] === s[j] + 1) j++;
      parts.push(j > i ? s[i] + "-" + s[j] : String(s[i]));
      i = j + 1;
    }
    const t = parts.join(",");
    return limit && t.length > limit ? t.slice(0, limit) + "… (" + s.length + " ranks)" : t;
  }

  /* ---- progress map: rows of groups of one kind x ranks ---- */
  const MAP = { labelW: 240, rowH: 20, top: 16 };
  const mapRows = D.map.rows.map(function (row) {
    const gidx = new Int32Array(NR).fill(-1), pos = new Int32Array(NR).fill(-1);
    const st = new Uint8Array(NR);
    row.g.forEach(function (gi) {
      const g = G[gi];
      g.m.forEach(function (r, k) {
        const i = IDX.get(r);
        if (i === undefined) return;
        gidx[i] = gi; pos[i] = k; st[i] = SEV[g.s[k]] || 0;
      });
    });
    return { label: row.l, gidx: gidx, pos: pos, st: st };
  });
  const mapCanvas = document.getElementById("map-canvas");
  let mapGeo = null, zoomed = D.map.verdict_group;
  function drawMap() {
    const W = mapCanvas.parentElement.clientWidth;
    const plotW = Math.max(60, W - MAP.labelW - 6);
    const H = MAP.top + mapRows.length * MAP.rowH + 4;
    const ctx = setup(mapCanvas, W, H);
    const per = Math.max(1, Math.ceil(NR / plotW)), nb = Math.ceil(NR / per), bw = plotW / nb;
    mapGeo = { per: per, bw: bw, nb: nb };
    const x0 = MAP.labelW;
    mapRows.forEach(function (row, y) {
      const y0 = MAP.top + y * MAP.rowH;
      let mark = false;
      if (zoomed !== null && zoomed !== undefined) {
        for (let i = 0; i < NR && !mark; i++) if (row.gidx[i] === zoomed) mark = true;
      }
      ctx.fillStyle = mark ? COL.ink : COL.dim;
      ctx.font = (mark ? "600 " : "") + FONT;
      ctx.fillText(fit(ctx, row.label, MAP.labelW - 10), 2, y0 + MAP.rowH / 2);
      ctx.font = FONT;
      for (let b = 0; b < nb; b++) {
        let worst = 0;
        const end = Math.min(NR, (b + 1) * per);
        for (let i = b * per; i < end; i++) if (row.st[i] > worst) worst = row.st[i];
        if (!worst) continue;
        ctx.fillStyle = SEV_COL[worst];
        ctx.fillRect(x0 + b * bw, y0 + 2, bw > 3 ? bw - 1 : Math.max(bw, 1), MAP.rowH - 4);
      }
      if (mark) {  // the zoomed group's members, outlined
        ctx.strokeStyle = COL.ink;
        ctx.lineWidth = 1.5;
        let start = -1;
        for (let b = 0; b <= nb; b++) {
          let inside = false;
          if (b < nb) {
            const end = Math.min(NR, (b + 1) * per);
            for (let i = b * per; i < end; i++) if (row.gidx[i] === zoomed) { inside = true; break; }
          }
          if (inside && start < 0) start = b;
          if (!inside && start >= 0) {
            ctx.strokeRect(x0 + start * bw - 0.5, y0 + 0.5, (b - start) * bw + 1, MAP.rowH - 1);
            start = -1;
          }
        }
      }
    });
    ctx.fillStyle = COL.guilty;  // guilty ranks: a triangle and a red band over their column
    for (let i = 0; i < NR; i++) {
      if (D.roles[i] !== "g") continue;
      const x = x0 + Math.floor(i / per) * bw + bw / 2;
      ctx.beginPath();
      ctx.moveTo(x - 5, 2); ctx.lineTo(x + 5, 2); ctx.lineTo(x, MAP.top - 2);
      ctx.fill();
      ctx.fillRect(x - Math.max(1.5, bw / 2), MAP.top, Math.max(3, bw), mapRows.length * MAP.rowH);
    }
    ctx.fillStyle = COL.dim;
    ctx.textAlign = "right";
    ctx.fillText("rank " + R[NR - 1], x0 + plotW, 8);
    ctx.textAlign = "left";
    ctx.fillText("rank " + R[0], x0 + (D.roles[0] === "g" ? 10 : 0), 8);
  }
  function mapCell(ev) {
    if (!mapGeo) return null;
    const rect = mapCanvas.getBoundingClientRect();
    const x = ev.clientX - rect.left - MAP.labelW, y = ev.clientY - rect.top - MAP.top;
    const ri = Math.floor(y / MAP.rowH), b = Math.floor(x / mapGeo.bw);
    if (x < 0 || ri < 0 || ri >= mapRows.length || b < 0 || b >= mapGeo.nb) return null;
    const row = mapRows[ri];
    let best = -1, worst = -1;
    const end = Math.min(NR, (b + 1) * mapGeo.per);
    for (let i = b * mapGeo.per; i < end; i++) {
      const s = row.st[i] + (D.roles[i] === "g" ? 10 : 0);
      if (s > worst) { worst = s; best = i; }
    }
    return best < 0 || row.gidx[best] < 0 ? null : { row: row, i: best, first: b * mapGeo.per, last: end - 1 };
  }
  function memberText(gi, k) {
    const g = G[gi], r = g.m[k];
    const ro = role(r);
    return "rank " + r + (ro === "g" ? " (guilty)" : ro === "w" ? " (waiting)" : "") +
      "\n" + groupName(gi) + ", " + g.m.length + " member(s)" +
      "\nlast issued " + (g.i[k] < 0 ? "-" : g.i[k]) + ", last completed " +
      (g.c[k] < 0 ? "-" : g.c[k]) + "; group's latest " + (g.latest < 0 ? "-" : g.latest) +
      "\n" + (STATE_TEXT[g.s[k]] || "");
  }
  mapCanvas.addEventListener("mousemove", function (ev) {
    const c = mapCell(ev);
    if (!c) { hideTip(); return; }
    const gi = c.row.gidx[c.i];
    const span = c.last > c.first ? "ranks " + R[c.first] + "-" + R[c.last] + " in this column\n" : "";
    showTip(ev, span + memberText(gi, c.row.pos[c.i]) + "\nclick: zoom to this group");
  });
  mapCanvas.addEventListener("mouseleave", hideTip);
  mapCanvas.addEventListener("click", function (ev) {
    const c = mapCell(ev);
    if (c) zoomGroup(c.row.gidx[c.i]);
  });
  const zoomBox = document.getElementById("map-zoom");
  function zoomGroup(gi) {
    if (gi === null || gi === undefined || !G[gi]) return;
    zoomed = gi;
    const g = G[gi];
    zoomBox.textContent = "";
    const h = document.createElement("h3");
    h.textContent = groupName(gi) + " · " + g.m.length + " member(s) · latest collective seq " +
      (g.latest < 0 ? "-" : g.latest) + (gi === D.map.verdict_group ? " · the verdict's group" : "");
    zoomBox.appendChild(h);
    const cells = document.createElement("div");
    cells.className = "cells";
    const limit = Math.min(g.m.length, 4096);
    for (let k = 0; k < limit; k++) {
      const cell = document.createElement("span");
      cell.className = "cell" + (role(g.m[k]) === "g" ? " g" : "");
      cell.style.background = COL[g.s[k]] || COL.u;
      if (g.s[k] === "b" || g.s[k] === "n") cell.style.color = "#fff";
      const b = document.createElement("b");
      b.textContent = String(g.m[k]);
      cell.appendChild(b);
      cell.appendChild(document.createTextNode(" " + (g.i[k] < 0 ? "-" : g.i[k]) + "/" + (g.c[k] < 0 ? "-" : g.c[k])));
      cell.title = memberText(gi, k);
      cells.appendChild(cell);
    }
    zoomBox.appendChild(cells);
    const note = document.createElement("p");
    note.className = "help";
    note.textContent = "rank, then last issued / last completed collective seq on this group" +
      (limit < g.m.length ? " (first " + limit + " members)" : "");
    zoomBox.appendChild(note);
    drawMap();
  }
  document.querySelectorAll("table.groups tr[data-group]").forEach(function (tr) {
    tr.addEventListener("click", function () {
      zoomGroup(Number(tr.getAttribute("data-group")));
      zoomBox.scrollIntoView({ block: "nearest" });
    });
  });

  /* ---- timeline: each rank's last ops as slices, grouped by host or by group ---- */
  const T = D.timeline, O = T.ops;
  const tlCanvas = document.getElementById("tl-canvas");
  const tlScroll = document.getElementById("tl-scroll");
  const TL = { labelW: 230, axisH: 30, rowH: 15, viewH: 520 };
  const opsOf = new Map();
  let tMin = 0, tMax = 0;
  if (O) {
    for (let j = 0; j < O.r.length; j++) {
      const e = opsOf.get(O.r[j]);
      if (e) e[1] = j + 1; else opsOf.set(O.r[j], [j, j + 1]);
      if (O.s[j] < tMin) tMin = O.s[j];
      if (O.s[j] + O.d[j] > tMax) tMax = O.s[j] + O.d[j];
    }
  }
  const vg = D.map.verdict_group;
  const isVerdictOp = function (j) {
    return vg !== null && vg !== undefined && O.g[j] === vg && D.kind !== "healthy" &&
      ((D.verdict_seq !== null && O.q[j] === D.verdict_seq && O.p[j] < 0) ||
       (D.verdict_seq === null && D.verdict_p2p_seq !== null && O.q[j] === D.verdict_p2p_seq && O.p[j] >= 0));
  };
  // groupings of the ranks into blocks
  const groupings = [];
  if (D.hosts) {
    const blocks = D.hosts.names.map(function (n) { return { label: "host " + n, ranks: [] }; });
    const unknown = { label: "host unknown", ranks: [] };
    R.forEach(function (r, i) { const h = D.hosts.of[i]; (h >= 0 ? blocks[h] : unknown).ranks.push(r); });
    if (unknown.ranks.length) blocks.push(unknown);
    groupings.push({ name: "host", blocks: blocks.filter(function (b) { return b.ranks.length; }) });
  }
  D.map.rows.forEach(function (row) {
    const sizes = row.g.map(function (gi) { return G[gi].m.length; });
    const big = Math.max.apply(null, sizes);
    if (big < 2 || big >= NR && row.g.length === 1) return;
    const seen = new Set();
    const blocks = row.g.map(function (gi) {
      G[gi].m.forEach(function (r) { seen.add(r); });
      return { label: "pg " + G[gi].n + " (" + rankText(G[gi].m, 16) + ")", ranks: G[gi].m.slice(), gi: gi };
    });
    const rest = R.filter(function (r) { return !seen.has(r); });
    if (rest.length) blocks.push({ label: "not in a " + (row.d || "such") + " group", ranks: rest });
    groupings.push({ name: row.l, blocks: blocks, size: big, hasVerdict: row.g.indexOf(vg) >= 0 });
  });
  {
    const blocks = [];
    for (let i = 0; i < NR; i += 8) {
      const part = R.slice(i, i + 8);
      blocks.push({ label: "ranks " + rankText(part), ranks: part });
    }
    groupings.push({ name: "consecutive ranks (8)", blocks: blocks });
  }
  let grouping = 0;
  if (!D.hosts) {
    let pick = groupings.findIndex(function (g) { return g.hasVerdict && g.size <= 64; });
    if (pick < 0) {
      let best = Infinity;
      groupings.forEach(function (g, k) { if (g.size && g.size >= 2 && g.size < best) { best = g.size; pick = k; } });
    }
    grouping = pick < 0 ? groupings.length - 1 : pick;
  }
  const select = document.getElementById("tl-group");
  groupings.forEach(function (g, k) {
    const o = document.createElement("option");
    o.value = String(k); o.textContent = g.name;
    select.appendChild(o);
  });
  select.value = String(grouping);
  // blocks holding a guilty rank first, then those with a waiting rank, each in rank order
  groupings.forEach(function (g) {
    const rank = function (b) {
      let best = 2;
      b.ranks.forEach(function (r) { const ro = role(r); best = Math.min(best, ro === "g" ? 0 : ro === "w" ? 1 : 2); });
      return best;
    };
    g.blocks.forEach(function (b, k) { b.pri = rank(b); b.at = k; });
    g.blocks.sort(function (a, b) { return a.pri - b.pri || a.at - b.at; });
  });
  let expanded = new Set(), tlRows = [];
  function defaultExpanded() {
    expanded = new Set();
    const blocks = groupings[grouping].blocks;
    const want = D.focus.length ? D.focus : R.slice(0, 16);
    const pri = function (r) { return role(r) === "g" ? 0 : 1; };
    const ordered = want.slice().sort(function (a, b) { return pri(a) - pri(b); });
    let shown = 0;
    for (const r of ordered) {
      const k = blocks.findIndex(function (b) { return b.ranks.indexOf(r) >= 0; });
      if (k < 0 || expanded.has(k)) continue;
      if (shown && shown + blocks[k].ranks.length > 64) continue;
      expanded.add(k);
      shown += blocks[k].ranks.length;
    }
  }
  function buildRows() {
    tlRows = [];
    groupings[grouping].blocks.forEach(function (b, k) {
      tlRows.push({ block: k });
      if (expanded.has(k)) b.ranks.forEach(function (r) { tlRows.push({ rank: r, block: k }); });
    });
    const total = tlRows.length * TL.rowH + TL.axisH;
    const viewH = Math.min(TL.viewH, total);
    tlScroll.style.height = viewH + 2 + "px";
    document.getElementById("tl-spacer").style.height = Math.max(0, total - viewH) + "px";
  }
  let t0 = 0, t1 = 1;
  function fitAll() {
    const span = Math.max(1, tMax - tMin);
    t0 = tMin - span * 0.02; t1 = Math.max(tMax, 0) + span * 0.04;
  }
  function aroundHang() {
    if (T.hang === null || T.hang === undefined) { fitAll(); return; }
    // from before the hang and the guilty ranks' newest ops (where they left) to the end
    let from = T.hang;
    R.forEach(function (r) {
      const span = role(r) === "g" ? opsOf.get(r) : null;
      if (span) from = Math.min(from, O.s[span[1] - 1]);
    });
    const span = Math.max(1000, -from);
    t0 = from - span * 0.25; t1 = span * 0.08;
  }
  function fmtTime(us) {
    const a = Math.abs(us);
    if (a >= 1e6) return (us / 1e6).toFixed(a >= 1e7 ? 1 : 2) + " s";
    if (a >= 1e3) return (us / 1e3).toFixed(a >= 1e4 ? 1 : 2) + " ms";
    return us.toFixed(0) + " µs";
  }
  function niceStep(span, n) {
    const raw = span / n, p = Math.pow(10, Math.floor(Math.log10(raw))), f = raw / p;
    return (f < 1.5 ? 1 : f < 3.5 ? 2 : f < 7.5 ? 5 : 10) * p;
  }
  function sliceColour(j) { return O.c[j] === 0 ? COL.d : O.c[j] === 1 ? COL.p : COL.u; }
  function drawTimeline() {
    const W = tlScroll.clientWidth;
    const H = parseFloat(tlScroll.style.height) - 2;
    const ctx = setup(tlCanvas, W, H);
    const plotW = Math.max(40, W - TL.labelW - 8), x0 = TL.labelW;
    const X = function (t) { return x0 + (t - t0) / (t1 - t0) * plotW; };
    const top = tlScroll.scrollTop;
    const first = Math.max(0, Math.floor(top / TL.rowH));
    const count = Math.ceil((H - TL.axisH) / TL.rowH) + 1;
    const blocks = groupings[grouping].blocks;
    ctx.save();
    ctx.beginPath(); ctx.rect(0, TL.axisH, W, H - TL.axisH); ctx.clip();
    for (let k = first; k < Math.min(tlRows.length, first + count); k++) {
      const row = tlRows[k], y = TL.axisH + k * TL.rowH - top;
      const header = row.rank === undefined;
      const b = blocks[row.block];
      if (header) { ctx.fillStyle = COL.panel; ctx.fillRect(0, y, W, TL.rowH); }
      let label, colour = COL.ink;
      if (header) {
        let g = 0, w = 0;
        b.ranks.forEach(function (r) { const ro = role(r); if (ro === "g") g++; else if (ro === "w") w++; });
        label = (expanded.has(row.block) ? "▾ " : "▸ ") + b.label + ": " +
          (g || w ? (g ? g + " guilty" : "") + (g && w ? ", " : "") + (w ? w + " waiting" : "")
            : b.ranks.length + " rank" + (b.ranks.length > 1 ? "s" : ""));
        if (g) colour = COL.guilty;
      } else {
        const ro = role(row.rank);
        label = "    rank " + row.rank + (ro === "g" ? "  guilty" : ro === "w" ? "  waiting" : ro === "a" ? "  no record" : "");
        colour = ro === "g" ? COL.guilty : ro === "w" ? "#9a6b00" : COL.ink;
      }
      ctx.fillStyle = colour;
      ctx.font = (header ? "600 " : "") + FONT;
      ctx.fillText(fit(ctx, label, TL.labelW - 6), 2, y + TL.rowH / 2);
      ctx.font = FONT;
      if (!O) continue;
      const ranks = header ? (expanded.has(row.block) ? [] : b.ranks) : [row.rank];
      ctx.globalAlpha = header ? 0.55 : 1;
      ranks.forEach(function (r) {
        const span = opsOf.get(r);
        if (!span) return;
        for (let j = span[0]; j < span[1]; j++) {
          const a = X(O.s[j]), e = X(O.s[j] + O.d[j]);
          if (e < x0 || a > x0 + plotW) continue;
          const xa = Math.max(a, x0), w = Math.max(1.5, Math.min(e, x0 + plotW) - xa);
          ctx.fillStyle = sliceColour(j);
          ctx.fillRect(xa, y + 2, w, TL.rowH - 4);
          if (!O.e[j] && O.c[j] === 0 && w > 4) {  // end not recorded: hatched
            ctx.strokeStyle = "rgba(255,255,255,0.8)";
            ctx.lineWidth = 1;
            ctx.beginPath();
            for (let hx = xa + 3; hx < xa + w; hx += 5) { ctx.moveTo(hx, y + 2); ctx.lineTo(hx - 3, y + TL.rowH - 2); }
            ctx.stroke();
          }
          if (!header && isVerdictOp(j)) {
            ctx.strokeStyle = COL.guilty; ctx.lineWidth = 1.5;
            ctx.strokeRect(xa + 0.5, y + 1.5, Math.max(w - 1, 1), TL.rowH - 3);
          }
        }
      });
      ctx.globalAlpha = 1;
      ctx.strokeStyle = COL.line; ctx.lineWidth = 0.5;
      ctx.beginPath(); ctx.moveTo(0, y + TL.rowH - 0.25); ctx.lineTo(W, y + TL.rowH - 0.25); ctx.stroke();
    }
    // the hang and the end of the records, across all rows
    const mark = function (t, colour, dash) {
      const x = X(t);
      if (x < x0 || x > x0 + plotW) return;
      ctx.strokeStyle = colour; ctx.lineWidth = 1.5; ctx.setLineDash(dash);
      ctx.beginPath(); ctx.moveTo(x, TL.axisH); ctx.lineTo(x, H); ctx.stroke();
      ctx.setLineDash([]);
    };
    mark(0, COL.ink, []);
    if (T.hang !== null && T.hang !== undefined) mark(T.hang, COL.guilty, [5, 4]);
    ctx.restore();
    // time axis
    ctx.fillStyle = "#fff"; ctx.fillRect(0, 0, W, TL.axisH);
    ctx.strokeStyle = COL.line; ctx.beginPath(); ctx.moveTo(0, TL.axisH - 0.5); ctx.lineTo(W, TL.axisH - 0.5); ctx.stroke();
    const step = niceStep(t1 - t0, Math.max(2, Math.floor(plotW / 110)));
    ctx.fillStyle = COL.dim; ctx.textAlign = "center";
    for (let t = Math.ceil(t0 / step) * step; t <= t1; t += step) {
      const x = X(t);
      ctx.fillRect(x, TL.axisH - 5, 1, 5);
      ctx.fillText(fmtTime(t), x, 9);
    }
    ctx.textAlign = "left";
    ctx.fillStyle = COL.ink;
    ctx.fillText(T.end_is_dump_time ? "0 = the dumps' time" : "0 = the newest record", 4, 9);
    if (T.hang !== null && T.hang !== undefined) {
      const x = X(T.hang);
      if (x >= x0 && x <= x0 + plotW) { ctx.fillStyle = COL.guilty; ctx.fillText("hang", x + 3, TL.axisH - 7); }
    }
  }
  function tlHit(ev) {
    const rect = tlCanvas.getBoundingClientRect();
    const x = ev.clientX - rect.left, y = ev.clientY - rect.top;
    if (y < TL.axisH) return null;
    const k = Math.floor((y - TL.axisH + tlScroll.scrollTop) / TL.rowH);
    if (k < 0 || k >= tlRows.length) return null;
    const row = tlRows[k];
    const hit = { row: row, op: -1 };
    if (!O || x < TL.labelW) return hit;
    const plotW = Math.max(40, rect.width - TL.labelW - 8);
    const t = t0 + (x - TL.labelW) / plotW * (t1 - t0), slack = 3 / plotW * (t1 - t0);
    const ranks = row.rank === undefined ? (expanded.has(row.block) ? [] : groupings[grouping].blocks[row.block].ranks) : [row.rank];
    for (const r of ranks) {
      const span = opsOf.get(r);
      if (!span) continue;
      for (let j = span[1] - 1; j >= span[0]; j--) {
        if (t >= O.s[j] - slack && t <= O.s[j] + O.d[j] + slack) { hit.op = j; return hit; }
      }
    }
    return hit;
  }
  function opText(j) {
    const r = O.r[j], ro = role(r);
    const what = T.opnames[O.o[j]] + (O.p[j] >= 0 ? " (peer " + O.p[j] + ") p2p #" : " #") + O.q[j];
    const state = O.c[j] === 0 ? "completed" : O.c[j] === 1 ? "not completed" : "completion unknown";
    return "rank " + r + (ro === "g" ? " (guilty)" : ro === "w" ? " (waiting)" : "") +
      "\n" + what + " on " + groupName(O.g[j]) + "\n" + state +
      (isVerdictOp(j) ? " · the verdict's op" : "") +
      "\nsizes " + T.sizes[O.z[j]] +
      "\nenqueued " + fmtTime(O.s[j]) + (O.c[j] === 0 ?
        (O.e[j] ? ", took " + fmtTime(O.d[j]) : ", end not recorded (drawn to the next op)") :
        ", open for " + fmtTime(O.d[j])) +
      (T.sites[O.k[j]] ? "\nat " + T.sites[O.k[j]] : "");
  }
  let drag = null;
  tlCanvas.addEventListener("mousemove", function (ev) {
    if (drag) {
      const plotW = Math.max(40, tlCanvas.clientWidth - TL.labelW - 8);
      const dt = (ev.clientX - drag.x) / plotW * (drag.t1 - drag.t0);
      t0 = drag.t0 - dt; t1 = drag.t1 - dt;
      drag.moved = true;
      drawTimeline();
      return;
    }
    const h = tlHit(ev);
    if (!h) { hideTip(); return; }
    if (h.op >= 0) showTip(ev, opText(h.op));
    else if (h.row.rank === undefined) showTip(ev, "click: " + (expanded.has(h.row.block) ? "close" : "open") + " this group of ranks");
    else hideTip();
  });
  tlCanvas.addEventListener("mouseleave", function () { hideTip(); drag = null; });
  tlCanvas.addEventListener("mousedown", function (ev) { drag = { x: ev.clientX, t0: t0, t1: t1, moved: false }; });
  tlCanvas.addEventListener("mouseup", function (ev) {
    const moved = drag && drag.moved;
    drag = null;
    if (moved) return;
    const h = tlHit(ev);
    if (h && h.row.rank === undefined) {
      if (expanded.has(h.row.block)) expanded.delete(h.row.block); else expanded.add(h.row.block);
      buildRows(); drawTimeline();
    }
  });
  tlCanvas.addEventListener("wheel", function (ev) {
    if (!ev.ctrlKey && !ev.metaKey) return;
    ev.preventDefault();
    const rect = tlCanvas.getBoundingClientRect();
    const plotW = Math.max(40, rect.width - TL.labelW - 8);
    const at = t0 + Math.max(0, ev.clientX - rect.left - TL.labelW) / plotW * (t1 - t0);
    const f = ev.deltaY > 0 ? 1.25 : 0.8;
    t0 = at - (at - t0) * f; t1 = at + (t1 - at) * f;
    drawTimeline();
  }, { passive: false });
  tlScroll.addEventListener("scroll", function () { drawTimeline(); });
  select.addEventListener("change", function () {
    grouping = Number(select.value);
    defaultExpanded(); buildRows(); tlScroll.scrollTop = 0; drawTimeline();
  });
  document.getElementById("tl-fit").addEventListener("click", function () { fitAll(); drawTimeline(); });
  document.getElementById("tl-hang").addEventListener("click", function () { aroundHang(); drawTimeline(); });

  /* ---- lateness ---- */
  const L = D.lateness, lateCanvas = document.getElementById("late-canvas");
  function drawLateness() {
    if (!L || !lateCanvas) return;
    const W = lateCanvas.parentElement.clientWidth, H = 160, x0 = 60, plotW = W - x0 - 10;
    const ctx = setup(lateCanvas, W, H);
    const val = new Float64Array(NR).fill(NaN);
    L.ranks.forEach(function (r, k) { const i = IDX.get(r); if (i !== undefined) val[i] = L.median[k]; });
    let hi = 0, lo = 0;
    val.forEach(function (x) { if (x > hi) hi = x; if (x < lo) lo = x; });
    hi = hi || 1;
    const per = Math.max(1, Math.ceil(NR / plotW)), nb = Math.ceil(NR / per), bw = plotW / nb;
    const Y = function (x) { return 10 + (hi - x) / (hi - lo) * (H - 30); };
    for (let b = 0; b < nb; b++) {
      let best = NaN, g = false;
      for (let i = b * per; i < Math.min(NR, (b + 1) * per); i++) {
        if (!(val[i] <= best) && !isNaN(val[i])) best = val[i];
        if (D.roles[i] === "g") g = true;
      }
      if (isNaN(best)) continue;
      ctx.fillStyle = g ? COL.guilty : "#7b8fa6";
      const ya = Y(Math.max(best, 0)), yb = Y(Math.min(best, 0));
      ctx.fillRect(x0 + b * bw, ya, Math.max(bw - (bw > 3 ? 1 : 0), 1), Math.max(1, yb - ya));
    }
    ctx.fillStyle = COL.dim;
    ctx.fillText(hi.toFixed(1) + " ms", 2, Y(hi));
    ctx.fillText("0", 2, Y(0));
    ctx.fillRect(x0, Y(0), plotW, 1);
    ctx.fillText("rank " + R[0], x0, H - 8);
    ctx.textAlign = "right"; ctx.fillText("rank " + R[NR - 1], x0 + plotW, H - 8); ctx.textAlign = "left";
  }

  function drawAll() { drawMap(); drawTimeline(); drawLateness(); }
  defaultExpanded();
  buildRows();
  aroundHang();
  if (T.hang === null || T.hang === undefined) fitAll();
  if (zoomed !== null && zoomed !== undefined) zoomGroup(zoomed);
  drawAll();
  let pending = 0;
  window.addEventListener("resize", function () {
    cancelAnimationFrame(pending);
    pending = requestAnimationFrame(drawAll);
  });
  document.body.setAttribute("data-ready", "1");

  /* ---- for tests in a headless browser: file://…/report.html#frtools-selftest hovers
     and clicks like a person would and writes what it saw into data-selftest ---- */
  if (location.hash === "#frtools-selftest") {
    const seen = {};
    const fire = function (el, type, x, y) {
      const r = el.getBoundingClientRect();
      el.dispatchEvent(new MouseEvent(type, { clientX: r.left + x, clientY: r.top + y, bubbles: true }));
    };
    const g = D.roles.indexOf("g");
    if (g >= 0 && mapGeo) {
      fire(mapCanvas, "mousemove", MAP.labelW + Math.floor(g / mapGeo.per) * mapGeo.bw + mapGeo.bw / 2, MAP.top + MAP.rowH / 2);
      seen.map_tip = tip.textContent;
      fire(mapCanvas, "click", MAP.labelW + Math.floor(g / mapGeo.per) * mapGeo.bw + mapGeo.bw / 2, MAP.top + MAP.rowH / 2);
      seen.zoomed = zoomBox.querySelector("h3") ? zoomBox.querySelector("h3").textContent : "";
    }
    const k = tlRows.findIndex(function (row) { return row.rank !== undefined && opsOf.has(row.rank); });
    if (k >= 0 && O) {
      const span = opsOf.get(tlRows[k].rank), j = span[1] - 1;
      const plotW = Math.max(40, tlCanvas.clientWidth - TL.labelW - 8);
      const x = TL.labelW + (O.s[j] + O.d[j] / 2 - t0) / (t1 - t0) * plotW;
      fire(tlCanvas, "mousemove", Math.min(Math.max(x, TL.labelW + 1), TL.labelW + plotW - 1), TL.axisH + k * TL.rowH + TL.rowH / 2);
      seen.slice_tip = tip.textContent;
    }
    const rows = tlRows.length;
    fire(tlCanvas, "mousedown", 20, TL.axisH + 4);
    fire(tlCanvas, "mouseup", 20, TL.axisH + 4);
    seen.rows_before_after = [rows, tlRows.length];
    hideTip();
    document.body.setAttribute("data-selftest", JSON.stringify(seen));
  }
})();
