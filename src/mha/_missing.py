"""The message of the ImportError raised when mha's compiled core `mha._C` cannot be loaded."""
import os


def explain(init_file: str, error: BaseException) -> str:
    """What happened and what to do, for `import mha` failing at `from . import _C`.

    Two cases: the package folder has no compiled extension at all (Python was started in a
    source tree, or the package was copied without building), or it has one that fails to load
    (built for another Python, or a shared library such as the OpenMP runtime is missing).
    """
    folder = os.path.dirname(os.path.abspath(init_file))
    built = [f for f in os.listdir(folder) if f.startswith("_C.") and f.endswith((".so", ".pyd"))]
    if built:
        return (f"mha's compiled core {os.path.join(folder, built[0])} is there but cannot be "
                f"loaded: {error}. Rebuild it for this Python with `pip install .` from the "
                f"repository's root (or `python setup.py build_ext --inplace` for a development "
                f"checkout).")
    return (f"mha's compiled core (mha._C) is not built in {folder}: this looks like mha's source "
            f"tree, which Python imported instead of an installed mha. Install it with "
            f"`pip install .` from the repository's root and start Python from any folder but "
            f"src/ (or build it in place with `python setup.py build_ext --inplace` and put "
            f"src/ on PYTHONPATH).")
