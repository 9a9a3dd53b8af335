"""mha.checks on its own: every check against a table of bad inputs with the exact message it
must give, and what each check returns for good input.

The dtype policy, broadcasting, defaults and a layer's configuration are checked here for both
the C path (mha.attention, mha.MultiHeadAttention) and the NumPy oracle (mha.reference), so a
wrong check would sit on both sides of every comparison between them: only these tests can
catch it. The size checks here serve the oracle alone (the binding makes them for the C path;
test_errors.py and test_bad_input.py hold its messages).
"""
import numpy as np
import pytest

from mha import checks
from mha.layer_base import KVCache

F32, F64 = np.float32, np.float64
LONGDOUBLE = np.dtype(np.longdouble)


def a(*shape, dtype=F32):
    return np.zeros(shape, dtype)


def layer_inputs(query, key=None, value=None, d_model=8, kdim=8, vdim=8):
    return checks.layer_inputs(query, key, value, d_model=d_model, kdim=kdim, vdim=vdim, dtype=F32)


def layer_sizes(query, key=None, value=None, d_model=8, kdim=8, vdim=8):
    query, key, value, _ = layer_inputs(query, key, value, d_model, kdim, vdim)
    return checks.layer_sizes(query, key, value, d_model=d_model, kdim=kdim, vdim=vdim)


def cache(length=0, read_only=False, dtype=F32):
    c = KVCache(2, 2, 4, 3, dtype)
    c.length = length
    c.k_rows.flags.writeable = not read_only
    return c


