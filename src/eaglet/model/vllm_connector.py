"""eaglet's KV connector for vLLM's ``extract_hidden_states`` route: each shard's hidden states into one spool file.

vLLM loads this module inside its own processes (``KVTransferConfig(kv_connector="EagletRowsConnector",
kv_connector_module_path="eaglet.model.vllm_connector")``), through its public ``KVConnectorBase_V1``:

- scheduler side: when an eaglet request finishes (its prompt's prefill ran, its one token sampled), keep its blocks
  and pass its slots' blocks, token ids and ``RowsTarget`` to the workers in the next step's metadata;
- worker side (TP rank 0): in that step, gather every finished request's rows from the cache-only layer in one
  indexing per chunk (requests in file and row order) and form the stored tensors on the GPU, on a side stream
  (``vllm_rows.form_rows``: the aux columns, the target's final norm over the last layer's output, the store's
  encoding, finite flags), copy them to pinned host memory — all queued, the step thread never waits for the GPU —
  and let writer threads put each run of rows at its place in its shard's file (the shard's own safetensors file);
  the blocks are released once the copy is done. eaglet checks the file and moves it into the store as it is.

vLLM's own ``ExampleHiddenStatesConnector`` writes a safetensors file and a lock file per request, which eaglet then
read back one by one: 0.13x vLLM's prefill on the embedded target (benchmarks/RESULTS.md). The cache layout of the
hidden-state layer is vLLM's business and changes between releases (0.24: blocks x slots x layers x H, 0.33: blocks x
layers x slots x H), so the rows are read with vLLM's own ``extract_from_kv_cache`` and the layout it asks for.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.config import get_layers_from_vllm_config
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    extract_from_kv_cache,
)
from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionLayer

from .final_norm import load_final_norm
from .transfer import to_device
from .vllm_rows import (
    SAVED_KEY,
    RowsTarget,
    RowsWriter,
    column_index,
    file_groups,
    row_order,
    rows_to_host,
    slot_indices,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

CACHE_LAYER_MARK = "cache_only_layers"  # the hidden-state layer's name in vLLM's ExtractHiddenStatesModel
COPY_CHUNK_BYTES = 256 * 2**20  # rows gathered and copied at once: bounds the transient GPU and pinned memory
WRITER_THREADS = 4
SAVE_RANGE = "eaglet.save_rows"  # the step thread gathering, forming and copying finished requests' rows
WRITE_RANGE = "eaglet.write_rows"  # a writer thread waiting for a chunk's copy and writing it into its files


@dataclass
class FinishedRequest:
    """A finished request's rows to save (scheduler -> worker)."""

    req_id: str
    target: RowsTarget
    token_ids: list[int]
    block_ids: list[int]


@dataclass
class RowsMetadata(KVConnectorMetadata):
    finished: list[FinishedRequest] = field(default_factory=list)


def hidden_state_group(kv_cache_config: KVCacheConfig | None) -> int:
    """The KV-cache group that holds the cache-only layer (its blocks are the ones with the hidden states)."""
    if kv_cache_config is None:
        return 0
    for index, group in enumerate(kv_cache_config.kv_cache_groups):
        if any(CACHE_LAYER_MARK in name for name in group.layer_names):
            return index
    return 0


