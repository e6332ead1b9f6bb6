"""The PyTorch baseline of the whole-step benchmark is the same model as llmpy's: bench/torch_gpt2.py
against the CPU reference (loss, logits, every gradient, one AdamW step) from the same flat parameters;
and bench/bench_step.py's argument parsing, figures and tables on fake system results (no GPU)."""
import json
import math
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # bench/ lives at the repository root, next to src/
    sys.path.insert(0, str(REPO))

from bench import bench_step  # noqa: E402
from bench.torch_gpt2 import TorchGPT2, TorchTrainer, from_flat, num_parameters, to_flat  # noqa: E402
from llmpy.config import PARAMETER_NAMES, GPT2Config, parameter_views, parse_descriptor  # noqa: E402
from llmpy.init import init_parameters  # noqa: E402
from llmpy.reference import GPT2Reference, clip_scale  # noqa: E402

TINY = GPT2Config(max_seq_len=16, vocab_size=100, num_layers=2, num_heads=2, channels=32)  # Vp = 128
TINY_DESC = "layers=2,channels=32,heads=2,seq=16,vocab=100"


def rel_err(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def tiny_params(seed=0):
    """llm.c's init plus noise on every element, so biases, layernorm weights and the padded wte rows
    (which the loss must ignore) are all non-trivial."""
    g = torch.Generator().manual_seed(seed)
    p = init_parameters(TINY, seed=7)
    return p + 0.1 * torch.randn(p.shape, generator=g)


def tiny_batch(B=3, T=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, TINY.vocab_size, (B, T), generator=g),
            torch.randint(0, TINY.vocab_size, (B, T), generator=g))


def test_flat_roundtrip_and_parameter_count():
    p = tiny_params()
    model = from_flat(TINY, p)
    assert torch.equal(to_flat(model), p)
    assert num_parameters(model) == TINY.num_parameters
    with torch.device("meta"):  # d12 on the meta device: the count llm.c's MFU uses, at no cost
        d12 = parse_descriptor("d12")
        assert num_parameters(TorchGPT2(d12)) == d12.num_parameters == 124_475_904


@pytest.mark.parametrize("T", [16, 11])
def test_loss_logits_and_gradients_match_reference(T):
    p = tiny_params()
    x, y = tiny_batch(T=T)
    ref = GPT2Reference(TINY, p)
    ref_loss = ref.forward(x, y)
    ref.zero_grad()
    ref.backward()

    model = from_flat(TINY, p)
    loss, logits = model(x, y, return_logits=True)
    loss.backward()
    assert abs(loss.item() - ref_loss) < 1e-5 * abs(ref_loss)
    assert rel_err(logits, ref.logits) < 1e-5
    got = parameter_views(to_flat(model, grads=True), TINY)
    for name in PARAMETER_NAMES:
        assert rel_err(got[name], ref.grads[name]) < 1e-4, name
    # the padded wte rows get no gradient from either side
    assert torch.count_nonzero(got["wte"][TINY.vocab_size:]) == 0


def test_train_steps_match_reference_adamw():
    """Two full steps (clip + AdamW, decay on the 2-D tensors only) end at the reference's parameters."""
    lr, wd, clip = 1e-3, 0.1, 0.5
    p = tiny_params()
    ref = GPT2Reference(TINY, p)
    model = from_flat(TINY, p)
    trainer = TorchTrainer(model, lr=lr, weight_decay=wd, grad_clip=clip, autocast=False, fused=False)
    for step in (1, 2):
        x, y = tiny_batch(seed=10 + step)
        ref_loss = ref.forward(x, y)
        ref.zero_grad()
        ref.backward()
        ref_norm = ref.grad_norm()
        ref.update(lr, step, weight_decay=wd, grad_scale=clip_scale(ref_norm, clip))
        loss, norm = trainer.step(x, y, lr=lr)
        assert abs(float(loss) - ref_loss) < 1e-5 * ref_loss
        assert abs(float(norm) - ref_norm) < 1e-4 * ref_norm
    assert ref_norm > clip  # clipping was active
    moved_ref = ref.params_flat - p
    moved = to_flat(model) - p
    assert rel_err(moved, moved_ref) < 1e-3


# ----------------------------------------------------------------------------------------------------
# bench_step without a GPU

def test_bench_step_defaults_and_errors():
    args = bench_step.parse_args([])
    assert (args.B, args.T, args.steps, args.warmup_median_from, args.model) == (64, 1024, 40, 11, "d12")
    assert args.system_list == ["torch-compile", "llmpy"]
    assert bench_step.llmpy_options(args) == {"master_weights": True, "attention": "auto", "seed": 42,
                                              "cuda_graph": True}
    args = bench_step.parse_args(["--systems", "llmpy", "--recompute", "0", "--gelu-fusion", "2", "--no-graph"])
    assert bench_step.llmpy_options(args) == {"master_weights": True, "attention": "auto", "seed": 42,
                                              "cuda_graph": False, "recompute": 0, "gelu_fusion": 2}
    for bad in (["--systems", "torch-compile,jax"], ["--T", "2048"], ["--steps", "0"]):
        with pytest.raises(SystemExit):
            bench_step.parse_args(bad)


