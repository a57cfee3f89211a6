"""Command-line programs: ``meshd`` (the daemon) and ``meshctl`` (its admin tool)."""
