"""Tools around the library: ``plan/`` (will ACCO help on my cluster? the cost model and its command), ``memory``
(per-rank bytes of every buffer), ``bench/`` (benchmarks on shaped links), ``docs`` (renders the tables of the README
and docs/), ``multiprocess`` (N local gloo ranks for tests and benchmarks). Users run them as
``python -m hf_acco.plan``, ``python -m hf_acco.memory`` and ``python -m hf_acco.bench``."""
