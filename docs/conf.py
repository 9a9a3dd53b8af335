"""Sphinx configuration of mha's documentation: the API reference (autosummary + numpydoc, in the
NumPy/SciPy convention), the semantics and benchmark pages, and the notebooks rendered from
their saved outputs (myst-nb, never executed here: the test suite executes them).

Build: ``python -m sphinx -W --keep-going -b html docs docs/_build/html`` from the repository's
root, with mha installed (``pip install .``) and the docs' requirements (docs/requirements.txt).
"""
import shutil
from pathlib import Path

import mha

project = "mha"
author = "the mha developers"
copyright = "2026, the mha developers"
version = release = mha.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.mathjax",
    "numpydoc",
    "myst_nb",
]

source_suffix = {".rst": "restructuredtext", ".md": "myst-nb", ".ipynb": "myst-nb"}
root_doc = "index"
exclude_patterns = ["_build", "**.ipynb_checkpoints", "requirements.txt"]
templates_path = ["_templates"]

# --- API reference ---------------------------------------------------------------------------
autosummary_generate = True
autosummary_imported_members = True
autodoc_typehints = "none"          # the numpydoc Parameters sections carry the types
numpydoc_show_class_members = False  # classes get their own autosummary of methods
numpydoc_class_members_toctree = False
numpydoc_xref_param_type = False
# Every public docstring is validated against the numpydoc standard and a miss is a warning,
# which -W turns into a failed build: a missing Parameters or Returns section (PR01, RT01), an
# undocumented or untyped parameter (PR02-PR10), a summary that is not one line starting with
# a verb (SS01-SS06), sections out of order (GL07). Left out, as NumPy's and SciPy's own
# docstrings leave them out: GL01 (the summary starts on the opening quotes' line, as in
# NumPy), ES01 (an extended summary is not always needed), SA01 (See Also is optional),
# EX01 (Examples are written for the public functions and classes, not for every method;
# tests/test_docstrings.py runs them all), RT02 (a single return value may be named,
# "out : ndarray", as NumPy's reference names its returns).
numpydoc_validation_checks = {"all", "GL01", "ES01", "SA01", "EX01", "RT02"}
# module-level constants are data, not callables: their #: comments are not numpydoc sections
numpydoc_validation_exclude = set()       # filled below from each module's constants

# --- notebooks: rendered from their saved outputs, never executed by the docs build -----------
nb_execution_mode = "off"
myst_enable_extensions = ["dollarmath", "colon_fence"]
suppress_warnings = ["mystnb.unknown_mime_type"]

html_theme = "pydata_sphinx_theme"
html_title = "mha"
html_theme_options = {
    "navigation_with_keys": False,
    "show_toc_level": 2,
}
html_static_path = []

# The notebooks live in notebooks/ (executed by the tests); the docs render copies of them.
HERE = Path(__file__).resolve().parent
_copies = HERE / "notebooks"
_copies.mkdir(exist_ok=True)
_notebooks = sorted((HERE.parent / "notebooks").glob("*.ipynb"))
for _nb in _notebooks:
    shutil.copyfile(_nb, _copies / _nb.name)
(_copies / "index.md").write_text(
    "# Notebooks\n\nOne notebook per topic of multi-head attention, rendered with the outputs "
    "saved in the repository (the test suite executes them). {doc}`../experiments` names the "
    "experiment each one runs.\n\n```{toctree}\n:maxdepth: 1\n\n"
    + "".join(f"{nb.stem}\n" for nb in _notebooks) + "```\n")

# --- one reference page per public module, listing its __all__ (new names appear by themselves)
import importlib  # noqa: E402
import inspect  # noqa: E402
import re  # noqa: E402
import types  # noqa: E402

# the library, then the applications' modules that notebooks call (tests/test_docstrings.py
# runs the examples of the same list, read from here)
PUBLIC_MODULES = ["mha", "mha.reference", "mha.analysis", "mha.viz", "mha.models", "mha.sae",
                  "mha.patching", "mha.train", "mha.corpus", "mha.apps.training",
                  "mha.apps.training_figures", "mha.apps.timing"]


_documented = {}     # id(object) -> its first public name: an object re-exported by a second
                     # module (mha.reference.KVCache is mha.KVCache) gets one page, linked


def _reference_page(name):
    module = importlib.import_module(name)
    names = [n for n in getattr(module, "__all__", [])
             if not isinstance(getattr(module, n, None), types.ModuleType)]
    title = f"``{name}``"
    lines = [title, "=" * len(title), "", f".. automodule:: {name}", "   :no-members:", "",
             f".. currentmodule:: {name}", ""]
    groups = {"Classes": [], "Functions": [], "Constants": []}
    also = []
    for n in names:
        obj = getattr(module, n)
        if (inspect.isclass(obj) or callable(obj)) and id(obj) in _documented:
            also.append(f"``{n}`` is :py:obj:`{_documented[id(obj)]}`.")
            continue
        _documented.setdefault(id(obj), f"{name}.{n}")
        kind = ("Classes" if inspect.isclass(obj) else
                "Functions" if callable(obj) else "Constants")
        groups[kind].append(n)
    numpydoc_validation_exclude.update(rf"^{re.escape(name)}\.{re.escape(n)}$"
                                       for n in groups["Constants"])
    for kind, members in groups.items():
        if not members:
            continue
        lines += [kind, "-" * len(kind), "", ".. autosummary::", "   :toctree: generated",
                  "   :nosignatures:", ""]
        lines += [f"   {n}" for n in members] + [""]
    if also:
        lines += ["Also here", "---------", ""] + [f"- {line}" for line in also] + [""]
    return "\n".join(lines)


_ref = HERE / "reference"
_ref.mkdir(exist_ok=True)
_pages = []
for _name in PUBLIC_MODULES:
    (_ref / f"{_name}.rst").write_text(_reference_page(_name))
    _pages.append(_name)
(_ref / "index.rst").write_text(
    "API reference\n=============\n\nEvery public name of mha, one page each, from its docstring.\n\n"
    ".. toctree::\n   :maxdepth: 1\n\n" + "".join(f"   {p}\n" for p in _pages))
