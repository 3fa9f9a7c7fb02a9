"""The ``engine`` section of a model: ONNX Runtime session options and the execution-provider chain."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from protocol.settings_section import Section

__all__ = ["GRAPH_CAPTURE_OPTIONS", "PROVIDERS", "EngineSettings"]

PROVIDERS = ("TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider")
GRAPH_CAPTURE_OPTIONS = {"CUDAExecutionProvider": "enable_cuda_graph",
                         "TensorrtExecutionProvider": "trt_cuda_graph_enable"}
"""Each GPU provider's own option to capture runs as CUDA graphs: refused in ``provider_options`` (the fleet's
runs change shape); ``engine.cuda_graph`` sets the CUDA one where the shapes are fixed."""


class EngineSettings(Section):
    """ONNX Runtime session options and the execution-provider chain."""

    providers: list[str] = Field(default_factory=lambda: list(PROVIDERS))
    provider_options: dict[str, dict[str, Any]] = Field(default_factory=dict)
    require_provider: str | None = Field(
        default=None, description="Fail start-up unless this provider is active in the session."
    )
    graph_optimization_level: Literal["disable", "basic", "extended", "all"] = "all"
    intra_op_threads: int = Field(default=0, ge=0, le=256, description="0 lets ORT choose.")
    inter_op_threads: int = Field(default=1, ge=0, le=256)
    allow_spinning: bool | Literal["bounded"] = Field(
        default="bounded",
        description="ORT intra-op spin-waiting on CPU. 'bounded' (default): spin at most spin_duration_us after "
        "each run, so back-to-back generation steps find the threads awake while an idle worker stops spinning "
        "within that bound; true: ORT's own spin (keeps a core busy after every run, time Celery and Redis "
        "need); false: threads sleep as soon as a run ends. Figures: docs/spinning.md.",
    )
    spin_duration_us: int = Field(
        default=2000, ge=1, le=1_000_000,
        description="With allow_spinning 'bounded': how long ORT's threads spin after a run before they sleep "
        "(microseconds).",
    )
    trt_fp16: bool = True
    trt_int8: bool = False
    cache_dir: Path = Field(default=Path("var/trt-cache"), description="TensorRT engine + timing caches.")
    warmup: bool = Field(default=True, description="Run the extreme shapes once before consuming.")
    report_placement: bool = Field(
        default=True,
        description="At load, count the nodes each execution provider runs in the served graph (one "
        "profiled 1x1 run, profiling then off) for the heartbeat, `fleet status` and fleet_engine_nodes.",
    )
    lm_head_last: bool = Field(
        default=True,
        description="Causal LMs: rewrite the graph in memory at load so logits are computed at the last "
        "position only (tools/lm_head_last.py); skipped for files with external data.",
    )
    kv_cache: Literal["auto", "in_place", "concat"] = Field(
        default="auto",
        description="Causal LMs: 'in_place' rewrites each layer's attention at load into ONNX Runtime's "
        "GroupQueryAttention so the KV cache is a preallocated buffer written at each sequence's own "
        "position (tools/inplace_kv.py; a join or leave moves no other sequence's cache, a decode step copies "
        "no past), checked against the original graph on a probe; 'concat' serves the graph's own "
        "Concat cache; 'auto' = in_place where it applies (the CPU provider, or a GPU chain with the CUDA "
        "provider and a float16 graph; a graph the rewrite matches; the probe equal), concat otherwise, with "
        "the reason logged.",
    )

    cuda_graph: bool = Field(
        default=False,
        description="Causal LMs on the CUDA provider: capture each decode step as a CUDA graph and replay it "
        "(ONNX Runtime's enable_cuda_graph), one graph per span of KV slots, so a step costs one graph launch "
        "instead of a kernel launch per node. Needs the in-place KV cache (fixed-shape steps at fixed "
        "addresses) and a chain whose GPU provider is CUDA alone; otherwise, or when ONNX Runtime refuses the "
        "capture at load, the steps run without graphs and the reason is logged. Figures: docs/gpu.md.",
    )

    @field_validator("providers", "require_provider")
    @classmethod
    def _known_providers(cls, value: list[str] | str | None) -> list[str] | str | None:
        """Each name a provider ONNX Runtime has; checked per field, so an error names ``engine.providers`` or
        ``engine.require_provider``, not the whole section."""
        names = [value] if isinstance(value, str) else list(value or [])
        for name in names:
            if name not in PROVIDERS:
                raise ValueError(f"unknown execution provider {name!r}; known: {', '.join(PROVIDERS)}")
        if isinstance(value, list) and not value:
            raise ValueError("providers must name at least one execution provider")
        return value

    @model_validator(mode="after")
    def _graphs_through_cuda_graph(self) -> EngineSettings:
        for provider, option in GRAPH_CAPTURE_OPTIONS.items():
            if str(self.provider_options.get(provider, {}).get(option, "0")).lower() not in ("0", "false"):
                raise ValueError(
                    f"provider_options.{provider}.{option}: ONNX Runtime would capture the first run's shapes "
                    "and replay them for every later run, whatever its batch; set engine.cuda_graph: true "
                    "instead (the decode steps of the in-place KV cache, one graph per span of slots)")
        return self
