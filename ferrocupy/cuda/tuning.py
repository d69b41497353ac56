"""What tuning scripts (sweeps, probes, profiles: the repository's lab/) need from the CUDA
backend, through its public planning: run one kernel variant instead of the table's choice, force
the decode's split count, and run an operation's launches one at a time to time each.

    backend = CudaBackend(table=tuning.forcing(variant))   # that variant, or a ValueError
    for launch in tuning.launches(backend, "forward", dict(q=q, k=k, v=v, out=out), params):
        launch()                                           # each kernel alone, in order
    run = tuning.kernels_only(eng.backend, eng.plan_attention(...), pointers, stream)
    run()                            # a planned call's kernels, without its per-call checks

A kernel's source can be replaced too, without touching the package: `KernelLoader`'s overlay
directory (`FERROCUPY_KERNEL_OVERLAY`) is searched before the package's for every source and
header."""

from __future__ import annotations

import contextlib

import numpy as np

from ..params import contiguous_layout
from . import configs
from .launch import address

# The buffers each operation's plan takes, in the engine's order; absent ones are None.
BUFFERS = {
    "forward": ("q", "k", "v", "out", "mask", "lse", "kv_lens"),
    "backward": ("q", "k", "v", "out", "grad_out", "grad_q", "grad_k", "grad_v", "mask", "lse"),
}


def forcing(variant: configs.Variant, table: dict | None = None) -> dict:
    """The kernel table (default `configs.TABLE`) with `variant` the only candidate for its (op,
    dtype, padded head_dim): a backend on it runs that variant, or raises ValueError where the
    variant cannot run (shared memory, architecture, copy width, a mask on a `plain` build),
    never another one in its place."""
    if variant.head_dim != configs.padded_head_dim(variant.head_dim):
        raise ValueError(f"forcing: {variant.describe()} has head_dim {variant.head_dim}, not a "
                         f"padded one (a multiple of 16)")
    table = dict(configs.TABLE if table is None else table)
    table[(variant.op, np.dtype(variant.dtype), variant.head_dim)] = (variant,)
    return table


def shared_memory_limit(device: int | None = None) -> int:
    """Bytes of shared memory one block may opt in to on `device` (default: the current one):
    the limit `configs.select` fits variants to."""
    import cupy

    return cupy.cuda.Device(device).attributes["MaxSharedMemoryPerBlockOptin"]


@contextlib.contextmanager
def decode_splits(n: int):
    """Within the block, decode plans split each (batch, KV head)'s keys `n` ways (fewer where
    there are fewer key tiles), to time split counts against `configs.decode_splits`' choice.
    It acts on launches planned inside the block (`launches`); an engine's kept plan made before
    it keeps its own split."""
    if n < 1:
        raise ValueError(f"decode_splits: n must be >= 1, not {n}")
    chosen = configs.decode_splits

    def forced(pairs, reach, step, slots, max_splits=configs.DECODE_MAX_SPLITS):
        tiles = max(1, -(-reach // step))
        per = -(-tiles // min(n, tiles))
        return -(-tiles // per), per * step

    configs.decode_splits = forced  # the backend looks it up in configs when it plans
    try:
        yield
    finally:
        configs.decode_splits = chosen


class Launch:
    """One kernel launch of a plan, runnable alone: `launch()` queues it on the stream it was
    made for. `kernel` is the kernel's name, `blocks`/`threads`/`shared_bytes` its launch shape,
    `args` its arguments as planned (buffers are named slots; for decode, `arg("splits")`)."""

    def __init__(self, packed, pointers: dict, stream: int, workspace: list):
        self._packed, self._pointers, self._stream = packed, pointers, stream
        self._workspace = workspace  # the arrays `pointers` names, alive as long as this
        self.kernel = getattr(packed.fn, "name", "?")
        self.blocks, self.threads, self.shared_bytes = packed.blocks, packed.threads, packed.smem
        self.args = packed.args

    def arg(self, name: str):
        """The planned argument `name` of a decode kernel's launch (`configs.ARGS[DECODE]`)."""
        return self.args[configs.ARGS[configs.DECODE].index(name)]

    def __call__(self) -> None:
        self._packed.run(self._pointers, self._stream)

    def __repr__(self) -> str:
        return (f"Launch({self.kernel}, {self.blocks} x {self.threads} threads, "
                f"{self.shared_bytes} B shared)")


def launches(backend, op: str, buffers: dict, params, layout=None,
             stream: int | None = None) -> list[Launch]:
    """The launches `backend` plans for `op` ("forward" or "backward") on `buffers` (CuPy
    arrays by name, see BUFFERS; missing ones are absent), in order, each runnable alone on
    `stream` (default: CuPy's current). Their workspace (decode splits, backward statistics,
    tile counter) is made here and kept by the launches: running all of them in order computes
    what `backend.forward` / `backward` does. The plan is the backend's, so it follows its table
    (see `forcing`)."""
    if op not in BUFFERS:
        raise ValueError(f"launches: op must be one of {sorted(BUFFERS)}, not {op!r}")
    unknown = set(buffers) - set(BUFFERS[op])
    if unknown:
        raise ValueError(f"launches: {op} takes no buffer {sorted(unknown)}; it takes "
                         f"{BUFFERS[op]}")
    buffers = {n: buffers.get(n) for n in BUFFERS[op]}
    pointers = {n: 0 if b is None else address(b) for n, b in buffers.items()}
    plan = backend.plan(op, buffers, params,
                        contiguous_layout(params) if layout is None else layout, pointers)
    xp = backend.xp
    if stream is None:
        stream = xp.cuda.get_current_stream().ptr
    keep = []
    for name, shape in plan.workspace.items():
        # the decode's tickets start at zero, and every launch leaves them so
        keep.append((xp.zeros if name == configs.TICKETS else xp.empty)(shape, dtype=np.float32))
        pointers[name] = address(keep[-1])
    if plan.counted:  # a persistent kernel's tile counter: zero, and each launch leaves it so
        keep.append(xp.zeros(1, dtype=np.uint32))
        pointers[configs.TILE_COUNTER] = address(keep[-1])
    return [Launch(p, pointers, stream, keep) for p in plan.launches]


def kernels_only(backend, plan, pointers: dict, stream: int):
    """A call that runs an engine plan's kernels (`ComputeEngine.plan_attention` and the like)
    alone, on `pointers` (device addresses by the plan's argument names; those absent are 0) on
    `stream` (a raw CUDA stream handle): the front door's per-call checks, which read index
    tensors (kv_lens, block tables, cu_seqlens) to the host, stay out of what is timed. Run the
    plan itself once first, so its checks have passed on these inputs."""
    pointers = dict.fromkeys(plan.names, 0) | pointers
    launch = backend.plan(plan.op, plan.specs, plan.params, plan.layout, pointers, plan.extras)
    return lambda: backend.run_plan(launch, pointers, stream)
