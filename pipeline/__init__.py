"""The edgekiln engine: resolves config, keys the cache, generates dvc.yaml and runs stages."""
