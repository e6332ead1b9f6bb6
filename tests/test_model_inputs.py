"""Wrong model inputs (descriptors, configurations, parameter buffers, sizes) are one LlmpyError naming the
argument and the value, never a raw error from numpy, torch or Python."""
import pathlib

import numpy as np
import pytest
import torch

import llmpy
import llmpy.config
from llmpy import GPT2Config, parse_descriptor
from llmpy.errors import LlmpyError
from llmpy.init import init_parameters
from llmpy.reference import GPT2Reference

TINY = "layers=1,channels=16,heads=2,seq=16,vocab=257"
SIZES = dict(max_seq_len=16, vocab_size=257, num_layers=1, num_heads=2, channels=16)


def _one_line_error(call) -> str:
    with pytest.raises(LlmpyError) as e:
        call()
    assert "\n" not in str(e.value)
    return str(e.value)


@pytest.mark.parametrize("desc, kind", [
    (None, "NoneType"), (12, "int"), (np.int64(6), "int64"), (pathlib.Path("d6"), "PosixPath"), (b"d6", "bytes"),
])
def test_parse_descriptor_takes_str_only(desc, kind):
    message = _one_line_error(lambda: parse_descriptor(desc))
    assert message.startswith(f"model descriptor {desc!r}: must be a str") and message.endswith(f"not {kind}")


@pytest.mark.parametrize("value, what", [("99999999999999999999", "is far too large"),
                                         ("-1" + "0" * 19, "is far too large"),
                                         ("1_2", "must be an integer"), ("١٢", "must be an integer")])
def test_a_descriptors_number_says_what_is_wrong_with_it(value, what):
    # a number past the 18 digits read was "layers must be an integer", which it is
    desc = f"layers={value},channels=16,heads=2"
    assert _one_line_error(lambda: parse_descriptor(desc)) == f"model descriptor {desc!r}: layers {what}, got {value!r}"


@pytest.mark.parametrize("field, value, kind", [
    ("num_layers", 2.5, "float"), ("channels", 32.0, "float"), ("num_layers", True, "bool"),
    ("num_heads", np.bool_(True), "bool"), ("num_layers", "2", "str"), ("vocab_size", None, "NoneType"),
    ("max_seq_len", np.float32(16), "float32"), ("padded_vocab_size", 384.0, "float"),
])
def test_config_refuses_non_integer_fields(field, value, kind):
    message = _one_line_error(lambda: GPT2Config(**{**SIZES, field: value}))
    assert message == f"{field} must be an integer, got {value!r} ({kind})"


def test_config_refuses_sizes_past_int64():
    message = _one_line_error(lambda: GPT2Config(**{**SIZES, "num_layers": 2**70}))
    assert message == "num_layers must be less than 2**63, got a 71-bit integer"


def test_config_takes_numpys_integers_as_ints():
    rng = np.random.default_rng()
    layers, heads = int(rng.integers(1, 5)), int(rng.integers(1, 5))
    config = GPT2Config(max_seq_len=np.int32(16), vocab_size=np.uint16(257), num_layers=np.int64(layers),
                        num_heads=np.int8(heads), channels=np.int64(8 * heads), padded_vocab_size=np.int64(0))
    assert config == GPT2Config(max_seq_len=16, vocab_size=257, num_layers=layers, num_heads=heads,
                                channels=8 * heads)
    assert all(type(getattr(config, k)) is int for k in SIZES) and type(config.padded_vocab_size) is int


def test_huge_models_are_refused_before_allocating():
    # more parameters than any host's memory: refused by size, not numpy's MemoryError or ValueError
    for desc, n in [("layers=1000000000000,channels=8,heads=1,seq=8,vocab=257", "872,000,000,003,152"),
                    ("layers=1,channels=1000000000,heads=1,seq=8,vocab=257", "12,000,000,407,000,000,000")]:
        message = _one_line_error(lambda: llmpy.create_model(desc))
        assert message.startswith(f"model {desc}: its {n} fp32 parameters need ") and "GB of host memory" in message


def test_model_larger_than_available_memory_is_refused(monkeypatch):
    config = parse_descriptor(TINY)
    free = int(np.random.default_rng().integers(1000, 4 * config.num_parameters))
    monkeypatch.setattr(llmpy.config, "host_memory_available", lambda: free)
    message = _one_line_error(lambda: llmpy.create_model(TINY))
    assert message == (f"model {TINY}: its {config.num_parameters:,} fp32 parameters need "
                       f"{4 * config.num_parameters / 1e9:,.1f} GB of host memory, more than the {free / 1e9:,.1f} "
                       "GB available")


def test_allocation_failure_names_the_model(monkeypatch):
    # where /proc/meminfo does not say, numpy's own refusal becomes the one-line error
    monkeypatch.setattr(llmpy.config, "host_memory_available", lambda: None)
    huge = "layers=1,channels=1000000000,heads=1,seq=8,vocab=257"  # past numpy's largest array: ValueError
    message = _one_line_error(lambda: llmpy.create_model(huge))
    assert message == (f"model {huge}: its 12,000,000,407,000,000,000 fp32 parameters need 48,000,001,628.0 GB, "
                       "more than this machine can allocate")

    def no_memory(*args, **kwargs):
        raise MemoryError("Unable to allocate")
    monkeypatch.setattr(llmpy.init.np, "zeros", no_memory)
    config = parse_descriptor(TINY)
    message = _one_line_error(lambda: init_parameters(config))
    assert message.startswith(f"model {TINY}: its {config.num_parameters:,} fp32 parameters need 0.0 GB")


