"""A map of all heads: multidimensional scaling of the distances between their attention
(Clark et al. 2019, Section 6)."""
from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike

from ._inputs import _as_weights, _batch_mask, _check_convention, _real_square
from .similarity import head_distance

__all__ = ["classical_mds", "metric_mds", "head_map"]


def classical_mds(distances: ArrayLike, n_components: int = 2) -> np.ndarray:
    r"""Place points whose Euclidean distances approximate the given ones (classical MDS).

    This is classical (Torgerson) multidimensional scaling.

    With :math:`D^{(2)}` the squared distances and :math:`J = I - \frac{1}{N} 1 1^\top`, the
    Gram matrix :math:`B = -\frac12 J D^{(2)} J` is eigendecomposed and the points are the top
    eigenvectors scaled by the square roots of their (non-negative) eigenvalues. Exact when
    the distances are Euclidean.

    Parameters
    ----------
    distances : array_like, shape (N, N)
        Symmetric, zero diagonal.
    n_components : int
        Dimensions of the map.

    Returns
    -------
    points : ndarray, shape (N, n_components)
        Centred; the sign of each axis is fixed so that its largest coordinate is positive.

    References
    ----------
    W. S. Torgerson, "Multidimensional scaling: I. Theory and method", Psychometrika 17, 1952.

    Examples
    --------
    >>> pts = np.array([[0.0, 0.0], [3.0, 0.0], [0.0, 4.0]])
    >>> d = np.linalg.norm(pts[:, None] - pts[None], axis=-1)
    >>> q = classical_mds(d)
    >>> bool(np.allclose(np.linalg.norm(q[:, None] - q[None], axis=-1), d))
    True
    """
    d = np.asarray(distances, dtype=np.float64)
    if d.ndim != 2 or d.shape[0] != d.shape[1]:
        raise ValueError(f"distances has shape {d.shape}: expected a square (N, N) matrix")
    N = d.shape[0]
    j = np.eye(N) - 1.0 / N
    gram = -0.5 * j @ (d * d) @ j
    values, vectors = np.linalg.eigh(0.5 * (gram + gram.T))
    order = np.argsort(values)[::-1][:n_components]
    points = vectors[:, order] * np.sqrt(np.maximum(values[order], 0))
    if points.shape[1] < n_components:
        points = np.pad(points, ((0, 0), (0, n_components - points.shape[1])))
    flip = np.sign(points[np.argmax(np.abs(points), axis=0), np.arange(n_components)])
    return points * np.where(flip == 0, 1, flip)


