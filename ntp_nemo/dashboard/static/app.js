// ntp-dashboard page: polls api/state every second and redraws. Text goes in with textContent only.
"use strict";
(function () {
  const POLL_MS = 1000;
  const params = new URLSearchParams(location.search);
  const job = params.get("job");
  const stateUrl = "api/state" + (job !== null ? "?job=" + encodeURIComponent(job) : "");
  const charts = {};
  window.ntpDashboard = { charts: charts, state: null, polls: 0 };
  const $ = (id) => document.getElementById(id);

  function el(tag, text, attrs) {
    const e = document.createElement(tag);
    if (text !== undefined && text !== null) e.textContent = String(text);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
    return e;
  }
  function row(cells) {
    const tr = el("tr");
    for (const c of cells) tr.appendChild(c instanceof Node ? wrap(c) : el("td", c));
    return tr;
  }
  function wrap(node) { const td = el("td"); td.appendChild(node); return td; }
  function fill(tbody, rows) { tbody.replaceChildren(...rows); }
  const fmt = (x, d) => (x === null || x === undefined) ? "-" : Number(x).toFixed(d);
  function bytes(n) {
    if (n === null || n === undefined) return "-";
    const u = ["B", "KiB", "MiB", "GiB", "TiB"]; let i = 0;
    while (n >= 1024 && i < u.length - 1) { n /= 1024; i++; }
    return n.toFixed(i ? 1 : 0) + " " + u[i];
  }

  function chart(id, title, series, data, opts) {
    const host = $(id);
    const width = Math.max(360, Math.min(600, (window.innerWidth - 80) / 2));
    const n = data[0].length;
    const drawn = charts[id];
    if (drawn && n > 0 && drawn.data[0].length > 0 && drawn.series.length === series.length + 1) {
      drawn.setData(data);
      return drawn;
    }
    if (drawn) { drawn.destroy(); delete charts[id]; }
    host.replaceChildren();
    if (n === 0) { host.appendChild(el("p", "no steps yet", { class: "nodata" })); return null; }
    charts[id] = new uPlot(Object.assign({
      title: title, width: width, height: 240,
      scales: { x: { time: false } },
      series: [{ label: opts && opts.xLabel || "x" }].concat(series),
    }, opts || {}), data, host);
    return charts[id];
  }

  const PALETTE = ["#6a1b9a", "#1565c0", "#00838f", "#c62828", "#ef6c00", "#f9a825", "#ad1457", "#2e7d32",
                   "#5d4037", "#455a64"];

  function drawMarkers(u) {
    const m = window.ntpDashboard.markers || { failures: [], relayouts: [] };
    const ctx = u.ctx, top = u.bbox.top, h = u.bbox.height;
    ctx.save();
    ctx.lineWidth = 1.5 * devicePixelRatio;
    const line = (step, colour, dash) => {
      if (step === null || step === undefined) return;
      const x = Math.round(u.valToPos(step, "x", true));
      ctx.strokeStyle = colour; ctx.setLineDash(dash);
      ctx.beginPath(); ctx.moveTo(x, top); ctx.lineTo(x, top + h); ctx.stroke();
    };
    for (const r of m.relayouts) line(r.step, "#1565c0", [6, 4]);
    for (const f of m.failures) line(f.step, "#c62828", []);
    ctx.restore();
  }

  // A cluster job's places as ntp-coordinator knows them (its failover/coordinator.json).
  const PLACE_CLASS = { active: "healthy", done: "healthy", lost: "lost", replacing: "rejoining" };
  function renderCluster(c) {
    $("cluster").hidden = !c;
    if (!c) return;
    const phase = c.ended ? "ended" : c.started ? "training" : c.formed ? "formed" : "forming";
    $("cluster-note").textContent = "(ntp-coordinator: " + phase + ", generation " + c.generation +
      (c.spares.length ? ", " + c.spares.length + " spare(s) waiting" : "") + (c.stop ? "; " + c.stop : "") + ")";
    $("cluster-places").replaceChildren(...c.places.map((p) => el("span", p.place, {
      class: "slot " + (PLACE_CLASS[p.state] || "excluded"), "data-state": p.state,
      title: p.state + (p.host ? " on " + p.host : "") + ", heartbeat " + fmt(p.age_s, 1) + " s ago" })));
    fill($("places").tBodies[0], c.places.map((p) => {
      const tr = row([p.place, p.host || "-", p.state, p.step === null ? "-" : p.step, p.phase || "-",
                      p.age_s === null ? "-" : fmt(p.age_s, 1) + " s"]);
      tr.setAttribute("data-state", p.state);
      return tr;
    }));
  }

  function renderLayout(lay) {
    const box = $("layout");
    box.setAttribute("data-state", lay.state);
    $("layout-name").textContent = lay.current ? lay.current + " (nominal TP " + lay.nominal_tp +
      (lay.pp > 1 ? ", PP " + lay.pp : "") + ")" : "";
    const nodes = [];
    for (const r of lay.replicas) {
      const d = el("div", null, { class: "replica", "data-state": r.state, "data-replica": r.index });
      d.appendChild(el("b", "replica " + r.index + ": TP " + r.active + " of " + r.nominal));
      r.stages.forEach((stage, st) => {
        const slots = el("div", null, { class: "slots" });
        if (r.stages.length > 1) slots.appendChild(el("span", "stage " + st, { class: "stage" }));
        for (const s of stage) {
          const title = s.state + (s.rank !== null ? ", rank " + s.rank : "") + (s.speed ? ", speed " + s.speed : "");
          slots.appendChild(el("span", s.rank !== null ? s.rank : "x", { class: "slot " + s.state, title: title,
                                                                          "data-state": s.state }));
        }
        d.appendChild(slots);
      });
      d.appendChild(el("div", "batch share: " + r.share + " micro-batches"));
      if (r.layer_tp) d.appendChild(el("div", "TP per layer slot (emb, layers, head): " + r.layer_tp.join(",")));
      nodes.push(d);
    }
    box.replaceChildren(...nodes);
    renderCluster(lay.cluster);
    fill($("beats").tBodies[0], lay.heartbeats.map((b) => {
      const tr = row([b.file, b.pid, b.step, b.phase, fmt(b.age_s, 1) + " s"]);
      if (b.age_s > 30 && b.phase !== "end") tr.classList.add("stale");
      return tr;
    }));
  }

  function renderGoodput(gp) {
    const v = $("goodput-value");
    if (!gp || !gp.report) {
      v.textContent = gp && gp.error ? "(" + gp.error + ")" : "";
      v.setAttribute("data-value", "");
      return;
    }
    const rep = gp.report, s = gp.series;
    v.textContent = (100 * rep.goodput).toFixed(1) + "% (last 30 s: " + fmt(gp.rolling, 1) + "%, capacity " +
      (100 * rep.capacity_fraction).toFixed(1) + "%)";
    v.setAttribute("data-value", String(100 * rep.goodput));
    chart("goodput-chart", "goodput (%)", [
      { label: "cumulative", stroke: "#2e7d32", width: 2 },
      { label: "last 30 s", stroke: "#1565c0", dash: [4, 3] },
    ], [s.t, s.goodput, s.rolling], { xLabel: "seconds", scales: { x: { time: false }, y: { range: [0, 100] } } });
    const cats = Object.keys(rep.badput_s);
    chart("badput-chart", "badput (s)", cats.map((c, i) => ({ label: c, stroke: PALETTE[i % PALETTE.length] })),
          [s.t].concat(cats.map((c) => s[c])), { xLabel: "seconds" });
    const pct = (x) => rep.total_s > 0 ? (100 * x / rep.total_s).toFixed(1) : "-";
    const rows = [row(["productive", fmt(rep.productive_s, 2) + " s", pct(rep.productive_s) + " %"])];
    for (const c of cats) rows.push(row([c, fmt(rep.badput_s[c], 2) + " s", pct(rep.badput_s[c]) + " %"]));
    rows.push(row(["total", fmt(rep.total_s, 2) + " s", ""]));
    rows.push(row(["steps completed / redone", rep.steps_completed + " / " + rep.steps_redone, ""]));
    rows.push(row(["failures", rep.failures, ""]));
    fill($("breakdown").tBodies[0], rows);
  }

  function renderRun(st) {
    $("run").hidden = false;
    $("sweep").hidden = true;
    const empty = $("empty");
    if (st.status === "not_started") {
      empty.hidden = false;
      empty.textContent = "This run has not started yet: nothing in " + st.run_dir +
        " to show so far (no metrics.jsonl or goodput.jsonl). The page updates by itself once it starts.";
    } else {
      empty.hidden = true;
    }
    const last = st.loss.step.length ? st.loss.step[st.loss.step.length - 1] : 0;
    $("progress").textContent = "step " + last + (st.max_steps ? " / " + st.max_steps : "");
    window.ntpDashboard.markers = st.markers;
    renderLayout(st.layout);
    chart("loss-chart", "training loss", [{ label: "loss", stroke: "#c62828", width: 1.5 }],
          [st.loss.step, st.loss.loss], { xLabel: "step", hooks: { draw: [drawMarkers] } });
    if (charts["loss-chart"]) charts["loss-chart"].redraw(false, false);
    renderGoodput(st.goodput);
    fill($("timeline").tBodies[0], st.timeline.map((e) => row([fmt(e.t, 2), e.event, fmt(e.cost_s, 3), e.details])));
    fill($("checkpoints").tBodies[0], st.checkpoints.map((c) => {
      const tr = row([c.step, bytes(c.size_bytes), c.valid ? "yes" : "no: " + c.problem, c.name]);
      tr.setAttribute("data-valid", c.valid ? "true" : "false");
      return tr;
    }));
  }

  function renderSweep(st) {
    $("run").hidden = true;
    $("sweep").hidden = false;
    $("empty").hidden = st.jobs.length > 0;
    $("empty").textContent = "This sweep has no job directories yet.";
    const cols = [];
    for (const j of st.jobs) for (const k of Object.keys(j.values)) if (!cols.includes(k)) cols.push(k);
    const head = el("tr");
    for (const c of ["job", "status", "overrides"].concat(cols)) head.appendChild(el("th", c));
    $("jobs").tHead.replaceChildren(head);
    fill($("jobs").tBodies[0], st.jobs.map((j) => {
      const a = el("a", j.job, { href: "?job=" + encodeURIComponent(j.job) });
      const v = cols.map((c) => typeof j.values[c] === "number" ? Number(j.values[c].toPrecision(5)) : j.values[c]);
      return row([a, j.status, j.overrides].concat(v.map((x) => x === undefined || x === null ? "-" : x)));
    }));
  }

  async function poll() {
    try {
      const r = await fetch(stateUrl, { cache: "no-store" });
      const body = await r.json();
      if (!r.ok) throw new Error(body.error || r.statusText);
      $("error").hidden = true;
      window.ntpDashboard.state = body;
      $("title").textContent = body.name + (job !== null ? " (job " + job + ")" : "");
      $("back").hidden = job === null;
      const status = body.kind === "sweep" ? "sweep" : body.status;
      $("status").textContent = status.replace("_", " ");
      $("status").setAttribute("data-status", status);
      if (body.kind === "sweep") renderSweep(body); else renderRun(body);
      $("updated").textContent = "updated " + new Date().toLocaleTimeString();
    } catch (err) {
      $("error").hidden = false;
      $("error").textContent = "Cannot read the run: " + err.message;
    } finally {
      window.ntpDashboard.polls += 1;
      setTimeout(poll, POLL_MS);
    }
  }
  poll();
})();
