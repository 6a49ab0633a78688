"""``python -m hf_acco.demo``: ACCOTrainer on 2 CPU ranks from the installed package; lives in
``hf_acco/tools/demo.py``."""

from hf_acco.tools.demo import main


def cli() -> None:
    """The console script (``hf-acco-demo``): main's return value is for callers in Python, not an exit status."""
    main()


if __name__ == "__main__":
    cli()
