/* module.c: the CPython binding of the C core, `mha._C` (private; mha/_core.py is its one
 * caller inside the package, and mha/functional.py and mha/layer.py own the public API).
 *
 * Who checks what. The binding validates everything that reaches the core: each array's
 * dtype, rank, layout and sizes, and each scalar's type and range, with messages that name the
 * argument and say what was expected (the messages users see: the Python layer does not check
 * these again). Python checks only what the binding cannot see: the dtype policy (promotion,
 * float16), broadcasting, defaults, and a layer's configuration and state. The core (mha.h)
 * checks its descriptors once more for its C callers and answers with an error code.
 *
 * Every function here: parse (METH_FASTCALL: every parameter by position or by name, parse_call);
 * check; allocate the outputs while holding the GIL; release the GIL around the pure C call;
 * raise MemoryError / ValueError from the core's error code after taking the GIL back; release
 * every reference on every path.
 */
#define PY_SSIZE_T_CLEAN
#define NPY_NO_DEPRECATED_API NPY_2_0_API_VERSION
#include <Python.h>
#include <numpy/arrayobject.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "common.h" /* mha_alloc, mha_free: the scratch results are made from */
#include "mha.h"

/* ---- argument checks ---------------------------------------------------------------------- */

/* The shape of an array as a tuple, for messages (a new reference, or NULL). */
static PyObject *shape_of(PyArrayObject *a) {
    return PyArray_IntTupleFromIntp(PyArray_NDIM(a), PyArray_DIMS(a));
}

/* ValueError "<a_name> has shape (..) but <b_name> has shape (..): <why>"; returns -1. */
static int shape_mismatch(const char *a_name, PyArrayObject *a, const char *b_name, PyArrayObject *b,
                          const char *why) {
    PyObject *sa = shape_of(a), *sb = shape_of(b);
    if (sa && sb) PyErr_Format(PyExc_ValueError, "%s has shape %R but %s has shape %R: %s", a_name, sa, b_name, sb, why);
    Py_XDECREF(sa);
    Py_XDECREF(sb);
    return -1;
}

/* a must have the shape (ndim, shape), else ValueError
 * "<name> has shape (..) but <what> (..)", e.g. what = "the output of attention has shape". */
static int expect_shape(PyArrayObject *a, const char *name, int ndim, const npy_intp *shape, const char *what) {
    int same = PyArray_NDIM(a) == ndim;
    for (int i = 0; same && i < ndim; i++) same = PyArray_DIM(a, i) == shape[i];
    if (same) return 0;
    PyObject *sa = shape_of(a), *se = PyArray_IntTupleFromIntp(ndim, shape);
    if (sa && se) PyErr_Format(PyExc_ValueError, "%s has shape %R but %s %R", name, sa, what, se);
    Py_XDECREF(sa);
    Py_XDECREF(se);
    return -1;
}

/* ---- parsing -------------------------------------------------------------------------------- */

/* A function's parameters: every one may be passed by position or by name (mha._core passes
 * them by name). The names are interned on first use, so that the names of a call, interned by
 * the compiler, are found by pointer comparison: a call by keyword costs no more than one by
 * position. */
enum { MAX_PARAMS = 24 };

typedef struct {
    const char *function;
    const char *const *kwlist; /* NULL-terminated, at most MAX_PARAMS */
    int required;              /* the first `required` parameters are */
    PyObject *names[MAX_PARAMS]; /* kwlist as interned str, filled by parse_call */
} call_spec;

/* Matches a METH_FASTCALL | METH_KEYWORDS call (args[:nargs] by position, then the values of
 * kwnames) to spec's parameters: out[i] is the argument of kwlist[i] (borrowed), NULL when it
 * was not passed (out has MAX_PARAMS entries). TypeError, as Python's own, for too many, unknown,
 * repeated or missing ones. */
static int parse_call(call_spec *spec, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, PyObject **out) {
    int n = 0;
    while (spec->kwlist[n]) n++;
    if (n > MAX_PARAMS) { /* a binding's own mistake: caught by the tests, never by a user */
        PyErr_Format(PyExc_SystemError, "%s(): %d parameters, more than MAX_PARAMS", spec->function, n);
        return -1;
    }
    if (!spec->names[0])
        for (int i = 0; i < n; i++)
            if (!(spec->names[i] = PyUnicode_InternFromString(spec->kwlist[i]))) return -1;
    if (nargs > n) {
        PyErr_Format(PyExc_TypeError, "%s() takes at most %d arguments (%zd given)", spec->function, n, nargs);
        return -1;
    }
    for (int i = 0; i < n; i++) out[i] = i < nargs ? args[i] : NULL;
    const Py_ssize_t n_kw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    for (Py_ssize_t j = 0; j < n_kw; j++) {
        PyObject *key = PyTuple_GET_ITEM(kwnames, j);
        int i = 0;
        while (i < n && spec->names[i] != key) i++;
        if (i == n) /* a name built at run time: compare the text */
            for (i = 0; i < n && PyUnicode_Compare(key, spec->names[i]) != 0; i++)
                if (PyErr_Occurred()) return -1;
        if (i == n) {
            PyErr_Format(PyExc_TypeError, "%s() got an unexpected keyword argument %R", spec->function, key);
            return -1;
        }
        if (out[i]) {
            PyErr_Format(PyExc_TypeError, "%s() got multiple values for argument '%s'", spec->function, spec->kwlist[i]);
            return -1;
        }
        out[i] = args[nargs + j];
    }
    for (int i = 0; i < spec->required; i++)
        if (!out[i]) {
            PyErr_Format(PyExc_TypeError, "%s() missing required argument '%s' (pos %d)", spec->function,
                         spec->kwlist[i], i + 1);
            return -1;
        }
    return 0;
}

#define OR_NONE(obj) ((obj) ? (obj) : Py_None)

/* An integer argument (anything with __index__); NULL (omitted) keeps *value. */
static int get_ssize(PyObject *obj, const char *name, Py_ssize_t *value) {
    if (!obj) return 0;
    PyObject *n = PyNumber_Index(obj);
    if (!n) {
        PyErr_Format(PyExc_TypeError, "%s must be an int, not %.100s", name, Py_TYPE(obj)->tp_name);
        return -1;
    }
    *value = PyLong_AsSsize_t(n); /* OverflowError past Py_ssize_t */
    Py_DECREF(n);
    return *value == -1 && PyErr_Occurred() ? -1 : 0;
}

/* A real-valued argument (not a bool, complex, string or array); NULL keeps *value. */
static int get_double(PyObject *obj, const char *name, double *value) {
    if (!obj) return 0;
    double v = -1.0;
    int bad = PyBool_Check(obj) || PyArray_IsScalar(obj, Bool) || PyComplex_Check(obj) ||
              PyArray_IsScalar(obj, ComplexFloating) || PyUnicode_Check(obj) || PyBytes_Check(obj) ||
              (PyArray_Check(obj) && PyArray_NDIM((PyArrayObject *)obj) != 0);
    if (!bad) v = PyFloat_AsDouble(obj);
    if (bad || (v == -1.0 && PyErr_Occurred())) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s must be a real number, not %.100s %.200R", name, Py_TYPE(obj)->tp_name, obj);
        return -1;
    }
    *value = v;
    return 0;
}

static const char *type_name(int typenum) {
    return typenum == NPY_FLOAT32 ? "float32" : typenum == NPY_FLOAT64 ? "float64" : typenum == NPY_BOOL ? "bool"
         : typenum == NPY_UINT16 ? "uint16" : typenum == NPY_UINT8 ? "uint8" : "int64";
}

/* obj must be an ndarray of dtype typenum and rank ndim (any rank for ndim < 0). */
static PyArrayObject *get_typed(PyObject *obj, const char *name, int typenum, int ndim) {
    if (!PyArray_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s must be a numpy array, not %.100s", name, Py_TYPE(obj)->tp_name);
        return NULL;
    }
    PyArrayObject *a = (PyArrayObject *)obj;
    if (PyArray_TYPE(a) != typenum) {
        PyErr_Format(PyExc_TypeError, "%s has dtype %S but %s was expected", name, (PyObject *)PyArray_DESCR(a),
                     type_name(typenum));
        return NULL;
    }
    if (ndim >= 0 && PyArray_NDIM(a) != ndim) {
        PyObject *shape = shape_of(a);
        if (shape) PyErr_Format(PyExc_ValueError, "%s has shape %R but %d dimensions were expected", name, shape, ndim);
        Py_XDECREF(shape);
        return NULL;
    }
    return a;
}

/* obj must be a C-contiguous, aligned ndarray in native byte order, of dtype typenum and rank
 * ndim (any rank for ndim < 0). */
static PyArrayObject *get_array(PyObject *obj, const char *name, int typenum, int ndim) {
    PyArrayObject *a = get_typed(obj, name, typenum, ndim);
    if (a && (!PyArray_IS_C_CONTIGUOUS(a) || !PyArray_ISALIGNED(a) || !PyArray_ISNOTSWAPPED(a))) {
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

/* obj must be an aligned ndarray in native byte order, of dtype typenum and rank ndim (any for
 * ndim < 0), whose last axis is contiguous and whose other strides are non-negative multiples
 * of the item size: a view the core can read through an mha_view, such as the (B, H, n, d)
 * heads of a (B, n, 3 * H * d) projection. */
static PyArrayObject *get_view(PyObject *obj, const char *name, int typenum, int ndim) {
    PyArrayObject *a = get_typed(obj, name, typenum, ndim);
    if (!a || PyArray_SIZE(a) == 0) return a; /* nothing is read: any strides will do */
    const npy_intp item = PyArray_ITEMSIZE(a);
    const int nd = PyArray_NDIM(a);
    int ok = PyArray_ISALIGNED(a) && PyArray_ISNOTSWAPPED(a) &&
             (nd == 0 || PyArray_DIM(a, nd - 1) <= 1 || PyArray_STRIDE(a, nd - 1) == item);
    for (int i = 0; i < nd; i++) ok = ok && PyArray_STRIDE(a, i) >= 0 && PyArray_STRIDE(a, i) % item == 0;
    if (!ok) {
        PyErr_Format(PyExc_ValueError, "%s must be aligned, in native byte order, with a contiguous last "
                     "axis and non-negative strides", name);
        return NULL;
    }
    return a;
}

/* The element strides of a (n, d), (B, n, d) or (B, H, n, d) view (get_view) along its batch,
 * head and row axes; 0 for an axis the rank lacks (its size is 1). */
static mha_view view_of(PyArrayObject *a) {
    const npy_intp item = PyArray_ITEMSIZE(a);
    const int nd = PyArray_NDIM(a);
    return (mha_view){nd >= 3 ? PyArray_STRIDE(a, 0) / item : 0, nd == 4 ? PyArray_STRIDE(a, 1) / item : 0,
                      PyArray_STRIDE(a, nd - 2) / item};
}

/* A flag: a bool or an integer (Python or NumPy); NULL (omitted) keeps *value. */
static int get_flag(PyObject *obj, const char *name, int *value) {
    if (!obj) return 0;
    if (!(PyBool_Check(obj) || PyLong_Check(obj) || PyArray_IsScalar(obj, Bool) || PyArray_IsScalar(obj, Integer))) {
        PyErr_Format(PyExc_TypeError, "%s must be a bool, not %.100s", name, Py_TYPE(obj)->tp_name);
        return -1;
    }
    int t = PyObject_IsTrue(obj);
    if (t < 0) return -1;
    *value = t;
    return 0;
}

/* The scale argument: omitted (NULL) or None keeps *scale (the descriptor's 1/sqrt(d_k), or 1
 * when d_k = 0); else a real number. */
static int get_scale(PyObject *obj, double *scale) {
    return obj == Py_None ? 0 : get_double(obj, "scale", scale);
}

/* A dropout probability in [0, 1) (p = 1 would divide by 1 - p = 0); NULL keeps *p. */
static int get_dropout(PyObject *obj, double *p) {
    double value = 0;
    if (!obj) return 0;
    if (get_double(obj, "dropout", &value)) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "dropout must be a number in [0, 1), not %.100s %.200R", Py_TYPE(obj)->tp_name, obj);
        return -1;
    }
    if (!(value >= 0 && value < 1)) {
        PyErr_Format(PyExc_ValueError, "dropout must be in [0, 1), got %.200R", obj);
        return -1;
    }
    *p = value;
    return 0;
}

/* A soft-cap: a finite number >= 0 (0: off); NULL or None keeps *c (0). The messages are
 * mha.checks.softcap's (the NumPy reference's check). */
static int get_softcap(PyObject *obj, double *c) {
    double value = 0;
    if (!obj || obj == Py_None) return 0;
    if (get_double(obj, "softcap", &value)) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "softcap must be a positive real number (or None), not %.100s %.200R",
                     Py_TYPE(obj)->tp_name, obj);
        return -1;
    }
    if (!(value >= 0 && value < INFINITY)) {
        PyErr_Format(PyExc_ValueError, "softcap must be a positive finite number (the cap c of c * tanh(s / c)), "
                     "or None or 0 for no cap; got %.200R", obj);
        return -1;
    }
    *c = value;
    return 0;
}

/* A dropout seed: an int in [0, 2**64) (bools and floats refused), or None / omitted (NULL):
 * *given = 0, *seed = 0. */
static int get_seed(PyObject *obj, unsigned long long *seed, int *given) {
    *seed = 0;
    *given = obj && obj != Py_None;
    if (!*given) return 0;
    if (PyBool_Check(obj) || PyArray_IsScalar(obj, Bool) || !(PyLong_Check(obj) || PyArray_IsScalar(obj, Integer))) {
        PyErr_Format(PyExc_TypeError, "seed must be an int, not %.100s", Py_TYPE(obj)->tp_name);
        return -1;
    }
    PyObject *n = PyNumber_Index(obj);
    if (!n) return -1;
    *seed = PyLong_AsUnsignedLongLong(n); /* OverflowError for a negative or too large n */
    Py_DECREF(n);
    if (PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "seed must be in [0, 2**64), got %.200R", obj);
        return -1;
    }
    return 0;
}

/* a must have the shape (ndim, shape): "<name> has shape (..) but expected (..)". */
static int check_shape(PyArrayObject *a, const char *name, int ndim, const npy_intp *shape) {
    return expect_shape(a, name, ndim, shape, "expected");
}

static int raise_core_error(int err) {
    if (err == MHA_ENOMEM) PyErr_SetString(PyExc_MemoryError, "mha: not enough memory for the scratch buffers");
    else if (err) PyErr_Format(PyExc_ValueError, "mha: the core rejected its arguments (error %d)", err);
    return err ? -1 : 0;
}

static void free_block(PyObject *capsule) { mha_free(PyCapsule_GetPointer(capsule, "mha.block")); }

/* A new C-contiguous array, zeroed with `zero`. With `block`, or from MHA_SCRATCH_KEEP_MIN
 * bytes, its data is the core's scratch memory (mha_alloc: 64-byte aligned; a capsule base
 * gives it back to mha_free when the array goes): a result dropped after a call is then taken
 * again by the next call's, where NumPy's own memory, from glibc, would be mapped anew and
 * faulted in every time (the layer's forward and backward at the seed shape: about 1,300 page
 * faults a step). Packings are block arrays whatever their size: NumPy aligns its arrays to
 * 16 bytes only, and a 32-byte load that straddles two cache lines (every other load of a
 * panel row at an address 16 or 48 past a line) costs the AVX2 micro-kernel about a tenth of
 * its speed. */
