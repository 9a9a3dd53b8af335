"""mha.viz.head_view: one self-contained HTML page, tested as a file and in headless Chromium.

The browser tests need Debian's chromium (apt-get install chromium) and the playwright Python
package (pip install playwright; no `playwright install`: the system browser is used). They
skip cleanly when either is missing. MHA_CHROMIUM may point at another Chromium binary.
"""
import base64
import html
import json
import os
import re
import shutil
import time
import zlib

import numpy as np
import pytest

from mha import viz

TOKENS = ["[CLS]", "the", "man", "saw", "the", "astronomer", "with", "a", "telescope", "[SEP]",
          "he", "smiled", "[SEP]"]


def realistic_attention(n_layers, n_heads, n, seed=0):
    """Softmax attention with the usual head types (previous token, first token, local,
    content) over noise, like a trained model's."""
    rng = np.random.default_rng(seed)
    i = np.arange(n)[:, None]
    j = np.arange(n)[None, :]
    out = np.empty((n_layers, n_heads, n, n))
    for l in range(n_layers):
        for h in range(n_heads):
            s = rng.standard_normal((n, n)) * rng.uniform(0.5, 2.0)
            kind = (l * n_heads + h) % 4
            if kind == 0:
                s += 8.0 * (j == i - 1)
            elif kind == 1:
                s += 6.0 * (j == 0)
            elif kind == 2:
                s -= 0.8 * np.abs(i - j)
            else:
                s += 3.0 * rng.standard_normal((1, n))
            e = np.exp(s - s.max(axis=-1, keepdims=True))
            out[l, h] = e / e.sum(axis=-1, keepdims=True)
    return out


def page_data(page):
    """The JSON payload inlined in a page."""
    m = re.search(r'<script id="mha-data" type="application/json">(.*?)</script>', page, re.S)
    assert m, "no inline data"
    return json.loads(m.group(1))


def decode_layer(data, l):
    raw = zlib.decompress(base64.b64decode(data["layers"][l]))
    return np.frombuffer(raw, np.uint8).reshape(data["n_heads"], data["n"], data["n"])


# --- the page as a file ----------------------------------------------------------------------

def test_page_is_self_contained_and_compact():
    att = realistic_attention(2, 3, len(TOKENS))
    view = viz.head_view(att, TOKENS, sentence_b_start=10)
    page = view.html
    assert page.startswith("<!DOCTYPE html>")
    assert "http" not in page and " src=" not in page, "refers to the network"
    assert "require" not in page and "<link" not in page and "@import" not in page
    assert "cdn" not in page.lower()
    data = page_data(page)
    assert data["tokens"] == TOKENS and data["sentence_b_start"] == 10
    assert (data["n_layers"], data["n_heads"], data["n"]) == (2, 3, len(TOKENS))
    # the weights are bytes round(255 w), not JSON floats
    for l in range(2):
        assert np.array_equal(decode_layer(data, l), np.rint(att[l] * 255).astype(np.uint8))
    assert not re.search(r"0\.\d{4,}", page), "weights written as decimal floats"


def test_payload_size_for_300_tokens_6_layers_12_heads():
    att = realistic_attention(6, 12, 300, seed=1)
    view = viz.head_view(att, [f"t{i}" for i in range(300)])
    raw = att.size                                   # one byte per weight before compression
    print(f"\nhead view 300 tokens x 6 layers x 12 heads: payload {view.payload_bytes / 1e6:.2f} MB "
          f"(uint8 {raw / 1e6:.2f} MB, float32 JSON would be ~{att.size * 10 / 1e6:.0f} MB), "
          f"page {len(view.html) / 1e6:.2f} MB")
    assert view.payload_bytes < 0.5 * raw * 4 / 3   # zlib at least halves the base64 bytes
    assert len(view.html) < view.payload_bytes + 60_000


def test_tokens_cannot_break_the_page():
    tokens = ["</script><script>alert(1)</script>", "a & b", "\"quoted\"", "<!--", "ünï", "💡"]
    att = realistic_attention(1, 2, len(tokens))
    view = viz.head_view(att, tokens, title="<b>t</b>")
    assert "</script><script>alert" not in view.html
    assert page_data(view.html)["tokens"] == tokens
    assert "<b>t</b>" not in view.html


def test_inputs_and_errors(tmp_path):
    torch = pytest.importorskip("torch")
    att = realistic_attention(3, 2, 5)
    # Hugging Face outputs.attentions: a tuple of (1, heads, n, n) tensors
    view = viz.head_view(tuple(torch.tensor(a[None]) for a in att), list("abcde"),
                         path=tmp_path / "v.html")
    assert (view.n_layers, view.n_heads, view.n_tokens) == (3, 2, 5)
    assert (tmp_path / "v.html").read_text(encoding="utf-8") == view.html
    assert view.save(tmp_path / "w.html") == str(tmp_path / "w.html")
    one_layer = viz.head_view(att[0], list("abcde"))
    assert one_layer.n_layers == 1
    with pytest.raises(ValueError, match="tokens"):
        viz.head_view(att, list("abcd"))
    with pytest.raises(ValueError, match="shape"):
        viz.head_view(np.ones((2, 2, 3, 4)), list("abc"))
    with pytest.raises(ValueError, match="sentence_b_start"):
        viz.head_view(att, list("abcde"), sentence_b_start=5)
    with pytest.raises(ValueError, match="heads"):
        viz.head_view(att, list("abcde"), heads=[2])


