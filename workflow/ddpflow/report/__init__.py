"""The report: building it from a run's files, rendering, plots, insight, a run's outcome."""
