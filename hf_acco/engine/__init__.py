"""The engine: one ACCO optimizer step on one rank (imports torch only).

``core.ACCOOptimizer`` is the facade; ``schedule`` and ``halves`` decide when a half and a step end; ``buffers`` holds
the accumulation and round buffers; ``inflight`` and ``runner`` run one round in the background; ``rounds`` is a
round's body (counts, reduce-scatter, norm, clip, shard update, all-gather); ``optim`` is the sharded optimizer;
``shard_state`` and ``checkpoint`` save and load a rank's shard. How bytes move is ``hf_acco.comm``'s job.
"""