def test_bench_step_flash_config(monkeypatch):
    """--flash-config overrides the flash tile table at the model's head size (GPT-2 124M: 64)."""
    from llmpy.config import parse_descriptor
    from llmpy.kernels import flash_attention as fa
    monkeypatch.setattr(fa, "FLASH_CONFIGS", {})
    args = bench_step.parse_args(["--flash-config", '{"bwd_schedule": "split", "fwd_tma": false}'])
    bench_step.set_flash_config(args.flash_config, parse_descriptor("d12"))
    assert fa.FLASH_CONFIGS == {64: {"bwd_schedule": "split", "fwd_tma": False}}
    assert fa.flash_config(64, torch.bfloat16)["bwd_schedule"] == "split"
    bench_step.set_flash_config(None, parse_descriptor("d12"))  # no flag: nothing changes
    assert fa.FLASH_CONFIGS == {64: {"bwd_schedule": "split", "fwd_tma": False}}


def test_make_batches_fresh_shifted_and_reproducible():
    a = bench_step.make_batches(100, 2, 8, 3, seed=5)
    b = bench_step.make_batches(100, 2, 8, 3, seed=5)
    assert len(a) == 3
    for (x, y), (x2, y2) in zip(a, b):
        assert x.shape == y.shape == (2, 8) and x.dtype == torch.int64
        assert torch.equal(x, x2) and torch.equal(y, y2)
        assert torch.equal(x.reshape(-1)[1:], y.reshape(-1)[:-1])  # targets are the next tokens
        assert 0 <= int(x.min()) and int(x.max()) < 100
    assert not torch.equal(a[0][0], a[1][0])  # a fresh batch every step


def _fake_result(system, ms, loss0=10.9, ok=True, error=None):
    steps = 40
    return {"system": system, "ok": ok, "error": error, "step_ms": [60_000.0] + [ms] * (steps - 1),
            "losses": [loss0 - 0.01 * i for i in range(steps)], "norms": [1.0] * steps,
            "peak_allocated_bytes": int(30e9), "device_used_bytes": int(32e9), "time_to_first_step_s": 75.0}


def test_bench_step_figures_table_and_json(tmp_path, capsys):
    calls = []

    def runner(system, args, argv):
        calls.append(system)
        return _fake_result(system, {"torch-compile": 129.4, "llmpy": 100.0}[system],
                            loss0=10.9 if system == "llmpy" else 10.9001)

    out = tmp_path / "sub" / "step.json"
    rc = bench_step.main(["--json", str(out)], runner=runner)
    assert rc == 0 and calls == ["torch-compile", "llmpy"]
    text = capsys.readouterr().out
    assert "whole step" in text and "1.29x" in text and "41.1%" in text  # llmpy vs torch-compile; torch-compile's MFU
    assert "max |loss(llmpy) - loss(torch-compile)|" in text
    report = json.loads(out.read_text())
    assert report["settings"]["tokens_per_step"] == 65536
    assert report["settings"]["flops_per_token"] == 803_478_528
    r = report["results"]["torch-compile"]
    assert r["median_ms"] == pytest.approx(129.4) and r["median_steps"] == [11, 40]
    assert r["tokens_per_s"] == pytest.approx(65536 / 0.1294)
    assert r["mfu"] == pytest.approx(803_478_528 * 65536 / 0.1294 / 989e12)
    assert r["compile_s"] == pytest.approx(60.0 - 0.1294)
    assert len(r["step_ms"]) == len(r["losses"]) == 40


def test_bench_step_reports_a_failed_system(capsys):
    def runner(system, args, argv):
        if system == "llmpy":
            return {"system": system, "ok": False, "error": "ModuleNotFoundError: no llmpy.model",
                    "step_ms": [], "losses": [], "norms": []}
        return _fake_result(system, 129.4)

    rc = bench_step.main([], runner=runner)
    text = capsys.readouterr().out
    assert rc == 1
    assert "FAILED (ModuleNotFoundError" in text and "torch-compile" in text


def test_bench_step_torch_eager_runs_on_cpu(tmp_path):
    """The child's whole path (init, data, build, steps, result file) on a tiny model, in this process."""
    result = tmp_path / "r.json"
    args = bench_step.parse_args(["--model", TINY_DESC, "--B", "2", "--T", "16", "--steps", "3",
                                  "--warmup-median-from", "2", "--device", "cpu", "--print-steps", "0",
                                  "--result-file", str(result)])
    res = bench_step.run_system(args, "torch-eager")
    assert res["ok"], res.get("traceback")
    assert json.loads(result.read_text())["losses"] == res["losses"]
    assert len(res["losses"]) == 3 and all(math.isfinite(v) for v in res["losses"])
    # same init and data as the reference: step 1's loss is the reference's forward loss
    x, y = bench_step.make_batches(TINY.vocab_size, 2, 16, 1, seed=args.data_seed)[0]
    ref = GPT2Reference(TINY, init_parameters(TINY, args.seed))
    assert res["losses"][0] == pytest.approx(ref.forward(x, y), rel=1e-5)
    bench_step.summarize(res, args)
    assert res["median_steps"] == [2, 3] and res["tokens_per_s"] > 0
