"""Every notebook in notebooks/ runs top to bottom on a fresh kernel, without an error.

The kernel is this interpreter (sys.executable, through a kernelspec written to a temporary
folder), with MPLBACKEND=Agg and a temporary working directory. Each notebook also has to
print what its experiments compute (a few cheap facts checked below) and draw its figures.
The notebooks are committed without outputs, built from notebooks/src/ by notebooks/build.py.
"""
import json
import os
import sys
import time
import warnings
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
PATHS = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
#: A notebook should run in under this many seconds on two cores (the issue's limit).
TIME_LIMIT = 180.0
KERNEL_NAME = "mha-tests-python"

#: Text each notebook must print (what its experiments compute), by notebook file name prefix.
EXPECTED_TEXT = {
    "01": ["max |C - NumPy|", "rows sum to 1: True", "equivariant: True"],
    "02": ["1,050,624", "1,048,576", "W_o (8, 4)", "money bank: C layer == step by step: True"],
    "03": ["Dominant", "she -> doctor", "telescope"],
    "04": ["layer output == concat @ W_o: True", "prune_heads == head_mask: True"],
    "05": ["1 Head", "4 Heads", "8 Heads", "parameters"],
    "06": ["The sweep over head counts", "The head-pruning procedure", "prunable"],
    "07": ["262,144", "ms"],
    "08": ["maximum flows in", "share of weight", "Kobayashi's finding reproduced", "broad heads",
           "head map", "Pearson r (AttnLRP, integrated gradients)"],
    "09": ["next-token accuracy on the repeat: 1.00",
           "zero-ablate head 1.0: accuracy on the repeat 0.00", "patching each head's output",
           "error term kept: logits equal to the plain forward's: True"],
    "10": ["passes 0.5: True", "below half its first value: True", "pairs ordered rightly"],
    "11": ["rollout rows sum to 1: True", "relevance >= 0 with a diagonal >= 1: True",
           "CLS's attention mass on registers", "logits_per_image"],
}
#: Notebooks that must also display something other than a PNG (HTML head view, GIF).
EXPECTED_HTML = {"03", "08"}


def write_kernelspec(root):
    """A kernelspec under root/kernels that starts ipykernel with this very interpreter (the
    test's venv, whatever kernels Jupyter knows about); put root on JUPYTER_PATH to use it."""
    spec = Path(root) / "kernels" / KERNEL_NAME
    spec.mkdir(parents=True, exist_ok=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": f"Python ({sys.executable})",
        "language": "python",
    }))
    return KERNEL_NAME


@pytest.fixture(scope="session")
def kernel_name(tmp_path_factory):
    root = tmp_path_factory.mktemp("jupyter")
    name = write_kernelspec(root)
    old = os.environ.get("JUPYTER_PATH")
    os.environ["JUPYTER_PATH"] = os.pathsep.join([str(root)] + ([old] if old else []))
    yield name
    if old is None:
        os.environ.pop("JUPYTER_PATH", None)
    else:
        os.environ["JUPYTER_PATH"] = old


def run_notebook(path, kernel_name, workdir):
    """Execute the notebook at path in workdir -> (executed notebook, seconds)."""
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, kernel_name=kernel_name, timeout=900,
                                     resources={"metadata": {"path": str(workdir)}})
    start = time.perf_counter()
    client.execute()
    return nb, time.perf_counter() - start


def outputs_of(nb):
    """(all printed text, set of MIME types displayed) of an executed notebook."""
    text, mimes = [], set()
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream":
                text.append(out.get("text", ""))
            for mime, value in out.get("data", {}).items():
                mimes.add(mime)
                if mime == "text/plain":
                    text.append(value if isinstance(value, str) else "".join(value))
    return "\n".join(text), mimes


def test_there_is_a_notebook_per_topic():
    prefixes = {p.name[:2] for p in PATHS}
    assert prefixes >= set(EXPECTED_TEXT), f"missing notebooks: {set(EXPECTED_TEXT) - prefixes}"


def test_notebooks_are_built_from_their_sources_and_cleared():
    import importlib.util

    spec = importlib.util.spec_from_file_location("mha_notebooks_build", NOTEBOOKS / "build.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    assert build.main(["--check"]) == 0, "run: python notebooks/build.py"
    assert {p.stem for p in PATHS} == {p.stem for p in (NOTEBOOKS / "src").glob("[0-9][0-9]_*.py")}
    for path in PATHS:
        nb = nbformat.read(path, as_version=4)
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert cell.outputs == [] and cell.execution_count is None, (
                    f"{path.name} is committed with outputs")


@pytest.mark.parametrize("path", PATHS, ids=[p.stem for p in PATHS])
def test_notebook_runs(path, kernel_name, tmp_path, monkeypatch):
    monkeypatch.setenv("MPLBACKEND", "Agg")
    try:
        nb, seconds = run_notebook(path, kernel_name, tmp_path)
    except nbclient.exceptions.CellExecutionError as error:
        pytest.fail(f"{path.name} failed:\n{error}", pytrace=False)
    text, mimes = outputs_of(nb)
    for expected in EXPECTED_TEXT.get(path.name[:2], []):
        assert expected in text, f"{path.name} did not print {expected!r}"
    assert "image/png" in mimes, f"{path.name} drew no figure"
    if path.name[:2] in EXPECTED_HTML:
        assert "text/html" in mimes, f"{path.name} displayed no HTML (head view, GIF)"
    assert "Traceback" not in text
    print(f"{path.name}: {seconds:.1f} s")
    if seconds > TIME_LIMIT:
        warnings.warn(f"{path.name} took {seconds:.0f} s (limit {TIME_LIMIT:.0f} s on two cores)")


if __name__ == "__main__":          # python tests/test_notebooks.py [NN ...]: run and time them
    import tempfile

    wanted = sys.argv[1:]
    with tempfile.TemporaryDirectory() as root:
        os.environ["JUPYTER_PATH"] = root
        os.environ.setdefault("MPLBACKEND", "Agg")
        name = write_kernelspec(root)
        for path in PATHS:
            if wanted and path.name[:2] not in wanted:
                continue
            with tempfile.TemporaryDirectory() as work:
                nb, seconds = run_notebook(path, name, work)
                text, mimes = outputs_of(nb)
                missing = [e for e in EXPECTED_TEXT.get(path.name[:2], []) if e not in text]
                print(f"{path.name}: {seconds:.1f} s, outputs {sorted(mimes)}"
                      + (f", MISSING {missing}" if missing else ""), flush=True)
