#!/usr/bin/env bash
# Build llama.cpp's llama-perplexity tool from the llama.cpp that llama-cpp-python vendors (its sdist),
# for tests/test_kld_llamacpp.py's cross-check of pipeline/measure/kld.py. llama-cpp-python ships the library,
# not the tools. Usage: benchmarks/build_llama_perplexity.sh [DEST]   (default: .cache/llama-perplexity)
# then: export EDGEKILN_LLAMA_PERPLEXITY=DEST/llama-perplexity
# Built without -march=native and without AMX, as the benchmarks' llama-cpp-python (benchmarks/README.md).
set -euo pipefail
dest=${1:-.cache/llama-perplexity}
version=$(python -c "import llama_cpp; print(llama_cpp.__version__)")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python - "$version" "$work" <<'PY'
import re, sys, urllib.request
version, work = sys.argv[1], sys.argv[2]
html = urllib.request.urlopen("https://pypi.org/simple/llama-cpp-python/").read().decode()
url = re.findall(r'href="([^"#]+llama_cpp_python-' + re.escape(version) + r'\.tar\.gz)', html)[0]
urllib.request.urlretrieve(url, f"{work}/sdist.tar.gz")
PY
tar xzf "$work/sdist.tar.gz" -C "$work"
src="$work/llama_cpp_python-$version/vendor/llama.cpp"
cmake -S "$src" -B "$work/build" -DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON \
    -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=OFF -DBUILD_SHARED_LIBS=OFF -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$work/build" --target llama-perplexity -j "$(nproc)"
mkdir -p "$dest"
cp "$work/build/bin/llama-perplexity" "$dest/"
echo "export EDGEKILN_LLAMA_PERPLEXITY=$(cd "$dest" && pwd)/llama-perplexity"
