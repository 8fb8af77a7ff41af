"""Launchers start the ranks of a run: local processes, or Spark barrier tasks."""