def test_reference_checks_its_memory(monkeypatch):
    config = parse_descriptor(TINY)
    params = torch.randn(config.num_parameters)
    monkeypatch.setattr(llmpy.config, "host_memory_available", lambda: 8 * config.num_parameters - 1)
    message = _one_line_error(lambda: GPT2Reference(config, params))
    assert message.startswith(f"model {TINY}: its float32 parameter and gradient buffers need ")
    monkeypatch.setattr(llmpy.config, "host_memory_available", lambda: 8 * config.num_parameters)
    assert torch.equal(GPT2Reference(config, params).params_flat, params)


def test_reference_refuses_a_buffer_of_another_model():
    small = llmpy.create_model(TINY, seed=int(np.random.default_rng().integers(2**32)))
    deeper = parse_descriptor(TINY.replace("layers=1", "layers=2"))
    message = _one_line_error(lambda: GPT2Reference(deeper, small.params_flat))
    assert message == (f"GPT2Reference: parameter buffer has {small.config.num_parameters} elements, the model needs "
                       f"{deeper.num_parameters} ({deeper.describe()})")


@pytest.mark.parametrize("make_params, got", [
    (lambda n: None, "None"),
    (lambda n: [0.0] * n, "a list"),
    (lambda n: np.zeros(n, dtype=np.float32), "a ndarray"),
    (lambda n: torch.zeros(n, dtype=torch.int64), "a 1-D torch.int64 tensor"),
    (lambda n: torch.zeros(1, n), "a 2-D torch.float32 tensor"),
])
def test_reference_refuses_what_is_no_flat_buffer(make_params, got):
    config = parse_descriptor(TINY)
    message = _one_line_error(lambda: GPT2Reference(config, make_params(config.num_parameters)))
    assert message == (f"GPT2Reference: params is {got}; it must be the flat parameter buffer, a 1-D floating-point "
                       "torch tensor")


@pytest.mark.parametrize("config", ["d6", None, pathlib.Path(TINY)])
def test_reference_refuses_what_is_no_config(config):
    params = torch.randn(parse_descriptor(TINY).num_parameters)
    message = _one_line_error(lambda: GPT2Reference(config, params))
    assert message.startswith(f"GPT2Reference: config {config!r:.60}: must be a GPT2Config")


@pytest.mark.parametrize("dtype", ["float32", torch.int32, None])
def test_reference_refuses_a_dtype_that_is_no_float(dtype):
    config = parse_descriptor(TINY)
    message = _one_line_error(lambda: GPT2Reference(config, torch.randn(config.num_parameters), dtype=dtype))
    assert message == f"GPT2Reference: dtype {dtype!r}: must be a floating-point torch dtype"


# what the number arguments of both models' methods must be (the messages' "must be ..." part)
LR = AT_LEAST_0 = "a finite number >= 0"
STEP, BETA = "an integer from 1 to 2**63 - 1 (AdamW counts steps from 1)", "a number in [0, 1)"
ADAMW_BAD = [  # (argument, its value from a generator, what it must be)
    ("lr", lambda r: "1e-3", LR), ("lr", lambda r: None, LR), ("lr", lambda r: float("nan"), LR),
    ("lr", lambda r: float("inf"), LR), ("lr", lambda r: -float(r.uniform(1e-4, 1e-1)), LR),
    ("step", lambda r: "1", STEP), ("step", lambda r: 1 + float(r.uniform(0.1, 0.9)), STEP),
    ("step", lambda r: True, STEP), ("step", lambda r: 0, STEP), ("step", lambda r: -int(r.integers(1, 100)), STEP),
    ("step", lambda r: 2**63 + int(r.integers(100)), STEP), ("step", lambda r: np.float64(r.integers(1, 100)), STEP),
    ("beta1", lambda r: 1.0, BETA), ("beta1", lambda r: -float(r.uniform(0.1, 1)), BETA),
    ("beta2", lambda r: float("nan"), BETA), ("eps", lambda r: 0.0, "a finite number > 0"),
    ("eps", lambda r: "1e-8", "a finite number > 0"),
    ("weight_decay", lambda r: -float(r.uniform(0.01, 1)), AT_LEAST_0),
    ("weight_decay", lambda r: float("inf"), AT_LEAST_0),
]
GOOD_HYPER = dict(lr=1e-2, step=2, weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8)
DLOSS_BAD = ["0.1", float("nan"), float("inf"), -float("inf"), True]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes: equal only where every bit is (a NaN too)."""
    return t.detach().reshape(-1).contiguous().view(torch.uint8).clone()


def _reference_state(model) -> list:
    return [_bits(t) for t in (model.params_flat, model.grads_flat, model.m_flat, model.v_flat)]


def _trained_reference():
    """A tiny reference with AdamW's m and v set by one step and a fresh gradient waiting for update()."""
    rng = np.random.default_rng()
    model = llmpy.create_model(TINY, seed=int(rng.integers(2**32)))
    x, y = (torch.from_numpy(rng.integers(0, 257, (2, 8))) for _ in range(2))
    for step in (1, 2):
        model.zero_grad()
        model.forward(x, y)
        model.backward()
        if step == 1:
            model.update(1e-2, 1, weight_decay=0.1)
    return model, rng


