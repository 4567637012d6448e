#!/usr/bin/env bash
# MFU of `jaxpar train` on one GPU: GPT-2 small and Llama-3.2-1B's dims in bf16, each
# run's end-of-run table and summary.json kept under $OUT (default ./gpu-mfu).
# Usage (from the repository root, with jax[cuda] installed): bash scripts/gpu_mfu.sh;
# ONLY=REGEX runs the rows whose names match.
set -u
OUT=${OUT:-gpu-mfu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
jaxpar() { python3 -c 'import sys; from jaxpar.cli.main import main; sys.exit(main())' "$@"; }
python3 -c 'import jax, flax, optax, orbax.checkpoint as o; print("jax", jax.__version__, "flax", flax.__version__, "optax", optax.__version__, "orbax", o.__version__, jax.devices())'
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader 2>/dev/null
train() {  # NAME, then the config and its overrides
  local name=$1; shift
  [[ $name =~ ${ONLY:-.} ]] || return 0
  local dir=${ROOT:-/tmp}/gpu-mfu/$name
  rm -rf "$dir"
  echo "== $name: $*"
  local start=$SECONDS
  jaxpar train --out "$dir" "$@" checkpoint.final=false 2>&1 | tr '\r' '\n' | grep -v "^train:" > "$OUT/$name.log"
  echo "   rc ${PIPESTATUS[0]} in $((SECONDS - start)) s"
  tail -15 "$OUT/$name.log"
  python3 - "$dir/metrics.jsonl" "$name" <<'PY' | tee -a "$OUT/rows.txt"
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
rows = [r for r in rows if "step_time_s" in r][len(rows) // 4 :]  # past warm-up
med = lambda k: statistics.median(r[k] or 0 for r in rows)
mean = statistics.mean(r["step_time_s"] for r in rows)  # saves and skips land in the mean
print(f"{sys.argv[2]:<26} step {med('step_time_s') * 1e3:8.1f} ms (mean {mean * 1e3:.1f})  tokens/s {med('tokens_per_s'):9.0f}  "
      f"TFLOP/s {med('flops_per_s_per_device') / 1e12:6.1f}  MFU {med('mfu'):.1%}")
PY
}
steps="train.steps=30 train.log_every=1"
train gpt-small-b32-s512 --config gpt-small $steps
# the cost of an asynchronous save every step (uncompressed, zstd, into memory) and every
# 10th, and of the spike check
train gpt-small-b32-s512-save1 --config gpt-small $steps checkpoint.every=1 checkpoint.keep=2
train gpt-small-b32-s512-save1-zstd --config gpt-small $steps checkpoint.every=1 checkpoint.keep=2 checkpoint.compress=true
(( $(df -k --output=avail /dev/shm | tail -1) > 8000000 )) &&
  ROOT=/dev/shm train gpt-small-b32-s512-save1-shm --config gpt-small $steps checkpoint.every=1 checkpoint.keep=2
train gpt-small-b32-s512-save10 --config gpt-small $steps checkpoint.every=10 checkpoint.keep=2
train gpt-small-b32-s512-spike --config gpt-small $steps train.on_spike=skip
train gpt-small-b32-s1024 --config gpt-small $steps train.seq_len=1024
train llama-1b-b8-s2048 --config llama-1b $steps train.batch_size=8 parallel.zero=0
train llama-1b-b8-s2048-muon --config llama-1b $steps train.batch_size=8 parallel.zero=0 train.optimizer=muon
# MuonClip: attention in the blocked form (cuDNN's kernel hands on no maxima)
train llama-1b-b8-s2048-muon-clip --config llama-1b $steps train.batch_size=8 parallel.zero=0 train.optimizer=muon muon.qk_clip=100
train llama-1b-b16-s2048-remat --config llama-1b $steps train.batch_size=16 parallel.zero=0 parallel.remat=full
# JAX takes 75% of a GPU's memory by default; 95% lets batch 16 run without recomputation
XLA_PYTHON_CLIENT_MEM_FRACTION=.95 train llama-1b-b16-s2048-mem95 --config llama-1b $steps train.batch_size=16 parallel.zero=0
echo "== rows"; cat "$OUT/rows.txt"
