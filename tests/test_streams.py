"""llmpy.streams: the two-lane backward's waits, against a brute-force happens-before check.

The scheduler decides, for each call, which of the other lane's calls it must wait for. The oracle here
does not reuse that logic: it takes the plan the scheduler logged and, for EVERY pair of calls on
different lanes whose memory conflicts, checks that the earlier one happens before the later one (two
lanes: a call knows the other lane up to the largest index any call of its own lane, itself included, has
waited for). Then the model: a tiny GPT-2's backward with overlap_weight_grads on gives bitwise the
gradients of the one-stream backward, every call declares all the memory it writes (each call's writes
are observed by snapshots of every buffer the model owns), the plan passes the oracle, and the weight
gradients are on the side lane. CPU: the calls run in program order, so this checks the plan, not a GPU
race; tests/test_gpt2.py runs the overlap on the GPU.
"""
import random

import pytest
import torch

from llmpy.config import GPT2Config
from llmpy.errors import LlmpyError
from llmpy.init import init_parameters
from llmpy.model import GPT2Model
from llmpy.streams import OVERLAP_MODES, Lanes, conflicts, spans


def test_spans_and_conflicts():
    buf = torch.empty(100, dtype=torch.float32)
    a, b, c = buf[:10], buf[10:20], buf[5:15]
    assert spans([a]) == [(a.data_ptr(), a.data_ptr() + 40)]
    assert spans([None, buf[:0]]) == []
    # adjacent slices do not conflict, overlapping ones do; reads never conflict with reads
    assert not conflicts(spans([a]), spans([a]), spans([b]), spans([b]))
    assert conflicts([], spans([a]), spans([c]), [])      # write after read
    assert conflicts(spans([c]), [], [], spans([a]))      # read after write
    assert conflicts([], spans([b]), [], spans([c]))      # write after write
    assert not conflicts(spans([a, c]), [], spans([buf]), [])
    # a strided view spans first to last element
    m = buf.view(10, 10)[:, 2]
    assert spans([m]) == [(buf.data_ptr() + 8, buf.data_ptr() + 8 + (9 * 10 + 1) * 4)]


def check_plan(log):
    """Every conflicting pair of calls on different lanes is ordered in the logged plan (the oracle)."""
    known = {"main": -1, "side": -1}  # per lane: the other lane's last call known to have finished
    calls = []  # (lane, index, what this call knows of the other lane, reads, writes)
    for lane, name, index, wait_for, reads, writes in log:
        if wait_for is not None:
            known[lane] = max(known[lane], wait_for)
        if name == "wait_side":
            continue
        calls.append((lane, index, known[lane], reads, writes))
    n_conflicts = 0
    for j, (lane_b, _, knows_b, reads_b, writes_b) in enumerate(calls):
        for lane_a, index_a, _, reads_a, writes_a in calls[:j]:
            if lane_a != lane_b and conflicts(reads_a, writes_a, reads_b, writes_b):
                n_conflicts += 1
                assert knows_b >= index_a, f"{lane_a} call {index_a} may still run when {lane_b}'s starts"
    return n_conflicts


def random_plan(seed, calls=60):
    rng = random.Random(seed)
    buf = torch.empty(64, dtype=torch.float32)
    lanes = Lanes(torch.device("cpu"), "on")
    lanes.begin()

    def some():
        out = []
        for _ in range(rng.randrange(3)):
            lo = rng.randrange(64)
            out.append(buf[lo:lo + rng.randrange(1, 9)])
        return out

    for i in range(calls):
        if rng.random() < 0.05:
            lanes.wait_side()
        lanes.run(rng.choice(("main", "side")), lambda: None, some(), some(), name=f"call {i}")
    lanes.end()
    return lanes.log


@pytest.mark.parametrize("seed", range(20))
def test_random_plans_are_ordered(seed):
    log = random_plan(seed)
    assert check_plan(log) > 0  # (the plans do have conflicts to order)


def test_oracle_catches_a_missing_wait():
    """The oracle is not vacuous: drop one wait from a plan and it fails."""
    for seed in range(20):
        log = random_plan(seed)
        waits = [i for i, e in enumerate(log) if e[3] is not None and e[1] != "wait_side"]
        for i in waits:
            broken = list(log)
            lane, name, index, _, r, w = broken[i]
            broken[i] = (lane, name, index, None, r, w)
            try:
                check_plan(broken)
            except AssertionError:
                return
    pytest.fail("no dropped wait was caught")


