"""Turn bench_kernels' JSON into the markdown table of bench/RESULTS.md.

    python -m bench.results_table kernels.json [--skip-sweeps]
"""
import argparse
import json


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.results_table", description=__doc__.split("\n")[0])
    ap.add_argument("path", help="bench_kernels' --json file")
    ap.add_argument("--skip-sweeps", action="store_true", help="leave out the rows of the block-size sweeps")
    args = ap.parse_args(argv)
    path, skip_sweeps = args.path, args.skip_sweeps
    with open(path) as f:
        d = json.load(f)
    copy = d["copy_gbs"]
    print(f"Copy bandwidth measured in the same run: {copy:.0f} GB/s ({d['device']}).\n")
    print("| kernel | MB moved | ms | GB/s | % of copy | PyTorch baseline | ms | torch.compile ms | note |")
    print("| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | --- |")
    for r in d["rows"]:
        if skip_sweeps and (r["kernel"].startswith("sweep") or r["kernel"].startswith("  ") or "BLOCK=" in r["kernel"]
                            or "block=" in r["kernel"]):
            continue
        ms = r.get("ms")
        gbs = r["bytes"] / (ms * 1e-3) / 1e9 if ms and r["bytes"] else None
        fmt = lambda x, f: (f.format(x) if x else "-")
        print(f"| {r['kernel'].strip()} | {r['bytes'] / 1e6:.0f} | {fmt(ms, '{:.3f}')} | {fmt(gbs, '{:.0f}')} | "
              f"{fmt(gbs and 100 * gbs / copy, '{:.0f}')} | {r.get('baseline', '')} | "
              f"{fmt(r.get('baseline_ms'), '{:.3f}')} | {fmt(r.get('compiled_ms'), '{:.3f}')} | "
              f"{str(r.get('note', '')).replace('|', '/')[:90]} |")


if __name__ == "__main__":
    main()
