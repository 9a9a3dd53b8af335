/* module.c: the CPython binding of the C core, `mha._C` (private; mha/functional.py and
 * mha/layer.py own the public API, defaults, dtype policy and friendly shape messages).
 *
 * Every function here: parse; check that each array has the dtype, rank, layout and sizes the
 * core needs (a safety net under the Python layer: nothing reaches the core unchecked);
 * allocate the outputs while holding the GIL; release the GIL around the pure C call; raise
 * MemoryError / ValueError from the core's error code after taking the GIL back; release
 * every reference on every path.
 */
#define PY_SSIZE_T_CLEAN
#define NPY_NO_DEPRECATED_API NPY_2_0_API_VERSION
#include <Python.h>
#include <numpy/arrayobject.h>
#include <stddef.h>
#include <string.h>

#include "mha.h"

/* ---- argument checks ---------------------------------------------------------------------- */

/* obj must be a C-contiguous, aligned ndarray of dtype typenum and rank ndim. */
static PyArrayObject *get_array(PyObject *obj, const char *name, int typenum, int ndim) {
    if (!PyArray_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s must be a numpy array, not %.100s", name, Py_TYPE(obj)->tp_name);
        return NULL;
    }
    PyArrayObject *a = (PyArrayObject *)obj;
    if (PyArray_TYPE(a) != typenum) {
        PyErr_Format(PyExc_TypeError, "%s has dtype %S but the core expected %s", name,
                     (PyObject *)PyArray_DESCR(a), typenum == NPY_FLOAT32 ? "float32" : typenum == NPY_FLOAT64 ? "float64" : "bool");
        return NULL;
    }
    if (PyArray_NDIM(a) != ndim) {
        PyErr_Format(PyExc_ValueError, "%s has %d dimensions but the core expected %d", name, PyArray_NDIM(a), ndim);
        return NULL;
    }
    if (!PyArray_IS_C_CONTIGUOUS(a) || !PyArray_ISALIGNED(a) || !PyArray_ISNOTSWAPPED(a)) {
        PyErr_Format(PyExc_ValueError, "%s must be C-contiguous, aligned and in native byte order", name);
        return NULL;
    }
    return a;
}

/* Like get_array, for a buffer the core writes into. */
static PyArrayObject *get_output_array(PyObject *obj, const char *name, int typenum, int ndim) {
    PyArrayObject *a = get_array(obj, name, typenum, ndim);
    if (a && !PyArray_ISWRITEABLE(a)) {
        PyErr_Format(PyExc_ValueError, "%s is read-only, but the core writes into it", name);
        return NULL;
    }
    return a;
}

/* obj must be an aligned ndarray in native byte order, of dtype typenum and rank ndim, whose
 * last axis is contiguous and whose other strides are non-negative multiples of the item size:
 * a view the core can read through an mha_view, such as the (B, H, n, d) heads of a
 * (B, n, 3 * H * d) projection. */
static PyArrayObject *get_view(PyObject *obj, const char *name, int typenum, int ndim) {
    if (!PyArray_Check(obj)) return get_array(obj, name, typenum, ndim); /* its TypeError */
    PyArrayObject *a = (PyArrayObject *)obj;
    if (PyArray_TYPE(a) != typenum || PyArray_NDIM(a) != ndim) return get_array(obj, name, typenum, ndim);
    const npy_intp item = PyArray_ITEMSIZE(a);
    if (PyArray_SIZE(a) == 0) return a; /* nothing is read: any strides will do */
    int ok = PyArray_ISALIGNED(a) && PyArray_ISNOTSWAPPED(a) &&
             (PyArray_DIM(a, ndim - 1) <= 1 || PyArray_STRIDE(a, ndim - 1) == item);
    for (int i = 0; i < ndim; i++) ok = ok && PyArray_STRIDE(a, i) >= 0 && PyArray_STRIDE(a, i) % item == 0;
    if (!ok) {
        PyErr_Format(PyExc_ValueError, "%s must be aligned, in native byte order, with a contiguous last "
                     "axis and non-negative strides", name);
        return NULL;
    }
    return a;
}

/* The element strides of a rank-4 view (get_view) along its batch, head and row axes. */
static mha_view view_of(PyArrayObject *a) {
    const npy_intp item = PyArray_ITEMSIZE(a);
    return (mha_view){PyArray_STRIDE(a, 0) / item, PyArray_STRIDE(a, 1) / item, PyArray_STRIDE(a, 2) / item};
}

/* The scale argument: omitted (NULL) or None means 1/sqrt(d_k) (1 when d_k = 0). */
static int get_scale(PyObject *obj, double *scale) {
    if (!obj || obj == Py_None) return 0; /* keep the descriptor's default */
    double value = PyFloat_AsDouble(obj);
    if (value == -1.0 && PyErr_Occurred()) {
        PyErr_SetString(PyExc_TypeError, "scale must be a float");
        return -1;
    }
    *scale = value;
    return 0;
}

/* a.shape[axis] == expected, or ValueError naming both. */
static int check_dim(PyArrayObject *a, const char *name, int axis, npy_intp expected, const char *what) {
    if (PyArray_DIM(a, axis) != expected) {
        PyErr_Format(PyExc_ValueError, "%s has %zd along axis %d (%s) but %zd was expected", name,
                     (Py_ssize_t)PyArray_DIM(a, axis), axis, what, (Py_ssize_t)expected);
        return -1;
    }
    return 0;
}

static int check_shape(PyArrayObject *a, const char *name, int ndim, const npy_intp *shape) {
    for (int i = 0; i < ndim; i++)
        if (check_dim(a, name, i, shape[i], "size")) return -1;
    return 0;
}

static int raise_core_error(int err) {
    if (err == MHA_ENOMEM) PyErr_SetString(PyExc_MemoryError, "mha: not enough memory for the scratch buffers");
    else if (err) PyErr_Format(PyExc_ValueError, "mha: the core rejected its arguments (error %d)", err);
    return err ? -1 : 0;
}

static PyArrayObject *new_array(int ndim, const npy_intp *shape, int typenum, int zero) {
    return (PyArrayObject *)(zero ? PyArray_ZEROS(ndim, (npy_intp *)shape, typenum, 0)
                                  : PyArray_SimpleNew(ndim, (npy_intp *)shape, typenum));
}

/* The float dtype of the call, from q (every other float array must match it). */
static int float_type(PyObject *obj, const char *name) {
    if (!PyArray_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s must be a numpy array, not %.100s", name, Py_TYPE(obj)->tp_name);
        return -1;
    }
    int t = PyArray_TYPE((PyArrayObject *)obj);
    if (t != NPY_FLOAT32 && t != NPY_FLOAT64) {
        PyErr_Format(PyExc_TypeError, "%s must be float32 or float64, not %S", name,
                     (PyObject *)PyArray_DESCR((PyArrayObject *)obj));
        return -1;
    }
    return t;
}

/* Fills the mask, key padding, causal, scale and dropout fields of d (sizes already set).
 * mask: None or a rank-4 array of shape (B, H, n_q, n_k), any strides (broadcast views),
 * bool or of the call's float dtype. key_padding: None or bool (B, n_k) C-contiguous. */
static int fill_masks(mha_attention_desc *d, int typenum, PyObject *mask_obj, PyObject *kp_obj,
                      int causal, double scale, double dropout, unsigned long long seed) {
    d->causal = causal;
    d->scale = scale;
    d->dropout = dropout;
    d->seed = (uint64_t)seed;
    if (!(dropout >= 0 && dropout < 1)) {
        PyObject *value = PyFloat_FromDouble(dropout); /* PyErr_Format has no %g */
        PyErr_Format(PyExc_ValueError, "dropout must be in [0, 1), got %R", value);
        Py_XDECREF(value);
        return -1;
    }
    if (mask_obj != Py_None) {
        if (!PyArray_Check(mask_obj)) {
            PyErr_SetString(PyExc_TypeError, "mask must be a numpy array");
            return -1;
        }
        PyArrayObject *m = (PyArrayObject *)mask_obj;
        int t = PyArray_TYPE(m);
        if (t != NPY_BOOL && t != typenum) {
            PyErr_Format(PyExc_TypeError, "mask must be bool or of the inputs' float dtype, not %S",
                         (PyObject *)PyArray_DESCR(m));
            return -1;
        }
        npy_intp shape[4] = {d->batch, d->heads, d->n_q, d->n_k};
        if (PyArray_NDIM(m) != 4) {
            PyErr_SetString(PyExc_ValueError, "mask must be broadcast to rank 4 (B, H, n_q, n_k) by the caller");
            return -1;
        }
        if (check_shape(m, "mask", 4, shape)) return -1;
        npy_intp item = PyArray_ITEMSIZE(m);
        if (!PyArray_ISALIGNED(m) || !PyArray_ISNOTSWAPPED(m)) {
            PyErr_SetString(PyExc_ValueError, "mask must be aligned and in native byte order");
            return -1;
        }
        for (int i = 0; i < 4; i++) {
            npy_intp s = PyArray_STRIDE(m, i);
            if (s % item) {
                PyErr_SetString(PyExc_ValueError, "mask strides must be multiples of its item size");
                return -1;
            }
            d->mask_strides[i] = shape[i] > 1 ? (int64_t)(s / item) : 0;
        }
        d->mask = PyArray_DATA(m);
        d->mask_kind = t == NPY_BOOL ? MHA_MASK_BOOL : MHA_MASK_FLOAT;
    }
    if (kp_obj != Py_None) {
        PyArrayObject *kp = get_array(kp_obj, "key_padding_mask", NPY_BOOL, 2);
        if (!kp) return -1;
        npy_intp shape[2] = {d->batch, d->n_k};
        if (check_shape(kp, "key_padding_mask", 2, shape)) return -1;
        d->key_padding = (const uint8_t *)PyArray_DATA(kp);
        d->key_padding_stride = d->n_k;
    }
    return 0;
}

