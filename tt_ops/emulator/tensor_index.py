"""``EmuTensor.__getitem__``: torch-style basic indexing as ttnn's ``Tensor.__getitem__`` does it
(``ttnn/operations/core.py``: normalise the key, ``ttnn.slice``, then squeeze the integer-indexed axes)."""

from __future__ import annotations


def getitem(t, key):
    shape = t.logical_shape_list
    keys = list(key) if isinstance(key, tuple) else [key]
    if sum(k is Ellipsis for k in keys) > 1:
        raise ValueError("Only one ellipsis ('...') is allowed in a slice.")
    if Ellipsis in keys:
        i = keys.index(Ellipsis)
        keys[i:i + 1] = [slice(None)] * (len(shape) - len(keys) + 1)
    if len(keys) > len(shape):
        raise IndexError(f"too many indices ({len(keys)}) for a rank-{len(shape)} tensor")
    keys += [slice(None)] * (len(shape) - len(keys))
    begins, ends, steps, squeeze = [], [], [], []
    for d, (k, n) in enumerate(zip(keys, shape)):
        if isinstance(k, int):
            k = k + n if k < 0 else k
            if not 0 <= k < n:
                raise IndexError(f"index {k} out of range for dim {d} of size {n}")
            begins.append(k), ends.append(k + 1), steps.append(1)
            squeeze.append(d)
        elif isinstance(k, slice):
            b, e, st = k.indices(n)
            if st <= 0:
                raise ValueError("ttnn slicing needs a positive step")
            begins.append(b), ends.append(e), steps.append(st)
        else:
            raise TypeError(f"unsupported index {k!r} (ints, slices and ... only)")
    ns = t._ns()
    out = ns.slice(t, begins, ends, steps)
    if squeeze:
        out = ns.reshape(out, [s for d, s in enumerate(out.logical_shape_list) if d not in squeeze])
    return out
