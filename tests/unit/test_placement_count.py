"""Counting node placement from an ONNX Runtime profile (pure logic over its trace-event list), and when a
placement is worth a warning."""

from __future__ import annotations

from typing import Any

import pytest

from workers.placement import Placement, count_placement, format_nodes, placement_warning


def _node(name: str, provider: str, kind: str = "kernel_time") -> dict[str, Any]:
    return {"cat": "Node", "name": f"{name}_{kind}", "args": {"provider": provider, "op_name": "MatMul"}}


def test_each_node_counts_once_for_the_provider_that_ran_it() -> None:
    events = [
        {"cat": "Session", "name": "model_run", "args": {}},
        _node("/h.0/MatMul", "CUDAExecutionProvider"),
        _node("/h.0/MatMul", "CUDAExecutionProvider", "fence_before"),
        _node("/h.0/MatMul", "CUDAExecutionProvider"),  # a second run of the same node
        _node("/h.0/Shape", "CPUExecutionProvider"),
        _node("/h.1/MatMul", "CUDAExecutionProvider"),
        {"cat": "Node", "name": "odd_kernel_time", "args": {}},  # no provider: not counted
    ]
    assert count_placement(events) == {"CUDAExecutionProvider": 2, "CPUExecutionProvider": 1}


def test_shares_of_a_placement() -> None:
    placement = Placement({"CUDAExecutionProvider": 3, "CPUExecutionProvider": 1}, ["CUDAExecutionProvider"])
    assert placement.total == 4
    assert placement.share("CUDAExecutionProvider") == 0.75
    assert Placement({}, []).share("CPUExecutionProvider") == 0.0


CUDA, TRT, CPU = "CUDAExecutionProvider", "TensorrtExecutionProvider", "CPUExecutionProvider"


@pytest.mark.parametrize(
    ("nodes", "providers", "warn"),
    [
        ({CPU: 84}, [CPU], False),  # a CPU session: everything on the CPU is the plan
        ({CUDA: 190, CPU: 6}, [CUDA, CPU], False),  # 3 %: shape ops
        ({CUDA: 90, CPU: 10}, [CUDA, CPU], False),  # exactly 10 %: not more
        ({CUDA: 317, CPU: 57}, [CUDA, CPU], True),  # dynamic INT8 on CUDA: 15 %
        ({TRT: 5, CPU: 5}, [TRT, CUDA, CPU], True),
        ({}, [CUDA, CPU], False),
    ],
)
def test_warning_when_a_gpu_session_runs_more_than_a_tenth_on_cpu(
    nodes: dict[str, int], providers: list[str], warn: bool
) -> None:
    assert placement_warning(nodes, providers) is warn


def test_nodes_in_one_line() -> None:
    assert format_nodes({CUDA: 190, CPU: 6}) == "CUDA 190, CPU 6"