/* q (B, H, n_q, d_k), k (B, H_kv, n_k, d_k), v (B, H_kv, n_k, d_v): checks, fills sizes and
 * views. views: q, k, v may be strided views (get_view; the forward only reads them), else
 * they must be C-contiguous (the backward writes dq, dk, dv through the same views). */
static int attention_args(mha_attention_desc *d, int typenum, int views, PyObject *q_obj, PyObject *k_obj,
                          PyObject *v_obj, PyArrayObject **q, PyArrayObject **k, PyArrayObject **v) {
    PyArrayObject *(*get)(PyObject *, const char *, int, int) = views ? get_view : get_array;
    if (!(*q = get(q_obj, "q", typenum, 4)) || !(*k = get(k_obj, "k", typenum, 4)) || !(*v = get(v_obj, "v", typenum, 4)))
        return -1;
    npy_intp B = PyArray_DIM(*q, 0), H = PyArray_DIM(*q, 1), H_kv = PyArray_DIM(*k, 1);
    if (check_dim(*k, "k", 0, B, "batch") || check_dim(*v, "v", 0, B, "batch") ||
        check_dim(*k, "k", 3, PyArray_DIM(*q, 3), "d_k") || check_dim(*v, "v", 1, H_kv, "heads") ||
        check_dim(*v, "v", 2, PyArray_DIM(*k, 2), "n_k"))
        return -1;
    if (H_kv == 0 ? H != 0 : H % H_kv != 0) {
        PyErr_Format(PyExc_ValueError, "k has %zd heads, which does not divide q's %zd heads",
                     (Py_ssize_t)H_kv, (Py_ssize_t)H);
        return -1;
    }
    mha_attention_desc_init(d, B, H, H_kv, PyArray_DIM(*q, 2), PyArray_DIM(*k, 2),
                            PyArray_DIM(*q, 3), PyArray_DIM(*v, 3));
    if (views) { /* an empty array keeps the contiguous view: it is never read */
        if (PyArray_SIZE(*q)) d->q = view_of(*q);
        if (PyArray_SIZE(*k)) d->k = view_of(*k);
        if (PyArray_SIZE(*v)) d->v = view_of(*v);
    }
    return 0;
}

/* The data pointer of an optional array. */
#define DATA_OR_NULL(a) ((a) ? PyArray_DATA(a) : NULL)

/* ---- attention ---------------------------------------------------------------------------- */

static char *attention_kw[] = {"q", "k", "v", "mask", "key_padding_mask", "causal", "scale",
                               "dropout", "seed", "need_weights", "return_lse", "out",
                               "weights_out", NULL};

/* -> (out, weights|None), or (out, weights|None, lse (B, H, n_q)) with return_lse.
 * q, k, v: strided views are read in place (get_view). out: None, or a writable (B, H, n_q,
 * d_v) view to write into (get_view: e.g. the heads of a (B, n_q, H * d_v) buffer, so that
 * they need no merging); weights_out: None, or a C-contiguous (B, H, n_q, n_k) array for the
 * weights (with need_weights). What is written into is what is returned. */
static PyObject *py_attention_forward(PyObject *self, PyObject *args, PyObject *kwargs) {
    (void)self;
    PyObject *q_obj, *k_obj, *v_obj, *mask_obj = Py_None, *kp_obj = Py_None, *scale_obj = NULL;
    PyObject *out_obj = Py_None, *w_obj = Py_None;
    int causal = 0, need_weights = 1, return_lse = 0;
    double dropout = 0;
    unsigned long long seed = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOO|OOpOdKppOO", attention_kw, &q_obj, &k_obj,
                                     &v_obj, &mask_obj, &kp_obj, &causal, &scale_obj, &dropout,
                                     &seed, &need_weights, &return_lse, &out_obj, &w_obj))
        return NULL;
    int typenum = float_type(q_obj, "q");
    if (typenum < 0) return NULL;
    PyArrayObject *q, *k, *v, *out = NULL, *weights = NULL, *lse = NULL;
    mha_attention_desc d;
    if (attention_args(&d, typenum, 1, q_obj, k_obj, v_obj, &q, &k, &v)) return NULL;
    double scale = d.scale;
    if (get_scale(scale_obj, &scale)) return NULL;
    if (fill_masks(&d, typenum, mask_obj, kp_obj, causal, scale, dropout, seed)) return NULL;
    npy_intp out_shape[4] = {d.batch, d.heads, d.n_q, d.d_v};
    npy_intp w_shape[4] = {d.batch, d.heads, d.n_q, d.n_k};
    if (out_obj != Py_None) {
        PyArrayObject *o = get_view(out_obj, "out", typenum, 4);
        if (!o || check_shape(o, "out", 4, out_shape)) return NULL;
        if (!PyArray_ISWRITEABLE(o)) {
            PyErr_SetString(PyExc_ValueError, "out is read-only, but the core writes into it");
            return NULL;
        }
        Py_INCREF(o);
        out = o;
        if (PyArray_SIZE(o)) d.out = view_of(o);
    } else if (!(out = new_array(4, out_shape, typenum, 0))) goto fail;
    if (need_weights && w_obj != Py_None) {
        PyArrayObject *w = get_output_array(w_obj, "weights_out", typenum, 4);
        if (!w || check_shape(w, "weights_out", 4, w_shape)) goto fail;
        Py_INCREF(w);
        weights = w;
    } else if (need_weights && !(weights = new_array(4, w_shape, typenum, 0))) goto fail;
    if (return_lse && !(lse = new_array(3, out_shape, typenum, 0))) goto fail; /* (B, H, n_q) */
    int err;
    Py_BEGIN_ALLOW_THREADS
    if (typenum == NPY_FLOAT32)
        err = mha_attention_forward_lse_f32(PyArray_DATA(out), DATA_OR_NULL(weights), DATA_OR_NULL(lse),
                                            PyArray_DATA(q), PyArray_DATA(k), PyArray_DATA(v), &d);
    else
        err = mha_attention_forward_lse_f64(PyArray_DATA(out), DATA_OR_NULL(weights), DATA_OR_NULL(lse),
                                            PyArray_DATA(q), PyArray_DATA(k), PyArray_DATA(v), &d);
    Py_END_ALLOW_THREADS
    if (raise_core_error(err)) goto fail;
    PyObject *w = weights ? (PyObject *)weights : Py_None;
    if (!weights) Py_INCREF(Py_None);
    if (lse) return Py_BuildValue("(NNN)", out, w, lse);
    return Py_BuildValue("(NN)", out, w);
fail:
    Py_XDECREF(out);
    Py_XDECREF(weights);
    Py_XDECREF(lse);
    return NULL;
}

static char *attention_backward_kw[] = {"d_out", "q", "k", "v", "mask", "key_padding_mask",
                                        "causal", "scale", "dropout", "seed", "out", "lse", NULL};

/* out and lse: the forward's output (like d_out) and (B, H, n_q) log-sum-exp, both or neither
 * (then the forward runs again inside). */

