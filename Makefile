# Two front-door commands; each sets itself up on a fresh clone.
#   make demo   several ranks on localhost under torchrun: a checked allreduce and its bandwidth
#   make test   type checks (mypy, configured in pyproject.toml), then the default test suite
#   (make test-slow runs the tests marked slow: timing, torch's own suite, simulated hosts,
#   the fault matrix, and the device kernels' compilation by NVRTC; make soak runs 300
#   seeded random faults)
# make docs regenerates from the code and bench/results/: docs/tutorial.md, its figures and the
# README's explain picture and page (docs/build_tutorial.py); docs/settings.md, docs/support.md
# and the figures of README.md and docs/benchmarks.md (docs/build_reference.py). Each has
# --check, which the default test suite runs.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test test-slow kernels-compile soak bench bench-quick bench-small gpu-check lint docs setup clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt ringcomm/transport/_board_round.c
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[test,bench]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/torchrun --standalone --nproc-per-node 4 examples/allreduce_demo.py

test: $(STAMP)
	$(PY) -m mypy
	$(PY) -m pytest -q -m "not slow"

test-slow: $(STAMP) kernels-compile
	$(PY) -m pytest -q -m slow

# The device kernels compiled by NVRTC for every architecture they target, and their launch
# checked against the CUDA source, in a venv of their own with CuPy's NVRTC binding and
# NVRTC's library (no GPU needed; the main venv stays without CuPy, as a CPU user's is).
NVRTC_VENV  := .venv-nvrtc
NVRTC_STAMP := $(NVRTC_VENV)/.installed
$(NVRTC_STAMP): pyproject.toml constraints.txt
	test -x $(NVRTC_VENV)/bin/python || $(PYTHON) -m venv $(NVRTC_VENV)
	$(NVRTC_VENV)/bin/python -m pip install -q --upgrade pip
	$(NVRTC_VENV)/bin/python -m pip install -q -c constraints.txt cupy-cuda12x \
		nvidia-cuda-nvrtc-cu12 numpy ml_dtypes pyzmq xxhash pytest pytest-timeout hypothesis
	touch $(NVRTC_STAMP)

kernels-compile: $(NVRTC_STAMP)
	PYTHONPATH=$(CURDIR) $(NVRTC_VENV)/bin/python -m pytest -q -p no:cacheprovider \
		tests/test_kernels_compile.py tests/test_kernel_launch.py -k "not unchecked"

# Seeded random faults (kill, delay, drop, corrupt) in random ops at world sizes 2-4 over
# real processes, counted by outcome (about 5 minutes on 2 cores); SEED=n repeats a run.
SOAK_TRIALS ?= 300
soak: $(STAMP)
	$(PY) tests/fault_soak.py --trials $(SOAK_TRIALS) $(if $(SEED),--seed $(SEED))

lint: $(STAMP)
	$(VENV)/bin/ruff check .

docs: $(STAMP)
	$(PY) docs/build_tutorial.py
	$(PY) docs/build_reference.py

# The figures README.md and docs/benchmarks.md quote (make docs reads them): allreduce
# 8 B..256 MiB with every ringcomm algorithm and its automatic choice against gloo, the other
# collectives, DDP training and the peak memory of a 256 MiB allreduce, at worlds 2 and 4
# (about 15 minutes on 2 cores).
RESULTS := bench/results
bench: $(STAMP)
	$(VENV)/bin/ringcomm bench --collectives allreduce -n 2 4 -b 8 -e 256M -f 2 --reps 9 \
		--json $(RESULTS)/allreduce.json --plot-dir $(RESULTS)/plots
	$(VENV)/bin/ringcomm bench --collectives allgather reduce_scatter broadcast alltoall \
		-n 2 4 -b 8 -e 64M -f 8 --json $(RESULTS)/collectives.json --plot-dir $(RESULTS)/plots
	$(VENV)/bin/ringcomm bench ddp -n 2 4 --json $(RESULTS)/ddp.json
	$(PY) -m ringcomm_bench.peak_memory --world-sizes 2 4 --mib 256 --json $(RESULTS)/peak_memory.json

bench-quick: $(STAMP)
	$(VENV)/bin/ringcomm bench --quick

# Small allreduces with the floors under them, beside MPICH (the mpi extra: pip install -e
# '.[mpi]'), and where DDP's added time goes (docs/benchmarks.md; about 4 minutes on 2 cores).
bench-small: $(STAMP)
	$(VENV)/bin/ringcomm bench --collectives allreduce -n 2 4 -b 8 -e 16M -f 8 --reps 9 \
		--backends ringcomm ringcomm/torch gloo floor/torch floor/ringcomm --peers mpi \
		--json $(RESULTS)/small_messages.json --plot-dir $(RESULTS)/plots/small_messages
	$(VENV)/bin/ringcomm bench ddp -n 2 4 --json $(RESULTS)/ddp_phases.json

# The one command for a GPU machine (docs/gpu.md): probes, the tests marked gpu (in parallel
# workers, each outcome streamed) and a short device benchmark, without and with MPS, into
# bench/results/gpu.json and gpu_check.log, in under 8 minutes. It installs nothing (brought
# wheels go to a private folder), so it needs no venv: it uses this one where there is one,
# else python3. FAKE=1: the same against the fake runtime. QUICK=1: under 4 minutes (the same
# tests, no tune step, a shorter benchmark).
GPU_PYTHON ?= $(if $(wildcard $(PY)),$(PY),$(PYTHON))
gpu-check:
	PYTHON=$(GPU_PYTHON) bench/gpu_check.sh $(if $(FAKE),--fake) $(if $(QUICK),--quick)

clean:
	rm -rf $(VENV) $(NVRTC_VENV) build *.egg-info ringcomm/transport/*.so
