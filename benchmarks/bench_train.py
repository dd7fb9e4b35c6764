"""Draft training throughput and MFU: eaglet's TTT step next to a naive per-step implementation, one process.

Synthetic packed batch (documents of random lengths filling --tokens), the draft shaped like an 8B
target's (hidden 4096, 32 heads / 8 KV heads, intermediate 14336, draft vocab 32000) or the embedded
target's, K TTT steps. A step = forward + backward + grad clip + AdamW step, bf16 autocast over fp32
master weights, timed with CUDA synchronisation after warm-up; teacher logits are precomputed.
  eaglet: FlexAttention (GPU: the layouts --kernels names: split, train's default; one; per_step) / dense (CPU), the
          draft's pointwise work compiled (train's GPU default; "LAYOUT") and eager ("LAYOUT+eager_pointwise")
  naive: ReferenceAttention (explicit [T, T*(k+1)] mask), eager
Usage: python benchmarks/bench_train.py --shape 8b|smollm [--tokens 2048] [--ttt 7] [--steps 20] [--out FILE.json]
  [--pointwise compiled,eager]: which of the two to time for each layout (GPU; the CPU runs eager)
  [--profile]: after timing, one profiled step per layout; its busiest kernels and host operations are printed
  [--find-syncs]: after timing, the stack of the call that makes the host wait for the GPU (if a step has one)
  [--graph]: GPU, also each compiled layout with the whole step (forward, backward, clip, AdamW) replayed as one
             CUDA graph ("LAYOUT+graph"): the host launches one graph per step instead of ~1,200 kernels
  [--deferred]: GPU, also each compiled layout (and its graph, with --graph) with the shared layers' weight
             gradients made once per step over the K TTT calls ("LAYOUT+deferred", "LAYOUT+graph+deferred")
  [--train-step]: also the step `eaglet train` runs ("train_step", its defaults for this device: on a GPU recorded
             as two CUDA graphs, train.graphed, its batches copied to the GPU ahead by the prefetch thread as train's
             loop does; on a GPU also "train_step+copied_in", the batch copied from pinned host memory by the
             step itself, and "train_step+no_cuda_graphs", the step eager): the batch's copy and the teacher
             included, which the other variants leave out: its logits over the draft vocabulary, the target's argmax
             read from the batch as `eaglet extract` stores it
  [--computed-teacher-argmax]: the train_step variants' teacher as for a store without the argmax (vLLM's
             extraction, online training): the LM head over the target's whole vocabulary every step
  [--freeze-lm-head]: every variant with the draft's LM head frozen (train's --freeze-lm-head; speculators 0.9.0
             freezes it): no head weight gradient, no AdamW over its rows
  [--train-kernels one|per_step|split]: the train_step variants' attention layout (default: train's)
  [--only NAME,...]: time these variants alone (names as the output prints them). A recorded variant (train_step,
             train_step+copied_in, LAYOUT+graph) recorded after another one in the same process once failed on the
             H200 (cudaErrorStreamCaptureInvalidated), so benchmarks/e2e_h200.sh gives each its own process
The demo's step: --shape smollm --tokens 16384 --draft-vocab 32000 --kernels one --skip-naive
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings
from contextlib import nullcontext
from pathlib import Path

SHAPES = {
    "8b": dict(
        hidden_size=4096,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=14336,
        vocab_size=128256,
        draft_vocab_size=32000,
    ),
    "smollm": dict(
        hidden_size=576,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        intermediate_size=1536,
        vocab_size=49152,
        draft_vocab_size=16384,
    ),
    "tiny": dict(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=512,
        draft_vocab_size=256,
    ),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--ttt", type=int, default=7)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--skip-naive", action="store_true")
    parser.add_argument("--draft-vocab", type=int, default=None, help="override the shape's draft vocabulary")
    parser.add_argument(
        "--kernels", default="split,one", help="GPU FlexAttention layouts to time (train's attention_kernels)"
    )
    parser.add_argument(
        "--pointwise", default="compiled,eager", help="GPU: time compiled and/or eager pointwise pieces"
    )
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--profile", action="store_true", help="print each layout's busiest kernels over one step")
    parser.add_argument("--find-syncs", action="store_true", help="print where a step makes the host wait for the GPU")
    parser.add_argument("--graph", action="store_true", help="GPU: also the whole step replayed as one CUDA graph")
    parser.add_argument("--deferred", action="store_true", help="GPU: also one weight-gradient matmul over K calls")
    parser.add_argument("--train-step", action="store_true", help="also the step `eaglet train` runs, batch included")
    parser.add_argument(
        "--freeze-lm-head", action="store_true", help="every variant with the draft's LM head frozen (speculators')"
    )
    parser.add_argument(
        "--computed-teacher-argmax",
        action="store_true",
        help="train_step: the target's argmax from the whole LM head each step, not read from the batch",
    )
    parser.add_argument("--only", default=None, help="comma-separated variant names: time those alone")
    parser.add_argument(
        "--train-kernels", default=None, help="the attention layout of the train_step variants (default: train's)"
    )
    args = parser.parse_args()

    import torch

    from eaglet.formats.draft_config import DraftConfig
    from eaglet.model.draft import Eagle3Draft
    from eaglet.model.shared_linear import deferred_weight_grads
    from eaglet.model.sizing import draft_train_flops_per_token
    from eaglet.train.metrics import H200_BF16_DENSE_FLOPS
    from eaglet.train.ttt import ReferenceAttention, TTTInputs, attention_for, documents, ttt_forward

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = SHAPES[args.shape] | ({"draft_vocab_size": args.draft_vocab} if args.draft_vocab else {})
    config = DraftConfig(**shape, target_hidden_size=shape["hidden_size"], eagle_aux_hidden_state_layer_ids=[2, 16, 29])
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    lengths, left = [], args.tokens
    while left > 0:
        lengths.append(min(left, int(torch.randint(256, 1024, (1,), generator=generator))))
        left -= lengths[-1]
    offsets = torch.tensor([0] + lengths).cumsum(0)
    doc_ids, positions, doc_end = documents(offsets, device)
    vocab = shape["draft_vocab_size"]
    inputs = TTTInputs(
        input_ids=torch.randint(0, shape["vocab_size"], (args.tokens,), device=device),
        aux=torch.randn(args.tokens, 3, shape["hidden_size"], device=device),
        loss_mask=torch.rand(args.tokens, device=device) > 0.3,
        doc_ids=doc_ids,
        positions=positions,
        doc_end=doc_end,
        teacher_logits=torch.randn(args.tokens, vocab, device=device) * 3,
        teacher_in_vocab=torch.rand(args.tokens, device=device) > 0.1,
    )
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if device.type == "cuda" else nullcontext
    mean_context = sum(L * L for L in lengths) / args.tokens / 2
    flops = draft_train_flops_per_token(config, args.ttt, mean_context, head_trainable=not args.freeze_lm_head)
    flops *= args.tokens

    def new_draft():
        """The draft every variant starts from (the same seed); --freeze-lm-head: its head without gradients."""
        torch.manual_seed(0)
        draft = Eagle3Draft(config).to(device)
        draft.lm_head.weight.requires_grad_(not args.freeze_lm_head)
        return draft

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    spread = [None]  # [min, max] ms of the last timed variant

    def time_steps(step, warmup: int):
        """(median seconds of ``args.steps`` steps after ``warmup``, the last step's output)."""
        times = []
        for index in range(warmup + args.steps):
            sync()
            started = time.perf_counter()
            out = step()
            sync()
            if index >= warmup:
                times.append(time.perf_counter() - started)
        times.sort()
        spread[0] = [round(times[0] * 1e3, 2), round(times[-1] * 1e3, 2)]  # the variant's fastest and slowest step
        return statistics.median(times), out

    def measure_train_step(cuda_graphs: bool = True, staged: bool = True) -> dict:
        """`eaglet train`'s step on this device (``train.graphed.step_function``), fed a pinned host batch: copied to
        the GPU ahead by a prefetch thread (``staged``, as train's loop does for a recorded step) or by the step."""
        from itertools import repeat

        from eaglet.config import TrainConfig
        from eaglet.model.distributed import Dist
        from eaglet.model.sizing import PREFETCH_STEPS
        from eaglet.train.data import FeatureBatch, pad_to_budget
        from eaglet.train.graphed import Stager, step_function
        from eaglet.train.loss import TeacherHead
        from eaglet.train.parallel import Parallel
        from eaglet.train.prefetch import prefetched
        from eaglet.train.setup import Model
        from eaglet.train.ttt import TTTModule

        chosen = {"attention_kernels": args.train_kernels} if args.train_kernels else {}
        train = TrainConfig(
            out="-", store="-", ttt_steps=args.ttt, token_budget=args.tokens, cuda_graphs=cuda_graphs, **chosen
        )
        draft = new_draft()
        if device.type == "cuda":
            draft.compile_pointwise()
        module = TTTModule(draft, args.ttt, train.loss_decay, 0.0, train.attention_kernels)
        parallel = Parallel("ddp", Dist(rank=0, world=1, local_rank=0), device)
        parameters = [p for p in module.parameters() if p.requires_grad]
        graphed = train.records_step(device.type, 1)
        optimizer = torch.optim.AdamW(parameters, lr=1e-4, fused=device.type == "cuda", capturable=graphed)
        head = torch.randn(shape["vocab_size"], shape["hidden_size"], device=device) * 0.02
        teacher = TeacherHead(head.to(torch.bfloat16 if device.type == "cuda" else torch.float32),
                              torch.zeros(vocab, dtype=torch.long, device=device),
                              whole_head=args.computed_teacher_argmax)  # fmt: skip
        model = Model(draft, module, module, parallel, teacher, parameters, optimizer, autocast, graphed)
        step = step_function(model, train, device)
        host = FeatureBatch(
            input_ids=inputs.input_ids.cpu(),
            loss_mask=inputs.loss_mask.cpu().to(torch.uint8),
            aux=inputs.aux.cpu().to(torch.bfloat16),
            last=torch.randn(args.tokens, shape["hidden_size"]).to(torch.bfloat16),
            doc_offsets=offsets,
            sample_index=torch.arange(len(lengths)),
            # the target's argmax as a store keeps it; a quarter in the draft vocabulary, as the ids here are
            target_top=None
            if args.computed_teacher_argmax
            else torch.randint(shape["vocab_size"], (args.tokens,)).int(),
        )
        batch = pad_to_budget(host, args.tokens, pin=device.type == "cuda")
        feed = prefetched(repeat(batch), Stager(device), PREFETCH_STEPS) if staged and graphed else None

        def run():
            return step([next(feed) if feed is not None else batch])

        median, stats = time_steps(run, args.warmup)
        final_loss = round(float(stats.loss), 4)
        if args.profile:
            print(f"profile: train_step, cuda_graphs={cuda_graphs}, staged={feed is not None}")
            profile_step(run, device)
        if feed is not None:
            feed.close()
        return {
            "step_ms_median": round(median * 1e3, 2),
            "tokens_per_s": round(args.tokens / median, 1),
            "mfu": round(flops / median / H200_BF16_DENSE_FLOPS, 4) if device.type == "cuda" else None,
            "step_ms_spread": spread[0],
            "final_loss": final_loss,
            "recorded": graphed,
            "attention_kernels": train.attention_kernels,
            "teacher_argmax": "computed" if args.computed_teacher_argmax else "stored",
        }

    def measure(attention, compile_pointwise: bool = False, graphed: bool = False, deferred: bool = False) -> dict:
        draft = new_draft()
        if compile_pointwise:
            draft.compile_pointwise()
        parameters = [p for p in draft.parameters() if p.requires_grad]
        # capturable: AdamW's step count lives on the device, so the step can be recorded in a CUDA graph
        optimizer = torch.optim.AdamW(parameters, lr=1e-4, fused=device.type == "cuda", capturable=graphed)

        def train_step():
            with deferred_weight_grads(draft, calls_per_layer=args.ttt) if deferred else nullcontext():
                with autocast():
                    out = ttt_forward(draft, inputs, args.ttt, attention_factory=attention)
                out.loss.backward()
            torch.nn.utils.clip_grad_norm_(parameters, 0.5)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return out

        step, warmup = train_step, args.warmup
        if graphed:  # the capture's warm-up steps count as warm-up: every variant runs as many steps
            step, warmup = captured(train_step), max(0, args.warmup - CAPTURE_WARMUP)
        median, out = time_steps(step, warmup)
        syncs = None
        if device.type == "cuda":  # one more step, counting the calls that make the host wait for the GPU
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    out = step()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            syncs = sum("synchroniz" in str(w.message) for w in caught)
        final_loss = round(float(out.loss.detach()), 4)  # before the profiled step (a graph's outputs are rewritten)
        if args.profile:
            profile_step(step, device)
        if args.find_syncs and device.type == "cuda" and syncs and not graphed:
            find_host_syncs(train_step)
            optimizer.zero_grad(set_to_none=True)
        peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        return {
            "step_ms_median": round(median * 1e3, 2),
            "step_ms_spread": spread[0],
            "tokens_per_s": round(args.tokens / median, 1),
            "mfu": round(flops / median / H200_BF16_DENSE_FLOPS, 4) if device.type == "cuda" else None,
            "peak_gib": round(peak, 2) if peak else None,
            "final_loss": final_loss,
            "host_syncs_per_step": syncs,
        }

    kernels = args.kernels.split(",") if device.type == "cuda" else ["per_step"]  # CPU: the dense path either way
    pointwise = args.pointwise.split(",") if device.type == "cuda" else ["eager"]
    if device.type == "cuda" and "compiled" in pointwise:  # compiled pointwise, and on top of it:
        pointwise += ["deferred"] if args.deferred else []  # one weight-gradient matmul per shared layer
        pointwise += ["graph"] if args.graph else []  # the whole step one CUDA graph
        pointwise += ["graph+deferred"] if args.graph and args.deferred else []
    layout_variants = [  # (name, attention layout, pointwise mode); the CPU runs one dense eager variant
        (({"compiled": layout, "eager": f"{layout}+eager_pointwise"}.get(mode, f"{layout}+{mode}")), layout, mode)
        if device.type == "cuda"
        else (layout, layout, mode)
        for layout in kernels
        for mode in pointwise
    ]
    step_variants = [("train_step", True, True)] + (  # (name, CUDA graphs, batch staged by the prefetch thread)
        [("train_step+copied_in", True, False), ("train_step+no_cuda_graphs", False, False)]
        if device.type == "cuda"
        else []
    )
    wanted = set(args.only.split(",")) if args.only else None
    known = {name for name, _, _ in layout_variants + step_variants}
    if wanted is not None and wanted - known:
        parser.error(f"--only {','.join(sorted(wanted - known))}: not a variant here ({', '.join(sorted(known))})")
    timed = {}
    for name, layout, mode in layout_variants:  # each printed as soon as it is timed (a cut-off run keeps them)
        if wanted is not None and name not in wanted:
            continue
        try:
            timed[name] = measure(
                attention_for(device, config.head_dim, layout),
                compile_pointwise=mode != "eager",
                graphed="graph" in mode,
                deferred="deferred" in mode,
            )
        except RuntimeError as exc:  # a variant that cannot run here is reported, the others still timed
            timed[name] = failed(exc)
        print(json.dumps({name: timed[name]}), flush=True)
    for name, graphs, staged in step_variants:  # as train runs it on this device; on a GPU also copied in, eager
        if (name not in wanted) if wanted is not None else not args.train_step:
            continue
        try:
            timed[name] = measure_train_step(graphs, staged)
        except RuntimeError as exc:  # the H200 once refused the second recording in a process: keep the rest
            timed[name] = failed(exc)
        print(json.dumps({name: timed[name]}), flush=True)
    ours, one_kernel = timed.get(kernels[0]), timed.get("one")  # the first layout named: train's default
    naive = None if args.skip_naive else measure(ReferenceAttention)
    record = {
        "benchmark": f"train_step_{args.shape}",
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "tokens": args.tokens,
        "documents": len(lengths),
        "ttt_steps": args.ttt,
        "draft_vocab": vocab,
        "lm_head_frozen": args.freeze_lm_head,
        "teacher_argmax": "computed" if args.computed_teacher_argmax else "stored",
        "flops_per_step": flops,
        "eaglet": ours,
        "eaglet_one_kernel": one_kernel,
        "naive_per_step": naive,
        "variants": timed,
        "speedup_vs_naive": round(naive["step_ms_median"] / ours["step_ms_median"], 3) if naive and ours else None,
        "one_kernel_speedup_vs_naive": (
            round(naive["step_ms_median"] / one_kernel["step_ms_median"], 3) if naive and one_kernel else None
        ),
    }
    print(json.dumps(record, indent=2))
    if args.out:
        args.out.write_text(json.dumps(record, indent=2) + "\n")


PROFILE_ROWS = 15
ERROR_CHARS = 300  # a failed variant's entry: the first line of its error


def failed(exc: BaseException) -> dict:
    """A variant that could not run, as its entry in the results (the other variants are still timed)."""
    text = str(exc).strip()
    return {"error": text.splitlines()[0][:ERROR_CHARS] if text else repr(exc)}


CAPTURE_WARMUP = 3  # eager steps on a side stream before capture (compiles, AdamW's state, the allocator settle)


def captured(train_step):
    """``train_step`` recorded once as a CUDA graph and replayed: one launch per step instead of one per kernel.
    Every shape is fixed (the token budget), the inputs are the same tensors every step, the optimizer is
    capturable; the gradients live in the graph's pool (set to None before capture, so each replay writes them
    afresh rather than accumulating)."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(CAPTURE_WARMUP):
            train_step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = train_step()

    def replay():
        graph.replay()
        return out

    return replay


def profile_step(train_step, device) -> None:
    """One step under torch.profiler: the operations that take most of the device's time and, apart, of the
    host's (a step whose host time exceeds its device time is launch-bound: the GPU waits for Python)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as profiler:
        train_step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    table = profiler.key_averages()
    if device.type == "cuda":
        print(table.table(sort_by="self_cuda_time_total", row_limit=PROFILE_ROWS, max_name_column_width=60))
    print(table.table(sort_by="self_cpu_time_total", row_limit=PROFILE_ROWS, max_name_column_width=60))


def find_host_syncs(train_step) -> None:
    """Where a step makes the host wait for the GPU: the first synchronising call raises under the CUDA sync
    debug mode, and its stack (eaglet's and torch's frames) is printed. Run after timing: the step is abandoned."""
    import traceback

    import torch

    torch.cuda.set_sync_debug_mode("error")
    try:
        train_step()
        print("host syncs: none in a step")
    except RuntimeError as exc:
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if "eaglet" in f.filename or "torch" in f.filename]
        print(f"host sync: {exc}".splitlines()[0])
        print("".join(traceback.format_list(frames[-12:])))
    finally:
        torch.cuda.set_sync_debug_mode("default")


if __name__ == "__main__":
    main()
