#!/usr/bin/env bash
# One command, many checks: runs the named sections on a GPU machine and writes each
# section's log to $OUT/<section>.log ($OUT: default /tmp/coat_gpu_out).
#   bash benchmarks/run_gpu.sh tests kernels layer optimizer     # one run, four sections
#   bash benchmarks/run_gpu.sh train1b e2e
# Sections: tests (GPU-marked tests), tests_all (kernel/ops/quantize test files compiled for the
# GPU), adam (the optimizer kernel's tests: carry .whl; tests/test_optim_group_axis.py stays out:
# its CPU tests compare with the reference to the ulp on an 8-device mesh, its GPU test runs in
# tests), kernels (quantize bandwidth, fused Adam step, FP8 GEMM), quant_sweep (the Mosaic GPU
# quantize kernels' tunables), remake (the remade linear input's transposed codes each way:
# benchmarks/kernels/bench_remake.py, REMAKE_ARGS such as --sweep), remade_ab (coat with
# model.linear_residuals kept, then remade, one after the other: the 7B layer, OLMo-1B's step
# (scanned, remat none), Llama-2-7B's (remat full, batch 8); REMADE_AB picks among "layer olmo
# 7b"; a JSON each in $OUT), ops (per-op fwd+bwd times),
# layer (7B decoder layer, 3 modes),
# optimizer (1.21e9 params), train1b (train.py, olmo-1b shape, 3 modes, short), train_sharded
# (same, FSDP over all GPUs), e2e (benchmarks/step/bench_e2e.py), compile_breakdown (where the
# step's compile goes, benchmarks/step/compile_breakdown.py: CB_ARGS, default Llama-2-7B unrolled,
# bf16 against coat), accuracy (benchmarks/accuracy/accuracy.py at ACC_SEEDS, default 0 1 2, one
# run each, 2000 steps of llama-125m: ACC_MODES, ACC_BUDGET seconds a seed, default 170 (one coat
# run takes ~70 s on an H100, bf16 ~90 s), ACC_ARGS such as "--set model.linear_residuals=remade"),
# peak (what the coat step holds at its memory peak, lax.scan vs vjp_loop), floor (the olmo-1b
# step of both modes per kernel category, against benchmarks/step/step_floor.py's floors),
# multi_gpu (2 GPUs: a checkpoint written on 2 resumed on 1; olmo-1b FSDP on 2 vs 1 GPU),
# configs (each shipped config through train.py as a user runs it, offline corpus: `--plan`, then a
# few steps; first step, compile, tokens/s, MFU, device peak, host max RSS with the final save;
# CONFIGS="..." picks configs, one run each for llama2-7b, llama2-13b and llama-20b; CONFIG_EXTRA:
# more train.py arguments, e.g. "--set checkpoint.enabled=false" where the final checkpoint cannot
# fit the machine's disk), remat_sweep (one
# config at each remat policy, microbatches auto, against remat auto: REMAT_CONFIG), equal7b
# (configs/llama2-7b.yaml, bf16 + optax.adamw against coat at one batch and remat, no microbatches:
# EQUAL_BATCHES, the first that every mode fits), batch1b (OLMo-1B's shape through bench_e2e,
# each mode at its largest batch: BATCH1B), batch7b (configs/llama2-7b.yaml, each mode at its
# largest batch without microbatches, remat full: BATCH7B), largest (the largest Llama each optimizer fits at
# seq 2048, global batch 64: `--plan` per shape, largest first, LARGEST_PLANS, LARGEST_LIMIT),
# largest_run (train.py on one such shape: LARGEST_RUN, or the last that `largest` found fitting),
# step_memory (benchmarks/step/step_memory.py: STEP_MEMORY_ARGS), checkpoint_memory (host memory of
# a save, whole and streamed: benchmarks/step/checkpoint_memory.py, CKPT_ARGS, CKPT_LIMIT), layer takes LAYER_ARGS,
# sft (configs/llama2-7b-sft.yaml from a random Hugging Face directory of Llama-2-7B's shape made
# on the machine: SFT_VARIANTS of coat / bf16 (+ optax.adamw), _b4 at batch 4 without microbatches).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/coat_gpu_out}; mkdir -p "$OUT"
PY=${PY:-python3}
# Wheels carried to the GPU machine (.whl/, git-ignored; the `gpu` extra: jax-triton), e.g. here:
#   python3 -m pip download --no-deps --only-binary=:all: -d .whl jax-triton==0.3.1
# and .whl is copied to the GPU machine with the tree. Installed into /tmp/site, ahead on PYTHONPATH.
if compgen -G ".whl/*.whl" > /dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}
# A test that lowers a kernel on the deprecated Pallas Triton backend fails (none may).
NO_PT=(-W "error:The Pallas Triton backend is deprecated:DeprecationWarning")
# Runs the command after it, then prints its host max RSS (what a checkpoint save holds on the host).
HOST_RSS=(-c "import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]).returncode; \
print(f'host max RSS {resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20:.2f} GiB'); \
sys.exit(r)")
config_args() {  # config_args NAME: train.py's arguments for a shipped config on the offline corpus
  local v=32000; [ "$1" = olmo-1b ] && v=50304; [ "$1" = tiny ] && v=4096
  echo --config configs/$1.yaml --no-progress --set data.kind=stdlib --set 'data.paths=[]' \
    --set data.vocab_size=$v --set data.eval_fraction=0.02 --set data.eval_batches=1 --set run.eval_every=100000 \
    --set run.log_every=1 --set run.plot=false --set run.tensorboard=false \
    --set checkpoint.every=100000 --set run.plan_timed_steps=${PLAN_TIMED_STEPS:-2}
}
master_args() {  # master_args OPTIMIZER: the master weights each optimizer runs with here
  # (coat_adamw: bfloat16 with stochastic rounding, as the shipped 7B/13B configs; optax: float32)
  if [ "$1" = coat_adamw ]; then echo --set model.param_dtype=bfloat16 --set optimizer.master_rounding=stochastic
  else echo --set model.param_dtype=float32 --set optimizer.master_rounding=nearest; fi
}
largest_args() {  # largest_args OPTIMIZER H L F: a Llama of that shape (heads of 128) through the
  # 13B recipe at seq 2048, global batch 64, remat full, the fewest microbatches that fit
  echo $(config_args llama2-13b) --set optimizer.name=$1 $(master_args $1) --set model.hidden_size=$2 \
    --set model.num_layers=$3 --set model.intermediate_size=$4 --set model.num_heads=$(($2 / 128)) \
    --set model.num_kv_heads=$(($2 / 128)) --set data.seq_len=2048 --set data.batch_size=64 \
    --set model.remat=full --set optimizer.accumulate=auto
}
summary() {  # summary DIR: the numbers of a run's summary.json on one line
  $PY -c "import json, sys; s = json.load(open(sys.argv[1] + '/summary.json')); \
print(sys.argv[1], {k: s.get(k) for k in ('step', 'compile_s', 'first_step_s', 'tokens_per_s', \
'mfu', 'peak_memory_bytes', 'peak_memory_kind', 'host_max_rss_bytes', 'wall_s', 'train_loss_last')})" "$1"
}
section_lines() {  # section_lines NAME: what the last `section` call appended to $OUT/NAME.log
  tail -n +"$SECTION_FROM" "$OUT/$1.log"
}
section() {  # section NAME SECONDS CMD...: run with a time limit, log to $OUT/NAME.log
  local name=$1 limit=$2; shift 2
  SECTION_FROM=$(( $( (wc -l < "$OUT/$name.log") 2>/dev/null || echo 0) + 1 ))
  echo "=== $name ($(date -u +%H:%M:%S), limit ${limit}s): $*" | tee -a "$OUT/$name.log"
  timeout "$limit" "$@" 2>&1 | tee -a "$OUT/$name.log" | grep -v "^\s*$" | tail -n 60
  local rc=${PIPESTATUS[0]}
  echo "=== $name exit $rc" | tee -a "$OUT/$name.log"
  return "$rc"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
$PY -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, jax.devices())" | tee -a "$OUT/gpu.txt"
$PY -c "from pallas_kernels.adam import adam_step_triton as t; print('jax-triton available:', t.available())" 2>&1 | tail -1 | tee -a "$OUT/gpu.txt"
for s in "$@"; do
  case $s in
    tests) section tests 300 env JAX_PLATFORMS=cuda,cpu $PY -m pytest "${NO_PT[@]}" -v -rf --tb=short -p no:cacheprovider -m gpu --durations=10 tests ;;
    tests_all) section tests_all 420 env JAX_PLATFORMS=cuda,cpu $PY -m pytest "${NO_PT[@]}" -v -rf --tb=line -p no:cacheprovider -m "not slow" -k "not interpret" --timeout 90 --durations=15 \
             tests/test_kernels_backends.py tests/test_kernels_matmul.py tests/test_kernels_adam.py tests/test_ops.py tests/test_quantize.py ;;
    adam) section adam 300 env JAX_PLATFORMS=cuda,cpu $PY -m pytest "${NO_PT[@]}" -q -rf --tb=short -p no:cacheprovider -m "not slow" -k "not interpret" --durations=10 \
             tests/test_kernels_adam_triton.py tests/test_kernels_adam.py tests/test_optim_clip.py tests/test_optim_master_rounding.py tests/test_optim_packed.py ;;
    kernels) section kernels 420 $PY -m benchmarks.kernels.bench_kernels ${KERNEL_ARGS:-} ;;
    quant_sweep) section quant_sweep 300 $PY -m benchmarks.kernels.bench_kernels_mgpu --sweep ${SWEEP_ARGS:-} ;;
    remake) section remake 240 $PY -m benchmarks.kernels.bench_remake ${REMAKE_ARGS:-} ;;
    remade_ab) for what in ${REMADE_AB:-layer olmo 7b}; do
             case $what in layer|olmo|7b) ;; *) echo "remade_ab: unknown part $what (layer, olmo, 7b)"; continue ;; esac
             for lr in kept remade; do case $what in
               layer) section remade_ab 90 $PY -m benchmarks.layer.bench_layer --modes coat \
                        --linear-residuals $lr --json "$OUT/layer_$lr.json" ;;
               olmo) section remade_ab 150 $PY -m benchmarks.step.bench_e2e --modes coat+coat_adamw \
                       --layers scanned --set model.linear_residuals=$lr --json "$OUT/e2e_olmo1b_$lr.json" ;;
               7b) section remade_ab 240 $PY -m benchmarks.step.bench_e2e --preset llama2-7b --remat full \
                     --batch 8 --modes coat+coat_adamw --set model.linear_residuals=$lr \
                     --json "$OUT/e2e_7b_$lr.json" ;;
             esac; done; done ;;
    ops) section ops 240 $PY -m benchmarks.layer.bench_ops ;;
    profile) section profile 200 $PY -m benchmarks.layer.profile_layer ;;
    layer) section layer 420 $PY -m benchmarks.layer.bench_layer --json "$OUT/layer.json" ${LAYER_ARGS:-} ;;
    step_memory) section step_memory ${CONFIG_LIMIT:-300} $PY -m benchmarks.step.step_memory ${STEP_MEMORY_ARGS:-} ;;
    checkpoint_memory) section checkpoint_memory ${CKPT_LIMIT:-300} $PY -m benchmarks.step.checkpoint_memory ${CKPT_ARGS:-} ;;
    optimizer) section optimizer 420 $PY -m benchmarks.step.bench_optimizer ${OPT_ARGS:-} ;;
    train1b) for m in ${TRAIN1B_MODES:-bf16:adamw fp8_linear:adamw coat:coat_adamw}; do set -- ${m/:/ }
               section train1b 200 $PY train.py --config configs/olmo-1b.yaml --no-progress \
                 --set data.kind=stdlib --set 'data.paths=[]' --set data.vocab_size=50304 --set data.batch_size=8 --set data.eval_fraction=0.02 --set data.eval_batches=4 \
                 --set precision=$1 --set optimizer.name=$2 --set run.steps=30 --set run.log_every=10 \
                 --set run.eval_every=1000 --set checkpoint.every=100000 --out-dir /tmp/run_$1; done ;;
    train_sharded) for m in "bf16 adamw" "coat coat_adamw"; do set -- $m  # all GPUs, FSDP
               section train_sharded 240 $PY train.py --config configs/olmo-1b.yaml --no-progress \
                 --set data.kind=stdlib --set 'data.paths=[]' --set data.vocab_size=50304 --set data.batch_size=16 --set data.eval_fraction=0.02 --set data.eval_batches=4 \
                 --set precision=$1 --set optimizer.name=$2 --set run.steps=30 --set run.log_every=10 \
                 --set run.eval_every=1000 --set checkpoint.every=100000 --set mesh.fsdp=-1 --out-dir /tmp/runs_$1; done ;;
    e2e) section e2e 500 $PY -m benchmarks.step.bench_e2e --modes bf16+adamw,coat+coat_adamw --layers best ${E2E_ARGS:-} ;;
    compile_breakdown) section compile_breakdown ${CB_LIMIT:-240} $PY -m benchmarks.step.compile_breakdown \
             --vmodule "" --json "$OUT/compile_breakdown.json" ${CB_ARGS:---preset llama2-7b --remat full \
             --batch 8 --set model.scan_layers=false --variants bf16:adamw coat:coat_adamw --parallel 1} ;;
    accuracy) for s in ${ACC_SEEDS:-0 1 2}; do  # one seed a run, its accuracy.json kept
               section accuracy $(( ${ACC_BUDGET:-170} + 30 )) $PY -m benchmarks.accuracy.accuracy \
                 --out /tmp/acc_s$s --seed $s --modes ${ACC_MODES:-coat+coat_adamw} \
                 --seconds-budget ${ACC_BUDGET:-170} ${ACC_ARGS:-}
               cp /tmp/acc_s$s/accuracy.json "$OUT/accuracy_s$s.json"; done ;;
    peak) section peak 300 $PY -m benchmarks.step.profile_step --variants coat:scan+lax,coat:scan+vjploop \
            --iters 1 --steps 1 --warmup 1 --top 25 --gaps 0 --buffers /tmp/peak_dumps --hlo-dir "$OUT/hlo" \
            --json "$OUT/peak.json" ;;
    floor) section floor 500 $PY -m benchmarks.step.profile_step --variants bf16:loop,coat:loop --steps 8 \
             --warmup 3 --iters 3 --top 40 --json "$OUT/profile16_loop.json"
           gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | grep -qi h200 && echo h200 || echo h100)
           section floor 120 env JAX_PLATFORMS=cpu $PY -m benchmarks.step.step_floor --gpu "$gpu" \
             --profile "$OUT/profile16_loop.json" ;;
    multi_gpu) export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # never NVLink multicast
          section multi_gpu 200 $PY -m benchmarks.mesh.resume_across_meshes --devices-a 2 --devices-b 1 --reference \
            --set precision=coat --set optimizer.name=coat_adamw --out-dir /tmp/resume \
            --json "$OUT/resume.json" --plot "$OUT/resume.png"
          section multi_gpu 240 $PY -m benchmarks.step.bench_e2e --devices 2 --set mesh.fsdp=-1 --batch 16 \
            --steps 8 --warmup 2 --json "$OUT/e2e_2gpu_fsdp.json"
          section multi_gpu 200 $PY -m benchmarks.step.bench_e2e --devices 1 --batch 8 --steps 8 --warmup 2 \
            --json "$OUT/e2e_1gpu.json" ;;
    configs) for c in ${CONFIGS:-tiny llama-125m olmo-1b}; do  # CONFIG_PLAN=0 / CONFIG_RUN=0: skip one
               [ "${CONFIG_PLAN:-1}" = 1 ] && section configs 240 $PY train.py $(config_args $c) --plan
               [ "${CONFIG_RUN:-1}" = 1 ] || continue
               section configs ${CONFIG_LIMIT:-420} $PY "${HOST_RSS[@]}" $PY train.py $(config_args $c) \
                 --set run.steps=${CONFIG_STEPS:-6} ${CONFIG_EXTRA:-} --out-dir /tmp/cfg_$c --overwrite
               summary /tmp/cfg_$c 2>&1 | tee -a "$OUT/configs.log"
               du -sh /tmp/cfg_$c/checkpoints 2>&1 | tee -a "$OUT/configs.log"
               rm -rf /tmp/cfg_$c/checkpoints; done ;;
    sft) d=/tmp/sft_model  # configs/llama2-7b-sft.yaml from a random HF directory of its shape
         [ -f $d/tokenizer.json ] || section sft 300 $PY scripts/make_random_hf.py --preset llama2-7b \
           --out $d --sft $d/sft.jsonl --sft-examples ${SFT_EXAMPLES:-20000}
         for v in ${SFT_VARIANTS:-coat bf16}; do  # bf16: optax.adamw; _b4: batch 4, no microbatches
           extra=(); case $v in bf16*) extra+=(--set precision=bf16 --set optimizer.name=adamw) ;; esac
           case $v in *_b4) extra+=(--set optimizer.accumulate=1 --set data.batch_size=4) ;; esac
           section sft ${SFT_LIMIT:-420} $PY train.py --config configs/llama2-7b-sft.yaml --no-progress \
             --set model.init_from=$d --set "data.paths=[$d/sft.jsonl]" --set run.steps=${SFT_STEPS:-8} \
             --set run.log_every=2 --set run.eval_every=0 --set run.plot=false --set run.tensorboard=false \
             --set checkpoint.enabled=false --set run.plan_timed_steps=${PLAN_TIMED_STEPS:-1} \
             "${extra[@]}" --out-dir /tmp/sft_$v --overwrite
           summary /tmp/sft_$v 2>&1 | tee -a "$OUT/sft.log"; done ;;
    remat_sweep) c=${REMAT_CONFIG:-olmo-1b}
             for r in ${REMATS:-none fp8_residuals dots full} auto; do  # auto last: data cache warm
               section remat_sweep ${CONFIG_LIMIT:-200} $PY train.py $(config_args $c) \
                 --set model.remat=$r --set run.steps=${CONFIG_STEPS:-8} --set checkpoint.enabled=false \
                 --set run.out_dir=/tmp/sweep_$r --overwrite
               summary /tmp/sweep_$r 2>&1 | tee -a "$OUT/remat_sweep.log"; rm -rf /tmp/sweep_$r; done ;;
    equal7b) for b in ${EQUAL_BATCHES:-8 4}; do  # the first batch every mode fits, no microbatches
               ok=1
               for m in ${EQUAL_MODES:-bf16:adamw coat:coat_adamw}; do set -- ${m/:/ }
                 section equal7b ${CONFIG_LIMIT:-240} $PY train.py $(config_args llama2-7b) --set precision=$1 \
                   --set optimizer.name=$2 $(master_args $2) --set model.remat=${EQUAL_REMAT:-full} \
                   --set optimizer.accumulate=1 --set data.batch_size=$b --set run.steps=${CONFIG_STEPS:-6} \
                   --set checkpoint.enabled=false --set run.out_dir=/tmp/equal_$1_$b --overwrite || ok=0
                 summary /tmp/equal_$1_$b 2>&1 | tee -a "$OUT/equal7b.log"
                 [ $ok = 1 ] || break
               done
               [ $ok = 1 ] && break
             done ;;
    batch1b)  # OLMo-1B's shape (bench_e2e, layers unrolled, remat none), each mode at its largest
             # batch: BATCH1B="MODE:B1:B2..." entries, each batch tried largest first until one
             # runs (a batch that does not fit reports "oom" and the next is tried)
             for plan in ${BATCH1B:-bf16+adamw:24:22 coat+coat_adamw:40:38:36}; do
               IFS=: read -r mode rest <<< "$plan"; IFS=: read -ra sizes <<< "$rest"
               for b in "${sizes[@]}"; do
                 section batch1b ${CONFIG_LIMIT:-200} $PY -m benchmarks.step.bench_e2e --modes $mode \
                   --layers unrolled --batch $b --steps 6 --warmup 2
                 section_lines batch1b | grep -qF "$mode (unrolled) batch $b: ok in" && break
               done; done ;;
    batch7b)  # configs/llama2-7b.yaml, each mode at its largest batch without microbatches, remat
             # full: BATCH7B="PRECISION:OPTIMIZER:B1:B2..." entries, each batch tried largest first
             # until one runs (an out-of-memory run exits non-zero and the next batch is tried)
             for plan in ${BATCH7B:-bf16:adamw:16:12 coat:coat_adamw:56:48:40}; do
               IFS=: read -r prec opt rest <<< "$plan"; IFS=: read -ra sizes <<< "$rest"
               for b in "${sizes[@]}"; do
                 section batch7b ${CONFIG_LIMIT:-240} $PY train.py $(config_args llama2-7b) --set precision=$prec \
                   --set optimizer.name=$opt $(master_args $opt) --set model.remat=full \
                   --set optimizer.accumulate=1 --set data.batch_size=$b --set run.steps=${CONFIG_STEPS:-4} \
                   --set checkpoint.enabled=false --set run.out_dir=/tmp/batch7b_${prec}_$b --overwrite \
                   && { summary /tmp/batch7b_${prec}_$b 2>&1 | tee -a "$OUT/batch7b.log"; break; }
               done; done ;;
    largest)  # LARGEST_PLANS: PRECISION+OPTIMIZER:H:L:F:H:L:F..., shapes largest first; the first
             # that fits ends that entry and is appended to $OUT/largest_fits.txt (plans at remat full,
             # microbatches auto, global batch 64 x 2048; LARGEST_LIMIT: run.device_memory_limit,
             # 0 the device's own, 80767614976 an 80 GB H100's share at XLA_PYTHON_CLIENT_MEM_FRACTION 0.95)
             for plan in ${LARGEST_PLANS:-coat+coat_adamw:6144:52:16384:6144:48:16384 bf16+adamw:4096:36:11008:4096:32:11008}; do
               IFS=: read -r mode rest <<< "$plan"; IFS=: read -ra dims <<< "$rest"
               prec=${mode%+*} opt=${mode#*+}
               for ((i = 0; i < ${#dims[@]}; i += 3)); do
                 h=${dims[i]} l=${dims[i+1]} f=${dims[i+2]}
                 section largest ${LARGEST_TIMEOUT:-240} $PY train.py $(largest_args $opt $h $l $f) \
                   --set precision=$prec --set run.device_memory_limit=${LARGEST_LIMIT:-0} --plan
                 if section_lines largest | grep -q "^  chosen"; then
                   echo "$mode $h $l $f ${LARGEST_LIMIT:-0}" >> "$OUT/largest_fits.txt"; break
                 fi
               done; done ;;
    largest_run)  # LARGEST_RUN=PRECISION+OPTIMIZER:H:L:F, or unset: the last plan `largest` found fitting
             fit=$(tail -n 1 "$OUT/largest_fits.txt" 2>/dev/null | awk '{print $1 ":" $2 ":" $3 ":" $4}')
             [ -n "${LARGEST_RUN:-$fit}" ] || { echo "largest_run: no LARGEST_RUN and no plan found fitting" | tee -a "$OUT/largest.log"; continue; }
             IFS=: read -r mode h l f <<< "${LARGEST_RUN:-$fit}"
             prec=${mode%+*} opt=${mode#*+}
             section largest ${CONFIG_LIMIT:-420} $PY train.py $(largest_args $opt $h $l $f) \
               --set precision=$prec --set run.steps=${CONFIG_STEPS:-3} --set checkpoint.enabled=false \
               --set run.out_dir=/tmp/largest --overwrite
             summary /tmp/largest 2>&1 | tee -a "$OUT/largest.log" ;;
    *) echo "unknown section $s" >&2 ;;
  esac
done