REFERENCE_BAD = ADAMW_BAD + [("grad_scale", lambda r: float("inf"), AT_LEAST_0),
                             ("grad_scale", lambda r: "1", AT_LEAST_0),
                             ("grad_scale", lambda r: -float(r.uniform(0.1, 1)), AT_LEAST_0)]


@pytest.mark.parametrize("name, make, rule", REFERENCE_BAD,
                         ids=[f"{n}-{k}" for k, (n, _, _) in enumerate(REFERENCE_BAD)])
def test_reference_update_checks_its_numbers_before_any_work(name, make, rule):
    # a str was a raw TypeError after AdamW had begun on m and v; a NaN or infinite rate made every weight NaN;
    # step 1.5 or True was taken
    model, rng = _trained_reference()
    value = make(rng)
    before = _reference_state(model)
    assert _one_line_error(lambda: model.update(**{**GOOD_HYPER, "grad_scale": 1.0, name: value})) == \
        f"GPT2Reference.update: {name} {value!r}: must be {rule}"
    assert all(torch.equal(a, b) for a, b in zip(_reference_state(model), before))
    # numpy's numbers are numbers: the same update as Python's
    twin = GPT2Reference(model.config, model.params_flat)
    twin.grads_flat.copy_(model.grads_flat)
    twin.m_flat, twin.v_flat = model.m_flat.clone(), model.v_flat.clone()
    lr = np.float32(rng.uniform(1e-3, 1e-2))
    model.update(lr, np.int64(2), weight_decay=np.float64(0.1), grad_scale=np.float32(0.5))
    twin.update(float(lr), 2, weight_decay=0.1, grad_scale=float(np.float32(0.5)))
    assert all(torch.equal(a, b) for a, b in zip(_reference_state(model), _reference_state(twin)))
    assert not torch.equal(_bits(model.params_flat), before[0])


@pytest.mark.parametrize("dloss", DLOSS_BAD)
def test_reference_backward_checks_dloss_before_any_work(dloss):
    # a str was a raw TypeError; a NaN or infinite dloss made every gradient NaN
    rng = np.random.default_rng()
    model = llmpy.create_model(TINY, seed=int(rng.integers(2**32)))
    twin = GPT2Reference(model.config, model.params_flat)
    x, y = (torch.from_numpy(rng.integers(0, 257, (2, 8))) for _ in range(2))
    for m in (model, twin):
        m.forward(x, y)
    grads = _bits(model.grads_flat)
    assert _one_line_error(lambda: model.backward(dloss)) == \
        f"GPT2Reference.backward: dloss {dloss!r}: must be None or a finite number"
    assert torch.equal(_bits(model.grads_flat), grads)
    d = float(rng.uniform(0.01, 0.1))
    model.backward(np.float32(d))  # the forward's activations are still there for it
    twin.backward(float(np.float32(d)))
    assert torch.equal(_bits(model.grads_flat), _bits(twin.grads_flat)) and model.grad_norm() > 0


# ----------------------------------------------------------------------------------------------------
# llmpy.model.GPT2Model: token ids, batches, state loading (a tiny model through Triton's interpreter on the CPU)

MODEL = "layers=1,channels=16,heads=2,seq=32,vocab=257"
MB, MT = 2, 8


def _gpt2(device, **kw):
    from llmpy.model import GPT2Model
    config = parse_descriptor(MODEL)
    params = init_parameters(config, seed=int(np.random.default_rng().integers(2**31)))
    kw = {"dtype": torch.float32, "attention": "flash", **kw}
    return GPT2Model(config, params, MB, MT, device=device, **kw), config, params


def _ids(config, rng, shape=(MB, MT), dtype=np.int64):
    return torch.from_numpy(rng.integers(0, config.vocab_size, shape).astype(dtype))


def test_model_checks_int32_ids_already_on_its_device(device):
    # (B, T) int32 tensors on the model's device skip the copy; on the CPU that must not skip the check
    # (an id past the vocabulary read past wte: garbage losses, or a segfault further out)
    model, config, _ = _gpt2(device)
    rng = np.random.default_rng()
    x, y = _ids(config, rng, dtype=np.int32).to(device), _ids(config, rng, dtype=np.int32).to(device)
    bad = x.clone()
    b, t = int(rng.integers(MB)), int(rng.integers(MT))
    v = int(rng.integers(config.vocab_size, config.padded_vocab_size))
    bad[b, t] = v
    if bad.device.type == "cpu":
        where = f"token id {v} at [{b}, {t}], outside the model's vocabulary [0, 257)"
        assert _one_line_error(lambda: model.forward(bad, y)) == f"inputs hold {where}"
        assert _one_line_error(lambda: model.forward(x, bad)) == f"targets hold {where}"
    model.forward(x, y)
    assert 4.5 < model.loss() < 7.0


