"""e13's step profile: kernel names into classes, and the profile's per-step figures."""

from __future__ import annotations

import pytest
import torch

from weft.benchmark.profiling import kernel_class, step_profile


@pytest.mark.parametrize(("name", "cls"), [
    ("_split_kernel", "attention"), ("_prefill_kernel", "attention"), ("_grouped_kernel", "attention"),
    ("_write_kernel", "kv write"), ("_matmul_kernel", "gemm"), ("_rope_kernel", "gemm"),
    ("_add_rms_norm_kernel", "norm"), ("_rotary_kernel", "rope"), ("_silu_and_mul_kernel", "activation"),
    ("nvjet_tst_128x64_64x8_1x2_h_bz_TNT", "gemm"), ("sm90_xmma_gemm_bf16bf16_bf16f32", "gemm"),
    ("Memcpy HtoD (Pinned -> Device)", "copy"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::AddFunctor<float>>", "other"),
])  # fmt: skip
def test_kernel_classes(name, cls):
    assert kernel_class(name) == cls


def test_a_cpu_profile_times_the_steps_and_has_no_gpu_figures():
    calls = []
    result = step_profile(lambda: calls.append(torch.ones(64).sum()), 3, torch.device("cpu"))
    assert len(calls) == 6 and result["profiled_steps"] == 3 and result["step_ms"] > 0  # 3 timed, then 3 profiled
    assert result["gpu_busy_ms"] is None and result["gpu_ms_by_class"] is None
