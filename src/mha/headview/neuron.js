(function () {
  "use strict";
  // data.q[i], data.k[i]: layer data.layers[i]'s q (heads, n, d_head) and k (kv_heads, n, d_head),
  // float32; the score of query i and key j is (q_i . k_j) * scale[layer], softmax over the keys
  // the query sees (j <= i when causal)
  var data = JSON.parse(document.getElementById("mha-data").textContent);
  var N = data.n, D = data.d_head, H = data.n_heads, HKV = data.n_kv_heads, tokens = data.tokens;
  var cache = {};
  function vectors(slot) {
    if (!cache[slot]) cache[slot] = { q: MHA.floatsFromBase64(data.q[slot], H * N * D),
                                      k: MHA.floatsFromBase64(data.k[slot], HKV * N * D) };
    return cache[slot];
  }
  var state = { slot: Math.max(0, data.layers.indexOf(data.layer)), head: data.head, hover: null, pinned: 0 };

  // q, every k, q * k, q . k * scale and the softmax for the current query
  function compute() {
    var V = vectors(state.slot), l = data.layers[state.slot], i = state.hover !== null ? state.hover : state.pinned;
    var qh = state.head, kh = Math.floor(state.head / (H / HKV)), scale = data.scale[l];
    var q = V.q.subarray((qh * N + i) * D, (qh * N + i + 1) * D);
    var keys = [], prod = [], score = new Float64Array(N), p = new Float64Array(N), top = -Infinity, j, d;
    var qmax = 0, pmax = 0;
    for (d = 0; d < D; d++) qmax = Math.max(qmax, Math.abs(q[d]));
    for (j = 0; j < N; j++) {
      var k = V.k.subarray((kh * N + j) * D, (kh * N + j + 1) * D), pr = new Float64Array(D), s = 0;
      for (d = 0; d < D; d++) { pr[d] = q[d] * k[d]; s += pr[d]; qmax = Math.max(qmax, Math.abs(k[d])); pmax = Math.max(pmax, Math.abs(pr[d])); }
      keys.push(k); prod.push(pr);
      score[j] = s * scale;
      if ((!data.causal || j <= i) && score[j] > top) top = score[j];
    }
    var total = 0;
    for (j = 0; j < N; j++) { p[j] = !data.causal || j <= i ? Math.exp(score[j] - top) : 0; total += p[j]; }
    for (j = 0; j < N; j++) p[j] /= total;
    return { i: i, layer: l, q: q, keys: keys, prod: prod, score: score, p: p, vmax: qmax || 1, pmax: pmax || 1 };
  }

  var canvas = document.getElementById("mha-canvas"), ctx = MHA.canvasContext(canvas.getContext("2d"));
  var vp = new MHA.Viewport(canvas, requestDraw);
  var statusEl = document.getElementById("mha-status"), geo = null;

  function layout() {
    var rowH = N > 150 ? 12 : (N > 60 ? 14 : 18), font = (N > 120 ? 10 : 12) + "px " + MHA.FONT, widest = 0;
    ctx.font = font;
    for (var i = 0; i < N; i++) widest = Math.max(widest, ctx.measureText(tokens[i]).width);
    var colW = Math.min(Math.max(widest + 12, 48), 150), cw = Math.max(2, Math.min(8, Math.floor(200 / D)));
    var x0 = 10, xk = x0 + colW + 10, xp = xk + D * cw + 16, xs = xp + D * cw + 16, xb = xs + 78, xt = xb + 124;
    geo = { rowH: rowH, font: font, colW: colW, cw: cw, x0: x0, xk: xk, xp: xp, xs: xs, xb: xb, xt: xt,
            top: 64 + rowH, width: xt + colW + 10, height: 64 + rowH + N * rowH + 14 };
    vp.setSize(geo.width, geo.height);
  }
  function rowY(j) { return geo.top + j * geo.rowH + geo.rowH / 2; }

  function paint(c, band) {          // the band {y0, y1} of the picture
    var g = geo, r = compute(), cw = g.cw, rh = g.rowH;
    var first = Math.max(0, Math.floor((band.y0 - g.top) / rh)), last = Math.min(N, Math.ceil((band.y1 - g.top) / rh));
    MHA.heading(c, g.width, g.height, (data.title ? data.title + " \u2014 " : "") + data.name + ", layer " + r.layer +
                ", head " + state.head + (HKV < H ? " (key head " + Math.floor(state.head / (H / HKV)) + ")" : ""));
    c.font = "11px " + MHA.FONT;
    c.fillStyle = "#666";
    c.textAlign = "left";
    c.fillText("query", g.x0, 34);
    c.fillText("key k", g.xk, 34);
    c.fillText("q \u00d7 k (elementwise)", g.xp, 34);
    c.fillText("q \u00b7 k \u00d7 scale", g.xs, 34);
    c.fillText("(scale " + data.scale[r.layer].toPrecision(3) + ")", g.xs, 48);
    c.fillText("softmax", g.xb, 34);
    c.fillText("key", g.xt, 34);
    // the query vector q, above the keys
    c.fillStyle = "#333";
    c.textAlign = "right";
    c.fillText("q of \u201c" + MHA.fit(c, tokens[r.i], 90) + "\u201d", g.xk - 4, 52);
    c.putCells(g.xk, 52 - rh / 2 + 1, cw, rh - 2, 1, D, function (_, d) { return r.q[d] / r.vmax; }, MHA.diverging);
    // every key and its product with q: two blocks of cells (keys a query cannot see: blank)
    c.putCells(g.xk, g.top, cw, rh, N, D, function (j, d) { return !data.causal || j <= r.i ? r.keys[j][d] / r.vmax : NaN; }, MHA.diverging);
    c.putCells(g.xp, g.top, cw, rh, N, D, function (j, d) { return !data.causal || j <= r.i ? r.prod[j][d] / r.pmax : NaN; }, MHA.diverging);
    // rows: query tokens, then per key k, q * k, the score, the softmax bar, the key token
    c.font = g.font;
    for (var j = first; j < last; j++) {
      var y = g.top + j * rh, seen = !data.causal || j <= r.i;
      if (j === r.i) { c.fillStyle = "#000"; c.globalAlpha = 0.07; c.fillRect(g.x0, y, g.colW, rh); c.globalAlpha = 1; }
      c.fillStyle = j === r.i ? "#000" : "#444";
      c.textAlign = "right";
      c.fillText(MHA.fit(c, tokens[j], g.colW - 8), g.x0 + g.colW - 4, y + rh / 2);
      c.fillStyle = seen ? "#222" : "#aaa";
      c.textAlign = "right";
      c.fillText(seen ? r.score[j].toFixed(2) : "masked", g.xs + 60, y + rh / 2);
      c.fillStyle = "#1f77b4";
      c.fillRect(g.xb, y + 2, 70 * r.p[j], rh - 4);
      c.fillStyle = "#222";
      c.textAlign = "left";
      c.fillText(r.p[j].toFixed(3), g.xb + 76, y + rh / 2);
      c.fillText(MHA.fit(c, tokens[j], g.colW - 8), g.xt, y + rh / 2);
    }
    c.strokeStyle = "#000";
    c.lineWidth = 1;
    c.strokeRect(g.x0 + 0.5, g.top + r.i * rh + 0.5, g.colW - 1, rh - 1);
    return r;
  }

  var last = null, drawer = MHA.drawing(function () {
    last = paint(ctx, vp.begin(ctx));
    var order = Array.from(last.p.keys()).sort(function (a, b) { return last.p[b] - last.p[a]; }).slice(0, 4);
    statusEl.textContent = (state.hover === null ? "Pinned: " : "") + "\u201c" + tokens[last.i] + "\u201d (#" + last.i + ") attends to: " +
      order.map(function (j) { return tokens[j] + " " + last.p[j].toFixed(2); }).join(" \u00b7 ");
  });
  function draw() { drawer.now(); }
  function requestDraw() { drawer.later(); }

  function hit(ev) {
    var pt = vp.pointer(ev), x = pt.x, y = pt.y;
    var j = Math.floor((y - geo.top) / geo.rowH);
    return x >= geo.x0 && x <= geo.x0 + geo.colW && j >= 0 && j < N ? j : null;
  }
  canvas.addEventListener("pointermove", function (ev) {
    var j = hit(ev);
    canvas.style.cursor = j === null ? "default" : "pointer";
    if (j !== state.hover) { state.hover = j; requestDraw(); }
  });
  canvas.addEventListener("pointerleave", function () { if (state.hover !== null) { state.hover = null; requestDraw(); } });
  canvas.addEventListener("click", function (ev) {
    var j = hit(ev);
    if (j !== null) { state.pinned = j; state.hover = null; requestDraw(); }
  });

  var layerSel = document.getElementById("mha-layer"), headSel = document.getElementById("mha-head");
  data.layers.forEach(function (l, i) { layerSel.add(new Option(l, i)); });
  for (var h = 0; h < H; h++) headSel.add(new Option(h, h));
  layerSel.value = state.slot;
  headSel.value = state.head;
  layerSel.addEventListener("change", function () { state.slot = +layerSel.value; requestDraw(); });
  headSel.addEventListener("change", function () { state.head = +headSel.value; requestDraw(); });

  var svg = MHA.exportButtons(vp, paint, ctx, fileName);
  function fileName(ext) { return "neuron_view_layer" + data.layers[state.slot] + "_head" + state.head + "." + ext; }

  layout();
  draw();
  document.body.setAttribute("data-ready", "1");
  window.mhaNeuronView = {
    state: state,
    stats: function () { return { drawCount: drawer.count, settled: drawer.idle() && vp.drawn(), lastDrawMs: drawer.ms, width: geo.width, height: geo.height }; },
    result: function () { return { i: last.i, layer: last.layer, p: Array.from(last.p), score: Array.from(last.score), q: Array.from(last.q) }; },
    svg: svg,
    tokenPoint: function (j) { return vp.pagePoint(geo.x0 + geo.colW / 2, rowY(j)); }
  };
})();
