"""Sparse autoencoders (SAEs) and transcoders in SAELens's format, spliced into mha's models.

``mha.sae.load(folder)`` reads the folder SAELens 6.x writes (``cfg.json`` with
``metadata.hook_name``, ``sae_weights.safetensors``) for the architectures "standard" (ReLU),
"topk" (with ``rescale_acts_by_decoder_norm``), "jumprelu" (with and without
``apply_b_dec_to_input``), "gated", and the transcoders "transcoder" and
"jumprelu_transcoder" (``metadata.hook_name_out``, ``d_out``). An :class:`SAE` computes as
SAELens's inference classes do (``sae_lens/saes/*.py``), its products on mha's C GEMM with the
weights packed once per dtype, in float32 or float64 (the input's).

``model.run_with_saes(ids, saes=[...])`` and ``model.run_with_cache_with_saes(...)`` (every
family, through :class:`mha.models.hooked.Hooked`) splice each SAE's reconstruction in at its
hook point with the forward's own hooks, as TransformerLens 3's ``HookedSAETransformer``
does; the cache holds SAELens's names (``{hook}.hook_sae_acts_post``, ...). With
``backward=True`` the Encoding's tape carries the splices, and ``enc.backward(wrt=...)``
takes the SAEs' names: the gradient reaching a feature is one backward away. SAELens's
gradient semantics are kept: the error term (``use_error_term=True``) is a constant, so the
gradient below a spliced SAE flows through the SAE alone; a transcoder's output replaces what
the model computed there, which then gets no gradient.

The tools here are random SAEs (:func:`random`, since no SAE ships with mha) and
:meth:`SAE.save`, which writes SAELens's format.
"""
from __future__ import annotations

import json
import os
import struct
import threading
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
from numpy.typing import ArrayLike, DTypeLike

from mha import _core

__all__ = ["SAE", "load", "random", "ARCHITECTURES", "SAE_HOOKS"]

#: the architectures :func:`load` reads (SAELens's ``architecture`` names)
ARCHITECTURES = ("standard", "topk", "jumprelu", "gated", "transcoder", "jumprelu_transcoder")
#: SAELens's hook points inside a spliced SAE, in the order its forward visits them; the
#: cache names them ``{hook_name}.{point}`` (a transcoder's: ``{hook_name_out}.{point}``)
SAE_HOOKS = ("hook_sae_input", "hook_sae_acts_pre", "hook_sae_acts_post", "hook_sae_recons",
             "hook_sae_error", "hook_sae_output")
#: SAELens's ``normalize_activations`` options this module computes: "none" and
#: "expected_average_only_in" leave the input as it is (SAELens's inference SAE does too: the
#: scaling factor is folded into the weights when it is known), "constant_norm_rescale" and
#: "layer_norm" are computed per row as SAELens does (forward only: no gradients through them)
NORMALIZATIONS = ("none", "expected_average_only_in", "constant_norm_rescale", "layer_norm")
_RELU = 5                           # the C core's activation code for ReLU (csrc/mha.h)
_LAYER_NORM_EPS = 1e-5              # SAELens's run_time_activation_ln_in


# --- the SAE -------------------------------------------------------------------------------------

