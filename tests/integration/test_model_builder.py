"""The model builder, checked with real ONNX Runtime sessions (all graph optimizations on).

What the fleet relies on: the KV-cache path equals full recomputation, right and left padding never
change a real token's result, the I/O follows optimum's convention (GPT-2's input order here; the
Llama-style model is checked in test_llama_builder.py), builds are reproducible, the WordPiece
tokenizer fits the encoder, and the bench preset has the advertised size.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from protocol.errors import ConfigError
from protocol.modelcard import ModelCard, load_card
from protocol.tokenization import load_tokenizer
from tests.integration.decoder_harness import Decoder, left_pad, random_ids, right_pad, session
from tools.build_encoder import build_encoder, encoder_parameter_count
from tools.build_identity import build_identity
from tools.build_lm import build_causal_lm, causal_lm_parameter_count
from tools.build_model import PRESETS, add_build_model_arguments, preset_parameter_count, run_build_model

ATOL = 1e-4


@pytest.fixture(scope="module")
def lm(tmp_path_factory: pytest.TempPathFactory) -> Decoder:
    path = build_causal_lm(tmp_path_factory.mktemp("models"))
    return Decoder(path, load_card(path))


@pytest.fixture(scope="module")
def encoder(tmp_path_factory: pytest.TempPathFactory) -> tuple[ort.InferenceSession, ModelCard]:
    path = build_encoder(tmp_path_factory.mktemp("models"))
    return session(path), load_card(path)


# -- (a) the KV cache ------------------------------------------------------------------------------


@pytest.mark.parametrize("prefix", [1, 5, 11])
def test_kv_cache_matches_full_recomputation(lm: Decoder, prefix: int) -> None:
    card = lm.card
    total = 12
    ids = random_ids(np.random.default_rng(prefix), (2, total), card.vocab_size)
    pos = np.tile(np.arange(total, dtype=np.int64), (2, 1))
    full, _ = lm.run(ids, np.ones_like(ids), pos)

    steps, past = lm.run(ids[:, :prefix], np.ones((2, prefix), np.int64), pos[:, :prefix])
    pieces = [steps]
    for t in range(prefix, total):
        mask = np.ones((2, t + 1), np.int64)  # the cache so far plus this token
        step, past = lm.run(ids[:, t : t + 1], mask, pos[:, t : t + 1], past)
        pieces.append(step)
    incremental = np.concatenate(pieces, axis=1)
    assert past[0].shape == (2, card.num_heads, total, card.head_dim)
    np.testing.assert_allclose(incremental, full, atol=ATOL, rtol=0)
    assert (incremental.argmax(-1) == full.argmax(-1)).all()


def test_decode_after_right_padded_prefill(lm: Decoder) -> None:
    """Continuous batching: a cache with padding holes still gives each sequence its own next logits."""
    card = lm.card
    rng = np.random.default_rng(7)
    seqs = [random_ids(rng, (n,), card.vocab_size) for n in (3, 8, 5)]
    nxt = random_ids(rng, (3, 1), card.vocab_size)
    ids, mask, pos = right_pad(seqs)
    _, past = lm.run(ids, mask, pos)
    step_mask = np.concatenate([mask, np.ones((3, 1), np.int64)], axis=1)
    step_pos = np.array([[len(s)] for s in seqs], np.int64)
    step, _ = lm.run(nxt, step_mask, step_pos, past)
    for b, seq in enumerate(seqs):
        alone_ids = np.concatenate([seq, nxt[b]])[None]
        alone, _ = lm.run(alone_ids, np.ones_like(alone_ids), np.arange(len(seq) + 1)[None])
        np.testing.assert_allclose(step[b, 0], alone[0, -1], atol=ATOL, rtol=0)


# -- (b) right padding -----------------------------------------------------------------------------


def test_lm_right_padding_does_not_change_real_positions(lm: Decoder) -> None:
    card = lm.card
    rng = np.random.default_rng(1)
    seqs = [random_ids(rng, (n,), card.vocab_size) for n in (7, 3, 12, 1)]
    batched, _ = lm.run(*right_pad(seqs))
    for b, seq in enumerate(seqs):
        n = len(seq)
        alone, _ = lm.run(seq[None], np.ones((1, n), np.int64), np.arange(n)[None])
        np.testing.assert_allclose(batched[b, :n], alone[0], atol=ATOL, rtol=0)
        top5 = np.argsort(-batched[b, :n], axis=-1)[:, :5]
        assert (top5 == np.argsort(-alone[0], axis=-1)[:, :5]).all()
    assert np.isfinite(batched).all()


def test_lm_left_padding_does_not_change_real_positions(lm: Decoder) -> None:
    rng = np.random.default_rng(4)
    seqs = [random_ids(rng, (n,), lm.card.vocab_size) for n in (7, 3, 12, 1)]
    batched, _ = lm.run(*left_pad(seqs))
    for b, seq in enumerate(seqs):
        n = len(seq)
        alone, _ = lm.run(seq[None], np.ones((1, n), np.int64), np.arange(n)[None])
        np.testing.assert_allclose(batched[b, -n:], alone[0], atol=ATOL, rtol=0)
    assert np.isfinite(batched).all()


def test_decode_after_left_padded_prefill(lm: Decoder) -> None:
    """The worker's decode layout: rows right-aligned in a left-padded past, each at its own position."""
    rng = np.random.default_rng(9)
    seqs = [random_ids(rng, (n,), lm.card.vocab_size) for n in (2, 9, 4)]
    ids, mask, pos = left_pad([s[:-1] for s in seqs])
    _, past = lm.run(ids, mask, pos)
    step_mask = np.concatenate([mask, np.ones((3, 1), np.int64)], axis=1)
    step, _ = lm.run(np.array([[s[-1]] for s in seqs]), step_mask, mask.sum(axis=1, keepdims=True), past)
    for b, seq in enumerate(seqs):
        alone, _ = lm.run(seq[None], np.ones((1, len(seq)), np.int64), np.arange(len(seq))[None])
        np.testing.assert_allclose(step[b, 0], alone[0, -1], atol=ATOL, rtol=0)


