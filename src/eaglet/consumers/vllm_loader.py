"""vLLM as a consumer of eaglet's exports, read from its released source (``fixtures``).

What it answers, each by running the engine's own code from the excerpts in ``pysubset``:
- which config class vLLM picks for a draft directory (``HFConfigParser.parse``) and, for speculators-format
  directories, the HF config it derives (``SpeculatorsConfig.extract_transformers_pre_trained_config`` with
  ``update_eagle3``);
- the draft model class its registry maps the architecture to, and that class's parameters (``modules``);
- where each exported tensor lands (``Eagle3LlamaForCausalLM.load_weights``, then ``WeightsMapper`` and the
  routing of vLLM's ``AutoWeightsLoader``: a child module with its own ``load_weights`` gets the names under
  its prefix, anything else must be a parameter, and an unknown name is an error);
- which aux layers it captures (``GPUModelRunner._get_eagle3_aux_layers_from_config`` for the ids, and where
  ``LlamaModel.forward`` records them, for what an id means).
"""

from __future__ import annotations

import ast
from typing import Any

from .findings import LoadReport, Weight, capture_offset, feeds_back_normed, skip_tracer
from .fixtures import Fixture, VerifierFacts
from .modules import Instance, ModelBuilder, named_parameters
from .pysubset import ConfigObject, Interpreter, Namespace, NotCovered, Unknown

EAGLE3_MODULE = "vllm.model_executor.models.llama_eagle3"
MODELS_MODULE = "vllm.model_executor.models.llama"
UTILS_MODULE = "vllm.model_executor.models.utils"
RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"
REGISTRY_MODULE = "vllm.model_executor.models.registry"
CONFIG_MODULE = "vllm.transformers_utils.config"
SPECULATORS_BASE_MODULE = "vllm.transformers_utils.configs.speculators.base"
SPECULATORS_ALGOS_MODULE = "vllm.transformers_utils.configs.speculators.algos"


