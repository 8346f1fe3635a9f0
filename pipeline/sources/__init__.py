"""What a build reads: checkpoint files and their facts (model_facts, counted from
headers without loading), GGUF checkpoints, tensor files written a tensor at a time,
calibration and evaluation text (textdata, the built-in corpus). Imports nothing else of
pipeline."""
