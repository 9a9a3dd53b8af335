"""Build the notebooks from their sources: src/NN_name.py -> NN_name.ipynb (outputs cleared).

The sources are plain Python in the "percent" format that Jupytext, VS Code and Spyder read:

    # %% [markdown]
    # # A title
    # Some prose.

    # %%
    import mha

A line `# %% [markdown]` starts a Markdown cell (its lines lose their leading "# "), a line
`# %%` starts a code cell,
in which a commented magic such as `# %matplotlib inline` becomes a live one. Edit a source, then run

    python notebooks/build.py            # rewrite every .ipynb
    python notebooks/build.py --check    # exit 1 if a .ipynb differs from its source or has
                                         # outputs (used by the tests)

The .ipynb files are committed without outputs; tests/test_notebooks.py executes them.
"""
import argparse
import re
import sys
from pathlib import Path

import nbformat

HERE = Path(__file__).resolve().parent
SOURCES = HERE / "src"
MAGIC = re.compile(r"^# %[a-z]")
KERNELSPEC = {"display_name": "Python 3", "language": "python", "name": "python3"}


def parse(text):
    """[(kind, source)] with kind "markdown" or "code", from a percent-format source."""
    cells = []
    kind, lines = None, []

    def flush():
        if kind is None:
            return
        body = lines[:]
        while body and not body[-1].strip():
            body.pop()
        while body and not body[0].strip():
            body.pop(0)
        if kind == "markdown":
            body = [line[2:] if line.startswith("# ") else line.lstrip("#") for line in body]
        else:                                   # "# %matplotlib inline" -> a live magic
            body = [line[2:] if MAGIC.match(line) else line for line in body]
        cells.append((kind, "\n".join(body)))

    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("# %%"):
            flush()
            kind = "markdown" if "[markdown]" in stripped else "code"
            lines = []
        elif kind is not None:
            lines.append(line)
    flush()
    return cells


def build(source):
    """A cleared nbformat v4 notebook from a source file (a Path)."""
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = dict(KERNELSPEC)
    nb.metadata["language_info"] = {"name": "python"}
    for i, (kind, text) in enumerate(parse(Path(source).read_text(encoding="utf-8"))):
        if kind == "markdown":
            cell = nbformat.v4.new_markdown_cell(text)
        else:
            cell = nbformat.v4.new_code_cell(text)
        cell["id"] = f"{Path(source).stem[:2]}-{i:02d}"       # stable ids: clean diffs
        nb.cells.append(cell)
    nbformat.validate(nb)
    return nb


def render(nb):
    return nbformat.writes(nb) + "\n"


def cells_of(nb):
    """[(cell type, source)]: what --check compares (not the JSON bytes, which depend on the
    nbformat version)."""
    return [(cell.cell_type, cell.source) for cell in nb.cells]


def has_outputs(nb):
    return any(cell.cell_type == "code" and (cell.get("outputs") or cell.get("execution_count"))
               for cell in nb.cells)


def notebook_path(source):
    return HERE / (Path(source).stem + ".ipynb")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true",
                        help="only check that every .ipynb has its source's cells and no "
                             "outputs; exit 1 if not")
    args = parser.parse_args(argv)
    stale = []
    for source in sorted(SOURCES.glob("[0-9][0-9]_*.py")):
        target = notebook_path(source)
        nb = build(source)
        if args.check:
            if not target.is_file():
                stale.append(f"{target.name} (missing)")
                continue
            committed = nbformat.read(target, as_version=4)
            if cells_of(committed) != cells_of(nb):
                stale.append(f"{target.name} (differs from src/{source.name})")
            elif has_outputs(committed):
                stale.append(f"{target.name} (has outputs)")
        else:
            target.write_text(render(nb), encoding="utf-8")
            print(f"wrote {target.relative_to(HERE.parent)}")
    if stale:
        print("out of date, run python notebooks/build.py: " + "; ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
