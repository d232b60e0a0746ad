"""A second device with values, on a machine with only a CPU: ``meta`` made to hold data.

Inside ``with ShimDevice():`` a tensor created on or moved to ``meta`` is a ``Shim``: it reports
``device == meta`` but keeps its values in a CPU tensor, and every op runs on those values with the
CPU kernels, so a model or a memory store on ``meta`` computes exactly what it computes on the CPU.
What a real accelerator refuses is refused here too: an op mixing ``meta`` tensors with CPU tensors
(other than 0-dim scalars) raises "Expected all tensors to be on the same device", and moving
between the two takes an explicit ``.to()`` / ``copy_``. Code that builds a tensor on the CPU and
mixes it with the compute device's, or hands a compute-device tensor to a gloo collective, fails
here as it would with CUDA tensors, without a GPU.

Limits: ``torch.tensor(..., device="meta")`` bypasses the mode (it gives a real meta tensor, without
values); ``numpy()`` on a ``Shim`` fails, as on CUDA; fused optimizers refuse the ``meta`` device.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

DEVICE = torch.device("meta")
_aten = torch.ops.aten


class Shim(torch.Tensor):
    """A tensor on ``meta`` whose values live in the CPU tensor ``inner``."""

    inner: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor):
        r = torch.Tensor._make_wrapper_subclass(cls, inner.shape, strides=inner.stride(),
                                                storage_offset=inner.storage_offset(), dtype=inner.dtype,
                                                device=DEVICE, requires_grad=inner.requires_grad)
        r.inner = inner
        return r

    def tolist(self):  # as a CUDA tensor's (Python values come back to the host)
        return self.inner.tolist()

    def __repr__(self):
        return f"Shim({self.inner!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _dispatch(func, args, kwargs or {})


def _on_shim(device) -> bool:
    return device is not None and torch.device(device).type == DEVICE.type


def _unwrap(x):
    return x.inner if isinstance(x, Shim) else x


def _dispatch(func, args, kwargs):
    tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
    shims = [t for t in tensors if isinstance(t, Shim)]
    if func is _aten._to_copy.default:  # .to(): the device moves
        kw = dict(kwargs)
        device = kw.pop("device", None)
        out = func(_unwrap(args[0]), **kw)
        return Shim(out) if (_on_shim(device) if device is not None else isinstance(args[0], Shim)) else out
    if func is _aten.copy_.default:  # copies may cross devices
        _unwrap(args[0]).copy_(_unwrap(args[1]))
        return args[0]
    if _on_shim(kwargs.get("device")):  # a factory on meta: made on the CPU, wrapped
        out = func(*tree_map(_unwrap, args), **{**tree_map(_unwrap, kwargs), "device": torch.device("cpu")})
        return tree_map(lambda o: Shim(o) if isinstance(o, torch.Tensor) else o, out)
    if shims and any(not isinstance(t, Shim) and t.dim() > 0 for t in tensors):
        raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                           f"meta and cpu! ({func})")
    out = func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))
    if not shims:
        return out
    mine = {id(s.inner): s for s in shims}  # in-place ops give back their own argument
    return tree_map(lambda o: (mine[id(o)] if id(o) in mine else Shim(o)) if isinstance(o, torch.Tensor) else o, out)


class ShimDevice(TorchDispatchMode):
    """While active, ``meta`` is a device that holds values (see the module docstring)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return _dispatch(func, args, kwargs or {})