static PyObject *py_attention_backward(PyObject *self, PyObject *args, PyObject *kwargs) {
    (void)self;
    PyObject *do_obj, *q_obj, *k_obj, *v_obj, *mask_obj = Py_None, *kp_obj = Py_None, *scale_obj = NULL;
    PyObject *o_obj = Py_None, *lse_obj = Py_None;
    int causal = 0;
    double dropout = 0;
    unsigned long long seed = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOO|OOpOdKOO", attention_backward_kw, &do_obj,
                                     &q_obj, &k_obj, &v_obj, &mask_obj, &kp_obj, &causal,
                                     &scale_obj, &dropout, &seed, &o_obj, &lse_obj))
        return NULL;
    int typenum = float_type(q_obj, "q");
    if (typenum < 0) return NULL;
    PyArrayObject *q, *k, *v, *d_out, *o = NULL, *lse = NULL, *dq = NULL, *dk = NULL, *dv = NULL;
    mha_attention_desc d;
    if (attention_args(&d, typenum, 0, q_obj, k_obj, v_obj, &q, &k, &v)) return NULL;
    double scale = d.scale;
    if (get_scale(scale_obj, &scale)) return NULL;
    if (fill_masks(&d, typenum, mask_obj, kp_obj, causal, scale, dropout, seed)) return NULL;
    npy_intp out_shape[4] = {d.batch, d.heads, d.n_q, d.d_v};
    if (!(d_out = get_array(do_obj, "d_out", typenum, 4)) || check_shape(d_out, "d_out", 4, out_shape))
        return NULL;
    if ((o_obj == Py_None) != (lse_obj == Py_None)) {
        PyErr_SetString(PyExc_ValueError, "give both out and lse from the forward, or neither");
        return NULL;
    }
    if (o_obj != Py_None) {
        if (!(o = get_array(o_obj, "out", typenum, 4)) || check_shape(o, "out", 4, out_shape) ||
            !(lse = get_array(lse_obj, "lse", typenum, 3)) || check_shape(lse, "lse", 3, out_shape))
            return NULL;
    }
    if (!(dq = new_array(4, PyArray_DIMS(q), typenum, 0)) ||
        !(dk = new_array(4, PyArray_DIMS(k), typenum, 0)) ||
        !(dv = new_array(4, PyArray_DIMS(v), typenum, 0)))
        goto fail;
    int err;
    Py_BEGIN_ALLOW_THREADS
    if (typenum == NPY_FLOAT32)
        err = mha_attention_backward_saved_f32(PyArray_DATA(dq), PyArray_DATA(dk), PyArray_DATA(dv),
                                               PyArray_DATA(d_out), PyArray_DATA(q), PyArray_DATA(k),
                                               PyArray_DATA(v), DATA_OR_NULL(o), DATA_OR_NULL(lse), &d);
    else
        err = mha_attention_backward_saved_f64(PyArray_DATA(dq), PyArray_DATA(dk), PyArray_DATA(dv),
                                               PyArray_DATA(d_out), PyArray_DATA(q), PyArray_DATA(k),
                                               PyArray_DATA(v), DATA_OR_NULL(o), DATA_OR_NULL(lse), &d);
    Py_END_ALLOW_THREADS
    if (raise_core_error(err)) goto fail;
    return Py_BuildValue("(NNN)", dq, dk, dv);
fail:
    Py_XDECREF(dq);
    Py_XDECREF(dk);
    Py_XDECREF(dv);
    return NULL;
}

/* ---- the layer ---------------------------------------------------------------------------- */

/* heads, kv_heads, d_head positive, kv_heads dividing heads, heads * d_head representable. */
static int check_heads(Py_ssize_t heads, Py_ssize_t kv_heads, Py_ssize_t d_head) {
    if (heads <= 0 || kv_heads <= 0 || d_head <= 0 || heads % kv_heads) {
        PyErr_SetString(PyExc_ValueError, "heads, kv_heads, d_head must be positive with kv_heads dividing heads");
        return -1;
    }
    if (heads > PY_SSIZE_T_MAX / d_head) {
        PyErr_SetString(PyExc_ValueError, "heads * d_head does not fit in an array axis");
        return -1;
    }
    return 0;
}

/* query (B, n_q, d_model), key (B, n_new, kdim), value (B, n_new, vdim), C-contiguous of the
 * call's dtype, and the head sizes: checks them and fills dims for a call without a cache
 * (n_k = kv_batch_stride = n_new). */
static int layer_inputs(mha_layer_dims *m, int typenum, PyObject *xq_obj, PyObject *xk_obj, PyObject *xv_obj,
                        Py_ssize_t heads, Py_ssize_t kv_heads, Py_ssize_t d_head, PyArrayObject **xq,
                        PyArrayObject **xk, PyArrayObject **xv) {
    if (!(*xq = get_array(xq_obj, "query", typenum, 3)) || !(*xk = get_array(xk_obj, "key", typenum, 3)) ||
        !(*xv = get_array(xv_obj, "value", typenum, 3)) || check_heads(heads, kv_heads, d_head))
        return -1;
    memset(m, 0, sizeof *m);
    m->batch = PyArray_DIM(*xq, 0);
    m->n_q = PyArray_DIM(*xq, 1);
    m->n_k = m->n_new = m->kv_batch_stride = PyArray_DIM(*xk, 1);
    m->d_model = PyArray_DIM(*xq, 2);
    m->kdim = PyArray_DIM(*xk, 2);
    m->vdim = PyArray_DIM(*xv, 2);
    m->heads = heads;
    m->kv_heads = kv_heads;
    m->d_head = d_head;
    return check_dim(*xk, "key", 0, m->batch, "batch") || check_dim(*xv, "value", 0, m->batch, "batch") ||
                   check_dim(*xv, "value", 1, m->n_new, "n_k")
               ? -1
               : 0;
}

/* The layer's parameters (or their gradients) as arrays, field for field mha.h's
 * mha_layer_params; NULL for an absent bias or head mask. */
typedef struct {
    PyArrayObject *W_q, *W_k, *W_v, *W_o, *b_q, *b_k, *b_v, *b_o, *head_mask;
} layer_arrays;

/* mha.h's params or grads struct of a layer_arrays, field by field. */
#define LAYER_POINTERS(a)                                                                       \
    {.W_q = DATA_OR_NULL((a).W_q), .W_k = DATA_OR_NULL((a).W_k), .W_v = DATA_OR_NULL((a).W_v), \
     .W_o = DATA_OR_NULL((a).W_o), .b_q = DATA_OR_NULL((a).b_q), .b_k = DATA_OR_NULL((a).b_k), \
     .b_v = DATA_OR_NULL((a).b_v), .b_o = DATA_OR_NULL((a).b_o),                               \
     .head_mask = DATA_OR_NULL((a).head_mask)}

/* Every parameter by name: its field, whether it is required, and its shape (rows, cols;
 * cols VECTOR for a vector) in terms of dims. */
enum { D_MODEL, KDIM, VDIM, E_Q, E_KV, HEADS, VECTOR };
static const struct {
    const char *name;
    size_t field;
    int required, rows, cols;
} LAYER_PARAMS[] = {
    {"W_q", offsetof(layer_arrays, W_q), 1, D_MODEL, E_Q},
    {"W_k", offsetof(layer_arrays, W_k), 1, KDIM, E_KV},
    {"W_v", offsetof(layer_arrays, W_v), 1, VDIM, E_KV},
    {"W_o", offsetof(layer_arrays, W_o), 1, E_Q, D_MODEL},
    {"b_q", offsetof(layer_arrays, b_q), 0, E_Q, VECTOR},
    {"b_k", offsetof(layer_arrays, b_k), 0, E_KV, VECTOR},
    {"b_v", offsetof(layer_arrays, b_v), 0, E_KV, VECTOR},
    {"b_o", offsetof(layer_arrays, b_o), 0, D_MODEL, VECTOR},
    {"head_mask", offsetof(layer_arrays, head_mask), 0, HEADS, VECTOR},
};
enum { N_LAYER_PARAMS = sizeof LAYER_PARAMS / sizeof LAYER_PARAMS[0] };

#define FIELD(arrays, i) (*(PyArrayObject **)((char *)(arrays) + LAYER_PARAMS[i].field))

static npy_intp layer_size(int which, const mha_layer_dims *m) {
    switch (which) {
    case D_MODEL: return m->d_model;
    case KDIM: return m->kdim;
    case VDIM: return m->vdim;
    case E_Q: return m->heads * m->d_head;
    case E_KV: return m->kv_heads * m->d_head;
    case HEADS: return m->heads;
    default: return 0;
    }
}

/* params: a dict {name: array} of W_q, W_k, W_v, W_o (required) and b_q, b_k, b_v, b_o,
 * head_mask (absent or None: no bias / all ones). Checks dtypes and shapes against dims; the
 * pointers stay valid while params is alive. */
