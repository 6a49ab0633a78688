"""Make tests/trainer_acco/: a copy of tests/trainer/ where every `from transformers import ...` statement that
binds Trainer or TrainingArguments (module level, inside `if is_torch_available():`, or inside a function) loses
those names and is followed by `from acco_swap import Trainer, TrainingArguments` (only the names it had).
Everything else is byte-for-byte the same; trainer_test_utils.py (get_regression_trainer,
RegressionTrainingArguments, CustomDataloaderTrainer) is swapped the same way."""

import ast
import os
import shutil

SRC, DST = "tests/trainer", "tests/trainer_acco"  # under tests/: transformers' get_tests_dir() looks for it
SWAP = {"Trainer", "TrainingArguments"}


def swap_source(src: str) -> tuple[str, int]:
    tree = ast.parse(src)
    lines = src.splitlines(keepends=True)
    edits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "transformers" and node.level == 0:
            names = [a for a in node.names if a.name in SWAP and a.asname is None]
            if not names:
                continue
            keep = [a for a in node.names if a not in names]
            ind = " " * node.col_offset
            new = ""
            if keep:
                new += (
                    ind
                    + "from transformers import (\n"
                    + "".join(f"{ind}    {a.name}{' as ' + a.asname if a.asname else ''},\n" for a in keep)
                    + ind
                    + ")\n"
                )
            new += ind + "from acco_swap import " + ", ".join(sorted(a.name for a in names)) + "  # swapped\n"
            edits.append((node.lineno, node.end_lineno, new))
    for lo, hi, new in sorted(edits, reverse=True):
        lines[lo - 1 : hi] = [new]
    out = "".join(lines)
    ast.parse(out)
    return out, len(edits)


if __name__ == "__main__":
    shutil.rmtree(DST, ignore_errors=True)
    os.makedirs(DST)
    for name in sorted(os.listdir(SRC)):
        if not name.endswith(".py"):
            continue
        out, n = swap_source(open(os.path.join(SRC, name)).read())
        open(os.path.join(DST, name), "w").write(out)
        print(f"{name}: {n} import statement(s) swapped")
