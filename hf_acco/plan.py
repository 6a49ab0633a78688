"""``python -m hf_acco.plan``: will ACCO help on my cluster? The planner lives in ``hf_acco/tools/plan/``."""

from hf_acco.tools.plan.cli import main


def cli() -> None:
    """The console script (``hf-acco-plan``): main's return value is for callers in Python, not an exit status."""
    main()


if __name__ == "__main__":
    cli()