static PyArrayObject *make_array(int ndim, const npy_intp *shape, int typenum, int zero, int block) {
    PyArray_Descr *descr = PyArray_DescrFromType(typenum); /* a new reference, which NewFromDescr steals */
    if (!descr) return NULL;
    int ok = 1;
    size_t bytes = (size_t)PyDataType_ELSIZE(descr);
    for (int i = 0; i < ndim; i++) bytes = mha_mul_size(bytes, (size_t)shape[i], &ok);
    /* past what an array can address, NumPy's own check raises "array is too big" */
    if (!ok || bytes > (size_t)NPY_MAX_INTP || (!block && bytes < MHA_SCRATCH_KEEP_MIN)) {
        Py_DECREF(descr);
        return (PyArrayObject *)(zero ? PyArray_ZEROS(ndim, (npy_intp *)shape, typenum, 0)
                                      : PyArray_SimpleNew(ndim, (npy_intp *)shape, typenum));
    }
    void *data = mha_alloc(bytes);
    if (!data) {
        Py_DECREF(descr);
        return (PyArrayObject *)PyErr_NoMemory();
    }
    if (zero) memset(data, 0, bytes);
    PyObject *capsule = PyCapsule_New(data, "mha.block", free_block);
    if (!capsule) {
        mha_free(data);
        Py_DECREF(descr);
        return NULL;
    }
    PyArrayObject *a = (PyArrayObject *)PyArray_NewFromDescr(&PyArray_Type, descr, ndim, (npy_intp *)shape,
                                                             NULL, data, NPY_ARRAY_CARRAY, NULL);
    if (!a || PyArray_SetBaseObject(a, capsule) < 0) { /* SetBaseObject steals the capsule */
        Py_XDECREF(a);
        if (!a) Py_DECREF(capsule);
        return NULL;
    }
    return a;
}

/* A result (NumPy's memory below MHA_SCRATCH_KEEP_MIN bytes), and a packing (always a block). */
static PyArrayObject *new_array(int ndim, const npy_intp *shape, int typenum, int zero) {
    return make_array(ndim, shape, typenum, zero, 0);
}

static PyArrayObject *new_block_array(int ndim, const npy_intp *shape, int typenum, int zero) {
    return make_array(ndim, shape, typenum, zero, 1);
}

/* The float dtype of the call, from its first array (every other float array must match it). */
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

/* The shapes of an attention call of rank 2, 3 or 4: q (..., n_q, d_k) and what comes out. */
typedef struct {
    int rank;
    npy_intp out[4];    /* q.shape[:-1] + (d_v,)                 */
    npy_intp scores[4]; /* q.shape[:-2] + (n_q, n_k): the weights */
} attention_shapes;

/* Fills the mask, key padding, causal, scale and dropout fields of d (sizes already set).
 * mask: None, or an array of the scores' shape (rank r, any strides: broadcast views), bool or
 * of the call's float dtype. key_padding: None or bool (B, n_k) C-contiguous. seed_given: a
 * seed was passed (dropout > 0 needs one). */
static int fill_masks(mha_attention_desc *d, const attention_shapes *s, int typenum, PyObject *mask_obj,
                      PyObject *kp_obj, int causal, double scale, double dropout, unsigned long long seed,
                      int seed_given, const char *seed_message) {
    d->causal = causal;
    d->scale = scale;
    d->dropout = dropout;
    d->seed = (uint64_t)seed;
    if (dropout > 0 && !seed_given) {
        PyErr_SetString(PyExc_ValueError, seed_message);
        return -1;
    }
    if (mask_obj != Py_None) {
        if (!PyArray_Check(mask_obj)) {
            PyErr_Format(PyExc_TypeError, "mask must be a numpy array, not %.100s", Py_TYPE(mask_obj)->tp_name);
            return -1;
        }
        PyArrayObject *m = (PyArrayObject *)mask_obj;
        int t = PyArray_TYPE(m);
        if (t != NPY_BOOL && t != typenum) {
            PyErr_Format(PyExc_TypeError, "mask must be bool or of the inputs' float dtype (%s), not %S",
                         type_name(typenum), (PyObject *)PyArray_DESCR(m));
            return -1;
        }
        if (expect_shape(m, "mask", s->rank, s->scores, "the scores (..., n_q, n_k) have shape")) return -1;
        npy_intp item = PyArray_ITEMSIZE(m);
        if (!PyArray_ISALIGNED(m) || !PyArray_ISNOTSWAPPED(m)) {
            PyErr_SetString(PyExc_ValueError, "mask must be aligned and in native byte order");
            return -1;
        }
        /* the axes of (B, H, n_q, n_k) that the mask's axes are: (B, n_q, n_k) lacks H, (n_q,
         * n_k) B and H too (those are of size 1: stride 0) */
        static const int AXES[3][4] = {{2, 3}, {0, 2, 3}, {0, 1, 2, 3}};
        for (int i = 0; i < 4; i++) d->mask_strides[i] = 0;
        for (int i = 0; i < s->rank; i++) {
            npy_intp stride = PyArray_STRIDE(m, i);
            if (stride % item) {
                PyErr_SetString(PyExc_ValueError, "mask strides must be multiples of its item size");
                return -1;
            }
            d->mask_strides[AXES[s->rank - 2][i]] = s->scores[i] > 1 ? (int64_t)(stride / item) : 0;
        }
        d->mask = PyArray_DATA(m);
        d->mask_kind = t == NPY_BOOL ? MHA_MASK_BOOL : MHA_MASK_FLOAT;
    }
    if (kp_obj != Py_None) {
        PyArrayObject *kp = get_array(kp_obj, "key_padding_mask", NPY_BOOL, -1);
        npy_intp shape[2] = {d->batch, d->n_k};
        if (!kp || expect_shape(kp, "key_padding_mask", 2, shape, "(batch, n_k) is")) return -1;
        d->key_padding = (const uint8_t *)PyArray_DATA(kp);
        d->key_padding_stride = d->n_k;
    }
    return 0;
}

/* q (..., n_q, d_k), k (..., n_k, d_k), v (..., n_k, d_v) of one rank, 2 (n, d), 3 (B, n, d) or
 * 4 (B, H, n, d) with k and v of H_kv heads dividing H: checks them against each other, fills
 * the sizes and views of d and the shapes s. views: q, k, v may be strided views (get_view;
 * the forward only reads them), else they must be C-contiguous (the backward writes dq, dk,
 * dv through the same views). */
static int attention_args(mha_attention_desc *d, attention_shapes *s, int typenum, int views, PyObject *q_obj,
                          PyObject *k_obj, PyObject *v_obj, PyArrayObject **q, PyArrayObject **k,
                          PyArrayObject **v) {
    PyArrayObject *(*get)(PyObject *, const char *, int, int) = views ? get_view : get_array;
    if (!(*q = get(q_obj, "q", typenum, -1)) || !(*k = get(k_obj, "k", typenum, -1)) ||
        !(*v = get(v_obj, "v", typenum, -1)))
        return -1;
    const int r = PyArray_NDIM(*q);
    if (r < 2 || r > 4) {
        PyObject *shape = shape_of(*q);
        if (shape) PyErr_Format(PyExc_ValueError, "q must have 2, 3 or 4 dimensions (..., n_q, d_k), got shape %R", shape);
        Py_XDECREF(shape);
        return -1;
    }
    if (PyArray_NDIM(*k) != r) return shape_mismatch("q", *q, "k", *k, "they must have the same rank");
    if (PyArray_NDIM(*v) != r) return shape_mismatch("q", *q, "v", *v, "they must have the same rank");
    const npy_intp n_q = PyArray_DIM(*q, r - 2), d_k = PyArray_DIM(*q, r - 1);
    const npy_intp n_k = PyArray_DIM(*k, r - 2), d_v = PyArray_DIM(*v, r - 1);
    if (PyArray_DIM(*k, r - 1) != d_k) return shape_mismatch("q", *q, "k", *k, "d_k must match");
    if (PyArray_DIM(*v, r - 2) != n_k) return shape_mismatch("k", *k, "v", *v, "n_k must match");
    npy_intp B = 1, H = 1, H_kv = 1;
    if (r >= 3) {
        B = PyArray_DIM(*q, 0);
        if (PyArray_DIM(*k, 0) != B) return shape_mismatch("q", *q, "k", *k, "the batch size must match");
        if (PyArray_DIM(*v, 0) != B) return shape_mismatch("q", *q, "v", *v, "the batch size must match");
    }
    if (r == 4) {
        H = PyArray_DIM(*q, 1);
        H_kv = PyArray_DIM(*k, 1);
        if (PyArray_DIM(*v, 1) != H_kv) return shape_mismatch("k", *k, "v", *v, "the number of heads must match");
        if (H_kv == 0 ? H != 0 : H % H_kv != 0) {
            char why[160];
            snprintf(why, sizeof why, "k's %zd heads must divide q's %zd heads (grouped-query attention)",
                     (Py_ssize_t)H_kv, (Py_ssize_t)H);
            return shape_mismatch("q", *q, "k", *k, why);
        }
    }
    s->rank = r;
    for (int i = 0; i < r - 1; i++) s->out[i] = s->scores[i] = PyArray_DIM(*q, i);
    s->out[r - 1] = d_v;
    s->scores[r - 1] = n_k;
    mha_attention_desc_init(d, B, H, H_kv, n_q, n_k, d_k, d_v);
    if (views) { /* an empty array keeps the contiguous view: it is never read */
        if (PyArray_SIZE(*q)) d->q = view_of(*q);
        if (PyArray_SIZE(*k)) d->k = view_of(*k);
        if (PyArray_SIZE(*v)) d->v = view_of(*v);
    }
    return 0;
}

/* The data pointer of an optional array. */
#define DATA_OR_NULL(a) ((a) ? PyArray_DATA(a) : NULL)

/* The scalar arguments of an attention call, as parsed ("O": checked here, so that every
 * message names its argument). */
typedef struct {
    PyObject *causal, *scale, *dropout, *seed, *softcap;
} attention_scalars;

static int attention_options(mha_attention_desc *d, const attention_shapes *s, int typenum, PyObject *mask_obj,
                             PyObject *kp_obj, const attention_scalars *a, const char *seed_message) {
    int causal = 0, seed_given;
    double scale = d->scale, dropout = 0, softcap = 0;
    unsigned long long seed;
    if (get_flag(a->causal, "causal", &causal) || get_scale(a->scale, &scale) || get_dropout(a->dropout, &dropout) ||
        get_seed(a->seed, &seed, &seed_given) || get_softcap(a->softcap, &softcap))
        return -1;
    d->softcap = softcap;
    return fill_masks(d, s, typenum, mask_obj, kp_obj, causal, scale, dropout, seed, seed_given, seed_message);
}

/* ---- attention ---------------------------------------------------------------------------- */

/* The row statistics by name (mha_row_stats's fields in order): the keys of the dict that
 * attention_forward returns with row_stats. */
enum { N_ROW_STATS = 8, ROW_STAT_ARGMAX = 2, ROW_STAT_KEY_SET = 3 };
static const char *const ROW_STAT_NAMES[N_ROW_STATS] = {"entropy", "max", "argmax", "key_set_mass",
                                                        "self", "prev", "next", "distance"};

/* row_stats: NULL or None (none asked), or a sequence of names from ROW_STAT_NAMES; asked[i]
 * = whether statistic i is. */
static int parse_row_stats(PyObject *obj, int asked[N_ROW_STATS]) {
    for (int i = 0; i < N_ROW_STATS; i++) asked[i] = 0;
    if (!obj || obj == Py_None) return 0;
    if (PyUnicode_Check(obj) || !PySequence_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "row_stats must be a sequence of names, not %.100s", Py_TYPE(obj)->tp_name);
        return -1;
    }
    PyObject *seq = PySequence_Fast(obj, "row_stats must be a sequence of names");
    if (!seq) return -1;
    int status = 0;
    for (Py_ssize_t n = 0; n < PySequence_Fast_GET_SIZE(seq) && status == 0; n++) {
        PyObject *name = PySequence_Fast_GET_ITEM(seq, n);
        int i = 0;
        while (i < N_ROW_STATS && !(PyUnicode_Check(name) && PyUnicode_CompareWithASCIIString(name, ROW_STAT_NAMES[i]) == 0))
            i++;
        if (i < N_ROW_STATS) {
            asked[i] = 1;
            continue;
        }
        PyErr_Format(PyExc_ValueError, "row_stats: unknown statistic %.200R; expected names from 'entropy', 'max', "
                     "'argmax', 'key_set_mass', 'self', 'prev', 'next', 'distance'", name);
        status = -1;
    }
    Py_DECREF(seq);
    return status;
}

/* Fills stats (of the call's dtype) with the key set and the data of the arrays asked for. */
#define FILL_ROW_STATS(stats, T, arrays, key_set, key_set_stride)                                    \
    do {                                                                                        \
        T *f_[N_ROW_STATS];                                                                     \
        for (int i_ = 0; i_ < N_ROW_STATS; i_++) f_[i_] = (arrays)[i_] ? PyArray_DATA((arrays)[i_]) : NULL; \
        (stats).entropy = f_[0], (stats).max_weight = f_[1];                                    \
        (stats).argmax = (arrays)[ROW_STAT_ARGMAX] ? PyArray_DATA((arrays)[ROW_STAT_ARGMAX]) : NULL; \
        (stats).key_set_mass = f_[3], (stats).self_weight = f_[4], (stats).prev_weight = f_[5];  \
        (stats).next_weight = f_[6], (stats).distance = f_[7];                                  \
        (stats).key_set = (key_set), (stats).key_set_stride = (key_set_stride);                 \
    } while (0)

/* key_set: None, or bool (n_k,) or (batch, n_k) C-contiguous (batch 1 for a 2-D call), given
 * exactly when 'key_set_mass' is asked. Sets *data and *stride (0 for one set of every batch). */
static int get_key_set(PyObject *obj, const mha_attention_desc *d, int asked, const uint8_t **data, int64_t *stride) {
    *data = NULL;
    *stride = 0;
    if (obj == Py_None) {
        if (!asked) return 0;
        PyErr_SetString(PyExc_ValueError, "row_stats asks for 'key_set_mass' but key_set is None: give a bool "
                        "array (n_k,) or (batch, n_k), True for the keys of the set");
        return -1;
    }
    if (!asked) {
        PyErr_SetString(PyExc_ValueError, "key_set is given but row_stats does not ask for 'key_set_mass'");
        return -1;
    }
    PyArrayObject *ks = get_array(obj, "key_set", NPY_BOOL, -1);
    if (!ks) return -1;
    const int nd = PyArray_NDIM(ks);
    if (!((nd == 1 && PyArray_DIM(ks, 0) == d->n_k) ||
          (nd == 2 && PyArray_DIM(ks, 0) == d->batch && PyArray_DIM(ks, 1) == d->n_k))) {
        PyObject *shape = shape_of(ks);
        if (shape)
            PyErr_Format(PyExc_ValueError, "key_set has shape %R but (n_k,) = (%zd,) or (batch, n_k) = (%zd, %zd) "
                         "was expected", shape, (Py_ssize_t)d->n_k, (Py_ssize_t)d->batch, (Py_ssize_t)d->n_k);
        Py_XDECREF(shape);
        return -1;
    }
    *data = (const uint8_t *)PyArray_DATA(ks);
    *stride = nd == 2 ? d->n_k : 0;
    return 0;
}

