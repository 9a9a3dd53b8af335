"""A short run of the binding's fuzz target (tests/fuzz/fuzz_binding.py), in a child process so
that a crash fails this test instead of killing the test run.

MHA_FUZZ_SECONDS (default 20) sets the duration, MHA_FUZZ_SEED the seed (default fixed, so CI is
reproducible; any failing input is saved and its replay command printed). The long runs
(10 minutes and more, optionally under AddressSanitizer) are tests/fuzz/run_fuzz.sh.
"""
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def test_fuzz_smoke(tmp_path):
    seconds = float(os.environ.get("MHA_FUZZ_SECONDS", "20"))
    seed = os.environ.get("MHA_FUZZ_SEED", "20261122")
    out = tmp_path / "fuzz"
    cmd = [sys.executable, os.path.join(HERE, "fuzz_binding.py"), "--engine", "random",
           "--seconds", str(seconds), "--seed", seed, "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="2")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 120,
                          cwd=str(tmp_path), env=env)
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    print(last)
    if proc.returncode != 0:
        saved = out / "current.bin"
        pytest.fail(f"the fuzz target failed (exit {proc.returncode}) with seed {seed}:\n"
                    f"{proc.stderr[-4000:]}\nreplay: {sys.executable} "
                    f"{os.path.join(HERE, 'fuzz_binding.py')} --replay {saved}")
    assert last.startswith("done:"), proc.stdout[-2000:]
    n_inputs = int(last.split()[1])
    assert n_inputs > 100 * seconds / 20, f"only {n_inputs} inputs ran: {last}"
