"""The benchmark: ``python -m hf_acco.bench --help``. Statistics in ``report.py`` (pure Python), the link in
``link.py`` (network namespaces, veth, tbf), one rank's training loop in ``worker.py``."""
