"""The built-in workloads: models and their deterministic data, ready to train on the engine.

Each is an example of what a user brings, kept apart from the layout and engine that run
any model (``parallelism/topology.py``, ``schedule/``, ``engine.py``): a LLaMA-style
decoder split into pipeline stages (`llama`; its `TrainSpec` recipe, `llama_spec`) on
language-model data (`data`), a DLRM whose embedding tables are row-sharded over the
workers (`dlrm`, recipe `dlrm.spec`) on click logs (`clicks`), and a small BatchNorm CNN on
generated shape images (`shapes`: a model with buffers). Every batch is a pure function of ``(seed, step, replica, microbatch)``, so a
replacement worker recomputes exactly the data its predecessor saw. Import the
submodules; this package re-exports nothing, so importing one workload does not load
the others.
"""

__all__: list[str] = []
