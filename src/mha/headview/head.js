(function () {
  "use strict";

  // ---- data --------------------------------------------------------------------------------
  // data.sources: what the lines can show (raw weights, rollout, value norms...), each
  // {name, label, kind: "probability" | "norm", n_heads, scale: [per layer], layers: [b64]}:
  // layer l is (n_heads, n_q, n_k) bytes, value = byte / 255 * scale[l].
  var started = performance.now(), timings = {};
  var data = JSON.parse(document.getElementById("mha-data").textContent);
  timings.json = performance.now() - started;
  var L = data.n_layers, NQ = data.n_q, NK = data.n_k;
  var qTokens = data.tokens, kTokens = data.key_tokens || data.tokens;
  var sources = data.sources, stores = sources.map(function (s) { return MHA.layerStore(s, NQ, NK); });
  var maxHeads = Math.max.apply(null, sources.map(function (s) { return s.n_heads; }));
  var colors = MHA.headColors(maxHeads), FUSED = "#08306b";

  var state = {
    source: 0,
    layer: Math.min(Math.max(data.layer | 0, 0), L - 1),
    layerMode: "one",        // "one", or "mean" / "max" over the layers
    headMode: "each",        // "each" head in its colour, or their "mean" / "max"
    selected: [],            // per head of the current source
    filter: "all",
    threshold: data.threshold,
    hover: null,             // {side: "L" | "R", k: row in that column}
    pins: []                 // pinned rows: several queries (side L) or one key (side R)
  };

  function src() { return sources[state.source]; }
  function selectedHeads() { var s = []; for (var h = 0; h < src().n_heads; h++) if (state.selected[h]) s.push(h); return s; }

  // one head's values as floats, for one layer or fused over the layers (cached per picture)
  var headCache = { key: null, heads: {} };
  function headValues(h) {
    var key = state.source + "|" + (state.layerMode === "one" ? state.layer : state.layerMode);
    if (headCache.key !== key) headCache = { key: key, heads: {} };
    if (headCache.heads[h]) return headCache.heads[h];
    var s = src(), size = NQ * NK, out = new Float32Array(size), l, i;
    var layers = state.layerMode === "one" ? [state.layer] : Array.from({ length: L }, function (_, l) { return l; });
    for (var c = 0; c < layers.length; c++) {
      l = layers[c];
      var A = stores[state.source](l), base = h * size, f = s.scale[l] / 255;
      for (i = 0; i < size; i++) {
        var v = A[base + i] * f;
        if (c === 0) out[i] = v;
        else if (state.layerMode === "max") { if (v > out[i]) out[i] = v; }
        else out[i] += v;
      }
    }
    if (state.layerMode === "mean") for (i = 0; i < size; i++) out[i] /= layers.length;
    return (headCache.heads[h] = out);
  }

  // what is drawn: [{color, head, values, vmax}]; one entry per selected head, or one fused
  var pictureCache = { key: null, list: null };
  function pictures() {
    var sel = selectedHeads();
    var key = state.source + "|" + (state.layerMode === "one" ? state.layer : state.layerMode) +
              "|" + state.headMode + "|" + sel.join(",");
    if (pictureCache.key === key) return pictureCache.list;
    var list = [], i;
    if (state.headMode === "each" || sel.length < 2) {
      for (var s = 0; s < sel.length; s++) list.push({ color: colors[sel[s]], head: sel[s], values: headValues(sel[s]) });
    } else {
      var out = new Float32Array(NQ * NK);
      for (var t = 0; t < sel.length; t++) {
        var v = headValues(sel[t]);
        for (i = 0; i < out.length; i++) {
          if (state.headMode === "max") { if (t === 0 || v[i] > out[i]) out[i] = v[i]; }
          else out[i] += v[i] / sel.length;
        }
      }
      list.push({ color: FUSED, head: -1, values: out });
    }
    // line opacity = value / vmax: 1 for probabilities, the largest value shown for norms
    var vmax = 1;
    if (src().kind === "norm") {
      vmax = 0;
      for (var p = 0; p < list.length; p++) for (i = 0; i < list[p].values.length; i++) vmax = Math.max(vmax, list[p].values[i]);
      vmax = vmax || 1;
    }
    list.forEach(function (p) { p.vmax = vmax; });
    pictureCache = { key: key, list: list };
    return list;
  }

  // ---- geometry ----------------------------------------------------------------------------
  var canvas = document.getElementById("mha-canvas"), ctx = MHA.canvasContext(canvas.getContext("2d"));
  var vp = new MHA.Viewport(canvas, requestDraw);
  var statusEl = document.getElementById("mha-status"), hint = document.getElementById("mha-hint");
  var geo = null;

  function visible() {       // the query (left) and key (right) positions shown
    var s = data.sentence_b_start, i, left = [], right = [];
    if (s === null || state.filter === "all") {
      for (i = 0; i < NQ; i++) left.push(i);
      for (i = 0; i < NK; i++) right.push(i);
      return { left: left, right: right };
    }
    var a = [], b = [];
    for (i = 0; i < NQ; i++) (i >= s ? b : a).push(i);
    return { left: state.filter[0] === "a" ? a : b, right: state.filter[1] === "a" ? a : b };
  }

  function layout() {
    var vis = visible(), N = Math.max(NQ, NK);
    var rows = Math.max(vis.left.length, vis.right.length);
    var fontPx = N > 120 ? 11 : 13;
    var rowH = N > 150 ? 14 : (N > 60 ? 16 : 20);
    var font = fontPx + "px " + MHA.FONT;
    ctx.font = font;
    var widest = 0, i;
    for (i = 0; i < NQ; i++) widest = Math.max(widest, ctx.measureText(qTokens[i]).width);
    for (i = 0; i < NK; i++) widest = Math.max(widest, ctx.measureText(kTokens[i]).width);
    var colW = Math.min(Math.max(widest + 14, 48), 180);
    var gap = Math.max(220, Math.min(320, 160 + rows * 2));
    var pad = 10, top = 52, strip = Math.min(Math.max(maxHeads * 7, 28), 84);
    geo = {
      left: vis.left, right: vis.right, rowH: rowH, font: font, fontPx: fontPx, colW: colW,
      strip: strip, x0: pad + strip + 4, x1: pad + strip + 4 + colW, x2: pad + strip + 4 + colW + gap,
      x3: pad + strip + 4 + 2 * colW + gap, top: top,
      width: Math.ceil(2 * pad + 2 * strip + 8 + 2 * colW + gap), height: Math.ceil(top + rows * rowH + 12),
      qLabels: qTokens.map(function (t) { return MHA.fit(ctx, t, colW - 10); }),
      kLabels: kTokens.map(function (t) { return MHA.fit(ctx, t, colW - 10); })
    };
    vp.setSize(geo.width, geo.height);
    overviewCache = null;
  }

  function rowY(k) { return geo.top + k * geo.rowH + geo.rowH / 2; }

  // the focused rows: the pinned ones unless another token is hovered
  function focus() {
    var h = state.hover, onPin = h && state.pins.some(function (p) { return same(p, h); });
    if (state.pins.length && (!h || onPin))
      return { side: state.pins[0].side, rows: state.pins.map(function (p) { return p.k; }), pinned: true };
    if (h) return { side: h.side, rows: [h.k], pinned: false };
    return null;
  }

  // ---- drawing -----------------------------------------------------------------------------
  // lines grouped by (picture, opacity bucket) so that a few strokes draw thousands of lines;
  // kept as coordinates so that the same lines go to a canvas or an SVG
  function bucketLines(collect) {
    var buckets = {};
    collect(function (pic, alpha, xa, ya, xb, yb) {
      var q = Math.min(63, Math.floor(alpha * 64)), key = pic * 64 + q, b = buckets[key];
      if (!b) b = buckets[key] = { pic: pic, alpha: (q + 0.5) / 64, xy: [] };
      b.xy.push(xa, ya, xb, yb);
    });
    var list = [];
    for (var k in buckets) list.push(buckets[k]);
    return list;
  }

  function strokeLines(c, lines, pics, width, band) {
    c.lineWidth = width;
    for (var i = 0; i < lines.length; i++) {
      var b = lines[i], path = c.newPath(), xy = b.xy;
      for (var j = 0; j < xy.length; j += 4) {
        if ((xy[j + 1] < band.y0 && xy[j + 3] < band.y0) || (xy[j + 1] > band.y1 && xy[j + 3] > band.y1)) continue;
        path.moveTo(xy[j], xy[j + 1]); path.lineTo(xy[j + 2], xy[j + 3]);
      }
      c.globalAlpha = Math.min(1, b.alpha);
      c.strokeStyle = pics[b.pic].color;
      c.stroke(path);
    }
    c.globalAlpha = 1;
  }

  var overviewCache = null;
  function overviewLines(pics) {
    var key = pictureCache.key + "|" + state.threshold + "|" + state.filter;
    if (overviewCache && overviewCache.key === key) return overviewCache.lines;
    var left = geo.left, right = geo.right, x1 = geo.x1, x2 = geo.x2;
    var lines = bucketLines(function (add) {
      for (var p = 0; p < pics.length; p++) {
        var V = pics[p].values, min = Math.max(state.threshold, 1 / 255) * pics[p].vmax, inv = 1 / pics[p].vmax;
        for (var a = 0; a < left.length; a++) {
          var base = left[a] * NK, ya = rowY(a);
          for (var b = 0; b < right.length; b++) {
            var v = V[base + right[b]];
            if (v >= min) add(p, v * inv, x1, ya, x2, rowY(b));
          }
        }
      }
    });
    overviewCache = { key: key, lines: lines };
    return lines;
  }

  // per picture, the values along the focused rows (queries) or column (key), and their sum
  function focusValues(f, pics) {
    var other = f.side === "L" ? geo.right : geo.left, mine = f.side === "L" ? geo.left : geo.right;
    return pics.map(function (p) {
      var rows = f.rows.map(function (k) {
        var pos = mine[k], w = new Float32Array(other.length);
        for (var t = 0; t < other.length; t++)
          w[t] = f.side === "L" ? p.values[pos * NK + other[t]] : p.values[other[t] * NK + pos];
        return w;
      });
      var sum = new Float32Array(other.length);
      rows.forEach(function (w) { for (var t = 0; t < w.length; t++) sum[t] += w[t]; });
      return { rows: rows, sum: sum, pic: p };
    });
  }

  // draw the band {y0, y1} of the picture (picture coordinates) into c, a canvas or an SVG
  function paint(c, band) {
    var g = geo, f = focus(), pics = pictures(), sel = selectedHeads(), s = src();
    var first = Math.max(0, Math.floor((band.y0 - g.top) / g.rowH)), last = Math.ceil((band.y1 - g.top) / g.rowH);
    var what = (state.layerMode === "one" ? "Layer " + state.layer : state.layerMode + " of layers") + ", " +
      (s.n_heads === 1 ? "" : (state.headMode !== "each" && sel.length > 1 ? state.headMode + " of " : "") + "heads " +
       (sel.length === s.n_heads ? "all " + s.n_heads : (sel.length ? sel.join(" ") : "none")));
    MHA.heading(c, g.width, g.height, (data.title ? data.title + " \u2014 " : "") + (sources.length > 1 ? s.label + ": " : "") + what);
    c.font = "11px " + MHA.FONT;
    c.fillStyle = "#666";
    c.textAlign = "right";
    c.fillText(data.key_tokens ? "Queries" : "Query", g.x1 - 6, 36);
    c.textAlign = "center";
    c.fillText("attending from \u2192 to", (g.x1 + g.x2) / 2, 36);
    c.textAlign = "left";
    c.fillText(data.key_tokens ? "Keys" : "Key", g.x2 + 6, 36);

    c.lineCap = "butt";
    if (f) {
      var fv = focusValues(f, pics), other = f.side === "L" ? g.right : g.left;
      // heat cells beside the other column: per picture, the (summed) values of the focus
      var cellX = f.side === "L" ? g.x3 + 4 : g.x0 - 4 - g.strip, cellW = g.strip / Math.max(fv.length, 1);
      for (var p = 0; p < fv.length; p++) {
        var top = 0, t;
        for (t = 0; t < other.length; t++) top = Math.max(top, fv[p].sum[t]);
        var norm = Math.max(top, f.rows.length > 1 ? 0 : fv[p].pic.vmax) || 1;
        c.fillStyle = fv[p].pic.color;
        for (t = first; t < Math.min(other.length, last); t++) {
          if (fv[p].sum[t] * 255 < norm) continue;
          c.globalAlpha = Math.min(1, fv[p].sum[t] / norm);
          c.fillRect(cellX + p * cellW, g.top + t * g.rowH + 1, cellW, g.rowH - 2);
        }
      }
      c.globalAlpha = 1;
      var lines = bucketLines(function (add) {
        for (var p = 0; p < fv.length; p++) {
          var inv = 1 / fv[p].pic.vmax;
          for (var r = 0; r < f.rows.length; r++) {
            var fy = rowY(f.rows[r]), w = fv[p].rows[r];
            for (var t = 0; t < other.length; t++) {
              if (w[t] * inv * 255 < 1) continue;
              if (f.side === "L") add(p, w[t] * inv, g.x1, fy, g.x2, rowY(t));
              else add(p, w[t] * inv, g.x1, rowY(t), g.x2, fy);
            }
          }
        }
      });
      strokeLines(c, lines, pics, 2, band);
      // the focused tokens
      f.rows.forEach(function (k) {
        c.fillStyle = "#000";
        c.globalAlpha = 0.08;
        c.fillRect(f.side === "L" ? g.x0 : g.x2, g.top + k * g.rowH, g.colW, g.rowH);
        c.globalAlpha = 1;
        c.strokeStyle = f.pinned ? "#000" : "#999";
        c.lineWidth = 1;
        c.strokeRect((f.side === "L" ? g.x0 : g.x2) + 0.5, g.top + k * g.rowH + 0.5, g.colW - 1, g.rowH - 1);
      });
    } else {
      strokeLines(c, overviewLines(pics), pics, 1, band);
    }
    // tokens
    c.font = g.font;
    c.fillStyle = "#111";
    c.textAlign = "right";
    for (var a = first; a < Math.min(g.left.length, last); a++) c.fillText(g.qLabels[g.left[a]], g.x1 - 6, rowY(a));
    c.textAlign = "left";
    for (var b = first; b < Math.min(g.right.length, last); b++) c.fillText(g.kLabels[g.right[b]], g.x2 + 6, rowY(b));
    return f && fv;
  }

  var lastFocus = null, drawer = MHA.drawing(function () { lastFocus = paint(ctx, vp.begin(ctx)); updateStatus(); });
  function draw() { drawer.now(); }
  function requestDraw() { drawer.later(); }

  function fmt(v) { return src().kind === "norm" ? v.toPrecision(3) : v.toFixed(2); }

  function updateStatus() {
    var f = focus();
    if (!f) { statusEl.innerHTML = ""; statusEl.appendChild(hint); return; }
    var fv = lastFocus, other = f.side === "L" ? geo.right : geo.left, mine = f.side === "L" ? geo.left : geo.right;
    var otherTokens = f.side === "L" ? kTokens : qTokens, myTokens = f.side === "L" ? qTokens : kTokens;
    var mean = new Float64Array(other.length), t, p;
    for (p = 0; p < fv.length; p++) for (t = 0; t < other.length; t++) mean[t] += fv[p].sum[t] / fv.length;
    var order = [];
    for (t = 0; t < other.length; t++) order.push(t);
    order.sort(function (x, y) { return mean[y] - mean[x]; });
    var parts = [];
    for (t = 0; t < Math.min(5, order.length); t++)
      if (mean[order[t]] > 0) parts.push(otherTokens[other[order[t]]] + " " + fmt(mean[order[t]]));
    var who = f.rows.length > 1 ? "\u03a3 of " + f.rows.length + " queries (" +
      f.rows.slice(0, 4).map(function (k) { return "\u201c" + myTokens[mine[k]] + "\u201d"; }).join(" ") + (f.rows.length > 4 ? " \u2026" : "") + ")"
      : "\u201c" + myTokens[mine[f.rows[0]]] + "\u201d (#" + mine[f.rows[0]] + ")";
    var verb = f.side === "L" ? " attends to: " : " is attended by: ";
    statusEl.textContent = (f.pinned ? "Pinned: " : "") + who + verb +
      (parts.length ? parts.join(" \u00b7 ") : "(nothing above 0.002)") +
      (fv.length > 1 ? "  [mean of " + fv.length + " heads]" : fv.length ? (fv[0].pic.head >= 0 ? "  [head " + fv[0].pic.head + "]" : "  [" + state.headMode + " of heads]") : "  [no head selected]");
  }


  // ---- interaction -------------------------------------------------------------------------
  function hit(ev) {
    var pt = vp.pointer(ev), x = pt.x, y = pt.y;
    var k = Math.floor((y - geo.top) / geo.rowH);
    if (k < 0) return null;
    if (x >= geo.x0 && x <= geo.x1 && k < geo.left.length) return { side: "L", k: k };
    if (x >= geo.x2 && x <= geo.x3 && k < geo.right.length) return { side: "R", k: k };
    return null;
  }
  function same(a, b) { return a === b || (a && b && a.side === b.side && a.k === b.k); }

  canvas.addEventListener("pointermove", function (ev) {
    var hv = hit(ev);
    canvas.style.cursor = hv ? "pointer" : "default";
    if (!same(hv, state.hover)) { state.hover = hv; requestDraw(); }
  });
  canvas.addEventListener("pointerleave", function () {
    if (state.hover) { state.hover = null; requestDraw(); }
  });
  canvas.addEventListener("click", function (ev) {
    var hv = hit(ev);
    if (!hv) { state.pins = []; requestDraw(); return; }
    var at = -1;
    state.pins.forEach(function (p, i) { if (same(p, hv)) at = i; });
    if ((ev.shiftKey || ev.ctrlKey || ev.metaKey) && hv.side === "L" && (!state.pins.length || state.pins[0].side === "L")) {
      if (at >= 0) state.pins.splice(at, 1); else state.pins.push(hv);       // add or remove a query
    } else {
      state.pins = at >= 0 && state.pins.length === 1 ? [] : [hv];
    }
    requestDraw();
  });
  document.addEventListener("keydown", function (ev) {
    if (ev.key === "Escape" && state.pins.length) { state.pins = []; requestDraw(); }
  });

  var layerSel = document.getElementById("mha-layer");
  for (var l = 0; l < L; l++) layerSel.add(new Option(l, l));
  if (L > 1) { layerSel.add(new Option("mean", "mean")); layerSel.add(new Option("max", "max")); }
  layerSel.value = state.layer;
  layerSel.addEventListener("change", function () {
    if (layerSel.value === "mean" || layerSel.value === "max") state.layerMode = layerSel.value;
    else { state.layerMode = "one"; state.layer = +layerSel.value; }
    requestDraw();
  });

  var fuseSel = document.getElementById("mha-fuse");
  fuseSel.addEventListener("change", function () { state.headMode = fuseSel.value; requestDraw(); });

  var headBox = document.getElementById("mha-heads"), headButtons = [];
  function buildHeads(initial) {
    headBox.textContent = "";
    headButtons = [];
    var H = src().n_heads, label = document.createElement("span");
    label.textContent = H > 1 ? "Heads" : "";
    label.style.marginRight = "4px";
    headBox.appendChild(label);
    state.selected = [];
    for (var h = 0; h < H; h++) state.selected.push(initial ? initial.indexOf(h) >= 0 : true);
    if (H === 1) return syncHeads();
    for (h = 0; h < H; h++) (function (h) {
      var b = document.createElement("button");
      b.type = "button";
      b.className = "mha-head";
      b.textContent = h;
      b.title = "Head " + h + ": click to toggle, double-click to show it alone";
      b.style.background = colors[h];
      b.addEventListener("click", function () { state.selected[h] = !state.selected[h]; syncHeads(); });
      b.addEventListener("dblclick", function () {
        for (var i = 0; i < src().n_heads; i++) state.selected[i] = i === h;
        syncHeads();
      });
      headBox.appendChild(b);
      headButtons.push(b);
    })(h);
    syncHeads();
  }
  function syncHeads() {
    for (var i = 0; i < headButtons.length; i++) {
      headButtons[i].classList.toggle("off", !state.selected[i]);
      headButtons[i].setAttribute("aria-pressed", state.selected[i] ? "true" : "false");
    }
    requestDraw();
  }
  document.getElementById("mha-all").addEventListener("click", function () { state.selected.fill(true); syncHeads(); });
  document.getElementById("mha-none").addEventListener("click", function () { state.selected.fill(false); syncHeads(); });

  MHA.sourceMenu(sources, function (i) { state.source = i; buildHeads(null); });

  var filterSel = document.getElementById("mha-filter");
  if (data.sentence_b_start !== null) {
    document.getElementById("mha-filter-label").hidden = false;
    filterSel.addEventListener("change", function () {
      state.filter = filterSel.value; state.hover = null; state.pins = [];
      layout(); requestDraw();
    });
  }

  var thrInput = document.getElementById("mha-threshold"), thrValue = document.getElementById("mha-threshold-value");
  thrInput.value = state.threshold;
  thrValue.textContent = (+state.threshold).toFixed(2);
  thrInput.addEventListener("input", function () {
    state.threshold = +thrInput.value;
    thrValue.textContent = state.threshold.toFixed(2);
    requestDraw();
  });

  function fileName(ext) {
    return "head_view_" + src().name + "_" + (state.layerMode === "one" ? "layer" + state.layer : state.layerMode + "_of_layers") + "." + ext;
  }
  var svg = MHA.exportButtons(vp, paint, ctx, fileName);

  // ---- start -------------------------------------------------------------------------------
  layout();
  timings.layout = performance.now() - started;
  buildHeads(data.heads);
  stores[0](state.layer);
  timings.inflate = performance.now() - started;
  draw();
  timings.draw = performance.now() - started;
  timings.scriptStart = started;
  document.body.setAttribute("data-ready", "1");

  // for tests and the curious: read-only peeks at the view
  window.mhaHeadView = {
    state: state,
    stats: function () { return { drawCount: drawer.count, settled: drawer.idle() && vp.drawn(), lastDrawMs: drawer.ms, width: geo.width, height: geo.height, timings: timings }; },
    layerSum: function (l, s) { var A = stores[s || 0](l), t = 0; for (var i = 0; i < A.length; i++) t += A[i]; return t; },
    tokenPoint: function (side, k) {     // page coordinates of a token's row
      return vp.pagePoint(side === "L" ? (geo.x0 + geo.x1) / 2 : (geo.x2 + geo.x3) / 2, rowY(k));
    },
    focusSums: function () {             // per picture, the summed values of the focus
      return lastFocus ? lastFocus.map(function (p) { return Array.from(p.sum); }) : null;
    },
    svg: svg,
    inflate: function (b64, n) { var o = MHA.inflate(MHA.base64ToBytes(b64), n), s = 0; for (var i = 0; i < o.length; i++) s += o[i]; return s; }
  };
})();
