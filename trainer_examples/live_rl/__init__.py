"""Live-RL example: GRPO on the tiny MoE against a running RolloutWorker (see README.md)."""
