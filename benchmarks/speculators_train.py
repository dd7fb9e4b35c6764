"""speculators 0.9.0's own trainer, as ``python -m speculators.train ARGS`` runs it, for the same-data comparison
(benchmarks/speculators_vs_eaglet_device.sh; issue 59).

One runtime workaround, the anchor harness's (../shared/anchors/speculators-0.9.0/README.md): speculators 0.9.0 gives
its fused loss's forward and backward Triton kernels one shared ``autotune`` configs list, and torch 2.11's dynamo
asserts on it ("ListVariable ... is already tracked for mutation", fixed upstream by pytorch PR #177874). The backward
kernel gets its own copy of the same list; nothing else changes. Printed on stderr when applied.
"""

from __future__ import annotations

import sys


def give_backward_kernel_its_own_configs() -> bool:
    from speculators.losses import fused

    forward, backward = fused.loss_forward_kernel, fused.loss_backward_kernel
    if getattr(forward, "configs", None) is not getattr(backward, "configs", object()):
        return False
    backward.configs = list(backward.configs)
    return True


def main() -> None:
    from speculators.train.cli import main as train
    from speculators.train.config import TrainConfig

    if give_backward_kernel_its_own_configs():
        print("speculators_train: the fused loss's backward kernel has its own autotune configs list", file=sys.stderr)
    train(TrainConfig.resolve())


if __name__ == "__main__":
    main()