def metric_mds(distances: ArrayLike, n_components: int = 2, *, n_init: int = 5,
               max_iter: int = 1000, eps: float = 1e-10, seed: int | None = 0,
               init: ArrayLike | None = None) -> np.ndarray:
    r"""Place points whose Euclidean distances fit the given ones in least squares (SMACOF).

    Metric multidimensional scaling minimises the raw stress
    :math:`\sigma(X) = \sum_{i<j} (\|x_i - x_j\| - \delta_{ij})^2` by majorization (SMACOF):
    from a start :math:`X`, the Guttman transform :math:`X \leftarrow \frac1N B(X) X`, with
    :math:`b_{ij} = -\delta_{ij} / \|x_i - x_j\|` off the diagonal (0 for coincident points)
    and rows of :math:`B` summing to 0, never raises the stress. It runs from the
    :func:`classical_mds` configuration and from ``n_init`` random starts (uniform in the unit
    square), each until the stress falls by less than ``eps`` of itself in one step or for
    ``max_iter`` steps, and keeps the configuration of least stress. Unlike
    :func:`classical_mds` it fits the distances themselves, not their squares
    through a Gram matrix, and needs no Euclidean input.

    Parameters
    ----------
    distances : array_like, shape (N, N)
        Symmetric dissimilarities, zero diagonal.
    n_components : int
        Dimensions of the map.
    n_init : int
        Random starts; the best is kept.
    max_iter : int
        Most Guttman transforms per start.
    eps : float
        Stop a start when one step lowers the stress by less than ``eps`` times the stress.
    seed : int or None
        Seed of the random starts (None: fresh entropy from the operating system).
    init : array_like, shape (N, n_components), optional
        Start from this configuration alone (``n_init`` and ``seed`` are then not used).

    Returns
    -------
    points : ndarray, shape (N, n_components)
        Centred and turned to their principal axes, the sign of each axis fixed so that its
        largest coordinate is positive (stress does not change under these).

    Raises
    ------
    ValueError
        A matrix that is not square, ``n_init`` or ``max_iter`` below 1, or an ``init`` of
        the wrong shape.

    See Also
    --------
    classical_mds : The eigendecomposition that needs no iterations.

    Notes
    -----
    The defaults are the options of the call behind Clark et al.'s map of BERT's heads
    (scikit-learn's ``MDS(metric=True, n_init=5, eps=1e-10, max_iter=1000,
    dissimilarity="precomputed")``, five random starts that were not seeded). From the same
    start the two reach the same configuration; the classical start added here can only lower
    the stress of the best of the random ones.

    References
    ----------
    J. de Leeuw, "Applications of convex analysis to multidimensional scaling", in Recent
    Developments in Statistics, North-Holland, 1977.
    I. Borg and P. J. F. Groenen, "Modern Multidimensional Scaling", 2nd ed., Springer, 2005,
    Chapter 8.

    Examples
    --------
    >>> d = 1.0 - np.eye(4)                    # four points at distance 1 from each other
    >>> q = metric_mds(d)                      # the best a plane can do is a square
    >>> np.sort(np.linalg.norm(q[:, None] - q[None], axis=-1)[np.triu_indices(4, 1)]).round(4)
    array([0.8536, 0.8536, 0.8536, 0.8536, 1.2071, 1.2071])
    """
    d = np.asarray(distances, dtype=np.float64)
    if d.ndim != 2 or d.shape[0] != d.shape[1]:
        raise ValueError(f"distances has shape {d.shape}: expected a square (N, N) matrix")
    if n_init < 1 or max_iter < 1:
        raise ValueError(f"n_init={n_init}, max_iter={max_iter}: expected at least 1 each")
    d = 0.5 * (d + d.T)
    N = d.shape[0]
    if init is not None:
        starts = [np.array(init, dtype=np.float64)]
        if starts[0].shape != (N, n_components):
            raise ValueError(f"init has shape {starts[0].shape}: expected {(N, n_components)}")
    else:
        rng = np.random.default_rng(seed)
        starts = [classical_mds(d, n_components)]
        starts += [rng.uniform(size=(N, n_components)) for _ in range(n_init)]
    best, best_stress = None, np.inf
    for start in starts:
        points, stress = _smacof(d, start, max_iter, eps)
        if stress < best_stress:
            best, best_stress = points, stress
    assert best is not None                               # starts holds one start or more
    return _principal_axes(best)


def _pairwise(x: np.ndarray) -> np.ndarray:
    """Euclidean distances between the rows of x: (N, N)."""
    diff = x[:, None, :] - x[None, :, :]
    return np.sqrt(np.einsum("ijk,ijk->ij", diff, diff))


def _smacof(d: np.ndarray, x: np.ndarray, max_iter: int, eps: float) -> tuple[np.ndarray, float]:
    """Guttman transforms from x until the stress stalls: (points, their stress)."""
    N = d.shape[0]
    dist = _pairwise(x)
    stress = 0.5 * float(((dist - d) ** 2).sum())          # each pair twice in the matrix
    for _ in range(max_iter):
        ratio = np.divide(d, dist, out=np.zeros_like(d), where=dist > 0)
        b = -ratio
        b[np.diag_indices(N)] = ratio.sum(axis=1) - np.diagonal(ratio)
        x = b @ x / N
        dist = _pairwise(x)
        previous, stress = stress, 0.5 * float(((dist - d) ** 2).sum())
        if previous - stress <= eps * previous:             # also stops at a perfect fit
            break
    return x, stress


