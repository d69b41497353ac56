"""The packed structs' two halves agree field by field: every field of ferro_params.cuh's structs
(FlashV2Params, FlashBwdParams, AttnExtras, AttnLayout, RopeParams, RopeLayout) sits at the byte
offset, with the size, that ferrocupy/params.py's NumPy dtype gives it. The headers'
static_asserts check only each struct's total size, which two swapped fields of one size keep;
a kernel receives the struct's bytes as they are, so a swap would be a silent wrong answer."""

from __future__ import annotations

import ctypes

import pytest

from cuda_on_host import build
from ferrocupy.params import (ATTN_EXTRAS, ATTN_LAYOUT, FLASH_BWD_PARAMS, FLASH_V2_PARAMS,
                              LAYOUT_TENSORS, ROPE_LAYOUT, ROPE_PARAMS)

# C struct -> (its NumPy dtype, the dtype's field name of each C field: (C name, NumPy name))
STRUCTS = {
    "FlashV2Params": (FLASH_V2_PARAMS, [(n, n) for n in FLASH_V2_PARAMS.names
                                        if not n.startswith("_")]),
    "FlashBwdParams": (FLASH_BWD_PARAMS, [(n, n) for n in FLASH_BWD_PARAMS.names
                                          if not n.startswith("_")]),
    "AttnExtras": (ATTN_EXTRAS, [(n, n) for n in ATTN_EXTRAS.names if not n.startswith("_")]),
    "AttnLayout": (ATTN_LAYOUT, [(f"{t}.{c}", f"{t}_{c}") for t in LAYOUT_TENSORS for c in "bsh"]),
    "RopeParams": (ROPE_PARAMS, [(n, n) for n in ROPE_PARAMS.names if not n.startswith("_")]),
    "RopeLayout": (ROPE_LAYOUT, [(n, n) for n in ROPE_LAYOUT.names if not n.startswith("_")]),
}


def _shim() -> str:
    lines = ['#include <cstddef>', '#include "ferro_params.cuh"',
             'extern "C" long long field_at(int i, int what) {',
             '    static const long long at[][2] = {']
    for name, (_, fields) in STRUCTS.items():
        for c, _ in fields:
            lines.append(f"        {{(long long)offsetof({name}, {c}), "
                         f"(long long)sizeof((({name}*)0)->{c})}},")
    lines += ["    };", "    return at[i][what];", "}"]
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    lib = build(tmp_path_factory.mktemp("structs_host"), _shim(), "the structs' host build")
    lib.field_at.argtypes = [ctypes.c_int, ctypes.c_int]
    lib.field_at.restype = ctypes.c_longlong
    return lib


def test_every_field_at_the_offset_params_py_packs(lib):
    i, wrong = 0, []
    for name, (dtype, fields) in STRUCTS.items():
        for c, n in fields:
            want = (dtype.fields[n][1], dtype.fields[n][0].itemsize)
            got = (lib.field_at(i, 0), lib.field_at(i, 1))
            if got != want:
                wrong.append(f"{name}.{c}: header (offset, size) {got}, params.py {want}")
            i += 1
    assert not wrong, "\n".join(wrong)
