"""What a new user meets: the README's commands, run exactly as written from the root of a
fresh clone, each in the environment the one before it made, and `import mha` from a source
tree that has no compiled core.

The README's first ```bash block holds three commands: 1 sets up a virtual environment and
runs the tour, 2 is `bash .ci/run` (the run of the tests this file is part of: a test cannot
start it again), 3 builds the documentation in the environment of command 1. The test clones
the committed HEAD of this checkout into a temporary folder and runs 1, then 3 after
activating the environment 1 made (as the user's shell has it), with a plain PATH and no other
virtual environment active. It needs git, the package index and a few minutes; set
MHA_SKIP_NEWCOMER=1 to skip it.
"""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def readme_commands(text):
    """The command lines of the README's first ```bash block (comments and blank lines left
    out, a leading '$ ' removed)."""
    block = re.search(r"^```(?:bash|sh|console)\n(.*?)^```", text, re.S | re.M)
    assert block, "the README has no ```bash block"
    lines = [line for line in block.group(1).splitlines()
             if line.strip() and not line.lstrip().startswith("#")]
    assert lines, "the README's first bash block has no command"
    return [line[2:] if line.startswith("$ ") else line for line in lines]


def test_readme_commands_parser():
    text = "# t\n```python\nx = 1\n```\n```bash\n# a comment\n\n$ make it && run\nsecond\n```\n"
    assert readme_commands(text) == ["make it && run", "second"]


def test_readme_has_the_three_commands():
    commands = readme_commands((ROOT / "README.md").read_text())
    assert len(commands) == 3, commands
    assert "python -m mha tour" in commands[0] and ". .venv/bin/activate" in commands[0]
    assert commands[1] == "bash .ci/run"
    assert "sphinx" in commands[2] and "docs/_build/html" in commands[2]


@pytest.mark.skipif(os.environ.get("MHA_SKIP_NEWCOMER") == "1", reason="MHA_SKIP_NEWCOMER=1")
def test_readme_commands_work_in_order_from_a_fresh_clone(tmp_path):
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs git and a git checkout of mha")
    repo = tmp_path / "repo"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(repo)], check=True, timeout=120)
    setup, _ci, docs = readme_commands((repo / "README.md").read_text())
    env = {k: v for k, v in os.environ.items()
           if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME") and not k.startswith("MHA_")}
    env["PATH"] = os.pathsep.join(["/usr/local/bin", "/usr/bin", "/bin"])
    # the python3 that runs this test, so that the command finds a Python with venv
    env["PATH"] = os.path.dirname(os.path.realpath(sys.executable)) + os.pathsep + env["PATH"]
    # command 1 activates .venv in the user's shell; command 3 runs in that shell afterwards
    for command, script, made in (
            (setup, setup, repo / "mha-tour" / "index.html"),
            (docs, f". .venv/bin/activate && {docs}",
             repo / "docs" / "_build" / "html" / "reference" / "mha.corpus.html")):
        done = subprocess.run(["bash", "-c", script], cwd=repo, env=env, capture_output=True,
                              text=True, timeout=1800)
        assert done.returncode == 0, (f"`{command}` failed in a fresh clone with exit status "
                                      f"{done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
        assert made.is_file(), done.stdout[-2000:]


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
