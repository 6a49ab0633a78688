"""What the engine reports: per optimizer step (``last_step_stats``), the latest commit round, and totals.

Pure Python: it only reads the ``RoundResult`` of each round waited for."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from hf_acco.engine.schedule import RoundKind

if TYPE_CHECKING:
    from hf_acco.engine.rounds import RoundResult

TOTALS = ("steps", "micro_batches", "weight", "wait_s", "round_s", "skipped_steps", "global_micro_batches")


class EngineStats:
    """Rounds waited for and steps ended, as seen by this rank's main thread."""

    def __init__(self) -> None:
        self.last_step_stats: dict[str, float] = {}
        self.last_commit: RoundResult | None = None  # the latest commit round waited for
        # since the start: this rank's steps and micro-batches; every commit round's global micro-batches and this
        # rank's weight in it
        self.totals = dict.fromkeys(TOTALS, 0.0)
        self.wait_s = 0.0  # exposed communication of the current step
        self._rounds: list[RoundResult] = []  # finished during the current step

    def round_finished(self, result: RoundResult) -> bool:
        """Count a round's result once (``wait()`` may return the same one again). Whether it was new."""
        if self._rounds and self._rounds[-1] is result:
            return False
        self._rounds.append(result)
        if result.kind is RoundKind.COMMIT:
            self.last_commit = result
            self.totals["skipped_steps"] += float(result.skipped)
            self.totals["global_micro_batches"] += result.micro_batches
            self.totals["weight"] += result.local_weight
        return True

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to log as the uninterrupted one does: the latest commit round (its grad norm and
        global micro-batches are logged at the next step) and the counts that add up the whole run."""
        last = None
        if self.last_commit is not None:  # (this rank's weight in it is not saved: checkpoints stay readable by the
            last = {**dataclasses.asdict(self.last_commit), "kind": self.last_commit.kind.value}  # versions before it)
            last.pop("local_weight")
        return {"last_commit": last, **{k: self.totals[k] for k in ("skipped_steps", "global_micro_batches")}}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        from hf_acco.engine.rounds import RoundResult  # here: rounds imports torch, and this module stays pure Python

        if not state:  # a checkpoint written before these were saved
            return
        last = state.get("last_commit")
        if last is not None:  # the fields this version knows (a newer one may save more)
            known = {f.name for f in dataclasses.fields(RoundResult)}
            last = {k: v for k, v in last.items() if k in known}
        self.last_commit = None if last is None else RoundResult(**{**last, "kind": RoundKind(last["kind"])})
        for key in ("skipped_steps", "global_micro_batches"):
            self.totals[key] = float(state.get(key, 0.0))

    def step_ended(self, step: int, micro_batches: int) -> None:
        rounds, self._rounds = self._rounds, []
        commit = [r for r in rounds if r.kind is RoundKind.COMMIT]
        self.last_step_stats = {
            "step": float(step),
            "micro_batches": float(micro_batches),
            "wait_s": self.wait_s,
            "round_s": sum(r.seconds for r in rounds),
        }
        if commit:  # the commit round that finished during this step (the previous step's, except for sync); its
            self.last_step_stats.update(  # weights come from the round, which reads a weight kept on the device
                weight=commit[-1].local_weight,
                global_micro_batches=float(commit[-1].micro_batches),
                global_weight=commit[-1].weight,
                grad_norm=commit[-1].grad_norm,
            )
        for key, value in (
            ("steps", 1.0),
            ("micro_batches", micro_batches),
            ("wait_s", self.wait_s),
            ("round_s", self.last_step_stats["round_s"]),
        ):
            self.totals[key] += value
        self.wait_s = 0.0