class SAE:
    """A sparse autoencoder (or transcoder) as SAELens defines it, on mha's C GEMM.

    Build one with :func:`load` (a folder SAELens wrote) or :func:`random`. Every product runs
    on mha's GEMM in the input's dtype (float32 or float64; other floats become float32), with
    the weights packed once per dtype.

    Parameters
    ----------
    cfg : dict
        SAELens's configuration (``cfg.json``): ``architecture``, ``d_in``, ``d_sae``
        (``d_out`` for a transcoder), ``apply_b_dec_to_input``, ``normalize_activations``,
        ``reshape_activations``, ``k`` and ``rescale_acts_by_decoder_norm`` (topk), and
        ``metadata.hook_name`` (``metadata.hook_name_out`` for a transcoder).
    weights : dict of str to array_like
        ``W_enc`` (d_in, d_sae), ``W_dec`` (d_sae, d_out), ``b_dec`` (d_out,), and by
        architecture ``b_enc`` (d_sae,), ``threshold`` (d_sae,) or ``log_threshold``, and for
        "gated" ``b_gate``, ``b_mag``, ``r_mag`` (d_sae,).

    Attributes
    ----------
    architecture : str
        One of :data:`ARCHITECTURES`.
    hook_name : str
        The hook point the SAE reads (a TransformerLens name: ``blocks.0.attn.hook_z``).
    hook_name_out : str
        Where its reconstruction goes: ``hook_name``, or a transcoder's output point.
    d_in, d_sae, d_out : int
        Input width (``H * d_head`` for a ``hook_z`` SAE), features, output width.
    cfg : dict
        The configuration it was built from.
    W_enc, W_dec, b_dec, ... : ndarray
        The weights, read-only, in the file's dtype (bfloat16 widened to float32).

    Raises
    ------
    ValueError
        An unknown architecture or normalisation, or weights of the wrong shapes (the message
        names the weight and both shapes).

    Examples
    --------
    >>> sae = mha.sae.random("blocks.0.attn.hook_z", d_in=64, d_sae=256, seed=0,
    ...                      reshape_activations="hook_z")
    >>> z = np.random.default_rng(0).standard_normal((1, 5, 4, 16)).astype(np.float32)
    >>> acts = sae.encode(z)                        # z as the cache holds it: (B, n, H, d_head)
    >>> acts.shape, sae.decode(acts).shape, sae.forward(z).shape
    ((1, 5, 256), (1, 5, 64), (1, 5, 4, 16))
    """

    def __init__(self, cfg: Mapping[str, Any], weights: Mapping[str, ArrayLike]) -> None:
        cfg = dict(cfg)
        self.cfg = cfg
        arch = cfg.get("architecture", "standard")
        if arch not in ARCHITECTURES:
            raise ValueError(f"architecture {arch!r} is not supported; expected one of "
                             f"{list(ARCHITECTURES)}")
        self.architecture: str = arch
        metadata = cfg.get("metadata") or {}
        hook = metadata.get("hook_name") or cfg.get("hook_name") or cfg.get("hook_point")
        if not isinstance(hook, str) or not hook:
            raise ValueError("the SAE's cfg names no hook point (metadata.hook_name)")
        self.hook_name: str = hook
        self.transcoder = arch.endswith("transcoder")
        out = metadata.get("hook_name_out") or cfg.get("hook_name_out")
        if self.transcoder and not out:
            raise ValueError(f"a {arch} needs metadata.hook_name_out (where its output goes)")
        self.hook_name_out: str = out or hook
        self.d_in = int(cfg["d_in"])
        self.d_sae = int(cfg["d_sae"])
        self.d_out = int(cfg.get("d_out", self.d_in)) if self.transcoder else self.d_in
        self.apply_b_dec_to_input = bool(cfg.get("apply_b_dec_to_input", not self.transcoder))
        if self.transcoder and self.apply_b_dec_to_input:
            raise ValueError("apply_b_dec_to_input is not supported for transcoders (as in "
                             "SAELens: b_dec has the output's width)")
        self.normalize = cfg.get("normalize_activations", "none") or "none"
        if self.normalize not in NORMALIZATIONS:
            raise ValueError(f"normalize_activations {self.normalize!r} is not supported; "
                             f"expected one of {list(NORMALIZATIONS)} (fold a whitening into "
                             f"the weights first, as SAELens's fold_activation_whitening does)")
        self.reshape = cfg.get("reshape_activations", "none") or "none"
        if self.reshape not in ("none", "hook_z"):
            raise ValueError(f"reshape_activations {self.reshape!r}: expected 'none' or 'hook_z'")
        self.k = int(cfg.get("k", 100)) if arch == "topk" else 0
        if arch == "topk" and not 0 < self.k <= self.d_sae:
            raise ValueError(f"topk SAE: k={self.k} must lie in [1, d_sae={self.d_sae}]")
        self.rescale = arch == "topk" and bool(cfg.get("rescale_acts_by_decoder_norm", False))

        w = dict(weights)
        if "log_threshold" in w and "threshold" not in w:         # older JumpReLU checkpoints
            w["threshold"] = np.exp(np.asarray(w.pop("log_threshold"), dtype=np.float64))
        shapes = {"W_enc": (self.d_in, self.d_sae), "W_dec": (self.d_sae, self.d_out),
                  "b_dec": (self.d_out,)}
        if arch == "gated":
            shapes.update(b_gate=(self.d_sae,), b_mag=(self.d_sae,), r_mag=(self.d_sae,))
        else:
            shapes["b_enc"] = (self.d_sae,)
        if arch.startswith("jumprelu"):
            shapes["threshold"] = (self.d_sae,)
        self._weights: dict[str, np.ndarray] = {}
        for name, shape in shapes.items():
            if name not in w:
                raise ValueError(f"the {arch} SAE needs the weight {name!r} {shape}; the "
                                 f"file has {sorted(w)}")
            a = np.array(w[name], copy=True)
            if a.dtype.kind != "f":
                raise ValueError(f"weight {name!r} has dtype {a.dtype}; expected floats")
            if a.dtype not in (np.float32, np.float64):
                a = a.astype(np.float32)
            if a.shape != shape:
                raise ValueError(f"weight {name!r} has shape {a.shape} but d_in={self.d_in}, "
                                 f"d_sae={self.d_sae} imply {shape}")
            a.flags.writeable = False
            self._weights[name] = a
        self._packed: dict[tuple[str, np.dtype], Any] = {}
        self._lock = threading.RLock()

    def __getattr__(self, name: str) -> np.ndarray:
        weights = self.__dict__.get("_weights", {})
        if name in weights:
            return weights[name]
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    @property
    def dtype(self) -> np.dtype:
        """The dtype of the weights as stored."""
        return self._weights["W_enc"].dtype

    def weights(self) -> dict[str, np.ndarray]:
        """Return the weights by SAELens's names (read-only arrays).

        Returns
        -------
        dict of str to ndarray
            ``W_enc``, ``W_dec``, ``b_dec`` and the architecture's others.
        """
        return dict(self._weights)

    def __repr__(self) -> str:
        out = f" -> {self.hook_name_out} (d_out={self.d_out})" if self.transcoder else ""
        return (f"SAE({self.architecture!r}, {self.hook_name}{out}, d_in={self.d_in}, "
                f"d_sae={self.d_sae})")

    # --- packed weights, per dtype ---------------------------------------------------------------
    def _get(self, what: str, dtype: np.dtype) -> Any:
        """A weight product's operand in dtype, made once: "enc" the packed encoder ([W_enc |
        W_mag] for gated), "dec" the packed decoder (divided by its row norms for a rescaled
        topk), "enc_t"/"dec_t" their transposes for the backward, "b_enc"/"b_dec"/... the
        vectors in dtype."""
        key = (what, dtype)
        got = self._packed.get(key)
        if got is not None:
            return got
        with self._lock:
            got = self._packed.get(key)
            if got is None:
                got = self._make(what, dtype)
                self._packed[key] = got
        return got

    def _make(self, what: str, dtype: np.dtype) -> Any:
        w = self._weights
        if what in ("enc", "enc_t", "enc_bias"):
            if self.architecture == "gated":
                w_mag = w["W_enc"].astype(np.float64) * np.exp(w["r_mag"].astype(np.float64))
                enc = np.concatenate([w["W_enc"].astype(np.float64), w_mag], axis=1)
                bias = np.concatenate([w["b_gate"], w["b_mag"]])
            else:
                enc, bias = w["W_enc"], w["b_enc"]
            if what == "enc_bias":
                return np.ascontiguousarray(bias, dtype=dtype)
            enc = np.ascontiguousarray(enc, dtype=dtype)
            if what == "enc_t":             # the backward's d_in = d_pre @ W^T (gated: W_mag)
                if self.architecture == "gated":
                    enc = np.ascontiguousarray(enc[:, self.d_sae:])
                return _core.pack_weight(enc, trans_b=True)
            return _core.pack_weight(enc)
        if what in ("dec", "dec_t"):
            dec = w["W_dec"].astype(np.float64 if self.rescale else w["W_dec"].dtype)
            if self.rescale:                # act_times_W_dec: (acts / ||W_dec row||) @ W_dec
                dec = dec / self._get("dec_norm", np.dtype(np.float64))[:, None]
            dec = np.ascontiguousarray(dec, dtype=dtype)
            return _core.pack_weight(dec, trans_b=what == "dec_t")
        if what == "dec_norm":
            return np.linalg.norm(w["W_dec"].astype(np.float64), axis=1).astype(dtype)
        return np.ascontiguousarray(w[what], dtype=dtype)

    # --- the stages of SAELens's encode and decode, on rows ------------------------------------
    def _input(self, x: ArrayLike, what: str = "x") -> tuple[np.ndarray, tuple[int, ...]]:
        """x as (rows, d_in) C-contiguous float32/float64, and the leading shape."""
        a = np.asarray(x)
        if a.dtype.kind != "f":
            raise TypeError(f"{what} must hold floats, got dtype {a.dtype}")
        dtype = a.dtype if a.dtype in (np.float32, np.float64) else np.dtype(np.float32)
        if self.reshape == "hook_z" and not self.transcoder:
            if a.ndim < 2 or a.shape[-2] * a.shape[-1] != self.d_in:
                raise ValueError(f"{what} has shape {a.shape}; this hook_z SAE takes (..., "
                                 f"n_heads, d_head) with n_heads * d_head = d_in = {self.d_in}")
            lead = a.shape[:-2]
        else:
            if a.ndim < 1 or a.shape[-1] != self.d_in:
                raise ValueError(f"{what} has shape {a.shape}; this SAE takes (..., d_in) with "
                                 f"d_in = {self.d_in} (at {self.hook_name})")
            lead = a.shape[:-1]
        return np.ascontiguousarray(a.reshape(-1, self.d_in), dtype=dtype), lead

    def _normalize_in(self, x: np.ndarray) -> tuple[np.ndarray, Any]:
        """SAELens's run_time_activation_norm_fn_in on rows -> (x', what undoes it)."""
        if self.normalize == "constant_norm_rescale":
            coeff = np.sqrt(self.d_in) / np.linalg.norm(x, axis=-1, keepdims=True)
            return x * coeff.astype(x.dtype), coeff
        if self.normalize == "layer_norm":
            mu = x.mean(axis=-1, keepdims=True)
            centred = x - mu
            std = centred.std(axis=-1, ddof=1, keepdims=True)
            return centred / (std + x.dtype.type(_LAYER_NORM_EPS)), (mu, std)
        return x, None

    def _normalize_out(self, r: np.ndarray, state: Any) -> np.ndarray:
        """SAELens's run_time_activation_norm_fn_out (none for a transcoder)."""
        if state is None or self.transcoder:
            return r
        if self.normalize == "constant_norm_rescale":
            return r / state.astype(r.dtype)
        mu, std = state
        return r * std + mu

    def _centre(self, x: np.ndarray) -> np.ndarray:
        """process_sae_in's last step: x - b_dec when apply_b_dec_to_input."""
        return x - self._get("b_dec", x.dtype) if self.apply_b_dec_to_input else x

    def _pre(self, centred: np.ndarray, fused_relu: bool = False
             ) -> tuple[np.ndarray, np.ndarray | None]:
        """The pre-activation (hook_sae_acts_pre; gated: the magnitude path's) and the gated
        SAE's gate pre-activation (else None). fused_relu: the standard SAE's ReLU in the
        product (then the first array is already the activation)."""
        dt = centred.dtype
        both = _core.linear(centred, self._get("enc", dt), bias=self._get("enc_bias", dt),
                            act=_RELU if fused_relu else 0,
                            columns=self.d_sae * (2 if self.architecture == "gated" else 1))
        if self.architecture == "gated":
            return both[:, self.d_sae:], both[:, :self.d_sae]
        return both, None

    def _activate(self, pre: np.ndarray, gate: np.ndarray | None
                  ) -> tuple[np.ndarray, np.ndarray]:
        """(acts_post, the activation's derivative as a 0/1 mask) from the pre-activation."""
        arch = self.architecture
        if arch == "topk":
            h = pre * self._get("dec_norm", pre.dtype) if self.rescale else pre
            idx = np.argpartition(-h, self.k - 1, axis=-1)[:, :self.k]
            vals = np.take_along_axis(h, idx, axis=-1)
            keep = vals > 0
            post = np.zeros_like(h)
            np.put_along_axis(post, idx, np.where(keep, vals, 0), axis=-1)
            mask = np.zeros(h.shape, dtype=bool)
            np.put_along_axis(mask, idx, keep, axis=-1)
            return post, mask
        mask = pre > 0
        if arch.startswith("jumprelu"):
            mask &= pre > self._get("threshold", pre.dtype)
        elif arch == "gated":
            assert gate is not None
            mask &= gate > 0
        return np.where(mask, pre, pre.dtype.type(0)), mask

    def _decode_rows(self, post: np.ndarray) -> np.ndarray:
        """acts (rows, d_sae) @ W_dec + b_dec -> (rows, d_out): hook_sae_recons."""
        dt = post.dtype
        return _core.linear(np.ascontiguousarray(post), self._get("dec", dt),
                            bias=self._get("b_dec", dt), columns=self.d_out)

    # --- the public surface --------------------------------------------------------------------
    def encode(self, x: ArrayLike) -> np.ndarray:
        """Encode activations into feature activations (SAELens's ``encode``).

        Parameters
        ----------
        x : array_like of float, shape (..., d_in)
            The activation as mha's cache holds it: (..., n_heads, d_head) for a ``hook_z``
            SAE (flattened to n_heads * d_head, as SAELens does).

        Returns
        -------
        ndarray, shape (..., d_sae)
            ``hook_sae_acts_post``, in x's dtype (float32 or float64).

        Raises
        ------
        ValueError
            x's last axis (axes, for ``hook_z``) is not d_in wide.
        TypeError
            x does not hold floats.

        Examples
        --------
        >>> sae = mha.sae.random("blocks.0.hook_resid_pre", d_in=8, d_sae=32, seed=1)
        >>> sae.encode(np.ones((2, 3, 8))).shape
        (2, 3, 32)
        """
        flat, lead = self._input(x)
        centred = self._centre(self._normalize_in(flat)[0])
        if self.architecture in ("standard", "transcoder"):
            post = self._pre(centred, fused_relu=True)[0]
        else:
            post = self._activate(*self._pre(centred))[0]
        return post.reshape(*lead, self.d_sae)

    def decode(self, feature_acts: ArrayLike) -> np.ndarray:
        """Decode feature activations: ``acts @ W_dec + b_dec``.

        Parameters
        ----------
        feature_acts : array_like of float, shape (..., d_sae)
            Feature activations (``encode``'s result, or edited ones).

        Returns
        -------
        ndarray, shape (..., d_out)
            The reconstruction, flat (``hook_sae_recons``; d_out = d_in but for a
            transcoder). :meth:`forward` gives it the input's shape (a ``hook_z`` SAE's
            (..., n_heads, d_head)). For an SAE with ``normalize_activations``
            "constant_norm_rescale" or "layer_norm" this is in the normalised space (SAELens
            undoes the normalisation with the statistics of the last input it encoded; use
            :meth:`forward`).

        Raises
        ------
        ValueError
            The last axis is not d_sae wide.

        Examples
        --------
        >>> sae = mha.sae.random("blocks.0.hook_resid_pre", d_in=8, d_sae=32, seed=1)
        >>> f = np.zeros((1, 32)); f[0, 3] = 2.0
        >>> np.allclose(sae.decode(f), 2.0 * sae.W_dec[3] + sae.b_dec)
        True
        """
        f = np.asarray(feature_acts)
        if f.dtype.kind != "f":
            raise TypeError(f"feature_acts must hold floats, got dtype {f.dtype}")
        if f.ndim < 1 or f.shape[-1] != self.d_sae:
            raise ValueError(f"feature_acts has shape {f.shape}; expected (..., d_sae) with "
                             f"d_sae = {self.d_sae}")
        dtype = f.dtype if f.dtype in (np.float32, np.float64) else np.dtype(np.float32)
        rows = np.ascontiguousarray(f.reshape(-1, self.d_sae), dtype=dtype)
        return self._decode_rows(rows).reshape(*f.shape[:-1], self.d_out)

    def forward(self, x: ArrayLike) -> np.ndarray:
        """Reconstruct x: ``decode(encode(x))`` in x's shape.

        SAELens's ``forward`` without the error term; a normalising SAE's reconstruction is
        taken back to x's scale with x's own statistics.

        Parameters
        ----------
        x : array_like of float, shape (..., d_in)
            As for :meth:`encode`.

        Returns
        -------
        ndarray
            The reconstruction, of x's shape (a transcoder's: (..., d_out)) and dtype.

        Raises
        ------
        ValueError, TypeError
            As for :meth:`encode`.

        Examples
        --------
        >>> sae = mha.sae.random("blocks.0.hook_resid_pre", d_in=8, d_sae=32, seed=1)
        >>> x = np.ones((3, 8), dtype=np.float32)
        >>> sae.forward(x).shape, sae.forward(x).dtype
        ((3, 8), dtype('float32'))
        """
        shape = np.shape(x)
        parts = self._parts(x)
        out = parts["out"]
        if self.transcoder:
            return out.reshape(*parts["lead"], self.d_out)
        return out.reshape(shape)

    __call__ = forward

    def _parts(self, x: ArrayLike, hook: Callable[[str, np.ndarray], np.ndarray] | None = None
               ) -> dict[str, Any]:
        """Every stage of encode and decode on x, by SAELens's names (rows), with ``hook(point,
        rows)`` run at each point (it returns what goes on); "out" is the reconstruction after
        the normalisation is undone, "mask" the activation's derivative (None without hook:
        then a ReLU SAE's activation is fused into its product)."""
        flat, lead = self._input(x)
        if hook is not None:
            flat = hook("hook_sae_input", flat)
        normed, state = self._normalize_in(flat)
        fused = hook is None and self.architecture in ("standard", "transcoder")
        pre, gate = self._pre(self._centre(normed), fused_relu=fused)
        if hook is not None:
            pre = hook("hook_sae_acts_pre", pre)
        post, mask = (pre, None) if fused else self._activate(pre, gate)
        if hook is not None:
            post = hook("hook_sae_acts_post", post)
        recons = self._decode_rows(post)
        if hook is not None:
            recons = hook("hook_sae_recons", recons)
        return {"input": flat, "lead": lead, "pre": pre, "post": post, "mask": mask,
                "recons": recons, "out": self._normalize_out(recons, state)}

    # --- saving --------------------------------------------------------------------------------
    def save(self, folder: str | os.PathLike[str]) -> Path:
        """Write the SAE in SAELens's format: ``cfg.json`` and ``sae_weights.safetensors``.

        Parameters
        ----------
        folder : str or path
            Created if missing; the two files are overwritten.

        Returns
        -------
        Path
            The folder (``mha.sae.load`` and SAELens's ``SAE.load_from_disk`` read it).

        Examples
        --------
        >>> import tempfile
        >>> sae = mha.sae.random("blocks.1.hook_resid_pre", d_in=8, d_sae=16, seed=2)
        >>> folder = sae.save(tempfile.mkdtemp())
        >>> again = mha.sae.load(folder)
        >>> np.array_equal(again.W_enc, sae.W_enc), again.hook_name
        (True, 'blocks.1.hook_resid_pre')
        """
        path = Path(folder)
        path.mkdir(parents=True, exist_ok=True)
        _write_safetensors(path / "sae_weights.safetensors", self._weights)
        (path / "cfg.json").write_text(json.dumps(self.cfg, indent=1), encoding="utf-8")
        return path


