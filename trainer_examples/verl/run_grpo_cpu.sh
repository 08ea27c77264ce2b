#!/usr/bin/env bash
# verl's own trainer (python -m verl.trainer.main_ppo), GRPO, 2 steps, on CPU, with ainfer-pd as the
# rollout backend (rollout.name=ainfer_pd): a tiny Qwen3-MoE built with transformers is the actor
# (FSDP2 on gloo) and the rollout model (the replica loads actor_rollout_ref.model.path), weights synced
# by verl's naive checkpoint engine each step. See README.md ("CPU run") for what verl needs on CPU.
#   trainer_examples/verl/run_grpo_cpu.sh [WORK_DIR] [extra hydra overrides...]
set -euo pipefail
cd "$(dirname "$0")/../.."
WORK="${1:-${TMPDIR:-/tmp}/ainfer_pd_grpo_cpu}"
shift || true
if [ ! -f "$WORK/model/config.json" ]; then
  python -m trainer_examples.verl.make_tiny_cpu "$WORK"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# verl has no CPU platform: the plugin trainer_examples/verl/cpu_platform.py registers one.
export VERL_PLATFORM=cpu
export VERL_USE_EXTERNAL_MODULES="trainer_examples.verl.cpu_platform,ainfer_pd.integrations.verl.register"
# verl's FSDP engine is registered for cuda / npu only; the class itself is device-agnostic.
export VERL_ENGINE_DEVICE=cuda VERL_ENGINE_VENDOR=nvidia
export TOKENIZERS_PARALLELISM=false
exec python -m verl.trainer.main_ppo \
  --config-path="$PWD/trainer_examples/verl" --config-name=ainfer_pd_grpo \
  actor_rollout_ref.model.path="$WORK/model" \
  data.train_files="$WORK/train.parquet" data.val_files="$WORK/val.parquet" \
  data.train_batch_size=2 data.max_prompt_length=32 data.max_response_length=16 \
  data.dataloader_num_workers=0 \
  +ray_kwargs.ray_init.num_gpus=1 ray_kwargs.ray_init.num_cpus=8 \
  trainer.use_v1=False trainer.device=cpu trainer.n_gpus_per_node=1 trainer.nnodes=1 \
  trainer.total_training_steps=2 trainer.val_before_train=False trainer.test_freq=-1 trainer.save_freq=-1 \
  trainer.logger='[console]' trainer.experiment_name=grpo_cpu_smoke trainer.default_local_dir="$WORK/checkpoints" \
  hydra.run.dir="$WORK/hydra" \
  algorithm.use_kl_in_reward=False \
  actor_rollout_ref.model.use_remove_padding=False \
  +actor_rollout_ref.model.override_config.attn_implementation=sdpa \
  actor_rollout_ref.actor.strategy=fsdp2 \
  '+actor_rollout_ref.actor.fsdp_config.mixed_precision={param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}' \
  actor_rollout_ref.actor.use_kl_loss=False \
  actor_rollout_ref.actor.ppo_mini_batch_size=2 \
  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2 \
  actor_rollout_ref.actor.use_dynamic_bsz=False \
  actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2 \
  actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2 \
  actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
  actor_rollout_ref.rollout.data_parallel_size=1 \
  actor_rollout_ref.rollout.n=2 \
  actor_rollout_ref.rollout.prompt_length=32 actor_rollout_ref.rollout.response_length=16 \
  actor_rollout_ref.rollout.load_format=auto actor_rollout_ref.rollout.dtype=float32 \
  actor_rollout_ref.rollout.multi_turn.enable=False \
  actor_rollout_ref.rollout.agent.default_agent_loop=single_turn_agent \
  actor_rollout_ref.rollout.agent.num_workers=1 \
  actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=16 \
  actor_rollout_ref.rollout.engine_kwargs.ainfer_pd.config=configs/tiny-cpu.yaml \
  '~actor_rollout_ref.rollout.engine_kwargs.ainfer_pd.overrides' \
  "$@"
