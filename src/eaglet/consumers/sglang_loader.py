"""SGLang as a consumer of eaglet's exports, read from its released source (``fixtures``).

- the draft model: ``LlamaForCausalLMEagle3`` built on the exported config (``modules``);
- its loader: ``LlamaForCausalLMEagle3.load_weights`` run on the exported names. It loads a name only when it
  matches a parameter and drops any other name without a word, so every exported tensor must land;
- aux layers: the ids the model runner reads from the draft config (the ``is_eagle3()`` block of
  ``_resolve_eagle_aux_hidden_state``), the layers ``set_eagle3_layers_to_capture`` turns them into, and where
  ``LlamaModel.forward`` hands a capture to a layer and ``LlamaDecoderLayer.forward`` takes it.
"""

from __future__ import annotations

import ast
from typing import Any

from .findings import LoadReport, Weight, feeds_back_normed, skip_tracer
from .fixtures import Fixture, VerifierFacts
from .modules import Instance, ModelBuilder, named_parameters
from .pysubset import ConfigObject, Interpreter, Namespace, NotCovered, Unknown

EAGLE3_MODULE = "sglang.srt.models.llama_eagle3"
MODELS_MODULE = "sglang.srt.models.llama"
RUNNER_MODULE = "sglang.srt.model_executor.model_runner_components.spec_aux_hidden_state"


