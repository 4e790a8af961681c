"""Worker side: what runs on each rank (the per-rank loop, evaluation, log routing)."""
