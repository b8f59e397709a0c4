"""Reliability rules below the shell: what a command prints and computes (issue 30's classes, unit level)."""

from __future__ import annotations

from types import SimpleNamespace


def test_explain_prints_every_member_with_weight_heaviest_first():
    from gencli.pipelines.forecast.outputs import explain_text

    weights = {"network": 0.0, "damped trend": 0.0, "theta": 0.0, "holt-winters": 0.25, "arima": 0.0, "seasonal arima": 0.75}
    ex = {"past": {"a": 1.0}, "future": {"b": 1.0}, "static": {}, "attention_by_lag": [1.0], "attention_on_history": 1.0, "ensemble": weights}
    text = explain_text(SimpleNamespace(explain=ex, record=SimpleNamespace(id="s")))
    line = next(x for x in text.splitlines() if "ensemble weights" in x)
    assert line.split(": ", 1)[1] == "seasonal arima 0.75, holt-winters 0.25"


def test_backtest_label_names_every_member_that_ran():
    from gencli.pipelines.forecast.forecaster import ENSEMBLE_LABELS
    from gencli.pipelines.forecast.pipeline import backtest_label

    assert backtest_label(True) == "TFT"
    label = backtest_label(False)
    assert all(name in label for name in ENSEMBLE_LABELS[1:]) and "ETS/Theta" not in label
