"""bench/bench_plot.py and bench/bench_prepare.py's arguments (bench/host_commands.py): a run of no rounds would
measure nothing and still report (bench_prepare: "byte-identical across the trees: True" over no shards)."""
import random

import pytest

from bench import bench_plot, bench_prepare


@pytest.mark.parametrize("main,argv,message", [
    (bench_prepare.main, ["--rounds", "0"], "--rounds: 0 is not a positive integer"),
    (bench_plot.main, ["--rounds", "-1"], "--rounds: -1 is not a positive integer"),
    (bench_plot.main, ["--steps", "0"], "--steps: 0 is not a positive integer"),
])
def test_no_rounds_or_no_steps_is_one_usage_line(tmp_path, capsys, main, argv, message):
    corpus = tmp_path / "corpus.txt"
    rng = random.Random(4)
    corpus.write_text("".join(rng.choice("abc de\n") for _ in range(2000)))
    extra = ["--mb", "1", "--corpus", str(corpus)] if main is bench_prepare.main else ["--steps", "20"]
    with pytest.raises(SystemExit) as e:
        main(extra + argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1].endswith(message)
