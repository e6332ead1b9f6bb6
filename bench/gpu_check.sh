#!/usr/bin/env bash
# One device call that checks and measures the kernel layer: the kernel tests on the GPU (CPU-sized and
# GPT-2 124M-sized), the per-kernel benchmark, and a compute-sanitizer memcheck over every kernel.
# Logs land in $OUT. Usage: bash bench/gpu_check.sh [tests] [bench] [model] [suite] [rest] [step] [train] [parity] [profile] [gemm] [flash] [flash-bwd] [ab] [options-tests] [options-ab] [overlap-tests] [overlap-ab] [blas] [lt] [search] [dgelu-ab] [classifier-l2] [bias-column] [ablate] [energy] [bias] [dist] [sanitize]
# (model: test_gpt2 on the GPU; suite: resume/HellaSwag/CLI/API tests on the GPU; rest: every other test file; step: the whole-step benchmark against the torch.compile baseline)
set -o pipefail
# .vendor: the cuDNN frontend wheel unpacked for the device (carried; see bench/RESULTS.md run P)
export PYTHONUNBUFFERED=1 PYTHONPATH=src:.:.vendor NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/llmpy_out}
mkdir -p "$OUT"
stages=${*:-tests bench sanitize}
KERNEL_TESTS=${KERNEL_TESTS:-"tests/test_encoder.py tests/test_layernorm.py tests/test_attention.py tests/test_flash_attention.py tests/test_flash_backward_wgmma.py
  tests/test_matmul.py tests/test_cublaslt.py tests/test_gelu.py tests/test_fused_classifier.py tests/test_adamw.py tests/test_global_norm.py"}
SUITE_TESTS="tests/test_resume.py tests/test_hellaswag.py tests/test_cli.py tests/test_api.py"
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv | tee "$OUT/gpu.txt"
git log --oneline -1 2>/dev/null | tee -a "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
summary=(); worst=0
for stage in $stages; do
  t0=$(date +%s)
  case $stage in
    tests)
      timeout ${TESTS_TIMEOUT:-300} python3 -m pytest -q -rfEx -p no:cacheprovider $KERNEL_TESTS 2>&1 | tee "$OUT/tests.log"
      rc=$? ;;
    bench)
      timeout ${BENCH_TIMEOUT:-420} python3 -m bench.bench_kernels ${BENCH_ARGS:-} --json "$OUT/kernels.json" 2>&1 | tee "$OUT/bench.log"
      rc=$? ;;
    model)
      timeout ${MODEL_TIMEOUT:-300} python3 -m pytest -q -rfEx -p no:cacheprovider tests/test_gpt2.py ${MODEL_K:+-k "$MODEL_K"} \
        2>&1 | tee "$OUT/model.log"
      rc=$? ;;
    suite)
      # the trainer-level tests (resume, HellaSwag, CLI, API) where `llmpy train` picks the GPU (2026-12-07 on an
      # H100: 330 s ran three quarters of them; each CLI test's run compiles its kernels anew)
      timeout ${SUITE_TIMEOUT:-560} python3 -m pytest -q -rfEx -p no:cacheprovider $SUITE_TESTS 2>&1 \
        | tee "$OUT/suite.log"
      rc=$? ;;
    rest)
      # every other test file (data, checkpoints, tokenizer, schedules, benches' helpers, ...): with tests, model
      # and suite, the README's whole test command on a GPU machine, in parts that fit a call
      staged=" $(echo $KERNEL_TESTS tests/test_gpt2.py $SUITE_TESTS) "  # echo: one space between names
      rest=(); for f in tests/test_*.py; do [[ $staged == *" $f "* ]] || rest+=("$f"); done
      timeout ${REST_TIMEOUT:-480} python3 -m pytest -q -rfEx -p no:cacheprovider "${rest[@]}" 2>&1 \
        | tee "$OUT/rest.log"
      rc=$? ;;
    step)
      timeout ${STEP_TIMEOUT:-480} python3 -m bench.bench_step ${STEP_ARGS:-} --json "$OUT/step.json" 2>&1 | tee "$OUT/step.log"
      rc=$? ;;
    train)
      # the main job on the GPU: `llmpy train` with the embedded default (GPT-2 124M on the stdlib corpus)
      timeout ${TRAIN_TIMEOUT:-240} python3 -m llmpy train ${TRAIN_ARGS:--x 60 -v 20 -g 64} 2>&1 | tee "$OUT/train.log"
      rc=$? ;;
    parity)
      # needs tinyshakespeare shards in .parity_data (carried): see bench/parity.py
      timeout ${PARITY_TIMEOUT:-300} python3 -m bench.parity --data .parity_data ${PARITY_ARGS:-} --json "$OUT/parity.json" \
        --png "$OUT/parity.png" 2>&1 | tee "$OUT/parity.log"
      rc=$? ;;
    profile)
      timeout ${PROFILE_TIMEOUT:-300} python3 -m bench.profile_step ${PROFILE_ARGS:-} --json "$OUT/profile.json" \
        --md "$OUT/profile.md" 2>&1 | tee "$OUT/profile.log"
      rc=$? ;;
    gemm)
      # the Triton GEMM (pointer and TMA kernels) with the GELU epilogues against cuBLAS + a GELU pass
      timeout ${GEMM_TIMEOUT:-300} python3 -m bench.kernels.sweep_gemm --budget-s ${GEMM_BUDGET:-220} \
        --json "$OUT/gemm.json" 2>&1 | tee "$OUT/gemm.log"
      rc=$? ;;
    flash)
      # the flash attention tile sweeps (forward and the backward schedules) against SDPA's flash and cuDNN
      timeout ${FLASH_TIMEOUT:-300} python3 -m bench.kernels.bench_flash_attention ${FLASH_ARGS:---hs 64} \
        --best-json "$OUT/flash_best.json" 2>&1 | tee "$OUT/flash.log"
      rc=$? ;;
    flash-bwd)
      # the flash backward's kernels (tl.dot, Gluon wgmma) alternated at the power cap, with a bitwise check
      timeout ${FLASH_BWD_TIMEOUT:-300} python3 -m bench.kernels.bench_flash_backward ${FLASH_BWD_ARGS:-} \
        --json "$OUT/flash_bwd.json" 2>&1 | tee "$OUT/flash_bwd.log"
      rc=$? ;;
    ab)
      # whole-step A/B, alternated round by round: by default the flash sweep's best tiles (stage flash,
      # earlier in the same call) against the defaults; AB_ARGS gives other variants
      timeout ${AB_TIMEOUT:-480} python3 -m bench.ab_step ${AB_ARGS:---from-best $OUT/flash_best.json} \
        --rounds ${AB_ROUNDS:-2} --json "$OUT/ab.json" -- --recompute 0 2>&1 | tee "$OUT/ab.log"
      rc=$? ;;
    options-tests)
      # the GPU tests of the two pass-moving model options (residual_in_product, proj_bias_in_layernorm)
      timeout ${OPTIONS_TESTS_TIMEOUT:-300} python3 -m pytest -q -rfEx -p no:cacheprovider tests/test_cublaslt.py \
        tests/test_layernorm.py tests/test_gpt2.py -k "residual or proj" 2>&1 | tee "$OUT/options_tests.log"
      rc=$? ;;
    options-ab)
      # whole-step A/B of those options against the default (proj_bias_in_layernorm on since run N; 3 variants x
      # AB_ROUNDS runs of ~50 s)
      timeout ${AB_TIMEOUT:-480} python3 -m bench.ab_step --variant default= --variant "projln-off=--proj-bias-in-ln off" \
        --variant "resid=--residual-in-product" --rounds ${AB_ROUNDS:-2} --json "$OUT/ab.json" -- --recompute 0 \
        2>&1 | tee "$OUT/ab.log"
      rc=$? ;;
    overlap-tests)
      # the backward's weight gradients on a second stream (overlap_weight_grads): bitwise against one stream
      timeout ${OVERLAP_TESTS_TIMEOUT:-300} python3 -m pytest -q -rfEx -p no:cacheprovider tests/test_streams.py \
        tests/test_gpt2.py -k "overlap or spans or plans" 2>&1 | tee "$OUT/overlap_tests.log"
      rc=$? ;;
    overlap-ab)
      # whole-step A/B of overlap_weight_grads off (the default) / on / priority (3 variants x AB_ROUNDS runs)
      timeout ${AB_TIMEOUT:-480} python3 -m bench.ab_step --variant default= --variant "overlap=--overlap-weight-grads on" \
        --variant "priority=--overlap-weight-grads priority" --rounds ${AB_ROUNDS:-2} --json "$OUT/ab.json" -- \
        --recompute 0 2>&1 | tee "$OUT/ab.log"
      rc=$? ;;
    blas)
      # every matrix product of a step under cuBLAS settings, each setting in its own process
      timeout ${BLAS_TIMEOUT:-300} python3 -m bench.kernels.bench_blas ${BLAS_ARGS:-} --json "$OUT/blas.json" 2>&1 | tee "$OUT/blas.log"
      rc=$? ;;
    lt)
      # every product of a step: torch's cuBLAS against cuBLASLt's ranked algorithms and its GELU / bias
      # epilogues (what kernels.matmul.TUNED_ALGOS is read from)
      timeout ${LT_TIMEOUT:-200} python3 -m bench.kernels.bench_cublaslt ${LT_ARGS:-} --json "$OUT/lt.json" 2>&1 | tee "$OUT/lt.log"
      rc=$? ;;
    dgelu-ab)
      # fcproj's DGELU product at cuBLASLt ranks 2 and 3 (DGELU_RANKS) against the table's rank 0, alone:
      # each variant's table is TUNED_ALGOS plus that one entry (bench_step --tuned-from replaces the table)
      for r in ${DGELU_RANKS:-2 3}; do
        python3 -c "import json, sys; from llmpy.kernels.matmul import TUNED_ALGOS as t
