"""specrl.observability: what a run records and shows: the step record (one line of metrics.jsonl), the metrics
writers and the live display, and one run's report with its plots.
"""
