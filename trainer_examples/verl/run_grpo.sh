#!/usr/bin/env bash
# GRPO with verl 0.9.x + ainfer-pd rollout on one GPU host. Usage:
#   MODEL_PATH=/path/to/hf_checkpoint TRAIN_FILES=train.parquet VAL_FILES=val.parquet \
#   AINFER_PD_CONFIG=configs/verl-ep4.yaml trainer_examples/verl/run_grpo.sh [extra hydra overrides...]
set -euo pipefail
cd "$(dirname "$0")/../.."
: "${MODEL_PATH:?set MODEL_PATH to the actor's HF checkpoint}"
: "${TRAIN_FILES:?set TRAIN_FILES (verl RLHFDataset parquet)}"
: "${VAL_FILES:=$TRAIN_FILES}"
export AINFER_PD_CONFIG="${AINFER_PD_CONFIG:-configs/verl-ep4.yaml}"
# The verl.plugins entry point registers the backend when ainfer-pd is pip-installed; this also
# works from a plain checkout (PYTHONPATH) and in Ray workers, which inherit the variable.
export VERL_USE_EXTERNAL_MODULES="${VERL_USE_EXTERNAL_MODULES:-ainfer_pd.integrations.verl.register}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec python -m verl.trainer.main_ppo \
  --config-path="$PWD/trainer_examples/verl" --config-name=ainfer_pd_grpo \
  actor_rollout_ref.model.path="$MODEL_PATH" \
  data.train_files="$TRAIN_FILES" data.val_files="$VAL_FILES" \
  "$@"
