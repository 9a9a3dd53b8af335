"""`python -m mha tour`: every figure is written and is a real picture, index.html shows them,
the head view is there; --help explains every option; bad options, an unwritable folder and a
missing model give a one-line message and exit status 2, never a traceback.

The full tour runs once, in --quick mode (30 training epochs instead of 100: the same files).
"""
import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("PIL")
from PIL import Image

from mha.apps import tour
from mha.apps.tour import schedule


@pytest.fixture(scope="module")
def tour_dir(tmp_path_factory):
    pytest.importorskip("tokenizers")
    pytest.importorskip("safetensors")
    try:
        from mha.models import minilm_path
        minilm_path()
    except (ModuleNotFoundError, FileNotFoundError) as e:
        pytest.skip(f"the embedded MiniLM is not installed: {e}")
    out = tmp_path_factory.mktemp("tour") / "figures"          # created by the tour
    assert tour.main(["--out", str(out), "--quick", "--quiet"]) == 0
    return out


PNGS = [name for name in tour.FILES if name.endswith(".png")]


def test_at_least_the_eight_figures_of_the_issue():
    assert len(PNGS) >= 8
    for needed in ("sentence_heads", "layer_grid", "head_diversity", "causal_mask",
                   "concat_projection", "training", "speed", "pruning"):
        assert any(needed in name for name in PNGS), needed


@pytest.mark.parametrize("name", PNGS)
def test_png_is_a_real_picture(tour_dir, name):
    path = tour_dir / name
    assert path.is_file(), f"{name} was not written"
    with Image.open(path) as img:
        assert img.format == "PNG"
        width, height = img.size
        pixels = np.asarray(img.convert("RGB"), dtype=np.float64)
    assert width >= 400 and height >= 250, (name, img.size)
    # not blank: a real figure has many colours and a fair share of non-white pixels
    assert pixels.std() > 10, f"{name} looks blank (pixel std {pixels.std():.1f})"
    colours = np.unique(pixels.reshape(-1, 3)[::7], axis=0)
    assert len(colours) > 20, f"{name} has only {len(colours)} colours"
    assert (pixels.min(axis=-1) < 200).mean() > 0.02, f"{name} is almost all white"


def test_gif_has_one_frame_per_layer(tour_dir):
    with Image.open(tour_dir / "attention_layers.gif") as gif:
        assert gif.format == "GIF"
        assert gif.n_frames == 6                                    # MiniLM's layers


def test_head_view_is_self_contained(tour_dir):
    page = (tour_dir / "head_view.html").read_text(encoding="utf-8")
    assert "<script" in page and "telescope" in page
    assert "http://" not in page.replace("http://www.w3.org", "")  # no network


def test_index_shows_every_file_with_a_sentence(tour_dir):
    page = (tour_dir / "index.html").read_text(encoding="utf-8")
    for name in tour.FILES:
        if name != "index.html":
            assert f'src="{name}"' in page, f"index.html does not show {name}"
    assert page.count("<section>") == len(tour.FILES) - 1
    assert "<h2>" in page and "<p>" in page
    assert not list(tour_dir.glob(".mha-tour-*")), "the write probe was left behind"


# Stand-in figures for the schedule's tests: module-level, so that a spawned worker process
# finds them by name (it imports this module); each writes its file and says which process drew it.
def _stub_draw(t, path):
    path.write_text(str(os.getpid()))
    return str(os.getpid())


def _stub_fail(t, path):
    raise RuntimeError(f"{path.name} failed in its process")


STUBS = (tour.Figure("a", "A", _stub_draw), tour.Figure("g1", "G1", _stub_draw, group="g"),
         tour.Figure("b", "B", _stub_draw), tour.Figure("t", "T", _stub_draw, alone=True),
         tour.Figure("g2", "G2", _stub_draw, group="g"), tour.Figure("c", "C", _stub_draw),
         tour.Figure("d", "D", _stub_draw))


@pytest.mark.parametrize("jobs", [1, 2])
def test_schedule_draws_each_figure_once_a_group_in_one_process_and_the_timed_one_alone(tmp_path, jobs):
    import multiprocessing

    done = []
    schedule.draw_all(tour.Tour(tmp_path, "no model needed"), STUBS, jobs, done.extend)
    names = [name for name, _, _ in done]
    pid = {name: int(sentence) for name, sentence, _ in done}
    assert sorted(names) == sorted(f.name for f in STUBS)
    assert all(int((tmp_path / name).read_text()) == pid[name] for name in names)
    assert names.index("g2") == names.index("g1") + 1 and pid["g1"] == pid["g2"]    # one task
    assert names[-1] == "t" and pid["t"] == os.getpid()             # last, here, workers gone
    if jobs == 1:
        assert set(pid.values()) == {os.getpid()}
    else:                                   # the group went to the worker, "a" stayed here
        assert pid["g1"] != os.getpid() and pid["a"] == os.getpid()
    assert not multiprocessing.active_children()


def test_schedule_raises_a_workers_error_and_stops_it(tmp_path):
    import multiprocessing

    stubs = (tour.Figure("g1", "G1", _stub_fail, group="g"),) + STUBS[:1]
    with pytest.raises(RuntimeError, match="g1 failed in its process"):
        schedule.draw_all(tour.Tour(tmp_path, "no model needed"), stubs, 2, lambda results: None)
    assert not multiprocessing.active_children()


def test_help_explains_every_option(capsys):
    assert tour.main(["--help"]) == 0
    text = capsys.readouterr().out
    for option in ("--out", "--model", "--quick", "--threads", "--jobs", "--quiet"):
        assert option in text
    assert "minilm" in text and "index.html" in text


@pytest.mark.parametrize("argv, message", [
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--threads", "0"], "expected a positive integer"),
    (["--threads", "two"], "expected a positive integer"),
    (["--out"], "expected one argument"),
])
def test_bad_option_is_a_clear_error(argv, message, capsys):
    assert tour.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "usage: python -m mha tour" in err
    assert "Traceback" not in err


def test_unwritable_folder_is_a_clear_error(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    assert tour.main(["--out", str(blocker / "figures"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "cannot write to the folder" in err and str(blocker / "figures") in err
    assert "Traceback" not in err and err.count("\n") == 1


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0,
                    reason="root can write into a read-only folder")
def test_read_only_folder_is_a_clear_error(tmp_path, capsys):
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        assert tour.main(["--out", str(folder), "--quiet"]) == 2
    finally:
        folder.chmod(0o700)
    err = capsys.readouterr().err
    assert "cannot write to the folder" in err and "ermission denied" in err


def test_missing_model_is_a_clear_error(tmp_path, capsys):
    missing = tmp_path / "no-such-model"
    assert tour.main(["--out", str(tmp_path / "out"), "--model", str(missing), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "cannot load the model" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists(), "an empty output folder was left behind"


def test_python_dash_m_routes_to_the_tour(tmp_path):
    env = dict(os.environ, MPLBACKEND="Agg")
    done = subprocess.run([sys.executable, "-m", "mha", "tour", "--no-such-option"], cwd=tmp_path,
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2
    assert "unrecognized arguments: --no-such-option" in done.stderr
    assert "Traceback" not in done.stderr
    done = subprocess.run([sys.executable, "-m", "mha", "tour", "--help"], cwd=tmp_path,
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0 and "--out DIR" in done.stdout
