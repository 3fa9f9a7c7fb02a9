"""An encoder is pooled as its sentence-transformers ``modules.json`` + ``1_Pooling/config.json`` declare.

Each mode is served by the real scheduler over the real ONNX encoder (a padded batch of inputs of
different lengths) and compared with a numpy reference computed from each input run alone (no
padding); the reported case (CLS pooling) is also served end to end by a worker. What the fleet
cannot serve refuses the model at load, naming the file and the mode or module.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from protocol.errors import ModelLoadError
from protocol.messages import InferenceResult, OutputSpec
from protocol.modelcard import load_card
from protocol.settings import BatchingSettings, EngineSettings, LimitSettings
from store import ModelStore
from store.local import LocalBackend
from tests.integration.fleet_fixtures import Fleet
from workers.engine import Engine
from workers.padding import pad_batch
from workers.policy import BatchPolicy
from workers.scheduler import Job, JobResult, Scheduler

INPUTS = [[2, 40, 41, 42, 3], [2, 50, 3], [2, 60, 61, 62, 63, 64, 65, 3], [2, 70, 71, 3]]
"""Different lengths, so the batch holds padding that no pooling may see."""

ST_KEYS = {
    "cls": "pooling_mode_cls_token", "max": "pooling_mode_max_tokens", "mean": "pooling_mode_mean_tokens",
    "mean_sqrt_len": "pooling_mode_mean_sqrt_len_tokens", "weightedmean": "pooling_mode_weightedmean_tokens",
    "lasttoken": "pooling_mode_lasttoken",
}  # fmt: skip
TRANSFORMER = {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}
POOLING = {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}
NORMALIZE = {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}


def st_folder(model_dir: Path, dest: Path, modes: tuple[str, ...] = (), *, normalize: bool = False,
              modules: list[dict[str, Any]] | None = None, **pooling_extra: Any) -> Path:
    """The demo encoder copied into ``dest`` as a sentence-transformers folder; returns its model file."""
    shutil.copytree(model_dir / "demo-encoder", dest)
    model = dest / "demo-encoder-1.0.0.onnx"
    hidden = load_card(model).hidden_size
    config = {"word_embedding_dimension": hidden, **{key: name in modes for name, key in ST_KEYS.items()},
              "include_prompt": True, **pooling_extra}
    (dest / "1_Pooling").mkdir()
    (dest / "1_Pooling" / "config.json").write_text(json.dumps(config))
    declared = modules if modules is not None else [TRANSFORMER, POOLING, *([NORMALIZE] if normalize else [])]
    (dest / "modules.json").write_text(json.dumps(declared))
    return model


def engine_of(model: Path) -> Engine:
    return Engine(model, load_card(model), EngineSettings(intra_op_threads=1), BatchingSettings(),
                  LimitSettings(max_input_tokens=64))


def reference(engine: Engine, ids: list[int], modes: tuple[str, ...], normalize: bool) -> npt.NDArray[np.float64]:
    """sentence-transformers' pooling of ``ids`` run alone (no padding), written out plainly."""
    tokens = engine.run(pad_batch([ids]))[0].astype(np.float64)  # [len, dim]
    n = len(ids)
    parts = {
        "cls": tokens[0], "max": tokens.max(axis=0), "mean": tokens.sum(axis=0) / n,
        "mean_sqrt_len": tokens.sum(axis=0) / np.sqrt(n), "lasttoken": tokens[n - 1],
        "weightedmean": (tokens * np.arange(1, n + 1)[:, None]).sum(axis=0) / np.arange(1, n + 1).sum(),
    }  # fmt: skip
    vec = np.concatenate([parts[m] for m in modes])
    return vec / np.linalg.norm(vec) if normalize else vec


def served_by_scheduler(engine: Engine, *, normalize_request: bool) -> list[list[float]]:
    """Every input's vector as the worker's scheduler computes it, all in one padded batch."""
    sched = Scheduler(engine, BatchPolicy(len(INPUTS), 10_000, 10_000, close_when_idle=False))
    spec = OutputSpec(kind="embedding", normalize=normalize_request)
    futures = [sched.submit(Job(list(ids), spec)) for ids in INPUTS]
    sched.start()
    try:
        done: list[JobResult] = [f.result(timeout=60) for f in futures]
    finally:
        sched.stop()
    assert all(r.batch_size == len(INPUTS) for r in done), "the inputs must share one padded batch"
    return [r.embedding or [] for r in done]


CASES = [(("cls",), False), (("max",), False), (("mean",), False), (("mean_sqrt_len",), False),
         (("weightedmean",), False), (("lasttoken",), False), (("cls", "mean"), False), (("cls",), True),
         (("lasttoken",), True)]  # fmt: skip


@pytest.mark.parametrize(("modes", "normalize"), CASES, ids=lambda c: "+".join(c) if isinstance(c, tuple) else
                         ("normalize" if c else "raw"))
