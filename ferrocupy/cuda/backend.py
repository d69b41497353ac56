"""The CUDA backend: maps the engine's four kernel launches onto the `.cu` kernels, picking each
kernel's variant (padded head_dim, copy width) and launch geometry. The engine has already
validated the inputs and packed the parameter struct, which is passed to the kernel by value."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .loader import KernelLoader

WARPS = 4
THREADS = 32 * WARPS
GRID_X_MAX = 2**31 - 1


@dataclass(frozen=True)
class AttentionKernel:
    source: str
    args: tuple  # buffer names, in the kernel's parameter order (the packed struct comes last)
    tile: int  # rows (queries, or keys for dK/dV) per block
    per_kv_head: bool  # one block row per (batch, KV head) instead of (batch, head)
    smem_rows: tuple  # (rows of head_dim pitch, extra floats) per block, see shared_bytes

    def shared_bytes(self, dp: int) -> int:
        rows, extra = self.smem_rows
        return 4 * (rows * (dp + 4) + extra)


ATTENTION = {
    "flash_attn_v2": AttentionKernel(
        "flash_fwd.cu", ("q", "k", "v", "out", "mask"), 64, False, (64 + 64 + 64, 0)),
    "flash_attn_v2_bw_dq": AttentionKernel(
        "flash_bwd_dq.cu", ("q", "k", "v", "out", "grad_out", "grad_q", "mask", "stats"),
        64, False, (64 + 64 + 32 + 32, 0)),
    "flash_attn_v2_bw_dkdv": AttentionKernel(
        "flash_bwd_dkdv.cu", ("q", "k", "v", "grad_out", "grad_k", "grad_v", "mask", "stats"),
        64, True, (64 + 64 + 32 + 32, 0)),
}


def padded_head_dim(d: int) -> int:
    """Kernel variant for head_dim d: the next multiple of 16 (one compiled variant each)."""
    return max(16, -(-d // 16) * 16)


class CudaBackend:
    name = "cuda"
    dtypes = (np.dtype(np.float32),)

    def __init__(self):
        import cupy

        self.xp = cupy
        self._id = cupy.cuda.Device().id
        self.device = f"cuda:{self._id}"
        self.loader = KernelLoader()
        with cupy.cuda.Device(self._id):
            self._no_mask = cupy.zeros(1, dtype=np.float32)  # the seed's dummy binding
            # Read once: CuPy's `attributes` queries every device attribute on each access.
            self._smem_limit = cupy.cuda.Device(self._id).attributes["MaxSharedMemoryPerBlockOptin"]

    def device_name(self) -> str:
        props = self.xp.cuda.runtime.getDeviceProperties(self._id)
        name = props["name"]
        return name.decode() if isinstance(name, bytes) else name

    def empty(self, shape, dtype):
        """An uninitialised array on this backend's device."""
        with self.xp.cuda.Device(self._id):
            return self.xp.empty(shape, dtype=dtype)

    def zero(self, array) -> None:
        """Fill `array` with zeros on this backend's device (its current stream)."""
        with self.xp.cuda.Device(self._id):
            array.fill(0)

    def prepare(self, kernel: str, buffers: dict, params: np.void) -> None:
        """Compile and check a launch without running it, so that a launch sequence (the
        backward's two kernels) fails before its first kernel writes anything."""
        if kernel != "rope":
            with self.xp.cuda.Device(self._id):
                self._plan(ATTENTION[kernel], kernel, buffers, params)

    def run(self, kernel: str, buffers: dict, params: np.void) -> None:
        with self.xp.cuda.Device(self._id):
            if kernel == "rope":
                self._rope(buffers["x"], params)
            else:
                fn, blocks, smem, args = self._plan(ATTENTION[kernel], kernel, buffers, params)
                if blocks:
                    fn((blocks,), (THREADS,), args + (params,), shared_mem=smem)

    def _rope(self, x, params) -> None:
        fn = self.loader.function("rope.cu", "rope")
        head_dim, heads = int(params["head_dim"]), int(params["heads"])
        tokens = x.size // (head_dim * heads)
        items = tokens * (head_dim // 2)
        blocks = max(1, min(-(-items // 256), 132 * 16))
        fn((blocks,), (256,), (x, np.uint64(tokens), params))

    def _plan(self, spec: AttentionKernel, name: str, buffers: dict, params):
        """(kernel, blocks, shared bytes, arguments) of one attention launch."""
        d = int(params["head_dim"])
        dp = padded_head_dim(d)
        data = [buffers[a] for a in spec.args if a != "mask" and buffers.get(a) is not None]
        vec = 4 if d % 4 == 0 and all(b.data.ptr % 16 == 0 for b in data) else 1
        fn = self.loader.function(spec.source, name, {"FERRO_HEAD_DIM": dp, "FERRO_VEC": vec})
        smem = spec.shared_bytes(dp)
        limit = self._smem_limit
        if smem > limit:
            raise ValueError(f"{name} needs {smem} bytes of shared memory per block for "
                             f"head_dim {d}; this GPU allows {limit}")
        if fn.max_dynamic_shared_size_bytes < smem:
            fn.max_dynamic_shared_size_bytes = smem
        rows = int(params["seq_k"] if spec.per_kv_head else params["seq_q"])
        heads = int(params["kv_heads"] if spec.per_kv_head else params["heads"])
        blocks = -(-rows // spec.tile) * int(params["batch"]) * heads
        if blocks > GRID_X_MAX:
            raise ValueError(f"{name}: {blocks} blocks exceed the grid limit {GRID_X_MAX}")
        args = tuple(self._no_mask if buffers[a] is None and a == "mask" else buffers[a]
                     for a in spec.args)
        return fn, blocks, smem, args
