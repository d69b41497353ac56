"""Packed kernel arguments (ferrocupy/cuda/launch.py), checked byte by byte without a GPU: what
cuLaunchKernel receives is an array of addresses, each of one argument's bytes."""

from __future__ import annotations

import ctypes

import numpy as np

from ferrocupy import AttentionDims, AttentionOptions
from ferrocupy.cuda.launch import NULL, PackedLaunch, Slot


def arg_bytes(launch: PackedLaunch, i: int, n: int) -> bytes:
    addr = int(launch._addrs[i])
    return ctypes.string_at(addr, n)


def test_every_argument_is_packed_at_its_own_address():
    params = AttentionDims.new(np.zeros((1, 2, 4, 8)), np.zeros((1, 3, 2, 8))).params(
        AttentionOptions(causal=True, window=5))
    owned = np.zeros(16, np.float32)
    launch = PackedLaunch(None, 3, 128, 0,
                          (Slot("q"), NULL, owned, np.uint32(7), Slot("out"), params))
    assert launch.slot_names == ("q", "out")
    launch._values[0][0], launch._values[4][0] = 0xABC0, 0xDEF0  # what run() writes
    assert arg_bytes(launch, 0, 8) == (0xABC0).to_bytes(8, "little")
    assert arg_bytes(launch, 1, 8) == bytes(8)
    assert arg_bytes(launch, 2, 8) == owned.ctypes.data.to_bytes(8, "little")
    assert arg_bytes(launch, 3, 4) == (7).to_bytes(4, "little")
    assert arg_bytes(launch, 4, 8) == (0xDEF0).to_bytes(8, "little")
    assert arg_bytes(launch, 5, 80) == params.tobytes()  # the struct, by value
    assert launch._addr == launch._addrs.ctypes.data
    as_array = PackedLaunch(None, 1, 32, 0, (np.array(params),))  # a 0-d array: the same bytes
    assert arg_bytes(as_array, 0, 80) == params.tobytes()


def test_run_writes_each_slots_address_into_its_argument(monkeypatch):
    """run() fills every Slot from the call's pointers (each at its own argument's address),
    leaves the other arguments as packed, and launches with the packed array."""
    from types import SimpleNamespace

    from ferrocupy.cuda import launch as launch_module

    launched = []
    monkeypatch.setattr(launch_module, "driver", SimpleNamespace(
        launchKernel=lambda *a: launched.append(a)))
    fn = SimpleNamespace(kernel=SimpleNamespace(ptr=0x77))
    launch = PackedLaunch(fn, 3, 128, 0, (Slot("q"), NULL, np.uint32(7), Slot("out"),
                                          Slot("k")))
    launch._function = fn.kernel.ptr  # (the first run would import CuPy's driver)
    for q, out, k in ((0x1000, 0x2000, 0x3000), (0x1100, 0x2100, 0x3100)):
        launch.run({"q": q, "out": out, "k": k, "v": 0x9000}, stream=5)
        assert [arg_bytes(launch, i, 8) for i in (0, 3, 4)] == [
            x.to_bytes(8, "little") for x in (q, out, k)]
        assert arg_bytes(launch, 1, 8) == bytes(8) and arg_bytes(launch, 2, 4) == (7).to_bytes(
            4, "little")
    assert [a[0] for a in launched] == [0x77, 0x77] and launched[-1][8] == 5
    assert launched[-1][9] == launch._addr
