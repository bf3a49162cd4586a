"""Kimi Delta Attention through flash-linear-attention's Triton kernels (fla-core), in the layouts
of dflash_batch/models/layers/kda.py, whose torch functions they must equal:

    q, k [*B, T, H, K] (L2-normalised, not scaled), v [*B, T, H, V], g [*B, T, H, K] (log decay),
    beta [*B, T, H], state [*B, H, K, V] float32 or None -> (o [*B, T, H, V] float32, new state)

`recurrent` (verify and the replay commit: a few rows, any batch) is fla's fused recurrent
kernel, which also runs on the CPU under TRITON_INTERPRET=1; `chunked` (prefill: one sequence,
thousands of rows) is fla's chunked kernel, autotuned, so CUDA only. fla is imported at first use:
machines without it never import it (`available`).

fla autotunes each chunked kernel over its whole config list (6 to 36 configs, 85 in all) for
every new head shape, compiling one config after another: minutes. With $DFLASH_FLA_CONFIGS
naming a JSON file whose "fla_configs" maps each of those kernels to one config, each is pinned
to it (`pin_autotune`): nothing is benchmarked, one compile per kernel. The GPU check sets it to
the file its carried Triton cache was built with (benchmarks/triton_cache.py). Unset, fla tunes.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import json
import os
import sys

import torch

PIN_ENV = "DFLASH_FLA_CONFIGS"


@functools.cache
def available() -> bool:
    """fla-core is installed (asked once: the model asks on every KDA layer's forward)."""
    return importlib.util.find_spec("fla") is not None


def autotuned_kernels() -> dict:
    """fla's loaded autotuners by kernel name (an autotuner may sit under triton.heuristics)."""
    from triton.runtime.autotuner import Autotuner

    found = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith("fla.") or module is None:
            continue
        for obj in vars(module).values():
            while obj is not None and not isinstance(obj, Autotuner):
                obj = getattr(obj, "fn", None)
            if obj is not None:
                found[obj.base_fn.__name__] = obj
    return found


def pin_autotune(configs: dict[str, dict], source: str = "the table") -> None:
    """Restrict each named autotuned fla kernel to one config {"kwargs": {...}, "num_warps": w,
    "num_stages": s}; a name fla does not have (another fla version) is an error."""
    import triton

    tuners = autotuned_kernels()
    if unknown := sorted(set(configs) - set(tuners)):
        raise ValueError(f"{source} pins {', '.join(unknown)}, which fla {_fla_version()} does not autotune: "
                         f"rebuild it (python benchmarks/triton_cache.py build)")
    for name, c in configs.items():
        tuners[name].configs = [triton.Config(c["kwargs"], num_warps=c["num_warps"], num_stages=c["num_stages"])]


def _fla_version() -> str:
    return importlib.metadata.version("fla-core")


@functools.cache
def _pin_from_env() -> None:
    """Pins fla's chunked kernels from $DFLASH_FLA_CONFIGS, once per process (after chunk_kda's
    import has loaded every kernel it runs)."""
    path = os.environ.get(PIN_ENV)
    if not path:
        return
    try:
        configs = json.loads(open(path).read())["fla_configs"]
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"{PIN_ENV}={path}: no readable \"fla_configs\" table ({type(e).__name__}: {e})") from e
    pin_autotune(configs, f"{PIN_ENV}={path}")


def _fla_layout(single: bool, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """fla takes contiguous float32 [B, T, ...]: a single sequence [T, ...] gets a batch dim of 1."""
    return tuple((x.unsqueeze(0) if single else x).to(torch.float32).contiguous() for x in xs)


def recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    single = q.dim() == 3
    q, k, v, g, beta = _fla_layout(single, q, k, v, g, beta)
    if state is None:
        state = q.new_zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[3])
    else:
        state, = _fla_layout(single, state)
    # The kernel reads the start state and writes the final one to a new tensor (the caller
    # decides whether it is committed); o is written in float32, as the torch path returns it.
    out, final = fused_recurrent_kda_fwd(q, k, v, g, beta, initial_state=state, output_final_state=True,
                                         inplace_final_state=False, out=torch.empty_like(v))
    return (out[0], final[0]) if single else (out, final)


def chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence [T, H, .] from `state` [H, K, V]."""
    from fla.ops.kda import chunk_kda

    _pin_from_env()
    q, k, v, g, beta = _fla_layout(True, q, k, v, g, beta)
    initial = None if state is None else _fla_layout(True, state)[0]
    out, final = chunk_kda(q, k, v, g, beta, initial_state=initial, output_final_state=True)
    return out[0], final[0]
