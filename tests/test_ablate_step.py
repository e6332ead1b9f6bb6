"""CPU tests of bench/ablate_step.py: its groups name real launchers, leaving a group out really stops the
model from launching it, and the launchers come back afterwards."""
import importlib
import math

import pytest
import torch

from bench import ablate_step as ab
from cli_helpers import config_error
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


class _FakeModel:
    """GPT2Model's surface that ablate_step.main uses, without a GPU: steps counted, nothing computed."""
    steps: list[int] = []

    def __init__(self, config, params, B, T, **kw):
        self.B, self.T, _FakeModel.steps = B, T, []

    def describe(self):
        return f"fake B={self.B} T={self.T}"

    def release_graphs(self):
        pass

    def train_step(self, batches, lr, step, weight_decay, grad_clip):
        _FakeModel.steps.append(step)
        return 10.0, 1.0


@pytest.fixture
def no_gpu(monkeypatch):
    import llmpy.model
    monkeypatch.setattr(llmpy.model, "GPT2Model", _FakeModel)
    monkeypatch.setattr(ab, "make_batches", lambda *a, **k: [None] * 8)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "fake")


def test_main_on_a_stand_in_model_writes_its_json_where_asked(no_gpu, tmp_path):
    import json
    out = tmp_path / "new" / "ablate.json"
    assert ab.main(["--model", "layers=1,channels=32,heads=2,seq=16,vocab=100", "--B", "2", "--T", "16", "--steps",
                    "6", "--warmup", "2", "--rounds", "2", "--variants", "full,-bias", "--json", str(out)]) == 0
    assert _FakeModel.steps == list(range(1, 2 + 2 * 2 * (1 + 6) + 1))  # warm-up, then each capture and 6 steps
    report = json.loads(out.read_text())
    assert [len(r) for r in report["times_ms"]["-bias"]] == [6, 6]
    assert set(report["summary"]) == {"full", "-bias"} and len(report["summary"]["full"]["medians"]) == 2


@pytest.mark.parametrize("argv,message", [
    (["--steps", "0"], "--steps must be at least 1"),  # the median of no steps: StatisticsError after the warm-up
    (["--rounds", "0"], "--rounds must be at least 1"),  # no round: ZeroDivisionError in summarize
    (["--warmup", "-1"], "--warmup must be at least 0"),
    (["--B", "0"], "--B must be at least 1"),
    (["--model", "d13"], f"--model d13: {config_error('d13')}"),
    (["--T", "2048"], "--T 2048 is longer than the model's context 1024"),
])
def test_bad_arguments_are_one_usage_line(no_gpu, capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        ab.main(["--variants", "full,-bias", "--warmup", "1", *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1].endswith(message)
