"""CPU tests of bench/ablate_step.py: its groups name real launchers, leaving a group out really stops the
model from launching it, and the launchers come back afterwards."""
import importlib
import math

import pytest
import torch

from bench import ablate_step as ab
from llmpy.config import GPT2Config
from llmpy.init import init_parameters
from llmpy.model import GPT2Model

TINY = GPT2Config(max_seq_len=16, vocab_size=100, num_layers=1, num_heads=2, channels=32)


def test_every_group_names_a_launcher():
    for group, entries in ab.GROUPS.items():
        for module, path in entries:
            if module == ab.LANE:
                continue
            owner, attr = ab._owner(module, path)
            assert callable(owner.__dict__[attr]), f"{group}: {module}.{path} is not a launcher"


def test_lane_calls_are_the_backward_s():
    """The Lanes.run names the groups skip are names the backward really issues (a renamed call would
    silently stay in, and its group's figure would be wrong)."""
    import inspect
    from llmpy import model
    source = inspect.getsource(model.GPT2Model.backward)
    for entries in ab.GROUPS.values():
        for module, name in entries:
            if module == ab.LANE:
                assert f'"{name}")' in source, f"the backward issues no call named {name!r}"


@pytest.mark.parametrize("variant,groups", [
    ("full", []),
    ("-classifier", ["classifier"]),
    ("-ln-forward+ln-backward", ["ln-forward", "ln-backward"]),
    ("only-products", [g for g in ab.GROUPS if g != "products"]),
])
def test_groups_of(variant, groups):
    assert ab.groups_of(variant) == groups


@pytest.mark.parametrize("variant", ["classifier", "-nothing", "-", "-bias+", "everything"])
def test_groups_of_refuses(variant):
    with pytest.raises(ValueError):
        ab.groups_of(variant)


def test_default_variants_parse():
    for v in ab.DEFAULT_VARIANTS:
        ab.groups_of(v)


def test_left_out_restores_even_on_error():
    layernorm = importlib.import_module("llmpy.kernels.layernorm")
    before = layernorm.layernorm_backward, GPT2Model._adamw
    with pytest.raises(RuntimeError):
        with ab.left_out(["ln-backward", "optimizer"]):
            assert layernorm.layernorm_backward(1, 2, three=3) is None
            assert GPT2Model._adamw is not before[1]
            raise RuntimeError("inside")
    assert (layernorm.layernorm_backward, GPT2Model._adamw) == before


def _model(device):
    params = init_parameters(TINY, 7)
    model = GPT2Model(TINY, params, 2, 8, device=device, dtype=torch.float32, attention="flash", cuda_graph=False)
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, TINY.vocab_size, (2, 8), generator=g)
    y = torch.randint(0, TINY.vocab_size, (2, 8), generator=g)
    return model, x, y


def test_left_out_classifier_writes_no_losses(device):
    model, x, y = _model(device)
    model.acts["losses"].fill_(float("nan"))
    with ab.left_out(["classifier"]):
        model.forward(x, y)
    assert model.acts["losses"].isnan().all()
    model.forward(x, y)  # restored: the real classifier again
    assert math.isfinite(model.loss())


def test_left_out_optimizer_leaves_parameters(device):
    model, x, y = _model(device)
    before = model.params_memory.clone()
    with ab.left_out(["optimizer"]):
        model.train_step([(x, y)], 1e-2, 1, 0.0, 1.0)
    assert torch.equal(model.params_memory, before)
    model.train_step([(x, y)], 1e-2, 2, 0.0, 1.0)
    assert not torch.equal(model.params_memory, before)


def test_left_out_ln_backward_keeps_the_residual_gradient(device):
    """Without the LayerNorm backward the residual gradient must keep its last values, not be zeroed
    (products on zeros would be timed), and the real backward comes back afterwards."""
    model, x, y = _model(device)
    model.zero_grad()
    model.forward(x, y, dloss=1.0 / x.numel())
    model.backward()
    last = model.acts["dresidual"].clone()
    assert last.abs().sum() > 0
    model.zero_grad()
    model.forward(x, y, dloss=1.0 / x.numel())
    with ab.left_out(["ln-backward"]):
        model.backward()
    assert torch.equal(model.acts["dresidual"], last)
    model.forward(x, y, dloss=1.0 / x.numel())
    model.acts["dresidual"].fill_(float("nan"))
    model.backward()
    assert model.acts["dresidual"].isfinite().all()


def test_summarize_and_table():
    times = {"full": [[200.0] * 3 + [100.0] * 6, [102.0] * 9], "-bias": [[99.0] * 9, [99.0] * 9]}
    s = ab.summarize(times)
    assert s["full"]["medians"] == [100.0, 102.0] and s["full"]["mean"] == 101.0
    assert s["-bias"]["saves"] == pytest.approx(2.0)
    table = ab.format_table(s)
    assert "| -bias | 99.0, 99.0 | 99.0 | 2.0 |" in table
