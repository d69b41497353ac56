"""UnifiedTensor: one array on the GPU (CuPy) or the host (NumPy), shared without copies."""

from __future__ import annotations

import functools
import math

import numpy as np

_DLPACK_CPU, _DLPACK_CUDA = 1, 2


@functools.lru_cache(maxsize=None)
def cuda_available() -> bool:
    """True when CuPy imports and sees at least one CUDA device."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no CuPy, no driver, no device: all mean "not usable"
        return False


def _cupy():
    try:
        import cupy
    except ImportError as e:  # pragma: no cover - depends on the install
        raise RuntimeError("this needs CuPy: pip install 'ferrocupy[cuda13]' "
                           "(or [cuda12])") from e
    return cupy


def _resolve_device(device: str | None) -> str:
    if device is None:
        return "cuda" if cuda_available() else "cpu"
    kind, _, index = device.partition(":")
    if kind not in ("cuda", "cpu") or (kind == "cpu" and index) or (index and not index.isdigit()):
        raise ValueError(f"device must be 'cuda', 'cuda:N' or 'cpu', got {device!r}")
    if device.startswith("cuda") and not cuda_available():
        raise RuntimeError(f"device={device!r} asked for, but no CUDA device is usable")
    return device


def _wrap(obj):
    """The ndarray behind `obj`: NumPy/CuPy arrays as they are, anything else through DLPack."""
    if isinstance(obj, np.ndarray):
        return obj
    if type(obj).__module__.startswith("cupy"):
        return obj
    if hasattr(obj, "__dlpack_device__"):
        kind = int(obj.__dlpack_device__()[0])
        try:
            if kind == _DLPACK_CPU:
                return _host_from_dlpack(obj)
            if kind == _DLPACK_CUDA:
                return _cupy().from_dlpack(obj)
        except (RuntimeError, BufferError) as e:  # e.g. a torch tensor that requires grad
            raise TypeError(f"cannot share {type(obj).__name__} through DLPack: {e}") from e
        raise TypeError(f"DLPack device type {kind} of {type(obj).__name__} is neither CPU "
                        f"nor CUDA")
    if hasattr(obj, "__cuda_array_interface__"):
        return _cupy().asarray(obj)
    raise TypeError(f"cannot wrap {type(obj).__name__}: expected a NumPy or CuPy array or a "
                    f"DLPack producer such as a PyTorch tensor")


def _host_from_dlpack(obj):
    """`np.from_dlpack`, plus bfloat16: NumPy's DLPack import knows no bfloat16, so a host
    bf16 tensor (PyTorch's) is shared as int16 and viewed as ml_dtypes' bfloat16, the dtype CuPy
    gives the same tensor on the GPU."""
    try:
        return np.from_dlpack(obj)
    except (RuntimeError, BufferError):
        if str(getattr(obj, "dtype", "")) != "torch.bfloat16":
            raise
    import torch

    from .dtypes import BFLOAT16

    return np.from_dlpack(obj.view(torch.int16)).view(BFLOAT16)


class UnifiedTensor:
    """A NumPy or CuPy array with the seed's tensor API. Views share memory with their source."""

    __slots__ = ("_array", "__weakref__")  # weak references: the engine's remembered calls

    def __init__(self, array):
        self._array = _wrap(array)

    # --- construction -------------------------------------------------------------------------
    @classmethod
    def from_numpy(cls, a, device: str | None = None) -> "UnifiedTensor":
        """Copy host data to `device` ("cuda", "cuda:N", "cpu"; default the best available)."""
        device = _resolve_device(device)
        a = np.ascontiguousarray(a)
        if device == "cpu":
            return cls(a.copy())
        cp = _cupy()
        with cp.cuda.Device(_device_id(device)):
            if str(a.dtype) == "bfloat16":
                # bfloat16 crosses as its 16-bit pattern: the copy needs no float conversion
                return cls(cp.asarray(a.view(np.uint16)).view(a.dtype))
            return cls(cp.asarray(a))

    @classmethod
    def zeros(cls, shape, dtype=np.float32, device: str | None = None) -> "UnifiedTensor":
        return cls._alloc("zeros", shape, dtype, device)

    @classmethod
    def empty(cls, shape, dtype=np.float32, device: str | None = None) -> "UnifiedTensor":
        return cls._alloc("empty", shape, dtype, device)

    @classmethod
    def _alloc(cls, how, shape, dtype, device):
        device = _resolve_device(device)
        if device == "cpu":
            return cls(getattr(np, how)(shape, dtype=dtype))
        cp = _cupy()
        with cp.cuda.Device(_device_id(device)):
            return cls(getattr(cp, how)(shape, dtype=dtype))

    # --- properties -----------------------------------------------------------------------------
    @property
    def shape(self) -> tuple:
        return tuple(self._array.shape)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self._array.dtype)

    @property
    def device(self) -> str:
        """'cpu', or 'cuda:N' for the GPU the data lives on."""
        if isinstance(self._array, np.ndarray):
            return "cpu"
        return f"cuda:{self._array.device.id}"

    @property
    def is_cuda(self) -> bool:
        return not isinstance(self._array, np.ndarray)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def strides(self) -> tuple:
        """Element strides (byte strides over the item size; a byte stride that is not a whole
        number of elements stays a fraction, which the engine refuses)."""
        size = self._array.dtype.itemsize
        return tuple(st // size if st % size == 0 else st / size for st in self._array.strides)

    @property
    def is_contiguous(self) -> bool:
        return bool(self._array.flags.c_contiguous)

    def buffer(self):
        """The wrapped `cupy.ndarray` or `numpy.ndarray` (no copy)."""
        return self._array

    # --- views and copies -----------------------------------------------------------------------
    def reshaped(self, shape) -> "UnifiedTensor":
        """A view with `shape` sharing this tensor's memory (one -1 allowed)."""
        shape = tuple(int(s) for s in shape)
        if sum(s == -1 for s in shape) > 1 or any(s < -1 for s in shape):
            raise ValueError(f"reshaped{shape}: at most one -1 and no other negative size")
        known = math.prod(s for s in shape if s != -1)
        if -1 in shape:
            if known == 0 or self.numel % known:
                raise ValueError(f"cannot reshape {self.shape} ({self.numel} elements) to {shape}")
            shape = tuple(self.numel // known if s == -1 else s for s in shape)
        if math.prod(shape) != self.numel:
            raise ValueError(f"cannot reshape {self.shape} ({self.numel} elements) to {shape} "
                             f"({math.prod(shape)} elements)")
        if not self.is_contiguous:
            raise ValueError(f"reshaped{shape} needs C-contiguous data to share memory; this "
                             f"tensor of shape {self.shape} has strides {self._array.strides}")
        return UnifiedTensor(self._array.reshape(shape))

    def to_numpy(self) -> np.ndarray:
        """A host copy of the data."""
        if isinstance(self._array, np.ndarray):
            return self._array.copy()
        if str(self._array.dtype) == "bfloat16":
            return self._array.view(np.uint16).get().view(self._array.dtype)
        return self._array.get()

    # --- interop out ----------------------------------------------------------------------------
    def __dlpack__(self, *args, **kwargs):
        return self._array.__dlpack__(*args, **kwargs)

    def __dlpack_device__(self):
        return self._array.__dlpack_device__()

    @property
    def __cuda_array_interface__(self):
        if not self.is_cuda:
            raise AttributeError("a host tensor has no __cuda_array_interface__")
        return self._array.__cuda_array_interface__

    def __array__(self, dtype=None, copy=None):
        if not self.is_cuda and not copy:
            return self._array if dtype is None else self._array.astype(dtype, copy=False)
        if copy is False:
            raise ValueError(f"a tensor on {self.device} cannot become a NumPy array without "
                             f"a copy; use to_numpy()")
        a = self.to_numpy()
        return a if dtype is None else a.astype(dtype)

    def __repr__(self) -> str:
        return f"UnifiedTensor(shape={self.shape}, dtype={self.dtype}, device='{self.device}')"


def _device_id(device: str) -> int:
    """'cuda:N' -> N; plain 'cuda' is CuPy's current device."""
    return int(device.split(":")[1]) if ":" in device else _cupy().cuda.Device().id
