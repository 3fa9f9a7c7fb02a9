"""``fleet models pin|canary|promote|rollback|history|compare`` against a real Redis, a real S3 store
(SeaweedFS) and a real worker that follows the state."""

from __future__ import annotations

import json
import re
import uuid
from pathlib import Path
from typing import Any

import pytest

from producer.cli import main as fleet_main
from protocol.keys import REQUEST_KEY
from protocol.messages import InferenceResult
from protocol.model_state import pin, recent_prompts, record_refusal, samples_prompt, set_canary
from store import ChecksumMismatch
from tests.integration.canary_fixtures import MODEL, publish_two_versions, wait_canary_served
from tests.integration.fleet_fixtures import Fleet
from tools.build_lm import build_causal_lm
from tools.seaweed_server import EmbeddedSeaweed


def fleet_json(capsys: pytest.CaptureFixture[str], config: Path, *argv: str) -> tuple[int, Any, str]:
    """Run ``fleet models …`` in this process: exit code, the JSON it printed (or None), stderr."""
    code = fleet_main(["models", argv[0], "--config", str(config), *argv[1:]])
    captured = capsys.readouterr()
    out = captured.out.strip().splitlines()
    return code, json.loads(out[-1]) if out else None, captured.err


def test_lifecycle_commands_record_history_and_refuse_clearly(
    fleet: Fleet, s3: EmbeddedSeaweed, model_dir: Path, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    cfg, _, v1, v2 = publish_two_versions(fleet, s3, model_dir, tmp_path)

    code, doc, err = fleet_json(capsys, cfg, "pin", MODEL, "9.9.9")
    assert code == 2 and doc["type"] == "VersionNotFound" and f"{MODEL} 9.9.9 is not published" in err
    assert "`fleet models list MODEL` shows the published versions" in err
    code, doc, _ = fleet_json(capsys, cfg, "promote", MODEL)
    assert code == 1 and doc["type"] == "StateChangeRefused" and "no canary to promote" in doc["message"]
    with pytest.raises(SystemExit) as exit_info:
        fleet_json(capsys, cfg, "canary", MODEL, v2, "--weight", "150")
    assert exit_info.value.code == 2 and "weight must be an integer from 1 to 99" in capsys.readouterr().err
    code, _, err = fleet_json(capsys, cfg, "pin", "no-such-model", v1)
    assert code == 2 and "unknown model 'no-such-model'" in err

    assert fleet_json(capsys, cfg, "pin", MODEL, v1, "--by", "ann@ops")[0] == 0
    code, doc, _ = fleet_json(capsys, cfg, "canary", MODEL, v2, "--weight", "10")
    assert code == 0 and doc["state"]["canary"] == v2 and doc["state"]["canary_weight"] == 10
    assert doc["change"]["by"].count("@") == 1  # $USER@host by default
    code, doc, _ = fleet_json(capsys, cfg, "rollback", MODEL, "--reason", "p99 too high")
    assert code == 0 and doc["state"]["canary"] is None and doc["state"]["stable"] == v1
    fleet_json(capsys, cfg, "canary", MODEL, v2, "--weight", "20")
    code, doc, _ = fleet_json(capsys, cfg, "promote", MODEL)
    assert code == 0 and doc["state"] == {**doc["state"], "stable": v2, "canary": None, "canary_weight": 0}

    code, doc, _ = fleet_json(capsys, cfg, "history", MODEL)
    assert code == 0
    entries = doc["history"]
    rows = [(e["action"], e["from"]["stable"], e["to"]["stable"], e["to"]["canary"], e["reason"]) for e in entries]
    assert rows == [
        ("pin", None, v1, None, None),
        ("canary", v1, v1, v2, None),
        ("rollback", v1, v1, None, "p99 too high"),
        ("canary", v1, v1, v2, None),
        ("promote", v1, v2, None, None),
    ]
    assert doc["history"][0]["by"] == "ann@ops"
    assert len(fleet_json(capsys, cfg, "history", MODEL, "--last", "2")[1]["history"]) == 2


def test_compare_reports_per_version_figures_and_shadow_agreement(
    fleet: Fleet, s3: EmbeddedSeaweed, model_dir: Path, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    cfg, _, v1, v2 = publish_two_versions(fleet, s3, model_dir, tmp_path)
    fleet.worker(cfg)
    fleet_json(capsys, cfg, "pin", MODEL, v1)
    fleet_json(capsys, cfg, "canary", MODEL, v2, "--weight", "30")
    client = fleet.client(cfg)
    wait_canary_served(client, v2)
    ids = client.submit_bulk(MODEL, [[5 + i % 40, 9] for i in range(400)], chunk_size=100, top_k=1)
    results = [r for r in client.wait(ids, 120) if isinstance(r, InferenceResult)]
    assert len(results) == 400
    served = {v: sum(r.version == v for r in results) for v in (v1, v2)}
    # one request in 20 (by a hash of its ID) leaves its prompt for the shadow sample while a canary is set
    singles = [(client.submit(MODEL, [9, 5 + i], top_k=1), [9, 5 + i]) for i in range(120)]
    assert all(isinstance(r, InferenceResult) for r in client.wait([rid for rid, _ in singles], 60))
    sampled = [ids for rid, ids in singles if samples_prompt(rid)]
    assert recent_prompts(client.redis, MODEL, 200) == sampled[::-1]

    code, doc, _ = fleet_json(capsys, cfg, "compare", MODEL, "--window-s", "600", "--shadow", "16")
    assert code == 0
    figures = {f["version"]: f for f in doc["versions"]}
    for version in (v1, v2):  # the outcomes stream also holds the probes of wait_canary_served
        assert figures[version]["requests"] >= served[version] > 0
        assert figures[version]["errors"] == 0 and figures[version]["error_rate"] == 0
        assert 0 < figures[version]["p50_ms"] <= figures[version]["tail_ms"] <= figures[version]["max_ms"]
    assert figures[v2]["roles"] == ["canary"]
    shadow = doc["shadow"]
    assert shadow["prompts"] == 16 and shadow["compared"] == 16 and shadow["failed"] == 0
    assert shadow["agreement"] == 1.0  # the two versions are the same bytes
    assert shadow["recent_prompts"] == min(16, len(sampled))

    # a prompt of the file that cannot be sent is named by its place in the file, and none of them is sent
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([[5, 6], "fine", [7, 10**6]]))
    markers = len(list(client.redis.scan_iter(REQUEST_KEY.format(id="*"), count=1000)))
    code, _, err = fleet_json(capsys, cfg, "compare", MODEL, "--window-s", "600", "--shadow", "4", "--prompts",
                              str(prompts))
    assert code == 2 and "--prompts item 2: input_ids[1] = 1000000" in err, err
    assert len(list(client.redis.scan_iter(REQUEST_KEY.format(id="*"), count=1000))) == markers  # nothing sent


def test_status_shows_versions_changes_and_refusals(fleet: Fleet, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = fleet.config()
    client = fleet.client(cfg)
    pin(client.redis, MODEL, "1.0.0", "ann@ops")
    set_canary(client.redis, MODEL, "1.1.0", 10, "ann@ops")
    err = ChecksumMismatch("demo-lm/1.1.0/demo-lm.onnx: sha256 is 1111, the manifest says 2222", "f", "2222")
    record_refusal(client.redis, MODEL, "w1@host", "1.1.0", err)
    client.redis.rpush(fleet.settings(cfg).canary_queue_for(MODEL), b"{}")  # one message waiting

    assert fleet_main(["status", "--json", "--config", str(cfg)]) == 0
    doc = json.loads(capsys.readouterr().out)
    row = next(m for m in doc["models"] if m["model"] == MODEL)
    assert (row["stable"], row["canary"], row["canary_weight"], row["generation"]) == ("1.0.0", "1.1.0", 10, 2)
    assert row["canary_queue"] == "fleet.demo-lm.canary" and row["canary_queue_depth"] == 1
    assert [e["action"] for e in row["last_changes"]] == ["pin", "canary"]
    [refusal] = row["last_refusals"]
    assert refusal["worker"] == "w1@host" and refusal["error_type"] == "ChecksumMismatch"
    assert "the manifest says 2222" in refusal["error"]

    assert fleet_main(["status", "--config", str(cfg)]) == 0
    text = capsys.readouterr().out
    assert "demo-lm: 1.0.0 + canary 1.1.0 10% (generation 2, canary queue fleet.demo-lm.canary depth 1)" in text
    assert "canary by ann@ops  1.0.0 -> 1.0.0 + canary 1.1.0 10%" in text
    assert re.search(r"REFUSED \d+ s ago  w1@host refused 1\.1\.0: ChecksumMismatch: demo-lm/1\.1\.0/demo-lm\.onnx: "
                     r"sha256 is 1111, the manifest says 2222", text)


def test_quantize_publishes_its_int8_result_with_the_report(
    s3: EmbeddedSeaweed, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    fp32 = build_causal_lm(tmp_path / "models")
    version = f"1.0.0-int8-{uuid.uuid4().hex[:8]}"
    config = tmp_path / "fleet.yaml"
    config.write_text("{}\n")  # the store comes from FLEET_STORE__* (the s3 fixture), credentials too
    code = fleet_main(["quantize", str(fp32), "--mode", "dynamic", "--eval-count", "8", "--latency-rounds", "1",
                       "--quiet", "--publish", version, "--config", str(config)])
    out, err = capsys.readouterr()
    assert code == 0, err
    doc = json.loads(out.strip().splitlines()[-1])
    published = doc["published"]
    assert published["model"] == "demo-lm" and published["version"] == version
    ours = {"demo-lm-1.0.0-int8.json", "demo-lm-1.0.0-int8.onnx", "demo-lm-1.0.0-int8.report.json"}
    assert ours <= set(published["paths"]) and "demo-lm-1.0.0.onnx" not in published["paths"]
    code, shown, _ = fleet_json(capsys, config, "show", "demo-lm", version)
    roles = {f["path"]: f["role"] for f in shown["manifest"]["files"]}
    assert code == 0 and roles["demo-lm-1.0.0-int8.report.json"] == "report"
    assert shown["manifest"]["precision"] == "int8"
    code, _, err = fleet_json(capsys, config, "show", "demo-lm", version + "-nope")
    assert code == 2 and "is not published" in err
