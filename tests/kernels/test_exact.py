"""weft/layers/exact.py: exp and SiLU from correctly rounded operations, within a few ulp of float64, and the same bits
for an element whatever slice of a tensor it is computed in, with many threads splitting the work."""

import pytest
import torch
import torch.nn.functional as F

from weft.layers import exact

pytestmark = pytest.mark.kernels


def ulps(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """|got - want| in units of float32's spacing at want (got float32, want float64)."""
    w = want.float()
    spacing = (torch.nextafter(w.abs(), torch.tensor(float("inf"))) - w.abs()).double()
    return (got.double() - want).abs() / spacing


def test_exp_and_silu_are_within_a_few_ulp_of_float64():
    x = torch.linspace(-87.0, 88.0, 400_001)  # float32's normal range of e**x
    assert ulps(exact.exp(x), torch.exp(x.double())).max() <= 2
    y = torch.linspace(-60.0, 60.0, 400_001)
    assert ulps(exact.silu(y), F.silu(y.double())).max() <= 3  # exp's error, then two roundings
    ends = exact.exp(torch.tensor([-float("inf"), -200.0, 100.0, 0.0]))
    assert ends.tolist() == [0.0, 0.0, float("inf"), 1.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_element_keeps_its_bits_in_any_slice(dtype):
    threads = torch.get_num_threads()
    torch.set_num_threads(16)  # more threads than most tensors' shares: many share ends, each at its own element
    try:
        x = (torch.randn(10_007, generator=torch.Generator().manual_seed(0)) * 20).to(dtype)
        for f in (exact.exp, exact.silu):
            full = f(x)
            for start, stop in [(0, 1), (3, 4_000), (4_001, 4_017), (5_000, 10_007)]:
                assert torch.equal(f(x[start:stop].clone()), full[start:stop]), (f.__name__, start, stop)
    finally:
        torch.set_num_threads(threads)
