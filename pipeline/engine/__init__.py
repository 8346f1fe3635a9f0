"""The engine: config and its schema, where everything lives (layout), the cache key
(codedeps, the toolchain files), dvc.yaml (dvcgen), running one stage (run_stage) and a
build (build), manifests and locks. It imports only pipeline.sources and pipeline.toolchains
(to validate a model and text source before any stage runs, and fingerprint toolchains):
never a quantizer, a graph builder, a runtime or a measurement."""