def _write_safetensors(path: Path, arrays: Mapping[str, np.ndarray]) -> None:
    """The safetensors format: an 8-byte little-endian header size, the JSON header (dtype,
    shape, byte range per tensor), then the bytes."""
    codes = {np.dtype(np.float32): "F32", np.dtype(np.float64): "F64"}
    header: dict[str, Any] = {}
    offset = 0
    blobs = []
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        data = a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes()
        header[name] = {"dtype": codes[a.dtype], "shape": list(a.shape),
                        "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(text)))
        fh.write(text)
        for blob in blobs:
            fh.write(blob)


# --- loading and making ------------------------------------------------------------------------

def load(folder: str | os.PathLike[str], *, dtype: DTypeLike | None = None) -> SAE:
    """Load an SAE or transcoder from the folder SAELens writes.

    The folder holds ``cfg.json`` (SAELens 6.x: the hook point in ``metadata.hook_name``; a
    pre-6 ``hook_name``/``hook_point`` at the top level is read too) and
    ``sae_weights.safetensors`` (SAELens's ``SAE.save_model``; what ``SAE.from_pretrained``
    downloads). No torch or SAELens is needed.

    Parameters
    ----------
    folder : str or path
        The SAE's folder.
    dtype : {None, float32, float64}, optional
        Convert the weights once (None: as stored; bfloat16 and float16 become float32).
        The products run in the input's dtype either way.

    Returns
    -------
    SAE
        With ``encode``, ``decode``, ``forward``, ``hook_name``, ``d_in``, ``d_sae``.

    Raises
    ------
    FileNotFoundError
        No cfg.json or sae_weights.safetensors in the folder.
    ValueError
        An architecture or ``normalize_activations`` that is not supported (the message
        lists those that are), or weights whose shapes disagree with cfg.json.

    Examples
    --------
    >>> import tempfile
    >>> folder = mha.sae.random("blocks.0.attn.hook_z", d_in=64, d_sae=128, seed=0,
    ...                         architecture="jumprelu").save(tempfile.mkdtemp())
    >>> sae = mha.sae.load(folder)
    >>> sae.architecture, sae.hook_name, sae.d_in, sae.d_sae
    ('jumprelu', 'blocks.0.attn.hook_z', 64, 128)
    """
    from mha.models.hub import Checkpoint
    path = Path(folder)
    cfg_path, weights_path = path / "cfg.json", path / "sae_weights.safetensors"
    for needed in (cfg_path, weights_path):
        if not needed.is_file():
            raise FileNotFoundError(f"{path} has no {needed.name}: not an SAE folder as SAELens "
                                    f"writes it (cfg.json + sae_weights.safetensors)")
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    if "architecture" not in cfg:       # SAELens < 6 wrote no architecture: a standard SAE
        cfg["architecture"] = "topk" if cfg.get("activation_fn") == "topk" else "standard"
    checkpoint = Checkpoint([weights_path])
    weights = {}
    for name in checkpoint:
        a = np.asarray(checkpoint[name])
        weights[name] = a if dtype is None else a.astype(dtype)
    return SAE(cfg, weights)


def random(hook_name: str, d_in: int, d_sae: int, *, architecture: str = "standard",
           seed: int | None = None, dtype: DTypeLike = np.float32, hook_name_out: str | None = None,
           d_out: int | None = None, **cfg: Any) -> SAE:
    """An SAE with random weights (mha ships none; for tests, tutorials and timing).

    Weights are drawn as SAELens initialises them (uniform, decoder rows of norm about 1,
    ``W_enc = W_dec^T``) plus small random biases, and thresholds of 0.1 (JumpReLU).

    Parameters
    ----------
    hook_name : str
        The hook point it reads, e.g. ``"blocks.0.attn.hook_z"``.
    d_in, d_sae : int
        Input width and number of features.
    architecture : str, default "standard"
        One of :data:`ARCHITECTURES`.
    seed : int, optional
        Seed of the weights.
    dtype : float32 or float64
        The weights' dtype.
    hook_name_out, d_out : optional
        A transcoder's output point and width (d_out defaults to d_in).
    **cfg
        Further SAELens configuration: ``k`` (topk, default 100 or d_sae),
        ``rescale_acts_by_decoder_norm``, ``apply_b_dec_to_input``,
        ``normalize_activations``, ``reshape_activations`` ("hook_z" for an SAE on
        ``hook_z``).

    Returns
    -------
    SAE
        Its ``cfg`` as SAELens would write it (:meth:`SAE.save`).

    Raises
    ------
    ValueError
        As for :class:`SAE`.

    Examples
    --------
    >>> sae = mha.sae.random("blocks.0.hook_resid_pre", d_in=16, d_sae=64, architecture="topk",
    ...                      k=8, seed=0)
    >>> (sae.encode(np.ones((4, 16))) > 0).sum(axis=-1)      # at most k features per row
    array([8, 8, 8, 8])
    """
    rng = np.random.default_rng(seed)
    transcoder = architecture.endswith("transcoder")
    width = (d_out or d_in) if transcoder else d_in
    bound = np.sqrt(6.0 / d_sae) / np.sqrt(2.0)          # kaiming_uniform_'s a=sqrt(5) bound
    w_dec = rng.uniform(-bound, bound, (d_sae, width))
    w_dec /= np.linalg.norm(w_dec, axis=1, keepdims=True)
    w_enc = w_dec.T.copy() if not transcoder else rng.uniform(-1, 1, (d_in, d_sae)) / np.sqrt(d_in)
    weights: dict[str, Any] = {"W_enc": w_enc, "W_dec": w_dec,
                               "b_dec": 0.1 * rng.standard_normal(width)}
    if architecture == "gated":
        weights.update(b_gate=0.1 * rng.standard_normal(d_sae),
                       b_mag=0.1 * rng.standard_normal(d_sae),
                       r_mag=0.1 * rng.standard_normal(d_sae))
    else:
        weights["b_enc"] = 0.1 * rng.standard_normal(d_sae)
    if architecture.startswith("jumprelu"):
        weights["threshold"] = np.full(d_sae, 0.1)
    config: dict[str, Any] = {"architecture": architecture, "d_in": d_in, "d_sae": d_sae,
                              "dtype": np.dtype(dtype).name,
                              "apply_b_dec_to_input": not transcoder,
                              "normalize_activations": "none", "reshape_activations": "none",
                              "metadata": {"hook_name": hook_name}}
    if transcoder:
        config["d_out"] = width
        config["metadata"]["hook_name_out"] = hook_name_out
    if architecture == "topk":
        config["k"] = min(100, d_sae)
        config["rescale_acts_by_decoder_norm"] = False
    config.update(cfg)
    return SAE(config, {k: np.asarray(v, dtype=dtype) for k, v in weights.items()})


# --- splicing into a model ---------------------------------------------------------------------

class _Splice:
    """One SAE spliced into one forward: the forward hooks at its points (the transcoder's
    input point, and the point its output replaces), what it keeps for the cache and for the
    backward, and the backward's hooks."""

    def __init__(self, sae: SAE, use_error_term: bool, user_hooks: Mapping[str, list[Any]],
                 keep: Callable[[str], bool], record: bool) -> None:
        self.sae = sae
        self.use_error_term = use_error_term
        self.point = sae.hook_name_out
        self.names = [f"{self.point}.{h}" for h in SAE_HOOKS
                      if use_error_term or h != "hook_sae_error"]
        self.user = {n: user_hooks[n] for n in self.names if n in user_hooks}
        self.kept = {n for n in self.names if keep(n)}
        self.record = record
        self.cache: dict[str, np.ndarray] = {}
        self.changed: dict[str, np.ndarray] = {}     # rows: where a user hook changed a stage
        self.state: dict[str, Any] = {}
        self._captured: np.ndarray | None = None

    # forward ------------------------------------------------------------------------------------
    def capture(self, x: np.ndarray, name: str) -> None:
        """The transcoder's input point: keep what it reads."""
        self._captured = np.array(x)

    def _stage(self, B: int, n: int) -> Callable[[str, np.ndarray], np.ndarray]:
        from mha.models.hooks import run_hook_fns

        def hook(point: str, rows: np.ndarray) -> np.ndarray:
            name = f"{self.point}.{point}"
            fns = self.user.get(name)
            if fns:
                view = rows.reshape(B, n, -1).copy()
                before = view.copy() if self.record else None
                run_hook_fns(fns, view, name)
                if before is not None:
                    changed = (view != before) & ~(np.isnan(view) & np.isnan(before))
                    if changed.any():
                        self.changed[point] = changed.reshape(rows.shape)
                rows = view.reshape(rows.shape)
            if name in self.kept:
                self.cache[name] = rows.reshape(B, n, -1).copy()
            return rows
        return hook

    def _point_hook(self, name: str, value: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        """hook_sae_error and hook_sae_output (the activation's shape)."""
        from mha.models.hooks import run_hook_fns
        full = f"{self.point}.{name}"
        fns = self.user.get(full)
        if fns:
            value = np.array(value)
            before = value.copy() if self.record else None
            run_hook_fns(fns, value, full)
            if before is not None:
                changed = (value != before) & ~(np.isnan(value) & np.isnan(before))
                if changed.any():
                    self.changed[name] = changed
        if full in self.kept:
            self.cache[full] = value.reshape(shape).copy()
        return value

    def replace(self, x: np.ndarray, name: str) -> np.ndarray:
        """The output point: the SAE's reconstruction (plus the error term) in place of x."""
        sae = self.sae
        if x.ndim < 3:
            raise ValueError(f"{name} has shape {x.shape}: an SAE splices into a (batch, pos, "
                             f"...) activation")
        B, n = x.shape[:2]
        if sae.transcoder:
            source = self._captured
            if source is None:
                raise RuntimeError(f"the transcoder's input {sae.hook_name} was not reached "
                                   f"before its output {name}: it must come first in the "
                                   f"forward")
            self._captured = None
            if x.shape[2:] != (sae.d_out,):
                raise ValueError(f"the transcoder writes d_out = {sae.d_out} values per position "
                                 f"but {name} holds {x.shape[2:]}")
        else:
            source = x
            if sae.reshape == "hook_z":
                if x.ndim != 4 or x.shape[2] * x.shape[3] != sae.d_in:
                    raise ValueError(f"the hook_z SAE at {name} has d_in = {sae.d_in}, but the "
                                     f"model's {name} is {x.shape[2:]} per position "
                                     f"({int(np.prod(x.shape[2:]))} values)")
            elif int(np.prod(x.shape[2:])) != sae.d_in or x.ndim != 3:
                raise ValueError(f"the SAE at {name} has d_in = {sae.d_in}, but the model's "
                                 f"{name} is {x.shape[2:]} per position")
        hooked = bool(self.user)
        observed = hooked or self.record or bool(self.kept)
        parts = sae._parts(source.astype(x.dtype, copy=False),
                           self._stage(B, n) if observed else None)
        out = parts["out"].reshape(x.shape)
        if self.use_error_term:
            if hooked:                      # SAELens: the error of the SAE without the hooks
                clean = sae._parts(source.astype(x.dtype, copy=False))["out"].reshape(x.shape)
            else:
                clean = out
            error = self._point_hook("hook_sae_error", x - clean, x.shape)
            # unhooked, out + (x - out) is x itself: the forward goes on exactly as without it
            out = x.copy() if not hooked and "hook_sae_error" not in self.changed else out + error
        out = self._point_hook("hook_sae_output", out, x.shape)
        if self.record:
            self.state = {"mask": parts["mask"], "B": B, "n": n, "shape": x.shape,
                          "source_shape": source.shape, "dtype": x.dtype}
        return out.astype(x.dtype, copy=False)

    def fwd_hooks(self) -> list[tuple[str, Any]]:
        hooks: list[tuple[str, Any]] = []
        if self.sae.transcoder:
            hooks.append((self.sae.hook_name, self.capture))
        hooks.append((self.point, self.replace))
        return hooks

    # backward -----------------------------------------------------------------------------------
    def backward_hooks(self, wanted: set[str], bwd: Mapping[str, list[Any]],
                       out: dict[str, np.ndarray]) -> list[tuple[str, Any]]:
        """The model-point hooks that carry the gradient through the SAE: at the output point
        (the SAE's Jacobian, transposed), and for a transcoder at its input point (the
        gradient it adds there); the SAE names asked for go into ``out``."""
        sae, state = self.sae, self.state
        if not state:
            return []
        B, n = state["B"], state["n"]
        carry: dict[str, np.ndarray] = {}

        def at(point: str, g: np.ndarray) -> np.ndarray:
            from mha.models.hooks import run_hook_fns
            name = f"{self.point}.{point}"
            fns = bwd.get(name)
            if fns:
                view = g.reshape(B, n, *g.shape[2:]) if g.ndim >= 3 else g.reshape(B, n, -1)
                view = np.array(view)
                run_hook_fns(fns, view, name, "backward hook", "the gradient there has")
                g = view.reshape(g.shape)
            if name in wanted:
                out[name] = np.array(g.reshape(B, n, -1) if g.ndim == 2 else g)
            changed = self.changed.get(point)
            if changed is not None:
                g = np.where(changed.reshape(g.shape), g.dtype.type(0), g)
            return g

        def through(g: np.ndarray, name: str) -> np.ndarray | None:
            dt = g.dtype
            g = at("hook_sae_output", np.array(g))
            if self.use_error_term:
                at("hook_sae_error", g)     # a constant in SAELens: nothing flows on from it
            rows = np.ascontiguousarray(g.reshape(B * n, sae.d_out), dtype=dt)
            d_recons = at("hook_sae_recons", rows)
            d_post = _core.linear(np.ascontiguousarray(d_recons), sae._get("dec_t", dt),
                                  columns=sae.d_sae)
            d_post = at("hook_sae_acts_post", d_post)
            d_pre = np.where(state["mask"], d_post, dt.type(0))
            if sae.rescale:
                d_pre *= sae._get("dec_norm", dt)
            d_pre = at("hook_sae_acts_pre", d_pre)
            d_in = _core.linear(np.ascontiguousarray(d_pre), sae._get("enc_t", dt),
                                columns=sae.d_in)
            d_in = at("hook_sae_input", d_in)
            if sae.transcoder:
                carry["d_in"] = d_in.reshape(state["source_shape"])
                return None                 # the output point: zeroed by the tape (replaced)
            return d_in.reshape(state["shape"])

        hooks: list[tuple[str, Any]] = [(self.point, through)]
        if sae.transcoder:
            def add_input(g: np.ndarray, name: str) -> np.ndarray | None:
                d_in = carry.pop("d_in", None)
                return None if d_in is None else g + d_in.astype(g.dtype, copy=False)
            hooks.append((sae.hook_name, add_input))
        return hooks


class Splices:
    """The SAEs spliced into one forward with ``backward=True``, kept on its tape: the
    backward runs through them, and ``wrt=``/``bwd_hooks=`` take their names."""

    def __init__(self, splices: Sequence[_Splice]) -> None:
        self.splices = list(splices)
        self.names = {name for s in self.splices for name in s.names}

    def plan(self, wrt: Sequence[str], bwd_hooks: Sequence[tuple[Any, Any]]
             ) -> tuple[list[str], list[tuple[Any, Any]], Callable[[dict[str, Any]], None]]:
        """(the model's wrt, the model's backward hooks with the splices' first, and what adds
        the SAE names' gradients to the result)."""
        wrt = [wrt] if isinstance(wrt, str) else list(wrt)
        wanted = {name for name in wrt if name in self.names}
        for name in wrt:
            if name not in self.names and ".hook_sae_" in name:
                _unknown_sae_name(name, self.names)
        bwd: dict[str, list[Any]] = {}
        model_hooks = []
        for selector, fn in bwd_hooks:
            if isinstance(selector, str) and selector in self.names:
                bwd.setdefault(selector, []).append(fn)
            elif isinstance(selector, str) and ".hook_sae_" in selector:
                _unknown_sae_name(selector, self.names)
            else:
                if callable(selector):
                    for name in sorted(self.names):
                        if selector(name):
                            bwd.setdefault(name, []).append(fn)
                model_hooks.append((selector, fn))
        out: dict[str, np.ndarray] = {}
        ours = [hook for s in self.splices for hook in s.backward_hooks(wanted, bwd, out)]

        def finish(grads: dict[str, Any]) -> None:
            for name in wrt:
                if name in wanted:
                    grads[name] = out[name]
        return [n for n in wrt if n not in wanted], ours + model_hooks, finish


def _unknown_sae_name(name: str, names: set[str]) -> None:
    import difflib
    near = difflib.get_close_matches(name, sorted(names), n=3, cutoff=0.5)
    hint = f"; nearest: {', '.join(near)}" if near else ""
    extra = (" (hook_sae_error exists only with use_error_term=True)"
             if name.endswith("hook_sae_error") else "")
    raise KeyError(f"{name!r} is no hook point of the SAEs spliced into this forward{hint}"
                   f"{extra}")


def _check_saes(model: Any, saes: SAE | Sequence[SAE], valid: Sequence[str]) -> list[SAE]:
    if isinstance(saes, SAE):
        saes = [saes]
    saes = list(saes)
    outputs: dict[str, SAE] = {}
    from mha.models.hooks import unknown_name
    for sae in saes:
        if not isinstance(sae, SAE):
            raise TypeError(f"saes must be mha.sae.SAE objects (mha.sae.load(folder)), got "
                            f"{type(sae).__name__}")
        for point in {sae.hook_name, sae.hook_name_out}:
            if point not in model.hook_names():
                err = unknown_name(point, model.hook_names())
                raise KeyError(f"{sae!r}: {err.args[0]}")
            if point not in valid:
                raise KeyError(f"{sae!r}: {point!r} cannot take an SAE in this forward (a "
                               f"backward=True forward splices only where its backward passes: "
                               f"not inside the fused attention, nor at a norm's insides)")
        if sae.hook_name_out in outputs:
            raise ValueError(f"two SAEs write {sae.hook_name_out}: {outputs[sae.hook_name_out]!r} "
                             f"and {sae!r}")
        outputs[sae.hook_name_out] = sae
        if sae.transcoder:
            order = model.hook_names()
            if order.index(sae.hook_name) >= order.index(sae.hook_name_out):
                raise ValueError(f"{sae!r}: its input {sae.hook_name} comes after its output "
                                 f"{sae.hook_name_out} in the forward")
    return saes


def _split_hooks(fwd_hooks: Sequence[tuple[Any, Any]], sae_names: set[str]
                 ) -> tuple[list[tuple[Any, Any]], dict[str, list[Any]]]:
    """User hooks -> (those at the model's points, {SAE name: [fn]})."""
    model_hooks: list[tuple[Any, Any]] = []
    ours: dict[str, list[Any]] = {}
    for selector, fn in fwd_hooks:
        if isinstance(selector, str) and selector in sae_names:
            if not callable(fn):
                raise TypeError(f"the hook at {selector!r} is not callable: {fn!r}")
            ours.setdefault(selector, []).append(fn)
        elif isinstance(selector, str) and ".hook_sae_" in selector:
            _unknown_sae_name(selector, sae_names)
        else:
            if callable(selector) and not isinstance(selector, str):
                for name in sorted(sae_names):
                    if selector(name):
                        ours.setdefault(name, []).append(fn)
            model_hooks.append((selector, fn))
    return model_hooks, ours


def _sae_names(saes: Sequence[SAE], use_error_term: bool) -> set[str]:
    return {f"{s.hook_name_out}.{h}" for s in saes for h in SAE_HOOKS
            if use_error_term or h != "hook_sae_error"}


def _ids(model: Any, text_or_ids: Any) -> Any:
    """A text's ids for a backward=True forward (which takes ids)."""
    from mha.models.encoding import _is_texts
    if not _is_texts(text_or_ids):
        return text_or_ids
    if not isinstance(text_or_ids, str) or model.tokenizer is None:
        raise TypeError("backward=True takes token ids or one text; tokenize a batch of texts "
                        "and give its ids and attention_mask")
    return np.asarray(model.tokenizer(text_or_ids).ids)


def run(model: Any, text_or_ids: Any, saes: SAE | Sequence[SAE], use_error_term: bool, *,
        names: Any = False, fwd_hooks: Sequence[tuple[Any, Any]] = (), backward: bool = False,
        **kwargs: Any) -> Any:
    """The one forward behind ``run_with_saes`` (names=False: no cache) and
    ``run_with_cache_with_saes`` -> Encoding, or (Encoding, ActivationCache)."""
    from mha.models.hooks import ActivationCache, _resolve
    from mha.models.tape import _record_points
    valid = _record_points(model, ()) if backward else model.hook_names()
    saes = _check_saes(model, saes, valid)
    if backward:
        for sae in saes:
            if sae.normalize in ("constant_norm_rescale", "layer_norm"):
                raise NotImplementedError(f"{sae!r}: no gradients through normalize_activations="
                                          f"{sae.normalize!r}; run it without backward=True")
    sae_names = _sae_names(saes, use_error_term)
    model_hooks, user = _split_hooks(fwd_hooks, sae_names)
    caching = names is not False
    model_names: Any = []
    if not caching:
        keep_sae: Callable[[str], bool] = lambda name: False   # noqa: E731
    elif names is None:
        keep_sae, model_names = (lambda name: True), None
    elif callable(names):
        keep_sae, model_names = names, names
    else:
        listed = [names] if isinstance(names, str) else list(names)
        for name in listed:
            if ".hook_sae_" in name and name not in sae_names:
                _unknown_sae_name(name, sae_names)
        wanted = {n for n in listed if n in sae_names}
        keep_sae = wanted.__contains__
        model_names = [n for n in listed if n not in sae_names]
    splices = [_Splice(sae, use_error_term, user, keep_sae, backward) for sae in saes]
    hooks = model_hooks + [hook for s in splices for hook in s.fwd_hooks()]
    if backward:
        kept: dict[str, np.ndarray] = {}
        if caching:                         # the model's names, copied as the forward passes
            chosen = valid if model_names is None else (
                [n for n in valid if model_names(n)] if callable(model_names) else
                [n for name in model_names for n in _resolve(name, valid)])

            def keeper(x: np.ndarray, name: str) -> None:
                kept[name] = np.array(x)
            hooks = hooks + [(name, keeper) for name in chosen]     # after every other hook
        extra = {k: v for k, v in kwargs.items()
                 if k in ("attention_mask", "head_mask", "token_type_ids")}
        enc = model(_ids(model, text_or_ids), backward=True, fwd_hooks=hooks,
                    need_weights=kwargs.get("need_weights", False), **extra)
        state = enc.tape._state
        for s in splices:               # the tape: an SAE point passes its own gradient back
            state.changed.pop(s.point, None)
            if s.sae.transcoder:        # ... a transcoder's output replaced the model's
                state.changed[s.point] = np.ones(s.state["shape"], dtype=bool)
        state.splices = Splices(splices)
        activations = kept
    elif caching:
        enc, cache = model.run_with_cache(text_or_ids, names=model_names, fwd_hooks=hooks,
                                          **kwargs)
        activations = dict(cache.items())
    else:
        return model.run_with_hooks(text_or_ids, fwd_hooks=hooks, **kwargs)
    if not caching:
        return enc
    ordered: dict[str, np.ndarray] = {}
    by_point = {s.point: s for s in splices}
    for name in model.hook_names():
        if name in activations:
            ordered[name] = activations[name]
        at = by_point.get(name)
        if at is not None:
            ordered.update((n, at.cache[n]) for n in at.names if n in at.cache)
    return enc, ActivationCache(ordered, model)
