"""What a run records and the tools that read it back: each report's line and metrics.jsonl (reporter.py),
the trackers it also goes to (trackers.py), fms-plot-metrics (plot.py) and fms-compare-runs (compare.py)."""
