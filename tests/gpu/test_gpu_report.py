"""The GPU report's figures, on the tiny shape in float32 on the CPU (not marked gpu: runs everywhere).

The report is what tests/gpu/run.sh ends with on a GPU machine, where nobody watches it being
written; this keeps its every figure present and sane without one.
"""

from __future__ import annotations

import json
import pathlib

import pytest

from tests.gpu import gpu_report

TINY = ["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--batches", "1", "4"]
FEW_STEPS = ["--prompt-len", "16", "--steps", "4", "--warmup-steps", "1"]


@pytest.mark.timeout(30)
def test_report_has_every_figure_and_a_roofline_with_a_peak(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "report.json"
    assert gpu_report.main([*TINY, *FEW_STEPS, "--peak-gbps", "100", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    figures = json.loads(out.read_text())

    assert figures["device"] == "cpu" and figures["dtype"] == "float32" and figures["shape"] == "tiny"
    assert figures["attention_backend"] == "sdpa"  # auto on a CPU
    assert figures["peak_gbps"] == 100.0 and figures["peak_source"] == "--peak-gbps"
    assert figures["greedy_ok"] and len(figures["greedy"]) == len(gpu_report.GREEDY_PROMPT_LENS)
    # float32 on both sides: no near-tie excuse needed.
    assert all(row["equal"] and len(row["ours"]) == 16 for row in figures["greedy"])
    assert [row["batch"] for row in figures["decode"]] == [1, 4]
    for row in figures["decode"]:
        assert row["ours_tokens_per_s"] > 0 and row["transformers_tokens_per_s"] > 0
        assert row["bytes_per_step"] > figures["weight_bytes"] > 0
        assert 0 < row["ours_roofline_fraction"] < 1 and 0 < row["transformers_roofline_fraction"] < 1
    assert "greedy        PASS" in text and "unknown" not in text


@pytest.mark.timeout(30)
def test_report_says_unknown_without_a_peak(capsys: pytest.CaptureFixture[str]) -> None:
    report = gpu_report.run(gpu_report.parse_args([*TINY, *FEW_STEPS, "--batches", "1"]))
    assert report.peak_gbps is None and report.peak_source == "unknown"
    assert all(d.roofline_ms is None and d.ours_roofline_fraction is None for d in report.decode)
    text = gpu_report.format_report(report)
    assert "peak HBM      unknown" in text
    assert text.splitlines()[-1].split()[-3:] == ["unknown", "unknown", "unknown"]


@pytest.mark.parametrize(
    ("name", "gbps"),
    [
        ("NVIDIA H200", 4800.0),
        ("NVIDIA H100 80GB HBM3", 3350.0),
        ("NVIDIA H100 PCIe", 2000.0),
        ("NVIDIA A100-SXM4-80GB", 2039.0),
        ("NVIDIA A100-PCIE-40GB", 1555.0),
        ("NVIDIA L4", 300.0),
        ("NVIDIA A10", 600.0),
        ("NVIDIA GeForce RTX 4090", 1008.0),
        ("NVIDIA L40S", None),
        ("cpu", None),
    ],
)
def test_peak_bandwidth_by_whole_name_tokens(name: str, gbps: float | None) -> None:
    assert gpu_report.peak_bandwidth(name, None)[0] == gbps
    assert gpu_report.peak_bandwidth(name, 123.0) == (123.0, "--peak-gbps")
