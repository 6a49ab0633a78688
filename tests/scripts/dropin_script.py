"""Models where DDP leaves parameters or buffers alone, trained by Trainer (DDP) or ACCOTrainer on forked ranks.

* ``towers``: two towers; tower B runs only on micro-batches that hold a row flagged ``use_b`` (``--use_b`` is the
  fraction of such rows: 0 means never), so its parameters get no gradient on some ranks, some steps or all;
* ``experts``: a mixture of experts written as a ModuleList with a top-1 router: an expert that receives no row
  gets no gradient;
* ``mixtral``: transformers' Mixtral, whose experts are one fused tensor: an expert without a token gets zeros in a
  gradient that exists, so DDP and ACCO step the whole tensor;
* ``batchnorm``: a BatchNorm1d network, whose running statistics DDP broadcasts from rank 0
  (``ddp_broadcast_buffers``).

Each run returns every parameter and buffer, the loss curve, the eval loss, and which micro-batches used tower B.
"""

from __future__ import annotations

import json
import os

import torch
from datasets import Dataset
from transformers import MixtralConfig, MixtralForCausalLM, Trainer, TrainingArguments

from hf_acco import ACCOConfig, ACCOTrainer

FEATURES = 8


class TwoTowers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tower_a = torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        self.tower_b = torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        self.used_b: list[bool] = []  # per training micro-batch of this rank

    def forward(self, x: torch.Tensor, labels: torch.Tensor, use_b: torch.Tensor) -> dict:
        out = self.tower_a(x).squeeze(-1)
        used = bool(use_b.any())
        if used:  # tower B only where asked: otherwise it is not in the graph and gets no gradient
            out = out + self.tower_b(x).squeeze(-1) * use_b
        if self.training and torch.is_grad_enabled():
            self.used_b.append(used)
        return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}


class ExpertsMoE(torch.nn.Module):
    """A mixture of experts as many custom models write it: a ModuleList of experts, a top-1 router, and only the
    experts that receive a row run (an expert without a row gets no gradient)."""

    def __init__(self, experts: int = 6) -> None:
        super().__init__()
        self.router = torch.nn.Linear(FEATURES, experts)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(FEATURES, 1) for _ in range(experts))
        self.hit: list[list[int]] = []  # per training micro-batch of this rank: the experts that got a row

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict:
        gate = torch.softmax(self.router(x), dim=-1)
        choice = gate.argmax(-1)
        out = torch.zeros_like(labels)
        hit = sorted(set(choice.tolist()))
        for e in hit:
            rows = choice == e
            out = out.index_put((rows.nonzero().squeeze(-1),), self.experts[e](x[rows]).squeeze(-1) * gate[rows, e])
        if self.training and torch.is_grad_enabled():
            self.hit.append(hit)
        return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}


class BatchNormNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(FEATURES, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 1)
        )

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict:
        out = self.net(x).squeeze(-1)
        return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}


class Combined(torch.nn.Module):
    """A BatchNorm network and two towers under one forward (one module to wrap in DDP)."""

    def __init__(self) -> None:
        super().__init__()
        self.bn, self.towers = BatchNormNet(), TwoTowers()

    def forward(self, x: torch.Tensor, labels: torch.Tensor, use_b: torch.Tensor) -> dict:
        loss = self.bn(x, labels)["loss"] + self.towers(x, labels, use_b)["loss"]
        return {"loss": loss}


def tabular(n: int, seed: int, use_b: float) -> Dataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, FEATURES, generator=g)
    labels = torch.tanh(x[:, 0] - 2 * x[:, 1]) + 0.1 * x[:, 2:].sum(-1)
    flags = (torch.rand(n, generator=g) < use_b).float()
    return Dataset.from_dict({"x": x.tolist(), "labels": labels.tolist(), "use_b": flags.tolist()})


def tokens(n: int, seed: int, vocab: int, seq: int) -> Dataset:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (n, seq), generator=g)
    return Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})


def build(kind: str, use_b: float) -> tuple[torch.nn.Module, Dataset, Dataset]:
    torch.manual_seed(0)
    if kind == "towers":
        return TwoTowers(), tabular(96, 1, use_b), tabular(16, 2, use_b)
    if kind == "batchnorm":
        data = tabular(96, 1, 0.0).remove_columns("use_b")
        return BatchNormNet(), data, tabular(32, 2, 0.0).remove_columns("use_b")
    if kind == "experts":
        return ExpertsMoE(), tabular(96, 1, 0.0).remove_columns("use_b"), tabular(16, 2, 0.0).remove_columns("use_b")
    if kind == "mixtral":
        config = MixtralConfig(vocab_size=32, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                               num_attention_heads=2, num_key_value_heads=2, num_local_experts=16,
                               num_experts_per_tok=2, max_position_embeddings=8, router_aux_loss_coef=0.0)  # fmt: skip
        return MixtralForCausalLM(config), tokens(96, 1, 32, 3), tokens(8, 2, 32, 3)
    raise ValueError(kind)


def run(rank: int, world_size: int, out: str, kind: str, acco: bool, extra: dict, use_b: float = 0.0) -> dict:
    model, train, valid = build(kind, use_b)
    settings = dict(
        output_dir=out, per_device_train_batch_size=2, per_device_eval_batch_size=4, gradient_accumulation_steps=2,
        learning_rate=1e-2, weight_decay=0.1, max_steps=12, logging_steps=1, eval_strategy="no", save_strategy="no",
        report_to=[], use_cpu=True, seed=0, disable_tqdm=True, ddp_find_unused_parameters=True,
        max_grad_norm=1.0,
    )  # fmt: skip
    args = (ACCOConfig if acco else TrainingArguments)(**{**settings, **extra})
    trainer = (ACCOTrainer if acco else Trainer)(model=model, args=args, train_dataset=train, eval_dataset=valid)
    trainer.train()
    eval_loss = trainer.evaluate()["eval_loss"]
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "buffers": {n: b.detach().clone() for n, b in model.named_buffers()},
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "eval_loss": eval_loss,
        "used_b": list(getattr(model, "used_b", [])),
        "hit": list(getattr(model, "hit", [])),
        "boundary_copy": None if getattr(trainer, "acco", None) is None else trainer.acco._boundary.copy is not None,
        "rank": int(os.environ.get("RANK", rank)),
    }


if __name__ == "__main__":  # for a look by hand: python tests/scripts/dropin_script.py towers
    import sys

    print(json.dumps(run(0, 1, "/tmp/dropin", sys.argv[1], acco=False, extra={})["losses"]))
