.PHONY: style quality test test-slow test-gpu bench

PY ?= python3

style:
	ruff format hf_acco tests recipes benchmarks
	ruff check --fix hf_acco tests recipes benchmarks

quality:
	ruff format --check hf_acco tests recipes benchmarks
	ruff check hf_acco tests recipes benchmarks

test:
	$(PY) -m pytest -q

test-slow:
	$(PY) -m pytest -q -m slow

test-gpu:
	$(PY) -m pytest -q -m gpu tests/test_gpu.py
