"""Shared pytest setup for the copied transformers Trainer tests (plain and swapped runs).

Compatibility shim only: the stored test_trainer_evaluation.py imports GlueDataset / GlueDataTrainingArguments,
which transformers 5.24 no longer exports. They are used by one @slow test (test_trainer_eval_mrpc, skipped here);
placeholders let the module import. Nothing else of transformers is patched.
"""

import sys

from transformers import Trainer  # noqa: F401  (this import swaps sys.modules['transformers'])

transformers = sys.modules["transformers"]
for _name in ("GlueDataset", "GlueDataTrainingArguments"):
    try:
        getattr(transformers, _name)
    except (ImportError, AttributeError):
        setattr(transformers, _name, type(_name, (), {"__doc__": "placeholder: removed from transformers 5.24"}))

sys.path.insert(0, __import__("os").path.dirname(__file__))  # acco_swap.py importable


def pytest_configure(config):
    config.addinivalue_line("markers", "torch_compile_test: transformers marker")