class SglangReader:
    engine = "sglang"

    def __init__(self, fixture: Fixture):
        self.fixture = fixture
        parallel = Namespace(
            "parallel",
            {
                "pp_group": Namespace("pp_group", {"is_last_rank": True, "is_first_rank": True, "world_size": 1}),
                "tp_size": 1,
                "tp_rank": 0,
                "attn_tp_size": 1,
                "attn_tp_rank": 0,
            },
        )
        spec = Namespace("spec", {"speculative_draft_window_size": None})
        self.builder = ModelBuilder(
            fixture.sources,
            {
                "get_parallel": lambda: parallel,
                "get_spec": lambda: spec,
                "get_tensor_model_parallel_world_size": lambda: 1,
                "get_tensor_model_parallel_rank": lambda: 0,
            },
        )

    def hf_config(self, config: dict[str, Any]) -> dict[str, Any]:
        return dict(config)

    def draft_class(self, hf_config: dict[str, Any]) -> str:
        entry = next(
            (
                n
                for n in self.builder.modules[EAGLE3_MODULE].tree.body
                if isinstance(n, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "EntryClass" for t in n.targets)
            ),
            None,
        )
        classes = (
            [ast.unparse(e) for e in entry.value.elts]
            if entry is not None and isinstance(entry.value, ast.List)
            else []
        )
        architecture = (hf_config.get("architectures") or ["?"])[0]
        if architecture not in classes:
            raise NotCovered(
                f"architecture {architecture!r} is not served by {EAGLE3_MODULE} in {self.fixture.label} "
                f"(it serves {classes})"
            )
        return f"{EAGLE3_MODULE}.{architecture}"

    def build(self, hf_config: dict[str, Any], verifier: VerifierFacts) -> Instance:
        dotted = self.draft_class(hf_config)
        module, _, cls = dotted.rpartition(".")
        return self.builder.build(module, cls, config=ConfigObject(hf_config), quant_config=None, prefix="")

    def load(self, model: Instance, names: list[str]) -> LoadReport:
        report = LoadReport(self.fixture.label)
        params = named_parameters(model)
        tokens = {name: Namespace("param", {"name": name}) for name in params}

        def weight_loader(param: Namespace, weight: Weight, *shard: Any) -> None:
            report.loaded[weight.source] = param.name

        calls = {
            "self.named_parameters": lambda: list(tokens.items()),
            "default_weight_loader": weight_loader,
            "torch.arange": lambda *a, **k: Unknown("torch.arange"),
        }
        weights = [(name, Weight(name)) for name in names]
        self.builder.call_method(model, "load_weights", calls=calls, trace=skip_tracer(report), weights=weights)
        for name in names:
            if name not in report.loaded and name not in report.skipped and name not in report.consumed:
                report.errors.append(f"{name}: SGLang's load_weights drops it silently (no parameter takes it)")
        for name in report.consumed:
            report.skipped.pop(name, None)  # taken by the loader (d2t -> hot_token_id), then `continue`
        filled = set(report.loaded.values())
        report.unfilled = [
            p for p, certain in params.items() if certain and p not in filled and p != "model.embed_tokens.weight"
        ]  # SGLang's EAGLE worker shares the target's
        return report

    def aux_layer_ids(self, hf_config: dict[str, Any], verifier: VerifierFacts) -> tuple[int, ...] | None:
        """The aux layers SGLang captures, in eaglet's convention (input of decoder layer i)."""
        resolve = next(
            (
                n
                for n in self.builder.modules[RUNNER_MODULE].tree.body
                if isinstance(n, ast.FunctionDef) and n.name == "_resolve_eagle_aux_hidden_state"
            ),
            None,
        )
        block = (
            next(
                (
                    n
                    for n in ast.walk(resolve)
                    if isinstance(n, ast.If) and ast.unparse(n.test) == "spec_algorithm.is_eagle3()"
                ),
                None,
            )
            if resolve is not None
            else None
        )
        if block is None:
            raise NotCovered(f"where {self.fixture.label} reads the draft's aux layer ids")
        runner_config = Namespace("SpecAuxHiddenStateConfig", {"eagle_aux_hidden_state_layer_ids": None})
        Interpreter().run_block(
            block.body,
            {
                "config": runner_config,
                "draft_model_config": Namespace("draft_model_config", {"hf_config": ConfigObject(hf_config)}),
            },
        )
        ids = runner_config.eagle_aux_hidden_state_layer_ids
        target = Namespace(
            "LlamaForCausalLM",
            {
                "pp_group": Namespace("pp_group", {"is_last_rank": True}),
                "model": Namespace("LlamaModel"),
                "config": ConfigObject(
                    {
                        "num_hidden_layers": verifier.num_layers
                        if verifier.num_layers is not None
                        else Unknown("the verifier's layer count")
                    }
                ),
            },
        )
        capture = self._method(MODELS_MODULE, "LlamaForCausalLM", "set_eagle3_layers_to_capture")
        Interpreter().call_function(capture, {"self": target, "layer_ids": None if ids is None else list(ids)})
        captured = target.model.layers_to_capture
        if isinstance(captured, Unknown):
            return None
        offset = self.capture_offset()
        return tuple(layer + offset for layer in captured)

    def _method(self, module: str, cls: str, name: str) -> ast.FunctionDef:
        scope = self.builder.modules[module]
        found = self.builder.resolve(scope, cls)
        if isinstance(found, str):
            raise NotCovered(f"{cls} not in the excerpts of {self.fixture.label}")
        function = next((n for n in found[1].body if isinstance(n, ast.FunctionDef) and n.name == name), None)  # type: ignore[union-attr]
        if function is None:
            raise NotCovered(f"{cls}.{name} not in the excerpts of {self.fixture.label}")
        return function

    def capture_offset(self) -> int:
        """0 when a layer given a capture records its input (eaglet's convention), 1 when it records its output.
        Read from ``LlamaModel.forward`` (which layer call gets ``capture_output``) and ``LlamaDecoderLayer.forward``
        (whether the capture is taken before or after the attention)."""
        model_forward = self._method(MODELS_MODULE, "LlamaModel", "forward")
        handed = [
            k
            for call in ast.walk(model_forward)
            if isinstance(call, ast.Call)
            for k in call.keywords
            if k.arg == "capture_output"
            and isinstance(k.value, ast.IfExp)
            and "layers_to_capture" in ast.unparse(k.value.test)
        ]
        if not handed:
            raise NotCovered(f"how {self.fixture.label}'s LlamaModel hands captures to its layers")
        layer_forward = self._method(MODELS_MODULE, "LlamaDecoderLayer", "forward")
        attention_at = capture_at = None
        for position, statement in enumerate(layer_forward.body):
            text = ast.unparse(statement)
            if capture_at is None and "capture=capture_output" in text:
                capture_at = position
            if attention_at is None and "self.self_attn(" in text:
                attention_at = position
        if capture_at is None or attention_at is None:
            raise NotCovered(f"where {self.fixture.label}'s decoder layer takes its capture")
        return 0 if capture_at < attention_at else 1

    def norm_before_residual(self, hf_config: dict[str, Any]) -> bool:
        """Whether SGLang's first draft layer takes its residual after ``hidden_norm``: the order of the two
        statements in its input-layer branch (it reads no config field for it)."""
        forward = self._method(EAGLE3_MODULE, "LlamaDecoderLayer", "forward")
        branch = next(
            (n for n in forward.body if isinstance(n, ast.If) and "is_input_layer" in ast.unparse(n.test)), None
        )
        order = [ast.unparse(s) for s in (branch.body if branch is not None else [])]
        residual = next((i for i, text in enumerate(order) if text.startswith("residual = ")), None)
        normed = next((i for i, text in enumerate(order) if "self.hidden_norm(" in text), None)
        if residual is None or normed is None:
            raise NotCovered(f"how {self.fixture.label}'s input layer takes its residual")
        return residual > normed and order[residual] == "residual = hidden_states"

    def norm_output(self, model: Instance) -> bool:
        """Whether SGLang feeds the next draft step the normed hidden state (its LlamaModel.forward's choice)."""
        return feeds_back_normed(model, self._method(EAGLE3_MODULE, "LlamaModel", "forward"))
