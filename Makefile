.PHONY: style quality test test-kernels test-slow test-gpu gpu-check test-latest test-range bench bench-ab docs wheel-check

PY ?= python3

style:
	ruff format hf_acco tests recipes benchmarks
	ruff check --fix hf_acco tests recipes benchmarks

quality:
	ruff format --check hf_acco tests recipes benchmarks
	ruff check hf_acco tests recipes benchmarks
	$(PY) -m mypy hf_acco

test:
	$(PY) -m pytest -q

# The package as a user gets it: sdist and wheel built, the wheel installed in a new virtual environment, the first
# commands run from outside the source tree, then the sdist (CI runs it after the tests)
wheel-check:
	bash .ci/wheel_check

# The gradient hook's Triton kernels on CPU (Triton's interpreter; compiled for sm_80/sm_90 without a GPU): Triton is
# ~1 GB, so neither CI nor the `tests` extra installs it; run this after a change to engine/kernels.py or
# engine/triton_kernels.py (without Triton, tests/test_kernels.py's Triton tests skip)
test-kernels:
	$(PY) -m pip install -c constraints.txt -e ".[tests,kernels]"
	$(PY) -m pytest -q tests/test_kernels.py

test-slow:
	$(PY) -m pytest -q -m slow

test-gpu:
	$(PY) -m pytest -q -m gpu tests/test_gpu.py

# On one GPU, under 8 minutes: the GPU tier, ACCOTrainer sync / acco against Trainer on a ~1B Llama, memory against
# the report; writes benchmarks/results/gpu_check_<gpu>.json (docs/development.md: how to run it on a lent GPU)
gpu-check:
	$(PY) benchmarks/gpu_check.py

# The default suite against the newest releases (no constraints.txt), in a new virtual environment: what a newer
# transformers / accelerate / pytest breaks. torch stays pinned (the CPU wheel; an upgrade would pull a CUDA build).
# Passing? Refresh constraints.txt and hf_acco/integrations/versions.py from the pip freeze it prints.
test-latest:
	rm -rf .venv-latest && $(PY) -m venv .venv-latest
	. .venv-latest/bin/activate && python3 -m pip install torch==2.13.0 && \
		python3 -m pip install -e ".[tests]" "torch==2.13.0" && \
		python3 -m pip freeze --exclude-editable && python3 -m pytest

# The default suite against the oldest and the newest transformers / accelerate setup.cfg allows (.ci/test_range):
# before a release, and when either makes a release. PAIRS=newest for one of them.
test-range:
	PAIRS="$(or $(PAIRS),oldest newest)" bash .ci/test_range

# Before committing a change to the engine's round or step path: the headline benchmark, BASE against the working
# tree, alternated on this machine (about 12 minutes for 2 rounds). Ratios side by side; a measurement, not a test.
bench-ab:
	$(PY) benchmarks/bench_ab.py --base $(BASE) --rounds $(or $(ROUNDS),2)

# The tables of README.md and docs/ from the code and recipes/results/ (tests/test_docs.py checks they are current)
docs:
	$(PY) -m hf_acco.tools.docs
