"""An embeddings call's inputs built, admitted and queued as fleet requests, all or none: one
``embedding`` request per input, each refusal naming ``input[i]``, at most ``api.max_batch_requests``
inputs (the route: :mod:`gateway.openai_routes`).
"""

from __future__ import annotations

from starlette.concurrency import run_in_threadpool

from gateway.deps import Gateway
from gateway.openai_mapping import embedding_inputs, input_field, rename_field, wrong_kind
from gateway.openai_schema import EmbeddingBody
from producer.submit_groups import SubmitItem
from protocol.errors import InvalidRequest
from protocol.messages import InferenceRequest

__all__ = ["build_embeddings", "queue_embeddings", "send_embeddings"]


async def queue_embeddings(gw: Gateway, body: EmbeddingBody, rate_key: str) -> list[str]:
    """Build every input's request, admit them together and queue them all or none: with the other
    submissions of the moment (:mod:`gateway.submit_queue`), or alone in a thread (``api.group_submits``
    false). Token-id inputs of a model already loaded are built on the loop (no file, no Redis read)."""
    texts = isinstance(body.input, str) or any(isinstance(x, str) for x in body.input)
    if not texts and gw.fleet.model_loaded(body.model):
        built = build_embeddings(gw, body)
    else:
        built = await run_in_threadpool(build_embeddings, gw, body)
    routing = [body.user] * len(built)
    try:
        if gw.settings.api.group_submits:
            return await gw.submits.submit(SubmitItem(built, rate_key, list(routing)))
        return await run_in_threadpool(send_embeddings, gw, built, rate_key, routing)
    except InvalidRequest as exc:  # more inputs at once than the rate bucket holds: named as the body names them
        raise rename_field(exc, {"requests": "input"}) from exc


def build_embeddings(gw: Gateway, body: EmbeddingBody) -> list[InferenceRequest]:
    """One embedding request per input, each validated (raises InvalidRequest naming ``input[i]``)."""
    prompts = embedding_inputs(body)
    cap = gw.settings.api.max_batch_requests
    if len(prompts) > cap:
        raise InvalidRequest(f"input has {len(prompts)} items; the limit is api.max_batch_requests={cap}", "input", cap)
    built = []
    for i, (ids, text) in enumerate(prompts):
        field = input_field(body, i)
        try:
            built.append(gw.fleet.build_request(body.model, ids, text=text, kind="embedding"))
        except InvalidRequest as exc:
            refused = wrong_kind(exc, body.model, "embed", "a causal LM answers POST /v1/completions")
            raise rename_field(refused, {"input_ids": field, "text": field}) from exc
    return built


def send_embeddings(gw: Gateway, built: list[InferenceRequest], rate_key: str,
                     routing: list[str | None]) -> list[str]:  # fmt: skip
    """Admit ``built`` together and queue it in one Redis step, all or none (blocking: in a thread), each request
    the caller's (its owner mark claimed first: :mod:`gateway.request_owners`)."""
    gw.fleet.admission.admit(built[0].model, count=len(built), rate_key=rate_key)
    owners = [gw.owners.owner_for(rate_key)] * len(built)
    with gw.owners.claimed([str(r.request_id) for r in built], owners, lambda i: f"input[{i}]"):
        return gw.fleet.send_batch(built, routing_keys=routing, label="input")
