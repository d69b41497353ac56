"""UnifiedTensor: views share memory, construction, DLPack in and out, repr (GPU cases last)."""

from __future__ import annotations

import numpy as np
import pytest

from ferrocupy import ComputeEngine, UnifiedTensor
from helpers import requires_gpu


def test_reshaped_view_writes_through(rng):
    a = rng.standard_normal((2, 3, 4)).astype(np.float32)
    t = UnifiedTensor(a)
    view = t.reshaped((6, -1))
    assert view.shape == (6, 4)
    view.buffer()[5, 3] = 42.0
    assert a[1, 2, 3] == 42.0 and t.buffer()[1, 2, 3] == 42.0
    # And the other way: a write to the original shows in the view.
    a[0, 0, 1] = -7.0
    assert view.buffer()[0, 1] == -7.0
    assert np.shares_memory(view.buffer(), a)


def test_reshaped_four_d_single_head_view(rng):
    a = rng.standard_normal((5, 8)).astype(np.float32)
    v = UnifiedTensor(a).reshaped((1, 5, 1, 8))
    v.buffer()[0, 4, 0, 7] = 3.5
    assert a[4, 7] == 3.5


@pytest.mark.parametrize("shape,match", [
    ((5, 5), r"cannot reshape \(2, 3, 4\) \(24 elements\) to \(5, 5\) \(25 elements\)"),
    ((-1, -1), r"at most one -1"),
    ((5, -1), r"cannot reshape \(2, 3, 4\) \(24 elements\) to \(5, -1\)"),
    ((-2, 12), r"no other negative size"),
])
def test_reshape_errors(shape, match):
    t = UnifiedTensor(np.zeros((2, 3, 4), np.float32))
    with pytest.raises(ValueError, match=match):
        t.reshaped(shape)


def test_reshape_of_non_contiguous_refuses_to_copy(rng):
    a = rng.standard_normal((4, 6)).astype(np.float32)
    with pytest.raises(ValueError, match=r"C-contiguous.*shape \(6, 4\)"):
        UnifiedTensor(a.T).reshaped((24,))


def test_from_numpy_copies_to_cpu(rng):
    a = rng.standard_normal((3, 4)).astype(np.float32)
    t = UnifiedTensor.from_numpy(a, device="cpu")
    assert t.device == "cpu" and not t.is_cuda
    assert t.shape == (3, 4) and t.dtype == np.float32 and t.numel == 12
    np.testing.assert_array_equal(t.buffer(), a)
    a[0, 0] += 1.0  # a copy: the source changing does not change the tensor
    assert t.buffer()[0, 0] != a[0, 0]


def test_from_numpy_makes_non_contiguous_input_contiguous(rng):
    a = rng.standard_normal((4, 6)).astype(np.float32)
    t = UnifiedTensor.from_numpy(a[:, ::2], device="cpu")
    assert t.is_contiguous
    np.testing.assert_array_equal(t.buffer(), a[:, ::2])


def test_default_device_without_gpu_is_cpu():
    from ferrocupy import cuda_available

    if cuda_available():
        pytest.skip("a CUDA GPU is usable, so the default device is cuda")
    assert UnifiedTensor.from_numpy(np.ones(3, np.float32)).device == "cpu"


def test_bad_device_names():
    with pytest.raises(ValueError, match=r"device must be 'cuda', 'cuda:N' or 'cpu', got 'tpu'"):
        UnifiedTensor.zeros((2,), device="tpu")


def test_zeros_empty_to_numpy():
    z = UnifiedTensor.zeros((2, 3), dtype=np.float64, device="cpu")
    assert z.shape == (2, 3) and z.dtype == np.float64
    np.testing.assert_array_equal(z.to_numpy(), np.zeros((2, 3)))
    e = UnifiedTensor.empty((4,), device="cpu")
    assert e.shape == (4,) and e.dtype == np.float32
    copy = z.to_numpy()
    copy[0, 0] = 1.0  # to_numpy is a copy
    assert z.buffer()[0, 0] == 0.0


