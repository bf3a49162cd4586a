"""CUDA-graph capture and replay on the CPU, with a real graph's rules.

`refuse_host_syncs()` refuses, while a round runs, every op that a CUDA capture cannot hold: any
op whose result's shape or a returned scalar depends on tensor values (torch tags them
dynamic_output_shape / data_dependent_output: nonzero, bincount, unique, masked_select,
`_local_scalar_dense` behind item/bool/int, equal), bool-mask indexing and index_put,
repeat_interleave without output_size, and reads to the host that no op dispatch shows on a CPU
tensor (`tolist`, `numpy`, `cpu`).

`Capture` records the round as a graph does: every aten op on the tensors it touched, and every
kernel launch (a Triton launch, tests/fake_flashinfer.py's MLA run: see `kernel`) as one opaque
call. `Capture.replay` runs that recording again without the round's Python: the same ops on the
same tensors, Python numbers as they were at capture, each op's result written into the tensor
the capture allocated for it (a graph's memory pool: fixed addresses). A value the round read on
the host at capture, or a tensor it replaced instead of updating in place, stays frozen, as in
a real replay.

`EmulatedGraphs` is RoundGraphs with capture and replay so emulated: the engine's graph path,
tensor parallelism included (each rank replays its collectives in the captured order), runs on
the CPU.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten

import dflash_batch.backends.flashinfer_attention as flashinfer_attention
from dflash_batch.engine.graphs import RoundGraphs
from dflash_batch.kernels import moe_mxfp4

aten = torch.ops.aten
HOST_READS = ("tolist", "numpy", "cpu")  # host copies no dispatch shows for a CPU tensor
_in_kernel: list[bool] = []  # a kernel's own body (the interpreter, an emulation) reads freely
_modes: list = []  # the guard or capture in force


class HostSync(AssertionError):
    """An op that would wait on the device inside a CUDA capture."""


def why_host_sync(func, args, kwargs) -> str | None:
    """Why running `func` on a CUDA tensor reads the device from the host (None: it does not)."""
    if func is aten.index.Tensor or func in (aten.index_put_.default, aten.index_put.default):
        if any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1]):
            return "bool-mask indexing (its result's length is the count of True)"
        return None
    if func is aten.repeat_interleave.Tensor:
        return None if kwargs.get("output_size") is not None else "repeat_interleave without output_size"
    if func is aten.is_nonzero.default:
        return "a tensor's truth value"
    if torch.Tag.dynamic_output_shape in func.tags:
        return "its result's shape depends on tensor values"
    if torch.Tag.data_dependent_output in func.tags:
        return "it returns a value read from a tensor"
    return None


class _RefuseHostSyncs(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        why = why_host_sync(func, args, kwargs)
        if why:
            raise HostSync(f"{func} inside a round: {why}")
        return self.run(func, args, kwargs)

    def run(self, func, args, kwargs):
        return func(*args, **kwargs)

    def launch(self, fn, args, kwargs):
        with _disable_current_modes():
            _in_kernel.append(True)
            try:
                return fn(*args, **kwargs)
            finally:
                _in_kernel.pop()


def kernel(fn):
    """Mark `fn` as a device kernel: inside a capture or the guard its body runs unguarded (it
    emulates device code, which may read its own buffers), and a capture records the call whole,
    so that a replay launches it again with the same arguments."""
    @functools.wraps(fn)
    def launch(*args, **kwargs):
        mode = _modes[-1] if _modes and not _in_kernel else None
        return mode.launch(fn, args, kwargs) if mode else fn(*args, **kwargs)
    return launch



@contextlib.contextmanager
def _guarded(mode: _RefuseHostSyncs):
    from triton.runtime.interpreter import GridExecutor  # Triton kernels run through it on a CPU

    saved = {name: getattr(torch.Tensor, name) for name in HOST_READS}
    triton_launch = GridExecutor.__call__

    def refuse(name):
        original = saved[name]

        def read(self, *args, **kwargs):
            if not _in_kernel:
                raise HostSync(f"Tensor.{name} inside a round: a copy to the host")
            return original(self, *args, **kwargs)
        return read

    try:
        for name in HOST_READS:
            setattr(torch.Tensor, name, refuse(name))
        GridExecutor.__call__ = kernel(triton_launch)
        _modes.append(mode)
        with mode:
            yield mode
    finally:
        _modes.pop()
        GridExecutor.__call__ = triton_launch
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


def refuse_host_syncs():
    """A context in which every host-waiting op raises HostSync (see the module's docstring)."""
    return _guarded(_RefuseHostSyncs())


class Capture(_RefuseHostSyncs):
    """A recording of the ops and kernel launches a round makes (refusing host syncs as it goes)."""

    def __init__(self):
        super().__init__()
        self.steps: list[tuple] = []

    def run(self, func, args, kwargs):
        out = func(*args, **kwargs)
        self.steps.append((func, args, kwargs, out))
        return out

    def launch(self, fn, args, kwargs):
        out = super().launch(fn, args, kwargs)
        self.steps.append((fn, args, kwargs, out))
        return out

    def record(self):
        return _guarded(self)

    def replay(self) -> None:
        for fn, args, kwargs, out in self.steps:
            fresh = fn(*args, **kwargs)
            for old, new in zip(tree_flatten(out)[0], tree_flatten(fresh)[0]):
                if isinstance(new, torch.Tensor):
                    if new.untyped_storage().data_ptr() != old.untyped_storage().data_ptr():
                        old.copy_(new)  # into the capture's memory, where later steps read it
                elif hasattr(new, "wait"):  # a collective's work handle
                    new.wait()


def every_expert(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, width: int, experts: int,
                 expert) -> torch.Tensor:
    """moe_mxfp4.routed_sum without its grouping by expert on the host: every expert runs
    on every row, times its routing weight (0 where not chosen), experts in the same ascending
    order. The CPU's MoE takes this form inside an emulated capture; on the GPU the Triton MoE
    groups on the device (tests/test_round_host_reads.py runs it under the guard)."""
    out = x.new_zeros(x.shape[0], width)
    for e in range(experts):
        out += (weights * (ids == e)).sum(-1, keepdim=True) * expert(e, x)
    return out


class EmulatedGraphs(RoundGraphs):
    def _capture(self, size: int, greedy: bool, width: int) -> None:
        self.step.attention.plan_round(self.batch, size, {"draft": [], "verify": []}, graph=True,
                                       widths={"verify": width})
        for _ in range(2):  # warm-up, as graphs.py does
            self._run(size, greedy, width)
        graph = Capture()
        # The backend takes its graph wrappers; the CPU's MoE its capturable form.
        saved = flashinfer_attention.capturing, moe_mxfp4.routed_sum
        flashinfer_attention.capturing = lambda device: True
        moe_mxfp4.routed_sum = every_expert
        try:
            with graph.record():
                self._run(size, greedy, width)
        finally:
            flashinfer_attention.capturing, moe_mxfp4.routed_sum = saved
        self.graphs[(size, greedy, width)] = graph

    def replay(self, size: int, greedy: bool, width: int | None = None) -> None:
        self.graphs[(size, greedy, width or self.batch.block)].replay()
