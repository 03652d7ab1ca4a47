"""Every engine that runs a model given as a folder or hub id, under its ``--engine`` name.

An engine is a function ``build(spec, settings, role=..., shares_device=...)`` that returns a
:class:`speceyes.backends.base.Backend` for the model ``spec`` under the
:class:`speceyes.factory.BackendSettings` ``settings``; ``role`` ("small" or "large") picks the
per-model settings (``settings.pixels(role)``) and ``shares_device`` says that another engine
runs in this process. Each engine imports its runtime (torch, vLLM) only when it builds, so
``--help`` and the registry itself load none. A new engine is one module with its backend and
its ``build`` function, and one entry in :data:`ENGINES`; ``--engine`` offers every entry.
Models behind URLs are not an engine: ``factory.make_backend`` serves any URL itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from speceyes.backends.base import Backend
    from speceyes.factory import BackendSettings


class Engine(Protocol):
    def __call__(
        self, spec: str, settings: BackendSettings, *, role: str, shares_device: bool
    ) -> Backend: ...


def build_hf(spec: str, settings: BackendSettings, *, role: str, shares_device: bool) -> Backend:
    """transformers in this process (``shares_device`` does not matter to it)."""
    from speceyes.backends.hf import HFBackend

    b = settings
    min_pixels, max_pixels = b.pixels(role)
    return HFBackend(
        spec,
        dtype=b.dtype,
        device_map=b.device_map,
        attn_implementation=b.attn,
        min_pixels=min_pixels,
        max_pixels=max_pixels,
        decoding=b.decoding,
    )


# Memory two vLLM engines in one process share when neither share is given: vLLM's own default
# (0.9 of the device) split evenly, so the second engine still finds its share free.
VLLM_SHARED_MEMORY = 0.9


def vllm_memory(b: BackendSettings, role: str, shares_device: bool) -> float | None:
    """The memory share of ``role``'s vLLM engine: its own setting; else, beside another
    engine, what the other's share leaves of ``VLLM_SHARED_MEMORY`` (half of it when neither is
    set); else None (vLLM's default)."""
    own = getattr(b, f"{role}_vllm_memory")
    if own is not None or not shares_device:
        return own
    other = getattr(b, f"{'large' if role == 'small' else 'small'}_vllm_memory")
    return VLLM_SHARED_MEMORY / 2 if other is None else max(VLLM_SHARED_MEMORY - other, 0.05)


def vllm_engine_options(b: BackendSettings, memory: float | None) -> dict[str, Any]:
    """``vllm.LLM`` keyword arguments of the engine settings that are set."""
    options: dict[str, Any] = {}
    if memory is not None:
        options["gpu_memory_utilization"] = memory
    if b.vllm_kv_cache_gib is not None:  # on CPU the same as VLLM_CPU_KVCACHE_SPACE
        options["kv_cache_memory_bytes"] = int(b.vllm_kv_cache_gib * 2**30)
    if b.vllm_max_model_len is not None:
        options["max_model_len"] = b.vllm_max_model_len
    if b.vllm_eager:
        options["enforce_eager"] = True
    return options


def build_vllm(spec: str, settings: BackendSettings, *, role: str, shares_device: bool) -> Backend:
    """The vLLM offline engine; a start that fails for memory names the flags to change."""
    from speceyes.backends.vllm import EngineStartError, VLLMBackend

    b = settings
    min_pixels, max_pixels = b.pixels(role)
    memory = vllm_memory(b, role, shares_device)
    try:
        return VLLMBackend(
            spec,
            dtype=b.dtype,
            tensor_parallel_size=b.tensor_parallel_size,
            min_pixels=min_pixels,
            max_pixels=max_pixels,
            decoding=b.decoding,
            **vllm_engine_options(b, memory),
        )
    except EngineStartError as e:
        if e.memory is False:
            raise
        share = "vLLM's default" if memory is None else f"{memory:g}"
        raise EngineStartError(
            f"{e} -- if memory is short, set --{role}-vllm-memory (the {role} model's share "
            f"of the device, now {share}), --vllm-kv-cache-gib or --vllm-max-model-len",
            e.memory,
        ) from e


ENGINES: dict[str, Engine] = {
    "hf": build_hf,  # transformers in-process
    "vllm": build_vllm,  # vLLM offline engine
}


def engine(name: str) -> Engine:
    """The engine registered under ``name``."""
    found = ENGINES.get(name)
    if found is None:
        raise ValueError(f"unknown engine {name!r}; choose from {', '.join(ENGINES)}")
    return found