@pytest.mark.parametrize("make, dtype", [
    (lambda x: x.float() + 0.5, "torch.float32"),
    (lambda x: torch.full(x.shape, float("nan")), "torch.float32"),
    (lambda x: x.to(torch.bfloat16), "torch.bfloat16"),
    (lambda x: x.numpy().astype(np.float64), "float64"),
])
def test_model_refuses_token_ids_that_are_not_integers(device, make, dtype):
    # a float was truncated to another token (3.5 -> 3), a NaN or bf16 tensor was numpy's or torch's traceback
    model, config, _ = _gpt2(device)
    rng = np.random.default_rng()
    x, y = _ids(config, rng), _ids(config, rng)
    bad = make(x)
    assert _one_line_error(lambda: model.forward(bad, y)) == f"inputs of dtype {dtype}: token ids must be integers"
    assert _one_line_error(lambda: model.validate(x, bad)) == f"targets of dtype {dtype}: token ids must be integers"
    assert _one_line_error(lambda: model.train_step([(x, bad)], 1e-3, 1)) == \
        f"targets of dtype {dtype}: token ids must be integers"
    assert _one_line_error(lambda: model.logits_last(bad[0])) == \
        f"logits_last: tokens of dtype {dtype}: token ids must be integers"


def test_model_refuses_ragged_token_lists(device):
    model, config, _ = _gpt2(device)
    rng = np.random.default_rng()
    ragged = [list(range(MT)), list(range(MT - 1))]
    y = _ids(config, rng)
    for call in (lambda: model.forward(ragged, y), lambda: model.train_step([(ragged, y)], 1e-3, 1)):
        assert _one_line_error(call).startswith("inputs: not an array of token ids (")


def test_empty_lists_are_refused_by_their_shape_and_numpy_views_are_taken(device):
    # numpy makes [] float64: "token ids must be integers" was the wrong complaint; a reversed view or a big-endian
    # array is a fine batch of ids, which torch.as_tensor refused with a raw ValueError
    from llmpy.reference import GPT2Reference
    model, config, params = _gpt2(device)
    assert _one_line_error(lambda: model.logits_last([])).startswith("logits_last: tokens of shape [1, 0]")
    assert _one_line_error(lambda: model.logits_last([[]])).startswith("logits_last: tokens of shape [1, 0]")
    assert _one_line_error(lambda: model.forward([[]])).startswith("inputs of shape [1, 0]")
    assert _one_line_error(lambda: GPT2Reference(config, params).forward([[]])).startswith("inputs of shape [1, 0]")
    rng = np.random.default_rng()
    x, y = (rng.integers(0, config.vocab_size, (MB, MT)) for _ in range(2))
    model.forward(x, y)
    want = model.position_losses()
    for view in (x[:, ::-1].copy()[:, ::-1], x.astype(">i4")):
        model.forward(view, y)
        assert torch.equal(model.position_losses(), want)


def test_bad_targets_leave_the_last_training_forward_intact(device):
    # the targets were checked only after the whole forward had run on the new inputs: the logit gradient
    # (and, from a CPU batch, the inputs the backward's encoder reads) of the training forward before were gone
    model, config, params = _gpt2(device)
    rng = np.random.default_rng()
    x, y, x2 = _ids(config, rng), _ids(config, rng), _ids(config, rng)
    bad = _ids(config, rng)
    b, t = int(rng.integers(MB)), int(rng.integers(MT))
    bad[b, t] = config.vocab_size
    model.zero_grad()
    model.forward(x, y, dloss=1.0 / (MB * MT))
    loss = model.loss()
    assert _one_line_error(lambda: model.validate(x2, bad)) == \
        f"targets hold token id 257 at [{b}, {t}], outside the model's vocabulary [0, 257)"
    assert model.loss() == loss
    model.backward()
    from llmpy.model import GPT2Model
    fresh = GPT2Model(config, params, MB, MT, device=device, dtype=torch.float32, attention="flash")
    fresh.zero_grad()
    fresh.forward(x, y, dloss=1.0 / (MB * MT))
    fresh.backward()
    assert fresh.loss() == loss and 4.5 < loss < 7.0
    assert torch.equal(model.gradients_fp32(), fresh.gradients_fp32())


def test_a_refused_step_changes_nothing(device):
    # step 0 was refused only after the forward and backward had run: the rounding seeds had moved on, so
    # the run went on with other bits than one that never made the call (bf16: the seeds decide them)
    seed = int(np.random.default_rng().integers(2**31))
    model, config, params = _gpt2(device, dtype=torch.bfloat16, seed=seed)
    rng = np.random.default_rng()
    batches = [[(_ids(config, rng), _ids(config, rng))] for _ in range(2)]
    assert _one_line_error(lambda: model.train_step(batches[0], 1e-2, 0)) == \
        f"GPT2Model.train_step: step 0: must be {STEP}"
    from llmpy.model import GPT2Model
    fresh = GPT2Model(config, params, MB, MT, device=device, attention="flash", seed=seed)
    for m in (model, fresh):  # the step by step API: a gradient, and (model only) a refused update of it
        m.zero_grad()
        m.forward(*batches[0][0], dloss=1.0 / (MB * MT))
        m.backward()
    assert _one_line_error(lambda: model.update(1e-2, 0)) == f"GPT2Model.update: step 0: must be {STEP}"
    got = [model.train_step(b, 1e-2, s + 1) for s, b in enumerate(batches)]
    want = [fresh.train_step(b, 1e-2, s + 1) for s, b in enumerate(batches)]
    assert got == want and 4.5 < got[0][0] < 7.0
    assert torch.equal(model.params_memory, fresh.params_memory)