static int layer_params(layer_arrays *la, PyObject *params, int typenum, const mha_layer_dims *m) {
    memset(la, 0, sizeof *la);
    if (!PyDict_Check(params)) {
        PyErr_Format(PyExc_TypeError, "params must be a dict {name: array} of W_q, W_k, W_v, W_o and "
                     "optionally b_q, b_k, b_v, b_o, head_mask, not %.100s", Py_TYPE(params)->tp_name);
        return -1;
    }
    PyObject *key, *value;
    Py_ssize_t pos = 0;
    while (PyDict_Next(params, &pos, &key, &value)) { /* no unknown (misspelled) names */
        int known = 0;
        for (int i = 0; i < N_LAYER_PARAMS && !known; i++)
            known = PyUnicode_Check(key) && PyUnicode_CompareWithASCIIString(key, LAYER_PARAMS[i].name) == 0;
        if (!known) {
            PyErr_Format(PyExc_TypeError, "params has an unknown key %R", key);
            return -1;
        }
    }
    for (int i = 0; i < N_LAYER_PARAMS; i++) {
        const char *name = LAYER_PARAMS[i].name;
        PyObject *obj = PyDict_GetItemString(params, name); /* borrowed */
        int ndim = LAYER_PARAMS[i].cols == VECTOR ? 1 : 2;
        if (!obj || obj == Py_None) {
            if (LAYER_PARAMS[i].required) {
                PyErr_Format(PyExc_TypeError, "params has no %s", name);
                return -1;
            }
            continue;
        }
        PyArrayObject *a = get_array(obj, name, typenum, ndim);
        npy_intp shape[2] = {layer_size(LAYER_PARAMS[i].rows, m), layer_size(LAYER_PARAMS[i].cols, m)};
        if (!a || check_shape(a, name, ndim, shape)) return -1;
        FIELD(la, i) = a;
    }
    return 0;
}

/* The array saved[name] (a dict) of dtype typenum and the given shape; NULL (and no error)
 * for an absent or None optional one. */
static PyArrayObject *get_saved(PyObject *saved, const char *name, int required, int typenum, int ndim,
                                const npy_intp *shape) {
    PyObject *obj = PyDict_GetItemString(saved, name); /* borrowed */
    if (!obj || obj == Py_None) {
        if (required) PyErr_Format(PyExc_TypeError, "saved has no %s", name);
        return NULL;
    }
    PyArrayObject *a = get_array(obj, name, typenum, ndim);
    return a && !check_shape(a, name, ndim, shape) ? a : NULL;
}

/* The typed core call of py_layer_forward (SFX f32 or f64), its structs filled by name. */
#define LAYER_FORWARD(SFX)                                                                             \
    do {                                                                                           \
        mha_layer_params_##SFX p = LAYER_POINTERS(la);                                             \
        mha_layer_saved_##SFX saved = {.q_proj = PyArray_DATA(q_proj), .k_proj = PyArray_DATA(k_proj), \
                                       .v_proj = PyArray_DATA(v_proj), .attn = PyArray_DATA(attn),    \
                                       .lse = PyArray_DATA(lse)};                                   \
        err = mha_layer_forward_##SFX(PyArray_DATA(out), DATA_OR_NULL(weights), &saved,             \
                                      PyArray_DATA(xq), PyArray_DATA(xk), PyArray_DATA(xv), &p, &m, &d); \
    } while (0)

static char *layer_forward_kw[] = {"query", "key", "value", "params", "heads", "kv_heads", "d_head",
                                   "mask", "key_padding_mask", "causal", "dropout", "seed",
                                   "need_weights", "k_cache", "v_cache", "cache_length", NULL};

/* -> {"out", "weights" (or None), "q_proj", "k_proj", "v_proj", "attn", "lse"}: the output and
 * what the backward needs (mha.h, mha_layer_saved). With k_cache/v_cache (B, max_len,
 * H_kv*d_head) the new keys/values are written there at rows [cache_length, +n_new) and
 * k_proj/v_proj are the caches themselves. */
static PyObject *py_layer_forward(PyObject *self, PyObject *args, PyObject *kwargs) {
    (void)self;
    PyObject *xq_obj, *xk_obj, *xv_obj, *params, *mask_obj = Py_None, *kp_obj = Py_None;
    PyObject *kc_obj = Py_None, *vc_obj = Py_None;
    Py_ssize_t heads, kv_heads, d_head, cache_length = 0;
    int causal = 0, need_weights = 1;
    double dropout = 0;
    unsigned long long seed = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOnnn|OOpdKpOOn", layer_forward_kw, &xq_obj,
                                     &xk_obj, &xv_obj, &params, &heads, &kv_heads, &d_head,
                                     &mask_obj, &kp_obj, &causal, &dropout, &seed, &need_weights,
                                     &kc_obj, &vc_obj, &cache_length))
        return NULL;
    int typenum = float_type(xq_obj, "query");
    if (typenum < 0) return NULL;
    PyArrayObject *xq, *xk, *xv, *kc = NULL, *vc = NULL;
    PyArrayObject *out = NULL, *weights = NULL, *q_proj = NULL, *k_proj = NULL, *v_proj = NULL, *attn = NULL;
    PyArrayObject *lse = NULL;
    mha_layer_dims m;
    if (layer_inputs(&m, typenum, xq_obj, xk_obj, xv_obj, heads, kv_heads, d_head, &xq, &xk, &xv)) return NULL;
    const npy_intp E_q = heads * d_head, E_kv = kv_heads * d_head;
    if (kc_obj != Py_None) {
        if (!(kc = get_output_array(kc_obj, "k_cache", typenum, 3)) ||
            !(vc = get_output_array(vc_obj, "v_cache", typenum, 3)))
            return NULL;
        npy_intp max_len = PyArray_DIM(kc, 1);
        npy_intp shape[3] = {m.batch, max_len, E_kv};
        if (check_shape(kc, "k_cache", 3, shape) || check_shape(vc, "v_cache", 3, shape)) return NULL;
        if (cache_length < 0 || cache_length > max_len - m.n_new) { /* no overflow */
            PyErr_Format(PyExc_ValueError, "the KV cache holds %zd of %zd positions: %zd more do not fit",
                         cache_length, (Py_ssize_t)max_len, (Py_ssize_t)m.n_new);
            return NULL;
        }
        m.kv_row_offset = cache_length;
        m.kv_batch_stride = max_len;
        m.n_k = m.kv_row_offset + m.n_new;
    }
    layer_arrays la;
    if (layer_params(&la, params, typenum, &m)) return NULL;
    mha_attention_desc d;
    mha_attention_desc_init(&d, m.batch, m.heads, m.kv_heads, m.n_q, m.n_k, m.d_head, m.d_head);
    if (fill_masks(&d, typenum, mask_obj, kp_obj, causal, d.scale, dropout, seed)) return NULL;

    npy_intp out_shape[3] = {m.batch, m.n_q, m.d_model}, w_shape[4] = {m.batch, m.heads, m.n_q, m.n_k};
    npy_intp q_shape[3] = {m.batch, m.n_q, E_q}, kv_shape[3] = {m.batch, m.n_new, E_kv};
    npy_intp lse_shape[3] = {m.batch, m.heads, m.n_q};
    if (!(out = new_array(3, out_shape, typenum, 0)) || !(lse = new_array(3, lse_shape, typenum, 0)) ||
        (need_weights && !(weights = new_array(4, w_shape, typenum, 0))) ||
        !(q_proj = new_array(3, q_shape, typenum, 0)) || !(attn = new_array(3, q_shape, typenum, 0)))
        goto fail;
    if (kc) {
        Py_INCREF(kc);
        Py_INCREF(vc);
        k_proj = kc;
        v_proj = vc;
    } else if (!(k_proj = new_array(3, kv_shape, typenum, 0)) || !(v_proj = new_array(3, kv_shape, typenum, 0))) {
        goto fail;
    }
    int err;
    Py_BEGIN_ALLOW_THREADS
    if (typenum == NPY_FLOAT32) LAYER_FORWARD(f32);
    else LAYER_FORWARD(f64);
    Py_END_ALLOW_THREADS
    if (raise_core_error(err)) goto fail;
    if (!weights) {
        Py_INCREF(Py_None);
        weights = (PyArrayObject *)Py_None;
    }
    return Py_BuildValue("{s:N,s:N,s:N,s:N,s:N,s:N,s:N}", "out", out, "weights", weights, "q_proj", q_proj,
                         "k_proj", k_proj, "v_proj", v_proj, "attn", attn, "lse", lse);
fail:
    Py_XDECREF(lse);
    Py_XDECREF(out);
    Py_XDECREF(weights);
    Py_XDECREF(q_proj);
    Py_XDECREF(k_proj);
    Py_XDECREF(v_proj);
    Py_XDECREF(attn);
    return NULL;
}

/* The typed core call of py_layer_backward (SFX f32 or f64), its structs filled by name. */
#define LAYER_BACKWARD(SFX)                                                                            \
    do {                                                                                           \
        mha_layer_params_##SFX p = LAYER_POINTERS(la);                                             \
        mha_layer_grads_##SFX gr = LAYER_POINTERS(g);                                              \
        mha_layer_saved_##SFX saved = {.q_proj = PyArray_DATA(qp), .k_proj = PyArray_DATA(kp),     \
                                       .v_proj = PyArray_DATA(vp), .attn = PyArray_DATA(attn),     \
                                       .lse = DATA_OR_NULL(lse)};                                   \
        err = mha_layer_backward_##SFX(PyArray_DATA(d_query), PyArray_DATA(dxk_buf), PyArray_DATA(dxv_buf), \
                                       &gr, PyArray_DATA(d_out), &saved, PyArray_DATA(xq),         \
                                       PyArray_DATA(xk), PyArray_DATA(xv), &p, &m, &d);            \
    } while (0)

