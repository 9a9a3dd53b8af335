"""`python -m mha stats FILE --model FOLDER` (mha.apps.stats) on tiny model folders: the NetCDF
it writes holds, window by window, the row statistics of the materialised maps
(mha.reference.row_statistics of the model's own attentions), in float64 within 1e-9."""
import subprocess
import sys

import numpy as np
import pytest

xr = pytest.importorskip("xarray")
pytest.importorskip("netCDF4")
pytest.importorskip("transformers")

import mha.models  # noqa: E402
from mha.apps import stats as command  # noqa: E402
from mha.reference import row_statistics  # noqa: E402
from tiny_models import CORPUS  # noqa: E402

ROW_STATS = ["entropy", "max", "argmax", "self", "prev", "next", "distance"]


def expected_window(model, ids):
    """Every statistic of one window from its (layers, heads, n, n) maps."""
    w = model(ids).attentions
    out = row_statistics(w, ROW_STATS)
    out["mass:first"] = row_statistics(w, "key_set_mass", key_set=np.arange(len(ids)) == 0)[
        "key_set_mass"]
    return out


def run(capsys, *argv):
    status = command.main([str(a) for a in argv] + ["--quiet"])
    printed = capsys.readouterr()
    return status, printed.out, printed.err


def test_windows_of_a_causal_gqa_model_match_the_maps(tiny, tmp_path, capsys):
    folder, _ = tiny("qwen2")                   # GQA 4/2, a sliding window on layer 1
    text = tmp_path / "long.txt"
    text.write_text(" ".join(CORPUS * 2), encoding="utf-8")
    out, png = tmp_path / "long.nc", tmp_path / "long.png"
    status, printed, err = run(capsys, text, "--model", folder, "--dtype", "float64",
                               "--window", 24, "--max-tokens", 100, "--out", out, "--figure", png)
    assert status == 0, err
    assert "100 tokens in 5 window(s) of at most 24" in printed and f"wrote {png}" in printed
    model = mha.models.load(folder, dtype=np.float64)
    ids = mha.models.Tokenizer.from_folder(folder)(text.read_text(encoding="utf-8")).ids[:100]
    with xr.open_dataset(out) as ds:
        ds.load()
    assert dict(ds.sizes) == {"layer": 2, "head": 4, "position": 100}
    assert set(ds.data_vars) == set(ROW_STATS) | {"mass:first"}
    assert ds.attrs["tokens"] == 100 and ds.attrs["windows"] == 5
    assert ds.attrs["window_tokens"] == 24 and ds.attrs["text_file"] == str(text)
    assert ds.attrs["model"] == str(folder) and ds["entropy"].dtype == np.float64
    assert ds["window"].values.tolist() == [p // 24 for p in range(100)]
    assert ds["token"].values[0] == "<s>"
    for start in range(0, 100, 24):
        stop = min(start + 24, 100)
        want = expected_window(model, np.array(ids[start:stop]))
        for name, values in want.items():
            got = ds[name].values[..., start:stop]
            if name == "argmax":                # a position in the file
                np.testing.assert_array_equal(got, values + start)
            else:
                np.testing.assert_allclose(got, values, rtol=0, atol=1e-9, err_msg=name)
    # each window's first query sees only its first key: all its weight is the sink's
    np.testing.assert_allclose(ds["mass:first"].values[..., ::24], 1.0, atol=1e-12)
    from PIL import Image
    with Image.open(png) as image:
        assert image.size[0] > 800 and image.size[1] > 200


def test_one_forward_on_an_encoder_and_the_special_key_set(tiny, tmp_path, capsys):
    folder, _ = tiny("bert")
    text = tmp_path / "short.txt"
    text.write_text(CORPUS[0] + " " + CORPUS[1], encoding="utf-8")
    out = tmp_path / "short.nc"
    status, printed, err = run(capsys, text, "--model", folder, "--stats", "entropy,max",
                               "--key-sets", "first,special", "--out", out)
    assert status == 0, err
    model = mha.models.load(folder)
    tokenized = model.tokenizer(text.read_text(encoding="utf-8"))
    n = len(tokenized.ids)
    assert f"{n} tokens in 1 window(s)" in printed
    with xr.open_dataset(out) as ds:
        ds.load()
    assert set(ds.data_vars) == {"entropy", "max", "mass:first", "mass:special"}
    assert ds.attrs["windows"] == 1 and ds.attrs["window_tokens"] == model.config.max_positions
    want = expected_window(mha.models.load(folder, dtype=np.float64), np.array(tokenized.ids))
    for name in ("entropy", "max", "mass:first"):
        np.testing.assert_allclose(ds[name].values, want[name], rtol=0, atol=2e-5, err_msg=name)
    # [CLS] is the first token and a special one: the special set holds at least the sink's mass
    # ([SEP] adds the rest)
    assert (ds["mass:special"].values >= ds["mass:first"].values - 1e-6).all()
    assert (ds["mass:special"].values > ds["mass:first"].values + 1e-3).any()


def test_errors_name_the_option(tiny, tmp_path, capsys):
    folder, _ = tiny("qwen2")
    text = tmp_path / "t.txt"
    text.write_text(CORPUS[0], encoding="utf-8")
    for argv, message in (
            ([tmp_path / "nothing.txt"], "no such file"),
            ([text, "--stats", "entropy,sink"], "--stats: unknown 'sink'"),
            ([text, "--key-sets", "cls"], "--key-sets: unknown 'cls'"),
            ([text, "--window", 0], "--window must be at least 1"),
            ([text, "--max-tokens", 0], "--max-tokens must be at least 1"),
            ([text, "--out", tmp_path / "t.csv"], "ending in .nc"),
            ([text, "--out", tmp_path / "no" / "t.nc"], "cannot write to the folder"),
            ([text, "--figure", tmp_path / "t.png", "--stats", "max", "--key-sets", "special",
              "--out", tmp_path / "t.nc"], "--figure draws the sink mass and the entropy")):
        model = [] if "--model" in argv else ["--model", folder]
        status, _, err = run(capsys, *argv, *model)
        assert status == 2 and message in err, err
    status, _, err = run(capsys, text, "--model", tmp_path)
    assert status == 2 and "cannot load the model" in err


def test_python_m_mha_lists_and_runs_stats(tmp_path):
    run = subprocess.run([sys.executable, "-m", "mha"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "stats" in run.stdout
    run = subprocess.run([sys.executable, "-m", "mha", "stats", "--help"], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0 and "--max-tokens N" in run.stdout, run.stderr


def test_long_context_benchmark_quick(tmp_path):
    """benchmarks/long_context.py --quick: each case in its own process; the peak above the
    weights counts what the call allocates (the maps of the weights case at least). At 512
    tokens the maps (28 MiB) outweigh the forward's own scratch (about 20 MiB at its peak,
    which a result can reuse), so the statistics' peak stands clear of the weights' (at 256
    tokens, 7 MiB of maps against a forward's 10-12.5 MiB of peak, the two overlapped run to
    run)."""
    import json
    from pathlib import Path
    n = 512
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "long_context.py"
    out = tmp_path / "quick.json"
    run = subprocess.run([sys.executable, str(script), "--quick", "--tokens", str(n),
                          "--workdir", str(tmp_path), "--json", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "| stats |" in run.stdout and f"2 x 14 x {n}^2 x 4 bytes" in run.stdout
    results = {case: rs[0] for case, rs in json.loads(out.read_text())["results"].items()}
    assert set(results) == {"forward", "stats", "stats-3sets", "weights"}
    maps = 2 * 14 * n * n * 4
    hidden = 3 * n * 896 * 4  # every layer's hidden states
    assert results["weights"]["result"] == maps + hidden
    assert results["forward"]["result"] == hidden
    # per layer, head and query: 6 float32 statistics, argmax (int64) and the sink mass
    assert results["stats"]["result"] == 2 * 14 * n * (6 * 4 + 8 + 4)
    assert results["weights"]["peak"] >= maps + hidden
    assert results["stats"]["peak"] < results["weights"]["peak"] - maps // 2
    for r in results.values():
        assert abs(r["reset_residue"]) < 2**20 and r["seconds"] > 0
