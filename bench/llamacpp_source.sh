#!/usr/bin/env bash
# llama.cpp's source, trimmed for a CUDA build of llama-bench and llama-server on the device
# machine (no network there): the llama.cpp that llama-cpp-python 0.3.36 vendors (the project's
# reference), without its models, docs, UI sources and other backends' trees.
#   bash bench/llamacpp_source.sh       # -> .devcarry/llama.cpp-src.tar.gz (git-ignored; ~5 MB)
# Then a device call carries ".devcarry" and runs `bash bench/gpu_llamacpp.sh build` (see there).
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=0.3.36
OUT=.devcarry/llama.cpp-src.tar.gz
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$work"
tar -xzf "$work/llama_cpp_python-$VERSION.tar.gz" -C "$work"
src="$work/llama_cpp_python-$VERSION/vendor/llama.cpp"
keep=(CMakeLists.txt LICENSE cmake common include src vendor licenses
      ggml/CMakeLists.txt ggml/cmake ggml/include ggml/src
      tools/CMakeLists.txt tools/llama-bench tools/server tools/mtmd tools/ui/CMakeLists.txt
      tools/ui/sources.cmake tools/ui/ui.cpp.in tools/ui/ui.h.in scripts/ui-assets.cmake)
drop=(ggml/src/ggml-cann ggml/src/ggml-hexagon ggml/src/ggml-hip ggml/src/ggml-metal ggml/src/ggml-musa
      ggml/src/ggml-opencl ggml/src/ggml-openvino ggml/src/ggml-sycl ggml/src/ggml-virtgpu
      ggml/src/ggml-vulkan ggml/src/ggml-webgpu ggml/src/ggml-zdnn ggml/src/ggml-zendnn ggml/src/ggml-et
      )
for d in "${drop[@]}"; do rm -rf "${src:?}/$d"; done
# tools/CMakeLists.txt adds every tool: keep only the ones kept here
python3 - "$src/tools/CMakeLists.txt" <<'PY'
import re, sys
p = sys.argv[1]
s = open(p).read()
for tool in ("batched-bench", "gguf-split", "imatrix", "completion", "perplexity", "quantize", "cli",
             "tokenize", "tts", "rpc", "cvector-generator", "export-lora", "fit-params", "tuning", "results"):
    s = re.sub(rf"^\s*add_subdirectory\({tool}\)\s*$", "", s, flags=re.M)
open(p, "w").write(s)
PY
mkdir -p .devcarry
tar -czf "$OUT" -C "$src" "${keep[@]}"
echo "$OUT: $(du -h "$OUT" | cut -f1) (llama.cpp of llama-cpp-python $VERSION)"
