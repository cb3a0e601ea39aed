"""Metrics from hand-made request timings."""

import pytest

from weft.benchmark.metrics import measure, percentiles, summarize
from weft.inference.outputs import CompletionOutput, RequestMetrics, RequestOutput


def output(arrival: float, times: list[float], prompt_len: int = 4) -> RequestOutput:
    metrics = RequestMetrics(arrival, arrival, times, times[-1] if times else None)
    completion = CompletionOutput(0, "", [7] * len(times), "length")
    return RequestOutput(0, None, [1] * prompt_len, [completion], True, metrics)


def test_percentiles_interpolate_and_name_their_keys():
    assert percentiles("ttft", [1.0, 2.0, 3.0]) == {"ttft_p50_s": 2.0, "ttft_p90_s": 2.8, "ttft_p99_s": 2.98}
    assert percentiles("itl", []) == {"itl_p50_s": None, "itl_p90_s": None, "itl_p99_s": None}


def test_summarize_latencies_rates_and_failed_requests():
    outs = [output(0.0, [1.0, 1.5, 2.5]), output(1.0, [3.0, 3.5]), output(0.0, [])]  # the last one failed
    m = summarize(outs, makespan_s=4.0, peak_mem_bytes=None, preemptions=1, recomputed_tokens=5)
    rec = m.as_record()
    assert (rec["requests"], rec["input_tokens"], rec["output_tokens"]) == (3, 12, 5)
    assert rec["ttft_p50_s"] == pytest.approx(1.5)  # 1.0 and 2.0
    assert rec["itl_p50_s"] == pytest.approx(0.5)  # 0.5, 1.0, 0.5
    assert rec["e2e_p50_s"] == pytest.approx(2.5)  # 2.5 and 2.5
    assert rec["output_tok_s"] == pytest.approx(5 / 4) and rec["input_tok_s"] == pytest.approx(3.0)
    assert (rec["preemptions"], rec["recomputed_tokens"], rec["peak_mem_bytes"]) == (1, 5, None)
    with pytest.raises(ValueError, match="makespan"):
        summarize(outs, 0.0, None, None, None)


def test_measure_times_the_body_on_the_cpu():
    with measure("cpu") as window:
        sum(range(10000))
    assert window.makespan_s > 0 and window.start > 0 and window.peak_mem_bytes is None