def _model_state(model) -> list:
    """Everything a step reads and writes on the device: parameters, gradients, AdamW's m and v, the master weights,
    the rounding seeds."""
    buffers = (model.params_memory, model.grads_memory, model.m_memory, model.v_memory, model.master_memory)
    return [model.seed_state()] + [_bits(t) for t in buffers if t is not None]


def test_model_checks_its_numbers_before_any_work(device):
    # train_step's lr="a" or None was refused only when the hyper-parameters were written, after the forward and
    # backward had moved the gradients and the rounding seeds; a NaN rate made every parameter NaN, step 1.5 was taken
    from llmpy.model import GPT2Model
    seed = int(np.random.default_rng().integers(2**31))
    model, config, params = _gpt2(device, dtype=torch.bfloat16, seed=seed)
    twin = GPT2Model(config, params, MB, MT, device=device, dtype=torch.bfloat16, attention="flash", seed=seed)
    rng = np.random.default_rng()
    batches = [(_ids(config, rng), _ids(config, rng)) for _ in range(3)]
    for m in (model, twin):
        m.train_step([batches[0]], 1e-2, 1, 0.1)  # AdamW's m and v, the seeds: past their first values
        m.zero_grad()
        m.forward(*batches[1], dloss=1.0 / (MB * MT))
        m.backward()  # a gradient waiting for update()
    before = _model_state(model)
    cases = ADAMW_BAD + [("grad_clip", lambda r: "x", f"{AT_LEAST_0} (0 turns clipping off)"),
                         ("grad_clip", lambda r: float("nan"), f"{AT_LEAST_0} (0 turns clipping off)"),
                         ("grad_clip", lambda r: -float(r.uniform(0.1, 1)), f"{AT_LEAST_0} (0 turns clipping off)")]
    for name, make, rule in cases:
        value = make(rng)
        kw = {**GOOD_HYPER, "grad_clip": 1.0, name: value}
        pending = iter([batches[2]])
        assert _one_line_error(lambda: model.train_step(pending, **kw)) == \
            f"GPT2Model.train_step: {name} {value!r}: must be {rule}"
        assert next(pending) is batches[2]  # refused before a generator of batches is drawn from
        assert _one_line_error(lambda: model.update(**kw)) == f"GPT2Model.update: {name} {value!r}: must be {rule}"
    after = _model_state(model)
    assert after[0] == before[0] and all(torch.equal(a, b) for a, b in zip(after[1:], before[1:]))
    # numpy's numbers are numbers, an int is one: the same steps as Python's floats
    model.update(np.float32(1e-2), np.int64(2), weight_decay=np.float64(0.1), grad_clip=1)
    twin.update(float(np.float32(1e-2)), 2, weight_decay=0.1, grad_clip=1.0)
    lr = np.float32(rng.uniform(1e-3, 1e-2))
    got = model.train_step([batches[2]], lr, np.int32(3), np.float32(0.1), np.float32(0.5), eps=np.float64(1e-8))
    want = twin.train_step([batches[2]], float(lr), 3, float(np.float32(0.1)), 0.5, eps=1e-8)
    assert got == want and 4.5 < got[0] < 7.0
    after, theirs = _model_state(model), _model_state(twin)
    assert after[0] == theirs[0] and all(torch.equal(a, b) for a, b in zip(after[1:], theirs[1:]))


def test_model_forward_checks_dloss_before_any_work(device):
    # dloss="a" was a raw ValueError once the whole forward had run over the earlier training forward's buffers
    from llmpy.model import GPT2Model
    model, config, params = _gpt2(device)
    twin = GPT2Model(config, params, MB, MT, device=device, dtype=torch.float32, attention="flash")
    rng = np.random.default_rng()
    x, y, x2, y2 = (_ids(config, rng) for _ in range(4))
    for m in (model, twin):
        m.zero_grad()
        m.forward(x, y, dloss=1.0 / (MB * MT))
    loss = model.loss()
    for dloss in DLOSS_BAD:
        assert _one_line_error(lambda: model.forward(x2, y2, dloss=dloss)) == \
            f"GPT2Model.forward: dloss {dloss!r}: must be None or a finite number"
    assert model.loss() == loss and 4.5 < loss < 7.0
    for m in (model, twin):
        m.backward()  # from the first forward's logit gradient, still in place
    assert torch.equal(_bits(model.gradients_fp32()), _bits(twin.gradients_fp32()))


DENSE = "token ids must be a dense tensor (to_dense() makes one)"


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("make, what", [
    (lambda x: x.to_sparse(), f"of layout torch.sparse_coo: {DENSE}"),
    (lambda x: x.to_sparse_csr(), f"of layout torch.sparse_csr: {DENSE}"),
    (lambda x: x.to("meta"), "on the meta device: token ids must be a tensor with values (a meta tensor has only a "
                             "shape)"),
], ids=["sparse_coo", "sparse_csr", "meta"])
def test_token_ids_must_be_a_dense_tensor_with_values(device, make, what):
    # a sparse tensor was numpy's raw TypeError, a meta one torch's NotImplementedError
    model, config, params = _gpt2(device)
    reference = GPT2Reference(config, params)
    rng = np.random.default_rng()
    x, y = _ids(config, rng), _ids(config, rng)
    loss = model.validate(x, y)
    ref_loss = reference.forward(x, y)
    seeds = model.seed_state()
    for m in (model, reference):
        assert _one_line_error(lambda: m.forward(make(x), y)) == f"inputs {what}"
        assert _one_line_error(lambda: m.forward(x, make(y))) == f"targets {what}"
    assert _one_line_error(lambda: model.train_step([(x, make(y))], 1e-3, 1)) == f"targets {what}"
    assert _one_line_error(lambda: model.logits_last(make(x[:1]))) == f"logits_last: tokens {what}"
    assert model.loss() == loss and model.seed_state() == seeds and 4.5 < loss < 7.0
    assert float(reference.losses.double().mean()) == ref_loss


