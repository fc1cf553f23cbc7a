"""rlhf-pipeline: staged, offline, iterative RLHF as standalone programs that pass Hugging Face datasets along.

Importing the package is cheap: no torch, transformers, datasets, vLLM or DeepSpeed import happens here.
"""

__version__ = "0.1.0"