static char *layer_backward_kw[] = {"d_out", "saved", "query", "key", "value", "params", "heads",
                                    "kv_heads", "d_head", "mask", "key_padding_mask", "causal",
                                    "dropout", "seed", "key_is_query", "value_is_key", NULL};

/* saved: a dict with the forward's q_proj, k_proj, v_proj, attn and (optional) lse (the
 * attention's forward runs again without it). key_is_query: key was query, so its gradient is
 * added into d_query and d_key is None; likewise value_is_key.
 * -> {"d_query", "d_key" (or None), "d_value" (or None), "grads": {name: gradient}} with a
 * gradient for every parameter given and for head_mask. */
static PyObject *py_layer_backward(PyObject *self, PyObject *args, PyObject *kwargs) {
    (void)self;
    PyObject *do_obj, *saved_obj, *xq_obj, *xk_obj, *xv_obj, *params;
    PyObject *mask_obj = Py_None, *kpm_obj = Py_None;
    Py_ssize_t heads, kv_heads, d_head;
    int causal = 0, key_is_query = 0, value_is_key = 0;
    double dropout = 0;
    unsigned long long seed = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOOOnnn|OOpdKpp", layer_backward_kw, &do_obj,
                                     &saved_obj, &xq_obj, &xk_obj, &xv_obj, &params, &heads,
                                     &kv_heads, &d_head, &mask_obj, &kpm_obj, &causal, &dropout,
                                     &seed, &key_is_query, &value_is_key))
        return NULL;
    int typenum = float_type(xq_obj, "query");
    if (typenum < 0) return NULL;
    if (!PyDict_Check(saved_obj)) {
        PyErr_Format(PyExc_TypeError, "saved must be the dict of the forward's q_proj, k_proj, v_proj, "
                     "attn, lse, not %.100s", Py_TYPE(saved_obj)->tp_name);
        return NULL;
    }
    PyArrayObject *xq, *xk, *xv, *d_out, *qp, *kp, *vp, *attn, *lse;
    mha_layer_dims m;
    if (layer_inputs(&m, typenum, xq_obj, xk_obj, xv_obj, heads, kv_heads, d_head, &xq, &xk, &xv)) return NULL;
    const npy_intp E_q = heads * d_head, E_kv = kv_heads * d_head;
    npy_intp out_shape[3] = {m.batch, m.n_q, m.d_model}, q_shape[3] = {m.batch, m.n_q, E_q};
    npy_intp kv_shape[3] = {m.batch, m.n_k, E_kv}, lse_shape[3] = {m.batch, m.heads, m.n_q};
    if (!(d_out = get_array(do_obj, "d_out", typenum, 3)) || check_shape(d_out, "d_out", 3, out_shape))
        return NULL;
    if (!(qp = get_saved(saved_obj, "q_proj", 1, typenum, 3, q_shape)) ||
        !(kp = get_saved(saved_obj, "k_proj", 1, typenum, 3, kv_shape)) ||
        !(vp = get_saved(saved_obj, "v_proj", 1, typenum, 3, kv_shape)) ||
        !(attn = get_saved(saved_obj, "attn", 1, typenum, 3, q_shape)))
        return NULL;
    if (!(lse = get_saved(saved_obj, "lse", 0, typenum, 3, lse_shape)) && PyErr_Occurred()) return NULL;
    layer_arrays la;
    if (layer_params(&la, params, typenum, &m)) return NULL;
    mha_attention_desc d;
    mha_attention_desc_init(&d, m.batch, m.heads, m.kv_heads, m.n_q, m.n_k, m.d_head, m.d_head);
    if (fill_masks(&d, typenum, mask_obj, kpm_obj, causal, d.scale, dropout, seed)) return NULL;

    if ((key_is_query && (xk != xq)) || (value_is_key && (xv != xk))) {
        PyErr_SetString(PyExc_ValueError, "key_is_query / value_is_key need the same array objects");
        return NULL;
    }
    PyArrayObject *d_query = NULL, *d_key = NULL, *d_value = NULL;
    layer_arrays g = {0};
    PyObject *grads = NULL;
    if (!(d_query = new_array(3, PyArray_DIMS(xq), typenum, 0)) ||
        (!key_is_query && !(d_key = new_array(3, PyArray_DIMS(xk), typenum, 0))) ||
        (!value_is_key && !(d_value = new_array(3, PyArray_DIMS(xv), typenum, 0))))
        goto fail;
    /* the buffers the core writes: an aliased input shares the buffer of the one it is */
    PyArrayObject *dxk_buf = key_is_query ? d_query : d_key;
    PyArrayObject *dxv_buf = value_is_key ? dxk_buf : d_value;
    /* a gradient for every parameter given, and for the head mask whether or not it was */
    for (int i = 0; i < N_LAYER_PARAMS; i++) {
        PyArrayObject *a = FIELD(&la, i);
        npy_intp hshape[1] = {m.heads};
        int is_head_mask = LAYER_PARAMS[i].rows == HEADS;
        if ((a || is_head_mask) &&
            !(FIELD(&g, i) = a ? new_array(PyArray_NDIM(a), PyArray_DIMS(a), typenum, 0) : new_array(1, hshape, typenum, 0)))
            goto fail;
    }
    int err;
    Py_BEGIN_ALLOW_THREADS
    if (typenum == NPY_FLOAT32) LAYER_BACKWARD(f32);
    else LAYER_BACKWARD(f64);
    Py_END_ALLOW_THREADS
    if (raise_core_error(err) || !(grads = PyDict_New())) goto fail;
    for (int i = 0; i < N_LAYER_PARAMS; i++)
        if (FIELD(&g, i) && PyDict_SetItemString(grads, LAYER_PARAMS[i].name, (PyObject *)FIELD(&g, i)))
            goto fail;
    for (int i = 0; i < N_LAYER_PARAMS; i++) Py_CLEAR(FIELD(&g, i)); /* grads holds them now */
    PyObject *none_key = d_key ? (PyObject *)d_key : Py_None, *none_value = d_value ? (PyObject *)d_value : Py_None;
    if (!d_key) Py_INCREF(Py_None);
    if (!d_value) Py_INCREF(Py_None);
    return Py_BuildValue("{s:N,s:N,s:N,s:N}", "d_query", d_query, "d_key", none_key, "d_value", none_value,
                         "grads", grads);
fail:
    Py_XDECREF(d_query);
    Py_XDECREF(d_key);
    Py_XDECREF(d_value);
    Py_XDECREF(grads);
    for (int i = 0; i < N_LAYER_PARAMS; i++) Py_XDECREF(FIELD(&g, i));
    return NULL;
}

/* ---- building blocks ---------------------------------------------------------------------- */

static char *matmul_kw[] = {"a", "b", "trans_a", "trans_b", NULL};

/* op(a) @ op(b) for 2-D C-contiguous float arrays of one dtype: the core's GEMM. */
static PyObject *py_matmul(PyObject *self, PyObject *args, PyObject *kwargs) {
    (void)self;
    PyObject *a_obj, *b_obj;
    int ta = 0, tb = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO|pp", matmul_kw, &a_obj, &b_obj, &ta, &tb))
        return NULL;
    int typenum = float_type(a_obj, "a");
    if (typenum < 0) return NULL;
    PyArrayObject *a = get_array(a_obj, "a", typenum, 2), *b;
    if (!a || !(b = get_array(b_obj, "b", typenum, 2))) return NULL;
    npy_intp M = PyArray_DIM(a, ta ? 1 : 0), K = PyArray_DIM(a, ta ? 0 : 1);
    npy_intp Kb = PyArray_DIM(b, tb ? 1 : 0), N = PyArray_DIM(b, tb ? 0 : 1);
    if (K != Kb) {
        PyErr_Format(PyExc_ValueError, "op(a) has %zd columns but op(b) has %zd rows", (Py_ssize_t)K, (Py_ssize_t)Kb);
        return NULL;
    }
    npy_intp shape[2] = {M, N};
    PyArrayObject *c = new_array(2, shape, typenum, 0);
    if (!c) return NULL;
    int err;
    npy_intp lda = PyArray_DIM(a, 1), ldb = PyArray_DIM(b, 1);
    Py_BEGIN_ALLOW_THREADS
    if (typenum == NPY_FLOAT32)
        err = mha_gemm_f32(ta, tb, M, N, K, 1, PyArray_DATA(a), lda, PyArray_DATA(b), ldb, 0, PyArray_DATA(c), N);
    else
        err = mha_gemm_f64(ta, tb, M, N, K, 1, PyArray_DATA(a), lda, PyArray_DATA(b), ldb, 0, PyArray_DATA(c), N);
    Py_END_ALLOW_THREADS
    if (raise_core_error(err)) {
        Py_DECREF(c);
        return NULL;
    }
    return (PyObject *)c;
}

