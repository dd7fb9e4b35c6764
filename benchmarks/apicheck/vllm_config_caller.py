"""Calls into vLLM's configuration classes and its distributed package, for `benchmarks/bench_apicheck_releases.py`
(read, never run). Configuration classes are built behind decorators (`@config` over a pydantic `@dataclass` in
vLLM 0.10, `@config` alone in 0.33) and the distributed helpers are re-exported through star imports: the shapes
that gave false errors before the checker followed them."""

import vllm.distributed as dist
from vllm.config import CacheConfig, LoadConfig, ParallelConfig, SchedulerConfig, SpeculativeConfig
from vllm.distributed import (
    get_pp_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    get_tp_group,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)


def configs(draft: str):
    cache = CacheConfig(block_size=16, gpu_memory_utilization=0.9)
    cache = CacheConfig(block_size=16, swap_space=4)  # swap_space: gone in later releases
    parallel = ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=1)
    parallel = ParallelConfig(tensor_parallel_size=8, data_parallel_size=2, enable_expert_parallel=True)
    scheduler = SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=8192)
    load = LoadConfig(load_format="safetensors", download_dir=None)
    spec = SpeculativeConfig(method="eagle3", model=draft, num_speculative_tokens=3)
    return cache, parallel, scheduler, load, spec


def collectives(tensor):
    group = get_tp_group()
    world = get_tensor_model_parallel_world_size()
    rank = get_tensor_model_parallel_rank()
    reduced = tensor_model_parallel_all_reduce(tensor)
    gathered = tensor_model_parallel_all_gather(tensor, dim=-1)
    last = get_pp_group().is_last_rank
    same = dist.get_tp_group()
    count = dist.get_tensor_model_parallel_world_size()
    return group, world, rank, reduced, gathered, last, same, count
