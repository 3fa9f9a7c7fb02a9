"""Counting node placement from an ONNX Runtime profile (pure logic over its trace-event list)."""

from __future__ import annotations

from typing import Any

from workers.placement import Placement, count_placement


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