def test_wrap_shares_memory_with_numpy(rng):
    a = rng.standard_normal(5).astype(np.float32)
    t = UnifiedTensor(a)
    t.buffer()[2] = 9.0
    assert a[2] == 9.0


class _HostDLPack:
    """A minimal DLPack producer that is not an ndarray (as a foreign library would be)."""

    def __init__(self, a):
        self._a = a

    def __dlpack__(self, *args, **kwargs):
        return self._a.__dlpack__(*args, **kwargs)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


def test_dlpack_in_without_copy(rng):
    a = rng.standard_normal((2, 3)).astype(np.float32)
    t = UnifiedTensor(_HostDLPack(a))
    assert t.shape == (2, 3) and t.device == "cpu"
    t.buffer()[1, 2] = 5.0
    assert a[1, 2] == 5.0  # same memory, not a copy


def test_dlpack_from_unknown_device_type_rejected():
    class Weird:
        def __dlpack_device__(self):
            return (14, 0)  # kDLOneAPI

    with pytest.raises(TypeError, match=r"DLPack device type 14 of Weird"):
        UnifiedTensor(Weird())


def test_unwrappable_object_rejected():
    with pytest.raises(TypeError, match=r"cannot wrap list"):
        UnifiedTensor([1.0, 2.0])


def test_torch_cpu_tensor_in_and_out(rng):
    torch = pytest.importorskip("torch", reason="torch is not installed")
    x = torch.from_numpy(rng.standard_normal((3, 4)).astype(np.float32))
    t = UnifiedTensor(x)
    assert t.shape == (3, 4) and t.dtype == np.float32 and t.device == "cpu"
    t.buffer()[0, 1] = 11.0
    assert float(x[0, 1]) == 11.0  # no copy
    back = torch.from_dlpack(t)
    back[2, 3] = -4.0
    assert t.buffer()[2, 3] == -4.0


@pytest.mark.parametrize("name", ["bfloat16", "float16"])
def test_torch_cpu_half_tensor_shares_memory(rng, name):
    # A host bf16 tensor has no NumPy DLPack dtype: it wraps through an int16 view as
    # ml_dtypes' bfloat16 (CuPy's), still sharing memory; float16 wraps directly.
    torch = pytest.importorskip("torch", reason="torch is not installed")
    from ferrocupy.dtypes import BFLOAT16, FLOAT16

    x = torch.from_numpy(rng.standard_normal((3, 4)).astype(np.float32)).to(getattr(torch, name))
    t = UnifiedTensor(x)
    assert t.dtype == {"bfloat16": BFLOAT16, "float16": FLOAT16}[name]
    assert t.shape == (3, 4) and t.device == "cpu" and t.is_contiguous
    np.testing.assert_array_equal(t.buffer().astype(np.float32), x.float().numpy())
    t.buffer()[0, 1] = 11.5
    assert float(x[0, 1]) == 11.5  # written through the wrapper, seen in torch
    x[2, 3] = -4.25
    assert float(t.buffer()[2, 3]) == -4.25  # and the other way
    view = t.reshaped((2, 6))
    view.buffer()[1, 5] = 0.75
    assert float(x[2, 3]) == 0.75
    assert repr(t) == f"UnifiedTensor(shape=(3, 4), dtype={name}, device='cpu')"


def test_dlpack_out(rng):
    a = rng.standard_normal((2, 5)).astype(np.float32)
    t = UnifiedTensor(a)
    b = np.from_dlpack(t)
    np.testing.assert_array_equal(b, a)
    assert np.shares_memory(b, a)
    assert t.__dlpack_device__()[0] == 1  # kDLCPU


def test_host_tensor_has_no_cuda_array_interface():
    t = UnifiedTensor(np.zeros(2, np.float32))
    assert not hasattr(t, "__cuda_array_interface__")


