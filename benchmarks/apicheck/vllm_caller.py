"""A caller of ~50 call sites into vLLM, for `benchmarks/bench_apicheck.py` (read, never run).

Written the way engine-facing research code is: LLM + SamplingParams, EngineArgs, v1 Request/Scheduler
internals, speculative configs. Some calls are what older vLLM versions took (the breaks users hit)."""

from vllm import LLM, SamplingParams
from vllm.engine.arg_utils import EngineArgs
from vllm.sampling_params import RequestOutputKind
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request


def offline_generation(model: str, draft: str):
    llm = LLM(model=model, tensor_parallel_size=1, dtype="bfloat16", seed=0)
    llm_spec = LLM(model, speculative_config={"method": "eagle3", "model": draft, "num_speculative_tokens": 4})
    llm_old = LLM(model=model, speculative_model=draft, num_speculative_tokens=4)  # vLLM < 0.7
    greedy = SamplingParams(temperature=0.0, max_tokens=128)
    nucleus = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=256, seed=1)
    stops = SamplingParams(max_tokens=64, stop=["</s>"], stop_token_ids=[2], include_stop_str_in_output=False)
    logprobs = SamplingParams(logprobs=5, prompt_logprobs=1, max_tokens=8)
    outputs = llm.generate(["Hello"], greedy)
    outputs = llm.generate(["Hello"], nucleus, use_tqdm=False)
    outputs = llm.generate(prompts=["Hello"], sampling_params=stops)
    outputs = llm_spec.generate(["Hello"], greedy, lora_request=None, priority=[0])
    outputs = llm.generate(["Hello"], greedy, prompt_token_ids=[[1, 2]])  # removed keyword
    chat = llm.chat([{"role": "user", "content": "hi"}], greedy)
    chat = llm.chat(messages=[{"role": "user", "content": "hi"}], sampling_params=nucleus, use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    llm_old.generate(["x"], logprobs)
    return outputs, chat, tokenizer


def engine_args(model: str, draft: str):
    args = EngineArgs(model=model)
    args = EngineArgs(model=model, tensor_parallel_size=2, max_model_len=4096, gpu_memory_utilization=0.9)
    args = EngineArgs(model=model, speculative_config={"method": "eagle3", "model": draft})
    args = EngineArgs(model=model, block_size=16, enable_prefix_caching=True, max_num_seqs=256)
    args = EngineArgs(model=model, use_v2_block_manager=True)  # removed field
    args = EngineArgs(model=model, swap_space=4, enforce_eager=True)
    config = args.create_engine_config()
    return config


def scheduler_internals(vllm_config, kv_cache_config, structured_output_manager):
    scheduler = Scheduler(vllm_config, kv_cache_config, structured_output_manager, block_size=16)
    scheduler = Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=structured_output_manager,
        block_size=16,
        log_stats=True,
    )
    scheduler_old = Scheduler(vllm_config, kv_cache_config, structured_output_manager)  # before block_size
    scheduler.add_request(make_request("a"))
    output = scheduler.schedule()
    scheduler.get_num_unfinished_requests()
    scheduler.has_finished_requests()
    scheduler.reset_prefix_cache()
    return output, scheduler_old


def make_request(request_id: str) -> Request:
    params = SamplingParams(max_tokens=16)
    request = Request(request_id, [1, 2, 3], params, None)
    request = Request(
        request_id=request_id,
        prompt_token_ids=[1, 2, 3],
        sampling_params=params,
        pooling_params=None,
        arrival_time=0.0,
        priority=0,
    )
    request = Request(request_id, [1, 2, 3], params, None, eos_token_id=2)  # removed keyword
    request = Request(request_id, [1, 2, 3], params, None, 0, 0.0, None, None, None, None, None, 0)
    request = Request(request_id, [1, 2, 3])  # missing sampling/pooling params
    request.get_num_encoder_embeds(0)
    request.append_output_token_ids(5)
    request.is_finished()
    return request


def sampling_variants():
    SamplingParams(n=2, best_of=4)  # best_of removed
    SamplingParams(presence_penalty=0.1, frequency_penalty=0.2, repetition_penalty=1.1)
    SamplingParams(min_tokens=4, ignore_eos=True, skip_special_tokens=False)
    SamplingParams(output_kind=RequestOutputKind.DELTA)
    SamplingParams(temperature=0.5, top_k=50, min_p=0.05)
    SamplingParams(use_beam_search=True)  # removed keyword
    SamplingParams(truncate_prompt_tokens=128, detokenize=False)
    SamplingParams.from_optional(temperature=0.0, max_tokens=8)
    SamplingParams.from_optional(temperatur=0.0)
    params = SamplingParams(max_tokens=4)
    params.clone()
    params.update_from_generation_config({}, None)
    params.verify(None, None, None, None)