# (id, call, exception, the exact message)
BAD = [
    # float_array
    ("float_array-None", lambda: checks.float_array(None, "q"), TypeError,
     "q must be a float array, not NoneType"),
    ("float_array-str", lambda: checks.float_array("key", "k"), TypeError,
     "k must be a float array, not str"),
    ("float_array-int", lambda: checks.float_array(np.ones(2, np.int64), "v"), TypeError,
     "v must have a float dtype (float16, float32 or float64), not int64"),
    ("float_array-bool", lambda: checks.float_array(np.ones(2, bool), "q"), TypeError,
     "q must have a float dtype (float16, float32 or float64), not bool"),
    ("float_array-complex", lambda: checks.float_array(np.ones(2, complex), "k"), TypeError,
     "k must have a float dtype (float16, float32 or float64), not complex128"),
    ("float_array-object", lambda: checks.float_array(np.array([1.0, None]), "d_out"), TypeError,
     "d_out must have a float dtype (float16, float32 or float64), not object"),
    # flag
    ("flag-array", lambda: checks.flag(np.ones(3), "causal"), TypeError,
     "causal must be a bool, not ndarray"),
    ("flag-float", lambda: checks.flag(0.5, "need_weights"), TypeError,
     "need_weights must be a bool, not float"),
    ("flag-None", lambda: checks.flag(None, "return_lse"), TypeError,
     "return_lse must be a bool, not NoneType"),
    # scale
    ("scale-str", lambda: checks.scale("abc", 4), TypeError, "scale must be a real number, not str 'abc'"),
    ("scale-complex", lambda: checks.scale(1j, 4), TypeError, "scale must be a real number, not complex 1j"),
    ("scale-bool", lambda: checks.scale(True, 4), TypeError, "scale must be a real number, not bool True"),
    ("scale-list", lambda: checks.scale([1, 2], 4), TypeError, "scale must be a real number, not list [1, 2]"),
    ("scale-object", lambda: checks.scale(object(), 4), TypeError, "scale must be a real number, not object"),
    # dropout
    ("dropout-str", lambda: checks.dropout("x"), TypeError, "dropout must be a number in [0, 1), not str 'x'"),
    ("dropout-None", lambda: checks.dropout(None), TypeError,
     "dropout must be a number in [0, 1), not NoneType None"),
    ("dropout-list", lambda: checks.dropout([0.1]), TypeError,
     "dropout must be a number in [0, 1), not list [0.1]"),
    ("dropout-one", lambda: checks.dropout(1.0), ValueError, "dropout must be in [0, 1), got 1.0"),
    ("dropout-negative", lambda: checks.dropout(-0.1), ValueError, "dropout must be in [0, 1), got -0.1"),
    ("dropout-nan", lambda: checks.dropout(float("nan")), ValueError, "dropout must be in [0, 1), got nan"),
    # seed
    ("seed-float", lambda: checks.seed(1.5), TypeError, "seed must be an int, not float"),
    ("seed-bool", lambda: checks.seed(True), TypeError, "seed must be an int, not bool"),
    ("seed-negative", lambda: checks.seed(-1), ValueError, "seed must be in [0, 2**64), got -1"),
    ("seed-2**64", lambda: checks.seed(2**64), ValueError, "seed must be in [0, 2**64), got 18446744073709551616"),
    ("dropout_seed-backward", lambda: checks.dropout_seed(0.2, None, backward=True), ValueError,
     "attention_backward with dropout > 0 needs the seed the forward used (seed=None)"),
    ("dropout_seed-bad-seed-without-dropout", lambda: checks.dropout_seed(0.0, -3), ValueError,
     "seed must be in [0, 2**64), got -3"),
    # qkv
    ("qkv-rank-1", lambda: checks.qkv(a(8), a(8), a(8)), ValueError,
     "q must have 2, 3 or 4 dimensions (..., n_q, d_k), got shape (8,)"),
    ("qkv-rank-5", lambda: checks.qkv(a(1, 1, 1, 5, 8), a(1, 1, 1, 7, 8), a(1, 1, 1, 7, 4)), ValueError,
     "q must have 2, 3 or 4 dimensions (..., n_q, d_k), got shape (1, 1, 1, 5, 8)"),
    ("qkv-rank-mismatch", lambda: checks.qkv(a(5, 8), a(1, 7, 8), a(1, 7, 4)), ValueError,
     "q has shape (5, 8) but k has shape (1, 7, 8): they must have the same rank"),
    ("qkv-v-rank", lambda: checks.qkv(a(5, 8), a(7, 8), a(1, 7, 4)), ValueError,
     "q has shape (5, 8) but v has shape (1, 7, 4): they must have the same rank"),
    ("qkv-d_k", lambda: checks.qkv(a(2, 5, 8), a(2, 7, 6), a(2, 7, 4)), ValueError,
     "q has shape (2, 5, 8) but k has shape (2, 7, 6): d_k must match"),
    ("qkv-n_k", lambda: checks.qkv(a(2, 5, 8), a(2, 7, 8), a(2, 9, 4)), ValueError,
     "k has shape (2, 7, 8) but v has shape (2, 9, 4): n_k must match"),
    ("qkv-batch-k", lambda: checks.qkv(a(2, 5, 8), a(3, 7, 8), a(3, 7, 4)), ValueError,
     "q has shape (2, 5, 8) but k has shape (3, 7, 8): the batch size must match"),
    ("qkv-batch-v", lambda: checks.qkv(a(2, 5, 8), a(2, 7, 8), a(3, 7, 4)), ValueError,
     "q has shape (2, 5, 8) but v has shape (3, 7, 4): the batch size must match"),
    ("qkv-kv-heads", lambda: checks.qkv(a(2, 4, 5, 8), a(2, 2, 7, 8), a(2, 1, 7, 4)), ValueError,
     "k has shape (2, 2, 7, 8) but v has shape (2, 1, 7, 4): the number of heads must match"),
    ("qkv-gqa", lambda: checks.qkv(a(2, 4, 5, 8), a(2, 3, 7, 8), a(2, 3, 7, 4)), ValueError,
     "q has shape (2, 4, 5, 8) but k has shape (2, 3, 7, 8): k's 3 heads must divide q's 4 heads "
     "(grouped-query attention)"),
    ("qkv-zero-kv-heads", lambda: checks.qkv(a(2, 4, 5, 8), a(2, 0, 7, 8), a(2, 0, 7, 4)), ValueError,
     "q has shape (2, 4, 5, 8) but k has shape (2, 0, 7, 8): k's 0 heads must divide q's 4 heads "
     "(grouped-query attention)"),
    # mask
    ("mask-complex", lambda: checks.mask(np.ones((5, 7), complex), (2, 5, 7), F32), TypeError,
     "mask must be bool, integer (nonzero = may attend) or float (added), not complex128"),
    ("mask-str", lambda: checks.mask(np.full((5, 7), "x"), (2, 5, 7), F32), TypeError,
     "mask must be bool, integer (nonzero = may attend) or float (added), not <U1"),
    ("mask-shape", lambda: checks.mask(np.ones((6, 7), bool), (2, 5, 7), F32), ValueError,
     "mask has shape (6, 7), which does not broadcast to the scores' shape (2, 5, 7) (..., n_q, n_k)"),
    ("mask-rank", lambda: checks.mask(np.ones((1, 1, 2, 5, 7)), (2, 5, 7), F64), ValueError,
     "mask has shape (1, 1, 2, 5, 7), which does not broadcast to the scores' shape (2, 5, 7) "
     "(..., n_q, n_k)"),
    # the layer's sizes and dtype
    ("positive_int-float", lambda: checks.positive_int("d_model", 8.0), TypeError,
     "d_model must be a positive int, not float 8.0"),
    ("positive_int-str", lambda: checks.positive_int("n_heads", "8"), TypeError,
     "n_heads must be a positive int, not str '8'"),
    ("positive_int-bool", lambda: checks.positive_int("batch_size", True), TypeError,
     "batch_size must be a positive int, not bool True"),
    ("positive_int-zero", lambda: checks.positive_int("n_heads", 0), ValueError,
     "n_heads must be a positive int, got 0"),
    ("layer_dims-kv", lambda: checks.layer_dims(8, 4, 3), ValueError, "n_kv_heads=3 must divide n_heads=4"),
    ("layer_dims-d_head", lambda: checks.layer_dims(10, 3), ValueError,
     "d_model=10 is not divisible by n_heads=3; pass d_head explicitly"),
    ("layer_dims-d_head-0", lambda: checks.layer_dims(8, 2, d_head=0), ValueError,
     "d_head must be a positive int, got 0"),
    ("layer_dims-kdim", lambda: checks.layer_dims(8, 2, kdim=0), ValueError, "kdim must be a positive int, got 0"),
    ("layer_dims-vdim", lambda: checks.layer_dims(8, 2, vdim=-1), ValueError, "vdim must be a positive int, got -1"),
    ("layer_dtype-int", lambda: checks.layer_dtype(np.int32), TypeError, "dtype must be float32 or float64, got int32"),
    ("layer_dtype-half", lambda: checks.layer_dtype(np.float16), TypeError,
     "dtype must be float32 or float64, got float16"),
    ("layer_dtype-bogus", lambda: checks.layer_dtype("bogus"), TypeError,
     "dtype must be float32 or float64, got 'bogus'"),
    ("generator-negative", lambda: checks.generator(-1), ValueError,
     "seed must be None or a non-negative int, got -1"),
    ("generator-str", lambda: checks.generator("abc"), TypeError,
     "seed must be None or a non-negative int, got 'abc'"),
    # the layer's call
    ("layer_inputs-int", lambda: layer_inputs(np.ones((2, 5, 8), np.int64)), TypeError,
     "query must be a floating-point array, got dtype int64"),
    ("layer_sizes-width", lambda: layer_sizes(a(2, 5, 7)), ValueError,
     "query has shape (2, 5, 7) but expected (B, n, 8) or (n, 8)"),
    ("layer_inputs-rank", lambda: layer_inputs(a(8)), ValueError,
     "query has shape (8,) but expected (B, n, 8) or (n, 8)"),
    ("layer_inputs-key-complex", lambda: layer_inputs(a(2, 5, 8), a(2, 5, 8).astype(complex)), TypeError,
     "key must be a floating-point array, got dtype complex128"),
    ("layer_sizes-key-width", lambda: layer_sizes(a(2, 5, 8), a(2, 6, 4), a(2, 6, 8), kdim=5), ValueError,
     "key has shape (2, 6, 4) but expected (B, n, 5) or (n, 5)"),
    ("layer_inputs-key-default", lambda: layer_inputs(a(2, 5, 8), kdim=5), ValueError,
     "key must be given: it defaults to query (width d_model=8) but this layer has kdim=5"),
    ("layer_inputs-value-default", lambda: layer_inputs(a(2, 5, 8), a(2, 6, 5), kdim=5), ValueError,
     "value must be given: it defaults to key (width 5) but this layer has vdim=8"),
    ("layer_inputs-batched", lambda: layer_inputs(a(5, 8), a(2, 6, 8)), ValueError,
     "query, key, value must all be batched or all unbatched, got shapes (5, 8), (2, 6, 8), (2, 6, 8)"),
    ("layer_sizes-batch", lambda: layer_sizes(a(2, 5, 8), a(3, 6, 8)), ValueError,
     "query (2, 5, 8), key (3, 6, 8), value (3, 6, 8): batch sizes and key/value lengths must match"),
    ("layer_sizes-n_k", lambda: layer_sizes(a(2, 5, 8), a(2, 6, 8), a(2, 4, 8)), ValueError,
     "query (2, 5, 8), key (2, 6, 8), value (2, 4, 8): batch sizes and key/value lengths must match"),
    ("layer_inputs-ragged", lambda: layer_inputs([[1.0, 2.0], [1.0]]), ValueError, None),
    ("key_padding_mask-float", lambda: checks.key_padding_mask(np.ones((2, 5)), False), TypeError,
     "key_padding_mask must be bool (True = real token), got dtype float64"),
    ("key_padding_shape", lambda: checks.key_padding_shape(np.ones((2, 4), bool), 2, 5),
     ValueError, "key_padding_mask has shape (2, 4) but expected (batch, n_k) = (2, 5)"),
    ("key_padding_shape-batch", lambda: checks.key_padding_shape(np.ones((3, 5), bool), 2, 5),
     ValueError, "key_padding_mask has shape (3, 5) but expected (batch, n_k) = (2, 5)"),
    ("head_mask_shape", lambda: checks.head_mask_shape(np.ones(3), 2), ValueError,
     "head_mask has shape (3,) but expected (2,)"),
    ("d_out-int", lambda: checks.d_out(np.ones((2, 5, 8), np.int64), False, F32), TypeError,
     "d_out must have a float dtype (float16, float32 or float64), not int64"),
    ("d_out_shape", lambda: checks.d_out_shape(a(2, 5, 7), (2, 5, 8), False), ValueError,
     "d_out has shape (2, 5, 7) but the output has shape (2, 5, 8)"),
    ("d_out_shape-unbatched", lambda: checks.d_out_shape(checks.d_out(a(5, 7), True, F32), (1, 5, 8), True),
     ValueError,
     "d_out has shape (5, 7) but the output has shape (5, 8)"),
    ("cache_sizes-batch", lambda: checks.cache_sizes(0, 4), ValueError, "batch_size must be a positive int, got 0"),
    ("cache_sizes-max_len", lambda: checks.cache_sizes(2, -1), ValueError, "max_len must be a positive int, got -1"),
    ("cache_sizes-float", lambda: checks.cache_sizes(2.0, 4), TypeError,
     "batch_size must be a positive int, not float 2.0"),
    ("cache-read-only", lambda: checks.cache(cache(read_only=True), 2, 2, 3, F32, 1), ValueError,
     "the KV cache's buffers are read-only"),
    ("cache-batch", lambda: checks.cache(cache(), 1, 2, 3, F32, 1), ValueError,
     "cache holds (2, 2, 4, 3) (batch, n_kv_heads, max_len, d_head) of float32 but this call has "
     "batch 1, 2 kv heads of width 3, float32"),
    ("cache-width", lambda: checks.cache(cache(), 2, 1, 3, F32, 1), ValueError,
     "cache holds (2, 2, 4, 3) (batch, n_kv_heads, max_len, d_head) of float32 but this call has "
     "batch 2, 1 kv heads of width 3, float32"),
    ("cache-dtype", lambda: checks.cache(cache(), 2, 2, 3, F64, 1), ValueError,
     "cache holds (2, 2, 4, 3) (batch, n_kv_heads, max_len, d_head) of float32 but this call has "
     "batch 2, 2 kv heads of width 3, float64"),
    ("cache-overflow", lambda: checks.cache(cache(length=3), 2, 2, 3, F32, 2), ValueError,
     "cache overflow: 3 cached + 2 new positions > max_len=4"),
]


