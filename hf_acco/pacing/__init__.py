"""Paced accumulation, for ranks of unequal speed (imports torch only): ``claims`` (micro-batches claimed from the
c10d store, every sample once per epoch at any speeds) and ``pacer.Pacer`` (steps of one global batch of claimed
micro-batches, ending the engine's halves and steps where the claims cross them)."""
