"""Data parallelism for the draft trainer: DDP (default) or FSDP2, both under torchrun.

One interface for the trainer: ``wrap`` the module, ``accumulating`` around micro-batches that must not
synchronise gradients, and full (unsharded) state dicts for checkpoints and the saved draft — collective
calls that every rank makes, with the tensors landing on rank 0's CPU.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Any, Iterator

import torch

from ..model.distributed import Dist

# above this many tokens a micro-batch, one call's weight-gradient matmul is already large enough: deferring only adds
# the copies that join the K calls (H200, RESULTS: 2,048 tokens at the 8B shape gained 1.0-2.1 ms a step; 16,384 at
# the demo's lost 4.5-4.8 ms)
DEFERRED_MAX_TOKENS = 4096


class Parallel:
    def __init__(self, strategy: str, dist: Dist, device: torch.device):
        self.strategy = strategy if dist.world > 1 else "none"
        self.dist = dist
        self.device = device

    @property
    def lockstep(self) -> bool:
        """FSDP2 gathers parameters collectively in every forward: all ranks must run the same number."""
        return self.strategy == "fsdp2"

    def wrap(self, module: torch.nn.Module) -> torch.nn.Module:
        """The module to call for training (FSDP2 shards ``module`` in place; DDP wraps it)."""
        if self.strategy == "fsdp2":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh(self.device.type, (self.dist.world,))
            fully_shard(module, mesh=mesh)
            return module
        if self.strategy == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            return DistributedDataParallel(
                module, device_ids=[self.device.index] if self.device.type == "cuda" else None
            )
        return module

    def weight_grads(self, draft: torch.nn.Module, tokens: int, ttt_steps: int):
        """Around a micro-batch's forward and backward: in one process on a GPU, with at most DEFERRED_MAX_TOKENS
        tokens a micro-batch, the draft's shared layers make their weight gradients once over the K = ``ttt_steps``
        TTT calls (``model.shared_linear``). DDP and FSDP2 reduce gradients from autograd's per-weight hooks; on the
        CPU (float32, no casts to save) and past the token bound, the kept gradients cost more than they save: there
        autograd makes them call by call."""
        if self.strategy == "none" and self.device.type == "cuda" and tokens <= DEFERRED_MAX_TOKENS:
            from ..model.shared_linear import deferred_weight_grads

            return deferred_weight_grads(draft, calls_per_layer=ttt_steps)
        return nullcontext()

    @contextmanager
    def accumulating(self, wrapped: torch.nn.Module, last: bool) -> Iterator[None]:
        """Gradients are reduced across ranks only on the ``last`` micro-batch of a step."""
        if self.strategy == "ddp" and not last:
            with wrapped.no_sync():
                yield
        elif self.strategy == "fsdp2":
            wrapped.set_requires_gradient_sync(last)
            yield
        else:
            with nullcontext():
                yield

    def full_state(
        self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, model: torch.nn.Module
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Unsharded CPU state dicts of ``model`` (a submodule of ``module``) and of the optimizer (keyed by
        parameter names relative to ``module``); empty on ranks other than 0 under FSDP2."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(model, options=options), get_optimizer_state_dict(
            module, optimizer, options=options
        )

    def load_state(
        self,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        model: torch.nn.Module,
        model_state: dict[str, torch.Tensor],
        optimizer_state: dict[str, Any],
    ) -> None:
        """Every rank passes the full state dicts (read from the checkpoint); each keeps its shard."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, strict=False)
        set_model_state_dict(model, model_state, options=options)
        set_optimizer_state_dict(module, optimizer, optimizer_state, options=options)
