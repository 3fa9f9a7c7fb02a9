"""Pure generation logic: sampling, stop strings, the KV layout, the sequence state and admission."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.messages import GenerationParams
from protocol.settings import BatchingSettings
from protocol.streams import EVENT_FIELD, StreamEvent, decode_event, encode_token
from protocol.tokenization import ByteTokenizer
from workers.generation.kvcache import relayout, right_aligned_mask
from workers.generation.loop import GenerationLoop
from workers.generation.prefill_queue import plan_chunks
from workers.generation.sampling import Sampler, apply_repetition_penalty, greedy_rows, nucleus_probs
from workers.generation.sequence import GenSequence
from workers.generation.stops import scan_stops


def test_greedy_breaks_ties_towards_the_lower_id() -> None:
    assert Sampler(GenerationParams()).pick(np.array([0.0, 3.0, 3.0, 1.0]), []) == 1


def test_seeded_sampler_repeats_its_draws_and_seeds_differ() -> None:
    logits = np.linspace(0, 2, 50)
    draws = {seed: [Sampler(GenerationParams(temperature=1.0, seed=seed)).pick(logits, []) for _ in range(1)]
             for seed in range(40)}
    again = {seed: [Sampler(GenerationParams(temperature=1.0, seed=seed)).pick(logits, []) for _ in range(1)]
             for seed in range(40)}
    assert draws == again
    assert len({tuple(v) for v in draws.values()}) > 5


@pytest.mark.parametrize(
    ("top_k", "top_p", "kept"),
    [(0, 1.0, 4), (2, 1.0, 2), (0, 0.5, 1), (0, 0.9, 3), (3, 0.99, 3)],
)
def test_nucleus_cuts(top_k: int, top_p: float, kept: int) -> None:
    probs = nucleus_probs(np.log(np.array([0.6, 0.25, 0.1, 0.05])), 1.0, top_k, top_p)
    assert int((probs > 0).sum()) == kept
    assert probs.sum() == pytest.approx(1.0)
    assert probs[0] == probs.max()


def test_repetition_penalty_as_transformers_applies_it() -> None:
    out = apply_repetition_penalty(np.array([2.0, -2.0, 1.0]), [0, 1], 2.0)
    assert out.tolist() == [1.0, -4.0, 1.0]


def test_sampler_never_picks_a_token_outside_top_k() -> None:
    logits = np.zeros(100)
    logits[[7, 8]] = 5.0
    picks = {Sampler(GenerationParams(temperature=2.0, top_k=2, seed=s)).pick(logits, []) for s in range(200)}
    assert picks == {7, 8}


@pytest.mark.parametrize(
    ("text", "stops", "match", "safe"),
    [
        ("hello world", ["wor"], 6, 6),
        ("hello wo", ["world"], None, 6),  # 'wo' may become 'world': held back
        ("hello", ["xyz"], None, 5),
        ("abcab", ["abd", "cab"], 2, 2),
        ("", ["a"], None, 0),
        ("aaa", [], None, 3),
    ],
)
def test_scan_stops(text: str, stops: list[str], match: int | None, safe: int) -> None:
    scan = scan_stops(text, stops)
    assert (scan.match_at, scan.safe_end) == (match, safe)


def _cache(rows: list[list[float]], width: int) -> tuple[dict[str, Any], list[int]]:
    arr = np.zeros((len(rows), 1, width, 1), dtype=np.float32)
    for r, values in enumerate(rows):
        arr[r, 0, width - len(values):, 0] = values
    return {"past_key_values.0.key": arr}, [len(v) for v in rows]


def test_relayout_keeps_rows_appends_joiners_right_aligned_and_trims_width() -> None:
    cache, positions = _cache([[1, 2], [3], [4, 5, 6]], 3)
    joiner = {"past_key_values.0.key": np.array([[[7], [8]]], dtype=np.float32)}
    out, mask = relayout(cache, positions, [1, 0], [joiner], [2])  # row 2 (the widest) leaves
    assert mask.tolist() == [[0, 1], [1, 1], [1, 1]]
    assert out["past_key_values.0.key"][:, 0, :, 0].tolist() == [[0, 3], [1, 2], [7, 8]]
    wider = {"past_key_values.0.key": np.array([[[9], [9], [9], [9]]], dtype=np.float32)}
    out, mask = relayout(cache, positions, [0], [wider], [4])
    assert mask.tolist() == [[0, 0, 1, 1], [1, 1, 1, 1]]
    assert out["past_key_values.0.key"][:, 0, :, 0].tolist() == [[0, 0, 1, 2], [9, 9, 9, 9]]
    assert right_aligned_mask([0, 2], 2).tolist() == [[0, 0], [1, 1]]


def _seq(max_new: int, prompt_len: int = 4, **params: Any) -> GenSequence:
    return GenSequence(
        request_id=f"r{max_new}-{prompt_len}",
        prompt=[5] * prompt_len,
        params=GenerationParams(max_new_tokens=max_new, **params),
        eos_ids=frozenset({2}),
        tokenizer=ByteTokenizer(),
        future=Future(),
    )


def _logits_for(token: int, vocab: int = 300) -> np.ndarray:
    row = np.zeros(vocab, dtype=np.float32)
    row[token] = 10.0
    return row


class _Collect:
    """A stream sink that keeps every event, tokens built as the publisher's encoding would read back."""

    def __init__(self) -> None:
        self.events: list[StreamEvent] = []

    def publish(self, request_id: str, event: StreamEvent) -> None:
        self.events.append(event)

    def publish_token(self, request_id: str, index: int, token_id: int, text: str) -> None:
        self.events.append(decode_event({EVENT_FIELD: encode_token(index, token_id, text)}))