def test_train_step_wants_a_list_of_pairs(device):
    model, config, _ = _gpt2(device)
    rng = np.random.default_rng()
    x, y = _ids(config, rng), _ids(config, rng)
    assert _one_line_error(lambda: model.train_step((x, y), 1e-3, 1)) == \
        f"train_step: micro-batch 0 is a Tensor of shape [{MB}, {MT}], not an (inputs, targets) pair (batches: a " \
        "list of pairs)"
    assert _one_line_error(lambda: model.train_step([(x, y, x)], 1e-3, 1)) == \
        "train_step: micro-batch 0 is a tuple of 3, not an (inputs, targets) pair (batches: a list of pairs)"
    assert _one_line_error(lambda: model.train_step(x, 1e-3, 1)) == \
        f"train_step: micro-batch 0 is a Tensor of shape [{MT}], not an (inputs, targets) pair (batches: a list " \
        "of pairs)"
    loss, norm = model.train_step(((x, y) for _ in range(2)), 1e-3, 1)  # a generator of pairs: two micro-steps
    assert 4.5 < loss < 7.0 and norm > 0
    # a micro-batch as one stacked (2, B, T) tensor or array is a pair too (it was, before the checks above)
    from llmpy.model import GPT2Model
    _, _, params = _gpt2(device)
    stacked = [GPT2Model(config, params.clone(), MB, MT, device=device, dtype=torch.float32, attention="flash")
               .train_step([pair], 1e-3, 1) for pair in (torch.stack([x, y]), (x, y), torch.stack([x, y]).numpy())]
    assert stacked[0] == stacked[1] == stacked[2]


def test_logits_last_checks_ids_before_narrowing_them(device):
    # ids were cast to int32 before the check: 2**32 + 5 was read as token 5; and b = 0 passed
    model, config, _ = _gpt2(device)
    rng = np.random.default_rng()
    row = _ids(config, rng, shape=(int(rng.integers(1, MT + 1)),))
    huge = row.clone()
    huge[-1] = 2**32 + int(rng.integers(config.vocab_size))
    assert _one_line_error(lambda: model.logits_last(huge)) == \
        f"logits_last: tokens hold token id {int(huge[-1])} at [0, {len(row) - 1}], outside the model's vocabulary " \
        "[0, 257)"
    assert _one_line_error(lambda: model.logits_last(torch.zeros(0, 3, dtype=torch.int64))) == \
        f"logits_last: tokens of shape [0, 3]; want (b, t), 1 <= b <= {MB}, t >= 1"
    logits = model.logits_last(row)
    assert logits.shape == (1, config.vocab_size) and 0 < float(logits.abs().max()) < 10


def test_optimizer_state_of_another_size_is_refused_whole(device):
    model, config, _ = _gpt2(device, dtype=torch.bfloat16)
    N = config.num_parameters
    m, v = torch.randn(N), torch.rand(N)
    model.load_optimizer_state(m, v)
    # one element was broadcast over all of m and v; a wrong v was refused after m was overwritten
    message = f"load_optimizer_state: m has 1 elements, v 1; the model has {N:,} parameters"
    assert _one_line_error(lambda: model.load_optimizer_state(torch.randn(1), torch.randn(1))) == message
    message = f"load_optimizer_state: m has {N:,} elements, v {N - 1:,}; the model has {N:,} parameters"
    assert _one_line_error(lambda: model.load_optimizer_state(torch.randn(N), torch.rand(N - 1))) == message
    got_m, got_v = model.optimizer_state()
    assert torch.equal(got_m, m) and torch.equal(got_v, v)
    master = torch.randn(N)
    model.load_master(master)
    assert _one_line_error(lambda: model.load_master(torch.randn(1))) == \
        f"load_master: the master weights have 1 elements, the model {N:,} parameters"
    assert torch.equal(model.master_fp32(), master)
    fp32, _, _ = _gpt2(device)
    assert _one_line_error(lambda: fp32.load_master(master)) == \
        "load_master: this model keeps no master weights (only bf16 storage with master_weights=True has them)"


