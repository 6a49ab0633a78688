"""``python -m hf_acco.memory``: the per-rank memory of every buffer (the report: ``hf_acco/tools/memory.py``)."""

from hf_acco.tools.memory import main


def cli() -> None:
    """The console script (``hf-acco-memory``): main's return value is for callers in Python, not an exit status."""
    main()


if __name__ == "__main__":
    cli()