class VllmReader:
    engine = "vllm"

    def __init__(self, fixture: Fixture):
        self.fixture = fixture
        self.builder = ModelBuilder(fixture.sources, {})

    # ------------------------------------------------------------------ config

    def _function(self, module: str, qualname: str) -> ast.FunctionDef:
        owner, _, name = qualname.rpartition(".")
        scope = self.builder.modules[module]
        if owner:
            found = self.builder.resolve(scope, owner)
            if isinstance(found, str):
                raise NotCovered(f"{owner} not in the excerpts of {self.fixture.label}")
            body = found[1].body  # type: ignore[union-attr]
        else:
            body = scope.tree.body
        for node in body:
            if isinstance(node, ast.FunctionDef) and node.name == name:
                return node
        raise NotCovered(f"{module}.{qualname} not in the excerpts of {self.fixture.label}")

    def model_type(self, config: dict[str, Any]) -> Any:
        """The model type vLLM's config parser settles on for this config.json (its statements that set it)."""
        parse = self._function(CONFIG_MODULE, "HFConfigParser.parse")
        env: dict[str, Any] = {"config_dict": dict(config), "model_type": None}
        interpreter = Interpreter()
        for statement in parse.body:
            assigned = {
                t.id
                for n in ast.walk(statement)
                if isinstance(n, ast.Assign)
                for t in n.targets
                if isinstance(t, ast.Name)
            }
            if "model_type" not in assigned:
                continue
            if "hf_overrides" in ast.unparse(statement):  # a user override: eaglet's commands pass none
                break
            interpreter.execute(statement, env)
        return env["model_type"]

    def hf_config(self, config: dict[str, Any]) -> dict[str, Any]:
        """The draft's config as vLLM builds it: speculators-format configs converted by vLLM's own code."""
        if self.model_type(config) != "speculators":
            return dict(config)
        algos = self.builder.modules[SPECULATORS_ALGOS_MODULE]
        update = next(n for n in algos.tree.body if isinstance(n, ast.FunctionDef) and n.name == "update_eagle3")
        interpreter = Interpreter()
        registry = {"eagle3": lambda **kw: interpreter.call_function(update, kw)}
        extract = self._function(SPECULATORS_BASE_MODULE, "SpeculatorsConfig.extract_transformers_pre_trained_config")
        runner = Interpreter(calls={"SUPPORTED_SPECULATORS_TYPES": registry})
        result = runner.call_function(
            extract,
            {
                "cls": Namespace("SpeculatorsConfig"),
                "config_dict": dict(config),
                "SUPPORTED_SPECULATORS_TYPES": registry,
            },
        )
        return dict(result)

    def draft_class(self, hf_config: dict[str, Any]) -> str:
        """The class vLLM's registry runs for the draft's architecture (``module.Class``)."""
        registry = self.builder.modules[REGISTRY_MODULE]
        node = next(
            n
            for n in registry.tree.body
            if isinstance(n, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "_SPECULATIVE_DECODING_MODELS" for t in n.targets)
        )
        table = Interpreter().evaluate(node.value, {})
        architecture = (hf_config.get("architectures") or ["?"])[0]
        if architecture not in table:
            raise NotCovered(f"architecture {architecture!r} is not a speculative model in {self.fixture.label}")
        module, cls = table[architecture]
        return f"vllm.model_executor.models.{module}.{cls}"

    # ------------------------------------------------------------------ model

    def _vllm_config(self, hf_config: dict[str, Any], verifier: VerifierFacts) -> Namespace:
        hf = ConfigObject(hf_config)
        known = lambda value, what: (lambda: value) if value is not None else (lambda: Unknown(what))  # noqa: E731
        model_config = Namespace(
            "model_config",
            {
                "get_vocab_size": known(verifier.vocab_size, "the verifier's vocabulary"),
                "get_total_num_hidden_layers": known(verifier.num_layers, "the verifier's layer count"),
                "hf_config": hf,
                "dtype": Unknown("dtype"),
            },
        )
        speculative = Namespace(
            "speculative_config",
            {
                "draft_model_config": Namespace("draft_model_config", {"hf_config": hf}),
                "parallel_drafting": False,
                "method": "eagle3",
            },
        )
        return Namespace(
            "vllm_config",
            {
                "speculative_config": speculative,
                "model_config": model_config,
                "cache_config": None,
                "quant_config": None,
            },
        )

    def build(self, hf_config: dict[str, Any], verifier: VerifierFacts) -> Instance:
        dotted = self.draft_class(hf_config)
        module, _, cls = dotted.rpartition(".")
        if module not in self.builder.modules:
            raise NotCovered(f"{dotted} is not in the excerpts of {self.fixture.label}")
        vllm_config = self._vllm_config(hf_config, verifier)
        self.builder.facts = {
            "get_current_vllm_config": lambda: vllm_config,
            "get_draft_quant_config": lambda *a, **k: None,
            "get_tensor_model_parallel_world_size": lambda: 1,
            "WeightsMapper": lambda **fields: self.mapper(fields),
        }
        return self.builder.build(module, cls, vllm_config=vllm_config, prefix="")

    # ------------------------------------------------------------------ loading

    def mapper(self, fields: dict[str, Any]) -> Namespace:
        """A WeightsMapper whose ``map`` runs vLLM's own ``_map_name_with_shard``."""
        function = self._function(UTILS_MODULE, "WeightsMapper._map_name_with_shard")
        defaults = {
            "orig_to_new_renaming": [],
            "orig_to_new_regex": {},
            "orig_to_new_substr": {},
            "orig_to_new_stacked": {},
            "orig_to_new_prefix": {},
            "orig_to_new_suffix": {},
        }
        state = Namespace("WeightsMapper", defaults | fields)
        interpreter = Interpreter(calls={"logger.warning_once": lambda *a, **k: None})
        state.map = lambda name: interpreter.call_function(function, {"self": state, "key": name})
        return state

    def load(self, model: Instance, names: list[str]) -> LoadReport:
        report = LoadReport(self.fixture.label)
        params = named_parameters(model)
        delivered: dict[str, str] = {}  # engine parameter -> exported tensor

        def auto_loader(module: Instance, prefix: str):
            """vLLM's AutoWeightsLoader over ``module`` (parameters named relative to it, under ``prefix``)."""

            def load_weights(weights, mapper=None):
                loaded = []
                for name, weight in weights:
                    mapped = mapper.map(name) if mapper is not None else (name, None)
                    if mapped is None:
                        report.skipped[weight.source] = f"dropped by the loader's mapping ({name})"
                        continue
                    loaded += route(module, prefix, mapped[0], weight)
                return set(loaded)

            return Namespace("AutoWeightsLoader", {"load_weights": load_weights})

        def route(module: Instance, prefix: str, name: str, weight: Weight) -> list[str]:
            head, _, rest = name.partition(".")
            child = getattr(module, head, None) if head and not head.startswith("_") else None
            if isinstance(child, Instance) and rest and self.builder.method(child, "load_weights") is not None:
                return call_load(child, f"{prefix}{head}.", [(rest, weight)])
            qualified = f"{prefix}{name}"
            if qualified in params:
                delivered[qualified] = weight.source
                report.loaded[weight.source] = qualified
                return [qualified]
            if name.endswith(".bias"):  # AutoWeightsLoader ignores unexpected biases
                report.skipped[weight.source] = "unexpected bias, ignored by AutoWeightsLoader"
                return []
            report.errors.append(
                f"{weight.source}: vLLM raises 'There is no module or parameter named "
                f"{qualified!r}' (loaded as {qualified})"
            )
            return []

        def call_load(module: Instance, prefix: str, weights: list[tuple[str, Weight]]) -> list[str]:
            calls = {
                "AutoWeightsLoader": lambda target, **k: auto_loader(target, prefix),
                "process_eagle_weight": lambda *a: None,
                "logger.warning": lambda *a, **k: None,
            }
            self.builder.call_method(module, "load_weights", calls=calls, weights=weights)
            return []

        items = [(name, Weight(name)) for name in names]
        self.builder.call_method(
            model,
            "load_weights",
            calls={
                "AutoWeightsLoader": lambda target, **k: auto_loader(target, ""),
                "process_eagle_weight": lambda *a: None,
                "logger.warning": lambda *a, **k: None,
            },
            weights=items,
            trace=skip_tracer(report),
        )
        for name in names:
            if name not in report.loaded and name not in report.skipped and not any(name in e for e in report.errors):
                report.skipped[name] = "skipped by load_weights"
        shared = {"model.embed_tokens.weight"}  # vLLM shares the target's when the draft has none (load_weights)
        report.unfilled = [p for p, certain in params.items() if certain and p not in delivered and p not in shared]
        return report

    # ------------------------------------------------------------------ aux layers

    def aux_layer_ids(self, hf_config: dict[str, Any], verifier: VerifierFacts) -> tuple[int, ...] | None:
        """The aux layers vLLM captures, in eaglet's convention (input of decoder layer i); None: the config
        names none (vLLM would ask the target model for its defaults)."""
        function = self._function(RUNNER_MODULE, "GPUModelRunner._get_eagle3_aux_layers_from_config")
        runner = Namespace(
            "GPUModelRunner",
            {
                "speculative_config": Namespace(
                    "speculative_config",
                    {"draft_model_config": Namespace("draft_model_config", {"hf_config": ConfigObject(hf_config)})},
                )
            },
        )
        ids = Interpreter().call_function(function, {"self": runner})
        if ids is None:
            return None
        forward = self._function(MODELS_MODULE, "LlamaModel.forward")
        return tuple(i + capture_offset(forward, "_maybe_add_hidden_state") for i in ids)

    def norm_before_residual(self, hf_config: dict[str, Any]) -> bool:
        """Whether vLLM's first draft layer takes its residual after ``hidden_norm`` (the test its decoder layer
        chooses the residual path by, evaluated on the config)."""
        init = self._function(EAGLE3_MODULE, "LlamaDecoderLayer.__init__")
        test = next(
            (n.test for n in ast.walk(init) if isinstance(n, ast.If) and "norm_before_residual" in ast.unparse(n.test)),
            None,
        )
        if test is None:
            raise NotCovered(f"how {self.fixture.label} reads norm_before_residual")
        return bool(Interpreter().evaluate(test, {"config": ConfigObject(hf_config)}))

    def norm_output(self, model: Instance) -> bool:
        """Whether vLLM feeds the next draft step the normed hidden state (its LlamaModel.forward's choice)."""
        return feeds_back_normed(model, self._function(EAGLE3_MODULE, "LlamaModel.forward"))
