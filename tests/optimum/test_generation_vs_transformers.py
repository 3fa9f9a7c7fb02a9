"""Greedy generation under continuous batching gives exactly transformers' own tokens, on real optimum exports.

A tiny random-weight GPT-2 and a tiny random Llama with grouped-query attention (2 KV heads for 4
query heads) are built, exported by Hugging Face optimum to ONNX ``text-generation-with-past``, and
run through ``generate()`` by transformers, one prompt at a time (``export_models.py``, run inside
``var/optimum-venv``: torch, transformers, optimum, built once, about a minute). Then a real
``celery worker`` per model serves the export, the prompts (1 to 60 tokens, 1 to 40 new tokens)
arrive in a seeded random order, join the running batch at different decode steps, and every
request's ``generation.token_ids`` (and finish reason: one EOS is chosen so that some requests end
with 'stop') must equal transformers' exactly.

Sharing is made by the queue, not by the clock: each round queues a burst in one Redis step, which
the worker takes in one take. The burst is larger than ``MAX_BATCH_SIZE``, so the rest of it joins
as running requests leave. Requests sent one by one at random gaps after it join or miss the batch as
the machine's timing lets them; their tokens are checked all the same.

Offline, or on a machine without the CPU torch wheel, the tier skips (see ``tests/tier_venv.py``).
"""

from __future__ import annotations

import os
import random
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from producer.client import FleetClient
from protocol.errors import FleetError
from protocol.messages import GenerationParams, InferenceRequest, InferenceResult, OutputSpec
from tests.integration.fleet_fixtures import Fleet
from tests.tier_venv import pip_install_or_skip
from tools.redis_server import EmbeddedRedis

pytestmark = [pytest.mark.optimum, pytest.mark.timeout(900)]  # the first run builds the venv (about a minute)

MODELS = ("hf-gpt2", "hf-llama")
ARRIVAL_SEED = 7
MAX_GAP_S = 0.02
"""Largest random pause between two submissions (s): a few decode steps of these tiny models."""
MAX_BATCH_SIZE = 8
CONCURRENCY = 16


@pytest.fixture
def served(request: pytest.FixtureRequest, exports: tuple[Path, dict[str, Any]], redis_server: EmbeddedRedis,
           tmp_path: Path) -> Iterator[tuple[FleetClient, dict[str, Any]]]:
    """A real worker serving ``request.param``'s export; yields a client and that model's references."""
    model: str = request.param
    out, refs = exports
    spec = refs["models"][model]
    fleet = Fleet(tmp_path, out, redis_server.url)
    try:
        cfg = fleet.config(
            worker={"model": model, "concurrency": CONCURRENCY},
            models={model: {
                "path": str(out / spec["onnx"]),
                "batching": {"max_batch_size": MAX_BATCH_SIZE, "max_wait_ms": 2.0},
                "limits": {"max_input_tokens": 128, "max_new_tokens": 64},
                "engine": {"intra_op_threads": 1, "kv_cache": "in_place"},  # refuses to load if not in place
            }},
        )
        fleet.worker(cfg, model=model, concurrency=CONCURRENCY)
        yield fleet.client(cfg), spec
    finally:
        fleet.close()


def _submit(client: FleetClient, model: str, requests: list[dict[str, Any]], burst: int) -> list[str]:
    """Queue the first ``burst`` requests of a seeded random order in one Redis step, then send the rest
    one by one, pausing a seeded random 0 to ``MAX_GAP_S`` seconds before each; returns the ids in
    ``requests`` order."""
    rng = random.Random(ARRIVAL_SEED)
    order = list(range(len(requests)))
    rng.shuffle(order)

    def build(i: int) -> InferenceRequest:
        params = GenerationParams(max_new_tokens=requests[i]["max_new_tokens"], temperature=0.0)
        return InferenceRequest(model=model, input_ids=requests[i]["prompt"],
                                output=OutputSpec(kind="generate", generation=params))

    ids = dict(zip(order[:burst], client.send_batch([build(i) for i in order[:burst]]), strict=True))
    for i in order[burst:]:
        time.sleep(rng.uniform(0, MAX_GAP_S))
        ids[i] = client.send(build(i))
    return [ids[i] for i in range(len(requests))]


def _row(i: int, ref: dict[str, Any], got: InferenceResult | FleetError) -> str:
    head = f"#{i} prompt {len(ref['prompt'])} tok, max_new {ref['max_new_tokens']}"
    if not isinstance(got, InferenceResult) or got.generation is None:
        return f"{head}: FAILED {got!r}"
    gen = got.generation
    t = gen.timings
    same = gen.token_ids == ref["token_ids"] and gen.finish_reason == ref["finish_reason"]
    line = (f"{head}: {'same' if same else 'DIFFERENT'}, {len(gen.token_ids)} tok {gen.finish_reason}, "
            f"batch min/mean/max {t.batch_size_min}/{t.batch_size_mean}/{t.batch_size_max}, "
            f"prefill batch {got.timings.batch_size}, {t.decode_steps} steps of {t.mean_inter_token_ms} ms")
    if not same:
        line += f"\n    transformers {ref['token_ids']} {ref['finish_reason']}\n    fleet        {gen.token_ids}"
    return line


@pytest.mark.parametrize("served", MODELS, indirect=True)
def test_continuous_batching_gives_transformers_greedy_tokens(served: tuple[FleetClient, dict[str, Any]],
                                                              request: pytest.FixtureRequest) -> None:
    client, spec = served
    model = request.node.callspec.params["served"]
    requests = spec["requests"]
    assert any(ref["finish_reason"] == "stop" for ref in requests), "no reference ends at the EOS"
    first_burst = MAX_BATCH_SIZE + 1
    assert len(requests) > first_burst, "the workload is too small to leave requests for random arrivals"
    rounds = ((f"a burst of {first_burst}, then random arrivals", first_burst), ("one burst", len(requests)))
    for arrivals, burst in rounds:
        results = client.wait(_submit(client, model, requests, burst), timeout_s=120)
        report = "\n".join(_row(i, ref, got) for i, (ref, got) in enumerate(zip(requests, results, strict=True)))
        print(f"\n{model} (EOS {spec['eos_token_id']}), {arrivals}:\n{report}")
        generations = [r.generation for r in results if isinstance(r, InferenceResult) and r.generation is not None]
        assert len(generations) == len(requests), report
        mismatched = [i for i, (ref, gen) in enumerate(zip(requests, generations, strict=True))
                      if gen.token_ids != ref["token_ids"] or gen.finish_reason != ref["finish_reason"]]
        assert not mismatched, f"{model}, {arrivals}: requests {mismatched} differ from transformers:\n{report}"
        # the comparison proves something only if requests really shared decode steps, and joined or
        # left a running batch while others kept going: the burst, taken in one take, is larger than a
        # batch, so this holds whatever the machine's timing
        assert max(g.timings.batch_size_max for g in generations) > 1, report
        assert any(g.timings.batch_size_min < g.timings.batch_size_max for g in generations), report


def test_an_unreachable_index_skips_the_tier() -> None:
    offline = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    offline |= {"PIP_CONFIG_FILE": os.devnull, "PIP_INDEX_URL": "http://127.0.0.1:9/simple/", "PIP_RETRIES": "0",
                "PIP_TIMEOUT": "5"}
    with pytest.raises(pytest.skip.Exception, match="package index unreachable"):
        pip_install_or_skip(sys.executable, ["--dry-run", "--no-deps", "optimum-onnx==0.1.0"], env=offline,
                            timeout_s=120)
