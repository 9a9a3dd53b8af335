"""mha.viz.long_context_figure and smooth_positions on synthetic statistics of the shape
model.head_statistics returns: {name: (layers, heads, n)}, a batch of them, or the xarray
Dataset that python -m mha stats writes."""
import matplotlib
import numpy as np
import pytest

matplotlib.use("Agg")

from mha import viz  # noqa: E402
from test_viz import render  # noqa: E402

L, H, N = 24, 14, 3000


@pytest.fixture
def stats(rng):
    sink = rng.random((L, H, N))
    entropy = 8 * rng.random((L, H, N))
    return {"mass:first": sink, "entropy": entropy, "argmax": rng.integers(0, N, (L, H, N))}


def images(fig):
    return [im for ax in fig.axes for im in ax.images]


def test_one_row_per_layer_one_column_per_statistic_images_hold_the_values(stats):
    fig = viz.long_context_figure(stats)
    render(fig, dpi=20)
    panels = [ax for ax in fig.axes if ax.images]
    assert len(panels) == 2 * L and len(fig.axes) == 2 * L + 2            # + 2 colour bars
    ims = images(fig)                     # row by row: layer 0's sink mass, its entropy, layer 1's...
    np.testing.assert_array_equal(ims[2 * 5].get_array(), stats["mass:first"][5])
    np.testing.assert_array_equal(ims[2 * 23 + 1].get_array(), stats["entropy"][23])
    assert ims[0].get_clim() == (0.0, 1.0)                                  # a share: [0, 1]
    assert ims[1].get_clim() == (0.0, pytest.approx(stats["entropy"].max()))
    assert ims[0].get_extent() == [-0.5, N - 0.5, H - 0.5, -0.5]            # heads x positions
    assert panels[2 * 3].get_ylabel() == "L3"
    assert "sink mass" in panels[0].get_title() and "entropy" in panels[1].get_title()
    assert f"{N:,} tokens" in fig.get_suptitle()


def test_smoothing_layers_and_lines(stats):
    fig = viz.long_context_figure(stats, ["entropy"], layers=[2, 7], smooth=50, kind="lines")
    panels = [ax for ax in fig.axes if ax.lines]
    assert len(panels) == 2 and [ax.get_ylabel() for ax in panels] == ["L2", "L7"]
    assert all(len(ax.lines) == H for ax in panels)
    y = panels[1].lines[4].get_ydata()
    expected = viz.smooth_positions(stats["entropy"][7, 4], 50)
    np.testing.assert_allclose(y, expected, rtol=1e-12)
    assert abs(y[1000] - stats["entropy"][7, 4, 975:1025].mean()) < 1e-12
    assert "mean over 50 positions" in fig.get_suptitle()
    render(fig, dpi=30)


def test_smooth_positions_is_a_centred_mean_of_what_exists():
    x = np.array([[0.0, 0.0, 4.0, 0.0, 0.0, 8.0]])
    np.testing.assert_allclose(viz.smooth_positions(x, 3),
                               [[0.0, 4 / 3, 4 / 3, 4 / 3, 8 / 3, 4.0]], rtol=1e-15)
    # an even window reaches one further back: i-2 .. i+1
    np.testing.assert_allclose(viz.smooth_positions(x, 4), [[0.0, 4 / 3, 1.0, 1.0, 3.0, 8 / 3]],
                               rtol=1e-15)
    np.testing.assert_array_equal(viz.smooth_positions(x, 1), x)
    # a window longer than the text: every position averages everything
    np.testing.assert_allclose(viz.smooth_positions(x, 99), np.full((1, 6), 2.0), rtol=1e-15)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="smooth"):
            viz.smooth_positions(x, bad)


def test_a_batch_is_indexed_and_a_dataset_reads_the_same(stats):
    xr = pytest.importorskip("xarray")
    batch = {k: np.stack([v, v[..., ::-1]]) for k, v in stats.items()}
    fig = viz.long_context_figure(batch, index=1, layers=[0])
    np.testing.assert_array_equal(images(fig)[0].get_array(), stats["mass:first"][0, :, ::-1])
    with pytest.raises(ValueError, match="index 2"):
        viz.long_context_figure(batch, index=2)
    # the Dataset of the stats command: position in the file, two windows of 2,000 + 1,000
    window = np.repeat([0, 1], [2000, 1000])
    ds = xr.Dataset({k: (("layer", "head", "position"), v) for k, v in stats.items()},
                    coords={"position": np.arange(N) + 10, "window": ("position", window)})
    fig = viz.long_context_figure(ds.transpose("position", "head", "layer"), layers=[1])
    np.testing.assert_array_equal(images(fig)[0].get_array(), stats["mass:first"][1])
    assert images(fig)[0].get_extent() == [9.5, N + 9.5, H - 0.5, -0.5]
    # the start of window 1 is marked in each panel
    marks = [line.get_xdata()[0] for line in fig.axes[0].lines]
    assert marks == [2000 + 10 - 0.5]


def test_bad_input_names_the_argument(stats):
    with pytest.raises(ValueError, match=r"quantities: 'mass:first'.*key_sets=\['first'\]"):
        viz.long_context_figure({"entropy": stats["entropy"]})
    with pytest.raises(ValueError, match="expected \\(layers, heads, n\\)"):
        viz.long_context_figure({"mass:first": np.zeros((3, 4)), "entropy": np.zeros((3, 4))})
    with pytest.raises(ValueError, match="layers \\[24\\] out of range"):
        viz.long_context_figure(stats, layers=[24])
    with pytest.raises(ValueError, match="kind"):
        viz.long_context_figure(stats, kind="bars")
    with pytest.raises(ValueError, match="different shapes"):
        viz.long_context_figure({"mass:first": stats["mass:first"],
                                 "entropy": stats["entropy"][:, :, :10]})