def test_each_declared_pooling_is_served_as_numpy_computes_it(
    model_dir: Path, tmp_path: Path, modes: tuple[str, ...], normalize: bool
) -> None:
    engine = engine_of(st_folder(model_dir, tmp_path / "st", modes, normalize=normalize))
    assert engine.pooling.modes == modes and engine.pooling.normalize is normalize
    # normalize_request=False: what the model declares is all that shapes the vector
    got = served_by_scheduler(engine, normalize_request=False)
    for ids, vec in zip(INPUTS, got, strict=True):
        want = reference(engine, ids, modes, normalize)
        assert len(vec) == engine.card.hidden_size * len(modes)
        np.testing.assert_allclose(vec, want, rtol=1e-4, atol=1e-5)
    if modes != ("mean",):  # the old behaviour (mean pooling whatever the model says) is not what is served
        mean = reference(engine, INPUTS[0], ("mean",) * len(modes), normalize)
        assert not np.allclose(got[0], mean, rtol=1e-3, atol=1e-4)


def test_a_folder_without_modules_json_is_mean_pooled_as_before(model_dir: Path) -> None:
    engine = engine_of(model_dir / "demo-encoder" / "demo-encoder-1.0.0.onnx")
    assert engine.pooling.source is None and engine.pooling.modes == ("mean",)
    got = served_by_scheduler(engine, normalize_request=True)
    for ids, vec in zip(INPUTS, got, strict=True):
        np.testing.assert_allclose(vec, reference(engine, ids, ("mean",), True), rtol=1e-4, atol=1e-5)


def test_a_pooling_mode_given_by_name_is_served(model_dir: Path, tmp_path: Path) -> None:
    engine = engine_of(st_folder(model_dir, tmp_path / "st", (), pooling_mode="lasttoken"))
    assert engine.pooling.modes == ("lasttoken",)


REFUSED = [
    ({"modes": (), "pooling_mode": "attention"}, "pooling_mode 'attention' is not supported", "config.json"),
    ({"modes": ()}, "no pooling mode is set", "config.json"),
    ({"modes": ("cls",), "include_prompt": False}, "include_prompt: false is not supported", "config.json"),
    ({"modes": ("cls",), "pooling_mode_attention_tokens": True},
     "pooling mode pooling_mode_attention_tokens is not supported", "config.json"),
    ({"modes": ("cls",), "word_embedding_dimension": 7}, "word_embedding_dimension 7", "config.json"),
    ({"modes": ("cls",), "modules": [TRANSFORMER, POOLING,
                                     {"idx": 2, "path": "2_Dense", "type": "sentence_transformers.models.Dense"}]},
     "'sentence_transformers.models.Dense' .* is not supported", "modules.json"),
    ({"modes": ("cls",), "modules": [TRANSFORMER]}, "has no Pooling module", "modules.json"),
]


@pytest.mark.parametrize(("how", "says", "file"), REFUSED, ids=[r[1].split(" ")[0] + str(i) for i, r in
                                                               enumerate(REFUSED)])
def test_a_pooling_the_fleet_cannot_serve_refuses_the_model_at_load(
    model_dir: Path, tmp_path: Path, how: dict[str, Any], says: str, file: str
) -> None:
    how = dict(how)
    model = st_folder(model_dir, tmp_path / "st", how.pop("modes"), modules=how.pop("modules", None), **how)
    with pytest.raises(ModelLoadError, match=says) as info:
        engine_of(model)
    assert file in str(info.value) and str(tmp_path / "st") in str(info.value)


def test_a_worker_serves_a_cls_pooled_model_with_cls_vectors(fleet: Fleet, model_dir: Path, tmp_path: Path) -> None:
    """The reported case end to end: a worker and FleetClient, not mean pooling."""
    model = st_folder(model_dir, tmp_path / "st-cls", ("cls",))
    cfg = fleet.config(worker={"model": "demo-encoder"}, models={"demo-encoder": {"path": str(model)}})
    fleet.worker(cfg, model="demo-encoder")
    client = fleet.client(cfg)
    ids = [client.submit("demo-encoder", list(x), normalize=False) for x in INPUTS]
    results = client.wait(ids, timeout_s=60)
    engine = engine_of(model)
    for x, result in zip(INPUTS, results, strict=True):
        assert isinstance(result, InferenceResult) and result.embedding is not None, result
        np.testing.assert_allclose(result.embedding, reference(engine, x, ("cls",), False), rtol=1e-4, atol=1e-5)


def test_a_model_store_version_keeps_its_declared_pooling(model_dir: Path, tmp_path: Path) -> None:
    """Pushed and fetched, the version still says CLS + Normalize: the declaration travels with the model."""
    model = st_folder(model_dir, tmp_path / "st", ("cls",), normalize=True)
    store = ModelStore(LocalBackend(tmp_path / "store"), tmp_path / "cache")
    store.push(model, "st-encoder", "1.0.0")
    fetched = store.fetch("st-encoder", "1.0.0")
    assert fetched.parent != model.parent
    assert (fetched.parent / "1_Pooling" / "config.json").read_bytes() == (model.parent / "1_Pooling" /
                                                                           "config.json").read_bytes()
    pooling = engine_of(fetched).pooling
    assert (pooling.modes, pooling.normalize, pooling.source) == (("cls",), True, str(fetched.parent / "modules.json"))