@pytest.mark.parametrize("args, message", [
    (lambda c, p: (MODEL, p, MB, MT), f"GPT2Model: config {MODEL!r}: must be a GPT2Config (llmpy.parse_descriptor "
                                      "makes one from a descriptor)"),
    (lambda c, p: (c, p.numpy(), MB, MT), "GPT2Model: params is a ndarray; it must be the flat parameter buffer, "
                                          "a floating-point torch tensor"),
    (lambda c, p: (c, None, MB, MT), "GPT2Model: params is None; it must be the flat parameter buffer, "
                                     "a floating-point torch tensor"),
    (lambda c, p: (c, p.long(), MB, MT), "GPT2Model: params is a torch.int64 tensor; it must be the flat parameter "
                                         "buffer, a floating-point torch tensor"),
    (lambda c, p: (c, p, float(MB), MT), f"B={float(MB)!r}, T={MT}: the micro-batch must be positive integers"),
    (lambda c, p: (c, p, MB, 0), f"B={MB}, T=0: the micro-batch must be positive integers"),
])
def test_model_refuses_what_is_no_config_buffer_or_size(device, args, message):
    from llmpy.model import GPT2Model
    config = parse_descriptor(MODEL)
    params = init_parameters(config, seed=int(np.random.default_rng().integers(2**31)))
    assert _one_line_error(lambda: GPT2Model(*args(config, params), device=device)) == message


@pytest.mark.parametrize("seed", [None, -5, 2**32, 1.5, True])
def test_model_seed_is_checked(device, seed):
    # None drew the rounding seeds from the OS (two models "of the same seed" then differed), -5 gave the bits of 5
    from llmpy.model import GPT2Model
    config = parse_descriptor(MODEL)
    params = init_parameters(config, seed=int(np.random.default_rng().integers(2**31)))
    message = _one_line_error(lambda: GPT2Model(config, params, MB, MT, device=device, seed=seed))
    assert message == f"GPT2Model: seed {seed!r}: must be an integer from 0 to 4294967295"
    good = int(np.random.default_rng().integers(2**32))
    a, b = (GPT2Model(config, params, MB, MT, device=device, seed=good) for _ in range(2))
    assert a.seed_state() == b.seed_state() and len(set(a.seed_state())) == 3 + 6 * config.num_layers


def test_model_device_is_checked():
    from llmpy.model import GPT2Model
    config = parse_descriptor(MODEL)
    params = init_parameters(config, seed=int(np.random.default_rng().integers(2**31)))
    n = torch.cuda.device_count()
    past = f"cuda:{n}"  # one past the last GPU (cuda:0 where there is none): torch's RuntimeError before
    want = (f"GPT2Model: device {past!r}: torch sees {n} CUDA device(s)" if n
            else f"GPT2Model: device {past!r}: no CUDA GPU is visible to torch")
    assert _one_line_error(lambda: GPT2Model(config, params, MB, MT, device=past)) == want
    for device in ("meta", "tpu"):
        assert _one_line_error(lambda: GPT2Model(config, params, MB, MT, device=device)) == \
            f"GPT2Model: device {device!r}: must be cuda (a GPU) or cpu (Triton's interpreter)"


def test_loss_before_any_forward_with_targets_is_refused(device):
    # the losses buffer is allocated uninitialised: loss() read back whatever was in that memory
    model, config, _ = _gpt2(device)
    rng = np.random.default_rng()
    for call in (model.loss, model.position_losses):
        assert _one_line_error(call) == "no forward with targets has run yet: no loss to read"
    model.forward(_ids(config, rng))
    assert _one_line_error(model.loss) == "no forward with targets has run yet: no loss to read"
    x, y = _ids(config, rng), _ids(config, rng)
    loss = model.validate(x, y)
    assert 4.5 < loss < 7.0 and model.position_losses().shape == (MB, MT)
    model.logits_last(x[0])  # a forward without targets: loss() still reads the last one with targets
    assert model.loss() == loss


def test_logits_and_losses_handed_out_are_copies(device):
    # fp32 on the CPU: .float().cpu() returned views of the model's buffers, which the next forward overwrote
    model, config, _ = _gpt2(device, classifier_chunks=1)
    rng = np.random.default_rng()
    row = _ids(config, rng, shape=(MT,))
    logits = model.logits_last(row)
    kept = logits.clone()
    x, y = _ids(config, rng), _ids(config, rng)
    model.validate(x, y)
    losses = model.position_losses()
    kept_losses = losses.clone()
    assert torch.equal(logits, kept) and 0 < float(kept.abs().max()) < 10
    model.validate(_ids(config, rng), _ids(config, rng))
    assert torch.equal(losses, kept_losses) and float(losses.mean()) == pytest.approx(model.validate(x, y), rel=1e-6)


def test_validate_without_targets_is_refused(device):
    # a forward without targets writes no losses: validate(x, None) returned the batch before's loss as this one's
    model, config, _ = _gpt2(device)
    rng = np.random.default_rng()
    loss = model.validate(_ids(config, rng), _ids(config, rng))
    assert _one_line_error(lambda: model.validate(_ids(config, rng), None)) == \
        "validate: targets is None; it needs the (B, T) targets of the inputs"
    assert model.loss() == loss and 4.5 < loss < 7.0


def test_a_cpu_model_without_the_interpreter_is_one_line(monkeypatch):
    # a CPU model's kernels run only in Triton's interpreter: without it every call was Triton's raw RuntimeError
    # ("0 active drivers"); the model itself is still built (its memory plan needs no kernel)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    model, config, _ = _gpt2("cpu", dtype=torch.bfloat16)
    rng = np.random.default_rng()
    x, y = _ids(config, rng), _ids(config, rng)
    seeds = model.seed_state()
    for who, call in [("forward", lambda: model.forward(x, y)), ("forward", lambda: model.validate(x, y)),
                      ("forward", lambda: model.logits_last(x[0])), ("train_step", lambda: model.train_step([(x, y)],
                                                                                                          1e-3, 1)),
                      ("update", lambda: model.update(1e-3, 1)), ("grad_norm", model.grad_norm)]:
        assert _one_line_error(call) == (f"GPT2Model.{who}: a model on the CPU runs its kernels in Triton's "
                                         "interpreter: set TRITON_INTERPRET=1 before importing llmpy (slow; meant for "
                                         "tests), or use device=cuda")
    assert model.seed_state() == seeds  # the refused step drew no rounding seeds


