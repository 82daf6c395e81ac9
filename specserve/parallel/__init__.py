"""Tensor parallelism on torch.distributed: one model over several processes (docs/tensor-parallel.md).

How a model is split lives with the models (`models/sharding.py`); here: `group.py` holds the process
groups, the collectives and the commands, `vocab.py` the vocabulary-split embedding and LM head,
`worker.py` the loop a non-driver rank runs, and `executor.py` starts the workers and drives them from
the engine.
"""
