#!/usr/bin/env bash
# Measures what the speed issues track on the GPU machine, writing everything under $OUT. A device
# call may run 10 minutes, so the work comes in parts, each well inside that:
#   bash benchmarks/gpu_session.sh first [GPUS]   GPU tests, t1 on each GPU count (rank 0 profiled),
#                                                 t1 on 2 GPUs without sharding (DDP) when GPUS has 2
#   bash benchmarks/gpu_session.sh decode         the rollout targets: decode profiler, 0.5B and 1.5B
#   bash benchmarks/gpu_session.sh attention      the decode attention's tilings and splits (attention_sweep.py)
#   bash benchmarks/gpu_session.sh gemm           the decode GEMMs: cuBLAS against Triton tilings (gemm_sweep.py)
#   bash benchmarks/gpu_session.sh workloads [W]  w1,w2,w3 (or W) on one GPU
#   bash benchmarks/gpu_session.sh lora           the LoRA and 7B workloads on one GPU
#   bash benchmarks/gpu_session.sh large          w32: LoRA on Qwen2.5-32B shapes
#   bash benchmarks/gpu_session.sh multi          m1: multi-turn, 4 turns of 128 tokens; w4: variable lengths
#   bash benchmarks/gpu_session.sh levers         t1 as the bench runs it (profiled: GPU busy per phase), then
#                                                 on-policy (one mini-batch) and in rollout correction's bypass mode
#   bash benchmarks/gpu_session.sh families [W]   issue 29: the native engine's GPU tests for every family, then
#                                                 t1's work on each family's shapes (q1,e1,l1,t1 or W)
#   bash benchmarks/gpu_session.sh large_families [W]  issue 29: GPT-OSS-20B, Qwen3-30B-A3B and Qwen3-8B with
#                                                 LoRA (o20l,e30l,q8l or W)
#   bash benchmarks/gpu_session.sh agents         issue 30: m1 through keel's agent loop, then m1a: the same episodes
#                                                 by an OpenAI-client agent through keel's endpoint (carry the
#                                                 wheels: starlette uvicorn openai pydantic pydantic-core
#                                                 annotated-types typing-inspection distro jiter sniffio httpx2
#                                                 httpcore2 truststore typing-extensions idna anyio h11 httpx
#                                                 httpcore certifi aiohttp multidict yarl propcache frozenlist
#                                                 aiosignal aiohappyeyeballs attrs httptools uvloop)
#   bash benchmarks/gpu_session.sh async_mode     issue 31: s1 (slow rewards), w2 and m1 in sync then async mode
#   bash benchmarks/gpu_session.sh partial        issue 31: v2 (EOS-ended lengths) sync, async, async with partial
#                                                 rollouts (wait, drop); then s1 sync and async profiled (GPU busy)
#   bash benchmarks/gpu_session.sh scoring        issue 31: the GPU tests, then sv (slow rewards, EOS-ended lengths) in
#                                                 sync mode scoring each batch whole, then each sample as it finishes
#   bash benchmarks/gpu_session.sh fifo           issue 31: v2 sync, then async with partial rollouts (wait: first
#                                                 in, first out), then sv async with partial rollouts
#   bash benchmarks/gpu_session.sh design BASE [N]  issue 46: the GPU tests (SKIP_TESTS=1: none), then t1 at BASE (a
#                                                 folder holding keel/ of an earlier commit, e.g. git archive into
#                                                 .whl/baseline, carried) and at this tree, alternating, N rounds
#   bash benchmarks/gpu_session.sh dpo            issue 47: the preference and Phi-3 GPU tests, then d1 (DPO, 0.5B shapes)
#                                                 beside TRL's DPOTrainer (--trl; carry .whl with trl, datasets, dill,
#                                                 multiprocess), then d1 with a reference pass each step as TRL's
#   bash benchmarks/gpu_session.sh distill        issue 48: the distillation GPU tests and the README's quick-start on the
#                                                 GPU (SKIP_TESTS=1: none), then o1 (1.5B shapes teaching 0.5B at t1's
#                                                 batch) in each mode with a bf16 and a float8 teacher (O1_RUNS: mode:dtype)
#   bash benchmarks/gpu_session.sh quickstart     issue 48: the quick-start's GRPO for 3 steps as it is and with one
#                                                 part swapped each time (QUICK_VARIANTS: "name overrides" lines)
#   bash benchmarks/gpu_session.sh speed          issue 50: the async GPU test, s1 sync then async (SPEED_PART=s1);
#                                                 t1 profiled, t1 with cuDNN's attention allowed, q1 with its KV cache
#                                                 freed and kept (SPEED_PART=t1); the invariant and async tests, t1
#                                                 profiled, t1 with each lever of benchmarks/levers.py (LEVERS), q1
#                                                 kept and freed, t1 invariant in bypass mode (SPEED_PART=levers)
#   bash benchmarks/gpu_session.sh exact          issue 50: the batch-invariant and async GPU tests, s1 sync and async,
#                                                 t1 and t1 batch-invariant
#   bash benchmarks/gpu_session.sh invariant      issue 50: the batch-invariant GPU tests (ALL_TESTS=1: all of tests/gpu),
#                                                 t1, t1 invariant in bypass mode (profiled), t1 invariant with its pass,
#                                                 then the workloads in INVARIANT_MORE (e.g. q1)
#   bash benchmarks/gpu_session.sh prefix         issue 50: the decode attention's GPU tests (PREFIX_TESTS: -k), then q1 and t1 with each
#                                                 prompt's copies read in each row's own cache (noshare) and in one row,
#                                                 in turn; the kernel alone (attention_sweep.py --shared 1, 8). PREFIX_RUNS:
#                                                 other runs, a line each, in place of those ("- q1 --profile DIR": plain;
#                                                 "noshare t1": a lever; "sweep 8"); PREFIX_WARMUP: every run's warm-up
#                                                 steps (1; the bench's own default is 2)
#   bash benchmarks/gpu_session.sh counters       issue 50: the decode attention kernel under Nsight Compute (ncu) at q1's
#                                                 and t1's shapes (attention_ncu.py): duration, throughputs, occupancy, stalls
#   bash benchmarks/gpu_session.sh fusions [N]    issue 50: the GPU tests the ninth session could not run, then q1 and t1
#                                                 with the decode fusions off (levers.py norotary,norecord) and on, in
#                                                 turn, N rounds (1), 5 steps each: the update swings between runs
#   bash benchmarks/gpu_session.sh pdl [N]        issue 50, tenth session: the GPU tests of sessions 9 and 10 (the
#                                                 programmatic launch's bits, the log-prob's backward, shared prompts),
#                                                 then q1 and t1 as they are and with levers.py pdl, in turn, N rounds
#                                                 (1), 3 steps each; a run starts only before PDL_UNTIL (480 s)
#   bash benchmarks/gpu_session.sh shared         issue 50, tenth session: the shared prompts' GPU test (flex attention
#                                                 forward and backward), then t1 and q1 as they are and with levers.py
#                                                 shareprompt (a prompt computed once for its samples), in turn, then
#                                                 t1 without shuffling mini-batches (verl's default) both ways; a run
#                                                 starts only before SHARED_UNTIL (470 s)
#   bash benchmarks/gpu_session.sh summary        one line per record written so far
# GPUS defaults to 1,2. Records name the commit in KEEL_COMMIT (set it in the device command, e.g.
# KEEL_COMMIT=$(git rev-parse --short HEAD) expanded here: the copy there has no history of its own).
# Run from the repository root after installing carried wheels into .site
# (../shared/device/wheels.sh ray==2.60.0 jsonschema jsonschema-specifications referencing rpds-py);
# Ray is needed for more than one GPU only. Each step has its own time limit, so a part cut short
# still brings back what finished.
set -u
OUT=${OUT:-benchmarks/out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/.site:$PWD
part=${1:-first}

first() {
    local gpus=${1:-1,2}
    timeout 300 python3 -m pytest -q tests/gpu > "$OUT/gpu_tests.txt" 2>&1; tail -1 "$OUT/gpu_tests.txt"  # 2 min at 001026c, more since
    timeout 260 python3 -m keel bench t1 --gpus "$gpus" --steps 3 --warmup 2 --profile "$OUT/profile" \
        --out "$OUT/bench.jsonl" > "$OUT/bench_t1.log" 2>&1
    if [[ ",$gpus," == *",2,"* ]]; then  # a 0.5B model fits one GPU: DDP instead of FSDP
        timeout 150 python3 -m keel bench t1 actor_rollout_ref.actor.fsdp_config.fsdp_size=1 --gpus 2 --steps 3 \
            --warmup 2 --out "$OUT/bench_ddp.jsonl" > "$OUT/bench_t1_ddp.log" 2>&1
    fi
}

decode() {  # batch 256, prompt 256, response 512: the compiled graphs (the engine's default) and their kernels
    for shape in 0.5b 1.5b; do
        timeout 200 python3 benchmarks/profile_decode.py --model "$shape" --batch 256 --prompt 256 --steps 512 \
            --variants compiled_graphs > "$OUT/profile_decode_$shape.txt" 2>&1
        grep -E "^compiled_graphs " "$OUT/profile_decode_$shape.txt"
    done
}

attention() {  # the decode attention's tilings at the rollout target, then splits for few rows over a long cache
    timeout 240 python3 benchmarks/attention_sweep.py --best "$OUT/attention_best.json" > "$OUT/attention_sweep.txt" 2>&1
    timeout 120 python3 benchmarks/attention_sweep.py --sweep splits --shapes 0.5b --batch 8 16 32 64 128 --prompt 256 \
        --response 2048 > "$OUT/attention_splits.txt" 2>&1
    grep -h "^best" "$OUT/attention_sweep.txt" "$OUT/attention_splits.txt" | cut -c1-200
}

counters() {  # what bounds the decode attention kernel: Nsight Compute's counters at q1's and t1's shapes, 128 rows
    local shape
    for shape in qwen3-0.6b 0.5b; do
        (cd benchmarks && timeout 200 ncu --set full --clock-control none -k regex:decode_attention_kernel \
            --launch-skip 28 --launch-count 1 python3 attention_ncu.py --shape "$shape" --shared 8) \
            > "$OUT/ncu_$shape.txt" 2>&1
        grep -h -E "Duration|DRAM Throughput|L2 Cache Throughput|Achieved Occupancy|Block Limit|Registers Per|Stall" \
            "$OUT/ncu_$shape.txt" | sed "s/^/$shape /" | cut -c1-160
    done
}

fusions() {  # the ninth session's decode fusions against their levers off, alternating
    timeout 240 python3 -m pytest -q tests/gpu/test_batch_invariant_cuda.py tests/gpu/test_update_cuda.py \
        tests/gpu/test_train_cuda.py "tests/gpu/test_native_cuda.py::test_continuous_batching_graphs_equal_eager_and_hf" \
        > "$OUT/gpu_tests.txt" 2>&1; tail -1 "$OUT/gpu_tests.txt"
    local round workload
    for round in $(seq "${1:-1}"); do
        for workload in q1 t1; do
            timeout 150 python3 benchmarks/levers.py norotary,norecord "$workload" --gpus 1 --steps 5 --warmup 2 \
                --out "$OUT/bench.jsonl" > "$OUT/fusions_off_${workload}_$round.log" 2>&1
            timeout 150 python3 -m keel bench "$workload" --gpus 1 --steps 5 --warmup 2 \
                --out "$OUT/bench.jsonl" > "$OUT/fusions_on_${workload}_$round.log" 2>&1
        done
    done
}

pdl() {  # the tenth session's lever for the decode step: its kernels launched programmatically, against
    # the step as it is
    timeout 200 python3 -m pytest -q tests/gpu/test_update_cuda.py tests/gpu/test_batch_invariant_cuda.py \
        tests/gpu/test_train_cuda.py "tests/gpu/test_native_cuda.py::test_programmatic_launch_decodes_the_same_bits" \
        > "$OUT/gpu_tests.txt" 2>&1; tail -1 "$OUT/gpu_tests.txt"
    local round workload levers log
    for round in $(seq "${1:-1}"); do
        for workload in q1 t1; do
            for levers in - pdl; do
                (( SECONDS > ${PDL_UNTIL:-480} )) && { echo "$workload $levers: skipped, the call's time is spent"; continue; }
                log="$OUT/pdl_${workload}_${levers}_$round.log"
                if [ "$levers" = - ]; then
                    timeout 150 python3 -m keel bench "$workload" --gpus 1 --steps 3 --warmup 2 \
                        --out "$OUT/bench.jsonl" > "$log" 2>&1
                else
                    timeout 150 python3 benchmarks/levers.py "$levers" "$workload" --gpus 1 --steps 3 --warmup 2 \
                        --out "$OUT/bench.jsonl" > "$log" 2>&1
                fi
                echo "$workload $levers: $(tail -1 "$log" | cut -c1-160)"
            done
        done
    done
}

shared() {  # the tenth session's shared prompts against each sample's own pass, in turn; first
    # their GPU test (flex attention's block mask, forward and backward: the eleventh session's
    # first try failed there)
    timeout 120 python3 -m pytest -q tests/gpu/test_update_cuda.py -k "shared or flex" > "$OUT/gpu_shared_tests.txt" 2>&1
    tail -1 "$OUT/gpu_shared_tests.txt"
    local plain="actor_rollout_ref.actor.shuffle=false" run log i=0
    for run in "- t1" "shareprompt t1" "- q1" "shareprompt q1" "- t1 $plain" "shareprompt t1 $plain"; do
        i=$((i + 1))
        (( SECONDS > ${SHARED_UNTIL:-470} )) && { echo "$run: skipped, the call's time is spent"; continue; }
        log="$OUT/shared_$i.log"
        set -- $run
        if [ "$1" = - ]; then
            timeout 150 python3 -m keel bench "${@:2}" --gpus 1 --steps 3 --warmup 2 --out "$OUT/bench.jsonl" > "$log" 2>&1
        else
            timeout 150 python3 benchmarks/levers.py "$@" --gpus 1 --steps 3 --warmup 2 --out "$OUT/bench.jsonl" > "$log" 2>&1
        fi
        echo "$run: $(tail -1 "$log" | cut -c1-160)"
    done
}

gemm() {  # the decode step's GEMMs: could a Triton kernel of keel's own beat cuBLAS? (5e9df95: no)
    timeout 400 python3 benchmarks/gemm_sweep.py --check > "$OUT/gemm_sweep.txt" 2>&1
    grep -h "^best\|^check" "$OUT/gemm_sweep.txt" | cut -c1-220
}

workloads() {
    timeout 560 python3 -m keel bench "${1:-w1,w2,w3}" --gpus 1 --steps 2 --warmup 1 \
        --out "$OUT/bench.jsonl" > "$OUT/bench_workloads.log" 2>&1
}

lora() {  # w7 as the issue defines it, then without checkpointing (its memory now allows micro-batches of 4)
    timeout 150 python3 -m keel bench w7 --gpus 1 --steps 2 --warmup 1 --out "$OUT/bench.jsonl" > "$OUT/w7.log" 2>&1
    timeout 130 python3 -m keel bench w7 actor_rollout_ref.model.enable_gradient_checkpointing=false \
        actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 --gpus 1 --steps 2 --warmup 1 \
        --out "$OUT/bench.jsonl" > "$OUT/w7_nogc.log" 2>&1
    timeout 220 python3 -m keel bench w7f --gpus 1 --steps 2 --warmup 1 --out "$OUT/bench.jsonl" > "$OUT/w7f.log" 2>&1
}

large() {
    timeout 560 python3 -m keel bench w32 --gpus 1 --steps 1 --warmup 1 --out "$OUT/bench.jsonl" > "$OUT/w32.log" 2>&1
}

multi() {  # m1, then w4: variable lengths under continuous batching against fixed lengths and chunks
    timeout 300 python3 -m keel bench m1 --gpus 1 --steps 2 --warmup 1 --out "$OUT/bench.jsonl" > "$OUT/m1.log" 2>&1
    timeout 240 python3 benchmarks/variable_lengths.py --rows 512 --out "$OUT/w4.jsonl" > "$OUT/w4.log" 2>&1; tail -1 "$OUT/w4.log"
}

families() {
    timeout 240 python3 -m pytest -q tests/gpu/test_native_cuda.py > "$OUT/gpu_native_tests.txt" 2>&1
    tail -1 "$OUT/gpu_native_tests.txt"
    for w in ${1//,/ }; do
        timeout 170 python3 -m keel bench "$w" --gpus 1 --steps 2 --warmup 1 --out "$OUT/bench.jsonl" > "$OUT/$w.log" 2>&1
        tail -1 "$OUT/$w.log" | cut -c1-300
    done
}

agents() {  # issue 30: m1a against m1 in one call (m1 first: it warms the compile cache), then m1a with the
    # agent and endpoint processes of the earlier defaults (4 and 2), and with 4 of each
    for w in m1 m1a; do
        timeout 150 python3 -m keel bench "$w" --gpus 1 --steps 2 --warmup 1 --out "$OUT/bench.jsonl" > "$OUT/$w.log" 2>&1
        tail -1 "$OUT/$w.log" | cut -c1-200
    done
    local key=actor_rollout_ref.rollout.agent
    for variant in "$key.processes=4 $key.endpoint_processes=2" "$key.processes=4 $key.endpoint_processes=4"; do
        timeout 150 python3 -m keel bench m1a $variant --gpus 1 --steps 2 --warmup 1 --out "$OUT/bench.jsonl" \
            > "$OUT/m1a_variant.log" 2>&1
        echo "$variant: $(tail -1 "$OUT/m1a_variant.log" | cut -c1-200)"
    done
}

async_mode() {  # issue 31: s1 (1 s of host scoring a sample), w2 and m1, each sync then async in one call; a part
    # starts only while the call has time left for it (SECONDS: this script's)
    for w in s1 w2 m1; do
        for mode in sync async; do
            (( SECONDS > ${ASYNC_UNTIL:-420} )) && { echo "$w $mode: skipped, the call's time is spent"; continue; }
            timeout 170 python3 -m keel bench "$w" trainer.mode=$mode --gpus 1 --steps 2 --warmup 1 \
                --out "$OUT/bench.jsonl" > "$OUT/${w}_$mode.log" 2>&1
            echo "$w $mode: $(tail -1 "$OUT/${w}_$mode.log" | cut -c1-160)"
        done
    done
}

partial() {  # issue 31: v2's long tail in sync mode, async mode, and async with partial rollouts (wait, then
    # drop), then s1 sync and async with a profiled step each (GPU busy per phase); a run starts only while the
    # call has time left for it (SECONDS: this script's)
    local async="trainer.mode=async" part="trainer.partial_rollout=true"
    local runs=("v2 trainer.mode=sync" "v2 $async" "v2 $async $part" "v2 $async $part trainer.off_policy_strategy=drop"
        "s1 trainer.mode=sync --profile $OUT/profile" "s1 $async --profile $OUT/profile")
    bench_runs 150 "${PARTIAL_UNTIL:-430}" "${runs[@]}"
    grep -h -o '"async": {[^}]*}\|"gpu_busy[a-z_]*": {[^}]*}' "$OUT/bench.jsonl"
}

bench_runs() {  # LIMIT UNTIL RUN...: each run (a workload and its overrides) for 3 steps under LIMIT seconds,
    # started only while this script is under UNTIL seconds (SECONDS: the call's time)
    local limit=$1 until=$2 run
    for run in "${@:3}"; do
        (( SECONDS > until )) && { echo "$run: skipped, the call's time is spent"; continue; }
        timeout "$limit" python3 -m keel bench $run --gpus 1 --steps 3 --warmup 1 --out "$OUT/bench.jsonl" \
            > "$OUT/run.log" 2>&1
        echo "$run: $(tail -1 "$OUT/run.log" | cut -c1-160)"
    done
}

scoring() {  # issue 31: scoring each sample as it finishes (reward.score_ahead), against the batch whole
    timeout 300 python3 -m pytest -q tests/gpu > "$OUT/gpu_tests.txt" 2>&1; tail -1 "$OUT/gpu_tests.txt"
    for ahead in false true; do
        (( SECONDS > ${SCORING_UNTIL:-450} )) && { echo "sv ahead=$ahead: skipped, the call's time is spent"; continue; }
        timeout 140 python3 -m keel bench sv reward.score_ahead=$ahead --gpus 1 --steps 2 --warmup 1 \
            --out "$OUT/bench.jsonl" > "$OUT/sv_$ahead.log" 2>&1
        echo "sv ahead=$ahead: $(tail -1 "$OUT/sv_$ahead.log" | cut -c1-160)"
    done
}

fifo() {  # issue 31: partial rollouts' first-in-first-out wait on v2, against sync; sv with partial rollouts
    local async="trainer.mode=async trainer.partial_rollout=true"
    bench_runs 170 "${FIFO_UNTIL:-430}" "v2 trainer.mode=sync" "v2 $async" "sv $async"
    grep -h -o '"async": {[^}]*}' "$OUT/bench.jsonl"
}

agents_profile() {  # issue 30: where m1a's engine process spends its time (py-spy, carry its wheel), and a
    # GIL switch interval of 0.5 ms against the default 5 ms
    timeout 150 python3 -m keel bench m1 --gpus 1 --steps 2 --warmup 1 --out "$OUT/bench.jsonl" > "$OUT/m1.log" 2>&1
    tail -1 "$OUT/m1.log" | cut -c1-200
    local bench="-m keel bench m1a --gpus 1 --steps 2 --warmup 1 --out $OUT/bench.jsonl"
    for how in threads gil; do
        local flags="--threads"; [[ $how == gil ]] && flags="--threads --gil"
        timeout 200 py-spy record --nonblocking $flags --format raw --rate 100 -o "$OUT/m1a_spy_$how.txt" \
            -- python3 $bench > "$OUT/m1a_spy_$how.log" 2>&1
        tail -1 "$OUT/m1a_spy_$how.log" | cut -c1-200
    done
    timeout 150 python3 -c "import sys, runpy; sys.setswitchinterval(0.0005); sys.argv = ['keel'] + sys.argv[1:]; \
runpy.run_module('keel', run_name='__main__', alter_sys=True)" ${bench#-m keel } > "$OUT/m1a_switch.log" 2>&1
    tail -1 "$OUT/m1a_switch.log" | cut -c1-200
}

large_families() {  # issue 29: the large shapes with LoRA, one after another (o20l,e30l,q8l or W)
    for w in ${1//,/ }; do
        timeout 190 python3 -m keel bench "$w" --gpus 1 --steps 2 --warmup 1 --out "$OUT/bench.jsonl" > "$OUT/$w.log" 2>&1
        tail -1 "$OUT/$w.log" | cut -c1-300
    done
}

levers() {  # what issue 17's CPU-built levers are worth, in one run of each against t1's four mini-batches
    timeout 150 python3 -m keel bench t1 --gpus 1 --steps 3 --warmup 2 --profile "$OUT/profile" \
        --out "$OUT/bench.jsonl" > "$OUT/levers_t1.log" 2>&1
    timeout 120 python3 -m keel bench t1 actor_rollout_ref.actor.ppo_mini_batch_size=16 --gpus 1 --steps 3 \
        --warmup 2 --out "$OUT/bench.jsonl" > "$OUT/levers_on_policy.log" 2>&1
    timeout 120 python3 -m keel bench t1 algorithm.rollout_correction.bypass_mode=true --gpus 1 --steps 3 \
        --warmup 2 --out "$OUT/bench.jsonl" > "$OUT/levers_bypass.log" 2>&1
    grep -h -o '"gpu_busy[a-z_]*": {[^}]*}' "$OUT/bench.jsonl" | tail -2
}

design() {
    local base=${1:?a folder holding an earlier keel/} rounds=${2:-1}
    if [ -z "${SKIP_TESTS:-}" ]; then
        timeout 300 python3 -m pytest -q tests/gpu > "$OUT/gpu_tests.txt" 2>&1
        tail -1 "$OUT/gpu_tests.txt"
    fi
    for round in $(seq "$rounds"); do
        # python -m puts the working folder first on sys.path: run the baseline from its own folder
        (cd "$base" && PYTHONPATH=$PWD KEEL_COMMIT=${BASE_COMMIT:-baseline} timeout 150 python3 -m keel bench t1 \
            --gpus 1 --steps 3 --warmup 2 --out "$OUT/bench_baseline.jsonl") > "$OUT/design_base_$round.log" 2>&1
        timeout 150 python3 -m keel bench t1 --gpus 1 --steps 3 --warmup 2 --out "$OUT/bench.jsonl" \
            > "$OUT/design_t1_$round.log" 2>&1
    done
}

dpo() {
    timeout 200 python3 -m pytest -q tests/gpu/test_preference_cuda.py tests/gpu/test_native_cuda.py \
        -k "${DPO_TESTS:-phi3 or preference or packed}" > "$OUT/gpu_dpo_tests.txt" 2>&1; tail -1 "$OUT/gpu_dpo_tests.txt"
    timeout 240 python3 -m keel bench d1 --trl --steps 5 --warmup 2 --out "$OUT/d1.jsonl" > "$OUT/d1.log" 2>&1
    timeout 120 python3 -m keel bench d1 dpo.reference=model --steps 5 --warmup 2 --out "$OUT/d1.jsonl" \
        > "$OUT/d1_model_reference.log" 2>&1
    timeout 120 python3 -m keel bench d1 data.share_prompt=false --steps 5 --warmup 2 --out "$OUT/d1.jsonl" \
        > "$OUT/d1_prompt_twice.log" 2>&1
    python3 - "$OUT/d1.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(r["workload"], r["reference"], r["overrides"], f"step {r['step_time_s']:.3f}s", f"peak {r['peak_memory_gb']:.1f} GB",
          f"trl {r.get('trl_step_time_s') or 0:.3f}s peak {r.get('trl_peak_memory_gb') or 0:.1f} GB", f"x{r.get('speedup_vs_trl') or 0:.2f}")
PY
}

distill() {  # issue 48: the teacher's pass against the student's old-log-prob pass and update (teacher_share,
    # target <= 0.5) in both modes; a run starts only while the call has time left for it (SECONDS: this script's)
    if [ -z "${SKIP_TESTS:-}" ]; then
        timeout 330 python3 -m pytest -q -s tests/gpu/test_distill_cuda.py tests/gpu/test_quickstart_cuda.py \
            "tests/gpu/test_native_cuda.py::test_a_kept_cache_captures_again_for_other_sampling_settings" \
            > "$OUT/gpu_distill_tests.txt" 2>&1
        grep -E "float8 teacher:|passed|failed" "$OUT/gpu_distill_tests.txt" | tail -3
    fi
    local run
    for run in ${O1_RUNS:-reverse_kl:bfloat16 reverse_kl:float8 gkd:bfloat16 gkd:float8}; do
        local mode=${run%%:*} dtype=${run##*:}
        (( SECONDS > ${DISTILL_UNTIL:-400} )) && { echo "o1 $run: skipped, the call's time is spent"; continue; }
        timeout 150 python3 -m keel bench o1 distillation.mode=$mode distillation.teacher.dtype=$dtype --gpus 1 \
            --steps 5 --warmup 2 --out "$OUT/o1.jsonl" > "$OUT/o1_${mode}_$dtype.log" 2>&1 \
            || { echo "o1 $run: exit $?, the log's end:"; tail -5 "$OUT/o1_${mode}_$dtype.log" | cut -c1-300; }
    done
    [ -e "$OUT/o1.jsonl" ] || return
    python3 - "$OUT/o1.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    t, kl = r["timing_s"], r["distill_reverse_kl_per_step"]
    print(r["workload"], r["distill_mode"], r["teacher_dtype"], r["device"], f"step {r['step_time_s']:.3f}s", f"teacher {r['teacher_s']:.3f}s",
          f"old {r['old_log_prob_s'] or 0:.3f}s", f"update {r['update_actor_s']:.3f}s",
          f"share {r['teacher_share']:.3f} of {r['teacher_share_of']} (target <= {r['teacher_share_target']})",
          f"gen {t['gen']:.3f}s", f"peak {r['peak_memory_gb']:.1f} GB", "reverse_kl " + " ".join(f"{k:.3f}" for k in kl))
PY
}

quickstart() {  # issue 48: the quick-start on one GPU (it stopped at step 2 with a NaN gradient at c072db3):
    # each variant 3 steps without validation or saving, then the README's runs (QUICK_README=1)
    python3 examples/quickstart/prepare.py > /dev/null
    local base="trainer.total_training_steps=3 trainer.test_freq=-1 trainer.save_freq=-1"
    local name args
    while read -r name args; do
        (( SECONDS > ${QUICK_UNTIL:-480} )) && { echo "$name: skipped, the call's time is spent"; continue; }
        timeout 150 python3 -m keel train examples/quickstart/grpo.yaml $base trainer.experiment_name=$name $args \
            > "$OUT/quick_$name.log" 2>&1
        echo "$name ($args): exit $? | $(grep -E '^(step [0-9]|error)' "$OUT/quick_$name.log" | tail -2 | cut -c1-220 | tr '\n' ' ')"
    done <<< "${QUICK_VARIANTS:-base
eager actor_rollout_ref.rollout.enforce_eager=true
nocompile actor_rollout_ref.actor.use_torch_compile=false
hf actor_rollout_ref.rollout.name=hf
fp32 actor_rollout_ref.model.dtype=float32
lowlr actor_rollout_ref.actor.optim.lr=3e-4}"
}

speed() {  # issue 50: the async GPU test, then s1 sync and async (SPEED_PART=s1), or t1 as it is (profiled), t1
    # with cuDNN's attention allowed (keel keeps half precision off it: pytorch#196678), and q1 with its KV cache
    # freed and kept between steps (SPEED_PART=t1); a run starts only while the call has time left for it
    if [ "${SPEED_PART:-s1}" = levers ]; then
        speed_levers
        return
    fi
    if [ "${SPEED_PART:-s1}" = s1 ]; then
        timeout 200 python3 -m pytest -q tests/gpu/test_train_cuda.py -k async > "$OUT/gpu_async_test.txt" 2>&1
        tail -1 "$OUT/gpu_async_test.txt"
        bench_runs 170 "${SPEED_UNTIL:-400}" "s1 trainer.mode=sync" "s1 trainer.mode=async"
        return
    fi
    bench_runs 150 "${SPEED_UNTIL:-430}" "t1 --profile $OUT/profile"
    (( SECONDS > ${SPEED_UNTIL:-430} )) || timeout 150 python3 -c "import sys, keel.models.load as load
load.avoid_cudnn_attention = lambda: None  # cuDNN's attention allowed, as torch 2.11 chooses
from keel.cli import main
sys.exit(main(sys.argv[1:]))" bench t1 --gpus 1 --steps 3 --warmup 1 --out "$OUT/bench_cudnn.jsonl" > "$OUT/t1_cudnn.log" 2>&1
    bench_runs 150 "${SPEED_UNTIL:-430}" "q1 actor_rollout_ref.rollout.free_cache_engine=true" \
        "q1 actor_rollout_ref.rollout.free_cache_engine=false"
}

speed_levers() {  # issue 50, second session: the invariant and async GPU tests, t1 as it is (profiled), then t1
    # with each experimental lever of benchmarks/levers.py, q1 as it is (its cache kept) and freed, and t1
    # batch-invariant in bypass mode (the sampler's log-probs are the old ones: the pass fused away)
    local until=${SPEED_UNTIL:-500} lever
    timeout 170 python3 -m pytest -q tests/gpu/test_batch_invariant_cuda.py \
        "tests/gpu/test_train_cuda.py::test_an_async_run_ends_and_its_process_exits_with_a_batch_still_scoring" \
        > "$OUT/gpu_exact_tests.txt" 2>&1
    grep -E "passed|failed|Error" "$OUT/gpu_exact_tests.txt" | tail -3
    bench_runs 150 "$until" "t1 --profile $OUT/profile"
    for lever in ${LEVERS:-nogc graphs}; do
        (( SECONDS > until )) && { echo "lever $lever: skipped, the call's time is spent"; continue; }
        timeout 150 python3 benchmarks/levers.py "$lever" t1 --gpus 1 --steps 3 --warmup 1 \
            --out "$OUT/bench.jsonl" > "$OUT/lever_$lever.log" 2>&1
        echo "lever $lever: $(tail -1 "$OUT/lever_$lever.log" | cut -c1-160)"
    done
    bench_runs 150 "$until" q1 "q1 actor_rollout_ref.rollout.free_cache_engine=true" \
        "t1 actor_rollout_ref.rollout.batch_invariant=true algorithm.rollout_correction.bypass_mode=true"
}

invariant() {  # issue 50: the batch-invariant GPU tests (ALL_TESTS=1: every GPU test), then t1 as it is, t1
    # invariant with the sampler's log-probs as the old ones (bypass mode: the pass fused away; profiled) and t1
    # invariant with the pass
    local tests=tests/gpu/test_batch_invariant_cuda.py
    [ -n "${ALL_TESTS:-}" ] && tests=tests/gpu
    timeout 330 python3 -m pytest -q $tests > "$OUT/gpu_invariant_tests.txt" 2>&1
    grep -E "passed|failed|Error" "$OUT/gpu_invariant_tests.txt" | tail -3
    local on=actor_rollout_ref.rollout.batch_invariant=true
    bench_runs 130 "${INVARIANT_UNTIL:-420}" t1 \
        "t1 $on algorithm.rollout_correction.bypass_mode=true --profile $OUT/profile_invariant" "t1 $on" \
        ${INVARIANT_MORE:-}
}

exact() {  # issue 50 in one call: the batch-invariant and async GPU tests, then s1 sync and async, then t1 as it
    # is and batch-invariant (log_prob_gap 0, its cost); a run starts only while the call has time left for it
    timeout 180 python3 -m pytest -q tests/gpu/test_batch_invariant_cuda.py \
        "tests/gpu/test_train_cuda.py::test_an_async_run_ends_and_its_process_exits_with_a_batch_still_scoring" \
        > "$OUT/gpu_exact_tests.txt" 2>&1
    grep -E "passed|failed|Error" "$OUT/gpu_exact_tests.txt" | tail -3
    bench_runs 130 "${EXACT_UNTIL:-330}" "s1 trainer.mode=sync" "s1 trainer.mode=async" t1 \
        "t1 actor_rollout_ref.rollout.batch_invariant=true"
}

prefix() {  # issue 50: a prompt's samples read its keys and values in one row (decode_state.SHARE_PREFIX_READS)
    timeout 150 python3 -m pytest -q tests/gpu/test_native_cuda.py -k "${PREFIX_TESTS:-triton_decode_attention or same_bits}" \
        > "$OUT/gpu_prefix_tests.txt" 2>&1
    grep -E "passed|failed|Error" "$OUT/gpu_prefix_tests.txt" | tail -3
    local run runs=("noshare q1" "- q1" "noshare t1" "- t1" "sweep 1" "sweep 8")
    [ -n "${PREFIX_RUNS:-}" ] && mapfile -t runs <<< "$PREFIX_RUNS"
    local i=0
    for run in "${runs[@]}"; do
        i=$((i + 1))
        (( SECONDS > ${PREFIX_UNTIL:-450} )) && { echo "$run: skipped, the call's time is spent"; continue; }
        set -- $run
        if [ "$1" = sweep ]; then  # the kernel alone at q1's and t1's shapes, rows reading copies in groups of $2
            timeout 90 python3 benchmarks/attention_sweep.py --sweep sharing --shapes qwen3-0.6b 0.5b --batch 128 \
                --response 256 --shared "$2" > "$OUT/attention_shared_$2.txt" 2>&1
            echo "$run: $(grep -h '^best' "$OUT/attention_shared_$2.txt" | cut -c1-220)"
            continue
        fi
        # numbered: two runs of one workload differ in their arguments
        local log="$OUT/run_${i}_${2}_${1/-/share}.log"
        if [ "$1" = - ]; then
            timeout 200 python3 -m keel bench "${@:2}" --gpus 1 --steps 3 --warmup "${PREFIX_WARMUP:-1}" \
                --out "$OUT/bench.jsonl" > "$log" 2>&1
        else
            timeout 200 python3 benchmarks/levers.py "$1" "${@:2}" --gpus 1 --steps 3 --warmup "${PREFIX_WARMUP:-1}" \
                --out "$OUT/bench.jsonl" > "$log" 2>&1
        fi
        echo "$run: $(tail -1 "$log" | cut -c1-160)"
    done
}

summary() {
    local records=("$OUT"/bench*.jsonl)
    [ -e "${records[0]}" ] || { echo "no records in $OUT yet"; return; }
    python3 - "${records[@]}" <<'PY'
import json, sys
for path, line in ((path, line) for path in sys.argv[1:] for line in open(path)):
    r = json.loads(line)
    t = r["timing_s"]
    print(r["workload"], r["n_gpus"], r.get("overrides", []), r.get("levers", []), f"step {r['step_time_s']:.2f}s", f"gen {t['gen']:.2f}s",
          f"old {t.get('old_log_prob', 0):.3f}s", f"update {t['update_actor']:.2f}s", f"sync {t.get('sync_rollout_weights', 0):.3f}s",
          f"gen {r['gen_tokens_per_s']:.0f} tok/s", f"decode {r.get('decode_tokens_per_s') or 0:.0f} tok/s",
          f"mfu {r['update_mfu']:.3f}", f"peak {r['peak_memory_gb']:.1f} GB", f"gap {r['log_prob_gap']:.2g}",
          f"waited on reward {t.get('wait_reward', 0):.2f}s", f"capture {t.get('gen_capture', 0):.3f}s", path.rsplit("/", 1)[-1])
PY
}

"$part" "${@:2}"
[ "$part" = summary ] || [ "$part" = counters ] || [ "$part" = dpo ] || [ "$part" = distill ] || [ "$part" = quickstart ] || summary
