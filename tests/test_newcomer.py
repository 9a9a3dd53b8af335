"""What a new user meets: the README's first command, run exactly as written from the root of a
fresh clone, and `import mha` from a source tree that has no compiled core.

The first test clones the committed HEAD of this checkout into a temporary folder and runs the
first command line of the README's first ```bash block there with bash, with a plain PATH and no
active virtual environment (what shared/tools/try-as-newcomer does). It needs git, a network to
the package index and a few minutes; set MHA_SKIP_NEWCOMER=1 to skip it.
"""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def readme_first_command(text):
    """The first non-comment line of the README's first ```bash block (no leading '$ ')."""
    block = re.search(r"^```(?:bash|sh|console)\n(.*?)^```", text, re.S | re.M)
    assert block, "the README has no ```bash block"
    for line in block.group(1).splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            return line[2:] if line.startswith("$ ") else line
    raise AssertionError("the README's first bash block has no command")


def test_readme_first_command_parser():
    text = "# t\n```python\nx = 1\n```\n```bash\n# a comment\n\n$ make it && run\nsecond\n```\n"
    assert readme_first_command(text) == "make it && run"


@pytest.mark.skipif(os.environ.get("MHA_SKIP_NEWCOMER") == "1", reason="MHA_SKIP_NEWCOMER=1")
def test_readme_first_command_works_from_a_fresh_clone(tmp_path):
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs git and a git checkout of mha")
    repo = tmp_path / "repo"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(repo)], check=True, timeout=120)
    command = readme_first_command((repo / "README.md").read_text())
    env = {k: v for k, v in os.environ.items()
           if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME") and not k.startswith("MHA_")}
    env["PATH"] = os.pathsep.join(["/usr/local/bin", "/usr/bin", "/bin"])
    # the python3 that runs this test, so that the command finds a Python with venv
    env["PATH"] = os.path.dirname(os.path.realpath(sys.executable)) + os.pathsep + env["PATH"]
    done = subprocess.run(["bash", "-c", command], cwd=repo, env=env, capture_output=True,
                          text=True, timeout=1800)
    assert done.returncode == 0, (f"`{command}` failed in a fresh clone with exit status "
                                  f"{done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    assert (repo / "mha-tour" / "index.html").is_file(), done.stdout[-2000:]


def test_import_from_a_source_tree_without_the_core_says_what_to_do(tmp_path):
    """A copy of the package without its compiled core, imported from its parent folder (what
    Python does when started in src/): one ImportError that says what happened and what to do,
    never the 'partially initialized module' of a circular import."""
    import mha

    shutil.copytree(Path(mha.__file__).parent, tmp_path / "mha",
                    ignore=shutil.ignore_patterns("_C.*", "__pycache__"))
    done = subprocess.run([sys.executable, "-c", "import mha"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": ""})
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: mha's compiled core (mha._C) is not built in"), last
    assert "pip install ." in last and "partially initialized" not in done.stderr
