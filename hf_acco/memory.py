"""``python -m hf_acco.memory``: the per-rank memory of every buffer (the report: ``hf_acco/tools/memory.py``)."""

from hf_acco.tools.memory import main

if __name__ == "__main__":
    main()