/* A dict {name: array} of the statistics asked for; steals the arrays' references (NULL on
 * error, every reference released). */
static PyObject *row_stats_dict(PyArrayObject *arrays[N_ROW_STATS]) {
    PyObject *dict = PyDict_New();
    for (int i = 0; i < N_ROW_STATS; i++) {
        if (!arrays[i]) continue;
        if (dict && PyDict_SetItemString(dict, ROW_STAT_NAMES[i], (PyObject *)arrays[i])) Py_CLEAR(dict);
        Py_CLEAR(arrays[i]);
    }
    return dict;
}

static const char *const attention_kw[] = {"q", "k", "v", "mask", "key_padding_mask", "causal", "scale",
                                           "dropout", "seed", "need_weights", "return_lse", "out",
                                           "weights_out", "row_stats", "key_set", "scores_out", "softcap", NULL};
static call_spec attention_spec = {"attention_forward", attention_kw, 3, {NULL}};

/* -> (out, weights|None), or (out, weights|None, lse) with return_lse, then {name: stats} with
 * row_stats; out (..., n_q, d_v), weights (..., n_q, n_k), lse and each statistic (..., n_q)
 * (argmax int64, the others the call's dtype) for q (..., n_q, d_k) of rank 2, 3 or 4.
 * row_stats: None or a sequence of names (ROW_STAT_NAMES); key_set: bool (n_k,) or (B, n_k),
 * exactly when 'key_set_mass' is asked.
 * q, k, v: strided views are read in place (get_view). out: None, or a writable view of the
 * output's shape to write into (get_view: e.g. the heads of a (B, n_q, H * d_v) buffer, so that
 * they need no merging); weights_out: None, or a C-contiguous array of the weights' shape (with
 * need_weights). scores_out: None, or a C-contiguous array of the weights' shape (with
 * need_weights) that receives the masked, scaled scores (-inf where masked; soft-capped
 * first with softcap); not returned. softcap: a finite number >= 0, 0 (or None) off; c > 0
 * turns each score s into c tanh(s / c) before the masks (get_softcap).
 * What is written into is what is returned. */
static PyObject *py_attention_forward(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    (void)self;
    PyObject *a[MAX_PARAMS];
    if (parse_call(&attention_spec, args, nargs, kwnames, a)) return NULL;
    PyObject *q_obj = a[0], *k_obj = a[1], *v_obj = a[2], *mask_obj = OR_NONE(a[3]), *kp_obj = OR_NONE(a[4]);
    attention_scalars sc = {a[5], a[6], a[7], a[8], a[16]};
    PyObject *need_obj = a[9], *lse_obj = a[10], *out_obj = OR_NONE(a[11]), *w_obj = OR_NONE(a[12]);
    PyObject *stats_obj = a[13], *ks_obj = OR_NONE(a[14]), *scores_obj = OR_NONE(a[15]);
    int typenum = float_type(q_obj, "q"), need_weights = 1, return_lse = 0, asked[N_ROW_STATS];
    if (typenum < 0 || get_flag(need_obj, "need_weights", &need_weights) || get_flag(lse_obj, "return_lse", &return_lse) ||
        parse_row_stats(stats_obj, asked))
        return NULL;
    const int want_stats = stats_obj && stats_obj != Py_None;
    PyArrayObject *q, *k, *v, *out = NULL, *weights = NULL, *lse = NULL, *scores = NULL;
    PyArrayObject *stat_arrays[N_ROW_STATS] = {NULL};
    mha_attention_desc d;
    attention_shapes s;
    const uint8_t *key_set;
    int64_t key_set_stride;
    if (attention_args(&d, &s, typenum, 1, q_obj, k_obj, v_obj, &q, &k, &v) ||
        attention_options(&d, &s, typenum, mask_obj, kp_obj, &sc, "dropout > 0 needs a seed") ||
        get_key_set(ks_obj, &d, asked[ROW_STAT_KEY_SET], &key_set, &key_set_stride))
        return NULL;
    if (out_obj != Py_None) {
        PyArrayObject *o = get_view(out_obj, "out", typenum, -1);
        if (!o || expect_shape(o, "out", s.rank, s.out, "the output of attention has shape")) return NULL;
        if (!PyArray_ISWRITEABLE(o)) {
            PyErr_SetString(PyExc_ValueError, "out is read-only, but the core writes into it");
            return NULL;
        }
        Py_INCREF(o);
        out = o;
        if (PyArray_SIZE(o)) d.out = view_of(o);
    } else if (!(out = new_array(s.rank, s.out, typenum, 0))) goto fail;
    if (need_weights && w_obj != Py_None) {
        PyArrayObject *w = get_output_array(w_obj, "weights_out", typenum, -1);
        if (!w || expect_shape(w, "weights_out", s.rank, s.scores, "the weights have shape")) goto fail;
        Py_INCREF(w);
        weights = w;
    } else if (need_weights && !(weights = new_array(s.rank, s.scores, typenum, 0))) goto fail;
    if (scores_obj != Py_None) {
        if (!need_weights) {
            PyErr_SetString(PyExc_ValueError, "scores_out needs need_weights=True");
            goto fail;
        }
        if (!(scores = get_output_array(scores_obj, "scores_out", typenum, -1)) ||
            expect_shape(scores, "scores_out", s.rank, s.scores, "the scores have shape"))
            goto fail;
        d.scores = PyArray_DATA(scores);
    }
    if (return_lse && !(lse = new_array(s.rank - 1, s.out, typenum, 0))) goto fail; /* (..., n_q) */
    for (int i = 0; i < N_ROW_STATS; i++) /* (..., n_q) */
        if (asked[i] && !(stat_arrays[i] = new_array(s.rank - 1, s.out, i == ROW_STAT_ARGMAX ? NPY_INT64 : typenum, 0)))
            goto fail;
    mha_row_stats_f32 stats32;
    mha_row_stats_f64 stats64;
    FILL_ROW_STATS(stats32, float, stat_arrays, key_set, key_set_stride);
    FILL_ROW_STATS(stats64, double, stat_arrays, key_set, key_set_stride);
    int err;
    Py_BEGIN_ALLOW_THREADS
    if (typenum == NPY_FLOAT32)
        err = mha_attention_forward_stats_f32(PyArray_DATA(out), DATA_OR_NULL(weights), DATA_OR_NULL(lse),
                                              want_stats ? &stats32 : NULL, PyArray_DATA(q), PyArray_DATA(k),
                                              PyArray_DATA(v), &d);
    else
        err = mha_attention_forward_stats_f64(PyArray_DATA(out), DATA_OR_NULL(weights), DATA_OR_NULL(lse),
                                              want_stats ? &stats64 : NULL, PyArray_DATA(q), PyArray_DATA(k),
                                              PyArray_DATA(v), &d);
    Py_END_ALLOW_THREADS
    if (raise_core_error(err)) goto fail;
    PyObject *w = weights ? (PyObject *)weights : Py_None, *stats = NULL;
    if (want_stats && !(stats = row_stats_dict(stat_arrays))) goto fail;
    if (!weights) Py_INCREF(Py_None);
    if (lse && stats) return Py_BuildValue("(NNNN)", out, w, lse, stats);
    if (lse) return Py_BuildValue("(NNN)", out, w, lse);
    if (stats) return Py_BuildValue("(NNN)", out, w, stats);
    return Py_BuildValue("(NN)", out, w);
fail:
    Py_XDECREF(out);
    Py_XDECREF(weights);
    Py_XDECREF(lse);
    for (int i = 0; i < N_ROW_STATS; i++) Py_XDECREF(stat_arrays[i]);
    return NULL;
}

static const char *const attention_backward_kw[] = {"d_out", "q", "k", "v", "mask", "key_padding_mask",
                                                    "causal", "scale", "dropout", "seed", "out", "lse", "softcap",
                                                    NULL};
static call_spec attention_backward_spec = {"attention_backward", attention_backward_kw, 4, {NULL}};

/* -> (dq, dk, dv) shaped like q, k, v. out and lse: the forward's output (like d_out) and
 * log-sum-exp (..., n_q), both or neither (then the forward runs again inside). */
static PyObject *py_attention_backward(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    (void)self;
    PyObject *a[MAX_PARAMS];
    if (parse_call(&attention_backward_spec, args, nargs, kwnames, a)) return NULL;
    PyObject *do_obj = a[0], *q_obj = a[1], *k_obj = a[2], *v_obj = a[3], *mask_obj = OR_NONE(a[4]);
    PyObject *kp_obj = OR_NONE(a[5]), *o_obj = OR_NONE(a[10]), *lse_obj = OR_NONE(a[11]);
    attention_scalars sc = {a[6], a[7], a[8], a[9], a[12]};
    int typenum = float_type(q_obj, "q");
    if (typenum < 0) return NULL;
    PyArrayObject *q, *k, *v, *d_out, *o = NULL, *lse = NULL, *dq = NULL, *dk = NULL, *dv = NULL;
    mha_attention_desc d;
    attention_shapes s;
    if (attention_args(&d, &s, typenum, 0, q_obj, k_obj, v_obj, &q, &k, &v) ||
        attention_options(&d, &s, typenum, mask_obj, kp_obj, &sc,
                          "attention_backward with dropout > 0 needs the seed the forward used (seed=None)"))
        return NULL;
    if (!(d_out = get_array(do_obj, "d_out", typenum, -1)) ||
        expect_shape(d_out, "d_out", s.rank, s.out, "the output of attention has shape"))
        return NULL;
    if ((o_obj == Py_None) != (lse_obj == Py_None)) {
        PyErr_SetString(PyExc_ValueError, "give both out and lse from attention(..., return_lse=True), or neither");
        return NULL;
    }
    if (o_obj != Py_None) {
        if (!(o = get_array(o_obj, "out", typenum, -1)) ||
            expect_shape(o, "out", s.rank, s.out, "the output of attention has shape") ||
            !(lse = get_array(lse_obj, "lse", typenum, -1)) ||
            expect_shape(lse, "lse", s.rank - 1, s.out, "attention's lse has shape"))
            return NULL;
    }
    if (!(dq = new_array(s.rank, PyArray_DIMS(q), typenum, 0)) ||
        !(dk = new_array(s.rank, PyArray_DIMS(k), typenum, 0)) ||
        !(dv = new_array(s.rank, PyArray_DIMS(v), typenum, 0)))
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
        PyErr_Format(PyExc_ValueError, "heads, kv_heads, d_head must be positive with kv_heads dividing heads, "
                     "got heads=%zd, kv_heads=%zd, d_head=%zd", heads, kv_heads, d_head);
        return -1;
    }
    if (heads > PY_SSIZE_T_MAX / d_head) {
        PyErr_SetString(PyExc_ValueError, "heads * d_head does not fit in an array axis");
        return -1;
    }
    return 0;
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
 * cols VECTOR for a vector) in terms of the layer's sizes. W_q, W_k, W_v come first: their
 * rows give d_model, kdim and vdim, which the inputs and W_o are checked against. */
enum { D_MODEL, KDIM, VDIM, E_Q, E_KV, HEADS, VECTOR };
static const struct {
    const char *name, *shape;
    size_t field;
    int required, rows, cols;
} LAYER_PARAMS[] = {
    {"W_q", "(d_model, n_heads*d_head)", offsetof(layer_arrays, W_q), 1, D_MODEL, E_Q},
    {"W_k", "(kdim, n_kv_heads*d_head)", offsetof(layer_arrays, W_k), 1, KDIM, E_KV},
    {"W_v", "(vdim, n_kv_heads*d_head)", offsetof(layer_arrays, W_v), 1, VDIM, E_KV},
    {"W_o", "(n_heads*d_head, d_model)", offsetof(layer_arrays, W_o), 1, E_Q, D_MODEL},
    {"b_q", "(n_heads*d_head,)", offsetof(layer_arrays, b_q), 0, E_Q, VECTOR},
    {"b_k", "(n_kv_heads*d_head,)", offsetof(layer_arrays, b_k), 0, E_KV, VECTOR},
    {"b_v", "(n_kv_heads*d_head,)", offsetof(layer_arrays, b_v), 0, E_KV, VECTOR},
    {"b_o", "(d_model,)", offsetof(layer_arrays, b_o), 0, D_MODEL, VECTOR},
    {"head_mask", "(n_heads,)", offsetof(layer_arrays, head_mask), 0, HEADS, VECTOR},
};
enum { N_LAYER_PARAMS = sizeof LAYER_PARAMS / sizeof LAYER_PARAMS[0] };

#define FIELD(arrays, i) (*(PyArrayObject **)((char *)(arrays) + LAYER_PARAMS[i].field))

/* Where the size `which` lives: in m, or in the products E_q, E_kv and the head count. */
static int64_t *layer_size(int which, mha_layer_dims *m, int64_t *E_q, int64_t *E_kv, int64_t *heads) {
    switch (which) {
    case D_MODEL: return &m->d_model;
    case KDIM: return &m->kdim;
    case VDIM: return &m->vdim;
    case E_Q: return E_q;
    case E_KV: return E_kv;
    case HEADS: return heads;
    default: return NULL;
    }
}

/* params: a dict {name: array} of W_q, W_k, W_v, W_o (required) and b_q, b_k, b_v, b_o,
 * head_mask (absent or None: no bias / all ones; a head mask of all ones is left out too, the
 * identity the core then skips). Checks dtypes and shapes against the head sizes in m and
 * fills m's d_model, kdim, vdim from W_q's, W_k's, W_v's rows; the pointers stay valid while
 * params is alive. */
static int layer_params(layer_arrays *la, PyObject *params, int typenum, mha_layer_dims *m) {
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
    int64_t E_q = m->heads * m->d_head, E_kv = m->kv_heads * m->d_head, heads = m->heads;
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
        if (!a) return -1;
        if (i < 3) *layer_size(LAYER_PARAMS[i].rows, m, &E_q, &E_kv, &heads) = PyArray_DIM(a, 0); /* W_q, W_k, W_v */
        npy_intp shape[2] = {*layer_size(LAYER_PARAMS[i].rows, m, &E_q, &E_kv, &heads),
                             ndim == 2 ? *layer_size(LAYER_PARAMS[i].cols, m, &E_q, &E_kv, &heads) : 0};
        char what[64];
        snprintf(what, sizeof what, "expected %s =", LAYER_PARAMS[i].shape);
        if (expect_shape(a, name, ndim, shape, what)) return -1;
        if (LAYER_PARAMS[i].rows == HEADS) { /* the head mask: all ones is no head mask */
            int ones = 1;
            for (int64_t h = 0; h < heads && ones; h++)
                ones = (typenum == NPY_FLOAT32 ? ((const float *)PyArray_DATA(a))[h] : ((const double *)PyArray_DATA(a))[h]) == 1;
            if (ones) continue;
        }
        FIELD(la, i) = a;
    }
    return 0;
}

