#!/usr/bin/env bash
# Every benchmark of the project on one GPU, one JSON line per benchmark ({"benchmark": name, ...}),
# in under 8 minutes on an H200:
#   packing       tools/bench_packing.py, Qwen3-0.6B bf16: padded vs packed + token budget (TE's THD
#                 attention where TE imports, else FlexAttention's document mask)
#   train_dense   tools/bench_train_step.py --preset dense-1b, seq 4096 x mbs 2, bf16, with MFU
#   train_moe     tools/bench_train_step.py --preset moe, seq 4096 x mbs 2, bf16, with MFU
#   logprob       tools/bench_logprob.py, bf16, 8192 tokens x hidden 4096 -> vocab 151936
#   offload       tools/bench_train_step.py --offload: the engine's host-memory round trip
#   algos, bridge tools/bench_algos.py, tools/bench_bridge.py (CPU-side figures of the same machine)
#   transports    tools/bench_transports.py: 1 GiB streamed process to process by shm, broadcast,
#                 cuda_ipc (one GPU) and nccl (GPU 0 -> GPU 1; skipped with one GPU), vs one copy
#   weight_sync   tools/bench_weight_sync.py (needs vLLM; a "skipped" line without it)
#   rollout_node  tests/megatron_rl/trainer/gpu_node.py --gpus N: the trainer on the node's N GPUs with N//2
#                 TP=2 vLLM engines (shm and cuda_ipc sync, log-prob parity) and an NCCL sync into two
#                 separate engines; needs vLLM and >= 2 GPUs ("skipped" naming the GPU count otherwise);
#                 --smoke prints the expected engine maps of an 8-GPU node instead
#
#   tools/bench_gpu.sh            # on a GPU machine
#   tools/bench_gpu.sh --smoke    # tiny sizes, CPU, ~1 minute (tests/test_tools_bench_gpu.py runs it)
#   tools/bench_gpu.sh --check    # every GPU-only path once with tiny models (tools/gpu_check.py): one
#                                 # PASS / FAIL / SKIP line per path in under 5 minutes; no benchmark
# Without CUDA the smoke variant runs. A failing benchmark prints {"benchmark": ..., "error": ...} and
# makes the script exit 1 after the others ran.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the tools import megatron_rl / parallel from this checkout
PY=${PYTHON:-python}
if [[ "${1:-}" == "--check" ]]; then
  exec $PY tools/gpu_check.py
fi
smoke=0
[[ "${1:-}" == "--smoke" ]] && smoke=1
if [[ $smoke == 0 ]] && ! $PY -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "bench_gpu.sh: no CUDA device; running the --smoke variant on CPU" >&2
  smoke=1
fi
failed=0
log=$(mktemp -d)
trap 'rm -rf "$log"' EXIT

# run NAME CMD...: the command's last stdout line (a JSON object) re-emitted with "benchmark": NAME.
run() {
  local name=$1; shift
  local start=$SECONDS
  if "$@" >"$log/$name.out" 2>"$log/$name.err"; then
    $PY - "$name" "$log/$name.out" "$((SECONDS - start))" <<'EOF' || failed=1
import json, sys
name, path, seconds = sys.argv[1], sys.argv[2], int(sys.argv[3])
lines = [l for l in open(path).read().splitlines() if l.strip()]
result = json.loads(lines[-1])
print(json.dumps({"benchmark": name, "wall_s": seconds, **result}), flush=True)
EOF
  else
    failed=1
    $PY -c 'import json, sys; print(json.dumps({"benchmark": sys.argv[1], "error": sys.argv[2][-2000:]}))' \
      "$name" "$(tail -n 20 "$log/$name.err")"
  fi
}

if [[ $smoke == 1 ]]; then
  run packing     $PY tools/bench_packing.py --smoke
  run train_dense $PY tools/bench_train_step.py --preset tiny --seq 64 --steps 1 --warmup 0
  run train_moe   $PY tools/bench_train_step.py --preset tiny-moe --seq 64 --steps 1 --warmup 0
  run logprob     $PY tools/bench_logprob.py --tokens 64 --vocab 512 --hidden 32 --chunk-size 16 \
                    --linear-chunk-size 16 --iters 1 --warmup 0
  run offload     $PY tools/bench_train_step.py --preset tiny --seq 64 --steps 1 --warmup 0 --offload
  run algos       $PY tools/bench_algos.py --num-responses 64 --group-size 4 --response-length 16 --repeats 1
  run bridge      $PY tools/bench_bridge.py --hidden 64 --ffn 128 --layers 2 --heads 4 --kv-heads 2 --vocab 512 \
                    --bucket-mb 0.05 --repeats 1
  run transports  $PY tools/bench_transports.py --smoke
  # tests/test_tools_bench_weight_sync.py runs the vLLM benchmark itself; starting vLLM here would double it.
  $PY -c 'import json; print(json.dumps({"benchmark": "weight_sync", "skipped": "smoke: run by tests/test_tools_bench_weight_sync.py"}))'
  run rollout_node $PY -m tests.megatron_rl.trainer.gpu_node --plan 8
else
  run packing     $PY tools/bench_packing.py --preset qwen3-0.6b --dtype bf16 --repeats 3
  run train_dense $PY tools/bench_train_step.py --preset dense-1b --seq 4096 --mbs 2 --dtype bf16
  run train_moe   $PY tools/bench_train_step.py --preset moe --seq 4096 --mbs 2 --dtype bf16
  run logprob     $PY tools/bench_logprob.py --device cuda --dtype bf16 --tokens 8192 --vocab 151936 --hidden 4096
  run offload     $PY tools/bench_train_step.py --preset dense-1b --seq 1024 --mbs 1 --dtype bf16 --steps 1 --offload
  run algos       $PY tools/bench_algos.py
  run bridge      $PY tools/bench_bridge.py
  run transports  $PY tools/bench_transports.py
  if $PY -c 'import vllm' 2>/dev/null; then
    run weight_sync $PY tools/bench_weight_sync.py --transport shm
  else
    $PY -c 'import json; print(json.dumps({"benchmark": "weight_sync", "skipped": "vllm does not import"}))'
  fi
  gpus=$($PY -c 'import torch; print(torch.cuda.device_count())')
  if (( gpus < 2 )); then  # e.g. one H200: the TP=2 case cannot run here
    $PY -c 'import json, sys; from tests.megatron_rl.trainer.gpu_node import too_few_gpus
print(json.dumps({"benchmark": "rollout_node", "skipped": too_few_gpus(int(sys.argv[1]), "colocated")}))' "$gpus"
  elif ! $PY -c 'import vllm' 2>/dev/null; then
    $PY -c 'import json; print(json.dumps({"benchmark": "rollout_node", "skipped": "vllm does not import"}))'
  else
    run rollout_node $PY -m tests.megatron_rl.trainer.gpu_node --gpus "$gpus"
  fi
fi
exit $failed
