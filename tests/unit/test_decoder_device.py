"""The generation decoder's device choice and its transfer-meter arithmetic (pure logic).

The option maps are what ``InferenceSession.get_provider_options()`` reports (every value a string;
keys as onnxruntime-gpu 1.31's CUDA and TensorRT providers write them); this CPU machine can only
open a CPU session, so the GPU sessions' reports are written out here. The real CPU session's
report, and the meter's counts on a real model, are checked in tests/integration/test_decoder_transfers.py.
"""

from __future__ import annotations

import pytest

from workers.generation.decoder import Transfers, decoder_device

CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"
TRT = "TensorrtExecutionProvider"


def cuda_applied(device_id: str) -> dict[str, str]:
    """The CUDA provider's applied options, as a session reports them."""
    return {
        "device_id": device_id,
        "has_user_compute_stream": "0",
        "user_compute_stream": "0",
        "gpu_mem_limit": "18446744073709551615",
        "arena_extend_strategy": "kNextPowerOfTwo",
        "cudnn_conv_algo_search": "EXHAUSTIVE",
        "do_copy_in_default_stream": "1",
        "gpu_external_alloc": "0",
        "gpu_external_free": "0",
        "gpu_external_empty_cache": "0",
        "cudnn_conv_use_max_workspace": "1",
        "enable_cuda_graph": "0",
        "cudnn_conv1d_pad_to_nc1d": "0",
        "tunable_op_enable": "0",
        "tunable_op_tuning_enable": "0",
        "tunable_op_max_tuning_duration_ms": "0",
        "enable_skip_layer_norm_strict_mode": "0",
        "prefer_nhwc": "0",
        "use_ep_level_unified_stream": "0",
        "use_tf32": "1",
        "sdpa_kernel": "0",
        "fuse_conv_bias": "0",
    }


def trt_applied(device_id: str) -> dict[str, str]:
    """The TensorRT provider's applied options (a subset of its keys), as a session reports them."""
    return {
        "device_id": device_id,
        "has_user_compute_stream": "0",
        "trt_max_partition_iterations": "1000",
        "trt_min_subgraph_size": "1",
        "trt_max_workspace_size": "0",
        "trt_fp16_enable": "1",
        "trt_int8_enable": "0",
        "trt_engine_cache_enable": "1",
        "trt_engine_cache_path": "var/trt-cache/demo-llama/1.0.0",
        "trt_timing_cache_enable": "1",
        "trt_profile_min_shapes": "input_ids:1x1",
        "trt_cuda_graph_enable": "0",
    }


@pytest.mark.parametrize(
    ("active", "applied", "expected"),
    [
        ([CPU], {CPU: {}}, ("cpu", 0)),
        (["AzureExecutionProvider", CPU], {"AzureExecutionProvider": {}, CPU: {}}, ("cpu", 0)),
        ([CUDA, CPU], {CUDA: cuda_applied("0"), CPU: {}}, ("cuda", 0)),
        ([CUDA, CPU], {CUDA: cuda_applied("1"), CPU: {}}, ("cuda", 1)),  # the configured device, not 0
        ([TRT, CUDA, CPU], {TRT: trt_applied("2"), CUDA: cuda_applied("2"), CPU: {}}, ("cuda", 2)),
        ([TRT, CPU], {TRT: trt_applied("3"), CPU: {}}, ("cuda", 3)),  # TensorRT alone is a GPU too
        ([TRT, CUDA, CPU], {TRT: trt_applied("0"), CUDA: cuda_applied("1"), CPU: {}}, ("cuda", 0)),  # first active
        ([CUDA, CPU], {CUDA: {}, CPU: {}}, ("cuda", 0)),  # no device_id reported: the default device
        ([CPU], {CUDA: cuda_applied("1"), CPU: {}}, ("cpu", 0)),  # only *active* providers count
    ],
)
def test_decoder_device_from_active_providers_and_applied_options(
    active: list[str], applied: dict[str, dict[str, str]], expected: tuple[str, int]
) -> None:
    assert decoder_device(active, applied) == expected


def test_transfers_per_token_and_between_snapshots() -> None:
    before = Transfers("cuda:1", h2d_bytes=1_000, d2h_bytes=5_000, prefills=1, decode_steps=2, tokens=6)
    after = Transfers("cuda:1", h2d_bytes=1_600, d2h_bytes=9_000, prefills=1, decode_steps=4, tokens=10)
    delta = after.since(before)
    assert delta == Transfers("cuda:1", 600, 4_000, 0, 2, 4)
    assert delta.bytes_per_token == 1_150.0
    assert after.bytes_per_token == 1_060.0
    assert after.crossed


def test_transfers_on_cpu_are_what_would_cross_and_nothing_is_per_token_before_a_token() -> None:
    idle = Transfers("cpu", 0, 0, 0, 0, 0)
    assert not idle.crossed
    assert idle.bytes_per_token == 0.0
