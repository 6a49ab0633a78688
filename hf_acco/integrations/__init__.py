"""The glue to the Hugging Face stack: ``trainer/`` (``ACCOTrainer``: Trainer's step replaced), ``config``
(``ACCOConfig``, the ``acco_*`` settings), ``accelerate`` (``prepare_acco`` for hand-written loops), ``trl`` (TRL's
trainers), ``baselines`` (a fair DDP baseline), ``versions`` (the tested releases). Imports the engine, never the
tools. Nothing here is imported eagerly: ``import hf_acco`` loads no transformers."""
