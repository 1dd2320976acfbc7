#!/usr/bin/env bash
# The GPU check (no network): build llama-server with CUDA from the trimmed llama.cpp source, generate a
# ~0.8 B layer-skip target/draft pair, measure speedup vs k, the goodput surface at c = 1..32 and the
# switch cost, and write a JSON. See benchmarks/gpu/check.py and the README's "GPU check".
#
#   bash benchmarks/gpu/check.sh [--src benchmarks/gpu/llama.cpp-src.tar.gz] [--out gpu-results.json]
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
python="${PYTHON:-python3}"
for tool in nvidia-smi nvcc cmake "$python"; do
  command -v "$tool" >/dev/null || { echo "check.sh: $tool not found on PATH" >&2; exit 2; }
done
"$python" -c "import numpy" 2>/dev/null || { echo "check.sh: $python has no numpy" >&2; exit 2; }
exec "$python" "$here/check.py" run "$@"
