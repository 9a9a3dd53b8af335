(function () {
  "use strict";
  // data.sources[s]: {name, label, kind, n_heads, scale: [L], layers: [b64 (heads, n_q, n_k) bytes],
  //                   thumbs: b64 (L, heads, tq, tk) bytes round(255 sqrt(v / top)) of the block
  //                   max v, thumb_top: [L][heads] top (each thumbnail's largest value),
  //                   thumb_shape: [tq, tk]}
  var data = JSON.parse(document.getElementById("mha-data").textContent);
  var L = data.n_layers, NQ = data.n_q, NK = data.n_k;
  var qTokens = data.tokens, kTokens = data.key_tokens || data.tokens;
  var sources = data.sources, stores = sources.map(function (s) { return MHA.layerStore(s, NQ, NK); });
  var thumbs = [];
  function thumbData(s) {
    if (!thumbs[s]) {
      var src = sources[s], t = src.thumb_shape;
      thumbs[s] = MHA.inflate(MHA.base64ToBytes(src.thumbs), L * src.n_heads * t[0] * t[1]);
    }
    return thumbs[s];
  }

  var state = { source: 0, open: null, hover: null };  // open: {layer, head}; hover: thumbnail or cell
  function src() { return sources[state.source]; }

  var canvas = document.getElementById("mha-canvas"), ctx = MHA.canvasContext(canvas.getContext("2d"));
  var vp = new MHA.Viewport(canvas, requestDraw);
  var statusEl = document.getElementById("mha-status"), backBtn = document.getElementById("mha-back");
  var geo = null;

  function layout() {
    var s = src(), t = s.thumb_shape, H = s.n_heads;
    if (!state.open) {
      // thumbnails about 72 px on their longer side at any length: a fractional cell below 3 px,
      // whole pixels from 3 px up (57 to 72 px)
      var fit = 72 / Math.max(t[0], t[1]), cell = fit >= 3 ? Math.floor(fit) : fit;
      var tw = t[1] * cell, th = t[0] * cell, gapCells = Math.max(1, Math.round(8 / cell)), gap = gapCells * cell, left = 62, top = 58;
      geo = { mode: "grid", cell: cell, gapCells: gapCells, tw: tw, th: th, gap: gap, left: left, top: top,
              width: Math.max(left + H * (tw + gap) + 10, 480), height: top + L * (th + gap) + 10 };
    } else {
      var n = Math.max(NQ, NK), c = Math.max(1, Math.min(24, Math.floor(640 / n)));
      var labels = c >= 9, font = Math.min(c - 1, 12) + "px " + MHA.FONT, lw = 0;
      ctx.font = font;
      if (labels) {
        for (var i = 0; i < NQ; i++) lw = Math.max(lw, ctx.measureText(qTokens[i]).width);
        for (i = 0; i < NK; i++) lw = Math.max(lw, ctx.measureText(kTokens[i]).width);
        lw = Math.min(lw + 8, 140);
      }
      var left2 = Math.max(lw, 66) + 10, top2 = 40 + Math.max(lw, 16);
      geo = { mode: "open", c: c, labels: labels, font: font, left: left2, top: top2,
              width: Math.max(left2 + NK * c + 90, 360), height: top2 + NQ * c + 30 };
    }
    vp.setSize(geo.width, geo.height);
    backBtn.hidden = !state.open;
  }

  // every thumbnail in one image, one pixel per cell and geo.gapCells blank cells between
  // thumbnails (drawn at geo.cell pixels a cell)
  var gridImages = [];
  function gridImage() {
    if (gridImages[state.source]) return gridImages[state.source];
    var s = src(), t = s.thumb_shape, H = s.n_heads, T = thumbData(state.source), G = geo.gapCells;
    var W = H * (t[1] + G), R = L * (t[0] + G);
    var c = document.createElement("canvas");
    c.width = W; c.height = R;
    var x = c.getContext("2d"), img = x.createImageData(W, R), d = img.data, lut = MHA.blues.lut;
    d.fill(255);
    for (var l = 0; l < L; l++)
      for (var h = 0; h < H; h++)
        for (var i = 0; i < t[0]; i++)
          for (var j = 0; j < t[1]; j++) {
            var q = 3 * T[((l * H + h) * t[0] + i) * t[1] + j], p = 4 * ((l * (t[0] + G) + i) * W + h * (t[1] + G) + j);
            d[p] = lut[q]; d[p + 1] = lut[q + 1]; d[p + 2] = lut[q + 2];
          }
    x.putImageData(img, 0, 0);
    return (gridImages[state.source] = c);
  }

  function thumbX(h) { return geo.left + h * (geo.tw + geo.gap); }
  function thumbY(l) { return geo.top + l * (geo.th + geo.gap); }

  function paint(c) {                 // the whole picture (a band argument is not needed)
    var s = src(), H = s.n_heads, g = geo;
    var title = (data.title ? data.title + " \u2014 " : "") + (sources.length > 1 ? s.label + ", " : "");
    if (g.mode === "grid") {
      MHA.heading(c, g.width, g.height, title + L + " layers \u00d7 " + H + " heads");
      c.font = "11px " + MHA.FONT;
      c.fillStyle = "#666";
      c.textAlign = "left";
      c.fillText(MHA.fit(c, LEGEND, g.width - 20), 10, 32);
      c.textAlign = "center";
      for (var h = 0; h < H; h++) c.fillText(H > 1 ? "head " + h : "", thumbX(h) + g.tw / 2, g.top - 10);
      c.textAlign = "right";
      var t = s.thumb_shape, T = thumbData(state.source), size = t[0] * t[1];
      if (c.drawImage) {                      // a canvas: all thumbnails as one image
        var smooth = c.imageSmoothingEnabled;
        c.imageSmoothingEnabled = false;
        c.drawImage(gridImage(), g.left, g.top, H * (t[1] + g.gapCells) * g.cell, L * (t[0] + g.gapCells) * g.cell);
        c.imageSmoothingEnabled = smooth;
      }
      for (var l = 0; l < L; l++) {
        c.fillStyle = "#666";
        c.fillText("layer " + l, g.left - 8, thumbY(l) + g.th / 2);
        for (h = 0; h < H; h++) {
          var base = (l * H + h) * size;
          if (!c.drawImage) c.putCells(thumbX(h), thumbY(l), g.cell, g.cell, t[0], t[1],
                                       function (i, j) { return T[base + i * t[1] + j] / 255; }, MHA.blues);
          c.strokeStyle = state.hover && state.hover.layer === l && state.hover.head === h ? "#000" : "#ccc";
          c.lineWidth = 1;
          c.strokeRect(thumbX(h) - 0.5, thumbY(l) - 0.5, g.tw + 1, g.th + 1);
        }
      }
    } else {
      var o = state.open, A = stores[state.source](o.layer), base2 = o.head * NQ * NK, top = 1;
      for (var e = base2; e < base2 + NQ * NK; e++) if (A[e] > top) top = A[e];   // colours up to the head's largest value
      MHA.heading(c, g.width, g.height, title + "layer " + o.layer + (H > 1 ? ", head " + o.head : ""));
      c.putCells(g.left, g.top, g.c, g.c, NQ, NK, function (i, j) { return A[base2 + i * NK + j] / top; }, MHA.blues,
                 "o" + state.source + "|" + o.layer + "|" + o.head);
      c.strokeStyle = "#ccc";
      c.lineWidth = 1;
      c.strokeRect(g.left - 0.5, g.top - 0.5, NK * g.c + 1, NQ * g.c + 1);
      c.font = "11px " + MHA.FONT;
      c.fillStyle = "#666";
      c.textAlign = "left";
      if (!g.labels) c.fillText("keys \u2192", g.left, g.top - 8);
      if (g.labels) {
        c.font = g.font;
        c.fillStyle = "#111";
        c.textAlign = "right";
        for (var i = 0; i < NQ; i++) c.fillText(MHA.fit(c, qTokens[i], g.left - 14), g.left - 4, g.top + (i + 0.5) * g.c);
        c.textAlign = "left";
        for (var j = 0; j < NK; j++) c.fillTextRotated(MHA.fit(c, kTokens[j], g.top - 44), g.left + (j + 0.5) * g.c, g.top - 4, -90);
      } else {
        c.textAlign = "right";
        c.fillText("queries \u2193", g.left - 4, g.top + 6);
      }
      if (state.hover && state.hover.i !== undefined) {        // crosshair on the hovered cell
        c.strokeStyle = "#d62728";
        c.strokeRect(g.left + state.hover.j * g.c - 0.5, g.top + state.hover.i * g.c - 0.5, g.c + 1, g.c + 1);
      }
      // colour bar: 64 steps from the layer's scale down to 0
      var bx = g.left + NK * g.c + 20;
      c.putCells(bx, g.top, 12, 2, 64, 1, function (i) { return 1 - i / 63; }, MHA.blues);
      c.font = "10px " + MHA.FONT;
      c.fillStyle = "#444";
      c.textAlign = "left";
      c.fillText(fmt(top / 255 * s.scale[o.layer]), bx + 16, g.top + 4);
      c.fillText("0", bx + 16, g.top + 124);
    }
  }

  function fmt(v) { return src().kind === "norm" ? v.toPrecision(3) : v.toFixed(2); }
  var LEGEND = "Each thumbnail: white 0 to dark blue at its own largest value, square-root scale";

  var drawer = MHA.drawing(function () { vp.begin(ctx); paint(ctx); });
  function draw() { drawer.now(); }
  function requestDraw() { drawer.later(); }

  function hit(ev) {
    var pt = vp.pointer(ev), x = pt.x, y = pt.y, g = geo;
    if (g.mode === "grid") {
      var h = Math.floor((x - g.left) / (g.tw + g.gap)), l = Math.floor((y - g.top) / (g.th + g.gap));
      if (h < 0 || l < 0 || h >= src().n_heads || l >= L) return null;
      if (x - thumbX(h) > g.tw || y - thumbY(l) > g.th) return null;
      return { layer: l, head: h };
    }
    var i = Math.floor((y - g.top) / g.c), j = Math.floor((x - g.left) / g.c);
    if (i < 0 || j < 0 || i >= NQ || j >= NK) return null;
    return { i: i, j: j };
  }

  function status() {
    var hv = state.hover, s = src();
    if (!state.open) {
      statusEl.textContent = hv ? "Layer " + hv.layer + (s.n_heads > 1 ? ", head " + hv.head : "") + ": largest " +
                                  (s.kind === "norm" ? "value " : "weight ") + fmt(s.thumb_top[hv.layer][hv.head]) +
                                  " (its darkest blue); click to open it"
                                : "Click a head to open it; arrow keys step through heads and layers, Esc comes back.";
      return;
    }
    var o = state.open;
    if (!hv) { statusEl.textContent = "Layer " + o.layer + (s.n_heads > 1 ? ", head " + o.head : "") + ": hover a cell; arrows step, Esc comes back"; return; }
    var A = stores[state.source](o.layer), v = A[o.head * NQ * NK + hv.i * NK + hv.j] / 255 * s.scale[o.layer];
    statusEl.textContent = "\u201c" + qTokens[hv.i] + "\u201d (#" + hv.i + ") \u2192 \u201c" + kTokens[hv.j] + "\u201d (#" + hv.j + "): " + fmt(v);
  }

  canvas.addEventListener("pointermove", function (ev) {
    var hv = hit(ev);
    if (JSON.stringify(hv) !== JSON.stringify(state.hover)) { state.hover = hv; status(); requestDraw(); }
    canvas.style.cursor = hv && !state.open ? "pointer" : "default";
  });
  canvas.addEventListener("pointerleave", function () { state.hover = null; status(); requestDraw(); });
  canvas.addEventListener("click", function (ev) {
    var hv = hit(ev);
    if (!state.open && hv) open(hv.layer, hv.head);
  });
  function open(l, h) {
    state.open = l === null ? null : { layer: l, head: h };
    state.hover = null;
    layout(); status(); draw();
  }
  backBtn.addEventListener("click", function () { open(null); });
  document.addEventListener("keydown", function (ev) {
    if (!state.open) return;
    var o = state.open, H = src().n_heads;
    if (ev.key === "Escape") open(null);
    else if (ev.key === "ArrowRight") open(o.layer, (o.head + 1) % H);
    else if (ev.key === "ArrowLeft") open(o.layer, (o.head + H - 1) % H);
    else if (ev.key === "ArrowDown") open((o.layer + 1) % L, o.head);
    else if (ev.key === "ArrowUp") open((o.layer + L - 1) % L, o.head);
    else return;
    ev.preventDefault();
  });

  MHA.sourceMenu(sources, function (i) {
    state.source = i;
    if (state.open) state.open.head = Math.min(state.open.head, src().n_heads - 1);
    layout(); status(); draw();
  });

  function fileName(ext) {
    return "model_view_" + src().name + (state.open ? "_layer" + state.open.layer + "_head" + state.open.head : "") + "." + ext;
  }
  var svg = MHA.exportButtons(vp, paint, ctx, fileName);

  layout();
  draw();
  document.body.setAttribute("data-ready", "1");
  window.mhaModelView = {
    state: state,
    stats: function () { return { drawCount: drawer.count, settled: drawer.idle() && vp.drawn(), lastDrawMs: drawer.ms, width: geo.width, height: geo.height, mode: geo.mode }; },
    open: open,
    svg: svg,
    thumbPoint: function (l, h) { return vp.pagePoint(thumbX(h) + geo.tw / 2, thumbY(l) + geo.th / 2); },
    // a thumbnail's box in canvas pixels as last drawn (inside its border)
    thumbBox: function (l, h) {
      return { x: Math.round(thumbX(h) * vp.dpr), y: Math.round((thumbY(l) - vp.y0) * vp.dpr),
               width: Math.floor(geo.tw * vp.dpr), height: Math.floor(geo.th * vp.dpr) };
    },
    cellPoint: function (i, j) { return vp.pagePoint(geo.left + (j + 0.5) * geo.c, geo.top + (i + 0.5) * geo.c); },
    thumbSum: function () { var T = thumbData(state.source), t = 0; for (var i = 0; i < T.length; i++) t += T[i]; return t; }
  };
})();