/* An optional 1-D float array of n elements: *out = NULL for None; -1 on a bad one. */
static int get_opt_vector(PyObject *obj, const char *name, int typenum, npy_intp n, PyArrayObject **out) {
    *out = NULL;
    if (!obj || obj == Py_None) return 0;
    if (!(*out = get_array(obj, name, typenum, 1))) return -1;
    return check_dim(*out, name, 0, n, "size");
}

/* The array to write: `out` when given (checked for dtype, shape, layout, writability; a new
 * reference), else a new one. */
static PyArrayObject *get_or_new(PyObject *out_obj, int ndim, const npy_intp *shape, int typenum) {
    if (!out_obj || out_obj == Py_None) return new_array(ndim, shape, typenum, 0);
    PyArrayObject *o = get_output_array(out_obj, "out", typenum, ndim);
    if (!o || check_shape(o, "out", ndim, shape)) return NULL;
    Py_INCREF(o);
    return o;
}

/* Calls the f32 or f64 form of a core function, the GIL released: err = f_SFX(args...). */
#define CALL_TYPED(typenum, err, fn, ...)                                                       \
    do {                                                                                        \
        Py_BEGIN_ALLOW_THREADS                                                                  \
        if ((typenum) == NPY_FLOAT32) err = fn##_f32(__VA_ARGS__);                              \
        else err = fn##_f64(__VA_ARGS__);                                                       \
        Py_END_ALLOW_THREADS                                                                    \
    } while (0)
#define DPTR(a) ((void *)((a) ? PyArray_DATA(a) : NULL))

static int check_act(int act) {
    int kind = act & ~MHA_ACT_GATED;
    if ((act & ~(MHA_ACT_GATED | 15)) || kind < MHA_ACT_NONE || kind > MHA_ACT_RELU) {
        PyErr_Format(PyExc_ValueError, "act must be an activation code in [0, %d], or'ed with %d "
                     "(gated), got %d", MHA_ACT_RELU, MHA_ACT_GATED, act);
        return -1;
    }
    return 0;
}

/* The width W of packed panels (mha_pack_width) for the dtype typenum, on the path in use. */
static npy_intp pack_width(int typenum) {
    int64_t w = 0;
    if (typenum == NPY_FLOAT32) mha_pack_width_f32(&w);
    else mha_pack_width_f64(&w);
    return (npy_intp)w;
}

static char *pack_weight_kw[] = {"b", "trans_b", NULL};

/* pack_weight(b (K, N) or (N, K) with trans_b, trans_b=False) -> op(b) packed whole, a new
 * (ceil(N / W), K, W) array (W = the path's panel width), for linear(a, packed, columns=N). */
static PyObject *py_pack_weight(PyObject *self, PyObject *args, PyObject *kwargs) {
    (void)self;
    PyObject *b_obj;
    int tb = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|p", pack_weight_kw, &b_obj, &tb)) return NULL;
    int typenum = float_type(b_obj, "b");
    if (typenum < 0) return NULL;
    PyArrayObject *b = get_array(b_obj, "b", typenum, 2);
    if (!b) return NULL;
    const npy_intp K = PyArray_DIM(b, tb ? 1 : 0), N = PyArray_DIM(b, tb ? 0 : 1), W = pack_width(typenum);
    npy_intp shape[3] = {(N + W - 1) / W, K, W};
    PyArrayObject *p = new_array(3, shape, typenum, 0);
    if (!p) return NULL;
    int err;
    CALL_TYPED(typenum, err, mha_pack_weight, PyArray_DATA(p), PyArray_DATA(b), PyArray_DIM(b, 1), tb, K, N);
    if (raise_core_error(err)) {
        Py_DECREF(p);
        return NULL;
    }
    return (PyObject *)p;
}

static char *linear_kw[] = {"a", "b", "bias", "act", "trans_b", "out", "columns", NULL};

/* linear(a (M, K), b (K, N') or (N', K) with trans_b, bias (N') or None, act=0, trans_b=False,
 * out=None, columns=None) -> act(a @ op(b) + bias) (M, N), N = N' / 2 when act is gated; with
 * out (M, N): out += a @ op(b) + bias in place (act must be 0), and out is returned. b may be
 * packed by pack_weight ((P, K, W), trans_b False): columns then gives N'. */
static PyObject *py_linear(PyObject *self, PyObject *args, PyObject *kwargs) {
    (void)self;
    PyObject *a_obj, *b_obj, *bias_obj = Py_None, *out_obj = Py_None, *cols_obj = Py_None;
    int act = 0, tb = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO|OipOO", linear_kw, &a_obj, &b_obj, &bias_obj,
                                     &act, &tb, &out_obj, &cols_obj))
        return NULL;
    int typenum = float_type(a_obj, "a");
    if (typenum < 0 || check_act(act)) return NULL;
    const int packed = PyArray_Check(b_obj) && PyArray_NDIM((PyArrayObject *)b_obj) == 3;
    PyArrayObject *a = get_array(a_obj, "a", typenum, 2), *b, *bias;
    if (!a || !(b = get_array(b_obj, "b", typenum, packed ? 3 : 2))) return NULL;
    npy_intp M = PyArray_DIM(a, 0), K = PyArray_DIM(a, 1);
    npy_intp Kb = PyArray_DIM(b, tb ? 1 : 0), Nb = PyArray_DIM(b, tb ? 0 : 1);
    if (packed) { /* (P, K, W) from pack_weight: N' from columns, checked against P and W */
        const npy_intp W = pack_width(typenum);
        Py_ssize_t cols = cols_obj == Py_None ? -1 : PyNumber_AsSsize_t(cols_obj, PyExc_OverflowError);
        if (cols == -1 && PyErr_Occurred()) return NULL;
        if (tb || PyArray_DIM(b, 2) != W || cols < 0 || (cols + W - 1) / W != PyArray_DIM(b, 0)) {
            PyErr_Format(PyExc_ValueError, "a packed b (%zd, %zd, %zd) needs trans_b=False, panels %zd "
                         "wide (this process's SIMD path) and columns=N with ceil(N / %zd) = %zd, got "
                         "trans_b=%d, columns=%zd", (Py_ssize_t)PyArray_DIM(b, 0), (Py_ssize_t)PyArray_DIM(b, 1),
                         (Py_ssize_t)PyArray_DIM(b, 2), (Py_ssize_t)W, (Py_ssize_t)W,
                         (Py_ssize_t)PyArray_DIM(b, 0), tb, cols);
            return NULL;
        }
        Kb = PyArray_DIM(b, 1);
        Nb = cols;
    } else if (cols_obj != Py_None) {
        PyErr_SetString(PyExc_ValueError, "columns goes with a packed b (from pack_weight) only");
        return NULL;
    }
    if (K != Kb) {
        PyErr_Format(PyExc_ValueError, "a has %zd columns but op(b) has %zd rows", (Py_ssize_t)K, (Py_ssize_t)Kb);
        return NULL;
    }
    int gated = (act & MHA_ACT_GATED) != 0;
    if (gated && Nb % 2) {
        PyErr_Format(PyExc_ValueError, "a gated activation needs an even number of columns in op(b), got %zd",
                     (Py_ssize_t)Nb);
        return NULL;
    }
    if (out_obj != Py_None && act != MHA_ACT_NONE) {
        PyErr_SetString(PyExc_ValueError, "out (accumulate into it) needs act=0");
        return NULL;
    }
    if (get_opt_vector(bias_obj, "bias", typenum, Nb, &bias)) return NULL;
    npy_intp shape[2] = {M, gated ? Nb / 2 : Nb};
    PyArrayObject *c = get_or_new(out_obj, 2, shape, typenum);
    if (!c) return NULL;
    int err;
    npy_intp ldb = PyArray_DIM(b, 1);
    if (packed) {
        const double beta = out_obj != Py_None ? 1.0 : 0.0;
        CALL_TYPED(typenum, err, mha_linear_packed, M, shape[1], K, PyArray_DATA(a), K, PyArray_DATA(b),
                   DPTR(bias), act, beta, PyArray_DATA(c), shape[1]);
    } else if (typenum == NPY_FLOAT32) {
        Py_BEGIN_ALLOW_THREADS
        err = mha_linear_f32(M, shape[1], K, PyArray_DATA(a), K, PyArray_DATA(b), ldb, tb, DPTR(bias), act,
                             out_obj != Py_None ? 1.0f : 0.0f, PyArray_DATA(c), shape[1]);
        Py_END_ALLOW_THREADS
    } else {
        Py_BEGIN_ALLOW_THREADS
        err = mha_linear_f64(M, shape[1], K, PyArray_DATA(a), K, PyArray_DATA(b), ldb, tb, DPTR(bias), act,
                             out_obj != Py_None ? 1.0 : 0.0, PyArray_DATA(c), shape[1]);
        Py_END_ALLOW_THREADS
    }
    if (raise_core_error(err)) {
        Py_DECREF(c);
        return NULL;
    }
    return (PyObject *)c;
}