def test_encoder_right_padding_does_not_change_real_positions(
        encoder: tuple[ort.InferenceSession, ModelCard]) -> None:
    sess, card = encoder
    rng = np.random.default_rng(2)
    seqs = [random_ids(rng, (n,), card.vocab_size) for n in (9, 2, 5, 1)]
    ids, mask, _ = right_pad(seqs)
    (batched,) = sess.run(["last_hidden_state"], {"input_ids": ids, "attention_mask": mask,
                                                  "token_type_ids": np.zeros_like(ids)})
    assert batched.shape == (4, 9, card.hidden_size)
    assert np.isfinite(batched).all()
    for b, seq in enumerate(seqs):
        one = seq[None]
        (alone,) = sess.run(["last_hidden_state"], {"input_ids": one, "attention_mask": np.ones_like(one),
                                                    "token_type_ids": np.zeros_like(one)})
        np.testing.assert_allclose(batched[b, : len(seq)], alone[0], atol=ATOL, rtol=0)


def test_fully_masked_rows_give_no_nan(encoder: tuple[ort.InferenceSession, ModelCard]) -> None:
    sess, _ = encoder
    ids = np.zeros((2, 4), np.int64)
    (out,) = sess.run(None, {"input_ids": ids, "attention_mask": ids, "token_type_ids": ids})
    assert np.isfinite(out).all()


# -- (c) the I/O convention ------------------------------------------------------------------------


def _io(values: list[onnx.ValueInfoProto]) -> dict[str, tuple[int, list[int | str]]]:
    return {v.name: (v.type.tensor_type.elem_type,
                     [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]) for v in values}


def test_lm_io_follows_optimum(tmp_path: Path) -> None:
    model = onnx.load(build_causal_lm(tmp_path, num_layers=3, hidden_size=32, num_heads=2))
    i64, f32 = onnx.TensorProto.INT64, onnx.TensorProto.FLOAT
    b, s, p = "batch_size", "sequence_length", "past_sequence_length"
    t = "past_sequence_length + sequence_length"
    want_in: dict[str, tuple[int, list[int | str]]] = {
        "input_ids": (i64, [b, s]), "attention_mask": (i64, [b, t]), "position_ids": (i64, [b, s])}
    want_out: dict[str, tuple[int, list[int | str]]] = {"logits": (f32, [b, s, 512])}
    for i in range(3):
        for kv in ("key", "value"):
            want_in[f"past_key_values.{i}.{kv}"] = (f32, [b, 2, p, 16])
            want_out[f"present.{i}.{kv}"] = (f32, [b, 2, t, 16])
    assert _io(list(model.graph.input)) == want_in
    assert _io(list(model.graph.output)) == want_out
    # GPT-2's forward takes past_key_values second, so optimum's export puts the past right after the ids.
    assert [i.name for i in model.graph.input] == [
        "input_ids", *(n for n in want_in if n.startswith("past_key_values")), "attention_mask", "position_ids"]
    assert [o.name for o in model.graph.output] == list(want_out)
    meta = {e.key: e.value for e in model.metadata_props}
    assert {k: meta[k] for k in ("name", "version", "kind", "vocab_size")} == {
        "name": "demo-lm", "version": "1.0.0", "kind": "causal_lm", "vocab_size": "512"}
    assert model.opset_import[0].version == 17


