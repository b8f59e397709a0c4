"""Forecasting with the Temporal Fusion Transformer. Submodules import torch only where they run the model.

- :mod:`~.request`: what a run is asked to do (:class:`~.request.ForecastRequest`) and its checks;
- :mod:`~.pipeline`: the run end to end (:func:`~.pipeline.run`);
- :mod:`~.table`, :mod:`~.layout`, :mod:`~.records`: reading the user's table, deciding each
  column's role, validating each series into a :class:`~gencli.data.timeseries.SeriesRecord`;
- :mod:`~.features`: records -> model input arrays;
- :mod:`~.forecaster`: the loaded model, batched forecasts and explanations;
- :mod:`~.backtest`, :mod:`~.finetune`, :mod:`~.evaluate`, :mod:`~.metrics`: rolling-origin
  backtests, fine-tuning on the user's series, evaluation against baselines, the scores;
- :mod:`~.outputs`, :mod:`~.plot`: CSV, JSON lines, explanations, fan charts.
"""
