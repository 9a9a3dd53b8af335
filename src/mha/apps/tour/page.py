"""The tour's index.html: every figure with its title and sentence, on one page."""
from __future__ import annotations

import html
from pathlib import Path

def write_index(out, entries, label, quick, seconds):
    import mha

    cards = []
    for name, title, sentence in entries:
        t, s, n = html.escape(title), html.escape(sentence), html.escape(name)
        if name.endswith(".html"):
            body = (f'<p><a class="button" href="{n}">Open the head view</a></p>'
                    f'<iframe src="{n}" title="{t}" loading="lazy"></iframe>')
        else:
            body = f'<a href="{n}"><img src="{n}" alt="{t}"></a>'
        cards.append(f'<section><h2>{t}</h2><p>{s}</p>{body}'
                     f'<p class="file">{n}</p></section>')
    info = mha.build_info()
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>mha tour</title>
<style>
body {{ font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 0 auto;
       max-width: 1100px; padding: 1.5em; color: #222; background: #fafafa; }}
h1 {{ margin-bottom: 0.2em; }}
section {{ background: white; border: 1px solid #ddd; border-radius: 8px; padding: 1em 1.2em;
          margin: 1.2em 0; }}
section h2 {{ margin: 0 0 0.3em 0; font-size: 1.2em; }}
img {{ max-width: 100%; height: auto; display: block; margin: 0.6em auto; }}
iframe {{ width: 100%; height: 560px; border: 1px solid #ddd; }}
.file {{ color: #888; font-size: 0.85em; margin: 0; }}
.meta {{ color: #666; }}
a.button {{ background: #3498db; color: white; padding: 0.3em 0.8em; border-radius: 4px;
           text-decoration: none; }}
</style></head><body>
<h1>mha tour</h1>
<p class="meta">The key figure of each experiment, computed on mha's C kernels: model {html.escape(label)},
{'quick mode (30 training epochs), ' if quick else ''}{seconds:.0f} s on
{info['num_threads']} thread(s) ({html.escape(info['simd'])}). Regenerate with
<code>python -m mha tour</code>; the notebooks in <code>notebooks/</code> explain each figure.</p>
{chr(10).join(cards)}
</body></html>
"""
    (Path(out) / "index.html").write_text(page, encoding="utf-8")
