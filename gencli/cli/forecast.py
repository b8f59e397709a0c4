"""`gencli forecast`."""

from gencli.cli import app
from gencli.cli.common import placeholder

placeholder(app, "forecast", "Quantile forecasts for the series in a CSV with a Temporal Fusion Transformer.", "TFT forecasting")
