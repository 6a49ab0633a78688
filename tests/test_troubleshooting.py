"""docs/troubleshooting.md has an entry for every error message hf_acco raises that a user can hit.

Each ``raise`` in the package is read from its source: its message's literal text must contain a passage the page
quotes in the first column of its tables (a backticked span, split at ``...``, of at least 12 characters). What a
user cannot hit is listed below with why: internal invariants (``AssertionError``, and the few raises that guard
internal callers), maintainers' tools. A new raise fails this test until the page says what it means and what to
do, or it is listed here with a reason.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "troubleshooting.md"

# maintainers' tools: the benchmarks and the docs renderer (docs/development.md)
MAINTAINERS = ("hf_acco/tools/bench/", "hf_acco/tools/docs.py")

# (module, a passage of the raise): raised only when hf_acco's own code calls its internals wrongly, by Python's own
# protocol, or by argparse next to the option's usage line; a user's input cannot reach the others
INTERNAL = {
    ("hf_acco/__init__.py", "has no attribute"): "Python's own AttributeError for a missing name",
    ("hf_acco/comm/sharding.py", "params, names and groups"): "FlatLayout's internal arguments",
    ("hf_acco/comm/sharding.py", "world_size must be >= 1"): "the communicator gives the world size",
    ("hf_acco/comm/sharding.py", "an inconsistent layout record"): "a layout record checked after loading its shard",
    ("hf_acco/comm/sharding.py", "shards, got"): "split_to_shards' internal argument",
    ("hf_acco/comm/exchange.py", "all_gather_into:"): "buffer sizes the engine computes",
    ("hf_acco/comm/nodes.py", "no such collective to warm"): "the communicator names the collectives it warms",
    ("hf_acco/comm/quant.py", "values travel in"): "the bit widths the engine passes",
    ("hf_acco/comm/quant.py", "a packed row of"): "buffer sizes the engine computes",
    ("hf_acco/comm/deltas.py", "reads parameters in place"): "the engine's own parameter views",
    ("hf_acco/comm/transfer.py", "a member's own are copied"): "engine/reshard.py copies a member's own messages",
    ("hf_acco/pacing/claims.py", "need num_samples, batch_size"): "the Pacer checks these first",
    ("hf_acco/tools/multiprocess.py", "join(errors)"): "re-raises the ranks' own errors, listed on the page",
    ("hf_acco/tools/plan/model.py", "spelling must be"): "the planner's own two spellings",
    ("hf_acco/tools/plan/model.py", "method must be"): "the planner's own three methods",
    ("hf_acco/tools/cli_types.py", "ArgumentTypeError"): "argparse prints it after the option's usage line",
}

# raises whose message is built elsewhere: (module, the raise's expression) -> (the module that holds the text, a
# passage of it), which the page must quote
COMPUTED = {
    ("hf_acco/comm/membership.py", "gloo_failure(e)"): ("comm/nodes.py", "ACCO could not set up its gloo group"),
    ("hf_acco/comm/communicator.py", "RuntimeError(message)"): ("engine/core.py", "Ranks disagree on the trainable"),
    ("hf_acco/comm/communicator.py", "RuntimeError(elsewhere)"): ("engine/core.py", "Another rank could not load"),
    ("hf_acco/engine/checkpoint.py", "ValueError(mismatch)"): ("engine/checkpoint.py", "so each rank holds other"),
    ("hf_acco/integrations/fsdp.py", "ValueError(ONE_MACHINE)"): ("integrations/fsdp.py", "FSDP with ACCO needs"),
    ("hf_acco/integrations/config.py", "metadata['help']"): ("integrations/config.py", "Removed: it had no effect"),
    ("hf_acco/integrations/trainer/checkpoints.py", "f\"Can't find"): (
        "integrations/trainer/checkpoints.py",
        "Can't find a valid checkpoint at",
    ),
    ("hf_acco/integrations/trainer/mixin.py", "ValueError(mismatch)"): ("engine/checkpoint.py", "so each rank holds"),
    ("hf_acco/integrations/trainer/mixin.py", "checkpoints.peer_failure("): (
        "integrations/trainer/checkpoints.py",
        "Training stopped on rank",
    ),
}
MIN_QUOTE = 12


def literal_parts(node: ast.expr) -> list[str] | None:
    """The literal text of a message expression, split where a value goes in; None when it is computed."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        parts = [""]
        for value in node.values:
            if isinstance(value, ast.Constant):
                parts[-1] += str(value.value)
            else:
                parts.append("")
        return parts
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = literal_parts(node.left), literal_parts(node.right)
        if left is None or right is None:
            return None
        return left[:-1] + [left[-1] + right[0]] + right[1:]
    return None