@pytest.mark.parametrize("call, exc, message", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_input_gives_the_exact_message(call, exc, message):
    with pytest.raises(exc) as info:
        call()
    if message is not None:
        assert str(info.value) == message


def test_ragged_and_extended_precision_messages():
    """Messages that end in NumPy's own words, or name a platform-dependent dtype."""
    with pytest.raises(ValueError) as info:
        checks.float_array([[1.0, 2.0], [1.0]], "q")
    assert str(info.value).startswith("q is not a rectangular array: ")
    with pytest.raises(ValueError) as info:
        layer_inputs([[1.0, 2.0], [1.0]])
    assert str(info.value).startswith("query is not a rectangular array: ")
    if LONGDOUBLE.itemsize > 8:
        with pytest.raises(TypeError) as info:
            checks.float_array(np.ones(2, LONGDOUBLE), "q")
        assert str(info.value) == f"q has dtype {LONGDOUBLE}; mha computes in float32 or float64"


def test_fits_names_the_array_and_advises_need_weights():
    with pytest.raises(MemoryError) as info:
        checks.fits("weights", (2**40, 2**20), F32)
    text = str(info.value)
    assert text.startswith("weights of shape (1099511627776, 1048576) would need 4294967296.0 GiB, more than the ")
    assert text.endswith("GiB this machine has available (pass need_weights=False to avoid the n_q x n_k weights)")
    with pytest.raises(MemoryError) as info:
        checks.fits("KV cache", (2, 2**31, 2**31, 8), F64)          # Python ints: no overflow
    assert str(info.value).startswith("KV cache of shape (2, 2147483648, 2147483648, 8) would need ")
    assert "need_weights" not in str(info.value)
    checks.fits("output", (1024, 1024), F64)                         # 8 MiB fits


# --- what the checks return -----------------------------------------------------------------------

def test_dtype_policy():
    h, s, d = np.ones(2, np.float16), np.ones(2, F32), np.ones(2, F64)
    assert checks.float_array(h, "q") is h                           # no copy
    assert checks.compute_dtype(h) == F32 and checks.compute_dtype(h, s) == F32
    assert checks.compute_dtype(s, d) == F64 and checks.compute_dtype(h, d) == F64
    assert checks.float_array([1.0, 2.0], "q").dtype == F64


def test_scalars():
    assert checks.flag(np.True_, "causal") is True and checks.flag(0, "causal") is False
    assert checks.scale(None, 16) == 0.25 and checks.scale(None, 0) == 1.0
    assert checks.scale(np.float32(0.5), 4) == 0.5 and type(checks.scale(2, 4)) is float
    assert checks.default_scale(9) == pytest.approx(1 / 3)
    assert checks.dropout(0) == 0.0 and checks.dropout(np.float32(0.25)) == 0.25
    assert checks.seed(np.uint64(2**64 - 1)) == 2**64 - 1 and type(checks.seed(np.int8(3))) is int
    assert checks.dropout_seed(0.0, None) == (0.0, 0)
    assert checks.dropout_seed(0.3, 7) == (0.3, 7)
    p, seed = checks.dropout_seed(0.3, None)                         # drawn fresh
    assert p == 0.3 and 0 <= seed < 2**63
    assert checks.dropout_seed(0.3, 7, backward=True) == (0.3, 7)


def test_qkv_sizes():
    assert checks.qkv(a(5, 8), a(7, 8), a(7, 3)) == (1, 1, 1, 5, 7, 8, 3)
    assert checks.qkv(a(2, 5, 8), a(2, 7, 8), a(2, 7, 3)) == (2, 1, 1, 5, 7, 8, 3)
    assert checks.qkv(a(2, 4, 5, 8), a(2, 2, 7, 8), a(2, 2, 7, 3)) == (2, 4, 2, 5, 7, 8, 3)


def test_mask_forms():
    scores = (2, 3, 4)
    assert checks.mask(None, scores, F32) is None
    m = checks.mask(np.array([[1, 0, 2, 0]], np.int8), scores, F32)  # integer: nonzero = may attend
    assert m.dtype == bool and m.shape == scores and m[1, 2].tolist() == [True, False, True, False]
    f = checks.mask(np.zeros((3, 4)), scores, F32)                   # float: cast to the call's dtype
    assert f.dtype == F32 and f.shape == scores and not f.flags.writeable  # a broadcast view
    swapped = np.arange(4.0).astype(">f8")                           # byte-swapped: a native copy
    s = checks.mask(swapped, scores, F64)
    assert s.dtype.isnative and s[0, 0].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert swapped.dtype.byteorder == ">"                            # the input is untouched


def test_layer_sizes_and_generator():
    assert checks.layer_dims(8, 2) == (8, 2, 2, 4, 8, 8)
    assert checks.layer_dims(6, 4, 2, d_head=5, kdim=3, vdim=7) == (6, 4, 2, 5, 3, 7)
    assert checks.layer_dtype("float64") == F64
    g = np.random.default_rng(5)
    assert checks.generator(g) is g
    assert checks.generator(5).integers(100) == np.random.default_rng(5).integers(100)


def test_layer_inputs_alias_omitted_arguments_and_cast():
    x = np.ones((2, 5, 8), F64)
    query, key, value, unbatched = layer_inputs(x)
    assert query is key is value and not unbatched                  # self-attention: one array
    assert query.dtype == F32 and query.flags.c_contiguous
    query, key, value, _ = layer_inputs(x, np.ones((2, 6, 8), F32))
    assert value is key and key is not query
    x32 = np.ones((2, 5, 8), F32)
    query, key, value, _ = layer_inputs(x32, x32, x32)               # given thrice: still apart
    assert query is x32 and key is not query and value is not key
    assert np.shares_memory(key, query) and np.shares_memory(value, key)   # views, no copies
    q1, k1, v1, unbatched = layer_inputs(np.ones((5, 8), F32), value=np.ones((5, 8), F32))
    assert unbatched and q1.shape == (1, 5, 8) and k1 is q1 and v1 is not k1
    strided = np.ones((2, 5, 16), F32)[..., ::2]
    assert layer_inputs(strided)[0].flags.c_contiguous               # copied to C order


def test_key_padding_mask_head_mask_and_d_out():
    kpm = checks.key_padding_mask(np.array([1, 0, 3]), True)        # unbatched (n_k,) -> (1, n_k)
    assert kpm.dtype == bool and kpm.tolist() == [[True, False, True]] and kpm.flags.c_contiguous
    checks.key_padding_shape(kpm, 1, 3)
    assert checks.head_mask([1, 0], F64).dtype == F64
    checks.head_mask_shape(checks.head_mask([1, 0], F64), 2)
    g = checks.d_out(np.ones((5, 8)), True, F32)
    assert g.shape == (1, 5, 8) and g.dtype == F32
    checks.d_out_shape(g, (1, 5, 8), True)
    g64 = np.ones((2, 5, 8))
    assert checks.d_out(g64, False, F64) is g64                      # no copy when nothing to do


def test_cache_accepts_what_fits():
    c = cache(length=2)
    checks.cache(c, 2, 2, 3, F32, 2)                                 # exactly full: fine
    assert checks.cache_sizes(np.int64(2), 4) == (2, 4)
