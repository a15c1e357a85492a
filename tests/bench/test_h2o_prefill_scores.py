"""bench/h2o_prefill_scores.py: the report from records (medians per arm, the selection-agreement count)."""

from __future__ import annotations

import argparse

from bench.h2o_prefill_scores import report
from litctx_common.io import append_jsonl


def _row(sid, arm, live, rec, comp, same):
    return {"id": sid, "length": 4000, "arm": arm, "plain_prefill_s": 5.0, "live_prefill_s": live,
            "recorded_prefill_s": rec, "h2o_compress_s": comp, "same_selection": same}


def test_report_gives_each_arms_medians_and_counts_agreeing_samples(tmp_path):
    path = tmp_path / "r.jsonl"
    append_jsonl(path, [_row("a", "separate pass", 12.0, 7.0, 7.0, True), _row("a", "fused", 7.0, 8.0, 0.1, True),
                        _row("b", "separate pass", 14.0, 9.0, 6.0, False), _row("b", "fused", 9.0, 6.0, 0.3, False),
                        _row("c", "separate pass", 13.0, 8.0, 8.0, True), _row("c", "fused", 8.0, 7.0, 0.2, True)])
    text = report(argparse.Namespace(results=path))
    assert "| separate pass | 13.00 (12.00-14.00) | 8.00 (7.00-9.00) | 7.00 (6.00-8.00) | 15.00 |" in text
    assert "| fused | 8.00 (7.00-9.00) | 7.00 (6.00-8.00) | 0.20 (0.10-0.30) | 7.20 |" in text
    assert "2 of 3 samples" in text and "--samples 3" in text


def test_report_without_records_says_so(tmp_path):
    assert report(argparse.Namespace(results=tmp_path / "none.jsonl")) == "No records yet."
