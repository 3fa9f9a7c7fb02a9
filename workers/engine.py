"""The ONNX Runtime engine: one session per worker process, inputs bound by name.

It follows Hugging Face optimum's I/O convention: ``input_ids``, ``attention_mask``,
``position_ids``, ``token_type_ids``, ``past_key_values.{i}.key/.value`` in; ``logits`` or
``last_hidden_state`` out (``present.*`` are computed but never fetched). A model without
``past_key_values`` inputs works too.

Provider chain: TensorRT → CUDA → CPU by default (:func:`workers.session_config.provider_chain`, with
the session options and the served graph), opened one step at a time so each provider keeps its
options (:mod:`workers.ort_session`). onnxruntime-gpu on a machine without a GPU falls back to
CPU with nothing more than a line on stderr, so every step's outcome and the active providers are
logged and ``require_provider`` turns a fallback into a loud start-up failure.

Node placement (``engine.report_placement``, on by default): the session is created with ONNX
Runtime's profiler on, runs one 1 x 1 batch, and ends profiling, which ORT never restarts for that
session, so steady-state runs are not profiled. The count of nodes each provider ran
(:mod:`workers.placement`) is :attr:`Engine.placement`, logged in one line (WARNING when a GPU
session runs more than 10 % of its nodes on the CPU).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import onnxruntime as ort

from protocol.errors import ModelLoadError, ProviderUnavailable
from protocol.modelcard import ModelCard
from protocol.pooling import Pooling, load_pooling
from protocol.settings import BatchingSettings, EngineSettings, LimitSettings
from protocol.validation import input_token_limit
from workers.cuda_graph import NO_GRAPH, capture_active, cuda_graph_chain, open_capturing, run_options
from workers.inplace_graph import KVChoice, inplace_source
from workers.int8_providers import int8_placement_warning
from workers.kv_dtype import kv_dtype
from workers.ort_session import ProviderStep, open_session
from workers.padding import PaddedBatch, pad_batch
from workers.placement import format_nodes, placement_warning, read_placement
from workers.session_config import (
    check_single_ort_build,
    graph_input_names,
    provider_chain,
    serving_graph,
    session_options,
)

__all__ = [
    "Engine",
    "check_single_ort_build",
    "graph_input_names",
    "provider_chain",
    "serving_graph",
    "session_options",
]

log = logging.getLogger("fleet.engine")


class Engine:
    """One InferenceSession plus the knowledge of how to feed it a padded batch."""

    def __init__(
        self,
        model_path: Path,
        card: ModelCard,
        engine: EngineSettings,
        batching: BatchingSettings,
        limits: LimitSettings,
    ) -> None:
        if not model_path.exists():
            raise ModelLoadError(f"model file {model_path} does not exist", "path", str(model_path))
        self.card = card
        self.model_path = model_path
        # read before the session opens: a pooling the fleet cannot serve refuses the model at load
        self.pooling = load_pooling(model_path, card.hidden_size) if card.kind == "encoder" else Pooling()
        """How an encoder's token vectors become one vector (its sentence-transformers modules.json)."""
        self.max_batch_size = batching.max_batch_size
        self.max_input_tokens = input_token_limit(limits, card.max_positions)  # as every request is checked
        if limits.max_input_tokens > card.max_positions:  # requests are checked against the smaller one
            log.warning("model %s %s: limits.max_input_tokens=%d is above the model's max_positions=%d: requests of "
                        "more than %d tokens are refused (InputTooLong naming input_ids)", card.name, card.version,
                        limits.max_input_tokens, card.max_positions, card.max_positions)  # fmt: skip
        trt = "TensorrtExecutionProvider" in ort.get_available_providers()
        names = graph_input_names(model_path) if trt else []
        self.requested = provider_chain(engine, batching, limits, card, names)
        self.ort_build = check_single_ort_build()
        source, self.lm_head_last = serving_graph(model_path, engine, card)
        self.concat_source = source
        """The served graph before the in-place rewrite (the generation loop's probe compares against it)."""
        self.kv: KVChoice = inplace_source(source, engine, card, [n for n, _ in self.requested])
        source = self.kv.source
        graph_chain, self.cuda_graph_reason = cuda_graph_chain(self.requested, engine, self.kv)
        """Why decode steps run without CUDA graphs though ``engine.cuda_graph`` asks for them (None: not asked,
        or they run with them: :attr:`cuda_graph`)."""
        # the profile is written at end_profiling (in __init__, below); the folder goes with it
        profile_dir = tempfile.mkdtemp(prefix="fleet-placement-") if engine.report_placement else None
        try:
            self._open(source, engine, profile_dir, graph_chain)
            self.placement: dict[str, int] | None = self._count_placement() if profile_dir else None
            """Nodes of the served graph per execution provider (None: ``engine.report_placement`` off)."""
        except BaseException:
            if profile_dir and hasattr(self, "session"):  # refused after opening: write no profile later
                with contextlib.suppress(Exception):
                    self.session.end_profiling()
            raise
        finally:
            if profile_dir:
                shutil.rmtree(profile_dir, ignore_errors=True)

    def _open(self, source: str | bytes, engine: EngineSettings, profile_dir: str | None,
              graph_chain: list[tuple[str, dict[str, Any]]]) -> None:
        """Open the session on ``graph_chain`` (the requested chain, with CUDA graph capture where asked for
        and possible), profiling into ``profile_dir`` when set, and check it. A session asked for graphs
        that ONNX Runtime does not give them (it refuses the CUDA step) is reopened on the requested chain.

        Raises:
            ModelLoadError / ProviderUnavailable: see :class:`Engine`.
        """
        card, model_path = self.card, self.model_path
        started = time.perf_counter()

        def options() -> ort.SessionOptions:
            opts = session_options(engine)
            if profile_dir:
                opts.enable_profiling = True
                opts.profile_file_prefix = os.path.join(profile_dir, "placement")
            return opts

        try:
            self.session, self.provider_steps, refused = open_capturing(
                lambda chain: open_session(source, options, chain), graph_chain, self.requested)
            self.cuda_graph_reason = refused or self.cuda_graph_reason
        except Exception as exc:  # ORT raises its own Fail/InvalidGraph types
            raise ModelLoadError(f"cannot load {model_path}: {exc}", "path", str(model_path)) from exc
        self.cuda_graph = capture_active(self.provider_steps)
        """True when decode steps of the in-place cache are captured and replayed as CUDA graphs."""
        self.run_options: ort.RunOptions | None = run_options(NO_GRAPH) if self.cuda_graph else None
        """The options of every run that is not a decode step (None: no graphs in this session)."""
        self._graph_ids = itertools.count(1)
        if self.cuda_graph:
            log.info("model %s %s: decode steps captured and replayed as CUDA graphs (one per span of KV slots)",
                     card.name, card.version)
        elif self.cuda_graph_reason:
            log.warning("model %s %s: engine.cuda_graph is on but decode steps run without CUDA graphs: %s",
                        card.name, card.version, self.cuda_graph_reason)
        self.load_ms = (time.perf_counter() - started) * 1000
        self.providers: list[str] = list(self.session.get_providers())
        log.info(
            "model %s %s loaded in %.0f ms (logits at the last position only: %s) with %s; "
            "providers requested %s; ACTIVE %s",
            card.name,
            card.version,
            self.load_ms,
            self.lm_head_last,
            self.ort_build,
            [n for n, _ in self.requested],
            self.providers,
        )
        self._log_steps(self.provider_steps)
        int8_warning = int8_placement_warning(model_path, self.providers)
        if int8_warning:
            log.warning("model %s %s: %s", card.name, card.version, int8_warning)
        if engine.require_provider and engine.require_provider not in self.providers:
            raise ProviderUnavailable(
                f"require_provider={engine.require_provider} but the session runs on {self.providers} "
                f"(this onnxruntime build offers {ort.get_available_providers()}; "
                f"{engine.require_provider}: {self._why_not(engine.require_provider)})",
                "engine.require_provider",
                engine.require_provider,
            )
        self._inputs = {i.name: i for i in self.session.get_inputs()}
        outputs = [o.name for o in self.session.get_outputs()]
        self._past = sorted(n for n in self._inputs if n.startswith("past_key_values."))
        self.kv_dtype = kv_dtype([self._inputs[n] for n in self._past])
        """numpy type of the KV cache (float32 or float16: the graph's ``past_key_values.*`` inputs)."""
        if card.kind == "causal_lm":
            if "logits" not in outputs:
                raise ModelLoadError(
                    f"{model_path} has no 'logits' output (has {outputs})", "outputs", "logits"
                )
            self.output_name = "logits"
        else:
            if "last_hidden_state" not in outputs:
                raise ModelLoadError(
                    f"{model_path} has no 'last_hidden_state' output (has {outputs})",
                    "outputs",
                    "last_hidden_state",
                )
            self.output_name = "last_hidden_state"
        if "input_ids" not in self._inputs:
            raise ModelLoadError(f"{model_path} has no 'input_ids' input", "inputs", "input_ids")

    def _count_placement(self) -> dict[str, int]:
        """Run one 1 x 1 batch under the profiler, end profiling, and log the nodes per provider."""
        token = min(self.card.vocab_size - 1, 3)
        self.run(pad_batch([[token]], self.card.pad_token_id))
        nodes = read_placement(self.session)
        warn = placement_warning(nodes, self.providers)
        log.log(
            logging.WARNING if warn else logging.INFO,
            "model %s %s: nodes per provider: %s (of %d)%s",
            self.card.name,
            self.card.version,
            format_nodes(nodes),
            sum(nodes.values()),
            "; more than 10 % on the CPU in a GPU session: each copies tensors across the bus at every run"
            if warn
            else "",
        )
        return nodes

    def next_graph_id(self) -> int:
        """A CUDA graph id no other run of this session uses (1, 2, ...): one per captured step shape."""
        return next(self._graph_ids)

    def _why_not(self, provider: str) -> str:
        """The recorded reason ``provider`` is not active (not in the chain, or its step's reason)."""
        for step in self.provider_steps:
            if step.provider == provider and step.reason:
                return step.reason
        return "not in engine.providers, or not in this onnxruntime build"

    def _log_steps(self, steps: list[ProviderStep]) -> None:
        """One line per provider of the chain: the options requested and applied, or why it is not active."""
        for step in steps:
            if step.active:
                log.info("execution provider %s ACTIVE; options requested %s; applied %s",
                         step.provider, step.requested, step.applied)
            else:
                log.warning("execution provider FALLBACK: %s (options requested %s) not active: %s",
                            step.provider, step.requested, step.reason)

    @property
    def has_kv_cache(self) -> bool:
        """True when the graph takes ``past_key_values.*`` (it can generate with a KV cache)."""
        return bool(self._past)

    @property
    def on_cpu_only(self) -> bool:
        """True when no GPU provider is active."""
        return self.providers == ["CPUExecutionProvider"]

    def feeds(self, batch: PaddedBatch) -> dict[str, npt.NDArray[Any]]:
        """The session inputs for ``batch``, by name; empty KV caches for a prefill."""
        feeds: dict[str, npt.NDArray[Any]] = {"input_ids": batch.input_ids}
        if "attention_mask" in self._inputs:
            feeds["attention_mask"] = batch.attention_mask
        if "position_ids" in self._inputs:
            feeds["position_ids"] = batch.position_ids
        if "token_type_ids" in self._inputs:
            feeds["token_type_ids"] = np.zeros_like(batch.input_ids)
        rows = batch.input_ids.shape[0]
        for name in self._past:
            feeds[name] = np.zeros((rows, self.card.kv_heads, 0, self.card.head_dim), dtype=self.kv_dtype)
        return feeds

    def run(self, batch: PaddedBatch) -> npt.NDArray[np.float32]:
        """One forward pass: ``logits`` [b, s, vocab] or ``last_hidden_state`` [b, s, dim]."""
        (out,) = self.session.run([self.output_name], self.feeds(batch), self.run_options)
        return np.asarray(out, dtype=np.float32)

    def warm_up(self) -> float:
        """Run the extreme shapes (1 x 1 and max_batch_size x max_input_tokens) once; returns ms."""
        started = time.perf_counter()
        for rows, width in ((1, 1), (self.max_batch_size, self.max_input_tokens)):
            token = min(self.card.vocab_size - 1, 3)
            self.run(pad_batch([[token] * width for _ in range(rows)], self.card.pad_token_id))
        elapsed = (time.perf_counter() - started) * 1000
        log.info(
            "warm-up at shapes 1x1 and %dx%d took %.0f ms",
            self.max_batch_size,
            self.max_input_tokens,
            elapsed,
        )
        return elapsed
