"""LAMBADA (OpenAI version) last-word accuracy and perplexity, as lm-evaluation-harness's `lambada_openai` scores it.

Load it offline from its path: ``evaluate.load(hf_acco.tasks.lambada.METRIC_PATH)``.
"""

import math

import datasets
import evaluate

_DESCRIPTION = """
Per passage, the target is one space plus the last space-separated chunk of the text, and the context is what comes
before it. The model gives `log_likelihood`, the sum of the log-probabilities of the target's tokens, and
`is_greedy`, whether every target token is the most likely token at its position.
accuracy = mean(is_greedy); perplexity = exp(-mean(log_likelihood)) over passages (a per-word perplexity).
"""

_KWARGS_DESCRIPTION = """
Args:
    log_likelihood (`list[float]`): summed log-probability of each passage's target.
    is_greedy (`list[bool]`): whether each passage's target is the model's greedy continuation.
Returns:
    lambada_acc (`float`), lambada_ppl (`float`), num_docs (`int`).
Example:
    >>> metric = evaluate.load(METRIC_PATH)
    >>> metric.compute(log_likelihood=[-1.0, -3.0], is_greedy=[True, False])
    {'lambada_acc': 0.5, 'lambada_ppl': 7.38905609893065, 'num_docs': 2}
"""

_CITATION = """
@misc{paperno2016lambada, title={The LAMBADA dataset: Word prediction requiring a broad discourse context},
      author={Paperno, Denis and others}, year={2016}, eprint={1606.06031}, archivePrefix={arXiv}}
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class LambadaOpenai(evaluate.Metric):
    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {"log_likelihood": datasets.Value("float64"), "is_greedy": datasets.Value("bool")}
            ),
            reference_urls=["https://github.com/EleutherAI/lm-evaluation-harness"],
        )

    def _compute(self, log_likelihood: list[float], is_greedy: list[bool]) -> dict:
        if not log_likelihood:
            raise ValueError("No passage was scored: the LAMBADA data is empty.")
        n = len(log_likelihood)
        return {
            "lambada_acc": sum(bool(g) for g in is_greedy) / n,
            "lambada_ppl": math.exp(-sum(log_likelihood) / n),
            "num_docs": n,
        }
