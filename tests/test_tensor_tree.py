"""An optimizer's state written as safetensors + JSON (no pickle) and read back exactly."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from eaglet.train.tensor_tree import join_tensors, split_tensors


def trained(fused: bool = False, state: dict | None = None, steps: int = 2, start: int = 0):
    """A model and its AdamW after ``steps`` steps (from ``state`` when given): integer parameter ids as the state's
    keys, 0-dim step tensors, tuple betas."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2, bias=False))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), fused=fused)
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    for step in range(start, start + steps):
        model(torch.arange(20.0).reshape(5, 4) / (step + 1)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def assert_same(a, b) -> None:
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


@pytest.mark.parametrize("fused", [False, True])
def test_an_adamw_state_round_trips_through_safetensors_and_json(tmp_path, fused):
    """Written as the checkpoint writes it and read back: the same state, and a run resumed from it takes the same
    next step as the run that never stopped."""
    model, optimizer = trained(fused)
    state = optimizer.state_dict()
    document, tensors = split_tensors(state)
    save_file(tensors, tmp_path / "optimizer.safetensors")
    (tmp_path / "optimizer.json").write_text(json.dumps(document))
    loaded = join_tensors(
        json.loads((tmp_path / "optimizer.json").read_text()), load_file(tmp_path / "optimizer.safetensors")
    )
    assert_same(loaded, state)
    assert isinstance(loaded["param_groups"][0]["betas"], tuple) and 0 in loaded["state"]
    snapshot = {"model": {k: v.clone() for k, v in model.state_dict().items()}, "optimizer": loaded}
    continued, _ = trained(fused, steps=3)
    resumed, _ = trained(fused, state=snapshot, steps=1, start=2)
    for name, value in continued.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], value), name


def test_what_is_neither_a_tensor_nor_json_is_refused_when_written():
    with pytest.raises(TypeError, match="/state/0/f: a builtin_function_or_method, neither a tensor nor a JSON value"):
        split_tensors({"state": {0: {"f": len}}})


@pytest.mark.parametrize(
    "document,message",
    [
        ({"state": {"__tensor__": "missing"}}, "/state: refers to tensor 'missing', which is not stored"),
        ({"state": {"__items__": [[0]]}}, "/state: __items__ is not a list of [key, value] pairs"),
        ({"betas": {"__tuple__": 3}}, "/betas: __tuple__ is not a list"),
    ],
)
def test_a_damaged_document_names_where(document, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        join_tensors(document, {})
