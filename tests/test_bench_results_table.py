"""bench/results_table.py on a made-up bench_kernels JSON (the measurements need a GPU)."""
import json
import random
import sys

import pytest

from bench import results_table


def _kernels_json(tmp_path):
    rng = random.Random(2)
    rows = [{"kernel": "layernorm_forward", "bytes": 201_850_880, "ms": 0.08 + 0.01 * rng.random(),
             "baseline": "F.layer_norm", "baseline_ms": 0.137, "compiled_ms": 0.054, "note": "a | b"},
            {"kernel": "sweep BLOCK=1024", "bytes": 1000, "ms": 0.5, "baseline": "", "baseline_ms": None,
             "compiled_ms": None, "note": ""}]
    path = tmp_path / "kernels.json"
    path.write_text(json.dumps({"copy_gbs": 4200.0 + rng.random(), "device": "NVIDIA H200", "rows": rows}))
    return path, rows


def test_the_flag_may_come_before_the_file(tmp_path, monkeypatch, capsys):
    path, rows = _kernels_json(tmp_path)
    monkeypatch.setattr(sys, "argv", ["results_table", "--skip-sweeps", str(path)])
    results_table.main()
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert len(lines) == 2 + 1  # header, rule, the one row that is not a sweep
    gbs = rows[0]["bytes"] / (rows[0]["ms"] * 1e-3) / 1e9
    assert lines[2].startswith(f"| layernorm_forward | 202 | {rows[0]['ms']:.3f} | {gbs:.0f} | ")
    assert lines[2].endswith("| a / b |")


def test_no_file_is_one_usage_line(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["results_table"])
    with pytest.raises(SystemExit) as e:
        results_table.main()
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err and "the following arguments are required" in err