@pytest.mark.parametrize("make, got", [(lambda t: t.numpy(), "a ndarray"), (lambda t: t.tolist(), "a list"),
                                       (lambda t: None, "None"), (lambda t: t.long(), "a torch.int64 tensor")])
def test_optimizer_state_and_master_weights_must_be_tensors(device, make, got):
    # they were an AttributeError (no numel) or, as integers, silently truncated
    model, config, _ = _gpt2(device, dtype=torch.bfloat16)
    N = config.num_parameters
    m, v = torch.randn(N), torch.rand(N)
    model.load_optimizer_state(m, v)
    tail = "a floating-point torch tensor"
    assert _one_line_error(lambda: model.load_optimizer_state(make(m), v)) == \
        f"load_optimizer_state: m is {got}; it must be AdamW's whole flat m, {tail}"
    assert _one_line_error(lambda: model.load_optimizer_state(m, make(v))) == \
        f"load_optimizer_state: v is {got}; it must be AdamW's whole flat v, {tail}"
    assert _one_line_error(lambda: model.load_master(make(m))) == \
        f"load_master: master is {got}; it must be the whole flat master weights, {tail}"
    got_m, got_v = model.optimizer_state()
    assert torch.equal(got_m, m) and torch.equal(got_v, v)


def _graphed_cpu_model(device, monkeypatch):
    """(model, config, captures): a CPU model with cuda_graph on and torch.cuda's graph calls stood in for, so that
    it takes the graph path: a capture runs the work eagerly, a replay does nothing; captures lists the graphs
    captured so far. A GPU runs the real graphs' tests instead."""
    import contextlib
    if device != "cpu":
        pytest.skip("CUDA's calls are stood in for on the CPU only")
    captures = []

    class Stream:
        def __init__(self, *args, **kwargs):
            pass

        def wait_stream(self, other):
            pass

    class Graph:
        def pool(self):
            return None

        def replay(self):
            pass

    @contextlib.contextmanager
    def graph(g, pool=None, capture_error_mode=None):
        captures.append(g)
        yield

    for name, value in [("CUDAGraph", Graph), ("graph", graph), ("Stream", Stream), ("current_stream", Stream),
                        ("stream", lambda s: contextlib.nullcontext())]:
        monkeypatch.setattr(torch.cuda, name, value)
    model, config, _ = _gpt2(device)
    model.cuda_graph = True
    return model, config, captures


def test_a_refused_batch_is_refused_before_the_step_graph_is_captured(device, monkeypatch):
    # the step's graph was captured before its batches were checked: a refused batch left the host flags as if
    # the step had run (here: the logit gradient of a pending forward gone). The CUDA calls are stand-ins that
    # run the "captured" work eagerly, so the CPU takes the graph path (a GPU runs the real graphs' tests).
    model, config, captures = _graphed_cpu_model(device, monkeypatch)
    rng = np.random.default_rng()
    x, y = _ids(config, rng), _ids(config, rng)
    bad = y.clone()
    bad[0, 0] = config.vocab_size
    model.train_step([(x, y)], 1e-3, 1)  # the warm-up step, eager
    model.zero_grad()
    model.forward(x, y, dloss=1.0 / (MB * MT))
    assert _one_line_error(lambda: model.train_step([(x, bad)], 1e-3, 2)) == \
        "micro-batch 0: targets hold token id 257 at [0, 0], outside the model's vocabulary [0, 257)"
    assert not captures
    model.backward()  # the forward's logit gradient is still there
    loss, norm = model.train_step([(x, y)], 1e-3, 2)  # captured (and run eagerly by the stand-ins) now
    assert len(captures) == 1 and 4.5 < loss < 7.0 and norm > 0


def test_a_replayed_step_graph_names_its_own_gradient(device, monkeypatch):
    # graphs of one and of two micro-steps captured in turn, then the two-step one replayed: gradients_fp32() (and
    # grad_norm(), update()) must mean its gradient, the micro-steps' sum in the accumulator, not the buffer the
    # last capture pointed them at. Stand-ins as above: a replay runs nothing, so the buffers keep the captures'.
    model, config, captures = _graphed_cpu_model(device, monkeypatch)
    rng = np.random.default_rng()
    two = [(_ids(config, rng), _ids(config, rng)) for _ in range(2)]
    one = [(_ids(config, rng), _ids(config, rng))]
    model.train_step(two, 1e-3, 1)  # warm-ups, eager
    model.train_step(one, 1e-3, 2)
    model.train_step(two, 1e-3, 3)  # captured
    summed = model.gradients_fp32()
    model.train_step(one, 1e-3, 4)  # captured
    single = model.gradients_fp32()
    assert len(captures) == 2 and not torch.equal(summed, single)
    model.train_step(two, 1e-3, 5)  # replayed
    assert torch.equal(model.gradients_fp32(), summed)
