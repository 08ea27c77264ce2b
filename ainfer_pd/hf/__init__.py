"""Hugging Face checkpoints: ``config.json`` -> :class:`~ainfer_pd.config.ModelConfig`
(:mod:`.config`), the weight names of each architecture -> this engine's parameters
(:mod:`.names`), and the lazy, expert-parallel-aware safetensors reader (:mod:`.checkpoint`);
``quantization_config`` (blockwise FP8 only) in :mod:`.quant_config`.

Supported ``model_type``: ``qwen3_moe``, ``qwen2_moe``, ``mixtral``, ``glm4_moe``: each one
config-driven variant of the single segmented decoder in :mod:`ainfer_pd.engine.model.model`.
"""