def test_jupyter_repr_is_an_isolated_iframe():
    att = realistic_attention(1, 2, 4)
    view = viz.head_view(att, list("abcd"))
    frame = view._repr_html_()
    assert frame.startswith("<iframe srcdoc=\"") and 'sandbox="allow-scripts' in frame
    srcdoc = re.match(r'<iframe srcdoc="([^"]*)"', frame).group(1)
    assert html.unescape(srcdoc) == view.html
    assert repr(view).startswith("<HeadView: 1 layers x 2 heads x 4 tokens")


# --- in a real browser -----------------------------------------------------------------------

CHROMIUM = os.environ.get("MHA_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def browser():
    if not CHROMIUM or not os.path.exists(CHROMIUM):
        pytest.skip("chromium is not installed (apt-get install chromium)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()


class Page:
    """A loaded head view with its console errors collected."""

    def __init__(self, browser, path, viewport=(1000, 800)):
        self.context = browser.new_context(viewport={"width": viewport[0], "height": viewport[1]},
                                           accept_downloads=True)
        self.page = self.context.new_page()
        self.errors = []
        self.page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.goto(path.as_uri())
        self.page.wait_for_selector("body[data-ready='1']", timeout=20_000)

    def stats(self):
        return self.page.evaluate("mhaHeadView.stats()")

    def canvas(self):
        """A hash and the count of non-white pixels of the canvas."""
        return self.page.evaluate("""() => {
            const c = document.getElementById('mha-canvas');
            const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
            let h = 0, ink = 0;
            for (let i = 0; i < d.length; i += 4) {
                if (d[i] < 245 || d[i + 1] < 245 || d[i + 2] < 245) ink++;
                h = (Math.imul(h, 31) + d[i] * 3 + d[i + 1] * 5 + d[i + 2] * 7) | 0;
            }
            return {hash: h, ink: ink, width: c.width, height: c.height};
        }""")

    def redraw_after(self, action):
        before = self.stats()["drawCount"]
        action()
        self.page.wait_for_function(f"mhaHeadView.stats().drawCount > {before}", timeout=10_000)

    def hover(self, side, k):
        pt = self.page.evaluate(f"mhaHeadView.tokenPoint('{side}', {k})")
        self.page.evaluate(f"window.scrollTo(0, {max(0, pt['y'] - 300)})")
        pt = self.page.evaluate(f"mhaHeadView.tokenPoint('{side}', {k})")
        scroll = self.page.evaluate("[window.scrollX, window.scrollY]")
        self.redraw_after(lambda: self.page.mouse.move(pt["x"] - scroll[0], pt["y"] - scroll[1]))

    def close(self):
        self.context.close()


@pytest.fixture
def small_view(browser, tmp_path):
    att = realistic_attention(3, 4, len(TOKENS))
    path = tmp_path / "small.html"
    viz.head_view(att, TOKENS, sentence_b_start=10, title="test view", path=path)
    page = Page(browser, path)
    yield page, att
    page.close()


def test_loads_without_errors_draws_and_reacts_to_hover(small_view, tmp_path):
    view, att = small_view
    rest = view.canvas()
    assert rest["ink"] > 2000, "nothing drawn"
    # the page decoded exactly the bytes Python wrote (checks the inline inflate)
    for l in range(3):
        assert view.page.evaluate(f"mhaHeadView.layerSum({l})") == int(np.rint(att[l] * 255).sum())
    view.hover("L", 2)                                          # "man"
    hovered = view.canvas()
    assert hovered["hash"] != rest["hash"]
    status = view.page.inner_text("#mha-status")
    assert "man" in status and "attends to" in status
    view.page.screenshot(path=str(tmp_path / "hover.png"))
    view.hover("R", 8)                                          # incoming to "telescope"
    assert view.canvas()["hash"] not in (rest["hash"], hovered["hash"])
    assert "is attended by" in view.page.inner_text("#mha-status")
    view.redraw_after(lambda: view.page.mouse.move(1, 1))      # leave: back to the overview
    assert view.canvas()["hash"] == rest["hash"]
    assert view.errors == []


def test_heads_layers_filter_and_pin(small_view):
    view, _ = small_view
    page = view.page
    rest = view.canvas()["hash"]
    view.redraw_after(lambda: page.click(".mha-head >> nth=1"))         # toggle head 1 off
    assert "off" in page.get_attribute(".mha-head >> nth=1", "class")
    one_off = view.canvas()["hash"]
    assert one_off != rest
    view.redraw_after(lambda: page.dblclick(".mha-head >> nth=2"))      # only head 2
    classes = [page.get_attribute(f".mha-head >> nth={h}", "class") for h in range(4)]
    assert ["off" in c for c in classes] == [True, True, False, True]
    view.redraw_after(lambda: page.click("#mha-all"))
    assert view.canvas()["hash"] == rest
    view.redraw_after(lambda: page.select_option("#mha-layer", "2"))
    assert view.canvas()["hash"] != rest
    assert page.evaluate("mhaHeadView.state.layer") == 2
    # the sentence-pair filter: A -> B shows 10 queries and 3 keys
    assert page.is_visible("#mha-filter")
    height = view.canvas()["height"]
    view.redraw_after(lambda: page.select_option("#mha-filter", "ab"))
    assert view.canvas()["height"] < height
    # click pins a token; the pinned lines stay after the mouse leaves
    view.redraw_after(lambda: page.select_option("#mha-filter", "all"))
    view.hover("L", 5)
    view.redraw_after(lambda: page.mouse.down() or page.mouse.up())
    pinned = view.canvas()["hash"]
    view.redraw_after(lambda: page.mouse.move(1, 1))
    assert view.canvas()["hash"] == pinned
    assert "astronomer" in page.inner_text("#mha-status")
    assert view.errors == []


def test_png_export(small_view):
    view, _ = small_view
    with view.page.expect_download() as info:
        view.page.click("#mha-png")
    download = info.value
    assert download.suggested_filename == "head_view_layer0.png"
    data = open(download.path(), "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    assert view.errors == []


def test_inflate_handles_every_block_type(small_view):
    view, _ = small_view
    rng = np.random.default_rng(3)
    cases = [(bytes(200), 0),                                    # stored block
             (bytes(range(40)), 9),                              # fixed Huffman codes
             (rng.integers(0, 4, 70_000).astype(np.uint8).tobytes(), 6),   # dynamic codes
             (rng.integers(0, 256, 5_000).astype(np.uint8).tobytes(), 6)]  # incompressible
    for raw, level in cases:
        stream = base64.b64encode(zlib.compress(raw, level)).decode()
        total = view.page.evaluate(f"mhaHeadView.inflate('{stream}', {len(raw)})")
        assert total == sum(raw)
    bad = bytearray(zlib.compress(bytes(range(100)) * 3, 9))
    bad[-1] ^= 1                                                 # corrupt the Adler-32
    with pytest.raises(Exception, match="Adler-32"):
        view.page.evaluate(f"mhaHeadView.inflate('{base64.b64encode(bytes(bad)).decode()}', 300)")


def test_several_views_coexist_in_one_notebook_page(browser, tmp_path):
    a = viz.head_view(realistic_attention(1, 2, 5), list("abcde"))
    b = viz.head_view(realistic_attention(2, 3, 4, seed=2), list("wxyz"))
    path = tmp_path / "notebook.html"
    path.write_text("<!DOCTYPE html><html><body><h1>notebook</h1>" + a._repr_html_()
                    + "<p>cell 2</p>" + b._repr_html_() + "</body></html>", encoding="utf-8")
    context = browser.new_context()
    page = context.new_page()
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(path.as_uri())
    frames = []
    deadline = time.time() + 20
    while len(frames) < 2 and time.time() < deadline:
        frames = [f for f in page.frames if f != page.main_frame]
        page.wait_for_timeout(50)
    assert len(frames) == 2
    for frame, n_heads in zip(frames, (2, 3)):
        frame.wait_for_selector("body[data-ready='1']", timeout=20_000)
        assert frame.evaluate("document.querySelectorAll('.mha-head').length") == n_heads
    assert errors == []
    context.close()


def test_fluent_at_300_tokens_6_layers_12_heads(browser, tmp_path):
    att = realistic_attention(6, 12, 300, seed=1)
    tokens = [f"tok{i}" for i in range(300)]
    path = tmp_path / "big.html"
    viz.head_view(att, tokens, path=path)
    start = time.perf_counter()
    view = Page(browser, path)
    load = time.perf_counter() - start
    try:
        rest = view.canvas()
        assert rest["ink"] > 10_000
        view.hover("L", 150)
        hover_ms = view.stats()["lastDrawMs"]
        assert view.canvas()["hash"] != rest["hash"]
        view.hover("L", 151)
        hover_ms = max(hover_ms, view.stats()["lastDrawMs"])
        view.redraw_after(lambda: view.page.select_option("#mha-layer", "5"))   # inflate + draw
        view.redraw_after(lambda: view.page.click(".mha-head >> nth=0"))
        overview_ms = view.stats()["lastDrawMs"]
        view.page.screenshot(path=str(tmp_path / "big.png"))
        print(f"\n300 tokens x 6 layers x 12 heads: load {load:.2f} s, hover redraw "
              f"{hover_ms:.1f} ms, overview redraw {overview_ms:.1f} ms")
        assert load < 15
        assert hover_ms < 150 and overview_ms < 500    # generous: CI machines are shared
        assert view.errors == []
    finally:
        view.close()
