"""``python -m hf_acco.plan``: will ACCO help on my cluster? The planner lives in ``hf_acco/tools/plan/``."""

from hf_acco.tools.plan.cli import main

if __name__ == "__main__":
    main()