static char *activation_kw[] = {"x", "act", "out", NULL};

/* activation(x (rows, n) [or (rows, 2n) gated], act, out=None) -> act(x) (rows, n); out may be
 * x itself (in place). */
static PyObject *py_activation(PyObject *self, PyObject *args, PyObject *kwargs) {
    (void)self;
    PyObject *x_obj, *out_obj = Py_None;
    int act;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "Oi|O", activation_kw, &x_obj, &act, &out_obj)) return NULL;
    int typenum = float_type(x_obj, "x");
    if (typenum < 0 || check_act(act)) return NULL;
    PyArrayObject *x = get_array(x_obj, "x", typenum, 2);
    if (!x) return NULL;
    int gated = (act & MHA_ACT_GATED) != 0;
    npy_intp rows = PyArray_DIM(x, 0), cols = PyArray_DIM(x, 1);
    if (gated && cols % 2) {
        PyErr_Format(PyExc_ValueError, "a gated activation needs an even number of columns, got %zd", (Py_ssize_t)cols);
        return NULL;
    }
    npy_intp shape[2] = {rows, gated ? cols / 2 : cols};
    if (gated && out_obj == x_obj) {
        PyErr_SetString(PyExc_ValueError, "a gated activation cannot write into x");
        return NULL;
    }
    PyArrayObject *y = get_or_new(out_obj, 2, shape, typenum);
    if (!y) return NULL;
    if (y != x && PyArray_SIZE(y) && PyArray_SIZE(x) &&
        (char *)PyArray_DATA(y) < (char *)PyArray_DATA(x) + PyArray_NBYTES(x) &&
        (char *)PyArray_DATA(x) < (char *)PyArray_DATA(y) + PyArray_NBYTES(y)) {
        Py_DECREF(y);
        PyErr_SetString(PyExc_ValueError, "out overlaps x without being x");
        return NULL;
    }
    int err;
    CALL_TYPED(typenum, err, mha_activation, PyArray_DATA(y), shape[1], PyArray_DATA(x), cols, rows,
               shape[1], act);
    if (raise_core_error(err)) {
        Py_DECREF(y);
        return NULL;
    }
    return (PyObject *)y;
}

static char *norm_kw[] = {"x", "gain", "bias", "eps", "out", NULL};
static char *rms_norm_kw[] = {"x", "gain", "eps", "out", NULL};

/* layer_norm(x (rows, d), gain (d) or None, bias (d) or None, eps, out=None) -> (rows, d);
 * rms_norm(x, gain, eps, out=None) the same without bias. out may be x itself. */
static PyObject *norm(PyObject *args, PyObject *kwargs, int rms) {
    PyObject *x_obj, *g_obj, *b_obj = Py_None, *out_obj = Py_None;
    double eps;
    int parsed = rms ? PyArg_ParseTupleAndKeywords(args, kwargs, "OOd|O", rms_norm_kw, &x_obj, &g_obj, &eps, &out_obj)
                     : PyArg_ParseTupleAndKeywords(args, kwargs, "OOOd|O", norm_kw, &x_obj, &g_obj, &b_obj, &eps, &out_obj);
    if (!parsed) return NULL;
    int typenum = float_type(x_obj, "x");
    if (typenum < 0) return NULL;
    if (!(eps >= 0)) {
        PyErr_SetString(PyExc_ValueError, "eps must be >= 0");
        return NULL;
    }
    PyArrayObject *x = get_array(x_obj, "x", typenum, 2), *g, *b;
    if (!x) return NULL;
    npy_intp rows = PyArray_DIM(x, 0), d = PyArray_DIM(x, 1);
    if (get_opt_vector(g_obj, "gain", typenum, d, &g) || get_opt_vector(b_obj, "bias", typenum, d, &b)) return NULL;
    npy_intp shape[2] = {rows, d};
    PyArrayObject *y = get_or_new(out_obj, 2, shape, typenum);
    if (!y) return NULL;
    int err;
    if (rms)
        CALL_TYPED(typenum, err, mha_rms_norm, PyArray_DATA(y), d, PyArray_DATA(x), d, rows, d, DPTR(g), eps);
    else
        CALL_TYPED(typenum, err, mha_layer_norm, PyArray_DATA(y), d, PyArray_DATA(x), d, rows, d, DPTR(g),
                   DPTR(b), eps);
    if (raise_core_error(err)) {
        Py_DECREF(y);
        return NULL;
    }
    return (PyObject *)y;
}

static PyObject *py_layer_norm(PyObject *self, PyObject *args, PyObject *kwargs) {
    (void)self;
    return norm(args, kwargs, 0);
}

static PyObject *py_rms_norm(PyObject *self, PyObject *args, PyObject *kwargs) {
    (void)self;
    return norm(args, kwargs, 1);
}

static char *rope_kw[] = {"x", "heads", "d_head", "cos", "sin", NULL};

/* rope(x (rows, width), heads, d_head, cos (period, d_head / 2), sin (same)) -> None: rotates
 * the first heads * d_head columns of every row in place, row r by row r % period of cos, sin. */
static PyObject *py_rope(PyObject *self, PyObject *args, PyObject *kwargs) {
    (void)self;
    PyObject *x_obj, *c_obj, *s_obj;
    Py_ssize_t heads, d_head;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OnnOO", rope_kw, &x_obj, &heads, &d_head, &c_obj, &s_obj))
        return NULL;
    int typenum = float_type(x_obj, "x");
    if (typenum < 0) return NULL;
    PyArrayObject *x = get_output_array(x_obj, "x", typenum, 2), *c, *s;
    if (!x || !(c = get_array(c_obj, "cos", typenum, 2)) || !(s = get_array(s_obj, "sin", typenum, 2))) return NULL;
    if (heads < 0 || d_head < 0 || d_head % 2 || heads * d_head > PyArray_DIM(x, 1)) {
        PyErr_Format(PyExc_ValueError, "heads=%zd and d_head=%zd (even) must fit x's %zd columns", heads, d_head,
                     (Py_ssize_t)PyArray_DIM(x, 1));
        return NULL;
    }
    npy_intp period = PyArray_DIM(c, 0), rows = PyArray_DIM(x, 0);
    npy_intp shape[2] = {period, d_head / 2};
    if (check_shape(c, "cos", 2, shape) || check_shape(s, "sin", 2, shape)) return NULL;
    if (rows > 0 && period < 1) {
        PyErr_SetString(PyExc_ValueError, "cos and sin have no rows");
        return NULL;
    }
    int err;
    CALL_TYPED(typenum, err, mha_rope, PyArray_DATA(x), PyArray_DIM(x, 1), rows, heads, d_head, PyArray_DATA(c),
               PyArray_DATA(s), period);
    if (raise_core_error(err)) return NULL;
    Py_RETURN_NONE;
}

static char *embedding_kw[] = {"table", "ids", "out", "accumulate", NULL};

/* embedding(table (vocab, d), ids int64 (n,), out=None, accumulate=False) -> (n, d): rows of
 * table; with accumulate, added to out (required). */
static PyObject *py_embedding(PyObject *self, PyObject *args, PyObject *kwargs) {
    (void)self;
    PyObject *t_obj, *ids_obj, *out_obj = Py_None;
    int accumulate = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO|Op", embedding_kw, &t_obj, &ids_obj, &out_obj, &accumulate))
        return NULL;
    int typenum = float_type(t_obj, "table");
    if (typenum < 0) return NULL;
    PyArrayObject *t = get_array(t_obj, "table", typenum, 2), *ids;
    if (!t || !(ids = get_array(ids_obj, "ids", NPY_INT64, 1))) return NULL;
    if (accumulate && out_obj == Py_None) {
        PyErr_SetString(PyExc_ValueError, "accumulate needs out");
        return NULL;
    }
    npy_intp vocab = PyArray_DIM(t, 0), d = PyArray_DIM(t, 1), n = PyArray_DIM(ids, 0);
    npy_intp shape[2] = {n, d};
    PyArrayObject *o = get_or_new(out_obj, 2, shape, typenum);
    if (!o) return NULL;
    int err;
    CALL_TYPED(typenum, err, mha_embedding, PyArray_DATA(o), d, PyArray_DATA(t), vocab, d,
               (const int64_t *)PyArray_DATA(ids), n, accumulate);
    if (err == MHA_EINVAL) {
        Py_DECREF(o);
        PyErr_Format(PyExc_ValueError, "ids must lie in [0, %zd) (the table's rows)", (Py_ssize_t)vocab);
        return NULL;
    }
    if (raise_core_error(err)) {
        Py_DECREF(o);
        return NULL;
    }
    return (PyObject *)o;
}

