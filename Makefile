# Thin wrapper: the logic lives in tools/setup.sh.
#   make setup                 idempotent set-up (apt, .venv, project, models, kp)
#   make run [PROMPT="..."] [N=64]   a chat turn with the default model (qwen2.5-coder-0.5b)
#   make test                  whole pytest suite
#   make bench
#   make docs                  the documentation site (MkDocs, strict) into site/
ROOT   := $(patsubst %/,%,$(dir $(abspath $(lastword $(MAKEFILE_LIST)))))
VENV   ?= $(ROOT)/.venv
PROMPT ?= Write a Python function that reverses a string.
N      ?= 64
# Pass PROMPT through literally (quotes, $, % survive).
override PROMPT := $(value PROMPT)
export VENV PROMPT N

STAMP := $(VENV)/.setup/complete

.PHONY: setup run test bench docs
.DEFAULT_GOAL := setup

setup:
	@"$(ROOT)/tools/setup.sh"

# "setup if needed": rerun when the venv is gone or a set-up input (pyproject, setup.sh, the kp patch, ...) changed.
$(STAMP): $(ROOT)/pyproject.toml $(ROOT)/tools/setup.sh $(ROOT)/tools/kp-0.9.0.patch $(ROOT)/engine/catalog.py $(ROOT)/engine/pull.py $(ROOT)/tools/build_kp_barrier.py $(ROOT)/backends/vulkan/native/kp_barrier.cpp
	@"$(ROOT)/tools/setup.sh"

run: $(STAMP)
	@cd "$(ROOT)" && "$$VENV/bin/engine" run --chat -p "$$PROMPT" -n "$$N"

test: $(STAMP)
	@cd "$(ROOT)" && "$$VENV/bin/python" -m pytest -q --tb=short --durations=25 -n 2 --dist loadfile --no-loadscope-reorder

bench: $(STAMP)
	@cd "$(ROOT)" && "$$VENV/bin/engine" bench

docs: $(STAMP)
	@cd "$(ROOT)" && NO_MKDOCS_2_WARNING=1 "$$VENV/bin/python" -m mkdocs build --strict
