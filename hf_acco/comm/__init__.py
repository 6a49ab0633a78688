"""Communication: every ``torch.distributed`` call and what goes on the wire (imports torch only).

``communicator.Communicator`` (process groups, reduce-scatter, all-gather, counts), ``exchange`` (the all-gathers per
backend), ``quant`` (int8 / int4 blocks), ``deltas`` (quantised parameter changes), ``nodes`` (machines and the
two-level layout), ``sharding`` (the flat layout: which rank owns which elements, bucket by bucket: the contract
between the engine and the wire), ``groups`` (process-group helpers the integrations share).
This is the lowest layer: it imports nothing else of hf_acco.
"""