def test_sequence_cuts_text_at_a_stop_string_and_never_streams_past_it() -> None:
    sink = _Collect()
    events = sink.events
    seq = _seq(20, stop=["lo w"])
    seq.emit = sink
    for ch in "hello world":
        if seq.accept(_logits_for(ord(ch) + 3)):
            break
    outcome = seq.end()
    assert outcome.finish_reason == "stop" and outcome.text == "hel"
    assert "".join(e.text for e in events) == "hel"
    usage = events[-1].usage
    assert events[-1].type == "final" and usage is not None and usage.completion_tokens == len(outcome.token_ids)


def test_a_stop_string_in_the_text_held_back_to_the_end_is_cut_too() -> None:
    """The detokenizer holds back an unfinished UTF-8 character (and byte pieces) until it is complete or the
    sequence ends; the stop scan ran only on text released while generating, so a stop string completed by the
    flushed tail stayed in the result and the final event."""
    sink = _Collect()
    seq = _seq(3, stop=["i\ufffd"])
    seq.emit = sink
    for byte in (ord("h"), ord("i"), 0xC3):  # the last, the first byte of a two-byte character, never completed
        seq.accept(_logits_for(byte + 3))
    outcome = seq.end()
    assert (outcome.text, outcome.finish_reason) == ("h", "stop"), outcome
    assert "".join(e.text for e in sink.events) == "h" and sink.events[-1].type == "final"
    cancelled = _seq(3, stop=["i\ufffd"])
    for byte in (ord("h"), ord("i"), 0xC3):
        cancelled.accept(_logits_for(byte + 3))
    assert (cancelled.end("cancelled").text, cancelled.finish_reason) == ("h", "cancelled")


def test_sequence_ends_on_eos_length_and_stop_token() -> None:
    eos = _seq(10)
    assert eos.accept(_logits_for(2)) and eos.end().finish_reason == "stop"
    assert eos.end().token_ids == [2]
    ignoring = _seq(2, ignore_eos=True)
    assert not ignoring.accept(_logits_for(2))
    assert ignoring.accept(_logits_for(2)) and ignoring.end().finish_reason == "length"
    stop_id = _seq(10, stop_token_ids=[77])
    assert stop_id.accept(_logits_for(77)) and stop_id.end().finish_reason == "stop"


class _NoDecoder:
    supports_prefix_reuse = False


