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
#   router  ${ROUTER_CMD:-$PYTHON -m megatron_tg.launch.router} --worker-urls URL... ...
#           (sglang_router.launch_router run in-process, its --api-key read from a file),
#           plus the plan's TG_ROUTER_ARGS (health-check flags that outlast a weight-sync
#           pause: megatron_tg/launch/router_health.py)
#   judge   ${JUDGE_CMD:-$PYTHON -m sglang.launch_server} --model-path M --served-model-name N ...
#   rollout_service  ${SERVICE_CMD:-$PYTHON -m megatron_tg.sampling.service} --recipe R [k=v ...]
#           (the trainer's arguments, TG_SERVICE_ARGS: docs/rollout-service.md)
# followed by ENGINE_ARGS / ROUTER_ARGS / JUDGE_ARGS / SERVICE_ARGS (word-split).
set -euo pipefail
: "${TG_JOB_DIR:?set by slurm/lib.sh}" "${TG_STEP_INDEX:?set by slurm/lib.sh}"

# Filled by the plan; declared here so a missing entry fails loudly under set -u.
TG_STEP_FIRST=() TG_SERVER_NAME=() TG_SERVER_ROLE=() TG_SERVER_PORT=() TG_SERVER_GPUS=()
TG_SERVER_LOG=() TG_SERVER_DIST=() TG_SERVER_NNODES=() TG_SERVER_BASE_GPU=() TG_ENGINE_URLS=() TG_ENGINE_ARGS=()
TG_SERVICE_ARGS=() TG_ROUTER_ARGS=() TG_ENGINE="" TG_ENGINE_MODEL="" TG_JUDGE_MODEL="" TG_JUDGE_NAME="" TG_KEY_FILE="" TG_SGLANG_AUTH=""
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
      # Colocated engines see every GPU of their node (shared with the trainer's step): each
      # starts at its own, the GPUs of the trainer ranks that write its weights.
      if [ "${TG_SERVER_BASE_GPU[i]}" -gt 0 ]; then args+=(--base-gpu-id "${TG_SERVER_BASE_GPU[i]}"); fi
    else
      read -r -a cmd <<<"${ENGINE_CMD:-$py -m megatron_tg.rollout.engine}"
      args=(--model "$TG_ENGINE_MODEL")
    fi
    # Flags the recipe requires (plan.engine_flags: routed experts, deterministic inference).
    args+=("${TG_ENGINE_ARGS[@]}")
    read -r -a extra <<<"${ENGINE_ARGS:-}"
    ;;
  router)
    read -r -a cmd <<<"${ROUTER_CMD:-$py -m megatron_tg.launch.router}"
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
    read -r -a cmd <<<"${SERVICE_CMD:-$py -m megatron_tg.sampling.service}"
    args=("${TG_SERVICE_ARGS[@]}")
    read -r -a extra <<<"${SERVICE_ARGS:-}"
    ;;
  *)
    echo "task.sh: server $i has unknown role '${TG_SERVER_ROLE[i]}'" >&2
    exit 2
    ;;
esac
# The job's API key (docs/security.md), by file name only: SGLang reads it from its --config
# YAML, the embedded engine and the router from the key file (megatron_tg.launch.router
# hands it to sglang-router in-process), the rollout service from rollout.api_key_file.
redact=0
if [ -n "$TG_KEY_FILE" ]; then
  [ -f "$TG_KEY_FILE" ] || { echo "task.sh: the job's API key $TG_KEY_FILE is missing (slurm/lib.sh makes it)" >&2; exit 2; }
  case "${TG_SERVER_ROLE[i]}" in
    engine) if [ "$TG_ENGINE" = sglang ]; then args+=(--config "$TG_SGLANG_AUTH"); redact=1
            else args+=(--api-key-file "$TG_KEY_FILE"); fi ;;
    judge) args+=(--config "$TG_SGLANG_AUTH"); redact=1 ;;
    router) args+=(--api-key-file "$TG_KEY_FILE") ;;
  esac
fi
args+=(--host 0.0.0.0 --port "$port")

echo "[task.sh $(date '+%F %T')] ${TG_SERVER_NAME[i]} node rank $rank on ${SLURMD_NODENAME:-$(hostname)}," \
  "restart ${SLURM_RESTART_COUNT:-0}, CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-<unset>}"
echo "+ ${cmd[*]} ${args[*]} ${extra[*]}"
if [ "$redact" = 1 ]; then
  # SGLang logs its server_args, api_key included: its output reaches the log through a
  # filter that replaces the key. Signals reach the server from Slurm directly; this shell
  # only waits (a trap, not an ignore, so the server keeps default handlers), and the filter
  # drains to EOF, so the server's last lines are logged. Exit status: the server's.
  trap 'true' TERM INT USR1
  set +e
  "${cmd[@]}" "${args[@]}" "${extra[@]}" 2>&1 | "$py" -m megatron_tg.auth redact --key-file "$TG_KEY_FILE"
  exit "${PIPESTATUS[0]}"
fi
exec "${cmd[@]}" "${args[@]}" "${extra[@]}"
