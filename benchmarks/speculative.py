"""Prompt-lookup speculative decoding against plain greedy decoding on one pack folder (the figures the
benchmark stage reports as `speculative`, with more options): pipeline/measure/speculative.py.

    python benchmarks/speculative.py artifacts/x86_avx512-embedded-speed/pack
    python benchmarks/speculative.py PACK --passes 5 --threads 2 --new 128 --draft-max 8,8f --json out.json
    python benchmarks/speculative.py model.gguf    # llama-server's --spec-type modes on a GGUF (its plain greedy the base)
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.measure.speculative import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
