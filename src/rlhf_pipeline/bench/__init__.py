"""``rlhf bench``: side-by-side benchmarks of the pipeline against what users would otherwise run."""