def test_array_protocol(rng):
    a = rng.standard_normal(4).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(UnifiedTensor(a)), a)
    assert np.asarray(UnifiedTensor(a), dtype=np.float64).dtype == np.float64


def test_repr_shows_shape_dtype_device():
    r = repr(UnifiedTensor(np.zeros((2, 3, 4), np.float16)))
    assert r == "UnifiedTensor(shape=(2, 3, 4), dtype=float16, device='cpu')"


def test_engine_takes_a_view_strided_over_seq(rng):
    """Every other row of a longer sequence: read through its strides, as its copy would be."""
    eng = ComputeEngine("reference")
    base = rng.standard_normal((2, 8, 4, 16)).astype(np.float32)
    q = base[:, ::2]  # [2, 4, 4, 16], strided over seq
    k = rng.standard_normal((2, 4, 4, 16)).astype(np.float32)
    out, want = np.full((2, 4, 4, 16), np.nan, np.float32), np.full((2, 4, 4, 16), np.nan,
                                                                    np.float32)
    eng.flash_attention_v2(q, k, k.copy(), out)
    eng.flash_attention_v2(np.ascontiguousarray(q), k, k.copy(), want)
    np.testing.assert_array_equal(out, want)


def test_engine_writes_into_torch_tensors(rng):
    torch = pytest.importorskip("torch", reason="torch is not installed")
    from helpers import dense_attention, rel_err

    q, k, v = (torch.from_numpy(rng.standard_normal((1, n, 2, 8)).astype(np.float32))
               for n in (4, 6, 6))
    out = torch.full((1, 4, 2, 8), float("nan"))
    ComputeEngine("reference").flash_attention_v2(q, k, v, out, causal=True)
    want, _ = dense_attention(q.numpy(), k.numpy(), v.numpy(), causal=True)
    assert rel_err(out.numpy(), want) < 1e-6


# --- on a GPU (skipped here when none is usable) ----------------------------------------------
@requires_gpu
def test_cuda_tensor_round_trip_and_views(rng):
    import cupy

    a = rng.standard_normal((2, 3, 4)).astype(np.float32)
    t = UnifiedTensor.from_numpy(a, device="cuda")
    assert t.is_cuda and t.device == "cuda:0" and isinstance(t.buffer(), cupy.ndarray)
    np.testing.assert_array_equal(t.to_numpy(), a)
    view = t.reshaped((6, 4))
    view.buffer()[5, 3] = 42.0
    assert float(t.buffer()[1, 2, 3]) == 42.0
    assert t.__cuda_array_interface__["shape"] == (2, 3, 4)
    back = cupy.from_dlpack(t)
    back[0, 0, 0] = -1.0
    assert float(t.buffer()[0, 0, 0]) == -1.0  # DLPack out shares memory
    assert repr(t) == "UnifiedTensor(shape=(2, 3, 4), dtype=float32, device='cuda:0')"


@requires_gpu
def test_reference_engine_rejects_cuda_tensor(rng):
    q = UnifiedTensor.from_numpy(rng.standard_normal((1, 2, 1, 8)).astype(np.float32), "cuda")
    out = np.full((1, 2, 1, 8), 5.0, np.float32)
    with pytest.raises(ValueError, match=r"q \(shape \(1, 2, 1, 8\)\) is on cuda:0, but this "
                                         r"engine's reference backend runs on cpu"):
        ComputeEngine("reference").flash_attention_v2(q, out.copy(), out.copy(), out)
    assert (out == 5.0).all()


def test_strides_are_in_elements():
    a = np.zeros((2, 3, 4), np.float32)
    assert UnifiedTensor(a).strides == (12, 4, 1)
    assert UnifiedTensor(a.transpose(0, 2, 1)).strides == (12, 1, 4)
    odd = np.zeros(13, np.uint8)[1:].view(np.float32)  # 4-byte items, aligned to 1 byte
    assert UnifiedTensor(np.lib.stride_tricks.as_strided(odd, (2,), (6,))).strides == (1.5,)
