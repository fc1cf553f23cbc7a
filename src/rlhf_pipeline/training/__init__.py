"""Training machinery shared by every training stage: the loop, checkpoints, the stage frame, LoRA."""
