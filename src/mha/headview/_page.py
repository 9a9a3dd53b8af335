"""The page writer shared by the views: page.html with a view's controls, its script, the
shared script (common.js) and the data filled in, and the object that holds the page."""
from __future__ import annotations

import html
import json
import os
import re
from importlib import resources
from typing import Any, TypeVar


def _resource(name: str) -> str:
    return resources.files(__package__).joinpath(name).read_text(encoding="utf-8")


def _json(payload: object) -> str:
    """JSON safe inside <script>: <, > and & escaped so no token can close the tag."""
    return (json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
            .replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026"))


_PLACEHOLDER = re.compile(r"__MHA_([A-Z]+)__")


def write_page(view: str, payload: dict[str, Any], title: str) -> str:
    """page.html with view's controls ({view}_controls.html) and script ({view}.js), the shared
    code and the data filled in (one pass, so nothing inserted, a token or a title, is read as a
    placeholder)."""
    parts = {"TITLE": html.escape(title), "KIND": f"{view} view",
             "CONTROLS": _resource(f"{view}_controls.html"), "COMMON": _resource("common.js"),
             "SCRIPT": _resource(f"{view}.js"), "DATA": _json(payload)}
    return _PLACEHOLDER.sub(lambda m: parts[m.group(1)], _resource("page.html"))


class HTMLView:
    """Hold a rendered view: one self-contained HTML page.

    ``save(path)`` writes it; Jupyter displays it through ``_repr_html_`` (a sandboxed iframe,
    so views do not collide).

    Parameters
    ----------
    page : str
        The whole standalone HTML page.
    height : int
        The height of the iframe in Jupyter, in pixels.
    payload_bytes : int
        The base64 characters of the data in the page.
    **info
        The view's sizes, kept as attributes (``n_layers``, ``n_heads``, ``n_tokens``, ...).

    Attributes
    ----------
    html : str
        The whole page.
    """
    kind = "view"
    # set from **info by every view
    n_layers: int
    n_heads: int
    n_tokens: int

    def __init__(self, page: str, *, height: int, payload_bytes: int, **info: Any) -> None:
        self.html = page
        self.height = height                  # iframe height in Jupyter (px)
        self.payload_bytes = payload_bytes    # base64 characters of the data
        for key, value in info.items():
            setattr(self, key, value)

    def save(self, path: str | os.PathLike[str]) -> str:
        """Write the standalone HTML page to a file.

        Parameters
        ----------
        path : str or os.PathLike
            Where to write (UTF-8).

        Returns
        -------
        str
            The path written.
        """
        path = os.fspath(path)
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.html)
        return path

    def _repr_html_(self) -> str:
        return (f'<iframe srcdoc="{html.escape(self.html, quote=True)}" '
                f'style="width:100%;height:{self.height}px;border:1px solid #ddd;" '
                f'sandbox="allow-scripts allow-downloads" loading="eager" '
                f'title="mha {self.kind}"></iframe>')

    def _shape(self) -> str:
        return f"{self.n_layers} layers x {self.n_heads} heads x {self.n_tokens} tokens"

    def __repr__(self) -> str:
        return f"<{type(self).__name__}: {self._shape()}, {len(self.html) / 1e6:.2f} MB page>"


_View = TypeVar("_View", bound=HTMLView)


def picture_view(cls: type[_View], page: str, height: int, sources: list[dict[str, Any]],
                 shape: tuple[int, ...], path: str | os.PathLike[str] | None) -> _View:
    """A head or model view object holding page (saved to path when given)."""
    L, H, n_q, n_k = shape
    payload = sum(len(s.get("thumbs", "")) + sum(map(len, s["layers"])) for s in sources)
    view = cls(page, height=height, n_layers=L, n_heads=H, n_tokens=n_q, n_keys=n_k,
               sources=[s["name"] for s in sources], payload_bytes=payload)
    if path is not None:
        view.save(path)
    return view