def test_admission_respects_slots_kv_budget_and_static_mode() -> None:
    loop = GenerationLoop(_NoDecoder(), BatchingSettings(max_batch_size=3, max_kv_tokens=100))  # type: ignore[arg-type]
    waiting = [_seq(40), _seq(40), _seq(40), _seq(5)]
    assert loop.admissible(waiting) == 2  # the third would pass the 100-token budget (44 each)
    loop.running = [_seq(10)]
    assert loop.admissible(waiting) == 1
    static = GenerationLoop(_NoDecoder(), BatchingSettings(max_batch_size=3, continuous=False))  # type: ignore[arg-type]
    static.running = [_seq(10)]
    assert static.admissible(waiting) == 0
    static.running = []
    assert static.admissible(waiting) == 3
    huge = GenerationLoop(_NoDecoder(), BatchingSettings(max_batch_size=3, max_kv_tokens=10))  # type: ignore[arg-type]
    assert huge.admissible(waiting) == 1  # an empty batch always takes the oldest


def test_tensorrt_profiles_cover_the_decode_range_of_a_kv_model() -> None:
    from protocol.modelcard import ModelCard
    from protocol.settings import EngineSettings, LimitSettings
    from workers.engine import provider_chain

    card = ModelCard(name="m", version="1", kind="causal_lm", vocab_size=300, max_positions=512, num_layers=1,
                     num_heads=4, num_kv_heads=2, head_dim=8, hidden_size=32)
    names = ["input_ids", "attention_mask", "position_ids", "past_key_values.0.key", "past_key_values.0.value"]
    chain = provider_chain(EngineSettings(), BatchingSettings(max_batch_size=4), LimitSettings(max_input_tokens=64,
                           max_new_tokens=100), card, names, available=["TensorrtExecutionProvider"])
    options = chain[0][1]
    assert options["trt_profile_min_shapes"].startswith("input_ids:1x1,attention_mask:1x1,")
    assert "past_key_values.0.key:4x2x164x8" in options["trt_profile_max_shapes"]
    assert "attention_mask:4x228" in options["trt_profile_max_shapes"]
    assert "past_key_values.0.key:1x2x0x8" in options["trt_profile_min_shapes"]


@pytest.mark.parametrize(
    ("remaining", "budget", "takes"),
    [
        ([5, 7], 0, [5, 7]),  # no budget: every prompt whole
        ([5, 7], 16, [5, 7]),
        ([5, 7], 8, [5, 3]),  # the oldest first; the one that spends the budget takes a part
        ([20, 3], 8, [8, 0]),
        ([0, 3], 2, [0, 2]),
        ([], 8, []),
    ],
)
def test_prefill_chunks_take_the_budget_oldest_first(remaining: list[int], budget: int, takes: list[int]) -> None:
    assert plan_chunks(remaining, budget) == takes


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 6).flatmap(lambda rows: st.lists(
    st.lists(st.sampled_from([-1.5, 0.0, 0.25, 3.0, float("inf"), float("-inf"), float("nan")]),
             min_size=5, max_size=5), min_size=rows, max_size=rows)))  # fmt: skip
def test_a_batch_greedy_pick_is_each_rows_own_pick(rows: list[list[float]]) -> None:
    """The decode step's one-call greedy picks equal what each row's sampler picks from its float64 copy,
    ties (few distinct values), infinities and NaN included."""
    logits = np.asarray(rows, dtype=np.float32)
    sampler = Sampler(GenerationParams(max_new_tokens=1, temperature=0.0))
    assert sampler.takes_argmax
    assert greedy_rows(logits).tolist() == [sampler.pick(row, []) for row in logits]


@pytest.mark.parametrize(("temperature", "penalty", "argmax"), [(0.0, 1.0, True), (0.0, 1.3, False),
                                                                 (0.7, 1.0, False)])  # fmt: skip
def test_only_plain_greedy_takes_the_batch_argmax(temperature: float, penalty: float, argmax: bool) -> None:
    params = GenerationParams(max_new_tokens=1, temperature=temperature, repetition_penalty=penalty)
    assert Sampler(params).takes_argmax is argmax