/* query (B, n_q, d_model), key (B, n_new, kdim), value (B, n_new, vdim), C-contiguous of the
 * call's dtype, their widths those of W_q's, W_k's and W_v's rows: checks them and fills m
 * (and la, from params) for a call without a cache (n_k = kv_batch_stride = n_new). */
static int fill_layer_dims(mha_layer_dims *m, layer_arrays *la, int typenum, PyObject *params,
                           Py_ssize_t heads, Py_ssize_t kv_heads, Py_ssize_t d_head, PyObject *xq_obj,
                           PyObject *xk_obj, PyObject *xv_obj, PyArrayObject **xq, PyArrayObject **xk,
                           PyArrayObject **xv) {
    if (check_heads(heads, kv_heads, d_head)) return -1;
    memset(m, 0, sizeof *m);
    m->heads = heads;
    m->kv_heads = kv_heads;
    m->d_head = d_head;
    if (layer_params(la, params, typenum, m)) return -1;
    const struct {
        const char *name, *width, *weight;
        PyObject *obj;
        PyArrayObject **a;
        int64_t expected;
    } inputs[3] = {{"query", "d_model", "W_q", xq_obj, xq, m->d_model},
                   {"key", "kdim", "W_k", xk_obj, xk, m->kdim},
                   {"value", "vdim", "W_v", xv_obj, xv, m->vdim}};
    for (int i = 0; i < 3; i++) {
        PyArrayObject *a = *inputs[i].a = get_array(inputs[i].obj, inputs[i].name, typenum, 3);
        if (!a) return -1;
        if (PyArray_DIM(a, 2) != inputs[i].expected) {
            PyObject *shape = shape_of(a);
            if (shape)
                PyErr_Format(PyExc_ValueError, "%s has shape %R but its last axis must be %s = %lld (the rows of %s)",
                             inputs[i].name, shape, inputs[i].width, (long long)inputs[i].expected, inputs[i].weight);
            Py_XDECREF(shape);
            return -1;
        }
    }
    if (PyArray_DIM(*xk, 0) != PyArray_DIM(*xq, 0)) return shape_mismatch("query", *xq, "key", *xk, "the batch size must match");
    if (PyArray_DIM(*xv, 0) != PyArray_DIM(*xq, 0)) return shape_mismatch("query", *xq, "value", *xv, "the batch size must match");
    if (PyArray_DIM(*xv, 1) != PyArray_DIM(*xk, 1)) return shape_mismatch("key", *xk, "value", *xv, "n_k must match");
    m->batch = PyArray_DIM(*xq, 0);
    m->n_q = PyArray_DIM(*xq, 1);
    m->n_k = m->n_new = m->kv_batch_stride = PyArray_DIM(*xk, 1);
    return 0;
}

/* What layer_forward hands back for layer_backward: the forward's inputs, parameters, masks
 * and sizes, and the buffers the core saved (mha_layer_saved), owned (new references) by an
 * opaque capsule, so that the backward runs on exactly what the forward ran on. */
typedef struct {
    int typenum, key_is_query, value_is_key;
    mha_layer_dims m;
    mha_attention_desc d;                /* its mask and key_padding point into mask, key_padding */
    PyArrayObject *query, *key, *value;
    layer_arrays params;
    PyObject *mask, *key_padding;        /* None or the arrays d points into */
    PyArrayObject *q_proj, *k_proj, *v_proj, *attn, *lse;
} layer_context;

static const char CONTEXT_NAME[] = "mha._C.layer_context";

static void layer_context_free(layer_context *c) {
    if (!c) return;
    Py_XDECREF(c->query);
    Py_XDECREF(c->key);
    Py_XDECREF(c->value);
    for (int i = 0; i < N_LAYER_PARAMS; i++) Py_XDECREF(FIELD(&c->params, i));
    Py_XDECREF(c->mask);
    Py_XDECREF(c->key_padding);
    Py_XDECREF(c->q_proj);
    Py_XDECREF(c->k_proj);
    Py_XDECREF(c->v_proj);
    Py_XDECREF(c->attn);
    Py_XDECREF(c->lse);
    free(c);
}

static void layer_context_destructor(PyObject *capsule) {
    layer_context_free(PyCapsule_GetPointer(capsule, CONTEXT_NAME));
}

/* The capsule of a filled context, which takes new references to the inputs, parameters and
 * masks (it owns the saved buffers already); NULL, with ctx freed, on failure. */
static PyObject *context_capsule(layer_context *ctx) {
    Py_INCREF(ctx->query);
    Py_INCREF(ctx->key);
    Py_INCREF(ctx->value);
    for (int i = 0; i < N_LAYER_PARAMS; i++) Py_XINCREF(FIELD(&ctx->params, i));
    Py_INCREF(ctx->mask);
    Py_INCREF(ctx->key_padding);
    PyObject *capsule = PyCapsule_New(ctx, CONTEXT_NAME, layer_context_destructor);
    if (!capsule) layer_context_free(ctx);
    return capsule;
}

/* k_cache and v_cache (B, max_len, H_kv*d_head) of the call's dtype, writable, with room for
 * m->n_new rows after cache_length: checks them and points m at them (this call's keys and
 * values go to rows [cache_length, +n_new), and every row before them is attended). */
static int layer_cache(mha_layer_dims *m, int typenum, PyObject *kc_obj, PyObject *vc_obj, Py_ssize_t cache_length,
                       PyArrayObject **kc, PyArrayObject **vc) {
    for (int i = 0; i < 2; i++) { /* a cache of another dtype: made for another layer */
        PyObject *c = i ? vc_obj : kc_obj;
        if (PyArray_Check(c) && PyArray_TYPE((PyArrayObject *)c) != typenum) {
            PyErr_Format(PyExc_ValueError, "%s has dtype %S but this call computes in %s: the KV cache "
                         "was made for another layer", i ? "v_cache" : "k_cache",
                         (PyObject *)PyArray_DESCR((PyArrayObject *)c), type_name(typenum));
            return -1;
        }
    }
    if (!(*kc = get_output_array(kc_obj, "k_cache", typenum, 3)) || !(*vc = get_output_array(vc_obj, "v_cache", typenum, 3)))
        return -1;
    npy_intp max_len = PyArray_DIM(*kc, 1);
    npy_intp shape[3] = {m->batch, max_len, m->kv_heads * m->d_head};
    if (expect_shape(*kc, "k_cache", 3, shape, "expected (batch, max_len, n_kv_heads*d_head) =") ||
        expect_shape(*vc, "v_cache", 3, shape, "expected (batch, max_len, n_kv_heads*d_head) ="))
        return -1;
    if (cache_length < 0 || cache_length > max_len - m->n_new) { /* no overflow */
        PyErr_Format(PyExc_ValueError, "the KV cache holds %zd of %zd positions: %zd more do not fit",
                     cache_length, (Py_ssize_t)max_len, (Py_ssize_t)m->n_new);
        return -1;
    }
    m->kv_row_offset = cache_length;
    m->kv_batch_stride = max_len;
    m->n_k = m->kv_row_offset + m->n_new;
    return 0;
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

static const char *const layer_forward_kw[] = {"query", "key", "value", "params", "heads", "kv_heads",
                                               "d_head", "mask", "key_padding_mask", "causal", "dropout",
                                               "seed", "need_weights", "k_cache", "v_cache", "cache_length",
                                               "key_is_query", "value_is_key", "softcap", NULL};
static call_spec layer_forward_spec = {"layer_forward", layer_forward_kw, 7, {NULL}};

/* -> (out (B, n_q, d_model), weights (B, H, n_q, n_k) or None, context): context is what
 * layer_backward takes, or None after a call with a KV cache (no backward through those).
 * With k_cache/v_cache (B, max_len, H_kv*d_head) the new keys/values are written there at rows
 * [cache_length, +n_new) and attended with the cached ones. key_is_query: the key is the query
 * (self-attention), so that the backward adds its gradient to d_query; likewise value_is_key. */
static PyObject *py_layer_forward(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    (void)self;
    PyObject *a[MAX_PARAMS];
    Py_ssize_t heads = 0, kv_heads = 0, d_head = 0, cache_length = 0;
    if (parse_call(&layer_forward_spec, args, nargs, kwnames, a) || get_ssize(a[4], "heads", &heads) ||
        get_ssize(a[5], "kv_heads", &kv_heads) || get_ssize(a[6], "d_head", &d_head) ||
        get_ssize(a[15], "cache_length", &cache_length))
        return NULL;
    PyObject *xq_obj = a[0], *xk_obj = a[1], *xv_obj = a[2], *params = a[3];
    PyObject *mask_obj = OR_NONE(a[7]), *kp_obj = OR_NONE(a[8]);
    attention_scalars sc = {a[9], NULL, a[10], a[11], a[18]};
    PyObject *need_obj = a[12], *kc_obj = OR_NONE(a[13]), *vc_obj = OR_NONE(a[14]), *kiq_obj = a[16], *vik_obj = a[17];
    int typenum = float_type(xq_obj, "query"), need_weights = 1, key_is_query = 0, value_is_key = 0;
    if (typenum < 0 || get_flag(need_obj, "need_weights", &need_weights) ||
        get_flag(kiq_obj, "key_is_query", &key_is_query) || get_flag(vik_obj, "value_is_key", &value_is_key))
        return NULL;
    PyArrayObject *xq, *xk, *xv, *kc = NULL, *vc = NULL;
    PyArrayObject *out = NULL, *weights = NULL, *q_proj = NULL, *k_proj = NULL, *v_proj = NULL, *attn = NULL;
    PyArrayObject *lse = NULL;
    layer_context *ctx;
    mha_layer_dims m;
    layer_arrays la;
    if (fill_layer_dims(&m, &la, typenum, params, heads, kv_heads, d_head, xq_obj, xk_obj, xv_obj, &xq, &xk, &xv))
        return NULL;
    if ((key_is_query && xk != xq) || (value_is_key && xv != xk)) {
        PyErr_SetString(PyExc_ValueError, "key_is_query / value_is_key need the same array objects");
        return NULL;
    }
    const npy_intp E_q = heads * d_head, E_kv = kv_heads * d_head;
    if (kc_obj != Py_None && layer_cache(&m, typenum, kc_obj, vc_obj, cache_length, &kc, &vc)) return NULL;
    mha_attention_desc d;
    mha_attention_desc_init(&d, m.batch, m.heads, m.kv_heads, m.n_q, m.n_k, m.d_head, m.d_head);
    attention_shapes s = {4, {m.batch, m.heads, m.n_q, m.d_head}, {m.batch, m.heads, m.n_q, m.n_k}};
    if (attention_options(&d, &s, typenum, mask_obj, kp_obj, &sc, "dropout > 0 needs a seed")) return NULL;

    npy_intp out_shape[3] = {m.batch, m.n_q, m.d_model};
    npy_intp q_shape[3] = {m.batch, m.n_q, E_q}, kv_shape[3] = {m.batch, m.n_new, E_kv};
    npy_intp lse_shape[3] = {m.batch, m.heads, m.n_q};
    if (!(out = new_array(3, out_shape, typenum, 0)) || !(lse = new_array(3, lse_shape, typenum, 0)) ||
        (need_weights && !(weights = new_array(4, s.scores, typenum, 0))) ||
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
    if (kc) { /* no backward through a cached call: the cache is rewritten by the next one */
        Py_CLEAR(q_proj);
        Py_CLEAR(k_proj);
        Py_CLEAR(v_proj);
        Py_CLEAR(attn);
        Py_CLEAR(lse);
        Py_INCREF(Py_None);
        return Py_BuildValue("(NNN)", out, weights, Py_None);
    }
    if (!(ctx = calloc(1, sizeof *ctx))) {
        PyErr_NoMemory();
        goto fail;
    }
    *ctx = (layer_context){.typenum = typenum, .key_is_query = key_is_query, .value_is_key = value_is_key,
                           .m = m, .d = d, .query = xq, .key = xk, .value = xv, .params = la,
                           .mask = mask_obj, .key_padding = kp_obj, .q_proj = q_proj, .k_proj = k_proj,
                           .v_proj = v_proj, .attn = attn, .lse = lse};
    q_proj = k_proj = v_proj = attn = lse = NULL; /* ctx owns them now */
    PyObject *capsule = context_capsule(ctx);
    if (!capsule) goto fail;
    return Py_BuildValue("(NNN)", out, weights, capsule);
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
        mha_layer_params_##SFX p = LAYER_POINTERS(c->params);                                      \
        mha_layer_grads_##SFX gr = LAYER_POINTERS(g);                                              \
        mha_layer_saved_##SFX saved = {.q_proj = PyArray_DATA(c->q_proj), .k_proj = PyArray_DATA(c->k_proj), \
                                       .v_proj = PyArray_DATA(c->v_proj), .attn = PyArray_DATA(c->attn), \
                                       .lse = PyArray_DATA(c->lse)};                               \
        err = mha_layer_backward_##SFX(PyArray_DATA(d_query), PyArray_DATA(dxk_buf), PyArray_DATA(dxv_buf), \
                                       &gr, PyArray_DATA(d_out), &saved, PyArray_DATA(c->query),   \
                                       PyArray_DATA(c->key), PyArray_DATA(c->value), &p, &c->m, &c->d); \
    } while (0)

static const char *const layer_backward_kw[] = {"d_out", "context", NULL};
static call_spec layer_backward_spec = {"layer_backward", layer_backward_kw, 2, {NULL}};

/* layer_backward(d_out (B, n_q, d_model), context from layer_forward) -> (d_query, d_key or
 * None, d_value or None, grads {name: gradient}): a gradient for every parameter the forward
 * was given and for head_mask; d_key (d_value) is None when the key was the query (the value
 * the key): its gradient is added there. */
