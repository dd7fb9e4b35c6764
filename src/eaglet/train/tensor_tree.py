"""A nested state (dicts, lists, tuples of tensors and JSON values: an optimizer's ``state_dict``) as a safetensors
file of its tensors and a JSON document of the rest, each tensor replaced by a reference to its name. Nothing is
pickled, so reading a checkpoint never runs code from it."""

from __future__ import annotations

from typing import Any

import torch

TENSOR = "__tensor__"  # {"__tensor__": name}: the tensor stored under ``name``
ITEMS = "__items__"  # {"__items__": [[key, value], ...]}: a dict whose keys are not all strings (parameter ids)
TUPLE = "__tuple__"  # {"__tuple__": [...]}: a tuple (AdamW's betas), kept a tuple
MARKERS = (TENSOR, ITEMS, TUPLE)
JSON_SCALARS = (str, int, float, bool, type(None))


def split_tensors(tree: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """``tree`` -> (its JSON document, {name: tensor}); names are the tensors' paths in the tree."""
    tensors: dict[str, torch.Tensor] = {}

    def encode(node: Any, path: str) -> Any:
        if isinstance(node, torch.Tensor):
            tensors[path] = node.detach().cpu().contiguous()
            return {TENSOR: path}
        if isinstance(node, dict):
            if all(isinstance(key, str) for key in node) and not any(marker in node for marker in MARKERS):
                return {key: encode(value, f"{path}/{key}") for key, value in node.items()}
            if not all(isinstance(key, JSON_SCALARS) for key in node):
                raise TypeError(f"{path or '(top level)'}: a dict key of type {type(next(iter(node))).__name__}")
            return {ITEMS: [[key, encode(value, f"{path}/{key}")] for key, value in node.items()]}
        if isinstance(node, tuple):
            return {TUPLE: [encode(value, f"{path}/{index}") for index, value in enumerate(node)]}
        if isinstance(node, list):
            return [encode(value, f"{path}/{index}") for index, value in enumerate(node)]
        if isinstance(node, JSON_SCALARS):
            return node
        raise TypeError(f"{path or '(top level)'}: a {type(node).__name__}, neither a tensor nor a JSON value")

    return encode(tree, ""), tensors


def join_tensors(document: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """``split_tensors``' inverse; a reference to a tensor not stored, or a marker of the wrong shape, raises
    ValueError naming where in the document."""

    def decode(node: Any, path: str) -> Any:
        if isinstance(node, dict):
            if TENSOR in node:
                name = node[TENSOR]
                if len(node) != 1 or not isinstance(name, str) or name not in tensors:
                    raise ValueError(f"{path or '(top level)'}: refers to tensor {name!r}, which is not stored")
                return tensors[name]
            if ITEMS in node:
                items = node[ITEMS]
                if len(node) != 1 or not isinstance(items, list) or not all(_pair(item) for item in items):
                    raise ValueError(f"{path or '(top level)'}: {ITEMS} is not a list of [key, value] pairs")
                return {key: decode(value, f"{path}/{key}") for key, value in items}
            if TUPLE in node:
                if len(node) != 1 or not isinstance(node[TUPLE], list):
                    raise ValueError(f"{path or '(top level)'}: {TUPLE} is not a list")
                return tuple(decode(value, f"{path}/{index}") for index, value in enumerate(node[TUPLE]))
            return {key: decode(value, f"{path}/{key}") for key, value in node.items()}
        if isinstance(node, list):
            return [decode(value, f"{path}/{index}") for index, value in enumerate(node)]
        return node

    return decode(document, "")


def _pair(item: Any) -> bool:
    return isinstance(item, list) and len(item) == 2 and isinstance(item[0], JSON_SCALARS)