def test_independent_calls_do_not_wait():
    buf = torch.empty(40)
    lanes = Lanes(torch.device("cpu"), "on")
    lanes.begin()
    lanes.run("main", lambda: None, [buf[:8]], [buf[8:16]])
    lanes.run("side", lambda: None, [buf[:8]], [buf[16:24]])    # reads what main reads: no wait
    lanes.run("side", lambda: None, [buf[8:16]], [buf[24:32]])  # reads what main wrote: waits for it
    lanes.run("main", lambda: None, [], [buf[32:36]])           # touches nothing side touches: no wait
    lanes.run("main", lambda: None, [], [buf[20:22]])           # overwrites side's first output
    lanes.end()
    assert [e[3] for e in lanes.log] == [None, None, 0, None, 0]


def test_off_is_a_plain_call():
    lanes = Lanes(torch.device("cpu"), "off")
    lanes.begin()
    assert lanes.run("side", lambda: 7, [torch.empty(2)], []) == 7
    assert lanes.log == []
    with pytest.raises(ValueError, match="overlap"):
        Lanes(torch.device("cpu"), "sideways")


# ----------------------------------------------------------------------------------------------------
# the model

SMALL = GPT2Config(max_seq_len=32, vocab_size=128, num_layers=2, num_heads=2, channels=32)
B, T = 2, 16


def _owned_buffers(model):
    """Every device buffer the backward may write (arenas, gradients, encoder scratch)."""
    out = list(model.acts.buffers) + [model.grads_memory]
    out += [t for t in vars(model._enc_scratch).values() if isinstance(t, torch.Tensor)]
    return out


def _observe_writes(model, monkeypatch):
    """Wrap Lanes.run: each call's changed bytes must lie inside the writes it declared."""
    undeclared = []
    original = Lanes.run

    def run(self, lane, fn, reads=(), writes=(), name=""):
        bufs = _owned_buffers(model)
        before = [b.view(-1).view(torch.uint8).clone() for b in bufs]

        def observed():
            out = fn()
            declared = spans(writes)
            for b, old in zip(bufs, before):
                now = b.view(-1).view(torch.uint8)
                changed = (now != old).nonzero().flatten()
                for off in changed.tolist():
                    addr = b.data_ptr() + off
                    if not any(s <= addr < e for s, e in declared):
                        undeclared.append((name, lane))
                        break
            return out

        return original(self, lane, observed, reads, writes, name)

    monkeypatch.setattr(Lanes, "run", run)
    return undeclared


@pytest.mark.parametrize("kw", [dict(), dict(recompute=0, gelu_fusion=2), dict(recompute=2, attention="classic"),
                                dict(proj_bias_in_layernorm=False, dtype=torch.float32, classifier_chunks=1)],
                         ids=["default", "r0-ge2", "r2-classic", "proj-pass-fp32-unchunked"])
def test_model_overlap_plan(kw, monkeypatch, device):
    if device != "cpu":
        pytest.skip("the plan on the CPU; the GPU run is in tests/test_gpt2.py")
    params = init_parameters(SMALL, seed=42)
    g = torch.Generator().manual_seed(7)
    x = torch.randint(0, SMALL.vocab_size, (B, T), generator=g)
    y = torch.randint(0, SMALL.vocab_size, (B, T), generator=g)
    kw.setdefault("attention", "flash")
    grads = {}
    for mode in ("off", "on"):
        model = GPT2Model(SMALL, params, B, T, device="cpu", overlap_weight_grads=mode, **kw)
        undeclared = _observe_writes(model, monkeypatch) if mode == "on" else []
        model.zero_grad()
        model.forward(x, y, dloss=1.0 / (B * T))
        model.backward()
        monkeypatch.undo()
        grads[mode] = model.gradients_fp32()
        if mode == "on":
            assert undeclared == [], f"calls that write memory they do not declare: {sorted(set(undeclared))}"
            log = model._lanes.log
            assert check_plan(log) > 0
            side = {name for lane, name, *_ in log if lane == "side"}
            # (at -ge 2 fc's weight and bias gradients come from one product: fc_bias_in_product)
            assert side == {"matmul_backward dweight", "qkv bias"} | (
                {"weight_grad_bias_column"} if model.fc_bias_in_product else set())
            n_side = sum(lane == "side" for lane, *_ in log)
            assert n_side == 5 * SMALL.num_layers + (model.classifier_chunks == 1)
    assert torch.equal(grads["on"], grads["off"])
    assert grads["on"].abs().sum() > 0


def test_model_rejects_a_bad_mode():
    params = init_parameters(SMALL, seed=42)
    with pytest.raises(LlmpyError, match="overlap_weight_grads"):
        GPT2Model(SMALL, params, B, T, device="cpu", overlap_weight_grads="sideways")
    assert OVERLAP_MODES == ("off", "on", "priority")
