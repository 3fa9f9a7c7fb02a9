"""The Llama-style builder, checked against a plain numpy Llama (float64) written from Hugging Face's math.

The reference reads the built file's weights by their Hugging Face names and computes RMSNorm,
rotary embeddings (rotate-half, driven by ``position_ids``), grouped-query attention (KV heads
repeated with ``np.repeat``: query head ``j`` reads KV head ``j // groups``), the SwiGLU MLP and the
untied head. ONNX Runtime (all graph optimizations on) must agree on every real position: prefill,
prefill + decode through the returned cache, right padding, left padding, holes, and for 1, 2 and 4
KV heads.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from protocol.modelcard import ModelCard, load_card
from tests.integration.decoder_harness import F32, I64, Decoder, left_pad, random_ids, right_pad
from tools.build_llama import ROPE_THETA, build_llama, llama_parameter_count
from tools.build_model import PRESETS, preset_parameter_count
from tools.onnx_layers import RMS_EPSILON

F64 = npt.NDArray[np.float64]
Batcher = Callable[[Sequence[I64]], tuple[I64, I64, I64]]
REF_ATOL = 2e-4  # float32 graph vs float64 reference, logits of std ~4


class Reference:
    """Hugging Face's Llama forward pass in numpy, on the weights of a built file."""

    def __init__(self, path: Path, card: ModelCard, theta: float = ROPE_THETA) -> None:
        model = onnx.load(str(path))
        self.w = {t.name: numpy_helper.to_array(t).astype(np.float64) for t in model.graph.initializer}
        self.card, self.theta = card, theta

    def _rms(self, x: F64, name: str) -> F64:
        return np.asarray(self.w[name] * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + RMS_EPSILON))

    def _rope(self, x: F64, pos: I64) -> F64:
        """``x [B, h, S, d]`` rotated by the angles of ``pos [B, S]``."""
        d = x.shape[-1]
        inv_freq = 1.0 / self.theta ** (np.arange(0, d, 2) / d)
        angles = pos[:, None, :, None] * np.concatenate([inv_freq, inv_freq])  # [B, 1, S, d]
        rotated = np.concatenate([-x[..., d // 2:], x[..., : d // 2]], axis=-1)
        return np.asarray(x * np.cos(angles) + rotated * np.sin(angles))

    def _heads(self, x: F64, name: str, count: int) -> F64:
        b, s, _ = x.shape
        return (x @ self.w[name]).reshape(b, s, count, self.card.head_dim).transpose(0, 2, 1, 3)

    def run(self, ids: I64, mask: I64, pos: I64, past: list[F64] | None = None) -> tuple[F64, list[F64]]:
        """(logits, presents in past_key_values order) for one call of the graph."""
        card, (b, s) = self.card, ids.shape
        kv, d = card.kv_heads, card.head_dim
        past = past or [np.zeros((b, kv, 0, d))] * (2 * card.num_layers)
        total = mask.shape[1]
        query_at = total - s + np.arange(s)
        allowed = (np.arange(total)[None, :] <= query_at[:, None])[None, None] & (mask[:, None, None, :] == 1)
        x = self.w["model.embed_tokens.weight"][ids]
        presents = []
        for i in range(card.num_layers):
            p = f"model.layers.{i}"
            h = self._rms(x, f"{p}.input_layernorm.weight")
            q = self._rope(self._heads(h, f"{p}.self_attn.q_proj.weight", card.num_heads), pos)
            k = self._rope(self._heads(h, f"{p}.self_attn.k_proj.weight", kv), pos)
            v = self._heads(h, f"{p}.self_attn.v_proj.weight", kv)
            keys = np.concatenate([past[2 * i], k], axis=2)
            values = np.concatenate([past[2 * i + 1], v], axis=2)
            presents += [keys, values]
            groups = card.num_heads // kv
            scores = q @ np.repeat(keys, groups, axis=1).transpose(0, 1, 3, 2) / np.sqrt(d)
            scores = np.where(allowed, scores, -np.inf)
            probs = np.exp(scores - scores.max(-1, keepdims=True))
            probs = np.nan_to_num(probs / probs.sum(-1, keepdims=True))  # fully masked (pad) rows: 0
            ctx = (probs @ np.repeat(values, groups, axis=1)).transpose(0, 2, 1, 3).reshape(b, s, -1)
            x = x + ctx @ self.w[f"{p}.self_attn.o_proj.weight"]
            h = self._rms(x, f"{p}.post_attention_layernorm.weight")
            gate = h @ self.w[f"{p}.mlp.gate_proj.weight"]
            act = gate / (1 + np.exp(-gate)) * (h @ self.w[f"{p}.mlp.up_proj.weight"])
            x = x + act @ self.w[f"{p}.mlp.down_proj.weight"]
        return self._rms(x, "model.norm.weight") @ self.w["lm_head.weight"], presents


@pytest.fixture(scope="module", params=[1, 2, 4], ids=lambda kv: f"kv{kv}")
def llama(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Decoder, Reference]:
    """demo-llama sizes (4 heads of 16) with 1 (multi-query), 2 (grouped) or 4 (multi-head) KV heads."""
    path = build_llama(tmp_path_factory.mktemp("llama"), num_kv_heads=request.param, seed=request.param)
    card = load_card(path)
    return Decoder(path, card), Reference(path, card)


def _alone(ref: Reference, seq: I64) -> F64:
    """Reference logits of ``seq`` alone, unpadded."""
    n = len(seq)
    return np.asarray(ref.run(seq[None], np.ones((1, n), np.int64), np.arange(n)[None])[0][0])


def test_prefill_matches_the_reference(llama: tuple[Decoder, Reference]) -> None:
    dec, ref = llama
    ids = random_ids(np.random.default_rng(0), (2, 9), dec.card.vocab_size)
    ids[0, :3] = [1, 2, 0]  # bos, eos and pad ids are ordinary inputs too
    mask, pos = np.ones_like(ids), np.tile(np.arange(9), (2, 1))
    logits, presents = dec.run(ids, mask, pos)
    want, want_presents = ref.run(ids, mask, pos)
    np.testing.assert_allclose(logits, want, atol=REF_ATOL, rtol=0)
    for got, expected in zip(presents, want_presents, strict=True):
        assert got.shape == (2, dec.card.kv_heads, 9, dec.card.head_dim)
        np.testing.assert_allclose(got, expected, atol=REF_ATOL, rtol=0)  # keys cached after rotation


@pytest.mark.parametrize("prefix", [1, 4, 8])
def test_decode_through_the_cache_matches_the_reference(llama: tuple[Decoder, Reference], prefix: int) -> None:
    """[a b c] at once equals [a b] then [c] with the returned present as past, in the graph and the reference."""
    dec, ref = llama
    total = 9
    ids = random_ids(np.random.default_rng(prefix), (2, total), dec.card.vocab_size)
    pos = np.tile(np.arange(total), (2, 1))
    full, _ = dec.run(ids, np.ones_like(ids), pos)
    np.testing.assert_allclose(full, ref.run(ids, np.ones_like(ids), pos)[0], atol=REF_ATOL, rtol=0)
    steps, past = dec.run(ids[:, :prefix], np.ones((2, prefix), np.int64), pos[:, :prefix])
    pieces = [steps]
    for t in range(prefix, total):
        step, past = dec.run(ids[:, t : t + 1], np.ones((2, t + 1), np.int64), pos[:, t : t + 1], past)
        pieces.append(step)
    np.testing.assert_allclose(np.concatenate(pieces, axis=1), full, atol=1e-4, rtol=0)
    assert past[0].shape == (2, dec.card.kv_heads, total, dec.card.head_dim)


@pytest.mark.parametrize("pad", [right_pad, left_pad], ids=["right", "left"])
def test_padding_matches_each_sequence_alone(llama: tuple[Decoder, Reference], pad: Batcher) -> None:
    dec, ref = llama
    rng = np.random.default_rng(11)
    seqs = [random_ids(rng, (n,), dec.card.vocab_size) for n in (6, 2, 9, 1)]
    ids, mask, pos = pad(seqs)
    batched, _ = dec.run(ids, mask, pos)
    for b, seq in enumerate(seqs):
        real = np.flatnonzero(mask[b])
        np.testing.assert_allclose(batched[b, real], _alone(ref, seq), atol=REF_ATOL, rtol=0)
    assert np.isfinite(batched).all()  # fully masked pad rows average instead of giving NaN


def test_decode_after_a_cache_with_holes(llama: tuple[Decoder, Reference]) -> None:
    """A past with masked columns in the middle (a dropped neighbour's leftovers) changes nothing."""
    dec, ref = llama
    rng = np.random.default_rng(5)
    seq = random_ids(rng, (5,), dec.card.vocab_size)
    junk = random_ids(rng, (3,), dec.card.vocab_size)
    ids = np.concatenate([seq[:2], junk, seq[2:4]])[None]         # a b X X X c d
    mask = np.array([[1, 1, 0, 0, 0, 1, 1]], np.int64)
    pos = np.array([[0, 1, 0, 0, 0, 2, 3]], np.int64)
    _, past = dec.run(ids, mask, pos)
    step, _ = dec.run(seq[4:][None], np.concatenate([mask, [[1]]], axis=1), np.array([[4]]), past)
    np.testing.assert_allclose(step[0, 0], _alone(ref, seq)[-1], atol=REF_ATOL, rtol=0)


def test_mixed_lengths_decode_together(llama: tuple[Decoder, Reference]) -> None:
    """Continuous batching's layout: rows right-aligned in a left-padded past, one new token each."""
    dec, ref = llama
    rng = np.random.default_rng(8)
    seqs = [random_ids(rng, (n,), dec.card.vocab_size) for n in (4, 7, 2)]
    ids, mask, pos = left_pad([s[:-1] for s in seqs])
    _, past = dec.run(ids, mask, pos)
    last = np.array([[s[-1]] for s in seqs], np.int64)
    next_pos = mask.sum(axis=1, keepdims=True)  # each row's own count of real tokens
    step, _ = dec.run(last, np.concatenate([mask, np.ones((3, 1), np.int64)], axis=1), next_pos, past)
    for b, seq in enumerate(seqs):
        np.testing.assert_allclose(step[b, 0], _alone(ref, seq)[-1], atol=REF_ATOL, rtol=0)


# -- the file: I/O order, card, sizes --------------------------------------------------------------


def test_io_follows_optimums_llama_export(tmp_path: Path) -> None:
    path = build_llama(tmp_path, num_layers=2, num_kv_heads=2)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    past = [f"past_key_values.{i}.{kv}" for i in range(2) for kv in ("key", "value")]
    assert [i.name for i in sess.get_inputs()] == ["input_ids", "attention_mask", "position_ids", *past]
    assert [o.name for o in sess.get_outputs()] == ["logits", *(p.replace("past_key_values", "present") for p in past)]
    b, s, p, t = "batch_size", "sequence_length", "past_sequence_length", "past_sequence_length + sequence_length"
    shapes = {i.name: i.shape for i in sess.get_inputs()} | {o.name: o.shape for o in sess.get_outputs()}
    assert shapes["attention_mask"] == [b, t] and shapes["position_ids"] == [b, s]
    assert shapes["past_key_values.1.value"] == [b, 2, p, 16] and shapes["present.0.key"] == [b, 2, t, 16]
    assert shapes["logits"] == [b, s, 512]
    meta = sess.get_modelmeta().custom_metadata_map
    assert (meta["name"], meta["num_heads"], meta["num_kv_heads"]) == ("demo-llama", "4", "2")


def test_card_and_weights(tmp_path: Path) -> None:
    path = build_llama(tmp_path, seed=3)
    card = load_card(path)
    assert (card.name, card.kind, card.tokenizer, card.seed) == ("demo-llama", "causal_lm", "byte", 3)
    assert (card.num_heads, card.num_kv_heads, card.kv_heads, card.head_dim) == (4, 2, 2, 16)
    assert (card.pad_token_id, card.bos_token_id, card.eos_token_id) == (0, 1, 2)
    names = {t.name for t in onnx.load(str(path)).graph.initializer if t.dims and len(t.dims) > 1}
    assert "lm_head.weight" in names and "model.embed_tokens.weight" in names  # untied head
    assert not [n for n in names if n.endswith(".bias")]
    assert card.parameters == llama_parameter_count(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2,
                                                    vocab_size=512)
    assert card.parameters == preset_parameter_count("demo", "llama")


def test_build_is_reproducible_and_seeded(tmp_path: Path) -> None:
    a, b, c = (build_llama(tmp_path / d, seed=s) for d, s in (("a", 1), ("b", 1), ("c", 2)))
    assert a.read_bytes() == b.read_bytes() != c.read_bytes()


def test_sizes_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        build_llama(tmp_path, num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="byte tokenizer needs at least 259"):
        build_llama(tmp_path, vocab_size=100)
    with pytest.raises(ValueError, match="must be even"):
        build_llama(tmp_path, hidden_size=12, num_heads=4)


def test_demo_llama_logits_are_well_spread(tmp_path: Path) -> None:
    """The served model's top-k ids are stable under float noise (tests compare them across batchings)."""
    path = build_llama(tmp_path, **PRESETS["demo"]["llama"])
    dec = Decoder(path, load_card(path))
    ids = random_ids(np.random.default_rng(3), (4, 16), dec.card.vocab_size)
    logits, _ = dec.run(ids, np.ones_like(ids), np.tile(np.arange(16), (4, 1)))
    assert 2.0 < float(logits.std()) < 8.0
    assert np.diff(np.sort(logits, axis=-1)[..., -5:], axis=-1).min() > 1e-3  # no near-ties among the top 5


def test_bench_llama_size() -> None:
    assert 20_000_000 <= preset_parameter_count("bench", "llama") <= 30_000_000
    assert PRESETS["bench"]["llama"]["num_kv_heads"] == 2


def test_past_shapes_are_the_kv_heads(llama: tuple[Decoder, Reference]) -> None:
    dec, _ = llama
    empty: list[F32] = [np.zeros((1, dec.card.num_heads + 1, 0, dec.card.head_dim), np.float32)] * 4
    ids = np.array([[5]], np.int64)
    with pytest.raises(ort.capi.onnxruntime_pybind11_state.InvalidArgument):  # the declared dim is fixed
        dec.run(ids, np.ones_like(ids), np.zeros_like(ids), empty)
