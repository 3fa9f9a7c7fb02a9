"""The generation notes say what the KV cache cost the workers: nothing re-laid out in place, else the re-layouts."""

from __future__ import annotations

from bench.gennotes import _kv_note

PROFILE = {"concat_share": 0.29, "batch_size": 16, "past_tokens": 112}
SAT = {"static": {"worker": {"copy_share": 0.05}}}
LIMIT = {"relayout": {"copies": 1.3}}


def test_an_in_place_cache_is_said_to_copy_nothing_and_the_exports_concat_is_priced() -> None:
    note = _kv_note(0.0006, 800.0, 250.0, SAT, LIMIT, PROFILE, in_place=True)
    assert note.startswith("- **The KV cache is written in place**")
    assert "copy no past" in note and "29 %" in note and "the cost to remove" not in note


def test_a_concat_cache_is_priced_by_its_relayouts() -> None:
    note = _kv_note(0.12, 800.0, 250.0, SAT, LIMIT, PROFILE, in_place=False)
    assert note.startswith("- **Copying the KV cache is the cost to remove.**")
    assert "12 %" in note and "909 tokens/s" in note and "1.3 times over" in note
