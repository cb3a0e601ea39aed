"""e17: decode GEMMs (issue 34). Parts, each selectable with -k:

- kernel: each linear layer of e17_models at 1 and DECODE_ROWS rows as a decode runs it (the tuned launch of
  weft.layers.linear's TUNED table where one beat cuBLAS on this GPU, else cuBLAS; gate_up with the MLP's SiLU x up
  after it, in the launch's epilogue or by weft.layers.fused's kernel), beside cuBLAS: GPU time replayed
  from a CUDA graph over copies of the weight that together outgrow the L2 (a step's layers each read their own), and
  each as a fraction of the copy bandwidth (the weight's bytes at that bandwidth, over the time). Without a GPU a tiny
  model's layers run once through a fixed launch in Triton's interpreter, timed by the host clock, only so that the
  code cannot rot.
- batch1_itl: e12's batch-1 request on each of e17_models, weft with its defaults beside HF's static cache
  (compiled on a GPU), each with the weights floor per step.
"""

import pytest
import torch
import torch.nn.functional as F

from weft.benchmark import workloads
from weft.benchmark.environment import kernel_environment, launched_seconds
from weft.benchmark.floor import step_weights
from weft.benchmark.runner import BenchConfig
from weft.benchmark.tune_gemm import VERIFY_ROUNDS, Shape, layer_shapes
from weft.inference.config import DTYPES
from weft.layers.linear import DECODE_ROWS, DecodeLaunch, Tiles, decode_launch, decode_matmul
from weft.models.loader import resolve_model

pytestmark = pytest.mark.perf

CPU_LAUNCH = DecodeLaunch(Tiles(DECODE_ROWS, 32, 4, 3, 64), 2, DECODE_ROWS)
LAYERS = ("qkv", "o", "gate_up", "down", "lm_head")


def cpu_seconds(N: int, K: int, M: int, gated: bool) -> tuple[float, float, str]:
    """The interpreter's run of CPU_LAUNCH (checked against float64) and PyTorch's, by the host clock."""
    g = torch.Generator().manual_seed(N + K)
    x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g) * K**-0.5
    got = decode_matmul(x, w, None, CPU_LAUNCH, gated)
    assert torch.allclose(got.double(), reference(x.double(), w.double(), gated), atol=1e-4)
    return (launched_seconds(lambda: decode_matmul(x, w, None, CPU_LAUNCH, gated)),
            launched_seconds(lambda: reference(x, w, gated)), "interpreter")


def reference(x: torch.Tensor, w: torch.Tensor, gated: bool) -> torch.Tensor:
    """PyTorch's product (cuBLAS on CUDA); gated: SiLU(gate) x up of it."""
    y = F.linear(x, w)
    if not gated:
        return y
    gate, up = y.chunk(2, dim=-1)
    return F.silu(gate) * up


def gpu_seconds(N: int, K: int, M: int, dtype: torch.dtype, gated: bool) -> tuple[float, float, str]:
    """GPU seconds per call of weft's choice for M rows of an [N, K] weight and of cuBLAS's (gated: each with SiLU x
    up after, weft's in the launch, cuBLAS's by weft.layers.fused's kernel); which launch ran."""
    shape = Shape(N, K, dtype)
    w, x = shape.weights[0], shape.x[:M]
    launch = decode_launch(M, w, gated)
    if launch is not None:
        want = reference(x.double(), w.double(), gated)
        assert (decode_matmul(x, w, None, launch, gated).double() - want).abs().max() <= 2e-2 * want.abs().max()
    cublas = shape.cublas_s(M, VERIFY_ROUNDS, gated)
    if launch is None:
        return cublas, cublas, "cublas"
    t = launch.tiles
    return (shape.triton_s(launch, M, VERIFY_ROUNDS, gated), cublas,
            f"{t.block_n}x{t.block_k} w{t.num_warps} s{t.num_stages}, {launch.splits} splits")


@pytest.mark.parametrize("M", [1, DECODE_ROWS])
@pytest.mark.parametrize("layer", LAYERS)
def test_e17_kernel(benchmark, sizes, device, e17_model, layer, M):
    model = e17_model
    N, K = layer_shapes(resolve_model(model).config)[layer]
    dtype = DTYPES[sizes.dtype]
    gated = layer == "gate_up"  # with SiLU x up after it, as the MLP runs it
    seconds, cublas, launch = gpu_seconds(N, K, M, dtype, gated) if device.type == "cuda" else cpu_seconds(N, K, M,
                                                                                                        gated)
    env = kernel_environment(device)
    nbytes = N * K * dtype.itemsize
    pct = (lambda s: 100 * nbytes / s / 1e9 / env["copy_gbps"]) if env["copy_gbps"] else (lambda s: None)
    benchmark.extra_info.update(
        experiment="e17_kernel", model=model, layer=layer, N=N, K=K, M=M, dtype=sizes.dtype, launch=launch, gated=gated,
        time_s=seconds, cublas_s=cublas, cublas_over_weft=cublas / seconds, bytes=nbytes, pct_of_copy=pct(seconds),
        cublas_pct_of_copy=pct(cublas),
        timer="CUDA graph over weight copies, median" if device.type == "cuda" else "host clock, one call", **env,
    )
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)


def test_e17_batch1_itl(run_benchmark, sizes, model_for, device, e17_itl_run):
    model, engine = e17_itl_run
    hf = model_for(model, sizes.dtype, alone=True)
    workload = workloads.fixed(1, sizes.e12_prompt_len, sizes.e12_new_tokens, hf.config.vocab_size)
    config = BenchConfig(options=dict(attention=sizes.attention)) if engine == "weft" else BenchConfig(engine=engine)
    run_benchmark("e17_itl", config, workload, model=model, S=sizes.e12_prompt_len, B=1, **step_weights(hf, 1, device))
