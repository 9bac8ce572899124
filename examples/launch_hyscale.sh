#!/usr/bin/env bash
# Multi-GPU launch: Megatron pretrain (torchrun, NCCL) of a DSA GPT.
# launch_stock.sh and launch_hyscale.sh are the same script except for SPEC and HYSCALE_ARGS
# (see examples/README.md for the diff). Any extra arguments are appended as Megatron flags.
set -euo pipefail
cd "$(dirname "$0")/.."

# ---- parallel layout: world size = TP * PP * CP * DP --------------------------------------
TP=${TP:-1}            # tensor parallel
PP=${PP:-1}            # pipeline parallel (VPP: add --num-layers-per-virtual-pipeline-stage N)
CP=${CP:-1}            # context parallel
DP=${DP:-8}            # data parallel
NNODES=${NNODES:-1}; NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}; MASTER_PORT=${MASTER_PORT:-29500}
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}   # Megatron requires it with TP/CP > 1 (pre-Blackwell)
GPUS_PER_NODE=$(( TP * PP * CP * DP / NNODES ))

# ---- model, data, batch --------------------------------------------------------------------
MODEL_ARGS=${MODEL_ARGS:-configs/deepseek_v32_multigpu.args}   # or configs/glm51_multigpu.args
SEQ=${SEQ:-32768}
MBS=${MBS:-1}; GBS=${GBS:-$(( DP * MBS ))}
ITERS=${ITERS:-100}
DATA_ARGS="--mock-data"; [[ -n "${DATA_PATH:-}" ]] && DATA_ARGS="--data-path ${DATA_PATH} --split 99,1,0"
RECOMPUTE_ARGS="--recompute-granularity full --recompute-method uniform --recompute-num-layers 1"
DSA_BACKEND=${DSA_BACKEND:-none}      # stock's kernels: none | tilelang | cudnn (same for both scripts)
# absorbed-MLA DSA needs --sequence-parallel when TP > 1, which needs Transformer Engine (or apex)
# norms: with TP > 1 also set TRANSFORMER_IMPL=transformer_engine
SP_ARGS=""; if (( TP > 1 )); then SP_ARGS="--sequence-parallel"; fi
IMPL_ARGS="--transformer-impl ${TRANSFORMER_IMPL:-local} --no-gradient-accumulation-fusion --no-dsa-indexer-rotate-activation"

# ---- DSA implementation ------------------------------------------------------------------------
SPEC="hyscale_megatron.specs hyscale_block_spec"
HYSCALE_ARGS="--hyscale --hyscale-replay --hyscale-topk-impl auto --hyscale-attn-impl auto"

torchrun --nproc-per-node "$GPUS_PER_NODE" --nnodes "$NNODES" --node-rank "$NODE_RANK" \
  --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" \
  -m hyscale_megatron.tools.train "@${MODEL_ARGS}" \
  --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP" \
  --context-parallel-size "$CP" $SP_ARGS \
  --seq-length "$SEQ" --max-position-embeddings "$SEQ" \
  --micro-batch-size "$MBS" --global-batch-size "$GBS" --train-iters "$ITERS" \
  $DATA_ARGS $RECOMPUTE_ARGS $IMPL_ARGS --dsa-kernel-backend "$DSA_BACKEND" \
  --spec $SPEC $HYSCALE_ARGS \
  "$@"
