"""Which sessions ask ONNX Runtime for CUDA graphs, and what happens when it refuses (pure logic of
:mod:`workers.cuda_graph`; the decode steps themselves: tests/integration/test_cuda_graph_steps.py)."""

from __future__ import annotations

from typing import Any

from protocol.settings import EngineSettings
from workers.cuda_graph import capture_active, cuda_graph_chain, open_capturing
from workers.inplace_graph import KVChoice
from workers.ort_session import ProviderStep

CUDA = ("CUDAExecutionProvider", {"device_id": 1})
TRT = ("TensorrtExecutionProvider", {"trt_fp16_enable": True})
CPU = ("CPUExecutionProvider", {})
IN_PLACE = KVChoice(b"graph", True, "attention rewritten to GroupQueryAttention")
CONCAT = KVChoice(b"graph", False, "providers [...]: GroupQueryAttention's CUDA kernel takes a float16 KV cache")
ON = EngineSettings(cuda_graph=True)


def test_only_an_in_place_cache_on_a_cuda_chain_asks_for_graphs() -> None:
    chain = [CUDA, CPU]
    asked, why = cuda_graph_chain(chain, ON, IN_PLACE)
    assert why is None and asked == [("CUDAExecutionProvider", {"device_id": 1, "enable_cuda_graph": "1"}), CPU]
    assert chain == [CUDA, CPU] and CUDA[1] == {"device_id": 1}  # the requested chain is not changed
    assert cuda_graph_chain(chain, EngineSettings(), IN_PLACE) == (chain, None)
    for other, kv, reason in (([CPU], IN_PLACE, "has no CUDA provider"),
                              ([TRT, CUDA, CPU], IN_PLACE, "TensorRT is ahead of CUDA"),
                              ([CUDA, CPU], CONCAT, "keeps the Concat one (providers [...]: GroupQueryAttention's")):
        same, why = cuda_graph_chain(other, ON, kv)
        assert same is other and why is not None and reason in why


def _steps(graphs: bool | None) -> list[ProviderStep]:
    """A CUDA step active with graphs (True), active without (False), or refused (None); then CPU."""
    cuda = (ProviderStep("CUDAExecutionProvider", {}, reason="This session cannot use the graph capture feature")
            if graphs is None else
            ProviderStep("CUDAExecutionProvider", {}, applied={"enable_cuda_graph": "1" if graphs else "0"}))
    return [cuda, ProviderStep("CPUExecutionProvider", {}, applied={})]


class _Session:
    ended = False

    def end_profiling(self) -> str:
        self.ended = True
        return ""


def test_a_refused_capture_reopens_the_requested_chain_and_says_why() -> None:
    plain = [CUDA, CPU]
    graphs, _ = cuda_graph_chain(plain, ON, IN_PLACE)
    for outcome, reopened in ((True, False), (False, True), (None, True)):
        opened: list[tuple[list[Any], _Session]] = []

        def open_chain(chain: list[Any], outcome: bool | None = outcome,
                       opened: list[tuple[list[Any], _Session]] = opened) -> tuple[_Session, list[ProviderStep]]:
            session = _Session()
            opened.append((chain, session))
            return session, _steps(outcome if chain is graphs else False)

        session, steps, why = open_capturing(open_chain, graphs, plain)
        assert [c for c, _ in opened] == ([graphs, plain] if reopened else [graphs])
        assert session is opened[-1][1] and capture_active(steps) is (not reopened)
        assert opened[0][1].ended is reopened  # the refused session writes no placement profile later
        prefix = "the CUDA provider did not open with graph capture: "
        if outcome is None:
            assert why == prefix + "This session cannot use the graph capture feature"
        elif outcome is False:
            assert why == prefix + "the CUDA provider did not apply enable_cuda_graph"
        else:
            assert why is None
    session, steps, why = open_capturing(lambda chain: (_Session(), _steps(False)), plain, plain)
    assert why is None and not capture_active(steps)


def test_fleet_status_names_a_kv_cache_whose_steps_replay_graphs() -> None:
    from producer.ops_cli import _kv

    doc = {"cache": "in_place", "dtype": "float16", "memory": "device", "bytes": 192 << 20}
    assert _kv({**doc, "cuda_graphs": True}) == "in place float16 device 192 MiB + cuda graphs"
    assert _kv({**doc, "cuda_graphs": False}) == _kv(doc) == "in place float16 device 192 MiB"