/* attention_flow(weights, sources=None) -> (n_sources, n): weights (L, n, n) float64,
 * C-contiguous, finite, >= 0; sources int64 (n_sources,) or None for all positions
 * (mha.analysis.attention_flow fuses the heads, adds the residual and checks the values). */
static char *attention_flow_kw[] = {"weights", "sources", NULL};

static PyObject *py_attention_flow(PyObject *self, PyObject *args, PyObject *kwargs) {
    (void)self;
    PyObject *w_obj, *s_obj = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|O", attention_flow_kw, &w_obj, &s_obj)) return NULL;
    PyArrayObject *w = get_array(w_obj, "weights", NPY_FLOAT64, 3), *src = NULL;
    if (!w) return NULL;
    npy_intp L = PyArray_DIM(w, 0), n = PyArray_DIM(w, 1), n_src = n;
    if (L < 1 || n < 1 || PyArray_DIM(w, 2) != n) {
        PyErr_Format(PyExc_ValueError, "weights has shape (%zd, %zd, %zd) but (layers >= 1, n >= 1, n) was expected",
                     (Py_ssize_t)L, (Py_ssize_t)n, (Py_ssize_t)PyArray_DIM(w, 2));
        return NULL;
    }
    if (s_obj != Py_None) {
        if (!PyArray_Check(s_obj) || PyArray_TYPE((PyArrayObject *)s_obj) != NPY_INT64) {
            PyErr_SetString(PyExc_TypeError, "sources must be an int64 numpy array or None");
            return NULL;
        }
        if (!(src = get_array(s_obj, "sources", NPY_INT64, 1))) return NULL;
        n_src = PyArray_DIM(src, 0);
        const int64_t *s = PyArray_DATA(src);
        for (npy_intp i = 0; i < n_src; i++)
            if (s[i] < 0 || s[i] >= n) {
                PyErr_Format(PyExc_ValueError, "sources[%zd] = %lld is outside [0, %zd)", (Py_ssize_t)i, (long long)s[i], (Py_ssize_t)n);
                return NULL;
            }
    }
    npy_intp shape[2] = {n_src, n};
    PyArrayObject *out = (PyArrayObject *)PyArray_SimpleNew(2, shape, NPY_FLOAT64);
    if (!out) return NULL;
    int err;
    Py_BEGIN_ALLOW_THREADS
    err = mha_attention_flow_f64(PyArray_DATA(out), PyArray_DATA(w), L, n, src ? PyArray_DATA(src) : NULL, n_src);
    Py_END_ALLOW_THREADS
    if (err == MHA_EINVAL) PyErr_SetString(PyExc_ValueError, "weights must be finite and >= 0");
    else if (err) PyErr_NoMemory();
    if (err) {
        Py_DECREF(out);
        return NULL;
    }
    return (PyObject *)out;
}

static PyObject *py_dropout_uniform(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long seed, b, h, i, j;
    if (!PyArg_ParseTuple(args, "KKKKK", &seed, &b, &h, &i, &j)) return NULL;
    return PyFloat_FromDouble(mha_dropout_uniform(seed, b, h, i, j));
}

static PyObject *py_set_num_threads(PyObject *self, PyObject *arg) {
    (void)self;
    long n = PyLong_AsLong(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    if (n < 1 || n > MHA_MAX_THREADS) {
        PyErr_Format(PyExc_ValueError, "n must be between 1 and %d, got %ld", MHA_MAX_THREADS, n);
        return NULL;
    }
    mha_set_num_threads((int)n);
    Py_RETURN_NONE;
}

static PyObject *py_get_num_threads(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyLong_FromLong(mha_get_num_threads());
}

static PyObject *py_build_info(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyUnicode_FromString(mha_build_info());
}

static PyMethodDef methods[] = {
    {"attention_forward", (PyCFunction)(void (*)(void))py_attention_forward, METH_VARARGS | METH_KEYWORDS,
     "attention_forward(q, k, v, mask, key_padding_mask, causal, scale, dropout, seed, need_weights, return_lse) -> (out, weights[, lse])"},
    {"attention_backward", (PyCFunction)(void (*)(void))py_attention_backward, METH_VARARGS | METH_KEYWORDS,
     "attention_backward(d_out, q, k, v, mask, key_padding_mask, causal, scale, dropout, seed, out, lse) -> (dq, dk, dv)"},
    {"layer_forward", (PyCFunction)(void (*)(void))py_layer_forward, METH_VARARGS | METH_KEYWORDS,
     "layer_forward(query, key, value, params, heads, kv_heads, d_head, mask, key_padding_mask, causal, "
     "dropout, seed, need_weights, k_cache, v_cache, cache_length) -> {out, weights, q_proj, k_proj, "
     "v_proj, attn, lse}; params: {W_q, W_k, W_v, W_o[, b_q, b_k, b_v, b_o, head_mask]}"},
    {"layer_backward", (PyCFunction)(void (*)(void))py_layer_backward, METH_VARARGS | METH_KEYWORDS,
     "layer_backward(d_out, saved, query, key, value, params, heads, kv_heads, d_head, mask, "
     "key_padding_mask, causal, dropout, seed, key_is_query, value_is_key) -> {d_query, d_key, "
     "d_value, grads}; saved: {q_proj, k_proj, v_proj, attn[, lse]} from layer_forward"},
    {"matmul", (PyCFunction)(void (*)(void))py_matmul, METH_VARARGS | METH_KEYWORDS,
     "matmul(a, b, trans_a=False, trans_b=False): the core's GEMM on 2-D C-contiguous arrays"},
    {"linear", (PyCFunction)(void (*)(void))py_linear, METH_VARARGS | METH_KEYWORDS,
     "linear(a, b, bias=None, act=0, trans_b=False, out=None, columns=None) -> act(a @ op(b) + bias), "
     "or out += a @ op(b) + bias; b may be pack_weight's (P, K, W), with columns=N"},
    {"pack_weight", (PyCFunction)(void (*)(void))py_pack_weight, METH_VARARGS | METH_KEYWORDS,
     "pack_weight(b, trans_b=False) -> op(b) (K, N) packed whole for linear: (ceil(N / W), K, W)"},
    {"activation", (PyCFunction)(void (*)(void))py_activation, METH_VARARGS | METH_KEYWORDS,
     "activation(x, act, out=None) -> act(x) (gated: act(x[:, :n]) * x[:, n:])"},
    {"layer_norm", (PyCFunction)(void (*)(void))py_layer_norm, METH_VARARGS | METH_KEYWORDS,
     "layer_norm(x, gain, bias, eps, out=None) -> LayerNorm of the rows of x"},
    {"rms_norm", (PyCFunction)(void (*)(void))py_rms_norm, METH_VARARGS | METH_KEYWORDS,
     "rms_norm(x, gain, eps, out=None) -> RMSNorm of the rows of x"},
    {"rope", (PyCFunction)(void (*)(void))py_rope, METH_VARARGS | METH_KEYWORDS,
     "rope(x, heads, d_head, cos, sin) -> None: rotary embedding in place"},
    {"embedding", (PyCFunction)(void (*)(void))py_embedding, METH_VARARGS | METH_KEYWORDS,
     "embedding(table, ids, out=None, accumulate=False) -> rows of table"},
    {"attention_flow", (PyCFunction)(void (*)(void))py_attention_flow, METH_VARARGS | METH_KEYWORDS,
     "attention_flow(weights (L, n, n) float64, sources=None) -> (n_sources, n) maximum flows"},
    {"dropout_uniform", py_dropout_uniform, METH_VARARGS, "dropout_uniform(seed, b, h, i, j) -> float in [0, 1)"},
    {"set_num_threads", py_set_num_threads, METH_O, "set_num_threads(n): n in 1 .. MAX_THREADS"},
    {"get_num_threads", py_get_num_threads, METH_NOARGS, "get_num_threads() -> int"},
    {"build_info", py_build_info, METH_NOARGS, "build_info() -> str"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "mha._C", "mha's C core (private).", -1,
                                    methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__C(void) {
    import_array();
    PyObject *m = PyModule_Create(&module);
    if (m && PyModule_AddIntConstant(m, "MAX_THREADS", MHA_MAX_THREADS) < 0) Py_CLEAR(m);
    return m;
}
