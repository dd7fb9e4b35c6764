"""`eaglet train`: the EAGLE-3 draft trained with training-time test, offline (a store) or online (the target).

data (what a step consumes) · setup (the draft, teacher, optimizer, schedule) · step (one optimizer step) ·
evaluate (held-out τ) · parallel (DDP/FSDP2 under torchrun) · checkpoint (resume) · metrics (logs, plots) ·
loop (the epochs).
"""

from .loop import TrainResult, run_train

__all__ = ["TrainResult", "run_train"]
