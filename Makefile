# Two commands on a fresh machine: `make demo` and `make test`. Both make the virtualenv first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
OUT ?= out/demo
DEMO_ARGS ?=

RECIPE ?= bangla-0.4b
ARGS ?=

.PHONY: demo test test-fast lint format recipe recipe-dry-run bench-tokenizer bench-train bench-export bench-serve bench-core bench-load bench-spec bench-quant-quality bench-runtimes check-arm64 check-avx2 clean

# The demo needs only the three stages' extras; the tests add [dev] (pytest, lm-eval, openai,
# selenium, transformers for the parity tests).
# torch first: the CUDA build with an NVIDIA GPU, a CPU build without one (PyPI's Linux torch
# is the 6 GB CUDA build); .ci/torch_build.py says which in one line.
$(BIN)/.installed-demo: pyproject.toml .ci/torch_build.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python .ci/torch_build.py
	$(BIN)/pip install -e '.[train,export,serve]'
	touch $@

$(BIN)/.installed: pyproject.toml .ci/torch_build.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python .ci/torch_build.py
	$(BIN)/pip install -e '.[all]'
	touch $@ $(BIN)/.installed-demo

demo: $(BIN)/.installed-demo  # make demo DEMO_ARGS=--serve: keep the server up at the end
	$(BIN)/doel demo --out $(OUT) $(DEMO_ARGS)

# The rented-GPU recipe: data -> tokenizer -> shards -> verify -> train -> eval -> bundles, with
# the projected time and cost asked for before training (ARGS='--yes --price-per-hour 2.5').
recipe: $(BIN)/.installed-demo
	$(BIN)/pip install -q -e '.[all,hub]'
	$(BIN)/doel recipe $(RECIPE) $(ARGS)

# The same stages at tiny scale on this CPU, from local stand-ins: a few minutes, no GPU, no network.
recipe-dry-run: $(BIN)/.installed-demo
	$(BIN)/doel recipe $(RECIPE) --dry-run --yes $(ARGS)

test: $(BIN)/.installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest

# The inner loop while changing code: the tests not marked slow (no spawned process, no bundle
# built), in seconds rather than minutes. `make test` (CI) runs them all, with the lint.
test-fast: $(BIN)/.installed
	$(BIN)/python -m pytest -m "not slow"

lint: $(BIN)/.installed
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

format: $(BIN)/.installed
	$(BIN)/ruff format . && $(BIN)/ruff check --fix .

bench-tokenizer: $(BIN)/.installed
	$(BIN)/python -m benchmarks.train.bench_tokenizer

bench-train: $(BIN)/.installed
	$(BIN)/python -m benchmarks.train.bench_train

bench-export: $(BIN)/.installed
	$(BIN)/python -m benchmarks.export.bench_export

# llama-cpp-python is benchmark-only: `$(BIN)/python -m benchmarks.serve.bench_serve --install-llama-cpp`
bench-serve: $(BIN)/.installed
	$(BIN)/python -m benchmarks.serve.bench_serve

# The serving core before issue 53's changes (a worktree of 61dc752) and after, in one run: chats
# without max_tokens at 16 clients under --kv-positions 8192, the time between tokens at 8 and 16
bench-core: $(BIN)/.installed
	flock /tmp/doel-bench.lock $(BIN)/python -m benchmarks.load.bench_core

# doel-serve vs llama-server under 1-16 clients, and vs onnxruntime-genai in-process; builds
# llama-server and the onnxruntime-genai venv once (cached in ~/.cache/doel), holds the bench lock
bench-load: $(BIN)/.installed
	flock /tmp/doel-bench.lock $(BIN)/python -m benchmarks.load.bench_load --install-llama-server --install-ortgenai --chat --inproc

# Prompt-lookup drafting on SmolLM2-135M: the draft length, doel-serve against llama-server's
# ngram drafting at 1 and 8 clients (builds llama-server once, as bench-load does)
bench-spec: $(BIN)/.installed
	flock /tmp/doel-bench.lock $(BIN)/python -m benchmarks.serve.bench_spec

# Each runtime people install (onnxruntime-genai, Ollama's Go templates, llama-server,
# transformers) on doel's default model, each row printed by that tool itself
bench-runtimes: $(BIN)/.installed
	flock /tmp/doel-bench.lock $(BIN)/python -m benchmarks.runtimes.bench_runtimes

# Held-out loss of doel's int4/int8 bundles against llama.cpp's q4_0/q8_0 on a trained checkpoint
bench-quant-quality: $(BIN)/.installed
	$(BIN)/python -m benchmarks.export.bench_quant_quality

# serve/'s engine on the int4 and int8 bundles (model.onnx and model.ort) in an emulated ARM64
# userland against x86 (qemu; the first run builds ~/.cache/doel/arm64 with apt-get and pip,
# later runs need no network). Default: make demo's model, exported with --mobile; or
# ARM_BUNDLES='DIR ...'. Takes minutes under emulation, so CI runs only its unit tests.
ARM_BUNDLES ?=
check-arm64: $(BIN)/.installed
ifeq ($(strip $(ARM_BUNDLES)),)
	test -d $(OUT)/run/final || $(MAKE) demo
	for q in int4 int8; do test -f $(OUT)/arm64-$$q/model.ort || $(BIN)/doel-export \
	  $(OUT)/run/final --out $(OUT)/arm64-$$q --quant $$q --mobile --force || exit 1; done
	$(BIN)/python -m benchmarks.checks.check_arm64 $(OUT)/arm64-int4 $(OUT)/arm64-int8 $(ARGS)
else
	$(BIN)/python -m benchmarks.checks.check_arm64 $(ARM_BUNDLES) $(ARGS)
endif

# The same engine on the int4 and int8 bundles under qemu's x86_64 emulator with an AVX2-only
# CPU model (no AVX-512, no VNNI) against this machine: correctness only. Needs
# qemu-user-static (apt-get). Default: make demo's model; or AVX2_BUNDLES='DIR ...'.
AVX2_BUNDLES ?=
check-avx2: $(BIN)/.installed
ifeq ($(strip $(AVX2_BUNDLES)),)
	test -d $(OUT)/run/final || $(MAKE) demo
	for q in int4 int8; do test -f $(OUT)/avx2-$$q/model.onnx || $(BIN)/doel-export \
	  $(OUT)/run/final --out $(OUT)/avx2-$$q --quant $$q --force || exit 1; done
	$(BIN)/python -m benchmarks.checks.check_avx2 $(OUT)/avx2-int4 $(OUT)/avx2-int8 $(ARGS)
else
	$(BIN)/python -m benchmarks.checks.check_avx2 $(AVX2_BUNDLES) $(ARGS)
endif

clean:
	rm -rf $(VENV) out
