"""One array's values in other memory layouts, shared by the property tests and the fuzzer."""
import numpy as np

#: every layout relayout() makes, besides "c" (a plain copy)
LAYOUTS = ("fortran", "strided", "negative", "readonly", "byteswapped", "broadcast", "unaligned")


def relayout(a, kind):
    """An array equal to `a` in layout `kind` (a new buffer, unless "broadcast" can be a view;
    `a` is untouched). Non-arrays and object arrays come back as they are."""
    if not isinstance(a, np.ndarray) or a.dtype == object:
        return a
    if kind == "c" or a.ndim == 0:
        return a.copy()
    if kind == "fortran":
        return np.asfortranarray(a)
    if kind == "strided":          # every other element of a twice-wider buffer
        big = np.zeros(a.shape[:-1] + (2 * a.shape[-1],), a.dtype)
        big[..., ::2] = a
        return big[..., ::2]
    if kind == "negative":         # negative strides on every axis
        flip = tuple(slice(None, None, -1) for _ in a.shape)
        return np.ascontiguousarray(a[flip])[flip]
    if kind == "readonly":
        r = a.copy()
        r.flags.writeable = False
        return r
    if kind == "byteswapped":      # non-native byte order, same values
        return a.astype(a.dtype.newbyteorder()) if a.dtype.kind in "fiuc" else a.copy()
    if kind == "broadcast":        # a zero-stride view of the first row, when all rows are equal
        if a.shape[0] > 0 and (a == a[:1]).all():
            return np.broadcast_to(a[:1], a.shape)
        return a.copy()
    if kind == "unaligned":        # one byte past an aligned buffer
        buf = np.zeros(a.nbytes + 1, np.uint8)
        u = buf[1:].view(a.dtype).reshape(a.shape)
        u[...] = a
        return u
    raise ValueError(kind)
