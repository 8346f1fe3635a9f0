"""External toolchains the project fetches or installs, and their identity in the
cache key: llama.cpp's converter, vLLM's CPU build in its own venv (and its server),
and the toolchain fingerprint the probe writes."""
