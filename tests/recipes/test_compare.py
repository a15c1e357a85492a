"""recipes.compare: the follow-up against its baseline (then.baseline): the line, the chance level, the figure."""

from pathlib import Path
from types import SimpleNamespace

import pytest

from recipes.compare import _chance, compare_line, compare_with_baseline, metric_history


def _run(tmp_path: Path, name: str, rows):
    run_dir = tmp_path / name
    (run_dir / "logs").mkdir(parents=True)
    lines = ["step,val/top10_acc,train/loss"] + [f"{s},{v},{'' if v == '' else 1.0}" for s, v in rows]
    (run_dir / "logs" / "metrics.csv").write_text("\n".join(lines) + "\n")
    cfg = SimpleNamespace(checkpoint=SimpleNamespace(monitor="val/top10_acc", mode="max"))
    return SimpleNamespace(run_dir=run_dir, cfg=cfg)


def test_the_line_compares_test_values_and_the_figure_is_written(tmp_path, capsys):
    ours = _run(tmp_path, "ours", [(10, 0.3), (20, ""), (30, 0.5), (40, 0.4)])
    base = _run(tmp_path, "base", [(10, 0.35), (30, 0.3)])
    assert metric_history(ours.run_dir, "val/top10_acc") == [(10, 0.3), (30, 0.5), (40, 0.4)]  # blank cells skipped
    figure = tmp_path / "plots" / "baseline.png"
    line = compare_with_baseline(ours, {"test/top10_acc": 0.45, "test/top10_chance": 0.25}, base,
                                 {"test/top10_acc": 0.5, "test/top10_chance": 0.25}, figure)
    assert "did not help: test/top10_acc 0.4500 from it vs 0.5000 from scratch (-0.0500" in line
    assert line in capsys.readouterr().out
    pytest.importorskip("matplotlib")
    assert figure.stat().st_size > 1000


def test_without_test_metrics_the_best_validation_values_are_compared(tmp_path):
    ours = _run(tmp_path, "ours", [(10, 0.3), (30, 0.5)])
    base = _run(tmp_path, "base", [(10, 0.35), (30, 0.3)])
    line = compare_with_baseline(ours, {}, base, {}, tmp_path / "b.png")
    assert "helped: best val/top10_acc 0.5000 from it vs 0.3500" in line


@pytest.mark.parametrize("ours,base,mode,word", [(0.4, 0.3, "max", "helped"), (0.4, 0.3, "min", "did not help"),
                                                 (0.3, 0.3, "max", "made no difference")])
def test_compare_line_reads_the_mode(ours, base, mode, word):
    assert f" {word}: " in compare_line(ours, base, "test/x", mode, "the checkpoint")
    assert "nothing to compare" in compare_line(None, base, "test/x", mode, "the checkpoint")


def test_the_chance_level_is_the_metric_logged_beside_the_tested_one():
    assert _chance({"test/top10_acc": 0.4, "test/top10_chance": 0.25}, "test/top10_acc") == 0.25
    assert _chance({"test/top10_acc": 0.4}, "test/top10_acc") is None
    assert _chance({"test/top10_chance": 0.25}, "best val/top10_acc") is None
