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