def string_texts(path: Path) -> list[str]:
    """Every string literal (f-strings with ``{}`` for their values) in a module."""
    texts = []
    for node in ast.walk(ast.parse(path.read_text())):
        parts = literal_parts(node) if isinstance(node, (ast.Constant, ast.JoinedStr)) else None
        if parts is not None:
            texts.append("{}".join(parts))
    return texts


def raises() -> list[tuple[str, int, str, ast.expr | None]]:
    """(module, line, the raised call's source, its message expression) of every raise of a call in the package."""
    found = []
    for path in sorted((ROOT / "hf_acco").rglob("*.py")):
        module = path.relative_to(ROOT).as_posix()
        if module.startswith(MAINTAINERS):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
                message = node.exc.args[0] if node.exc.args else None
                found.append((module, node.lineno, ast.unparse(node.exc), message))
    return found


def quoted_passages(page: str | None = None) -> list[str]:
    """The backticked spans in the first cell of the page's table rows (the message column), split at `...`, each
    passage at least MIN_QUOTE characters."""
    cells = re.findall(r"^\| (.+?) \|", PAGE.read_text() if page is None else page, re.M)
    spans = [span for cell in cells for span in re.findall(r"`([^`]+)`", cell)]
    return [p.strip() for span in spans for p in span.split("...") if len(p.strip()) >= MIN_QUOTE]


def test_every_error_a_user_can_hit_has_an_entry():
    passages = quoted_passages()
    missing, listed = [], set()
    for module, line, source, message in raises():
        if source.startswith("AssertionError("):
            continue
        internal = [key for key in INTERNAL if key[0] == module and key[1] in source]
        if internal:
            listed.update(internal)
            continue
        parts = None if message is None else literal_parts(message)
        if parts is None or max(map(len, parts)) < MIN_QUOTE:
            key = next((k for k in COMPUTED if k[0] == module and k[1] in source), None)
            assert key is not None, f"{module}:{line}: a computed message ({source}): add it to COMPUTED"
            listed.add(key)
            where, passage = COMPUTED[key]
            assert any(passage in text for text in string_texts(ROOT / "hf_acco" / where)), f"{key}: not in {where}"
            if any(passage in p for p in passages):  # the page may quote more of the built text
                continue
            parts = [passage]
        if not any(p in part for part in parts for p in passages):
            missing.append(f"{module}:{line}: {'{}'.join(parts)[:100]!r}")
    assert not missing, "no entry in docs/troubleshooting.md for:\n" + "\n".join(missing)
    stale = (set(INTERNAL) | set(COMPUTED)) - listed
    assert not stale, f"listed here but raised nowhere any more: {sorted(stale)}"


def test_only_the_message_column_counts_and_a_short_quote_covers_nothing():
    page = (
        "Prose with `a long quote outside any table`.\n\n| message | what to do |\n| --- | --- |\n"
        "| `Rank ... was given the optimizer shard` / `got` | set `the option in the second column` |\n"
    )
    assert quoted_passages(page) == ["was given the optimizer shard"]  # "Rank " and "got": too short to cover
    assert all(len(p) >= MIN_QUOTE for p in quoted_passages())
    # f-strings split where a value goes in, concatenations joined
    assert literal_parts(ast.parse('f"a {x} b" + "c"', mode="eval").body) == ["a ", " bc"]