def test_encoder_io_follows_optimum(tmp_path: Path) -> None:
    path = build_encoder(tmp_path)
    model = onnx.load(path)
    i64, f32 = onnx.TensorProto.INT64, onnx.TensorProto.FLOAT
    b, s = "batch_size", "sequence_length"
    assert _io(list(model.graph.input)) == {
        "input_ids": (i64, [b, s]), "attention_mask": (i64, [b, s]), "token_type_ids": (i64, [b, s])}
    assert _io(list(model.graph.output)) == {"last_hidden_state": (f32, [b, s, 64])}
    assert {e.key: e.value for e in model.metadata_props}["kind"] == "encoder"


def test_cards(tmp_path: Path) -> None:
    lm_card = load_card(build_causal_lm(tmp_path, seed=3))
    assert (lm_card.kind, lm_card.tokenizer, lm_card.seed) == ("causal_lm", "byte", 3)
    assert (lm_card.pad_token_id, lm_card.bos_token_id, lm_card.eos_token_id) == (0, 1, 2)
    assert (lm_card.num_layers, lm_card.num_heads, lm_card.head_dim, lm_card.hidden_size) == (2, 4, 16, 64)
    enc_path = build_encoder(tmp_path)
    enc_card = load_card(enc_path)
    assert enc_card.kind == "encoder" and enc_card.vocab_size == 1024 and enc_card.pad_token_id == 0
    assert (enc_path.parent / enc_card.tokenizer).exists()


# -- (d) reproducible weights ----------------------------------------------------------------------


def test_same_seed_same_model_different_seed_different_logits(tmp_path: Path) -> None:
    first = build_causal_lm(tmp_path / "a", seed=5)
    again = build_causal_lm(tmp_path / "b", seed=5)
    other = build_causal_lm(tmp_path / "c", seed=6)
    assert first.read_bytes() == again.read_bytes()
    assert first.read_bytes() != other.read_bytes()
    card = load_card(first)
    ids = random_ids(np.random.default_rng(0), (1, 6), card.vocab_size)
    args = (ids, np.ones_like(ids), np.arange(6)[None])
    logits = [Decoder(p, card).run(*args)[0] for p in (first, again, other)]
    np.testing.assert_array_equal(logits[0], logits[1])
    assert np.abs(logits[0] - logits[2]).max() > 1.0


def test_encoder_build_is_reproducible(tmp_path: Path) -> None:
    a, b = build_encoder(tmp_path / "a"), build_encoder(tmp_path / "b")
    assert a.read_bytes() == b.read_bytes()
    tok = "demo-encoder-1.0.0.tokenizer.json"
    assert (a.parent / tok).read_bytes() == (b.parent / tok).read_bytes()


def test_logits_are_well_spread(lm: Decoder) -> None:
    card = lm.card
    ids = random_ids(np.random.default_rng(3), (4, 16), card.vocab_size)
    logits, _ = lm.run(ids, np.ones_like(ids), np.tile(np.arange(16), (4, 1)))
    assert 2.0 < float(logits.std()) < 8.0
    top = np.sort(logits, axis=-1)[..., -5:]
    assert np.diff(top, axis=-1).min() > 10 * ATOL  # no near-ties among the top 5


# -- (e) the WordPiece tokenizer -------------------------------------------------------------------


def test_wordpiece_tokenizer_fits_the_encoder(tmp_path: Path) -> None:
    path = build_encoder(tmp_path, vocab_size=700)
    card = load_card(path)
    tok = load_tokenizer(card, path.parent)
    assert tok is not None
    ids = tok.encode("Batching several requests together, naïvely: 3.5 ms! Unseen→symbols 你好")
    assert ids[0] == 2 and ids[-1] == 3  # [CLS] … [SEP]
    assert all(0 <= i < card.vocab_size for i in ids)
    assert tok.decode(ids).startswith("batching several requests together")
    enc_ids = np.array([ids], np.int64)
    (out,) = session(path).run(None, {"input_ids": enc_ids, "attention_mask": np.ones_like(enc_ids),
                                       "token_type_ids": np.zeros_like(enc_ids)})
    assert out.shape == (1, len(ids), 64) and np.isfinite(out).all()


