"""``python -m hf_acco.plan``: see cli.py."""

from .cli import main

main()
