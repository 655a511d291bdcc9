"""The built-in workloads: models and their deterministic data, ready to train on the engine.

Each is an example of what a user brings, kept apart from the layout and engine that run
any model (``parallelism/topology.py``, ``schedule/``, ``engine.py``): a LLaMA-style
decoder split into pipeline stages (`llama`) on language-model data (`data`), and a
DLRM whose embedding tables are row-sharded over the workers (`dlrm`) on click logs
(`clicks`). Every batch is a pure function of ``(seed, step, replica, microbatch)``, so a
replacement worker recomputes exactly the data its predecessor saw. Import the
submodules; this package re-exports nothing, so importing one workload does not load
the others.
"""

__all__: list[str] = []