def test_vocab_too_small_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="byte tokenizer needs at least 259"):
        build_causal_lm(tmp_path, vocab_size=258)
    with pytest.raises(ValueError, match="byte tokenizer needs at least 259"):
        build_identity(tmp_path, vocab_size=100)
    with pytest.raises(ValueError, match="WordPiece"):
        build_encoder(tmp_path, vocab_size=64)
    with pytest.raises(ValueError, match="multiple of num_heads"):
        build_causal_lm(tmp_path, hidden_size=30, num_heads=4)


# -- (f) the identity model ------------------------------------------------------------------------


def test_identity_model_runs(tmp_path: Path) -> None:
    path = build_identity(tmp_path, vocab_size=300)
    card = load_card(path)
    assert (card.kind, card.num_layers, card.vocab_size) == ("causal_lm", 0, 300)
    sess = session(path)
    assert [i.name for i in sess.get_inputs()] == ["input_ids", "attention_mask", "position_ids"]
    assert [o.name for o in sess.get_outputs()] == ["logits"]
    ids = np.array([[5, 7, 299], [3, 0, 0]], np.int64)
    (logits,) = sess.run(["logits"], {"input_ids": ids, "attention_mask": np.ones_like(ids),
                                      "position_ids": np.zeros_like(ids)})
    assert logits.shape == (2, 3, 300) and logits.dtype == np.float32
    assert (logits.argmax(-1) == ids).all()


# -- (g) presets and the CLI -----------------------------------------------------------------------


def test_parameter_count_formulas_match_built_models(tmp_path: Path) -> None:
    sizes: dict[str, Any] = {"num_layers": 3, "hidden_size": 48, "vocab_size": 300, "max_positions": 40,
                             "intermediate_size": 100}
    lm_card = load_card(build_causal_lm(tmp_path, num_heads=6, **sizes))
    enc_card = load_card(build_encoder(tmp_path, num_heads=6, tokenizer="byte", **sizes))
    assert lm_card.parameters == causal_lm_parameter_count(**sizes)
    assert enc_card.parameters == encoder_parameter_count(**sizes)
    assert preset_parameter_count("demo", "lm") == load_card(build_causal_lm(tmp_path / "d")).parameters


def test_bench_preset_size() -> None:
    params = preset_parameter_count("bench", "lm")
    assert 20_000_000 <= params <= 30_000_000
    assert PRESETS["bench"]["lm"]["vocab_size"] == 8192


@pytest.mark.slow
def test_bench_lm_builds_and_runs(tmp_path: Path) -> None:
    path = build_causal_lm(tmp_path, **PRESETS["bench"]["lm"])
    card = load_card(path)
    assert card.parameters == preset_parameter_count("bench", "lm")
    ids = random_ids(np.random.default_rng(0), (1, 4), card.vocab_size)
    logits, presents = Decoder(path, card).run(ids, np.ones_like(ids), np.arange(4)[None])
    assert logits.shape == (1, 4, 8192) and len(presents) == 12


def test_cli_builds_the_demo_models(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_build_model_arguments(parser)
    paths = run_build_model(parser.parse_args(["--out-dir", str(tmp_path)]))
    assert [p.relative_to(tmp_path).as_posix() for p in paths] == [
        "demo-lm/demo-lm-1.0.0.onnx", "demo-llama/demo-llama-1.0.0.onnx", "demo-encoder/demo-encoder-1.0.0.onnx",
        "identity/identity-1.0.0.onnx"]
    assert len(capsys.readouterr().out.strip().splitlines()) == 4
    one = run_build_model(parser.parse_args(["--out-dir", str(tmp_path), "--kind", "lm", "--name", "x",
                                             "--version", "2.0.0", "--layers", "1", "--seed", "4"]))
    card = load_card(one[0])
    assert (card.name, card.version, card.num_layers, card.seed) == ("x", "2.0.0", 1, 4)
    with pytest.raises(ConfigError, match="--name needs a single --kind"):
        run_build_model(parser.parse_args(["--out-dir", str(tmp_path), "--name", "x"]))
    (llama,) = run_build_model(parser.parse_args(["--out-dir", str(tmp_path), "--kind", "llama", "--name", "y",
                                                  "--heads", "8", "--kv-heads", "1", "--layers", "1"]))
    card = load_card(llama)
    assert (card.name, card.num_heads, card.kv_heads, card.head_dim, card.num_layers) == ("y", 8, 1, 8, 1)
