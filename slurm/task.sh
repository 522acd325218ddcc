#!/usr/bin/env bash
# One task of a server step (engine, router or judge), started by slurm/lib.sh via srun.
#
# The step's task picks its server from the plan: server TG_STEP_FIRST[step] + SLURM_LOCALID
# (several engines packed on a node), node rank SLURM_NODEID (a server spanning nodes). It
# appends to that server's log and execs the server, so Slurm's signals reach the server
# process itself. Commands per role, each overridable (tests use a fake server):
#   engine  ENGINE=sglang:   ${ENGINE_CMD:-$PYTHON -m sglang.launch_server} --model-path M --tp-size T ...
#                            plus the plan's TG_ENGINE_ARGS (--enable-deterministic-inference
#                            when rollout.sampling_seed is set)
#           ENGINE=embedded: ${ENGINE_CMD:-$PYTHON -m megatron_tg.rollout.engine} --model M ...
#   router  ${ROUTER_CMD:-$PYTHON -m sglang_router.launch_router} --worker-urls URL... ...
#           plus the plan's TG_ROUTER_ARGS (health-check flags that outlast a weight-sync
#           pause: megatron_tg/launch/router_health.py)
#   judge   ${JUDGE_CMD:-$PYTHON -m sglang.launch_server} --model-path M --served-model-name N ...
#   rollout_service  ${SERVICE_CMD:-$PYTHON -m megatron_tg.train.service} --recipe R [k=v ...]
#           (the trainer's arguments, TG_SERVICE_ARGS: docs/rollout-service.md)
# followed by ENGINE_ARGS / ROUTER_ARGS / JUDGE_ARGS / SERVICE_ARGS (word-split).
set -euo pipefail
: "${TG_JOB_DIR:?set by slurm/lib.sh}" "${TG_STEP_INDEX:?set by slurm/lib.sh}"

# Filled by the plan; declared here so a missing entry fails loudly under set -u.
TG_STEP_FIRST=() TG_SERVER_NAME=() TG_SERVER_ROLE=() TG_SERVER_PORT=() TG_SERVER_GPUS=()
TG_SERVER_LOG=() TG_SERVER_DIST=() TG_SERVER_NNODES=() TG_ENGINE_URLS=() TG_ENGINE_ARGS=()
TG_SERVICE_ARGS=() TG_ROUTER_ARGS=() TG_ENGINE="" TG_ENGINE_MODEL="" TG_JUDGE_MODEL="" TG_JUDGE_NAME=""
# shellcheck source=/dev/null
source "$TG_JOB_DIR/plan.env"

i=$((TG_STEP_FIRST[TG_STEP_INDEX] + ${SLURM_LOCALID:-0}))
rank="${SLURM_NODEID:-0}"
log="${TG_SERVER_LOG[i]}"
if [ "$rank" -gt 0 ]; then log="${log%.log}.node$rank.log"; fi
exec >>"$log" 2>&1

py="${PYTHON:-python3}"
port="${TG_SERVER_PORT[i]}"
# Ranks of a node-spanning server meet at its first node; only rank 0 serves HTTP.
multi=()
if [ "${TG_SERVER_NNODES[i]}" -gt 1 ]; then
  multi=(--nnodes "${TG_SERVER_NNODES[i]}" --node-rank "$rank" --dist-init-addr "${TG_SERVER_DIST[i]}")
fi
cmd=() args=() extra=()
case "${TG_SERVER_ROLE[i]}" in
  engine)
    if [ "$TG_ENGINE" = sglang ]; then
      read -r -a cmd <<<"${ENGINE_CMD:-$py -m sglang.launch_server}"
      args=(--model-path "$TG_ENGINE_MODEL" --tp-size "${TG_SERVER_GPUS[i]}" "${multi[@]}")
    else
      read -r -a cmd <<<"${ENGINE_CMD:-$py -m megatron_tg.rollout.engine}"
      args=(--model "$TG_ENGINE_MODEL")
    fi
    # Flags the recipe requires (plan.engine_flags: routed experts, deterministic inference).
    args+=("${TG_ENGINE_ARGS[@]}")
    read -r -a extra <<<"${ENGINE_ARGS:-}"
    ;;
  router)
    read -r -a cmd <<<"${ROUTER_CMD:-$py -m sglang_router.launch_router}"
    args=(--worker-urls "${TG_ENGINE_URLS[@]}" "${TG_ROUTER_ARGS[@]}")
    read -r -a extra <<<"${ROUTER_ARGS:-}"
    ;;
  judge)
    read -r -a cmd <<<"${JUDGE_CMD:-$py -m sglang.launch_server}"
    args=(--model-path "$TG_JUDGE_MODEL" --served-model-name "$TG_JUDGE_NAME"
          --tp-size "${TG_SERVER_GPUS[i]}" "${multi[@]}")
    read -r -a extra <<<"${JUDGE_ARGS:-}"
    ;;
  rollout_service)
    read -r -a cmd <<<"${SERVICE_CMD:-$py -m megatron_tg.train.service}"
    args=("${TG_SERVICE_ARGS[@]}")
    read -r -a extra <<<"${SERVICE_ARGS:-}"
    ;;
  *)
    echo "task.sh: server $i has unknown role '${TG_SERVER_ROLE[i]}'" >&2
    exit 2
    ;;
esac
args+=(--host 0.0.0.0 --port "$port")

echo "[task.sh $(date '+%F %T')] ${TG_SERVER_NAME[i]} node rank $rank on ${SLURMD_NODENAME:-$(hostname)}," \
  "restart ${SLURM_RESTART_COUNT:-0}, CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-<unset>}"
echo "+ ${cmd[*]} ${args[*]} ${extra[*]}"
exec "${cmd[@]}" "${args[@]}" "${extra[@]}"
