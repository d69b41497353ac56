"""Kernel launches with their arguments packed once.

A `Plan` is what one operation launches for one combination of shapes, dtypes, options, copy
width and stream: its kernels, grids, shared memory, workspace, and every argument packed into
the `void*[]` array that `cuLaunchKernel` takes. What changes from call to call, the buffers'
addresses, is written into their slots before each run; everything else was decided when the plan
was made. Running a plan is one driver call per kernel, no argument conversion, no allocation.
"""

from __future__ import annotations

import threading

import numpy as np

from .configs import TILE_COUNTER

NULL = np.uint64(0)  # a null pointer argument: no mask, lse or kv_lens
driver = None  # cupy.cuda.driver, imported at the first launch (this module imports no CuPy)


class PackedLaunch:
    """One kernel launch. `args` are its arguments in order: a named buffer (`Slot`), an array
    the plan owns (workspace: its address is fixed), NULL, or a NumPy scalar (np.uint32, or the
    packed parameter struct as a structured scalar), each stored once at its own alignment."""

    __slots__ = ("fn", "blocks", "threads", "smem", "args", "_values", "_slots", "_slot_view",
                 "_addr", "_addrs", "_function", "_seed_words")

    def __init__(self, fn, blocks: int, threads: int, smem: int, args):
        self.fn, self.blocks, self.threads, self.smem = fn, int(blocks), int(threads), int(smem)
        self.args = tuple(args)
        # Every Slot's address lives in one array, written through a memoryview on each run (a
        # memoryview item write is cheaper than a NumPy one); `_slots`: (index, name).
        slot_cells = np.zeros(max(1, sum(isinstance(a, Slot) for a in args)), np.uint64)
        self._slot_view = memoryview(slot_cells).cast("B").cast("Q")
        self._values, self._slots, self._function = [], [], None
        # (a uint32 view of a struct's cell, the index of its `seed` word): where a run writes
        # dropout's seed (the struct is copied by the driver at each launch)
        self._seed_words = []
        for a in args:
            if isinstance(a, Slot):
                i = len(self._slots)
                cell = slot_cells[i:i + 1]
                self._slots.append((i, a.name))
            elif isinstance(a, np.generic):  # np.uint32, np.uint64, the struct (np.void)
                cell = np.array([a])
            elif isinstance(a, np.ndarray) and a.ndim == 0:  # a struct as a 0-d array
                cell = a.reshape(1).copy()
            else:  # an array the plan owns: its address
                cell = np.array([address(a)], np.uint64)
            self._values.append(cell)
            fields = cell.dtype.fields
            if fields and "seed" in fields:
                self._seed_words.append((memoryview(cell.view(np.uint8)).cast("I"),
                                         fields["seed"][1] // 4))
        self._addrs = np.array([c.ctypes.data for c in self._values], np.uint64)
        self._addr = int(self._addrs.ctypes.data)

    @property
    def slot_names(self) -> tuple:
        return tuple(name for _, name in self._slots)

    def run(self, pointers: dict, stream: int, seed: int | None = None) -> None:
        """Write this call's buffer addresses (and dropout's `seed` word, unless None), then
        launch on `stream` (a CUstream handle). Not for two threads at once: they would write
        one argument array (`Plan.lock`)."""
        view = self._slot_view
        if self._function is None:
            self._function = self.fn.kernel.ptr  # the cupy.RawKernel's CUfunction
            global driver
            from cupy.cuda import driver
        for i, name in self._slots:
            view[i] = pointers[name]
        if seed is not None:
            for words, at in self._seed_words:
                words[at] = seed
        driver.launchKernel(self._function, self.blocks, 1, 1, self.threads, 1, 1, self.smem,
                            stream, self._addr, 0)


class Slot:
    """A buffer argument filled in on every run: `pointers[name]` (0 for an absent one)."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"Slot({self.name!r})"


class Plan:
    """The launches of one operation, in order; the float32 workspace they take (name -> shape,
    slots filled on each run like the buffers'); the workspace the backend made for it, by stream
    (when the caller supplies none); whether a launch takes the stream's tile counter."""

    __slots__ = ("launches", "workspace", "owned", "counted", "lock")

    def __init__(self, launches, workspace=None):
        self.launches = [x for x in launches if x.blocks]  # an empty grid launches nothing
        self.workspace = dict(workspace or {})
        self.owned: dict = {}
        # A launch claims its tiles from the stream's tile counter (the backend's, not workspace:
        # it must be zero before the launch, and the launch leaves it so)
        self.counted = any(TILE_COUNTER in x.slot_names for x in self.launches)
        # Held by a run from its workspace to its last launch: a run writes its addresses into
        # each launch's one argument array, and its launches share the stream's workspace, so
        # two threads running the plan at once must not interleave (one would launch with the
        # other's tensors, or read the statistics the other's first kernel wrote).
        self.lock = threading.Lock()

    def run(self, pointers: dict, stream: int, seed: int | None = None) -> None:
        with self.lock:
            for launch in self.launches:
                launch.run(pointers, stream, seed)


def address(a) -> int:
    """A CuPy array's or a torch tensor's device address (a NumPy array's host address: the
    tests' fake device)."""
    if isinstance(a, np.ndarray):
        return a.ctypes.data
    return a.data_ptr() if hasattr(a, "data_ptr") else a.data.ptr


class _StreamHandle:
    """A raw CUDA stream handle under the CUDA stream protocol (`__cuda_stream__`)."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = int(ptr)

    def __cuda_stream__(self):
        return (0, self.ptr)


def external_stream(xp, ptr: int, device: int):
    """A CuPy stream for the raw handle `ptr` of device `device` (the current device), to use as
    CuPy's current stream in a `with` block: `Stream.from_external` where CuPy has it (CuPy 14
    deprecates `ExternalStream`), else `ExternalStream`."""
    stream_cls = getattr(xp.cuda, "Stream", None)
    if hasattr(stream_cls, "from_external"):
        return stream_cls.from_external(_StreamHandle(ptr))
    return xp.cuda.ExternalStream(ptr, device)
