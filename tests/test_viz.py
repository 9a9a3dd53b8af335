"""mha.viz: every figure renders to a non-blank PNG with its labels (Agg backend)."""
import io

import matplotlib
import numpy as np
import pytest
from PIL import Image

matplotlib.use("Agg")

from mha import analysis, viz  # noqa: E402

TOKENS = ["The", "cat", "sat", "on", "the", "mat"]


def softmax(s):
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


@pytest.fixture
def attention(rng):
    return softmax(rng.standard_normal((3, 4, 6, 6)) * 2)          # (layers, heads, n, n)


def render(fig, dpi=40):
    """The figure as an RGB array, checked to be a real picture (not blank)."""
    from matplotlib.figure import Figure
    assert isinstance(fig, Figure)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    image = np.asarray(Image.open(io.BytesIO(buffer.getvalue())).convert("RGB")).astype(float)
    assert image.shape[0] > 50 and image.shape[1] > 50
    assert image.std() > 10, "the picture is (nearly) one colour"
    n_colors = len(np.unique(image.reshape(-1, 3), axis=0))
    assert n_colors > 20, f"only {n_colors} colours: nothing much was drawn"
    return image


def texts(fig):
    return {t.get_text() for ax in fig.axes for t in ax.texts}


def test_heatmap_has_tokens_annotations_and_axis_titles(attention):
    fig = viz.heatmap(attention[0, 0], TOKENS, title="Single-Head Attention")
    render(fig)
    ax = fig.axes[0]
    assert ax.get_xlabel() == "Key (attending to)"
    assert ax.get_ylabel() == "Query (attending from)"
    assert ax.get_title() == "Single-Head Attention"
    assert [t.get_text() for t in ax.get_xticklabels()] == TOKENS
    assert [t.get_text() for t in ax.get_yticklabels()] == TOKENS
    assert f"{attention[0, 0, 2, 3]:.2f}" in texts(fig)             # annotated cells
    assert len(fig.axes) == 2                                      # + colorbar


def test_heatmap_draws_into_given_axes_and_handles_cross_attention(rng):
    from matplotlib.figure import Figure
    fig = Figure(figsize=(8, 3))
    axes = fig.subplots(1, 2)
    w = softmax(rng.standard_normal((3, 5)))
    out = viz.heatmap(w, ["a", "b", "c"], key_tokens=list("vwxyz"), ax=axes[1], colorbar=False)
    assert out is fig
    assert [t.get_text() for t in axes[1].get_xticklabels()] == list("vwxyz")
    render(fig)
    with pytest.raises(ValueError, match="tokens"):
        viz.heatmap(w, ["a", "b"])
    # a batch of one is squeezed; a torch tensor-like 4-D (1, 1, n, n) works
    render(viz.heatmap(w[None, None], ["a", "b", "c"], key_tokens=list("vwxyz")))


def test_head_grid_uses_n_cols(attention):
    fig = viz.head_grid(attention[1], TOKENS, n_cols=3)
    render(fig)
    visible = [ax for ax in fig.axes if ax.get_visible() and ax.get_title().startswith("Head")]
    assert [ax.get_title() for ax in visible] == ["Head 0", "Head 1", "Head 2", "Head 3"]
    assert len(fig.axes) == 2 * 3 + 1                              # 2 rows x 3 cols + colorbar
    assert sum(not ax.get_visible() for ax in fig.axes) == 2       # the unused panels
    assert fig.get_suptitle() == "Attention Patterns per Head"
    fig = viz.head_grid(attention, TOKENS, layer=2, heads=[1, 3], n_cols=2)
    assert [ax.get_title() for ax in fig.axes[:2]] == ["Layer 2, Head 1", "Layer 2, Head 3"]
    with pytest.raises(ValueError, match="layer"):
        viz.head_grid(attention, TOKENS)


def test_similarity_matrices_per_layer(attention):
    fig = viz.similarity_matrices(attention, layers=[0, 2], n_cols=2)
    render(fig)
    assert [ax.get_title() for ax in fig.axes[:2]] == ["Layer 0", "Layer 2"]
    assert "1.00" in texts(fig)                                    # the diagonal
    assert "Cosine" in fig.get_suptitle()
    assert "Jensen-Shannon" in viz.similarity_matrices(attention[0], metric="js").get_suptitle()
    with pytest.raises(ValueError, match="metric"):
        viz.similarity_matrices(attention, metric="euclid")


