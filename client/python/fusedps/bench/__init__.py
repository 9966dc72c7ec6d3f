"""fusedps.bench: tools that measure a deployment, run as ``python -m fusedps.bench COMMAND``.

* e2e: trains a small GPT locally and through given servers, and prints the step time of each,
  the split of the remote step (hidden and exposed) and the link that limits it
  (fusedps/bench/e2e.py).
* fusedps.bench.gpt: the GPT it trains (examples/train_gpt.py trains it too).
* fusedps.bench.timing: where a timed loop's phases end on CUDA (both time their steps so).
"""