def _principal_axes(x: np.ndarray) -> np.ndarray:
    """x centred, turned to its principal axes, each axis' largest coordinate positive."""
    x = x - x.mean(axis=0)
    _, _, vt = np.linalg.svd(x, full_matrices=False)
    x = x @ vt.T
    flip = np.sign(x[np.argmax(np.abs(x), axis=0), np.arange(x.shape[1])])
    return x * np.where(flip == 0, 1, flip)


def head_map(attentions: ArrayLike, *, attention_mask: ArrayLike | None = None,
             convention: str = "mha", seed: int | None = 0) -> tuple[np.ndarray, np.ndarray]:
    """Place every head in the plane by the Jensen-Shannon distance between their attention.

    This is Clark et al.'s (2019) map of BERT's heads (Section 6, Figure 6): the distance
    between two heads from :func:`head_distance` over all L*H heads, mapped to the plane by
    multidimensional scaling.

    Parameters
    ----------
    attentions : array_like, shape (L, H, n, n) or (B, L, H, n, n)
        One text, or a padded batch of texts.
    attention_mask : array_like of bool, shape (n,) or (B, n), optional
        True = real token: each text is cut to its real tokens first (default: all real).
    convention : {"mha", "clark"}
        ``"mha"``: the distance is the square root of the mean (over texts) of the mean
        Jensen-Shannon divergence in bits (a metric in [0, 1]), mapped by
        :func:`classical_mds`. ``"clark"``: Clark et al.'s: the divergence in nats of the
        smoothed weights summed over every token of every text, mapped by
        :func:`metric_mds` with their options (see Notes).
    seed : int or None
        The random starts of :func:`metric_mds` (``"clark"`` only).

    Returns
    -------
    points : ndarray, shape (L, H, 2)
        The 2-D coordinates of each head.
    distances : ndarray, shape (L*H, L*H)
        The distances between the heads that the points approximate.

    Raises
    ------
    ValueError
        Fewer than 4 axes, a mask of the wrong shape, or an unknown ``convention``.

    See Also
    --------
    mha.viz.head_map : The figure.

    Notes
    -----
    Clark et al.'s code sums ``head_distance(..., convention="clark")`` over its 1,000
    texts and passes the sums, without a square root, to scikit-learn's metric MDS
    (SMACOF, five random starts). ``convention="clark"`` computes the same distances (equal
    to rounding) and runs the same algorithm with the same options in NumPy; the points agree
    with theirs up to rotation, reflection and the local minimum that random starts reach
    (their starts were not seeded). mha's default maps a length-independent metric with
    classical MDS, which is exact for Euclidean distances and needs no starts.

    Examples
    --------
    >>> rng = np.random.default_rng(0)
    >>> w = rng.random((2, 3, 5, 5)); w /= w.sum(-1, keepdims=True)
    >>> points, d = head_map(w)
    >>> points.shape, d.shape
    ((2, 3, 2), (6, 6))
    """
    clark = _check_convention(convention) == "clark"
    w = _as_weights(attentions, 4)
    if w.ndim == 4:
        w = w[None]
    B, L, H, n_q, n_k = w.shape
    if attention_mask is None:
        per_text = head_distance(w.reshape(B, L * H, n_q, n_k), convention=convention)
    else:
        mask = np.asarray(attention_mask)
        real = _batch_mask(mask.reshape(B, -1) if mask.ndim == 1 else mask, (B, n_k),
                           "attention_mask")
        texts = []
        for b in range(B):
            idx = np.flatnonzero(real[b])
            if len(idx):
                square = _real_square(w[b], idx).reshape(L * H, len(idx), len(idx))
                texts.append(head_distance(square, convention=convention))
        if not texts:
            raise ValueError("attention_mask marks no real token")
        per_text = np.stack(texts)
    if clark:
        distances = per_text.sum(axis=0)
        points = metric_mds(distances, seed=seed)
    else:
        distances = np.sqrt(per_text.mean(axis=0))
        points = classical_mds(distances)
    return points.reshape(L, H, 2), distances
