"""What a build reads: checkpoint files and their facts (model_facts, counted from
headers without loading), GGUF checkpoints, tensor files written a tensor at a time,
calibration and evaluation text (textdata, the built-in corpus), the KV a config needs
(kv_budget: what the deploy profile sizes and the default context is bounded by). Imports nothing else of
pipeline."""