static PyObject *py_layer_backward(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    (void)self;
    PyObject *a[MAX_PARAMS];
    if (parse_call(&layer_backward_spec, args, nargs, kwnames, a)) return NULL;
    PyObject *do_obj = a[0], *ctx_obj = a[1];
    if (!PyCapsule_IsValid(ctx_obj, CONTEXT_NAME)) {
        PyErr_Format(PyExc_TypeError, "context must be the one layer_forward returned (from a call without a "
                     "KV cache), not %.100s", Py_TYPE(ctx_obj)->tp_name);
        return NULL;
    }
    const layer_context *c = PyCapsule_GetPointer(ctx_obj, CONTEXT_NAME);
    const int typenum = c->typenum;
    npy_intp out_shape[3] = {c->m.batch, c->m.n_q, c->m.d_model};
    PyArrayObject *d_out = get_array(do_obj, "d_out", typenum, -1);
    if (!d_out || expect_shape(d_out, "d_out", 3, out_shape, "the output has shape")) return NULL;
    PyArrayObject *d_query = NULL, *d_key = NULL, *d_value = NULL;
    layer_arrays g = {0};
    PyObject *grads = NULL;
    if (!(d_query = new_array(3, PyArray_DIMS(c->query), typenum, 0)) ||
        (!c->key_is_query && !(d_key = new_array(3, PyArray_DIMS(c->key), typenum, 0))) ||
        (!c->value_is_key && !(d_value = new_array(3, PyArray_DIMS(c->value), typenum, 0))))
        goto fail;
    /* the buffers the core writes: an aliased input shares the buffer of the one it is */
    PyArrayObject *dxk_buf = c->key_is_query ? d_query : d_key;
    PyArrayObject *dxv_buf = c->value_is_key ? dxk_buf : d_value;
    /* a gradient for every parameter given, and for the head mask whether or not it was */
    for (int i = 0; i < N_LAYER_PARAMS; i++) {
        PyArrayObject *a = FIELD(&c->params, i);
        npy_intp hshape[1] = {c->m.heads};
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
    return Py_BuildValue("(NNNN)", d_query, none_key, none_value, grads);
fail:
    Py_XDECREF(d_query);
    Py_XDECREF(d_key);
    Py_XDECREF(d_value);
    Py_XDECREF(grads);
    for (int i = 0; i < N_LAYER_PARAMS; i++) Py_XDECREF(FIELD(&g, i));
    return NULL;
}

/* ---- building blocks ---------------------------------------------------------------------- */

static const char *const matmul_kw[] = {"a", "b", "trans_a", "trans_b", NULL};
static call_spec matmul_spec = {"matmul", matmul_kw, 2, {NULL}};

/* op(a) @ op(b) for 2-D C-contiguous float arrays of one dtype: the core's GEMM. */
static PyObject *py_matmul(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    (void)self;
    PyObject *arg[MAX_PARAMS];
    int ta = 0, tb = 0;
    if (parse_call(&matmul_spec, args, nargs, kwnames, arg) || get_flag(arg[2], "trans_a", &ta) ||
        get_flag(arg[3], "trans_b", &tb))
        return NULL;
    PyObject *a_obj = arg[0], *b_obj = arg[1];
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
    return check_shape(*out, name, 1, &n);
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

static int check_act(Py_ssize_t act) {
    Py_ssize_t kind = act & ~(Py_ssize_t)MHA_ACT_GATED;
    if ((act & ~(Py_ssize_t)(MHA_ACT_GATED | 15)) || kind < MHA_ACT_NONE || kind > MHA_ACT_RELU) {
        PyErr_Format(PyExc_ValueError, "act must be an activation code in [0, %d], or'ed with %d "
                     "(gated), got %zd", MHA_ACT_RELU, MHA_ACT_GATED, act);
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

static const char *const pack_weight_kw[] = {"b", "trans_b", NULL};
static call_spec pack_weight_spec = {"pack_weight", pack_weight_kw, 1, {NULL}};

/* pack_weight(b (K, N) or (N, K) with trans_b, trans_b=False) -> op(b) packed whole, a new
 * (ceil(N / W), K, W) array (W = the path's panel width), for linear(a, packed, columns=N). */
static PyObject *py_pack_weight(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    (void)self;
    PyObject *arg[MAX_PARAMS];
    int tb = 0;
    if (parse_call(&pack_weight_spec, args, nargs, kwnames, arg) || get_flag(arg[1], "trans_b", &tb)) return NULL;
    PyObject *b_obj = arg[0];
    int typenum = float_type(b_obj, "b");
    if (typenum < 0) return NULL;
    PyArrayObject *b = get_array(b_obj, "b", typenum, 2);
    if (!b) return NULL;
    const npy_intp K = PyArray_DIM(b, tb ? 1 : 0), N = PyArray_DIM(b, tb ? 0 : 1), W = pack_width(typenum);
    npy_intp shape[3] = {(N + W - 1) / W, K, W};
    PyArrayObject *p = new_block_array(3, shape, typenum, 0);
    if (!p) return NULL;
    int err;
    CALL_TYPED(typenum, err, mha_pack_weight, PyArray_DATA(p), PyArray_DATA(b), PyArray_DIM(b, 1), tb, K, N);
    if (raise_core_error(err)) {
        Py_DECREF(p);
        return NULL;
    }
    return (PyObject *)p;
}

static int check_apart(PyArrayObject *const *all, const char *const *names, int n_all, int n_outs);

static const char *const pack_weight_transposed_kw[] = {"packed", "columns", "out", NULL};
static call_spec pack_weight_transposed_spec = {"pack_weight_transposed", pack_weight_transposed_kw, 2, {NULL}};

/* pack_weight_transposed(packed (P, K, W) from pack_weight, columns=N, out=None) -> op(b)^T
 * packed as pack_weight packs it, (ceil(K / W), N, W): a new array, or a view of out's first
 * elements (out: a C-contiguous 1-D array of the dtype, apart from packed, with room). */
static PyObject *py_pack_weight_transposed(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                                           PyObject *kwnames) {
    (void)self;
    PyObject *arg[MAX_PARAMS];
    Py_ssize_t N = 0;
    if (parse_call(&pack_weight_transposed_spec, args, nargs, kwnames, arg) || get_ssize(arg[1], "columns", &N))
        return NULL;
    int typenum = float_type(arg[0], "packed");
    if (typenum < 0) return NULL;
    PyArrayObject *p = get_array(arg[0], "packed", typenum, 3);
    if (!p) return NULL;
    const npy_intp W = pack_width(typenum), K = PyArray_DIM(p, 1), expected[3] = {(N + W - 1) / W, K, W};
    if (N < 0) {
        PyErr_Format(PyExc_ValueError, "columns must be >= 0, got %zd", N);
        return NULL;
    }
    if (check_shape(p, "packed (for columns=N on this process's SIMD path)", 3, expected)) return NULL;
    npy_intp shape[3] = {(K + W - 1) / W, N, W};
    PyArrayObject *t;
    if (OR_NONE(arg[2]) == Py_None) {
        if (!(t = new_block_array(3, shape, typenum, 0))) return NULL;
    } else {
        PyArrayObject *out = get_output_array(arg[2], "out", typenum, 1);
        if (!out) return NULL;
        if (PyArray_DIM(out, 0) < shape[0] * N * W) {
            PyErr_Format(PyExc_ValueError, "out has %zd elements but the packing needs %zd",
                         (Py_ssize_t)PyArray_DIM(out, 0), (Py_ssize_t)(shape[0] * N * W));
            return NULL;
        }
        PyArrayObject *all[] = {out, p};
        const char *const names[] = {"out", "packed"};
        if (check_apart(all, names, 2, 1)) return NULL;
        Py_INCREF(PyArray_DESCR(out)); /* NewFromDescr steals it */
        t = (PyArrayObject *)PyArray_NewFromDescr(&PyArray_Type, PyArray_DESCR(out), 3, shape, NULL,
                                                  PyArray_DATA(out), NPY_ARRAY_CARRAY, NULL);
        if (!t) return NULL;
        Py_INCREF(out);
        if (PyArray_SetBaseObject(t, (PyObject *)out) < 0) { /* steals out's new reference */
            Py_DECREF(t);
            return NULL;
        }
    }
    int err;
    CALL_TYPED(typenum, err, mha_pack_weight_transposed, PyArray_DATA(t), PyArray_DATA(p), K, N);
    if (raise_core_error(err)) {
        Py_DECREF(t);
        return NULL;
    }
    return (PyObject *)t;
}

static const char *const linear_kw[] = {"a", "b", "bias", "act", "trans_b", "out", "columns",
                                        "accumulate", NULL};
static call_spec linear_spec = {"linear", linear_kw, 2, {NULL}};

/* linear(a (M, K), b (K, N') or (N', K) with trans_b, bias (N') or None, act=0, trans_b=False,
 * out=None, columns=None, accumulate=True) -> act(a @ op(b) + bias) (M, N), N = N' / 2 when act
 * is gated; with out (M, N): out += a @ op(b) + bias in place (act must be 0), or with
 * accumulate=False out = act(a @ op(b) + bias) (whatever out held), and out is returned. b may
 * be packed by pack_weight ((P, K, W), trans_b False): columns then gives N'. */
static PyObject *py_linear(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    (void)self;
    PyObject *arg[MAX_PARAMS];
    Py_ssize_t act_code = 0;
    int tb = 0, accumulate = 1;
    if (parse_call(&linear_spec, args, nargs, kwnames, arg) || get_ssize(arg[3], "act", &act_code) ||
        check_act(act_code) || get_flag(arg[4], "trans_b", &tb) || get_flag(arg[7], "accumulate", &accumulate))
        return NULL;
    PyObject *a_obj = arg[0], *b_obj = arg[1], *bias_obj = OR_NONE(arg[2]), *out_obj = OR_NONE(arg[5]);
    PyObject *cols_obj = OR_NONE(arg[6]);
    const int act = (int)act_code;
    int typenum = float_type(a_obj, "a");
    if (typenum < 0) return NULL;
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
    accumulate = accumulate && out_obj != Py_None; /* beta: 1 adds into out, 0 writes it */
    if (accumulate && act != MHA_ACT_NONE) {
        PyErr_SetString(PyExc_ValueError, "out (accumulate into it) needs act=0; pass accumulate=False "
                                          "to write act(a @ op(b) + bias) into out");
        return NULL;
    }
    if (get_opt_vector(bias_obj, "bias", typenum, Nb, &bias)) return NULL;
    npy_intp shape[2] = {M, gated ? Nb / 2 : Nb};
    PyArrayObject *c = get_or_new(out_obj, 2, shape, typenum);
    if (!c) return NULL;
    int err;
    npy_intp ldb = PyArray_DIM(b, 1);
    if (packed) {
        const double beta = accumulate ? 1.0 : 0.0;
        CALL_TYPED(typenum, err, mha_linear_packed, M, shape[1], K, PyArray_DATA(a), K, PyArray_DATA(b),
                   DPTR(bias), act, beta, PyArray_DATA(c), shape[1]);
    } else if (typenum == NPY_FLOAT32) {
        Py_BEGIN_ALLOW_THREADS
        err = mha_linear_f32(M, shape[1], K, PyArray_DATA(a), K, PyArray_DATA(b), ldb, tb, DPTR(bias), act,
                             accumulate ? 1.0f : 0.0f, PyArray_DATA(c), shape[1]);
        Py_END_ALLOW_THREADS
    } else {
        Py_BEGIN_ALLOW_THREADS
        err = mha_linear_f64(M, shape[1], K, PyArray_DATA(a), K, PyArray_DATA(b), ldb, tb, DPTR(bias), act,
                             accumulate ? 1.0 : 0.0, PyArray_DATA(c), shape[1]);
        Py_END_ALLOW_THREADS
    }
    if (raise_core_error(err)) {
        Py_DECREF(c);
        return NULL;
    }
    return (PyObject *)c;
}

/* ---- narrow packed weights (mha.h: mha_weight_format) -------------------------------------- */

/* The shape of op(b) (K, N) packed in format (float32 compute, this process's SIMD path):
 * bfloat16 and float16 (P, K, W) uint16; Q8_0 (P, ceil(K / 32), 34 W) uint8. */
static void narrow_shape(int format, npy_intp K, npy_intp N, npy_intp shape[3], int *typenum) {
    const npy_intp W = pack_width(NPY_FLOAT32);
    shape[0] = (N + W - 1) / W;
    if (format != MHA_WEIGHTS_Q8_0) {
        shape[1] = K, shape[2] = W, *typenum = NPY_UINT16;
    } else {
        shape[1] = (K + 31) / 32, shape[2] = 34 * W, *typenum = NPY_UINT8;
    }
}

static int get_format(PyObject *obj, int *format) {
    Py_ssize_t f = -1;
    if (get_ssize(obj, "format", &f)) return -1;
    if (f != MHA_WEIGHTS_BF16 && f != MHA_WEIGHTS_Q8_0 && f != MHA_WEIGHTS_F16) {
        PyErr_Format(PyExc_ValueError, "format must be %d (bfloat16), %d (q8_0) or %d (float16), got %zd",
                     MHA_WEIGHTS_BF16, MHA_WEIGHTS_Q8_0, MHA_WEIGHTS_F16, f);
        return -1;
    }
    *format = (int)f;
    return 0;
}

static const char *const pack_weight_narrow_kw[] = {"b", "format", "trans_b", NULL};
static call_spec pack_weight_narrow_spec = {"pack_weight_narrow", pack_weight_narrow_kw, 2, {NULL}};

/* pack_weight_narrow(b, format, trans_b=False) -> op(b) (K, N) packed for linear_narrow in
 * format 1 (bfloat16: (P, K, W) uint16), 2 (q8_0: (P, ceil(K / 32), 34 W) uint8) or 3
 * (float16: (P, K, W) uint16), W the float32 panel width. b: float32 (K, N), or (N, K) with
 * trans_b; for bfloat16 and float16 also uint16 raw bits of the format (kept as they are);
 * for q8_0 also uint8 ggml blocks (N, ceil(K / 32) * 34) with trans_b=True (a GGUF tensor's
 * rows: K = 32 * blocks). */
static PyObject *py_pack_weight_narrow(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    (void)self;
    PyObject *arg[MAX_PARAMS];
    int tb = 0, format = 0;
    if (parse_call(&pack_weight_narrow_spec, args, nargs, kwnames, arg) || get_format(arg[1], &format) ||
        get_flag(arg[2], "trans_b", &tb))
        return NULL;
    PyObject *b_obj = arg[0];
    if (!PyArray_Check(b_obj)) {
        PyErr_Format(PyExc_TypeError, "b must be a numpy array, not %.100s", Py_TYPE(b_obj)->tp_name);
        return NULL;
    }
    const int bt = PyArray_TYPE((PyArrayObject *)b_obj);
    const int src = bt == NPY_FLOAT32 ? 0 : format != MHA_WEIGHTS_Q8_0 && bt == NPY_UINT16 ? 1
                  : format == MHA_WEIGHTS_Q8_0 && bt == NPY_UINT8 ? 2 : -1;
    if (src < 0) {
        PyErr_Format(PyExc_TypeError, "b must be float32%s, not %S", format == MHA_WEIGHTS_BF16 ?
                     " or uint16 (bfloat16 bits)" : format == MHA_WEIGHTS_F16 ? " or uint16 (float16 bits)"
                     : " or uint8 (ggml's Q8_0 blocks)",
                     (PyObject *)PyArray_DESCR((PyArrayObject *)b_obj));
        return NULL;
    }
    PyArrayObject *b = get_array(b_obj, "b", bt, 2);
    if (!b) return NULL;
    npy_intp K = PyArray_DIM(b, tb ? 1 : 0), N = PyArray_DIM(b, tb ? 0 : 1);
    if (src == 2) {
        if (!tb || PyArray_DIM(b, 1) % 34) {
            PyErr_Format(PyExc_ValueError, "ggml's Q8_0 blocks are (N, blocks * 34) bytes with trans_b=True, "
                         "got (%zd, %zd) with trans_b=%d", (Py_ssize_t)PyArray_DIM(b, 0),
                         (Py_ssize_t)PyArray_DIM(b, 1), tb);
            return NULL;
        }
        K = PyArray_DIM(b, 1) / 34 * 32;
    }
    npy_intp shape[3];
    int typenum;
    narrow_shape(format, K, N, shape, &typenum);
    PyArrayObject *p = new_block_array(3, shape, typenum, 0);
    if (!p) return NULL;
    int err;
    Py_BEGIN_ALLOW_THREADS
    if (src == 0)
        err = mha_pack_weight_fmt_f32(PyArray_DATA(p), format, PyArray_DATA(b), PyArray_DIM(b, 1), tb, K, N);
    else if (src == 1 && format == MHA_WEIGHTS_BF16)
        err = mha_pack_weight_bf16_bits_f32(PyArray_DATA(p), PyArray_DATA(b), PyArray_DIM(b, 1), tb, K, N);
    else if (src == 1)
        err = mha_pack_weight_f16_bits_f32(PyArray_DATA(p), PyArray_DATA(b), PyArray_DIM(b, 1), tb, K, N);
    else
        err = mha_pack_weight_q8_0_blocks_f32(PyArray_DATA(p), PyArray_DATA(b), K, N);
    Py_END_ALLOW_THREADS
    if (raise_core_error(err)) {
        Py_DECREF(p);
        return NULL;
    }
    return (PyObject *)p;
}

static const char *const linear_narrow_kw[] = {"a", "packed", "format", "columns", "bias", "act", "out",
                                               "accumulate", NULL};
static call_spec linear_narrow_spec = {"linear_narrow", linear_narrow_kw, 4, {NULL}};

/* linear_narrow(a (M, K) float32, packed, format, columns, bias=None, act=0, out=None,
 * accumulate=True): linear's product with op(b) (K, N' = columns) from pack_weight_narrow. */
static PyObject *py_linear_narrow(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    (void)self;
    PyObject *arg[MAX_PARAMS];
    Py_ssize_t act_code = 0, cols = -1;
    int format = 0, accumulate = 1;
    if (parse_call(&linear_narrow_spec, args, nargs, kwnames, arg) || get_format(arg[2], &format) ||
        get_ssize(arg[3], "columns", &cols) || get_ssize(arg[5], "act", &act_code) || check_act(act_code) ||
        get_flag(arg[7], "accumulate", &accumulate))
        return NULL;
    PyObject *a_obj = arg[0], *p_obj = arg[1], *bias_obj = OR_NONE(arg[4]), *out_obj = OR_NONE(arg[6]);
    const int act = (int)act_code;
    PyArrayObject *a = get_array(a_obj, "a", NPY_FLOAT32, 2), *p, *bias;
    if (!a) return NULL;
    const npy_intp M = PyArray_DIM(a, 0), K = PyArray_DIM(a, 1);
    if (cols < 0) {
        PyErr_Format(PyExc_ValueError, "columns must be >= 0, got %zd", cols);
        return NULL;
    }
    npy_intp shape3[3];
    int typenum;
    narrow_shape(format, K, cols, shape3, &typenum);
    if (!(p = get_array(p_obj, "packed", typenum, 3))) return NULL;
    if (check_shape(p, "packed (for a's K and columns, on this SIMD path)", 3, shape3)) return NULL;
    const int gated = (act & MHA_ACT_GATED) != 0;
    if (gated && cols % 2) {
        PyErr_Format(PyExc_ValueError, "a gated activation needs an even number of columns, got %zd", cols);
        return NULL;
    }
    accumulate = accumulate && out_obj != Py_None;
    if (accumulate && act != MHA_ACT_NONE) {
        PyErr_SetString(PyExc_ValueError, "out (accumulate into it) needs act=0; pass accumulate=False "
                                          "to write act(a @ op(b) + bias) into out");
        return NULL;
    }
    if (get_opt_vector(bias_obj, "bias", NPY_FLOAT32, cols, &bias)) return NULL;
    npy_intp shape[2] = {M, gated ? cols / 2 : cols};
    PyArrayObject *c = get_or_new(out_obj, 2, shape, NPY_FLOAT32);
    if (!c) return NULL;
    int err;
    Py_BEGIN_ALLOW_THREADS
    err = mha_linear_packed_fmt_f32(M, shape[1], K, PyArray_DATA(a), K, format, PyArray_DATA(p), DPTR(bias),
                                    act, accumulate ? 1.0f : 0.0f, PyArray_DATA(c), shape[1]);
    Py_END_ALLOW_THREADS
    if (raise_core_error(err)) {
        Py_DECREF(c);
        return NULL;
    }
    return (PyObject *)c;
}

static const char *const linear_transposed_kw[] = {"a", "packed", "format", "columns", "rows", "out",
                                                    "accumulate", NULL};
static call_spec linear_transposed_spec = {"linear_transposed", linear_transposed_kw, 4, {NULL}};

/* linear_transposed(a (M, N), packed, format, columns=N, rows=-1, out=None, accumulate=True)
 * -> a @ op(b)^T (M, K), op(b) (K, N) packed by pack_weight (format 0: a's dtype) or by
 * pack_weight_narrow (1 bfloat16, 2 q8_0, 3 float16: a float32); K = rows, or from the
 * packing's shape (q8_0: 32 a block); out (M, K): added into (accumulate) or overwritten. */
static PyObject *py_linear_transposed(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    (void)self;
    PyObject *arg[MAX_PARAMS];
    Py_ssize_t f = 0, cols = -1, rows = -1;
    int accumulate = 1;
    if (parse_call(&linear_transposed_spec, args, nargs, kwnames, arg) || get_ssize(arg[2], "format", &f) ||
        get_ssize(arg[3], "columns", &cols) || (arg[4] && get_ssize(arg[4], "rows", &rows)) ||
        get_flag(arg[6], "accumulate", &accumulate))
        return NULL;
    PyObject *a_obj = arg[0], *p_obj = arg[1], *out_obj = OR_NONE(arg[5]);
    if (f != 0) {
        int format;
        if (get_format(arg[2], &format)) return NULL;
    }
    const int typenum = f == 0 ? float_type(a_obj, "a") : NPY_FLOAT32;
    if (typenum < 0) return NULL;
    PyArrayObject *a = get_array(a_obj, "a", typenum, 2), *p;
    if (!a) return NULL;
    const npy_intp M = PyArray_DIM(a, 0), N = PyArray_DIM(a, 1);
    if (cols != N) {
        PyErr_Format(PyExc_ValueError, "columns must be a's second axis (%zd), got %zd", (Py_ssize_t)N, cols);
        return NULL;
    }
    if (!PyArray_Check(p_obj) || PyArray_NDIM((PyArrayObject *)p_obj) != 3) {
        PyErr_SetString(PyExc_ValueError, "packed must be a 3-D array from pack_weight");
        return NULL;
    }
    /* K: rows, or the packing's rows (bfloat16, float16, native) or its blocks' (q8_0) */
    npy_intp shape3[3];
    int ptype = typenum;
    const npy_intp K = rows >= 0 ? rows : PyArray_DIM((PyArrayObject *)p_obj, 1) * (f == MHA_WEIGHTS_Q8_0 ? 32 : 1);
    if (f == 0) {
        const npy_intp W = pack_width(typenum);
        shape3[0] = (N + W - 1) / W, shape3[1] = K, shape3[2] = W;
    } else {
        narrow_shape((int)f, K, N, shape3, &ptype);
    }
    if (!(p = get_array(p_obj, "packed", ptype, 3))) return NULL;
    if (check_shape(p, "packed (for a's columns, on this SIMD path)", 3, shape3)) return NULL;
    accumulate = accumulate && out_obj != Py_None;
    npy_intp shape[2] = {M, K};
    PyArrayObject *c = get_or_new(out_obj, 2, shape, typenum);
    if (!c) return NULL;
    int err;
    Py_BEGIN_ALLOW_THREADS
    if (typenum == NPY_FLOAT32)
        err = mha_linear_transposed_fmt_f32(M, N, K, PyArray_DATA(a), N, (int)f, PyArray_DATA(p),
                                            accumulate ? 1.0f : 0.0f, PyArray_DATA(c), K);
    else
        err = mha_linear_transposed_fmt_f64(M, N, K, PyArray_DATA(a), N, (int)f, PyArray_DATA(p),
                                            accumulate ? 1.0 : 0.0, PyArray_DATA(c), K);
    Py_END_ALLOW_THREADS
    if (raise_core_error(err)) {
        Py_DECREF(c);
        return NULL;
    }
    return (PyObject *)c;
}

static const char *const activation_kw[] = {"x", "act", "out", NULL};
static call_spec activation_spec = {"activation", activation_kw, 2, {NULL}};

/* activation(x (rows, n) [or (rows, 2n) gated], act, out=None) -> act(x) (rows, n); out may be
 * x itself (in place). */
static PyObject *py_activation(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    (void)self;
    PyObject *arg[MAX_PARAMS];
    Py_ssize_t act_code = 0;
    if (parse_call(&activation_spec, args, nargs, kwnames, arg) || get_ssize(arg[1], "act", &act_code) ||
        check_act(act_code))
        return NULL;
    PyObject *x_obj = arg[0], *out_obj = OR_NONE(arg[2]);
    const int act = (int)act_code;
    int typenum = float_type(x_obj, "x");
    if (typenum < 0) return NULL;
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

static const char *const norm_kw[] = {"x", "gain", "bias", "eps", "out", NULL};
static const char *const rms_norm_kw[] = {"x", "gain", "eps", "out", NULL};
static call_spec norm_spec = {"layer_norm", norm_kw, 4, {NULL}};
static call_spec rms_norm_spec = {"rms_norm", rms_norm_kw, 3, {NULL}};

/* layer_norm(x (rows, d), gain (d) or None, bias (d) or None, eps, out=None) -> (rows, d);
 * rms_norm(x, gain, eps, out=None) the same without bias. out may be x itself. */
static PyObject *norm(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, int rms) {
    PyObject *arg[5] = {NULL};
    double eps = 0;
    if (parse_call(rms ? &rms_norm_spec : &norm_spec, args, nargs, kwnames, arg)) return NULL;
    /* layer_norm: x, gain, bias, eps, out; rms_norm: x, gain, eps, out */
    PyObject *x_obj = arg[0], *g_obj = arg[1], *b_obj = rms ? Py_None : OR_NONE(arg[2]);
    PyObject *out_obj = OR_NONE(arg[rms ? 3 : 4]);
    if (get_double(arg[rms ? 2 : 3], "eps", &eps)) return NULL;
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

static PyObject *py_layer_norm(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    (void)self;
    return norm(args, nargs, kwnames, 0);
}

static PyObject *py_rms_norm(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    (void)self;
    return norm(args, nargs, kwnames, 1);
}

static const char *const rope_kw[] = {"x", "heads", "d_head", "cos", "sin", NULL};
static call_spec rope_spec = {"rope", rope_kw, 5, {NULL}};

/* rope(x (rows, width), heads, d_head, cos (period, d_head / 2), sin (same)) -> None: rotates
 * the first heads * d_head columns of every row in place, row r by row r % period of cos, sin;
 * rope_backward the same on a gradient by the rotation's transpose. `name`: the array's. */
static PyObject *rope_call(call_spec *spec, const char *name, PyObject *const *args, Py_ssize_t nargs,
                           PyObject *kwnames, int backward) {
    PyObject *arg[MAX_PARAMS];
    Py_ssize_t heads = 0, d_head = 0;
    if (parse_call(spec, args, nargs, kwnames, arg) || get_ssize(arg[1], "heads", &heads) ||
        get_ssize(arg[2], "d_head", &d_head))
        return NULL;
    PyObject *x_obj = arg[0], *c_obj = arg[3], *s_obj = arg[4];
    int typenum = float_type(x_obj, name);
    if (typenum < 0) return NULL;
    PyArrayObject *x = get_output_array(x_obj, name, typenum, 2), *c, *s;
    if (!x || !(c = get_array(c_obj, "cos", typenum, 2)) || !(s = get_array(s_obj, "sin", typenum, 2))) return NULL;
    if (heads < 0 || d_head < 0 || d_head % 2 || heads * d_head > PyArray_DIM(x, 1)) {
        PyErr_Format(PyExc_ValueError, "heads=%zd and d_head=%zd (even) must fit %s's %zd columns", heads, d_head,
                     name, (Py_ssize_t)PyArray_DIM(x, 1));
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
    if (backward)
        CALL_TYPED(typenum, err, mha_rope_backward, PyArray_DATA(x), PyArray_DIM(x, 1), rows, heads, d_head,
                   PyArray_DATA(c), PyArray_DATA(s), period);
    else
        CALL_TYPED(typenum, err, mha_rope, PyArray_DATA(x), PyArray_DIM(x, 1), rows, heads, d_head, PyArray_DATA(c),
                   PyArray_DATA(s), period);
    if (raise_core_error(err)) return NULL;
    Py_RETURN_NONE;
}

static PyObject *py_rope(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    (void)self;
    return rope_call(&rope_spec, "x", args, nargs, kwnames, 0);
}

static const char *const embedding_kw[] = {"table", "ids", "out", "accumulate", NULL};
static call_spec embedding_spec = {"embedding", embedding_kw, 2, {NULL}};

/* embedding(table (vocab, d), ids int64 (n,), out=None, accumulate=False) -> (n, d): rows of
 * table; with accumulate, added to out (required). */
static PyObject *py_embedding(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    (void)self;
    PyObject *arg[MAX_PARAMS];
    int accumulate = 0;
    if (parse_call(&embedding_spec, args, nargs, kwnames, arg) || get_flag(arg[3], "accumulate", &accumulate))
        return NULL;
    PyObject *t_obj = arg[0], *ids_obj = arg[1], *out_obj = OR_NONE(arg[2]);
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

/* ---- the block's backward ------------------------------------------------------------------ */

/* A 2-D array of dtype typenum the core reads by rows: a contiguous last axis, any row stride
 * >= 0 (get_view); *ld: its row stride in elements. */
static PyArrayObject *get_rows(PyObject *obj, const char *name, int typenum, npy_intp *ld) {
    PyArrayObject *a = get_view(obj, name, typenum, 2);
    if (a) *ld = PyArray_DIM(a, 0) > 1 ? PyArray_STRIDE(a, 0) / PyArray_ITEMSIZE(a) : PyArray_DIM(a, 1);
    return a;
}

/* A gradient to accumulate into: obj None (or omitted) gives a new zero array of the shape,
 * else obj itself (C-contiguous, writable, of the shape); a new reference. */
static PyArrayObject *grad_out(PyObject *obj, const char *name, int typenum, int ndim, const npy_intp *shape) {
    if (!obj || obj == Py_None) return new_array(ndim, shape, typenum, 1);
    PyArrayObject *o = get_output_array(obj, name, typenum, ndim);
    if (!o || check_shape(o, name, ndim, shape)) return NULL;
    Py_INCREF(o);
    return o;
}

/* The bytes [lo, hi) an array's elements can occupy. */
static void byte_extent(PyArrayObject *a, const char **lo, const char **hi) {
    const char *p = PyArray_DATA(a);
    npy_intp up = PyArray_ITEMSIZE(a), down = 0;
    for (int i = 0; i < PyArray_NDIM(a); i++) {
        npy_intp s = PyArray_STRIDE(a, i) * (PyArray_DIM(a, i) - 1);
        if (s > 0) up += s;
        else down += s;
    }
    *lo = p + down;
    *hi = p + up;
}

/* ValueError unless each output outs[i] (NULL: none) shares no byte with any other array of
 * `all` (NULL entries skipped): the core writes into the outputs while it reads the rest. */
static int check_apart(PyArrayObject *const *all, const char *const *names, int n_all, int n_outs) {
    for (int i = 0; i < n_outs; i++) {
        if (!all[i] || PyArray_SIZE(all[i]) == 0) continue;
        const char *lo, *hi;
        byte_extent(all[i], &lo, &hi);
        for (int j = 0; j < n_all; j++) {
            if (j == i || !all[j] || PyArray_SIZE(all[j]) == 0) continue;
            const char *lo2, *hi2;
            byte_extent(all[j], &lo2, &hi2);
            if (lo < hi2 && lo2 < hi) {
                PyErr_Format(PyExc_ValueError, "%s overlaps %s: the core writes into %s while it reads %s", names[i],
                             names[j], names[i], names[j]);
                return -1;
            }
        }
    }
    return 0;
}

static const char *const linear_backward_kw[] = {"d_out", "a", "b", "bias", "act", "trans_b", "z", "da", "db",
                                                  "dbias", "workspace", NULL};
static call_spec linear_backward_spec = {"linear_backward", linear_backward_kw, 3, {NULL}};

/* linear_backward(d_out (M, N), a (M, K), b (K, N') or (N', K) with trans_b, bias (N') or None,
 * act=0, trans_b=False, z (M, N') or None, da=None, db=None, dbias=None) -> (da, db, dbias or
 * None): the gradients of linear's inputs, added into da, db, dbias when given (else into
 * zeros); dbias when bias or dbias is given. z: the pre-activation (else recomputed). a and
 * d_out may have any row stride. workspace: None, or a C-contiguous 1-D array of the dtype
 * with at least ceil(K / W) * W * N' elements (W: pack_weight's panel width), where da's
 * product packs op(b)^T; a caller making many calls passes one, sparing an allocation (and
 * its first-touch page faults, taken by the product's threads) per call. */
static PyObject *py_linear_backward(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    (void)self;
    PyObject *arg[MAX_PARAMS];
    Py_ssize_t act_code = 0;
    int tb = 0;
    if (parse_call(&linear_backward_spec, args, nargs, kwnames, arg) || get_ssize(arg[4], "act", &act_code) ||
        check_act(act_code) || get_flag(arg[5], "trans_b", &tb))
        return NULL;
    const int act = (int)act_code, gated = (act & MHA_ACT_GATED) != 0;
    int typenum = float_type(arg[1], "a");
    if (typenum < 0) return NULL;
    npy_intp lda = 0, lddc = 0;
    PyArrayObject *a = get_rows(arg[1], "a", typenum, &lda), *b, *dc, *bias, *z = NULL;
    if (!a || !(b = get_array(arg[2], "b", typenum, 2)) || !(dc = get_rows(arg[0], "d_out", typenum, &lddc)))
        return NULL;
    const npy_intp M = PyArray_DIM(a, 0), K = PyArray_DIM(a, 1), NB = PyArray_DIM(b, tb ? 0 : 1);
    if (PyArray_DIM(b, tb ? 1 : 0) != K) {
        PyErr_Format(PyExc_ValueError, "a has %zd columns but op(b) has %zd rows", (Py_ssize_t)K,
                     (Py_ssize_t)PyArray_DIM(b, tb ? 1 : 0));
        return NULL;
    }
    if (gated && NB % 2) {
        PyErr_Format(PyExc_ValueError, "a gated activation needs an even number of columns in op(b), got %zd",
                     (Py_ssize_t)NB);
        return NULL;
    }
    npy_intp out_shape[2] = {M, gated ? NB / 2 : NB}, z_shape[2] = {M, NB}, a_shape[2] = {M, K};
    if (check_shape(dc, "d_out", 2, out_shape) || get_opt_vector(OR_NONE(arg[3]), "bias", typenum, NB, &bias))
        return NULL;
    if (OR_NONE(arg[6]) != Py_None && (!(z = get_array(arg[6], "z", typenum, 2)) || check_shape(z, "z", 2, z_shape)))
        return NULL;
    PyArrayObject *da = NULL, *db = NULL, *dbias = NULL;
    PyObject *result = NULL;
    const int want_dbias = bias || OR_NONE(arg[9]) != Py_None;
    if (!(da = grad_out(arg[7], "da", typenum, 2, a_shape)) ||
        !(db = grad_out(arg[8], "db", typenum, 2, PyArray_DIMS(b))) ||
        (want_dbias && !(dbias = grad_out(arg[9], "dbias", typenum, 1, &NB))))
        goto done;
    PyArrayObject *ws = NULL;
    if (OR_NONE(arg[10]) != Py_None) {
        const npy_intp W = pack_width(typenum), need = (K + W - 1) / W * W * NB;
        if (!(ws = get_output_array(arg[10], "workspace", typenum, 1))) goto done;
        if (PyArray_DIM(ws, 0) < need) {
            PyErr_Format(PyExc_ValueError, "workspace has %zd elements but this product needs %zd",
                         (Py_ssize_t)PyArray_DIM(ws, 0), (Py_ssize_t)need);
            goto done;
        }
    }
    PyArrayObject *all[] = {da, db, dbias, ws, dc, a, b, bias, z};
    const char *const names[] = {"da", "db", "dbias", "workspace", "d_out", "a", "b", "bias", "z"};
    if (check_apart(all, names, 9, 4)) goto done;
    int err;
    CALL_TYPED(typenum, err, mha_linear_backward, PyArray_DATA(da), K, PyArray_DATA(db), DPTR(dbias),
               PyArray_DATA(dc), lddc, PyArray_DATA(a), lda, PyArray_DATA(b), PyArray_DIM(b, 1), tb, DPTR(bias),
               DPTR(z), act, M, out_shape[1], K, DPTR(ws));
    if (raise_core_error(err)) goto done;
    result = Py_BuildValue("(OOO)", da, db, dbias ? (PyObject *)dbias : Py_None);
done:
    Py_XDECREF(da);
    Py_XDECREF(db);
    Py_XDECREF(dbias);
    return result;
}

static const char *const activation_backward_kw[] = {"d_y", "x", "act", "out", NULL};
static call_spec activation_backward_spec = {"activation_backward", activation_backward_kw, 3, {NULL}};

/* activation_backward(d_y (rows, n), x (rows, n) [or (rows, 2n) gated], act, out=None) ->
 * d_y * act'(x) (rows, n or 2n), written (not added) into out when given; out may be x, or
 * d_y when not gated (in place). d_y and x may have any row stride. */
static PyObject *py_activation_backward(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    (void)self;
    PyObject *arg[MAX_PARAMS];
    Py_ssize_t act_code = 0;
    if (parse_call(&activation_backward_spec, args, nargs, kwnames, arg) || get_ssize(arg[2], "act", &act_code) ||
        check_act(act_code))
        return NULL;
    const int act = (int)act_code, gated = (act & MHA_ACT_GATED) != 0;
    PyObject *out_obj = OR_NONE(arg[3]);
    int typenum = float_type(arg[1], "x");
    if (typenum < 0) return NULL;
    npy_intp ldx = 0, lddy = 0;
    PyArrayObject *x = get_rows(arg[1], "x", typenum, &ldx), *dy;
    if (!x || !(dy = get_rows(arg[0], "d_y", typenum, &lddy))) return NULL;
    const npy_intp rows = PyArray_DIM(x, 0), w = PyArray_DIM(x, 1);
    if (gated && w % 2) {
        PyErr_Format(PyExc_ValueError, "a gated activation needs an even number of columns in x, got %zd", (Py_ssize_t)w);
        return NULL;
    }
    npy_intp dy_shape[2] = {rows, gated ? w / 2 : w}, x_shape[2] = {rows, w};
    if (check_shape(dy, "d_y", 2, dy_shape)) return NULL;
    if (gated && out_obj == arg[0]) {
        PyErr_SetString(PyExc_ValueError, "a gated activation's gradient cannot be written into d_y");
        return NULL;
    }
    PyArrayObject *dx = get_or_new(out_obj, 2, x_shape, typenum);
    if (!dx) return NULL;
    PyArrayObject *all[] = {dx, x, dy};
    const char *const names[] = {"out", "x", "d_y"};
    if ((PyObject *)dx == arg[1]) all[1] = NULL; /* in place on x: read before written, row by row */
    if ((PyObject *)dx == arg[0]) all[2] = NULL;
    if (check_apart(all, names, 3, 1)) {
        Py_DECREF(dx);
        return NULL;
    }
    if ((all[1] == NULL && ldx != w) || (all[2] == NULL && lddy != w)) { /* same array: same layout */
        Py_DECREF(dx);
        PyErr_SetString(PyExc_ValueError, "out must be C-contiguous");
        return NULL;
    }
    int err;
    CALL_TYPED(typenum, err, mha_activation_backward, PyArray_DATA(dx), w, PyArray_DATA(dy), lddy, PyArray_DATA(x),
               ldx, rows, dy_shape[1], act);
    if (raise_core_error(err)) {
        Py_DECREF(dx);
        return NULL;
    }
    return (PyObject *)dx;
}

static const char *const norm_backward_kw[] = {"d_y", "x", "gain", "eps", "dx", "dgain", "dbias", NULL};
static const char *const rms_norm_backward_kw[] = {"d_y", "x", "gain", "eps", "dx", "dgain", NULL};
static call_spec norm_backward_spec = {"layer_norm_backward", norm_backward_kw, 4, {NULL}};
static call_spec rms_norm_backward_spec = {"rms_norm_backward", rms_norm_backward_kw, 4, {NULL}};

/* layer_norm_backward(d_y (rows, d), x (rows, d), gain (d) or None, eps, dx=None, dgain=None,
 * dbias=None) -> (dx, dgain or None (no gain), dbias), added into the given arrays (else
 * into zeros); rms_norm_backward the same without dbias. d_y and x: any row stride. */
static PyObject *norm_backward(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, int rms) {
    PyObject *arg[MAX_PARAMS];
    double eps = 0;
    if (parse_call(rms ? &rms_norm_backward_spec : &norm_backward_spec, args, nargs, kwnames, arg) ||
        get_double(arg[3], "eps", &eps))
        return NULL;
    if (!(eps >= 0)) {
        PyErr_SetString(PyExc_ValueError, "eps must be >= 0");
        return NULL;
    }
    int typenum = float_type(arg[1], "x");
    if (typenum < 0) return NULL;
    npy_intp ldx = 0, lddy = 0;
    PyArrayObject *x = get_rows(arg[1], "x", typenum, &ldx), *dy, *g;
    if (!x || !(dy = get_rows(arg[0], "d_y", typenum, &lddy))) return NULL;
    npy_intp rows = PyArray_DIM(x, 0), d = PyArray_DIM(x, 1);
    if (check_shape(dy, "d_y", 2, PyArray_DIMS(x)) || get_opt_vector(OR_NONE(arg[2]), "gain", typenum, d, &g))
        return NULL;
    if (!g && OR_NONE(arg[5]) != Py_None) {
        PyErr_SetString(PyExc_ValueError, "dgain was given but gain is None (a norm without gain has no dgain)");
        return NULL;
    }
    PyArrayObject *dx = NULL, *dgain = NULL, *dbias = NULL;
    PyObject *result = NULL;
    if (!(dx = grad_out(arg[4], "dx", typenum, 2, PyArray_DIMS(x))) ||
        (g && !(dgain = grad_out(arg[5], "dgain", typenum, 1, &d))) ||
        (!rms && !(dbias = grad_out(arg[6], "dbias", typenum, 1, &d))))
        goto done;
    PyArrayObject *all[] = {dx, dgain, dbias, dy, x, g};
    const char *const names[] = {"dx", "dgain", "dbias", "d_y", "x", "gain"};
    if (check_apart(all, names, 6, 3)) goto done;
    int err;
    if (rms)
        CALL_TYPED(typenum, err, mha_rms_norm_backward, PyArray_DATA(dx), d, DPTR(dgain), PyArray_DATA(dy), lddy,
                   PyArray_DATA(x), ldx, DPTR(g), rows, d, eps);
    else
        CALL_TYPED(typenum, err, mha_layer_norm_backward, PyArray_DATA(dx), d, DPTR(dgain), DPTR(dbias),
                   PyArray_DATA(dy), lddy, PyArray_DATA(x), ldx, DPTR(g), rows, d, eps);
    if (raise_core_error(err)) goto done;
    PyObject *dg = dgain ? (PyObject *)dgain : Py_None;
    result = rms ? Py_BuildValue("(OO)", dx, dg) : Py_BuildValue("(OOO)", dx, dg, dbias);
done:
    Py_XDECREF(dx);
    Py_XDECREF(dgain);
    Py_XDECREF(dbias);
    return result;
}

static PyObject *py_layer_norm_backward(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    (void)self;
    return norm_backward(args, nargs, kwnames, 0);
}

static PyObject *py_rms_norm_backward(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    (void)self;
    return norm_backward(args, nargs, kwnames, 1);
}

static const char *const rope_backward_kw[] = {"dx", "heads", "d_head", "cos", "sin", NULL};
static call_spec rope_backward_spec = {"rope_backward", rope_backward_kw, 5, {NULL}};

/* rope_backward(dx (rows, width), heads, d_head, cos, sin) -> None: rope's transpose in place. */
static PyObject *py_rope_backward(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    (void)self;
    return rope_call(&rope_backward_spec, "dx", args, nargs, kwnames, 1);
}

static const char *const embedding_backward_kw[] = {"d_out", "ids", "vocab", "d_table", NULL};
static call_spec embedding_backward_spec = {"embedding_backward", embedding_backward_kw, 3, {NULL}};

/* embedding_backward(d_out (n, d), ids int64 (n,), vocab, d_table=None) -> d_table (vocab, d)
 * with d_out's rows added at ids (into zeros, or into d_table when given). */
static PyObject *py_embedding_backward(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    (void)self;
    PyObject *arg[MAX_PARAMS];
    Py_ssize_t vocab = 0;
    if (parse_call(&embedding_backward_spec, args, nargs, kwnames, arg) || get_ssize(arg[2], "vocab", &vocab))
        return NULL;
    int typenum = float_type(arg[0], "d_out");
    if (typenum < 0) return NULL;
    npy_intp ldo = 0;
    PyArrayObject *g = get_rows(arg[0], "d_out", typenum, &ldo), *ids;
    if (!g || !(ids = get_array(arg[1], "ids", NPY_INT64, 1))) return NULL;
    const npy_intp n = PyArray_DIM(g, 0), d = PyArray_DIM(g, 1);
    if (vocab < 0 || PyArray_DIM(ids, 0) != n) {
        PyErr_Format(PyExc_ValueError, "ids has %zd entries and vocab is %zd, but d_out has %zd rows and vocab must "
                     "be >= 0", (Py_ssize_t)PyArray_DIM(ids, 0), vocab, (Py_ssize_t)n);
        return NULL;
    }
    npy_intp shape[2] = {vocab, d};
    PyArrayObject *dt = grad_out(arg[3], "d_table", typenum, 2, shape);
    if (!dt) return NULL;
    PyArrayObject *all[] = {dt, g, ids};
    const char *const names[] = {"d_table", "d_out", "ids"};
    int err = check_apart(all, names, 3, 1) ? -1 : 0;
    if (!err) {
        CALL_TYPED(typenum, err, mha_embedding_backward, PyArray_DATA(dt), PyArray_DATA(g), ldo,
                   (const int64_t *)PyArray_DATA(ids), n, vocab, d);
        if (err == MHA_EINVAL) PyErr_Format(PyExc_ValueError, "ids must lie in [0, %zd) (vocab)", vocab);
        else raise_core_error(err);
    }
    if (err) {
        Py_DECREF(dt);
        return NULL;
    }
    return (PyObject *)dt;
}

static const char *const cross_entropy_kw[] = {"hidden", "w", "labels", "trans_w", "chunk", "need_grads",
                                               "d_hidden", "d_w", NULL};
static call_spec cross_entropy_spec = {"cross_entropy", cross_entropy_kw, 3, {NULL}};

/* cross_entropy(hidden (n, d), w (d, vocab) or (vocab, d) with trans_w, labels int64 (n,),
 * trans_w=False, chunk=0, need_grads=True, d_hidden=None, d_w=None) -> (loss, d_hidden or None,
 * d_w or None): the mean softmax cross-entropy of hidden @ op(w) over the labels that are not
 * -100, `chunk` rows of logits at a time (0: the core's choice), the gradients added into
 * d_hidden, d_w when given (else into zeros). hidden: any row stride. */
static PyObject *py_cross_entropy(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    (void)self;
    PyObject *arg[MAX_PARAMS];
    int tw = 0, need = 1;
    Py_ssize_t chunk = 0;
    if (parse_call(&cross_entropy_spec, args, nargs, kwnames, arg) || get_flag(arg[3], "trans_w", &tw) ||
        get_ssize(arg[4], "chunk", &chunk) || get_flag(arg[5], "need_grads", &need))
        return NULL;
    int typenum = float_type(arg[0], "hidden");
    if (typenum < 0) return NULL;
    npy_intp ldh = 0;
    PyArrayObject *h = get_rows(arg[0], "hidden", typenum, &ldh), *w, *labels;
    if (!h || !(w = get_array(arg[1], "w", typenum, 2)) || !(labels = get_array(arg[2], "labels", NPY_INT64, 1)))
        return NULL;
    const npy_intp n = PyArray_DIM(h, 0), d = PyArray_DIM(h, 1), vocab = PyArray_DIM(w, tw ? 0 : 1);
    const char *layout = tw ? "w (vocab, d) needs hidden (n, d)" : "w (d, vocab) needs hidden (n, d)";
    if (PyArray_DIM(w, tw ? 1 : 0) != d) return shape_mismatch("w", w, "hidden", h, layout), NULL;
    if (PyArray_DIM(labels, 0) != n) return shape_mismatch("labels", labels, "hidden", h, "one label per row"), NULL;
    if (chunk < 0) {
        PyErr_SetString(PyExc_ValueError, "chunk must be >= 0 (0: the core's choice)");
        return NULL;
    }
    if (!need && (OR_NONE(arg[6]) != Py_None || OR_NONE(arg[7]) != Py_None)) {
        PyErr_SetString(PyExc_ValueError, "d_hidden and d_w go with need_grads=True");
        return NULL;
    }
    PyArrayObject *dh = NULL, *dw = NULL;
    PyObject *result = NULL;
    if (need && (!(dh = grad_out(arg[6], "d_hidden", typenum, 2, PyArray_DIMS(h))) ||
                 !(dw = grad_out(arg[7], "d_w", typenum, 2, PyArray_DIMS(w)))))
        goto done;
    PyArrayObject *all[] = {dh, dw, h, w, labels};
    const char *const names[] = {"d_hidden", "d_w", "hidden", "w", "labels"};
    if (check_apart(all, names, 5, 2)) goto done;
    double loss = 0;
    int err;
    CALL_TYPED(typenum, err, mha_cross_entropy, &loss, DPTR(dh), d, DPTR(dw), PyArray_DATA(h), ldh, PyArray_DATA(w),
               PyArray_DIM(w, 1), tw, (const int64_t *)PyArray_DATA(labels), n, d, vocab, chunk);
    if (err == MHA_EINVAL) {
        PyErr_Format(PyExc_ValueError, "labels must lie in [0, %zd) (vocab) or be -100 (ignored)", (Py_ssize_t)vocab);
        goto done;
    }
    if (raise_core_error(err)) goto done;
    result = Py_BuildValue("(dOO)", loss, dh ? (PyObject *)dh : Py_None, dw ? (PyObject *)dw : Py_None);
done:
    Py_XDECREF(dh);
    Py_XDECREF(dw);
    return result;
}

/* attention_flow(weights, sources=None) -> (n_sources, n): weights (L, n, n) float64,
 * C-contiguous, finite, >= 0; sources int64 (n_sources,) or None for all positions
 * (mha.analysis.attention_flow fuses the heads, adds the residual and checks the values). */
static const char *const attention_flow_kw[] = {"weights", "sources", NULL};
static call_spec attention_flow_spec = {"attention_flow", attention_flow_kw, 1, {NULL}};

static PyObject *py_attention_flow(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    (void)self;
    PyObject *arg[MAX_PARAMS];
    if (parse_call(&attention_flow_spec, args, nargs, kwnames, arg)) return NULL;
    PyObject *w_obj = arg[0], *s_obj = OR_NONE(arg[1]);
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

static PyObject *py_release_scratch(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyLong_FromSize_t(mha_release_scratch());
}

static const char *const adam_step_kw[] = {"p", "grad", "m", "v", "lr", "beta1", "beta2", "eps",
                                           "weight_decay", "decoupled", "step", NULL};
static call_spec adam_step_spec = {"adam_step", adam_step_kw, 11, {NULL}};

/* adam_step(p, grad, m, v, lr, beta1, beta2, eps, weight_decay, decoupled, step) -> None: one
 * Adam (decoupled: AdamW) step in place on p and its moments m, v; p, grad, m, v C-contiguous,
 * of p's float dtype and shape, none overlapping another; step >= 1 counts this one. */
static PyObject *py_adam_step(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    (void)self;
    PyObject *arg[MAX_PARAMS];
    double lr = 0, beta1 = 0, beta2 = 0, eps = 0, wd = 0;
    Py_ssize_t step = 0;
    if (parse_call(&adam_step_spec, args, nargs, kwnames, arg) || get_double(arg[4], "lr", &lr) ||
        get_double(arg[5], "beta1", &beta1) || get_double(arg[6], "beta2", &beta2) ||
        get_double(arg[7], "eps", &eps) || get_double(arg[8], "weight_decay", &wd) ||
        get_ssize(arg[10], "step", &step))
        return NULL;
    const int decoupled = PyObject_IsTrue(arg[9]);
    if (decoupled < 0) return NULL;
    if (step < 1) {
        PyErr_Format(PyExc_ValueError, "step must be >= 1 (the steps taken with this one), got %zd", step);
        return NULL;
    }
    int typenum = float_type(arg[0], "p");
    if (typenum < 0) return NULL;
    /* the outputs p, m, v first, then grad (check_apart's order); arguments 0, 2, 3, 1 */
    const char *const names[4] = {"p", "m", "v", "grad"};
    const int at[4] = {0, 2, 3, 1};
    PyArrayObject *a[4];
    for (int i = 0; i < 4; i++) {
        a[i] = i == 3 ? get_array(arg[at[i]], names[i], typenum, -1) : get_output_array(arg[at[i]], names[i], typenum, -1);
        if (!a[i] || (i && check_shape(a[i], names[i], PyArray_NDIM(a[0]), PyArray_DIMS(a[0])))) return NULL;
    }
    if (check_apart(a, names, 4, 3)) return NULL;
    int err;
    CALL_TYPED(typenum, err, mha_adam_step, PyArray_DATA(a[0]), PyArray_DATA(a[1]), PyArray_DATA(a[2]),
               PyArray_DATA(a[3]), (int64_t)PyArray_SIZE(a[0]), lr, beta1, beta2, eps, wd, decoupled, (int64_t)step);
    if (raise_core_error(err)) return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"attention_forward", (PyCFunction)(void (*)(void))py_attention_forward, METH_FASTCALL | METH_KEYWORDS,
     "attention_forward(q, k, v, mask, key_padding_mask, causal, scale, dropout, seed, need_weights, return_lse, out, weights_out, row_stats, key_set, scores_out, softcap) -> (out, weights[, lse][, stats])"},
    {"attention_backward", (PyCFunction)(void (*)(void))py_attention_backward, METH_FASTCALL | METH_KEYWORDS,
     "attention_backward(d_out, q, k, v, mask, key_padding_mask, causal, scale, dropout, seed, out, lse, softcap) -> (dq, dk, dv)"},
    {"layer_forward", (PyCFunction)(void (*)(void))py_layer_forward, METH_FASTCALL | METH_KEYWORDS,
     "layer_forward(query, key, value, params, heads, kv_heads, d_head, mask, key_padding_mask, causal, "
     "dropout, seed, need_weights, k_cache, v_cache, cache_length, key_is_query, value_is_key, softcap) -> (out, "
     "weights, context); params: {W_q, W_k, W_v, W_o[, b_q, b_k, b_v, b_o, head_mask]}"},
    {"layer_backward", (PyCFunction)(void (*)(void))py_layer_backward, METH_FASTCALL | METH_KEYWORDS,
     "layer_backward(d_out, context) -> (d_query, d_key, d_value, grads); context from layer_forward"},
    {"matmul", (PyCFunction)(void (*)(void))py_matmul, METH_FASTCALL | METH_KEYWORDS,
     "matmul(a, b, trans_a=False, trans_b=False): the core's GEMM on 2-D C-contiguous arrays"},
    {"linear", (PyCFunction)(void (*)(void))py_linear, METH_FASTCALL | METH_KEYWORDS,
     "linear(a, b, bias=None, act=0, trans_b=False, out=None, columns=None) -> act(a @ op(b) + bias), "
     "or out += a @ op(b) + bias; b may be pack_weight's (P, K, W), with columns=N"},
    {"pack_weight", (PyCFunction)(void (*)(void))py_pack_weight, METH_FASTCALL | METH_KEYWORDS,
     "pack_weight(b, trans_b=False) -> op(b) (K, N) packed whole for linear: (ceil(N / W), K, W)"},
    {"pack_weight_transposed", (PyCFunction)(void (*)(void))py_pack_weight_transposed,
     METH_FASTCALL | METH_KEYWORDS,
     "pack_weight_transposed(packed, columns, out=None) -> op(b)^T packed, from op(b)'s packing"},
    {"pack_weight_narrow", (PyCFunction)(void (*)(void))py_pack_weight_narrow, METH_FASTCALL | METH_KEYWORDS,
     "pack_weight_narrow(b, format, trans_b=False) -> op(b) packed in format 1 (bfloat16), 2 (q8_0) or 3 (float16)"},
    {"linear_narrow", (PyCFunction)(void (*)(void))py_linear_narrow, METH_FASTCALL | METH_KEYWORDS,
     "linear_narrow(a, packed, format, columns, bias=None, act=0, out=None, accumulate=True)"},
    {"linear_transposed", (PyCFunction)(void (*)(void))py_linear_transposed, METH_FASTCALL | METH_KEYWORDS,
     "linear_transposed(a, packed, format, columns, out=None, accumulate=True) -> a @ op(b)^T"},
    {"activation", (PyCFunction)(void (*)(void))py_activation, METH_FASTCALL | METH_KEYWORDS,
     "activation(x, act, out=None) -> act(x) (gated: act(x[:, :n]) * x[:, n:])"},
    {"layer_norm", (PyCFunction)(void (*)(void))py_layer_norm, METH_FASTCALL | METH_KEYWORDS,
     "layer_norm(x, gain, bias, eps, out=None) -> LayerNorm of the rows of x"},
    {"rms_norm", (PyCFunction)(void (*)(void))py_rms_norm, METH_FASTCALL | METH_KEYWORDS,
     "rms_norm(x, gain, eps, out=None) -> RMSNorm of the rows of x"},
    {"rope", (PyCFunction)(void (*)(void))py_rope, METH_FASTCALL | METH_KEYWORDS,
     "rope(x, heads, d_head, cos, sin) -> None: rotary embedding in place"},
    {"embedding", (PyCFunction)(void (*)(void))py_embedding, METH_FASTCALL | METH_KEYWORDS,
     "embedding(table, ids, out=None, accumulate=False) -> rows of table"},
    {"linear_backward", (PyCFunction)(void (*)(void))py_linear_backward, METH_FASTCALL | METH_KEYWORDS,
     "linear_backward(d_out, a, b, bias=None, act=0, trans_b=False, z=None, da=None, db=None, dbias=None, "
     "workspace=None) -> "
     "(da, db, dbias or None), added into the given arrays"},
    {"activation_backward", (PyCFunction)(void (*)(void))py_activation_backward, METH_FASTCALL | METH_KEYWORDS,
     "activation_backward(d_y, x, act, out=None) -> d_y * act'(x) (gated: d gate, d up side by side)"},
    {"layer_norm_backward", (PyCFunction)(void (*)(void))py_layer_norm_backward, METH_FASTCALL | METH_KEYWORDS,
     "layer_norm_backward(d_y, x, gain, eps, dx=None, dgain=None, dbias=None) -> (dx, dgain or None, dbias)"},
    {"rms_norm_backward", (PyCFunction)(void (*)(void))py_rms_norm_backward, METH_FASTCALL | METH_KEYWORDS,
     "rms_norm_backward(d_y, x, gain, eps, dx=None, dgain=None) -> (dx, dgain or None)"},
    {"rope_backward", (PyCFunction)(void (*)(void))py_rope_backward, METH_FASTCALL | METH_KEYWORDS,
     "rope_backward(dx, heads, d_head, cos, sin) -> None: rope's transpose in place"},
    {"embedding_backward", (PyCFunction)(void (*)(void))py_embedding_backward, METH_FASTCALL | METH_KEYWORDS,
     "embedding_backward(d_out, ids, vocab, d_table=None) -> d_table with d_out's rows added at ids"},
    {"cross_entropy", (PyCFunction)(void (*)(void))py_cross_entropy, METH_FASTCALL | METH_KEYWORDS,
     "cross_entropy(hidden, w, labels, trans_w=False, chunk=0, need_grads=True, d_hidden=None, d_w=None) -> "
     "(loss, d_hidden, d_w): softmax cross-entropy over an LM head in chunks of rows"},
    {"adam_step", (PyCFunction)(void (*)(void))py_adam_step, METH_FASTCALL | METH_KEYWORDS,
     "adam_step(p, grad, m, v, lr, beta1, beta2, eps, weight_decay, decoupled, step) -> None: one Adam "
     "(decoupled: AdamW) step in place on p, m, v"},
    {"attention_flow", (PyCFunction)(void (*)(void))py_attention_flow, METH_FASTCALL | METH_KEYWORDS,
     "attention_flow(weights (L, n, n) float64, sources=None) -> (n_sources, n) maximum flows"},
    {"dropout_uniform", py_dropout_uniform, METH_VARARGS, "dropout_uniform(seed, b, h, i, j) -> float in [0, 1)"},
    {"set_num_threads", py_set_num_threads, METH_O, "set_num_threads(n): n in 1 .. MAX_THREADS"},
    {"get_num_threads", py_get_num_threads, METH_NOARGS, "get_num_threads() -> int"},
    {"build_info", py_build_info, METH_NOARGS, "build_info() -> str"},
    {"release_scratch", py_release_scratch, METH_NOARGS,
     "release_scratch() -> int: free the scratch blocks the core keeps for its next calls (0 where none are kept)"},
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