from bench.kernels.search_cublaslt import suggested_table
e = suggested_table([{'suggested': {'key': ['dinp_dgelu', 65536, 768, 3072], 'rank': int(sys.argv[1])}}], t, (9, 0))
json.dump({'capability': [9, 0], 'tuned': e}, open(sys.argv[2], 'w'))" "$r" "$OUT/dgelu$r.json"
      done
      variants=(--variant default=)
      for r in ${DGELU_RANKS:-2 3}; do variants+=(--variant "dg$r=--tuned-from=$OUT/dgelu$r.json"); done
      timeout ${AB_TIMEOUT:-480} python3 -m bench.ab_step "${variants[@]}" --rounds ${AB_ROUNDS:-2} \
        --json "$OUT/ab.json" -- --recompute 0 2>&1 | tee "$OUT/ab.log"
      rc=$? ;;
    search)
      # every configuration cuBLASLt runs, per product of the step (SEARCH_PRODUCTS), then the whole step with
      # the suggested table against today's (bench/RESULTS.md run AC); SEARCH_ARGS="--split-k 2 3 4 6 8" searches
      # the split-K configurations instead where the inner dimension is deep enough (run AJ); SEARCH_B=16 the
      # products of the step at B = 16 (and the A/B at that B); SEARCH_AB=0 the search alone;
      # SEARCH_ARGS="--graph-calls 20" times the candidates inside CUDA graphs, as the step runs them (run AP)
      timeout ${SEARCH_TIMEOUT:-420} python3 -m bench.kernels.search_cublaslt --products ${SEARCH_PRODUCTS:-qkv_fwd \
        fcproj_fwd attproj_fwd lm_head_fwd qkv_dinp fc_dinp attproj_dinp lm_head_dinp qkv_dweight attproj_dweight \
        fcproj_dweight lm_head_dweight} --top 4 --rounds 2 --budget-s ${SEARCH_BUDGET:-20} --B ${SEARCH_B:-64} \
        ${SEARCH_ARGS:-} --json "$OUT/search.json" \
        2>&1 | tee "$OUT/search.log" | grep -v "^  algo"
      rc=$?
      if [ $rc -eq 0 ] && [ "${SEARCH_AB:-1}" != 0 ]; then
        timeout ${AB_TIMEOUT:-480} python3 -m bench.ab_step --variant default= \
          --variant "searched=--tuned-from=$OUT/search.json" --rounds ${AB_ROUNDS:-2} --json "$OUT/ab.json" \
          -- --recompute 0 --B ${SEARCH_B:-64} 2>&1 | tee "$OUT/ab.log"
        rc=$?
      fi ;;
    classifier-l2)
      # the classifier section with the lm_head forward and the classifier in sub-chunks small enough for L2
      timeout ${L2_TIMEOUT:-200} python3 -m bench.kernels.bench_classifier_l2 ${L2_ARGS:-} --json "$OUT/l2.json" 2>&1 | tee "$OUT/l2.log"
      rc=$? ;;
    bias-column)
      # fc's weight-gradient product widened by the bias column against the product + the bias reduction
      timeout ${BIAS_COLUMN_TIMEOUT:-200} python3 -m bench.kernels.bench_bias_column ${BIAS_COLUMN_ARGS:-} \
        --json "$OUT/bias_column.json" 2>&1 | tee "$OUT/bias_column.log"
      rc=$? ;;
    ablate)
      # the graphed step timed with groups of kernels left out: what each group costs at the power cap
      timeout ${ABLATE_TIMEOUT:-300} python3 -m bench.ablate_step ${ABLATE_ARGS:-} --json "$OUT/ablate.json" 2>&1 | tee "$OUT/ablate.log"
      rc=$? ;;
    energy)
      # passes alone and beside a product, by NVML's energy counter: the memory-bound passes by grid size, or
      # with ENERGY_ARGS=--flash / --classifier the flash backward's tilings / the classifier's variants
      timeout ${ENERGY_TIMEOUT:-300} python3 -m bench.kernels.bench_energy ${ENERGY_ARGS:-} --json "$OUT/energy.json" \
        2>&1 | tee "$OUT/energy.log"
      rc=$? ;;
    bias)
      timeout ${BIAS_TIMEOUT:-240} python3 -m bench.kernels.sweep_bias ${BIAS_ARGS:-} --json "$OUT/bias.json" 2>&1 | tee "$OUT/bias.log"
      rc=$? ;;
    dist)
      # data-parallel scaling and bit-exactness over NCCL (needs the nvidia-h200-x2 kind). `timeout` stops
      # only its own child: torchrun's workers left behind would share the GPUs with what runs next.
      reap() { pkill -f "torch.distributed.run" ; pkill -f "bench.bench_dist --worker"; pkill -f "llmpy train"; true; }
      timeout ${DIST_TIMEOUT:-420} python3 -m bench.bench_dist --nproc ${DIST_NPROC:-2} ${DIST_ARGS:-} \
        --json "$OUT/dist.json" 2>&1 | tee "$OUT/dist.log"
      rc=$?; reap
      if [ "${DIST_TESTS:-1}" != 0 ]; then  # DIST_TESTS=0: the benchmark alone
        timeout ${DIST_TESTS_TIMEOUT:-360} python3 -m pytest -q -rfEx -p no:cacheprovider tests/test_distributed.py \
          2>&1 | tee "$OUT/dist_tests.log"
        rc=$(( rc || $? )); reap
      fi ;;
    sanitize)
      # the CPU-sized tests exercise every kernel (and its masks) at small shapes; memcheck reports any
      # out-of-bounds or misaligned access. One sanitizer process per test file, SANITIZE_JOBS at a time (memcheck is
      # slow and mostly host-bound; fifteen at once ran an H100 out of memory); logs in $OUT/sanitize_<name>.log.
      # Kernels the GPU runs only at model sizes (Gluon flash backward, cuDNN attention, TMA classifier, cuBLASLt)
      # are checked through their "gpu" tests, SANITIZE_GPU_TESTS entries "file[::-k expression]", after the small
      # files and SANITIZE_GPU_JOBS (1) at a time: one takes ~50 GB under memcheck.
      # SANITIZE_BACKTRACE=device: compute-sanitizer 2025.3's host backtrace keeps every Triton launch's Python frame,
      # and so each test's tensors, alive (run BD); set it to yes to rerun a failing file with host backtraces.
      logs=()
      memcheck() {  # job limit, log, marker, -k expression, test file
        local limit=$1; shift
        while [ "$(jobs -rp | wc -l)" -ge "$limit" ]; do wait -n; done
        (timeout ${SANITIZE_TIMEOUT:-420} compute-sanitizer --tool memcheck --error-exitcode 99 --print-limit 20 \
          --show-backtrace "${SANITIZE_BACKTRACE:-device}" \
          python3 -m pytest -q -p no:cacheprovider -m "$2" ${3:+-k "$3"} "$4" > "$1" 2>&1; echo $? > "$1.rc") &
        logs+=("$1")
      }
      for f in $KERNEL_TESTS; do
        memcheck "${SANITIZE_JOBS:-6}" "$OUT/sanitize_$(basename "$f" .py).log" "not gpu" "${SANITIZE_K:-}" "$f"
      done
      wait
      for entry in ${SANITIZE_GPU_TESTS-tests/test_flash_backward_wgmma.py tests/test_attention.py::cudnn
                     tests/test_fused_classifier.py tests/test_cublaslt.py}; do
        f=${entry%%::*}; k=; [ "$f" != "$entry" ] && k=${entry#*::}
        memcheck "${SANITIZE_GPU_JOBS:-1}" "$OUT/sanitize_gpu_$(basename "$f" .py).log" gpu "$k" "$f"
      done
      wait
      rc=0
      for log in "${logs[@]}"; do  # not piped: rc must outlive the loop
        r=$(cat "$log.rc" 2>/dev/null || echo 1); rm -f "$log.rc"; [ "$r" -ne 0 ] && rc=$r
        counts=$(grep -E "[0-9]+ (passed|failed)" "$log" | tail -1)
        echo "$(basename "$log" .log): $(grep -E "ERROR SUMMARY" "$log" | tail -1) | $counts"
        # a clean file's log says no more than its line here; the device returns at most 8 files from $OUT
        [ "$r" -eq 0 ] && rm -f "$log"
      done > "$OUT/sanitize.log"
      cat "$OUT/sanitize.log" ;;
    *)
      echo "unknown stage: $stage (see the usage line at the top of bench/gpu_check.sh)" >&2
      rc=2 ;;
  esac
  summary+=("$stage rc=$rc $(( $(date +%s) - t0 ))s")
  [ "$rc" -ne 0 ] && worst=$rc
done
echo "=== summary"; printf '%s\n' "${summary[@]}"
grep -E "passed|failed" "$OUT/tests.log" "$OUT/model.log" "$OUT/suite.log" 2>/dev/null | tail -3
grep -E "ERROR SUMMARY" "$OUT/sanitize.log" 2>/dev/null | tail -1
exit "$worst"  # a failed stage's status, not that of the greps above (2 where a stage's log is absent)
