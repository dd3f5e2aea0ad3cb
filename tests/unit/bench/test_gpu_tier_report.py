"""The GPU tier's summary (bench/gpu_tier_report.py): outcomes from the JUnit XML, the header and printed figures
from the log, and a run cut short (no XML yet) recorded as incomplete rather than as a pass."""

from __future__ import annotations

from pathlib import Path

from gpu_tier_report import report

XML = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="3">
<testcase classname="tests.gpu.test_gpu_processes.TestServing" name="test_pause" time="3.25"/>
<testcase classname="tests.gpu.test_gpu_processes" name="test_reward" time="5">
<failure message="AssertionError: low&#10;detail">trace</failure></testcase>
<testcase classname="tests.gpu.test_gpu_processes.TestCanary" name="test_syncs" time="1"><skipped message="no CUDA"/>
</testcase></testsuite></testsuites>"""
LOG = """lorafleet GPU tier: vLLM 0.26.0; GPUs 0: NVIDIA H100 80GB HBM3 (81559 MiB)
noise
bfloat16 canary distances: between replicas 0.012, adapter vs base on each replica [0.3, 0.31]
"""


def test_outcomes_header_and_printed_figures_are_read(tmp_path: Path) -> None:
    (tmp_path / "t.xml").write_text(XML)
    (tmp_path / "t.log").write_text(LOG)
    result = report(tmp_path / "t.xml", tmp_path / "t.log")
    assert [(t["test"], t["outcome"]) for t in result["tests"]] == [
        ("TestServing::test_pause", "passed"), ("test_gpu_processes::test_reward", "failed"),
        ("TestCanary::test_syncs", "skipped")]
    assert result["tests"][1]["why"] == "AssertionError: low"
    assert (result["passed"], result["failed"], result["skipped"], result["seconds"]) == (1, 1, 1, 9.2)
    assert result["header"] == [LOG.splitlines()[0]] and result["printed"] == [LOG.splitlines()[2]]
    assert result["complete"] and "machine" in result["meta"]


def test_a_run_cut_short_is_incomplete_with_no_tests_counted(tmp_path: Path) -> None:
    (tmp_path / "t.log").write_text(LOG)
    result = report(tmp_path / "t.xml", tmp_path / "t.log")
    assert not result["complete"] and result["tests"] == [] and result["passed"] == 0
    assert result["printed"]
