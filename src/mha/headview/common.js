// mha views: code shared by the head, model and neuron views (inlined into each page).
// Everything is offline: no network, no libraries. MHA.* is the shared namespace.
var MHA = (function () {
  "use strict";

  // ---- decoding: base64 -> zlib (RFC 1950/1951) -> uint8 weights (round(255 * w)) ----------
  function base64ToBytes(s) {
    var bin = atob(s), out = new Uint8Array(bin.length);
    for (var i = 0; i < bin.length; i++) out[i] = bin.charCodeAt(i);
    return out;
  }

  var LBASE = [3,4,5,6,7,8,9,10,11,13,15,17,19,23,27,31,35,43,51,59,67,83,99,115,131,163,195,227,258];
  var LEXT = [0,0,0,0,0,0,0,0,1,1,1,1,2,2,2,2,3,3,3,3,4,4,4,4,5,5,5,5,0];
  var DBASE = [1,2,3,4,5,7,9,13,17,25,33,49,65,97,129,193,257,385,513,769,1025,1537,2049,3073,
               4097,6145,8193,12289,16385,24577];
  var DEXT = [0,0,0,0,1,1,2,2,3,3,4,4,5,5,6,6,7,7,8,8,9,9,10,10,11,11,12,12,13,13];
  var CLORDER = [16,17,18,0,8,7,9,6,10,5,11,4,12,3,13,2,14,1,15];

  // A small inflate after zlib's puff.c: canonical Huffman codes decoded bit by bit.
  function inflate(src, outLength) {
    if ((src[0] & 15) !== 8 || ((src[0] << 8) | src[1]) % 31 !== 0) throw new Error("not a zlib stream");
    var out = new Uint8Array(outLength), op = 0, pos = 2, bitbuf = 0, bitcnt = 0;
    function bits(need) {
      while (bitcnt < need) {
        if (pos >= src.length) throw new Error("zlib stream ends early");
        bitbuf |= src[pos++] << bitcnt; bitcnt += 8;
      }
      var v = bitbuf & ((1 << need) - 1);
      bitbuf >>>= need; bitcnt -= need;
      return v;
    }
    function huffman(lengths, n) {
      var count = new Uint16Array(16), offs = new Uint16Array(16), symbol = new Uint16Array(n), i;
      for (i = 0; i < n; i++) count[lengths[i]]++;
      count[0] = 0;
      for (i = 1; i < 16; i++) offs[i] = offs[i - 1] + count[i - 1];
      for (i = 0; i < n; i++) if (lengths[i]) symbol[offs[lengths[i]]++] = i;
      return { count: count, symbol: symbol };
    }
    function decode(h) {
      var code = 0, first = 0, index = 0;
      for (var len = 1; len < 16; len++) {
        code |= bits(1);
        var c = h.count[len];
        if (code - c < first) return h.symbol[index + (code - first)];
        index += c; first += c; first <<= 1; code <<= 1;
      }
      throw new Error("bad Huffman code");
    }
    var fixedLit = null, fixedDist = null, last = 0;
    while (!last) {
      last = bits(1);
      var type = bits(2), lit, dist, i;
      if (type === 0) {                                   // stored block
        bitbuf = 0; bitcnt = 0;
        var len = src[pos] | (src[pos + 1] << 8);
        if ((len ^ (src[pos + 2] | (src[pos + 3] << 8))) !== 0xffff) throw new Error("bad stored block");
        pos += 4;
        if (op + len > outLength) throw new Error("output longer than expected");
        out.set(src.subarray(pos, pos + len), op); op += len; pos += len;
        continue;
      } else if (type === 1) {                            // fixed Huffman codes
        if (!fixedLit) {
          var l = new Uint8Array(288);
          for (i = 0; i < 144; i++) l[i] = 8;
          for (; i < 256; i++) l[i] = 9;
          for (; i < 280; i++) l[i] = 7;
          for (; i < 288; i++) l[i] = 8;
          fixedLit = huffman(l, 288);
          var d = new Uint8Array(30); d.fill(5);
          fixedDist = huffman(d, 30);
        }
        lit = fixedLit; dist = fixedDist;
      } else if (type === 2) {                            // dynamic Huffman codes
        var nlen = bits(5) + 257, ndist = bits(5) + 1, ncode = bits(4) + 4;
        var lengths = new Uint8Array(320);
        for (i = 0; i < ncode; i++) lengths[CLORDER[i]] = bits(3);
        var lencode = huffman(lengths, 19);
        lengths = new Uint8Array(320);
        i = 0;
        while (i < nlen + ndist) {
          var sym = decode(lencode);
          if (sym < 16) { lengths[i++] = sym; continue; }
          var rep, val = 0;
          if (sym === 16) { if (i === 0) throw new Error("repeat with no length"); val = lengths[i - 1]; rep = 3 + bits(2); }
          else if (sym === 17) rep = 3 + bits(3);
          else rep = 11 + bits(7);
          if (i + rep > nlen + ndist) throw new Error("too many lengths");
          while (rep--) lengths[i++] = val;
        }
        lit = huffman(lengths.subarray(0, nlen), nlen);
        dist = huffman(lengths.subarray(nlen, nlen + ndist), ndist);
      } else throw new Error("bad block type");
      for (;;) {
        var s = decode(lit);
        if (s < 256) { if (op >= outLength) throw new Error("output longer than expected"); out[op++] = s; }
        else if (s === 256) break;
        else {
          s -= 257;
          if (s >= 29) throw new Error("bad length symbol");
          var n = LBASE[s] + bits(LEXT[s]);
          var ds = decode(dist);
          if (ds >= 30) throw new Error("bad distance symbol");
          var back = DBASE[ds] + bits(DEXT[ds]);
          if (back > op) throw new Error("distance too far back");
          if (op + n > outLength) throw new Error("output longer than expected");
          for (var k = 0; k < n; k++, op++) out[op] = out[op - back];
        }
      }
    }
    if (op !== outLength) throw new Error("output has " + op + " bytes, expected " + outLength);
    var a = 1, b = 0;                                     // Adler-32 check
    for (var j = 0; j < op; ) {
      var end = Math.min(j + 3800, op);
      for (; j < end; j++) { a += out[j]; b += a; }
      a %= 65521; b %= 65521;
    }
    var want = ((src[src.length - 4] << 24) | (src[src.length - 3] << 16) |
                (src[src.length - 2] << 8) | src[src.length - 1]) >>> 0;
    if ((((b << 16) | a) >>> 0) !== want) throw new Error("Adler-32 mismatch: data corrupted");
    return out;
  }

  // ---- colours -----------------------------------------------------------------------------
  var PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
                 "#7f7f7f", "#bcbd22", "#17becf"];
  function headColors(H) {
    var colors = [];
    for (var h = 0; h < H; h++)
      colors.push(H <= PALETTE.length ? PALETTE[h]
                  : "hsl(" + Math.round(360 * h / H) + "," + (h % 2 ? 55 : 75) + "%," + (h % 2 ? 38 : 48) + "%)");
    return colors;
  }
  // colour maps: f(t) -> "rgb(...)", f.rgb(t) -> [r, g, b] (for image data); sequential white ->
  // blue for t in [0, 1], diverging blue (-1) - white (0) - orange (+1)
  function colourMap(rgb, lo) {      // lo: the value at the map's low end (0 or -1); high end 1
    var f = function (t) { var c = rgb(t); return "rgb(" + c[0] + "," + c[1] + "," + c[2] + ")"; };
    f.rgb = rgb;
    f.lo = lo;
    f.lut = new Uint8Array(3 * 256);   // 256 steps for image data
    for (var i = 0; i < 256; i++) f.lut.set(rgb(lo + (1 - lo) * i / 255), 3 * i);
    return f;
  }
  var blues = colourMap(function (t) {
    t = Math.max(0, Math.min(1, t));
    return [Math.round(255 - 222 * t), Math.round(255 - 153 * t), Math.round(255 - 75 * t)];
  }, 0);
  var diverging = colourMap(function (t) {
    t = Math.max(-1, Math.min(1, t));
    if (t < 0) return [Math.round(255 + 222 * t), Math.round(255 + 153 * t), Math.round(255 + 75 * t)];
    return [Math.round(255 - 10 * t), Math.round(255 - 128 * t), Math.round(255 - 241 * t)];
  }, -1);
  var FONT = "system-ui, -apple-system, 'Segoe UI', Roboto, 'DejaVu Sans', sans-serif";

  // ---- vector export: the canvas calls a view makes, recorded as SVG -------------------------
  // Implements the part of CanvasRenderingContext2D the views use; paths come from
  // ctx.newPath() (a Path2D on a canvas, a recorder here), images (heatmaps) from putCells.
  function esc(s) { return String(s).replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;").replace(/"/g, "&quot;"); }
  function num(x) { return Math.round(x * 100) / 100; }
  function SvgContext(width, height, measure) {
    this.width = width; this.height = height; this.measure = measure;
    this.parts = [];
    this.fillStyle = "#000"; this.strokeStyle = "#000"; this.globalAlpha = 1; this.lineWidth = 1;
    this.font = "10px sans-serif"; this.textAlign = "start"; this.textBaseline = "alphabetic"; this.lineCap = "butt";
  }
  SvgContext.prototype = {
    setTransform: function () {},
    measureText: function (text) { this.measure.font = this.font; return this.measure.measureText(text); },
    newPath: function () { return { d: [], moveTo: function (x, y) { this.d.push("M" + num(x) + " " + num(y)); },
                                    lineTo: function (x, y) { this.d.push("L" + num(x) + " " + num(y)); } }; },
    opacity: function (attr) { return this.globalAlpha < 1 ? " " + attr + '="' + num(this.globalAlpha * 1000) / 1000 + '"' : ""; },
    fillRect: function (x, y, w, h) {
      this.parts.push('<rect x="' + num(x) + '" y="' + num(y) + '" width="' + num(w) + '" height="' + num(h) +
                      '" fill="' + this.fillStyle + '"' + this.opacity("fill-opacity") + "/>");
    },
    fillTextRotated: function (text, x, y, degrees) {
      var anchor = { left: "start", start: "start", right: "end", end: "end", center: "middle" }[this.textAlign] || "start";
      this.parts.push('<text x="' + num(x) + '" y="' + num(y) + '" text-anchor="' + anchor + '" dominant-baseline="central" transform="rotate(' +
                      degrees + " " + num(x) + " " + num(y) + ')" style="font:' + esc(this.font) + '" fill="' + this.fillStyle + '">' + esc(text) + "</text>");
    },
    strokeRect: function (x, y, w, h) {
      this.parts.push('<rect x="' + num(x) + '" y="' + num(y) + '" width="' + num(w) + '" height="' + num(h) +
                      '" fill="none" stroke="' + this.strokeStyle + '" stroke-width="' + this.lineWidth + '"' + this.opacity("stroke-opacity") + "/>");
    },
    fillText: function (text, x, y) {
      var anchor = { left: "start", start: "start", right: "end", end: "end", center: "middle" }[this.textAlign] || "start";
      var base = { middle: "central", top: "hanging", hanging: "hanging", bottom: "text-after-edge" }[this.textBaseline] || "auto";
      this.parts.push('<text x="' + num(x) + '" y="' + num(y) + '" text-anchor="' + anchor + '" dominant-baseline="' + base +
                      '" style="font:' + esc(this.font) + '" fill="' + this.fillStyle + '"' + this.opacity("fill-opacity") + ">" + esc(text) + "</text>");
    },
    stroke: function (path) {
      if (!path.d.length) return;
      this.parts.push('<path d="' + path.d.join("") + '" fill="none" stroke="' + this.strokeStyle + '" stroke-width="' + this.lineWidth +
                      '" stroke-linecap="' + this.lineCap + '"' + this.opacity("stroke-opacity") + "/>");
    },
    // a heatmap: rows x cols cells of colour(value(i, j)) at (x, y), each cw x ch (a value of
    // NaN: no cell); vector rects when small, otherwise one embedded PNG (pixelated)
    putCells: function (x, y, cw, ch, rows, cols, value, colour) {
      if (rows * cols <= 20000) {
        for (var i = 0; i < rows; i++)
          for (var j = 0; j < cols; j++) {
            var v = value(i, j);
            if (v !== v || v === 0) continue;
            this.parts.push('<rect x="' + num(x + j * cw) + '" y="' + num(y + i * ch) + '" width="' + num(cw) + '" height="' + num(ch) + '" fill="' + colour(v) + '"/>');
          }
        return;
      }
      var c = document.createElement("canvas");
      c.width = cols; c.height = rows;
      paintCells(c.getContext("2d"), rows, cols, value, colour);
      this.parts.push('<image x="' + num(x) + '" y="' + num(y) + '" width="' + num(cols * cw) + '" height="' + num(rows * ch) +
                      '" preserveAspectRatio="none" style="image-rendering:pixelated" href="' + c.toDataURL("image/png") + '"/>');
    },
    toString: function () {
      return '<svg xmlns="http://www.w3.org/2000/svg" width="' + this.width + '" height="' + this.height +
             '" viewBox="0 0 ' + this.width + " " + this.height + '"><rect width="100%" height="100%" fill="#fff"/>' +
             this.parts.join("\n") + "</svg>";
    }
  };
  // the same two calls on a real canvas context
  function canvasContext(ctx) {
    ctx.newPath = function () { return new Path2D(); };
    ctx.fillTextRotated = function (text, x, y, degrees) {
      this.save();
      this.translate(x, y);
      this.rotate(degrees * Math.PI / 180);
      this.textBaseline = "middle";
      this.fillText(text, 0, 0);
      this.restore();
    };
    // key (optional): cache the painted cells under it (the same cells redrawn cost one drawImage)
    var cache = new Map();
    ctx.putCells = function (x, y, cw, ch, rows, cols, value, colour, key) {
      var c = key !== undefined ? cache.get(key) : undefined;
      if (!c) {
        c = document.createElement("canvas");
        c.width = cols; c.height = rows;
        paintCells(c.getContext("2d"), rows, cols, value, colour);
        if (key !== undefined) {
          if (cache.size > 400) cache.delete(cache.keys().next().value);
          cache.set(key, c);
        }
      }
      var smooth = this.imageSmoothingEnabled;
      this.imageSmoothingEnabled = false;
      this.drawImage(c, x, y, cols * cw, rows * ch);
      this.imageSmoothingEnabled = smooth;
    };
    return ctx;
  }
  function paintCells(ctx, rows, cols, value, colour) {   // colour: a colour map (its lut)
    var img = ctx.createImageData(cols, rows), d = img.data, lut = colour.lut, lo = colour.lo, k = 255 / (1 - lo);
    for (var i = 0, p = 0; i < rows; i++)
      for (var j = 0; j < cols; j++, p += 4) {
        var v = value(i, j);
        if (v === v) {
          var q = 3 * Math.max(0, Math.min(255, Math.round((v - lo) * k)));
          d[p] = lut[q]; d[p + 1] = lut[q + 1]; d[p + 2] = lut[q + 2];
        } else d[p] = d[p + 1] = d[p + 2] = 255;
        d[p + 3] = 255;
      }
    ctx.putImageData(img, 0, 0);
  }

  // ---- downloads -----------------------------------------------------------------------------
  function download(blob, name) {
    var a = document.createElement("a");
    a.href = URL.createObjectURL(blob);
    a.download = name;
    document.body.appendChild(a);
    a.click();
    setTimeout(function () { URL.revokeObjectURL(a.href); a.remove(); }, 1000);
  }
  function svgString(drawInto, size, measureCtx) {
    var svg = new SvgContext(size.width, size.height, measureCtx);
    drawInto(svg);
    return svg.toString();
  }

  // a view's drawing: render() now (d.now) or at the next frame (d.later, one pending at most);
  // d.count, d.ms (the last one's time, by performance.now) and d.idle() (no draw pending) for
  // tests
  function drawing(render) {
    var pending = false, d = { count: 0, ms: 0 };
    d.idle = function () { return !pending; };
    d.now = function () { var t0 = performance.now(); render(); d.count++; d.ms = performance.now() - t0; };
    d.later = function () {
      if (pending) return;
      pending = true;
      requestAnimationFrame(function () { pending = false; d.now(); });
    };
    return d;
  }

  // the Save PNG and Save SVG buttons of a view; returns svg(): the picture as SVG text
  function exportButtons(vp, paint, measureCtx, fileName) {
    function svg() { return vp.svg(paint, measureCtx); }
    document.getElementById("mha-png").addEventListener("click", function () { vp.exportPNG(paint, fileName("png")); });
    document.getElementById("mha-svg").addEventListener("click", function () {
      download(new Blob([svg()], { type: "image/svg+xml" }), fileName("svg"));
    });
    return svg;
  }

  // a fresh picture: white, its heading in bold at the top (part of exported images too)
  function heading(c, width, height, text) {
    c.fillStyle = "#fff";
    c.fillRect(0, 0, width, height);
    c.fillStyle = "#222";
    c.textBaseline = "middle";
    c.textAlign = "left";
    c.font = "bold 13px " + FONT;
    c.fillText(fit(c, text, width - 20), 10, 14);
  }

  // the "Show" menu of the pictures a view holds (hidden when there is one); onChange(index)
  function sourceMenu(sources, onChange) {
    var menu = document.getElementById("mha-source");
    sources.forEach(function (s, i) { menu.add(new Option(s.label, i)); });
    if (sources.length < 2) return;
    document.getElementById("mha-source-label").hidden = false;
    menu.addEventListener("change", function () { onChange(+menu.value); });
  }

  function fit(ctx, text, width) {  // text cut with an ellipsis to fit width
    if (ctx.measureText(text).width <= width) return text;
    var lo = 0, hi = text.length;
    while (lo < hi) {
      var mid = (lo + hi + 1) >> 1;
      if (ctx.measureText(text.slice(0, mid) + "\u2026").width <= width) lo = mid; else hi = mid - 1;
    }
    return text.slice(0, lo) + "\u2026";
  }

  // a layer of a source: Uint8Array (heads, n_q, n_k), value = byte / 255 * scale[layer]
  function layerStore(source, nq, nk) {
    var decoded = [];
    return function (l) {
      if (!decoded[l]) decoded[l] = inflate(base64ToBytes(source.layers[l]), source.n_heads * nq * nk);
      return decoded[l];
    };
  }
  function floatsFromBase64(b64, count) {   // little-endian float32, zlib-compressed
    var bytes = inflate(base64ToBytes(b64), 4 * count);
    return new Float32Array(bytes.buffer, 0, count);
  }

  // ---- a tall picture on a window-sized canvas ----------------------------------------------
  // The canvas sticks to the top of the window while a spacer scrolls by, and only the band of
  // the picture under it is drawn: a 512-token view (7,000 px) costs what one screen costs.
  // Picture coordinates are CSS pixels from the picture's top left.
  function Viewport(canvas, onScroll) {
    var wrap = document.createElement("div"), spacer = document.createElement("div"), self = this;
    canvas.parentNode.insertBefore(wrap, canvas);
    wrap.appendChild(canvas);
    wrap.appendChild(spacer);
    canvas.style.position = "sticky";
    canvas.style.top = "0";
    this.canvas = canvas; this.wrap = wrap; this.spacer = spacer;
    this.width = 1; this.height = 1; this.h = 1; this.dpr = 1; this.y0 = 0;
    this.scrollSeen = scrollPosition();
    window.addEventListener("scroll", function () { self.scrollSeen = scrollPosition(); }, { passive: true });
    window.addEventListener("scroll", onScroll, { passive: true });
    window.addEventListener("resize", function () { self.setSize(self.width, self.height); onScroll(); });
  }
  function scrollPosition() { return window.scrollX + "," + window.scrollY; }
  Viewport.prototype = {
    setSize: function (width, height) {
      this.width = width; this.height = height;
      this.h = Math.min(height, Math.max(240, window.innerHeight || 800));
      this.dpr = Math.min(window.devicePixelRatio || 1, 2, 16000 / width);
      this.canvas.width = Math.round(width * this.dpr);
      this.canvas.height = Math.round(this.h * this.dpr);
      this.canvas.style.width = width + "px";
      this.canvas.style.height = this.h + "px";
      this.spacer.style.height = (height - this.h) + "px";
    },
    // the picture's row at the canvas's top edge, from the layout now (not from the last draw:
    // an event that arrives between a scroll and the redraw it requested must see the new band)
    bandTop: function () {
      return Math.max(0, Math.min(this.height - this.h, -this.wrap.getBoundingClientRect().top));
    },
    // the band of the picture on screen now; ctx's transform set to draw picture coordinates
    begin: function (ctx) {
      this.y0 = this.bandTop();
      ctx.setTransform(this.dpr, 0, 0, this.dpr, 0, -this.y0 * this.dpr);
      return { y0: this.y0, y1: this.y0 + this.h };
    },
    // the last draw shows what is on screen now: the window's last scroll has reached the page
    // (its event handled) and the band drawn is the band under the canvas (tests wait for this,
    // with the view's drawing idle, before they act)
    drawn: function () { return this.scrollSeen === scrollPosition() && this.y0 === this.bandTop(); },
    pointer: function (ev) {      // picture coordinates of a mouse event
      var r = this.canvas.getBoundingClientRect();
      return { x: ev.clientX - r.left, y: ev.clientY - r.top + this.bandTop() };
    },
    pagePoint: function (x, y) {  // page coordinates of a picture point
      var r = this.wrap.getBoundingClientRect();
      return { x: r.left + window.scrollX + x, y: r.top + window.scrollY + y };
    },
    // the whole picture at twice its CSS size (PNG's limit: 32,000 pixels a side)
    exportPNG: function (paint, name) {
      var scale = Math.min(2, 32000 / this.height, 32000 / this.width), c = document.createElement("canvas");
      c.width = Math.round(this.width * scale);
      c.height = Math.round(this.height * scale);
      var ctx = canvasContext(c.getContext("2d"));
      ctx.setTransform(scale, 0, 0, scale, 0, 0);
      paint(ctx, { y0: 0, y1: this.height });
      c.toBlob(function (blob) { download(blob, name); }, "image/png");
    },
    svg: function (paint, measureCtx) {
      var self = this;
      return svgString(function (svg) { paint(svg, { y0: 0, y1: self.height }); }, this, measureCtx);
    }
  };

  window.addEventListener("error", function (e) {
    var el = document.getElementById("mha-error");
    if (el) el.textContent = "mha view: " + e.message;
  });

  return { base64ToBytes: base64ToBytes, inflate: inflate, headColors: headColors, blues: blues,
           diverging: diverging, FONT: FONT, SvgContext: SvgContext, canvasContext: canvasContext,
           download: download, svgString: svgString, Viewport: Viewport, drawing: drawing,
           exportButtons: exportButtons, heading: heading, sourceMenu: sourceMenu,
           fit: fit, layerStore: layerStore, floatsFromBase64: floatsFromBase64 };
})();