class EagletRowsConnector(KVConnectorBase_V1, SupportsHMA):
    """Saves each eaglet request's prompt hidden states to its shard's spool file (store-only: loads nothing)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.group = hidden_state_group(kv_cache_config)
        self.block_size = (
            kv_cache_config.kv_cache_groups[self.group].kv_cache_spec.block_size
            if kv_cache_config is not None
            else vllm_config.cache_config.block_size
        )
        # scheduler side
        self.to_save: list[FinishedRequest] = []
        # worker side
        self.kv_cache: torch.Tensor | None = None
        self.writes_rows = True  # TP rank 0 writes; the other ranks hold the same rows and only report them done
        self.copy_stream: torch.cuda.Stream | None = None
        self.copies: dict[str, torch.cuda.Event] = {}  # request -> its chunk's device-to-host copy
        self.reported: set[str] = set()  # finished requests whose blocks the scheduler may free once copied
        self.writer = RowsWriter()
        self.pool = ThreadPoolExecutor(WRITER_THREADS, thread_name_prefix="eaglet-rows")
        self.norm: torch.nn.Module | None = None  # the target's final norm, loaded on the cache's device at first use
        self.column_indices: dict[tuple[int, ...], torch.Tensor] = {}  # a form's aux columns -> its index on the GPU

    @property
    def prefer_cross_layer_blocks(self) -> bool:
        return False  # the hidden-state cache must stay apart from the target's own KV cache

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        return ExampleHiddenStatesConnector.get_required_kvcache_layout(vllm_config)

    # ---- worker side ----

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.writes_rows = get_tensor_model_parallel_rank() == 0
        layers = get_layers_from_vllm_config(self._vllm_config, CacheOnlyAttentionLayer, list(kv_caches))
        if len(layers) != 1:
            raise ValueError(f"eaglet's connector needs the extract_hidden_states method (one cache-only layer, got "
                             f"{len(layers)})")  # fmt: skip
        self.kv_cache = kv_caches[next(iter(layers))]
        if self.block_size not in self.kv_cache.shape[1:3]:
            raise ValueError(f"hidden-state cache {tuple(self.kv_cache.shape)} has no block of {self.block_size}")

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        pass  # store-only

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass  # store-only

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        pass  # the cache-only layer has cached the rows during the forward; they are read once the request ends

    def wait_for_save(self) -> None:
        pass  # the copies are asynchronous; get_finished reports each once done

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        metadata = self._get_connector_metadata() if self.has_connector_metadata() else None
        if isinstance(metadata, RowsMetadata) and metadata.finished:
            if self.writes_rows:
                self._save(metadata.finished)
            else:
                self.reported.update(request.req_id for request in metadata.finished)
        done = {req for req in self.reported if req not in self.copies or self.copies[req].query()}
        for req in done:
            self.reported.discard(req)
            self.copies.pop(req, None)
        return done or None, None

    def _save(self, finished: list[FinishedRequest]) -> None:
        """Gather the finished requests' rows chunk by chunk, form their stored tensors and copy them to host on the
        side stream, then hand them to a writer thread. The default stream's forward wrote the rows: the side stream
        waits for it."""
        assert self.kv_cache is not None
        with torch.profiler.record_function(SAVE_RANGE):  # named in a profile of vLLM's worker; free otherwise
            self._save_chunks(finished)

    def _save_chunks(self, finished: list[FinishedRequest]) -> None:
        on_gpu = self.kv_cache.device.type == "cuda"  # else vLLM's CPU build: rows formed in host memory at once
        if on_gpu:
            if self.copy_stream is None:
                self.copy_stream = torch.cuda.Stream(self.kv_cache.device)
            ready = torch.cuda.Event()
            ready.record()
            self.copy_stream.wait_event(ready)
        row_bytes = self.kv_cache[0].numel() // self.block_size * self.kv_cache.element_size()
        for chunk in _chunks(finished, row_bytes):
            chunk.sort(key=lambda request: row_order(request.target))  # runs of rows written at once
            form = chunk[0].target  # the stored form of every request in the chunk
            slots = np.concatenate(
                [slot_indices(r.block_ids, self.block_size, len(r.token_ids)) for r in chunk]
            )  # [rows of the chunk]
            with torch.cuda.stream(self.copy_stream) if on_gpu else contextlib.nullcontext():
                on_device = to_device(torch.from_numpy(slots), self.kv_cache.device)
                rows = extract_from_kv_cache(self.kv_cache, on_device, len(slots))  # [rows, layers, H]
                if rows.shape[1] != form.captured_layers or rows.shape[2] != form.hidden_size:
                    for request in chunk:  # its file gets NAME.error; its blocks are released at once
                        self.writer.fail(request.target.path, f"vLLM captured {tuple(rows.shape[1:])} per token, "
                                         f"eaglet asked for {(form.captured_layers, form.hidden_size)}")  # fmt: skip
                        self.reported.add(request.req_id)
                    continue
                host_finite, host = rows_to_host(
                    rows, self._columns(form.columns), self._final_norm(rows), form.storage
                )
                copied = _recorded_event() if on_gpu else None
            for request in chunk:
                if copied is not None:
                    self.copies[request.req_id] = copied
                self.reported.add(request.req_id)
            # each file's rows by a writer thread of its own: the last steps finish several small shards at once
            # (the store's tail pieces), and one thread's writes would be the run's last wait
            starts = np.cumsum([0, *(len(request.token_ids) for request in chunk)])
            for first, last in file_groups([request.target for request in chunk]):
                rows = slice(int(starts[first]), int(starts[last]))
                part = {name: tensor[rows] for name, tensor in host.items()}
                future = self.pool.submit(self._write, chunk[first:last], part, host_finite[rows], copied)
                future.add_done_callback(_surface)

    def _columns(self, columns: tuple[int, ...]) -> torch.Tensor:
        """The aux columns' index on the cache's device, made at a form's first chunk."""
        if columns not in self.column_indices:
            self.column_indices[columns] = column_index(columns, self.kv_cache.device)
        return self.column_indices[columns]

    def _final_norm(self, rows: torch.Tensor) -> torch.nn.Module:
        """The target's own final norm (vLLM loaded the target from this path), in the rows' device and dtype."""
        if self.norm is None:
            self.norm = load_final_norm(Path(self._vllm_config.model_config.model), rows.device, rows.dtype)
        return self.norm

    def _write(
        self,
        chunk: list[FinishedRequest],
        host: dict[str, torch.Tensor],
        finite: torch.Tensor,
        copied: torch.cuda.Event | None,
    ) -> None:
        with torch.profiler.record_function(WRITE_RANGE):
            if copied is not None:
                copied.synchronize()
            self._write_requests(chunk, host, finite)

    def _write_requests(
        self, chunk: list[FinishedRequest], host: dict[str, torch.Tensor], finite: torch.Tensor
    ) -> None:
        self.writer.write_chunk(
            [request.target for request in chunk], [request.token_ids for request in chunk], finite.numpy(), host
        )

    def shutdown(self) -> None:
        self.pool.shutdown(wait=True)
        self.writer.close()

    # ---- scheduler side ----

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False  # nothing is ever loaded from outside

    def update_state_after_alloc(self, request: Request, blocks: Any, num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        metadata = RowsMetadata(finished=self.to_save)
        self.to_save = []
        return metadata

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Keep an eaglet request's blocks until its rows are copied out; other requests go as usual."""
        target = RowsTarget.from_params(request.kv_transfer_params)
        if target is None or request.prompt_token_ids is None:
            return False, None
        self.to_save.append(
            FinishedRequest(request.request_id, target, list(request.prompt_token_ids), list(block_ids))
        )
        return True, {SAVED_KEY: target.path}

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        if self.group >= len(block_ids):
            return False, None
        return self.request_finished(request, block_ids[self.group])


def _chunks(finished: list[FinishedRequest], row_bytes: int) -> list[list[FinishedRequest]]:
    """Consecutive groups of requests of one stored form and at most ``COPY_CHUNK_BYTES`` of rows (a longer request
    alone)."""
    chunks: list[list[FinishedRequest]] = [[]]
    size = 0
    for request in finished:
        rows = len(request.token_ids) * row_bytes
        form = (request.target.columns, request.target.storage)
        other_form = bool(chunks[-1]) and (chunks[-1][0].target.columns, chunks[-1][0].target.storage) != form
        if chunks[-1] and (size + rows > COPY_CHUNK_BYTES or other_form):
            chunks.append([])
            size = 0
        chunks[-1].append(request)
        size += rows
    return chunks


def _recorded_event() -> torch.cuda.Event:
    """An event recorded on the current stream: passed once the work queued before it is done."""
    event = torch.cuda.Event()
    event.record()
    return event


def _surface(future: Future) -> None:
    """A writer thread's unexpected failure is logged by vLLM's worker, never silently lost (the reader also times
    out on the file that never completes)."""
    if future.exception() is not None:
        import logging

        logging.getLogger("eaglet.vllm_connector").error("eaglet rows write failed: %r", future.exception())