def test_mask_picture():
    fig = viz.mask_heatmap(6)
    image = render(fig)
    ax = fig.axes[0]
    assert ax.get_title() == "Causal Attention Mask"
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("Key Position", "Query Position")
    assert sorted(t.get_text() for t in ax.texts).count("1") == 21   # tril(ones(6, 6))
    assert image.shape[0] > 100
    # a bool mask (True = may attend) and an additive float mask give the same picture
    causal = np.tril(np.ones((4, 4), bool))
    additive = np.where(causal, 0.0, -np.inf)
    a = [t.get_text() for t in viz.mask_heatmap(causal).axes[0].texts]
    b = [t.get_text() for t in viz.mask_heatmap(additive).axes[0].texts]
    assert a == b and a.count("1") == 10


def test_concat_projection_picture(rng):
    fig = viz.concat_projection(seed=0)
    render(fig)
    titles = [ax.get_title() for ax in fig.axes[:3]]
    assert titles[0].startswith("Individual Head Outputs") and "4 heads x 2 dims" in titles[0]
    assert titles[1].startswith("After Concatenation") and "1 x 8 dims" in titles[1]
    assert titles[2].startswith("After W_o Projection")
    # given head outputs and W_o: the projection is concat @ W_o
    heads = rng.standard_normal((2, 3))
    W_o = rng.standard_normal((6, 5))
    fig = viz.concat_projection(heads, W_o)
    drawn = fig.axes[2].images[0].get_array()
    assert np.allclose(drawn, heads.reshape(1, 6) @ W_o)
    with pytest.raises(ValueError, match="W_o"):
        viz.concat_projection(heads, W_o[:4])


def test_training_curves_accuracy_bars_and_speed_bars():
    losses = {"1 Head": np.linspace(1.5, 0.8, 50), "4 Heads": np.linspace(1.5, 0.2, 50),
              "8 Heads": np.linspace(1.5, 0.1, 50)}
    accuracies = {"1 Head": 0.62, "4 Heads": 0.97, "8 Heads": 1.0}
    fig = viz.training_summary(losses, accuracies)
    render(fig)
    loss_ax, acc_ax = fig.axes
    assert [line.get_label() for line in loss_ax.get_lines()] == list(losses)
    assert (loss_ax.get_xlabel(), loss_ax.get_ylabel()) == ("Epoch", "Loss")
    assert {"62.0%", "97.0%", "100.0%"} <= {t.get_text() for t in acc_ax.texts}
    assert acc_ax.get_ylabel() == "Test Accuracy"
    render(viz.training_curves(losses, log=True))
    render(viz.accuracy_bars([0.5, 0.9]))
    times = {"1 Head": 3.1, "4 Heads": 3.4, "8 Heads": 3.9, "16 Heads": 4.7}
    fig = viz.speed_bars(times)
    render(fig)
    assert len(fig.axes[0].patches) == 4
    assert "4.70 ms" in texts(fig)
    assert fig.axes[0].get_ylabel() == "Time (ms)"


def test_pruning_plot():
    value = np.array([0.0, 0.3, 0.002, 0.05, 0.0, 0.1, 0.004, 0.2])
    curve = analysis.pruning_curve(lambda m: 0.3 + float((value * m).sum()), 8)
    fig = viz.pruning_plot(curve)
    render(fig)
    assert f"{curve.prunable}/8 heads prunable" in [t.get_text() for t in fig.axes[0].get_legend().texts]


def test_attention_gif_one_frame_per_layer(attention, tmp_path):
    path = tmp_path / "heads.gif"
    gif = viz.attention_gif(attention, TOKENS, path, head=1, fps=4, dpi=40)
    assert gif.n_frames == 3 and path.read_bytes() == gif.data
    image = Image.open(path)
    assert image.format == "GIF" and image.n_frames == 3
    assert image.info.get("duration") == 250 and image.info.get("loop") == 0
    frames = []
    for i in range(3):
        image.seek(i)
        frames.append(np.asarray(image.convert("RGB")).astype(float))
    assert all(f.std() > 10 for f in frames)
    assert np.abs(frames[0] - frames[1]).mean() > 0.5                # layers differ
    assert gif._repr_html_().startswith('<img src="data:image/gif;base64,')
    # the sum of heads, from a list of per-layer (1, heads, n, n) arrays (Hugging Face style)
    gif = viz.attention_gif([a[None] for a in attention], TOKENS, head="sum", dpi=40)
    assert gif.n_frames == 3


def test_figures_stay_out_of_pyplot(attention):
    import matplotlib.pyplot as plt
    before = plt.get_fignums()
    viz.heatmap(attention[0, 0], TOKENS)
    viz.mask_heatmap(3)
    assert plt.get_fignums() == before
